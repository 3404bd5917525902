//! The streaming JSON scan's tests.

use super::*;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

fn ptr(text: &str) -> Pointer {
    Pointer::parse(text).expect("a pointer")
}

fn at(pointer: &str, doc: &str) -> Result<String, Unreadable> {
    number_at(&ptr(pointer), doc.as_bytes())
}

/// The same document fed in every split into two pieces, and byte by byte: one answer.
fn every_split(pointer: &str, doc: &str) -> Result<String, Unreadable> {
    let p = ptr(pointer);
    let whole = number_at(&p, doc.as_bytes());
    let bytes = doc.as_bytes();
    for cut in 0..=bytes.len() {
        let mut s = Scan::new();
        s.feed(&p, &bytes[..cut]);
        s.feed(&p, &bytes[cut..]);
        assert_eq!(
            s.finish().map(str::to_string),
            whole,
            "cut at {cut} of {doc:?}"
        );
    }
    let mut s = Scan::new();
    for b in bytes {
        s.feed(&p, std::slice::from_ref(b));
    }
    assert_eq!(
        s.finish().map(str::to_string),
        whole,
        "byte by byte: {doc:?}"
    );
    whole
}

#[test]
fn reads_the_number_at_the_pointer_however_the_document_is_cut() {
    let doc = r#"{"id":"r1","usage":{"prompt_tokens":100,"total_tokens":300},"x":[1,{"a":[]}]}"#;
    assert_eq!(every_split("/usage/total_tokens", doc), Ok("300".into()));
    assert_eq!(every_split("/usage/prompt_tokens", doc), Ok("100".into()));
    assert_eq!(every_split("/x/0", doc), Ok("1".into()));
    assert_eq!(every_split("/x/1/a", doc), Err(Unreadable::NotANumber));
    assert_eq!(every_split("/x/2", doc), Err(Unreadable::Missing));
    assert_eq!(every_split("/usage", doc), Err(Unreadable::NotANumber));
    assert_eq!(every_split("/id", doc), Err(Unreadable::NotANumber));
    assert_eq!(
        every_split("/usage/total_tokens/x", doc),
        Err(Unreadable::Missing)
    );
    assert_eq!(every_split("", " 42 "), Ok("42".into()));
    assert_eq!(every_split("", "42"), Ok("42".into()));
    assert_eq!(every_split("/0/1", "[[5, 6], 7]"), Ok("6".into()));
    let spaced = "\r\n { \"usage\" :\t{ \"total_tokens\" : 7 } } \n";
    assert_eq!(every_split("/usage/total_tokens", spaced), Ok("7".into()));
}

#[test]
fn numbers_are_kept_as_spelled() {
    for n in ["0", "5", "5.0", "0.5e1", "1e30", "-3", "1E+2", "12.5e-3"] {
        let doc = format!(r#"{{"n": {n}}}"#);
        assert_eq!(every_split("/n", &doc), Ok(n.to_string()), "{n}");
    }
    let long = "1".repeat(NUMBER_ROOM + 1);
    assert_eq!(
        at("/n", &format!(r#"{{"n":{long}}}"#)),
        Err(Unreadable::LongNumber)
    );
    for bad in [
        "01", "-", "1.", ".5", "1e", "1e+", "+1", "0x10", "1.2.3", "--1", "NaN",
    ] {
        let doc = format!(r#"{{"n": {bad}}}"#);
        assert_eq!(at("/n", &doc), Err(Unreadable::Invalid), "{bad}");
    }
}

#[test]
fn a_member_on_the_path_that_appears_twice_is_ambiguous() {
    for doc in [
        r#"{"usage":{"total_tokens":5,"total_tokens":5000}}"#,
        r#"{"usage":{"total_tokens":5},"usage":{"total_tokens":5000}}"#,
        r#"{"usage":{"total_tokens":5},"usage":1}"#,
        r#"{"usage":{},"usage":{"total_tokens":5}}"#,
        r#"{"usage":{"total_tokens":5,"total_\u0074okens":6}}"#,
    ] {
        assert_eq!(
            every_split("/usage/total_tokens", doc),
            Err(Unreadable::Repeated),
            "{doc}"
        );
    }
    // Repeats off the path are the document's business.
    let doc = r#"{"a":1,"a":2,"usage":{"x":1,"x":2,"total_tokens":9}}"#;
    assert_eq!(every_split("/usage/total_tokens", doc), Ok("9".into()));
    let doc = r#"{"usage":{"total_tokens":9},"other":{"usage":1,"usage":2}}"#;
    assert_eq!(every_split("/usage/total_tokens", doc), Ok("9".into()));
}

#[test]
fn member_names_are_compared_decoded() {
    let p = "/a~1b/c~0d/é/😀";
    let doc = r#"{"a\/b":{"c~d":{"\u00e9":{"\ud83d\ude00":12}}}}"#;
    assert_eq!(every_split(p, doc), Ok("12".into()));
    let doc = r#"{"a/b":{"c~d":{"é":{"😀":13}}}}"#;
    assert_eq!(every_split(p, doc), Ok("13".into()));
    assert_eq!(at("/ab", r#"{"a":1,"abc":2,"ab":3}"#), Ok("3".into()));
    assert_eq!(at("/", r#"{"":4}"#), Ok("4".into()));
    // An array index is digits without a leading zero; "-" is past the end.
    assert_eq!(at("/01", "[1,2]"), Err(Unreadable::Missing));
    assert_eq!(at("/-", "[1,2]"), Err(Unreadable::Missing));
    assert_eq!(at("/1", r#"{"1":8}"#), Ok("8".into()));
}

#[test]
fn anything_but_one_whole_document_is_unreadable() {
    let p = "/n";
    for doc in [
        "",
        "{",
        r#"{"n":1"#,
        r#"{"n":1}}"#,
        r#"{"n":1} {}"#,
        r#"{"n":1,}"#,
        r#"{"n":1]"#,
        r#"[1}"#,
        r#"{"n" 1}"#,
        r#"{n:1}"#,
        r#"{"n":tru}"#,
        r#"{"n":1,"s":"\x"}"#,
        r#"{"n":1,"s":"\u12"}"#,
        r#"{"n":1,"s":"\ud800"}"#,
        r#"{"n":1,"s":"\udc00"}"#,
        r#"{"n":1,"s":"\ud800\u0041"}"#,
        "{\"n\":1,\"s\":\"a\u{1}\"}",
        "\u{feff}{\"n\":1}",
    ] {
        assert!(
            matches!(
                at(p, doc),
                Err(Unreadable::Invalid | Unreadable::Incomplete)
            ),
            "{doc:?}: {:?}",
            at(p, doc)
        );
    }
    // Bytes that are not UTF-8 inside a string.
    for bad in [
        &b"\xff"[..],
        b"\xc0\x80",
        b"\xed\xa0\x80",
        b"\xf4\x90\x80\x80",
        b"\xe2\x82",
    ] {
        let mut doc = br#"{"n":1,"s":""#.to_vec();
        doc.extend_from_slice(bad);
        doc.extend_from_slice(br#""}"#);
        assert_eq!(
            number_at(&ptr(p), &doc),
            Err(Unreadable::Invalid),
            "{bad:?}"
        );
    }
    let ok = "{\"n\":1,\"s\":\"é€😀\"}";
    assert_eq!(every_split(p, ok), Ok("1".into()));
}

#[test]
fn nesting_is_limited() {
    let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
    assert_eq!(at("/0", &deep(MAX_DEPTH)), Err(Unreadable::NotANumber));
    assert_eq!(at("/0", &deep(MAX_DEPTH + 1)), Err(Unreadable::TooDeep));
    let mut path = String::new();
    let mut doc = String::new();
    for _ in 0..MAX_DEPTH - 1 {
        path.push_str("/a");
        doc.push_str(r#"{"a":"#);
    }
    doc.push('3');
    doc.push_str(&"}".repeat(MAX_DEPTH - 1));
    assert_eq!(at(&path, &doc), Ok("3".into()));
}

#[test]
fn pointers_are_parsed_by_rfc_6901() {
    assert!(Pointer::parse("usage").is_err());
    assert!(Pointer::parse("/a~2").is_err());
    assert!(Pointer::parse("/a~").is_err());
    assert_eq!(ptr("/a~01").segments[0].key, "a~1");
    assert_eq!(ptr("/").segments.len(), 1);
    assert_eq!(ptr("").segments.len(), 0);
    assert_eq!(ptr("/10").segments[0].index, Some(10));
    assert!(Pointer::parse(&"/a".repeat(MAX_DEPTH + 1)).is_err());
}

/// Mutations of real-looking documents (bytes flipped, cut, doubled, inserted), fed in two
/// pieces: the scan calls a document valid exactly when serde_json does, and reads the same
/// number at the pointer (serde_json keeps the last of a repeated member, which the scan
/// calls ambiguous instead).
#[test]
fn agrees_with_serde_json_on_mutated_documents() {
    let seeds: [&[u8]; 5] = [
            br#"{"id":"r\u00e9","usage":{"prompt_tokens":10,"total_tokens":300},"list":[1,2.5,-3e2,true,null,"\ud83d\ude00"]}"#,
            br#"[{"usage":{"total_tokens":0}},{"a":[[],{}]}]"#,
            br#"{"usage":{"total_tokens":12345678901234567890}}"#,
            b"{\"usage\" : {\"total_tokens\" : 7 } , \"s\":\"\xc3\xa9\\n\\\"\"}",
            br#"{"usage":[{"total_tokens":1}],"":{"":2}}"#,
        ];
    let pointers = [
        "/usage/total_tokens",
        "/usage/0/total_tokens",
        "/0/usage/total_tokens",
        "//",
    ];
    let mut rng: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let alphabet = b"{}[]\",:0123456789.eE+-tfnul \\/x\xc3\xa9\xff";
    for _ in 0..20_000 {
        let seed = seeds[(next() % seeds.len() as u64) as usize];
        let mut doc = seed.to_vec();
        for _ in 0..(next() % 3) {
            let at = (next() as usize) % (doc.len() + 1);
            match next() % 4 {
                0 if at < doc.len() => doc[at] = alphabet[(next() as usize) % alphabet.len()],
                1 => doc.truncate(at),
                2 if at < doc.len() => doc.insert(at, doc[at]),
                _ => doc.insert(at, alphabet[(next() as usize) % alphabet.len()]),
            }
        }
        for pointer in pointers {
            let p = ptr(pointer);
            let cut = (next() as usize) % (doc.len() + 1);
            let mut s = Scan::new();
            s.feed(&p, &doc[..cut]);
            s.feed(&p, &doc[cut..]);
            let ours = s.finish().map(str::to_string);
            let theirs = serde_json::from_slice::<serde_json::Value>(&doc);
            let shown = String::from_utf8_lossy(&doc);
            // RFC 8259 puts no bound on a number; serde_json refuses one beyond an f64.
            if theirs
                .as_ref()
                .is_err_and(|e| e.to_string().contains("number out of range"))
            {
                continue;
            }
            match (&ours, &theirs) {
                (Err(Unreadable::Invalid | Unreadable::Incomplete), Err(_)) => {}
                (Err(Unreadable::Repeated), Ok(_)) => {}
                (Ok(n), Ok(v)) => {
                    let want = v.pointer(pointer).expect("serde finds it too");
                    let got: serde_json::Value = serde_json::from_str(n).expect("a number");
                    assert_eq!(&got, want, "{shown} at {pointer}");
                }
                (Err(Unreadable::Missing), Ok(v)) => {
                    assert!(v.pointer(pointer).is_none(), "{shown} at {pointer}")
                }
                (Err(Unreadable::NotANumber), Ok(v)) => {
                    let found = v.pointer(pointer).expect("serde finds it too");
                    assert!(!found.is_number(), "{shown} at {pointer}");
                }
                (Err(Unreadable::LongNumber), Ok(v)) => {
                    assert!(v.pointer(pointer).is_some_and(|n| n.is_number()), "{shown}");
                }
                _ => panic!("{shown} at {pointer}: scan {ours:?}, serde_json {theirs:?}"),
            }
        }
    }
}

#[test]
fn the_scan_keeps_nothing_of_the_document() {
    // Its state is its size, allocated once; feeding allocates nothing.
    assert!(
        std::mem::size_of::<Scan>() <= 128,
        "{}",
        std::mem::size_of::<Scan>()
    );
    let p = ptr("/usage/total_tokens");
    let mut doc = br#"{"usage":{"total_tokens":5},"x":["#.to_vec();
    for _ in 0..10_000 {
        doc.extend_from_slice(br#"{"":0},"#);
    }
    doc.extend_from_slice(br#"{"":0}]}"#);
    let mut s = Scan::new();
    let ((), n) = crate::support::alloc_count::allocations(|| s.feed(&p, &doc));
    assert_eq!(n, 0);
    assert_eq!(s.finish(), Ok("5"));
}

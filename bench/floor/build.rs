//! Writes `footprint.rs` into OUT_DIR: `CODE`, 512 distinct functions of 24 arithmetic steps on
//! a `u64` each (constants from a fixed xorshift, so every build is the same and no two
//! functions are alike), for the code-footprint anchors (src/lib.rs, `"code": n`); and
//! `SPARSE`, 512 more whose every third step is followed by a branch that never runs (the
//! value tested against a small constant it never takes), for `"sparse": true`. A sparse
//! function runs about 340 bytes of Wasm (its steps and the tests) and holds about 335 that
//! never run, interleaved with them.

use std::fmt::Write;

const FUNCTIONS: usize = 512;
const STEPS: usize = 24;

fn main() {
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut out = String::new();
    functions(&mut out, "code", "CODE", false, &mut next);
    // The branch calls out (`cold`, which keeps it a branch: a select would run it).
    out.push_str("#[inline(never)]\nfn cold(x: u64) -> u64 {\n    std::hint::black_box(x)\n}\n");
    functions(&mut out, "sparse", "SPARSE", true, &mut next);
    let dir = std::env::var("OUT_DIR").unwrap_or_else(|_| ".".into());
    if let Err(e) = std::fs::write(std::path::Path::new(&dir).join("footprint.rs"), out) {
        panic!("cannot write footprint.rs: {e}");
    }
}

/// [`FUNCTIONS`] functions `<name><i>` and the static `<array>` of them; `sparse`: each third
/// step followed by a branch that never runs.
fn functions(
    out: &mut String,
    name: &str,
    array: &str,
    sparse: bool,
    next: &mut impl FnMut() -> u64,
) {
    for f in 0..FUNCTIONS {
        let _ = writeln!(out, "#[inline(never)]\nfn {name}{f}(mut x: u64) -> u64 {{");
        for s in 0..STEPS {
            let r = next();
            let _ = match r % 4 {
                0 => writeln!(out, "    x = x.wrapping_add({:#x});", r | 1),
                1 => writeln!(out, "    x = x.wrapping_mul({:#x});", r | 1),
                2 => writeln!(out, "    x = x.rotate_left({});", 1 + r % 63),
                _ => writeln!(out, "    x ^= {:#x};", r),
            };
            if sparse && s % 3 == 2 {
                let (k, c, d) = (next() % 0x10_0000, next() | 1, next());
                let _ = writeln!(
                    out,
                    "    if x == {k:#x} {{ x = cold(x).wrapping_mul({c:#x}) ^ cold(x ^ {d:#x}); }}"
                );
            }
        }
        out.push_str("    x\n}\n");
    }
    let _ = write!(out, "pub static {array}: [fn(u64) -> u64; {FUNCTIONS}] = [");
    for f in 0..FUNCTIONS {
        let _ = write!(out, "{name}{f}, ");
    }
    out.push_str("];\n");
}

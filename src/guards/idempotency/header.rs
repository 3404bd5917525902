//! The `Idempotency-Key` header (draft-ietf-httpapi-idempotency-key-header): an RFC 9651
//! sf-string (`"8e03978e-40d5-43e8"`); the bare token form clients send in practice is
//! accepted too. The key is 1..=255 printable ASCII characters.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyError {
    Missing,
    /// More than one header line: ambiguous, so refused.
    Repeated,
    Malformed,
    TooLong,
    Empty,
}

impl KeyError {
    pub(crate) fn detail(self, header: &str) -> String {
        match self {
            KeyError::Missing => format!("this operation requires an {header} header"),
            KeyError::Repeated => format!("the {header} header must appear once"),
            KeyError::Malformed => format!(
                "the {header} header must be a structured-field string (\"...\") or token of printable ASCII"
            ),
            KeyError::TooLong => format!("the {header} header must be at most 255 characters"),
            KeyError::Empty => format!("the {header} header must not be empty"),
        }
    }
}

pub(crate) const MAX_KEY_LEN: usize = 255;

/// Parses the header's values (every line with that name) into the client's key.
pub(crate) fn parse_key(values: &[&str]) -> Result<String, KeyError> {
    let raw = match values {
        [] => return Err(KeyError::Missing),
        [one] => one.trim_matches(|c| c == ' ' || c == '\t'),
        _ => return Err(KeyError::Repeated),
    };
    let key = if let Some(inner) = raw.strip_prefix('"') {
        sf_string(inner)?
    } else {
        if raw.is_empty() {
            return Err(KeyError::Empty);
        }
        if !raw
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\\' && b != b',')
        {
            return Err(KeyError::Malformed);
        }
        raw.to_string()
    };
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong);
    }
    Ok(key)
}

/// The rest of an sf-string after its opening quote; nothing may follow the closing quote.
fn sf_string(inner: &str) -> Result<String, KeyError> {
    let mut out = String::with_capacity(inner.len());
    let mut bytes = inner.bytes();
    while let Some(b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(c @ (b'"' | b'\\')) => out.push(char::from(c)),
                _ => return Err(KeyError::Malformed),
            },
            b'"' => {
                return if bytes.next().is_none() {
                    Ok(out)
                } else {
                    Err(KeyError::Malformed)
                };
            }
            0x20..=0x7e => out.push(char::from(b)),
            _ => return Err(KeyError::Malformed),
        }
    }
    Err(KeyError::Malformed)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn keys() {
        let long = "a".repeat(255);
        let too_long = "a".repeat(256);
        let quoted_long = format!("\"{too_long}\"");
        let cases: Vec<(&str, Vec<&str>, Result<String, KeyError>)> = vec![
            (
                "sf_string",
                vec!["\"8e03978e-40d5-43e8\""],
                Ok("8e03978e-40d5-43e8".into()),
            ),
            (
                "token",
                vec!["8e03978e-40d5-43e8"],
                Ok("8e03978e-40d5-43e8".into()),
            ),
            ("surrounding_space", vec!["  \"abc\" "], Ok("abc".into())),
            ("escapes", vec![r#""a\"b\\c""#], Ok(r#"a"b\c"#.into())),
            ("inner_space", vec!["\"a b\""], Ok("a b".into())),
            ("max_len", vec![long.as_str()], Ok(long.clone())),
            ("missing", vec![], Err(KeyError::Missing)),
            ("repeated", vec!["a", "b"], Err(KeyError::Repeated)),
            ("empty_token", vec![""], Err(KeyError::Empty)),
            ("empty_string", vec!["\"\""], Err(KeyError::Empty)),
            ("too_long", vec![too_long.as_str()], Err(KeyError::TooLong)),
            (
                "too_long_quoted",
                vec![quoted_long.as_str()],
                Err(KeyError::TooLong),
            ),
            ("unterminated", vec!["\"abc"], Err(KeyError::Malformed)),
            ("trailing", vec!["\"abc\";x=1"], Err(KeyError::Malformed)),
            ("bad_escape", vec![r#""a\nb""#], Err(KeyError::Malformed)),
            ("non_ascii", vec!["\"clé\""], Err(KeyError::Malformed)),
            ("token_space", vec!["a b"], Err(KeyError::Malformed)),
            ("token_list", vec!["a,b"], Err(KeyError::Malformed)),
            ("control", vec!["\"a\u{7}b\""], Err(KeyError::Malformed)),
        ];
        for (name, values, want) in cases {
            assert_eq!(parse_key(&values), want, "case {name}");
        }
    }
}

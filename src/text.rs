//! Text building blocks shared by keys, headers and bodies: decimal numbers and hex, written
//! into an existing buffer (no intermediate strings on the request path).

/// Appends `n` in decimal.
pub fn push_u64(out: &mut String, n: u64) {
    let mut digits = [0u8; 20];
    for &d in decimal(n, &mut digits) {
        out.push(char::from(d));
    }
}

/// [`push_u64`] onto bytes.
pub fn push_u64_bytes(out: &mut Vec<u8>, n: u64) {
    let mut digits = [0u8; 20];
    out.extend_from_slice(decimal(n, &mut digits));
}

/// The decimal digits of `n`, written at the end of `digits`.
pub fn decimal(mut n: u64, digits: &mut [u8; 20]) -> &[u8] {
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    &digits[at..]
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    push_hex(&mut out, bytes);
    out
}

/// Appends the lower-case hex of `bytes`.
pub fn push_hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for b in bytes {
        out.push(DIGITS[usize::from(b >> 4)] as char);
        out.push(DIGITS[usize::from(b & 0x0f)] as char);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_u64_writes_decimal() {
        for n in [0, 1, 9, 10, 99, 100, 3_600_000, u64::MAX - 1, u64::MAX] {
            let mut out = String::from("x");
            push_u64(&mut out, n);
            assert_eq!(out, format!("x{n}"));
        }
    }

    #[test]
    fn push_u64_bytes_writes_decimal() {
        for n in [0, 7, 10, 429, u64::MAX] {
            let mut out = b"x".to_vec();
            push_u64_bytes(&mut out, n);
            assert_eq!(out, format!("x{n}").into_bytes());
        }
    }

    #[test]
    fn hex_encoding() {
        assert_eq!(hex(&[0x00, 0x0f, 0xa5, 0xff]), "000fa5ff");
        assert_eq!(hex(&[]), "");
    }
}

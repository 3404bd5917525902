//! Writes `footprint.rs` into OUT_DIR: `CODE`, 512 distinct functions of 24 arithmetic steps on
//! a `u64` each (constants from a fixed xorshift, so every build is the same and no two
//! functions are alike), for the code-footprint anchors (src/lib.rs, `"code": n`).

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
    for f in 0..FUNCTIONS {
        let _ = writeln!(out, "#[inline(never)]\nfn code{f}(mut x: u64) -> u64 {{");
        for _ in 0..STEPS {
            let r = next();
            let _ = match r % 4 {
                0 => writeln!(out, "    x = x.wrapping_add({:#x});", r | 1),
                1 => writeln!(out, "    x = x.wrapping_mul({:#x});", r | 1),
                2 => writeln!(out, "    x = x.rotate_left({});", 1 + r % 63),
                _ => writeln!(out, "    x ^= {:#x};", r),
            };
        }
        out.push_str("    x\n}\n");
    }
    let _ = write!(out, "pub static CODE: [fn(u64) -> u64; {FUNCTIONS}] = [");
    for f in 0..FUNCTIONS {
        let _ = write!(out, "code{f}, ");
    }
    out.push_str("];\n");
    let dir = std::env::var("OUT_DIR").unwrap_or_else(|_| ".".into());
    if let Err(e) = std::fs::write(std::path::Path::new(&dir).join("footprint.rs"), out) {
        panic!("cannot write footprint.rs: {e}");
    }
}

//! `cg-admin`: the operator's tool. See `coordination_guard::admin` and docs/admin.md.

// cargo builds every binary for the filter's target too: there this one only says where it runs.
#[cfg(target_arch = "wasm32")]
fn main() -> std::process::ExitCode {
    eprintln!("cg-admin runs on the host: cargo run --bin cg-admin -- COMMAND");
    std::process::ExitCode::from(2)
}

#[cfg(not(target_arch = "wasm32"))]
fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::ExitCode::from(coordination_guard::admin::main(&args))
}

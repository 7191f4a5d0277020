//! `cargo xtask`: the project's automation entry point.

mod certs;
mod dist;
mod e2e;
mod grpc_health;
mod helm;
mod repo;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("certs") => certs::run(&args[1..]),
        Some("dist") => dist::run(&args[1..]),
        Some("e2e") => e2e::run(&args[1..]),
        Some("helm") => helm::run(&args[1..]),
        _ => anyhow::bail!("usage: cargo xtask <certs|dist|e2e|helm> [options]"),
    }
}

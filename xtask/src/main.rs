//! `cargo xtask`: the project's automation entry point.

mod alerts;
mod bench;
mod certs;
mod demo;
mod dist;
mod docs;
mod e2e;
mod fuzz;
mod grpc_health;
mod helm;
mod repo;
mod soak;
mod suite;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("bench") => bench::run(&args[1..]),
        Some("certs") => certs::run(&args[1..]),
        Some("demo") => demo::run(&args[1..]),
        Some("dist") => dist::run(&args[1..]),
        Some("docs") => docs::run(&args[1..]),
        Some("e2e") => e2e::run(&args[1..]),
        Some("fuzz") => fuzz::run(&args[1..]),
        Some("helm") => helm::run(&args[1..]),
        Some("soak") => soak::run(&args[1..]),
        Some("test") => suite::run(&args[1..]),
        _ => {
            anyhow::bail!(
                "usage: cargo xtask <test|demo|bench|certs|dist|docs|e2e|helm|soak> [options]"
            )
        }
    }
}

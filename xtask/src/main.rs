//! `cargo xtask`: the project's automation entry point.

mod dist;
mod grpc_health;
mod helm;
mod repo;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("dist") => dist::run(&args[1..]),
        Some("helm") => helm::run(&args[1..]),
        _ => anyhow::bail!("usage: cargo xtask <dist|helm> [options]"),
    }
}

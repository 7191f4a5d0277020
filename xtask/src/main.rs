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
#[cfg(test)]
mod modules;
mod repo;
mod soak;
mod suite;

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match dispatch(&args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // The whole chain first (it may carry long process logs), then each cause on one
            // short line, so the end of the output always says what failed.
            eprintln!("error: {e:#}");
            eprintln!(
                "\nxtask {} failed:",
                args.first().map_or("", String::as_str)
            );
            for cause in e.chain() {
                eprintln!("  - {}", headline(&cause.to_string()));
            }
            std::process::ExitCode::FAILURE
        }
    }
}

/// The first line of `text`, at most 300 characters.
fn headline(text: &str) -> String {
    let line = text.lines().next().unwrap_or_default();
    match line.char_indices().nth(300) {
        Some((cut, _)) => format!("{}…", &line[..cut]),
        None => line.to_owned(),
    }
}

fn dispatch(args: &[String]) -> anyhow::Result<()> {
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

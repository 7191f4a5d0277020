//! `bigfleet-loadgen`: the load generator as a program of its own, for an operator who
//! benchmarks a deployment without the repository (`--help` lists scenarios and flags).

use std::process::ExitCode;

fn main() -> ExitCode {
    let mut argv = std::env::args();
    let program = argv.next().unwrap_or_else(|| "bigfleet-loadgen".to_owned());
    let args: Vec<String> = argv.collect();
    // The floor server is this program again, found where this one runs from.
    let exe = std::env::current_exe().map_or(program, |exe| exe.display().to_string());
    match loadgen::run(&args, &[exe]) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

//! `cargo xtask bench`: the load generator of `crates/loadgen` (`bigfleet-loadgen`) with the
//! same flags, run from the repository, and the one scenario that needs the repository:
//! `--scenario cloud-budget` counts the cloud API requests of both providers' real backends
//! against their emulators (`bench/cloud_budget.rs`).
//!
//! An unoptimised client spends more CPU per call than the provider does, and then it, not the
//! provider, sets the latencies; so a debug build of xtask runs the optimised build instead:
//! `bigfleet-loadgen` for the load, this tool for cloud-budget (whose emulators run in this
//! process and serve thousands of hosts per listing).

mod cloud_budget;

use anyhow::{Context, Result, bail};
pub(crate) use loadgen::{args, procfs, report, tail};

use self::args::Parsed;

pub(crate) fn run(args: &[String]) -> Result<()> {
    let exe = std::env::current_exe().context("locate the xtask executable")?;
    let program = [exe.display().to_string(), "bench".to_owned()];
    if args.first().map(String::as_str) == Some(loadgen::FLOOR_FLAG) {
        return loadgen::run(args, &program);
    }
    match args::parse(args)? {
        Parsed::Help => loadgen::run(args, &program),
        Parsed::CloudBudget(_) if cfg!(debug_assertions) => {
            rerun_optimised("xtask", &["bench"], args)
        }
        Parsed::CloudBudget(options) => cloud_budget::run(&options),
        Parsed::Run(_) if cfg!(debug_assertions) => rerun_optimised("bigfleet-loadgen", &[], args),
        Parsed::Run(_) => loadgen::run(args, &program),
    }
}

/// Where the optimised client is built: a target directory of its own, so building it never
/// replaces (or waits to link) the release binaries being measured, and without the release
/// profile's link-time optimisation, which makes the client no faster but its build slower.
const CLIENT_TARGET_DIR: &str = "target/bench-client";

/// Runs the optimised build of `binary` (of xtask or of loadgen) with `command` and `args`.
fn rerun_optimised(binary: &str, command: &[&str], args: &[String]) -> Result<()> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let root = crate::repo::root();
    eprintln!("bench: building and running the optimised {binary} ({CLIENT_TARGET_DIR})");
    // The working directory stays the caller's, so relative paths in the arguments hold.
    let status = std::process::Command::new(cargo)
        .args([
            "run",
            "--release",
            "--quiet",
            "--bin",
            binary,
            "--manifest-path",
        ])
        .arg(root.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(root.join(CLIENT_TARGET_DIR))
        .arg("--")
        .args(command)
        .args(args)
        .env("CARGO_PROFILE_RELEASE_LTO", "false")
        .env("CARGO_PROFILE_RELEASE_CODEGEN_UNITS", "16")
        .env_remove("CARGO_TARGET_DIR")
        .status()
        .context("run cargo")?;
    if !status.success() {
        bail!("the optimised bench exited with {status}");
    }
    Ok(())
}

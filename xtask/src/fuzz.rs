//! `cargo xtask fuzz [--seconds N] [--max-inputs N] [--seed 0xSEED] [--list] [TARGET...]`: runs
//! the fuzz targets of `crates/fuzz` on the stable toolchain (docs/fuzzing.md). Each target runs
//! for N seconds (default 10); the report gives per target the inputs tried and any crash with
//! its seed and shrunk input.
//!
//! The `fuzz` binary is built the way `cargo nextest run --workspace` builds it (`cargo test
//! --workspace --no-run`, dev profile), so right after the test step nothing is rebuilt, and
//! arithmetic overflow and debug assertions count as crashes.

use std::process::Command;

use anyhow::{Context, bail};

use crate::e2e::provider_process::target_binary;
use crate::repo;

pub fn run(args: &[String]) -> anyhow::Result<()> {
    let root = repo::root();
    let built = Command::new(env!("CARGO"))
        .current_dir(&root)
        .args(["test", "--workspace", "--no-run", "--quiet"])
        .status()
        .context("build the fuzz targets")?;
    if !built.success() {
        bail!("building the fuzz targets failed ({built})");
    }
    let status = Command::new(target_binary(&root, "debug", "fuzz"))
        .current_dir(&root)
        .args(args)
        .status()
        .context("run the fuzz targets")?;
    if !status.success() {
        bail!("fuzzing failed ({status}); replay a crash with the printed --seed");
    }
    Ok(())
}

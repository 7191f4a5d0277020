//! `cargo xtask fuzz [--seconds N] [--max-inputs N] [--seed 0xSEED] [--list] [TARGET...]`: runs
//! the fuzz targets of `crates/fuzz` on the stable toolchain (docs/fuzzing.md). Each target runs
//! for N seconds (default 10); the report gives per target the inputs tried and any crash with
//! its seed and shrunk input. The targets are built in the dev profile, so arithmetic overflow
//! and debug assertions count as crashes.

use std::process::Command;

use anyhow::{Context, bail};

use crate::repo;

pub fn run(args: &[String]) -> anyhow::Result<()> {
    let status = Command::new(env!("CARGO"))
        .current_dir(repo::root())
        .args(["run", "--quiet", "--package", "fuzz", "--bin", "fuzz", "--"])
        .args(args)
        .status()
        .context("run the fuzz targets")?;
    if !status.success() {
        bail!("fuzzing failed ({status}); replay a crash with the printed --seed");
    }
    Ok(())
}

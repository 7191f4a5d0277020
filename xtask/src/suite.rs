//! `cargo xtask test`: every test of the project, in order from the cheapest: the tools the
//! checks need, the unit/property/integration tests (nextest), the end-to-end run of the
//! binaries, a bounded soak of both providers against the API emulators, the Helm chart
//! validation, the docs check and the container image test.

use std::process::Command;

use anyhow::{Context, bail};

use crate::repo;

fn step(name: &str, command: &mut Command) -> anyhow::Result<()> {
    println!("xtask test: {name}");
    let status = command.status().with_context(|| format!("run {name}"))?;
    if !status.success() {
        bail!("{name} failed ({status})");
    }
    Ok(())
}

pub fn run(args: &[String]) -> anyhow::Result<()> {
    let root = repo::root();
    let quick = args.iter().any(|a| a == "--quick");
    if !quick {
        step(
            "tool setup (deploy/ci-setup.sh)",
            Command::new("bash").arg(root.join("deploy/ci-setup.sh")),
        )?;
    }
    step(
        "cargo nextest run --workspace",
        Command::new(env!("CARGO")).current_dir(&root).args([
            "nextest",
            "run",
            "--workspace",
            "--no-fail-fast",
        ]),
    )?;
    // The fuzz binary nextest just built (`cargo xtask fuzz --seconds 3` without a rebuild).
    step(
        "fuzz smoke run (every target for 3 s)",
        Command::new(crate::e2e::provider_process::target_binary(
            &root, "debug", "fuzz",
        ))
        .current_dir(&root)
        .args(["--seconds", "3"]),
    )?;
    step(
        "end-to-end (cargo xtask e2e)",
        Command::new(env!("CARGO"))
            .current_dir(&root)
            .args(["xtask", "e2e"]),
    )?;
    step(
        "soak, about a minute per cloud (cargo xtask soak --duration 60s)",
        Command::new(env!("CARGO"))
            .current_dir(&root)
            .args(["xtask", "soak", "--duration", "60s"]),
    )?;
    if quick {
        return Ok(());
    }
    step(
        "Helm charts (cargo xtask helm)",
        Command::new(env!("CARGO"))
            .current_dir(&root)
            .args(["xtask", "helm"]),
    )?;
    step(
        "docs check (cargo xtask docs)",
        Command::new(env!("CARGO"))
            .current_dir(&root)
            .args(["xtask", "docs"]),
    )?;
    step(
        "container images (cargo xtask dist --test)",
        Command::new(env!("CARGO"))
            .current_dir(&root)
            .args(["xtask", "dist", "--test"]),
    )?;
    Ok(())
}

//! A provider binary's command line, run to completion.

use std::path::Path;
use std::process::Command;

/// The standard output of `binary args`, which must exit 0.
pub fn stdout_of(binary: &Path, args: &[&str]) -> String {
    let output = Command::new(binary).args(args).output().unwrap();
    assert_eq!(output.status.code(), Some(0), "{args:?}");
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Checks that `binary`'s help lists its `check` subcommand and that `check --help` is the
/// subcommand's own (`Usage: <name> check …`); returns the latter for the cloud's own checks.
pub fn check_help(binary: &Path, name: &str) -> String {
    let top = stdout_of(binary, &["--help"]);
    assert!(
        top.lines()
            .any(|l| l.trim_start().starts_with("check ") && l.contains("Check a configuration")),
        "{top}"
    );
    let check = stdout_of(binary, &["check", "--help"]);
    assert!(
        check.contains(&format!("Usage: {name} check [OPTIONS] [SERVING FLAGS]...")),
        "{check}"
    );
    check
}

/// `binary state export --state STATE`, which must succeed: its standard output.
pub async fn state_export(binary: &Path, state: &Path) -> Vec<u8> {
    let out = tokio::process::Command::new(binary)
        .args(["state", "export", "--state"])
        .arg(state)
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "state export: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

//! `cargo xtask helm [--update-snapshots]`: renders both provider charts with Helm's own engine,
//! lints them, validates every object against the Kubernetes schemas, checks the rendered
//! Deployments against the rules the charts promise, compares the renders and the README
//! values tables with the committed copies, validates the Secret examples, and makes sure
//! bad values are refused. With the alerts and the dashboard on (the `alerts` and `full`
//! cases), the rendered rules and the dashboard are checked with promtool (`alerts.rs`). The
//! state encryption key Secret a chart generates is random, so it stays out of the snapshots
//! and is checked apart: two installs get different keys, and an upgrade keeps the key the
//! cluster already holds (the chart's `lookup`, replaced by a fake cluster answer).
//!
//! Helm and the schemas come from the Python environment that `deploy/ci-setup.sh` installs
//! (`deploy/ci/chartcheck.py` does the Helm and schema work); this module drives the cases
//! and owns the policy and the snapshots. `--update-snapshots` rewrites
//! `deploy/helm/snapshots/*.yaml` and the README tables instead of comparing them.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;

mod cases;
mod policy;

use cases::{CHARTS, REFUSALS};
use policy::{check_generated_key, check_policy};

/// Where `deploy/ci-setup.sh` puts the Python environment; `BIGFLEET_CI_PYTHON` overrides it.
const DEFAULT_PYTHON: &str = "/opt/bigfleet-ci/venv/bin/python3";
const RELEASE: &str = "bigfleet";
const NAMESPACE: &str = "bigfleet";
const TABLE_START: &str = "<!-- values-table:start -->";
const TABLE_END: &str = "<!-- values-table:end -->";
/// The template of the generated state encryption key Secret, and how it asks the cluster for
/// the Secret an earlier install created.
const KEY_TEMPLATE: &str = "templates/state-key-secret.yaml";
const KEY_LOOKUP: &str = r#"lookup "v1" "Secret" .Release.Namespace $name"#;
/// What the fake cluster holds for an upgrade: a key file of two keys (`a` and `b` 32 times),
/// base64 as in Secret data.
const EXISTING_KEY_FILE: &str =
    "YWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWE=\nYmJiYmJiYmJiYmJiYmJiYmJiYmJiYmJiYmJiYmJiYmI=\n";
const EXISTING_KEY_DATA: &str = "WVdGaFlXRmhZV0ZoWVdGaFlXRmhZV0ZoWVdGaFlXRmhZV0ZoWVdGaFlXRT0KWW1KaVltSmlZbUppWW1KaVltSmlZbUppWW1KaVltSmlZbUppWW1KaVltST0K";

pub(crate) fn run(args: &[String]) -> Result<()> {
    let mut update = false;
    for arg in args {
        match arg.as_str() {
            "--update-snapshots" => update = true,
            "-h" | "--help" => {
                println!("usage: cargo xtask helm [--update-snapshots]");
                return Ok(());
            }
            other => {
                bail!("unknown argument {other:?}; usage: cargo xtask helm [--update-snapshots]")
            }
        }
    }

    let root = crate::repo::root();
    let python = python()?;
    let scratch = root.join("target/xtask-helm");
    fs::create_dir_all(&scratch)?;
    let mut passed = 0;
    let mut stale = Vec::new();

    for chart in &CHARTS {
        let dir = root.join("deploy/helm").join(chart.name);
        for case in ["default", "alerts", "full", "ha"] {
            let values = (case != "default").then(|| dir.join(format!("ci/{case}-values.yaml")));
            let json = scratch.join(format!("{}-{case}.json", chart.name));
            let rendered = chartcheck(&python, &root, chart.name, values.as_deref(), Some(&json))
                .with_context(|| format!("chart {} with {case} values", chart.name))?;
            let objects: Vec<Value> = serde_json::from_str(&fs::read_to_string(&json)?)?;
            check_policy(chart, case, &objects)
                .with_context(|| format!("chart {} with {case} values", chart.name))?;
            if objects
                .iter()
                .any(|o| o["kind"] == "ValidatingAdmissionPolicy")
            {
                let verdicts = output(
                    Command::new(&python)
                        .arg(root.join("deploy/ci/chartcheck.py"))
                        .arg("admission-cases")
                        .arg("--json")
                        .arg(&json)
                        .args(["--namespace", NAMESPACE]),
                )
                .with_context(|| {
                    format!("chart {} with {case} values: admission policy", chart.name)
                })?;
                println!(
                    "helm: {} ({case} values): leader-label admission policy: {} patches judged as expected",
                    chart.name,
                    verdicts.lines().count()
                );
            }
            if case != "default" {
                crate::alerts::check_render(
                    &root,
                    &python,
                    chart.name,
                    case,
                    &objects,
                    &scratch,
                    case == "alerts",
                )
                .with_context(|| format!("chart {} with {case} values: alerts", chart.name))?;
            }
            let snapshot = root.join(format!("deploy/helm/snapshots/{}-{case}.yaml", chart.name));
            if !compare_or_update(&snapshot, &rendered, update)? {
                stale.push(snapshot);
            }
            println!(
                "helm: {} ({case} values): lint, render, schema and policy passed",
                chart.name
            );
            passed += 1;
        }

        check_key_generation(&python, &root, chart, &scratch)
            .with_context(|| format!("chart {}: generated state encryption key", chart.name))?;
        println!(
            "helm: {}: generated state encryption key: random per install, kept on uninstall, reused on upgrade",
            chart.name
        );
        passed += 1;

        if !crate::alerts::sync_chart_dashboard(&root, chart.name, update)? {
            stale.push(crate::alerts::chart_dashboard_path(&root, chart.name));
        }
        let exprs = crate::alerts::check_dashboard(&root, chart.name, &scratch)?;
        println!(
            "helm: {}: {exprs} dashboard expressions parse with promtool",
            chart.name
        );

        let table = output(
            Command::new(&python)
                .arg(root.join("deploy/ci/chartcheck.py"))
                .arg("values-table")
                .arg(&dir),
        )?;
        let readme = dir.join("README.md");
        if !update_readme_table(&readme, &table, update)? {
            stale.push(readme);
        }
    }

    let examples = root.join("deploy/secret");
    let mut files: Vec<PathBuf> = fs::read_dir(&examples)?
        .map(|entry| entry.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    files.retain(|path| path.to_string_lossy().ends_with(".example.yaml"));
    files.sort();
    ensure!(
        !files.is_empty(),
        "no Secret examples in {}",
        examples.display()
    );
    output(
        Command::new(&python)
            .arg(root.join("deploy/ci/chartcheck.py"))
            .arg("validate")
            .args(&files),
    )?;
    println!("helm: {} Secret examples are valid objects", files.len());
    passed += 1;

    for refusal in REFUSALS {
        let values = scratch.join(format!("refusal-{passed}.yaml"));
        fs::write(&values, refusal.values)?;
        let json = scratch.join("refusal.json");
        match chartcheck(&python, &root, refusal.chart, Some(&values), Some(&json)) {
            Ok(_) => bail!(
                "chart {} accepted {}; it must refuse it",
                refusal.chart,
                refusal.what
            ),
            Err(error) => {
                let message = format!("{error:#}");
                ensure!(
                    message.contains(refusal.message),
                    "chart {} refused {} without naming {:?}:\n{message}",
                    refusal.chart,
                    refusal.what,
                    refusal.message
                );
            }
        }
        println!("helm: {} refuses {}", refusal.chart, refusal.what);
        passed += 1;
    }

    if !stale.is_empty() {
        let list: Vec<String> = stale
            .iter()
            .map(|path| format!("  {}", path.display()))
            .collect();
        bail!(
            "out of date (see the differences above):\n{}\nrun `cargo xtask helm --update-snapshots` and review the change",
            list.join("\n")
        );
    }
    println!("helm: {passed} passed, 0 failed");
    Ok(())
}

/// The Secret a chart generates for the state encryption key, which no snapshot holds: a fresh
/// install draws a new random key each time, and an install that finds the Secret in the
/// cluster (an upgrade, or a reinstall after `keep` left it behind) reuses its data unchanged,
/// and refuses a Secret without the key rather than replacing it.
fn check_key_generation(
    python: &Path,
    root: &Path,
    chart: &cases::Chart,
    scratch: &Path,
) -> Result<()> {
    let values = scratch.join(format!("{}-generated-key.yaml", chart.name));
    fs::write(&values, "state:\n  enabled: true\n")?;
    let json = scratch.join(format!("{}-generated-key.json", chart.name));
    let render = |chart_dir: &Path| -> Result<String> {
        let mut command = Command::new(python);
        command
            .arg(root.join("deploy/ci/chartcheck.py"))
            .arg("check")
            .arg(chart_dir)
            .args(["--release", RELEASE, "--namespace", NAMESPACE])
            .arg("--values")
            .arg(&values)
            .arg("--json")
            .arg(&json);
        output(&mut command)?;
        let objects: Vec<Value> = serde_json::from_str(&fs::read_to_string(&json)?)?;
        check_generated_key(chart, &objects)
    };

    let dir = root.join("deploy/helm").join(chart.name);
    let first = render(&dir)?;
    let second = render(&dir)?;
    ensure!(
        first != second,
        "two installs generated the same key; it must be random"
    );

    let template = fs::read_to_string(dir.join(KEY_TEMPLATE))?;
    ensure!(
        template.matches(KEY_LOOKUP).count() == 1,
        "{KEY_TEMPLATE} must read the Secret of an earlier install with `{KEY_LOOKUP}`, or an upgrade would change the key"
    );
    let upgrade = scratch.join(format!("{}-upgrade", chart.name));
    let fake_cluster = |data: &str| -> Result<()> {
        if upgrade.exists() {
            fs::remove_dir_all(&upgrade)?;
        }
        copy_tree(&dir, &upgrade)?;
        let answer = format!(r#"dict "data" (dict {data})"#);
        fs::write(
            upgrade.join(KEY_TEMPLATE),
            template.replace(KEY_LOOKUP, &answer),
        )?;
        Ok(())
    };
    fake_cluster(&format!(r#""keys" "{EXISTING_KEY_DATA}""#))?;
    let kept = render(&upgrade)?;
    ensure!(
        kept == EXISTING_KEY_FILE,
        "an upgrade replaced the key file the cluster holds:\n{kept}"
    );
    fake_cluster(r#""other" "eA==""#)?;
    match render(&upgrade) {
        Ok(_) => bail!("an existing Secret without the key was overwritten"),
        Err(error) => ensure!(
            format!("{error:#}").contains("the chart never replaces a state encryption key"),
            "an existing Secret without the key was refused without saying why: {error:#}"
        ),
    }
    fs::remove_dir_all(&upgrade)?;
    Ok(())
}

fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    fs::create_dir_all(to)?;
    for entry in fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else {
            fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}

pub(crate) fn python() -> Result<PathBuf> {
    let python = std::env::var_os("BIGFLEET_CI_PYTHON")
        .map_or_else(|| PathBuf::from(DEFAULT_PYTHON), PathBuf::from);
    ensure!(
        python.exists(),
        "{} is missing: run deploy/ci-setup.sh (or set BIGFLEET_CI_PYTHON to a Python with helm-python-sdk and kubernetes-validate)",
        python.display()
    );
    Ok(python)
}

/// Runs `chartcheck.py check` and returns the `helm template` style render.
fn chartcheck(
    python: &Path,
    root: &Path,
    chart: &str,
    values: Option<&Path>,
    json: Option<&Path>,
) -> Result<String> {
    let mut command = Command::new(python);
    command
        .arg(root.join("deploy/ci/chartcheck.py"))
        .arg("check")
        .arg(root.join("deploy/helm").join(chart))
        .args(["--release", RELEASE, "--namespace", NAMESPACE]);
    if let Some(values) = values {
        command.arg("--values").arg(values);
    }
    if let Some(json) = json {
        command.arg("--json").arg(json);
    }
    output(&mut command)
}

fn output(command: &mut Command) -> Result<String> {
    let Output {
        status,
        stdout,
        stderr,
    } = command
        .output()
        .with_context(|| format!("run {command:?}"))?;
    ensure!(
        status.success(),
        "{}",
        String::from_utf8_lossy(&stderr).trim()
    );
    Ok(String::from_utf8(stdout)?)
}

/// Returns whether `path` already held `content`; with `update`, makes it so.
fn compare_or_update(path: &Path, content: &str, update: bool) -> Result<bool> {
    let current = fs::read_to_string(path).unwrap_or_default();
    if current == content {
        return Ok(true);
    }
    if update {
        fs::create_dir_all(path.parent().context("snapshot path has a parent")?)?;
        fs::write(path, content)?;
        println!("helm: updated {}", path.display());
        return Ok(true);
    }
    eprintln!(
        "helm: {} differs from the render:\n{}",
        path.display(),
        first_difference(&current, content)
    );
    Ok(false)
}

/// The first differing line of two texts, with a little context, for the failure report.
fn first_difference(expected: &str, actual: &str) -> String {
    let expected: Vec<&str> = expected.lines().collect();
    let actual: Vec<&str> = actual.lines().collect();
    let at = expected
        .iter()
        .zip(&actual)
        .take_while(|(a, b)| a == b)
        .count();
    let from = at.saturating_sub(3);
    let mut out = format!("  first difference at line {}\n", at + 1);
    for line in &expected[from..(at + 4).min(expected.len())] {
        out.push_str(&format!("  - {line}\n"));
    }
    for line in &actual[from..(at + 4).min(actual.len())] {
        out.push_str(&format!("  + {line}\n"));
    }
    out
}

/// Keeps the README's generated values table (between the markers) equal to `table`.
fn update_readme_table(readme: &Path, table: &str, update: bool) -> Result<bool> {
    let text = fs::read_to_string(readme).with_context(|| format!("read {}", readme.display()))?;
    let start = text
        .find(TABLE_START)
        .with_context(|| format!("{} has no {TABLE_START}", readme.display()))?;
    let end = text
        .find(TABLE_END)
        .with_context(|| format!("{} has no {TABLE_END}", readme.display()))?;
    let wanted = format!("{}{TABLE_START}\n{table}{}", &text[..start], &text[end..]);
    compare_or_update(readme, &wanted, update)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readme_table_is_spliced_between_markers() {
        let dir = std::env::temp_dir().join(format!("xtask-helm-readme-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let readme = dir.join("README.md");
        fs::write(
            &readme,
            format!("intro\n{TABLE_START}\nold\n{TABLE_END}\nend\n"),
        )
        .unwrap();
        assert!(!update_readme_table(&readme, "| new |\n", false).unwrap());
        assert!(update_readme_table(&readme, "| new |\n", true).unwrap());
        assert_eq!(
            fs::read_to_string(&readme).unwrap(),
            format!("intro\n{TABLE_START}\n| new |\n{TABLE_END}\nend\n")
        );
        assert!(update_readme_table(&readme, "| new |\n", false).unwrap());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn differences_are_shown() {
        let report = first_difference("a\nb\nc\n", "a\nx\nc\n");
        assert!(report.contains("line 2") && report.contains("- b") && report.contains("+ x"));
    }
}

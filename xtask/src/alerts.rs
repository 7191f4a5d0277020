//! The charts' alerts and dashboards checked with the real tools: `promtool check rules` on
//! every rendered PrometheusRule, `promtool test rules` with the chart's unit tests
//! (`deploy/helm/<provider>/ci/alerts-test.yaml`, each alert firing and staying silent), every
//! `runbook_url` anchored at a heading of the provider's troubleshooting page, the dashboard
//! ConfigMap carrying `deploy/dashboards/bigfleet-<provider>.json`, and every PromQL expression
//! of that dashboard parsed by promtool through a generated rule file. Driven by
//! `cargo xtask helm`; the live run against a real Prometheus is `e2e/alerts_live.rs`.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;

/// `promtool` from PATH (Debian's `prometheus` package, installed by deploy/ci-setup.sh).
pub(crate) fn promtool() -> Result<PathBuf> {
    which("promtool")
}

/// `prometheus` from PATH (same package).
pub(crate) fn prometheus() -> Result<PathBuf> {
    which("prometheus")
}

fn which(tool: &str) -> Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(tool))
        .find(|candidate| candidate.is_file())
        .with_context(|| {
            format!("{tool} is not installed: run deploy/ci-setup.sh (Debian package prometheus)")
        })
}

/// Runs `command` and fails with its output when it does not succeed.
fn run(command: &mut Command) -> Result<String> {
    let output = command
        .output()
        .with_context(|| format!("run {command:?}"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    ensure!(output.status.success(), "{command:?} failed:\n{text}");
    Ok(text)
}

/// The rule groups (`spec`) of the one PrometheusRule among the rendered objects.
pub(crate) fn rule_spec(objects: &[Value]) -> Result<&Value> {
    let rules: Vec<&Value> = objects
        .iter()
        .filter(|o| o["kind"] == "PrometheusRule")
        .collect();
    ensure!(
        rules.len() == 1,
        "want one PrometheusRule, got {}",
        rules.len()
    );
    Ok(&rules[0]["spec"])
}

/// Every alerting rule of a rule spec.
pub(crate) fn alerts(spec: &Value) -> Vec<&Value> {
    spec["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_array().into_iter().flatten())
        .filter(|r| r["alert"].is_string())
        .collect()
}

/// Writes a rule spec as a Prometheus rule file (JSON is YAML) and checks it with promtool.
pub(crate) fn check_rules(spec: &Value, file: &Path) -> Result<()> {
    fs::write(file, serde_json::to_vec_pretty(spec)?)
        .with_context(|| format!("write {}", file.display()))?;
    run(Command::new(promtool()?)
        .arg("check")
        .arg("rules")
        .arg(file))
    .with_context(|| format!("promtool check rules {}", file.display()))?;
    Ok(())
}

/// The checks of one chart render with the PrometheusRule and the dashboard on. `unit_tests`
/// runs the chart's promtool unit tests, which are written for the default values.
pub(crate) fn check_render(
    root: &Path,
    python: &Path,
    chart: &str,
    case: &str,
    objects: &[Value],
    scratch: &Path,
    unit_tests: bool,
) -> Result<()> {
    let spec = rule_spec(objects)?;
    let rules_file = scratch.join(format!("{chart}-{case}-rules.json"));
    check_rules(spec, &rules_file)?;
    check_runbooks(root, chart, spec)?;
    check_dashboard_configmap(root, chart, objects)?;
    if unit_tests {
        let tests = root.join(format!("deploy/helm/{chart}/ci/alerts-test.yaml"));
        let tested = tested_alerts(python, &tests)?;
        for alert in alerts(spec) {
            let name = alert["alert"].as_str().unwrap_or_default();
            let (fires, silent) = tested.get(name).copied().unwrap_or_default();
            ensure!(
                fires && silent,
                "{}: alert {name} needs a case where it fires and one where it stays silent",
                tests.display()
            );
        }
        let text =
            fs::read_to_string(&tests).with_context(|| format!("read {}", tests.display()))?;
        let with_rules = scratch.join(format!("{chart}-{case}-alerts-test.yaml"));
        fs::write(
            &with_rules,
            format!(
                "rule_files:\n  - {}\n{text}",
                serde_json::to_string(&rules_file.display().to_string())?
            ),
        )?;
        run(Command::new(promtool()?)
            .arg("test")
            .arg("rules")
            .arg(&with_rules))
        .with_context(|| format!("promtool test rules {}", tests.display()))?;
    }
    Ok(())
}

/// Alert name -> (has a case with expected alerts, has a case expecting none).
fn tested_alerts(
    python: &Path,
    tests: &Path,
) -> Result<std::collections::BTreeMap<String, (bool, bool)>> {
    let json = run(Command::new(python)
        .args([
            "-c",
            "import json, sys, yaml; json.dump(yaml.safe_load(open(sys.argv[1])), sys.stdout)",
        ])
        .arg(tests))?;
    let doc: Value = serde_json::from_str(&json)?;
    let mut tested = std::collections::BTreeMap::new();
    for case in doc["tests"].as_array().into_iter().flatten() {
        for check in case["alert_rule_test"].as_array().into_iter().flatten() {
            let name = check["alertname"].as_str().unwrap_or_default().to_owned();
            let fired = check["exp_alerts"]
                .as_array()
                .is_some_and(|a| !a.is_empty());
            let entry: &mut (bool, bool) = tested.entry(name).or_default();
            if fired {
                entry.0 = true;
            } else {
                entry.1 = true;
            }
        }
    }
    Ok(tested)
}

/// GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces as dashes.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// Every alert has a runbook_url whose anchor is a heading of the provider's troubleshooting
/// page.
fn check_runbooks(root: &Path, chart: &str, spec: &Value) -> Result<()> {
    let page = root.join(format!("docs/{chart}/troubleshooting.md"));
    let text = fs::read_to_string(&page).with_context(|| format!("read {}", page.display()))?;
    let anchors: BTreeSet<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix('#'))
        .map(|l| anchor(l.trim_start_matches('#')))
        .collect();
    for alert in alerts(spec) {
        let name = alert["alert"].as_str().unwrap_or_default();
        let url = alert["annotations"]["runbook_url"]
            .as_str()
            .with_context(|| format!("alert {name} has no runbook_url"))?;
        let (_, fragment) = url
            .split_once('#')
            .with_context(|| format!("alert {name}: runbook_url {url} has no #section"))?;
        ensure!(
            anchors.contains(fragment),
            "alert {name}: runbook_url {url} points at #{fragment}, which is no heading of {}",
            page.display()
        );
        ensure!(
            alert["annotations"]["summary"].is_string()
                && alert["annotations"]["description"].is_string(),
            "alert {name} lacks a summary or description"
        );
    }
    Ok(())
}

/// The canonical dashboard of a provider.
pub(crate) fn dashboard_path(root: &Path, chart: &str) -> PathBuf {
    root.join(format!("deploy/dashboards/bigfleet-{chart}.json"))
}

/// The chart's copy of the dashboard (Helm reads files only from inside the chart).
pub(crate) fn chart_dashboard_path(root: &Path, chart: &str) -> PathBuf {
    root.join(format!(
        "deploy/helm/{chart}/dashboards/bigfleet-{chart}.json"
    ))
}

/// The dashboard ConfigMap carries the canonical dashboard, with the sidecar label.
fn check_dashboard_configmap(root: &Path, chart: &str, objects: &[Value]) -> Result<()> {
    let key = format!("bigfleet-{chart}.json");
    let maps: Vec<&Value> = objects
        .iter()
        .filter(|o| o["kind"] == "ConfigMap" && !o["data"][&key].is_null())
        .collect();
    ensure!(
        maps.len() == 1,
        "want one ConfigMap carrying {key}, got {}",
        maps.len()
    );
    let shipped = maps[0]["data"][&key].as_str().unwrap_or_default();
    let canonical = fs::read_to_string(dashboard_path(root, chart))?;
    ensure!(
        shipped.trim_end() == canonical.trim_end(),
        "the dashboard ConfigMap does not carry {}",
        dashboard_path(root, chart).display()
    );
    ensure!(
        maps[0]["metadata"]["labels"]["grafana_dashboard"].is_string(),
        "the dashboard ConfigMap lacks the grafana_dashboard sidecar label"
    );
    Ok(())
}

/// Keeps the chart's copy of the dashboard equal to `deploy/dashboards`; returns whether it
/// already was (with `update`, makes it so).
pub(crate) fn sync_chart_dashboard(root: &Path, chart: &str, update: bool) -> Result<bool> {
    let canonical = fs::read_to_string(dashboard_path(root, chart))
        .with_context(|| format!("read {}", dashboard_path(root, chart).display()))?;
    let copy_path = chart_dashboard_path(root, chart);
    if fs::read_to_string(&copy_path).ok().as_deref() == Some(canonical.as_str()) {
        return Ok(true);
    }
    if update {
        fs::write(&copy_path, canonical)?;
        println!("helm: updated {}", copy_path.display());
        return Ok(true);
    }
    eprintln!(
        "helm: {} differs from {}",
        copy_path.display(),
        dashboard_path(root, chart).display()
    );
    Ok(false)
}

/// Every PromQL expression of a dashboard: panel targets (rows included) and query variables.
pub(crate) fn dashboard_exprs(dashboard: &Value) -> Vec<String> {
    fn panels(list: &Value, out: &mut Vec<String>) {
        for panel in list.as_array().into_iter().flatten() {
            for target in panel["targets"].as_array().into_iter().flatten() {
                if let Some(expr) = target["expr"].as_str() {
                    out.push(expr.to_owned());
                }
            }
            panels(&panel["panels"], out);
        }
    }
    let mut out = Vec::new();
    panels(&dashboard["panels"], &mut out);
    out
}

/// A dashboard expression as plain PromQL: Grafana's variables replaced by values of their
/// kind, so promtool can parse it.
pub(crate) fn as_promql(expr: &str) -> String {
    expr.replace("$__rate_interval", "5m")
        .replace("$__interval", "1m")
        .replace("$__range", "1h")
        .replace("$job", ".*")
        .replace("$instance", ".*")
}

/// The metric names an expression reads: identifiers starting with one of `prefixes`.
pub(crate) fn metric_names(expr: &str, prefixes: &[&str]) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let starts = (i == 0 || !is_ident(bytes[i - 1])) && is_ident(bytes[i]);
        if starts {
            let end = (i..bytes.len())
                .find(|&j| !is_ident(bytes[j]))
                .unwrap_or(bytes.len());
            let word = &expr[i..end];
            // A label name inside braces is followed by a matcher, never a metric.
            let next = expr[end..].trim_start();
            let is_label = next.starts_with("=") || next.starts_with("!=");
            if !is_label && prefixes.iter().any(|p| word.starts_with(p)) {
                names.insert(word.to_owned());
            }
            i = end;
        } else {
            i += 1;
        }
    }
    names
}

fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b':'
}

/// The metric-name prefixes a provider's dashboard may read.
pub(crate) fn dashboard_prefixes(chart: &str) -> Vec<String> {
    vec![format!("bigfleet_{chart}_"), "process_".to_owned()]
}

/// Parses every expression of the provider's dashboard with promtool (as recording rules of a
/// generated rule file), and requires each to read at least one provider metric.
pub(crate) fn check_dashboard(root: &Path, chart: &str, scratch: &Path) -> Result<usize> {
    let path = dashboard_path(root, chart);
    let dashboard: Value = serde_json::from_str(
        &fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?,
    )
    .with_context(|| format!("{} is not JSON", path.display()))?;
    let exprs = dashboard_exprs(&dashboard);
    ensure!(!exprs.is_empty(), "{} has no expressions", path.display());
    let prefixes = dashboard_prefixes(chart);
    let prefixes: Vec<&str> = prefixes.iter().map(String::as_str).collect();
    let mut rules = Vec::new();
    for (i, expr) in exprs.iter().enumerate() {
        ensure!(
            !metric_names(expr, &prefixes).is_empty(),
            "{}: {expr:?} reads no provider metric",
            path.display()
        );
        rules.push(serde_json::json!({
            "record": format!("dashboard:expr_{i}"),
            "expr": as_promql(expr),
        }));
    }
    let spec = serde_json::json!({"groups": [{"name": format!("bigfleet-{chart}-dashboard"), "rules": rules}]});
    let file = scratch.join(format!("{chart}-dashboard-rules.json"));
    check_rules(&spec, &file)
        .with_context(|| format!("the PromQL of {} does not parse", path.display()))?;
    Ok(exprs.len())
}

/// Every metric the provider's dashboard reads.
pub(crate) fn dashboard_metrics(root: &Path, chart: &str) -> Result<BTreeSet<String>> {
    let path = dashboard_path(root, chart);
    let dashboard: Value = serde_json::from_str(&fs::read_to_string(&path)?)?;
    let prefixes = dashboard_prefixes(chart);
    let prefixes: Vec<&str> = prefixes.iter().map(String::as_str).collect();
    let mut names = BTreeSet::new();
    for expr in dashboard_exprs(&dashboard) {
        names.extend(metric_names(&expr, &prefixes));
    }
    if names.is_empty() {
        bail!("{} reads no metric", path.display());
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_names_skip_labels_and_functions() {
        let names = metric_names(
            r#"histogram_quantile(0.99, sum by (method, le) (rate(bigfleet_x_grpc_request_duration_seconds_bucket{job=~"$job", bigfleet_x_label="a"}[5m]))) / process_cpu_seconds_total"#,
            &["bigfleet_x_", "process_"],
        );
        assert_eq!(
            names.into_iter().collect::<Vec<_>>(),
            [
                "bigfleet_x_grpc_request_duration_seconds_bucket",
                "process_cpu_seconds_total"
            ]
        );
    }

    #[test]
    fn grafana_variables_become_promql() {
        assert_eq!(
            as_promql(r#"rate(x{job=~"$job", instance=~"$instance"}[$__rate_interval])"#),
            r#"rate(x{job=~".*", instance=~".*"}[5m])"#
        );
    }

    #[test]
    fn anchors_follow_github() {
        assert_eq!(anchor(" BigFleetProviderDown"), "bigfleetproviderdown");
        assert_eq!(
            anchor("FAILED machines: `last_error`"),
            "failed-machines-last_error"
        );
    }
}

//! Reading this process's metrics back, as a scrape would.

/// The value of the series `name` (with its labels, if any, as rendered) in this process's
/// Prometheus recorder; 0 when it was never recorded.
pub fn metric(name: &str) -> f64 {
    let body = provider_core::telemetry::recorder().render();
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Reconcile surveys that succeeded, under the telemetry prefix `prefix`.
pub fn surveys(prefix: &str) -> f64 {
    metric(&format!("{prefix}_reconcile_total{{outcome=\"success\"}}"))
}

/// Surveys started early by an out-of-band check, under `prefix`.
pub fn early_surveys(prefix: &str) -> f64 {
    metric(&format!("{prefix}_reconcile_early_surveys_total"))
}

/// Successful cloud API calls of `op`, as the cloud client counts them, under `prefix`.
pub fn api_calls(prefix: &str, op: &str) -> f64 {
    metric(&format!(
        "{prefix}_api_calls_total{{op=\"{op}\",outcome=\"success\"}}"
    ))
}

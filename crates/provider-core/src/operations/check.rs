//! The shared half of `hetzner check` and `digitalocean check`: a read-only run of every check a
//! configuration can fail, one line per check with OK or the problem, a progress line on stderr
//! while it works, `--json` for scripts, and exit status 0 only when every check passed.
//!
//! A provider binary recognises `check` as its first argument ([`split_args`]), parses the rest
//! with the very same serving flags, and hands a closure that fills a [`Report`] to [`entry`].
//! The checks common to both clouds (TLS material, base user data) live here too.

use std::ffi::OsString;
use std::io::{IsTerminal, Write};
use std::process::ExitCode;

use serde_json::json;

use crate::operations::config::CommonArgs;

/// The word that selects the check run.
pub const SUBCOMMAND: &str = "check";

/// Options of the check run itself (everything else is a serving flag).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CheckOptions {
    /// Print one JSON document instead of lines.
    pub json: bool,
}

/// When `args` (program name first) select the check run, returns its options and the
/// arguments to parse as serving flags: the program name and everything but `check` and `--json`.
/// `check --help` (or `-h`) is not a check run: clap prints the subcommand's own help.
pub fn split_args(
    args: impl IntoIterator<Item = OsString>,
) -> Option<(CheckOptions, Vec<OsString>)> {
    let mut args = args.into_iter();
    let program = args.next()?;
    let mut rest: Vec<OsString> = args.collect();
    if rest.first().is_none_or(|first| first != SUBCOMMAND) {
        return None;
    }
    if rest.iter().any(|a| a == "--help" || a == "-h") {
        return None;
    }
    rest.remove(0);
    let mut options = CheckOptions::default();
    let mut serving = vec![program];
    for arg in rest {
        if arg == "--json" {
            options.json = true;
        } else {
            serving.push(arg);
        }
    }
    Some((options, serving))
}

/// The verdict of one check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Passed; the text says what was found (may be empty).
    Ok(String),
    /// Failed; the text names the flag, field or file and the value at fault.
    Problem(String),
}

#[derive(Debug, Clone)]
struct Entry {
    check: String,
    verdict: Verdict,
}

/// The checks run so far, in order.
pub struct Report {
    options: CheckOptions,
    entries: Vec<Entry>,
    progress: Box<dyn Write + Send>,
    show_progress: bool,
}

impl Report {
    /// A report that writes its progress line to stderr.
    pub fn new(options: CheckOptions) -> Report {
        Report {
            options,
            entries: Vec::new(),
            progress: Box::new(std::io::stderr()),
            show_progress: true,
        }
    }

    /// A report that writes no progress (tests, nested runs).
    pub fn quiet(options: CheckOptions) -> Report {
        Report {
            options,
            entries: Vec::new(),
            progress: Box::new(std::io::sink()),
            show_progress: false,
        }
    }

    /// Says on stderr what is being checked now, so a slow API does not look like a hang.
    pub fn progress(&mut self, what: &str) {
        if !self.show_progress {
            return;
        }
        // On a terminal the line is rewritten in place; in a log it is one line per step.
        let line = if std::io::stderr().is_terminal() {
            format!("\r\x1b[2Kchecking {what} ...")
        } else {
            format!("checking {what} ...\n")
        };
        // A progress line that cannot be written is not a check failure.
        let _ = self.progress.write_all(line.as_bytes());
        let _ = self.progress.flush();
    }

    /// Records a passed check with what it found.
    pub fn ok(&mut self, check: impl Into<String>, found: impl Into<String>) {
        self.push(check.into(), Verdict::Ok(found.into()));
    }

    /// Records a failed check with the problem.
    pub fn problem(&mut self, check: impl Into<String>, problem: impl Into<String>) {
        self.push(check.into(), Verdict::Problem(problem.into()));
    }

    /// Records `result`: `Ok(found)` passes, `Err(problem)` fails.
    pub fn record(&mut self, check: impl Into<String>, result: Result<String, String>) {
        let verdict = match result {
            Ok(found) => Verdict::Ok(found),
            Err(problem) => Verdict::Problem(problem),
        };
        self.push(check.into(), verdict);
    }

    fn push(&mut self, check: String, verdict: Verdict) {
        self.entries.push(Entry { check, verdict });
    }

    /// Whether every check passed (and at least one ran).
    pub fn passed(&self) -> bool {
        !self.entries.is_empty()
            && self
                .entries
                .iter()
                .all(|e| matches!(e.verdict, Verdict::Ok(_)))
    }

    /// The problems recorded, as (check, problem).
    pub fn problems(&self) -> Vec<(&str, &str)> {
        self.entries
            .iter()
            .filter_map(|e| match &e.verdict {
                Verdict::Problem(p) => Some((e.check.as_str(), p.as_str())),
                Verdict::Ok(_) => None,
            })
            .collect()
    }

    /// The verdict of the named check, if it ran.
    pub fn verdict(&self, check: &str) -> Option<&Verdict> {
        self.entries
            .iter()
            .find(|e| e.check == check)
            .map(|e| &e.verdict)
    }

    /// The report as printed: lines, or one JSON document with `--json`.
    pub fn render(&self) -> String {
        if self.options.json {
            return self.render_json();
        }
        let mut out = String::new();
        for entry in &self.entries {
            match &entry.verdict {
                Verdict::Ok(found) if found.is_empty() => {
                    out.push_str(&format!("OK    {}\n", entry.check));
                }
                Verdict::Ok(found) => out.push_str(&format!("OK    {}: {found}\n", entry.check)),
                Verdict::Problem(problem) => {
                    out.push_str(&format!("FAIL  {}: {problem}\n", entry.check));
                }
            }
        }
        let failed = self.problems().len();
        out.push_str(&format!(
            "{} checks, {failed} {}\n",
            self.entries.len(),
            if failed == 1 { "problem" } else { "problems" }
        ));
        out
    }

    fn render_json(&self) -> String {
        let checks: Vec<serde_json::Value> = self
            .entries
            .iter()
            .map(|e| match &e.verdict {
                Verdict::Ok(found) => json!({"check": e.check, "ok": true, "found": found}),
                Verdict::Problem(problem) => {
                    json!({"check": e.check, "ok": false, "problem": problem})
                }
            })
            .collect();
        let doc = json!({
            "ok": self.passed(),
            "problems": self.problems().len(),
            "checks": checks,
        });
        format!("{doc:#}\n")
    }

    /// Clears the progress line (on a terminal) so the report starts on a clean line.
    fn end_progress(&mut self) {
        if self.show_progress && std::io::stderr().is_terminal() {
            let _ = self.progress.write_all(b"\r\x1b[2K");
            let _ = self.progress.flush();
        }
    }
}

/// Runs a check closure on a fresh runtime, prints the report on stdout and returns exit status
/// 0 only when every check passed. `run` fills the report; an `Err` from it is a check run that
/// could not go on (it is recorded as a problem of its own, named `run`).
pub fn entry<F>(
    binary: &str,
    common: &CommonArgs,
    options: CheckOptions,
    run: impl FnOnce(Report) -> F,
) -> ExitCode
where
    F: std::future::Future<Output = (Report, Result<(), String>)>,
{
    // Logs would interleave with the report; only warnings and worse reach stderr.
    crate::operations::config::init_logging(common.log_format, "warn");
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{binary} check: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (mut report, outcome) = runtime.block_on(run(Report::new(options)));
    if let Err(e) = outcome {
        report.problem("run", e);
    }
    report.end_progress();
    print!("{}", report.render());
    if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// The checks both clouds share: the gRPC TLS material parses and belongs together, and the
/// base user data can be read. Each flag that is set gets a line.
pub fn common_checks(report: &mut Report, common: &CommonArgs) {
    let tls = common.tls_flags();
    if tls.cert.is_some() || tls.key.is_some() || tls.ca.is_some() {
        report.progress("TLS material");
        let result = crate::security::tls::grpc_tls(&tls).and_then(|(mode, _)| {
            let cert = tls.cert.as_deref().unwrap_or(std::path::Path::new(""));
            let not_after = crate::security::tls::earliest_not_after(cert)?;
            Ok(format!(
                "{}, earliest certificate expiry {}",
                mode.name(),
                crate::security::tls::unix_date(not_after)
            ))
        });
        report.record("--tls-cert/--tls-key/--tls-ca", result);
    }
    // A TLS setup that does not load is reported above already.
    if let (Some(_), Ok((security, _))) =
        (common.shard_identity, crate::security::tls::grpc_tls(&tls))
    {
        report.progress("shard identity");
        let result = common.shard_identity(security);
        report.record(
            "--shard-identity",
            result.map(|mode| format!("{} under mTLS", mode.name())),
        );
    }
    if !common.base_user_data.is_empty() {
        report.progress("base user data");
        report.record(
            "--base-user-data",
            common
                .read_base_user_data()
                .map(|data| format!("{} bytes", data.map_or(0, |d| d.len()))),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(args: &[&str]) -> Vec<OsString> {
        args.iter().map(OsString::from).collect()
    }

    #[test]
    fn check_is_selected_by_the_first_argument_only() {
        assert_eq!(split_args(os(&["hetzner", "--addr", ":9000"])), None);
        assert_eq!(split_args(os(&["hetzner", "--provider", "check"])), None);
        assert_eq!(split_args(os(&["hetzner"])), None);
        assert_eq!(
            split_args(os(&["hetzner", "check", "--help"])),
            None,
            "clap prints the subcommand's help"
        );
        assert_eq!(split_args(os(&["hetzner", "check", "--json", "-h"])), None);
        let (options, rest) =
            split_args(os(&["hetzner", "check", "--offerings", "o.json", "--json"])).unwrap();
        assert!(options.json);
        assert_eq!(rest, os(&["hetzner", "--offerings", "o.json"]));
        let (options, rest) = split_args(os(&["digitalocean", "check"])).unwrap();
        assert!(!options.json);
        assert_eq!(rest, os(&["digitalocean"]));
    }

    #[test]
    fn exit_status_follows_the_problems() {
        let mut report = Report::quiet(CheckOptions::default());
        assert!(!report.passed(), "an empty run proves nothing");
        report.ok("token", "works");
        assert!(report.passed());
        report.problem("offering \"a\" server_type", "\"cx99\" does not exist");
        assert!(!report.passed());
        assert_eq!(
            report.problems(),
            vec![("offering \"a\" server_type", "\"cx99\" does not exist")]
        );
    }

    #[test]
    fn lines_and_json() {
        let mut report = Report::quiet(CheckOptions::default());
        report.ok("token", "");
        report.record("--network", Err("network \"priv\" does not exist".into()));
        let text = report.render();
        assert_eq!(
            text,
            "OK    token\nFAIL  --network: network \"priv\" does not exist\n2 checks, 1 problem\n"
        );
        let mut report = Report::quiet(CheckOptions { json: true });
        report.ok("token", "project reachable");
        report.problem("--firewall", "firewall \"fw\" does not exist");
        let doc: serde_json::Value = serde_json::from_str(&report.render()).unwrap();
        assert_eq!(doc["ok"], false);
        assert_eq!(doc["problems"], 1);
        assert_eq!(doc["checks"][0]["check"], "token");
        assert_eq!(doc["checks"][0]["ok"], true);
        assert_eq!(
            doc["checks"][1]["problem"],
            "firewall \"fw\" does not exist"
        );
        assert_eq!(
            report.verdict("--firewall"),
            Some(&Verdict::Problem("firewall \"fw\" does not exist".into()))
        );
    }

    #[test]
    fn common_checks_name_the_flag_at_fault() {
        use clap::Parser;
        #[derive(Parser)]
        struct Args {
            #[command(flatten)]
            common: CommonArgs,
        }
        let missing = std::env::temp_dir().join("bigfleet-check-missing-cert.pem");
        let args = Args::parse_from([
            "test".to_string(),
            format!("--tls-cert={}", missing.display()),
            format!("--tls-key={}", missing.display()),
            "--base-user-data=/nonexistent/user-data".to_string(),
        ]);
        let mut report = Report::quiet(CheckOptions::default());
        common_checks(&mut report, &args.common);
        let problems = report.problems();
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems[0].1.contains("bigfleet-check-missing-cert.pem"));
        assert!(problems[1].1.contains("--base-user-data"));
        let args = Args::parse_from(["test", "--tls-ca=/x/ca.pem"]);
        let mut report = Report::quiet(CheckOptions::default());
        common_checks(&mut report, &args.common);
        assert!(report.problems()[0].1.contains("--tls-ca"));
        let args = Args::parse_from(["test", "--shard-identity=warn"]);
        let mut report = Report::quiet(CheckOptions::default());
        common_checks(&mut report, &args.common);
        let problems = report.problems();
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].1.contains("--shard-identity=warn needs mTLS"),
            "{problems:?}"
        );
    }

    #[test]
    fn dates() {
        assert_eq!(crate::security::tls::unix_date(0), "1970-01-01");
        assert_eq!(crate::security::tls::unix_date(951_782_400), "2000-02-29");
        assert_eq!(crate::security::tls::unix_date(1_798_761_599), "2026-12-31");
    }
}

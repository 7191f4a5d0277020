//! The shipped alerts in a real Prometheus: Debian's `prometheus` (started here on a free
//! loopback port with its own data directory, stopped by PID) scrapes the `digitalocean` binary
//! on its real backend against `do-emulator`, evaluating the rules the chart renders (with
//! second-scale `for` and windows so the run takes about a minute). Faults are injected and
//! each alert must reach `firing` in Prometheus's `/api/v1/alerts`, then disappear after
//! recovery:
//!
//! - a bootstrap certificate that expires in 3 days: `BigFleetProviderCertificateExpiringSoon`
//!   (resolved by a restart with a renewed certificate);
//! - a Configure whose agent enrolled and then died: a FAILED machine holding its Droplet after a transition
//!   timeout, `BigFleetProviderFailedMachinesHoldingHosts` and
//!   `BigFleetProviderTransitionTimeouts` (resolved by `admin failed release` and the window);
//! - an agent with a wrong token: `BigFleetProviderBootstrapUnauthorizedBurst`;
//! - a Create for another shard than the client certificate proves:
//!   `BigFleetProviderShardIdentityRejected`;
//! - a 429 storm and a 503 storm from the emulator: `BigFleetProviderCloudAPIRateLimited`,
//!   `BigFleetProviderCloudAPIBudgetExhausted` and `BigFleetProviderCloudAPIErrors`;
//! - the provider stopped: `BigFleetProviderDown` (resolved by the restart).
//!
//! Before the stop, every metric the DigitalOcean dashboard reads must be in the provider's live
//! `/metrics`; likewise the Hetzner dashboard against `hetzner` on its real backend, pointed at
//! `hcloud-emulator`, after a Create and a few refresh and reconcile passes
//! ([`hetzner_dashboard`]).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use fleet_proto::v1alpha1 as pb;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, date_time_ymd,
};
use serde_json::Value;
use tokio::time::Instant;

use super::digitalocean_real::{
    Process, backend_args, droplet_of, eventually, start_agent, start_emulator,
    start_on_free_bootstrap_port,
};
use super::provider_process::{self, Provider, Spec};
use super::wire::{self, Caller, ClientSecurity, Shard, state_of};
use crate::alerts;

const SECRET: &str = "e2e-alerts-bootstrap-secret-0123456789";
const OFFERINGS: &str = r#"[{"size": "s-1vcpu-2gb", "region": "nyc3", "count": 2, "resources": {"cpu": "1", "memory": "2Gi"}}]"#;
/// The scrape job, and the rules' selector.
const JOB: &str = "bigfleet-live";
/// How long any alert may take to fire or to resolve.
const ALERT_DEADLINE: Duration = Duration::from_secs(60);
/// How long a transition may take to settle against the emulator.
const SETTLE: Duration = Duration::from_secs(15);
/// The chart's rules with second-scale `for` and windows; every threshold stays the default
/// except the 401 burst, which must stay below the channel's per-address throttle (10).
const LIVE_VALUES: &str = r#"prometheusRule:
  enabled: true
  selector: job="bigfleet-live"
  evaluationInterval: 1s
  alerts:
    down: {enabled: true, for: 2s, severity: critical}
    notReady: {enabled: true, for: 2s, severity: warning}
    storeRefusingMutations: {enabled: true, for: 0s, severity: critical}
    failedMachinesWithHost: {enabled: true, threshold: 0, for: 2s, severity: warning}
    transitionTimeouts: {enabled: true, window: 15s, threshold: 0, for: 0s, severity: warning}
    cloudAPIRateLimited: {enabled: true, window: 10s, ratio: 0.1, for: 2s, severity: warning}
    cloudAPIBudgetExhausted: {enabled: true, window: 10s, count: 0, for: 2s, severity: warning}
    cloudAPIServerErrors: {enabled: true, window: 10s, ratio: 0.05, for: 2s, severity: warning}
    reconcileFailing: {enabled: true, window: 10s, for: 0s, severity: warning}
    priceRefreshFailing: {enabled: true, window: 10s, for: 0s, severity: warning}
    bootstrapUnauthorized: {enabled: true, window: 15s, threshold: 5, for: 0s, severity: warning}
    certificateExpiry: {enabled: true, days: 14, for: 2s, severity: warning}
    shardIdentityRejected: {enabled: true, window: 15s, threshold: 0, for: 0s, severity: warning}
"#;

/// Runs the whole live check; `Err` names the alert or step that deviated.
pub(crate) async fn run(root: &Path) -> Result<()> {
    let prometheus_bin = alerts::prometheus()?;
    let dir = std::env::temp_dir().join(format!("bigfleet-e2e-alerts-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    let result = run_in(root, &prometheus_bin, &dir).await;
    let _ = std::fs::remove_dir_all(&dir);
    result
}

async fn run_in(root: &Path, prometheus_bin: &Path, dir: &Path) -> Result<()> {
    let rules = render_rules(root, dir)?;
    let pki = Pki::generate(dir)?;
    let offerings = dir.join("offerings.json");
    std::fs::write(&offerings, OFFERINGS)?;
    let (emulator, api) = start_emulator(root)?;
    let targets = dir.join("targets.json");
    let mut provider = start_provider(root, api, dir, &offerings, &pki, &pki.short_leaf).await?;
    write_targets(&targets, &provider)?;
    let mut prometheus = Prometheus::start(prometheus_bin, dir, &rules, &targets).await?;
    let mut agents = Vec::new();
    let outcome = faults_and_recovery(
        root,
        api,
        dir,
        &offerings,
        &pki,
        &targets,
        &prometheus,
        &mut provider,
        &mut agents,
    )
    .await;
    let agent_logs: Vec<String> = agents.iter().map(Process::logs).collect();
    drop(agents);
    let provider_log = provider.logs();
    let _ = provider.stop(super::STOP_DEADLINE).await;
    let prometheus_log = prometheus.stop();
    outcome.map_err(|e| {
        anyhow::anyhow!(
            "{e:#}\nprovider log:\n{provider_log}\nprometheus log:\n{prometheus_log}\ndo-emulator log:\n{}\nagent logs:\n{}",
            emulator.logs(),
            agent_logs.join("\n---\n")
        )
    })
}

/// The steps, in order; the caller tears everything down.
#[allow(clippy::too_many_arguments)]
async fn faults_and_recovery(
    root: &Path,
    api: SocketAddr,
    dir: &Path,
    offerings: &Path,
    pki: &Pki,
    targets: &Path,
    prometheus: &Prometheus,
    provider: &mut Provider,
    agents: &mut Vec<Process>,
) -> Result<()> {
    // 1. The bootstrap certificate expires in 3 days; the gRPC ones (2124) do not.
    let cert = [("certificate", "bootstrap")];
    prometheus
        .wait_firing("BigFleetProviderCertificateExpiringSoon", &cert)
        .await?;
    ensure!(
        prometheus
            .alerts()?
            .iter()
            .filter(|a| a["labels"]["alertname"] == "BigFleetProviderCertificateExpiringSoon")
            .all(|a| a["labels"]["certificate"] == "bootstrap"),
        "only the bootstrap certificate expires soon: {:?}",
        prometheus.alerts()?
    );
    println!("e2e alerts: BigFleetProviderCertificateExpiringSoon fired for the 3-day certificate");

    // 2. One machine configured through a real agent (the channel's series), one Configure no
    // agent answers: it times out and leaves the machine FAILED with its Droplet.
    let mut caller = Caller::new(
        provider.default_channel().await?,
        Shard::new(wire::TEST_SHARD, 1),
    );
    let slots = caller.list_all().await?;
    ensure!(slots.len() == 2, "want 2 slots, got {slots:#?}");
    let (served, abandoned) = (slots[0].id.clone(), slots[1].id.clone());
    for id in [&served, &abandoned] {
        caller.create(id).await?;
        caller
            .wait_for_state(id, pb::MachineState::Idle, SETTLE)
            .await
            .with_context(|| format!("Create {id}"))?;
    }
    let (_, config) = droplet_of(api, &served)?.context("no Droplet for the served machine")?;
    let agent_dir = dir.join("agent-good");
    std::fs::create_dir_all(&agent_dir)?;
    agents.push(start_agent(root, &agent_dir, &config)?);
    caller
        .configure(&served, "e2e-alerts", Default::default())
        .await?;
    caller
        .wait_for_state(&served, pb::MachineState::Configured, SETTLE)
        .await
        .context("Configure through the agent")?;
    // The abandoned Droplet's agent enrolls and then dies: its Configure is queued for an
    // enrolled agent that never fetches it, and runs out of time.
    let (_, abandoned_config) =
        droplet_of(api, &abandoned)?.context("no Droplet for the abandoned machine")?;
    let gone_dir = dir.join("agent-gone");
    std::fs::create_dir_all(&gone_dir)?;
    let gone = start_agent(root, &gone_dir, &abandoned_config)?;
    eventually(SETTLE, "the abandoned Droplet's agent enrolled", || {
        Ok(gone
            .logs()
            .contains("enrolled; the user_data token is spent")
            .then_some(()))
    })
    .await?;
    drop(gone);
    caller
        .configure(&abandoned, "e2e-alerts", Default::default())
        .await?;
    wait_failed(&mut caller, &abandoned).await?;
    prometheus
        .wait_firing("BigFleetProviderFailedMachinesHoldingHosts", &[])
        .await?;
    prometheus
        .wait_firing(
            "BigFleetProviderTransitionTimeouts",
            &[("kind", "configure")],
        )
        .await?;
    println!(
        "e2e alerts: a Configure timeout fired BigFleetProviderTransitionTimeouts and BigFleetProviderFailedMachinesHoldingHosts"
    );

    // 3. An agent whose token was tampered with: a burst of 401s.
    let (_, mut bad) = droplet_of(api, &abandoned)?.context("no Droplet for the FAILED machine")?;
    let token = bad["token"].as_str().unwrap_or_default().to_owned();
    ensure!(!token.is_empty(), "the agent config has no token: {bad}");
    let mut tampered: Vec<char> = token.chars().collect();
    tampered[0] = if tampered[0] == 'A' { 'B' } else { 'A' };
    bad["token"] = Value::String(tampered.into_iter().collect());
    let bad_dir = dir.join("agent-bad");
    std::fs::create_dir_all(&bad_dir)?;
    agents.push(start_agent(root, &bad_dir, &bad)?);
    prometheus
        .wait_firing("BigFleetProviderBootstrapUnauthorizedBurst", &[])
        .await?;
    // Dropping the agent kills it.
    drop(agents.pop());
    println!("e2e alerts: a tampered agent token fired BigFleetProviderBootstrapUnauthorizedBurst");

    // 3b. A shard's certificate used to act for another shard: refused before the fence, and
    // alerted per reason.
    let mut impostor = Caller::new(
        provider.default_channel().await?,
        Shard::new("other-shard", 1),
    );
    let refused = impostor
        .create(&served)
        .await
        .expect_err("a Create for another shard than the certificate's must be refused");
    ensure!(
        refused.code() == tonic::Code::PermissionDenied,
        "a Create for another shard: {refused:?}"
    );
    prometheus
        .wait_firing(
            "BigFleetProviderShardIdentityRejected",
            &[("reason", "mismatch")],
        )
        .await?;
    println!(
        "e2e alerts: a Create for another shard than the certificate proves fired BigFleetProviderShardIdentityRejected"
    );

    // 4. Storms from the cloud API: 429, then 503.
    storm(api, prometheus, 429, "BigFleetProviderCloudAPIRateLimited").await?;
    // The same 429s, as the budget counts them: someone else spends the token.
    prometheus
        .wait_firing("BigFleetProviderCloudAPIBudgetExhausted", &[])
        .await?;
    storm(api, prometheus, 503, "BigFleetProviderCloudAPIErrors").await?;
    println!(
        "e2e alerts: emulator storms fired BigFleetProviderCloudAPIRateLimited (429) and BigFleetProviderCloudAPIErrors (503)"
    );

    // 5. The dashboard reads only metrics the provider exports.
    check_dashboard_metrics(root, "digitalocean", provider)?;

    // 6. Recovery: the storms end and the windows pass; the FAILED machine is released.
    for alert in [
        "BigFleetProviderCloudAPIRateLimited",
        "BigFleetProviderCloudAPIBudgetExhausted",
        "BigFleetProviderCloudAPIErrors",
        "BigFleetProviderTransitionTimeouts",
        "BigFleetProviderBootstrapUnauthorizedBurst",
        "BigFleetProviderShardIdentityRejected",
    ] {
        prometheus.wait_resolved(alert).await?;
    }
    release(root, dir, &abandoned).await?;
    prometheus
        .wait_resolved("BigFleetProviderFailedMachinesHoldingHosts")
        .await?;
    println!("e2e alerts: release, quiet windows and the end of the storms resolved them");

    // 7. The provider stops: down. It restarts with a renewed certificate: both resolve.
    drop(agents.drain(..));
    provider
        .stop(super::STOP_DEADLINE)
        .await
        .context("SIGTERM must exit 0")?;
    prometheus.wait_firing("BigFleetProviderDown", &[]).await?;
    *provider = start_provider(root, api, dir, offerings, pki, &pki.long_leaf).await?;
    write_targets(targets, provider)?;
    prometheus.wait_resolved("BigFleetProviderDown").await?;
    prometheus
        .wait_resolved("BigFleetProviderCertificateExpiringSoon")
        .await?;
    // An alert the release's own retries set off against what was left of a storm (on the
    // instance that is gone now) resolves at its next evaluations, not at once.
    prometheus.wait_all_resolved().await?;
    println!(
        "e2e alerts: BigFleetProviderDown fired while stopped; the restart with a renewed certificate resolved it and the expiry alert"
    );
    Ok(())
}

/// `digitalocean admin failed release ID`, retried (bounded) while the emulator still answers
/// what is left of a storm.
async fn release(root: &Path, dir: &Path, id: &str) -> Result<()> {
    let deadline = Instant::now() + ALERT_DEADLINE;
    loop {
        let output = Command::new(provider_process::target_binary(
            root,
            "debug",
            "digitalocean",
        ))
        .args(["admin", "failed", "release", id, "--admin-socket"])
        .arg(dir.join("admin.sock"))
        .output()
        .context("run digitalocean admin failed release")?;
        if output.status.success() {
            return Ok(());
        }
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        if Instant::now() >= deadline {
            bail!("admin failed release {id}: {text}");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Waits until `id` is FAILED (the Configure deadline passed).
async fn wait_failed(caller: &mut Caller, id: &str) -> Result<()> {
    let deadline = Instant::now() + SETTLE;
    loop {
        let machine = caller.get(id).await?;
        if state_of(&machine) == pb::MachineState::Failed {
            ensure!(
                machine.host.is_some(),
                "the timed-out machine lost its host: {machine:?}"
            );
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("{id} is not FAILED {SETTLE:?} after a Configure no agent answers: {machine:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Keeps `status` answers queued in the emulator (each with `Retry-After: 1`) until `alert`
/// fires, then clears what is left of the queue.
async fn storm(api: SocketAddr, prometheus: &Prometheus, status: u16, alert: &str) -> Result<()> {
    let deadline = Instant::now() + ALERT_DEADLINE;
    let fault = serde_json::json!({"status": status, "retry_after": 1});
    let body = serde_json::json!({"fail_next": vec![fault; 3]}).to_string();
    loop {
        let (code, answer) = http(api, "POST", "/_emulator/faults", Some(&body))?;
        ensure!(
            (200..300).contains(&code),
            "POST /_emulator/faults: {code} {answer}"
        );
        if prometheus.firing(alert, &[])? {
            // The provider paces its requests to the budget, so what is still queued would
            // take long to drain: the storm ends here.
            let clear = serde_json::json!({"clear": true}).to_string();
            let (code, answer) = http(api, "POST", "/_emulator/faults", Some(&clear))?;
            ensure!(
                (200..300).contains(&code),
                "POST /_emulator/faults: {code} {answer}"
            );
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!(
                "{alert} did not fire within {ALERT_DEADLINE:?} of a {status} storm; alerts: {:?}",
                prometheus.alerts()?
            );
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Every metric a provider's dashboard reads appears in the provider's live `/metrics`.
pub(super) fn check_dashboard_metrics(root: &Path, chart: &str, provider: &Provider) -> Result<()> {
    let metrics = provider
        .metrics
        .context("started without a metrics address")?;
    let (status, body) = http(metrics, "GET", "/metrics", None)?;
    ensure!(status == 200, "/metrics: {status}");
    let exported: std::collections::BTreeSet<&str> = body
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .collect();
    let read = alerts::dashboard_metrics(root, chart)?;
    let missing: Vec<&String> = read
        .iter()
        .filter(|name| !exported.contains(name.as_str()))
        .collect();
    ensure!(
        missing.is_empty(),
        "deploy/dashboards/bigfleet-{chart}.json reads metrics the live {chart} provider does not export: {missing:?}"
    );
    println!(
        "e2e alerts: all {} metrics of the {chart} dashboard are in a live /metrics scrape",
        read.len()
    );
    Ok(())
}

/// Every metric the Hetzner dashboard reads is exported by `hetzner` on its real backend (against
/// `hcloud-emulator`, without SSH) once it created a machine and ran its loops.
pub(crate) async fn hetzner_dashboard(root: &Path) -> Result<()> {
    let binary = provider_process::target_binary(root, "debug", "hcloud-emulator");
    let mut child = Command::new(&binary)
        .args(["--listen", "127.0.0.1:0", "--token", "e2e-dashboard-token"])
        .args(["--polls-to-running", "0"])
        .env_remove("HCLOUD_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("start {}", binary.display()))?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().context("emulator stdout")?)
        .read_line(&mut line)
        .context("read the emulator's address")?;
    let result = async {
        let endpoint = line
            .trim()
            .strip_prefix("listening on ")
            .with_context(|| format!("hcloud-emulator printed {line:?}"))?;
        let dir = std::env::temp_dir().join(format!(
            "bigfleet-e2e-hetzner-dashboard-{}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir)?;
        let offerings = dir.join("offerings.json");
        std::fs::write(
            &offerings,
            r#"[{"server_type": "cx23", "location": "nbg1", "count": 1}]"#,
        )?;
        let grpc_pki = wire::pki_dir(root);
        let pem = |name: &str| grpc_pki.join(name).display().to_string();
        let spec = Spec {
            name: "hetzner (dashboard)".into(),
            binary: provider_process::target_binary(root, "debug", "hetzner"),
            args: vec![
                "--hetzner-backend=hetzner".into(),
                "--token=e2e-dashboard-token".into(),
                format!("--hcloud-endpoint={endpoint}"),
                "--image=ubuntu-24.04".into(),
                format!("--offerings={}", offerings.display()),
                "--reconcile-interval=1s".into(),
                "--price-refresh=1s".into(),
                format!("--tls-cert={}", pem("server.pem")),
                format!("--tls-key={}", pem("server-key.pem")),
                format!("--tls-ca={}", pem("ca.pem")),
                "--shutdown-grace=5s".into(),
            ],
            metrics: true,
            security: ClientSecurity::Mtls,
            pki: grpc_pki.clone(),
        };
        let mut provider = provider_process::start(spec).await?;
        let checked = async {
            let mut caller = Caller::new(
                provider.default_channel().await?,
                Shard::new(wire::TEST_SHARD, 1),
            );
            let id = caller.list_all().await?[0].id.clone();
            caller.create(&id).await?;
            caller
                .wait_for_state(&id, pb::MachineState::Idle, SETTLE)
                .await?;
            // The 1 s reconcile and price refresh loops must have run: polled, bounded.
            let deadline = Instant::now() + Duration::from_secs(15);
            loop {
                match check_dashboard_metrics(root, "hetzner", &provider) {
                    Ok(()) => return Ok(()),
                    Err(e) if Instant::now() >= deadline => return Err(e),
                    Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
                }
            }
        }
        .await;
        let stopped = provider.stop(super::STOP_DEADLINE).await;
        let _ = std::fs::remove_dir_all(&dir);
        checked.map_err(|e| anyhow::anyhow!("{e:#}\nprovider log:\n{}", provider.logs()))?;
        stopped
    }
    .await;
    let _ = child.kill();
    let _ = child.wait();
    result
}

/// Renders the chart's PrometheusRule with the live values and checks it with promtool.
fn render_rules(root: &Path, dir: &Path) -> Result<PathBuf> {
    let python = crate::helm::python()?;
    let values = dir.join("live-values.yaml");
    std::fs::write(&values, LIVE_VALUES)?;
    let json = dir.join("live-render.json");
    let output = Command::new(&python)
        .arg(root.join("deploy/ci/chartcheck.py"))
        .arg("check")
        .arg(root.join("deploy/helm/digitalocean"))
        .args([
            "--release",
            "bigfleet",
            "--namespace",
            "bigfleet",
            "--values",
        ])
        .arg(&values)
        .arg("--json")
        .arg(&json)
        .output()
        .context("render the chart's rules")?;
    ensure!(
        output.status.success(),
        "render the chart's rules: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let objects: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(&json)?)?;
    let rules = dir.join("rules.json");
    alerts::check_rules(alerts::rule_spec(&objects)?, &rules)?;
    Ok(rules)
}

/// A CA for the bootstrap channel and two leaves for 127.0.0.1: one expiring in 3 days, one
/// valid until the CA expires.
struct Pki {
    ca: PathBuf,
    short_leaf: (PathBuf, PathBuf),
    long_leaf: (PathBuf, PathBuf),
}

impl Pki {
    fn generate(dir: &Path) -> Result<Pki> {
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::CommonName, "BigFleet alerts e2e CA");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        params.not_before = date_time_ymd(2024, 1, 1);
        params.not_after = date_time_ymd(2124, 1, 1);
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate()?)?;
        let ca_path = dir.join("bootstrap-ca.pem");
        std::fs::write(&ca_path, ca.pem())?;
        let (year, month, day) = date_in_days(3)?;
        let leaf = |name: &str, until: (i32, u8, u8)| -> Result<(PathBuf, PathBuf)> {
            let mut params =
                CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])?;
            params.is_ca = IsCa::ExplicitNoCa;
            params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
            params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
            params.not_before = date_time_ymd(2024, 1, 1);
            params.not_after = date_time_ymd(until.0, until.1, until.2);
            let key = KeyPair::generate()?;
            let cert = params.signed_by(&key, &ca)?;
            let (cert_path, key_path) = (
                dir.join(format!("{name}.pem")),
                dir.join(format!("{name}-key.pem")),
            );
            std::fs::write(&cert_path, cert.pem())?;
            std::fs::write(&key_path, key.serialize_pem())?;
            Ok((cert_path, key_path))
        };
        let short_leaf = leaf("bootstrap-expiring", (year, month, day))?;
        let long_leaf = leaf("bootstrap-renewed", (2124, 1, 1))?;
        Ok(Pki {
            ca: ca_path,
            short_leaf,
            long_leaf,
        })
    }
}

/// The UTC calendar date `days` from now.
fn date_in_days(days: u64) -> Result<(i32, u8, u8)> {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?;
    let (year, month, day) = civil_from_days(i64::try_from(now.as_secs() / 86_400 + days)?);
    Ok((
        i32::try_from(year)?,
        u8::try_from(month)?,
        u8::try_from(day)?,
    ))
}

/// The proleptic Gregorian date of a day count from 1970-01-01 (H. Hinnant's
/// `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z - era * 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let shifted_month = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * shifted_month + 2) / 5 + 1;
    let month = if shifted_month < 10 {
        shifted_month + 3
    } else {
        shifted_month - 9
    };
    (year_of_era + era * 400 + i64::from(month <= 2), month, day)
}

fn spec(
    root: &Path,
    api: SocketAddr,
    dir: &Path,
    bootstrap: u16,
    offerings: &Path,
    pki: &Pki,
    leaf: &(PathBuf, PathBuf),
) -> Spec {
    let grpc_pki = wire::pki_dir(root);
    let pem = |name: &str| grpc_pki.join(name).display().to_string();
    Spec {
        name: "digitalocean (alerts)".into(),
        binary: provider_process::target_binary(root, "debug", "digitalocean"),
        args: backend_args(api, bootstrap, offerings)
            .into_iter()
            .chain([
                format!("--bootstrap-tls-cert={}", leaf.0.display()),
                format!("--bootstrap-tls-key={}", leaf.1.display()),
                format!("--bootstrap-ca={}", pki.ca.display()),
                format!("--bootstrap-secret={SECRET}"),
                "--configure-timeout=4s".into(),
                "--reconcile-interval=1s".into(),
                "--price-refresh=1s".into(),
                // The whole (unscaled) budget for this one process and its background work:
                // after the 429 storm its reconcile and refresh passes must go on sending, at
                // DigitalOcean's real refill, for the 503 storm to meet them.
                "--api-budget-share=1".into(),
                "--api-reconcile-share=1".into(),
                format!("--admin-socket={}", dir.join("admin.sock").display()),
                format!("--tls-cert={}", pem("server.pem")),
                format!("--tls-key={}", pem("server-key.pem")),
                format!("--tls-ca={}", pem("ca.pem")),
                "--shutdown-grace=5s".into(),
                "--log-level=info".into(),
            ])
            .collect(),
        metrics: true,
        security: ClientSecurity::Mtls,
        pki: grpc_pki,
    }
}

/// Starts the provider; a bootstrap port lost to another process gets a fresh pick.
async fn start_provider(
    root: &Path,
    api: SocketAddr,
    dir: &Path,
    offerings: &Path,
    pki: &Pki,
    leaf: &(PathBuf, PathBuf),
) -> Result<Provider> {
    start_on_free_bootstrap_port(|bootstrap| {
        provider_process::start(spec(root, api, dir, bootstrap, offerings, pki, leaf))
    })
    .await
}

/// Points Prometheus's file service discovery at the provider's metrics address.
fn write_targets(path: &Path, provider: &Provider) -> Result<()> {
    let metrics = provider
        .metrics
        .context("started without a metrics address")?;
    let targets = serde_json::json!([{"targets": [metrics.to_string()]}]);
    // Written aside and renamed, so Prometheus never reads half a file.
    let partial = path.with_extension("partial");
    std::fs::write(&partial, targets.to_string())?;
    std::fs::rename(&partial, path)?;
    Ok(())
}

/// A Prometheus server of this run; stopped by PID.
struct Prometheus {
    child: Child,
    addr: SocketAddr,
    log: Arc<Mutex<Vec<String>>>,
}

impl Prometheus {
    async fn start(binary: &Path, dir: &Path, rules: &Path, targets: &Path) -> Result<Prometheus> {
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            serde_json::json!({
                "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
                "rule_files": [rules.display().to_string()],
                "scrape_configs": [{
                    "job_name": JOB,
                    "file_sd_configs": [{"files": [targets.display().to_string()], "refresh_interval": "1s"}],
                }],
            })
            .to_string(),
        )?;
        let addr = SocketAddr::from(([127, 0, 0, 1], provider_process::free_port()?));
        let mut child = Command::new(binary)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--log.level=warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("start {}", binary.display()))?;
        let log = Arc::new(Mutex::new(Vec::new()));
        for stream in [
            Box::new(child.stdout.take().context("prometheus stdout")?) as Box<dyn Read + Send>,
            Box::new(child.stderr.take().context("prometheus stderr")?),
        ] {
            let log = log.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    log.lock().unwrap_or_else(|e| e.into_inner()).push(line);
                }
            });
        }
        let mut prometheus = Prometheus { child, addr, log };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = prometheus.child.try_wait()? {
                bail!("prometheus exited with {status}:\n{}", prometheus.logs());
            }
            if matches!(http(addr, "GET", "/-/ready", None), Ok((200, _))) {
                return Ok(prometheus);
            }
            if Instant::now() >= deadline {
                let logs = prometheus.stop();
                bail!("prometheus not ready within 30s:\n{logs}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn logs(&self) -> String {
        self.log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .join("\n")
    }

    /// SIGTERM by PID, then the exit; returns the log.
    fn stop(&mut self) -> String {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = Command::new("kill")
                .args(["-TERM", &self.child.id().to_string()])
                .status();
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while matches!(self.child.try_wait(), Ok(None)) && std::time::Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
        self.logs()
    }

    /// The pending and firing alerts (`/api/v1/alerts`).
    fn alerts(&self) -> Result<Vec<Value>> {
        let (status, body) = http(self.addr, "GET", "/api/v1/alerts", None)?;
        ensure!(status == 200, "/api/v1/alerts: {status} {body}");
        let parsed: Value = serde_json::from_str(&body)?;
        Ok(parsed["data"]["alerts"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    }

    fn firing(&self, alert: &str, labels: &[(&str, &str)]) -> Result<bool> {
        Ok(self.alerts()?.iter().any(|a| {
            a["state"] == "firing"
                && a["labels"]["alertname"] == alert
                && a["labels"]["job"] == JOB
                && labels.iter().all(|(k, v)| a["labels"][*k] == *v)
        }))
    }

    async fn wait_firing(&self, alert: &str, labels: &[(&str, &str)]) -> Result<()> {
        let deadline = Instant::now() + ALERT_DEADLINE;
        while !self.firing(alert, labels)? {
            if Instant::now() >= deadline {
                bail!(
                    "{alert} {labels:?} did not fire within {ALERT_DEADLINE:?}; alerts: {:?}",
                    self.alerts()?
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        Ok(())
    }

    async fn wait_resolved(&self, alert: &str) -> Result<()> {
        let deadline = Instant::now() + ALERT_DEADLINE;
        while self
            .alerts()?
            .iter()
            .any(|a| a["labels"]["alertname"] == alert)
        {
            if Instant::now() >= deadline {
                bail!(
                    "{alert} did not resolve within {ALERT_DEADLINE:?}; alerts: {:?}",
                    self.alerts()?
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        Ok(())
    }
}

impl Prometheus {
    /// Waits (bounded) until no alert is pending or firing.
    async fn wait_all_resolved(&self) -> Result<()> {
        let deadline = Instant::now() + ALERT_DEADLINE;
        loop {
            let left = self.alerts()?;
            if left.is_empty() {
                return Ok(());
            }
            ensure!(
                Instant::now() < deadline,
                "alerts still pending or firing {ALERT_DEADLINE:?} after recovery: {left:#?}"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One HTTP/1.0 exchange on loopback (HTTP/1.0, so the answer is never chunked):
/// (status, body).
fn http(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> Result<(u16, String)> {
    let mut conn = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .with_context(|| format!("connect to {addr}"))?;
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    let body = body.unwrap_or_default();
    write!(
        conn,
        "{method} {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut response = Vec::new();
    conn.read_to_end(&mut response)
        .with_context(|| format!("read the answer to {method} {path}"))?;
    let response = String::from_utf8_lossy(&response);
    let (head, body) = response
        .split_once("\r\n\r\n")
        .with_context(|| format!("malformed HTTP response: {response:?}"))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .with_context(|| format!("no status line in {head:?}"))?;
    Ok((status, body.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates_of_known_days() {
        // Day counts from `date -u -d DATE +%s` / 86400.
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(11_017), (2000, 3, 1));
        assert_eq!(civil_from_days(19_782), (2024, 2, 29));
        assert_eq!(civil_from_days(47_541), (2100, 3, 1));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
    }
}

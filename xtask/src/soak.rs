//! `cargo xtask soak [--cloud hetzner|digitalocean] [--seed N] [--duration D]`: the providers
//! under a bad day at the cloud. The real provider binary runs on its real backend against the
//! API emulator (in this process, so every fault knob is at hand), on a `--state` directory,
//! while:
//!
//! - shard-like workers (each its own shard id, owning a disjoint share of the machines) walk
//!   machines through Create, Configure (which fails: no SSH key / no agent, a failing hook),
//!   Delete and `admin failed release`, retry every acknowledged mutation, and now and then
//!   replay a stale fence token;
//! - a seeded fault injector sends 429 storms, 5xx bursts, creates whose response is lost after
//!   the host exists, requests refused before they take effect, slow boots, out-of-band
//!   deletions and deletions during paged listings (pages of 3), stockouts (the offering sold
//!   out for seconds) and account limits (at the hosts held plus up to two, for seconds; the
//!   provider runs with `--stockout-backoff 2s`), and `kill -9` restarts;
//! - a checker asserts continuously and at the end: at most one live host per machine, no owned
//!   host untracked for longer than the orphan bound, nothing stuck transitional, every
//!   acknowledged mutation reflected unless a later one or an injected fault explains it,
//!   retries of an acknowledged operation return its operation id (a Create whose slot a
//!   stockout or the limit returned meanwhile aside: from Speculative a Create is new work),
//!   stale tokens get FAILED_PRECONDITION and nothing else does, no machine is FAILED by a
//!   stockout or the account's limit (its `last_error`), and every machine answers Get (one
//!   a withdrawn offering hides from List included);
//! - after every 429 storm or 5xx burst, the provider's API budget (read from its metrics)
//!   comes back within a few requests (module `pace`): one storm never leaves it slower than its
//!   share.
//!
//! The seed is printed first, and with every failure, so a failing run replays (the fault
//! schedule and the workers' choices follow from it; thread timing does not).

mod check;
mod clouds;
mod pace;
mod workers;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use tokio::sync::watch;
use tokio::time::Instant;
use tonic::transport::Channel;

use crate::e2e::provider_process::{self, Provider, Spec};
use crate::e2e::wire::{self, ClientSecurity};
use crate::repo;

use self::check::Checker;
use self::clouds::{CloudKind, Emulated};
use self::pace::{Budget, StormWatch};

/// Machines per run (one offering).
const MACHINES: usize = 24;
/// Concurrent shard-like workers.
const WORKERS: usize = 8;
/// Provider timing in the soak: short enough that a minute sees many passes and grace periods.
const RECONCILE_INTERVAL: Duration = Duration::from_secs(1);
const ORPHAN_GRACE: Duration = Duration::from_secs(10);
const CREATE_TIMEOUT: Duration = Duration::from_secs(25);
const CONFIGURE_TIMEOUT: Duration = Duration::from_secs(3);
const DELETE_TIMEOUT: Duration = Duration::from_secs(20);

/// What one run does.
#[derive(Clone, Debug)]
struct Options {
    clouds: Vec<CloudKind>,
    seed: u64,
    duration: Duration,
}

fn usage() -> &'static str {
    "usage: cargo xtask soak [--cloud hetzner|digitalocean] [--seed N] [--duration D (e.g. 60s, 10m)]"
}

/// The options of a run, or `None` when `--help` asked for the usage.
fn parse(args: &[String]) -> Result<Option<Options>> {
    let mut options = Options {
        clouds: vec![CloudKind::Hetzner, CloudKind::DigitalOcean],
        seed: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1),
        duration: Duration::from_secs(60),
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .with_context(|| format!("{flag} needs a value; {}", usage()))
        };
        match flag.as_str() {
            "-h" | "--help" => return Ok(None),
            "--cloud" => {
                options.clouds = vec![match value()?.as_str() {
                    "hetzner" => CloudKind::Hetzner,
                    "digitalocean" => CloudKind::DigitalOcean,
                    other => bail!("--cloud must be hetzner or digitalocean, got {other:?}"),
                }]
            }
            "--seed" => {
                let v = value()?;
                options.seed = v
                    .parse()
                    .with_context(|| format!("--seed must be an unsigned integer, got {v:?}"))?;
            }
            "--duration" => {
                let v = value()?;
                options.duration = parse_duration(v)
                    .with_context(|| format!("--duration must be like 90s or 10m, got {v:?}"))?;
            }
            other => bail!("unknown argument {other:?}; {}", usage()),
        }
    }
    ensure!(
        options.duration >= Duration::from_secs(10),
        "--duration must be at least 10s"
    );
    Ok(Some(options))
}

fn parse_duration(text: &str) -> Option<Duration> {
    let (number, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit())?);
    let n: u64 = number.parse().ok()?;
    match unit {
        "s" => Some(Duration::from_secs(n)),
        "m" => Some(Duration::from_secs(n * 60)),
        "h" => Some(Duration::from_secs(n * 3600)),
        _ => None,
    }
}

pub(crate) fn run(args: &[String]) -> Result<()> {
    let Some(options) = parse(args)? else {
        println!("{}", usage());
        return Ok(());
    };
    let root = repo::root();
    println!(
        "soak: seed {} (replay: cargo xtask soak --seed {} --duration {}s{})",
        options.seed,
        options.seed,
        options.duration.as_secs(),
        if options.clouds.len() == 1 {
            format!(" --cloud {}", options.clouds[0].name())
        } else {
            String::new()
        }
    );
    build(&root)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("start the async runtime")?;
    for (i, cloud) in options.clouds.iter().enumerate() {
        let seed = options.seed.wrapping_add(i as u64);
        let summary = runtime
            .block_on(soak(&root, *cloud, seed, options.duration))
            .with_context(|| {
                format!(
                    "soak {} failed (seed {}; replay: cargo xtask soak --cloud {} --seed {} --duration {}s)",
                    cloud.name(),
                    options.seed,
                    cloud.name(),
                    seed,
                    options.duration.as_secs()
                )
            })?;
        println!("soak {}: passed; {summary}", cloud.name());
    }
    Ok(())
}

fn build(root: &Path) -> Result<()> {
    let status = Command::new(env!("CARGO"))
        .current_dir(root)
        .args(["build", "-p", "hetzner", "-p", "digitalocean"])
        .status()
        .context("run cargo build")?;
    ensure!(status.success(), "cargo build failed ({status})");
    Ok(())
}

/// A small seeded generator (SplitMix64): the soak's only source of chance.
#[derive(Clone, Debug)]
pub(crate) struct Chance(u64);

impl Chance {
    pub(crate) fn new(seed: u64) -> Chance {
        Chance(seed)
    }

    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n`.
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// True with probability `percent` / 100.
    pub(crate) fn percent(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    pub(crate) fn millis(&mut self, low: u64, high: u64) -> Duration {
        Duration::from_millis(low + self.below(high - low + 1))
    }
}

/// Counts of what happened, by name.
#[derive(Clone, Debug, Default)]
pub(crate) struct Tally(Arc<Mutex<BTreeMap<String, u64>>>);

impl Tally {
    pub(crate) fn add(&self, name: &str) {
        *self
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(name.to_owned())
            .or_default() += 1;
    }

    /// How often `name` happened.
    pub(crate) fn count(&self, name: &str) -> u64 {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .copied()
            .unwrap_or(0)
    }

    fn render(&self) -> String {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// The running provider, restartable; workers follow the current channel.
struct Process {
    spec: Spec,
    provider: Option<Provider>,
    channel: watch::Sender<Option<Channel>>,
    /// Panics logged by the runs killed so far.
    panics: usize,
}

/// The panics a provider log reports.
fn panic_lines(log: &str) -> usize {
    log.lines().filter(|l| l.contains("panicked")).count()
}

impl Process {
    /// The running provider's `/metrics` page, if it answers.
    fn metrics(&self) -> Option<String> {
        let addr = self.provider.as_ref()?.metrics?;
        tokio::task::block_in_place(|| crate::e2e::http_get(addr, "/metrics"))
            .ok()
            .map(|(_, body)| body)
    }

    /// The reconcile survey period the running provider reports on its metrics, if it
    /// answers.
    fn survey_period(&self) -> Option<Duration> {
        survey_period(&self.metrics()?)
    }

    async fn start(spec: Spec) -> Result<Process> {
        let provider = provider_process::start(spec.clone()).await?;
        let channel = provider.default_channel().await?;
        let (tx, _) = watch::channel(Some(channel));
        Ok(Process {
            spec,
            provider: Some(provider),
            channel: tx,
            panics: 0,
        })
    }

    /// `kill -9`, then a start on the same `--state`.
    async fn kill_and_restart(&mut self) -> Result<()> {
        self.channel.send_replace(None);
        if let Some(mut provider) = self.provider.take() {
            self.panics += panic_lines(&provider.logs());
            let status = Command::new("kill")
                .args(["-KILL", &provider.pid().to_string()])
                .status()
                .context("run kill -KILL")?;
            ensure!(status.success(), "kill -KILL failed ({status})");
            provider.wait_exit(Duration::from_secs(10)).await?;
        }
        // A start under a fault storm can take longer than one start deadline (the price and
        // capacity warm-up retries within its own budget): try again, as a supervisor would.
        let mut attempt = 0;
        let provider = loop {
            attempt += 1;
            match provider_process::start(self.spec.clone()).await {
                Ok(provider) => break provider,
                Err(e) if attempt < 3 => {
                    eprintln!("soak: restart attempt {attempt} did not serve in time: {e:#}");
                }
                Err(e) => return Err(e.context("restart after kill -9")),
            }
        };
        self.channel
            .send_replace(Some(provider.default_channel().await?));
        self.provider = Some(provider);
        Ok(())
    }

    fn logs(&self) -> String {
        self.provider
            .as_ref()
            .map(Provider::logs)
            .unwrap_or_default()
    }
}

/// The reconcile survey period a metrics page reports (`<prefix>_reconcile_period_seconds`).
fn survey_period(page: &str) -> Option<Duration> {
    page.lines()
        .filter(|l| l.starts_with("bigfleet_"))
        .find_map(|l| l.split_once("_reconcile_period_seconds ").map(|(_, v)| v))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|v| v.is_finite() && *v >= 0.0)
        .map(Duration::from_secs_f64)
}

/// Where the run keeps its files.
fn work_dir(cloud: CloudKind, seed: u64) -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!(
        "bigfleet-soak-{}-{}-{seed}",
        cloud.name(),
        std::process::id()
    ));
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("clean {}", dir.display()))?;
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    Ok(dir)
}

async fn soak(root: &Path, cloud: CloudKind, seed: u64, duration: Duration) -> Result<String> {
    let dir = work_dir(cloud, seed)?;
    let emulated = Emulated::start(cloud).await?;
    emulated.small_pages();
    let spec = emulated.spec(root, &dir, MACHINES)?;
    let mut process = Process::start(spec).await?;
    let tally = Tally::default();
    let ids = machine_ids(&process).await?;
    let checker = Arc::new(Checker::new(emulated.clone(), tally.clone(), ids.clone()));
    let started = Instant::now();
    let end = started + duration;
    let admin = workers::AdminCommand {
        binary: provider_process::target_binary(root, "debug", emulated.binary()),
        socket: dir.join("admin.sock"),
    };
    let outcome = drive(
        &mut process,
        &emulated,
        &checker,
        &tally,
        &admin,
        seed,
        end,
        &ids,
    )
    .await;
    let outcome = match outcome {
        Ok(storms) => settle_and_check(&process, &emulated, &checker)
            .await
            .map(|figures| format!("{figures} {storms}")),
        Err(e) => Err(e),
    };
    // A panic in any run of the provider (each restart's log is read before its kill) fails
    // the soak, whatever else held.
    let outcome = outcome.and_then(|figures| {
        let panics = process.panics + panic_lines(&process.logs());
        ensure!(panics == 0, "the provider logged {panics} panic(s)");
        Ok(figures)
    });
    let (requests, classes) = emulated.requests();
    let result = match outcome {
        Ok(figures) => Ok(format!(
            "{}s, {} restarts; {figures}; {requests} API requests ({:.1}/s; {classes}); {}",
            started.elapsed().as_secs(),
            tally_value(&tally, "fault.kill9"),
            requests as f64 / started.elapsed().as_secs_f64(),
            tally.render()
        )),
        Err(e) => {
            let logs = process.logs();
            let _ = std::fs::write(dir.join("provider.log"), &logs);
            // The running provider's metrics (its API budget, its reconcile pace) beside it.
            if let Some(body) = process.metrics() {
                let _ = std::fs::write(dir.join("metrics.txt"), body);
            }
            eprintln!(
                "soak: the provider log and its metrics are in {}",
                dir.display()
            );
            let tail: Vec<&str> = logs.lines().rev().take(60).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            Err(e.context(format!(
                "counts: {}\nlast provider log lines:\n{}",
                tally.render(),
                tail.join("\n")
            )))
        }
    };
    if let Some(mut provider) = process.provider.take() {
        let _ = provider.stop(Duration::from_secs(10)).await;
    }
    emulated.stop();
    if result.is_ok() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    result
}

fn tally_value(tally: &Tally, name: &str) -> u64 {
    tally
        .0
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(name)
        .copied()
        .unwrap_or(0)
}

/// The machines the provider lists at the start, which the workers share out: the ids are
/// the state's own (BigFleet takes them from List).
async fn machine_ids(process: &Process) -> Result<Vec<String>> {
    let channel = process
        .channel
        .borrow()
        .clone()
        .context("no provider channel at the start")?;
    let mut caller = wire::Caller::new(channel, wire::Shard::new("soak-start", 1));
    let ids: Vec<String> = caller
        .list_all()
        .await
        .context("the first List")?
        .into_iter()
        .map(|m| m.id)
        .collect();
    ensure!(
        ids.len() == MACHINES,
        "the provider lists {} machines at the start, not the {MACHINES} offered",
        ids.len()
    );
    Ok(ids)
}

/// Runs workers, faults and the continuous checker until `end`, following the API budget
/// across the 429 storms and 5xx bursts; returns the storms' figures ([`StormWatch::figures`]).
#[allow(clippy::too_many_arguments)]
async fn drive(
    process: &mut Process,
    emulated: &Emulated,
    checker: &Arc<Checker>,
    tally: &Tally,
    admin: &workers::AdminCommand,
    seed: u64,
    end: Instant,
    ids: &[String],
) -> Result<String> {
    let mut chance = Chance::new(seed);
    let mut handles = Vec::new();
    for w in 0..WORKERS {
        let owned: Vec<String> = ids
            .iter()
            .enumerate()
            .filter(|(i, _)| i % WORKERS == w)
            .map(|(_, id)| id.clone())
            .collect();
        let worker = workers::Worker {
            shard: format!("soak-shard-{w}"),
            machines: owned,
            channel: process.channel.subscribe(),
            checker: checker.clone(),
            tally: tally.clone(),
            chance: Chance::new(chance.next()),
            admin: admin.clone(),
        };
        handles.push(tokio::spawn(worker.run(end)));
    }
    let monitor = {
        let (checker, channel) = (checker.clone(), process.channel.subscribe());
        tokio::spawn(async move { checker.watch(channel, end).await })
    };
    let duration = end.saturating_duration_since(Instant::now());
    // Restarts spread over the run: at least two, one more per three minutes (of the run's
    // length in whole seconds: the start of the provider took a moment off `duration`).
    let restarts = 2 + duration.as_secs_f64().round() as u64 / 180;
    let mut next_kill = Instant::now() + duration / (restarts as u32 + 1);
    let mut kills = 0;
    let mut failure = None;
    let mut storms = StormWatch::default();
    while Instant::now() < end {
        tokio::time::sleep(chance.millis(300, 1500)).await;
        if checker.failed() {
            break;
        }
        if Instant::now() >= next_kill && kills < restarts {
            kills += 1;
            tally.add("fault.kill9");
            if let Err(e) = process.kill_and_restart().await {
                failure = Some(e);
                break;
            }
            checker.restarted();
            storms.restarted();
            next_kill = Instant::now() + duration / (restarts as u32 + 1);
            continue;
        }
        let metrics = process.metrics();
        if let Some(period) = metrics.as_deref().and_then(survey_period) {
            checker.survey_period_reported(period);
        }
        // The budget is back after the last storms, or is getting there.
        let budget = metrics.as_deref().and_then(Budget::read);
        if let Err(e) = storms.look(budget, Instant::now()) {
            failure = Some(e);
            break;
        }
        let (name, lasting) = emulated.inject_random(&mut chance);
        if let Some(lasting) = lasting {
            storms.storm(budget, Instant::now() + lasting);
        }
        tally.add(&format!("fault.{name}"));
    }
    emulated.calm();
    for h in handles {
        if let Err(e) = h.await.context("worker task")? {
            failure.get_or_insert(e);
        }
    }
    if let Err(e) = monitor.await.context("checker task")? {
        failure.get_or_insert(e);
    }
    if let Some(e) = checker.violation() {
        return Err(anyhow::anyhow!(e));
    }
    match failure {
        Some(e) => Err(e),
        None => Ok(storms.figures()),
    }
}

/// After the run: faults off, every machine settles, orphans get their grace, then the final
/// checks.
/// Waits until every machine settled and the final properties hold; returns the run's
/// figures ([`Checker::figures`]).
async fn settle_and_check(
    process: &Process,
    emulated: &Emulated,
    checker: &Arc<Checker>,
) -> Result<String> {
    let channel = process
        .channel
        .borrow()
        .clone()
        .context("no provider channel at the end")?;
    let mut caller = wire::Caller::new(channel, wire::Shard::new("soak-final", 1));
    let settling = Instant::now();
    // Everything settles, and stays settled for an orphan grace plus a few passes.
    let mut quiet_since: Option<Instant> = None;
    loop {
        // Within what the provider's pace promises: surveys at the floor, or paced to the
        // budget share it reports.
        if let Some(period) = process.survey_period() {
            checker.survey_period_reported(period);
        }
        let deadline = settling + check::untracked_bound(checker.survey_period());
        let asked = Instant::now();
        let mut machines = caller.list_all().await.context("final List")?;
        // Slots of a withdrawn offering, or above the account's headroom, are not listed;
        // Get still answers them.
        for id in checker.unlisted(&machines) {
            if let Ok(m) = caller.get(&id).await {
                machines.push(m);
            }
        }
        let busy = machines.iter().any(|m| is_transitional(wire::state_of(m)));
        let mut verdict = checker.final_check(&machines, asked);
        if verdict.is_ok() && !busy {
            // BigFleet's shard, in both reconcile modes, holds every machine in the state the
            // provider reports for it.
            checker.reconcile_shards(&mut caller).await;
            let mut reported = std::collections::HashMap::new();
            for id in checker.held_by_shards() {
                if let Ok(m) = caller.get(&id).await {
                    reported.insert(id, check::model_state(&m));
                }
            }
            verdict = checker.shard_verdict(&reported);
        }
        match (busy, verdict) {
            (false, Ok(())) => {
                let since = *quiet_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= ORPHAN_GRACE + RECONCILE_INTERVAL * 3 {
                    return Ok(checker.figures(&machines));
                }
            }
            (_, Err(e)) if Instant::now() >= deadline => return Err(e),
            (true, _) if Instant::now() >= deadline => {
                bail!("machines still transitional long after the run ended")
            }
            _ => quiet_since = None,
        }
        if let Some(v) = checker.violation() {
            bail!(v);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let _ = emulated;
    }
}

fn is_transitional(state: fleet_proto::v1alpha1::MachineState) -> bool {
    use fleet_proto::v1alpha1::MachineState as S;
    matches!(
        state,
        S::Creating | S::Configuring | S::Draining | S::Deleting
    )
}

/// The spec of a provider on its real backend against `endpoint`, plaintext gRPC on loopback.
pub(crate) fn provider_spec(root: &Path, binary: &str, args: Vec<String>) -> Spec {
    Spec {
        name: format!("{binary} (soak)"),
        binary: provider_process::target_binary(root, "debug", binary),
        args,
        metrics: true,
        security: ClientSecurity::Plaintext,
        pki: wire::pki_dir(root),
    }
}

/// The flags every soak provider gets.
pub(crate) fn common_flags(dir: &Path) -> Vec<String> {
    vec![
        format!("--state={}", dir.join("state").display()),
        format!("--admin-socket={}", dir.join("admin.sock").display()),
        format!("--reconcile-interval={}s", RECONCILE_INTERVAL.as_secs()),
        format!("--orphan-grace={}s", ORPHAN_GRACE.as_secs()),
        format!("--create-timeout={}s", CREATE_TIMEOUT.as_secs()),
        format!("--configure-timeout={}s", CONFIGURE_TIMEOUT.as_secs()),
        format!("--delete-timeout={}s", DELETE_TIMEOUT.as_secs()),
        "--drain-timeout=5s".into(),
        "--shutdown-grace=2s".into(),
        "--price-refresh=0".into(),
        // Capacity faults last seconds: so do the stockout backoffs.
        "--stockout-backoff=2s".into(),
        "--stockout-backoff-max=8s".into(),
        "--log-level=info".into(),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(args: &[&str]) -> Vec<String> {
        args.iter().map(|a| a.to_string()).collect()
    }

    #[test]
    fn options() {
        assert!(parse(&strings(&["--help"])).unwrap().is_none());
        let options = parse(&strings(&[
            "--cloud",
            "digitalocean",
            "--seed",
            "7",
            "--duration",
            "10m",
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(options.clouds.len(), 1);
        assert_eq!(options.seed, 7);
        assert_eq!(options.duration, Duration::from_secs(600));
        for bad in [
            &["--cloud", "aws"][..],
            &["--seed"],
            &["--duration", "5s"],
            &["--fast"],
        ] {
            assert!(parse(&strings(bad)).is_err(), "{bad:?}");
        }
    }
}

//! `cargo xtask bench --scenario cloud-budget`: the cloud API requests of the `hetzner` and
//! `digitalocean` binaries on their real backends, each against its cloud's emulator run in
//! this process, which enforces the cloud's rate limit with its headers, boots servers by time
//! and counts every request by its class of work (`class_of` in the emulators' `ratelimit.rs`).
//!
//! Three kinds of run, each on a fresh emulator and a fresh provider process (release build),
//! all at once:
//!
//! - **a walk**: one machine alone through Create, Configure, Drain and Delete (Configure and
//!   Drain over the Hetzner emulator's sshd, or through a real `bigfleet-agent` playing the
//!   Droplet, as the e2e runs do), then a second Create once the provider learned the boot time;
//! - **bursts**: 50 Creates at once, from a full bucket, from one spent before the provider
//!   started, and from one spent behind its back while it idled;
//! - **the steady state**: owned hosts already in the cloud, and nothing for the provider to do
//!   but reconcile, measured over several survey cycles;
//! - **crowded bursts** ([`crowd`]): 200 Creates beside 1,000 owned hosts under the cloud's
//!   limit, alone on the token and beside another user spending half of it;
//! - **a sold-out offering** ([`soldout`]): a shard creating every listed slot for an hour of
//!   scaled backoffs, counting the requests the offering costs.
//!
//! Walks and bursts run in real time with the real limits and boot times (Hetzner 12 s,
//! DigitalOcean 30 s): the binary paces its boot polls by its own clock, which no emulator
//! setting speeds up. A survey's period is `max(floor, cost / background rate)`, and the steady
//! state scales both terms: on Hetzner the binary reads a time-scaled refill from the
//! `RateLimit-Reset` of a bucket that is short when it starts; DigitalOcean's `RateLimit-Reset`
//! gives no rate, so there the background share is raised tenfold instead. The report gives
//! every figure in real time.

mod crowd;
mod digitalocean;
mod hetzner;
mod report;
mod soldout;
mod surveys;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use fleet_proto::v1alpha1 as pb;
use tokio::task::JoinSet;
use tokio::time::Instant;

use self::report::{Bucket, Burst, Counts, Crowd, Operation, Report, Steady, Storm, total};
use self::surveys::Snapshot;
use super::args::{Cloud, CloudBudget};
use super::procfs::Machine;
use crate::e2e::digitalocean_real::start_on_free_bootstrap_port;
use crate::e2e::hetzner_real::host_of;
use crate::e2e::provider_process::{self, Provider, Spec};
use crate::e2e::wire::{self, Caller, ClientSecurity, Shard, acked, state_of};

/// Creates in a burst.
const CREATES: usize = 50;
/// The shard id the runs' mutations carry (plaintext gRPC: no certificate to match).
const SHARD: &str = "bench-cloud-budget";
/// The cluster the walked machine is configured into.
const CLUSTER: &str = "bench-cloud-budget";
/// How long one transition of the walk may take to settle.
const SETTLE: Duration = Duration::from_secs(240);
/// How long a burst may take (an empty bucket paces it at the refill rate).
const BURST_DEADLINE: Duration = Duration::from_secs(600);
/// How long the request count must stand still before a reading counts: a request sent just
/// after a transition settled (the end of its last poll round) belongs to it.
const QUIET: Duration = Duration::from_secs(3);
/// How long requests may go on before the count is declared never to settle.
const QUIET_BOUND: Duration = Duration::from_secs(90);
/// How long the 429 storm of a storm run lasts.
const STORM: Duration = Duration::from_secs(10);
/// Survey cycles in a steady-state window (after the first survey, whose wait was the floor).
const CYCLES: usize = 3;

/// How often the steady state reads the emulator's counts.
const SAMPLE_EVERY: Duration = Duration::from_millis(10);
/// How long a steady-state run may take to see its surveys.
const STEADY_DEADLINE: Duration = Duration::from_secs(600);
/// From exec to SERVING: a provider starting against a spent bucket paces its startup reads.
const START_DEADLINE: Duration = Duration::from_secs(180);
/// SIGTERM to exit (the default shutdown grace is 25 s).
const STOP_DEADLINE: Duration = Duration::from_secs(35);
/// The binaries' defaults that set their background API use: `--reconcile-interval` (the
/// survey period's floor) and `--price-refresh`.
const RECONCILE_FLOOR: Duration = Duration::from_secs(120);
const PRICE_REFRESH: Duration = Duration::from_secs(1800);
/// The binaries' default `--api-budget-share` and `--api-reconcile-share`: background work
/// gets their product of the token's refill.
const DEFAULT_SHARES: (f64, f64) = (0.5, 0.2);
/// How many times faster than real time the Hetzner steady state runs.
const HETZNER_STEADY_SCALE: f64 = 100.0;
/// How many times faster than real time the DigitalOcean steady state runs: the background
/// share at 1 x 1 over the default 0.5 x 0.2.
const DIGITALOCEAN_STEADY_SCALE: f64 = 10.0;

/// What this bench knows of a cloud besides its name.
trait Facts {
    fn boot(self) -> Duration;
    fn hourly_limit(self) -> f64;
    fn metrics_prefix(self) -> &'static str;
    fn steady_scale(self) -> f64;
    fn survey_gap(self) -> Duration;
    fn steady_flags(self) -> Vec<String>;
    fn steady_conditions(self) -> String;
}

impl Facts for Cloud {
    /// How long a new server of the cloud takes to boot.
    fn boot(self) -> Duration {
        match self {
            Cloud::Hetzner => Duration::from_secs(12),
            Cloud::DigitalOcean => Duration::from_secs(30),
        }
    }

    /// Requests per hour of one token.
    fn hourly_limit(self) -> f64 {
        match self {
            Cloud::Hetzner => 3600.0,
            Cloud::DigitalOcean => 5000.0,
        }
    }

    fn metrics_prefix(self) -> &'static str {
        match self {
            Cloud::Hetzner => "bigfleet_hetzner",
            Cloud::DigitalOcean => "bigfleet_digitalocean",
        }
    }

    /// How many times faster than real time the steady state runs.
    fn steady_scale(self) -> f64 {
        match self {
            Cloud::Hetzner => HETZNER_STEADY_SCALE,
            Cloud::DigitalOcean => DIGITALOCEAN_STEADY_SCALE,
        }
    }

    /// Requests this far apart belong to two surveys: a third of the shortest scaled wait
    /// between surveys (the floor), far above the gap between the pages of one.
    fn survey_gap(self) -> Duration {
        RECONCILE_FLOOR.div_f64(self.steady_scale() * 3.0)
    }

    /// The steady state's flags: the periods scaled, and on DigitalOcean the background share
    /// raised by the scale.
    fn steady_flags(self) -> Vec<String> {
        let scale = self.steady_scale();
        let scaled = |d: Duration| {
            let ms = (d.as_secs_f64() * 1e3 / scale).round();
            if ms % 1000.0 == 0.0 {
                format!("{}s", ms / 1000.0)
            } else {
                format!("{ms}ms")
            }
        };
        let mut flags = vec![
            format!("--reconcile-interval={}", scaled(RECONCILE_FLOOR)),
            format!("--price-refresh={}", scaled(PRICE_REFRESH)),
        ];
        if self == Cloud::DigitalOcean {
            flags.extend([
                "--api-budget-share=1".into(),
                "--api-reconcile-share=1".into(),
            ]);
        }
        flags
    }

    /// How the steady state was set up, for the report.
    fn steady_conditions(self) -> String {
        let flags = self.steady_flags().join(" ");
        match self {
            Cloud::Hetzner => format!(
                "hetzner steady state at {}x real time: the emulator's limit time-scaled and half \
                 its bucket spent before the provider starts, so that the provider reads the \
                 scaled refill from RateLimit-Reset; {flags}",
                self.steady_scale()
            ),
            Cloud::DigitalOcean => format!(
                "digitalocean steady state at {}x real time: DigitalOcean's RateLimit-Reset gives \
                 no refill rate (the binary budgets at the published one), so {flags} give \
                 background work {}x the default {} x {} of it and divide the floors alike, which \
                 makes every period the binary picks (max(floor, survey cost / background rate)) \
                 a tenth of the default's; the emulator's limits time-scaled as much",
                self.steady_scale(),
                self.steady_scale(),
                DEFAULT_SHARES.0,
                DEFAULT_SHARES.1
            ),
        }
    }
}

/// The flags of the walks and bursts besides the backend's: no survey inside a measurement
/// (the steady state measures them).
fn transition_flags() -> Vec<String> {
    vec!["--reconcile-interval=0".into()]
}

/// Lower-case unpadded RFC 4648 base32, as the providers encode machine ids in labels and tags.
fn base32_lower(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";
    let mut out = String::with_capacity(bytes.len().div_ceil(5) * 8);
    let (mut buffer, mut bits) = (0u32, 0u32);
    for &byte in bytes {
        buffer = (buffer << 8) | u32::from(byte);
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            out.push(char::from(ALPHABET[((buffer >> bits) & 31) as usize]));
        }
    }
    if bits > 0 {
        out.push(char::from(ALPHABET[((buffer << (5 - bits)) & 31) as usize]));
    }
    out
}

/// The id of offering slot `index` (provider-core's `fleet::slot_id`).
fn slot_id(provider: &str, instance_type: &str, zone: &str, index: usize) -> String {
    format!("{provider}/OnDemand/{instance_type}/{zone}/{index:03}")
}

/// The value of the first sample of `name` whose labels include every pair of `labels`.
fn sample(exposition: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    exposition.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?;
        let (set, value) = match rest.strip_prefix('{') {
            Some(labelled) => labelled.split_once('}')?,
            None if rest.starts_with(' ') => ("", rest),
            None => return None,
        };
        labels
            .iter()
            .all(|(key, wanted)| set.contains(&format!("{key}=\"{wanted}\"")))
            .then(|| value.split_whitespace().next()?.parse().ok())?
    })
}

/// A runtime for one emulator: its answers never wait on the bench's own tasks.
fn emulator_runtime(name: &str) -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(name)
        .enable_all()
        .build()
        .with_context(|| format!("start the runtime of the {name}"))
}

/// The release binaries the runs start.
struct Binaries {
    hetzner: PathBuf,
    digitalocean: PathBuf,
    agent: PathBuf,
}

impl Binaries {
    fn provider(&self, cloud: Cloud) -> &Path {
        match cloud {
            Cloud::Hetzner => &self.hetzner,
            Cloud::DigitalOcean => &self.digitalocean,
        }
    }
}

/// Builds the providers' release binaries (`cargo build --release -p hetzner -p digitalocean`,
/// a no-op when they are current). Both, whichever clouds run: a build of one package alone
/// unifies the dependencies' features differently and rebuilds them.
fn build(root: &Path) -> Result<Binaries> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = Command::new(cargo);
    command.current_dir(root).args(["build", "--release"]);
    for cloud in Cloud::ALL {
        command.args(["-p", cloud.name()]);
    }
    // This process may be the bench client, built without link-time optimisation: the
    // providers are built as they are released.
    command
        .env_remove("CARGO_PROFILE_RELEASE_LTO")
        .env_remove("CARGO_PROFILE_RELEASE_CODEGEN_UNITS");
    eprintln!(
        "bench: building the release binaries (cargo build --release -p hetzner -p digitalocean)"
    );
    let status = command.status().context("run cargo build")?;
    ensure!(
        status.success(),
        "cargo build --release of the providers failed ({status})"
    );
    let binary = |name| provider_process::target_binary(root, "release", name);
    Ok(Binaries {
        hetzner: binary("hetzner"),
        digitalocean: binary("digitalocean"),
        agent: binary("bigfleet-agent"),
    })
}

/// How a run's cloud and provider start.
struct Setup {
    cloud: Cloud,
    /// SPECULATIVE slots of the one offering.
    slots: usize,
    /// Hosts already in the cloud, owned by the provider, one for each of the first slots.
    owned: usize,
    /// How many times faster than real time the emulator's rate limit runs.
    scale: f64,
    /// How long new servers take to boot.
    boot: Duration,
    /// Whether hosts answer Configure and Drain (the Hetzner emulator's sshd; the agent is
    /// started by the walk).
    configures: bool,
    /// What another user of the token spent before the provider starts.
    spent: Spent,
    /// The provider's flags besides the backend's.
    flags: Vec<String>,
}

/// What another user of the token spent of its bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Spent {
    Nothing,
    Half,
    All,
}

/// The emulator of a run, by cloud.
enum Lab {
    Hetzner(hetzner::Lab),
    DigitalOcean(digitalocean::Lab),
}

impl Lab {
    fn counts(&self) -> Counts {
        match self {
            Lab::Hetzner(lab) => lab.counts(),
            Lab::DigitalOcean(lab) => lab.counts(),
        }
    }

    /// Spends every token left, as another user of the token would.
    fn empty_bucket(&self) {
        match self {
            Lab::Hetzner(lab) => lab.spend(Spent::All),
            Lab::DigitalOcean(lab) => lab.spend(Spent::All),
        }
    }

    /// Every request answered 429 (`Retry-After: 1`, nothing left of the bucket) for
    /// `lasting`: another user of the token spent it all.
    fn storm(&self, lasting: Duration) {
        match self {
            Lab::Hetzner(lab) => lab.emulator.inject_for(
                lasting,
                hcloud_emulator::Fault::RateLimited {
                    retry_after: Some(1),
                    reset_in: Some(1),
                },
            ),
            Lab::DigitalOcean(lab) => lab.emulator.fail_for(
                lasting,
                do_emulator::Fault {
                    status: 429,
                    retry_after: Some(1),
                },
            ),
        }
    }

    fn live_hosts(&self) -> usize {
        match self {
            Lab::Hetzner(lab) => lab.live_hosts(),
            Lab::DigitalOcean(lab) => lab.live_hosts(),
        }
    }

    /// Spends up to `n` tokens of the bucket, as another user of the token would, and says how
    /// many it got.
    fn drainer(&self) -> Box<dyn Fn(u32) -> u32 + Send> {
        match self {
            Lab::Hetzner(lab) => {
                let emulator = lab.emulator.clone();
                Box::new(move |n| emulator.drain_rate_limit(n))
            }
            Lab::DigitalOcean(lab) => {
                let emulator = lab.emulator.clone();
                Box::new(move |n| emulator.drain_rate_limit(n))
            }
        }
    }
}

/// One run's emulator, provider process and gRPC client.
struct Rig {
    cloud: Cloud,
    lab: Lab,
    provider: Provider,
    caller: Caller,
}

fn spec(root: &Path, cloud: Cloud, binary: &Path, args: Vec<String>) -> Spec {
    Spec {
        name: format!("{} (cloud-budget)", cloud.name()),
        binary: binary.to_owned(),
        args,
        metrics: true,
        security: ClientSecurity::Plaintext,
        pki: wire::pki_dir(root),
    }
}

impl Rig {
    async fn start(root: &Path, binaries: &Binaries, dir: &Path, setup: Setup) -> Result<Rig> {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
        let offerings = dir.join("offerings.json");
        let binary = binaries.provider(setup.cloud);
        let (lab, provider) = match setup.cloud {
            Cloud::Hetzner => {
                let lab = hetzner::Lab::start(dir, &setup).await?;
                std::fs::write(&offerings, hetzner::offerings(setup.slots))
                    .context("write the offerings")?;
                lab.spend(setup.spent);
                let mut args = lab.args(&offerings);
                args.extend(setup.flags.iter().cloned());
                let spec = spec(root, setup.cloud, binary, args);
                let provider = provider_process::start_within(spec, START_DEADLINE).await?;
                (Lab::Hetzner(lab), provider)
            }
            Cloud::DigitalOcean => {
                let lab = digitalocean::Lab::start(dir, &setup).await?;
                std::fs::write(&offerings, digitalocean::offerings(setup.slots))
                    .context("write the offerings")?;
                lab.spend(setup.spent);
                let provider = start_on_free_bootstrap_port(|bootstrap| {
                    let mut args = lab.args(root, bootstrap, &offerings);
                    args.extend(setup.flags.iter().cloned());
                    provider_process::start_within(
                        spec(root, setup.cloud, binary, args),
                        START_DEADLINE,
                    )
                })
                .await?;
                (Lab::DigitalOcean(lab), provider)
            }
        };
        let caller = Caller::new(provider.default_channel().await?, Shard::new(SHARD, 1));
        Ok(Rig {
            cloud: setup.cloud,
            lab,
            provider,
            caller,
        })
    }

    /// The emulator's counts once no request arrived for [`QUIET`].
    async fn quiet(&self) -> Result<Counts> {
        let started = Instant::now();
        let mut counts = self.lab.counts();
        let mut changed = Instant::now();
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let now = self.lab.counts();
            if now != counts {
                counts = now;
                changed = Instant::now();
            } else if changed.elapsed() >= QUIET {
                return Ok(counts);
            }
            ensure!(
                started.elapsed() < QUIET_BOUND,
                "requests never stopped for {QUIET:?} within {QUIET_BOUND:?}: {counts:?}"
            );
        }
    }

    /// Sends one transition, waits for it to settle and for its requests to end; the
    /// operation is called `name`.
    async fn step(
        &mut self,
        name: &'static str,
        transition: Transition,
        id: &str,
    ) -> Result<(pb::Machine, Operation)> {
        let before = self.quiet().await?;
        let started = Instant::now();
        let ack = match transition {
            Transition::Create => self.caller.create(id).await,
            Transition::Configure => self.caller.configure(id, CLUSTER, HashMap::new()).await,
            Transition::Drain => self.caller.drain(id).await,
            Transition::Delete => self.caller.delete(id).await,
        }
        .with_context(|| format!("{name} {id}"))?;
        let want = transition.settles_in();
        ensure!(
            state_of(acked(&ack)) != pb::MachineState::Failed,
            "{name} {id}: {ack:?}"
        );
        let settled = self
            .caller
            .wait_for_state(id, want, SETTLE)
            .await
            .with_context(|| name.to_owned())?;
        let took = started.elapsed();
        let after = self.quiet().await?;
        Ok((
            settled,
            Operation {
                cloud: self.cloud,
                name,
                requests: report::since(&after, &before),
                took,
            },
        ))
    }

    fn metrics(&self) -> Result<String> {
        let addr = self
            .provider
            .metrics
            .context("the provider has no metrics address")?;
        let (status, body) = crate::e2e::http_get(addr, "/metrics")?;
        ensure!(status == 200, "GET /metrics: {status}");
        Ok(body)
    }

    /// Waits until `want` machines are IDLE; fails when one goes FAILED or at `deadline`.
    async fn until_idle(&mut self, want: usize, deadline: Instant) -> Result<()> {
        loop {
            let machines = self.caller.list_all().await.context("List")?;
            if let Some(failed) = machines
                .iter()
                .find(|m| state_of(m) == pb::MachineState::Failed)
            {
                bail!("{} went FAILED: {}", failed.id, failed.last_error);
            }
            let idle = machines
                .iter()
                .filter(|m| state_of(m) == pb::MachineState::Idle)
                .count();
            if idle == want {
                return Ok(());
            }
            ensure!(
                Instant::now() < deadline,
                "{idle} of {want} machines IDLE by the deadline"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops the provider; an `outcome` that failed gets the end of its log.
    async fn finish<T>(mut self, outcome: Result<T>) -> Result<T> {
        let mut logs = super::tail(&self.provider.logs(), 30);
        if let Lab::DigitalOcean(lab) = &mut self.lab {
            let agent = lab.agent_log();
            if !agent.is_empty() {
                logs.push_str("\nbigfleet-agent log tail:\n");
                logs.push_str(&super::tail(&agent, 15));
            }
            lab.stop_agent();
        }
        let stopped = self.provider.stop(STOP_DEADLINE).await;
        match outcome {
            Err(e) => Err(e.context(format!("provider log tail:\n{logs}"))),
            Ok(value) => stopped.map(|()| value),
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Transition {
    Create,
    Configure,
    Drain,
    Delete,
}

impl Transition {
    fn settles_in(self) -> pb::MachineState {
        match self {
            Transition::Create | Transition::Drain => pb::MachineState::Idle,
            Transition::Configure => pb::MachineState::Configured,
            Transition::Delete => pb::MachineState::Speculative,
        }
    }
}

/// The Speculative slots the provider lists, the oldest id first (the ids are the state's
/// own; BigFleet takes them from List).
async fn spare_slots(caller: &mut Caller) -> Result<Vec<String>> {
    let mut ids: Vec<(u64, String)> = caller
        .list_all()
        .await
        .context("List the slots")?
        .into_iter()
        .filter(|m| m.state == pb::MachineState::Speculative as i32 && m.host.is_none())
        .map(|m| {
            let n =
                m.id.rsplit('/')
                    .next()
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(u64::MAX);
            (n, m.id)
        })
        .collect();
    ids.sort();
    Ok(ids.into_iter().map(|(_, id)| id).collect())
}

/// One machine alone through Create, Configure, Drain and Delete, then a second machine's
/// Create with the boot time learned.
async fn walk(
    root: &Path,
    binaries: &Binaries,
    dir: &Path,
    cloud: Cloud,
) -> Result<Vec<Operation>> {
    let setup = Setup {
        cloud,
        slots: 2,
        owned: 0,
        scale: 1.0,
        boot: cloud.boot(),
        configures: true,
        spent: Spent::Nothing,
        flags: transition_flags(),
    };
    let mut rig = Rig::start(root, binaries, dir, setup).await?;
    let outcome = walk_on(&mut rig, binaries).await;
    rig.finish(outcome).await
}

async fn walk_on(rig: &mut Rig, binaries: &Binaries) -> Result<Vec<Operation>> {
    use Transition::*;
    let spare = spare_slots(&mut rig.caller).await?;
    let (first, second) = (spare[0].clone(), spare[1].clone());
    let mut operations = Vec::new();
    let (idle, create) = rig.step("Create", Create, &first).await?;
    operations.push(create);
    match &rig.lab {
        Lab::Hetzner(lab) => lab.before_configure(&host_of(&idle))?,
        Lab::DigitalOcean(_) => {
            let enrollment = enroll(rig, binaries, &first).await?;
            operations.push(enrollment);
        }
    }
    operations.push(rig.step("Configure", Configure, &first).await?.1);
    operations.push(rig.step("Drain", Drain, &first).await?.1);
    operations.push(rig.step("Delete", Delete, &first).await?.1);
    if let Lab::DigitalOcean(lab) = &mut rig.lab {
        lab.stop_agent();
    }
    let (_, learned) = rig
        .step("Create (boot time learned)", Create, &second)
        .await?;
    operations.push(learned);
    rig.step("Delete", Delete, &second).await?;
    Ok(operations)
}

/// Boots the walked Droplet's agent and waits for its enrollment.
async fn enroll(rig: &mut Rig, binaries: &Binaries, id: &str) -> Result<Operation> {
    let before = rig.quiet().await?;
    let started = Instant::now();
    if let Lab::DigitalOcean(lab) = &mut rig.lab {
        lab.boot_agent(&binaries.agent, id)?;
    }
    let name = format!("{}_bootstrap_enrollments_total", rig.cloud.metrics_prefix());
    loop {
        let body = rig.metrics()?;
        if sample(&body, &name, &[("outcome", "enrolled")]).is_some_and(|n| n >= 1.0) {
            break;
        }
        ensure!(
            started.elapsed() < SETTLE,
            "the agent did not enroll within {SETTLE:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let took = started.elapsed();
    let after = rig.quiet().await?;
    Ok(Operation {
        cloud: rig.cloud,
        name: "agent enrollment",
        requests: report::since(&after, &before),
        took,
    })
}

/// `CREATES` Creates at once, each of a fresh slot, until every machine is IDLE.
async fn burst(
    root: &Path,
    binaries: &Binaries,
    dir: &Path,
    cloud: Cloud,
    bucket: Bucket,
) -> Result<Burst> {
    let setup = Setup {
        cloud,
        slots: CREATES,
        owned: 0,
        scale: 1.0,
        boot: cloud.boot(),
        configures: false,
        spent: if bucket == Bucket::Empty {
            Spent::All
        } else {
            Spent::Nothing
        },
        flags: transition_flags(),
    };
    let mut rig = Rig::start(root, binaries, dir, setup).await?;
    let outcome = burst_on(&mut rig, bucket).await;
    rig.finish(outcome).await
}

async fn burst_on(rig: &mut Rig, bucket: Bucket) -> Result<Burst> {
    let ids: Vec<String> = spare_slots(&mut rig.caller).await?[..CREATES].to_vec();
    let mut before = rig.quiet().await?;
    if bucket == Bucket::Emptied {
        rig.lab.empty_bucket();
        before = rig.lab.counts();
    }
    let started = Instant::now();
    for id in &ids {
        rig.caller
            .create(id)
            .await
            .with_context(|| format!("Create {id}"))?;
    }
    rig.until_idle(CREATES, started + BURST_DEADLINE).await?;
    let wall = started.elapsed();
    let after = rig.quiet().await?;
    let live = rig.lab.live_hosts();
    ensure!(live == CREATES, "{live} hosts in the cloud, want {CREATES}");
    Ok(Burst {
        cloud: rig.cloud,
        bucket,
        creates: CREATES,
        requests: report::since(&after, &before),
        wall,
    })
}

/// `CREATES` Creates from a full bucket, with a [`STORM`] of 429s starting with the first one
/// when `stormy`: how long each took from its acknowledgement to IDLE.
async fn storm(
    root: &Path,
    binaries: &Binaries,
    dir: &Path,
    cloud: Cloud,
    stormy: bool,
) -> Result<Storm> {
    let setup = Setup {
        cloud,
        slots: CREATES,
        owned: 0,
        scale: 1.0,
        boot: cloud.boot(),
        configures: false,
        spent: Spent::Nothing,
        flags: transition_flags(),
    };
    let mut rig = Rig::start(root, binaries, dir, setup).await?;
    let outcome = storm_on(&mut rig, stormy).await;
    rig.finish(outcome).await
}

async fn storm_on(rig: &mut Rig, stormy: bool) -> Result<Storm> {
    let ids: Vec<String> = spare_slots(&mut rig.caller).await?[..CREATES].to_vec();
    let before = rig.quiet().await?;
    if stormy {
        rig.lab.storm(STORM);
    }
    let mut acked = HashMap::new();
    for id in &ids {
        rig.caller
            .create(id)
            .await
            .with_context(|| format!("Create {id}"))?;
        acked.insert(id.clone(), Instant::now());
    }
    let deadline = Instant::now() + BURST_DEADLINE;
    let mut took: HashMap<String, Duration> = HashMap::new();
    while took.len() < ids.len() {
        for m in rig.caller.list_all().await.context("List")? {
            match state_of(&m) {
                pb::MachineState::Failed => bail!("{} went FAILED: {}", m.id, m.last_error),
                pb::MachineState::Idle if !took.contains_key(&m.id) => {
                    if let Some(at) = acked.get(&m.id) {
                        took.insert(m.id.clone(), at.elapsed());
                    }
                }
                _ => {}
            }
        }
        ensure!(
            Instant::now() < deadline,
            "{} of {CREATES} Creates IDLE by the deadline",
            took.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let after = rig.quiet().await?;
    let mut latencies: Vec<Duration> = took.into_values().collect();
    latencies.sort();
    let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q).round() as usize];
    Ok(Storm {
        cloud: rig.cloud,
        storm: stormy.then_some(STORM),
        creates: CREATES,
        p50: at(0.5),
        p99: at(0.99),
        max: at(1.0),
        requests: report::since(&after, &before),
    })
}

/// `hosts` owned hosts and nothing to do but reconcile, time-scaled, over [`CYCLES`] survey
/// cycles after the first survey.
async fn steady(
    root: &Path,
    binaries: &Binaries,
    dir: &Path,
    cloud: Cloud,
    hosts: usize,
) -> Result<Steady> {
    let scale = cloud.steady_scale();
    let setup = Setup {
        cloud,
        slots: hosts,
        owned: hosts,
        scale,
        boot: cloud.boot().div_f64(scale),
        configures: false,
        // Hetzner: a bucket short by half, so the first answers give the scaled refill.
        spent: match cloud {
            Cloud::Hetzner => Spent::Half,
            Cloud::DigitalOcean => Spent::Nothing,
        },
        flags: cloud.steady_flags(),
    };
    let rig = Rig::start(root, binaries, dir, setup).await?;
    let outcome = steady_on(&rig, hosts, scale).await;
    rig.finish(outcome).await
}

async fn steady_on(rig: &Rig, hosts: usize, scale: f64) -> Result<Steady> {
    let origin = Instant::now();
    let mut record = vec![Snapshot {
        at: Duration::ZERO,
        counts: rig.lab.counts(),
    }];
    let mut looked = origin;
    let found = loop {
        tokio::time::sleep(SAMPLE_EVERY).await;
        let counts = rig.lab.counts();
        if record.last().is_some_and(|s| s.counts != counts) {
            record.push(Snapshot {
                at: origin.elapsed(),
                counts,
            });
        }
        if looked.elapsed() >= Duration::from_millis(100) {
            looked = Instant::now();
            let found = surveys::find(&record, rig.cloud.survey_gap());
            if found.len() >= CYCLES + 2 {
                break found;
            }
            ensure!(
                origin.elapsed() < STEADY_DEADLINE,
                "{} surveys within {STEADY_DEADLINE:?}, want {}",
                found.len(),
                CYCLES + 2
            );
        }
    };
    let window = surveys::window(&record, &found, 1, CYCLES, scale)
        .context("the surveys found make no window")?;
    let metrics = rig.metrics()?;
    let prefix = rig.cloud.metrics_prefix();
    Ok(Steady {
        cloud: rig.cloud,
        hosts,
        scale,
        cycles: window.cycles,
        requests: window.requests,
        real_seconds: window.real_seconds,
        period_seconds: sample(&metrics, &format!("{prefix}_reconcile_period_seconds"), &[])
            .map(|p| p * scale),
        provider_survey_requests: sample(
            &metrics,
            &format!("{prefix}_reconcile_survey_requests"),
            &[],
        ),
        hourly_limit: rig.cloud.hourly_limit(),
    })
}

/// What one run of the scenario produced.
enum Figures {
    Walk(Vec<Operation>),
    Burst(Burst),
    Steady(Steady),
    Crowd(Crowd),
    Storm(Storm),
    Soldout(soldout::Soldout),
}

/// Every run at once; the report has what completed and names what failed.
async fn measure_all(root: PathBuf, binaries: Binaries, options: CloudBudget) -> Result<Report> {
    let scratch = std::env::temp_dir().join(format!(
        "bigfleet-bench-cloud-budget-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).with_context(|| format!("create {}", scratch.display()))?;
    let binaries = std::sync::Arc::new(binaries);
    let mut jobs = JoinSet::new();
    let mut spawn = |name: String, job: Job| {
        let (root, binaries, dir) = (root.clone(), binaries.clone(), scratch.join(&name));
        jobs.spawn(async move {
            let started = std::time::Instant::now();
            let result = match job {
                Job::Walk(cloud) => walk(&root, &binaries, &dir, cloud).await.map(Figures::Walk),
                Job::Burst(cloud, bucket) => burst(&root, &binaries, &dir, cloud, bucket)
                    .await
                    .map(Figures::Burst),
                Job::Steady(cloud, hosts) => steady(&root, &binaries, &dir, cloud, hosts)
                    .await
                    .map(Figures::Steady),
                Job::Crowded(cloud, shared) => {
                    crowd::crowded(&root, &binaries, &dir, cloud, shared)
                        .await
                        .map(Figures::Crowd)
                }
                Job::Storm(cloud, stormy) => storm(&root, &binaries, &dir, cloud, stormy)
                    .await
                    .map(Figures::Storm),
                Job::Soldout(cloud) => soldout::soldout(&root, &binaries, &dir, cloud)
                    .await
                    .map(Figures::Soldout),
            };
            (name, started.elapsed(), result)
        });
    };
    for &cloud in &options.clouds {
        if options.runs("storm") {
            for stormy in [false, true] {
                let name = if stormy { "storm" } else { "calm" };
                spawn(
                    format!("{}-storm-{name}", cloud.name()),
                    Job::Storm(cloud, stormy),
                );
            }
        }
        if options.runs("walk") {
            spawn(format!("{}-walk", cloud.name()), Job::Walk(cloud));
        }
        if options.runs("soldout") {
            spawn(format!("{}-soldout", cloud.name()), Job::Soldout(cloud));
        }
        for bucket in Bucket::ALL.into_iter().filter(|_| options.runs("burst")) {
            let label = bucket.name().replace(' ', "-");
            spawn(
                format!("{}-burst-{label}", cloud.name()),
                Job::Burst(cloud, bucket),
            );
        }
        for &hosts in options.hosts.iter().filter(|_| options.runs("steady")) {
            spawn(
                format!("{}-steady-{hosts}", cloud.name()),
                Job::Steady(cloud, hosts),
            );
        }
        for shared in [false, true]
            .into_iter()
            .filter(|_| options.runs("crowded"))
        {
            let beside = if shared { "shared" } else { "alone" };
            spawn(
                format!("{}-crowded-{beside}", cloud.name()),
                Job::Crowded(cloud, shared),
            );
        }
    }
    let mut report = Report::default();
    while let Some(joined) = jobs.join_next().await {
        let (name, took, result) = match joined {
            Ok(done) => done,
            Err(e) => {
                report
                    .failures
                    .push(format!("a run ended without a result: {e}"));
                continue;
            }
        };
        match result {
            Ok(figures) => {
                eprintln!(
                    "bench: cloud-budget {name}: {} ({took:.1?})",
                    summary(&figures)
                );
                match figures {
                    Figures::Walk(ops) => report.operations.extend(ops),
                    Figures::Burst(b) => report.bursts.push(b),
                    Figures::Steady(s) => report.steady.push(s),
                    Figures::Crowd(c) => report.crowds.push(c),
                    Figures::Storm(s) => report.storms.push(s),
                    Figures::Soldout(s) => report.soldouts.push(s),
                }
            }
            Err(e) => {
                eprintln!("bench: cloud-budget {name} FAILED ({took:.1?})");
                report.failures.push(format!("{name}: {e:#}"));
            }
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);
    // Runs end in any order; the report keeps one. A walk's transitions keep theirs.
    report.operations.sort_by_key(|op| op.cloud);
    report.bursts.sort_by_key(|b| (b.cloud, b.bucket));
    report.steady.sort_by_key(|s| (s.cloud, s.hosts));
    report.crowds.sort_by_key(|c| (c.cloud, c.other.is_some()));
    report.storms.sort_by_key(|s| (s.cloud, s.storm));
    report.soldouts.sort_by_key(|s| s.cloud);
    report.conditions = conditions(&options.clouds);
    Ok(report)
}

#[derive(Clone, Copy, Debug)]
enum Job {
    Walk(Cloud),
    Burst(Cloud, Bucket),
    Steady(Cloud, usize),
    /// Whether another user shares the token.
    Crowded(Cloud, bool),
    /// Whether a 429 storm meets the Creates.
    Storm(Cloud, bool),
    Soldout(Cloud),
}

fn summary(figures: &Figures) -> String {
    match figures {
        Figures::Walk(ops) => ops
            .iter()
            .map(|op| format!("{} {}", op.name, total(&op.requests)))
            .collect::<Vec<_>>()
            .join(", "),
        Figures::Burst(b) => format!(
            "{} requests, {} answered 429, in {:.1?}",
            total(&b.requests),
            report::refused(&b.requests),
            b.wall
        ),
        Figures::Steady(s) => format!(
            "{} requests per survey, {:.0} per hour ({:.1}% of the limit)",
            super::report::number(s.per_survey()),
            s.per_hour(),
            s.share() * 100.0
        ),
        Figures::Crowd(c) => format!(
            "{} requests, {} answered 429, in {:.1?} (budget time {:.1?})",
            total(&c.requests),
            report::refused(&c.requests),
            c.wall,
            c.budget
        ),
        Figures::Storm(s) => format!(
            "Create latency p50 {:.1?}, p99 {:.1?}, {} requests",
            s.p50,
            s.p99,
            total(&s.requests)
        ),
        Figures::Soldout(s) => soldout::summary(s),
    }
}

/// How the runs were set up, for the report.
fn conditions(clouds: &[Cloud]) -> Vec<String> {
    let mut lines = vec![format!(
        "walks and bursts: real time, the clouds' real limits (Hetzner 3,600 requests, one back \
         a second; DigitalOcean 5,000 an hour and 250 a minute) and boot times ({}), the \
         binaries' default flags but {} (no survey inside a measurement); a request sent after a \
         transition settled counts for it until none came for {} s",
        clouds
            .iter()
            .map(|c| format!("{} {} s", c.name(), c.boot().as_secs()))
            .collect::<Vec<_>>()
            .join(", "),
        transition_flags().join(" "),
        QUIET.as_secs()
    )];
    lines.extend(clouds.iter().map(|c| c.steady_conditions()));
    lines.extend(crowd::conditions(clouds));
    lines.push(format!(
        "steady state: owned hosts put into the emulator as the provider labels or tags its own \
         (they run no sshd or agent); requests/hour are the requests of the surveys and of the \
         out-of-band checks between them (every class but catalog) over {CYCLES} whole survey \
         cycles after the first survey, the waits between surveys counted at the scale and the \
         surveys' own time once; period is the provider's <prefix>_reconcile_period_seconds at \
         the end of the window, times the scale"
    ));
    lines
}

/// Runs the scenario and prints its report.
pub(super) fn run(options: &CloudBudget) -> Result<()> {
    let root = crate::repo::root();
    let binaries = match &options.providers {
        Some(dir) => Binaries {
            hetzner: dir.join("hetzner"),
            digitalocean: dir.join("digitalocean"),
            agent: dir.join("bigfleet-agent"),
        },
        None => build(&root)?,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .context("start the runtime")?;
    let machine = Machine::describe();
    let started = std::time::Instant::now();
    let report = runtime.block_on(measure_all(root, binaries, options.clone()))?;
    let took = started.elapsed();
    let json = report::to_json(&report, &machine, took);
    if let Some(path) = &options.json_out {
        std::fs::write(path, serde_json::to_string_pretty(&json)?)
            .with_context(|| format!("write {}", path.display()))?;
    }
    if options.json {
        println!("{}", serde_json::to_string_pretty(&json)?);
    } else {
        println!(
            "machine: {} CPUs, {}, {} MiB, Linux {}\n",
            machine.cpus, machine.cpu_model, machine.memory_mib, machine.kernel
        );
        print!("{}", report::tables(&report));
        println!("\nbench: cloud-budget in {took:.1?}");
    }
    for failure in &report.failures {
        eprintln!("bench: FAILED {failure}");
    }
    if !report.failures.is_empty() {
        bail!("{} runs of cloud-budget failed", report.failures.len());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base32_as_the_providers_write_it() {
        assert_eq!(base32_lower(b""), "");
        assert_eq!(base32_lower(b"f"), "my");
        assert_eq!(base32_lower(b"foobar"), "mzxw6ytboi");
        assert_eq!(base32_lower(b"digitalocean"), "mruwo2lumfwg6y3fmfxa");
    }

    #[test]
    fn samples_of_an_exposition() {
        let body = "# TYPE x counter\n\
                    bigfleet_x_total{outcome=\"enrolled\"} 2\n\
                    bigfleet_x_total{outcome=\"conflict\"} 1\n\
                    bigfleet_x_seconds 12.5\n\
                    bigfleet_x_seconds_count 3\n";
        assert_eq!(
            sample(body, "bigfleet_x_total", &[("outcome", "enrolled")]),
            Some(2.0)
        );
        assert_eq!(sample(body, "bigfleet_x_total", &[]), Some(2.0));
        assert_eq!(sample(body, "bigfleet_x_seconds", &[]), Some(12.5));
        assert_eq!(
            sample(body, "bigfleet_x_total", &[("outcome", "repeated")]),
            None
        );
        assert_eq!(sample(body, "bigfleet_y", &[]), None);
    }

    #[test]
    fn steady_state_scales_every_period_alike() {
        assert_eq!(
            Cloud::Hetzner.steady_flags(),
            ["--reconcile-interval=1200ms", "--price-refresh=18s"]
        );
        assert_eq!(
            DIGITALOCEAN_STEADY_SCALE,
            (1.0 / (DEFAULT_SHARES.0 * DEFAULT_SHARES.1)).round()
        );
        assert_eq!(
            Cloud::DigitalOcean.steady_flags(),
            [
                "--reconcile-interval=12s",
                "--price-refresh=180s",
                "--api-budget-share=1",
                "--api-reconcile-share=1"
            ]
        );
        assert_eq!(Cloud::Hetzner.survey_gap(), Duration::from_millis(400));
        assert_eq!(Cloud::DigitalOcean.survey_gap(), Duration::from_secs(4));
    }
}

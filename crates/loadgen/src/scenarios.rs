//! The scenarios of beyond.md section 10, each a warm-up and a measured window against a
//! connected provider (or, for `startup`, against the command that starts one). Every figure
//! of a latency comes with the provider's CPU time per operation over the same window.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use fleet_proto::v1alpha1 as pb;

use super::args::{Options, Tls};
use super::load::{self, Fence, WalkPlan, WalkResult};
use super::procfs::{CpuSample, Memory, Process};
use super::provider::{self, Provider};
use super::report::{CPU, PEAK_RSS, RATE, Row};
use super::stats::Samples;

/// Full Lists per measured series (fewer when the window closes first).
const LIST_COUNT: usize = 20;
/// Full Lists of the warm-up.
const LIST_WARMUP: usize = 2;
/// Machines walked before a measured walk, to warm both sides up.
const WALK_WARMUP: usize = 32;
/// Configure/Drain round trips per machine in the mixed scenario, so a 10k inventory lasts.
const MIXED_CYCLES: usize = 4;
/// Machines walked before a restart, so the state holds log records and not only a seed.
const RESTART_WALK: usize = 32;
/// How long a freshly started provider sits idle before its idle RSS is read.
const IDLE_WAIT: Duration = Duration::from_millis(500);

/// A measured window: wall time and the provider's CPU and memory.
struct Meter {
    process: Option<Process>,
    cpu: Option<CpuSample>,
    client_cpu: CpuSample,
    started: Instant,
}

struct Window {
    elapsed: Duration,
    cpu: Option<Duration>,
    /// This process's own CPU time over the window: a client that nears one core per client
    /// thread is part of the measured latency.
    client_cpu: Duration,
    memory: Option<Memory>,
}

fn client() -> Process {
    Process::new(std::process::id())
}

impl Meter {
    fn start(process: Option<Process>) -> Result<Meter> {
        let cpu = process.map(|p| p.cpu()).transpose()?;
        Ok(Meter {
            process,
            cpu,
            client_cpu: client().cpu()?,
            started: Instant::now(),
        })
    }

    fn stop(self) -> Result<Window> {
        let elapsed = self.started.elapsed();
        let client_cpu = client().cpu()?.since(&self.client_cpu);
        let (cpu, memory) = match (self.process, &self.cpu) {
            (Some(p), Some(before)) => (Some(p.cpu()?.since(before)), Some(p.memory()?)),
            _ => (None, None),
        };
        Ok(Window {
            elapsed,
            cpu,
            client_cpu,
            memory,
        })
    }
}

impl Window {
    fn rate(&self, ops: usize) -> f64 {
        ops as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Provider CPU per operation, in microseconds.
    fn cpu_per_op(&self, ops: usize) -> Option<f64> {
        (ops > 0).then_some(())?;
        self.cpu.map(|cpu| cpu.as_secs_f64() * 1e6 / ops as f64)
    }

    fn peak_mib(&self) -> Option<f64> {
        self.memory.map(Memory::peak_mib)
    }

    /// The provider's and the client's share of the window, in cores.
    fn cores(&self) -> (Option<f64>, f64) {
        let secs = self.elapsed.as_secs_f64().max(1e-9);
        (
            self.cpu.map(|c| c.as_secs_f64() / secs),
            self.client_cpu.as_secs_f64() / secs,
        )
    }

    /// Rate, CPU per op, peak RSS and the cores used on a row.
    fn onto(&self, row: Row, ops: usize) -> Row {
        let (provider, client) = self.cores();
        row.set(RATE, self.rate(ops))
            .set_opt(CPU, self.cpu_per_op(ops))
            .set_opt(PEAK_RSS, self.peak_mib())
            .set_opt("provider_cores", provider)
            .set("client_cores", client)
    }
}

fn seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(7, |d| d.as_nanos() as u64)
}

/// `get`: Get on random existing ids, at concurrency 1 and 32.
pub(crate) async fn get(provider: &Provider, options: &Options) -> Result<Vec<Row>> {
    let client = provider.client();
    let ids = Arc::new(load::all_ids(&client).await?);
    let mut rows = Vec::new();
    for &concurrency in &options.concurrency {
        load::get_loop(&client, ids.clone(), concurrency, options.warmup, seed()).await?;
        let meter = Meter::start(provider.process)?;
        let mut samples =
            load::get_loop(&client, ids.clone(), concurrency, options.duration, seed()).await?;
        let window = meter.stop()?;
        let n = samples.len();
        rows.push(window.onto(
            Row::new(format!("Get c={concurrency}")).latencies(&mut samples),
            n,
        ));
    }
    Ok(rows)
}

/// `list`: full Lists one after another; latency, response size, peak RSS after them.
pub(crate) async fn list(provider: &Provider, options: &Options) -> Result<Vec<Row>> {
    let channel = &provider.channel;
    let all = pb::ListFilter::default();
    load::list_series(channel, &all, LIST_WARMUP, options.timeout).await?;
    let meter = Meter::start(provider.process)?;
    let mut series = load::list_series(channel, &all, LIST_COUNT, options.duration).await?;
    let window = meter.stop()?;
    let n = series.latencies.len();
    let row = Row::new("List (full)")
        .latencies(&mut series.latencies)
        .set(
            "response_mib",
            series.response_bytes as f64 / (1 << 20) as f64,
        )
        .set("machines", series.machines as f64);
    Ok(vec![window.onto(row, n)])
}

/// `list-filtered`: a state-filtered List capped at 100, a delta List since the head, and a
/// List of a state no machine is in.
pub(crate) async fn list_filtered(provider: &Provider, options: &Options) -> Result<Vec<Row>> {
    let client = provider.client();
    let head = client
        .clone()
        .list(pb::ListFilter {
            max_results: 1,
            ..Default::default()
        })
        .await
        .context("List (head revision)")?
        .into_inner()
        .revision;
    let filters = [
        (
            "List 2 states, cap 100",
            pb::ListFilter {
                states: vec![
                    pb::MachineState::Speculative as i32,
                    pb::MachineState::Idle as i32,
                ],
                max_results: 100,
                since_revision: Vec::new(),
            },
        ),
        (
            "List delta since head",
            pb::ListFilter {
                since_revision: head,
                ..Default::default()
            },
        ),
        (
            // A freshly seeded inventory has no FAILED machine: what a shard's poll for
            // failures costs when there is nothing to report.
            "List FAILED (none)",
            pb::ListFilter {
                states: vec![pb::MachineState::Failed as i32],
                ..Default::default()
            },
        ),
    ];
    let mut rows = Vec::new();
    for (label, filter) in filters {
        load::list_series(&provider.channel, &filter, load::MAX_CALLS, options.warmup).await?;
        let meter = Meter::start(provider.process)?;
        let mut series = load::list_series(
            &provider.channel,
            &filter,
            load::MAX_CALLS,
            options.duration,
        )
        .await?;
        let window = meter.stop()?;
        let n = series.latencies.len();
        let row = Row::new(label)
            .latencies(&mut series.latencies)
            .set("returned", series.machines as f64);
        rows.push(window.onto(row, n));
    }
    Ok(rows)
}

/// `lifecycle` and `durable`: K machines walked Speculative -> Idle -> Configured -> Idle with
/// `--in-flight` machines at a time.
pub(crate) async fn lifecycle(provider: &Provider, options: &Options) -> Result<Vec<Row>> {
    let client = provider.client();
    let warm = if options.warmup.is_zero() {
        0
    } else {
        WALK_WARMUP.min(options.machines)
    };
    let mut ids = load::ids_in_state(
        &client,
        pb::MachineState::Speculative,
        warm + options.machines,
    )
    .await?;
    ensure!(
        ids.len() > warm,
        "only {} Speculative machines; need more than {warm}",
        ids.len()
    );
    let measured: Vec<String> = ids.split_off(warm);
    let fence = Arc::new(Fence::new("bench-lifecycle"));
    let plan = |deadline| WalkPlan {
        in_flight: options.in_flight,
        cycles: 1,
        deadline,
    };
    load::walk(
        &client,
        fence.clone(),
        Arc::new(ids),
        plan(Instant::now() + options.timeout),
    )
    .await?;
    let meter = Meter::start(provider.process)?;
    let result = load::walk(
        &client,
        fence,
        Arc::new(measured),
        plan(Instant::now() + options.timeout),
    )
    .await?;
    let window = meter.stop()?;
    Ok(walk_rows(result, &window, "mutations"))
}

fn walk_rows(mut result: WalkResult, window: &Window, label: &str) -> Vec<Row> {
    let mutations = result.mutations();
    let mut acks = result.acks();
    let mut rows = vec![
        Row::new("Create ack").latencies(&mut result.create),
        Row::new("Configure ack").latencies(&mut result.configure),
        Row::new("Drain ack").latencies(&mut result.drain),
        Row::new("settle per machine").latencies(&mut result.settle),
    ];
    let summary = Row::new(label)
        .latencies(&mut acks)
        .set(
            RATE,
            mutations as f64 / result.elapsed.as_secs_f64().max(1e-9),
        )
        .set_opt(CPU, window.cpu_per_op(mutations))
        .set_opt(PEAK_RSS, window.peak_mib())
        .set_opt("provider_cores", window.cores().0)
        .set("client_cores", window.cores().1)
        .set("machines", result.machines as f64)
        .set(
            "polls_per_mutation",
            result.polls as f64 / mutations.max(1) as f64,
        );
    rows.push(summary);
    rows
}

/// `mixed`: Get latency at concurrency 1 from a separate client, on its own connection and
/// thread, while the walk runs with `--in-flight` machines at a time.
pub(crate) async fn mixed(provider: &Provider, options: &Options) -> Result<Vec<Row>> {
    let client = provider.client();
    let ids = Arc::new(load::all_ids(&client).await?);
    let speculative = load::ids_in_state(&client, pb::MachineState::Speculative, ids.len()).await?;
    ensure!(!speculative.is_empty(), "no Speculative machines to walk");
    let (addr, tls) = provider.address();
    let (warmup, duration) = (options.warmup, options.duration);
    let reader_ids = ids.clone();
    let (started_tx, started_rx) = tokio::sync::oneshot::channel::<()>();
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<Result<Samples>>();
    // The reader gets a runtime and a connection of its own, so what it measures is the
    // provider's answer time, not this client's scheduling of the walkers.
    std::thread::spawn(move || {
        let result = (|| -> Result<Samples> {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(async {
                let reader = provider::client_at(addr, tls.as_ref()).await?;
                load::get_loop(&reader, reader_ids.clone(), 1, warmup, seed()).await?;
                let _ = started_tx.send(());
                load::get_loop(&reader, reader_ids, 1, duration, seed()).await
            })
        })();
        let _ = done_tx.send(result);
    });
    // The walk starts when the reader's measured window does; if the reader failed first,
    // its error is reported below.
    let _ = started_rx.await;
    let meter = Meter::start(provider.process)?;
    let plan = WalkPlan {
        in_flight: options.in_flight,
        cycles: MIXED_CYCLES,
        deadline: Instant::now() + duration,
    };
    let walked = load::walk(
        &client,
        Arc::new(Fence::new("bench-mixed")),
        Arc::new(speculative),
        plan,
    )
    .await;
    let reads = done_rx
        .await
        .context("the reader thread ended without an answer")?;
    let window = meter.stop()?;
    let mut reads = reads.context("reader")?;
    let walked = walked?;
    let reads_n = reads.len();
    let rpcs = reads_n + walked.mutations() + walked.polls as usize;
    let mut rows = walk_rows(walked, &window, "mutations during Gets");
    rows.retain(|r| r.label == "mutations during Gets");
    if let Some(summary) = rows.pop() {
        rows.push(summary.set(
            "cpu_us_per_rpc_all",
            window.cpu_per_op(rpcs).unwrap_or(f64::NAN),
        ));
    }
    rows.insert(
        0,
        Row::new("Get c=1 during mutations")
            .latencies(&mut reads)
            .set(RATE, window.rate(reads_n)),
    );
    Ok(rows)
}

/// Fresh directories for `--state`, removed when dropped.
pub(crate) struct Scratch {
    root: PathBuf,
    next: usize,
}

impl Scratch {
    pub(crate) fn create(parent: &Path) -> Result<Scratch> {
        let root = parent.join(format!("bigfleet-bench-{}", std::process::id()));
        std::fs::create_dir_all(&root).with_context(|| format!("create {}", root.display()))?;
        Ok(Scratch { root, next: 0 })
    }

    /// A path that does not exist yet, for one provider's `--state`.
    pub(crate) fn fresh(&mut self) -> PathBuf {
        self.next += 1;
        self.root.join(format!("state-{}", self.next))
    }

    pub(crate) fn root(&self) -> &Path {
        &self.root
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// `startup`: exec to SERVING and peak RSS with `size` seeds; then the same from a state
/// directory the provider wrote (after a short walk) and left with SIGTERM.
pub(crate) async fn startup(
    command: &[String],
    size: usize,
    tls: Option<&Tls>,
    scratch: &mut Scratch,
) -> Result<Vec<Row>> {
    let mut rows = Vec::new();

    let cold = Provider::start(command, Some(size), None, tls).await?;
    let ready = cold.ready_after().unwrap_or_default();
    let process = cold.process.context("no pid")?;
    let boot_cpu = process.cpu()?.since(&CpuSample::default());
    let boot = process.memory()?;
    tokio::time::sleep(IDLE_WAIT).await;
    let idle = process.memory()?;
    cold.stop().await?;
    rows.push(
        Row::new("start to SERVING")
            .set(super::report::P50, ms(ready))
            .set(PEAK_RSS, boot.peak_mib())
            .set("boot_cpu_ms", ms(boot_cpu))
            .set("idle_rss_mib", idle.rss_mib()),
    );

    let state = scratch.fresh();
    let first = Provider::start(command, Some(size), Some(&state), tls).await?;
    let first_ready = first.ready_after().unwrap_or_default();
    let client = first.client();
    let ids = load::ids_in_state(&client, pb::MachineState::Speculative, RESTART_WALK).await?;
    let plan = WalkPlan {
        in_flight: RESTART_WALK,
        cycles: 1,
        deadline: Instant::now() + Duration::from_secs(60),
    };
    load::walk(
        &client,
        Arc::new(Fence::new("bench-restart")),
        Arc::new(ids),
        plan,
    )
    .await?;
    first.stop().await?;
    let again = Provider::start(command, Some(size), Some(&state), tls).await?;
    let restart = again.ready_after().unwrap_or_default();
    let memory = again.process.context("no pid")?.memory()?;
    again.stop().await?;
    rows.push(
        Row::new("restart from --state")
            .set(super::report::P50, ms(restart))
            .set(PEAK_RSS, memory.peak_mib())
            .set("first_start_with_state_ms", ms(first_ready))
            .set("state_mib", dir_bytes(&state) as f64 / (1 << 20) as f64),
    );
    Ok(rows)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Bytes of the files in `path` (a directory, one level deep, or a file).
fn dir_bytes(path: &Path) -> u64 {
    match std::fs::read_dir(path) {
        Ok(entries) => entries
            .flatten()
            .filter_map(|e| e.metadata().ok())
            .filter(|m| m.is_file())
            .map(|m| m.len())
            .sum(),
        Err(_) => std::fs::metadata(path).map_or(0, |m| m.len()),
    }
}

/// The size of the spawned program, as built and as stripped (`strip` from binutils, when
/// present, on a copy).
pub(crate) fn binary_size(command: &[String], scratch: &Scratch) -> Option<Row> {
    let program = resolve_program(&command[0])?;
    let size = std::fs::metadata(&program).ok()?.len();
    let copy = scratch.root().join("stripped");
    let stripped = std::process::Command::new("strip")
        .arg("--strip-all")
        .arg("-o")
        .arg(&copy)
        .arg(&program)
        .status()
        .ok()
        .filter(|s| s.success())
        .and_then(|_| std::fs::metadata(&copy).ok())
        .map(|m| m.len());
    let _ = std::fs::remove_file(&copy);
    Some(
        Row::new("binary size")
            .set("binary_mb", size as f64 / 1e6)
            .set_opt("stripped_mb", stripped.map(|s| s as f64 / 1e6)),
    )
}

fn resolve_program(program: &str) -> Option<PathBuf> {
    if program.contains('/') {
        return Some(PathBuf::from(program));
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
}

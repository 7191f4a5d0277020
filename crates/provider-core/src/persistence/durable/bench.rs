//! A measurement of the durable store on the machine it runs on: durable commits per second
//! with a given inventory size and concurrency, commit latency, and the time to open a state of
//! that size. For `cargo xtask bench` and for checking that the cost per mutation stays flat
//! as the inventory grows.

use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::DurableStore;
use crate::persistence::store::Store;
use crate::rules::fence::HighWaterMark;
use crate::rules::lifecycle::OperationKind;
use crate::rules::machine::{CapacityType, HostRef, Machine, MachineState, StringMap};
use crate::rules::records::{Change, Slot};

/// What one run measured.
#[derive(Clone, Debug)]
pub struct BenchReport {
    pub slots: usize,
    pub concurrency: usize,
    pub commits: usize,
    pub commits_per_second: f64,
    pub commit_p50: Duration,
    pub commit_p99: Duration,
    /// Opening (reading and checking) the state written by the run.
    pub open: Duration,
    /// Bytes on disk after the run.
    pub state_bytes: u64,
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} slots, {} concurrent: {:.0} durable commits/s (p50 {:.2} ms, p99 {:.2} ms); \
             open {:.0} ms; {:.1} MiB on disk",
            self.slots,
            self.concurrency,
            self.commits_per_second,
            self.commit_p50.as_secs_f64() * 1e3,
            self.commit_p99.as_secs_f64() * 1e3,
            self.open.as_secs_f64() * 1e3,
            self.state_bytes as f64 / (1 << 20) as f64,
        )
    }
}

/// A slot shaped like a seeded cloud machine (labels, resources, allocatable).
pub(crate) fn sample_slot(i: usize) -> Slot {
    let zone = if i.is_multiple_of(2) { "fsn1" } else { "nbg1" };
    let instance_type = if i.is_multiple_of(3) { "cx22" } else { "cpx31" };
    let map = |pairs: &[(&str, &str)]| -> StringMap {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    };
    Slot {
        machine: Arc::new(Machine {
            id: format!("hetzner/OnDemand/{instance_type}/{zone}/{i:06}"),
            state: MachineState::Speculative,
            host: None,
            instance_type: instance_type.into(),
            zone: zone.into(),
            capacity_type: CapacityType::OnDemand,
            price_per_hour: 0.0104,
            interruption_probability: 0.0,
            resources: map(&[("cpu", "2"), ("memory", "4Gi"), ("pods", "110")]),
            allocatable: map(&[("cpu", "2"), ("memory", "4Gi")]),
            labels: map(&[
                ("bigfleet.io/provider", "hetzner"),
                ("topology.kubernetes.io/zone", zone),
                ("kubernetes.io/arch", "amd64"),
            ]),
            last_error: String::new(),
            cluster: String::new(),
            shard_metadata: StringMap::new(),
            wire: Default::default(),
        }),
        last_change: i as i64 + 1,
        operations: Default::default(),
        sealed: None,
        enrollment: None,
        retired: None,
    }
}

/// One mutation as the engine emits it for an accepted Configure: the fence advance, the slot
/// in its new state with the binding and op id, the counters.
fn mutation(base: &Slot, n: usize, revision: i64) -> Vec<Change> {
    let mut slot = base.clone();
    let machine = Arc::make_mut(&mut slot.machine);
    machine.state = MachineState::Configuring;
    machine.host = Some(HostRef {
        provider: "hetzner".into(),
        id: format!("{}", 40_000_000 + n),
    });
    machine.cluster = "cluster-a".into();
    machine
        .shard_metadata
        .insert("bigfleet.io/pool".into(), "general".into());
    slot.last_change = revision;
    slot.operations[OperationKind::Configure.index()] = Some(format!("op-{n}"));
    vec![
        Change::PutFence {
            shard_id: "shard-a".into(),
            machine_id: machine.id.clone(),
            mark: HighWaterMark {
                epoch: 1,
                sequence: n as i64,
            },
        },
        Change::PutSlot(slot),
        Change::Counters {
            revision,
            next_op: n as u64 + 1,
        },
    ]
}

/// Seeds a fresh state in `dir` (which must not hold one) with `slots` slots, runs `commits`
/// mutations from `concurrency` concurrent tasks, each waiting for its commit before the next,
/// then closes the store and times opening it again.
pub fn measure(
    dir: &Path,
    slots: usize,
    commits: usize,
    concurrency: usize,
) -> Result<BenchReport, String> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let store = Arc::new(DurableStore::open(dir)?);
    store.load().map_err(|e| e.0)?;
    let seed: Vec<Slot> = (0..slots).map(sample_slot).collect();
    let mut batch: Vec<Change> = seed.iter().cloned().map(Change::PutSlot).collect();
    batch.push(Change::Counters {
        revision: slots as i64,
        next_op: 1,
    });
    runtime
        .block_on(store.submit(batch).wait())
        .map_err(|e| e.0)?;
    let seed = Arc::new(seed);
    let concurrency = concurrency.max(1);
    let per_task = commits.div_ceil(concurrency);
    let started = Instant::now();
    let mut latencies = runtime.block_on(async {
        let mut tasks = Vec::new();
        for t in 0..concurrency {
            let store = store.clone();
            let seed = seed.clone();
            tasks.push(tokio::spawn(async move {
                let mut latencies = Vec::with_capacity(per_task);
                for k in 0..per_task {
                    let n = t * per_task + k;
                    let base = &seed[n % seed.len().max(1)];
                    let commit = store.submit(mutation(base, n, (slots + n) as i64));
                    let at = Instant::now();
                    commit.wait().await.map_err(|e| e.0)?;
                    latencies.push(at.elapsed());
                }
                Ok::<_, String>(latencies)
            }));
        }
        let mut all = Vec::new();
        for task in tasks {
            all.extend(task.await.map_err(|e| e.to_string())??);
        }
        Ok::<_, String>(all)
    })?;
    let elapsed = started.elapsed();
    drop(store);
    latencies.sort_unstable();
    let pick = |q: f64| {
        latencies
            .get(((latencies.len() as f64 * q) as usize).min(latencies.len().saturating_sub(1)))
            .copied()
            .unwrap_or_default()
    };
    let state_bytes = std::fs::read_dir(dir)
        .map_err(|e| e.to_string())?
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.len())
        .sum();
    let opened = Instant::now();
    let reopened = DurableStore::open(dir)?;
    let loaded = reopened.load().map_err(|e| e.0)?;
    let open = opened.elapsed();
    if loaded.slots.len() != slots {
        return Err(format!(
            "reopened state holds {} slots, expected {slots}",
            loaded.slots.len()
        ));
    }
    Ok(BenchReport {
        slots,
        concurrency,
        commits: latencies.len(),
        commits_per_second: latencies.len() as f64 / elapsed.as_secs_f64(),
        commit_p50: pick(0.5),
        commit_p99: pick(0.99),
        open,
        state_bytes,
    })
}

//! The load itself: timed Get loops, List series, and lifecycle walks of machines with a fixed
//! number in flight. Every loop stops at a deadline and at a count, whichever comes first.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use fleet_proto::v1alpha1 as pb;
use prost::Message;

use tonic::transport::Channel;

use super::provider::{Client, list_raw};
use super::stats::{Rng, Samples};

/// Most calls one timed loop makes, whatever its window.
pub(crate) const MAX_CALLS: usize = 2_000_000;
/// How long a machine may take to reach a settled state after its ack.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Gets one settle wait may make.
const MAX_POLLS: u64 = 100_000;

/// Every machine id, from one full List.
pub(crate) async fn all_ids(client: &Client) -> Result<Vec<String>> {
    let list = client
        .clone()
        .list(pb::ListFilter::default())
        .await
        .context("List (collecting ids)")?
        .into_inner();
    Ok(list.machines.into_iter().map(|m| m.id).collect())
}

/// Up to `n` machines currently in `state`.
pub(crate) async fn ids_in_state(
    client: &Client,
    state: pb::MachineState,
    n: usize,
) -> Result<Vec<String>> {
    let filter = pb::ListFilter {
        states: vec![state as i32],
        max_results: i32::try_from(n).unwrap_or(i32::MAX),
        since_revision: Vec::new(),
    };
    let list = client
        .clone()
        .list(filter)
        .await
        .context("List (selecting machines)")?
        .into_inner();
    let mut ids: Vec<String> = list.machines.into_iter().map(|m| m.id).collect();
    ids.sort();
    ids.truncate(n);
    Ok(ids)
}

/// Gets on ids picked at random, `concurrency` calls in flight, until `window` passes or
/// [`MAX_CALLS`] were made.
pub(crate) async fn get_loop(
    client: &Client,
    ids: Arc<Vec<String>>,
    concurrency: usize,
    window: Duration,
    seed: u64,
) -> Result<Samples> {
    if ids.is_empty() {
        bail!("the provider has no machines to Get");
    }
    let deadline = Instant::now() + window;
    let calls = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::with_capacity(concurrency);
    for worker in 0..concurrency {
        let mut client = client.clone();
        let ids = ids.clone();
        let calls = calls.clone();
        let mut rng = Rng::new(seed ^ (worker as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407));
        workers.push(tokio::spawn(async move {
            let mut samples = Samples::with_capacity(1024);
            while Instant::now() < deadline && calls.fetch_add(1, Ordering::Relaxed) < MAX_CALLS {
                let id = ids[rng.below(ids.len())].clone();
                let started = Instant::now();
                client
                    .get(pb::MachineRef { id: id.clone() })
                    .await
                    .with_context(|| format!("Get {id}"))?;
                samples.push(started.elapsed());
            }
            anyhow::Ok(samples)
        }));
    }
    let mut all = Samples::default();
    for worker in workers {
        all.extend(worker.await.context("Get worker panicked")??);
    }
    Ok(all)
}

/// What a List series saw.
#[derive(Debug, Default)]
pub(crate) struct ListSeries {
    pub latencies: Samples,
    /// Encoded size of the last response.
    pub response_bytes: usize,
    pub machines: usize,
}

/// `filter` Lists one after another: at most `count`, and no new one once `window` passed
/// (at least one is always made). Machines are left encoded ([`super::provider::RawList`]).
pub(crate) async fn list_series(
    channel: &Channel,
    filter: &pb::ListFilter,
    count: usize,
    window: Duration,
) -> Result<ListSeries> {
    let deadline = Instant::now() + window;
    let mut series = ListSeries::default();
    for i in 0..count.min(MAX_CALLS) {
        if i > 0 && Instant::now() >= deadline {
            break;
        }
        let started = Instant::now();
        let list = list_raw(channel, filter.clone()).await.context("List")?;
        series.latencies.push(started.elapsed());
        series.response_bytes = list.encoded_len();
        series.machines = list.machines.len();
    }
    Ok(series)
}

/// The fence tokens of one benchmark shard: a fresh epoch (wall-clock milliseconds, so a
/// later run against the same long-lived provider is never stale) and one strictly
/// increasing sequence shared by every machine.
#[derive(Debug)]
pub(crate) struct Fence {
    shard: String,
    epoch: i64,
    sequence: AtomicI64,
}

impl Fence {
    pub(crate) fn new(shard: &str) -> Fence {
        let epoch = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        Fence {
            shard: shard.to_owned(),
            epoch,
            sequence: AtomicI64::new(0),
        }
    }

    fn next(&self) -> (String, i64, i64) {
        let sequence = self.sequence.fetch_add(1, Ordering::Relaxed) + 1;
        (self.shard.clone(), self.epoch, sequence)
    }
}

/// What walks measured.
#[derive(Debug, Default)]
pub(crate) struct WalkResult {
    pub create: Samples,
    pub configure: Samples,
    pub drain: Samples,
    /// Per machine, from sending Create to seeing it Idle again after its last Drain.
    pub settle: Samples,
    /// Gets made while waiting for machines to settle.
    pub polls: u64,
    pub machines: usize,
    pub elapsed: Duration,
}

impl WalkResult {
    pub(crate) fn mutations(&self) -> usize {
        self.create.len() + self.configure.len() + self.drain.len()
    }

    fn merge(&mut self, other: WalkResult) {
        self.create.extend(other.create);
        self.configure.extend(other.configure);
        self.drain.extend(other.drain);
        self.settle.extend(other.settle);
        self.polls += other.polls;
        self.machines += other.machines;
    }

    /// Every ack latency together.
    pub(crate) fn acks(&self) -> Samples {
        let mut all = self.create.clone();
        all.extend(self.configure.clone());
        all.extend(self.drain.clone());
        all
    }
}

/// How to walk a set of machines.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WalkPlan {
    pub in_flight: usize,
    /// Configure/Drain round trips per machine after its Create (1 for the lifecycle walk).
    pub cycles: usize,
    /// No machine is started, and no further cycle begun, after this.
    pub deadline: Instant,
}

/// Walks every machine of `ids` (each Speculative) Create -> Idle, then `cycles` times
/// Configure -> Configured -> Drain -> Idle, `in_flight` machines at a time.
pub(crate) async fn walk(
    client: &Client,
    fence: Arc<Fence>,
    ids: Arc<Vec<String>>,
    plan: WalkPlan,
) -> Result<WalkResult> {
    let started = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::with_capacity(plan.in_flight);
    for _ in 0..plan.in_flight.min(ids.len()) {
        let mut client = client.clone();
        let (fence, ids, next) = (fence.clone(), ids.clone(), next.clone());
        workers.push(tokio::spawn(async move {
            let mut result = WalkResult::default();
            while Instant::now() < plan.deadline {
                let Some(id) = ids.get(next.fetch_add(1, Ordering::Relaxed)) else {
                    break;
                };
                walk_one(&mut client, &fence, id, plan, &mut result)
                    .await
                    .with_context(|| format!("walking {id}"))?;
            }
            anyhow::Ok(result)
        }));
    }
    let mut all = WalkResult::default();
    for worker in workers {
        all.merge(worker.await.context("walk worker panicked")??);
    }
    all.elapsed = started.elapsed();
    Ok(all)
}

async fn walk_one(
    client: &mut Client,
    fence: &Fence,
    id: &str,
    plan: WalkPlan,
    result: &mut WalkResult,
) -> Result<()> {
    use pb::MachineState::{Configured, Idle};
    let started = Instant::now();
    let t = Instant::now();
    let (shard_id, shard_epoch, sequence_number) = fence.next();
    client
        .create(pb::CreateRequest {
            machine_id: id.to_owned(),
            shard_id,
            shard_epoch,
            sequence_number,
        })
        .await
        .context("Create")?;
    result.create.push(t.elapsed());
    result.polls += wait_for(client, id, Idle).await?;
    for cycle in 0..plan.cycles {
        if cycle > 0 && Instant::now() >= plan.deadline {
            break;
        }
        let t = Instant::now();
        let (shard_id, shard_epoch, sequence_number) = fence.next();
        client
            .configure(pb::ConfigureRequest {
                machine_id: id.to_owned(),
                cluster_id: "bench".to_owned(),
                bootstrap_blob: b"#!/bin/sh\necho bench\n".to_vec(),
                shard_id,
                shard_epoch,
                sequence_number,
                shard_metadata: HashMap::from([("bench".to_owned(), "1".to_owned())]),
            })
            .await
            .context("Configure")?;
        result.configure.push(t.elapsed());
        result.polls += wait_for(client, id, Configured).await?;
        let t = Instant::now();
        let (shard_id, shard_epoch, sequence_number) = fence.next();
        client
            .drain(pb::DrainRequest {
                machine_id: id.to_owned(),
                grace_period_seconds: 0,
                shard_id,
                shard_epoch,
                sequence_number,
            })
            .await
            .context("Drain")?;
        result.drain.push(t.elapsed());
        result.polls += wait_for(client, id, Idle).await?;
    }
    result.settle.push(started.elapsed());
    result.machines += 1;
    Ok(())
}

/// Polls Get until `id` is in `want`: at once, then every millisecond. Returns the Gets made.
async fn wait_for(client: &mut Client, id: &str, want: pb::MachineState) -> Result<u64> {
    let deadline = Instant::now() + SETTLE_TIMEOUT;
    for polls in 1..=MAX_POLLS {
        let machine = client
            .get(pb::MachineRef { id: id.to_owned() })
            .await
            .context("Get (waiting to settle)")?
            .into_inner();
        let state =
            pb::MachineState::try_from(machine.state).unwrap_or(pb::MachineState::Unspecified);
        if state == want {
            return Ok(polls);
        }
        if state == pb::MachineState::Failed {
            bail!(
                "went FAILED while waiting for {want:?}: {}",
                machine.last_error
            );
        }
        if Instant::now() >= deadline {
            bail!("still {state:?} after {SETTLE_TIMEOUT:?}, want {want:?}");
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    bail!("not {want:?} after {MAX_POLLS} Gets")
}

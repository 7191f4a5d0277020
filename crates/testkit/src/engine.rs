//! An engine over the offerings-driven `Fleet` of any cloud, as both providers build it, and
//! the waits and tokens of the scenario tests that drive it directly.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use provider_core::cloud::Cloud;
use provider_core::fleet::{CapacityBook, Fleet, PriceBook};
use provider_core::offerings::Offering;
use provider_core::reconcile_loop::ReconcileLoop;
use provider_core::replica::Replica;
use provider_core::telemetry::Telemetry;
use provider_core::{Engine, EngineOptions, FenceToken, Machine, MachineState, StringMap};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::classes;

/// The zero fence token: the bypass a test uses when fencing is not what it tests.
pub fn zero_token() -> FenceToken {
    FenceToken {
        shard_id: String::new(),
        epoch: 0,
        sequence: 0,
    }
}

/// `count` on-demand slots of `instance_type` in `zone`, without resources or labels.
pub fn offering(instance_type: &str, zone: &str, count: i64) -> Offering {
    Offering {
        instance_type: instance_type.into(),
        zone: zone.into(),
        capacity_type: "on_demand".into(),
        count,
        resources: StringMap::new(),
        labels: StringMap::new(),
    }
}

/// The `resources` (and allocatable) map of a machine: `cpu`, `memory`, `ephemeral-storage`.
pub fn resources(cpu: &str, memory: &str, ephemeral_storage: &str) -> StringMap {
    StringMap::from([
        ("cpu".to_owned(), cpu.to_owned()),
        ("memory".to_owned(), memory.to_owned()),
        ("ephemeral-storage".to_owned(), ephemeral_storage.to_owned()),
    ])
}

/// An engine on an in-memory store over a `Fleet` of `cloud` with the one `offering`, priced
/// and sized by the cloud's pinned tables.
pub async fn over_fleet(
    cloud: Arc<dyn Cloud>,
    provider: &str,
    offering: Offering,
    prices: PriceBook,
    capacities: CapacityBook,
    options: EngineOptions,
) -> Arc<Engine> {
    let fleet = Fleet::new(
        cloud,
        provider,
        vec![offering],
        Arc::new(prices),
        Arc::new(capacities),
        |_| StringMap::new(),
    );
    Engine::start(
        Arc::new(fleet),
        Arc::new(provider_core::store::MemoryStore),
        options,
    )
    .await
    .unwrap()
}

/// The provider's own reconcile loop over `engine` and `cloud` at `floor`, running until the
/// returned token is cancelled.
pub fn spawn_reconcile_loop(
    engine: &Arc<Engine>,
    cloud: Arc<dyn Cloud>,
    floor: Duration,
    telemetry: Telemetry,
) -> (CancellationToken, JoinHandle<()>) {
    let stop = CancellationToken::new();
    let task = tokio::spawn(
        ReconcileLoop {
            replica: Replica::single(engine.clone()),
            cloud: Some(cloud),
            floor,
            telemetry,
        }
        .run(stop.clone()),
    );
    (stop, task)
}

/// Waits until every one of `ids` is Idle, failing at once when any is FAILED, and when
/// `deadline` passes first.
pub async fn until_all_idle(engine: &Engine, ids: &[String], deadline: Instant) {
    while !ids
        .iter()
        .all(|id| engine.get(id).is_ok_and(|m| m.state == MachineState::Idle))
    {
        let failed: Vec<&String> = ids
            .iter()
            .filter(|id| {
                engine
                    .get(id)
                    .is_ok_and(|m| m.state == MachineState::Failed)
            })
            .collect();
        assert!(failed.is_empty(), "failed Creates: {failed:?}");
        assert!(Instant::now() < deadline, "the burst did not finish");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The provider's own reconcile loop over `engine` and `cloud` at `floor` for at least `hour`,
/// and on until `enough` holds (40 hours at most): a slower machine only stretches the hour
/// the requests are counted over, so a verdict on them does not depend on its speed.
pub async fn reconcile_for(
    engine: &Arc<Engine>,
    cloud: Arc<dyn Cloud>,
    floor: Duration,
    telemetry: Telemetry,
    hour: Duration,
    enough: impl Fn() -> bool,
) {
    let (stop, reconcile) = spawn_reconcile_loop(engine, cloud, floor, telemetry);
    tokio::time::sleep(hour).await;
    let bound = Instant::now() + hour * 40;
    while !enough() && Instant::now() < bound {
        tokio::time::sleep(floor).await;
    }
    stop.cancel();
    reconcile.await.unwrap();
}

/// The machine `id` once it is no longer in a transitional state, read every 10 ms; a
/// panic when it is still transitional after `within`.
pub async fn settled(engine: &Engine, id: &str, within: Duration) -> Arc<Machine> {
    let deadline = Instant::now() + within;
    loop {
        let m = engine.get(id).unwrap();
        if !m.state.is_transitional() {
            return m;
        }
        assert!(Instant::now() < deadline, "{id} did not settle: {m:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The FAILED machine `id`, whose Create recorded the host `host_id` before it failed: a
/// reconcile pass attaches nothing more and leaves it that host, the census counts one FAILED
/// machine with a host, and releasing it succeeds. Returns the machine as the pass left it.
pub async fn release_failed_with_host(engine: &Engine, id: &str, host_id: &str) -> Arc<Machine> {
    let report = engine.reconcile().await.unwrap();
    assert_eq!(report.attached, 0, "nothing left to attach: {report:?}");
    let m = engine.get(id).unwrap();
    assert_eq!(m.host.as_ref().map(|h| h.id.as_str()), Some(host_id));
    assert_eq!(engine.census().failed_with_host, 1);
    let mut shards = crate::shard::EngineShards::new();
    shards.reconcile(engine);
    shards.timeline(engine, "FAILED with its host", &[id]);
    let answer = engine.release(id).await.unwrap();
    let successor = assert_released(engine, id, &answer);
    shards.reconcile(engine);
    shards.timeline(engine, "released: the host deleted", &[id, &successor]);
    shards.verdict(engine).unwrap();
    m
}

/// What a release leaves, as BigFleet's shard can follow it: the released id stays FAILED
/// without a host, and its capacity is a Speculative slot under the id `answer` names.
/// Returns that id.
pub fn assert_released(engine: &Engine, id: &str, answer: &str) -> String {
    let old = engine.get(id).unwrap();
    assert_eq!(
        old.state,
        MachineState::Failed,
        "Failed has no way out: {old:?}"
    );
    assert!(old.host.is_none(), "{old:?}");
    let successor = answer
        .rsplit_once("comes back as machine ")
        .map(|(_, id)| id.to_owned())
        .unwrap_or_else(|| panic!("no new id named: {answer}"));
    assert!(old.last_error.ends_with(&successor), "{}", old.last_error);
    let next = engine.get(&successor).unwrap();
    assert_eq!(next.state, MachineState::Speculative, "{next:?}");
    successor
}

/// Request counts by class, as the emulators keep them (`requests_by_class`).
pub type Classes = BTreeMap<&'static str, (usize, usize)>;

/// The steady hour of a scale test: its (scaled) `hour`, the reconcile loop's `floor`, and
/// what must have been sent before it ends: a whole survey (`survey_pages` listing requests)
/// and one out-of-band check (a request of `check_class`) between surveys.
pub struct SteadyHour<'a> {
    pub hour: Duration,
    pub floor: Duration,
    pub survey_pages: usize,
    pub check_class: &'a str,
}

impl<'a> SteadyHour<'a> {
    pub fn new(hour: Duration, floor: Duration, survey_pages: usize, check_class: &'a str) -> Self {
        SteadyHour {
            hour,
            floor,
            survey_pages,
            check_class,
        }
    }

    /// The verdict on the hour, from the request counts at its start and end, the requests it
    /// sent scaled to an hour and the reconcile `share` of the rate limit: a whole survey and
    /// a check between surveys were sent, and the hour's requests fit the share with at most
    /// one survey's worth over it (the first survey runs at once).
    pub fn assert_within_share(
        &self,
        at_start: &Classes,
        at_end: &Classes,
        per_hour: f64,
        share: f64,
    ) {
        let grew = |class| classes::grown(at_start, at_end, class);
        assert!(grew("listing") >= self.survey_pages, "{at_end:?}");
        assert!(grew(self.check_class) >= 1, "{at_end:?}");
        assert!(
            per_hour <= share + self.survey_pages as f64,
            "{per_hour:.0} requests an hour, above the reconcile share {share:.0}"
        );
    }
}

/// The provider's own reconcile loop over a steady fleet: surveys paced to their share, and
/// the out-of-band check every floor between them, for at least the hour and until a whole
/// survey and a check between surveys were sent, however long this machine takes for them.
/// Returns the request counts at the start and how long the loop ran.
pub async fn reconcile_a_steady_hour(
    engine: &Arc<Engine>,
    cloud: Arc<dyn Cloud>,
    telemetry: Telemetry,
    steady: &SteadyHour<'_>,
    requests_by_class: impl Fn() -> Classes,
) -> (Classes, Duration) {
    let at_start = requests_by_class();
    let started = Instant::now();
    let grown = |class| classes::grown(&at_start, &requests_by_class(), class);
    reconcile_for(engine, cloud, steady.floor, telemetry, steady.hour, || {
        grown("listing") >= steady.survey_pages && grown(steady.check_class) >= 1
    })
    .await;
    (at_start, started.elapsed())
}

//! An engine over the offerings-driven `Fleet` of any cloud, as both providers build it, and
//! the waits and tokens of the scenario tests that drive it directly.

use std::sync::Arc;
use std::time::Duration;

use provider_core::cloud::Cloud;
use provider_core::fleet::{CapacityBook, Fleet, PriceBook};
use provider_core::offerings::Offering;
use provider_core::reconcile_loop::ReconcileLoop;
use provider_core::replica::Replica;
use provider_core::telemetry::Telemetry;
use provider_core::{Engine, EngineOptions, FenceToken, MachineState, StringMap};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

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

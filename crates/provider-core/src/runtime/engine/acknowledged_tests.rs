//! A leader whose store stopped committing (etcd down for every replica) answers Get and List
//! alike from what the store holds: a change the store never confirmed is not shown, the
//! machine shows as it was before it, and List's revision is the last one the store confirmed.

use std::sync::Mutex;

use tokio::sync::oneshot;

use super::test_support::{SlotBackend, zero};
use super::*;
use crate::persistence::store::{Store, StoreError};

/// Commits at once while `hang` is false; afterwards never answers (etcd unreachable).
#[derive(Default)]
struct HangingStore {
    hang: AtomicBool,
    parked: Mutex<Vec<oneshot::Sender<Result<(), StoreError>>>>,
}

impl Store for HangingStore {
    fn load(&self) -> Result<Snapshot, StoreError> {
        Ok(Snapshot::default())
    }
    fn submit(&self, _batch: Vec<Change>) -> Commit {
        if !self.hang.load(Ordering::SeqCst) {
            return Commit::done();
        }
        let (tx, rx) = oneshot::channel();
        self.parked.lock().unwrap().push(tx);
        Commit::pending(rx)
    }
    fn is_durable(&self) -> bool {
        true
    }
    fn describe(&self) -> String {
        "hanging test store".into()
    }
}

#[tokio::test(start_paused = true)]
async fn reads_answer_from_the_acknowledged_state_once_the_store_stopped() {
    let store = Arc::new(HangingStore::default());
    let engine = Engine::start(
        Arc::new(SlotBackend::numbered(2)),
        store.clone(),
        EngineOptions::new(Telemetry::new("test_acknowledged")),
    )
    .await
    .expect("engine starts");
    let ids: Vec<String> = engine
        .list(&ListQuery::default())
        .machines
        .iter()
        .map(|m| m.id.clone())
        .collect();
    let (first, second) = (ids[0].clone(), ids[1].clone());
    engine.create(&first, zero()).await.expect("acknowledged");
    for _ in 0..100 {
        if engine.get(&first).expect("first").state == MachineState::Idle {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let durable = engine.list(&ListQuery::default()).revision;
    assert!(
        engine.acknowledged_list(&ListQuery::default()).is_none(),
        "only once the store stopped"
    );

    // etcd goes away: a Create is applied in memory but never confirmed.
    store.hang.store(true, Ordering::SeqCst);
    let pending = {
        let engine = engine.clone();
        let second = second.clone();
        tokio::spawn(async move { engine.create(&second, zero()).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(engine.get(&second).expect("second").state.is_transitional());
    assert!(engine.list(&ListQuery::default()).revision > durable);
    engine.step_down();
    // The lost connection ends the commit with an error.
    store.parked.lock().unwrap().clear();
    assert!(pending.await.expect("task").is_err(), "never acknowledged");

    let listing = engine
        .acknowledged_list(&ListQuery::default())
        .expect("answered from the acknowledged state");
    assert_eq!(listing.revision, durable, "the last confirmed revision");
    let state_of = |id: &str| {
        listing
            .machines
            .iter()
            .find(|m| m.id == id)
            .map(|m| m.state)
    };
    assert_eq!(state_of(&first), Some(MachineState::Idle));
    assert_eq!(
        state_of(&second),
        Some(MachineState::Speculative),
        "the Create the store never confirmed is not shown"
    );
    assert_eq!(
        engine.acknowledged_get(&second).map(|m| m.state),
        Some(MachineState::Speculative)
    );
    // A cursor at the confirmed revision sees no change; a state filter applies.
    let since = ListQuery {
        since_revision: durable.to_string().into_bytes(),
        ..ListQuery::default()
    };
    assert!(
        engine
            .acknowledged_list(&since)
            .expect("answered")
            .machines
            .is_empty()
    );
    let idle = ListQuery {
        states: vec![MachineState::Idle],
        ..ListQuery::default()
    };
    let idle = engine.acknowledged_list(&idle).expect("answered");
    assert_eq!(idle.machines.len(), 1);
    assert_eq!(idle.machines[0].id, first);
}

//! Engine tests: asynchronous dispatch, deadlines, stale completions, List cursors, durability
//! ordering, shutdown and resume, on the paused tokio clock where time matters.

use std::sync::Mutex;
use std::sync::atomic::AtomicUsize;

use async_trait::async_trait;

use super::test_support::{self, SlotBackend, Stub, zero};
use super::*;
use crate::observability::telemetry::Telemetry;
use crate::persistence::store::{Store, StoreError};
use crate::rules::records::{FenceRecord, Slot};

/// A scriptable backend: each call waits `delay` (or forever), then succeeds or fails.
#[derive(Default)]
struct Scripted {
    delay: Mutex<Option<Duration>>,
    fail: Mutex<Option<String>>,
    ignore_cancel: AtomicBool,
    calls: AtomicUsize,
    machines: usize,
    /// Every configure call: operation id, blob, time left before its deadline.
    configured: Mutex<Vec<(String, Vec<u8>, Duration)>>,
}

impl Scripted {
    fn with(machines: usize, delay: Option<Duration>) -> Arc<Scripted> {
        Arc::new(Scripted {
            machines,
            delay: Mutex::new(delay),
            ..Scripted::default()
        })
    }

    async fn act(&self, ctx: &TransitionContext) -> Result<(), BackendError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let delay = *self.delay.lock().unwrap();
        match delay {
            Some(d) if self.ignore_cancel.load(Ordering::SeqCst) => tokio::time::sleep(d).await,
            Some(d) => tokio::select! {
                _ = tokio::time::sleep(d) => {}
                _ = ctx.cancel.cancelled() => return Err(BackendError::new("cancelled")),
            },
            None => ctx.cancel.cancelled().await,
        }
        match self.fail.lock().unwrap().clone() {
            Some(message) => Err(BackendError(message)),
            None => Ok(()),
        }
    }
}

#[async_trait]
impl Stub for Scripted {
    fn slots(&self) -> Vec<Machine> {
        test_support::slots("m", self.machines, "z")
    }
    async fn create(
        &self,
        machine: &Machine,
        ctx: &TransitionContext,
    ) -> Result<Effect, BackendError> {
        self.act(ctx).await?;
        Ok(test_support::hosted(test_support::host_of(
            "p",
            &machine.id,
        )))
    }
    async fn configure(
        &self,
        _: &Machine,
        order: &ConfigureOrder,
        ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        self.configured.lock().unwrap().push((
            ctx.operation_id.clone(),
            order.blob.0.clone(),
            ctx.remaining(),
        ));
        self.act(ctx).await
    }
    async fn drain(
        &self,
        _: &Machine,
        _: i64,
        ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        self.act(ctx).await
    }
    async fn delete(&self, _: &Machine, ctx: &TransitionContext) -> Result<(), BackendError> {
        self.act(ctx).await
    }
}

/// A store that keeps applied batches in memory across engine instances, like a disk would.
#[derive(Default)]
struct KeptStore {
    state: Mutex<Snapshot>,
    fail: AtomicBool,
}

impl Store for KeptStore {
    fn load(&self) -> Result<Snapshot, StoreError> {
        Ok(self.state.lock().unwrap().clone())
    }
    fn submit(&self, batch: Vec<Change>) -> Commit {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.fail.load(Ordering::SeqCst) {
            let _ = tx.send(Err(StoreError("disk on fire".into())));
            return Commit::pending(rx);
        }
        let mut s = self.state.lock().unwrap();
        for change in batch {
            match change {
                Change::PutSlot(slot) => {
                    s.slots.retain(|x: &Slot| x.machine.id != slot.machine.id);
                    s.slots.push(slot);
                }
                Change::RemoveSlot(id) => s.slots.retain(|x| x.machine.id != id),
                Change::PutFence {
                    shard_id,
                    machine_id,
                    mark,
                } => {
                    s.fences
                        .retain(|f| !(f.shard_id == shard_id && f.machine_id == machine_id));
                    s.fences.push(FenceRecord {
                        shard_id,
                        machine_id,
                        mark,
                    });
                }
                Change::RemoveFence {
                    shard_id,
                    machine_id,
                } => s
                    .fences
                    .retain(|f| !(f.shard_id == shard_id && f.machine_id == machine_id)),
                Change::Counters { revision, next_op } => {
                    s.revision = revision;
                    s.next_op = next_op;
                }
            }
        }
        let _ = tx.send(Ok(()));
        Commit::pending(rx)
    }
    fn is_durable(&self) -> bool {
        true
    }
    fn describe(&self) -> String {
        "kept".into()
    }
}

fn options() -> EngineOptions {
    let mut o = EngineOptions::new(Telemetry::new("test_engine"));
    o.timeouts = Timeouts {
        create: Duration::from_secs(10),
        configure: Duration::from_secs(10),
        drain: Duration::from_secs(10),
        delete: Duration::from_secs(10),
    };
    o
}

/// An engine over `backend` on an in-memory store, with the tests' timeouts.
async fn in_memory(backend: Arc<Scripted>) -> Arc<Engine> {
    Engine::start(
        backend,
        Arc::new(crate::persistence::store::MemoryStore),
        options(),
    )
    .await
    .unwrap()
}

async fn settle(engine: &Engine, id: &str, want: MachineState) {
    for _ in 0..5000 {
        if engine.get(id).unwrap().state == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{id} never reached {want}: {:?}", engine.get(id).unwrap());
}

#[tokio::test(start_paused = true)]
async fn the_ack_shows_the_transitional_state_and_work_settles_later() {
    let backend = Scripted::with(2, Some(Duration::from_secs(1)));
    let engine = in_memory(backend.clone()).await;
    let ack = engine.create("m-0", zero()).await.unwrap();
    assert!(ack.accepted);
    assert_eq!(ack.machine.state, MachineState::Creating);
    assert!(ack.machine.host.is_none());
    settle(&engine, "m-0", MachineState::Idle).await;
    assert_eq!(
        engine.get("m-0").unwrap().host.as_ref().unwrap().id,
        "h-m-0"
    );
    assert_eq!(backend.calls.load(Ordering::SeqCst), 1);
    let retry = engine.create("m-0", zero()).await.unwrap();
    assert_eq!(retry.operation_id, ack.operation_id);
    assert!(!retry.accepted);
    assert_eq!(
        backend.calls.load(Ordering::SeqCst),
        1,
        "a retry dispatches no new work"
    );
}

#[tokio::test(start_paused = true)]
async fn a_timeout_fails_the_machine_and_a_late_success_is_discarded() {
    let backend = Scripted::with(1, Some(Duration::from_secs(30)));
    backend.ignore_cancel.store(true, Ordering::SeqCst);
    let engine = in_memory(backend.clone()).await;
    engine.create("m-0", zero()).await.unwrap();
    settle(&engine, "m-0", MachineState::Failed).await;
    assert_eq!(
        engine.get("m-0").unwrap().last_error,
        "create transition timed out after 10s: context deadline exceeded"
    );
    tokio::time::sleep(Duration::from_secs(60)).await;
    let m = engine.get("m-0").unwrap();
    assert_eq!(
        m.state,
        MachineState::Failed,
        "the late success must not flip FAILED"
    );
    assert!(m.host.is_none());
}

#[tokio::test(start_paused = true)]
async fn a_backend_failing_at_its_deadline_is_counted_as_a_timeout() {
    let metrics = crate::observability::telemetry::recorder();
    // The backend gives up at the deadline itself, as a backend waiting on its own clock does.
    let backend = Scripted::with(1, Some(Duration::from_secs(10)));
    *backend.fail.lock().unwrap() = Some("agent did not apply: context deadline exceeded".into());
    let engine = in_memory(backend).await;
    engine.create("m-0", zero()).await.unwrap();
    settle(&engine, "m-0", MachineState::Failed).await;
    let body = metrics.render();
    assert!(
        body.contains(r#"test_engine_transitions_total{kind="create",outcome="timeout"} 1"#),
        "{body}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_backend_error_becomes_last_error() {
    let backend = Scripted::with(1, Some(Duration::from_millis(5)));
    *backend.fail.lock().unwrap() = Some("create server cx22: quota exceeded".into());
    let engine = in_memory(backend).await;
    engine.create("m-0", zero()).await.unwrap();
    settle(&engine, "m-0", MachineState::Failed).await;
    assert_eq!(
        engine.get("m-0").unwrap().last_error,
        "create server cx22: quota exceeded"
    );
}

#[tokio::test]
async fn list_cursors_filters_and_caps() {
    let backend = Scripted::with(5, Some(Duration::ZERO));
    let engine = Engine::start(backend, Arc::new(KeptStore::default()), options())
        .await
        .unwrap();
    let all = engine.list(&ListQuery::default());
    assert_eq!(all.machines.len(), 5);
    let head = all.revision;
    let cursor = |c: &str| ListQuery {
        since_revision: c.as_bytes().to_vec(),
        ..ListQuery::default()
    };
    let delta = engine.list(&cursor(&head.to_string()));
    assert!(
        delta.machines.is_empty(),
        "no change since the cursor: empty delta"
    );
    assert_eq!(delta.revision, head, "no revision bump without a change");
    assert_eq!(
        engine.list(&cursor("garbage")).machines.len(),
        5,
        "garbage is no cursor"
    );
    assert_eq!(
        engine
            .list(&cursor(&(head + 1000).to_string()))
            .machines
            .len(),
        5,
        "a cursor from the future is stale"
    );
    engine.create("m-3", zero()).await.unwrap();
    let delta = engine.list(&cursor(&head.to_string()));
    assert_eq!(delta.machines.len(), 1);
    assert_eq!(delta.machines[0].id, "m-3");
    let filtered = engine.list(&ListQuery {
        states: vec![MachineState::Speculative],
        max_results: 2,
        ..ListQuery::default()
    });
    assert_eq!(filtered.machines.len(), 2);
    assert!(
        filtered
            .machines
            .iter()
            .all(|m| m.state == MachineState::Speculative)
    );
    let none = engine.list(&ListQuery {
        states: vec![MachineState::Unspecified],
        ..ListQuery::default()
    });
    assert!(none.machines.is_empty());
}

#[tokio::test]
async fn an_in_memory_restart_never_reuses_ids_or_cursors() {
    let backend = Scripted::with(2, Some(Duration::ZERO));
    let first = in_memory(backend.clone()).await;
    let op1 = first.create("m-0", zero()).await.unwrap().operation_id;
    let cursor = first.list(&ListQuery::default()).revision;
    drop(first);
    let second = in_memory(backend).await;
    let op2 = second.create("m-0", zero()).await.unwrap().operation_id;
    assert_ne!(op1, op2);
    let series = |op: &str| crate::rules::inventory::id_series(op).expect("a series");
    assert_ne!(
        series(&op1),
        series(&op2),
        "each in-memory start is a new state"
    );
    let listing = second.list(&ListQuery {
        since_revision: cursor.to_string().into_bytes(),
        ..ListQuery::default()
    });
    assert_eq!(
        listing.machines.len(),
        2,
        "an old cursor yields a full list, never an empty delta"
    );
}

#[tokio::test]
async fn a_failed_commit_is_never_acknowledged_and_stops_mutations() {
    let backend = Scripted::with(2, Some(Duration::ZERO));
    let store = Arc::new(KeptStore::default());
    let engine = Engine::start(backend, store.clone(), options())
        .await
        .unwrap();
    let metrics = crate::observability::telemetry::recorder();
    let refusing = "test_engine_store_refusing_mutations 1";
    assert!(!metrics.render().contains(refusing));
    store.fail.store(true, Ordering::SeqCst);
    let err = engine.create("m-0", zero()).await.unwrap_err();
    assert!(matches!(err, CoreError::Store(_)), "{err:?}");
    assert_eq!(err.code(), tonic::Code::Unavailable);
    assert!(
        metrics.render().contains(refusing),
        "the alert's gauge is set"
    );
    store.fail.store(false, Ordering::SeqCst);
    let err = engine.create("m-1", zero()).await.unwrap_err();
    assert!(
        matches!(err, CoreError::Store(_)),
        "poisoned until restart: {err:?}"
    );
    assert!(engine.get("m-1").is_ok(), "reads still work");
}

#[tokio::test(start_paused = true)]
async fn shutdown_waits_for_in_flight_work_then_refuses_mutations() {
    let backend = Scripted::with(2, Some(Duration::from_secs(3)));
    let engine = Engine::start(backend, Arc::new(KeptStore::default()), options())
        .await
        .unwrap();
    engine.create("m-0", zero()).await.unwrap();
    let unfinished = engine.shutdown(Duration::from_secs(5)).await;
    assert_eq!(unfinished, 0);
    assert_eq!(engine.get("m-0").unwrap().state, MachineState::Idle);
    let err = engine.create("m-1", zero()).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable);
}

#[tokio::test(start_paused = true)]
async fn interrupted_work_resumes_after_a_restart_under_its_original_id() {
    let backend = Scripted::with(3, Some(Duration::from_secs(60)));
    let store = Arc::new(KeptStore::default());
    let engine = Engine::start(backend.clone(), store.clone(), options())
        .await
        .unwrap();
    // m-1 Idle, then configure and create interrupted.
    *backend.delay.lock().unwrap() = Some(Duration::from_millis(1));
    engine.create("m-1", zero()).await.unwrap();
    settle(&engine, "m-1", MachineState::Idle).await;
    *backend.delay.lock().unwrap() = Some(Duration::from_secs(60));
    let create = engine.create("m-0", zero()).await.unwrap().operation_id;
    engine
        .configure(
            "m-1",
            "c".into(),
            b"blob".to_vec(),
            StringMap::new(),
            zero(),
        )
        .await
        .unwrap();
    let unfinished = engine.shutdown(Duration::from_secs(1)).await;
    assert_eq!(unfinished, 2);
    assert_eq!(
        engine.get("m-0").unwrap().state,
        MachineState::Creating,
        "left transitional for the next start"
    );
    drop(engine);

    *backend.delay.lock().unwrap() = Some(Duration::from_millis(1));
    let restarted = Engine::start(backend.clone(), store, options())
        .await
        .unwrap();
    let m1 = restarted.get("m-1").unwrap();
    assert_eq!(m1.state, MachineState::Failed);
    assert_eq!(m1.last_error, CONFIGURE_NOT_KEPT);
    settle(&restarted, "m-0", MachineState::Idle).await;
    let retry = restarted.create("m-0", zero()).await.unwrap();
    assert_eq!(
        retry.operation_id, create,
        "resumed under the original operation id"
    );
}

#[tokio::test]
async fn fence_advance_on_an_unknown_machine_is_durable() {
    let backend = Scripted::with(1, Some(Duration::ZERO));
    let store = Arc::new(KeptStore::default());
    let engine = Engine::start(backend.clone(), store.clone(), options())
        .await
        .unwrap();
    let token = FenceToken {
        shard_id: "s".into(),
        epoch: 3,
        sequence: 1,
    };
    assert!(matches!(
        engine.create("ghost", token.clone()).await,
        Err(CoreError::UnknownMachine(_))
    ));
    drop(engine);
    let restarted = Engine::start(backend, store, options()).await.unwrap();
    assert!(matches!(
        restarted.create("ghost", token).await,
        Err(CoreError::Fenced { .. })
    ));
}

#[tokio::test]
async fn release_deletes_the_host_and_returns_the_slot() {
    let backend = Scripted::with(1, Some(Duration::ZERO));
    let engine = Engine::start(backend.clone(), Arc::new(KeptStore::default()), options())
        .await
        .unwrap();
    engine.create("m-0", zero()).await.unwrap();
    settle(&engine, "m-0", MachineState::Idle).await;
    *backend.fail.lock().unwrap() = Some("hook failed".into());
    engine
        .configure("m-0", "c".into(), vec![], StringMap::new(), zero())
        .await
        .unwrap();
    settle(&engine, "m-0", MachineState::Failed).await;
    assert_eq!(engine.census().failed_with_host, 1);
    *backend.fail.lock().unwrap() = None;
    let calls = backend.calls.load(Ordering::SeqCst);
    engine.release("m-0").await.unwrap();
    assert_eq!(
        backend.calls.load(Ordering::SeqCst),
        calls + 1,
        "the host was deleted"
    );
    let m = engine.get("m-0").unwrap();
    assert_eq!(
        m.state,
        MachineState::Failed,
        "the released id stays FAILED"
    );
    assert!(m.host.is_none());
    assert_eq!(engine.census().failed_with_host, 0);
    assert!(
        engine
            .census()
            .retired
            .contains(&(RetireReason::Released.name(), 1))
    );
    let successor = m.last_error.rsplit(' ').next().unwrap();
    assert_eq!(
        engine.get(successor).unwrap().state,
        MachineState::Speculative
    );
    assert!(
        engine.failed().is_empty(),
        "a retired record is not listed for release"
    );
}

#[tokio::test]
async fn invalid_seed_records_fail_startup_naming_them() {
    let err = Engine::start(
        Arc::new(SlotBackend::new(vec![Machine::speculative("bad-1", "")])),
        Arc::new(crate::persistence::store::MemoryStore),
        options(),
    )
    .await
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "providerkit: invalid machine record: bad-1: instance_type is required (never labels-only)"
    );
}

// --- sealed Configures across a restart --------------------------------------------------

const KEY_A: &str = "q83vEjRWeJCrze8SNFZ4kKvN7xI0VniQq83vEjRWeJA=";
const KEY_B: &str = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";

fn sealing(keys: &str) -> EngineOptions {
    let mut o = options();
    o.state_keys = Some(Arc::new(StateKeys::parse(keys).unwrap()));
    o
}

/// An Idle m-0 whose Configure (blob `join-secret`) is left in flight by a shutdown.
async fn interrupted_configure(
    backend: &Arc<Scripted>,
    store: &Arc<KeptStore>,
    options: EngineOptions,
) -> String {
    let engine = Engine::start(backend.clone(), store.clone(), options)
        .await
        .unwrap();
    *backend.delay.lock().unwrap() = Some(Duration::from_millis(1));
    engine.create("m-0", zero()).await.unwrap();
    settle(&engine, "m-0", MachineState::Idle).await;
    *backend.delay.lock().unwrap() = Some(Duration::from_secs(60));
    let ack = engine
        .configure(
            "m-0",
            "c".into(),
            b"join-secret".to_vec(),
            StringMap::from([("k".to_owned(), "v".to_owned())]),
            zero(),
        )
        .await
        .unwrap();
    assert_eq!(engine.shutdown(Duration::from_secs(1)).await, 1);
    ack.operation_id
}

fn stored_slot(store: &KeptStore, id: &str) -> Slot {
    let state = store.state.lock().unwrap();
    state
        .slots
        .iter()
        .find(|s| s.machine.id == id)
        .unwrap()
        .clone()
}

#[tokio::test(start_paused = true)]
async fn an_interrupted_configure_resumes_with_its_sealed_blob_and_its_deadline() {
    let backend = Scripted::with(1, None);
    let store = Arc::new(KeptStore::default());
    let op = interrupted_configure(&backend, &store, sealing(KEY_A)).await;
    let kept = stored_slot(&store, "m-0");
    let sealed = kept.sealed.clone().expect("sealed with the acceptance");
    assert!(
        !sealed.sealed.windows(11).any(|w| w == b"join-secret"),
        "the state never holds the blob in the clear"
    );
    // The deadline comes from the state: shorten it there and the resumed run must see it.
    {
        let mut state = store.state.lock().unwrap();
        let slot = state
            .slots
            .iter_mut()
            .find(|s| s.machine.id == "m-0")
            .unwrap();
        slot.sealed = Some(Arc::new(SealedConfigure {
            deadline_unix_ms: unix_millis() + 3_000,
            sealed: sealed.sealed.clone(),
        }));
    }
    *backend.delay.lock().unwrap() = Some(Duration::from_millis(1));
    let restarted = Engine::start(backend.clone(), store.clone(), sealing(KEY_A))
        .await
        .unwrap();
    settle(&restarted, "m-0", MachineState::Configured).await;
    let calls = backend.configured.lock().unwrap().clone();
    assert_eq!(calls.len(), 2, "the first run and the resumed one");
    assert_eq!(calls[1].0, op, "resumed under its operation id");
    assert_eq!(calls[1].1, b"join-secret");
    assert!(
        calls[1].2 <= Duration::from_secs(3),
        "the original deadline, not a new one: {:?}",
        calls[1].2
    );
    let m = restarted.get("m-0").unwrap();
    assert_eq!(
        (m.cluster.as_str(), m.shard_metadata["k"].as_str()),
        ("c", "v")
    );
    assert!(
        stored_slot(&store, "m-0").sealed.is_none(),
        "the commit that ends the Configure forgets the blob"
    );
    let retry = restarted
        .configure(
            "m-0",
            "c".into(),
            b"join-secret".to_vec(),
            StringMap::new(),
            zero(),
        )
        .await
        .unwrap();
    assert_eq!(retry.operation_id, op);
}

#[tokio::test(start_paused = true)]
async fn a_wrong_or_missing_key_fails_startup_and_changes_nothing() {
    let backend = Scripted::with(1, None);
    let store = Arc::new(KeptStore::default());
    let op = interrupted_configure(&backend, &store, sealing(KEY_A)).await;
    let before = store.load().unwrap();
    for options in [sealing(KEY_B), options()] {
        let err = Engine::start(backend.clone(), store.clone(), options)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("--state-encryption-key-file"), "{err}");
        assert!(err.contains("1 in-flight Configures"), "{err}");
        assert!(err.contains("--fail-unreadable-configures"), "{err}");
        assert_eq!(store.load().unwrap(), before, "nothing changed");
    }
    // Rotation: the new key first, the old one after it, resumes.
    *backend.delay.lock().unwrap() = Some(Duration::from_millis(1));
    let rotated = Engine::start(
        backend.clone(),
        store.clone(),
        sealing(&format!("{KEY_B}\n{KEY_A}\n")),
    )
    .await
    .unwrap();
    settle(&rotated, "m-0", MachineState::Configured).await;
    assert_eq!(backend.configured.lock().unwrap().last().unwrap().0, op);
}

#[tokio::test(start_paused = true)]
async fn fail_unreadable_configures_fails_exactly_those() {
    let backend = Scripted::with(1, None);
    let store = Arc::new(KeptStore::default());
    interrupted_configure(&backend, &store, sealing(KEY_A)).await;
    let mut forced = sealing(KEY_B);
    forced.fail_unreadable_configures = true;
    let engine = Engine::start(backend.clone(), store.clone(), forced)
        .await
        .unwrap();
    let m = engine.get("m-0").unwrap();
    assert_eq!(m.state, MachineState::Failed);
    assert!(
        m.last_error
            .contains("none of the 1 keys of --state-encryption-key-file"),
        "{}",
        m.last_error
    );
    assert!(stored_slot(&store, "m-0").sealed.is_none());
    assert_eq!(backend.configured.lock().unwrap().len(), 1, "never re-run");
}

#[tokio::test(start_paused = true)]
async fn without_keys_no_blob_reaches_the_state() {
    let backend = Scripted::with(1, None);
    let store = Arc::new(KeptStore::default());
    interrupted_configure(&backend, &store, options()).await;
    assert!(stored_slot(&store, "m-0").sealed.is_none());
    let engine = Engine::start(backend.clone(), store.clone(), options())
        .await
        .unwrap();
    assert_eq!(engine.get("m-0").unwrap().last_error, CONFIGURE_NOT_KEPT);
}

// --- answers never show what is not durable ----------------------------------------------

/// A durable store whose commits complete only when the test releases them, in order.
#[derive(Default)]
struct GatedStore {
    hold: AtomicBool,
    held: Mutex<Vec<tokio::sync::oneshot::Sender<Result<(), StoreError>>>>,
}

impl GatedStore {
    fn release(&self) {
        for tx in self.held.lock().unwrap().drain(..) {
            let _ = tx.send(Ok(()));
        }
    }
}

impl Store for GatedStore {
    fn load(&self) -> Result<Snapshot, StoreError> {
        Ok(Snapshot::default())
    }
    fn submit(&self, _batch: Vec<Change>) -> Commit {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.hold.load(Ordering::SeqCst) {
            self.held.lock().unwrap().push(tx);
        } else {
            let _ = tx.send(Ok(()));
        }
        Commit::pending(rx)
    }
    fn is_durable(&self) -> bool {
        true
    }
    fn describe(&self) -> String {
        "gated".into()
    }
}

/// An engine over one machine whose commits are held from now on, and a zero-token Create of
/// m-0 waiting on its commit.
async fn held_create() -> (
    Arc<Engine>,
    Arc<GatedStore>,
    tokio::task::JoinHandle<Result<Ack, CoreError>>,
) {
    let store = Arc::new(GatedStore::default());
    let engine = Engine::start(Scripted::with(1, None), store.clone(), options())
        .await
        .unwrap();
    store.hold.store(true, Ordering::SeqCst);
    let create = tokio::spawn({
        let engine = engine.clone();
        async move { engine.create("m-0", zero()).await }
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    (engine, store, create)
}

#[tokio::test(start_paused = true)]
async fn a_zero_token_retry_is_answered_only_once_the_first_commit_is_durable() {
    let (engine, store, first) = held_create().await;
    let retry = tokio::spawn({
        let engine = engine.clone();
        async move { engine.create("m-0", zero()).await }
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(
        !first.is_finished() && !retry.is_finished(),
        "neither the accept nor its retry is answered before the commit"
    );
    store.hold.store(false, Ordering::SeqCst);
    store.release();
    let (first, retry) = (first.await.unwrap().unwrap(), retry.await.unwrap().unwrap());
    assert!(first.accepted && !retry.accepted);
    assert_eq!(first.operation_id, retry.operation_id);
}

#[tokio::test(start_paused = true)]
async fn reads_wait_for_the_commit_of_what_they_show() {
    let backend = Scripted::with(2, None);
    let store = Arc::new(GatedStore::default());
    let engine = Engine::start(backend, store.clone(), options())
        .await
        .unwrap();
    let head = engine.list(&ListQuery::default()).revision;
    assert!(matches!(
        engine.list_durable(&ListQuery::default()),
        Durable::Now(_)
    ));
    store.hold.store(true, Ordering::SeqCst);
    let create = tokio::spawn({
        let engine = engine.clone();
        async move { engine.create("m-0", zero()).await }
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    // m-1 did not change: answered at once. m-0 and the head wait for the commit.
    assert!(matches!(
        engine.get_durable("m-1").unwrap(),
        Durable::Now(_)
    ));
    let get = engine.get_durable("m-0").unwrap();
    let list = engine.list_durable(&ListQuery::default());
    let Durable::After { revision, .. } = &list else {
        panic!("the head is not durable yet: {list:?}");
    };
    assert!(*revision > head);
    let reads = tokio::spawn({
        let engine = engine.clone();
        async move { (engine.settle(get).await, engine.settle(list).await) }
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(!reads.is_finished(), "held until the commit lands");
    store.release();
    let (get, list) = reads.await.unwrap();
    assert_eq!(get.unwrap().state, MachineState::Creating);
    assert!(list.unwrap().revision > head);
    create.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_held_read_fails_unavailable_when_the_store_stops() {
    let (engine, _store, _create) = held_create().await;
    let get = engine.get_durable("m-0").unwrap();
    engine.step_down();
    let err = engine.settle(get).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable);
}

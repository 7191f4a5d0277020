//! A host the substrate named for a machine never loses that machine: the Create records it
//! before it goes on, so a deadline that passes while the host boots (or while the substrate
//! is still answering the create call) leaves the machine FAILED with its host; the wire
//! shows no host while the Create runs; reconcile deletes the host of a FAILED machine that
//! holds no cluster binding once the orphan grace passed; and a backend that finishes after
//! its deadline never panics the transition task.

use std::sync::Mutex;

use async_trait::async_trait;

use super::test_support::{self, Stub, zero};
use super::*;
use crate::persistence::store::MemoryStore;
use crate::rules::inventory::{Sighting, Survey};
use crate::rules::machine::HostRef;

/// What the backend's Create does once it has the host.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Then {
    /// Waits for the host to boot until cancelled (the deadline), then fails.
    BootPastTheDeadline,
    /// Ignores cancellation: the create call answers `late` after the deadline, the host is
    /// recorded then, and the backend returns success even later.
    AnswerLate { late: Duration },
}

struct Booting {
    then: Then,
    deleted: Mutex<Vec<String>>,
    /// The hosts that exist, by machine.
    hosts: Mutex<Vec<Sighting>>,
}

impl Booting {
    fn new(then: Then) -> Arc<Booting> {
        Arc::new(Booting {
            then,
            deleted: Mutex::new(Vec::new()),
            hosts: Mutex::new(Vec::new()),
        })
    }
}

fn host_of(machine_id: &str) -> HostRef {
    test_support::host_of("p", machine_id)
}

#[async_trait]
impl Stub for Booting {
    fn slots(&self) -> Vec<Machine> {
        vec![test_support::slot("m-0", "z")]
    }
    fn hosts(&self) -> Option<Vec<Sighting>> {
        Some(self.hosts.lock().unwrap().clone())
    }
    async fn create(
        &self,
        machine: &Machine,
        ctx: &TransitionContext,
    ) -> Result<Effect, BackendError> {
        let host = host_of(&machine.id);
        if let Then::AnswerLate { late } = self.then {
            tokio::time::sleep_until(ctx.deadline + late).await;
        }
        self.hosts.lock().unwrap().push(Sighting {
            machine_id: machine.id.clone(),
            host: host.clone(),
        });
        ctx.with_host_provider("p").record_host(&host.id).await?;
        match self.then {
            Then::BootPastTheDeadline => {
                ctx.cancel.cancelled().await;
                Err(BackendError::new("waiting for the host to run: cancelled"))
            }
            Then::AnswerLate { late } => {
                tokio::time::sleep(late).await;
                Ok(test_support::hosted(host))
            }
        }
    }
    async fn delete(&self, machine: &Machine, _: &TransitionContext) -> Result<(), BackendError> {
        let host = machine.host.clone().expect("delete names the host");
        self.hosts.lock().unwrap().retain(|s| s.host != host);
        self.deleted.lock().unwrap().push(host.id);
        Ok(())
    }
}

async fn engine_over(backend: Arc<Booting>, grace: Duration) -> Arc<Engine> {
    let mut options = EngineOptions::new(Telemetry::new("test_host_record"));
    options.timeouts.create = Duration::from_secs(30);
    options.orphan_grace = grace;
    Engine::start(backend, Arc::new(MemoryStore), options)
        .await
        .expect("engine starts")
}

async fn until_failed(engine: &Engine) -> Arc<Machine> {
    for _ in 0..600 {
        let m = engine.get("m-0").expect("m-0");
        if m.state == MachineState::Failed {
            return m;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("m-0 never went FAILED: {:?}", engine.get("m-0"));
}

#[tokio::test(start_paused = true)]
async fn a_create_that_times_out_while_its_host_boots_fails_with_the_host() {
    let backend = Booting::new(Then::BootPastTheDeadline);
    let engine = engine_over(backend.clone(), Duration::from_secs(600)).await;
    engine.create("m-0", zero()).await.expect("acknowledged");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let creating = engine.get("m-0").expect("m-0");
    assert_eq!(creating.state, MachineState::Creating);
    assert_eq!(creating.host, Some(host_of("m-0")), "recorded at once");
    assert!(
        crate::wire::server::machine_to_wire(&creating)
            .host
            .is_none(),
        "the wire shows a host from Idle on"
    );
    let failed = until_failed(&engine).await;
    assert_eq!(failed.host, Some(host_of("m-0")));
    assert!(
        failed.last_error.contains("timed out"),
        "{}",
        failed.last_error
    );
    assert!(crate::wire::server::machine_to_wire(&failed).host.is_some());
    assert_eq!(engine.census().failed_with_host, 1);
}

#[tokio::test(start_paused = true)]
async fn a_host_the_cloud_names_after_the_deadline_lands_on_the_failed_record() {
    let backend = Booting::new(Then::AnswerLate {
        late: Duration::from_secs(5),
    });
    let engine = engine_over(backend.clone(), Duration::from_secs(600)).await;
    engine.create("m-0", zero()).await.expect("acknowledged");
    let failed = until_failed(&engine).await;
    assert_eq!(failed.host, None, "the cloud has not answered yet");
    // The create call answers 5 s after the deadline; the backend reports success 5 s later
    // (stale, discarded without a panic).
    tokio::time::sleep(Duration::from_secs(15)).await;
    let failed = engine.get("m-0").expect("m-0");
    assert_eq!(failed.state, MachineState::Failed);
    assert_eq!(failed.host, Some(host_of("m-0")));
    // Release deletes it.
    engine.release("m-0").await.expect("release");
    assert_eq!(*backend.deleted.lock().unwrap(), vec!["h-m-0".to_owned()]);
    let released = engine.get("m-0").expect("m-0");
    assert_eq!(
        released.state,
        MachineState::Failed,
        "Failed has no way out"
    );
    assert_eq!(released.host, None);
}

#[tokio::test(start_paused = true)]
async fn reconcile_deletes_an_unreleased_failed_hosts_after_the_grace_and_keeps_bound_ones() {
    let backend = Booting::new(Then::BootPastTheDeadline);
    let grace = Duration::from_secs(600);
    let engine = engine_over(backend.clone(), grace).await;
    engine.create("m-0", zero()).await.expect("acknowledged");
    until_failed(&engine).await;
    let first = engine.reconcile().await.expect("reconcile");
    assert_eq!(first.orphans, 1, "counted while it waits: {first:?}");
    assert_eq!(first.failed_hosts_deleted, 0);
    tokio::time::sleep(grace / 2).await;
    assert_eq!(
        engine
            .reconcile()
            .await
            .expect("reconcile")
            .failed_hosts_deleted,
        0
    );
    assert!(
        backend.deleted.lock().unwrap().is_empty(),
        "not before the grace"
    );
    tokio::time::sleep(grace / 2).await;
    let due = engine.reconcile().await.expect("reconcile");
    assert_eq!(due.failed_hosts_deleted, 1, "{due:?}");
    assert_eq!(due.orphans_deleted, 0);
    assert_eq!(*backend.deleted.lock().unwrap(), vec!["h-m-0".to_owned()]);
    let m = engine.get("m-0").expect("m-0");
    assert_eq!(m.state, MachineState::Failed, "still FAILED, for the shard");
    assert_eq!(m.host, None, "and no longer holding the deleted host");
    assert!(m.last_error.contains("timed out"), "kept: {}", m.last_error);
    assert_eq!(engine.census().failed_with_host, 0);
    // Nothing more to do.
    let after = engine.reconcile().await.expect("reconcile");
    assert_eq!(
        (after.orphans, after.failed_hosts_deleted),
        (0, 0),
        "{after:?}"
    );
}

/// A FAILED machine bound to a cluster (its Configure or Drain failed) may hold a node: its
/// host is left to the operator, however long.
#[test]
fn a_bound_failed_machines_host_is_never_an_orphan() {
    let mut inventory = Inventory::default();
    let mut m = Machine::speculative("m-0", "cx22");
    m.zone = "z".into();
    m.capacity_type = CapacityType::OnDemand;
    m.state = MachineState::Failed;
    m.host = Some(host_of("m-0"));
    m.cluster = "c1".into();
    let mut changes = Vec::new();
    inventory.seed(vec![m], &mut changes).expect("seed");
    let sighting = Sighting {
        machine_id: "m-0".into(),
        host: host_of("m-0"),
    };
    assert!(!inventory.still_orphan(&sighting));
    let outcome = inventory.reconcile(
        Survey {
            machines: Vec::new(),
            hosts: Some(vec![sighting]),
        },
        None,
        inventory.revision(),
        Instant::now() + Duration::from_secs(100_000),
        Duration::ZERO,
        &mut changes,
    );
    assert_eq!(outcome.report.orphans, 0);
    assert!(outcome.orphans_due.is_empty());
}

//! `admin failed release` finds the host a failed Create left by reading that machine's hosts
//! directly: a survey of every host may have skipped it (a paged listing shifts while other
//! hosts are deleted), and the next reconcile pass would then adopt it behind the operator.

use std::sync::Mutex;

use async_trait::async_trait;

use super::*;
use crate::persistence::store::MemoryStore;
use crate::rules::inventory::Survey;
use crate::rules::machine::{CapacityType, HostRef};

/// One machine whose Create fails after its host exists; the survey misses that host, the
/// per-machine read sees it.
#[derive(Default)]
struct LeftoverBackend {
    deleted: Mutex<Vec<String>>,
}

fn leftover() -> HostRef {
    HostRef {
        provider: "p".into(),
        id: "h-left".into(),
    }
}

#[async_trait]
impl Backend for LeftoverBackend {
    async fn describe(&self) -> Result<Vec<Machine>, BackendError> {
        let mut m = Machine::speculative("m-0", "cx22");
        m.zone = "z".into();
        m.capacity_type = CapacityType::OnDemand;
        Ok(vec![m])
    }
    async fn survey(&self) -> Result<Survey, BackendError> {
        Ok(Survey {
            machines: self.describe().await?,
            hosts: Some(Vec::new()),
        })
    }
    async fn machine_hosts(&self, machine_id: &str) -> Result<Option<Vec<HostRef>>, BackendError> {
        assert_eq!(machine_id, "m-0");
        let gone = self.deleted.lock().expect("lock").contains(&leftover().id);
        Ok(Some(if gone { Vec::new() } else { vec![leftover()] }))
    }
    async fn create(&self, _: &Machine, _: &TransitionContext) -> Result<Effect, BackendError> {
        Err(BackendError::new(
            "waiting for the host to become active: deadline exceeded",
        ))
    }
    async fn configure(
        &self,
        _: &Machine,
        _: &ConfigureOrder,
        _: &TransitionContext,
    ) -> Result<(), BackendError> {
        Ok(())
    }
    async fn drain(&self, _: &Machine, _: i64, _: &TransitionContext) -> Result<(), BackendError> {
        Ok(())
    }
    async fn delete(&self, machine: &Machine, _: &TransitionContext) -> Result<(), BackendError> {
        let host = machine.host.as_ref().expect("delete names the host");
        self.deleted.lock().expect("lock").push(host.id.clone());
        Ok(())
    }
}

#[tokio::test]
async fn release_deletes_a_leftover_host_that_a_survey_missed() {
    let backend = Arc::new(LeftoverBackend::default());
    let engine = Engine::start(
        backend.clone(),
        Arc::new(MemoryStore),
        EngineOptions::new(Telemetry::new("test_release")),
    )
    .await
    .expect("engine starts");
    let zero = FenceToken {
        shard_id: String::new(),
        epoch: 0,
        sequence: 0,
    };
    engine
        .create("m-0", zero)
        .await
        .expect("create acknowledged");
    for _ in 0..10_000 {
        if engine.get("m-0").expect("m-0").state == MachineState::Failed {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(engine.get("m-0").expect("m-0").state, MachineState::Failed);
    assert_eq!(engine.get("m-0").expect("m-0").host, None);

    engine.release("m-0").await.expect("release");
    assert_eq!(
        *backend.deleted.lock().expect("lock"),
        vec!["h-left".to_owned()],
        "release deleted the host the failed Create left"
    );
    assert_eq!(
        engine.get("m-0").expect("m-0").state,
        MachineState::Speculative
    );
}

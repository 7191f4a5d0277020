//! `admin failed release` finds the host a failed Create left by reading that machine's hosts
//! directly: a survey of every host may have skipped it (a paged listing shifts while other
//! hosts are deleted), and the next reconcile pass would then adopt it behind the operator.

use std::sync::Mutex;

use async_trait::async_trait;

use super::test_support::{self, Stub, start_in_memory};
use super::*;
use crate::rules::inventory::Sighting;
use crate::rules::machine::HostRef;

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
impl Stub for LeftoverBackend {
    fn slots(&self) -> Vec<Machine> {
        vec![test_support::slot("m-0", "z")]
    }
    fn hosts(&self) -> Option<Vec<Sighting>> {
        Some(Vec::new())
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
    async fn delete(&self, machine: &Machine, _: &TransitionContext) -> Result<(), BackendError> {
        let host = machine.host.as_ref().expect("delete names the host");
        self.deleted.lock().expect("lock").push(host.id.clone());
        Ok(())
    }
}

#[tokio::test]
async fn release_deletes_a_leftover_host_that_a_survey_missed() {
    let backend = Arc::new(LeftoverBackend::default());
    let engine = start_in_memory(backend.clone(), "test_release").await;
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
    let m = engine.get("m-0").expect("m-0");
    assert_eq!(
        m.state,
        MachineState::Failed,
        "the released id stays FAILED"
    );
    let successor = m
        .last_error
        .rsplit(' ')
        .next()
        .expect("names its successor");
    assert_eq!(
        engine.get(successor).expect("successor").state,
        MachineState::Speculative
    );
}

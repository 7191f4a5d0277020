//! The error-code table of contract.md §3.1 over the wire, with the exact messages:
//! InvalidArgument for a missing id, NotFound for an unknown machine, Internal for every
//! out-of-position mutation (FAILED included, which never changes), FailedPrecondition for
//! fencing and nothing else, and never Unimplemented from backends that can delete.

use std::collections::HashMap;

use fleet_proto::v1alpha1 as pb;
use pb::MachineState::{Configured, Creating, Failed, Idle};
use provider_core::Backend;
use tonic::{Code, Status};

use crate::harness::{self, FAIL_CONFIGURE, SETTLE, ServerSecurity, TestBackend, machine_id};
use crate::wire::{Caller, expect_status};

const KINDS: [&str; 4] = ["create", "configure", "drain", "delete"];

/// Sends mutation `kind` for `id` with a fresh token.
async fn mutate(caller: &mut Caller, kind: &str, id: &str) -> Result<pb::TransitionAck, Status> {
    match kind {
        "create" => caller.create(id).await,
        "configure" => caller.configure(id, "cluster-x", HashMap::new()).await,
        "drain" => caller.drain(id).await,
        "delete" => caller.delete(id).await,
        other => unreachable!("{other}"),
    }
}

fn position(kind: &str, state: &str) -> String {
    format!("providerkit: invalid state transition: cannot {kind} a machine in state {state}")
}

#[tokio::test]
async fn missing_and_unknown_ids() {
    let server = harness::start(TestBackend::instant(1), ServerSecurity::Mtls).await;
    let mut caller = server.caller(crate::wire::TEST_SHARD).await;
    for kind in KINDS {
        expect_status(
            mutate(&mut caller, kind, "").await,
            Code::InvalidArgument,
            "machine_id required",
        )
        .unwrap_or_else(|e| panic!("{kind} with no id: {e}"));
        expect_status(
            mutate(&mut caller, kind, "ghost").await,
            Code::NotFound,
            "providerkit: machine not found: ghost",
        )
        .unwrap_or_else(|e| panic!("{kind} of an unknown id: {e}"));
    }
    expect_status(caller.get("").await, Code::InvalidArgument, "id required").unwrap();
    expect_status(
        caller.get("ghost").await,
        Code::NotFound,
        "machine \"ghost\" not found",
    )
    .unwrap();
    server.stop().await;
}

#[tokio::test]
async fn out_of_position_is_internal_with_the_reference_message() {
    let backend = TestBackend::gated(3);
    let server = harness::start(backend.clone(), ServerSecurity::Mtls).await;
    let mut caller = server.caller(crate::wire::TEST_SHARD).await;
    let (spec, moving, settled) = (machine_id(0), machine_id(1), machine_id(2));

    for kind in ["configure", "drain", "delete"] {
        expect_status(
            mutate(&mut caller, kind, &spec).await,
            Code::Internal,
            &position(kind, "Speculative"),
        )
        .unwrap_or_else(|e| panic!("{kind} on Speculative: {e}"));
    }

    // Held in Creating: every other kind is out of position.
    caller.create(&moving).await.unwrap();
    for kind in ["configure", "drain", "delete"] {
        expect_status(
            mutate(&mut caller, kind, &moving).await,
            Code::Internal,
            &position(kind, "Creating"),
        )
        .unwrap_or_else(|e| panic!("{kind} on Creating: {e}"));
    }
    assert_eq!(
        crate::wire::state_of(&caller.get(&moving).await.unwrap()),
        Creating
    );

    caller.create(&settled).await.unwrap();
    backend.release(2);
    caller.wait_for_state(&settled, Idle, SETTLE).await.unwrap();
    expect_status(
        mutate(&mut caller, "drain", &settled).await,
        Code::Internal,
        &position("drain", "Idle"),
    )
    .unwrap();
    caller
        .configure(&settled, "c", HashMap::new())
        .await
        .unwrap();
    backend.release(1);
    caller
        .wait_for_state(&settled, Configured, SETTLE)
        .await
        .unwrap();
    for kind in ["create", "delete"] {
        expect_status(
            mutate(&mut caller, kind, &settled).await,
            Code::Internal,
            &position(kind, "Configured"),
        )
        .unwrap_or_else(|e| panic!("{kind} on Configured: {e}"));
    }
    server.stop().await;
}

#[tokio::test]
async fn failed_is_terminal_on_the_wire() {
    let (server, mut caller) = harness::insecure(TestBackend::instant(1), "shard-x").await;
    let id = machine_id(0);
    harness::create_idle(&mut caller, &id).await;
    let failed =
        harness::configure_into(&mut caller, &id, FAIL_CONFIGURE, HashMap::new(), Failed).await;
    assert_eq!(
        failed.last_error,
        format!("injected configure failure for {id}")
    );
    assert_eq!(
        failed.cluster, FAIL_CONFIGURE,
        "a failed Configure keeps its binding"
    );
    let head = caller
        .list(pb::ListFilter::default())
        .await
        .unwrap()
        .revision;

    for kind in KINDS {
        expect_status(
            mutate(&mut caller, kind, &id).await,
            Code::Internal,
            &position(kind, "Failed"),
        )
        .unwrap_or_else(|e| panic!("{kind} on Failed: {e}"));
        let now = caller.get(&id).await.unwrap();
        assert_eq!(now, failed, "a rejected {kind} changed the FAILED record");
    }
    let listed = caller
        .list(pb::ListFilter {
            states: vec![Failed as i32],
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(listed.machines, vec![failed]);
    assert_eq!(
        listed.revision, head,
        "nothing changed, so the head did not move"
    );
    server.stop().await;
}

/// Every mutation against every state the test backend can reach: no Unimplemented, and
/// FailedPrecondition never (all tokens are fresh).
#[tokio::test]
async fn no_unimplemented_and_no_failed_precondition_without_fencing() {
    let backend = TestBackend::instant(4);
    assert!(backend.supports_delete());
    let (server, mut caller) = harness::insecure(backend, "shard-u").await;
    let (idle, configured, failed) = (machine_id(1), machine_id(2), machine_id(3));
    for id in [&idle, &configured, &failed] {
        harness::create_idle(&mut caller, id).await;
    }
    harness::configure_into(&mut caller, &configured, "c", HashMap::new(), Configured).await;
    harness::configure_into(&mut caller, &failed, FAIL_CONFIGURE, HashMap::new(), Failed).await;

    let mut seen = Vec::new();
    for id in [
        machine_id(0),
        idle,
        configured,
        failed,
        "ghost".into(),
        String::new(),
    ] {
        for kind in KINDS {
            let code = match mutate(&mut caller, kind, &id).await {
                Ok(_) => Code::Ok,
                Err(status) => status.code(),
            };
            assert_ne!(code, Code::Unimplemented, "{kind} {id:?}");
            assert_ne!(code, Code::FailedPrecondition, "{kind} {id:?}");
            seen.push(code);
        }
    }
    for code in [
        Code::Ok,
        Code::Internal,
        Code::NotFound,
        Code::InvalidArgument,
    ] {
        assert!(
            seen.contains(&code),
            "the sweep must reach {code:?}: {seen:?}"
        );
    }
    server.stop().await;
}

/// A backend without Delete (bare-metal free pool): Delete is Unimplemented after the argument
/// check and before fencing, so it never spends a token, whatever the id.
#[tokio::test]
async fn delete_without_the_capability_is_unimplemented_before_fencing() {
    let backend = TestBackend::without_delete(1);
    assert!(!backend.supports_delete());
    let (server, mut caller) = harness::insecure(backend, "unused").await;
    let id = machine_id(0);
    let token = || ("s1".to_owned(), 1, 1);
    let unsupported = "this provider does not support Delete (bare-metal free-pool semantics)";
    for target in [id.as_str(), "ghost"] {
        let request = crate::wire::delete_request(target, token());
        let result = caller.client.delete(request).await.map(|r| r.into_inner());
        expect_status(result, Code::Unimplemented, unsupported)
            .unwrap_or_else(|e| panic!("Delete {target}: {e}"));
    }
    let request = crate::wire::delete_request("", token());
    let result = caller.client.delete(request).await.map(|r| r.into_inner());
    expect_status(result, Code::InvalidArgument, "machine_id required").unwrap();
    // The token the Deletes carried was never recorded.
    let request = crate::wire::create_request(&id, token());
    caller
        .client
        .create(request)
        .await
        .expect("token (s1, 1, 1) is still fresh");
    server.stop().await;
}

/// A panic inside the backend fails that transition with a clear last_error; the provider
/// keeps serving.
#[tokio::test]
async fn a_backend_panic_fails_the_transition() {
    let (server, mut caller) = harness::insecure(TestBackend::instant(2), "shard-panic").await;
    let id = machine_id(0);
    harness::create_idle(&mut caller, &id).await;
    let panic = crate::harness::PANIC_CONFIGURE;
    let failed = harness::configure_into(&mut caller, &id, panic, HashMap::new(), Failed).await;
    assert_eq!(
        failed.last_error,
        "configure transition aborted: the backend panicked"
    );
    let other = machine_id(1);
    harness::create_idle(&mut caller, &other).await;
    server.stop().await;
}

//! Fencing over the wire (contract.md §4): a high-water mark per (shard, machine), replays and
//! older tokens rejected with FailedPrecondition and the reference message, first contact on an
//! unknown id recorded, marks advancing even when the request then fails, rejected requests
//! leaving no trace, and the all-zero token bypassing everything.

use std::collections::HashMap;

use fleet_proto::v1alpha1 as pb;
use pb::MachineState::{Creating, Failed, Idle, Speculative};
use provider_core::OperationKind;
use tonic::{Code, Status};

use crate::harness::{self, FAIL_CONFIGURE, SETTLE, ServerSecurity, TestBackend, machine_id};
use crate::wire::{
    Caller, acked, configure_request, create_request, drain_request, expect_status, state_of,
};

type Token = (String, i64, i64);

fn token(shard: &str, epoch: i64, sequence: i64) -> Token {
    (shard.to_owned(), epoch, sequence)
}

async fn create(caller: &mut Caller, id: &str, t: Token) -> Result<pb::TransitionAck, Status> {
    Ok(caller
        .client
        .create(create_request(id, t))
        .await?
        .into_inner())
}

async fn configure(
    caller: &mut Caller,
    id: &str,
    cluster: &str,
    t: Token,
) -> Result<pb::TransitionAck, Status> {
    let request = configure_request(id, cluster, HashMap::new(), t);
    Ok(caller.client.configure(request).await?.into_inner())
}

async fn drain(caller: &mut Caller, id: &str, t: Token) -> Result<pb::TransitionAck, Status> {
    Ok(caller
        .client
        .drain(drain_request(id, t))
        .await?
        .into_inner())
}

/// The reference's reject message.
fn fenced(t: &Token, id: &str, mark: (i64, i64)) -> String {
    format!(
        "providerkit: request fenced (stale shard token): shard \"{}\" sent (epoch={} seq={}) for machine \"{id}\"; high-water mark is (epoch={} seq={})",
        t.0, t.1, t.2, mark.0, mark.1
    )
}

#[tokio::test]
async fn replays_and_older_tokens_are_rejected() {
    // Under mTLS the shard must be the one the client certificate proves.
    const S1: &str = crate::wire::TEST_SHARD;
    let server = harness::start(TestBackend::instant(1), ServerSecurity::Mtls).await;
    let mut caller = server.caller(S1).await;
    let id = machine_id(0);
    let first = create(&mut caller, &id, token(S1, 3, 7)).await.unwrap();
    caller.wait_for_state(&id, Idle, SETTLE).await.unwrap();

    for stale in [
        token(S1, 3, 7),
        token(S1, 3, 6),
        token(S1, 2, 100),
        token(S1, -1, 9),
    ] {
        expect_status(
            create(&mut caller, &id, stale.clone()).await,
            Code::FailedPrecondition,
            &fenced(&stale, &id, (3, 7)),
        )
        .unwrap_or_else(|e| panic!("{stale:?}: {e}"));
    }
    // A higher epoch accepts any sequence; here it is an idempotent retry of the Create.
    let retry = create(&mut caller, &id, token(S1, 4, 1)).await.unwrap();
    assert_eq!(retry.operation_id, first.operation_id);
    expect_status(
        create(&mut caller, &id, token(S1, 3, 8)).await,
        Code::FailedPrecondition,
        &fenced(&token(S1, 3, 8), &id, (4, 1)),
    )
    .unwrap();
    // int64 extremes are ordinary numbers.
    create(&mut caller, &id, token(S1, i64::MAX, i64::MAX))
        .await
        .unwrap();
    expect_status(
        create(&mut caller, &id, token(S1, i64::MAX, i64::MAX)).await,
        Code::FailedPrecondition,
        &fenced(&token(S1, i64::MAX, i64::MAX), &id, (i64::MAX, i64::MAX)),
    )
    .unwrap();
    server.stop().await;
}

#[tokio::test]
async fn first_contact_on_an_unknown_id_is_recorded() {
    let (server, mut caller) = harness::insecure(TestBackend::instant(1), "unused").await;
    let t = token("s1", 1, 1);
    expect_status(
        create(&mut caller, "ghost", t.clone()).await,
        Code::NotFound,
        "providerkit: machine not found: ghost",
    )
    .unwrap();
    // The zombie's replay is fenced before the lookup: it does not learn whether the id exists.
    expect_status(
        create(&mut caller, "ghost", t.clone()).await,
        Code::FailedPrecondition,
        &fenced(&t, "ghost", (1, 1)),
    )
    .unwrap();
    expect_status(
        create(&mut caller, "ghost", token("s1", 1, 2)).await,
        Code::NotFound,
        "providerkit: machine not found: ghost",
    )
    .unwrap();
    server.stop().await;
}

#[tokio::test]
async fn marks_are_per_shard_and_machine() {
    let (server, mut caller) = harness::insecure(TestBackend::instant(3), "unused").await;
    let (a, b) = (machine_id(0), machine_id(1));
    create(&mut caller, &a, token("s1", 9, 9)).await.unwrap();
    // Another machine of the same shard, and another shard on the same machine, start fresh.
    create(&mut caller, &b, token("s1", 1, 1)).await.unwrap();
    create(&mut caller, &a, token("s2", 1, 1)).await.unwrap();
    // Shard ids are compared exactly.
    create(&mut caller, &a, token("S1", 1, 1)).await.unwrap();
    create(&mut caller, &a, token("s1 ", 1, 1)).await.unwrap();
    // ... and each mark holds for its own pair only.
    for (id, t, mark) in [
        (&a, token("s1", 9, 9), (9, 9)),
        (&b, token("s1", 1, 1), (1, 1)),
        (&a, token("s2", 1, 1), (1, 1)),
    ] {
        expect_status(
            create(&mut caller, id, t.clone()).await,
            Code::FailedPrecondition,
            &fenced(&t, id, mark),
        )
        .unwrap_or_else(|e| panic!("{id} {t:?}: {e}"));
    }
    server.stop().await;
}

#[tokio::test]
async fn the_mark_advances_even_when_the_request_fails() {
    let (server, mut caller) = harness::insecure(TestBackend::instant(2), "unused").await;
    let id = machine_id(0);

    // Out of position (Configure on Speculative): Internal, but the token is spent.
    let t = token("s1", 1, 5);
    expect_status(
        configure(&mut caller, &id, "c", t.clone()).await,
        Code::Internal,
        "providerkit: invalid state transition: cannot configure a machine in state Speculative",
    )
    .unwrap();
    for stale in [t.clone(), token("s1", 1, 4)] {
        expect_status(
            configure(&mut caller, &id, "c", stale.clone()).await,
            Code::FailedPrecondition,
            &fenced(&stale, &id, (1, 5)),
        )
        .unwrap();
    }

    // An accepted transition that fails in the backend: the token stays spent.
    create(&mut caller, &id, token("s1", 1, 6)).await.unwrap();
    caller.wait_for_state(&id, Idle, SETTLE).await.unwrap();
    let t = token("s1", 1, 7);
    configure(&mut caller, &id, FAIL_CONFIGURE, t.clone())
        .await
        .unwrap();
    caller.wait_for_state(&id, Failed, SETTLE).await.unwrap();
    expect_status(
        configure(&mut caller, &id, FAIL_CONFIGURE, t.clone()).await,
        Code::FailedPrecondition,
        &fenced(&t, &id, (1, 7)),
    )
    .unwrap();
    // A newer token reaches the position check: FAILED is out of position for everything.
    expect_status(
        drain(&mut caller, &id, token("s1", 1, 8)).await,
        Code::Internal,
        "providerkit: invalid state transition: cannot drain a machine in state Failed",
    )
    .unwrap();
    server.stop().await;
}

#[tokio::test]
async fn a_rejected_request_leaves_no_trace() {
    let backend = TestBackend::gated(2);
    let (server, mut caller) = harness::insecure(backend.clone(), "unused").await;
    let id = machine_id(1);
    // Establish the mark without moving the machine (Drain on Speculative is out of position).
    drain(&mut caller, &id, token("s1", 2, 5))
        .await
        .unwrap_err();
    let before = caller.list(pb::ListFilter::default()).await.unwrap();

    expect_status(
        create(&mut caller, &id, token("s1", 2, 4)).await,
        Code::FailedPrecondition,
        &fenced(&token("s1", 2, 4), &id, (2, 5)),
    )
    .unwrap();
    let after = caller.list(pb::ListFilter::default()).await.unwrap();
    assert_eq!(
        after.revision, before.revision,
        "a fenced request changed state"
    );
    assert_eq!(state_of(&caller.get(&id).await.unwrap()), Speculative);
    assert_eq!(backend.calls(OperationKind::Create), 0);
    let marks: Vec<_> = server
        .engine
        .snapshot()
        .fences
        .into_iter()
        .map(|f| (f.shard_id, f.machine_id, f.mark.epoch, f.mark.sequence))
        .collect();
    assert_eq!(marks, vec![("s1".to_owned(), id.clone(), 2, 5)]);

    // The mark did not move: the next token of the live shard is accepted.
    let ack = create(&mut caller, &id, token("s1", 2, 6)).await.unwrap();
    assert_eq!(state_of(acked(&ack)), Creating);
    backend.release(1);
    server.stop().await;
}

#[tokio::test]
async fn the_all_zero_token_bypasses_fencing() {
    let (server, mut caller) = harness::insecure(TestBackend::instant(1), "unused").await;
    let id = machine_id(0);
    let zero = token("", 0, 0);
    let first = create(&mut caller, &id, zero.clone()).await.unwrap();
    for _ in 0..3 {
        let again = create(&mut caller, &id, zero.clone()).await.unwrap();
        assert_eq!(again.operation_id, first.operation_id);
    }
    // An empty shard id with a non-zero epoch is a real token, keyed under shard "".
    let real = token("", 1, 0);
    create(&mut caller, &id, real.clone()).await.unwrap();
    expect_status(
        create(&mut caller, &id, real.clone()).await,
        Code::FailedPrecondition,
        &fenced(&real, &id, (1, 0)),
    )
    .unwrap();
    // ... and still never blocks the zero token.
    create(&mut caller, &id, zero).await.unwrap();
    server.stop().await;
}

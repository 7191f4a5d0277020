//! Each fault trigger of `faultprovider`, run with `--transition-timeout 1s`, and what it must do
//! to a machine: the failing transition, the FAILED record's last_error and binding, the
//! deadline, the discarded late success, the readiness gate that never confirms, and FAILED
//! being terminal on the wire.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use fleet_proto::v1alpha1 as pb;
use pb::MachineState::{Configured, Configuring, Creating, Draining, Failed, Idle, Speculative};
use tokio::time::Instant;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;

use crate::provider_process::Provider;
use crate::wire::{self, Caller, acked, expect_status, state_of};
use crate::{caller, start};

/// The transition deadline the provider runs with, and its text in messages.
const TIMEOUT: Duration = Duration::from_secs(1);
const TIMEOUT_FLAG: &str = "1s";
/// The message of a Configure that hit the deadline.
const CONFIGURE_TIMED_OUT: &str =
    "configure transition timed out after 1s: context deadline exceeded";
/// Time for a transition without faults to settle.
const SETTLE: Duration = Duration::from_secs(5);
/// Slack for timing assertions on a busy machine.
const SLACK: Duration = Duration::from_millis(150);

/// Creates `id` and waits until it is Idle.
async fn idle(caller: &mut Caller, id: &str) -> pb::Machine {
    caller.create(id).await.expect("Create");
    caller.wait_for_state(id, Idle, SETTLE).await.expect("Idle")
}

/// A provider of its own (`--transition-timeout 1s`) with `id` created and Idle: the provider,
/// a caller and the Idle record.
async fn idle_on_a_provider(id: &str) -> (Provider, Caller, pb::Machine) {
    let provider = start(TIMEOUT_FLAG).await;
    let mut caller = caller(&provider).await;
    let machine = idle(&mut caller, id).await;
    (provider, caller, machine)
}

/// A Configure of `id` into `cluster` that ends FAILED, with only Configuring seen on the way
/// (within the deadline and [`SETTLE`]): the FAILED record, when the Configure was accepted and
/// when it was first seen FAILED.
async fn configure_until_failed(
    caller: &mut Caller,
    id: &str,
    cluster: &str,
) -> (pb::Machine, Instant, Instant) {
    let accepted = Instant::now();
    caller
        .configure(id, cluster, HashMap::new())
        .await
        .expect("Configure");
    let (failed, at) = until_failed(caller, id, Configuring, TIMEOUT + SETTLE).await;
    (failed, accepted, at)
}

/// Polls Get until FAILED, asserting on the way that the machine only ever shows `allowed`.
/// Returns the FAILED record and when it was first seen.
async fn until_failed(
    caller: &mut Caller,
    id: &str,
    allowed: pb::MachineState,
    within: Duration,
) -> (pb::Machine, Instant) {
    let deadline = Instant::now() + within;
    loop {
        let machine = caller.get(id).await.expect("Get");
        match state_of(&machine) {
            Failed => return (machine, Instant::now()),
            state => assert_eq!(state, allowed, "{id} passed through {state:?}: {machine:?}"),
        }
        assert!(
            Instant::now() < deadline,
            "{id} not FAILED within {within:?}"
        );
        tokio::time::sleep(wire::POLL_EVERY).await;
    }
}

#[tokio::test]
async fn seeds_the_fault_inventory_and_serves_health() {
    let provider = start(TIMEOUT_FLAG).await;
    let mut caller = caller(&provider).await;
    let machines = caller.list_all().await.unwrap();
    let ids: BTreeSet<&str> = machines.iter().map(|m| m.id.as_str()).collect();
    let want: BTreeSet<String> = (0..6)
        .map(|i| format!("fault-spec-{i:03}"))
        .chain((0..8).map(|i| format!("faultcreate-{i}")))
        .collect();
    assert_eq!(ids, want.iter().map(String::as_str).collect());
    for m in &machines {
        assert_eq!(state_of(m), Speculative, "{m:?}");
        let labelled = m.labels.get("conformance.fault/create").map(String::as_str);
        assert_eq!(
            labelled == Some("error"),
            m.id.starts_with("faultcreate-"),
            "{m:?}"
        );
    }
    let channel = provider.default_channel().await.unwrap();
    for service in ["", fleet_proto::SERVICE_NAME] {
        assert_eq!(
            wire::health(&channel, service).await.unwrap(),
            ServingStatus::Serving
        );
    }
}

#[tokio::test]
async fn create_fault_fails_the_create() {
    let provider = start(TIMEOUT_FLAG).await;
    let mut caller = caller(&provider).await;
    let id = "faultcreate-3";
    let ack = caller.create(id).await.unwrap();
    assert_eq!(state_of(acked(&ack)), Creating);
    let (failed, _) = until_failed(&mut caller, id, Creating, SETTLE).await;
    assert_eq!(
        failed.last_error,
        format!("fault: create injected error for {id}")
    );
    assert!(
        failed.host.is_none(),
        "a failed Create has no host: {failed:?}"
    );
}

#[tokio::test]
async fn fault_error_fails_the_configure_at_once() {
    let id = "fault-spec-001";
    let (_provider, mut caller, machine) = idle_on_a_provider(id).await;
    let host = machine.host;
    let metadata = HashMap::from([("k".to_owned(), "v".to_owned())]);
    let accepted = Instant::now();
    let ack = caller
        .configure(id, "fault-error", metadata.clone())
        .await
        .unwrap();
    assert_eq!(state_of(acked(&ack)), Configuring);
    let (failed, at) = until_failed(&mut caller, id, Configuring, SETTLE).await;
    assert!(
        at - accepted < TIMEOUT - SLACK,
        "fault-error must fail before the deadline, took {:?}",
        at - accepted
    );
    assert_eq!(
        failed.last_error,
        format!("fault: configure injected error for {id}")
    );
    assert_eq!(
        (failed.cluster.as_str(), &failed.shard_metadata),
        ("fault-error", &metadata)
    );
    assert_eq!(failed.host, host, "a failed Configure keeps the host");
}

#[tokio::test]
async fn fault_timeout_fails_the_configure_at_the_deadline() {
    let id = "fault-spec-002";
    let (_provider, mut caller, _) = idle_on_a_provider(id).await;
    let (failed, accepted, at) = configure_until_failed(&mut caller, id, "fault-timeout").await;
    assert!(
        at - accepted >= TIMEOUT - SLACK,
        "failed before the deadline: {:?}",
        at - accepted
    );
    assert_eq!(failed.last_error, CONFIGURE_TIMED_OUT);
    assert_eq!(failed.cluster, "fault-timeout");
}

#[tokio::test]
async fn a_late_success_after_the_deadline_is_discarded() {
    let id = "fault-spec-003";
    let (_provider, mut caller, _) = idle_on_a_provider(id).await;
    let (failed, accepted, _) = configure_until_failed(&mut caller, id, "fault-slow-ok").await;
    assert_eq!(failed.last_error, CONFIGURE_TIMED_OUT);
    let head = caller
        .list(pb::ListFilter::default())
        .await
        .unwrap()
        .revision;

    // The backend succeeds at timeout + 1s; watch until well past that.
    let late_success = accepted + TIMEOUT + Duration::from_secs(1);
    while Instant::now() < late_success + Duration::from_millis(500) {
        let now = caller.get(id).await.unwrap();
        assert_eq!(now, failed, "the late success changed the FAILED record");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let after = caller.list(pb::ListFilter::default()).await.unwrap();
    assert_eq!(
        after.revision, head,
        "a discarded completion must not move the head"
    );
    let listed: Vec<_> = after.machines.iter().filter(|m| m.id == id).collect();
    assert_eq!(listed, [&failed]);
}

#[tokio::test]
async fn readiness_block_holds_configuring_then_fails_never_configured() {
    let id = "fault-spec-004";
    let (_provider, mut caller, _) = idle_on_a_provider(id).await;
    // until_failed asserts every observation on the way is Configuring, never Configured.
    let (failed, accepted, at) =
        configure_until_failed(&mut caller, id, "fault-readiness-block").await;
    assert!(
        at - accepted >= TIMEOUT - SLACK,
        "failed before the deadline: {:?}",
        at - accepted
    );
    assert_eq!(failed.last_error, CONFIGURE_TIMED_OUT);
    assert_eq!(failed.cluster, "fault-readiness-block");
}

#[tokio::test]
async fn fault_drain_error_fails_the_drain() {
    let id = "fault-spec-005";
    let (_provider, mut caller, _) = idle_on_a_provider(id).await;
    caller
        .configure(id, "fault-drain-error", HashMap::new())
        .await
        .unwrap();
    caller.wait_for_state(id, Configured, SETTLE).await.unwrap();
    let ack = caller.drain(id).await.unwrap();
    assert_eq!(state_of(acked(&ack)), Draining);
    let (failed, _) = until_failed(&mut caller, id, Draining, SETTLE).await;
    assert_eq!(
        failed.last_error,
        format!("fault: drain injected error for {id} (cluster fault-drain-error)")
    );
    assert_eq!(
        failed.cluster, "fault-drain-error",
        "a failed Drain keeps the binding"
    );
    assert!(failed.host.is_some());
}

#[tokio::test]
async fn mutations_on_failed_are_internal_and_change_nothing() {
    let id = "fault-spec-000";
    let (_provider, mut caller, _) = idle_on_a_provider(id).await;
    caller
        .configure(id, "fault-error", HashMap::new())
        .await
        .unwrap();
    let (failed, _) = until_failed(&mut caller, id, Configuring, SETTLE).await;
    let failed_create = "faultcreate-0";
    caller.create(failed_create).await.unwrap();
    let (failed_without_host, _) = until_failed(&mut caller, failed_create, Creating, SETTLE).await;

    for (id, record) in [(id, &failed), (failed_create, &failed_without_host)] {
        let results = [
            ("create", caller.create(id).await),
            (
                "configure",
                caller.configure(id, "other", HashMap::new()).await,
            ),
            ("drain", caller.drain(id).await),
            ("delete", caller.delete(id).await),
        ];
        for (kind, result) in results {
            expect_status(
                result,
                Code::Internal,
                &format!(
                    "providerkit: invalid state transition: cannot {kind} a machine in state Failed"
                ),
            )
            .unwrap_or_else(|e| panic!("{kind} on FAILED {id}: {e}"));
        }
        let now = caller.get(id).await.unwrap();
        assert_eq!(&now, record, "rejected mutations changed the FAILED record");
    }
}

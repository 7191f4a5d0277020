//! The machine lifecycle over the wire: every state of a full cycle observed through Get (the
//! backend holds each transition until released), the cluster binding and shard_metadata
//! echoed byte for byte and cleared by a successful Drain, and idempotent retries.

use std::collections::HashMap;

use fleet_proto::v1alpha1 as pb;
use pb::MachineState::{
    Configured, Configuring, Creating, Deleting, Draining, Failed, Idle, Speculative,
};
use provider_core::OperationKind;

use crate::harness::{self, FAIL_DRAIN, SETTLE, ServerSecurity, TestBackend, machine_id};
use crate::wire::{Caller, acked, state_of};

/// Get now, and the state it reports.
async fn observed(caller: &mut Caller, id: &str) -> pb::Machine {
    caller.get(id).await.expect("Get")
}

async fn walk_full_cycle(security: ServerSecurity) {
    let backend = harness::TestBackend::gated(3);
    let server = harness::start(backend.clone(), security).await;
    let mut caller = server.caller(crate::wire::TEST_SHARD).await;
    let id = machine_id(1);
    let cluster = "cluster-1";
    let metadata = HashMap::from([("k".to_owned(), "v".to_owned())]);

    let start = observed(&mut caller, &id).await;
    assert_eq!(state_of(&start), Speculative);
    assert!(start.host.is_none() && start.cluster.is_empty());

    // Create: Creating (no host) until the backend finishes, then Idle with the host.
    let ack = caller.create(&id).await.expect("Create");
    assert_eq!(state_of(acked(&ack)), Creating);
    assert!(acked(&ack).host.is_none());
    let now = observed(&mut caller, &id).await;
    assert_eq!((state_of(&now), now.host.is_none()), (Creating, true));
    backend.release(1);
    let idle = caller.wait_for_state(&id, Idle, SETTLE).await.unwrap();
    let host = idle.host.clone().expect("Idle has a host");
    assert_eq!(
        (host.provider.as_str(), host.r#ref.as_str()),
        ("test", "host-m-001")
    );

    // Configure: Configuring with the binding at acceptance, then Configured.
    let ack = caller
        .configure(&id, cluster, metadata.clone())
        .await
        .expect("Configure");
    assert_eq!(state_of(acked(&ack)), Configuring);
    assert_eq!(acked(&ack).cluster, cluster);
    let now = observed(&mut caller, &id).await;
    assert_eq!(
        (state_of(&now), now.cluster.as_str()),
        (Configuring, cluster)
    );
    assert_eq!(now.shard_metadata, metadata);
    backend.release(1);
    let configured = caller
        .wait_for_state(&id, Configured, SETTLE)
        .await
        .unwrap();
    assert_eq!(configured.host, Some(host.clone()));

    // Drain: Draining still bound, then Idle unbound with the host kept.
    let ack = caller.drain(&id).await.expect("Drain");
    assert_eq!(state_of(acked(&ack)), Draining);
    assert_eq!(acked(&ack).cluster, cluster);
    let now = observed(&mut caller, &id).await;
    assert_eq!((state_of(&now), now.cluster.as_str()), (Draining, cluster));
    backend.release(1);
    let drained = caller.wait_for_state(&id, Idle, SETTLE).await.unwrap();
    assert!(drained.cluster.is_empty() && drained.shard_metadata.is_empty());
    assert_eq!(drained.host, Some(host.clone()));

    // Delete: Deleting with the host, then Speculative without it.
    let ack = caller.delete(&id).await.expect("Delete");
    assert_eq!(state_of(acked(&ack)), Deleting);
    assert_eq!(acked(&ack).host, Some(host));
    assert_eq!(state_of(&observed(&mut caller, &id).await), Deleting);
    backend.release(1);
    let end = caller
        .wait_for_state(&id, Speculative, SETTLE)
        .await
        .unwrap();
    assert!(end.host.is_none() && end.cluster.is_empty() && end.last_error.is_empty());

    for kind in OperationKind::ALL {
        assert_eq!(backend.calls(kind), 1, "{kind:?} ran once");
    }
    // The other machines never moved.
    for other in [machine_id(0), machine_id(2)] {
        assert_eq!(state_of(&observed(&mut caller, &other).await), Speculative);
    }
    server.stop().await;
}

#[tokio::test]
async fn full_cycle_insecure() {
    walk_full_cycle(ServerSecurity::Insecure).await;
}

#[tokio::test]
async fn full_cycle_tls() {
    walk_full_cycle(ServerSecurity::Tls).await;
}

#[tokio::test]
async fn full_cycle_mtls() {
    walk_full_cycle(ServerSecurity::Mtls).await;
}

/// Metadata a shard may send: unicode, empty values, an empty key, NUL bytes, long values.
fn awkward_metadata() -> HashMap<String, String> {
    HashMap::from([
        ("bigfleet.io/shard".to_owned(), "shard-7".to_owned()),
        ("ünïcødé-ключ-鍵".to_owned(), "値🚀\u{200d}ß".to_owned()),
        ("empty-value".to_owned(), String::new()),
        (String::new(), "empty-key".to_owned()),
        ("nul\0key".to_owned(), "nul\0value\0".to_owned()),
        ("long".to_owned(), "x".repeat(64 * 1024)),
    ])
}

fn listed(list: &pb::MachineList, id: &str) -> pb::Machine {
    list.machines
        .iter()
        .find(|m| m.id == id)
        .cloned()
        .unwrap_or_else(|| panic!("{id} not listed"))
}

#[tokio::test]
async fn binding_is_echoed_byte_for_byte_and_cleared_by_drain() {
    let backend = TestBackend::gated(2);
    let server = harness::start(backend.clone(), ServerSecurity::Mtls).await;
    let mut caller = server.caller(crate::wire::TEST_SHARD).await;
    let id = machine_id(0);
    let cluster = "clüster-α\0β 🚀";
    let metadata = awkward_metadata();

    caller.create(&id).await.unwrap();
    backend.release(1);
    caller.wait_for_state(&id, Idle, SETTLE).await.unwrap();

    let ack = caller
        .configure(&id, cluster, metadata.clone())
        .await
        .unwrap();
    assert_eq!(
        (acked(&ack).cluster.as_str(), &acked(&ack).shard_metadata),
        (cluster, &metadata)
    );
    for settle in [true, false] {
        // Once while Configuring, once Configured.
        let got = caller.get(&id).await.unwrap();
        assert_eq!(
            (got.cluster.as_str(), &got.shard_metadata),
            (cluster, &metadata)
        );
        let all = caller.list(pb::ListFilter::default()).await.unwrap();
        let entry = listed(&all, &id);
        assert_eq!(
            (entry.cluster.as_str(), &entry.shard_metadata),
            (cluster, &metadata)
        );
        if settle {
            backend.release(1);
            caller
                .wait_for_state(&id, Configured, SETTLE)
                .await
                .unwrap();
        }
    }

    let ack = caller.drain(&id).await.unwrap();
    assert_eq!(
        (acked(&ack).cluster.as_str(), &acked(&ack).shard_metadata),
        (cluster, &metadata)
    );
    backend.release(1);
    let drained = caller.wait_for_state(&id, Idle, SETTLE).await.unwrap();
    assert!(
        drained.cluster.is_empty() && drained.shard_metadata.is_empty(),
        "{drained:?}"
    );
    let entry = listed(&caller.list(pb::ListFilter::default()).await.unwrap(), &id);
    assert!(
        entry.cluster.is_empty() && entry.shard_metadata.is_empty(),
        "{entry:?}"
    );

    // The next binding starts clean: no residue of the first.
    let small = HashMap::from([("only".to_owned(), "this".to_owned())]);
    let ack = caller
        .configure(&id, "second", small.clone())
        .await
        .unwrap();
    assert_eq!(
        (acked(&ack).cluster.as_str(), &acked(&ack).shard_metadata),
        ("second", &small)
    );
    backend.release(1);
    server.stop().await;
}

#[tokio::test]
async fn a_failed_drain_keeps_the_binding() {
    let backend = TestBackend::instant(1);
    let (server, mut caller) = harness::insecure(backend, "shard-f").await;
    let id = machine_id(0);
    let metadata = awkward_metadata();
    harness::create_idle(&mut caller, &id).await;
    harness::configure_into(&mut caller, &id, FAIL_DRAIN, metadata.clone(), Configured).await;
    caller.drain(&id).await.unwrap();
    let failed = caller.wait_for_state(&id, Failed, SETTLE).await.unwrap();
    assert_eq!(
        failed.last_error,
        format!("injected drain failure for {id}")
    );
    assert_eq!(
        (failed.cluster.as_str(), &failed.shard_metadata),
        (FAIL_DRAIN, &metadata)
    );
    assert!(failed.host.is_some());
    server.stop().await;
}

#[tokio::test]
async fn retries_return_the_same_operation_and_new_cycles_a_new_one() {
    let backend = TestBackend::gated(1);
    let (server, mut caller) = harness::insecure(backend.clone(), "shard-i").await;
    let id = machine_id(0);

    // Create: a retry while Creating and after Idle returns the same id and no new work.
    let create = caller.create(&id).await.unwrap().operation_id;
    let retry = caller.create(&id).await.unwrap();
    assert_eq!(retry.operation_id, create);
    assert_eq!(state_of(acked(&retry)), Creating);
    backend.release(1);
    caller.wait_for_state(&id, Idle, SETTLE).await.unwrap();
    let retry = caller.create(&id).await.unwrap();
    assert_eq!(retry.operation_id, create);
    assert_eq!(
        state_of(acked(&retry)),
        Idle,
        "a retry carries the current snapshot"
    );
    assert_eq!(backend.calls(OperationKind::Create), 1);

    // Configure: a retry with another cluster is the same operation and changes nothing.
    let metadata = HashMap::from([("a".to_owned(), "1".to_owned())]);
    let configure = caller
        .configure(&id, "c1", metadata.clone())
        .await
        .unwrap()
        .operation_id;
    let retry = caller.configure(&id, "c2", HashMap::new()).await.unwrap();
    assert_eq!(retry.operation_id, configure);
    assert_eq!(
        (
            acked(&retry).cluster.as_str(),
            &acked(&retry).shard_metadata
        ),
        ("c1", &metadata)
    );
    backend.release(1);
    caller
        .wait_for_state(&id, Configured, SETTLE)
        .await
        .unwrap();
    assert_eq!(
        caller
            .configure(&id, "c1", metadata)
            .await
            .unwrap()
            .operation_id,
        configure
    );

    let drain = caller.drain(&id).await.unwrap().operation_id;
    assert_eq!(caller.drain(&id).await.unwrap().operation_id, drain);
    backend.release(1);
    caller.wait_for_state(&id, Idle, SETTLE).await.unwrap();

    let delete = caller.delete(&id).await.unwrap().operation_id;
    backend.release(1);
    caller
        .wait_for_state(&id, Speculative, SETTLE)
        .await
        .unwrap();
    // Delete on a slot that reached Speculative through that Delete is the same operation.
    assert_eq!(caller.delete(&id).await.unwrap().operation_id, delete);

    // A new cycle mints a new id.
    let again = caller.create(&id).await.unwrap().operation_id;
    let ids = [&create, &configure, &drain, &delete, &again];
    for (i, a) in ids.iter().enumerate() {
        assert!(a.starts_with("op-"), "{a}");
        for b in &ids[i + 1..] {
            assert_ne!(a, b, "operation ids must be distinct: {ids:?}");
        }
    }
    for (kind, calls) in [
        (OperationKind::Create, 2),
        (OperationKind::Configure, 1),
        (OperationKind::Drain, 1),
        (OperationKind::Delete, 1),
    ] {
        assert_eq!(backend.calls(kind), calls, "{kind:?}");
    }
    backend.release(1);
    server.stop().await;
}

/// Many shards racing the same Create: one transition, one operation id for all of them.
#[tokio::test]
async fn concurrent_creates_share_one_operation() {
    let backend = TestBackend::gated(1);
    let server = harness::start(backend.clone(), ServerSecurity::Insecure).await;
    let id = machine_id(0);
    let mut calls = Vec::new();
    for shard in 0..16 {
        let mut caller = server.caller(&format!("racer-{shard}")).await;
        let id = id.clone();
        calls.push(tokio::spawn(async move { caller.create(&id).await }));
    }
    let mut operations = std::collections::BTreeSet::new();
    for call in calls {
        let ack = call.await.unwrap().expect("Create");
        assert_eq!(state_of(acked(&ack)), Creating);
        operations.insert(ack.operation_id);
    }
    assert_eq!(operations.len(), 1, "{operations:?}");
    backend.release(1);
    let mut caller = server.caller("observer").await;
    caller.wait_for_state(&id, Idle, SETTLE).await.unwrap();
    assert_eq!(backend.calls(OperationKind::Create), 1);
    server.stop().await;
}

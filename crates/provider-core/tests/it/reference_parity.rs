//! Details of the reference's transport behaviour that tonic does not give for free: the code of
//! an oversized request, and health checks counted like every other unary RPC.

use std::collections::HashMap;

use fleet_proto::v1alpha1 as pb;
use tonic::Code;

use crate::harness::{self, SETTLE, ServerSecurity, TestBackend, machine_id};
use crate::wire::{self, ClientSecurity, state_of};

const PARITY: &str = "differs from the reference provider";

/// contract.md §3.1 / §15: a request over the default 4 MiB receive limit is refused at the
/// transport with RESOURCE_EXHAUSTED (grpc-go's code, which BigFleet's client and the
/// conformance suite's B213 expect); tonic's codec would answer OUT_OF_RANGE.
///
/// `serve::serve_grpc` rewrites tonic's refusal to RESOURCE_EXHAUSTED.
#[tokio::test]
async fn oversized_requests_are_resource_exhausted() {
    let (server, mut caller) = harness::insecure(TestBackend::instant(1), "shard-big").await;
    let id = machine_id(0);
    caller.create(&id).await.unwrap();
    caller
        .wait_for_state(&id, pb::MachineState::Idle, SETTLE)
        .await
        .unwrap();

    let metadata = HashMap::from([("big".to_owned(), "x".repeat(5 << 20))]);
    let status = caller
        .configure(&id, "cluster", metadata)
        .await
        .expect_err("a 5 MiB request exceeds the 4 MiB receive limit");
    // Nothing happened to the machine either way.
    let now = caller.get(&id).await.unwrap();
    assert_eq!(state_of(&now), pb::MachineState::Idle);
    assert!(now.cluster.is_empty());
    assert_eq!(
        status.code(),
        Code::ResourceExhausted,
        "{PARITY}: got {:?} {:?}",
        status.code(),
        status.message()
    );
    server.stop().await;
}

/// hetzner.md §14: `<prefix>_grpc_requests_total` counts health checks too, as
/// `method="Check"` (the reference's interceptor sees every unary RPC), so probes can be
/// alerted on.
///
/// `serve::ObservedHealth` counts `Check` through `server::observe`.
#[tokio::test]
async fn health_checks_are_counted_like_the_reference() {
    let metrics = provider_core::telemetry::recorder();
    let server = harness::start(TestBackend::instant(1), ServerSecurity::Insecure).await;
    let channel = server.channel(ClientSecurity::Plaintext).await;
    wire::health(&channel, "").await.unwrap();
    server.caller("s").await.get(&machine_id(0)).await.unwrap();
    let body = metrics.render();
    assert!(
        body.contains("bigfleet_it_grpc_requests_total{method=\"Get\",code=\"OK\"} 1"),
        "{body}"
    );
    assert!(
        body.contains("bigfleet_it_grpc_requests_total{method=\"Check\",code=\"OK\"} 1"),
        "{PARITY}: health checks are not counted:\n{body}"
    );
    server.stop().await;
}

//! SIGTERM: the provider reports NOT_SERVING and refuses new mutations while it waits (up to its
//! grace, here the transition timeout) for in-flight work, then exits 0.

use std::collections::HashMap;
use std::time::Duration;

use fleet_proto::v1alpha1 as pb;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;

use crate::wire::{self, expect_status};
use crate::{caller, start};

#[tokio::test]
async fn sigterm_reports_not_serving_then_exits_zero() {
    let mut provider = start("2s").await;
    let mut caller = caller(&provider).await;
    let channel = provider.default_channel().await.unwrap();
    let busy = "fault-spec-000";
    caller.create(busy).await.unwrap();
    caller
        .wait_for_state(busy, pb::MachineState::Idle, Duration::from_secs(5))
        .await
        .unwrap();
    // An in-flight transition (it blocks until its 2s deadline) keeps the process in its grace.
    caller
        .configure(busy, "fault-timeout", HashMap::new())
        .await
        .unwrap();

    provider.terminate().unwrap();
    wire::wait_for_health(&channel, ServingStatus::NotServing, Duration::from_secs(2))
        .await
        .unwrap_or_else(|e| panic!("{e}; log:\n{}", provider.logs()));
    expect_status(
        caller.create("fault-spec-001").await,
        Code::Unavailable,
        "provider is shutting down; retry against the restarted provider",
    )
    .unwrap();

    let status = provider.wait_exit(Duration::from_secs(10)).await.unwrap();
    assert_eq!(
        status.code(),
        Some(0),
        "exit status; log:\n{}",
        provider.logs()
    );
    assert!(
        provider.logs().contains("shutting down"),
        "{}",
        provider.logs()
    );
}

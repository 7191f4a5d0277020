//! The `hetzner` binary with `--state etcd://…` against a real etcd member (Debian's
//! `etcd-server`, installed by deploy/ci-setup.sh): acknowledged mutations and operation ids
//! survive `kill -9`, a SIGTERM releases the claim, `state export` reads the prefix, and bad
//! etcd flags fail before any port binds.

use std::process::Command;
use std::time::Duration;

use provider_core::etcd::testing::Cluster;

use crate::harness::{binary, blocking, process_spec, state_export as export};
use crate::provider_process::{self, Spec};
use crate::wire;

fn spec(state: &str) -> Spec {
    process_spec(vec![
        "--use-fake-backend".into(),
        "--seed-count=4".into(),
        "--fake-latency=50ms".into(),
        // The fake cloud's hosts live in the process: a reconcile after the kill would
        // rightly find the servers of finished Creates gone and return their machines to
        // SPECULATIVE, and a retried Create would then start a new operation.
        "--reconcile-interval=0".into(),
        format!("--state={state}"),
        "--etcd-lease-ttl=1s".into(),
    ])
}

fn op_number(op: &str) -> u64 {
    op.trim_start_matches("op-").parse().unwrap()
}

#[tokio::test]
async fn acknowledged_mutations_and_op_ids_survive_kill_9_of_a_provider_on_etcd() {
    let etcd = blocking(|| Cluster::start(1));
    let state = etcd.state("/bigfleet/hetzner-e2e");

    let first = provider_process::start(spec(&state)).await.unwrap();
    let mut caller = wire::Caller::new(
        first.default_channel().await.unwrap(),
        wire::Shard::new("shard-e2e", 1),
    );
    let ids = testkit::listing::ids(&mut caller).await;
    assert_eq!(ids.len(), 4);
    let mut acked = Vec::new();
    for id in &ids[..3] {
        acked.push((id.clone(), caller.create(id).await.unwrap().operation_id));
    }
    let status = Command::new("kill")
        .args(["-KILL", &first.pid().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let mut first = first;
    first.wait_exit(Duration::from_secs(10)).await.unwrap();

    // A new process claims the prefix once the killed one's lease ran out.
    let second = provider_process::start(spec(&state)).await.unwrap();
    let mut caller = wire::Caller::new(second.default_channel().await.unwrap(), caller.shard);
    let mut highest = 0;
    for (id, op) in &acked {
        // Every acknowledged Create is there, under its operation id (a retry returns it).
        let retry = caller.create(id).await.unwrap();
        assert_eq!(&retry.operation_id, op, "{id}");
        highest = highest.max(op_number(op));
        caller
            .wait_for_state(
                id,
                fleet_proto::v1alpha1::MachineState::Idle,
                Duration::from_secs(10),
            )
            .await
            .unwrap();
    }
    // Operation ids are never reissued.
    let fresh = caller.create(&ids[3]).await.unwrap();
    assert!(op_number(&fresh.operation_id) > highest, "{fresh:?}");

    // SIGTERM releases the claim; `state export` reads what etcd holds.
    let mut second = second;
    second.stop(Duration::from_secs(15)).await.unwrap();
    let exported = export(&state).unwrap();
    assert!(
        exported["source"]
            .as_str()
            .unwrap()
            .contains("/bigfleet/hetzner-e2e")
    );
    let ops = exported["ops"].as_array().unwrap();
    for (id, op) in acked
        .iter()
        .chain([&(ids[3].clone(), fresh.operation_id.clone())])
    {
        assert!(
            ops.iter().any(|o| o["machine_id"] == id.as_str()
                && o["kind"] == "create"
                && o["operation_id"] == op.as_str()),
            "{id} {op} missing from {exported}"
        );
    }
    let third = provider_process::start(spec(&state)).await.unwrap();
    assert!(
        !third.logs().contains("waiting for the earlier claim"),
        "a SIGTERM released the claim:\n{}",
        third.logs()
    );
}

#[test]
fn bad_etcd_flags_fail_before_any_port_binds() {
    for (args, expected) in [
        (
            vec!["--state=etcd://127.0.0.21:1"],
            "a key prefix is required",
        ),
        (
            vec!["--state=/tmp/x", "--etcd-ca=/tmp/ca.pem"],
            "--etcd-ca is set but --state is not an etcd:// address",
        ),
        (
            vec!["--state=etcd://127.0.0.21:1/p", "--etcd-cert=/tmp/c.pem"],
            "--etcd-cert and --etcd-key must be given together",
        ),
        (
            vec![
                "--state=etcd://127.0.0.21:1/p",
                "--etcd-ca=/nonexistent/ca.pem",
            ],
            "--etcd-ca /nonexistent/ca.pem",
        ),
    ] {
        let out = Command::new(binary())
            .args([
                "--use-fake-backend",
                "--addr=127.0.0.1:0",
                "--metrics-addr=",
            ])
            .args(&args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
        assert!(!stderr.contains("listen on"), "{args:?}: {stderr}");
    }
}

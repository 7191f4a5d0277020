//! The `hetzner` binary with `--state etcd://…` against a real etcd member (Debian's
//! `etcd-server`, installed by deploy/ci-setup.sh): acknowledged mutations and operation ids
//! survive `kill -9`, a SIGTERM releases the claim, `state export` reads the prefix, and bad
//! etcd flags fail before any port binds.

use std::net::{Ipv4Addr, SocketAddrV4, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::provider_process::{self, Spec};
use crate::wire::{self, ClientSecurity};

/// One etcd member on 127.0.0.21 (ports picked free, own data directory), killed on drop.
struct Etcd {
    client: String,
    child: Child,
    _data: tempfile::TempDir,
}

fn free_port(ip: Ipv4Addr) -> u16 {
    TcpListener::bind(SocketAddrV4::new(ip, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap()
}

impl Etcd {
    async fn start() -> Etcd {
        let ip = Ipv4Addr::new(127, 0, 0, 21);
        let data = tempfile::tempdir().unwrap();
        let client = format!("{ip}:{}", free_port(ip));
        let peer = format!("http://{ip}:{}", free_port(ip));
        let child = Command::new("etcd")
            .args([
                "--name=e2e".to_owned(),
                format!("--data-dir={}", data.path().join("e2e").display()),
                format!("--listen-peer-urls={peer}"),
                format!("--initial-advertise-peer-urls={peer}"),
                format!("--listen-client-urls=http://{client}"),
                format!("--advertise-client-urls=http://{client}"),
                format!("--initial-cluster=e2e={peer}"),
                "--heartbeat-interval=50".into(),
                "--election-timeout=500".into(),
                "--auto-compaction-mode=revision".into(),
                "--auto-compaction-retention=1000".into(),
                "--logger=zap".into(),
                "--log-level=error".into(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start etcd (apt-get install etcd-server; deploy/ci-setup.sh does)");
        let etcd = Etcd {
            client,
            child,
            _data: data,
        };
        // Ready once `state export` of an empty prefix answers (it needs a leader).
        let started = Instant::now();
        while export(&etcd.state("/probe")).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "etcd did not start"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        etcd
    }

    fn state(&self, prefix: &str) -> String {
        format!("etcd://{}{prefix}", self.client)
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_hetzner"))
}

fn spec(state: &str) -> Spec {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    Spec {
        name: "hetzner".into(),
        binary: binary(),
        args: vec![
            "--use-fake-backend".into(),
            "--seed-count=4".into(),
            "--fake-latency=50ms".into(),
            // The fake cloud's hosts live in the process: a reconcile after the kill would
            // rightly find the servers of finished Creates gone and return their machines to
            // SPECULATIVE, and a retried Create would then start a new operation.
            "--reconcile-interval=0".into(),
            format!("--state={state}"),
            "--etcd-lease-ttl=1s".into(),
        ],
        metrics: false,
        security: ClientSecurity::Plaintext,
        pki: wire::pki_dir(&root),
    }
}

/// `hetzner state export --state STATE` as parsed JSON.
fn export(state: &str) -> Result<serde_json::Value, String> {
    let out = Command::new(binary())
        .args(["state", "export", "--state", state])
        .output()
        .unwrap();
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())
}

fn op_number(op: &str) -> u64 {
    op.trim_start_matches("op-").parse().unwrap()
}

#[tokio::test]
async fn acknowledged_mutations_and_op_ids_survive_kill_9_of_a_provider_on_etcd() {
    let etcd = Etcd::start().await;
    let state = etcd.state("/bigfleet/hetzner-e2e");

    let first = provider_process::start(spec(&state)).await.unwrap();
    let mut caller = wire::Caller::new(
        first.default_channel().await.unwrap(),
        wire::Shard::new("shard-e2e", 1),
    );
    let ids: Vec<String> = caller
        .list_all()
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.id)
        .collect();
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

//! The `digitalocean` binary on its real backend killed with SIGKILL in the middle of a
//! Configure and started again on the same `--state`: with `--state-encryption-key-file` the
//! Configure resumes under its operation id and ends CONFIGURED with the hook run exactly once,
//! whatever the moment of the kill (before delivery, blob delivered, hook running, hook done but
//! unrecorded, readiness pending); the blob never lies in the state in the clear; a rotated key
//! file still opens it, a key file that cannot open it stops the start before any port binds;
//! without a key file the Configure goes FAILED. Also the saved catalogue: a first start warms
//! prices up and saves it beside the state, a restart serves from it.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use base64::Engine as _;
use fleet_proto::v1alpha1 as pb;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::binary::{Provider, Site, free_port};
use crate::support::*;

/// The join blob, with bytes that are not UTF-8; its secret part is searched for in the state.
const BLOB: &[u8] = b"kubeadm join 10.0.0.1:6443 --token restart.sealedblobsecret\n\x00\xff\xfe";
const BLOB_SECRET: &[u8] = b"sealedblobsecret";
const CLUSTER: &str = "prod-restart";

fn metadata() -> HashMap<String, String> {
    HashMap::from([
        ("bigfleet.io/pool".to_owned(), "general".to_owned()),
        ("bigfleet.io/shard-note".to_owned(), "restart".to_owned()),
    ])
}

/// A fresh state key, as `openssl rand -base64 32` makes one.
fn new_key() -> String {
    base64::engine::general_purpose::STANDARD.encode(rand::random::<[u8; 32]>())
}

/// Writes a key file with `keys`, one per line, and returns its path.
fn key_file(dir: &Path, name: &str, keys: &[&str]) -> String {
    let path = dir.join(name);
    std::fs::write(&path, keys.join("\n") + "\n").unwrap();
    path.display().to_string()
}

/// Every file below `dir` by its relative path, with its bytes.
fn files(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, Vec<u8>>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(root, &path, out);
            } else {
                let bytes = std::fs::read(&path).unwrap();
                out.insert(path.strip_prefix(root).unwrap().to_owned(), bytes);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// No file of the state directory holds the blob, or its secret part, in the clear.
fn assert_blob_not_in_clear(state: &Path) {
    let files = files(state);
    assert!(!files.is_empty(), "no state files in {}", state.display());
    for (path, bytes) in files {
        assert!(
            !contains(&bytes, BLOB) && !contains(&bytes, BLOB_SECRET),
            "the blob is in the clear in {}",
            path.display()
        );
    }
}

/// `digitalocean state export --state DIR`, parsed.
async fn export(state: &Path) -> serde_json::Value {
    let stdout = testkit::cli::state_export(Path::new(BINARY), state).await;
    assert!(
        !contains(&stdout, BLOB_SECRET),
        "state export shows the blob"
    );
    serde_json::from_slice(&stdout).unwrap()
}

/// Whether the export shows a sealed Configure waiting for machine `id`.
fn sealed_configure(export: &serde_json::Value, id: &str) -> bool {
    let machine = testkit::json::entry(export, "machines", "id", id);
    machine.get("sealed_configure").is_some()
}

fn signal(provider: &Provider, signal: Signal) {
    let pid = provider.process.child.id().expect("a running provider");
    kill(Pid::from_raw(i32::try_from(pid).unwrap()), signal).unwrap();
}

/// The agent of a machine's Droplet: a hook that records its arguments, counts its runs in
/// `hook.runs` and waits for `hook.go`; with `readiness`, a readiness command that counts in
/// `ready.runs` and waits for `ready.go`.
struct Droplet {
    dir: PathBuf,
    config_json: String,
    readiness: bool,
}

impl Droplet {
    fn of(provider: &Provider, id: &str, readiness: bool) -> Droplet {
        let (dir, config_json) = provider.droplet_of(id);
        write_executable(
            &dir.join("bootstrap"),
            &format!(
                "#!/bin/sh\necho \"$@\" > '{d}/hook.args'\n{}",
                gated(&dir, "hook", 0),
                d = dir.display()
            ),
        );
        Droplet {
            dir,
            config_json,
            readiness,
        }
    }

    fn boot(&self) -> AgentProcess {
        AgentProcess::spawn(AgentSetup {
            dir: &self.dir,
            config_json: self.config_json.clone(),
            hook: self.dir.join("bootstrap"),
            drain_command: "true".to_owned(),
            readiness_command: self.readiness.then(|| gated(&self.dir, "ready", 0)),
        })
    }

    fn hook_args(&self) -> String {
        std::fs::read_to_string(self.dir.join("hook.args")).unwrap_or_default()
    }
}

/// Flags of a provider on `state` with the key file `keys` (none: no state encryption).
fn state_flags(state: &Path, keys: Option<&str>) -> Vec<String> {
    let mut flags = vec![
        format!("--state={}", state.display()),
        "--configure-timeout=90s".to_owned(),
    ];
    if let Some(keys) = keys {
        flags.push(format!("--state-encryption-key-file={keys}"));
    }
    flags
}

fn refs(flags: &[String]) -> Vec<&str> {
    flags.iter().map(String::as_str).collect()
}

/// A provider on a fresh site and state with `flags`, and one of its machines IDLE.
async fn idle_machine(flags: &[String]) -> (Provider, String) {
    let mut p = Provider::start_on(Site::start().await, &refs(flags)).await;
    let id = p.idle_machine().await;
    (p, id)
}

/// Configures `id` with the test's cluster, blob and metadata; the ack's operation id.
async fn configure(p: &mut Provider, id: &str) -> pb::TransitionAck {
    p.configure_with(id, CLUSTER, BLOB, metadata())
        .await
        .unwrap()
}

/// The Configure of `id` as the shard acknowledged it.
fn assert_bound(m: &pb::Machine) {
    assert_eq!(m.cluster, CLUSTER, "{m:?}");
    assert_eq!(m.shard_metadata, metadata(), "{m:?}");
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Moment {
    /// Acknowledged, and no agent has fetched the command yet (the Droplet's agent is not up).
    BeforeDelivery,
    /// The agent fetched the command and wrote the blob for the hook.
    BlobDelivered,
    /// The hook runs (it waits until the test releases it, after the restart).
    HookRunning,
    /// The hook finished and the agent recorded its outcome, but the provider, paused with
    /// SIGSTOP, never took the ack.
    HookDoneUnrecorded,
    /// The hook succeeded and the readiness command runs (it waits until released).
    ReadinessPending,
}

/// A `--bootstrap-secret` the restarted provider may get instead of the site's (a rotation).
const ROTATED_SECRET: &str = "--bootstrap-secret=a-rotated-bootstrap-secret-0123456789abcdef";

async fn configure_across_a_kill_9(moment: Moment) {
    configure_across_a_kill_9_with(moment, false).await;
}

/// The Configure cut by kill -9 at `moment` and resumed by a new process, which runs with a
/// rotated `--bootstrap-secret` when `rotate` is set.
async fn configure_across_a_kill_9_with(moment: Moment, rotate: bool) {
    let began = Instant::now();
    let site = Site::start().await;
    let state = site.dir.path().join("state");
    let keys = key_file(site.dir.path(), "keys", &[&new_key()]);
    let flags = state_flags(&state, Some(&keys));
    let mut p = Provider::start_on(site, &refs(&flags)).await;
    let id = p.idle_machine().await;
    let droplet = Droplet::of(&p, &id, moment == Moment::ReadinessPending);
    if matches!(moment, Moment::BeforeDelivery | Moment::ReadinessPending) {
        release(&droplet.dir, "hook");
    }
    let mut agent = (moment != Moment::BeforeDelivery).then(|| droplet.boot());

    let ack = configure(&mut p, &id).await;
    let operation_id = ack.operation_id.clone();
    let acked = ack.machine.unwrap();
    assert_eq!(
        acked.state,
        pb::MachineState::Configuring as i32,
        "{acked:?}"
    );
    let dir = droplet.dir.clone();
    match moment {
        Moment::BeforeDelivery => {}
        Moment::BlobDelivered => {
            assert!(
                eventually(Duration::from_secs(20), || dir
                    .join("bootstrap.blob")
                    .exists())
                .await
            );
        }
        Moment::HookRunning => {
            assert!(eventually(Duration::from_secs(20), || runs(&dir, "hook") == 1).await);
        }
        Moment::HookDoneUnrecorded => {
            assert!(eventually(Duration::from_secs(20), || runs(&dir, "hook") == 1).await);
            signal(&p, Signal::SIGSTOP);
            release(&dir, "hook");
            let agent = agent.as_ref().unwrap();
            agent
                .expect_output("command succeeded", Duration::from_secs(20))
                .await;
            // The ack is on its way to a provider that does not read it.
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        Moment::ReadinessPending => {
            assert!(eventually(Duration::from_secs(20), || runs(&dir, "ready") == 1).await);
        }
    }
    let killed = Instant::now();
    p.kill_9().await;
    assert_blob_not_in_clear(&state);
    assert!(
        sealed_configure(&export(&state).await, &id),
        "no sealed blob waits for the interrupted Configure"
    );

    let mut restart_flags = refs(&flags);
    if rotate {
        restart_flags.push(ROTATED_SECRET);
    }
    p.restart(&restart_flags).await;
    let serving = killed.elapsed();
    let resumed = p.get(&id).await;
    assert!(
        resumed.state == pb::MachineState::Configuring as i32
            || resumed.state == pb::MachineState::Configured as i32,
        "{resumed:?}"
    );
    assert_bound(&resumed);
    let retry = configure(&mut p, &id).await;
    assert_eq!(retry.operation_id, operation_id, "{retry:?}");
    match moment {
        Moment::BeforeDelivery => agent = Some(droplet.boot()),
        Moment::BlobDelivered | Moment::HookRunning => release(&dir, "hook"),
        Moment::HookDoneUnrecorded => {}
        Moment::ReadinessPending => release(&dir, "ready"),
    }
    let configured = p.wait_for(&id, pb::MachineState::Configured).await;
    let settled = killed.elapsed();
    assert_bound(&configured);
    let agent = agent.unwrap();
    assert_eq!(runs(&dir, "hook"), 1, "{}", agent.output());
    assert_eq!(droplet.hook_args(), format!("{CLUSTER}\n"));
    // The agent ran the configure command once; the resumed delivery was answered from its
    // record, or took the ack the agent retried.
    assert_eq!(
        agent
            .output()
            .lines()
            .filter(|l| l.contains("running command") && l.contains(".configure."))
            .count(),
        1,
        "{}",
        agent.output()
    );
    let retry = configure(&mut p, &id).await;
    assert_eq!(retry.operation_id, operation_id, "{retry:?}");
    assert!(
        !sealed_configure(&export(&state).await, &id),
        "a sealed blob is left after CONFIGURED"
    );
    assert_blob_not_in_clear(&state);
    eprintln!(
        "timing {moment:?}: kill -9 to serving {serving:?}, kill -9 to CONFIGURED {settled:?}, whole run {:?}",
        began.elapsed()
    );
}

#[tokio::test]
async fn kill_9_before_delivery_resumes_the_configure_to_configured() {
    configure_across_a_kill_9(Moment::BeforeDelivery).await;
}

#[tokio::test]
async fn kill_9_once_the_blob_is_delivered_resumes_the_configure_to_configured() {
    configure_across_a_kill_9(Moment::BlobDelivered).await;
}

#[tokio::test]
async fn kill_9_while_the_hook_runs_resumes_the_configure_without_a_second_run() {
    configure_across_a_kill_9(Moment::HookRunning).await;
}

#[tokio::test]
async fn kill_9_after_the_hook_but_before_its_ack_resumes_from_the_agents_record() {
    configure_across_a_kill_9(Moment::HookDoneUnrecorded).await;
}

#[tokio::test]
async fn kill_9_while_readiness_is_pending_resumes_the_configure_to_configured() {
    configure_across_a_kill_9(Moment::ReadinessPending).await;
}

/// A rotation of `--bootstrap-secret` needs a restart, and the restart resumes the Configure
/// in flight: its hook still runs once, whether the restart came while it ran or after it
/// finished but before its ack was taken.
#[tokio::test]
async fn kill_9_while_the_hook_runs_and_a_rotated_secret_runs_the_hook_once() {
    configure_across_a_kill_9_with(Moment::HookRunning, true).await;
}

#[tokio::test]
async fn kill_9_after_the_hook_and_a_rotated_secret_answers_from_the_agents_record() {
    configure_across_a_kill_9_with(Moment::HookDoneUnrecorded, true).await;
}

/// A provider on `flags` with one machine's Configure cut by kill -9 while its hook runs.
async fn killed_mid_hook(flags: &[String]) -> (Provider, String, Droplet, AgentProcess) {
    let (mut p, id) = idle_machine(flags).await;
    let droplet = Droplet::of(&p, &id, false);
    let agent = droplet.boot();
    configure(&mut p, &id).await;
    assert!(eventually(Duration::from_secs(20), || runs(&droplet.dir, "hook") == 1).await);
    p.kill_9().await;
    (p, id, droplet, agent)
}

/// Sealed with key A; a key file with B alone stops the start before any port binds and leaves
/// the state as it was; "B then A" resumes it to CONFIGURED.
#[tokio::test]
async fn a_rotated_key_file_resumes_the_configure_and_one_without_the_old_key_stops_the_start() {
    let site_dir = tempfile::tempdir().unwrap();
    let (a, b) = (new_key(), new_key());
    let state = site_dir.path().join("state");
    let only_a = key_file(site_dir.path(), "a", &[&a]);
    let (mut p, id, droplet, agent) = killed_mid_hook(&state_flags(&state, Some(&only_a))).await;
    let before = files(&state);

    let only_b = key_file(site_dir.path(), "b", &[&b]);
    let grpc = free_port().await;
    let mut refused = p
        .site
        .spawn(grpc, &refs(&state_flags(&state, Some(&only_b))))
        .await;
    let status = tokio::time::timeout(Duration::from_secs(60), refused.child.wait())
        .await
        .expect("the provider exits")
        .unwrap();
    let logs = refused.logs_after_exit().await;
    assert!(!status.success(), "{logs}");
    assert!(
        logs.contains("--state-encryption-key-file")
            && logs.contains("sealed bootstrap blobs of 1 in-flight Configure"),
        "{logs}"
    );
    assert!(!logs.contains("serving CapacityProvider"), "{logs}");
    assert!(
        tokio::net::TcpStream::connect(("127.0.0.1", grpc))
            .await
            .is_err(),
        "the gRPC port was bound"
    );
    // Only the lock file names the pid of the last process that held it.
    let (mut after, mut before) = (files(&state), before);
    assert!(
        after.remove(Path::new("LOCK")).is_some() && before.remove(Path::new("LOCK")).is_some()
    );
    assert_eq!(after, before, "the refused start changed the state");

    let b_then_a = key_file(site_dir.path(), "b-then-a", &[&b, &a]);
    p.restart(&refs(&state_flags(&state, Some(&b_then_a))))
        .await;
    release(&droplet.dir, "hook");
    let configured = p.wait_for(&id, pb::MachineState::Configured).await;
    assert_bound(&configured);
    assert_eq!(runs(&droplet.dir, "hook"), 1, "{}", agent.output());
    assert!(!sealed_configure(&export(&state).await, &id));
    assert_blob_not_in_clear(&state);
}

/// Sealed with key A, started with B alone and `--fail-unreadable-configures=true`: it serves,
/// and that Configure is FAILED with a last_error naming the flag.
#[tokio::test]
async fn fail_unreadable_configures_fails_the_configure_a_lost_key_sealed() {
    let site_dir = tempfile::tempdir().unwrap();
    let state = site_dir.path().join("state");
    let only_a = key_file(site_dir.path(), "a", &[&new_key()]);
    let (mut p, id, droplet, _agent) = killed_mid_hook(&state_flags(&state, Some(&only_a))).await;
    let only_b = key_file(site_dir.path(), "b", &[&new_key()]);
    let mut flags = state_flags(&state, Some(&only_b));
    flags.push("--fail-unreadable-configures=true".to_owned());
    p.restart(&refs(&flags)).await;
    let failed = p.get(&id).await;
    assert_eq!(failed.state, pb::MachineState::Failed as i32, "{failed:?}");
    assert!(
        failed.last_error.contains("--fail-unreadable-configures"),
        "{}",
        failed.last_error
    );
    assert!(!sealed_configure(&export(&state).await, &id));
    release(&droplet.dir, "hook");
}

/// Without a key file the blob is never kept: the Configure cut by kill -9 is FAILED naming the
/// flag, the start warns about it, and the hook is not run again.
#[tokio::test]
async fn without_a_key_file_a_configure_cut_by_kill_9_is_failed_naming_the_flag() {
    let site_dir = tempfile::tempdir().unwrap();
    let state = site_dir.path().join("state");
    let flags = state_flags(&state, None);
    let (mut p, id, droplet, agent) = killed_mid_hook(&flags).await;
    assert_blob_not_in_clear(&state);
    p.restart(&refs(&flags)).await;
    let failed = p.wait_for(&id, pb::MachineState::Failed).await;
    assert!(
        failed.last_error.contains("--state-encryption-key-file"),
        "{}",
        failed.last_error
    );
    let logs = p.logs();
    assert!(
        logs.lines().any(|l| l.contains("WARN")
            && l.contains("no --state-encryption-key-file: a restart or a takeover fails every Configure in flight")),
        "{logs}"
    );
    release(&droplet.dir, "hook");
    agent
        .expect_output("command succeeded", Duration::from_secs(20))
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(runs(&droplet.dir, "hook"), 1, "{}", agent.output());
    assert_eq!(
        p.get(&id).await.state,
        pb::MachineState::Failed as i32,
        "a late ack must not revive a FAILED Configure"
    );
    assert_blob_not_in_clear(&state);
}

/// A first start warms prices up from the emulator before it serves and saves
/// `catalog.json` in the state directory; a restart serves from it and refreshes in the
/// background.
#[tokio::test]
async fn a_first_start_saves_the_catalogue_and_a_restart_serves_from_it() {
    let site = Site::start().await;
    let state = site.dir.path().join("state");
    let flags = state_flags(&state, None);
    let mut p = Provider::start_on(site, &refs(&flags)).await;
    let id = p.speculative(1).await.remove(0);
    assert!(
        state.join("catalog.json").exists(),
        "no catalog.json once a first start serves: {}",
        p.logs()
    );
    let catalogue: serde_json::Value =
        serde_json::from_slice(&std::fs::read(state.join("catalog.json")).unwrap()).unwrap();
    assert!(
        catalogue["prices"]
            .as_array()
            .is_some_and(|prices| prices.iter().any(|p| p["instance_type"] == "s-2vcpu-4gb")),
        "{catalogue}"
    );
    assert!(!p.logs().contains("saved by the last run"), "{}", p.logs());
    signal(&p, Signal::SIGTERM);
    let status = tokio::time::timeout(Duration::from_secs(30), p.process.child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{}", p.logs());

    let restarted = Instant::now();
    p.restart(&refs(&flags)).await;
    let machine = p.get(&id).await;
    eprintln!("timing restart to serving: {:?}", restarted.elapsed());
    assert_eq!(machine.state, pb::MachineState::Speculative as i32);
    assert!(
        p.logs()
            .contains("pricing: starting with the prices and capacities saved by the last run"),
        "{}",
        p.logs()
    );
}

/// A start whose channel key is not the one the agents of the Droplets in the state pin
/// (`channel-key.json` records it) fails before any port binds, naming the files (the unit
/// tests of `channel_key` cover the other rules).
#[tokio::test]
async fn a_restart_with_a_channel_key_the_live_agents_do_not_pin_is_refused() {
    let site = Site::start().await;
    let state = site.dir.path().join("state");
    let flags = state_flags(&state, None);
    let mut p = Provider::start_on(site, &refs(&flags)).await;
    let record = state.join("channel-key.json");
    let recorded: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&record).expect("a first start records")).unwrap();
    // This site's agents anchor on --bootstrap-ca: no key is pinned.
    assert_eq!(recorded["pinned_spki_sha256"], serde_json::Value::Null);
    p.idle_machine().await;
    signal(&p, Signal::SIGTERM);
    let status = tokio::time::timeout(Duration::from_secs(30), p.process.child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{}", p.logs());

    // As if that Droplet's agent had been handed a pin of another key.
    let other_key = "q83vEjRWeJq83vEjRWeJq83vEjRWeJq83vEjRWeJq80=";
    std::fs::write(
        &record,
        format!(r#"{{"pinned_spki_sha256": "{other_key}"}}"#),
    )
    .unwrap();
    let grpc = free_port().await;
    let mut refused = p.site.spawn(grpc, &refs(&flags)).await;
    let status = tokio::time::timeout(Duration::from_secs(30), refused.child.wait())
        .await
        .expect("the refused start exits")
        .unwrap();
    let logs = refused.logs_after_exit().await;
    assert!(!status.success(), "{logs}");
    assert!(
        logs.contains("--bootstrap-tls-cert")
            && logs.contains("channel-key.json")
            && logs.contains("1 Droplets"),
        "{logs}"
    );
    assert!(
        tokio::net::TcpStream::connect(("127.0.0.1", grpc))
            .await
            .is_err(),
        "the gRPC port was bound"
    );
}

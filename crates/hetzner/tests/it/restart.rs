//! The `hetzner` binary on its real backend (this process's hcloud emulator and the emulator's
//! sshd), killed with SIGKILL in the middle of a Configure and started again on the same
//! `--state` and `--state-encryption-key-file`: before the blob reached the host, once it did,
//! while the hook runs, after the hook finished but before the provider took its outcome, and
//! while the readiness command still fails. Each time the Configure resumes under its operation
//! id, the machine ends CONFIGURED with the acknowledged cluster and shard metadata, the hook
//! ran exactly once, and the blob is nowhere in the state in the clear. Also: the same on etcd
//! (a new process takes over after the lease), an interrupted Configure without the key file
//! (FAILED, and the startup warning), and a wrong key (startup refused, the state untouched
//! but for the pid in its lock file).
//!
//! The emulator's sshd gives a connection to the newest server with the address it arrived on;
//! every server here is 127.0.0.1, so each scenario creates its server right before it
//! configures it.

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine;
use fleet_proto::v1alpha1 as pb;
use hcloud_emulator::{Fault, Sshd};
use pb::MachineState::{Configured, Configuring, Failed, Idle};
use provider_core::etcd::testing::Cluster;

use crate::binary::refuses;
use crate::harness::{
    Env, Options, TOKEN, blocking, process_spec, state_export, until, until_every,
};
use crate::provider_process::{self, Provider};
use crate::wire::{self, Caller, Shard};

/// Where the provider finds the hook, relative to the server's root (the SSH working directory).
const HOOK: &str = "opt/bigfleet/bootstrap";
/// Long enough for a resumed Configure, which waits one run poll (2 s in the binary).
const SETTLE: Duration = Duration::from_secs(20);
/// What the resumed provider logs when it finds the hook still running.
const WAITING: &str = "run in progress on the host; waiting for its record";

/// The cloud side every incarnation of the provider shares: the emulator, its sshd (once
/// started), the SSH and state keys, and the state.
struct Rig {
    env: Env,
    sshd: Option<Sshd>,
    ssh_port: u16,
    state: String,
    /// The state directory (none on etcd), searched for blob bytes.
    state_dir: Option<PathBuf>,
    ssh_key: PathBuf,
    offerings: PathBuf,
}

/// A fresh base64 key of 32 random bytes, as `openssl rand -base64 32` makes one.
fn new_state_key() -> String {
    base64::engine::general_purpose::STANDARD.encode(rand::random::<[u8; 32]>())
}

impl Rig {
    /// `slots` offered cx23 slots; the state in a directory of the test's own unless `etcd`.
    async fn new(slots: usize, etcd: Option<String>) -> Rig {
        let env = Env::new(Options::default()).await;
        let ssh_port = env.ssh_port();
        let dir = env.dir.path().to_owned();
        let (ssh_key, offerings) = env.process_files(&format!(
            r#"[{{"server_type":"cx23","location":"nbg1","count":{slots}}}]"#
        ));
        let (state, state_dir) = match etcd {
            Some(state) => (state, None),
            None => {
                let state_dir = dir.join("state");
                (state_dir.display().to_string(), Some(state_dir))
            }
        };
        Rig {
            env,
            sshd: None,
            ssh_port,
            state,
            state_dir,
            ssh_key,
            offerings,
        }
    }

    /// Writes a key file with `keys`, one a line, and returns its path.
    fn key_file(&self, name: &str, keys: &[&str]) -> PathBuf {
        let path = self.env.dir.path().join(name);
        std::fs::write(&path, keys.join("\n") + "\n").unwrap();
        path
    }

    fn args(&self, key_file: Option<&Path>) -> Vec<String> {
        let mut args = vec![
            "--hetzner-backend=hetzner".to_owned(),
            format!("--token={TOKEN}"),
            format!("--hcloud-endpoint={}", self.env.emulator.endpoint()),
            "--image=ubuntu-24.04".into(),
            format!("--offerings={}", self.offerings.display()),
            format!("--ssh-key={}", self.ssh_key.display()),
            format!("--ssh-port={}", self.ssh_port),
            format!("--bootstrap-hook={HOOK}"),
            // Counts its runs and succeeds once the test creates `ready` (in the server's root).
            "--readiness-command=echo run >> ready.runs; test -e ready".into(),
            format!("--state={}", self.state),
            // Nothing but the Configures under test touches the servers.
            "--reconcile-interval=0".into(),
            "--log-level=info".into(),
            "--metrics-addr=".into(),
        ];
        if let Some(key_file) = key_file {
            args.push(format!(
                "--state-encryption-key-file={}",
                key_file.display()
            ));
        }
        if self.state_dir.is_none() {
            // A killed process's claim on the prefix runs out after this.
            args.push("--etcd-lease-ttl=1s".into());
        }
        args
    }

    async fn start(&self, key_file: Option<&Path>) -> Provider {
        provider_process::start(process_spec(self.args(key_file)))
            .await
            .unwrap()
    }

    /// The emulator's sshd on the reserved port: from now on SSH reaches the servers.
    fn open_ssh(&mut self) {
        self.sshd = Some(self.env.start_emulator_sshd());
    }

    fn root(&self, host: &str) -> PathBuf {
        self.env.dir.path().join("servers").join(host)
    }

    /// Installs the test hook in `host`'s root: it counts its runs, records its arguments and
    /// the blob, and exits once `hook.release` exists. `ready` makes the readiness command pass.
    fn install_hook(&self, host: &str, released: bool, ready: bool) {
        let root = self.root(host);
        let hook = root.join(HOOK);
        std::fs::create_dir_all(hook.parent().unwrap()).unwrap();
        std::fs::write(
            &hook,
            "#!/bin/sh\necho run >> hook.count\nprintf '%s\\n' \"$@\" > hook.args\n\
             cp \"$0.blob\" hook.blob.copy\n\
             while [ ! -e hook.release ]; do sleep 0.02; done\n",
        )
        .unwrap();
        std::fs::set_permissions(&hook, std::fs::Permissions::from_mode(0o755)).unwrap();
        if released {
            self.release_hook(host);
        }
        if ready {
            self.make_ready(host);
        }
    }

    fn release_hook(&self, host: &str) {
        std::fs::write(self.root(host).join("hook.release"), "").unwrap();
    }

    fn make_ready(&self, host: &str) {
        std::fs::write(self.root(host).join("ready"), "").unwrap();
    }

    fn lines(&self, host: &str, file: &str) -> usize {
        std::fs::read_to_string(self.root(host).join(file))
            .map(|text| text.lines().count())
            .unwrap_or(0)
    }

    fn hook_runs(&self, host: &str) -> usize {
        self.lines(host, "hook.count")
    }

    /// The directory of the Configure `operation`'s run on `host`, once it started
    /// (`configure-<operation>-n<nonce>`, the nonce drawn when the Configure was accepted).
    fn run_dir(&self, host: &str, operation: &str) -> PathBuf {
        let runs = self.root(host).join(format!("{HOOK}.runs"));
        let prefix = format!("configure-{operation}-n");
        let found: Vec<PathBuf> = std::fs::read_dir(&runs)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
            .map(|e| e.path())
            .collect();
        assert!(found.len() <= 1, "two runs of one Configure: {found:?}");
        found
            .into_iter()
            .next()
            .unwrap_or_else(|| runs.join(&prefix))
    }

    /// Creates `id` and returns its server once it is IDLE.
    async fn create(&self, caller: &mut Caller, id: &str) -> String {
        caller.create(id).await.unwrap();
        let idle = caller.wait_for_state(id, Idle, SETTLE).await.unwrap();
        idle.host.expect("an IDLE machine has a host").r#ref
    }

    /// A provider (with `key_file`) whose one slot is created and has a Configure accepted
    /// under shard `shard`, with its hook running and held.
    async fn hook_running(
        &self,
        key_file: Option<&Path>,
        shard: &str,
        cluster: &str,
    ) -> (Provider, Caller, Accepted) {
        let provider = self.start(key_file).await;
        let mut caller = Caller::new(
            provider.default_channel().await.unwrap(),
            Shard::new(shard, 1),
        );
        let id = caller.list_all().await.unwrap()[0].id.clone();
        let host = self.create(&mut caller, &id).await;
        self.install_hook(&host, false, true);
        let accepted = configure(&mut caller, &id, &host, cluster).await;
        until("the hook started", || self.hook_runs(&host) == 1).await;
        (provider, caller, accepted)
    }

    /// The state's files, byte for byte.
    fn state_files(&self) -> BTreeMap<PathBuf, Vec<u8>> {
        let mut files = BTreeMap::new();
        let mut pending = vec![self.state_dir.clone().expect("a state directory")];
        while let Some(dir) = pending.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    pending.push(path);
                } else {
                    files.insert(path.clone(), std::fs::read(&path).unwrap());
                }
            }
        }
        files
    }

    /// No blob in the clear in any state file nor in `state export`.
    fn assert_blobs_not_in_state(&self, blobs: &[Vec<u8>]) {
        let export = state_export(&self.state).unwrap().to_string();
        for blob in blobs {
            assert!(
                !export.contains(std::str::from_utf8(blob).unwrap()),
                "state export shows a blob"
            );
        }
        if self.state_dir.is_none() {
            return;
        }
        for (path, bytes) in self.state_files() {
            for blob in blobs {
                assert!(
                    !bytes.windows(blob.len()).any(|w| w == &blob[..]),
                    "{} holds a bootstrap blob in the clear",
                    path.display()
                );
            }
        }
    }

    /// The exported machine `id`.
    fn exported(&self, id: &str) -> serde_json::Value {
        let export = state_export(&self.state).unwrap();
        testkit::json::entry(&export, "machines", "id", id).clone()
    }
}

/// One Configure under test: its request and the operation id it was acknowledged with.
struct Accepted {
    request: pb::ConfigureRequest,
    host: String,
    operation: String,
}

/// Sends a Configure of `id` to `cluster` with a blob and shard metadata of its own.
async fn configure(caller: &mut Caller, id: &str, host: &str, cluster: &str) -> Accepted {
    let metadata = HashMap::from([
        ("bigfleet.io/pool".to_owned(), format!("pool-{cluster}")),
        ("bigfleet.io/moment".to_owned(), cluster.to_owned()),
    ]);
    let mut request = wire::configure_request(id, cluster, metadata, caller.shard.next());
    request.bootstrap_blob =
        format!("join-secret-{cluster}-{:016x}\n", rand::random::<u64>()).into_bytes();
    let ack = caller
        .client
        .configure(request.clone())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(wire::state_of(wire::acked(&ack)), Configuring, "{ack:?}");
    Accepted {
        request,
        host: host.to_owned(),
        operation: ack.operation_id,
    }
}

/// SIGKILL, and waits for the process to be gone. Its log never showed a blob.
async fn kill_9(provider: Provider) {
    let mut provider = provider;
    provider.signal("KILL").unwrap();
    provider.wait_exit(Duration::from_secs(10)).await.unwrap();
    assert!(!provider.logs().contains("join-secret-"));
}

/// A caller for the new incarnation, stamping on from where the last one stopped.
async fn reconnect(provider: &Provider, caller: Caller) -> Caller {
    Caller::new(provider.default_channel().await.unwrap(), caller.shard)
}

/// Creates `id`'s server with a hook that holds until released (and readiness that passes),
/// sends its Configure into `cluster` and waits until the hook started: the host and the
/// accepted Configure.
async fn hook_started(
    rig: &Rig,
    caller: &mut Caller,
    id: &str,
    cluster: &str,
) -> (String, Accepted) {
    let host = rig.create(caller, id).await;
    rig.install_hook(&host, false, true);
    let accepted = configure(caller, id, &host, cluster).await;
    until("the hook started", || rig.hook_runs(&host) == 1).await;
    (host, accepted)
}

/// Kills `provider` (SIGKILL) with the Configure `accepted` sealed in its state, then starts a
/// new one with the state key `key` and reconnects `caller` to it.
async fn killed_and_restarted(
    rig: &Rig,
    provider: Provider,
    caller: Caller,
    key: &Path,
    accepted: &Accepted,
) -> (Provider, Caller) {
    kill_9(provider).await;
    assert_sealed(rig, accepted);
    let provider = rig.start(Some(key)).await;
    let caller = reconnect(&provider, caller).await;
    (provider, caller)
}

/// The killed provider's Configure is in the state, sealed: its blob is there, never in the
/// clear.
fn assert_sealed(rig: &Rig, accepted: &Accepted) {
    rig.assert_blobs_not_in_state(std::slice::from_ref(&accepted.request.bootstrap_blob));
    let machine = rig.exported(&accepted.request.machine_id);
    assert_eq!(machine["state"], "Configuring", "{machine}");
    assert!(
        machine["sealed_configure"]["sealed_bytes"]
            .as_u64()
            .unwrap()
            > 0,
        "{machine}"
    );
}

/// The resumed Configure ended CONFIGURED as acknowledged, its hook ran once with its cluster
/// and blob, a retry answers with its operation id, and the state keeps nothing of it sealed.
async fn assert_resumed(rig: &Rig, caller: &mut Caller, accepted: &Accepted) {
    let request = &accepted.request;
    let id = &request.machine_id;
    let machine = caller
        .wait_for_state(id, Configured, SETTLE)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(machine.cluster, request.cluster_id);
    assert_eq!(machine.shard_metadata, request.shard_metadata);
    assert_eq!(machine.host.unwrap().r#ref, accepted.host);
    let root = rig.root(&accepted.host);
    assert_eq!(
        rig.hook_runs(&accepted.host),
        1,
        "the hook ran exactly once"
    );
    assert_eq!(
        std::fs::read_to_string(root.join("hook.args")).unwrap(),
        format!("{}\n", request.cluster_id)
    );
    assert_eq!(
        std::fs::read(root.join("hook.blob.copy")).unwrap(),
        request.bootstrap_blob
    );
    assert!(!root.join(format!("{HOOK}.blob")).exists());

    let mut retry = request.clone();
    (retry.shard_id, retry.shard_epoch, retry.sequence_number) = caller.shard.next();
    let ack = caller.client.configure(retry).await.unwrap().into_inner();
    assert_eq!(ack.operation_id, accepted.operation, "{ack:?}");

    let export = state_export(&rig.state).unwrap();
    assert!(
        export["machines"]
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m.get("sealed_configure").is_none()),
        "{export}"
    );
    rig.assert_blobs_not_in_state(std::slice::from_ref(&request.bootstrap_blob));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configure_killed_at_each_moment_resumes_and_runs_the_hook_once() {
    let mut rig = Rig::new(5, None).await;
    let key = rig.key_file("state.key", &[&new_state_key()]);
    let mut provider = rig.start(Some(&key)).await;
    let mut caller = Caller::new(
        provider.default_channel().await.unwrap(),
        Shard::new("shard-restart", 1),
    );
    let ids = testkit::listing::ids(&mut caller).await;
    assert_eq!(ids.len(), 5);
    let mut blobs = Vec::new();

    // (a) Acknowledged, and killed before SSH reached the host: the port accepts nothing yet.
    let host = rig.create(&mut caller, &ids[0]).await;
    rig.install_hook(&host, true, true);
    let accepted = configure(&mut caller, &ids[0], &host, "before-delivery").await;
    kill_9(provider).await;
    assert_sealed(&rig, &accepted);
    assert_eq!(rig.hook_runs(&host), 0);
    rig.open_ssh();
    provider = rig.start(Some(&key)).await;
    caller = reconnect(&provider, caller).await;
    assert_resumed(&rig, &mut caller, &accepted).await;
    blobs.push(accepted.request.bootstrap_blob);

    // (b) Killed once the blob is on the host: its whole copy, or the run's directory, is there.
    let host = rig.create(&mut caller, &ids[1]).await;
    rig.install_hook(&host, false, true);
    let runs = rig.root(&host).join(format!("{HOOK}.runs"));
    let accepted = configure(&mut caller, &ids[1], &host, "blob-delivered").await;
    let blob_len = accepted.request.bootstrap_blob.len() as u64;
    until_every(
        "the blob reached the host",
        Duration::from_millis(1),
        || {
            std::fs::read_dir(&runs).is_ok_and(|entries| {
                entries
                    .filter_map(|e| e.ok()?.metadata().ok())
                    .any(|m| m.is_dir() || m.len() == blob_len)
            })
        },
    )
    .await;
    (provider, caller) = killed_and_restarted(&rig, provider, caller, &key, &accepted).await;
    rig.release_hook(&host);
    assert_resumed(&rig, &mut caller, &accepted).await;
    blobs.push(accepted.request.bootstrap_blob);

    // (c) Killed while the hook runs: the new process waits for that run.
    let (host, accepted) = hook_started(&rig, &mut caller, &ids[2], "hook-running").await;
    (provider, caller) = killed_and_restarted(&rig, provider, caller, &key, &accepted).await;
    until("the resumed Configure waits for the run", || {
        provider.logs().contains(WAITING)
    })
    .await;
    let machine = caller.get(&ids[2]).await.unwrap();
    assert_eq!(wire::state_of(&machine), Configuring);
    rig.release_hook(&host);
    assert_resumed(&rig, &mut caller, &accepted).await;
    blobs.push(accepted.request.bootstrap_blob);

    // (d) The hook finishes while the provider is stopped (so it cannot have read the record),
    // then the provider is killed: the new process takes the recorded outcome.
    let (host, accepted) = hook_started(&rig, &mut caller, &ids[3], "hook-finished").await;
    provider.signal("STOP").unwrap();
    rig.release_hook(&host);
    let record = rig.run_dir(&host, &accepted.operation).join("record");
    until("the run recorded its outcome", || record.exists()).await;
    (provider, caller) = killed_and_restarted(&rig, provider, caller, &key, &accepted).await;
    assert_resumed(&rig, &mut caller, &accepted).await;
    blobs.push(accepted.request.bootstrap_blob);

    // (e) Killed while the readiness command still fails; it passes after the restart.
    let host = rig.create(&mut caller, &ids[4]).await;
    rig.install_hook(&host, true, false);
    let accepted = configure(&mut caller, &ids[4], &host, "readiness-pending").await;
    until("a readiness run failed", || {
        rig.lines(&host, "ready.runs") >= 1
    })
    .await;
    let machine = caller.get(&ids[4]).await.unwrap();
    assert_eq!(wire::state_of(&machine), Configuring);
    kill_9(provider).await;
    assert_sealed(&rig, &accepted);
    rig.make_ready(&host);
    provider = rig.start(Some(&key)).await;
    caller = reconnect(&provider, caller).await;
    assert_resumed(&rig, &mut caller, &accepted).await;
    blobs.push(accepted.request.bootstrap_blob);

    rig.assert_blobs_not_in_state(&blobs);
    assert!(!provider.logs().contains("join-secret-"));
    let mut provider = provider;
    provider.stop(Duration::from_secs(10)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_etcd_a_new_process_takes_over_a_configure_killed_mid_hook() {
    let etcd = blocking(|| Cluster::start(1));
    let mut rig = Rig::new(1, Some(etcd.state("/bigfleet/hetzner-restart"))).await;
    rig.open_ssh();
    let key = rig.key_file("state.key", &[&new_state_key()]);
    let (provider, caller, accepted) = rig
        .hook_running(Some(&key), "shard-etcd", "etcd-hook-running")
        .await;
    let host = accepted.host.clone();
    kill_9(provider).await;
    assert_sealed(&rig, &accepted);

    // Serving means it won the claim, once the killed process's lease ran out.
    let provider = rig.start(Some(&key)).await;
    let mut caller = reconnect(&provider, caller).await;
    until("the resumed Configure waits for the run", || {
        provider.logs().contains(WAITING)
    })
    .await;
    rig.release_hook(&host);
    assert_resumed(&rig, &mut caller, &accepted).await;
    let mut provider = provider;
    provider.stop(Duration::from_secs(10)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_key_file_a_configure_killed_mid_hook_ends_failed() {
    const WARNING: &str = "no --state-encryption-key-file: a restart or a takeover fails every \
                           Configure in flight";
    let mut rig = Rig::new(1, None).await;
    rig.open_ssh();
    let (provider, caller, accepted) = rig.hook_running(None, "shard-no-key", "no-key").await;
    assert!(provider.logs().contains(WARNING), "{}", provider.logs());
    let (id, host) = (accepted.request.machine_id.clone(), accepted.host.clone());
    assert!(rig.exported(&id).get("sealed_configure").is_none());
    kill_9(provider).await;

    let provider = rig.start(None).await;
    until("the startup warning is read", || {
        provider
            .logs()
            .lines()
            .any(|l| l.contains("WARN") && l.contains(WARNING))
    })
    .await;
    let mut caller = reconnect(&provider, caller).await;
    let machine = caller.wait_for_state(&id, Failed, SETTLE).await.unwrap();
    assert!(
        machine.last_error.contains("--state-encryption-key-file"),
        "{machine:?}"
    );
    rig.release_hook(&host);
    let record = rig.run_dir(&host, &accepted.operation).join("record");
    until("the run recorded its outcome", || record.exists()).await;
    assert_eq!(rig.hook_runs(&host), 1);
    rig.assert_blobs_not_in_state(&[accepted.request.bootstrap_blob]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_state_key_refuses_to_start_and_changes_nothing() {
    let mut rig = Rig::new(1, None).await;
    rig.open_ssh();
    let (a, b) = (new_state_key(), new_state_key());
    let key_a = rig.key_file("a.key", &[&a]);
    let key_b = rig.key_file("b.key", &[&b]);
    let (provider, caller, accepted) = rig
        .hook_running(Some(&key_a), "shard-wrong-key", "wrong-key")
        .await;
    let host = accepted.host.clone();
    kill_9(provider).await;

    let before = rig.state_files();
    let args = rig.args(Some(&key_b));
    // `refuses` gives the ports.
    let args: Vec<&str> = args
        .iter()
        .map(String::as_str)
        .filter(|a| !a.starts_with("--metrics-addr"))
        .collect();
    refuses(
        &args,
        "the state holds the sealed bootstrap blobs of 1 in-flight Configures and none of the 1 \
         keys of --state-encryption-key-file opens them",
    );
    // Every file but the directory lock, which holds the pid of the last process that took
    // it (the refused one too).
    let after = rig.state_files();
    let changed: Vec<String> = before
        .keys()
        .chain(after.keys())
        .filter(|p| !p.ends_with("LOCK") && before.get(*p) != after.get(*p))
        .map(|p| p.display().to_string())
        .collect();
    assert!(
        changed.is_empty(),
        "the refused start changed the state: {changed:?}"
    );
    assert_sealed(&rig, &accepted);

    // The old key below the new one still opens it.
    let key_ba = rig.key_file("b-then-a.key", &[&b, &a]);
    let provider = rig.start(Some(&key_ba)).await;
    let mut caller = reconnect(&provider, caller).await;
    rig.release_hook(&host);
    assert_resumed(&rig, &mut caller, &accepted).await;
}

/// A first start resolves the offerings' settings from the API and saves them beside the state
/// (`plans.json`); a restart in a 429 storm serves at once from them (and from the saved
/// prices), looking up no image or location before it answers (the unit tests of `plan_cache`
/// cover the file's use only for the same settings, endpoint and token).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_in_a_rate_limit_storm_serves_from_the_saved_plans() {
    let rig = Rig::new(1, None).await;
    let state_dir = rig.state_dir.clone().expect("a local state");
    let mut provider = rig.start(None).await;
    let plans = state_dir.join("plans.json");
    let saved: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&plans).expect("plans.json after a first start"))
            .unwrap();
    assert_eq!(saved["plans"][0]["key"], "cx23/nbg1", "{saved}");
    assert!(saved["plans"][0]["image"].as_i64().is_some(), "{saved}");
    assert!(
        !String::from_utf8_lossy(&std::fs::read(&plans).unwrap()).contains(TOKEN),
        "the token is in plans.json"
    );
    provider.stop(Duration::from_secs(10)).await.unwrap();

    // Every answer from now on is a 429 asking for a minute's wait.
    let storm = || Fault::RateLimited {
        retry_after: Some(60),
        reset_in: Some(60),
    };
    rig.env.emulator.inject((0..10_000).map(|_| storm()));
    let seen_before = rig.env.emulator.seen().len();
    let restarted = tokio::time::Instant::now();
    let provider = rig.start(None).await;
    let mut caller = Caller::new(
        provider.default_channel().await.unwrap(),
        Shard::new("shard-plans", 1),
    );
    let slots = caller.list_all().await.unwrap();
    eprintln!(
        "timing restart to serving in a 429 storm: {:?}",
        restarted.elapsed()
    );
    assert_eq!(slots.len(), 1, "{slots:?}");
    assert!(
        provider
            .logs()
            .contains("settings: starting with the plans saved by the last run"),
        "{}",
        provider.logs()
    );
    let lookups: Vec<_> = rig.env.emulator.seen()[seen_before..]
        .iter()
        .filter(|s| s.path.starts_with("/images") || s.path.starts_with("/locations"))
        .cloned()
        .collect();
    assert!(lookups.is_empty(), "startup looked up {lookups:?}");
    drop(caller);
    let mut provider = provider;
    provider.stop(Duration::from_secs(10)).await.unwrap();
}

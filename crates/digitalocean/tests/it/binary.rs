//! The `digitalocean` binary with its real backend against the emulator, driven over gRPC,
//! with real `bigfleet-agent` processes playing the Droplets: the full lifecycle, a failing
//! hook and a silent agent, each ending where the contract says.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use digitalocean::naming::machine_tag;
use do_emulator::Emulator;
use fleet_proto::v1alpha1 as pb;
use pb::capacity_provider_client::CapacityProviderClient;
use testkit::digitalocean::RunningEmulator;
use testkit::wire;
use tokio::net::TcpListener;
use tonic::transport::Channel;

use crate::support::*;

const BLOB: &[u8] = b"kubeadm join 10.0.0.1:6443 --token binary.e2eblobsecret";

/// A port that was free a moment ago, for a child process to bind.
pub(crate) async fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The emulated cloud and the files a provider process starts with. It outlives the
/// processes: a restarted provider finds the same Droplets, and the agents reach whichever
/// process serves now through one stable bootstrap endpoint (a [`Forwarder`], as a Service in
/// front of the pod).
pub(crate) struct Site {
    pub emulator: Emulator,
    _serving: RunningEmulator,
    pub pki: Pki,
    pub dir: tempfile::TempDir,
    bootstrap: Forwarder,
    args: Vec<String>,
}

impl Site {
    pub async fn start() -> Site {
        let serving = RunningEmulator::start(API_TOKEN).await;
        let (emulator, api_url) = (serving.emulator.clone(), serving.url.clone());
        let dir = tempfile::tempdir().unwrap();
        let pki = pki();
        let file = |name: &str, body: &str| write_file(dir.path(), name, body);
        let (cert, key, ca) = (
            file("channel.pem", &pki.cert_pem),
            file("channel-key.pem", &pki.key_pem),
            file("ca.pem", &pki.ca_pem),
        );
        let offerings = file(
            "offerings.json",
            r#"[{"size":"s-2vcpu-4gb","region":"nyc3","count":4,"resources":{"cpu":"1","memory":"2Gi"}}]"#,
        );
        // Nothing listens behind it until a provider process starts.
        let bootstrap = Forwarder::start(([127, 0, 0, 1], 9).into()).await;
        let args = vec![
            "--provider=do-bin".to_owned(),
            "--region=nyc3".to_owned(),
            "--image=ubuntu-24-04-x64".to_owned(),
            "--reconcile-interval=0".to_owned(),
            "--price-refresh=0".to_owned(),
            format!("--offerings={offerings}"),
            format!("--do-api-url={api_url}"),
            format!(
                "--bootstrap-endpoint=https://127.0.0.1:{}",
                bootstrap.addr.port()
            ),
            format!("--bootstrap-tls-cert={cert}"),
            format!("--bootstrap-tls-key={key}"),
            format!("--bootstrap-ca={ca}"),
        ];
        Site {
            emulator,
            _serving: serving,
            pki,
            dir,
            bootstrap,
            args,
        }
    }

    /// Spawns the `digitalocean` binary on this site with gRPC on `grpc` and `extra` flags
    /// (`--metrics-addr` is off unless `extra` sets it; a `--flag=value` of `extra` replaces
    /// the site's own); the bootstrap endpoint leads to it from now on.
    pub async fn spawn(&self, grpc: u16, extra: &[&str]) -> Spawned {
        let bootstrap = free_port().await;
        self.bootstrap.retarget(([127, 0, 0, 1], bootstrap).into());
        let flag = |arg: &str| arg.split('=').next().unwrap_or(arg).to_owned();
        let replaced: Vec<String> = extra.iter().map(|arg| flag(arg)).collect();
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_digitalocean"));
        cmd.args(
            self.args
                .iter()
                .filter(|arg| !replaced.contains(&flag(arg))),
        )
        .arg(format!("--addr=127.0.0.1:{grpc}"))
        .arg(format!("--bootstrap-addr=127.0.0.1:{bootstrap}"))
        .args(extra)
        .env("DIGITALOCEAN_TOKEN", API_TOKEN)
        .env("BIGFLEET_BOOTSTRAP_SECRET", SECRET)
        // The agents run on loopback, not at the emulated Droplets' addresses (a test
        // that checks the source passes --bootstrap-enrollment-source=droplet).
        .env("BIGFLEET_BOOTSTRAP_ENROLLMENT_SOURCE", "any")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
        if !extra.iter().any(|a| a.starts_with("--metrics-addr")) {
            cmd.arg("--metrics-addr=");
        }
        let mut child = cmd.spawn().unwrap();
        let (output, readers) = testkit::logs::collect_output(&mut child);
        Spawned {
            child,
            output,
            readers,
        }
    }
}

/// A `digitalocean` process with its output collected; killed when dropped.
pub(crate) struct Spawned {
    pub child: tokio::process::Child,
    output: Arc<Mutex<Vec<u8>>>,
    /// The tasks copying its stdout and stderr into `output`.
    readers: Vec<tokio::task::JoinHandle<()>>,
}

impl Spawned {
    pub fn logs(&self) -> String {
        String::from_utf8_lossy(&self.output.lock().unwrap()).into_owned()
    }

    /// Everything the process wrote, once it has exited: the copies of its output are read to
    /// their end first (the exit can be seen before its last lines are).
    pub async fn logs_after_exit(&mut self) -> String {
        for reader in self.readers.drain(..) {
            let _ = tokio::time::timeout(Duration::from_secs(10), reader).await;
        }
        self.logs()
    }

    /// Connects to its gRPC port until it answers (bounded); panics with the log if the process
    /// exits first.
    pub async fn connect(&mut self, grpc: u16) -> CapacityProviderClient<Channel> {
        let endpoint = format!("http://127.0.0.1:{grpc}");
        for _ in 0..400 {
            if let Ok(c) = CapacityProviderClient::connect(endpoint.clone()).await {
                return c;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("provider exited with {status}: {}", self.logs());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("provider never listened: {}", self.logs())
    }
}

pub(crate) struct Provider {
    pub process: Spawned,
    pub client: CapacityProviderClient<Channel>,
    sequence: i64,
    pub site: Site,
}

impl Provider {
    pub async fn start(extra: &[&str]) -> Provider {
        Provider::start_on(Site::start().await, extra).await
    }

    /// Starts a provider process on `site`.
    pub async fn start_on(site: Site, extra: &[&str]) -> Provider {
        let grpc = free_port().await;
        let mut process = site.spawn(grpc, extra).await;
        let client = process.connect(grpc).await;
        Provider {
            process,
            client,
            sequence: 0,
            site,
        }
    }

    /// Kills the process at once (SIGKILL), as a crash would, and waits until it is gone.
    pub async fn kill_9(&mut self) {
        self.process.child.kill().await.unwrap();
    }

    /// Starts a new process on the same site in place of the dead one; the shard keeps
    /// counting its fence sequence.
    pub async fn restart(&mut self, extra: &[&str]) {
        assert!(
            self.process.child.try_wait().unwrap().is_some(),
            "restart of a running provider"
        );
        let grpc = free_port().await;
        self.process = self.site.spawn(grpc, extra).await;
        self.client = self.process.connect(grpc).await;
    }

    /// Waits up to 10 s for `line` in the log (lines from tasks that start next to gRPC may
    /// follow readiness by a moment).
    pub async fn wait_for_log(&self, line: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.logs().contains(line) {
            assert!(
                Instant::now() < deadline,
                "no {line:?} in the log:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn logs(&self) -> String {
        self.process.logs()
    }

    pub fn next(&mut self) -> i64 {
        self.sequence += 1;
        self.sequence
    }

    /// Every machine the provider lists.
    pub async fn listed(&mut self) -> Vec<pb::Machine> {
        self.client
            .list(pb::ListFilter::default())
            .await
            .unwrap()
            .into_inner()
            .machines
    }

    pub async fn speculative(&mut self, n: usize) -> Vec<String> {
        let machines = self.listed().await;
        let mut ids: Vec<String> = machines
            .iter()
            .filter(|m| m.state == pb::MachineState::Speculative as i32)
            .map(|m| m.id.clone())
            .collect();
        ids.sort();
        assert!(ids.len() >= n, "{ids:?}");
        ids.truncate(n);
        ids
    }

    pub async fn get(&mut self, id: &str) -> pb::Machine {
        self.client
            .get(pb::MachineRef { id: id.to_owned() })
            .await
            .unwrap()
            .into_inner()
    }

    /// Waits until the machine reaches `state` (bounded), failing fast on an unexpected FAILED.
    pub async fn wait_for(&mut self, id: &str, state: pb::MachineState) -> pb::Machine {
        for _ in 0..600 {
            let m = self.get(id).await;
            if m.state == state as i32 {
                return m;
            }
            if m.state == pb::MachineState::Failed as i32 {
                panic!("{id} FAILED: {}\n{}", m.last_error, self.logs());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!(
            "{id} never reached {state:?}: {:?}\n{}",
            self.get(id).await,
            self.logs()
        );
    }

    /// Waits until the machine leaves its transitional state (bounded) and returns it.
    pub async fn wait_for_state_or_failed(&mut self, id: &str) -> pb::Machine {
        for _ in 0..600 {
            let m = self.get(id).await;
            let transitional = [
                pb::MachineState::Creating as i32,
                pb::MachineState::Configuring as i32,
                pb::MachineState::Draining as i32,
                pb::MachineState::Deleting as i32,
            ];
            if !transitional.contains(&m.state) {
                return m;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("{id} stayed transitional\n{}", self.logs());
    }

    /// A machine of the first offering slot, created and Idle.
    pub async fn idle_machine(&mut self) -> String {
        let id = self.speculative(1).await.remove(0);
        self.create(&id).await;
        self.wait_for(&id, pb::MachineState::Idle).await;
        id
    }

    /// The shard's next fence token.
    fn token(&mut self) -> (String, i64, i64) {
        ("shard-a".into(), 1, self.next())
    }

    pub async fn create(&mut self, id: &str) {
        let request = wire::create_request(id, self.token());
        self.client.create(request).await.unwrap();
    }

    /// A Drain with `grace` seconds, which the provider must accept.
    pub async fn drain(&mut self, id: &str, grace: i64) {
        let request = pb::DrainRequest {
            grace_period_seconds: grace,
            ..wire::drain_request(id, self.token())
        };
        self.client.drain(request).await.unwrap();
    }

    /// A Delete, which the provider must accept.
    pub async fn delete(&mut self, id: &str) {
        let request = wire::delete_request(id, self.token());
        self.client.delete(request).await.unwrap();
    }

    async fn configure(&mut self, id: &str, cluster: &str, blob: &[u8]) {
        self.configure_with(id, cluster, blob, Default::default())
            .await
            .unwrap();
    }

    /// A Configure with the shard's next fence token; a retry of the same request is the same
    /// call again.
    pub async fn configure_with(
        &mut self,
        id: &str,
        cluster: &str,
        blob: &[u8],
        shard_metadata: std::collections::HashMap<String, String>,
    ) -> Result<pb::TransitionAck, tonic::Status> {
        let sequence_number = self.next();
        let request = pb::ConfigureRequest {
            machine_id: id.into(),
            cluster_id: cluster.into(),
            bootstrap_blob: blob.to_vec(),
            shard_id: "shard-a".into(),
            shard_epoch: 1,
            sequence_number,
            shard_metadata,
        };
        self.client
            .configure(request)
            .await
            .map(tonic::Response::into_inner)
    }

    /// Starts the agent of `machine_id`'s Droplet from the config its user_data carries.
    fn boot_droplet(&self, machine_id: &str, hook_exit: i32) -> (AgentProcess, PathBuf) {
        let (dir, config_json) = self.droplet_of(machine_id);
        let agent = AgentProcess::spawn(AgentSetup {
            dir: &dir,
            config_json,
            hook: recording_hook(&dir, hook_exit),
            drain_command: format!("echo \"$1\" > '{}/drain.args'", dir.display()),
            readiness_command: None,
        });
        (agent, dir)
    }

    /// The Droplet of `machine_id` (by its tag).
    pub fn droplet(&self, machine_id: &str) -> do_emulator::EmulatedDroplet {
        let tag = machine_tag(machine_id);
        self.site
            .emulator
            .droplets()
            .into_iter()
            .find(|d| d.tags.contains(&tag))
            .expect("droplet")
    }

    /// A directory for the agent of `machine_id`'s Droplet, and the agent config its
    /// user_data carries.
    pub fn droplet_of(&self, machine_id: &str) -> (PathBuf, String) {
        let droplet = self.droplet(machine_id);
        let dir = self.site.dir.path().join(droplet.id.to_string());
        std::fs::create_dir_all(&dir).unwrap();
        (dir, agent_config_from_user_data(&droplet.user_data))
    }
}

fn read(dir: &Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(name)).unwrap_or_default()
}

#[tokio::test]
async fn the_binary_runs_the_whole_lifecycle_with_real_agents() {
    let mut p = Provider::start(&[]).await;
    p.wait_for_log("serving on-host agent bootstrap channel")
        .await;
    let ids = p.speculative(2).await;
    let (good, bad) = (ids[0].clone(), ids[1].clone());

    p.create(&good).await;
    p.create(&bad).await;
    let idle = p.wait_for(&good, pb::MachineState::Idle).await;
    let host = idle.host.clone().expect("an Idle machine has a host");
    assert_eq!(host.provider, "do-bin");
    p.wait_for(&bad, pb::MachineState::Idle).await;
    assert_eq!(p.site.emulator.droplets().len(), 2);

    let (good_agent, good_dir) = p.boot_droplet(&good, 0);
    let (_bad_agent, _) = p.boot_droplet(&bad, 7);

    p.configure(&good, "prod-eu", BLOB).await;
    p.configure(&bad, "prod-eu", BLOB).await;
    let configured = p.wait_for(&good, pb::MachineState::Configured).await;
    assert_eq!(configured.cluster, "prod-eu");
    assert_eq!(read(&good_dir, "hook.args"), "prod-eu\n");
    assert_eq!(
        std::fs::read(good_dir.join("hook.blob.copy")).unwrap(),
        BLOB
    );
    let failed = p.wait_for(&bad, pb::MachineState::Failed).await;
    assert_eq!(
        failed.last_error,
        format!("agent bootstrap failed for {bad}: bootstrap hook failed: exit status: 7")
    );

    p.drain(&good, 0).await;
    p.wait_for(&good, pb::MachineState::Idle).await;
    assert_eq!(read(&good_dir, "drain.args"), "1\n");

    p.delete(&good).await;
    p.wait_for(&good, pb::MachineState::Speculative).await;
    assert_eq!(
        p.site.emulator.droplets().len(),
        1,
        "only the FAILED machine's Droplet is left"
    );

    let logs = p.logs() + &good_agent.output();
    for secret in [
        SECRET,
        API_TOKEN,
        token(&good).as_str(),
        token(&bad).as_str(),
        "binary.e2eblobsecret",
    ] {
        assert!(
            !logs.contains(secret),
            "a secret leaked into the logs:\n{logs}"
        );
    }
    let _ = &p.site.pki;
}

#[tokio::test]
async fn a_silent_agent_times_out_into_failed() {
    let mut p = Provider::start(&["--configure-timeout=2s"]).await;
    let id = p.idle_machine().await;
    // No agent ever enrolls or polls for this Droplet.
    p.configure(&id, "prod", BLOB).await;
    let failed = p.wait_for(&id, pb::MachineState::Failed).await;
    assert!(
        failed.last_error.contains("never enrolled")
            || failed.last_error.contains("context deadline exceeded")
                && (failed
                    .last_error
                    .starts_with("configure transition timed out after 2s")
                    || failed
                        .last_error
                        .starts_with(&format!("agent did not apply configure for {id}"))),
        "{}",
        failed.last_error
    );
}

/// `--help` and `-h` show which environment variables hold the secrets, never their values.
#[tokio::test]
async fn help_never_echoes_the_secret_environment_values() {
    let token = "dop_v1_help_must_never_show_0123456789";
    let secret = "bootstrap-secret-help-must-never-show-9876";
    for flag in ["--help", "-h"] {
        let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_digitalocean"))
            .arg(flag)
            .env("DIGITALOCEAN_TOKEN", token)
            .env("BIGFLEET_BOOTSTRAP_SECRET", secret)
            .output()
            .await
            .unwrap();
        assert!(out.status.success());
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(text.contains("--bootstrap-secret"), "{text}");
        assert!(!text.contains(token) && !text.contains(secret), "{text}");
        if flag == "--help" {
            assert!(text.contains("DIGITALOCEAN_TOKEN"), "{text}");
            assert!(text.contains("BIGFLEET_BOOTSTRAP_SECRET"), "{text}");
        }
    }
}

/// A `--bootstrap-ca` with one good and one garbage block stops the provider before it binds
/// any port, with an error naming the flag (and no secret).
#[tokio::test]
async fn a_malformed_bootstrap_ca_fails_startup_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki();
    let file = |name: &str, body: &str| write_file(dir.path(), name, body);
    let (cert, key) = (
        file("channel.pem", &pki.cert_pem),
        file("channel-key.pem", &pki.key_pem),
    );
    let ca = file(
        "ca.pem",
        &format!(
            "{}-----BEGIN CERTIFICATE-----\nZ2FyYmFnZQ==\n-----END CERTIFICATE-----\n",
            pki.ca_pem
        ),
    );
    let (grpc, bootstrap) = (free_port().await, free_port().await);
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_digitalocean"))
            .args([
                "--region=nyc3",
                "--image=ubuntu-24-04-x64",
                "--metrics-addr=",
                "--do-api-url=http://127.0.0.1:1",
            ])
            .arg(format!("--addr=127.0.0.1:{grpc}"))
            .arg(format!("--bootstrap-addr=127.0.0.1:{bootstrap}"))
            .arg(format!(
                "--bootstrap-endpoint=https://127.0.0.1:{bootstrap}"
            ))
            .arg(format!("--bootstrap-tls-cert={cert}"))
            .arg(format!("--bootstrap-tls-key={key}"))
            .arg(format!("--bootstrap-ca={ca}"))
            .env("DIGITALOCEAN_TOKEN", API_TOKEN)
            .env("BIGFLEET_BOOTSTRAP_SECRET", SECRET)
            .stdin(Stdio::null())
            .output(),
    )
    .await
    .unwrap()
    .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("--bootstrap-ca") && text.contains("certificate 2 is not a valid X.509"),
        "{text}"
    );
    assert!(!text.contains("serving"), "{text}");
    assert!(
        !text.contains(SECRET) && !text.contains(API_TOKEN),
        "{text}"
    );
}

#[test]
fn check_is_listed_in_the_help_and_has_its_own() {
    let check = testkit::cli::check_help(
        std::path::Path::new(env!("CARGO_BIN_EXE_digitalocean")),
        "digitalocean",
    );
    assert!(check.contains("the account's limits"), "{check}");
    assert!(
        !check.contains("--do-api-url"),
        "not the top-level help:\n{check}"
    );
}

//! The test environment: an hcloud emulator and a real SSH listener on 127.0.0.1, a
//! `HetznerCloud` pointed at both, a bootstrap hook that records what it was given, and a
//! captured log.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use hcloud_emulator::{Emulator, HostKeySource, Root, Sshd, SshdSetup};
use hetzner::api::ClientTiming;
use hetzner::cloud::{HetznerCloud, HetznerConfig, Timing};
use hetzner::ssh::{SshConfig, SshTiming};
use provider_core::backend::{BackendError, ConfigureOrder, TransitionContext};
use provider_core::cloud::{Cloud as _, OwnedHost};
use provider_core::config::Secret;
use provider_core::machine::Machine;
use provider_core::retry::Backoff;
use provider_core::telemetry::Telemetry;
use russh::keys::ssh_key::LineEnding;
use russh::keys::{Algorithm, PrivateKey};
use tokio::net::TcpListener;

pub const TOKEN: &str = "it-token-5be0c7d1a9f2";
pub const PROVIDER: &str = "hetzner-it";

/// The `hetzner` binary cargo built for these tests.
pub fn binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_hetzner"))
}

/// The `hetzner` binary as a child process with `args` (besides `--addr`), over plaintext.
pub fn process_spec(args: Vec<String>) -> crate::provider_process::Spec {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    crate::provider_process::Spec {
        name: "hetzner".into(),
        binary: binary(),
        args,
        metrics: false,
        security: crate::wire::ClientSecurity::Plaintext,
        pki: crate::wire::pki_dir(&root),
    }
}

/// `hetzner state export --state STATE` as parsed JSON, or its error output.
pub fn state_export(state: &str) -> Result<serde_json::Value, String> {
    let out = std::process::Command::new(binary())
        .args(["state", "export", "--state", state])
        .output()
        .unwrap();
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())
}

/// Runs `f` on a thread of its own: for what blocks on a runtime of its own, such as starting
/// an etcd (`provider_core::etcd::testing::Cluster::start`).
pub fn blocking<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| s.spawn(f).join().expect("blocking helper"))
}

/// Waits (10 s at most, polling every `every`) until `condition` holds.
pub async fn until_every(what: &str, every: Duration, condition: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !condition() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        tokio::time::sleep(every).await;
    }
}

/// Waits (10 s at most) until `condition` holds.
pub async fn until(what: &str, condition: impl Fn() -> bool) {
    until_every(what, Duration::from_millis(10), condition).await
}

/// `machine` bound to the server `id` (its host reference set to it).
pub fn bound(mut machine: Machine, id: &str) -> Machine {
    machine.host = Some(provider_core::machine::HostRef {
        provider: PROVIDER.into(),
        id: id.into(),
    });
    machine
}

/// Log lines captured from `tracing`.
pub use testkit::logs::LogCapture as Logs;
/// A TCP relay in front of an SSH server: counts connections and can cut every open one, as a
/// network blip or a restarted NAT would.
pub use testkit::relay::Relay;

/// What varies between tests.
pub struct Options {
    pub ssh: bool,
    pub readiness_command: Option<String>,
    pub hook_exit: i32,
    /// How long the hook sleeps before it exits (after it has recorded its arguments).
    pub hook_sleep: Duration,
    /// A line the hook prints to standard error before it exits.
    pub hook_says: Option<String>,
    pub base_user_data: Option<String>,
    pub request_timeout: Duration,
    pub telemetry_prefix: &'static str,
    pub network: Option<String>,
    pub ssh_address: hetzner::cloud::SshAddress,
    /// Further server settings of the flags (image, networks and SSH address come from above).
    pub server: hetzner::settings::ServerSpec,
    /// Per-offering settings.
    pub offerings: Vec<hetzner::settings::OfferingSpec>,
    /// How many times faster than real time the client's API budget refills.
    pub api_time_scale: f64,
    /// The boot polls' base interval, when not the fast timing's.
    pub running_poll: Option<Duration>,
    /// The inventory listing's budget, when not the fast timing's 10 s.
    pub list_budget: Option<Duration>,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            ssh: true,
            readiness_command: None,
            hook_exit: 0,
            hook_sleep: Duration::ZERO,
            hook_says: None,
            base_user_data: None,
            request_timeout: Duration::from_secs(5),
            telemetry_prefix: "bigfleet_hetzner_it",
            network: None,
            ssh_address: hetzner::cloud::SshAddress::Public,
            server: hetzner::settings::ServerSpec::default(),
            offerings: Vec::new(),
            api_time_scale: 1000.0,
            running_poll: None,
            list_budget: None,
        }
    }
}

pub struct Env {
    pub emulator: Emulator,
    pub cloud: Arc<HetznerCloud>,
    pub dir: tempfile::TempDir,
    pub hook: PathBuf,
    pub client_key: PrivateKey,
    pub logs: Logs,
    pub telemetry: Telemetry,
    ssh_listener: Option<TcpListener>,
    _log_guard: tracing::subscriber::DefaultGuard,
}

pub fn fast_timing(request_timeout: Duration) -> Timing {
    Timing {
        client: ClientTiming {
            request_timeout,
            backoff: Backoff {
                base: Duration::from_millis(10),
                max: Duration::from_millis(200),
                max_attempts: 8,
            },
            max_body: provider_core::cloud::MAX_RESPONSE_BODY,
            // Hetzner's limits with time running a thousand times faster: a test's storm of
            // injected 429s costs milliseconds, as its backoff does.
            budget: provider_core::budget::Settings::new(
                provider_core::budget::Limits::HETZNER.time_scaled(1000.0),
            ),
        },
        ssh: SshTiming {
            attempt_timeout: Duration::from_secs(2),
            retry_interval: Duration::from_millis(30),
            auth_retries: 1,
        },
        running_poll: Duration::from_millis(5),
        running_cap: Duration::from_secs(30),
        readiness_poll: Duration::from_millis(20),
        run_poll: Duration::from_millis(20),
        list_budget: Duration::from_secs(10),
        lookup_budget: Duration::from_secs(10),
    }
}

/// How many of `commands` delivered a bootstrap blob (started a hook run).
pub fn deliveries(commands: &[String]) -> usize {
    commands
        .iter()
        .filter(|c| c.contains("bootstrap blob truncated"))
        .count()
}

pub fn ctx(seconds: u64) -> TransitionContext {
    TransitionContext::with_timeout("op-it", Duration::from_secs(seconds))
}

/// Configures `machine` on server `server` with `order` within `seconds`, through `cloud`.
pub async fn configure_server(
    cloud: &HetznerCloud,
    machine: &Machine,
    server: i64,
    order: &ConfigureOrder,
    seconds: u64,
) -> Result<(), BackendError> {
    cloud
        .configure_host(machine, &server.to_string(), order, &ctx(seconds))
        .await
}

/// The real backend's flags as a plain deployment gives them: `endpoint` and `token`, a public
/// Ubuntu image reached over SSH as root, no selectors, networks, firewalls or overrides.
pub fn real_args(endpoint: &str, token: &str) -> hetzner::real::RealArgs {
    hetzner::real::RealArgs {
        token: Secret::new(token),
        endpoint: endpoint.into(),
        provider: "hetzner".into(),
        image: "ubuntu-24.04".into(),
        ssh_key: String::new(),
        ssh_user: "root".into(),
        ssh_port: 22,
        image_selector: String::new(),
        networks: Vec::new(),
        firewalls: Vec::new(),
        public_ipv4: true,
        public_ipv6: true,
        ssh_address: "public".into(),
        placement: "none".into(),
        server_labels: Vec::new(),
        login_ssh_keys: Vec::new(),
        overrides: Vec::new(),
        bootstrap_hook: "/opt/bigfleet/bootstrap".into(),
        readiness_command: String::new(),
        base_user_data: String::new(),
        eur_usd: 1.08,
    }
}

/// The error of a Configure that met another host key than the pinned one.
pub fn host_key_mismatch(pinned: &str, presented: &str) -> String {
    format!(
        "ssh handshake 127.0.0.1: host key mismatch: pinned \"{pinned}\", presented \"{presented}\" (possible MITM — refusing)"
    )
}

pub fn new_key() -> PrivateKey {
    PrivateKey::random(&mut rand::rng(), Algorithm::Ed25519).unwrap()
}

use testkit::script::write_executable as executable;

impl Env {
    /// An env with the default options but no SSH key (no SSH listener, no delivery).
    pub async fn without_ssh() -> Env {
        Env::new(Options {
            ssh: false,
            ..Options::default()
        })
        .await
    }

    pub async fn new(options: Options) -> Env {
        let logs = Logs::default();
        let guard = logs.install();
        let emulator = Emulator::start(TOKEN).await.unwrap();
        emulator.set_new_server_ipv4("127.0.0.1");
        let ssh_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let ssh_port = ssh_listener.local_addr().unwrap().port();
        let dir = tempfile::tempdir().unwrap();
        let hook = dir.path().join("opt/bigfleet/bootstrap");
        let record = dir.path().join("hook.args");
        let copy = dir.path().join("hook.blob.copy");
        let mode = dir.path().join("hook.blob.mode");
        let count = dir.path().join("hook.count");
        let done = dir.path().join("hook.done");
        let says = options
            .hook_says
            .as_ref()
            .map(|line| format!("echo '{line}' >&2\n"))
            .unwrap_or_default();
        executable(
            &hook,
            &format!(
                "#!/bin/sh\necho run >> '{}'\nprintf '%s\\n' \"$@\" > '{}'\ncp \"$0.blob\" '{}'\n\
                 stat -c %a \"$0.blob\" > '{}'\nsleep {}\n{says}touch '{}'\nexit {}\n",
                count.display(),
                record.display(),
                copy.display(),
                mode.display(),
                options.hook_sleep.as_secs_f64(),
                done.display(),
                options.hook_exit
            ),
        );
        // Stand-ins for the node's tools, found first on the sshd's PATH.
        let calls = dir.path().join("kubectl.calls");
        executable(
            &dir.path().join("bin/kubectl"),
            &format!("#!/bin/sh\necho \"$@\" >> '{}'\n", calls.display()),
        );
        executable(
            &dir.path().join("bin/hostname"),
            "#!/bin/sh\necho node-it-1\n",
        );
        let client_key = new_key();
        let telemetry = Telemetry::new(options.telemetry_prefix);
        let ssh = options.ssh.then(|| SshConfig {
            user: "root".into(),
            key: client_key.to_openssh(LineEnding::LF).unwrap().to_string(),
            port: ssh_port,
        });
        let cloud = HetznerCloud::new(HetznerConfig {
            token: Secret::new(TOKEN),
            endpoint: emulator.endpoint(),
            provider_instance: PROVIDER.into(),
            server: hetzner::settings::ServerSpec {
                image: "ubuntu-24.04".into(),
                networks: options
                    .network
                    .iter()
                    .map(|n| hetzner::settings::NetworkRef::parse(n).unwrap())
                    .collect(),
                ssh_address: options.ssh_address,
                ..options.server.clone()
            },
            offerings: options.offerings.clone(),
            locations: vec!["nbg1".into(), "fsn1".into()],
            ssh,
            bootstrap_hook: hook.to_str().unwrap().to_owned(),
            base_user_data: options.base_user_data,
            readiness_command: options.readiness_command,
            eur_usd: 1.25,
            telemetry,
            timing: {
                let mut timing = fast_timing(options.request_timeout);
                timing.client.budget.limits =
                    provider_core::budget::Limits::HETZNER.time_scaled(options.api_time_scale);
                if let Some(running_poll) = options.running_poll {
                    timing.running_poll = running_poll;
                }
                if let Some(list_budget) = options.list_budget {
                    timing.list_budget = list_budget;
                }
                timing
            },
        })
        .unwrap();
        Env {
            emulator,
            cloud: Arc::new(cloud),
            dir,
            hook,
            client_key,
            logs,
            telemetry,
            ssh_listener: Some(ssh_listener),
            _log_guard: guard,
        }
    }

    /// Creates `machine`'s host within `seconds`, which must succeed.
    pub async fn create_host(&self, machine: &Machine, seconds: u64) -> OwnedHost {
        self.cloud
            .create_host(machine, &ctx(seconds))
            .await
            .unwrap()
    }

    /// The error of creating `machine`'s host within `seconds`, which must fail.
    pub async fn create_fails(&self, machine: &Machine, seconds: u64) -> BackendError {
        self.cloud
            .create_host(machine, &ctx(seconds))
            .await
            .unwrap_err()
    }

    /// Configures `machine` on server `server` with `order` within `seconds`.
    pub async fn configure(
        &self,
        machine: &Machine,
        server: i64,
        order: &ConfigureOrder,
        seconds: u64,
    ) -> Result<(), BackendError> {
        configure_server(&self.cloud, machine, server, order, seconds).await
    }

    pub fn machine(&self, server_type: &str, zone: &str, index: i64) -> Machine {
        let id = provider_core::fleet::slot_id(PROVIDER, server_type, zone, index);
        let mut m = Machine::speculative(id, server_type);
        m.zone = zone.into();
        m
    }

    /// Machine slot `index` of cx23 in nbg1, its server created (30 s at most): the machine,
    /// bound to it, and the server's id.
    pub async fn created(&self, index: i64) -> (Machine, i64) {
        let machine = self.machine("cx23", "nbg1", index);
        let host = self.create_host(&machine, 30).await;
        (bound(machine, &host.id), host.id.parse().unwrap())
    }

    /// Starts the SSH server on the reserved port with the host key injected into `server`.
    pub fn start_sshd_of(&mut self, server: i64, drop_first: usize) -> Sshd {
        let key = self.injected_host_key(server);
        self.start_sshd(key, drop_first)
    }

    /// Starts the SSH server on the reserved port with `host_key`.
    pub fn start_sshd(&mut self, host_key: PrivateKey, drop_first: usize) -> Sshd {
        let authorized = self.client_key.public_key().clone();
        self.start_sshd_authorizing(host_key, authorized, drop_first)
    }

    /// Starts the SSH server, accepting only `authorized` as the client key.
    pub fn start_sshd_authorizing(
        &mut self,
        host_key: PrivateKey,
        authorized: russh::keys::PublicKey,
        drop_first: usize,
    ) -> Sshd {
        let listener = self.ssh_listener.take().expect("one SSH server per test");
        Sshd::start(
            listener,
            SshdSetup {
                authorized,
                drop_first,
                ..self.sshd_setup(host_key)
            },
        )
        .unwrap()
    }

    /// What an SSH server presenting `host_key` runs with: the client's key authorized for
    /// root, commands run in the env's directory (where the recording hook lives).
    pub fn sshd_setup(&self, host_key: PrivateKey) -> SshdSetup {
        SshdSetup {
            host_key: HostKeySource::Given(Box::new(host_key)),
            authorized: self.client_key.public_key().clone(),
            user: "root".into(),
            root: Root::Given {
                workdir: self.dir.path().to_owned(),
                path_prefix: self.dir.path().join("bin"),
            },
            drop_first: 0,
            emulator: None,
        }
    }

    /// Starts the SSH server on a port of its own behind a relay on the reserved port, whose
    /// connections a test can cut.
    pub async fn start_sshd_behind_relay(&mut self, host_key: PrivateKey) -> (Sshd, Relay) {
        let listener = self.ssh_listener.take().expect("one SSH server per test");
        let inner = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let sshd = Sshd::start(inner, self.sshd_setup(host_key)).unwrap();
        let relay = Relay::on(listener, sshd.addr());
        (sshd, relay)
    }

    /// Starts the emulator's own sshd on the reserved port: each server presents its injected
    /// host key and runs commands in `<dir>/servers/<id>`.
    pub fn start_emulator_sshd(&mut self) -> Sshd {
        let listener = self.ssh_listener.take().expect("one SSH server per test");
        Sshd::for_emulator(
            listener,
            self.emulator.clone(),
            self.dir.path().join("servers"),
            self.client_key.public_key().clone(),
            "root",
        )
        .unwrap()
    }

    /// The reserved SSH port (before an SSH server took it).
    pub fn ssh_port(&self) -> u16 {
        self.ssh_listener
            .as_ref()
            .expect("the reserved SSH port")
            .local_addr()
            .unwrap()
            .port()
    }

    /// Moves the reserved SSH port to the IPv6 loopback `[::1]` (same port number).
    pub async fn listen_on_ipv6(&mut self) {
        let port = self
            .ssh_listener
            .as_ref()
            .expect("the reserved SSH port")
            .local_addr()
            .unwrap()
            .port();
        self.ssh_listener = Some(TcpListener::bind(("::1", port)).await.unwrap());
    }

    /// Closes the reserved SSH port: connections are refused from now on.
    pub fn refuse_ssh(&mut self) {
        self.ssh_listener.take();
    }

    /// The host key the provider injected into `server`'s user-data, as cloud-init would
    /// install it.
    pub fn injected_host_key(&self, server: i64) -> PrivateKey {
        self.emulator
            .injected_host_key(server)
            .expect("host key in the server's user-data")
    }

    pub fn hook_args(&self) -> Option<String> {
        std::fs::read_to_string(self.dir.path().join("hook.args")).ok()
    }

    pub fn blob_copy(&self) -> Option<Vec<u8>> {
        std::fs::read(self.dir.path().join("hook.blob.copy")).ok()
    }

    /// The blob file's mode as the hook saw it (`600`).
    pub fn blob_mode(&self) -> Option<String> {
        std::fs::read_to_string(self.dir.path().join("hook.blob.mode"))
            .ok()
            .map(|m| m.trim().to_owned())
    }

    /// How many times the hook has started.
    pub fn hook_runs(&self) -> usize {
        std::fs::read_to_string(self.dir.path().join("hook.count"))
            .map(|text| text.lines().count())
            .unwrap_or(0)
    }

    /// Whether the hook has run to its end.
    pub fn hook_done(&self) -> bool {
        self.dir.path().join("hook.done").exists()
    }

    pub fn blob_file(&self) -> PathBuf {
        PathBuf::from(format!("{}.blob", self.hook.display()))
    }

    pub fn kubectl_calls(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("kubectl.calls")).unwrap_or_default()
    }

    pub fn labels(&self, server: i64) -> std::collections::HashMap<String, String> {
        self.emulator.server(server).expect("server exists").labels
    }

    /// The client's SSH key as `<dir>/id_ed25519` (mode 600) and `<dir>/offerings.json` with
    /// `offerings`, the two files a provider process is started with.
    pub fn process_files(&self, offerings: &str) -> (PathBuf, PathBuf) {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = self.dir.path();
        let ssh_key = dir.join("id_ed25519");
        let pem = self.client_key.to_openssh(LineEnding::LF).unwrap();
        std::fs::write(&ssh_key, pem.as_bytes()).unwrap();
        std::fs::set_permissions(&ssh_key, std::fs::Permissions::from_mode(0o600)).unwrap();
        let offerings_file = dir.join("offerings.json");
        std::fs::write(&offerings_file, offerings).unwrap();
        (ssh_key, offerings_file)
    }

    /// Asserts the token appears nowhere in the captured log.
    pub fn assert_token_not_logged(&self) {
        let text = self.logs.text();
        assert!(!text.is_empty(), "the log capture works");
        assert!(!text.contains(TOKEN), "the token leaked into the log");
    }
}

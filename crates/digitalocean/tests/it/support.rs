//! Shared test scaffolding: test PKI, the emulator + channel + cloud environment, the agent
//! process, and log capture.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use digitalocean::api::{ApiClient, ApiToken, ImageRef};
use digitalocean::channel::{
    AuthLimit, Channel, ChannelLimits, ChannelSettings, Command, DeliveryError,
};
use digitalocean::cloud::{AgentProvisioning, CloudSettings, DigitalOceanCloud};
use digitalocean::enrollment::EnrollmentSource;
use digitalocean::setup::channel_tls;
use digitalocean::token::BootstrapSecret;
use do_emulator::Emulator;
use provider_core::backend::{BackendError, TransitionContext};
use provider_core::cloud::{Cloud as _, OwnedHost};
use provider_core::machine::Machine;
use provider_core::retry::Backoff;
use provider_core::telemetry::Telemetry;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, ExtendedKeyUsagePurpose, IsCa, KeyPair,
};
use testkit::digitalocean::RunningEmulator;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub const API_TOKEN: &str = "dop_v1_test_api_token_0123456789";
pub const SECRET: &str = "bootstrap-secret-for-tests-7f3a";
pub const REGION: &str = "nyc3";
pub const PROVIDER: &str = "do-test";
/// The `digitalocean` binary cargo built for these tests.
pub const BINARY: &str = env!("CARGO_BIN_EXE_digitalocean");

/// A CA and a server certificate for 127.0.0.1 / localhost signed by it.
pub struct Pki {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

/// The parameters of a CA certificate named `name`.
pub fn ca_params(name: &str) -> CertificateParams {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    params
}

/// A two-level CA: the self-signed `{kind} root` and the `{kind} intermediate` it signed.
pub fn ca_chain(
    kind: &str,
) -> (
    CertifiedIssuer<'static, KeyPair>,
    CertifiedIssuer<'static, KeyPair>,
) {
    let root = CertifiedIssuer::self_signed(
        ca_params(&format!("{kind} root")),
        KeyPair::generate().unwrap(),
    )
    .unwrap();
    let intermediate = CertifiedIssuer::signed_by(
        ca_params(&format!("{kind} intermediate")),
        KeyPair::generate().unwrap(),
        &root,
    )
    .unwrap();
    (root, intermediate)
}

pub fn pki() -> Pki {
    let ca =
        CertifiedIssuer::self_signed(ca_params("bigfleet test CA"), KeyPair::generate().unwrap())
            .unwrap();
    let mut leaf =
        CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()]).unwrap();
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let leaf_key = KeyPair::generate().unwrap();
    let cert = leaf.signed_by(&leaf_key, &ca).unwrap();
    Pki {
        ca_pem: ca.pem(),
        cert_pem: cert.pem(),
        key_pem: leaf_key.serialize_pem(),
    }
}

/// Writes `body` to the file `name` in `dir`; returns its path as a flag takes it.
pub fn write_file(dir: &Path, name: &str, body: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, body).unwrap();
    path.display().to_string()
}

pub fn telemetry() -> Telemetry {
    Telemetry::new("bigfleet_digitalocean")
}

pub fn fast_backoff() -> Backoff {
    Backoff {
        base: Duration::from_millis(20),
        max: Duration::from_millis(200),
        max_attempts: 8,
    }
}

/// A transition context with an operation id of its own, as every new transition gets.
pub fn ctx(timeout: Duration) -> TransitionContext {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    TransitionContext::with_timeout(format!("op-test-{n}"), timeout)
}

/// A transition context for the operation `operation_id`: the same id again is the same
/// transition, resumed.
pub fn ctx_of(operation_id: &str, timeout: Duration) -> TransitionContext {
    TransitionContext::with_timeout(operation_id, timeout)
}

pub fn machine(index: u32) -> Machine {
    let mut m = Machine::speculative(
        format!("{PROVIDER}/OnDemand/s-2vcpu-4gb/{REGION}/{index:03}"),
        "s-2vcpu-4gb",
    );
    m.zone = REGION.into();
    m
}

/// Creates `m`'s Droplet through `cloud` (20 s at most) and records it as `m`'s host.
pub async fn create_bound(
    cloud: &DigitalOceanCloud,
    m: &mut Machine,
) -> provider_core::cloud::OwnedHost {
    use provider_core::cloud::Cloud as _;
    let host = cloud
        .create_host(m, &ctx(Duration::from_secs(20)))
        .await
        .unwrap();
    m.host = Some(provider_core::machine::HostRef {
        provider: PROVIDER.into(),
        id: host.id.clone(),
    });
    host
}

/// A running bootstrap channel on 127.0.0.1.
pub struct RunningChannel {
    pub channel: Channel,
    pub addr: SocketAddr,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl RunningChannel {
    /// A fresh test PKI, and a channel on it holding commands for `hold` under the default
    /// authentication limits.
    pub async fn with_fresh_pki(hold: Duration) -> (Pki, RunningChannel) {
        let pki = pki();
        let channel = RunningChannel::start(&pki, hold, AuthLimit::default()).await;
        (pki, channel)
    }

    pub async fn start(pki: &Pki, hold: Duration, limit: AuthLimit) -> RunningChannel {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        RunningChannel::start_on(listener, pki, hold, limit)
    }

    pub fn start_on(
        listener: TcpListener,
        pki: &Pki,
        hold: Duration,
        limit: AuthLimit,
    ) -> RunningChannel {
        RunningChannel::start_with_secret(listener, pki, hold, limit, SECRET)
    }

    /// Like [`RunningChannel::start_on`], with `secret` as `--bootstrap-secret`.
    pub fn start_with_secret(
        listener: TcpListener,
        pki: &Pki,
        hold: Duration,
        limit: AuthLimit,
        secret: &str,
    ) -> RunningChannel {
        RunningChannel::serve(listener, pki, hold, limit, secret, ChannelLimits::default())
    }

    /// Like [`RunningChannel::start`], with the given listener limits.
    pub async fn start_with_limits(
        pki: &Pki,
        hold: Duration,
        limit: AuthLimit,
        limits: ChannelLimits,
    ) -> RunningChannel {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        RunningChannel::serve(listener, pki, hold, limit, SECRET, limits)
    }

    fn serve(
        listener: TcpListener,
        pki: &Pki,
        hold: Duration,
        limit: AuthLimit,
        secret: &str,
        limits: ChannelLimits,
    ) -> RunningChannel {
        let addr = listener.local_addr().unwrap();
        let tls = channel_tls(pki.cert_pem.as_bytes(), pki.key_pem.as_bytes()).unwrap();
        let channel = Channel::with_limits(
            ChannelSettings {
                secret: BootstrapSecret::new(secret).unwrap(),
                tls,
                poll_hold: hold,
                auth_limit: limit,
            },
            limits,
            telemetry(),
        );
        // Loopback agents are not at the emulated Droplets' addresses.
        channel.set_enrollment_source(EnrollmentSource::Any);
        let stop = CancellationToken::new();
        let serving = channel.clone();
        let signal = stop.clone();
        let task =
            tokio::spawn(async move { serving.serve(listener, signal.cancelled_owned()).await });
        RunningChannel {
            channel,
            addr,
            stop,
            task,
        }
    }

    pub fn endpoint(&self) -> String {
        format!("https://127.0.0.1:{}", self.addr.port())
    }

    /// Delivers `command` to `machine_id` in a task of its own, as a transition does while the
    /// test plays the agent.
    pub fn deliver_later(
        &self,
        machine_id: &str,
        command: Command,
        ctx: TransitionContext,
    ) -> tokio::task::JoinHandle<Result<(), DeliveryError>> {
        let channel = self.channel.clone();
        let machine_id = machine_id.to_owned();
        tokio::spawn(async move { channel.deliver(&machine_id, command, &ctx).await })
    }

    /// Stops serving and waits until the listener is closed.
    pub async fn stop(self) {
        self.stop.cancel();
        self.task.await.unwrap().unwrap();
    }
}

/// Emulator + channel + cloud.
pub struct Env {
    pub emulator: Emulator,
    pub api_url: String,
    pub pki: Pki,
    pub channel: RunningChannel,
    pub cloud: Arc<DigitalOceanCloud>,
    pub dir: tempfile::TempDir,
    _serving: RunningEmulator,
}

pub struct EnvOptions {
    pub hold: Duration,
    pub limit: AuthLimit,
    pub base_user_data: Option<String>,
}

impl Default for EnvOptions {
    fn default() -> EnvOptions {
        EnvOptions {
            hold: Duration::from_secs(2),
            limit: AuthLimit::default(),
            base_user_data: None,
        }
    }
}

impl Env {
    pub async fn start() -> Env {
        Env::start_with(EnvOptions::default()).await
    }

    /// Creates `machine`'s Droplet within `seconds`, which must succeed.
    pub async fn create_host(&self, machine: &Machine, seconds: u64) -> OwnedHost {
        let within = ctx(Duration::from_secs(seconds));
        self.cloud.create_host(machine, &within).await.unwrap()
    }

    /// The error of creating `machine`'s Droplet within `seconds`, which must fail.
    pub async fn create_fails(&self, machine: &Machine, seconds: u64) -> BackendError {
        let within = ctx(Duration::from_secs(seconds));
        self.cloud.create_host(machine, &within).await.unwrap_err()
    }

    pub async fn start_with(options: EnvOptions) -> Env {
        let serving = RunningEmulator::start(API_TOKEN).await;
        let (emulator, api_url) = (serving.emulator.clone(), serving.url.clone());
        let pki = pki();
        let channel = RunningChannel::start(&pki, options.hold, options.limit).await;
        let cloud = Arc::new(cloud_for(
            &api_url,
            &channel,
            &pki,
            options.base_user_data,
            PROVIDER,
        ));
        Env {
            emulator,
            api_url,
            pki,
            channel,
            cloud,
            dir: tempfile::tempdir().unwrap(),
            _serving: serving,
        }
    }
}

pub fn api_client(api_url: &str) -> ApiClient {
    let base = digitalocean::api::parse_base_url(api_url).unwrap();
    ApiClient::new(
        base,
        ApiToken::new(API_TOKEN).unwrap(),
        fast_backoff(),
        telemetry(),
    )
    .unwrap()
}

pub fn cloud_for(
    api_url: &str,
    channel: &RunningChannel,
    pki: &Pki,
    base_user_data: Option<String>,
    provider: &str,
) -> DigitalOceanCloud {
    DigitalOceanCloud::new(
        api_client(api_url),
        channel.channel.clone(),
        cloud_settings(channel, pki, base_user_data, provider),
        telemetry(),
    )
}

/// The settings [`cloud_for`] uses: the test region and image, fast polls and backoff.
pub fn cloud_settings(
    channel: &RunningChannel,
    pki: &Pki,
    base_user_data: Option<String>,
    provider: &str,
) -> CloudSettings {
    let mut settings = CloudSettings::new(
        provider.into(),
        REGION.into(),
        ImageRef::parse("ubuntu-24-04-x64"),
        base_user_data,
        AgentProvisioning {
            endpoint: channel.endpoint(),
            ca_pem: pki.ca_pem.clone(),
            pinned_cert_pem: String::new(),
            pinned_spki_sha256: String::new(),
        },
    );
    settings.active_poll = Duration::from_millis(20);
    settings.create_backoff = fast_backoff();
    settings
}

/// The agent's config.json as the Droplet's cloud-init would write it from its user_data.
pub fn agent_config_from_user_data(user_data: &str) -> String {
    let start = user_data
        .find("    content: |\n")
        .expect("agent cloud-config in user_data")
        + "    content: |\n".len();
    let mut json = String::new();
    for line in user_data[start..].lines() {
        let Some(stripped) = line.strip_prefix("      ") else {
            break;
        };
        json.push_str(stripped);
        json.push('\n');
    }
    json
}

pub use testkit::script::write_executable;

/// A hook that records its arguments, the blob, the blob's mode and how often it ran, then
/// exits with `exit_code`.
pub fn recording_hook(dir: &Path, exit_code: i32) -> PathBuf {
    let hook = dir.join("bootstrap");
    let body = format!(
        "#!/bin/sh\n\
         echo \"$@\" > '{d}/hook.args'\n\
         cp \"$0.blob\" '{d}/hook.blob.copy'\n\
         stat -c %a \"$0.blob\" > '{d}/hook.blob.mode'\n\
         echo run >> '{d}/hook.runs'\n\
         exit {exit_code}\n",
        d = dir.display()
    );
    write_executable(&hook, &body);
    hook
}

/// A shell script that counts its runs in `<name>.runs`, waits until `<name>.go` exists, then
/// exits with `exit_code`.
pub fn gated(dir: &Path, name: &str, exit_code: i32) -> String {
    format!(
        "echo run >> '{d}/{name}.runs'\n\
         while [ ! -e '{d}/{name}.go' ]; do sleep 0.05; done\n\
         exit {exit_code}\n",
        d = dir.display()
    )
}

pub fn runs(dir: &Path, name: &str) -> usize {
    std::fs::read_to_string(dir.join(format!("{name}.runs")))
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

pub fn release(dir: &Path, name: &str) {
    std::fs::write(dir.join(format!("{name}.go")), b"").unwrap();
}

/// A running `bigfleet-agent` process with its stderr captured.
pub struct AgentProcess {
    child: tokio::process::Child,
    pub output: Arc<Mutex<Vec<u8>>>,
}

pub struct AgentSetup<'a> {
    pub dir: &'a Path,
    pub config_json: String,
    pub hook: PathBuf,
    pub drain_command: String,
    pub readiness_command: Option<String>,
}

impl<'a> AgentSetup<'a> {
    /// An agent in `dir` with `config_json`, a hook that records its runs and succeeds, `true`
    /// as its drain command and no readiness command.
    pub fn recording(dir: &'a Path, config_json: String) -> AgentSetup<'a> {
        AgentSetup {
            dir,
            config_json,
            hook: recording_hook(dir, 0),
            drain_command: "true".into(),
            readiness_command: None,
        }
    }
}

/// The agent config for `machine_id` polling the channel at `endpoint`, trusting `ca_pem`, with
/// the one-time token its user_data would carry.
pub fn agent_config(endpoint: &str, ca_pem: &str, machine_id: &str) -> String {
    serde_json::json!({
        "endpoint": endpoint, "ca_pem": ca_pem, "machine_id": machine_id,
        "token": token(machine_id),
    })
    .to_string()
}

impl AgentProcess {
    pub fn spawn(setup: AgentSetup<'_>) -> AgentProcess {
        AgentProcess::spawn_with_args(setup, &[])
    }

    /// Like [`AgentProcess::spawn`], with further command-line arguments for the agent.
    pub fn spawn_with_args(setup: AgentSetup<'_>, extra: &[&str]) -> AgentProcess {
        let config = setup.dir.join("config.json");
        std::fs::write(&config, &setup.config_json).unwrap();
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_bigfleet-agent"));
        cmd.arg("--config")
            .arg(&config)
            .arg("--hook")
            .arg(&setup.hook)
            .arg("--drain-command")
            .arg(&setup.drain_command)
            .arg("--state")
            .arg(setup.dir.join("state/executed.json"))
            .arg("--max-backoff")
            .arg("200ms")
            .args(extra)
            .env("RUST_LOG", "debug")
            // Whatever the caller's environment, colour must be off because stderr is a pipe.
            .env_remove("NO_COLOR")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        if let Some(ready) = setup.readiness_command {
            cmd.arg("--readiness-command").arg(ready);
        }
        let mut child = cmd.spawn().unwrap();
        let (output, _readers) = testkit::logs::collect_output(&mut child);
        AgentProcess { child, output }
    }

    pub fn output(&self) -> String {
        String::from_utf8_lossy(&self.output.lock().unwrap()).into_owned()
    }

    /// Kills the agent at once (SIGKILL), as a crash would.
    pub async fn kill(&mut self) {
        self.child.kill().await.unwrap();
    }

    /// Waits until the agent's output contains `needle` (bounded).
    pub async fn wait_for_output(&self, needle: &str, within: Duration) -> bool {
        let until = tokio::time::Instant::now() + within;
        while tokio::time::Instant::now() < until {
            if self.output().contains(needle) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    /// Asserts that the agent's output comes to contain `needle` within `within`, showing the
    /// output when it does not.
    pub async fn expect_output(&self, needle: &str, within: Duration) {
        assert!(
            self.wait_for_output(needle, within).await,
            "no {needle:?} within {within:?}:\n{}",
            self.output()
        );
    }
}

/// Waits until `f` holds (bounded); for state that other processes change.
pub use testkit::wait::eventually;

/// Captures the provider's logs of the current thread.
pub use testkit::logs::LogCapture;

/// An HTTPS client that trusts `ca_pem` only, TLS 1.3.
pub fn channel_client(ca_pem: &str) -> reqwest::Client {
    reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(ca_pem.as_bytes()).unwrap())
        .min_tls_version(reqwest::tls::Version::TLS_1_3)
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

/// Enrolls `machine_id` at the channel `endpoint` with its user_data `token` and a fresh
/// credential, as the agent does first; returns the credential.
pub async fn enroll(
    client: &reqwest::Client,
    endpoint: &str,
    machine_id: &str,
    token: &str,
) -> String {
    let credential = digitalocean::token::new_credential().expose().to_owned();
    let r = enroll_with(client, endpoint, machine_id, token, &credential).await;
    assert_eq!(r.status(), 200, "enrollment of {machine_id}");
    credential
}

/// One enrollment request; the caller reads the answer.
pub async fn enroll_with(
    client: &reqwest::Client,
    endpoint: &str,
    machine_id: &str,
    token: &str,
    credential: &str,
) -> reqwest::Response {
    client
        .post(format!("{endpoint}/v1/enroll"))
        .query(&[("machine_id", machine_id)])
        .bearer_auth(token)
        .json(&serde_json::json!({ "credential": credential }))
        .send()
        .await
        .unwrap()
}

pub fn token(machine_id: &str) -> String {
    BootstrapSecret::new(SECRET)
        .unwrap()
        .token_for(machine_id)
        .expose()
        .to_owned()
}

/// A loopback TCP forwarder standing in for a Kubernetes Service in front of replicas: each new
/// connection goes to the current target and stays on it (as kube-proxy keeps an established
/// connection on its pod) until either side closes it.
pub use testkit::relay::Relay as Forwarder;

/// An HTTP/1.1 200 answer carrying the JSON `body`, closing the connection.
pub fn json_response(body: &[u8]) -> Vec<u8> {
    [
        format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        )
        .into_bytes(),
        body.to_vec(),
    ]
    .concat()
}

/// A stand-in for the channel: TLS with `config`, answering every HTTP/1.1 request with
/// `response`. Counts failed handshakes and requests served.
pub struct FakeServer {
    pub addr: std::net::SocketAddr,
    pub failed_handshakes: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    pub requests: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

pub async fn fake_server(config: rustls::ServerConfig, response: Vec<u8>) -> FakeServer {
    use std::sync::atomic::Ordering;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let failed_handshakes = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let requests = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));
    let response = std::sync::Arc::new(response);
    let (failed, served) = (failed_handshakes.clone(), requests.clone());
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let (acceptor, response, failed, served) = (
                acceptor.clone(),
                response.clone(),
                failed.clone(),
                served.clone(),
            );
            tokio::spawn(async move {
                use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    failed.fetch_add(1, Ordering::SeqCst);
                    return;
                };
                let mut seen = Vec::new();
                let mut buf = [0u8; 4096];
                while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                    match tls.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => seen.extend_from_slice(&buf[..n]),
                    }
                }
                served.fetch_add(1, Ordering::SeqCst);
                let _ = tls.write_all(&response).await;
                let _ = tls.shutdown().await;
            });
        }
    });
    FakeServer {
        addr,
        failed_handshakes,
        requests,
    }
}

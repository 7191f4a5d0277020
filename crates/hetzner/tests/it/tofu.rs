//! Trust on first use, end to end: a pin that cannot be recorded stops delivery, and a key
//! presented at the same address after a first-use pin is refused. The API goes through a
//! proxy that can fail label writes; SSH goes through a relay whose target can be switched
//! from one SSH server (one host key) to another.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use hcloud_emulator::Sshd;
use hetzner::cloud::{HetznerCloud, HetznerConfig};
use hetzner::hostkey;
use hetzner::labels;
use hetzner::ssh::SshConfig;
use provider_core::backend::{BootstrapBlob, ConfigureOrder};
use provider_core::cloud::Cloud;
use provider_core::config::Secret;
use provider_core::machine::Machine;
use russh::keys::PrivateKey;
use russh::keys::ssh_key::LineEnding;
use tokio::net::TcpListener;

use crate::harness::{
    Env, Options, PROVIDER, TOKEN, bound, configure_server, ctx, fast_timing, new_key,
};

const BLOB: &[u8] = b"tofu-join-secret-material";

fn order(cluster: &str) -> ConfigureOrder {
    ConfigureOrder {
        cluster_id: cluster.into(),
        blob: BootstrapBlob(BLOB.to_vec()),
    }
}

/// A reverse proxy in front of the emulator that refuses the next `fail` label writes
/// (`PUT /servers/{id}` carrying `labels`) with a 503 and forwards everything else.
#[derive(Clone)]
struct LabelWriteFaults {
    upstream: SocketAddr,
    client: reqwest::Client,
    fail: Arc<AtomicUsize>,
    refused: Arc<AtomicUsize>,
}

async fn forward(
    State(proxy): State<LabelWriteFaults>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let label_write = method == Method::PUT
        && uri.path().starts_with("/v1/servers/")
        && String::from_utf8_lossy(&body).contains("\"labels\"");
    if label_write
        && proxy
            .fail
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    {
        proxy.refused.fetch_add(1, Ordering::SeqCst);
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::CONTENT_TYPE, "application/json")],
            r#"{"error":{"code":"unavailable","message":"injected label-write failure"}}"#,
        )
            .into_response();
    }
    let path = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let mut request = proxy
        .client
        .request(method, format!("http://{}{path}", proxy.upstream))
        .body(body);
    for (name, value) in &headers {
        if name != header::HOST {
            request = request.header(name, value);
        }
    }
    let answer = request.send().await.unwrap();
    let status = answer.status();
    let kind = answer.headers().get(header::CONTENT_TYPE).cloned();
    let bytes = answer.bytes().await.unwrap();
    let mut response = (status, bytes).into_response();
    if let Some(kind) = kind {
        response.headers_mut().insert(header::CONTENT_TYPE, kind);
    }
    response
}

impl LabelWriteFaults {
    async fn start(upstream: SocketAddr, fail: usize) -> (LabelWriteFaults, String) {
        let proxy = LabelWriteFaults {
            upstream,
            client: reqwest::Client::new(),
            fail: Arc::new(AtomicUsize::new(fail)),
            refused: Arc::new(AtomicUsize::new(0)),
        };
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}/v1", listener.local_addr().unwrap());
        let app = axum::Router::new()
            .fallback(forward)
            .with_state(proxy.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
        (proxy, endpoint)
    }
}

/// A TCP relay at one fixed address whose target can be switched: "the server at this
/// address" can be made to present another host key.
struct Relay {
    port: u16,
    target: Arc<Mutex<SocketAddr>>,
}

impl Relay {
    async fn start(target: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let target = Arc::new(Mutex::new(target));
        let current = target.clone();
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let to = *current.lock().unwrap();
                tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(to).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
        Relay { port, target }
    }

    fn switch_to(&self, target: SocketAddr) {
        *self.target.lock().unwrap() = target;
    }
}

/// An SSH server of its own port presenting `host_key`, running commands in the env's
/// directory (where the recording hook lives).
async fn sshd(env: &Env, host_key: PrivateKey) -> Sshd {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    Sshd::start(listener, env.sshd_setup(host_key)).unwrap()
}

/// A backend like the env's, but talking to `endpoint` and SSH port `ssh_port`.
fn cloud(env: &Env, endpoint: String, ssh_port: u16) -> HetznerCloud {
    HetznerCloud::new(HetznerConfig {
        token: Secret::new(TOKEN),
        endpoint,
        provider_instance: PROVIDER.into(),
        server: hetzner::settings::ServerSpec {
            image: "ubuntu-24.04".into(),
            ..Default::default()
        },
        offerings: Vec::new(),
        locations: vec!["nbg1".into(), "fsn1".into()],
        ssh: Some(SshConfig {
            user: "root".into(),
            key: env
                .client_key
                .to_openssh(LineEnding::LF)
                .unwrap()
                .to_string(),
            port: ssh_port,
        }),
        bootstrap_hook: env.hook.to_str().unwrap().to_owned(),
        base_user_data: None,
        readiness_command: None,
        eur_usd: 1.25,
        telemetry: env.telemetry,
        timing: fast_timing(std::time::Duration::from_secs(5)),
    })
    .unwrap()
}

/// A server of machine slot 0 made by `cloud` whose pin label was then removed (as if it had
/// been made before pinning existed).
async fn unpinned_server(env: &Env, cloud: &HetznerCloud) -> (Machine, i64) {
    let machine = env.machine("cx23", "nbg1", 0);
    let host = cloud.create_host(&machine, &ctx(30)).await.unwrap();
    let machine = bound(machine, &host.id);
    let server: i64 = host.id.parse().unwrap();
    let mut l: HashMap<String, String> = env.labels(server);
    l.remove(labels::HOST_KEY_FP);
    env.emulator.set_labels(server, l);
    (machine, server)
}

/// An unpinned server behind an SSH server of a fresh key (its fingerprint given), with a
/// backend talking to the API through label-write faults (none armed yet).
async fn pin_writes(env: &Env) -> (LabelWriteFaults, String, Sshd, HetznerCloud, (Machine, i64)) {
    let (proxy, endpoint) = LabelWriteFaults::start(env.emulator.addr(), 0).await;
    let host_key = new_key();
    let observed = hostkey::fingerprint(host_key.public_key());
    let sshd = sshd(env, host_key).await;
    let cloud = cloud(env, endpoint, sshd.addr().port());
    let server = unpinned_server(env, &cloud).await;
    (proxy, observed, sshd, cloud, server)
}

#[tokio::test]
async fn a_first_use_pin_that_cannot_be_recorded_stops_delivery_at_the_deadline() {
    let env = Env::new(Options::default()).await;
    let (proxy, observed, sshd, cloud, (machine, server)) = pin_writes(&env).await;
    proxy.fail.store(usize::MAX, Ordering::SeqCst);

    let err = configure_server(&cloud, &machine, server, &order("c1"), 2)
        .await
        .unwrap_err();
    assert!(
        err.0.starts_with(&format!(
            "ssh 127.0.0.1: server {server} presented host key {observed} on first use, but it \
             could not be recorded in label bigfleet-host-key-fp before the deadline ("
        )),
        "{}",
        err.0
    );
    assert!(
        err.0
            .ends_with("); nothing was sent over an unrecorded pin"),
        "{}",
        err.0
    );
    assert!(
        proxy.refused.load(Ordering::SeqCst) >= 2,
        "the write was retried"
    );
    let retries = env.logs.count("failed to persist TOFU host-key pin");
    assert!(retries >= 2, "retried until the deadline ({retries})");
    assert!(sshd.observed.commands().is_empty(), "no command ran");
    assert_eq!(sshd.observed.stdin_bytes.load(Ordering::SeqCst), 0);
    assert!(!env.blob_file().exists(), "the blob never reached the host");
    assert!(env.hook_args().is_none());
    let stored = env.labels(server);
    assert!(!stored.contains_key(labels::HOST_KEY_FP));
    assert!(!stored.contains_key(labels::CLUSTER));
}

#[tokio::test]
async fn a_pin_recorded_after_failed_writes_is_verified_on_a_fresh_connection() {
    let env = Env::new(Options::default()).await;
    let (proxy, observed, sshd, cloud, (machine, server)) = pin_writes(&env).await;
    // More than one label update's worth of API retries (8 attempts each in the tests).
    proxy.fail.store(10, Ordering::SeqCst);

    configure_server(&cloud, &machine, server, &order("c2"), 10)
        .await
        .unwrap();
    assert_eq!(proxy.refused.load(Ordering::SeqCst), 10);
    assert_eq!(env.labels(server)[labels::HOST_KEY_FP], observed);
    assert_eq!(
        sshd.observed.connections.load(Ordering::SeqCst),
        2,
        "the first-use connection is dropped; delivery goes over a connection checked against the recorded pin"
    );
    assert_eq!(
        crate::harness::deliveries(&sshd.observed.commands()),
        1,
        "delivered once"
    );
    assert_eq!(env.blob_copy().as_deref(), Some(BLOB));
    assert_eq!(env.labels(server)[labels::CLUSTER], "c2");
}

#[tokio::test]
async fn another_key_at_the_same_address_after_a_first_use_pin_is_refused() {
    let env = Env::new(Options::default()).await;
    let first = new_key();
    let pinned = hostkey::fingerprint(first.public_key());
    let genuine = sshd(&env, first).await;
    let impostor_key = new_key();
    let presented = hostkey::fingerprint(impostor_key.public_key());
    let impostor = sshd(&env, impostor_key).await;
    let relay = Relay::start(genuine.addr()).await;
    let cloud = cloud(&env, env.emulator.endpoint(), relay.port);
    let (machine, server) = unpinned_server(&env, &cloud).await;

    configure_server(&cloud, &machine, server, &order("c3"), 10)
        .await
        .unwrap();
    assert_eq!(
        env.labels(server)[labels::HOST_KEY_FP],
        pinned,
        "pinned on first use"
    );
    assert_eq!(env.blob_copy().as_deref(), Some(BLOB));
    assert!(
        !env.blob_file().exists(),
        "the blob is gone once the hook has exited"
    );
    std::fs::remove_file(env.dir.path().join("hook.args")).unwrap();

    // Same address, another server key.
    relay.switch_to(impostor.addr());
    let err = configure_server(&cloud, &machine, server, &order("c3"), 10)
        .await
        .unwrap_err();
    assert_eq!(
        err.0,
        crate::harness::host_key_mismatch(&pinned, &presented)
    );
    assert_eq!(impostor.observed.connections.load(Ordering::SeqCst), 1);
    assert_eq!(impostor.observed.authenticated.load(Ordering::SeqCst), 0);
    assert!(impostor.observed.commands().is_empty());
    assert_eq!(impostor.observed.stdin_bytes.load(Ordering::SeqCst), 0);
    assert!(!env.blob_file().exists(), "the blob was not sent again");
    assert!(env.hook_args().is_none());
    assert_eq!(
        env.labels(server)[labels::HOST_KEY_FP],
        pinned,
        "the pin is untouched"
    );
}

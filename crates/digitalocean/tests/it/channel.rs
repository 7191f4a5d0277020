//! The bootstrap channel over real HTTPS: authentication, isolation between machines, status
//! codes and bodies, the long poll, stale acks, throttling, TLS 1.3 only, CA pinning by the
//! agent, and a channel restart under a polling agent.

use std::time::Duration;

use digitalocean::channel::{AuthLimit, ChannelLimits, Command};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpListener;

use crate::support::*;

fn configure(blob: &[u8]) -> Command {
    Command::Configure {
        cluster_id: "c".into(),
        blob: blob.to_vec(),
    }
}

async fn get_command(
    client: &reqwest::Client,
    endpoint: &str,
    machine_id: Option<&str>,
    bearer: Option<&str>,
) -> reqwest::Response {
    let mut request = client.get(format!("{endpoint}/v1/command"));
    if let Some(id) = machine_id {
        request = request.query(&[("machine_id", id)]);
    }
    if let Some(b) = bearer {
        request = request.header("authorization", b);
    }
    request.send().await.unwrap()
}

/// `machine_id`'s poll with `secret` (its user_data token or its credential) as the bearer.
async fn poll_as(
    client: &reqwest::Client,
    endpoint: &str,
    machine_id: &str,
    secret: &str,
) -> reqwest::Response {
    let bearer = format!("Bearer {secret}");
    get_command(client, endpoint, Some(machine_id), Some(&bearer)).await
}

#[tokio::test]
async fn tokens_follow_the_reference_vectors() {
    let secret = digitalocean::token::BootstrapSecret::new("secret").unwrap();
    assert_eq!(
        secret.token_for("m-1").expose(),
        "RGyPhp3JM2vz25uzLTbRiiptVvpgYCMXhSNCnXL38y8"
    );
    assert_eq!(
        secret
            .token_for("digitalocean/OnDemand/s-2vcpu-4gb/nyc3/000")
            .expose(),
        "afTCmBgInQfipXp_8xl2hGCXP2zhASAQR1A3nGrvyPc"
    );
}

#[tokio::test]
async fn unauthenticated_and_cross_machine_requests_get_401() {
    let pki = pki();
    let ch = RunningChannel::start(
        &pki,
        Duration::from_millis(300),
        AuthLimit {
            burst: 100,
            refill_every: Duration::from_secs(1),
        },
    )
    .await;
    let client = channel_client(&pki.ca_pem);
    let endpoint = ch.endpoint();
    let (a, b) = ("machine/a", "machine/b");
    let pending = ch.deliver_later(b, configure(b"B-secret-blob"), ctx(Duration::from_secs(10)));

    let bearer_a = format!("Bearer {}", token(a));
    for (machine_id, bearer) in [
        (Some(b), Some(bearer_a.as_str())), // A's token for B's command
        (Some(b), None),                    // no header
        (Some(b), Some("Bearer wrong")),    // wrong token
        (Some(b), Some(format!("bearer {}", token(b)).leak() as &str)), // prefix is case-sensitive
        (None, Some(bearer_a.as_str())),    // no machine id
        (Some("machine/unknown"), Some(bearer_a.as_str())), // unknown machine: same answer
    ] {
        let r = get_command(&client, &endpoint, machine_id, bearer).await;
        assert_eq!(r.status(), 401, "{machine_id:?} {bearer:?}");
        assert_eq!(r.headers()["content-type"], "text/plain; charset=utf-8");
        assert_eq!(r.headers()["x-content-type-options"], "nosniff");
        assert_eq!(r.text().await.unwrap(), "unauthorized\n");
    }
    // A's own poll sees nothing of B's command.
    let r = get_command(&client, &endpoint, Some(a), Some(&bearer_a)).await;
    assert_eq!(r.status(), 204);
    // An ack with A's token cannot release B's command.
    let r = client
        .post(format!("{endpoint}/v1/ack"))
        .query(&[("machine_id", b)])
        .bearer_auth(token(a))
        .body(r#"{"command_id":"x","ok":true}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    // B's user_data token alone never sees the blob: the Configure waits for B to enroll.
    let r = poll_as(&client, &endpoint, b, &token(b)).await;
    assert_eq!(r.status(), 204);
    let credential = enroll(&client, &endpoint, b, &token(b)).await;
    // Once enrolled, the spent token is refused, and so is A's token as an enrollment of B.
    let r = poll_as(&client, &endpoint, b, &token(b)).await;
    assert_eq!(r.status(), 401);
    // B gets its command with its credential, percent-encoded machine id and all.
    let r = poll_as(&client, &endpoint, b, &credential).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "application/json");
    let body = r.text().await.unwrap();
    assert!(body.ends_with("}\n"));
    let command: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(command["type"], "configure");
    pending.abort();
}

#[tokio::test]
async fn methods_paths_and_bodies() {
    let (pki, ch) = RunningChannel::with_fresh_pki(Duration::from_millis(200)).await;
    let client = channel_client(&pki.ca_pem);
    let endpoint = ch.endpoint();
    // The method is checked before authentication.
    let r = client
        .post(format!("{endpoint}/v1/command"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);
    assert_eq!(r.text().await.unwrap(), "method not allowed\n");
    let r = client
        .get(format!("{endpoint}/v1/ack"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);
    let r = client
        .get(format!("{endpoint}/v2/command"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(r.text().await.unwrap(), "404 page not found\n");
    let m = "m-1";
    let ack = |body: &'static str| {
        client
            .post(format!("{endpoint}/v1/ack"))
            .query(&[("machine_id", m)])
            .bearer_auth(token(m))
            .body(body)
            .send()
    };
    let r = ack("not json").await.unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(r.text().await.unwrap(), "bad ack body\n");
    // Nothing pending: an ack is accepted and ignored.
    let r = ack(r#"{"command_id":"1","ok":true}"#).await.unwrap();
    assert_eq!(r.status(), 204);
    assert_eq!(r.text().await.unwrap(), "");
}

#[tokio::test]
async fn the_poll_is_held_until_a_command_arrives() {
    let (pki, ch) = RunningChannel::with_fresh_pki(Duration::from_secs(20)).await;
    let client = channel_client(&pki.ca_pem);
    let endpoint = ch.endpoint();
    let m = "digitalocean/OnDemand/s-2vcpu-4gb/nyc3/007";
    let started = tokio::time::Instant::now();
    let poll = tokio::spawn({
        let client = client.clone();
        let endpoint = endpoint.clone();
        async move { poll_as(&client, &endpoint, m, &token(m)).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let delivery = ch.deliver_later(
        m,
        Command::Drain { grace_seconds: 30 },
        ctx(Duration::from_secs(10)),
    );
    let r = poll.await.unwrap();
    let held = started.elapsed();
    // Answered with the command (a server that did not hold would have said 204 at once), and
    // well before the 20 s hold ended: the command woke the held poll. The exact timing is
    // checked with a paused clock in the channel's unit tests.
    assert_eq!(r.status(), 200);
    assert!(held < Duration::from_secs(10), "{held:?}");
    let command: serde_json::Value = r.json().await.unwrap();
    assert_eq!(command["type"], "drain");
    assert_eq!(command["grace_seconds"], 30);
    let id = command["id"].as_str().unwrap().to_owned();

    // Re-served until acked.
    let again: serde_json::Value = poll_as(&client, &endpoint, m, &token(m))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(again["id"], id.as_str());
    let ack = |body: String| {
        client
            .post(format!("{endpoint}/v1/ack"))
            .query(&[("machine_id", m)])
            .bearer_auth(token(m))
            .body(body)
            .send()
    };
    // A stale ack is ignored and does not release the waiter.
    let r = ack(r#"{"command_id":"stale-1","ok":true}"#.into())
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    assert!(!delivery.is_finished());
    let r = ack(format!(r#"{{"command_id":"{id}","ok":true}}"#))
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    delivery.await.unwrap().unwrap();
}

/// Two channel instances (two processes, or two replicas) deliver the same id for one
/// transition and different ids for different transitions; a newer command supersedes.
#[tokio::test]
async fn command_ids_follow_the_transition_across_channel_instances_and_newer_commands_supersede() {
    let (pki, one) = RunningChannel::with_fresh_pki(Duration::from_millis(100)).await;
    let two = RunningChannel::start(&pki, Duration::from_millis(100), AuthLimit::default()).await;
    let client = channel_client(&pki.ca_pem);
    let m = "m-9";
    // The agent enrolled with the first; the second knows it as a new process reads it from
    // the state.
    let credential = enroll(&client, &one.endpoint(), m, &token(m)).await;
    two.channel.adopt_enrollments(&one.channel);
    let mut ids = Vec::new();
    for (ch, operation_id) in [(&one, "op-1"), (&two, "op-1"), (&two, "op-2")] {
        let first = ch.deliver_later(
            m,
            configure(b"1"),
            ctx_of(operation_id, Duration::from_secs(10)),
        );
        let r: serde_json::Value = poll_as(&client, &ch.endpoint(), m, &credential)
            .await
            .json()
            .await
            .unwrap();
        ids.push(r["id"].as_str().unwrap().to_owned());
        let second = ch.deliver_later(m, configure(b"2"), ctx(Duration::from_millis(300)));
        let err = first.await.unwrap().unwrap_err();
        assert_eq!(
            err.0,
            format!("agent did not apply configure for {m}: superseded by a newer command")
        );
        let _ = second.await;
    }
    assert!(ids[0].starts_with("op-1.configure."), "{ids:?}");
    assert_eq!(
        ids[0], ids[1],
        "a restarted provider delivers the same id for the same transition"
    );
    assert_ne!(ids[1], ids[2], "another transition, another id");
}

#[tokio::test]
async fn failed_authentications_are_throttled_per_source_and_machine_never_for_a_valid_token() {
    let pki = pki();
    let ch = RunningChannel::start(
        &pki,
        Duration::from_millis(100),
        AuthLimit {
            burst: 3,
            refill_every: Duration::from_secs(60),
        },
    )
    .await;
    let client = channel_client(&pki.ca_pem);
    let endpoint = ch.endpoint();
    // A misbehaving client behind the same address (127.0.0.1) keeps failing for "m-bad".
    for _ in 0..3 {
        let r = get_command(&client, &endpoint, Some("m-bad"), Some("Bearer guess")).await;
        assert_eq!(r.status(), 401);
    }
    let r = get_command(&client, &endpoint, Some("m-bad"), Some("Bearer guess")).await;
    assert_eq!(r.status(), 429);
    let retry: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    // Another agent behind that address, with its correct token, enrolls and gets its command.
    let pending = ch.deliver_later("m-good", configure(b"good"), ctx(Duration::from_secs(10)));
    let credential = enroll(&client, &endpoint, "m-good", &token("m-good")).await;
    let r = poll_as(&client, &endpoint, "m-good", &credential).await;
    assert_eq!(r.status(), 200);
    let command: serde_json::Value = r.json().await.unwrap();
    assert_eq!(command["blob"], "Z29vZA==");
    // Even the machine under attack is served with its correct token.
    let r = poll_as(&client, &endpoint, "m-bad", &token("m-bad")).await;
    assert_eq!(r.status(), 204);
    // The attacker stays throttled.
    let r = get_command(&client, &endpoint, Some("m-bad"), Some("Bearer guess")).await;
    assert_eq!(r.status(), 429);
    pending.abort();
}

#[tokio::test]
async fn tls_1_2_clients_are_refused() {
    let (pki, ch) = RunningChannel::with_fresh_pki(Duration::from_millis(100)).await;
    let tls12 = reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(pki.ca_pem.as_bytes()).unwrap())
        .max_tls_version(reqwest::tls::Version::TLS_1_2)
        .build()
        .unwrap();
    let err = tls12
        .get(format!("{}/v1/command", ch.endpoint()))
        .send()
        .await
        .unwrap_err();
    assert!(err.is_connect() || err.is_request(), "{err:?}");
    // The same CA over TLS 1.3 works.
    let ok = channel_client(&pki.ca_pem)
        .get(format!("{}/v1/command", ch.endpoint()))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 401);
    // Plain HTTP gets nowhere either.
    let plain = reqwest::Client::new();
    assert!(
        plain
            .get(format!("http://{}/v1/command", ch.addr))
            .send()
            .await
            .is_err()
    );
}

#[tokio::test]
async fn an_agent_refuses_a_channel_whose_certificate_is_not_from_its_pinned_ca() {
    let real = pki();
    let impostor = pki();
    let ch =
        RunningChannel::start(&impostor, Duration::from_millis(200), AuthLimit::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let m = "m-pinned";
    let config_json = agent_config(&ch.endpoint(), &real.ca_pem, m);
    let agent = AgentProcess::spawn(AgentSetup::recording(dir.path(), config_json));
    let err = ch
        .channel
        .deliver(m, configure(b"impostor-blob"), &ctx(Duration::from_secs(2)))
        .await
        .unwrap_err();
    assert_eq!(
        err.0,
        format!("agent did not apply configure for {m}: context deadline exceeded")
    );
    assert!(!dir.path().join("hook.runs").exists(), "the hook never ran");
    agent
        .expect_output("enrollment failed", Duration::from_secs(5))
        .await;
    let out = agent.output();
    assert!(
        out.contains("certificate") || out.contains("UnknownIssuer"),
        "{out}"
    );
    assert!(!out.contains(&token(m)), "{out}");
}

#[tokio::test]
async fn a_polling_agent_survives_a_channel_restart() {
    let pki = pki();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let first = RunningChannel::start_on(
        listener,
        &pki,
        Duration::from_secs(20),
        AuthLimit::default(),
    );
    let dir = tempfile::tempdir().unwrap();
    let m = "m-restart";
    let config_json = agent_config(&first.endpoint(), &pki.ca_pem, m);
    let agent = AgentProcess::spawn(AgentSetup::recording(dir.path(), config_json));
    agent
        .expect_output("bigfleet-agent polling", Duration::from_secs(10))
        .await;
    assert!(
        !agent.output().contains('\u{1b}'),
        "the agent's text logs to a pipe (journald) carry no ANSI escape sequences: {:?}",
        agent.output()
    );
    // Stop the provider's channel while the agent's poll is held, then start a new one on
    // the same address.
    let state = first.channel.clone();
    first.stop().await;
    let listener = TcpListener::bind(addr).await.unwrap();
    let second = RunningChannel::start_on(
        listener,
        &pki,
        Duration::from_secs(20),
        AuthLimit::default(),
    );
    // The new process knows the agent's enrollment from the state.
    second.channel.adopt_enrollments(&state);
    second
        .channel
        .deliver(
            m,
            configure(b"after-restart"),
            &ctx(Duration::from_secs(15)),
        )
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(dir.path().join("hook.blob.copy")).unwrap(),
        b"after-restart"
    );
}

/// The provider's default pin (no `--bootstrap-ca`) for a `--bootstrap-tls-cert` file holding
/// the channel's self-signed certificate followed by a CA bundle: an agent given that pin
/// refuses a channel whose certificate was issued by one of the bundle's CAs, and accepts the
/// real channel.
#[tokio::test]
async fn an_agent_refuses_a_certificate_from_another_ca_of_the_channel_certificate_file() {
    use rcgen::{CertificateParams, KeyPair};
    let (root, intermediate) = ca_chain("public");

    let names = vec!["127.0.0.1".to_owned(), "localhost".to_owned()];
    let own_key = KeyPair::generate().unwrap();
    let own = CertificateParams::new(names.clone())
        .unwrap()
        .self_signed(&own_key)
        .unwrap();
    let impostor_key = KeyPair::generate().unwrap();
    let impostor = CertificateParams::new(names)
        .unwrap()
        .signed_by(&impostor_key, &intermediate)
        .unwrap();

    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, body: &str| write_file(dir.path(), name, body);
    let genuine_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let genuine_addr = genuine_listener.local_addr().unwrap();
    let flags = digitalocean::RealFlags {
        bootstrap_tls_cert: file(
            "tls.crt",
            &format!("{}{}{}", own.pem(), intermediate.pem(), root.pem()),
        ),
        bootstrap_tls_key: file("tls.key", &own_key.serialize_pem()),
        bootstrap_endpoint: format!("https://127.0.0.1:{}", genuine_addr.port()),
        ..Default::default()
    };
    let pin = digitalocean::setup::agent_pin(&flags)
        .unwrap()
        .verified_for(&flags.bootstrap_endpoint)
        .unwrap()
        .pem;
    assert_eq!(pin, own.pem());

    // The impostor serves a certificate of the file's intermediate, with its chain.
    let impostor_pki = Pki {
        ca_pem: root.pem(),
        cert_pem: format!("{}{}", impostor.pem(), intermediate.pem()),
        key_pem: impostor_key.serialize_pem(),
    };
    let fake = RunningChannel::start(
        &impostor_pki,
        Duration::from_millis(200),
        AuthLimit::default(),
    )
    .await;
    let m = "m-chain";
    let agent_dir = tempfile::tempdir().unwrap();
    let agent = AgentProcess::spawn(AgentSetup::recording(
        agent_dir.path(),
        agent_config(&fake.endpoint(), &pin, m),
    ));
    let err = fake
        .channel
        .deliver(m, configure(b"impostor-blob"), &ctx(Duration::from_secs(2)))
        .await
        .unwrap_err();
    assert_eq!(
        err.0,
        format!("agent did not apply configure for {m}: context deadline exceeded")
    );
    assert!(
        !agent_dir.path().join("hook.runs").exists(),
        "the hook never ran"
    );
    agent
        .expect_output("enrollment failed", Duration::from_secs(5))
        .await;
    drop(agent);

    // The same pin accepts the genuine channel.
    let genuine_pki = Pki {
        ca_pem: own.pem(),
        cert_pem: std::fs::read_to_string(&flags.bootstrap_tls_cert).unwrap(),
        key_pem: own_key.serialize_pem(),
    };
    let genuine = RunningChannel::start_on(
        genuine_listener,
        &genuine_pki,
        Duration::from_secs(5),
        AuthLimit::default(),
    );
    let agent_dir = tempfile::tempdir().unwrap();
    let _agent = AgentProcess::spawn(AgentSetup::recording(
        agent_dir.path(),
        agent_config(&genuine.endpoint(), &pin, m),
    ));
    genuine
        .channel
        .deliver(m, configure(b"genuine-blob"), &ctx(Duration::from_secs(15)))
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(agent_dir.path().join("hook.blob.copy")).unwrap(),
        b"genuine-blob"
    );
}

/// Whether process `pid` is gone (or a zombie nobody reaped yet: it runs nothing).
fn process_gone(pid: &str) -> bool {
    match std::fs::read_to_string(format!("/proc/{}/stat", pid.trim())) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
    }
}

/// A hook that never ends is killed at --hook-timeout with the processes it started, and the
/// configure is acked as failed; the agent then serves the next command.
#[tokio::test]
async fn a_hook_that_sleeps_forever_is_killed_and_acked_as_failed() {
    let (pki, ch) = RunningChannel::with_fresh_pki(Duration::from_secs(5)).await;
    let dir = tempfile::tempdir().unwrap();
    let hook = dir.path().join("bootstrap");
    write_executable(
        &hook,
        &format!(
            "#!/bin/sh\nsleep 100000 &\necho $! > '{d}/child.pid'\necho $$ > '{d}/hook.pid'\nwait\n",
            d = dir.path().display()
        ),
    );
    let m = "m-stuck-hook";
    let agent = AgentProcess::spawn_with_args(
        AgentSetup {
            dir: dir.path(),
            config_json: agent_config(&ch.endpoint(), &pki.ca_pem, m),
            hook,
            drain_command: "true".into(),
            readiness_command: None,
        },
        &["--hook-timeout", "1s"],
    );
    let err = ch
        .channel
        .deliver(m, configure(b"blob"), &ctx(Duration::from_secs(30)))
        .await
        .unwrap_err();
    assert_eq!(
        err.0,
        format!(
            "agent bootstrap failed for {m}: bootstrap hook timed out after 1s and was killed with its process group"
        )
    );
    for file in ["hook.pid", "child.pid"] {
        let pid = std::fs::read_to_string(dir.path().join(file)).unwrap();
        assert!(
            eventually(Duration::from_secs(5), || process_gone(&pid)).await,
            "{file} {pid} still runs"
        );
    }
    // The agent is not stuck: the next command runs.
    ch.channel
        .deliver(
            m,
            Command::Drain { grace_seconds: 1 },
            &ctx(Duration::from_secs(30)),
        )
        .await
        .unwrap();
    assert!(agent.output().contains("timed out after 1s"));
}

/// A TLS 1.3 connection to the channel trusting `ca_pem`, offering `alpn`, from `source`.
async fn raw_tls(
    addr: std::net::SocketAddr,
    ca_pem: &str,
    alpn: &[u8],
    source: std::net::IpAddr,
) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in provider_core::tls::parse_certificates(ca_pem.as_bytes()).unwrap() {
        roots.add(cert).unwrap();
    }
    let mut config =
        rustls::ClientConfig::builder_with_provider(provider_core::tls::crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
    config.alpn_protocols = vec![alpn.to_vec()];
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind(std::net::SocketAddr::new(source, 0))?;
    let tcp = socket.connect(addr).await?;
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let name = rustls_pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let mut tls = connector.connect(name, tcp).await?;
    // TLS 1.3: the server may still drop the connection right after its Finished; a read
    // with a short wait tells a refused connection from an open one.
    let mut probe = [0u8; 1];
    match tokio::time::timeout(Duration::from_millis(200), tls.read(&mut probe)).await {
        Ok(Ok(0)) | Ok(Err(_)) => Err(std::io::Error::other("closed by the server")),
        _ => Ok(tls),
    }
}

const LOCAL: std::net::IpAddr = std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

/// Reads until the server closes the connection; whether it did within `within`.
async fn closed_within<S: tokio::io::AsyncRead + Unpin>(stream: &mut S, within: Duration) -> bool {
    let mut buf = [0u8; 4096];
    tokio::time::timeout(within, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .is_ok()
}

fn limits() -> ChannelLimits {
    ChannelLimits {
        header_timeout: Duration::from_secs(60),
        idle_timeout: Duration::from_secs(60),
        keepalive_interval: Duration::from_secs(60),
        keepalive_timeout: Duration::from_secs(60),
        ..ChannelLimits::default()
    }
}

/// A channel that holds polls 5 s, with `limits` on its listener, and its test PKI.
struct Limited {
    pki: Pki,
    ch: RunningChannel,
}

async fn limited(limits: ChannelLimits) -> Limited {
    let pki = pki();
    let ch = RunningChannel::start_with_limits(
        &pki,
        Duration::from_secs(5),
        AuthLimit::default(),
        limits,
    )
    .await;
    Limited { pki, ch }
}

impl Limited {
    /// A TLS 1.3 connection from `source` offering `alpn`.
    async fn connect_from(
        &self,
        alpn: &[u8],
        source: std::net::IpAddr,
    ) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
        raw_tls(self.ch.addr, &self.pki.ca_pem, alpn, source).await
    }

    /// A TLS 1.3 connection from 127.0.0.1 offering `alpn`, which the channel accepts.
    async fn connect(&self, alpn: &[u8]) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
        self.connect_from(alpn, LOCAL).await.unwrap()
    }
}

#[tokio::test]
async fn a_slowloris_client_is_cut_off_at_the_header_timeout() {
    let limited = limited(ChannelLimits {
        header_timeout: Duration::from_millis(300),
        ..limits()
    })
    .await;
    // Headers that never end.
    let mut slow = limited.connect(b"http/1.1").await;
    slow.write_all(b"GET /v1/command HTTP/1.1\r\nHost: x\r\nX-Slow: 1\r\n")
        .await
        .unwrap();
    assert!(closed_within(&mut slow, Duration::from_secs(20)).await);
    // A TCP connection that never starts its TLS handshake.
    let mut silent = tokio::net::TcpStream::connect(limited.ch.addr)
        .await
        .unwrap();
    assert!(closed_within(&mut silent, Duration::from_secs(20)).await);
}

#[tokio::test]
async fn idle_connections_are_closed() {
    let limited = limited(ChannelLimits {
        idle_timeout: Duration::from_millis(300),
        ..limits()
    })
    .await;
    let mut conn = limited.connect(b"http/1.1").await;
    conn.write_all(b"GET /v2/nothing HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut head = [0u8; 12];
    conn.read_exact(&mut head).await.unwrap();
    assert_eq!(&head, b"HTTP/1.1 404");
    // Keep-alive: nothing more is sent, and the server ends the idle connection.
    assert!(closed_within(&mut conn, Duration::from_secs(20)).await);
}

#[tokio::test]
async fn http2_keepalive_drops_a_peer_that_never_answers_pings() {
    let limited = limited(ChannelLimits {
        keepalive_interval: Duration::from_millis(200),
        keepalive_timeout: Duration::from_millis(200),
        ..limits()
    })
    .await;
    let mut conn = limited.connect(b"h2").await;
    // The client preface and an empty SETTINGS frame; PINGs are never acknowledged.
    conn.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .await
        .unwrap();
    assert!(closed_within(&mut conn, Duration::from_secs(20)).await);
}

#[tokio::test]
async fn oversized_ack_bodies_get_413() {
    let limited = limited(ChannelLimits {
        max_body_bytes: 1024,
        ..limits()
    })
    .await;
    let client = channel_client(&limited.pki.ca_pem);
    let m = "m-body";
    let post = |body: Vec<u8>| {
        client
            .post(format!("{}/v1/ack", limited.ch.endpoint()))
            .query(&[("machine_id", m)])
            .bearer_auth(token(m))
            .body(body)
            .send()
    };
    let r = post(vec![b' '; 1025]).await.unwrap();
    assert_eq!(r.status(), 413);
    assert_eq!(r.text().await.unwrap(), "ack body too large\n");
    // At the cap the body is read (and here refused as not JSON).
    let r = post(vec![b'x'; 1024]).await.unwrap();
    assert_eq!(r.status(), 400);
    // A chunked body without a length is cut off at the cap too.
    let mut conn = limited.connect(b"http/1.1").await;
    let head = format!(
        "POST /v1/ack?machine_id={m} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nTransfer-Encoding: chunked\r\n\r\n",
        token(m)
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    for _ in 0..3 {
        conn.write_all(b"200\r\n").await.unwrap();
        conn.write_all(&[b' '; 0x200]).await.unwrap();
        conn.write_all(b"\r\n").await.unwrap();
    }
    let mut status = [0u8; 12];
    conn.read_exact(&mut status).await.unwrap();
    assert_eq!(&status, b"HTTP/1.1 413");
}

#[tokio::test]
async fn connections_are_capped_per_address_and_in_all() {
    let limited = limited(ChannelLimits {
        max_connections: 3,
        max_connections_per_address: 2,
        ..limits()
    })
    .await;
    let ip = |last: u8| std::net::IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, last));
    let first = limited.connect_from(b"http/1.1", ip(1)).await.unwrap();
    let _second = limited.connect_from(b"http/1.1", ip(1)).await.unwrap();
    // A third from the same address is refused; another address still gets in.
    assert!(limited.connect_from(b"http/1.1", ip(1)).await.is_err());
    let _other = limited.connect_from(b"http/1.1", ip(2)).await.unwrap();
    // Now the channel is full for everyone.
    assert!(limited.connect_from(b"http/1.1", ip(3)).await.is_err());
    // A closed connection frees its place.
    drop(first);
    let mut reopened = None;
    for _ in 0..100 {
        if let Ok(c) = limited.connect_from(b"http/1.1", ip(1)).await {
            reopened = Some(c);
            break;
        }
    }
    assert!(reopened.is_some());
}

fn server_config(
    pki: &Pki,
    versions: &[&'static rustls::SupportedProtocolVersion],
) -> rustls::ServerConfig {
    let certs = provider_core::tls::parse_certificates(pki.cert_pem.as_bytes()).unwrap();
    let key =
        <rustls_pki_types::PrivateKeyDer as rustls_pki_types::pem::PemObject>::from_pem_slice(
            pki.key_pem.as_bytes(),
        )
        .unwrap();
    let mut config =
        rustls::ServerConfig::builder_with_provider(provider_core::tls::crypto_provider())
            .with_protocol_versions(versions)
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .unwrap();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    config
}

fn spawn_agent(
    dir: &std::path::Path,
    addr: std::net::SocketAddr,
    ca_pem: &str,
    m: &str,
) -> AgentProcess {
    let endpoint = format!("https://127.0.0.1:{}", addr.port());
    AgentProcess::spawn(AgentSetup::recording(
        dir,
        agent_config(&endpoint, ca_pem, m),
    ))
}

#[tokio::test]
async fn the_agent_refuses_a_tls_1_2_server() {
    use std::sync::atomic::Ordering;
    let pki = pki();
    let command = br#"{"id":"1","type":"configure","cluster_id":"c","blob":"aGk="}"#;
    let response = json_response(command);
    let server = fake_server(server_config(&pki, &[&rustls::version::TLS12]), response).await;
    let dir = tempfile::tempdir().unwrap();
    let agent = spawn_agent(dir.path(), server.addr, &pki.ca_pem, "m-tls12");
    agent
        .expect_output("enrollment failed", Duration::from_secs(10))
        .await;
    assert!(
        eventually(Duration::from_secs(5), || server
            .failed_handshakes
            .load(Ordering::SeqCst)
            >= 2)
        .await,
        "the agent kept retrying, and every handshake failed"
    );
    assert_eq!(server.requests.load(Ordering::SeqCst), 0);
    assert!(!dir.path().join("hook.runs").exists());
}

#[tokio::test]
async fn the_agent_refuses_an_oversized_command_body() {
    use std::sync::atomic::Ordering;
    let pki = pki();
    // A well-formed configure command just over the cap, once with a length, once chunked.
    let pad = digitalocean::agent::MAX_COMMAND_BYTES;
    let blob = "A".repeat(pad - pad % 4);
    let command = format!(r#"{{"id":"big","type":"configure","cluster_id":"c","blob":"{blob}"}}"#);
    assert!(command.len() > digitalocean::agent::MAX_COMMAND_BYTES);
    let with_length = json_response(command.as_bytes());
    let mut chunked = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n".to_vec();
    for part in command.as_bytes().chunks(64 * 1024) {
        chunked.extend_from_slice(format!("{:x}\r\n", part.len()).as_bytes());
        chunked.extend_from_slice(part);
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    for response in [with_length, chunked] {
        let server = fake_server(server_config(&pki, &[&rustls::version::TLS13]), response).await;
        let dir = tempfile::tempdir().unwrap();
        let agent = spawn_agent(dir.path(), server.addr, &pki.ca_pem, "m-big");
        agent
            .expect_output("command body larger than", Duration::from_secs(10))
            .await;
        assert!(server.requests.load(Ordering::SeqCst) >= 1);
        assert!(!dir.path().join("hook.runs").exists());
    }
}

/// Two replicas' channels behind one Service: the agent's connection to the leader survives a
/// takeover at the TCP level (the Service keeps it on its pod), so the old leader must close it
/// for the agent to reach the new leader, rather than answer 503 on it until it idles out.
#[tokio::test]
async fn an_agent_moves_to_the_new_leader_after_a_takeover() {
    let pki = pki();
    let hold = Duration::from_secs(20);
    let old = RunningChannel::start(&pki, hold, AuthLimit::default()).await;
    let new = RunningChannel::start(&pki, hold, AuthLimit::default()).await;
    let (old_leading, new_leading) = (
        provider_core::replica::Leading::default(),
        provider_core::replica::Leading::default(),
    );
    old_leading.set(true);
    old.channel.serve_while(old_leading.clone());
    new.channel.serve_while(new_leading.clone());
    let service = Forwarder::start(old.addr).await;
    let dir = tempfile::tempdir().unwrap();
    let m = "m-takeover";
    let config_json = agent_config(&format!("https://{}", service.addr), &pki.ca_pem, m);
    let agent = AgentProcess::spawn(AgentSetup::recording(dir.path(), config_json));
    old.channel
        .deliver(m, configure(b"before"), &ctx(Duration::from_secs(15)))
        .await
        .unwrap();
    // The agent polls the leader again (held), then the other replica takes over, with the
    // enrollment the shared state holds.
    tokio::time::sleep(Duration::from_millis(300)).await;
    new.channel.adopt_enrollments(&old.channel);
    old_leading.set(false);
    new_leading.set(true);
    service.retarget(new.addr);
    let started = std::time::Instant::now();
    new.channel
        .deliver(m, configure(b"after"), &ctx(Duration::from_secs(8)))
        .await
        .unwrap_or_else(|e| {
            panic!(
                "the agent did not reach the new leader: {e:?}\n{}",
                agent.output()
            )
        });
    assert_eq!(
        std::fs::read(dir.path().join("hook.blob.copy")).unwrap(),
        b"after"
    );
    eprintln!(
        "the agent reached the new leader {:?} after the takeover",
        started.elapsed()
    );
}

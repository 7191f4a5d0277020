//! The agent's pin against real TLS on 127.0.0.1: without `--bootstrap-ca` the public key of
//! the channel's own certificate is pinned, whoever issued it, so a renewal keeping the key is
//! accepted and a new key is not (by the agents, and by the provider's reload of the channel's
//! keypair); with it, the named CA is a trust anchor (path validation and host name).

use std::time::Duration;

use digitalocean::channel::{AuthLimit, Command};
use rcgen::{CertificateParams, CertifiedIssuer, KeyPair};
use rustls_pki_types::pem::PemObject as _;
use tokio::net::TcpListener;

use crate::support::*;

fn configure(blob: &[u8]) -> Command {
    Command::Configure {
        cluster_id: "c".into(),
        blob: blob.to_vec(),
    }
}

/// A private CA (root -> intermediate) issuing leaves for `names`.
struct PrivateCa {
    root: CertifiedIssuer<'static, KeyPair>,
    intermediate: CertifiedIssuer<'static, KeyPair>,
}

impl PrivateCa {
    fn new() -> PrivateCa {
        let (root, intermediate) = ca_chain("private");
        PrivateCa { root, intermediate }
    }

    /// A leaf issued by the intermediate, as a `tls.crt` with its chain and its key.
    fn leaf(&self, names: &[&str]) -> Pki {
        self.leaf_with(names, KeyPair::generate().unwrap())
    }

    /// The same with a given key (a renewal that keeps it).
    fn leaf_with(&self, names: &[&str], key: KeyPair) -> Pki {
        let leaf =
            CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>())
                .unwrap()
                .signed_by(&key, &self.intermediate)
                .unwrap();
        Pki {
            ca_pem: self.root.pem(),
            cert_pem: format!(
                "{}{}{}",
                leaf.pem(),
                self.intermediate.pem(),
                self.root.pem()
            ),
            key_pem: key.serialize_pem(),
        }
    }
}

const NAMES: &[&str] = &["127.0.0.1", "localhost"];

/// The provider's startup for a channel on `listener` serving `pki`, with `--bootstrap-ca`
/// when given: the `(ca_pem, pinned_cert_pem, pinned_spki_sha256)` it writes into every
/// Droplet's user_data.
fn provider_pin(
    dir: &std::path::Path,
    listener: &TcpListener,
    pki: &Pki,
    bootstrap_ca: Option<&str>,
) -> Result<(String, String, String), String> {
    let file = |name: &str, body: &str| write_file(dir, name, body);
    let flags = digitalocean::RealFlags {
        bootstrap_tls_cert: file("tls.crt", &pki.cert_pem),
        bootstrap_tls_key: file("tls.key", &pki.key_pem),
        bootstrap_ca: bootstrap_ca.map_or_else(String::new, |ca| file("ca.crt", ca)),
        bootstrap_endpoint: format!(
            "https://127.0.0.1:{}",
            listener.local_addr().unwrap().port()
        ),
        ..Default::default()
    };
    let pin = digitalocean::setup::agent_pin(&flags)?.verified_for(&flags.bootstrap_endpoint)?;
    Ok((pin.pem, pin.pinned_cert_pem, pin.pinned_spki_sha256))
}

/// Starts an agent with the provider's pin against `channel` and says whether a configure got
/// through (the hook ran with the blob). When it is expected not to, the agent must have logged
/// `refusal` as the reason its enrollment failed.
async fn configure_through(
    channel: &RunningChannel,
    pin: &(String, String, String),
    m: &str,
    refusal: Option<&str>,
) -> bool {
    let dir = tempfile::tempdir().unwrap();
    // The config exactly as the provider renders it into the user_data.
    let provisioning = digitalocean::cloud::AgentProvisioning {
        endpoint: channel.endpoint(),
        ca_pem: pin.0.clone(),
        pinned_cert_pem: pin.1.clone(),
        pinned_spki_sha256: pin.2.clone(),
    };
    let config = agent_config_from_user_data(&digitalocean::cloud::agent_cloud_config(
        &provisioning,
        m,
        &token(m),
    ));
    let fields: serde_json::Value = serde_json::from_str(&config).unwrap();
    assert_eq!(fields.get("pinned_cert_pem").is_some(), !pin.1.is_empty());
    assert_eq!(
        fields.get("pinned_spki_sha256").is_some(),
        !pin.2.is_empty()
    );
    let agent = AgentProcess::spawn(AgentSetup::recording(dir.path(), config));
    let delivered = channel
        .channel
        .deliver(
            m,
            configure(b"join-blob"),
            &ctx(Duration::from_secs(if refusal.is_some() { 2 } else { 15 })),
        )
        .await;
    match delivered {
        Ok(()) => {
            assert_eq!(
                std::fs::read(dir.path().join("hook.blob.copy")).unwrap(),
                b"join-blob"
            );
            true
        }
        Err(e) => {
            assert!(e.0.ends_with("context deadline exceeded"), "{}", e.0);
            assert!(!dir.path().join("hook.runs").exists(), "the hook never ran");
            let reason = refusal.unwrap_or("enrollment failed");
            agent.expect_output(reason, Duration::from_secs(5)).await;
            false
        }
    }
}

/// A `tls.crt` holding a leaf issued by a private CA (with its chain), and no `--bootstrap-ca`,
/// as a cert-manager Secret gives it: the provider starts, pins that leaf's key (never the
/// intermediate or root of the file), and the agent accepts the channel; a sibling leaf of the
/// same intermediate, for the same names but with its own key, is refused.
#[tokio::test]
async fn a_ca_issued_leaf_is_pinned_exactly_without_bootstrap_ca() {
    let private = PrivateCa::new();
    let genuine = private.leaf(NAMES);
    let dir = tempfile::tempdir().unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let pin = provider_pin(dir.path(), &listener, &genuine, None).expect("provider starts");
    let leaf_pem = genuine
        .cert_pem
        .split_inclusive("-----END CERTIFICATE-----\n")
        .next()
        .unwrap();
    assert_eq!(
        (&pin.0, &pin.1),
        (&leaf_pem.to_owned(), &leaf_pem.to_owned())
    );
    let leaf = rustls_pki_types::CertificateDer::from_pem_slice(leaf_pem.as_bytes()).unwrap();
    let spki = digitalocean::pin::spki_sha256(&leaf).unwrap();
    assert_eq!(pin.2, digitalocean::pin::spki_pin_text(&spki));
    assert!(
        !pin.0
            .contains(private.intermediate.pem().lines().nth(1).unwrap())
    );

    let channel = RunningChannel::start_on(
        listener,
        &genuine,
        Duration::from_secs(5),
        AuthLimit::default(),
    );
    assert!(configure_through(&channel, &pin, "m-genuine", None).await);

    let sibling = private.leaf(NAMES);
    let impostor =
        RunningChannel::start(&sibling, Duration::from_millis(200), AuthLimit::default()).await;
    assert!(
        !configure_through(
            &impostor,
            &pin,
            "m-sibling",
            Some("not the pinned certificate")
        )
        .await
    );
}

/// With `--bootstrap-ca`, the named CA is a trust anchor as before: any leaf it issues for the
/// endpoint's host is accepted (path validation through the served intermediate), a leaf for
/// other names is refused, and so is a leaf of another CA.
#[tokio::test]
async fn with_bootstrap_ca_the_chain_is_path_validated() {
    let private = PrivateCa::new();
    let genuine = private.leaf(NAMES);
    let dir = tempfile::tempdir().unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let pin = provider_pin(dir.path(), &listener, &genuine, Some(&private.root.pem()))
        .expect("provider starts");
    assert_eq!(pin, (private.root.pem(), String::new(), String::new()));
    drop(listener);

    let sibling = private.leaf(NAMES);
    let channel =
        RunningChannel::start(&sibling, Duration::from_secs(5), AuthLimit::default()).await;
    assert!(configure_through(&channel, &pin, "m-sibling", None).await);

    let elsewhere = private.leaf(&["elsewhere.example.com"]);
    let channel =
        RunningChannel::start(&elsewhere, Duration::from_millis(200), AuthLimit::default()).await;
    assert!(
        !configure_through(
            &channel,
            &pin,
            "m-elsewhere",
            Some("certificate not valid for name")
        )
        .await
    );

    let other = PrivateCa::new().leaf(NAMES);
    let channel =
        RunningChannel::start(&other, Duration::from_millis(200), AuthLimit::default()).await;
    assert!(!configure_through(&channel, &pin, "m-other", Some("invalid peer certificate")).await);
    // The provider refuses to start when the CA did not issue the channel's certificate.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let e = provider_pin(dir.path(), &listener, &other, Some(&private.root.pem())).unwrap_err();
    assert!(
        e.starts_with("--bootstrap-ca: the channel certificate"),
        "{e}"
    );
}

/// A TLS 1.3 server presenting `cert` but signing the handshake with `key`, answering the
/// first request with a configure command. Counts requests it got (after a handshake the
/// client accepted).
async fn server_signing_with(
    cert: &str,
    key: &str,
) -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use rustls_pki_types::pem::PemObject as _;
    use std::sync::Arc;

    #[derive(Debug)]
    struct Fixed(Arc<rustls::sign::CertifiedKey>);
    impl rustls::server::ResolvesServerCert for Fixed {
        fn resolve(
            &self,
            _: rustls::server::ClientHello<'_>,
        ) -> Option<Arc<rustls::sign::CertifiedKey>> {
            Some(self.0.clone())
        }
    }

    let provider = provider_core::tls::crypto_provider();
    let signing = provider
        .key_provider
        .load_private_key(rustls_pki_types::PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap())
        .unwrap();
    let chain = provider_core::tls::parse_certificates(cert.as_bytes()).unwrap();
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(Fixed(Arc::new(rustls::sign::CertifiedKey::new(
            chain, signing,
        )))));
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let command = br#"{"id":"1","type":"configure","cluster_id":"c","blob":"am9pbi1ibG9i"}"#;
    let response = json_response(command);
    let server = fake_server(config, response).await;
    (server.addr, server.requests)
}

/// The end-entity pin is not a bearer check of public bytes: a server that presents the
/// pinned certificate without holding its key fails the TLS 1.3 signature check, while the
/// same server with the right key is accepted.
#[tokio::test]
async fn a_server_presenting_the_pinned_certificate_without_its_key_is_refused() {
    use std::sync::atomic::Ordering;
    let private = PrivateCa::new();
    let genuine = private.leaf(NAMES);
    let leaf_pem = genuine
        .cert_pem
        .split_inclusive("-----END CERTIFICATE-----\n")
        .next()
        .unwrap()
        .to_owned();
    let other_key = KeyPair::generate().unwrap().serialize_pem();
    for (key, accepted) in [(&other_key, false), (&genuine.key_pem, true)] {
        let (addr, requests) = server_signing_with(&genuine.cert_pem, key).await;
        let dir = tempfile::tempdir().unwrap();
        let m = "m-key";
        let config = serde_json::json!({
            "endpoint": format!("https://127.0.0.1:{}", addr.port()),
            "ca_pem": leaf_pem, "pinned_cert_pem": leaf_pem, "machine_id": m, "token": token(m),
        });
        let agent = AgentProcess::spawn(AgentSetup::recording(dir.path(), config.to_string()));
        if accepted {
            assert!(
                eventually(Duration::from_secs(15), || dir
                    .path()
                    .join("hook.runs")
                    .exists())
                .await,
                "{}",
                agent.output()
            );
            assert_eq!(
                std::fs::read(dir.path().join("hook.blob.copy")).unwrap(),
                b"join-blob"
            );
        } else {
            agent
                .expect_output("enrollment failed", Duration::from_secs(10))
                .await;
            assert!(
                agent.output().contains("BadSignature"),
                "{}",
                agent.output()
            );
            assert_eq!(requests.load(Ordering::SeqCst), 0);
            assert!(!dir.path().join("hook.runs").exists());
        }
    }
}

/// A renewal under a running fleet, without `--bootstrap-ca`: an agent given the key pin (and
/// one given only `pinned_cert_pem`, as older providers wrote it) accepts a renewed
/// certificate with the same key, and refuses a renewal with a new key.
#[tokio::test]
async fn a_renewal_keeping_the_key_is_accepted_and_a_new_key_is_refused() {
    let private = PrivateCa::new();
    let key_pem = KeyPair::generate().unwrap().serialize_pem();
    let key = || KeyPair::from_pem(&key_pem).unwrap();
    let issued = private.leaf_with(NAMES, key());
    let dir = tempfile::tempdir().unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let pin = provider_pin(dir.path(), &listener, &issued, None).expect("provider starts");
    drop(listener);
    // As an older provider wrote it: the certificate, no key pin.
    let old_config = (pin.0.clone(), pin.1.clone(), String::new());

    let renewed = private.leaf_with(NAMES, key());
    assert_ne!(renewed.cert_pem, issued.cert_pem);
    let channel =
        RunningChannel::start(&renewed, Duration::from_secs(5), AuthLimit::default()).await;
    assert!(configure_through(&channel, &pin, "m-renewed", None).await);
    assert!(configure_through(&channel, &old_config, "m-renewed-old", None).await);

    let rekeyed = private.leaf(NAMES);
    let channel =
        RunningChannel::start(&rekeyed, Duration::from_millis(200), AuthLimit::default()).await;
    for (pin, m) in [(&pin, "m-rekeyed"), (&old_config, "m-rekeyed-old")] {
        assert!(!configure_through(&channel, pin, m, Some("not the pinned key")).await);
    }
}

/// `<prefix>_tls_reload_total{certificate="bootstrap",result}` as exported now.
fn bootstrap_reloads(prefix: &str, result: &str) -> u64 {
    let body = provider_core::telemetry::recorder().render();
    body.lines()
        .find(|l| {
            l.starts_with(&format!("{prefix}_tls_reload_total{{"))
                && l.contains("certificate=\"bootstrap\"")
                && l.contains(&format!("result=\"{result}\""))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {prefix}_tls_reload_total {result} in\n{body}"))
}

/// The provider's reload of the channel's keypair, without `--bootstrap-ca`, takes a renewal
/// keeping the key and refuses one with a new key (no live agent could verify it), naming
/// the files; with `--bootstrap-ca`, a new key the CA issued is taken.
#[tokio::test]
async fn the_channel_reload_refuses_a_new_key_unless_bootstrap_ca_is_set() {
    let private = PrivateCa::new();
    let key_pem = KeyPair::generate().unwrap().serialize_pem();
    let key = || KeyPair::from_pem(&key_pem).unwrap();
    for (bootstrap_ca, prefix) in [
        (None, "bigfleet_do_reload_pinned"),
        (Some(private.root.pem()), "bigfleet_do_reload_ca"),
    ] {
        let issued = private.leaf_with(NAMES, key());
        let dir = tempfile::tempdir().unwrap();
        let file = |name: &str, body: &str| write_file(dir.path(), name, body);
        let flags = digitalocean::RealFlags {
            provider: "p".into(),
            token: zeroize::Zeroizing::new("do-token".into()),
            region: "nyc3".into(),
            image: "ubuntu-24-04-x64".into(),
            api_url: "http://127.0.0.1:1".into(),
            bootstrap_addr: "127.0.0.1:0".into(),
            bootstrap_endpoint: "https://127.0.0.1:8443".into(),
            bootstrap_tls_cert: file("tls.crt", &issued.cert_pem),
            bootstrap_tls_key: file("tls.key", &issued.key_pem),
            bootstrap_ca: bootstrap_ca
                .as_deref()
                .map_or_else(String::new, |ca| file("ca.crt", ca)),
            bootstrap_secret: zeroize::Zeroizing::new("s".repeat(48)),
            ..Default::default()
        };
        let telemetry = provider_core::telemetry::Telemetry::new(prefix);
        let mut real = digitalocean::build_real(&flags, telemetry).expect("starts");
        // A changed pair is judged on the second read that finds it.
        let mut reload = |cert: &str, key: &str| {
            file("tls.crt", cert);
            file("tls.key", key);
            real.channel_reloader.poll();
            real.channel_reloader.poll();
        };
        let renewed = private.leaf_with(NAMES, key());
        reload(&renewed.cert_pem, &renewed.key_pem);
        assert_eq!(bootstrap_reloads(prefix, "loaded"), 1);
        let rekeyed = private.leaf(NAMES);
        reload(&rekeyed.cert_pem, &rekeyed.key_pem);
        let (loaded, refused) = if bootstrap_ca.is_some() {
            (2, 0)
        } else {
            (1, 1)
        };
        assert_eq!(bootstrap_reloads(prefix, "loaded"), loaded, "{prefix}");
        assert_eq!(bootstrap_reloads(prefix, "refused"), refused, "{prefix}");
    }
}

//! Certificates rotated under a running gRPC server on 127.0.0.1: laid out as a Kubernetes
//! Secret volume (`tls.crt -> ..data/tls.crt`, `..data -> ..<timestamp>`) and rotated by
//! swapping `..data`, as the kubelet does. A new client sees the new pair within the reload
//! bound, a connection opened before keeps working, broken pairs and bundles are refused and
//! counted while the previous ones keep serving, and the server task never stops. Each client
//! keeps one rustls config across connections, so a session resumed past a rotation would
//! show up as the old certificate or an admitted old client.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use provider_core::Engine;
use provider_core::engine::EngineOptions;
use provider_core::serve;
use provider_core::store::MemoryStore;
use provider_core::telemetry::Telemetry;
use provider_core::tls::{self, TlsFlags};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

use crate::harness::TestBackend;

/// The interval the tests poll with, except where the production interval is measured.
const FAST: Duration = Duration::from_millis(100);

fn ca(name: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap()
}

/// A PEM keypair.
struct Pair {
    cert: String,
    key: String,
}

/// A server certificate for 127.0.0.1 issued by `issuer` with `key`; with `year`, valid only
/// during that calendar year.
fn server_pair(
    issuer: &CertifiedIssuer<'static, KeyPair>,
    key: KeyPair,
    year: Option<i32>,
) -> Pair {
    let mut params =
        CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap();
    if let Some(year) = year {
        params.not_before = rcgen::date_time_ymd(year, 1, 1);
        params.not_after = rcgen::date_time_ymd(year + 1, 1, 1);
    }
    let cert = params.signed_by(&key, issuer).unwrap();
    Pair {
        cert: cert.pem(),
        key: key.serialize_pem(),
    }
}

/// A client certificate issued by `issuer`.
fn client_pair(issuer: &CertifiedIssuer<'static, KeyPair>) -> Pair {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.subject_alt_names = vec![rcgen::SanType::URI(
        "bigfleet://shard/s1".try_into().unwrap(),
    )];
    let cert = params.signed_by(&key, issuer).unwrap();
    Pair {
        cert: cert.pem(),
        key: key.serialize_pem(),
    }
}

/// A directory laid out as a Kubernetes Secret volume.
struct SecretVolume {
    dir: PathBuf,
    generation: usize,
}

impl SecretVolume {
    fn new(dir: &Path, files: &[(&str, &str)]) -> SecretVolume {
        let mut volume = SecretVolume {
            dir: dir.to_owned(),
            generation: 0,
        };
        volume.swap(files);
        for (name, _) in files {
            std::os::unix::fs::symlink(format!("..data/{name}"), dir.join(name)).unwrap();
        }
        volume
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// What the kubelet does: a new timestamped directory, then `..data` renamed onto it.
    fn swap(&mut self, files: &[(&str, &str)]) {
        self.generation += 1;
        let data = format!(
            "..2026_12_02_17_00_{:02}.{}",
            self.generation, self.generation
        );
        std::fs::create_dir(self.dir.join(&data)).unwrap();
        for (name, body) in files {
            std::fs::write(self.dir.join(&data).join(name), body).unwrap();
        }
        let tmp = self.dir.join("..data_tmp");
        std::os::unix::fs::symlink(&data, &tmp).unwrap();
        std::fs::rename(&tmp, self.dir.join("..data")).unwrap();
    }
}

struct Server {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<Result<(), String>>,
    prefix: &'static str,
    _stop: tokio_util::sync::DropGuard,
}

/// Serves gRPC with `flags` and runs its reloader every `every`.
async fn serve_tls(flags: TlsFlags, prefix: &'static str, every: Duration) -> Server {
    let telemetry = Telemetry::new(prefix);
    let (_, grpc_tls) = tls::grpc_tls(&flags).expect("the pair loads at startup");
    // As the binaries do at startup: the expiry of what the files held.
    telemetry.startup_signals(tls::grpc_expiries(&flags));
    let grpc_tls = grpc_tls.expect("TLS is on");
    let engine = Engine::start(
        TestBackend::instant(2),
        Arc::new(MemoryStore),
        EngineOptions::new(telemetry),
    )
    .await
    .expect("engine starts");
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (health, health_service) = serve::grpc_health(telemetry).await;
    health.set(true).await;
    let stop = CancellationToken::new();
    tokio::spawn(grpc_tls.reloader(telemetry).run(every, stop.clone()));
    let task = tokio::spawn(serve::serve_grpc(
        listener,
        Some(grpc_tls),
        provider_core::identity::ShardIdentity::Off,
        provider_core::replica::Replica::single(engine),
        false,
        health_service,
        serve::GrpcLimits::default(),
        stop.clone().cancelled_owned(),
    ));
    Server {
        addr,
        task,
        prefix,
        _stop: stop.drop_guard(),
    }
}

impl Server {
    /// `<prefix>_tls_reload_total{certificate,result}` as exported now.
    fn reloads(&self, certificate: &str, result: &str) -> u64 {
        let body = provider_core::telemetry::recorder().render();
        let name = format!("{}_tls_reload_total{{", self.prefix);
        body.lines()
            .find(|l| {
                l.starts_with(&name)
                    && l.contains(&format!("certificate=\"{certificate}\""))
                    && l.contains(&format!("result=\"{result}\""))
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name}{certificate},{result}}} in\n{body}"))
    }

    fn not_after(&self, certificate: &str) -> Option<f64> {
        let body = provider_core::telemetry::recorder().render();
        let name = format!(
            "{}_certificate_not_after_timestamp_seconds{{certificate=\"{certificate}\"}} ",
            self.prefix
        );
        body.lines()
            .find_map(|l| l.strip_prefix(&name))
            .and_then(|v| v.parse().ok())
    }

    /// Waits until the reload counter reaches `count`.
    async fn until_reloads(&self, certificate: &str, result: &str, count: u64) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.reloads(certificate, result) < count {
            assert!(
                Instant::now() < deadline,
                "{certificate} {result} stayed below {count}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(self.reloads(certificate, result), count);
    }
}

/// A TLS 1.3 client trusting `roots`, presenting `identity` when given.
fn client_config(roots: &[&str], identity: Option<&Pair>) -> Arc<rustls::ClientConfig> {
    let mut store = rustls::RootCertStore::empty();
    for pem in roots {
        for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
            store.add(cert.unwrap()).unwrap();
        }
    }
    let builder =
        rustls::ClientConfig::builder_with_provider(provider_core::tls::crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_root_certificates(store);
    let mut config = match identity {
        Some(pair) => builder
            .with_client_auth_cert(
                vec![CertificateDer::from_pem_slice(pair.cert.as_bytes()).unwrap()],
                PrivateKeyDer::from_pem_slice(pair.key.as_bytes()).unwrap(),
            )
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    Arc::new(config)
}

/// A gRPC channel over TLS with `config`, recording the server certificate of every
/// connection it opens (a channel that reconnected would show two).
async fn connect(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
) -> Result<(Channel, Arc<Mutex<Vec<CertificateDer<'static>>>>), tonic::transport::Error> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let connections = seen.clone();
    let connector = tokio_rustls::TlsConnector::from(config);
    let channel = Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .connect_with_connector(tower::service_fn(move |_: http::Uri| {
            let (connector, connections) = (connector.clone(), connections.clone());
            async move {
                let tcp = TcpStream::connect(addr).await?;
                let name = ServerName::try_from("127.0.0.1").unwrap();
                let tls = connector.connect(name, tcp).await?;
                let leaf = tls.get_ref().1.peer_certificates().unwrap()[0].clone();
                connections.lock().unwrap().push(leaf);
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
            }
        }))
        .await?;
    Ok((channel, seen))
}

/// One health check over `channel`.
async fn healthy(channel: &Channel) -> Result<(), tonic::Status> {
    HealthClient::new(channel.clone())
        .check(HealthCheckRequest::default())
        .await
        .map(drop)
}

/// The server certificate a new client gets now.
async fn served_now(
    addr: SocketAddr,
    config: &Arc<rustls::ClientConfig>,
) -> CertificateDer<'static> {
    let (channel, seen) = connect(addr, config.clone()).await.expect("connects");
    healthy(&channel).await.expect("a health check");
    seen.lock().unwrap()[0].clone()
}

fn der(pem: &str) -> CertificateDer<'static> {
    CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()
}

#[tokio::test]
async fn a_secret_volume_swap_rotates_the_served_pair_within_the_reload_bound() {
    let issuer = ca("server ca");
    let first = server_pair(&issuer, KeyPair::generate().unwrap(), None);
    let dir = tempfile::tempdir().unwrap();
    let mut volume = SecretVolume::new(
        dir.path(),
        &[("tls.crt", &first.cert), ("tls.key", &first.key)],
    );
    let flags = TlsFlags {
        cert: Some(volume.path("tls.crt")),
        key: Some(volume.path("tls.key")),
        ca: None,
    };
    // The production interval: the bound is measured as operators get it.
    let server = serve_tls(flags, "bigfleet_tlsreload_swap", tls::RELOAD_INTERVAL).await;
    let config = client_config(&[&issuer.pem()], None);
    assert_eq!(served_now(server.addr, &config).await, der(&first.cert));
    let (old, old_seen) = connect(server.addr, config.clone()).await.unwrap();
    healthy(&old).await.unwrap();

    // A renewal with a new key, swapped in as the kubelet does.
    let second = server_pair(&issuer, KeyPair::generate().unwrap(), None);
    volume.swap(&[("tls.crt", &second.cert), ("tls.key", &second.key)]);
    let swapped = Instant::now();
    let bound = tls::RELOAD_INTERVAL * 2 + Duration::from_secs(2);
    loop {
        if served_now(server.addr, &config).await == der(&second.cert) {
            break;
        }
        assert!(swapped.elapsed() < bound, "not served within {bound:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let took = swapped.elapsed();
    println!("the new pair was served {took:?} after the swap (bound {bound:?})");
    assert_eq!(server.reloads("grpc_server", "loaded"), 1);
    assert_eq!(server.reloads("grpc_server", "refused"), 0);
    let not_after = tls::not_after_unix(&der(&second.cert)).unwrap();
    assert_eq!(server.not_after("grpc_server"), Some(not_after as f64));

    // The connection opened before the swap still answers, on its own handshake.
    healthy(&old)
        .await
        .expect("the old connection keeps working");
    assert_eq!(*old_seen.lock().unwrap(), vec![der(&first.cert)]);
    assert!(!server.task.is_finished(), "the server never stopped");
}

#[tokio::test]
async fn half_written_mismatched_and_not_yet_valid_pairs_are_refused_and_counted() {
    let issuer = ca("server ca");
    let good = server_pair(&issuer, KeyPair::generate().unwrap(), None);
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    std::fs::write(&cert, &good.cert).unwrap();
    std::fs::write(&key, &good.key).unwrap();
    let flags = TlsFlags {
        cert: Some(cert.clone()),
        key: Some(key.clone()),
        ca: None,
    };
    let server = serve_tls(flags, "bigfleet_tlsreload_refused", FAST).await;
    let config = client_config(&[&issuer.pem()], None);
    let (old, _) = connect(server.addr, config.clone()).await.unwrap();
    assert_eq!(server.reloads("grpc_server", "refused"), 0);

    // Half-written: the certificate file ends in the middle of its PEM block.
    let next = server_pair(&issuer, KeyPair::generate().unwrap(), None);
    std::fs::write(&cert, &next.cert[..next.cert.len() / 2]).unwrap();
    std::fs::write(&key, &next.key).unwrap();
    server.until_reloads("grpc_server", "refused", 1).await;
    assert_eq!(served_now(server.addr, &config).await, der(&good.cert));

    // Mismatched: a whole certificate, with the key of another one.
    let other = server_pair(&issuer, KeyPair::generate().unwrap(), None);
    std::fs::write(&cert, &next.cert).unwrap();
    std::fs::write(&key, &other.key).unwrap();
    server.until_reloads("grpc_server", "refused", 2).await;
    assert_eq!(served_now(server.addr, &config).await, der(&good.cert));

    // Not yet valid, with its own key.
    let future = server_pair(&issuer, KeyPair::generate().unwrap(), Some(2090));
    std::fs::write(&cert, &future.cert).unwrap();
    std::fs::write(&key, &future.key).unwrap();
    server.until_reloads("grpc_server", "refused", 3).await;
    assert_eq!(served_now(server.addr, &config).await, der(&good.cert));
    // Left in place, a refused pair is not judged (nor counted) again.
    tokio::time::sleep(FAST * 5).await;
    assert_eq!(server.reloads("grpc_server", "refused"), 3);
    assert_eq!(server.reloads("grpc_server", "loaded"), 0);
    let not_after = tls::not_after_unix(&der(&good.cert)).unwrap();
    assert_eq!(server.not_after("grpc_server"), Some(not_after as f64));

    // Completing the pair is taken.
    std::fs::write(&key, &next.key).unwrap();
    std::fs::write(&cert, &next.cert).unwrap();
    server.until_reloads("grpc_server", "loaded", 1).await;
    assert_eq!(served_now(server.addr, &config).await, der(&next.cert));
    healthy(&old)
        .await
        .expect("the old connection keeps working");
    assert!(!server.task.is_finished(), "the server never stopped");
}

#[tokio::test]
async fn a_rotated_client_ca_admits_the_new_clients_and_a_broken_bundle_keeps_the_old() {
    let server_ca = ca("server ca");
    let pair = server_pair(&server_ca, KeyPair::generate().unwrap(), None);
    let (old_ca, new_ca) = (ca("old client ca"), ca("new client ca"));
    let dir = tempfile::tempdir().unwrap();
    let mut volume = SecretVolume::new(
        dir.path(),
        &[
            ("tls.crt", &pair.cert),
            ("tls.key", &pair.key),
            ("ca.crt", &old_ca.pem()),
        ],
    );
    let flags = TlsFlags {
        cert: Some(volume.path("tls.crt")),
        key: Some(volume.path("tls.key")),
        ca: Some(volume.path("ca.crt")),
    };
    let server = serve_tls(flags, "bigfleet_tlsreload_ca", FAST).await;
    let roots = [server_ca.pem()];
    let roots: Vec<&str> = roots.iter().map(String::as_str).collect();
    let old_client = client_config(&roots, Some(&client_pair(&old_ca)));
    let new_client = client_config(&roots, Some(&client_pair(&new_ca)));
    let admitted = |config: &Arc<rustls::ClientConfig>| {
        let config = config.clone();
        let addr = server.addr;
        async move {
            match connect(addr, config).await {
                Ok((channel, _)) => healthy(&channel).await.is_ok(),
                Err(_) => false,
            }
        }
    };
    assert!(admitted(&old_client).await);
    assert!(!admitted(&new_client).await);
    let (old_connection, _) = connect(server.addr, old_client.clone()).await.unwrap();
    healthy(&old_connection).await.unwrap();

    // A bundle with a good block and a broken one: nothing of it is taken.
    let broken = format!(
        "{}-----BEGIN CERTIFICATE-----\n@@@@\n-----END CERTIFICATE-----\n",
        new_ca.pem()
    );
    volume.swap(&[
        ("tls.crt", &pair.cert),
        ("tls.key", &pair.key),
        ("ca.crt", &broken),
    ]);
    server.until_reloads("grpc_client_ca", "refused", 1).await;
    assert!(
        admitted(&old_client).await,
        "the old bundle keeps verifying"
    );
    assert!(!admitted(&new_client).await);

    volume.swap(&[
        ("tls.crt", &pair.cert),
        ("tls.key", &pair.key),
        ("ca.crt", &new_ca.pem()),
    ]);
    server.until_reloads("grpc_client_ca", "loaded", 1).await;
    assert!(admitted(&new_client).await, "the new CA admits its clients");
    assert!(
        !admitted(&old_client).await,
        "the old CA's clients are refused"
    );
    // The keypair did not change: a CA reload is not a keypair reload.
    assert_eq!(server.reloads("grpc_server", "loaded"), 0);
    healthy(&old_connection)
        .await
        .expect("a connection verified before keeps working");
    let not_after = tls::not_after_unix(&der(&new_ca.pem())).unwrap();
    assert_eq!(server.not_after("grpc_client_ca"), Some(not_after as f64));
    assert!(!server.task.is_finished(), "the server never stopped");
}

//! Certificates that rotate under a running process. cert-manager renews a certificate every few
//! weeks and Kubernetes rewrites the mounted Secret by swapping the `..data` symlink of its
//! volume, so a [`Reloader`] task reads the watched files every [`RELOAD_INTERVAL`] and compares
//! a digest of their contents with what it last saw: a symlink swap is seen like an edit, and
//! nothing depends on inotify reaching through the volume's symlinks.
//!
//! A changed keypair is judged once it reads the same on two polls in a row (a writer that
//! replaces the two files one after the other is not judged between them), and taken only
//! whole: every certificate parses, the key is the first certificate's, that certificate is
//! inside its validity period, and the owner's check (the DigitalOcean agents' pin) passes. A
//! changed client CA bundle is taken only if every block of it parses. Anything else leaves
//! what is served alone: it is logged at ERROR naming the file, counted in
//! `<prefix>_tls_reload_total{certificate,result="refused"}`, and judged again when the files
//! change (or, for a certificate refused as not yet valid, once its notBefore has passed).
//!
//! New handshakes get what is current: [`ServedKeypair`] is the server's certificate resolver,
//! and the gRPC server config is replaced whole when its keypair or client CA changes (a new
//! config has a new resumption cache, so no session of before resumes past a rotation).
//! Connections already open keep the keys and the verifier of their own handshake.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rustls::server::danger::ClientCertVerifier;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_util::sync::CancellationToken;
use zeroize::Zeroizing;

use crate::observability::telemetry::Telemetry;

/// How often the watched files are read. A change is taken on the second read that finds it,
/// so new handshakes use a rotated certificate within two intervals.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(2);

/// What the watched files held when last read: a digest of their contents (never the
/// contents: one of them is a private key), or why they could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Seen {
    Content([u8; 32]),
    Unreadable(String),
}

impl Seen {
    fn of(parts: &[&[u8]]) -> Seen {
        let mut context = ring::digest::Context::new(&ring::digest::SHA256);
        for part in parts {
            // Length-prefixed, so moving bytes from one file to the other is a change too.
            context.update(&(part.len() as u64).to_be_bytes());
            context.update(part);
        }
        let mut digest = [0u8; 32];
        digest.copy_from_slice(context.finish().as_ref());
        Seen::Content(digest)
    }
}

/// Seconds since the Unix epoch, now.
fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// The keypair new handshakes are served: the server config's certificate resolver, replaced
/// whole when a reload takes a new pair.
pub struct ServedKeypair {
    current: RwLock<Arc<CertifiedKey>>,
}

impl ServedKeypair {
    pub fn new(key: CertifiedKey) -> Arc<ServedKeypair> {
        Arc::new(ServedKeypair {
            current: RwLock::new(Arc::new(key)),
        })
    }

    /// The pair a handshake starting now gets.
    pub fn current(&self) -> Arc<CertifiedKey> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn replace(&self, key: CertifiedKey) {
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(key);
    }
}

/// The key stays out of debug output.
impl std::fmt::Debug for ServedKeypair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ServedKeypair")
    }
}

impl ResolvesServerCert for ServedKeypair {
    fn resolve(&self, _client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

/// What a reloaded pair must also pass before it is served, given its chain (leaf first): an
/// `Err` names what is wrong, and the previous pair keeps serving.
pub type KeypairCheck = Box<dyn Fn(&[CertificateDer<'static>]) -> Result<(), String> + Send>;

/// The PEM contents of a certificate file and of its key file (zeroed on drop).
type PemPair = (Vec<u8>, Zeroizing<Vec<u8>>);

/// The certificate chain and private key files of one served keypair.
#[derive(Clone, Debug)]
pub struct KeypairFiles {
    /// The `certificate` label of the metrics: `grpc_server`, `bootstrap`.
    pub certificate: &'static str,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl KeypairFiles {
    /// Loads the pair to serve at startup (the chain parses and the key is its leaf's; the
    /// validity dates are left to the caller, as before reloading existed), with the watch
    /// that keeps it current. The error names the file at fault.
    pub fn serve(self) -> Result<(Arc<ServedKeypair>, KeypairWatch), String> {
        let (seen, read) = self.read();
        let (cert_pem, key_pem) = read?;
        let key = self.parse(&cert_pem, &key_pem)?;
        let served = ServedKeypair::new(key);
        let watch = KeypairWatch {
            files: self,
            served: served.clone(),
            seen,
            pending: None,
            retry_at: None,
            check: None,
        };
        Ok((served, watch))
    }

    /// Both files, with the digest of what was read.
    fn read(&self) -> (Seen, Result<PemPair, String>) {
        let read = std::fs::read(&self.cert)
            .map_err(|e| format!("{}: {e}", self.cert.display()))
            .and_then(|cert| {
                let key =
                    std::fs::read(&self.key).map_err(|e| format!("{}: {e}", self.key.display()))?;
                Ok((cert, Zeroizing::new(key)))
            });
        let seen = match &read {
            Ok((cert, key)) => Seen::of(&[cert, key]),
            Err(e) => Seen::Unreadable(e.clone()),
        };
        (seen, read)
    }

    /// The chain and key as one [`CertifiedKey`], refused unless the key is the leaf's.
    fn parse(&self, cert_pem: &[u8], key_pem: &[u8]) -> Result<CertifiedKey, String> {
        let chain = super::parse_certificates(cert_pem)
            .map_err(|e| format!("{}: {e}", self.cert.display()))?;
        let key = PrivateKeyDer::from_pem_slice(key_pem)
            .map_err(|e| format!("{}: no usable private key ({e})", self.key.display()))?;
        let signing = super::crypto_provider()
            .key_provider
            .load_private_key(key)
            .map_err(|e| format!("{}: unusable private key: {e}", self.key.display()))?;
        let pair = CertifiedKey::new(chain, signing);
        pair.keys_match().map_err(|e| {
            format!(
                "the private key {} does not belong to the first certificate of {} ({e})",
                self.key.display(),
                self.cert.display()
            )
        })?;
        Ok(pair)
    }
}

/// Why a changed pair was not taken, and when to judge it again without a change.
struct Refused {
    reason: String,
    /// The notBefore of a certificate refused only for being not yet valid.
    retry_at: Option<i64>,
}

impl From<String> for Refused {
    fn from(reason: String) -> Refused {
        Refused {
            reason,
            retry_at: None,
        }
    }
}

/// Keeps one [`ServedKeypair`] current with its files (see [`Reloader::watch_keypair`]).
pub struct KeypairWatch {
    files: KeypairFiles,
    served: Arc<ServedKeypair>,
    /// What the files held when last judged (or loaded at startup).
    seen: Seen,
    /// A change read once, judged when the next read finds the same.
    pending: Option<Seen>,
    retry_at: Option<i64>,
    check: Option<KeypairCheck>,
}

impl KeypairWatch {
    /// Adds a check every reloaded pair must pass besides loading and being valid now.
    pub fn with_check(mut self, check: KeypairCheck) -> KeypairWatch {
        self.check = Some(check);
        self
    }

    /// One read of the files; true when a new pair was taken.
    fn poll(&mut self, telemetry: Telemetry, now: i64) -> bool {
        let (seen, read) = self.files.read();
        let retry = self.retry_at.is_some_and(|at| now >= at);
        if seen == self.seen && !retry {
            self.pending = None;
            return false;
        }
        if seen != self.seen && self.pending.as_ref() != Some(&seen) {
            self.pending = Some(seen);
            return false;
        }
        self.pending = None;
        self.seen = seen;
        self.retry_at = None;
        let certificate = self.files.certificate;
        let taken = read
            .map_err(Refused::from)
            .and_then(|(cert, key)| self.take(&cert, &key, now));
        match taken {
            Ok(not_after) => {
                telemetry.tls_reload(certificate, "loaded");
                if let Some(not_after) = not_after {
                    telemetry.certificate_not_after(certificate, not_after);
                }
                tracing::info!(
                    certificate,
                    cert = %self.files.cert.display(),
                    key = %self.files.key.display(),
                    "TLS keypair reloaded; new handshakes use it, open connections keep theirs"
                );
                true
            }
            Err(refused) => {
                self.retry_at = refused.retry_at;
                telemetry.tls_reload(certificate, "refused");
                tracing::error!(
                    certificate,
                    cert = %self.files.cert.display(),
                    key = %self.files.key.display(),
                    error = %refused.reason,
                    "TLS keypair changed on disk but not reloaded; the previous keypair keeps serving"
                );
                false
            }
        }
    }

    /// Serves the pair if it passes; the earliest notAfter of its chain, for the metric.
    fn take(&self, cert_pem: &[u8], key_pem: &[u8], now: i64) -> Result<Option<i64>, Refused> {
        let pair = self.files.parse(cert_pem, key_pem)?;
        let leaf = pair
            .cert
            .first()
            .ok_or("no certificates found".to_owned())?;
        let (not_before, not_after) = super::validity_unix(leaf)
            .map_err(|e| format!("{}: certificate 1: {e}", self.files.cert.display()))?;
        if now < not_before {
            return Err(Refused {
                reason: format!(
                    "{}: the certificate is not valid before {} (Unix time {not_before})",
                    self.files.cert.display(),
                    crate::security::tls::unix_date(not_before)
                ),
                retry_at: Some(not_before),
            });
        }
        if now > not_after {
            return Err(format!(
                "{}: the certificate expired on {} (Unix time {not_after})",
                self.files.cert.display(),
                crate::security::tls::unix_date(not_after)
            )
            .into());
        }
        if let Some(check) = &self.check {
            check(&pair.cert)?;
        }
        let earliest = pair
            .cert
            .iter()
            .map(|c| super::not_after_unix(c).ok())
            .try_fold(i64::MAX, |min, n| n.map(|n| min.min(n)));
        self.served.replace(pair);
        Ok(earliest)
    }
}

/// The client CA bundle (`--tls-ca`) as a verifier: every block must parse, or none is taken.
fn client_verifier(path: &Path, pem: &[u8]) -> Result<Arc<dyn ClientCertVerifier>, String> {
    let certs = super::parse_certificates(pem).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in certs {
        roots
            .add(cert)
            .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        super::crypto_provider(),
    )
    .build()
    .map_err(|e| format!("{}: {e}", path.display()))
}

/// The earliest notAfter of a PEM bundle already parsed once.
fn bundle_not_after(pem: &[u8]) -> Option<i64> {
    let certs = super::parse_certificates(pem).ok()?;
    certs
        .iter()
        .map(|c| super::not_after_unix(c).ok())
        .try_fold(i64::MAX, |min, n| n.map(|n| min.min(n)))
}

/// The gRPC server's TLS: the config new connections get, replaced whole when the client CA
/// changes, and the keypair it serves, replaced in place when the keypair changes.
#[derive(Clone)]
pub struct GrpcTls {
    config: Arc<RwLock<Arc<rustls::ServerConfig>>>,
    keypair: Arc<ServedKeypair>,
    /// The client certificate verifier of the current client CA (mTLS).
    verifier: Arc<RwLock<Option<Arc<dyn ClientCertVerifier>>>>,
    /// Taken by the first [`GrpcTls::reloader`]: one task keeps the files current.
    watches: Arc<std::sync::Mutex<Option<GrpcWatches>>>,
}

struct GrpcWatches {
    keypair: KeypairWatch,
    client_ca: Option<ClientCaWatch>,
}

impl std::fmt::Debug for GrpcTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GrpcTls")
    }
}

/// The ALPN protocol gRPC is served with.
const GRPC_ALPN: &[&[u8]] = &[b"h2"];

impl GrpcTls {
    /// Loads the keypair and, for mTLS, the client CA bundle at startup (errors name the file).
    pub(crate) fn load(files: KeypairFiles, client_ca: Option<&Path>) -> Result<GrpcTls, String> {
        let (keypair, keypair_watch) = files
            .serve()
            .map_err(|e| format!("load TLS keypair: {e}"))?;
        let (verifier, client_ca) = match client_ca {
            None => (None, None),
            Some(path) => {
                let pem = std::fs::read(path)
                    .map_err(|e| format!("read client CA {}: {e}", path.display()))?;
                let verifier =
                    client_verifier(path, &pem).map_err(|e| format!("read client CA {e}"))?;
                let watch = ClientCaWatch {
                    path: path.to_owned(),
                    seen: Seen::of(&[&pem]),
                    pending: None,
                };
                (Some(verifier.clone()), Some((watch, verifier)))
            }
        };
        let config = super::serving_config(keypair.clone(), verifier.clone(), GRPC_ALPN)
            .map_err(|e| format!("load TLS keypair: {e}"))?;
        Ok(GrpcTls {
            config: Arc::new(RwLock::new(Arc::new(config))),
            keypair,
            verifier: Arc::new(RwLock::new(verifier)),
            watches: Arc::new(std::sync::Mutex::new(Some(GrpcWatches {
                keypair: keypair_watch,
                client_ca: client_ca.map(|(watch, _)| watch),
            }))),
        })
    }

    /// The config a connection accepted now handshakes with.
    pub fn current(&self) -> Arc<rustls::ServerConfig> {
        self.config
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Replaces the config new connections get, with the current keypair and `verifier`. A new
    /// config also starts a new resumption cache, so no session of before resumes under it.
    fn rebuild(&self, verifier: Option<Arc<dyn ClientCertVerifier>>) -> Result<(), String> {
        let config = super::serving_config(self.keypair.clone(), verifier.clone(), GRPC_ALPN)?;
        *self.verifier.write().unwrap_or_else(|e| e.into_inner()) = verifier;
        *self.config.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(config);
        Ok(())
    }

    /// After a keypair reload: the same verifier, a new config.
    fn keypair_changed(&self) {
        let verifier = self
            .verifier
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Err(e) = self.rebuild(verifier) {
            // The keypair is served all the same (the resolver holds it); only sessions of
            // before may still resume.
            tracing::error!(error = %e, "gRPC TLS config not rebuilt after a keypair reload");
        }
    }

    /// The reloader of the gRPC keypair and client CA (empty when already taken).
    pub fn reloader(&self, telemetry: Telemetry) -> Reloader {
        let mut reloader = Reloader::new(telemetry);
        let taken = self
            .watches
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(watches) = taken {
            reloader
                .telemetry
                .tls_reload_signals(watches.keypair.files.certificate);
            reloader
                .watches
                .push(Watch::Keypair(watches.keypair, Some(self.clone())));
            if let Some(client_ca) = watches.client_ca {
                telemetry.tls_reload_signals("grpc_client_ca");
                reloader
                    .watches
                    .push(Watch::ClientCa(client_ca, self.clone()));
            }
        }
        reloader
    }
}

/// Keeps the gRPC client CA current.
struct ClientCaWatch {
    path: PathBuf,
    seen: Seen,
    /// A change read once, judged when the next read finds the same.
    pending: Option<Seen>,
}

impl ClientCaWatch {
    fn poll(&mut self, telemetry: Telemetry, grpc: &GrpcTls) {
        let read = std::fs::read(&self.path).map_err(|e| format!("{}: {e}", self.path.display()));
        let seen = match &read {
            Ok(pem) => Seen::of(&[pem]),
            Err(e) => Seen::Unreadable(e.clone()),
        };
        if seen == self.seen {
            self.pending = None;
            return;
        }
        if self.pending.as_ref() != Some(&seen) {
            self.pending = Some(seen);
            return;
        }
        self.pending = None;
        self.seen = seen;
        let taken = read.and_then(|pem| {
            let verifier = client_verifier(&self.path, &pem)?;
            grpc.rebuild(Some(verifier))?;
            Ok(bundle_not_after(&pem))
        });
        match taken {
            Ok(not_after) => {
                telemetry.tls_reload("grpc_client_ca", "loaded");
                if let Some(not_after) = not_after {
                    telemetry.certificate_not_after("grpc_client_ca", not_after);
                }
                tracing::info!(
                    certificate = "grpc_client_ca",
                    ca = %self.path.display(),
                    "client CA bundle reloaded; new connections are verified against it"
                );
            }
            Err(e) => {
                telemetry.tls_reload("grpc_client_ca", "refused");
                tracing::error!(
                    certificate = "grpc_client_ca",
                    ca = %self.path.display(),
                    error = %e,
                    "client CA bundle changed on disk but not reloaded; the previous bundle keeps verifying clients"
                );
            }
        }
    }
}

enum Watch {
    /// With the gRPC TLS whose config is rebuilt when the pair changes.
    Keypair(KeypairWatch, Option<GrpcTls>),
    ClientCa(ClientCaWatch, GrpcTls),
}

/// One task that keeps served certificates current with their files.
pub struct Reloader {
    telemetry: Telemetry,
    watches: Vec<Watch>,
}

impl std::fmt::Debug for Reloader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reloader")
            .field("watches", &self.watches.len())
            .finish()
    }
}

impl Reloader {
    pub fn new(telemetry: Telemetry) -> Reloader {
        Reloader {
            telemetry,
            watches: Vec::new(),
        }
    }

    /// Keeps the pair of `watch` current, and exports its reload counters from now on.
    pub fn watch_keypair(&mut self, watch: KeypairWatch) {
        self.telemetry.tls_reload_signals(watch.files.certificate);
        self.watches.push(Watch::Keypair(watch, None));
    }

    /// One read of every watched file, taking what changed and passes.
    pub fn poll(&mut self) {
        let now = unix_now();
        for watch in &mut self.watches {
            match watch {
                Watch::Keypair(watch, grpc) => {
                    if watch.poll(self.telemetry, now)
                        && let Some(grpc) = grpc
                    {
                        grpc.keypair_changed();
                    }
                }
                Watch::ClientCa(watch, grpc) => watch.poll(self.telemetry, grpc),
            }
        }
    }

    /// Polls every `every` until `stop` is cancelled. The files are a few kilobytes on a local
    /// volume, so they are read on the runtime's thread.
    pub async fn run(mut self, every: Duration, stop: CancellationToken) {
        if self.watches.is_empty() {
            return;
        }
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.cancelled() => return,
            }
            self.poll();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A self-signed pair valid during `year`, written to `dir`.
    fn write_pair(dir: &Path, year: i32) -> KeypairFiles {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params =
            rcgen::CertificateParams::new(vec!["localhost".to_owned()]).expect("params");
        params.not_before = rcgen::date_time_ymd(year, 1, 1);
        params.not_after = rcgen::date_time_ymd(year + 1, 1, 1);
        let cert = params.self_signed(&key).expect("cert");
        let files = KeypairFiles {
            certificate: "grpc_server",
            cert: dir.join("tls.crt"),
            key: dir.join("tls.key"),
        };
        std::fs::write(&files.cert, cert.pem()).expect("write");
        std::fs::write(&files.key, key.serialize_pem()).expect("write");
        files
    }

    #[test]
    fn a_pair_refused_as_not_yet_valid_is_taken_once_its_validity_starts() {
        let telemetry = Telemetry::new("bigfleet_reloadunit");
        let dir = tempfile::tempdir().expect("tempdir");
        let (served, mut watch) = write_pair(dir.path(), 2020).serve().expect("loads");
        let first = served.current().cert[0].clone();
        write_pair(dir.path(), 2090);
        let before = crate::security::tls::validity_unix(&first)
            .expect("validity")
            .1;
        let not_before = 3_786_912_000; // 2090-01-01
        // Read once: pending; read again, unchanged: judged and refused as not yet valid.
        assert!(!watch.poll(telemetry, before));
        assert!(!watch.poll(telemetry, before));
        assert_eq!(watch.retry_at, Some(not_before));
        assert_eq!(served.current().cert[0], first);
        // Unchanged and still before its notBefore: not judged again.
        assert!(!watch.poll(telemetry, not_before - 1));
        // Its validity has started: taken without any change of the files.
        assert!(watch.poll(telemetry, not_before));
        assert_ne!(served.current().cert[0], first);
        assert_eq!(watch.retry_at, None);
    }

    #[test]
    fn a_change_seen_once_is_not_judged_until_it_reads_the_same_again() {
        let telemetry = Telemetry::new("bigfleet_reloadunit_settle");
        let dir = tempfile::tempdir().expect("tempdir");
        let now = unix_now();
        let (served, mut watch) = write_pair(dir.path(), 2020).serve().expect("loads");
        let first = served.current().cert[0].clone();
        // The writer has replaced the certificate but not yet the key.
        let next_key = rcgen::KeyPair::generate().expect("key");
        let next = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
            .expect("params")
            .self_signed(&next_key)
            .expect("cert");
        std::fs::write(&watch.files.cert, next.pem()).expect("write");
        assert!(!watch.poll(telemetry, now));
        assert!(watch.pending.is_some(), "seen once, not judged");
        // Then the key: another change, still not judged...
        std::fs::write(&watch.files.key, next_key.serialize_pem()).expect("write");
        assert!(!watch.poll(telemetry, now));
        assert_eq!(served.current().cert[0], first);
        // ...until it reads the same twice: taken, never refused on the way.
        assert!(watch.poll(telemetry, now));
        assert_eq!(served.current().cert[0].as_ref(), next.der().as_ref());
    }
}

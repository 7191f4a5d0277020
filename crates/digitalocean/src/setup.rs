//! Start-up of the real backend: checks the flags in the reference's order with its messages
//! (digitalocean.md §3), loads the bootstrap channel's TLS material, and builds the channel and
//! the [`DigitalOceanCloud`] before any port is bound.

use std::path::Path;
use std::sync::Arc;

use provider_core::retry::Backoff;
use provider_core::telemetry::Telemetry;
use provider_core::tls;
use rustls::ServerConfig;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::api::{ApiClient, ApiToken, ImageRef, parse_base_url};
use crate::channel::{AuthLimit, Channel, ChannelLimits, ChannelSettings, DEFAULT_POLL_HOLD};
use crate::cloud::{AgentProvisioning, CloudSettings, DigitalOceanCloud};
use crate::pin::Pin;
use crate::profile::Wanted;
use crate::profile_cache::{Account, ProfileBook, ProfileFile};
use crate::token::BootstrapSecret;
use zeroize::Zeroizing;

/// The flags of the real backend, as parsed (secrets already resolved from their env vars).
#[derive(Clone, Default)]
pub struct RealFlags {
    pub provider: String,
    /// Zeroed on drop.
    pub token: Zeroizing<String>,
    pub region: String,
    pub image: String,
    pub api_url: String,
    /// The contents of `--base-user-data`, already read.
    pub base_user_data: Option<String>,
    pub bootstrap_addr: String,
    pub bootstrap_endpoint: String,
    pub bootstrap_tls_cert: String,
    pub bootstrap_tls_key: String,
    pub bootstrap_ca: String,
    /// Zeroed on drop.
    pub bootstrap_secret: Zeroizing<String>,
    /// `--bootstrap-max-connections`; 0 means the default.
    pub bootstrap_max_connections: usize,
    /// `--bootstrap-max-connections-per-address`; 0 means the default.
    pub bootstrap_max_connections_per_address: usize,
    /// `--bootstrap-enrollment-source`.
    pub bootstrap_enrollment_source: crate::enrollment::EnrollmentSource,
    /// The provider's `--state`: a local state directory keeps the channel key record and the
    /// resolved Droplet settings.
    pub state: String,
}

impl std::fmt::Debug for RealFlags {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RealFlags")
            .field("provider", &self.provider)
            .field("region", &self.region)
            .field("image", &self.image)
            .field("api_url", &self.api_url)
            .field("bootstrap_addr", &self.bootstrap_addr)
            .field("bootstrap_endpoint", &self.bootstrap_endpoint)
            .finish_non_exhaustive()
    }
}

/// The validated real backend, ready to serve.
#[derive(Debug)]
pub struct RealBackend {
    pub cloud: Arc<DigitalOceanCloud>,
    /// The bootstrap channel: bind `bootstrap_addr` and run [`Channel::serve`].
    pub channel: Channel,
    pub bootstrap_addr: String,
    /// The API client the cloud uses.
    pub api: ApiClient,
    /// Keeps the channel's keypair current with its files: run it beside the channel.
    pub channel_reloader: tls::Reloader,
    settings: CloudSettings,
    telemetry: Telemetry,
    /// `profiles.json` beside a local state: the Droplet settings the last run resolved.
    profile_file: Option<ProfileFile>,
    /// The endpoint and token, as a saved `profiles.json` must match them.
    account: Account,
}

/// How long the startup checks may take, retries included.
pub const STARTUP_CHECK_BUDGET: std::time::Duration = std::time::Duration::from_secs(60);

impl RealBackend {
    /// Runs the cheap checks against the API before anything is bound: the token works, every
    /// offering's size is sold in its region with a price, and every image, VPC and login SSH
    /// key resolves; or, when the last run saved them beside a local state for the same
    /// settings, endpoint and token, takes its resolved settings without any API call (see
    /// [`crate::profile_cache`]). The cloud is rebuilt with the resolved settings, so a Create
    /// sends them without another lookup.
    pub async fn resolve(self, wanted: &[Wanted]) -> Result<RealBackend, String> {
        let deadline = tokio::time::Instant::now() + STARTUP_CHECK_BUDGET;
        let profiles = ProfileBook::start(
            &self.api,
            wanted,
            self.profile_file.clone(),
            &self.account,
            deadline,
        )
        .await?;
        let mut settings = self.settings;
        settings.profiles = Arc::new(profiles);
        let cloud = Arc::new(DigitalOceanCloud::new(
            self.api.clone(),
            self.channel.clone(),
            settings.clone(),
            self.telemetry,
        ));
        Ok(RealBackend {
            cloud,
            settings,
            ..self
        })
    }
}

/// Shorter bootstrap secrets are accepted (the reference accepts any) but warned about.
const MIN_SECRET_BYTES: usize = 32;

/// Validates the flags in the reference's order and builds the channel and the cloud.
/// Nothing is bound or contacted.
pub fn build_real(flags: &RealFlags, telemetry: Telemetry) -> Result<RealBackend, String> {
    let secret = BootstrapSecret::new(flags.bootstrap_secret.to_string()).ok_or(
        "the digitalocean backend requires --bootstrap-secret or BIGFLEET_BOOTSTRAP_SECRET: a \
         stable HMAC key minting per-machine agent tokens (a random per-process secret would \
         invalidate already-issued tokens on restart and break Configure for every live Droplet)",
    )?;
    if flags.bootstrap_secret.len() < MIN_SECRET_BYTES {
        // Only the length is logged, never the secret.
        tracing::warn!(
            bytes = flags.bootstrap_secret.len(),
            "--bootstrap-secret is shorter than 32 bytes: agent tokens are only as strong as \
             this key; generate one with `openssl rand -base64 48` (rotating it invalidates \
             every token already issued)"
        );
    }
    if flags.bootstrap_addr.is_empty()
        || flags.bootstrap_tls_cert.is_empty()
        || flags.bootstrap_tls_key.is_empty()
    {
        return Err("the digitalocean backend requires --bootstrap-addr, --bootstrap-tls-cert and \
                    --bootstrap-tls-key (the bootstrap blob is a join secret and must travel over TLS)"
            .into());
    }
    // Checked as before reloading existed, for the same messages; then loaded for serving.
    load_channel_tls(&flags.bootstrap_tls_cert, &flags.bootstrap_tls_key)
        .map_err(|e| format!("load bootstrap TLS keypair: {e}"))?;
    let (served, watch) = tls::KeypairFiles {
        certificate: "bootstrap",
        cert: flags.bootstrap_tls_cert.clone().into(),
        key: flags.bootstrap_tls_key.clone().into(),
    }
    .serve()
    .map_err(|e| format!("load bootstrap TLS keypair: {e}"))?;
    let tls = reloading_channel_tls(served)?;
    let pin = agent_pin(flags)?;
    telemetry.bootstrap_channel_signals(tls::earliest_not_after(Path::new(
        &flags.bootstrap_tls_cert,
    )));
    let token = ApiToken::new(&flags.token)
        .ok_or("digitalocean: token is required for the digitalocean backend")?;
    if flags.region.is_empty() {
        return Err("digitalocean: --region is required for the digitalocean backend".into());
    }
    if flags.image.is_empty() {
        return Err("digitalocean: --image is required for the digitalocean backend".into());
    }
    if flags.bootstrap_endpoint.is_empty() {
        return Err(
            "digitalocean: --bootstrap-endpoint is required so the on-host agent can \
                    reach the provider"
                .into(),
        );
    }
    let endpoint_ok = reqwest::Url::parse(&flags.bootstrap_endpoint)
        .is_ok_and(|u| u.scheme() == "https" && u.host_str().is_some_and(|h| !h.is_empty()));
    if !endpoint_ok {
        return Err(format!(
            "digitalocean: --bootstrap-endpoint {:?} must be an https:// URL (the agent only speaks TLS)",
            flags.bootstrap_endpoint
        ));
    }
    let pin = pin.verified_for(&flags.bootstrap_endpoint)?;
    let mut channel_reloader = tls::Reloader::new(telemetry);
    channel_reloader.watch_keypair(watch.with_check(pin.reload_check()));
    let api_url = if flags.api_url.is_empty() {
        crate::api::DEFAULT_API_URL
    } else {
        &flags.api_url
    };
    let base = parse_base_url(api_url)?;
    let account = Account::new(base.as_str(), &flags.token);
    let api = ApiClient::new(base, token, Backoff::default(), telemetry)?;
    let mut limits = ChannelLimits::default();
    if flags.bootstrap_max_connections > 0 {
        limits.max_connections = flags.bootstrap_max_connections;
    }
    if flags.bootstrap_max_connections_per_address > 0 {
        limits.max_connections_per_address = flags.bootstrap_max_connections_per_address;
    }
    let channel = Channel::with_limits(
        ChannelSettings {
            secret,
            tls,
            poll_hold: DEFAULT_POLL_HOLD,
            auth_limit: AuthLimit::default(),
        },
        limits,
        telemetry,
    );
    channel.set_enrollment_source(flags.bootstrap_enrollment_source);
    if flags.bootstrap_enrollment_source == crate::enrollment::EnrollmentSource::Any {
        tracing::warn!(
            "--bootstrap-enrollment-source any: agents may enroll from any address, not only from \
             one the cloud assigned to their Droplet (the channel is reached through a NAT or a \
             proxy); a stolen user_data token can then enroll from anywhere before the real agent \
             does (detected as a conflict when the real agent enrolls)"
        );
    }
    let channel_key = crate::channel_key::ChannelKeyRecord::for_state(
        &flags.state,
        &pin.pinned_spki_sha256,
        &flags.bootstrap_tls_cert,
        &flags.bootstrap_tls_key,
    );
    let mut settings = CloudSettings::new(
        flags.provider.clone(),
        flags.region.clone(),
        ImageRef::parse(&flags.image),
        flags.base_user_data.clone(),
        AgentProvisioning {
            endpoint: flags.bootstrap_endpoint.clone(),
            ca_pem: pin.pem,
            pinned_cert_pem: pin.pinned_cert_pem,
            pinned_spki_sha256: pin.pinned_spki_sha256,
        },
    );
    settings.channel_key = channel_key;
    let cloud = Arc::new(DigitalOceanCloud::new(
        api.clone(),
        channel.clone(),
        settings.clone(),
        telemetry,
    ));
    Ok(RealBackend {
        cloud,
        channel,
        bootstrap_addr: flags.bootstrap_addr.clone(),
        api,
        channel_reloader,
        settings,
        telemetry,
        profile_file: ProfileFile::for_state(&flags.state),
        account,
    })
}

/// What every agent pins, as read from the flags but not yet checked against the channel's own
/// certificate. Written into each Droplet's user_data as `ca_pem` and, without
/// `--bootstrap-ca`, `pinned_cert_pem` and `pinned_spki_sha256`.
pub struct AgentPin {
    /// `ca_pem`: the trust anchors of `--bootstrap-ca`, or without it the channel's own
    /// certificate (for agents that predate both pins and take it as a trust anchor, which
    /// works for a self-signed certificate). PEM-encoded again from the DER: nothing else of
    /// the source file (a private key in a combined file, comments) can reach the user_data.
    pub pem: String,
    /// `pinned_cert_pem`: without `--bootstrap-ca`, the channel's own certificate, for agents
    /// that know this pin but not the next (they compare it byte for byte); empty with it.
    pub pinned_cert_pem: String,
    /// `pinned_spki_sha256`: without `--bootstrap-ca`, the base64 SHA-256 of the channel
    /// certificate's SubjectPublicKeyInfo; empty with it.
    pub pinned_spki_sha256: String,
    pin: Pin,
    /// The channel's chain as served: leaf first.
    chain: Vec<CertificateDer<'static>>,
    cert_path: String,
    /// The `--bootstrap-endpoint` host the agents connect to, once verified.
    host: String,
}

/// Decides what the agents pin:
///
/// - with `--bootstrap-ca`, every certificate of that file as a trust anchor (the operator
///   named them); the file is parsed strictly, so a malformed block fails startup;
/// - without it, the public key of the channel's own certificate, the first of
///   `--bootstrap-tls-cert`: self-signed or CA-issued, the agent accepts a certificate with
///   that key and no other, so a renewal that keeps the key keeps every agent working. Further
///   certificates in that file (intermediates, a bundle) are served in the handshake but never
///   pinned, so no intermediate or root can become a trust anchor of the agents.
pub fn agent_pin(flags: &RealFlags) -> Result<AgentPin, String> {
    let chain = tls::read_certificates(Path::new(&flags.bootstrap_tls_cert))
        .map_err(|e| format!("load bootstrap TLS keypair: {e}"))?;
    let (pem, pinned_cert_pem, pinned_spki_sha256, pin) = if flags.bootstrap_ca.is_empty() {
        let leaf = certificate_pem(&chain[0]);
        let spki = crate::pin::spki_sha256(&chain[0]).map_err(|e| {
            format!(
                "load bootstrap TLS keypair: --bootstrap-tls-cert {}: {e}",
                flags.bootstrap_tls_cert
            )
        })?;
        let text = crate::pin::spki_pin_text(&spki);
        (leaf.clone(), leaf, text, Pin::PublicKey(spki))
    } else {
        let anchors = tls::read_certificates(Path::new(&flags.bootstrap_ca))
            .map_err(|e| format!("read bootstrap CA: --bootstrap-ca {e}"))?;
        let pem = anchors.iter().map(|c| certificate_pem(c)).collect();
        (pem, String::new(), String::new(), Pin::Anchors(anchors))
    };
    Ok(AgentPin {
        pem,
        pinned_cert_pem,
        pinned_spki_sha256,
        pin,
        chain,
        cert_path: flags.bootstrap_tls_cert.clone(),
        host: String::new(),
    })
}

impl AgentPin {
    /// Checks with the agents' own verifier that they will accept the channel's chain for the
    /// host of `endpoint` (validity dates included): a pin that no agent could use fails
    /// startup instead of every Configure.
    pub fn verified_for(mut self, endpoint: &str) -> Result<AgentPin, String> {
        let url =
            reqwest::Url::parse(endpoint).map_err(|e| format!("--bootstrap-endpoint: {e}"))?;
        // An IPv6 host comes bracketed; the certificate names the bare address.
        let host = url
            .host_str()
            .map(|h| h.trim_start_matches('[').trim_end_matches(']').to_owned())
            .ok_or_else(|| format!("--bootstrap-endpoint {endpoint:?} has no host"))?;
        rustls_pki_types::ServerName::try_from(host.clone())
            .map_err(|e| format!("--bootstrap-endpoint host {host:?}: {e}"))?;
        self.host = host;
        accepted_by_agents(&self.pin, &self.chain, &self.host, &self.cert_path, false)?;
        Ok(self)
    }

    /// The check every reloaded channel keypair must pass: the agents' own verifier, with the
    /// pin they were given, accepts its chain. Without `--bootstrap-ca` that means the same
    /// public key; a new key would lock out every Droplet created before.
    pub fn reload_check(&self) -> tls::KeypairCheck {
        let (pin, host, cert_path) = (self.pin.clone(), self.host.clone(), self.cert_path.clone());
        Box::new(move |chain| accepted_by_agents(&pin, chain, &host, &cert_path, true))
    }
}

/// Whether agents holding `pin` accept `chain` for `host`; the error says which flag to look at.
fn accepted_by_agents(
    pin: &Pin,
    chain: &[CertificateDer<'static>],
    host: &str,
    cert_path: &str,
    reload: bool,
) -> Result<(), String> {
    let name = rustls_pki_types::ServerName::try_from(host.to_owned())
        .map_err(|e| format!("--bootstrap-endpoint host {host:?}: {e}"))?;
    let explicit = matches!(pin, Pin::Anchors(_));
    let verifier = crate::pin::verifier(pin).map_err(|e| {
        if explicit {
            format!("read bootstrap CA: --bootstrap-ca: {e}")
        } else {
            format!("--bootstrap-tls-cert {cert_path}: {e}")
        }
    })?;
    let (leaf, intermediates) = chain
        .split_first()
        .ok_or_else(|| format!("--bootstrap-tls-cert {cert_path}: no certificates found"))?;
    let verified = verifier.verify_server_cert(
        leaf,
        intermediates,
        &name,
        &[],
        rustls_pki_types::UnixTime::now(),
    );
    match verified {
        Ok(_) => Ok(()),
        Err(e) if explicit => Err(format!(
            "--bootstrap-ca: the channel certificate (--bootstrap-tls-cert {cert_path}) does not \
             verify against it for the --bootstrap-endpoint host {host:?}, so no agent would \
             accept the channel: {e}"
        )),
        Err(e) if reload => Err(format!(
            "--bootstrap-ca is not set, so agents pin the public key of the channel certificate \
             they were given, and no agent would accept the new certificate of \
             --bootstrap-tls-cert {cert_path} for the --bootstrap-endpoint host {host:?}: {e}; \
             renew keeping the key (cert-manager privateKey.rotationPolicy: Never), or set \
             --bootstrap-ca"
        )),
        Err(e) => Err(format!(
            "--bootstrap-ca is not set, so agents pin the public key of the channel's own \
             certificate (the first certificate of --bootstrap-tls-cert {cert_path}), and no \
             agent would accept it for the --bootstrap-endpoint host {host:?}: {e}"
        )),
    }
}

/// One certificate as PEM: base64 of the DER in 64-character lines.
fn certificate_pem(der: &CertificateDer<'_>) -> String {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der.as_ref());
    let mut pem = String::from("-----BEGIN CERTIFICATE-----\n");
    for line in b64.as_bytes().chunks(64) {
        pem.push_str(&String::from_utf8_lossy(line));
        pem.push('\n');
    }
    pem.push_str("-----END CERTIFICATE-----\n");
    pem
}

/// ALPN protocols of the channel: agents may speak HTTP/2 or HTTP/1.1.
const CHANNEL_ALPN: &[&[u8]] = &[b"h2", b"http/1.1"];

/// Loads the channel's certificate chain and key from PEM files into a TLS 1.3-only server
/// config (ring provider, no client certificates).
pub fn load_channel_tls(cert_path: &str, key_path: &str) -> Result<Arc<ServerConfig>, String> {
    let certs = tls::read_certificates(Path::new(cert_path))?;
    let key = tls::read_private_key(Path::new(key_path))?;
    build_channel_tls(certs, key)
}

/// The same from PEM bytes.
pub fn channel_tls(cert_pem: &[u8], key_pem: &[u8]) -> Result<Arc<ServerConfig>, String> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("parse certificate: {e}"))?;
    if certs.is_empty() {
        return Err("no certificates found".into());
    }
    let key =
        PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| format!("parse private key: {e}"))?;
    build_channel_tls(certs, key)
}

/// The channel's server config over a keypair that reloads. Sessions are not resumed: every
/// connection gets a full handshake with the keypair served at that moment, so none resumes a
/// session of a pair a reload has replaced.
fn reloading_channel_tls(served: Arc<tls::ServedKeypair>) -> Result<Arc<ServerConfig>, String> {
    let mut config = tls::serving_config(served, None, CHANNEL_ALPN)
        .map_err(|e| format!("load bootstrap TLS keypair: {e}"))?;
    config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    config.send_tls13_tickets = 0;
    Ok(Arc::new(config))
}

fn build_channel_tls(
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<Arc<ServerConfig>, String> {
    tls::server_config(certs, key, None, CHANNEL_ALPN)
        .map(Arc::new)
        .map_err(|e| format!("certificate and key do not match: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &std::path::Path, name: &str, body: &str) -> String {
        let path = dir.join(name);
        std::fs::write(&path, body).expect("write");
        path.display().to_string()
    }

    /// Flags that pass every check, with a self-signed channel certificate.
    fn valid(dir: &std::path::Path) -> RealFlags {
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = rcgen::CertificateParams::new(vec![
            "localhost".to_owned(),
            "bootstrap.example.com".to_owned(),
        ])
        .expect("params")
        .self_signed(&key)
        .expect("cert");
        RealFlags {
            provider: "digitalocean".into(),
            token: Zeroizing::new("dop_v1_x".into()),
            region: "nyc3".into(),
            image: "ubuntu-24-04-x64".into(),
            api_url: String::new(),
            base_user_data: None,
            bootstrap_addr: ":9443".into(),
            bootstrap_endpoint: "https://bootstrap.example.com:9443".into(),
            bootstrap_tls_cert: write(dir, "cert.pem", &cert.pem()),
            bootstrap_tls_key: write(dir, "key.pem", &key.serialize_pem()),
            bootstrap_ca: String::new(),
            bootstrap_secret: Zeroizing::new("s3cret".into()),
            bootstrap_max_connections: 0,
            bootstrap_max_connections_per_address: 0,
            bootstrap_enrollment_source: Default::default(),
            state: String::new(),
        }
    }

    fn error(flags: &RealFlags) -> String {
        build_real(flags, Telemetry::new("bigfleet_digitalocean_setup_test"))
            .expect_err("must fail")
    }

    #[test]
    fn checks_run_in_the_reference_order_with_its_messages() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ok = valid(dir.path());
        let backend = build_real(&ok, Telemetry::new("bigfleet_digitalocean_setup_test"))
            .expect("valid flags");
        assert_eq!(backend.bootstrap_addr, ":9443");

        // Everything wrong at once: the secret is reported first.
        let all_wrong = RealFlags::default();
        assert!(error(&all_wrong).starts_with(
            "the digitalocean backend requires --bootstrap-secret or BIGFLEET_BOOTSTRAP_SECRET: a stable HMAC key"
        ));
        let mut f = ok.clone();
        f.bootstrap_tls_key.clear();
        assert!(error(&f).starts_with(
            "the digitalocean backend requires --bootstrap-addr, --bootstrap-tls-cert and --bootstrap-tls-key"
        ));
        let mut f = ok.clone();
        f.bootstrap_tls_cert = dir.path().join("missing.pem").display().to_string();
        assert!(
            error(&f).starts_with("load bootstrap TLS keypair: /"),
            "{}",
            error(&f)
        );
        assert!(
            error(&f).contains("missing.pem: No such file"),
            "{}",
            error(&f)
        );
        let mut f = ok.clone();
        f.bootstrap_tls_key = write(dir.path(), "garbage.pem", "not pem");
        assert!(
            error(&f).ends_with("garbage.pem: no usable private key (no items found)"),
            "{}",
            error(&f)
        );
        let mut f = ok.clone();
        f.bootstrap_ca = dir.path().join("no-ca.pem").display().to_string();
        assert!(
            error(&f).starts_with("read bootstrap CA: --bootstrap-ca /"),
            "{}",
            error(&f)
        );
        let mut f = ok.clone();
        f.token = Zeroizing::new(" '' ".into());
        assert_eq!(
            error(&f),
            "digitalocean: token is required for the digitalocean backend"
        );
        let mut f = ok.clone();
        f.region.clear();
        assert_eq!(
            error(&f),
            "digitalocean: --region is required for the digitalocean backend"
        );
        let mut f = ok.clone();
        f.image.clear();
        assert_eq!(
            error(&f),
            "digitalocean: --image is required for the digitalocean backend"
        );
        let mut f = ok.clone();
        f.bootstrap_endpoint.clear();
        assert_eq!(
            error(&f),
            "digitalocean: --bootstrap-endpoint is required so the on-host agent can reach the provider"
        );
        let mut f = ok.clone();
        f.bootstrap_endpoint = "http://bootstrap.example.com".into();
        assert!(error(&f).contains("must be an https:// URL"));
        let mut f = ok;
        f.api_url = "http://203.0.113.9".into();
        assert!(error(&f).contains("plain http is only allowed for loopback addresses"));
    }

    struct Chain {
        root: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
        intermediate: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
        leaf_pem: String,
        leaf_key: String,
    }

    fn ca_params(name: &str) -> rcgen::CertificateParams {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        params
    }

    /// root -> intermediate -> leaf for bootstrap.example.com.
    fn chain() -> Chain {
        let root = rcgen::CertifiedIssuer::self_signed(
            ca_params("root"),
            rcgen::KeyPair::generate().expect("key"),
        )
        .expect("root");
        let intermediate = rcgen::CertifiedIssuer::signed_by(
            ca_params("intermediate"),
            rcgen::KeyPair::generate().expect("key"),
            &root,
        )
        .expect("intermediate");
        let key = rcgen::KeyPair::generate().expect("key");
        let leaf = rcgen::CertificateParams::new(vec!["bootstrap.example.com".to_owned()])
            .expect("params")
            .signed_by(&key, &intermediate)
            .expect("leaf");
        Chain {
            root,
            intermediate,
            leaf_pem: leaf.pem(),
            leaf_key: key.serialize_pem(),
        }
    }

    fn pin_of(flags: &RealFlags) -> String {
        build_real(flags, Telemetry::new("bigfleet_digitalocean_setup_test")).expect("valid");
        agent_pin(flags)
            .and_then(|p| p.verified_for(&flags.bootstrap_endpoint))
            .expect("pin")
            .pem
    }

    fn pinned_cert_of(flags: &RealFlags) -> String {
        agent_pin(flags)
            .and_then(|p| p.verified_for(&flags.bootstrap_endpoint))
            .expect("pin")
            .pinned_cert_pem
    }

    #[test]
    fn without_bootstrap_ca_the_channel_certificate_and_its_key_are_pinned() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut flags = valid(dir.path());
        let leaf = std::fs::read_to_string(&flags.bootstrap_tls_cert).expect("cert");
        // A self-signed certificate followed by a CA bundle: only the first is pinned.
        let c = chain();
        let bundle = format!("{leaf}{}{}", c.intermediate.pem(), c.root.pem());
        flags.bootstrap_tls_cert = write(dir.path(), "bundle.pem", &bundle);
        assert_eq!(pin_of(&flags), leaf);
        assert_eq!(pinned_cert_of(&flags), leaf);

        // A CA-issued leaf is pinned exactly, on its own: neither the intermediate nor the
        // root of the file reaches the user_data.
        let mut f = flags.clone();
        f.bootstrap_tls_cert = write(
            dir.path(),
            "chain.pem",
            &format!("{}{}{}", c.leaf_pem, c.intermediate.pem(), c.root.pem()),
        );
        f.bootstrap_tls_key = write(dir.path(), "chain-key.pem", &c.leaf_key);
        assert_eq!(pin_of(&f), c.leaf_pem);
        assert_eq!(pinned_cert_of(&f), c.leaf_pem);
        // The same leaf served alone, without its chain, is as good.
        let mut alone = f.clone();
        alone.bootstrap_tls_cert = write(dir.path(), "leaf.pem", &c.leaf_pem);
        assert_eq!(pinned_cert_of(&alone), c.leaf_pem);
        // A pin no agent could use still fails startup: the name is checked.
        let mut g = f.clone();
        g.bootstrap_endpoint = "https://elsewhere.example.com".into();
        let e = error(&g);
        assert!(
            e.starts_with(
                "--bootstrap-ca is not set, so agents pin the public key of the channel's own certificate"
            ),
            "{e}"
        );
        assert!(e.contains("\"elsewhere.example.com\""), "{e}");
        // Naming the root as --bootstrap-ca pins exactly it, as a trust anchor.
        f.bootstrap_ca = write(dir.path(), "root.pem", &c.root.pem());
        assert_eq!(pin_of(&f), c.root.pem());
        assert_eq!(pinned_cert_of(&f), "");
    }

    #[test]
    fn an_expired_channel_certificate_fails_startup_without_bootstrap_ca() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut flags = valid(dir.path());
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::new(vec!["bootstrap.example.com".to_owned()])
            .expect("params");
        params.not_before = rcgen::date_time_ymd(2000, 1, 1);
        params.not_after = rcgen::date_time_ymd(2001, 1, 1);
        let c = chain();
        let leaf = params.signed_by(&key, &c.intermediate).expect("leaf");
        flags.bootstrap_tls_cert = write(dir.path(), "old.pem", &leaf.pem());
        flags.bootstrap_tls_key = write(dir.path(), "old-key.pem", &key.serialize_pem());
        let e = error(&flags);
        assert!(e.starts_with("--bootstrap-ca is not set"), "{e}");
        assert!(e.contains("expired"), "{e}");
    }

    #[test]
    fn bootstrap_ca_is_parsed_strictly_and_must_verify_the_channel() {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = chain();
        let mut flags = valid(dir.path());
        flags.bootstrap_tls_cert = write(
            dir.path(),
            "chain.pem",
            &format!("{}{}", c.leaf_pem, c.intermediate.pem()),
        );
        flags.bootstrap_tls_key = write(dir.path(), "chain-key.pem", &c.leaf_key);
        // One good block and one that does not decode.
        flags.bootstrap_ca = write(
            dir.path(),
            "bad-ca.pem",
            &format!(
                "{}-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n",
                c.root.pem()
            ),
        );
        let e = error(&flags);
        assert!(e.starts_with("read bootstrap CA: --bootstrap-ca /"), "{e}");
        assert!(e.contains("bad-ca.pem: PEM block 2 does not decode"), "{e}");
        // A CA that did not issue the channel's certificate.
        let other = rcgen::CertifiedIssuer::self_signed(
            ca_params("other"),
            rcgen::KeyPair::generate().expect("key"),
        )
        .expect("other");
        flags.bootstrap_ca = write(dir.path(), "other.pem", &other.pem());
        let e = error(&flags);
        assert!(
            e.starts_with("--bootstrap-ca: the channel certificate (--bootstrap-tls-cert /"),
            "{e}"
        );
        // A name the certificate does not carry.
        flags.bootstrap_ca = write(dir.path(), "root.pem", &c.root.pem());
        let mut f = flags.clone();
        f.bootstrap_endpoint = "https://elsewhere.example.com".into();
        assert!(
            error(&f).contains("\"elsewhere.example.com\""),
            "{}",
            error(&f)
        );
        // A combined file: only certificates reach the user_data, never the key.
        let key = rcgen::KeyPair::generate().expect("key").serialize_pem();
        flags.bootstrap_ca = write(
            dir.path(),
            "combined.pem",
            &format!("{key}{}", c.root.pem()),
        );
        let pin = pin_of(&flags);
        assert_eq!(pin, c.root.pem());
        assert!(!pin.contains("PRIVATE KEY"));
    }

    /// Captures the log lines of the current thread.
    #[derive(Clone, Default)]
    struct Logs(Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Logs {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("logs").extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
        type Writer = Logs;
        fn make_writer(&'a self) -> Logs {
            self.clone()
        }
    }

    fn logs_of(flags: &RealFlags) -> String {
        let logs = Logs::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(logs.clone())
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            build_real(flags, Telemetry::new("bigfleet_digitalocean_setup_test")).expect("valid");
        });
        String::from_utf8_lossy(&logs.0.lock().expect("logs")).into_owned()
    }

    #[test]
    fn a_short_bootstrap_secret_is_warned_about_without_showing_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut flags = valid(dir.path());
        flags.bootstrap_secret = Zeroizing::new("short-secret-31-bytes-long-xyz!".into());
        assert_eq!(flags.bootstrap_secret.len(), 31);
        let text = logs_of(&flags);
        assert!(text.contains("WARN"), "{text}");
        assert!(
            text.contains("--bootstrap-secret is shorter than 32 bytes")
                && text.contains("bytes=31"),
            "{text}"
        );
        assert!(!text.contains(flags.bootstrap_secret.as_str()), "{text}");
        flags.bootstrap_secret = Zeroizing::new("a-secret-of-exactly-32-bytes-ok!".into());
        assert_eq!(flags.bootstrap_secret.len(), 32);
        let text = logs_of(&flags);
        assert!(!text.contains("shorter than 32 bytes"), "{text}");
    }

    #[test]
    fn flags_never_print_secrets() {
        let flags = RealFlags {
            token: Zeroizing::new("dop_v1_x".into()),
            bootstrap_secret: Zeroizing::new("s3cret".into()),
            ..RealFlags::default()
        };
        let text = format!("{flags:?}");
        assert!(
            !text.contains("dop_v1_x") && !text.contains("s3cret"),
            "{text}"
        );
    }
}

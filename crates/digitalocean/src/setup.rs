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
use crate::channel::{AuthLimit, Channel, ChannelSettings, DEFAULT_POLL_HOLD};
use crate::cloud::{AgentProvisioning, CloudSettings, DigitalOceanCloud};
use crate::token::BootstrapSecret;

/// The flags of the real backend, as parsed (secrets already resolved from their env vars).
#[derive(Clone, Default)]
pub struct RealFlags {
    pub provider: String,
    pub token: String,
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
    pub bootstrap_secret: String,
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
}

/// Validates the flags in the reference's order and builds the channel and the cloud.
/// Nothing is bound or contacted.
pub fn build_real(flags: &RealFlags, telemetry: Telemetry) -> Result<RealBackend, String> {
    let secret = BootstrapSecret::new(flags.bootstrap_secret.clone()).ok_or(
        "the digitalocean backend requires --bootstrap-secret or BIGFLEET_BOOTSTRAP_SECRET: a \
         stable HMAC key minting per-machine agent tokens (a random per-process secret would \
         invalidate already-issued tokens on restart and break Configure for every live Droplet)",
    )?;
    if flags.bootstrap_addr.is_empty()
        || flags.bootstrap_tls_cert.is_empty()
        || flags.bootstrap_tls_key.is_empty()
    {
        return Err("the digitalocean backend requires --bootstrap-addr, --bootstrap-tls-cert and \
                    --bootstrap-tls-key (the bootstrap blob is a join secret and must travel over TLS)"
            .into());
    }
    let tls = load_channel_tls(&flags.bootstrap_tls_cert, &flags.bootstrap_tls_key)
        .map_err(|e| format!("load bootstrap TLS keypair: {e}"))?;
    telemetry.bootstrap_channel_signals(Path::new(&flags.bootstrap_tls_cert));
    let ca_path = if flags.bootstrap_ca.is_empty() {
        &flags.bootstrap_tls_cert
    } else {
        &flags.bootstrap_ca
    };
    let ca_pem = std::fs::read(ca_path)
        .map_err(|e| format!("read bootstrap CA: {ca_path}: {e}"))
        .map(|b| String::from_utf8_lossy(&b).into_owned())?;
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
    let api_url = if flags.api_url.is_empty() {
        crate::api::DEFAULT_API_URL
    } else {
        &flags.api_url
    };
    let base = parse_base_url(api_url)?;
    let api = ApiClient::new(base, token, Backoff::default(), telemetry)?;
    let channel = Channel::new(
        ChannelSettings {
            secret,
            tls,
            poll_hold: DEFAULT_POLL_HOLD,
            auth_limit: AuthLimit::default(),
        },
        telemetry,
    );
    let settings = CloudSettings::new(
        flags.provider.clone(),
        flags.region.clone(),
        ImageRef::parse(&flags.image),
        flags.base_user_data.clone(),
        AgentProvisioning {
            endpoint: flags.bootstrap_endpoint.clone(),
            ca_pem,
        },
    );
    let cloud = Arc::new(DigitalOceanCloud::new(
        api,
        channel.clone(),
        settings,
        telemetry,
    ));
    Ok(RealBackend {
        cloud,
        channel,
        bootstrap_addr: flags.bootstrap_addr.clone(),
    })
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
        let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
            .expect("params")
            .self_signed(&key)
            .expect("cert");
        RealFlags {
            provider: "digitalocean".into(),
            token: "dop_v1_x".into(),
            region: "nyc3".into(),
            image: "ubuntu-24-04-x64".into(),
            api_url: String::new(),
            base_user_data: None,
            bootstrap_addr: ":9443".into(),
            bootstrap_endpoint: "https://bootstrap.example.com:9443".into(),
            bootstrap_tls_cert: write(dir, "cert.pem", &cert.pem()),
            bootstrap_tls_key: write(dir, "key.pem", &key.serialize_pem()),
            bootstrap_ca: String::new(),
            bootstrap_secret: "s3cret".into(),
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
            error(&f).starts_with("read bootstrap CA: /"),
            "{}",
            error(&f)
        );
        let mut f = ok.clone();
        f.token = " '' ".into();
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

    #[test]
    fn flags_never_print_secrets() {
        let flags = RealFlags {
            token: "dop_v1_x".into(),
            bootstrap_secret: "s3cret".into(),
            ..RealFlags::default()
        };
        let text = format!("{flags:?}");
        assert!(
            !text.contains("dop_v1_x") && !text.contains("s3cret"),
            "{text}"
        );
    }
}

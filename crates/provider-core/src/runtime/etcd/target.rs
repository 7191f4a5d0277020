//! Where the etcd state lives and how to reach it: the `--state etcd://…` address, the
//! `--etcd-*` flags, and the gRPC channel to the members (mTLS when the flags ask for it).

use std::path::Path;
use std::time::{Duration, Instant};

use clap::Args;
use etcd_proto::etcdserverpb::kv_client::KvClient;
use etcd_proto::etcdserverpb::lease_client::LeaseClient;
use etcd_proto::etcdserverpb::watch_client::WatchClient;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use crate::observability::duration;

/// The scheme that selects the etcd store in `--state`.
pub const SCHEME: &str = "etcd://";

/// The port of an endpoint written without one.
const DEFAULT_PORT: u16 = 2379;

/// How long connecting to one member may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// How long one etcd request may take before it counts as failed (and is retried).
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(3);

/// The flags of the etcd store (used only when `--state` is an `etcd://` address).
#[derive(Args, Debug, Clone, PartialEq)]
pub struct EtcdArgs {
    /// CA bundle PEM that signs the etcd members' certificates; switches the etcd connection to TLS.
    #[arg(
        long = "etcd-ca",
        env = "BIGFLEET_ETCD_CA",
        default_value = "",
        value_name = "PATH"
    )]
    pub etcd_ca: String,

    /// Client certificate PEM for mTLS to etcd (with --etcd-key).
    #[arg(
        long = "etcd-cert",
        env = "BIGFLEET_ETCD_CERT",
        default_value = "",
        value_name = "PATH"
    )]
    pub etcd_cert: String,

    /// Client private key PEM for mTLS to etcd (with --etcd-cert).
    #[arg(
        long = "etcd-key",
        env = "BIGFLEET_ETCD_KEY",
        default_value = "",
        value_name = "PATH"
    )]
    pub etcd_key: String,

    /// TTL of the etcd lease that holds this provider's claim on the state prefix.
    #[arg(long = "etcd-lease-ttl", env = "BIGFLEET_ETCD_LEASE_TTL", default_value = "3s", value_parser = duration::flag, value_name = "DURATION")]
    pub etcd_lease_ttl: Duration,

    /// etcd's --max-request-bytes: the largest request the members accept. Raise both together.
    #[arg(
        long = "etcd-max-request-bytes",
        env = "BIGFLEET_ETCD_MAX_REQUEST_BYTES",
        default_value_t = DEFAULT_MAX_REQUEST_BYTES,
        value_name = "BYTES"
    )]
    pub etcd_max_request_bytes: usize,
}

/// etcd's own default `--max-request-bytes` (1.5 MiB).
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 1_572_864;

/// The smallest `--etcd-max-request-bytes` accepted: room for a transaction's fixed part with
/// ids at their limits, and a machine record of a useful size.
const MIN_MAX_REQUEST_BYTES: usize = 64 * 1024;

impl Default for EtcdArgs {
    fn default() -> EtcdArgs {
        EtcdArgs {
            etcd_ca: String::new(),
            etcd_cert: String::new(),
            etcd_key: String::new(),
            etcd_lease_ttl: Duration::from_secs(3),
            etcd_max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
        }
    }
}

impl EtcdArgs {
    /// Checks the flags that clap cannot: a whole keypair and a TTL etcd can grant.
    pub fn validate(&self) -> Result<(), String> {
        if self.etcd_cert.is_empty() != self.etcd_key.is_empty() {
            return Err(
                "--etcd-cert and --etcd-key must be given together (a client certificate and its key)"
                    .into(),
            );
        }
        if !self.etcd_cert.is_empty() && self.etcd_ca.is_empty() {
            return Err(
                "--etcd-cert/--etcd-key need --etcd-ca (mTLS to etcd verifies the members too)"
                    .into(),
            );
        }
        if self.etcd_lease_ttl < Duration::from_secs(1) {
            return Err(format!(
                "--etcd-lease-ttl must be at least 1s (etcd grants whole seconds), got {}",
                duration::format(self.etcd_lease_ttl)
            ));
        }
        if self.etcd_max_request_bytes < MIN_MAX_REQUEST_BYTES {
            return Err(format!(
                "--etcd-max-request-bytes must be at least {MIN_MAX_REQUEST_BYTES} (and match etcd's \
                 --max-request-bytes, 1572864 by default), got {}",
                self.etcd_max_request_bytes
            ));
        }
        Ok(())
    }

    /// The lease TTL in whole seconds (rounded up).
    pub(crate) fn ttl_seconds(&self) -> i64 {
        let ms = self.etcd_lease_ttl.as_millis();
        i64::try_from(ms.div_ceil(1000)).unwrap_or(i64::MAX).max(1)
    }
}

/// A parsed `etcd://host:port,host:port/PREFIX`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Target {
    /// `host:port` of every member.
    pub endpoints: Vec<String>,
    /// The key prefix, without a trailing `/` (every key is `PREFIX/…`).
    pub prefix: String,
}

impl Target {
    /// The address as the operator wrote it, for messages.
    pub fn describe(&self) -> String {
        format!("{SCHEME}{}{}", self.endpoints.join(","), self.prefix)
    }
}

/// Whether `--state` names the etcd store.
pub fn is_etcd(state: &str) -> bool {
    state.starts_with(SCHEME)
}

/// Parses `etcd://host:port[,host:port…]/PREFIX`.
pub(crate) fn parse(state: &str) -> Result<Target, String> {
    let bad = |why: &str| {
        format!("--state {state}: {why} (expected etcd://HOST:PORT[,HOST:PORT…]/PREFIX)")
    };
    let rest = state
        .strip_prefix(SCHEME)
        .ok_or_else(|| bad("not an etcd:// address"))?;
    let (hosts, prefix) = match rest.find('/') {
        Some(at) => (&rest[..at], &rest[at..]),
        None => (rest, ""),
    };
    let prefix = prefix.trim_end_matches('/');
    if prefix.is_empty() {
        return Err(bad(
            "a key prefix is required, so that two providers never share keys",
        ));
    }
    if prefix.contains("//") {
        return Err(bad("the key prefix contains an empty path segment"));
    }
    let mut endpoints = Vec::new();
    for host in hosts.split(',') {
        let host = host.trim();
        if host.is_empty() {
            return Err(bad("an endpoint is empty"));
        }
        if host.contains('@') || host.contains('?') || host.contains('#') {
            return Err(bad(&format!("endpoint {host:?} is not HOST:PORT")));
        }
        let has_port = match host.rfind(':') {
            // `[::1]` alone has its colons inside the brackets.
            Some(at) => !host[at..].contains(']'),
            None => false,
        };
        let endpoint = if has_port {
            let (_, port) = host.rsplit_once(':').unwrap_or((host, ""));
            port.parse::<u16>()
                .ok()
                .filter(|p| *p > 0)
                .ok_or_else(|| bad(&format!("endpoint {host:?} has an invalid port")))?;
            host.to_owned()
        } else {
            format!("{host}:{DEFAULT_PORT}")
        };
        endpoints.push(endpoint);
    }
    Ok(Target {
        endpoints,
        prefix: prefix.to_owned(),
    })
}

/// The clients of one member.
#[derive(Clone, Debug)]
struct MemberClients {
    kv: KvClient<Channel>,
    lease: LeaseClient<Channel>,
    watch: WatchClient<Channel>,
}

/// Connections to every member of the etcd cluster (cheap to clone). Requests go to one member
/// until a request to it fails in a way a retry may cure; then the next member is used. (A
/// balancing channel keeps choosing a member that is down: it fails fastest, so it looks least
/// loaded.)
#[derive(Clone, Debug)]
pub(crate) struct Client {
    members: std::sync::Arc<Vec<MemberClients>>,
    current: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// What each member did with its last request (see [`Client::quorum_refused`]).
    heard: std::sync::Arc<Vec<LastHeard>>,
}

/// What a member did with the last request sent to it, and when.
type LastHeard = std::sync::Mutex<Option<(Heard, Instant)>>;

/// How a member answered the last request sent to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Heard {
    /// It answered (whatever the answer said).
    Answered,
    /// Its address actively refused: connection refused or reset. Nothing listens there, so it
    /// serves nobody.
    Refused,
    /// Silence: a timeout, a dropped stream, an error that says nothing about the others.
    Silent,
}

/// How long what a member did counts as evidence.
const HEARD_FOR: Duration = Duration::from_secs(10);

/// Whether a failed request was actively refused by the member's address (connection refused or
/// reset), as opposed to silence (a timeout, which is what a partition looks like).
pub(crate) fn refused(status: &tonic::Status) -> bool {
    use std::error::Error as _;
    let said = |text: &str| {
        let text = text.to_ascii_lowercase();
        text.contains("connection refused") || text.contains("connection reset")
    };
    if said(status.message()) {
        return true;
    }
    let mut source = status.source();
    while let Some(error) = source {
        if let Some(io) = error.downcast_ref::<std::io::Error>()
            && matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::ConnectionReset
            )
        {
            return true;
        }
        if said(&error.to_string()) {
            return true;
        }
        source = error.source();
    }
    false
}

impl Client {
    /// The member requests go to now.
    pub fn at(&self) -> usize {
        self.current.load(std::sync::atomic::Ordering::SeqCst) % self.members.len()
    }

    pub fn kv(&self) -> KvClient<Channel> {
        self.members[self.at()].kv.clone()
    }

    pub fn lease(&self) -> LeaseClient<Channel> {
        self.members[self.at()].lease.clone()
    }

    pub fn watch(&self) -> WatchClient<Channel> {
        self.members[self.at()].watch.clone()
    }

    /// Member `at` answered a request.
    pub fn answered(&self, at: usize) {
        self.hear(at, Heard::Answered);
    }

    /// A request to member `at` failed with `status`: remembers whether it was refused, and
    /// moves on to the next member.
    pub fn failed_with(&self, at: usize, status: &tonic::Status) {
        self.hear(
            at,
            if refused(status) {
                Heard::Refused
            } else {
                Heard::Silent
            },
        );
        self.next_after(at);
    }

    fn hear(&self, at: usize, heard: Heard) {
        if let Some(slot) = self.heard.get(at) {
            *slot
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some((heard, Instant::now()));
        }
    }

    /// Positive evidence that no etcd quorum exists for anyone: a majority of the configured
    /// members actively refused this process's last request to them (connection refused or
    /// reset) within the last few seconds, and none of those answered since. Silence (timeouts)
    /// is no evidence: a partition looks like that while the other side has a quorum.
    pub fn quorum_refused(&self) -> bool {
        let refusing = self
            .heard
            .iter()
            .filter(|slot| {
                matches!(
                    *slot.lock().unwrap_or_else(std::sync::PoisonError::into_inner),
                    Some((Heard::Refused, at)) if at.elapsed() < HEARD_FOR
                )
            })
            .count();
        refusing > self.members.len() / 2
    }

    /// A request to member `at` went unanswered (a timeout, a stream that ended): move on to
    /// the next one.
    pub fn failed(&self, at: usize) {
        self.hear(at, Heard::Silent);
        self.next_after(at);
    }

    /// Moves on from member `at` to the next one (unless another request already did).
    fn next_after(&self, at: usize) {
        let next = (at + 1) % self.members.len();
        let _ = self.current.compare_exchange(
            at,
            next,
            std::sync::atomic::Ordering::SeqCst,
            std::sync::atomic::Ordering::SeqCst,
        );
    }
}

fn read_file(flag: &str, path: &str) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("{flag} {path}: {e}"))
}

/// The TLS settings the flags ask for, checked now (a bad file fails startup naming the flag).
fn tls(args: &EtcdArgs) -> Result<Option<ClientTlsConfig>, String> {
    if args.etcd_ca.is_empty() {
        return Ok(None);
    }
    let ca = read_file("--etcd-ca", &args.etcd_ca)?;
    crate::security::tls::parse_certificates(&ca)
        .map_err(|e| format!("--etcd-ca {}: {e}", args.etcd_ca))?;
    let mut config = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca));
    if !args.etcd_cert.is_empty() {
        let cert = read_file("--etcd-cert", &args.etcd_cert)?;
        crate::security::tls::parse_certificates(&cert)
            .map_err(|e| format!("--etcd-cert {}: {e}", args.etcd_cert))?;
        crate::security::tls::read_private_key(Path::new(&args.etcd_key))
            .map_err(|e| format!("--etcd-key: {e}"))?;
        let key = read_file("--etcd-key", &args.etcd_key)?;
        config = config.identity(Identity::from_pem(cert, key));
    }
    Ok(Some(config))
}

/// A lazily connected channel to every member, starting at a random one (replicas spread their
/// load), so a member that is down is skipped rather than failing the whole client.
pub(crate) fn connect(target: &Target, args: &EtcdArgs) -> Result<Client, String> {
    let tls = tls(args)?;
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut endpoints = Vec::with_capacity(target.endpoints.len());
    for host in &target.endpoints {
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://{host}"))
            .map_err(|e| format!("--state {}: endpoint {host}: {e}", target.describe()))?
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(REQUEST_TIMEOUT)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_timeout(Duration::from_secs(5));
        if let Some(tls) = &tls {
            endpoint = endpoint
                .tls_config(tls.clone())
                .map_err(|e| format!("etcd TLS for {host}: {e}"))?;
        }
        endpoints.push(endpoint);
    }
    let members: Vec<MemberClients> = endpoints
        .into_iter()
        .map(|endpoint| {
            let channel = endpoint.connect_lazy();
            MemberClients {
                kv: KvClient::new(channel.clone()).max_decoding_message_size(64 << 20),
                lease: LeaseClient::new(channel.clone()),
                watch: WatchClient::new(channel).max_decoding_message_size(64 << 20),
            }
        })
        .collect();
    let start = rand::random::<u32>() as usize % members.len();
    let heard = members
        .iter()
        .map(|_| std::sync::Mutex::new(None))
        .collect();
    Ok(Client {
        heard: std::sync::Arc::new(heard),
        members: std::sync::Arc::new(members),
        current: std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(start)),
    })
}

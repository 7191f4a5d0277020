//! The HTTPS bootstrap channel between the provider and the on-host agents
//! (digitalocean.md §8, beyond.md §6/§8).
//!
//! A transition hands a command for one machine to [`Channel::deliver`], which waits for the
//! agent's ack. Agents long-poll `GET /v1/command` (the request is held until a command is
//! pending or the hold time passes) and answer with `POST /v1/ack`, echoing the command id.
//! Every request carries the machine's bearer token, re-derived and compared in constant time.
//! The token is checked first: a valid token is always served, and only failed authentications
//! are rate limited, per (source address, claimed machine id), so one misbehaving client behind
//! a shared egress address never locks out the other agents behind it. Only TLS 1.3 is spoken.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::hash::BuildHasher as _;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use provider_core::backend::TransitionContext;
use provider_core::telemetry::Telemetry;
use rand::Rng;
use rustls::ServerConfig;
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use zeroize::{Zeroize as _, Zeroizing};

use crate::enrollment::{
    Book, BookError, DropletDirectory, DropletSighting, EnrollmentSource, parse_enroll,
};
use crate::token::{
    AgentToken, BootstrapSecret, UserDataToken, credential_digest, credential_matches,
};
use provider_core::inventory::EnrollVerdict;
use provider_core::records::Enrollment;

/// How long `GET /v1/command` is held when nothing is pending.
pub const DEFAULT_POLL_HOLD: Duration = Duration::from_secs(25);
/// Most (source address, machine id) pairs whose failures are remembered. The table is full
/// only under a flood of failing sources; the oldest entry then makes room in O(1).
pub const FAILURE_TABLE_CAP: usize = 65_536;
/// How often a connection of a replica that does not serve checks whether it may close.
const NOT_SERVING_CHECK: Duration = Duration::from_millis(100);
/// How long such a connection waits for a first request to answer (503) before it closes.
const NOT_SERVING_FIRST_REQUEST: Duration = Duration::from_secs(1);
/// Longest operation id that appears verbatim in a command id (longer ones are digested).
const MAX_VERBATIM_OPERATION_ID: usize = 128;
/// How often a Configure waiting for its agent's enrollment looks again.
const ENROLLMENT_CHECK: Duration = Duration::from_millis(100);
/// How long shutdown waits for open connections.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Failed-authentication throttling per (source address, claimed machine id): a token bucket of
/// `burst` failures, refilled by one every `refill_every`. While a bucket is empty, every
/// request with a wrong token for that pair is answered 429, so guessing one machine's token
/// stays slow. A request with the right token is never throttled.
#[derive(Clone, Copy, Debug)]
pub struct AuthLimit {
    pub burst: u32,
    pub refill_every: Duration,
}

impl Default for AuthLimit {
    fn default() -> AuthLimit {
        AuthLimit {
            burst: 10,
            refill_every: Duration::from_secs(6),
        }
    }
}

/// Resource limits of the channel's listener. Every agent holds one connection with at most one
/// request in flight (its poll, or an ack), so the defaults leave ample room for large fleets
/// behind one NAT address while a single misbehaving source cannot exhaust the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChannelLimits {
    /// Open connections in all; a connection over the cap is closed right after accept.
    pub max_connections: usize,
    /// Open connections from one source address.
    pub max_connections_per_address: usize,
    /// Time for the TLS handshake, and (HTTP/1) for the headers of a request (slowloris).
    pub header_timeout: Duration,
    /// A connection with no request in flight for this long is closed.
    pub idle_timeout: Duration,
    /// HTTP/2: a PING is sent after this much silence...
    pub keepalive_interval: Duration,
    /// ...and the connection closed if it is not answered within this.
    pub keepalive_timeout: Duration,
    /// HTTP/2: concurrent streams per connection.
    pub max_streams: u32,
    /// Largest accepted request body (an ack); larger ones get 413.
    pub max_body_bytes: usize,
    /// Time to receive a request body; slower ones get 408.
    pub body_timeout: Duration,
}

impl Default for ChannelLimits {
    fn default() -> ChannelLimits {
        ChannelLimits {
            max_connections: 8192,
            max_connections_per_address: 1024,
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(120),
            keepalive_interval: Duration::from_secs(30),
            keepalive_timeout: Duration::from_secs(20),
            max_streams: 16,
            max_body_bytes: 64 * 1024,
            body_timeout: Duration::from_secs(10),
        }
    }
}

/// Open connections, in all and per source address.
#[derive(Default)]
struct Connections {
    total: usize,
    per_address: HashMap<IpAddr, usize>,
}

/// One admitted connection; releases its place when dropped.
struct ConnectionSlot {
    channel: Channel,
    peer: IpAddr,
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        let mut open = lock(&self.channel.inner.connections);
        open.total = open.total.saturating_sub(1);
        if let Some(n) = open.per_address.get_mut(&self.peer) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.per_address.remove(&self.peer);
            }
        }
    }
}

/// Requests in flight on one connection and when the last one ended, for the idle timeout.
struct Activity {
    in_flight: usize,
    last: Instant,
    /// Requests answered on this connection.
    answered: u64,
}

/// What the channel needs besides its listener.
#[derive(Clone)]
pub struct ChannelSettings {
    pub secret: BootstrapSecret,
    pub tls: Arc<ServerConfig>,
    pub poll_hold: Duration,
    pub auth_limit: AuthLimit,
}

impl std::fmt::Debug for ChannelSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChannelSettings")
            .field("poll_hold", &self.poll_hold)
            .field("auth_limit", &self.auth_limit)
            .finish_non_exhaustive()
    }
}

/// A command for one machine's agent.
#[derive(Clone)]
pub enum Command {
    /// Write the blob and run the bootstrap hook for `cluster_id`.
    Configure { cluster_id: String, blob: Vec<u8> },
    /// Report whether the node is Ready in `cluster_id` (the readiness gate).
    Ready { cluster_id: String },
    /// Cordon and drain the node within `grace_seconds` (at least 1).
    Drain { grace_seconds: i64 },
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Command::Configure { cluster_id, blob } => f
                .debug_struct("Configure")
                .field("cluster_id", cluster_id)
                .field("blob", &format_args!("[redacted; {} bytes]", blob.len()))
                .finish(),
            Command::Ready { cluster_id } => f
                .debug_struct("Ready")
                .field("cluster_id", cluster_id)
                .finish(),
            Command::Drain { grace_seconds } => f
                .debug_struct("Drain")
                .field("grace_seconds", grace_seconds)
                .finish(),
        }
    }
}

impl Drop for Command {
    /// The blob is a join secret: zeroed when the command is dropped.
    fn drop(&mut self) {
        if let Command::Configure { blob, .. } = self {
            blob.zeroize();
        }
    }
}

impl Command {
    pub fn kind(&self) -> &'static str {
        match self {
            Command::Configure { .. } => "configure",
            Command::Ready { .. } => "ready",
            Command::Drain { .. } => "drain",
        }
    }

    /// The wire form: compact JSON with keys `id`, `type`, `cluster_id`, `blob`,
    /// `grace_seconds`, `run_key` in that order, empty ones omitted, and a trailing newline.
    fn to_wire(&self, id: &str, run_key: &str) -> Zeroizing<Vec<u8>> {
        #[derive(Serialize)]
        struct Wire<'a> {
            id: &'a str,
            #[serde(rename = "type")]
            kind: &'a str,
            #[serde(skip_serializing_if = "str::is_empty")]
            cluster_id: &'a str,
            #[serde(skip_serializing_if = "str::is_empty")]
            blob: &'a str,
            #[serde(skip_serializing_if = "is_zero")]
            grace_seconds: i64,
            #[serde(skip_serializing_if = "str::is_empty")]
            run_key: &'a str,
        }
        fn is_zero(n: &i64) -> bool {
            *n == 0
        }
        let encoded = Zeroizing::new(match self {
            Command::Configure { blob, .. } => STANDARD.encode(blob),
            _ => String::new(),
        });
        let (cluster_id, grace_seconds) = match self {
            Command::Configure { cluster_id, .. } | Command::Ready { cluster_id } => {
                (cluster_id.as_str(), 0)
            }
            Command::Drain { grace_seconds } => ("", *grace_seconds),
        };
        let wire = Wire {
            id,
            kind: self.kind(),
            cluster_id,
            blob: &encoded,
            grace_seconds,
            run_key,
        };
        let mut body = Zeroizing::new(serde_json::to_vec(&wire).unwrap_or_default());
        body.push(b'\n');
        body
    }
}

/// Why a delivery did not succeed. The text becomes the machine's `last_error`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct DeliveryError(pub String);

/// How a delivery ended, as its waiter learns it.
enum Outcome {
    Applied,
    AgentFailed(String),
    Superseded,
    /// A second enrollment with the machine's spent token: the command is withdrawn.
    Conflict,
}

struct Pending {
    id: String,
    /// Which delivery queued it: two deliveries may share an id (a transition resumed while
    /// its earlier delivery still waits), and only the one that queued it may withdraw it.
    delivery: u64,
    /// The wire form, blob included: zeroed when the command is acked, superseded or dropped.
    /// Each response gets its own copy, which leaves with the response.
    body: Zeroizing<Vec<u8>>,
    /// Whether it carries a secret (a Configure's blob): served only to an enrolled agent.
    secret: bool,
    waiter: oneshot::Sender<Outcome>,
}

#[derive(Default)]
struct MachineSlot {
    pending: Option<Pending>,
    notify: Arc<Notify>,
}

struct Bucket {
    tokens: f64,
    updated: Instant,
}

/// The failure buckets, keyed by a keyed hash of (source address, claimed machine id) so every
/// entry has the same small size whatever the client sent. Insertion order is kept beside the
/// map: when the table is at its cap, the oldest entry is evicted in O(1). A collision of two
/// pairs only makes them share a bucket, which can never refuse a valid token.
struct FailureTable {
    hasher: std::hash::RandomState,
    buckets: HashMap<u64, Bucket>,
    order: VecDeque<u64>,
    cap: usize,
}

impl FailureTable {
    fn new(cap: usize) -> FailureTable {
        FailureTable {
            hasher: std::hash::RandomState::new(),
            buckets: HashMap::new(),
            order: VecDeque::new(),
            cap: cap.max(1),
        }
    }

    fn key(&self, peer: IpAddr, machine_id: &str) -> u64 {
        self.hasher.hash_one((peer, machine_id))
    }

    /// How long until the pair may fail again, if its bucket is empty.
    fn throttled(&mut self, key: u64, limit: AuthLimit) -> Option<Duration> {
        let bucket = self.buckets.get_mut(&key)?;
        refill(bucket, limit);
        (bucket.tokens < 1.0).then(|| limit.refill_every.mul_f64(1.0 - bucket.tokens))
    }

    fn record_failure(&mut self, key: u64, limit: AuthLimit) {
        if !self.buckets.contains_key(&key) {
            // Every key is in `order` exactly once while it is in `buckets`: entries leave
            // only here, so the front is always the oldest live entry.
            while self.buckets.len() >= self.cap {
                let Some(oldest) = self.order.pop_front() else {
                    break;
                };
                self.buckets.remove(&oldest);
            }
            self.buckets.insert(
                key,
                Bucket {
                    tokens: f64::from(limit.burst),
                    updated: Instant::now(),
                },
            );
            self.order.push_back(key);
        }
        if let Some(bucket) = self.buckets.get_mut(&key) {
            refill(bucket, limit);
            bucket.tokens = (bucket.tokens - 1.0).max(0.0);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.buckets.len()
    }

    #[cfg(test)]
    /// Heap bytes held by the table (allocated capacity, not just live entries).
    fn heap_bytes(&self) -> usize {
        // hashbrown stores one control byte per bucket beside each (key, value) pair.
        self.buckets.capacity() * (std::mem::size_of::<(u64, Bucket)>() + 1)
            + self.order.capacity() * std::mem::size_of::<u64>()
    }
}

/// What the channel decided about a request's credentials.
#[derive(Debug, PartialEq)]
enum Admission {
    /// The machine's enrolled credential (`enrolled`), or, for a machine that has not
    /// enrolled, its user_data token (`per_slot` when it is the older per-slot token, which
    /// speaks only for a Droplet created without an enrollment token: checked with the cloud
    /// before the request is served).
    Machine {
        machine_id: String,
        enrolled: bool,
        per_slot: bool,
    },
    /// The replica cannot read its state now (it stopped serving mid-request).
    NotServing,
    Unauthorized,
    /// Wrong token, and this (source, machine id) pair has failed too often: retry after this.
    Throttled(Duration),
}

/// What a request's bearer token proved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Bearer {
    /// The machine's enrolled credential.
    Enrolled,
    /// The one-time enrollment token of the machine's Create.
    EnrollmentToken,
    /// The older per-slot token.
    PerSlot,
}

struct Inner {
    secret: BootstrapSecret,
    tls: Arc<ServerConfig>,
    poll_hold: Duration,
    auth_limit: AuthLimit,
    telemetry: Telemetry,
    /// Random per process: the prefix of the ids of commands delivered outside a transition
    /// (no operation id), so those never repeat across restarts.
    id_prefix: String,
    /// Numbers deliveries, and the ids of commands outside a transition.
    counter: AtomicU64,
    machines: Mutex<HashMap<String, MachineSlot>>,
    failures: Mutex<FailureTable>,
    limits: ChannelLimits,
    connections: Mutex<Connections>,
    /// Set by a replicated provider: requests are answered only while this replica serves.
    leading: std::sync::OnceLock<provider_core::replica::Leading>,
    /// Enrollments in the provider's state, once [`Channel::serve_while`] attached it.
    state_book: std::sync::OnceLock<Book>,
    /// Enrollments of a channel with no provider state around it (tests, fuzzing).
    memory_book: Book,
    /// Where an enrollment's Droplet and its addresses are looked up (the cloud).
    directory: std::sync::OnceLock<Arc<dyn DropletDirectory>>,
    /// `--bootstrap-enrollment-source`.
    enrollment_source: std::sync::OnceLock<EnrollmentSource>,
    /// Per machine: its recorded Droplet as the cloud showed it, and whether that Droplet was
    /// created without an enrollment token (a per-slot token may speak for it). A Droplet's
    /// tags at create do not change, so one look-up per Droplet serves every poll of an older
    /// agent.
    per_slot_droplets: Mutex<HashMap<String, (String, bool)>>,
}

/// The bootstrap channel: shared by the HTTPS server and the transitions that deliver commands.
#[derive(Clone)]
pub struct Channel {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channel")
            .field("id_prefix", &self.inner.id_prefix)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Channel {
    pub fn new(settings: ChannelSettings, telemetry: Telemetry) -> Channel {
        Channel::with_limits(settings, ChannelLimits::default(), telemetry)
    }

    /// A channel with the given listener limits.
    pub fn with_limits(
        settings: ChannelSettings,
        limits: ChannelLimits,
        telemetry: Telemetry,
    ) -> Channel {
        let mut prefix = [0u8; 6];
        rand::rng().fill_bytes(&mut prefix);
        Channel {
            inner: Arc::new(Inner {
                secret: settings.secret,
                tls: settings.tls,
                poll_hold: settings.poll_hold,
                auth_limit: settings.auth_limit,
                telemetry,
                id_prefix: prefix.iter().map(|b| format!("{b:02x}")).collect(),
                counter: AtomicU64::new(0),
                machines: Mutex::new(HashMap::new()),
                failures: Mutex::new(FailureTable::new(FAILURE_TABLE_CAP)),
                limits,
                connections: Mutex::new(Connections::default()),
                leading: std::sync::OnceLock::new(),
                state_book: std::sync::OnceLock::new(),
                memory_book: Book::Memory(Mutex::default()),
                directory: std::sync::OnceLock::new(),
                enrollment_source: std::sync::OnceLock::new(),
                per_slot_droplets: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// Sets `--bootstrap-enrollment-source` (once; `droplet` until then).
    pub fn set_enrollment_source(&self, source: EnrollmentSource) {
        let _ = self.inner.enrollment_source.set(source);
    }

    fn enrollment_source(&self) -> EnrollmentSource {
        self.inner
            .enrollment_source
            .get()
            .copied()
            .unwrap_or_default()
    }

    /// Where enrollments look up a machine's Droplet and its addresses (set by the cloud).
    pub fn attach_directory(&self, directory: Arc<dyn DropletDirectory>) {
        let _ = self.inner.directory.set(directory);
    }

    /// Takes the enrollments `other` holds in memory, as a provider that restarts or takes
    /// over reads them from the state (channels without provider state: tests, fuzzing).
    pub fn adopt_enrollments(&self, other: &Channel) {
        self.inner.memory_book.adopt(&other.inner.memory_book);
    }

    fn book(&self) -> &Book {
        self.inner
            .state_book
            .get()
            .unwrap_or(&self.inner.memory_book)
    }

    /// The one-time token written into the user_data of the Droplet the Create
    /// `create_operation` makes for `machine_id`.
    pub fn enrollment_token_for(&self, machine_id: &str, create_operation: &str) -> AgentToken {
        self.inner
            .secret
            .enrollment_token_for(machine_id, create_operation)
    }

    /// Waits until the agent of `machine_id` enrolled (or its enrollment is in conflict, which
    /// the delivery then reports), until `until` or cancellation; returns whether it did.
    pub async fn wait_enrolled(
        &self,
        machine_id: &str,
        until: Instant,
        cancel: &CancellationToken,
    ) -> bool {
        loop {
            if self.enrollment_status(machine_id).is_some_and(|(e, _)| e) {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            let step = until
                .saturating_duration_since(Instant::now())
                .min(ENROLLMENT_CHECK);
            tokio::select! {
                () = tokio::time::sleep(step) => {}
                () = cancel.cancelled() => return false,
            }
        }
    }

    /// Whether the agent of `machine_id` enrolled, and whether its enrollment is in conflict.
    pub fn enrollment_status(&self, machine_id: &str) -> Option<(bool, bool)> {
        let view = self.book().view(machine_id).ok()?;
        Some(match view.enrollment {
            Some(e) => (true, e.conflict),
            None => (false, false),
        })
    }

    /// The bearer token the agent of `machine_id` must present.
    pub fn token_for(&self, machine_id: &str) -> AgentToken {
        self.inner.secret.token_for(machine_id)
    }

    /// The id under which `command` for `machine_id` is delivered in the transition
    /// `operation_id`, and which its ack echoes. It is derived from the transition, never from
    /// this process, so a transition resumed by another process or replica (same operation id,
    /// same secret) delivers the same id again, and an agent that predates run keys
    /// ([`Channel::run_key`]) answers it from its record instead of running it twice:
    ///
    /// - `<op>.configure.<fingerprint>`, the fingerprint a keyed digest (the bootstrap secret)
    ///   of the machine id, the cluster id and the blob: a resumed Configure carries the same
    ///   ones, and an operation id that ever came round again (a provider whose state was
    ///   wiped) with another cluster or blob still gets a new id, so its hook runs;
    /// - `<op>.ready` and `<op>.drain` (a resumed Drain has lost its grace period, so nothing
    ///   of its content may enter the id).
    ///
    /// `<op>` is the operation id verbatim when it is 1 to 128 characters of `A-Z a-z 0-9 _ :
    /// -` (the core's ids are `op-<n>`), else `x.<keyed digest of it>`; verbatim ones hold no
    /// dot, so no two forms meet. Operation ids never repeat within a provider's state, and
    /// every command of a transition has its own kind, so ids never repeat across
    /// transitions; the agent's record is per machine, so ids of different machines cannot
    /// meet either. Without an operation id the id is `<random per-process prefix>-<n>`,
    /// the older form, which never repeats and holds no dot.
    ///
    /// The fingerprint changes with `--bootstrap-secret`, and an operation id comes round
    /// again after a state was lost: what the agent records a Configure's run under is its run
    /// key instead.
    pub(crate) fn command_id(
        &self,
        machine_id: &str,
        command: &Command,
        operation_id: &str,
    ) -> String {
        if operation_id.is_empty() {
            return format!(
                "{}-{}",
                self.inner.id_prefix,
                self.inner.counter.fetch_add(1, Ordering::Relaxed) + 1
            );
        }
        let op = self.operation_part(operation_id);
        match command {
            Command::Configure { cluster_id, blob } => {
                let digest = self.inner.secret.fingerprint(&[
                    b"configure",
                    machine_id.as_bytes(),
                    cluster_id.as_bytes(),
                    blob,
                ]);
                format!("{op}.configure.{}", hex(digest))
            }
            Command::Ready { .. } | Command::Drain { .. } => format!("{op}.{}", command.kind()),
        }
    }

    /// The key under which the agent records the run of a Configure (sent beside its id):
    /// `<op>.configure.<nonce>`, `<op>` as in [`Channel::command_id`] and the nonce the
    /// Configure's [`TransitionContext::configure_nonce`]. It holds nothing that changes when
    /// the Configure is resumed (by a restart, a takeover, a new `--bootstrap-secret`) and
    /// nothing that two Configures share, not even two under one operation id after a state
    /// was lost. Empty (no run key sent) for other commands and without a nonce.
    pub(crate) fn run_key(&self, command: &Command, ctx: &TransitionContext) -> String {
        match (command, &ctx.configure_nonce) {
            (Command::Configure { .. }, Some(nonce)) if !ctx.operation_id.is_empty() => {
                format!(
                    "{}.configure.{nonce}",
                    self.operation_part(&ctx.operation_id)
                )
            }
            _ => String::new(),
        }
    }

    /// An operation id as command ids and run keys show it: verbatim when it is 1 to 128
    /// characters of `A-Z a-z 0-9 _ : -`, else `x.<keyed digest of it>`.
    fn operation_part(&self, operation_id: &str) -> String {
        let verbatim = operation_id.len() <= MAX_VERBATIM_OPERATION_ID
            && operation_id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b':' | b'-'));
        if verbatim {
            return operation_id.to_owned();
        }
        let digest = self
            .inner
            .secret
            .fingerprint(&[b"operation", operation_id.as_bytes()]);
        format!("x.{}", hex(digest))
    }

    /// Makes `command` the pending command of `machine_id` and waits until the agent acks it,
    /// the transition's deadline passes or it is cancelled. A newer delivery for the same
    /// machine supersedes this one. The command id comes from the transition's operation id
    /// (`command_id`), so a resumed transition delivers the same id from any process, and an
    /// ack for it is accepted whichever process delivered it first.
    pub async fn deliver(
        &self,
        machine_id: &str,
        command: Command,
        ctx: &TransitionContext,
    ) -> Result<(), DeliveryError> {
        let kind = command.kind();
        let secret = matches!(command, Command::Configure { .. });
        if self
            .enrollment_status(machine_id)
            .is_some_and(|(_, conflict)| conflict)
        {
            self.inner.telemetry.bootstrap_command(kind, "conflict");
            return Err(DeliveryError(conflict_error(kind, machine_id)));
        }
        let id = self.command_id(machine_id, &command, &ctx.operation_id);
        let run_key = self.run_key(&command, ctx);
        let delivery = self.inner.counter.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        {
            let mut machines = lock(&self.inner.machines);
            let slot = machines.entry(machine_id.to_owned()).or_default();
            let previous = slot.pending.replace(Pending {
                id: id.clone(),
                delivery,
                body: command.to_wire(&id, &run_key),
                secret,
                waiter: tx,
            });
            if let Some(previous) = previous {
                let _ = previous.waiter.send(Outcome::Superseded);
            }
            slot.notify.notify_waiters();
        }
        tracing::info!(machine_id, command_id = %id, run_key, command = kind, "bootstrap command queued");
        // Removes the command if this wait ends for any reason other than its ack.
        let guard = PendingGuard {
            channel: self,
            machine_id,
            delivery,
        };
        let outcome = tokio::select! {
            r = rx => Ok(r.unwrap_or(Outcome::Superseded)),
            () = tokio::time::sleep_until(ctx.deadline) => Err("context deadline exceeded"),
            () = ctx.cancel.cancelled() => Err("context canceled"),
        };
        drop(guard);
        let telemetry = &self.inner.telemetry;
        let (outcome, result) = match outcome {
            Ok(Outcome::Applied) => {
                tracing::info!(machine_id, command_id = %id, command = kind, "agent applied command");
                ("ok", Ok(()))
            }
            Ok(Outcome::AgentFailed(detail)) => {
                tracing::warn!(machine_id, command_id = %id, command = kind, error = %detail, "agent reported failure");
                (
                    "failed",
                    Err(format!("agent bootstrap failed for {machine_id}: {detail}")),
                )
            }
            Ok(Outcome::Conflict) => ("conflict", Err(conflict_error(kind, machine_id))),
            Ok(Outcome::Superseded) => (
                "superseded",
                Err(format!(
                    "agent did not apply {kind} for {machine_id}: superseded by a newer command"
                )),
            ),
            Err(reason) => {
                tracing::warn!(machine_id, command_id = %id, command = kind, reason, "agent did not apply command");
                let detail = format!("agent did not apply {kind} for {machine_id}: {reason}");
                ("timeout", Err(detail))
            }
        };
        telemetry.bootstrap_command(kind, outcome);
        result.map_err(DeliveryError)
    }

    /// Answers requests only while `leading` is set (a standby replica answers 503, so agents'
    /// polls reach the leader through the Service). Without it the channel always serves.
    pub fn serve_while(&self, leading: provider_core::replica::Leading) {
        let _ = self.inner.leading.set(leading);
    }

    /// Keeps enrollments in the provider's state, through the engine of the term `leading`'s
    /// replica leads: durable before an agent learns it enrolled, across restarts and
    /// takeovers. Without it (a channel with no provider around it) they live in memory.
    pub fn record_enrollments_in(&self, leading: provider_core::replica::Leading) {
        let _ = self.inner.state_book.set(Book::State(leading));
    }

    /// Resolves while this replica does not serve; never without replicas.
    async fn not_serving(&self) {
        match self.inner.leading.get() {
            Some(leading) => leading.lost().await,
            None => std::future::pending().await,
        }
    }

    /// 503 while this replica does not serve (a standby), before anything else is looked at.
    fn standby_answer(&self) -> Option<Response<Full<Bytes>>> {
        self.inner.leading.get().is_some_and(|l| !l.get()).then(|| {
            text(
                StatusCode::SERVICE_UNAVAILABLE,
                "this provider replica is a standby; the leader serves the channel",
            )
        })
    }

    /// Serves the channel on `listener` until `shutdown` resolves, then closes open
    /// connections (held polls are answered 204) within a few seconds.
    pub async fn serve(
        &self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send,
    ) -> std::io::Result<()> {
        let acceptor = TlsAcceptor::from(self.inner.tls.clone());
        let stop = CancellationToken::new();
        let tracker = TaskTracker::new();
        tokio::pin!(shutdown);
        loop {
            let (tcp, peer) = tokio::select! {
                () = &mut shutdown => break,
                accepted = listener.accept() => match accepted {
                    Ok(pair) => pair,
                    Err(e) => {
                        // Per-connection failures (EMFILE, aborted handshakes) must not end
                        // the server; pause briefly so a persistent one cannot spin.
                        tracing::warn!(error = %e, "bootstrap channel accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let Some(slot) = self.admit_connection(peer.ip()) else {
                // Closing at once costs nothing and tells the client; a message per refused
                // connection would let a flood fill the log.
                tracing::debug!(peer = %peer, "bootstrap channel: connection limit reached; closed");
                drop(tcp);
                continue;
            };
            let channel = self.clone();
            let acceptor = acceptor.clone();
            let stop = stop.clone();
            tracker.spawn(async move {
                channel.connection(acceptor, tcp, peer, stop).await;
                drop(slot);
            });
        }
        stop.cancel();
        tracker.close();
        if tokio::time::timeout(SHUTDOWN_GRACE, tracker.wait())
            .await
            .is_err()
        {
            tracing::warn!("bootstrap channel connections still open after shutdown grace");
        }
        Ok(())
    }

    /// Takes a place for a new connection from `peer`, if the caps allow it.
    fn admit_connection(&self, peer: IpAddr) -> Option<ConnectionSlot> {
        let limits = &self.inner.limits;
        let mut open = lock(&self.inner.connections);
        let from_peer = open.per_address.get(&peer).copied().unwrap_or(0);
        if open.total >= limits.max_connections || from_peer >= limits.max_connections_per_address {
            return None;
        }
        open.total += 1;
        open.per_address.insert(peer, from_peer + 1);
        Some(ConnectionSlot {
            channel: self.clone(),
            peer,
        })
    }

    async fn connection(
        self,
        acceptor: TlsAcceptor,
        tcp: tokio::net::TcpStream,
        peer: SocketAddr,
        stop: CancellationToken,
    ) {
        let limits = self.inner.limits;
        let tls = match tokio::time::timeout(limits.header_timeout, acceptor.accept(tcp)).await {
            Ok(Ok(tls)) => tls,
            Ok(Err(e)) => {
                tracing::debug!(peer = %peer, error = %e, "bootstrap channel TLS handshake failed");
                return;
            }
            Err(_) => return,
        };
        let activity = Arc::new(Mutex::new(Activity {
            in_flight: 0,
            last: Instant::now(),
            answered: 0,
        }));
        let channel = self.clone();
        // Held polls end early (204) when the server stops or this replica stops serving.
        let conn_stop = stop.child_token();
        let poll_stop = conn_stop.clone();
        let conn_activity = activity.clone();
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let channel = channel.clone();
            let stop = poll_stop.clone();
            let busy = Busy::start(conn_activity.clone());
            async move {
                let response = channel.route(req, peer.ip(), stop).await;
                drop(busy);
                Ok::<_, std::convert::Infallible>(response)
            }
        });
        let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            .max_buf_size(64 * 1024);
        builder
            .http2()
            .timer(TokioTimer::new())
            .keep_alive_interval(Some(limits.keepalive_interval))
            .keep_alive_timeout(limits.keepalive_timeout)
            .max_concurrent_streams(limits.max_streams)
            .max_header_list_size(16 * 1024);
        let conn = builder.serve_connection(TokioIo::new(tls), service);
        tokio::pin!(conn);
        // When this replica does not serve, the connection is closed (GOAWAY on HTTP/2) once its
        // requests are answered: an agent's client would otherwise keep its connection to this
        // replica and get 503 on it until it is idle long enough, while the leader is reachable
        // through the Service on a new connection. A connection that has answered nothing yet
        // gets a moment to send its request and learn why.
        let mut not_serving_since: Option<Instant> = None;
        loop {
            // Idle means no request in flight: a held poll keeps its connection busy.
            let idle_at = {
                let a = lock(&activity);
                if a.in_flight > 0 {
                    Instant::now() + limits.idle_timeout
                } else {
                    a.last + limits.idle_timeout
                }
            };
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(peer = %peer, error = %e, "bootstrap channel connection ended");
                    }
                    return;
                }
                () = stop.cancelled() => break,
                () = tokio::time::sleep_until(idle_at) => {
                    let a = lock(&activity);
                    if a.in_flight == 0 && a.last + limits.idle_timeout <= Instant::now() {
                        tracing::debug!(peer = %peer, "bootstrap channel: idle connection closed");
                        break;
                    }
                }
                () = self.not_serving(), if not_serving_since.is_none() => {
                    not_serving_since = Some(Instant::now());
                    conn_stop.cancel();
                }
                () = tokio::time::sleep(NOT_SERVING_CHECK), if not_serving_since.is_some() => {
                    let a = lock(&activity);
                    let waited = not_serving_since.map_or(Duration::ZERO, |t| t.elapsed());
                    if a.in_flight == 0 && (a.answered > 0 || waited >= NOT_SERVING_FIRST_REQUEST) {
                        tracing::debug!(peer = %peer, "bootstrap channel: connection closed, this replica does not serve");
                        break;
                    }
                }
            }
        }
        conn.as_mut().graceful_shutdown();
        // A peer that does not let the connection close is not waited for long.
        let _ = tokio::time::timeout(limits.header_timeout, conn).await;
    }

    async fn route(
        &self,
        req: Request<Incoming>,
        peer: IpAddr,
        stop: CancellationToken,
    ) -> Response<Full<Bytes>> {
        if let Some(refused) = self.standby_answer() {
            return refused;
        }
        let path = req.uri().path();
        let (want, is_poll) = match path {
            "/v1/command" => (Method::GET, true),
            "/v1/ack" | "/v1/enroll" => (Method::POST, false),
            _ => return text(StatusCode::NOT_FOUND, "404 page not found"),
        };
        if req.method() != want {
            return text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed");
        }
        if path == "/v1/enroll" {
            let machine_id = machine_id_of(req.uri().query().unwrap_or(""));
            let presented = bearer(&req).map(|t| Zeroizing::new(t.to_owned()));
            return self
                .enroll(
                    peer,
                    machine_id,
                    presented.as_deref().map(|t| t.as_str()),
                    req,
                )
                .await;
        }
        let (machine_id, enrolled) = match self.admit(
            peer,
            machine_id_of(req.uri().query().unwrap_or("")),
            bearer(&req),
        ) {
            Admission::Machine {
                machine_id,
                enrolled,
                per_slot,
            } => {
                if per_slot && !self.per_slot_allowed(&machine_id).await {
                    let refused = self.failed(peer, Some(&machine_id));
                    return self.refusal(refused, peer, path);
                }
                (machine_id, enrolled)
            }
            refused => return self.refusal(refused, peer, path),
        };
        if is_poll {
            self.poll(&machine_id, enrolled, stop).await
        } else {
            self.ack(&machine_id, enrolled, req).await
        }
    }

    /// The answer to a request whose credentials were not admitted.
    fn refusal(&self, admission: Admission, peer: IpAddr, path: &str) -> Response<Full<Bytes>> {
        match admission {
            Admission::Throttled(wait) => {
                self.inner.telemetry.bootstrap_poll("throttled");
                let mut response = text(
                    StatusCode::TOO_MANY_REQUESTS,
                    "too many failed authentications",
                );
                if let Ok(v) = http::HeaderValue::from_str(&wait.as_secs().max(1).to_string()) {
                    response.headers_mut().insert(header::RETRY_AFTER, v);
                }
                response
            }
            Admission::NotServing => text(
                StatusCode::SERVICE_UNAVAILABLE,
                "this provider replica is a standby; the leader serves the channel",
            ),
            Admission::Unauthorized | Admission::Machine { .. } => {
                self.inner.telemetry.bootstrap_unauthorized();
                tracing::warn!(peer = %peer, path, "bootstrap channel: unauthorized request");
                text(StatusCode::UNAUTHORIZED, "unauthorized")
            }
        }
    }

    /// Checks the token first: the right token for the claimed machine id is always admitted.
    /// A missing machine id, a missing or malformed header, or a wrong token (indistinguishable
    /// to the caller) counts as a failure of the pair (source address, claimed machine id), and
    /// a pair whose bucket is empty is told to wait instead.
    fn admit(
        &self,
        peer: IpAddr,
        machine_id: Option<String>,
        presented: Option<&str>,
    ) -> Admission {
        if let (Some(machine_id), Some(presented)) = (&machine_id, presented) {
            match self.authenticate(machine_id, presented) {
                Ok(bearer) => {
                    return Admission::Machine {
                        machine_id: machine_id.clone(),
                        enrolled: bearer == Bearer::Enrolled,
                        per_slot: bearer == Bearer::PerSlot,
                    };
                }
                Err(Some(refused)) => return refused,
                Err(None) => {}
            }
        }
        self.failed(peer, machine_id.as_deref())
    }

    /// What `presented` is for the machine: its enrolled credential, or the user_data token
    /// of a machine that has not enrolled (the one-time token of its Droplet's Create, or the
    /// per-slot token, which the caller still checks against the Droplet). Once the machine
    /// enrolled, only its credential is accepted, and after a conflict nothing is. `Err(None)`
    /// is a failed authentication; `Err(Some(_))` another answer.
    fn authenticate(&self, machine_id: &str, presented: &str) -> Result<Bearer, Option<Admission>> {
        let view = match self.book().view(machine_id) {
            Ok(view) => view,
            Err(BookError::NotServing) => return Err(Some(Admission::NotServing)),
            Err(BookError::Unknown | BookError::Refused(_)) => return Err(None),
        };
        if let Some(enrollment) = &view.enrollment {
            let matches = credential_matches(
                &enrollment.credential_digest,
                &enrollment.host_id,
                presented,
            );
            return if matches && !enrollment.conflict {
                Ok(Bearer::Enrolled)
            } else {
                Err(None)
            };
        }
        match self
            .inner
            .secret
            .check_user_data_token(machine_id, presented)
        {
            Some(UserDataToken::Enrollment { create_operation })
                if view
                    .create_operation
                    .as_ref()
                    .is_none_or(|c| *c == create_operation) =>
            {
                Ok(Bearer::EnrollmentToken)
            }
            Some(UserDataToken::PerSlot) => Ok(Bearer::PerSlot),
            _ => Err(None),
        }
    }

    /// Whether the per-slot token may speak for `machine_id`: only when its Droplet (the
    /// recorded one, or while the Create runs the only one the cloud shows) was created
    /// without an enrollment token, by a provider before enrollment. Without a cloud behind
    /// the channel (tests, fuzzing) there is no Droplet to tell by, and it may. A Droplet the
    /// cloud cannot show now is refused; the answer for a recorded Droplet is remembered.
    async fn per_slot_allowed(&self, machine_id: &str) -> bool {
        if self.inner.directory.get().is_none() {
            return true;
        }
        let recorded = self.book().view(machine_id).ok().and_then(|v| v.host_id);
        if let Some(host) = &recorded
            && let Some((droplet, older)) = lock(&self.inner.per_slot_droplets).get(machine_id)
            && droplet == host
        {
            return *older;
        }
        match self
            .enrolling_droplet(machine_id, recorded.as_deref())
            .await
        {
            Ok(droplet) => {
                let older = !droplet.enrollment_token;
                if !older {
                    tracing::warn!(machine_id, droplet = %droplet.id, "bootstrap channel: the per-slot token was presented for a Droplet created with a one-time enrollment token; refused");
                }
                if recorded.is_some() {
                    lock(&self.inner.per_slot_droplets)
                        .insert(machine_id.to_owned(), (droplet.id, older));
                }
                older
            }
            Err(why) => {
                tracing::debug!(machine_id, reason = %why, "bootstrap channel: the per-slot token's Droplet could not be checked; refused");
                false
            }
        }
    }

    /// Counts a failed authentication of (source, claimed machine id), or tells the pair to
    /// wait when it failed too often.
    fn failed(&self, peer: IpAddr, machine_id: Option<&str>) -> Admission {
        let limit = self.inner.auth_limit;
        let mut failures = lock(&self.inner.failures);
        let key = failures.key(peer, machine_id.unwrap_or(""));
        if let Some(wait) = failures.throttled(key, limit) {
            return Admission::Throttled(wait);
        }
        failures.record_failure(key, limit);
        Admission::Unauthorized
    }

    /// Serves the pending command, holding the request while there is none. A command that
    /// carries a secret waits for an enrolled agent: a poll with the user_data token alone
    /// does not see it.
    async fn poll(
        &self,
        machine_id: &str,
        enrolled: bool,
        stop: CancellationToken,
    ) -> Response<Full<Bytes>> {
        let servable = |p: &Pending| enrolled || !p.secret;
        let until = Instant::now() + self.inner.poll_hold;
        loop {
            let notify = {
                let mut machines = lock(&self.inner.machines);
                let slot = machines.entry(machine_id.to_owned()).or_default();
                if let Some(pending) = slot.pending.as_ref().filter(|p| servable(p)) {
                    self.inner.telemetry.bootstrap_poll("command");
                    tracing::debug!(machine_id, command_id = %pending.id, "bootstrap command fetched");
                    let mut response =
                        Response::new(Full::new(Bytes::copy_from_slice(&pending.body)));
                    response.headers_mut().insert(
                        header::CONTENT_TYPE,
                        http::HeaderValue::from_static("application/json"),
                    );
                    return response;
                }
                slot.notify.clone()
            };
            let notified = notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            // Re-check after registering, so a command queued in between is not missed.
            if lock(&self.inner.machines)
                .get(machine_id)
                .is_some_and(|s| s.pending.as_ref().is_some_and(servable))
            {
                continue;
            }
            tokio::select! {
                () = notified => continue,
                () = tokio::time::sleep_until(until) => break,
                () = stop.cancelled() => break,
            }
        }
        self.inner.telemetry.bootstrap_poll("empty");
        empty(StatusCode::NO_CONTENT)
    }

    async fn ack(
        &self,
        machine_id: &str,
        enrolled: bool,
        req: Request<Incoming>,
    ) -> Response<Full<Bytes>> {
        let body = match self.read_body(req).await {
            Ok(body) => body,
            Err(refused) => return refused,
        };
        let Some(ack) = parse_ack(&body) else {
            return self.bad_ack();
        };
        // A command only an enrolled agent is served is only acked by one.
        let matching = |slot: Option<&MachineSlot>| {
            slot.and_then(|s| s.pending.as_ref())
                .filter(|p| p.id == ack.command_id && (!p.secret || enrolled))
                .map(|p| (p.delivery, p.secret))
        };
        let Some((delivery, secret)) = matching(lock(&self.inner.machines).get(machine_id)) else {
            return self.stale_ack(machine_id, &ack.command_id);
        };
        // The blob went to the enrolled agent: its enrollment is confirmed, durably, before
        // the Configure can end, so from now on a replay of the spent token cannot cut the
        // machine off.
        if secret && let Err(refused) = self.confirm_enrollment(machine_id).await {
            return refused;
        }
        let pending = {
            let mut machines = lock(&self.inner.machines);
            let slot = machines.get_mut(machine_id);
            match slot {
                Some(slot) if matching(Some(slot)).is_some_and(|(d, _)| d == delivery) => {
                    slot.pending.take()
                }
                _ => None,
            }
        };
        let Some(pending) = pending else {
            return self.stale_ack(machine_id, &ack.command_id);
        };
        let outcome = if ack.ok {
            self.inner.telemetry.bootstrap_ack("ok");
            Outcome::Applied
        } else {
            self.inner.telemetry.bootstrap_ack("failed");
            Outcome::AgentFailed(if ack.error.is_empty() {
                "agent reported failure".to_owned()
            } else {
                ack.error
            })
        };
        let _ = pending.waiter.send(outcome);
        empty(StatusCode::OK)
    }

    /// An ack for no pending command (or another one): 204, and no waiter is released.
    fn stale_ack(&self, machine_id: &str, command_id: &str) -> Response<Full<Bytes>> {
        self.inner.telemetry.bootstrap_ack("stale");
        tracing::debug!(machine_id, command_id, "stale bootstrap ack ignored");
        empty(StatusCode::NO_CONTENT)
    }

    /// Confirms the enrollment of `machine_id` (its agent acked a Configure's blob). A replica
    /// that stopped serving answers 503, so the agent acks again to the leader; a state that
    /// refuses the write leaves the enrollment unconfirmed (a later replay is then a conflict)
    /// and is logged.
    async fn confirm_enrollment(&self, machine_id: &str) -> Result<(), Response<Full<Bytes>>> {
        match self.book().confirm(machine_id).await {
            Ok(()) => Ok(()),
            Err(BookError::NotServing) => Err(text(
                StatusCode::SERVICE_UNAVAILABLE,
                "this provider replica is a standby; the leader serves the channel",
            )),
            Err(BookError::Unknown) => Ok(()),
            Err(BookError::Refused(why)) => {
                tracing::warn!(machine_id, reason = %why, "bootstrap channel: the enrollment could not be confirmed; a later enrollment with the spent token will cut the machine off");
                Ok(())
            }
        }
    }

    /// Reads a request body within the channel's size and time limits.
    async fn read_body(&self, req: Request<Incoming>) -> Result<Bytes, Response<Full<Bytes>>> {
        let limits = self.inner.limits;
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > limits.max_body_bytes as u64) {
            return Err(self.too_large());
        }
        let collect = Limited::new(req.into_body(), limits.max_body_bytes).collect();
        match tokio::time::timeout(limits.body_timeout, collect).await {
            Ok(Ok(collected)) => Ok(collected.to_bytes()),
            Ok(Err(e))
                if e.downcast_ref::<http_body_util::LengthLimitError>()
                    .is_some() =>
            {
                Err(self.too_large())
            }
            Ok(Err(_)) => Err(self.bad_ack()),
            Err(_) => {
                self.inner.telemetry.bootstrap_ack("bad_body");
                Err(text(StatusCode::REQUEST_TIMEOUT, "request body too slow"))
            }
        }
    }

    /// `POST /v1/enroll`: the agent presents its Droplet's one-time user_data token and the
    /// credential it made (`{"credential": …}`). The enrollment is accepted only from an
    /// address the cloud assigned to the machine's Droplet (unless
    /// `--bootstrap-enrollment-source any`), recorded durably before the answer, and from then
    /// on only the credential speaks for the machine. The same credential again is answered
    /// as enrolled (an agent whose answer was lost). Any other enrollment while one holds is,
    /// once the enrolled agent was handed a Configure's blob (the enrollment is confirmed), a
    /// replay: 401, counted, and nothing changes; before that it is a conflict: 401, every
    /// command queued for the machine is withdrawn, and nothing is delivered to it any more.
    /// The per-slot token enrolls only a Droplet created without an enrollment token.
    async fn enroll(
        &self,
        peer: IpAddr,
        machine_id: Option<String>,
        presented: Option<&str>,
        req: Request<Incoming>,
    ) -> Response<Full<Bytes>> {
        let telemetry = self.inner.telemetry;
        let token = match (&machine_id, presented) {
            (Some(machine_id), Some(presented)) => self
                .inner
                .secret
                .check_user_data_token(machine_id, presented),
            _ => None,
        };
        let (Some(machine_id), Some(token)) = (machine_id.clone(), token) else {
            telemetry.bootstrap_enrollment("unauthorized");
            let refused = self.failed(peer, machine_id.as_deref());
            return self.refusal(refused, peer, "/v1/enroll");
        };
        let body = match self.read_body(req).await {
            Ok(body) => body,
            Err(refused) => return refused,
        };
        let Some(request) = parse_enroll(&body) else {
            telemetry.bootstrap_enrollment("bad_body");
            return text(StatusCode::BAD_REQUEST, "bad enrollment body");
        };
        let unauthorized = |outcome: &'static str| {
            telemetry.bootstrap_enrollment(outcome);
            telemetry.bootstrap_unauthorized();
            text(StatusCode::UNAUTHORIZED, "unauthorized")
        };
        let view = match self.book().view(&machine_id) {
            Ok(view) => view,
            Err(BookError::NotServing) => return self.refusal(Admission::NotServing, peer, ""),
            Err(_) => return unauthorized("unauthorized"),
        };
        let per_slot = token == UserDataToken::PerSlot;
        let create_operation = match token {
            UserDataToken::Enrollment { create_operation } => {
                if view
                    .create_operation
                    .as_ref()
                    .is_some_and(|c| *c != create_operation)
                {
                    tracing::warn!(peer = %peer, machine_id, "bootstrap channel: enrollment with the token of an earlier Droplet of this slot refused");
                    return unauthorized("stale_token");
                }
                create_operation
            }
            UserDataToken::PerSlot => view.create_operation.clone().unwrap_or_default(),
        };
        let droplet = match self
            .enrolling_droplet(&machine_id, view.host_id.as_deref())
            .await
        {
            Ok(droplet) => droplet,
            Err(why) => {
                telemetry.bootstrap_enrollment("droplet_unknown");
                tracing::warn!(peer = %peer, machine_id, reason = %why, "bootstrap channel: enrollment deferred");
                let mut response = text(StatusCode::SERVICE_UNAVAILABLE, &why);
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, http::HeaderValue::from_static("5"));
                return response;
            }
        };
        if per_slot && droplet.enrollment_token {
            tracing::warn!(peer = %peer, machine_id, droplet = %droplet.id, "bootstrap channel: enrollment with the per-slot token of a slot whose Droplet was created with a one-time enrollment token refused");
            return unauthorized("per_slot_refused");
        }
        if self.enrollment_source() == EnrollmentSource::Droplet
            && !droplet.addresses.iter().any(|a| same_address(*a, peer))
        {
            tracing::warn!(peer = %peer, machine_id, droplet = %droplet.id, "bootstrap channel: enrollment from an address the cloud did not assign to the machine's Droplet refused (--bootstrap-enrollment-source droplet)");
            return unauthorized("wrong_source");
        }
        let enrollment = Enrollment {
            credential_digest: credential_digest(&droplet.id, &request.credential),
            host_id: droplet.id.clone(),
            create_operation,
            conflict: false,
            confirmed: false,
        };
        match self.book().record(&machine_id, enrollment).await {
            Ok(EnrollVerdict::Enrolled) => {
                telemetry.bootstrap_enrollment("enrolled");
                tracing::info!(peer = %peer, machine_id, droplet = %droplet.id, "bootstrap channel: agent enrolled; its user_data token is spent");
                json_ok()
            }
            Ok(EnrollVerdict::AlreadyEnrolled) => {
                telemetry.bootstrap_enrollment("repeated");
                tracing::info!(peer = %peer, machine_id, droplet = %droplet.id, "bootstrap channel: agent enrolled again with its own credential");
                json_ok()
            }
            Ok(EnrollVerdict::Replayed) => {
                telemetry.bootstrap_enrollment("replayed");
                telemetry.bootstrap_enrollment_replay();
                telemetry.bootstrap_unauthorized();
                tracing::warn!(peer = %peer, machine_id, droplet = %droplet.id, "bootstrap channel: an enrollment presented this machine's spent one-time token after its agent was handed a Configure's blob (something that read the Droplet's user_data, such as a process on the node): refused; the enrolled agent keeps the machine");
                text(StatusCode::UNAUTHORIZED, "unauthorized")
            }
            Ok(EnrollVerdict::Conflict) => {
                telemetry.bootstrap_enrollment("conflict");
                telemetry.bootstrap_enrollment_conflict();
                let withdrawn = self.withdraw_all(&machine_id);
                tracing::error!(peer = %peer, machine_id, droplet = %droplet.id, withdrawn, "bootstrap channel: a second enrollment presented this machine's spent one-time token before its agent was handed a Configure's blob, so which party is the real agent cannot be told (an attack, or a cloned disk): every command for the machine is withdrawn and nothing is delivered to it any more; release the machine (admin failed release) to replace its Droplet");
                text(StatusCode::UNAUTHORIZED, "unauthorized")
            }
            Err(BookError::NotServing) => self.refusal(Admission::NotServing, peer, ""),
            Err(BookError::Unknown) => unauthorized("unauthorized"),
            Err(BookError::Refused(why)) => {
                tracing::warn!(peer = %peer, machine_id, droplet = %droplet.id, reason = %why, "bootstrap channel: enrollment refused");
                unauthorized("refused")
            }
        }
    }

    /// The Droplet an enrollment of `machine_id` comes from: the recorded one, or, while the
    /// Create has not recorded it yet, the only Droplet the cloud shows for the machine.
    async fn enrolling_droplet(
        &self,
        machine_id: &str,
        recorded: Option<&str>,
    ) -> Result<DropletSighting, String> {
        let Some(directory) = self.inner.directory.get() else {
            // No cloud around the channel: nothing to bind to but the recorded host, and
            // nothing tells how it was created.
            return Ok(DropletSighting {
                id: recorded.unwrap_or_default().to_owned(),
                enrollment_token: false,
                addresses: Vec::new(),
            });
        };
        let found = directory
            .droplets_of(machine_id)
            .await
            .map_err(|e| format!("cannot look up the machine's Droplet now ({e}); retry"))?;
        let droplet = match recorded {
            Some(id) => found.into_iter().find(|d| d.id == id),
            None if found.len() == 1 => found.into_iter().next(),
            None => None,
        };
        droplet.ok_or_else(|| "the machine's Droplet is not known yet; retry".to_owned())
    }

    /// Withdraws every command queued for `machine_id` (an enrollment conflict); returns how
    /// many.
    fn withdraw_all(&self, machine_id: &str) -> usize {
        let mut machines = lock(&self.inner.machines);
        let Some(slot) = machines.get_mut(machine_id) else {
            return 0;
        };
        let withdrawn = slot.pending.take().map(|pending| {
            let _ = pending.waiter.send(Outcome::Conflict);
        });
        slot.notify.notify_waiters();
        usize::from(withdrawn.is_some())
    }

    fn too_large(&self) -> Response<Full<Bytes>> {
        self.inner.telemetry.bootstrap_ack("too_large");
        text(StatusCode::PAYLOAD_TOO_LARGE, "ack body too large")
    }

    fn bad_ack(&self) -> Response<Full<Bytes>> {
        self.inner.telemetry.bootstrap_ack("bad_body");
        text(StatusCode::BAD_REQUEST, "bad ack body")
    }
}

/// Marks one request in flight on its connection until dropped.
struct Busy(Arc<Mutex<Activity>>);

impl Busy {
    fn start(activity: Arc<Mutex<Activity>>) -> Busy {
        lock(&activity).in_flight += 1;
        Busy(activity)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let mut a = lock(&self.0);
        a.in_flight = a.in_flight.saturating_sub(1);
        a.answered += 1;
        a.last = Instant::now();
    }
}

struct PendingGuard<'a> {
    channel: &'a Channel,
    machine_id: &'a str,
    delivery: u64,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        let mut machines = lock(&self.channel.inner.machines);
        if let Some(slot) = machines.get_mut(self.machine_id) {
            if slot
                .pending
                .as_ref()
                .is_some_and(|p| p.delivery == self.delivery)
            {
                slot.pending = None;
            }
            // Slots without a pending command or a waiting poll carry no state.
            if slot.pending.is_none() && Arc::strong_count(&slot.notify) == 1 {
                machines.remove(self.machine_id);
            }
        }
    }
}

fn refill(bucket: &mut Bucket, limit: AuthLimit) {
    let now = Instant::now();
    let earned = now.duration_since(bucket.updated).as_secs_f64()
        / limit.refill_every.as_secs_f64().max(f64::MIN_POSITIVE);
    bucket.tokens = (bucket.tokens + earned).min(f64::from(limit.burst));
    bucket.updated = now;
}

/// The bearer token of a request: `Authorization: Bearer <token>`, prefix case-sensitive.
fn bearer(req: &Request<Incoming>) -> Option<&str> {
    req.headers()
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
}

/// The first `machine_id` query parameter, form-decoded; `None` when missing or empty.
fn machine_id_of(query: &str) -> Option<String> {
    let url = reqwest::Url::parse(&format!("http://channel/?{query}")).ok()?;
    url.query_pairs()
        .find(|(k, _)| k == "machine_id")
        .map(|(_, v)| v.into_owned())
        .filter(|v| !v.is_empty())
}

struct Ack {
    command_id: String,
    ok: bool,
    error: String,
}

/// Decodes an ack leniently: keys match case-insensitively, unknown keys are ignored, a
/// missing `ok` means false, and `null` is an empty ack. Wrong types are rejected.
fn parse_ack(body: &[u8]) -> Option<Ack> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    let mut ack = Ack {
        command_id: String::new(),
        ok: false,
        error: String::new(),
    };
    let object = match value {
        serde_json::Value::Null => return Some(ack),
        serde_json::Value::Object(o) => o,
        _ => return None,
    };
    for (key, value) in object {
        match (key.to_ascii_lowercase().as_str(), value) {
            (_, serde_json::Value::Null) => {}
            ("command_id", serde_json::Value::String(s)) => ack.command_id = s,
            ("ok", serde_json::Value::Bool(b)) => ack.ok = b,
            ("error", serde_json::Value::String(s)) => ack.error = s,
            ("command_id" | "ok" | "error", _) => return None,
            _ => {}
        }
    }
    Some(ack)
}

/// Lower-case hex of a fingerprint.
fn hex(bytes: [u8; 8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Why a command for a machine in enrollment conflict is not delivered.
fn conflict_error(kind: &str, machine_id: &str) -> String {
    format!(
        "agent did not apply {kind} for {machine_id}: a second enrollment presented the \
         machine's spent one-time token before its agent was handed a Configure's blob (an \
         attack, or a cloned disk), so nothing is delivered \
         to its Droplet any more; release the machine (admin failed release) to replace it"
    )
}

/// Whether `a` and `b` are the same address (an IPv4 address and its IPv6-mapped form too).
fn same_address(a: IpAddr, b: IpAddr) -> bool {
    a.to_canonical() == b.to_canonical()
}

fn json_ok() -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from_static(b"{\"enrolled\":true}\n")));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    response
}

fn text(status: StatusCode, message: &str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(format!("{message}\n"))));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        http::HeaderValue::from_static("nosniff"),
    );
    response
}

fn empty(status: StatusCode) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::new()));
    *response.status_mut() = status;
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_commands() {
        let configure = Command::Configure {
            cluster_id: "c".into(),
            blob: b"hi".to_vec(),
        };
        assert_eq!(
            &configure.to_wire("1", "")[..],
            b"{\"id\":\"1\",\"type\":\"configure\",\"cluster_id\":\"c\",\"blob\":\"aGk=\"}\n"
        );
        let drain = Command::Drain { grace_seconds: 1 };
        assert_eq!(
            &drain.to_wire("2", "")[..],
            b"{\"id\":\"2\",\"type\":\"drain\",\"grace_seconds\":1}\n"
        );
        let empty_blob = Command::Configure {
            cluster_id: "c".into(),
            blob: Vec::new(),
        };
        assert_eq!(
            &empty_blob.to_wire("3", "")[..],
            b"{\"id\":\"3\",\"type\":\"configure\",\"cluster_id\":\"c\"}\n"
        );
        let ready = Command::Ready {
            cluster_id: "c".into(),
        };
        assert_eq!(
            &ready.to_wire("4", "")[..],
            b"{\"id\":\"4\",\"type\":\"ready\",\"cluster_id\":\"c\"}\n"
        );
        assert_eq!(
            &configure.to_wire("5", "op-1.configure.0123456789abcdef")[..],
            b"{\"id\":\"5\",\"type\":\"configure\",\"cluster_id\":\"c\",\"blob\":\"aGk=\",\"run_key\":\"op-1.configure.0123456789abcdef\"}\n"
        );
        assert!(!format!("{configure:?}").contains("hi"));
    }

    /// Ids derive from the transition: the same in every channel with the secret, different
    /// for every operation, kind, machine and configure content, and never one of the form of
    /// ids outside a transition.
    #[test]
    fn command_ids_come_from_the_transition() {
        let (one, two) = (
            test_channel(AuthLimit::default()),
            test_channel(AuthLimit::default()),
        );
        let configure = |cluster: &str, blob: &[u8]| Command::Configure {
            cluster_id: cluster.into(),
            blob: blob.to_vec(),
        };
        let ready = Command::Ready {
            cluster_id: "c".into(),
        };
        let drain = |grace_seconds| Command::Drain { grace_seconds };
        let m = "digitalocean/OnDemand/s-2vcpu-4gb/nyc3/000";
        let id = one.command_id(m, &configure("c", b"blob"), "op-7");
        assert_eq!(id, two.command_id(m, &configure("c", b"blob"), "op-7"));
        assert!(id.starts_with("op-7.configure."), "{id}");
        assert_eq!(id.len(), "op-7.configure.".len() + 16);
        assert!(!id.contains("blob"));
        assert_eq!(one.command_id(m, &ready, "op-7"), "op-7.ready");
        assert_eq!(two.command_id(m, &ready, "op-7"), "op-7.ready");
        // A resumed drain has lost its grace: the grace is not part of the id.
        assert_eq!(one.command_id(m, &drain(30), "op-9"), "op-9.drain");
        assert_eq!(two.command_id(m, &drain(1), "op-9"), "op-9.drain");
        let others = [
            one.command_id(m, &configure("c", b"blob"), "op-8"),
            one.command_id(m, &configure("c", b"blob2"), "op-7"),
            one.command_id(m, &configure("c2", b"blob"), "op-7"),
            one.command_id("m-other", &configure("c", b"blob"), "op-7"),
            one.command_id(m, &ready, "op-70"),
        ];
        for other in &others {
            assert_ne!(&id, other);
        }
        // Another secret, another fingerprint.
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
            .expect("params")
            .self_signed(&key)
            .expect("cert");
        let other_secret = Channel::new(
            ChannelSettings {
                secret: BootstrapSecret::new("another-secret").expect("secret"),
                tls: crate::setup::channel_tls(
                    cert.pem().as_bytes(),
                    key.serialize_pem().as_bytes(),
                )
                .expect("tls"),
                poll_hold: Duration::from_secs(25),
                auth_limit: AuthLimit::default(),
            },
            Telemetry::new("bigfleet_digitalocean_channel_unit_ids"),
        );
        assert_ne!(
            id,
            other_secret.command_id(m, &configure("c", b"blob"), "op-7")
        );
        // Operation ids outside the plain form are digested, stably, and never hold a dot of
        // their own.
        for odd in ["op.7", "op 7", "\u{e9}", &"o".repeat(129)] {
            let a = one.command_id(m, &ready, odd);
            assert_eq!(a, two.command_id(m, &ready, odd));
            assert!(a.starts_with("x.") && a.ends_with(".ready"), "{a}");
            assert_eq!(a.len(), "x.".len() + 16 + ".ready".len());
        }
        assert_ne!(
            one.command_id(m, &ready, "op.7"),
            one.command_id(m, &ready, "op 7")
        );
        let long = "o".repeat(128);
        assert_eq!(one.command_id(m, &ready, &long), format!("{long}.ready"));
        // Without an operation id: the per-process form, never repeated, never with a dot.
        let (a, b) = (one.command_id(m, &ready, ""), one.command_id(m, &ready, ""));
        assert_ne!(a, b);
        assert_ne!(a, two.command_id(m, &ready, ""));
        assert!(
            !a.contains('.') && a.starts_with(&one.inner.id_prefix),
            "{a}"
        );
    }

    #[test]
    fn acks_decode_leniently() {
        let a = parse_ack(br#"{"Command_ID":"7","OK":true,"extra":1}"#).unwrap();
        assert_eq!((a.command_id.as_str(), a.ok), ("7", true));
        let a = parse_ack(br#"{"command_id":"7"}"#).unwrap();
        assert!(!a.ok, "a missing ok means false");
        let a = parse_ack(br#"{"command_id":"7","ok":false,"error":"boom"}"#).unwrap();
        assert_eq!(a.error, "boom");
        assert!(parse_ack(b"null").is_some());
        assert!(parse_ack(b"[1]").is_none());
        assert!(parse_ack(br#"{"ok":"yes"}"#).is_none());
        assert!(parse_ack(b"{").is_none());
    }

    #[test]
    fn machine_ids_are_form_decoded() {
        assert_eq!(
            machine_id_of("machine_id=a%2Fb%2Fc").as_deref(),
            Some("a/b/c")
        );
        assert_eq!(machine_id_of("machine_id=a/b&x=1").as_deref(), Some("a/b"));
        assert_eq!(machine_id_of("machine_id=a+b").as_deref(), Some("a b"));
        assert_eq!(machine_id_of("machine_id="), None);
        assert_eq!(machine_id_of(""), None);
    }

    fn test_channel(limit: AuthLimit) -> Channel {
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
            .expect("params")
            .self_signed(&key)
            .expect("cert");
        let tls = crate::setup::channel_tls(cert.pem().as_bytes(), key.serialize_pem().as_bytes())
            .expect("tls");
        Channel::new(
            ChannelSettings {
                secret: BootstrapSecret::new("unit-test-secret").expect("secret"),
                tls,
                poll_hold: Duration::from_secs(25),
                auth_limit: limit,
            },
            Telemetry::new("bigfleet_digitalocean_channel_unit"),
        )
    }

    fn rss_bytes() -> usize {
        let status = std::fs::read_to_string("/proc/self/status").expect("proc status");
        let kib: usize = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS");
        kib * 1024
    }

    #[tokio::test(start_paused = true)]
    async fn a_valid_token_is_admitted_whatever_else_fails_at_its_address() {
        let limit = AuthLimit {
            burst: 2,
            refill_every: Duration::from_secs(60),
        };
        let ch = test_channel(limit);
        let nat: IpAddr = "203.0.113.7".parse().expect("ip");
        let good = ch.token_for("m-good");
        for _ in 0..2 {
            assert_eq!(
                ch.admit(nat, Some("m-bad".into()), Some("guess")),
                Admission::Unauthorized
            );
        }
        assert!(matches!(
            ch.admit(nat, Some("m-bad".into()), Some("guess")),
            Admission::Throttled(_)
        ));
        // Another machine behind the same address, and even the right token of the machine
        // under attack, are admitted.
        assert_eq!(
            ch.admit(nat, Some("m-good".into()), Some(good.expose())),
            Admission::Machine {
                machine_id: "m-good".into(),
                enrolled: false,
                per_slot: true
            }
        );
        let bad = ch.token_for("m-bad");
        assert_eq!(
            ch.admit(nat, Some("m-bad".into()), Some(bad.expose())),
            Admission::Machine {
                machine_id: "m-bad".into(),
                enrolled: false,
                per_slot: true
            }
        );
        // Failures of one machine id do not spend another's budget at the same address.
        assert_eq!(
            ch.admit(nat, Some("m-good".into()), Some("guess")),
            Admission::Unauthorized
        );
        // Nor at another address.
        let other: IpAddr = "198.51.100.1".parse().expect("ip");
        assert_eq!(
            ch.admit(other, Some("m-bad".into()), Some("guess")),
            Admission::Unauthorized
        );
        // The bucket refills.
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(
            ch.admit(nat, Some("m-bad".into()), Some("guess")),
            Admission::Unauthorized
        );
    }

    #[test]
    fn a_standby_replica_answers_503_and_the_leader_serves() {
        let ch = test_channel(AuthLimit::default());
        assert!(
            ch.standby_answer().is_none(),
            "without replicas it always serves"
        );
        let leading = provider_core::replica::Leading::default();
        ch.serve_while(leading.clone());
        let refused = ch.standby_answer().expect("a standby refuses");
        assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
        leading.set(true);
        assert!(ch.standby_answer().is_none(), "the leader serves");
    }

    #[test]
    fn the_failure_table_is_capped_and_evicts_the_oldest() {
        let limit = AuthLimit::default();
        let mut table = FailureTable::new(3);
        let keys: Vec<u64> = (0..5)
            .map(|i| table.key(IpAddr::from([10, 0, 0, i]), "m"))
            .collect();
        for &k in &keys {
            table.record_failure(k, limit);
        }
        assert_eq!(table.len(), 3);
        assert!(!table.buckets.contains_key(&keys[0]) && !table.buckets.contains_key(&keys[1]));
        assert!(keys[2..].iter().all(|k| table.buckets.contains_key(k)));
        // A repeated failure does not insert twice.
        table.record_failure(keys[4], limit);
        assert_eq!((table.len(), table.order.len()), (3, 3));
    }

    /// A million distinct failing (address, machine id) pairs through the admission path (with
    /// no bearer header, so the run does not spend its time on HMACs): the table never holds
    /// more than its cap, and the process grows by a bounded amount.
    #[test]
    fn a_million_failing_sources_leave_memory_bounded() {
        const SOURCES: u32 = 1_000_000;
        let ch = test_channel(AuthLimit::default());
        let before = rss_bytes();
        let mut machine_id = String::new();
        for i in 0..SOURCES {
            machine_id.clear();
            machine_id.push_str("digitalocean/OnDemand/s-2vcpu-4gb/nyc3/");
            machine_id.push_str(&i.to_string());
            let peer = IpAddr::from((0x0a00_0000 | i).to_be_bytes());
            let admission = ch.admit(peer, Some(machine_id.clone()), None);
            assert_eq!(admission, Admission::Unauthorized);
        }
        let after = rss_bytes();
        let table = lock(&ch.inner.failures);
        let heap = table.heap_bytes();
        eprintln!(
            "failure table: {} entries, {} KiB allocated; RSS grew {} KiB over {SOURCES} sources",
            table.len(),
            heap / 1024,
            after.saturating_sub(before) / 1024
        );
        assert_eq!(table.len(), FAILURE_TABLE_CAP);
        assert_eq!(table.order.len(), FAILURE_TABLE_CAP);
        assert!(heap < 16 << 20, "{heap}");
        assert!(
            after.saturating_sub(before) < 32 << 20,
            "{before} -> {after}"
        );
        // The newest sources are remembered, the oldest were evicted.
        let newest = table.key(
            IpAddr::from((0x0a00_0000 | (SOURCES - 1)).to_be_bytes()),
            &format!("digitalocean/OnDemand/s-2vcpu-4gb/nyc3/{}", SOURCES - 1),
        );
        assert!(table.buckets.contains_key(&newest));
        let oldest = table.key(
            IpAddr::from(0x0a00_0000u32.to_be_bytes()),
            "digitalocean/OnDemand/s-2vcpu-4gb/nyc3/0",
        );
        assert!(!table.buckets.contains_key(&oldest));
    }

    /// With a paused clock: a poll is held while nothing is pending, answers the moment a
    /// command is queued (not a tick later), and with nothing queued answers 204 exactly when
    /// the hold ends.
    #[tokio::test(start_paused = true)]
    async fn a_poll_is_held_until_a_command_arrives_or_the_hold_ends() {
        let ch = test_channel(AuthLimit::default());
        let hold = ch.inner.poll_hold;
        let stop = CancellationToken::new();
        let poll = |machine_id: &'static str| {
            let (ch, stop) = (ch.clone(), stop.clone());
            tokio::spawn(async move {
                let response = ch.poll(machine_id, true, stop).await;
                (response.status(), Instant::now())
            })
        };
        let start = Instant::now();
        let held = poll("m-1");
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert!(
            !held.is_finished(),
            "the poll returned before a command was queued"
        );
        let queued_at = Instant::now();
        let delivery = tokio::spawn({
            let ch = ch.clone();
            async move {
                ch.deliver(
                    "m-1",
                    Command::Drain { grace_seconds: 5 },
                    &TransitionContext::with_timeout("op", Duration::from_secs(600)),
                )
                .await
            }
        });
        let (status, answered_at) = held.await.expect("poll");
        assert_eq!(status, StatusCode::OK);
        assert_eq!(
            answered_at, queued_at,
            "answered as soon as the command was queued"
        );
        assert_eq!(answered_at - start, Duration::from_secs(10));
        delivery.abort();

        let start = Instant::now();
        let empty = poll("m-2");
        tokio::time::sleep(hold - Duration::from_millis(1)).await;
        assert!(!empty.is_finished());
        let (status, answered_at) = empty.await.expect("poll");
        assert_eq!(status, StatusCode::NO_CONTENT);
        assert_eq!(answered_at - start, hold);
    }

    /// A transition delivered again under its operation id (same command id) while the earlier
    /// delivery still waits: the earlier one is superseded, and its ending does not withdraw
    /// the command the later one is waiting on.
    #[tokio::test(start_paused = true)]
    async fn a_redelivery_of_the_same_id_supersedes_without_withdrawing_the_command() {
        let ch = test_channel(AuthLimit::default());
        let deliver = |ch: &Channel| {
            let ch = ch.clone();
            tokio::spawn(async move {
                ch.deliver(
                    "m-1",
                    Command::Ready {
                        cluster_id: "c".into(),
                    },
                    &TransitionContext::with_timeout("op-3", Duration::from_secs(600)),
                )
                .await
            })
        };
        let first = deliver(&ch);
        tokio::time::sleep(Duration::from_millis(1)).await;
        let second = deliver(&ch);
        let err = first.await.expect("first delivery").unwrap_err();
        assert!(err.0.ends_with("superseded by a newer command"), "{err}");
        let response = ch.poll("m-1", true, CancellationToken::new()).await;
        assert_eq!(
            response.status(),
            StatusCode::OK,
            "the command is still served"
        );
        let body = response
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes();
        assert_eq!(
            &body[..],
            b"{\"id\":\"op-3.ready\",\"type\":\"ready\",\"cluster_id\":\"c\"}\n"
        );
        assert!(!second.is_finished());
        second.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn buckets_refill() {
        let limit = AuthLimit {
            burst: 2,
            refill_every: Duration::from_secs(10),
        };
        let mut b = Bucket {
            tokens: 0.0,
            updated: Instant::now(),
        };
        tokio::time::advance(Duration::from_secs(5)).await;
        refill(&mut b, limit);
        assert!((b.tokens - 0.5).abs() < 1e-6);
        tokio::time::advance(Duration::from_secs(100)).await;
        refill(&mut b, limit);
        assert_eq!(b.tokens, 2.0);
    }
}

//! The real Hetzner Cloud backend: [`HetznerCloud`] implements `provider_core::cloud::Cloud`
//! over the Hetzner API ([`crate::api`]) and SSH ([`crate::ssh`]).
//!
//! Ownership: every server carries `bigfleet-managed=true`, its machine id and the provider
//! instance (`--provider`) in labels ([`crate::labels`]). Servers made by the reference
//! provider have no provider label; one of those is ours when its machine id is one of our
//! slot ids (`<provider>/…`) in one of our locations, and it gets the provider label the first
//! time we act on it, so swapping the reference binary for this one keeps every server. Inventory reads select on the
//! instance, keep only the configured locations and drop servers being deleted; a server is
//! only ever adopted, configured, drained or deleted after its labels prove it is ours. A Create
//! first looks for the server a previous attempt made, and a create error (name taken, lost
//! response) is resolved by the same lookup, never by the name alone.
//!
//! Prices: the live price is the ServerType's **net** (VAT-exclusive) hourly EUR price for the
//! location times `--eur-usd`. Net is what BigFleet should compare across clouds (VAT is
//! recoverable for businesses and other clouds quote net), and it is the basis of the pinned
//! table in [`crate::catalog`], so warm and cold prices agree.
//!
//! Label writes: Hetzner replaces a server's whole label map on update and has no conditional
//! write. Every write here is a read-modify-write under a per-server async lock (so two
//! transitions of this process never interleave on one server), followed by a re-read that
//! checks our change is present; if another writer slipped in between, the change is re-applied
//! on top of the newer map (at most three rounds). Only this provider instance writes the labels
//! of its servers, so the in-process lock removes the lost-update race the reference has, and
//! the verification catches anything outside it.
//!
//! Readiness (`--readiness-command`): Configure delivers the blob, runs the hook and records the
//! cluster binding once the hook succeeded (the node has joined at that point). The connection
//! is then kept for [`Cloud::confirm_ready`], which runs the command over the same pinned
//! connection until it exits 0 or the Configure deadline passes.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use hcloud::models;
use provider_core::backend::{BackendError, ConfigureOrder, TransitionContext};
use provider_core::cloud::{Capacity, Cloud, OwnedHost};
use provider_core::machine::Machine;
use provider_core::telemetry::Telemetry;
use tokio::time::Instant;

use crate::api::{ApiError, ClientTiming, HcloudApi};
use crate::hostkey::HostKey;
use crate::labels;
use crate::ssh::{self, PinnedSession, SshConfig, SshIdentity, SshTiming};
use provider_core::config::Secret;

/// The reference's default `--eur-usd`.
pub const DEFAULT_EUR_USD: f64 = 1.08;

/// Everything the real backend needs, as parsed from the command line. Its Debug output
/// leaves out the token, the SSH key and the base user-data (which may carry secrets of the
/// operator's own), printing only their presence and size.
#[derive(Clone)]
pub struct HetznerConfig {
    pub token: Secret,
    /// `--hcloud-endpoint` (default [`crate::api::DEFAULT_ENDPOINT`]).
    pub endpoint: String,
    /// `--provider`: the instance whose servers this process owns.
    pub provider_instance: String,
    /// `--image`: name or numeric id.
    pub image: String,
    /// The locations of the offerings; inventory is limited to them.
    pub locations: Vec<String>,
    /// `--ssh-key` / `--ssh-user` / `--ssh-port`; `None` disables Configure and Drain.
    pub ssh: Option<SshConfig>,
    /// `--network`: a Hetzner private network (name or id) every new server is attached to.
    pub network: Option<String>,
    /// `--ssh-address`: which server address SSH connects to.
    pub ssh_address: SshAddress,
    /// `--bootstrap-hook`.
    pub bootstrap_hook: String,
    /// The contents of `--base-user-data`.
    pub base_user_data: Option<String>,
    /// `--readiness-command`.
    pub readiness_command: Option<String>,
    /// `--eur-usd`.
    pub eur_usd: f64,
    pub telemetry: Telemetry,
    pub timing: Timing,
}

impl std::fmt::Debug for HetznerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let user_data = self
            .base_user_data
            .as_ref()
            .map(|d| format!("[redacted; {} bytes]", d.len()));
        f.debug_struct("HetznerConfig")
            .field("token", &self.token)
            .field("endpoint", &self.endpoint)
            .field("provider_instance", &self.provider_instance)
            .field("image", &self.image)
            .field("locations", &self.locations)
            .field("ssh", &self.ssh)
            .field("network", &self.network)
            .field("ssh_address", &self.ssh_address)
            .field("bootstrap_hook", &self.bootstrap_hook)
            .field("base_user_data", &user_data)
            .field("readiness_command", &self.readiness_command)
            .field("eur_usd", &self.eur_usd)
            .field("telemetry", &self.telemetry)
            .field("timing", &self.timing)
            .finish()
    }
}

/// Which address of a server the provider's SSH connection goes to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SshAddress {
    /// The public IPv4, exactly as the API reports it (the reference's behaviour).
    #[default]
    Public,
    /// The server's address on `--network`, for a management network the control plane
    /// trusts; the public address is then never used for SSH.
    Private,
}

impl SshAddress {
    /// Parses `--ssh-address`.
    pub fn parse(value: &str) -> Result<SshAddress, String> {
        match value.trim().to_ascii_lowercase().as_str() {
            "" | "public" => Ok(SshAddress::Public),
            "private" => Ok(SshAddress::Private),
            other => Err(format!(
                "--ssh-address must be public or private (got {other:?})"
            )),
        }
    }
}

/// Pacing of polls and retries; the defaults suit the real API, tests shorten them.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    pub client: ClientTiming,
    pub ssh: SshTiming,
    /// Interval between server status polls while waiting for `running`.
    pub running_poll: Duration,
    /// Own cap on waiting for `running` (the Create deadline normally ends it first).
    pub running_cap: Duration,
    /// Interval between readiness-command runs.
    pub readiness_poll: Duration,
    /// Budget of an inventory listing (it has no transition deadline of its own).
    pub list_budget: Duration,
    /// Budget of a price or capacity lookup.
    pub lookup_budget: Duration,
}

impl Default for Timing {
    fn default() -> Timing {
        Timing {
            client: ClientTiming::default(),
            ssh: SshTiming::default(),
            running_poll: Duration::from_secs(3),
            running_cap: Duration::from_secs(600),
            readiness_poll: Duration::from_secs(5),
            list_budget: Duration::from_secs(60),
            lookup_budget: Duration::from_secs(30),
        }
    }
}

/// The real Hetzner Cloud backend.
pub struct HetznerCloud {
    api: HcloudApi,
    provider: String,
    image: String,
    locations: HashSet<String>,
    ssh: Option<SshIdentity>,
    network: Option<String>,
    ssh_address: SshAddress,
    /// The numeric id of `network`, once resolved.
    network_id: tokio::sync::OnceCell<i64>,
    hook: String,
    base_user_data: Option<Secret>,
    readiness_command: Option<String>,
    eur_usd: f64,
    telemetry: Telemetry,
    timing: Timing,
    label_locks: Mutex<HashMap<i64, Arc<tokio::sync::Mutex<()>>>>,
    /// Connections kept from a successful configure for the readiness gate, by server id.
    ready_sessions: tokio::sync::Mutex<HashMap<i64, PinnedSession>>,
}

impl std::fmt::Debug for HetznerCloud {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HetznerCloud")
            .field("api", &self.api)
            .field("provider", &self.provider)
            .field("image", &self.image)
            .field("locations", &self.locations)
            .field("ssh", &self.ssh)
            .finish_non_exhaustive()
    }
}

fn err(message: impl Into<String>) -> BackendError {
    BackendError::new(message)
}

fn server_id(host_id: &str, what: &str) -> Result<i64, BackendError> {
    host_id
        .trim()
        .parse::<i64>()
        .map_err(|e| err(format!("{what}: bad server id {host_id:?}: {e}")))
}

/// Whether a failed call may well succeed when repeated later (rate limit, server error, lost
/// connection).
fn is_passing(e: &ApiError) -> bool {
    match e {
        ApiError::Status { status, .. } => *status == 429 || *status >= 500,
        ApiError::Transport(_) => true,
        ApiError::Decode(_) | ApiError::Deadline | ApiError::Config(_) => false,
    }
}

fn is_running(status: models::server::Status) -> bool {
    use models::server::Status;
    matches!(
        status,
        Status::Running | Status::Initializing | Status::Starting
    )
}

fn ipv4_of(server: &models::Server) -> Option<String> {
    server
        .public_net
        .ipv4
        .as_ref()
        .map(|v4| v4.ip.clone())
        .filter(|ip| !ip.is_empty())
}

impl HetznerCloud {
    /// Validates the configuration (token, image, endpoint, SSH key) and builds the backend.
    /// Makes no network call.
    pub fn new(config: HetznerConfig) -> Result<HetznerCloud, String> {
        if config.token.expose().trim().is_empty() {
            return Err("hcloud: token is required for the hetzner backend".into());
        }
        if config.image.trim().is_empty() {
            return Err("hcloud: --image is required for the hetzner backend".into());
        }
        if config.provider_instance.is_empty() {
            return Err("hcloud: --provider must not be empty".into());
        }
        if config.bootstrap_hook.trim().is_empty() {
            return Err("hcloud: --bootstrap-hook must not be empty".into());
        }
        let locations: HashSet<String> = config
            .locations
            .iter()
            .filter(|l| !l.is_empty())
            .cloned()
            .collect();
        if locations.is_empty() {
            return Err("hcloud: no locations configured (every offering names one)".into());
        }
        let eur_usd = if config.eur_usd.is_finite() && config.eur_usd > 0.0 {
            config.eur_usd
        } else {
            tracing::warn!(
                given = config.eur_usd,
                used = DEFAULT_EUR_USD,
                "--eur-usd must be positive; using the default"
            );
            DEFAULT_EUR_USD
        };
        let ssh = config.ssh.as_ref().map(SshIdentity::parse).transpose()?;
        let network = config
            .network
            .map(|n| n.trim().to_owned())
            .filter(|n| !n.is_empty());
        if config.ssh_address == SshAddress::Private && network.is_none() {
            return Err(
                "--ssh-address private needs --network (the private network to reach servers on)"
                    .into(),
            );
        }
        let api = HcloudApi::new(
            &config.endpoint,
            config.token,
            config.telemetry,
            config.timing.client,
        )?;
        Ok(HetznerCloud {
            api,
            provider: config.provider_instance,
            image: config.image.trim().to_owned(),
            locations,
            ssh,
            network,
            ssh_address: config.ssh_address,
            network_id: tokio::sync::OnceCell::new(),
            hook: config.bootstrap_hook,
            base_user_data: config.base_user_data.map(Secret::new),
            readiness_command: config.readiness_command.filter(|c| !c.trim().is_empty()),
            eur_usd,
            telemetry: config.telemetry,
            timing: config.timing,
            label_locks: Mutex::new(HashMap::new()),
            ready_sessions: tokio::sync::Mutex::new(HashMap::new()),
        })
    }

    /// Whether Configure and Drain can reach servers (an `--ssh-key` was given).
    pub fn ssh_enabled(&self) -> bool {
        self.ssh.is_some()
    }

    async fn timed<T>(
        &self,
        op: &'static str,
        work: impl Future<Output = Result<T, BackendError>>,
    ) -> Result<T, BackendError> {
        let started = std::time::Instant::now();
        let result = work.await;
        self.telemetry
            .api_call(op, result.is_ok(), started.elapsed());
        result
    }

    /// Whether `server`'s labels prove that this provider instance owns it.
    fn is_ours(&self, server: &models::Server) -> bool {
        server.labels.get(labels::MANAGED).map(String::as_str) == Some("true")
            && match labels::text_of(&server.labels, labels::PROVIDER) {
                Some(provider) => provider == self.provider,
                None => self.is_legacy_ours(server),
            }
    }

    /// A server made by the reference provider (or an older version) has no provider label.
    /// It is ours when its machine id is one of this instance's slot ids (`<provider>/…`) and
    /// it runs in one of our locations; it is claimed (labelled) on first use.
    fn is_legacy_ours(&self, server: &models::Server) -> bool {
        !server.labels.contains_key(labels::PROVIDER)
            && self.locations.contains(&server.location.name)
            && labels::machine_id_of(&server.labels)
                .is_some_and(|id| id.starts_with(&format!("{}/", self.provider)))
    }

    /// Stamps this instance's provider label on a server adopted from an earlier version, so
    /// every later read selects it directly.
    async fn claim_if_legacy(
        &self,
        server: &models::Server,
        deadline: Instant,
    ) -> Result<(), String> {
        if server.labels.contains_key(labels::PROVIDER) {
            return Ok(());
        }
        tracing::info!(server = server.id, provider = %self.provider, "claiming a server created without a provider label (earlier provider version)");
        let pairs = labels::text_labels(labels::PROVIDER, &self.provider);
        self.update_labels(server.id, deadline, |l| {
            labels::set_chunked(l, labels::PROVIDER, pairs.clone())
        })
        .await
    }

    /// Whether `server` is ours and carries `machine_id` (or, for an adopted orphan without a
    /// machine-id label, is recorded under its own server id).
    fn is_machines(&self, server: &models::Server, machine_id: &str) -> bool {
        self.is_ours(server)
            && match labels::machine_id_of(&server.labels) {
                Some(id) => id == machine_id,
                None => machine_id == server.id.to_string(),
            }
    }

    fn to_owned_host(&self, server: &models::Server) -> Option<OwnedHost> {
        let machine_id = match labels::machine_id_of(&server.labels) {
            Some(id) => id,
            // An owned server without a decodable machine id is reported under its server id,
            // but only while it runs, as the reference does.
            None if is_running(server.status) => server.id.to_string(),
            None => return None,
        };
        Some(OwnedHost {
            id: server.id.to_string(),
            machine_id,
            instance_type: server.server_type.name.clone(),
            zone: server.location.name.clone(),
            public_ipv4: ipv4_of(server),
            cluster: labels::text_of(&server.labels, labels::CLUSTER).filter(|c| !c.is_empty()),
            running: is_running(server.status),
        })
    }

    /// Every server of ours labelled as `machine_id`, oldest first, whatever its status.
    async fn machine_servers(
        &self,
        machine_id: &str,
        deadline: Instant,
    ) -> Result<Vec<models::Server>, ApiError> {
        // No provider label in the selector: servers of earlier versions lack it, and
        // `is_ours` decides ownership either way.
        let mut pairs = vec![(labels::MANAGED.to_owned(), "true".to_owned())];
        pairs.extend(labels::machine_id_labels(machine_id));
        let mut found: Vec<models::Server> = self
            .api
            .list_servers(&labels::selector(&pairs), Some(deadline))
            .await?
            .into_iter()
            .filter(|s| {
                self.is_ours(s) && labels::machine_id_of(&s.labels).as_deref() == Some(machine_id)
            })
            .collect();
        found.sort_by_key(|s| s.id);
        Ok(found)
    }

    /// The live server a previous Create made for `machine_id`, if any.
    async fn find_machine_server(
        &self,
        machine_id: &str,
        deadline: Instant,
    ) -> Result<Option<models::Server>, ApiError> {
        let live: Vec<models::Server> = self
            .machine_servers(machine_id, deadline)
            .await?
            .into_iter()
            .filter(|s| s.status != models::server::Status::Deleting)
            .collect();
        if live.len() > 1 {
            let ids: Vec<i64> = live.iter().map(|s| s.id).collect();
            tracing::warn!(machine = machine_id, servers = ?ids, "several servers carry one machine id; using the oldest");
        }
        Ok(live.into_iter().next())
    }

    /// The id of `--network`, resolved once (by id or by name).
    async fn network_id(&self, deadline: Instant) -> Result<Option<i64>, String> {
        let Some(network) = &self.network else {
            return Ok(None);
        };
        let id = self
            .network_id
            .get_or_try_init(|| async {
                self.api
                    .network(network, Some(deadline))
                    .await
                    .map_err(|e| format!("resolve network {network}: {e}"))?
                    .map(|n| n.id)
                    .ok_or_else(|| format!("unknown network {network:?}"))
            })
            .await?;
        Ok(Some(*id))
    }

    /// The per-server lock that serialises this process's label writes on one server.
    fn label_lock(&self, id: i64) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.label_locks.lock().unwrap_or_else(|e| e.into_inner());
        locks.retain(|_, lock| Arc::strong_count(lock) > 1);
        locks.entry(id).or_default().clone()
    }

    /// Applies `change` to the server's labels: read, modify, write, re-read and verify.
    async fn update_labels(
        &self,
        id: i64,
        deadline: Instant,
        change: impl Fn(&mut HashMap<String, String>),
    ) -> Result<(), String> {
        let lock = self.label_lock(id);
        let _held = lock.lock().await;
        for _ in 0..3 {
            let server = self
                .api
                .get_server(id, Some(deadline))
                .await
                .map_err(|e| e.to_string())?
                .ok_or_else(|| format!("server {id} not found"))?;
            let mut wanted = server.labels.clone();
            change(&mut wanted);
            if wanted == server.labels {
                return Ok(());
            }
            self.api
                .replace_labels(id, wanted, Some(deadline))
                .await
                .map_err(|e| e.to_string())?;
            let now = self
                .api
                .get_server(id, Some(deadline))
                .await
                .map_err(|e| e.to_string())?
                .ok_or_else(|| format!("server {id} vanished during a label update"))?;
            let mut check = now.labels.clone();
            change(&mut check);
            if check == now.labels {
                return Ok(());
            }
            tracing::warn!(
                server = id,
                "a concurrent label update overwrote ours; re-applying it"
            );
        }
        Err(format!(
            "server {id}: labels kept changing underneath three consecutive updates"
        ))
    }

    async fn wait_running(
        &self,
        id: i64,
        ctx: &TransitionContext,
    ) -> Result<models::Server, BackendError> {
        let cap = Instant::now() + self.timing.running_cap;
        let deadline = ctx.deadline.min(cap);
        loop {
            // The server exists: a run of 429s or 5xx answers while polling is no reason to
            // give up on it (and leave it running untracked) while the deadline allows more.
            let polled = self.api.get_server(id, Some(deadline)).await;
            let left = deadline.saturating_duration_since(Instant::now());
            let server = match polled {
                Ok(Some(server)) => Some(server),
                Ok(None) => return Err(err(format!("server {id} vanished while creating"))),
                Err(e) if is_passing(&e) && !left.is_zero() => {
                    tracing::warn!(server = id, err = %e, "polling the new server failed; polling on");
                    None
                }
                Err(e) => return Err(err(format!("poll server {id}: {e}"))),
            };
            if let Some(server) = server
                && server.status == models::server::Status::Running
            {
                return Ok(server);
            }
            if left.is_zero() {
                return Err(if cap <= ctx.deadline {
                    err(format!(
                        "server {id} did not reach running within {:?}",
                        self.timing.running_cap
                    ))
                } else {
                    err(format!("waiting for server {id} to run: deadline exceeded"))
                });
            }
            tokio::select! {
                _ = tokio::time::sleep(self.timing.running_poll.min(left)) => {}
                _ = ctx.cancel.cancelled() => {
                    return Err(err(format!("waiting for server {id} to run: cancelled")));
                }
            }
        }
    }

    async fn create(
        &self,
        machine: &Machine,
        ctx: &TransitionContext,
    ) -> Result<OwnedHost, BackendError> {
        let deadline = ctx.deadline;
        let server_type = &machine.instance_type;
        let owned = |server: &models::Server| {
            self.to_owned_host(server)
                .ok_or_else(|| err(format!("server {} has no machine-id label", server.id)))
        };
        if let Some(existing) = self
            .find_machine_server(&machine.id, deadline)
            .await
            .map_err(|e| err(format!("look up existing servers: {e}")))?
        {
            tracing::info!(machine = %machine.id, server = existing.id, "adopting the server a previous Create made");
            self.claim_if_legacy(&existing, deadline)
                .await
                .map_err(|e| err(format!("claim server {}: {e}", existing.id)))?;
            let server = self.wait_running(existing.id, ctx).await?;
            return owned(&server);
        }
        if !self.locations.contains(&machine.zone) {
            let mut known: Vec<&String> = self.locations.iter().collect();
            known.sort();
            return Err(err(format!(
                "location {:?} is not one of this provider's locations {known:?}",
                machine.zone
            )));
        }
        let kind = self
            .api
            .server_type(server_type, Some(deadline))
            .await
            .map_err(|e| err(format!("resolve server type {server_type}: {e}")))?
            .ok_or_else(|| err(format!("unknown server type {server_type:?}")))?;
        let image = self
            .api
            .image(&self.image, kind.architecture, Some(deadline))
            .await
            .map_err(|e| err(format!("resolve image {}: {e}", self.image)))?
            .ok_or_else(|| {
                err(format!(
                    "unknown image {:?} for architecture {}",
                    self.image,
                    arch_name(kind.architecture)
                ))
            })?;
        let location = self
            .api
            .location(&machine.zone, Some(deadline))
            .await
            .map_err(|e| err(format!("resolve location {}: {e}", machine.zone)))?
            .ok_or_else(|| err(format!("unknown location {:?}", machine.zone)))?;
        let network = self.network_id(deadline).await.map_err(err)?;
        let host_key = HostKey::generate().map_err(err)?;
        let user_data = provider_core::userdata::assemble(
            self.base_user_data.as_ref().map(Secret::expose),
            &host_key.cloud_config(),
        );
        let mut server_labels: HashMap<String, String> = HashMap::new();
        server_labels.insert(labels::MANAGED.into(), "true".into());
        server_labels.extend(labels::machine_id_labels(&machine.id));
        server_labels.extend(labels::text_labels(labels::PROVIDER, &self.provider));
        server_labels.insert(
            labels::HOST_KEY_FP.into(),
            host_key.fingerprint().to_owned(),
        );
        let name = labels::server_name(&machine.id);
        let request = models::CreateServerRequest {
            name: name.clone(),
            server_type: kind.name.clone(),
            image: image.id.to_string(),
            location: Some(location.name.clone()),
            user_data: Some(user_data),
            labels: Some(server_labels),
            networks: network.map(|id| vec![id]),
            ..Default::default()
        };
        let mut attempt = 0u32;
        let created = loop {
            attempt += 1;
            match self.api.create_server(&request, Some(deadline)).await {
                Ok(server) => break server,
                Err(e) if e.code() == Some("uniqueness_error") || e.is_ambiguous() => {
                    // The name is taken or the response was lost: the server may exist. Adopt
                    // it only if its labels say it is this machine's.
                    let found = self.machine_servers(&machine.id, deadline).await.map_err(
                        |le| {
                            err(format!(
                                "create server {server_type}: {e}; look up after the failure: {le}"
                            ))
                        },
                    )?;
                    if let Some(server) = found
                        .into_iter()
                        .find(|s| s.status != models::server::Status::Deleting)
                    {
                        tracing::info!(machine = %machine.id, server = server.id, err = %e, "create failed but the server exists; adopting it");
                        break server;
                    }
                    // Who holds the name? Only this machine's previous server, still being
                    // deleted, is worth waiting for (as is a name freed in the meantime).
                    if e.code() == Some("uniqueness_error") {
                        let holder = self.api.server_by_name(&name, Some(deadline)).await.map_err(|le| {
                            err(format!("create server {server_type}: {e}; look up the name's holder: {le}"))
                        })?;
                        if let Some(holder) = holder
                            && !(self.is_machines(&holder, &machine.id)
                                && holder.status == models::server::Status::Deleting)
                        {
                            return Err(err(format!(
                                "create server {server_type}: the name {name} is taken by server {} \
                                 that is not labelled as machine {:?} of provider {:?}; refusing to adopt it",
                                holder.id, machine.id, self.provider
                            )));
                        }
                    }
                    let wait = self.timing.client.backoff.delay(attempt, None);
                    if Instant::now() + wait >= deadline
                        || attempt >= self.timing.client.backoff.max_attempts
                    {
                        return Err(err(format!("create server {server_type}: {e}")));
                    }
                    tracing::warn!(machine = %machine.id, err = %e, "create failed without a server; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = ctx.cancel.cancelled() => return Err(err(format!("create server {server_type}: {e}"))),
                    }
                }
                Err(e) => return Err(err(format!("create server {server_type}: {e}"))),
            }
        };
        tracing::info!(machine = %machine.id, server = created.id, name = %name, "server created");
        let server = self.wait_running(created.id, ctx).await?;
        owned(&server)
    }

    /// The server behind `host_id`, checked to belong to `machine`, and the address SSH goes
    /// to (`--ssh-address`).
    async fn resolve_host(
        &self,
        what: &str,
        machine: &Machine,
        host_id: &str,
        deadline: Instant,
    ) -> Result<(models::Server, String), BackendError> {
        let id = server_id(host_id, what)?;
        let server = self
            .api
            .get_server(id, Some(deadline))
            .await
            .map_err(|e| err(format!("{what}: look up server {id}: {e}")))?
            .ok_or_else(|| err(format!("{what}: server {id} not found")))?;
        if !self.is_machines(&server, &machine.id) {
            return Err(err(format!(
                "{what}: server {id} is not labelled as machine {:?} of provider {:?}; refusing to touch it",
                machine.id, self.provider
            )));
        }
        self.claim_if_legacy(&server, deadline)
            .await
            .map_err(|e| err(format!("{what}: claim server {id}: {e}")))?;
        let ip = match self.ssh_address {
            SshAddress::Public => ipv4_of(&server).ok_or_else(|| {
                err(format!(
                    "{what}: server {id} has no public IPv4 for SSH delivery"
                ))
            })?,
            SshAddress::Private => {
                let network = self
                    .network_id(deadline)
                    .await
                    .map_err(|e| err(format!("{what}: {e}")))?;
                server
                    .private_net
                    .iter()
                    .find(|p| p.network == network)
                    .and_then(|p| p.ip.clone())
                    .filter(|ip| !ip.is_empty())
                    .ok_or_else(|| {
                        err(format!(
                            "{what}: server {id} has no address on network {} for SSH delivery",
                            self.network.as_deref().unwrap_or_default()
                        ))
                    })?
            }
        };
        Ok((server, ip))
    }

    /// Opens the pinned SSH connection, pinning on first use when the server has no pin.
    ///
    /// A key trusted on first use is recorded in the `bigfleet-host-key-fp` label before the
    /// connection is handed out: an unrecorded pin would leave every later connection on
    /// trust-on-first-use, so nothing is sent until the label write has succeeded. While it
    /// fails, the connection is closed and the write retried until the transition's deadline;
    /// once recorded, a fresh connection is opened and verified against that pin.
    async fn open_ssh(
        &self,
        identity: &SshIdentity,
        server: &models::Server,
        ip: &str,
        ctx: &TransitionContext,
    ) -> Result<PinnedSession, BackendError> {
        let pin = server
            .labels
            .get(labels::HOST_KEY_FP)
            .filter(|p| !p.is_empty());
        let session = ssh::connect(
            identity,
            ip,
            pin.map(String::as_str),
            self.timing.ssh,
            ctx.deadline,
            &ctx.cancel,
        )
        .await
        .map_err(|e| err(e.to_string()))?;
        if !session.first_use {
            return Ok(session);
        }
        tracing::warn!(server = server.id, fingerprint = %session.observed, "pinning SSH host key on first use (no pre-injected key)");
        let observed = session.observed.clone();
        let record = || {
            self.update_labels(server.id, ctx.deadline, |l| {
                l.insert(labels::HOST_KEY_FP.to_owned(), observed.clone());
            })
        };
        let mut last = match record().await {
            Ok(()) => return Ok(session),
            Err(e) => e,
        };
        // Nothing has been sent over this connection; do not hold it while the write is retried.
        session.close().await;
        loop {
            tracing::warn!(server = server.id, err = %last, "failed to persist TOFU host-key pin; nothing is sent to the server until it is recorded");
            let left = ctx.deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || ctx.cancel.is_cancelled() {
                return Err(err(format!(
                    "ssh {ip}: server {id} presented host key {observed} on first use, but it \
                     could not be recorded in label {label} before the deadline ({last}); \
                     nothing was sent over an unrecorded pin",
                    id = server.id,
                    label = labels::HOST_KEY_FP,
                )));
            }
            tokio::select! {
                _ = tokio::time::sleep(self.timing.ssh.retry_interval.min(left)) => {}
                _ = ctx.cancel.cancelled() => {}
            }
            if ctx.cancel.is_cancelled() {
                continue;
            }
            match record().await {
                Ok(()) => break,
                Err(e) => last = e,
            }
        }
        ssh::connect(
            identity,
            ip,
            Some(&observed),
            self.timing.ssh,
            ctx.deadline,
            &ctx.cancel,
        )
        .await
        .map_err(|e| err(e.to_string()))
    }

    async fn configure(
        &self,
        machine: &Machine,
        host_id: &str,
        order: &ConfigureOrder,
        ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        let Some(identity) = &self.ssh else {
            return Err(err(format!(
                "configure: SSH delivery disabled (set --ssh-key); cannot deliver bootstrap to {host_id}"
            )));
        };
        let (server, ip) = self
            .resolve_host("configure", machine, host_id, ctx.deadline)
            .await?;
        let session = self.open_ssh(identity, &server, &ip, ctx).await?;
        let script = ssh::configure_script(&self.hook, &order.cluster_id, order.blob.0.len());
        let exit = session
            .run(&script, &order.blob.0, ctx.deadline, &ctx.cancel)
            .await
            .map_err(|e| err(e.to_string()))?;
        if exit.status != 0 {
            session.close().await;
            return Err(err(format!(
                "ssh command on {ip} failed: Process exited with status {}",
                exit.status
            )));
        }
        let binding = labels::text_labels(labels::CLUSTER, &order.cluster_id);
        if let Err(e) = self
            .update_labels(server.id, ctx.deadline, |l| {
                labels::set_chunked(l, labels::CLUSTER, binding.clone())
            })
            .await
        {
            session.close().await;
            return Err(err(format!("label cluster binding: {e}")));
        }
        tracing::info!(machine = %machine.id, server = server.id, "bootstrap delivered and hook succeeded");
        if self.readiness_command.is_some() {
            self.ready_sessions.lock().await.insert(server.id, session);
        } else {
            session.close().await;
        }
        Ok(())
    }

    async fn ready(
        &self,
        machine: &Machine,
        host_id: &str,
        ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        let Some(command) = &self.readiness_command else {
            return Ok(());
        };
        let id = server_id(host_id, "readiness")?;
        let kept = self.ready_sessions.lock().await.remove(&id);
        let session = match kept {
            Some(session) => session,
            None => {
                let Some(identity) = &self.ssh else {
                    return Err(err("readiness: SSH delivery disabled (set --ssh-key)"));
                };
                let (server, ip) = self
                    .resolve_host("readiness", machine, host_id, ctx.deadline)
                    .await?;
                self.open_ssh(identity, &server, &ip, ctx).await?
            }
        };
        let ip = session.ip().to_owned();
        let mut last: Option<String> = None;
        let last = loop {
            match session.run(command, b"", ctx.deadline, &ctx.cancel).await {
                Ok(exit) if exit.status == 0 => {
                    session.close().await;
                    return Ok(());
                }
                Ok(exit) => last = Some(format!("last exit status {}", exit.status)),
                // A run cut short by the deadline says less than the one before it.
                Err(e) if last.is_none() || Instant::now() < ctx.deadline => {
                    last = Some(e.to_string())
                }
                Err(_) => {}
            }
            let last = last.clone().unwrap_or_default();
            let left = ctx.deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || ctx.cancel.is_cancelled() {
                break last;
            }
            tokio::select! {
                _ = tokio::time::sleep(self.timing.readiness_poll.min(left)) => {}
                _ = ctx.cancel.cancelled() => break last,
            }
        };
        session.close().await;
        Err(err(format!(
            "readiness: --readiness-command did not succeed on {ip} before the Configure deadline ({last})"
        )))
    }

    async fn drain(
        &self,
        machine: &Machine,
        host_id: &str,
        grace_period_seconds: i64,
        ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        let Some(identity) = &self.ssh else {
            return Err(err(format!(
                "drain: server {host_id} cannot be drained without --ssh-key: the node would stay \
                 joined to its cluster, so the binding is kept; set --ssh-key and retry"
            )));
        };
        let (server, ip) = self
            .resolve_host("drain", machine, host_id, ctx.deadline)
            .await?;
        if let Some(stale) = self.ready_sessions.lock().await.remove(&server.id) {
            stale.close().await;
        }
        let session = self.open_ssh(identity, &server, &ip, ctx).await?;
        let grace = if grace_period_seconds <= 0 {
            1
        } else {
            grace_period_seconds
        };
        let exit = session
            .run(&ssh::drain_script(grace), b"", ctx.deadline, &ctx.cancel)
            .await;
        session.close().await;
        let exit = exit.map_err(|e| err(e.to_string()))?;
        if exit.status != 0 {
            return Err(err(format!(
                "ssh command on {ip} failed: Process exited with status {}",
                exit.status
            )));
        }
        self.update_labels(server.id, ctx.deadline, |l| {
            labels::remove_chunked(l, labels::CLUSTER)
        })
        .await
        .map_err(|e| err(format!("drain: clear cluster binding: {e}")))?;
        tracing::info!(machine = %machine.id, server = server.id, "node drained and binding cleared");
        Ok(())
    }

    async fn delete(&self, host_id: &str, ctx: &TransitionContext) -> Result<(), BackendError> {
        let id = server_id(host_id, "delete")?;
        let Some(server) = self
            .api
            .get_server(id, Some(ctx.deadline))
            .await
            .map_err(|e| err(format!("delete: lookup server {id}: {e}")))?
        else {
            return Ok(());
        };
        if !self.is_ours(&server) {
            return Err(err(format!(
                "delete: server {id} is not labelled as owned by provider {:?}; refusing to delete it",
                self.provider
            )));
        }
        if let Some(stale) = self.ready_sessions.lock().await.remove(&id) {
            stale.close().await;
        }
        self.api
            .delete_server(id, Some(ctx.deadline))
            .await
            .map_err(|e| err(format!("delete: delete server {id}: {e}")))?;
        tracing::info!(server = id, "server deleted");
        Ok(())
    }

    async fn price(&self, server_type: &str, location: &str) -> Result<f64, BackendError> {
        let deadline = Instant::now() + self.timing.lookup_budget;
        let kind = self
            .api
            .server_type(server_type, Some(deadline))
            .await
            .map_err(|e| err(e.to_string()))?
            .ok_or_else(|| err(format!("unknown server type {server_type:?}")))?;
        let entry = kind
            .prices
            .iter()
            .find(|p| p.location == location)
            .ok_or_else(|| err(format!("no pricing for {server_type} in {location}")))?;
        let eur: f64 = entry.price_hourly.net.trim().parse().map_err(|e| {
            err(format!(
                "parse hourly price for {server_type}/{location}: {e}"
            ))
        })?;
        if !eur.is_finite() || eur < 0.0 {
            return Err(err(format!(
                "parse hourly price for {server_type}/{location}: {eur} is not a price"
            )));
        }
        Ok(eur * self.eur_usd)
    }

    async fn lookup_capacities(
        &self,
        types: &[String],
    ) -> Result<HashMap<String, Capacity>, BackendError> {
        let deadline = Instant::now() + self.timing.lookup_budget;
        let mut out = HashMap::new();
        for name in types {
            let Some(kind) = self
                .api
                .server_type(name, Some(deadline))
                .await
                .map_err(|e| err(format!("resolve server type {name}: {e}")))?
            else {
                continue;
            };
            let vcpus = u32::try_from(kind.cores).unwrap_or(0);
            let memory_mib = (kind.memory * 1024.0).round();
            if vcpus == 0 || !memory_mib.is_finite() || memory_mib <= 0.0 {
                continue;
            }
            out.insert(
                name.clone(),
                Capacity {
                    vcpus,
                    memory_mib: memory_mib as u64,
                },
            );
        }
        Ok(out)
    }
}

fn arch_name(arch: models::Architecture) -> &'static str {
    match arch {
        models::Architecture::Arm => "arm",
        models::Architecture::X86 => "x86",
    }
}

#[async_trait]
impl Cloud for HetznerCloud {
    async fn create_host(
        &self,
        machine: &Machine,
        ctx: &TransitionContext,
    ) -> Result<OwnedHost, BackendError> {
        self.timed("CreateServer", async {
            self.create(machine, ctx).await.map_err(|e| {
                if e.0.starts_with("create server ") {
                    e
                } else {
                    err(format!("create server {}: {}", machine.instance_type, e.0))
                }
            })
        })
        .await
    }

    async fn list_hosts(&self) -> Result<Vec<OwnedHost>, BackendError> {
        self.timed("DescribeManaged", async {
            let deadline = Instant::now() + self.timing.list_budget;
            let mut servers = self
                .api
                .list_servers(&labels::instance_selector(&self.provider), Some(deadline))
                .await
                .map_err(|e| err(format!("describe managed servers: {e}")))?;
            let legacy = self
                .api
                .list_servers(&labels::legacy_selector(), Some(deadline))
                .await
                .map_err(|e| err(format!("describe managed servers: {e}")))?;
            servers.extend(legacy.into_iter().filter(|s| self.is_legacy_ours(s)));
            Ok(servers
                .iter()
                .filter(|s| s.status != models::server::Status::Deleting)
                .filter(|s| self.is_ours(s) && self.locations.contains(&s.location.name))
                .filter_map(|s| self.to_owned_host(s))
                .collect())
        })
        .await
    }

    async fn machine_hosts(
        &self,
        machine_id: &str,
    ) -> Result<Option<Vec<OwnedHost>>, BackendError> {
        self.timed("DescribeMachine", async {
            let deadline = Instant::now() + self.timing.list_budget;
            let servers = self
                .machine_servers(machine_id, deadline)
                .await
                .map_err(|e| err(format!("list servers of {machine_id}: {e}")))?;
            Ok(Some(
                servers
                    .iter()
                    .filter(|s| s.status != models::server::Status::Deleting)
                    .filter_map(|s| self.to_owned_host(s))
                    .collect(),
            ))
        })
        .await
    }

    async fn host_present(&self, host_id: &str) -> Result<Option<bool>, BackendError> {
        let id = server_id(host_id, "read")?;
        let deadline = Instant::now() + self.timing.list_budget;
        let server = self
            .api
            .get_server(id, Some(deadline))
            .await
            .map_err(|e| err(format!("read server {id}: {e}")))?;
        Ok(Some(server.is_some_and(|s| {
            s.status != models::server::Status::Deleting && self.is_ours(&s)
        })))
    }

    async fn configure_host(
        &self,
        machine: &Machine,
        host_id: &str,
        order: &ConfigureOrder,
        ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        self.timed("Configure", self.configure(machine, host_id, order, ctx))
            .await
    }

    fn has_readiness_gate(&self) -> bool {
        self.readiness_command.is_some()
    }

    async fn confirm_ready(
        &self,
        machine: &Machine,
        host_id: &str,
        _cluster_id: &str,
        ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        self.timed("Readiness", self.ready(machine, host_id, ctx))
            .await
    }

    async fn drain_host(
        &self,
        machine: &Machine,
        host_id: &str,
        grace_period_seconds: i64,
        ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        self.timed(
            "Drain",
            self.drain(machine, host_id, grace_period_seconds, ctx),
        )
        .await
    }

    async fn delete_host(
        &self,
        host_id: &str,
        ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        self.timed("DeleteServer", self.delete(host_id, ctx)).await
    }

    async fn price_usd(&self, instance_type: &str, zone: &str) -> Result<f64, BackendError> {
        self.timed("ServerTypePricing", self.price(instance_type, zone))
            .await
    }

    async fn capacities(
        &self,
        instance_types: &[String],
    ) -> Result<HashMap<String, Capacity>, BackendError> {
        self.timed("ServerType", self.lookup_capacities(instance_types))
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(endpoint: String) -> HetznerConfig {
        HetznerConfig {
            token: Secret::new("unit-token"),
            endpoint,
            provider_instance: "unit".into(),
            image: "ubuntu-24.04".into(),
            locations: vec!["nbg1".into()],
            ssh: None,
            network: None,
            ssh_address: SshAddress::Public,
            bootstrap_hook: "/opt/bigfleet/bootstrap".into(),
            base_user_data: None,
            readiness_command: None,
            eur_usd: 1.08,
            telemetry: Telemetry::new("bigfleet_hetzner_unit"),
            timing: Timing::default(),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_label_updates_on_one_server_are_all_kept() {
        let emulator = hcloud_emulator::Emulator::start("unit-token")
            .await
            .unwrap();
        let id = emulator.insert_server("s", "cx22", "nbg1", HashMap::new(), "127.0.0.1");
        let cloud = Arc::new(HetznerCloud::new(config(emulator.endpoint())).unwrap());
        let deadline = Instant::now() + Duration::from_secs(20);
        let tasks: Vec<_> = (0..16)
            .map(|i| {
                let cloud = cloud.clone();
                tokio::spawn(async move {
                    cloud
                        .update_labels(id, deadline, |l| {
                            l.insert(format!("k{i}"), format!("v{i}"));
                        })
                        .await
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap().unwrap();
        }
        let labels = emulator.server(id).unwrap().labels;
        assert_eq!(labels.len(), 16, "{labels:?}");
        assert!((0..16).all(|i| labels[&format!("k{i}")] == format!("v{i}")));
        assert!(
            cloud.label_locks.lock().unwrap().len() <= 1,
            "locks do not pile up"
        );
    }

    #[test]
    fn config_validation() {
        let ok = HetznerCloud::new(config("http://127.0.0.1:1/v1".into()));
        assert!(ok.is_ok());
        type Breaker = Box<dyn Fn(&mut HetznerConfig)>;
        let cases: Vec<(Breaker, &str)> = vec![
            (
                Box::new(|c| c.token = Secret::new("")),
                "hcloud: token is required for the hetzner backend",
            ),
            (
                Box::new(|c| c.image = " ".into()),
                "hcloud: --image is required for the hetzner backend",
            ),
            (
                Box::new(|c| c.locations.clear()),
                "hcloud: no locations configured (every offering names one)",
            ),
            (
                Box::new(|c| c.bootstrap_hook.clear()),
                "hcloud: --bootstrap-hook must not be empty",
            ),
            (
                Box::new(|c| c.ssh_address = SshAddress::Private),
                "--ssh-address private needs --network (the private network to reach servers on)",
            ),
        ];
        for (breaker, message) in cases {
            let mut c = config("http://127.0.0.1:1/v1".into());
            breaker(&mut c);
            assert_eq!(HetznerCloud::new(c).unwrap_err(), message);
        }
        let mut c = config("http://127.0.0.1:1/v1".into());
        c.eur_usd = -3.0;
        assert_eq!(HetznerCloud::new(c).unwrap().eur_usd, DEFAULT_EUR_USD);
    }
}

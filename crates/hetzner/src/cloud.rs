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
//! it last polled the hook over is then kept for [`Cloud::confirm_ready`], which runs the
//! command over it (a new pinned connection if it drops) until it exits 0 or the Configure
//! deadline passes.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::models;
use async_trait::async_trait;
use provider_core::backend::{BackendError, ConfigureOrder, TransitionContext};
use provider_core::cloud::{Capacity, Cloud, InventorySignal, OwnedHost};
use provider_core::machine::Machine;
use provider_core::telemetry::Telemetry;
use tokio::time::Instant;

use crate::api::{ApiError, ClientTiming, HcloudApi};
use crate::labels;
use crate::resolve::Plan;
use crate::settings::{OfferingSpec, Placement, ServerSpec};
use crate::ssh::{PinnedSession, SshConfig, SshIdentity, SshTiming};
use provider_core::config::Secret;

/// The reference's default `--eur-usd`.
pub const DEFAULT_EUR_USD: f64 = 1.08;

pub use crate::settings::SshAddress;

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
    /// The server settings given by flags (`--image`, `--network`, `--ssh-address`, ...):
    /// used as they are for a server type and location no offering names.
    pub server: ServerSpec,
    /// Every offering's effective settings (flags overridden by its fields); may be empty.
    pub offerings: Vec<OfferingSpec>,
    /// The locations of the offerings; inventory is limited to them.
    pub locations: Vec<String>,
    /// `--ssh-key` / `--ssh-user` / `--ssh-port`; `None` disables Configure and Drain.
    pub ssh: Option<SshConfig>,
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
            .field("server", &self.server)
            .field("offerings", &self.offerings)
            .field("locations", &self.locations)
            .field("ssh", &self.ssh)
            .field("bootstrap_hook", &self.bootstrap_hook)
            .field("base_user_data", &user_data)
            .field("readiness_command", &self.readiness_command)
            .field("eur_usd", &self.eur_usd)
            .field("telemetry", &self.telemetry)
            .field("timing", &self.timing)
            .finish()
    }
}

/// The longest a batched read waits for other demands to join its round.
const GATHER_CAP: Duration = Duration::from_millis(250);

/// Pacing of polls and retries; the defaults suit the real API, tests shorten them.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    pub client: ClientTiming,
    pub ssh: SshTiming,
    /// The base interval of the polls of a booting server: they start at three quarters of
    /// its offering's typical boot time as this process saw it (at half this interval before
    /// it saw one), no sooner than half this interval apart, and grow to twice it (see
    /// [`provider_core::batch::PollSchedule`]).
    pub running_poll: Duration,
    /// Own cap on waiting for `running` (the Create deadline normally ends it first).
    pub running_cap: Duration,
    /// Interval between readiness-command runs.
    pub readiness_poll: Duration,
    /// Interval between reads of a detached run's record (the bootstrap hook, the drain).
    pub run_poll: Duration,
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
            run_poll: Duration::from_secs(2),
            list_budget: Duration::from_secs(60),
            lookup_budget: Duration::from_secs(30),
        }
    }
}

/// The real Hetzner Cloud backend.
pub struct HetznerCloud {
    pub(crate) api: HcloudApi,
    pub(crate) provider: String,
    /// The flags' settings, for a server type and location no offering names.
    pub(crate) server: ServerSpec,
    pub(crate) offerings: Vec<OfferingSpec>,
    pub(crate) locations: HashSet<String>,
    pub(crate) ssh: Option<SshIdentity>,
    /// Resolved settings per (server type, location), each resolved once and again at the
    /// price-refresh cadence ([`HetznerCloud::refresh_plans`]).
    pub(crate) plans: PlanCache,
    /// Where the offerings' plans are kept between runs (`plans.json` beside a local state).
    pub(crate) plan_file: Option<crate::plan_cache::PlanFile>,
    /// The digest of the settings, endpoint and token a saved plan file must match.
    pub(crate) plan_fingerprint: String,
    pub(crate) spread: crate::placement::SpreadGroups,
    pub(crate) hook: String,
    pub(crate) base_user_data: Option<Secret>,
    pub(crate) readiness_command: Option<String>,
    pub(crate) eur_usd: f64,
    pub(crate) telemetry: Telemetry,
    pub(crate) timing: Timing,
    pub(crate) label_locks: Mutex<HashMap<i64, Arc<tokio::sync::Mutex<()>>>>,
    /// Connections kept from a successful configure for the readiness gate, by server id.
    pub(crate) ready_sessions: tokio::sync::Mutex<HashMap<i64, PinnedSession>>,
    /// The look-ups and boot polls of every transition in flight, one listing per round.
    pub(crate) machine_reads: crate::machine_reads::MachineReads,
    /// How long each offering's servers take to boot, as seen by this process.
    pub(crate) boot: provider_core::batch::BootClock,
    /// The servers carrying this instance's label as of the last listing, with this process's
    /// own creates and deletes since: what the out-of-band check counts against.
    pub(crate) ledger: provider_core::host_ledger::HostLedger,
}

/// One lazily resolved plan per (server type, location).
pub(crate) type PlanCache = Mutex<HashMap<(String, String), Arc<tokio::sync::OnceCell<Arc<Plan>>>>>;

impl std::fmt::Debug for HetznerCloud {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HetznerCloud")
            .field("api", &self.api)
            .field("provider", &self.provider)
            .field("server", &self.server)
            .field("locations", &self.locations)
            .field("ssh", &self.ssh)
            .finish_non_exhaustive()
    }
}

pub(crate) fn err(message: impl Into<String>) -> BackendError {
    BackendError::new(message)
}

pub(crate) fn server_id(host_id: &str, what: &str) -> Result<i64, BackendError> {
    host_id
        .trim()
        .parse::<i64>()
        .map_err(|e| err(format!("{what}: bad server id {host_id:?}: {e}")))
}

/// Whether a failed call may well succeed when repeated later (rate limit, server error, lost
/// connection).
pub(crate) fn is_passing(e: &ApiError) -> bool {
    match e {
        ApiError::Status { status, .. } => *status == 429 || *status >= 500,
        ApiError::Transport(_) => true,
        ApiError::Decode(_) | ApiError::Deadline | ApiError::Config(_) => false,
    }
}

pub(crate) fn is_running(status: models::server::Status) -> bool {
    use models::server::Status;
    matches!(
        status,
        Status::Running | Status::Initializing | Status::Starting
    )
}

pub(crate) fn ipv4_of(server: &models::Server) -> Option<String> {
    server
        .public_net
        .ipv4
        .as_ref()
        .map(|v4| v4.ip.clone())
        .filter(|ip| !ip.is_empty())
}

impl HetznerCloud {
    /// The API client (its budget takes the `--api-budget-*` shares once built).
    pub fn api(&self) -> &HcloudApi {
        &self.api
    }

    /// Validates the configuration (token, settings, endpoint, SSH key) and builds the
    /// backend. Makes no network call; [`HetznerCloud::resolve`] resolves the settings.
    pub fn new(config: HetznerConfig) -> Result<HetznerCloud, String> {
        if config.token.expose().trim().is_empty() {
            return Err("hcloud: token is required for the hetzner backend".into());
        }
        let no_image = |s: &ServerSpec| s.image.trim().is_empty() && s.image_selector.is_empty();
        if no_image(&config.server)
            && (config.offerings.is_empty() || config.offerings.iter().any(|o| no_image(&o.spec)))
        {
            return Err(
                "hcloud: --image is required for the hetzner backend (or --image-selector, or \
                 an image per offering)"
                    .into(),
            );
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
        let mut server = config.server;
        server.image = server.image.trim().to_owned();
        if config.offerings.is_empty() {
            let flags = OfferingSpec {
                server_type: "*".into(),
                location: "*".into(),
                spec: server.clone(),
                overrides: Default::default(),
            };
            crate::settings::check_images(&flags)?;
            flags.validate()?;
        }
        for offering in &config.offerings {
            crate::settings::check_images(offering)?;
            offering.validate()?;
        }
        let plan_fingerprint = crate::plan_cache::fingerprint(
            &config.offerings,
            &config.endpoint,
            config.token.expose(),
        );
        let api = HcloudApi::new(
            &config.endpoint,
            config.token,
            config.telemetry,
            config.timing.client,
        )?;
        Ok(HetznerCloud {
            api: api.clone(),
            provider: config.provider_instance.clone(),
            server,
            offerings: config.offerings,
            locations,
            ssh,
            plans: Mutex::new(HashMap::new()),
            plan_file: None,
            plan_fingerprint,
            spread: crate::placement::SpreadGroups::new(&config.provider_instance),
            hook: config.bootstrap_hook,
            base_user_data: config.base_user_data.map(Secret::new),
            readiness_command: config.readiness_command.filter(|c| !c.trim().is_empty()),
            eur_usd,
            telemetry: config.telemetry,
            timing: config.timing,
            label_locks: Mutex::new(HashMap::new()),
            ready_sessions: tokio::sync::Mutex::new(HashMap::new()),
            machine_reads: crate::machine_reads::MachineReads::new(
                api,
                (config.timing.running_poll / 10).min(GATHER_CAP),
            ),
            boot: provider_core::batch::BootClock::new(),
            ledger: provider_core::host_ledger::HostLedger::default(),
        })
    }

    /// Keeps the offerings' plans in `file` between runs (see [`crate::plan_cache`]).
    pub fn set_plan_file(&mut self, file: Option<crate::plan_cache::PlanFile>) {
        self.plan_file = file;
    }

    /// Prepares every offering's settings before any port binds: from the plans the last run
    /// saved when they were resolved for these settings, endpoint and token (no API call; they
    /// are resolved again at the price-refresh cadence), else from the API now (server types,
    /// locations, prices, images, networks, firewalls, login keys), removing owned spread
    /// groups left empty, so that a broken setting fails here.
    pub async fn resolve(&self) -> Result<(), String> {
        if let Some(plans) = self.saved_plans() {
            tracing::info!(
                offerings = plans.len(),
                "settings: starting with the plans saved by the last run; they are resolved again from the API at the price-refresh cadence"
            );
            self.install(plans);
            return Ok(());
        }
        let deadline = Instant::now() + self.timing.lookup_budget;
        // Saved once the state directory exists ([`Cloud::state_opened`]).
        let plans = self.resolve_offerings(deadline).await?;
        self.install(plans);
        for offering in self
            .offerings
            .iter()
            .filter(|o| o.spec.placement == Placement::Spread)
        {
            if let Err(e) = self
                .spread
                .sweep_groups(
                    &self.api,
                    &offering.server_type,
                    &offering.location,
                    deadline,
                )
                .await
            {
                tracing::warn!(offering = %offering.key(), err = %e, "could not remove empty spread placement groups");
            }
        }
        Ok(())
    }

    /// Resolves every offering's settings again; with problems the plans in use are kept and
    /// the problems returned.
    pub async fn refresh_plans(&self) -> Result<(), String> {
        let deadline = Instant::now() + self.timing.lookup_budget;
        let plans = self.resolve_offerings(deadline).await?;
        self.save_plans(&plans);
        self.install(plans);
        Ok(())
    }

    /// Every offering's plan from the API, or every problem found.
    async fn resolve_offerings(&self, deadline: Instant) -> Result<Vec<Plan>, String> {
        let mut problems = crate::resolve::Problems::default();
        let mut resolver = crate::resolve::Resolver::new(&self.api, deadline);
        let mut plans = Vec::with_capacity(self.offerings.len());
        for offering in &self.offerings {
            if let Some(plan) = resolver.resolve(offering, &mut problems).await {
                plans.push(plan);
            }
        }
        if !problems.0.is_empty() {
            return Err(format!("hcloud: {}", problems.0.join("; ")));
        }
        for why in &problems.1 {
            tracing::warn!(
                why,
                "settings: an offering Hetzner does not sell now; the other offerings are served"
            );
        }
        Ok(plans)
    }

    /// The saved plans, when there is a file for these settings holding one per offering.
    fn saved_plans(&self) -> Option<Vec<Plan>> {
        let plans = self.plan_file.as_ref()?.load(&self.plan_fingerprint)?;
        let saved: HashSet<(&str, &str)> = plans
            .iter()
            .map(|p| (p.server_type.as_str(), p.location.as_str()))
            .collect();
        let complete = saved.len() == self.offerings.len()
            && self
                .offerings
                .iter()
                .all(|o| saved.contains(&(o.server_type.as_str(), o.location.as_str())));
        complete.then_some(plans)
    }

    /// The plans of the offerings in use.
    fn offering_plans(&self) -> Vec<Plan> {
        let cells = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        self.offerings
            .iter()
            .filter_map(|o| cells.get(&(o.server_type.clone(), o.location.clone())))
            .filter_map(|cell| cell.get().map(|plan| Plan::clone(plan)))
            .collect()
    }

    fn save_plans(&self, plans: &[Plan]) {
        if let Some(file) = &self.plan_file {
            file.save(&self.plan_fingerprint, plans);
        }
    }

    /// Makes `plans` the ones every later use sees (uses in flight keep the one they hold).
    fn install(&self, plans: Vec<Plan>) {
        let mut cells = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        for plan in plans {
            let key = (plan.server_type.clone(), plan.location.clone());
            cells.insert(
                key,
                Arc::new(tokio::sync::OnceCell::new_with(Some(Arc::new(plan)))),
            );
        }
    }

    pub(crate) fn plan_cell(
        &self,
        server_type: &str,
        location: &str,
    ) -> Arc<tokio::sync::OnceCell<Arc<Plan>>> {
        let mut plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        plans
            .entry((server_type.to_owned(), location.to_owned()))
            .or_default()
            .clone()
    }

    /// The settings of the offering of `server_type` in `location` (the flags' settings when no
    /// offering names them).
    pub(crate) fn spec_of(&self, server_type: &str, location: &str) -> OfferingSpec {
        self.offerings
            .iter()
            .find(|o| o.server_type == server_type && o.location == location)
            .cloned()
            .unwrap_or_else(|| OfferingSpec {
                server_type: server_type.to_owned(),
                location: location.to_owned(),
                spec: self.server.clone(),
                overrides: Default::default(),
            })
    }

    /// The resolved plan of `server_type` in `location`, resolved on first use and cached.
    pub(crate) async fn plan(
        &self,
        server_type: &str,
        location: &str,
        deadline: Instant,
    ) -> Result<Arc<Plan>, String> {
        let cell = self.plan_cell(server_type, location);
        cell.get_or_try_init(|| async {
            let spec = self.spec_of(server_type, location);
            let mut problems = crate::resolve::Problems::default();
            let plan = crate::resolve::Resolver::new(&self.api, deadline)
                .resolve(&spec, &mut problems)
                .await;
            plan.map(Arc::new).ok_or_else(|| {
                let mut all = problems.0;
                all.extend(problems.1);
                all.join("; ")
            })
        })
        .await
        .cloned()
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
    pub(crate) fn is_ours(&self, server: &models::Server) -> bool {
        server.labels.get(labels::MANAGED).map(String::as_str) == Some("true")
            && match labels::text_of(&server.labels, labels::PROVIDER) {
                Some(provider) => provider == self.provider,
                None => self.is_legacy_ours(server),
            }
    }

    /// A server made by the reference provider (or an older version) has no provider label.
    /// It is ours when its machine id is one of this instance's slot ids (`<provider>/…`) and
    /// it runs in one of our locations; it is claimed (labelled) on first use.
    pub(crate) fn is_legacy_ours(&self, server: &models::Server) -> bool {
        !server.labels.contains_key(labels::PROVIDER)
            && self.locations.contains(&server.location.name)
            && labels::machine_id_of(&server.labels)
                .is_some_and(|id| id.starts_with(&format!("{}/", self.provider)))
    }

    /// Stamps this instance's provider label on a server adopted from an earlier version, so
    /// every later read selects it directly.
    pub(crate) async fn claim_if_legacy(
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
    pub(crate) fn is_machines(&self, server: &models::Server, machine_id: &str) -> bool {
        self.is_ours(server)
            && match labels::machine_id_of(&server.labels) {
                Some(id) => id == machine_id,
                None => machine_id == server.id.to_string(),
            }
    }

    pub(crate) fn to_owned_host(&self, server: &models::Server) -> Option<OwnedHost> {
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

    /// The per-server lock that serialises this process's label writes on one server.
    fn label_lock(&self, id: i64) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.label_locks.lock().unwrap_or_else(|e| e.into_inner());
        locks.retain(|_, lock| Arc::strong_count(lock) > 1);
        locks.entry(id).or_default().clone()
    }

    /// Applies `change` to the server's labels: read, modify, write, and verify on the server
    /// the write answered with.
    pub(crate) async fn update_labels(
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
            let written = self
                .api
                .replace_labels(id, wanted, Some(deadline))
                .await
                .map_err(|e| e.to_string())?;
            // The write answers with the server as it left it: no read is needed to see it,
            // unless the answer came without one.
            let now = match written {
                Some(server) => server,
                None => self
                    .api
                    .get_server(id, Some(deadline))
                    .await
                    .map_err(|e| e.to_string())?
                    .ok_or_else(|| format!("server {id} vanished during a label update"))?,
            };
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

    async fn delete(&self, host_id: &str, ctx: &TransitionContext) -> Result<(), BackendError> {
        let id = server_id(host_id, "delete")?;
        // From here until the answer the server may vanish without that being a change.
        let deleting = self.ledger.deleting(&id.to_string());
        let Some(server) = self
            .api
            .get_server(id, Some(ctx.deadline))
            .await
            .map_err(|e| err(format!("delete: lookup server {id}: {e}")))?
        else {
            deleting.done();
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
        deleting.done();
        tracing::info!(server = id, "server deleted");
        self.spread
            .release_group(&self.api, &server, ctx.deadline)
            .await;
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
        let eur = crate::catalog::price_eur(&kind, location).map_err(err)?;
        Ok(eur * self.eur_usd)
    }

    /// The whole catalogue: `GET /server_types` (one page holds every type today).
    async fn server_types(&self) -> Result<Vec<models::ServerType>, BackendError> {
        let deadline = Instant::now() + self.timing.lookup_budget;
        self.api
            .server_types(Some(deadline))
            .await
            .map_err(|e| err(format!("list server types: {e}")))
    }

    async fn lookup_capacities(
        &self,
        types: &[String],
    ) -> Result<HashMap<String, Capacity>, BackendError> {
        let listed = self.server_types().await?;
        Ok(listed
            .iter()
            .filter(|kind| types.contains(&kind.name))
            .filter_map(|kind| Some((kind.name.clone(), crate::catalog::capacity(kind)?)))
            .collect())
    }

    /// Every server type's capacity, and the price and standing of each offered pair, from one
    /// catalogue read.
    async fn read_catalogue(
        &self,
        pairs: &[(String, String)],
    ) -> Result<provider_core::catalogue::Catalogue, BackendError> {
        use provider_core::catalogue::{Entry, Standing};
        let listed = self.server_types().await?;
        let capacities = listed
            .iter()
            .filter_map(|kind| Some((kind.name.clone(), crate::catalog::capacity(kind)?)))
            .collect();
        let entries = pairs
            .iter()
            .map(|(server_type, location)| {
                let entry = match listed.iter().find(|k| &k.name == server_type) {
                    None => Entry {
                        price_usd: None,
                        standing: Standing::unavailable(format!(
                            "the API lists no server type {server_type}"
                        )),
                    },
                    Some(kind) => Entry {
                        price_usd: crate::catalog::price_eur(kind, location)
                            .ok()
                            .map(|eur| eur * self.eur_usd),
                        standing: crate::catalog::standing(kind, location),
                    },
                };
                ((server_type.clone(), location.clone()), entry)
            })
            .collect();
        Ok(provider_core::catalogue::Catalogue {
            capacities,
            entries,
        })
    }
}

#[async_trait]
impl Cloud for HetznerCloud {
    fn api_budget(&self) -> Option<provider_core::budget::ApiBudget> {
        Some(self.api.budget().clone())
    }

    async fn refresh_settings(&self) -> Result<(), BackendError> {
        self.refresh_plans().await.map_err(err)
    }

    fn state_opened(&self, _live_hosts: usize) -> Result<(), String> {
        let plans = self.offering_plans();
        if plans.len() == self.offerings.len() {
            self.save_plans(&plans);
        }
        Ok(())
    }

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
            let listing = self.ledger.listing();
            let mut servers = self
                .api
                .list_servers(&labels::instance_selector(&self.provider), Some(deadline))
                .await
                .map_err(|e| err(format!("describe managed servers: {e}")))?;
            // Exactly what the out-of-band check counts: every server with the instance label,
            // in any location; those being deleted are about to leave the count.
            listing.complete(
                servers
                    .iter()
                    .filter(|s| s.status != models::server::Status::Deleting)
                    .map(|s| s.id.to_string()),
            );
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

    /// One `GET /servers?label_selector=<instance>&per_page=1`: fewer servers carry this
    /// instance's label than the ledger expects (the last listing's, with this process's own
    /// creates and deletes since) only when one was deleted elsewhere. Hetzner's action list
    /// cannot serve instead: `GET /actions` only answers for action ids already known, and a
    /// deleted server's own actions can no longer be listed.
    async fn inventory_changed(&self) -> Result<InventorySignal, BackendError> {
        self.timed("CountManaged", async {
            let deadline = Instant::now() + self.timing.list_budget;
            let found = self
                .api
                .count_servers(&labels::instance_selector(&self.provider), Some(deadline))
                .await
                .map_err(|e| err(format!("count managed servers: {e}")))?;
            // Read after the count: a delete of this process that the count already shows is
            // then either still marked as in flight or done, and left out either way.
            let Some(expected) = self.ledger.expected() else {
                return Ok(InventorySignal::Unchanged);
            };
            Ok(if found < expected as u64 {
                InventorySignal::Changed {
                    why: format!(
                        "{found} servers carry this instance's label where at least {expected} are expected (the last listing's, with this provider's own creates and deletes since)"
                    ),
                }
            } else {
                InventorySignal::Unchanged
            })
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

    async fn catalogue(
        &self,
        pairs: &[(String, String)],
    ) -> Result<Option<provider_core::catalogue::Catalogue>, BackendError> {
        self.timed("ServerTypes", self.read_catalogue(pairs))
            .await
            .map(Some)
    }

    /// Every server of the project, in one request; Hetzner has no limits API, so the limit
    /// is learned from a refusal.
    async fn account_hosts(
        &self,
    ) -> Result<Option<provider_core::headroom::AccountHosts>, BackendError> {
        let count = async {
            self.api
                .count_servers("", Some(Instant::now() + Duration::from_secs(30)))
                .await
                .map_err(|e| err(format!("count the project's servers: {e}")))
        };
        let hosts = self.timed("CountServers", count).await?;
        Ok(Some(provider_core::headroom::AccountHosts {
            limit: None,
            hosts,
        }))
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
            server: ServerSpec {
                image: "ubuntu-24.04".into(),
                ..Default::default()
            },
            offerings: Vec::new(),
            locations: vec!["nbg1".into()],
            ssh: None,
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
                Box::new(|c| c.server.image = " ".into()),
                "hcloud: --image is required for the hetzner backend (or --image-selector, or an image per offering)",
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
                Box::new(|c| c.server.ssh_address = SshAddress::Private),
                "offering */* --ssh-address \"private\" needs a private network, but offering */* --network is empty",
            ),
            (
                Box::new(|c| c.server.public_ipv4 = false),
                "offering */* --ssh-address \"public\" needs a public IPv4, but offering */* --public-ipv4 is false (use \"private\" with a network or \"ipv6\")",
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

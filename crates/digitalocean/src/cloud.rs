//! [`DigitalOceanCloud`]: the [`Cloud`] seam over the DigitalOcean API and the bootstrap
//! channel. Droplets are created only in `--region`, tagged with the machine id and the
//! provider instance, found again by those tags (never by name) so a retried Create adopts
//! instead of double-provisioning, and configured, confirmed Ready and drained through the
//! on-host agent.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use provider_core::backend::{BackendError, ConfigureOrder, TransitionContext};
use provider_core::batch::{Batcher, BootClock, ReadError};
use provider_core::cloud::{Capacity, Cloud, InventorySignal, OwnedHost};
use provider_core::config::Secret;
use provider_core::machine::Machine;
use provider_core::retry::{Backoff, Verdict};
use provider_core::telemetry::Telemetry;
use serde::Serialize;
use tokio::time::Instant;

use crate::api::{ApiClient, ApiError, CreateDroplet, Droplet, ImageRef, Size};
use crate::channel::{Channel, Command};
use crate::enrollment::{DropletDirectory, DropletSighting};
use crate::naming::{
    CLUSTER_TAG_PREFIX, ENROLLMENT_TOKEN_TAG, MACHINE_TAG_PREFIX, MANAGED_TAG, booting_tag,
    cluster_tag, decode_tag, droplet_name, machine_tag, provider_tag,
};
use crate::profile::DropletProfile;
use crate::profile_cache::ProfileBook;

/// Where the on-host agent finds the provider; written into every Droplet's user_data.
#[derive(Clone, Debug)]
pub struct AgentProvisioning {
    /// `--bootstrap-endpoint`, verbatim.
    pub endpoint: String,
    /// The PEM the agent pins (`--bootstrap-ca`, else the channel's certificate), verbatim.
    pub ca_pem: String,
    /// Without `--bootstrap-ca`: the channel's certificate, for agents that know this pin but
    /// not `pinned_spki_sha256`; empty, and not written, otherwise.
    pub pinned_cert_pem: String,
    /// Without `--bootstrap-ca`: the base64 SHA-256 of the channel certificate's
    /// SubjectPublicKeyInfo, the pin agents prefer; empty, and not written, otherwise.
    pub pinned_spki_sha256: String,
}

/// Everything [`DigitalOceanCloud`] needs besides its clients.
#[derive(Clone, Debug)]
pub struct CloudSettings {
    /// `--provider`: the instance whose Droplets these are.
    pub provider: String,
    /// `--region`: the only region this instance creates in and reads from.
    pub region: String,
    /// The image of a size without a profile.
    pub image: ImageRef,
    /// What a Create of each offered size sends (image, VPC, tags, IPv6, monitoring, login
    /// keys), resolved at startup and again at the price-refresh cadence; a size without one
    /// gets `image` and nothing else.
    pub profiles: Arc<ProfileBook>,
    /// `--base-user-data` contents, merged before the agent's cloud-config. Operators keep
    /// join secrets there, so it prints as `[redacted]` and is zeroed on drop.
    pub base_user_data: Option<Secret>,
    pub agent: AgentProvisioning,
    /// The base interval of the polls of a booting Droplet: they start at three quarters of
    /// its size's typical boot time as this process saw it (at half this interval before it
    /// saw one), no sooner than half this interval apart, and grow to twice it (see
    /// [`provider_core::batch::PollSchedule`]).
    pub active_poll: Duration,
    /// Longest wait for `active`, within the transition deadline.
    pub active_cap: Duration,
    /// How long a fetched size catalogue is reused.
    pub sizes_ttl: Duration,
    /// Backoff between create attempts (each preceded by a lookup).
    pub create_backoff: Backoff,
    /// What the agents of the Droplets in a local state pin (`channel-key.json`), checked once
    /// the state is open; `None` without a local state.
    pub channel_key: Option<crate::channel_key::ChannelKeyRecord>,
}

impl CloudSettings {
    /// Settings with the reference's timings: 5 s polls, 10 min cap, 1 min size cache.
    pub fn new(
        provider: String,
        region: String,
        image: ImageRef,
        base_user_data: Option<String>,
        agent: AgentProvisioning,
    ) -> CloudSettings {
        CloudSettings {
            provider,
            region,
            image,
            profiles: Arc::new(ProfileBook::fixed(HashMap::new())),
            base_user_data: base_user_data.map(Secret::new),
            agent,
            active_poll: Duration::from_secs(5),
            active_cap: Duration::from_secs(600),
            sizes_ttl: Duration::from_secs(60),
            create_backoff: Backoff::default(),
            channel_key: None,
        }
    }

    /// The same settings with a resolved profile per size.
    pub fn with_profiles(mut self, profiles: HashMap<String, DropletProfile>) -> CloudSettings {
        self.profiles = Arc::new(ProfileBook::fixed(profiles));
        self
    }

    /// What a Create of `size` sends.
    pub fn profile(&self, size: &str) -> DropletProfile {
        self.profiles
            .profile(size)
            .unwrap_or_else(|| DropletProfile::with_image(self.image.clone()))
    }
}

/// Budget of calls made outside a transition (inventory, prices, sizes).
const READ_BUDGET: Duration = Duration::from_secs(30);

/// The DigitalOcean implementation of [`Cloud`].
pub struct DigitalOceanCloud {
    api: ApiClient,
    channel: Channel,
    settings: CloudSettings,
    provider_tag: String,
    /// Carried by this instance's Droplets from their create until they were seen `active`.
    booting_tag: String,
    telemetry: Telemetry,
    sizes: tokio::sync::Mutex<Option<(Instant, Arc<Vec<Size>>)>>,
    /// The boot polls of every Create in flight: one listing of the booting tag per round.
    boot_reads: Batcher<u64, Droplet, ApiError>,
    watching: Watching,
    /// How long each size's Droplets take to boot, as seen by this process.
    boot: BootClock,
    /// The Droplets this instance owns as of the last listing, with this process's own
    /// creates and deletes since: whose destroy actions are out-of-band changes.
    ledger: provider_core::host_ledger::HostLedger,
    /// The newest account action the out-of-band check has seen.
    actions_seen: std::sync::Mutex<Option<u64>>,
}

/// The most pages of account actions one out-of-band check reads (200 actions a page) before
/// it gives up telling what happened and asks for a survey.
const MAX_ACTION_PAGES: u32 = 5;

/// The longest a boot poll waits for others to join its round.
const GATHER_CAP: Duration = Duration::from_millis(250);

/// The Droplets a `wait_active` of this process is waiting on.
type Watching = Arc<std::sync::Mutex<std::collections::HashSet<u64>>>;

/// Takes a Droplet off [`Watching`] when its wait ends, however it ends.
struct Watch {
    watching: Watching,
    id: u64,
}

impl Watch {
    fn new(watching: &Watching, id: u64) -> Watch {
        lock_watching(watching).insert(id);
        Watch {
            watching: watching.clone(),
            id,
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        lock_watching(&self.watching).remove(&self.id);
    }
}

fn lock_watching(watching: &Watching) -> std::sync::MutexGuard<'_, std::collections::HashSet<u64>> {
    watching.lock().unwrap_or_else(|e| e.into_inner())
}

/// One round of boot polls: lists the booting tag, untags (in one request) every listed
/// Droplet that is `active` and asked about in this round or not waited on at all (so a tag
/// left by a crash or an earlier process is cleared by the next round, and a waiter still
/// finds its Droplet in the listing), and answers for the asked ids it found.
async fn poll_booting(
    api: &ApiClient,
    tag: &str,
    watching: &Watching,
    ids: Vec<u64>,
    deadline: Instant,
) -> Result<HashMap<u64, Droplet>, ApiError> {
    let listed = api.list_droplets_by_tag_once(tag, deadline).await?;
    let active: Vec<u64> = {
        let watching = lock_watching(watching);
        listed
            .iter()
            .filter(|d| d.status == "active" && d.has_tag(tag))
            .filter(|d| ids.contains(&d.id) || !watching.contains(&d.id))
            .map(|d| d.id)
            .collect()
    };
    if !active.is_empty()
        && let Err(e) = api.untag_droplets_once(tag, &active, deadline).await
    {
        // Harmless: they are listed again, and untagged, by the next round.
        tracing::warn!(error = %e, droplets = active.len(), "clearing the booting tag failed");
    }
    Ok(listed
        .into_iter()
        .filter(|d| ids.contains(&d.id))
        .map(|d| (d.id, d))
        .collect())
}

impl std::fmt::Debug for DigitalOceanCloud {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DigitalOceanCloud")
            .field("region", &self.settings.region)
            .field("provider_tag", &self.provider_tag)
            .finish_non_exhaustive()
    }
}

impl DigitalOceanCloud {
    pub fn new(
        api: ApiClient,
        channel: Channel,
        settings: CloudSettings,
        telemetry: Telemetry,
    ) -> DigitalOceanCloud {
        let provider_tag = provider_tag(&settings.provider);
        let booting_tag = booting_tag(&settings.provider);
        let watching = Watching::default();
        let boot_reads = {
            let (api, tag, watching) = (api.clone(), booting_tag.clone(), watching.clone());
            let fetch = Arc::new(move |ids: Vec<u64>, deadline: Instant| {
                let (api, tag, watching) = (api.clone(), tag.clone(), watching.clone());
                Box::pin(async move { poll_booting(&api, &tag, &watching, ids, deadline).await })
                    as provider_core::batch::FetchFuture<_, _, _>
            });
            Batcher::new((settings.active_poll / 10).min(GATHER_CAP), fetch)
        };
        let boot = BootClock::new();
        channel.attach_directory(Arc::new(ApiDirectory {
            api: api.clone(),
            provider_tag: provider_tag.clone(),
            region: settings.region.clone(),
        }));
        DigitalOceanCloud {
            api,
            channel,
            settings,
            provider_tag,
            booting_tag,
            telemetry,
            sizes: tokio::sync::Mutex::new(None),
            boot_reads,
            watching,
            boot,
            ledger: provider_core::host_ledger::HostLedger::default(),
            actions_seen: std::sync::Mutex::new(None),
        }
    }

    /// The user_data of the Droplet the Create `create_operation` makes: the operator's base
    /// part (if any), then the agent's cloud-config with its endpoint, pinned CA, machine id
    /// and the one-time enrollment token of that Create.
    pub fn user_data(&self, machine_id: &str, create_operation: &str) -> String {
        let ours = agent_cloud_config(
            &self.settings.agent,
            machine_id,
            self.channel
                .enrollment_token_for(machine_id, create_operation)
                .expose(),
        );
        provider_core::userdata::assemble(
            self.settings.base_user_data.as_ref().map(Secret::expose),
            &ours,
        )
    }

    /// Whether this instance owns `droplet`: managed, ours, in our region.
    fn owns(&self, droplet: &Droplet) -> bool {
        droplet.has_tag(MANAGED_TAG)
            && droplet.has_tag(&self.provider_tag)
            && droplet.region.slug == self.settings.region
    }

    /// The Droplet a previous attempt created for `machine_id`, if any.
    async fn find_created(
        &self,
        machine_id: &str,
        deadline: Instant,
    ) -> Result<Option<Droplet>, ApiError> {
        let tag = machine_tag(machine_id);
        let found = self.api.list_droplets_by_tag(&tag, deadline).await?;
        Ok(found
            .into_iter()
            .filter(|d| self.owns(d) && d.has_tag(&tag))
            .min_by_key(|d| d.id))
    }

    async fn create(
        &self,
        machine: &Machine,
        ctx: &TransitionContext,
    ) -> Result<OwnedHost, String> {
        let zone = if machine.zone.is_empty() {
            &self.settings.region
        } else {
            &machine.zone
        };
        if *zone != self.settings.region {
            return Err(format!(
                "create droplet: offering region {zone:?} does not match this provider's region {:?}",
                self.settings.region
            ));
        }
        let size = &machine.instance_type;
        let profile = self.settings.profile(size);
        let mut tags = vec![
            MANAGED_TAG.to_owned(),
            machine_tag(&machine.id),
            self.provider_tag.clone(),
            self.booting_tag.clone(),
            ENROLLMENT_TOKEN_TAG.to_owned(),
        ];
        tags.extend(profile.tags);
        let request = CreateDroplet {
            name: droplet_name(&machine.id),
            region: self.settings.region.clone(),
            size: size.clone(),
            image: profile.image,
            vpc_uuid: profile.vpc_uuid,
            ipv6: profile.ipv6,
            monitoring: profile.monitoring,
            ssh_keys: profile.ssh_keys,
            user_data: self.user_data(&machine.id, &ctx.operation_id),
            tags,
        };
        let backoff = self.settings.create_backoff;
        let mut attempt = 0;
        let created = loop {
            attempt += 1;
            let existing = self
                .find_created(&machine.id, ctx.deadline)
                .await
                .map_err(|e| format!("create droplet {size}: pre-create lookup: {e}"))?;
            if let Some(existing) = existing {
                if attempt == 1 {
                    tracing::info!(machine_id = %machine.id, droplet = existing.id, "adopting the Droplet of an earlier create");
                } else {
                    tracing::info!(machine_id = %machine.id, droplet = existing.id, "create took effect despite its error; adopting the Droplet");
                }
                break existing;
            }
            let error = match self.api.create_droplet(&request, ctx.deadline).await {
                Ok(d) if d.id != 0 => break d,
                Ok(_) => return Err(format!("create droplet {size}: empty result")),
                Err(e) => e,
            };
            // The create may have taken effect even though it failed (a dropped response, a
            // garbled body): only a clear refusal ends here; anything else is looked up first.
            let after = match error.verdict() {
                Verdict::Retry { after } => after,
                Verdict::Fatal if matches!(error, ApiError::Decode { .. }) => None,
                Verdict::Fatal => {
                    let Some(refusal) = refusal_of(&error) else {
                        return Err(match failure_fix(&error) {
                            Some(fix) => format!("create droplet {size}: {error} ({fix})"),
                            None => format!("create droplet {size}: {error}"),
                        });
                    };
                    ctx.refuse(refusal);
                    return Err(format!("create droplet {size}: {error}"));
                }
            };
            let wait = backoff.delay(attempt, after);
            if attempt >= backoff.max_attempts || Instant::now() + wait >= ctx.deadline {
                // This look-up may outlast the Create's deadline (a create call cut short by it
                // may still have made the Droplet): one it finds is recorded on the machine,
                // FAILED by then, so it is never left running untracked.
                let last = self
                    .find_created(
                        &machine.id,
                        provider_core::backend::after_deadline(ctx.deadline),
                    )
                    .await
                    .ok()
                    .flatten();
                match last {
                    Some(d) => break d,
                    None => return Err(format!("create droplet {size}: {error}")),
                }
            }
            tracing::warn!(machine_id = %machine.id, attempt, error = %error, "create droplet failed; looking up before retrying");
            sleep_or_cancel(wait, ctx)
                .await
                .map_err(|e| format!("create droplet {size}: {e}"))?;
        };
        // Expected by the out-of-band check from now on, whatever becomes of the Create (the
        // Droplet exists until a delete), and into the machine's record before anything else
        // is asked of the cloud.
        self.ledger.created(&created.id.to_string());
        ctx.record_host(&created.id.to_string())
            .await
            .map_err(|e| e.0)?;
        let active = self
            .wait_active(&created, Some(Instant::now()), ctx)
            .await
            .map_err(|e| format!("create droplet {size}: {e}"))?;
        Ok(self.owned_host(&active))
    }

    /// Waits for `droplet` to be `active`, looking at it on the schedule its size's boot time
    /// gives, in the booting-tag listing every Create in flight shares. A Droplet missing from
    /// that listing (adopted from an earlier version, or its tag removed) is read directly; a
    /// 404 fails at once; other errors are retried until the cap or the transition deadline.
    /// `created` is when the create call returned, for learning the boot time.
    async fn wait_active(
        &self,
        droplet: &Droplet,
        created: Option<Instant>,
        ctx: &TransitionContext,
    ) -> Result<Droplet, String> {
        let id = droplet.id;
        if droplet.status == "active" {
            return Ok(droplet.clone());
        }
        let _watch = Watch::new(&self.watching, id);
        let started = Instant::now();
        let cap = self.settings.active_cap;
        let until = ctx.deadline.min(started + cap);
        let mut schedule = self.boot.schedule(
            &droplet.size_slug,
            self.settings.active_poll / 2,
            self.settings.active_poll * 2,
        );
        // The last status the API answered (a poll cut short by the deadline does not hide
        // it), and how the polls since have failed.
        let mut seen = format!("status {:?}", droplet.status);
        let mut failure: Option<String> = None;
        loop {
            let last = match &failure {
                Some(e) => format!("{seen}; then the poll failed: {e}"),
                None => seen.clone(),
            };
            let Some(wake) = schedule.next_look(until) else {
                if until < ctx.deadline {
                    return Err(format!(
                        "droplet {id} did not become active within {} (last: {last})",
                        provider_core::duration::format(cap)
                    ));
                }
                sleep_or_cancel(until.saturating_duration_since(Instant::now()), ctx)
                    .await
                    .ok();
                return Err(format!(
                    "waiting for droplet {id} to become active: context deadline exceeded (last: {last})"
                ));
            };
            sleep_or_cancel(wake.saturating_duration_since(Instant::now()), ctx)
                .await
                .map_err(|e| {
                    format!("waiting for droplet {id} to become active: {e} (last: {last})")
                })?;
            let polled = match self.boot_reads.read(id, ctx.deadline).await {
                Ok(Some(d)) => Ok(d),
                // Not booting by its tag: ask for it.
                Ok(None) => self.api.get_droplet_once(id, ctx.deadline).await,
                Err(ReadError::Fetch(e)) => Err(e),
                Err(e) => Err(ApiError::Transport {
                    endpoint: "GET /v2/droplets",
                    message: e.to_string(),
                }),
            };
            match polled {
                Ok(d) if d.status == "active" => {
                    if let Some(created) = created {
                        self.boot.record(&droplet.size_slug, created.elapsed());
                    }
                    return Ok(d);
                }
                Ok(d) => {
                    seen = format!("status {:?}", d.status);
                    failure = None;
                }
                Err(e) if e.is_not_found() => {
                    return Err(format!(
                        "droplet {id} not found while waiting to become active (deleted out-of-band?): {e}"
                    ));
                }
                Err(e) => failure = Some(e.to_string()),
            }
        }
    }

    fn owned_host(&self, d: &Droplet) -> OwnedHost {
        OwnedHost {
            id: d.id.to_string(),
            machine_id: decode_tag(&d.tags, MACHINE_TAG_PREFIX).unwrap_or_default(),
            instance_type: d.size_slug.clone(),
            zone: d.region.slug.clone(),
            public_ipv4: d.public_ipv4(),
            cluster: decode_tag(&d.tags, CLUSTER_TAG_PREFIX),
            running: d.status == "new" || d.status == "active",
        }
    }

    /// Reads a Droplet for Configure/Drain and checks it is ours and carries a machine id.
    async fn managed_droplet(
        &self,
        op: &str,
        host_id: &str,
        machine: &Machine,
        deadline: Instant,
    ) -> Result<(Droplet, String), String> {
        let id = parse_id(op, host_id)?;
        let d = self
            .api
            .get_droplet(id, deadline)
            .await
            .map_err(|e| format!("{op}: look up droplet {id}: {e}"))?;
        if !self.owns(&d) {
            return Err(format!("{op}: droplet {id} is not owned by this provider"));
        }
        let machine_id = decode_tag(&d.tags, MACHINE_TAG_PREFIX)
            .ok_or_else(|| format!("{op}: droplet {id} carries no machine id tag"))?;
        if machine_id != machine.id {
            return Err(format!(
                "{op}: droplet {id} belongs to machine {machine_id:?}, not {:?}",
                machine.id
            ));
        }
        Ok((d, machine_id))
    }

    async fn configure(
        &self,
        machine: &Machine,
        host_id: &str,
        order: &ConfigureOrder,
        ctx: &TransitionContext,
    ) -> Result<(), String> {
        let (d, machine_id) = self
            .managed_droplet("configure", host_id, machine, ctx.deadline)
            .await?;
        self.wait_active(&d, None, ctx)
            .await
            .map_err(|e| format!("configure: droplet {} not ready: {e}", d.id))?;
        let command = Command::Configure {
            cluster_id: order.cluster_id.clone(),
            blob: order.blob.0.clone(),
        };
        // The blob waits for the agent's enrollment (within the deadline, leaving a moment to
        // say so when that is what never came).
        let margin = ctx.remaining().div_f64(8.0).min(Duration::from_secs(5));
        if !self
            .channel
            .wait_enrolled(&machine_id, ctx.deadline - margin, &ctx.cancel)
            .await
        {
            return Err(format!(
                "configure: the agent on droplet {} never enrolled, and a bootstrap blob is \
                 delivered only to an enrolled agent (an agent older than the provider cannot \
                 enroll: install a current bigfleet-agent in the image; see the agent's log \
                 for why its enrollment failed)",
                d.id
            ));
        }
        self.channel
            .deliver(&machine_id, command, ctx)
            .await
            .map_err(|e| e.0)?;
        let tag = cluster_tag(&order.cluster_id);
        self.api
            .ensure_tag(&tag, ctx.deadline)
            .await
            .map_err(|e| format!("create cluster tag {tag}: {e}"))?;
        self.api
            .tag_droplet(&tag, d.id, ctx.deadline)
            .await
            .map_err(|e| format!("tag cluster binding: {e}"))?;
        Ok(())
    }

    async fn drain(
        &self,
        machine: &Machine,
        host_id: &str,
        grace: i64,
        ctx: &TransitionContext,
    ) -> Result<(), String> {
        let (d, machine_id) = self
            .managed_droplet("drain", host_id, machine, ctx.deadline)
            .await?;
        let command = Command::Drain {
            grace_seconds: grace.max(1),
        };
        self.channel
            .deliver(&machine_id, command, ctx)
            .await
            .map_err(|e| e.0)?;
        let current = self
            .api
            .get_droplet(d.id, ctx.deadline)
            .await
            .map_err(|e| format!("clear cluster binding: look up droplet {}: {e}", d.id))?;
        for tag in current
            .tags
            .iter()
            .filter(|t| t.starts_with(CLUSTER_TAG_PREFIX))
        {
            self.api
                .untag_droplet(tag, d.id, ctx.deadline)
                .await
                .map_err(|e| format!("untag cluster binding {tag}: {e}"))?;
        }
        Ok(())
    }

    async fn delete(&self, host_id: &str, ctx: &TransitionContext) -> Result<(), String> {
        let id = parse_id("delete", host_id)?;
        // From here until the answer, the Droplet's destroy action is this provider's own.
        let deleting = self.ledger.deleting(&id.to_string());
        match self.api.get_droplet(id, ctx.deadline).await {
            Err(e) if e.is_not_found() => {
                deleting.done();
                return Ok(());
            }
            Err(e) => return Err(format!("delete droplet {id}: {e}")),
            Ok(d) if !self.owns(&d) => {
                return Err(format!(
                    "delete: droplet {id} is not owned by this provider"
                ));
            }
            Ok(_) => {}
        }
        match self.api.delete_droplet(id, ctx.deadline).await {
            Ok(()) => {
                deleting.done();
                Ok(())
            }
            Err(e) if e.is_not_found() => {
                deleting.done();
                Ok(())
            }
            Err(e) => Err(format!("delete droplet {id}: {e}")),
        }
    }

    /// The account's actions since the last check (`GET /v2/actions`, newest first; one page
    /// unless more than a page of actions happened since), and whether one of them destroyed a
    /// Droplet the ledger expects: one this instance owned at the last listing or created
    /// since, and that no delete of this process is sending or has sent. Ownership cannot be
    /// read from a destroyed Droplet; the ledger knows its id.
    async fn destroyed_out_of_band(&self) -> Result<InventorySignal, String> {
        let deadline = Instant::now() + READ_BUDGET;
        let cursor = *self.actions_seen.lock().unwrap_or_else(|e| e.into_inner());
        let mut newest = cursor;
        let mut destroyed = Vec::new();
        // The first check has nothing to catch up with: its page sets the cursor.
        let mut caught_up = cursor.is_none();
        for page in 1..=MAX_ACTION_PAGES {
            let listed = match self.api.list_actions(page, deadline).await {
                Ok(listed) => listed,
                Err(e) if e.status() == Some(403) => {
                    tracing::warn!(err = %e, "the API token may not read the account's actions (scope actions:read): Droplets destroyed out of band are seen by the paced reconcile surveys only");
                    return Ok(InventorySignal::Unsupported);
                }
                Err(e) => return Err(format!("list account actions: {e}")),
            };
            for action in &listed.actions {
                if cursor.is_some_and(|seen| action.id <= seen) {
                    caught_up = true;
                    continue;
                }
                newest = newest.max(Some(action.id));
                if let Some(droplet) = action.destroyed_droplet()
                    && self.ledger.expects(&droplet.to_string())
                {
                    destroyed.push(droplet);
                }
            }
            if caught_up || !listed.more {
                caught_up = true;
                break;
            }
        }
        *self.actions_seen.lock().unwrap_or_else(|e| e.into_inner()) = newest;
        Ok(if !destroyed.is_empty() {
            destroyed.sort_unstable();
            destroyed.dedup();
            InventorySignal::Changed {
                why: format!(
                    "DigitalOcean recorded the destroy of Droplet(s) {destroyed:?} of this instance, not by this provider"
                ),
            }
        } else if !caught_up {
            InventorySignal::Changed {
                why: format!(
                    "more than {MAX_ACTION_PAGES} pages of account actions since the last check; a survey tells what they changed"
                ),
            }
        } else {
            InventorySignal::Unchanged
        })
    }

    /// The size catalogue, fetched at most once per TTL and shared by prices and capacities.
    async fn sizes(&self) -> Result<Arc<Vec<Size>>, String> {
        let mut cached = self.sizes.lock().await;
        if let Some((at, sizes)) = cached.as_ref()
            && at.elapsed() < self.settings.sizes_ttl
        {
            return Ok(sizes.clone());
        }
        let sizes = Arc::new(
            self.api
                .list_sizes(Instant::now() + READ_BUDGET)
                .await
                .map_err(|e| format!("list sizes: {e}"))?,
        );
        *cached = Some((Instant::now(), sizes.clone()));
        Ok(sizes)
    }

    /// Records one operation's outcome under its reference `op` name.
    fn timed<T>(
        &self,
        op: &'static str,
        start: Instant,
        r: Result<T, String>,
    ) -> Result<T, BackendError> {
        self.telemetry.api_call(op, r.is_ok(), start.elapsed());
        r.map_err(BackendError)
    }
}

/// What a refused create call means for the slot (docs/digitalocean/troubleshooting.md,
/// "Create refusals"): DigitalOcean answers 422 `unprocessable_entity` for every refusal and
/// tells them apart only by the message. A size or region not available now is a stockout; the
/// Droplet limit is the account's limit; anything else (an invalid image, VPC, key or name) is
/// the settings' fault and fails the machine with the message.
pub(crate) fn refusal_of(error: &ApiError) -> Option<provider_core::backend::Refusal> {
    use provider_core::backend::Refusal;
    let ApiError::Status {
        status: 422,
        message,
        ..
    } = error
    else {
        return None;
    };
    let message = message.to_ascii_lowercase();
    if message.contains("droplet limit") {
        return Some(Refusal::account_limit("droplet_limit", None));
    }
    let unavailable = [
        "not available",
        "unavailable",
        "sold out",
        "out of capacity",
    ];
    let about_placement = message.contains("size") || message.contains("region");
    (about_placement && unavailable.iter().any(|w| message.contains(w)))
        .then(|| Refusal::stockout("size_unavailable"))
}

/// What the operator fixes when a create call fails for the settings or the token, not for
/// capacity (docs/digitalocean/troubleshooting.md, "Create refusals"); `None` when the answer
/// says enough.
pub(crate) fn failure_fix(error: &ApiError) -> Option<&'static str> {
    let ApiError::Status {
        status, message, ..
    } = error
    else {
        return None;
    };
    match status {
        422 | 400 if message.to_ascii_lowercase().contains("size") => Some(
            "the offering's size is refused: use a size slug DigitalOcean sells; \
             `digitalocean check` checks each offering's size in its region",
        ),
        422 | 400 => Some(
            "a Droplet setting is refused (image, ssh_keys, vpc_uuid, tags, name): \
             `digitalocean check` names the one at fault",
        ),
        404 => Some(
            "the image, VPC or SSH key the offering names is gone: `digitalocean check` names it",
        ),
        401 | 403 => Some(
            "the token may not create Droplets: give it read-write access (droplet:create, tag:create)",
        ),
        _ => None,
    }
}

#[async_trait]
impl Cloud for DigitalOceanCloud {
    fn api_budget(&self) -> Option<provider_core::budget::ApiBudget> {
        Some(self.api.budget().clone())
    }

    async fn refresh_settings(&self) -> Result<(), BackendError> {
        self.settings
            .profiles
            .refresh(&self.api)
            .await
            .map_err(BackendError)
    }

    fn state_opened(&self, live_hosts: usize) -> Result<(), String> {
        self.settings.profiles.keep();
        match &self.settings.channel_key {
            Some(record) => record.check(live_hosts),
            None => Ok(()),
        }
    }

    async fn create_host(
        &self,
        machine: &Machine,
        ctx: &TransitionContext,
    ) -> Result<OwnedHost, BackendError> {
        let start = Instant::now();
        let r = self.create(machine, ctx).await;
        self.timed("CreateDroplet", start, r)
    }

    async fn list_hosts(&self) -> Result<Vec<OwnedHost>, BackendError> {
        let start = Instant::now();
        let listing = self.ledger.listing();
        let r = self
            .api
            .list_droplets_by_tag(&self.provider_tag, Instant::now() + READ_BUDGET)
            .await
            .map(|all| {
                all.iter()
                    .filter(|d| self.owns(d))
                    .map(|d| self.owned_host(d))
                    .collect::<Vec<_>>()
            })
            .map_err(|e| format!("list managed droplets: {e}"));
        if let Ok(hosts) = &r {
            listing.complete(hosts.iter().map(|h| h.id.clone()));
        }
        self.timed("DescribeManaged", start, r)
    }

    async fn inventory_changed(&self) -> Result<InventorySignal, BackendError> {
        let start = Instant::now();
        let r = self.destroyed_out_of_band().await;
        self.timed("ListActions", start, r)
    }

    async fn machine_hosts(
        &self,
        machine_id: &str,
    ) -> Result<Option<Vec<OwnedHost>>, BackendError> {
        let start = Instant::now();
        let tag = machine_tag(machine_id);
        let r = self
            .api
            .list_droplets_by_tag(&tag, Instant::now() + READ_BUDGET)
            .await
            .map(|found| {
                Some(
                    found
                        .iter()
                        .filter(|d| self.owns(d) && d.has_tag(&tag))
                        .map(|d| self.owned_host(d))
                        .collect(),
                )
            })
            .map_err(|e| format!("list droplets of {machine_id}: {e}"));
        self.timed("DescribeMachine", start, r)
    }

    async fn host_present(&self, host_id: &str) -> Result<Option<bool>, BackendError> {
        let start = Instant::now();
        let r = async {
            let id = parse_id("read", host_id)?;
            match self.api.get_droplet(id, Instant::now() + READ_BUDGET).await {
                Ok(d) => Ok(Some(self.owns(&d))),
                Err(e) if e.is_not_found() => Ok(Some(false)),
                Err(e) => Err(format!("read droplet {id}: {e}")),
            }
        }
        .await;
        self.timed("GetDroplet", start, r)
    }

    async fn configure_host(
        &self,
        machine: &Machine,
        host_id: &str,
        order: &ConfigureOrder,
        ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        let start = Instant::now();
        let r = self.configure(machine, host_id, order, ctx).await;
        self.timed("Configure", start, r)
    }

    /// The agent is the authority on readiness: it answers the `ready` command after its
    /// readiness command succeeds (or, without one, because its hook returned only once the
    /// node was Ready).
    fn has_readiness_gate(&self) -> bool {
        true
    }

    async fn confirm_ready(
        &self,
        machine: &Machine,
        _host_id: &str,
        cluster_id: &str,
        ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        let command = Command::Ready {
            cluster_id: cluster_id.to_owned(),
        };
        self.channel
            .deliver(&machine.id, command, ctx)
            .await
            .map_err(|e| BackendError(e.0))
    }

    async fn drain_host(
        &self,
        machine: &Machine,
        host_id: &str,
        grace_period_seconds: i64,
        ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        let start = Instant::now();
        let r = self
            .drain(machine, host_id, grace_period_seconds, ctx)
            .await;
        self.timed("Drain", start, r)
    }

    async fn delete_host(
        &self,
        host_id: &str,
        ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        let start = Instant::now();
        let r = self.delete(host_id, ctx).await;
        self.timed("DeleteDroplet", start, r)
    }

    async fn price_usd(&self, instance_type: &str, _zone: &str) -> Result<f64, BackendError> {
        let start = Instant::now();
        let r = self.sizes().await.and_then(|sizes| {
            sizes
                .iter()
                .find(|s| s.slug == instance_type)
                .map(|s| s.price_hourly)
                .ok_or_else(|| format!("no pricing for size {instance_type:?}"))
        });
        self.timed("SizePricing", start, r)
    }

    async fn capacities(
        &self,
        instance_types: &[String],
    ) -> Result<HashMap<String, Capacity>, BackendError> {
        let start = Instant::now();
        let r = self.sizes().await.map(|sizes| {
            sizes
                .iter()
                .filter(|s| instance_types.contains(&s.slug))
                .filter_map(|s| Some((s.slug.clone(), crate::catalog::capacity(s)?)))
                .collect()
        });
        self.timed("Sizes", start, r)
    }

    /// The account's `droplet_limit` and every Droplet it holds (whoever made them): two
    /// requests.
    async fn account_hosts(
        &self,
    ) -> Result<Option<provider_core::headroom::AccountHosts>, BackendError> {
        let start = Instant::now();
        let r = async {
            let deadline = Instant::now() + READ_BUDGET;
            let account = self
                .api
                .get_account(deadline)
                .await
                .map_err(|e| format!("read the account: {e}"))?;
            let hosts = self
                .api
                .count_droplets(deadline)
                .await
                .map_err(|e| format!("count the account's droplets: {e}"))?;
            Ok(Some(provider_core::headroom::AccountHosts {
                limit: (account.droplet_limit > 0).then_some(account.droplet_limit),
                hosts,
            }))
        }
        .await;
        self.timed("Account", start, r)
    }

    /// Sizes (`sizes[].available`, `sizes[].regions`, prices, vCPUs, memory, disk) and regions
    /// (`regions[].available`): two requests.
    async fn catalogue(
        &self,
        pairs: &[(String, String)],
    ) -> Result<Option<provider_core::catalogue::Catalogue>, BackendError> {
        let start = Instant::now();
        let r = async {
            let sizes = self.sizes().await?;
            let regions = self
                .api
                .list_regions(Instant::now() + READ_BUDGET)
                .await
                .map_err(|e| format!("list regions: {e}"))?;
            Ok(crate::catalog::catalogue(&sizes, &regions, pairs))
        }
        .await;
        self.timed("Catalogue", start, r).map(Some)
    }
}

/// The channel's view of the cloud for enrollments: the Droplets this instance owns for a
/// machine, with every address the API reports for them.
struct ApiDirectory {
    api: ApiClient,
    provider_tag: String,
    region: String,
}

#[async_trait]
impl DropletDirectory for ApiDirectory {
    async fn droplets_of(&self, machine_id: &str) -> Result<Vec<DropletSighting>, String> {
        let tag = machine_tag(machine_id);
        let found = self
            .api
            .list_droplets_by_tag(&tag, Instant::now() + ENROLLMENT_LOOKUP_BUDGET)
            .await
            .map_err(|e| format!("list droplets of {machine_id}: {e}"))?;
        Ok(found
            .iter()
            .filter(|d| {
                d.has_tag(MANAGED_TAG)
                    && d.has_tag(&self.provider_tag)
                    && d.has_tag(&tag)
                    && d.region.slug == self.region
            })
            .map(sighting)
            .collect())
    }
}

/// How long an enrollment waits for the API (the agent retries a deferred enrollment).
const ENROLLMENT_LOOKUP_BUDGET: Duration = Duration::from_secs(10);

/// A Droplet's id, every address it was assigned (public and VPC, IPv4 and IPv6) and whether
/// it was created with a one-time enrollment token.
fn sighting(d: &Droplet) -> DropletSighting {
    DropletSighting {
        id: d.id.to_string(),
        enrollment_token: d.has_tag(ENROLLMENT_TOKEN_TAG),
        addresses: d
            .networks
            .v4
            .iter()
            .chain(&d.networks.v6)
            .filter_map(|n| n.ip_address.parse().ok())
            .collect(),
    }
}

fn parse_id(op: &str, host_id: &str) -> Result<u64, String> {
    host_id
        .parse::<u64>()
        .map_err(|e| format!("{op}: bad droplet id {host_id:?}: {e}"))
}

async fn sleep_or_cancel(wait: Duration, ctx: &TransitionContext) -> Result<(), &'static str> {
    tokio::select! {
        () = tokio::time::sleep(wait) => Ok(()),
        () = ctx.cancel.cancelled() => Err("context canceled"),
        () = tokio::time::sleep_until(ctx.deadline) => Err("context deadline exceeded"),
    }
}

/// The agent's cloud-config: writes `/etc/bigfleet-agent/config.json` (mode 0600) with the
/// keys `ca_pem`, `endpoint`, `machine_id`, `token`, pretty-printed and indented under
/// `content: |`.
pub fn agent_cloud_config(agent: &AgentProvisioning, machine_id: &str, token: &str) -> String {
    #[derive(Serialize)]
    struct AgentConfigFile<'a> {
        ca_pem: &'a str,
        endpoint: &'a str,
        machine_id: &'a str,
        #[serde(skip_serializing_if = "str::is_empty")]
        pinned_cert_pem: &'a str,
        #[serde(skip_serializing_if = "str::is_empty")]
        pinned_spki_sha256: &'a str,
        token: &'a str,
    }
    let file = AgentConfigFile {
        ca_pem: &agent.ca_pem,
        endpoint: &agent.endpoint,
        machine_id,
        pinned_cert_pem: &agent.pinned_cert_pem,
        pinned_spki_sha256: &agent.pinned_spki_sha256,
        token,
    };
    let json = serde_json::to_string_pretty(&file).unwrap_or_default();
    let mut out = String::from(
        "#cloud-config\nwrite_files:\n  - path: /etc/bigfleet-agent/config.json\n    permissions: '0600'\n    owner: root:root\n    content: |\n",
    );
    for line in json.lines() {
        out.push_str("      ");
        out.push_str(line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: u16, message: &str) -> ApiError {
        ApiError::Status {
            endpoint: "create droplet",
            status,
            message: message.into(),
            retry_after: None,
        }
    }

    /// Every answer of the official document a create call can get, with its outcome: a
    /// stockout or the Droplet limit returns the slot; 429 and 5xx are retried after a look-up;
    /// the rest fails the machine saying what to fix.
    #[test]
    fn each_create_answer_has_a_deliberate_outcome() {
        use provider_core::backend::RefusalKind::*;
        use provider_core::retry::Verdict;
        let refused =
            |status, message| refusal_of(&answer(status, message)).map(|r| (r.kind, r.code));
        assert_eq!(
            refused(422, "Size is not available in this region."),
            Some((Stockout, "size_unavailable"))
        );
        assert_eq!(
            refused(422, "Region is not available"),
            Some((Stockout, "size_unavailable"))
        );
        assert_eq!(
            refused(
                422,
                "creating this/these droplet(s) will exceed your droplet limit"
            ),
            Some((AccountLimit, "droplet_limit"))
        );
        for message in [
            "You specified an invalid image for Droplet creation.",
            "You specified an invalid SSH key ID",
            "tag name invalid",
        ] {
            assert_eq!(refused(422, message), None, "{message}");
            let fix = failure_fix(&answer(422, message)).unwrap();
            assert!(fix.contains("digitalocean check"), "{fix}");
        }
        let fix = failure_fix(&answer(
            422,
            "You specified an invalid size for Droplet creation.",
        ))
        .unwrap();
        assert!(fix.starts_with("the offering's size is refused"), "{fix}");
        assert!(
            failure_fix(&answer(401, "unauthorized"))
                .unwrap()
                .contains("read-write")
        );
        assert!(
            failure_fix(&answer(403, "forbidden"))
                .unwrap()
                .contains("read-write")
        );
        assert!(failure_fix(&answer(404, "not found")).is_some());
        for status in [429, 500, 502, 503, 504] {
            assert!(
                matches!(answer(status, "x").verdict(), Verdict::Retry { .. }),
                "{status}"
            );
            assert_eq!(refused(status, "size is not available"), None);
        }
    }

    #[test]
    fn settings_never_print_the_base_user_data() {
        let settings = CloudSettings::new(
            "p".into(),
            "nyc3".into(),
            ImageRef::Slug("ubuntu-24-04-x64".into()),
            Some("#cloud-config\nJOIN_SECRET=hunter2\n".into()),
            AgentProvisioning {
                endpoint: "https://x".into(),
                ca_pem: String::new(),
                pinned_cert_pem: String::new(),
                pinned_spki_sha256: String::new(),
            },
        );
        let printed = format!("{settings:?}");
        assert!(!printed.contains("hunter2"), "{printed}");
        assert!(printed.contains("[redacted]"), "{printed}");
    }

    #[test]
    fn agent_config_rendering() {
        let agent = AgentProvisioning {
            endpoint: "https://x/a?b=1&c=2".into(),
            ca_pem: "-----BEGIN CERTIFICATE-----\nMII\n-----END CERTIFICATE-----\n".into(),
            pinned_cert_pem: String::new(),
            pinned_spki_sha256: String::new(),
        };
        let doc = agent_cloud_config(&agent, "m/1", "tok");
        assert_eq!(
            doc,
            "#cloud-config\nwrite_files:\n  - path: /etc/bigfleet-agent/config.json\n    permissions: '0600'\n    owner: root:root\n    content: |\n      {\n        \"ca_pem\": \"-----BEGIN CERTIFICATE-----\\nMII\\n-----END CERTIFICATE-----\\n\",\n        \"endpoint\": \"https://x/a?b=1&c=2\",\n        \"machine_id\": \"m/1\",\n        \"token\": \"tok\"\n      }\n"
        );
    }

    #[test]
    fn droplet_ids() {
        assert_eq!(parse_id("delete", "42"), Ok(42));
        assert_eq!(
            parse_id("delete", "x1").unwrap_err(),
            "delete: bad droplet id \"x1\": invalid digit found in string"
        );
    }
}

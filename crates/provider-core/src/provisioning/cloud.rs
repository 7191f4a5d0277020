//! The per-cloud seam. A cloud crate implements [`Cloud`] twice, once over the real API and
//! once as an in-memory fake (or uses [`crate::provisioning::fake::FakeCloud`]); [`crate::provisioning::fleet::Fleet`]
//! turns either into a [`crate::Backend`] with offerings, slot ids, quota, prices and
//! allocatable, so none of that is written twice.

use std::collections::HashMap;

use async_trait::async_trait;

use crate::provisioning::backend::{BackendError, ConfigureOrder, TransitionContext};
pub use crate::provisioning::catalogue::{Arch, Capacity};
use crate::rules::machine::Machine;

/// A host owned by this provider instance, as the cloud reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OwnedHost {
    /// The cloud's host id (`HostRef.ref`), e.g. a Hetzner server id or a Droplet id.
    pub id: String,
    /// The machine id decoded from the host's ownership label or tag.
    pub machine_id: String,
    /// Server type or Droplet size.
    pub instance_type: String,
    /// Location or region.
    pub zone: String,
    pub public_ipv4: Option<String>,
    /// The cluster binding label or tag, if set.
    pub cluster: Option<String>,
    /// Whether the host is running (or starting).
    pub running: bool,
}

/// What a cloud's cheap check between two full surveys ([`Cloud::inventory_changed`]) says
/// about the hosts this instance owns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InventorySignal {
    /// This cloud has no such check: only a full survey sees a host deleted out of band.
    Unsupported,
    /// Nothing the check can see changed the owned hosts out of band since the last survey.
    Unchanged,
    /// The owned hosts may have changed out of band; `why` says what the check saw (logged
    /// when it starts a survey early).
    Changed { why: String },
}

/// What one cloud must offer. Every method that changes the cloud is idempotent on the machine
/// id, only ever touches hosts this instance owns, and gives up at `ctx.deadline`.
#[async_trait]
pub trait Cloud: Send + Sync + 'static {
    /// Creates the host for `machine` (id, instance type, zone) or finds the one a previous
    /// attempt created (matched by its ownership labels, never by name alone), and returns once
    /// it is running.
    async fn create_host(
        &self,
        machine: &Machine,
        ctx: &TransitionContext,
    ) -> Result<OwnedHost, BackendError>;

    /// Every host this instance owns, in its locations/region, excluding hosts being deleted.
    /// A partial listing is an error, never a short inventory.
    async fn list_hosts(&self) -> Result<Vec<OwnedHost>, BackendError>;

    /// A direct read of one host: `Some(false)` when the cloud answers not-found, or the host
    /// is being deleted or is not ours; `Some(true)` when it exists; `None` when this cloud has
    /// no such read. Reconcile uses it as proof before treating a host as vanished.
    async fn host_present(&self, _host_id: &str) -> Result<Option<bool>, BackendError> {
        Ok(None)
    }

    /// The hosts this instance owns for one machine, read by the machine's own label or tag (a
    /// small answer that a concurrent deletion elsewhere cannot shift, unlike a paged listing
    /// of every host); `None` when this cloud has no such read.
    async fn machine_hosts(
        &self,
        _machine_id: &str,
    ) -> Result<Option<Vec<OwnedHost>>, BackendError> {
        Ok(None)
    }

    /// Whether the owned hosts may have changed out of band (an operator deleting one in the
    /// cloud console) since the last [`Cloud::list_hosts`], at the cost of one or two requests
    /// instead of a whole listing. The reconcile loop asks it between two paced surveys and
    /// surveys at once on [`InventorySignal::Changed`]: the survey, its proofs and its rules
    /// decide what changed, so a check may err towards `Changed` but must never claim
    /// `Unchanged` for a deletion it can see. This instance's own Creates and Deletes are not
    /// changes. Before the first listing there is nothing to compare with: `Unchanged`.
    async fn inventory_changed(&self) -> Result<InventorySignal, BackendError> {
        Ok(InventorySignal::Unsupported)
    }

    /// Delivers the bootstrap blob to the host and runs the bootstrap hook; on success records
    /// the cluster binding on the host.
    async fn configure_host(
        &self,
        machine: &Machine,
        host_id: &str,
        order: &ConfigureOrder,
        ctx: &TransitionContext,
    ) -> Result<(), BackendError>;

    /// Whether [`Cloud::confirm_ready`] really observes node readiness.
    fn has_readiness_gate(&self) -> bool {
        false
    }

    /// After a successful configure: waits until the node is Ready in `cluster_id`.
    async fn confirm_ready(
        &self,
        _machine: &Machine,
        _host_id: &str,
        _cluster_id: &str,
        _ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        Ok(())
    }

    /// Cordons and drains the node within `grace_period_seconds`, then removes the binding.
    async fn drain_host(
        &self,
        machine: &Machine,
        host_id: &str,
        grace_period_seconds: i64,
        ctx: &TransitionContext,
    ) -> Result<(), BackendError>;

    /// Deletes the host; a host that is already gone is a success.
    async fn delete_host(&self, host_id: &str, ctx: &TransitionContext)
    -> Result<(), BackendError>;

    /// How many hosts the whole account holds (whoever made them) and, where the API reports
    /// it, its limit, read in as few requests as the API allows; `None` when this cloud has no
    /// such read. Caps the Speculative slots advertised ([`crate::provisioning::headroom`]).
    async fn account_hosts(
        &self,
    ) -> Result<Option<crate::provisioning::headroom::AccountHosts>, BackendError> {
        Ok(None)
    }

    /// The live on-demand price of an instance type in a zone, in USD per hour.
    async fn price_usd(&self, instance_type: &str, zone: &str) -> Result<f64, BackendError>;

    /// Looks up again what the cloud resolved at startup (server types, images, networks and
    /// the like), at the price-refresh cadence. On an error the settings in use stay.
    async fn refresh_settings(&self) -> Result<(), BackendError> {
        Ok(())
    }

    /// The API budget of this cloud's token, when the client plans one: reconcile paces its
    /// surveys from it.
    fn api_budget(&self) -> Option<crate::provisioning::budget::ApiBudget> {
        None
    }

    /// Called once the state is open, before any port binds, with the number of machines in it
    /// that hold a host: keeps what the startup look-ups found beside a local state for the next
    /// start (a first start creates the directory after them), and refuses, with a message
    /// naming the flags, a start that would lock those hosts out.
    fn state_opened(&self, _live_hosts: usize) -> Result<(), String> {
        Ok(())
    }

    /// Live capacities of the given instance types; types the cloud does not know are absent.
    async fn capacities(
        &self,
        instance_types: &[String],
    ) -> Result<HashMap<String, Capacity>, BackendError>;

    /// The cloud's catalogue for the offered `(type, zone)` pairs, read in as few requests as
    /// the API allows: resources, prices and where each pair stands (available, deprecated).
    /// `None` when this cloud has no such read; prices and capacities then come from
    /// [`Cloud::price_usd`] and [`Cloud::capacities`] and every offering counts as available.
    async fn catalogue(
        &self,
        _pairs: &[(String, String)],
    ) -> Result<Option<crate::provisioning::catalogue::Catalogue>, BackendError> {
        Ok(None)
    }
}

/// The largest cloud API response body read (a page of 50 servers is a few hundred KiB): a
/// misbehaving endpoint or proxy cannot make the provider buffer without bound.
pub const MAX_RESPONSE_BODY: usize = 8 * 1024 * 1024;

/// Why a response body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("response body larger than {limit} bytes; refusing to read it")]
    TooLarge { limit: usize },
    #[error("{0}")]
    Transport(reqwest::Error),
}

/// Reads a response body of at most `limit` bytes, chunk by chunk, failing as soon as it (or
/// its declared length) is larger.
pub async fn read_body(
    mut response: reqwest::Response,
    limit: usize,
) -> Result<Vec<u8>, BodyError> {
    if response.content_length().is_some_and(|n| n > limit as u64) {
        return Err(BodyError::TooLarge { limit });
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(BodyError::Transport)? {
        if body.len() + chunk.len() > limit {
            return Err(BodyError::TooLarge { limit });
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

//! An in-memory cloud for the fake backends of both binaries and for tests: hosts appear after
//! a short, realistic moment, are idempotent on the machine id, and report the same field
//! shape as the real clouds. It never touches a network.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;

use crate::provisioning::backend::{BackendError, ConfigureOrder, TransitionContext};
use crate::provisioning::cloud::{Capacity, Cloud, OwnedHost};
use crate::rules::machine::Machine;
use crate::rules::records::Snapshot;

/// How a fake cloud looks.
#[derive(Clone, Debug)]
pub struct FakeCloudProfile {
    /// Prefix of error messages, e.g. `hcloudfake`.
    pub name: &'static str,
    /// What a host is called in messages, e.g. `server` or `droplet`.
    pub host_noun: &'static str,
    /// The first host id is `id_base + 1`.
    pub id_base: u64,
    /// Public IPv4 addresses are `<ip_prefix>.<n % 250 + 1>` (documentation ranges).
    pub ip_prefix: &'static str,
    /// The constant live price, USD/hour.
    pub price_usd: f64,
    /// How long each transition takes.
    pub latency: Duration,
    /// Hardware capacities.
    pub capacity: fn(&str) -> Option<Capacity>,
}

#[derive(Debug)]
struct State {
    next: u64,
    hosts: BTreeMap<String, OwnedHost>,
    /// The host of each machine that has one (a Create finds it without a scan).
    by_machine: HashMap<String, String>,
    /// (type, zone) pairs a Create is refused for, as a sold-out cloud refuses it.
    sold_out: std::collections::HashSet<(String, String)>,
    /// The most hosts the account may hold.
    host_limit: Option<usize>,
    /// Create calls that reached the cloud.
    creates: u64,
}

impl State {
    fn remove(&mut self, host_id: &str) -> Option<OwnedHost> {
        let host = self.hosts.remove(host_id)?;
        if self.by_machine.get(&host.machine_id).map(String::as_str) == Some(host_id) {
            self.by_machine.remove(&host.machine_id);
        }
        Some(host)
    }
}

/// The fake cloud.
#[derive(Debug)]
pub struct FakeCloud {
    profile: FakeCloudProfile,
    state: Mutex<State>,
}

impl FakeCloud {
    pub fn new(profile: FakeCloudProfile) -> FakeCloud {
        FakeCloud {
            profile,
            state: Mutex::new(State {
                next: 0,
                hosts: BTreeMap::new(),
                by_machine: HashMap::new(),
                sold_out: Default::default(),
                host_limit: None,
                creates: 0,
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn pause(&self, ctx: &TransitionContext) -> Result<(), BackendError> {
        if self.profile.latency.is_zero() {
            return Ok(());
        }
        tokio::select! {
            _ = tokio::time::sleep(self.profile.latency) => Ok(()),
            _ = ctx.cancel.cancelled() => Err(BackendError::new("cancelled")),
        }
    }

    /// Sells `instance_type` out in `zone` (or sells it again): a Create there is refused,
    /// noted as a stockout, and makes nothing.
    pub fn set_sold_out(&self, instance_type: &str, zone: &str, sold_out: bool) {
        let key = (instance_type.to_owned(), zone.to_owned());
        let mut state = self.state();
        if sold_out {
            state.sold_out.insert(key);
        } else {
            state.sold_out.remove(&key);
        }
    }

    /// The most hosts the account may hold (`None`: no limit): a Create beyond it is refused,
    /// noted as the account's limit, and makes nothing.
    pub fn set_host_limit(&self, limit: Option<usize>) {
        self.state().host_limit = limit;
    }

    /// How many Create calls reached the cloud (refused ones included).
    pub fn create_calls(&self) -> u64 {
        self.state().creates
    }

    /// Removes a host behind the provider's back (tests of out-of-band deletion).
    pub fn remove_out_of_band(&self, host_id: &str) -> bool {
        self.state().remove(host_id).is_some()
    }

    /// The hosts that exist now.
    pub fn hosts(&self) -> Vec<OwnedHost> {
        self.state().hosts.values().cloned().collect()
    }

    /// Makes the hosts exactly those the state records, as a real cloud still holds them when
    /// another process takes the state over: each process has its own fake cloud, so a new
    /// leader's would otherwise be empty, and its reconcile would rightly find every recorded
    /// host gone. New hosts are numbered after the recorded ones.
    pub fn restore(&self, snapshot: &Snapshot) {
        let mut state = self.state();
        state.hosts.clear();
        state.by_machine.clear();
        for slot in &snapshot.slots {
            let machine = &slot.machine;
            let Some(host) = machine.host.as_ref().filter(|h| !h.id.is_empty()) else {
                continue;
            };
            let n = host
                .id
                .parse::<u64>()
                .ok()
                .and_then(|id| id.checked_sub(self.profile.id_base));
            if let Some(n) = n {
                state.next = state.next.max(n);
            }
            let restored = OwnedHost {
                id: host.id.clone(),
                machine_id: machine.id.clone(),
                instance_type: machine.instance_type.clone(),
                zone: machine.zone.clone(),
                public_ipv4: n.map(|n| format!("{}.{}", self.profile.ip_prefix, n % 250 + 1)),
                cluster: (!machine.cluster.is_empty()).then(|| machine.cluster.clone()),
                running: true,
            };
            state
                .by_machine
                .insert(restored.machine_id.clone(), restored.id.clone());
            state.hosts.insert(restored.id.clone(), restored);
        }
    }
}

#[async_trait]
impl Cloud for FakeCloud {
    async fn create_host(
        &self,
        machine: &Machine,
        ctx: &TransitionContext,
    ) -> Result<OwnedHost, BackendError> {
        self.pause(ctx).await?;
        let mut state = self.state();
        if let Some(existing) = state
            .by_machine
            .get(&machine.id)
            .and_then(|id| state.hosts.get(id))
        {
            return Ok(existing.clone());
        }
        state.creates += 1;
        if state
            .sold_out
            .contains(&(machine.instance_type.clone(), machine.zone.clone()))
        {
            ctx.refuse(crate::provisioning::backend::Refusal::stockout("sold_out"));
            return Err(BackendError(format!(
                "{}: {} {} is sold out in {}",
                self.profile.name, self.profile.host_noun, machine.instance_type, machine.zone
            )));
        }
        if let Some(limit) = state.host_limit.filter(|l| state.hosts.len() >= *l) {
            ctx.refuse(crate::provisioning::backend::Refusal::account_limit(
                "limit_exceeded",
                Some(state.hosts.len() as u64),
            ));
            return Err(BackendError(format!(
                "{}: the account's {} limit ({limit}) is reached",
                self.profile.name, self.profile.host_noun
            )));
        }
        state.next += 1;
        let n = state.next;
        let host = OwnedHost {
            id: (self.profile.id_base + n).to_string(),
            machine_id: machine.id.clone(),
            instance_type: machine.instance_type.clone(),
            zone: machine.zone.clone(),
            public_ipv4: Some(format!("{}.{}", self.profile.ip_prefix, n % 250 + 1)),
            cluster: None,
            running: true,
        };
        state
            .by_machine
            .insert(host.machine_id.clone(), host.id.clone());
        state.hosts.insert(host.id.clone(), host.clone());
        Ok(host)
    }

    async fn list_hosts(&self) -> Result<Vec<OwnedHost>, BackendError> {
        Ok(self.hosts())
    }

    async fn host_present(&self, host_id: &str) -> Result<Option<bool>, BackendError> {
        Ok(Some(self.state().hosts.contains_key(host_id)))
    }

    async fn configure_host(
        &self,
        _machine: &Machine,
        host_id: &str,
        order: &ConfigureOrder,
        ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        self.pause(ctx).await?;
        let mut state = self.state();
        let host = state.hosts.get_mut(host_id).ok_or_else(|| {
            BackendError(format!(
                "{}: configure unknown {} {host_id:?}",
                self.profile.name, self.profile.host_noun
            ))
        })?;
        host.cluster = Some(order.cluster_id.clone());
        Ok(())
    }

    async fn drain_host(
        &self,
        _machine: &Machine,
        host_id: &str,
        _grace: i64,
        ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        self.pause(ctx).await?;
        let mut state = self.state();
        let host = state.hosts.get_mut(host_id).ok_or_else(|| {
            BackendError(format!(
                "{}: drain unknown {} {host_id:?}",
                self.profile.name, self.profile.host_noun
            ))
        })?;
        host.cluster = None;
        Ok(())
    }

    async fn account_hosts(
        &self,
    ) -> Result<Option<crate::provisioning::headroom::AccountHosts>, BackendError> {
        let state = self.state();
        Ok(state
            .host_limit
            .map(|limit| crate::provisioning::headroom::AccountHosts {
                limit: Some(limit as u64),
                hosts: state.hosts.len() as u64,
            }))
    }

    async fn delete_host(
        &self,
        host_id: &str,
        ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        self.pause(ctx).await?;
        self.state().remove(host_id);
        Ok(())
    }

    async fn price_usd(&self, _instance_type: &str, _zone: &str) -> Result<f64, BackendError> {
        Ok(self.profile.price_usd)
    }

    async fn capacities(
        &self,
        instance_types: &[String],
    ) -> Result<HashMap<String, Capacity>, BackendError> {
        Ok(instance_types
            .iter()
            .filter_map(|t| (self.profile.capacity)(t).map(|c| (t.clone(), c)))
            .collect())
    }
}

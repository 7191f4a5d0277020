//! The offerings-driven [`Backend`] shared by both clouds: slot ids, the Speculative slots of
//! each offering, the merge of owned hosts into them, prices from the [`PriceBook`] (never a
//! network call on the RPC path), allocatable from the [`CapacityBook`] and, from the
//! [`StandingBook`], which offerings are withdrawn (their Speculative slots are not offered
//! while the cloud does not sell them, or after a stockout, see [`crate::provisioning::stockout`]) and, from
//! the [`Headroom`], how many Speculative slots the account can still hold. The cloud itself is
//! behind the [`Cloud`] seam.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_trait::async_trait;

use crate::observability::telemetry::Telemetry;
use crate::provisioning::backend::{
    Backend, BackendError, ConfigureOrder, Refusal, RefusalKind, TransitionContext,
};
use crate::provisioning::catalogue::{Catalogue, StandingBook, now_unix};
use crate::provisioning::cloud::{Capacity, Cloud, OwnedHost};
use crate::provisioning::headroom::{AccountHosts, Headroom};
use crate::provisioning::offerings::Offering;
use crate::provisioning::stockout::{Admission, StockoutBackoff, Withdrawals};
use crate::rules::inventory::{Effect, OfferGroup, Sighting, Survey};
use crate::rules::machine::{CapacityType, HostRef, Machine, MachineState, StringMap};

/// The slot id of offering slot `index`: `<provider>/OnDemand/<type>/<zone>/<NNN>`.
pub fn slot_id(provider: &str, instance_type: &str, zone: &str, index: i64) -> String {
    format!(
        "{provider}/{}/{instance_type}/{zone}/{index:03}",
        CapacityType::OnDemand.name()
    )
}

type PinnedPrice = dyn Fn(&str, &str) -> Option<f64> + Send + Sync;
type PinnedCapacity = dyn Fn(&str) -> Option<Capacity> + Send + Sync;

/// USD/hour per (instance type, zone): live prices over a pinned fallback table.
pub struct PriceBook {
    live: RwLock<HashMap<(String, String), f64>>,
    pinned: Box<PinnedPrice>,
}

impl std::fmt::Debug for PriceBook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PriceBook").finish_non_exhaustive()
    }
}

impl PriceBook {
    pub fn new(pinned: impl Fn(&str, &str) -> Option<f64> + Send + Sync + 'static) -> PriceBook {
        PriceBook {
            live: RwLock::default(),
            pinned: Box::new(pinned),
        }
    }

    /// The live price when one was fetched, else the pinned one.
    pub fn price(&self, instance_type: &str, zone: &str) -> Option<f64> {
        let live = self.live.read().unwrap_or_else(|e| e.into_inner());
        live.get(&(instance_type.to_owned(), zone.to_owned()))
            .copied()
            .or_else(|| (self.pinned)(instance_type, zone))
    }

    /// The live prices fetched so far, by (instance type, zone).
    pub fn live(&self) -> Vec<((String, String), f64)> {
        let live = self.live.read().unwrap_or_else(|e| e.into_inner());
        live.iter().map(|(k, v)| (k.clone(), *v)).collect()
    }

    /// Takes prices saved by an earlier run as live ones until the next refresh replaces them.
    pub fn restore(&self, prices: impl IntoIterator<Item = ((String, String), f64)>) {
        self.live
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .extend(prices);
    }

    /// Fetches live prices for every pair; returns the failures as `(type, zone, error)`.
    pub async fn refresh(
        &self,
        cloud: &dyn Cloud,
        pairs: &[(String, String)],
    ) -> Vec<(String, String, String)> {
        let mut failures = Vec::new();
        for (t, z) in pairs {
            match cloud.price_usd(t, z).await {
                Ok(price) if price.is_finite() && price >= 0.0 => {
                    self.live
                        .write()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert((t.clone(), z.clone()), price);
                }
                Ok(price) => {
                    failures.push((t.clone(), z.clone(), format!("implausible price {price}")))
                }
                Err(e) => failures.push((t.clone(), z.clone(), e.0)),
            }
        }
        failures
    }
}

/// Hardware capacity per instance type: the live catalogue over a pinned table.
pub struct CapacityBook {
    live: RwLock<HashMap<String, Capacity>>,
    pinned: Box<PinnedCapacity>,
}

impl std::fmt::Debug for CapacityBook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CapacityBook").finish_non_exhaustive()
    }
}

impl CapacityBook {
    pub fn new(pinned: impl Fn(&str) -> Option<Capacity> + Send + Sync + 'static) -> CapacityBook {
        CapacityBook {
            live: RwLock::default(),
            pinned: Box::new(pinned),
        }
    }

    pub fn capacity(&self, instance_type: &str) -> Option<Capacity> {
        let live = self.live.read().unwrap_or_else(|e| e.into_inner());
        live.get(instance_type)
            .copied()
            .or_else(|| (self.pinned)(instance_type))
    }

    /// `cpu`, `memory` and (when the disk is known) `ephemeral-storage` of the type; empty for
    /// a type neither the catalogue nor the pinned table knows.
    pub fn allocatable(&self, instance_type: &str) -> StringMap {
        self.capacity(instance_type)
            .map(|c| c.resources())
            .unwrap_or_default()
    }

    /// The capacities the live catalogue resolved so far.
    pub fn live(&self) -> Vec<(String, Capacity)> {
        let live = self.live.read().unwrap_or_else(|e| e.into_inner());
        live.iter().map(|(k, v)| (k.clone(), *v)).collect()
    }

    /// Takes capacities saved by an earlier run until the next resolve replaces them.
    pub fn restore(&self, capacities: impl IntoIterator<Item = (String, Capacity)>) {
        self.live
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .extend(capacities);
    }

    /// Overlays the live catalogue; returns how many of `types` it did not resolve.
    pub async fn resolve(
        &self,
        cloud: &dyn Cloud,
        types: &[String],
    ) -> Result<usize, BackendError> {
        let found = cloud.capacities(types).await?;
        let unresolved = types.iter().filter(|t| !found.contains_key(*t)).count();
        self.live
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .extend(found);
        Ok(unresolved)
    }
}

/// The offerings-driven backend over one cloud.
pub struct Fleet {
    cloud: Arc<dyn Cloud>,
    provider: String,
    offerings: Vec<Offering>,
    prices: Arc<PriceBook>,
    capacities: Arc<CapacityBook>,
    standings: StandingBook,
    extra_labels: fn(&str) -> StringMap,
    withdrawals: Withdrawals,
    headroom: Headroom,
    telemetry: Option<Telemetry>,
    /// Bumped whenever what is offered may have changed other than by the clock (a stockout, a
    /// probe's end, the headroom): the engine then fits its Speculative slots at once.
    offers: tokio::sync::watch::Sender<u64>,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("provider", &self.provider)
            .finish_non_exhaustive()
    }
}

impl Fleet {
    pub fn new(
        cloud: Arc<dyn Cloud>,
        provider: impl Into<String>,
        offerings: Vec<Offering>,
        prices: Arc<PriceBook>,
        capacities: Arc<CapacityBook>,
        extra_labels: fn(&str) -> StringMap,
    ) -> Fleet {
        Fleet {
            cloud,
            provider: provider.into(),
            offerings,
            prices,
            capacities,
            standings: StandingBook::default(),
            extra_labels,
            withdrawals: Withdrawals::new(StockoutBackoff::default()),
            headroom: Headroom::new(StockoutBackoff::default()),
            telemetry: None,
            offers: tokio::sync::watch::Sender::new(0),
        }
    }

    /// This fleet with `backoff` for offerings withdrawn after a stockout and for the probes of
    /// a learned account limit.
    pub fn with_stockout_backoff(mut self, backoff: StockoutBackoff) -> Fleet {
        self.withdrawals = Withdrawals::new(backoff);
        self.headroom = Headroom::new(backoff);
        self
    }

    /// This fleet, recording refusals, withdrawals and headroom under `telemetry`.
    pub fn with_telemetry(mut self, telemetry: Telemetry) -> Fleet {
        self.telemetry = Some(telemetry);
        self
    }

    /// The offerings withdrawn after a stockout.
    pub fn stockouts(&self) -> &Withdrawals {
        &self.withdrawals
    }

    /// The account's headroom.
    pub fn headroom(&self) -> &Headroom {
        &self.headroom
    }

    fn offers_changed(&self) {
        self.offers.send_modify(|n| *n = n.wrapping_add(1));
        if let Some(t) = self.telemetry {
            t.account_headroom(self.headroom.headroom());
        }
    }

    /// Reads how many hosts the account holds (and its limit, where the API says) within
    /// `budget`, into the headroom. Returns what was read, `None` when this cloud has no such
    /// read.
    pub async fn read_account(
        &self,
        budget: Duration,
    ) -> Result<Option<AccountHosts>, BackendError> {
        let read = crate::provisioning::budget::scoped(
            crate::provisioning::budget::Class::Refresh,
            self.cloud.account_hosts(),
        );
        let account = tokio::time::timeout(budget, read)
            .await
            .map_err(|_| BackendError::new("the account read timed out"))??;
        if let Some(account) = account {
            self.headroom.read(account);
            self.offers_changed();
        }
        Ok(account)
    }

    /// Why a Create that sent nothing returns its slot: noted on `ctx`, counted, and the text
    /// of its `last_error`.
    fn unsent(
        &self,
        ctx: &TransitionContext,
        machine: &Machine,
        refusal: Refusal,
        message: String,
    ) -> BackendError {
        ctx.refuse(refusal);
        if let Some(t) = self.telemetry {
            t.create_refused(&machine.instance_type, &machine.zone, refusal.code);
        }
        BackendError(message)
    }

    /// Whether a stockout or an account limit is in force that a Create's end can change.
    fn offers_may_change(&self) -> bool {
        self.headroom.limit().is_some()
    }

    /// Where each offering stands in the cloud's catalogue.
    pub fn standings(&self) -> &StandingBook {
        &self.standings
    }

    /// Takes a catalogue read: its prices and capacities become the live ones and its standings
    /// decide which offerings are withdrawn.
    pub fn apply_catalogue(&self, catalogue: Catalogue) {
        self.capacities.restore(catalogue.capacities);
        let mut prices = Vec::new();
        let mut standings = Vec::new();
        for (pair, entry) in catalogue.entries {
            if let Some(price) = entry.price_usd.filter(|p| p.is_finite() && *p >= 0.0) {
                prices.push((pair.clone(), price));
            }
            standings.push((pair, entry.standing));
        }
        self.prices.restore(prices);
        let now = now_unix();
        let mut sold_again = false;
        for ((t, z), standing) in &standings {
            let was_off = self.standings.withdrawn(t, z, now).is_some();
            if was_off && standing.withdrawn_at(now).is_none() && self.withdrawals.sold(t, z) {
                tracing::info!(
                    instance_type = t,
                    zone = z,
                    "stockout: the catalogue sells the offering again; its slots are advertised again"
                );
                sold_again = true;
            }
        }
        self.standings.extend(standings);
        if sold_again {
            if let Some(tel) = self.telemetry {
                for (t, z) in self.price_pairs() {
                    tel.offering_stockout(&t, &z, self.withdrawal(&t, &z).is_some());
                }
            }
            self.offers_changed();
        }
    }

    /// Why the offering of `instance_type` in `zone` is withdrawn now, or `None`: the cloud's
    /// catalogue does not sell it there, or a stockout withdrew it for a backoff (or while its
    /// probe runs).
    pub fn withdrawn(&self, instance_type: &str, zone: &str) -> Option<String> {
        self.standings
            .withdrawn(instance_type, zone, now_unix())
            .or_else(|| {
                self.withdrawals
                    .withdrawn(instance_type, zone, tokio::time::Instant::now())
                    .map(|why| format!("stockout: {why}"))
            })
    }

    /// Why the offering is not sold now as the operator should see it: withdrawn (see
    /// [`Fleet::withdrawn`]), or awaiting the probe that ends a stockout.
    pub fn withdrawal(&self, instance_type: &str, zone: &str) -> Option<String> {
        self.withdrawn(instance_type, zone).or_else(|| {
            self.withdrawals
                .all()
                .into_iter()
                .find(|((t, z), _)| t == instance_type && z == zone)
                .map(|(_, w)| {
                    format!(
                        "stockout: {} ({} in a row); the next Create on it probes",
                        w.code, w.strikes
                    )
                })
        })
    }

    /// The offerings whose slots are offered now (not withdrawn).
    fn advertised(&self) -> impl Iterator<Item = &Offering> + Clone {
        self.offerings
            .iter()
            .filter(move |o| self.withdrawn(&o.instance_type, &o.zone).is_none())
    }

    pub fn cloud(&self) -> &Arc<dyn Cloud> {
        &self.cloud
    }

    pub fn prices(&self) -> &Arc<PriceBook> {
        &self.prices
    }

    pub fn capacities(&self) -> &Arc<CapacityBook> {
        &self.capacities
    }

    /// The distinct (type, zone) pairs of the offerings.
    pub fn price_pairs(&self) -> Vec<(String, String)> {
        let mut seen = HashSet::new();
        self.offerings
            .iter()
            .map(|o| (o.instance_type.clone(), o.zone.clone()))
            .filter(|p| seen.insert(p.clone()))
            .collect()
    }

    /// The distinct instance types of the offerings.
    pub fn instance_types(&self) -> Vec<String> {
        let mut seen = HashSet::new();
        self.offerings
            .iter()
            .map(|o| o.instance_type.clone())
            .filter(|t| seen.insert(t.clone()))
            .collect()
    }

    /// Offered pairs with neither a live nor a pinned price: a startup error, never a silent 0.
    /// Withdrawn pairs are left out: they advertise nothing, and the catalogue read that makes
    /// one orderable again prices it.
    pub fn unpriced(&self) -> Vec<(String, String)> {
        self.price_pairs()
            .into_iter()
            .filter(|(t, z)| self.prices.price(t, z).is_none() && self.withdrawn(t, z).is_none())
            .collect()
    }

    fn machine(&self, id: String, instance_type: &str, zone: &str) -> Machine {
        let mut m = Machine::speculative(id, instance_type);
        m.zone = zone.to_owned();
        m.capacity_type = CapacityType::OnDemand;
        m.price_per_hour = self.prices.price(instance_type, zone).unwrap_or(0.0);
        m.allocatable = self.capacities.allocatable(instance_type);
        m
    }

    /// Labels every slot of `instance_type` in `zone` carries, with the values the Node it
    /// becomes will have: its architecture (`kubernetes.io/arch`, from the catalogue, as the
    /// kubelet sets it), its type and its region (`node.kubernetes.io/instance-type` and
    /// `topology.kubernetes.io/region`, as both clouds' controller managers set them: the server
    /// type or size, and the location or region), then the cloud's own.
    fn node_labels(&self, instance_type: &str, zone: &str) -> StringMap {
        let mut labels = StringMap::from([
            (
                "node.kubernetes.io/instance-type".to_owned(),
                instance_type.to_owned(),
            ),
            ("topology.kubernetes.io/region".to_owned(), zone.to_owned()),
        ]);
        if let Some(arch) = self.capacities.capacity(instance_type).and_then(|c| c.arch) {
            labels.insert("kubernetes.io/arch".to_owned(), arch.name().to_owned());
        }
        labels.extend((self.extra_labels)(instance_type));
        labels
    }

    /// The per-replica resources of an offering: its own when it names some, else the whole
    /// machine as the catalogue describes it.
    fn offering_resources(&self, resources: &StringMap, instance_type: &str) -> StringMap {
        if resources.is_empty() {
            self.capacities.allocatable(instance_type)
        } else {
            resources.clone()
        }
    }

    fn slots(&self) -> Vec<Machine> {
        self.slots_of(self.advertised())
    }

    /// The ids of the slots of `offerings`.
    fn slot_ids<'a>(
        &self,
        offerings: impl Iterator<Item = &'a Offering> + Clone,
    ) -> HashSet<String> {
        let total = offerings.clone().map(|o| o.count.max(0) as usize).sum();
        let mut ids = HashSet::with_capacity(total);
        for o in offerings {
            for i in 0..o.count.max(0) {
                ids.insert(slot_id(&self.provider, &o.instance_type, &o.zone, i));
            }
        }
        ids
    }

    /// The Speculative slots of `offerings`.
    fn slots_of<'a>(&self, offerings: impl Iterator<Item = &'a Offering> + Clone) -> Vec<Machine> {
        let total = offerings.clone().map(|o| o.count.max(0) as usize).sum();
        let mut out = Vec::with_capacity(total);
        for o in offerings {
            // One shape per offering, shared by all of its slots.
            let shape = self.shape(o);
            for i in 0..o.count.max(0) {
                let mut m = shape.clone();
                m.id = slot_id(&self.provider, &o.instance_type, &o.zone, i);
                out.push(m);
            }
        }
        out
    }

    /// The Speculative slot of offering `o`, named as its first slot (the prefix of the ids
    /// its slots get).
    fn shape(&self, o: &Offering) -> Machine {
        let id = slot_id(&self.provider, &o.instance_type, &o.zone, 0);
        let mut shape = self.machine(id, &o.instance_type, &o.zone);
        shape.resources = self.offering_resources(&o.resources, &o.instance_type);
        shape.labels = o.labels.clone();
        shape
            .labels
            .extend(self.node_labels(&o.instance_type, &o.zone));
        shape
    }

    fn host_ref(&self, host: &OwnedHost) -> HostRef {
        HostRef {
            provider: self.provider.clone(),
            id: host.id.clone(),
        }
    }

    /// Resources for a host without a slot: from an offering of the same type, the same zone
    /// preferred.
    fn recovered_resources(&self, instance_type: &str, zone: &str) -> StringMap {
        let same_type = self
            .offerings
            .iter()
            .filter(|o| o.instance_type == instance_type);
        same_type
            .clone()
            .find(|o| o.zone == zone)
            .or_else(|| same_type.clone().next())
            .map(|o| self.offering_resources(&o.resources, instance_type))
            .unwrap_or_default()
    }

    fn host_id<'a>(&self, machine: &'a Machine, action: &str) -> Result<&'a str, BackendError> {
        machine
            .host
            .as_ref()
            .filter(|h| !h.id.is_empty())
            .map(|h| h.id.as_str())
            .ok_or_else(|| BackendError(format!("{action}: machine {} has no host", machine.id)))
    }
}

impl Fleet {
    /// The records of every slot and owned host: one record per machine id, the oldest host
    /// (lowest id, numerically when ids are numbers) when several carry one id.
    fn records(&self, hosts: &[OwnedHost]) -> Vec<Machine> {
        let mut by_machine: HashMap<&str, &OwnedHost> = HashMap::new();
        for h in hosts {
            if h.machine_id.is_empty() {
                continue;
            }
            let older = by_machine
                .get(h.machine_id.as_str())
                .is_some_and(|kept| host_order(kept) <= host_order(h));
            if !older {
                by_machine.insert(h.machine_id.as_str(), h);
            }
        }
        // Every offering's slots, so that a host in a slot of a withdrawn offering keeps its
        // offering's shape; the withdrawn offerings' slots without a host are then left out.
        let mut out = self.slots_of(self.offerings.iter());
        let mut matched = HashSet::new();
        for m in &mut out {
            if let Some(host) = by_machine.get(m.id.as_str()) {
                m.state = MachineState::Idle;
                m.host = Some(self.host_ref(host));
                matched.insert(m.id.clone());
            }
        }
        let withdrawn: HashSet<(&str, &str)> = self
            .offerings
            .iter()
            .filter(|o| self.withdrawn(&o.instance_type, &o.zone).is_some())
            .map(|o| (o.instance_type.as_str(), o.zone.as_str()))
            .collect();
        if !withdrawn.is_empty() {
            out.retain(|m| {
                m.host.is_some()
                    || !withdrawn.contains(&(m.instance_type.as_str(), m.zone.as_str()))
            });
        }
        let mut extra: Vec<&OwnedHost> = by_machine
            .values()
            .filter(|h| !matched.contains(&h.machine_id))
            .copied()
            .collect();
        extra.sort_by(|a, b| host_order(a).cmp(&host_order(b)));
        for host in extra {
            // A host of a configured offering (its machine id one of this or an earlier
            // state's) takes that offering's shape; any other is recovered as the reference
            // does, without labels.
            let offering = self
                .offerings
                .iter()
                .find(|o| o.instance_type == host.instance_type && o.zone == host.zone);
            let mut m = match offering {
                Some(o) => {
                    let mut m = self.shape(o);
                    m.id = host.machine_id.clone();
                    m
                }
                None => {
                    let mut m =
                        self.machine(host.machine_id.clone(), &host.instance_type, &host.zone);
                    m.resources = self.recovered_resources(&host.instance_type, &host.zone);
                    m
                }
            };
            m.state = MachineState::Idle;
            m.host = Some(self.host_ref(host));
            out.push(m);
        }
        out
    }
}

/// Orders host ids oldest first: numeric ids by value, others after them by text.
fn host_order(host: &OwnedHost) -> (u64, &str) {
    (host.id.parse::<u64>().unwrap_or(u64::MAX), host.id.as_str())
}

#[async_trait]
impl Backend for Fleet {
    async fn describe(&self) -> Result<Vec<Machine>, BackendError> {
        let hosts = self.cloud.list_hosts().await?;
        Ok(self.records(&hosts))
    }

    async fn survey(&self) -> Result<Survey, BackendError> {
        let hosts = self.cloud.list_hosts().await?;
        let machines = self.records(&hosts);
        let sightings = hosts
            .iter()
            .filter(|h| !h.machine_id.is_empty())
            .map(|h| Sighting {
                machine_id: h.machine_id.clone(),
                host: self.host_ref(h),
            })
            .collect();
        Ok(Survey {
            machines,
            hosts: Some(sightings),
        })
    }

    async fn host_present(
        &self,
        _machine_id: &str,
        host: &HostRef,
    ) -> Result<Option<bool>, BackendError> {
        if host.id.is_empty() {
            return Ok(Some(false));
        }
        self.cloud.host_present(&host.id).await
    }

    async fn machine_hosts(&self, machine_id: &str) -> Result<Option<Vec<HostRef>>, BackendError> {
        Ok(self
            .cloud
            .machine_hosts(machine_id)
            .await?
            .map(|hosts| hosts.iter().map(|h| self.host_ref(h)).collect()))
    }

    fn offered(&self) -> Option<Vec<Machine>> {
        Some(self.slots())
    }

    fn offered_ids(&self) -> Option<HashSet<String>> {
        Some(self.slot_ids(self.advertised()))
    }

    fn offer(&self) -> Option<Vec<OfferGroup>> {
        Some(
            self.offerings
                .iter()
                .map(|o| OfferGroup {
                    shape: self.shape(o),
                    count: o.count.max(0) as usize,
                    advertised: self.withdrawn(&o.instance_type, &o.zone).is_none(),
                })
                .collect(),
        )
    }

    async fn create(
        &self,
        machine: &Machine,
        ctx: &TransitionContext,
    ) -> Result<Effect, BackendError> {
        let (t, z) = (machine.instance_type.as_str(), machine.zone.as_str());
        if let Some(why) = self.standings.withdrawn(t, z, now_unix()) {
            return Err(self.unsent(
                ctx,
                machine,
                Refusal::stockout("withdrawn"),
                format!(
                    "offering {t}/{z} is withdrawn ({why}): the cloud does not sell it there now; nothing was sent"
                ),
            ));
        }
        let now = tokio::time::Instant::now();
        let probe = match self.withdrawals.admit(t, z, now) {
            Admission::Open => false,
            Admission::Probe => {
                tracing::info!(instance_type = t, zone = z, machine_id = %machine.id, "stockout: the backoff is over; this Create probes the offering");
                self.offers_changed();
                true
            }
            Admission::Withdrawn { code, left } => {
                let when = if left.is_zero() {
                    "when the probe Create in flight shows it is sold again".to_owned()
                } else {
                    format!(
                        "in {} at the latest",
                        crate::observability::duration::format(Duration::from_secs(left.as_secs()))
                    )
                };
                return Err(self.unsent(
                    ctx,
                    machine,
                    Refusal::stockout("withdrawn"),
                    format!(
                        "stockout: offering {t}/{z} is withdrawn since the cloud refused it ({code}); nothing was sent and the offering comes back {when}"
                    ),
                ));
            }
        };
        let account_probe = match self.headroom.admit(now) {
            Admission::Open => false,
            Admission::Probe => true,
            Admission::Withdrawn { .. } => {
                if probe {
                    self.withdrawals.inconclusive(t, z);
                }
                self.offers_changed();
                let limit = self.headroom.limit().map_or(0, |(l, _)| l);
                return Err(self.unsent(
                    ctx,
                    machine,
                    Refusal::account_limit("no_headroom", None),
                    format!(
                        "account limit: the cloud account holds as many hosts as its limit ({limit}) allows; nothing was sent (raise the limit, or delete hosts)"
                    ),
                ));
            }
        };
        if account_probe || self.offers_may_change() {
            self.offers_changed();
        }
        let ctx = ctx.with_host_provider(&self.provider);
        let created = self.cloud.create_host(machine, &ctx).await;
        let host = match created {
            Ok(host) if !host.id.is_empty() => host,
            Ok(_) => {
                if probe {
                    self.withdrawals.inconclusive(t, z);
                }
                self.headroom.ended(false, account_probe);
                if probe || self.offers_may_change() {
                    self.offers_changed();
                }
                return Err(BackendError(format!(
                    "create {} returned no host id",
                    machine.instance_type
                )));
            }
            Err(e) => return Err(self.create_failed(machine, &ctx, e, probe, account_probe)),
        };
        let sold_again = self.withdrawals.sold(t, z);
        self.headroom.ended(true, account_probe);
        if sold_again {
            tracing::info!(instance_type = t, zone = z, machine_id = %machine.id, "stockout: the probe Create made a host; the offering's slots are advertised again");
            if let Some(tel) = self.telemetry {
                tel.offering_stockout(t, z, self.withdrawal(t, z).is_some());
            }
        }
        if sold_again || account_probe || self.offers_may_change() {
            self.offers_changed();
        }
        Ok(Effect {
            host: Some(self.host_ref(&host)),
            resources: StringMap::new(),
            allocatable: self.capacities.allocatable(&machine.instance_type),
        })
    }

    async fn configure(
        &self,
        machine: &Machine,
        order: &ConfigureOrder,
        ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        let host_id = self.host_id(machine, "configure")?;
        self.cloud
            .configure_host(machine, host_id, order, ctx)
            .await
    }

    fn has_readiness_gate(&self) -> bool {
        self.cloud.has_readiness_gate()
    }

    async fn confirm_ready(
        &self,
        machine: &Machine,
        cluster_id: &str,
        ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        let host_id = self.host_id(machine, "readiness")?;
        self.cloud
            .confirm_ready(machine, host_id, cluster_id, ctx)
            .await
    }

    async fn drain(
        &self,
        machine: &Machine,
        grace_period_seconds: i64,
        ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        let host_id = self.host_id(machine, "drain")?;
        self.cloud
            .drain_host(machine, host_id, grace_period_seconds.max(1), ctx)
            .await
    }

    async fn delete(&self, machine: &Machine, ctx: &TransitionContext) -> Result<(), BackendError> {
        let host_id = self.host_id(machine, "delete")?;
        self.cloud.delete_host(host_id, ctx).await?;
        self.headroom.deleted();
        if self.offers_may_change() {
            self.offers_changed();
        }
        Ok(())
    }

    fn speculative_cap(&self) -> Option<usize> {
        self.headroom.cap(tokio::time::Instant::now())
    }

    fn offer_changes(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        Some(self.offers.subscribe())
    }

    fn next_offer_change(&self) -> Option<tokio::time::Instant> {
        let now = tokio::time::Instant::now();
        [
            self.withdrawals.next_change(now),
            self.headroom.next_change(now),
        ]
        .into_iter()
        .flatten()
        .min()
    }
}

impl Fleet {
    /// A create that failed: a refusal the cloud noted on `ctx` withdraws the offering (a
    /// stockout) or caps the headroom (the account's limit), and its error says so; any other
    /// error ends a probe without a verdict.
    fn create_failed(
        &self,
        machine: &Machine,
        ctx: &TransitionContext,
        error: BackendError,
        probe: bool,
        account_probe: bool,
    ) -> BackendError {
        let (t, z) = (machine.instance_type.as_str(), machine.zone.as_str());
        let now = tokio::time::Instant::now();
        let jitter: f64 = rand::random();
        let Some(refusal) = ctx.refusal() else {
            if probe {
                self.withdrawals.inconclusive(t, z);
            }
            self.headroom.ended(false, account_probe);
            if probe || account_probe || self.offers_may_change() {
                self.offers_changed();
            }
            return error;
        };
        if let Some(tel) = self.telemetry {
            tel.create_refused(t, z, refusal.code);
        }
        let message = match refusal.kind {
            RefusalKind::Stockout => {
                self.headroom.ended(false, account_probe);
                let wait = self
                    .withdrawals
                    .stockout(t, z, refusal.code, now, jitter, probe);
                let strikes = self
                    .withdrawals
                    .all()
                    .into_iter()
                    .find(|((it, iz), _)| it == t && iz == z)
                    .map_or(1, |(_, w)| w.strikes);
                let wait =
                    crate::observability::duration::format(Duration::from_secs(wait.as_secs()));
                tracing::warn!(instance_type = t, zone = z, machine_id = %machine.id, code = refusal.code, strikes, backoff = wait, err = %error, "stockout: the cloud cannot place this offering now; its Speculative slots are withdrawn for the backoff, then one Create probes it; the machine's capacity comes back under a new machine id");
                if let Some(tel) = self.telemetry {
                    tel.offering_stockout(t, z, true);
                }
                format!(
                    "stockout: {error}; offering {t}/{z} is withdrawn for {wait} (stockout {strikes} in a row), then one Create probes it; nothing was created"
                )
            }
            RefusalKind::AccountLimit => {
                if probe {
                    self.withdrawals.inconclusive(t, z);
                }
                self.headroom
                    .refused(refusal.account_hosts, account_probe, now, jitter);
                let limit = self.headroom.limit().map_or(0, |(l, _)| l);
                tracing::warn!(instance_type = t, zone = z, machine_id = %machine.id, code = refusal.code, limit, err = %error, "account limit: the cloud account holds as many hosts as its limit allows; Speculative slots are capped to the headroom; the machine's capacity comes back under a new machine id");
                format!(
                    "account limit: {error}; the account holds {limit} hosts, its limit; nothing was created (raise the limit, or delete hosts)"
                )
            }
        };
        self.offers_changed();
        BackendError(message)
    }
}

/// Budget of the startup price warm-up and capacity resolution.
pub const WARMUP_BUDGET: Duration = Duration::from_secs(20);

/// A fleet over a fake cloud with no latency, `p` as the provider, a price of 0.01 everywhere and
/// no known capacities, for tests; the cloud is returned too, to act behind the fleet's back.
#[cfg(test)]
pub(crate) fn test_fleet(
    offerings: Vec<Offering>,
) -> (Arc<crate::provisioning::fake::FakeCloud>, Fleet) {
    use crate::provisioning::fake::{FakeCloud, FakeCloudProfile};
    let cloud = Arc::new(FakeCloud::new(FakeCloudProfile {
        name: "fake",
        host_noun: "server",
        id_base: 0,
        ip_prefix: "192.0.2",
        price_usd: 0.01,
        latency: Duration::ZERO,
        capacity: |_| None,
    }));
    let fleet = Fleet::new(
        cloud.clone(),
        "p",
        offerings,
        Arc::new(PriceBook::new(|_, _| Some(0.01))),
        Arc::new(CapacityBook::new(|_| None)),
        |_| StringMap::new(),
    );
    (cloud, fleet)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provisioning::offerings::default_mix;

    #[test]
    fn offered_ids_are_the_ids_of_the_offered_slots() {
        let mut offerings = default_mix(1003, ["a", "b"], ["z1", "z2"]);
        offerings[1].count = 0;
        let (_, fleet) = test_fleet(offerings);
        let offered = fleet.offered().expect("offered");
        let ids = fleet.offered_ids().expect("ids");
        assert_eq!(ids.len(), offered.len());
        assert!(offered.iter().all(|m| ids.contains(&m.id)));
        assert!(offered.len() > 700, "{} slots", offered.len());
    }

    fn standing_of(why: &str) -> crate::provisioning::catalogue::Standing {
        crate::provisioning::catalogue::Standing::unavailable(why)
    }

    #[tokio::test]
    async fn a_withdrawn_offering_leaves_the_offered_set_and_comes_back() {
        let (_, fleet) = test_fleet(default_mix(8, ["a", "b"], ["z1", "z2"]));
        let ctx = TransitionContext::with_timeout("op", Duration::from_secs(5));
        let all = fleet.offered().expect("offered");
        assert_eq!(all.len(), 8);
        // One host in a slot of a/z1 before it is withdrawn.
        let hosted = all
            .iter()
            .find(|m| m.instance_type == "a" && m.zone == "z1")
            .expect("a/z1 slot")
            .clone();
        fleet.create(&hosted, &ctx).await.expect("create");
        fleet
            .standings()
            .extend([(("a".to_owned(), "z1".to_owned()), standing_of("sold out"))]);
        let offered = fleet.offered().expect("offered");
        assert_eq!(offered.len(), 6, "a/z1's two slots are withdrawn");
        assert!(
            offered
                .iter()
                .all(|m| (m.instance_type.as_str(), m.zone.as_str()) != ("a", "z1"))
        );
        let ids = fleet.offered_ids().expect("ids");
        assert_eq!(ids.len(), 6);
        // The hosted slot is still described, Idle, with its offering's shape.
        let described = fleet.describe().await.expect("describe");
        assert_eq!(described.len(), 7);
        let kept = described
            .iter()
            .find(|m| m.id == hosted.id)
            .expect("the hosted slot stays");
        assert_eq!(kept.state, MachineState::Idle);
        assert_eq!(kept.resources, hosted.resources);
        // A Create of a withdrawn slot is refused without calling the cloud.
        let other = all
            .iter()
            .find(|m| m.instance_type == "a" && m.zone == "z1" && m.id != hosted.id)
            .expect("second a/z1 slot");
        let refused = fleet.create(other, &ctx).await.expect_err("withdrawn");
        assert!(
            refused.0.contains("a/z1 is withdrawn (sold out)"),
            "{refused}"
        );
        // Available again: the slots come back.
        fleet.standings().extend([(
            ("a".to_owned(), "z1".to_owned()),
            crate::provisioning::catalogue::Standing::available(),
        )]);
        assert_eq!(fleet.offered().expect("offered").len(), 8);
        assert_eq!(fleet.describe().await.expect("describe").len(), 8);
    }

    #[test]
    fn a_withdrawn_offering_needs_no_price() {
        let (_, fleet) = test_fleet(default_mix(2, ["a", "b"], ["z1", "z1"]));
        let fleet = Fleet {
            prices: Arc::new(PriceBook::new(|t, _| (t == "a").then_some(0.5))),
            ..fleet
        };
        assert_eq!(fleet.unpriced(), [("b".to_owned(), "z1".to_owned())]);
        fleet
            .standings()
            .extend([(("b".to_owned(), "z1".to_owned()), standing_of("unknown"))]);
        assert!(fleet.unpriced().is_empty());
    }

    #[test]
    fn an_offering_past_its_deprecation_date_is_withdrawn() {
        let (_, fleet) = test_fleet(default_mix(4, ["a", "b"], ["z1", "z1"]));
        let deprecated = |after: &str| crate::provisioning::catalogue::Standing {
            deprecation: Some(crate::provisioning::catalogue::Deprecation {
                announced: "2025-01-01T00:00:00Z".into(),
                unavailable_after: after.into(),
            }),
            ..crate::provisioning::catalogue::Standing::available()
        };
        fleet.standings().extend([
            (
                ("a".to_owned(), "z1".to_owned()),
                deprecated("2025-12-31T23:59:59Z"),
            ),
            (
                ("b".to_owned(), "z1".to_owned()),
                deprecated("2999-01-01T00:00:00Z"),
            ),
        ]);
        let offered = fleet.offered().expect("offered");
        assert!(!offered.is_empty());
        assert!(
            offered.iter().all(|m| m.instance_type == "b"),
            "{offered:?}"
        );
        assert!(fleet.withdrawn("a", "z1").is_some());
        assert_eq!(fleet.withdrawn("b", "z1"), None);
    }

    #[test]
    fn an_offering_without_resources_takes_the_machine_from_the_catalogue() {
        let mut offerings = default_mix(2, ["a", "b"], ["z1", "z1"]);
        offerings[1].resources.clear();
        let (_, fleet) = test_fleet(offerings);
        fleet.capacities().restore([
            (
                "a".to_owned(),
                Capacity {
                    vcpus: 2,
                    memory_mib: 4096,
                    disk_gib: 40,
                    arch: Some(crate::provisioning::cloud::Arch::Arm64),
                },
            ),
            (
                "b".to_owned(),
                Capacity {
                    vcpus: 8,
                    memory_mib: 16384,
                    disk_gib: 160,
                    arch: Some(crate::provisioning::cloud::Arch::Amd64),
                },
            ),
        ]);
        let offered = fleet.offered().expect("offered");
        let a = offered.iter().find(|m| m.instance_type == "a").expect("a");
        let b = offered.iter().find(|m| m.instance_type == "b").expect("b");
        assert_eq!(a.resources["cpu"], "1", "the offering's own resources stay");
        assert_eq!(a.labels["kubernetes.io/arch"], "arm64");
        assert_eq!(a.allocatable["ephemeral-storage"], "40Gi");
        assert_eq!(
            b.resources,
            StringMap::from([
                ("cpu".to_owned(), "8".to_owned()),
                ("memory".to_owned(), "16Gi".to_owned()),
                ("ephemeral-storage".to_owned(), "160Gi".to_owned()),
            ])
        );
        assert_eq!(b.allocatable, b.resources);
        assert_eq!(b.labels["kubernetes.io/arch"], "amd64");
    }
}

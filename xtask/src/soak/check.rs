//! The soak's checker: what the workers were told (acknowledged operations and where each
//! machine settled), compared continuously and at the end with what the provider lists and
//! what the emulator holds.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{Result, bail};
use fleet_proto::v1alpha1 as pb;
use tokio::sync::watch;
use tokio::time::Instant;
use tonic::transport::Channel;

use shard_model::{Shards, State};

use super::clouds::Emulated;
use super::{CREATE_TIMEOUT, DELETE_TIMEOUT, ORPHAN_GRACE, RECONCILE_INTERVAL, Tally};
use crate::e2e::wire;

/// Longest a machine may stay transitional: the longest deadline plus a restart.
const STUCK_AFTER: Duration = Duration::from_secs(CREATE_TIMEOUT.as_secs() + 40);

/// Longest an owned host may stay attached to no machine: a Create in flight, then the
/// orphan grace, several passes (or two of the surveys the provider paces to its budget
/// share, `survey_period`, when they come less often) and a restart.
pub(crate) fn untracked_bound(survey_period: Duration) -> Duration {
    CREATE_TIMEOUT
        + DELETE_TIMEOUT
        + ORPHAN_GRACE
        + (RECONCILE_INTERVAL * 10).max(survey_period * 2)
        + Duration::from_secs(30)
}

/// The longest survey period a provider may report and still be waited for: beyond it the
/// soak's bounds stop growing (a provider that surveys less often fails them).
const LONGEST_SURVEY_PERIOD: Duration = Duration::from_secs(300);

/// Where a machine should be while no worker acts on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Expect {
    Speculative,
    Idle { host: String },
    Failed,
}

#[derive(Default)]
struct Inner {
    violation: Option<String>,
    /// machine -> where it should be, and since when (a listing asked for earlier predates it).
    expect: HashMap<String, (Expect, Instant)>,
    busy: HashSet<String>,
    transitional_since: HashMap<String, (i32, Instant)>,
    /// machine -> the last things workers did to it, for violation reports.
    history: HashMap<String, std::collections::VecDeque<String>>,
    untracked_since: HashMap<String, Instant>,
    /// Every host seen live during the run.
    seen_hosts: HashSet<String>,
    /// The longest reconcile survey period the provider reported
    /// (`<prefix>_reconcile_period_seconds`): at the default budget shares surveys are paced
    /// to their share, and a host deleted out of band is noticed by the next survey (or a
    /// check between two, where the share leaves room for them).
    survey_period: Duration,
}

pub(crate) struct Checker {
    emulated: Emulated,
    tally: Tally,
    /// Every machine id a worker owned: the ones listed at the start, and the new ids the
    /// capacity of retired machines came back under.
    ids: Mutex<Vec<String>>,
    inner: Mutex<Inner>,
    /// BigFleet's shard, as a full-reconcile model and an incremental one, fed every List the
    /// checker reads and every answer and Get the workers see.
    shards: Mutex<Shards>,
    /// Held across every call whose answer the models read and its reading: the models see
    /// answers in the order the provider gave them, as a shard whose reconcile and actions
    /// run one after another does.
    order: tokio::sync::Mutex<()>,
}

/// The id a retired machine's capacity came back under, as its `last_error` names it.
pub(crate) fn successor(m: &pb::Machine) -> Option<String> {
    (wire::state_of(m) == pb::MachineState::Failed)
        .then(|| m.last_error.rsplit_once("comes back as machine "))
        .flatten()
        .map(|(_, id)| id.to_owned())
}

/// A wire state as the models keep it.
pub(crate) fn model_state(m: &pb::Machine) -> State {
    State::from_wire(m.state)
}

fn host_of(m: &pb::Machine) -> Option<String> {
    m.host
        .as_ref()
        .map(|h| h.r#ref.clone())
        .filter(|h| !h.is_empty())
}

impl Checker {
    pub(crate) fn new(emulated: Emulated, tally: Tally, ids: Vec<String>) -> Checker {
        Checker {
            emulated,
            tally,
            ids: Mutex::new(ids),
            inner: Mutex::default(),
            shards: Mutex::new(Shards::new()),
            order: tokio::sync::Mutex::new(()),
        }
    }

    /// Taken before a call whose answer the models read, dropped after they read it.
    pub(crate) async fn in_order(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.order.lock().await
    }

    fn shards(&self) -> std::sync::MutexGuard<'_, Shards> {
        self.shards.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A worker takes over `id`, the new id of retired machine `old`'s capacity (which may
    /// leave the inventory after its retention).
    pub(crate) fn track(&self, old: &str, id: &str) {
        let mut ids = self.ids.lock().unwrap_or_else(|e| e.into_inner());
        ids.retain(|known| known != old);
        if !ids.iter().any(|known| known == id) {
            ids.push(id.to_owned());
        }
        self.tally.add("check.retired_with_a_new_id");
    }

    /// A mutation of `id` got no answer from a handler (the provider down or restarting):
    /// whether it took effect is unknown, so both models forget the machine and take its next
    /// report as new. (BigFleet marks such a machine Failed on its side, which no answer of a
    /// provider can change; the soak judges the provider's answers.)
    pub(crate) fn unanswered(&self, id: &str) {
        self.shards().forget(id);
    }

    /// Both shard models take a mutation's answer.
    pub(crate) fn answered(
        &self,
        create: bool,
        id: &str,
        answer: Result<&pb::TransitionAck, &tonic::Status>,
    ) {
        let mut shards = self.shards();
        match answer {
            Ok(ack) => {
                if let Some(m) = &ack.machine {
                    shards.apply(id, model_state(m), "ack");
                }
            }
            Err(_) if create => shards.create_refused(id),
            Err(_) => {}
        }
    }

    /// Both shard models read a Get.
    pub(crate) fn got(&self, m: &pb::Machine) {
        self.shards().apply(&m.id, model_state(m), "Get");
    }

    /// Both shard models reconcile over `caller`: the full one a full List, the incremental
    /// one a List since its cursor. Returns the full List's machines.
    pub(crate) async fn reconcile_shards(
        &self,
        caller: &mut wire::Caller,
    ) -> Option<Vec<pb::Machine>> {
        let _order = self.in_order().await;
        let full = caller.list(pb::ListFilter::default()).await.ok()?;
        let since = self.shards().incremental.since();
        let delta = caller
            .list(pb::ListFilter {
                since_revision: since,
                ..pb::ListFilter::default()
            })
            .await
            .ok()?;
        let pairs = |list: &pb::MachineList| -> Vec<(String, State)> {
            list.machines
                .iter()
                .map(|m| (m.id.clone(), model_state(m)))
                .collect()
        };
        let mut shards = self.shards();
        shards.full.read_list(&pairs(&full), full.revision.clone());
        shards
            .incremental
            .read_list(&pairs(&delta), delta.revision.clone());
        drop(shards);
        let mut machines = full.machines;
        machines.sort_by(|a, b| a.id.cmp(&b.id));
        Some(machines)
    }

    /// The models' verdict against what the provider reports now (`reported`: a Get of each
    /// id they hold, `None` where it has no such machine).
    pub(crate) fn shard_verdict(&self, reported: &HashMap<String, State>) -> Result<()> {
        if let Err(e) = self.shards().verdict_with(|id| reported.get(id).copied()) {
            bail!("BigFleet's shard could not follow the provider: {e}");
        }
        Ok(())
    }

    /// Every id either shard model holds.
    pub(crate) fn held_by_shards(&self) -> Vec<String> {
        self.shards().held()
    }

    /// Reports either shard model refused so far, for the figures.
    fn refused_edges(&self) -> usize {
        self.shards().refused()
    }

    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a broken property (the first one wins) and stops the run.
    pub(crate) fn violate(&self, what: String) {
        let mut inner = self.inner();
        if inner.violation.is_none() {
            eprintln!("soak: VIOLATION: {what}");
            inner.violation = Some(what);
        }
    }

    pub(crate) fn failed(&self) -> bool {
        self.inner().violation.is_some()
    }

    pub(crate) fn violation(&self) -> Option<String> {
        self.inner().violation.clone()
    }

    /// Remembers what a worker did to `id` (the last few events go into a violation report).
    pub(crate) fn note(&self, id: &str, event: String) {
        let mut inner = self.inner();
        let h = inner.history.entry(id.to_owned()).or_default();
        h.push_back(format!("{:?} {event}", std::time::SystemTime::now()));
        if h.len() > 16 {
            h.pop_front();
        }
    }

    /// The provider reports its reconcile survey period: the soak's bounds on noticing
    /// changes grow with the longest seen, up to [`LONGEST_SURVEY_PERIOD`].
    pub(crate) fn survey_period_reported(&self, period: Duration) {
        let mut inner = self.inner();
        inner.survey_period = inner.survey_period.max(period.min(LONGEST_SURVEY_PERIOD));
    }

    /// The longest reconcile survey period the provider reported so far.
    pub(crate) fn survey_period(&self) -> Duration {
        self.inner().survey_period
    }

    /// The provider was just restarted: the clocks of untracked hosts and transitional
    /// machines start over (a start under a fault storm takes a while; nothing ran meanwhile).
    pub(crate) fn restarted(&self) {
        let mut inner = self.inner();
        inner.untracked_since.clear();
        inner.transitional_since.clear();
    }

    /// A worker is about to act on `id`: its expectation is suspended.
    pub(crate) fn begin(&self, id: &str) {
        let mut inner = self.inner();
        inner.busy.insert(id.to_owned());
        inner.expect.remove(id);
    }

    /// A worker is done with `id`; `settled` is where it saw the machine settle after an
    /// acknowledged mutation (or `None` when it knows nothing certain).
    pub(crate) fn end(&self, id: &str, settled: Option<&pb::Machine>) {
        let mut inner = self.inner();
        inner.busy.remove(id);
        let expect = settled.and_then(|m| match wire::state_of(m) {
            pb::MachineState::Speculative => Some(Expect::Speculative),
            pb::MachineState::Idle => host_of(m).map(|host| Expect::Idle { host }),
            pb::MachineState::Failed => Some(Expect::Failed),
            _ => None,
        });
        match expect {
            Some(e) => inner.expect.insert(id.to_owned(), (e, Instant::now())),
            None => inner.expect.remove(id),
        };
    }

    /// Compares one listing, asked for at `now`, with the expectations set before it and with
    /// the emulator; `Err` on a violation.
    fn compare(&self, machines: &[pb::Machine], now: Instant) -> Result<()> {
        let live = self.emulated.live_hosts();
        let live_ids: HashSet<&str> = live.iter().map(|(id, _)| id.as_str()).collect();
        // At most one live host per machine (host names derive from machine ids).
        let mut by_name: HashMap<&str, Vec<&str>> = HashMap::new();
        for (id, name) in &live {
            by_name.entry(name.as_str()).or_default().push(id.as_str());
        }
        if let Some((name, ids)) = by_name.iter().find(|(_, ids)| ids.len() > 1) {
            bail!("two live hosts for one machine: {name} has hosts {ids:?}");
        }
        let mut inner = self.inner();
        inner
            .seen_hosts
            .extend(live.iter().map(|(id, _)| id.clone()));
        let mut tracked: HashMap<String, &str> = HashMap::new();
        for m in machines {
            let state = wire::state_of(m);
            if let Some(host) = host_of(m)
                && let Some(other) = tracked.insert(host.clone(), &m.id)
            {
                bail!(
                    "host {host} is recorded on two machines: {other} and {}",
                    m.id
                );
            }
            // A stockout or the account's limit never costs a machine: the refused id ends
            // FAILED with its capacity under a new id (one holding the host its Create
            // recorded fails for that host, as any Create that made something).
            if state == pb::MachineState::Failed
                && host_of(m).is_none()
                && by_capacity(&m.last_error)
                && successor(m).is_none()
            {
                bail!(
                    "{} is FAILED by a stockout or the account's limit without a new id for its capacity (last_error {:?})",
                    m.id,
                    m.last_error
                );
            }
            // Nothing stuck transitional.
            if super::is_transitional(state) {
                let since = inner
                    .transitional_since
                    .entry(m.id.clone())
                    .or_insert((m.state, now));
                if since.0 != m.state {
                    *since = (m.state, now);
                } else if now.saturating_duration_since(since.1) > STUCK_AFTER {
                    bail!("{} stuck {state:?} for more than {STUCK_AFTER:?}", m.id);
                }
            } else {
                inner.transitional_since.remove(&m.id);
            }
            // Acknowledged mutations stay reflected unless an injected fault explains it.
            if inner.busy.contains(&m.id) {
                continue;
            }
            let Some((expect, set_at)) = inner.expect.get(&m.id).cloned() else {
                continue;
            };
            if set_at > now {
                continue;
            }
            match (&expect, state) {
                (Expect::Speculative, pb::MachineState::Speculative)
                | (Expect::Failed, pb::MachineState::Failed) => {}
                (Expect::Idle { host }, pb::MachineState::Idle)
                    if host_of(m).as_ref() == Some(host) => {}
                (Expect::Idle { host }, pb::MachineState::Idle)
                    if !live_ids.contains(host.as_str()) =>
                {
                    // Its host was deleted out of band (a fault): the machine stays Idle, as
                    // BigFleet's shard has no edge to say so, until a worker acts on it.
                    self.tally.add("check.idle_after_out_of_band_delete");
                }
                _ => bail!(
                    "{} settled as {expect:?} after an acknowledged mutation, now {state:?} on host {:?} (last_error {:?}) with no mutation or fault to explain it; its history:\n{}",
                    m.id,
                    host_of(m),
                    m.last_error,
                    inner
                        .history
                        .get(&m.id)
                        .map(|h| h.iter().cloned().collect::<Vec<_>>().join("\n"))
                        .unwrap_or_default()
                ),
            }
        }
        // No owned host untracked for long.
        let bound = untracked_bound(inner.survey_period);
        inner
            .untracked_since
            .retain(|h, _| live_ids.contains(h.as_str()) && !tracked.contains_key(h));
        for (id, name) in &live {
            if tracked.contains_key(id) {
                continue;
            }
            let since = *inner.untracked_since.entry(id.clone()).or_insert(now);
            if now.saturating_duration_since(since) > bound {
                bail!("host {id} ({name}) attached to no machine for more than {bound:?}");
            }
        }
        Ok(())
    }

    /// The run's figures at its end, from the final listing: hosts seen live during the run,
    /// live hosts attached to no machine (leaked), FAILED machines with and without a host.
    pub(crate) fn figures(&self, machines: &[pb::Machine]) -> String {
        let live = self.emulated.live_hosts();
        let tracked: HashSet<String> = machines.iter().filter_map(host_of).collect();
        let leaked = live.iter().filter(|(id, _)| !tracked.contains(id)).count();
        let failed = |with_host: bool| {
            machines
                .iter()
                .filter(|m| {
                    wire::state_of(m) == pb::MachineState::Failed
                        && host_of(m).is_some() == with_host
                })
                .count()
        };
        let retired = machines.iter().filter(|m| successor(m).is_some()).count();
        format!(
            "hosts_seen={} leaked={leaked} failed_with_host={} failed_without_host={} \
             retired_with_a_new_id={retired} shard_refused_edges={}",
            self.inner().seen_hosts.len(),
            failed(true),
            failed(false) - retired,
            self.refused_edges()
        )
    }

    /// The continuous check: every half second until `end`.
    pub(crate) async fn watch(
        &self,
        mut channel: watch::Receiver<Option<Channel>>,
        end: Instant,
    ) -> Result<()> {
        while Instant::now() < end && !self.failed() {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let Some(ch) = channel.borrow_and_update().clone() else {
                continue;
            };
            let mut caller = wire::Caller::new(ch, wire::Shard::new("soak-checker", 1));
            let asked = Instant::now();
            let Some(machines) = self.reconcile_shards(&mut caller).await else {
                continue;
            };
            self.tally.add("check.passes");
            if let Err(e) = self.compare(&machines, asked) {
                self.violate(format!("{e:#}"));
            }
        }
        Ok(())
    }

    /// The end state, once every machine settled: every live owned host attached to exactly
    /// one machine (so no machine is FAILED without the host that exists for it), every Idle
    /// machine's host alive, the continuous properties too.
    /// The soak's machines a listing left out (hidden: a withdrawn offering's, or above the
    /// account's headroom).
    pub(crate) fn unlisted(&self, machines: &[pb::Machine]) -> Vec<String> {
        let known: HashSet<&str> = machines.iter().map(|m| m.id.as_str()).collect();
        self.ids
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|id| !known.contains(id.as_str()))
            .cloned()
            .collect()
    }

    pub(crate) fn final_check(&self, machines: &[pb::Machine], asked: Instant) -> Result<()> {
        self.compare(machines, asked)?;
        let live = self.emulated.live_hosts();
        let tracked: HashMap<String, &str> = machines
            .iter()
            .filter_map(|m| host_of(m).map(|h| (h, m.id.as_str())))
            .collect();
        for (id, name) in &live {
            if !tracked.contains_key(id) {
                let hostless_failed: Vec<&str> = machines
                    .iter()
                    .filter(|m| {
                        wire::state_of(m) == pb::MachineState::Failed && host_of(m).is_none()
                    })
                    .map(|m| m.id.as_str())
                    .collect();
                bail!(
                    "live host {id} ({name}) is attached to no machine (a leak); FAILED machines \
                     without a host: {hostless_failed:?}"
                );
            }
        }
        for m in machines {
            if matches!(
                wire::state_of(m),
                pb::MachineState::Idle | pb::MachineState::Configured
            ) && let Some(host) = host_of(m)
                && !self.emulated.is_live(&host)
                && !self.inner().seen_hosts.contains(&host)
            {
                // A host deleted out of band leaves its machine as it was (BigFleet's shard has
                // no edge to say so); one that never lived is a record of nothing.
                bail!(
                    "{} is {:?} on host {host}, which never existed",
                    m.id,
                    wire::state_of(m)
                );
            }
        }
        let known: HashSet<&str> = machines.iter().map(|m| m.id.as_str()).collect();
        let ids = self.ids.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(missing) = ids.iter().find(|id| !known.contains(id.as_str())) {
            bail!("machine {missing} is missing from the inventory");
        }
        Ok(())
    }
}

/// Whether a `last_error` names a stockout or the account's limit (the provider's own words,
/// or the clouds' answers).
fn by_capacity(last_error: &str) -> bool {
    let e = last_error.to_ascii_lowercase();
    e.starts_with("stockout:")
        || e.starts_with("account limit:")
        || [
            "resource_unavailable",
            "resource_limit_exceeded",
            "placement_error",
            "droplet limit",
            "not available in this region",
        ]
        .iter()
        .any(|w| e.contains(w))
}

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
    ids: Vec<String>,
    inner: Mutex<Inner>,
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
            ids,
            inner: Mutex::default(),
        }
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
            // A stockout or the account's limit returns the slot: it never fails a machine
            // (one holding the host its Create recorded fails for that host, as any Create
            // that made something).
            if state == pb::MachineState::Failed
                && host_of(m).is_none()
                && by_capacity(&m.last_error)
            {
                bail!(
                    "{} is FAILED by a stockout or the account's limit (last_error {:?})",
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
                (Expect::Idle { host }, pb::MachineState::Speculative)
                    if !live_ids.contains(host.as_str()) =>
                {
                    // Its host was deleted out of band (a fault): reconcile noticed.
                    self.tally.add("check.vanished_after_out_of_band_delete");
                    inner
                        .expect
                        .insert(m.id.clone(), (Expect::Speculative, now));
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
        let returned = machines
            .iter()
            .filter(|m| {
                wire::state_of(m) == pb::MachineState::Speculative && by_capacity(&m.last_error)
            })
            .count();
        format!(
            "hosts_seen={} leaked={leaked} failed_with_host={} failed_without_host={} \
             returned_by_capacity={returned}",
            self.inner().seen_hosts.len(),
            failed(true),
            failed(false)
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
            let Ok(machines) = caller.list_all().await else {
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
            {
                bail!(
                    "{} is {:?} on host {host}, which does not exist",
                    m.id,
                    wire::state_of(m)
                );
            }
        }
        let known: HashSet<&str> = machines.iter().map(|m| m.id.as_str()).collect();
        if let Some(missing) = self.ids.iter().find(|id| !known.contains(id.as_str())) {
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

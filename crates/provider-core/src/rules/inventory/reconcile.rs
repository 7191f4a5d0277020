//! Reconcile rules: merging a fresh view of the substrate into the state (contract.md §9,
//! improved by beyond.md §4–§5) without ever undoing the provider's own newer work.
//!
//! A pass reads the cloud over seconds while transitions keep completing, so three rules make it
//! safe under churn:
//!
//! - **No stale edits.** The pass knows the revision at which it began reading; a slot changed
//!   after that is not touched by this pass at all, and a host the provider itself deleted is
//!   never adopted.
//! - **Vanished needs proof.** A recorded host missing from the listing is only a suspect: a
//!   direct read answering not-found (or, for a backend without direct reads, absence in two
//!   consecutive passes) confirms it before any machine changes because of it.
//! - **Every owned host is accounted for.** A host is attached to its slot (adopted by a
//!   Speculative one, recorded on a FAILED one so an operator can release it), left to the
//!   Create that is finding it, or is an orphan: deleted once it stayed one for the grace period.
//!   The host of a FAILED machine that holds no cluster binding (its Create or its Delete
//!   failed: no node ever ran there, or it was on its way out) is treated as an orphan too,
//!   so no release that never comes leaves it running.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::Inventory;
use crate::rules::error::CoreError;
use crate::rules::machine::{HostRef, Machine, MachineState};
use crate::rules::records::{Change, RetireReason};

/// How many hosts deleted by the provider are remembered (never adopted again).
const DELETED_MEMORY: usize = 4096;

/// One owned host as the substrate lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sighting {
    /// The machine id the host's ownership labels or tags name.
    pub machine_id: String,
    pub host: HostRef,
}

/// What a backend reports for a reconcile pass: the records (as Describe returns them) and,
/// when it can list them, every owned host, duplicates included.
#[derive(Clone, Debug, Default)]
pub struct Survey {
    pub machines: Vec<Machine>,
    /// `None`: the hosts are those the records carry.
    pub hosts: Option<Vec<Sighting>>,
}

/// What a reconcile pass changed or found.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReconcileReport {
    pub added: usize,
    pub refreshed: usize,
    pub removed: usize,
    pub adopted: usize,
    /// Hosts recorded on a FAILED slot that had none (a Create that failed after the host
    /// existed): visible to `failed_machines_with_host` and deleted by `admin failed release`.
    pub attached: usize,
    pub vanished: usize,
    /// Slots left alone because they changed after the pass began reading the cloud.
    pub stale: usize,
    /// Recorded hosts missing from the listing, awaiting proof.
    pub suspects: usize,
    /// Owned hosts attached to no slot (counted each pass until deleted).
    pub orphans: usize,
    /// Orphans deleted after their grace period.
    pub orphans_deleted: usize,
    /// Hosts of FAILED machines without a cluster binding (a failed Create or Delete) that no
    /// release came for within the grace period: counted among `orphans` while they wait,
    /// deleted like them.
    pub failed_hosts_deleted: usize,
}

impl ReconcileReport {
    /// Whether the pass changed the state.
    pub fn changed(&self) -> bool {
        self.added + self.refreshed + self.removed + self.adopted + self.attached + self.vanished
            > 0
    }
}

/// A recorded host missing from a listing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Suspect {
    pub machine_id: String,
    pub host: HostRef,
    /// Whether the previous pass found it missing too.
    pub absent_before: bool,
}

/// The result of the merge step of a pass: what it changed and what needs I/O next.
#[derive(Clone, Debug, Default)]
pub struct ReconcileOutcome {
    pub report: ReconcileReport,
    /// Hosts to confirm absent before their slots change ([`Inventory::confirm_vanished`]).
    pub suspects: Vec<Suspect>,
    /// Orphans past their grace period, to delete ([`Inventory::still_orphan`] first).
    pub orphans_due: Vec<Sighting>,
}

/// What reconcile remembers between passes. Never persisted: after a restart the grace
/// periods and proofs start over, which only delays, never hastens, a change.
#[derive(Debug, Default)]
pub(crate) struct Upkeep {
    deleted: HashSet<String>,
    deleted_order: VecDeque<String>,
    /// machine id -> the host found missing in the previous pass.
    absent: HashMap<String, String>,
    /// host id -> when it was first seen as an orphan.
    orphans: HashMap<String, Instant>,
}

impl Upkeep {
    /// Records a host the provider deleted: it is never adopted again.
    pub(crate) fn remember_deleted(&mut self, host_id: &str) {
        if host_id.is_empty() || !self.deleted.insert(host_id.to_owned()) {
            return;
        }
        self.deleted_order.push_back(host_id.to_owned());
        while self.deleted_order.len() > DELETED_MEMORY {
            if let Some(old) = self.deleted_order.pop_front() {
                self.deleted.remove(&old);
            }
        }
    }

    fn was_deleted(&self, host: &HostRef) -> bool {
        self.deleted.contains(&host.id)
    }
}

impl Inventory {
    /// Whether the provider itself deleted `host_id` (recently enough to remember it).
    pub fn deleted_by_us(&self, host_id: &str) -> bool {
        self.upkeep.deleted.contains(host_id)
    }

    /// The merge step of a reconcile pass over `survey`, read from the substrate after the
    /// state was at revision `since`:
    ///
    /// - unknown ids are added;
    /// - known ids unchanged since `since` get their mutable substrate facts refreshed;
    /// - a Speculative slot whose host exists is adopted (Idle with that host), unless the
    ///   provider deleted that host;
    /// - a FAILED slot without a host gets the host the substrate shows for it recorded;
    /// - Idle and Configured slots whose host is missing become suspects (see
    ///   [`Inventory::confirm_vanished`]); nothing changes for them yet;
    /// - owned hosts attached to no slot are orphans; those that stayed orphans for `grace`
    ///   (as of `now`) are due for deletion;
    /// - with `offered` set (offerings are a hard quota), Speculative slots without a host that
    ///   are no longer offered are removed.
    ///
    /// Slots changed after `since` are left alone. The revision moves only on real changes.
    pub fn reconcile(
        &mut self,
        survey: Survey,
        offered: Option<&HashSet<String>>,
        since: i64,
        now: Instant,
        grace: Duration,
        changes: &mut Vec<Change>,
    ) -> ReconcileOutcome {
        let mut report = ReconcileReport::default();
        let sightings: Vec<Sighting> = match survey.hosts {
            Some(hosts) => hosts,
            None => survey
                .machines
                .iter()
                .filter_map(|m| {
                    m.host.clone().map(|host| Sighting {
                        machine_id: m.id.clone(),
                        host,
                    })
                })
                .collect(),
        };
        let listed: HashSet<&str> = sightings.iter().map(|s| s.host.id.as_str()).collect();
        for fresh in survey.machines {
            let Some(slot) = self.slots.get(&fresh.id) else {
                if fresh
                    .host
                    .as_ref()
                    .is_some_and(|h| self.upkeep.was_deleted(h))
                {
                    continue;
                }
                self.insert_new(fresh, Some(&mut *changes));
                report.added += 1;
                continue;
            };
            if slot.last_change > since {
                report.stale += 1;
                continue;
            }
            let current = &slot.machine;
            let mut next = (**current).clone();
            let refreshed = next.price_per_hour.to_bits() != fresh.price_per_hour.to_bits()
                || next.interruption_probability.to_bits()
                    != fresh.interruption_probability.to_bits()
                || next.resources != fresh.resources
                || next.allocatable != fresh.allocatable
                || next.labels != fresh.labels;
            if refreshed {
                next.price_per_hour = fresh.price_per_hour;
                next.interruption_probability = fresh.interruption_probability;
                next.resources = fresh.resources.clone();
                next.allocatable = fresh.allocatable.clone();
                next.labels = fresh.labels.clone();
            }
            let fresh_host = fresh
                .host
                .as_ref()
                .filter(|h| !h.is_empty() && !self.upkeep.was_deleted(h));
            let mut adopted = false;
            let mut attached = false;
            match (current.state, &current.host, fresh_host) {
                (MachineState::Speculative, None, Some(host)) => {
                    next.state = MachineState::Idle;
                    next.host = Some(host.clone());
                    adopted = true;
                }
                (MachineState::Failed, None, Some(host)) => {
                    next.host = Some(host.clone());
                    attached = true;
                }
                _ => {}
            }
            if refreshed || adopted || attached {
                report.refreshed += usize::from(refreshed);
                report.adopted += usize::from(adopted);
                report.attached += usize::from(attached);
                let id = fresh.id.clone();
                if attached {
                    tracing::warn!(machine_id = id, host = ?next.host, "reconcile: recording the host found for a FAILED slot; release it with `admin failed release`");
                }
                self.slots.get_mut(&id).expect("present").machine = Arc::new(next);
                self.touch(&id, changes);
            }
        }
        // Recorded hosts the listing does not show: suspects, never changed on this evidence.
        let mut suspects = Vec::new();
        let mut absent = HashMap::new();
        for slot in self.slots.values() {
            let m = &slot.machine;
            let Some(host) = &m.host else { continue };
            if !matches!(m.state, MachineState::Idle | MachineState::Configured)
                || slot.last_change > since
                || listed.contains(host.id.as_str())
            {
                continue;
            }
            suspects.push(Suspect {
                machine_id: m.id.clone(),
                host: host.clone(),
                absent_before: self.upkeep.absent.get(&m.id) == Some(&host.id),
            });
            absent.insert(m.id.clone(), host.id.clone());
        }
        self.upkeep.absent = absent;
        report.suspects = suspects.len();
        // Owned hosts attached to no slot.
        let mut orphans = HashMap::new();
        let mut orphans_due = Vec::new();
        for sighting in sightings {
            match self.host_standing(&sighting, since) {
                Standing::Attached | Standing::Undecided => continue,
                Standing::Orphan | Standing::FailedUnbound => {}
            }
            let first = self
                .upkeep
                .orphans
                .get(&sighting.host.id)
                .copied()
                .unwrap_or(now);
            orphans.insert(sighting.host.id.clone(), first);
            report.orphans += 1;
            if now.saturating_duration_since(first) >= grace {
                orphans_due.push(sighting);
            }
        }
        self.upkeep.orphans = orphans;
        if let Some(offered) = offered {
            report.removed += self.enforce_quota(offered, changes);
        }
        if report.changed() {
            changes.push(self.counters());
        }
        ReconcileOutcome {
            report,
            suspects,
            orphans_due,
        }
    }

    /// How a listed host stands against the state.
    fn host_standing(&self, sighting: &Sighting, since: i64) -> Standing {
        let Some(slot) = self.slots.get(&sighting.machine_id) else {
            return Standing::Orphan;
        };
        let m = &slot.machine;
        if m.host.as_ref().is_some_and(|h| h.id == sighting.host.id) {
            if m.state == MachineState::Failed && m.cluster.is_empty() && slot.last_change <= since
            {
                return Standing::FailedUnbound;
            }
            return Standing::Attached;
        }
        if slot.last_change > since || m.state == MachineState::Creating {
            // Changed under the pass, or a Create that is finding (or making) this host.
            return Standing::Undecided;
        }
        Standing::Orphan
    }

    /// Whether `sighting` is still an orphan (or a FAILED machine's unbound host) now:
    /// re-checked before deleting it.
    pub fn still_orphan(&self, sighting: &Sighting) -> bool {
        matches!(
            self.host_standing(sighting, self.revision),
            Standing::Orphan | Standing::FailedUnbound
        )
    }

    /// Records a host the provider deleted outside a transition (admin release): it is never
    /// adopted again.
    pub fn remember_deleted_host(&mut self, host_id: &str) {
        self.upkeep.remember_deleted(host_id);
    }

    /// Forgets an orphan that was deleted, and never adopts it again. When it was a FAILED
    /// machine's host, the machine (still FAILED, its `last_error` kept) no longer holds it;
    /// returns whether it was.
    pub fn orphan_deleted(&mut self, sighting: &Sighting, changes: &mut Vec<Change>) -> bool {
        self.upkeep.orphans.remove(&sighting.host.id);
        self.upkeep.remember_deleted(&sighting.host.id);
        let Some(mut slot) = self.slots.get_mut(&sighting.machine_id) else {
            return false;
        };
        if slot.machine.state != MachineState::Failed
            || slot.machine.host.as_ref() != Some(&sighting.host)
        {
            return false;
        }
        crate::rules::machine::edit(&mut slot.machine).host = None;
        drop(slot);
        self.touch(&sighting.machine_id, changes);
        changes.push(self.counters());
        true
    }

    /// Applies the vanished hosts a pass proved absent. BigFleet's shard has no edge from Idle
    /// or Configured to a state that says the host is gone, so neither changes: the shard's
    /// next action ends the machine on an edge it has (a Configure or Drain fails, a Delete
    /// gives the slot back). Returns how many were proved gone (each is logged; none changes). A slot changed
    /// after `since`, or no longer on that host, is left alone. Returns how many changed.
    pub fn confirm_vanished(
        &mut self,
        confirmed: &[Suspect],
        since: i64,
        _changes: &mut Vec<Change>,
    ) -> usize {
        let mut proved = 0;
        for suspect in confirmed {
            let Some(slot) = self.slots.get(&suspect.machine_id) else {
                continue;
            };
            if slot.last_change > since
                || slot.machine.host.as_ref().map(|h| h.id.as_str()) != Some(&suspect.host.id)
            {
                continue;
            }
            let next = match slot.machine.state {
                MachineState::Idle => "a Configure fails, a Delete gives the slot back",
                MachineState::Configured => "its Drain fails, naming the host",
                _ => continue,
            };
            tracing::warn!(machine_id = suspect.machine_id, host = suspect.host.id, state = %slot.machine.state, next, "reconcile: the host of this machine was deleted outside the provider; BigFleet's shard has no edge that says so, so the machine keeps its state until the shard's next action on it");
            proved += 1;
        }
        proved
    }

    /// Removes Speculative slots without a host that are not offered any more. Returns how
    /// many were removed; bumps the revision once if any were.
    pub fn enforce_quota(&mut self, offered: &HashSet<String>, changes: &mut Vec<Change>) -> usize {
        let doomed: Vec<String> = self
            .slots
            .values()
            .filter(|s| {
                s.machine.state == MachineState::Speculative
                    && s.machine.host.is_none()
                    && !offered.contains(&s.machine.id)
            })
            .map(|s| s.machine.id.clone())
            .collect();
        for id in &doomed {
            self.slots.remove(id);
            changes.push(Change::RemoveSlot(id.clone()));
        }
        if !doomed.is_empty() {
            self.revision += 1;
            changes.push(self.counters());
        }
        doomed.len()
    }

    /// Adds offered slots the state does not know yet (startup with a persisted store).
    pub fn add_missing(&mut self, offered: Vec<Machine>, changes: &mut Vec<Change>) -> usize {
        let mut added = 0;
        for machine in offered {
            if !self.slots.contains_key(&machine.id) {
                self.insert_new(machine, Some(&mut *changes));
                added += 1;
            }
        }
        if added > 0 {
            changes.push(self.counters());
        }
        added
    }

    /// Records `host` on FAILED `machine_id` if the record holds no host (a release that could
    /// not delete a host it found keeps it visible). Returns whether it did.
    pub fn keep_failed_host(
        &mut self,
        machine_id: &str,
        host: &HostRef,
        changes: &mut Vec<Change>,
    ) -> bool {
        let Some(mut slot) = self.slots.get_mut(machine_id) else {
            return false;
        };
        if slot.machine.state != MachineState::Failed || slot.machine.host.is_some() {
            return false;
        }
        crate::rules::machine::edit(&mut slot.machine).host = Some(host.clone());
        drop(slot);
        self.touch(machine_id, changes);
        changes.push(self.counters());
        true
    }

    /// Gives a FAILED machine's capacity back after its host (if any) was deleted: the machine
    /// id stays FAILED (BigFleet's shard has no way out of Failed) as a retired record without
    /// a host, and a Speculative slot of its shape comes back under a new machine id (see
    /// [`Inventory::retire`]). Returns the new id.
    pub fn release(
        &mut self,
        machine_id: &str,
        now_unix: u64,
        changes: &mut Vec<Change>,
    ) -> Result<String, CoreError> {
        let slot = self
            .slots
            .get(machine_id)
            .ok_or_else(|| CoreError::UnknownMachine(machine_id.to_owned()))?;
        if slot.machine.state != MachineState::Failed {
            return Err(CoreError::Admin(format!(
                "machine {machine_id} is {}, not Failed; only FAILED slots can be released",
                slot.machine.state
            )));
        }
        if let Some(retired) = &slot.retired {
            return Err(CoreError::Admin(format!(
                "machine {machine_id} was released already: its capacity came back as machine {}",
                retired.successor
            )));
        }
        let message = format!(
            "released by `admin failed release` after: {}",
            slot.machine.last_error
        );
        let successor = self.retire(
            machine_id,
            RetireReason::Released,
            &message,
            now_unix,
            changes,
        );
        changes.push(self.counters());
        Ok(successor)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Standing {
    Attached,
    Undecided,
    Orphan,
    /// The host of a FAILED machine without a cluster binding.
    FailedUnbound,
}

#[cfg(test)]
mod tests;

//! The provider's state and every rule that changes it: admission of a mutation (fence, not
//! found, idempotent retry, position, accept), completion of a transition, seeding, reconcile,
//! restart recovery and admin release. Synchronous and free of I/O: each change is also
//! emitted as a [`Change`] for the store, so memory and disk cannot drift apart.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::rules::error::CoreError;
use crate::rules::fence::unknown_ids::{self, UnknownIdMarks};
use crate::rules::fence::{self, FenceDecision, FenceToken, HighWaterMark};
use crate::rules::lifecycle::OperationKind;
use crate::rules::machine::{HostRef, Machine, MachineState, StringMap};
use crate::rules::records::{
    Change, Enrollment, FenceRecord, RETIRED_RETENTION_SECONDS, RetireReason, Retired,
    SealedConfigure, Slot, Snapshot,
};

mod slot_table;

use slot_table::SlotTable;

/// Whether `enrollment` still speaks for `machine`'s host: the host it names is the recorded
/// one, or no host is recorded yet while the Create that will record it runs.
pub fn enrollment_holds(machine: &Machine, enrollment: &Enrollment) -> bool {
    match &machine.host {
        Some(host) => host.id == enrollment.host_id,
        None => machine.state == MachineState::Creating,
    }
}

/// What [`Inventory::record_enrollment`] decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EnrollVerdict {
    /// The first enrollment of the host: recorded.
    Enrolled,
    /// The same credential again (an agent whose answer was lost): nothing changed.
    AlreadyEnrolled,
    /// Another enrollment while an unconfirmed one holds: the record is marked as a conflict.
    Conflict,
    /// Another enrollment while a confirmed one holds (its agent was handed a Configure's
    /// blob): refused, and nothing changed.
    Replayed,
}

/// What [`Inventory::record_created_host`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostRecord {
    /// The host is now on the Creating record.
    Recorded,
    /// The record held that host already.
    Unchanged,
    /// The Create had already failed: the host is now on its FAILED record.
    OnFailed,
    /// The machine moved on (another Create, another state): nothing recorded.
    Refused(String),
}

/// Operation ids are `<prefix>-<n>`; the reference uses the prefix `op`.
pub const OPERATION_PREFIX: &str = "op";

/// What a List selects (contract.md §8).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Selection {
    /// Empty: every state.
    pub states: Vec<MachineState>,
    /// Only slots changed after this revision.
    pub since: Option<i64>,
    /// At most this many machines (`usize::MAX`: no cap).
    pub cap: usize,
}

/// What [`Inventory::select`] found.
#[derive(Debug)]
pub struct Selected {
    /// The matches, in the table's order from the start position, wrapping around.
    pub machines: Vec<Arc<Machine>>,
    /// How many slots a walk from the start position passes until the cap is reached (every
    /// slot when it is not); the next capped List continues after them.
    pub visited: usize,
}

/// The binding a Configure applies at acceptance.
#[derive(Clone, Debug, Default)]
pub struct Binding {
    pub cluster: String,
    pub shard_metadata: StringMap,
    /// The Configure's sealed blob, kept with the slot while it is Configuring (sealed for the
    /// operation id [`Inventory::next_operation_id`] names).
    pub sealed: Option<Arc<SealedConfigure>>,
}

/// What admission decided.
#[derive(Debug)]
pub enum Admission {
    /// New work was accepted under a fresh operation id; the snapshot shows the transitional
    /// state.
    Accepted {
        operation_id: String,
        machine: Arc<Machine>,
    },
    /// A retry of the recorded operation: no new work, the current snapshot.
    Retry {
        operation_id: String,
        machine: Arc<Machine>,
    },
}

/// What a finished transition did to the substrate.
#[derive(Clone, Debug, Default)]
pub struct Effect {
    /// Create: the new host.
    pub host: Option<HostRef>,
    /// Create: replaces the slot's resources when non-empty.
    pub resources: StringMap,
    /// Create: replaces the slot's allocatable when non-empty.
    pub allocatable: StringMap,
}

/// A transitional slot found at startup: resumed, or failed because it cannot be re-driven.
#[derive(Clone, Debug, PartialEq)]
pub struct Interrupted {
    pub machine_id: String,
    pub kind: OperationKind,
    pub operation_id: String,
}

/// The whole mutable state of a provider.
#[derive(Debug, Default)]
pub struct Inventory {
    slots: SlotTable,
    /// Marks of machines that exist (or existed): never evicted, bounded by the slots ever
    /// offered.
    fences: HashMap<String, HashMap<String, HighWaterMark>>,
    /// Marks of ids no slot has: a bounded table (docs/limits.md).
    unknown_marks: UnknownIdMarks,
    /// How many marks of unknown ids were evicted since start (a metric).
    unknown_marks_evicted: u64,
    revision: i64,
    next_op: u64,
    /// What reconcile remembers between passes; never persisted.
    upkeep: reconcile::Upkeep,
    /// Speculative slots without a host that stay in the state but are not listed: their
    /// offering is withdrawn, or they are above the account's headroom. A Create on one is
    /// still admitted (a shard that reconciles incrementally may still hold it), and its
    /// backend answers it without a request. Derived from what the backend offers; never
    /// persisted.
    hidden: HashSet<String>,
}

/// One configured offering, as the slots are fitted to it: the shape of its Speculative slots
/// (type, zone, price, resources, labels; the id names the offering's first slot and so the
/// prefix new ids get), how many machines it holds, and whether the cloud sells it now.
#[derive(Clone, Debug)]
pub struct OfferGroup {
    pub shape: Machine,
    pub count: usize,
    pub advertised: bool,
}

/// Machine ids of a state are `<prefix>/<n>`, `n` drawn from the operation counter, whose high
/// bits are the state's series (see [`Inventory::ensure_series`]): no id repeats within a state,
/// nor, but for a one in 2^24 chance that the check against the project's hosts also misses,
/// between two states.
const SERIES_SHIFT: u32 = 32;
const SERIES_BITS: u32 = 24;

/// The series of a machine id or operation id minted by this scheme (its trailing number's high
/// bits), if it has one.
pub fn id_series(id: &str) -> Option<u64> {
    let tail = id.rsplit(['/', '-']).next()?;
    let n: u64 = tail.parse().ok()?;
    Some(n >> SERIES_SHIFT).filter(|s| *s != 0)
}

/// What [`Inventory::fit_offered`] changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fitted {
    /// Slots removed: their offering is no longer configured.
    pub removed: usize,
    /// Slots added: offered, and unknown to the state.
    pub added: usize,
    /// Slots now hidden from List (withdrawn, or above the cap).
    pub hidden: usize,
    /// Hidden slots listed again.
    pub shown: usize,
    /// Spare slots whose shape (price, resources, labels) followed their offering's.
    pub refreshed: usize,
    /// Retired records that left the state after their retention.
    pub pruned: usize,
}

impl Fitted {
    pub fn changed(&self) -> bool {
        *self != Fitted::default()
    }
}

impl Inventory {
    /// Rebuilds the state from a snapshot.
    pub fn from_snapshot(snapshot: Snapshot) -> Inventory {
        let mut inventory = Inventory {
            revision: snapshot.revision,
            next_op: snapshot.next_op,
            ..Inventory::default()
        };
        inventory.slots.reserve(snapshot.slots.len());
        for slot in drain_releasing(snapshot.slots) {
            inventory.slots.insert(slot.machine.id.clone(), slot);
        }
        let (known, unknown): (Vec<FenceRecord>, Vec<FenceRecord>) = snapshot
            .fences
            .into_iter()
            .partition(|f| inventory.slots.contains_key(&f.machine_id));
        for f in known {
            inventory
                .fences
                .entry(f.shard_id)
                .or_default()
                .insert(f.machine_id, f.mark);
        }
        // Everything stored is loaded; [`Inventory::limit_unknown_id_marks`] then applies the
        // configured capacity and tells the store what it dropped.
        inventory.unknown_marks =
            UnknownIdMarks::with_capacity(unknown.len().max(unknown_ids::DEFAULT_CAPACITY));
        for f in unknown {
            inventory
                .unknown_marks
                .put(&f.shard_id, &f.machine_id, f.mark);
        }
        inventory
    }

    /// Bounds the table of marks for unknown ids to `capacity`, evicting the oldest marks
    /// beyond it (their removal is emitted for the store). Returns how many were evicted.
    pub fn limit_unknown_id_marks(&mut self, capacity: usize, changes: &mut Vec<Change>) -> usize {
        let loaded = std::mem::replace(
            &mut self.unknown_marks,
            UnknownIdMarks::with_capacity(capacity),
        );
        let mut evicted = 0;
        for (shard_id, machine_id, mark) in loaded.iter() {
            for gone in self.unknown_marks.put(shard_id, machine_id, mark) {
                changes.push(Change::RemoveFence {
                    shard_id: gone.shard_id,
                    machine_id: gone.machine_id,
                });
                evicted += 1;
            }
        }
        self.unknown_marks_evicted += evicted as u64;
        evicted
    }

    /// Marks of unknown ids held now, and evicted since start.
    pub fn unknown_id_marks(&self) -> (usize, u64) {
        (self.unknown_marks.len(), self.unknown_marks_evicted)
    }

    /// The whole state, for export and compaction.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            slots: {
                // Sorted by id: exports and compacted snapshots do not depend on the table's
                // internal order.
                let mut slots: Vec<Slot> = self.slots.values().cloned().collect();
                slots.sort_unstable_by(|a, b| a.machine.id.cmp(&b.machine.id));
                slots
            },
            fences: self
                .fences
                .iter()
                .flat_map(|(shard, marks)| {
                    marks.iter().map(move |(machine, mark)| FenceRecord {
                        shard_id: shard.clone(),
                        machine_id: machine.clone(),
                        mark: *mark,
                    })
                })
                .chain(
                    self.unknown_marks
                        .iter()
                        .map(|(shard, machine, mark)| FenceRecord {
                            shard_id: shard.to_owned(),
                            machine_id: machine.to_owned(),
                            mark,
                        }),
                )
                .collect(),
            revision: self.revision,
            next_op: self.next_op,
        }
    }

    pub fn revision(&self) -> i64 {
        self.revision
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn get(&self, id: &str) -> Option<&Slot> {
        self.slots.get(id)
    }

    /// Forgets the pre-change copies of slots whose changes the store confirmed up to
    /// revision `durable` (see [`Inventory::acknowledged_select`]).
    pub fn forget_acknowledged(&mut self, durable: i64) {
        self.slots.forget_acknowledged(durable);
    }

    /// Machine `id` as the store holds it after revision `durable` (a slot whose newer change
    /// the store never confirmed shows as it was before that change; one the store never held
    /// is `None`).
    pub fn acknowledged_get(&self, id: &str, durable: i64) -> Option<Arc<Machine>> {
        self.slots.acknowledged(id, durable).map(|(m, _)| m)
    }

    /// [`Inventory::select`] as of revision `durable`: every matching machine as the store
    /// holds it, uncapped rotation aside (the first `cap` matches).
    pub fn acknowledged_select(&self, selection: &Selection, durable: i64) -> Vec<Arc<Machine>> {
        let since = selection.since.unwrap_or(0);
        let everything = Selection {
            states: Vec::new(),
            since: selection.since,
            cap: usize::MAX,
        };
        self.select(&everything, 0)
            .machines
            .iter()
            .filter_map(|m| self.slots.acknowledged(&m.id, durable))
            .filter(|(m, revision)| {
                (selection.since.is_none() || *revision > since)
                    && (selection.states.is_empty() || selection.states.contains(&m.state))
            })
            .map(|(m, _)| m)
            .take(selection.cap)
            .collect()
    }

    pub fn slots(&self) -> impl Iterator<Item = &Slot> {
        self.slots.values()
    }

    /// Every slot once, starting at position `start` (modulo the number of slots) and
    /// wrapping around; the start costs O(1).
    pub fn slots_from(&self, start: usize) -> impl Iterator<Item = &Slot> {
        self.slots.rotated(start)
    }

    /// The slots matching `selection`, as a walk over [`Inventory::slots_from`]`(start)` that
    /// stops at the cap would find them, at the cost of what matches: a cursor reads the
    /// revision index (the slots changed after it), a state filter the state index, and only a
    /// List of everything walks the table.
    pub fn select(&self, selection: &Selection, start: usize) -> Selected {
        let n = self.slots.len();
        let cap = selection.cap;
        if n == 0 || cap == 0 {
            return Selected {
                machines: Vec::new(),
                visited: 0,
            };
        }
        let start = start % n;
        let mut wanted = [selection.states.is_empty(); MachineState::ALL.len()];
        for s in &selection.states {
            wanted[s.wire() as usize] = true;
        }
        // A slot's distance from the start along the walk.
        let offset = |position: usize| (position + n - start) % n;
        let positions: Vec<usize> = match selection.since {
            Some(since) => {
                let mut found: Vec<usize> = self
                    .slots
                    .changed_after(since)
                    .filter(|p| {
                        let slot = self.slots.at(*p);
                        wanted[slot.machine.state.wire() as usize] && self.listed(slot)
                    })
                    .collect();
                found.sort_unstable_by_key(|p| offset(*p));
                found.truncate(cap);
                found
            }
            None if !selection.states.is_empty() => {
                let mut found = Vec::new();
                for state in MachineState::ALL {
                    if wanted[state.wire() as usize] {
                        found.extend(
                            self.slots
                                .in_state_from(state, start)
                                .filter(|p| self.listed(self.slots.at(*p)))
                                .take(cap),
                        );
                    }
                }
                found.sort_unstable_by_key(|p| offset(*p));
                found.truncate(cap);
                found
            }
            None if self.hidden.is_empty() => {
                let machines: Vec<Arc<Machine>> = self
                    .slots
                    .rotated(start)
                    .take(cap)
                    .map(|slot| slot.machine.clone())
                    .collect();
                let visited = if machines.len() == cap { cap } else { n };
                return Selected { machines, visited };
            }
            None => {
                let mut machines = Vec::with_capacity(cap.min(n));
                let mut visited = n;
                for (walked, slot) in self.slots.rotated(start).enumerate() {
                    if !self.listed(slot) {
                        continue;
                    }
                    machines.push(slot.machine.clone());
                    if machines.len() == cap {
                        visited = walked + 1;
                        break;
                    }
                }
                return Selected { machines, visited };
            }
        };
        let visited = match positions.last() {
            Some(last) if positions.len() == cap => offset(*last) + 1,
            _ => n,
        };
        Selected {
            machines: positions
                .into_iter()
                .map(|p| self.slots.at(p).machine.clone())
                .collect(),
            visited,
        }
    }

    /// Whether List shows `slot`: every slot but the hidden Speculative ones without a host
    /// (see [`Inventory::fit_offered`]).
    fn listed(&self, slot: &Slot) -> bool {
        self.hidden.is_empty()
            || slot.machine.state != MachineState::Speculative
            || slot.machine.host.is_some()
            || !self.hidden.contains(&slot.machine.id)
    }

    /// Whether machine `id` is kept in the state but not listed (its offering is withdrawn, or
    /// it is above the account's headroom).
    pub fn is_hidden(&self, id: &str) -> bool {
        self.slots.get(id).is_some_and(|slot| !self.listed(slot))
    }

    /// How many slots are kept but not listed.
    pub fn hidden_count(&self) -> usize {
        self.hidden.iter().filter(|id| self.is_hidden(id)).count()
    }

    /// How many slots are in `state`, in O(1).
    pub fn count_in_state(&self, state: MachineState) -> usize {
        self.slots.count_in_state(state)
    }

    /// The slots in `state`, in O(matching slots).
    pub fn in_state(&self, state: MachineState) -> impl Iterator<Item = &Slot> {
        self.slots.in_state_from(state, 0).map(|p| self.slots.at(p))
    }

    pub fn fence_mark(&self, shard_id: &str, machine_id: &str) -> Option<HighWaterMark> {
        self.fences
            .get(shard_id)
            .and_then(|m| m.get(machine_id))
            .copied()
            .or_else(|| self.unknown_marks.get(shard_id, machine_id))
    }

    /// Makes the operation counter start no lower than `floor` (ids never repeat, also across
    /// restarts of an in-memory provider) and the revision head no lower than `revision_floor`.
    pub fn raise_counters(&mut self, op_floor: u64, revision_floor: i64) {
        self.next_op = self.next_op.max(op_floor).max(1);
        self.revision = self.revision.max(revision_floor);
    }

    /// Marks every slot as changed at a fresh head, so that a List cursor issued before this
    /// point yields a full list instead of a delta that could miss changes.
    pub fn invalidate_cursors(&mut self, changes: &mut Vec<Change>) {
        self.revision += 1;
        self.slots.mark_all_changed(self.revision);
        // The store is told about the new head only; the per-slot marks are re-derived on load.
        changes.push(self.counters());
    }

    fn counters(&self) -> Change {
        Change::Counters {
            revision: self.revision,
            next_op: self.next_op,
        }
    }

    fn touch(&mut self, id: &str, changes: &mut Vec<Change>) {
        self.revision += 1;
        let revision = self.revision;
        if let Some(mut slot) = self.slots.get_mut(id) {
            slot.last_change = revision;
            // A sealed blob lives exactly as long as its Configure: the change that takes the
            // slot out of Configuring is the one that forgets it.
            if slot.machine.state != MachineState::Configuring {
                slot.sealed = None;
            }
            // An enrollment speaks for one host: forgotten with it. While a Create runs the
            // host is not recorded yet, and the agent may already have enrolled.
            if slot
                .enrollment
                .as_ref()
                .is_some_and(|e| !enrollment_holds(&slot.machine, e))
            {
                slot.enrollment = None;
            }
            changes.push(Change::PutSlot(Slot::clone(&slot)));
        }
    }

    /// Records the enrollment of the agent on `machine_id`'s host, atomically with what the
    /// slot already holds: a first enrollment is recorded; the same credential again changes
    /// nothing, except that one presented `confirmed` confirms the held enrollment; any other
    /// enrollment (the one-time token presented twice) is a replay once the held one is
    /// confirmed, or its machine is Configured or Draining (an enrollment of a release before
    /// confirmation existed), and changes nothing; before that it marks the held one as a
    /// conflict, for good. Refused when the slot is gone, holds another host, or was created
    /// again since the token was issued. The slot's List revision does not move: nothing a
    /// shard sees changes.
    pub fn record_enrollment(
        &mut self,
        machine_id: &str,
        enrollment: Enrollment,
        changes: &mut Vec<Change>,
    ) -> Result<EnrollVerdict, String> {
        let Some(mut slot) = self.slots.get_mut(machine_id) else {
            return Err(format!("machine {machine_id} does not exist"));
        };
        if slot.operation(OperationKind::Create) != Some(enrollment.create_operation.as_str()) {
            return Err(format!(
                "machine {machine_id} was created again since this token was issued"
            ));
        }
        if !enrollment_holds(&slot.machine, &enrollment) {
            return Err(format!(
                "machine {machine_id} does not hold host {} (any more)",
                enrollment.host_id
            ));
        }
        let verdict = match slot.enrollment.as_deref() {
            Some(held) if enrollment_holds(&slot.machine, held) => {
                if !held.conflict && held.credential_digest == enrollment.credential_digest {
                    if !enrollment.confirmed || held.confirmed {
                        return Ok(EnrollVerdict::AlreadyEnrolled);
                    }
                    slot.enrollment = Some(Arc::new(Enrollment {
                        confirmed: true,
                        ..held.clone()
                    }));
                    changes.push(Change::PutSlot(Slot::clone(&slot)));
                    return Ok(EnrollVerdict::AlreadyEnrolled);
                }
                if held.conflict {
                    return Ok(EnrollVerdict::Conflict);
                }
                let configured = matches!(
                    slot.machine.state,
                    MachineState::Configured | MachineState::Draining
                );
                if held.confirmed || configured {
                    return Ok(EnrollVerdict::Replayed);
                }
                slot.enrollment = Some(Arc::new(Enrollment {
                    conflict: true,
                    ..held.clone()
                }));
                EnrollVerdict::Conflict
            }
            _ => {
                slot.enrollment = Some(Arc::new(enrollment));
                EnrollVerdict::Enrolled
            }
        };
        changes.push(Change::PutSlot(Slot::clone(&slot)));
        Ok(verdict)
    }

    /// Records `host`, which the substrate just named for the Create `operation_id` of
    /// `machine_id`, on the machine's record: on the Creating record (not shown on the wire
    /// until the Create ends), or on the FAILED record that Create left when the deadline
    /// passed before the substrate answered. The slot's List revision moves, as for any
    /// durable change.
    pub fn record_created_host(
        &mut self,
        machine_id: &str,
        operation_id: &str,
        host: HostRef,
        changes: &mut Vec<Change>,
    ) -> HostRecord {
        let Some(mut slot) = self.slots.get_mut(machine_id) else {
            return HostRecord::Refused(format!("machine {machine_id} does not exist"));
        };
        if slot.operation(OperationKind::Create) != Some(operation_id) {
            return HostRecord::Refused(format!(
                "machine {machine_id} was given another Create since {operation_id}"
            ));
        }
        let held = slot.machine.host.clone();
        let outcome = match (slot.machine.state, held) {
            (_, Some(held)) if held == host => return HostRecord::Unchanged,
            (MachineState::Creating, held) => {
                if let Some(held) = held {
                    tracing::warn!(
                        machine_id,
                        operation_id,
                        replaced = held.id,
                        host = host.id,
                        "the Create names another host than the one it recorded; the first becomes an orphan"
                    );
                }
                HostRecord::Recorded
            }
            (MachineState::Failed, None) => HostRecord::OnFailed,
            (MachineState::Failed, Some(held)) => {
                return HostRecord::Refused(format!(
                    "machine {machine_id} is FAILED and holds host {} already",
                    held.id
                ));
            }
            (state, _) => {
                return HostRecord::Refused(format!(
                    "machine {machine_id} is {state}, no longer Creating"
                ));
            }
        };
        crate::rules::machine::edit(&mut slot.machine).host = Some(host);
        drop(slot);
        self.touch(machine_id, changes);
        outcome
    }

    /// The operation id the next accepted transition gets (a Configure seals its blob for it
    /// before admission, under the same lock).
    pub fn next_operation_id(&self) -> String {
        format!("{OPERATION_PREFIX}-{}", self.next_op.max(1))
    }

    fn mint_operation(&mut self) -> String {
        let n = self.next_op.max(1);
        self.next_op = n + 1;
        format!("{OPERATION_PREFIX}-{n}")
    }

    /// Steps 1 to 5 of every mutating RPC (contract.md §3), in their fixed order.
    pub fn admit(
        &mut self,
        kind: OperationKind,
        machine_id: &str,
        token: &FenceToken,
        binding: Option<Binding>,
        changes: &mut Vec<Change>,
    ) -> Result<Admission, CoreError> {
        // 1. Fence, before anything else. A passing token advances the mark whatever follows.
        match fence::check(self.fence_mark(&token.shard_id, machine_id), token) {
            FenceDecision::Bypass => {}
            FenceDecision::Reject { mark } => {
                return Err(CoreError::Fenced {
                    token: token.clone(),
                    machine_id: machine_id.to_owned(),
                    mark,
                });
            }
            FenceDecision::Advance(mark) => {
                if self.slots.contains_key(machine_id) {
                    self.fences
                        .entry(token.shard_id.clone())
                        .or_default()
                        .insert(machine_id.to_owned(), mark);
                } else {
                    // An id no slot has: its mark goes to the bounded table, so random ids
                    // cannot grow the state without bound.
                    for gone in self.unknown_marks.put(&token.shard_id, machine_id, mark) {
                        self.unknown_marks_evicted += 1;
                        changes.push(Change::RemoveFence {
                            shard_id: gone.shard_id,
                            machine_id: gone.machine_id,
                        });
                    }
                }
                changes.push(Change::PutFence {
                    shard_id: token.shard_id.clone(),
                    machine_id: machine_id.to_owned(),
                    mark,
                });
            }
        }
        // 2. Not found.
        let Some(slot) = self.slots.get(machine_id) else {
            return Err(CoreError::UnknownMachine(machine_id.to_owned()));
        };
        let state = slot.machine.state;
        // 3. Idempotent retry of the recorded operation.
        if let Some(operation_id) = slot
            .operation(kind)
            .filter(|_| kind.is_retry_position(state))
        {
            return Ok(Admission::Retry {
                operation_id: operation_id.to_owned(),
                machine: slot.machine.clone(),
            });
        }
        // 4. Position.
        if !kind.can_start(state) {
            return Err(CoreError::InvalidTransition { kind, state });
        }
        // 5. Accept.
        let operation_id = self.mint_operation();
        {
            let mut slot = self.slots.get_mut(machine_id).expect("slot checked above");
            slot.operations[kind.index()] = Some(operation_id.clone());
            let machine = crate::rules::machine::edit(&mut slot.machine);
            machine.state = kind.transitional();
            if let Some(binding) = binding {
                machine.cluster = binding.cluster;
                machine.shard_metadata = binding.shard_metadata;
                slot.sealed = binding.sealed;
            }
        }
        self.touch(machine_id, changes);
        changes.push(self.counters());
        let machine = self.slots[machine_id].machine.clone();
        Ok(Admission::Accepted {
            operation_id,
            machine,
        })
    }

    /// Applies the outcome of a transition, unless it is stale: the machine must still exist,
    /// still be in the kind's transitional state and still carry this operation id. Returns
    /// whether it was applied.
    pub fn complete(
        &mut self,
        machine_id: &str,
        kind: OperationKind,
        operation_id: &str,
        outcome: Result<Effect, String>,
        changes: &mut Vec<Change>,
    ) -> bool {
        let Some(mut slot) = self.slots.get_mut(machine_id) else {
            return false;
        };
        if slot.machine.state != kind.transitional() || slot.operation(kind) != Some(operation_id) {
            return false;
        }
        let machine = crate::rules::machine::edit(&mut slot.machine);
        match outcome {
            Ok(effect) => {
                machine.state = kind.target();
                match kind {
                    OperationKind::Create => {
                        machine.host = effect.host;
                        if !effect.resources.is_empty() {
                            machine.resources = effect.resources;
                        }
                        if !effect.allocatable.is_empty() {
                            machine.allocatable = effect.allocatable;
                        }
                    }
                    OperationKind::Configure => {}
                    OperationKind::Drain => {
                        machine.cluster.clear();
                        machine.shard_metadata.clear();
                    }
                    OperationKind::Delete => {
                        if let Some(host) = machine.host.take() {
                            self.upkeep.remember_deleted(&host.id);
                        }
                    }
                }
            }
            Err(message) => {
                machine.state = MachineState::Failed;
                machine.last_error = message;
            }
        }
        drop(slot);
        self.touch(machine_id, changes);
        changes.push(self.counters());
        true
    }

    /// Ends the Create `operation_id` of `machine_id` without a host: the substrate refused it
    /// without making anything, for a reason that is not the machine's (a stockout, the
    /// account's limit). The machine id ends on an edge BigFleet's shard has, Creating ->
    /// FAILED, with `message` and the new id in its `last_error`, and its capacity comes back
    /// as a Speculative slot under a machine id never listed before (see
    /// [`Inventory::retire`]). One holding a host (the substrate did make something) goes
    /// FAILED without a successor, as any failed Create: the host is the operator's to release.
    /// Returns the successor's id when the outcome was applied (`Some("")` for a FAILED record
    /// that keeps its host), `None` when it was stale.
    pub fn return_created(
        &mut self,
        machine_id: &str,
        operation_id: &str,
        reason: RetireReason,
        message: String,
        now_unix: u64,
        changes: &mut Vec<Change>,
    ) -> Option<String> {
        let kind = OperationKind::Create;
        let slot = self.slots.get(machine_id)?;
        if slot.machine.state != kind.transitional() || slot.operation(kind) != Some(operation_id) {
            return None;
        }
        if let Some(host) = slot.machine.host.clone() {
            let mut slot = self.slots.get_mut(machine_id).expect("present");
            let machine = crate::rules::machine::edit(&mut slot.machine);
            machine.state = MachineState::Failed;
            machine.last_error = format!(
                "create: host {} is recorded for this Create, so the machine cannot give its \
                 capacity back (release it with `admin failed release`); the cloud then \
                 refused: {message}",
                host.id
            );
            drop(slot);
            self.touch(machine_id, changes);
            changes.push(self.counters());
            return Some(String::new());
        }
        let successor = self.retire(machine_id, reason, &message, now_unix, changes);
        changes.push(self.counters());
        Some(successor)
    }

    /// Ends machine `id` as a retired FAILED record without a host and gives its capacity back
    /// under a new machine id: a Speculative slot of the same shape (type, zone, price,
    /// resources, labels). The old record's `last_error` is `message` and the successor's id;
    /// it stays listed, as FAILED, for [`RETIRED_RETENTION_SECONDS`] so every shard can read
    /// how it ended, then leaves the state ([`Inventory::prune_retired`]). Returns the
    /// successor's id.
    pub(crate) fn retire(
        &mut self,
        id: &str,
        reason: RetireReason,
        message: &str,
        now_unix: u64,
        changes: &mut Vec<Change>,
    ) -> String {
        let shape = self.slots[id].machine.clone();
        let successor = self.mint_machine_id(id);
        let mut fresh = Machine::speculative(successor.clone(), &shape.instance_type);
        fresh.zone = shape.zone.clone();
        fresh.capacity_type = shape.capacity_type;
        fresh.price_per_hour = shape.price_per_hour;
        fresh.interruption_probability = shape.interruption_probability;
        fresh.resources = shape.resources.clone();
        fresh.allocatable = shape.allocatable.clone();
        fresh.labels = shape.labels.clone();
        {
            let mut slot = self.slots.get_mut(id).expect("present");
            let machine = crate::rules::machine::edit(&mut slot.machine);
            machine.state = MachineState::Failed;
            if let Some(host) = machine.host.take() {
                self.upkeep.remember_deleted(&host.id);
            }
            machine.cluster.clear();
            machine.shard_metadata.clear();
            machine.last_error =
                format!("{message}; its capacity comes back as machine {successor}");
            slot.retired = Some(Retired {
                reason,
                unix_seconds: now_unix,
                successor: successor.clone(),
            });
        }
        self.touch(id, changes);
        self.insert_new(fresh, Some(&mut *changes));
        successor
    }

    /// A machine id never used in this state, nor (see [`Inventory::ensure_series`]) by another
    /// state: `like`'s prefix (up to its last `/`, the offering's
    /// `<provider>/OnDemand/<type>/<zone>`) and the next number of the operation counter.
    pub fn mint_machine_id(&mut self, like: &str) -> String {
        let n = self.next_op.max(1);
        self.next_op = n + 1;
        match like.rsplit_once('/') {
            Some((prefix, _)) => format!("{prefix}/{n}"),
            None => format!("{like}-{n}"),
        }
    }

    /// The state's series: the high bits of its operation counter, drawn at random when the
    /// state was made, so operation ids, the names and tokens derived from them and new machine
    /// ids differ between two states even when their counters coincide.
    pub fn series(&self) -> u64 {
        self.next_op >> SERIES_SHIFT
    }

    /// Gives a state without a series (a new one, one an older version wrote, a reference
    /// import) one: drawn at random, never one of `taken` (the series the project's hosts
    /// carry in their machine ids), and kept with the state from then on. Counts already
    /// issued stay below the new counter, so nothing repeats. Returns whether it drew one.
    pub fn ensure_series(&mut self, taken: &HashSet<u64>, changes: &mut Vec<Change>) -> bool {
        if self.series() != 0 {
            return false;
        }
        let series = loop {
            let drawn = rand::random_range(1..(1u64 << SERIES_BITS));
            if !taken.contains(&drawn) {
                break drawn;
            }
        };
        self.next_op = (series << SERIES_SHIFT) | self.next_op.max(1);
        changes.push(self.counters());
        true
    }

    /// Removes slot `id` from the state; the fence marks it held move to the bounded table of
    /// unknown ids, so an old token stays refused without the id's marks growing the state for
    /// good.
    fn forget_slot(&mut self, id: &str, changes: &mut Vec<Change>) {
        if self.slots.remove(id).is_none() {
            return;
        }
        changes.push(Change::RemoveSlot(id.to_owned()));
        self.hidden.remove(id);
        let mut marks = Vec::new();
        for (shard, by_machine) in self.fences.iter_mut() {
            if let Some(mark) = by_machine.remove(id) {
                marks.push((shard.clone(), mark));
            }
        }
        for (shard, mark) in marks {
            for gone in self.unknown_marks.put(&shard, id, mark) {
                self.unknown_marks_evicted += 1;
                changes.push(Change::RemoveFence {
                    shard_id: gone.shard_id,
                    machine_id: gone.machine_id,
                });
            }
        }
    }

    /// Removes the retired records older than [`RETIRED_RETENTION_SECONDS`] as of `now_unix`.
    /// Returns how many left.
    pub fn prune_retired(&mut self, now_unix: u64, changes: &mut Vec<Change>) -> usize {
        let due: Vec<String> = self
            .in_state(MachineState::Failed)
            .filter(|s| {
                s.retired.as_ref().is_some_and(|r| {
                    now_unix.saturating_sub(r.unix_seconds) >= RETIRED_RETENTION_SECONDS
                })
            })
            .map(|s| s.machine.id.clone())
            .collect();
        for id in &due {
            self.forget_slot(id, changes);
        }
        if !due.is_empty() {
            self.revision += 1;
            changes.push(self.counters());
        }
        due.len()
    }

    /// The retired records held, by reason.
    pub fn retired_by_reason(&self) -> Vec<(RetireReason, usize)> {
        let mut counts: HashMap<RetireReason, usize> = HashMap::new();
        for slot in self.in_state(MachineState::Failed) {
            if let Some(r) = &slot.retired {
                *counts.entry(r.reason).or_default() += 1;
            }
        }
        RetireReason::ALL
            .into_iter()
            .map(|r| (r, counts.get(&r).copied().unwrap_or(0)))
            .collect()
    }

    /// Fits the slots to the configured offerings `offer`: each offering holds `count`
    /// machines, counting every slot of its type and zone but the retired records (hosts and
    /// FAILED records hold theirs); missing Speculative slots are added under new machine ids,
    /// spare ones (Speculative, no host) beyond the count removed, the newest first, as are
    /// the spare slots of offerings no longer configured. Spare slots take their offering's
    /// shape (price, resources, labels). Then the spare slots of offerings not sold now and
    /// those above `cap` (the newest first) are hidden: kept in the state, so a Create on one
    /// from a shard that still holds it is admitted and answered without a request, but left
    /// out of List. A hidden slot listed again is marked changed, so a List since an earlier
    /// revision shows it. Retired records older than their retention leave (`now_unix`).
    pub fn fit_offered(
        &mut self,
        offer: &[OfferGroup],
        cap: Option<usize>,
        now_unix: u64,
        changes: &mut Vec<Change>,
    ) -> Fitted {
        let pruned = self.prune_retired(now_unix, changes);
        let groups: HashMap<(&str, &str), usize> = offer
            .iter()
            .enumerate()
            .map(|(g, o)| ((o.shape.instance_type.as_str(), o.shape.zone.as_str()), g))
            .collect();
        let mut occupied = vec![0usize; offer.len()];
        let mut spare: Vec<Vec<String>> = vec![Vec::new(); offer.len()];
        let mut unconfigured = Vec::new();
        let mut stale_shape = Vec::new();
        for slot in self.slots.values() {
            if slot.retired.is_some() {
                continue;
            }
            let m = &slot.machine;
            let group = groups
                .get(&(m.instance_type.as_str(), m.zone.as_str()))
                .copied();
            let is_spare = m.state == MachineState::Speculative && m.host.is_none();
            match (group, is_spare) {
                (Some(g), true) => {
                    if !same_shape(m, &offer[g].shape) {
                        stale_shape.push((m.id.clone(), g));
                    }
                    spare[g].push(m.id.clone());
                }
                (Some(g), false) => occupied[g] += 1,
                (None, true) => unconfigured.push(m.id.clone()),
                (None, false) => {}
            }
        }
        let mut removed = 0;
        let mut added = 0;
        for (g, group) in offer.iter().enumerate() {
            let want = group.count.saturating_sub(occupied[g]);
            let ids = &mut spare[g];
            ids.sort_by(|a, b| slot_order(a).cmp(&slot_order(b)));
            if ids.len() > want {
                for id in ids.split_off(want) {
                    self.forget_slot(&id, changes);
                    removed += 1;
                }
            }
            while ids.len() < want {
                let id = self.mint_machine_id(&group.shape.id);
                let mut fresh = group.shape.clone();
                fresh.id = id.clone();
                self.insert_new(fresh, Some(&mut *changes));
                ids.push(id);
                added += 1;
            }
        }
        for id in unconfigured {
            self.forget_slot(&id, changes);
            removed += 1;
        }
        let mut refreshed = 0;
        for (id, g) in stale_shape {
            let Some(mut slot) = self.slots.get_mut(&id) else {
                continue;
            };
            let shape = &offer[g].shape;
            let m = crate::rules::machine::edit(&mut slot.machine);
            m.price_per_hour = shape.price_per_hour;
            m.interruption_probability = shape.interruption_probability;
            m.resources = shape.resources.clone();
            m.allocatable = shape.allocatable.clone();
            m.labels = shape.labels.clone();
            drop(slot);
            self.touch(&id, changes);
            refreshed += 1;
        }
        // Hidden: the spare slots of offerings not sold now, and those above the cap.
        let mut hide: HashSet<String> = HashSet::new();
        let mut candidates: Vec<&String> = Vec::new();
        // A slot a Delete gave back stays listed: a shard holds it Deleting until a List shows
        // it Speculative (an incremental one would never see it leave).
        let given_back = |id: &String| {
            self.slots
                .get(id)
                .is_some_and(|s| s.operation(OperationKind::Delete).is_some())
        };
        let mut kept = 0;
        for (g, group) in offer.iter().enumerate() {
            kept += spare[g].iter().filter(|id| given_back(id)).count();
            let hideable = spare[g].iter().filter(|id| !given_back(id));
            if group.advertised {
                candidates.extend(hideable);
            } else {
                hide.extend(hideable.cloned());
            }
        }
        // The slots a Delete gave back count against the cap first.
        let cap = cap.map(|cap| cap.saturating_sub(kept));
        if let Some(cap) = cap
            && candidates.len() > cap
        {
            candidates.sort_by(|a, b| slot_order(a).cmp(&slot_order(b)));
            hide.extend(candidates[cap..].iter().map(|id| (*id).clone()));
        }
        let shown: Vec<String> = self
            .hidden
            .iter()
            .filter(|id| !hide.contains(*id) && self.slots.contains_key(id.as_str()))
            .cloned()
            .collect();
        let hidden = hide.iter().filter(|id| !self.hidden.contains(*id)).count();
        self.hidden = hide;
        for id in &shown {
            self.touch(id, changes);
        }
        let fitted = Fitted {
            removed,
            added,
            hidden,
            shown: shown.len(),
            refreshed,
            pruned,
        };
        if removed + added + refreshed + shown.len() > 0 {
            if removed > 0 {
                self.revision += 1;
            }
            changes.push(self.counters());
        }
        fitted
    }

    /// The Speculative slots without a host, listed or not.
    pub fn spare_speculative(&self) -> impl Iterator<Item = &Slot> {
        self.in_state(MachineState::Speculative)
            .filter(|s| s.machine.host.is_none())
    }

    /// The Speculative slots without a host that List shows.
    pub fn listed_spare(&self) -> impl Iterator<Item = &Slot> {
        self.spare_speculative().filter(|s| self.listed(s))
    }

    /// Adds the records of a first seed. Duplicates are rejected before anything changes.
    pub fn seed(
        &mut self,
        machines: Vec<Machine>,
        changes: &mut Vec<Change>,
    ) -> Result<(), String> {
        changes.reserve(machines.len() + 1);
        self.seed_slots(machines, Some(&mut *changes))?;
        changes.push(self.counters());
        Ok(())
    }

    /// [`Inventory::seed`] for a store that keeps nothing (the in-memory store): the same
    /// slots and revisions, without the change record per slot that only a durable store reads
    /// (at 100,000 machines that batch is about 12 MiB at the peak of the start).
    pub fn seed_unrecorded(&mut self, machines: Vec<Machine>) -> Result<(), String> {
        self.seed_slots(machines, None)
    }

    fn seed_slots(
        &mut self,
        machines: Vec<Machine>,
        mut changes: Option<&mut Vec<Change>>,
    ) -> Result<(), String> {
        let mut seen = HashSet::new();
        for m in &machines {
            if !seen.insert(m.id.as_str()) || self.slots.contains_key(&m.id) {
                return Err(format!(
                    "backend Describe returned duplicate id {}",
                    fence::go_quote(&m.id)
                ));
            }
        }
        self.slots.reserve(machines.len());
        for machine in drain_releasing(machines) {
            self.insert_new(machine, changes.as_deref_mut());
        }
        Ok(())
    }

    /// Adds a slot at a fresh revision; its record goes to `changes` when given.
    fn insert_new(&mut self, machine: Machine, changes: Option<&mut Vec<Change>>) {
        let id = machine.id.clone();
        // Marks recorded while the id was unknown now guard a real machine: they move to the
        // table that is never evicted (the store already holds them under the same key).
        for (shard, mark) in self.unknown_marks.take_machine(&id) {
            self.fences
                .entry(shard)
                .or_default()
                .insert(id.clone(), mark);
        }
        self.revision += 1;
        let slot = Slot {
            machine: Arc::new(machine),
            last_change: self.revision,
            operations: Default::default(),
            sealed: None,
            enrollment: None,
            retired: None,
        };
        if let Some(changes) = changes {
            changes.push(Change::PutSlot(slot.clone()));
        }
        self.slots.insert(id, slot);
    }

    /// Turns transitional slots found at startup into work to resume or into FAILED. Every
    /// transition with a recorded operation id is resumed under it, except a Configure for which
    /// `configure_failure` gives a reason it cannot be (no sealed blob, or one no key opens): that
    /// one goes FAILED with the reason as its `last_error`.
    pub fn recover_interrupted(
        &mut self,
        configure_failure: impl Fn(&Slot) -> Option<String>,
        changes: &mut Vec<Change>,
    ) -> Vec<Interrupted> {
        let mut resumable = Vec::new();
        let mut failed = Vec::new();
        for slot in self.slots.values() {
            let Some(kind) = OperationKind::of_transitional(slot.machine.state) else {
                continue;
            };
            let Some(op) = slot.operation(kind) else {
                failed.push((
                    slot.machine.id.clone(),
                    format!("{kind} transition interrupted by a provider restart; needs re-drive"),
                ));
                continue;
            };
            if kind == OperationKind::Configure
                && let Some(reason) = configure_failure(slot)
            {
                failed.push((slot.machine.id.clone(), reason));
                continue;
            }
            resumable.push(Interrupted {
                machine_id: slot.machine.id.clone(),
                kind,
                operation_id: op.to_owned(),
            });
        }
        for (id, reason) in failed {
            let mut slot = self.slots.get_mut(&id).expect("collected above");
            let machine = crate::rules::machine::edit(&mut slot.machine);
            machine.state = MachineState::Failed;
            machine.last_error = reason;
            drop(slot);
            self.touch(&id, changes);
        }
        if !changes.is_empty() {
            changes.push(self.counters());
        }
        resumable
    }
}

/// The items of `items` in order, handing the vector's memory back as it empties (a 100,000
/// machine seed would otherwise hold its whole buffer until the last slot is built, next to the
/// slots built from it).
/// Whether spare slot `m` already has `shape`'s price, resources and labels.
fn same_shape(m: &Machine, shape: &Machine) -> bool {
    m.price_per_hour.to_bits() == shape.price_per_hour.to_bits()
        && m.interruption_probability.to_bits() == shape.interruption_probability.to_bits()
        && m.resources == shape.resources
        && m.allocatable == shape.allocatable
        && m.labels == shape.labels
}

/// Orders slot ids by their trailing slot number (`.../007`), then by id: the order in which
/// a cap keeps them.
pub fn slot_order(id: &str) -> (u64, &str) {
    let number = id
        .rsplit_once('/')
        .and_then(|(_, n)| n.parse().ok())
        .unwrap_or(u64::MAX);
    (number, id)
}

fn drain_releasing<T>(mut items: Vec<T>) -> impl Iterator<Item = T> {
    /// Items taken between two shrinks of the buffer.
    const STEP: usize = 8192;
    items.reverse();
    std::iter::from_fn(move || {
        let item = items.pop()?;
        if items.len().is_multiple_of(STEP) {
            items.shrink_to_fit();
        }
        Some(item)
    })
}

mod reconcile;

pub use reconcile::{ReconcileOutcome, ReconcileReport, Sighting, Survey, Suspect};

#[cfg(test)]
mod tests;

#[cfg(test)]
mod index_tests;

#[cfg(test)]
mod unknown_id_tests;

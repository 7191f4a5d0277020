//! The machine slots keyed by id, with O(1) positional access so that a capped List can start
//! at a random slot and wrap around (contract.md §8: a capped List is an arbitrary subset, and
//! callers that pick machines with `max_results = 1` must not all get the same one), and two
//! indexes kept in step with every change: slot positions by last-change revision and by state.
//! A delta List then costs what changed since its cursor and a state-filtered List what matches,
//! instead of a walk over every slot.

use std::collections::BTreeSet;
use std::ops::{Deref, DerefMut, Index};

use indexmap::IndexMap;

use crate::rules::machine::MachineState;
use crate::rules::records::Slot;

/// Number of wire values of [`MachineState`] (0 is Unspecified).
const STATES: usize = MachineState::ALL.len();

/// Slots by machine id. Lookups are O(1); iteration follows an unspecified but stable order
/// (insertion order, perturbed by removals), and [`SlotTable::rotated`] walks the same order
/// starting at any position. Every change goes through this type (insert, remove,
/// [`SlotTable::get_mut`], [`SlotTable::mark_all_changed`]), which keeps the indexes exact.
#[derive(Debug, Default)]
pub(crate) struct SlotTable {
    by_id: IndexMap<String, Slot>,
    index: Positions,
    /// Each slot changed since the store last confirmed its changes durable, as it was before
    /// that first change (its machine and revision): what the store holds for it. A replica
    /// whose store stopped answers reads from these ([`SlotTable::acknowledged`]); entries
    /// leave once their slot's change is durable ([`SlotTable::forget_acknowledged`]).
    acknowledged:
        std::collections::HashMap<String, (std::sync::Arc<crate::rules::machine::Machine>, i64)>,
}

/// Slot positions by (last-change revision, position) and by state.
#[derive(Debug, Default)]
struct Positions {
    by_revision: BTreeSet<(i64, u32)>,
    by_state: [BTreeSet<u32>; STATES],
}

impl Positions {
    fn add(&mut self, position: usize, state: MachineState, last_change: i64) {
        let position = position_u32(position);
        self.by_revision.insert((last_change, position));
        self.by_state[state.wire() as usize].insert(position);
    }

    fn forget(&mut self, position: usize, state: MachineState, last_change: i64) {
        let position = position_u32(position);
        self.by_revision.remove(&(last_change, position));
        self.by_state[state.wire() as usize].remove(&position);
    }
}

fn position_u32(position: usize) -> u32 {
    u32::try_from(position).expect("fewer than 2^32 slots")
}

/// A slot borrowed for change; the indexes follow its state and revision when it is dropped.
pub(crate) struct SlotMut<'a> {
    slot: &'a mut Slot,
    index: &'a mut Positions,
    position: usize,
    state: MachineState,
    last_change: i64,
}

impl Deref for SlotMut<'_> {
    type Target = Slot;

    fn deref(&self) -> &Slot {
        self.slot
    }
}

impl DerefMut for SlotMut<'_> {
    fn deref_mut(&mut self) -> &mut Slot {
        self.slot
    }
}

impl Drop for SlotMut<'_> {
    fn drop(&mut self) {
        let (state, last_change) = (self.slot.machine.state, self.slot.last_change);
        if state != self.state || last_change != self.last_change {
            self.index
                .forget(self.position, self.state, self.last_change);
            self.index.add(self.position, state, last_change);
        }
    }
}

impl SlotTable {
    pub(crate) fn insert(&mut self, id: String, slot: Slot) -> Option<Slot> {
        let (state, last_change) = (slot.machine.state, slot.last_change);
        let (position, old) = self.by_id.insert_full(id, slot);
        if let Some(old) = &old {
            self.index
                .forget(position, old.machine.state, old.last_change);
        }
        self.index.add(position, state, last_change);
        old
    }

    /// Room for `additional` more slots without growing.
    pub(crate) fn reserve(&mut self, additional: usize) {
        self.by_id.reserve(additional);
    }

    pub(crate) fn get(&self, id: &str) -> Option<&Slot> {
        self.by_id.get(id)
    }

    pub(crate) fn get_mut(&mut self, id: &str) -> Option<SlotMut<'_>> {
        let (position, _, slot) = self.by_id.get_full_mut(id)?;
        if !self.acknowledged.contains_key(id) {
            // Held here, the machine is copied by the change, not changed in place.
            self.acknowledged
                .insert(id.to_owned(), (slot.machine.clone(), slot.last_change));
        }
        Some(SlotMut {
            state: slot.machine.state,
            last_change: slot.last_change,
            slot,
            index: &mut self.index,
            position,
        })
    }

    pub(crate) fn contains_key(&self, id: &str) -> bool {
        self.by_id.contains_key(id)
    }

    /// Removes a slot in O(log n); the last slot takes its position.
    pub(crate) fn remove(&mut self, id: &str) -> Option<Slot> {
        let (position, _, slot) = self.by_id.swap_remove_full(id)?;
        self.index
            .forget(position, slot.machine.state, slot.last_change);
        if let Some(moved) = self.by_id.get_index(position).map(|(_, s)| s) {
            let last = self.by_id.len();
            self.index
                .forget(last, moved.machine.state, moved.last_change);
            self.index
                .add(position, moved.machine.state, moved.last_change);
        }
        Some(slot)
    }

    /// Sets every slot's last-change revision to `revision`.
    /// Forgets what was kept for slots whose last change is durable (`durable` is the
    /// revision the store confirmed) and for slots that are gone.
    pub(crate) fn forget_acknowledged(&mut self, durable: i64) {
        if self.acknowledged.is_empty() {
            return;
        }
        let by_id = &self.by_id;
        self.acknowledged
            .retain(|id, _| by_id.get(id).is_some_and(|s| s.last_change > durable));
    }

    /// The machine `id` as the store holds it, when the store confirmed revision `durable`:
    /// the slot itself when its last change is durable, what it was before its first change
    /// since otherwise, `None` for a slot the store does not hold yet. With its revision.
    pub(crate) fn acknowledged(
        &self,
        id: &str,
        durable: i64,
    ) -> Option<(std::sync::Arc<crate::rules::machine::Machine>, i64)> {
        let slot = self.by_id.get(id)?;
        if slot.last_change <= durable {
            return Some((slot.machine.clone(), slot.last_change));
        }
        self.acknowledged
            .get(id)
            .filter(|(_, revision)| *revision <= durable)
            .cloned()
    }

    pub(crate) fn mark_all_changed(&mut self, revision: i64) {
        for slot in self.by_id.values_mut() {
            slot.last_change = revision;
        }
        // Positions ascend, so the set is built from sorted input.
        self.index.by_revision = (0..self.by_id.len())
            .map(|p| (revision, position_u32(p)))
            .collect();
    }

    pub(crate) fn len(&self) -> usize {
        self.by_id.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &Slot> {
        self.by_id.values()
    }

    /// The slot at `position` (below [`SlotTable::len`]).
    pub(crate) fn at(&self, position: usize) -> &Slot {
        &self.by_id[position]
    }

    /// Every slot once, starting at position `start` (taken modulo the length) and wrapping
    /// around. Starting costs O(1), whatever `start` is.
    pub(crate) fn rotated(&self, start: usize) -> impl Iterator<Item = &Slot> {
        let all = self.by_id.as_slice();
        let start = if all.is_empty() { 0 } else { start % all.len() };
        all[start..].values().chain(all[..start].values())
    }

    /// Positions (in no particular order) of the slots whose last change is after `since`.
    pub(crate) fn changed_after(&self, since: i64) -> impl Iterator<Item = usize> + '_ {
        let from = since.saturating_add(1);
        self.index
            .by_revision
            .range((from, 0)..)
            .filter(move |(revision, _)| *revision > since)
            .map(|(_, position)| *position as usize)
    }

    /// Positions of the slots in `state`, ascending from `start`, then from 0 up to `start`:
    /// the order of [`SlotTable::rotated`].
    pub(crate) fn in_state_from(
        &self,
        state: MachineState,
        start: usize,
    ) -> impl Iterator<Item = usize> + '_ {
        let set = &self.index.by_state[state.wire() as usize];
        let start = position_u32(start.min(u32::MAX as usize));
        set.range(start..)
            .chain(set.range(..start))
            .map(|p| *p as usize)
    }

    /// How many slots are in `state`, in O(1).
    pub(crate) fn count_in_state(&self, state: MachineState) -> usize {
        self.index.by_state[state.wire() as usize].len()
    }

    /// Checks the indexes against the slots (tests).
    #[cfg(test)]
    pub(crate) fn assert_indexes_exact(&self) {
        let mut by_revision = BTreeSet::new();
        let mut by_state: [BTreeSet<u32>; STATES] = Default::default();
        for (position, slot) in self.by_id.values().enumerate() {
            by_revision.insert((slot.last_change, position_u32(position)));
            by_state[slot.machine.state.wire() as usize].insert(position_u32(position));
        }
        assert_eq!(self.index.by_revision, by_revision, "revision index");
        assert_eq!(self.index.by_state, by_state, "state index");
    }
}

impl Index<&str> for SlotTable {
    type Output = Slot;

    fn index(&self, id: &str) -> &Slot {
        &self.by_id[id]
    }
}

impl Index<&String> for SlotTable {
    type Output = Slot;

    fn index(&self, id: &String) -> &Slot {
        &self.by_id[id.as_str()]
    }
}

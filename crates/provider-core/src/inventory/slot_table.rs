//! The machine slots keyed by id, with O(1) positional access so that a capped List can start
//! at a random slot and wrap around (contract.md §8: a capped List is an arbitrary subset, and
//! callers that pick machines with `max_results = 1` must not all get the same one).

use std::ops::Index;

use indexmap::IndexMap;

use super::Slot;

/// Slots by machine id. Lookups are O(1); iteration follows an unspecified but stable order
/// (insertion order, perturbed by removals), and [`SlotTable::rotated`] walks the same order
/// starting at any position.
#[derive(Debug, Default)]
pub(crate) struct SlotTable {
    by_id: IndexMap<String, Slot>,
}

impl SlotTable {
    pub(crate) fn insert(&mut self, id: String, slot: Slot) -> Option<Slot> {
        self.by_id.insert(id, slot)
    }

    pub(crate) fn get(&self, id: &str) -> Option<&Slot> {
        self.by_id.get(id)
    }

    pub(crate) fn get_mut(&mut self, id: &str) -> Option<&mut Slot> {
        self.by_id.get_mut(id)
    }

    pub(crate) fn contains_key(&self, id: &str) -> bool {
        self.by_id.contains_key(id)
    }

    /// Removes a slot in O(1); the last slot takes its position.
    pub(crate) fn remove(&mut self, id: &str) -> Option<Slot> {
        self.by_id.swap_remove(id)
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

    pub(crate) fn values_mut(&mut self) -> impl Iterator<Item = &mut Slot> {
        self.by_id.values_mut()
    }

    /// Every slot once, starting at position `start` (taken modulo the length) and wrapping
    /// around. Starting costs O(1), whatever `start` is.
    pub(crate) fn rotated(&self, start: usize) -> impl Iterator<Item = &Slot> {
        let all = self.by_id.as_slice();
        let start = if all.is_empty() { 0 } else { start % all.len() };
        all[start..].values().chain(all[..start].values())
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

//! The hosts a cloud expects to own between two full surveys: those of its last complete
//! listing, with this process's own Creates and Deletes since. A cloud's out-of-band check
//! ([`crate::provisioning::cloud::Cloud::inventory_changed`]) compares what its API says with this ledger, so
//! that a host the provider deleted itself, or one it created after the listing, is never
//! taken for a change made behind its back.
//!
//! A listing is paged and takes a while: a host created while it runs may be missing from it
//! (its page was already read), and a host deleted while it runs may still be in it. So a
//! listing adds the hosts created since it began, and never brings back a host this process
//! deleted (cloud ids are never reused).

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::{Mutex, MutexGuard};

/// How many of this process's own deletions are remembered to be kept out of later listings: far
/// more than can happen between two listings.
const REMEMBERED_DELETIONS: usize = 4096;

/// The hosts a cloud expects to own. Cheap to share behind the cloud; every method is a short
/// critical section.
#[derive(Debug, Default)]
pub struct HostLedger {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// The expected hosts; `None` until the first complete listing.
    known: Option<HashSet<String>>,
    /// Deletes sent and not answered yet, by host (two transitions may delete one host).
    deleting: HashMap<String, usize>,
    /// Hosts this process deleted, newest last.
    deleted: HashSet<String>,
    deleted_order: VecDeque<String>,
    /// Hosts created while a listing ran, by the sequence number of their creation.
    created: Vec<(u64, String)>,
    /// Listings in progress, by the sequence number they began at.
    listings: BTreeMap<u64, usize>,
    next: u64,
}

impl State {
    fn forget_old_creations(&mut self) {
        match self.listings.keys().next().copied() {
            Some(oldest) => self.created.retain(|(seq, _)| *seq >= oldest),
            None => self.created.clear(),
        }
    }
}

impl HostLedger {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Marks the start of a full listing of the owned hosts; [`Listing::complete`] with what
    /// it found replaces the expected hosts. A listing dropped without completing (it failed)
    /// changes nothing.
    pub fn listing(&self) -> Listing<'_> {
        let mut state = self.lock();
        let start = state.next;
        *state.listings.entry(start).or_default() += 1;
        Listing {
            ledger: self,
            start,
        }
    }

    /// A host this process created (or found made by an earlier attempt of its own).
    pub fn created(&self, id: &str) {
        let mut state = self.lock();
        let seq = state.next;
        state.next += 1;
        if let Some(known) = &mut state.known {
            known.insert(id.to_owned());
        }
        if !state.listings.is_empty() {
            state.created.push((seq, id.to_owned()));
        }
    }

    /// A delete of `id` about to be sent: from now until it is answered the host may vanish
    /// without that being a change. [`Deleting::done`] once it is gone.
    pub fn deleting(&self, id: &str) -> Deleting<'_> {
        *self.lock().deleting.entry(id.to_owned()).or_default() += 1;
        Deleting {
            ledger: self,
            id: id.to_owned(),
        }
    }

    /// How many hosts should exist now at least: the expected ones less those being deleted;
    /// `None` before the first complete listing.
    pub fn expected(&self) -> Option<usize> {
        let state = self.lock();
        let known = state.known.as_ref()?;
        let leaving = state
            .deleting
            .keys()
            .filter(|id| known.contains(*id))
            .count();
        Some(known.len() - leaving)
    }

    /// Whether `id` is one of the expected hosts and no delete of this process is sending or
    /// has sent for it: its disappearance would be a change made elsewhere.
    pub fn expects(&self, id: &str) -> bool {
        let state = self.lock();
        state.known.as_ref().is_some_and(|k| k.contains(id))
            && !state.deleting.contains_key(id)
            && !state.deleted.contains(id)
    }
}

/// A full listing in progress ([`HostLedger::listing`]).
#[must_use = "a listing changes the ledger only when completed"]
pub struct Listing<'a> {
    ledger: &'a HostLedger,
    start: u64,
}

impl Listing<'_> {
    /// The listing found exactly `ids`: they become the expected hosts, with those created
    /// since the listing began and without those this process deleted.
    pub fn complete(self, ids: impl IntoIterator<Item = String>) {
        let mut state = self.ledger.lock();
        let mut known: HashSet<String> = ids
            .into_iter()
            .filter(|id| !state.deleted.contains(id))
            .collect();
        known.extend(
            state
                .created
                .iter()
                .filter(|(seq, _)| *seq >= self.start)
                .map(|(_, id)| id.clone())
                .filter(|id| !state.deleted.contains(id)),
        );
        state.known = Some(known);
        // The listing leaves the ledger (its `Drop`) once the lock is free.
        drop(state);
    }
}

impl Drop for Listing<'_> {
    fn drop(&mut self) {
        let mut state = self.ledger.lock();
        if let Some(n) = state.listings.get_mut(&self.start) {
            *n -= 1;
            if *n == 0 {
                state.listings.remove(&self.start);
            }
        }
        state.forget_old_creations();
    }
}

/// A delete in flight ([`HostLedger::deleting`]). Dropped without [`Deleting::done`] (the
/// delete failed), the host is expected again.
#[must_use = "a delete that succeeded must say so with `done`"]
pub struct Deleting<'a> {
    ledger: &'a HostLedger,
    id: String,
}

impl Deleting<'_> {
    /// The host is gone (deleted now, or already absent): it is no longer expected, and no
    /// later listing that still shows it brings it back.
    pub fn done(self) {
        let mut state = self.ledger.lock();
        if let Some(known) = &mut state.known {
            known.remove(&self.id);
        }
        if state.deleted.insert(self.id.clone()) {
            state.deleted_order.push_back(self.id.clone());
            if state.deleted_order.len() > REMEMBERED_DELETIONS
                && let Some(oldest) = state.deleted_order.pop_front()
            {
                state.deleted.remove(&oldest);
            }
        }
        // The delete leaves the ledger (its `Drop`) once the lock is free.
        drop(state);
    }
}

impl Drop for Deleting<'_> {
    fn drop(&mut self) {
        let mut state = self.ledger.lock();
        if let Some(n) = state.deleting.get_mut(&self.id) {
            *n -= 1;
            if *n == 0 {
                state.deleting.remove(&self.id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(ids: &[&str]) -> Vec<String> {
        ids.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn nothing_is_expected_before_the_first_listing() {
        let ledger = HostLedger::default();
        ledger.created("1");
        assert_eq!(ledger.expected(), None);
        assert!(!ledger.expects("1"));
        // A failed listing does not count as one.
        drop(ledger.listing());
        assert_eq!(ledger.expected(), None);
        ledger.listing().complete(ids(&["1", "2"]));
        assert_eq!(ledger.expected(), Some(2));
        assert!(ledger.expects("1") && ledger.expects("2") && !ledger.expects("3"));
    }

    #[test]
    fn own_creates_and_deletes_move_the_expectation() {
        let ledger = HostLedger::default();
        ledger.listing().complete(ids(&["1", "2"]));
        ledger.created("3");
        assert_eq!(ledger.expected(), Some(3));
        let deleting = ledger.deleting("1");
        // While the delete is out, the host may already be gone.
        assert_eq!(ledger.expected(), Some(2));
        assert!(!ledger.expects("1"));
        deleting.done();
        assert_eq!(ledger.expected(), Some(2));
        assert!(!ledger.expects("1"));
        // A delete that failed leaves the host expected.
        drop(ledger.deleting("2"));
        assert_eq!(ledger.expected(), Some(2));
        assert!(ledger.expects("2"));
    }

    #[test]
    fn a_listing_keeps_creates_made_while_it_ran_and_drops_own_deletions() {
        let ledger = HostLedger::default();
        ledger.created("0");
        ledger.listing().complete(ids(&["0", "1", "2"]));
        let listing = ledger.listing();
        // Created after the listing read its page: missing from what it found.
        ledger.created("3");
        // Deleted after the listing read its page: still in what it found.
        ledger.deleting("1").done();
        listing.complete(ids(&["0", "1", "2"]));
        assert_eq!(ledger.expected(), Some(3));
        assert!(ledger.expects("3") && !ledger.expects("1"));
        // A later listing that does not show the new host (deleted behind our back) is
        // believed: only creations made while a listing ran are added to it.
        ledger.listing().complete(ids(&["0", "2"]));
        assert_eq!(ledger.expected(), Some(2));
        assert!(!ledger.expects("3"));
    }

    #[test]
    fn creations_are_forgotten_once_no_listing_needs_them() {
        let ledger = HostLedger::default();
        let first = ledger.listing();
        ledger.created("1");
        let second = ledger.listing();
        ledger.created("2");
        first.complete(ids(&[]));
        assert_eq!(
            ledger.lock().created,
            vec![(1, "2".to_owned())],
            "the second listing still needs the creation made after it began"
        );
        second.complete(ids(&[]));
        assert!(ledger.lock().created.is_empty());
        assert_eq!(
            ledger.expected(),
            Some(1),
            "only the creation after it began"
        );
        ledger.created("3");
        assert!(ledger.lock().created.is_empty(), "no listing runs");
    }

    #[test]
    fn remembered_deletions_are_bounded() {
        let ledger = HostLedger::default();
        for i in 0..REMEMBERED_DELETIONS + 10 {
            ledger.deleting(&i.to_string()).done();
        }
        let state = ledger.lock();
        assert_eq!(state.deleted.len(), REMEMBERED_DELETIONS);
        assert!(!state.deleted.contains("0"));
        assert!(state.deleting.is_empty());
    }
}

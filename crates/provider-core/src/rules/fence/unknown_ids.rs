//! Fence marks for machine ids the provider does not know. The fence runs before the not-found
//! check and a passing token records its mark even when the id does not exist (contract.md §3,
//! §4; B301), so any client could otherwise grow the durable mark table without bound by
//! sending random ids. These marks live in a table of fixed capacity: when it is full, the mark
//! advanced least recently is evicted. Losing such a mark costs nothing a stale token could
//! exploit: the id does not exist, so a replay that the mark would have fenced is answered
//! NotFound instead of FailedPrecondition. When a slot with that id appears, its marks leave
//! this table for the unbounded per-machine one ([`UnknownIdMarks::take_machine`]).

use std::collections::{HashMap, VecDeque};

use super::HighWaterMark;

/// The default capacity of the table (see docs/limits.md).
pub const DEFAULT_CAPACITY: usize = 16_384;

/// A mark that left the table to make room, for the store and the eviction metric.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Evicted {
    pub shard_id: String,
    pub machine_id: String,
}

/// Marks by (machine id, shard id) with least-recently-advanced eviction in amortised O(1).
#[derive(Debug)]
pub struct UnknownIdMarks {
    capacity: usize,
    /// machine id -> shard id -> (mark, the tick of its last advance).
    marks: HashMap<String, HashMap<String, (HighWaterMark, u64)>>,
    /// (machine id, shard id, tick) in advance order. An entry whose tick is older than the
    /// mark's current tick is stale (the mark advanced again later) and is skipped.
    order: VecDeque<(String, String, u64)>,
    len: usize,
    tick: u64,
}

impl Default for UnknownIdMarks {
    fn default() -> UnknownIdMarks {
        UnknownIdMarks::with_capacity(DEFAULT_CAPACITY)
    }
}

impl UnknownIdMarks {
    /// A table that holds at most `capacity` marks (at least one).
    pub fn with_capacity(capacity: usize) -> UnknownIdMarks {
        UnknownIdMarks {
            capacity: capacity.max(1),
            marks: HashMap::new(),
            order: VecDeque::new(),
            len: 0,
            tick: 0,
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn get(&self, shard_id: &str, machine_id: &str) -> Option<HighWaterMark> {
        self.marks
            .get(machine_id)
            .and_then(|by_shard| by_shard.get(shard_id))
            .map(|(mark, _)| *mark)
    }

    /// Records `mark` as the newest of the table and returns the marks evicted to make room
    /// (the new mark itself is never evicted).
    pub fn put(&mut self, shard_id: &str, machine_id: &str, mark: HighWaterMark) -> Vec<Evicted> {
        self.tick += 1;
        let tick = self.tick;
        let by_shard = self.marks.entry(machine_id.to_owned()).or_default();
        match by_shard.get_mut(shard_id) {
            Some(entry) => *entry = (mark, tick),
            None => {
                by_shard.insert(shard_id.to_owned(), (mark, tick));
                self.len += 1;
            }
        }
        self.order
            .push_back((machine_id.to_owned(), shard_id.to_owned(), tick));
        let mut evicted = Vec::new();
        while self.len > self.capacity {
            match self.pop_oldest() {
                Some(e) => evicted.push(e),
                None => break,
            }
        }
        self.compact_order();
        evicted
    }

    /// Removes and returns every mark of `machine_id` (a slot with that id now exists).
    pub fn take_machine(&mut self, machine_id: &str) -> Vec<(String, HighWaterMark)> {
        let Some(by_shard) = self.marks.remove(machine_id) else {
            return Vec::new();
        };
        self.len -= by_shard.len();
        // Their entries in `order` are now stale and skipped on eviction.
        self.compact_order();
        by_shard
            .into_iter()
            .map(|(shard, (mark, _))| (shard, mark))
            .collect()
    }

    /// Every mark, oldest first (for a snapshot of the state).
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str, HighWaterMark)> {
        let mut all: Vec<(&str, &str, HighWaterMark, u64)> = self
            .marks
            .iter()
            .flat_map(|(machine, by_shard)| {
                by_shard.iter().map(move |(shard, (mark, tick))| {
                    (shard.as_str(), machine.as_str(), *mark, *tick)
                })
            })
            .collect();
        all.sort_unstable_by_key(|entry| entry.3);
        all.into_iter()
            .map(|(shard, machine, mark, _)| (shard, machine, mark))
    }

    fn pop_oldest(&mut self) -> Option<Evicted> {
        while let Some((machine_id, shard_id, tick)) = self.order.pop_front() {
            let Some(by_shard) = self.marks.get_mut(&machine_id) else {
                continue;
            };
            if by_shard.get(&shard_id).map(|(_, t)| *t) != Some(tick) {
                continue;
            }
            by_shard.remove(&shard_id);
            if by_shard.is_empty() {
                self.marks.remove(&machine_id);
            }
            self.len -= 1;
            return Some(Evicted {
                shard_id,
                machine_id,
            });
        }
        None
    }

    /// Drops stale entries of `order` once they outnumber the live ones, so the queue stays
    /// within twice the capacity whatever the access pattern (amortised O(1) per put).
    fn compact_order(&mut self) {
        if self.order.len() <= 2 * self.len.max(self.capacity) {
            return;
        }
        let marks = &self.marks;
        self.order.retain(|(machine, shard, tick)| {
            marks
                .get(machine)
                .and_then(|by_shard| by_shard.get(shard))
                .is_some_and(|(_, t)| t == tick)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(n: i64) -> HighWaterMark {
        HighWaterMark {
            epoch: 1,
            sequence: n,
        }
    }

    #[test]
    fn the_least_recently_advanced_mark_is_evicted_first() {
        let mut table = UnknownIdMarks::with_capacity(3);
        assert!(table.put("s", "a", mark(1)).is_empty());
        assert!(table.put("s", "b", mark(1)).is_empty());
        assert!(table.put("t", "a", mark(1)).is_empty());
        // Advancing ("s", "a") makes ("s", "b") the oldest.
        assert!(table.put("s", "a", mark(2)).is_empty());
        let evicted = table.put("s", "c", mark(1));
        assert_eq!(
            evicted,
            vec![Evicted {
                shard_id: "s".into(),
                machine_id: "b".into()
            }]
        );
        assert_eq!(table.len(), 3);
        assert_eq!(table.get("s", "b"), None);
        assert_eq!(table.get("s", "a"), Some(mark(2)));
        let order: Vec<(&str, &str)> = table.iter().map(|(s, m, _)| (s, m)).collect();
        assert_eq!(order, vec![("t", "a"), ("s", "a"), ("s", "c")]);
    }

    #[test]
    fn taking_a_machine_removes_all_of_its_marks() {
        let mut table = UnknownIdMarks::with_capacity(4);
        table.put("s", "a", mark(1));
        table.put("t", "a", mark(5));
        table.put("s", "b", mark(1));
        let mut taken = table.take_machine("a");
        taken.sort();
        assert_eq!(taken, vec![("s".into(), mark(1)), ("t".into(), mark(5))]);
        assert_eq!(table.len(), 1);
        assert_eq!(table.get("t", "a"), None);
        // The stale order entries of "a" are skipped: the next evictions are real marks.
        for i in 0..4 {
            table.put("s", &format!("n{i}"), mark(1));
        }
        assert_eq!(table.len(), 4);
        assert_eq!(table.get("s", "b"), None, "b was the oldest live mark");
    }

    #[test]
    fn memory_stays_bounded_under_any_access_pattern() {
        let mut table = UnknownIdMarks::with_capacity(100);
        let mut evictions = 0;
        for i in 0..100_000u32 {
            // Half the puts re-advance a hot mark, half add a fresh id.
            let id = if i % 2 == 0 {
                "hot".to_owned()
            } else {
                format!("id-{i}")
            };
            evictions += table.put("s", &id, mark(i64::from(i))).len();
            assert!(table.len() <= 100);
            assert!(table.order.len() <= 2 * 100 + 1);
        }
        assert_eq!(evictions, 50_000 + 1 - 100);
        assert_eq!(table.get("s", "hot"), Some(mark(99_998)));
    }
}

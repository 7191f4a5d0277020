//! Fence marks of unknown machine ids live in a bounded table (docs/limits.md): the fence still
//! runs before not-found (contract.md §3, B301), but random ids cannot grow the state.

use super::*;
use crate::rules::lifecycle::OperationKind::Create;
use crate::rules::machine::{CapacityType, Machine};

fn machine(id: &str) -> Machine {
    let mut m = Machine::speculative(id.to_owned(), "cx22");
    m.zone = "nbg1".into();
    m.capacity_type = CapacityType::OnDemand;
    m
}

fn tok(shard: &str, epoch: i64, sequence: i64) -> FenceToken {
    FenceToken {
        shard_id: shard.into(),
        epoch,
        sequence,
    }
}

fn create(
    inv: &mut Inventory,
    id: &str,
    token: &FenceToken,
) -> (Result<Admission, CoreError>, Vec<Change>) {
    let mut changes = Vec::new();
    let result = inv.admit(Create, id, token, None, &mut changes);
    (result, changes)
}

fn removed(changes: &[Change]) -> Vec<(String, String)> {
    changes
        .iter()
        .filter_map(|c| match c {
            Change::RemoveFence {
                shard_id,
                machine_id,
            } => Some((shard_id.clone(), machine_id.clone())),
            _ => None,
        })
        .collect()
}

fn bounded(capacity: usize, slots: &[&str]) -> Inventory {
    let mut inv = Inventory::default();
    inv.seed(
        slots.iter().map(|id| machine(id)).collect(),
        &mut Vec::new(),
    )
    .expect("seed");
    assert_eq!(inv.limit_unknown_id_marks(capacity, &mut Vec::new()), 0);
    inv
}

#[test]
fn marks_of_unknown_ids_are_bounded_and_the_oldest_is_evicted() {
    let mut inv = bounded(3, &["m-0"]);
    for (i, ghost) in ["g-0", "g-1", "g-2"].iter().enumerate() {
        let (result, changes) = create(&mut inv, ghost, &tok("s", 1, i as i64));
        assert!(matches!(result, Err(CoreError::UnknownMachine(_))));
        assert!(removed(&changes).is_empty());
    }
    // The fence still runs before not-found: a stale replay on a ghost is fenced (B301).
    let (result, _) = create(&mut inv, "g-1", &tok("s", 1, 1));
    assert!(
        matches!(result, Err(CoreError::Fenced { .. })),
        "{result:?}"
    );

    // A fourth ghost evicts the oldest mark, and the store is told to forget it.
    let (result, changes) = create(&mut inv, "g-3", &tok("s", 1, 9));
    assert!(matches!(result, Err(CoreError::UnknownMachine(_))));
    assert_eq!(removed(&changes), vec![("s".to_owned(), "g-0".to_owned())]);
    assert!(
        changes
            .iter()
            .any(|c| matches!(c, Change::PutFence { machine_id, .. } if machine_id == "g-3"))
    );
    assert_eq!(inv.fence_mark("s", "g-0"), None);
    assert_eq!(inv.unknown_id_marks(), (3, 1));
    // After eviction the ghost is first contact again: the answer is the true NotFound.
    let (result, _) = create(&mut inv, "g-0", &tok("s", 1, 0));
    assert!(matches!(result, Err(CoreError::UnknownMachine(_))));

    // Marks of real machines are never evicted, however many ghosts follow.
    let (result, _) = create(&mut inv, "m-0", &tok("s", 5, 5));
    assert!(result.is_ok());
    for i in 0..100 {
        let _ = create(&mut inv, &format!("x-{i}"), &tok("s", 1, 1));
    }
    assert_eq!(
        inv.fence_mark("s", "m-0"),
        Some(HighWaterMark {
            epoch: 5,
            sequence: 5
        })
    );
    assert_eq!(inv.unknown_id_marks().0, 3);
    assert_eq!(inv.snapshot().fences.len(), 4);
}

#[test]
fn a_slot_that_appears_keeps_the_marks_recorded_while_it_was_unknown() {
    let mut inv = bounded(2, &["m-0"]);
    let (result, _) = create(&mut inv, "later", &tok("s", 7, 7));
    assert!(matches!(result, Err(CoreError::UnknownMachine(_))));
    inv.seed(vec![machine("later")], &mut Vec::new())
        .expect("the slot appears");
    // Ghost churn no longer touches its mark: it guards a real machine now.
    for i in 0..10 {
        let _ = create(&mut inv, &format!("g-{i}"), &tok("s", 1, 1));
    }
    let (result, _) = create(&mut inv, "later", &tok("s", 7, 7));
    assert!(
        matches!(result, Err(CoreError::Fenced { .. })),
        "a stale replay on the new slot must stay fenced: {result:?}"
    );
}

#[test]
fn stored_marks_beyond_the_capacity_are_dropped_oldest_first_at_load() {
    let mut inv = bounded(10, &["m-0"]);
    for i in 0..6 {
        let _ = create(&mut inv, &format!("g-{i}"), &tok("s", 1, i));
    }
    let _ = create(&mut inv, "m-0", &tok("s", 1, 1));
    let stored = inv.snapshot();
    assert_eq!(stored.fences.len(), 7);

    let mut reloaded = Inventory::from_snapshot(stored.clone());
    assert_eq!(reloaded.unknown_id_marks().0, 6);
    let mut changes = Vec::new();
    assert_eq!(reloaded.limit_unknown_id_marks(4, &mut changes), 2);
    assert_eq!(
        removed(&changes),
        vec![
            ("s".to_owned(), "g-0".to_owned()),
            ("s".to_owned(), "g-1".to_owned())
        ]
    );
    assert!(reloaded.fence_mark("s", "m-0").is_some());
    assert!(reloaded.fence_mark("s", "g-5").is_some());
    assert_eq!(reloaded.snapshot().fences.len(), 5);
}

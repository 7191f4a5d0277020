//! List over the wire (contract.md §8): state filters, max_results, and the since_revision
//! cursor (deltas, an empty delta with the same head, garbage treated as no cursor, and a
//! cursor from before a restart of an in-memory provider yielding the full list).

use std::collections::BTreeSet;

use fleet_proto::v1alpha1 as pb;
use pb::MachineState::{Configured, Failed, Idle, Speculative, Unspecified};

use crate::harness::{self, SETTLE, TestBackend, machine_id};
use crate::wire::{Caller, state_of};

const SEEDS: usize = 6;

fn filter(states: &[pb::MachineState], max_results: i32, since: &[u8]) -> pb::ListFilter {
    pb::ListFilter {
        states: states.iter().map(|s| *s as i32).collect(),
        max_results,
        since_revision: since.to_vec(),
    }
}

fn ids(list: &pb::MachineList) -> BTreeSet<String> {
    list.machines.iter().map(|m| m.id.clone()).collect()
}

fn all_ids() -> BTreeSet<String> {
    (0..SEEDS).map(machine_id).collect()
}

/// The head revision as the number it encodes (ASCII decimal).
fn head(list: &pb::MachineList) -> i64 {
    std::str::from_utf8(&list.revision)
        .expect("ASCII revision")
        .parse()
        .expect("decimal revision")
}

async fn with_one_idle(caller: &mut Caller) -> String {
    let id = machine_id(0);
    harness::create_idle(caller, &id).await;
    id
}

#[tokio::test]
async fn state_filters_and_caps() {
    let (server, mut caller) = harness::insecure(TestBackend::instant(SEEDS), "shard-l").await;
    let idle = with_one_idle(&mut caller).await;

    let list = |states: &'static [pb::MachineState], max: i32| filter(states, max, b"");
    let only_idle = caller.list(list(&[Idle], 0)).await.unwrap();
    assert_eq!(ids(&only_idle), BTreeSet::from([idle.clone()]));
    let speculative = caller.list(list(&[Speculative], 0)).await.unwrap();
    assert_eq!(speculative.machines.len(), SEEDS - 1);
    assert!(
        speculative
            .machines
            .iter()
            .all(|m| state_of(m) == Speculative)
    );
    let union = caller.list(list(&[Speculative, Idle], 0)).await.unwrap();
    assert_eq!(ids(&union), all_ids());
    for nothing in [&[Unspecified][..], &[Failed], &[Configured, Failed]] {
        let none = caller.list(filter(nothing, 0, b"")).await.unwrap();
        assert!(
            none.machines.is_empty(),
            "{nothing:?} matched {:?}",
            ids(&none)
        );
    }

    for (max, want) in [(0, SEEDS), (-3, SEEDS), (2, 2), (SEEDS as i32 + 5, SEEDS)] {
        let capped = caller.list(list(&[], max)).await.unwrap();
        assert_eq!(capped.machines.len(), want, "max_results {max}");
        assert_eq!(
            ids(&capped).len(),
            want,
            "distinct ids with max_results {max}"
        );
    }
    let capped = caller.list(list(&[Speculative], 3)).await.unwrap();
    assert_eq!(capped.machines.len(), 3);
    assert!(capped.machines.iter().all(|m| state_of(m) == Speculative));

    // Every answer carries the same head when nothing changed.
    assert_eq!(head(&only_idle), head(&capped));
    server.stop().await;
}

#[tokio::test]
async fn cursors_give_deltas() {
    let (server, mut caller) = harness::insecure(TestBackend::instant(SEEDS), "shard-c").await;
    let full = caller.list(filter(&[], 0, b"")).await.unwrap();
    assert_eq!(ids(&full), all_ids());
    let h0 = full.revision.clone();

    // Nothing changed: an empty delta with the same head.
    let quiet = caller.list(filter(&[], 0, &h0)).await.unwrap();
    assert!(quiet.machines.is_empty(), "{:?}", ids(&quiet));
    assert_eq!(quiet.revision, h0);

    // Garbage, invalid UTF-8, an empty cursor and "0" all mean: everything.
    for cursor in [
        &b"not-a-cursor"[..],
        &[0xff, 0xfe, 0x00],
        b"",
        b"0",
        b"12abc",
        b" 5",
    ] {
        let list = caller.list(filter(&[], 0, cursor)).await.unwrap();
        assert_eq!(ids(&list), all_ids(), "cursor {cursor:?}");
        assert_eq!(list.revision, h0);
    }

    let changed = with_one_idle(&mut caller).await;
    let delta = caller.list(filter(&[], 0, &h0)).await.unwrap();
    assert_eq!(ids(&delta), BTreeSet::from([changed.clone()]));
    assert!(head(&delta) > head(&full), "the head moves on change");
    assert_eq!(state_of(&delta.machines[0]), Idle);
    // The delta respects the state filter.
    let filtered = caller.list(filter(&[Speculative], 0, &h0)).await.unwrap();
    assert!(filtered.machines.is_empty());

    let h1 = delta.revision.clone();
    let quiet = caller.list(filter(&[], 0, &h1)).await.unwrap();
    assert!(quiet.machines.is_empty());
    assert_eq!(quiet.revision, h1);
    // Reads do not move the head.
    caller.get(&changed).await.unwrap();
    assert_eq!(caller.list(filter(&[], 0, &h1)).await.unwrap().revision, h1);
    server.stop().await;
}

#[tokio::test]
async fn a_cursor_from_before_an_in_memory_restart_yields_the_full_list() {
    let (first, mut caller) = harness::insecure(TestBackend::instant(SEEDS), "shard-r").await;
    let old_op = caller.create(&machine_id(0)).await.unwrap().operation_id;
    caller
        .wait_for_state(&machine_id(0), Idle, SETTLE)
        .await
        .unwrap();
    let cursor = caller.list(filter(&[], 0, b"")).await.unwrap().revision;
    first.stop().await;

    let (second, mut caller) = harness::insecure(TestBackend::instant(SEEDS), "shard-r").await;
    let list = caller.list(filter(&[], 0, &cursor)).await.unwrap();
    assert_eq!(
        ids(&list),
        all_ids(),
        "a stale cursor must not hide the re-seeded inventory"
    );
    assert!(list.machines.iter().all(|m| state_of(m) == Speculative));
    assert_ne!(list.revision, cursor);
    // Operation ids of the earlier incarnation are not reused either.
    let new_op = caller.create(&machine_id(0)).await.unwrap().operation_id;
    assert_ne!(new_op, old_op);
    second.stop().await;
}

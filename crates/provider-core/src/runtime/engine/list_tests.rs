//! List selection (contract.md §8): a capped List is an arbitrary subset that changes from call
//! to call, while filters, uncapped Lists and `since_revision` cursors stay exact.

use std::collections::{BTreeSet, HashSet};

use super::test_support::{SlotBackend, start_in_memory, zero};
use super::*;

async fn engine(machines: usize) -> Arc<Engine> {
    start_in_memory(Arc::new(SlotBackend::numbered(machines)), "test_list").await
}

fn query(states: &[MachineState], max_results: i32, since: &[u8]) -> ListQuery {
    ListQuery {
        states: states.to_vec(),
        max_results,
        since_revision: since.to_vec(),
    }
}

fn ids(listing: &Listing) -> Vec<String> {
    listing.machines.iter().map(|m| m.id.clone()).collect()
}

async fn settle(engine: &Engine, id: &str, want: MachineState) {
    for _ in 0..10_000 {
        if engine.get(id).expect("known id").state == want {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("{id} never reached {want}");
}

#[tokio::test]
async fn consecutive_capped_lists_return_many_distinct_machines() {
    let engine = engine(1000).await;
    let mut picked = HashSet::new();
    for _ in 0..200 {
        let listing = engine.list(&query(&[MachineState::Speculative], 1, b""));
        assert_eq!(listing.machines.len(), 1);
        picked.insert(listing.machines[0].id.clone());
    }
    // 200 uniform picks out of 1000 give ~181 distinct ids; a fixed order gives 1.
    assert!(
        picked.len() > 100,
        "200 capped Lists returned only {} distinct machines",
        picked.len()
    );

    // Three picks in a row, as the conformance program makes them, are not all the same.
    let three: HashSet<String> = (0..3)
        .map(|_| ids(&engine.list(&query(&[MachineState::Speculative], 1, b"")))[0].clone())
        .collect();
    assert!(three.len() > 1, "three capped Lists returned one machine");
}

/// The conformance program's B302 picks three "different" Speculative machines with three
/// `max_results = 1` Lists and sends one shard's tokens to them in an order that a repeat would
/// fence falsely; a worker pool picking machines the same way would collide the same way. Picks
/// in a row never repeat until every match has been returned once.
#[tokio::test]
async fn consecutive_capped_lists_return_every_match_before_any_repeat() {
    let engine = engine(256).await;
    // Every third machine goes Idle, so matches are not contiguous.
    for i in (0..256).step_by(3) {
        engine
            .create(&format!("m-{i:05}"), zero())
            .await
            .expect("create");
    }
    for i in (0..256).step_by(3) {
        settle(&engine, &format!("m-{i:05}"), MachineState::Idle).await;
    }
    let speculative = engine
        .list(&query(&[MachineState::Speculative], 0, b""))
        .machines
        .len();
    let mut picked = Vec::new();
    for _ in 0..speculative {
        let listing = engine.list(&query(&[MachineState::Speculative], 1, b""));
        assert_eq!(listing.machines.len(), 1);
        assert_eq!(listing.machines[0].state, MachineState::Speculative);
        picked.push(listing.machines[0].id.clone());
    }
    let distinct: HashSet<&String> = picked.iter().collect();
    assert_eq!(
        distinct.len(),
        speculative,
        "{speculative} capped Lists in a row repeated a machine"
    );
}

#[tokio::test]
async fn a_capped_list_returns_only_matching_machines_without_repeats() {
    let engine = engine(300).await;
    // Every tenth machine goes Idle; the rest stay Speculative.
    let idle: BTreeSet<String> = (0..300).step_by(10).map(|i| format!("m-{i:05}")).collect();
    for id in &idle {
        engine.create(id, zero()).await.expect("create");
    }
    for id in &idle {
        settle(&engine, id, MachineState::Idle).await;
    }
    let mut seen = BTreeSet::new();
    for _ in 0..300 {
        let listing = engine.list(&query(&[MachineState::Idle], 3, b""));
        assert_eq!(listing.machines.len(), 3);
        let got: BTreeSet<String> = ids(&listing).into_iter().collect();
        assert_eq!(got.len(), 3, "a capped List repeated a machine");
        assert!(got.is_subset(&idle), "{got:?} holds a non-Idle machine");
        seen.extend(got);
    }
    assert!(
        seen.len() > 20,
        "capped Lists kept returning the same few Idle machines"
    );

    // A cap at or above the number of matches returns all of them.
    let all = engine.list(&query(&[MachineState::Idle], 30, b""));
    assert_eq!(ids(&all).into_iter().collect::<BTreeSet<_>>(), idle);
}

#[tokio::test]
async fn uncapped_lists_and_cursors_keep_their_exact_semantics() {
    let engine = engine(50).await;
    let everything = engine.list(&query(&[], 0, b""));
    assert_eq!(everything.machines.len(), 50);
    let order = ids(&everything);
    // Uncapped Lists return every machine, in the same order each time.
    for max in [0, -1, 50, 51] {
        assert_eq!(ids(&engine.list(&query(&[], max, b""))), order, "max {max}");
    }

    let cursor = everything.revision.to_string();
    let changed = ["m-00007", "m-00031", "m-00044"];
    for id in changed {
        engine.create(id, zero()).await.expect("create");
        settle(&engine, id, MachineState::Idle).await;
    }
    let delta = engine.list(&query(&[], 0, cursor.as_bytes()));
    assert_eq!(
        ids(&delta).into_iter().collect::<BTreeSet<_>>(),
        changed.iter().map(|s| s.to_string()).collect()
    );
    // A capped delta is a subset of the delta, never a machine unchanged since the cursor.
    let mut seen = BTreeSet::new();
    for _ in 0..100 {
        let capped = engine.list(&query(&[], 1, cursor.as_bytes()));
        assert_eq!(capped.machines.len(), 1);
        assert!(changed.contains(&capped.machines[0].id.as_str()));
        seen.insert(capped.machines[0].id.clone());
    }
    assert!(
        seen.len() > 1,
        "capped deltas always returned the same machine"
    );
    // A cursor at the head is an empty delta, capped or not.
    let head = delta.revision.to_string();
    assert!(
        engine
            .list(&query(&[], 0, head.as_bytes()))
            .machines
            .is_empty()
    );
    assert!(
        engine
            .list(&query(&[], 2, head.as_bytes()))
            .machines
            .is_empty()
    );
}

//! The List indexes against a full scan: on random walks of every kind of change (admission,
//! completion, failure, release, new and removed slots, cursor invalidation, restart recovery
//! and reloads through the durable store), every selection (state filter, cursor, cap, start)
//! finds the same machines in the same order, and passes the same slots, as a walk over the
//! whole table.

use std::collections::HashSet;

use proptest::prelude::*;

use super::*;
use crate::persistence::durable::DurableStore;
use crate::persistence::store::Store;

/// What a List found by walking every slot from `start`: the definition the indexes must meet.
fn select_by_scan(
    inventory: &Inventory,
    selection: &Selection,
    start: usize,
) -> (Vec<String>, usize) {
    let n = inventory.len();
    if n == 0 || selection.cap == 0 {
        return (Vec::new(), 0);
    }
    let mut found = Vec::new();
    let mut visited = 0;
    for slot in inventory.slots_from(start % n) {
        if found.len() >= selection.cap {
            break;
        }
        visited += 1;
        if selection
            .since
            .is_some_and(|since| slot.last_change <= since)
        {
            continue;
        }
        if !selection.states.is_empty() && !selection.states.contains(&slot.machine.state) {
            continue;
        }
        found.push(slot.machine.id.clone());
    }
    (found, visited)
}

#[derive(Clone, Debug)]
enum Step {
    Admit(usize, usize),
    Succeed(usize),
    Fail(usize),
    Release(usize),
    Add(usize),
    Shrink(usize),
    Invalidate,
    Recover,
    Reload,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (0usize..24, 0usize..4).prop_map(|(m, k)| Step::Admit(m, k)),
        4 => (0usize..24).prop_map(Step::Succeed),
        2 => (0usize..24).prop_map(Step::Fail),
        1 => (0usize..24).prop_map(Step::Release),
        1 => (1usize..6).prop_map(Step::Add),
        1 => (0usize..24).prop_map(Step::Shrink),
        1 => Just(Step::Invalidate),
        1 => Just(Step::Recover),
        1 => Just(Step::Reload),
    ]
}

/// A selection drawn relative to the current head: state subset, cursor, cap and start.
#[derive(Clone, Debug)]
struct Query {
    states: u16,
    cursor_back: Option<i64>,
    cap: usize,
    start: usize,
}

fn query() -> impl Strategy<Value = Query> {
    (
        prop_oneof![Just(0u16), 1u16..512],
        prop::option::of(-2i64..12),
        prop_oneof![Just(usize::MAX), 1usize..8, Just(0usize)],
        0usize..64,
    )
        .prop_map(|(states, cursor_back, cap, start)| Query {
            states,
            cursor_back,
            cap,
            start,
        })
}

fn selection(inventory: &Inventory, q: &Query) -> Selection {
    Selection {
        states: MachineState::ALL
            .into_iter()
            .filter(|s| q.states & (1 << s.wire()) != 0)
            .collect(),
        since: q.cursor_back.map(|back| inventory.revision() - back),
        cap: q.cap,
    }
}

fn machine_id(n: usize) -> String {
    format!("m-{n}")
}

fn check(inventory: &Inventory, queries: &[Query]) -> Result<(), TestCaseError> {
    inventory.slots.assert_indexes_exact();
    for q in queries {
        let selection = selection(inventory, q);
        let selected = inventory.select(&selection, q.start);
        let ids: Vec<String> = selected.machines.iter().map(|m| m.id.clone()).collect();
        let (expected, visited) = select_by_scan(inventory, &selection, q.start);
        prop_assert_eq!(
            &ids,
            &expected,
            "machines of {:?} from {}",
            selection,
            q.start
        );
        if selection.cap < inventory.len() {
            prop_assert_eq!(selected.visited, visited, "visited by {:?}", selection);
        }
    }
    Ok(())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn indexed_selection_matches_a_full_scan_on_random_walks(
        steps in prop::collection::vec(step(), 1..60),
        queries in prop::collection::vec(query(), 4..12),
    ) {
        let rt = runtime();
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("state");
        let mut store = DurableStore::open(&dir).expect("open state");
        let mut inventory = Inventory::default();
        let mut next_id = 0;
        let mut changes = Vec::new();
        let seed: Vec<Machine> = (0..12)
            .map(|_| {
                next_id += 1;
                Machine::speculative(machine_id(next_id - 1), "cx22")
            })
            .collect();
        inventory.seed(seed, &mut changes).expect("seed");
        for s in steps {
            match s {
                Step::Admit(m, k) => {
                    let kind = OperationKind::ALL[k];
                    // Every other Configure carries a sealed blob, so reloads cover the trailer.
                    let binding = (kind == OperationKind::Configure).then(|| Binding {
                        cluster: "c1".into(),
                        shard_metadata: Default::default(),
                        sealed: m.is_multiple_of(2).then(|| {
                            std::sync::Arc::new(crate::rules::records::SealedConfigure {
                                deadline_unix_ms: m as u64,
                                sealed: vec![m as u8; 3],
                            })
                        }),
                    });
                    let token = FenceToken { shard_id: String::new(), epoch: 0, sequence: 0 };
                    let _ = inventory.admit(kind, &machine_id(m), &token, binding, &mut changes);
                }
                Step::Succeed(m) | Step::Fail(m) => {
                    let id = machine_id(m);
                    let pending = inventory.get(&id).and_then(|slot| {
                        let kind = OperationKind::of_transitional(slot.machine.state)?;
                        Some((kind, slot.operation(kind)?.to_owned()))
                    });
                    if let Some((kind, op)) = pending {
                        let outcome = if matches!(s, Step::Succeed(_)) {
                            Ok(Effect {
                                host: (kind == OperationKind::Create).then(|| HostRef {
                                    provider: "p".into(),
                                    id: format!("h-{m}"),
                                }),
                                ..Effect::default()
                            })
                        } else {
                            Err("broken".to_owned())
                        };
                        inventory.complete(&id, kind, &op, outcome, &mut changes);
                    }
                }
                Step::Release(m) => {
                    let _ = inventory.release(&machine_id(m), 0, &mut changes);
                }
                Step::Add(k) => {
                    let fresh = (0..k)
                        .map(|_| {
                            next_id += 1;
                            Machine::speculative(machine_id(next_id - 1), "cx22")
                        })
                        .collect();
                    inventory.add_missing(fresh, &mut changes);
                }
                Step::Shrink(keep_below) => {
                    let offered: HashSet<String> = (0..keep_below).map(machine_id).collect();
                    inventory.enforce_quota(&offered, &mut changes);
                }
                Step::Invalidate => inventory.invalidate_cursors(&mut changes),
                Step::Recover => {
                    inventory.recover_interrupted(
                        |slot| slot.sealed.is_none().then(|| "not sealed".to_owned()),
                        &mut changes,
                    );
                }
                Step::Reload => {
                    let _ = store.submit(std::mem::take(&mut changes));
                    rt.block_on(store.flush().wait()).expect("flush");
                    drop(store);
                    store = DurableStore::open(&dir).expect("reopen state");
                    let before = inventory.snapshot();
                    inventory = Inventory::from_snapshot(store.load().expect("load"));
                    prop_assert_eq!(inventory.len(), before.slots.len());
                }
            }
            if !changes.is_empty() {
                let _ = store.submit(std::mem::take(&mut changes));
            }
            check(&inventory, &queries)?;
        }
    }
}

#[test]
fn capped_selections_continue_where_the_previous_one_stopped() {
    let mut inventory = Inventory::default();
    let machines = (0..10)
        .map(|i| Machine::speculative(machine_id(i), "cx22"))
        .collect();
    inventory.seed(machines, &mut Vec::new()).unwrap();
    // Fail every other machine: a capped List of FAILED walks them all once before repeating.
    for i in (0..10).step_by(2) {
        let token = FenceToken {
            shard_id: String::new(),
            epoch: 0,
            sequence: 0,
        };
        let Ok(Admission::Accepted { operation_id, .. }) = inventory.admit(
            OperationKind::Create,
            &machine_id(i),
            &token,
            None,
            &mut Vec::new(),
        ) else {
            panic!("create {i} not accepted");
        };
        assert!(inventory.complete(
            &machine_id(i),
            OperationKind::Create,
            &operation_id,
            Err("x".into()),
            &mut Vec::new()
        ));
    }
    let failed = Selection {
        states: vec![MachineState::Failed],
        since: None,
        cap: 1,
    };
    let mut start = 7;
    let mut seen = Vec::new();
    for _ in 0..5 {
        let Selected { machines, visited } = inventory.select(&failed, start);
        assert_eq!(machines.len(), 1);
        seen.push(machines[0].id.clone());
        start = (start + visited) % inventory.len();
    }
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 5, "every FAILED machine once: {seen:?}");
}

#[test]
fn a_seed_without_change_records_builds_the_same_inventory() {
    let machines: Vec<Machine> = (0..50)
        .map(|i| Machine::speculative(machine_id(i), "cx22"))
        .collect();
    let mut recorded = Inventory::default();
    let mut changes = Vec::new();
    recorded.seed(machines.clone(), &mut changes).unwrap();
    assert_eq!(changes.len(), 51, "a record per slot and the counters");
    let mut unrecorded = Inventory::default();
    unrecorded.seed_unrecorded(machines.clone()).unwrap();
    assert_eq!(unrecorded.snapshot(), recorded.snapshot());
    unrecorded.slots.assert_indexes_exact();
    let ids: Vec<&str> = unrecorded.slots().map(|s| s.machine.id.as_str()).collect();
    let expected: Vec<&str> = machines.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(ids, expected, "slots keep the seed's order");
    let mut duplicate = machines;
    duplicate.push(Machine::speculative(machine_id(3), "cx22"));
    assert!(Inventory::default().seed_unrecorded(duplicate).is_err());
}

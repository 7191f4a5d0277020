//! Unit and property tests of the pure state rules (contract.md §3–§5, §7, §9, §10).

use super::*;
use crate::rules::lifecycle::OperationKind::{self, *};
use crate::rules::machine::{CapacityType, HostRef, Machine, MachineState};
use proptest::prelude::*;

fn seeded(n: usize) -> Inventory {
    let mut inv = Inventory::default();
    let machines = (0..n)
        .map(|i| {
            let mut m = Machine::speculative(format!("m-{i}"), "cx22");
            m.zone = "nbg1".into();
            m.capacity_type = CapacityType::OnDemand;
            m
        })
        .collect();
    inv.seed(machines, &mut Vec::new()).unwrap();
    inv
}

fn tok(shard: &str, epoch: i64, sequence: i64) -> FenceToken {
    FenceToken {
        shard_id: shard.into(),
        epoch,
        sequence,
    }
}

fn zero() -> FenceToken {
    tok("", 0, 0)
}

fn admit(
    inv: &mut Inventory,
    kind: OperationKind,
    id: &str,
    token: &FenceToken,
) -> Result<Admission, CoreError> {
    let binding = (kind == Configure).then(|| Binding {
        cluster: "c1".into(),
        shard_metadata: StringMap::from([("k".into(), "v".into())]),
        sealed: Some(std::sync::Arc::new(SealedConfigure {
            deadline_unix_ms: 1,
            sealed: b"sealed".to_vec(),
        })),
    });
    inv.admit(kind, id, token, binding, &mut Vec::new())
}

fn accepted_op(a: Result<Admission, CoreError>) -> String {
    match a {
        Ok(Admission::Accepted { operation_id, .. }) => operation_id,
        other => panic!("expected Accepted, got {other:?}"),
    }
}

fn settle(inv: &mut Inventory, id: &str, kind: OperationKind, op: &str) {
    let effect = Effect {
        host: (kind == Create).then(|| HostRef {
            provider: "p".into(),
            id: "h1".into(),
        }),
        ..Effect::default()
    };
    assert!(inv.complete(id, kind, op, Ok(effect), &mut Vec::new()));
}

fn state(inv: &Inventory, id: &str) -> MachineState {
    inv.get(id).unwrap().machine.state
}

#[test]
fn fence_runs_before_not_found_and_records_first_contact() {
    let mut inv = seeded(1);
    let err = admit(&mut inv, Create, "ghost", &tok("s", 1, 1)).unwrap_err();
    assert!(matches!(err, CoreError::UnknownMachine(_)));
    assert_eq!(
        inv.fence_mark("s", "ghost"),
        Some(HighWaterMark {
            epoch: 1,
            sequence: 1
        })
    );
    let err = admit(&mut inv, Create, "ghost", &tok("s", 1, 1)).unwrap_err();
    assert!(
        matches!(err, CoreError::Fenced { .. }),
        "replay at an unknown id is fenced: {err:?}"
    );
}

#[test]
fn passing_token_advances_the_mark_even_when_the_operation_fails() {
    let mut inv = seeded(1);
    let mut changes = Vec::new();
    let err = inv
        .admit(Drain, "m-0", &tok("s", 5, 1), None, &mut changes)
        .unwrap_err();
    assert!(matches!(
        err,
        CoreError::InvalidTransition {
            kind: Drain,
            state: MachineState::Speculative
        }
    ));
    assert!(
        changes.iter().any(|c| matches!(c, Change::PutFence { .. })),
        "the advance is persisted"
    );
    assert!(matches!(
        admit(&mut inv, Create, "m-0", &tok("s", 5, 1)),
        Err(CoreError::Fenced { .. })
    ));
    assert!(matches!(
        admit(&mut inv, Create, "m-0", &tok("s", 5, 2)),
        Ok(Admission::Accepted { .. })
    ));
}

#[test]
fn fence_runs_before_the_idempotent_short_circuit() {
    let mut inv = seeded(1);
    accepted_op(admit(&mut inv, Create, "m-0", &tok("s", 1, 2)));
    let err = admit(&mut inv, Create, "m-0", &tok("s", 1, 1)).unwrap_err();
    assert!(
        matches!(err, CoreError::Fenced { .. }),
        "a zombie learns nothing: {err:?}"
    );
}

#[test]
fn rejected_tokens_leave_the_mark_and_the_machine_untouched() {
    let mut inv = seeded(1);
    accepted_op(admit(&mut inv, Create, "m-0", &tok("s", 2, 2)));
    let before = inv.get("m-0").unwrap().clone();
    let mut changes = Vec::new();
    assert!(
        inv.admit(Create, "m-0", &tok("s", 1, 9), None, &mut changes)
            .is_err()
    );
    assert!(changes.is_empty());
    assert_eq!(inv.get("m-0").unwrap(), &before);
    assert_eq!(
        inv.fence_mark("s", "m-0"),
        Some(HighWaterMark {
            epoch: 2,
            sequence: 2
        })
    );
}

#[test]
fn zero_token_bypasses_fencing_and_records_nothing() {
    let mut inv = seeded(1);
    accepted_op(admit(&mut inv, Create, "m-0", &zero()));
    assert!(inv.fences.is_empty());
    // A non-zero token with an empty shard id is a real token under shard "".
    let _ = admit(&mut inv, Create, "m-0", &tok("", 1, 0));
    assert_eq!(
        inv.fence_mark("", "m-0"),
        Some(HighWaterMark {
            epoch: 1,
            sequence: 0
        })
    );
}

#[test]
fn fence_marks_are_per_shard_and_machine() {
    let mut inv = seeded(2);
    accepted_op(admit(&mut inv, Create, "m-0", &tok("s", 9, 9)));
    accepted_op(admit(&mut inv, Create, "m-1", &tok("s", 1, 1)));
    assert!(matches!(
        admit(&mut inv, Create, "m-0", &tok("other", 1, 1)),
        Ok(Admission::Retry { .. })
    ));
}

#[test]
fn retries_return_the_recorded_id_and_the_current_snapshot() {
    let mut inv = seeded(1);
    let op = accepted_op(admit(&mut inv, Create, "m-0", &tok("s", 1, 1)));
    let next_op = inv.next_op;
    match admit(&mut inv, Create, "m-0", &tok("s", 1, 2)).unwrap() {
        Admission::Retry {
            operation_id,
            machine,
        } => {
            assert_eq!(operation_id, op);
            assert_eq!(machine.state, MachineState::Creating);
        }
        other => panic!("{other:?}"),
    }
    settle(&mut inv, "m-0", Create, &op);
    match admit(&mut inv, Create, "m-0", &tok("s", 1, 3)).unwrap() {
        Admission::Retry {
            operation_id,
            machine,
        } => {
            assert_eq!(operation_id, op);
            assert_eq!(
                machine.state,
                MachineState::Idle,
                "current snapshot, already settled"
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(inv.next_op, next_op, "no new operation minted");
}

#[test]
fn a_new_cycle_mints_a_new_operation_id() {
    let mut inv = seeded(1);
    let first = accepted_op(admit(&mut inv, Create, "m-0", &zero()));
    settle(&mut inv, "m-0", Create, &first);
    let del = accepted_op(admit(&mut inv, Delete, "m-0", &zero()));
    settle(&mut inv, "m-0", Delete, &del);
    assert_eq!(state(&inv, "m-0"), MachineState::Speculative);
    assert!(inv.get("m-0").unwrap().machine.host.is_none());
    let second = accepted_op(admit(&mut inv, Create, "m-0", &zero()));
    assert_ne!(first, second);
}

#[test]
fn out_of_position_is_internal_with_the_reference_message() {
    let mut inv = seeded(1);
    let err = admit(&mut inv, Configure, "m-0", &zero()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "providerkit: invalid state transition: cannot configure a machine in state Speculative"
    );
    assert_eq!(err.code(), tonic::Code::Internal);
}

#[test]
fn failed_is_terminal_for_every_kind() {
    let mut inv = seeded(1);
    let op = accepted_op(admit(&mut inv, Create, "m-0", &zero()));
    assert!(inv.complete("m-0", Create, &op, Err("boom".into()), &mut Vec::new()));
    for kind in OperationKind::ALL {
        let err = admit(&mut inv, kind, "m-0", &zero()).unwrap_err();
        assert!(
            matches!(
                err,
                CoreError::InvalidTransition {
                    state: MachineState::Failed,
                    ..
                }
            ),
            "{kind}: {err:?}"
        );
    }
    assert_eq!(inv.get("m-0").unwrap().machine.last_error, "boom");
}

#[test]
fn binding_is_set_at_acceptance_kept_on_failure_and_cleared_by_drain() {
    let mut inv = seeded(2);
    for id in ["m-0", "m-1"] {
        let op = accepted_op(admit(&mut inv, Create, id, &zero()));
        settle(&mut inv, id, Create, &op);
    }
    match admit(&mut inv, Configure, "m-0", &zero()).unwrap() {
        Admission::Accepted { machine, .. } => {
            assert_eq!(machine.state, MachineState::Configuring);
            assert_eq!(machine.cluster, "c1");
            assert_eq!(machine.shard_metadata["k"], "v");
        }
        other => panic!("{other:?}"),
    }
    let op = inv
        .get("m-0")
        .unwrap()
        .operation(Configure)
        .unwrap()
        .to_owned();
    settle(&mut inv, "m-0", Configure, &op);
    let drain = accepted_op(admit(&mut inv, Drain, "m-0", &zero()));
    assert_eq!(
        inv.get("m-0").unwrap().machine.cluster,
        "c1",
        "Draining keeps the binding"
    );
    settle(&mut inv, "m-0", Drain, &drain);
    let m = &inv.get("m-0").unwrap().machine;
    assert!(m.cluster.is_empty() && m.shard_metadata.is_empty());
    // A failed configure keeps the binding on the FAILED record.
    let op = accepted_op(admit(&mut inv, Configure, "m-1", &zero()));
    inv.complete(
        "m-1",
        Configure,
        &op,
        Err("hook failed".into()),
        &mut Vec::new(),
    );
    assert_eq!(inv.get("m-1").unwrap().machine.cluster, "c1");
}

#[test]
fn stale_completions_are_discarded() {
    let mut inv = seeded(1);
    let op = accepted_op(admit(&mut inv, Create, "m-0", &zero()));
    let mut changes = Vec::new();
    assert!(!inv.complete(
        "m-0",
        Create,
        "op-unknown",
        Ok(Effect::default()),
        &mut changes
    ));
    assert!(!inv.complete("m-0", Configure, &op, Ok(Effect::default()), &mut changes));
    assert!(inv.complete("m-0", Create, &op, Err("timed out".into()), &mut changes));
    let rev = inv.revision();
    assert!(
        !inv.complete("m-0", Create, &op, Ok(Effect::default()), &mut changes),
        "late success after FAILED"
    );
    assert_eq!(state(&inv, "m-0"), MachineState::Failed);
    assert_eq!(inv.revision(), rev);
}

#[test]
fn create_effect_replaces_resources_only_when_given() {
    let mut inv = seeded(1);
    Arc::make_mut(&mut inv.slots.get_mut("m-0").unwrap().machine).resources =
        StringMap::from([("cpu".into(), "1".into())]);
    let op = accepted_op(admit(&mut inv, Create, "m-0", &zero()));
    let effect = Effect {
        host: Some(HostRef {
            provider: "p".into(),
            id: "7".into(),
        }),
        resources: StringMap::new(),
        allocatable: StringMap::from([("cpu".into(), "2".into())]),
    };
    assert!(inv.complete("m-0", Create, &op, Ok(effect), &mut Vec::new()));
    let m = &inv.get("m-0").unwrap().machine;
    assert_eq!(m.resources["cpu"], "1");
    assert_eq!(m.allocatable["cpu"], "2");
    assert_eq!(m.host.as_ref().unwrap().id, "7");
}

#[test]
fn every_change_bumps_the_revision_and_the_slot_mark() {
    let mut inv = seeded(2);
    let head = inv.revision();
    let op = accepted_op(admit(&mut inv, Create, "m-1", &zero()));
    assert_eq!(inv.revision(), head + 1);
    assert_eq!(inv.get("m-1").unwrap().last_change, head + 1);
    settle(&mut inv, "m-1", Create, &op);
    assert_eq!(inv.revision(), head + 2);
    assert!(inv.get("m-0").unwrap().last_change <= head);
}

#[test]
fn duplicate_seed_ids_are_rejected() {
    let mut inv = Inventory::default();
    let m = Machine::speculative("dup", "t");
    let err = inv.seed(vec![m.clone(), m], &mut Vec::new()).unwrap_err();
    assert_eq!(err, "backend Describe returned duplicate id \"dup\"");
    assert!(inv.is_empty());
}

#[test]
fn interrupted_transitions_resume_or_fail() {
    let mut inv = seeded(4);
    let create = accepted_op(admit(&mut inv, Create, "m-0", &zero()));
    for id in ["m-1", "m-2"] {
        let op = accepted_op(admit(&mut inv, Create, id, &zero()));
        settle(&mut inv, id, Create, &op);
    }
    accepted_op(admit(&mut inv, Configure, "m-1", &zero()));
    let delete = accepted_op(admit(&mut inv, Delete, "m-2", &zero()));
    let mut restarted = Inventory::from_snapshot(inv.snapshot());
    let mut changes = Vec::new();
    let mut resumed = restarted.recover_interrupted(
        |_| Some("configure transition interrupted by a provider restart; not sealed".into()),
        &mut changes,
    );
    resumed.sort_by(|a, b| a.machine_id.cmp(&b.machine_id));
    assert_eq!(
        resumed,
        vec![
            Interrupted {
                machine_id: "m-0".into(),
                kind: Create,
                operation_id: create
            },
            Interrupted {
                machine_id: "m-2".into(),
                kind: Delete,
                operation_id: delete
            },
        ]
    );
    let m1 = &restarted.get("m-1").unwrap().machine;
    assert_eq!(m1.state, MachineState::Failed);
    assert!(
        m1.last_error
            .starts_with("configure transition interrupted by a provider restart"),
        "{}",
        m1.last_error
    );
    assert!(!changes.is_empty());
}

#[test]
fn a_sealed_blob_lives_exactly_as_long_as_its_configure() {
    let mut inv = seeded(3);
    for id in ["m-0", "m-1", "m-2"] {
        let op = accepted_op(admit(&mut inv, Create, id, &zero()));
        settle(&mut inv, id, Create, &op);
    }
    let sealed_of = |inv: &Inventory, id: &str| inv.get(id).unwrap().sealed.is_some();
    // Accepted: the blob is in the same change as the acceptance.
    let expected = inv.next_operation_id();
    let mut changes = Vec::new();
    let binding = Binding {
        cluster: "c1".into(),
        shard_metadata: StringMap::new(),
        sealed: Some(std::sync::Arc::new(SealedConfigure {
            deadline_unix_ms: 1,
            sealed: b"sealed".to_vec(),
        })),
    };
    let op = accepted_op(inv.admit(Configure, "m-0", &zero(), Some(binding), &mut changes));
    assert_eq!(op, expected, "the peeked id is the one admission mints");
    assert!(
        changes
            .iter()
            .any(|c| matches!(c, Change::PutSlot(s) if s.sealed.is_some()))
    );
    assert!(sealed_of(&inv, "m-0"));
    // A retry keeps it; success forgets it in the completing change.
    let _ = admit(&mut inv, Configure, "m-0", &zero());
    assert!(sealed_of(&inv, "m-0"));
    let mut changes = Vec::new();
    assert!(inv.complete("m-0", Configure, &op, Ok(Effect::default()), &mut changes));
    assert!(!sealed_of(&inv, "m-0"));
    assert!(
        changes
            .iter()
            .all(|c| !matches!(c, Change::PutSlot(s) if s.sealed.is_some()))
    );
    // Failure forgets it too.
    let op = accepted_op(admit(&mut inv, Configure, "m-1", &zero()));
    assert!(inv.complete(
        "m-1",
        Configure,
        &op,
        Err("hook failed".into()),
        &mut Vec::new()
    ));
    assert!(!sealed_of(&inv, "m-1"));
    // A restart resumes a Configure the closure lets through, and fails one it does not.
    let resumable = accepted_op(admit(&mut inv, Configure, "m-2", &zero()));
    let mut restarted = Inventory::from_snapshot(inv.snapshot());
    let resumed = restarted.recover_interrupted(|_| None, &mut Vec::new());
    assert_eq!(
        resumed,
        vec![Interrupted {
            machine_id: "m-2".into(),
            kind: Configure,
            operation_id: resumable,
        }]
    );
    assert!(sealed_of(&restarted, "m-2"));
    let mut restarted = Inventory::from_snapshot(inv.snapshot());
    let resumed = restarted.recover_interrupted(|_| Some("no key".into()), &mut Vec::new());
    assert!(resumed.is_empty());
    let m2 = restarted.get("m-2").unwrap();
    assert_eq!(
        (m2.machine.state, m2.machine.last_error.as_str()),
        (MachineState::Failed, "no key")
    );
    assert!(m2.sealed.is_none(), "a FAILED slot keeps no blob");
}

fn machine(id: &str, state: MachineState, host: Option<&str>) -> Machine {
    let mut m = Machine::speculative(id, "cx22");
    m.zone = "nbg1".into();
    m.state = state;
    m.host = host.map(|h| HostRef {
        provider: "p".into(),
        id: h.into(),
    });
    m
}

#[test]
fn reconcile_without_changes_keeps_the_revision() {
    let mut inv = seeded(3);
    let fresh: Vec<Machine> = inv.slots().map(|s| (*s.machine).clone()).collect();
    let head = inv.revision();
    let mut changes = Vec::new();
    let survey = Survey {
        machines: fresh,
        hosts: None,
    };
    let now = tokio::time::Instant::now();
    let report = inv
        .reconcile(
            survey,
            None,
            head,
            now,
            std::time::Duration::MAX,
            &mut changes,
        )
        .report;
    assert!(!report.changed());
    assert_eq!(inv.revision(), head);
    assert!(changes.is_empty());
}

#[test]
fn reconcile_adds_refreshes_adopts_and_notices_vanished_hosts() {
    let mut inv = seeded(4);
    // m-1 Idle with host, m-2 Configured with host.
    for id in ["m-1", "m-2"] {
        let op = accepted_op(admit(&mut inv, Create, id, &zero()));
        settle(&mut inv, id, Create, &op);
    }
    let op = accepted_op(admit(&mut inv, Configure, "m-2", &zero()));
    settle(&mut inv, "m-2", Configure, &op);
    let mut m0 = machine("m-0", MachineState::Idle, Some("h9"));
    m0.price_per_hour = 0.5;
    let described = vec![
        m0,                                              // Speculative -> adopted
        machine("m-1", MachineState::Speculative, None), // host vanished
        machine("m-3", MachineState::Speculative, None), // unchanged
        machine("new", MachineState::Idle, Some("h10")), // unknown: added
    ];
    let head = inv.revision();
    let survey = Survey {
        machines: described,
        hosts: None,
    };
    let now = tokio::time::Instant::now();
    let outcome = inv.reconcile(
        survey,
        None,
        head,
        now,
        std::time::Duration::MAX,
        &mut Vec::new(),
    );
    let report = outcome.report;
    assert_eq!(report.added, 1);
    assert_eq!(report.adopted, 1);
    assert_eq!(report.refreshed, 1);
    assert_eq!(report.vanished, 0, "missing hosts are only suspects");
    assert_eq!(
        inv.confirm_vanished(&outcome.suspects, head, &mut Vec::new()),
        2,
        "m-1 (Idle) and m-2 (Configured) are proved gone, and wait for the shard's next action"
    );
    assert_eq!(state(&inv, "m-0"), MachineState::Idle);
    assert_eq!(inv.get("m-0").unwrap().machine.price_per_hour, 0.5);
    assert_eq!(
        state(&inv, "m-1"),
        MachineState::Idle,
        "no edge from Idle says so"
    );
    assert_eq!(state(&inv, "m-2"), MachineState::Configured);
    assert_eq!(state(&inv, "new"), MachineState::Idle);
    assert!(inv.revision() > head);
}

#[test]
fn quota_removes_only_unoffered_speculative_slots_without_host() {
    let mut inv = seeded(3);
    let op = accepted_op(admit(&mut inv, Create, "m-2", &zero()));
    settle(&mut inv, "m-2", Create, &op);
    let offered: HashSet<String> = ["m-0".to_owned()].into();
    let mut changes = Vec::new();
    assert_eq!(inv.enforce_quota(&offered, &mut changes), 1);
    assert!(inv.get("m-1").is_none());
    assert!(inv.get("m-2").is_some(), "a slot with a live host keeps it");
    assert!(changes.contains(&Change::RemoveSlot("m-1".into())));
}

#[test]
fn release_keeps_the_failed_id_and_gives_its_capacity_a_new_one() {
    let mut inv = seeded(2);
    let op = accepted_op(admit(&mut inv, Create, "m-0", &zero()));
    settle(&mut inv, "m-0", Create, &op);
    let op = accepted_op(admit(&mut inv, Configure, "m-0", &zero()));
    inv.complete("m-0", Configure, &op, Err("boom".into()), &mut Vec::new());
    let successor = inv.release("m-0", 1_000, &mut Vec::new()).unwrap();
    let old = inv.get("m-0").unwrap();
    assert_eq!(
        old.machine.state,
        MachineState::Failed,
        "Failed has no way out"
    );
    assert!(old.machine.host.is_none());
    assert!(
        old.machine.last_error.contains("boom")
            && old
                .machine
                .last_error
                .ends_with(&format!("comes back as machine {successor}")),
        "{}",
        old.machine.last_error
    );
    assert_eq!(
        old.retired.as_ref().map(|r| r.reason),
        Some(RetireReason::Released)
    );
    let new = &inv.get(&successor).unwrap().machine;
    assert_eq!(new.state, MachineState::Speculative);
    assert_ne!(successor, "m-0");
    assert!(new.host.is_none() && new.last_error.is_empty() && new.cluster.is_empty());
    assert_eq!(new.instance_type, old.machine.instance_type);
    assert!(
        matches!(inv.release("m-0", 1_000, &mut Vec::new()), Err(CoreError::Admin(m)) if m.contains("released already")),
        "a retired record is not released twice"
    );
    assert!(matches!(
        inv.release("m-1", 1_000, &mut Vec::new()),
        Err(CoreError::Admin(_))
    ));
    // The retired record leaves the state after its retention, not before.
    let mut changes = Vec::new();
    assert_eq!(
        inv.prune_retired(1_000 + RETIRED_RETENTION_SECONDS - 1, &mut changes),
        0
    );
    assert_eq!(
        inv.prune_retired(1_000 + RETIRED_RETENTION_SECONDS, &mut changes),
        1
    );
    assert!(inv.get("m-0").is_none());
    assert!(changes.contains(&Change::RemoveSlot("m-0".into())));
    assert!(inv.get(&successor).is_some());
}

#[test]
fn minted_ids_and_operation_ids_differ_between_two_states_with_the_same_counters() {
    let mut one = seeded(1);
    let mut two = seeded(1);
    let none = HashSet::new();
    assert!(one.ensure_series(&none, &mut Vec::new()));
    assert!(
        !one.ensure_series(&none, &mut Vec::new()),
        "a series is kept"
    );
    let taken: HashSet<u64> = [one.series()].into();
    assert!(two.ensure_series(&taken, &mut Vec::new()));
    assert_ne!(one.series(), two.series(), "a taken series is never drawn");
    assert_ne!(one.next_operation_id(), two.next_operation_id());
    let (a, b) = (
        one.mint_machine_id("p/OnDemand/t/z/000"),
        two.mint_machine_id("p/OnDemand/t/z/000"),
    );
    assert_ne!(a, b);
    assert!(a.starts_with("p/OnDemand/t/z/"), "{a}");
    assert_eq!(id_series(&a), Some(one.series()));
    assert_eq!(id_series(&one.next_operation_id()), Some(one.series()));
    // Within a state nothing repeats: ids and operation ids share one counter.
    let op = one.next_operation_id();
    let c = one.mint_machine_id("p/OnDemand/t/z/000");
    assert_ne!(c, a);
    assert_ne!(one.next_operation_id(), op);
    // The series survives a snapshot (the counter carries it).
    assert_eq!(
        Inventory::from_snapshot(one.snapshot()).series(),
        one.series()
    );
}

#[test]
fn snapshot_round_trip_keeps_everything() {
    let mut inv = seeded(3);
    let op = accepted_op(admit(&mut inv, Create, "m-0", &tok("s", 1, 1)));
    settle(&mut inv, "m-0", Create, &op);
    let copy = Inventory::from_snapshot(inv.snapshot());
    assert_eq!(copy.snapshot().slots, inv.snapshot().slots);
    assert_eq!(copy.fence_mark("s", "m-0"), inv.fence_mark("s", "m-0"));
    assert_eq!(copy.revision(), inv.revision());
    assert_eq!(copy.next_op, inv.next_op);
}

#[derive(Clone, Debug)]
enum Step {
    Admit(usize, u8, i64, i64),
    Succeed(usize),
    Fail(usize),
    Reload,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (0usize..3, 0u8..4, 0i64..3, 0i64..4).prop_map(|(m, k, e, s)| Step::Admit(m, k, e, s)),
        (0usize..3).prop_map(Step::Succeed),
        (0usize..3).prop_map(Step::Fail),
        Just(Step::Reload),
    ]
}

proptest! {
    /// Random walks: retries return the id recorded for (machine, kind), even across a store
    /// reload; minted ids never repeat; every reachable state/host pair is legal.
    #[test]
    fn idempotency_and_legal_states_hold_on_random_walks(steps in proptest::collection::vec(step(), 1..60)) {
        let mut inv = seeded(3);
        let mut minted = HashSet::new();
        for s in steps {
            match s {
                Step::Admit(m, k, e, q) => {
                    let id = format!("m-{m}");
                    let kind = OperationKind::ALL[k as usize];
                    let recorded = inv.get(&id).unwrap().operation(kind).map(str::to_owned);
                    match admit(&mut inv, kind, &id, &tok("s", e, q)) {
                        Ok(Admission::Accepted { operation_id, machine }) => {
                            prop_assert!(minted.insert(operation_id.clone()), "id {operation_id} repeated");
                            prop_assert_eq!(machine.state, kind.transitional());
                        }
                        Ok(Admission::Retry { operation_id, .. }) => {
                            prop_assert_eq!(Some(operation_id), recorded);
                        }
                        Err(_) => {}
                    }
                }
                Step::Succeed(m) | Step::Fail(m) => {
                    let id = format!("m-{m}");
                    let slot = inv.get(&id).unwrap().clone();
                    if let Some(kind) = OperationKind::of_transitional(slot.machine.state) {
                        let op = slot.operation(kind).unwrap().to_owned();
                        let outcome = if matches!(s, Step::Succeed(_)) {
                            Ok(Effect { host: (kind == Create).then(|| HostRef { provider: "p".into(), id: id.clone() }), ..Effect::default() })
                        } else {
                            Err("x".to_owned())
                        };
                        prop_assert!(inv.complete(&id, kind, &op, outcome, &mut Vec::new()));
                    }
                }
                Step::Reload => inv = Inventory::from_snapshot(inv.snapshot()),
            }
            for slot in inv.slots() {
                let m = &slot.machine;
                let has_host = m.host.is_some();
                let legal = match m.state {
                    MachineState::Speculative | MachineState::Creating => !has_host,
                    MachineState::Idle | MachineState::Configuring | MachineState::Configured
                    | MachineState::Draining | MachineState::Deleting => has_host,
                    MachineState::Failed => true,
                    MachineState::Unspecified => false,
                };
                prop_assert!(legal, "{} in {} with host={}", m.id, m.state, has_host);
                let bound = !m.cluster.is_empty();
                if matches!(m.state, MachineState::Speculative | MachineState::Creating | MachineState::Idle) {
                    prop_assert!(!bound, "{} bound while {}", m.id, m.state);
                }
            }
        }
    }
}

#[test]
fn an_enrollment_is_recorded_once_conflicts_for_good_and_is_forgotten_with_its_host() {
    let mut inv = seeded(1);
    let op = accepted_op(admit(&mut inv, Create, "m-0", &zero()));
    let enrollment = |digest: u8, host: &str, create: &str| Enrollment {
        host_id: host.into(),
        create_operation: create.into(),
        credential_digest: vec![digest],
        conflict: false,
        confirmed: false,
    };
    let mut changes = Vec::new();
    // A token of another Create is refused; while the Create runs the host is not known yet.
    assert!(
        inv.record_enrollment("m-0", enrollment(1, "h1", "op-999"), &mut changes)
            .is_err()
    );
    assert!(changes.is_empty());
    let revision = inv.revision();
    assert_eq!(
        inv.record_enrollment("m-0", enrollment(1, "h1", &op), &mut changes),
        Ok(EnrollVerdict::Enrolled)
    );
    assert_eq!(changes.len(), 1, "one durable change");
    assert_eq!(inv.revision(), revision, "nothing a shard sees moved");
    // The Create records the same host: the enrollment stays.
    settle(&mut inv, "m-0", Create, &op);
    assert!(inv.get("m-0").unwrap().enrollment.is_some());
    assert_eq!(
        inv.record_enrollment("m-0", enrollment(1, "h1", &op), &mut Vec::new()),
        Ok(EnrollVerdict::AlreadyEnrolled)
    );
    // Another credential is a conflict, and from then on so is the first one.
    assert_eq!(
        inv.record_enrollment("m-0", enrollment(2, "h1", &op), &mut Vec::new()),
        Ok(EnrollVerdict::Conflict)
    );
    assert!(
        inv.get("m-0")
            .unwrap()
            .enrollment
            .as_ref()
            .unwrap()
            .conflict
    );
    assert_eq!(
        inv.record_enrollment("m-0", enrollment(1, "h1", &op), &mut Vec::new()),
        Ok(EnrollVerdict::Conflict)
    );
    // Another host of the slot cannot enroll on this record.
    assert!(
        inv.record_enrollment("m-0", enrollment(3, "h2", &op), &mut Vec::new())
            .is_err()
    );
    // Delete forgets the host, and the enrollment with it.
    let delete = accepted_op(admit(&mut inv, Delete, "m-0", &zero()));
    settle(&mut inv, "m-0", Delete, &delete);
    assert!(inv.get("m-0").unwrap().enrollment.is_none());
}

/// A confirmed enrollment (its agent was handed a Configure's blob) is not cut off by a replay
/// of the spent token: the replay is refused and changes nothing, whatever state the machine
/// is in (here Idle); an enrollment of the earlier release, never confirmed, is not cut off
/// while its machine is Configured either.
#[test]
fn a_replay_after_confirmation_changes_nothing() {
    let mut inv = seeded(2);
    let enrollment = |digest: u8, create: &str, confirmed: bool| Enrollment {
        host_id: "h1".into(),
        create_operation: create.into(),
        credential_digest: vec![digest],
        conflict: false,
        confirmed,
    };
    let op = accepted_op(admit(&mut inv, Create, "m-0", &zero()));
    settle(&mut inv, "m-0", Create, &op);
    assert_eq!(
        inv.record_enrollment("m-0", enrollment(1, &op, false), &mut Vec::new()),
        Ok(EnrollVerdict::Enrolled)
    );
    // Confirmation is one durable change; a second one is none.
    let mut changes = Vec::new();
    assert_eq!(
        inv.record_enrollment("m-0", enrollment(1, &op, true), &mut changes),
        Ok(EnrollVerdict::AlreadyEnrolled)
    );
    assert_eq!(changes.len(), 1);
    let held = inv.get("m-0").unwrap().enrollment.clone().unwrap();
    assert!(held.confirmed && !held.conflict);
    let mut changes = Vec::new();
    assert_eq!(
        inv.record_enrollment("m-0", enrollment(1, &op, true), &mut changes),
        Ok(EnrollVerdict::AlreadyEnrolled)
    );
    assert!(changes.is_empty());
    // Another credential is a replay, however often, and changes nothing.
    for digest in [2, 3, 2] {
        let mut changes = Vec::new();
        assert_eq!(
            inv.record_enrollment("m-0", enrollment(digest, &op, false), &mut changes),
            Ok(EnrollVerdict::Replayed)
        );
        assert!(changes.is_empty());
    }
    assert_eq!(inv.get("m-0").unwrap().enrollment, Some(held.clone()));
    // The agent's own credential still answers as enrolled.
    assert_eq!(
        inv.record_enrollment("m-0", enrollment(1, &op, false), &mut Vec::new()),
        Ok(EnrollVerdict::AlreadyEnrolled)
    );

    // An unconfirmed enrollment on a Configured machine (the earlier release never confirmed).
    let op = accepted_op(admit(&mut inv, Create, "m-1", &zero()));
    settle(&mut inv, "m-1", Create, &op);
    assert_eq!(
        inv.record_enrollment("m-1", enrollment(1, &op, false), &mut Vec::new()),
        Ok(EnrollVerdict::Enrolled)
    );
    let configure = accepted_op(admit(&mut inv, Configure, "m-1", &zero()));
    settle(&mut inv, "m-1", Configure, &configure);
    assert_eq!(
        inv.get("m-1").unwrap().machine.state,
        MachineState::Configured
    );
    assert_eq!(
        inv.record_enrollment("m-1", enrollment(2, &op, false), &mut Vec::new()),
        Ok(EnrollVerdict::Replayed)
    );
    assert!(
        !inv.get("m-1")
            .unwrap()
            .enrollment
            .as_ref()
            .unwrap()
            .conflict
    );
}

#[test]
fn a_refused_create_ends_failed_and_its_capacity_comes_back_under_a_new_id() {
    let mut inv = Inventory::default();
    let mut changes = Vec::new();
    let mut m = Machine::speculative("p/OnDemand/cx22/nbg1/001", "cx22");
    m.zone = "nbg1".into();
    m.labels.insert("k".into(), "v".into());
    let mut m2 = m.clone();
    m2.id = "p/OnDemand/cx22/nbg1/002".into();
    inv.seed(vec![m, m2], &mut changes).expect("seed");
    let zero = FenceToken {
        shard_id: String::new(),
        epoch: 0,
        sequence: 0,
    };
    let op = |inv: &mut Inventory, id: &str| match inv
        .admit(OperationKind::Create, id, &zero, None, &mut Vec::new())
        .expect("admitted")
    {
        Admission::Accepted { operation_id, .. } => operation_id,
        other => panic!("{other:?}"),
    };
    let stockout = RetireReason::Stockout;
    let one = "p/OnDemand/cx22/nbg1/001";
    let first = op(&mut inv, one);
    assert!(
        inv.return_created(
            one,
            "op-other",
            stockout,
            "stockout: x".into(),
            5,
            &mut changes
        )
        .is_none()
    );
    let successor = inv
        .return_created(one, &first, stockout, "stockout: x".into(), 5, &mut changes)
        .expect("applied");
    let old = inv.get(one).expect("slot");
    assert_eq!(
        old.machine.state,
        MachineState::Failed,
        "Creating -> Failed"
    );
    assert_eq!(
        old.machine.last_error,
        format!("stockout: x; its capacity comes back as machine {successor}")
    );
    assert_eq!(old.retired.as_ref().map(|r| r.reason), Some(stockout));
    let new = &inv.get(&successor).expect("successor").machine;
    assert!(successor.starts_with("p/OnDemand/cx22/nbg1/") && successor != one);
    assert_eq!(new.state, MachineState::Speculative);
    assert_eq!(
        (new.zone.as_str(), new.labels.get("k").map(String::as_str)),
        ("nbg1", Some("v"))
    );
    assert!(
        inv.return_created(one, &first, stockout, "again".into(), 5, &mut changes)
            .is_none(),
        "stale"
    );
    // The old id takes no new Create: FAILED has no way out; the new one does.
    assert!(matches!(
        inv.admit(OperationKind::Create, one, &zero, None, &mut Vec::new()),
        Err(CoreError::InvalidTransition { .. })
    ));
    let again = op(&mut inv, &successor);
    assert_ne!(again, first);
    // A Create that recorded a host made something: FAILED, without a successor.
    let two = "p/OnDemand/cx22/nbg1/002";
    let second = op(&mut inv, two);
    let host = HostRef {
        provider: "p".into(),
        id: "9".into(),
    };
    inv.record_created_host(two, &second, host, &mut changes);
    let before = inv.len();
    assert_eq!(
        inv.return_created(
            two,
            &second,
            stockout,
            "stockout: y".into(),
            5,
            &mut changes
        ),
        Some(String::new())
    );
    assert_eq!(inv.len(), before, "no successor while the host is recorded");
    let kept = &inv.get(two).expect("slot");
    assert_eq!(kept.machine.state, MachineState::Failed);
    assert!(kept.retired.is_none());
    assert!(
        kept.machine
            .last_error
            .starts_with("create: host 9 is recorded for this Create")
            && kept.machine.last_error.ends_with("refused: stockout: y"),
        "{}",
        kept.machine.last_error
    );
}

#[test]
fn fitting_hides_the_spare_slots_above_the_cap_and_those_not_offered() {
    let mut inv = Inventory::default();
    let mut changes = Vec::new();
    inv.ensure_series(&HashSet::new(), &mut changes);
    let group = |instance: &str, count: usize, advertised: bool| {
        let mut shape = Machine::speculative(format!("p/OnDemand/{instance}/z/000"), instance);
        shape.zone = "z".into();
        OfferGroup {
            shape,
            count,
            advertised,
        }
    };
    let listed = |inv: &Inventory| -> Vec<String> {
        inv.listed_spare().map(|s| s.machine.id.clone()).collect()
    };
    let everything = Selection {
        states: Vec::new(),
        since: None,
        cap: usize::MAX,
    };
    let offer = vec![group("a", 4, true), group("b", 2, true)];
    let fitted = inv.fit_offered(&offer, Some(2), 0, &mut changes);
    assert_eq!((fitted.added, fitted.hidden, fitted.removed), (6, 4, 0));
    assert_eq!(inv.len(), 6, "hidden slots stay in the state");
    let kept = listed(&inv);
    assert_eq!(kept.len(), 2);
    assert_eq!(inv.select(&everything, 0).machines.len(), 2);
    assert!(
        kept.iter().all(|id| id.starts_with("p/OnDemand/a/z/")),
        "the oldest ids are kept: {kept:?}"
    );
    assert!(kept.iter().all(|id| id_series(id) == Some(inv.series())));
    assert!(!inv.fit_offered(&offer, Some(2), 0, &mut changes).changed());
    let head = inv.revision();
    let fitted = inv.fit_offered(&offer, Some(3), 0, &mut changes);
    assert_eq!((fitted.hidden, fitted.shown), (0, 1));
    let since = Selection {
        since: Some(head),
        ..everything.clone()
    };
    assert_eq!(
        inv.select(&since, 0).machines.len(),
        1,
        "a slot listed again shows in a delta List"
    );
    // b withdrawn: its slots are hidden, not removed.
    let withdrawn = vec![group("a", 4, true), group("b", 2, false)];
    let fitted = inv.fit_offered(&withdrawn, None, 0, &mut changes);
    assert_eq!(
        (fitted.hidden, fitted.shown, fitted.removed),
        (0, 1, 0),
        "b's slots were hidden by the cap already; the last of a is listed again"
    );
    assert_eq!(listed(&inv).len(), 4);
    assert_eq!(inv.hidden_count(), 2);
    // b no longer configured, a shrinks to 3: removed, the newest first.
    let newest_a = listed(&inv)
        .into_iter()
        .max_by(|x, y| slot_order(x).cmp(&slot_order(y)))
        .unwrap();
    let fitted = inv.fit_offered(&[group("a", 3, true)], None, 0, &mut changes);
    assert_eq!(fitted.removed, 3);
    assert_eq!(inv.len(), 3);
    assert!(inv.get(&newest_a).is_none());
    assert_eq!(inv.hidden_count(), 0);
    // A machine with a host holds its place: only the rest are spare.
    let id = listed(&inv)[0].clone();
    let zero = zero();
    let op = accepted_op(admit(&mut inv, Create, &id, &zero));
    settle(&mut inv, &id, Create, &op);
    assert!(
        !inv.fit_offered(&[group("a", 3, true)], None, 0, &mut changes)
            .changed()
    );
    let fitted = inv.fit_offered(&[group("a", 5, true)], None, 0, &mut changes);
    assert_eq!(fitted.added, 2);
    assert_eq!(listed(&inv).len(), 4);
    // A new price reaches every spare slot.
    let mut priced = group("a", 5, true);
    priced.shape.price_per_hour = 0.5;
    let fitted = inv.fit_offered(&[priced], None, 0, &mut changes);
    assert_eq!(fitted.refreshed, 4);
    assert!(inv.listed_spare().all(|s| s.machine.price_per_hour == 0.5));
}

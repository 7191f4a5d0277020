//! Tests of the reconcile rules under churn: no stale edits, vanished needs proof, every owned
//! host accounted for.

use std::collections::HashSet;
use std::time::Duration;

use tokio::time::Instant;

use super::*;
use crate::rules::fence::FenceToken;
use crate::rules::inventory::{Admission, Effect};
use crate::rules::lifecycle::OperationKind::{self, *};
use crate::rules::machine::CapacityType;

fn slot(id: &str) -> Machine {
    let mut m = Machine::speculative(id, "cx22");
    m.zone = "nbg1".into();
    m.capacity_type = CapacityType::OnDemand;
    m
}

fn seeded(ids: &[&str]) -> Inventory {
    let mut inv = Inventory::default();
    inv.seed(ids.iter().map(|id| slot(id)).collect(), &mut Vec::new())
        .unwrap();
    inv
}

fn host(id: &str) -> HostRef {
    HostRef {
        provider: "p".into(),
        id: id.into(),
    }
}

fn start(inv: &mut Inventory, kind: OperationKind, id: &str) -> String {
    let token = FenceToken {
        shard_id: String::new(),
        epoch: 0,
        sequence: 0,
    };
    match inv.admit(kind, id, &token, None, &mut Vec::new()) {
        Ok(Admission::Accepted { operation_id, .. }) => operation_id,
        other => panic!("expected Accepted, got {other:?}"),
    }
}

fn finish(
    inv: &mut Inventory,
    id: &str,
    kind: OperationKind,
    op: &str,
    outcome: Result<Option<&str>, &str>,
) {
    let outcome = outcome
        .map(|h| Effect {
            host: h.map(host),
            ..Effect::default()
        })
        .map_err(str::to_owned);
    assert!(inv.complete(id, kind, op, outcome, &mut Vec::new()));
}

/// An Idle machine on `host_id`.
fn idle_on(inv: &mut Inventory, id: &str, host_id: &str) {
    let op = start(inv, Create, id);
    finish(inv, id, Create, &op, Ok(Some(host_id)));
}

/// The listing a pass sees: `ids` as the offerings' Speculative slots, the given hosts on top.
fn listing(ids: &[&str], hosts: &[(&str, &str)]) -> Survey {
    let machines = ids
        .iter()
        .map(|id| {
            let mut m = slot(id);
            if let Some((_, h)) = hosts.iter().find(|(mid, _)| mid == id) {
                m.state = MachineState::Idle;
                m.host = Some(host(h));
            }
            m
        })
        .collect();
    Survey {
        machines,
        hosts: Some(
            hosts
                .iter()
                .map(|(m, h)| Sighting {
                    machine_id: (*m).into(),
                    host: host(h),
                })
                .collect(),
        ),
    }
}

fn pass(inv: &mut Inventory, survey: Survey, since: i64, now: Instant) -> ReconcileOutcome {
    inv.reconcile(
        survey,
        None,
        since,
        now,
        Duration::from_secs(60),
        &mut Vec::new(),
    )
}

fn get(inv: &Inventory, id: &str) -> Arc<Machine> {
    inv.get(id).unwrap().machine.clone()
}

/// Defect 1: a Delete that completes while a pass is reading the cloud is not undone by the
/// pass's stale listing (which still shows the host).
#[test]
fn a_delete_finished_during_the_listing_is_not_resurrected() {
    let mut inv = seeded(&["m-0", "m-1"]);
    idle_on(&mut inv, "m-0", "h1");
    let op = start(&mut inv, Delete, "m-0");
    // The pass begins reading; the listing still shows h1.
    let since = inv.revision();
    let stale = listing(&["m-0", "m-1"], &[("m-0", "h1")]);
    // Meanwhile the Delete completes.
    finish(&mut inv, "m-0", Delete, &op, Ok(None));
    let head = inv.revision();
    let outcome = pass(&mut inv, stale, since, Instant::now());
    let m = get(&inv, "m-0");
    assert_eq!(m.state, MachineState::Speculative, "{m:?}");
    assert!(m.host.is_none());
    assert_eq!(outcome.report.adopted, 0);
    assert_eq!(outcome.report.stale, 1);
    assert_eq!(inv.revision(), head, "nothing changed");
    // A Delete retried by the shard is still the same operation.
    let retried = inv.admit(
        Delete,
        "m-0",
        &FenceToken {
            shard_id: String::new(),
            epoch: 0,
            sequence: 0,
        },
        None,
        &mut Vec::new(),
    );
    assert!(
        matches!(&retried, Ok(Admission::Retry { operation_id, .. }) if *operation_id == op),
        "{retried:?}"
    );
}

/// Defect 1, second shape: the listing was taken after the Delete finished but the cloud still
/// lists the host (eventual consistency). A host the provider deleted is never adopted; it is an
/// orphan, deleted again once its grace period passes.
#[test]
fn a_host_the_provider_deleted_is_never_adopted() {
    let mut inv = seeded(&["m-0"]);
    idle_on(&mut inv, "m-0", "h1");
    let op = start(&mut inv, Delete, "m-0");
    finish(&mut inv, "m-0", Delete, &op, Ok(None));
    let t0 = Instant::now();
    let since = inv.revision();
    let outcome = pass(&mut inv, listing(&["m-0"], &[("m-0", "h1")]), since, t0);
    assert_eq!(get(&inv, "m-0").state, MachineState::Speculative);
    assert_eq!(outcome.report.adopted, 0);
    assert_eq!(outcome.report.orphans, 1);
    assert!(outcome.orphans_due.is_empty(), "within the grace period");
    let since = inv.revision();
    let later = t0 + Duration::from_secs(61);
    let outcome = pass(&mut inv, listing(&["m-0"], &[("m-0", "h1")]), since, later);
    assert_eq!(outcome.orphans_due.len(), 1);
    assert!(inv.still_orphan(&outcome.orphans_due[0]));
}

/// Defect 2: a host missing from one listing (a page skipped while hosts were deleted) is a
/// suspect; the machine changes only once the host is proved absent, and not at all if it
/// changed after the pass began.
#[test]
fn a_host_missing_from_a_listing_needs_proof() {
    let mut inv = seeded(&["m-0", "m-1"]);
    idle_on(&mut inv, "m-0", "h1");
    idle_on(&mut inv, "m-1", "h2");
    let op = start(&mut inv, Configure, "m-1");
    finish(&mut inv, "m-1", Configure, &op, Ok(None));
    let since = inv.revision();
    // h1 and h2 both skipped by a paged listing.
    let outcome = pass(
        &mut inv,
        listing(&["m-0", "m-1"], &[]),
        since,
        Instant::now(),
    );
    assert_eq!(
        get(&inv, "m-0").state,
        MachineState::Idle,
        "no change on a listing alone"
    );
    assert_eq!(get(&inv, "m-1").state, MachineState::Configured);
    assert_eq!(outcome.report.vanished, 0);
    assert_eq!(outcome.suspects.len(), 2);
    assert!(outcome.suspects.iter().all(|s| !s.absent_before));
    // The next pass sees them again: no longer suspects.
    let since = inv.revision();
    let outcome = pass(
        &mut inv,
        listing(&["m-0", "m-1"], &[("m-0", "h1"), ("m-1", "h2")]),
        since,
        Instant::now(),
    );
    assert!(outcome.suspects.is_empty());
    // Missing twice in a row: the second pass says so.
    let since = inv.revision();
    pass(
        &mut inv,
        listing(&["m-0", "m-1"], &[]),
        since,
        Instant::now(),
    );
    let outcome = pass(
        &mut inv,
        listing(&["m-0", "m-1"], &[]),
        since,
        Instant::now(),
    );
    assert!(outcome.suspects.iter().all(|s| s.absent_before));
    // A proof that arrives after m-1 changed does not touch it.
    let op = start(&mut inv, Drain, "m-1");
    let applied = inv.confirm_vanished(&outcome.suspects, since, &mut Vec::new());
    assert_eq!(
        applied, 1,
        "only m-0 is proved (m-1 changed); it stays Idle: the shard has no edge to say its host is gone"
    );
    assert_eq!(get(&inv, "m-0").state, MachineState::Idle);
    assert_eq!(get(&inv, "m-1").state, MachineState::Draining);
    finish(&mut inv, "m-1", Drain, &op, Ok(None));
}

/// A proved-absent Configured host leaves its machine Configured: BigFleet's shard has no edge
/// from Configured to Failed, so the Drain it sends next ends it.
#[test]
fn a_proved_absent_configured_host_leaves_its_machine_for_the_shard_to_drain() {
    let mut inv = seeded(&["m-0"]);
    idle_on(&mut inv, "m-0", "h1");
    let op = start(&mut inv, Configure, "m-0");
    finish(&mut inv, "m-0", Configure, &op, Ok(None));
    let since = inv.revision();
    let outcome = pass(&mut inv, listing(&["m-0"], &[]), since, Instant::now());
    assert_eq!(
        inv.confirm_vanished(&outcome.suspects, since, &mut Vec::new()),
        1
    );
    assert_eq!(get(&inv, "m-0").state, MachineState::Configured);
}

/// Defect 3: a Create that failed after its host existed leaves a FAILED slot without a host;
/// the next pass records the host on it (so it counts as FAILED-with-host and an admin release
/// deletes it), and the release never lets it be adopted again.
#[test]
fn a_host_left_by_a_failed_create_is_recorded_on_the_failed_machine() {
    let mut inv = seeded(&["m-0"]);
    let op = start(&mut inv, Create, "m-0");
    // Still Creating: the host is the Create's business, not an orphan.
    let since = inv.revision();
    let outcome = pass(
        &mut inv,
        listing(&["m-0"], &[("m-0", "h7")]),
        since,
        Instant::now(),
    );
    assert_eq!(outcome.report.orphans, 0);
    assert_eq!(get(&inv, "m-0").state, MachineState::Creating);
    finish(&mut inv, "m-0", Create, &op, Err("poll server: 429"));
    let since = inv.revision();
    let outcome = pass(
        &mut inv,
        listing(&["m-0"], &[("m-0", "h7")]),
        since,
        Instant::now(),
    );
    assert_eq!(outcome.report.attached, 1);
    assert_eq!(outcome.report.orphans, 0);
    let m = get(&inv, "m-0");
    assert_eq!(m.state, MachineState::Failed);
    assert_eq!(m.host, Some(host("h7")));
    assert_eq!(m.last_error, "poll server: 429", "the reason is kept");
    let successor = inv.release("m-0", 1_000, &mut Vec::new()).unwrap();
    assert!(inv.deleted_by_us("h7"));
    assert_eq!(get(&inv, &successor).state, MachineState::Speculative);
    let since = inv.revision();
    let outcome = pass(
        &mut inv,
        listing(&["m-0"], &[("m-0", "h7")]),
        since,
        Instant::now(),
    );
    assert_eq!(
        outcome.report.adopted, 0,
        "a released host is never adopted"
    );
    assert_eq!(
        get(&inv, "m-0").state,
        MachineState::Failed,
        "a released machine id stays FAILED"
    );
    assert!(get(&inv, "m-0").host.is_none());
}

/// A second host carrying a machine id that already has one is an orphan, due after the
/// grace period, and no longer one once it is recorded somewhere.
#[test]
fn a_second_host_for_a_machine_is_an_orphan_after_the_grace_period() {
    let mut inv = seeded(&["m-0"]);
    idle_on(&mut inv, "m-0", "h1");
    let t0 = Instant::now();
    let hosts = [("m-0", "h1"), ("m-0", "h2")];
    let since = inv.revision();
    let outcome = pass(&mut inv, listing(&["m-0"], &hosts), since, t0);
    assert_eq!(outcome.report.orphans, 1);
    assert!(outcome.orphans_due.is_empty());
    let outcome = pass(
        &mut inv,
        listing(&["m-0"], &hosts),
        since,
        t0 + Duration::from_secs(30),
    );
    assert!(
        outcome.orphans_due.is_empty(),
        "the grace runs from the first sighting"
    );
    let outcome = pass(
        &mut inv,
        listing(&["m-0"], &hosts),
        since,
        t0 + Duration::from_secs(60),
    );
    assert_eq!(
        outcome.orphans_due,
        vec![Sighting {
            machine_id: "m-0".into(),
            host: host("h2")
        }]
    );
    inv.orphan_deleted(&outcome.orphans_due[0], &mut Vec::new());
    assert!(inv.deleted_by_us("h2"));
    // Seen again (eventual consistency): the grace starts over, it is not adopted.
    let outcome = pass(
        &mut inv,
        listing(&["m-0"], &hosts),
        since,
        t0 + Duration::from_secs(61),
    );
    assert!(outcome.orphans_due.is_empty());
    assert_eq!(get(&inv, "m-0").host, Some(host("h1")));
}

/// Quota enforcement still removes only unoffered Speculative slots without a host.
#[test]
fn quota_still_applies_during_a_pass() {
    let mut inv = seeded(&["m-0", "m-1"]);
    let offered: HashSet<String> = ["m-0".to_owned()].into();
    let since = inv.revision();
    let outcome = inv.reconcile(
        listing(&["m-0"], &[]),
        Some(&offered),
        since,
        Instant::now(),
        Duration::from_secs(60),
        &mut Vec::new(),
    );
    assert_eq!(outcome.report.removed, 1);
    assert!(inv.get("m-1").is_none());
}

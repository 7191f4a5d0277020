//! A Create refused for a stockout or the account's limit (the fake cloud's knobs) over the
//! offerings-driven fleet: the machine id ends FAILED (retired) and its capacity comes back
//! under a new id, the offering's slots leave List at once but stay in the state (a Create on one from a shard that still holds it costs nothing),
//! a probe after the backoff brings them back, and the headroom caps what is listed. Paused
//! clock.

use std::time::Duration;

use super::test_support::{start_in_memory, zero};
use super::*;
use crate::provisioning::fake::FakeCloud;
use crate::provisioning::fleet::{Fleet, test_fleet};
use crate::provisioning::offerings::default_mix;
use crate::provisioning::stockout::StockoutBackoff;

const MIN: Duration = Duration::from_secs(60);

/// 16 slots: 4 of each of a/z1, b/z1, a/z2, b/z2.
async fn engine() -> (Arc<FakeCloud>, Arc<Fleet>, Arc<Engine>) {
    let (cloud, fleet) = test_fleet(default_mix(16, ["a", "b"], ["z1", "z2"]));
    let fleet = Arc::new(fleet.with_stockout_backoff(StockoutBackoff {
        first: 5 * MIN,
        max: 30 * MIN,
    }));
    let engine = start_in_memory(fleet.clone(), "test_stockout").await;
    (cloud, fleet, engine)
}

fn listed(engine: &Engine, instance_type: &str, zone: &str) -> Vec<Arc<Machine>> {
    listed_spare(engine)
        .into_iter()
        .filter(|m| m.instance_type == instance_type && m.zone == zone)
        .collect()
}

/// The machine once its transition ended (Get answers for a hidden slot too).
async fn settled(engine: &Engine, id: &str) -> Arc<Machine> {
    for _ in 0..10_000 {
        let m = engine.get(id).expect("the slot stays in the state");
        if !m.state.is_transitional() {
            return m;
        }
        tokio::task::yield_now().await;
    }
    panic!("{id} never settled");
}

/// A refused Create's machine: FAILED (Creating -> Failed, an edge BigFleet's shard has),
/// retired, without a host, with a `last_error` starting with `prefix` and naming the id its
/// capacity came back under, a Speculative slot of the same offering. Returns that id.
async fn returned(engine: &Engine, id: &str, prefix: &str) -> String {
    let m = settled(engine, id).await;
    assert_eq!(m.state, MachineState::Failed, "{m:?}");
    assert!(m.host.is_none());
    assert!(m.last_error.starts_with(prefix), "{}", m.last_error);
    let slot = engine.read().get(id).cloned().expect("kept");
    let successor = slot.retired.expect("retired").successor;
    assert!(
        m.last_error
            .ends_with(&format!("comes back as machine {successor}"))
    );
    let next = engine.get(&successor).expect("the successor exists");
    assert_eq!(next.state, MachineState::Speculative);
    assert_eq!(
        (next.instance_type.as_str(), next.zone.as_str()),
        (m.instance_type.as_str(), m.zone.as_str())
    );
    successor
}

/// A Speculative slot kept in the state but not listed.
fn hidden_spare(engine: &Engine) -> String {
    let inventory = engine.read();
    inventory
        .spare_speculative()
        .find(|s| inventory.is_hidden(&s.machine.id))
        .map(|s| s.machine.id.clone())
        .expect("a hidden slot")
}

/// The Speculative machines a full List shows.
fn listed_spare(engine: &Engine) -> Vec<Arc<Machine>> {
    engine
        .list(&ListQuery {
            states: vec![MachineState::Speculative],
            max_results: 0,
            since_revision: Vec::new(),
        })
        .machines
}

/// FAILED machines that lost capacity (retired records gave theirs back).
fn failed(engine: &Engine) -> usize {
    engine.failed().len()
}

/// Lets the offer watch run.
async fn quiesce() {
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_stockout_returns_the_slot_withdraws_the_offering_and_a_probe_brings_it_back() {
    let (cloud, _fleet, engine) = engine().await;
    cloud.set_sold_out("a", "z1", true);
    let slots = listed(&engine, "a", "z1");
    assert_eq!(slots.len(), 4);
    engine.create(&slots[0].id, zero()).await.expect("accepted");
    let next = returned(&engine, &slots[0].id, "stockout: ").await;
    quiesce().await;
    assert!(engine.read().is_hidden(&next), "kept, not listed");
    assert!(listed(&engine, "a", "z1").is_empty(), "withdrawn at once");
    assert_eq!(listed(&engine, "b", "z1").len(), 4, "other offerings stay");
    assert_eq!(cloud.create_calls(), 1);
    assert_eq!(failed(&engine), 0);

    // After the backoff the slots come back; the next Create probes, still sold out.
    tokio::time::sleep(5 * MIN).await;
    quiesce().await;
    let back = listed(&engine, "a", "z1");
    assert_eq!(back.len(), 4, "listed again after the backoff");
    engine.create(&back[1].id, zero()).await.expect("accepted");
    returned(&engine, &back[1].id, "stockout: ").await;
    quiesce().await;
    assert!(listed(&engine, "a", "z1").is_empty());
    assert_eq!(cloud.create_calls(), 2);

    // The cloud sells it again; the next probe (after a doubled backoff) makes a host.
    cloud.set_sold_out("a", "z1", false);
    tokio::time::sleep(5 * MIN).await;
    quiesce().await;
    assert!(
        listed(&engine, "a", "z1").is_empty(),
        "the second backoff is longer"
    );
    tokio::time::sleep(5 * MIN).await;
    quiesce().await;
    let back = listed(&engine, "a", "z1");
    assert_eq!(back.len(), 4);
    engine.create(&back[2].id, zero()).await.expect("accepted");
    let made = settled(&engine, &back[2].id).await;
    assert_eq!(made.state, MachineState::Idle);
    quiesce().await;
    assert_eq!(listed(&engine, "a", "z1").len(), 3, "the rest stay listed");
    assert_eq!(failed(&engine), 0);
}

#[tokio::test(start_paused = true)]
async fn a_create_on_a_withdrawn_offering_sends_nothing_and_returns_the_slot() {
    let (cloud, fleet, engine) = engine().await;
    let slots = listed(&engine, "a", "z1");
    cloud.set_sold_out("a", "z1", true);
    // A stockout the engine has not fitted yet (a shard that picked the slot before it left
    // List): withdraw behind the engine's back, then Create another slot of the offering.
    fleet.stockouts().stockout(
        "a",
        "z1",
        "resource_unavailable",
        tokio::time::Instant::now(),
        0.0,
        false,
    );
    engine.create(&slots[3].id, zero()).await.expect("accepted");
    returned(&engine, &slots[3].id, "stockout: ").await;
    assert_eq!(cloud.create_calls(), 0, "no request spent");
    quiesce().await;
    assert!(listed(&engine, "a", "z1").is_empty());
    assert_eq!(failed(&engine), 0);
}

#[tokio::test(start_paused = true)]
async fn a_burst_on_a_sold_out_offering_costs_a_bounded_number_of_calls() {
    let (cloud, _fleet, engine) = engine().await;
    cloud.set_sold_out("a", "z1", true);
    // For an hour, the shard creates every listed slot of the offering each 10 seconds.
    for _ in 0..360 {
        for slot in listed(&engine, "a", "z1") {
            let _ = engine.create(&slot.id, zero()).await;
        }
        tokio::time::sleep(Duration::from_secs(10)).await;
    }
    // At most one call per backoff (5, 10, 20 minutes, then 30), and the first burst's: the
    // Creates accepted before the first refusal reached the cloud.
    let calls = cloud.create_calls();
    assert!(calls <= 4 + 4, "{calls} create calls in an hour");
    assert_eq!(failed(&engine), 0);
}

#[tokio::test(start_paused = true)]
async fn the_account_limit_caps_the_speculative_slots_and_never_fails_a_machine() {
    let (cloud, fleet, engine) = engine().await;
    // A limit of 4 with 2 hosts held: 2 Speculative slots are listed.
    let all = listed(&engine, "a", "z1");
    for slot in &all[..2] {
        engine.create(&slot.id, zero()).await.expect("accepted");
        let m = settled(&engine, &slot.id).await;
        assert_eq!(m.state, MachineState::Idle);
    }
    cloud.set_host_limit(Some(4));
    fleet.read_account(MIN).await.expect("account read");
    quiesce().await;
    let spare = listed_spare(&engine);
    assert_eq!(spare.len(), 2, "{spare:?}");
    for slot in &spare {
        engine.create(&slot.id, zero()).await.expect("accepted");
        let m = settled(&engine, &slot.id).await;
        assert_eq!(m.state, MachineState::Idle);
    }
    quiesce().await;
    assert!(listed_spare(&engine).is_empty());
    // A Delete makes room for one; someone else takes it: the cloud refuses, the slot is not
    // burned.
    engine.delete(&all[0].id, zero()).await.expect("accepted");
    let m = settled(&engine, &all[0].id).await;
    assert_eq!(m.state, MachineState::Speculative);
    cloud.set_host_limit(Some(3));
    quiesce().await;
    let one = listed_spare(&engine);
    assert!(
        one.iter().any(|m| m.id == all[0].id),
        "the slot a Delete gave back stays listed until a shard can read it: {one:?}"
    );
    engine.create(&all[0].id, zero()).await.expect("accepted");
    returned(&engine, &all[0].id, "account limit: ").await;
    quiesce().await;
    assert!(listed_spare(&engine).iter().all(|m| m.id != all[0].id));
    // A slot hidden above the headroom, created by a shard that still holds it: no request.
    let calls = cloud.create_calls();
    let hidden = &hidden_spare(&engine);
    engine.create(hidden, zero()).await.expect("accepted");
    returned(&engine, hidden, "account limit: ").await;
    assert_eq!(cloud.create_calls(), calls, "no request spent");
    assert_eq!(failed(&engine), 0);
}

/// A shard that reconciles only incrementally (List since a revision) never learns that a slot
/// left List (BigFleet ADR-0004) and may Create on it: the Create is admitted, sends nothing
/// and returns the slot, which stays out of every List (full and delta) until the offering is
/// sold again; then a delta List shows it Speculative.
#[tokio::test(start_paused = true)]
async fn a_withdrawn_slot_is_hidden_from_full_and_delta_lists_and_a_create_on_it_costs_nothing() {
    let (cloud, _fleet, engine) = engine().await;
    let slots = listed(&engine, "a", "z1");
    let cursor = engine
        .list(&ListQuery {
            states: Vec::new(),
            max_results: 0,
            since_revision: Vec::new(),
        })
        .revision;
    cloud.set_sold_out("a", "z1", true);
    engine.create(&slots[0].id, zero()).await.expect("accepted");
    returned(&engine, &slots[0].id, "stockout: ").await;
    quiesce().await;
    assert_eq!(cloud.create_calls(), 1);
    let delta = |since: i64| {
        engine
            .list(&ListQuery {
                states: Vec::new(),
                max_results: 0,
                since_revision: since.to_string().into_bytes(),
            })
            .machines
    };
    assert!(
        delta(cursor)
            .iter()
            .all(|m| m.instance_type != "a" || m.zone != "z1" || m.state == MachineState::Failed),
        "a delta List leaves the withdrawn slots out, and shows the refused id's end"
    );
    // The incremental shard still holds slots[1] as Speculative and creates it.
    let ack = engine.create(&slots[1].id, zero()).await.expect("accepted");
    assert_eq!(ack.machine.state, MachineState::Creating);
    let next = returned(
        &engine,
        &slots[1].id,
        "stockout: offering a/z1 is withdrawn",
    )
    .await;
    assert_eq!(cloud.create_calls(), 1, "answered without a request");
    assert!(engine.read().is_hidden(&next));
    let capped = engine.list(&ListQuery {
        states: Vec::new(),
        max_results: 1,
        since_revision: Vec::new(),
    });
    assert_eq!(
        capped.machines.len(),
        1,
        "a capped List still fills its page"
    );
    let cursor = engine
        .list(&ListQuery {
            states: Vec::new(),
            max_results: 0,
            since_revision: Vec::new(),
        })
        .revision;
    assert!(delta(cursor).is_empty());
    let speculative = |m: &&Arc<Machine>| {
        m.instance_type == "a" && m.zone == "z1" && m.state == MachineState::Speculative
    };
    // Sold again: after the backoff the slots are listed again, and a delta List shows them.
    cloud.set_sold_out("a", "z1", false);
    tokio::time::sleep(5 * MIN).await;
    quiesce().await;
    let back = delta(cursor);
    assert_eq!(back.iter().filter(speculative).count(), 4, "{back:?}");
    assert!(
        back.iter()
            .all(|m| !slots[..2].iter().any(|s| s.id == m.id)),
        "the refused ids are never listed Speculative again"
    );
    assert_eq!(failed(&engine), 0);
}

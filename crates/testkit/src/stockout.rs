//! The stockout and account-limit scenarios both clouds run (the engine over the offerings-driven
//! fleet, the real client and the emulator): a sold-out offering, its return, an account limit
//! with room for two, a burst of 50 Creates, and a restart while withdrawn. What is cloud-neutral
//! about them lives here, with the same assertions for both; each cloud says how its emulator
//! sells out, limits and counts ([`Knobs`]).
//!
//! The backoffs are short and real (the client talks HTTP to the emulator, which a paused clock
//! would starve); every verdict is a count of requests or of machines, never a duration. The
//! timelines printed are the figures of a stockout as the cloud sees it.

use std::sync::Arc;
use std::time::Duration;

use crate::shard::EngineShards;
use provider_core::catalogue_refresh::Refresh;
use provider_core::cloud::Cloud;
use provider_core::fleet::{CapacityBook, Fleet, PriceBook};
use provider_core::offerings::Offering;
use provider_core::stockout::StockoutBackoff;
use provider_core::store::SharedStore;
use provider_core::telemetry::Telemetry;
use provider_core::{Engine, EngineOptions, ListQuery, Machine, MachineState, StringMap};
use tokio::time::Instant;

use crate::engine::{offering, zero_token};
use crate::wait::until;

/// How one cloud's emulator sells out, limits and counts.
pub trait Knobs: Send + Sync {
    /// The real client over the emulator.
    fn cloud(&self) -> Arc<dyn Cloud>;
    /// The provider instance the client was made for (the slots' ids carry it).
    fn provider(&self) -> &str;
    /// Sells `instance_type` out in `zone` (the create answer and the catalogue's flag), or
    /// sells it again.
    fn sell_out(&self, instance_type: &str, zone: &str, sold_out: bool);
    /// The account's host limit (`None`: none).
    fn set_limit(&self, limit: Option<u64>);
    /// Create requests the emulator has seen (refused ones included).
    fn create_requests(&self) -> usize;
    /// Every request the emulator has seen.
    fn requests(&self) -> usize;
    /// Whether the cloud reports its limit (DigitalOcean's `droplet_limit`); otherwise it is
    /// learned from a refusal (Hetzner).
    fn limit_api(&self) -> bool;
}

/// The backoff of the scenarios: short, so a probe comes within a test.
pub const BACKOFF: StockoutBackoff = StockoutBackoff {
    first: Duration::from_millis(300),
    max: Duration::from_millis(1200),
};

/// A fleet of `offerings` over the cloud, with [`BACKOFF`], and an engine over it on `store`.
pub async fn start(
    knobs: &dyn Knobs,
    offerings: Vec<Offering>,
    store: SharedStore,
    telemetry: Telemetry,
) -> (Arc<Fleet>, Arc<Engine>) {
    start_with(knobs, offerings, store, telemetry, BACKOFF).await
}

/// [`start`] with `backoff`.
pub async fn start_with(
    knobs: &dyn Knobs,
    offerings: Vec<Offering>,
    store: SharedStore,
    telemetry: Telemetry,
    backoff: StockoutBackoff,
) -> (Arc<Fleet>, Arc<Engine>) {
    let fleet = Arc::new(
        Fleet::new(
            knobs.cloud(),
            knobs.provider(),
            offerings,
            Arc::new(PriceBook::new(|_, _| Some(0.01))),
            Arc::new(CapacityBook::new(|_| None)),
            |_| StringMap::new(),
        )
        .with_stockout_backoff(backoff)
        .with_telemetry(telemetry),
    );
    let engine = Engine::start(fleet.clone(), store, EngineOptions::new(telemetry))
        .await
        .unwrap();
    (fleet, engine)
}

fn memory() -> SharedStore {
    Arc::new(provider_core::store::MemoryStore)
}

/// The Speculative slots a full List shows, of `instance_type` in `zone` (`None`: all).
pub fn listed(engine: &Engine, of: Option<(&str, &str)>) -> Vec<Arc<Machine>> {
    engine
        .list(&ListQuery {
            states: vec![MachineState::Speculative],
            max_results: 0,
            since_revision: Vec::new(),
        })
        .machines
        .into_iter()
        .filter(|m| of.is_none_or(|(t, z)| m.instance_type == t && m.zone == z))
        .collect()
}

/// The machine once its transition ended.
pub async fn settled(engine: &Engine, id: &str) -> Arc<Machine> {
    until(&format!("{id} settles"), Duration::from_secs(60), || {
        engine.get(id).is_ok_and(|m| !m.state.is_transitional())
    })
    .await;
    engine.get(id).unwrap()
}

/// Asserts the refused Create of `id` ended as BigFleet's shard can follow: FAILED (Creating ->
/// Failed), retired, without a host, its `last_error` starting `prefix` and naming the id its
/// capacity came back under, a Speculative slot of the same offering. Returns that id.
pub async fn returned(engine: &Engine, id: &str, prefix: &str) -> String {
    let m = settled(engine, id).await;
    assert_eq!(m.state, MachineState::Failed, "{m:?}");
    assert!(m.host.is_none(), "{m:?}");
    assert!(m.last_error.starts_with(prefix), "{}", m.last_error);
    let successor = m
        .last_error
        .rsplit_once("comes back as machine ")
        .map(|(_, id)| id.to_owned())
        .unwrap_or_else(|| panic!("no successor named: {}", m.last_error));
    let next = engine.get(&successor).expect("the successor exists");
    assert_eq!(next.state, MachineState::Speculative, "{next:?}");
    assert_eq!(
        (next.instance_type.as_str(), next.zone.as_str()),
        (m.instance_type.as_str(), m.zone.as_str())
    );
    successor
}

/// FAILED machines that cost capacity (the retired records of refused Creates gave theirs back
/// under new ids and are left out).
pub fn failed(engine: &Engine) -> Vec<Arc<Machine>> {
    engine.failed()
}

fn ms(t0: Instant) -> u128 {
    t0.elapsed().as_millis()
}

/// A stockout: the Create's machine ends FAILED and its capacity comes back under a new id, the offering leaves List
/// at once (the other stays), a Create on a withdrawn slot sends nothing; after the backoff a
/// probe (still sold out) withdraws it again; sold again, the next probe makes a host. Prints
/// the timeline and the requests it cost.
pub async fn a_stockout_and_its_return(
    knobs: &dyn Knobs,
    sold: (&str, &str),
    other: (&str, &str),
    telemetry: Telemetry,
) {
    let (_fleet, engine) = start(
        knobs,
        vec![offering(sold.0, sold.1, 4), offering(other.0, other.1, 2)],
        memory(),
        telemetry,
    )
    .await;
    let mut shards = EngineShards::new();
    shards.reconcile(&engine);
    knobs.sell_out(sold.0, sold.1, true);
    let slots = listed(&engine, Some(sold));
    assert_eq!(slots.len(), 4);
    let (creates, requests) = (knobs.create_requests(), knobs.requests());
    let t0 = Instant::now();
    let all: Vec<&str> = slots.iter().map(|m| m.id.as_str()).collect();
    shards.timeline(&engine, "start", &all);
    shards.create(&engine, &slots[0].id).await.unwrap();
    shards.timeline(&engine, "Create of the first, answered", &all[..1]);
    let first_successor = returned(&engine, &slots[0].id, "stockout: ").await;
    shards.reconcile(&engine);
    let mut tracked = all.clone();
    tracked.push(&first_successor);
    shards.timeline(&engine, "refused: withdrawn, a new id hidden", &tracked);
    let refused_at = ms(t0);
    assert!(listed(&engine, Some(sold)).is_empty(), "withdrawn at once");
    assert_eq!(listed(&engine, Some(other)).len(), 2, "the other stays");
    assert_eq!(knobs.create_requests() - creates, 1);
    let first_cost = knobs.requests() - requests;
    // A shard that still holds another slot creates it: no request, no machine lost.
    shards.create(&engine, &slots[1].id).await.unwrap();
    returned(&engine, &slots[1].id, "stockout: offering").await;
    assert_eq!(knobs.create_requests() - creates, 1, "nothing sent");
    shards.get(&engine, &slots[1].id);
    shards.reconcile(&engine);
    shards.timeline(
        &engine,
        "a Create on a hidden slot, answered without a request",
        &tracked,
    );

    // After the backoff the slots come back; the probe is refused again.
    until("listed after the backoff", Duration::from_secs(30), || {
        listed(&engine, Some(sold)).len() == 4
    })
    .await;
    let back_at = ms(t0);
    shards.reconcile(&engine);
    let back: Vec<String> = listed(&engine, Some(sold))
        .iter()
        .map(|m| m.id.clone())
        .collect();
    let back_ids: Vec<&str> = back.iter().map(String::as_str).collect();
    shards.timeline(&engine, "the backoff ended: listed again", &back_ids);
    let probe = listed(&engine, Some(sold)).remove(2);
    shards.create(&engine, &probe.id).await.unwrap();
    returned(&engine, &probe.id, "stockout: ").await;
    shards.reconcile(&engine);
    shards.timeline(&engine, "the probe refused again", &[probe.id.as_str()]);
    let probed_at = ms(t0);
    assert!(listed(&engine, Some(sold)).is_empty(), "withdrawn again");
    assert_eq!(knobs.create_requests() - creates, 2);

    // Sold again: the next probe makes a host, and the offering stays listed.
    knobs.sell_out(sold.0, sold.1, false);
    until(
        "listed after the second backoff",
        Duration::from_secs(30),
        || listed(&engine, Some(sold)).len() == 4,
    )
    .await;
    let returned_at = ms(t0);
    shards.reconcile(&engine);
    let restocked: Vec<String> = listed(&engine, Some(sold))
        .iter()
        .map(|m| m.id.clone())
        .collect();
    let restocked_ids: Vec<&str> = restocked.iter().map(String::as_str).collect();
    shards.timeline(&engine, "sold again: restocked", &restocked_ids);
    let slot = listed(&engine, Some(sold)).remove(0);
    shards.create(&engine, &slot.id).await.unwrap();
    let made = settled(&engine, &slot.id).await;
    assert_eq!(made.state, MachineState::Idle, "{made:?}");
    assert!(made.host.is_some());
    assert_eq!(listed(&engine, Some(sold)).len(), 3);
    assert!(failed(&engine).is_empty());
    shards.reconcile(&engine);
    shards.timeline(&engine, "the next Create made a host", &restocked_ids);
    shards.verdict(&engine).unwrap();
    eprintln!(
        "stockout timeline: Create at t0; refused and withdrawn at +{refused_at} ms ({first_cost} \
         requests); backoff ended at +{back_at} ms; probe refused at +{probed_at} ms; sold again, \
         listed at +{returned_at} ms; host made at +{} ms; create requests {} (of {} requests in \
         all) for 3 Creates, 0 FAILED",
        ms(t0),
        knobs.create_requests() - creates,
        knobs.requests() - requests,
    );
}

/// The catalogue's availability flag turning back on brings a withdrawn offering back at
/// once, before its backoff ends.
pub async fn the_catalogue_flag_ends_a_withdrawal(
    knobs: &dyn Knobs,
    sold: (&str, &str),
    telemetry: Telemetry,
) {
    // The default backoff (5 minutes): only the flag can bring it back within the test.
    let (fleet, engine) = start_with(
        knobs,
        vec![offering(sold.0, sold.1, 3)],
        memory(),
        telemetry,
        StockoutBackoff::default(),
    )
    .await;
    let mut shards = EngineShards::new();
    shards.reconcile(&engine);
    knobs.sell_out(sold.0, sold.1, true);
    let slot = listed(&engine, Some(sold)).remove(0);
    shards.create(&engine, &slot.id).await.unwrap();
    returned(&engine, &slot.id, "stockout: ").await;
    shards.reconcile(&engine);
    assert!(listed(&engine, Some(sold)).is_empty());
    // The catalogue says so too; then it sells the type again.
    let refresh = || provider_core::catalogue_refresh::refresh(&fleet, Duration::from_secs(10));
    assert_eq!(refresh().await, Refresh::Done);
    assert!(fleet.withdrawn(sold.0, sold.1).is_some());
    assert!(listed(&engine, Some(sold)).is_empty());
    knobs.sell_out(sold.0, sold.1, false);
    assert_eq!(refresh().await, Refresh::Done);
    assert_eq!(fleet.withdrawn(sold.0, sold.1), None);
    until("listed again by the flag", Duration::from_secs(10), || {
        listed(&engine, Some(sold)).len() == 3
    })
    .await;
    assert!(fleet.stockouts().all().is_empty());
    assert!(failed(&engine).is_empty());
    shards.verdict(&engine).unwrap();
}

/// An account limit of `n` with `n - 2` hosts held: no Create ends FAILED, and once the limit
/// is known List advertises at most the two that fit (read from the API where the cloud reports
/// it; learned from the refusal where not), then none; a Create on a slot above the headroom
/// sends nothing.
pub async fn an_account_limit_with_room_for_two(
    knobs: &dyn Knobs,
    at: (&str, &str),
    n: u64,
    telemetry: Telemetry,
) {
    let (fleet, engine) = start(knobs, vec![offering(at.0, at.1, 8)], memory(), telemetry).await;
    let mut shards = EngineShards::new();
    shards.reconcile(&engine);
    let slots = listed(&engine, Some(at));
    for slot in &slots[..(n - 2) as usize] {
        shards.create(&engine, &slot.id).await.unwrap();
        assert_eq!(settled(&engine, &slot.id).await.state, MachineState::Idle);
    }
    knobs.set_limit(Some(n));
    if knobs.limit_api() {
        fleet.read_account(Duration::from_secs(10)).await.unwrap();
        until("capped to the headroom", Duration::from_secs(10), || {
            listed(&engine, None).len() == 2
        })
        .await;
    }
    // The shard creates what it sees (on a cloud without a limits API: more than fits).
    let spare = listed(&engine, None);
    assert!(knobs.limit_api() == (spare.len() == 2), "{}", spare.len());
    for slot in &spare {
        shards.create(&engine, &slot.id).await.unwrap();
    }
    let mut idle = 0;
    for slot in &spare {
        let m = settled(&engine, &slot.id).await;
        match m.state {
            MachineState::Idle => idle += 1,
            MachineState::Failed => {
                returned(&engine, &slot.id, "account limit: ").await;
            }
            _ => panic!("{m:?}"),
        }
    }
    assert_eq!(idle, 2, "two fit");
    until("no headroom left", Duration::from_secs(10), || {
        listed(&engine, None).is_empty()
    })
    .await;
    assert_eq!(fleet.headroom().headroom(), Some(0));
    shards.reconcile(&engine);
    // A slot above the headroom, created by a shard that still holds it: nothing is sent.
    let creates = knobs.create_requests();
    let hidden = engine.hidden().pop().expect("a slot above the headroom");
    shards.create(&engine, &hidden).await.unwrap();
    returned(&engine, &hidden, "account limit: ").await;
    assert_eq!(knobs.create_requests(), creates);
    assert!(failed(&engine).is_empty(), "{:?}", failed(&engine));
    // A Delete makes room for one.
    let idle_one = slots[0].id.clone();
    let answer = engine.delete(&idle_one, zero_token()).await;
    shards.answer(false, &idle_one, &answer);
    assert_eq!(
        settled(&engine, &idle_one).await.state,
        MachineState::Speculative
    );
    until("room for one", Duration::from_secs(10), || {
        listed(&engine, None).len() == 1
    })
    .await;
    assert_eq!(
        listed(&engine, None)[0].id,
        idle_one,
        "the slot the Delete gave back is the one listed, under its id (Deleting -> Speculative)"
    );
    shards.verdict(&engine).unwrap();
}

/// Creates every slot of `slots` as a shard does, then waits for each refusal.
async fn burst(engine: &Arc<Engine>, shards: &mut EngineShards, slots: Vec<Arc<Machine>>) {
    for slot in &slots {
        shards.create(engine, &slot.id).await.unwrap();
    }
    for slot in &slots {
        returned(engine, &slot.id, "stockout: ").await;
    }
    shards.reconcile(engine);
}

/// A burst of 50 Creates on a sold-out offering, then a burst on every slot listed each time
/// its backoff ends: the first burst sends what was admitted before the first refusal came
/// back, each later one exactly one probe. Returns the create requests of the first burst.
pub async fn repeated_bursts_on_a_sold_out_offering(
    knobs: &dyn Knobs,
    sold: (&str, &str),
    rounds: usize,
    telemetry: Telemetry,
) -> usize {
    let (_fleet, engine) = start(
        knobs,
        vec![offering(sold.0, sold.1, 50)],
        memory(),
        telemetry,
    )
    .await;
    knobs.sell_out(sold.0, sold.1, true);
    let mut shards = EngineShards::new();
    shards.reconcile(&engine);
    let creates = knobs.create_requests();
    let slots = listed(&engine, Some(sold));
    assert_eq!(slots.len(), 50);
    burst(&engine, &mut shards, slots).await;
    let first = knobs.create_requests() - creates;
    for round in 1..=rounds {
        until("listed after the backoff", Duration::from_secs(30), || {
            listed(&engine, Some(sold)).len() == 50
        })
        .await;
        shards.reconcile(&engine);
        burst(&engine, &mut shards, listed(&engine, Some(sold))).await;
        assert_eq!(
            knobs.create_requests() - creates,
            first + round,
            "one probe per backoff"
        );
    }
    shards.verdict(&engine).unwrap();
    assert!(failed(&engine).is_empty());
    eprintln!(
        "burst of 50 Creates on a sold-out offering: {first} create requests; {rounds} later \
         bursts of 50: one probe each; {} create requests for {} Creates",
        knobs.create_requests() - creates,
        50 * (rounds + 1)
    );
    first
}

/// A restart while the offering is withdrawn, on a durable state: the withdrawal is kept in
/// memory only, so the restarted provider lists the slots again and learns the stockout again
/// from one refused Create, with no machine losing capacity; the machine refused before the
/// restart is FAILED (retired) in the state it loaded, its capacity under a new id.
pub async fn a_restart_while_withdrawn(
    knobs: &dyn Knobs,
    sold: (&str, &str),
    state: &std::path::Path,
    telemetry: Telemetry,
) {
    let store =
        || -> SharedStore { Arc::new(provider_core::durable::DurableStore::open(state).unwrap()) };
    let (fleet, engine) = start(knobs, vec![offering(sold.0, sold.1, 3)], store(), telemetry).await;
    let mut shards = EngineShards::new();
    shards.reconcile(&engine);
    knobs.sell_out(sold.0, sold.1, true);
    let slot = listed(&engine, Some(sold)).remove(0);
    shards.create(&engine, &slot.id).await.unwrap();
    returned(&engine, &slot.id, "stockout: ").await;
    assert!(listed(&engine, Some(sold)).is_empty());
    engine.shutdown(Duration::from_secs(5)).await;
    drop((fleet, engine));

    let creates = knobs.create_requests();
    let (_fleet, engine) =
        start(knobs, vec![offering(sold.0, sold.1, 3)], store(), telemetry).await;
    let before = engine.get(&slot.id).unwrap();
    assert_eq!(
        before.state,
        MachineState::Failed,
        "the refused id stays FAILED"
    );
    assert!(before.last_error.starts_with("stockout: "));
    shards.reconcile(&engine);
    let again = listed(&engine, Some(sold));
    assert_eq!(again.len(), 3, "not remembered: listed again");
    shards.create(&engine, &again[1].id).await.unwrap();
    returned(&engine, &again[1].id, "stockout: ").await;
    assert!(listed(&engine, Some(sold)).is_empty(), "learned again");
    assert_eq!(
        knobs.create_requests() - creates,
        1,
        "one request to learn it"
    );
    assert!(failed(&engine).is_empty());
    shards.verdict(&engine).unwrap();
}

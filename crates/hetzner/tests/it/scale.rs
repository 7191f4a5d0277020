//! The API budget at fleet sizes a project can hold, against the emulator's real Hetzner
//! limit (time-scaled): a burst of 200 Creates beside 1,000 servers already owned meets no 429
//! and sends one POST per Create, with a reconcile survey running beside it (its time against
//! the budget time is a figure here, measured by the bench); at 10,000 owned servers an hour of the provider's
//! reconcile loop (paced surveys, out-of-band checks between them) stays within the reconcile
//! share and meets no 429.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use hcloud_emulator::RateLimit;
use hetzner::{catalog, labels};
use provider_core::budget::{self, Class};
use provider_core::fleet::{CapacityBook, PriceBook};
use provider_core::machine::MachineState;
use testkit::engine::{
    SteadyHour, offering, over_fleet, reconcile_a_steady_hour, until_all_idle, zero_token,
};
use tokio::time::Instant;

use crate::harness::{Env, Options, PROVIDER};

/// Time runs this many times faster for the emulator's bucket and the client's budget alike
/// (the steady state runs faster still: an hour in 9 s).
const SCALE: f64 = 100.0;
const STEADY_SCALE: f64 = 400.0;

fn scaled(seconds: f64) -> Duration {
    testkit::time::scaled(seconds, SCALE)
}

async fn env(prefix: &'static str, scale: f64) -> Env {
    let env = Env::new(Options {
        ssh: false,
        telemetry_prefix: prefix,
        api_time_scale: scale,
        running_poll: Some(Duration::from_secs_f64(3.0 / scale)),
        // Pages of 10,000 servers from a debug-built emulator on a busy machine.
        request_timeout: Duration::from_secs(30),
        // The 200 pages of 10,000 servers get the provider's default listing budget.
        list_budget: Some(hetzner::cloud::Timing::default().list_budget),
        ..Options::default()
    })
    .await;
    testkit::hcloud::time_scaled(&env.emulator, scale, 12.0);
    env
}

/// Servers of the first `owned` slots, as an earlier run of this instance left them.
fn insert_owned(env: &Env, owned: i64) {
    for i in 0..owned {
        let machine = env.machine("cx23", "nbg1", i);
        let mut server_labels = HashMap::from([(labels::MANAGED.to_owned(), "true".to_owned())]);
        server_labels.extend(labels::machine_id_labels(&machine.id));
        server_labels.extend(labels::text_labels(labels::PROVIDER, PROVIDER));
        env.emulator.insert_server(
            &labels::server_name(&machine.id),
            "cx23",
            "nbg1",
            server_labels,
            "192.0.2.10",
        );
    }
}

async fn engine(env: &Env, count: i64) -> Arc<provider_core::Engine> {
    let mut options = provider_core::EngineOptions::new(env.telemetry);
    options.timeouts.create = Duration::from_secs(120);
    over_fleet(
        env.cloud.clone(),
        PROVIDER,
        offering("cx23", "nbg1", count),
        PriceBook::new(|t, _| catalog::pinned_price_eur(t).map(|eur| eur * 1.25)),
        CapacityBook::new(catalog::pinned_capacity),
        options,
    )
    .await
}

fn total(env: &Env) -> usize {
    env.emulator
        .requests_by_class()
        .values()
        .map(|(n, _)| n)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_creates_beside_a_thousand_owned_servers_meet_no_429_with_one_post_each() {
    let env = env("bigfleet_hetzner_it_scale_burst", SCALE).await;
    insert_owned(&env, 1_000);
    let engine = engine(&env, 1_200).await;
    let owned = (0..1_000)
        .filter(|i| {
            let id = env.machine("cx23", "nbg1", *i).id;
            engine.get(&id).is_ok_and(|m| m.state == MachineState::Idle)
        })
        .count();
    assert_eq!(owned, 1_000, "the owned servers were recorded at start");
    // Start from a nearly spent bucket, so the burst is paced by the refill rate alone.
    env.emulator.drain_rate_limit(RateLimit::HETZNER.limit - 20);
    let before = total(&env);
    let started = Instant::now();
    // A reconcile survey (20 pages) runs beside the burst, in its own class.
    let survey = {
        let engine = engine.clone();
        tokio::spawn(budget::scoped(Class::Reconcile, async move {
            engine.reconcile().await
        }))
    };
    // The owned servers keep their ids; the 200 spare slots have this state's.
    let ids: Vec<String> = engine.spare_of("cx23", "nbg1");
    assert_eq!(ids.len(), 200);
    for id in &ids {
        engine.create(id, zero_token()).await.unwrap();
    }
    until_all_idle(&engine, &ids, started + Duration::from_secs(60)).await;
    let took = started.elapsed();
    survey.await.unwrap().unwrap();
    let sent = total(&env) - before;
    let classes = env.emulator.requests_by_class();
    // The provider's share of Hetzner's refill (one a second), time-scaled: what the budget
    // allows for the requests sent, plus one boot.
    let allowed =
        Duration::from_secs_f64(sent as f64 / (budget::DEFAULT_SHARE * SCALE)) + scaled(12.0);
    eprintln!(
        "200 creates beside 1,000 owned servers: {took:?} ({:.0} s unscaled), {sent} requests, \
         budget time {allowed:?}; by class {classes:?}",
        took.as_secs_f64() * SCALE
    );
    assert_eq!(env.emulator.count_status(429), 0, "{classes:?}");
    // How long the burst took is a figure, not a verdict: it depends on the machine. The
    // bench's crowded run (`cargo xtask bench --scenario cloud-budget --runs crowded`) measures
    // it against the budget time with release binaries.
    assert_eq!(classes["create"].0, 200, "one POST per Create");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_hour_at_ten_thousand_owned_servers_stays_within_the_reconcile_share() {
    let env = env("bigfleet_hetzner_it_scale_steady", STEADY_SCALE).await;
    insert_owned(&env, 10_000);
    let engine = engine(&env, 10_000).await;
    let hour = Duration::from_secs_f64(3_600.0 / STEADY_SCALE);
    let floor = Duration::from_secs_f64(120.0 / STEADY_SCALE);
    let before = total(&env);
    let steady = SteadyHour::new(hour, floor, 200, "count");
    let (at_start, elapsed) =
        reconcile_a_steady_hour(&engine, env.cloud.clone(), env.telemetry, &steady, || {
            env.emulator.requests_by_class()
        })
        .await;
    let sent = total(&env) - before;
    let classes = env.emulator.requests_by_class();
    let per_hour = sent as f64 * hour.as_secs_f64() / elapsed.as_secs_f64();
    let share = budget::DEFAULT_SHARE * budget::DEFAULT_RECONCILE_SHARE * 3_600.0;
    eprintln!(
        "10,000 owned servers: {per_hour:.0} requests an hour (reconcile share {share:.0}, \
         {:.1}% of the limit); by class {classes:?}",
        per_hour / 36.0
    );
    assert_eq!(env.emulator.count_status(429), 0, "{classes:?}");
    // The survey's pages (a survey is 200 pages of 50) and the checks between surveys.
    steady.assert_within_share(&at_start, &classes, per_hour, share);
}

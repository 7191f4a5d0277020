//! The API budget against the emulator's real (time-scaled) rate limit: a burst of Creates
//! from a nearly spent bucket meets no 429, and another user of the token spending the half
//! the provider leaves it fails no Create and keeps its part, and the look-ups and boot polls
//! of a burst are shared listings, not a request per server.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use hcloud_emulator::RateLimit;
use provider_core::cloud::Cloud;
use tokio::time::Instant;

use crate::harness::{Env, Options, ctx};

/// Time runs this many times faster for the emulator's bucket and the client's budget alike:
/// 100 requests a second come back, of which the provider takes half.
const SCALE: f64 = 100.0;
const CREATES: i64 = 50;

async fn env(prefix: &'static str, left: u32) -> Env {
    let env = Env::new(Options {
        ssh: false,
        telemetry_prefix: prefix,
        api_time_scale: SCALE,
        ..Options::default()
    })
    .await;
    env.emulator
        .set_rate_limit(RateLimit::HETZNER.time_scaled(SCALE));
    env.emulator
        .drain_rate_limit(RateLimit::HETZNER.limit - left);
    env
}

/// `CREATES` concurrent Creates; every one must succeed. Returns how long they took.
async fn burst(env: &Env) -> Duration {
    let started = Instant::now();
    let tasks: Vec<_> = (0..CREATES)
        .map(|i| {
            let cloud = env.cloud.clone();
            let machine = env.machine("cx23", "nbg1", i);
            tokio::spawn(async move { cloud.create_host(&machine, &ctx(120)).await })
        })
        .collect();
    for task in tasks {
        task.await.unwrap().unwrap();
    }
    assert_eq!(env.emulator.live_servers().len(), CREATES as usize);
    started.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_creates_from_a_nearly_spent_bucket_meets_no_429() {
    let env = env("bigfleet_hetzner_it_budget_burst", 20).await;
    let took = burst(&env).await;
    let classes = env.emulator.requests_by_class();
    eprintln!("{CREATES} creates in {took:?}; requests by class: {classes:?}");
    assert_eq!(env.emulator.count_status(429), 0, "{classes:?}");
    assert_eq!(classes["create"].0, CREATES as usize, "one POST per Create");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_client_spending_half_the_budget_fails_no_create_and_keeps_its_part() {
    let env = env("bigfleet_hetzner_it_budget_shared", 20).await;
    // The other user asks for half the refill rate (50 a second) and takes what it finds.
    let stop = Arc::new(AtomicBool::new(false));
    let (asked, got) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let other = {
        let (emulator, stop) = (env.emulator.clone(), stop.clone());
        let (asked, got) = (asked.clone(), got.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(20));
            while !stop.load(Ordering::SeqCst) {
                tick.tick().await;
                asked.fetch_add(1, Ordering::SeqCst);
                got.fetch_add(emulator.drain_rate_limit(1), Ordering::SeqCst);
            }
        })
    };
    let took = burst(&env).await;
    stop.store(true, Ordering::SeqCst);
    other.await.unwrap();
    let classes = env.emulator.requests_by_class();
    let (asked, got) = (asked.load(Ordering::SeqCst), got.load(Ordering::SeqCst));
    eprintln!(
        "{CREATES} creates in {took:?} beside another user (it got {got} of {asked}); \
         429s: {}; requests by class: {classes:?}",
        env.emulator.count_status(429)
    );
    assert!(
        f64::from(got) >= 0.5 * f64::from(asked),
        "the other user kept most of its part: {got} of {asked}"
    );
    assert_eq!(classes["create"].0, CREATES as usize, "one POST per Create");
}

/// Issue 21 §2: 50 Creates of servers that boot in 12 s (time-scaled like the budget) cost
/// their 50 POSTs and a few shared listings (the look-ups before the creates and the boot
/// polls), and not one `GET /servers/{id}`; before, this burst cost 350 requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_shares_its_look_ups_and_boot_polls() {
    let scaled = |seconds: f64| Duration::from_secs_f64(seconds / SCALE);
    let env = Env::new(Options {
        ssh: false,
        telemetry_prefix: "bigfleet_hetzner_it_budget_batched",
        api_time_scale: SCALE,
        running_poll: Some(scaled(3.0)),
        ..Options::default()
    })
    .await;
    env.emulator
        .set_rate_limit(RateLimit::HETZNER.time_scaled(SCALE));
    env.emulator.set_boot_time(Some(scaled(12.0)));
    let took = burst(&env).await;
    let classes = env.emulator.requests_by_class();
    let total: usize = classes.values().map(|(n, _)| n).sum();
    eprintln!("{CREATES} creates in {took:?}: {total} requests, by class: {classes:?}");
    assert_eq!(env.emulator.count_status(429), 0, "{classes:?}");
    assert_eq!(classes["create"].0, CREATES as usize, "one POST per Create");
    assert!(
        !classes.contains_key("poll"),
        "no per-server poll: {classes:?}"
    );
    let listings = classes.get("listing").map_or(0, |(n, _)| *n);
    assert!(
        listings <= 30,
        "look-ups and boot polls share listings: {listings} ({classes:?})"
    );
    assert!(
        total <= CREATES as usize + 36,
        "{total} requests: {classes:?}"
    );
}

//! The API budget at fleet sizes a token can hold, against the emulator's real DigitalOcean
//! limits (5,000 an hour and 250 a minute, time-scaled): a burst of 200 Creates beside 1,000
//! Droplets already owned, from a token nearly spent for the hour, meets no 429 and sends one
//! POST per Create, with a reconcile survey running beside it (its time against the budget
//! time is a figure here, measured by the bench); at 10,000 owned Droplets an hour of the provider's
//! reconcile loop (paced surveys, out-of-band checks between them) stays within the reconcile
//! share.

use std::sync::Arc;
use std::time::Duration;

use digitalocean::cloud::DigitalOceanCloud;
use digitalocean::naming::{MANAGED_TAG, droplet_name, machine_tag, provider_tag};
use do_emulator::{Emulator, RateLimit};
use provider_core::budget::{self, Class, Limits, Settings};
use provider_core::fleet::{CapacityBook, PriceBook, slot_id};
use provider_core::machine::MachineState;
use testkit::digitalocean::{RunningEmulator, time_scaled};
use testkit::engine::{
    SteadyHour, offering, over_fleet, reconcile_a_steady_hour, until_all_idle, zero_token,
};
use tokio::time::Instant;

use crate::support::{API_TOKEN, PROVIDER, REGION, RunningChannel, api_client, pki, telemetry};

const SIZE: &str = "s-2vcpu-4gb";

struct Site {
    emulator: Emulator,
    cloud: Arc<DigitalOceanCloud>,
    _channel: RunningChannel,
    _serving: RunningEmulator,
}

async fn site(scale: f64, prefix: &str) -> Site {
    let emulator = Emulator::new(API_TOKEN);
    time_scaled(&emulator, scale, 30.0);
    let serving = RunningEmulator::serve(emulator.clone()).await;
    let budget = Settings::new(Limits::DIGITALOCEAN.time_scaled(scale)).budget(prefix);
    let pki = pki();
    let channel = RunningChannel::start(&pki, Duration::from_secs(2), Default::default()).await;
    let mut settings = crate::support::cloud_settings(&channel, &pki, None, PROVIDER);
    settings.active_poll = Duration::from_secs_f64(5.0 / scale);
    let cloud = Arc::new(DigitalOceanCloud::new(
        api_client(&serving.url).with_budget(budget),
        channel.channel.clone(),
        settings,
        telemetry(),
    ));
    Site {
        emulator,
        cloud,
        _channel: channel,
        _serving: serving,
    }
}

fn slot(i: i64) -> String {
    slot_id(PROVIDER, SIZE, REGION, i)
}

/// Droplets of the first `owned` slots, as an earlier run of this instance left them.
fn insert_owned(site: &Site, owned: i64) {
    let provider = provider_tag(PROVIDER);
    for i in 0..owned {
        let id = slot(i);
        let machine = machine_tag(&id);
        site.emulator.insert_droplet(
            &droplet_name(&id),
            REGION,
            SIZE,
            &[MANAGED_TAG, machine.as_str(), provider.as_str()],
        );
    }
}

async fn engine(site: &Site, count: i64) -> Arc<provider_core::Engine> {
    let mut options = provider_core::EngineOptions::new(telemetry());
    options.timeouts.create = Duration::from_secs(120);
    over_fleet(
        site.cloud.clone(),
        PROVIDER,
        offering(SIZE, REGION, count),
        PriceBook::new(|t, _| digitalocean::catalog::pinned_price_usd(t)),
        CapacityBook::new(digitalocean::catalog::pinned_capacity),
        options,
    )
    .await
}

fn sent(site: &Site) -> (usize, usize) {
    let classes = site.emulator.requests_by_class();
    (
        classes.values().map(|(n, _)| n).sum(),
        classes.values().map(|(_, refused)| refused).sum(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_creates_beside_a_thousand_owned_droplets_meet_no_429_with_one_post_each() {
    const SCALE: f64 = 60.0;
    let site = site(SCALE, "bigfleet_digitalocean_it_scale_burst").await;
    insert_owned(&site, 1_000);
    // Little is left of the hour, as if the token had been busy earlier in it (the headers
    // tell the client, from the start-up listing on): the burst is paced by the hour's refill
    // rate alone.
    site.emulator.set_hourly_remaining(20);
    let engine = engine(&site, 1_200).await;
    let owned = (0..1_000)
        .filter(|i| {
            engine
                .get(&slot(*i))
                .is_ok_and(|m| m.state == MachineState::Idle)
        })
        .count();
    assert_eq!(owned, 1_000, "the owned Droplets were recorded at start");
    let (before, _) = sent(&site);
    let started = Instant::now();
    let survey = {
        let engine = engine.clone();
        tokio::spawn(budget::scoped(Class::Reconcile, async move {
            engine.reconcile().await
        }))
    };
    // The owned Droplets keep their ids; the 200 spare slots have this state's.
    let ids: Vec<String> = engine.spare_of(SIZE, REGION);
    assert_eq!(ids.len(), 200);
    for id in &ids {
        engine.create(id, zero_token()).await.unwrap();
    }
    until_all_idle(&engine, &ids, started + Duration::from_secs(90)).await;
    let took = started.elapsed();
    survey.await.unwrap().unwrap();
    let (after, refused) = sent(&site);
    let requests = after - before;
    let classes = site.emulator.requests_by_class();
    // The provider's share of the hour's refill (5,000 an hour), time-scaled, plus one boot.
    let per_second =
        budget::DEFAULT_SHARE * f64::from(RateLimit::DIGITALOCEAN.per_hour) / 3_600.0 * SCALE;
    let allowed = Duration::from_secs_f64(requests as f64 / per_second)
        + Duration::from_secs_f64(30.0 / SCALE);
    eprintln!(
        "200 creates beside 1,000 owned Droplets: {took:?} ({:.0} s unscaled), {requests} \
         requests, budget time {allowed:?}; by class {classes:?}",
        took.as_secs_f64() * SCALE
    );
    assert_eq!(refused, 0, "{classes:?}");
    // How long the burst took is a figure, not a verdict: it depends on the machine. The
    // bench's crowded run (`cargo xtask bench --scenario cloud-budget --runs crowded`) measures
    // it against the budget time with release binaries.
    assert_eq!(classes["create"].0, 200, "one POST per Create");
    assert_eq!(classes.get("poll").map_or(0, |(n, _)| *n), 0, "{classes:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_hour_at_ten_thousand_owned_droplets_stays_within_the_reconcile_share() {
    const SCALE: f64 = 600.0;
    let site = site(SCALE, "bigfleet_digitalocean_it_scale_steady").await;
    insert_owned(&site, 10_000);
    let engine = engine(&site, 10_000).await;
    let hour = Duration::from_secs_f64(3_600.0 / SCALE);
    let floor = Duration::from_secs_f64(120.0 / SCALE);
    let (before, _) = sent(&site);
    let steady = SteadyHour::new(hour, floor, 50, "actions");
    let (at_start, elapsed) =
        reconcile_a_steady_hour(&engine, site.cloud.clone(), telemetry(), &steady, || {
            site.emulator.requests_by_class()
        })
        .await;

    let (after, refused) = sent(&site);
    let classes = site.emulator.requests_by_class();
    let per_hour = (after - before) as f64 * hour.as_secs_f64() / elapsed.as_secs_f64();
    let share = budget::DEFAULT_SHARE
        * budget::DEFAULT_RECONCILE_SHARE
        * f64::from(RateLimit::DIGITALOCEAN.per_hour);
    eprintln!(
        "10,000 owned Droplets: {per_hour:.0} requests an hour (reconcile share {share:.0}, \
         {:.1}% of the limit); by class {classes:?}",
        per_hour / 50.0
    );
    assert_eq!(refused, 0, "{classes:?}");
    // The survey's pages (a survey is 50 pages of 200) and the checks between surveys.
    steady.assert_within_share(&at_start, &classes, per_hour, share);
}

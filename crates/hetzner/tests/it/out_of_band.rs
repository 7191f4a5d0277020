//! The out-of-band check between paced reconcile surveys, with the engine and the reconcile
//! loop over the real client and the emulator: one `GET /servers?label_selector=…&per_page=1`
//! a floor while nothing happens (no survey), none after the provider's own Creates and
//! Deletes, and a server deleted behind the provider's back (as in the console) noticed by the
//! next check, not by the paced survey.

use std::time::Duration;

use hetzner::catalog;
use provider_core::cloud::Cloud;
use provider_core::fleet::{CapacityBook, PriceBook};
use provider_core::offerings::Offering;
use provider_core::{MachineState, StringMap};
use testkit::engine::{offering, over_fleet, spawn_reconcile_loop, zero_token};
use testkit::wait::until;
use testkit::{classes, metrics};
use tokio::time::Instant;

use crate::harness::{Env, Options, ctx};

const SERVERS: i64 = 30;
const FLOOR: Duration = Duration::from_millis(400);
const PREFIX: &str = "bigfleet_hetzner_it_oob";

/// Out-of-band checks made, as the cloud client counts its calls.
fn checks() -> f64 {
    metrics::api_calls(PREFIX, "CountManaged")
}

#[tokio::test]
async fn a_server_deleted_out_of_band_is_noticed_by_the_next_check_not_the_paced_survey() {
    let _ = provider_core::telemetry::recorder();
    // Hetzner's limits 100 times faster: background work refills at 10 requests a second, of
    // which a check every 400 ms takes a quarter.
    let env = Env::new(Options {
        ssh: false,
        telemetry_prefix: PREFIX,
        api_time_scale: 100.0,
        ..Options::default()
    })
    .await;
    env.emulator.set_polls_to_running(0);
    for i in 0..SERVERS {
        env.cloud
            .create_host(&env.machine("cx23", "nbg1", i), &ctx(30))
            .await
            .unwrap();
    }
    // Pages of one server: a survey costs 30 pages and the empty legacy listing, 31 requests,
    // so at the 7.5 a second the checks leave, surveys are paced to about 4 s.
    env.emulator.set_max_per_page(1);
    let offering = Offering {
        resources: StringMap::from([("cpu".into(), "1".into()), ("memory".into(), "2Gi".into())]),
        ..offering("cx23", "nbg1", SERVERS + 1)
    };
    let engine = over_fleet(
        env.cloud.clone(),
        crate::harness::PROVIDER,
        offering,
        PriceBook::new(|t, _| catalog::pinned_price_eur(t).map(|eur| eur * 1.25)),
        CapacityBook::new(catalog::pinned_capacity),
        provider_core::EngineOptions::new(env.telemetry),
    )
    .await;
    let ids: Vec<String> = (0..=SERVERS)
        .map(|i| env.machine("cx23", "nbg1", i).id)
        .collect();
    for id in &ids[..SERVERS as usize] {
        assert_eq!(engine.get(id).unwrap().state, MachineState::Idle, "{id}");
    }
    let (stop, _reconcile) = spawn_reconcile_loop(&engine, env.cloud.clone(), FLOOR, env.telemetry);
    until("the first survey", Duration::from_secs(10), || {
        metrics::surveys(PREFIX) >= 1.0
    })
    .await;
    let period = metrics::metric(&format!("{PREFIX}_reconcile_period_seconds"));
    eprintln!(
        "a survey cost {} requests; the next one waits {period:.1} s",
        metrics::metric(&format!("{PREFIX}_reconcile_survey_requests"))
    );
    assert!(
        period >= 3.5,
        "surveys are paced well above the floor: {period} s"
    );

    // Nothing happens: one request a check, and no survey.
    let (listings, counts, checked) = (
        classes::count(&env.emulator.requests_by_class(), "listing"),
        classes::count(&env.emulator.requests_by_class(), "count"),
        checks(),
    );
    tokio::time::sleep(FLOOR * 4).await;
    let made = checks() - checked;
    assert!(made >= 2.0, "{made} checks in four floors");
    assert_eq!(
        (classes::count(&env.emulator.requests_by_class(), "count") - counts) as f64,
        made,
        "one request per check"
    );
    assert_eq!(
        classes::count(&env.emulator.requests_by_class(), "listing"),
        listings,
        "no survey"
    );
    assert_eq!(metrics::early_surveys(PREFIX), 0.0);

    // The provider's own Delete and Create move what the check expects: no early survey.
    let checked = checks();
    engine.delete(&ids[0], zero_token()).await.unwrap();
    engine
        .create(&ids[SERVERS as usize], zero_token())
        .await
        .unwrap();
    until("the own Delete and Create", Duration::from_secs(10), || {
        engine.get(&ids[0]).unwrap().state == MachineState::Speculative
            && engine.get(&ids[SERVERS as usize]).unwrap().state == MachineState::Idle
    })
    .await;
    until("two more checks", Duration::from_secs(10), || {
        checks() >= checked + 2.0
    })
    .await;
    assert_eq!(
        metrics::early_surveys(PREFIX),
        0.0,
        "own changes are not out-of-band ones"
    );

    // Right after a survey (the next paced one is seconds away), a server is deleted in the
    // console: the next check notices it and the survey that follows proves it gone.
    let done = metrics::surveys(PREFIX);
    until("a survey", Duration::from_secs(20), || {
        metrics::surveys(PREFIX) > done
    })
    .await;
    let victim = engine.get(&ids[1]).unwrap();
    let server: i64 = victim.host.as_ref().unwrap().id.parse().unwrap();
    let deleted = Instant::now();
    assert!(env.emulator.delete_out_of_band(server));
    until(
        "the machine of the deleted server",
        Duration::from_secs(5),
        || engine.get(&ids[1]).unwrap().state == MachineState::Speculative,
    )
    .await;
    let noticed = deleted.elapsed();
    eprintln!("noticed {noticed:?} after the deletion (paced period {period:.1} s)");
    assert_eq!(metrics::early_surveys(PREFIX), 1.0);
    assert!(
        noticed < FLOOR * 4 && noticed.as_secs_f64() < period / 2.0,
        "noticed after {noticed:?}, a paced period is {period} s"
    );
    assert!(
        env.logs
            .text()
            .contains("reconcile: the cloud's out-of-band check saw the owned hosts change"),
        "the early survey says why"
    );
    for id in &ids[2..] {
        assert_eq!(engine.get(id).unwrap().state, MachineState::Idle, "{id}");
    }
    stop.cancel();
}

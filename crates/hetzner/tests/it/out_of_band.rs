//! The out-of-band check between paced reconcile surveys, with the engine and the reconcile
//! loop over the real client and the emulator: one `GET /servers?label_selector=…&per_page=1`
//! a floor while nothing happens (no survey), none after the provider's own Creates and
//! Deletes, and a server deleted behind the provider's back (as in the console) noticed by the
//! next check, not by the paced survey, also right after a rate-limit storm has passed.

use std::time::Duration;

use hcloud_emulator::Fault;
use hetzner::catalog;
use provider_core::StringMap;
use provider_core::fleet::{CapacityBook, PriceBook};
use provider_core::offerings::Offering;
use testkit::classes;
use testkit::engine::{offering, over_fleet};
use testkit::out_of_band::Scenario;

use crate::harness::{Env, Options};

const SERVERS: i64 = 30;
const FLOOR: Duration = Duration::from_millis(400);
const PREFIX: &str = "bigfleet_hetzner_it_oob";

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
        env.create_host(&env.machine("cx23", "nbg1", i), 30).await;
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
    // The servers made above keep their ids; the offering's one spare slot has a new one.
    let mut ids: Vec<String> = (0..SERVERS)
        .map(|i| env.machine("cx23", "nbg1", i).id)
        .collect();
    ids.extend(engine.spare_of("cx23", "nbg1"));
    assert_eq!(ids.len(), SERVERS as usize + 1);
    let scenario = Scenario::new(&engine, PREFIX, FLOOR, "CountManaged");
    let requests = |class: &str| classes::count(&env.emulator.requests_by_class(), class);
    let unanswered = scenario.unanswered(requests("count"));
    let (stop, _reconcile, period) = scenario
        .start_reconciling(&ids[..SERVERS as usize], env.cloud.clone(), env.telemetry)
        .await;

    // Nothing happens: one request a check, and no survey.
    scenario
        .nothing_happens(requests, "count", unanswered)
        .await;

    // The provider's own Delete and Create move what the check expects: no early survey.
    let checked = scenario.checks();
    scenario
        .own_delete_and_create(&ids[0], &ids[SERVERS as usize])
        .await;
    scenario.two_more_checks_start_no_survey(checked).await;

    // Another user of the token spends it for ten floors: every request is answered 429. The
    // checks and surveys wait it out, and once it has passed they keep their pace.
    scenario
        .storm_passes(FLOOR * 10, |lasting| {
            env.emulator.inject_for(
                lasting,
                Fault::RateLimited {
                    retry_after: Some(1),
                    reset_in: None,
                },
            );
        })
        .await;

    // Right after a survey (the next paced one is seconds away), a server is deleted in the
    // console: the next check notices it, as soon as before the storm, and the survey that
    // follows proves it gone.
    let delete = |host: &str| env.emulator.delete_out_of_band(host.parse().unwrap());
    scenario
        .host_deleted_out_of_band("the machine of the deleted server", &ids[1], period, delete)
        .await;
    assert!(
        env.logs
            .text()
            .contains("reconcile: the cloud's out-of-band check saw the owned hosts change"),
        "the early survey says why"
    );
    scenario.assert_idle(&ids[2..]);
    stop.cancel();
}

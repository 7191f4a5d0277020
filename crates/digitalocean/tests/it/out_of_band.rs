//! The out-of-band check between paced reconcile surveys, with the engine and the reconcile
//! loop over the real client and the emulator: one `GET /v2/actions` a floor while nothing
//! happens (no survey), none started by the destroy and create actions of the provider's own
//! Deletes and Creates, and a Droplet destroyed behind the provider's back (as in the console)
//! noticed by the next check, not by the paced survey, also right after a rate-limit storm has
//! passed.

use std::sync::Arc;
use std::time::Duration;

use digitalocean::cloud::DigitalOceanCloud;
use provider_core::budget::{Limits, Settings};
use provider_core::cloud::{Cloud, InventorySignal};
use provider_core::fleet::{CapacityBook, PriceBook};
use provider_core::telemetry::Telemetry;
use testkit::classes;
use testkit::engine::{offering, over_fleet};
use testkit::out_of_band::Scenario;

use crate::support::{Env, LogCapture, PROVIDER, REGION, api_client, cloud_settings, ctx, machine};

const DROPLETS: u32 = 30;
const FLOOR: Duration = Duration::from_millis(400);
const PREFIX: &str = "bigfleet_digitalocean_it_oob";

#[tokio::test]
async fn a_droplet_destroyed_out_of_band_is_noticed_by_the_next_check_not_the_paced_survey() {
    let logs = LogCapture::default();
    let _logs = logs.install();
    let _ = provider_core::telemetry::recorder();
    let telemetry = Telemetry::new(PREFIX);
    let env = Env::start().await;
    // DigitalOcean's limits 72 times faster: background work refills at 10 requests a second,
    // of which a check every 400 ms takes a quarter.
    let budget = Settings::new(Limits::DIGITALOCEAN.time_scaled(72.0)).budget(PREFIX);
    let cloud = Arc::new(DigitalOceanCloud::new(
        api_client(&env.api_url).with_budget(budget),
        env.channel.channel.clone(),
        cloud_settings(&env.channel, &env.pki, None, PROVIDER),
        telemetry,
    ));
    for i in 0..DROPLETS {
        cloud
            .create_host(&machine(i), &ctx(Duration::from_secs(20)))
            .await
            .unwrap();
    }
    // Pages of one Droplet: a survey costs 30 requests, so at the 7.5 a second the checks
    // leave, surveys are paced to about 4 s.
    env.emulator.set_max_per_page(1);
    let engine = over_fleet(
        cloud.clone(),
        PROVIDER,
        offering("s-2vcpu-4gb", REGION, i64::from(DROPLETS) + 1),
        PriceBook::new(|t, _| digitalocean::catalog::pinned_price_usd(t)),
        CapacityBook::new(digitalocean::catalog::pinned_capacity),
        provider_core::EngineOptions::new(telemetry),
    )
    .await;
    // The Droplets made above keep their ids; the offering's one spare slot has a new one.
    let mut ids: Vec<String> = (0..DROPLETS).map(|i| machine(i).id).collect();
    ids.extend(engine.spare_of("s-2vcpu-4gb", REGION));
    assert_eq!(ids.len(), DROPLETS as usize + 1);
    let scenario = Scenario::new(&engine, PREFIX, FLOOR, "ListActions");
    let requests = |class: &str| classes::count(&env.emulator.requests_by_class(), class);
    let unanswered = scenario.unanswered(requests("actions"));
    let (stop, _reconcile, period) = scenario
        .start_reconciling(&ids[..DROPLETS as usize], cloud.clone(), telemetry)
        .await;

    // Nothing happens: one request a check, and no survey.
    scenario
        .nothing_happens(requests, "actions", unanswered)
        .await;

    // The provider's own Delete and Create are destroy and create actions of its own: no early
    // survey.
    scenario
        .own_delete_and_create(&ids[0], &ids[DROPLETS as usize])
        .await;
    let checked = scenario.checks();
    scenario.two_more_checks_start_no_survey(checked).await;
    assert!(
        env.emulator
            .actions()
            .iter()
            .any(|a| a["type"] == "destroy"),
        "the own Delete was recorded as a destroy action"
    );

    // Another user of the token spends it for ten floors: every request is answered 429. The
    // checks and surveys wait it out, and once it has passed they keep their pace.
    scenario
        .storm_passes(FLOOR * 10, |lasting| {
            env.emulator.fail_for(
                lasting,
                do_emulator::Fault {
                    status: 429,
                    retry_after: Some(1),
                },
            );
        })
        .await;

    // Right after a survey (the next paced one is seconds away), a Droplet is destroyed in the
    // console: the next check notices it, as soon as before the storm, and the survey that
    // follows proves it gone.
    let delete = |host: &str| env.emulator.delete_out_of_band(host.parse().unwrap());
    let droplet = scenario
        .host_deleted_out_of_band(
            "the machine of the destroyed Droplet",
            &ids[1],
            period,
            delete,
        )
        .await;
    assert!(
        logs.text().contains(&format!(
            "DigitalOcean recorded the destroy of Droplet(s) [{droplet}]"
        )),
        "the early survey says why"
    );
    stop.cancel();
}

/// The check itself against the emulator: the first one only sets the cursor, each one costs
/// one `GET /v2/actions` while less than a page of actions happened since the last, the
/// provider's own destroys and other tools' Droplets are not changes, a destroy of one of this
/// instance's Droplets is (once), a flood of actions is too, and a token without
/// `actions:read` turns the check off.
#[tokio::test]
async fn the_check_reads_the_actions_since_the_last_one() {
    let env = Env::start().await;
    let mut hosts = Vec::new();
    for i in 0..3 {
        let host = env.create_host(&machine(i), 20).await;
        hosts.push(host.id);
    }
    let check = || async { env.cloud.inventory_changed().await.unwrap() };
    let actions = || classes::count(&env.emulator.requests_by_class(), "actions");
    assert_eq!(check().await, InventorySignal::Unchanged, "no listing yet");
    env.cloud.list_hosts().await.unwrap();
    assert_eq!(check().await, InventorySignal::Unchanged);
    assert_eq!(actions(), 2, "one request a check");

    env.cloud
        .delete_host(&hosts[0], &ctx(Duration::from_secs(20)))
        .await
        .unwrap();
    let other = env
        .emulator
        .insert_droplet("someone-else", REGION, "s-1vcpu-1gb", &["other-tool"]);
    assert!(env.emulator.delete_out_of_band(other));
    assert_eq!(
        check().await,
        InventorySignal::Unchanged,
        "the provider's own destroy and another tool's Droplet are not changes"
    );

    let ours: u64 = hosts[1].parse().unwrap();
    assert!(env.emulator.delete_out_of_band(ours));
    match check().await {
        InventorySignal::Changed { why } => assert!(why.contains(&format!("[{ours}]")), "{why}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        check().await,
        InventorySignal::Unchanged,
        "the cursor moved past it"
    );
    assert_eq!(actions(), 5);

    // More actions since the last check than five pages hold: the check cannot tell, and
    // asks for a survey after five requests.
    env.emulator.set_max_per_page(1);
    for i in 0..6 {
        let id = env
            .emulator
            .insert_droplet(&format!("busy-{i}"), REGION, "s-1vcpu-1gb", &[]);
        env.emulator.delete_out_of_band(id);
    }
    match check().await {
        InventorySignal::Changed { why } => assert!(why.contains("more than 5 pages"), "{why}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(actions(), 10);
    assert_eq!(check().await, InventorySignal::Unchanged);

    env.emulator.fail_next(
        1,
        do_emulator::Fault {
            status: 403,
            retry_after: None,
        },
    );
    assert_eq!(check().await, InventorySignal::Unsupported);
}

/// A Droplet the cloud named for a Create is expected from that moment, also when the Create
/// fails afterwards (a boot that outlasts its deadline): its destroy in the console is a
/// change made behind the provider's back, which the check reports.
#[tokio::test]
async fn a_failed_creates_droplet_destroyed_out_of_band_is_a_change() {
    let env = Env::start().await;
    let cloud = DigitalOceanCloud::new(
        api_client(&env.api_url),
        env.channel.channel.clone(),
        cloud_settings(&env.channel, &env.pki, None, PROVIDER),
        Telemetry::new(PREFIX),
    );
    cloud
        .create_host(&machine(0), &ctx(Duration::from_secs(20)))
        .await
        .unwrap();
    assert_eq!(cloud.list_hosts().await.unwrap().len(), 1);
    // The first check sets where the account's actions are read from.
    assert!(matches!(
        cloud.inventory_changed().await.unwrap(),
        InventorySignal::Unchanged
    ));

    env.emulator.set_boot_time(Some(Duration::from_secs(3600)));
    let failed = cloud
        .create_host(&machine(1), &ctx(Duration::from_secs(1)))
        .await
        .unwrap_err();
    assert!(failed.0.contains("deadline"), "{}", failed.0);
    let droplet = env
        .emulator
        .droplets()
        .into_iter()
        .find(|d| d.name == digitalocean::naming::droplet_name(&machine(1).id))
        .expect("the failed Create's Droplet exists");
    assert!(matches!(
        cloud.inventory_changed().await.unwrap(),
        InventorySignal::Unchanged
    ));
    assert!(env.emulator.delete_out_of_band(droplet.id));
    let signal = cloud.inventory_changed().await.unwrap();
    assert!(
        matches!(&signal, InventorySignal::Changed { why } if why.contains(&droplet.id.to_string())),
        "{signal:?}"
    );
}

//! The catalogue as Hetzner serves it today (the emulator's lineup, with per-location
//! deprecation and availability): resources and prices of a type no table of ours knows,
//! offerings withdrawn from List while Hetzner does not sell them and back when it does, the
//! answers of a sold-out type and of the server limit, and the `hetzner` binary started with no
//! `--offerings`.

use std::sync::Arc;
use std::time::Duration;

use fleet_proto::v1alpha1 as pb;
use provider_core::catalogue_refresh::{self as catalogue, Refresh};
use provider_core::cloud::Cloud;
use provider_core::fleet::{CapacityBook, Fleet, PriceBook};
use provider_core::machine::MachineState;
use provider_core::offerings::Offering;
use provider_core::{Backend, StringMap};

use crate::binary::refuses;
use crate::harness::{Env, Options, TOKEN, process_spec};
use crate::provider_process;
use crate::wire::{Caller, Shard};

fn offering(server_type: &str, location: &str, count: i64) -> Offering {
    Offering {
        instance_type: server_type.into(),
        zone: location.into(),
        capacity_type: "on_demand".into(),
        count,
        resources: StringMap::new(),
        labels: StringMap::new(),
    }
}

/// A fleet over the real client with no pinned table at all: whatever it knows of a type comes
/// from the API.
fn unpinned_fleet(env: &Env, offerings: Vec<Offering>) -> Arc<Fleet> {
    Arc::new(Fleet::new(
        env.cloud.clone(),
        crate::harness::PROVIDER,
        offerings,
        Arc::new(PriceBook::new(|_, _| None)),
        Arc::new(CapacityBook::new(|_| None)),
        |_| StringMap::new(),
    ))
}

async fn engine(fleet: &Arc<Fleet>, env: &Env) -> Arc<provider_core::Engine> {
    provider_core::Engine::start(
        fleet.clone(),
        Arc::new(provider_core::store::MemoryStore),
        provider_core::EngineOptions::new(env.telemetry),
    )
    .await
    .unwrap()
}

/// The Speculative slots in the engine, as `type/location` per slot, sorted.
/// The Speculative slots a full List shows (a withdrawn offering's stay in the state, hidden).
fn speculative(engine: &provider_core::Engine) -> Vec<String> {
    let mut slots: Vec<String> = testkit::stockout::listed(engine, None)
        .iter()
        .map(|m| format!("{}/{}", m.instance_type, m.zone))
        .collect();
    slots.sort();
    slots
}

#[tokio::test]
async fn a_type_no_table_knows_takes_its_resources_price_and_architecture_from_the_api() {
    let env = Env::new(Options::default()).await;
    let fleet = unpinned_fleet(
        &env,
        vec![offering("cpx52", "nbg1", 1), offering("cax31", "hel1", 1)],
    );
    assert_eq!(
        catalogue::refresh(&fleet, Duration::from_secs(10)).await,
        Refresh::Done
    );
    let slots = fleet.offered().unwrap();
    let cpx = slots.iter().find(|m| m.instance_type == "cpx52").unwrap();
    assert_eq!(
        cpx.resources,
        testkit::engine::resources("12", "24Gi", "480Gi")
    );
    assert_eq!(cpx.allocatable, cpx.resources);
    assert_eq!(cpx.labels["kubernetes.io/arch"], "amd64");
    // Net EUR 0.0440 times the harness's --eur-usd of 1.25.
    assert!(
        (cpx.price_per_hour - 0.0440 * 1.25).abs() < 1e-9,
        "{}",
        cpx.price_per_hour
    );
    let cax = slots.iter().find(|m| m.instance_type == "cax31").unwrap();
    assert_eq!(cax.labels["kubernetes.io/arch"], "arm64");
    // Helsinki is served 10% cheaper: the price is the location's.
    assert!(
        (cax.price_per_hour - 0.0210 * 0.9 * 1.25).abs() < 1e-9,
        "{}",
        cax.price_per_hour
    );
    // One request read the whole catalogue.
    assert_eq!(env.emulator.count("GET", "/server_types"), 1);
}

#[tokio::test]
async fn offerings_hetzner_does_not_sell_leave_list_and_come_back() {
    let env = Env::new(Options::default()).await;
    let fleet = unpinned_fleet(
        &env,
        vec![offering("cx23", "nbg1", 2), offering("cpx42", "fsn1", 2)],
    );
    catalogue::refresh(&fleet, Duration::from_secs(10)).await;
    let engine = engine(&fleet, &env).await;
    assert_eq!(
        speculative(&engine),
        ["cpx42/fsn1", "cpx42/fsn1", "cx23/nbg1", "cx23/nbg1"]
    );
    // A server for one cx23 slot before Hetzner stops selling cx23 in nbg1.
    let hosted = engine.get(&engine.spare_of("cx23", "nbg1")[0]).unwrap();
    let token = provider_core::FenceToken {
        shard_id: String::new(),
        epoch: 0,
        sequence: 0,
    };
    engine.create(&hosted.id, token.clone()).await.unwrap();
    crate::harness::until_every("the Create ends IDLE", Duration::from_millis(50), || {
        engine
            .get(&hosted.id)
            .is_ok_and(|m| m.state == MachineState::Idle)
    })
    .await;

    // cpx42 sold out in fsn1; cx23 past its unavailable_after in nbg1.
    env.emulator.set_sold_out("cpx42", "fsn1", true);
    env.emulator.set_deprecation(
        "cx23",
        "nbg1",
        Some(("2026-01-01T00:00:00Z", "2026-03-01T00:00:00Z")),
    );
    assert_eq!(
        catalogue::refresh(&fleet, Duration::from_secs(10)).await,
        Refresh::Done
    );
    let withdrawn = catalogue::announce(&fleet, env.telemetry);
    assert_eq!(withdrawn.len(), 2, "{withdrawn:?}");
    assert!(withdrawn.iter().any(|w| w.instance_type == "cpx42"
        && w.why == "server type cpx42 is temporarily unavailable in location fsn1"));
    assert!(withdrawn.iter().any(|w| w.instance_type == "cx23"
        && w.why == "deprecated, and unavailable after 2026-03-01T00:00:00Z"));
    engine.reconcile().await.unwrap();
    assert!(
        speculative(&engine).is_empty(),
        "{:?}",
        speculative(&engine)
    );
    // The machine that holds a server keeps it, and can be deleted.
    assert_eq!(engine.get(&hosted.id).unwrap().state, MachineState::Idle);
    // Hidden, not removed: the state still holds the three withdrawn Speculative slots.
    let kept = engine
        .snapshot()
        .slots
        .iter()
        .filter(|s| s.machine.state == MachineState::Speculative)
        .count();
    assert_eq!(kept, 3);
    // A Create of a withdrawn slot fails in the cloud layer without a request.
    let ctx = provider_core::TransitionContext::with_timeout("op", Duration::from_secs(5));
    let posts = env.emulator.count("POST", "/servers");
    let other = fleet.offered_ids().unwrap();
    assert!(other.is_empty());
    let refused = fleet
        .create(&env.machine("cpx42", "fsn1", 0), &ctx)
        .await
        .unwrap_err();
    assert!(refused.0.contains("cpx42/fsn1 is withdrawn"), "{refused}");
    assert_eq!(env.emulator.count("POST", "/servers"), posts);

    // Sold again in fsn1; cx23's deprecation moved a year ahead in nbg1.
    env.emulator.set_sold_out("cpx42", "fsn1", false);
    env.emulator.set_deprecation(
        "cx23",
        "nbg1",
        Some(("2026-01-01T00:00:00Z", "2999-01-01T00:00:00Z")),
    );
    catalogue::refresh(&fleet, Duration::from_secs(10)).await;
    assert!(catalogue::announce(&fleet, env.telemetry).is_empty());
    assert_eq!(
        fleet
            .standings()
            .get("cx23", "nbg1")
            .deprecation
            .map(|d| d.unavailable_after),
        Some("2999-01-01T00:00:00Z".to_owned()),
        "an announced deprecation is known before its date"
    );
    engine.reconcile().await.unwrap();
    assert_eq!(
        speculative(&engine),
        ["cpx42/fsn1", "cpx42/fsn1", "cx23/nbg1"]
    );
    let newer = provider_core::FenceToken {
        sequence: 1,
        ..token
    };
    engine.delete(&hosted.id, newer).await.unwrap();
}

#[tokio::test]
async fn a_sold_out_type_and_the_server_limit_answer_as_hetzner_does() {
    let env = Env::new(Options::default()).await;
    let ctx = provider_core::TransitionContext::with_timeout("op", Duration::from_secs(10));
    env.emulator.set_sold_out("cx33", "nbg1", true);
    let err = env
        .cloud
        .create_host(&env.machine("cx33", "nbg1", 0), &ctx)
        .await
        .unwrap_err();
    assert!(
        err.0
            .contains("hcloud resource_unavailable (HTTP 412): error during placement"),
        "{err}"
    );
    env.emulator.set_sold_out("cx33", "nbg1", false);
    env.emulator.set_server_limit(Some(1));
    env.cloud
        .create_host(&env.machine("cx33", "nbg1", 1), &ctx)
        .await
        .unwrap();
    let err = env
        .cloud
        .create_host(&env.machine("cx33", "nbg1", 2), &ctx)
        .await
        .unwrap_err();
    assert!(
        err.0
            .contains("hcloud resource_limit_exceeded (HTTP 403): server limit exceeded"),
        "{err}"
    );
}

fn binary_args(env: &Env, extra: &[&str]) -> Vec<String> {
    let mut args = vec![
        "--hetzner-backend=hetzner".to_owned(),
        format!("--token={TOKEN}"),
        format!("--hcloud-endpoint={}", env.emulator.endpoint()),
        "--image=ubuntu-24.04".into(),
        "--bootstrap-hook=/opt/bigfleet/bootstrap".into(),
        "--seed-count=4".into(),
        "--reconcile-interval=0".into(),
        "--metrics-addr=".into(),
        "--log-level=info".into(),
    ];
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    args
}

#[tokio::test]
async fn the_binary_with_no_offerings_advertises_what_hetzner_sells_and_every_create_ends_idle() {
    let env = Env::new(Options::default()).await;
    let provider = provider_process::start(process_spec(binary_args(&env, &[])))
        .await
        .unwrap();
    let mut caller = Caller::new(
        provider.default_channel().await.unwrap(),
        Shard::new("s", 1),
    );
    let listed = caller.list_all().await.unwrap();
    let mut offered: Vec<String> = listed
        .iter()
        .map(|m| format!("{}/{}", m.instance_type, m.zone))
        .collect();
    offered.sort();
    assert_eq!(
        offered,
        ["cpx42/fsn1", "cpx42/nbg1", "cx23/fsn1", "cx23/nbg1"],
        "today's lineup, in --location-a and --location-b"
    );
    for machine in &listed {
        assert_eq!(machine.labels["kubernetes.io/arch"], "amd64");
        caller.create(&machine.id).await.unwrap();
    }
    for machine in &listed {
        caller
            .wait_for_state(&machine.id, pb::MachineState::Idle, Duration::from_secs(30))
            .await
            .unwrap();
    }
    assert_eq!(env.emulator.count_status(412), 0);
    let mut provider = provider;
    provider.stop(Duration::from_secs(10)).await.unwrap();
}

#[tokio::test]
async fn the_default_mix_takes_the_successor_of_a_type_hetzner_stopped_selling() {
    let env = Env::new(Options::default()).await;
    env.emulator.set_deprecation(
        "cx23",
        "nbg1",
        Some(("2026-01-01T00:00:00Z", "2026-03-01T00:00:00Z")),
    );
    let provider = provider_process::start(process_spec(binary_args(&env, &[])))
        .await
        .unwrap();
    let mut caller = Caller::new(
        provider.default_channel().await.unwrap(),
        Shard::new("s", 1),
    );
    let mut offered: Vec<String> = caller
        .list_all()
        .await
        .unwrap()
        .iter()
        .map(|m| format!("{}/{}", m.instance_type, m.zone))
        .collect();
    offered.sort();
    // The cheapest x86 shared type with at least 2 cores and 4 GB sold in nbg1: cpx22.
    assert_eq!(
        offered,
        ["cpx22/nbg1", "cpx42/fsn1", "cpx42/nbg1", "cx23/fsn1"]
    );
    let mut provider = provider;
    provider.stop(Duration::from_secs(10)).await.unwrap();
    let logs = provider.logs();
    assert!(
        logs.contains("replaced a server type Hetzner no longer sells there by its successor"),
        "{logs}"
    );
}

#[test]
fn startup_serves_the_offerings_hetzner_sells_and_refuses_only_when_none() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let env = runtime.block_on(Env::new(Options::default()));
    for (server_type, location) in [("cx23", "nbg1"), ("cx23", "fsn1"), ("cpx42", "nbg1")] {
        env.emulator.set_sold_out(server_type, location, true);
    }
    for location in ["nbg1", "fsn1"] {
        // No successor either: every type of the mix's sizes is sold out.
        for t in ["cpx22", "cx33", "cpx32", "cx43", "cpx52", "cx53", "cpx62"] {
            env.emulator.set_sold_out(t, location, true);
        }
    }
    // cpx42 in fsn1 is still sold: the provider serves it alone.
    let provider = runtime
        .block_on(provider_process::start(process_spec(binary_args(
            &env,
            &[],
        ))))
        .unwrap();
    let listed = runtime.block_on(async {
        let mut caller = Caller::new(
            provider.default_channel().await.unwrap(),
            Shard::new("s", 1),
        );
        caller.list_all().await.unwrap()
    });
    assert!(!listed.is_empty());
    assert!(
        listed
            .iter()
            .all(|m| m.instance_type == "cpx42" && m.zone == "fsn1"),
        "{listed:?}"
    );
    let mut provider = provider;
    runtime
        .block_on(provider.stop(Duration::from_secs(10)))
        .unwrap();
    assert!(
        provider
            .logs()
            .contains("catalogue: serving the offerings that can be ordered"),
        "{}",
        provider.logs()
    );
    env.emulator.set_sold_out("cpx42", "fsn1", true);
    let args = binary_args(&env, &[]);
    refuses(
        &args
            .iter()
            .map(String::as_str)
            .filter(|a| *a != "--metrics-addr=")
            .collect::<Vec<_>>(),
        "none of the 4 offerings can be ordered now",
    );
}

#[tokio::test]
async fn check_names_a_deprecation_with_its_date_and_a_type_not_sold_now() {
    let env = Env::new(Options::default()).await;
    env.emulator.set_deprecation(
        "cx23",
        "nbg1",
        Some(("2026-06-01T09:00:00Z", "2999-12-31T23:59:59Z")),
    );
    env.emulator.set_sold_out("cpx42", "fsn1", true);
    let args = hetzner::real::RealArgs {
        provider: "check".into(),
        public_ipv6: false,
        ..crate::harness::real_args(&env.emulator.endpoint(), TOKEN)
    };
    let mut report =
        provider_core::check::Report::quiet(provider_core::check::CheckOptions::default());
    hetzner::check::run(
        &mut report,
        &args,
        &[offering("cx23", "nbg1", 1), offering("cpx42", "fsn1", 1)],
    )
    .await;
    let text = report.render();
    assert!(
        text.contains(
            "OK    offering cx23/nbg1 location: nbg1 (eu-central), net 0.0060000000 EUR/h; \
             deprecated (announced 2026-06-01T09:00:00Z), unavailable after \
             2999-12-31T23:59:59Z: choose a successor before then"
        ),
        "{text}"
    );
    assert!(
        text.contains(
            "FAIL  offering cpx42/fsn1 availability: offering cpx42/fsn1: server type cpx42 is \
             temporarily unavailable in location fsn1: withdrawn"
        ),
        "{text}"
    );
}

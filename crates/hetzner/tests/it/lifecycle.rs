//! The whole lifecycle through the real client, the emulator and a real SSH server, with the
//! backend wrapped in provider-core's `Fleet` as the binary wires it.

use std::collections::HashMap;
use std::sync::Arc;

use hetzner::catalog;
use hetzner::labels;
use provider_core::backend::{Backend, BootstrapBlob, ConfigureOrder};
use provider_core::cloud::{Capacity, Cloud};
use provider_core::fleet::{CapacityBook, Fleet, PriceBook};
use provider_core::machine::{MachineState, StringMap};
use provider_core::offerings::Offering;

use crate::harness::{Env, Options, PROVIDER, ctx};

fn offering(server_type: &str, zone: &str, count: i64) -> Offering {
    Offering {
        instance_type: server_type.into(),
        zone: zone.into(),
        capacity_type: "on_demand".into(),
        count,
        resources: StringMap::from([("cpu".into(), "1".into()), ("memory".into(), "2Gi".into())]),
        labels: StringMap::new(),
    }
}

fn fleet(env: &Env) -> Fleet {
    let prices = Arc::new(PriceBook::new(|t, _| {
        catalog::pinned_price_eur(t).map(|eur| eur * 1.25)
    }));
    let capacities = Arc::new(CapacityBook::new(catalog::pinned_capacity));
    Fleet::new(
        env.cloud.clone(),
        PROVIDER,
        vec![offering("cx23", "nbg1", 2), offering("cax11", "fsn1", 1)],
        prices,
        capacities,
        |_| provider_core::StringMap::new(),
    )
}

#[tokio::test]
async fn create_configure_drain_delete_end_to_end() {
    let mut env = Env::new(Options::default()).await;
    env.emulator.set_polls_to_running(3);
    let fleet = fleet(&env);

    let slots = fleet.describe().await.unwrap();
    assert_eq!(slots.len(), 3);
    assert!(slots.iter().all(|m| m.state == MachineState::Speculative));
    let mut machine = slots
        .iter()
        .find(|m| m.instance_type == "cx23")
        .unwrap()
        .clone();

    // Create: one server, labelled, named after the machine, with the host key injected.
    let effect = fleet.create(&machine, &ctx(30)).await.unwrap();
    let host = effect.host.clone().unwrap();
    assert_eq!(host.provider, PROVIDER);
    assert_eq!(
        effect.allocatable.get("memory").map(String::as_str),
        Some("4Gi")
    );
    let servers = env.emulator.servers();
    assert_eq!(servers.len(), 1);
    let server = &servers[0];
    assert_eq!(host.id, server.id.to_string());
    assert_eq!(server.name, labels::server_name(&machine.id));
    assert_eq!(server.status, hcloud::models::server::Status::Running);
    assert_eq!(server.labels[labels::MANAGED], "true");
    assert_eq!(
        labels::machine_id_of(&server.labels).as_deref(),
        Some(machine.id.as_str())
    );
    assert_eq!(
        labels::text_of(&server.labels, labels::PROVIDER).as_deref(),
        Some(PROVIDER)
    );
    let injected = env.injected_host_key(server.id);
    assert_eq!(
        server.labels[labels::HOST_KEY_FP],
        hetzner::hostkey::fingerprint(injected.public_key())
    );
    assert!(
        env.emulator
            .user_data(server.id)
            .unwrap()
            .starts_with("#cloud-config\n")
    );

    // Inventory maps the server back to its slot.
    let described = fleet.describe().await.unwrap();
    let idle = described.iter().find(|m| m.id == machine.id).unwrap();
    assert_eq!(idle.state, MachineState::Idle);
    assert_eq!(idle.host.as_ref().unwrap().id, host.id);

    // Configure: the server's sshd presents the injected key; the blob and the hook are real.
    let sshd = env.start_sshd(injected, 0);
    machine.host = Some(host.clone());
    let blob: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let order = ConfigureOrder {
        cluster_id: "prod-eu-1".into(),
        blob: BootstrapBlob(blob.clone()),
    };
    fleet.configure(&machine, &order, &ctx(30)).await.unwrap();
    assert_eq!(env.hook_args().as_deref(), Some("prod-eu-1\n"));
    assert_eq!(env.blob_copy().as_deref(), Some(blob.as_slice()));
    assert_eq!(env.blob_mode().as_deref(), Some("600"));
    assert!(
        !env.blob_file().exists(),
        "the blob is gone once the hook has exited"
    );
    let commands = sshd.observed.commands();
    assert_eq!(crate::harness::deliveries(&commands), 1);
    assert!(
        commands.iter().all(|c| !c.contains("prod-eu-1\n")),
        "the hook got its argument quoted"
    );
    assert!(
        commands.iter().all(|c| c.len() < 10_000),
        "the blob travelled over stdin, not the command line"
    );
    assert_eq!(env.labels(server.id)[labels::CLUSTER], "prod-eu-1");
    let hosts = env.cloud.list_hosts().await.unwrap();
    assert_eq!(hosts[0].cluster.as_deref(), Some("prod-eu-1"));

    // Drain: cordon + drain with the grace period, then the binding is gone.
    fleet.drain(&machine, 0, &ctx(30)).await.unwrap();
    let calls = env.kubectl_calls();
    assert!(calls.contains("cordon node-it-1"), "{calls}");
    assert!(
        calls.contains("drain node-it-1 --ignore-daemonsets --delete-emptydir-data --grace-period=1 --timeout=1s"),
        "{calls}"
    );
    assert!(!env.labels(server.id).contains_key(labels::CLUSTER));

    // Delete: gone, and deleting again is still a success.
    fleet.delete(&machine, &ctx(30)).await.unwrap();
    assert!(env.emulator.servers().is_empty());
    fleet.delete(&machine, &ctx(30)).await.unwrap();
    let after = fleet.describe().await.unwrap();
    assert!(after.iter().all(|m| m.state == MachineState::Speculative));
    env.assert_token_not_logged();
}

#[tokio::test]
async fn arm_offerings_get_the_arm_image_and_prices_are_net_per_location() {
    let env = Env::new(Options::default()).await;
    let machine = env.machine("cax11", "fsn1", 0);
    let host = env.create_host(&machine, 30).await;
    let server = env.emulator.server(host.id.parse().unwrap()).unwrap();
    assert_eq!(
        server.image.unwrap().architecture,
        hcloud::models::Architecture::Arm
    );
    assert_eq!(host.instance_type, "cax11");
    assert_eq!(host.zone, "fsn1");
    assert_eq!(host.public_ipv4.as_deref(), Some("127.0.0.1"));
    assert!(host.running);

    let cx23 = env.cloud.price_usd("cx23", "nbg1").await.unwrap();
    assert!(
        (cx23 - 0.0060 * 1.25).abs() < 1e-9,
        "net EUR x rate, got {cx23}"
    );
    let hel = env.cloud.price_usd("cx23", "hel1").await.unwrap();
    assert!(
        (hel - 0.0060 * 0.9 * 1.25).abs() < 1e-9,
        "per-location price, got {hel}"
    );
    let err = env.cloud.price_usd("cx23", "ash").await.unwrap_err();
    assert_eq!(err.0, "no pricing for cx23 in ash");
    let err = env.cloud.price_usd("cx99", "nbg1").await.unwrap_err();
    assert_eq!(err.0, "unknown server type \"cx99\"");

    let caps = env
        .cloud
        .capacities(&["cx23".into(), "cpx42".into(), "nope".into()])
        .await
        .unwrap();
    assert_eq!(
        caps["cx23"],
        Capacity {
            vcpus: 2,
            memory_mib: 4096,
            disk_gib: 40,
            arch: Some(provider_core::cloud::Arch::Amd64),
        }
    );
    assert_eq!(
        caps["cpx42"],
        Capacity {
            vcpus: 8,
            memory_mib: 16384,
            disk_gib: 320,
            arch: Some(provider_core::cloud::Arch::Amd64),
        }
    );
    assert!(!caps.contains_key("nope"));
}

#[tokio::test]
async fn create_errors_name_what_is_wrong() {
    let env = Env::new(Options::default()).await;
    let err = env.create_fails(&env.machine("cx99", "nbg1", 0), 10).await;
    assert_eq!(
        err.0,
        "create server cx99: offering cx99/nbg1 server_type \"cx99\" does not exist (the API \
         lists no such server type): withdrawn"
    );
    let err = env.create_fails(&env.machine("cx23", "hel1", 0), 10).await;
    assert!(
        err.0.starts_with(
            "create server cx23: location \"hel1\" is not one of this provider's locations"
        ),
        "{}",
        err.0
    );
    assert!(env.emulator.servers().is_empty());
}

#[tokio::test]
async fn operator_user_data_is_merged_as_multipart() {
    let env = Env::new(Options {
        base_user_data: Some("#!/bin/sh\necho operator\n".into()),
        ..Options::default()
    })
    .await;
    let host = env.create_host(&env.machine("cx23", "nbg1", 0), 10).await;
    let user_data = env.emulator.user_data(host.id.parse().unwrap()).unwrap();
    assert!(user_data.starts_with("Content-Type: multipart/mixed; boundary=\""));
    assert!(user_data.contains("Content-Type: text/x-shellscript\r\n"));
    assert!(user_data.contains("#!/bin/sh\necho operator\n"));
    assert!(user_data.contains("Content-Type: text/cloud-config\r\n"));
    // The injected key is still recoverable from the merged document.
    let key = env.injected_host_key(host.id.parse().unwrap());
    let server_labels = env.labels(host.id.parse().unwrap());
    assert_eq!(
        server_labels[labels::HOST_KEY_FP],
        hetzner::hostkey::fingerprint(key.public_key())
    );
}

/// An engine over the real client and the emulator, on an in-memory store, with `orphan_grace`.
async fn engine(
    env: &Env,
    offerings: Vec<Offering>,
    create_timeout: std::time::Duration,
    orphan_grace: std::time::Duration,
) -> Arc<provider_core::Engine> {
    let prices = Arc::new(PriceBook::new(|t, _| {
        catalog::pinned_price_eur(t).map(|eur| eur * 1.25)
    }));
    let capacities = Arc::new(CapacityBook::new(catalog::pinned_capacity));
    let fleet = Fleet::new(
        env.cloud.clone(),
        PROVIDER,
        offerings,
        prices,
        capacities,
        |_| provider_core::StringMap::new(),
    );
    let mut options = provider_core::EngineOptions::new(env.telemetry);
    options.timeouts.create = create_timeout;
    options.orphan_grace = orphan_grace;
    provider_core::Engine::start(
        Arc::new(fleet),
        Arc::new(provider_core::store::MemoryStore),
        options,
    )
    .await
    .unwrap()
}

fn zero_token() -> provider_core::FenceToken {
    provider_core::FenceToken {
        shard_id: String::new(),
        epoch: 0,
        sequence: 0,
    }
}

async fn settled(engine: &provider_core::Engine, id: &str) -> Arc<provider_core::Machine> {
    testkit::engine::settled(engine, id, std::time::Duration::from_secs(20)).await
}

/// Defect 2: a paged listing taken while a server is deleted skips a live server (the later
/// ones move up a page). Reconcile changes only the machine whose server is really gone
/// (proved by a direct read); the skipped one stays Idle on its server.
#[tokio::test]
async fn a_server_skipped_by_a_shifting_paged_listing_is_not_declared_vanished() {
    let env = Env::new(Options::default()).await;
    env.emulator.set_polls_to_running(0);
    for i in 0..6 {
        env.create_host(&env.machine("cx23", "nbg1", i), 30).await;
    }
    let engine = engine(
        &env,
        vec![offering("cx23", "nbg1", 6)],
        std::time::Duration::from_secs(30),
        std::time::Duration::from_secs(600),
    )
    .await;
    let ids: Vec<String> = (0..6).map(|i| env.machine("cx23", "nbg1", i).id).collect();
    for id in &ids {
        assert_eq!(engine.get(id).unwrap().state, MachineState::Idle);
    }
    env.emulator.set_max_per_page(3);
    env.emulator.delete_during_next_listings(1);
    let report = engine.reconcile().await.unwrap();
    assert_eq!(env.emulator.servers().len(), 5, "one server was deleted");
    // The listing had the deleted server (page 1 was served before it went) and missed the
    // one that moved up a page: a suspect, alive on a direct read, so nothing changes.
    assert_eq!((report.suspects, report.vanished), (1, 0), "{report:?}");
    for id in &ids {
        assert_eq!(engine.get(id).unwrap().state, MachineState::Idle, "{id}");
    }
    // The next pass sees the deletion and proves it; BigFleet's shard has no edge from Idle to
    // say so, so the machine stays Idle (its next Configure fails, a Delete gives it back).
    let report = engine.reconcile().await.unwrap();
    assert_eq!(report.vanished, 1, "{report:?}");
    let states: Vec<MachineState> = ids.iter().map(|id| engine.get(id).unwrap().state).collect();
    assert_eq!(
        states,
        [
            MachineState::Idle, // its server is gone: the shard's next action ends it
            MachineState::Idle,
            MachineState::Idle,
            MachineState::Idle, // skipped by the first listing, alive
            MachineState::Idle,
            MachineState::Idle,
        ]
    );
}

/// Defect 3: a Create that fails after its server exists (here its deadline passes while the
/// server boots) leaves a FAILED machine that holds the server (the Create recorded it the
/// moment the cloud named it), so it counts as FAILED-with-host and an admin release deletes
/// it. Nothing keeps running untracked.
#[tokio::test]
async fn a_server_left_by_a_failed_create_is_recorded_and_released() {
    let env = Env::new(Options::default()).await;
    env.emulator.set_polls_to_running(1_000_000);
    let engine = engine(
        &env,
        vec![offering("cx23", "nbg1", 1)],
        std::time::Duration::from_secs(1),
        std::time::Duration::from_secs(600),
    )
    .await;
    let id = engine.spare_of("cx23", "nbg1")[0].clone();
    engine.create(&id, zero_token()).await.unwrap();
    let failed = settled(&engine, &id).await;
    assert_eq!(failed.state, MachineState::Failed, "{failed:?}");
    assert_eq!(env.emulator.servers().len(), 1, "the server exists");
    assert_eq!(
        failed.host.as_ref().map(|h| h.id.clone()),
        Some(env.emulator.servers()[0].id.to_string())
    );
    let server = env.emulator.servers()[0].id.to_string();
    let m = testkit::engine::release_failed_with_host(&engine, &id, &server).await;
    assert_eq!(m.state, MachineState::Failed);
    assert!(
        env.emulator
            .servers()
            .iter()
            .all(|s| s.status == hcloud::models::server::Status::Deleting),
        "released: the server is deleted"
    );
    assert_eq!(engine.get(&id).unwrap().state, MachineState::Failed);
}

/// A second server carrying one machine's labels (attached to no record) is deleted as an
/// orphan once it stayed one for the grace period; the machine's own server is kept.
#[tokio::test]
async fn an_orphaned_server_is_deleted_after_the_grace_period() {
    let env = Env::new(Options::default()).await;
    env.emulator.set_polls_to_running(0);
    let machine = env.machine("cx23", "nbg1", 0);
    let own = env.create_host(&machine, 30).await;
    let engine = engine(
        &env,
        vec![offering("cx23", "nbg1", 1)],
        std::time::Duration::from_secs(30),
        std::time::Duration::from_millis(50),
    )
    .await;
    let mut server_labels = HashMap::from([(labels::MANAGED.to_owned(), "true".to_owned())]);
    server_labels.extend(labels::machine_id_labels(&machine.id));
    server_labels.extend(labels::text_labels(labels::PROVIDER, PROVIDER));
    let stray = env
        .emulator
        .insert_server("stray", "cx23", "nbg1", server_labels, "192.0.2.9");
    let first = engine.reconcile().await.unwrap();
    assert_eq!((first.orphans, first.orphans_deleted), (1, 0), "{first:?}");
    tokio::time::sleep(std::time::Duration::from_millis(60)).await;
    let second = engine.reconcile().await.unwrap();
    assert_eq!(second.orphans_deleted, 1, "{second:?}");
    let live: Vec<String> = env
        .emulator
        .servers()
        .iter()
        .filter(|s| s.status != hcloud::models::server::Status::Deleting)
        .map(|s| s.id.to_string())
        .collect();
    assert_eq!(live, vec![own.id.clone()]);
    assert_ne!(own.id, stray.to_string());
    let m = engine.get(&machine.id).unwrap();
    assert_eq!(m.state, MachineState::Idle);
    assert_eq!(m.host.as_ref().unwrap().id, own.id);
}

/// Releasing a FAILED machine before any reconcile recorded the server its failed Create left
/// deletes that server too (otherwise the next pass would adopt it behind the operator's back).
/// The server exists but the Create never learned its id: the create call's answer came only
/// after the deadline.
#[tokio::test]
async fn releasing_a_failed_create_deletes_the_server_it_left_before_reconcile_saw_it() {
    let env = Env::new(Options::default()).await;
    env.emulator.set_polls_to_running(1_000_000);
    env.emulator
        .inject_create([hcloud_emulator::CreateFault::Hang(
            std::time::Duration::from_secs(3),
        )]);
    let engine = engine(
        &env,
        vec![offering("cx23", "nbg1", 1)],
        std::time::Duration::from_secs(1),
        std::time::Duration::from_secs(600),
    )
    .await;
    let id = engine.spare_of("cx23", "nbg1")[0].clone();
    engine.create(&id, zero_token()).await.unwrap();
    let failed = settled(&engine, &id).await;
    assert_eq!(failed.state, MachineState::Failed, "{failed:?}");
    // The look-up after the deadline may already have put the server on the FAILED record
    // (docs/state.md, "A Create's host"); either way it is the one server the Create left.
    if let Some(host) = &failed.host {
        let servers = env.emulator.servers();
        assert_eq!(servers.len(), 1, "{servers:?}");
        assert_eq!(host.id, servers[0].id.to_string());
    }
    let answer = engine.release(&id).await.unwrap();
    let successor = testkit::engine::assert_released(&engine, &id, &answer);
    assert!(
        env.emulator
            .servers()
            .iter()
            .all(|s| s.status == hcloud::models::server::Status::Deleting),
        "the server the failed Create left is deleted"
    );
    env.emulator.set_polls_to_running(0);
    let report = engine.reconcile().await.unwrap();
    assert_eq!(report.adopted, 0, "{report:?}");
    assert_eq!(engine.get(&id).unwrap().state, MachineState::Failed);
    assert_eq!(
        engine.get(&successor).unwrap().state,
        MachineState::Speculative
    );
}

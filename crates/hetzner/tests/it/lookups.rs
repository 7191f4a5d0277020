//! The client's look-ups by numeric id or else by name, against the emulator's fixtures: what
//! each finds and exactly which requests it sends.

use hcloud_emulator::Emulator;
use hetzner::api::{ClientTiming, HcloudApi};
use hetzner::models::Architecture;
use provider_core::config::Secret;
use provider_core::telemetry::Telemetry;
use tokio::time::{Duration, Instant};

use crate::harness::TOKEN;

async fn api(prefix: &'static str) -> (Emulator, HcloudApi) {
    let emulator = Emulator::start(TOKEN).await.unwrap();
    let api = HcloudApi::new(
        &emulator.endpoint(),
        Secret::new(TOKEN),
        Telemetry::new(prefix),
        ClientTiming::default(),
    )
    .unwrap();
    (emulator, api)
}

fn deadline() -> Option<Instant> {
    Some(Instant::now() + Duration::from_secs(30))
}

/// The requests seen since the last call, as `GET /path?query status`.
fn take_seen(emulator: &Emulator, from: &mut usize) -> Vec<String> {
    let seen = emulator.seen();
    let new = seen[*from..]
        .iter()
        .map(|s| {
            let query = if s.query.is_empty() {
                String::new()
            } else {
                format!("?{}", s.query)
            };
            format!("{} {}{query} {}", s.method, s.path, s.status)
        })
        .collect();
    *from = seen.len();
    new
}

#[tokio::test]
async fn images_by_id_ignore_the_architecture_and_by_name_honour_it() {
    let (emulator, api) = api("bigfleet_hetzner_it_lookups_images").await;
    let mut from = 0;

    let arm = api
        .image("161547270", Architecture::X86, deadline())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(arm.architecture, Architecture::Arm);
    assert_eq!(
        take_seen(&emulator, &mut from),
        ["GET /images/161547270 200"]
    );

    let by_name = api
        .image("ubuntu-24.04", Architecture::Arm, deadline())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(by_name.id, 161_547_270);
    assert_eq!(
        take_seen(&emulator, &mut from),
        ["GET /images?architecture=arm&name=ubuntu-24.04 200"]
    );

    // An id no image has is tried as a name too.
    assert!(
        api.image("999", Architecture::X86, deadline())
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(
        take_seen(&emulator, &mut from),
        [
            "GET /images/999 404",
            "GET /images?architecture=x86&name=999 200"
        ]
    );
}

#[tokio::test]
async fn networks_firewalls_and_ssh_keys_by_id_or_name() {
    let (emulator, api) = api("bigfleet_hetzner_it_lookups_others").await;
    let mut from = 0;

    let network = api.network("9002", deadline()).await.unwrap().unwrap();
    assert_eq!(network.name, "bigfleet-storage");
    let network = api
        .network("bigfleet-mgmt", deadline())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(network.id, 9001);
    assert!(api.network("nope", deadline()).await.unwrap().is_none());
    assert_eq!(
        take_seen(&emulator, &mut from),
        [
            "GET /networks/9002 200",
            "GET /networks?name=bigfleet-mgmt 200",
            "GET /networks?name=nope 200"
        ]
    );

    let firewall = api.firewall("7002", deadline()).await.unwrap().unwrap();
    assert_eq!(firewall.name, "bigfleet-ssh");
    let firewall = api
        .firewall("bigfleet-nodes", deadline())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(firewall.id, 7001);
    assert_eq!(
        take_seen(&emulator, &mut from),
        [
            "GET /firewalls/7002 200",
            "GET /firewalls?name=bigfleet-nodes 200"
        ]
    );

    let key = api.ssh_key("5002", deadline()).await.unwrap().unwrap();
    assert_eq!(key.name, "ops-bob");
    assert!(api.ssh_key("5999", deadline()).await.unwrap().is_none());
    assert_eq!(
        take_seen(&emulator, &mut from),
        [
            "GET /ssh_keys/5002 200",
            "GET /ssh_keys/5999 404",
            "GET /ssh_keys?name=5999 200"
        ]
    );
}

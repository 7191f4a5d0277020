//! The size catalogue as DigitalOcean serves it (the emulator's sizes and regions): resources,
//! prices and architecture of a size no table of ours knows, offerings withdrawn from the
//! offered set while a size is not sold in the region and back when it is, the answers of a
//! sold-out size and of the Droplet limit, and the binary serving the healthy offerings when
//! one size is not sold.

use std::sync::Arc;
use std::time::Duration;

use provider_core::catalogue_refresh::{self as catalogue, Refresh};
use provider_core::cloud::Cloud;
use provider_core::fleet::{CapacityBook, Fleet, PriceBook};
use provider_core::offerings::Offering;
use provider_core::{Backend, StringMap};

use crate::binary::Provider;
use crate::support::*;

fn offering(size: &str, count: i64) -> Offering {
    Offering {
        instance_type: size.into(),
        zone: REGION.into(),
        capacity_type: "on_demand".into(),
        count,
        resources: StringMap::new(),
        labels: StringMap::new(),
    }
}

/// A fleet with no pinned table: whatever it knows of a size comes from the API.
fn unpinned_fleet(env: &Env, offerings: Vec<Offering>) -> Fleet {
    fleet_over(env.cloud.clone(), offerings)
}

fn fleet_over(cloud: Arc<dyn Cloud>, offerings: Vec<Offering>) -> Fleet {
    Fleet::new(
        cloud,
        PROVIDER,
        offerings,
        Arc::new(PriceBook::new(|_, _| None)),
        Arc::new(CapacityBook::new(|_| None)),
        |_| StringMap::new(),
    )
}

/// Sells s-4vcpu-8gb in the region and s-2vcpu-4gb at all (`sold`) or neither, then reads
/// the catalogue of two slots of each through a fresh cloud (its size cache, a minute long,
/// empty): that fleet.
async fn sold(env: &Env, sold: bool) -> Fleet {
    env.emulator.set_sold_out("s-4vcpu-8gb", REGION, !sold);
    env.emulator.set_size_available("s-2vcpu-4gb", sold);
    let fresh = Arc::new(cloud_for(
        &env.api_url,
        &env.channel,
        &env.pki,
        None,
        PROVIDER,
    ));
    let fleet = fleet_over(
        fresh,
        vec![offering("s-2vcpu-4gb", 2), offering("s-4vcpu-8gb", 2)],
    );
    catalogue::refresh(&fleet, Duration::from_secs(10)).await;
    fleet
}

#[tokio::test]
async fn a_size_no_table_knows_takes_its_resources_and_price_from_the_api() {
    let env = Env::start().await;
    let fleet = unpinned_fleet(&env, vec![offering("s-4vcpu-16gb-amd", 1)]);
    assert_eq!(
        catalogue::refresh(&fleet, Duration::from_secs(10)).await,
        Refresh::Done
    );
    let slot = fleet.offered().unwrap().remove(0);
    assert_eq!(
        slot.resources,
        testkit::engine::resources("4", "16Gi", "200Gi")
    );
    assert_eq!(slot.allocatable, slot.resources);
    assert_eq!(slot.price_per_hour, 0.125);
    assert_eq!(slot.labels["kubernetes.io/arch"], "amd64");
    assert_eq!(slot.labels["topology.kubernetes.io/region"], REGION);
    assert_eq!(
        slot.labels["node.kubernetes.io/instance-type"],
        "s-4vcpu-16gb-amd"
    );
}

#[tokio::test]
async fn sizes_digitalocean_does_not_sell_leave_the_offered_set_and_come_back() {
    let env = Env::start().await;
    let fleet = unpinned_fleet(
        &env,
        vec![offering("s-2vcpu-4gb", 2), offering("s-4vcpu-8gb", 2)],
    );
    catalogue::refresh(&fleet, Duration::from_secs(10)).await;
    assert_eq!(fleet.offered_ids().unwrap().len(), 4);
    // The cloud's size cache lives a minute: a fresh cloud reads the change at once.
    let fleet = sold(&env, false).await;
    let withdrawn = catalogue::announce(&fleet, telemetry());
    let why: Vec<&str> = withdrawn.iter().map(|w| w.why.as_str()).collect();
    assert_eq!(
        why,
        [
            "size s-2vcpu-4gb is not available for new Droplets",
            "size s-4vcpu-8gb is not available in region nyc3"
        ]
    );
    assert!(fleet.offered_ids().unwrap().is_empty());
    // Sold again: the slots come back.
    let fleet = sold(&env, true).await;
    assert!(catalogue::announce(&fleet, telemetry()).is_empty());
    assert_eq!(fleet.offered_ids().unwrap().len(), 4);
}

#[tokio::test]
async fn a_region_closed_to_new_droplets_withdraws_its_offerings_until_it_reopens() {
    let env = Env::start().await;
    env.emulator.set_region_available(REGION, false);
    let fleet = unpinned_fleet(&env, vec![offering("s-2vcpu-4gb", 1)]);
    catalogue::refresh(&fleet, Duration::from_secs(10)).await;
    assert_eq!(
        fleet.withdrawn("s-2vcpu-4gb", REGION),
        Some("region nyc3 takes no new Droplets".into())
    );
    env.emulator.set_region_available(REGION, true);
    catalogue::refresh(&fleet, Duration::from_secs(10)).await;
    assert_eq!(fleet.withdrawn("s-2vcpu-4gb", REGION), None);
    assert_eq!(fleet.offered_ids().unwrap().len(), 1);
}

#[tokio::test]
async fn a_sold_out_size_and_the_droplet_limit_answer_as_digitalocean_does() {
    let env = Env::start().await;
    env.emulator.set_sold_out("s-2vcpu-4gb", REGION, true);
    let err = env.create_fails(&machine(0), 10).await;
    assert!(err.0.contains("422"), "{err}");
    assert!(
        err.0.contains("Size is not available in this region."),
        "{err}"
    );
    env.emulator.set_sold_out("s-2vcpu-4gb", REGION, false);
    env.emulator.set_droplet_limit(1);
    env.create_host(&machine(1), 10).await;
    let err = env.create_fails(&machine(2), 10).await;
    assert!(err.0.contains("will exceed your droplet limit"), "{err}");
}

#[tokio::test]
async fn the_binary_serves_the_sizes_digitalocean_sells_and_names_the_withdrawn_one() {
    let site = crate::binary::Site::start().await;
    site.emulator.set_sold_out("s-4vcpu-8gb", REGION, true);
    let offerings = site.dir.path().join("two-sizes.json");
    std::fs::write(
        &offerings,
        r#"[{"size":"s-2vcpu-4gb","region":"nyc3","count":2},
            {"size":"s-4vcpu-8gb","region":"nyc3","count":2}]"#,
    )
    .unwrap();
    let flag = format!("--offerings={}", offerings.display());
    let mut p = Provider::start_on(site, &[&flag]).await;
    let listed = p.listed().await;
    assert_eq!(listed.len(), 2, "{listed:?}");
    assert!(listed.iter().all(|m| m.instance_type == "s-2vcpu-4gb"));
    let logs = p.process.logs();
    assert!(
        logs.contains("catalogue: serving the offerings that can be ordered"),
        "{logs}"
    );
    p.kill_9().await;
}

#[tokio::test]
async fn the_default_mix_takes_the_successor_of_a_size_not_sold_in_the_region() {
    let site = crate::binary::Site::start().await;
    site.emulator.set_sold_out("s-2vcpu-4gb", REGION, true);
    // No --offerings: the built-in default mix in --region.
    let mut p = Provider::start_on(site, &["--offerings=", "--seed-count=4"]).await;
    let listed = p.listed().await;
    let mut sizes: Vec<&str> = listed.iter().map(|m| m.instance_type.as_str()).collect();
    sizes.sort();
    sizes.dedup();
    // The cheapest Basic size sold in nyc3 with at least 2 vCPUs and 4 GiB.
    assert_eq!(sizes, ["s-2vcpu-4gb-amd", "s-4vcpu-8gb"], "{listed:?}");
    let logs = p.process.logs();
    assert!(
        logs.contains("replaced a size DigitalOcean no longer sells there by its successor"),
        "{logs}"
    );
    p.kill_9().await;
}

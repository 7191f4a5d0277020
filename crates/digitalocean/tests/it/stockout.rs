//! Stockouts and the Droplet limit against the emulator, through the real client: a size not
//! available in the region returns its slot and withdraws the offering there, a probe after the
//! backoff (or the catalogue's `regions` list) brings it back, `droplet_limit` with room for two
//! caps what is listed without a FAILED machine, bursts on a sold-out size cost one probe per
//! backoff, and a restart re-learns a withdrawal with one request.

use std::sync::Arc;
use std::time::Duration;

use digitalocean::cloud::DigitalOceanCloud;
use provider_core::cloud::Cloud;
use testkit::stockout::{self as scenario, Knobs};

use crate::support::{Env, PROVIDER, REGION, api_client, cloud_settings, telemetry};

/// The emulator, with a client that reads the sizes afresh at every catalogue read (the
/// provider keeps them for a minute), so a size sold again is seen at the next read.
struct Site {
    env: Env,
    cloud: Arc<DigitalOceanCloud>,
}

impl Site {
    async fn start() -> Site {
        let env = Env::start().await;
        let mut settings = cloud_settings(&env.channel, &env.pki, None, PROVIDER);
        settings.sizes_ttl = Duration::ZERO;
        let cloud = Arc::new(DigitalOceanCloud::new(
            api_client(&env.api_url),
            env.channel.channel.clone(),
            settings,
            telemetry(),
        ));
        Site { env, cloud }
    }
}

impl Knobs for Site {
    fn cloud(&self) -> Arc<dyn Cloud> {
        self.cloud.clone()
    }

    fn provider(&self) -> &str {
        PROVIDER
    }

    fn sell_out(&self, size: &str, region: &str, sold_out: bool) {
        self.env.emulator.set_sold_out(size, region, sold_out);
    }

    fn set_limit(&self, limit: Option<u64>) {
        self.env
            .emulator
            .set_droplet_limit(limit.unwrap_or(u64::MAX));
    }

    fn create_requests(&self) -> usize {
        self.env.emulator.create_requests() as usize
    }

    fn requests(&self) -> usize {
        self.env.emulator.requests().len()
    }

    fn limit_api(&self) -> bool {
        true
    }
}

#[tokio::test]
async fn a_stockout_returns_the_slot_withdraws_the_offering_and_a_probe_brings_it_back() {
    let env = Site::start().await;
    scenario::a_stockout_and_its_return(
        &env,
        ("s-2vcpu-4gb", REGION),
        ("s-4vcpu-8gb", REGION),
        telemetry(),
    )
    .await;
}

#[tokio::test]
async fn the_catalogues_regions_end_a_withdrawal_at_once() {
    let env = Site::start().await;
    scenario::the_catalogue_flag_ends_a_withdrawal(&env, ("s-2vcpu-4gb", REGION), telemetry())
        .await;
}

#[tokio::test]
async fn a_droplet_limit_with_room_for_two_caps_the_listed_slots_without_a_failed_machine() {
    let env = Site::start().await;
    scenario::an_account_limit_with_room_for_two(&env, ("s-2vcpu-4gb", REGION), 5, telemetry())
        .await;
}

#[tokio::test]
async fn bursts_of_50_creates_on_a_sold_out_size_cost_one_probe_per_backoff() {
    let env = Site::start().await;
    let first = scenario::repeated_bursts_on_a_sold_out_offering(
        &env,
        ("s-2vcpu-4gb", REGION),
        3,
        telemetry(),
    )
    .await;
    assert!(first <= 50, "{first}");
}

#[tokio::test]
async fn a_restart_while_withdrawn_learns_the_stockout_again_without_a_failed_machine() {
    let env = Site::start().await;
    let state = env.env.dir.path().join("state");
    scenario::a_restart_while_withdrawn(&env, ("s-2vcpu-4gb", REGION), &state, telemetry()).await;
}

//! Stockouts and the project's server limit against the emulator, through the real client: a
//! sold-out type's Create returns its slot and withdraws the offering in that location, a probe
//! after the backoff (or the catalogue's availability flag) brings it back, a server limit with
//! room for two is learned from the 403 without a FAILED machine, bursts on a sold-out offering
//! cost one probe per backoff, and a restart re-learns a withdrawal with one request.

use std::sync::Arc;

use provider_core::cloud::Cloud;
use testkit::stockout::{self as scenario, Knobs};

use crate::harness::{Env, Options, PROVIDER};

impl Knobs for Env {
    fn cloud(&self) -> Arc<dyn Cloud> {
        self.cloud.clone()
    }

    fn provider(&self) -> &str {
        PROVIDER
    }

    fn sell_out(&self, server_type: &str, location: &str, sold_out: bool) {
        self.emulator.set_sold_out(server_type, location, sold_out);
    }

    fn set_limit(&self, limit: Option<u64>) {
        self.emulator
            .set_server_limit(limit.map(|l| usize::try_from(l).unwrap()));
    }

    fn create_requests(&self) -> usize {
        self.emulator.count("POST", "/servers")
    }

    fn requests(&self) -> usize {
        self.emulator.seen().len()
    }

    fn limit_api(&self) -> bool {
        false
    }
}

#[tokio::test]
async fn a_stockout_returns_the_slot_withdraws_the_offering_and_a_probe_brings_it_back() {
    let env = Env::new(Options::default()).await;
    scenario::a_stockout_and_its_return(&env, ("cx33", "nbg1"), ("cx23", "fsn1"), env.telemetry)
        .await;
}

#[tokio::test]
async fn the_catalogues_availability_flag_ends_a_withdrawal_at_once() {
    let env = Env::new(Options::default()).await;
    scenario::the_catalogue_flag_ends_a_withdrawal(&env, ("cx33", "nbg1"), env.telemetry).await;
}

#[tokio::test]
async fn a_server_limit_with_room_for_two_is_learned_without_a_failed_machine() {
    let env = Env::new(Options::default()).await;
    scenario::an_account_limit_with_room_for_two(&env, ("cx23", "nbg1"), 5, env.telemetry).await;
}

#[tokio::test]
async fn bursts_of_50_creates_on_a_sold_out_type_cost_one_probe_per_backoff() {
    let env = Env::new(Options::default()).await;
    let first =
        scenario::repeated_bursts_on_a_sold_out_offering(&env, ("cx33", "nbg1"), 3, env.telemetry)
            .await;
    assert!(first <= 50, "{first}");
}

#[tokio::test]
async fn a_restart_while_withdrawn_learns_the_stockout_again_without_a_failed_machine() {
    let env = Env::new(Options::default()).await;
    let state = env.dir.path().join("state");
    scenario::a_restart_while_withdrawn(&env, ("cx33", "nbg1"), &state, env.telemetry).await;
}

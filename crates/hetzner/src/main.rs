//! The `hetzner` binary: parses and validates the configuration, builds the fake or real
//! backend, and hands both to the shared provider runtime.

mod cli;

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use hetzner::catalog;
use provider_core::app::{self, Launch};
use provider_core::fake::{FakeCloud, FakeCloudProfile};
use provider_core::fleet::{CapacityBook, Fleet, PriceBook};
use provider_core::offerings::{self, Offering, OfferingRules};
use provider_core::telemetry::Telemetry;

use crate::cli::Cli;
use provider_core::config::BackendChoice as Mode;

/// Offering words and messages of the Hetzner provider.
pub const RULES: OfferingRules = OfferingRules {
    backend: "hetzner backend",
    type_key: "server_type",
    zone_key: "location",
    spot_message: "capacity_type \"spot\" is not offered by Hetzner Cloud (on-demand only)",
    metal_message: "capacity_type \"{}\" is not a Hetzner Cloud substrate (on-demand only; bare-metal is the separate Robot provider)",
};

fn load_offerings(cli: &Cli) -> Result<Vec<Offering>, String> {
    let offerings = if cli.common.offerings.is_empty() {
        offerings::default_mix(
            cli.common.seed_count,
            ["cx22", "cpx41"],
            [&cli.location_a, &cli.location_b],
        )
    } else {
        offerings::load(Path::new(&cli.common.offerings), &RULES)?
    };
    offerings::validate(&offerings, &RULES)?;
    Ok(offerings)
}

async fn launch(cli: Cli) -> Result<(), String> {
    let mode = cli::resolve_mode(&cli)?;
    let telemetry = Telemetry::new("bigfleet_hetzner");
    let offerings = load_offerings(&cli)?;
    let offering_count = offerings.len();
    let eur_usd = cli.eur_usd();
    let prices = Arc::new(PriceBook::new(move |server_type, _location| {
        catalog::pinned_price_eur(server_type).map(|eur| eur * eur_usd)
    }));
    let capacities = Arc::new(CapacityBook::new(catalog::pinned_capacity));
    let cloud: Arc<dyn provider_core::cloud::Cloud> = match mode {
        Mode::Fake => {
            tracing::warn!(
                "using the IN-MEMORY fake Hetzner backend (dev / conformance only) — no real servers will be created"
            );
            Arc::new(FakeCloud::new(FakeCloudProfile {
                name: "hcloudfake",
                host_noun: "server",
                id_base: 1_000_000,
                ip_prefix: "203.0.113",
                price_usd: 0.0065,
                latency: cli.common.fake_latency,
                capacity: catalog::pinned_capacity,
            }))
        }
        Mode::Real => real_cloud(&cli, &offerings, telemetry)?,
    };
    let fleet = Arc::new(Fleet::new(
        cloud,
        cli.provider.clone(),
        offerings,
        prices,
        capacities,
        catalog::extra_labels,
    ));
    let (addr, provider, metrics_addr) = (
        cli.common.addr.clone(),
        cli.provider.clone(),
        cli.common.metrics_addr.clone(),
    );
    let announce = Box::new(move |security: provider_core::tls::SecurityMode| {
        tracing::info!(
            version = env!("CARGO_PKG_VERSION"),
            addr,
            provider,
            hetzner_backend = match mode {
                Mode::Real => "hetzner",
                Mode::Fake => "fake",
            },
            security = security.name(),
            offerings = offering_count,
            metrics_addr,
            "serving CapacityProvider"
        );
    });
    app::run(Launch {
        common: cli.common,
        backend: fleet.clone(),
        fleet: Some(fleet),
        telemetry,
        announce,
        side_servers: Vec::new(),
        require_zone: true,
        real_backend: mode == Mode::Real,
        leading: Default::default(),
    })
    .await
}

/// The real Hetzner Cloud backend.
fn real_cloud(
    cli: &Cli,
    offerings: &[Offering],
    telemetry: Telemetry,
) -> Result<Arc<dyn provider_core::cloud::Cloud>, String> {
    hetzner::real::build(cli_to_real(cli), offerings, telemetry)
}

fn cli_to_real(cli: &Cli) -> hetzner::real::RealArgs {
    hetzner::real::RealArgs {
        token: cli.token.clone(),
        endpoint: cli.hcloud_endpoint.clone(),
        provider: cli.provider.clone(),
        image: cli.common.image.clone(),
        ssh_key: cli.ssh_key.clone(),
        ssh_user: cli.ssh_user.clone(),
        ssh_port: cli.ssh_port,
        network: cli.network.clone(),
        ssh_address: cli.ssh_address.clone(),
        bootstrap_hook: cli.bootstrap_hook.clone(),
        readiness_command: cli.readiness_command.clone(),
        base_user_data: cli.common.base_user_data.clone(),
        eur_usd: cli.eur_usd(),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (common, command) = (cli.common.clone(), cli.command.clone());
    app::main_entry("hetzner", &common, command, || launch(cli))
}

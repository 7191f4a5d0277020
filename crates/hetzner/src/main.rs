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

/// The server-settings fields of `--offerings` (none for the default mix).
fn load_overrides(cli: &Cli) -> Result<Vec<hetzner::settings::Overrides>, String> {
    if cli.common.offerings.is_empty() {
        return Ok(Vec::new());
    }
    hetzner::settings::load_overrides(Path::new(&cli.common.offerings))
}

fn load_offerings(cli: &Cli) -> Result<Vec<Offering>, String> {
    let offerings = if cli.common.offerings.is_empty() {
        offerings::default_mix(
            cli.common.seed_count,
            catalog::DEFAULT_MIX,
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
    let mut offerings = load_offerings(&cli)?;
    if mode == Mode::Real && cli.common.offerings.is_empty() {
        offerings = hetzner::real::revise_default_mix(&cli_to_real(&cli)?, offerings).await;
    }
    let offering_count = offerings.len();
    let eur_usd = cli.eur_usd();
    let prices = Arc::new(PriceBook::new(move |server_type, _location| {
        catalog::pinned_price_eur(server_type).map(|eur| eur * eur_usd)
    }));
    let capacities = Arc::new(CapacityBook::new(catalog::pinned_capacity));
    let leading = provider_core::replica::Leading::default();
    let cloud: Arc<dyn provider_core::cloud::Cloud> = match mode {
        Mode::Fake => {
            tracing::warn!(
                "using the IN-MEMORY fake Hetzner backend (dev / conformance only) — no real servers will be created"
            );
            let fake = Arc::new(FakeCloud::new(FakeCloudProfile {
                name: "hcloudfake",
                host_noun: "server",
                id_base: 1_000_000,
                ip_prefix: "203.0.113",
                price_usd: 0.0065,
                latency: cli.common.fake_latency,
                capacity: catalog::pinned_capacity,
            }));
            // A replica that takes an etcd state over finds its servers in the fake cloud.
            let restored = fake.clone();
            leading.on_takeover(move |snapshot| restored.restore(snapshot));
            fake
        }
        Mode::Real => real_cloud(&cli, &offerings, telemetry).await?,
    };
    let fleet = Arc::new(
        Fleet::new(
            cloud,
            cli.provider.clone(),
            offerings,
            prices,
            capacities,
            |_| provider_core::StringMap::new(),
        )
        .with_stockout_backoff(cli.common.stockout_backoff())
        .with_telemetry(telemetry),
    );
    let (addr, provider, metrics_addr) = (
        cli.common.addr.clone(),
        cli.provider.clone(),
        cli.common.metrics_addr.clone(),
    );
    let announce = Box::new(
        move |security: provider_core::tls::SecurityMode,
              shard_identity: provider_core::identity::ShardIdentity| {
            tracing::info!(
                version = env!("CARGO_PKG_VERSION"),
                addr,
                provider,
                hetzner_backend = match mode {
                    Mode::Real => "hetzner",
                    Mode::Fake => "fake",
                },
                security = security.name(),
                shard_identity = shard_identity.name(),
                offerings = offering_count,
                metrics_addr,
                "serving CapacityProvider"
            );
        },
    );
    app::run(Launch {
        common: cli.common,
        backend: fleet.clone(),
        fleet: Some(fleet),
        telemetry,
        announce,
        side_servers: Vec::new(),
        require_zone: true,
        real_backend: mode == Mode::Real,
        leading,
    })
    .await
}

/// The real Hetzner Cloud backend, its offerings' settings resolved against the API (a
/// broken setting fails here, before any port binds).
async fn real_cloud(
    cli: &Cli,
    offerings: &[Offering],
    telemetry: Telemetry,
) -> Result<Arc<dyn provider_core::cloud::Cloud>, String> {
    let mut cloud = hetzner::real::build_cloud(cli_to_real(cli)?, offerings, telemetry)?;
    cloud
        .api()
        .budget()
        .set_shares(cli.common.api_budget_shares());
    cloud.set_plan_file(hetzner::plan_cache::PlanFile::for_state(&cli.common.state));
    cloud.resolve().await?;
    Ok(Arc::new(cloud))
}

fn cli_to_real(cli: &Cli) -> Result<hetzner::real::RealArgs, String> {
    Ok(hetzner::real::RealArgs {
        token: cli.token.clone(),
        endpoint: cli.hcloud_endpoint.clone(),
        provider: cli.provider.clone(),
        image: cli.common.image.clone(),
        ssh_key: cli.ssh_key.clone(),
        ssh_user: cli.ssh_user.clone(),
        ssh_port: cli.ssh_port,
        image_selector: cli.image_selector.clone(),
        networks: cli.network.clone(),
        firewalls: cli.firewall.clone(),
        public_ipv4: cli.public_ipv4,
        public_ipv6: cli.public_ipv6,
        ssh_address: cli.ssh_address.clone(),
        placement: cli.placement.clone(),
        server_labels: cli.server_label.clone(),
        login_ssh_keys: cli.login_ssh_key.clone(),
        overrides: load_overrides(cli)?,
        bootstrap_hook: cli.bootstrap_hook.clone(),
        readiness_command: cli.readiness_command.clone(),
        base_user_data: cli.common.base_user_data.clone(),
        eur_usd: cli.eur_usd(),
    })
}

/// `hetzner check [--json] <serving flags>`.
fn check(options: provider_core::check::CheckOptions, cli: Cli) -> ExitCode {
    let common = cli.common.clone();
    provider_core::check::entry("hetzner", &common, options, |mut report| async move {
        provider_core::check::common_checks(&mut report, &cli.common);
        report.progress("offerings");
        let offerings = match load_offerings(&cli) {
            Ok(o) => o,
            Err(e) => {
                report.problem("--offerings", e);
                return (report, Ok(()));
            }
        };
        match cli_to_real(&cli) {
            Ok(args) => hetzner::check::run(&mut report, &args, &offerings).await,
            Err(e) => report.problem("--offerings", e),
        }
        (report, Ok(()))
    })
}

fn main() -> ExitCode {
    if let Some((options, args)) = provider_core::check::split_args(std::env::args_os()) {
        return check(options, Cli::parse_from(args));
    }
    let cli = Cli::parse();
    let (common, command) = (cli.common.clone(), cli.command.clone());
    app::main_entry("hetzner", &common, command, || launch(cli))
}

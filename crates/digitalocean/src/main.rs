//! The `digitalocean` binary: parses and validates the configuration, builds the fake or real
//! backend (with its HTTPS bootstrap channel), and hands both to the shared provider runtime.

mod cli;

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use digitalocean::catalog;
use digitalocean::profile::{self, Wanted};
use provider_core::StringMap;
use provider_core::app::{self, Launch, SideServer};
use provider_core::check;
use provider_core::cloud::Cloud;
use provider_core::config::listen_addr;
use provider_core::fake::{FakeCloud, FakeCloudProfile};
use provider_core::fleet::{CapacityBook, Fleet, PriceBook};
use provider_core::offerings::{self, Offering, OfferingRules};
use provider_core::telemetry::Telemetry;

use crate::cli::Cli;
use provider_core::config::BackendChoice as Mode;

/// Offering words and messages of the DigitalOcean provider.
pub const RULES: OfferingRules = OfferingRules {
    backend: "digitalocean backend",
    type_key: "size",
    zone_key: "region",
    spot_message: "capacity_type \"spot\" is not offered by DigitalOcean (on-demand Droplets only)",
    metal_message: "capacity_type \"{}\" is not a DigitalOcean Droplet substrate (on-demand only)",
};

/// The offerings with each one's Droplet settings, checked offline.
fn load_offerings(cli: &Cli, mode: Mode) -> Result<(Vec<Offering>, Vec<Wanted>), String> {
    let offerings = load_offering_list(cli, mode)?;
    let fields = if cli.common.offerings.is_empty() {
        Vec::new()
    } else {
        let path = Path::new(&cli.common.offerings);
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("read offerings {}: {e}", path.display()))?;
        profile::offering_fields(&text)
            .map_err(|e| format!("parse offerings {}: {e}", path.display()))?
    };
    let wanted = profile::plan(
        &offerings,
        &fields,
        &cli.droplet_defaults(),
        mode == Mode::Real,
    )
    .map_err(|e| format!("digitalocean: {e}"))?;
    Ok((offerings, wanted))
}

fn load_offering_list(cli: &Cli, mode: Mode) -> Result<Vec<Offering>, String> {
    let offerings = if cli.common.offerings.is_empty() {
        // One process serves one region: with the real backend the default mix lives in
        // --region only, so no advertised slot is uncreatable.
        let (a, b) = match mode {
            Mode::Real => (cli.region.as_str(), cli.region.as_str()),
            Mode::Fake => (cli.region_a.as_str(), cli.region_b.as_str()),
        };
        if mode == Mode::Real && (cli.region_a != cli.region || cli.region_b != cli.region) {
            tracing::info!(
                region = cli.region,
                "default offering mix placed in --region only (one process serves one region)"
            );
        }
        offerings::merge_same_placement(offerings::default_mix(
            cli.common.seed_count,
            catalog::DEFAULT_MIX,
            [a, b],
        ))
    } else {
        offerings::load(Path::new(&cli.common.offerings), &RULES)?
    };
    offerings::validate(&offerings, &RULES)?;
    if mode == Mode::Real
        && let Some(o) = offerings.iter().find(|o| o.zone != cli.region)
    {
        return Err(format!(
            "digitalocean backend: offering {}/{}: region {:?} is not this provider's --region {:?} (one process serves one region; run another provider for that region)",
            o.instance_type, o.zone, o.zone, cli.region
        ));
    }
    for o in &offerings {
        if catalog::pinned_price_usd(&o.instance_type).is_none() && mode == Mode::Fake {
            return Err(format!(
                "digitalocean backend: offering {}/{}: size {:?} has no pinned price and the fake backend cannot price it",
                o.instance_type, o.zone, o.instance_type
            ));
        }
    }
    Ok(offerings)
}

fn real_flags(cli: &Cli, base_user_data: Option<String>) -> digitalocean::RealFlags {
    digitalocean::RealFlags {
        provider: cli.provider.clone(),
        token: zeroize::Zeroizing::new(cli.token.expose().to_owned()),
        region: cli.region.clone(),
        image: cli.common.image.clone(),
        api_url: cli.do_api_url.clone(),
        base_user_data,
        bootstrap_addr: cli.bootstrap_addr.clone(),
        bootstrap_endpoint: cli.bootstrap_endpoint.clone(),
        bootstrap_tls_cert: cli.bootstrap_tls_cert.clone(),
        bootstrap_tls_key: cli.bootstrap_tls_key.clone(),
        bootstrap_ca: cli.bootstrap_ca.clone(),
        bootstrap_secret: zeroize::Zeroizing::new(cli.bootstrap_secret.expose().to_owned()),
        bootstrap_max_connections: cli.bootstrap_max_connections as usize,
        bootstrap_max_connections_per_address: cli.bootstrap_max_connections_per_address as usize,
        bootstrap_enrollment_source: cli.bootstrap_enrollment_source,
        state: cli.common.state.clone(),
    }
}

/// Checks the built-in default mix against the API's catalogue before anything is resolved: a
/// size DigitalOcean does not sell in the region now is replaced by its successor there (or
/// kept, to be withdrawn, when none is sold), and each change is logged with why. Returns
/// whether the mix changed. When the API does not answer, the mix stays as it is.
async fn revise_default_mix(
    api: &digitalocean::api::ApiClient,
    offerings: &mut Vec<Offering>,
) -> bool {
    let deadline = tokio::time::Instant::now() + provider_core::fleet::WARMUP_BUDGET;
    let read = async {
        Ok::<_, String>((
            api.list_sizes(deadline).await.map_err(|e| e.to_string())?,
            api.list_regions(deadline)
                .await
                .map_err(|e| e.to_string())?,
        ))
    };
    let (sizes, regions) = match read.await {
        Ok(read) => read,
        Err(err) => {
            tracing::warn!(
                err,
                "default offerings: the catalogue could not be read; checking them again at warm-up"
            );
            return false;
        }
    };
    let revisions = catalog::revise_default_mix(offerings, &sizes, &regions);
    for (region, from, to, why) in &revisions {
        match to {
            Some(to) => tracing::warn!(
                region,
                from,
                to,
                why,
                "default offerings: replaced a size DigitalOcean no longer sells there by its successor"
            ),
            None => tracing::warn!(
                region,
                size = from,
                why,
                "default offerings: no successor is sold there; the offering is withdrawn until DigitalOcean sells the size again"
            ),
        }
    }
    if revisions.is_empty() {
        return false;
    }
    *offerings = offerings::merge_same_placement(std::mem::take(offerings));
    true
}

fn no_extra_labels(_size: &str) -> StringMap {
    StringMap::new()
}

async fn launch(cli: Cli) -> Result<(), String> {
    let mode = cli::resolve_mode(&cli)?;
    let telemetry = Telemetry::new("bigfleet_digitalocean");
    let (mut offerings, mut wanted) = load_offerings(&cli, mode)?;
    let offering_count = offerings.len();
    let prices = Arc::new(PriceBook::new(|size, _region| {
        catalog::pinned_price_usd(size)
    }));
    let capacities = Arc::new(CapacityBook::new(catalog::pinned_capacity));
    let mut side_servers: Vec<SideServer> = Vec::new();
    // Set while this replica serves; the bootstrap channel answers 503 otherwise.
    let leading = provider_core::replica::Leading::default();
    let cloud: Arc<dyn Cloud> = match mode {
        Mode::Fake => {
            tracing::warn!(
                "using the IN-MEMORY fake DigitalOcean backend (dev / conformance only) — no real Droplets will be created"
            );
            let fake = Arc::new(FakeCloud::new(FakeCloudProfile {
                name: "dofake",
                host_noun: "droplet",
                id_base: 300_000_000,
                ip_prefix: "198.51.100",
                price_usd: 0.03571,
                latency: cli.common.fake_latency,
                capacity: catalog::pinned_capacity,
            }));
            // A replica that takes an etcd state over finds its Droplets in the fake cloud.
            let restored = fake.clone();
            leading.on_takeover(move |snapshot| restored.restore(snapshot));
            fake
        }
        Mode::Real => {
            let flags = real_flags(&cli, cli.common.read_base_user_data()?);
            let real = digitalocean::build_real(&flags, telemetry)?;
            real.api.budget().set_shares(cli.common.api_budget_shares());
            if cli.common.offerings.is_empty()
                && revise_default_mix(&real.api, &mut offerings).await
            {
                wanted = profile::plan(&offerings, &[], &cli.droplet_defaults(), true)
                    .map_err(|e| format!("digitalocean: {e}"))?;
            }
            let real = real.resolve(&wanted).await?;
            let channel = real.channel.clone();
            channel.serve_while(leading.clone());
            channel.record_enrollments_in(leading.clone());
            let addr = real.bootstrap_addr.clone();
            let reloader = real.channel_reloader;
            side_servers.push(Box::new(move |stop| {
                Box::pin(async move {
                    let listener = tokio::net::TcpListener::bind(listen_addr(&addr))
                        .await
                        .map_err(|e| format!("listen on --bootstrap-addr {addr}: {e}"))?;
                    // The channel's keypair follows its files from now on.
                    tokio::spawn(reloader.run(provider_core::tls::RELOAD_INTERVAL, stop.clone()));
                    Ok(tokio::spawn(async move {
                        tracing::info!(addr, "serving on-host agent bootstrap channel");
                        if let Err(e) = channel
                            .serve(listener, async move { stop.cancelled().await })
                            .await
                        {
                            tracing::error!(error = %e, "bootstrap channel server");
                        }
                    }))
                })
            }));
            real.cloud
        }
    };
    let fleet = Arc::new(
        Fleet::new(
            cloud,
            cli.provider.clone(),
            offerings,
            prices,
            capacities,
            no_extra_labels,
        )
        .with_stockout_backoff(cli.common.stockout_backoff())
        .with_telemetry(telemetry),
    );
    let (addr, provider, region, metrics_addr) = (
        cli.common.addr.clone(),
        cli.provider.clone(),
        cli.region.clone(),
        cli.common.metrics_addr.clone(),
    );
    let announce = Box::new(
        move |security: provider_core::tls::SecurityMode,
              shard_identity: provider_core::identity::ShardIdentity| {
            tracing::info!(
                version = env!("CARGO_PKG_VERSION"),
                addr,
                provider,
                do_backend = match mode {
                    Mode::Real => "digitalocean",
                    Mode::Fake => "fake",
                },
                region,
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
        side_servers,
        require_zone: true,
        real_backend: mode == Mode::Real,
        leading,
    })
    .await
}

/// `digitalocean check [--json] <serving flags>`: every check, read-only, one line each.
fn check_entry(cli: Cli, options: check::CheckOptions) -> ExitCode {
    let common = cli.common.clone();
    check::entry("digitalocean", &common, options, |mut report| async move {
        let outcome = run_checks(&cli, &mut report).await;
        (report, outcome)
    })
}

async fn run_checks(cli: &Cli, report: &mut check::Report) -> Result<(), String> {
    check::common_checks(report, &cli.common);
    if cli.region.is_empty() {
        report.problem("--region", "not set (one process serves one region)");
    } else {
        report.ok("--region", cli.region.clone());
    }
    report.progress("offerings");
    let (wanted, slots) = match load_offerings(cli, Mode::Real) {
        Ok((offerings, wanted)) => {
            let what = if cli.common.offerings.is_empty() {
                "the default mix".to_owned()
            } else {
                cli.common.offerings.clone()
            };
            report.ok(
                "--offerings",
                format!("{what}: {} offerings, settings valid", offerings.len()),
            );
            let slots = offerings.iter().map(|o| o.count.max(0) as u64).sum();
            (wanted, slots)
        }
        Err(e) => {
            report.problem("--offerings", e);
            (Vec::new(), 0)
        }
    };
    let flags = real_flags(cli, None);
    digitalocean::check::bootstrap_checks(report, &flags);
    let base = match digitalocean::api::parse_base_url(&cli.do_api_url) {
        Ok(base) => base,
        Err(e) => {
            report.problem("--do-api-url", e);
            return Ok(());
        }
    };
    let Some(token) = digitalocean::api::ApiToken::new(cli.token.expose()) else {
        report.problem("token", "not set (--token or DIGITALOCEAN_TOKEN)");
        return Ok(());
    };
    let api = digitalocean::api::ApiClient::new(
        base,
        token,
        provider_core::retry::Backoff::default(),
        Telemetry::new("bigfleet_digitalocean_check"),
    )?;
    let deadline = tokio::time::Instant::now() + digitalocean::setup::STARTUP_CHECK_BUDGET;
    digitalocean::check::api_checks(report, &api, &wanted, slots, &cli.provider, deadline).await;
    Ok(())
}

fn main() -> ExitCode {
    if let Some((options, args)) = check::split_args(std::env::args_os()) {
        return check_entry(Cli::parse_from(args), options);
    }
    let cli = Cli::parse();
    let (common, command) = (cli.common.clone(), cli.command.clone());
    app::main_entry("digitalocean", &common, command, || launch(cli))
}

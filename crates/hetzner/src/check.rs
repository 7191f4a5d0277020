//! `hetzner check`: the read-only run of every check the serving flags can fail. One line per
//! check: the token works; each offering's server type and location exist, have a price and
//! can be ordered; its image resolves for its architecture; every network, subnet, firewall and
//! login SSH key exists; its public IPs and SSH address work together; the provider's SSH key
//! parses. (TLS material and base user data are checked by `provider_core::check`.) Only `GET`
//! requests are made.

use provider_core::check::Report;
use provider_core::offerings::Offering;
use provider_core::telemetry::Telemetry;
use tokio::time::Instant;

use crate::api::{ClientTiming, HcloudApi};
use crate::real::{self, RealArgs};
use crate::resolve::{Resolver, Sink};
use crate::settings::{self, Placement};

struct Lines<'a>(&'a mut Report);

impl Sink for Lines<'_> {
    fn line(&mut self, check: String, result: Result<String, String>) {
        self.0.record(check, result);
    }

    fn progress(&mut self, what: &str) {
        self.0.progress(what);
    }
}

/// Fills `report` with the Hetzner checks of `args` and `offerings`.
pub async fn run(report: &mut Report, args: &RealArgs, offerings: &[Offering]) {
    report.progress("the provider's SSH key");
    match real::ssh_config(args) {
        Ok(Some(config)) => report.ok(
            "--ssh-key",
            format!(
                "{} parses (user {}, port {})",
                args.ssh_key, config.user, config.port
            ),
        ),
        Ok(None) => report.problem(
            "--ssh-key",
            "not set: Configure cannot deliver bootstrap blobs and Drain cannot drain nodes",
        ),
        Err(e) => report.problem("--ssh-key", e),
    }
    let (_, specs) = match real::specs(args, offerings) {
        Ok(specs) => specs,
        Err(e) => {
            report.problem("server settings", e);
            return;
        }
    };
    let mut usable = Vec::new();
    for spec in &specs {
        let key = spec.key();
        let combination = settings::check_images(spec).and_then(|()| spec.validate());
        let found = format!(
            "SSH over {} (public IPv4 {}, public IPv6 {}, {} network(s))",
            spec.spec.ssh_address.name(),
            if spec.spec.public_ipv4 { "on" } else { "off" },
            if spec.spec.public_ipv6 { "on" } else { "off" },
            spec.spec.networks.len()
        );
        let ok = combination.is_ok();
        report.record(
            format!("offering {key} ssh_address"),
            combination.map(|()| found),
        );
        if ok {
            usable.push(spec);
        }
    }
    if args.token.is_empty() {
        report.problem(
            "--token",
            "not set (--token or HCLOUD_TOKEN): no API check can run",
        );
        return;
    }
    let api = match HcloudApi::new(
        &args.endpoint,
        args.token.clone(),
        Telemetry::new("bigfleet_hetzner_check"),
        ClientTiming::default(),
    ) {
        Ok(api) => api,
        Err(e) => {
            report.problem("--hcloud-endpoint", e);
            return;
        }
    };
    let deadline = Instant::now() + std::time::Duration::from_secs(60);
    report.progress("the API token");
    match api.locations(Some(deadline)).await {
        Ok(locations) => report.ok(
            "--token",
            format!("the API answered ({} locations)", locations.len()),
        ),
        Err(e) => {
            let problem = if e.status() == Some(401) {
                "the API rejected the token (HTTP 401 unauthorized)".to_owned()
            } else {
                format!("the API at {} did not answer: {e}", args.endpoint)
            };
            report.problem("--token", problem);
            return;
        }
    }
    report.progress("the project's servers");
    let slots: i64 = offerings.iter().map(|o| o.count.max(0)).sum();
    match api.count_servers("", Some(deadline)).await {
        Ok(servers) => report.ok("server limit", server_headroom(servers, slots)),
        Err(e) => report.problem("server limit", format!("count the project's servers: {e}")),
    }
    let mut resolver = Resolver::new(&api, deadline);
    for spec in usable {
        let mut sink = Lines(report);
        resolver.resolve(spec, &mut sink).await;
        if spec.spec.placement == Placement::Spread {
            report.ok(
                format!("offering {} placement", spec.key()),
                "spread: provider-owned spread placement groups, opened as they fill up",
            );
        }
    }
}

/// The headroom line: Hetzner publishes no server limit, so only the servers held are known.
fn server_headroom(servers: u64, slots: i64) -> String {
    format!(
        "{servers} servers in the project, headroom unknown: Hetzner publishes no server limit; \
         the provider learns it from the first 403 resource_limit_exceeded and then lists no \
         more Speculative slots than the headroom (bigfleet_hetzner_account_headroom); the \
         offerings have {slots} slots"
    )
}

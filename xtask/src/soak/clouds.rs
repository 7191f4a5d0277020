//! The two clouds under the soak: each API emulator in this process (so its fault knobs are at
//! hand), the provider flags that point the real binary at it, and the seeded fault menu.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use tokio_util::sync::CancellationToken;

use super::{CREATE_TIMEOUT, Chance, common_flags, provider_spec};
use crate::e2e::provider_process::{self, Spec};
use crate::e2e::wire;

const HCLOUD_TOKEN: &str = "soak-hcloud-token-0123456789";
const DO_TOKEN: &str = "dop_v1_soak_api_token_0123456789";
const DO_SECRET: &str = "soak-bootstrap-secret-0123456789abcdef";
const DO_REGION: &str = "nyc3";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CloudKind {
    Hetzner,
    DigitalOcean,
}

impl CloudKind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            CloudKind::Hetzner => "hetzner",
            CloudKind::DigitalOcean => "digitalocean",
        }
    }
}

/// A running API emulator.
#[derive(Clone)]
pub(crate) enum Emulated {
    Hetzner(hcloud_emulator::Emulator),
    DigitalOcean {
        emulator: do_emulator::Emulator,
        url: String,
        stop: CancellationToken,
    },
}

impl Emulated {
    pub(crate) async fn start(kind: CloudKind) -> Result<Emulated> {
        Ok(match kind {
            CloudKind::Hetzner => Emulated::Hetzner(
                hcloud_emulator::Emulator::start(HCLOUD_TOKEN)
                    .await
                    .context("start the hcloud emulator")?,
            ),
            CloudKind::DigitalOcean => {
                let emulator = do_emulator::Emulator::new(DO_TOKEN);
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                    .await
                    .context("bind the DigitalOcean emulator")?;
                let url = format!("http://{}", listener.local_addr()?);
                let stop = CancellationToken::new();
                tokio::spawn(emulator.clone().serve(listener, stop.clone()));
                Emulated::DigitalOcean {
                    emulator,
                    url,
                    stop,
                }
            }
        })
    }

    pub(crate) fn kind(&self) -> CloudKind {
        match self {
            Emulated::Hetzner(_) => CloudKind::Hetzner,
            Emulated::DigitalOcean { .. } => CloudKind::DigitalOcean,
        }
    }

    pub(crate) fn stop(&self) {
        if let Emulated::DigitalOcean { stop, .. } = self {
            stop.cancel();
        }
    }

    /// Pages of three: a deletion between two page requests shifts hosts across pages often.
    pub(crate) fn small_pages(&self) {
        match self {
            Emulated::Hetzner(e) => e.set_max_per_page(3),
            Emulated::DigitalOcean { emulator, .. } => emulator.set_max_per_page(3),
        }
    }

    fn provider(&self) -> &'static str {
        match self {
            Emulated::Hetzner(_) => "soak-hetzner",
            Emulated::DigitalOcean { .. } => "soak-do",
        }
    }

    /// The provider process for this cloud, with its offerings written into `dir`.
    pub(crate) fn spec(&self, root: &Path, dir: &Path, machines: usize) -> Result<Spec> {
        let offerings = dir.join("offerings.json");
        let mut args = common_flags(dir);
        args.push(format!("--provider={}", self.provider()));
        args.push(format!("--offerings={}", offerings.display()));
        let (binary, text) = match self {
            Emulated::Hetzner(e) => {
                args.extend([
                    "--hetzner-backend=hetzner".to_owned(),
                    format!("--token={HCLOUD_TOKEN}"),
                    format!("--hcloud-endpoint={}", e.endpoint()),
                    "--image=ubuntu-24.04".to_owned(),
                ]);
                (
                    "hetzner",
                    format!(
                        r#"[{{"server_type": "cx23", "location": "nbg1", "count": {machines}}}]"#
                    ),
                )
            }
            Emulated::DigitalOcean { url, .. } => {
                let pki = wire::pki_dir(root);
                let pem = |name: &str| pki.join(name).display().to_string();
                let bootstrap = provider_process::free_port()?;
                args.extend([
                    format!("--token={DO_TOKEN}"),
                    format!("--region={DO_REGION}"),
                    "--image=ubuntu-24-04-x64".to_owned(),
                    format!("--do-api-url={url}"),
                    format!("--bootstrap-addr=127.0.0.1:{bootstrap}"),
                    format!("--bootstrap-endpoint=https://127.0.0.1:{bootstrap}"),
                    format!("--bootstrap-tls-cert={}", pem("server.pem")),
                    format!("--bootstrap-tls-key={}", pem("server-key.pem")),
                    format!("--bootstrap-ca={}", pem("ca.pem")),
                    format!("--bootstrap-secret={DO_SECRET}"),
                ]);
                (
                    "digitalocean",
                    format!(
                        r#"[{{"size": "s-1vcpu-2gb", "region": "{DO_REGION}", "count": {machines}}}]"#
                    ),
                )
            }
        };
        std::fs::write(&offerings, text)
            .with_context(|| format!("write {}", offerings.display()))?;
        // The API budget runs at its defaults (`--api-budget-share 0.5`,
        // `--api-reconcile-share 0.2`), as operators run it, against the cloud's real limits.
        Ok(provider_spec(root, binary, args))
    }

    /// The binary's name (for `admin failed release`).
    pub(crate) fn binary(&self) -> &'static str {
        self.kind().name()
    }

    /// Every live (not being deleted) host: `(host id, name)`. Names derive from machine ids.
    pub(crate) fn live_hosts(&self) -> Vec<(String, String)> {
        match self {
            Emulated::Hetzner(e) => e
                .live_servers()
                .into_iter()
                .map(|(id, name)| (id.to_string(), name))
                .collect(),
            Emulated::DigitalOcean { emulator, .. } => emulator
                .droplets()
                .into_iter()
                .map(|d| (d.id.to_string(), d.name))
                .collect(),
        }
    }

    /// The API requests the provider sent so far, by class, and their total.
    pub(crate) fn requests(&self) -> (usize, String) {
        let classes = match self {
            Emulated::Hetzner(e) => e.requests_by_class(),
            Emulated::DigitalOcean { emulator, .. } => emulator.requests_by_class(),
        };
        let total = classes.values().map(|(n, _)| n).sum();
        let text = classes
            .iter()
            .map(|(class, (n, _))| format!("{class}:{n}"))
            .collect::<Vec<_>>()
            .join(",");
        (total, text)
    }

    /// Whether host `id` is live.
    pub(crate) fn is_live(&self, id: &str) -> bool {
        self.live_hosts().iter().any(|(h, _)| h == id)
    }

    /// The soak's one offering: `(instance type, zone)`.
    fn offering(&self) -> (&'static str, &'static str) {
        match self {
            Emulated::Hetzner(_) => ("cx23", "nbg1"),
            Emulated::DigitalOcean { .. } => ("s-1vcpu-2gb", DO_REGION),
        }
    }

    /// Sells the offering out (`sold_out`) or sells it again: Hetzner answers a Create 412
    /// `resource_unavailable`, DigitalOcean 422 "Size is not available in this region.".
    fn sell_out(&self, sold_out: bool) {
        let (instance_type, zone) = self.offering();
        match self {
            Emulated::Hetzner(e) => e.set_sold_out(instance_type, zone, sold_out),
            Emulated::DigitalOcean { emulator, .. } => {
                emulator.set_sold_out(instance_type, zone, sold_out)
            }
        }
    }

    /// The account's host limit (`None`: lifted): Hetzner answers a Create beyond it 403
    /// `resource_limit_exceeded`, DigitalOcean 422 "… will exceed your droplet limit".
    fn limit_hosts(&self, limit: Option<usize>) {
        match self {
            Emulated::Hetzner(e) => e.set_server_limit(limit),
            Emulated::DigitalOcean { emulator, .. } => {
                emulator.set_droplet_limit(limit.map_or(u64::MAX, |l| l as u64))
            }
        }
    }

    /// A capacity fault for `lasting`: the offering sold out, or the account's limit at the
    /// hosts it holds plus up to two; lifted afterwards by a task of its own.
    fn capacity_fault(&self, chance: &mut Chance, lasting: Duration) -> &'static str {
        let stockout = chance.percent(50);
        if stockout {
            self.sell_out(true);
        } else {
            let room = chance.below(3) as usize;
            self.limit_hosts(Some(self.live_hosts().len() + room));
        }
        let cloud = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(lasting).await;
            if stockout {
                cloud.sell_out(false);
            } else {
                cloud.limit_hosts(None);
            }
        });
        if stockout {
            "stockout"
        } else {
            "account_limit"
        }
    }

    /// Injects one fault chosen by `chance`; returns its name for the counts and, for a 429
    /// storm or a 5xx burst, how long every request is answered with an error.
    pub(crate) fn inject_random(&self, chance: &mut Chance) -> (&'static str, Option<Duration>) {
        let (name, lasting) = self.inject_one(chance);
        let storm = matches!(name, "rate_limit_storm" | "server_error_burst");
        (name, storm.then_some(lasting))
    }

    /// Injects one fault; returns its name and the time drawn for it (how long it lasts, for
    /// storms, bursts and capacity faults).
    fn inject_one(&self, chance: &mut Chance) -> (&'static str, Duration) {
        let roll = chance.below(110);
        if roll >= 100 {
            // A sold-out offering or a full account lasts seconds here, minutes to days in a
            // real cloud; the provider runs with short stockout backoffs to match.
            let lasting = chance.millis(2_000, 8_000);
            return (self.capacity_fault(chance, lasting), lasting);
        }
        // A storm or burst lasts a while, however many requests meet it, as a cloud's
        // outages do: queued for a count of requests, it would last longer the fewer requests
        // the provider sends (one polling every booting host in one listing sends few).
        let lasting = chance.millis(100, 1000);
        let name = match self {
            Emulated::Hetzner(e) => {
                use hcloud_emulator::{CreateFault, Fault};
                match roll {
                    0..20 => {
                        e.inject_for(
                            lasting,
                            Fault::RateLimited {
                                retry_after: Some(1),
                                reset_in: Some(1),
                            },
                        );
                        "rate_limit_storm"
                    }
                    20..40 => {
                        let status = [500, 502, 503, 504][chance.below(4) as usize];
                        e.inject_for(lasting, Fault::ServerError(status));
                        "server_error_burst"
                    }
                    40..50 => {
                        e.inject_create([CreateFault::LoseResponse]);
                        "create_response_lost_after_commit"
                    }
                    50..58 => {
                        e.inject_create([CreateFault::Refuse(503)]);
                        "create_refused_before_commit"
                    }
                    58..62 => {
                        e.inject_create([CreateFault::Hang(Duration::from_secs(3))]);
                        "create_response_delayed"
                    }
                    62..72 => {
                        e.set_boot_time(Some(slow_boot(chance)));
                        "slow_boots"
                    }
                    72..84 => {
                        self.delete_random(chance);
                        "out_of_band_delete"
                    }
                    _ => {
                        e.delete_during_next_listings(1);
                        "delete_during_paged_listing"
                    }
                }
            }
            Emulated::DigitalOcean { emulator: e, .. } => {
                use do_emulator::Fault;
                match roll {
                    0..20 => {
                        e.fail_for(
                            lasting,
                            Fault {
                                status: 429,
                                retry_after: Some(1),
                            },
                        );
                        "rate_limit_storm"
                    }
                    20..40 => {
                        let status = [500, 502, 503, 504][chance.below(4) as usize];
                        e.fail_for(
                            lasting,
                            Fault {
                                status,
                                retry_after: None,
                            },
                        );
                        "server_error_burst"
                    }
                    40..52 => {
                        e.drop_create_responses(1);
                        "connection_dropped_after_create_commit"
                    }
                    52..60 => {
                        e.fail_next(
                            1,
                            Fault {
                                status: 502,
                                retry_after: None,
                            },
                        );
                        "request_refused_before_commit"
                    }
                    60..72 => {
                        e.set_boot_time(Some(slow_boot(chance)));
                        "slow_boots"
                    }
                    72..84 => {
                        self.delete_random(chance);
                        "out_of_band_delete"
                    }
                    _ => {
                        e.delete_during_next_listings(1);
                        "delete_during_paged_listing"
                    }
                }
            }
        };
        (name, lasting)
    }

    fn delete_random(&self, chance: &mut Chance) {
        let live = self.live_hosts();
        if live.is_empty() {
            return;
        }
        let (id, _) = &live[chance.below(live.len() as u64) as usize];
        match self {
            Emulated::Hetzner(e) => {
                if let Ok(id) = id.parse() {
                    e.delete_out_of_band(id);
                }
            }
            Emulated::DigitalOcean { emulator, .. } => {
                if let Ok(id) = id.parse() {
                    emulator.delete_out_of_band(id);
                }
            }
        }
    }

    /// Faults off for the settling phase (pages stay small).
    pub(crate) fn calm(&self) {
        self.sell_out(false);
        self.limit_hosts(None);
        match self {
            Emulated::Hetzner(e) => {
                e.set_polls_to_running(0);
                e.set_boot_time(None);
            }
            Emulated::DigitalOcean { emulator, .. } => {
                emulator.set_active_after_polls(0);
                emulator.set_boot_time(None);
            }
        }
    }
}

/// How long new hosts take to run: mostly a few seconds, sometimes longer than the Create
/// deadline. By time, as a cloud boots (the provider's batched polls look at every booting
/// host in one listing, so a count of reads would say little).
fn slow_boot(chance: &mut Chance) -> Duration {
    if chance.percent(15) {
        CREATE_TIMEOUT + Duration::from_secs(10)
    } else {
        Duration::from_millis(chance.below(4_000))
    }
}

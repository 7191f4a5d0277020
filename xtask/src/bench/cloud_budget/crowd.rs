//! The crowded bursts of `cloud-budget`: 200 Creates beside 1,000 hosts the provider already
//! owns (adopted at startup, surveyed and checked by its reconcile loop as the burst runs),
//! alone on the token or beside another user who spends half of the token's refill the whole
//! time. The binary runs with its default budget shares; what the figures are held to is the
//! time its share of the refill allows for the requests it sent, plus one boot.
//!
//! - Hetzner runs from a bucket another user emptied before the provider started, with the
//!   emulator's limit [`HETZNER_SCALE`] times faster (the binary reads the faster refill from
//!   `RateLimit-Reset`) and the reconcile floor and price refresh divided alike; boots and the
//!   binary's boot polls keep real time.
//! - DigitalOcean runs at its real limits in real time (its `RateLimit-Reset` gives no refill
//!   rate to scale) from a full bucket: the binary's share of the minute's 250 is what paces it.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use fleet_proto::v1alpha1 as pb;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::report::{Counts, Crowd};
use super::{Binaries, DEFAULT_SHARES, Facts, Lab, Rig, Setup, Spent, spare_slots};
use crate::bench::args::Cloud;
use crate::e2e::wire::state_of;

/// Creates in a crowded burst.
pub(super) const CREATES: usize = 200;
/// Hosts the provider owns before it.
pub(super) const OWNED: usize = 1_000;
/// How many times faster than real time the Hetzner limit runs.
pub(super) const HETZNER_SCALE: f64 = 10.0;
/// How long a crowded burst may take.
const DEADLINE: Duration = Duration::from_secs(900);
/// How often the other user takes its part.
const OTHER_TICK: Duration = Duration::from_millis(100);

/// The token's refill (requests a second) as the run's emulator gives it: Hetzner's one a
/// second time-scaled, DigitalOcean's 250 a minute (the limit that binds a burst).
fn refill(cloud: Cloud) -> f64 {
    match cloud {
        Cloud::Hetzner => HETZNER_SCALE,
        Cloud::DigitalOcean => 250.0 / 60.0,
    }
}

/// How many times faster than real time the run's limit goes.
fn scale(cloud: Cloud) -> f64 {
    match cloud {
        Cloud::Hetzner => HETZNER_SCALE,
        Cloud::DigitalOcean => 1.0,
    }
}

/// What the provider may spend at once before the refill paces it: nothing from Hetzner's
/// emptied bucket; its share of DigitalOcean's full minute.
fn allowance(cloud: Cloud) -> f64 {
    match cloud {
        Cloud::Hetzner => 0.0,
        Cloud::DigitalOcean => 250.0 * DEFAULT_SHARES.0,
    }
}

/// The time the provider's share of the refill allows for `requests`, and one boot.
pub(super) fn budget_time(cloud: Cloud, requests: usize) -> Duration {
    let paced = (requests as f64 - allowance(cloud)).max(0.0);
    Duration::from_secs_f64(paced / (DEFAULT_SHARES.0 * refill(cloud))) + cloud.boot()
}

/// The run's flags besides the backend's: reconcile left at its defaults (scaled with the
/// limit), so that its surveys and checks of the owned hosts run beside the burst.
fn flags(cloud: Cloud) -> Vec<String> {
    match cloud {
        Cloud::Hetzner => vec![
            format!(
                "--reconcile-interval={}s",
                super::RECONCILE_FLOOR.as_secs_f64() / HETZNER_SCALE
            ),
            format!(
                "--price-refresh={}s",
                super::PRICE_REFRESH.as_secs_f64() / HETZNER_SCALE
            ),
        ],
        Cloud::DigitalOcean => Vec::new(),
    }
}

/// How the crowded bursts were set up, for the report.
pub(super) fn conditions(clouds: &[Cloud]) -> Vec<String> {
    clouds
        .iter()
        .map(|&cloud| {
            let flags = flags(cloud);
            let flags = if flags.is_empty() {
                "the default flags".to_owned()
            } else {
                flags.join(" ")
            };
            match cloud {
                Cloud::Hetzner => format!(
                    "hetzner crowded bursts: {CREATES} Creates beside {OWNED} owned servers, the \
                     emulator's limit {HETZNER_SCALE}x real time and emptied by another user \
                     before the provider started, {flags}; budget time = requests / (0.5 x \
                     {HETZNER_SCALE} a second) + one 12 s boot (boots and boot polls in real \
                     time)"
                ),
                Cloud::DigitalOcean => format!(
                    "digitalocean crowded bursts: {CREATES} Creates beside {OWNED} owned Droplets, \
                     real limits in real time from a full bucket, {flags}; budget time = \
                     (requests - 125) / (0.5 x 250 a minute) + one 30 s boot"
                ),
            }
        })
        .collect()
}

/// Another user of the token who asks for half its refill every [`OTHER_TICK`] and takes what
/// the bucket has.
struct OtherUser {
    stop: CancellationToken,
    /// Ends with what it asked for and what it got.
    task: tokio::task::JoinHandle<(u32, u32)>,
}

impl OtherUser {
    fn start(lab: &Lab, cloud: Cloud) -> OtherUser {
        let stop = CancellationToken::new();
        let drain = lab.drainer();
        let per_tick = 0.5 * refill(cloud) * OTHER_TICK.as_secs_f64();
        let until = stop.clone();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(OTHER_TICK);
            let (mut owed, mut asked, mut got) = (0.0, 0, 0);
            loop {
                tokio::select! {
                    () = until.cancelled() => return (asked, got),
                    _ = tick.tick() => {}
                }
                owed += per_tick;
                let whole = owed.floor();
                owed -= whole;
                let n = whole as u32;
                asked += n;
                got += drain(n);
            }
        });
        OtherUser { stop, task }
    }

    /// Stops it; what it asked for and what it got.
    async fn stop(self) -> (u32, u32) {
        self.stop.cancel();
        self.task.await.unwrap_or_default()
    }
}

/// [`CREATES`] Creates of fresh slots beside [`OWNED`] owned hosts, with another user spending
/// half the refill when `shared`.
pub(super) async fn crowded(
    root: &Path,
    binaries: &Binaries,
    dir: &Path,
    cloud: Cloud,
    shared: bool,
) -> Result<Crowd> {
    let setup = Setup {
        cloud,
        slots: OWNED + CREATES,
        owned: OWNED,
        scale: scale(cloud),
        boot: cloud.boot(),
        configures: false,
        spent: match cloud {
            Cloud::Hetzner => Spent::All,
            Cloud::DigitalOcean => Spent::Nothing,
        },
        flags: flags(cloud),
    };
    let mut rig = Rig::start(root, binaries, dir, setup).await?;
    let outcome = crowded_on(&mut rig, shared).await;
    rig.finish(outcome).await
}

async fn crowded_on(rig: &mut Rig, shared: bool) -> Result<Crowd> {
    let cloud = rig.cloud;
    // The owned hosts keep their ids; the Creates take the spare slots, under the state's ids.
    let ids: Vec<String> = spare_slots(&mut rig.caller).await?[..CREATES].to_vec();
    let owned = rig
        .caller
        .list_all()
        .await
        .context("List")?
        .iter()
        .filter(|m| state_of(m) == pb::MachineState::Idle)
        .count();
    ensure!(owned == OWNED, "{owned} owned hosts adopted, want {OWNED}");
    let other = shared.then(|| OtherUser::start(&rig.lab, cloud));
    let before = rig.lab.counts();
    let started = Instant::now();
    for id in &ids {
        rig.caller
            .create(id)
            .await
            .with_context(|| format!("Create {id}"))?;
    }
    rig.until_idle(OWNED + CREATES, started + DEADLINE).await?;
    let wall = started.elapsed();
    let requests: Counts = super::report::since(&rig.lab.counts(), &before);
    let other = match other {
        Some(user) => Some(user.stop().await),
        None => None,
    };
    let live = rig.lab.live_hosts();
    ensure!(
        live == OWNED + CREATES,
        "{live} hosts in the cloud, want {}",
        OWNED + CREATES
    );
    Ok(Crowd {
        cloud,
        owned: OWNED,
        creates: CREATES,
        scale: scale(cloud),
        other,
        budget: budget_time(cloud, super::report::total(&requests)),
        requests,
        wall,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_time_is_the_share_of_the_refill_and_a_boot() {
        // 240 requests at half of 10 a second, and the 12 s boot.
        assert_eq!(
            budget_time(Cloud::Hetzner, 240),
            Duration::from_secs(48 + 12)
        );
        // 125 at once from the full minute, the other 300 at half of 250 a minute.
        assert_eq!(
            budget_time(Cloud::DigitalOcean, 425),
            Duration::from_secs(144 + 30)
        );
        assert_eq!(
            budget_time(Cloud::DigitalOcean, 100),
            Duration::from_secs(30)
        );
        assert_eq!(
            flags(Cloud::Hetzner),
            ["--reconcile-interval=12s", "--price-refresh=180s"]
        );
    }
}

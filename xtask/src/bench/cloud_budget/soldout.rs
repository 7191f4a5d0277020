//! The `soldout` run of `cloud-budget`: what a sold-out offering costs the cloud API. The
//! provider's one offering is sold out at the emulator (Hetzner 412 `resource_unavailable`,
//! DigitalOcean 422 "Size is not available in this region.") while a shard creates every slot
//! it lists, twice a second, for an hour at a time scale of [`SCALE`]: the stockout backoffs are
//! the defaults divided by it (`--stockout-backoff` 5m and `--stockout-backoff-max` 30m become
//! 3 s and 18 s), so the requests the emulator counts in [`HOUR`] of real time are those of an
//! hour. No machine may end FAILED.

use std::path::Path;
use std::time::Duration;

use anyhow::{Result, bail};
use fleet_proto::v1alpha1 as pb;
use serde_json::{Value, json};
use tokio::time::Instant;

use super::report::{self, Counts, total};
use super::{Binaries, Facts, Lab, Rig, Setup, Spent, digitalocean, hetzner, transition_flags};
use crate::bench::args::Cloud;
use crate::e2e::digitalocean_real::REGION;
use crate::e2e::wire::state_of;

/// How many times faster than real time the backoffs run.
pub(super) const SCALE: f64 = 100.0;
/// One scaled hour.
const HOUR: Duration = Duration::from_secs(36);
/// The slots of the sold-out offering.
const SLOTS: usize = 20;
/// How often the shard creates every slot it lists.
const EVERY: Duration = Duration::from_millis(500);

/// What a sold-out offering cost over one scaled hour.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Soldout {
    pub cloud: Cloud,
    /// Creates the shard sent (each answered; those on withdrawn slots sent nothing on).
    pub creates: usize,
    /// Create requests the cloud got (the first refusal and the probes).
    pub create_requests: usize,
    /// Every request the cloud got over the hour, by class.
    pub requests: Counts,
    /// Scaled seconds from the start to each create request the cloud got.
    pub timeline: Vec<f64>,
}

pub(super) async fn soldout(
    root: &Path,
    binaries: &Binaries,
    dir: &Path,
    cloud: Cloud,
) -> Result<Soldout> {
    let mut flags = transition_flags();
    flags.extend([
        format!("--stockout-backoff={}ms", (300_000.0 / SCALE) as u64),
        format!("--stockout-backoff-max={}ms", (1_800_000.0 / SCALE) as u64),
    ]);
    let setup = Setup {
        cloud,
        slots: SLOTS,
        owned: 0,
        scale: 1.0,
        boot: cloud.boot(),
        configures: false,
        spent: Spent::Nothing,
        flags,
    };
    let mut rig = Rig::start(root, binaries, dir, setup).await?;
    let outcome = soldout_on(&mut rig).await;
    rig.finish(outcome).await
}

fn sell_out(lab: &Lab) {
    match lab {
        Lab::Hetzner(lab) => {
            lab.emulator
                .set_sold_out(hetzner::SERVER_TYPE, hetzner::LOCATION, true)
        }
        Lab::DigitalOcean(lab) => lab.emulator.set_sold_out(digitalocean::SIZE, REGION, true),
    }
}

fn create_requests(counts: &Counts) -> usize {
    counts.get("create").map_or(0, |(n, _)| *n)
}

async fn soldout_on(rig: &mut Rig) -> Result<Soldout> {
    let before = rig.quiet().await?;
    sell_out(&rig.lab);
    let start = Instant::now();
    let mut creates = 0;
    let mut timeline = Vec::new();
    let mut seen = 0;
    while start.elapsed() < HOUR {
        let listed = rig
            .caller
            .list(pb::ListFilter {
                states: vec![pb::MachineState::Speculative as i32],
                ..Default::default()
            })
            .await?
            .machines;
        for m in listed {
            if rig.caller.create(&m.id).await.is_ok() {
                creates += 1;
            }
        }
        tokio::time::sleep(EVERY).await;
        let sent = create_requests(&report::since(&rig.lab.counts(), &before));
        for _ in seen..sent {
            timeline.push(start.elapsed().as_secs_f64() * SCALE);
        }
        seen = sent;
        for m in rig.caller.list_all().await? {
            if state_of(&m) == pb::MachineState::Failed {
                bail!("{} went FAILED: {}", m.id, m.last_error);
            }
        }
    }
    let requests = report::since(&rig.lab.counts(), &before);
    Ok(Soldout {
        cloud: rig.cloud,
        creates,
        create_requests: create_requests(&requests),
        requests,
        timeline,
    })
}

/// One line for the progress output.
pub(super) fn summary(s: &Soldout) -> String {
    format!(
        "{} Creates, {} create requests, {} requests in a scaled hour",
        s.creates,
        s.create_requests,
        total(&s.requests)
    )
}

/// The Markdown table of the runs.
pub(super) fn render(runs: &[Soldout]) -> String {
    if runs.is_empty() {
        return String::new();
    }
    let mut out = format!(
        "A sold-out offering for an hour (backoffs scaled {}x), a shard creating every listed \
         slot twice a second:\n\n| cloud | Creates sent | create requests | all requests | \
         create requests at (minutes) |\n|---|---:|---:|---:|---|\n",
        SCALE
    );
    for s in runs {
        let at: Vec<String> = s
            .timeline
            .iter()
            .map(|t| format!("{:.1}", t / 60.0))
            .collect();
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} |\n",
            s.cloud.name(),
            s.creates,
            s.create_requests,
            total(&s.requests),
            at.join(", ")
        ));
    }
    out.push('\n');
    out
}

pub(super) fn to_json(runs: &[Soldout]) -> Value {
    json!(
        runs.iter()
            .map(|s| json!({
                "cloud": s.cloud.name(),
                "time_scale": SCALE,
                "creates": s.creates,
                "create_requests_per_hour": s.create_requests,
                "requests_per_hour": total(&s.requests),
                "create_requests_at_seconds": s.timeline,
            }))
            .collect::<Vec<_>>()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_lists_each_cloud_with_its_probes() {
        let run = Soldout {
            cloud: Cloud::Hetzner,
            creates: 300,
            create_requests: 5,
            requests: Counts::from([("create", (5, 0)), ("listing", (9, 0))]),
            timeline: vec![0.0, 270.0, 780.0],
        };
        let table = render(std::slice::from_ref(&run));
        assert!(
            table.contains("| hetzner | 300 | 5 | 14 | 0.0, 4.5, 13.0 |"),
            "{table}"
        );
        assert_eq!(to_json(&[run])[0]["create_requests_per_hour"], 5);
        assert!(render(&[]).is_empty());
    }
}

//! One catalogue refresh of the offerings-driven backend: reads the cloud's catalogue (when it
//! has one) into the [`Fleet`]'s prices, capacities and standings, then says where the offerings
//! stand: a WARN and the gauges per deprecated or withdrawn offering, and at startup the verdict
//! (serve the offerings that can be ordered; refuse only when none can).

use std::time::Duration;

use crate::observability::telemetry::Telemetry;
use crate::provisioning::catalogue::{Deprecation, now_unix};
use crate::provisioning::fleet::Fleet;

/// What one catalogue refresh did.
#[derive(Debug, PartialEq)]
pub enum Refresh {
    /// This cloud has no catalogue read: prices and capacities are read the older way.
    Unsupported,
    /// The read failed; what the provider knew stays.
    Failed(String),
    /// Prices, capacities and standings of the offered pairs were replaced.
    Done,
}

/// Reads the cloud's catalogue within `budget` and applies it to `fleet`.
pub async fn refresh(fleet: &Fleet, budget: Duration) -> Refresh {
    let pairs = fleet.price_pairs();
    let read = crate::provisioning::budget::scoped(
        crate::provisioning::budget::Class::Refresh,
        fleet.cloud().catalogue(&pairs),
    );
    match tokio::time::timeout(budget, read).await {
        Err(_) => Refresh::Failed("the catalogue read timed out".into()),
        Ok(Err(e)) => Refresh::Failed(e.0),
        Ok(Ok(None)) => Refresh::Unsupported,
        Ok(Ok(Some(catalogue))) => {
            fleet.apply_catalogue(catalogue);
            read_account(fleet, budget).await;
            Refresh::Done
        }
    }
}

/// Reads the account's hosts and limit into the fleet's headroom; a failure keeps what is
/// known.
async fn read_account(fleet: &Fleet, budget: Duration) {
    match fleet.read_account(budget).await {
        Ok(Some(account)) => tracing::debug!(
            hosts = account.hosts,
            limit = account.limit,
            headroom = fleet.headroom().headroom(),
            "account: hosts and limit read"
        ),
        Ok(None) => {}
        Err(e) => {
            tracing::warn!(err = %e, "account: reading the account's hosts failed; keeping the headroom known")
        }
    }
}

/// An offering that cannot be ordered now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Withdrawn {
    pub instance_type: String,
    pub zone: String,
    pub why: String,
}

/// Says where the offerings stand: a WARN per announced deprecation (with its date) and per
/// withdrawn offering, and the gauges of both. Returns the withdrawn offerings.
pub fn announce(fleet: &Fleet, telemetry: Telemetry) -> Vec<Withdrawn> {
    let now = now_unix();
    let mut withdrawn = Vec::new();
    for (instance_type, zone) in fleet.price_pairs() {
        let standing = fleet.standings().get(&instance_type, &zone);
        let why = standing
            .withdrawn_at(now)
            .or_else(|| fleet.withdrawal(&instance_type, &zone));
        let after = standing
            .deprecation
            .as_ref()
            .and_then(Deprecation::unavailable_after_unix);
        telemetry.offering_standing(&instance_type, &zone, why.is_some(), after);
        if let Some(d) = &standing.deprecation
            && why.is_none()
        {
            tracing::warn!(
                instance_type,
                zone,
                announced = d.announced,
                unavailable_after = d.unavailable_after,
                "catalogue: the cloud deprecated this offering's type in its zone; it is withdrawn after unavailable_after, choose a successor before then"
            );
        }
        if let Some(why) = why {
            tracing::warn!(
                instance_type,
                zone,
                why,
                "catalogue: offering withdrawn: its Speculative slots are not advertised until the cloud sells it there again; machines that hold a host keep working"
            );
            withdrawn.push(Withdrawn {
                instance_type,
                zone,
                why,
            });
        }
    }
    withdrawn
}

/// The startup verdict on the offerings: serve the ones that can be ordered (naming the
/// withdrawn ones), or refuse when none can.
pub fn startup_verdict(fleet: &Fleet, withdrawn: &[Withdrawn]) -> Result<(), String> {
    let pairs = fleet.price_pairs();
    if !pairs.is_empty() && withdrawn.len() >= pairs.len() {
        let list: Vec<String> = withdrawn
            .iter()
            .map(|w| format!("{}/{}: {}", w.instance_type, w.zone, w.why))
            .collect();
        return Err(format!(
            "none of the {} offerings can be ordered now ({}); choose types the cloud sells in these zones",
            pairs.len(),
            list.join("; ")
        ));
    }
    if !withdrawn.is_empty() {
        let names: Vec<String> = withdrawn
            .iter()
            .map(|w| format!("{}/{}", w.instance_type, w.zone))
            .collect();
        tracing::warn!(
            withdrawn = names.join(", "),
            serving = pairs.len() - withdrawn.len(),
            "catalogue: serving the offerings that can be ordered; the withdrawn ones come back when the cloud sells them again"
        );
    }
    Ok(())
}

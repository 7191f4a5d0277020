//! The cloud's catalogue as the provider follows it: what each offered instance type is
//! (resources and architecture from the API; a pinned table only where no API answers), what it
//! costs in each zone, and where it stands there: available, deprecated with a date after which
//! it cannot be ordered, or not available now.
//!
//! An offering that cannot be ordered is *withdrawn*: its Speculative slots leave the offered
//! set ([`crate::fleet::Fleet`]), so the next reconcile pass removes them from List; machines
//! that already hold a host keep working and can be drained and deleted. When the catalogue
//! says the type can be ordered there again, the slots come back at the next refresh.

use std::collections::HashMap;
use std::sync::RwLock;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::cloud::Capacity;
use crate::fleet::Fleet;
use crate::telemetry::Telemetry;

/// A deprecation the cloud announced for an instance type in one zone.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Deprecation {
    /// When it was announced, as the cloud wrote it (RFC 3339).
    pub announced: String,
    /// After this moment the type cannot be ordered there, as the cloud wrote it (RFC 3339).
    pub unavailable_after: String,
}

impl Deprecation {
    /// `unavailable_after` in seconds since the Unix epoch; `None` when it does not parse.
    pub fn unavailable_after_unix(&self) -> Option<i64> {
        parse_rfc3339(&self.unavailable_after)
    }
}

/// Where an instance type stands in one zone.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Standing {
    /// Whether the cloud says it can be ordered there now.
    pub available: bool,
    /// Why not, in the cloud's terms (empty when available).
    #[serde(default)]
    pub why: String,
    #[serde(default)]
    pub deprecation: Option<Deprecation>,
}

impl Default for Standing {
    fn default() -> Standing {
        Standing::available()
    }
}

impl Standing {
    pub fn available() -> Standing {
        Standing {
            available: true,
            why: String::new(),
            deprecation: None,
        }
    }

    pub fn unavailable(why: impl Into<String>) -> Standing {
        Standing {
            available: false,
            why: why.into(),
            deprecation: None,
        }
    }

    /// Why the offering cannot be ordered at `now_unix` (seconds since the epoch), or `None`
    /// when it can.
    pub fn withdrawn_at(&self, now_unix: i64) -> Option<String> {
        if !self.available {
            return Some(self.why.clone());
        }
        let deprecation = self.deprecation.as_ref()?;
        let after = deprecation.unavailable_after_unix()?;
        (now_unix > after).then(|| {
            format!(
                "deprecated, and unavailable after {}",
                deprecation.unavailable_after
            )
        })
    }
}

/// One offered `(type, zone)` pair as the catalogue describes it.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    /// The on-demand price in USD per hour; `None` when the catalogue has none for the zone.
    pub price_usd: Option<f64>,
    pub standing: Standing,
}

/// What one read of the cloud's catalogue found for the offered pairs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Catalogue {
    /// Resources of every instance type the catalogue describes (at least the offered ones).
    pub capacities: HashMap<String, Capacity>,
    /// Every offered pair asked for; one the cloud does not describe is unavailable.
    pub entries: HashMap<(String, String), Entry>,
}

/// Where every offered pair stands, as of the last catalogue read (or the saved catalogue).
/// Pairs it does not hold are available.
#[derive(Debug, Default)]
pub struct StandingBook {
    standings: RwLock<HashMap<(String, String), Standing>>,
}

impl StandingBook {
    /// The standing of `instance_type` in `zone`.
    pub fn get(&self, instance_type: &str, zone: &str) -> Standing {
        let standings = self.standings.read().unwrap_or_else(|e| e.into_inner());
        standings
            .get(&(instance_type.to_owned(), zone.to_owned()))
            .cloned()
            .unwrap_or_default()
    }

    /// Why `instance_type` cannot be ordered in `zone` now, or `None`.
    pub fn withdrawn(&self, instance_type: &str, zone: &str, now_unix: i64) -> Option<String> {
        let standings = self.standings.read().unwrap_or_else(|e| e.into_inner());
        standings
            .get(&(instance_type.to_owned(), zone.to_owned()))
            .and_then(|s| s.withdrawn_at(now_unix))
    }

    /// Every pair held, sorted.
    pub fn all(&self) -> Vec<((String, String), Standing)> {
        let standings = self.standings.read().unwrap_or_else(|e| e.into_inner());
        let mut all: Vec<_> = standings
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    /// Takes `standings` in place of what was held for those pairs.
    pub fn extend(&self, standings: impl IntoIterator<Item = ((String, String), Standing)>) {
        self.standings
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .extend(standings);
    }
}

/// Seconds since the Unix epoch now.
pub fn now_unix() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// Parses an RFC 3339 timestamp (`2026-09-01T00:00:00Z`, `2026-09-01T02:00:00+02:00`, with or
/// without fractional seconds) to seconds since the Unix epoch.
pub fn parse_rfc3339(text: &str) -> Option<i64> {
    let text = text.trim();
    let (date, rest) = text.split_once(['T', 't', ' '])?;
    let mut date_parts = date.splitn(3, '-');
    let year: i64 = date_parts.next()?.parse().ok()?;
    let month: u32 = date_parts.next()?.parse().ok()?;
    let day: u32 = date_parts.next()?.parse().ok()?;
    let (time, offset_secs) = if let Some(time) = rest.strip_suffix(['Z', 'z']) {
        (time, 0)
    } else {
        let at = rest.rfind(['+', '-'])?;
        let (time, offset) = rest.split_at(at);
        let sign = if offset.starts_with('-') { -1 } else { 1 };
        let (h, m) = offset[1..].split_once(':')?;
        let (h, m): (i64, i64) = (h.parse().ok()?, m.parse().ok()?);
        (time, sign * (h * 3600 + m * 60))
    };
    let time = time.split('.').next()?;
    let mut time_parts = time.splitn(3, ':');
    let hour: i64 = time_parts.next()?.parse().ok()?;
    let minute: i64 = time_parts.next()?.parse().ok()?;
    let second: i64 = time_parts.next()?.parse().ok()?;
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || minute > 59 {
        return None;
    }
    Some(
        days_from_civil(year, month, day) * 86_400 + hour * 3600 + minute * 60 + second
            - offset_secs,
    )
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let m = i64::from(month);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

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
    let read = crate::budget::scoped(
        crate::budget::Class::Refresh,
        fleet.cloud().catalogue(&pairs),
    );
    match tokio::time::timeout(budget, read).await {
        Err(_) => Refresh::Failed("the catalogue read timed out".into()),
        Ok(Err(e)) => Refresh::Failed(e.0),
        Ok(Ok(None)) => Refresh::Unsupported,
        Ok(Ok(Some(catalogue))) => {
            fleet.apply_catalogue(catalogue);
            Refresh::Done
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
        let why = standing.withdrawn_at(now);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_timestamps_parse() {
        assert_eq!(parse_rfc3339("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(parse_rfc3339("2023-09-01T00:00:00Z"), Some(1_693_526_400));
        assert_eq!(
            parse_rfc3339("2023-09-01T02:00:00+02:00"),
            Some(1_693_526_400)
        );
        assert_eq!(
            parse_rfc3339("2025-12-31T23:59:59.123-01:00"),
            Some(1_767_229_199)
        );
        assert_eq!(parse_rfc3339("2024-02-29T12:00:00Z"), Some(1_709_208_000));
        assert_eq!(parse_rfc3339("@1700000000"), None);
        assert_eq!(parse_rfc3339("2023-13-01T00:00:00Z"), None);
        assert_eq!(parse_rfc3339(""), None);
    }

    #[test]
    fn a_standing_is_withdrawn_when_unavailable_or_past_its_date() {
        let now = parse_rfc3339("2026-07-01T00:00:00Z").unwrap_or_default();
        assert_eq!(Standing::available().withdrawn_at(now), None);
        assert_eq!(
            Standing::unavailable("sold out").withdrawn_at(now),
            Some("sold out".into())
        );
        let deprecated = |after: &str| Standing {
            deprecation: Some(Deprecation {
                announced: "2025-10-01T00:00:00Z".into(),
                unavailable_after: after.into(),
            }),
            ..Standing::available()
        };
        assert_eq!(deprecated("2027-01-01T00:00:00Z").withdrawn_at(now), None);
        assert_eq!(
            deprecated("2025-12-31T23:59:59Z").withdrawn_at(now),
            Some("deprecated, and unavailable after 2025-12-31T23:59:59Z".into())
        );
    }
}

//! The cloud's catalogue as the provider follows it: what each offered instance type is
//! (resources and architecture from the API; a pinned table only where no API answers), what it
//! costs in each zone, and where it stands there: available, deprecated with a date after which
//! it cannot be ordered, or not available now.
//!
//! An offering that cannot be ordered is *withdrawn*: its Speculative slots leave the offered
//! set (the offerings-driven backend asks [`StandingBook`]), so the next reconcile pass removes them from List; machines
//! that already hold a host keep working and can be drained and deleted. When the catalogue
//! says the type can be ordered there again, the slots come back at the next refresh.

use std::collections::HashMap;
use std::sync::RwLock;

use serde::{Deserialize, Serialize};

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

/// The CPU architecture of an instance type, named as the kubelet labels the Node
/// (`kubernetes.io/arch`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    Amd64,
    Arm64,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Amd64 => "amd64",
            Arch::Arm64 => "arm64",
        }
    }
}

/// Hardware capacity of an instance type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacity {
    pub vcpus: u32,
    pub memory_mib: u64,
    /// Local disk in GiB (0: unknown, or no local disk).
    pub disk_gib: u64,
    /// `None` when the catalogue does not say.
    pub arch: Option<Arch>,
}

impl Capacity {
    /// A capacity of `vcpus` and `memory_mib` whose disk and architecture are unknown.
    pub fn compute(vcpus: u32, memory_mib: u64) -> Capacity {
        Capacity {
            vcpus,
            memory_mib,
            disk_gib: 0,
            arch: None,
        }
    }

    /// The Kubernetes resources of the whole machine: `cpu`, `memory` and, when the disk is
    /// known, `ephemeral-storage`.
    pub fn resources(&self) -> crate::rules::machine::StringMap {
        let mut resources =
            crate::provisioning::backend::allocatable_of(self.vcpus, self.memory_mib);
        if self.disk_gib > 0 {
            resources.insert(
                "ephemeral-storage".to_owned(),
                format!("{}Gi", self.disk_gib),
            );
        }
        resources
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

//! The Hetzner Cloud catalogue: what a server type is, what it costs and where it can be
//! ordered, read from `GET /server_types` (cores, memory, disk, architecture, net prices per
//! location, and per location `available` and `deprecation`). A type the API describes needs
//! no entry here.
//!
//! The pinned table below is only for where no API answers: the fake backend, and a first start
//! while the API is down (until the first catalogue read replaces it). Prices are **net**
//! (VAT-exclusive) EUR per hour, the basis of the live price too, so a warm and a cold cache
//! never disagree by VAT.

use provider_core::catalogue::{Deprecation, Standing};
use provider_core::cloud::{Arch, Capacity};
use provider_core::offerings::Offering;

use crate::models;

/// The server types of the built-in default mix: a shared x86 type and a larger shared AMD
/// one (today's successors of the reference's `cx22` and `cpx41`).
pub const DEFAULT_MIX: [&str; 2] = ["cx23", "cpx42"];

/// One row of the pinned table: server type, EUR/hour net, vCPUs, memory in GiB, disk in GB,
/// architecture.
type Row = (&'static str, f64, u32, u64, u64, Arch);

/// Hetzner Cloud's lineup as sold in 2026 (the types that can be ordered since the CX Gen2
/// `cx22`-`cx52` and CPX Gen1 `cpx11`-`cpx51` stopped on 2025-12-31). Sizes from Hetzner's
/// server type pages and `GET /server_types`; hourly prices are the EU list prices as of
/// 2026-07, rounded, and only stand in until the API answers.
const PINNED: &[Row] = &[
    // CX Gen3: shared vCPU, Intel/AMD.
    ("cx23", 0.0060, 2, 4, 40, Arch::Amd64),
    ("cx33", 0.0110, 4, 8, 80, Arch::Amd64),
    ("cx43", 0.0210, 8, 16, 160, Arch::Amd64),
    ("cx53", 0.0410, 16, 32, 320, Arch::Amd64),
    // CPX Gen2: shared vCPU, AMD.
    ("cpx12", 0.0080, 1, 2, 40, Arch::Amd64),
    ("cpx22", 0.0100, 2, 4, 80, Arch::Amd64),
    ("cpx32", 0.0170, 4, 8, 160, Arch::Amd64),
    ("cpx42", 0.0310, 8, 16, 320, Arch::Amd64),
    ("cpx52", 0.0440, 12, 24, 480, Arch::Amd64),
    ("cpx62", 0.0600, 16, 32, 640, Arch::Amd64),
    // CAX: shared vCPU, Ampere (arm64).
    ("cax11", 0.0065, 2, 4, 40, Arch::Arm64),
    ("cax21", 0.0110, 4, 8, 80, Arch::Arm64),
    ("cax31", 0.0210, 8, 16, 160, Arch::Arm64),
    ("cax41", 0.0410, 16, 32, 320, Arch::Arm64),
    // CCX: dedicated vCPU, AMD.
    ("ccx13", 0.0220, 2, 8, 80, Arch::Amd64),
    ("ccx23", 0.0430, 4, 16, 160, Arch::Amd64),
    ("ccx33", 0.0840, 8, 32, 240, Arch::Amd64),
    ("ccx43", 0.1660, 16, 64, 360, Arch::Amd64),
    ("ccx53", 0.3310, 32, 128, 600, Arch::Amd64),
    ("ccx63", 0.4960, 48, 192, 960, Arch::Amd64),
];

fn row(server_type: &str) -> Option<&'static Row> {
    PINNED.iter().find(|(name, ..)| *name == server_type)
}

/// Every server type the pinned table knows, in table order.
pub fn pinned_server_types() -> impl Iterator<Item = &'static str> {
    PINNED.iter().map(|(name, ..)| *name)
}

/// The pinned net on-demand price in EUR per hour, location-agnostic (EU baseline).
pub fn pinned_price_eur(server_type: &str) -> Option<f64> {
    row(server_type).map(|(_, eur, ..)| *eur)
}

/// The pinned hardware capacity of a server type.
pub fn pinned_capacity(server_type: &str) -> Option<Capacity> {
    row(server_type).map(|(_, _, vcpus, gib, disk, arch)| Capacity {
        vcpus: *vcpus,
        memory_mib: gib * 1024,
        disk_gib: *disk,
        arch: Some(*arch),
    })
}

/// A server type's capacity as the API describes it; `None` when it describes no usable
/// machine (no cores or no memory).
pub fn capacity(kind: &models::ServerType) -> Option<Capacity> {
    let vcpus = kind.cores.round();
    let memory_mib = (kind.memory * 1024.0).round();
    let usable = (1.0..=f64::from(u32::MAX)).contains(&vcpus) && memory_mib >= 1.0;
    if !usable {
        return None;
    }
    let disk = kind.disk.round();
    Some(Capacity {
        vcpus: vcpus as u32,
        memory_mib: memory_mib as u64,
        disk_gib: if disk.is_finite() && disk > 0.0 {
            disk as u64
        } else {
            0
        },
        arch: match kind.architecture {
            models::Architecture::X86 => Some(Arch::Amd64),
            models::Architecture::Arm => Some(Arch::Arm64),
            models::Architecture::Unknown => None,
        },
    })
}

/// Where `kind` stands in `location`: sold there or not, temporarily unavailable, deprecated.
/// Hetzner lists in `locations` every location a type is sold in, each with its own
/// `deprecation` and `available`; an answer without `locations` (older API) counts a type as
/// sold where it has a price.
pub fn standing(kind: &models::ServerType, location: &str) -> Standing {
    let Some(entry) = kind.locations.iter().find(|l| l.name == location) else {
        let priced = kind.prices.iter().any(|p| p.location == location);
        return if kind.locations.is_empty() && priced {
            Standing::available()
        } else {
            Standing::unavailable(format!(
                "server type {} is not sold in location {location}",
                kind.name
            ))
        };
    };
    let deprecation = entry.deprecation.as_ref().map(|d| Deprecation {
        announced: d.announced.clone(),
        unavailable_after: d.unavailable_after.clone(),
    });
    let available = entry.available.unwrap_or(true);
    Standing {
        available,
        why: if available {
            String::new()
        } else {
            format!(
                "server type {} is temporarily unavailable in location {location}",
                kind.name
            )
        },
        deprecation,
    }
}

/// The net hourly EUR price of `kind` in `location`.
pub fn price_eur(kind: &models::ServerType, location: &str) -> Result<f64, String> {
    let entry = kind
        .prices
        .iter()
        .find(|p| p.location == location)
        .ok_or_else(|| format!("no pricing for {} in {location}", kind.name))?;
    let eur: f64 = entry
        .price_hourly
        .net
        .trim()
        .parse()
        .map_err(|e| format!("parse hourly price for {}/{location}: {e}", kind.name))?;
    if !eur.is_finite() || eur < 0.0 {
        return Err(format!(
            "parse hourly price for {}/{location}: {eur} is not a price",
            kind.name
        ));
    }
    Ok(eur)
}

/// Whether `kind` can be ordered in `location` now and has no announced deprecation there.
fn current(kind: &models::ServerType, location: &str, now_unix: i64) -> bool {
    let standing = standing(kind, location);
    standing.withdrawn_at(now_unix).is_none()
        && standing.deprecation.is_none()
        && price_eur(kind, location).is_ok()
}

/// The successor of `old` in `location`: the cheapest type sold there now, without a
/// deprecation, of the same architecture and CPU kind (shared or dedicated), with at least its
/// cores and memory.
pub fn successor<'a>(
    types: &'a [models::ServerType],
    old: &models::ServerType,
    location: &str,
    now_unix: i64,
) -> Option<&'a models::ServerType> {
    types
        .iter()
        .filter(|t| t.name != old.name)
        .filter(|t| t.architecture == old.architecture && t.cpu_type == old.cpu_type)
        .filter(|t| t.cores >= old.cores && t.memory >= old.memory)
        .filter(|t| current(t, location, now_unix))
        .filter_map(|t| price_eur(t, location).ok().map(|eur| (t, eur)))
        .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.name.cmp(&b.0.name)))
        .map(|(t, _)| t)
}

/// One change the startup check made to the default mix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Revision {
    pub location: String,
    pub from: String,
    /// `None` when no successor is sold there: the offering stays and is withdrawn.
    pub to: Option<String>,
    pub why: String,
}

/// Checks the default mix against the catalogue: an offering whose type the API marks
/// deprecated or unavailable in its location (or does not know) is replaced by its successor
/// there; without one it is kept and the catalogue withdraws it. Returns what changed.
pub fn revise_default_mix(
    offerings: &mut [Offering],
    types: &[models::ServerType],
    now_unix: i64,
) -> Vec<Revision> {
    let mut revisions = Vec::new();
    for offering in offerings.iter_mut() {
        let location = offering.zone.clone();
        let Some(kind) = types.iter().find(|t| t.name == offering.instance_type) else {
            revisions.push(Revision {
                location,
                from: offering.instance_type.clone(),
                to: None,
                why: "the API lists no such server type".into(),
            });
            continue;
        };
        if current(kind, &location, now_unix) {
            continue;
        }
        let standing = standing(kind, &location);
        let why = match (standing.withdrawn_at(now_unix), &standing.deprecation) {
            (Some(why), _) => why,
            (None, Some(d)) => format!("deprecated, unavailable after {}", d.unavailable_after),
            (None, None) => format!("no price in location {location}"),
        };
        let to = successor(types, kind, &location, now_unix).map(|t| t.name.clone());
        if let Some(to) = &to {
            offering.instance_type = to.clone();
        }
        revisions.push(Revision {
            location,
            from: kind.name.clone(),
            to,
            why,
        });
    }
    revisions
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_and_unknown_types() {
        assert_eq!(pinned_price_eur("cx23"), Some(0.0060));
        assert_eq!(pinned_price_eur("cx22"), None, "no longer sold");
        assert_eq!(
            pinned_capacity("cpx42"),
            Some(Capacity {
                vcpus: 8,
                memory_mib: 16384,
                disk_gib: 320,
                arch: Some(Arch::Amd64),
            })
        );
        assert_eq!(
            pinned_capacity("cax21").and_then(|c| c.arch),
            Some(Arch::Arm64)
        );
        assert_eq!(pinned_capacity("nope"), None);
        assert_eq!(pinned_server_types().count(), 20);
        assert!(DEFAULT_MIX.iter().all(|t| row(t).is_some()));
    }

    #[test]
    fn every_row_has_a_price_and_a_capacity() {
        for name in pinned_server_types() {
            assert!(pinned_price_eur(name).is_some_and(|p| p > 0.0), "{name}");
            assert!(
                pinned_capacity(name)
                    .is_some_and(|c| c.vcpus > 0 && c.memory_mib > 0 && c.disk_gib > 0),
                "{name}"
            );
        }
    }

    fn kind(
        name: &str,
        cores: f64,
        memory: f64,
        eur: &str,
        loc: serde_json::Value,
    ) -> models::ServerType {
        serde_json::from_value(serde_json::json!({
            "id": 1, "name": name, "cores": cores, "memory": memory, "disk": 40,
            "architecture": "x86", "cpu_type": "shared",
            "prices": [{"location": "nbg1", "price_hourly": {"net": eur, "gross": eur}}],
            "locations": [loc],
        }))
        .expect("server type")
    }

    #[test]
    fn a_deprecated_default_type_is_replaced_by_its_cheapest_current_successor() {
        let now = provider_core::catalogue::parse_rfc3339("2026-07-01T00:00:00Z").unwrap_or(0);
        let gone = serde_json::json!({"id": 2, "name": "nbg1", "available": true, "recommended": false,
            "deprecation": {"announced": "2025-10-01T00:00:00Z", "unavailable_after": "2025-12-31T23:59:59Z"}});
        let sold = serde_json::json!({"id": 2, "name": "nbg1", "available": true, "recommended": true, "deprecation": null});
        let sold_out = serde_json::json!({"id": 2, "name": "nbg1", "available": false, "recommended": false, "deprecation": null});
        let types = vec![
            kind("cx22", 2.0, 4.0, "0.0060", gone),
            kind("cx23", 2.0, 4.0, "0.0060", sold.clone()),
            kind("cx33", 4.0, 8.0, "0.0110", sold.clone()),
            kind("cpx12", 1.0, 2.0, "0.0010", sold.clone()),
            kind("cpx42", 8.0, 16.0, "0.0310", sold_out),
        ];
        let mut offerings =
            provider_core::offerings::default_mix(4, ["cx22", "cpx42"], ["nbg1", "nbg1"]);
        offerings.truncate(2);
        let revisions = revise_default_mix(&mut offerings, &types, now);
        assert_eq!(
            offerings[0].instance_type, "cx23",
            "cpx12 is too small, cx33 dearer"
        );
        assert_eq!(
            revisions[0],
            Revision {
                location: "nbg1".into(),
                from: "cx22".into(),
                to: Some("cx23".into()),
                why: "deprecated, and unavailable after 2025-12-31T23:59:59Z".into(),
            }
        );
        assert_eq!(
            offerings[1].instance_type, "cpx42",
            "no larger type: kept, withdrawn"
        );
        assert_eq!(revisions[1].to, None);
        assert!(
            revisions[1].why.contains("temporarily unavailable"),
            "{revisions:?}"
        );
    }
}

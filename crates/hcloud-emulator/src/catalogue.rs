//! Today's Hetzner Cloud catalogue as the emulator serves it: the server types sold in 2026
//! (CX Gen3, CPX Gen2, CAX, CCX) beside the CX Gen2 and CPX Gen1 types that cannot be ordered
//! since 2025-12-31 (still listed, with that date as every location's `unavailable_after`),
//! net prices per location, and per location `available`, `recommended` and `deprecation`, in
//! the shape of Hetzner's official `cloud.spec.json` (`ServerType`, `Server`). Tests change the
//! standing of a type in a location ([`crate::Emulator::set_sold_out`],
//! [`crate::Emulator::set_deprecation`]); a Create of a type that cannot be ordered answers what
//! Hetzner answers: HTTP 412 `resource_unavailable`.

use std::collections::HashMap;

use hcloud::models;
use serde_json::{Value, json};

/// One server type: name, id, cores, memory GB, disk GB, architecture, CPU kind, category,
/// net EUR/hour.
type Row = (
    &'static str,
    i64,
    i32,
    f64,
    f64,
    models::Architecture,
    &'static str,
    &'static str,
    f64,
);

const X86: models::Architecture = models::Architecture::X86;
const ARM: models::Architecture = models::Architecture::Arm;

/// The server types the emulator knows. Sizes as Hetzner lists them; prices the EU list prices
/// of 2026, rounded (Helsinki is served 10% cheaper, to tell locations apart).
pub(crate) const SERVER_TYPES: &[Row] = &[
    (
        "cx23",
        114,
        2,
        4.0,
        40.0,
        X86,
        "shared",
        "Cost-Optimized",
        0.0060,
    ),
    (
        "cx33",
        115,
        4,
        8.0,
        80.0,
        X86,
        "shared",
        "Cost-Optimized",
        0.0110,
    ),
    (
        "cx43",
        116,
        8,
        16.0,
        160.0,
        X86,
        "shared",
        "Cost-Optimized",
        0.0210,
    ),
    (
        "cx53",
        117,
        16,
        32.0,
        320.0,
        X86,
        "shared",
        "Cost-Optimized",
        0.0410,
    ),
    (
        "cpx12",
        118,
        1,
        2.0,
        40.0,
        X86,
        "shared",
        "Regular Purpose",
        0.0080,
    ),
    (
        "cpx22",
        119,
        2,
        4.0,
        80.0,
        X86,
        "shared",
        "Regular Purpose",
        0.0100,
    ),
    (
        "cpx32",
        120,
        4,
        8.0,
        160.0,
        X86,
        "shared",
        "Regular Purpose",
        0.0170,
    ),
    (
        "cpx42",
        121,
        8,
        16.0,
        320.0,
        X86,
        "shared",
        "Regular Purpose",
        0.0310,
    ),
    (
        "cpx52",
        122,
        12,
        24.0,
        480.0,
        X86,
        "shared",
        "Regular Purpose",
        0.0440,
    ),
    (
        "cpx62",
        123,
        16,
        32.0,
        640.0,
        X86,
        "shared",
        "Regular Purpose",
        0.0600,
    ),
    (
        "cax11",
        45,
        2,
        4.0,
        40.0,
        ARM,
        "shared",
        "Cost-Optimized",
        0.0065,
    ),
    (
        "cax21",
        93,
        4,
        8.0,
        80.0,
        ARM,
        "shared",
        "Cost-Optimized",
        0.0110,
    ),
    (
        "cax31",
        94,
        8,
        16.0,
        160.0,
        ARM,
        "shared",
        "Cost-Optimized",
        0.0210,
    ),
    (
        "cax41",
        95,
        16,
        32.0,
        320.0,
        ARM,
        "shared",
        "Cost-Optimized",
        0.0410,
    ),
    (
        "ccx13",
        96,
        2,
        8.0,
        80.0,
        X86,
        "dedicated",
        "General Purpose",
        0.0220,
    ),
    (
        "ccx23",
        97,
        4,
        16.0,
        160.0,
        X86,
        "dedicated",
        "General Purpose",
        0.0430,
    ),
    (
        "ccx33",
        98,
        8,
        32.0,
        240.0,
        X86,
        "dedicated",
        "General Purpose",
        0.0840,
    ),
    (
        "ccx43",
        99,
        16,
        64.0,
        360.0,
        X86,
        "dedicated",
        "General Purpose",
        0.1660,
    ),
    (
        "ccx53",
        100,
        32,
        128.0,
        600.0,
        X86,
        "dedicated",
        "General Purpose",
        0.3310,
    ),
    (
        "ccx63",
        101,
        48,
        192.0,
        960.0,
        X86,
        "dedicated",
        "General Purpose",
        0.4960,
    ),
    // No longer sold: deprecated everywhere, unavailable after 2025-12-31.
    (
        "cx22",
        104,
        2,
        4.0,
        40.0,
        X86,
        "shared",
        "Cost-Optimized",
        0.0060,
    ),
    (
        "cx32",
        105,
        4,
        8.0,
        80.0,
        X86,
        "shared",
        "Cost-Optimized",
        0.0113,
    ),
    (
        "cx42",
        106,
        8,
        16.0,
        160.0,
        X86,
        "shared",
        "Cost-Optimized",
        0.0273,
    ),
    (
        "cx52",
        107,
        16,
        32.0,
        320.0,
        X86,
        "shared",
        "Cost-Optimized",
        0.0540,
    ),
    (
        "cpx11",
        22,
        2,
        2.0,
        40.0,
        X86,
        "shared",
        "Regular Purpose",
        0.0070,
    ),
    (
        "cpx21",
        23,
        3,
        4.0,
        80.0,
        X86,
        "shared",
        "Regular Purpose",
        0.0120,
    ),
    (
        "cpx31",
        24,
        4,
        8.0,
        160.0,
        X86,
        "shared",
        "Regular Purpose",
        0.0230,
    ),
    (
        "cpx41",
        25,
        8,
        16.0,
        240.0,
        X86,
        "shared",
        "Regular Purpose",
        0.0440,
    ),
    (
        "cpx51",
        26,
        16,
        32.0,
        360.0,
        X86,
        "shared",
        "Regular Purpose",
        0.0860,
    ),
];

/// The types that can no longer be ordered, and their deprecation.
pub(crate) const RETIRED: &[&str] = &[
    "cx22", "cx32", "cx42", "cx52", "cpx11", "cpx21", "cpx31", "cpx41", "cpx51",
];
pub(crate) const RETIRED_ANNOUNCED: &str = "2025-10-16T09:00:00Z";
pub(crate) const RETIRED_UNAVAILABLE_AFTER: &str = "2025-12-31T23:59:59Z";

/// Where a server type stands in one location.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Standing {
    /// `false` while it is sold out there (Create answers 412).
    pub available: bool,
    pub recommended: bool,
    /// `(announced, unavailable_after)`, RFC 3339.
    pub deprecation: Option<(String, String)>,
}

impl Default for Standing {
    fn default() -> Standing {
        Standing {
            available: true,
            recommended: true,
            deprecation: None,
        }
    }
}

/// The catalogue's standings by (server type, location).
pub(crate) type Standings = HashMap<(String, String), Standing>;

/// The initial standings: retired types deprecated everywhere, the rest available.
pub(crate) fn initial_standings(types: &[models::ServerType]) -> Standings {
    let mut standings = Standings::new();
    for t in types {
        for l in &t.locations {
            let standing = if RETIRED.contains(&t.name.as_str()) {
                Standing {
                    available: true,
                    recommended: false,
                    deprecation: Some((
                        RETIRED_ANNOUNCED.to_owned(),
                        RETIRED_UNAVAILABLE_AFTER.to_owned(),
                    )),
                }
            } else {
                Standing::default()
            };
            standings.insert((t.name.clone(), l.name.clone()), standing);
        }
    }
    standings
}

/// Whether `server_type` can be ordered in `location` at `now` (RFC 3339, UTC): sold there,
/// available, not past its `unavailable_after`.
pub(crate) fn orderable(
    types: &[models::ServerType],
    standings: &Standings,
    server_type: &str,
    location: &str,
    now: &str,
) -> bool {
    let sold = types
        .iter()
        .any(|t| t.name == server_type && t.locations.iter().any(|l| l.name == location));
    let standing = standings
        .get(&(server_type.to_owned(), location.to_owned()))
        .cloned()
        .unwrap_or_default();
    // Both stamps are `YYYY-MM-DDTHH:MM:SSZ`: they compare as text.
    let past = standing
        .deprecation
        .as_ref()
        .is_some_and(|(_, after)| now > after.as_str());
    sold && standing.available && !past
}

/// A server type as Hetzner's document shapes it: every required key, `deprecated` a boolean,
/// the type-level `deprecation` (deprecated by Hetzner) null, the per-location standing in
/// `locations[]`.
pub(crate) fn server_type_json(t: &models::ServerType, standings: &Standings) -> Value {
    let locations: Vec<Value> = t
        .locations
        .iter()
        .map(|l| {
            let standing = standings
                .get(&(t.name.clone(), l.name.clone()))
                .cloned()
                .unwrap_or_default();
            json!({
                "id": l.id,
                "name": l.name,
                "deprecation": standing.deprecation.as_ref().map(|(announced, after)| json!({
                    "announced": announced,
                    "unavailable_after": after,
                })),
                "recommended": standing.recommended,
                "available": standing.available,
            })
        })
        .collect();
    let deprecated = t.locations.iter().any(|l| {
        standings
            .get(&(t.name.clone(), l.name.clone()))
            .is_some_and(|s| s.deprecation.is_some())
    });
    let prices: Vec<Value> = t
        .prices
        .iter()
        .map(|p| {
            json!({
                "location": p.location,
                "price_hourly": {"net": p.price_hourly.net, "gross": p.price_hourly.gross},
                "price_monthly": {"net": p.price_monthly.net, "gross": p.price_monthly.gross},
                "included_traffic": p.included_traffic,
                "price_per_tb_traffic": {
                    "net": p.price_per_tb_traffic.net,
                    "gross": p.price_per_tb_traffic.gross,
                },
            })
        })
        .collect();
    json!({
        "id": t.id,
        "name": t.name,
        "description": t.description,
        "cores": t.cores,
        "memory": t.memory,
        "disk": t.disk,
        "deprecated": deprecated,
        "prices": prices,
        "storage_type": "local",
        "cpu_type": match t.cpu_type {
            models::server_type::CpuType::Dedicated => "dedicated",
            models::server_type::CpuType::Shared => "shared",
        },
        "category": t.category,
        "architecture": match t.architecture {
            models::Architecture::Arm => "arm",
            models::Architecture::X86 => "x86",
        },
        "deprecation": Value::Null,
        "locations": locations,
    })
}

/// A server as Hetzner's document shapes it: its stored fields, without `datacenter` (which
/// Hetzner removed from servers), its `server_type` spec-shaped. Serialized field by field
/// (no intermediate JSON tree: a survey of 10,000 servers reads 200 pages of them).
#[derive(serde::Serialize)]
pub(crate) struct ServerJson<'a> {
    id: i64,
    name: &'a str,
    status: models::server::Status,
    created: &'a str,
    public_net: &'a models::ServerPublicNet,
    private_net: &'a [models::ServerPrivateNet],
    server_type: &'a Value,
    location: &'a models::Location,
    image: Option<&'a models::Image>,
    iso: Option<&'a models::Iso>,
    rescue_enabled: bool,
    locked: bool,
    backup_window: Option<&'a str>,
    outgoing_traffic: Option<i64>,
    ingoing_traffic: Option<i64>,
    included_traffic: Option<i64>,
    protection: &'a models::ServerProtection,
    labels: &'a HashMap<String, String>,
    volumes: &'a [i64],
    load_balancers: &'a [i64],
    primary_disk_size: i32,
    placement_group: Option<&'a models::PlacementGroup>,
}

/// [`ServerJson`] of `server`, whose type [`server_type_json`] rendered as `server_type`.
pub(crate) fn server_json<'a>(
    server: &'a models::Server,
    server_type: &'a Value,
) -> ServerJson<'a> {
    ServerJson {
        id: server.id,
        name: &server.name,
        status: server.status,
        created: &server.created,
        public_net: &server.public_net,
        private_net: &server.private_net,
        server_type,
        location: &server.location,
        image: server.image.as_deref(),
        iso: server.iso.as_deref(),
        rescue_enabled: server.rescue_enabled,
        locked: server.locked,
        backup_window: server.backup_window.as_deref(),
        outgoing_traffic: server.outgoing_traffic,
        ingoing_traffic: server.ingoing_traffic,
        included_traffic: server.included_traffic,
        protection: &server.protection,
        labels: &server.labels,
        volumes: server.volumes.as_deref().unwrap_or_default(),
        load_balancers: server.load_balancers.as_deref().unwrap_or_default(),
        primary_disk_size: server.primary_disk_size,
        placement_group: server.placement_group.as_ref().and_then(|g| g.as_deref()),
    }
}

/// Seconds since the Unix epoch as RFC 3339 UTC (`2026-07-01T12:00:00Z`).
pub fn rfc3339(unix: i64) -> String {
    let days = unix.div_euclid(86_400);
    let secs = unix.rem_euclid(86_400);
    // H. Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs % 3600 / 60,
        secs % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_693_526_400), "2023-09-01T00:00:00Z");
        assert_eq!(rfc3339(1_709_208_000), "2024-02-29T12:00:00Z");
        assert_eq!(rfc3339(1_767_225_599), "2025-12-31T23:59:59Z");
    }
}

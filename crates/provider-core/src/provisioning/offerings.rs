//! Offerings: the instance types, zones and counts a provider may create, parsed from the
//! operator's JSON (or the built-in default mix) and validated with the reference's messages.
//! Offerings are a hard quota: the slots they define are the only ones that can be created.

use std::path::Path;

use serde_json::Value;

use crate::rules::machine::StringMap;

/// The per-cloud words used in offering files and messages.
#[derive(Clone, Copy, Debug)]
pub struct OfferingRules {
    /// Prefix of validation errors, e.g. `hetzner backend`.
    pub backend: &'static str,
    /// JSON key of the instance type, e.g. `server_type` or `size`.
    pub type_key: &'static str,
    /// JSON key of the zone, e.g. `location` or `region`.
    pub zone_key: &'static str,
    /// Message for a `spot` capacity type.
    pub spot_message: &'static str,
    /// Message for reserved or bare-metal capacity types; `{}` is replaced by the value.
    pub metal_message: &'static str,
}

/// One offering.
#[derive(Clone, Debug, PartialEq)]
pub struct Offering {
    pub instance_type: String,
    pub zone: String,
    pub capacity_type: String,
    pub count: i64,
    pub resources: StringMap,
    pub labels: StringMap,
}

fn field<'a>(object: &'a serde_json::Map<String, Value>, key: &str) -> Option<&'a Value> {
    object.get(key).or_else(|| {
        object
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(key))
            .map(|(_, v)| v)
    })
}

fn string_field(object: &serde_json::Map<String, Value>, key: &str) -> Result<String, String> {
    match field(object, key) {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(other) => Err(format!("{key}: expected a string, got {other}")),
    }
}

fn map_field(object: &serde_json::Map<String, Value>, key: &str) -> Result<StringMap, String> {
    match field(object, key) {
        None | Some(Value::Null) => Ok(StringMap::new()),
        Some(Value::Object(map)) => map
            .iter()
            .map(|(k, v)| match v {
                Value::String(s) => Ok((k.clone(), s.clone())),
                other => Err(format!("{key}.{k}: expected a string, got {other}")),
            })
            .collect(),
        Some(other) => Err(format!("{key}: expected an object, got {other}")),
    }
}

/// Parses an offerings document.
pub fn parse(text: &str, rules: &OfferingRules) -> Result<Vec<Offering>, String> {
    let value: Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let Value::Array(items) = value else {
        return Err("expected a JSON array of offerings".into());
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let Value::Object(object) = item else {
                return Err(format!("offering {i}: expected an object"));
            };
            let count = match field(object, "count") {
                None | Some(Value::Null) => 0,
                Some(Value::Number(n)) => n
                    .as_i64()
                    .ok_or_else(|| format!("offering {i}: count must be a whole number"))?,
                Some(other) => {
                    return Err(format!(
                        "offering {i}: count: expected a number, got {other}"
                    ));
                }
            };
            Ok(Offering {
                instance_type: string_field(object, rules.type_key)
                    .map_err(|e| format!("offering {i}: {e}"))?,
                zone: string_field(object, rules.zone_key)
                    .map_err(|e| format!("offering {i}: {e}"))?,
                capacity_type: string_field(object, "capacity_type")
                    .map_err(|e| format!("offering {i}: {e}"))?,
                count,
                resources: map_field(object, "resources")
                    .map_err(|e| format!("offering {i}: {e}"))?,
                labels: map_field(object, "labels").map_err(|e| format!("offering {i}: {e}"))?,
            })
        })
        .collect()
}

/// Loads `--offerings PATH` with the reference's error texts.
pub fn load(path: &Path, rules: &OfferingRules) -> Result<Vec<Offering>, String> {
    let shown = path.display();
    let text = std::fs::read_to_string(path).map_err(|e| format!("read offerings {shown}: {e}"))?;
    let offerings = parse(&text, rules).map_err(|e| format!("parse offerings {shown}: {e}"))?;
    if offerings.is_empty() {
        return Err(format!("offerings {shown} is empty"));
    }
    Ok(offerings)
}

/// Validates offerings in the reference's order: the empty list first, then per offering the
/// capacity type, the type and the zone.
pub fn validate(offerings: &[Offering], rules: &OfferingRules) -> Result<(), String> {
    let backend = rules.backend;
    if offerings.is_empty() {
        return Err(format!("{backend}: no offerings configured"));
    }
    for o in offerings {
        let value = o.capacity_type.as_str();
        let problem = match value.to_ascii_lowercase().as_str() {
            "" | "on_demand" | "on-demand" | "ondemand" => None,
            "spot" => Some(rules.spot_message.to_owned()),
            "reserved" | "bare_metal" | "bare-metal" | "metal" => {
                Some(rules.metal_message.replace("{}", value))
            }
            _ => Some(format!("unknown capacity_type {value:?}")),
        };
        if let Some(problem) = problem {
            return Err(format!(
                "{backend}: offering {}/{}: {problem}",
                o.instance_type, o.zone
            ));
        }
        if o.instance_type.is_empty() {
            return Err(format!("{backend}: offering with empty {}", rules.type_key));
        }
        if o.zone.is_empty() {
            return Err(format!(
                "{backend}: offering {} with empty {}",
                o.instance_type, rules.zone_key
            ));
        }
    }
    Ok(())
}

/// The default mix: `seed_count` (16 when ≤ 0) split as evenly as possible over
/// type A and B in zone A, then type A and B in zone B, the remainder to the first buckets.
pub fn default_mix(seed_count: i64, types: [&str; 2], zones: [&str; 2]) -> Vec<Offering> {
    let total = if seed_count <= 0 { 16 } else { seed_count };
    let buckets = [
        (types[0], zones[0]),
        (types[1], zones[0]),
        (types[0], zones[1]),
        (types[1], zones[1]),
    ];
    buckets
        .iter()
        .enumerate()
        .map(|(i, (t, z))| Offering {
            instance_type: (*t).to_owned(),
            zone: (*z).to_owned(),
            capacity_type: "on_demand".into(),
            count: total / 4 + i64::from((i as i64) < total % 4),
            resources: StringMap::from([
                ("cpu".to_owned(), "1".to_owned()),
                ("memory".to_owned(), "2Gi".to_owned()),
            ]),
            labels: StringMap::new(),
        })
        .collect()
}

/// Folds offerings of the same (type, zone) into one by adding their counts, in first-seen
/// order (the default mix collapses to two buckets when both of its zones are the same).
pub fn merge_same_placement(offerings: Vec<Offering>) -> Vec<Offering> {
    let mut out: Vec<Offering> = Vec::with_capacity(offerings.len());
    for o in offerings {
        match out
            .iter_mut()
            .find(|m| m.instance_type == o.instance_type && m.zone == o.zone)
        {
            Some(m) => m.count = m.count.saturating_add(o.count.max(0)),
            None => out.push(o),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULES: OfferingRules = OfferingRules {
        backend: "hetzner backend",
        type_key: "server_type",
        zone_key: "location",
        spot_message: "capacity_type \"spot\" is not offered by Hetzner Cloud (on-demand only)",
        metal_message: "capacity_type \"{}\" is not a Hetzner Cloud substrate (on-demand only; bare-metal is the separate Robot provider)",
    };

    #[test]
    fn parses_case_insensitively_and_ignores_unknown_keys() {
        let o = parse(
            r#"[{"Server_Type":"cx22","location":"nbg1","count":3,"resources":{"cpu":"1"},"labels":{"a":"b"},"x":1}]"#,
            &RULES,
        )
        .unwrap();
        assert_eq!(o[0].instance_type, "cx22");
        assert_eq!(o[0].count, 3);
        assert_eq!(o[0].resources["cpu"], "1");
        assert_eq!(o[0].labels["a"], "b");
    }

    #[test]
    fn validation_messages() {
        let base = |ct: &str, t: &str, z: &str| Offering {
            instance_type: t.into(),
            zone: z.into(),
            capacity_type: ct.into(),
            count: 1,
            resources: StringMap::new(),
            labels: StringMap::new(),
        };
        assert_eq!(
            validate(&[], &RULES).unwrap_err(),
            "hetzner backend: no offerings configured"
        );
        assert_eq!(
            validate(&[base("spot", "cx22", "nbg1")], &RULES).unwrap_err(),
            "hetzner backend: offering cx22/nbg1: capacity_type \"spot\" is not offered by Hetzner Cloud (on-demand only)"
        );
        assert_eq!(
            validate(&[base("Bare-Metal", "cx22", "nbg1")], &RULES).unwrap_err(),
            "hetzner backend: offering cx22/nbg1: capacity_type \"Bare-Metal\" is not a Hetzner Cloud substrate (on-demand only; bare-metal is the separate Robot provider)"
        );
        assert_eq!(
            validate(&[base("weird", "cx22", "nbg1")], &RULES).unwrap_err(),
            "hetzner backend: offering cx22/nbg1: unknown capacity_type \"weird\""
        );
        assert_eq!(
            validate(&[base("", "", "nbg1")], &RULES).unwrap_err(),
            "hetzner backend: offering with empty server_type"
        );
        assert_eq!(
            validate(&[base("ON-DEMAND", "cx22", "")], &RULES).unwrap_err(),
            "hetzner backend: offering cx22 with empty location"
        );
        assert!(validate(&[base("OnDemand", "cx22", "nbg1")], &RULES).is_ok());
    }

    #[test]
    fn same_placement_merges() {
        let merged = merge_same_placement(default_mix(10, ["a", "b"], ["z", "z"]));
        let got: Vec<(&str, i64)> = merged
            .iter()
            .map(|o| (o.instance_type.as_str(), o.count))
            .collect();
        assert_eq!(got, vec![("a", 5), ("b", 5)]);
    }

    #[test]
    fn default_mix_splits_evenly() {
        let counts: Vec<i64> = default_mix(10, ["a", "b"], ["z1", "z2"])
            .iter()
            .map(|o| o.count)
            .collect();
        assert_eq!(counts, vec![3, 3, 2, 2]);
        let counts: Vec<i64> = default_mix(0, ["a", "b"], ["z1", "z2"])
            .iter()
            .map(|o| o.count)
            .collect();
        assert_eq!(counts, vec![4, 4, 4, 4]);
        let mix = default_mix(32, ["cx22", "cpx41"], ["nbg1", "fsn1"]);
        assert_eq!(
            (mix[1].instance_type.as_str(), mix[1].zone.as_str()),
            ("cpx41", "nbg1")
        );
        assert_eq!(
            (mix[2].instance_type.as_str(), mix[2].zone.as_str()),
            ("cx22", "fsn1")
        );
    }
}

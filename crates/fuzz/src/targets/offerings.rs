//! `--offerings FILE`: the offerings JSON of both providers.

use arbitrary::{Result, Unstructured};
use provider_core::offerings::{self, Offering, OfferingRules};
use serde_json::{Map, Value, json};

use crate::engine::Target;
use crate::shape::{json as any_json, json_bytes, number, word};

pub const JSON: Target = Target {
    name: "offerings-json",
    checks: "offerings documents with the Hetzner and DigitalOcean key names in any case, odd \
             counts and wrong types, sometimes damaged: parsing, validation and merging never \
             panic; a parsed list written back as canonical JSON parses to the same list",
    property,
};

const HETZNER: OfferingRules = OfferingRules {
    backend: "hetzner backend",
    type_key: "server_type",
    zone_key: "location",
    spot_message: "spot",
    metal_message: "metal {}",
};

const DIGITALOCEAN: OfferingRules = OfferingRules {
    backend: "digitalocean backend",
    type_key: "size",
    zone_key: "region",
    spot_message: "spot",
    metal_message: "metal {}",
};

const KEYS: &[&str] = &[
    "server_type",
    "location",
    "size",
    "region",
    "capacity_type",
    "count",
    "resources",
    "labels",
];
const STRINGS: &[&str] = &[
    "cx22",
    "nbg1",
    "s-2vcpu-4gb",
    "fra1",
    "on_demand",
    "ON-DEMAND",
    "spot",
    "reserved",
    "metal",
    "",
];

fn offering(u: &mut Unstructured<'_>) -> Result<Value> {
    let mut o = Map::new();
    for _ in 0..u.int_in_range(0..=7)? {
        let key = word(u, KEYS, true)?;
        let value = match key.to_lowercase().as_str() {
            "count" if u.ratio(3, 4)? => Value::Number(number(u)?),
            "resources" | "labels" if u.ratio(3, 4)? => {
                let mut m = Map::new();
                for _ in 0..u.int_in_range(0..=3)? {
                    let v = if u.ratio(7, 8)? {
                        Value::String(word(u, STRINGS, false)?)
                    } else {
                        Value::Number(number(u)?)
                    };
                    m.insert(word(u, &["cpu", "memory", "team"], false)?, v);
                }
                Value::Object(m)
            }
            _ => any_json(u, KEYS, STRINGS, 1)?,
        };
        o.insert(key, value);
    }
    Ok(Value::Object(o))
}

/// The canonical JSON of `list` under `rules`.
fn canonical(list: &[Offering], rules: &OfferingRules) -> String {
    let items: Vec<Value> = list
        .iter()
        .map(|o| {
            let mut m = Map::new();
            m.insert(rules.type_key.into(), json!(o.instance_type));
            m.insert(rules.zone_key.into(), json!(o.zone));
            m.insert("capacity_type".into(), json!(o.capacity_type));
            m.insert("count".into(), json!(o.count));
            m.insert("resources".into(), json!(*o.resources));
            m.insert("labels".into(), json!(*o.labels));
            Value::Object(m)
        })
        .collect();
    Value::Array(items).to_string()
}

fn same(a: &[Offering], b: &[Offering]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.instance_type == y.instance_type
                && x.zone == y.zone
                && x.capacity_type == y.capacity_type
                && x.count == y.count
                && *x.resources == *y.resources
                && *x.labels == *y.labels
        })
}

fn property(u: &mut Unstructured<'_>) -> Result<()> {
    let doc = if u.ratio(1, 10)? {
        any_json(u, KEYS, STRINGS, 3)?
    } else {
        Value::Array(
            (0..u.int_in_range(0..=4)?)
                .map(|_| offering(u))
                .collect::<Result<_>>()?,
        )
    };
    let bytes = json_bytes(u, &doc)?;
    let text = String::from_utf8_lossy(&bytes);
    for rules in [&HETZNER, &DIGITALOCEAN] {
        let Ok(list) = offerings::parse(&text, rules) else {
            continue;
        };
        let again = offerings::parse(&canonical(&list, rules), rules)
            .expect("the canonical form of a parsed list parses");
        assert!(same(&list, &again), "canonical round trip changed the list");
        let _ = offerings::validate(&list, rules);
        let merged = offerings::merge_same_placement(list.clone());
        assert!(merged.len() <= list.len());
    }
    Ok(())
}

//! The reference provider's JSON state file, imported on first start with `--state FILE`.

use arbitrary::{Result, Unstructured};
use provider_core::durable::{self, DurableStore};
use provider_core::store::Store;
use serde_json::{Map, Value};

use crate::engine::Target;
use crate::shape::{json, json_bytes, number, word};

pub const IMPORT: Target = Target {
    name: "reference-import",
    checks: "reference-shaped JSON state files (Go key matching, nulls, wrong types, both fence \
             layouts), sometimes damaged: the read-only export and the import at startup agree \
             (both refuse, or the import succeeds and the new state directory exports exactly \
             what the file exported)",
    property,
};

const STATE_KEYS: &[&str] = &["machines", "fences", "ops", "rev", "next_op"];
const MACHINE_KEYS: &[&str] = &[
    "ID",
    "State",
    "Host",
    "InstanceType",
    "Zone",
    "CapacityType",
    "PricePerHour",
    "InterruptionProbability",
    "Resources",
    "Allocatable",
    "Labels",
    "Cluster",
    "ShardMetadata",
    "LastError",
];
const STRINGS: &[&str] = &[
    "m-1",
    "m-2",
    "",
    "IDLE",
    "SPECULATIVE",
    "CONFIGURED",
    "CREATING",
    "FAILED",
    "ON_DEMAND",
    "SPOT",
    "create",
    "delete",
    "configure",
    "drain",
    "op-7",
    "shard-a",
];

fn pick(u: &mut Unstructured<'_>, keys: &[&str], value: Value) -> Result<(String, Value)> {
    Ok((word(u, keys, true)?, value))
}

fn scalar(u: &mut Unstructured<'_>) -> Result<Value> {
    Ok(match u.int_in_range(0..=5)? {
        0 => Value::Null,
        1 => Value::Number(number(u)?),
        2 => Value::Bool(u.arbitrary()?),
        _ => Value::String(word(u, STRINGS, false)?),
    })
}

fn machine(u: &mut Unstructured<'_>) -> Result<Value> {
    let mut m = Map::new();
    for _ in 0..u.int_in_range(0..=10)? {
        let key = word(u, MACHINE_KEYS, true)?;
        let value = match key.to_lowercase().as_str() {
            "host" if u.ratio(3, 4)? => {
                let mut h = Map::new();
                h.insert("Provider".into(), scalar(u)?);
                h.insert(word(u, &["Ref", "ref"], false)?, scalar(u)?);
                Value::Object(h)
            }
            "resources" | "allocatable" | "labels" | "shardmetadata" => {
                let mut o = Map::new();
                for _ in 0..u.int_in_range(0..=3)? {
                    o.insert(word(u, &["cpu", "team"], false)?, scalar(u)?);
                }
                Value::Object(o)
            }
            _ => scalar(u)?,
        };
        m.insert(key, value);
    }
    Ok(Value::Object(m))
}

fn mark(u: &mut Unstructured<'_>) -> Result<Map<String, Value>> {
    let mut m = Map::new();
    m.insert(word(u, &["Epoch", "epoch"], false)?, scalar(u)?);
    m.insert(word(u, &["Sequence", "sequence"], false)?, scalar(u)?);
    Ok(m)
}

fn document(u: &mut Unstructured<'_>) -> Result<Value> {
    if u.ratio(1, 10)? {
        return json(u, STATE_KEYS, STRINGS, 3);
    }
    let mut state = Map::new();
    for _ in 0..u.int_in_range(0..=6)? {
        let key = word(u, STATE_KEYS, true)?;
        let value = match key.to_lowercase().as_str() {
            "machines" => Value::Array(
                (0..u.int_in_range(0..=4)?)
                    .map(|_| {
                        if u.ratio(1, 8)? {
                            Ok(Value::Null)
                        } else {
                            machine(u)
                        }
                    })
                    .collect::<Result<_>>()?,
            ),
            "fences" if u.arbitrary()? => {
                // The per-machine list layout.
                let mut items = Vec::new();
                for _ in 0..u.int_in_range(0..=4)? {
                    let mut f = mark(u)?;
                    f.insert("shard_id".into(), scalar(u)?);
                    f.insert("machine_id".into(), scalar(u)?);
                    items.push(Value::Object(f));
                }
                Value::Array(items)
            }
            "fences" => {
                // The older layout: shard-wide marks keyed by shard id.
                let mut o = Map::new();
                for _ in 0..u.int_in_range(0..=3)? {
                    o.insert(word(u, STRINGS, false)?, Value::Object(mark(u)?));
                }
                Value::Object(o)
            }
            "ops" => {
                let mut items = Vec::new();
                for _ in 0..u.int_in_range(0..=4)? {
                    let mut o = Map::new();
                    for key in ["machine_id", "kind", "operation_id"] {
                        let v = scalar(u)?;
                        let (k, v) = pick(u, &[key], v)?;
                        o.insert(k, v);
                    }
                    items.push(Value::Object(o));
                }
                Value::Array(items)
            }
            _ => scalar(u)?,
        };
        state.insert(key, value);
    }
    Ok(Value::Object(state))
}

fn export(path: &std::path::Path) -> std::result::Result<Value, String> {
    let text = durable::export_json(path)?;
    let mut value: Value = serde_json::from_str(&text).expect("the export is JSON");
    if let Some(object) = value.as_object_mut() {
        object.remove("source");
    }
    Ok(value)
}

fn property(u: &mut Unstructured<'_>) -> Result<()> {
    let doc = document(u)?;
    let bytes = json_bytes(u, &doc)?;
    let dir = tempfile::tempdir().expect("temporary directory");
    let file = dir.path().join("state.json");
    std::fs::write(&file, &bytes).expect("write the state file");
    let exported = export(&file);
    let opened = DurableStore::open(&file);
    match (&exported, opened) {
        (Ok(before), Ok(store)) => {
            store.load().expect("load after import");
            drop(store);
            assert!(file.is_dir(), "the file became a state directory");
            let after = export(&file).expect("the imported state exports");
            assert_eq!(&after, before, "the import kept exactly what the file held");
        }
        (Err(_), Err(_)) => {}
        (Ok(_), Err(e)) => panic!("the export read the file but the import refused it: {e}"),
        (Err(e), Ok(_)) => panic!("the import accepted a file the export refused: {e}"),
    }
    Ok(())
}

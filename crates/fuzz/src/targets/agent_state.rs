//! The on-host agent's record of executed commands (`--state`), which decides whether a
//! re-served command id runs or is answered from the record.

use arbitrary::{Result, Unstructured};
use digitalocean::agent::{RECORDED_COMMANDS, RecordedCommand, read_record, write_record};
use serde_json::{Map, Value};

use crate::engine::Target;
use crate::shape::{json as any_json, json_bytes, number, short_string, word};

pub const STATE: Target = Target {
    name: "agent-state",
    checks: "records of executed commands (ids of every form, repeated ids, outcomes ok, failed \
             or cut short, more ids than are kept) written as the agent writes them, and state \
             files shaped like them (keys missing, null, of the wrong type, unknown), sometimes \
             damaged: what is written reads back as the agent's own model of it; a well-formed \
             file loads exactly when every entry has a string id and an outcome that is absent, \
             null, {\"Ok\":null} or {\"Err\":string}; whatever loads is written back and reads \
             the same",
    property,
};

const IDS: &[&str] = &[
    "op-7.configure.0123456789abcdef",
    "op-7.ready",
    "op-9.drain",
    "x.0011223344556677.drain",
    "9f2c4a1b7e30-1",
    "",
    "op-7.configure.0123456789abcdef ",
];
const KEYS: &[&str] = &["executed", "id", "outcome", "Ok", "Err", "extra"];

fn outcome(u: &mut Unstructured<'_>) -> Result<Option<Result<(), String>>> {
    Ok(match u.int_in_range(0..=2)? {
        0 => None,
        1 => Some(Ok(())),
        _ => Some(Err(short_string(u)?)),
    })
}

/// The record after `entries`, by the rule the agent documents.
fn model(entries: &[RecordedCommand]) -> Vec<RecordedCommand> {
    let mut kept: Vec<RecordedCommand> = Vec::new();
    for (id, outcome) in entries {
        if let Some(entry) = kept.iter_mut().find(|e| &e.0 == id) {
            entry.1 = outcome.clone();
        } else {
            kept.push((id.clone(), outcome.clone()));
        }
    }
    let excess = kept.len().saturating_sub(RECORDED_COMMANDS);
    kept.drain(..excess);
    kept
}

fn written_records(u: &mut Unstructured<'_>, path: &std::path::Path) -> Result<()> {
    let mut entries = Vec::new();
    if u.ratio(1, 8)? {
        // More ids than are kept, some of them repeated.
        let n = u.int_in_range(RECORDED_COMMANDS - 4..=RECORDED_COMMANDS + 8)?;
        for i in 0..n {
            let id = if u.ratio(1, 16)? {
                word(u, IDS, false)?
            } else {
                format!("op-{i}.drain")
            };
            entries.push((id, outcome(u)?));
        }
    } else {
        for _ in 0..u.int_in_range(0..=8)? {
            entries.push((word(u, IDS, false)?, outcome(u)?));
        }
    }
    write_record(path, &entries).expect("write the record");
    assert_eq!(read_record(path).expect("read the record"), model(&entries));
    Ok(())
}

fn value(u: &mut Unstructured<'_>) -> Result<Value> {
    Ok(match u.int_in_range(0..=4)? {
        0 => Value::Null,
        1 => Value::Number(number(u)?),
        2 => Value::Bool(u.arbitrary()?),
        3 => any_json(u, KEYS, IDS, 1)?,
        _ => Value::String(word(u, IDS, false)?),
    })
}

fn outcome_value(u: &mut Unstructured<'_>) -> Result<Value> {
    Ok(match u.int_in_range(0..=5)? {
        0 => Value::Null,
        1 => serde_json::json!({"Ok": null}),
        2 => serde_json::json!({"Err": short_string(u)?}),
        3 => {
            let mut o = Map::new();
            for key in ["Ok", "Err", "ok"] {
                if u.arbitrary()? {
                    o.insert(key.to_owned(), value(u)?);
                }
            }
            Value::Object(o)
        }
        _ => value(u)?,
    })
}

fn entry_accepted(entry: &Value) -> bool {
    let Some(entry) = entry.as_object() else {
        return false;
    };
    let id = entry.get("id").is_some_and(Value::is_string);
    let outcome = match entry.get("outcome") {
        None | Some(Value::Null) => true,
        Some(Value::Object(o)) if o.len() == 1 => match o.iter().next() {
            Some((k, v)) if k == "Ok" => v.is_null(),
            Some((k, v)) if k == "Err" => v.is_string(),
            _ => false,
        },
        Some(_) => false,
    };
    id && outcome
}

fn state_files(u: &mut Unstructured<'_>, path: &std::path::Path) -> Result<()> {
    let mut entries = Vec::new();
    for _ in 0..u.int_in_range(0..=6)? {
        let entry = if u.ratio(7, 8)? {
            let mut o = Map::new();
            if u.ratio(7, 8)? {
                let id = if u.ratio(7, 8)? {
                    Value::String(word(u, IDS, false)?)
                } else {
                    value(u)?
                };
                o.insert("id".to_owned(), id);
            }
            if u.ratio(7, 8)? {
                o.insert("outcome".to_owned(), outcome_value(u)?);
            }
            if u.ratio(1, 8)? {
                o.insert("at".to_owned(), value(u)?);
            }
            Value::Object(o)
        } else {
            value(u)?
        };
        entries.push(entry);
    }
    let mut doc = Map::new();
    let executed = if u.ratio(7, 8)? {
        Some(Value::Array(entries.clone()))
    } else if u.arbitrary()? {
        Some(value(u)?)
    } else {
        None
    };
    if let Some(executed) = &executed {
        doc.insert("executed".to_owned(), executed.clone());
    }
    if u.ratio(1, 8)? {
        doc.insert("v".to_owned(), value(u)?);
    }
    let doc = Value::Object(doc);
    let bytes = json_bytes(u, &doc)?;
    std::fs::write(path, &bytes).expect("write the state file");
    let loaded = read_record(path);
    if bytes == serde_json::to_vec(&doc).unwrap_or_default() {
        let accepted = match &executed {
            Some(Value::Array(items)) => items.iter().all(entry_accepted),
            _ => false,
        };
        assert_eq!(
            loaded.is_ok(),
            accepted,
            "{}: {loaded:?}",
            String::from_utf8_lossy(&bytes)
        );
    }
    if let Ok(loaded) = loaded {
        write_record(path, &loaded).expect("write the record back");
        assert_eq!(read_record(path).expect("read it again"), model(&loaded));
    }
    Ok(())
}

fn property(u: &mut Unstructured<'_>) -> Result<()> {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("state.json");
    if u.arbitrary()? {
        written_records(u, &path)
    } else {
        state_files(u, &path)
    }
}

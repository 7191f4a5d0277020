//! The on-host agent's inputs: the command JSON the channel serves and the config file the
//! provider's user-data writes.

use arbitrary::{Result, Unstructured};
use digitalocean::agent::{AgentConfig, WireCommand};
use serde_json::{Map, Value};

use crate::engine::Target;
use crate::shape::{json as any_json, json_bytes, number, word};

pub const COMMAND: Target = Target {
    name: "agent-command",
    checks: "command bodies shaped like the channel's (every key present or missing, null, of \
             the wrong type, unknown keys), sometimes damaged: decoding never panics, and a body \
             is accepted exactly when `id` and `type` are strings and the optional \
             `cluster_id`/`blob` are strings and `grace_seconds` a whole number in i64",
    property: command_property,
};

pub const CONFIG: Target = Target {
    name: "agent-config",
    checks: "config files shaped like the provider writes them, sometimes damaged: loading never \
             panics, a config loads exactly when all four fields are non-blank strings, and \
             its Debug output never shows the token or the CA",
    property: config_property,
};

const COMMAND_KEYS: &[&str] = &["id", "type", "cluster_id", "blob", "grace_seconds", "extra"];
const STRINGS: &[&str] = &["c-1", "configure", "ready", "drain", "", " ", "aGVsbG8="];

fn value(u: &mut Unstructured<'_>) -> Result<Value> {
    Ok(match u.int_in_range(0..=5)? {
        0 => Value::Null,
        1 => Value::Number(number(u)?),
        2 => Value::Bool(u.arbitrary()?),
        3 => any_json(u, COMMAND_KEYS, STRINGS, 1)?,
        _ => Value::String(word(u, STRINGS, false)?),
    })
}

fn command_accepted(object: &Map<String, Value>) -> bool {
    let string = |k: &str, required: bool| match object.get(k) {
        None => !required,
        Some(v) => v.is_string(),
    };
    let grace = match object.get("grace_seconds") {
        None => true,
        Some(v) => v.as_i64().is_some(),
    };
    string("id", true)
        && string("type", true)
        && string("cluster_id", false)
        && string("blob", false)
        && grace
}

fn command_property(u: &mut Unstructured<'_>) -> Result<()> {
    let mut object = Map::new();
    for key in COMMAND_KEYS {
        if u.ratio(4, 5)? {
            let v = if u.ratio(3, 4)? {
                match *key {
                    "grace_seconds" => Value::Number(number(u)?),
                    _ => Value::String(word(u, STRINGS, false)?),
                }
            } else {
                value(u)?
            };
            object.insert((*key).to_owned(), v);
        }
    }
    let doc = Value::Object(object.clone());
    let bytes = json_bytes(u, &doc)?;
    let decoded = serde_json::from_slice::<WireCommand>(&bytes);
    if bytes == serde_json::to_vec(&doc).unwrap_or_default() {
        assert_eq!(
            decoded.is_ok(),
            command_accepted(&object),
            "{}: {decoded:?}",
            String::from_utf8_lossy(&bytes)
        );
    }
    Ok(())
}

/// The fields a config must hold as non-blank strings.
const REQUIRED_KEYS: &[&str] = &["endpoint", "machine_id"];
/// Fields that may be absent (or blank) but are strings when present: the trust fields
/// (`pinned_spki_sha256`, then `pinned_cert_pem`, wins when it is not blank), and the token,
/// which an enrolled agent removes from its config.
const TRUST_KEYS: &[&str] = &["ca_pem", "pinned_cert_pem", "pinned_spki_sha256", "token"];
const CONFIG_KEYS: &[&str] = &[
    "endpoint",
    "ca_pem",
    "pinned_cert_pem",
    "pinned_spki_sha256",
    "machine_id",
    "token",
];
const CA_PEM: &str = include_str!("../../../../testdata/pki/ca.pem");
const CHAIN_PEM: &str = concat!(
    include_str!("../../../../testdata/pki/server.pem"),
    include_str!("../../../../testdata/pki/ca.pem")
);
const CONFIG_STRINGS: &[&str] = &[
    "https://10.0.0.2:8443",
    "-----BEGIN CERTIFICATE-----\nMIIBcanary\n-----END CERTIFICATE-----\n",
    CA_PEM,
    CHAIN_PEM,
    "do/s-1/fra1/0",
    // A key pin (32 bytes of base64), and one of 31 bytes.
    "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=",
    "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA==",
    "tok-e4d1c7b9a0f2",
    "",
    "  ",
];

fn config_property(u: &mut Unstructured<'_>) -> Result<()> {
    let mut object = Map::new();
    for key in CONFIG_KEYS {
        if u.ratio(7, 8)? {
            let v = if u.ratio(7, 8)? {
                Value::String(word(u, CONFIG_STRINGS, false)?)
            } else {
                value(u)?
            };
            object.insert((*key).to_owned(), v);
        }
    }
    if u.ratio(1, 4)? {
        object.insert(word(u, &["extra", "Token"], false)?, value(u)?);
    }
    let doc = Value::Object(object.clone());
    let bytes = json_bytes(u, &doc)?;
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("config.json");
    std::fs::write(&path, &bytes).expect("write the config");
    let loaded = AgentConfig::load(&path);
    if bytes == serde_json::to_vec(&doc).unwrap_or_default() {
        let text = |k: &str| object.get(k).and_then(Value::as_str);
        let set = |k: &str| text(k).filter(|s| !s.trim().is_empty());
        let certificates = |pem: &str| provider_core::tls::parse_certificates(pem.as_bytes());
        // A key pin is 32 bytes: exactly 44 characters of padded base64 ending in one `=`,
        // whose last digit leaves its two spare bits at zero.
        const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let key_pin = |pin: &str| {
            let pin = pin.trim().as_bytes();
            pin.len() == 44
                && pin[43] == b'='
                && pin[..43].iter().all(|b| ALPHABET.contains(b))
                && ALPHABET
                    .iter()
                    .position(|b| *b == pin[42])
                    .is_some_and(|i| i % 4 == 0)
        };
        let trusted = match (
            set("pinned_spki_sha256"),
            set("pinned_cert_pem"),
            set("ca_pem"),
        ) {
            (Some(pin), _, _) => key_pin(pin),
            (None, Some(pinned), _) => certificates(pinned).is_ok_and(|c| c.len() == 1),
            (None, None, Some(anchors)) => certificates(anchors).is_ok(),
            (None, None, None) => false,
        };
        let accepted = REQUIRED_KEYS.iter().all(|k| set(k).is_some())
            && TRUST_KEYS
                .iter()
                .all(|k| object.get(*k).is_none_or(Value::is_string))
            && trusted;
        assert_eq!(loaded.is_ok(), accepted, "{:?}", loaded.as_ref().err());
    }
    if let Ok(config) = loaded {
        // The canaries may only show up if a non-secret field holds them too.
        let shown = format!("{config:?}");
        let public = format!("{} {}", config.endpoint, config.machine_id);
        if !public.contains("tok-e4d1c7b9a0f2") {
            assert!(!shown.contains("tok-e4d1c7b9a0f2"), "Debug shows the token");
        }
        if !public.contains("MIIBcanary") {
            assert!(!shown.contains("MIIBcanary"), "Debug shows the CA");
        }
    }
    Ok(())
}

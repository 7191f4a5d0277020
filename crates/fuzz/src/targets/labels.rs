//! What the clouds hand back about our hosts: Hetzner server labels and DigitalOcean Droplet
//! tags, both decoded into machine ids, provider instances and cluster bindings.

use std::collections::HashMap;

use arbitrary::{Result, Unstructured};
use digitalocean::naming;
use hetzner::labels;
use provider_core::encoding::{base32_decode, base32_lower};

use crate::engine::Target;
use crate::shape::{short_string, word};

pub const HETZNER: Target = Target {
    name: "hetzner-labels",
    checks: "arbitrary label maps (chunked and escaped values, stray chunks) decode without \
             panicking; every value we encode is a valid Hetzner label value, decodes to exactly \
             what was encoded, and replacing a long value with a short one leaves no stale chunk",
    property: hetzner_property,
};

pub const DIGITALOCEAN: Target = Target {
    name: "digitalocean-tags",
    checks: "arbitrary tag lists decode without panicking; every tag we write uses only \
             DigitalOcean's tag characters and decodes to exactly what was encoded; base32 text \
             that decodes re-encodes to the same text (case and padding aside)",
    property: digitalocean_property,
};

const LABEL_KEYS: &[&str] = &[
    labels::MACHINE_ID,
    "bigfleet-machine-id-1",
    "bigfleet-machine-id-2",
    labels::PROVIDER,
    "bigfleet-provider-1",
    labels::CLUSTER,
    "bigfleet-cluster-1",
    labels::MANAGED,
    labels::HOST_KEY_FP,
];

/// A value that is sometimes base32, escaped base32, label-safe, or anything.
fn label_value(u: &mut Unstructured<'_>) -> Result<String> {
    let raw = short_string(u)?;
    Ok(match u.int_in_range(0..=3)? {
        0 => base32_lower(raw.as_bytes()),
        1 => format!("b32.{}", base32_lower(raw.as_bytes())),
        2 => raw.chars().filter(|c| c.is_ascii_alphanumeric()).collect(),
        _ => raw,
    })
}

/// A long free-form value (machine ids and cluster ids may be long and contain anything).
fn text(u: &mut Unstructured<'_>) -> Result<String> {
    let mut s = String::new();
    for _ in 0..u.int_in_range(0..=4)? {
        s.push_str(&word(
            u,
            &["hetzner/cx22/nbg1/7", "b32.", "-", "é", "a"],
            false,
        )?);
    }
    Ok(s)
}

fn assert_valid_labels(pairs: &[(String, String)]) {
    for (k, v) in pairs {
        assert!(labels::is_label_value(v), "invalid label value {v:?}");
        assert!(k.len() <= labels::MAX_VALUE_LEN, "key too long {k:?}");
    }
}

fn hetzner_property(u: &mut Unstructured<'_>) -> Result<()> {
    // Whatever a server carries decodes without panicking.
    let mut found: HashMap<String, String> = HashMap::new();
    for _ in 0..u.int_in_range(0..=8)? {
        found.insert(word(u, LABEL_KEYS, false)?, label_value(u)?);
    }
    let _ = labels::machine_id_of(&found);
    let _ = labels::text_of(&found, labels::PROVIDER);
    let _ = labels::text_of(&found, labels::CLUSTER);
    assert!(labels::chunk_keys(&found, labels::MACHINE_ID).count() <= found.len());

    // What we write is valid and round-trips.
    let id = text(u)?;
    let pairs = labels::machine_id_labels(&id);
    assert_valid_labels(&pairs);
    let map: HashMap<String, String> = pairs.into_iter().collect();
    let decoded = labels::machine_id_of(&map);
    if id.is_empty() {
        assert_eq!(decoded, None);
    } else {
        assert_eq!(decoded.as_deref(), Some(id.as_str()));
    }
    let (long, short) = (text(u)?, text(u)?);
    let mut map: HashMap<String, String> = found;
    labels::set_chunked(
        &mut map,
        labels::CLUSTER,
        labels::text_labels(labels::CLUSTER, &long),
    );
    assert_valid_labels(&labels::text_labels(labels::CLUSTER, &long));
    assert_eq!(
        labels::text_of(&map, labels::CLUSTER).as_deref(),
        Some(long.as_str())
    );
    labels::set_chunked(
        &mut map,
        labels::CLUSTER,
        labels::text_labels(labels::CLUSTER, &short),
    );
    assert_eq!(
        labels::text_of(&map, labels::CLUSTER).as_deref(),
        Some(short.as_str())
    );
    let name = labels::server_name(&id);
    assert!(name.len() <= 63 && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'));
    Ok(())
}

fn is_tag(tag: &str) -> bool {
    !tag.is_empty()
        && tag
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b':' | b'_' | b'-'))
}

fn digitalocean_property(u: &mut Unstructured<'_>) -> Result<()> {
    let mut tags = Vec::new();
    for _ in 0..u.int_in_range(0..=6)? {
        let prefix = word(
            u,
            &[
                naming::MACHINE_TAG_PREFIX,
                naming::CLUSTER_TAG_PREFIX,
                naming::PROVIDER_TAG_PREFIX,
                "",
            ],
            false,
        )?;
        tags.push(format!("{prefix}{}", label_value(u)?));
    }
    for prefix in [
        naming::MACHINE_TAG_PREFIX,
        naming::CLUSTER_TAG_PREFIX,
        naming::PROVIDER_TAG_PREFIX,
    ] {
        let _ = naming::decode_tag(&tags, prefix);
    }
    let value = text(u)?;
    for (tag, prefix) in [
        (naming::machine_tag(&value), naming::MACHINE_TAG_PREFIX),
        (naming::cluster_tag(&value), naming::CLUSTER_TAG_PREFIX),
        (naming::provider_tag(&value), naming::PROVIDER_TAG_PREFIX),
    ] {
        assert!(is_tag(&tag), "not a valid tag: {tag:?}");
        let mut list = tags.clone();
        list.retain(|t| !t.starts_with(prefix));
        list.insert(u.int_in_range(0..=list.len())?, tag);
        assert_eq!(
            naming::decode_tag(&list, prefix).as_deref(),
            Some(value.as_str())
        );
    }
    assert!(is_tag(&naming::droplet_name(&value)));

    let raw = short_string(u)?;
    if let Some(bytes) = base32_decode(&raw) {
        assert_eq!(
            base32_lower(&bytes),
            raw.trim_end_matches('=').to_ascii_lowercase(),
            "base32 decoding is canonical"
        );
    }
    let n = u.int_in_range(0..=40)?;
    let bytes = u.bytes(n)?;
    assert_eq!(base32_decode(&base32_lower(bytes)).as_deref(), Some(bytes));
    Ok(())
}

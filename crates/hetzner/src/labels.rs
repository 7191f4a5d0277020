//! The server label scheme that ties a Hetzner server to one machine slot of one provider
//! instance, and the encodings that keep every value inside Hetzner's label syntax.
//!
//! Hetzner label values are at most 63 characters, must be empty or start and end with an ASCII
//! letter or digit, and may contain `-`, `_` and `.` in between. Our values come from outside
//! (machine ids, `--provider`, cluster ids) and may break every one of those rules, so:
//!
//! - `bigfleet-machine-id` is always the lower-case, unpadded RFC 4648 base32 of the machine id,
//!   as the reference writes it. A machine id longer than 39 bytes does not fit one value, so the
//!   base32 text is split into 63-character chunks stored under `bigfleet-machine-id`,
//!   `bigfleet-machine-id-1`, `bigfleet-machine-id-2`, ... and joined again on read. The scheme
//!   stays decodable (inventory reports the exact id) and selectable (a label selector names
//!   every chunk), and a server is only ever matched after its full id decodes equal.
//! - `bigfleet-provider` and `bigfleet-cluster` keep a value that is already label-safe verbatim
//!   (so operators can read it in the console). Anything else, and any value that itself starts
//!   with the escape prefix `b32.`, is written as `b32.` + base32 of its bytes, chunked the same
//!   way. The encoding is therefore injective and round-trips exactly.

use std::collections::HashMap;

use sha2::{Digest, Sha256};

/// Marks every server this provider manages (`bigfleet-managed=true`).
pub const MANAGED: &str = "bigfleet-managed";
/// The machine id (chunked base32, see the module doc).
pub const MACHINE_ID: &str = "bigfleet-machine-id";
/// The provider instance (`--provider`) that owns the server.
pub const PROVIDER: &str = "bigfleet-provider";
/// The pinned SSH host-key fingerprint.
pub const HOST_KEY_FP: &str = "bigfleet-host-key-fp";
/// The cluster the server was configured into.
pub const CLUSTER: &str = "bigfleet-cluster";

/// Hetzner's limit on a label value (and on a key's name part).
pub const MAX_VALUE_LEN: usize = 63;
const ESCAPE: &str = "b32.";

pub use provider_core::encoding::{base32_decode, base32_lower as base32};

/// Whether `value` is a valid Hetzner label value.
pub fn is_label_value(value: &str) -> bool {
    if value.is_empty() {
        return true;
    }
    let bytes = value.as_bytes();
    value.len() <= MAX_VALUE_LEN
        && bytes[0].is_ascii_alphanumeric()
        && bytes[bytes.len() - 1].is_ascii_alphanumeric()
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

fn chunk_key(key: &str, index: usize) -> String {
    if index == 0 {
        key.to_owned()
    } else {
        format!("{key}-{index}")
    }
}

fn chunked(key: &str, text: &str) -> Vec<(String, String)> {
    if text.is_empty() {
        return vec![(key.to_owned(), String::new())];
    }
    text.as_bytes()
        .chunks(MAX_VALUE_LEN)
        .enumerate()
        // The text is ASCII (base32 or a label-safe value), so byte chunks are valid UTF-8.
        .map(|(i, part)| {
            (
                chunk_key(key, i),
                String::from_utf8_lossy(part).into_owned(),
            )
        })
        .collect()
}

fn joined(labels: &HashMap<String, String>, key: &str) -> Option<String> {
    let mut text = labels.get(key)?.clone();
    for index in 1.. {
        match labels.get(&chunk_key(key, index)) {
            Some(part) => text.push_str(part),
            None => break,
        }
    }
    Some(text)
}

/// Every key a chunked value under `key` may occupy in `labels`.
pub fn chunk_keys<'a>(
    labels: &'a HashMap<String, String>,
    key: &'a str,
) -> impl Iterator<Item = String> + 'a {
    (0..)
        .map(move |i| chunk_key(key, i))
        .take_while(move |k| labels.contains_key(k))
}

/// The labels that carry `machine_id`.
pub fn machine_id_labels(machine_id: &str) -> Vec<(String, String)> {
    chunked(MACHINE_ID, &base32(machine_id.as_bytes()))
}

/// The machine id carried by `labels`, if it is present and decodes.
pub fn machine_id_of(labels: &HashMap<String, String>) -> Option<String> {
    let text = joined(labels, MACHINE_ID)?;
    String::from_utf8(base32_decode(&text)?)
        .ok()
        .filter(|id| !id.is_empty())
}

/// The labels that carry a free-form `value` under `key` (provider instance, cluster id).
pub fn text_labels(key: &str, value: &str) -> Vec<(String, String)> {
    if is_label_value(value) && !value.starts_with(ESCAPE) {
        vec![(key.to_owned(), value.to_owned())]
    } else {
        chunked(key, &format!("{ESCAPE}{}", base32(value.as_bytes())))
    }
}

/// The free-form value stored under `key` by [`text_labels`].
pub fn text_of(labels: &HashMap<String, String>, key: &str) -> Option<String> {
    let text = joined(labels, key)?;
    match text.strip_prefix(ESCAPE) {
        Some(encoded) => String::from_utf8(base32_decode(encoded)?).ok(),
        None => Some(text),
    }
}

/// Removes `key` and every chunk label of it from `labels`, also chunks stranded behind a gap
/// (a `key-2` without `key-1`), which a later, shorter value would otherwise pick up.
pub fn remove_chunked(labels: &mut HashMap<String, String>, key: &str) {
    labels.retain(|k, _| {
        let chunk = k.strip_prefix(key).is_some_and(|rest| {
            rest.is_empty()
                || rest
                    .strip_prefix('-')
                    .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        });
        !chunk
    });
}

/// Sets a chunked value, clearing stale chunks of a longer previous value first.
pub fn set_chunked(labels: &mut HashMap<String, String>, key: &str, pairs: Vec<(String, String)>) {
    remove_chunked(labels, key);
    labels.extend(pairs);
}

/// A Hetzner label selector matching exactly the given pairs (comma = AND).
pub fn selector(pairs: &[(String, String)]) -> String {
    pairs
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// The selector for every server owned by provider instance `provider`.
pub fn instance_selector(provider: &str) -> String {
    let mut pairs = vec![(MANAGED.to_owned(), "true".to_owned())];
    pairs.extend(text_labels(PROVIDER, provider));
    selector(&pairs)
}

/// The selector for managed servers without a provider label (made by the reference provider
/// or an earlier version); ownership is then decided by machine id and location.
pub fn legacy_selector() -> String {
    format!("{MANAGED}=true,!{PROVIDER}")
}

/// The server name for a machine: `bigfleet-` + 32 base32 characters of the SHA-256 of the
/// machine id. Stable across restarts and processes, a valid hostname, 41 characters.
pub fn server_name(machine_id: &str) -> String {
    let digest = Sha256::digest(machine_id.as_bytes());
    let mut name = String::from("bigfleet-");
    name.push_str(&base32(&digest)[..32]);
    name
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn map(pairs: Vec<(String, String)>) -> HashMap<String, String> {
        pairs.into_iter().collect()
    }

    #[test]
    fn reference_machine_id_label() {
        let labels = machine_id_labels("hetzner/OnDemand/cx22/nbg1/000");
        assert_eq!(labels.len(), 1);
        assert_eq!(labels[0].0, MACHINE_ID);
        assert_eq!(labels[0].1.len(), 48);
        assert_eq!(
            machine_id_of(&map(labels)).as_deref(),
            Some("hetzner/OnDemand/cx22/nbg1/000")
        );
        let short = machine_id_labels("op-1");
        assert_eq!(short[0].1, "n5yc2mi");
    }

    #[test]
    fn long_machine_ids_are_chunked_and_round_trip() {
        let id = "hetzner-production-eu-central/OnDemand/ccx63/fsn1/1024";
        let labels = machine_id_labels(id);
        assert!(labels.len() >= 2);
        assert_eq!(labels[1].0, "bigfleet-machine-id-1");
        assert!(labels.iter().all(|(_, v)| is_label_value(v)));
        assert_eq!(machine_id_of(&map(labels)).as_deref(), Some(id));
    }

    #[test]
    fn text_values_stay_readable_when_safe() {
        assert_eq!(
            text_labels(CLUSTER, "prod-eu-1"),
            vec![(CLUSTER.into(), "prod-eu-1".into())]
        );
        let odd = text_labels(CLUSTER, "team/a b");
        assert!(odd[0].1.starts_with("b32."));
        assert_eq!(text_of(&map(odd), CLUSTER).as_deref(), Some("team/a b"));
        let tricky = text_labels(PROVIDER, "b32.abc");
        assert_ne!(
            tricky[0].1, "b32.abc",
            "a value that looks escaped is escaped"
        );
        assert_eq!(text_of(&map(tricky), PROVIDER).as_deref(), Some("b32.abc"));
        assert_eq!(text_of(&HashMap::new(), CLUSTER), None);
    }

    #[test]
    fn label_value_rules() {
        assert!(is_label_value("a"));
        assert!(is_label_value("a.b-c_d"));
        assert!(is_label_value(""));
        assert!(!is_label_value("-a"));
        assert!(!is_label_value("a-"));
        assert!(!is_label_value("a/b"));
        assert!(!is_label_value(&"a".repeat(64)));
        assert!(is_label_value(&"a".repeat(63)));
    }

    #[test]
    fn set_chunked_drops_stale_chunks() {
        let mut labels = map(text_labels(CLUSTER, &"x/".repeat(60)));
        assert!(labels.contains_key("bigfleet-cluster-1"));
        set_chunked(&mut labels, CLUSTER, text_labels(CLUSTER, "short"));
        assert_eq!(labels.len(), 1);
        assert_eq!(text_of(&labels, CLUSTER).as_deref(), Some("short"));
        remove_chunked(&mut labels, CLUSTER);
        assert!(labels.is_empty());
    }

    #[test]
    fn server_names_are_stable_valid_hostnames() {
        let a = server_name("hetzner/OnDemand/cx22/nbg1/000");
        assert_eq!(a, server_name("hetzner/OnDemand/cx22/nbg1/000"));
        assert_ne!(a, server_name("hetzner/OnDemand/cx22/nbg1/001"));
        assert_eq!(a.len(), 41);
        assert!(a.starts_with("bigfleet-"));
        assert!(
            a.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        );
    }

    #[test]
    fn selectors() {
        assert_eq!(
            instance_selector("hetzner"),
            "bigfleet-managed=true,bigfleet-provider=hetzner"
        );
        assert!(
            instance_selector("a/b").starts_with("bigfleet-managed=true,bigfleet-provider=b32.")
        );
    }

    proptest! {
        #[test]
        fn base32_round_trips(bytes in proptest::collection::vec(any::<u8>(), 0..100)) {
            prop_assert_eq!(base32_decode(&base32(&bytes)), Some(bytes));
        }

        #[test]
        fn text_labels_round_trip_and_are_valid(value in "\\PC{0,90}") {
            let pairs = text_labels(CLUSTER, &value);
            prop_assert!(pairs.iter().all(|(_, v)| is_label_value(v)));
            prop_assert_eq!(text_of(&map(pairs), CLUSTER), Some(value));
        }

        #[test]
        fn machine_ids_round_trip(id in "[ -~]{1,120}") {
            let pairs = machine_id_labels(&id);
            prop_assert!(pairs.iter().all(|(_, v)| is_label_value(v)));
            prop_assert_eq!(machine_id_of(&map(pairs)), Some(id));
        }
    }
}

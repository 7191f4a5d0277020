//! Every crash the fuzz targets found, replayed from its shrunk input (so the target keeps
//! passing on it), plus a direct test of each fix.

#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use fuzz::engine::{Outcome, check};
use provider_core::durable::codec;
use provider_core::machine::{Machine, StringMap};
use provider_core::offerings::{self, Offering};
use provider_core::records::Slot;

fn bytes(hex: &str) -> Vec<u8> {
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect()
}

fn replay(target: &str, hex: &str) {
    let target = fuzz::target(target).unwrap();
    assert_eq!(check(target, &bytes(hex)), Outcome::Held);
}

/// durable-codec: a record whose map keys were out of order decoded, and re-encoded sorted,
/// so the decoder was not canonical.
#[test]
fn durable_codec_map_keys_out_of_order() {
    replay(
        "durable-codec",
        "3500000000170000df00abb6005d00000000000000000b00c5ad0000008a00ad007a0000fb004700e22000df000000e100000000a7000000000000000000000000000000000000000000cd00000000000000002a00c100000000a5000091003600f223db0000eb000000000000000000e500aa00000000b10000bd00002f00003f0000000000000000a20000bb67000000d400e60000be00f100000000cd00d10000c90000000000000000000000000000f1000900008f00009e4500006500000000000000008200460000ceecd4c9004aa24300a500000000c800000000000000fd003e000000150000a3001fa2fe00000000000000630600000000500200660000000e0000000027000e1d0000006f7e535a003b0000000020007f",
    );
}

#[test]
fn a_slot_whose_map_keys_are_out_of_order_is_refused() {
    let mut resources = BTreeMap::new();
    resources.insert("a".to_owned(), "1".to_owned());
    resources.insert("b".to_owned(), "2".to_owned());
    let mut machine = Machine::speculative("m-1", "cx22");
    machine.resources = StringMap::from(resources);
    let slot = Slot {
        machine: Arc::new(machine),
        last_change: 0,
        operations: Default::default(),
        sealed: None,
        enrollment: None,
        retired: None,
    };
    let mut encoded = Vec::new();
    codec::encode_slot(&slot, &mut encoded);
    assert_eq!(codec::decode_slot(&encoded).unwrap(), slot);
    let sorted: &[u8] = b"\x01\0\0\0a\x01\0\0\0\x31\x01\0\0\0b\x01\0\0\0\x32";
    let swapped: &[u8] = b"\x01\0\0\0b\x01\0\0\0\x32\x01\0\0\0a\x01\0\0\0\x31";
    let at = encoded
        .windows(sorted.len())
        .position(|w| w == sorted)
        .unwrap();
    encoded[at..at + sorted.len()].copy_from_slice(swapped);
    let err = codec::decode_slot(&encoded).unwrap_err();
    assert_eq!(err, "a map's keys are not in strictly ascending order");
}

/// offerings-json: merging two offerings of one placement added their counts with overflow.
#[test]
fn offerings_json_count_overflow_on_merge() {
    replay(
        "offerings-json",
        "4458250bf600fbf7b2007671000500000000000005010014000000000000001900f2000000000016007c005200000000005900000641000b001bbd0000000047cb0000000093e5e22b0000004d6a00ed5d005f0000000000",
    );
}

#[test]
fn merging_huge_counts_saturates() {
    let offering = |count| Offering {
        instance_type: "cx22".into(),
        zone: "nbg1".into(),
        capacity_type: String::new(),
        count,
        resources: StringMap::new(),
        labels: StringMap::new(),
    };
    let merged = offerings::merge_same_placement(vec![offering(i64::MAX), offering(5)]);
    assert_eq!(merged.len(), 1);
    assert_eq!(merged[0].count, i64::MAX);
}

/// hetzner-labels: a chunk label stranded behind a gap (`bigfleet-cluster-1` without
/// `bigfleet-cluster`) survived a rewrite and was read back as part of the new value.
#[test]
fn hetzner_labels_stranded_chunk() {
    replay("hetzner-labels", "1e00008500de00000000000000002a00");
}

#[test]
fn rewriting_a_chunked_label_drops_stranded_chunks() {
    use hetzner::labels;
    let mut map: HashMap<String, String> = HashMap::new();
    map.insert("bigfleet-cluster-1".into(), "stale".into());
    map.insert("bigfleet-cluster-3".into(), "stale".into());
    map.insert("bigfleet-cluster-x".into(), "not a chunk".into());
    labels::set_chunked(
        &mut map,
        labels::CLUSTER,
        labels::text_labels(labels::CLUSTER, "prod"),
    );
    assert_eq!(
        labels::text_of(&map, labels::CLUSTER).as_deref(),
        Some("prod")
    );
    assert!(!map.contains_key("bigfleet-cluster-3"));
    assert_eq!(map["bigfleet-cluster-x"], "not a chunk");
}

/// agent-state: the record a release before transition-derived command ids wrote still loads,
/// outcomes and all, and is written back unchanged beside an id of the new form.
#[test]
fn an_agent_state_file_of_the_earlier_release_loads() {
    use digitalocean::agent::{read_record, write_record};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.json");
    std::fs::write(
        &path,
        r#"{"executed":[{"id":"9f2c4a1b7e30-1","outcome":{"Ok":null}},{"id":"9f2c4a1b7e30-2","outcome":{"Err":"bootstrap hook failed: exit status: 3"}},{"id":"9f2c4a1b7e30-3","outcome":null}]}"#,
    )
    .unwrap();
    let mut record = read_record(&path).unwrap();
    assert_eq!(
        record,
        vec![
            ("9f2c4a1b7e30-1".to_owned(), Some(Ok(()))),
            (
                "9f2c4a1b7e30-2".to_owned(),
                Some(Err("bootstrap hook failed: exit status: 3".to_owned()))
            ),
            ("9f2c4a1b7e30-3".to_owned(), None),
        ]
    );
    record.push(("op-7.configure.0123456789abcdef".to_owned(), Some(Ok(()))));
    write_record(&path, &record).unwrap();
    assert_eq!(read_record(&path).unwrap(), record);
}

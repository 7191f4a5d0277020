//! The values of the etcd store's records (`--state etcd://…`): machine slots (the durable slot
//! encoding behind a format byte, sealed Configures included), fence marks and the meta record,
//! as a replica reads them at takeover and a standby reads them from its watch.

use arbitrary::{Result, Unstructured};
use provider_core::etcd::records::{
    Meta, decode_fence, decode_meta, decode_slot, encode_fence, encode_meta, encode_slot,
};
use provider_core::fence::HighWaterMark;
use provider_core::records::Change;

use crate::engine::Target;
use crate::shape::{mutate, short_string};
use crate::targets::durable::{same_change, slot};

pub const RECORDS: Target = Target {
    name: "etcd-records",
    checks: "machine slots (sealed Configures included), fence marks and meta records: \
             decode(encode(x)) == x and re-encodes to the same bytes; a damaged value either \
             fails to decode or decodes to a record that re-encodes to exactly its bytes",
    property,
};

/// Encodes, decodes and re-encodes one record of a kind chosen by `kind`.
fn round_trip(kind: u8, value: &[u8]) -> Option<Vec<u8>> {
    match kind {
        0 => decode_slot(value).ok().map(|s| encode_slot(&s)),
        1 => decode_fence(value)
            .ok()
            .map(|f| encode_fence(&f.shard_id, &f.machine_id, f.mark)),
        _ => decode_meta(value).ok().map(encode_meta),
    }
}

fn property(u: &mut Unstructured<'_>) -> Result<()> {
    let kind = u.int_in_range(0..=2)?;
    let encoded = match kind {
        0 => {
            let original = slot(u)?;
            let encoded = encode_slot(&original);
            let decoded = decode_slot(&encoded).expect("a slot we encoded decodes");
            assert!(
                same_change(
                    &Change::PutSlot(original.clone()),
                    &Change::PutSlot(decoded.clone())
                ),
                "round trip changed {original:?} into {decoded:?}"
            );
            encoded
        }
        1 => {
            let (shard, machine) = (short_string(u)?, short_string(u)?);
            let mark = HighWaterMark {
                epoch: u.arbitrary()?,
                sequence: u.arbitrary()?,
            };
            let encoded = encode_fence(&shard, &machine, mark);
            let decoded = decode_fence(&encoded).expect("a fence we encoded decodes");
            assert_eq!(
                (
                    decoded.shard_id.as_str(),
                    decoded.machine_id.as_str(),
                    decoded.mark
                ),
                (shard.as_str(), machine.as_str(), mark)
            );
            encoded
        }
        _ => {
            let meta = Meta {
                revision: u.arbitrary()?,
                next_op: u.arbitrary()?,
            };
            let encoded = encode_meta(meta);
            assert_eq!(decode_meta(&encoded), Ok(meta));
            encoded
        }
    };
    assert_eq!(
        round_trip(kind, &encoded).as_deref(),
        Some(&encoded[..]),
        "a decoded record re-encodes to the same bytes"
    );
    let damaged = mutate(u, &encoded)?;
    if let Some(again) = round_trip(kind, &damaged) {
        assert_eq!(
            again, damaged,
            "a value that decodes is canonical: it re-encodes to the bytes it came from"
        );
    }
    Ok(())
}

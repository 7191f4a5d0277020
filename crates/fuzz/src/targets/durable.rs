//! The durable store (`--state`): the record codec, whole state directories of damaged log and
//! snapshot files, and the store's own write/reopen round trip.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use arbitrary::{Result, Unstructured};
use provider_core::durable::codec::{self, Entry, RECORD_HEADER_LEN};
use provider_core::durable::{self, DurableStore};
use provider_core::fence::HighWaterMark;
use provider_core::machine::{CapacityType, HostRef, Machine, MachineState, StringMap};
use provider_core::records::{Change, Enrollment, FenceRecord, SealedConfigure, Slot, Snapshot};
use provider_core::store::Store;
use serde_json::Value;

use crate::engine::Target;
use crate::shape::{mutate, short_string, word};

pub const CODEC: Target = Target {
    name: "durable-codec",
    checks: "log records: decode(encode(batch)) == batch (floats bit for bit) and re-encodes to \
             the same bytes; a damaged record either fails to decode or decodes to changes that \
             re-encode to exactly the bytes it was decoded from",
    property: codec_property,
};

pub const FILES: Target = Target {
    name: "durable-files",
    checks: "state directories of generated and damaged log and snapshot files: the read-only \
             export and the store's startup agree (both fail, or the store opens and then \
             exports exactly what the first export showed); undamaged logs always load",
    property: files_property,
};

pub const STORE: Target = Target {
    name: "durable-store",
    checks: "random batches committed through DurableStore, then the store dropped: the \
             export equals the state a plain in-memory model of the same batches renders",
    property: store_property,
};

const IDS: &[&str] = &[
    "hetzner/cx22/nbg1/0",
    "hetzner/cx22/nbg1/1",
    "do/s-1/fra1/0",
    "",
];
const KEYS: &[&str] = &["cpu", "memory", "kubernetes.io/arch", "team", ""];

fn map(u: &mut Unstructured<'_>) -> Result<StringMap> {
    let mut m = BTreeMap::new();
    for _ in 0..u.int_in_range(0..=3)? {
        m.insert(word(u, KEYS, false)?, short_string(u)?);
    }
    Ok(StringMap::from(m))
}

fn float(u: &mut Unstructured<'_>) -> Result<f64> {
    Ok(match u.int_in_range(0..=3)? {
        0 => f64::from(u.int_in_range(0u16..=1000)?) / 1000.0,
        1 => f64::from_bits(u.arbitrary()?),
        2 => *u.choose(&[0.0, -0.0, f64::NAN, f64::INFINITY, f64::MIN_POSITIVE])?,
        _ => u.arbitrary()?,
    })
}

fn option_string(u: &mut Unstructured<'_>) -> Result<Option<String>> {
    Ok(if u.arbitrary()? {
        Some(word(u, &["op-1", "op-2", ""], false)?)
    } else {
        None
    })
}

pub(crate) fn slot(u: &mut Unstructured<'_>) -> Result<Slot> {
    let state = MachineState::ALL[u.choose_index(MachineState::ALL.len())?];
    let capacity_type =
        CapacityType::from_wire(u.int_in_range(0..=4)?).ok_or(arbitrary::Error::IncorrectFormat)?;
    let host = if u.arbitrary()? {
        Some(HostRef {
            provider: word(u, &["hetzner", "digitalocean"], false)?,
            id: short_string(u)?,
        })
    } else {
        None
    };
    let machine = Machine {
        id: word(u, IDS, false)?,
        state,
        host,
        instance_type: word(u, &["cx22", "s-2vcpu-4gb"], false)?,
        zone: word(u, &["nbg1", "fra1"], false)?,
        capacity_type,
        price_per_hour: float(u)?,
        interruption_probability: float(u)?,
        resources: map(u)?,
        allocatable: map(u)?,
        labels: map(u)?,
        last_error: short_string(u)?,
        cluster: short_string(u)?,
        shard_metadata: map(u)?,
        wire: Default::default(),
    };
    Ok(Slot {
        machine: Arc::new(machine),
        last_change: u.arbitrary()?,
        operations: [
            option_string(u)?,
            option_string(u)?,
            option_string(u)?,
            option_string(u)?,
        ],
        sealed: if u.arbitrary()? {
            Some(Arc::new(SealedConfigure {
                deadline_unix_ms: u.arbitrary()?,
                sealed: u.arbitrary()?,
            }))
        } else {
            None
        },
        // The enrollment trailer, alone or after the sealed one.
        enrollment: if u.arbitrary()? {
            Some(Arc::new(Enrollment {
                host_id: short_string(u)?,
                create_operation: word(u, &["op-1", "op-2", ""], false)?,
                credential_digest: u.arbitrary()?,
                conflict: u.arbitrary()?,
                confirmed: u.arbitrary()?,
            }))
        } else {
            None
        },
        retired: None,
    })
}

pub(crate) fn change(u: &mut Unstructured<'_>) -> Result<Change> {
    Ok(match u.int_in_range(0..=4)? {
        0 => Change::PutSlot(slot(u)?),
        4 => Change::RemoveFence {
            shard_id: word(u, &["shard-a", "shard-b"], false)?,
            machine_id: word(u, IDS, false)?,
        },
        1 => Change::RemoveSlot(word(u, IDS, false)?),
        2 => Change::PutFence {
            shard_id: word(u, &["shard-a", "shard-b"], false)?,
            machine_id: word(u, IDS, false)?,
            mark: HighWaterMark {
                epoch: u.arbitrary()?,
                sequence: u.arbitrary()?,
            },
        },
        _ => Change::Counters {
            revision: u.arbitrary()?,
            next_op: u.arbitrary()?,
        },
    })
}

fn batch(u: &mut Unstructured<'_>) -> Result<Vec<Change>> {
    let n = u.int_in_range(0..=6)?;
    (0..n).map(|_| change(u)).collect()
}

/// Equality with floats compared bit for bit (NaN == NaN of the same payload).
pub(crate) fn same_change(a: &Change, b: &Change) -> bool {
    match (a, b) {
        (Change::PutSlot(x), Change::PutSlot(y)) => {
            let (mx, my) = (&*x.machine, &*y.machine);
            mx.price_per_hour.to_bits() == my.price_per_hour.to_bits()
                && mx.interruption_probability.to_bits() == my.interruption_probability.to_bits()
                && {
                    let (mut cx, mut cy) = (mx.clone(), my.clone());
                    (cx.price_per_hour, cy.price_per_hour) = (0.0, 0.0);
                    (cx.interruption_probability, cy.interruption_probability) = (0.0, 0.0);
                    cx == cy
                }
                && x.last_change == y.last_change
                && x.operations == y.operations
                && x.sealed == y.sealed
        }
        _ => a == b,
    }
}

/// Decodes one record payload back into changes (a snapshot-end marker has no change form).
fn decode(payload: &[u8]) -> std::result::Result<(Vec<Change>, usize), String> {
    let mut changes = Vec::new();
    let mut ends = 0;
    codec::decode_record(payload, |entry| {
        match entry {
            Entry::PutSlot { id, encoded } => {
                let slot = codec::decode_slot(encoded)?;
                assert_eq!(slot.machine.id, id, "the entry's id is the slot's id");
                changes.push(Change::PutSlot(slot));
            }
            Entry::RemoveSlot(id) => changes.push(Change::RemoveSlot(id)),
            Entry::PutFence {
                shard_id,
                machine_id,
                mark,
            } => changes.push(Change::PutFence {
                shard_id,
                machine_id,
                mark,
            }),
            Entry::RemoveFence {
                shard_id,
                machine_id,
            } => changes.push(Change::RemoveFence {
                shard_id,
                machine_id,
            }),
            Entry::Counters { revision, next_op } => {
                changes.push(Change::Counters { revision, next_op })
            }
            Entry::SnapshotEnd { .. } => ends += 1,
        }
        Ok(())
    })?;
    Ok((changes, ends))
}

fn encode(changes: &[Change]) -> Vec<u8> {
    let mut frame = Vec::new();
    codec::encode_batch(changes, &mut frame);
    frame
}

fn codec_property(u: &mut Unstructured<'_>) -> Result<()> {
    let changes = batch(u)?;
    let frame = encode(&changes);
    let payload = &frame[RECORD_HEADER_LEN..];
    let (decoded, ends) = decode(payload).expect("a record we encoded decodes");
    assert_eq!(ends, 0);
    assert_eq!(decoded.len(), changes.len());
    for (a, b) in changes.iter().zip(&decoded) {
        assert!(same_change(a, b), "round trip changed {a:?} into {b:?}");
    }
    assert_eq!(
        encode(&decoded),
        frame,
        "a decoded record re-encodes to the same bytes"
    );

    let damaged = mutate(u, payload)?;
    if let Ok((changes, 0)) = decode(&damaged) {
        let again = encode(&changes);
        assert_eq!(
            &again[RECORD_HEADER_LEN..],
            &damaged[..],
            "a record that decodes is canonical: it re-encodes to the bytes it came from"
        );
    }
    Ok(())
}

/// A file header: magic, format version 1, kind (1 log, 2 snapshot), generation, checksum.
fn header(kind: u32, generation: u64) -> Vec<u8> {
    let mut h = Vec::with_capacity(32);
    h.extend_from_slice(b"BFSTATE\0");
    h.extend_from_slice(&1u32.to_le_bytes());
    h.extend_from_slice(&kind.to_le_bytes());
    h.extend_from_slice(&generation.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    let crc = crc32fast::hash(&h);
    h.extend_from_slice(&crc.to_le_bytes());
    h
}

/// Frames `payload` as a record: length, payload checksum, checksum of those two.
fn frame(payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + RECORD_HEADER_LEN);
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out.extend_from_slice(payload);
    out
}

/// A snapshot file as the store writes one: slots in id order, then fence marks, then the
/// counters, spread over records and closed by an end marker counting the slots and fences.
/// Returns the bytes and whether the end marker was deliberately falsified.
fn snapshot_file(u: &mut Unstructured<'_>, generation: u64) -> Result<(Vec<u8>, bool)> {
    let mut slots = BTreeMap::new();
    for _ in 0..u.int_in_range(0..=4)? {
        let s = slot(u)?;
        slots.insert(s.machine.id.clone(), s);
    }
    let mut fences = BTreeMap::new();
    for _ in 0..u.int_in_range(0..=3)? {
        let key = (
            word(u, &["shard-a", "shard-b"], false)?,
            word(u, IDS, false)?,
        );
        fences.insert(key, (u.arbitrary::<i64>()?, u.arbitrary::<i64>()?));
    }
    let (slot_count, fence_count) = (slots.len() as u64, fences.len() as u64);
    let mut changes: Vec<Change> = slots.into_values().map(Change::PutSlot).collect();
    changes.extend(
        fences.into_iter().map(
            |((shard_id, machine_id), (epoch, sequence))| Change::PutFence {
                shard_id,
                machine_id,
                mark: HighWaterMark { epoch, sequence },
            },
        ),
    );
    changes.push(Change::Counters {
        revision: u.int_in_range(0..=100)?,
        next_op: u.int_in_range(0..=100)?,
    });
    let mut out = header(2, generation);
    let per_record = u.int_in_range(1..=4)?;
    for part in changes.chunks(per_record) {
        out.extend_from_slice(&encode(part));
    }
    let falsified = u.ratio(1, 8)?;
    let slot_count = if falsified {
        slot_count.wrapping_add(u.int_in_range(1..=u64::MAX)?)
    } else {
        slot_count
    };
    let mut end = 1u32.to_le_bytes().to_vec();
    end.push(5);
    end.extend_from_slice(&slot_count.to_le_bytes());
    end.extend_from_slice(&fence_count.to_le_bytes());
    out.extend_from_slice(&frame(&end));
    Ok((out, falsified))
}

fn log_file(u: &mut Unstructured<'_>, generation: u64) -> Result<Vec<u8>> {
    let mut out = header(1, generation);
    for _ in 0..u.int_in_range(0..=4)? {
        out.extend_from_slice(&encode(&batch(u)?));
    }
    Ok(out)
}

fn name(kind: &str, generation: u64) -> String {
    format!("{kind}-{generation:020}")
}

/// The export as JSON without its `source` line (which names the path it was read from).
fn export(path: &Path) -> std::result::Result<Value, String> {
    let text = durable::export_json(path)?;
    let mut value: Value = serde_json::from_str(&text).expect("the export is JSON");
    if let Some(object) = value.as_object_mut() {
        object.remove("source");
    }
    Ok(value)
}

fn files_property(u: &mut Unstructured<'_>) -> Result<()> {
    let dir = tempfile::tempdir().expect("temporary directory");
    let state = dir.path().join("state");
    std::fs::create_dir(&state).expect("state directory");
    let first = u.int_in_range(0..=2u64)?;
    let mut damaged = false;
    if u.arbitrary()? {
        let (mut bytes, falsified) = snapshot_file(u, first)?;
        damaged |= falsified;
        if u.ratio(1, 3)? {
            bytes = mutate(u, &bytes)?;
            damaged = true;
        }
        std::fs::write(state.join(name("snapshot", first)), bytes).expect("write snapshot");
    }
    for generation in first..first + u.int_in_range(1..=2)? {
        let mut bytes = log_file(u, generation)?;
        if u.ratio(1, 3)? {
            bytes = mutate(u, &bytes)?;
            damaged = true;
        }
        std::fs::write(state.join(name("log", generation)), bytes).expect("write log");
    }
    let exported = export(&state);
    if !damaged
        && first == 0
        && let Err(e) = &exported
    {
        panic!("undamaged files load: {e}");
    }
    let opened = DurableStore::open(&state);
    match (&exported, opened) {
        (Ok(before), Ok(store)) => {
            let loaded = store.load().expect("load after open");
            drop(store);
            let _ = loaded;
            let after = export(&state).expect("a state the store opened exports");
            assert_eq!(&after, before, "startup kept exactly the exported state");
        }
        (Err(_), Err(_)) => {}
        (Ok(_), Err(e)) => panic!("the export read the state but startup refused it: {e}"),
        (Err(e), Ok(_)) => panic!("startup accepted a state the export refused: {e}"),
    }
    Ok(())
}

/// What the store must hold after `batches`: the last write of every slot, fence and counter.
fn model(batches: &[Vec<Change>]) -> Snapshot {
    let mut slots: BTreeMap<String, Slot> = BTreeMap::new();
    let mut fences: BTreeMap<(String, String), HighWaterMark> = BTreeMap::new();
    let (mut revision, mut next_op) = (0, 0);
    for change in batches.iter().flatten() {
        match change {
            Change::PutSlot(slot) => {
                slots.insert(slot.machine.id.clone(), slot.clone());
            }
            Change::RemoveSlot(id) => {
                slots.remove(id);
            }
            Change::PutFence {
                shard_id,
                machine_id,
                mark,
            } => {
                fences.insert((shard_id.clone(), machine_id.clone()), *mark);
            }
            Change::RemoveFence {
                shard_id,
                machine_id,
            } => {
                fences.remove(&(shard_id.clone(), machine_id.clone()));
            }
            Change::Counters {
                revision: r,
                next_op: n,
            } => (revision, next_op) = (*r, *n),
        }
    }
    Snapshot {
        slots: slots.into_values().collect(),
        fences: fences
            .into_iter()
            .map(|((shard_id, machine_id), mark)| FenceRecord {
                shard_id,
                machine_id,
                mark,
            })
            .collect(),
        revision,
        next_op,
    }
}

fn store_property(u: &mut Unstructured<'_>) -> Result<()> {
    let mut batches = Vec::new();
    for _ in 0..u.int_in_range(1..=6)? {
        batches.push(batch(u)?);
    }
    let dir = tempfile::tempdir().expect("temporary directory");
    let state = dir.path().join("state");
    let reopen = u.arbitrary::<bool>()?;
    {
        let store = DurableStore::open(&state).expect("a fresh store opens");
        let split = if reopen {
            batches.len() / 2
        } else {
            batches.len()
        };
        for b in &batches[..split] {
            let _ = store.submit(b.clone());
        }
        drop(store);
        if reopen {
            let store = DurableStore::open(&state).expect("the store reopens");
            let _ = store.load().expect("load");
            for b in &batches[split..] {
                let _ = store.submit(b.clone());
            }
        }
    }
    let expected = model(&batches);
    let rendered = durable::render_json(&expected, "model");
    match (export(&state), rendered) {
        (Ok(got), Ok(text)) => {
            let mut want: Value = serde_json::from_str(&text).expect("JSON");
            if let Some(object) = want.as_object_mut() {
                object.remove("source");
            }
            assert_eq!(got, want, "the store holds what was committed");
        }
        (Err(a), Err(b)) => assert_eq!(a, b),
        (got, want) => panic!("export {got:?} but model {want:?}"),
    }
    Ok(())
}

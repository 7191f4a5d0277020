//! The byte layout of the state files: the file header, the framing of one record, and the
//! encoding of each [`Change`] and [`Slot`]. Little-endian integers, `u32`-length-prefixed
//! UTF-8 strings, CRC-32 (IEEE) checksums. Only this module knows the layout; a change to it
//! bumps [`FORMAT_VERSION`].

use std::sync::Arc;

use crate::rules::fence::HighWaterMark;
use crate::rules::lifecycle::OperationKind;
use crate::rules::machine::{CapacityType, HostRef, Machine, MachineState, StringMap};
use crate::rules::records::{Change, Enrollment, RetireReason, Retired, SealedConfigure, Slot};

/// The first eight bytes of every state file.
pub(crate) const MAGIC: [u8; 8] = *b"BFSTATE\0";
/// The format this build writes and the newest it reads. Version 2 added the fence removal
/// entry; version 1 files read unchanged.
pub(crate) const FORMAT_VERSION: u32 = 2;
/// Magic, version, kind, generation, reserved, header checksum.
pub(crate) const HEADER_LEN: usize = 32;
/// Payload length, payload checksum, checksum of those two fields.
pub const RECORD_HEADER_LEN: usize = 12;
/// No record is ever larger; a larger length is corruption.
pub(crate) const MAX_RECORD_LEN: u32 = 1 << 30;

const TAG_PUT_SLOT: u8 = 1;
const TAG_REMOVE_SLOT: u8 = 2;
const TAG_PUT_FENCE: u8 = 3;
const TAG_COUNTERS: u8 = 4;
const TAG_SNAPSHOT_END: u8 = 5;
const TAG_REMOVE_FENCE: u8 = 6;

/// What a state file holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FileKind {
    /// Batches of changes, appended as they are committed.
    Log,
    /// The whole state as of the start of the log with the same generation.
    Snapshot,
}

impl FileKind {
    fn number(self) -> u32 {
        match self {
            FileKind::Log => 1,
            FileKind::Snapshot => 2,
        }
    }

    pub(crate) fn noun(self) -> &'static str {
        match self {
            FileKind::Log => "log",
            FileKind::Snapshot => "snapshot",
        }
    }
}

/// The header every state file starts with.
pub(crate) fn encode_header(kind: FileKind, generation: u64) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..8].copy_from_slice(&MAGIC);
    h[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&kind.number().to_le_bytes());
    h[16..24].copy_from_slice(&generation.to_le_bytes());
    let crc = crc32fast::hash(&h[0..28]);
    h[28..32].copy_from_slice(&crc.to_le_bytes());
    h
}

/// Checks a file header: what it holds must be `kind` of generation `generation`. The magic and
/// the version are checked first, so a file from a newer build is reported as such rather than
/// as a checksum failure.
pub(crate) fn check_header(bytes: &[u8], kind: FileKind, generation: u64) -> Result<(), String> {
    if bytes.is_empty() {
        return Err("the file is empty (zero length)".into());
    }
    let n = bytes.len().min(MAGIC.len());
    if bytes[..n] != MAGIC[..n] {
        return Err("not a BigFleet provider state file (unknown magic bytes)".into());
    }
    if bytes.len() < 12 {
        return Err(format!(
            "the file is truncated inside its header ({} bytes)",
            bytes.len()
        ));
    }
    let version = u32::from_le_bytes(le4(&bytes[8..12]));
    if version > FORMAT_VERSION {
        return Err(format!(
            "written in state format version {version}, but this build reads versions up to \
             {FORMAT_VERSION}: run the newer provider build that wrote it"
        ));
    }
    if version == 0 {
        return Err("unknown state format version 0".into());
    }
    if bytes.len() < HEADER_LEN {
        return Err(format!(
            "the file is truncated inside its header ({} bytes)",
            bytes.len()
        ));
    }
    let stored = u32::from_le_bytes(le4(&bytes[28..32]));
    if crc32fast::hash(&bytes[0..28]) != stored {
        return Err("header checksum mismatch (the header is corrupt)".into());
    }
    let found_kind = u32::from_le_bytes(le4(&bytes[12..16]));
    if found_kind != kind.number() {
        return Err(format!(
            "the header says file kind {found_kind}, but its name says it is a {}",
            kind.noun()
        ));
    }
    let found_generation = u64::from_le_bytes(le8(&bytes[16..24]));
    if found_generation != generation {
        return Err(format!(
            "the header says generation {found_generation}, but its name says {generation} \
             (a file was renamed or copied from elsewhere)"
        ));
    }
    Ok(())
}

fn le4(b: &[u8]) -> [u8; 4] {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    a
}

fn le8(b: &[u8]) -> [u8; 8] {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    a
}

/// Reserves room for a record header at the end of `out`; returns where the record starts.
pub(crate) fn begin_record(out: &mut Vec<u8>) -> usize {
    let start = out.len();
    out.extend_from_slice(&[0u8; RECORD_HEADER_LEN]);
    start
}

/// Fills in the header of the record begun at `start` (its payload is everything after it).
pub(crate) fn finish_record(out: &mut [u8], start: usize) {
    let payload_len = out.len() - start - RECORD_HEADER_LEN;
    let len = u32::try_from(payload_len).unwrap_or(u32::MAX);
    let payload_crc = crc32fast::hash(&out[start + RECORD_HEADER_LEN..]);
    out[start..start + 4].copy_from_slice(&len.to_le_bytes());
    out[start + 4..start + 8].copy_from_slice(&payload_crc.to_le_bytes());
    let header_crc = crc32fast::hash(&out[start..start + 8]);
    out[start + 8..start + 12].copy_from_slice(&header_crc.to_le_bytes());
}

/// A record header as read back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RecordHeader {
    pub len: u32,
    pub payload_crc: u32,
}

/// Parses a record header; `None` when its own checksum does not match.
pub(crate) fn read_record_header(bytes: &[u8]) -> Option<RecordHeader> {
    let len = u32::from_le_bytes(le4(&bytes[0..4]));
    let payload_crc = u32::from_le_bytes(le4(&bytes[4..8]));
    let header_crc = u32::from_le_bytes(le4(&bytes[8..12]));
    (crc32fast::hash(&bytes[0..8]) == header_crc).then_some(RecordHeader { len, payload_crc })
}

/// Appends one framed record holding `batch`.
pub fn encode_batch(batch: &[Change], out: &mut Vec<u8>) {
    let start = begin_batch(out);
    for change in batch {
        encode_change(change, out);
    }
    finish_batch(out, start, batch.len());
}

/// Begins a record whose entries are appended one by one (snapshots); returns where it starts.
pub(crate) fn begin_batch(out: &mut Vec<u8>) -> usize {
    let start = begin_record(out);
    put_u32(out, 0);
    start
}

/// Finishes a record begun with [`begin_batch`] that holds `entries` entries.
pub(crate) fn finish_batch(out: &mut [u8], start: usize, entries: usize) {
    let at = start + RECORD_HEADER_LEN;
    out[at..at + 4].copy_from_slice(&(entries as u32).to_le_bytes());
    finish_record(out, start);
}

fn encode_change(change: &Change, out: &mut Vec<u8>) {
    match change {
        Change::PutSlot(slot) => put_slot_entry(out, |out| encode_slot(slot, out)),
        Change::RemoveSlot(id) => {
            out.push(TAG_REMOVE_SLOT);
            put_str(out, id);
        }
        Change::PutFence {
            shard_id,
            machine_id,
            mark,
        } => encode_fence(shard_id, machine_id, *mark, out),
        Change::RemoveFence {
            shard_id,
            machine_id,
        } => {
            out.push(TAG_REMOVE_FENCE);
            put_str(out, shard_id);
            put_str(out, machine_id);
        }
        Change::Counters { revision, next_op } => encode_counters(*revision, *next_op, out),
    }
}

/// A slot entry: tag, byte length, the encoded slot (so a reader can skip or copy it whole).
fn put_slot_entry(out: &mut Vec<u8>, body: impl FnOnce(&mut Vec<u8>)) {
    out.push(TAG_PUT_SLOT);
    let len_at = out.len();
    put_u32(out, 0);
    body(out);
    let len = (out.len() - len_at - 4) as u32;
    out[len_at..len_at + 4].copy_from_slice(&len.to_le_bytes());
}

/// A slot entry from an already encoded slot (compaction copies slots without decoding them).
pub(crate) fn encode_slot_entry_raw(encoded: &[u8], out: &mut Vec<u8>) {
    put_slot_entry(out, |out| out.extend_from_slice(encoded));
}

pub(crate) fn encode_fence(
    shard_id: &str,
    machine_id: &str,
    mark: HighWaterMark,
    out: &mut Vec<u8>,
) {
    out.push(TAG_PUT_FENCE);
    put_str(out, shard_id);
    put_str(out, machine_id);
    put_i64(out, mark.epoch);
    put_i64(out, mark.sequence);
}

pub(crate) fn encode_counters(revision: i64, next_op: u64, out: &mut Vec<u8>) {
    out.push(TAG_COUNTERS);
    put_i64(out, revision);
    put_u64(out, next_op);
}

pub(crate) fn encode_snapshot_end(slots: u64, fences: u64, out: &mut Vec<u8>) {
    out.push(TAG_SNAPSHOT_END);
    put_u64(out, slots);
    put_u64(out, fences);
}

/// Marks the optional trailer of a slot that holds a sealed Configure. A slot without one ends
/// after its operation ids, byte for byte as before the trailer existed, so files written
/// before it read unchanged; a build without it refuses only a slot that carries one.
const SEALED_TRAILER: u8 = 1;
/// Marks the optional trailer of a slot whose host's agent enrolled (after the sealed one, if
/// both are present). Like the sealed trailer, a slot without one encodes as before it existed.
/// Its last byte holds flags: [`ENROLLMENT_CONFLICT`] (all a trailer held before confirmation
/// existed, so older trailers read unchanged) and [`ENROLLMENT_CONFIRMED`].
const ENROLLMENT_TRAILER: u8 = 2;
/// Marks the optional trailer of a retired FAILED record (after the others): the reason's code,
/// the time it retired and its successor's id. A slot without one encodes as before.
const RETIRED_TRAILER: u8 = 3;
/// Flag of the enrollment trailer: a second enrollment cut the machine off.
const ENROLLMENT_CONFLICT: u8 = 1;
/// Flag of the enrollment trailer: the enrolled agent acknowledged a Configure's blob.
const ENROLLMENT_CONFIRMED: u8 = 2;

/// Encodes one slot. The machine id comes first, so [`slot_id`] can read it alone.
pub fn encode_slot(slot: &Slot, out: &mut Vec<u8>) {
    let m = &*slot.machine;
    put_str(out, &m.id);
    out.push(m.state.wire() as u8);
    match &m.host {
        None => out.push(0),
        Some(host) => {
            out.push(1);
            put_str(out, &host.provider);
            put_str(out, &host.id);
        }
    }
    put_str(out, &m.instance_type);
    put_str(out, &m.zone);
    out.push(m.capacity_type.wire() as u8);
    put_u64(out, m.price_per_hour.to_bits());
    put_u64(out, m.interruption_probability.to_bits());
    put_map(out, &m.resources);
    put_map(out, &m.allocatable);
    put_map(out, &m.labels);
    put_str(out, &m.last_error);
    put_str(out, &m.cluster);
    put_map(out, &m.shard_metadata);
    put_i64(out, slot.last_change);
    for op in &slot.operations {
        match op {
            None => out.push(0),
            Some(id) => {
                out.push(1);
                put_str(out, id);
            }
        }
    }
    if let Some(sealed) = &slot.sealed {
        out.push(SEALED_TRAILER);
        put_u64(out, sealed.deadline_unix_ms);
        put_u32(out, sealed.sealed.len() as u32);
        out.extend_from_slice(&sealed.sealed);
    }
    if let Some(enrollment) = &slot.enrollment {
        out.push(ENROLLMENT_TRAILER);
        put_str(out, &enrollment.host_id);
        put_str(out, &enrollment.create_operation);
        put_u32(out, enrollment.credential_digest.len() as u32);
        out.extend_from_slice(&enrollment.credential_digest);
        let mut flags = 0;
        if enrollment.conflict {
            flags |= ENROLLMENT_CONFLICT;
        }
        if enrollment.confirmed {
            flags |= ENROLLMENT_CONFIRMED;
        }
        out.push(flags);
    }
    if let Some(retired) = &slot.retired {
        out.push(RETIRED_TRAILER);
        out.push(retired.reason.code());
        put_u64(out, retired.unix_seconds);
        put_str(out, &retired.successor);
    }
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_i64(out: &mut Vec<u8>, v: i64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    put_u32(out, s.len() as u32);
    out.extend_from_slice(s.as_bytes());
}

fn put_map(out: &mut Vec<u8>, map: &StringMap) {
    put_u32(out, map.len() as u32);
    for (k, v) in map {
        put_str(out, k);
        put_str(out, v);
    }
}

/// One decoded change. Slots are handed over still encoded, with their id.
#[derive(Debug, PartialEq)]
pub enum Entry<'a> {
    PutSlot {
        id: String,
        encoded: &'a [u8],
    },
    RemoveSlot(String),
    PutFence {
        shard_id: String,
        machine_id: String,
        mark: HighWaterMark,
    },
    RemoveFence {
        shard_id: String,
        machine_id: String,
    },
    Counters {
        revision: i64,
        next_op: u64,
    },
    SnapshotEnd {
        slots: u64,
        fences: u64,
    },
}

/// Decodes the payload of one record, handing each entry to `visit` in order.
pub fn decode_record<'a>(
    payload: &'a [u8],
    mut visit: impl FnMut(Entry<'a>) -> Result<(), String>,
) -> Result<(), String> {
    let mut r = Reader::new(payload);
    let count = r.u32()?;
    for _ in 0..count {
        let entry = match r.u8()? {
            TAG_PUT_SLOT => {
                let len = r.u32()? as usize;
                let encoded = r.bytes(len)?;
                Entry::PutSlot {
                    id: slot_id(encoded)?,
                    encoded,
                }
            }
            TAG_REMOVE_SLOT => Entry::RemoveSlot(r.string()?),
            TAG_PUT_FENCE => Entry::PutFence {
                shard_id: r.string()?,
                machine_id: r.string()?,
                mark: HighWaterMark {
                    epoch: r.i64()?,
                    sequence: r.i64()?,
                },
            },
            TAG_REMOVE_FENCE => Entry::RemoveFence {
                shard_id: r.string()?,
                machine_id: r.string()?,
            },
            TAG_COUNTERS => Entry::Counters {
                revision: r.i64()?,
                next_op: r.u64()?,
            },
            TAG_SNAPSHOT_END => Entry::SnapshotEnd {
                slots: r.u64()?,
                fences: r.u64()?,
            },
            tag => return Err(format!("unknown entry kind {tag}")),
        };
        visit(entry)?;
    }
    if r.remaining() != 0 {
        return Err(format!(
            "{} unexpected bytes after the last entry",
            r.remaining()
        ));
    }
    Ok(())
}

/// The machine id of an encoded slot.
pub(crate) fn slot_id(encoded: &[u8]) -> Result<String, String> {
    Reader::new(encoded).string()
}

/// Decodes one slot.
pub fn decode_slot(encoded: &[u8]) -> Result<Slot, String> {
    let mut r = Reader::new(encoded);
    let id = r.string()?;
    let state_number = r.u8()?;
    let state = MachineState::from_wire(i32::from(state_number))
        .ok_or_else(|| format!("slot {id}: unknown machine state {state_number}"))?;
    let host = match r.u8()? {
        0 => None,
        1 => Some(HostRef {
            provider: r.string()?,
            id: r.string()?,
        }),
        other => return Err(format!("slot {id}: bad host marker {other}")),
    };
    let instance_type = r.string()?;
    let zone = r.string()?;
    let capacity_number = r.u8()?;
    let capacity_type = CapacityType::from_wire(i32::from(capacity_number))
        .ok_or_else(|| format!("slot {id}: unknown capacity type {capacity_number}"))?;
    let price_per_hour = f64::from_bits(r.u64()?);
    let interruption_probability = f64::from_bits(r.u64()?);
    let resources = r.map()?;
    let allocatable = r.map()?;
    let labels = r.map()?;
    let last_error = r.string()?;
    let cluster = r.string()?;
    let shard_metadata = r.map()?;
    let last_change = r.i64()?;
    let mut operations: [Option<String>; 4] = Default::default();
    for kind in OperationKind::ALL {
        operations[kind.index()] = match r.u8()? {
            0 => None,
            1 => Some(r.string()?),
            other => return Err(format!("slot {id}: bad operation marker {other}")),
        };
    }
    let mut sealed = None;
    let mut enrollment = None;
    let mut retired = None;
    // Trailers come in marker order, each at most once.
    let mut last_marker = 0;
    while r.remaining() != 0 {
        let marker = r.u8()?;
        if marker <= last_marker {
            return Err(format!("slot {id}: trailer marker {marker} out of order"));
        }
        last_marker = marker;
        match marker {
            SEALED_TRAILER => {
                let deadline_unix_ms = r.u64()?;
                let len = r.u32()? as usize;
                sealed = Some(Arc::new(SealedConfigure {
                    deadline_unix_ms,
                    sealed: r.bytes(len)?.to_vec(),
                }));
            }
            ENROLLMENT_TRAILER => {
                let host_id = r.string()?;
                let create_operation = r.string()?;
                let len = r.u32()? as usize;
                let credential_digest = r.bytes(len)?.to_vec();
                let flags = r.u8()?;
                if flags & !(ENROLLMENT_CONFLICT | ENROLLMENT_CONFIRMED) != 0 {
                    return Err(format!("slot {id}: bad enrollment flags {flags}"));
                }
                enrollment = Some(Arc::new(Enrollment {
                    host_id,
                    create_operation,
                    credential_digest,
                    conflict: flags & ENROLLMENT_CONFLICT != 0,
                    confirmed: flags & ENROLLMENT_CONFIRMED != 0,
                }));
            }
            RETIRED_TRAILER => {
                let code = r.u8()?;
                let reason = RetireReason::from_code(code)
                    .ok_or_else(|| format!("slot {id}: bad retirement reason {code}"))?;
                retired = Some(Retired {
                    reason,
                    unix_seconds: r.u64()?,
                    successor: r.string()?,
                });
            }
            other => return Err(format!("slot {id}: bad trailer marker {other}")),
        }
    }
    if r.remaining() != 0 {
        return Err(format!(
            "slot {id}: {} unexpected trailing bytes",
            r.remaining()
        ));
    }
    Ok(Slot {
        machine: Arc::new(Machine {
            id,
            state,
            host,
            instance_type,
            zone,
            capacity_type,
            price_per_hour,
            interruption_probability,
            resources,
            allocatable,
            labels,
            last_error,
            cluster,
            shard_metadata,
            wire: Default::default(),
        }),
        last_change,
        operations,
        sealed,
        enrollment,
        retired,
    })
}

/// A bounds-checked cursor over a payload.
/// How many distinct encoded maps the decoder remembers for sharing.
const MAP_CACHE_LIMIT: usize = 4096;

thread_local! {
    static MAP_CACHE: std::cell::RefCell<std::collections::HashMap<Vec<u8>, StringMap>> =
        std::cell::RefCell::new(std::collections::HashMap::new());
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf, pos: 0 }
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn bytes(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.remaining() < n {
            return Err(format!(
                "an entry runs past the end of its record ({n} bytes wanted, {} left)",
                self.remaining()
            ));
        }
        let out = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.bytes(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(le4(self.bytes(4)?)))
    }

    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(le8(self.bytes(8)?)))
    }

    fn i64(&mut self) -> Result<i64, String> {
        Ok(i64::from_le_bytes(le8(self.bytes(8)?)))
    }

    fn string(&mut self) -> Result<String, String> {
        let len = self.u32()? as usize;
        let bytes = self.bytes(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| "a string is not valid UTF-8".to_owned())
    }

    fn map(&mut self) -> Result<StringMap, String> {
        // Identical maps (the resources, allocatable and labels of every slot of an offering)
        // are decoded once and shared, as they were in memory before the restart.
        let start = self.pos;
        let count = self.u32()?;
        for _ in 0..count.saturating_mul(2) {
            let len = self.u32()? as usize;
            self.bytes(len)?;
        }
        let encoded = &self.buf[start..self.pos];
        if count == 0 {
            return Ok(StringMap::new());
        }
        if let Some(shared) = MAP_CACHE.with(|c| c.borrow().get(encoded).cloned()) {
            return Ok(shared);
        }
        let mut entries = Reader::new(encoded);
        entries.u32()?;
        let mut map = std::collections::BTreeMap::new();
        for _ in 0..count {
            let k = entries.string()?;
            let v = entries.string()?;
            // Maps are written in key order; anything else would not re-encode to its bytes.
            if map.last_key_value().is_some_and(|(last, _)| *last >= k) {
                return Err("a map's keys are not in strictly ascending order".into());
            }
            map.insert(k, v);
        }
        let map = StringMap::from(map);
        MAP_CACHE.with(|c| {
            let mut cache = c.borrow_mut();
            if cache.len() >= MAP_CACHE_LIMIT {
                cache.clear();
            }
            cache.insert(encoded.to_vec(), map.clone());
        });
        Ok(map)
    }
}

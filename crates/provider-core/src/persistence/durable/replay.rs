//! Reading a state directory back: which files make up the state, replaying the snapshot and
//! the logs that follow it into an [`Image`], and telling a torn final record (a write that was
//! cut short and never acknowledged) from corruption.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

use super::codec::{
    self, Entry, FileKind, HEADER_LEN, MAX_RECORD_LEN, RECORD_HEADER_LEN, decode_record,
};
use super::layout::{self, Listing};
use crate::rules::fence::HighWaterMark;
use crate::rules::records::{FenceRecord, Slot, Snapshot};

/// How a slot is held while replaying: decoded (loading for the engine) or still encoded
/// (compaction, which only copies slots from the old files into the new snapshot).
pub(crate) trait SlotForm: Sized {
    fn from_encoded(encoded: &[u8]) -> Result<Self, String>;
}

impl SlotForm for Slot {
    fn from_encoded(encoded: &[u8]) -> Result<Slot, String> {
        codec::decode_slot(encoded)
    }
}

impl SlotForm for Box<[u8]> {
    fn from_encoded(encoded: &[u8]) -> Result<Box<[u8]>, String> {
        Ok(encoded.into())
    }
}

/// The state as the files describe it.
#[derive(Debug)]
pub(crate) struct Image<S> {
    pub slots: BTreeMap<String, S>,
    pub fences: BTreeMap<(String, String), HighWaterMark>,
    pub revision: i64,
    pub next_op: u64,
}

impl<S> Default for Image<S> {
    fn default() -> Image<S> {
        Image {
            slots: BTreeMap::new(),
            fences: BTreeMap::new(),
            revision: 0,
            next_op: 0,
        }
    }
}

/// What the logs say on top of the snapshot. Slots stay encoded until every log is read, so a
/// slot written many times is decoded once.
#[derive(Default)]
pub(crate) struct Overlay {
    slots: HashMap<String, LastWrite>,
}

/// The last write of a slot in the logs: its bytes (`None`: removed), and the log generation
/// and offset it was read at (for error messages).
struct LastWrite(Option<Box<[u8]>>, u64, usize);

impl Overlay {
    fn apply<S>(
        &mut self,
        image: &mut Image<S>,
        entry: Entry<'_>,
        generation: u64,
        offset: usize,
    ) -> Result<(), String> {
        match entry {
            Entry::PutSlot { id, encoded } => {
                self.slots
                    .insert(id, LastWrite(Some(encoded.into()), generation, offset));
            }
            Entry::RemoveSlot(id) => {
                self.slots.insert(id, LastWrite(None, generation, offset));
            }
            Entry::PutFence {
                shard_id,
                machine_id,
                mark,
            } => {
                image.fences.insert((shard_id, machine_id), mark);
            }
            Entry::RemoveFence {
                shard_id,
                machine_id,
            } => {
                image.fences.remove(&(shard_id, machine_id));
            }
            Entry::Counters { revision, next_op } => {
                image.revision = revision;
                image.next_op = next_op;
            }
            Entry::SnapshotEnd { .. } => {
                return Err("a snapshot end marker inside a log".into());
            }
        }
        Ok(())
    }

    /// Applies the final write of each slot to `image`.
    fn merge_into<S: SlotForm>(self, dir: &Path, image: &mut Image<S>) -> Result<(), String> {
        for (id, LastWrite(bytes, generation, offset)) in self.slots {
            match bytes {
                Some(bytes) => {
                    let slot = S::from_encoded(&bytes).map_err(|e| {
                        format!(
                            "log file {}: record at offset {offset}: {e}; {FIX}",
                            layout::file_path(dir, FileKind::Log, generation).display()
                        )
                    })?;
                    image.slots.insert(id, slot);
                }
                None => {
                    image.slots.remove(&id);
                }
            }
        }
        Ok(())
    }
}

impl Image<Slot> {
    pub fn into_snapshot(self) -> Snapshot {
        Snapshot {
            slots: self.slots.into_values().collect(),
            fences: self
                .fences
                .into_iter()
                .map(|((shard_id, machine_id), mark)| FenceRecord {
                    shard_id,
                    machine_id,
                    mark,
                })
                .collect(),
            revision: self.revision,
            next_op: self.next_op,
        }
    }
}

impl Image<Box<[u8]>> {
    /// The encoded image of a whole state (import writes it as the first snapshot).
    pub fn encode(snapshot: &Snapshot) -> Image<Box<[u8]>> {
        let mut image = Image {
            revision: snapshot.revision,
            next_op: snapshot.next_op,
            ..Image::default()
        };
        for slot in &snapshot.slots {
            let mut encoded = Vec::new();
            codec::encode_slot(slot, &mut encoded);
            image
                .slots
                .insert(slot.machine.id.clone(), encoded.into_boxed_slice());
        }
        for f in &snapshot.fences {
            image
                .fences
                .insert((f.shard_id.clone(), f.machine_id.clone()), f.mark);
        }
        image
    }
}

/// How the newest log ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Tail {
    /// At a record boundary.
    Clean,
    /// With a record that was cut short: dropped, it was never acknowledged.
    Torn { offset: u64, reason: String },
}

/// What reading one log found.
#[derive(Clone, Debug)]
pub(crate) struct LogEnd {
    /// Where the last whole record ends: appending resumes here.
    pub valid_len: u64,
    pub file_len: u64,
    pub tail: Tail,
}

/// Why a record could not be read.
enum Bad {
    /// The file ends inside the record (or in zeros): the write never finished.
    Torn(String),
    /// The bytes are wrong where a whole record should be.
    Corrupt(String),
}

/// Locates the record at `pos`: its payload range.
fn locate(bytes: &[u8], pos: usize) -> Result<(usize, usize), Bad> {
    let rest = &bytes[pos..];
    if rest.len() < RECORD_HEADER_LEN {
        return Err(Bad::Torn(format!(
            "only {} bytes of a {RECORD_HEADER_LEN}-byte record header",
            rest.len()
        )));
    }
    let Some(header) = codec::read_record_header(rest) else {
        if rest.iter().all(|b| *b == 0) {
            return Err(Bad::Torn(format!(
                "{} zero bytes where a record should be",
                rest.len()
            )));
        }
        return Err(Bad::Corrupt("record header checksum mismatch".into()));
    };
    if header.len > MAX_RECORD_LEN {
        return Err(Bad::Corrupt(format!(
            "implausible record length {}",
            header.len
        )));
    }
    let start = pos + RECORD_HEADER_LEN;
    let end = start + header.len as usize;
    if end > bytes.len() {
        return Err(Bad::Torn(format!(
            "a record of {} bytes with only {} present",
            header.len,
            bytes.len() - start
        )));
    }
    if crc32fast::hash(&bytes[start..end]) != header.payload_crc {
        if bytes[end..].iter().all(|b| *b == 0) {
            return Err(Bad::Torn(format!(
                "the last record ({} bytes) is only partly written (checksum mismatch)",
                header.len
            )));
        }
        return Err(Bad::Corrupt(
            "record checksum mismatch, with more records after it".into(),
        ));
    }
    Ok((start, end))
}

fn read_whole(path: &Path, kind: FileKind) -> Result<Vec<u8>, String> {
    fs::read(path).map_err(|e| format!("read {} file {}: {e}", kind.noun(), path.display()))
}

const FIX: &str = "restore the state directory from a backup; moving it aside starts the \
                   provider fresh, which re-seeds from the cloud and loses bindings, fence \
                   marks and operation ids";

/// Replays one log into `image` and `overlay`. Only the newest log may end with a torn record.
pub(crate) fn replay_log<S>(
    dir: &Path,
    generation: u64,
    newest: bool,
    image: &mut Image<S>,
    overlay: &mut Overlay,
) -> Result<LogEnd, String> {
    let path = layout::file_path(dir, FileKind::Log, generation);
    let bytes = read_whole(&path, FileKind::Log)?;
    let fail = |what: String| format!("log file {}: {what}; {FIX}", path.display());
    codec::check_header(&bytes, FileKind::Log, generation).map_err(fail)?;
    let mut pos = HEADER_LEN;
    while pos < bytes.len() {
        match locate(&bytes, pos) {
            Ok((start, end)) => {
                decode_record(&bytes[start..end], |entry| {
                    overlay.apply(image, entry, generation, pos)
                })
                .map_err(|e| fail(format!("record at offset {pos}: {e}")))?;
                pos = end;
            }
            Err(Bad::Torn(reason)) if newest => {
                return Ok(LogEnd {
                    valid_len: pos as u64,
                    file_len: bytes.len() as u64,
                    tail: Tail::Torn {
                        offset: pos as u64,
                        reason,
                    },
                });
            }
            Err(Bad::Torn(reason)) => {
                return Err(fail(format!(
                    "ends at offset {pos} with {reason}, but a newer log follows it, so the \
                     file lost acknowledged data"
                )));
            }
            Err(Bad::Corrupt(reason)) => {
                return Err(fail(format!("corrupt record at offset {pos}: {reason}")));
            }
        }
    }
    Ok(LogEnd {
        valid_len: bytes.len() as u64,
        file_len: bytes.len() as u64,
        tail: Tail::Clean,
    })
}

/// One decoded snapshot entry.
enum SnapshotEntry<S> {
    Slot(String, S),
    Fence((String, String), HighWaterMark),
    Counters(i64, u64),
    End(u64, u64),
}

/// A record's offset and its payload range.
type Framed = (usize, usize, usize);

fn decode_snapshot_record<S: SlotForm>(
    bytes: &[u8],
    &(pos, start, end): &Framed,
) -> Result<Vec<SnapshotEntry<S>>, (usize, String)> {
    let mut out = Vec::new();
    decode_record(&bytes[start..end], |entry| {
        out.push(match entry {
            Entry::PutSlot { id, encoded } => SnapshotEntry::Slot(id, S::from_encoded(encoded)?),
            Entry::PutFence {
                shard_id,
                machine_id,
                mark,
            } => SnapshotEntry::Fence((shard_id, machine_id), mark),
            Entry::Counters { revision, next_op } => SnapshotEntry::Counters(revision, next_op),
            Entry::SnapshotEnd { slots, fences } => SnapshotEntry::End(slots, fences),
            Entry::RemoveSlot(_) => return Err("a slot removal inside a snapshot".into()),
            Entry::RemoveFence { .. } => {
                return Err("a fence mark removal inside a snapshot".into());
            }
        });
        Ok(())
    })
    .map_err(|e| (pos, e))?;
    Ok(out)
}

/// Replays one snapshot into an empty `image`; returns the file's length. Snapshots are written
/// whole (temp file, fsync, rename), so anything short of a complete one is corruption.
pub(crate) fn replay_snapshot<S: SlotForm>(
    dir: &Path,
    generation: u64,
    image: &mut Image<S>,
) -> Result<u64, String> {
    let path = layout::file_path(dir, FileKind::Snapshot, generation);
    let bytes = read_whole(&path, FileKind::Snapshot)?;
    let fail = |what: String| format!("snapshot file {}: {what}; {FIX}", path.display());
    codec::check_header(&bytes, FileKind::Snapshot, generation).map_err(fail)?;
    // Check the framing and every checksum before decoding anything.
    let mut records = Vec::new();
    let mut pos = HEADER_LEN;
    while pos < bytes.len() {
        let (start, end) = locate(&bytes, pos).map_err(|bad| match bad {
            Bad::Torn(reason) | Bad::Corrupt(reason) => fail(format!(
                "corrupt or truncated record at offset {pos}: {reason}"
            )),
        })?;
        records.push((pos, start, end));
        pos = end;
    }
    let mut slots = Vec::new();
    let mut end_marker = None;
    for record in &records {
        let pos = record.0;
        let entries = decode_snapshot_record::<S>(&bytes, record)
            .map_err(|(pos, e)| fail(format!("record at offset {pos}: {e}")))?;
        for entry in entries {
            if end_marker.is_some() {
                return Err(fail(format!("data after the end marker at offset {pos}")));
            }
            match entry {
                SnapshotEntry::Slot(id, slot) => slots.push((id, slot)),
                SnapshotEntry::Fence(key, mark) => {
                    image.fences.insert(key, mark);
                }
                SnapshotEntry::Counters(revision, next_op) => {
                    image.revision = revision;
                    image.next_op = next_op;
                }
                SnapshotEntry::End(slots, fences) => end_marker = Some((slots, fences)),
            }
        }
    }
    let written = slots.len();
    // Written in id order, so this builds the map in one pass.
    image.slots = slots.into_iter().collect();
    match end_marker {
        None => Err(fail("truncated: the end marker is missing".into())),
        Some((slots, fences))
            if slots != written as u64
                || slots != image.slots.len() as u64
                || fences != image.fences.len() as u64 =>
        {
            Err(fail(format!(
                "the end marker counts {slots} slots and {fences} fence marks, but the file \
                 holds {} and {}",
                image.slots.len(),
                image.fences.len()
            )))
        }
        Some(_) => Ok(bytes.len() as u64),
    }
}

/// Which files make up the state.
#[derive(Debug)]
pub(crate) struct Plan {
    /// The newest snapshot, if any: the state as of the start of its log generation.
    pub snapshot: Option<u64>,
    /// The logs to replay after it, in order (contiguous generations).
    pub logs: Vec<u64>,
    /// Files of generations the snapshot already covers: left over from a compaction that
    /// was interrupted after writing its snapshot.
    pub obsolete: Vec<PathBuf>,
}

/// Decides which files make up the state, considering only generations below `below` (a
/// compaction into snapshot `below`) or all of them.
pub(crate) fn plan(dir: &Path, listing: &Listing, below: Option<u64>) -> Result<Plan, String> {
    let limit = below.unwrap_or(u64::MAX);
    let snapshot = listing.snapshots.iter().copied().rfind(|g| *g < limit);
    let base = snapshot.unwrap_or(0);
    let logs: Vec<u64> = listing
        .logs
        .iter()
        .copied()
        .filter(|g| *g >= base && *g < limit)
        .collect();
    let missing = |g: u64| {
        format!(
            "state directory {}: {} is missing, but the files around it need it; {FIX}",
            dir.display(),
            layout::file_name(FileKind::Log, g)
        )
    };
    if snapshot.is_none() && listing.logs.first().is_some_and(|g| *g > 0) {
        return Err(format!(
            "state directory {}: {} is missing, but {} continues from it; {FIX}",
            dir.display(),
            layout::file_name(FileKind::Snapshot, listing.logs[0]),
            layout::file_name(FileKind::Log, listing.logs[0]),
        ));
    }
    for (i, g) in logs.iter().enumerate() {
        let expected = base + i as u64;
        if *g != expected {
            return Err(missing(expected));
        }
    }
    match below {
        None if logs.is_empty() => return Err(missing(base)),
        Some(target) if logs.last().is_none_or(|last| *last + 1 != target) => {
            return Err(missing(target.saturating_sub(1)));
        }
        _ => {}
    }
    let obsolete = listing
        .snapshots
        .iter()
        .filter(|g| **g < base)
        .map(|g| layout::file_path(dir, FileKind::Snapshot, *g))
        .chain(
            listing
                .logs
                .iter()
                .filter(|g| **g < base)
                .map(|g| layout::file_path(dir, FileKind::Log, *g)),
        )
        .collect();
    Ok(Plan {
        snapshot,
        logs,
        obsolete,
    })
}

/// A replayed state and where its newest log ends.
#[derive(Debug)]
pub(crate) struct Loaded<S> {
    pub image: Image<S>,
    pub newest_log: u64,
    pub newest_end: LogEnd,
    pub snapshot_len: u64,
    pub plan: Plan,
}

/// Replays the files a plan names. With `tolerate_torn_tail`, the newest log may end with a
/// torn record (reported in `newest_end`); otherwise every log must end cleanly.
pub(crate) fn replay<S: SlotForm>(
    dir: &Path,
    plan: Plan,
    tolerate_torn_tail: bool,
) -> Result<Loaded<S>, String> {
    let mut image = Image::default();
    let snapshot_len = match plan.snapshot {
        Some(g) => replay_snapshot(dir, g, &mut image)?,
        None => 0,
    };
    let mut newest = None;
    let mut overlay = Overlay::default();
    for (i, g) in plan.logs.iter().enumerate() {
        let is_newest = i + 1 == plan.logs.len();
        let tolerate = is_newest && tolerate_torn_tail;
        let end = replay_log(dir, *g, tolerate, &mut image, &mut overlay)?;
        if is_newest {
            newest = Some((*g, end));
        }
    }
    overlay.merge_into(dir, &mut image)?;
    let (newest_log, newest_end) = newest
        .ok_or_else(|| format!("state directory {}: no log to replay; {FIX}", dir.display()))?;
    Ok(Loaded {
        image,
        newest_log,
        newest_end,
        snapshot_len,
        plan,
    })
}

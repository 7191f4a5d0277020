//! Tests of the durable store: round trips, group commit, torn tails, every startup error,
//! compaction under load, import of both reference layouts, export, and `kill -9` of a child
//! process mid-mutation.

use std::collections::BTreeMap;
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::codec::{self, FileKind, HEADER_LEN};
use super::layout;
use super::writer::{self, Tuning};
use super::{DurableStore, export_json};
use crate::persistence::store::Store;
use crate::persistence::test_support::{self, counters, fence, mark_of};
use crate::rules::fence::HighWaterMark;
use crate::rules::lifecycle::OperationKind;
use crate::rules::machine::{CapacityType, HostRef, Machine, MachineState, StringMap};
use crate::rules::records::{Change, FenceRecord, SealedConfigure, Slot, Snapshot};

// --- helpers ------------------------------------------------------------------------------

/// The state a sequence of batches should produce, computed independently of the store.
#[derive(Default)]
struct Model {
    slots: BTreeMap<String, Slot>,
    fences: BTreeMap<(String, String), HighWaterMark>,
    revision: i64,
    next_op: u64,
}

impl Model {
    fn apply(&mut self, batch: &[Change]) {
        for change in batch {
            match change {
                Change::PutSlot(slot) => {
                    self.slots.insert(slot.machine.id.clone(), slot.clone());
                }
                Change::RemoveSlot(id) => {
                    self.slots.remove(id);
                }
                Change::PutFence {
                    shard_id,
                    machine_id,
                    mark,
                } => {
                    self.fences
                        .insert((shard_id.clone(), machine_id.clone()), *mark);
                }
                Change::RemoveFence {
                    shard_id,
                    machine_id,
                } => {
                    self.fences.remove(&(shard_id.clone(), machine_id.clone()));
                }
                Change::Counters { revision, next_op } => {
                    self.revision = *revision;
                    self.next_op = *next_op;
                }
            }
        }
    }

    fn snapshot(&self) -> Snapshot {
        Snapshot {
            slots: self.slots.values().cloned().collect(),
            fences: self
                .fences
                .iter()
                .map(|((s, m), mark)| FenceRecord {
                    shard_id: s.clone(),
                    machine_id: m.clone(),
                    mark: *mark,
                })
                .collect(),
            revision: self.revision,
            next_op: self.next_op,
        }
    }
}

fn map(pairs: &[(&str, &str)]) -> StringMap {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn slot(id: &str, last_change: i64) -> Slot {
    let mut machine = Machine::speculative(id, "cx22");
    machine.zone = "fsn1".into();
    Slot {
        machine: Arc::new(machine),
        last_change,
        operations: Default::default(),
        sealed: None,
        enrollment: None,
        retired: None,
    }
}

/// A slot with every field set to something unusual.
fn rich_slot(id: &str) -> Slot {
    Slot {
        machine: Arc::new(Machine {
            id: id.into(),
            state: MachineState::Configured,
            host: Some(HostRef {
                provider: "hetzner".into(),
                id: "4711".into(),
            }),
            instance_type: "cpx31".into(),
            zone: "nbg1".into(),
            capacity_type: CapacityType::Spot,
            price_per_hour: 0.00648,
            interruption_probability: 1e-7,
            resources: map(&[("cpu", "4"), ("memory", "8Gi")]),
            allocatable: map(&[("cpu", "3900m")]),
            labels: map(&[("team", "a<b>&c"), ("ünïcødé", "☃")]),
            last_error: "quoted \"error\"\nwith a newline".into(),
            cluster: "cluster-a".into(),
            shard_metadata: map(&[("bigfleet.io/pool", "general"), ("", "")]),
            wire: Default::default(),
        }),
        last_change: i64::MAX,
        operations: [
            Some("op-1".into()),
            Some("op-2".into()),
            None,
            Some(String::new()),
        ],
        sealed: Some(Arc::new(SealedConfigure {
            deadline_unix_ms: u64::MAX,
            sealed: vec![1, 0, 255, 7],
        })),
        enrollment: None,
        retired: None,
    }
}

fn open(dir: &Path) -> DurableStore {
    DurableStore::open(dir).unwrap_or_else(|e| panic!("open {}: {e}", dir.display()))
}

fn open_tuned(dir: &Path, compact_min_bytes: u64) -> DurableStore {
    let tuning = Tuning {
        compact_min_bytes,
        ..Tuning::default()
    };
    DurableStore::open_with(dir, tuning).unwrap_or_else(|e| panic!("open {}: {e}", dir.display()))
}

/// Opens, loads and closes.
fn reload(dir: &Path) -> Snapshot {
    let store = open(dir);
    store.load().expect("load")
}

fn runtime() -> tokio::runtime::Runtime {
    crate::runtime::engine::test_support::runtime(4)
}

/// Submits each batch and waits for it; returns the model of what was committed.
fn commit_all(store: &DurableStore, batches: &[Vec<Change>]) -> Model {
    let rt = runtime();
    let mut model = Model::default();
    for batch in batches {
        model.apply(batch);
        rt.block_on(store.submit(batch.clone()).wait())
            .expect("commit");
    }
    model
}

fn state_dir() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("state.json");
    (tmp, dir)
}

fn log_path(dir: &Path, generation: u64) -> PathBuf {
    layout::file_path(dir, FileKind::Log, generation)
}

fn append(path: &Path, bytes: &[u8]) {
    let mut f = OpenOptions::new().append(true).open(path).expect("open");
    f.write_all(bytes).expect("append");
}

fn framed(batch: &[Change]) -> Vec<u8> {
    let mut out = Vec::new();
    codec::encode_batch(batch, &mut out);
    out
}

fn simple_batches(n: usize) -> Vec<Vec<Change>> {
    (0..n)
        .map(|i| {
            vec![
                Change::PutSlot(slot(&format!("m-{}", i % 7), i as i64)),
                fence("shard-a", &format!("m-{}", i % 7), 1, i as i64),
                counters(i as i64, i as u64 + 1),
            ]
        })
        .collect()
}

fn err_of(result: Result<DurableStore, String>) -> String {
    match result {
        Ok(_) => panic!("open succeeded where it must fail"),
        Err(e) => e,
    }
}

// --- round trips and group commit ---------------------------------------------------------

#[test]
fn fresh_directory_is_created_and_empty() {
    let (_tmp, dir) = state_dir();
    let store = open(&dir);
    assert!(store.load().expect("load").is_fresh());
    assert!(store.is_durable());
    drop(store);
    assert!(dir.is_dir());
    assert!(log_path(&dir, 0).is_file());
    assert!(reload(&dir).is_fresh());
}

#[test]
fn every_change_kind_round_trips() {
    let (_tmp, dir) = state_dir();
    let store = open(&dir);
    store.load().expect("load");
    let batches = vec![
        vec![
            Change::PutSlot(rich_slot("a")),
            Change::PutSlot(slot("b", 2)),
            Change::PutSlot(slot("c", 3)),
            counters(3, 1),
        ],
        vec![
            fence("shard-a", "a", 3, 7),
            fence("shard-b", "a", i64::MIN, i64::MAX),
            fence("", "b", -1, 0),
        ],
        vec![Change::RemoveSlot("c".into()), counters(4, 9)],
        vec![Change::RemoveSlot("never-existed".into())],
        vec![fence("shard-a", "a", 4, 0), counters(i64::MIN, u64::MAX)],
        vec![],
    ];
    let model = commit_all(&store, &batches);
    // A second load of a running store reads back what is durable.
    assert_eq!(store.load().expect("second load"), model.snapshot());
    drop(store);
    let loaded = reload(&dir);
    assert_eq!(loaded, model.snapshot());
    assert_eq!(loaded.slots[0], rich_slot("a"));
    assert_eq!(loaded.fences.len(), 3);
    // And again, after the reopen appended nothing.
    assert_eq!(reload(&dir), model.snapshot());
}

#[test]
fn slot_encoding_keeps_exact_float_bits() {
    for value in [f64::NAN, f64::INFINITY, -0.0, f64::MIN_POSITIVE, 0.1 + 0.2] {
        let mut s = rich_slot("x");
        Arc::make_mut(&mut s.machine).price_per_hour = value;
        let mut out = Vec::new();
        codec::encode_slot(&s, &mut out);
        let back = codec::decode_slot(&out).expect("decode");
        assert_eq!(back.machine.price_per_hour.to_bits(), value.to_bits());
        assert_eq!(codec::slot_id(&out).expect("id"), "x");
    }
}

/// The enrollment trailer's last byte as the release before confirmation wrote it (0, or 1
/// for a conflict) reads as before, unconfirmed; the confirmed flag round-trips beside the
/// conflict flag; an unknown flag is refused.
#[test]
fn enrollment_flags_of_the_earlier_release_read_unchanged_and_confirmation_round_trips() {
    let mut s = rich_slot("f");
    s.sealed = None;
    let mut base = Vec::new();
    codec::encode_slot(&s, &mut base);
    // host "4711", create "op-1", a 2-byte digest, then the flags byte.
    let trailer = |flags: u8| {
        let mut out = base.clone();
        out.push(2);
        for part in [&b"4711"[..], &b"op-1"[..], &[7u8, 7][..]] {
            out.extend_from_slice(&(part.len() as u32).to_le_bytes());
            out.extend_from_slice(part);
        }
        out.push(flags);
        out
    };
    for (flags, conflict, confirmed) in [
        (0, false, false),
        (1, true, false),
        (2, false, true),
        (3, true, true),
    ] {
        let decoded = codec::decode_slot(&trailer(flags)).expect("decode");
        let e = decoded.enrollment.clone().expect("enrollment");
        assert_eq!((e.conflict, e.confirmed), (conflict, confirmed), "{flags}");
        assert_eq!(e.credential_digest, vec![7, 7]);
        let mut again = Vec::new();
        codec::encode_slot(&decoded, &mut again);
        assert_eq!(again, trailer(flags), "{flags}");
    }
    assert!(
        codec::decode_slot(&trailer(4))
            .unwrap_err()
            .contains("bad enrollment flags 4")
    );
}

#[test]
fn the_enrollment_trailer_round_trips_alone_and_after_the_sealed_one_and_old_slots_read_unchanged()
{
    let enrollment = Arc::new(crate::rules::records::Enrollment {
        host_id: "4711".into(),
        create_operation: "op-1".into(),
        credential_digest: vec![9; 32],
        conflict: true,
        confirmed: false,
    });
    let plain = {
        let mut s = rich_slot("p");
        s.sealed = None;
        s
    };
    let mut plain_bytes = Vec::new();
    codec::encode_slot(&plain, &mut plain_bytes);
    for sealed in [true, false] {
        let mut s = rich_slot("e");
        if !sealed {
            s.sealed = None;
        }
        s.enrollment = Some(enrollment.clone());
        let mut out = Vec::new();
        codec::encode_slot(&s, &mut out);
        assert_eq!(codec::decode_slot(&out).expect("decode"), s);
        // Without the trailer, the bytes are those of a slot encoded before it existed.
        s.enrollment = None;
        let mut without = Vec::new();
        codec::encode_slot(&s, &mut without);
        assert!(out.starts_with(&without));
    }
    assert_eq!(codec::decode_slot(&plain_bytes).expect("decode"), plain);
    // Trailers out of order, repeated or unknown are refused.
    let mut twice = plain_bytes.clone();
    for _ in 0..2 {
        twice.push(2);
        twice.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    }
    assert!(codec::decode_slot(&twice).is_err());
}

#[test]
fn concurrent_mutations_share_fsyncs_and_all_commit() {
    let (_tmp, dir) = state_dir();
    let store = Arc::new(open(&dir));
    store.load().expect("load");
    let tasks = 64;
    let per_task = 40;
    let model = commit_concurrently(&store, tasks, per_task, |t, k| {
        vec![
            Change::PutSlot(slot(&format!("t{t}-{}", k % 3), k)),
            fence(&format!("shard-{}", t % 4), "shared", t, k),
            counters(t * 1000 + k, (t * 1000 + k) as u64),
        ]
    });
    let commits = (tasks * per_task) as u64;
    let groups = store.groups_committed();
    assert!(
        groups < commits / 2,
        "{commits} commits took {groups} fsyncs: no group commit"
    );
    let expected = model.snapshot();
    drop(store);
    assert_eq!(reload(&dir), expected);
}

/// Runs `tasks` tasks that each commit `batch(task, k)` for k below `per_task`, waiting for
/// each commit, and returns the model of what they submitted, applied in submission order.
fn commit_concurrently(
    store: &Arc<DurableStore>,
    tasks: i64,
    per_task: i64,
    batch: fn(i64, i64) -> Vec<Change>,
) -> Model {
    let model = Arc::new(Mutex::new(Model::default()));
    runtime().block_on(async {
        let mut handles = Vec::new();
        for t in 0..tasks {
            let store = store.clone();
            let model = model.clone();
            handles.push(tokio::spawn(async move {
                for k in 0..per_task {
                    let batch = batch(t, k);
                    // Submission order is durable order: record the model in the same order,
                    // as the engine does under its write lock.
                    let commit = {
                        let mut model = model.lock().expect("model");
                        model.apply(&batch);
                        store.submit(batch)
                    };
                    commit.wait().await.expect("commit");
                }
            }));
        }
        for h in handles {
            h.await.expect("task");
        }
    });
    Arc::try_unwrap(model)
        .ok()
        .expect("the tasks ended")
        .into_inner()
        .expect("model")
}

#[test]
fn flush_waits_for_everything_before_it() {
    let (_tmp, dir) = state_dir();
    let store = open(&dir);
    store.load().expect("load");
    let batches = simple_batches(20);
    let mut model = Model::default();
    let commits: Vec<_> = batches
        .iter()
        .map(|b| {
            model.apply(b);
            store.submit(b.clone())
        })
        .collect();
    let rt = runtime();
    rt.block_on(store.flush().wait()).expect("flush");
    assert_eq!(store.load().expect("read back"), model.snapshot());
    for c in commits {
        rt.block_on(c.wait()).expect("commit");
    }
}

// --- torn tails and startup errors --------------------------------------------------------

#[test]
fn torn_final_records_are_dropped_and_truncated() {
    let full = framed(&[Change::PutSlot(rich_slot("torn")), counters(99, 99)]);
    let mut bad_crc = full.clone();
    let last = bad_crc.len() - 1;
    bad_crc[last] ^= 0xff;
    let tails: Vec<(&str, Vec<u8>)> = vec![
        ("partial header", full[..5].to_vec()),
        ("header only", full[..codec::RECORD_HEADER_LEN].to_vec()),
        ("half a payload", full[..full.len() / 2].to_vec()),
        ("all but one byte", full[..full.len() - 1].to_vec()),
        ("final record checksum", bad_crc),
        ("zero-filled", vec![0u8; 300]),
    ];
    for (what, tail) in tails {
        let (_tmp, dir) = state_dir();
        let store = open(&dir);
        store.load().expect("load");
        let mut model = commit_all(&store, &simple_batches(5));
        drop(store);
        let log = log_path(&dir, 0);
        let good_len = fs::metadata(&log).expect("stat").len();
        append(&log, &tail);

        let store = open(&dir);
        assert_eq!(store.load().expect("load"), model.snapshot(), "{what}");
        assert_eq!(
            fs::metadata(&log).expect("stat").len(),
            good_len,
            "{what}: torn tail not truncated"
        );
        // Appending after the truncation works and survives a reopen.
        let more = vec![vec![Change::PutSlot(slot("after", 1)), counters(100, 100)]];
        let rt = runtime();
        for b in &more {
            model.apply(b);
            rt.block_on(store.submit(b.clone()).wait()).expect("commit");
        }
        drop(store);
        assert_eq!(reload(&dir), model.snapshot(), "{what}: after append");
    }
}

#[test]
fn corrupt_record_in_the_middle_is_an_error_naming_the_file() {
    let (_tmp, dir) = state_dir();
    let store = open(&dir);
    store.load().expect("load");
    commit_all(&store, &simple_batches(3));
    drop(store);
    let log = log_path(&dir, 0);
    let mut bytes = fs::read(&log).expect("read");

    // A flipped payload byte in the first record.
    let payload_byte = HEADER_LEN + codec::RECORD_HEADER_LEN + 3;
    bytes[payload_byte] ^= 0x01;
    fs::write(&log, &bytes).expect("write");
    let e = err_of(DurableStore::open(&dir));
    assert!(e.contains(&log.display().to_string()), "{e}");
    assert!(
        e.contains(&format!("corrupt record at offset {HEADER_LEN}")),
        "{e}"
    );
    assert!(e.contains("checksum mismatch"), "{e}");
    bytes[payload_byte] ^= 0x01;

    // A flipped length byte in the first record's header.
    bytes[HEADER_LEN] ^= 0x40;
    fs::write(&log, &bytes).expect("write");
    let e = err_of(DurableStore::open(&dir));
    assert!(e.contains(&log.display().to_string()), "{e}");
    assert!(e.contains("record header checksum mismatch"), "{e}");
    // The file was left alone: nothing truncated.
    assert_eq!(fs::read(&log).expect("read"), bytes);
}

#[test]
fn zero_length_files_are_errors() {
    // The operator's --state is an empty file.
    let (_tmp, dir) = state_dir();
    fs::write(&dir, b"").expect("write");
    let e = err_of(DurableStore::open(&dir));
    assert!(e.contains(&dir.display().to_string()), "{e}");
    assert!(e.contains("zero length"), "{e}");
    assert!(dir.is_file(), "the empty file must be left alone");

    // A zero-length log inside a state directory.
    let (_tmp, dir) = state_dir();
    drop(open(&dir));
    fs::write(log_path(&dir, 0), b"").expect("truncate");
    let e = err_of(DurableStore::open(&dir));
    assert!(e.contains(&log_path(&dir, 0).display().to_string()), "{e}");
    assert!(e.contains("zero length"), "{e}");
}

#[test]
fn a_truncated_header_or_foreign_file_is_an_error() {
    let (_tmp, dir) = state_dir();
    drop(open(&dir));
    let log = log_path(&dir, 0);
    let header = fs::read(&log).expect("read");
    fs::write(&log, &header[..20]).expect("write");
    let e = err_of(DurableStore::open(&dir));
    assert!(e.contains("truncated inside its header"), "{e}");
    fs::write(&log, b"{\"machines\": []}").expect("write");
    let e = err_of(DurableStore::open(&dir));
    assert!(e.contains("not a BigFleet provider state file"), "{e}");
}

#[test]
fn a_newer_format_version_is_an_error() {
    let (_tmp, dir) = state_dir();
    let store = open(&dir);
    commit_all(&store, &simple_batches(2));
    drop(store);
    let log = log_path(&dir, 0);
    let mut bytes = fs::read(&log).expect("read");
    bytes[8..12].copy_from_slice(&(codec::FORMAT_VERSION + 1).to_le_bytes());
    fs::write(&log, &bytes).expect("write");
    let e = err_of(DurableStore::open(&dir));
    assert!(e.contains(&log.display().to_string()), "{e}");
    assert!(
        e.contains(&format!("format version {}", codec::FORMAT_VERSION + 1)),
        "{e}"
    );
}

#[test]
fn unreadable_state_is_an_error() {
    // A directory where the log file should be.
    let (_tmp, dir) = state_dir();
    fs::create_dir_all(log_path(&dir, 0)).expect("mkdir");
    let e = err_of(DurableStore::open(&dir));
    assert!(e.contains(&log_path(&dir, 0).display().to_string()), "{e}");
    assert!(e.contains("read log file"), "{e}");

    // A --state whose parent is a regular file.
    let tmp = tempfile::tempdir().expect("tempdir");
    let parent = tmp.path().join("not-a-dir");
    fs::write(&parent, b"x").expect("write");
    let e = err_of(DurableStore::open(&parent.join("state.json")));
    assert!(e.contains("not-a-dir"), "{e}");

    // A --state file that is not JSON.
    let (_tmp, dir) = state_dir();
    fs::write(&dir, b"\x00\x01garbage").expect("write");
    let e = err_of(DurableStore::open(&dir));
    assert!(e.contains(&dir.display().to_string()), "{e}");
    assert!(e.contains("decode state file"), "{e}");
}

#[test]
fn missing_generations_are_errors() {
    // Logs 0 and 2 without 1: a gap.
    let (_tmp, dir) = state_dir();
    drop(open(&dir));
    let log2 = log_path(&dir, 2);
    fs::write(&log2, codec::encode_header(FileKind::Log, 2)).expect("write");
    let e = err_of(DurableStore::open(&dir));
    assert!(e.contains("log-00000000000000000001 is missing"), "{e}");

    // A log that continues a snapshot that is gone.
    fs::remove_file(log_path(&dir, 0)).expect("rm");
    let e = err_of(DurableStore::open(&dir));
    assert!(
        e.contains("snapshot-00000000000000000002 is missing"),
        "{e}"
    );

    // A header whose generation does not match the file name.
    let (_tmp, dir) = state_dir();
    drop(open(&dir));
    fs::write(log_path(&dir, 0), codec::encode_header(FileKind::Log, 7)).expect("write");
    let e = err_of(DurableStore::open(&dir));
    assert!(e.contains("generation 7"), "{e}");
}

#[test]
fn a_second_process_is_locked_out() {
    let (_tmp, dir) = state_dir();
    let first = open(&dir);
    let e = err_of(DurableStore::open(&dir));
    assert!(e.contains("in use by another provider process"), "{e}");
    assert!(e.contains(&std::process::id().to_string()), "{e}");
    drop(first);
    drop(open(&dir));
}

// --- compaction ---------------------------------------------------------------------------

#[test]
fn compaction_under_concurrent_writes_keeps_every_commit() {
    let (_tmp, dir) = state_dir();
    let store = Arc::new(open_tuned(&dir, 16 << 10));
    store.load().expect("load");
    let model = commit_concurrently(&store, 16, 150, |t, k| {
        let mut batch = vec![
            Change::PutSlot(if k % 10 == 0 {
                rich_slot(&format!("t{t}-{}", k % 13))
            } else {
                slot(&format!("t{t}-{}", k % 13), k)
            }),
            fence("shard", &format!("t{t}"), 1, k),
            counters(t * 1000 + k, k as u64),
        ];
        if k % 7 == 0 {
            batch.push(Change::RemoveSlot(format!("t{t}-{}", (k + 5) % 13)));
        }
        batch
    });
    let expected = model.snapshot();
    drop(store);
    let listing = layout::list(&dir).expect("list");
    assert!(
        !listing.snapshots.is_empty() && listing.logs[0] > 0,
        "no compaction happened: {listing:?}"
    );
    assert!(
        listing.logs.len() <= 2 && listing.snapshots.len() == 1,
        "compaction left old files: {listing:?}"
    );
    assert!(listing.temps.is_empty(), "{listing:?}");
    assert_eq!(reload(&dir), expected);
}

#[test]
fn every_step_of_an_interrupted_compaction_loads_the_same_state() {
    let (_tmp, dir) = state_dir();
    let store = open(&dir);
    store.load().expect("load");
    let mut model = commit_all(&store, &simple_batches(10));
    drop(store);

    // Crash after rotating to log 1 and before the snapshot: two logs, no snapshot.
    let batch = vec![Change::PutSlot(rich_slot("in-log-1")), counters(50, 50)];
    model.apply(&batch);
    let mut log1 = codec::encode_header(FileKind::Log, 1).to_vec();
    log1.extend_from_slice(&framed(&batch));
    fs::write(log_path(&dir, 1), &log1).expect("write");
    // And a half-written snapshot temp file.
    fs::write(dir.join("snapshot-00000000000000000001.tmp"), b"partial").expect("write");
    let saved_log0 = fs::read(log_path(&dir, 0)).expect("read");
    assert_eq!(reload(&dir), model.snapshot());

    // That open compacted into snapshot 1 and removed log 0 and the temp file.
    let listing = layout::list(&dir).expect("list");
    assert_eq!(listing.snapshots, vec![1]);
    assert_eq!(listing.logs, vec![1]);
    assert!(listing.temps.is_empty());

    // Crash after the snapshot rename and before the old files were removed.
    fs::write(log_path(&dir, 0), &saved_log0).expect("restore log 0");
    assert_eq!(reload(&dir), model.snapshot());
    assert_eq!(layout::list(&dir).expect("list").logs, vec![1]);
}

#[test]
fn corrupt_snapshot_is_an_error() {
    let (_tmp, dir) = state_dir();
    let store = open(&dir);
    commit_all(&store, &simple_batches(10));
    drop(store);
    // Fold log 0 into snapshot 1 by hand.
    fs::write(log_path(&dir, 1), codec::encode_header(FileKind::Log, 1)).expect("write");
    writer::compact(&dir, 1).expect("compact");
    let snap = layout::file_path(&dir, FileKind::Snapshot, 1);
    let bytes = fs::read(&snap).expect("read");

    // Truncated: the end marker is gone.
    fs::write(&snap, &bytes[..bytes.len() - 10]).expect("write");
    let e = err_of(DurableStore::open(&dir));
    assert!(e.contains(&snap.display().to_string()), "{e}");
    assert!(e.contains("snapshot file"), "{e}");

    // Cut at a record boundary: the end marker is missing.
    let mut pos = HEADER_LEN;
    let mut boundaries = Vec::new();
    while pos < bytes.len() {
        boundaries.push(pos);
        let len = u32::from_le_bytes(bytes[pos..pos + 4].try_into().expect("4 bytes"));
        pos += codec::RECORD_HEADER_LEN + len as usize;
    }
    let last_record = *boundaries.last().expect("records");
    fs::write(&snap, &bytes[..last_record]).expect("write");
    let e = err_of(DurableStore::open(&dir));
    assert!(e.contains("end marker is missing"), "{e}");

    // Intact again: loads.
    fs::write(&snap, &bytes).expect("write");
    drop(open(&dir));
}

// --- import of the reference provider's JSON file -----------------------------------------

/// A reference state file in the current layout, written the way Go's encoder writes it
/// (contract.md §11): Go field names in struct order, every key present, `Host` always an
/// object, nil maps as `null`, `<>&` escaped, shortest floats, no trailing newline.
const REFERENCE_CURRENT: &str = r#"{
  "machines": [
    {
      "ID": "hetzner/OnDemand/cx22/fsn1/000",
      "State": "Configured",
      "Host": {
        "Provider": "hetzner",
        "Ref": "4711"
      },
      "InstanceType": "cx22",
      "Zone": "fsn1",
      "CapacityType": "OnDemand",
      "PricePerHour": 0.00648,
      "InterruptionProbability": 0,
      "Resources": {
        "cpu": "2",
        "memory": "4Gi"
      },
      "Allocatable": null,
      "Labels": {
        "team": "a\u003cb\u003e\u0026c"
      },
      "Cluster": "cluster-a",
      "ShardMetadata": {
        "bigfleet.io/pool": "general"
      },
      "LastError": ""
    },
    {
      "ID": "hetzner/Spot/cpx31/nbg1/001",
      "State": "Creating",
      "Host": {
        "Provider": "",
        "Ref": ""
      },
      "InstanceType": "cpx31",
      "Zone": "nbg1",
      "CapacityType": "Spot",
      "PricePerHour": 0.0104,
      "InterruptionProbability": 1e-7,
      "Resources": null,
      "Allocatable": null,
      "Labels": null,
      "Cluster": "",
      "ShardMetadata": null,
      "LastError": ""
    },
    {
      "ID": "hetzner/OnDemand/cx22/fsn1/002",
      "State": "Failed",
      "Host": {
        "Provider": "hetzner",
        "Ref": "4712"
      },
      "InstanceType": "cx22",
      "Zone": "fsn1",
      "CapacityType": "OnDemand",
      "PricePerHour": 0.00648,
      "InterruptionProbability": 0,
      "Resources": null,
      "Allocatable": null,
      "Labels": null,
      "Cluster": "",
      "ShardMetadata": null,
      "LastError": "drain transition timed out after 15m0s: context deadline exceeded"
    }
  ],
  "fences": [
    {
      "shard_id": "shard-a",
      "machine_id": "hetzner/OnDemand/cx22/fsn1/000",
      "epoch": 3,
      "sequence": 7
    },
    {
      "shard_id": "shard-b",
      "machine_id": "hetzner/Spot/cpx31/nbg1/001",
      "epoch": 1,
      "sequence": 2
    }
  ],
  "ops": [
    {
      "machine_id": "hetzner/OnDemand/cx22/fsn1/000",
      "kind": "configure",
      "operation_id": "op-7"
    },
    {
      "machine_id": "hetzner/OnDemand/cx22/fsn1/000",
      "kind": "create",
      "operation_id": "op-3"
    },
    {
      "machine_id": "hetzner/Spot/cpx31/nbg1/001",
      "kind": "create",
      "operation_id": "op-9"
    },
    {
      "machine_id": "hetzner/OnDemand/cx22/fsn1/002",
      "kind": "drain",
      "operation_id": "op-8"
    }
  ],
  "rev": 42,
  "next_op": 9
}"#;

/// The pre-ADR-0058 layout: `fences` is an object of shard-wide marks keyed by shard id. Also
/// exercises the decoder's leniency: keys in other cases, unknown keys, missing keys.
const REFERENCE_OLD: &str = r#"{"Machines":[
 {"id":"do/OnDemand/s-2vcpu-4gb/fra1/000","state":"Idle","HOST":{"provider":"digitalocean","ref":"123456"},
  "instancetype":"s-2vcpu-4gb","zone":"fra1","capacitytype":"OnDemand","PricePerHour":0.03571,
  "Labels":{"a":"b"},"SomethingNew":{"nested":[1,2,3]}},
 {"ID":"do/OnDemand/s-2vcpu-4gb/fra1/001","State":"Speculative","Host":null,
  "InstanceType":"s-2vcpu-4gb","Zone":"fra1","CapacityType":"OnDemand"}],
 "fences":{"shard-a":{"Epoch":3,"Sequence":7},"shard-b":{"epoch":1,"sequence":2}},
 "ops":[{"Machine_ID":"do/OnDemand/s-2vcpu-4gb/fra1/000","KIND":"create","operation_id":"op-4"}],
 "rev":17,"next_op":4,"future_key":true}"#;

fn machine_of<'a>(snapshot: &'a Snapshot, id: &str) -> &'a Slot {
    snapshot
        .slots
        .iter()
        .find(|s| s.machine.id == id)
        .unwrap_or_else(|| panic!("no machine {id}"))
}

#[test]
fn imports_the_current_reference_layout() {
    let (tmp, dir) = state_dir();
    fs::write(&dir, REFERENCE_CURRENT).expect("write");
    let store = open(&dir);
    let s = store.load().expect("load");
    drop(store);

    assert!(
        dir.is_dir(),
        "the state is now a directory at the same path"
    );
    let kept = tmp.path().join("state.json.reference-import.json");
    assert_eq!(fs::read_to_string(&kept).expect("kept"), REFERENCE_CURRENT);

    assert_eq!(s.slots.len(), 3);
    assert_eq!(s.revision, 42);
    // The reference's next_op is the last number issued; ours is the next one.
    assert_eq!(s.next_op, 10);
    let a = machine_of(&s, "hetzner/OnDemand/cx22/fsn1/000");
    let m = &*a.machine;
    assert_eq!(m.state, MachineState::Configured);
    assert_eq!(
        m.host,
        Some(HostRef {
            provider: "hetzner".into(),
            id: "4711".into()
        })
    );
    assert_eq!(
        (m.instance_type.as_str(), m.zone.as_str()),
        ("cx22", "fsn1")
    );
    assert_eq!(m.capacity_type, CapacityType::OnDemand);
    assert_eq!(m.price_per_hour, 0.00648);
    assert_eq!(m.resources, map(&[("cpu", "2"), ("memory", "4Gi")]));
    assert!(m.allocatable.is_empty());
    assert_eq!(m.labels, map(&[("team", "a<b>&c")]));
    assert_eq!(m.cluster, "cluster-a");
    assert_eq!(m.shard_metadata, map(&[("bigfleet.io/pool", "general")]));
    assert_eq!(a.last_change, 42);
    assert_eq!(a.operation(OperationKind::Create), Some("op-3"));
    assert_eq!(a.operation(OperationKind::Configure), Some("op-7"));
    assert_eq!(a.operation(OperationKind::Drain), None);

    let b = machine_of(&s, "hetzner/Spot/cpx31/nbg1/001");
    assert_eq!(b.machine.state, MachineState::Creating);
    assert_eq!(b.machine.host, None);
    assert_eq!(b.machine.capacity_type, CapacityType::Spot);
    assert_eq!(b.machine.interruption_probability, 1e-7);
    assert_eq!(b.operation(OperationKind::Create), Some("op-9"));

    let c = machine_of(&s, "hetzner/OnDemand/cx22/fsn1/002");
    assert_eq!(c.machine.state, MachineState::Failed);
    assert!(
        c.machine
            .last_error
            .starts_with("drain transition timed out")
    );
    assert_eq!(c.operation(OperationKind::Drain), Some("op-8"));

    assert_eq!(s.fences.len(), 2);
    assert_eq!(
        mark_of(&s, "shard-a", "hetzner/OnDemand/cx22/fsn1/000"),
        Some(HighWaterMark {
            epoch: 3,
            sequence: 7
        })
    );
    assert_eq!(
        mark_of(&s, "shard-b", "hetzner/Spot/cpx31/nbg1/001"),
        Some(HighWaterMark {
            epoch: 1,
            sequence: 2
        })
    );

    // The next start reads the directory; nothing is imported twice.
    assert_eq!(reload(&dir), s);
    assert!(!tmp.path().join("state.json.importing").exists());
}

#[test]
fn imports_the_old_shard_wide_fence_layout_onto_every_machine() {
    let (_tmp, dir) = state_dir();
    fs::write(&dir, REFERENCE_OLD).expect("write");
    let s = reload(&dir);
    let ids = [
        "do/OnDemand/s-2vcpu-4gb/fra1/000",
        "do/OnDemand/s-2vcpu-4gb/fra1/001",
    ];
    assert_eq!(s.slots.len(), 2);
    assert_eq!(s.fences.len(), 4);
    for id in ids {
        assert_eq!(
            mark_of(&s, "shard-a", id),
            Some(HighWaterMark {
                epoch: 3,
                sequence: 7
            })
        );
        assert_eq!(
            mark_of(&s, "shard-b", id),
            Some(HighWaterMark {
                epoch: 1,
                sequence: 2
            })
        );
    }
    let idle = machine_of(&s, ids[0]);
    assert_eq!(idle.machine.state, MachineState::Idle);
    assert_eq!(
        idle.machine.host,
        Some(HostRef {
            provider: "digitalocean".into(),
            id: "123456".into()
        })
    );
    assert_eq!(idle.machine.instance_type, "s-2vcpu-4gb");
    assert_eq!(idle.machine.price_per_hour, 0.03571);
    assert_eq!(idle.machine.labels, map(&[("a", "b")]));
    assert_eq!(idle.operation(OperationKind::Create), Some("op-4"));
    assert_eq!(s.revision, 17);
    assert_eq!(s.next_op, 5);
    let spec = machine_of(&s, ids[1]);
    assert_eq!(spec.machine.state, MachineState::Speculative);
    assert_eq!(spec.machine.host, None);
}

#[test]
fn import_edge_cases_follow_the_reference() {
    // Unknown names load as Unspecified / create, as in the reference; ids never repeat.
    let json = r#"{"machines":[{"ID":"m","State":"Exploded","CapacityType":"Gold"},{"ID":""}],
        "ops":[{"machine_id":"m","kind":"teleport","operation_id":"op-41"},
               {"machine_id":"ghost","kind":"drain","operation_id":"op-50"}],
        "rev":3,"next_op":2}"#;
    let imported = super::reference::parse(json.as_bytes()).expect("parse");
    let s = &imported.snapshot;
    assert_eq!(s.slots.len(), 1);
    assert_eq!(s.slots[0].machine.state, MachineState::Unspecified);
    assert_eq!(s.slots[0].machine.capacity_type, CapacityType::Unspecified);
    assert_eq!(s.slots[0].operation(OperationKind::Create), Some("op-41"));
    assert_eq!(s.next_op, 51, "above every op id in the file");
    assert_eq!(
        imported.report.warnings.len(),
        5,
        "{:?}",
        imported.report.warnings
    );

    // A reference file that is fresh by the reference's rules imports as a fresh state, so the
    // provider seeds from the cloud as the reference would have.
    let fresh =
        super::reference::parse(br#"{"machines":[],"fences":[],"ops":[],"rev":0,"next_op":0}"#)
            .expect("parse");
    assert!(fresh.snapshot.is_fresh());
    let fresh =
        super::reference::parse(br#"{"machines":null,"fences":{},"ops":[],"rev":0,"next_op":5}"#)
            .expect("parse");
    assert!(fresh.snapshot.is_fresh());

    // Key given twice: the last wins, as in Go.
    let twice =
        super::reference::parse(br#"{"rev":1,"REV":2,"machines":[{"ID":"x","State":"Idle"}]}"#)
            .expect("parse");
    assert_eq!(twice.snapshot.revision, 2);

    // Wrong JSON types are errors, as in Go.
    for bad in [
        r#"{"machines":[{"ID":"m","State":3}]}"#,
        r#"{"fences":"shard-a"}"#,
        r#"{"rev":1.5}"#,
        r#"{"machines":[{"ID":7}]}"#,
        r#"[]"#,
        r#"{"rev":1} trailing"#,
    ] {
        assert!(super::reference::parse(bad.as_bytes()).is_err(), "{bad}");
    }
}

#[test]
fn a_bad_reference_file_fails_startup_and_stays_in_place() {
    let (_tmp, dir) = state_dir();
    let bad = r#"{"machines":[{"ID":"m","State":3}]}"#;
    fs::write(&dir, bad).expect("write");
    let e = err_of(DurableStore::open(&dir));
    assert!(e.contains(&dir.display().to_string()), "{e}");
    assert!(e.contains("reference provider's JSON state"), "{e}");
    assert_eq!(fs::read_to_string(&dir).expect("read"), bad);
}

#[test]
fn an_import_interrupted_between_its_renames_is_finished() {
    let (tmp, dir) = state_dir();
    fs::write(&dir, REFERENCE_CURRENT).expect("write");
    let expected = reload(&dir);
    // Put the directory back where the import builds it: the state of a crash after the
    // reference file was renamed and before the new directory was.
    let staging = tmp.path().join("state.json.importing");
    fs::rename(&dir, &staging).expect("rename");
    assert_eq!(reload(&dir), expected);
    assert!(!staging.exists());
}

#[test]
fn a_second_reference_file_keeps_the_first_import() {
    let (tmp, dir) = state_dir();
    fs::write(&dir, REFERENCE_CURRENT).expect("write");
    drop(open(&dir));
    // The operator moves the state away and starts from another reference file.
    fs::rename(&dir, tmp.path().join("elsewhere")).expect("rename");
    fs::write(&dir, REFERENCE_OLD).expect("write");
    let s = reload(&dir);
    assert_eq!(s.slots.len(), 2);
    assert_eq!(
        fs::read_to_string(tmp.path().join("state.json.reference-import.json")).expect("first"),
        REFERENCE_CURRENT
    );
    assert_eq!(
        fs::read_to_string(tmp.path().join("state.json.reference-import-2.json")).expect("second"),
        REFERENCE_OLD
    );
}

// --- export -------------------------------------------------------------------------------

#[test]
fn export_renders_the_whole_state_while_the_store_runs() {
    let (_tmp, dir) = state_dir();
    let store = open(&dir);
    store.load().expect("load");
    let mut rich = rich_slot("a");
    rich.operations = [Some("op-1".into()), Some("op-2".into()), None, None];
    let batches = vec![vec![
        Change::PutSlot(rich),
        Change::PutSlot(slot("b", 2)),
        fence("shard-a", "a", 3, 7),
        counters(12, 3),
    ]];
    commit_all(&store, &batches);
    let json = export_json(&dir).expect("export");
    drop(store);
    let v: serde_json::Value = serde_json::from_str(&json).expect("json");
    assert_eq!(v["revision"], 12);
    assert_eq!(v["next_op"], 3);
    let a = &v["machines"][0];
    assert_eq!(a["id"], "a");
    assert_eq!(a["state"], "Configured");
    assert_eq!(a["host"]["provider"], "hetzner");
    assert_eq!(a["host"]["id"], "4711");
    assert_eq!(a["instance_type"], "cpx31");
    assert_eq!(a["zone"], "nbg1");
    assert_eq!(a["capacity_type"], "Spot");
    assert_eq!(a["price_per_hour"], 0.00648);
    assert_eq!(a["interruption_probability"], 1e-7);
    assert_eq!(a["resources"]["memory"], "8Gi");
    assert_eq!(a["allocatable"]["cpu"], "3900m");
    assert_eq!(a["labels"]["team"], "a<b>&c");
    assert_eq!(a["last_error"], "quoted \"error\"\nwith a newline");
    assert_eq!(a["cluster"], "cluster-a");
    assert_eq!(a["shard_metadata"]["bigfleet.io/pool"], "general");
    assert_eq!(a["last_change"], i64::MAX);
    assert_eq!(v["machines"][1]["host"], serde_json::Value::Null);
    assert_eq!(
        v["fences"],
        serde_json::json!([{"shard_id": "shard-a", "machine_id": "a", "epoch": 3, "sequence": 7}])
    );
    assert_eq!(
        v["ops"],
        serde_json::json!([
            {"machine_id": "a", "kind": "create", "operation_id": "op-1"},
            {"machine_id": "a", "kind": "configure", "operation_id": "op-2"},
        ])
    );
    // Exporting wrote nothing and is repeatable.
    assert_eq!(export_json(&dir).expect("again"), json);
}

#[test]
fn export_reads_a_reference_file_without_importing_it() {
    let (_tmp, dir) = state_dir();
    fs::write(&dir, REFERENCE_OLD).expect("write");
    let json = export_json(&dir).expect("export");
    assert!(dir.is_file(), "export must not import");
    let v: serde_json::Value = serde_json::from_str(&json).expect("json");
    assert_eq!(v["machines"].as_array().map(Vec::len), Some(2));
    assert_eq!(v["fences"].as_array().map(Vec::len), Some(4));
    assert!(
        v["source"]
            .as_str()
            .is_some_and(|s| s.contains("not imported yet"))
    );

    let missing = dir.with_file_name("nothing-here");
    let e = export_json(&missing).expect_err("missing");
    assert!(e.contains("no state at"), "{e}");
    fs::write(&missing, b"").expect("write");
    let e = export_json(&missing).expect_err("empty");
    assert!(e.contains("zero length"), "{e}");
}

// --- kill -9 ------------------------------------------------------------------------------

const CHILD_DIR: &str = "BIGFLEET_DURABLE_CRASH_DIR";
const CHILD_ROUND: &str = "BIGFLEET_DURABLE_CRASH_ROUND";
const CHILD_TASKS: i64 = 8;

/// The child side of the crash test: started by [`kill_9_loses_no_acknowledged_mutation`] with
/// the environment set; otherwise there is nothing to do. It mutates until killed and prints
/// every acknowledged mutation.
#[test]
fn crash_test_child() {
    let (Ok(dir), Ok(round)) = (std::env::var(CHILD_DIR), std::env::var(CHILD_ROUND)) else {
        return;
    };
    let round: i64 = round.parse().expect("round");
    // Small compactions, so kills also land while the log rotates and snapshots are written.
    let store = Arc::new(open_tuned(Path::new(&dir), 8 << 10));
    store.load().expect("load");
    runtime().block_on(test_support::commit_until_killed(
        round,
        CHILD_TASKS,
        move |task, n| {
            let commit = store.submit(test_support::batch(round, task, n, slot, None));
            async move { commit.wait().await.expect("commit") }
        },
    ));
}

/// Checks every acknowledged mutation of every round against the reloaded state.
fn check_crash_state(s: &Snapshot, acked: &test_support::Acked) {
    test_support::check_acknowledged(s, acked, |t| {
        // Every acknowledged slot write is there or overwritten by a later one.
        for n in (t.last_acked - 3).max(0)..=t.last_acked {
            let id = test_support::slot_id(t.round, t.task, n);
            let slot = t
                .slots
                .get(id.as_str())
                .unwrap_or_else(|| panic!("{id} lost"));
            assert!(
                slot.last_change >= n
                    && slot.last_change % 4 == n % 4
                    && slot.last_change <= t.newest,
                "{id}: last_change {} after acknowledged {n}",
                slot.last_change
            );
        }
    });
}

#[test]
fn kill_9_loses_no_acknowledged_mutation() {
    let (_tmp, dir) = state_dir();
    let dir_env = dir.to_str().expect("utf-8 state dir");
    let mut acked = test_support::Acked::new();
    let deadline = Instant::now() + Duration::from_secs(12);
    for round in 0..20i64 {
        if Instant::now() > deadline && round >= 5 {
            break;
        }
        // Wait for the first acknowledgement, then kill at a random moment.
        test_support::Round {
            test: "persistence::durable::tests::crash_test_child",
            env: (CHILD_DIR, dir_env),
            round_var: CHILD_ROUND,
            round,
            enough: |lines| lines.iter().any(|l| l.starts_with("ACK ")),
            within: Duration::from_secs(15),
            short: "nothing",
            max_pause: Duration::from_millis(120),
        }
        .kill_child(&mut acked);
        let store = open(&dir);
        let s = store.load().expect("load after kill -9");
        check_crash_state(&s, &acked);
        drop(store);
    }
    assert!(acked.len() >= 5 * CHILD_TASKS as usize);
}

#[test]
fn a_large_snapshot_of_many_records_round_trips() {
    let (_tmp, dir) = state_dir();
    let store = open(&dir);
    let mut batch: Vec<Change> = (0..6000)
        .map(|i| {
            let mut s = rich_slot(&format!("m-{i:05}"));
            s.last_change = i;
            Change::PutSlot(s)
        })
        .collect();
    batch.push(fence("shard-a", "m-00001", 2, 3));
    batch.push(counters(6000, 17));
    let model = commit_all(&store, &[batch]);
    drop(store);
    fs::write(log_path(&dir, 1), codec::encode_header(FileKind::Log, 1)).expect("write");
    writer::compact(&dir, 1).expect("compact");
    let snapshot = fs::metadata(layout::file_path(&dir, FileKind::Snapshot, 1)).expect("stat");
    assert!(
        snapshot.len() > 16 * 64 * 1024,
        "too small to span 16 records"
    );
    assert_eq!(reload(&dir), model.snapshot());
}

// --- the engine over the durable store ----------------------------------------------------

mod engine_restart {
    use std::sync::Arc;
    use std::time::Duration;

    use crate::persistence::durable::DurableStore;
    use crate::persistence::store::SharedStore;
    use crate::rules::error::CoreError;
    use crate::rules::fence::FenceToken;
    use crate::rules::machine::{MachineState, StringMap};
    use crate::runtime::engine::Engine;
    use crate::runtime::engine::test_support::{self, SlotBackend, settle};

    fn token(shard: &str, epoch: i64, sequence: i64) -> FenceToken {
        FenceToken {
            shard_id: shard.into(),
            epoch,
            sequence,
        }
    }

    async fn start(dir: &std::path::Path, held: &[&str]) -> Arc<Engine> {
        let store: SharedStore = Arc::new(DurableStore::open(dir).expect("open"));
        // Three slots; creates of the `held` ids never finish on their own.
        let backend = Arc::new(
            SlotBackend::new(test_support::slots("m", 3, "fsn1"))
                .provider("test")
                .holding(held),
        );
        test_support::start_on(store, backend, "durable_test").await
    }

    #[test]
    fn a_restart_keeps_bindings_fences_and_op_ids_and_resumes_creates() {
        let (_tmp, dir) = super::state_dir();
        let rt = super::runtime();
        rt.block_on(async {
            let engine = start(&dir, &["m-1"]).await;
            let created = engine
                .create("m-0", token("shard-a", 1, 1))
                .await
                .expect("create");
            settle(&engine, "m-0", MachineState::Idle).await;
            let metadata: StringMap = [("pool".to_owned(), "general".to_owned())].into();
            engine
                .configure(
                    "m-0",
                    "cluster-1".into(),
                    b"blob".to_vec(),
                    metadata.clone(),
                    token("shard-a", 1, 2),
                )
                .await
                .expect("configure");
            settle(&engine, "m-0", MachineState::Configured).await;
            let interrupted = engine
                .create("m-1", token("shard-b", 5, 1))
                .await
                .expect("create");
            assert_eq!(
                engine.get("m-1").expect("get").state,
                MachineState::Creating
            );
            // The grace runs out with m-1 still creating: it stays Creating in the store.
            assert_eq!(engine.shutdown(Duration::from_millis(20)).await, 1);
            drop(engine);

            let engine = start(&dir, &[]).await;
            let m0 = engine.get("m-0").expect("get");
            assert_eq!(m0.state, MachineState::Configured);
            assert_eq!(m0.cluster, "cluster-1");
            assert_eq!(m0.shard_metadata, metadata);
            assert_eq!(m0.host.as_ref().map(|h| h.id.as_str()), Some("h-m-0"));
            // The interrupted create is resumed under its original operation id.
            settle(&engine, "m-1", MachineState::Idle).await;
            let retry = engine
                .create("m-1", token("shard-b", 5, 2))
                .await
                .expect("retry");
            assert!(!retry.accepted);
            assert_eq!(retry.operation_id, interrupted.operation_id);
            let again = engine
                .create(
                    "m-0",
                    FenceToken {
                        shard_id: String::new(),
                        epoch: 0,
                        sequence: 0,
                    },
                )
                .await;
            assert!(
                matches!(again, Err(CoreError::InvalidTransition { .. })),
                "{again:?}"
            );
            // The fence marks survived: a replayed token is rejected, a newer one passes.
            let replay = engine.drain("m-0", 0, token("shard-a", 1, 2)).await;
            assert!(
                matches!(replay, Err(CoreError::Fenced { .. })),
                "{replay:?}"
            );
            let drained = engine
                .drain("m-0", 0, token("shard-a", 1, 3))
                .await
                .expect("drain");
            // Operation ids never repeat across the restart.
            let n = |op: &str| {
                op.trim_start_matches("op-")
                    .parse::<u64>()
                    .expect("op number")
            };
            assert!(n(&drained.operation_id) > n(&interrupted.operation_id));
            assert!(n(&interrupted.operation_id) > n(&created.operation_id));
            settle(&engine, "m-0", MachineState::Idle).await;
            engine.shutdown(Duration::from_secs(5)).await;
        });
    }
}

// --- fence removals (bounded marks of unknown ids) -----------------------------------------

fn remove_fence(shard: &str, machine: &str) -> Change {
    Change::RemoveFence {
        shard_id: shard.into(),
        machine_id: machine.into(),
    }
}

#[test]
fn fence_removals_survive_reload_and_compaction() {
    let (_tmp, dir) = state_dir();
    let store = open_tuned(&dir, 2 << 10);
    store.load().expect("load");
    // A sliding window of marks, as the bounded table of unknown ids writes them: each batch
    // adds one mark and removes the one that fell out of the window.
    let batches: Vec<Vec<Change>> = (0..600i64)
        .map(|i| {
            let mut batch = vec![fence("shard", &format!("ghost-{i}"), 1, i)];
            if i >= 10 {
                batch.push(remove_fence("shard", &format!("ghost-{}", i - 10)));
            }
            batch.push(remove_fence("shard", "never-recorded"));
            batch
        })
        .collect();
    let model = commit_all(&store, &batches);
    drop(store);
    let listing = layout::list(&dir).expect("list");
    assert!(
        !listing.snapshots.is_empty(),
        "no compaction happened: {listing:?}"
    );
    let loaded = reload(&dir);
    assert_eq!(loaded, model.snapshot());
    let mut kept: Vec<&str> = loaded
        .fences
        .iter()
        .map(|f| f.machine_id.as_str())
        .collect();
    kept.sort_unstable();
    let mut want: Vec<String> = (590..600).map(|i| format!("ghost-{i}")).collect();
    want.sort_unstable();
    assert_eq!(kept, want);
}

#[test]
fn a_fence_removal_round_trips_through_the_codec() {
    let mut payload = Vec::new();
    codec::encode_batch(&[remove_fence("s", "m")], &mut payload);
    // As a log record it decodes; snapshots never hold removals.
    let framed_len = payload.len();
    assert!(framed_len > codec::RECORD_HEADER_LEN);
    let mut seen = Vec::new();
    codec::decode_record(&payload[codec::RECORD_HEADER_LEN..], |e| {
        seen.push(format!("{e:?}"));
        Ok(())
    })
    .expect("decodes");
    assert_eq!(
        seen,
        vec![r#"RemoveFence { shard_id: "s", machine_id: "m" }"#.to_owned()]
    );
}

#[test]
fn a_sealed_blob_survives_reload_and_is_gone_from_every_file_after_compaction() {
    let (_tmp, dir) = state_dir();
    let store = open_tuned(&dir, 2 << 10);
    store.load().expect("load");
    let marker = b"SEALED-BYTES-THAT-MUST-GO".to_vec();
    let mut configuring = slot("m-sealed", 1);
    crate::rules::machine::edit(&mut configuring.machine).state = MachineState::Configuring;
    configuring.sealed = Some(Arc::new(SealedConfigure {
        deadline_unix_ms: 42,
        sealed: marker.clone(),
    }));
    let model = commit_all(&store, &[vec![Change::PutSlot(configuring.clone())]]);
    drop(store);
    let loaded = reload(&dir);
    assert_eq!(loaded, model.snapshot());
    assert_eq!(
        machine_of(&loaded, "m-sealed").sealed.as_deref(),
        configuring.sealed.as_deref()
    );
    // The Configure ends: the slot is written without it, then enough traffic to compact.
    let store = open_tuned(&dir, 2 << 10);
    store.load().expect("load");
    let mut configured = configuring.clone();
    crate::rules::machine::edit(&mut configured.machine).state = MachineState::Configured;
    configured.sealed = None;
    let mut batches = vec![vec![Change::PutSlot(configured)]];
    batches.extend((0..400i64).map(|i| vec![fence("shard", "m-sealed", 1, i)]));
    let model = commit_all(&store, &batches);
    drop(store);
    assert!(
        !layout::list(&dir).expect("list").snapshots.is_empty(),
        "no compaction happened"
    );
    let loaded = reload(&dir);
    assert_eq!(loaded, model.snapshot());
    assert!(machine_of(&loaded, "m-sealed").sealed.is_none());
    for entry in fs::read_dir(&dir).expect("read dir") {
        let path = entry.expect("entry").path();
        if path.is_file() {
            let bytes = fs::read(&path).expect("read");
            assert!(
                !bytes.windows(marker.len()).any(|w| w == marker.as_slice()),
                "{} still holds the sealed blob",
                path.display()
            );
        }
    }
}

//! The durable store behind `--state PATH`: an append-only log of checksummed batches with
//! group commit, plus snapshots written by background compaction (beyond.md §2; operator view
//! in docs/state.md).
//!
//! # Why a log, not an embedded database
//!
//! The engine already produces exactly what a log wants: one batch of per-record changes per
//! mutation, in order, with the whole state in memory for reads. A log appends that batch
//! (a few hundred bytes, whatever the inventory size), and one fsync covers every batch queued
//! meanwhile. An embedded transactional store (sled, redb, SQLite) would add a B-tree the
//! engine never reads, a second copy of every record, its own page cache and a large
//! dependency, for the same durability. The price of the log is compaction, which here is a
//! merge of immutable files on a background thread, and which keeps the work per mutation
//! constant: the log is folded into a new snapshot once it is as large as the last one.
//!
//! # Layout
//!
//! `PATH` is a directory (created mode 0700 if missing):
//!
//! - `snapshot-<generation>`: the whole state as of the start of `log-<generation>`;
//! - `log-<generation>`: batches appended since; the newest log is the one being written;
//! - `LOCK`: held with `flock` by the one provider process using the directory;
//! - `*.tmp`: a file being written; never part of the state, removed at startup.
//!
//! The state is the newest snapshot (none means empty) plus every log from its generation on.
//! Every file starts with a header: magic, format version, kind, generation, checksum. A log
//! record is `length | crc32(payload) | crc32(length, crc) | payload`; its payload is one batch.
//!
//! # Durability
//!
//! A commit completes only after its group was written and `fdatasync`ed; new files (logs,
//! snapshots) are written under a temporary name, fsynced, renamed and the directory fsynced.
//! A `kill -9` at any instant therefore loses at most batches that were never acknowledged; the
//! newest log may end in a torn record, which is dropped (WARN) and truncated away. Anything
//! else that is wrong (zero length, a truncated or corrupt file, a gap in the generations, a
//! newer format) fails startup with an error naming the file: a state is never silently
//! replaced by a fresh one.
//!
//! # The reference provider's JSON file
//!
//! If `PATH` is a regular file, it is the reference provider's state (contract.md §11). On
//! first start it is imported (see `reference.rs`): the new state is built in `<PATH>.importing`,
//! the file is renamed to `<PATH>.reference-import.json` (kept for the operator), and the
//! directory renamed to `PATH`. A crash between the two renames is finished on the next start.

pub mod codec;
mod export;
mod layout;
mod reference;
mod replay;
mod snapshot;
mod writer;

pub mod bench;

#[cfg(test)]
mod tests;

#[cfg(test)]
mod mode_tests;

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions, TryLockError};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Instant;

use tokio::sync::oneshot;

pub use export::render_json;
// The etcd store keeps machine slots in the same encoding.
pub(crate) use codec::{decode_slot, encode_slot};

/// Writes `name` in `dir` whole or not at all (temp file, fsync, rename, directory fsync), for
/// files kept beside the state that are not part of it.
pub(crate) fn write_file_atomically(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    layout::create_file_atomically(dir, name, |file| file.write_all(bytes)).map(drop)
}

use codec::{FileKind, HEADER_LEN};
use replay::{Image, Tail};
use writer::{Message, Tuning, Writer};

use crate::persistence::store::{Commit, Store, StoreError};
use crate::rules::records::{Change, Slot, Snapshot};

/// The suffix of the directory an import is built in.
const IMPORTING_SUFFIX: &str = ".importing";
/// The suffix the imported reference file is kept under.
const KEPT_SUFFIX: &str = ".reference-import.json";

/// The durable store: an open state directory and its writer thread.
#[derive(Debug)]
pub struct DurableStore {
    dir: PathBuf,
    queue: mpsc::Sender<Message>,
    writer: Mutex<Option<JoinHandle<()>>>,
    /// The state read at open, handed to the engine by the first `load`.
    loaded: Mutex<Option<Snapshot>>,
    groups: Arc<AtomicU64>,
}

impl DurableStore {
    /// Opens (creating, importing or recovering as needed) the state at `path` and starts its
    /// writer. The state is read and checked here, so every error surfaces before the provider
    /// listens.
    pub fn open(path: &Path) -> Result<DurableStore, String> {
        DurableStore::open_with(path, Tuning::default())
    }

    pub(crate) fn open_with(path: &Path, tuning: Tuning) -> Result<DurableStore, String> {
        let started = Instant::now();
        let dir = normalize(path);
        prepare(&dir)?;
        let lock = lock(&dir)?;
        restrict_permissions(&dir);
        let listing = layout::list(&dir)
            .map_err(|e| format!("read state directory {}: {e}", dir.display()))?;
        if let Err(e) = layout::remove_all(&dir, &listing.temps) {
            tracing::warn!(dir = %dir.display(), error = %e, "could not remove leftover temporary state files");
        }
        let groups = Arc::new(AtomicU64::new(0));
        let (snapshot, writer) = if listing.is_empty() {
            let name = layout::file_name(FileKind::Log, 0);
            let log = layout::create_file_atomically(&dir, &name, |f| {
                f.write_all(&codec::encode_header(FileKind::Log, 0))
            })
            .map_err(|e| format!("create {}: {e}", dir.join(&name).display()))?;
            tracing::info!(dir = %dir.display(), "state: new state directory (first start)");
            let writer = Writer {
                dir: dir.clone(),
                log,
                generation: 0,
                log_len: HEADER_LEN as u64,
                snapshot_len: 0,
                tuning,
                compact_on_start: false,
                lock,
                groups: groups.clone(),
            };
            (Snapshot::default(), writer)
        } else {
            let plan = replay::plan(&dir, &listing, None)?;
            let loaded = replay::replay::<Slot>(&dir, plan, true)?;
            let log_path = layout::file_path(&dir, FileKind::Log, loaded.newest_log);
            let mut log = OpenOptions::new()
                .write(true)
                .open(&log_path)
                .map_err(|e| format!("open log file {}: {e}", log_path.display()))?;
            if let Tail::Torn { offset, reason } = &loaded.newest_end.tail {
                tracing::warn!(
                    file = %log_path.display(),
                    offset,
                    dropped_bytes = loaded.newest_end.file_len - offset,
                    reason,
                    "state: dropped a torn record at the end of the log (a write cut short by a crash; it was never acknowledged)"
                );
                log.set_len(loaded.newest_end.valid_len)
                    .and_then(|()| log.sync_all())
                    .map_err(|e| format!("truncate torn tail of {}: {e}", log_path.display()))?;
            }
            log.seek(SeekFrom::Start(loaded.newest_end.valid_len))
                .map_err(|e| format!("seek in {}: {e}", log_path.display()))?;
            if let Err(e) = layout::remove_all(&dir, &loaded.plan.obsolete) {
                tracing::warn!(dir = %dir.display(), error = %e, "could not remove state files an earlier compaction already covered");
            }
            let writer = Writer {
                dir: dir.clone(),
                log,
                generation: loaded.newest_log,
                log_len: loaded.newest_end.valid_len,
                snapshot_len: loaded.snapshot_len,
                tuning,
                compact_on_start: loaded.plan.logs.len() > 1,
                lock,
                groups: groups.clone(),
            };
            let snapshot = loaded.image.into_snapshot();
            tracing::info!(
                dir = %dir.display(),
                machines = snapshot.slots.len(),
                fences = snapshot.fences.len(),
                revision = snapshot.revision,
                logs = loaded.plan.logs.len(),
                elapsed_ms = started.elapsed().as_millis() as u64,
                "state: loaded"
            );
            (snapshot, writer)
        };
        let (queue, receiver) = mpsc::channel();
        let handle = std::thread::Builder::new()
            .name("state-writer".into())
            .spawn(move || writer.run(receiver))
            .map_err(|e| format!("start the state writer thread: {e}"))?;
        Ok(DurableStore {
            dir,
            queue,
            writer: Mutex::new(Some(handle)),
            loaded: Mutex::new(Some(snapshot)),
            groups,
        })
    }

    /// The state directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// How many groups (one write and one fsync each) the writer has committed.
    pub fn groups_committed(&self) -> u64 {
        self.groups.load(Ordering::Relaxed)
    }

    fn send(&self, message: impl FnOnce(writer::Reply) -> Message) -> Commit {
        let (reply, receiver) = oneshot::channel();
        if let Err(mpsc::SendError(Message::Batch(_, reply) | Message::Flush(reply))) =
            self.queue.send(message(reply))
        {
            let _ = reply.send(Err(StoreError(format!(
                "the state writer for {} has stopped",
                self.dir.display()
            ))));
        }
        Commit::pending(receiver)
    }
}

impl Store for DurableStore {
    fn load(&self) -> Result<Snapshot, StoreError> {
        let cached = self
            .loaded
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        match cached {
            Some(snapshot) => Ok(snapshot),
            // A second load reads back what is durable so far.
            None => read_dir_state(&self.dir).map_err(StoreError),
        }
    }

    fn submit(&self, batch: Vec<Change>) -> Commit {
        self.send(|reply| Message::Batch(batch, reply))
    }

    fn is_durable(&self) -> bool {
        true
    }

    fn flush(&self) -> Commit {
        self.send(Message::Flush)
    }

    fn describe(&self) -> String {
        format!("{} (durable log)", self.dir.display())
    }
}

impl Drop for DurableStore {
    /// Finishes every queued batch, waits for a running compaction and releases the lock.
    fn drop(&mut self) {
        let _ = self.queue.send(Message::Stop);
        let handle = self
            .writer
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(handle) = handle {
            let _ = handle.join();
        }
    }
}

/// `PATH` without a trailing slash or `.` components, so sibling names derive from it.
fn normalize(path: &Path) -> PathBuf {
    let normalized: PathBuf = path
        .components()
        .filter(|c| !matches!(c, Component::CurDir))
        .collect();
    if normalized.as_os_str().is_empty() {
        PathBuf::from(".")
    } else {
        normalized
    }
}

fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut name = OsString::from(path.as_os_str());
    name.push(suffix);
    PathBuf::from(name)
}

/// Makes `dir` a state directory: as it is, created, imported from a reference file, or with
/// an interrupted import finished.
fn prepare(dir: &Path) -> Result<(), String> {
    match fs::metadata(dir) {
        Ok(meta) if meta.is_dir() => Ok(()),
        Ok(meta) if meta.is_file() => import_reference_file(dir),
        Ok(_) => Err(format!(
            "{} is neither a state directory nor a reference state file",
            dir.display()
        )),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let staging = sibling(dir, IMPORTING_SUFFIX);
            if staging.is_dir() {
                tracing::info!(
                    state = %dir.display(),
                    "state: finishing an import of the reference state file that a restart interrupted"
                );
                fs::rename(&staging, dir)
                    .and_then(|()| layout::sync_parent(dir))
                    .map_err(|e| format!("rename {} to {}: {e}", staging.display(), dir.display()))
            } else {
                layout::create_dir(dir)
                    .map_err(|e| format!("create state directory {}: {e}", dir.display()))
            }
        }
        Err(e) => Err(format!("inspect {}: {e}", dir.display())),
    }
}

fn read_reference_file(path: &Path) -> Result<reference::Imported, String> {
    let bytes = fs::read(path).map_err(|e| format!("read state file {}: {e}", path.display()))?;
    if bytes.is_empty() {
        return Err(format!(
            "state file {} is empty (zero length). An empty file usually means a lost write, so \
             it is not taken as a first start: restore it from a backup, or remove it to start \
             fresh (the provider then re-seeds from the cloud)",
            path.display()
        ));
    }
    reference::parse(&bytes).map_err(|e| {
        format!(
            "decode state file {} as the reference provider's JSON state: {e}",
            path.display()
        )
    })
}

/// Converts the reference provider's JSON state file at `path` into a state directory at the
/// same path, keeping the file as `<path>.reference-import.json`.
fn import_reference_file(path: &Path) -> Result<(), String> {
    let imported = read_reference_file(path)?;
    for warning in &imported.report.warnings {
        tracing::warn!(file = %path.display(), "state import: {warning}");
    }
    let staging = sibling(path, IMPORTING_SUFFIX);
    let at = |what: &str, e: io::Error| format!("import {}: {what}: {e}", path.display());
    if staging.exists() {
        fs::remove_dir_all(&staging).map_err(|e| at("remove an earlier partial import", e))?;
    }
    layout::create_dir(&staging).map_err(|e| at("create the state directory", e))?;
    if !imported.snapshot.is_fresh() {
        snapshot::write(&staging, 0, &Image::encode(&imported.snapshot))
            .map_err(|e| at("write the first snapshot", e))?;
    }
    layout::create_file_atomically(&staging, &layout::file_name(FileKind::Log, 0), |f| {
        f.write_all(&codec::encode_header(FileKind::Log, 0))
    })
    .map_err(|e| at("write the first log", e))?;
    let kept = kept_name(path);
    fs::rename(path, &kept)
        .and_then(|()| layout::sync_parent(path))
        .map_err(|e| at(&format!("rename it to {}", kept.display()), e))?;
    fs::rename(&staging, path)
        .and_then(|()| layout::sync_parent(path))
        .map_err(|e| at("move the new state directory into place", e))?;
    let report = &imported.report;
    tracing::info!(
        state = %path.display(),
        kept = %kept.display(),
        machines = report.machines,
        fence_marks = report.fence_marks,
        ops = report.ops,
        shard_wide_fence_layout = report.shard_wide_fences,
        shard_marks = report.shard_marks,
        revision = imported.snapshot.revision,
        next_op = imported.snapshot.next_op,
        warnings = report.warnings.len(),
        "state: imported the reference provider's JSON state file"
    );
    Ok(())
}

/// `<path>.reference-import.json`, or a numbered variant if an earlier import kept that name.
fn kept_name(path: &Path) -> PathBuf {
    let first = sibling(path, KEPT_SUFFIX);
    if !first.exists() {
        return first;
    }
    (2u32..)
        .map(|n| sibling(path, &format!(".reference-import-{n}.json")))
        .find(|p| !p.exists())
        .unwrap_or(first)
}

/// The state holds cluster bindings and fence marks: only the provider's user may read it.
/// The directory and files this build creates are 0700 and 0600 already; a directory created
/// by someone else (a mounted volume, an older build) or files copied in with wider modes are
/// tightened. Failing to (a directory owned by another user) is worth a warning, not a refusal
/// to start.
fn restrict_permissions(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let tighten = |path: &Path, mode: u32| {
        let Ok(meta) = fs::symlink_metadata(path) else {
            return;
        };
        let current = meta.permissions().mode() & 0o777;
        if current & 0o077 == 0 {
            return;
        }
        match fs::set_permissions(path, fs::Permissions::from_mode(current & mode)) {
            Ok(()) => tracing::info!(
                path = %path.display(),
                from = format!("{current:o}"),
                to = format!("{:o}", current & mode),
                "state: restricted permissions to the provider's user"
            ),
            Err(e) => tracing::warn!(
                path = %path.display(),
                mode = format!("{current:o}"),
                error = %e,
                "state: could not restrict permissions; other users may read the state"
            ),
        }
    };
    tighten(dir, 0o700);
    if let Ok(entries) = fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_file()) {
                tighten(&entry.path(), 0o600);
            }
        }
    }
}

/// Takes the directory lock, so two processes never write one state.
fn lock(dir: &Path) -> Result<File, String> {
    let path = dir.join(layout::LOCK_NAME);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .map_err(|e| format!("open lock file {}: {e}", path.display()))?;
    match file.try_lock() {
        Ok(()) => {
            let pid = std::process::id().to_string();
            let _ = file
                .set_len(0)
                .and_then(|()| file.write_all(pid.as_bytes()));
            Ok(file)
        }
        Err(TryLockError::WouldBlock) => {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            Err(format!(
                "state directory {} is in use by another provider process (pid {}, per {}); two \
                 providers must never share one --state",
                dir.display(),
                if holder.trim().is_empty() {
                    "unknown"
                } else {
                    holder.trim()
                },
                path.display()
            ))
        }
        Err(TryLockError::Error(e)) => Err(format!("lock {}: {e}", path.display())),
    }
}

/// Reads the state of a directory without writing anything (export, and a second `load`). The
/// newest log may end in a record still being written; it is left out. When a compaction of a
/// running provider removes files meanwhile, the read is retried.
fn read_dir_state(dir: &Path) -> Result<Snapshot, String> {
    let mut attempts = 0;
    loop {
        let listing = layout::list(dir)
            .map_err(|e| format!("read state directory {}: {e}", dir.display()))?;
        if listing.is_empty() {
            return Ok(Snapshot::default());
        }
        let result = replay::plan(dir, &listing, None)
            .and_then(|plan| replay::replay::<Slot>(dir, plan, true));
        match result {
            Ok(loaded) => return Ok(loaded.image.into_snapshot()),
            Err(e) => {
                attempts += 1;
                let now = layout::list(dir)
                    .map_err(|e| format!("read state directory {}: {e}", dir.display()))?;
                let changed = now.snapshots != listing.snapshots || now.logs != listing.logs;
                if !changed || attempts >= 10 {
                    return Err(e);
                }
            }
        }
    }
}

/// Renders the state at `path` as JSON without starting a server: a state directory (also while
/// a provider is running on it), or a reference JSON state file not imported yet. Nothing is
/// written.
pub fn export_json(path: &Path) -> Result<String, String> {
    let path = normalize(path);
    match fs::metadata(&path) {
        Ok(meta) if meta.is_dir() => {
            let snapshot = read_dir_state(&path)?;
            render_json(&snapshot, &format!("state directory {}", path.display()))
        }
        Ok(meta) if meta.is_file() => {
            let imported = read_reference_file(&path)?;
            render_json(
                &imported.snapshot,
                &format!(
                    "reference provider state file {} (not imported yet; a provider started \
                     with this --state imports it)",
                    path.display()
                ),
            )
        }
        Ok(_) => Err(format!(
            "{} is neither a state directory nor a reference state file",
            path.display()
        )),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let staging = sibling(&path, IMPORTING_SUFFIX);
            if staging.is_dir() {
                let snapshot = read_dir_state(&staging)?;
                return render_json(
                    &snapshot,
                    &format!("state directory {} (import in progress)", staging.display()),
                );
            }
            Err(format!(
                "no state at {}: nothing to export (a provider started with --state {} creates it)",
                path.display(),
                path.display()
            ))
        }
        Err(e) => Err(format!("inspect {}: {e}", path.display())),
    }
}

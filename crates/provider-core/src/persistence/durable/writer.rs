//! The writer thread: group commit and log rotation, plus the compactor thread it starts.
//!
//! The engine queues batches without waiting (it holds its write lock while it does). The
//! writer takes everything queued, appends it to the log in one write, fsyncs once for the whole
//! group and only then completes each batch's commit, in submission order. While it waits on
//! the disk, new batches queue up and form the next group, so concurrent mutations share
//! fsyncs. When the log has grown past the size of the last snapshot, the writer starts a new
//! log and a compactor thread folds the old snapshot and logs into a new snapshot from the
//! files alone: the writer keeps no copy of the state and never waits on a compaction.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::thread::JoinHandle;

use tokio::sync::oneshot;

use super::codec::{self, FileKind, HEADER_LEN};
use super::layout;
use super::replay;
use super::snapshot;
use crate::persistence::store::StoreError;
use crate::rules::records::Change;

/// Where a commit's outcome goes.
pub(crate) type Reply = oneshot::Sender<Result<(), StoreError>>;

/// What the store sends its writer.
pub(crate) enum Message {
    /// Make this batch durable after everything queued before it.
    Batch(Vec<Change>, Reply),
    /// Report once everything queued before it is durable.
    Flush(Reply),
    /// Finish what is queued, wait for a running compaction, release the directory.
    Stop,
}

/// Sizes that decide grouping and compaction.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Tuning {
    /// Never compact a log smaller than this; above it, compact once the log is as large as
    /// the last snapshot (so compaction work per mutation stays constant).
    pub compact_min_bytes: u64,
    /// A group stops taking batches once it holds this many bytes.
    pub max_group_bytes: usize,
}

impl Default for Tuning {
    fn default() -> Tuning {
        Tuning {
            compact_min_bytes: 8 << 20,
            max_group_bytes: 16 << 20,
        }
    }
}

/// The writer's side of an open state directory.
pub(crate) struct Writer {
    pub dir: PathBuf,
    /// The newest log, positioned at its end.
    pub log: File,
    pub generation: u64,
    pub log_len: u64,
    pub snapshot_len: u64,
    pub tuning: Tuning,
    /// Older logs exist that a compaction should fold away as soon as the writer starts.
    pub compact_on_start: bool,
    /// The directory lock, held as long as the writer runs.
    pub lock: File,
    /// Groups written so far (each one write and one fsync).
    pub groups: Arc<AtomicU64>,
}

struct Running {
    w: Writer,
    compactor: Option<JoinHandle<Result<u64, String>>>,
    /// After a failed rotation or compaction, wait until the log reaches this size.
    retry_at: u64,
    /// Set by the first failed write or fsync: nothing is acknowledged after it.
    failed: Option<StoreError>,
    group: Vec<u8>,
    replies: Vec<Reply>,
}

impl Writer {
    /// Runs until [`Message::Stop`] or until the store is dropped.
    pub fn run(self, queue: Receiver<Message>) {
        let compact_now = self.compact_on_start;
        let mut r = Running {
            w: self,
            compactor: None,
            retry_at: 0,
            failed: None,
            group: Vec::new(),
            replies: Vec::new(),
        };
        if compact_now {
            let target = r.w.generation;
            r.start_compaction(target);
        }
        let mut stopping = false;
        while !stopping {
            let Ok(first) = queue.recv() else { break };
            r.take(first, &mut stopping);
            while !stopping && r.group.len() < r.w.tuning.max_group_bytes {
                match queue.try_recv() {
                    Ok(message) => r.take(message, &mut stopping),
                    Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
                }
            }
            r.commit_group();
            if !stopping {
                r.maybe_compact();
            }
        }
        r.reap_compaction(true);
        // Only now may another process take the directory.
        drop(r.w.lock);
    }
}

impl Running {
    fn take(&mut self, message: Message, stopping: &mut bool) {
        match message {
            Message::Batch(batch, reply) => {
                if self.failed.is_none() {
                    codec::encode_batch(&batch, &mut self.group);
                }
                self.replies.push(reply);
            }
            Message::Flush(reply) => self.replies.push(reply),
            Message::Stop => *stopping = true,
        }
    }

    fn log_path(&self) -> PathBuf {
        layout::file_path(&self.w.dir, FileKind::Log, self.w.generation)
    }

    /// Writes and fsyncs the group, then completes its commits.
    fn commit_group(&mut self) {
        if self.failed.is_none() && !self.group.is_empty() {
            let written = self
                .w
                .log
                .write_all(&self.group)
                .and_then(|()| self.w.log.sync_data());
            match written {
                Ok(()) => {
                    self.w.log_len += self.group.len() as u64;
                    self.w.groups.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    let message = format!(
                        "write state log {}: {e} (nothing after this point is acknowledged; \
                         fix the disk and restart the provider)",
                        self.log_path().display()
                    );
                    tracing::error!(error = %message, "state store write failed");
                    self.failed = Some(StoreError(message));
                }
            }
        }
        // Keep a large buffer from one huge batch (the first seed) from staying allocated.
        if self.group.capacity() > 4 << 20 {
            self.group = Vec::new();
        } else {
            self.group.clear();
        }
        let outcome = match &self.failed {
            None => Ok(()),
            Some(e) => Err(e.clone()),
        };
        for reply in self.replies.drain(..) {
            let _ = reply.send(outcome.clone());
        }
    }

    fn maybe_compact(&mut self) {
        self.reap_compaction(false);
        let threshold = self.w.tuning.compact_min_bytes.max(self.w.snapshot_len);
        if self.compactor.is_some()
            || self.failed.is_some()
            || self.w.log_len < threshold
            || self.w.log_len < self.retry_at
        {
            return;
        }
        let next = self.w.generation + 1;
        let name = layout::file_name(FileKind::Log, next);
        let created = layout::create_file_atomically(&self.w.dir, &name, |f| {
            f.write_all(&codec::encode_header(FileKind::Log, next))
        });
        match created {
            Ok(file) => {
                self.w.log = file;
                self.w.generation = next;
                self.w.log_len = HEADER_LEN as u64;
                self.retry_at = 0;
                self.start_compaction(next);
            }
            Err(e) => {
                tracing::error!(
                    dir = %self.w.dir.display(),
                    error = %e,
                    "could not start a new state log; compaction postponed (the log keeps growing)"
                );
                self.retry_at = self.w.log_len + threshold;
            }
        }
    }

    /// Starts folding everything before log `target` into snapshot `target`.
    fn start_compaction(&mut self, target: u64) {
        let dir = self.w.dir.clone();
        let spawned = std::thread::Builder::new()
            .name("state-compactor".into())
            .spawn(move || compact(&dir, target));
        match spawned {
            Ok(handle) => self.compactor = Some(handle),
            Err(e) => {
                tracing::error!(error = %e, "could not start the state compactor");
                self.retry_at = self.w.log_len + self.w.tuning.compact_min_bytes;
            }
        }
    }

    /// Collects a finished compaction (or waits for it with `wait`).
    fn reap_compaction(&mut self, wait: bool) {
        if !self
            .compactor
            .as_ref()
            .is_some_and(|h| wait || h.is_finished())
        {
            return;
        }
        let Some(handle) = self.compactor.take() else {
            return;
        };
        match handle.join() {
            Ok(Ok(snapshot_len)) => {
                tracing::debug!(snapshot_len, "state compaction finished");
                self.w.snapshot_len = snapshot_len;
            }
            Ok(Err(e)) => {
                tracing::error!(error = %e, "state compaction failed; the state stays in the logs and compaction is retried later");
                self.retry_at = self.w.log_len + self.w.tuning.compact_min_bytes;
            }
            Err(_) => {
                tracing::error!("state compactor panicked; compaction is retried later");
                self.retry_at = self.w.log_len + self.w.tuning.compact_min_bytes;
            }
        }
    }
}

/// Writes snapshot `target` from the newest older snapshot and the logs before `target`, then
/// removes the files it covers. Those files are complete and never written again, so this runs
/// beside the writer; each step leaves a directory that loads to the same state.
pub(crate) fn compact(dir: &Path, target: u64) -> Result<u64, String> {
    let listing = layout::list(dir).map_err(|e| format!("list {}: {e}", dir.display()))?;
    let plan = replay::plan(dir, &listing, Some(target))?;
    let loaded = replay::replay::<Box<[u8]>>(dir, plan, false)?;
    let len = snapshot::write(dir, target, &loaded.image).map_err(|e| {
        format!(
            "write {}: {e}",
            layout::file_path(dir, FileKind::Snapshot, target).display()
        )
    })?;
    drop(loaded);
    let listing = layout::list(dir).map_err(|e| format!("list {}: {e}", dir.display()))?;
    let covered: Vec<PathBuf> = listing
        .snapshots
        .iter()
        .filter(|g| **g < target)
        .map(|g| layout::file_path(dir, FileKind::Snapshot, *g))
        .chain(
            listing
                .logs
                .iter()
                .filter(|g| **g < target)
                .map(|g| layout::file_path(dir, FileKind::Log, *g)),
        )
        .collect();
    layout::remove_all(dir, &covered)
        .map_err(|e| format!("remove compacted files in {}: {e}", dir.display()))?;
    Ok(len)
}

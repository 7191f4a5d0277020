//! How far the engine's state is durable. The engine changes memory under its lock and then
//! waits for the store; an answer must never show what the store has not kept (a new leader or a
//! restarted process would continue without it). Batches become durable in submission order, so
//! two numbers say it all: how many batches are durable, and the revision the last of them
//! reached. Reads and retries compare against them and wait only when they are behind.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};

use tokio::sync::Notify;

/// One submitted batch: its place in the submission order and the revision head after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Mark {
    pub batch: u64,
    pub revision: i64,
}

/// The store stopped committing (a failed commit or a step-down): what is not durable by now
/// never will be in this engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct NeverDurable;

#[derive(Debug)]
pub(super) struct Durability {
    /// Batches submitted so far; advanced under the inventory's write lock.
    submitted: AtomicU64,
    /// Batches known durable.
    batches: AtomicU64,
    /// The revision head of the last durable batch.
    revision: AtomicI64,
    stopped: AtomicBool,
    changed: Notify,
}

impl Durability {
    /// Everything up to `revision` is durable (what the engine loaded or committed at start).
    pub(super) fn new(revision: i64) -> Durability {
        Durability {
            submitted: AtomicU64::new(0),
            batches: AtomicU64::new(0),
            revision: AtomicI64::new(revision),
            stopped: AtomicBool::new(false),
            changed: Notify::new(),
        }
    }

    /// Numbers the batch being submitted; call under the write lock, in submission order.
    pub(super) fn submit(&self, revision: i64) -> Mark {
        Mark {
            batch: self.submitted.fetch_add(1, Ordering::SeqCst) + 1,
            revision,
        }
    }

    /// Where the submission order stands now (call under a lock of the inventory, so it covers
    /// every batch whose changes the caller can see).
    pub(super) fn head(&self, revision: i64) -> Mark {
        Mark {
            batch: self.submitted.load(Ordering::SeqCst),
            revision,
        }
    }

    /// The batch `mark` is durable, and with it every batch before it.
    pub(super) fn committed(&self, mark: Mark) {
        self.batches.fetch_max(mark.batch, Ordering::SeqCst);
        self.revision.fetch_max(mark.revision, Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    /// Nothing more becomes durable.
    pub(super) fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    /// The revision head of the last durable batch.
    pub(super) fn revision(&self) -> i64 {
        self.revision.load(Ordering::Acquire)
    }

    /// Whether the store stopped committing (nothing more becomes durable here).
    pub(super) fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::SeqCst)
    }

    /// Whether the revision `revision` is durable (the fast path of every read).
    pub(super) fn revision_is_durable(&self, revision: i64) -> bool {
        self.revision.load(Ordering::Acquire) >= revision
    }

    /// Waits until `revision` is durable.
    pub(super) async fn revision_durable(&self, revision: i64) -> Result<(), NeverDurable> {
        self.wait(|| self.revision.load(Ordering::SeqCst) >= revision)
            .await
    }

    /// Waits until every batch submitted up to `mark` is durable.
    pub(super) async fn batches_durable(&self, mark: Mark) -> Result<(), NeverDurable> {
        self.wait(|| self.batches.load(Ordering::SeqCst) >= mark.batch)
            .await
    }

    async fn wait(&self, done: impl Fn() -> bool) -> Result<(), NeverDurable> {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            // Registered before the check, so a commit between the check and the wait wakes it.
            changed.as_mut().enable();
            if done() {
                return Ok(());
            }
            if self.stopped.load(Ordering::SeqCst) {
                return Err(NeverDurable);
            }
            changed.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[tokio::test]
    async fn waiters_wake_when_their_batch_or_revision_is_durable() {
        let durability = Arc::new(Durability::new(10));
        assert!(durability.revision_is_durable(10));
        assert!(!durability.revision_is_durable(11));
        let first = durability.submit(11);
        let second = durability.submit(12);
        let head = durability.head(12);
        assert_eq!(head, second);
        let waiter = {
            let durability = durability.clone();
            tokio::spawn(async move { durability.batches_durable(head).await })
        };
        let reader = {
            let durability = durability.clone();
            tokio::spawn(async move { durability.revision_durable(12).await })
        };
        durability.committed(first);
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished() && !reader.is_finished());
        // Commits may be reported out of order; the later one covers the earlier.
        durability.committed(second);
        assert_eq!(waiter.await.expect("join"), Ok(()));
        assert_eq!(reader.await.expect("join"), Ok(()));
        durability.committed(first);
        assert!(durability.revision_is_durable(12));
    }

    #[tokio::test]
    async fn a_stopped_store_fails_only_what_is_not_durable() {
        let durability = Durability::new(3);
        let mark = durability.submit(4);
        durability.stop();
        assert_eq!(durability.revision_durable(3).await, Ok(()));
        assert_eq!(durability.revision_durable(4).await, Err(NeverDurable));
        assert_eq!(durability.batches_durable(mark).await, Err(NeverDurable));
    }
}

//! The state store seam. The engine hands the store one batch of per-record changes per
//! mutation, in the order the mutations were applied, and acknowledges the RPC only once the
//! batch is durable. The in-memory store (no `--state`) acknowledges at once.

use std::sync::Arc;

use tokio::sync::oneshot;

use crate::rules::records::{Change, Snapshot};

/// Why the store could not load or persist.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct StoreError(pub String);

/// The promise that a submitted batch becomes durable.
#[must_use = "a mutation is acknowledged only after its commit completes"]
pub struct Commit(Option<oneshot::Receiver<Result<(), StoreError>>>);

impl Commit {
    /// A commit that is already complete (the in-memory store).
    pub fn done() -> Commit {
        Commit(None)
    }

    /// A commit completed when the sender reports.
    pub fn pending(rx: oneshot::Receiver<Result<(), StoreError>>) -> Commit {
        Commit(Some(rx))
    }

    /// Waits until the batch is durable.
    pub async fn wait(self) -> Result<(), StoreError> {
        match self.0 {
            None => Ok(()),
            Some(rx) => rx
                .await
                .unwrap_or_else(|_| Err(StoreError("state store stopped before commit".into()))),
        }
    }
}

/// Where the engine's state lives between restarts.
pub trait Store: Send + Sync + 'static {
    /// Loads the state; an empty snapshot means a fresh store.
    fn load(&self) -> Result<Snapshot, StoreError>;
    /// Queues one batch. Called with the engine's write lock held, so it must not wait on I/O;
    /// batches become durable in submission order.
    fn submit(&self, batch: Vec<Change>) -> Commit;
    /// Whether state survives a restart (false for the in-memory store).
    fn is_durable(&self) -> bool;
    /// The largest encoded machine record the store can commit in one batch (the etcd store's
    /// request limit less its overhead); `None` when any record a request can make fits.
    fn max_record_bytes(&self) -> Option<usize> {
        None
    }
    /// Waits until everything submitted so far is durable (shutdown).
    fn flush(&self) -> Commit {
        Commit::done()
    }
    /// A short description for logs, e.g. the file path.
    fn describe(&self) -> String;
    /// Gives up the store's hold at shutdown, after the last commit (the etcd store revokes its
    /// claim so a successor need not wait for the lease to run out). Nothing commits after it.
    fn release(&self) -> Commit {
        Commit::done()
    }
}

/// State in process memory only: lost on restart, as with the reference without `--state`.
#[derive(Debug, Default)]
pub struct MemoryStore;

impl Store for MemoryStore {
    fn load(&self) -> Result<Snapshot, StoreError> {
        Ok(Snapshot::default())
    }

    fn submit(&self, _batch: Vec<Change>) -> Commit {
        Commit::done()
    }

    fn is_durable(&self) -> bool {
        false
    }

    fn describe(&self) -> String {
        "memory".into()
    }
}

/// Shared handle type for stores.
pub type SharedStore = Arc<dyn Store>;

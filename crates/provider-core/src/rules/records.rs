//! The records of the provider's state: a machine slot, a fence mark, the whole state as
//! loaded, and one durable change to it. The pure rules (`inventory`) produce and consume them;
//! the stores (`store`, `durable`, `etcd`) persist them. Neither side depends on the other.

use std::sync::Arc;

use crate::rules::fence::HighWaterMark;
use crate::rules::lifecycle::OperationKind;
use crate::rules::machine::Machine;

/// One machine slot with its bookkeeping.
#[derive(Clone, Debug, PartialEq)]
pub struct Slot {
    pub machine: Arc<Machine>,
    /// The revision of the slot's last change (List cursors compare against it).
    pub last_change: i64,
    /// The operation id recorded per kind (idempotency), indexed by [`OperationKind::index`].
    pub operations: [Option<String>; 4],
    /// The sealed bootstrap blob of the Configure in flight: present only while the machine is
    /// Configuring and the provider runs with `--state-encryption-key-file` (`seal`).
    pub sealed: Option<Arc<SealedConfigure>>,
    /// Which credential speaks for the agent on the slot's host, once it enrolled (the
    /// DigitalOcean bootstrap channel): kept while the slot holds that host, forgotten with it.
    pub enrollment: Option<Arc<Enrollment>>,
    /// Set on a FAILED record whose capacity came back under a new machine id (a Create the
    /// cloud refused without a host, an admin release): the record stays to end the old id on
    /// an edge BigFleet's shard has, holds no host, and leaves the state after
    /// [`RETIRED_RETENTION_SECONDS`].
    pub retired: Option<Retired>,
}

/// How long a retired record stays listed (FAILED, no host) before it leaves the state: long
/// enough for any shard, reconciling every few seconds, to read how the old id ended.
pub const RETIRED_RETENTION_SECONDS: u64 = 600;

/// Why a machine id was retired and its capacity given a new id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RetireReason {
    /// The cloud could not place the offering (a stockout, or the offering withdrawn).
    Stockout,
    /// The cloud account holds as many hosts as its limit allows.
    AccountLimit,
    /// `admin failed release` deleted the FAILED machine's host.
    Released,
}

impl RetireReason {
    pub const ALL: [RetireReason; 3] = [
        RetireReason::Stockout,
        RetireReason::AccountLimit,
        RetireReason::Released,
    ];

    /// The label value and the state's code.
    pub fn name(self) -> &'static str {
        match self {
            RetireReason::Stockout => "stockout",
            RetireReason::AccountLimit => "account_limit",
            RetireReason::Released => "released",
        }
    }

    pub fn code(self) -> u8 {
        match self {
            RetireReason::Stockout => 1,
            RetireReason::AccountLimit => 2,
            RetireReason::Released => 3,
        }
    }

    pub fn from_code(code: u8) -> Option<RetireReason> {
        RetireReason::ALL.into_iter().find(|r| r.code() == code)
    }
}

/// A retired record's facts: why, when (seconds since the Unix epoch) and the id its capacity
/// came back under.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Retired {
    pub reason: RetireReason,
    pub unix_seconds: u64,
    pub successor: String,
}

/// An on-host agent's enrollment, as the state keeps it: the host it was made on, a digest of
/// the credential it chose (never the credential: a reader of the state learns nothing that
/// lets it speak for the agent), whether its agent was handed a Configure's blob under it, and
/// whether a second enrollment with the spent one-time token cut the machine off.
#[derive(Clone, PartialEq, Eq)]
pub struct Enrollment {
    /// The cloud's host id the credential is bound to (a Droplet id).
    pub host_id: String,
    /// The Create operation whose one-time token was spent on this enrollment.
    pub create_operation: String,
    /// A digest of the credential (bound to the host id; the channel defines it).
    pub credential_digest: Vec<u8>,
    /// Set when another enrollment presented the spent token before the enrollment was
    /// confirmed: nothing is delivered to the machine's host any more, and its Configures fail.
    pub conflict: bool,
    /// Set once the enrolled agent acknowledged a Configure's blob: the blob went to the
    /// party that enrolled, so a later enrollment with the spent token (anything on the node
    /// can read it from the metadata service) is refused as a replay and changes nothing.
    pub confirmed: bool,
}

impl std::fmt::Debug for Enrollment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Enrollment")
            .field("host_id", &self.host_id)
            .field("create_operation", &self.create_operation)
            .field("conflict", &self.conflict)
            .field("confirmed", &self.confirmed)
            .finish_non_exhaustive()
    }
}

/// A Configure's bootstrap blob as the state keeps it while the Configure runs: sealed with the
/// state encryption key (the machine id and operation id bound in as associated data), with the
/// wall-clock deadline the Configure was accepted with, so a resumed Configure keeps it.
#[derive(Clone, PartialEq, Eq)]
pub struct SealedConfigure {
    /// Milliseconds since the Unix epoch at which the Configure's deadline passes.
    pub deadline_unix_ms: u64,
    /// Format byte, nonce, ciphertext and tag (`seal::StateKeys::seal`).
    pub sealed: Vec<u8>,
}

impl std::fmt::Debug for SealedConfigure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SealedConfigure")
            .field("deadline_unix_ms", &self.deadline_unix_ms)
            .field("sealed_bytes", &self.sealed.len())
            .finish()
    }
}

impl Slot {
    pub fn operation(&self, kind: OperationKind) -> Option<&str> {
        self.operations[kind.index()].as_deref()
    }
}

/// One durable fact. A batch of changes is applied atomically.
#[derive(Clone, Debug, PartialEq)]
pub enum Change {
    /// Insert or replace a machine slot (the record, its last-change revision and op ids).
    PutSlot(Slot),
    /// Forget a machine slot (an offering shrank).
    RemoveSlot(String),
    /// The high-water mark of a (shard, machine) pair.
    PutFence {
        shard_id: String,
        machine_id: String,
        mark: HighWaterMark,
    },
    /// Forget the mark of a (shard, machine) pair (a mark of an unknown id was evicted).
    RemoveFence {
        shard_id: String,
        machine_id: String,
    },
    /// The revision head and the next operation number.
    Counters { revision: i64, next_op: u64 },
}

/// A fence mark as loaded from a store.
#[derive(Clone, Debug, PartialEq)]
pub struct FenceRecord {
    pub shard_id: String,
    pub machine_id: String,
    pub mark: HighWaterMark,
}

/// The whole state, as loaded at startup.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    pub slots: Vec<Slot>,
    pub fences: Vec<FenceRecord>,
    pub revision: i64,
    pub next_op: u64,
}

impl Snapshot {
    /// A fresh store: no machines, no fences, no operations and revision 0 (contract.md §9).
    pub fn is_fresh(&self) -> bool {
        self.slots.is_empty() && self.fences.is_empty() && self.revision == 0 && self.next_op == 0
    }
}

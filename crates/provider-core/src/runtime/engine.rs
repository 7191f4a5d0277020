//! The contract engine: it owns the inventory behind one lock, runs admission and completion,
//! makes every acknowledged change durable before answering, and drives transitions in the
//! background under a deadline per kind (contract.md §3, §6). Reads never wait on the disk.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::observability::duration;
use crate::observability::telemetry::Telemetry;
use crate::persistence::store::{Commit, SharedStore};
use crate::provisioning::backend::{
    Backend, BackendError, BootstrapBlob, ConfigureOrder, HostLog, RefusalKind, TransitionContext,
    validate,
};
use crate::rules::error::CoreError;
use crate::rules::fence::FenceToken;
use crate::rules::inventory::{
    Admission, Binding, Effect, EnrollVerdict, Fitted, HostRecord, Interrupted, Inventory,
    ReconcileReport, Selected, Selection, Sighting, Suspect,
};
use crate::rules::lifecycle::OperationKind;
use crate::rules::limits;
use crate::rules::machine::{CapacityType, Machine, MachineState, StringMap};
use crate::rules::records::{Change, Enrollment, RetireReason, SealedConfigure, Slot, Snapshot};
use crate::security::seal::{KEY_FILE_FLAG, StateKeys};

mod durability;

use durability::{Durability, Mark};

/// The deadline of each transition kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    pub create: Duration,
    pub configure: Duration,
    pub drain: Duration,
    pub delete: Duration,
}

impl Default for Timeouts {
    /// The Hetzner and DigitalOcean defaults: 5m / 8m / 15m / 5m.
    fn default() -> Timeouts {
        Timeouts {
            create: Duration::from_secs(300),
            configure: Duration::from_secs(480),
            drain: Duration::from_secs(900),
            delete: Duration::from_secs(300),
        }
    }
}

impl Timeouts {
    pub fn of(&self, kind: OperationKind) -> Duration {
        match kind {
            OperationKind::Create => self.create,
            OperationKind::Configure => self.configure,
            OperationKind::Drain => self.drain,
            OperationKind::Delete => self.delete,
        }
    }
}

/// How the engine is set up.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    pub timeouts: Timeouts,
    /// Reported records must carry a zone (Hetzner and DigitalOcean).
    pub require_zone: bool,
    /// Budget of the first-boot Describe and of each reconcile pass.
    pub describe_timeout: Duration,
    /// Capacity of the table of fence marks for machine ids that do not exist.
    pub max_unknown_id_marks: usize,
    /// How long an owned host attached to no machine record is left alone before reconcile
    /// deletes it (`--orphan-grace`; zero keeps orphans forever).
    pub orphan_grace: Duration,
    /// `--state-encryption-key-file`: with it, an accepted Configure's blob is kept sealed in
    /// the state until the Configure ends, so a restart or a takeover resumes it.
    pub state_keys: Option<Arc<StateKeys>>,
    /// `--fail-unreadable-configures`: start even when sealed blobs of in-flight Configures
    /// cannot be opened, and fail exactly those Configures.
    pub fail_unreadable_configures: bool,
    pub telemetry: Telemetry,
}

/// The default `--orphan-grace`.
pub const DEFAULT_ORPHAN_GRACE: Duration = Duration::from_secs(600);

impl EngineOptions {
    pub fn new(telemetry: Telemetry) -> EngineOptions {
        EngineOptions {
            timeouts: Timeouts::default(),
            require_zone: true,
            describe_timeout: Duration::from_secs(30),
            max_unknown_id_marks: crate::rules::fence::unknown_ids::DEFAULT_CAPACITY,
            orphan_grace: DEFAULT_ORPHAN_GRACE,
            state_keys: None,
            fail_unreadable_configures: false,
            telemetry,
        }
    }
}

/// Why the engine could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("providerkit: load store: {0}")]
    Store(String),
    #[error("providerkit: seed from backend: {0}")]
    Seed(String),
    #[error("providerkit: invalid machine record: {0}")]
    InvalidRecord(String),
    #[error("providerkit: {0}")]
    Sealed(String),
}

/// Why an interrupted Configure without a sealed blob cannot be resumed.
pub const CONFIGURE_NOT_KEPT: &str = "configure transition interrupted by a provider restart; its \
     bootstrap blob was not kept (the provider runs without --state-encryption-key-file), so it \
     cannot be re-driven: release the slot (admin failed release) and configure another machine";

/// A read that may still wait for its commit (see [`Engine::settle`]).
#[derive(Debug)]
pub enum Durable<T> {
    /// Everything it shows is durable.
    Now(T),
    /// It shows changes up to `revision`, not all of them durable yet.
    After { value: T, revision: i64 },
}

impl<T> Durable<T> {
    /// What the read shows, durable or not.
    pub fn into_value(self) -> T {
        match self {
            Durable::Now(value) | Durable::After { value, .. } => value,
        }
    }
}

/// A batch submitted under the lock, and where it stands in the submission order.
struct Pending {
    commit: Option<Commit>,
    mark: Mark,
}

/// What [`Engine::enrollment_record`] reads.
#[derive(Clone, Debug)]
pub struct EnrollmentRecord {
    pub machine: Arc<Machine>,
    pub create_operation: Option<String>,
    pub enrollment: Option<Arc<Enrollment>>,
}

/// A List request in domain terms.
#[derive(Clone, Debug, Default)]
pub struct ListQuery {
    /// Empty means every state.
    pub states: Vec<MachineState>,
    /// 0 or less: no cap.
    pub max_results: i32,
    /// The raw cursor bytes from the request.
    pub since_revision: Vec<u8>,
}

/// The answer to a List.
#[derive(Debug)]
pub struct Listing {
    pub machines: Vec<Arc<Machine>>,
    pub revision: i64,
}

/// The answer to a mutating RPC.
#[derive(Debug)]
pub struct Ack {
    pub operation_id: String,
    pub machine: Arc<Machine>,
    /// False for an idempotent retry (no new work).
    pub accepted: bool,
}

/// How many machines are in each state, and how many FAILED ones still hold a host.
#[derive(Debug, Default, Clone)]
pub struct Census {
    pub by_state: Vec<(&'static str, usize)>,
    pub failed_with_host: usize,
    /// FAILED records without a host whose capacity came back under a new id, by reason.
    pub retired: Vec<(&'static str, usize)>,
    pub total: usize,
}

/// The work a transition performs, with what it needs beyond the machine snapshot.
#[derive(Debug, Clone)]
enum Work {
    Create,
    Configure(ConfigureOrder),
    Drain { grace_period_seconds: i64 },
    Delete,
}

impl Work {
    fn kind(&self) -> OperationKind {
        match self {
            Work::Create => OperationKind::Create,
            Work::Configure(_) => OperationKind::Configure,
            Work::Drain { .. } => OperationKind::Drain,
            Work::Delete => OperationKind::Delete,
        }
    }
}

/// The contract engine shared by every RPC handler and background loop.
pub struct Engine {
    inventory: RwLock<Inventory>,
    backend: Arc<dyn Backend>,
    store: SharedStore,
    options: EngineOptions,
    tasks: TaskTracker,
    accepting: AtomicBool,
    store_failed: AtomicBool,
    /// Where the next capped List starts (see [`Engine::list`]).
    next_capped_start: AtomicUsize,
    /// Cancelled when the shutdown grace runs out: in-flight work stops where it is.
    abandon: CancellationToken,
    /// How far the state is durable: no answer shows more.
    durability: Durability,
    /// Stops the task that fits the Speculative slots to what the backend offers.
    offer_watch: CancellationToken,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("store", &self.store.describe())
            .finish_non_exhaustive()
    }
}

fn unix_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(1)
}

fn unix_seconds() -> u64 {
    unix_micros() / 1_000_000
}

fn unix_millis() -> u64 {
    unix_micros() / 1000
}

/// The blobs of the interrupted Configures in `snapshot`, opened with `keys`, and the number of
/// sealed blobs that did not open.
fn open_sealed(
    snapshot: &Snapshot,
    keys: Option<&StateKeys>,
) -> (std::collections::HashMap<String, BootstrapBlob>, usize) {
    let mut opened = std::collections::HashMap::new();
    let mut unreadable = 0;
    for slot in &snapshot.slots {
        let (Some(sealed), Some(op)) = (&slot.sealed, slot.operation(OperationKind::Configure))
        else {
            continue;
        };
        if slot.machine.state != MachineState::Configuring {
            continue;
        }
        match keys.map(|keys| keys.open(&slot.machine.id, op, &sealed.sealed)) {
            Some(Ok(blob)) => {
                opened.insert(slot.machine.id.clone(), blob);
            }
            Some(Err(_)) | None => unreadable += 1,
        }
    }
    (opened, unreadable)
}

/// Why the Configure of `slot` cannot be resumed, if it cannot.
fn configure_failure(
    slot: &Slot,
    opened: &std::collections::HashMap<String, BootstrapBlob>,
    keys: Option<&StateKeys>,
) -> Option<String> {
    if opened.contains_key(&slot.machine.id) {
        return None;
    }
    Some(match (&slot.sealed, keys) {
        (None, _) => CONFIGURE_NOT_KEPT.to_owned(),
        (Some(_), None) => format!(
            "configure transition interrupted by a provider restart; its sealed bootstrap blob \
             could not be opened: the provider started without {KEY_FILE_FLAG} \
             (--fail-unreadable-configures): release the slot (admin failed release) and \
             configure another machine"
        ),
        (Some(_), Some(keys)) => format!(
            "configure transition interrupted by a provider restart; its sealed bootstrap blob \
             could not be opened: none of the {} keys of {KEY_FILE_FLAG} sealed it \
             (--fail-unreadable-configures): release the slot (admin failed release) and \
             configure another machine",
            keys.len()
        ),
    })
}

impl Engine {
    /// Loads the store, seeds a fresh one from the backend (validating every record), or
    /// recovers a persisted one: offered slots are added or trimmed to the quota, interrupted
    /// Create/Drain/Delete transitions are resumed and interrupted Configures fail.
    pub async fn start(
        backend: Arc<dyn Backend>,
        store: SharedStore,
        options: EngineOptions,
    ) -> Result<Arc<Engine>, StartError> {
        let snapshot = store.load().map_err(|e| StartError::Store(e.0))?;
        let keys = options.state_keys.as_deref();
        // Checked before anything changes: a wrong key must not fail work a right one resumes.
        let (mut opened, unreadable) = open_sealed(&snapshot, keys);
        if unreadable > 0 && !options.fail_unreadable_configures {
            let why = match keys {
                None => format!("the provider was started without {KEY_FILE_FLAG}"),
                Some(keys) => format!(
                    "none of the {} keys of {KEY_FILE_FLAG} opens them",
                    keys.len()
                ),
            };
            return Err(StartError::Sealed(format!(
                "the state holds the sealed bootstrap blobs of {unreadable} in-flight Configures \
                 and {why}: give {KEY_FILE_FLAG} the key they were sealed with (older keys on \
                 later lines), or start with --fail-unreadable-configures to fail exactly those \
                 Configures; no machine, mark or operation id was changed"
            )));
        }
        let fresh = snapshot.is_fresh();
        let mut inventory = Inventory::from_snapshot(snapshot);
        let mut changes = Vec::new();
        let evicted = inventory.limit_unknown_id_marks(options.max_unknown_id_marks, &mut changes);
        if evicted > 0 {
            tracing::info!(
                evicted,
                capacity = options.max_unknown_id_marks,
                "dropped the oldest stored fence marks of unknown machine ids beyond the table's capacity"
            );
        }
        let mut resume = Vec::new();
        if fresh {
            let described = tokio::time::timeout(options.describe_timeout, backend.describe())
                .await
                .map_err(|_| {
                    StartError::Seed(format!(
                        "backend Describe did not answer within {}",
                        duration::format(options.describe_timeout)
                    ))
                })?
                .map_err(|e| StartError::Seed(e.0))?;
            for machine in &described {
                validate(machine, options.require_zone).map_err(StartError::InvalidRecord)?;
            }
            // Machine ids of this state must be new to the project: the series its ids and
            // operation ids carry is none of those the hosts' machine ids carry.
            let taken: HashSet<u64> = described
                .iter()
                .filter(|m| m.host.is_some())
                .filter_map(|m| crate::rules::inventory::id_series(&m.id))
                .collect();
            inventory.ensure_series(&taken, &mut changes);
            let mut described = described;
            if backend.offer().is_some() {
                // The offerings' Speculative slots get ids of this state's series when the
                // slots are fitted below, so no id an earlier state listed is listed again.
                described.retain(|m| m.host.is_some() || m.state != MachineState::Speculative);
            }
            let seeded = if store.is_durable() {
                inventory.seed(described, &mut changes)
            } else {
                inventory.seed_unrecorded(described)
            };
            seeded.map_err(StartError::Seed)?;
        } else {
            inventory.invalidate_cursors(&mut changes);
            resume = inventory
                .recover_interrupted(|slot| configure_failure(slot, &opened, keys), &mut changes);
        }
        // A state an older version wrote, or a reference import, gets its series now.
        inventory.ensure_series(&HashSet::new(), &mut changes);
        // Before the first List: the offerings' slots are fitted (new ones under new ids),
        // withdrawn offerings' slots and those above the account's headroom hidden, slots of
        // offerings no longer configured removed.
        if let Some(offer) = backend.offer() {
            let cap = backend.speculative_cap();
            inventory.fit_offered(&offer, cap, unix_seconds(), &mut changes);
        }
        if !store.is_durable() {
            // Without a durable store, cursors of an earlier incarnation must not be reused:
            // start the revision from the clock, far above anything issued before (ids and
            // operation ids differ by the state's series).
            let floor = unix_micros();
            inventory.raise_counters(0, floor as i64);
            inventory.invalidate_cursors(&mut changes);
        }
        if !changes.is_empty() {
            store
                .submit(changes)
                .wait()
                .await
                .map_err(|e| StartError::Store(e.0))?;
        }
        let durability = Durability::new(inventory.revision());
        let engine = Arc::new(Engine {
            durability,
            inventory: RwLock::new(inventory),
            backend,
            store,
            options,
            tasks: TaskTracker::new(),
            accepting: AtomicBool::new(true),
            store_failed: AtomicBool::new(false),
            next_capped_start: AtomicUsize::new(rand::random::<u32>() as usize),
            abandon: CancellationToken::new(),
            offer_watch: CancellationToken::new(),
        });
        engine.spawn_offer_watch();
        for Interrupted {
            machine_id,
            kind,
            operation_id,
        } in resume
        {
            let Some((machine, sealed)) = engine
                .read()
                .get(&machine_id)
                .map(|s| (s.machine.clone(), s.sealed.clone()))
            else {
                continue;
            };
            let mut deadline = None;
            let work = match kind {
                OperationKind::Create => Work::Create,
                // A resumed drain has lost its grace period; the shortest the providers use.
                OperationKind::Drain => Work::Drain {
                    grace_period_seconds: 1,
                },
                OperationKind::Delete => Work::Delete,
                OperationKind::Configure => {
                    let (Some(blob), Some(sealed)) = (opened.remove(&machine_id), sealed) else {
                        continue;
                    };
                    // The Configure keeps the deadline it was accepted with.
                    let left = sealed.deadline_unix_ms.saturating_sub(unix_millis());
                    deadline = Some(Instant::now() + Duration::from_millis(left));
                    Work::Configure(ConfigureOrder {
                        cluster_id: machine.cluster.clone(),
                        blob,
                    })
                }
            };
            tracing::info!(
                machine_id,
                kind = kind.name(),
                operation_id,
                "resuming interrupted transition"
            );
            engine.spawn_transition(machine, operation_id, work, deadline);
        }
        Ok(engine)
    }

    fn read(&self) -> RwLockReadGuard<'_, Inventory> {
        self.inventory.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Inventory> {
        self.inventory.write().unwrap_or_else(|e| e.into_inner())
    }

    /// The store this engine commits to.
    pub fn store(&self) -> &SharedStore {
        &self.store
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    pub fn options(&self) -> &EngineOptions {
        &self.options
    }

    /// Commits a batch submitted under the lock and records the commit metrics. A failed commit
    /// poisons the engine: nothing more is acknowledged until an operator restarts it.
    async fn commit(&self, pending: Pending) -> Result<(), CoreError> {
        let Some(commit) = pending.commit else {
            return Ok(());
        };
        let started = std::time::Instant::now();
        let result = commit.wait().await;
        self.options
            .telemetry
            .store_commit(started.elapsed(), result.is_ok());
        if result.is_ok() {
            self.durability.committed(pending.mark);
        }
        result.map_err(|e| {
            self.durability.stop();
            if !self.store_failed.swap(true, Ordering::SeqCst) {
                tracing::error!(error = %e, "state store commit failed; refusing further mutations until restart");
                self.options.telemetry.store_refusing_mutations();
            }
            CoreError::Store(e.0)
        })
    }

    /// Applies `f` under the write lock and submits its changes in order. The mark says where
    /// the batch (or, with no changes, everything `f` could see) stands in the submission order.
    fn apply<T>(&self, f: impl FnOnce(&mut Inventory, &mut Vec<Change>) -> T) -> (T, Pending) {
        let mut inventory = self.write();
        inventory.forget_acknowledged(self.durability.revision());
        let mut changes = Vec::new();
        let value = f(&mut inventory, &mut changes);
        let revision = inventory.revision();
        let pending = if changes.is_empty() {
            Pending {
                commit: None,
                mark: self.durability.head(revision),
            }
        } else {
            Pending {
                mark: self.durability.submit(revision),
                commit: Some(self.store.submit(changes)),
            }
        };
        (value, pending)
    }

    /// The blob of a Configure about to be admitted, sealed for the operation id admission will
    /// mint, with the deadline the Configure gets; `None` without state keys.
    fn seal_configure(
        &self,
        inventory: &Inventory,
        machine_id: &str,
        order: &ConfigureOrder,
    ) -> Result<Option<Arc<SealedConfigure>>, CoreError> {
        let Some(keys) = &self.options.state_keys else {
            return Ok(None);
        };
        let operation_id = inventory.next_operation_id();
        let sealed = keys
            .seal(machine_id, &operation_id, &order.blob.0)
            .map_err(CoreError::Store)?;
        let timeout = self.options.timeouts.configure.as_millis() as u64;
        Ok(Some(Arc::new(SealedConfigure {
            deadline_unix_ms: unix_millis().saturating_add(timeout),
            sealed,
        })))
    }

    /// Refuses a Configure whose machine record could not fit the store's record limit (the
    /// etcd store's request limit), before the fence and whether or not the machine exists.
    fn check_record_size(
        &self,
        inventory: &Inventory,
        machine_id: &str,
        binding: &Binding,
        blob_len: usize,
    ) -> Result<(), CoreError> {
        let Some(limit) = self.store.max_record_bytes() else {
            return Ok(());
        };
        let mut slot = match inventory.get(machine_id) {
            Some(slot) => Slot::clone(slot),
            None => Slot {
                machine: Arc::new(Machine::speculative(machine_id, "")),
                last_change: 0,
                operations: Default::default(),
                sealed: None,
                enrollment: None,
                retired: None,
            },
        };
        let machine = crate::rules::machine::edit(&mut slot.machine);
        machine.cluster = binding.cluster.clone();
        machine.shard_metadata = binding.shard_metadata.clone();
        slot.sealed = binding.sealed.clone();
        let mut encoded = Vec::new();
        crate::persistence::durable::encode_slot(&slot, &mut encoded);
        if encoded.len() <= limit {
            return Ok(());
        }
        let metadata: usize = binding
            .shard_metadata
            .iter()
            .map(|(k, v)| k.len() + v.len())
            .sum();
        let field = if binding.sealed.is_some() && blob_len > metadata {
            "bootstrap_blob"
        } else {
            "shard_metadata"
        };
        Err(CoreError::FieldTooLarge {
            field,
            detail: format!(
                "the machine's record would be {} bytes, more than the {limit} bytes a record of \
                 this state store may hold (--etcd-max-request-bytes, docs/ha.md)",
                encoded.len()
            ),
        })
    }

    async fn mutate(
        self: &Arc<Self>,
        machine_id: &str,
        token: FenceToken,
        binding: Option<Binding>,
        work: Work,
    ) -> Result<Ack, CoreError> {
        if machine_id.is_empty() {
            return Err(CoreError::MissingId("machine_id"));
        }
        limits::check_id("machine_id", machine_id)?;
        limits::check_id("shard_id", &token.shard_id)?;
        if let Some(binding) = &binding {
            limits::check_id("cluster_id", &binding.cluster)?;
            limits::check_metadata(&binding.shard_metadata)?;
        }
        if matches!(work, Work::Delete) && !self.backend.supports_delete() {
            return Err(CoreError::DeleteUnsupported);
        }
        if !self.accepting.load(Ordering::SeqCst) {
            return Err(CoreError::ShuttingDown);
        }
        if self.store_failed.load(Ordering::SeqCst) {
            return Err(CoreError::Store(
                "an earlier commit failed; restart the provider".into(),
            ));
        }
        let kind = work.kind();
        let (admitted, pending) = self.apply(|inv, changes| {
            let mut binding = binding;
            if let (Some(binding), Work::Configure(order)) = (&mut binding, &work) {
                binding.sealed = self.seal_configure(inv, machine_id, order)?;
                self.check_record_size(inv, machine_id, binding, order.blob.0.len())?;
            }
            let (_, evicted_before) = inv.unknown_id_marks();
            let admission = inv.admit(kind, machine_id, &token, binding, changes);
            let (held, evicted_after) = inv.unknown_id_marks();
            Ok((admission, (held, evicted_after - evicted_before)))
        });
        let (admission, unknown_marks) = admitted?;
        self.options
            .telemetry
            .unknown_id_marks(unknown_marks.0, unknown_marks.1);
        // The rest runs to the end even when the caller goes away (a client deadline while a
        // commit is slow): an admitted transition must get its task once its batch is durable,
        // or it would stay transitional with nothing carrying it out. It is tracked like a
        // transition, so a graceful shutdown waits for it (and for the task it starts).
        let engine = self.clone();
        let finish = self.tasks.spawn(async move {
            // A passing token advanced the mark even when the request then fails: make it
            // durable.
            let mark = pending.mark;
            engine.commit(pending).await?;
            // Nothing is answered from state the store has not kept: a retry's operation id, a
            // mark another request advanced, a position another request took may all still be
            // in a commit in flight (a new leader would not know them).
            engine.durability.batches_durable(mark).await.map_err(|_| {
                CoreError::Store(
                    "the state store stopped before the state this answer shows was durable".into(),
                )
            })?;
            match admission? {
                Admission::Retry {
                    operation_id,
                    machine,
                } => Ok(Ack {
                    operation_id,
                    machine,
                    accepted: false,
                }),
                Admission::Accepted {
                    operation_id,
                    machine,
                } => {
                    engine.spawn_transition(machine.clone(), operation_id.clone(), work, None);
                    Ok(Ack {
                        operation_id,
                        machine,
                        accepted: true,
                    })
                }
            }
        });
        finish
            .await
            .unwrap_or_else(|e| Err(CoreError::Store(format!("commit task ended: {e}"))))
    }

    pub async fn create(
        self: &Arc<Self>,
        machine_id: &str,
        token: FenceToken,
    ) -> Result<Ack, CoreError> {
        self.mutate(machine_id, token, None, Work::Create).await
    }

    pub async fn configure(
        self: &Arc<Self>,
        machine_id: &str,
        cluster_id: String,
        blob: Vec<u8>,
        shard_metadata: StringMap,
        token: FenceToken,
    ) -> Result<Ack, CoreError> {
        let binding = Binding {
            cluster: cluster_id.clone(),
            shard_metadata,
            sealed: None,
        };
        let order = ConfigureOrder {
            cluster_id,
            blob: BootstrapBlob(blob),
        };
        self.mutate(machine_id, token, Some(binding), Work::Configure(order))
            .await
    }

    pub async fn drain(
        self: &Arc<Self>,
        machine_id: &str,
        grace_period_seconds: i64,
        token: FenceToken,
    ) -> Result<Ack, CoreError> {
        self.mutate(
            machine_id,
            token,
            None,
            Work::Drain {
                grace_period_seconds,
            },
        )
        .await
    }

    pub async fn delete(
        self: &Arc<Self>,
        machine_id: &str,
        token: FenceToken,
    ) -> Result<Ack, CoreError> {
        self.mutate(machine_id, token, None, Work::Delete).await
    }

    /// The machine as memory holds it now, durable or not (admin and tests; the wire answers
    /// with [`Engine::get_durable`]).
    pub fn get(&self, id: &str) -> Result<Arc<Machine>, CoreError> {
        self.get_durable(id).map(Durable::into_value)
    }

    /// Get as answered on the wire: the machine, and whether its last change is durable yet.
    pub fn get_durable(&self, id: &str) -> Result<Durable<Arc<Machine>>, CoreError> {
        if id.is_empty() {
            return Err(CoreError::MissingId("id"));
        }
        limits::check_id("id", id)?;
        let inventory = self.read();
        let slot = inventory
            .get(id)
            .ok_or_else(|| CoreError::GetNotFound(id.to_owned()))?;
        let value = slot.machine.clone();
        Ok(self.durable_at(value, slot.last_change))
    }

    /// List as answered on the wire: the listing, and whether its revision is durable yet.
    pub fn list_durable(&self, query: &ListQuery) -> Durable<Listing> {
        let listing = self.list(query);
        let revision = listing.revision;
        self.durable_at(listing, revision)
    }

    fn durable_at<T>(&self, value: T, revision: i64) -> Durable<T> {
        if self.durability.revision_is_durable(revision) {
            Durable::Now(value)
        } else {
            Durable::After { value, revision }
        }
    }

    /// Holds a read until what it shows is durable: an answer never shows a state or a revision
    /// the store may still lose (a restart or a new leader would continue without it).
    pub async fn settle<T>(&self, read: Durable<T>) -> Result<T, CoreError> {
        match read {
            Durable::Now(value) => Ok(value),
            Durable::After { value, revision } => {
                self.durability
                    .revision_durable(revision)
                    .await
                    .map_err(|_| {
                        CoreError::Store(
                            "the state store stopped before this state was durable".into(),
                        )
                    })?;
                Ok(value)
            }
        }
    }

    /// Get when the store stopped committing before the machine's last change was durable
    /// (a leader that lost etcd): the machine as the store holds it. `None` while the store
    /// commits (wait for it instead), or for a machine the store never held.
    pub fn acknowledged_get(&self, id: &str) -> Option<Arc<Machine>> {
        if !self.durability.is_stopped() {
            return None;
        }
        self.read().acknowledged_get(id, self.durability.revision())
    }

    /// List when the store stopped committing (a leader that lost etcd, answering reads while
    /// no replica can lead): every machine as the store holds it, at the last revision the
    /// store confirmed, so the answer shows nothing a new leader could take back and its
    /// revision is never one a new leader could reuse for other changes. `None` while the
    /// store commits.
    pub fn acknowledged_list(&self, query: &ListQuery) -> Option<Listing> {
        if !self.durability.is_stopped() {
            return None;
        }
        let durable = self.durability.revision();
        let cursor = std::str::from_utf8(&query.since_revision)
            .ok()
            .filter(|s| !s.is_empty())
            .and_then(|s| s.parse::<i64>().ok());
        let selection = Selection {
            states: query.states.clone(),
            since: cursor.filter(|c| *c <= durable),
            cap: usize::try_from(query.max_results)
                .ok()
                .filter(|n| *n > 0)
                .unwrap_or(usize::MAX),
        };
        let machines = self.read().acknowledged_select(&selection, durable);
        Some(Listing {
            machines,
            revision: durable,
        })
    }

    /// List with a state filter, a cap and a `since_revision` cursor (contract.md §8). A cursor
    /// that does not parse, or that is ahead of the head (another incarnation), is no cursor.
    pub fn list(&self, query: &ListQuery) -> Listing {
        let cursor = std::str::from_utf8(&query.since_revision)
            .ok()
            .filter(|s| !s.is_empty())
            .and_then(|s| s.parse::<i64>().ok());
        let cap = usize::try_from(query.max_results)
            .ok()
            .filter(|n| *n > 0)
            .unwrap_or(usize::MAX);
        let inventory = self.read();
        let head = inventory.revision();
        let selection = Selection {
            states: query.states.clone(),
            since: cursor.filter(|c| *c <= head),
            cap,
        };
        let capped = cap < inventory.len();
        // A capped List is an arbitrary subset (contract.md §8), and callers rely on that: the
        // conformance program and a shard's worker pool pick "different" machines with
        // consecutive `max_results = 1` calls. A capped List therefore starts where the previous
        // one stopped (the first one at a random slot) and wraps around: consecutive picks are
        // distinct until every match has been returned once, and every slot is visited at most
        // once per List. The cost is what the indexes yield (`Inventory::select`).
        let start = if capped {
            self.next_capped_start.load(Ordering::Relaxed) % inventory.len()
        } else {
            0
        };
        let Selected { machines, visited } = inventory.select(&selection, start);
        if capped {
            self.next_capped_start
                .store((start + visited) % inventory.len(), Ordering::Relaxed);
        }
        Listing {
            machines,
            revision: head,
        }
    }

    /// What the state records of `machine_id` for an on-host agent's channel: the machine, the
    /// operation id of its Create and its host's enrollment, if any (a map lookup; never waits).
    pub fn enrollment_record(&self, machine_id: &str) -> Option<EnrollmentRecord> {
        let inventory = self.read();
        let slot = inventory.get(machine_id)?;
        Some(EnrollmentRecord {
            machine: slot.machine.clone(),
            create_operation: slot.operation(OperationKind::Create).map(str::to_owned),
            enrollment: slot.enrollment.clone(),
        })
    }

    /// Records an agent's enrollment (or marks a conflict on it) and returns once it is
    /// durable, so an agent never learns it enrolled before a restart or a new leader would
    /// know it too.
    pub async fn record_enrollment(
        &self,
        machine_id: &str,
        enrollment: Enrollment,
    ) -> Result<EnrollVerdict, CoreError> {
        if self.store_failed.load(Ordering::SeqCst) {
            return Err(CoreError::Store(
                "an earlier commit failed; restart the provider".into(),
            ));
        }
        let (result, commit) =
            self.apply(|inv, changes| inv.record_enrollment(machine_id, enrollment, changes));
        self.commit(commit).await?;
        result.map_err(CoreError::Admin)
    }

    /// Machines by state, for metrics.
    pub fn census(&self) -> Census {
        let inventory = self.read();
        let failed_with_host = inventory
            .in_state(MachineState::Failed)
            .filter(|slot| slot.machine.host.is_some())
            .count();
        Census {
            by_state: MachineState::ALL[1..]
                .iter()
                .map(|s| (s.name(), inventory.count_in_state(*s)))
                .collect(),
            failed_with_host,
            retired: inventory
                .retired_by_reason()
                .into_iter()
                .map(|(reason, n)| (reason.name(), n))
                .collect(),
            total: inventory.len(),
        }
    }

    /// The ids of the listed Speculative slots without a host of `instance_type` in `zone`,
    /// the oldest first: the ones a Create would take next.
    pub fn spare_of(&self, instance_type: &str, zone: &str) -> Vec<String> {
        let inventory = self.read();
        let mut ids: Vec<String> = inventory
            .listed_spare()
            .filter(|s| s.machine.instance_type == instance_type && s.machine.zone == zone)
            .map(|s| s.machine.id.clone())
            .collect();
        ids.sort_by(|a, b| {
            crate::rules::inventory::slot_order(a).cmp(&crate::rules::inventory::slot_order(b))
        });
        ids
    }

    /// The ids of the Speculative slots kept in the state but not listed (a withdrawn
    /// offering's, those above the account's headroom), the oldest first.
    pub fn hidden(&self) -> Vec<String> {
        let inventory = self.read();
        let mut ids: Vec<String> = inventory
            .spare_speculative()
            .filter(|s| inventory.is_hidden(&s.machine.id))
            .map(|s| s.machine.id.clone())
            .collect();
        ids.sort_by(|a, b| {
            crate::rules::inventory::slot_order(a).cmp(&crate::rules::inventory::slot_order(b))
        });
        ids
    }

    /// FAILED machines an operator can release, for the admin interface: every FAILED record
    /// but the retired ones (their capacity came back already).
    pub fn failed(&self) -> Vec<Arc<Machine>> {
        self.read()
            .in_state(MachineState::Failed)
            .filter(|s| s.retired.is_none())
            .map(|s| s.machine.clone())
            .collect()
    }

    /// The whole state (for `state export` of a running provider and tests).
    pub fn snapshot(&self) -> Snapshot {
        self.read().snapshot()
    }

    /// One reconcile pass (contract.md §9, beyond.md §4–§5): survey the substrate, validate
    /// (skipping invalid records), merge what may be merged, prove suspected vanished hosts
    /// absent by a direct read before changing their slots, and delete orphans whose grace
    /// period ran out. A slot that changed after the survey began is never touched by the pass.
    pub async fn reconcile(&self) -> Result<ReconcileReport, CoreError> {
        let since = self.read().revision();
        let mut survey = tokio::time::timeout(self.options.describe_timeout, self.backend.survey())
            .await
            .map_err(|_| CoreError::Admin("reconcile: backend Describe timed out".into()))?
            .map_err(|e| CoreError::Admin(format!("reconcile: {e}")))?;
        survey.machines.retain(
            |machine| match validate(machine, self.options.require_zone) {
                Ok(()) => true,
                Err(reason) => {
                    tracing::warn!(reason, "providerkit: reconcile skipping invalid instance");
                    false
                }
            },
        );
        let offer = self.backend.offer();
        if offer.is_some() {
            // The offerings' Speculative slots are fitted below, by offering, under this
            // state's ids: the listing's slot records only carry their shapes.
            survey
                .machines
                .retain(|m| m.host.is_some() || m.state != MachineState::Speculative);
        }
        let now = Instant::now();
        // Zero disables orphan deletion: no orphan is ever due.
        let grace = if self.options.orphan_grace.is_zero() {
            Duration::MAX
        } else {
            self.options.orphan_grace
        };
        let cap = self.backend.speculative_cap();
        let now_unix = unix_seconds();
        let (outcome, commit) = self.apply(|inv, changes| {
            let outcome = inv.reconcile(survey, None, since, now, grace, changes);
            if let Some(offer) = &offer {
                inv.fit_offered(offer, cap, now_unix, changes);
            } else {
                inv.prune_retired(now_unix, changes);
            }
            outcome
        });
        self.commit(commit).await?;
        let mut report = outcome.report;
        let confirmed = self.prove_vanished(outcome.suspects).await;
        if !confirmed.is_empty() {
            let (vanished, commit) =
                self.apply(|inv, changes| inv.confirm_vanished(&confirmed, since, changes));
            self.commit(commit).await?;
            report.vanished += vanished;
        }
        for orphan in outcome.orphans_due {
            match self.delete_orphan(&orphan).await? {
                Some(true) => report.failed_hosts_deleted += 1,
                Some(false) => report.orphans_deleted += 1,
                None => {}
            }
        }
        Ok(report)
    }

    /// The suspects proved absent: by a direct read answering not-found, or, when the backend
    /// cannot read one host, by absence in the previous pass too.
    async fn prove_vanished(&self, suspects: Vec<Suspect>) -> Vec<Suspect> {
        let mut confirmed = Vec::new();
        for suspect in suspects {
            let read = tokio::time::timeout(
                self.options.describe_timeout,
                crate::provisioning::budget::scoped(
                    crate::provisioning::budget::Class::Proof,
                    self.backend
                        .host_present(&suspect.machine_id, &suspect.host),
                ),
            )
            .await;
            let proved = match read {
                Ok(Ok(Some(present))) => !present,
                Ok(Ok(None)) => suspect.absent_before,
                Ok(Err(e)) => {
                    tracing::warn!(machine_id = suspect.machine_id, host = suspect.host.id, err = %e, "reconcile: cannot confirm a host missing from the listing; keeping the machine as it is");
                    false
                }
                Err(_) => false,
            };
            if proved {
                confirmed.push(suspect);
            } else {
                tracing::debug!(
                    machine_id = suspect.machine_id,
                    host = suspect.host.id,
                    "reconcile: host missing from the listing is not proved gone"
                );
            }
        }
        confirmed
    }

    /// Deletes an owned host attached to no machine record (or the unbound host of a FAILED
    /// one), if it still is one. `Some(was a FAILED machine's)` when it was deleted.
    async fn delete_orphan(&self, orphan: &Sighting) -> Result<Option<bool>, CoreError> {
        if !self.read().still_orphan(orphan) {
            return Ok(None);
        }
        let mut machine = Machine::speculative(orphan.machine_id.clone(), "");
        machine.capacity_type = CapacityType::OnDemand;
        machine.state = MachineState::Idle;
        machine.host = Some(orphan.host.clone());
        let ctx = TransitionContext::with_timeout(
            format!("orphan-{}", unix_micros()),
            self.options.timeouts.delete,
        );
        let outcome = tokio::time::timeout(ctx.remaining(), self.backend.delete(&machine, &ctx))
            .await
            .unwrap_or_else(|_| Err(BackendError::new("delete timed out")));
        match outcome {
            Ok(()) => {
                let (was_failed, commit) =
                    self.apply(|inv, changes| inv.orphan_deleted(orphan, changes));
                self.commit(commit).await?;
                let grace = duration::format(self.options.orphan_grace);
                if was_failed {
                    tracing::warn!(machine_id = orphan.machine_id, host = orphan.host.id, grace = %grace, "reconcile: deleted the host of a FAILED machine that no release came for; the machine stays FAILED without it");
                } else {
                    tracing::warn!(machine_id = orphan.machine_id, host = orphan.host.id, grace = %grace, "reconcile: deleted an owned host attached to no machine record");
                }
                self.options
                    .telemetry
                    .reconcile_host_deleted(if was_failed { "failed" } else { "orphan" });
                Ok(Some(was_failed))
            }
            Err(e) => {
                tracing::warn!(machine_id = orphan.machine_id, host = orphan.host.id, err = %e, "reconcile: deleting an orphaned host failed; trying again next pass");
                Ok(None)
            }
        }
    }

    /// Releases a FAILED slot: deletes its host through the backend if it has one (or, when
    /// the record holds none, any host the substrate shows for the machine), then returns it
    /// to Speculative. The whole release runs under one deadline, the Delete timeout, and its
    /// cloud requests wait for the API budget within it (a rate-limit storm delays a release,
    /// it does not fail it). A release that gives up changes nothing it did not finish: the
    /// machine stays FAILED holding the host that is left, and the error says which hosts were
    /// deleted and which are left. Running it again carries on (a host already gone counts as
    /// deleted). Returns what was done, for the operator.
    pub async fn release(&self, machine_id: &str) -> Result<String, CoreError> {
        let machine = {
            let inventory = self.read();
            let slot = inventory
                .get(machine_id)
                .ok_or_else(|| CoreError::UnknownMachine(machine_id.to_owned()))?;
            if slot.machine.state != MachineState::Failed {
                return Err(CoreError::Admin(format!(
                    "machine {machine_id} is {}, not Failed; only FAILED slots can be released \
                     (nothing changed)",
                    slot.machine.state
                )));
            }
            slot.machine.clone()
        };
        let limit = self.options.timeouts.delete;
        let ctx = TransitionContext::with_timeout(format!("release-{}", unix_micros()), limit);
        let started = Instant::now();
        let gave_up = |what: String, deleted: &[String]| {
            CoreError::Admin(format!(
                "release {machine_id} gave up after {} (its deadline is {}, the wait for the \
                 cloud API budget included): {what}; deleted so far: {}; the machine stays FAILED; \
                 run the release again once the cause is fixed (hosts already deleted count as \
                 deleted)",
                duration::format(started.elapsed()),
                duration::format(limit),
                if deleted.is_empty() {
                    "none".to_owned()
                } else {
                    deleted.join(", ")
                },
            ))
        };
        let hosts = match &machine.host {
            Some(host) => vec![host.clone()],
            // A Create that failed after its host existed may have left one that no reconcile
            // pass has recorded yet: look before the slot goes back to Speculative, or the
            // next pass would adopt it behind the operator's back.
            None => self
                .hosts_of(machine_id, ctx.remaining())
                .await
                .map_err(|e| {
                    gave_up(
                        format!("could not look for a host a failed Create may have left: {e}"),
                        &[],
                    )
                })?,
        };
        let mut deleted = Vec::new();
        for (i, host) in hosts.iter().enumerate() {
            let mut target = (*machine).clone();
            target.host = Some(host.clone());
            let outcome = tokio::time::timeout(ctx.remaining(), self.backend.delete(&target, &ctx))
                .await
                .unwrap_or_else(|_| Err(BackendError::new("delete timed out")));
            if let Err(e) = outcome {
                // What is left stays on the record, so the next release (or reconcile, after
                // --orphan-grace) finds it.
                let left: Vec<String> = hosts[i..].iter().map(|h| h.id.clone()).collect();
                let (_, commit) =
                    self.apply(|inv, changes| inv.keep_failed_host(machine_id, host, changes));
                self.commit(commit).await?;
                return Err(gave_up(
                    format!(
                        "delete host {}: {e}; left: host {}",
                        host.id,
                        left.join(", host ")
                    ),
                    &deleted,
                ));
            }
            self.write().remember_deleted_host(&host.id);
            deleted.push(host.id.clone());
        }
        let offer = self.backend.offer();
        let cap = self.backend.speculative_cap();
        let now = unix_seconds();
        let (result, commit) = self.apply(|inv, changes| {
            let result = inv.release(machine_id, now, changes);
            if result.is_ok()
                && let Some(offer) = &offer
            {
                inv.fit_offered(offer, cap, now, changes);
            }
            result
        });
        self.commit(commit).await?;
        let successor = result?;
        Ok(match deleted.as_slice() {
            [] => format!(
                "released {machine_id}: it held no host; its capacity comes back as machine {successor}"
            ),
            ids => format!(
                "released {machine_id}: deleted host {} in {} (deadline {}, the wait for the \
                 cloud API budget included); its capacity comes back as machine {successor}",
                ids.join(", host "),
                duration::format(started.elapsed()),
                duration::format(limit)
            ),
        })
    }

    /// Every host the substrate shows for `machine_id` now: read for that machine alone where
    /// the backend can (a paged listing of every host can skip one while others are deleted),
    /// else picked out of a survey.
    async fn hosts_of(
        &self,
        machine_id: &str,
        within: Duration,
    ) -> Result<Vec<crate::rules::machine::HostRef>, String> {
        let direct = tokio::time::timeout(within, self.backend.machine_hosts(machine_id))
            .await
            .map_err(|_| {
                format!(
                    "backend host read timed out after {}",
                    duration::format(within)
                )
            })?
            .map_err(|e| e.0)?;
        if let Some(hosts) = direct {
            return Ok(hosts);
        }
        let survey = tokio::time::timeout(self.options.describe_timeout, self.backend.survey())
            .await
            .map_err(|_| "backend Describe timed out".to_owned())?
            .map_err(|e| e.0)?;
        Ok(match survey.hosts {
            Some(hosts) => hosts
                .into_iter()
                .filter(|s| s.machine_id == machine_id)
                .map(|s| s.host)
                .collect(),
            None => survey
                .machines
                .into_iter()
                .filter(|m| m.id == machine_id)
                .filter_map(|m| m.host)
                .collect(),
        })
    }

    /// Runs `work` in the background under `deadline` (the kind's timeout from now when
    /// `None`; a resumed Configure keeps the one it was accepted with).
    fn spawn_transition(
        self: &Arc<Self>,
        machine: Arc<Machine>,
        operation_id: String,
        work: Work,
        deadline: Option<Instant>,
    ) {
        let engine = self.clone();
        let kind = work.kind();
        let timeout = self.options.timeouts.of(kind);
        let host_log = if kind == OperationKind::Create {
            HostLog::new(self.host_sink(&machine.id, &operation_id))
        } else {
            HostLog::default()
        };
        let configure_nonce = matches!(work, Work::Configure(_)).then(|| {
            let sealed = self.read().get(&machine.id).and_then(|s| s.sealed.clone());
            crate::security::seal::configure_nonce(sealed.as_deref())
        });
        let ctx = TransitionContext {
            operation_id: operation_id.clone(),
            deadline: deadline.unwrap_or_else(|| Instant::now() + timeout),
            cancel: self.abandon.child_token(),
            host_log,
            configure_nonce,
            refusal: Default::default(),
        };
        let machine_id = machine.id.clone();
        self.tasks.spawn(async move {
            let started = std::time::Instant::now();
            let backend = engine.backend.clone();
            let task_ctx = ctx.clone();
            // The backend runs in its own task so a backend that ignores cancellation can still
            // finish late; its late result is then discarded as stale (a host it names was
            // recorded by the Create as soon as the substrate gave it, see `host_sink`).
            let mut handle = tokio::spawn(async move { run_backend(&*backend, &machine, &task_ctx, work).await });
            let (outcome, pending) = tokio::select! {
                biased;
                _ = engine.abandon.cancelled() => {
                    // Shutdown grace ran out: leave the slot transitional in the store so the
                    // next start resumes (or fails) it.
                    return;
                }
                joined = &mut handle => (match joined {
                    Ok(result) => result.map_err(|e| e.0),
                    Err(_) => Err(format!("{kind} transition aborted: the backend panicked")),
                }, None),
                _ = tokio::time::sleep_until(ctx.deadline) => {
                    ctx.cancel.cancel();
                    (Err(format!(
                        "{kind} transition timed out after {}: context deadline exceeded",
                        duration::format(timeout)
                    )), Some(handle))
                },
            };
            if outcome.is_err() && engine.abandon.is_cancelled() {
                // The error is the abandonment itself, not the substrate's answer.
                return;
            }
            let timed_out = pending.is_some() || (outcome.is_err() && Instant::now() >= ctx.deadline);
            // A Create the substrate refused without making anything gives its slot back.
            let refusal = ctx.refusal().filter(|_| kind == OperationKind::Create && !timed_out && outcome.is_err());
            let refused = refusal.is_some();
            let ok = outcome.is_ok();
            match &outcome {
                Err(message) if refused => {
                    tracing::warn!(machine_id, kind = kind.name(), operation_id, error = %message, "create refused by the cloud without a host; the machine id ends FAILED and its capacity comes back under a new one");
                }
                Err(message) => {
                    tracing::warn!(machine_id, kind = kind.name(), operation_id, error = %message, "providerkit: transition failed");
                }
                Ok(_) => {}
            }
            engine.options.telemetry.transition(
                kind.name(),
                if ok { "success" } else if refused { "returned" } else if timed_out { "timeout" } else { "error" },
                started.elapsed(),
            );
            match outcome {
                Err(message) if refused => {
                    let reason = match refusal.map(|r| r.kind) {
                        Some(RefusalKind::AccountLimit) => RetireReason::AccountLimit,
                        _ => RetireReason::Stockout,
                    };
                    engine.finish_returned(&machine_id, &operation_id, reason, message).await;
                }
                outcome => {
                    engine.finish(&machine_id, kind, &operation_id, outcome).await;
                    // A slot a Delete gave back counts against the account's headroom.
                    if kind == OperationKind::Delete && engine.backend.speculative_cap().is_some() {
                        let _ = engine.fit_offers().await;
                    }
                }
            }
            if let Some(handle) = pending {
                // The backend ignored the cancellation: let its result arrive and be discarded
                // by the stale check (what it created, it has recorded on the way).
                let late_engine = engine.clone();
                let op = operation_id.clone();
                tokio::spawn(async move {
                    if let Ok(Ok(effect)) = handle.await {
                        late_engine.finish(&machine_id, kind, &op, Ok(effect)).await;
                    }
                });
            }
        });
    }

    /// The sink a Create's backend hands each host the substrate names for the machine
    /// ([`TransitionContext::record_host`]): the host goes into the machine's record, durably,
    /// before the backend goes on. On a Create that already failed (its deadline passed while
    /// the substrate was still answering) the host is recorded on the FAILED record, so an
    /// operator or reconcile can delete it.
    fn host_sink(
        self: &Arc<Self>,
        machine_id: &str,
        operation_id: &str,
    ) -> crate::provisioning::backend::HostSink {
        let engine = Arc::downgrade(self);
        let machine_id = machine_id.to_owned();
        let operation_id = operation_id.to_owned();
        Arc::new(move |host| {
            let engine = engine.clone();
            let machine_id = machine_id.clone();
            let operation_id = operation_id.clone();
            Box::pin(async move {
                let Some(engine) = engine.upgrade() else {
                    return Err("the provider is shutting down".to_owned());
                };
                engine
                    .record_created_host(&machine_id, &operation_id, host)
                    .await
            })
        })
    }

    async fn record_created_host(
        &self,
        machine_id: &str,
        operation_id: &str,
        host: crate::rules::machine::HostRef,
    ) -> Result<(), String> {
        if self.store_failed.load(Ordering::SeqCst) {
            return Err("the state store refuses writes (an earlier commit failed, or this replica no longer leads)".into());
        }
        let (recorded, commit) = self.apply(|inv, changes| {
            inv.record_created_host(machine_id, operation_id, host.clone(), changes)
        });
        self.commit(commit).await.map_err(|e| e.to_string())?;
        match recorded {
            HostRecord::Recorded => {
                tracing::info!(
                    machine_id,
                    operation_id,
                    host = host.id,
                    "host recorded for the Create in flight"
                );
                Ok(())
            }
            HostRecord::Unchanged => Ok(()),
            HostRecord::OnFailed => {
                tracing::warn!(
                    machine_id,
                    operation_id,
                    host = host.id,
                    "host recorded on the machine its Create left FAILED; `admin failed release` deletes it, as does reconcile after --orphan-grace"
                );
                Ok(())
            }
            HostRecord::Refused(why) => Err(why),
        }
    }

    async fn finish(
        &self,
        machine_id: &str,
        kind: OperationKind,
        operation_id: &str,
        outcome: Result<Effect, String>,
    ) {
        let (applied, commit) = self
            .apply(|inv, changes| inv.complete(machine_id, kind, operation_id, outcome, changes));
        if !applied {
            tracing::debug!(
                machine_id,
                kind = kind.name(),
                operation_id,
                "discarded stale completion"
            );
        }
        let _ = self.commit(commit).await;
    }

    /// A Create refused without a host: the machine id ends FAILED and its capacity comes
    /// back under a new id (see [`Inventory::return_created`]), and in the same change the
    /// slots are fitted to what is offered now, so the new slot of a withdrawn offering is
    /// hidden from List from the moment it exists.
    async fn finish_returned(
        &self,
        machine_id: &str,
        operation_id: &str,
        reason: RetireReason,
        message: String,
    ) {
        let offer = self.backend.offer();
        let cap = self.backend.speculative_cap();
        let now = unix_seconds();
        let (applied, commit) = self.apply(|inv, changes| {
            let applied =
                inv.return_created(machine_id, operation_id, reason, message, now, changes);
            if let Some(offer) = &offer {
                inv.fit_offered(offer, cap, now, changes);
            }
            applied
        });
        match applied {
            None => tracing::debug!(machine_id, operation_id, "discarded stale completion"),
            Some(successor) if !successor.is_empty() => {
                tracing::info!(
                    machine_id,
                    operation_id,
                    successor,
                    reason = reason.name(),
                    "the refused Create's capacity comes back under a new machine id"
                )
            }
            Some(_) => {}
        }
        let _ = self.commit(commit).await;
    }

    /// Fits the Speculative slots without a host to what the backend offers now and to its cap
    /// (see [`Inventory::fit_offered`]): a withdrawn offering's slots are hidden from List, those
    /// of one sold again are listed again, and no more are listed than the account's headroom.
    /// No I/O but the commit.
    pub async fn fit_offers(&self) -> Result<Fitted, CoreError> {
        if self.store_failed.load(Ordering::SeqCst) || !self.is_accepting() {
            return Ok(Fitted::default());
        }
        let Some(offer) = self.backend.offer() else {
            return Ok(Fitted::default());
        };
        let cap = self.backend.speculative_cap();
        let now = unix_seconds();
        let (fitted, commit) =
            self.apply(|inv, changes| inv.fit_offered(&offer, cap, now, changes));
        self.commit(commit).await?;
        if fitted.changed() {
            tracing::info!(
                removed = fitted.removed,
                added = fitted.added,
                hidden = fitted.hidden,
                shown = fitted.shown,
                cap = cap.map_or(-1, |c| c as i64),
                "offered slots fitted to the offerings sold now and to the account's headroom"
            );
        }
        Ok(fitted)
    }

    /// Follows what the backend offers: fits the slots now, whenever the backend says its offer
    /// changed, and when a backoff it reported ends; stops at shutdown or step-down.
    fn spawn_offer_watch(self: &Arc<Self>) {
        let Some(mut changes) = self.backend.offer_changes() else {
            return;
        };
        let engine = Arc::downgrade(self);
        let stop = self.offer_watch.clone();
        tokio::spawn(async move {
            loop {
                let next = {
                    let Some(engine) = engine.upgrade() else {
                        return;
                    };
                    changes.mark_unchanged();
                    if let Err(e) = engine.fit_offers().await {
                        tracing::warn!(err = %e, "fitting the offered slots failed");
                    }
                    engine.backend.next_offer_change()
                };
                let review = async {
                    match next {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    _ = stop.cancelled() => return,
                    changed = changes.changed() => if changed.is_err() { return },
                    _ = review => {}
                }
            }
        });
    }

    /// Graceful shutdown: refuse new mutations, wait up to `grace` for in-flight transitions,
    /// then stop waiting (unfinished ones stay transitional and are resumed on the next start)
    /// and flush the store.
    pub async fn shutdown(&self, grace: Duration) -> usize {
        self.accepting.store(false, Ordering::SeqCst);
        self.offer_watch.cancel();
        self.tasks.close();
        let unfinished = if tokio::time::timeout(grace, self.tasks.wait())
            .await
            .is_err()
        {
            let n = self.tasks.len();
            self.abandon.cancel();
            self.tasks.wait().await;
            n
        } else {
            0
        };
        if let Err(e) = self.store.flush().wait().await {
            tracing::error!(error = %e, "state store flush failed at shutdown");
        }
        unfinished
    }

    /// This replica no longer holds the state (its claim in etcd is gone): acknowledge nothing
    /// more and stop in-flight transitions where they are, without writing (the next leader
    /// resumes them under their operation ids). Reads keep answering from memory.
    pub fn step_down(&self) {
        self.store_failed.store(true, Ordering::SeqCst);
        self.offer_watch.cancel();
        self.durability.stop();
        self.tasks.close();
        self.abandon.cancel();
    }

    /// Whether mutations are still accepted.
    pub fn is_accepting(&self) -> bool {
        self.accepting.load(Ordering::SeqCst)
    }

    /// In-flight transitions.
    pub fn in_flight(&self) -> usize {
        self.tasks.len()
    }
}

async fn run_backend(
    backend: &dyn Backend,
    machine: &Machine,
    ctx: &TransitionContext,
    work: Work,
) -> Result<Effect, BackendError> {
    match work {
        Work::Create => {
            let effect = backend.create(machine, ctx).await?;
            match &effect.host {
                Some(host) if !host.is_empty() => Ok(effect),
                _ => Err(BackendError::new(
                    "CreateInstance returned no host for a created machine",
                )),
            }
        }
        Work::Configure(order) => {
            backend.configure(machine, &order, ctx).await?;
            backend
                .confirm_ready(machine, &order.cluster_id, ctx)
                .await
                .map_err(|e| BackendError(format!("node readiness: {e}")))?;
            Ok(Effect::default())
        }
        Work::Drain {
            grace_period_seconds,
        } => backend
            .drain(machine, grace_period_seconds, ctx)
            .await
            .map(|()| Effect::default()),
        Work::Delete => backend
            .delete(machine, ctx)
            .await
            .map(|()| Effect::default()),
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
pub(crate) mod test_support;

#[cfg(test)]
mod list_tests;

#[cfg(test)]
mod release_tests;

#[cfg(test)]
mod limits_tests;

#[cfg(test)]
mod host_record_tests;

#[cfg(test)]
mod acknowledged_tests;

#[cfg(test)]
mod stockout_tests;

#[cfg(test)]
mod shard_model_tests;

//! The seam between the contract engine and a substrate: what a backend must do for each
//! transition, the optional Delete capability and readiness gate, and the field-shape rules
//! every record it reports must satisfy (contract.md §9, §12, §14).

use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::rules::inventory::{Effect, Survey};
use crate::rules::machine::{CapacityType, HostRef, Machine, MachineState, StringMap};

/// The budget of one transition, handed to the backend with every call.
#[derive(Clone, Debug)]
pub struct TransitionContext {
    /// The operation id, usable as a substrate idempotency key.
    pub operation_id: String,
    /// When the engine stops waiting and fails the transition.
    pub deadline: Instant,
    /// Cancelled when the deadline passes or the provider gives up on the work.
    pub cancel: CancellationToken,
    /// Where a Create records the host the substrate gave it (see
    /// [`TransitionContext::record_host`]).
    pub host_log: HostLog,
    /// For a Configure, what tells it apart from every other Configure on any host, even one
    /// under the same operation id after a state was lost and its ids started again, while
    /// every process that resumes it gets the same value: a digest of its sealed record in the
    /// state (drawn at random when it was accepted, [`crate::security::seal::configure_nonce`]), or,
    /// for a Configure the state does not keep (no `--state-encryption-key-file`), which no
    /// process ever resumes, a random value drawn when it starts. 16 lower-case hex digits,
    /// nothing secret. `None` for other transitions and outside the engine.
    pub configure_nonce: Option<String>,
    /// Where a Create notes that the cloud refused it before making anything (see
    /// [`TransitionContext::refuse`]).
    pub refusal: RefusalNote,
}

impl TransitionContext {
    /// Time left before the deadline.
    pub fn remaining(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    /// A context for work outside a transition (admin release, tests): nothing records hosts.
    pub fn with_timeout(operation_id: impl Into<String>, timeout: Duration) -> TransitionContext {
        TransitionContext {
            operation_id: operation_id.into(),
            deadline: Instant::now() + timeout,
            cancel: CancellationToken::new(),
            host_log: HostLog::default(),
            configure_nonce: None,
            refusal: RefusalNote::default(),
        }
    }

    /// Notes that the cloud refused this Create for a reason that is not the machine's (a
    /// stockout, the account's limit) and provably made nothing. The Create then returns an
    /// error as usual; the engine, seeing the note and no recorded host, returns the slot to
    /// Speculative with the error as its `last_error` instead of failing it. Only for an
    /// answer that proves nothing was created: a lost or ambiguous answer is never a refusal.
    pub fn refuse(&self, refusal: Refusal) {
        *self.refusal.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(refusal);
    }

    /// The refusal noted by [`TransitionContext::refuse`], if any.
    pub fn refusal(&self) -> Option<Refusal> {
        *self.refusal.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes the host id `id` (a server id, a Droplet id) part of the machine's durable
    /// record before the Create sends anything else: called the moment the substrate names the
    /// host (a create call's answer, or the look-up that finds a previous attempt's host), so
    /// that whatever happens next (a deadline, a 429 storm, a restart) leaves the machine with
    /// its host, never without it while it runs. An error means the record could not be made
    /// durable; the Create should stop (a later attempt finds the host by its labels).
    pub async fn record_host(&self, id: &str) -> Result<(), BackendError> {
        let Some(sink) = &self.host_log.sink else {
            return Ok(());
        };
        let host = HostRef {
            provider: self.host_log.provider.clone(),
            id: id.to_owned(),
        };
        sink(host)
            .await
            .map_err(|e| BackendError(format!("record host {id} in the machine's record: {e}")))
    }

    /// This context with hosts recorded under `provider` (the `HostRef.provider` the
    /// backend reports).
    pub fn with_host_provider(&self, provider: &str) -> TransitionContext {
        let mut ctx = self.clone();
        ctx.host_log.provider = provider.to_owned();
        ctx
    }
}

/// Why a cloud refused a Create without making anything.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RefusalKind {
    /// The type cannot be placed in the zone now (sold out, no capacity, not offered there):
    /// the offering is withdrawn for a backoff.
    Stockout,
    /// The account holds as many hosts as its limit allows: what is advertised is capped to
    /// the headroom.
    AccountLimit,
}

impl RefusalKind {
    /// The name used in metrics and `last_error`.
    pub fn name(self) -> &'static str {
        match self {
            RefusalKind::Stockout => "stockout",
            RefusalKind::AccountLimit => "account_limit",
        }
    }
}

/// A refusal of a Create (see [`TransitionContext::refuse`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub kind: RefusalKind,
    /// The cloud's error code (`resource_unavailable`, `resource_limit_exceeded`,
    /// `unprocessable_entity`, or ours, `withdrawn`): a bounded set, used as a metric label.
    pub code: &'static str,
    /// For [`RefusalKind::AccountLimit`]: how many hosts the account held when it was refused,
    /// when the cloud could tell (the limit is then that number).
    pub account_hosts: Option<u64>,
}

impl Refusal {
    pub fn stockout(code: &'static str) -> Refusal {
        Refusal {
            kind: RefusalKind::Stockout,
            code,
            account_hosts: None,
        }
    }

    pub fn account_limit(code: &'static str, account_hosts: Option<u64>) -> Refusal {
        Refusal {
            kind: RefusalKind::AccountLimit,
            code,
            account_hosts,
        }
    }
}

/// The cell a Create's refusal is noted in, shared by every clone of its context.
#[derive(Clone, Debug, Default)]
pub struct RefusalNote(std::sync::Arc<std::sync::Mutex<Option<Refusal>>>);

/// How long after a Create's deadline its look-up for a host a cut-short create call may have
/// made still runs (see [`after_deadline`]).
pub const LATE_LOOK_UP: Duration = Duration::from_secs(60);

/// The deadline of a look-up for a host a create call may have made although it failed (its
/// answer lost, or cut short by the transition's deadline): the transition's `deadline`, or
/// [`LATE_LOOK_UP`] from now if that is later. A host it finds is recorded on the machine
/// ([`TransitionContext::record_host`]), which by then may be FAILED, so no failure leaves a
/// host the cloud made running without its machine.
pub fn after_deadline(deadline: Instant) -> Instant {
    deadline.max(Instant::now() + LATE_LOOK_UP)
}

/// Records a host in the durable record of the machine a Create is for.
pub type HostSink = std::sync::Arc<
    dyn Fn(HostRef) -> futures_util::future::BoxFuture<'static, Result<(), String>> + Send + Sync,
>;

/// The engine's end of [`TransitionContext::record_host`]: empty outside a Create.
#[derive(Clone, Default)]
pub struct HostLog {
    /// Set by the engine for a Create.
    pub sink: Option<HostSink>,
    /// The `HostRef.provider` of recorded hosts.
    pub provider: String,
}

impl HostLog {
    /// A log that hands every host to `sink`.
    pub fn new(sink: HostSink) -> HostLog {
        HostLog {
            sink: Some(sink),
            provider: String::new(),
        }
    }
}

impl std::fmt::Debug for HostLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostLog")
            .field("recording", &self.sink.is_some())
            .field("provider", &self.provider)
            .finish()
    }
}

/// The opaque cluster-join blob. Never printed: Debug shows only its length. The buffer is
/// zeroed when the value is dropped (copies a backend makes are its own to zero).
#[derive(Clone, Default)]
pub struct BootstrapBlob(pub Vec<u8>);

impl zeroize::Zeroize for BootstrapBlob {
    fn zeroize(&mut self) {
        self.0.zeroize();
    }
}

impl Drop for BootstrapBlob {
    fn drop(&mut self) {
        zeroize::Zeroize::zeroize(self);
    }
}

impl zeroize::ZeroizeOnDrop for BootstrapBlob {}

impl std::fmt::Debug for BootstrapBlob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BootstrapBlob([redacted; {} bytes])", self.0.len())
    }
}

/// A Configure as the backend sees it.
#[derive(Clone, Debug)]
pub struct ConfigureOrder {
    pub cluster_id: String,
    pub blob: BootstrapBlob,
}

/// A backend failure: its text becomes the machine's `last_error`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BackendError(pub String);

impl BackendError {
    pub fn new(message: impl Into<String>) -> BackendError {
        BackendError(message.into())
    }
}

impl From<String> for BackendError {
    fn from(message: String) -> BackendError {
        BackendError(message)
    }
}

/// What a substrate does for the engine. Backends never see fence tokens.
#[async_trait]
pub trait Backend: Send + Sync + 'static {
    /// The full inventory: every offered slot and every owned host (seeding and reconcile).
    async fn describe(&self) -> Result<Vec<Machine>, BackendError>;

    /// What a reconcile pass reads: the records and, when the backend can list them, every
    /// owned host (duplicates included, so none goes unnoticed).
    async fn survey(&self) -> Result<Survey, BackendError> {
        Ok(Survey {
            machines: self.describe().await?,
            hosts: None,
        })
    }

    /// A direct read of one host, the proof a reconcile pass needs before it treats a host
    /// missing from a listing as gone: `Some(false)` when the substrate answers that it does not
    /// exist (or is being deleted), `Some(true)` when it exists, `None` when the backend cannot
    /// read one host (absence in consecutive passes is then the proof).
    async fn host_present(
        &self,
        _machine_id: &str,
        _host: &HostRef,
    ) -> Result<Option<bool>, BackendError> {
        Ok(None)
    }

    /// The hosts the substrate holds for one machine, read directly for that machine;
    /// `None` when the backend has no such read (a survey is then the fallback).
    async fn machine_hosts(&self, _machine_id: &str) -> Result<Option<Vec<HostRef>>, BackendError> {
        Ok(None)
    }

    /// The slots the offerings sold now allow, one record per slot named by its position
    /// (`<provider>/OnDemand/<type>/<zone>/<index>`), computed without any I/O: what a test or
    /// an operator's tool inspects of what is sold. The engine does not list these ids: it fits
    /// its own slots to [`Backend::offer`]. `None` means the backend has no offerings.
    fn offered(&self) -> Option<Vec<Machine>> {
        None
    }

    /// The ids of [`Backend::offered`]; a backend whose offered slots are many overrides it to
    /// skip building their records.
    fn offered_ids(&self) -> Option<std::collections::HashSet<String>> {
        self.offered()
            .map(|offered| offered.into_iter().map(|m| m.id).collect())
    }

    /// Every configured offering with the shape of its Speculative slots, how many machines
    /// it holds and whether it is sold now, computed without any I/O; the engine fits the
    /// slots to it (see [`crate::inventory::Inventory::fit_offered`]), minting the ids of new
    /// slots itself. `None` means the backend has no offerings: its Describe names every slot.
    fn offer(&self) -> Option<Vec<crate::rules::inventory::OfferGroup>> {
        None
    }

    /// The most Speculative slots to list now (the account's headroom); `None`: no cap beyond
    /// [`Backend::offered`]. The engine keeps the Speculative slots without a host at or below
    /// it.
    fn speculative_cap(&self) -> Option<usize> {
        None
    }

    /// Ticks whenever [`Backend::offered`] or [`Backend::speculative_cap`] may have changed
    /// other than by the clock (a stockout, a probe's end): the engine then fits its slots at
    /// once. `None` when they never change between reconcile passes.
    fn offer_changes(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        None
    }

    /// When the clock next changes what is offered (a stockout's backoff ends).
    fn next_offer_change(&self) -> Option<Instant> {
        None
    }

    /// Speculative -> Idle: create (or find) the host. Must be idempotent on the machine id.
    /// A Create the substrate refused without making anything, for a reason that is not the
    /// machine's, notes it with [`TransitionContext::refuse`]: the slot then goes back to
    /// Speculative instead of FAILED.
    async fn create(
        &self,
        machine: &Machine,
        ctx: &TransitionContext,
    ) -> Result<Effect, BackendError>;

    /// Idle -> Configured: deliver the blob and run the bootstrap hook.
    async fn configure(
        &self,
        machine: &Machine,
        order: &ConfigureOrder,
        ctx: &TransitionContext,
    ) -> Result<(), BackendError>;

    /// Whether [`Backend::confirm_ready`] really observes node readiness (ADR-0056).
    fn has_readiness_gate(&self) -> bool {
        false
    }

    /// Runs after a successful configure, within the same deadline, while the machine stays
    /// Configuring.
    async fn confirm_ready(
        &self,
        _machine: &Machine,
        _cluster_id: &str,
        _ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        Ok(())
    }

    /// Configured -> Idle: drain the node within the grace period and drop the binding.
    async fn drain(
        &self,
        machine: &Machine,
        grace_period_seconds: i64,
        ctx: &TransitionContext,
    ) -> Result<(), BackendError>;

    /// Whether Delete is supported at all (bare-metal free pools do not delete).
    fn supports_delete(&self) -> bool {
        true
    }

    /// Idle -> Speculative: delete the host. A host that is already gone is a success.
    async fn delete(&self, machine: &Machine, ctx: &TransitionContext) -> Result<(), BackendError>;
}

/// Checks the field-shape rules of a reported record, in the reference's order, and returns the
/// first broken rule as `<id>: <rule>`.
pub fn validate(machine: &Machine, require_zone: bool) -> Result<(), String> {
    let fail = |rule: &str| Err(format!("{}: {rule}", machine.id));
    if machine.id.is_empty() {
        return Err("id is required".into());
    }
    if machine.instance_type.is_empty() {
        return fail("instance_type is required (never labels-only)");
    }
    if machine.capacity_type == CapacityType::Unspecified {
        return fail("capacity_type is required");
    }
    if require_zone && machine.zone.is_empty() {
        return fail("zone is required");
    }
    if machine.price_per_hour.is_nan() || machine.price_per_hour < 0.0 {
        return fail("price_per_hour must be a non-negative number");
    }
    let p = machine.interruption_probability;
    if p.is_nan() || !(0.0..=1.0).contains(&p) {
        return fail("interruption_probability must be within [0,1]");
    }
    if machine.capacity_type == CapacityType::Spot && p <= 0.0 {
        return fail("SPOT capacity requires interruption_probability > 0");
    }
    match (
        machine.state,
        machine.host.as_ref().is_some_and(|h| !h.is_empty()),
    ) {
        (MachineState::Speculative, false) | (MachineState::Idle, true) => Ok(()),
        (MachineState::Speculative, true) => fail("a Speculative record must not carry a host"),
        (MachineState::Idle, false) => fail("an Idle record must carry a host"),
        (state, _) => fail(&format!(
            "a reported record may only be Speculative or Idle, not {state}"
        )),
    }
}

/// Renders `cpu`/`memory` allocatable from vCPUs and MiB: whole GiB as `<N>Gi`, else `<N>Mi`.
pub fn allocatable_of(vcpus: u32, memory_mib: u64) -> StringMap {
    let memory = if memory_mib.is_multiple_of(1024) {
        format!("{}Gi", memory_mib / 1024)
    } else {
        format!("{memory_mib}Mi")
    };
    StringMap::from([
        ("cpu".to_owned(), vcpus.to_string()),
        ("memory".to_owned(), memory),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::machine::HostRef;

    fn good() -> Machine {
        let mut m = Machine::speculative("m-1", "cx22");
        m.zone = "nbg1".into();
        m
    }

    #[test]
    fn validation_reports_the_first_broken_rule() {
        assert_eq!(validate(&good(), true), Ok(()));
        type Breaker = Box<dyn Fn(&mut Machine)>;
        let cases: Vec<(Breaker, &str)> = vec![
            (
                Box::new(|m| m.instance_type.clear()),
                "m-1: instance_type is required (never labels-only)",
            ),
            (
                Box::new(|m| m.capacity_type = CapacityType::Unspecified),
                "m-1: capacity_type is required",
            ),
            (Box::new(|m| m.zone.clear()), "m-1: zone is required"),
            (
                Box::new(|m| m.price_per_hour = f64::NAN),
                "m-1: price_per_hour must be a non-negative number",
            ),
            (
                Box::new(|m| m.price_per_hour = -1.0),
                "m-1: price_per_hour must be a non-negative number",
            ),
            (
                Box::new(|m| m.interruption_probability = 1.5),
                "m-1: interruption_probability must be within [0,1]",
            ),
            (
                Box::new(|m| m.capacity_type = CapacityType::Spot),
                "m-1: SPOT capacity requires interruption_probability > 0",
            ),
            (
                Box::new(|m| {
                    m.host = Some(HostRef {
                        provider: "p".into(),
                        id: "1".into(),
                    })
                }),
                "m-1: a Speculative record must not carry a host",
            ),
            (
                Box::new(|m| m.state = MachineState::Idle),
                "m-1: an Idle record must carry a host",
            ),
            (
                Box::new(|m| m.state = MachineState::Configured),
                "m-1: a reported record may only be Speculative or Idle, not Configured",
            ),
        ];
        for (breaker, message) in cases {
            let mut m = good();
            breaker(&mut m);
            assert_eq!(validate(&m, true), Err(message.to_owned()));
        }
        let mut m = good();
        m.price_per_hour = f64::INFINITY;
        assert_eq!(
            validate(&m, true),
            Ok(()),
            "+Inf passes as in the reference"
        );
        m.zone.clear();
        assert_eq!(validate(&m, false), Ok(()));
    }

    #[test]
    fn allocatable_rendering() {
        assert_eq!(allocatable_of(2, 4096)["memory"], "4Gi");
        assert_eq!(allocatable_of(2, 1500)["memory"], "1500Mi");
        assert_eq!(allocatable_of(3, 1024)["cpu"], "3");
    }
}

#[cfg(test)]
mod secret_tests {
    use zeroize::{Zeroize, ZeroizeOnDrop};

    use super::*;

    fn zeroed_on_drop<T: ZeroizeOnDrop>() {}

    #[test]
    fn the_blob_never_prints_and_is_zeroed() {
        zeroed_on_drop::<BootstrapBlob>();
        let mut order = ConfigureOrder {
            cluster_id: "c1".into(),
            blob: BootstrapBlob(b"kubeadm join --token abcdef.0123456789abcdef".to_vec()),
        };
        let printed = format!("{order:?} {order:#?} {:?}", order.blob);
        assert!(!printed.contains("abcdef"), "{printed}");
        assert!(printed.contains("[redacted; 44 bytes]"), "{printed}");
        order.blob.zeroize();
        assert!(order.blob.0.is_empty());
    }
}

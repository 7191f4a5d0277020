//! What this process is allowed to do right now. A provider with a local or in-memory state is
//! the only replica and always serves. With `--state etcd://…` several replicas share one
//! prefix and exactly one of them leads (docs/ha.md):
//!
//! | Role | Mutations | Get, List | gRPC health, `/readyz`, bootstrap channel |
//! |---|---|---|---|
//! | single | engine | engine | SERVING, 200, served |
//! | leader, claim held | engine | engine | SERVING, 200, served |
//! | leader whose claim lapsed, or that stepped down: etcd unreachable for it | UNAVAILABLE | UNAVAILABLE | NOT_SERVING, 503, 503 (a standby) |
//! | degraded: the same, while a majority of the etcd members refuse connections | UNAVAILABLE | engine (memory) | SERVING, 200, served |
//! | standby | UNAVAILABLE | UNAVAILABLE | NOT_SERVING, 503, 503 |
//!
//! The claim's validity is a monotonic deadline ([`HoldCheck`], the same check every commit
//! makes), consulted per request by the mutation and read gates, gRPC health and `/readyz`: a
//! leader paused or cut off past its lease answers as a standby from its first instruction
//! after it runs again, before the replica loop notices. Reads are answered from memory
//! without a claim only with positive evidence that no etcd quorum exists for anyone
//! ([`OutageCheck`]: a majority of the configured members actively refusing connections).
//! Silence — timeouts, which is what a partition from etcd looks like while the others still
//! have a quorum and another replica may lead — is no such evidence.
//!
//! A standby never answers FAILED_PRECONDITION: the shard reads that as a zombie.

use std::sync::{Arc, RwLock};

use tonic::Status;

use crate::observability::telemetry::Telemetry;
use crate::rules::records::Snapshot;
use crate::runtime::engine::Engine;

/// A replica's role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The only replica (local or in-memory state).
    Single,
    /// Holds the claim on the etcd prefix and serves.
    Leader,
    /// Led, then lost etcd or its claim: answers reads from memory, acknowledges nothing.
    Degraded,
    /// Follows the prefix and waits for the claim.
    Standby,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Single => "single",
            Role::Leader => "leader",
            Role::Degraded => "degraded",
            Role::Standby => "standby",
        }
    }

    /// Whether this role answers reads and passes readiness.
    pub fn serves(self) -> bool {
        !matches!(self, Role::Standby)
    }
}

/// A flag that side servers (the DigitalOcean bootstrap channel) consult per request: set
/// while this replica serves (always for a single replica). Side servers also wait on it to
/// close their connections when the replica stops serving.
///
/// It is also the one handle the binary shares with its replica before anything starts, so it
/// carries the binary's takeover hooks ([`Leading::on_takeover`]).
#[derive(Clone)]
pub struct Leading(
    Arc<tokio::sync::watch::Sender<bool>>,
    Arc<std::sync::Mutex<Vec<TakeoverHook>>>,
    /// The replica the flag belongs to, asked per request whether it serves at this instant.
    Arc<std::sync::OnceLock<std::sync::Weak<Replica>>>,
);

/// Called with the state a new term starts on, before its engine starts.
pub type TakeoverHook = Box<dyn Fn(&Snapshot) + Send + Sync>;

impl std::fmt::Debug for Leading {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Leading").field(&self.get()).finish()
    }
}

impl Default for Leading {
    fn default() -> Leading {
        Leading(
            Arc::new(tokio::sync::watch::channel(false).0),
            Arc::default(),
            Arc::default(),
        )
    }
}

impl Leading {
    /// Registers `hook`, called with the state each term of a replicated provider starts on,
    /// before its engine starts, and with the state a single provider started on (the fake
    /// backend's cloud takes the hosts the state records, as a real cloud keeps them across a
    /// failover or a restart).
    pub fn on_takeover(&self, hook: impl Fn(&Snapshot) + Send + Sync + 'static) {
        self.1
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(Box::new(hook));
    }

    /// A process restarted on a stored state continues it as a new leader would: the hooks see
    /// the stored state before the engine starts, so no resumed transition reaches the cloud
    /// the hooks prepare (the fake cloud) before it holds the recorded hosts.
    pub fn before_start(&self, store: &dyn crate::persistence::store::Store) -> Result<(), String> {
        if self.has_takeover_hooks() {
            let snapshot = store.load().map_err(|e| e.0)?;
            if !snapshot.is_fresh() {
                self.taking_over(&snapshot);
            }
        }
        Ok(())
    }

    fn has_takeover_hooks(&self) -> bool {
        !self
            .1
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_empty()
    }

    fn taking_over(&self, snapshot: &Snapshot) {
        for hook in self
            .1
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
        {
            hook(snapshot);
        }
    }

    /// Whether the replica serves right now: its role does, and (for a leader) its claim is
    /// still valid at this instant, as for gRPC health and `/readyz`.
    pub fn get(&self) -> bool {
        *self.0.borrow()
            && self
                .2
                .get()
                .and_then(std::sync::Weak::upgrade)
                .is_none_or(|replica| replica.serves_now())
    }

    /// The engine of the term this replica leads now, while it serves (a side server's way to
    /// read and record state of its own, such as an agent's enrollment).
    pub fn engine(&self) -> Option<Arc<Engine>> {
        if !self.get() {
            return None;
        }
        self.2
            .get()
            .and_then(std::sync::Weak::upgrade)
            .and_then(|replica| replica.writer().ok())
    }

    /// Set by the replica as its role changes (public for side servers' tests).
    pub fn set(&self, leading: bool) {
        self.0
            .send_if_modified(|current| std::mem::replace(current, leading) != leading);
    }

    /// Resolves once this replica does not serve (at once if it does not now).
    pub async fn lost(&self) {
        let mut changes = self.0.subscribe();
        // The sender lives in `self`, so the wait cannot fail.
        let _ = changes.wait_for(|leading| !leading).await;
    }
}

/// May the leader still commit? (Its claim was confirmed by a keep-alive recently enough.)
pub type HoldCheck = Arc<dyn Fn() -> bool + Send + Sync>;

/// Is there positive evidence that no etcd quorum exists for anyone right now (so no other
/// replica can lead either, and reads from memory show the last committed state)?
pub type OutageCheck = Arc<dyn Fn() -> bool + Send + Sync>;

struct Current {
    role: Role,
    engine: Option<Arc<Engine>>,
    hold: Option<HoldCheck>,
    outage: Option<OutageCheck>,
}

impl Current {
    fn claim_held(&self) -> bool {
        self.hold.as_ref().is_none_or(|held| held())
    }

    fn etcd_down_for_all(&self) -> bool {
        self.outage.as_ref().is_some_and(|down| down())
    }

    /// Whether this replica answers reads and passes health and readiness at this instant.
    fn serves_now(&self) -> bool {
        match self.role {
            Role::Single => true,
            Role::Leader => self.claim_held() || self.etcd_down_for_all(),
            Role::Degraded => self.etcd_down_for_all(),
            Role::Standby => false,
        }
    }
}

/// The engine this process serves with, if any, and its role.
pub struct Replica {
    current: RwLock<Current>,
    /// Set while this replica's copy of the state follows etcd (a warm standby).
    warm: Arc<std::sync::atomic::AtomicBool>,
    telemetry: Telemetry,
    leading: Leading,
    changed: tokio::sync::watch::Sender<Role>,
}

impl std::fmt::Debug for Replica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replica")
            .field("role", &self.role())
            .finish_non_exhaustive()
    }
}

fn unavailable(role: Role) -> Status {
    match role {
        Role::Standby => Status::unavailable(
            "this replica is a standby: another replica leads the state (retry; the Service \
             routes to the leader)",
        ),
        _ => Status::unavailable(
            "this replica lost its claim on the state in etcd (etcd unreachable or the lease \
             ran out): nothing is answered as the leader until it leads again (retry; the \
             Service routes to the leader)",
        ),
    }
}

impl Replica {
    /// The only replica, serving with `engine`.
    pub fn single(engine: Arc<Engine>) -> Arc<Replica> {
        Replica::single_with(engine, Leading::default())
    }

    /// The only replica, serving with `engine`; sets `leading`.
    pub fn single_with(engine: Arc<Engine>, leading: Leading) -> Arc<Replica> {
        let telemetry = engine.options().telemetry;
        leading.set(true);
        telemetry.leader(true);
        Replica::gated(Replica {
            current: RwLock::new(Current {
                role: Role::Single,
                engine: Some(engine),
                hold: None,
                outage: None,
            }),
            warm: Arc::default(),
            telemetry,
            leading,
            changed: tokio::sync::watch::channel(Role::Single).0,
        })
    }

    /// A replica that starts as a standby (etcd state); `leading` is set while it serves.
    pub fn standby(telemetry: Telemetry, leading: Leading) -> Arc<Replica> {
        leading.set(false);
        telemetry.leader(false);
        Replica::gated(Replica {
            current: RwLock::new(Current {
                role: Role::Standby,
                engine: None,
                hold: None,
                outage: None,
            }),
            warm: Arc::default(),
            telemetry,
            leading,
            changed: tokio::sync::watch::channel(Role::Standby).0,
        })
    }

    /// Shares `replica` and lets its [`Leading`] flag ask it per request.
    fn gated(replica: Replica) -> Arc<Replica> {
        let replica = Arc::new(replica);
        let _ = replica.leading.2.set(Arc::downgrade(&replica));
        replica
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Current> {
        self.current.read().unwrap_or_else(|e| e.into_inner())
    }

    pub fn telemetry(&self) -> Telemetry {
        self.telemetry
    }

    pub fn role(&self) -> Role {
        self.read().role
    }

    /// Whether this replica's role answers reads and passes readiness (what the role says;
    /// [`Replica::serves_now`] also checks the claim and the evidence behind it).
    pub fn serves(&self) -> bool {
        self.role().serves()
    }

    /// Whether this replica answers reads and passes gRPC health and `/readyz` at this
    /// instant: a leader whose claim lapsed does not, from the first request after the lapse,
    /// unless etcd is down for everyone (see the module's table).
    pub fn serves_now(&self) -> bool {
        self.read().serves_now()
    }

    /// Whether this replica's copy of the state follows etcd (set by the follower of a
    /// standby; false while it leads or without etcd).
    pub fn warm(&self) -> bool {
        self.warm.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The flag the follower sets.
    pub(crate) fn warmth(&self) -> Arc<std::sync::atomic::AtomicBool> {
        self.warm.clone()
    }

    /// The engine, whatever the role (metrics, shutdown).
    pub fn engine(&self) -> Option<Arc<Engine>> {
        self.read().engine.clone()
    }

    /// The engine for Get and List.
    pub fn reader(&self) -> Result<Arc<Engine>, Status> {
        let current = self.read();
        match &current.engine {
            Some(engine) if current.serves_now() => Ok(engine.clone()),
            _ => Err(unavailable(current.role)),
        }
    }

    /// The engine for a mutation: only while this replica leads with a claim it still holds.
    pub fn writer(&self) -> Result<Arc<Engine>, Status> {
        let current = self.read();
        match (&current.engine, current.role) {
            (Some(engine), Role::Single) => Ok(engine.clone()),
            (Some(engine), Role::Leader) if current.claim_held() => Ok(engine.clone()),
            (_, role) => Err(unavailable(role)),
        }
    }

    /// Waits for the next change of role and returns it.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<Role> {
        self.changed.subscribe()
    }

    fn set(
        &self,
        role: Role,
        engine: Option<Arc<Engine>>,
        hold: Option<HoldCheck>,
        outage: Option<OutageCheck>,
    ) {
        {
            let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
            current.role = role;
            current.engine = engine;
            current.hold = hold;
            current.outage = outage;
        }
        self.leading.set(role.serves());
        self.telemetry.leader(role == Role::Leader);
        self.changed.send_replace(role);
    }

    /// Leads with `engine` while `hold` says the claim is held (reads also while `outage` says
    /// etcd is down for everyone).
    pub(crate) fn lead(&self, engine: Arc<Engine>, hold: HoldCheck, outage: OutageCheck) {
        self.telemetry.store_accepting();
        self.set(Role::Leader, Some(engine), Some(hold), Some(outage));
    }

    /// Keeps answering reads from the engine of the lost term while `outage` holds (etcd down
    /// for everyone), acknowledging nothing.
    pub(crate) fn degrade(&self, outage: OutageCheck) {
        let engine = self.engine();
        self.set(Role::Degraded, engine, None, Some(outage));
    }

    /// Drops the engine and answers UNAVAILABLE to everything.
    pub(crate) fn stand_by(&self) {
        self.set(Role::Standby, None, None, None);
    }

    /// [`Replica::stand_by`] if the role is still degraded (atomically: a term that started
    /// meanwhile is left alone); whether it did.
    pub(crate) fn stand_by_if_degraded(&self) -> bool {
        {
            let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
            if current.role != Role::Degraded {
                return false;
            }
            current.role = Role::Standby;
            current.engine = None;
            current.hold = None;
            current.outage = None;
        }
        self.leading.set(false);
        self.telemetry.leader(false);
        self.changed.send_replace(Role::Standby);
        true
    }

    /// A term is about to start on `snapshot`: runs the hooks the binary registered on its
    /// [`Leading`] (the fake cloud takes the hosts the state records).
    pub(crate) fn taking_over(&self, snapshot: &Snapshot) {
        self.leading.taking_over(snapshot);
    }
}

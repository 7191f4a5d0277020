//! What this process is allowed to do right now. A provider with a local or in-memory state is
//! the only replica and always serves. With `--state etcd://…` several replicas share one
//! prefix and exactly one of them leads (docs/ha.md):
//!
//! | Role | Mutations | Get, List | gRPC health, `/readyz`, bootstrap channel |
//! |---|---|---|---|
//! | single | engine | engine | SERVING, 200, served |
//! | leader | engine, while its claim is held | engine | SERVING, 200, served |
//! | degraded (leader that lost etcd) | UNAVAILABLE | engine (memory) | SERVING, 200, served |
//! | standby | UNAVAILABLE | UNAVAILABLE | NOT_SERVING, 503, 503 |
//!
//! A standby never answers FAILED_PRECONDITION: the shard reads that as a zombie.

use std::sync::{Arc, RwLock};

use tonic::Status;

use crate::engine::Engine;
use crate::telemetry::Telemetry;

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
#[derive(Clone, Debug)]
pub struct Leading(Arc<tokio::sync::watch::Sender<bool>>);

impl Default for Leading {
    fn default() -> Leading {
        Leading(Arc::new(tokio::sync::watch::channel(false).0))
    }
}

impl Leading {
    pub fn get(&self) -> bool {
        *self.0.borrow()
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

struct Current {
    role: Role,
    engine: Option<Arc<Engine>>,
    hold: Option<HoldCheck>,
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
             ran out): no mutation is acknowledged until it leads again",
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
        Arc::new(Replica {
            current: RwLock::new(Current {
                role: Role::Single,
                engine: Some(engine),
                hold: None,
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
        Arc::new(Replica {
            current: RwLock::new(Current {
                role: Role::Standby,
                engine: None,
                hold: None,
            }),
            warm: Arc::default(),
            telemetry,
            leading,
            changed: tokio::sync::watch::channel(Role::Standby).0,
        })
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

    /// Whether this replica answers reads and passes readiness.
    pub fn serves(&self) -> bool {
        self.role().serves()
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
        match (&current.engine, current.role) {
            (Some(engine), role) if role.serves() => Ok(engine.clone()),
            (_, role) => Err(unavailable(role)),
        }
    }

    /// The engine for a mutation: only while this replica leads with a claim it still holds.
    pub fn writer(&self) -> Result<Arc<Engine>, Status> {
        let current = self.read();
        match (&current.engine, current.role) {
            (Some(engine), Role::Single) => Ok(engine.clone()),
            (Some(engine), Role::Leader) if current.hold.as_ref().is_none_or(|held| held()) => {
                Ok(engine.clone())
            }
            (_, role) => Err(unavailable(role)),
        }
    }

    /// Waits for the next change of role and returns it.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<Role> {
        self.changed.subscribe()
    }

    fn set(&self, role: Role, engine: Option<Arc<Engine>>, hold: Option<HoldCheck>) {
        {
            let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
            current.role = role;
            current.engine = engine;
            current.hold = hold;
        }
        self.leading.set(role.serves());
        self.telemetry.leader(role == Role::Leader);
        self.changed.send_replace(role);
    }

    /// Leads with `engine` while `hold` says the claim is held.
    pub(crate) fn lead(&self, engine: Arc<Engine>, hold: HoldCheck) {
        self.telemetry.store_accepting();
        self.set(Role::Leader, Some(engine), Some(hold));
    }

    /// Keeps answering reads from the engine of the lost term, acknowledging nothing.
    pub(crate) fn degrade(&self) {
        let engine = self.engine();
        self.set(Role::Degraded, engine, None);
    }

    /// Drops the engine and answers UNAVAILABLE to everything.
    pub(crate) fn stand_by(&self) {
        self.set(Role::Standby, None, None);
    }
}

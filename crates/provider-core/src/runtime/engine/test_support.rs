//! What the crate's tests share about an engine and its backend, written once: slots to seed,
//! the host a test backend names, a backend that finishes every transition at once (or holds
//! chosen Creates until cancelled), [`Stub`] for a backend that differs only in a few calls, a
//! wait for a machine's state and a multi-threaded runtime for tests that block on one.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::observability::telemetry::Telemetry;
use crate::persistence::store::{MemoryStore, SharedStore};
use crate::provisioning::backend::{Backend, BackendError, ConfigureOrder, TransitionContext};
use crate::rules::fence::FenceToken;
use crate::rules::inventory::{Effect, Sighting, Survey};
use crate::rules::machine::{HostRef, Machine, MachineState, StringMap};
use crate::runtime::engine::{Engine, EngineOptions};

/// A Speculative `cx22` slot (on demand) in `zone`.
pub(crate) fn slot(id: impl Into<String>, zone: &str) -> Machine {
    let mut m = Machine::speculative(id, "cx22");
    m.zone = zone.into();
    m
}

/// `count` slots `<prefix>-0`, `<prefix>-1`, … in `zone`.
pub(crate) fn slots(prefix: &str, count: usize, zone: &str) -> Vec<Machine> {
    (0..count)
        .map(|i| slot(format!("{prefix}-{i}"), zone))
        .collect()
}

/// The host a test backend names for a machine: `h-<machine id>` of `provider`.
pub(crate) fn host_of(provider: &str, machine_id: &str) -> HostRef {
    HostRef {
        provider: provider.into(),
        id: format!("h-{machine_id}"),
    }
}

/// A Create's effect that names `host` and nothing else.
pub(crate) fn hosted(host: HostRef) -> Effect {
    Effect {
        host: Some(host),
        ..Effect::default()
    }
}

/// A test backend written as only what it does differently: it seeds [`Stub::slots`], surveys
/// [`Stub::hosts`], and its Configure, Drain and Delete succeed at once unless it says otherwise.
#[async_trait]
pub(crate) trait Stub: Send + Sync + 'static {
    /// The slots the backend seeds.
    fn slots(&self) -> Vec<Machine>;

    /// The hosts a survey lists; `None` when the backend lists none.
    fn hosts(&self) -> Option<Vec<Sighting>> {
        None
    }

    async fn machine_hosts(&self, _machine_id: &str) -> Result<Option<Vec<HostRef>>, BackendError> {
        Ok(None)
    }

    async fn create(
        &self,
        machine: &Machine,
        ctx: &TransitionContext,
    ) -> Result<Effect, BackendError>;

    async fn configure(
        &self,
        _machine: &Machine,
        _order: &ConfigureOrder,
        _ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        Ok(())
    }

    async fn drain(
        &self,
        _machine: &Machine,
        _grace_period_seconds: i64,
        _ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        Ok(())
    }

    async fn delete(
        &self,
        _machine: &Machine,
        _ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        Ok(())
    }
}

#[async_trait]
impl<T: Stub> Backend for T {
    async fn describe(&self) -> Result<Vec<Machine>, BackendError> {
        Ok(self.slots())
    }
    async fn survey(&self) -> Result<Survey, BackendError> {
        Ok(Survey {
            machines: self.slots(),
            hosts: self.hosts(),
        })
    }
    async fn machine_hosts(&self, machine_id: &str) -> Result<Option<Vec<HostRef>>, BackendError> {
        Stub::machine_hosts(self, machine_id).await
    }
    async fn create(
        &self,
        machine: &Machine,
        ctx: &TransitionContext,
    ) -> Result<Effect, BackendError> {
        Stub::create(self, machine, ctx).await
    }
    async fn configure(
        &self,
        machine: &Machine,
        order: &ConfigureOrder,
        ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        Stub::configure(self, machine, order, ctx).await
    }
    async fn drain(
        &self,
        machine: &Machine,
        grace_period_seconds: i64,
        ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        Stub::drain(self, machine, grace_period_seconds, ctx).await
    }
    async fn delete(&self, machine: &Machine, ctx: &TransitionContext) -> Result<(), BackendError> {
        Stub::delete(self, machine, ctx).await
    }
}

/// Seeds its slots and finishes every transition at once: a Create names the host
/// [`host_of`] its provider (with the allocatable resources set), a Drain succeeds or fails
/// with the set message; a Create of a held machine waits until cancelled instead.
pub(crate) struct SlotBackend {
    slots: Vec<Machine>,
    provider: &'static str,
    held: HashSet<String>,
    allocatable: StringMap,
    drain_error: Option<&'static str>,
}

impl SlotBackend {
    /// A backend over `slots` whose hosts are of provider `p`.
    pub(crate) fn new(slots: Vec<Machine>) -> SlotBackend {
        SlotBackend {
            slots,
            provider: "p",
            held: HashSet::new(),
            allocatable: StringMap::new(),
            drain_error: None,
        }
    }

    /// `count` slots `m-00000`, `m-00001`, … in zone `z`.
    pub(crate) fn numbered(count: usize) -> SlotBackend {
        SlotBackend::new((0..count).map(|i| slot(format!("m-{i:05}"), "z")).collect())
    }

    pub(crate) fn provider(mut self, provider: &'static str) -> SlotBackend {
        self.provider = provider;
        self
    }

    /// Creates of these machines never finish on their own.
    pub(crate) fn holding(mut self, ids: &[&str]) -> SlotBackend {
        self.held = ids.iter().map(|id| (*id).to_owned()).collect();
        self
    }

    pub(crate) fn allocatable(mut self, allocatable: StringMap) -> SlotBackend {
        self.allocatable = allocatable;
        self
    }

    pub(crate) fn refusing_drains(mut self, message: &'static str) -> SlotBackend {
        self.drain_error = Some(message);
        self
    }
}

#[async_trait]
impl Stub for SlotBackend {
    fn slots(&self) -> Vec<Machine> {
        self.slots.clone()
    }
    async fn create(
        &self,
        machine: &Machine,
        ctx: &TransitionContext,
    ) -> Result<Effect, BackendError> {
        if self.held.contains(&machine.id) {
            ctx.cancel.cancelled().await;
            return Err(BackendError::new("cancelled"));
        }
        Ok(Effect {
            allocatable: self.allocatable.clone(),
            ..hosted(host_of(self.provider, &machine.id))
        })
    }
    async fn drain(&self, _: &Machine, _: i64, _: &TransitionContext) -> Result<(), BackendError> {
        match self.drain_error {
            Some(message) => Err(BackendError::new(message)),
            None => Ok(()),
        }
    }
}

/// Waits (up to five seconds of 10 ms polls) until `id` is in `state`, and returns it then.
pub(crate) async fn settle(engine: &Engine, id: &str, state: MachineState) -> Arc<Machine> {
    for _ in 0..500 {
        let m = engine.get(id).expect("get");
        if m.state == state {
            return m;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{id} never reached {state}");
}

/// A multi-threaded runtime of `workers` threads, for a test that blocks on one.
pub(crate) fn runtime(workers: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .expect("runtime")
}

/// An engine over `backend` on `store`, with the default options and its metrics under
/// `prefix`.
pub(crate) async fn start_on(
    store: SharedStore,
    backend: Arc<dyn Backend>,
    prefix: &str,
) -> Arc<Engine> {
    Engine::start(backend, store, EngineOptions::new(Telemetry::new(prefix)))
        .await
        .expect("engine starts")
}

/// [`start_on`] an in-memory store.
pub(crate) async fn start_in_memory(backend: Arc<dyn Backend>, prefix: &str) -> Arc<Engine> {
    start_on(Arc::new(MemoryStore), backend, prefix).await
}

/// The fence token of a caller that names no shard.
pub(crate) fn zero() -> FenceToken {
    FenceToken {
        shard_id: String::new(),
        epoch: 0,
        sequence: 0,
    }
}

//! The real gRPC server (`serve::serve_grpc` over a `127.0.0.1:0` listener, the engine on the
//! in-memory store) in each security mode, over a small scripted backend: every backend call can
//! be held at a gate until the test releases it, so transitional states are observable
//! deterministically, and chosen cluster ids make a transition fail.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use provider_core::engine::EngineOptions;
use provider_core::identity::ShardIdentity;
use provider_core::inventory::Effect;
use provider_core::serve::{self, GrpcHealth};
use provider_core::store::MemoryStore;
use provider_core::telemetry::Telemetry;
use provider_core::tls::{self, TlsFlags};
use provider_core::{
    Backend, BackendError, ConfigureOrder, Engine, HostRef, Machine, OperationKind, StringMap,
    TransitionContext,
};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::wire::{self, Caller, ClientSecurity, Shard};

/// Configure with this cluster fails at once.
pub const FAIL_CONFIGURE: &str = "fail-configure";
/// Configure with this cluster succeeds, and the Drain that follows fails.
pub const FAIL_DRAIN: &str = "fail-drain";
/// Configure with this cluster panics inside the backend.
pub const PANIC_CONFIGURE: &str = "panic-configure";
/// How long a test waits for an ungated transition to settle.
pub const SETTLE: Duration = Duration::from_secs(5);

/// The slot ids the test backend seeds.
pub fn machine_id(i: usize) -> String {
    format!("m-{i:03}")
}

/// A backend scripted by the test.
pub struct TestBackend {
    seeds: usize,
    /// When set, every backend call waits here for a permit from [`TestBackend::release`].
    gate: Option<Semaphore>,
    /// Whether the backend has the Delete capability.
    deletes: bool,
    calls: [AtomicUsize; 4],
}

impl TestBackend {
    /// Transitions complete as soon as they are dispatched.
    pub fn instant(seeds: usize) -> Arc<TestBackend> {
        Arc::new(TestBackend {
            seeds,
            gate: None,
            deletes: true,
            calls: Default::default(),
        })
    }

    /// Like [`TestBackend::instant`], without the Delete capability (a bare-metal free pool).
    pub fn without_delete(seeds: usize) -> Arc<TestBackend> {
        Arc::new(TestBackend {
            seeds,
            gate: None,
            deletes: false,
            calls: Default::default(),
        })
    }

    /// Each transition waits in its transitional state until released.
    pub fn gated(seeds: usize) -> Arc<TestBackend> {
        Arc::new(TestBackend {
            seeds,
            gate: Some(Semaphore::new(0)),
            deletes: true,
            calls: Default::default(),
        })
    }

    /// Lets `n` held backend calls finish.
    pub fn release(&self, n: usize) {
        self.gate
            .as_ref()
            .expect("release on a gated backend")
            .add_permits(n);
    }

    /// How many times the engine called the backend for `kind`.
    pub fn calls(&self, kind: OperationKind) -> usize {
        self.calls[kind.index()].load(Ordering::SeqCst)
    }

    async fn enter(&self, kind: OperationKind) -> Result<(), BackendError> {
        self.calls[kind.index()].fetch_add(1, Ordering::SeqCst);
        if let Some(gate) = &self.gate {
            gate.acquire()
                .await
                .map_err(|_| BackendError::new("gate closed"))?
                .forget();
        }
        Ok(())
    }
}

#[async_trait]
impl Backend for TestBackend {
    async fn describe(&self) -> Result<Vec<Machine>, BackendError> {
        Ok((0..self.seeds)
            .map(|i| {
                let mut m = Machine::speculative(machine_id(i), "t.small");
                m.zone = "zone-a".into();
                m.price_per_hour = 0.05;
                m.resources = StringMap::from([("cpu".to_owned(), "1".to_owned())]);
                m.allocatable = StringMap::from([("cpu".to_owned(), "2".to_owned())]);
                m
            })
            .collect())
    }

    async fn create(
        &self,
        machine: &Machine,
        _ctx: &TransitionContext,
    ) -> Result<Effect, BackendError> {
        self.enter(OperationKind::Create).await?;
        Ok(Effect {
            host: Some(HostRef {
                provider: "test".into(),
                id: format!("host-{}", machine.id),
            }),
            ..Effect::default()
        })
    }

    async fn configure(
        &self,
        machine: &Machine,
        order: &ConfigureOrder,
        _ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        self.enter(OperationKind::Configure).await?;
        if order.cluster_id == PANIC_CONFIGURE {
            panic!("injected configure panic for {}", machine.id);
        }
        if order.cluster_id == FAIL_CONFIGURE {
            return Err(BackendError(format!(
                "injected configure failure for {}",
                machine.id
            )));
        }
        Ok(())
    }

    async fn drain(
        &self,
        machine: &Machine,
        _grace_period_seconds: i64,
        _ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        self.enter(OperationKind::Drain).await?;
        if machine.cluster == FAIL_DRAIN {
            return Err(BackendError(format!(
                "injected drain failure for {}",
                machine.id
            )));
        }
        Ok(())
    }

    fn supports_delete(&self) -> bool {
        self.deletes
    }

    async fn delete(
        &self,
        _machine: &Machine,
        _ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        self.enter(OperationKind::Delete).await
    }
}

/// How the server's gRPC port is secured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServerSecurity {
    Insecure,
    Tls,
    Mtls,
}

impl ServerSecurity {
    /// The client mode that this server accepts.
    pub fn client(self) -> ClientSecurity {
        match self {
            ServerSecurity::Insecure => ClientSecurity::Plaintext,
            ServerSecurity::Tls => ClientSecurity::Tls,
            ServerSecurity::Mtls => ClientSecurity::Mtls,
        }
    }
}

/// The committed test PKI.
pub fn pki() -> PathBuf {
    wire::pki_dir(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.."))
}

/// A running in-process provider.
pub struct TestServer {
    pub addr: SocketAddr,
    pub engine: Arc<Engine>,
    pub health: GrpcHealth,
    pub security: ServerSecurity,
    stop: CancellationToken,
    task: JoinHandle<Result<(), String>>,
}

/// Starts the engine over `backend` and serves it, with reflection, on a fresh loopback port.
pub async fn start(backend: Arc<dyn Backend>, security: ServerSecurity) -> TestServer {
    start_with(backend, security, true).await
}

/// An insecure server over `backend` (see [`start`]) and a plaintext caller for `shard`.
pub async fn insecure(backend: Arc<dyn Backend>, shard: &str) -> (TestServer, Caller) {
    let server = start(backend, ServerSecurity::Insecure).await;
    let caller = server.caller(shard).await;
    (server, caller)
}

/// Creates `id` through `caller` and waits until it is Idle.
pub async fn create_idle(caller: &mut Caller, id: &str) {
    caller.create(id).await.unwrap();
    caller
        .wait_for_state(id, fleet_proto::v1alpha1::MachineState::Idle, SETTLE)
        .await
        .unwrap();
}

/// Configures `id` into `cluster` with `metadata` through `caller` and waits until it is in
/// `state` (Configured, or Failed for a cluster whose Configure fails): the machine then.
pub async fn configure_into(
    caller: &mut Caller,
    id: &str,
    cluster: &str,
    metadata: std::collections::HashMap<String, String>,
    state: fleet_proto::v1alpha1::MachineState,
) -> fleet_proto::v1alpha1::Machine {
    caller.configure(id, cluster, metadata).await.unwrap();
    caller.wait_for_state(id, state, SETTLE).await.unwrap()
}

/// Like [`start`], with reflection registered or not (`--reflection`).
pub async fn start_with(
    backend: Arc<dyn Backend>,
    security: ServerSecurity,
    reflection: bool,
) -> TestServer {
    let pki = pki();
    let flags = match security {
        ServerSecurity::Insecure => TlsFlags::default(),
        ServerSecurity::Tls | ServerSecurity::Mtls => TlsFlags {
            cert: Some(pki.join("server.pem")),
            key: Some(pki.join("server-key.pem")),
            ca: (security == ServerSecurity::Mtls).then(|| pki.join("ca.pem")),
        },
    };
    serve_with(backend, security, flags, None, reflection).await
}

/// An mTLS server with the committed server certificate that verifies clients against the CA
/// bundle at `client_ca`, with `--shard-identity` set to `shard_identity` (`None`: not given).
pub async fn start_mtls(
    backend: Arc<dyn Backend>,
    client_ca: &std::path::Path,
    shard_identity: Option<ShardIdentity>,
) -> TestServer {
    let pki = pki();
    let flags = TlsFlags {
        cert: Some(pki.join("server.pem")),
        key: Some(pki.join("server-key.pem")),
        ca: Some(client_ca.to_owned()),
    };
    serve_with(backend, ServerSecurity::Mtls, flags, shard_identity, true).await
}

async fn serve_with(
    backend: Arc<dyn Backend>,
    security: ServerSecurity,
    flags: TlsFlags,
    shard_identity: Option<ShardIdentity>,
    reflection: bool,
) -> TestServer {
    let (mode, tls_config) = tls::grpc_tls(&flags).expect("the test PKI loads");
    assert_eq!(
        mode.name(),
        match security {
            ServerSecurity::Insecure => "insecure",
            ServerSecurity::Tls => "TLS",
            ServerSecurity::Mtls => "mTLS",
        }
    );
    // As the binaries resolve it: enforce by default under mTLS.
    let shard_identity = ShardIdentity::resolve(shard_identity, mode).expect("shard identity");
    let engine = Engine::start(
        backend,
        Arc::new(MemoryStore),
        EngineOptions::new(Telemetry::new("bigfleet_it")),
    )
    .await
    .expect("engine starts");
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("local addr");
    let (health, health_service) = serve::grpc_health(engine.options().telemetry).await;
    let stop = CancellationToken::new();
    let task = tokio::spawn(serve::serve_grpc(
        listener,
        tls_config,
        shard_identity,
        provider_core::replica::Replica::single(engine.clone()),
        reflection,
        health_service,
        serve::GrpcLimits::default(),
        stop.clone().cancelled_owned(),
    ));
    health.set(true).await;
    TestServer {
        addr,
        engine,
        health,
        security,
        stop,
        task,
    }
}

impl TestServer {
    /// A connected client in `security` mode.
    pub async fn channel(&self, security: ClientSecurity) -> tonic::transport::Channel {
        wire::channel(&pki(), self.addr, security)
            .await
            .expect("connect")
    }

    /// A caller in the server's own mode, stamping tokens of `shard` at epoch 1.
    pub async fn caller(&self, shard: &str) -> Caller {
        Caller::new(
            self.channel(self.security.client()).await,
            Shard::new(shard, 1),
        )
    }

    /// Stops serving and waits for the server task.
    pub async fn stop(self) {
        self.stop.cancel();
        tokio::time::timeout(SETTLE, self.task)
            .await
            .expect("the server stops within the settle time")
            .expect("server task")
            .expect("server stops cleanly");
    }
}

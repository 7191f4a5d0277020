//! gRPC listener limits over loopback (docs/limits.md): a client that opens too many
//! connections, opens too many streams on one connection, stays silent, never finishes a
//! request or keeps a connection forever cannot hold the server's resources beyond the limits.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fleet_proto::v1alpha1 as pb;
use pb::capacity_provider_client::CapacityProviderClient;
use provider_core::Engine;
use provider_core::engine::EngineOptions;
use provider_core::records::{Change, Snapshot};
use provider_core::serve::{self, GrpcLimits};
use provider_core::store::{Commit, Store, StoreError};
use provider_core::telemetry::Telemetry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tonic::transport::{Channel, Endpoint};

use crate::harness::{TestBackend, machine_id, pki};

/// How long a test waits for something the server must do by itself.
const BOUND: Duration = Duration::from_secs(10);

/// A store whose commits can be held open, so an RPC stays in its handler.
#[derive(Default)]
struct GatedStore {
    hold: AtomicBool,
    pending: Mutex<Vec<oneshot::Sender<Result<(), StoreError>>>>,
}

impl GatedStore {
    fn held(&self) -> usize {
        self.pending.lock().unwrap().len()
    }

    fn open(&self) {
        self.hold.store(false, Ordering::SeqCst);
        for tx in self.pending.lock().unwrap().drain(..) {
            let _ = tx.send(Ok(()));
        }
    }
}

impl Store for GatedStore {
    fn load(&self) -> Result<Snapshot, StoreError> {
        Ok(Snapshot::default())
    }
    fn submit(&self, _batch: Vec<Change>) -> Commit {
        if !self.hold.load(Ordering::SeqCst) {
            return Commit::done();
        }
        let (tx, rx) = oneshot::channel();
        self.pending.lock().unwrap().push(tx);
        Commit::pending(rx)
    }
    fn is_durable(&self) -> bool {
        false
    }
    fn describe(&self) -> String {
        "gated".into()
    }
}

struct Served {
    addr: SocketAddr,
    store: Arc<GatedStore>,
    _stop: tokio_util::sync::DropGuard,
}

/// Serves with the default limits as `set` changes them.
async fn serve(set: impl FnOnce(&mut GrpcLimits)) -> Served {
    let mut limits = GrpcLimits::default();
    set(&mut limits);
    serve_with(limits, None).await
}

async fn serve_with(limits: GrpcLimits, tls: Option<provider_core::tls::GrpcTls>) -> Served {
    let store = Arc::new(GatedStore::default());
    let engine = Engine::start(
        TestBackend::instant(8),
        store.clone(),
        EngineOptions::new(Telemetry::new("bigfleet_limits")),
    )
    .await
    .expect("engine starts");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (health, health_service) = serve::grpc_health(engine.options().telemetry).await;
    health.set(true).await;
    let stop = CancellationToken::new();
    tokio::spawn(serve::serve_grpc(
        listener,
        tls,
        provider_core::identity::ShardIdentity::Off,
        provider_core::replica::Replica::single(engine),
        false,
        health_service,
        limits,
        stop.clone().cancelled_owned(),
    ));
    Served {
        addr,
        store,
        _stop: stop.drop_guard(),
    }
}

async fn client(addr: SocketAddr) -> CapacityProviderClient<Channel> {
    let channel = Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect_timeout(BOUND)
        .connect()
        .await
        .expect("connect");
    CapacityProviderClient::new(channel)
}

fn create(i: usize) -> pb::CreateRequest {
    pb::CreateRequest {
        machine_id: machine_id(i),
        ..pb::CreateRequest::default()
    }
}

/// The HTTP/2 client preface and an empty SETTINGS frame: a connection the server serves.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";

/// Reads until the server closes the connection; returns the HTTP/2 frame types seen (the
/// first is the server's SETTINGS), or panics if the server keeps it open beyond [`BOUND`].
async fn until_closed(conn: &mut TcpStream) -> Vec<u8> {
    let mut bytes = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(BOUND, conn.read(&mut buf)).await {
            Err(_) => panic!("the server kept the connection open for {BOUND:?}"),
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => bytes.extend_from_slice(&buf[..n]),
        }
    }
    let mut types = Vec::new();
    let mut at = 0;
    while at + 9 <= bytes.len() {
        let len = usize::from(bytes[at]) << 16
            | usize::from(bytes[at + 1]) << 8
            | usize::from(bytes[at + 2]);
        types.push(bytes[at + 3]);
        at += 9 + len;
    }
    types
}

/// Polls a Get until it succeeds (the server frees a slot as soon as it sees the close).
async fn eventually_served(addr: SocketAddr) {
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        let attempt = async {
            let mut c = client(addr).await;
            c.get(pb::MachineRef { id: machine_id(0) }).await
        };
        if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(1), attempt).await {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "never served again");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn connections_beyond_the_cap_are_closed_at_once_and_slots_come_back() {
    let server = serve(|l| l.max_connections = 2).await;
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut conn = TcpStream::connect(server.addr).await.expect("connect");
        conn.write_all(PREFACE).await.expect("preface");
        let mut first = [0u8; 9];
        conn.read_exact(&mut first)
            .await
            .expect("served: the server's SETTINGS");
        assert_eq!(first[3], 0x4, "a SETTINGS frame");
        held.push(conn);
    }
    // A third connection is closed without a byte.
    let mut third = TcpStream::connect(server.addr).await.expect("connect");
    let _ = third.write_all(PREFACE).await;
    assert_eq!(until_closed(&mut third).await, Vec::<u8>::new());

    // Closing one held connection frees its slot.
    drop(held.pop());
    eventually_served(server.addr).await;
}

#[tokio::test]
async fn a_silent_connection_is_closed_after_the_handshake_timeout() {
    let server = serve(|l| {
        l.max_connections = 1;
        l.handshake_timeout = Duration::from_millis(300);
    })
    .await;
    let mut silent = TcpStream::connect(server.addr).await.expect("connect");
    until_closed(&mut silent).await;
    // Its slot is free again: the only slot serves a real client.
    eventually_served(server.addr).await;
}

#[tokio::test]
async fn streams_per_connection_are_capped() {
    let server = serve(|l| l.max_concurrent_streams = 2).await;
    let c = client(server.addr).await;
    // One answered RPC: the client has the server's SETTINGS and knows the limit.
    c.clone()
        .get(pb::MachineRef { id: machine_id(0) })
        .await
        .expect("get");
    server.store.hold.store(true, Ordering::SeqCst);
    let calls: Vec<_> = (0..5)
        .map(|i| {
            let mut c = c.clone();
            tokio::spawn(async move { c.create(create(i)).await })
        })
        .collect();
    let deadline = tokio::time::Instant::now() + BOUND;
    while server.store.held() < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the first two RPCs never arrived"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The other three wait for a stream: nothing more reaches a handler meanwhile.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        server.store.held(),
        2,
        "more than 2 RPCs in flight on one connection"
    );
    server.store.open();
    // A client that respects SETTINGS waits for a free stream; one that does not is refused
    // (REFUSED_STREAM, retryable). Either way every call ends.
    let mut answered = 0;
    for call in calls {
        match call.await.expect("task") {
            Ok(_) => answered += 1,
            Err(status) => assert_eq!(status.code(), Code::Unavailable, "{status:?}"),
        }
    }
    assert!(answered >= 2, "only {answered} Creates answered");
}

#[tokio::test]
async fn a_request_that_does_not_finish_in_time_is_cancelled() {
    let server = serve(|l| l.request_timeout = Duration::from_millis(300)).await;
    server.store.hold.store(true, Ordering::SeqCst);
    let mut c = client(server.addr).await;
    let status = tokio::time::timeout(BOUND, c.create(create(1)))
        .await
        .expect("answered within the bound")
        .expect_err("a held commit cannot answer OK");
    assert_eq!(status.code(), Code::Cancelled, "{status:?}");
    server.store.open();
    // The connection and the server are fine afterwards.
    c.get(pb::MachineRef { id: machine_id(0) })
        .await
        .expect("get");
}

#[tokio::test]
async fn an_old_connection_is_sent_away_and_then_closed() {
    let server = serve(|l| {
        l.max_connection_age = Duration::from_millis(300);
        l.request_timeout = Duration::from_millis(100);
    })
    .await;
    let mut conn = TcpStream::connect(server.addr).await.expect("connect");
    conn.write_all(PREFACE).await.expect("preface");
    // The client never acknowledges anything nor closes; the server closes the connection
    // once its age and the grace (the request timeout plus 5 s) have passed.
    let started = tokio::time::Instant::now();
    let frames = until_closed(&mut conn).await;
    assert_eq!(frames.first(), Some(&0x4), "SETTINGS first: {frames:?}");
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "closed before its age: {frames:?}"
    );
}

#[tokio::test]
async fn tls_handshakes_in_progress_count_against_the_cap() {
    let pki = pki();
    let (_, tls) = provider_core::tls::grpc_tls(&provider_core::tls::TlsFlags {
        cert: Some(pki.join("server.pem")),
        key: Some(pki.join("server-key.pem")),
        ca: None,
    })
    .expect("the test PKI loads");
    let server = serve_with(
        GrpcLimits {
            max_connections: 1,
            // Far beyond BOUND: only the cap can close the second connection in time.
            handshake_timeout: Duration::from_secs(60),
            ..GrpcLimits::default()
        },
        tls,
    )
    .await;
    // A client that connects and never starts its TLS handshake holds the only slot...
    let stalled = TcpStream::connect(server.addr).await.expect("connect");
    // ...so another connection is closed at once, before any handshake.
    let mut refused = TcpStream::connect(server.addr).await.expect("connect");
    assert_eq!(until_closed(&mut refused).await, Vec::<u8>::new());
    drop(stalled);
}

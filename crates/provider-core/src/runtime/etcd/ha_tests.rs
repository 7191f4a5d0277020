//! Replicas and their answers: a takeover on the fake cloud, a claim that lapses before the
//! replica loop notices, the evidence that tells an etcd outage from a partition, etcd's
//! answers as the commit path classifies them, and the request size limit against a real etcd.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tonic::Code;

use super::testing::{Cluster, args};
use super::*;
use crate::observability::telemetry::Telemetry;
use crate::provisioning::offerings::default_mix;
use crate::rules::error::CoreError;
use crate::rules::fence::{FenceToken, HighWaterMark};
use crate::rules::machine::{Machine, MachineState};
use crate::rules::records::Slot;
use crate::runtime::engine::{Engine, EngineOptions};
use crate::runtime::replica::{Leading, Replica, Role};

fn runtime() -> tokio::runtime::Runtime {
    crate::runtime::engine::test_support::runtime(2)
}

fn token(sequence: i64) -> FenceToken {
    FenceToken {
        shard_id: "shard-ha".into(),
        epoch: 1,
        sequence,
    }
}

async fn until(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !done() {
        assert!(Instant::now() < deadline, "{what} within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One in-process replica on the fake cloud: its replica, its cloud and its stop token.
struct FakeReplica {
    replica: Arc<Replica>,
    cloud: Arc<crate::provisioning::fake::FakeCloud>,
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

fn fake_replica(state: &str, name: &str) -> FakeReplica {
    fake_replica_with(state, name, args())
}

fn fake_replica_with(state: &str, name: &str, etcd: EtcdArgs) -> FakeReplica {
    let (cloud, fleet) =
        crate::provisioning::fleet::test_fleet(default_mix(4, ["a", "b"], ["z1", "z2"]));
    let fleet: Arc<dyn crate::provisioning::backend::Backend> = Arc::new(fleet);
    let leading = Leading::default();
    // The binaries' fake-backend wiring (crates/hetzner/src/main.rs).
    let restored = cloud.clone();
    leading.on_takeover(move |snapshot| restored.restore(snapshot));
    let telemetry = Telemetry::new("etcd_ha_test");
    let replica = Replica::standby(telemetry, leading);
    let setup = ha::ReplicaSetup {
        replica: replica.clone(),
        start_engine: Box::new(move |store| {
            let backend = fleet.clone();
            Box::pin(async move {
                Engine::start(backend, store, EngineOptions::new(telemetry))
                    .await
                    .map_err(|e| e.to_string())
            })
        }),
        reconcile: true,
        shutdown_grace: Duration::from_secs(2),
    };
    let prepared = ha::prepare(state, &etcd).expect("prepare");
    let stop = tokio_util::sync::CancellationToken::new();
    let task = tokio::spawn(ha::run(prepared, setup, stop.clone()));
    let _ = name;
    FakeReplica {
        replica,
        cloud,
        stop,
        task,
    }
}

async fn settle(engine: &Engine, id: &str, state: MachineState) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let machine = engine.get(id).expect("get");
        if machine.state == state {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{id} is {} ({}), never {state}",
            machine.state,
            machine.last_error
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A new leader's fake cloud holds the hosts the state records: a takeover followed by
/// reconcile passes turns no Configured machine FAILED, and the machine drains on the new
/// leader's cloud.
#[test]
fn a_takeover_on_the_fake_cloud_finds_the_recorded_hosts() {
    let cluster = Cluster::start(1);
    let state = cluster.state("/bigfleet/fake-takeover");
    runtime().block_on(async {
        let first = fake_replica(&state, "first");
        until("the first replica leads", Duration::from_secs(10), || {
            first.replica.role() == Role::Leader
        })
        .await;
        let engine = first.replica.writer().expect("the leader writes");
        let (a, b) = (
            engine.spare_of("a", "z1")[0].clone(),
            engine.spare_of("b", "z1")[0].clone(),
        );
        let ids = [a.as_str(), b.as_str()];
        let mut sequence = 0;
        for id in ids {
            sequence += 1;
            engine.create(id, token(sequence)).await.expect("create");
            settle(&engine, id, MachineState::Idle).await;
            sequence += 1;
            engine
                .configure(
                    id,
                    "cluster-ha".into(),
                    b"blob".to_vec(),
                    Default::default(),
                    token(sequence),
                )
                .await
                .expect("configure");
            settle(&engine, id, MachineState::Configured).await;
        }
        let recorded: Vec<String> = ids
            .iter()
            .map(|id| engine.get(id).expect("get").host.clone().expect("host").id)
            .collect();
        assert_eq!(first.cloud.hosts().len(), 2);
        drop(engine);

        let second = fake_replica(&state, "second");
        until(
            "the second replica is a warm standby",
            Duration::from_secs(10),
            || second.replica.warm(),
        )
        .await;
        // The first one stops; the second takes over (and reconciles before it serves).
        first.stop.cancel();
        first.task.await.expect("first replica");
        until("the second replica leads", Duration::from_secs(10), || {
            second.replica.role() == Role::Leader
        })
        .await;
        let engine = second.replica.writer().expect("the new leader writes");
        for _ in 0..2 {
            engine.reconcile().await.expect("reconcile");
        }
        for (id, host) in ids.iter().zip(&recorded) {
            let machine = engine.get(id).expect("get");
            assert_eq!(
                machine.state,
                MachineState::Configured,
                "{id}: {}",
                machine.last_error
            );
            assert_eq!(
                machine.host.as_ref().map(|h| h.id.as_str()),
                Some(host.as_str())
            );
        }
        let hosts = second.cloud.hosts();
        assert_eq!(hosts.len(), 2, "{hosts:?}");
        assert!(
            hosts
                .iter()
                .all(|h| h.cluster.as_deref() == Some("cluster-ha"))
        );
        // The machine goes on through its lifecycle on the new leader's cloud, and a new host
        // gets an id of its own.
        sequence += 1;
        engine
            .drain(ids[0], 1, token(sequence))
            .await
            .expect("drain");
        settle(&engine, ids[0], MachineState::Idle).await;
        sequence += 1;
        let third = engine.spare_of("a", "z2")[0].clone();
        engine
            .create(&third, token(sequence))
            .await
            .expect("create");
        settle(&engine, &third, MachineState::Idle).await;
        let new_host = engine
            .get(&third)
            .expect("get")
            .host
            .clone()
            .expect("host")
            .id;
        assert!(!recorded.contains(&new_host), "{new_host} reissued");
        second.stop.cancel();
        second.task.await.expect("second replica");
    });
}

async fn memory_engine() -> Arc<Engine> {
    let (_, fleet) =
        crate::provisioning::fleet::test_fleet(default_mix(4, ["a", "b"], ["z1", "z2"]));
    crate::runtime::engine::test_support::start_in_memory(Arc::new(fleet), "etcd_ha_test").await
}

async fn http_status(addr: std::net::SocketAddr, path: &str) -> u16 {
    reqwest::get(format!("http://{addr}{path}"))
        .await
        .expect("GET")
        .status()
        .as_u16()
}

async fn health(addr: std::net::SocketAddr) -> i32 {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .expect("health")
        .into_inner()
        .status
}

const SERVING: i32 = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
const NOT_SERVING: i32 = tonic_health::pb::health_check_response::ServingStatus::NotServing as i32;

/// The claim's validity is consulted per request: when the hold's monotonic deadline passes
/// (a leader paused past its lease, or cut off from etcd), the very next health check, `/readyz`,
/// Get and bootstrap-channel request answer as a standby, while the role (and the health status the role mirror set) still
/// says leader. With evidence that etcd is down for everyone, reads go on from memory.
#[test]
fn a_lapsed_claim_answers_as_a_standby_before_the_replica_loop_notices() {
    runtime().block_on(async {
        let engine = memory_engine().await;
        let telemetry = Telemetry::new("etcd_ha_test");
        let leading = Leading::default();
        let replica = Replica::standby(telemetry, leading.clone());
        // A claim whose last keep-alive was confirmed now, with a 1 s lease: usable for 800 ms.
        let hold = Hold::new(&Claim {
            lease: 1,
            token: b"t".to_vec(),
            ttl: Duration::from_secs(1),
            granted_at: Instant::now(),
            revision: 1,
        });
        let outage = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (check, down) = (hold.clone(), outage.clone());
        replica.lead(
            engine.clone(),
            Arc::new(move || check.is_held()),
            Arc::new(move || down.load(std::sync::atomic::Ordering::SeqCst)),
        );

        let stop = tokio_util::sync::CancellationToken::new();
        let http = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let http_addr = http.local_addr().expect("addr");
        let ready = crate::wire::serve::Readiness::default();
        ready.set(true);
        tokio::spawn(crate::wire::serve::serve_http(
            http,
            ready,
            replica.clone(),
            {
                let stop = stop.clone();
                async move { stop.cancelled().await }
            },
        ));
        let grpc = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let grpc_addr = grpc.local_addr().expect("addr");
        let (reporter, health_service) = crate::wire::serve::grpc_health(telemetry).await;
        // What the role mirror of app.rs does for a leader.
        reporter.set(true).await;
        tokio::spawn(crate::wire::serve::serve_grpc(
            grpc,
            None,
            crate::security::identity::ShardIdentity::Off,
            replica.clone(),
            false,
            health_service,
            crate::wire::serve::GrpcLimits::default(),
            {
                let stop = stop.clone();
                async move { stop.cancelled().await }
            },
        ));

        assert!(hold.is_held());
        assert_eq!(http_status(http_addr, "/readyz").await, 200);
        assert_eq!(health(grpc_addr).await, SERVING);
        assert!(replica.reader().is_ok() && replica.writer().is_ok());
        assert!(leading.get(), "the bootstrap channel serves");

        // The hold lapses; nothing tells the replica.
        let lapse = hold.valid_until();
        tokio::time::sleep(lapse.saturating_duration_since(Instant::now())).await;
        assert!(!hold.is_held());
        assert_eq!(replica.role(), Role::Leader, "the loop did not run");
        assert_eq!(http_status(http_addr, "/readyz").await, 503);
        assert_eq!(health(grpc_addr).await, NOT_SERVING);
        assert_eq!(
            replica.reader().map(|_| ()).unwrap_err().code(),
            Code::Unavailable
        );
        assert_eq!(
            replica.writer().map(|_| ()).unwrap_err().code(),
            Code::Unavailable
        );
        assert!(!leading.get(), "the bootstrap channel answers 503");

        // Evidence that etcd is down for everyone: reads from memory, still no mutation.
        outage.store(true, std::sync::atomic::Ordering::SeqCst);
        assert!(replica.reader().is_ok());
        assert_eq!(health(grpc_addr).await, SERVING);
        assert_eq!(http_status(http_addr, "/readyz").await, 200);
        assert_eq!(
            replica.writer().map(|_| ()).unwrap_err().code(),
            Code::Unavailable
        );
        // The same for a replica that stepped down degraded: the evidence is asked per request.
        replica.degrade(Arc::new({
            let down = outage.clone();
            move || down.load(std::sync::atomic::Ordering::SeqCst)
        }));
        assert!(replica.reader().is_ok());
        outage.store(false, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(
            replica.reader().map(|_| ()).unwrap_err().code(),
            Code::Unavailable
        );
        assert_eq!(http_status(http_addr, "/readyz").await, 503);
        assert!(replica.stand_by_if_degraded());
        assert_eq!(replica.role(), Role::Standby);
        stop.cancel();
    });
}

/// A member's address that refuses connections (nothing listens) is evidence; one of three is
/// not a majority; a timeout is no evidence at all; an answer clears it.
#[test]
fn a_majority_of_refusing_members_is_evidence_of_an_outage_and_silence_is_not() {
    runtime().block_on(async {
        let closed = |_: ()| {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            let addr = listener.local_addr().expect("addr");
            drop(listener);
            addr.to_string()
        };
        let target = target::parse(&format!(
            "etcd://{},{},{}/p",
            closed(()),
            closed(()),
            closed(())
        ))
        .expect("parse");
        let client = target::connect(&target, &args()).expect("connect");
        assert!(!client.quorum_refused(), "nothing heard yet");
        let read = holder(&client, &Keys::new("/p")).await;
        assert!(read.is_err());
        assert!(client.quorum_refused(), "every member refused: {read:?}");
        // One member answering is not enough while the two others refuse...
        client.answered(0);
        assert!(client.quorum_refused());
        // ...two are.
        client.answered(1);
        assert!(!client.quorum_refused());
        // Timeouts (a partition) are silence, whatever their number.
        let timeout = tonic::Status::cancelled("Timeout expired");
        for at in 0..3 {
            client.failed_with(at, &timeout);
        }
        assert!(!client.quorum_refused());
        assert!(!target::refused(&timeout));
        assert!(target::refused(&tonic::Status::unavailable(
            "error trying to connect: tcp connect error: Connection refused (os error 111)"
        )));
        assert!(target::refused(&tonic::Status::from_error(Box::new(
            std::io::Error::from(std::io::ErrorKind::ConnectionReset)
        ))));
    });
}

/// A commit interrupted by an etcd election or a member going away (CANCELLED from a reset
/// stream, DEADLINE_EXCEEDED, UNAVAILABLE, a broken connection) is retried on the next member;
/// when the attempts run out it surfaces as a store failure, which the shard is answered
/// UNAVAILABLE for (and retries), never CANCELLED. etcd refusing the request itself is told
/// apart and not retried.
#[test]
fn interrupted_etcd_requests_are_retried_and_surface_as_unavailable() {
    for status in [
        tonic::Status::cancelled("h2 protocol error: stream no longer needed"),
        tonic::Status::cancelled("Timeout expired"),
        tonic::Status::deadline_exceeded("context deadline exceeded"),
        tonic::Status::unavailable("etcdserver: leader changed"),
        tonic::Status::unknown("transport error"),
        tonic::Status::unknown("etcdserver: request timed out"),
    ] {
        assert!(retryable(&status), "{status:?}");
        assert!(!refuses_the_request(&status), "{status:?}");
    }
    for status in [
        tonic::Status::invalid_argument("etcdserver: request is too large"),
        tonic::Status::invalid_argument("etcdserver: too many operations in txn request"),
        tonic::Status::resource_exhausted(
            "grpc: received message larger than max (3146000 vs. 2097152)",
        ),
    ] {
        assert!(refuses_the_request(&status), "{status:?}");
    }
    assert!(!refuses_the_request(&tonic::Status::resource_exhausted(
        "etcdserver: mvcc: database space exceeded"
    )));
    runtime().block_on(async {
        // A member that accepts connections and never answers: every attempt times out
        // (CANCELLED "Timeout expired" on the client) and is retried; then the commit fails.
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = silent.local_addr().expect("addr");
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((tcp, _)) = silent.accept().await {
                held.push(tcp);
            }
        });
        let target = target::parse(&format!("etcd://{addr}/p")).expect("parse");
        let client = target::connect(&target, &args()).expect("connect");
        let started = Instant::now();
        let failed = retry_classified(&client, "commit", || {
            let mut kv = client.kv();
            async move { kv.range(pb::RangeRequest::default()).await }
        })
        .await
        .expect_err("nobody answers");
        let RequestError::Failed(message) = failed else {
            panic!("a silent member is no refusal of the request: {failed:?}");
        };
        assert!(message.contains("after 6 attempts"), "{message}");
        assert!(
            started.elapsed() >= Duration::from_secs(6),
            "every attempt waited"
        );
        assert!(
            !client.quorum_refused(),
            "silence is no evidence of an outage"
        );
        let status = tonic::Status::from(CoreError::Store(message));
        assert_eq!(status.code(), Code::Unavailable);
    });
}

fn slot_of_size(id: &str, record_bytes: usize) -> Slot {
    let mut machine = Machine::speculative(id, "cx22");
    machine.zone = "fsn1".into();
    let mut slot = Slot {
        machine: Arc::new(machine),
        last_change: 1,
        operations: [Some("op-1".into()), None, None, None],
        sealed: None,
        enrollment: None,
        retired: None,
    };
    // The record as the engine measures it: the durable slot encoding (the etcd value adds a
    // format byte, which the limit accounts for).
    let encoded = |slot: &Slot| {
        let mut out = Vec::new();
        crate::persistence::durable::encode_slot(slot, &mut out);
        out.len()
    };
    let base = encoded(&slot);
    Arc::make_mut(&mut slot.machine)
        .shard_metadata
        .insert("blob".into(), "x".repeat(record_bytes - base - 64));
    let now = encoded(&slot);
    let pad = record_bytes - now;
    Arc::make_mut(&mut slot.machine)
        .shard_metadata
        .insert("blob".into(), "x".repeat(record_bytes - base - 64 + pad));
    assert_eq!(encoded(&slot), record_bytes);
    slot
}

/// `max_record_bytes` is what fits: a Configure's batch with a record of exactly that size and
/// ids at their limits is one transaction that etcd (default `--max-request-bytes`) accepts. A
/// record etcd refuses fails its commit and every later one of that store, but the claim stays:
/// no step-down, and the claim continues in a new store on a fresh read.
#[test]
fn a_record_at_the_limit_commits_and_one_etcd_refuses_keeps_the_claim() {
    let cluster = Cluster::start(1);
    let prefix = "/bigfleet/limit";
    let state = cluster.state(prefix);
    runtime().block_on(async {
        let store = EtcdStore::open(&state, &args()).await.expect("open");
        let _ = store.load();
        let limit = store.max_record_bytes().expect("etcd has a limit");
        let keys = Keys::new(prefix);
        assert_eq!(limit, TxnLimits::DEFAULT.max_record_bytes(&keys));
        assert!(limit > 1_500_000 && limit < 1_572_864, "{limit}");
        let id = "/".repeat(crate::rules::limits::MAX_ID_BYTES);
        let batch = |record: usize, n: i64| {
            vec![
                Change::PutFence {
                    shard_id: id.clone(),
                    machine_id: id.clone(),
                    mark: HighWaterMark {
                        epoch: i64::MAX,
                        sequence: n,
                    },
                },
                Change::PutSlot(slot_of_size(&id, record)),
                Change::Counters {
                    revision: i64::MAX - 10 + n,
                    next_op: u64::MAX - 10,
                },
            ]
        };
        assert_eq!(
            plan(&keys, vec![batch(limit, 1)], TxnLimits::DEFAULT).len(),
            1,
            "one transaction"
        );
        assert_eq!(
            plan(&keys, vec![batch(limit + 1, 1)], TxnLimits::DEFAULT).len(),
            2,
            "a byte more is split"
        );
        store
            .submit(batch(limit, 1))
            .wait()
            .await
            .expect("a record at the limit commits");

        // Over what etcd takes in one request at all.
        let e = store
            .submit(batch(1_600_000, 2))
            .wait()
            .await
            .expect_err("etcd refuses it");
        assert!(e.0.contains("too large"), "{e}");
        tokio::time::timeout(Duration::from_secs(1), store.refused())
            .await
            .expect("the refusal is reported");
        let e = store
            .submit(vec![Change::Counters {
                revision: 1,
                next_op: 1,
            }])
            .wait()
            .await
            .expect_err("later batches of this store fail too: durable in order");
        assert!(e.0.contains("too large"), "{e}");
        let (guarded, keep_alive) = store.hand_over().await.expect("hand over");
        assert!(guarded.hold.is_held(), "the claim is kept");
        let snapshot = read_state(&guarded.client, &guarded.keys)
            .await
            .expect("read");
        assert_eq!(snapshot.slots.len(), 1, "the record at the limit");
        let renewed = EtcdStore::claimed(guarded, keep_alive, snapshot);
        renewed
            .submit(batch(1000, 3))
            .wait()
            .await
            .expect("the claim commits on in a new store");
        renewed.release().wait().await.expect("release");
    });
}

/// A transaction etcd refuses as too large (here: the provider is told etcd takes 3 MiB, etcd
/// keeps its default 1.5 MiB, so the record passes the provider's own limit) fails that
/// Configure with UNAVAILABLE, and the leader keeps its claim: it serves on with a new engine on
/// a fresh read, without a step-down, and the next mutation is acknowledged.
#[test]
fn a_transaction_etcd_refuses_keeps_the_leader_leading_on_a_fresh_read() {
    let cluster = Cluster::start(1);
    let prefix = "/bigfleet/refused";
    let state = cluster.state(prefix);
    runtime().block_on(async {
        let etcd = EtcdArgs {
            etcd_max_request_bytes: 3 << 20,
            ..args()
        };
        let leader = fake_replica_with(&state, "leader", etcd);
        until("the replica leads", Duration::from_secs(10), || {
            leader.replica.role() == Role::Leader
        })
        .await;
        let client = cluster.client();
        let keys = Keys::new(prefix);
        let claim = holder(&client, &keys)
            .await
            .expect("read")
            .expect("claimed");
        let engine = leader.replica.writer().expect("the leader writes");
        let id = engine.spare_of("a", "z1")[0].clone();
        let id = id.as_str();
        engine.create(id, token(1)).await.expect("create");
        settle(&engine, id, MachineState::Idle).await;
        let metadata = [("blob".to_owned(), "x".repeat(2 << 20))]
            .into_iter()
            .collect();
        let refused = engine
            .configure(id, "c".into(), b"blob".to_vec(), metadata, token(2))
            .await
            .expect_err("etcd refuses the transaction");
        assert_eq!(refused.code(), Code::Unavailable, "{refused}");
        assert!(refused.to_string().contains("too large"), "{refused}");
        until("a new engine serves", Duration::from_secs(10), || {
            leader
                .replica
                .writer()
                .is_ok_and(|e| !Arc::ptr_eq(&e, &engine))
        })
        .await;
        assert_eq!(leader.replica.role(), Role::Leader);
        assert_eq!(
            holder(&client, &keys).await.expect("read"),
            Some(claim),
            "the same claim: no step-down"
        );
        let renewed = leader.replica.writer().expect("the leader writes");
        assert_eq!(
            renewed.get(id).expect("get").state,
            MachineState::Idle,
            "the refused Configure left nothing behind"
        );
        renewed
            .configure(
                id,
                "c".into(),
                b"blob".to_vec(),
                Default::default(),
                token(3),
            )
            .await
            .expect("the next mutation is acknowledged");
        settle(&renewed, id, MachineState::Configured).await;
        leader.stop.cancel();
        leader.task.await.expect("replica");
    });
}

/// The same for a single provider restarted on a local state with the fake backend: the new
/// process's fake cloud holds the recorded hosts, and a reconcile fails nothing.
#[test]
fn a_restart_on_a_local_state_finds_the_recorded_hosts_on_the_fake_cloud() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("state").display().to_string();
    let start = || async {
        let (cloud, fleet) =
            crate::provisioning::fleet::test_fleet(default_mix(4, ["a", "b"], ["z1", "z2"]));
        let leading = Leading::default();
        let restored = cloud.clone();
        leading.on_takeover(move |snapshot| restored.restore(snapshot));
        let store = crate::operations::app::open_store(&state).expect("open the state");
        leading
            .before_start(&*store)
            .expect("the hooks see the state");
        let engine = Engine::start(
            Arc::new(fleet),
            store,
            EngineOptions::new(Telemetry::new("etcd_ha_test")),
        )
        .await
        .expect("engine");
        (Replica::single_with(engine, leading), cloud)
    };
    runtime().block_on(async {
        let (replica, _) = start().await;
        let engine = replica.writer().expect("writes");
        let id = engine.spare_of("a", "z1")[0].clone();
        let id = id.as_str();
        engine.create(id, token(1)).await.expect("create");
        settle(&engine, id, MachineState::Idle).await;
        engine
            .configure(
                id,
                "c".into(),
                b"blob".to_vec(),
                Default::default(),
                token(2),
            )
            .await
            .expect("configure");
        settle(&engine, id, MachineState::Configured).await;
        engine.shutdown(Duration::from_secs(2)).await;
        engine.store().release().wait().await.expect("release");
        drop(engine);
        drop(replica);

        let (replica, cloud) = start().await;
        let engine = replica.writer().expect("writes");
        assert_eq!(cloud.hosts().len(), 1);
        for _ in 0..2 {
            engine.reconcile().await.expect("reconcile");
        }
        let machine = engine.get(id).expect("get");
        assert_eq!(
            machine.state,
            MachineState::Configured,
            "{}",
            machine.last_error
        );
    });
}

/// `--etcd-max-request-bytes` defaults to etcd's own 1.5 MiB and moves the record limit with it.
#[test]
fn the_request_size_flag_sets_the_record_limit() {
    use clap::Parser;
    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        etcd: EtcdArgs,
    }
    let default = Flags::try_parse_from(["p"]).expect("parse").etcd;
    assert_eq!(default.etcd_max_request_bytes, 1_572_864);
    assert_eq!(default, EtcdArgs::default());
    let raised = Flags::try_parse_from(["p", "--etcd-max-request-bytes=3145728"])
        .expect("parse")
        .etcd;
    assert!(raised.validate().is_ok());
    let keys = Keys::new("/bigfleet/hetzner-fsn1");
    let limit = TxnLimits::of(raised.etcd_max_request_bytes).max_record_bytes(&keys);
    // The conformance program's 2 MiB shard_metadata fits, with room to spare.
    assert!(limit > (2 << 20) + 500_000, "{limit}");
    assert_eq!(
        TxnLimits::of(3_145_728).max_record_bytes(&keys),
        TxnLimits::DEFAULT.max_record_bytes(&keys) + (3_145_728 - 1_572_864)
    );
    let e = Flags::try_parse_from(["p", "--etcd-max-request-bytes=1000"])
        .expect("parse")
        .etcd
        .validate()
        .unwrap_err();
    assert!(e.contains("--etcd-max-request-bytes"), "{e}");
}

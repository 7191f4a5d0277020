//! Replicas of `faultprovider` on one prefix of a real three-member etcd cluster (loopback
//! 127.0.0.21-23, etcd::testing), under a steady stream of mutations, through failures of the
//! leader and of etcd. A checker then compares every acknowledged mutation with the final state
//! read from etcd: its fence mark is there, its operation is recorded and the machine settled
//! where it leads, no operation id was handed out twice and ids only grew, nothing is FAILED.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fleet_proto::v1alpha1 as pb;
use fleet_proto::v1alpha1::capacity_provider_client::CapacityProviderClient;
use provider_core::etcd::testing::Cluster;
use tonic::transport::Channel;
use tonic::{Code, Status};

use crate::provider_process::{self, Provider, Spec};
use crate::wire::{self, ClientSecurity};

const SHARD: &str = "ha-shard";
/// Machines under load (the first ordinary slots of the fault inventory).
const MACHINES: usize = 6;
/// The lease TTL of the test replicas where a short one helps (takeovers wait for it).
const TTL: &str = "2s";
/// The default lease TTL: the etcd scenarios keep it, so that an etcd leader election (about a
/// second) fits inside the lease as it must in production.
const DEFAULT_TTL: &str = "3s";

/// Runs `f` on a plain thread (the etcd test cluster blocks while it waits for readiness).
fn blocking<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| s.spawn(f).join().expect("blocking helper"))
}

fn root() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn spec(state: &str, name: &str, ttl: &str) -> Spec {
    Spec {
        name: name.into(),
        binary: std::path::PathBuf::from(env!("CARGO_BIN_EXE_faultprovider")),
        args: vec![
            format!("--state={state}"),
            format!("--etcd-lease-ttl={ttl}"),
            "--seed-count=8".into(),
            "--transition-timeout=5s".into(),
            // Configures in flight resume on the next leader instead of failing.
            format!(
                "--state-encryption-key-file={}",
                root().join("testdata/state-key").display()
            ),
        ],
        metrics: true,
        security: ClientSecurity::Plaintext,
        pki: wire::pki_dir(&root()),
    }
}

async fn start_replica(state: &str, name: &str, ttl: &str) -> Provider {
    provider_process::start_answering(spec(state, name, ttl))
        .await
        .expect("replica answers health")
}

/// `/readyz` status code (0 when the port does not answer).
async fn readyz(addr: SocketAddr) -> u16 {
    http_status(addr, "/readyz").await
}

/// A client with a short deadline per call: a paused replica must not stall the stream.
fn client(provider: &Provider) -> CapacityProviderClient<Channel> {
    let channel = wire::endpoint(&provider.spec.pki, provider.grpc, ClientSecurity::Plaintext)
        .expect("endpoint")
        .connect_timeout(Duration::from_millis(300))
        .timeout(Duration::from_millis(1500))
        .connect_lazy();
    CapacityProviderClient::new(channel)
}

fn machine_ids() -> Vec<String> {
    (0..MACHINES)
        .map(|i| format!("fault-spec-{i:03}"))
        .collect()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Create,
    Configure,
    Drain,
    Delete,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Create => "create",
            Kind::Configure => "configure",
            Kind::Drain => "drain",
            Kind::Delete => "delete",
        }
    }

    fn target(self) -> pb::MachineState {
        match self {
            Kind::Create | Kind::Drain => pb::MachineState::Idle,
            Kind::Configure => pb::MachineState::Configured,
            Kind::Delete => pb::MachineState::Speculative,
        }
    }
}

#[derive(Clone, Debug)]
struct Ack {
    machine: String,
    kind: Kind,
    op: String,
    seq: i64,
    replica: usize,
    /// When the request left the client.
    sent: Instant,
    /// When its acknowledgement arrived.
    at: Instant,
}

/// The stream of mutations and what it saw.
#[derive(Default)]
struct Record {
    acks: Vec<Ack>,
    /// Per machine: whether its last mutation's outcome is unknown (no answer, or UNAVAILABLE
    /// after the request may have reached a leader).
    uncertain: HashMap<String, bool>,
    unavailable: u64,
    /// Answers that are wrong under any failure: a stale-fence refusal, INTERNAL.
    wrong: Vec<String>,
    /// Machines that ended FAILED.
    failed: Vec<String>,
}

struct Load {
    clients: Mutex<Vec<CapacityProviderClient<Channel>>>,
    seq: AtomicI64,
    stop: AtomicBool,
    record: Mutex<Record>,
}

fn settled(state: pb::MachineState) -> bool {
    matches!(
        state,
        pb::MachineState::Speculative
            | pb::MachineState::Idle
            | pb::MachineState::Configured
            | pb::MachineState::Failed
    )
}

/// An answer the client retries. CANCELLED only as what the client library makes of its own
/// failures — tonic reports its expired deadline as CANCELLED "Timeout expired" and a request
/// whose connection closed under it (a killed or stepping-down replica) as CANCELLED "operation
/// was canceled" — never as a provider's answer: a commit cut off by an etcd election is
/// UNAVAILABLE. INTERNAL likewise only as "h2 protocol error: …": tonic's name for a stream
/// its HTTP/2 connection ended (a stopping replica's GOAWAY refusing a stream the server never
/// saw, which grpc-go, BigFleet's client, reports as UNAVAILABLE); the provider's own INTERNAL
/// answers carry its message and stay wrong.
fn retryable(status: &Status) -> bool {
    match status.code() {
        Code::Unavailable | Code::DeadlineExceeded | Code::Unknown => true,
        Code::Internal => status.message().starts_with("h2 protocol error"),
        Code::Cancelled => {
            status.message() == "Timeout expired"
                || status.message().starts_with("operation was canceled")
        }
        _ => false,
    }
}

impl Load {
    fn new(replicas: &[Provider]) -> Arc<Load> {
        Arc::new(Load {
            clients: Mutex::new(replicas.iter().map(client).collect()),
            seq: AtomicI64::new(0),
            stop: AtomicBool::new(false),
            record: Mutex::default(),
        })
    }

    fn client(&self, index: usize) -> (usize, CapacityProviderClient<Channel>) {
        let clients = self.clients.lock().unwrap();
        let index = index % clients.len();
        (index, clients[index].clone())
    }

    /// Points replica slot `index` at a restarted process.
    fn replace(&self, index: usize, provider: &Provider) {
        self.clients.lock().unwrap()[index] = client(provider);
    }

    fn token(&self) -> i64 {
        self.seq.fetch_add(1, Ordering::SeqCst) + 1
    }

    fn acks(&self) -> Vec<Ack> {
        self.record.lock().unwrap().acks.clone()
    }

    /// Drives one machine through Create, Configure, Drain, Delete, again and again.
    async fn drive(self: Arc<Self>, machine: String) {
        let mut replica = 0;
        let mut known: Option<pb::MachineState> = None;
        let mut after_idle = Kind::Configure;
        while !self.stop.load(Ordering::SeqCst) {
            let state = match known {
                Some(s) if settled(s) => s,
                _ => {
                    let (at, mut c) = self.client(replica);
                    match c
                        .get(pb::MachineRef {
                            id: machine.clone(),
                        })
                        .await
                    {
                        Ok(m) => {
                            let s = m.into_inner().state();
                            known = Some(s);
                            if !settled(s) {
                                tokio::time::sleep(Duration::from_millis(20)).await;
                            }
                        }
                        Err(status) => {
                            // A kill is noticed by whichever call meets it, a state read too.
                            if retryable(&status) {
                                self.record.lock().unwrap().unavailable += 1;
                            }
                            replica = at + 1;
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    }
                    continue;
                }
            };
            let kind = match state {
                pb::MachineState::Speculative => Kind::Create,
                pb::MachineState::Idle => after_idle,
                pb::MachineState::Configured => Kind::Drain,
                _ => {
                    self.record.lock().unwrap().failed.push(machine);
                    return;
                }
            };
            let seq = self.token();
            let token = (SHARD.to_owned(), 1, seq);
            let (at, mut c) = self.client(replica);
            let sent = Instant::now();
            let answer = match kind {
                Kind::Create => c.create(wire::create_request(&machine, token)).await,
                Kind::Configure => {
                    c.configure(wire::configure_request(
                        &machine,
                        "ha-cluster",
                        HashMap::new(),
                        token,
                    ))
                    .await
                }
                Kind::Drain => c.drain(wire::drain_request(&machine, token)).await,
                Kind::Delete => c.delete(wire::delete_request(&machine, token)).await,
            };
            let pause = {
                let mut record = self.record.lock().unwrap();
                match answer {
                    Ok(ack) => {
                        let ack = ack.into_inner();
                        known = ack.machine.as_ref().map(|m| m.state());
                        after_idle = match kind {
                            Kind::Create => Kind::Configure,
                            Kind::Drain => Kind::Delete,
                            _ => after_idle,
                        };
                        record.uncertain.insert(machine.clone(), false);
                        record.acks.push(Ack {
                            machine: machine.clone(),
                            kind,
                            op: ack.operation_id,
                            seq,
                            replica: at,
                            sent,
                            at: Instant::now(),
                        });
                        false
                    }
                    Err(status) if retryable(&status) => {
                        record.unavailable += 1;
                        record.uncertain.insert(machine.clone(), true);
                        known = None;
                        replica = at + 1;
                        true
                    }
                    Err(status) => {
                        if matches!(
                            status.code(),
                            Code::FailedPrecondition | Code::Internal | Code::Cancelled
                        ) {
                            record.wrong.push(format!(
                                "{} {machine} (seq {seq}) answered {:?}: {}",
                                kind.name(),
                                status.code(),
                                status.message()
                            ));
                        }
                        // Otherwise the machine moved on under an answer we did not see: look again.
                        record.uncertain.insert(machine.clone(), true);
                        known = None;
                        false
                    }
                }
            };
            if pause {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

/// Starts the stream of mutations: one task per machine.
fn start_load(load: &Arc<Load>) -> Vec<tokio::task::JoinHandle<()>> {
    machine_ids()
        .into_iter()
        .map(|id| tokio::spawn(load.clone().drive(id)))
        .collect()
}

/// Starts the load on `replicas` and waits until it has `acks` acknowledgements: the load and
/// its tasks.
async fn load_running(
    replicas: &[Provider],
    acks: usize,
) -> (Arc<Load>, Vec<tokio::task::JoinHandle<()>>) {
    let load = Load::new(replicas);
    let tasks = start_load(&load);
    let started = Instant::now();
    while acks_since(&load, started) < acks {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (load, tasks)
}

/// Waits until a replica other than `excluding` acknowledges a mutation after `since`; the
/// time it took.
async fn first_ack_after(
    load: &Load,
    since: Instant,
    excluding: Option<usize>,
    within: Duration,
) -> Duration {
    let deadline = since + within;
    loop {
        if let Some(ack) = load
            .acks()
            .iter()
            .find(|a| a.at > since && Some(a.replica) != excluding)
        {
            return ack.at - since;
        }
        assert!(
            Instant::now() < deadline,
            "no mutation acknowledged within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Acknowledgements after `since`.
fn acks_since(load: &Load, since: Instant) -> usize {
    load.acks().iter().filter(|a| a.at > since).count()
}

/// The replica that serves (readyz 200), waiting up to `within`.
async fn leader(replicas: &[Provider], within: Duration) -> usize {
    let deadline = Instant::now() + within;
    loop {
        for (i, r) in replicas.iter().enumerate() {
            if readyz(r.metrics.expect("metrics addr")).await == 200 {
                return i;
            }
        }
        assert!(Instant::now() < deadline, "no replica became ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Prints every replica's log if the test fails while it is alive.
struct LogsOnFailure<'a>(&'a [Provider]);

impl Drop for LogsOnFailure<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for r in self.0 {
                eprintln!("==== {} log:\n{}", r.spec.name, r.logs());
            }
        }
    }
}

/// What the checker counted.
#[derive(Debug)]
struct Checked {
    acked: usize,
    last_acks_checked: usize,
    unavailable: u64,
    failed_configures: usize,
}

/// Stops the load, lets every machine settle, reads the final state from etcd and compares it
/// with every acknowledged mutation.
/// `interrupted_configures`: a Configure cut off by a lost leadership may end FAILED, exactly as
/// after a restart (the bootstrap blob is never stored), so a machine whose last acknowledged
/// mutation was a Configure may be FAILED; nothing else may.
async fn check(
    load: &Arc<Load>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    state: &str,
    interrupted_configures: bool,
) -> Checked {
    load.stop.store(true, Ordering::SeqCst);
    for t in tasks {
        t.await.expect("driver task");
    }
    // Every machine settles in the stored state (transitions are quick on this backend): the
    // state in etcd is the truth, whatever a replica holds in memory.
    let deadline = Instant::now() + Duration::from_secs(20);
    let args = provider_core::etcd::EtcdArgs {
        etcd_lease_ttl: Duration::from_secs(1),
        ..Default::default()
    };
    let json = loop {
        let json = provider_core::etcd::export_json(state, &args)
            .await
            .expect("export the final state");
        let doc: serde_json::Value = serde_json::from_str(&json).expect("export JSON");
        let transitional = doc["machines"]
            .as_array()
            .expect("machines")
            .iter()
            .any(|m| {
                matches!(
                    m["state"]
                        .as_str()
                        .unwrap_or("")
                        .to_ascii_uppercase()
                        .as_str(),
                    "CREATING" | "CONFIGURING" | "DRAINING" | "DELETING"
                )
            });
        if !transitional {
            break json;
        }
        assert!(
            Instant::now() < deadline,
            "machines did not settle in the stored state:\n{json}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let exported: serde_json::Value = serde_json::from_str(&json).expect("export JSON");
    let record = load.record.lock().unwrap();
    assert!(record.wrong.is_empty(), "wrong answers: {:?}", record.wrong);
    let fences: HashMap<String, i64> = exported["fences"]
        .as_array()
        .expect("fences")
        .iter()
        .filter(|f| f["shard_id"] == SHARD)
        .map(|f| {
            (
                f["machine_id"].as_str().unwrap().to_owned(),
                f["sequence"].as_i64().unwrap(),
            )
        })
        .collect();
    let states: HashMap<String, String> = exported["machines"]
        .as_array()
        .expect("machines")
        .iter()
        .map(|m| {
            (
                m["id"].as_str().unwrap().to_owned(),
                m["state"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let ops: std::collections::HashSet<(String, String, String)> = exported["ops"]
        .as_array()
        .expect("ops")
        .iter()
        .map(|o| {
            (
                o["machine_id"].as_str().unwrap().to_owned(),
                o["kind"].as_str().unwrap().to_owned(),
                o["operation_id"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let next_op = exported["next_op"].as_u64().expect("next_op");
    let number = |op: &str| -> u64 {
        op.rsplit('-')
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("operation id {op:?}"))
    };
    // No operation id handed out twice, and ids only grow per machine.
    let mut owners: HashMap<&str, (&str, Kind)> = HashMap::new();
    let mut last_per_machine: BTreeMap<&str, &Ack> = BTreeMap::new();
    for ack in &record.acks {
        if let Some((m, k)) = owners.insert(&ack.op, (&ack.machine, ack.kind)) {
            panic!(
                "operation id {} acknowledged for {m} {} and again for {} {}",
                ack.op,
                k.name(),
                ack.machine,
                ack.kind.name()
            );
        }
        if let Some(previous) = last_per_machine.get(ack.machine.as_str()) {
            assert!(
                number(&ack.op) > number(&previous.op),
                "{}: operation {} acknowledged after {}",
                ack.machine,
                ack.op,
                previous.op
            );
        }
        last_per_machine.insert(&ack.machine, ack);
        // Zero lost: the fence advance of every acknowledged mutation is durable.
        let mark = fences.get(&ack.machine).copied().unwrap_or(0);
        assert!(
            mark >= ack.seq,
            "{} {} acknowledged with sequence {} (replica {}) but the stored mark is {mark}",
            ack.kind.name(),
            ack.machine,
            ack.seq,
            ack.replica
        );
        assert!(
            number(&ack.op) < next_op,
            "operation {} at or above the stored counter {next_op}",
            ack.op
        );
    }
    // The last acknowledged mutation of each machine (nothing attempted after it) is where the
    // machine settled, under its operation id.
    let mut last_acks_checked = 0;
    for (machine, ack) in &last_per_machine {
        let failed = states
            .get(*machine)
            .is_some_and(|s| s.eq_ignore_ascii_case("FAILED"));
        if failed {
            // Only a Configure cut off by a lost leadership: the acknowledged one, or a later
            // one whose answer was lost (it is recorded in the state, newer than the last ack).
            let configure = ops
                .iter()
                .filter(|(m, k, _)| m == machine && k == "configure")
                .map(|(_, _, op)| number(op))
                .max();
            assert!(
                interrupted_configures && configure.is_some_and(|c| c >= number(&ack.op)),
                "{machine} is FAILED; its last acknowledged mutation was {} {} (latest configure \
                 in the state: {configure:?})",
                ack.kind.name(),
                ack.op
            );
            continue;
        }
        if record.uncertain.get(*machine).copied().unwrap_or(false) {
            continue;
        }
        let want = ack
            .kind
            .target()
            .as_str_name()
            .trim_start_matches("MACHINE_STATE_");
        let got = states
            .get(*machine)
            .map(String::as_str)
            .unwrap_or("missing");
        assert!(
            got.eq_ignore_ascii_case(want),
            "{machine}: last acknowledged {} {} should leave it {want}, the state has {got}",
            ack.kind.name(),
            ack.op
        );
        assert!(
            ops.contains(&(
                machine.to_string(),
                ack.kind.name().to_owned(),
                ack.op.clone()
            )),
            "{machine}: acknowledged {} {} is not recorded in the state",
            ack.kind.name(),
            ack.op
        );
        last_acks_checked += 1;
    }
    for (id, state) in &states {
        assert!(
            !state.eq_ignore_ascii_case("FAILED") || last_per_machine.contains_key(id.as_str()),
            "{id} is FAILED"
        );
    }
    Checked {
        acked: record.acks.len(),
        last_acks_checked,
        unavailable: record.unavailable,
        failed_configures: record.failed.len(),
    }
}

/// A fresh three-member etcd cluster, its state URL for `prefix`, and three replicas on it, the
/// first of which leads.
async fn three_on_a_new_cluster(prefix: &str, ttl: &str) -> (Cluster, String, Vec<Provider>) {
    let cluster = blocking(|| Cluster::start(3));
    let state = cluster.state(prefix);
    let replicas = three(&state, ttl).await;
    (cluster, state, replicas)
}

/// Three replicas on `prefix`, the first of which leads.
async fn three(state: &str, ttl: &str) -> Vec<Provider> {
    three_over(state, state, ttl).await
}

/// Three replicas, the first of which leads on `first_state`, the others on `state` (the same
/// etcd prefix, reached another way).
async fn three_over(first_state: &str, state: &str, ttl: &str) -> Vec<Provider> {
    let first = start_replica(first_state, "replica-0", ttl).await;
    assert_eq!(
        leader(std::slice::from_ref(&first), Duration::from_secs(10)).await,
        0
    );
    let mut replicas = vec![first];
    for i in 1..3 {
        replicas.push(start_replica(state, &format!("replica-{i}"), ttl).await);
    }
    replicas
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_the_leader_under_load_loses_nothing() {
    let (cluster, state, replicas) = three_on_a_new_cluster("/bigfleet/ha-kill", TTL).await;
    let _logs = LogsOnFailure(&replicas);
    // Standbys answer UNAVAILABLE to every RPC and fail readiness.
    for standby in &replicas[1..] {
        let mut c = client(standby);
        let get = c
            .get(pb::MachineRef {
                id: "fault-spec-000".into(),
            })
            .await
            .expect_err("a standby answers nothing");
        assert_eq!(get.code(), Code::Unavailable, "{get:?}");
        let create = c
            .create(wire::create_request("fault-spec-000", (SHARD.into(), 1, 1)))
            .await
            .expect_err("a standby acknowledges nothing");
        assert_eq!(create.code(), Code::Unavailable, "{create:?}");
        assert_eq!(readyz(standby.metrics.unwrap()).await, 503);
        assert_eq!(
            wire::health(&standby.default_channel().await.unwrap(), "")
                .await
                .unwrap(),
            tonic_health::pb::health_check_response::ServingStatus::NotServing
        );
    }
    let (load, tasks) = load_running(&replicas, 40).await;
    let killed = Instant::now();
    replicas[0].signal("KILL").expect("kill -9");
    let takeover = first_ack_after(&load, killed, Some(0), Duration::from_secs(15)).await;
    let new_leader = leader(&replicas[1..], Duration::from_secs(5)).await + 1;
    let resumed = Instant::now();
    while acks_since(&load, resumed) < 40 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let checked = check(&load, tasks, &state, false).await;
    eprintln!(
        "kill -9 of the leader (lease TTL {TTL}): replica {new_leader} acknowledged the first \
         mutation {takeover:?} after the kill; checker: {checked:?}"
    );
    assert!(
        takeover < Duration::from_secs(2) + Duration::from_secs(3),
        "takeover took {takeover:?}"
    );
    assert!(
        checked.acked >= 80 && checked.last_acks_checked > 0,
        "{checked:?}"
    );
    assert!(
        checked.unavailable > 0,
        "the kill went unnoticed: {checked:?}"
    );
    drop(cluster);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_paused_past_its_lease_commits_nothing_and_steps_down() {
    let (cluster, state, replicas) = three_on_a_new_cluster("/bigfleet/ha-stop", TTL).await;
    let _logs = LogsOnFailure(&replicas);
    let (load, tasks) = load_running(&replicas, 40).await;
    replicas[0].signal("STOP").expect("SIGSTOP");
    // Taken once `kill` returned, so a request sent later cannot have reached the leader before
    // it stopped.
    let stopped = Instant::now();
    let takeover = first_ack_after(&load, stopped, Some(0), Duration::from_secs(15)).await;
    // The new leader serves meanwhile.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let resumed = Instant::now();
    replicas[0].signal("CONT").expect("SIGCONT");
    // From its first answer after it runs again, the old leader is no leader: readiness and
    // health consult the claim's validity per request, before its replica loop notices.
    let ready_after = readyz(replicas[0].metrics.unwrap()).await;
    let health_after = wire::health(&replicas[0].default_channel().await.unwrap(), "").await;
    assert_eq!(ready_after, 503, "/readyz right after SIGCONT");
    assert_eq!(
        health_after.expect("health answers"),
        tonic_health::pb::health_check_response::ServingStatus::NotServing,
        "gRPC health right after SIGCONT"
    );
    eprintln!(
        "SIGSTOP: /readyz 503 and health NOT_SERVING {:?} after SIGCONT",
        resumed.elapsed()
    );
    // The old leader answers only UNAVAILABLE for mutations from the moment it runs again, and
    // becomes a standby.
    let mut old = client(&replicas[0]);
    let refused = old
        .create(wire::create_request(
            "fault-spec-007",
            (SHARD.into(), 1, load.token()),
        ))
        .await
        .expect_err("the paused leader acknowledges nothing");
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while readyz(replicas[0].metrics.unwrap()).await != 503 {
        assert!(
            Instant::now() < deadline,
            "the old leader did not step down"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    while acks_since(&load, resumed) < 40 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Answers to requests that were in flight at the pause may arrive after it: the leader
    // committed those while it held the lease, and the checker below finds each of them in the
    // final state. A request that reached the old leader after its pause began must never be
    // acknowledged: the process runs it only after SIGCONT, when its lease is gone.
    let old_after: Vec<Ack> = load
        .acks()
        .into_iter()
        .filter(|a| a.replica == 0 && a.sent > stopped)
        .collect();
    assert!(
        old_after.is_empty(),
        "the paused leader acknowledged requests sent after its pause: {old_after:?}"
    );
    let checked = check(&load, tasks, &state, false).await;
    eprintln!(
        "SIGSTOP of the leader (lease TTL {TTL}): first mutation on the new leader {takeover:?} \
         after the pause; checker: {checked:?}"
    );
    assert!(replicas[0].logs().contains("no longer held"));
    assert!(
        checked.acked >= 80 && checked.last_acks_checked > 0,
        "{checked:?}"
    );
    drop(cluster);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_losing_a_member_serves_on_and_losing_all_refuses_then_recovers() {
    let mut cluster = blocking(|| Cluster::start(3));
    let state = cluster.state("/bigfleet/ha-etcd");
    let replicas = three(&state, DEFAULT_TTL).await;
    let _logs = LogsOnFailure(&replicas);
    let (load, tasks) = load_running(&replicas, 30).await;
    // One member (the etcd leader, the hardest case) down: service continues.
    let member = cluster.leader().await;
    cluster.members[member].kill();
    let one_down = Instant::now();
    let gap = first_ack_after(&load, one_down, None, Duration::from_secs(10)).await;
    while acks_since(&load, one_down) < 30 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    {
        let record = load.record.lock().unwrap();
        assert!(
            record.failed.is_empty(),
            "machines FAILED while one etcd member was down: {:?}",
            record.failed
        );
    }
    blocking(|| {
        cluster.restart(member);
        cluster.wait_ready();
    });
    // Every member down: no mutation is acknowledged, reads are answered from memory, but only
    // what was durable: a machine of the load may have a change whose commit never landed (it is
    // answered UNAVAILABLE), the seeded machine no request touches is answered.
    let serving = leader(&replicas, Duration::from_secs(5)).await;
    for m in &mut cluster.members {
        m.kill();
    }
    let all_down = Instant::now();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let mut c = client(&replicas[serving]);
    // A machine the load never touched: its state is durable, so it is answered from memory.
    let read = c
        .get(pb::MachineRef {
            id: "fault-spec-006".into(),
        })
        .await
        .expect("reads are answered from memory while etcd is down");
    assert_eq!(read.into_inner().id, "fault-spec-006");
    // A machine under load is answered too, unless its last change was never made durable
    // (an answer never shows what etcd did not keep): then it is UNAVAILABLE.
    for id in machine_ids() {
        match c.get(pb::MachineRef { id: id.clone() }).await {
            Ok(m) => assert_eq!(m.into_inner().id, id),
            Err(status) => {
                assert_eq!(status.code(), Code::Unavailable, "{id}: {status:?}");
                assert!(status.message().contains("durable"), "{id}: {status:?}");
            }
        }
    }
    // Every member refuses connections: positive evidence that nobody has a quorum, so the
    // replica keeps serving reads and says so.
    assert_eq!(readyz(replicas[serving].metrics.unwrap()).await, 200);
    assert_eq!(
        wire::health(&replicas[serving].default_channel().await.unwrap(), "")
            .await
            .expect("health answers"),
        tonic_health::pb::health_check_response::ServingStatus::Serving
    );
    let refused = c
        .create(wire::create_request(
            "fault-spec-007",
            (SHARD.into(), 1, load.token()),
        ))
        .await
        .expect_err("no mutation is acknowledged while etcd is down");
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    let restarting = Instant::now();
    let during: Vec<Ack> = load
        .acks()
        .into_iter()
        .filter(|a| a.at > all_down + Duration::from_millis(500) && a.at < restarting)
        .collect();
    assert!(
        during.is_empty(),
        "acknowledged while every etcd member was down: {during:?}"
    );
    // Back: full recovery without restarting any replica.
    blocking(|| {
        for i in 0..3 {
            cluster.restart(i);
        }
        cluster.wait_ready();
    });
    let back = Instant::now();
    let recovery = first_ack_after(&load, back, None, Duration::from_secs(30)).await;
    while acks_since(&load, back) < 30 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // With every member down the leader's claim lapses (no keep-alive is confirmed within the
    // TTL), so it leads again only after etcd returns and resumes what was in flight then: a
    // Configure whose deadline passed during the outage ends FAILED, as after any lost
    // leadership. How long the outage lasts against that deadline is the machine's speed.
    let checked = check(&load, tasks, &state, true).await;
    eprintln!(
        "etcd: longest wait for an ack after the etcd leader was killed {gap:?}; first ack \
         {recovery:?} after all members returned; checker: {checked:?}"
    );
    assert!(
        checked.acked >= 90 && checked.last_acks_checked > 0,
        "{checked:?}"
    );
    drop(cluster);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_of_every_replica_under_load_loses_nothing() {
    let (cluster, state, mut replicas) = three_on_a_new_cluster("/bigfleet/ha-roll", TTL).await;
    let (load, tasks) = load_running(&replicas, 20).await;
    // Standbys first, the leader last, as a Deployment's rolling update may do it.
    let leading = leader(&replicas, Duration::from_secs(5)).await;
    let mut order: Vec<usize> = (0..3).filter(|i| *i != leading).collect();
    order.push(leading);
    let mut longest = Duration::ZERO;
    for i in order {
        replicas[i]
            .stop(Duration::from_secs(15))
            .await
            .expect("SIGTERM exits 0");
        let restarted = Instant::now();
        longest =
            longest.max(first_ack_after(&load, restarted, None, Duration::from_secs(15)).await);
        replicas[i] = start_replica(&state, &format!("replica-{i}-again"), TTL).await;
        load.replace(i, &replicas[i]);
        let again = Instant::now();
        while acks_since(&load, again) < 20 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let checked = check(&load, tasks, &state, false).await;
    eprintln!(
        "rolling restart: longest wait for an ack after a replica stopped {longest:?}; \
         checker: {checked:?}"
    );
    assert!(
        checked.acked >= 80 && checked.last_acks_checked > 0,
        "{checked:?}"
    );
    assert_eq!(
        checked.failed_configures, 0,
        "no FAILED machine in a rolling restart"
    );
    drop(cluster);
}

/// A loopback TCP forwarder standing in for the Kubernetes Service: each new connection goes
/// to the current target and stays there (as kube-proxy keeps an established connection on its
/// pod) until either side closes it. Counts the connections it forwarded.
struct Service {
    addr: SocketAddr,
    target: Arc<Mutex<SocketAddr>>,
    connections: Arc<AtomicI64>,
    task: tokio::task::JoinHandle<()>,
}

impl Service {
    async fn start(target: SocketAddr) -> Service {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let target = Arc::new(Mutex::new(target));
        let connections = Arc::new(AtomicI64::new(0));
        let (current, count) = (target.clone(), connections.clone());
        let task = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let to = *current.lock().unwrap();
                tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(to).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
        Service {
            addr,
            target,
            connections,
            task,
        }
    }

    fn retarget(&self, to: SocketAddr) {
        *self.target.lock().unwrap() = to;
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A client holding one channel through the Service to the leader: after the leader is paused
/// past its lease and steps down, its connection is closed, so the same channel reconnects
/// through the Service and reaches the new leader instead of being answered UNAVAILABLE on the
/// old connection until it ages out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_of_a_leader_that_steps_down_reconnects_to_the_new_leader() {
    let (cluster, _, replicas) = three_on_a_new_cluster("/bigfleet/ha-move", TTL).await;
    let _logs = LogsOnFailure(&replicas);
    let service = Service::start(replicas[0].grpc).await;
    let channel = wire::endpoint(
        &replicas[0].spec.pki,
        service.addr,
        ClientSecurity::Plaintext,
    )
    .expect("endpoint")
    .connect_timeout(Duration::from_millis(300))
    .timeout(Duration::from_millis(1500))
    .connect_lazy();
    let mut shard = CapacityProviderClient::new(channel);
    let get = || pb::MachineRef {
        id: "fault-spec-000".into(),
    };
    shard.get(get()).await.expect("the leader answers");
    assert_eq!(service.connections.load(Ordering::SeqCst), 1);

    replicas[0].signal("STOP").expect("SIGSTOP");
    let new_leader = leader(&replicas[1..], Duration::from_secs(15)).await + 1;
    service.retarget(replicas[new_leader].grpc);
    replicas[0].signal("CONT").expect("SIGCONT");
    let deadline = Instant::now() + Duration::from_secs(10);
    while readyz(replicas[0].metrics.unwrap()).await != 503 {
        assert!(
            Instant::now() < deadline,
            "the old leader did not step down"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let stepped_down = Instant::now();
    let mut refusals = Vec::new();
    loop {
        match shard.get(get()).await {
            Ok(_) => break,
            Err(status) => refusals.push(status.code()),
        }
        assert!(
            stepped_down.elapsed() < Duration::from_secs(5),
            "the channel stayed on the old leader: {refusals:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "the client reached the new leader {:?} after the old one stepped down; refused \
         meanwhile: {refusals:?}",
        stepped_down.elapsed()
    );
    assert_eq!(
        service.connections.load(Ordering::SeqCst),
        2,
        "the channel reconnected once, through the Service"
    );
    drop(cluster);
}

/// HTTP status of `path` on a metrics address (0 when the port does not answer).
async fn http_status(addr: SocketAddr, path: &str) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let attempt = async {
        let mut tcp = tokio::net::TcpStream::connect(addr).await.ok()?;
        tcp.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
            .await
            .ok()?;
        let mut out = Vec::new();
        tcp.read_to_end(&mut out).await.ok()?;
        String::from_utf8_lossy(&out)
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    };
    tokio::time::timeout(Duration::from_secs(1), attempt)
        .await
        .ok()
        .flatten()
        .unwrap_or(0)
}

/// Three replicas labelling their pods through a loopback stand-in of the Kubernetes API: the
/// leader's pod carries `bigfleet-leader=true`, the others `false`, and after kill -9 of the
/// leader the new leader's pod turns `true`. Standbys pass the replica readiness endpoint once
/// warm. The service account token never shows in a replica's log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_labels_its_pod_and_a_new_leader_takes_the_label_over() {
    use provider_core::leader_label::testing::FakeKubeApi;
    const TOKEN: &str = "ha-test-service-account-token-91f3";
    let pki = wire::pki_dir(&root());
    let api = FakeKubeApi::start(
        &std::fs::read(pki.join("server.pem")).unwrap(),
        &std::fs::read(pki.join("server-key.pem")).unwrap(),
    )
    .await;
    let credentials =
        std::env::temp_dir().join(format!("bigfleet-ha-label-{}", std::process::id()));
    std::fs::create_dir_all(&credentials).unwrap();
    std::fs::write(credentials.join("token"), TOKEN).unwrap();
    std::fs::copy(pki.join("ca.pem"), credentials.join("ca.crt")).unwrap();
    // A refused patch first: it is retried, and its message (which echoes the request's
    // headers) must not bring the token into the log.
    api.fail_next(&[403]);

    let cluster = blocking(|| Cluster::start(3));
    let state = cluster.state("/bigfleet/ha-label");
    let mut replicas = Vec::new();
    for i in 0..3 {
        let mut spec = spec(&state, &format!("replica-{i}"), TTL);
        spec.args.extend([
            "--leader-label".into(),
            format!("--pod-name=replica-{i}"),
            "--pod-namespace=bigfleet".into(),
            format!("--kubernetes-credentials={}", credentials.display()),
            format!("--kubernetes-api=https://{}", api.addr),
        ]);
        replicas.push(
            provider_process::start_answering(spec)
                .await
                .expect("replica answers health"),
        );
        if i == 0 {
            assert_eq!(
                leader(std::slice::from_ref(&replicas[0]), Duration::from_secs(10)).await,
                0
            );
        }
    }
    let _logs = LogsOnFailure(&replicas);
    let labels = |api: &FakeKubeApi| -> Vec<Option<String>> {
        (0..3)
            .map(|i| api.label("bigfleet", &format!("replica-{i}")))
            .collect()
    };
    let until = |want: [&'static str; 3], api: &'static FakeKubeApi| async move {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let now = labels(api);
            if now.iter().zip(want).all(|(l, w)| l.as_deref() == Some(w)) {
                return Instant::now();
            }
            assert!(
                Instant::now() < deadline,
                "labels {now:?}, expected {want:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    // The stand-in outlives the test body's borrows.
    let api: &'static FakeKubeApi = Box::leak(Box::new(api));
    until(["true", "false", "false"], api).await;
    // Every replica is ready for a replicated Deployment: the leader, and the warm standbys.
    let deadline = Instant::now() + Duration::from_secs(10);
    for r in &replicas {
        while http_status(r.metrics.unwrap(), "/readyz/replica").await != 200 {
            assert!(Instant::now() < deadline, "{} is not warm", r.spec.name);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    assert_eq!(readyz(replicas[1].metrics.unwrap()).await, 503);

    let killed = Instant::now();
    replicas[0].signal("KILL").expect("kill -9");
    let new_leader = leader(&replicas[1..], Duration::from_secs(10)).await + 1;
    let mut want = ["false", "false", "false"];
    want[0] = "true"; // the killed pod keeps its last label (its endpoint goes with the pod)
    want[new_leader] = "true";
    let labelled = until(want, api).await;
    eprintln!(
        "kill -9 of the leader (lease TTL {TTL}): replica {new_leader}'s pod labelled leader {:?} \
         after the kill",
        labelled - killed
    );
    for r in &replicas {
        assert!(
            !r.logs().contains(TOKEN),
            "{} logged the token",
            r.spec.name
        );
    }
    assert!(
        replicas.iter().any(|r| r.logs().contains("HTTP 403")),
        "the refused patch was logged"
    );
    assert_eq!(api.seen()[0].authorization, format!("Bearer {TOKEN}"));
    let _ = std::fs::remove_dir_all(&credentials);
    drop(cluster);
}

/// A loopback TCP forwarder to one etcd member that can be cut: a cut connection stays open but
/// nothing more crosses it in either direction, and new connections are accepted and then
/// ignored — a network partition, not a refusal (nothing is closed or reset).
struct Partition {
    addr: SocketAddr,
    cut: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Partition {
    async fn start(member: &str) -> Partition {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cut = Arc::new(AtomicBool::new(false));
        let to: SocketAddr = member.parse().unwrap();
        let flag = cut.clone();
        let task = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let flag = flag.clone();
                tokio::spawn(async move {
                    let Ok(outbound) = tokio::net::TcpStream::connect(to).await else {
                        return;
                    };
                    let (from_client, to_client) = inbound.into_split();
                    let (from_member, to_member) = outbound.into_split();
                    let up = tokio::spawn(pump(from_client, to_member, flag.clone()));
                    pump(from_member, to_client, flag).await;
                    let _ = up.await;
                });
            }
        });
        Partition { addr, cut, task }
    }

    fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies bytes one way until either side closes; drops them once `cut`.
/// A [`Partition`] in front of each member of `cluster`, and the state `prefix` as reached
/// through them.
async fn behind_partitions(cluster: &Cluster, prefix: &str) -> (Vec<Partition>, String) {
    let mut partitions = Vec::new();
    for member in &cluster.members {
        partitions.push(Partition::start(&member.client).await);
    }
    let through: Vec<String> = partitions.iter().map(|p| p.addr.to_string()).collect();
    let cut_off = format!("etcd://{}{prefix}", through.join(","));
    (partitions, cut_off)
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    cut: Arc<AtomicBool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if cut.load(Ordering::SeqCst) {
            continue;
        }
        if to.write_all(&buffer[..n]).await.is_err() {
            return;
        }
    }
}

/// The leader is cut off from etcd (etcd itself healthy, the other replicas reach it): once its
/// claim lapses it stops answering as the leader, reads included — Get and List UNAVAILABLE,
/// gRPC health NOT_SERVING, /readyz 503 — while another replica takes over and serves. Timeouts
/// are no evidence that etcd is down for everyone, so nothing is answered from a frozen copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_off_from_etcd_stops_answering_reads_while_another_leads() {
    let cluster = blocking(|| Cluster::start(3));
    let prefix = "/bigfleet/ha-cut";
    let (partitions, cut_off) = behind_partitions(&cluster, prefix).await;
    let replicas = three_over(&cut_off, &cluster.state(prefix), TTL).await;
    let _logs = LogsOnFailure(&replicas);
    let mut old = client(&replicas[0]);
    let get = || pb::MachineRef {
        id: "fault-spec-000".into(),
    };
    old.get(get()).await.expect("the leader answers");
    old.create(wire::create_request("fault-spec-000", (SHARD.into(), 1, 1)))
        .await
        .expect("the leader acknowledges");
    // A client holding one connection to the leader, through a forwarder that counts them.
    let service = Service::start(replicas[0].grpc).await;
    let mut held = CapacityProviderClient::new(
        wire::endpoint(
            &replicas[0].spec.pki,
            service.addr,
            ClientSecurity::Plaintext,
        )
        .expect("endpoint")
        .connect_timeout(Duration::from_millis(300))
        .timeout(Duration::from_millis(1500))
        .connect_lazy(),
    );
    held.get(get()).await.expect("the leader answers");
    assert_eq!(service.connections.load(Ordering::SeqCst), 1);

    for p in &partitions {
        p.cut();
    }
    let cut = Instant::now();
    let metrics = replicas[0].metrics.unwrap();
    let deadline = cut + Duration::from_secs(10);
    while readyz(metrics).await != 503 {
        assert!(Instant::now() < deadline, "the cut-off leader stayed ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let not_ready = cut.elapsed();
    let new_leader = leader(&replicas[1..], Duration::from_secs(15)).await + 1;
    let took_over = cut.elapsed();
    // The new leader serves what the old one acknowledged.
    let mut new = client(&replicas[new_leader]);
    let machine = new.get(get()).await.expect("the new leader answers");
    assert_ne!(machine.into_inner().state(), pb::MachineState::Speculative);

    // The old one, still cut off, answers nothing as the leader: fresh connections, every
    // kind of answer.
    let mut old = client(&replicas[0]);
    let refused = old
        .get(get())
        .await
        .expect_err("Get on the cut-off replica");
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    let refused = old
        .list(pb::ListFilter::default())
        .await
        .expect_err("List on the cut-off replica");
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    let refused = old
        .create(wire::create_request("fault-spec-001", (SHARD.into(), 1, 2)))
        .await
        .expect_err("Create on the cut-off replica");
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    assert_eq!(
        wire::health(&replicas[0].default_channel().await.unwrap(), "")
            .await
            .expect("health answers"),
        tonic_health::pb::health_check_response::ServingStatus::NotServing
    );
    assert_eq!(readyz(metrics).await, 503);
    // The connection held from before the cut was closed (as a standby closes them), so the
    // client's channel connects again through the forwarder.
    let mut refusals = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while service.connections.load(Ordering::SeqCst) < 2 {
        refusals.push(held.get(get()).await.map(|_| ()).map_err(|s| s.code()));
        assert!(
            Instant::now() < deadline,
            "the old connection stayed open: {refusals:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        refusals.iter().all(Result::is_err),
        "the cut-off replica answered on its old connection: {refusals:?}"
    );
    // And it stays that way while the partition lasts.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let refused = client(&replicas[0])
        .get(get())
        .await
        .expect_err("Get on the cut-off replica, later");
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    assert_eq!(readyz(metrics).await, 503);
    assert!(
        !replicas[0].logs().contains("answering reads from memory"),
        "a partition is no etcd outage"
    );
    eprintln!(
        "partition of the leader from etcd (lease TTL {TTL}): the old leader answered 503 \
         {not_ready:?} after the cut; replica {new_leader} ready {took_over:?} after it"
    );
    drop(partitions);
    drop(cluster);
}

/// Every answer a retry loop saw: (machine, operation id, replica, when).
type Answers = Arc<Mutex<Vec<(String, String, usize, Instant)>>>;

/// Retries of a Create — with the zero token (no fencing) for half the machines, two at once,
/// with a newer fence token on every attempt for the others — sent from before the leader is
/// killed (`kill -9`, while the first attempts are being admitted) until the new leader answers:
/// every answer for a machine, before and after the kill, carries the same operation id (an
/// answer is given only for an operation that is durable), and no operation id is handed to two
/// machines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_across_a_kill_of_the_leader_keep_the_first_acknowledged_operation_id() {
    let (cluster, _, replicas) = three_on_a_new_cluster("/bigfleet/ha-retry", TTL).await;
    let _logs = LogsOnFailure(&replicas);
    let clients: Arc<Vec<CapacityProviderClient<Channel>>> =
        Arc::new(replicas.iter().map(client).collect());
    let sequence = Arc::new(AtomicI64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let answers: Answers = Arc::default();
    let wrong: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut tasks = Vec::new();
    for (i, id) in machine_ids().into_iter().enumerate() {
        let (clients, sequence, stop, answers, wrong) = (
            clients.clone(),
            sequence.clone(),
            stop.clone(),
            answers.clone(),
            wrong.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let zero_token = i % 2 == 0;
            let mut replica = 0;
            while !stop.load(Ordering::SeqCst) {
                let token = || {
                    if zero_token {
                        (String::new(), 0, 0)
                    } else {
                        (
                            SHARD.to_owned(),
                            1,
                            sequence.fetch_add(1, Ordering::SeqCst) + 1,
                        )
                    }
                };
                let at = replica % clients.len();
                let (mut a, mut b) = (clients[at].clone(), clients[at].clone());
                // Zero-token retries race each other; fenced ones go one after the other, as a
                // shard stamps them (two in flight at once may arrive out of order and be
                // fenced, rightly).
                let (first, second) = if zero_token {
                    tokio::join!(
                        a.create(wire::create_request(&id, token())),
                        b.create(wire::create_request(&id, token()))
                    )
                } else {
                    let first = a.create(wire::create_request(&id, token())).await;
                    (first, b.create(wire::create_request(&id, token())).await)
                };
                for answer in [first, second] {
                    match answer {
                        Ok(ack) => answers.lock().unwrap().push((
                            id.clone(),
                            ack.into_inner().operation_id,
                            at,
                            Instant::now(),
                        )),
                        Err(status) if retryable(&status) => replica = at + 1,
                        Err(status) => wrong.lock().unwrap().push(format!(
                            "create {id} answered {:?}: {}",
                            status.code(),
                            status.message()
                        )),
                    }
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }));
    }
    // Kill the leader while the first attempts are being admitted.
    tokio::time::sleep(Duration::from_millis(15)).await;
    replicas[0].signal("KILL").expect("kill -9");
    let killed = Instant::now();
    let deadline = killed + Duration::from_secs(15);
    loop {
        let answered_after: std::collections::HashSet<String> = answers
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, _, replica, at)| *replica != 0 && *at > killed)
            .map(|(id, ..)| id.clone())
            .collect();
        if answered_after.len() == MACHINES {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the new leader did not answer every retry: {answered_after:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = killed.elapsed();
    stop.store(true, Ordering::SeqCst);
    for t in tasks {
        t.await.expect("retry task");
    }
    let wrong = wrong.lock().unwrap();
    assert!(wrong.is_empty(), "wrong answers: {wrong:?}");
    let answers = answers.lock().unwrap();
    let mut per_machine: BTreeMap<&str, &str> = BTreeMap::new();
    let mut owner: HashMap<&str, &str> = HashMap::new();
    let before_kill = answers.iter().filter(|(_, _, r, _)| *r == 0).count();
    for (id, op, replica, _) in answers.iter() {
        let first = *per_machine.entry(id).or_insert(op);
        assert_eq!(
            first, op,
            "{id}: answered {op} by replica {replica} after {first}"
        );
        if let Some(other) = owner.insert(op, id)
            && other != id
        {
            panic!("operation id {op} handed to {other} and to {id}");
        }
    }
    eprintln!(
        "retries across kill -9 of the leader: {} answers ({before_kill} from the killed leader), \
         every machine answered by the new leader {took:?} after the kill, one operation id per \
         machine",
        answers.len()
    );
    drop(cluster);
}

/// A List cursor taken from the leader under load, used after a `kill -9` of that leader on
/// the new one: the answer holds every machine that changed since the cursor (a delta, or the
/// full list a cursor of an earlier term yields), never silently skipping one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_cursor_from_before_a_kill_misses_no_change_on_the_new_leader() {
    let (cluster, _, replicas) = three_on_a_new_cluster("/bigfleet/ha-cursor", TTL).await;
    let _logs = LogsOnFailure(&replicas);
    let (load, tasks) = load_running(&replicas, 30).await;
    let mut old = client(&replicas[0]);
    let at_cursor = old
        .list(pb::ListFilter::default())
        .await
        .expect("the leader lists")
        .into_inner();
    let cursor = at_cursor.revision.clone();
    assert!(!cursor.is_empty(), "a List answers a revision");
    // Changes after the cursor, some of them in flight at the kill.
    let after_cursor = Instant::now();
    while acks_since(&load, after_cursor) < 10 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    replicas[0].signal("KILL").expect("kill -9");
    let killed = Instant::now();
    let new_leader = leader(&replicas[1..], Duration::from_secs(15)).await + 1;
    while acks_since(&load, killed) < 10 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    load.stop.store(true, Ordering::SeqCst);
    for t in tasks {
        t.await.expect("driver task");
    }
    // Nothing changes any more once every machine settled.
    let mut new = client(&replicas[new_leader]);
    let deadline = Instant::now() + Duration::from_secs(20);
    let full = loop {
        let full = new
            .list(pb::ListFilter::default())
            .await
            .expect("the new leader lists")
            .into_inner();
        if full.machines.iter().all(|m| settled(m.state())) {
            break full;
        }
        assert!(Instant::now() < deadline, "machines did not settle");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let delta = new
        .list(pb::ListFilter {
            since_revision: cursor,
            ..Default::default()
        })
        .await
        .expect("the new leader answers the old cursor")
        .into_inner();
    let before: HashMap<&str, &pb::Machine> = at_cursor
        .machines
        .iter()
        .map(|m| (m.id.as_str(), m))
        .collect();
    let in_delta: HashMap<&str, &pb::Machine> =
        delta.machines.iter().map(|m| (m.id.as_str(), m)).collect();
    let mut changed = 0;
    for machine in &full.machines {
        if before.get(machine.id.as_str()) == Some(&machine) {
            continue;
        }
        changed += 1;
        assert_eq!(
            in_delta.get(machine.id.as_str()),
            Some(&machine),
            "{} changed since the cursor ({:?} then, {:?} now) but the answer to the cursor \
             does not show it as it is",
            machine.id,
            before.get(machine.id.as_str()).map(|m| m.state()),
            machine.state()
        );
    }
    assert!(changed > 0, "the load changed machines after the cursor");
    eprintln!(
        "List cursor across kill -9: {changed} machines changed since the cursor, the new leader \
         answered {} machines for it (of {})",
        delta.machines.len(),
        full.machines.len()
    );
    drop(cluster);
}

/// A Configure at the size limit on etcd (default `--max-request-bytes`): the largest
/// `shard_metadata` the leader accepts commits in etcd, one byte more is refused up front with
/// INVALID_ARGUMENT naming `shard_metadata`, and the leader does not step down. The limit is found
/// with a stale fence token, which the size check answers before the fence is consulted, so the
/// search changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configure_at_the_etcd_size_limit_commits_and_one_over_is_invalid_argument() {
    let (cluster, _, replicas) = three_on_a_new_cluster("/bigfleet/ha-limit", DEFAULT_TTL).await;
    let _logs = LogsOnFailure(&replicas);
    let mut leader = client(&replicas[0]);
    let channel = wire::endpoint(
        &replicas[0].spec.pki,
        replicas[0].grpc,
        ClientSecurity::Plaintext,
    )
    .expect("endpoint")
    .timeout(Duration::from_secs(10))
    .connect_lazy();
    let mut big = CapacityProviderClient::new(channel)
        .max_encoding_message_size(8 << 20)
        .max_decoding_message_size(8 << 20);
    let (under_id, over_id) = ("fault-spec-000", "fault-spec-001");
    let mut sequence = 0;
    let mut next = || {
        sequence += 1;
        (SHARD.to_owned(), 1, sequence)
    };
    for id in [under_id, over_id] {
        leader
            .create(wire::create_request(id, next()))
            .await
            .expect("create");
    }
    let metadata = |bytes: usize| -> HashMap<String, String> {
        [("blob".to_owned(), "x".repeat(bytes))]
            .into_iter()
            .collect()
    };
    // Smallest refused size, with a stale token (sequence 0 is behind every mark here).
    let stale = (SHARD.to_owned(), 1, 0);
    let (mut fits, mut refused) = (1024usize, 3 << 20);
    while refused - fits > 1 {
        let size = (fits + refused) / 2;
        let answer = big
            .configure(wire::configure_request(
                under_id,
                "ha-cluster",
                metadata(size),
                stale.clone(),
            ))
            .await
            .expect_err("a stale token is never accepted");
        match answer.code() {
            Code::InvalidArgument => {
                assert!(answer.message().contains("shard_metadata"), "{answer:?}");
                refused = size;
            }
            Code::FailedPrecondition => fits = size,
            other => panic!("configure of {size} bytes answered {other:?}: {answer:?}"),
        }
    }
    assert!(
        (1_400_000..1_572_864).contains(&fits),
        "the largest shard_metadata accepted is {fits} bytes"
    );
    for id in [under_id, over_id] {
        let deadline = Instant::now() + Duration::from_secs(10);
        while leader
            .get(pb::MachineRef { id: id.into() })
            .await
            .expect("get")
            .into_inner()
            .state()
            != pb::MachineState::Idle
        {
            assert!(Instant::now() < deadline, "{id} never Idle");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let accepted = big
        .configure(wire::configure_request(
            under_id,
            "ha-cluster",
            metadata(fits),
            next(),
        ))
        .await
        .expect("the largest accepted record commits in etcd");
    assert_eq!(
        accepted.into_inner().machine.unwrap().state(),
        pb::MachineState::Configuring
    );
    let over = big
        .configure(wire::configure_request(
            over_id,
            "ha-cluster",
            metadata(refused),
            next(),
        ))
        .await
        .expect_err("one byte more is refused");
    assert_eq!(over.code(), Code::InvalidArgument, "{over:?}");
    assert!(over.message().contains("shard_metadata"), "{over:?}");
    // The leader leads on: it acknowledges the next mutation and never stepped down.
    leader
        .drain(wire::drain_request(over_id, next()))
        .await
        .expect_err("an Idle machine is not drained");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let machine = big
            .get(pb::MachineRef {
                id: under_id.into(),
            })
            .await
            .expect("get")
            .into_inner();
        if machine.state() == pb::MachineState::Configured {
            assert_eq!(machine.shard_metadata["blob"].len(), fits);
            break;
        }
        assert!(Instant::now() < deadline, "{under_id} never Configured");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    leader
        .configure(wire::configure_request(
            over_id,
            "ha-cluster",
            HashMap::new(),
            next(),
        ))
        .await
        .expect("the leader acknowledges on");
    assert_eq!(readyz(replicas[0].metrics.unwrap()).await, 200);
    assert!(
        !replicas[0].logs().contains("no longer held"),
        "the leader stepped down"
    );
    eprintln!(
        "size limit on etcd: shard_metadata of {fits} bytes committed, {refused} refused with \
         INVALID_ARGUMENT; the leader led on"
    );
    drop(cluster);
}

/// The deterministic case of a retry across a failover: the leader is cut off from etcd (its
/// proxies black-hole), a zero-token Create is admitted there but its commit never reaches
/// etcd, and its retry arrives while the claim is still valid. Neither may be acknowledged, nor
/// shown by a Get: the
/// operation is not durable, and the new leader, which never heard of it, continues the
/// operation counter from etcd (an answer from the cut-off leader would hand out an operation id
/// that the new leader then issues again for another operation).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_on_a_leader_whose_commit_hangs_is_answered_only_once_durable() {
    let cluster = blocking(|| Cluster::start(3));
    let prefix = "/bigfleet/ha-hang";
    let (partitions, cut_off) = behind_partitions(&cluster, prefix).await;
    let replicas = three_over(&cut_off, &cluster.state(prefix), TTL).await;
    let _logs = LogsOnFailure(&replicas);
    let id = "fault-spec-000";
    let zero = || (String::new(), 0, 0);
    for p in &partitions {
        p.cut();
    }
    // The first attempt: admitted, its commit hangs.
    let original = tokio::spawn({
        let mut old = client(&replicas[0]);
        async move {
            old.create(wire::create_request(id, (String::new(), 0, 0)))
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    // A read there does not show the admitted Create either: it is not durable.
    let read = client(&replicas[0])
        .get(pb::MachineRef { id: id.into() })
        .await
        .map(|m| m.into_inner().state());
    assert!(
        !matches!(read, Ok(pb::MachineState::Creating)),
        "the cut-off leader showed a Create that never became durable: {read:?}"
    );
    // Its retry, while the claim is still valid.
    let retried = client(&replicas[0])
        .create(wire::create_request(id, zero()))
        .await
        .map(|ack| ack.into_inner().operation_id);
    let original = original
        .await
        .expect("first attempt")
        .map(|ack| ack.into_inner().operation_id);
    // The new leader answers the retry.
    let new_leader = leader(&replicas[1..], Duration::from_secs(15)).await + 1;
    let deadline = Instant::now() + Duration::from_secs(10);
    let answered = loop {
        match client(&replicas[new_leader])
            .create(wire::create_request(id, zero()))
            .await
        {
            Ok(ack) => break ack.into_inner().operation_id,
            Err(status) => assert!(retryable(&status), "{status:?}"),
        }
        assert!(Instant::now() < deadline, "the new leader never answered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!(
        "retry on a leader whose commit hangs: the cut-off leader answered the Create {:?} and \
         its retry {:?}; the new leader answered {answered}",
        original.as_ref().map_err(|s| s.code()),
        retried.as_ref().map_err(|s| s.code()),
    );
    for (what, answer) in [("the Create", &original), ("its retry", &retried)] {
        match answer {
            Ok(op) => panic!(
                "the cut-off leader acknowledged {what} with {op}, which never became durable \
                 (the new leader answered {answered})"
            ),
            Err(status) => assert!(retryable(status), "{what}: {status:?}"),
        }
    }
    drop(partitions);
    drop(cluster);
}

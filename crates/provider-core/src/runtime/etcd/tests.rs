//! The etcd store against a real etcd: round trips, the transaction limits, the claim and its
//! guard, export/import both ways, a killed etcd member, and `kill -9` of a child process
//! committing through the store.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::testing::{Cluster, args};
use super::*;
use crate::persistence::test_support::{self, counters, fence, mark_of};
use crate::rules::fence::HighWaterMark;
use crate::rules::machine::{Machine, MachineState};
use crate::rules::records::Slot;

fn runtime() -> tokio::runtime::Runtime {
    crate::runtime::engine::test_support::runtime(2)
}

fn slot(id: &str, last_change: i64) -> Slot {
    let mut machine = Machine::speculative(id, "cx22");
    machine.zone = "fsn1".into();
    Slot {
        machine: Arc::new(machine),
        last_change,
        operations: [Some(format!("op-{last_change}")), None, None, None],
        sealed: None,
        enrollment: None,
        retired: None,
    }
}

/// The claim on `/bigfleet/test`, if any.
async fn owner(cluster: &Cluster) -> Option<Vec<u8>> {
    let mut kv = cluster.client().kv();
    let found = kv
        .range(pb::RangeRequest {
            key: b"/bigfleet/test/owner".to_vec(),
            ..Default::default()
        })
        .await
        .expect("range")
        .into_inner();
    found.kvs.into_iter().next().map(|kv| kv.value)
}

async fn commit(store: &EtcdStore, batch: Vec<Change>) -> Result<(), StoreError> {
    store.submit(batch).wait().await
}

#[test]
fn parses_state_addresses_and_names_the_flag_in_errors() {
    let t = target::parse("etcd://a:1,b/bigfleet/fsn1/").expect("parse");
    assert_eq!(t.endpoints, vec!["a:1".to_owned(), "b:2379".to_owned()]);
    assert_eq!(t.prefix, "/bigfleet/fsn1");
    let t = target::parse("etcd://[::1]:2379,[::1]/p").expect("ipv6");
    assert_eq!(
        t.endpoints,
        vec!["[::1]:2379".to_owned(), "[::1]:2379".to_owned()]
    );
    for (bad, why) in [
        ("etcd://a:2379", "prefix is required"),
        ("etcd://a:2379/", "prefix is required"),
        ("etcd://a:0/p", "invalid port"),
        ("etcd://a:x/p", "invalid port"),
        ("etcd://a,,b/p", "endpoint is empty"),
        ("etcd://u@a/p", "not HOST:PORT"),
        ("etcd://a/p//q", "empty path segment"),
    ] {
        let e = target::parse(bad).expect_err(bad);
        assert!(e.starts_with("--state ") && e.contains(why), "{bad}: {e}");
    }
    let mut a = args();
    assert!(validate_with_state("etcd://a/p", &a).is_ok());
    a.etcd_cert = "c.pem".into();
    assert!(
        validate_with_state("etcd://a/p", &a)
            .unwrap_err()
            .contains("--etcd-key")
    );
    a.etcd_key = "k.pem".into();
    assert!(
        validate_with_state("etcd://a/p", &a)
            .unwrap_err()
            .contains("--etcd-ca")
    );
    let a = EtcdArgs {
        etcd_ca: "ca.pem".into(),
        ..args()
    };
    let e = validate_with_state("/var/lib/state", &a).unwrap_err();
    assert!(e.contains("--etcd-ca is set"), "{e}");
    let zero_ttl = EtcdArgs {
        etcd_lease_ttl: Duration::ZERO,
        ..args()
    };
    let e = validate_with_state("etcd://a/p", &zero_ttl).unwrap_err();
    assert!(e.contains("--etcd-lease-ttl"), "{e}");
    let small = EtcdArgs {
        etcd_max_request_bytes: 1000,
        ..args()
    };
    let e = validate_with_state("etcd://a/p", &small).unwrap_err();
    assert!(e.contains("--etcd-max-request-bytes"), "{e}");
    let e = validate_with_state(
        "etcd://a/p",
        &EtcdArgs {
            etcd_ca: "/nonexistent/ca.pem".into(),
            ..args()
        },
    )
    .and_then(|()| {
        target::connect(
            &target::parse("etcd://a/p").expect("parse"),
            &EtcdArgs {
                etcd_ca: "/nonexistent/ca.pem".into(),
                ..args()
            },
        )
        .map(|_| ())
    })
    .unwrap_err();
    assert!(e.starts_with("--etcd-ca /nonexistent/ca.pem"), "{e}");
}

#[test]
fn whole_batches_share_a_transaction_and_only_an_oversized_batch_is_split() {
    let keys = Keys::new("/p");
    // 50 batches of 3 writes and counters: packed into transactions of whole batches.
    let batches: Vec<Vec<Change>> = (0..50)
        .map(|n| {
            vec![
                Change::PutSlot(slot(&format!("m{n}"), n)),
                fence("s", &format!("m{n}"), 1, n),
                Change::RemoveSlot(format!("gone{n}")),
                counters(n, n as u64),
            ]
        })
        .collect();
    let txns = plan(&keys, batches, TxnLimits::DEFAULT);
    assert!(
        txns.len() > 1,
        "150 writes and counters need more than one transaction"
    );
    let mut seen_slots = 0;
    for ops in &txns {
        assert!(ops.len() <= MAX_TXN_OPS);
        // Each batch's three writes land in one transaction.
        let puts = ops
            .iter()
            .filter(|o| matches!(&o.request, Some(Request::RequestPut(p)) if p.key.starts_with(b"/p/m/")))
            .count();
        let deletes = ops
            .iter()
            .filter(|o| matches!(o.request, Some(Request::RequestDeleteRange(_))))
            .count();
        assert_eq!(puts, deletes);
        seen_slots += puts;
        // The counters come first.
        assert!(matches!(&ops[0].request, Some(Request::RequestPut(p)) if p.key == b"/p/meta"));
    }
    assert_eq!(seen_slots, 50);
    // One batch of 300 machines: split within the limits, counters first, fences before
    // machines.
    let mut big: Vec<Change> = (0..300)
        .map(|n| Change::PutSlot(slot(&format!("m{n:03}"), n)))
        .collect();
    big.push(fence("s", "m000", 1, 1));
    big.push(counters(300, 9));
    let txns = plan(&keys, vec![big], TxnLimits::DEFAULT);
    assert_eq!(txns.len(), 3);
    let flat: Vec<&[u8]> = txns
        .iter()
        .flatten()
        .map(|o| match &o.request {
            Some(Request::RequestPut(p)) => p.key.as_slice(),
            _ => panic!("only puts"),
        })
        .collect();
    assert_eq!(flat[0], b"/p/meta");
    assert!(flat[1].starts_with(b"/p/f/"));
    assert!(flat[2..].iter().all(|k| k.starts_with(b"/p/m/")));
    assert!(txns.iter().all(|t| t.len() <= MAX_TXN_OPS));
    // Bytes: 8 machines of 300 KB labels cannot share one 1.5 MiB request.
    let heavy: Vec<Change> = (0..8)
        .map(|n| {
            let mut s = slot(&format!("h{n}"), n);
            Arc::make_mut(&mut s.machine)
                .labels
                .insert("blob".into(), "x".repeat(300_000));
            Change::PutSlot(s)
        })
        .collect();
    let txns = plan(&keys, vec![heavy], TxnLimits::DEFAULT);
    assert!(txns.len() >= 2);
    for ops in &txns {
        assert!(ops.iter().map(op_size).sum::<usize>() <= MAX_TXN_BYTES);
    }
}

#[test]
fn commits_survive_a_restart_and_large_groups_fit_the_etcd_limits() {
    let cluster = Cluster::start(1);
    let state = cluster.state("/bigfleet/test");
    let rt = runtime();
    rt.block_on(async {
        let store = EtcdStore::open(&state, &args()).await.expect("open");
        assert!(store.load().expect("load").is_fresh());
        assert!(store.load().is_err(), "a second load is refused");
        commit(
            &store,
            vec![
                Change::PutSlot(slot("a", 1)),
                fence("s/1", "a", 2, 3),
                counters(1, 5),
            ],
        )
        .await
        .expect("commit");
        commit(
            &store,
            vec![
                Change::PutSlot(slot("b", 2)),
                Change::RemoveSlot("a".into()),
                fence("s/2", "ghost", 1, 1),
                counters(2, 6),
            ],
        )
        .await
        .expect("commit");
        // 1,000 machines of 4 KiB each in one batch: 1,001 writes and about 4 MiB, far over
        // etcd's 128 operations and 1.5 MiB per request.
        let big: Vec<Change> = (0..1000)
            .map(|n| {
                let mut s = slot(&format!("big-{n:04}"), 3);
                Arc::make_mut(&mut s.machine)
                    .labels
                    .insert("note".into(), "y".repeat(4096));
                Change::PutSlot(s)
            })
            .chain([counters(3, 7)])
            .collect();
        commit(&store, big)
            .await
            .expect("a batch over the limits commits in parts");
        // An evicted mark of an unknown id is deleted from the prefix.
        commit(
            &store,
            vec![Change::RemoveFence {
                shard_id: "s/2".into(),
                machine_id: "ghost".into(),
            }],
        )
        .await
        .expect("commit");
        // Concurrent batches commit in groups.
        let store = Arc::new(store);
        let mut tasks = Vec::new();
        for t in 0..16 {
            let store = store.clone();
            tasks.push(tokio::spawn(async move {
                for n in 0..10 {
                    commit(
                        &store,
                        vec![fence("c", &format!("t{t}"), 1, n), counters(4, 8)],
                    )
                    .await
                    .expect("commit");
                }
            }));
        }
        for t in tasks {
            t.await.expect("task");
        }
        store.flush().wait().await.expect("flush");
        // Dropping the store (as at the end of a provider's run) revokes the claim.
        drop(store);
        assert!(owner(&cluster).await.is_none(), "the claim was released");

        let reopened = EtcdStore::open(&state, &args())
            .await
            .expect("reopen at once: the claim was released");
        let s = reopened.load().expect("load");
        assert_eq!((s.revision, s.next_op), (4, 8));
        assert_eq!(s.slots.len(), 1001);
        assert!(s.slots.iter().all(|slot| slot.machine.id != "a"));
        let b = s
            .slots
            .iter()
            .find(|slot| slot.machine.id == "b")
            .expect("b");
        assert_eq!(b, &slot("b", 2));
        assert_eq!(
            mark_of(&s, "s/1", "a"),
            Some(HighWaterMark {
                epoch: 2,
                sequence: 3
            })
        );
        for t in 0..16 {
            assert_eq!(
                mark_of(&s, "c", &format!("t{t}")).map(|m| m.sequence),
                Some(9)
            );
        }
        assert_eq!(
            mark_of(&s, "s/2", "ghost"),
            None,
            "the evicted mark is gone"
        );
        assert!(owner(&cluster).await.is_some());
        reopened.release().wait().await.expect("release");
        assert!(owner(&cluster).await.is_none(), "release revoked the claim");
        let e = commit(&reopened, vec![counters(5, 9)])
            .await
            .expect_err("after release");
        assert!(e.0.contains("stopped"), "{e}");
    });
}

#[test]
fn a_second_provider_is_refused_and_a_lost_claim_stops_every_commit() {
    let cluster = Cluster::start(1);
    let state = cluster.state("/bigfleet/claim");
    let rt = runtime();
    rt.block_on(async {
        let first = EtcdStore::open(&state, &args()).await.expect("open");
        first.load().expect("load");
        let started = Instant::now();
        let e = EtcdStore::open(&state, &args())
            .await
            .expect_err("second provider");
        assert!(
            e.contains("in use by another provider") && e.contains("pid "),
            "{e}"
        );
        assert!(
            started.elapsed() >= Duration::from_secs(2),
            "it waited for the claim to expire"
        );
        commit(&first, vec![counters(1, 1)])
            .await
            .expect("the first still commits");

        // Someone else takes the prefix over (as a new leader would after this one's lease
        // ran out): the guarded commit is refused, and so is every later one.
        let mut kv = cluster.client().kv();
        kv.put(pb::PutRequest {
            key: b"/bigfleet/claim/owner".to_vec(),
            value: b"another provider".to_vec(),
            lease: 0,
        })
        .await
        .expect("put");
        let e = commit(&first, vec![counters(2, 2)])
            .await
            .expect_err("refused");
        assert!(e.0.contains("no longer holds the claim"), "{e}");
        let e = commit(&first, vec![counters(3, 3)])
            .await
            .expect_err("still refused");
        assert!(e.0.contains("claim"), "{e}");
        let meta = kv
            .range(pb::RangeRequest {
                key: b"/bigfleet/claim/meta".to_vec(),
                ..Default::default()
            })
            .await
            .expect("range")
            .into_inner();
        assert_eq!(
            keys::decode_meta(&meta.kvs[0].value).expect("meta"),
            Meta {
                revision: 1,
                next_op: 1
            },
            "nothing after the takeover was written"
        );
    });
}

#[test]
fn commits_continue_when_the_etcd_leader_is_killed_and_when_it_returns() {
    let mut cluster = Cluster::start(3);
    let state = cluster.state("/bigfleet/member");
    let rt = runtime();
    rt.block_on(async {
        // A lease longer than an etcd election, as in production (the default is 3 s).
        let args = EtcdArgs {
            etcd_lease_ttl: Duration::from_secs(3),
            ..args()
        };
        let store = EtcdStore::open(&state, &args).await.expect("open");
        store.load().expect("load");
        let mut killed = None;
        for n in 0..30u64 {
            if n == 5 {
                // The request in flight, or the next one, meets the election ("request timed
                // out", unavailable) and is retried.
                let leader = cluster.leader().await;
                cluster.members[leader].kill();
                killed = Some(leader);
            }
            if n == 20 {
                cluster.restart(killed.expect("killed"));
            }
            commit(
                &store,
                vec![fence("s", "m", 1, n as i64), counters(n as i64, n)],
            )
            .await
            .unwrap_or_else(|e| panic!("commit {n}: {e}"));
        }
        drop(store);
        let s = EtcdStore::open(&state, &args)
            .await
            .expect("reopen")
            .load()
            .expect("load");
        assert_eq!(mark_of(&s, "s", "m").map(|m| m.sequence), Some(29));
    });
}

#[test]
fn import_and_export_move_a_state_between_a_directory_and_etcd() {
    let cluster = Cluster::start(1);
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("state");
    let mut configured = slot("c", 7);
    {
        let m = Arc::make_mut(&mut configured.machine);
        m.state = MachineState::Configured;
        m.cluster = "k8s-1".into();
        m.shard_metadata.insert("shard".into(), "s-1".into());
    }
    configured.operations = [Some("op-3".into()), Some("op-7".into()), None, None];
    let original = {
        let store = crate::persistence::durable::DurableStore::open(&dir).expect("open dir");
        store.load().expect("load");
        let batch = vec![
            Change::PutSlot(slot("a", 2)),
            Change::PutSlot(configured),
            fence("shard/1", "a", 3, 4),
            fence("shard-2", "c", 1, 9),
            counters(7, 8),
        ];
        runtime()
            .block_on(store.submit(batch).wait())
            .expect("commit");
        crate::persistence::durable::export_json(&dir).expect("export dir")
    };
    let state = cluster.state("/bigfleet/moved");
    let dir_str = dir.to_str().expect("utf-8").to_owned();
    let rt = runtime();
    rt.block_on(async {
        let summary = import(&dir_str, &state, &args())
            .await
            .expect("import into etcd");
        assert!(
            summary.contains("imported 2 machines, 2 fence marks, revision 7 and next operation 8"),
            "{summary}"
        );
        let exported = export_json(&state, &args()).await.expect("export etcd");
        let strip = |json: &str| {
            let mut v: serde_json::Value = serde_json::from_str(json).expect("json");
            v.as_object_mut().expect("object").remove("source");
            v
        };
        assert_eq!(
            strip(&exported),
            strip(&original),
            "etcd holds exactly the directory's state"
        );

        // A provider on the imported prefix continues the counters.
        {
            let store = EtcdStore::open(&state, &args()).await.expect("open");
            let s = store.load().expect("load");
            assert_eq!((s.revision, s.next_op), (7, 8));
            assert_eq!(
                mark_of(&s, "shard/1", "a"),
                Some(HighWaterMark {
                    epoch: 3,
                    sequence: 4
                })
            );
            // Importing again over it is refused while it runs (claimed) ...
            let e = import(&dir_str, &state, &args())
                .await
                .expect_err("claimed");
            assert!(e.contains("in use by another provider"), "{e}");
        }
        // ... and after it stopped, because the prefix holds a state.
        let e = import(&dir_str, &state, &args())
            .await
            .expect_err("not empty");
        assert!(e.contains("already holds a state"), "{e}");

        // Back out of etcd into a new directory.
        let back = tmp.path().join("back");
        let back_str = back.to_str().expect("utf-8").to_owned();
        import(&state, &back_str, &args())
            .await
            .expect("import into a directory");
        let round = crate::persistence::durable::export_json(&back).expect("export back");
        assert_eq!(strip(&round), strip(&original));
        let e = import(&state, &back_str, &args())
            .await
            .expect_err("not empty");
        assert!(e.contains("already holds a state"), "{e}");
        let e = import(&dir_str, &back_str, &args())
            .await
            .expect_err("dir to dir");
        assert!(e.contains("etcd://"), "{e}");
        let e = import(&cluster.state("/bigfleet/empty"), &back_str, &args())
            .await
            .expect_err("empty source");
        assert!(e.contains("holds no state"), "{e}");

        // A prefix with machines but no counters (an import cut short) is never taken for a
        // state: opening it fails and says why.
        let mut kv = cluster.client().kv();
        kv.put(pb::PutRequest {
            key: b"/bigfleet/cut/m/x".to_vec(),
            value: keys::encode_slot(&slot("x", 1)),
            lease: 0,
        })
        .await
        .expect("put");
        let e = EtcdStore::open(&cluster.state("/bigfleet/cut"), &args())
            .await
            .expect_err("cut");
        assert!(e.contains("interrupted `state import`"), "{e}");
    });
}

// --- kill -9 ------------------------------------------------------------------------------

const CHILD_STATE: &str = "BIGFLEET_ETCD_CRASH_STATE";
const CHILD_ROUND: &str = "BIGFLEET_ETCD_CRASH_ROUND";
const CHILD_TASKS: i64 = 6;

/// Mutation `n` of a task, with the counters moved along.
fn crash_batch(round: i64, task: i64, n: i64) -> Vec<Change> {
    let counters = counters(round * 1_000_000 + n, (round * 1_000_000 + n) as u64);
    test_support::batch(round, task, n, slot, Some(counters))
}

/// The child side of the crash test: started by [`kill_9_loses_no_acknowledged_mutation`]
/// with the environment set; otherwise there is nothing to do.
#[test]
fn crash_test_child() {
    let (Ok(state), Ok(round)) = (std::env::var(CHILD_STATE), std::env::var(CHILD_ROUND)) else {
        return;
    };
    let round: i64 = round.parse().expect("round");
    runtime().block_on(async {
        let store = Arc::new(EtcdStore::open(&state, &args()).await.expect("open"));
        store.load().expect("load");
        test_support::commit_until_killed(round, CHILD_TASKS, move |task, n| {
            let store = store.clone();
            async move {
                commit(&store, crash_batch(round, task, n))
                    .await
                    .expect("commit")
            }
        })
        .await;
    });
}

#[test]
fn kill_9_loses_no_acknowledged_mutation() {
    let cluster = Cluster::start(1);
    let state = cluster.state("/bigfleet/crash");
    let mut acked = test_support::Acked::new();
    let rt = runtime();
    for round in 0..4i64 {
        // The child claims the prefix once the killed one's lease ran out (about 1 s).
        test_support::Round {
            test: "runtime::etcd::tests::crash_test_child",
            env: (CHILD_STATE, &state),
            round_var: CHILD_ROUND,
            round,
            enough: |lines| lines.len() >= 20,
            within: Duration::from_secs(20),
            short: "too little",
            max_pause: Duration::from_millis(200),
        }
        .kill_child(&mut acked);
        // Read what etcd holds (without claiming: the killed child's lease is still alive).
        let s = rt
            .block_on(async { read_state(&cluster.client(), &Keys::new("/bigfleet/crash")).await })
            .expect("read");
        test_support::check_acknowledged(&s, &acked, |t| {
            let id = test_support::slot_id(t.round, t.task, t.newest);
            assert_eq!(
                t.slots.get(id.as_str()).map(|x| x.last_change),
                Some(t.newest)
            );
        });
        assert!(
            s.next_op >= (round * 1_000_000) as u64,
            "counters went back"
        );
    }
    assert_eq!(acked.len(), 4 * CHILD_TASKS as usize);
}

// --- the engine over the etcd store ---------------------------------------------------------

mod engine_restart {
    use std::sync::Arc;
    use std::time::Duration;

    use super::super::testing::{Cluster, args};
    use super::super::{EtcdStore, pb};
    use crate::persistence::store::SharedStore;
    use crate::rules::error::CoreError;
    use crate::rules::fence::FenceToken;
    use crate::rules::machine::MachineState;
    use crate::runtime::engine::Engine;
    use crate::runtime::engine::test_support::{self, SlotBackend, settle};

    fn token(epoch: i64, sequence: i64) -> FenceToken {
        FenceToken {
            shard_id: "shard-e".into(),
            epoch,
            sequence,
        }
    }

    async fn start(state: &str, stuck: &[&str]) -> Arc<Engine> {
        let store: SharedStore = Arc::new(EtcdStore::open(state, &args()).await.expect("open"));
        // Four slots; a Create of a machine in `stuck` waits until cancelled.
        let backend = Arc::new(
            SlotBackend::new(test_support::slots("e", 4, "fsn1"))
                .provider("etcd-test")
                .holding(stuck),
        );
        test_support::start_on(store, backend, "etcd_test").await
    }

    fn number(op: &str) -> u64 {
        op.trim_start_matches("op-").parse().expect("op number")
    }

    #[test]
    fn a_restart_on_etcd_keeps_fences_and_op_ids_resumes_creates_and_a_lost_claim_is_unavailable() {
        let cluster = Cluster::start(1);
        let state = cluster.state("/bigfleet/engine");
        let rt = super::runtime();
        rt.block_on(async {
            let engine = start(&state, &["e-1"]).await;
            let created = engine.create("e-0", token(1, 1)).await.expect("create");
            settle(&engine, "e-0", MachineState::Idle).await;
            let interrupted = engine.create("e-1", token(1, 2)).await.expect("create");
            // The grace runs out with e-1 still creating: it stays Creating in etcd.
            assert_eq!(engine.shutdown(Duration::from_millis(20)).await, 1);
            drop(engine);

            let engine = start(&state, &[]).await;
            assert_eq!(
                engine.get("e-0").expect("get").host.clone().map(|h| h.id),
                Some("h-e-0".to_owned())
            );
            // The interrupted create is resumed under its operation id.
            settle(&engine, "e-1", MachineState::Idle).await;
            let retry = engine.create("e-1", token(1, 3)).await.expect("retry");
            assert!(!retry.accepted);
            assert_eq!(retry.operation_id, interrupted.operation_id);
            // The fence marks survived.
            let replay = engine.delete("e-0", token(1, 1)).await;
            assert!(
                matches!(replay, Err(CoreError::Fenced { .. })),
                "{replay:?}"
            );
            let drained = engine
                .configure(
                    "e-0",
                    "c-1".into(),
                    b"blob".to_vec(),
                    Default::default(),
                    token(1, 2),
                )
                .await
                .expect("configure");
            assert!(number(&drained.operation_id) > number(&interrupted.operation_id));
            assert!(number(&interrupted.operation_id) > number(&created.operation_id));
            settle(&engine, "e-0", MachineState::Configured).await;

            // Another provider takes the prefix over: this one's next mutation is refused
            // as UNAVAILABLE and nothing more is acknowledged.
            let mut kv = cluster.client().kv();
            kv.put(pb::PutRequest {
                key: b"/bigfleet/engine/owner".to_vec(),
                value: b"someone else".to_vec(),
                lease: 0,
            })
            .await
            .expect("put");
            let refused = engine
                .create("e-2", token(1, 4))
                .await
                .expect_err("refused");
            assert!(matches!(refused, CoreError::Store(_)), "{refused:?}");
            assert_eq!(
                tonic::Status::from(refused).code(),
                tonic::Code::Unavailable
            );
            let again = engine
                .create("e-3", token(1, 5))
                .await
                .expect_err("refused");
            assert!(matches!(again, CoreError::Store(_)), "{again:?}");
            engine.shutdown(Duration::from_secs(1)).await;
        });
    }
}

/// A standby's copy, kept by the watch through puts, overwrites and deletes, hands over exactly
/// the state a full read returns, and the follower stops with it.
#[test]
fn a_followers_copy_hands_over_the_state_a_full_read_returns() {
    let cluster = Cluster::start(1);
    let state = cluster.state("/bigfleet/follow");
    let rt = runtime();
    rt.block_on(async {
        let store = EtcdStore::open(&state, &args()).await.expect("open");
        store.load().expect("load");
        let keys = Keys::new("/bigfleet/follow");
        let warm = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let follower = follow::Follower::start(cluster.client(), keys.clone(), warm.clone());
        let within = Instant::now() + Duration::from_secs(10);
        while !warm.load(std::sync::atomic::Ordering::SeqCst) {
            assert!(
                Instant::now() < within,
                "the follower never read the prefix"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for round in 1..=5_i64 {
            // 40 machines, then overwrites of ten and one removal per round.
            let written = if round == 1 { 40 } else { 10 };
            let mut batch: Vec<Change> = (0..written)
                .map(|n| Change::PutSlot(slot(&format!("m-{n:02}"), round * 100 + n)))
                .collect();
            if round > 1 {
                batch.push(Change::RemoveSlot(format!("m-{:02}", round * 7)));
            }
            batch.push(fence("s/1", &format!("m-{round}"), round, round));
            batch.push(counters(round, round as u64 * 10));
            commit(&store, batch).await.expect("commit");
        }
        let mut kv = cluster.client().kv();
        let head = kv
            .range(pb::RangeRequest {
                key: keys.meta(),
                ..Default::default()
            })
            .await
            .expect("range")
            .into_inner()
            .header
            .expect("header")
            .revision;
        let copied = follower
            .into_snapshot_at(&keys, head, Duration::from_secs(10))
            .await
            .expect("the copy reached the head revision");
        assert!(
            !warm.load(std::sync::atomic::Ordering::SeqCst),
            "the follower stopped"
        );
        let read = read_state(&cluster.client(), &keys).await.expect("read");
        assert_eq!(copied, read);
        assert_eq!(copied.slots.len(), 36, "40 machines less the 4 removed");
        assert_eq!(copied.slots[0].last_change, 500, "m-00 as last overwritten");
        assert_eq!((copied.revision, copied.next_op), (5, 50));
    });
}

fn claim_granted(ago: Duration, ttl: Duration) -> Claim {
    Claim {
        lease: 7,
        token: b"token".to_vec(),
        ttl,
        granted_at: Instant::now() - ago,
        revision: 1,
    }
}

#[test]
fn a_lapsed_hold_says_how_long_no_keep_alive_was_confirmed() {
    let lapsed = Hold::new(&claim_granted(
        Duration::from_secs(5),
        Duration::from_secs(2),
    ));
    assert!(!lapsed.is_held());
    let why = lapsed.loss();
    assert!(why.contains("etcd confirmed was sent 5"), "{why}");
    assert!(why.contains("at most 1600 ms"), "{why}");

    let fresh = Hold::new(&claim_granted(Duration::ZERO, Duration::from_secs(60)));
    assert!(fresh.is_held());
    fresh.lose("etcd refused a commit");
    fresh.lose("a later reason");
    assert!(!fresh.is_held());
    assert_eq!(
        fresh.loss(),
        "etcd refused a commit",
        "the first reason stays"
    );
}

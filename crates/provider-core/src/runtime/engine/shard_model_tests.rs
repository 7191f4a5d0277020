//! BigFleet's shard as a test oracle. [`ShardModel`] is written from the shard's own code
//! (intUnderflow/bigfleet `pkg/machine/machine.go`, `pkg/shard/reconcile.go`,
//! `pkg/shard/execute.go`): its transition table, `inventory.Apply` ignoring a report that is
//! not an edge from the state it holds, a full reconcile dropping the ids a List no longer
//! returns, an incremental one (List since a revision) dropping nothing, and a Create answered
//! with an error marking the machine Failed. Every answer of the engine in these tests goes
//! through a full-reconcile model and an incremental one; a refused edge fails the test, as does
//! a machine a model holds in a state the provider no longer reports for it at the end.
//!
//! The property test drives an engine over the offerings-driven fleet on the fake cloud with
//! random interleavings of every RPC, stockouts, restocks, probes (the paused clock passing the
//! backoff), account-limit changes, releases, hosts deleted behind the provider's back,
//! reconciles and restarts on a durable state, with Lists of both kinds at random points.

use std::time::Duration;

use proptest::prelude::*;

use super::test_support::zero;
use super::*;
use crate::observability::telemetry::Telemetry;
use crate::provisioning::fake::FakeCloud;
use crate::provisioning::fleet::{CapacityBook, Fleet, PriceBook, test_fleet};
use crate::provisioning::offerings::default_mix;
use crate::provisioning::stockout::StockoutBackoff;
use shard_model::{ShardModel, State};

fn state(s: MachineState) -> State {
    State::from_wire(s.wire())
}

/// What the model side of these tests does with an engine: its Lists, its acks, its Gets.
trait Follows {
    fn reconcile(&mut self, engine: &Engine);
    fn answer(&mut self, kind: OperationKind, id: &str, answer: &Result<Ack, CoreError>);
    fn verdict(&self, engine: &Engine) -> Result<(), String>;
}

impl Follows for ShardModel {
    fn reconcile(&mut self, engine: &Engine) {
        let listing = engine.list(&ListQuery {
            since_revision: self.since(),
            ..ListQuery::default()
        });
        let machines: Vec<(String, State)> = listing
            .machines
            .iter()
            .map(|m| (m.id.clone(), state(m.state)))
            .collect();
        self.read_list(&machines, listing.revision.to_string().into_bytes());
    }

    fn answer(&mut self, kind: OperationKind, id: &str, answer: &Result<Ack, CoreError>) {
        match answer {
            Ok(ack) => self.apply(id, state(ack.machine.state), "ack"),
            Err(_) if kind == OperationKind::Create => self.create_refused(id),
            Err(_) => {}
        }
    }

    fn verdict(&self, engine: &Engine) -> Result<(), String> {
        self.verdict_with(|id| engine.get(id).ok().map(|m| state(m.state)))
    }
}

/// One step of a scenario.
#[derive(Clone, Debug)]
enum Step {
    /// A shard's Create on a machine it holds Speculative (`pick` chooses which, and which
    /// model's view).
    Create {
        pick: usize,
        incremental: bool,
    },
    Configure {
        pick: usize,
    },
    Drain {
        pick: usize,
    },
    Delete {
        pick: usize,
    },
    /// Get of a machine a shard holds.
    Get {
        pick: usize,
    },
    /// Both shards reconcile.
    List,
    /// Offering `a/z1` (`0`) or `b/z1` (`1`) sold out or sold again.
    SoldOut {
        offering: usize,
        sold_out: bool,
    },
    /// The account's host limit (`None`: unlimited), read at once.
    Limit(Option<usize>),
    /// `admin failed release` of a FAILED machine.
    Release {
        pick: usize,
    },
    /// A host deleted behind the provider's back.
    LoseHost {
        pick: usize,
    },
    /// A provider reconcile pass.
    Reconcile,
    /// Time passes (minutes, on the paused clock): backoffs end, probes go.
    Wait(u64),
    /// The provider restarts on its durable state.
    Restart,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (any::<usize>(), any::<bool>()).prop_map(|(pick, incremental)| Step::Create { pick, incremental }),
        2 => any::<usize>().prop_map(|pick| Step::Configure { pick }),
        2 => any::<usize>().prop_map(|pick| Step::Drain { pick }),
        2 => any::<usize>().prop_map(|pick| Step::Delete { pick }),
        1 => any::<usize>().prop_map(|pick| Step::Get { pick }),
        4 => Just(Step::List),
        2 => (0..2usize, any::<bool>()).prop_map(|(offering, sold_out)| Step::SoldOut { offering, sold_out }),
        1 => prop_oneof![Just(None), (2..7usize).prop_map(Some)].prop_map(Step::Limit),
        1 => any::<usize>().prop_map(|pick| Step::Release { pick }),
        1 => any::<usize>().prop_map(|pick| Step::LoseHost { pick }),
        1 => Just(Step::Reconcile),
        2 => (1..12u64).prop_map(Step::Wait),
        1 => Just(Step::Restart),
    ]
}

const OFFERINGS: [(&str, &str); 2] = [("a", "z1"), ("b", "z1")];

/// A fleet over `cloud` with short stockout backoffs: 4 slots in each of a/z1, b/z1, a/z2,
/// b/z2.
fn fleet_over(cloud: Arc<FakeCloud>) -> Arc<Fleet> {
    let fleet = Fleet::new(
        cloud,
        "p",
        default_mix(16, ["a", "b"], ["z1", "z2"]),
        Arc::new(PriceBook::new(|_, _| Some(0.01))),
        Arc::new(CapacityBook::new(|_| None)),
        |_| StringMap::new(),
    );
    Arc::new(fleet.with_stockout_backoff(StockoutBackoff {
        first: Duration::from_secs(120),
        max: Duration::from_secs(600),
    }))
}

async fn start(fleet: Arc<Fleet>, state: &str) -> Arc<Engine> {
    // A restarted engine's last tasks let go of the state's lock within a few turns.
    let mut store = crate::operations::app::open_store(state);
    for _ in 0..100 {
        if store.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        store = crate::operations::app::open_store(state);
    }
    let store = store.expect("open the state");
    Engine::start(
        fleet,
        store,
        EngineOptions::new(Telemetry::new("shard_model")),
    )
    .await
    .expect("engine starts")
}

/// Lets transitions and the offer watch run.
async fn quiesce() {
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(Duration::from_millis(10)).await;
}

fn pick<T: Clone>(items: &[T], pick: usize) -> Option<T> {
    (!items.is_empty()).then(|| items[pick % items.len()].clone())
}

/// Runs `steps` and returns the two models' verdicts.
async fn run(steps: Vec<Step>) -> Result<(), String> {
    let dir = tempfile::tempdir().expect("tempdir");
    let state_dir = dir.path().join("state").display().to_string();
    let (cloud, _) = test_fleet(Vec::new());
    let mut fleet = fleet_over(cloud.clone());
    let mut engine = start(fleet.clone(), &state_dir).await;
    let mut full = ShardModel::new(false);
    let mut incremental = ShardModel::new(true);
    full.reconcile(&engine);
    incremental.reconcile(&engine);
    let models = |f: &mut ShardModel, i: &mut ShardModel, run: &mut dyn FnMut(&mut ShardModel)| {
        run(f);
        run(i);
    };
    for step in steps {
        match step {
            Step::Create {
                pick: p,
                incremental: inc,
            } => {
                let view = if inc { &incremental } else { &full };
                if let Some(id) = pick(&view.in_state(State::Speculative), p) {
                    let answer = engine.create(&id, zero()).await;
                    models(&mut full, &mut incremental, &mut |m| {
                        m.answer(OperationKind::Create, &id, &answer)
                    });
                }
            }
            Step::Configure { pick: p } => {
                if let Some(id) = pick(&full.in_state(State::Idle), p) {
                    let answer = engine
                        .configure(&id, "c".into(), b"blob".to_vec(), StringMap::new(), zero())
                        .await;
                    models(&mut full, &mut incremental, &mut |m| {
                        m.answer(OperationKind::Configure, &id, &answer)
                    });
                }
            }
            Step::Drain { pick: p } => {
                if let Some(id) = pick(&full.in_state(State::Configured), p) {
                    let answer = engine.drain(&id, 1, zero()).await;
                    models(&mut full, &mut incremental, &mut |m| {
                        m.answer(OperationKind::Drain, &id, &answer)
                    });
                }
            }
            Step::Delete { pick: p } => {
                if let Some(id) = pick(&full.in_state(State::Idle), p) {
                    let answer = engine.delete(&id, zero()).await;
                    models(&mut full, &mut incremental, &mut |m| {
                        m.answer(OperationKind::Delete, &id, &answer)
                    });
                }
            }
            Step::Get { pick: p } => {
                let mut ids: Vec<String> = incremental.held.keys().cloned().collect();
                ids.sort();
                if let Some(id) = pick(&ids, p)
                    && let Ok(m) = engine.get(&id)
                {
                    models(&mut full, &mut incremental, &mut |s| {
                        s.apply(&id, state(m.state), "Get")
                    });
                }
            }
            Step::List => {
                full.reconcile(&engine);
                incremental.reconcile(&engine);
            }
            Step::SoldOut { offering, sold_out } => {
                let (t, z) = OFFERINGS[offering];
                cloud.set_sold_out(t, z, sold_out);
            }
            Step::Limit(limit) => {
                cloud.set_host_limit(limit);
                let _ = fleet.read_account(Duration::from_secs(60)).await;
                let _ = engine.fit_offers().await;
            }
            Step::Release { pick: p } => {
                let failed: Vec<String> = engine.failed().iter().map(|m| m.id.clone()).collect();
                if let Some(id) = pick(&failed, p) {
                    engine
                        .release(&id)
                        .await
                        .map_err(|e| format!("release {id}: {e}"))?;
                }
            }
            Step::LoseHost { pick: p } => {
                let hosts = cloud.hosts();
                if let Some(host) = pick(&hosts, p) {
                    cloud.remove_out_of_band(&host.id);
                }
            }
            Step::Reconcile => {
                let _ = engine.reconcile().await;
                let _ = engine.reconcile().await;
            }
            Step::Wait(minutes) => {
                tokio::time::sleep(Duration::from_secs(60 * minutes)).await;
                let _ = engine.fit_offers().await;
            }
            Step::Restart => {
                engine.shutdown(Duration::from_secs(30)).await;
                let _ = engine.store().release().wait().await;
                drop(engine);
                fleet = fleet_over(cloud.clone());
                engine = start(fleet.clone(), &state_dir).await;
            }
        }
        quiesce().await;
    }
    // Let every transition end, then a last reconcile of both shards.
    tokio::time::sleep(Duration::from_secs(3600)).await;
    quiesce().await;
    full.reconcile(&engine);
    incremental.reconcile(&engine);
    full.verdict(&engine)?;
    incremental.verdict(&engine)?;
    engine.shutdown(Duration::from_secs(5)).await;
    Ok(())
}

fn paused_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("runtime")
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn every_answer_is_one_both_kinds_of_shard_can_apply(steps in prop::collection::vec(step(), 20..90)) {
        let verdict = paused_runtime().block_on(run(steps));
        prop_assert!(verdict.is_ok(), "{}", verdict.unwrap_err());
    }
}

/// Reproduction 1 of the stockout probe, on the engine: after the backoff a shard creates the
/// offering's slots at once; one probes, the others are answered without a request. None of
/// them may be listed Speculative again under its id.
#[test]
fn a_probe_burst_leaves_no_machine_a_shard_cannot_follow() {
    paused_runtime().block_on(async {
        let dir = tempfile::tempdir().expect("tempdir");
        let state_dir = dir.path().join("state").display().to_string();
        let (cloud, _) = test_fleet(Vec::new());
        let engine = start(fleet_over(cloud.clone()), &state_dir).await;
        let mut full = ShardModel::new(false);
        let mut incremental = ShardModel::new(true);
        full.reconcile(&engine);
        incremental.reconcile(&engine);
        cloud.set_sold_out("a", "z1", true);
        let first = engine.spare_of("a", "z1")[0].clone();
        let answer = engine.create(&first, zero()).await;
        full.answer(OperationKind::Create, &first, &answer);
        incremental.answer(OperationKind::Create, &first, &answer);
        quiesce().await;
        full.reconcile(&engine);
        incremental.reconcile(&engine);
        cloud.set_sold_out("a", "z1", false);
        tokio::time::sleep(Duration::from_secs(121)).await;
        let _ = engine.fit_offers().await;
        full.reconcile(&engine);
        incremental.reconcile(&engine);
        let burst: Vec<String> = full
            .in_state(State::Speculative)
            .into_iter()
            .filter(|id| id.starts_with("p/OnDemand/a/z1/"))
            .collect();
        assert_eq!(burst.len(), 4, "{burst:?}");
        for id in &burst {
            let answer = engine.create(id, zero()).await;
            full.answer(OperationKind::Create, id, &answer);
            incremental.answer(OperationKind::Create, id, &answer);
        }
        for _ in 0..5 {
            tokio::time::sleep(Duration::from_secs(2)).await;
            quiesce().await;
            full.reconcile(&engine);
            incremental.reconcile(&engine);
        }
        full.verdict(&engine).expect("full shard");
        incremental.verdict(&engine).expect("incremental shard");
        assert!(cloud.create_calls() <= 5);
        for id in &burst {
            let state = engine.get(id).expect("kept").state;
            assert!(
                matches!(state, MachineState::Idle | MachineState::Failed),
                "{id} is {state}: a burst's machine ends with a host or FAILED, never Speculative"
            );
        }
        let spare = engine.spare_of("a", "z1");
        assert!(spare.iter().all(|id| !burst.contains(id)), "{spare:?}");
    });
}

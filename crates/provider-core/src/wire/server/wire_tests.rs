//! Get's cached reply against the built message: for random machines, after every kind of
//! change the inventory makes (admission with a binding, success with a host and resources,
//! failure, release, a reconcile refresh and adoption, a vanished host, restart recovery,
//! cursor invalidation, a reload from a snapshot), the bytes Get sends decode to exactly the
//! message `machine_to_wire` builds from the machine as it is now. Caches filled before a
//! change stay in place across it, so a cache that outlived its change would be caught.

use std::collections::BTreeMap;
use std::sync::Arc;

use proptest::prelude::*;
use prost::Message;

use super::*;
use crate::rules::inventory::{Binding, Effect, Inventory, Survey, Suspect};
use crate::rules::lifecycle::OperationKind;
use crate::rules::machine::{CapacityType, HostRef};
use crate::runtime::engine::test_support::{self, SlotBackend};

/// What Get puts on the wire for `m`: the codec encodes the reply message.
fn get_reply(m: &Machine) -> pb::Machine {
    let on_the_wire = Encoded(wire_bytes(m)).encode_to_vec();
    pb::Machine::decode(on_the_wire.as_slice()).expect("Get's reply decodes as a Machine")
}

fn check_every_slot(inventory: &Inventory) -> Result<(), TestCaseError> {
    for slot in inventory.slots() {
        prop_assert_eq!(
            get_reply(&slot.machine),
            machine_to_wire(&slot.machine),
            "machine {}",
            slot.machine.id
        );
    }
    Ok(())
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![Just(String::new()), "[ -~]{1,12}", "\\PC{1,6}"]
}

fn string_map() -> impl Strategy<Value = StringMap> {
    prop::collection::btree_map("[a-z./-]{1,10}", text(), 0..4)
        .prop_map(|m: BTreeMap<String, String>| StringMap::from(m))
}

fn host() -> impl Strategy<Value = Option<HostRef>> {
    // An all-empty host is "no host" on the wire.
    prop::option::of((text(), text()).prop_map(|(provider, id)| HostRef { provider, id }))
}

fn number() -> impl Strategy<Value = f64> {
    prop_oneof![Just(0.0), Just(-0.0), -1e9f64..1e9, Just(f64::MAX)]
}

fn machine(id: String) -> impl Strategy<Value = Machine> {
    (
        (
            prop::sample::select(MachineState::ALL.to_vec()),
            host(),
            text(),
            text(),
            0i32..5,
            number(),
            number(),
        ),
        (
            string_map(),
            string_map(),
            string_map(),
            text(),
            text(),
            string_map(),
        ),
    )
        .prop_map(
            move |(
                (state, host, instance_type, zone, capacity, price, interruption),
                (resources, allocatable, labels, last_error, cluster, shard_metadata),
            )| Machine {
                id: id.clone(),
                state,
                host,
                instance_type,
                zone,
                capacity_type: CapacityType::from_wire(capacity).expect("0..5"),
                price_per_hour: price,
                interruption_probability: interruption,
                resources,
                allocatable,
                labels,
                last_error,
                cluster,
                shard_metadata,
                wire: Default::default(),
            },
        )
}

fn machines() -> impl Strategy<Value = Vec<Machine>> {
    (1usize..8).prop_flat_map(|n| {
        (0..n)
            .map(|i| machine(format!("m-{i}")))
            .collect::<Vec<_>>()
    })
}

#[derive(Clone, Debug)]
enum Step {
    Admit(usize, usize, String, StringMap),
    Succeed(usize, Option<HostRef>, StringMap, StringMap),
    Fail(usize, String),
    Release(usize),
    Refresh(usize, f64, StringMap, Option<HostRef>),
    Vanish(usize),
    Recover,
    Invalidate,
    Reload,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0usize..8, 0usize..4, text(), string_map())
            .prop_map(|(m, k, cluster, metadata)| Step::Admit(m, k, cluster, metadata)),
        3 => (0usize..8, host(), string_map(), string_map())
            .prop_map(|(m, host, r, a)| Step::Succeed(m, host, r, a)),
        2 => (0usize..8, text()).prop_map(|(m, e)| Step::Fail(m, e)),
        1 => (0usize..8).prop_map(Step::Release),
        2 => (0usize..8, number(), string_map(), host())
            .prop_map(|(m, price, labels, host)| Step::Refresh(m, price, labels, host)),
        1 => (0usize..8).prop_map(Step::Vanish),
        1 => Just(Step::Recover),
        1 => Just(Step::Invalidate),
        1 => Just(Step::Reload),
    ]
}

fn apply(inventory: &mut Inventory, step: Step) {
    let mut changes = Vec::new();
    let id = |m: usize| format!("m-{m}");
    match step {
        Step::Admit(m, k, cluster, shard_metadata) => {
            let kind = OperationKind::ALL[k];
            let binding = (kind == OperationKind::Configure).then_some(Binding {
                cluster,
                shard_metadata,
                sealed: None,
            });
            let token = FenceToken {
                shard_id: "s".into(),
                epoch: 1,
                sequence: 0,
            };
            let _ = inventory.admit(kind, &id(m), &token, binding, &mut changes);
        }
        Step::Succeed(m, _, _, _) | Step::Fail(m, _) => {
            let pending = inventory.get(&id(m)).and_then(|slot| {
                let kind = OperationKind::of_transitional(slot.machine.state)?;
                Some((kind, slot.operation(kind)?.to_owned()))
            });
            let Some((kind, op)) = pending else { return };
            let outcome = match step {
                Step::Succeed(_, host, resources, allocatable) => Ok(Effect {
                    host,
                    resources,
                    allocatable,
                }),
                Step::Fail(_, error) => Err(error),
                _ => unreachable!("matched above"),
            };
            inventory.complete(&id(m), kind, &op, outcome, &mut changes);
        }
        Step::Release(m) => {
            let _ = inventory.release(&id(m), 0, &mut changes);
        }
        Step::Refresh(m, price, labels, host) => {
            let machines = inventory
                .slots()
                .map(|slot| {
                    let mut seen = (*slot.machine).clone();
                    if seen.id == id(m) {
                        seen.price_per_hour = price;
                        seen.labels = labels.clone();
                        seen.host = host.clone();
                    }
                    seen
                })
                .collect();
            let since = inventory.revision();
            let survey = Survey {
                machines,
                hosts: None,
            };
            let now = tokio::time::Instant::now();
            inventory.reconcile(
                survey,
                None,
                since,
                now,
                std::time::Duration::MAX,
                &mut changes,
            );
        }
        Step::Vanish(m) => {
            let Some(host) = inventory.get(&id(m)).and_then(|s| s.machine.host.clone()) else {
                return;
            };
            let suspect = Suspect {
                machine_id: id(m),
                host,
                absent_before: true,
            };
            let since = inventory.revision();
            inventory.confirm_vanished(&[suspect], since, &mut changes);
        }
        Step::Recover => {
            inventory.recover_interrupted(
                |slot| slot.sealed.is_none().then(|| "not sealed".to_owned()),
                &mut changes,
            );
        }
        Step::Invalidate => inventory.invalidate_cursors(&mut changes),
        Step::Reload => *inventory = Inventory::from_snapshot(inventory.snapshot()),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn the_cached_get_reply_is_the_built_message_after_every_change(
        seed in machines(),
        steps in prop::collection::vec(step(), 1..40),
    ) {
        let mut inventory = Inventory::default();
        inventory.seed(seed, &mut Vec::new()).expect("seed");
        check_every_slot(&inventory)?;
        for step in steps {
            apply(&mut inventory, step);
            check_every_slot(&inventory)?;
        }
    }
}

/// Three slots with a price, a label and resources; transitions finish at once, a Create
/// reports a host and allocatable resources, a Drain is refused.
fn instant3() -> SlotBackend {
    let slots = (0..3)
        .map(|i| {
            let mut m = test_support::slot(format!("m-{i}"), "fsn1");
            m.price_per_hour = 0.0123;
            m.labels.insert("tier".into(), "general".into());
            m.resources.insert("cpu".into(), "2".into());
            m
        })
        .collect();
    SlotBackend::new(slots)
        .allocatable([("cpu".to_owned(), "1900m".to_owned())].into())
        .refusing_drains("drain refused")
}

/// The served Get (cached bytes) and the generated one (built message) give the same answer
/// for every machine after each RPC of a walk, and the same error for unknown and bad ids.
#[tokio::test]
async fn served_get_answers_what_the_generated_get_answers() {
    let engine = crate::runtime::engine::test_support::start_in_memory(
        Arc::new(instant3()),
        "bigfleet_wiretest",
    )
    .await;
    let service = Service::new(
        Replica::single(engine.clone()),
        crate::security::identity::ShardIdentity::Off,
    );
    let token = |sequence| FenceToken {
        shard_id: "s".into(),
        epoch: 1,
        sequence,
    };
    let same = async |service: &Service| {
        for id in ["m-0", "m-1", "m-2", "unknown", "", &"x".repeat(300)] {
            let request = Request::new(pb::MachineRef { id: id.into() });
            let built = CapacityProvider::get(service, request).await;
            let cached = service.get_encoded(id.to_owned()).await;
            match (built, cached) {
                (Ok(built), Ok(cached)) => {
                    let decoded = pb::Machine::decode(cached.encode_to_vec().as_slice()).unwrap();
                    assert_eq!(decoded, built.into_inner(), "{id}");
                }
                (Err(a), Err(b)) => {
                    assert_eq!((a.code(), a.message()), (b.code(), b.message()), "{id}")
                }
                (a, b) => panic!("{id}: generated {a:?}, served {b:?}"),
            }
        }
    };
    let settle = async |id: &str, state: MachineState| {
        for _ in 0..1000 {
            if engine.get(id).unwrap().state == state {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        panic!("{id} never reached {state}");
    };
    same(&service).await;
    engine.create("m-0", token(1)).await.unwrap();
    same(&service).await;
    settle("m-0", MachineState::Idle).await;
    same(&service).await;
    let metadata: StringMap = [("pool".to_owned(), "a".to_owned())].into();
    engine
        .configure("m-0", "c1".into(), b"blob".to_vec(), metadata, token(2))
        .await
        .unwrap();
    settle("m-0", MachineState::Configured).await;
    same(&service).await;
    engine.drain("m-0", 0, token(3)).await.unwrap();
    settle("m-0", MachineState::Failed).await;
    same(&service).await;
    engine.create("m-1", token(4)).await.unwrap();
    settle("m-1", MachineState::Idle).await;
    engine.delete("m-1", token(5)).await.unwrap();
    settle("m-1", MachineState::Speculative).await;
    same(&service).await;
}

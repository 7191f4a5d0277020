//! Input bounds through the real admit path (docs/limits.md): oversized fields are refused
//! with INVALID_ARGUMENT naming the field before anything is recorded, and a flood of Creates
//! on random unknown ids leaves memory and the `--state` directory bounded.

use std::path::Path;

use tonic::Code;

use super::test_support::{SlotBackend, start_in_memory};
use super::*;
use crate::persistence::durable::DurableStore;
use crate::persistence::store::Store;
use crate::rules::limits::{MAX_ID_BYTES, MAX_METADATA_ENTRIES};

fn token(shard: &str, sequence: i64) -> FenceToken {
    FenceToken {
        shard_id: shard.into(),
        epoch: 1,
        sequence,
    }
}

fn invalid_argument(result: Result<Ack, CoreError>, field: &str) {
    let err = result.expect_err("oversized field accepted");
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    assert!(
        err.to_string().starts_with(&format!("{field} too large: ")),
        "{err}"
    );
}

#[tokio::test]
async fn oversized_fields_are_invalid_argument_naming_the_field_and_record_nothing() {
    let engine = start_in_memory(Arc::new(SlotBackend::numbered(2)), "test_limits").await;
    let long = "x".repeat(MAX_ID_BYTES + 1);
    invalid_argument(engine.create(&long, token("s", 1)).await, "machine_id");
    invalid_argument(engine.create("m-00000", token(&long, 1)).await, "shard_id");
    invalid_argument(
        engine
            .configure(
                "m-00000",
                long.clone(),
                Vec::new(),
                StringMap::new(),
                token("s", 1),
            )
            .await,
        "cluster_id",
    );
    let too_many: StringMap = (0..=MAX_METADATA_ENTRIES)
        .map(|i| (format!("k{i}"), String::new()))
        .collect();
    invalid_argument(
        engine
            .configure("m-00000", "c".into(), Vec::new(), too_many, token("s", 1))
            .await,
        "shard_metadata",
    );
    let err = engine.get(&long).expect_err("long id");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.to_string().starts_with("id too large"), "{err}");
    // Nothing was recorded: the refused token (1) is still first contact.
    assert!(engine.snapshot().fences.is_empty());
    engine
        .create("m-00000", token("s", 1))
        .await
        .expect("create");

    // At the limits everything passes; the reference echoes a 10,000-entry map.
    let at_limit = "y".repeat(MAX_ID_BYTES);
    let err = engine
        .create(&at_limit, token(&at_limit, 1))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    let ten_thousand: StringMap = (0..10_000)
        .map(|i| (format!("key-{i}"), format!("value-{i}")))
        .collect();
    for _ in 0..1000 {
        if engine.get("m-00000").expect("m-00000").state == MachineState::Idle {
            break;
        }
        tokio::task::yield_now().await;
    }
    let ack = engine
        .configure(
            "m-00000",
            at_limit,
            Vec::new(),
            ten_thousand.clone(),
            token("s", 2),
        )
        .await
        .expect("configure at the limits");
    assert_eq!(ack.machine.shard_metadata, ten_thousand);
}

/// Resident set size of this process (nextest runs each test in its own process).
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmRSS")
        * 1024
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .expect("read state dir")
        .map(|e| e.expect("entry").metadata().expect("metadata").len())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_million_creates_on_random_unknown_ids_leave_memory_and_state_bounded() {
    const TOTAL: usize = 1_000_000;
    const TASKS: usize = 500;
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("state");
    let store = Arc::new(DurableStore::open(&dir).expect("open state"));
    let engine = Engine::start(
        Arc::new(SlotBackend::numbered(10)),
        store,
        EngineOptions::new(Telemetry::new("test_limits")),
    )
    .await
    .expect("start");
    let capacity = engine.options().max_unknown_id_marks;

    let mut rss_at = Vec::new();
    let mut dir_at = Vec::new();
    let started = std::time::Instant::now();
    for round in 0..4 {
        let mut tasks = Vec::with_capacity(TASKS);
        for task in 0..TASKS {
            let engine = engine.clone();
            tasks.push(tokio::spawn(async move {
                for n in 0..TOTAL / 4 / TASKS {
                    let id = format!("ghost-{round}-{task}-{n}-{:016x}", rand::random::<u64>());
                    let err = engine.create(&id, token("shard-a", 1)).await.unwrap_err();
                    assert_eq!(err.code(), Code::NotFound, "{err}");
                }
            }));
        }
        for t in tasks {
            t.await.expect("task");
        }
        rss_at.push(rss_bytes());
        dir_at.push(dir_bytes(&dir));
    }
    let elapsed = started.elapsed();
    let snapshot = engine.snapshot();
    println!(
        "{TOTAL} Creates on unknown ids in {elapsed:?}: RSS after each 250k {:?} MiB, state \
         directory {:?} KiB, {} fence marks held (capacity {capacity})",
        rss_at.iter().map(|b| b / (1 << 20)).collect::<Vec<_>>(),
        dir_at.iter().map(|b| b / 1024).collect::<Vec<_>>(),
        snapshot.fences.len(),
    );
    assert_eq!(snapshot.fences.len(), capacity);
    let (held, evicted) = engine.read().unknown_id_marks();
    assert_eq!(held, capacity);
    assert_eq!(evicted as usize, TOTAL - capacity);
    // Memory and disk stop growing once the table is full: the last 750k Creates add no more
    // than noise to what the first 250k left.
    let rss_growth = rss_at[3].saturating_sub(rss_at[0]);
    assert!(
        rss_growth < 64 << 20,
        "RSS grew by {} MiB over the last 750k Creates",
        rss_growth >> 20
    );
    // The log is compacted at 8 MiB or the snapshot's size, whichever is larger.
    for bytes in &dir_at {
        assert!(*bytes < 40 << 20, "state directory holds {bytes} bytes");
    }
    engine.shutdown(Duration::from_secs(1)).await;
    drop(engine);
    // The reloaded state holds exactly the newest marks.
    let reloaded = DurableStore::open(&dir)
        .expect("reopen")
        .load()
        .expect("load");
    assert_eq!(reloaded.fences.len(), capacity);
}

//! `state export` of an etcd prefix and `state import` between a local state directory and etcd
//! (either direction, or between two prefixes), without losing a fence mark or an operation id.
//!
//! An import claims both sides like a provider does, so it never runs beside a provider on
//! either state; it refuses a destination that already holds a state; it writes the counters
//! last into etcd (a prefix without them is recognised as an interrupted import), and it reads
//! the destination back and compares it with the source before it reports success.

use std::path::Path;

use super::{EtcdArgs, Guarded, Keys, is_etcd, open_guarded, read_state, release, target};
use crate::persistence::durable::{DurableStore, render_json};
use crate::persistence::store::Store;
use crate::rules::records::{Change, Snapshot};

/// Renders the state under an etcd prefix as JSON. It reads one consistent etcd revision and
/// writes nothing, so it also works while a provider runs on the prefix.
pub async fn export_json(state: &str, args: &EtcdArgs) -> Result<String, String> {
    args.validate()?;
    let target = target::parse(state)?;
    let client = target::connect(&target, args)?;
    let snapshot = read_state(&client, &Keys::new(&target.prefix))
        .await
        .map_err(|e| format!("{}: {e}", target.describe()))?;
    render_json(&snapshot, &format!("etcd prefix {}", target.describe()))
}

/// Sorted, so two reads of one state compare equal whatever order they were read in.
fn normalized(mut snapshot: Snapshot) -> Snapshot {
    snapshot
        .slots
        .sort_by(|a, b| a.machine.id.cmp(&b.machine.id));
    snapshot
        .fences
        .sort_by(|a, b| (&a.shard_id, &a.machine_id).cmp(&(&b.shard_id, &b.machine_id)));
    snapshot
}

/// The state as a list of changes: fence marks, then machines, then the counters.
fn changes_of(snapshot: &Snapshot) -> (Vec<Change>, Change) {
    let mut changes: Vec<Change> = snapshot
        .fences
        .iter()
        .map(|f| Change::PutFence {
            shard_id: f.shard_id.clone(),
            machine_id: f.machine_id.clone(),
            mark: f.mark,
        })
        .collect();
    changes.extend(snapshot.slots.iter().cloned().map(Change::PutSlot));
    let counters = Change::Counters {
        revision: snapshot.revision,
        next_op: snapshot.next_op,
    };
    (changes, counters)
}

/// A local state directory opened (and locked) for the import.
fn open_dir(path: &str, must_exist: bool) -> Result<DurableStore, String> {
    let p = Path::new(path);
    match std::fs::metadata(p) {
        Ok(meta) if meta.is_dir() => {
            if !must_exist {
                let empty = std::fs::read_dir(p)
                    .map_err(|e| format!("read {path}: {e}"))?
                    .next()
                    .is_none();
                if !empty {
                    return Err(format!(
                        "--to {path} already holds a state (or other files); an import never \
                         overwrites one: choose a new directory"
                    ));
                }
            }
        }
        Ok(meta) if meta.is_file() => {
            return Err(format!(
                "{path} is a file (the reference provider's JSON state?): start a provider with \
                 --state {path} once to convert it into a state directory, then import that"
            ));
        }
        Ok(_) => return Err(format!("{path} is not a state directory")),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && must_exist => {
            return Err(format!("--from {path}: no state there"));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(format!("inspect {path}: {e}")),
    }
    DurableStore::open(p)
}

/// One side of an import.
enum Side {
    Dir(DurableStore),
    Etcd(Box<(Guarded, tokio_util::sync::CancellationToken)>),
}

impl Side {
    async fn open(state: &str, args: &EtcdArgs, source: bool) -> Result<Side, String> {
        if is_etcd(state) {
            let (guarded, stop) = open_guarded(state, args).await?;
            Ok(Side::Etcd(Box::new((guarded, stop))))
        } else {
            Ok(Side::Dir(open_dir(state, source)?))
        }
    }

    async fn read(&self) -> Result<Snapshot, String> {
        match self {
            Side::Dir(store) => store.load().map_err(|e| e.0),
            Side::Etcd(claimed) => read_state(&claimed.0.client, &claimed.0.keys)
                .await
                .map_err(|e| format!("{}: {e}", claimed.0.describe)),
        }
    }

    async fn write(&self, snapshot: &Snapshot) -> Result<(), String> {
        let (mut changes, counters) = changes_of(snapshot);
        match self {
            Side::Dir(store) => {
                changes.push(counters);
                store.submit(changes).wait().await.map_err(|e| e.0)?;
                store.flush().wait().await.map_err(|e| e.0)
            }
            Side::Etcd(claimed) => {
                let guarded = &claimed.0;
                // The counters go last: until they are written the prefix reads as an
                // interrupted import, never as a state with ids that could be reissued.
                guarded.commit(vec![changes]).await?;
                guarded
                    .commit(vec![vec![counters]])
                    .await
                    .map_err(String::from)
            }
        }
    }

    async fn close(self) {
        match self {
            Side::Dir(store) => drop(store),
            Side::Etcd(claimed) => release(&claimed.0, &claimed.1).await,
        }
    }
}

/// Copies the state at `from` to `to` (each a state directory or an `etcd://` address) and
/// checks the copy. Returns a one-line summary.
pub async fn import(from: &str, to: &str, args: &EtcdArgs) -> Result<String, String> {
    if from == to {
        return Err(format!("--from and --to are the same state ({from})"));
    }
    if !is_etcd(from) && !is_etcd(to) {
        return Err(
            "one of --from and --to must be an etcd:// address (to copy a state directory, \
             copy the directory while no provider runs on it)"
                .into(),
        );
    }
    let source = Side::open(from, args, true).await?;
    let snapshot = match source.read().await {
        Ok(s) => normalized(s),
        Err(e) => {
            source.close().await;
            return Err(format!("--from {from}: {e}"));
        }
    };
    if snapshot.is_fresh() {
        source.close().await;
        return Err(format!(
            "--from {from} holds no state (no machines, fence marks or operations): nothing to import"
        ));
    }
    let destination = match Side::open(to, args, false).await {
        Ok(d) => d,
        Err(e) => {
            source.close().await;
            return Err(format!("--to {to}: {e}"));
        }
    };
    let result = copy(&snapshot, &destination).await;
    destination.close().await;
    source.close().await;
    result.map_err(|e| format!("--to {to}: {e}"))?;
    Ok(format!(
        "imported {} machines, {} fence marks, revision {} and next operation {} from {from} to {to}",
        snapshot.slots.len(),
        snapshot.fences.len(),
        snapshot.revision,
        snapshot.next_op
    ))
}

async fn copy(snapshot: &Snapshot, destination: &Side) -> Result<(), String> {
    let existing = destination.read().await?;
    if !existing.is_fresh() {
        return Err(format!(
            "already holds a state ({} machines, revision {}); an import never overwrites one",
            existing.slots.len(),
            existing.revision
        ));
    }
    destination.write(snapshot).await?;
    // A second read of a directory store reads what is on disk now.
    let written = normalized(destination.read().await?);
    if &written != snapshot {
        return Err(format!(
            "the copy does not read back equal to the source ({} machines, {} fence marks, \
             revision {} read back; {} machines, {} fence marks, revision {} expected)",
            written.slots.len(),
            written.fences.len(),
            written.revision,
            snapshot.slots.len(),
            snapshot.fences.len(),
            snapshot.revision
        ));
    }
    Ok(())
}

//! Rendering a whole state as JSON for `<binary> state export --state PATH`: every machine with
//! every field, every fence mark, every recorded operation id, the revision head and the next
//! operation number. Sorted, so two exports of the same state are identical.

use serde::{Serialize, Serializer};

use crate::rules::lifecycle::OperationKind;
use crate::rules::machine::StringMap;
use crate::rules::records::Snapshot;

#[derive(Serialize)]
struct Export<'a> {
    /// Where the state was read from.
    source: &'a str,
    revision: i64,
    next_op: u64,
    machines: Vec<ExportMachine<'a>>,
    fences: Vec<ExportFence<'a>>,
    ops: Vec<ExportOp<'a>>,
}

#[derive(Serialize)]
struct ExportMachine<'a> {
    id: &'a str,
    state: &'static str,
    host: Option<ExportHost<'a>>,
    instance_type: &'a str,
    zone: &'a str,
    capacity_type: &'static str,
    #[serde(serialize_with = "number")]
    price_per_hour: f64,
    #[serde(serialize_with = "number")]
    interruption_probability: f64,
    resources: &'a StringMap,
    allocatable: &'a StringMap,
    labels: &'a StringMap,
    last_error: &'a str,
    cluster: &'a str,
    shard_metadata: &'a StringMap,
    /// The revision of the machine's last change (what List cursors compare against).
    last_change: i64,
    /// That a sealed bootstrap blob waits for the Configure in flight: its size and deadline,
    /// never its content.
    #[serde(skip_serializing_if = "Option::is_none")]
    sealed_configure: Option<ExportSealed>,
    /// That the host's agent enrolled: the host and Create it is bound to, whether its agent
    /// was handed a Configure's blob (confirmed) and whether a conflicting enrollment cut the
    /// machine off, never the credential's digest.
    #[serde(skip_serializing_if = "Option::is_none")]
    enrollment: Option<ExportEnrollment<'a>>,
}

#[derive(Serialize)]
struct ExportEnrollment<'a> {
    host_id: &'a str,
    create_operation: &'a str,
    conflict: bool,
    confirmed: bool,
}

#[derive(Serialize)]
struct ExportSealed {
    sealed_bytes: usize,
    deadline_unix_ms: u64,
}

#[derive(Serialize)]
struct ExportHost<'a> {
    provider: &'a str,
    id: &'a str,
}

#[derive(Serialize)]
struct ExportFence<'a> {
    shard_id: &'a str,
    machine_id: &'a str,
    epoch: i64,
    sequence: i64,
}

#[derive(Serialize)]
struct ExportOp<'a> {
    machine_id: &'a str,
    kind: &'static str,
    operation_id: &'a str,
}

/// JSON has no infinities: a non-finite number is written as a string.
fn number<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
    if v.is_finite() {
        s.serialize_f64(*v)
    } else {
        s.serialize_str(&v.to_string())
    }
}

/// Renders `snapshot` as pretty JSON; `source` says where it came from.
pub fn render_json(snapshot: &Snapshot, source: &str) -> Result<String, String> {
    let mut slots: Vec<_> = snapshot.slots.iter().collect();
    slots.sort_by(|a, b| a.machine.id.cmp(&b.machine.id));
    let machines = slots
        .iter()
        .map(|slot| {
            let m = &*slot.machine;
            ExportMachine {
                id: &m.id,
                state: m.state.name(),
                host: m.host.as_ref().map(|h| ExportHost {
                    provider: &h.provider,
                    id: &h.id,
                }),
                instance_type: &m.instance_type,
                zone: &m.zone,
                capacity_type: m.capacity_type.name(),
                price_per_hour: m.price_per_hour,
                interruption_probability: m.interruption_probability,
                resources: &m.resources,
                allocatable: &m.allocatable,
                labels: &m.labels,
                last_error: &m.last_error,
                cluster: &m.cluster,
                shard_metadata: &m.shard_metadata,
                last_change: slot.last_change,
                sealed_configure: slot.sealed.as_ref().map(|sealed| ExportSealed {
                    sealed_bytes: sealed.sealed.len(),
                    deadline_unix_ms: sealed.deadline_unix_ms,
                }),
                enrollment: slot.enrollment.as_ref().map(|e| ExportEnrollment {
                    host_id: &e.host_id,
                    create_operation: &e.create_operation,
                    conflict: e.conflict,
                    confirmed: e.confirmed,
                }),
            }
        })
        .collect();
    let mut fences: Vec<ExportFence<'_>> = snapshot
        .fences
        .iter()
        .map(|f| ExportFence {
            shard_id: &f.shard_id,
            machine_id: &f.machine_id,
            epoch: f.mark.epoch,
            sequence: f.mark.sequence,
        })
        .collect();
    fences.sort_by(|a, b| (a.shard_id, a.machine_id).cmp(&(b.shard_id, b.machine_id)));
    let ops = slots
        .iter()
        .flat_map(|slot| {
            OperationKind::ALL.into_iter().filter_map(|kind| {
                slot.operation(kind).map(|operation_id| ExportOp {
                    machine_id: &slot.machine.id,
                    kind: kind.name(),
                    operation_id,
                })
            })
        })
        .collect();
    let export = Export {
        source,
        revision: snapshot.revision,
        next_op: snapshot.next_op,
        machines,
        fences,
        ops,
    };
    serde_json::to_string_pretty(&export).map_err(|e| format!("render state as JSON: {e}"))
}

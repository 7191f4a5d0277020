//! Reading the reference provider's JSON state file (contract.md §11) into a [`Snapshot`], so an
//! operator can swap the reference binary for ours on the same volume and keep every binding,
//! fence mark and operation id.
//!
//! Decoding follows Go's `encoding/json` as the reference used it: keys match
//! case-insensitively, unknown keys are ignored, a key given twice takes its last value, a
//! missing key (or `null` for a string or number) leaves the zero value, and a value of the
//! wrong JSON type (a number where a state name belongs, a fraction where an integer belongs) is
//! an error. Where the reference loaded nonsense silently, we load the same thing and warn:
//!
//! - an unknown `State` or `CapacityType` name loads as Unspecified;
//! - an op record with an unknown `kind` counts as `create`;
//! - a machine with an empty `ID` is skipped (nothing can address it); an op for a machine the
//!   file does not hold is dropped (there is no slot to keep it).
//!
//! Two deliberate differences, both so that nothing issued before the switch is ever reissued
//! or reopened:
//!
//! - `next_op` is the *last* number the reference issued (it increments before minting); ours is
//!   the *next* one, so the import stores `next_op + 1`, raised above the number of any `op-N`
//!   id in the file.
//! - Files written before ADR-0058 keep `fences` as an object of shard-wide marks keyed by
//!   shard id (`{"shard-a": {"Epoch": 3, "Sequence": 7}}`), which the reference itself refuses to
//!   load. We import them: each shard-wide mark becomes that shard's mark on *every* machine in
//!   the file. A shard's own next token is strictly newer than its shard-wide high-water mark, so
//!   this rejects nothing the shard could legitimately send, while a zombie shard instance
//!   holding an older token stays fenced on every machine (dropping the marks would reopen that
//!   window). Where the file also holds a per-machine mark, the higher one wins.

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use crate::rules::fence::HighWaterMark;
use crate::rules::inventory::OPERATION_PREFIX;
use crate::rules::lifecycle::OperationKind;
use crate::rules::machine::{CapacityType, HostRef, Machine, MachineState, StringMap};
use crate::rules::records::{FenceRecord, Slot, Snapshot};

/// A reference state file, converted.
#[derive(Debug)]
pub(crate) struct Imported {
    pub snapshot: Snapshot,
    pub report: ImportReport,
}

/// What the import found, for the log line and for tests.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct ImportReport {
    pub machines: usize,
    /// Per-machine fence marks in the result.
    pub fence_marks: usize,
    pub ops: usize,
    /// The file used the pre-ADR-0058 object layout for `fences`.
    pub shard_wide_fences: bool,
    /// Shard-wide marks read from that layout.
    pub shard_marks: usize,
    pub warnings: Vec<String>,
}

/// Parses and converts a reference state file.
pub(crate) fn parse(bytes: &[u8]) -> Result<Imported, String> {
    let Go(state) = serde_json::from_slice::<Go<RefState>>(bytes).map_err(|e| e.to_string())?;
    Ok(convert(state))
}

fn convert(state: RefState) -> Imported {
    let mut report = ImportReport::default();
    let reference_fresh = state.machines.is_empty()
        && state.fences.is_empty()
        && state.ops.is_empty()
        && state.rev == 0;

    let mut slots: BTreeMap<String, Slot> = BTreeMap::new();
    for m in state.machines {
        if m.id.is_empty() {
            report.warnings.push(format!(
                "skipped a machine record with an empty ID (host {:?}/{:?}): nothing can address it",
                m.host.provider, m.host.reference
            ));
            continue;
        }
        let state_name = m.state.unwrap_or_default();
        let machine_state = MachineState::from_name(&state_name).unwrap_or_else(|| {
            report.warnings.push(format!(
                "machine {}: unknown State {state_name:?} loads as Unspecified (as in the reference)",
                m.id
            ));
            MachineState::Unspecified
        });
        let capacity_name = m.capacity_type.unwrap_or_default();
        let capacity_type = CapacityType::from_name(&capacity_name).unwrap_or_else(|| {
            report.warnings.push(format!(
                "machine {}: unknown CapacityType {capacity_name:?} loads as Unspecified (as in the reference)",
                m.id
            ));
            CapacityType::Unspecified
        });
        let host =
            (!m.host.provider.is_empty() || !m.host.reference.is_empty()).then_some(HostRef {
                provider: m.host.provider,
                id: m.host.reference,
            });
        let machine = Machine {
            id: m.id.clone(),
            state: machine_state,
            host,
            instance_type: m.instance_type,
            zone: m.zone,
            capacity_type,
            price_per_hour: m.price_per_hour,
            interruption_probability: m.interruption_probability,
            resources: m.resources,
            allocatable: m.allocatable,
            labels: m.labels,
            last_error: m.last_error,
            cluster: m.cluster,
            shard_metadata: m.shard_metadata,
            wire: Default::default(),
        };
        let slot = Slot {
            machine: Arc::new(machine),
            // The reference resets every record's last change to the persisted head on load.
            last_change: state.rev,
            operations: Default::default(),
            sealed: None,
            enrollment: None,
            retired: None,
        };
        if slots.insert(m.id.clone(), slot).is_some() {
            report.warnings.push(format!(
                "machine {} appears more than once; the last record wins (as in the reference)",
                m.id
            ));
        }
    }

    let mut highest_op = 0u64;
    for op in state.ops {
        let kind = OperationKind::from_name(&op.kind).unwrap_or_else(|| {
            report.warnings.push(format!(
                "op {} of machine {}: unknown kind {:?} counts as create (as in the reference)",
                op.operation_id, op.machine_id, op.kind
            ));
            OperationKind::Create
        });
        if let Some(n) = op
            .operation_id
            .strip_prefix(OPERATION_PREFIX)
            .and_then(|rest| rest.strip_prefix('-'))
            .and_then(|n| n.parse::<u64>().ok())
        {
            highest_op = highest_op.max(n);
        }
        match slots.get_mut(&op.machine_id) {
            Some(slot) => slot.operations[kind.index()] = Some(op.operation_id),
            None => report.warnings.push(format!(
                "dropped op {} ({kind}) of machine {:?}, which the file does not hold",
                op.operation_id, op.machine_id
            )),
        }
    }
    report.ops = slots
        .values()
        .map(|s| s.operations.iter().flatten().count())
        .sum();

    let mut marks: BTreeMap<(String, String), HighWaterMark> = BTreeMap::new();
    let mut raise = |shard_id: String, machine_id: String, mark: HighWaterMark| {
        let entry = marks.entry((shard_id, machine_id)).or_insert(mark);
        *entry = (*entry).max(mark);
    };
    match state.fences {
        RefFences::Absent => {}
        RefFences::PerMachine(records) => {
            for f in records {
                raise(
                    f.shard_id,
                    f.machine_id,
                    HighWaterMark {
                        epoch: f.epoch,
                        sequence: f.sequence,
                    },
                );
            }
        }
        RefFences::ShardWide(shards) => {
            report.shard_wide_fences = true;
            report.shard_marks = shards.len();
            if slots.is_empty() && !shards.is_empty() {
                report.warnings.push(format!(
                    "{} shard-wide fence marks (pre-ADR-0058 layout) dropped: the file holds no \
                     machine to apply them to",
                    shards.len()
                ));
            }
            for (shard_id, mark) in shards {
                for id in slots.keys() {
                    raise(
                        shard_id.clone(),
                        id.clone(),
                        HighWaterMark {
                            epoch: mark.epoch,
                            sequence: mark.sequence,
                        },
                    );
                }
            }
        }
    }
    let fences: Vec<FenceRecord> = marks
        .into_iter()
        .map(|((shard_id, machine_id), mark)| FenceRecord {
            shard_id,
            machine_id,
            mark,
        })
        .collect();

    report.machines = slots.len();
    report.fence_marks = fences.len();
    let snapshot = if reference_fresh {
        Snapshot::default()
    } else {
        let last_issued = u64::try_from(state.next_op).unwrap_or(0);
        Snapshot {
            slots: slots.into_values().collect(),
            fences,
            revision: state.rev,
            next_op: last_issued.max(highest_op).saturating_add(1),
        }
    };
    Imported { snapshot, report }
}

// --- Go-style decoding --------------------------------------------------------------------

/// A value decoded the way Go's `encoding/json` decodes a struct.
struct Go<T>(T);

/// A Go struct: fields matched by lower-cased key.
trait GoObject: Default {
    const WHAT: &'static str;
    fn field<'de, A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error>;
}

impl<'de, T: GoObject> Deserialize<'de> for Go<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Go<T>, D::Error> {
        struct ObjectVisitor<T>(PhantomData<T>);
        impl<'de, T: GoObject> Visitor<'de> for ObjectVisitor<T> {
            type Value = Go<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "a JSON object ({})", T::WHAT)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Go<T>, A::Error> {
                let mut value = T::default();
                while let Some(key) = map.next_key::<String>()? {
                    value.field(&key.to_lowercase(), &mut map)?;
                }
                Ok(Go(value))
            }
        }
        d.deserialize_map(ObjectVisitor(PhantomData))
    }
}

/// Go leaves a string or number field alone when the JSON value is `null`.
fn keep<'de, A: MapAccess<'de>, V: Deserialize<'de>>(
    map: &mut A,
    slot: &mut V,
) -> Result<(), A::Error> {
    if let Some(v) = map.next_value::<Option<V>>()? {
        *slot = v;
    }
    Ok(())
}

/// Go sets a map or slice field to nil (empty) when the JSON value is `null`.
fn replace<'de, A: MapAccess<'de>, V: Deserialize<'de> + Default>(
    map: &mut A,
    slot: &mut V,
) -> Result<(), A::Error> {
    *slot = map.next_value::<Option<V>>()?.unwrap_or_default();
    Ok(())
}

/// A slice of structs; `null` elements (nil pointers) are skipped.
fn objects<'de, A: MapAccess<'de>, T: GoObject>(
    map: &mut A,
    slot: &mut Vec<T>,
) -> Result<(), A::Error> {
    let items: Option<Vec<Option<Go<T>>>> = map.next_value()?;
    *slot = items
        .unwrap_or_default()
        .into_iter()
        .flatten()
        .map(|Go(t)| t)
        .collect();
    Ok(())
}

fn ignore<'de, A: MapAccess<'de>>(map: &mut A) -> Result<(), A::Error> {
    map.next_value::<IgnoredAny>().map(|_| ())
}

#[derive(Default)]
struct RefState {
    machines: Vec<RefMachine>,
    fences: RefFences,
    ops: Vec<RefOp>,
    rev: i64,
    next_op: i64,
}

impl GoObject for RefState {
    const WHAT: &'static str = "the state: machines, fences, ops, rev, next_op";
    fn field<'de, A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error> {
        match key {
            "machines" => objects(map, &mut self.machines),
            "fences" => replace(map, &mut self.fences),
            "ops" => objects(map, &mut self.ops),
            "rev" => keep(map, &mut self.rev),
            "next_op" => keep(map, &mut self.next_op),
            _ => ignore(map),
        }
    }
}

#[derive(Default)]
struct RefMachine {
    id: String,
    state: Option<String>,
    host: RefHost,
    instance_type: String,
    zone: String,
    capacity_type: Option<String>,
    price_per_hour: f64,
    interruption_probability: f64,
    resources: StringMap,
    allocatable: StringMap,
    labels: StringMap,
    cluster: String,
    shard_metadata: StringMap,
    last_error: String,
}

impl GoObject for RefMachine {
    const WHAT: &'static str = "a machine record";
    fn field<'de, A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error> {
        match key {
            "id" => keep(map, &mut self.id),
            "state" => {
                if let Some(name) = map.next_value::<Option<String>>()? {
                    self.state = Some(name);
                }
                Ok(())
            }
            "host" => {
                self.host = map
                    .next_value::<Option<Go<RefHost>>>()?
                    .map(|Go(h)| h)
                    .unwrap_or_default();
                Ok(())
            }
            "instancetype" => keep(map, &mut self.instance_type),
            "zone" => keep(map, &mut self.zone),
            "capacitytype" => {
                if let Some(name) = map.next_value::<Option<String>>()? {
                    self.capacity_type = Some(name);
                }
                Ok(())
            }
            "priceperhour" => keep(map, &mut self.price_per_hour),
            "interruptionprobability" => keep(map, &mut self.interruption_probability),
            "resources" => replace(map, &mut self.resources),
            "allocatable" => replace(map, &mut self.allocatable),
            "labels" => replace(map, &mut self.labels),
            "cluster" => keep(map, &mut self.cluster),
            "shardmetadata" => replace(map, &mut self.shard_metadata),
            "lasterror" => keep(map, &mut self.last_error),
            _ => ignore(map),
        }
    }
}

#[derive(Default)]
struct RefHost {
    provider: String,
    reference: String,
}

impl GoObject for RefHost {
    const WHAT: &'static str = "a host: Provider, Ref";
    fn field<'de, A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error> {
        match key {
            "provider" => keep(map, &mut self.provider),
            "ref" => keep(map, &mut self.reference),
            _ => ignore(map),
        }
    }
}

#[derive(Default)]
struct RefFence {
    shard_id: String,
    machine_id: String,
    epoch: i64,
    sequence: i64,
}

impl GoObject for RefFence {
    const WHAT: &'static str = "a fence record: shard_id, machine_id, epoch, sequence";
    fn field<'de, A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error> {
        match key {
            "shard_id" => keep(map, &mut self.shard_id),
            "machine_id" => keep(map, &mut self.machine_id),
            "epoch" => keep(map, &mut self.epoch),
            "sequence" => keep(map, &mut self.sequence),
            _ => ignore(map),
        }
    }
}

/// A shard-wide mark of the pre-ADR-0058 layout (Go field names, no tags).
#[derive(Default)]
struct RefShardMark {
    epoch: i64,
    sequence: i64,
}

impl GoObject for RefShardMark {
    const WHAT: &'static str = "a shard-wide fence mark: Epoch, Sequence";
    fn field<'de, A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error> {
        match key {
            "epoch" => keep(map, &mut self.epoch),
            "sequence" => keep(map, &mut self.sequence),
            _ => ignore(map),
        }
    }
}

#[derive(Default)]
struct RefOp {
    machine_id: String,
    kind: String,
    operation_id: String,
}

impl GoObject for RefOp {
    const WHAT: &'static str = "an op record: machine_id, kind, operation_id";
    fn field<'de, A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error> {
        match key {
            "machine_id" => keep(map, &mut self.machine_id),
            "kind" => keep(map, &mut self.kind),
            "operation_id" => keep(map, &mut self.operation_id),
            _ => ignore(map),
        }
    }
}

/// `fences`: an array of per-machine records, or (before ADR-0058) an object of shard-wide
/// marks keyed by shard id.
#[derive(Default)]
enum RefFences {
    #[default]
    Absent,
    PerMachine(Vec<RefFence>),
    ShardWide(Vec<(String, RefShardMark)>),
}

impl RefFences {
    fn is_empty(&self) -> bool {
        match self {
            RefFences::Absent => true,
            RefFences::PerMachine(v) => v.is_empty(),
            RefFences::ShardWide(v) => v.is_empty(),
        }
    }
}

impl<'de> Deserialize<'de> for RefFences {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<RefFences, D::Error> {
        struct FencesVisitor;
        impl<'de> Visitor<'de> for FencesVisitor {
            type Value = RefFences;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(
                    "an array of fence records (or, in files written before ADR-0058, an \
                     object of marks keyed by shard id)",
                )
            }
            fn visit_unit<E: de::Error>(self) -> Result<RefFences, E> {
                Ok(RefFences::Absent)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<RefFences, A::Error> {
                let mut records = Vec::new();
                while let Some(item) = seq.next_element::<Option<Go<RefFence>>>()? {
                    records.extend(item.map(|Go(f)| f));
                }
                Ok(RefFences::PerMachine(records))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RefFences, A::Error> {
                let mut shards = Vec::new();
                while let Some(shard_id) = map.next_key::<String>()? {
                    if let Some(Go(mark)) = map.next_value::<Option<Go<RefShardMark>>>()? {
                        shards.push((shard_id, mark));
                    }
                }
                Ok(RefFences::ShardWide(shards))
            }
        }
        d.deserialize_any(FencesVisitor)
    }
}

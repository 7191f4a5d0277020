//! The domain model of a machine slot: its state, capacity type, host and cluster binding.
//! Plain data with no I/O; `server` converts it to and from the wire types.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

/// The lifecycle state of a machine (contract.md §2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MachineState {
    Unspecified,
    Speculative,
    Creating,
    Idle,
    Configuring,
    Configured,
    Draining,
    Deleting,
    Failed,
}

impl MachineState {
    /// Every state, in wire-number order.
    pub const ALL: [MachineState; 9] = [
        MachineState::Unspecified,
        MachineState::Speculative,
        MachineState::Creating,
        MachineState::Idle,
        MachineState::Configuring,
        MachineState::Configured,
        MachineState::Draining,
        MachineState::Deleting,
        MachineState::Failed,
    ];

    /// The name used in error messages and in the reference state file.
    pub fn name(self) -> &'static str {
        match self {
            MachineState::Unspecified => "Unspecified",
            MachineState::Speculative => "Speculative",
            MachineState::Creating => "Creating",
            MachineState::Idle => "Idle",
            MachineState::Configuring => "Configuring",
            MachineState::Configured => "Configured",
            MachineState::Draining => "Draining",
            MachineState::Deleting => "Deleting",
            MachineState::Failed => "Failed",
        }
    }

    /// Parses a state name as the reference state file writes it.
    pub fn from_name(name: &str) -> Option<MachineState> {
        MachineState::ALL.into_iter().find(|s| s.name() == name)
    }

    /// True for Creating, Configuring, Draining and Deleting.
    pub fn is_transitional(self) -> bool {
        matches!(
            self,
            MachineState::Creating
                | MachineState::Configuring
                | MachineState::Draining
                | MachineState::Deleting
        )
    }

    /// The wire number of `bigfleet.v1alpha1.MachineState`.
    pub fn wire(self) -> i32 {
        self as i32
    }

    /// The state for a wire number; unknown numbers are `None`.
    pub fn from_wire(number: i32) -> Option<MachineState> {
        usize::try_from(number)
            .ok()
            .and_then(|i| MachineState::ALL.get(i).copied())
    }
}

impl fmt::Display for MachineState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How the capacity is bought (contract.md §1.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CapacityType {
    Unspecified,
    BareMetal,
    Reserved,
    OnDemand,
    Spot,
}

impl CapacityType {
    const ALL: [CapacityType; 5] = [
        CapacityType::Unspecified,
        CapacityType::BareMetal,
        CapacityType::Reserved,
        CapacityType::OnDemand,
        CapacityType::Spot,
    ];

    /// The name used in slot ids and the reference state file.
    pub fn name(self) -> &'static str {
        match self {
            CapacityType::Unspecified => "Unspecified",
            CapacityType::BareMetal => "BareMetal",
            CapacityType::Reserved => "Reserved",
            CapacityType::OnDemand => "OnDemand",
            CapacityType::Spot => "Spot",
        }
    }

    pub fn from_name(name: &str) -> Option<CapacityType> {
        CapacityType::ALL.into_iter().find(|c| c.name() == name)
    }

    pub fn wire(self) -> i32 {
        self as i32
    }

    pub fn from_wire(number: i32) -> Option<CapacityType> {
        usize::try_from(number)
            .ok()
            .and_then(|i| CapacityType::ALL.get(i).copied())
    }
}

/// Where a machine runs: the provider label and the provider-scoped host id.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostRef {
    pub provider: String,
    pub id: String,
}

impl HostRef {
    /// A host counts as absent only when both fields are empty (contract.md §2.2).
    pub fn is_empty(&self) -> bool {
        self.provider.is_empty() && self.id.is_empty()
    }
}

/// A sorted string map (labels, resources, metadata) that is shared, not copied, when cloned:
/// every slot of an offering points at the same resources, allocatable and labels, which keeps
/// a 100,000-machine inventory small. Writes copy on demand.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct StringMap(Arc<BTreeMap<String, String>>);

impl StringMap {
    pub fn new() -> StringMap {
        StringMap::default()
    }

    fn map_mut(&mut self) -> &mut BTreeMap<String, String> {
        Arc::make_mut(&mut self.0)
    }

    pub fn insert(&mut self, key: String, value: String) -> Option<String> {
        self.map_mut().insert(key, value)
    }

    pub fn remove(&mut self, key: &str) -> Option<String> {
        if self.0.contains_key(key) {
            self.map_mut().remove(key)
        } else {
            None
        }
    }

    pub fn clear(&mut self) {
        if !self.0.is_empty() {
            self.0 = Arc::default();
        }
    }

    /// Whether two maps share storage (cheap equality for the common case).
    pub fn shares_with(&self, other: &StringMap) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl std::ops::Deref for StringMap {
    type Target = BTreeMap<String, String>;
    fn deref(&self) -> &BTreeMap<String, String> {
        &self.0
    }
}

impl fmt::Debug for StringMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl From<BTreeMap<String, String>> for StringMap {
    fn from(map: BTreeMap<String, String>) -> StringMap {
        StringMap(Arc::new(map))
    }
}

impl<const N: usize> From<[(String, String); N]> for StringMap {
    fn from(pairs: [(String, String); N]) -> StringMap {
        StringMap(Arc::new(BTreeMap::from(pairs)))
    }
}

impl FromIterator<(String, String)> for StringMap {
    fn from_iter<I: IntoIterator<Item = (String, String)>>(iter: I) -> StringMap {
        StringMap(Arc::new(iter.into_iter().collect()))
    }
}

impl Extend<(String, String)> for StringMap {
    fn extend<I: IntoIterator<Item = (String, String)>>(&mut self, iter: I) {
        let mut iter = iter.into_iter().peekable();
        if iter.peek().is_some() {
            self.map_mut().extend(iter);
        }
    }
}

impl<'a> Extend<(&'a String, &'a String)> for StringMap {
    fn extend<I: IntoIterator<Item = (&'a String, &'a String)>>(&mut self, iter: I) {
        self.extend(iter.into_iter().map(|(k, v)| (k.clone(), v.clone())));
    }
}

impl<'a> IntoIterator for &'a StringMap {
    type Item = (&'a String, &'a String);
    type IntoIter = std::collections::btree_map::Iter<'a, String, String>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

impl IntoIterator for StringMap {
    type Item = (String, String);
    type IntoIter = std::collections::btree_map::IntoIter<String, String>;
    fn into_iter(self) -> Self::IntoIter {
        Arc::unwrap_or_clone(self.0).into_iter()
    }
}

impl serde::Serialize for StringMap {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(serializer)
    }
}

impl<'de> serde::Deserialize<'de> for StringMap {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<StringMap, D::Error> {
        BTreeMap::deserialize(deserializer).map(StringMap::from)
    }
}

/// One machine slot as the provider reports it.
#[derive(Clone, Debug, PartialEq)]
pub struct Machine {
    pub id: String,
    pub state: MachineState,
    pub host: Option<HostRef>,
    pub instance_type: String,
    pub zone: String,
    pub capacity_type: CapacityType,
    pub price_per_hour: f64,
    pub interruption_probability: f64,
    pub resources: StringMap,
    pub allocatable: StringMap,
    pub labels: StringMap,
    pub last_error: String,
    pub cluster: String,
    pub shard_metadata: StringMap,
    /// The machine's encoded wire form, filled by the first List that needs it.
    pub wire: WireCache,
}

/// A lazily filled copy of a machine's encoded wire form. It never travels with a changed
/// machine: clones start empty, and [`edit`] empties it before any change in place.
#[derive(Default)]
pub struct WireCache(std::sync::OnceLock<prost::bytes::Bytes>);

impl WireCache {
    /// The cached encoding, computed by `encode` on first use.
    pub fn get_or_init(&self, encode: impl FnOnce() -> prost::bytes::Bytes) -> prost::bytes::Bytes {
        self.0.get_or_init(encode).clone()
    }
}

impl Clone for WireCache {
    fn clone(&self) -> WireCache {
        WireCache::default()
    }
}

impl PartialEq for WireCache {
    /// A cache never makes two machines different.
    fn eq(&self, _: &WireCache) -> bool {
        true
    }
}

impl fmt::Debug for WireCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.get().is_some() {
            "cached"
        } else {
            "empty"
        })
    }
}

/// Mutable access to a shared machine for a change: copies it if it is shared and drops its
/// cached encoding.
pub fn edit(machine: &mut Arc<Machine>) -> &mut Machine {
    let m = Arc::make_mut(machine);
    m.wire = WireCache::default();
    m
}

impl Machine {
    /// A Speculative slot with no host and no binding.
    pub fn speculative(id: impl Into<String>, instance_type: impl Into<String>) -> Machine {
        Machine {
            id: id.into(),
            state: MachineState::Speculative,
            host: None,
            instance_type: instance_type.into(),
            zone: String::new(),
            capacity_type: CapacityType::OnDemand,
            price_per_hour: 0.0,
            interruption_probability: 0.0,
            resources: StringMap::new(),
            allocatable: StringMap::new(),
            labels: StringMap::new(),
            last_error: String::new(),
            cluster: String::new(),
            shard_metadata: StringMap::new(),
            wire: WireCache::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_drops_the_cached_encoding() {
        let mut shared = Arc::new(Machine::speculative("m", "t"));
        let first = shared
            .wire
            .get_or_init(|| prost::bytes::Bytes::from_static(b"old"));
        assert_eq!(&first[..], b"old");
        // Unique Arc: changed in place, the cache must still be dropped.
        edit(&mut shared).state = MachineState::Creating;
        let second = shared
            .wire
            .get_or_init(|| prost::bytes::Bytes::from_static(b"new"));
        assert_eq!(&second[..], b"new");
        // Shared Arc: copied on change; the copy starts empty, the original keeps its cache.
        let reader = shared.clone();
        edit(&mut shared).state = MachineState::Idle;
        assert_eq!(&reader.wire.get_or_init(|| unreachable!())[..], b"new");
        assert_eq!(
            &shared
                .wire
                .get_or_init(|| prost::bytes::Bytes::from_static(b"idle"))[..],
            b"idle"
        );
        assert!(
            *reader != *shared,
            "the cache never decides equality, the fields do"
        );
    }
}

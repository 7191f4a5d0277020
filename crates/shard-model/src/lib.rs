//! BigFleet's shard as a test oracle, written from the shard's own code (intUnderflow/bigfleet
//! `pkg/machine/machine.go`, `pkg/shard/reconcile.go`, `pkg/shard/execute.go`):
//!
//! - its transition table ([`allows`]): Speculative -> Creating; Creating -> Idle | Failed;
//!   Idle -> Configuring | Deleting; Configuring -> Configured | Failed | Idle; Configured ->
//!   Draining; Draining -> Idle | Failed; Deleting -> Speculative | Failed; Failed has no way
//!   out;
//! - `inventory.Apply` ignoring a report that is not an edge from the state it holds (the
//!   machine keeps its state, and nothing tells the provider);
//! - a full reconcile dropping the ids a List no longer returns and taking an unseen one as
//!   new capacity; an incremental one (List since a revision) dropping nothing;
//! - a Create answered with an error marking the machine Failed.
//!
//! Tests put every answer of a provider through a full-reconcile model and an incremental one
//! ([`Shards`]); a refused edge fails them, as does a machine a model holds in a state the
//! provider no longer reports for it at the end ([`ShardModel::verdict_with`]). States are the
//! wire's numbers, so the crate needs nothing of the provider's.

use std::collections::{HashMap, HashSet};

/// A machine state, numbered as `bigfleet.v1alpha1.MachineState` on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum State {
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

impl State {
    /// The state of wire number `n` (an unknown number is [`State::Unspecified`]).
    pub fn from_wire(n: i32) -> State {
        use State::*;
        match n {
            1 => Speculative,
            2 => Creating,
            3 => Idle,
            4 => Configuring,
            5 => Configured,
            6 => Draining,
            7 => Deleting,
            8 => Failed,
            _ => Unspecified,
        }
    }
}

/// The shard's transition table (`validTransitions` and `CanTransition`).
pub fn allows(from: State, to: State) -> bool {
    use State::*;
    matches!(
        (from, to),
        (Speculative, Creating)
            | (Creating, Idle | Failed)
            | (Idle, Configuring | Deleting)
            | (Configuring, Configured | Failed | Idle)
            | (Configured, Draining)
            | (Draining, Idle | Failed)
            | (Deleting, Speculative | Failed)
    )
}

/// A report the shard's `Apply` refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub id: String,
    pub held: State,
    pub reported: State,
    /// The answer it came in: `ack`, `Get`, `List`.
    pub source: &'static str,
}

/// One shard's inventory of one provider, as the shard's code keeps it.
#[derive(Clone, Debug, Default)]
pub struct ShardModel {
    pub incremental: bool,
    pub held: HashMap<String, State>,
    /// The revision (as the wire carries it) the next incremental List starts after.
    pub cursor: Option<Vec<u8>>,
    /// Every report `Apply` refused.
    pub refused: Vec<Refusal>,
}

impl ShardModel {
    pub fn new(incremental: bool) -> ShardModel {
        ShardModel {
            incremental,
            ..ShardModel::default()
        }
    }

    /// `inventory.Insert` for an unseen id, `Apply` (an edge, or nothing) for a known one.
    pub fn apply(&mut self, id: &str, state: State, source: &'static str) {
        match self.held.get(id).copied() {
            None => {
                self.held.insert(id.to_owned(), state);
            }
            Some(held) if held == state => {}
            Some(held) if allows(held, state) => {
                self.held.insert(id.to_owned(), state);
            }
            Some(held) => self.refused.push(Refusal {
                id: id.to_owned(),
                held,
                reported: state,
                source,
            }),
        }
    }

    /// What the next List asks since: nothing for a full shard (and for an incremental one's
    /// first), else the revision its last List returned.
    pub fn since(&self) -> Vec<u8> {
        match (self.incremental, &self.cursor) {
            (true, Some(cursor)) => cursor.clone(),
            _ => Vec::new(),
        }
    }

    /// A reconcile over the answer of a List asked with [`ShardModel::since`]: every machine is
    /// applied; the full model then drops the ids the List left out, the incremental one keeps
    /// the revision as its cursor and drops nothing.
    pub fn read_list(&mut self, machines: &[(String, State)], revision: Vec<u8>) {
        for (id, state) in machines {
            self.apply(id, *state, "List");
        }
        if self.incremental {
            self.cursor = Some(revision);
        } else {
            let seen: HashSet<&str> = machines.iter().map(|(id, _)| id.as_str()).collect();
            self.held.retain(|id, _| seen.contains(id.as_str()));
        }
    }

    /// A Create answered with an error: the shard marks the machine Failed (`execute.go`).
    /// Errors of the other mutations change nothing.
    pub fn create_refused(&mut self, id: &str) {
        if let Some(state) = self.held.get_mut(id) {
            *state = State::Failed;
        }
    }

    /// The ids held in `state`, sorted.
    pub fn in_state(&self, state: State) -> Vec<String> {
        let mut ids: Vec<String> = self
            .held
            .iter()
            .filter(|(_, s)| **s == state)
            .map(|(id, _)| id.clone())
            .collect();
        ids.sort();
        ids
    }

    /// After a last reconcile: nothing was refused, and every machine the shard holds is in
    /// the state the provider reports for it (`reported`: its Get, `None` when it has no such
    /// machine). An id the provider no longer has is allowed only when the shard holds it
    /// Failed, the state the provider last reported (a retired record leaves after its
    /// retention; only an incremental shard keeps it).
    pub fn verdict_with(&self, reported: impl Fn(&str) -> Option<State>) -> Result<(), String> {
        let kind = if self.incremental {
            "incremental"
        } else {
            "full"
        };
        if let Some(first) = self.refused.first() {
            return Err(format!(
                "the {kind} shard refused {} reports, the first {first:?}",
                self.refused.len()
            ));
        }
        let mut held: Vec<(&String, &State)> = self.held.iter().collect();
        held.sort();
        for (id, held) in held {
            match reported(id) {
                Some(state) if state == *held => {}
                Some(state) => {
                    return Err(format!(
                        "the {kind} shard holds {id} {held:?}, the provider reports {state:?}"
                    ));
                }
                None if *held == State::Failed => {}
                None => {
                    return Err(format!(
                        "the {kind} shard holds {id} {held:?}, which the provider no longer has"
                    ));
                }
            }
        }
        Ok(())
    }
}

/// A full-reconcile shard and an incremental one, fed the same answers.
#[derive(Clone, Debug)]
pub struct Shards {
    pub full: ShardModel,
    pub incremental: ShardModel,
}

impl Default for Shards {
    fn default() -> Shards {
        Shards::new()
    }
}

impl Shards {
    pub fn new() -> Shards {
        Shards {
            full: ShardModel::new(false),
            incremental: ShardModel::new(true),
        }
    }

    /// Both read a report of `id` in `state` (an ack, a Get).
    pub fn apply(&mut self, id: &str, state: State, source: &'static str) {
        self.full.apply(id, state, source);
        self.incremental.apply(id, state, source);
    }

    /// Both read a Create answered with an error.
    pub fn create_refused(&mut self, id: &str) {
        self.full.create_refused(id);
        self.incremental.create_refused(id);
    }

    /// Both forget what they held of `id`: a call about it got no answer (the provider
    /// restarting), so whether it took effect is unknown; the next report of it is taken as
    /// new.
    pub fn forget(&mut self, id: &str) {
        self.full.held.remove(id);
        self.incremental.held.remove(id);
    }

    /// Every id either holds, sorted.
    pub fn held(&self) -> Vec<String> {
        let mut ids: Vec<String> = self
            .full
            .held
            .keys()
            .chain(self.incremental.held.keys())
            .cloned()
            .collect();
        ids.sort();
        ids.dedup();
        ids
    }

    /// Both verdicts.
    pub fn verdict_with(&self, reported: impl Fn(&str) -> Option<State>) -> Result<(), String> {
        self.full.verdict_with(&reported)?;
        self.incremental.verdict_with(&reported)
    }

    /// Reports refused by either.
    pub fn refused(&self) -> usize {
        self.full.refused.len() + self.incremental.refused.len()
    }
}

#[cfg(test)]
mod tests {
    use super::State::*;
    use super::*;

    #[test]
    fn the_table_is_the_shards() {
        assert!(allows(Speculative, Creating));
        assert!(allows(Deleting, Speculative));
        for from in [Creating, Idle, Configured, Failed] {
            assert!(!allows(from, Speculative), "{from:?} -> Speculative");
        }
        assert!(!allows(Idle, Failed) && !allows(Configured, Failed));
        for to in [
            Speculative,
            Creating,
            Idle,
            Configuring,
            Configured,
            Draining,
            Deleting,
        ] {
            assert!(!allows(Failed, to), "Failed has no way out");
        }
    }

    #[test]
    fn apply_ignores_a_refused_edge_and_the_full_shard_drops_unseen_ids() {
        let mut shards = Shards::new();
        let listed = |ids: &[(&str, State)]| -> Vec<(String, State)> {
            ids.iter().map(|(id, s)| ((*id).to_owned(), *s)).collect()
        };
        shards.full.read_list(
            &listed(&[("a", Speculative), ("b", Speculative)]),
            b"1".to_vec(),
        );
        shards.incremental.read_list(
            &listed(&[("a", Speculative), ("b", Speculative)]),
            b"1".to_vec(),
        );
        shards.apply("a", Creating, "ack");
        shards.apply("a", Speculative, "List");
        assert_eq!(
            shards.full.held["a"], Creating,
            "the refused report changes nothing"
        );
        assert_eq!(shards.refused(), 2);
        shards
            .full
            .read_list(&listed(&[("a", Creating)]), b"2".to_vec());
        assert!(
            !shards.full.held.contains_key("b"),
            "a full reconcile drops b"
        );
        assert_eq!(shards.incremental.since(), b"1".to_vec());
        shards.incremental.read_list(&[], b"2".to_vec());
        assert!(
            shards.incremental.held.contains_key("b"),
            "an incremental one drops nothing"
        );
        shards.create_refused("b");
        assert_eq!(shards.incremental.held["b"], Failed);
        let verdict = shards.verdict_with(|_| Some(Creating));
        assert!(verdict.unwrap_err().contains("refused 1 reports"));
    }

    #[test]
    fn the_verdict_wants_every_held_machine_as_the_provider_reports_it() {
        let mut model = ShardModel::new(true);
        model.apply("a", Idle, "List");
        model.apply("gone", Failed, "List");
        assert!(model.verdict_with(|id| (id == "a").then_some(Idle)).is_ok());
        assert!(model.verdict_with(|_| Some(Configured)).is_err());
        model.apply("stuck", Creating, "ack");
        let e = model
            .verdict_with(|id| (id == "a").then_some(Idle))
            .unwrap_err();
        assert!(e.contains("stuck") && e.contains("no longer has"), "{e}");
    }
}

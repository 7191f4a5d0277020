//! The transition table (contract.md §2.1): which operation may start from which state, what it
//! passes through and where it settles. Pure functions, no I/O.

use std::fmt;

use crate::rules::machine::MachineState;

/// The four mutating operations. Idempotency is keyed on (machine id, kind), because Create
/// and Drain share their target state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OperationKind {
    Create,
    Configure,
    Drain,
    Delete,
}

impl OperationKind {
    pub const ALL: [OperationKind; 4] = [
        OperationKind::Create,
        OperationKind::Configure,
        OperationKind::Drain,
        OperationKind::Delete,
    ];

    /// Lower-case name, as used in error messages, logs and the reference state file.
    pub fn name(self) -> &'static str {
        match self {
            OperationKind::Create => "create",
            OperationKind::Configure => "configure",
            OperationKind::Drain => "drain",
            OperationKind::Delete => "delete",
        }
    }

    pub fn from_name(name: &str) -> Option<OperationKind> {
        OperationKind::ALL.into_iter().find(|k| k.name() == name)
    }

    /// Index into per-kind arrays.
    pub fn index(self) -> usize {
        self as usize
    }

    /// The only state this operation may start from.
    pub fn source(self) -> MachineState {
        match self {
            OperationKind::Create => MachineState::Speculative,
            OperationKind::Configure => MachineState::Idle,
            OperationKind::Drain => MachineState::Configured,
            OperationKind::Delete => MachineState::Idle,
        }
    }

    /// The state the machine holds while the operation runs.
    pub fn transitional(self) -> MachineState {
        match self {
            OperationKind::Create => MachineState::Creating,
            OperationKind::Configure => MachineState::Configuring,
            OperationKind::Drain => MachineState::Draining,
            OperationKind::Delete => MachineState::Deleting,
        }
    }

    /// The state the machine settles in when the operation succeeds.
    pub fn target(self) -> MachineState {
        match self {
            OperationKind::Create => MachineState::Idle,
            OperationKind::Configure => MachineState::Configured,
            OperationKind::Drain => MachineState::Idle,
            OperationKind::Delete => MachineState::Speculative,
        }
    }

    /// The operation whose transitional state this is, if any.
    pub fn of_transitional(state: MachineState) -> Option<OperationKind> {
        OperationKind::ALL
            .into_iter()
            .find(|k| k.transitional() == state)
    }

    /// Whether the operation may start from `state`. There is no other edge: nothing leaves
    /// Failed through the API, and no stable state is re-entered without a transition.
    pub fn can_start(self, state: MachineState) -> bool {
        state == self.source()
    }

    /// Whether a repeated request of this kind is a retry of the recorded operation: the machine
    /// is still in the kind's transitional state or has settled at its target.
    pub fn is_retry_position(self, state: MachineState) -> bool {
        state == self.transitional() || state == self.target()
    }
}

impl fmt::Display for OperationKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_has_exactly_one_entry_edge() {
        for kind in OperationKind::ALL {
            let starts: Vec<_> = MachineState::ALL
                .into_iter()
                .filter(|s| kind.can_start(*s))
                .collect();
            assert_eq!(starts, vec![kind.source()], "{kind}");
        }
    }

    #[test]
    fn nothing_starts_from_failed_or_transitional_states() {
        for kind in OperationKind::ALL {
            for state in MachineState::ALL
                .into_iter()
                .filter(|s| s.is_transitional())
            {
                assert!(!kind.can_start(state), "{kind} from {state}");
            }
            assert!(!kind.can_start(MachineState::Failed));
            assert!(!kind.is_retry_position(MachineState::Failed));
        }
    }

    #[test]
    fn table_matches_contract() {
        use MachineState::*;
        let rows = [
            (OperationKind::Create, Speculative, Creating, Idle),
            (OperationKind::Configure, Idle, Configuring, Configured),
            (OperationKind::Drain, Configured, Draining, Idle),
            (OperationKind::Delete, Idle, Deleting, Speculative),
        ];
        for (kind, from, via, to) in rows {
            assert_eq!(
                (kind.source(), kind.transitional(), kind.target()),
                (from, via, to)
            );
            assert_eq!(OperationKind::of_transitional(via), Some(kind));
            assert_eq!(OperationKind::from_name(kind.name()), Some(kind));
        }
    }
}

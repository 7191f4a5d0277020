//! The engine's error type and its one mapping to gRPC status codes (contract.md §3.1).
//! FAILED_PRECONDITION means fencing and nothing else.

use tonic::{Code, Status};

use crate::rules::fence::{FenceToken, HighWaterMark, go_quote};
use crate::rules::lifecycle::OperationKind;
use crate::rules::machine::MachineState;

/// Everything an RPC of the engine can fail with.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    /// An empty `machine_id` (mutations) or `id` (Get).
    #[error("{0} required")]
    MissingId(&'static str),
    /// A request field over its size limit (docs/limits.md).
    #[error("{field} too large: {detail}")]
    FieldTooLarge { field: &'static str, detail: String },
    /// A mutation on an unknown machine.
    #[error("providerkit: machine not found: {0}")]
    UnknownMachine(String),
    /// A Get of an unknown machine.
    #[error("machine {} not found", go_quote(.0))]
    GetNotFound(String),
    /// A stale fence token.
    #[error(
        "providerkit: request fenced (stale shard token): shard {} sent (epoch={} seq={}) for machine {}; high-water mark is {}",
        go_quote(&.token.shard_id), .token.epoch, .token.sequence, go_quote(.machine_id), .mark
    )]
    Fenced {
        token: FenceToken,
        machine_id: String,
        mark: HighWaterMark,
    },
    /// An operation that may not start from the machine's current state.
    #[error("providerkit: invalid state transition: cannot {kind} a machine in state {state}")]
    InvalidTransition {
        kind: OperationKind,
        state: MachineState,
    },
    /// A machine record that breaks the field-shape rules.
    #[error("providerkit: invalid machine record: {0}")]
    InvalidMachine(String),
    /// Delete on a backend without the Delete capability.
    #[error("this provider does not support Delete (bare-metal free-pool semantics)")]
    DeleteUnsupported,
    /// The provider is shutting down and accepts no more mutations.
    #[error("provider is shutting down; retry against the restarted provider")]
    ShuttingDown,
    /// The state store could not make a mutation durable; nothing was acknowledged.
    #[error("state store failure (mutation not acknowledged): {0}")]
    Store(String),
    /// Under mTLS, a mutation whose client certificate does not prove the shard it asserts
    /// (`identity`): checked before the fence, so it says nothing of marks or machines.
    #[error("{0}")]
    ShardIdentity(String),
    /// An admin request that does not apply (for example releasing a machine that is not FAILED).
    #[error("{0}")]
    Admin(String),
}

impl CoreError {
    /// The gRPC code of this error. Exhaustive on purpose: a new variant must choose its code.
    pub fn code(&self) -> Code {
        match self {
            CoreError::MissingId(_) | CoreError::FieldTooLarge { .. } => Code::InvalidArgument,
            CoreError::UnknownMachine(_) | CoreError::GetNotFound(_) => Code::NotFound,
            CoreError::Fenced { .. } => Code::FailedPrecondition,
            CoreError::InvalidTransition { .. } => Code::Internal,
            CoreError::InvalidMachine(_) => Code::Internal,
            CoreError::DeleteUnsupported => Code::Unimplemented,
            CoreError::ShuttingDown | CoreError::Store(_) => Code::Unavailable,
            CoreError::ShardIdentity(_) => Code::PermissionDenied,
            CoreError::Admin(_) => Code::Internal,
        }
    }
}

impl From<CoreError> for Status {
    fn from(err: CoreError) -> Status {
        Status::new(err.code(), err.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variant_maps_to_its_code_and_message() {
        let token = FenceToken {
            shard_id: "s1".into(),
            epoch: 2,
            sequence: 3,
        };
        let cases: Vec<(CoreError, Code, &str)> = vec![
            (
                CoreError::MissingId("machine_id"),
                Code::InvalidArgument,
                "machine_id required",
            ),
            (
                CoreError::MissingId("id"),
                Code::InvalidArgument,
                "id required",
            ),
            (
                CoreError::FieldTooLarge {
                    field: "cluster_id",
                    detail: "300 bytes, the limit is 256".into(),
                },
                Code::InvalidArgument,
                "cluster_id too large: 300 bytes, the limit is 256",
            ),
            (
                CoreError::UnknownMachine("m".into()),
                Code::NotFound,
                "providerkit: machine not found: m",
            ),
            (
                CoreError::GetNotFound("m".into()),
                Code::NotFound,
                "machine \"m\" not found",
            ),
            (
                CoreError::Fenced {
                    token,
                    machine_id: "m".into(),
                    mark: HighWaterMark {
                        epoch: 2,
                        sequence: 5,
                    },
                },
                Code::FailedPrecondition,
                "providerkit: request fenced (stale shard token): shard \"s1\" sent (epoch=2 seq=3) for machine \"m\"; high-water mark is (epoch=2 seq=5)",
            ),
            (
                CoreError::InvalidTransition {
                    kind: OperationKind::Drain,
                    state: MachineState::Speculative,
                },
                Code::Internal,
                "providerkit: invalid state transition: cannot drain a machine in state Speculative",
            ),
            (
                CoreError::InvalidMachine("m: zone is required".into()),
                Code::Internal,
                "providerkit: invalid machine record: m: zone is required",
            ),
            (
                CoreError::DeleteUnsupported,
                Code::Unimplemented,
                "this provider does not support Delete (bare-metal free-pool semantics)",
            ),
            (
                CoreError::ShuttingDown,
                Code::Unavailable,
                "provider is shutting down; retry against the restarted provider",
            ),
            (
                CoreError::Store("disk full".into()),
                Code::Unavailable,
                "state store failure (mutation not acknowledged): disk full",
            ),
            (
                CoreError::ShardIdentity("shard identity: …".into()),
                Code::PermissionDenied,
                "shard identity: …",
            ),
            (CoreError::Admin("nope".into()), Code::Internal, "nope"),
        ];
        for (err, code, message) in cases {
            let status = Status::from(err);
            assert_eq!(status.code(), code);
            assert_eq!(status.message(), message);
        }
    }

    #[test]
    fn only_fencing_is_failed_precondition() {
        let others = [
            CoreError::MissingId("id"),
            CoreError::FieldTooLarge {
                field: "shard_id",
                detail: String::new(),
            },
            CoreError::UnknownMachine("m".into()),
            CoreError::GetNotFound("m".into()),
            CoreError::InvalidTransition {
                kind: OperationKind::Create,
                state: MachineState::Failed,
            },
            CoreError::InvalidMachine(String::new()),
            CoreError::DeleteUnsupported,
            CoreError::ShuttingDown,
            CoreError::Store(String::new()),
            CoreError::ShardIdentity(String::new()),
            CoreError::Admin(String::new()),
        ];
        for err in others {
            assert_ne!(err.code(), Code::FailedPrecondition, "{err:?}");
        }
    }
}

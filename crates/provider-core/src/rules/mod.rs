//! The contract's rules as plain functions over plain types, with no I/O and no task: the
//! machine and its transition table, fencing, the records of the state, every rule that
//! changes it, the size limits of a request, and the one mapping of errors to gRPC codes.

pub mod error;
pub mod fence;
pub mod inventory;
pub mod lifecycle;
pub mod limits;
pub mod machine;
pub mod records;

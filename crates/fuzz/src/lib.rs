//! Fuzz targets for every decoder of untrusted or on-disk bytes in the workspace, runnable on the
//! stable toolchain (`cargo xtask fuzz`, docs/fuzzing.md).
//!
//! A target is a property over an [`arbitrary::Unstructured`] input: it builds structured
//! values from the bytes (so most inputs reach deep into the decoder instead of failing its
//! first check), feeds them or their mutated encodings to the decoder, and asserts what must
//! hold beyond "does not panic" (round trips, canonical re-encoding, agreement between two
//! readers of the same state). [`engine`] drives a target with random inputs under a time and
//! input budget, names every input by a seed that regenerates it, and shrinks a crashing input.

pub mod engine;
mod shape;
pub mod targets;

pub use engine::{Budget, Crash, Report, Target};

/// Every target, in the order `cargo xtask fuzz` runs them.
pub const TARGETS: &[Target] = &[
    targets::durable::CODEC,
    targets::durable::FILES,
    targets::durable::STORE,
    targets::etcd::RECORDS,
    targets::reference::IMPORT,
    targets::offerings::JSON,
    targets::agent::COMMAND,
    targets::agent::CONFIG,
    targets::agent_state::STATE,
    targets::channel::REQUESTS,
    targets::labels::HETZNER,
    targets::labels::DIGITALOCEAN,
];

/// The target called `name`.
pub fn target(name: &str) -> Option<&'static Target> {
    TARGETS.iter().find(|t| t.name == name)
}

//! Dev-only test kit: the scaffolding the integration tests of every crate share, written once
//! (as rust-analyzer's `test-utils` and tokio's `tokio-test` are).
//!
//! - [`wire`]: the gRPC test client: channels in every security mode against the committed
//!   test PKI, a shard stamping fresh fence tokens, the Create/Configure/Drain/Delete request
//!   builders, Get/List and bounded polling of Get until a machine settles.
//! - [`provider_process`]: a provider binary as a child process on loopback ports: free ports,
//!   wait for SERVING, logs, SIGTERM/SIGKILL, restart.
//! - [`cli`]: a provider binary's command line run to completion (help texts).
//! - [`engine`]: an engine over a `Fleet` of any `Cloud` with one offering, the zero fence
//!   token, and the wait until every machine of a burst is Idle (failing on the first FAILED).
//! - [`classes`]: the emulators' request counts by class, and how they grew.
//! - [`wait`]: bounded polling of a condition (what it counts is the test's, the deadline
//!   only turns a hang into a failure).
//! - [`listing`]: what a provider lists, through the test client.
//! - [`logs`]: a `tracing` capture of the current thread's log lines, and a child process's
//!   output collected as it comes.
//! - [`out_of_band`]: the cloud-neutral steps of the out-of-band check scenario.
//! - [`stockout`]: the cloud-neutral stockout and account-limit scenarios (a sold-out offering
//!   and its return, a limit with room for two, bursts on a sold-out offering, a restart while
//!   withdrawn), each cloud's emulator behind its [`stockout::Knobs`].
//! - [`json`]: entries of the JSON documents a test reads back (state exports, reports).
//! - [`metrics`]: one series of this process's Prometheus rendering.
//! - [`time`]: scaled time: a cloud's seconds at a test's time scale.
//! - [`relay`]: a loopback TCP relay that counts, cuts and retargets connections.
//! - [`script`]: executable shell stand-ins (hooks, node tools).
//! - `hcloud` (feature `hetzner`) and `digitalocean` (feature `digitalocean`): the emulators
//!   started on 127.0.0.1, so a crate's tests compile only the emulator they use.
//!
//! It is a dev-dependency only; nothing here ships.

// Test code: a panic is the failure report we want.
#![allow(clippy::unwrap_used)]

// `Shard::next` stamps the next fence token; it is no iterator, as `cargo xtask e2e` has it.
#[allow(clippy::should_implement_trait)]
#[path = "../../../xtask/src/e2e/wire.rs"]
pub mod wire;

#[path = "../../../xtask/src/e2e/provider_process.rs"]
pub mod provider_process;

pub mod classes;
pub mod cli;
pub mod engine;
pub mod json;
pub mod listing;
pub mod logs;
pub mod metrics;
pub mod out_of_band;
pub mod relay;
pub mod script;
pub mod shard;
pub mod stockout;
pub mod time;
pub mod wait;

#[cfg(feature = "digitalocean")]
pub mod digitalocean;
#[cfg(feature = "hetzner")]
pub mod hcloud;

use std::path::PathBuf;

/// The workspace root, for the committed test PKI (`testdata/pki`) and the like.
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

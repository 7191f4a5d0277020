//! The `faultprovider` binary as a child process on a loopback port: every fault trigger
//! certified over gRPC, and graceful shutdown on SIGTERM.

// Helpers outside `#[test]` functions may unwrap too: a panic is the failure report.
#![allow(clippy::unwrap_used)]

use testkit::{provider_process, wire};

mod ha;
mod shutdown;
mod triggers;

use std::path::PathBuf;

use provider_process::{Provider, Spec};
use wire::{Caller, ClientSecurity, Shard};

/// Starts `faultprovider` with `--transition-timeout` and 6 ordinary slots (plus the 8
/// create-fault slots it always seeds), and waits for SERVING.
pub async fn start(transition_timeout: &str) -> Provider {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let spec = Spec {
        name: "faultprovider".into(),
        binary: PathBuf::from(env!("CARGO_BIN_EXE_faultprovider")),
        args: vec![
            format!("--transition-timeout={transition_timeout}"),
            "--seed-count=6".into(),
        ],
        metrics: false,
        security: ClientSecurity::Plaintext,
        pki: wire::pki_dir(&root),
    };
    provider_process::start(spec)
        .await
        .expect("faultprovider serves")
}

/// A plaintext caller for `provider`.
pub async fn caller(provider: &Provider) -> Caller {
    let channel = provider.default_channel().await.expect("connect");
    Caller::new(channel, Shard::new("fault-shard", 1))
}

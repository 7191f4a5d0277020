//! Wiring point between the `hetzner` binary's flags and the real Hetzner Cloud backend.
//! `build` reads the files the flags name (`--ssh-key`, `--base-user-data`), validates the
//! real-backend flags and constructs the `Cloud` implementation; it makes no network call.

use std::sync::Arc;

use provider_core::cloud::Cloud;
use provider_core::config::Secret;
use provider_core::offerings::Offering;
use provider_core::telemetry::Telemetry;

use crate::cloud::{HetznerCloud, HetznerConfig, SshAddress, Timing};
use crate::ssh::{SshConfig, SshIdentity};

/// The flags the real backend needs, as given on the command line.
#[derive(Debug, Clone)]
pub struct RealArgs {
    pub token: Secret,
    pub endpoint: String,
    pub provider: String,
    pub image: String,
    /// Path of the SSH private key; empty disables Configure and Drain.
    pub ssh_key: String,
    pub ssh_user: String,
    pub ssh_port: u16,
    /// `--network`: private network (name or id) new servers are attached to; empty for none.
    pub network: String,
    /// `--ssh-address`: `public` (default) or `private` (the address on `--network`).
    pub ssh_address: String,
    pub bootstrap_hook: String,
    /// Empty: the hook's success is taken as readiness.
    pub readiness_command: String,
    /// Path of the operator's cloud-init; empty for none.
    pub base_user_data: String,
    pub eur_usd: f64,
}

/// Validates the real-backend flags and builds the Hetzner Cloud backend.
pub fn build(
    args: RealArgs,
    offerings: &[Offering],
    telemetry: Telemetry,
) -> Result<Arc<dyn Cloud>, String> {
    Ok(Arc::new(build_cloud(args, offerings, telemetry)?))
}

/// [`build`], returning the concrete type.
pub fn build_cloud(
    args: RealArgs,
    offerings: &[Offering],
    telemetry: Telemetry,
) -> Result<HetznerCloud, String> {
    if args.token.is_empty() {
        return Err("hcloud: token is required for the hetzner backend".into());
    }
    if args.image.trim().is_empty() {
        return Err("hcloud: --image is required for the hetzner backend".into());
    }
    let ssh = if args.ssh_key.is_empty() {
        tracing::warn!(
            "no --ssh-key set: Configure cannot deliver the bootstrap blob and Drain cannot drain \
             nodes; both transitions will fail until --ssh-key is set"
        );
        None
    } else {
        let path = &args.ssh_key;
        let key =
            std::fs::read_to_string(path).map_err(|e| format!("read --ssh-key {path}: {e}"))?;
        let config = SshConfig {
            user: args.ssh_user.clone(),
            key,
            port: args.ssh_port,
        };
        SshIdentity::parse(&config).map_err(|e| match e.strip_prefix("parse --ssh-key: ") {
            Some(reason) => format!("parse --ssh-key {path}: {reason}"),
            None => e,
        })?;
        Some(config)
    };
    let base_user_data = if args.base_user_data.is_empty() {
        None
    } else {
        let path = &args.base_user_data;
        Some(
            std::fs::read_to_string(path)
                .map_err(|e| format!("read --base-user-data: {path}: {e}"))?,
        )
    };
    let readiness_command =
        Some(args.readiness_command.trim().to_owned()).filter(|c| !c.is_empty());
    if readiness_command.is_none() {
        tracing::info!(
            "no --readiness-command set: a successful bootstrap hook is taken as node readiness"
        );
    }
    let mut locations: Vec<String> = offerings.iter().map(|o| o.zone.clone()).collect();
    locations.sort();
    locations.dedup();
    HetznerCloud::new(HetznerConfig {
        token: args.token,
        endpoint: args.endpoint,
        provider_instance: args.provider,
        image: args.image,
        locations,
        ssh,
        network: Some(args.network).filter(|n| !n.trim().is_empty()),
        ssh_address: SshAddress::parse(&args.ssh_address)?,
        bootstrap_hook: args.bootstrap_hook,
        base_user_data,
        readiness_command,
        eur_usd: args.eur_usd,
        telemetry,
        timing: Timing::default(),
    })
}

//! Wiring point between the `hetzner` binary's flags and the real Hetzner Cloud backend.
//! `build` reads the files the flags name (`--ssh-key`, `--base-user-data`), validates the
//! real-backend flags and the offerings' server settings and constructs the `Cloud`
//! implementation; it makes no network call ([`crate::cloud::HetznerCloud::resolve`] does,
//! at startup).

use std::sync::Arc;

use provider_core::cloud::Cloud;
use provider_core::config::Secret;
use provider_core::offerings::Offering;
use provider_core::telemetry::Telemetry;

use crate::cloud::{HetznerCloud, HetznerConfig, Timing};
use crate::settings::{
    self, NetworkRef, OfferingSpec, Overrides, Placement, ServerSpec, SshAddress,
};
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
    /// `--image-selector`.
    pub image_selector: String,
    /// `--network` (each `NAME_OR_ID[=SUBNET]`); empty entries are ignored.
    pub networks: Vec<String>,
    /// `--firewall`.
    pub firewalls: Vec<String>,
    pub public_ipv4: bool,
    pub public_ipv6: bool,
    /// `--ssh-address`: `public` (default), `private` or `ipv6`.
    pub ssh_address: String,
    /// `--placement`: `none` or `spread`.
    pub placement: String,
    /// `--server-label` (each `key=value`).
    pub server_labels: Vec<String>,
    /// `--login-ssh-key`.
    pub login_ssh_keys: Vec<String>,
    /// The server-settings fields of the `--offerings` document, in document order.
    pub overrides: Vec<Overrides>,
    pub bootstrap_hook: String,
    /// Empty: the hook's success is taken as readiness.
    pub readiness_command: String,
    /// Path of the operator's cloud-init; empty for none.
    pub base_user_data: String,
    pub eur_usd: f64,
}

fn nonempty(values: &[String]) -> Vec<String> {
    values
        .iter()
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
        .collect()
}

/// The server settings the flags give (every offering's defaults).
pub fn server_spec(args: &RealArgs) -> Result<ServerSpec, String> {
    let image_selector = if args.image_selector.trim().is_empty() {
        String::new()
    } else {
        settings::parse_image_selector(&args.image_selector)
            .map_err(|e| format!("--image-selector {e}"))?
    };
    let image = args.image.trim().to_owned();
    if !image.is_empty() && !image_selector.is_empty() {
        return Err(format!(
            "set either --image ({image:?}) or --image-selector ({image_selector:?}), not both"
        ));
    }
    let networks = nonempty(&args.networks)
        .iter()
        .map(|n| NetworkRef::parse(n).map_err(|e| format!("--network {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    let mut labels = std::collections::BTreeMap::new();
    for label in nonempty(&args.server_labels) {
        let (k, v) = settings::parse_label(&label).map_err(|e| format!("--server-label {e}"))?;
        labels.insert(k, v);
    }
    Ok(ServerSpec {
        image,
        image_selector,
        networks,
        firewalls: nonempty(&args.firewalls),
        public_ipv4: args.public_ipv4,
        public_ipv6: args.public_ipv6,
        ssh_address: SshAddress::parse(&args.ssh_address)?,
        placement: Placement::parse(&args.placement).map_err(|e| format!("--placement {e}"))?,
        labels,
        login_keys: nonempty(&args.login_ssh_keys),
    })
}

/// The flags' settings and every offering's effective settings, validated.
pub fn specs(
    args: &RealArgs,
    offerings: &[Offering],
) -> Result<(ServerSpec, Vec<OfferingSpec>), String> {
    let server = server_spec(args)?;
    let specs = settings::offering_specs(&server, offerings, &args.overrides)?;
    Ok((server, specs))
}

/// Validates the real-backend flags and builds the Hetzner Cloud backend.
pub fn build(
    args: RealArgs,
    offerings: &[Offering],
    telemetry: Telemetry,
) -> Result<Arc<dyn Cloud>, String> {
    Ok(Arc::new(build_cloud(args, offerings, telemetry)?))
}

/// Reads and parses `--ssh-key`; `None` when it is not set.
pub fn ssh_config(args: &RealArgs) -> Result<Option<SshConfig>, String> {
    if args.ssh_key.is_empty() {
        return Ok(None);
    }
    let path = &args.ssh_key;
    let key = std::fs::read_to_string(path).map_err(|e| format!("read --ssh-key {path}: {e}"))?;
    let config = SshConfig {
        user: args.ssh_user.clone(),
        key,
        port: args.ssh_port,
    };
    SshIdentity::parse(&config).map_err(|e| match e.strip_prefix("parse --ssh-key: ") {
        Some(reason) => format!("parse --ssh-key {path}: {reason}"),
        None => e,
    })?;
    Ok(Some(config))
}

/// Checks the built-in default mix against the API's catalogue before anything is built: a
/// type Hetzner marks deprecated or unavailable in a location is replaced by its successor
/// there (or kept, to be withdrawn, when none is sold), and each change is logged with why.
/// When the API does not answer, the mix stays as it is (the catalogue read at warm-up then
/// decides what is advertised).
pub async fn revise_default_mix(args: &RealArgs, mut offerings: Vec<Offering>) -> Vec<Offering> {
    let api = match crate::api::HcloudApi::new(
        &args.endpoint,
        args.token.clone(),
        Telemetry::new("bigfleet_hetzner"),
        crate::api::ClientTiming::default(),
    ) {
        Ok(api) => api,
        Err(_) => return offerings,
    };
    let deadline = tokio::time::Instant::now() + provider_core::fleet::WARMUP_BUDGET;
    let types = match api.server_types(Some(deadline)).await {
        Ok(types) => types,
        Err(e) => {
            tracing::warn!(err = %e, "default offerings: the catalogue could not be read; checking them again at warm-up");
            return offerings;
        }
    };
    let now = provider_core::catalogue::now_unix();
    let revisions = crate::catalog::revise_default_mix(&mut offerings, &types, now);
    for r in &revisions {
        match &r.to {
            Some(to) => tracing::warn!(
                location = r.location,
                from = r.from,
                to,
                why = r.why,
                "default offerings: replaced a server type Hetzner no longer sells there by its successor"
            ),
            None => tracing::warn!(
                location = r.location,
                server_type = r.from,
                why = r.why,
                "default offerings: no successor is sold there; the offering is withdrawn until Hetzner sells the type again"
            ),
        }
    }
    if revisions.is_empty() {
        offerings
    } else {
        provider_core::offerings::merge_same_placement(offerings)
    }
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
    let (server, specs) = specs(&args, offerings)?;
    let ssh = ssh_config(&args)?;
    if ssh.is_none() {
        tracing::warn!(
            "no --ssh-key set: Configure cannot deliver the bootstrap blob and Drain cannot drain \
             nodes; both transitions will fail until --ssh-key is set"
        );
    }
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
        server,
        offerings: specs,
        locations,
        ssh,
        bootstrap_hook: args.bootstrap_hook,
        base_user_data,
        readiness_command,
        eur_usd: args.eur_usd,
        telemetry,
        timing: Timing::default(),
    })
}

//! The `hetzner` command line: every flag of the reference provider with its default and
//! environment variable, plus this provider's additions (see docs/hetzner/configuration.md).

use clap::{ArgAction, Parser};
use provider_core::cli::Command;
use provider_core::config::{BackendChoice, CommonArgs, Secret, choose_backend, go_bool};

/// BigFleet capacity provider for Hetzner Cloud servers.
#[derive(Parser, Debug, Clone)]
#[command(name = "hetzner", version, about, long_about = None, args_conflicts_with_subcommands = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,

    #[command(flatten)]
    pub common: CommonArgs,

    /// Provider label stamped into HostRef.provider and the slot-id prefix; also names this
    /// instance in server labels.
    #[arg(long, default_value = "hetzner", value_name = "NAME")]
    pub provider: String,

    /// Backend: hetzner, fake, or auto (hetzner when a token is set).
    #[arg(long = "hetzner-backend", default_value = "auto", value_name = "MODE")]
    pub hetzner_backend: String,

    /// Hetzner Cloud API token (Read & Write).
    #[arg(
        long,
        env = "HCLOUD_TOKEN",
        hide_env_values = true,
        default_value = "",
        hide_default_value = true,
        value_name = "TOKEN"
    )]
    pub token: Secret,

    /// Hetzner Cloud API base URL (plain http only for loopback addresses).
    #[arg(
        long = "hcloud-endpoint",
        env = "HCLOUD_ENDPOINT",
        hide_env_values = true,
        default_value = "https://api.hetzner.cloud/v1",
        value_name = "URL"
    )]
    pub hcloud_endpoint: String,

    /// First location of the default offering mix.
    #[arg(long = "location-a", default_value = "nbg1", value_name = "LOCATION")]
    pub location_a: String,

    /// Second location of the default offering mix.
    #[arg(long = "location-b", default_value = "fsn1", value_name = "LOCATION")]
    pub location_b: String,

    /// EUR to USD rate for prices (values <= 0 mean 1.08).
    #[arg(
        long = "eur-usd",
        default_value_t = 1.08,
        allow_negative_numbers = true,
        value_name = "RATE"
    )]
    pub eur_usd: f64,

    /// SSH private key (unencrypted OpenSSH or PEM) for Configure and Drain.
    #[arg(long = "ssh-key", default_value = "", value_name = "PATH")]
    pub ssh_key: String,

    /// SSH login user.
    #[arg(long = "ssh-user", default_value = "root", value_name = "USER")]
    pub ssh_user: String,

    /// SSH port on the server (at the address --ssh-address picks).
    #[arg(long = "ssh-port", default_value_t = 22, value_name = "PORT")]
    pub ssh_port: u16,

    /// Label selector (k=v,k2=v2) picking the image: the newest snapshot or image matching it
    /// built for the server type's architecture. Replaces --image.
    #[arg(long = "image-selector", default_value = "", value_name = "SELECTOR")]
    pub image_selector: String,

    /// Hetzner private network (name or id) new servers join, optionally in one of its subnets
    /// (NETWORK=10.0.1.0/24). Repeatable or comma-separated; empty for none.
    #[arg(
        long = "network",
        env = "HCLOUD_NETWORK",
        hide_env_values = true,
        value_delimiter = ',',
        value_name = "NETWORK[=SUBNET]"
    )]
    pub network: Vec<String>,

    /// Hetzner firewall (name or id) applied to new servers at create. Repeatable or
    /// comma-separated.
    #[arg(
        long = "firewall",
        env = "HCLOUD_FIREWALL",
        hide_env_values = true,
        value_delimiter = ',',
        value_name = "FIREWALL"
    )]
    pub firewall: Vec<String>,

    /// Give new servers a public IPv4 (Hetzner bills it).
    #[arg(long = "public-ipv4", env = "HCLOUD_PUBLIC_IPV4", hide_env_values = true, default_value = "true", value_parser = go_bool, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = ArgAction::Set, value_name = "BOOL")]
    pub public_ipv4: bool,

    /// Give new servers a public IPv6 network.
    #[arg(long = "public-ipv6", env = "HCLOUD_PUBLIC_IPV6", hide_env_values = true, default_value = "true", value_parser = go_bool, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = ArgAction::Set, value_name = "BOOL")]
    pub public_ipv6: bool,

    /// Server address SSH connects to: public (its public IPv4), private (its address on the
    /// first --network) or ipv6 (its public IPv6 address).
    #[arg(
        long = "ssh-address",
        default_value = "public",
        value_name = "public|private|ipv6"
    )]
    pub ssh_address: String,

    /// Placement of new servers: none, or spread (provider-owned spread placement groups per
    /// offering, a new group when one is full, empty ones deleted).
    #[arg(long = "placement", default_value = "none", value_name = "none|spread")]
    pub placement: String,

    /// Operator label (key=value) on every new server; repeatable. Keys starting with
    /// bigfleet- are reserved.
    #[arg(long = "server-label", value_name = "KEY=VALUE")]
    pub server_label: Vec<String>,

    /// Hetzner SSH key (name or id) added to new servers for operator logins (not the
    /// provider's own --ssh-key). Repeatable or comma-separated.
    #[arg(
        long = "login-ssh-key",
        env = "HCLOUD_SSH_KEY",
        hide_env_values = true,
        value_delimiter = ',',
        value_name = "KEY"
    )]
    pub login_ssh_key: Vec<String>,

    /// On-host executable that consumes the bootstrap blob (<hook>.blob) as `<hook> <cluster-id>`.
    #[arg(
        long = "bootstrap-hook",
        default_value = "/opt/bigfleet/bootstrap",
        value_name = "PATH"
    )]
    pub bootstrap_hook: String,

    /// Command run over SSH after the hook until it exits 0: the node-readiness gate.
    #[arg(long = "readiness-command", default_value = "", value_name = "CMD")]
    pub readiness_command: String,
}

impl Cli {
    /// The EUR to USD rate in force (the reference turns values <= 0 into 1.08).
    pub fn eur_usd(&self) -> f64 {
        if self.eur_usd > 0.0 && self.eur_usd.is_finite() {
            self.eur_usd
        } else {
            1.08
        }
    }
}

/// Backend selection: `auto` picks Hetzner Cloud when a token is set.
pub fn resolve_mode(cli: &Cli) -> Result<BackendChoice, String> {
    let missing = cli.token.is_empty().then_some("");
    choose_backend(
        "hetzner",
        "--hetzner-backend",
        "hetzner",
        &cli.hetzner_backend,
        missing,
        cli.common.use_fake_backend,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Cli {
        let mut full = vec!["hetzner"];
        full.extend_from_slice(args);
        Cli::try_parse_from(full).unwrap()
    }

    #[test]
    fn defaults_match_the_reference() {
        let cli = parse(&[]);
        assert_eq!(cli.common.addr, ":9000");
        assert_eq!(cli.common.metrics_addr, ":9090");
        assert_eq!(cli.provider, "hetzner");
        assert_eq!(cli.common.seed_count, 32);
        assert_eq!(cli.location_a, "nbg1");
        assert_eq!(cli.location_b, "fsn1");
        assert_eq!(cli.ssh_user, "root");
        assert_eq!(cli.bootstrap_hook, "/opt/bigfleet/bootstrap");
        assert_eq!(cli.common.price_refresh.as_secs(), 1800);
        assert_eq!(cli.common.reconcile_interval.as_secs(), 120);
        assert_eq!(cli.common.configure_timeout.as_secs(), 480);
        assert!(cli.common.reflection);
        assert!(!cli.common.use_fake_backend);
        assert_eq!(cli.eur_usd(), 1.08);
        assert!(cli.public_ipv4 && cli.public_ipv6);
        assert_eq!(cli.ssh_address, "public");
        assert_eq!(cli.placement, "none");
        assert!(cli.network.is_empty() && cli.firewall.is_empty());
    }

    #[test]
    fn production_flags() {
        let cli = parse(&[
            "--network=mgmt=10.0.1.0/24,storage",
            "--network",
            "9003",
            "--firewall=fw-a,fw-b",
            "--public-ipv4=false",
            "--public-ipv6",
            "--server-label=team=core",
            "--server-label",
            "env=prod",
            "--login-ssh-key=ops-alice",
            "--placement=spread",
            "--image-selector=role=node",
        ]);
        assert_eq!(cli.network, vec!["mgmt=10.0.1.0/24", "storage", "9003"]);
        assert_eq!(cli.firewall, vec!["fw-a", "fw-b"]);
        assert!(!cli.public_ipv4 && cli.public_ipv6);
        assert_eq!(cli.server_label, vec!["team=core", "env=prod"]);
        assert_eq!(cli.login_ssh_key, vec!["ops-alice"]);
        assert_eq!(cli.placement, "spread");
        assert_eq!(cli.image_selector, "role=node");
    }

    #[test]
    fn go_style_flags() {
        let cli = parse(&[
            "--reflection=false",
            "--use-fake-backend",
            "--seed-count",
            "8",
            "--price-refresh=1h30m",
            "--eur-usd=-1",
        ]);
        assert!(!cli.common.reflection);
        assert!(cli.common.use_fake_backend);
        assert_eq!(cli.common.seed_count, 8);
        assert_eq!(cli.common.price_refresh.as_secs(), 5400);
        assert_eq!(cli.eur_usd(), 1.08);
        assert!(Cli::try_parse_from(["hetzner", "--price-refresh=5"]).is_err());
    }

    #[test]
    fn backend_selection() {
        let no_token = parse(&["--token="]);
        let err = resolve_mode(&no_token).unwrap_err();
        assert!(
            err.starts_with("refusing to start the hetzner provider on the in-memory fake backend")
        );
        assert_eq!(
            resolve_mode(&parse(&["--token=", "--use-fake-backend"])),
            Ok(BackendChoice::Fake)
        );
        assert_eq!(
            resolve_mode(&parse(&["--token=", "--hetzner-backend=FAKE"])),
            Ok(BackendChoice::Fake)
        );
        assert_eq!(
            resolve_mode(&parse(&["--token=t"])),
            Ok(BackendChoice::Real)
        );
        assert_eq!(
            resolve_mode(&parse(&["--token=t", "--use-fake-backend=true"])),
            Ok(BackendChoice::Fake)
        );
        assert_eq!(
            resolve_mode(&parse(&["--hetzner-backend=aws"])).unwrap_err(),
            "--hetzner-backend must be hetzner, fake, or auto (got \"aws\")"
        );
    }

    #[test]
    fn token_is_never_printed() {
        let cli = parse(&["--token=super-secret-token"]);
        assert!(!format!("{cli:?}").contains("super-secret-token"));
    }
}

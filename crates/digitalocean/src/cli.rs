//! The `digitalocean` command line: every flag of the reference provider with its default and
//! environment variable, plus this provider's additions (see docs/digitalocean/configuration.md).

use clap::{ArgAction, Parser};
use provider_core::cli::Command;
use provider_core::config::{BackendChoice, CommonArgs, Secret, choose_backend, go_bool};

/// BigFleet capacity provider for DigitalOcean Droplets.
#[derive(Parser, Debug, Clone)]
#[command(name = "digitalocean", version, about, long_about = None, args_conflicts_with_subcommands = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,

    #[command(flatten)]
    pub common: CommonArgs,

    /// Provider label stamped into HostRef.provider and the slot-id prefix; also names this
    /// instance in Droplet tags.
    #[arg(long, default_value = "digitalocean", value_name = "NAME")]
    pub provider: String,

    /// Backend: digitalocean, fake, or auto (digitalocean when a token and --region are set).
    #[arg(long = "do-backend", default_value = "auto", value_name = "MODE")]
    pub do_backend: String,

    /// DigitalOcean Personal Access Token.
    #[arg(
        long,
        env = "DIGITALOCEAN_TOKEN",
        hide_env_values = true,
        default_value = "",
        hide_default_value = true,
        value_name = "TOKEN"
    )]
    pub token: Secret,

    /// DigitalOcean API base URL (plain http only for loopback addresses).
    #[arg(
        long = "do-api-url",
        env = "DIGITALOCEAN_API_URL",
        hide_env_values = true,
        default_value = "https://api.digitalocean.com",
        value_name = "URL"
    )]
    pub do_api_url: String,

    /// The region this process serves (required for the real backend).
    #[arg(long, default_value = "", value_name = "REGION")]
    pub region: String,

    /// First region of the default offering mix.
    #[arg(long = "region-a", default_value = "nyc3", value_name = "REGION")]
    pub region_a: String,

    /// Second region of the default offering mix.
    #[arg(long = "region-b", default_value = "sfo3", value_name = "REGION")]
    pub region_b: String,

    /// HTTPS listen address of the on-host agent channel (required for the real backend).
    #[arg(long = "bootstrap-addr", default_value = "", value_name = "ADDR")]
    pub bootstrap_addr: String,

    /// Externally reachable URL of the channel, written into every Droplet's user_data.
    #[arg(long = "bootstrap-endpoint", default_value = "", value_name = "URL")]
    pub bootstrap_endpoint: String,

    /// Channel server certificate PEM.
    #[arg(long = "bootstrap-tls-cert", default_value = "", value_name = "PATH")]
    pub bootstrap_tls_cert: String,

    /// Channel server private key PEM.
    #[arg(long = "bootstrap-tls-key", default_value = "", value_name = "PATH")]
    pub bootstrap_tls_key: String,

    /// CA PEM the agents trust (every certificate in it). Without it, agents pin exactly the
    /// first certificate of --bootstrap-tls-cert (self-signed or CA-issued).
    #[arg(long = "bootstrap-ca", default_value = "", value_name = "PATH")]
    pub bootstrap_ca: String,

    /// Most open connections to the agent channel; further ones are closed at once.
    #[arg(long = "bootstrap-max-connections", default_value_t = 8192, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub bootstrap_max_connections: u32,

    /// Most open connections to the agent channel from one source address (agents behind one
    /// NAT share it: one connection per agent).
    #[arg(long = "bootstrap-max-connections-per-address", default_value_t = 1024, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub bootstrap_max_connections_per_address: u32,

    /// Where an agent may enroll from: `droplet`, only an address the cloud assigned to its
    /// Droplet (public IPv4/IPv6, VPC); `any`, when the channel is reached through a NAT or a
    /// proxy (logged at startup).
    #[arg(
        long = "bootstrap-enrollment-source",
        env = "BIGFLEET_BOOTSTRAP_ENROLLMENT_SOURCE",
        value_enum,
        default_value_t = digitalocean::enrollment::EnrollmentSource::Droplet,
        value_name = "SOURCE"
    )]
    pub bootstrap_enrollment_source: digitalocean::enrollment::EnrollmentSource,

    /// HMAC key minting per-machine agent tokens (stable across restarts).
    #[arg(
        long = "bootstrap-secret",
        env = "BIGFLEET_BOOTSTRAP_SECRET",
        hide_env_values = true,
        default_value = "",
        hide_default_value = true,
        value_name = "SECRET"
    )]
    pub bootstrap_secret: Secret,

    /// VPC (UUID) new Droplets join, unless their offering sets vpc_uuid; without it, the
    /// region's default VPC. Checked to exist in --region at startup.
    #[arg(
        long = "vpc-uuid",
        env = "DIGITALOCEAN_VPC_UUID",
        default_value = "",
        value_name = "UUID"
    )]
    pub vpc_uuid: String,

    /// Extra tag on every new Droplet (repeatable or comma-separated; an offering's tags add to
    /// these). Cloud firewalls select Droplets by tag. The provider's own tags are reserved.
    #[arg(
        long = "tag",
        env = "DIGITALOCEAN_TAGS",
        value_delimiter = ',',
        value_name = "TAG"
    )]
    pub tags: Vec<String>,

    /// Give new Droplets a public IPv6 address, unless their offering sets ipv6.
    #[arg(long, default_value = "false", value_parser = go_bool, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = ArgAction::Set)]
    pub ipv6: bool,

    /// Install the DigitalOcean monitoring agent on new Droplets, unless their offering sets
    /// monitoring.
    #[arg(long, default_value = "false", value_parser = go_bool, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = ArgAction::Set)]
    pub monitoring: bool,

    /// Login SSH key of the account added to new Droplets for operators: id, fingerprint or
    /// name (repeatable or comma-separated); an offering's ssh_keys replace these.
    #[arg(
        long = "login-ssh-key",
        env = "DIGITALOCEAN_SSH_KEYS",
        value_delimiter = ',',
        value_name = "KEY"
    )]
    pub login_ssh_keys: Vec<String>,
}

impl Cli {
    /// The global Droplet settings, defaults of every offering.
    pub fn droplet_defaults(&self) -> digitalocean::profile::Defaults {
        digitalocean::profile::Defaults {
            image: self.common.image.clone(),
            vpc_uuid: self.vpc_uuid.trim().to_owned(),
            tags: self.tags.iter().map(|t| t.trim().to_owned()).collect(),
            ipv6: self.ipv6,
            monitoring: self.monitoring,
            ssh_keys: self
                .login_ssh_keys
                .iter()
                .map(|k| k.trim().to_owned())
                .filter(|k| !k.is_empty())
                .collect(),
        }
    }
}

/// Backend selection: `auto` picks DigitalOcean only when a token and `--region` are set.
pub fn resolve_mode(cli: &Cli) -> Result<BackendChoice, String> {
    let missing = match (cli.token.is_empty(), cli.region.is_empty()) {
        (false, false) => None,
        (true, true) => Some("no token (--token or DIGITALOCEAN_TOKEN) and no --region"),
        (true, false) => Some("no token (--token or DIGITALOCEAN_TOKEN)"),
        (false, true) => Some("no --region"),
    };
    choose_backend(
        "digitalocean",
        "--do-backend",
        "digitalocean",
        &cli.do_backend,
        missing,
        cli.common.use_fake_backend,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Cli {
        let mut full = vec!["digitalocean"];
        full.extend_from_slice(args);
        Cli::try_parse_from(full).unwrap()
    }

    #[test]
    fn defaults_match_the_reference() {
        let cli = parse(&[]);
        assert_eq!(cli.common.addr, ":9000");
        assert_eq!(cli.provider, "digitalocean");
        assert_eq!(cli.region_a, "nyc3");
        assert_eq!(cli.region_b, "sfo3");
        assert_eq!(cli.common.seed_count, 32);
        assert_eq!(cli.common.drain_timeout.as_secs(), 900);
        assert!(cli.bootstrap_ca.is_empty());
        assert!(cli.vpc_uuid.is_empty() && cli.tags.is_empty() && cli.login_ssh_keys.is_empty());
        assert!(!cli.ipv6 && !cli.monitoring);
    }

    #[test]
    fn droplet_flags() {
        let cli = parse(&[
            "--image=node-snap",
            "--vpc-uuid=5a4981aa-9653-4bd1-bef5-d6bff52042e4",
            "--tag=k8s,pool",
            "--tag",
            "edge",
            "--ipv6",
            "--monitoring=false",
            "--login-ssh-key=512189",
            "--login-ssh-key=ops laptop",
        ]);
        let d = cli.droplet_defaults();
        assert_eq!(d.image, "node-snap");
        assert_eq!(d.vpc_uuid, "5a4981aa-9653-4bd1-bef5-d6bff52042e4");
        assert_eq!(d.tags, ["k8s", "pool", "edge"]);
        assert!(d.ipv6 && !d.monitoring);
        assert_eq!(d.ssh_keys, ["512189", "ops laptop"]);
    }

    #[test]
    fn backend_selection() {
        let err = resolve_mode(&parse(&["--token=", "--region=nyc3"])).unwrap_err();
        assert!(err.starts_with("refusing to start the digitalocean provider on the in-memory fake backend: no credentials were detected (no token"), "{err}");
        let err = resolve_mode(&parse(&["--token=t"])).unwrap_err();
        assert!(err.contains("(no --region)"), "{err}");
        assert_eq!(
            resolve_mode(&parse(&["--token=t", "--region=nyc3"])),
            Ok(BackendChoice::Real)
        );
        assert_eq!(
            resolve_mode(&parse(&["--token=", "--do-backend=fake"])),
            Ok(BackendChoice::Fake)
        );
        assert_eq!(
            resolve_mode(&parse(&[
                "--token=t",
                "--region=nyc3",
                "--use-fake-backend"
            ])),
            Ok(BackendChoice::Fake)
        );
        assert_eq!(
            resolve_mode(&parse(&["--do-backend=gcp"])).unwrap_err(),
            "--do-backend must be digitalocean, fake, or auto (got \"gcp\")"
        );
    }

    #[test]
    fn secrets_are_never_printed() {
        let cli = parse(&["--token=tok-123456", "--bootstrap-secret=hmac-abcdef"]);
        let shown = format!("{cli:?}");
        assert!(!shown.contains("tok-123456") && !shown.contains("hmac-abcdef"));
    }
}

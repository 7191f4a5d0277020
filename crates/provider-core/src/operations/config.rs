//! Flags both binaries share, parsed by clap with the reference's names, defaults and Go-style
//! durations and booleans, plus logging setup. Secrets are wrapped in [`Secret`].

use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgAction, Args, ValueEnum};

use crate::observability::duration;
use crate::runtime::engine::Timeouts;
use crate::security::tls::TlsFlags;

/// A secret string (API token, HMAC key). Debug and Display print `[redacted]`; the buffer is
/// zeroed when the value is dropped.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret(String);

impl zeroize::Zeroize for Secret {
    fn zeroize(&mut self) {
        self.0.zeroize();
    }
}

impl Drop for Secret {
    fn drop(&mut self) {
        zeroize::Zeroize::zeroize(self);
    }
}

impl zeroize::ZeroizeOnDrop for Secret {}

impl Secret {
    pub fn new(value: impl Into<String>) -> Secret {
        Secret(value.into())
    }

    /// The secret itself, for the one place that must send it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("[redacted]")
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("[redacted]")
    }
}

impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Secret, Self::Err> {
        Ok(Secret(s.to_owned()))
    }
}

/// Log output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

pub use crate::operations::flag_syntax::go_bool;

/// The flags shared by every provider binary.
#[derive(Args, Debug, Clone)]
pub struct CommonArgs {
    /// gRPC listen address.
    #[arg(long, default_value = ":9000", value_name = "ADDR")]
    pub addr: String,

    /// HTTP address for /metrics, /healthz and /readyz; empty disables it.
    #[arg(long = "metrics-addr", default_value = ":9090", value_name = "ADDR")]
    pub metrics_addr: String,

    /// Force the in-memory fake backend (testing and conformance only; it never creates real
    /// resources).
    #[arg(long = "use-fake-backend", default_value = "false", value_parser = go_bool, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = ArgAction::Set)]
    pub use_fake_backend: bool,

    /// Register the gRPC reflection service.
    #[arg(long, default_value = "true", value_parser = go_bool, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = ArgAction::Set)]
    pub reflection: bool,

    /// Path to the offerings JSON; empty uses the built-in default mix.
    #[arg(long, default_value = "", value_name = "PATH")]
    pub offerings: String,

    /// Slots in the default offering mix (values <= 0 mean 16).
    #[arg(
        long = "seed-count",
        default_value_t = 32,
        allow_negative_numbers = true,
        value_name = "N"
    )]
    pub seed_count: i64,

    /// Durable state directory/file; empty keeps state in memory only.
    #[arg(long, default_value = "", value_name = "PATH")]
    pub state: String,

    /// File of base64 32-byte keys, one per line, the current key first (older keys still open
    /// what they sealed): with it, the bootstrap blob of a Configure in flight is kept sealed in
    /// the state, so a restart or a takeover resumes the Configure instead of failing it.
    #[arg(
        long = "state-encryption-key-file",
        env = "BIGFLEET_STATE_ENCRYPTION_KEY_FILE",
        default_value = "",
        value_name = "PATH"
    )]
    pub state_encryption_key_file: String,

    /// Start even when the state holds sealed blobs that no key of
    /// --state-encryption-key-file opens, failing exactly those Configures.
    #[arg(long = "fail-unreadable-configures", default_value = "false", value_parser = go_bool, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = ArgAction::Set)]
    pub fail_unreadable_configures: bool,

    /// Base image name or id for new hosts (required for the real backend).
    #[arg(long, default_value = "", value_name = "IMAGE")]
    pub image: String,

    /// Operator cloud-init merged into every host's user-data.
    #[arg(long = "base-user-data", default_value = "", value_name = "PATH")]
    pub base_user_data: String,

    /// Price refresh period; 0 disables the timer.
    #[arg(long = "price-refresh", default_value = "30m", value_parser = duration::flag, value_name = "DURATION")]
    pub price_refresh: Duration,

    /// How long an offering stays withdrawn after the cloud refused a Create of it for a
    /// stockout (HTTP 412 `resource_unavailable`, a size not available in the region) before
    /// one Create probes it; doubled on each stockout in a row, up to --stockout-backoff-max,
    /// less up to 20% jitter. Also the first wait before probing a learned account limit.
    #[arg(long = "stockout-backoff", default_value = "5m", value_parser = duration::flag, value_name = "DURATION")]
    pub stockout_backoff: Duration,

    /// The longest --stockout-backoff grows to: a sold-out offering costs at most about one
    /// probe Create per this period.
    #[arg(long = "stockout-backoff-max", default_value = "30m", value_parser = duration::flag, value_name = "DURATION")]
    pub stockout_backoff_max: Duration,

    /// Reconcile period floor: a survey runs less often when its cost at the fleet's size
    /// would spend more than --api-reconcile-share allows, and a cheap check for hosts deleted
    /// out of band then runs every floor in between; 0 disables it.
    #[arg(long = "reconcile-interval", default_value = "2m", value_parser = duration::flag, value_name = "DURATION")]
    pub reconcile_interval: Duration,

    /// How long reconcile leaves an owned host that is attached to no machine record, or held
    /// by a FAILED machine without a cluster binding (a failed Create or Delete) that no release
    /// came for, before it deletes it; 0 never deletes them.
    #[arg(long = "orphan-grace", default_value = "10m", value_parser = duration::flag, value_name = "DURATION")]
    pub orphan_grace: Duration,

    /// The part of the cloud token's API budget (its rate limit) this provider may spend; the
    /// rest is left to the operator's tools and other providers on the same token.
    #[arg(
        long = "api-budget-share",
        env = "BIGFLEET_API_BUDGET_SHARE",
        default_value_t = crate::provisioning::budget::DEFAULT_SHARE,
        value_name = "FRACTION"
    )]
    pub api_budget_share: f64,

    /// The part of --api-budget-share that background work (reconcile listings, proofs of
    /// absence, price refreshes) may spend; transitions always come first.
    #[arg(
        long = "api-reconcile-share",
        env = "BIGFLEET_API_RECONCILE_SHARE",
        default_value_t = crate::provisioning::budget::DEFAULT_RECONCILE_SHARE,
        value_name = "FRACTION"
    )]
    pub api_reconcile_share: f64,

    /// Deadline of a Create transition.
    #[arg(long = "create-timeout", default_value = "5m", value_parser = duration::flag, value_name = "DURATION")]
    pub create_timeout: Duration,

    /// Deadline of a Configure transition (including the readiness gate).
    #[arg(long = "configure-timeout", default_value = "8m", value_parser = duration::flag, value_name = "DURATION")]
    pub configure_timeout: Duration,

    /// Deadline of a Drain transition.
    #[arg(long = "drain-timeout", default_value = "15m", value_parser = duration::flag, value_name = "DURATION")]
    pub drain_timeout: Duration,

    /// Deadline of a Delete transition.
    #[arg(long = "delete-timeout", default_value = "5m", value_parser = duration::flag, value_name = "DURATION")]
    pub delete_timeout: Duration,

    /// How long SIGTERM waits for in-flight transitions before exiting.
    #[arg(long = "shutdown-grace", default_value = "25s", value_parser = duration::flag, value_name = "DURATION")]
    pub shutdown_grace: Duration,

    /// Unix socket for the admin interface (`admin failed list|release`); empty disables it.
    #[arg(long = "admin-socket", default_value = "", value_name = "PATH")]
    pub admin_socket: String,

    /// Server certificate PEM for gRPC TLS.
    #[arg(long = "tls-cert", default_value = "", value_name = "PATH")]
    pub tls_cert: String,

    /// Server private key PEM for gRPC TLS.
    #[arg(long = "tls-key", default_value = "", value_name = "PATH")]
    pub tls_key: String,

    /// Client CA bundle PEM; enables mTLS (client certificates required and verified).
    #[arg(long = "tls-ca", default_value = "", value_name = "PATH")]
    pub tls_ca: String,

    /// Under mTLS, admit a Create, Configure, Drain or Delete only from a client certificate
    /// whose one bigfleet:// URI SAN is bigfleet://shard/<its shard_id>: enforce refuses the
    /// others (PERMISSION_DENIED), warn admits, logs and counts them, off checks nothing. Get and
    /// List are open to every verified certificate. Default: enforce with --tls-ca; any value
    /// without --tls-ca is an error.
    #[arg(
        long = "shard-identity",
        env = "BIGFLEET_SHARD_IDENTITY",
        value_enum,
        value_name = "MODE"
    )]
    pub shard_identity: Option<crate::security::identity::ShardIdentity>,

    /// Log format.
    #[arg(long = "log-format", value_enum, default_value = "text")]
    pub log_format: LogFormat,

    /// Log level or filter (RUST_LOG syntax); RUST_LOG wins when set.
    #[arg(long = "log-level", default_value = "info", value_name = "FILTER")]
    pub log_level: String,

    /// Open gRPC connections at most (TLS handshakes in progress included); more are closed at
    /// once.
    #[arg(
        long = "grpc-max-connections",
        default_value_t = 1024,
        value_name = "N"
    )]
    pub grpc_max_connections: usize,

    /// Concurrent RPCs (HTTP/2 streams) per gRPC connection at most.
    #[arg(
        long = "grpc-max-concurrent-streams",
        default_value_t = 256,
        value_name = "N"
    )]
    pub grpc_max_concurrent_streams: u32,

    /// How long one gRPC request may take, reading it included; then CANCELLED.
    #[arg(long = "grpc-request-timeout", default_value = "60s", value_parser = duration::flag, value_name = "DURATION")]
    pub grpc_request_timeout: Duration,

    /// Age after which a gRPC connection is asked to reconnect (GOAWAY), then closed once its
    /// RPCs had their request timeout to finish; 0 disables.
    #[arg(long = "grpc-max-connection-age", default_value = "1h", value_parser = duration::flag, value_name = "DURATION")]
    pub grpc_max_connection_age: Duration,

    /// The etcd store's flags (`--state etcd://…`).
    #[command(flatten)]
    pub etcd: crate::runtime::etcd::EtcdArgs,

    /// The pod label that routes a Service to the leader (`--leader-label`).
    #[command(flatten)]
    pub leader_label: crate::operations::leader_label::LeaderLabelArgs,

    /// How long each fake-backend transition takes.
    #[arg(long = "fake-latency", default_value = "100ms", value_parser = duration::flag, value_name = "DURATION")]
    pub fake_latency: Duration,
}

fn optional_path(s: &str) -> Option<PathBuf> {
    (!s.is_empty()).then(|| PathBuf::from(s))
}

impl CommonArgs {
    pub fn timeouts(&self) -> Timeouts {
        Timeouts {
            create: self.create_timeout,
            configure: self.configure_timeout,
            drain: self.drain_timeout,
            delete: self.delete_timeout,
        }
    }

    pub fn tls_flags(&self) -> TlsFlags {
        TlsFlags {
            cert: optional_path(&self.tls_cert),
            key: optional_path(&self.tls_key),
            ca: optional_path(&self.tls_ca),
        }
    }

    /// What `--shard-identity` means on a port secured as `security` (a startup error when it
    /// is given without mTLS).
    pub fn shard_identity(
        &self,
        security: crate::security::tls::SecurityMode,
    ) -> Result<crate::security::identity::ShardIdentity, String> {
        crate::security::identity::ShardIdentity::resolve(self.shard_identity, security)
    }

    /// The state encryption keys, read and checked before anything binds.
    pub fn state_keys(
        &self,
    ) -> Result<Option<std::sync::Arc<crate::security::seal::StateKeys>>, String> {
        if self.state_encryption_key_file.is_empty() {
            return Ok(None);
        }
        if self.state.is_empty() {
            return Err(
                "--state-encryption-key-file needs --state: without a durable state there is \
                 nothing to seal"
                    .into(),
            );
        }
        crate::security::seal::StateKeys::load(std::path::Path::new(
            &self.state_encryption_key_file,
        ))
        .map(|keys| Some(std::sync::Arc::new(keys)))
    }

    /// Checks what clap cannot: positive transition deadlines.
    pub fn validate(&self) -> Result<(), String> {
        for (flag, d) in [
            ("--create-timeout", self.create_timeout),
            ("--configure-timeout", self.configure_timeout),
            ("--drain-timeout", self.drain_timeout),
            ("--delete-timeout", self.delete_timeout),
        ] {
            if d.is_zero() {
                return Err(format!("{flag} must be a positive duration"));
            }
        }
        if self.grpc_request_timeout.is_zero() {
            return Err("--grpc-request-timeout must be a positive duration".into());
        }
        if self.grpc_max_connections == 0 {
            return Err("--grpc-max-connections must be at least 1".into());
        }
        if self.grpc_max_concurrent_streams == 0 {
            return Err("--grpc-max-concurrent-streams must be at least 1".into());
        }
        self.api_budget_shares().validate()?;
        self.stockout_backoff().validate()?;
        crate::runtime::etcd::validate_with_state(&self.state, &self.etcd)
    }

    /// `--stockout-backoff` and `--stockout-backoff-max`.
    pub fn stockout_backoff(&self) -> crate::provisioning::stockout::StockoutBackoff {
        crate::provisioning::stockout::StockoutBackoff {
            first: self.stockout_backoff,
            max: self.stockout_backoff_max,
        }
    }

    /// `--api-budget-share` and `--api-reconcile-share`.
    pub fn api_budget_shares(&self) -> crate::provisioning::budget::Shares {
        crate::provisioning::budget::Shares {
            share: self.api_budget_share,
            reconcile: self.api_reconcile_share,
        }
    }

    /// The gRPC listener limits from the `--grpc-*` flags.
    pub fn grpc_limits(&self) -> crate::wire::serve::GrpcLimits {
        crate::wire::serve::GrpcLimits {
            max_connections: self.grpc_max_connections,
            max_concurrent_streams: self.grpc_max_concurrent_streams,
            request_timeout: self.grpc_request_timeout,
            max_connection_age: self.grpc_max_connection_age,
            ..crate::wire::serve::GrpcLimits::default()
        }
    }

    /// Reads `--base-user-data` (`read --base-user-data: ...`).
    pub fn read_base_user_data(&self) -> Result<Option<String>, String> {
        if self.base_user_data.is_empty() {
            return Ok(None);
        }
        std::fs::read_to_string(&self.base_user_data)
            .map(Some)
            .map_err(|e| format!("read --base-user-data: {}: {e}", self.base_user_data))
    }
}

/// Resolves a listen address: Go's `:9000` means every interface.
pub fn listen_addr(addr: &str) -> String {
    if addr.starts_with(':') {
        format!("0.0.0.0{addr}")
    } else {
        addr.to_owned()
    }
}

/// Installs the global tracing subscriber (stderr, text or JSON).
/// Whether log lines on stderr may carry ANSI colour: only when stderr is a terminal and
/// `NO_COLOR` is unset or empty (<https://no-color.org>). A pod's log, journald and a pipe get
/// plain text.
pub fn stderr_wants_colour() -> bool {
    use std::io::IsTerminal;
    colour_wanted(
        std::io::stderr().is_terminal(),
        std::env::var_os("NO_COLOR").as_deref(),
    )
}

/// [`stderr_wants_colour`] for a given terminal check and `NO_COLOR` value.
pub fn colour_wanted(terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

pub fn init_logging(format: LogFormat, level: &str) {
    use tracing_subscriber::EnvFilter;
    let filter = std::env::var("RUST_LOG")
        .ok()
        .filter(|v| !v.is_empty())
        .and_then(|v| EnvFilter::try_new(v).ok())
        .or_else(|| EnvFilter::try_new(level).ok())
        .unwrap_or_else(|| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(stderr_wants_colour())
        .with_target(false);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

/// Which backend a provider runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendChoice {
    Real,
    Fake,
}

/// Backend selection shared by the providers (the reference's rules and messages):
/// `auto` (or empty) picks the real backend when credentials are present; `--use-fake-backend`
/// forces the fake; an `auto` without credentials refuses to start; an explicit `fake` is
/// accepted. `missing` says which credentials are absent (`None` when all are present).
pub fn choose_backend(
    binary: &str,
    flag: &str,
    real: &str,
    requested: &str,
    missing: Option<&str>,
    use_fake_backend: bool,
) -> Result<BackendChoice, String> {
    let lowered = requested.to_ascii_lowercase();
    let resolved = match lowered.as_str() {
        "" | "auto" if missing.is_none() => BackendChoice::Real,
        "" | "auto" | "fake" => BackendChoice::Fake,
        r if r == real => BackendChoice::Real,
        _ => {
            return Err(format!(
                "{flag} must be {real}, fake, or auto (got {requested:?})"
            ));
        }
    };
    if use_fake_backend {
        return Ok(BackendChoice::Fake);
    }
    if resolved == BackendChoice::Fake && lowered != "fake" {
        let detail = match missing {
            Some(d) if !d.is_empty() => format!(" ({d})"),
            _ => String::new(),
        };
        return Err(format!(
            "refusing to start the {binary} provider on the in-memory fake backend: no credentials were detected{detail}. Configure the real backend, or pass --use-fake-backend to run the credential-free fake (testing/conformance only — it never creates real resources)"
        ));
    }
    Ok(resolved)
}

#[cfg(test)]
mod secret_tests {
    use zeroize::{Zeroize, ZeroizeOnDrop};

    use super::*;

    fn zeroed_on_drop<T: ZeroizeOnDrop>() {}

    #[test]
    fn a_secret_never_prints_and_is_zeroed() {
        zeroed_on_drop::<Secret>();
        let mut secret: Secret = "hcloud-token-123".parse().expect("infallible");
        assert_eq!(format!("{secret:?}"), "[redacted]");
        assert_eq!(format!("{secret}"), "[redacted]");
        assert_eq!(format!("{:?}", Some(secret.clone())), "Some([redacted])");
        assert_eq!(secret.expose(), "hcloud-token-123");
        secret.zeroize();
        assert!(secret.is_empty());
    }
}

#[cfg(test)]
mod colour_tests {
    use std::ffi::OsStr;

    use super::colour_wanted;

    #[test]
    fn colour_only_on_a_terminal_and_never_with_no_color() {
        assert!(colour_wanted(true, None));
        assert!(
            colour_wanted(true, Some(OsStr::new(""))),
            "an empty NO_COLOR counts as unset"
        );
        assert!(!colour_wanted(true, Some(OsStr::new("1"))));
        assert!(!colour_wanted(false, None), "a pipe, a pod log or journald");
        assert!(!colour_wanted(false, Some(OsStr::new("1"))));
    }
}

#[cfg(test)]
mod budget_flag_tests {
    use clap::Parser;

    use super::CommonArgs;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        common: CommonArgs,
    }

    #[test]
    fn the_budget_shares_default_parse_and_are_checked() {
        let common = Flags::try_parse_from(["p"]).expect("parse").common;
        assert_eq!(
            common.api_budget_shares(),
            crate::provisioning::budget::Shares::default()
        );
        assert!(common.validate().is_ok());
        let common =
            Flags::try_parse_from(["p", "--api-budget-share=0.8", "--api-reconcile-share=0.1"])
                .expect("parse")
                .common;
        assert_eq!(common.api_budget_shares().share, 0.8);
        assert_eq!(common.api_budget_shares().reconcile, 0.1);
        for (flag, value) in [
            ("--api-budget-share", "0"),
            ("--api-budget-share", "1.5"),
            ("--api-reconcile-share", "-0.2"),
        ] {
            let common = Flags::try_parse_from(["p", &format!("{flag}={value}")])
                .expect("parse")
                .common;
            let e = common.validate().unwrap_err();
            assert!(e.contains(flag), "{e}");
        }
    }
}

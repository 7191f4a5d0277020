//! `bigfleet-agent`: the DigitalOcean provider's on-host agent. See `docs/digitalocean/agent.md`.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use digitalocean::agent::{
    Agent, AgentConfig, AgentOptions, CommandTimeouts, DEFAULT_DRAIN_COMMAND,
};

#[derive(Debug, Parser)]
#[command(
    name = "bigfleet-agent",
    version,
    about = "BigFleet on-host agent for DigitalOcean Droplets"
)]
struct Args {
    /// The config written by the provider's user_data.
    #[arg(long, default_value = "/etc/bigfleet-agent/config.json")]
    config: PathBuf,
    /// Bootstrap hook, run as `<hook> <cluster-id>` after the blob is written to `<hook>.blob`.
    #[arg(long, default_value = "/opt/bigfleet/bootstrap")]
    hook: PathBuf,
    /// Shell command that cordons and drains this node; the grace in seconds is in
    /// `$BIGFLEET_GRACE_SECONDS` and `$1`.
    #[arg(long, default_value = DEFAULT_DRAIN_COMMAND)]
    drain_command: String,
    /// Shell command that exits 0 once the node is Ready (`$BIGFLEET_CLUSTER_ID` is set).
    /// Without it, the hook's success is taken as readiness.
    #[arg(long)]
    readiness_command: Option<String>,
    /// Where executed command ids and their outcomes are recorded: an id found there is
    /// answered from the record, never run again.
    #[arg(long, default_value = "/var/lib/bigfleet-agent/state.json")]
    state: PathBuf,
    /// Longest wait between retries while the provider is unreachable (e.g. `30s`, `500ms`).
    #[arg(long, default_value = "30s", value_parser = provider_core::duration::flag)]
    max_backoff: Duration,
    /// Longest run of the bootstrap hook; on expiry its process group is killed and the
    /// configure is reported as failed.
    #[arg(long, default_value = "8m", value_parser = positive_duration)]
    hook_timeout: Duration,
    /// Longest run of --readiness-command; on expiry its process group is killed and the
    /// readiness check is reported as failed.
    #[arg(long, default_value = "8m", value_parser = positive_duration)]
    readiness_timeout: Duration,
    /// Longest run of --drain-command; on expiry its process group is killed and the drain is
    /// reported as failed.
    #[arg(long, default_value = "15m", value_parser = positive_duration)]
    drain_timeout: Duration,
    /// `text` or `json`.
    #[arg(long, default_value = "text")]
    log_format: String,
}

/// A duration flag that must be greater than zero (a zero timeout would fail every command).
fn positive_duration(text: &str) -> Result<Duration, String> {
    let d = provider_core::duration::flag(text)?;
    if d.is_zero() {
        return Err("must be greater than 0".into());
    }
    Ok(d)
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(provider_core::config::stderr_wants_colour());
    if args.log_format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
    let config_path = args.config.clone();
    let agent = AgentConfig::load(&args.config).and_then(|config| {
        Agent::new(
            config,
            AgentOptions {
                hook: args.hook,
                drain_command: args.drain_command,
                readiness_command: args.readiness_command,
                state_path: args.state,
                max_backoff: args.max_backoff,
                timeouts: CommandTimeouts {
                    hook: args.hook_timeout,
                    readiness: args.readiness_timeout,
                    drain: args.drain_timeout,
                },
                config_path: Some(config_path),
            },
        )
    });
    let agent = match agent {
        Ok(agent) => agent,
        Err(e) => {
            eprintln!("bigfleet-agent: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    agent.run(shutdown()).await;
    tracing::info!("bigfleet-agent stopped");
    std::process::ExitCode::SUCCESS
}

async fn shutdown() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(term) => term,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

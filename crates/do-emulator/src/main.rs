//! `do-emulator`: serves the DigitalOcean API emulator on a loopback address, for end-to-end
//! runs (`cargo xtask e2e`). Fault knobs are under `/_emulator/`.

use std::net::SocketAddr;

use anyhow::{Context, bail};
use clap::Parser;
use do_emulator::Emulator;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Parser)]
#[command(
    name = "do-emulator",
    about = "Local DigitalOcean API emulator (loopback only)"
)]
struct Args {
    /// Loopback address to listen on; port 0 picks a free port.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// The API token the emulator accepts.
    #[arg(
        long,
        env = "DIGITALOCEAN_TOKEN",
        default_value = "emulator-token",
        hide_env_values = true
    )]
    token: String,
    /// Enforce DigitalOcean's rate limits (5,000 an hour, 250 a minute) with the real headers,
    /// time running this many times faster (1 is real time); off when not given.
    #[arg(long, value_name = "FACTOR")]
    rate_limit_time_scale: Option<f64>,
    /// Seconds a new Droplet takes to turn `active`, however often it is read (by default it
    /// turns `active` on its first read).
    #[arg(long, value_name = "SECONDS")]
    boot_seconds: Option<f64>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if !args.listen.ip().is_loopback() {
        bail!(
            "--listen {}: the emulator only listens on loopback addresses",
            args.listen
        );
    }
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("listen on {}", args.listen))?;
    let addr = listener.local_addr()?;
    println!("do-emulator listening on http://{addr}");
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        stop.cancel();
    });
    let emulator = Emulator::new(&args.token);
    if let Some(seconds) = args.boot_seconds {
        let boot = std::time::Duration::try_from_secs_f64(seconds).map_err(|_| {
            anyhow::anyhow!("--boot-seconds must be a non-negative number, got {seconds}")
        })?;
        emulator.set_boot_time(Some(boot));
    }
    if let Some(factor) = args.rate_limit_time_scale {
        if !(factor.is_finite() && factor > 0.0) {
            bail!("--rate-limit-time-scale must be a positive number, got {factor}");
        }
        emulator.set_rate_limit(do_emulator::RateLimit::DIGITALOCEAN.time_scaled(factor));
    }
    emulator.serve(listener, shutdown).await;
    Ok(())
}

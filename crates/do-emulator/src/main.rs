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
    Emulator::new(&args.token).serve(listener, shutdown).await;
    Ok(())
}

//! `hcloud-emulator`: serves the local Hetzner Cloud API emulator until interrupted, for
//! end-to-end runs of the `hetzner` binary (`--hcloud-endpoint http://ADDR/v1`).

use clap::Parser;

/// A local, stateful emulator of the Hetzner Cloud API.
#[derive(Debug, Parser)]
#[command(name = "hcloud-emulator", version)]
struct Args {
    /// Address to listen on (loopback only).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: std::net::SocketAddr,
    /// The bearer token the emulator accepts.
    #[arg(
        long,
        env = "HCLOUD_TOKEN",
        default_value = "emulator-token",
        hide_env_values = true
    )]
    token: String,
    /// Public IPv4 given to new servers (e.g. 127.0.0.1 to reach a local SSH server).
    #[arg(long)]
    server_ipv4: Option<String>,
    /// Reads before a new server reports `running`.
    #[arg(long, default_value_t = 1)]
    polls_to_running: u32,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if !args.listen.ip().is_loopback() {
        anyhow::bail!("--listen must be a loopback address, got {}", args.listen);
    }
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    let emulator = hcloud_emulator::Emulator::serve(listener, &args.token)?;
    emulator.set_polls_to_running(args.polls_to_running);
    if let Some(ip) = &args.server_ipv4 {
        emulator.set_new_server_ipv4(ip);
    }
    // The one line xtask reads to find the endpoint.
    println!("listening on {}", emulator.endpoint());
    tokio::signal::ctrl_c().await?;
    Ok(())
}

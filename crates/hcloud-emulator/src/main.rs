//! `hcloud-emulator`: serves the local Hetzner Cloud API emulator until interrupted, for
//! end-to-end runs of the `hetzner` binary (`--hcloud-endpoint http://ADDR/v1`).

use anyhow::Context;
use clap::Parser;
use hcloud_emulator::Sshd;

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
    /// The address new servers get on the private networks they join (e.g. 127.0.0.1).
    #[arg(long)]
    server_private_ip: Option<String>,
    /// The IPv6 network of new servers (`::/64` gives them the address ::1).
    #[arg(long)]
    server_ipv6_net: Option<String>,
    /// Servers a spread placement group holds at most.
    #[arg(long, default_value_t = hcloud_emulator::SPREAD_GROUP_LIMIT)]
    placement_group_limit: usize,
    /// Enforce Hetzner's rate limit (3,600 requests, one returned a second) with the real
    /// headers, time running this many times faster (1 is real time); off when not given.
    #[arg(long, value_name = "FACTOR")]
    rate_limit_time_scale: Option<f64>,
    /// Reads before a new server reports `running`.
    #[arg(long, default_value_t = 1)]
    polls_to_running: u32,
    /// Seconds a new server takes to report `running`, however often it is read (in place of
    /// --polls-to-running).
    #[arg(long, value_name = "SECONDS")]
    boot_seconds: Option<f64>,
    /// Also play the servers' sshd on this address (loopback only): a connection is for the
    /// newest live server at the address it arrived on, which presents the host key the
    /// provider injected via user-data and runs commands in `<ssh-root>/<server id>`.
    #[arg(long, value_name = "ADDR")]
    ssh_listen: Option<std::net::SocketAddr>,
    /// The client public key the sshd accepts (an OpenSSH `ssh-ed25519 AAAA...` line).
    #[arg(long, value_name = "PATH", requires = "ssh_listen")]
    ssh_authorized_key: Option<std::path::PathBuf>,
    /// The login user the sshd accepts.
    #[arg(long, default_value = "root", requires = "ssh_listen")]
    ssh_user: String,
    /// Where the servers' roots live (default: a temp dir removed at exit).
    #[arg(long, value_name = "DIR", requires = "ssh_listen")]
    ssh_root: Option<std::path::PathBuf>,
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
    if let Some(seconds) = args.boot_seconds {
        let boot = std::time::Duration::try_from_secs_f64(seconds).map_err(|_| {
            anyhow::anyhow!("--boot-seconds must be a non-negative number, got {seconds}")
        })?;
        emulator.set_boot_time(Some(boot));
    }
    if let Some(ip) = &args.server_ipv4 {
        emulator.set_new_server_ipv4(ip);
    }
    if let Some(ip) = &args.server_private_ip {
        emulator.set_new_server_private_ip(ip);
    }
    if let Some(net) = &args.server_ipv6_net {
        emulator.set_new_server_ipv6_net(net);
    }
    emulator.set_placement_group_limit(args.placement_group_limit);
    if let Some(factor) = args.rate_limit_time_scale {
        if !(factor.is_finite() && factor > 0.0) {
            anyhow::bail!("--rate-limit-time-scale must be a positive number, got {factor}");
        }
        emulator.set_rate_limit(hcloud_emulator::RateLimit::HETZNER.time_scaled(factor));
    }
    // The line xtask reads to find the endpoint.
    println!("listening on {}", emulator.endpoint());
    let _ssh = match args.ssh_listen {
        None => None,
        Some(addr) => Some(ssh(&args, addr, &emulator).await?),
    };
    tokio::signal::ctrl_c().await?;
    Ok(())
}

/// Starts the servers' sshd; prints `ssh listening on ADDR`.
async fn ssh(
    args: &Args,
    addr: std::net::SocketAddr,
    emulator: &hcloud_emulator::Emulator,
) -> anyhow::Result<(Sshd, Option<tempfile::TempDir>)> {
    if !addr.ip().is_loopback() {
        anyhow::bail!("--ssh-listen must be a loopback address, got {addr}");
    }
    let path = args
        .ssh_authorized_key
        .as_ref()
        .context("--ssh-listen needs --ssh-authorized-key")?;
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("read --ssh-authorized-key {}", path.display()))?;
    let authorized = russh::keys::PublicKey::from_openssh(text.trim())
        .with_context(|| format!("parse --ssh-authorized-key {}", path.display()))?;
    let (base, temp) = match &args.ssh_root {
        Some(dir) => {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("create --ssh-root {}", dir.display()))?;
            (dir.clone(), None)
        }
        None => {
            let temp = tempfile::tempdir().context("create the servers' root")?;
            (temp.path().to_owned(), Some(temp))
        }
    };
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("bind --ssh-listen {addr}"))?;
    let sshd = Sshd::for_emulator(listener, emulator.clone(), base, authorized, &args.ssh_user)?;
    println!("ssh listening on {}", sshd.addr());
    Ok((sshd, temp))
}

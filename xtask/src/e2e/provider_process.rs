//! A provider binary running as a child process on loopback ports: picks free ports (bind
//! `127.0.0.1:0`, close, pass the port on; a new pick when the child loses the race for it),
//! waits for `grpc.health.v1` SERVING by bounded polling, stops it with SIGTERM, and keeps its
//! log for failure reports. The child is killed if it is dropped while still running.
//!
//! Shared by `cargo xtask e2e` and, through the dev-only `testkit` crate (which includes this
//! file by `#[path]`), the integration tests that run provider binaries.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tokio::time::Instant;
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;

use super::wire::{self, ClientSecurity};

/// How many fresh port picks a start may take before giving up.
const PORT_ATTEMPTS: usize = 5;
/// How long a start may take from exec to SERVING.
pub const START_DEADLINE: Duration = Duration::from_secs(30);

/// A loopback port that was free a moment ago.
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
        .local_addr()?
        .port())
}

/// What to start.
#[derive(Clone, Debug)]
pub struct Spec {
    /// A short name for messages.
    pub name: String,
    pub binary: PathBuf,
    /// Arguments besides `--addr` (and `--metrics-addr` when `metrics` is set).
    pub args: Vec<String>,
    /// Whether the binary takes `--metrics-addr` (faultprovider does not).
    pub metrics: bool,
    /// How the health check connects (must match the TLS flags in `args`).
    pub security: ClientSecurity,
    pub pki: PathBuf,
}

/// A running provider.
pub struct Provider {
    pub spec: Spec,
    pub grpc: SocketAddr,
    pub metrics: Option<SocketAddr>,
    child: Child,
    log: Arc<Mutex<Vec<String>>>,
}

impl std::fmt::Debug for Provider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Provider")
            .field("name", &self.spec.name)
            .field("grpc", &self.grpc)
            .finish_non_exhaustive()
    }
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, port))
}

/// Spawns the child with both output streams collected into `log`.
fn spawn(
    spec: &Spec,
    grpc: SocketAddr,
    metrics: Option<SocketAddr>,
) -> Result<(Child, Arc<Mutex<Vec<String>>>)> {
    let mut command = Command::new(&spec.binary);
    command.arg(format!("--addr={grpc}"));
    if let Some(metrics) = metrics {
        command.arg(format!("--metrics-addr={metrics}"));
    }
    command
        .args(&spec.args)
        .env_remove("RUST_LOG")
        .env("NO_COLOR", "1")
        .env_remove("HCLOUD_TOKEN")
        .env_remove("DIGITALOCEAN_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = command
        .spawn()
        .with_context(|| format!("spawn {}", spec.binary.display()))?;
    let log = Arc::new(Mutex::new(Vec::new()));
    let streams: [Box<dyn std::io::Read + Send>; 2] = [
        Box::new(child.stdout.take().context("child stdout")?),
        Box::new(child.stderr.take().context("child stderr")?),
    ];
    for stream in streams {
        let log = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                log.lock().unwrap_or_else(|e| e.into_inner()).push(line);
            }
        });
    }
    Ok((child, log))
}

/// Starts `spec` on free loopback ports and waits until it reports SERVING.
pub async fn start(spec: Spec) -> Result<Provider> {
    start_until(spec, true, START_DEADLINE).await
}

/// [`start`] with a deadline of its own from exec to SERVING, for a provider whose startup
/// waits on something slow (an API budget that another user of the token spent).
pub async fn start_within(spec: Spec, within: Duration) -> Result<Provider> {
    start_until(spec, true, within).await
}

/// Starts `spec` and waits until its gRPC port answers the health check at all: a standby
/// replica (`--state etcd://…`) reports NOT_SERVING until it leads.
pub async fn start_answering(spec: Spec) -> Result<Provider> {
    start_until(spec, false, START_DEADLINE).await
}

async fn start_until(spec: Spec, serving: bool, within: Duration) -> Result<Provider> {
    let mut last_error = None;
    for _ in 0..PORT_ATTEMPTS {
        let grpc = loopback(free_port()?);
        let metrics = if spec.metrics {
            Some(loopback(free_port()?))
        } else {
            None
        };
        match start_on(spec.clone(), grpc, metrics, serving, within).await {
            Ok(provider) => return Ok(provider),
            Err(StartFailure::PortTaken(text)) => last_error = Some(text),
            Err(StartFailure::Other(e)) => return Err(e),
        }
    }
    bail!(
        "{}: no free port after {PORT_ATTEMPTS} attempts: {}",
        spec.name,
        last_error.unwrap_or_default()
    )
}

enum StartFailure {
    PortTaken(String),
    Other(anyhow::Error),
}

impl From<anyhow::Error> for StartFailure {
    fn from(e: anyhow::Error) -> StartFailure {
        StartFailure::Other(e)
    }
}

async fn start_on(
    spec: Spec,
    grpc: SocketAddr,
    metrics: Option<SocketAddr>,
    serving: bool,
    within: Duration,
) -> Result<Provider, StartFailure> {
    let (child, log) = spawn(&spec, grpc, metrics)?;
    let mut provider = Provider {
        spec,
        grpc,
        metrics,
        child,
        log,
    };
    let deadline = Instant::now() + within;
    loop {
        if let Some(status) = provider.child.try_wait().context("poll child")? {
            let logs = provider.logs();
            if logs.contains("Address already in use") || logs.contains("address already in use") {
                return Err(StartFailure::PortTaken(logs));
            }
            return Err(StartFailure::Other(anyhow::anyhow!(
                "{} exited with {status} before serving; log:\n{logs}",
                provider.spec.name
            )));
        }
        if let Ok(channel) = provider.try_channel(provider.spec.security).await
            && match wire::health(&channel, "").await {
                Ok(ServingStatus::Serving) => true,
                Ok(_) => !serving,
                Err(_) => false,
            }
        {
            if provider.metrics.is_some() && provider.lost_metrics_port().await {
                return Err(StartFailure::PortTaken(provider.logs()));
            }
            return Ok(provider);
        }
        if Instant::now() >= deadline {
            return Err(StartFailure::Other(anyhow::anyhow!(
                "{} not SERVING within {within:?}; log:\n{}",
                provider.spec.name,
                provider.logs()
            )));
        }
        tokio::time::sleep(wire::POLL_EVERY * 2).await;
    }
}

impl Provider {
    /// Everything the child printed so far.
    pub fn logs(&self) -> String {
        self.log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .join("\n")
    }

    /// Whether the provider logged that it could not bind its metrics port (it keeps serving
    /// gRPC without it). The line comes before the startup announcement, so this waits (bounded)
    /// for the announcement to be read first.
    async fn lost_metrics_port(&self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let logs = self.logs();
            if logs.contains("cannot bind the metrics address") {
                return true;
            }
            if logs.contains("serving") || Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(wire::POLL_EVERY).await;
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    async fn try_channel(&self, security: ClientSecurity) -> Result<Channel> {
        let endpoint = wire::endpoint(&self.spec.pki, self.grpc, security)?
            .connect_timeout(Duration::from_millis(500));
        Ok(endpoint.connect().await?)
    }

    /// A connected channel in the given mode.
    pub async fn channel(&self, security: ClientSecurity) -> Result<Channel> {
        wire::channel(&self.spec.pki, self.grpc, security).await
    }

    /// A channel in the mode the provider was started for.
    pub async fn default_channel(&self) -> Result<Channel> {
        self.channel(self.spec.security).await
    }

    /// Sends a signal by name (`KILL`, `STOP`, `CONT`, ...) to the child.
    pub fn signal(&self, name: &str) -> Result<()> {
        let status = Command::new("kill")
            .args([&format!("-{name}"), &self.child.id().to_string()])
            .status()
            .context("run kill")?;
        if !status.success() {
            bail!(
                "could not send SIG{name} to {} (pid {})",
                self.spec.name,
                self.child.id()
            );
        }
        Ok(())
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) -> Result<()> {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .context("run kill")?;
        if !status.success() {
            bail!(
                "could not send SIGTERM to {} (pid {})",
                self.spec.name,
                self.child.id()
            );
        }
        Ok(())
    }

    /// Waits (bounded) for the child to exit.
    pub async fn wait_exit(&mut self, within: Duration) -> Result<ExitStatus> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() >= deadline {
                bail!(
                    "{} still running {within:?} after being asked to stop; log:\n{}",
                    self.spec.name,
                    self.logs()
                );
            }
            tokio::time::sleep(wire::POLL_EVERY).await;
        }
    }

    /// SIGTERM, then insists on exit status 0 within `within`.
    pub async fn stop(&mut self, within: Duration) -> Result<()> {
        self.terminate()?;
        let status = self.wait_exit(within).await?;
        if status.code() != Some(0) {
            bail!(
                "{} exited with {status} after SIGTERM, want 0; log:\n{}",
                self.spec.name,
                self.logs()
            );
        }
        Ok(())
    }
}

impl Drop for Provider {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The path of a binary in cargo's target directory (`CARGO_TARGET_DIR` or `<root>/target`).
pub fn target_binary(workspace_root: &Path, profile: &str, name: &str) -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root.join("target"));
    let target = if target.is_relative() {
        workspace_root.join(target)
    } else {
        target
    };
    target.join(profile).join(name)
}

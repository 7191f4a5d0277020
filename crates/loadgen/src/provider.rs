//! The provider under load: a gRPC channel to it, and, when the bench starts it, the child
//! process (free loopback port, `--seed-count`, `--state`, timed wait for health SERVING,
//! SIGTERM at the end).
//!
//! `crate::e2e::provider_process` launches providers for the e2e run, but it polls health
//! every 20 ms (too coarse to time a 0.25 s startup), only knows the committed test PKI, and
//! takes a binary rather than a command line, so this is a separate, smaller launcher.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use fleet_proto::v1alpha1 as pb;
use pb::capacity_provider_client::CapacityProviderClient;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use super::args::{Tls, flag_value};
use super::procfs::Process;

/// How long one RPC may take (a full List of a large inventory on a slow provider included).
const RPC_TIMEOUT: Duration = Duration::from_secs(120);
/// Largest response the client accepts: a full List of millions of machines.
const MAX_MESSAGE: usize = 1 << 30;
/// From exec to SERVING, whatever the inventory.
const START_DEADLINE: Duration = Duration::from_secs(180);
/// How often a starting provider is probed; the startup figure's resolution.
const START_POLL: Duration = Duration::from_millis(1);
/// SIGTERM to exit (the providers' default shutdown grace is 25 s).
const STOP_DEADLINE: Duration = Duration::from_secs(35);
/// Fresh port picks when a child loses the race for its port.
const PORT_ATTEMPTS: usize = 5;
/// Log lines kept from a child, for error reports.
const LOG_LINES: usize = 200;

pub(crate) type Client = CapacityProviderClient<Channel>;

/// A connected provider.
pub(crate) struct Provider {
    pub channel: Channel,
    addr: SocketAddr,
    tls: Option<Tls>,
    /// Set when the provider runs on this host and its pid is known.
    pub process: Option<Process>,
    child: Option<Spawned>,
}

impl Provider {
    pub(crate) fn client(&self) -> Client {
        CapacityProviderClient::new(self.channel.clone())
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE)
    }

    /// Where a second, independent caller connects to (see [`client_at`]).
    pub(crate) fn address(&self) -> (SocketAddr, Option<Tls>) {
        (self.addr, self.tls.clone())
    }

    /// Time from exec to health SERVING, when the bench started it.
    pub(crate) fn ready_after(&self) -> Option<Duration> {
        self.child.as_ref().map(|c| c.ready_after)
    }

    /// Connects to a running provider.
    pub(crate) async fn connect(
        addr: SocketAddr,
        tls: Option<&Tls>,
        pid: Option<u32>,
    ) -> Result<Provider> {
        let channel = endpoint(addr, tls)?
            .connect()
            .await
            .with_context(|| format!("connect to {addr}"))?;
        match health(&channel).await {
            Ok(ServingStatus::Serving) => {}
            other => bail!("{addr} is not SERVING: {other:?}"),
        }
        Ok(Provider {
            channel,
            addr,
            tls: tls.cloned(),
            process: pid.map(Process::new),
            child: None,
        })
    }

    /// Starts `command` with the bench's flags added, and waits for SERVING.
    pub(crate) async fn start(
        command: &[String],
        seeds: Option<usize>,
        state: Option<&Path>,
        tls: Option<&Tls>,
    ) -> Result<Provider> {
        let mut last = None;
        for _ in 0..PORT_ATTEMPTS {
            match start_once(command, seeds, state, tls).await {
                Ok(provider) => return Ok(provider),
                Err(Start::PortTaken(log)) => last = Some(log),
                Err(Start::Failed(e)) => return Err(e),
            }
        }
        bail!(
            "{}: no free port after {PORT_ATTEMPTS} attempts; log:\n{}",
            command[0],
            last.unwrap_or_default()
        )
    }

    /// SIGTERM, and a bounded wait for exit (then SIGKILL). A provider the bench did not
    /// start is left alone.
    pub(crate) async fn stop(mut self) -> Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        terminate(child.child.id())?;
        let deadline = Instant::now() + STOP_DEADLINE;
        loop {
            if let Some(status) = child.child.try_wait()? {
                if !status.success() {
                    eprintln!("bench: note: provider exited with {status} after SIGTERM");
                }
                return Ok(());
            }
            if Instant::now() >= deadline {
                let _ = child.child.kill();
                let _ = child.child.wait();
                bail!(
                    "provider still running {STOP_DEADLINE:?} after SIGTERM; killed. log:\n{}",
                    child.logs()
                );
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Recent log lines of a provider the bench started.
    pub(crate) fn logs(&self) -> String {
        self.child.as_ref().map(Spawned::logs).unwrap_or_default()
    }
}

/// A client on a connection of its own, driven by the runtime this is called on.
pub(crate) async fn client_at(addr: SocketAddr, tls: Option<&Tls>) -> Result<Client> {
    let channel = endpoint(addr, tls)?
        .connect()
        .await
        .with_context(|| format!("connect to {addr}"))?;
    Ok(CapacityProviderClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE))
}

/// A `MachineList` whose machines stay encoded: timing a List then measures the provider and
/// the transfer, not this client's decoding of every field of every machine (which, for
/// 100k machines, costs about as much CPU as the provider's answer).
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct RawList {
    /// Slices of the received buffer, not copies.
    #[prost(bytes = "bytes", repeated, tag = "1")]
    pub machines: Vec<prost::bytes::Bytes>,
    #[prost(bytes = "vec", tag = "2")]
    pub revision: Vec<u8>,
}

/// `CapacityProvider/List` answered as a [`RawList`].
pub(crate) async fn list_raw(
    channel: &Channel,
    filter: pb::ListFilter,
) -> Result<RawList, tonic::Status> {
    let mut grpc = tonic::client::Grpc::new(channel.clone()).max_decoding_message_size(MAX_MESSAGE);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(format!("channel not ready: {e}")))?;
    let codec = tonic_prost::ProstCodec::<pb::ListFilter, RawList>::default();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(
        "/bigfleet.v1alpha1.CapacityProvider/List",
    );
    Ok(grpc
        .unary(tonic::Request::new(filter), path, codec)
        .await?
        .into_inner())
}

struct Spawned {
    child: Child,
    ready_after: Duration,
    log: Arc<Mutex<VecDeque<String>>>,
}

impl Spawned {
    fn logs(&self) -> String {
        let log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        log.iter().cloned().collect::<Vec<_>>().join("\n")
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

enum Start {
    PortTaken(String),
    Failed(anyhow::Error),
}

/// The full argument list: the command, then what the bench adds unless the command has it.
pub(crate) fn launch_args(
    command: &[String],
    addr: SocketAddr,
    seeds: Option<usize>,
    state: Option<&Path>,
) -> Vec<String> {
    let mut args = command.to_vec();
    if flag_value(command, "--addr").is_none() {
        args.push(format!("--addr={addr}"));
    }
    if let Some(seeds) = seeds
        && flag_value(command, "--seed-count").is_none()
    {
        args.push(format!("--seed-count={seeds}"));
    }
    if let Some(state) = state
        && flag_value(command, "--state").is_none()
    {
        args.push(format!("--state={}", state.display()));
    }
    args
}

/// The address the provider will listen on: the command's own `--addr` when it names a
/// loopback address, else a free loopback port.
fn listen_addr(command: &[String]) -> Result<SocketAddr> {
    match flag_value(command, "--addr") {
        Some(text) => super::args::loopback_addr(text)
            .with_context(|| format!("--addr {text:?} in the spawned command")),
        None => Ok(SocketAddr::from((
            Ipv4Addr::LOCALHOST,
            TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
                .local_addr()?
                .port(),
        ))),
    }
}

async fn start_once(
    command: &[String],
    seeds: Option<usize>,
    state: Option<&Path>,
    tls: Option<&Tls>,
) -> Result<Provider, Start> {
    let addr = listen_addr(command).map_err(Start::Failed)?;
    let args = launch_args(command, addr, seeds, state);
    let endpoint = endpoint(addr, tls)
        .map_err(Start::Failed)?
        .connect_timeout(Duration::from_millis(200));
    let started = Instant::now();
    let mut child = Command::new(&args[0])
        .args(&args[1..])
        .env_remove("HCLOUD_TOKEN")
        .env_remove("DIGITALOCEAN_TOKEN")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawn {}", args.join(" ")))
        .map_err(Start::Failed)?;
    let log = Arc::new(Mutex::new(VecDeque::new()));
    let streams: [Box<dyn std::io::Read + Send>; 2] = [
        Box::new(
            child
                .stdout
                .take()
                .context("child stdout")
                .map_err(Start::Failed)?,
        ),
        Box::new(
            child
                .stderr
                .take()
                .context("child stderr")
                .map_err(Start::Failed)?,
        ),
    ];
    for stream in streams {
        let log = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                let mut log = log.lock().unwrap_or_else(|e| e.into_inner());
                if log.len() == LOG_LINES {
                    log.pop_front();
                }
                log.push_back(line);
            }
        });
    }
    let mut spawned = Spawned {
        child,
        ready_after: Duration::ZERO,
        log,
    };
    let deadline = started + START_DEADLINE;
    loop {
        if let Some(status) = spawned
            .child
            .try_wait()
            .map_err(|e| Start::Failed(e.into()))?
        {
            // Give the log readers a moment to collect the last lines.
            tokio::time::sleep(Duration::from_millis(50)).await;
            let logs = spawned.logs();
            if logs.to_ascii_lowercase().contains("address already in use") {
                return Err(Start::PortTaken(logs));
            }
            return Err(Start::Failed(anyhow::anyhow!(
                "{} exited with {status} before serving; log:\n{logs}",
                args.join(" ")
            )));
        }
        if let Ok(channel) = endpoint.connect().await
            && matches!(health(&channel).await, Ok(ServingStatus::Serving))
        {
            spawned.ready_after = started.elapsed();
            let pid = spawned.child.id();
            return Ok(Provider {
                channel,
                addr,
                tls: tls.cloned(),
                process: Some(Process::new(pid)),
                child: Some(spawned),
            });
        }
        if Instant::now() >= deadline {
            return Err(Start::Failed(anyhow::anyhow!(
                "{} not SERVING within {START_DEADLINE:?}; log:\n{}",
                args.join(" "),
                spawned.logs()
            )));
        }
        tokio::time::sleep(START_POLL).await;
    }
}

fn terminate(pid: u32) -> Result<()> {
    let status = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .context("run kill")?;
    if !status.success() {
        bail!("could not send SIGTERM to pid {pid}");
    }
    Ok(())
}

/// An endpoint to `addr`: cleartext HTTP/2, or TLS with the given material. Windows are
/// opened wide so a large List is not paced by HTTP/2 flow control on loopback.
pub(crate) fn endpoint(addr: SocketAddr, tls: Option<&Tls>) -> Result<Endpoint> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut endpoint = Endpoint::from_shared(format!("{scheme}://{addr}"))?
        .connect_timeout(Duration::from_secs(5))
        .timeout(RPC_TIMEOUT)
        .tcp_nodelay(true)
        .initial_stream_window_size(Some(16 << 20))
        .initial_connection_window_size(Some(32 << 20));
    if let Some(tls) = tls {
        let read =
            |path: &Path| std::fs::read(path).with_context(|| format!("read {}", path.display()));
        let mut config = ClientTlsConfig::new()
            .domain_name(tls.domain.clone())
            .ca_certificate(Certificate::from_pem(read(&tls.ca)?));
        if let Some((cert, key)) = &tls.identity {
            config = config.identity(Identity::from_pem(read(cert)?, read(key)?));
        }
        endpoint = endpoint.tls_config(config)?;
    }
    Ok(endpoint)
}

async fn health(channel: &Channel) -> Result<ServingStatus, tonic::Status> {
    let reply = HealthClient::new(channel.clone())
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await?;
    Ok(reply.into_inner().status())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::split_words;

    #[test]
    fn raw_list_reads_the_wire_form_of_machine_list() {
        use prost::Message;
        let list = pb::MachineList {
            machines: (0..3)
                .map(|i| pb::Machine {
                    id: format!("m-{i}"),
                    state: pb::MachineState::Idle as i32,
                    ..Default::default()
                })
                .collect(),
            revision: b"42".to_vec(),
            ..Default::default()
        };
        let bytes = list.encode_to_vec();
        let raw = RawList::decode(bytes.as_slice()).unwrap();
        assert_eq!(raw.machines.len(), 3);
        assert_eq!(raw.revision, b"42");
        assert_eq!(raw.encoded_len(), bytes.len());
        assert_eq!(
            pb::Machine::decode(raw.machines[2].clone()).unwrap().id,
            "m-2"
        );
    }

    #[test]
    fn adds_only_missing_flags() {
        let addr: SocketAddr = "127.0.0.1:4000".parse().unwrap();
        let cmd = split_words("bin --use-fake-backend --metrics-addr=").unwrap();
        assert_eq!(
            launch_args(&cmd, addr, Some(1000), Some(Path::new("/tmp/s"))),
            split_words(
                "bin --use-fake-backend --metrics-addr= --addr=127.0.0.1:4000 \
                 --seed-count=1000 --state=/tmp/s"
            )
            .unwrap()
        );
        let cmd = split_words("bin --addr 127.0.0.1:5 --seed-count=9").unwrap();
        assert_eq!(launch_args(&cmd, addr, Some(1000), None), cmd);
        assert_eq!(listen_addr(&cmd).unwrap(), "127.0.0.1:5".parse().unwrap());
        assert!(listen_addr(&split_words("bin --addr :9000").unwrap()).is_err());
    }
}

//! The `takeover` scenario: two replicas of the provider on one prefix of a fresh etcd member,
//! with the provider's own lease TTL (the default unless the command sets `--etcd-lease-ttl`).
//! Each round kills the leader with SIGKILL and times the first Create that the standby
//! acknowledges, retried every 10 ms from the moment of the kill; then a new standby is started
//! for the next round. The figure is what a shard sees: kill -9 to the first acknowledged
//! mutation on the new leader.

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use fleet_proto::v1alpha1 as pb;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use super::args::Tls;
use super::etcd::Etcd;
use super::provider::{client_at, endpoint, launch_args};
use super::report::{COUNT, P50, P99, Row};
use super::scenarios::Scratch;
use super::stats::Samples;

/// Kills per run.
const ROUNDS: usize = 3;
/// Longest a takeover may take before the run fails.
const TAKEOVER_DEADLINE: Duration = Duration::from_secs(30);

struct Replica {
    addr: SocketAddr,
    child: Child,
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts a replica and waits until its health check answers `want` (a standby reports
/// NOT_SERVING, the first replica SERVING).
async fn replica(
    command: &[String],
    size: usize,
    state: &Path,
    tls: Option<&Tls>,
    want: ServingStatus,
) -> Result<Replica> {
    let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
        .local_addr()?
        .port();
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let args = launch_args(command, addr, Some(size), Some(state));
    let child = Command::new(&args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("spawn {}", args[0]))?;
    let mut replica = Replica { addr, child };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = replica.child.try_wait()? {
            bail!("replica exited with {status} before it answered");
        }
        if let Ok(channel) = endpoint(addr, tls)?.connect().await
            && let Ok(reply) = HealthClient::new(channel)
                .check(HealthCheckRequest::default())
                .await
            && reply.into_inner().status() == want
        {
            return Ok(replica);
        }
        if Instant::now() >= deadline {
            bail!("replica on {addr} did not report {want:?} within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub(crate) async fn measure(
    command: &[String],
    size: usize,
    tls: Option<&Tls>,
    scratch: &mut Scratch,
) -> Result<Vec<Row>> {
    let etcd = Etcd::start(&scratch.fresh())?;
    let state = std::path::PathBuf::from(etcd.state());
    let mut leader = replica(command, size, &state, tls, ServingStatus::Serving).await?;
    let speculative: Vec<String> = client_at(leader.addr, tls)
        .await?
        .list(pb::ListFilter {
            states: vec![pb::MachineState::Speculative as i32],
            max_results: 0,
            since_revision: Vec::new(),
        })
        .await
        .context("list the inventory")?
        .into_inner()
        .machines
        .into_iter()
        .map(|m| m.id)
        .collect();
    let mut ids = speculative.into_iter();
    let mut samples = Samples::with_capacity(ROUNDS);
    let mut sequence = 0;
    for round in 0..ROUNDS {
        let standby = replica(command, size, &state, tls, ServingStatus::NotServing).await?;
        // Let the standby's watch catch up with the seeded inventory.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut client = client_at(standby.addr, tls).await?;
        let id = ids.next().context("ran out of speculative machines")?;
        leader.child.kill().context("kill -9 the leader")?;
        let killed = Instant::now();
        let _ = leader.child.wait();
        loop {
            sequence += 1;
            let request = pb::CreateRequest {
                machine_id: id.clone(),
                shard_id: "bench-takeover".into(),
                shard_epoch: 1,
                sequence_number: sequence,
            };
            match client.create(request).await {
                Ok(_) => break,
                // A standby refuses, then closes its connections (docs/ha.md); the channel
                // reconnects on the next call, as a shard's does.
                Err(status) if refused_or_closed(&status) => {}
                Err(status) => bail!("round {round}: Create {id} answered {status:?}"),
            }
            if killed.elapsed() > TAKEOVER_DEADLINE {
                bail!("round {round}: no takeover within {TAKEOVER_DEADLINE:?}");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let took = killed.elapsed();
        eprintln!(
            "bench: takeover round {}: {:.0} ms",
            round + 1,
            took.as_secs_f64() * 1e3
        );
        samples.push(took);
        leader = standby;
    }
    drop(leader);
    drop(etcd);
    let ms = |d: Option<Duration>| d.map(|d| d.as_secs_f64() * 1e3).unwrap_or(0.0);
    let (p50, max) = (ms(samples.percentile(50.0)), ms(samples.percentile(100.0)));
    Ok(vec![
        Row::new(format!("kill -9 to first ack, {size} machines"))
            .set(COUNT, samples.len() as f64)
            .set(P50, p50)
            .set(P99, max),
    ])
}

/// UNAVAILABLE from a replica that does not lead, or the connection it closed under the call.
fn refused_or_closed(status: &tonic::Status) -> bool {
    match status.code() {
        tonic::Code::Unavailable | tonic::Code::Cancelled => true,
        tonic::Code::Unknown => status.message().contains("transport error"),
        _ => false,
    }
}

//! A tiny `bigfleet.v1alpha1.CapacityProvider` test client: channels in every security mode
//! against the committed test PKI (`testdata/pki`, `cargo xtask certs`), a shard that stamps
//! fresh fence tokens, and bounded polling of Get until a machine settles.
//!
//! Shared by `cargo xtask e2e` and, through the dev-only `testkit` crate (which includes this
//! file by `#[path]`), every crate's integration tests, so the tiers speak to providers the
//! same way.
//! It depends only on tonic (tls-ring), tonic-health, fleet-proto, tokio and anyhow.

#![allow(dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use fleet_proto::v1alpha1 as pb;
use pb::capacity_provider_client::CapacityProviderClient;
use tokio::time::Instant;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic::{Code, Status};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// How long one RPC may take before the client gives up.
pub const RPC_TIMEOUT: Duration = Duration::from_secs(5);
/// How often [`Caller::wait_for_state`] polls Get.
pub const POLL_EVERY: Duration = Duration::from_millis(10);

/// The shard id the test CA's client certificate (`client.pem`, [`ClientSecurity::Mtls`])
/// proves: its one `bigfleet://` URI SAN is `bigfleet://shard/test-shard`, so under mTLS with
/// `--shard-identity=enforce` (the default) mutations must assert this shard id.
pub const TEST_SHARD: &str = "test-shard";

/// The committed test PKI below the workspace root.
pub fn pki_dir(workspace_root: &Path) -> PathBuf {
    workspace_root.join("testdata").join("pki")
}

/// What a client presents to the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClientSecurity {
    /// Cleartext HTTP/2.
    Plaintext,
    /// TLS trusting the test CA, without a client certificate.
    Tls,
    /// TLS trusting the test CA, with the test CA's client certificate: the shard
    /// [`TEST_SHARD`].
    Mtls,
    /// TLS trusting the test CA, with its `bigfleet://admin` client certificate (reads pass,
    /// mutations are refused under `--shard-identity=enforce`).
    MtlsAdmin,
    /// TLS trusting the test CA, with a client certificate of the unrelated CA.
    MtlsOtherCa,
    /// TLS trusting only the unrelated CA (the server's certificate must be refused).
    TlsOtherRoots,
}

fn read(pki: &Path, name: &str) -> Result<Vec<u8>> {
    let path = pki.join(name);
    std::fs::read(&path)
        .with_context(|| format!("read {} (run `cargo xtask certs`)", path.display()))
}

/// An endpoint for `addr` in the given mode, not yet connected. TLS clients verify the server
/// as `localhost`, the name in the test server certificate.
pub fn endpoint(pki: &Path, addr: SocketAddr, security: ClientSecurity) -> Result<Endpoint> {
    let scheme = if security == ClientSecurity::Plaintext {
        "http"
    } else {
        "https"
    };
    let mut endpoint = Endpoint::from_shared(format!("{scheme}://{addr}"))?
        .connect_timeout(RPC_TIMEOUT)
        .timeout(RPC_TIMEOUT);
    let roots = match security {
        ClientSecurity::Plaintext => return Ok(endpoint),
        ClientSecurity::TlsOtherRoots => "other-ca.pem",
        _ => "ca.pem",
    };
    let mut tls = ClientTlsConfig::new()
        .domain_name("localhost")
        .ca_certificate(Certificate::from_pem(read(pki, roots)?));
    let identity = match security {
        ClientSecurity::Mtls => Some(("client.pem", "client-key.pem")),
        ClientSecurity::MtlsAdmin => Some(("admin-client.pem", "admin-client-key.pem")),
        ClientSecurity::MtlsOtherCa => Some(("other-client.pem", "other-client-key.pem")),
        _ => None,
    };
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(read(pki, cert)?, read(pki, key)?));
    }
    endpoint = endpoint.tls_config(tls)?;
    Ok(endpoint)
}

/// A connected channel (the TCP connection and, for TLS, the handshake are done).
pub async fn channel(pki: &Path, addr: SocketAddr, security: ClientSecurity) -> Result<Channel> {
    endpoint(pki, addr, security)?
        .connect()
        .await
        .with_context(|| format!("connect to {addr} ({security:?})"))
}

/// `grpc.health.v1.Health/Check` for `service` ("" is the whole server).
pub async fn health(channel: &Channel, service: &str) -> Result<ServingStatus, Status> {
    let reply = HealthClient::new(channel.clone())
        .check(HealthCheckRequest {
            service: service.to_owned(),
        })
        .await?;
    Ok(reply.into_inner().status())
}

/// Polls the health check until it reports `want` or `within` passes.
pub async fn wait_for_health(
    channel: &Channel,
    want: ServingStatus,
    within: Duration,
) -> Result<()> {
    let deadline = Instant::now() + within;
    loop {
        let seen = health(channel, "").await;
        if matches!(&seen, Ok(status) if *status == want) {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("health did not become {want:?} within {within:?}; last answer {seen:?}");
        }
        tokio::time::sleep(POLL_EVERY).await;
    }
}

/// A shard identity that stamps strictly increasing fence tokens, the way a live shard does on
/// every attempt.
#[derive(Clone, Debug)]
pub struct Shard {
    pub id: String,
    pub epoch: i64,
    pub sequence: i64,
}

impl Shard {
    pub fn new(id: impl Into<String>, epoch: i64) -> Shard {
        Shard {
            id: id.into(),
            epoch,
            sequence: 0,
        }
    }

    /// The next token: `(id, epoch, sequence + 1)`.
    pub fn next(&mut self) -> (String, i64, i64) {
        self.sequence += 1;
        (self.id.clone(), self.epoch, self.sequence)
    }
}

/// A client plus the shard it stamps its mutations with.
#[derive(Clone, Debug)]
pub struct Caller {
    pub client: CapacityProviderClient<Channel>,
    pub shard: Shard,
}

pub fn create_request(id: &str, token: (String, i64, i64)) -> pb::CreateRequest {
    pb::CreateRequest {
        machine_id: id.to_owned(),
        shard_id: token.0,
        shard_epoch: token.1,
        sequence_number: token.2,
    }
}

pub fn configure_request(
    id: &str,
    cluster: &str,
    shard_metadata: HashMap<String, String>,
    token: (String, i64, i64),
) -> pb::ConfigureRequest {
    pb::ConfigureRequest {
        machine_id: id.to_owned(),
        cluster_id: cluster.to_owned(),
        bootstrap_blob: b"#!/bin/sh\necho join\n".to_vec(),
        shard_id: token.0,
        shard_epoch: token.1,
        sequence_number: token.2,
        shard_metadata,
    }
}

pub fn drain_request(id: &str, token: (String, i64, i64)) -> pb::DrainRequest {
    pb::DrainRequest {
        machine_id: id.to_owned(),
        grace_period_seconds: 1,
        shard_id: token.0,
        shard_epoch: token.1,
        sequence_number: token.2,
    }
}

pub fn delete_request(id: &str, token: (String, i64, i64)) -> pb::DeleteRequest {
    pb::DeleteRequest {
        machine_id: id.to_owned(),
        shard_id: token.0,
        shard_epoch: token.1,
        sequence_number: token.2,
    }
}

/// The state of a wire machine as the enum.
pub fn state_of(machine: &pb::Machine) -> pb::MachineState {
    pb::MachineState::try_from(machine.state).unwrap_or(pb::MachineState::Unspecified)
}

/// The snapshot carried by an ack (an ack always carries one).
pub fn acked(ack: &pb::TransitionAck) -> &pb::Machine {
    ack.machine
        .as_ref()
        .expect("a TransitionAck always carries the machine")
}

impl Caller {
    pub fn new(channel: Channel, shard: Shard) -> Caller {
        Caller {
            client: CapacityProviderClient::new(channel),
            shard,
        }
    }

    pub async fn create(&mut self, id: &str) -> Result<pb::TransitionAck, Status> {
        let request = create_request(id, self.shard.next());
        Ok(self.client.create(request).await?.into_inner())
    }

    pub async fn configure(
        &mut self,
        id: &str,
        cluster: &str,
        shard_metadata: HashMap<String, String>,
    ) -> Result<pb::TransitionAck, Status> {
        let request = configure_request(id, cluster, shard_metadata, self.shard.next());
        Ok(self.client.configure(request).await?.into_inner())
    }

    pub async fn drain(&mut self, id: &str) -> Result<pb::TransitionAck, Status> {
        let request = drain_request(id, self.shard.next());
        Ok(self.client.drain(request).await?.into_inner())
    }

    pub async fn delete(&mut self, id: &str) -> Result<pb::TransitionAck, Status> {
        let request = delete_request(id, self.shard.next());
        Ok(self.client.delete(request).await?.into_inner())
    }

    pub async fn get(&mut self, id: &str) -> Result<pb::Machine, Status> {
        let request = pb::MachineRef { id: id.to_owned() };
        Ok(self.client.get(request).await?.into_inner())
    }

    pub async fn list(&mut self, filter: pb::ListFilter) -> Result<pb::MachineList, Status> {
        Ok(self.client.list(filter).await?.into_inner())
    }

    /// Every machine, sorted by id.
    pub async fn list_all(&mut self) -> Result<Vec<pb::Machine>, Status> {
        let mut machines = self.list(pb::ListFilter::default()).await?.machines;
        machines.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(machines)
    }

    /// Polls Get until the machine is in `want`, or fails after `within`. Reaching FAILED when
    /// something else is wanted fails at once, with the machine's last_error.
    pub async fn wait_for_state(
        &mut self,
        id: &str,
        want: pb::MachineState,
        within: Duration,
    ) -> Result<pb::Machine> {
        let deadline = Instant::now() + within;
        loop {
            let machine = self.get(id).await.with_context(|| format!("Get {id}"))?;
            let state = state_of(&machine);
            if state == want {
                return Ok(machine);
            }
            if state == pb::MachineState::Failed {
                bail!(
                    "{id} went FAILED while waiting for {want:?}: {}",
                    machine.last_error
                );
            }
            if Instant::now() >= deadline {
                bail!("{id} still {state:?} after {within:?}, want {want:?}");
            }
            tokio::time::sleep(POLL_EVERY).await;
        }
    }
}

/// Whether a call failed in the client's transport (the connection was refused, reset or closed
/// by the server's TLS layer) rather than with a status sent by a server handler. Statuses built
/// on the client from a transport error carry that error as their source; statuses received
/// from the server never do.
pub fn is_transport_refusal(status: &Status) -> bool {
    std::error::Error::source(status).is_some_and(|e| e.is::<tonic::transport::Error>())
}

/// Checks that `result` failed with `code` and exactly `message`.
pub fn expect_status<T: std::fmt::Debug>(
    result: Result<T, Status>,
    code: Code,
    message: &str,
) -> Result<()> {
    match result {
        Ok(value) => bail!("want {code:?} {message:?}, got OK {value:?}"),
        Err(status) if status.code() == code && status.message() == message => Ok(()),
        Err(status) => bail!(
            "want {code:?} {message:?}, got {:?} {:?}",
            status.code(),
            status.message()
        ),
    }
}

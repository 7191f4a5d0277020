//! The tonic `CapacityProvider` service: wire <-> domain conversion, one log line and one
//! metric sample per RPC (method, machine id, code, duration), and panics answered as INTERNAL
//! "internal error" without taking the process down. Under mTLS a mutating RPC is first checked
//! against the client certificate's shard identity ([`crate::security::identity`]), before the engine sees
//! it. [`Routes`] is the service as served: Get answers with the machine's cached encoding.

use std::convert::Infallible;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use fleet_proto::encoded::Encoded;
use fleet_proto::v1alpha1 as pb;
use fleet_proto::v1alpha1::capacity_provider_server::{CapacityProvider, CapacityProviderServer};
use futures_util::future::Either;
use futures_util::{FutureExt, TryFutureExt};
use prost::bytes::Bytes;
use tonic::codegen::{BoxFuture, StdError, http};
use tonic::server::{NamedService, UnaryService};
use tonic::{Code, Request, Response, Status};

use crate::observability::telemetry::{Telemetry, code_name};
use crate::rules::fence::FenceToken;
use crate::rules::machine::{Machine, MachineState, StringMap};
use crate::runtime::engine::{Ack, Durable, ListQuery};
use crate::runtime::replica::Replica;
use crate::security::identity::{ShardGuard, ShardIdentity};

/// The gRPC face of the engine this replica serves with (every RPC answers UNAVAILABLE while
/// it does not: see [`Replica`]).
#[derive(Debug, Clone)]
pub struct Service {
    replica: Arc<Replica>,
    telemetry: Telemetry,
    /// Checks the shard a mutation asserts against the client certificate (`--shard-identity`).
    shard_identity: Arc<ShardGuard>,
}

impl Service {
    /// The service; `shard_identity` is [`ShardIdentity::Off`] unless the port is mTLS.
    pub fn new(replica: Arc<Replica>, shard_identity: ShardIdentity) -> Service {
        let telemetry = replica.telemetry();
        Service {
            replica,
            telemetry,
            shard_identity: Arc::new(ShardGuard::new(shard_identity, telemetry)),
        }
    }
}

/// The verified certificates the client presented on this request's connection (leaf first);
/// `None` without TLS.
fn peer_certificates<T>(
    request: &Request<T>,
) -> Option<Arc<Vec<rustls_pki_types::CertificateDer<'static>>>> {
    request.peer_certs()
}

/// Runs one handler: catches a panic (INTERNAL "internal error", ERROR log, panic counter),
/// then logs and counts the outcome.
pub async fn observe<T, F>(
    telemetry: Telemetry,
    method: &'static str,
    machine_id: &str,
    handler: F,
) -> Result<T, Status>
where
    F: std::future::Future<Output = Result<T, Status>>,
{
    let started = Instant::now();
    let result = match AssertUnwindSafe(handler).catch_unwind().await {
        Ok(result) => result,
        Err(panic) => Err(recovered(telemetry, method, panic)),
    };
    record(telemetry, method, machine_id, started, result)
}

fn recovered(
    telemetry: Telemetry,
    method: &'static str,
    panic: Box<dyn std::any::Any + Send>,
) -> Status {
    let what = panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic".into());
    tracing::error!(method = %format!("/{}/{method}", fleet_proto::SERVICE_NAME), panic = %what, "recovered panic in gRPC handler");
    telemetry.panic();
    Status::internal("internal error")
}

fn record<T>(
    telemetry: Telemetry,
    method: &'static str,
    machine_id: &str,
    started: Instant,
    result: Result<T, Status>,
) -> Result<T, Status> {
    let elapsed = started.elapsed();
    let code = result
        .as_ref()
        .map(|_| Code::Ok)
        .unwrap_or_else(|s| s.code());
    telemetry.rpc(method, code, elapsed);
    let dur_ms = elapsed.as_secs_f64() * 1000.0;
    let mutating = matches!(method, "Create" | "Configure" | "Drain" | "Delete");
    match (&result, mutating) {
        // The shard identity check writes its own WARN line, rate-limited: a client refused in
        // a loop must not flood the log.
        (Err(status), _) if code == Code::PermissionDenied => tracing::debug!(
            method,
            machine_id,
            code = code_name(code),
            dur_ms,
            error = status.message(),
            "rpc"
        ),
        (Err(status), _) => tracing::warn!(
            method,
            machine_id,
            code = code_name(code),
            dur_ms,
            error = status.message(),
            "rpc"
        ),
        (Ok(_), true) => tracing::info!(method, machine_id, code = code_name(code), dur_ms, "rpc"),
        (Ok(_), false) => {
            tracing::debug!(method, machine_id, code = code_name(code), dur_ms, "rpc")
        }
    }
    result
}

fn resources(map: &StringMap) -> Option<pb::Resources> {
    (!map.is_empty()).then(|| pb::Resources {
        resources: map.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
    })
}

fn hash_map(map: &StringMap) -> std::collections::HashMap<String, String> {
    map.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

/// The wire form of a machine (contract.md §2.2: host only when set, resource maps only when
/// non-empty).
pub fn machine_to_wire(m: &Machine) -> pb::Machine {
    pb::Machine {
        id: m.id.clone(),
        state: m.state.wire(),
        // A Create records its host as soon as the substrate names it (so no failure can
        // lose it), but the wire shows a host from Idle on, as the contract has it.
        host: m
            .host
            .as_ref()
            .filter(|h| !h.is_empty() && m.state != crate::rules::machine::MachineState::Creating)
            .map(|h| pb::HostRef {
                provider: h.provider.clone(),
                r#ref: h.id.clone(),
            }),
        instance_type: m.instance_type.clone(),
        zone: m.zone.clone(),
        capacity_type: m.capacity_type.wire(),
        price_per_hour: m.price_per_hour,
        interruption_probability: m.interruption_probability,
        resources: resources(&m.resources),
        labels: hash_map(&m.labels),
        last_error: m.last_error.clone(),
        allocatable: resources(&m.allocatable),
        cluster: m.cluster.clone(),
        shard_metadata: hash_map(&m.shard_metadata),
    }
}

/// The encoded wire form of a machine (the bytes of [`machine_to_wire`]), built on first use
/// and kept with the machine until it changes (see [`crate::rules::machine::WireCache`]).
pub fn wire_bytes(m: &Machine) -> Bytes {
    m.wire
        .get_or_init(|| pb::MachineList::encode_machine(&machine_to_wire(m)))
}

fn ack(a: Ack) -> pb::TransitionAck {
    pb::TransitionAck {
        operation_id: a.operation_id,
        machine: Some(machine_to_wire(&a.machine)),
    }
}

fn token(shard_id: String, epoch: i64, sequence: i64) -> FenceToken {
    FenceToken {
        shard_id,
        epoch,
        sequence,
    }
}

#[tonic::async_trait]
impl CapacityProvider for Service {
    async fn create(
        &self,
        request: Request<pb::CreateRequest>,
    ) -> Result<Response<pb::TransitionAck>, Status> {
        let peer = peer_certificates(&request);
        let r = request.into_inner();
        let (replica, guard) = (self.replica.clone(), self.shard_identity.clone());
        observe(
            self.telemetry,
            "Create",
            &r.machine_id.clone(),
            async move {
                guard.admit(
                    "Create",
                    &r.machine_id,
                    peer.as_deref().map(Vec::as_slice),
                    &r.shard_id,
                )?;
                let a = replica
                    .writer()?
                    .create(
                        &r.machine_id,
                        token(r.shard_id, r.shard_epoch, r.sequence_number),
                    )
                    .await?;
                Ok(Response::new(ack(a)))
            },
        )
        .await
    }

    async fn configure(
        &self,
        request: Request<pb::ConfigureRequest>,
    ) -> Result<Response<pb::TransitionAck>, Status> {
        let peer = peer_certificates(&request);
        let r = request.into_inner();
        let (replica, guard) = (self.replica.clone(), self.shard_identity.clone());
        let id = r.machine_id.clone();
        observe(self.telemetry, "Configure", &id, async move {
            guard.admit(
                "Configure",
                &r.machine_id,
                peer.as_deref().map(Vec::as_slice),
                &r.shard_id,
            )?;
            let engine = replica.writer()?;
            let metadata: StringMap = r.shard_metadata.into_iter().collect();
            let a = engine
                .configure(
                    &r.machine_id,
                    r.cluster_id,
                    r.bootstrap_blob,
                    metadata,
                    token(r.shard_id, r.shard_epoch, r.sequence_number),
                )
                .await?;
            Ok(Response::new(ack(a)))
        })
        .await
    }

    async fn drain(
        &self,
        request: Request<pb::DrainRequest>,
    ) -> Result<Response<pb::TransitionAck>, Status> {
        let peer = peer_certificates(&request);
        let r = request.into_inner();
        let (replica, guard) = (self.replica.clone(), self.shard_identity.clone());
        let id = r.machine_id.clone();
        observe(self.telemetry, "Drain", &id, async move {
            guard.admit(
                "Drain",
                &r.machine_id,
                peer.as_deref().map(Vec::as_slice),
                &r.shard_id,
            )?;
            let engine = replica.writer()?;
            let a = engine
                .drain(
                    &r.machine_id,
                    r.grace_period_seconds,
                    token(r.shard_id, r.shard_epoch, r.sequence_number),
                )
                .await?;
            Ok(Response::new(ack(a)))
        })
        .await
    }

    async fn delete(
        &self,
        request: Request<pb::DeleteRequest>,
    ) -> Result<Response<pb::TransitionAck>, Status> {
        let peer = peer_certificates(&request);
        let r = request.into_inner();
        let (replica, guard) = (self.replica.clone(), self.shard_identity.clone());
        let id = r.machine_id.clone();
        observe(self.telemetry, "Delete", &id, async move {
            guard.admit(
                "Delete",
                &r.machine_id,
                peer.as_deref().map(Vec::as_slice),
                &r.shard_id,
            )?;
            let engine = replica.writer()?;
            let a = engine
                .delete(
                    &r.machine_id,
                    token(r.shard_id, r.shard_epoch, r.sequence_number),
                )
                .await?;
            Ok(Response::new(ack(a)))
        })
        .await
    }

    /// Get as a built message. [`Routes`] serves Get with [`Service::get_encoded`] instead;
    /// both answer the same bytes.
    async fn get(&self, request: Request<pb::MachineRef>) -> Result<Response<pb::Machine>, Status> {
        let id = request.into_inner().id;
        let replica = self.replica.clone();
        observe(self.telemetry, "Get", &id.clone(), async move {
            let engine = replica.reader()?;
            let m = match engine.settle(engine.get_durable(&id)?).await {
                Ok(m) => m,
                // The store stopped before this change was durable (degraded: etcd is down
                // for everyone): the machine as the store holds it.
                Err(e) => engine.acknowledged_get(&id).ok_or(e)?,
            };
            Ok(Response::new(machine_to_wire(&m)))
        })
        .await
    }

    async fn list(
        &self,
        request: Request<pb::ListFilter>,
    ) -> Result<Response<pb::MachineList>, Status> {
        let r = request.into_inner();
        let replica = self.replica.clone();
        observe(self.telemetry, "List", "", async move {
            let engine = replica.reader()?;
            let query = ListQuery {
                // Unknown state numbers match nothing, like UNSPECIFIED.
                states: r
                    .states
                    .iter()
                    .map(|s| MachineState::from_wire(*s).unwrap_or(MachineState::Unspecified))
                    .collect(),
                max_results: r.max_results,
                since_revision: r.since_revision,
            };
            let listing = match engine.settle(engine.list_durable(&query)).await {
                Ok(listing) => listing,
                // The store stopped before the head was durable (degraded): the listing as
                // the store holds it, at the last revision it confirmed.
                Err(e) => engine.acknowledged_list(&query).ok_or(e)?,
            };
            // Each machine is encoded once per change and reused by every later List and Get.
            let encoded = listing.machines.iter().map(|m| wire_bytes(m)).collect();
            Ok(Response::new(pb::MachineList {
                machines: Vec::new(),
                revision: listing.revision.to_string().into_bytes(),
                encoded,
            }))
        })
        .await
    }
}

impl Service {
    /// Get's answer as the encoded machine: the bytes kept with the machine since its last
    /// change, encoded here only if no List or Get needed them since.
    /// Answered at once when the machine's last change is durable (the common case), else once
    /// its commit lands.
    pub fn get_encoded(&self, id: String) -> EncodedAnswer {
        let telemetry = self.telemetry;
        let started = Instant::now();
        let read = std::panic::catch_unwind(AssertUnwindSafe(|| {
            let engine = self.replica.reader()?;
            let read = engine.get_durable(&id)?;
            Ok::<_, Status>((engine, read))
        }));
        let result = match read {
            Ok(Ok((_, Durable::Now(m)))) => Ok(Encoded(wire_bytes(&m))),
            Ok(Ok((engine, later))) => {
                return Either::Right(Box::pin(async move {
                    let result = engine
                        .settle(later)
                        .await
                        .map(|m| Encoded(wire_bytes(&m)))
                        .map_err(Status::from);
                    record(telemetry, "Get", &id, started, result)
                }));
            }
            Ok(Err(status)) => Err(status),
            Err(panic) => Err(recovered(telemetry, "Get", panic)),
        };
        Either::Left(std::future::ready(record(
            telemetry, "Get", &id, started, result,
        )))
    }
}

/// Get's answer: ready now, or once the change it shows is durable.
pub type EncodedAnswer =
    Either<std::future::Ready<Result<Encoded, Status>>, BoxFuture<Encoded, Status>>;

/// The gRPC path of Get.
const GET_PATH: &str = "/bigfleet.v1alpha1.CapacityProvider/Get";

/// The `CapacityProvider` service as served: Get answers with the machine's encoded bytes
/// ([`Service::get_encoded`]) without building a `pb::Machine`; every other method goes to
/// the generated server. The bytes on the wire are those the generated Get would send.
#[derive(Debug, Clone)]
pub struct Routes {
    service: Arc<Service>,
    generated: CapacityProviderServer<Service>,
}

impl Routes {
    pub fn new(replica: Arc<Replica>, shard_identity: ShardIdentity) -> Routes {
        let service = Arc::new(Service::new(replica, shard_identity));
        Routes {
            generated: CapacityProviderServer::from_arc(service.clone()),
            service,
        }
    }
}

impl NamedService for Routes {
    const NAME: &'static str = fleet_proto::SERVICE_NAME;
}

impl<B> tower::Service<http::Request<B>> for Routes
where
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if request.uri().path() != GET_PATH {
            return self.generated.call(request);
        }
        let get = EncodedGet(self.service.clone());
        Box::pin(async move {
            // The generated Get's codec settings: no compression, default message limits.
            let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::<
                Encoded,
                pb::MachineRef,
            >::default());
            Ok(grpc.unary(get, request).await)
        })
    }
}

/// Get answered from the cached encoding.
struct EncodedGet(Arc<Service>);

impl UnaryService<pb::MachineRef> for EncodedGet {
    type Response = Encoded;
    type Future = futures_util::future::MapOk<EncodedAnswer, fn(Encoded) -> Response<Encoded>>;

    fn call(&mut self, request: Request<pb::MachineRef>) -> Self::Future {
        let id = request.into_inner().id;
        self.0.get_encoded(id).map_ok(Response::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panicking_handler_answers_internal_and_the_process_lives_on() {
        let telemetry = Telemetry::new("bigfleet_servertest");
        let result: Result<(), Status> =
            observe(telemetry, "Get", "m", async { panic!("boom in handler") }).await;
        let status = result.unwrap_err();
        assert_eq!(status.code(), Code::Internal);
        assert_eq!(status.message(), "internal error");
        let ok: Result<u8, Status> = observe(telemetry, "Get", "m", async { Ok(7) }).await;
        assert_eq!(ok.unwrap(), 7);
    }

    #[test]
    fn wire_shape_omits_empty_host_and_resources() {
        let m = Machine::speculative("m", "cx22");
        let wire = machine_to_wire(&m);
        assert!(wire.host.is_none());
        assert!(wire.resources.is_none() && wire.allocatable.is_none());
        let mut m = m;
        m.host = Some(crate::HostRef {
            provider: "hetzner".into(),
            id: "42".into(),
        });
        m.resources.insert("cpu".into(), "1".into());
        let wire = machine_to_wire(&m);
        assert_eq!(wire.host.unwrap().r#ref, "42");
        assert_eq!(wire.resources.unwrap().resources["cpu"], "1");
    }
}

#[cfg(test)]
mod wire_tests;

//! The listeners: the gRPC server (CapacityProvider, grpc.health.v1, reflection) over plain TCP
//! or TLS 1.3, with the reference keepalive settings, and the HTTP observability server with
//! `/metrics`, `/healthz`, `/readyz` and `/readyz/replica`.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::any;
use tokio::net::TcpListener;
use tokio_stream::StreamExt as _;
use tonic::transport::Server;
use tonic_health::ServingStatus;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::server::HealthReporter;

use crate::observability::telemetry::{self, Telemetry};
use crate::runtime::replica::Replica;
use crate::security::identity::ShardIdentity;
use crate::wire::listener;
use crate::wire::server::Routes;

/// Readiness as `/readyz` reports it.
#[derive(Debug, Default, Clone)]
pub struct Readiness(Arc<AtomicBool>);

impl Readiness {
    pub fn set(&self, ready: bool) {
        self.0.store(ready, Ordering::SeqCst);
    }

    pub fn get(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// Health of the gRPC port: the overall service "" and the CapacityProvider service.
#[derive(Clone)]
pub struct GrpcHealth(HealthReporter);

impl std::fmt::Debug for GrpcHealth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GrpcHealth")
    }
}

impl GrpcHealth {
    pub async fn set(&self, serving: bool) {
        let status = if serving {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        self.0.set_service_status("", status).await;
        self.0
            .set_service_status(fleet_proto::SERVICE_NAME, status)
            .await;
    }
}

/// What one gRPC client can hold, and for how long (docs/limits.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GrpcLimits {
    /// Open connections, TLS handshakes in progress included; more are closed at accept.
    pub max_connections: usize,
    /// HTTP/2 streams (concurrent RPCs) per connection, advertised in SETTINGS.
    pub max_concurrent_streams: u32,
    /// How long one RPC may take, reading its request included; then CANCELLED.
    pub request_timeout: Duration,
    /// Age after which a connection is asked to go away (GOAWAY); zero: no limit.
    pub max_connection_age: Duration,
    /// How long a new connection may take to send its first bytes (plaintext) or to finish
    /// the TLS handshake and then send its first bytes (TLS).
    pub handshake_timeout: Duration,
}

impl Default for GrpcLimits {
    fn default() -> GrpcLimits {
        GrpcLimits {
            max_connections: 1024,
            max_concurrent_streams: 256,
            request_timeout: Duration::from_secs(60),
            max_connection_age: Duration::from_secs(3600),
            handshake_timeout: Duration::from_secs(10),
        }
    }
}

impl GrpcLimits {
    /// After GOAWAY, in-flight RPCs may finish within their own timeout; then the connection is
    /// closed whatever the client does (a client that never reads its answers included).
    pub fn max_connection_age_grace(&self) -> Duration {
        self.request_timeout + Duration::from_secs(5)
    }
}

/// Serves gRPC on `listener` until `shutdown` completes. `shard_identity` is what mutations
/// whose client certificate does not prove their shard get ([`ShardIdentity::Off`] unless `tls`
/// verifies client certificates: see [`ShardIdentity::resolve`]).
#[allow(clippy::too_many_arguments)]
pub async fn serve_grpc(
    listener: TcpListener,
    tls: Option<crate::security::tls::GrpcTls>,
    shard_identity: ShardIdentity,
    replica: Arc<Replica>,
    reflection: bool,
    health_service: HealthServer<ObservedHealth>,
    limits: GrpcLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), String> {
    let telemetry = replica.telemetry();
    // Connections end when a replica stops serving, so clients move to the leader; the only
    // replica (local state) always serves.
    let roles =
        (replica.role() != crate::runtime::replica::Role::Single).then(|| replica.subscribe());
    let service = Routes::new(replica.clone(), shard_identity);
    let mut builder = Server::builder()
        .layer(tower::util::MapResponseLayer::new(
            oversize_is_resource_exhausted,
        ))
        .layer(ReplicaLayer(replica.clone()))
        // The reference's keepalive: a ping every 2h, a dead peer dropped 20s later. tonic
        // 0.14 offers no enforcement of the client's ping rate (grpc-go's EnforcementPolicy);
        // hyper bounds the reset-stream and header abuse instead, with its defaults.
        .http2_keepalive_interval(Some(Duration::from_secs(2 * 3600)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .max_concurrent_streams(limits.max_concurrent_streams)
        .timeout(limits.request_timeout)
        .tcp_nodelay(true);
    if !limits.max_connection_age.is_zero() {
        builder = builder
            .max_connection_age(limits.max_connection_age)
            .max_connection_age_grace(limits.max_connection_age_grace());
    }
    let reflection_v1 = if reflection {
        Some(
            tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(fleet_proto::FILE_DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
                .build_v1()
                .map_err(|e| format!("reflection: {e}"))?,
        )
    } else {
        None
    };
    let reflection_v1alpha = if reflection {
        Some(
            tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(fleet_proto::FILE_DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
                .build_v1alpha()
                .map_err(|e| format!("reflection: {e}"))?,
        )
    } else {
        None
    };
    let router = builder
        .add_service(health_service)
        .add_service(service)
        .add_optional_service(reflection_v1)
        .add_optional_service(reflection_v1alpha);
    let result = match tls {
        Some(config) => {
            // The TLS handshake has its own deadline; the connection's first bytes after it
            // get one too.
            let accepted =
                listener::accept(listener, limits.max_connections, None, roles, telemetry);
            let handshake = limits.handshake_timeout;
            let incoming = crate::security::tls::incoming(accepted, config, handshake)
                .map(move |tls| tls.map(|s| listener::Limited::first_bytes_within(s, handshake)));
            router
                .serve_with_incoming_shutdown(incoming, shutdown)
                .await
        }
        None => {
            let accepted = listener::accept(
                listener,
                limits.max_connections,
                Some(limits.handshake_timeout),
                roles,
                telemetry,
            );
            router
                .serve_with_incoming_shutdown(listener::plaintext(accepted), shutdown)
                .await
        }
    };
    result.map_err(|e| format!("gRPC server: {e}"))
}

/// Hands every gRPC request the replica it reaches, so the health service can ask it per
/// request whether it serves right now (see [`ObservedHealth`]).
#[derive(Clone)]
struct ReplicaLayer(Arc<Replica>);

impl<S> tower::Layer<S> for ReplicaLayer {
    type Service = WithReplica<S>;

    fn layer(&self, inner: S) -> WithReplica<S> {
        WithReplica {
            inner,
            replica: self.0.clone(),
        }
    }
}

/// The replica a request reached, in its extensions.
#[derive(Clone)]
struct Reached(Arc<Replica>);

#[derive(Clone)]
struct WithReplica<S> {
    inner: S,
    replica: Arc<Replica>,
}

impl<S, B> tower::Service<http::Request<B>> for WithReplica<S>
where
    S: tower::Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        request
            .extensions_mut()
            .insert(Reached(self.replica.clone()));
        self.inner.call(request)
    }
}

/// The health service, with `Check` logged and counted like every other unary RPC (the
/// reference's `<prefix>_grpc_requests_total{method="Check"}`). `Check` of the server or of
/// CapacityProvider also asks the replica whether it serves at this instant: a leader whose
/// claim lapsed (paused past its lease, cut off from etcd) answers NOT_SERVING from its first
/// request after the lapse, before its role changes and the reported status follows.
pub struct ObservedHealth {
    inner: tonic_health::server::HealthService,
    telemetry: Telemetry,
}

#[tonic::async_trait]
impl Health for ObservedHealth {
    async fn check(
        &self,
        request: tonic::Request<tonic_health::pb::HealthCheckRequest>,
    ) -> Result<tonic::Response<tonic_health::pb::HealthCheckResponse>, tonic::Status> {
        let lapsed = request
            .extensions()
            .get::<Reached>()
            .is_some_and(|Reached(replica)| !replica.serves_now());
        let ours = matches!(
            request.get_ref().service.as_str(),
            "" | fleet_proto::SERVICE_NAME
        );
        if lapsed && ours {
            let answer = async {
                Ok(tonic::Response::new(
                    tonic_health::pb::HealthCheckResponse {
                        status: tonic_health::pb::health_check_response::ServingStatus::NotServing
                            as i32,
                    },
                ))
            };
            return crate::wire::server::observe(self.telemetry, "Check", "", answer).await;
        }
        crate::wire::server::observe(self.telemetry, "Check", "", self.inner.check(request)).await
    }

    type WatchStream = <tonic_health::server::HealthService as Health>::WatchStream;

    async fn watch(
        &self,
        request: tonic::Request<tonic_health::pb::HealthCheckRequest>,
    ) -> Result<tonic::Response<Self::WatchStream>, tonic::Status> {
        self.inner.watch(request).await
    }
}

/// A fresh health reporter and service, initially NOT_SERVING.
pub async fn grpc_health(telemetry: Telemetry) -> (GrpcHealth, HealthServer<ObservedHealth>) {
    let (reporter, _) = tonic_health::server::health_reporter();
    let inner = tonic_health::server::HealthService::from_health_reporter(reporter.clone());
    let health = GrpcHealth(reporter);
    health.set(false).await;
    (
        health,
        HealthServer::new(ObservedHealth { inner, telemetry }),
    )
}

/// tonic refuses a request over the receive limit with OUT_OF_RANGE; gRPC (and BigFleet's
/// client) expect RESOURCE_EXHAUSTED for it, as the reference answers.
fn oversize_is_resource_exhausted<B>(mut response: http::Response<B>) -> http::Response<B> {
    let headers = response.headers_mut();
    let out_of_range = headers.get("grpc-status").is_some_and(|v| v == "11");
    let too_large = headers
        .get("grpc-message")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|m| m.starts_with("Error,%20decoded%20message%20length%20too%20large"));
    if out_of_range && too_large {
        headers.insert("grpc-status", http::HeaderValue::from_static("8"));
    }
    response
}

#[derive(Clone)]
struct HttpState {
    ready: Readiness,
    replica: Arc<Replica>,
    telemetry: Telemetry,
    handle: metrics_exporter_prometheus::PrometheusHandle,
}

async fn healthz() -> &'static str {
    "ok\n"
}

/// 200 while this replica serves at this instant (a leader whose claim lapsed does not, before
/// its role changes).
async fn readyz(State(state): State<HttpState>) -> (StatusCode, &'static str) {
    if state.ready.get() && state.replica.serves_now() {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}

/// For the pods of a replicated Deployment: ready when this replica serves (`/readyz`) or is a
/// standby whose copy of the state follows etcd, so it can take over in about the lease TTL.
/// Routing to the leader is the leader label's job (docs/ha.md).
async fn readyz_replica(State(state): State<HttpState>) -> (StatusCode, &'static str) {
    if state.ready.get() {
        (StatusCode::OK, "ready\n")
    } else if state.replica.role() == crate::runtime::replica::Role::Standby && state.replica.warm()
    {
        (StatusCode::OK, "warm standby\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}

async fn metrics(
    State(state): State<HttpState>,
) -> ([(axum::http::HeaderName, &'static str); 1], String) {
    state.telemetry.readiness(state.ready.get());
    if let Some(engine) = state.replica.engine() {
        let census = engine.census();
        state
            .telemetry
            .census(&census.by_state, census.failed_with_host, &census.retired);
    }
    state.handle.run_upkeep();
    let mut body = state.handle.render();
    body.push_str(&process_metrics());
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
}

/// `process_*` series read from /proc, like the Prometheus process collector.
fn process_metrics() -> String {
    let mut out = String::new();
    if let Ok(status) = std::fs::read_to_string("/proc/self/status") {
        for (key, name) in [
            ("VmRSS:", "process_resident_memory_bytes"),
            ("VmHWM:", "process_resident_memory_max_bytes"),
        ] {
            if let Some(kb) = status
                .lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
            {
                out.push_str(&format!("# TYPE {name} gauge\n{name} {}\n", kb * 1024));
            }
        }
    }
    if let Ok(stat) = std::fs::read_to_string("/proc/self/stat") {
        // Fields after the command name: utime and stime are fields 14 and 15 (1-based).
        if let Some(rest) = stat.rsplit(')').next() {
            let fields: Vec<&str> = rest.split_whitespace().collect();
            let ticks = |i: usize| {
                fields
                    .get(i)
                    .and_then(|v| v.parse::<f64>().ok())
                    .unwrap_or(0.0)
            };
            let seconds = (ticks(11) + ticks(12)) / 100.0;
            out.push_str(&format!(
                "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total {seconds}\n"
            ));
        }
    }
    if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
        out.push_str(&format!(
            "# TYPE process_open_fds gauge\nprocess_open_fds {}\n",
            fds.count()
        ));
    }
    out
}

/// Serves `/metrics`, `/healthz`, `/readyz` and `/readyz/replica` until `shutdown` completes.
pub async fn serve_http(
    listener: TcpListener,
    ready: Readiness,
    replica: Arc<Replica>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let telemetry = replica.telemetry();
    let state = HttpState {
        ready,
        replica,
        telemetry,
        handle: telemetry::recorder(),
    };
    let app = Router::new()
        .route("/healthz", any(healthz))
        .route("/readyz", any(readyz))
        .route("/readyz/replica", any(readyz_replica))
        .route("/metrics", any(metrics))
        .with_state(state);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provisioning::offerings::default_mix;
    use crate::runtime::engine::{Engine, EngineOptions};

    async fn engine() -> Arc<Engine> {
        let (_, fleet) =
            crate::provisioning::fleet::test_fleet(default_mix(8, ["a", "b"], ["z1", "z2"]));
        let options = EngineOptions::new(Telemetry::new("bigfleet_servetest"));
        Engine::start(
            Arc::new(fleet),
            Arc::new(crate::persistence::store::MemoryStore),
            options,
        )
        .await
        .unwrap()
    }

    #[tokio::test]
    async fn health_readiness_and_metrics_over_http() {
        let engine = engine().await;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let ready = Readiness::default();
        let stop = tokio_util::sync::CancellationToken::new();
        let server = {
            let stop = stop.clone();
            tokio::spawn(serve_http(
                listener,
                ready.clone(),
                crate::runtime::replica::Replica::single(engine.clone()),
                async move { stop.cancelled().await },
            ))
        };
        let client = reqwest::Client::new();
        let get = |path: &str| {
            let client = client.clone();
            let url = format!("http://{addr}{path}");
            async move {
                let r = client.get(url).send().await.unwrap();
                (r.status().as_u16(), r.text().await.unwrap())
            }
        };
        assert_eq!(get("/healthz").await, (200, "ok\n".into()));
        assert_eq!(get("/readyz").await, (503, "not ready\n".into()));
        ready.set(true);
        assert_eq!(get("/readyz").await, (200, "ready\n".into()));
        assert_eq!(get("/readyz/replica").await, (200, "ready\n".into()));
        let id = engine.spare_of("a", "z1")[0].clone();
        engine
            .create(
                &id,
                crate::FenceToken {
                    shard_id: String::new(),
                    epoch: 0,
                    sequence: 0,
                },
            )
            .await
            .unwrap();
        let (status, body) = get("/metrics").await;
        assert_eq!(status, 200);
        assert!(
            body.contains("bigfleet_servetest_machines{state=\"Speculative\"} 7"),
            "{body}"
        );
        assert!(
            body.contains("bigfleet_servetest_failed_machines_with_host 0"),
            "{body}"
        );
        assert!(body.contains("process_resident_memory_bytes"), "{body}");
        assert_eq!(get("/nope").await.0, 404);
        ready.set(false);
        assert_eq!(
            get("/readyz").await.0,
            503,
            "readiness goes false on shutdown"
        );
        assert_eq!(get("/readyz/replica").await.0, 503);
        stop.cancel();
        server.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn replica_readiness_passes_warm_standbys_and_readyz_does_not() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let ready = Readiness::default();
        let replica = crate::runtime::replica::Replica::standby(
            Telemetry::new("bigfleet_servetest"),
            crate::runtime::replica::Leading::default(),
        );
        let stop = tokio_util::sync::CancellationToken::new();
        let server = {
            let stop = stop.clone();
            tokio::spawn(serve_http(
                listener,
                ready.clone(),
                replica.clone(),
                async move { stop.cancelled().await },
            ))
        };
        let client = reqwest::Client::new();
        let get = |path: &str| {
            let client = client.clone();
            let url = format!("http://{addr}{path}");
            async move {
                let r = client.get(url).send().await.unwrap();
                (r.status().as_u16(), r.text().await.unwrap())
            }
        };
        assert_eq!(get("/readyz/replica").await.0, 503, "a cold standby");
        replica
            .warmth()
            .store(true, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(get("/readyz/replica").await, (200, "warm standby\n".into()));
        assert_eq!(get("/readyz").await.0, 503, "/readyz stays the leader's");
        stop.cancel();
        server.await.unwrap().unwrap();
    }
}

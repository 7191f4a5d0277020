//! The floor: the least a server of `bigfleet.v1alpha1.CapacityProvider` can do per call on
//! this stack (tokio, tonic, hyper, h2, prost). It answers Get with one machine encoded once at
//! start (whatever the id) and List with that machine `--seed-count` times, also pre-encoded;
//! every other method is UNIMPLEMENTED. It runs as a process of its own
//! (`xtask bench --floor-server`), on the provider's runtime (tokio's multi-thread default)
//! and HTTP/2 settings, so the bench measures its CPU, memory and latency exactly as it
//! measures the provider's, and prints the provider's figures as ratios to it.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use fleet_proto::encoded::Encoded;
use fleet_proto::v1alpha1 as pb;
use prost::bytes::Bytes;
use tonic::codegen::{BoxFuture, Service, http};
use tonic::server::{NamedService, UnaryService};
use tonic_prost::ProstCodec;

use super::provider::{Provider, list_raw};

/// The flag that turns `xtask bench` into the floor server.
pub const FLAG: &str = "--floor-server";

/// The command line that starts the floor (the bench appends `--addr` and `--seed-count`):
/// `program`, the one that runs this tool, answering with `machine` (one encoded `Machine`).
pub(crate) fn command(program: &[String], machine: &[u8]) -> Vec<String> {
    let hex: String = machine.iter().map(|b| format!("{b:02x}")).collect();
    let mut command = program.to_vec();
    command.extend([FLAG.into(), format!("--machine={hex}")]);
    command
}

/// One machine as the provider under test encodes it, so the floor's answers have the same
/// size: a short-lived start of `ours` at `size` machines and a List capped at one.
pub(crate) async fn sample_machine(ours: &[String], size: usize) -> Result<Bytes> {
    let provider = Provider::start(ours, Some(size), None, None).await?;
    let filter = pb::ListFilter {
        max_results: 1,
        ..pb::ListFilter::default()
    };
    let list = list_raw(&provider.channel, filter).await;
    provider.stop().await?;
    let list = list.context("List (a machine for the floor)")?;
    list.machines
        .into_iter()
        .next()
        .context("the provider listed no machine for the floor to answer with")
}

/// The pre-encoded answers.
#[derive(Debug)]
struct Answers {
    /// `Machine`, for Get.
    machine: Encoded,
    /// `MachineList` of `count` copies of the machine and a revision, for List.
    list: Encoded,
}

impl Answers {
    fn new(machine: Bytes, count: usize) -> Answers {
        let list = pb::MachineList {
            machines: Vec::new(),
            revision: b"1".to_vec(),
            encoded: vec![machine.clone(); count],
        };
        Answers {
            machine: Encoded(machine),
            list: Encoded(Bytes::from(prost::Message::encode_to_vec(&list))),
        }
    }
}

#[derive(Clone, Debug)]
struct Floor(Arc<Answers>);

impl NamedService for Floor {
    const NAME: &'static str = fleet_proto::SERVICE_NAME;
}

/// Get or List: decodes the request (as the provider must), answers with the stored bytes.
struct Answer<Req> {
    bytes: Encoded,
    _request: std::marker::PhantomData<Req>,
}

impl<Req: Send + 'static> UnaryService<Req> for Answer<Req> {
    type Response = Encoded;
    type Future = std::future::Ready<Result<tonic::Response<Encoded>, tonic::Status>>;

    fn call(&mut self, _request: tonic::Request<Req>) -> Self::Future {
        std::future::ready(Ok(tonic::Response::new(self.bytes.clone())))
    }
}

fn answer<Req, B>(
    bytes: &Encoded,
    request: http::Request<B>,
) -> BoxFuture<http::Response<tonic::body::Body>, Infallible>
where
    Req: prost::Message + Default + Send + 'static,
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<tonic::codegen::StdError> + Send + 'static,
{
    let method = Answer::<Req> {
        bytes: bytes.clone(),
        _request: std::marker::PhantomData,
    };
    Box::pin(async move {
        let mut grpc = tonic::server::Grpc::new(ProstCodec::<Encoded, Req>::default())
            .apply_max_message_size_config(None, Some(usize::MAX));
        Ok(grpc.unary(method, request).await)
    })
}

impl<B> Service<http::Request<B>> for Floor
where
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<tonic::codegen::StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, _cx: &mut TaskContext<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        match request.uri().path() {
            "/bigfleet.v1alpha1.CapacityProvider/Get" => {
                answer::<pb::MachineRef, B>(&self.0.machine, request)
            }
            "/bigfleet.v1alpha1.CapacityProvider/List" => {
                answer::<pb::ListFilter, B>(&self.0.list, request)
            }
            _ => Box::pin(async {
                Ok(tonic::Status::unimplemented("the floor answers Get and List only").into_http())
            }),
        }
    }
}

/// `xtask bench --floor-server --machine=HEX --addr=ADDR --seed-count=N`: serves until
/// SIGTERM or SIGINT.
pub(crate) fn serve(args: &[String]) -> Result<()> {
    let mut machine = None;
    let mut addr: Option<SocketAddr> = None;
    let mut count = 0usize;
    for arg in args {
        let Some((name, value)) = arg.split_once('=') else {
            bail!("{FLAG}: expected --name=value, got {arg:?}");
        };
        match name {
            "--machine" => machine = Some(from_hex(value)?),
            "--addr" => {
                addr = Some(
                    value
                        .parse()
                        .with_context(|| format!("{FLAG}: --addr {value:?}"))?,
                )
            }
            "--seed-count" => {
                count = value
                    .parse()
                    .with_context(|| format!("{FLAG}: --seed-count {value:?}"))?
            }
            _ => bail!("{FLAG}: unknown argument {arg:?}"),
        }
    }
    let machine = machine.with_context(|| format!("{FLAG} needs --machine=HEX"))?;
    let addr = addr.with_context(|| format!("{FLAG} needs --addr=HOST:PORT"))?;
    let floor = Floor(Arc::new(Answers::new(Bytes::from(machine), count)));
    // The provider's runtime: tokio's multi-thread default (one worker per CPU).
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("start the floor's runtime")?;
    runtime.block_on(async move {
        let (reporter, health) = tonic_health::server::health_reporter();
        reporter
            .set_service_status(
                fleet_proto::SERVICE_NAME,
                tonic_health::ServingStatus::Serving,
            )
            .await;
        // The provider's HTTP/2 and transport settings (provider_core::serve::serve_grpc).
        tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(Duration::from_secs(2 * 3600)))
            .http2_keepalive_timeout(Some(Duration::from_secs(20)))
            .max_concurrent_streams(256)
            .timeout(Duration::from_secs(60))
            .tcp_nodelay(true)
            .max_connection_age(Duration::from_secs(3600))
            .add_service(health)
            .add_service(floor)
            .serve_with_shutdown(addr, stop_signal())
            .await
            .with_context(|| format!("serve the floor on {addr}"))
    })
}

async fn stop_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

fn from_hex(text: &str) -> Result<Vec<u8>> {
    if !text.len().is_multiple_of(2) || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        bail!("{FLAG}: --machine is not hex");
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).context("hex"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_the_machine_and_a_list_of_copies() {
        let machine = pb::Machine {
            id: "m-1".into(),
            instance_type: "cx23".into(),
            ..pb::Machine::default()
        };
        let bytes = Bytes::from(prost::Message::encode_to_vec(&machine));
        let answers = Answers::new(bytes.clone(), 3);
        let get: pb::Machine = prost::Message::decode(answers.machine.0.clone()).unwrap();
        assert_eq!(get, machine);
        let list: pb::MachineList = prost::Message::decode(answers.list.0.clone()).unwrap();
        assert_eq!(
            list.machines,
            vec![machine.clone(), machine.clone(), machine]
        );
        assert_eq!(list.revision, b"1");
    }

    #[test]
    fn the_machine_travels_as_hex() {
        let program = ["xtask".to_owned(), "bench".to_owned()];
        let cmd = command(&program, &[0x0a, 0xff, 0x00]);
        assert_eq!(cmd[..3], ["xtask", "bench", FLAG]);
        let hex = cmd[3].strip_prefix("--machine=").unwrap();
        assert_eq!(from_hex(hex).unwrap(), vec![0x0a, 0xff, 0x00]);
        assert!(from_hex("0g").is_err());
        assert!(from_hex("abc").is_err());
    }
}

//! `cargo xtask e2e`: the provider binaries as an operator runs them. Builds `hetzner`,
//! `digitalocean` and `faultprovider` (debug), then for each cloud provider on its fake backend:
//!
//! - starts it on free loopback ports with mTLS (the committed `testdata/pki`), its metrics
//!   server on another port, `--fake-latency 50ms`, and waits for SERVING;
//! - checks mTLS is enforced (no client certificate, or one from another CA, is refused), and
//!   the shard identity: a mutation asserting another shard than the client certificate's, or
//!   from the admin certificate, is PERMISSION_DENIED, while reads pass;
//! - walks a machine Create -> Configure -> Drain -> Delete over gRPC, checking each ack, the
//!   transitional and settled states, the cluster binding and shard_metadata echo, the host,
//!   idempotent retries and a fresh operation id for the next cycle;
//! - checks the error paths (InvalidArgument, NotFound, Internal for out-of-position,
//!   FailedPrecondition for a replayed fence token) and a List delta;
//! - checks `/healthz`, `/readyz` and `/metrics` over HTTP;
//! - restarts it (SIGTERM, exit 0, start again) and checks the inventory is re-seeded exactly
//!   as on first boot, without duplicates.
//!
//! Then the real backends against the cloud API emulators, and the shipped alerts and dashboards
//! against a real Prometheus and live scrapes (`e2e/alerts_live.rs`; needs Prometheus and the
//! chart tools of `deploy/ci-setup.sh`).
//!
//! Any deviation ends the run with a non-zero exit and a message naming the provider and the
//! check. [`real_backend_runs`] is where the runs against the cloud API emulators go.

mod alerts_live;
mod digitalocean_production;
pub(crate) mod digitalocean_real;
mod hetzner_production;
pub(crate) mod hetzner_real;
pub(crate) mod provider_process;
pub(crate) mod wire;

use std::collections::{BTreeSet, HashMap};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use fleet_proto::v1alpha1 as pb;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;

use self::provider_process::{Provider, Spec};
use self::wire::{Caller, ClientSecurity, Shard, acked, expect_status, state_of};
use crate::repo;

/// The fake backend's per-transition latency in this run.
const FAKE_LATENCY: &str = "50ms";
/// Slots seeded per provider.
const SEED_COUNT: usize = 8;
/// How long a transition may take to settle (50 ms of fake latency plus scheduling).
const SETTLE: Duration = Duration::from_secs(5);
/// SIGTERM to exit; nothing is in flight, so this is generous.
const STOP_DEADLINE: Duration = Duration::from_secs(30);

/// A cloud provider binary run on its fake backend.
struct Target {
    binary: &'static str,
    /// The prefix of its metric names.
    metrics_prefix: &'static str,
}

const TARGETS: [Target; 2] = [
    Target {
        binary: "hetzner",
        metrics_prefix: "bigfleet_hetzner",
    },
    Target {
        binary: "digitalocean",
        metrics_prefix: "bigfleet_digitalocean",
    },
];

pub(crate) fn run(args: &[String]) -> Result<()> {
    ensure!(args.is_empty(), "usage: cargo xtask e2e");
    let root = repo::root();
    build(&root)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("start the async runtime")?;
    let started = Instant::now();
    runtime.block_on(async {
        for target in &TARGETS {
            let step = Instant::now();
            fake_backend_run(&root, target)
                .await
                .with_context(|| format!("e2e FAILED for {} (fake backend)", target.binary))?;
            println!(
                "e2e: {} on the fake backend: ok ({:.1?})",
                target.binary,
                step.elapsed()
            );
        }
        real_backend_runs(&root).await
    })?;
    println!("e2e: all checks passed in {:.1?}", started.elapsed());
    Ok(())
}

fn build(root: &Path) -> Result<()> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .current_dir(root)
        .args([
            "build",
            "-p",
            "hetzner",
            "-p",
            "digitalocean",
            "-p",
            "faultprovider",
            "-p",
            "hcloud-emulator",
            "-p",
            "do-emulator",
        ])
        .status()
        .context("run cargo build")?;
    ensure!(
        status.success(),
        "cargo build of the provider binaries failed ({status})"
    );
    Ok(())
}

/// The hook for the runs against the real backends pointed at the local cloud API emulators
/// (`crates/hcloud-emulator`, `crates/do-emulator`): the engineers who own them extend this.
/// It runs after the fake-backend runs and must fail the same loud way.
async fn real_backend_runs(root: &Path) -> Result<()> {
    let step = Instant::now();
    hetzner_real::run(root)
        .await
        .context("e2e FAILED for hetzner (real backend against hcloud-emulator)")?;
    println!(
        "e2e: hetzner on its real backend against hcloud-emulator: ok ({:.1?})",
        step.elapsed()
    );
    let step = Instant::now();
    hetzner_production::run(root)
        .await
        .context("e2e FAILED for hetzner (production-shaped servers against hcloud-emulator)")?;
    println!(
        "e2e: hetzner production-shaped servers against hcloud-emulator: ok ({:.1?})",
        step.elapsed()
    );
    let step = Instant::now();
    digitalocean_real::run(root)
        .await
        .context("e2e FAILED for digitalocean (real backend against do-emulator)")?;
    println!(
        "e2e: digitalocean on its real backend against do-emulator: ok ({:.1?})",
        step.elapsed()
    );
    let step = Instant::now();
    digitalocean_production::run(root)
        .await
        .context("e2e FAILED for digitalocean production-shaped (VPC, snapshot, tags, IPv6, monitoring, SSH keys, check)")?;
    println!(
        "e2e: digitalocean production-shaped against do-emulator: ok ({:.1?})",
        step.elapsed()
    );
    let step = Instant::now();
    alerts_live::hetzner_dashboard(root)
        .await
        .context("e2e FAILED for the hetzner dashboard against a live scrape")?;
    alerts_live::run(root)
        .await
        .context("e2e FAILED for the alerts in a real Prometheus")?;
    println!(
        "e2e: the shipped alerts fired and resolved in a real Prometheus: ok ({:.1?})",
        step.elapsed()
    );
    Ok(())
}

fn spec(root: &Path, target: &Target) -> Spec {
    let pki = wire::pki_dir(root);
    let pem = |name: &str| pki.join(name).display().to_string();
    Spec {
        name: target.binary.to_owned(),
        binary: provider_process::target_binary(root, "debug", target.binary),
        args: vec![
            "--use-fake-backend".into(),
            format!("--fake-latency={FAKE_LATENCY}"),
            format!("--seed-count={SEED_COUNT}"),
            format!("--tls-cert={}", pem("server.pem")),
            format!("--tls-key={}", pem("server-key.pem")),
            format!("--tls-ca={}", pem("ca.pem")),
            "--shutdown-grace=5s".into(),
            "--log-level=info".into(),
        ],
        metrics: true,
        security: ClientSecurity::Mtls,
        pki,
    }
}

async fn fake_backend_run(root: &Path, target: &Target) -> Result<()> {
    let spec = spec(root, target);
    let mut provider = provider_process::start(spec.clone()).await?;
    match exercise(&mut provider, target).await {
        Ok(first_boot) => restart(spec, provider, target, first_boot).await,
        Err(e) => Err(anyhow!("{e:#}\nprovider log:\n{}", provider.logs())),
    }
}

/// Everything checked on the first incarnation; returns its first-boot inventory.
async fn exercise(provider: &mut Provider, target: &Target) -> Result<Vec<pb::Machine>> {
    mtls_is_enforced(provider)
        .await
        .context("mTLS enforcement")?;
    let channel = provider.default_channel().await?;
    let mut caller = Caller::new(channel, Shard::new(wire::TEST_SHARD, 1));
    let first_boot = caller.list_all().await?;
    check_seeded(&first_boot, target).context("first-boot inventory")?;
    let ids: Vec<String> = first_boot.iter().map(|m| m.id.clone()).collect();
    shard_identity_is_enforced(provider, &ids[0])
        .await
        .context("shard identity")?;

    walk(&mut caller, &ids[0]).await.context("lifecycle walk")?;
    error_paths(&mut caller, &ids[1], &ids[2])
        .await
        .context("error paths")?;
    list_delta(&mut caller, &ids[3])
        .await
        .context("List delta")?;
    let required: Vec<_> = BASE_SERIES.iter().chain(WALK_SERIES).copied().collect();
    observability(provider, target, &required)
        .await
        .context("HTTP observability")?;
    Ok(first_boot)
}

async fn restart(
    spec: Spec,
    mut provider: Provider,
    target: &Target,
    first_boot: Vec<pb::Machine>,
) -> Result<()> {
    provider
        .stop(STOP_DEADLINE)
        .await
        .context("first incarnation: SIGTERM must exit 0")?;
    let mut provider = provider_process::start(spec).await.context("restart")?;
    let checks = async {
        let channel = provider.default_channel().await?;
        let mut caller = Caller::new(channel, Shard::new(wire::TEST_SHARD, 2));
        let reseeded = caller.list_all().await?;
        check_seeded(&reseeded, target).context("re-seeded inventory")?;
        // Without a state a restart is a new state: the same slots, each under an id of the
        // new state's series, never one the first boot listed (BigFleet's shard may still
        // hold any of those, in a state a new Speculative slot would contradict).
        let shape = |machines: &[pb::Machine]| {
            let mut shapes: Vec<pb::Machine> = machines
                .iter()
                .map(|m| pb::Machine {
                    id: String::new(),
                    ..m.clone()
                })
                .collect();
            shapes.sort_by(|a, b| {
                (&a.instance_type, &a.zone, a.price_per_hour.to_bits()).cmp(&(
                    &b.instance_type,
                    &b.zone,
                    b.price_per_hour.to_bits(),
                ))
            });
            shapes
        };
        ensure!(
            shape(&reseeded) == shape(&first_boot),
            "the slots after a restart differ from the first boot's:\nbefore: {first_boot:#?}\nafter: {reseeded:#?}"
        );
        let before: BTreeSet<&str> = first_boot.iter().map(|m| m.id.as_str()).collect();
        let repeated: Vec<&str> = reseeded
            .iter()
            .map(|m| m.id.as_str())
            .filter(|id| before.contains(id))
            .collect();
        ensure!(
            repeated.is_empty(),
            "a restart without a state listed ids of the first boot again: {repeated:?}"
        );
        observability(&provider, target, BASE_SERIES).await
    };
    if let Err(e) = checks.await {
        return Err(anyhow!(
            "after restart: {e:#}\nprovider log:\n{}",
            provider.logs()
        ));
    }
    provider
        .stop(STOP_DEADLINE)
        .await
        .context("second incarnation: SIGTERM must exit 0")
}

/// A client without a certificate, or with one from an unrelated CA, gets nothing.
async fn mtls_is_enforced(provider: &Provider) -> Result<()> {
    for security in [
        ClientSecurity::Tls,
        ClientSecurity::MtlsOtherCa,
        ClientSecurity::Plaintext,
    ] {
        let outcome = match provider.channel(security).await {
            Err(_) => continue,
            Ok(channel) => wire::health(&channel, "").await,
        };
        match outcome {
            Err(status) if wire::is_transport_refusal(&status) => {}
            other => bail!("a {security:?} client must be refused at the transport, got {other:?}"),
        }
    }
    Ok(())
}

/// Under mTLS a mutation must come from the shard it asserts (`--shard-identity=enforce`, the
/// default): the test client certificate proves `test-shard` and no other, the admin
/// certificate no shard at all; reads stay open to both. The admin's refused token for
/// `test-shard` on `id` is newer than any the walk then sends on `id`, so the walk passing shows
/// it never reached the fence.
async fn shard_identity_is_enforced(provider: &Provider, id: &str) -> Result<()> {
    let mut impostor = Caller::new(
        provider.default_channel().await?,
        Shard::new("another-shard", i64::MAX),
    );
    expect_status(
        impostor.create(id).await,
        Code::PermissionDenied,
        "shard identity: the client certificate is \"bigfleet://shard/test-shard\", but the \
         request asserts shard_id \"another-shard\", which needs bigfleet://shard/another-shard",
    )?;
    let mut admin = Caller::new(
        provider.channel(ClientSecurity::MtlsAdmin).await?,
        Shard::new(wire::TEST_SHARD, i64::MAX),
    );
    ensure!(
        admin.list_all().await?.len() == SEED_COUNT,
        "an admin certificate reads"
    );
    admin.get(id).await?;
    let status = admin
        .delete(id)
        .await
        .err()
        .context("an admin certificate's Delete must be refused")?;
    ensure!(
        status.code() == Code::PermissionDenied,
        "an admin certificate's Delete: {status:?}"
    );
    Ok(())
}

/// The fake backend seeds `SEED_COUNT` Speculative slots `<provider>/OnDemand/<type>/<zone>/<NNN>`.
fn check_seeded(machines: &[pb::Machine], target: &Target) -> Result<()> {
    let ids: BTreeSet<&str> = machines.iter().map(|m| m.id.as_str()).collect();
    ensure!(
        ids.len() == machines.len(),
        "duplicate ids in the inventory: {} machines, {} distinct ids",
        machines.len(),
        ids.len()
    );
    ensure!(
        machines.len() == SEED_COUNT,
        "want {SEED_COUNT} seeded slots, got {}",
        machines.len()
    );
    let prefix = format!("{}/OnDemand/", target.binary);
    for m in machines {
        ensure!(
            m.id.starts_with(&prefix),
            "slot id {:?} lacks {prefix:?}",
            m.id
        );
        ensure!(
            state_of(m) == pb::MachineState::Speculative && m.host.is_none(),
            "{} is not a host-less Speculative slot: {m:?}",
            m.id
        );
        ensure!(
            !m.instance_type.is_empty() && !m.zone.is_empty() && m.price_per_hour > 0.0,
            "{} lacks its type, zone or price: {m:?}",
            m.id
        );
    }
    Ok(())
}

fn expect_ack(ack: &pb::TransitionAck, state: pb::MachineState) -> Result<()> {
    let machine = acked(ack);
    ensure!(
        !ack.operation_id.is_empty(),
        "ack without an operation id: {ack:?}"
    );
    ensure!(
        state_of(machine) == state,
        "ack shows {:?}, want {state:?}",
        state_of(machine)
    );
    Ok(())
}

/// Create -> Idle -> Configure -> Configured -> Drain -> Idle -> Delete -> Speculative, then a
/// new cycle with a fresh operation id.
async fn walk(caller: &mut Caller, id: &str) -> Result<()> {
    use pb::MachineState::*;
    let create = caller.create(id).await?;
    expect_ack(&create, Creating)?;
    ensure!(acked(&create).host.is_none(), "Creating ack carries a host");
    let retry = caller.create(id).await?;
    ensure!(
        retry.operation_id == create.operation_id,
        "a retried Create got a new operation id: {} then {}",
        create.operation_id,
        retry.operation_id
    );
    let idle = caller.wait_for_state(id, Idle, SETTLE).await?;
    ensure!(idle.host.is_some(), "Idle without a host: {idle:?}");

    let metadata = HashMap::from([
        ("bigfleet.io/shard".to_owned(), "e2e".to_owned()),
        ("ünïcødé ✓".to_owned(), "値🚀".to_owned()),
        ("empty".to_owned(), String::new()),
    ]);
    let configure = caller
        .configure(id, "e2e-cluster", metadata.clone())
        .await?;
    expect_ack(&configure, Configuring)?;
    ensure!(
        acked(&configure).cluster == "e2e-cluster" && acked(&configure).shard_metadata == metadata,
        "Configure ack does not echo the binding: {configure:?}"
    );
    let configured = caller.wait_for_state(id, Configured, SETTLE).await?;
    ensure!(
        configured.cluster == "e2e-cluster" && configured.shard_metadata == metadata,
        "Configured machine lost its binding: {configured:?}"
    );

    let drain = caller.drain(id).await?;
    expect_ack(&drain, Draining)?;
    ensure!(
        acked(&drain).cluster == "e2e-cluster",
        "the Drain ack must still carry the cluster: {drain:?}"
    );
    let drained = caller.wait_for_state(id, Idle, SETTLE).await?;
    ensure!(
        drained.cluster.is_empty() && drained.shard_metadata.is_empty() && drained.host.is_some(),
        "a drained machine must keep its host and drop its binding: {drained:?}"
    );

    let delete = caller.delete(id).await?;
    expect_ack(&delete, Deleting)?;
    let deleted = caller.wait_for_state(id, Speculative, SETTLE).await?;
    ensure!(
        deleted.host.is_none(),
        "Speculative with a host: {deleted:?}"
    );

    let again = caller.create(id).await?;
    expect_ack(&again, Creating)?;
    ensure!(
        again.operation_id != create.operation_id,
        "a new cycle reused operation id {}",
        create.operation_id
    );
    caller.wait_for_state(id, Idle, SETTLE).await?;
    Ok(())
}

async fn error_paths(caller: &mut Caller, speculative: &str, fenced: &str) -> Result<()> {
    expect_status(caller.get("").await, Code::InvalidArgument, "id required")?;
    expect_status(
        caller.create("").await,
        Code::InvalidArgument,
        "machine_id required",
    )?;
    expect_status(
        caller.get("no-such-machine").await,
        Code::NotFound,
        "machine \"no-such-machine\" not found",
    )?;
    expect_status(
        caller.create("no-such-machine").await,
        Code::NotFound,
        "providerkit: machine not found: no-such-machine",
    )?;
    expect_status(
        caller.configure(speculative, "c", HashMap::new()).await,
        Code::Internal,
        "providerkit: invalid state transition: cannot configure a machine in state Speculative",
    )?;
    expect_status(
        caller.drain(speculative).await,
        Code::Internal,
        "providerkit: invalid state transition: cannot drain a machine in state Speculative",
    )?;

    // A zombie replaying the token of an accepted request is fenced.
    let token = caller.shard.next();
    let request = wire::create_request(fenced, token.clone());
    caller.client.create(request.clone()).await?;
    let message = format!(
        "providerkit: request fenced (stale shard token): shard \"{}\" sent (epoch={} seq={}) for machine \"{fenced}\"; high-water mark is (epoch={} seq={})",
        token.0, token.1, token.2, token.1, token.2
    );
    expect_status(
        caller.client.create(request).await.map(|r| r.into_inner()),
        Code::FailedPrecondition,
        &message,
    )?;
    caller
        .wait_for_state(fenced, pb::MachineState::Idle, SETTLE)
        .await?;
    expect_status(
        caller.drain(fenced).await,
        Code::Internal,
        "providerkit: invalid state transition: cannot drain a machine in state Idle",
    )?;
    Ok(())
}

/// A List cursor yields only what changed after it, and an empty delta with the same head when
/// nothing did.
async fn list_delta(caller: &mut Caller, id: &str) -> Result<()> {
    let head = caller.list(pb::ListFilter::default()).await?.revision;
    let quiet = caller
        .list(pb::ListFilter {
            since_revision: head.clone(),
            ..Default::default()
        })
        .await?;
    ensure!(
        quiet.machines.is_empty() && quiet.revision == head,
        "no change since the cursor must give an empty delta with the same head: {quiet:?}"
    );
    caller.create(id).await?;
    let delta = caller
        .list(pb::ListFilter {
            since_revision: head,
            ..Default::default()
        })
        .await?;
    let ids: Vec<&str> = delta.machines.iter().map(|m| m.id.as_str()).collect();
    ensure!(
        ids == [id],
        "the delta after one Create must hold only {id}: {ids:?}"
    );
    caller
        .wait_for_state(id, pb::MachineState::Idle, SETTLE)
        .await?;
    Ok(())
}

/// Series every incarnation exports once it answered a List.
const BASE_SERIES: &[(&str, &[(&str, &str)])] = &[
    ("machines", &[("state", "Speculative")]),
    ("grpc_requests_total", &[("method", "List"), ("code", "OK")]),
    (
        "certificate_not_after_timestamp_seconds",
        &[("certificate", "grpc_server")],
    ),
    (
        "certificate_not_after_timestamp_seconds",
        &[("certificate", "grpc_client_ca")],
    ),
    // Zero from the start under mTLS, for the ShardIdentityRejected alert.
    ("shard_identity_rejected_total", &[("reason", "multiple")]),
];

/// Series the first incarnation must export after the walk and the error paths.
const WALK_SERIES: &[(&str, &[(&str, &str)])] = &[
    (
        "grpc_requests_total",
        &[("method", "Create"), ("code", "OK")],
    ),
    (
        "grpc_requests_total",
        &[("method", "Create"), ("code", "FailedPrecondition")],
    ),
    (
        "grpc_requests_total",
        &[("method", "Get"), ("code", "NotFound")],
    ),
    (
        "grpc_requests_total",
        &[("method", "Create"), ("code", "PermissionDenied")],
    ),
    ("shard_identity_rejected_total", &[("reason", "mismatch")]),
    (
        "transitions_total",
        &[("kind", "delete"), ("outcome", "success")],
    ),
    ("machines", &[("state", "Idle")]),
];

/// Whether the exposition has a sample of `name` carrying every label pair.
fn has_sample(body: &str, name: &str, labels: &[(&str, &str)]) -> bool {
    body.lines().any(|line| {
        line.strip_prefix(name).is_some_and(|rest| {
            rest.starts_with('{')
                && labels
                    .iter()
                    .all(|(key, value)| rest.contains(&format!("{key}=\"{value}\"")))
        })
    })
}

async fn observability(
    provider: &Provider,
    target: &Target,
    required: &[(&str, &[(&str, &str)])],
) -> Result<()> {
    let metrics = provider
        .metrics
        .context("started without a metrics address")?;
    let (status, body) = http_get(metrics, "/healthz")?;
    ensure!(
        status == 200 && body.trim() == "ok",
        "/healthz: {status} {body:?}"
    );
    let (status, body) = http_get(metrics, "/readyz")?;
    ensure!(
        status == 200 && body.trim() == "ready",
        "/readyz: {status} {body:?}"
    );
    let (status, body) = http_get(metrics, "/metrics")?;
    ensure!(status == 200, "/metrics: {status}");
    for (series, labels) in required {
        let name = format!("{}_{series}", target.metrics_prefix);
        ensure!(
            has_sample(&body, &name, labels),
            "/metrics lacks {name} with {labels:?}:\n{body}"
        );
    }
    let ready = format!("{}_ready 1", target.metrics_prefix);
    ensure!(
        body.lines().any(|l| l == ready),
        "/metrics lacks {ready:?}:\n{body}"
    );
    ensure!(
        body.contains("process_resident_memory_bytes"),
        "/metrics lacks the process series:\n{body}"
    );
    let channel = provider.default_channel().await?;
    ensure!(
        wire::health(&channel, fleet_proto::SERVICE_NAME).await? == ServingStatus::Serving,
        "the CapacityProvider service is not SERVING"
    );
    Ok(())
}

/// `GET path` over HTTP/1.1 on loopback: (status, body).
pub(crate) fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    let mut conn = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .with_context(|| format!("connect to {addr}"))?;
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        conn,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    conn.read_to_string(&mut response)
        .with_context(|| format!("read the answer to GET {path}"))?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .with_context(|| format!("malformed HTTP response: {response:?}"))?;
    let status = head
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
        .with_context(|| format!("no status line in {head:?}"))?;
    Ok((status, body.to_owned()))
}

//! `faultprovider`: a CapacityProvider on provider-core whose in-memory backend injects faults
//! on command, driven purely over the wire, so our core's failure, timeout and recovery
//! handling can be certified black-box. Triggers:
//!
//! - Create of a machine labelled `conformance.fault/create=error` (`faultcreate-N`) fails;
//! - Configure with cluster_id `fault-error` fails at once, `fault-timeout` blocks until the
//!   deadline, `fault-slow-ok` ignores the deadline and succeeds late (the late success must be
//!   discarded), `fault-readiness-block` configures but never confirms readiness, and
//!   `fault-drain-error` makes the following Drain fail.

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use clap::Parser;
use provider_core::app::{self, Launch};
use provider_core::config::{CommonArgs, LogFormat, init_logging};
use provider_core::duration;
use provider_core::inventory::Effect;
use provider_core::serve::GrpcLimits;
use provider_core::telemetry::Telemetry;
use provider_core::{
    Backend, BackendError, CapacityType, ConfigureOrder, HostRef, Machine, StringMap,
    TransitionContext,
};

const CREATE_FAULT_LABEL: &str = "conformance.fault/create";
const CREATE_FAULT_VALUE: &str = "error";

/// Fault-injecting capacity provider for conformance runs.
#[derive(Parser, Debug)]
#[command(name = "faultprovider", version, about)]
struct Cli {
    /// gRPC listen address.
    #[arg(long, default_value = ":9400")]
    addr: String,
    /// Provider name stamped on HostRefs and slot ids.
    #[arg(long, default_value = "fault")]
    provider: String,
    /// Speculative slots to seed (plus 8 create-fault slots).
    #[arg(long = "seed-count", default_value_t = 64)]
    seed_count: usize,
    /// Deadline of every transition (short, so timeout tests are fast).
    #[arg(long = "transition-timeout", default_value = "2s", value_parser = duration::flag)]
    transition_timeout: Duration,
    /// Durable state: a directory, or etcd://HOST:PORT[,…]/PREFIX shared by replicas (one
    /// leads, the others stand by); empty keeps state in memory.
    #[arg(long, default_value = "")]
    state: String,
    /// Keys that seal the blob of a Configure in flight into the state, so a restart or a
    /// takeover resumes it (one base64 32-byte key per line, the current one first).
    #[arg(long = "state-encryption-key-file", default_value = "")]
    state_encryption_key_file: String,
    /// `/metrics`, `/healthz` and `/readyz` listen address; empty disables them.
    #[arg(long = "metrics-addr", default_value = "")]
    metrics_addr: String,
    #[command(flatten)]
    etcd: provider_core::etcd::EtcdArgs,
    #[command(flatten)]
    leader_label: provider_core::leader_label::LeaderLabelArgs,
}

struct FaultBackend {
    provider: String,
    timeout: Duration,
    seeds: Vec<Machine>,
    /// Machine id -> cluster of its last successful configure.
    bound: Mutex<HashMap<String, String>>,
}

fn seeds(provider: &str, count: usize) -> Vec<Machine> {
    let shape = |id: String| {
        let mut m = Machine::speculative(id, "fault-standard-4");
        m.zone = "fault-zone-a".into();
        m.price_per_hour = 0.40;
        let cap = StringMap::from([
            ("cpu".to_owned(), "4".to_owned()),
            ("memory".to_owned(), "16Gi".to_owned()),
        ]);
        m.resources = cap.clone();
        m.allocatable = cap;
        m
    };
    let mut out: Vec<Machine> = (0..count)
        .map(|i| {
            let mut m = shape(format!("{provider}-spec-{i:03}"));
            if i % 3 == 0 {
                m.capacity_type = CapacityType::Spot;
                m.interruption_probability = 0.05;
                m.price_per_hour = 0.12;
            }
            m.labels
                .insert("fault.conformance/pool".into(), "default".into());
            m
        })
        .collect();
    out.extend((0..8).map(|i| {
        let mut m = shape(format!("faultcreate-{i}"));
        m.labels
            .insert(CREATE_FAULT_LABEL.into(), CREATE_FAULT_VALUE.into());
        m
    }));
    out
}

impl FaultBackend {
    fn bound(&self) -> std::sync::MutexGuard<'_, HashMap<String, String>> {
        self.bound.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[async_trait]
impl Backend for FaultBackend {
    async fn describe(&self) -> Result<Vec<Machine>, BackendError> {
        Ok(self.seeds.clone())
    }

    async fn create(
        &self,
        machine: &Machine,
        _ctx: &TransitionContext,
    ) -> Result<Effect, BackendError> {
        if machine.labels.get(CREATE_FAULT_LABEL).map(String::as_str) == Some(CREATE_FAULT_VALUE) {
            return Err(BackendError(format!(
                "fault: create injected error for {}",
                machine.id
            )));
        }
        Ok(Effect {
            host: Some(HostRef {
                provider: self.provider.clone(),
                id: format!("host-{}", machine.id),
            }),
            ..Effect::default()
        })
    }

    async fn configure(
        &self,
        machine: &Machine,
        order: &ConfigureOrder,
        ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        match order.cluster_id.as_str() {
            "fault-error" => Err(BackendError(format!(
                "fault: configure injected error for {}",
                machine.id
            ))),
            "fault-timeout" => {
                ctx.cancel.cancelled().await;
                Err(BackendError::new("context deadline exceeded"))
            }
            "fault-slow-ok" => {
                // Deliberately ignores the deadline and succeeds late.
                tokio::time::sleep(self.timeout + Duration::from_secs(1)).await;
                self.bound()
                    .insert(machine.id.clone(), order.cluster_id.clone());
                Ok(())
            }
            cluster => {
                self.bound().insert(machine.id.clone(), cluster.to_owned());
                Ok(())
            }
        }
    }

    fn has_readiness_gate(&self) -> bool {
        true
    }

    async fn confirm_ready(
        &self,
        _machine: &Machine,
        cluster_id: &str,
        ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        if cluster_id == "fault-readiness-block" {
            ctx.cancel.cancelled().await;
            return Err(BackendError::new("node never became Ready"));
        }
        Ok(())
    }

    async fn drain(
        &self,
        machine: &Machine,
        _grace: i64,
        _ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        let cluster = self.bound().get(&machine.id).cloned().unwrap_or_default();
        if cluster == "fault-drain-error" {
            return Err(BackendError(format!(
                "fault: drain injected error for {} (cluster {cluster})",
                machine.id
            )));
        }
        self.bound().remove(&machine.id);
        Ok(())
    }

    async fn delete(
        &self,
        machine: &Machine,
        _ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        self.bound().remove(&machine.id);
        Ok(())
    }
}

fn common(cli: &Cli) -> CommonArgs {
    CommonArgs {
        addr: cli.addr.clone(),
        metrics_addr: cli.metrics_addr.clone(),
        reflection: true,
        use_fake_backend: false,
        offerings: String::new(),
        seed_count: cli.seed_count as i64,
        state: cli.state.clone(),
        state_encryption_key_file: cli.state_encryption_key_file.clone(),
        fail_unreadable_configures: false,
        image: String::new(),
        base_user_data: String::new(),
        price_refresh: Duration::ZERO,
        stockout_backoff: Duration::from_secs(300),
        stockout_backoff_max: Duration::from_secs(1800),
        reconcile_interval: Duration::ZERO,
        orphan_grace: Duration::ZERO,
        create_timeout: cli.transition_timeout,
        configure_timeout: cli.transition_timeout,
        drain_timeout: cli.transition_timeout,
        delete_timeout: cli.transition_timeout,
        shutdown_grace: cli.transition_timeout,
        admin_socket: String::new(),
        tls_cert: String::new(),
        tls_key: String::new(),
        tls_ca: String::new(),
        shard_identity: None,
        log_format: LogFormat::Text,
        log_level: "info".into(),
        fake_latency: Duration::ZERO,
        grpc_max_connections: GrpcLimits::default().max_connections,
        grpc_max_concurrent_streams: GrpcLimits::default().max_concurrent_streams,
        grpc_request_timeout: GrpcLimits::default().request_timeout,
        grpc_max_connection_age: GrpcLimits::default().max_connection_age,
        etcd: cli.etcd.clone(),
        leader_label: cli.leader_label.clone(),
        api_budget_share: provider_core::budget::DEFAULT_SHARE,
        api_reconcile_share: provider_core::budget::DEFAULT_RECONCILE_SHARE,
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(LogFormat::Text, "info");
    let backend = Arc::new(FaultBackend {
        provider: cli.provider.clone(),
        timeout: cli.transition_timeout,
        seeds: seeds(&cli.provider, cli.seed_count),
        bound: Mutex::default(),
    });
    let (addr, provider, seeded, timeout, state) = (
        cli.addr.clone(),
        cli.provider.clone(),
        cli.seed_count,
        duration::format(cli.transition_timeout),
        cli.state.clone(),
    );
    let launch = Launch {
        common: common(&cli),
        backend,
        fleet: None,
        telemetry: Telemetry::new("bigfleet_faultprovider"),
        announce: Box::new(move |security, shard_identity| {
            tracing::info!(
                addr,
                provider,
                seeded,
                transition_timeout = timeout,
                state,
                security = security.name(),
                shard_identity = shard_identity.name(),
                "serving fault CapacityProvider"
            );
        }),
        side_servers: Vec::new(),
        require_zone: false,
        real_backend: false,
        leading: Default::default(),
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("faultprovider: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(app::run(launch)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(err = %e, "faultprovider exited with error");
            ExitCode::FAILURE
        }
    }
}

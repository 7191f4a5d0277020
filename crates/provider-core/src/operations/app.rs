//! Startup and shutdown shared by every provider binary: validate, load state, seed, bind,
//! serve, run the background loops, and on SIGTERM/SIGINT drain in-flight work within the
//! grace before exiting 0.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::observability::telemetry::Telemetry;
use crate::operations::config::{CommonArgs, listen_addr};
use crate::persistence::store::{MemoryStore, SharedStore};
use crate::provisioning::backend::Backend;
use crate::provisioning::fleet::{Fleet, WARMUP_BUDGET};
use crate::runtime::engine::{Engine, EngineOptions};
use crate::runtime::replica::{Leading, Replica};
use crate::security::identity::ShardIdentity;
use crate::security::tls::{self, SecurityMode};
use crate::wire::serve::{self, Readiness};

/// A server that runs beside gRPC (the DigitalOcean bootstrap channel). It binds when called,
/// after the configuration, TLS and state were validated and before gRPC binds, so a taken port
/// fails startup; it stops when the token is cancelled.
pub type SideServer = Box<
    dyn FnOnce(
            CancellationToken,
        ) -> std::pin::Pin<
            Box<
                dyn std::future::Future<Output = Result<tokio::task::JoinHandle<()>, String>>
                    + Send,
            >,
        > + Send,
>;

/// Everything a binary hands to [`run`].
pub struct Launch {
    pub common: CommonArgs,
    pub backend: Arc<dyn Backend>,
    /// The offerings backend, for the price and capacity warm-up and the price refresh loop.
    pub fleet: Option<Arc<Fleet>>,
    pub telemetry: Telemetry,
    /// Logs the startup line ("serving CapacityProvider") with the binary's own fields, the
    /// security mode and, beside it, the shard identity mode (`off` without mTLS).
    pub announce: Box<dyn Fn(SecurityMode, ShardIdentity) + Send>,
    pub side_servers: Vec<SideServer>,
    /// Whether reported records must carry a zone.
    pub require_zone: bool,
    /// Whether the backend acts on a real cloud (not the in-memory fake or a test backend).
    pub real_backend: bool,
    /// Set while this replica serves (always, unless `--state etcd://…` makes it a standby):
    /// side servers consult it per request.
    pub leading: Leading,
}

/// The warning logged when gRPC is served in plain text in front of a real cloud: anyone on the
/// network path can read bootstrap blobs and send lifecycle RPCs that create and delete
/// billable hosts. `None` when TLS is on or the backend is a fake.
pub fn plaintext_warning(security: SecurityMode, real_backend: bool) -> Option<&'static str> {
    (real_backend && security == SecurityMode::Insecure).then_some(
        "gRPC is served in PLAIN TEXT with the real cloud backend: bootstrap blobs travel \
         unencrypted and any client that reaches the port can create and delete hosts. Plain \
         text is only for traffic that never leaves a trusted cluster network or for the fake \
         backend; set --tls-cert, --tls-key and --tls-ca (mTLS)",
    )
}

/// The warning logged when mTLS is on but the shard identity is not enforced: any client
/// certificate the CA signed may then act as any shard. `None` when enforced or without mTLS.
pub fn shard_identity_warning(
    security: SecurityMode,
    shard_identity: ShardIdentity,
) -> Option<&'static str> {
    match (security, shard_identity) {
        (SecurityMode::MutualTls, ShardIdentity::Off) => Some(
            "--shard-identity=off: the shard a mutation asserts is not checked against the \
             client certificate, so any certificate the CA signed can act as any shard",
        ),
        (SecurityMode::MutualTls, ShardIdentity::Warn) => Some(
            "--shard-identity=warn: mutations whose client certificate does not prove their \
             shard are admitted, logged and counted (shard_identity_rejected_total); switch to \
             enforce once the counter stays at zero",
        ),
        _ => None,
    }
}

/// Opens the store behind `--state` (in memory when empty).
pub fn open_store(state: &str) -> Result<SharedStore, String> {
    if state.is_empty() {
        return Ok(Arc::new(MemoryStore));
    }
    crate::persistence::durable::DurableStore::open(std::path::Path::new(state))
        .map(|s| Arc::new(s) as SharedStore)
}

/// Warms prices, capacities and standings from the cloud (best effort, bounded: the cloud's
/// catalogue in one read where it has one, else price by price) and fails if an offered type
/// has no price at all.
pub async fn warm_up(fleet: &Fleet, telemetry: Telemetry) -> Result<(), String> {
    match crate::provisioning::catalogue_refresh::refresh(fleet, WARMUP_BUDGET).await {
        crate::provisioning::catalogue_refresh::Refresh::Done => {}
        crate::provisioning::catalogue_refresh::Refresh::Failed(err) => tracing::warn!(
            err,
            "catalogue: reading the cloud's catalogue failed; using the pinned table until the next refresh"
        ),
        crate::provisioning::catalogue_refresh::Refresh::Unsupported => {
            fetch_prices(fleet, WARMUP_BUDGET).await;
            resolve_capacities(fleet).await;
        }
    }
    let _ = telemetry;
    let unpriced = fleet.unpriced();
    if let Some((t, z)) = unpriced.first() {
        return Err(format!(
            "no live or pinned price for instance type {t:?} in {z:?}: the cloud did not price it and it is not in the pinned table; fix the offering or check the API token and endpoint"
        ));
    }
    Ok(())
}

/// Resolves the capacities of the offered types from the cloud (best effort, bounded).
async fn resolve_capacities(fleet: &Fleet) {
    let types = fleet.instance_types();
    match tokio::time::timeout(
        WARMUP_BUDGET,
        fleet.capacities().resolve(&**fleet.cloud(), &types),
    )
    .await
    {
        Ok(Ok(0)) => {}
        Ok(Ok(unresolved)) => tracing::warn!(
            unresolved,
            "some offered instance types unresolved from the cloud; using pinned table"
        ),
        Ok(Err(err)) => tracing::warn!(err = %err, "capacity resolve failed; using pinned table"),
        Err(_) => tracing::warn!("capacity resolve timed out; using pinned table"),
    }
}

/// Waits for SIGTERM or SIGINT. The handlers are installed when this is called (at the top of
/// [`run`]), so a signal that arrives during startup is not lost.
fn shutdown_signal() -> Result<impl std::future::Future<Output = ()>, String> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term =
        signal(SignalKind::terminate()).map_err(|e| format!("install SIGTERM handler: {e}"))?;
    let mut int =
        signal(SignalKind::interrupt()).map_err(|e| format!("install SIGINT handler: {e}"))?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}

/// Runs a provider until SIGTERM/SIGINT.
pub async fn run(launch: Launch) -> Result<(), String> {
    let Launch {
        common,
        backend,
        fleet,
        telemetry,
        announce,
        side_servers,
        require_zone,
        real_backend,
        leading,
    } = launch;
    let shutdown = shutdown_signal()?;
    common.validate()?;
    let state_keys = common.state_keys()?;
    // TLS is loaded before anything else binds or loads; from then on it follows its files.
    let (security, tls_config) = tls::grpc_tls(&common.tls_flags())?;
    let tls_reloader = tls_config.as_ref().map(|tls| tls.reloader(telemetry));
    let shard_identity = common.shard_identity(security)?;
    if let Some(warning) = plaintext_warning(security, real_backend) {
        tracing::warn!(security = security.name(), "{warning}");
    }
    telemetry.startup_signals(tls::grpc_expiries(&common.tls_flags()));
    if shard_identity != ShardIdentity::Off {
        telemetry.shard_identity_signals(
            crate::security::identity::Reason::ALL
                .iter()
                .map(|r| r.label()),
        );
    }
    if let Some(warning) = shard_identity_warning(security, shard_identity) {
        tracing::warn!(shard_identity = shard_identity.name(), "{warning}");
    }
    // The pod label that routes the Service to the leader: flags, credentials and the API
    // address are checked now, before anything binds.
    let leader_label =
        crate::operations::leader_label::LeaderLabel::prepare(&common.leader_label, telemetry)?;
    // A restart serves from the prices and capacities the last run saved and refreshes them in
    // the background; a first start (or one without a saved catalogue) waits for the cloud.
    let price_cache = crate::operations::price_cache::PriceCache::for_state(&common.state);
    let mut refresh_now = false;
    if let Some(fleet) = &fleet {
        match &price_cache {
            Some(cache) if cache.restore(fleet) => {
                tracing::info!(
                    "pricing: starting with the prices and capacities saved by the last run; they are refreshed from the cloud in the background once serving"
                );
                refresh_now = true;
            }
            _ => warm_up(fleet, telemetry).await?,
        }
        // Never refuse because some offerings cannot be ordered: serve the rest. A first start
        // with none that can be ordered is a configuration to fix; a restart (it saved a
        // catalogue) serves anyway: its state's machines need it, and a sold-out offering
        // comes back when the cloud sells it again.
        let withdrawn = crate::provisioning::catalogue_refresh::announce(fleet, telemetry);
        match crate::provisioning::catalogue_refresh::startup_verdict(fleet, &withdrawn) {
            Err(e) if refresh_now => tracing::warn!(
                err = %e,
                "catalogue: serving the state's machines although no offering can be ordered now; the offerings come back when the cloud sells them again"
            ),
            verdict => verdict?,
        }
    }
    if !backend.has_readiness_gate() {
        tracing::warn!(
            "no readiness gate configured: a successful bootstrap hook is taken as node readiness (Configured is reported as soon as configure succeeds)"
        );
    }
    let mut options = EngineOptions::new(telemetry);
    options.timeouts = common.timeouts();
    options.orphan_grace = common.orphan_grace;
    options.require_zone = require_zone;
    options.state_keys = state_keys;
    options.fail_unreadable_configures = common.fail_unreadable_configures;
    match (&options.state_keys, common.state.is_empty()) {
        (Some(keys), _) => tracing::info!(
            keys = keys.len(),
            "state encryption on: the bootstrap blob of a Configure in flight is kept sealed in the state until it ends, so a restart or a takeover resumes it"
        ),
        (None, false) => tracing::warn!(
            "no --state-encryption-key-file: a restart or a takeover fails every Configure in flight (its bootstrap blob is not kept); set --state-encryption-key-file to resume them"
        ),
        (None, true) => {}
    }
    // With the state in etcd this process is one of several replicas: it starts as a standby
    // and leads when it wins the claim. Otherwise it is the only one and serves at once.
    let (replica, mode) = if crate::runtime::etcd::is_etcd(&common.state) {
        let prepared = crate::runtime::etcd::ha::prepare(&common.state, &common.etcd)
            .map_err(|e| format!("open state {}: {e}", common.state))?;
        let replica = Replica::standby(telemetry, leading);
        (replica, Mode::Replicated(Box::new(prepared)))
    } else {
        let store =
            open_store(&common.state).map_err(|e| format!("open state {}: {e}", common.state))?;
        leading
            .before_start(&*store)
            .map_err(|e| format!("open state {}: {e}", common.state))?;
        let engine = Engine::start(backend.clone(), store.clone(), options.clone())
            .await
            .map_err(|e| format!("build provider: {e}"))?;
        // The state directory exists now: keep what the warm-up learned for the next start.
        if let (Some(cache), Some(fleet), false) = (&price_cache, &fleet, refresh_now) {
            cache.save(fleet);
        }
        if let Some(fleet) = &fleet {
            let live_hosts = engine
                .snapshot()
                .slots
                .iter()
                .filter(|slot| slot.machine.host.is_some())
                .count();
            fleet.cloud().state_opened(live_hosts)?;
        }
        (Replica::single_with(engine, leading), Mode::Single)
    };

    let stop = CancellationToken::new();
    let mut tasks = Vec::new();
    // The label follows the role from the start (`false` on a standby, before it can serve)
    // and is cleared first at shutdown; it never waits on anything else.
    let label_stop = CancellationToken::new();
    let label_task =
        leader_label.map(|label| tokio::spawn(label.run(replica.subscribe(), label_stop.clone())));
    if let Some(reloader) = tls_reloader {
        tasks.push(tokio::spawn(
            reloader.run(tls::RELOAD_INTERVAL, stop.clone()),
        ));
    }
    for side in side_servers {
        tasks.push(side(stop.clone()).await?);
    }
    let addr = listen_addr(&common.addr);
    let grpc_listener = TcpListener::bind(&addr)
        .await
        .map_err(|e| format!("listen on {}: {e}", common.addr))?;
    let ready = Readiness::default();

    if !common.metrics_addr.is_empty() {
        match TcpListener::bind(listen_addr(&common.metrics_addr)).await {
            Ok(listener) => {
                let (ready, replica, stop) = (ready.clone(), replica.clone(), stop.clone());
                tasks.push(tokio::spawn(async move {
                    if let Err(e) = serve::serve_http(listener, ready, replica, async move {
                        stop.cancelled().await
                    })
                    .await
                    {
                        tracing::error!(error = %e, "observability server");
                    }
                }));
            }
            Err(e) => {
                tracing::error!(addr = common.metrics_addr, error = %e, "observability server: cannot bind the metrics address; serving gRPC without it")
            }
        }
    }
    if !common.admin_socket.is_empty() {
        let handle = crate::operations::admin::serve(
            std::path::Path::new(&common.admin_socket),
            replica.clone(),
            stop.clone(),
        )
        .map_err(|e| format!("admin socket {}: {e}", common.admin_socket))?;
        tasks.push(handle);
    }
    spawn_loops(
        &common,
        &replica,
        fleet.clone(),
        Prices {
            cache: price_cache,
            refresh_now,
        },
        telemetry,
        &stop,
    );

    let (health, health_service) = serve::grpc_health(telemetry).await;
    let grpc_stop = CancellationToken::new();
    let grpc = {
        let (replica, grpc_stop) = (replica.clone(), grpc_stop.clone());
        tokio::spawn(serve::serve_grpc(
            grpc_listener,
            tls_config,
            shard_identity,
            replica,
            common.reflection,
            health_service,
            common.grpc_limits(),
            async move { grpc_stop.cancelled().await },
        ))
    };
    telemetry.build_info();
    // Health and readiness follow the role: only a replica that serves passes them.
    let mirror = {
        let (mut roles, health, ready, stop) = (
            replica.subscribe(),
            health.clone(),
            ready.clone(),
            stop.clone(),
        );
        tokio::spawn(async move {
            loop {
                let serves = roles.borrow_and_update().serves();
                health.set(serves).await;
                ready.set(serves);
                tokio::select! {
                    changed = roles.changed() => if changed.is_err() { return },
                    _ = stop.cancelled() => return,
                }
            }
        })
    };
    let replicated = match mode {
        Mode::Replicated(prepared) => {
            let setup = crate::runtime::etcd::ha::ReplicaSetup {
                replica: replica.clone(),
                start_engine: {
                    let (backend, options) = (backend.clone(), options.clone());
                    Box::new(move |store| {
                        let (backend, options) = (backend.clone(), options.clone());
                        Box::pin(async move {
                            Engine::start(backend, store, options)
                                .await
                                .map_err(|e| e.to_string())
                        })
                    })
                },
                reconcile: !common.reconcile_interval.is_zero(),
                shutdown_grace: common.shutdown_grace,
            };
            let ha_stop = CancellationToken::new();
            let task = tokio::spawn(crate::runtime::etcd::ha::run(
                *prepared,
                setup,
                ha_stop.clone(),
            ));
            Some((task, ha_stop))
        }
        Mode::Single => None,
    };
    announce(security, shard_identity);

    let mut grpc = grpc;
    tokio::select! {
        _ = shutdown => {}
        result = &mut grpc => {
            stop.cancel();
            return match result {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(e),
                Err(e) => Err(format!("gRPC server task: {e}")),
            };
        }
    }
    tracing::info!(in_flight = replica.engine().map_or(0, |e| e.in_flight()), grace = %crate::observability::duration::format(common.shutdown_grace), role = replica.role().name(), "shutting down");
    mirror.abort();
    health.set(false).await;
    ready.set(false);
    label_stop.cancel();
    match replicated {
        // The replica loop lets a leader's in-flight work finish within the grace, then gives
        // the claim up so a standby takes over at once.
        Some((task, ha_stop)) => {
            ha_stop.cancel();
            let _ = task.await;
        }
        None => {
            if let Some(engine) = replica.engine() {
                let unfinished = engine.shutdown(common.shutdown_grace).await;
                if unfinished > 0 {
                    tracing::warn!(
                        unfinished,
                        "shutdown grace ran out; unfinished transitions will be resumed at the next start"
                    );
                }
                if let Err(e) = engine.store().release().wait().await {
                    tracing::warn!(error = %e, "state store release at shutdown");
                }
            }
        }
    }
    stop.cancel();
    grpc_stop.cancel();
    if let Some(task) = label_task {
        let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
    }
    let _ = tokio::time::timeout(Duration::from_secs(5), grpc).await;
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
    }
    tracing::info!("stopped");
    Ok(())
}

/// How the state is held.
enum Mode {
    /// Local or in-memory: this process is the only replica.
    Single,
    /// In etcd: replicas elect a leader.
    Replicated(Box<crate::runtime::etcd::ha::Prepared>),
}

fn spawn_loops(
    common: &CommonArgs,
    replica: &Arc<Replica>,
    fleet: Option<Arc<Fleet>>,
    prices: Prices,
    telemetry: Telemetry,
    stop: &CancellationToken,
) {
    if !common.reconcile_interval.is_zero() {
        let reconcile = crate::runtime::reconcile_loop::ReconcileLoop {
            replica: replica.clone(),
            cloud: fleet.as_ref().map(|f| f.cloud().clone()),
            floor: common.reconcile_interval,
            telemetry,
        };
        tokio::spawn(reconcile.run(stop.clone()));
    }
    if let Some(fleet) = fleet {
        let (stop, every) = (stop.clone(), common.price_refresh);
        tokio::spawn(async move {
            // Serving on saved prices: refresh them now, and again every minute until it works.
            if prices.refresh_now {
                loop {
                    let refreshed = refresh_prices(&fleet, telemetry).await;
                    if refreshed == Refreshed::Catalogue {
                        break;
                    }
                    if refreshed == Refreshed::Prices {
                        let _ = tokio::time::timeout(
                            Duration::from_secs(30),
                            crate::provisioning::budget::scoped(
                                crate::provisioning::budget::Class::Refresh,
                                fleet
                                    .capacities()
                                    .resolve(&**fleet.cloud(), &fleet.instance_types()),
                            ),
                        )
                        .await;
                        break;
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_secs(60)) => {}
                        _ = stop.cancelled() => return,
                    }
                }
                if let Some(cache) = &prices.cache {
                    cache.save(&fleet);
                }
            }
            if every.is_zero() {
                return;
            }
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            loop {
                tokio::select! { _ = tick.tick() => {}, _ = stop.cancelled() => return }
                if refresh_prices(&fleet, telemetry).await != Refreshed::Failed
                    && let Some(cache) = &prices.cache
                {
                    cache.save(&fleet);
                }
            }
        });
    }
}

/// Where prices come from at the start: the saved catalogue to keep fresh, and whether the
/// provider serves on it and must refresh at once.
struct Prices {
    cache: Option<crate::operations::price_cache::PriceCache>,
    refresh_now: bool,
}

/// How one refresh of the offerings went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Refreshed {
    /// The cloud's catalogue was read: prices, capacities and standings are fresh.
    Catalogue,
    /// Every price was read one by one (a cloud without a catalogue read).
    Prices,
    Failed,
}

/// One refresh of every offered price (and, from the cloud's catalogue, capacity and
/// standing), counted for the `PriceRefreshFailing` alert.
async fn refresh_prices(fleet: &Fleet, telemetry: Telemetry) -> Refreshed {
    // The startup look-ups first, so that prices are read for what Creates will send.
    let settings = crate::provisioning::budget::scoped(
        crate::provisioning::budget::Class::Refresh,
        fleet.cloud().refresh_settings(),
    );
    if let Err(e) = settings.await {
        tracing::warn!(err = %e, "settings: looking up the offerings' settings again failed; keeping the ones in use");
    }
    let refreshed =
        match crate::provisioning::catalogue_refresh::refresh(fleet, Duration::from_secs(30)).await
        {
            crate::provisioning::catalogue_refresh::Refresh::Done => Refreshed::Catalogue,
            crate::provisioning::catalogue_refresh::Refresh::Failed(err) => {
                tracing::warn!(
                    err,
                    "catalogue: reading the cloud's catalogue failed; keeping what is known"
                );
                Refreshed::Failed
            }
            crate::provisioning::catalogue_refresh::Refresh::Unsupported => {
                if fetch_prices(fleet, Duration::from_secs(30)).await {
                    Refreshed::Prices
                } else {
                    Refreshed::Failed
                }
            }
        };
    crate::provisioning::catalogue_refresh::announce(fleet, telemetry);
    telemetry.price_refresh_outcome(if refreshed == Refreshed::Failed {
        "error"
    } else {
        "success"
    });
    refreshed
}

/// Fetches every offered price within `budget`, logging each failure (the fallback stays);
/// true when every price was fetched.
async fn fetch_prices(fleet: &Fleet, budget: Duration) -> bool {
    let pairs = fleet.price_pairs();
    let refresh = crate::provisioning::budget::scoped(
        crate::provisioning::budget::Class::Refresh,
        fleet.prices().refresh(&**fleet.cloud(), &pairs),
    );
    match tokio::time::timeout(budget, refresh).await {
        Ok(failures) => {
            for (instance_type, zone, err) in &failures {
                tracing::warn!(
                    instance_type,
                    zone,
                    err,
                    "pricing: price fetch failed; keeping fallback"
                );
            }
            failures.is_empty()
        }
        Err(_) => {
            tracing::warn!("pricing: price refresh timed out; keeping fallback");
            false
        }
    }
}

/// The `main` of a provider binary: logging, the runtime, then either a subcommand (printing
/// its output) or the server returned by `launch`. Exit code 1 on any error.
pub fn main_entry<F>(
    binary: &str,
    common: &CommonArgs,
    command: Option<crate::operations::cli::Command>,
    launch: impl FnOnce() -> F,
) -> std::process::ExitCode
where
    F: std::future::Future<Output = Result<(), String>>,
{
    use std::process::ExitCode;
    crate::operations::config::init_logging(common.log_format, &common.log_level);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{binary}: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(command) = command {
        return match runtime.block_on(crate::operations::cli::run(command)) {
            Ok(out) => {
                println!("{out}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{binary}: {e}");
                ExitCode::FAILURE
            }
        };
    }
    match runtime.block_on(launch()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(err = %e, "provider exited with error");
            ExitCode::FAILURE
        }
    }
}

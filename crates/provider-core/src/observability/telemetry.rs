//! Metric names and recording helpers. Every series carries the binary's prefix
//! (`bigfleet_hetzner_`, `bigfleet_digitalocean_`, ...), keeps the reference's names where it
//! has them, and never uses an unbounded label value such as a machine id.

use std::sync::OnceLock;
use std::time::Duration;

use metrics::{Counter, Histogram, counter, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tonic::Code;

/// The metric names of one provider binary.
#[derive(Debug, Clone, Copy)]
pub struct Telemetry {
    /// The binary's prefix (`bigfleet_hetzner`), for series named elsewhere (`budget`).
    pub prefix: &'static str,
    pub grpc_requests: &'static str,
    pub grpc_duration: &'static str,
    pub panics: &'static str,
    pub reconcile: &'static str,
    pub reconcile_period: &'static str,
    pub reconcile_survey_requests: &'static str,
    pub reconcile_early_surveys: &'static str,
    pub reconcile_hosts_deleted: &'static str,
    pub price_refresh: &'static str,
    pub offering_withdrawn: &'static str,
    pub offering_unavailable_after: &'static str,
    pub create_refusals: &'static str,
    pub account_headroom: &'static str,
    pub api_calls: &'static str,
    pub api_duration: &'static str,
    pub api_http: &'static str,
    pub transitions: &'static str,
    pub transition_duration: &'static str,
    pub machines: &'static str,
    pub failed_with_host: &'static str,
    pub retired_machines: &'static str,
    pub store_commit_duration: &'static str,
    pub store_commit_failures: &'static str,
    pub admin_actions: &'static str,
    pub bootstrap_polls: &'static str,
    pub bootstrap_commands: &'static str,
    pub bootstrap_acks: &'static str,
    pub bootstrap_unauthorized: &'static str,
    pub bootstrap_enrollments: &'static str,
    pub bootstrap_enrollment_conflicts: &'static str,
    pub bootstrap_enrollment_replays: &'static str,
    pub build_info: &'static str,
    // Listener and input limits (docs/limits.md).
    pub unknown_id_marks: &'static str,
    pub unknown_id_marks_evicted: &'static str,
    pub grpc_connections: &'static str,
    pub grpc_connections_refused: &'static str,
    // Shard identity under mTLS (`identity`).
    pub shard_identity_rejected: &'static str,
    // Alerting signals (see the `impl` block below).
    pub certificate_not_after: &'static str,
    pub tls_reload: &'static str,
    pub ready: &'static str,
    pub store_refusing_mutations: &'static str,
    // High availability (docs/ha.md).
    pub leader: &'static str,
    pub takeovers: &'static str,
    pub takeover_duration: &'static str,
    pub step_downs: &'static str,
    pub leader_label: &'static str,
    /// The per-RPC series, resolved once per method and code.
    rpc_series: &'static RpcSeries,
}

/// The methods whose per-RPC series are resolved once (the CapacityProvider methods and the
/// health check); any other method name is recorded through the registry on every call.
const RPC_METHODS: [&str; 7] = [
    "Create",
    "Configure",
    "Drain",
    "Delete",
    "Get",
    "List",
    "Check",
];

/// gRPC status codes, 0 (OK) to 16 (UNAUTHENTICATED).
const RPC_CODES: usize = 17;

/// Handles of `<prefix>_grpc_requests_total{method,code}` and
/// `<prefix>_grpc_request_duration_seconds{method}`, each resolved from the recorder on its
/// first use (so a series exists only once it has happened, as with the macros), so that an
/// RPC costs an index and the increments, with no label building, hashing or allocation.
struct RpcSeries {
    requests: [[OnceLock<Counter>; RPC_CODES]; RPC_METHODS.len()],
    durations: [OnceLock<Histogram>; RPC_METHODS.len()],
}

impl std::fmt::Debug for RpcSeries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RpcSeries")
    }
}

fn method_index(method: &str) -> Option<usize> {
    RPC_METHODS.iter().position(|m| *m == method)
}

fn leak(prefix: &str, name: &str) -> &'static str {
    // A bounded, one-time set of names per process: leaking gives the metrics macros the
    // `'static` names they record without allocating on every call.
    Box::leak(format!("{prefix}_{name}").into_boxed_str())
}

impl Telemetry {
    /// Names for the binary whose metrics start with `prefix`, e.g. `bigfleet_hetzner`.
    pub fn new(prefix: &str) -> Telemetry {
        static CACHE: OnceLock<std::sync::Mutex<Vec<(String, Telemetry)>>> = OnceLock::new();
        let cache = CACHE.get_or_init(Default::default);
        let mut cache = cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, t)) = cache.iter().find(|(p, _)| p == prefix) {
            return *t;
        }
        let t = Telemetry {
            prefix: Box::leak(prefix.to_owned().into_boxed_str()),
            grpc_requests: leak(prefix, "grpc_requests_total"),
            grpc_duration: leak(prefix, "grpc_request_duration_seconds"),
            panics: leak(prefix, "panics_total"),
            reconcile: leak(prefix, "reconcile_total"),
            reconcile_period: leak(prefix, "reconcile_period_seconds"),
            reconcile_survey_requests: leak(prefix, "reconcile_survey_requests"),
            reconcile_hosts_deleted: leak(prefix, "reconcile_hosts_deleted_total"),
            reconcile_early_surveys: leak(prefix, "reconcile_early_surveys_total"),
            price_refresh: leak(prefix, "price_refresh_total"),
            offering_withdrawn: leak(prefix, "offering_withdrawn"),
            offering_unavailable_after: leak(
                prefix,
                "offering_unavailable_after_timestamp_seconds",
            ),
            create_refusals: leak(prefix, "create_refusals_total"),
            account_headroom: leak(prefix, "account_headroom"),
            api_calls: leak(prefix, "api_calls_total"),
            api_duration: leak(prefix, "api_duration_seconds"),
            api_http: leak(prefix, "api_http_requests_total"),
            transitions: leak(prefix, "transitions_total"),
            transition_duration: leak(prefix, "transition_duration_seconds"),
            machines: leak(prefix, "machines"),
            failed_with_host: leak(prefix, "failed_machines_with_host"),
            retired_machines: leak(prefix, "retired_machines"),
            store_commit_duration: leak(prefix, "store_commit_duration_seconds"),
            store_commit_failures: leak(prefix, "store_commit_failures_total"),
            admin_actions: leak(prefix, "admin_actions_total"),
            bootstrap_polls: leak(prefix, "bootstrap_polls_total"),
            bootstrap_commands: leak(prefix, "bootstrap_commands_total"),
            bootstrap_acks: leak(prefix, "bootstrap_acks_total"),
            bootstrap_unauthorized: leak(prefix, "bootstrap_unauthorized_total"),
            bootstrap_enrollments: leak(prefix, "bootstrap_enrollments_total"),
            bootstrap_enrollment_conflicts: leak(prefix, "bootstrap_enrollment_conflicts_total"),
            bootstrap_enrollment_replays: leak(prefix, "bootstrap_enrollment_replays_total"),
            build_info: leak(prefix, "build_info"),
            // Listener and input limits (docs/limits.md).
            unknown_id_marks: leak(prefix, "unknown_id_fence_marks"),
            unknown_id_marks_evicted: leak(prefix, "unknown_id_fence_marks_evicted_total"),
            grpc_connections: leak(prefix, "grpc_connections"),
            grpc_connections_refused: leak(prefix, "grpc_connections_refused_total"),
            shard_identity_rejected: leak(prefix, "shard_identity_rejected_total"),
            certificate_not_after: leak(prefix, "certificate_not_after_timestamp_seconds"),
            tls_reload: leak(prefix, "tls_reload_total"),
            ready: leak(prefix, "ready"),
            store_refusing_mutations: leak(prefix, "store_refusing_mutations"),
            leader: leak(prefix, "leader"),
            takeovers: leak(prefix, "takeovers_total"),
            takeover_duration: leak(prefix, "takeover_duration_seconds"),
            step_downs: leak(prefix, "step_downs_total"),
            leader_label: leak(prefix, "leader_label_updates_total"),
            rpc_series: Box::leak(Box::new(RpcSeries {
                requests: std::array::from_fn(|_| std::array::from_fn(|_| OnceLock::new())),
                durations: std::array::from_fn(|_| OnceLock::new()),
            })),
        };
        cache.push((prefix.to_owned(), t));
        t
    }

    /// One finished RPC: `<prefix>_grpc_requests_total{method,code}` and
    /// `<prefix>_grpc_request_duration_seconds{method}`, `code` spelled as [`code_name`] does.
    pub fn rpc(&self, method: &'static str, code: Code, elapsed: Duration) {
        let seconds = elapsed.as_secs_f64();
        let code_label = code_name(code);
        // Handles resolved before the process recorder exists would record nowhere forever:
        // until it is installed, every call goes through the registry.
        let cell = method_index(method)
            .filter(|_| RECORDER.get().is_some())
            .zip(usize::try_from(i32::from(code)).ok())
            .filter(|(_, column)| *column < RPC_CODES);
        let Some((row, column)) = cell else {
            counter!(self.grpc_requests, "method" => method, "code" => code_label).increment(1);
            histogram!(self.grpc_duration, "method" => method).record(seconds);
            return;
        };
        self.rpc_series.requests[row][column]
            .get_or_init(|| counter!(self.grpc_requests, "method" => method, "code" => code_label))
            .increment(1);
        self.rpc_series.durations[row]
            .get_or_init(|| histogram!(self.grpc_duration, "method" => method))
            .record(seconds);
    }

    pub fn panic(&self) {
        counter!(self.panics).increment(1);
    }

    pub fn transition(&self, kind: &'static str, outcome: &'static str, elapsed: Duration) {
        counter!(self.transitions, "kind" => kind, "outcome" => outcome).increment(1);
        histogram!(self.transition_duration, "kind" => kind, "outcome" => outcome)
            .record(elapsed.as_secs_f64());
    }

    pub fn reconcile_outcome(&self, outcome: &'static str) {
        counter!(self.reconcile, "outcome" => outcome).increment(1);
    }

    /// The wait chosen before the next reconcile survey, and what the last one cost in API
    /// requests (when the client counts them).
    pub fn reconcile_period(&self, period: Duration, survey_requests: Option<u64>) {
        gauge!(self.reconcile_period).set(period.as_secs_f64());
        if let Some(cost) = survey_requests {
            gauge!(self.reconcile_survey_requests).set(cost as f64);
        }
    }

    /// A survey started before its paced period was over because the cloud's out-of-band
    /// check said the owned hosts changed.
    pub fn reconcile_early_survey(&self) {
        counter!(self.reconcile_early_surveys).increment(1);
    }

    /// Reconcile deleted an owned host: an `orphan` attached to no machine, or the unbound
    /// host of a `failed` machine, once `--orphan-grace` passed.
    pub fn reconcile_host_deleted(&self, reason: &'static str) {
        counter!(self.reconcile_hosts_deleted, "reason" => reason).increment(1);
    }

    /// Where one offering stands: withdrawn (1) or advertised (0), and the moment after which
    /// the cloud stops selling it in its zone when a deprecation was announced (the series is
    /// set to 0 when none is).
    pub fn offering_standing(
        &self,
        instance_type: &str,
        zone: &str,
        withdrawn: bool,
        unavailable_after_unix: Option<i64>,
    ) {
        let labels = [
            ("instance_type", instance_type.to_owned()),
            ("zone", zone.to_owned()),
        ];
        gauge!(self.offering_withdrawn, &labels).set(if withdrawn { 1.0 } else { 0.0 });
        gauge!(self.offering_unavailable_after, &labels)
            .set(unavailable_after_unix.map_or(0.0, |t| t as f64));
    }

    /// A Create the cloud refused without making anything (or that was answered without a
    /// request while its offering is withdrawn or the account is full), by offering and reason:
    /// the cloud's code, `withdrawn` or `no_headroom`.
    pub fn create_refused(&self, instance_type: &str, zone: &str, reason: &'static str) {
        counter!(
            self.create_refusals,
            "instance_type" => instance_type.to_owned(),
            "zone" => zone.to_owned(),
            "reason" => reason
        )
        .increment(1);
    }

    /// Whether the offering is withdrawn after a stockout (until the probe that ends it).
    pub fn offering_stockout(&self, instance_type: &str, zone: &str, withdrawn: bool) {
        let labels = [
            ("instance_type", instance_type.to_owned()),
            ("zone", zone.to_owned()),
        ];
        gauge!(self.offering_withdrawn, &labels).set(if withdrawn { 1.0 } else { 0.0 });
    }

    /// How many more hosts the cloud account may hold (`None`: no limit known, the series is
    /// set to -1).
    pub fn account_headroom(&self, headroom: Option<u64>) {
        gauge!(self.account_headroom).set(headroom.map_or(-1.0, |h| h as f64));
    }

    pub fn price_refresh_outcome(&self, outcome: &'static str) {
        counter!(self.price_refresh, "outcome" => outcome).increment(1);
    }

    /// One cloud-client operation (the reference's `op` granularity).
    pub fn api_call(&self, op: &'static str, ok: bool, elapsed: Duration) {
        let outcome = if ok { "success" } else { "error" };
        counter!(self.api_calls, "op" => op, "outcome" => outcome).increment(1);
        histogram!(self.api_duration, "op" => op).record(elapsed.as_secs_f64());
    }

    /// One HTTP request to a cloud API, by endpoint template and status class (see
    /// [`status_class`]; `error` for a transport failure).
    pub fn api_http(&self, endpoint: &'static str, status: &'static str) {
        counter!(self.api_http, "endpoint" => endpoint, "status" => status).increment(1);
    }

    pub fn store_commit(&self, elapsed: Duration, ok: bool) {
        histogram!(self.store_commit_duration).record(elapsed.as_secs_f64());
        if !ok {
            counter!(self.store_commit_failures).increment(1);
        }
    }

    pub fn admin(&self, action: &'static str, outcome: &'static str) {
        counter!(self.admin_actions, "action" => action, "outcome" => outcome).increment(1);
    }

    pub fn census(
        &self,
        by_state: &[(&'static str, usize)],
        failed_with_host: usize,
        retired: &[(&'static str, usize)],
    ) {
        for (state, n) in by_state {
            gauge!(self.machines, "state" => *state).set(*n as f64);
        }
        gauge!(self.failed_with_host).set(failed_with_host as f64);
        for (reason, n) in retired {
            gauge!(self.retired_machines, "reason" => *reason).set(*n as f64);
        }
    }

    /// Marks the build this process runs (`<prefix>_build_info{version} 1`).
    pub fn build_info(&self) {
        gauge!(self.build_info, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
    }

    // Listener and input limits (docs/limits.md).

    /// The bounded table of fence marks for unknown machine ids: its size and evictions.
    pub fn unknown_id_marks(&self, held: usize, evicted: u64) {
        gauge!(self.unknown_id_marks).set(held as f64);
        if evicted > 0 {
            counter!(self.unknown_id_marks_evicted).increment(evicted);
        }
    }

    /// Open gRPC connections.
    pub fn grpc_connections(&self, open: usize) {
        gauge!(self.grpc_connections).set(open as f64);
    }

    /// A gRPC connection refused because the connection limit was reached.
    pub fn grpc_connection_refused(&self) {
        counter!(self.grpc_connections_refused).increment(1);
    }

    /// A mutating RPC whose client certificate does not prove its shard (refused under
    /// `--shard-identity=enforce`, admitted under `warn`), by reason.
    pub fn shard_identity_rejected(&self, reason: &'static str) {
        counter!(self.shard_identity_rejected, "reason" => reason).increment(1);
    }

    pub fn bootstrap_poll(&self, outcome: &'static str) {
        counter!(self.bootstrap_polls, "outcome" => outcome).increment(1);
    }

    pub fn bootstrap_command(&self, kind: &'static str, outcome: &'static str) {
        counter!(self.bootstrap_commands, "type" => kind, "outcome" => outcome).increment(1);
    }

    pub fn bootstrap_ack(&self, outcome: &'static str) {
        counter!(self.bootstrap_acks, "outcome" => outcome).increment(1);
    }

    pub fn bootstrap_unauthorized(&self) {
        counter!(self.bootstrap_unauthorized).increment(1);
    }

    /// One enrollment request of an on-host agent, by how it ended.
    pub fn bootstrap_enrollment(&self, outcome: &'static str) {
        counter!(self.bootstrap_enrollments, "outcome" => outcome).increment(1);
    }

    /// A second enrollment with a spent one-time token before the enrolled agent was handed a
    /// Configure's blob (an attack or a cloned disk): the machine is cut off.
    pub fn bootstrap_enrollment_conflict(&self) {
        counter!(self.bootstrap_enrollment_conflicts).increment(1);
    }

    /// An enrollment with a spent one-time token after the enrolled agent was handed a
    /// Configure's blob (something read the Droplet's user_data): refused, nothing changed.
    pub fn bootstrap_enrollment_replay(&self) {
        counter!(self.bootstrap_enrollment_replays).increment(1);
    }
}

/// Signals the shipped alerts need beyond the counters above: the expiry of the certificates
/// served (a reload moves it), readiness and a poisoned store, which are states, not events,
/// so they are gauges.
impl Telemetry {
    /// `<prefix>_certificate_not_after_timestamp_seconds{certificate}`: when the first
    /// certificate of a PEM file expires, as [`crate::security::tls::earliest_not_after`] read it. A file
    /// the DER walk cannot read (it was already accepted by TLS) is logged, not fatal: the
    /// series is then absent.
    pub fn certificate_expiry(&self, certificate: &'static str, not_after: Result<i64, String>) {
        match not_after {
            Ok(not_after) => self.certificate_not_after(certificate, not_after),
            Err(e) => {
                tracing::warn!(certificate, error = %e, "cannot read the certificate's expiry; its expiry metric is not exported")
            }
        }
    }

    /// `<prefix>_certificate_not_after_timestamp_seconds{certificate}` of a pair or bundle a
    /// reload has just taken: the expiry follows what is served.
    pub fn certificate_not_after(&self, certificate: &'static str, not_after: i64) {
        gauge!(self.certificate_not_after, "certificate" => certificate).set(not_after as f64);
    }

    /// One changed certificate file judged by the reloader:
    /// `<prefix>_tls_reload_total{certificate,result}`, `result` = `loaded` or `refused`.
    pub fn tls_reload(&self, certificate: &'static str, result: &'static str) {
        counter!(self.tls_reload, "certificate" => certificate, "result" => result).increment(1);
    }

    /// Both reload series of `certificate` at zero (kept if they exist), once it is watched.
    pub fn tls_reload_signals(&self, certificate: &'static str) {
        let _ = recorder();
        for result in ["loaded", "refused"] {
            counter!(self.tls_reload, "certificate" => certificate, "result" => result)
                .increment(0);
        }
    }

    /// What a provider exports from its start: the expiry of the gRPC server certificate
    /// (`grpc_server`) and client CA bundle (`grpc_client_ca`) of the TLS flags that are set
    /// ([`crate::security::tls::grpc_expiries`]), and
    /// a zero for every series an alert or the dashboard reads, so the first event is an
    /// increase Prometheus sees (a counter born at 1 has no `increase`) and a healthy provider
    /// shows 0 rather than no data. Called before the store loads, so a commit failure while
    /// resuming is not overwritten.
    pub fn startup_signals(&self, expiries: Vec<(&'static str, Result<i64, String>)>) {
        // Values recorded before the recorder is installed are lost; the observability server
        // installs it later, so install it now.
        let _ = recorder();
        for (certificate, not_after) in expiries {
            self.certificate_expiry(certificate, not_after);
        }
        for kind in ["create", "configure", "drain", "delete"] {
            for outcome in ["success", "error", "timeout"] {
                counter!(self.transitions, "kind" => kind, "outcome" => outcome).absolute(0);
            }
        }
        for outcome in ["success", "error"] {
            counter!(self.reconcile, "outcome" => outcome).absolute(0);
            counter!(self.price_refresh, "outcome" => outcome).absolute(0);
        }
        counter!(self.reconcile_early_surveys).absolute(0);
        counter!(self.store_commit_failures).absolute(0);
        counter!(self.panics).absolute(0);
        counter!(self.takeovers).absolute(0);
        counter!(self.step_downs).absolute(0);
        gauge!(self.store_refusing_mutations).set(0.0);
    }

    /// What the DigitalOcean bootstrap channel exports from its start: its certificate's expiry
    /// (`bootstrap`) and a zero 401 counter, for the same reasons as [`Self::startup_signals`].
    pub fn bootstrap_channel_signals(&self, not_after: Result<i64, String>) {
        let _ = recorder();
        self.certificate_expiry("bootstrap", not_after);
        counter!(self.bootstrap_unauthorized).absolute(0);
        counter!(self.bootstrap_enrollment_conflicts).absolute(0);
        counter!(self.bootstrap_enrollment_replays).absolute(0);
    }

    /// A zero `<prefix>_shard_identity_rejected_total` for every reason label the binding
    /// counts, once the check is on (`--shard-identity` enforce or warn), for the same reasons as
    /// [`Self::startup_signals`].
    pub fn shard_identity_signals(&self, reasons: impl IntoIterator<Item = &'static str>) {
        let _ = recorder();
        for reason in reasons {
            counter!(self.shard_identity_rejected, "reason" => reason).absolute(0);
        }
    }

    /// `<prefix>_ready`: 1 while `/readyz` answers ready, else 0.
    pub fn readiness(&self, ready: bool) {
        gauge!(self.ready).set(if ready { 1.0 } else { 0.0 });
    }

    /// `<prefix>_store_refusing_mutations 1`: a commit failed and every mutation is refused
    /// until the provider restarts.
    pub fn store_refusing_mutations(&self) {
        gauge!(self.store_refusing_mutations).set(1.0);
    }

    /// Back to 0 when a replica starts a new term on a freshly read state.
    pub fn store_accepting(&self) {
        gauge!(self.store_refusing_mutations).set(0.0);
    }

    /// `<prefix>_leader`: 1 while this replica leads the etcd state (or is the only replica).
    pub fn leader(&self, leading: bool) {
        gauge!(self.leader).set(if leading { 1.0 } else { 0.0 });
    }

    /// A won claim, from the start of the attempt to serving (read, resume, reconcile).
    pub fn takeover(&self, elapsed: Duration) {
        counter!(self.takeovers).increment(1);
        histogram!(self.takeover_duration).record(elapsed.as_secs_f64());
    }

    /// A leader that stopped acknowledging because its claim was no longer held.
    pub fn step_down(&self) {
        counter!(self.step_downs).increment(1);
    }

    /// One attempt to set the pod's leader label (`--leader-label`): `success` or `error`.
    pub fn leader_label(&self, outcome: &'static str) {
        counter!(self.leader_label, "outcome" => outcome).increment(1);
    }
}

static RECORDER: OnceLock<PrometheusHandle> = OnceLock::new();

/// The process-wide Prometheus recorder. Installed once; later calls share the same handle.
pub fn recorder() -> PrometheusHandle {
    RECORDER
        .get_or_init(|| {
            let buckets = [
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0, 30.0, 60.0, 300.0, 900.0,
            ];
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &buckets)
                .unwrap_or_else(|_| PrometheusBuilder::new());
            match builder.install_recorder() {
                Ok(handle) => handle,
                // Another recorder was installed first (only possible in tests that embed
                // several components); render an isolated recorder instead.
                Err(_) => PrometheusBuilder::new().build_recorder().handle(),
            }
        })
        .clone()
}

/// The status class label of a cloud API answer: `429` on its own (rate limiting), else
/// `2xx`, `3xx`, `4xx` or `5xx`.
pub fn status_class(status: u16) -> &'static str {
    match status {
        429 => "429",
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        _ => "5xx",
    }
}

/// The gRPC code name as the reference's metrics spell it (`OK`, `FailedPrecondition`, ...).
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "Canceled",
        Code::Unknown => "Unknown",
        Code::InvalidArgument => "InvalidArgument",
        Code::DeadlineExceeded => "DeadlineExceeded",
        Code::NotFound => "NotFound",
        Code::AlreadyExists => "AlreadyExists",
        Code::PermissionDenied => "PermissionDenied",
        Code::ResourceExhausted => "ResourceExhausted",
        Code::FailedPrecondition => "FailedPrecondition",
        Code::Aborted => "Aborted",
        Code::OutOfRange => "OutOfRange",
        Code::Unimplemented => "Unimplemented",
        Code::Internal => "Internal",
        Code::Unavailable => "Unavailable",
        Code::DataLoss => "DataLoss",
        Code::Unauthenticated => "Unauthenticated",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sample of `name` in the exposition, if any.
    fn sample(body: &str, name: &str) -> Option<f64> {
        body.lines()
            .find(|l| l.starts_with(name) && !l.starts_with('#'))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }

    #[test]
    fn code_names_match_the_reference_metrics() {
        assert_eq!(code_name(Code::FailedPrecondition), "FailedPrecondition");
        assert_eq!(code_name(Code::Ok), "OK");
        assert_eq!(code_name(Code::Cancelled), "Canceled");
    }

    #[test]
    fn rpc_series_keep_their_names_and_labels() {
        let handle = recorder();
        let t = Telemetry::new("bigfleet_rpctest");
        let ms = Duration::from_millis(1);
        for _ in 0..2 {
            t.rpc("Get", Code::NotFound, ms);
        }
        t.rpc("Get", Code::Ok, ms);
        t.rpc("Check", Code::Unavailable, ms);
        // A method outside the resolved table takes the registry path.
        t.rpc("Watch", Code::Cancelled, ms);
        let body = handle.render();
        for (series, value) in [
            (
                r#"bigfleet_rpctest_grpc_requests_total{method="Get",code="NotFound"}"#,
                2.0,
            ),
            (
                r#"bigfleet_rpctest_grpc_requests_total{method="Get",code="OK"}"#,
                1.0,
            ),
            (
                r#"bigfleet_rpctest_grpc_requests_total{method="Check",code="Unavailable"}"#,
                1.0,
            ),
            (
                r#"bigfleet_rpctest_grpc_requests_total{method="Watch",code="Canceled"}"#,
                1.0,
            ),
            (
                r#"bigfleet_rpctest_grpc_request_duration_seconds_count{method="Get"}"#,
                3.0,
            ),
            (
                r#"bigfleet_rpctest_grpc_request_duration_seconds_count{method="Watch"}"#,
                1.0,
            ),
        ] {
            assert_eq!(
                sample(&body, &format!("{series} ")),
                Some(value),
                "{series}\n{body}"
            );
        }
        assert!(
            !body.contains(r#"bigfleet_rpctest_grpc_requests_total{method="List""#)
                && !body.contains(
                    r#"bigfleet_rpctest_grpc_requests_total{method="Get",code="Internal""#
                ),
            "only series that happened exist: {body}"
        );
    }

    #[test]
    fn alerting_signals_are_exported() {
        let handle = recorder();
        let t = Telemetry::new("bigfleet_telemetrytest");
        let pki = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/pki");
        let flags = crate::security::tls::TlsFlags {
            cert: Some(std::path::Path::new(pki).join("server.pem")),
            key: Some(std::path::Path::new(pki).join("server-key.pem")),
            ca: Some(std::path::Path::new(pki).join("ca.pem")),
        };
        t.startup_signals(crate::security::tls::grpc_expiries(&flags));
        for zeroed in [
            "bigfleet_telemetrytest_transitions_total{kind=\"configure\",outcome=\"timeout\"} 0",
            "bigfleet_telemetrytest_reconcile_total{outcome=\"error\"} 0",
            "bigfleet_telemetrytest_reconcile_early_surveys_total 0",
            "bigfleet_telemetrytest_price_refresh_total{outcome=\"success\"} 0",
            "bigfleet_telemetrytest_store_commit_failures_total 0",
            "bigfleet_telemetrytest_panics_total 0",
            "bigfleet_telemetrytest_store_refusing_mutations 0",
        ] {
            assert!(handle.render().contains(zeroed), "{zeroed}");
        }
        t.bootstrap_channel_signals(crate::security::tls::earliest_not_after(
            std::path::Path::new("/nonexistent/cert.pem"),
        ));
        t.readiness(false);
        t.store_refusing_mutations();
        let body = handle.render();
        for (certificate, file) in [("grpc_server", "server.pem"), ("grpc_client_ca", "ca.pem")] {
            let name = format!(
                "bigfleet_telemetrytest_certificate_not_after_timestamp_seconds{{certificate=\"{certificate}\"}}"
            );
            let want =
                crate::security::tls::earliest_not_after(&std::path::Path::new(pki).join(file))
                    .expect("committed PKI");
            assert_eq!(sample(&body, &name), Some(want as f64), "{body}");
        }
        assert!(
            !body.contains("certificate=\"bootstrap\""),
            "an unreadable file exports no expiry: {body}"
        );
        assert_eq!(
            sample(
                &body,
                "bigfleet_telemetrytest_bootstrap_unauthorized_total "
            ),
            Some(0.0)
        );
        assert_eq!(sample(&body, "bigfleet_telemetrytest_ready "), Some(0.0));
        t.readiness(true);
        assert_eq!(
            sample(&handle.render(), "bigfleet_telemetrytest_ready "),
            Some(1.0)
        );
        assert_eq!(
            sample(&body, "bigfleet_telemetrytest_store_refusing_mutations "),
            Some(1.0)
        );
    }
}

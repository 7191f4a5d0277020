//! The leader label (`--leader-label`): the replica labels its own pod `bigfleet-leader=true`
//! while it leads and `false` otherwise, through the Kubernetes API, so a Service that selects
//! `bigfleet-leader=true` routes to the leader while every replica that is up to date stays Ready
//! (docs/ha.md, "Deploying replicas").
//!
//! The label only routes. Correctness stays with the claim in etcd: a stale label sends clients
//! to a replica that answers UNAVAILABLE, and that replica closes their connections (see
//! [`crate::wire::listener`]) so they come back through the Service.
//!
//! In-cluster configuration, as every Kubernetes client reads it: the service account's token and
//! CA from `--kubernetes-credentials` (the standard mount), the API address from
//! `KUBERNETES_SERVICE_HOST` and `KUBERNETES_SERVICE_PORT` (or `--kubernetes-api`), the pod's
//! name and namespace from the downward API. The label is written with a JSON merge patch on the
//! pod, retried with backoff until it succeeds; a failure is logged and counted, and never
//! delays serving or stepping down. The token is read again for every request (projected tokens
//! rotate) and never appears in a log, an error or a metric.

use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgAction, Args};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use zeroize::Zeroizing;

use crate::observability::telemetry::Telemetry;
use crate::operations::flag_syntax::go_bool;
use crate::runtime::replica::Role;

/// The pod label key; `true` on the leader, `false` on every other replica.
pub const LABEL: &str = "bigfleet-leader";
/// Where Kubernetes mounts a pod's service account credentials.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// Per request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// The first retry waits this long, doubling up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(200);
const MAX_BACKOFF: Duration = Duration::from_secs(10);
/// How long a stopping replica tries to set its label to `false`.
const SHUTDOWN_BUDGET: Duration = Duration::from_secs(2);

/// The leader label's flags.
#[derive(Args, Debug, Clone, PartialEq)]
pub struct LeaderLabelArgs {
    /// Label this replica's pod bigfleet-leader=true while it leads the state and false
    /// otherwise, through the Kubernetes API, for a Service that routes to the leader.
    #[arg(long = "leader-label", env = "BIGFLEET_LEADER_LABEL", default_value = "false", value_parser = go_bool, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = ArgAction::Set)]
    pub leader_label: bool,

    /// This replica's pod name (downward API metadata.name), for --leader-label.
    #[arg(
        long = "pod-name",
        env = "BIGFLEET_POD_NAME",
        default_value = "",
        value_name = "NAME"
    )]
    pub pod_name: String,

    /// This replica's pod namespace (downward API metadata.namespace), for --leader-label.
    #[arg(
        long = "pod-namespace",
        env = "BIGFLEET_POD_NAMESPACE",
        default_value = "",
        value_name = "NAMESPACE"
    )]
    pub pod_namespace: String,

    /// Directory with the service account's token and ca.crt, for --leader-label.
    #[arg(
        long = "kubernetes-credentials",
        env = "BIGFLEET_KUBERNETES_CREDENTIALS",
        default_value = SERVICE_ACCOUNT_DIR,
        value_name = "DIR"
    )]
    pub kubernetes_credentials: String,

    /// Kubernetes API base URL for --leader-label; empty: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT.
    #[arg(
        long = "kubernetes-api",
        env = "BIGFLEET_KUBERNETES_API",
        default_value = "",
        value_name = "URL"
    )]
    pub kubernetes_api: String,
}

impl Default for LeaderLabelArgs {
    fn default() -> LeaderLabelArgs {
        LeaderLabelArgs {
            leader_label: false,
            pod_name: String::new(),
            pod_namespace: String::new(),
            kubernetes_credentials: SERVICE_ACCOUNT_DIR.into(),
            kubernetes_api: String::new(),
        }
    }
}

/// A pod name or namespace: a DNS subdomain (which also keeps it one path segment).
fn check_name(flag: &str, env: &str, value: &str) -> Result<(), String> {
    if value.is_empty() {
        return Err(format!(
            "--leader-label needs {flag} ({env}, from the downward API): it is not set"
        ));
    }
    let valid = value.len() <= 253
        && value
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && !value.starts_with(['-', '.'])
        && !value.ends_with(['-', '.']);
    if !valid {
        return Err(format!(
            "{flag} {value:?} is not a Kubernetes name (lower-case letters, digits, '-' and '.')"
        ));
    }
    Ok(())
}

/// The API base URL: `--kubernetes-api`, else the in-cluster Service environment.
fn api_base(
    flag: &str,
    host: Option<String>,
    port: Option<String>,
) -> Result<reqwest::Url, String> {
    let text = if !flag.is_empty() {
        flag.trim_end_matches('/').to_owned()
    } else {
        let (Some(host), Some(port)) = (
            host.filter(|h| !h.is_empty()),
            port.filter(|p| !p.is_empty()),
        ) else {
            return Err(
                "--leader-label needs the Kubernetes API address: KUBERNETES_SERVICE_HOST and \
                 KUBERNETES_SERVICE_PORT are not set (not in a pod?); set --kubernetes-api"
                    .into(),
            );
        };
        if port.parse::<u16>().is_err() {
            return Err(format!(
                "KUBERNETES_SERVICE_PORT {port:?} is not a port number (--leader-label)"
            ));
        }
        if host.contains(':') && !host.starts_with('[') {
            format!("https://[{host}]:{port}")
        } else {
            format!("https://{host}:{port}")
        }
    };
    let url = reqwest::Url::parse(&text)
        .map_err(|e| format!("--kubernetes-api {text:?}: not a URL: {e}"))?;
    if url.scheme() != "https" || url.host_str().is_none() {
        return Err(format!(
            "--kubernetes-api {text:?}: must be an https:// URL with a host"
        ));
    }
    Ok(url)
}

/// Publishes this replica's role as its pod's label.
pub struct LeaderLabel {
    client: reqwest::Client,
    url: reqwest::Url,
    token_path: PathBuf,
    /// `namespace/name`, for messages.
    pod: String,
    telemetry: Telemetry,
}

impl std::fmt::Debug for LeaderLabel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaderLabel")
            .field("pod", &self.pod)
            .field("url", &self.url.as_str())
            .finish_non_exhaustive()
    }
}

impl LeaderLabel {
    /// Checks the flags, the credentials and the API address; `None` when `--leader-label` is
    /// off. Reads the Service environment of this process.
    pub fn prepare(
        args: &LeaderLabelArgs,
        telemetry: Telemetry,
    ) -> Result<Option<LeaderLabel>, String> {
        LeaderLabel::prepare_with(
            args,
            std::env::var("KUBERNETES_SERVICE_HOST").ok(),
            std::env::var("KUBERNETES_SERVICE_PORT").ok(),
            telemetry,
        )
    }

    /// Like [`LeaderLabel::prepare`], with the Service environment given.
    pub fn prepare_with(
        args: &LeaderLabelArgs,
        host: Option<String>,
        port: Option<String>,
        telemetry: Telemetry,
    ) -> Result<Option<LeaderLabel>, String> {
        if !args.leader_label {
            return Ok(None);
        }
        check_name("--pod-name", "BIGFLEET_POD_NAME", &args.pod_name)?;
        check_name(
            "--pod-namespace",
            "BIGFLEET_POD_NAMESPACE",
            &args.pod_namespace,
        )?;
        let dir = PathBuf::from(&args.kubernetes_credentials);
        let token_path = dir.join("token");
        read_token(&token_path)?;
        let ca_path = dir.join("ca.crt");
        let ca = std::fs::read(&ca_path).map_err(|e| {
            format!(
                "--kubernetes-credentials: read the API's CA {}: {e}",
                ca_path.display()
            )
        })?;
        let certificates = crate::security::tls::parse_certificates(&ca).map_err(|e| {
            format!(
                "--kubernetes-credentials: the API's CA {}: {e}",
                ca_path.display()
            )
        })?;
        let mut roots = rustls::RootCertStore::empty();
        for certificate in certificates {
            roots.add(certificate).map_err(|e| {
                format!(
                    "--kubernetes-credentials: the API's CA {}: {e}",
                    ca_path.display()
                )
            })?;
        }
        let tls =
            rustls::ClientConfig::builder_with_provider(crate::security::tls::crypto_provider())
                .with_safe_default_protocol_versions()
                .map_err(|e| format!("Kubernetes API TLS: {e}"))?
                .with_root_certificates(roots)
                .with_no_client_auth();
        let client = reqwest::Client::builder()
            .use_preconfigured_tls(tls)
            .https_only(true)
            .connect_timeout(REQUEST_TIMEOUT)
            .timeout(REQUEST_TIMEOUT)
            .build()
            .map_err(|e| format!("Kubernetes API client: {e}"))?;
        let base = api_base(&args.kubernetes_api, host, port)?;
        let url = base
            .join(&format!(
                "/api/v1/namespaces/{}/pods/{}",
                args.pod_namespace, args.pod_name
            ))
            .map_err(|e| format!("--kubernetes-api: {e}"))?;
        Ok(Some(LeaderLabel {
            client,
            url,
            token_path,
            pod: format!("{}/{}", args.pod_namespace, args.pod_name),
            telemetry,
        }))
    }

    /// Sets the label once: `Ok` when the API accepted the patch.
    pub async fn set(&self, leader: bool) -> Result<(), String> {
        let token = read_token(&self.token_path)?;
        let value = if leader { "true" } else { "false" };
        let body = serde_json::json!({ "metadata": { "labels": { LABEL: value } } }).to_string();
        let mut authorization =
            reqwest::header::HeaderValue::from_str(&format!("Bearer {}", token.as_str())).map_err(
                |_| {
                    format!(
                        "the service account token {} is not a valid header value",
                        self.token_path.display()
                    )
                },
            )?;
        authorization.set_sensitive(true);
        let what = format!("label pod {} {LABEL}={value}", self.pod);
        let response = self
            .client
            .patch(self.url.clone())
            .header(reqwest::header::AUTHORIZATION, authorization)
            .header(
                reqwest::header::CONTENT_TYPE,
                "application/merge-patch+json",
            )
            .header(reqwest::header::ACCEPT, "application/json")
            .body(body)
            .send()
            .await
            .map_err(|e| redact(format!("{what}: {e}"), &token))?;
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        let text = response.text().await.unwrap_or_default();
        // The API answers a Status object; its message says why (RBAC, a missing pod).
        let message = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v.get("message").and_then(|m| m.as_str()).map(str::to_owned))
            .unwrap_or(text);
        let message: String = message.chars().take(300).collect();
        Err(redact(format!("{what}: HTTP {status}: {message}"), &token))
    }

    /// Keeps the label in step with the role until `stop`, then sets it to `false` (bounded).
    pub async fn run(self, mut roles: watch::Receiver<Role>, stop: CancellationToken) {
        let mut published: Option<bool> = None;
        let mut failures = 0u32;
        loop {
            let want = leads(*roles.borrow_and_update());
            if published != Some(want) {
                match self.set(want).await {
                    Ok(()) => {
                        self.telemetry.leader_label("success");
                        tracing::info!(
                            pod = self.pod,
                            label = LABEL,
                            value = want,
                            "leader label set"
                        );
                        published = Some(want);
                        failures = 0;
                    }
                    Err(e) => {
                        self.telemetry.leader_label("error");
                        failures += 1;
                        let wait = backoff(failures);
                        tracing::warn!(error = %e, retry_in_ms = wait.as_millis() as u64, "leader label: the Kubernetes API refused or did not answer; retrying");
                        tokio::select! {
                            _ = stop.cancelled() => break,
                            changed = roles.changed() => if changed.is_err() { break },
                            _ = tokio::time::sleep(wait) => {}
                        }
                        continue;
                    }
                }
            }
            tokio::select! {
                _ = stop.cancelled() => break,
                changed = roles.changed() => if changed.is_err() { break },
            }
        }
        if published != Some(false) {
            match tokio::time::timeout(SHUTDOWN_BUDGET, self.set(false)).await {
                Ok(Ok(())) => {
                    self.telemetry.leader_label("success");
                    tracing::info!(
                        pod = self.pod,
                        label = LABEL,
                        value = false,
                        "leader label set"
                    );
                }
                Ok(Err(e)) => {
                    self.telemetry.leader_label("error");
                    tracing::warn!(error = %e, "leader label: could not clear it at shutdown");
                }
                Err(_) => {
                    self.telemetry.leader_label("error");
                    tracing::warn!("leader label: the Kubernetes API did not answer at shutdown");
                }
            }
        }
    }
}

/// Whether a role is labelled leader.
fn leads(role: Role) -> bool {
    matches!(role, Role::Leader | Role::Single)
}

fn backoff(failures: u32) -> Duration {
    FIRST_BACKOFF
        .saturating_mul(1 << failures.saturating_sub(1).min(10))
        .min(MAX_BACKOFF)
}

/// Reads the service account token (trimmed); the error names the file, never its content.
fn read_token(path: &std::path::Path) -> Result<Zeroizing<String>, String> {
    let raw = Zeroizing::new(std::fs::read_to_string(path).map_err(|e| {
        format!(
            "--kubernetes-credentials: read the service account token {}: {e}",
            path.display()
        )
    })?);
    let token = Zeroizing::new(raw.trim().to_owned());
    if token.is_empty() {
        return Err(format!(
            "--kubernetes-credentials: the service account token {} is empty",
            path.display()
        ));
    }
    Ok(token)
}

/// Whatever an error says, the token is not in it.
fn redact(message: String, token: &str) -> String {
    if token.is_empty() {
        message
    } else {
        message.replace(token, "<token>")
    }
}

/// A loopback stand-in for the Kubernetes API's pod endpoint, for tests: HTTPS with the given
/// certificate, records every request and answers each with the next scripted status (200 once
/// the script is used up). A failing answer echoes the request's headers in its message, so a
/// client that repeats an answer verbatim would leak its token.
#[cfg(any(test, feature = "etcd-testing"))]
pub mod testing {
    use std::collections::{BTreeMap, VecDeque};
    use std::net::SocketAddr;
    use std::sync::{Arc, Mutex};

    use http_body_util::{BodyExt as _, Full};
    use hyper::body::{Bytes, Incoming};
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use rustls_pki_types::pem::PemObject as _;

    /// One request as the stand-in saw it.
    #[derive(Clone, Debug)]
    pub struct Seen {
        pub method: String,
        pub path: String,
        pub authorization: String,
        pub content_type: String,
        pub body: serde_json::Value,
    }

    #[derive(Default)]
    struct State {
        seen: Vec<Seen>,
        script: VecDeque<u16>,
        /// The last label value accepted per pod path.
        labels: BTreeMap<String, String>,
    }

    /// A running stand-in; stops when dropped.
    pub struct FakeKubeApi {
        pub addr: SocketAddr,
        state: Arc<Mutex<State>>,
        task: tokio::task::JoinHandle<()>,
    }

    impl Drop for FakeKubeApi {
        fn drop(&mut self) {
            self.task.abort();
        }
    }

    impl std::fmt::Debug for FakeKubeApi {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("FakeKubeApi")
                .field("addr", &self.addr)
                .finish_non_exhaustive()
        }
    }

    impl FakeKubeApi {
        /// Serves on 127.0.0.1 with `cert_pem`/`key_pem` (a certificate for 127.0.0.1).
        pub async fn start(cert_pem: &[u8], key_pem: &[u8]) -> FakeKubeApi {
            let certificates =
                crate::security::tls::parse_certificates(cert_pem).expect("certificate");
            let key = rustls_pki_types::PrivateKeyDer::from_pem_slice(key_pem).expect("key");
            let config = rustls::ServerConfig::builder_with_provider(
                crate::security::tls::crypto_provider(),
            )
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_no_client_auth()
            .with_single_cert(certificates, key)
            .expect("server config");
            let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let addr = listener.local_addr().expect("addr");
            let state = Arc::new(Mutex::new(State::default()));
            let shared = state.clone();
            let task = tokio::spawn(async move {
                while let Ok((tcp, _)) = listener.accept().await {
                    let (acceptor, state) = (acceptor.clone(), shared.clone());
                    tokio::spawn(async move {
                        let Ok(tls) = acceptor.accept(tcp).await else {
                            return;
                        };
                        let service = hyper::service::service_fn(move |req| {
                            let state = state.clone();
                            async move { Ok::<_, std::convert::Infallible>(answer(req, &state).await) }
                        });
                        let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                            .serve_connection(TokioIo::new(tls), service)
                            .await;
                    });
                }
            });
            FakeKubeApi { addr, state, task }
        }

        /// The next requests get these statuses, in order.
        pub fn fail_next(&self, statuses: &[u16]) {
            self.lock().script.extend(statuses.iter().copied());
        }

        pub fn seen(&self) -> Vec<Seen> {
            self.lock().seen.clone()
        }

        /// The label value last accepted for `namespace/name`.
        pub fn label(&self, namespace: &str, name: &str) -> Option<String> {
            self.lock()
                .labels
                .get(&format!("/api/v1/namespaces/{namespace}/pods/{name}"))
                .cloned()
        }

        fn lock(&self) -> std::sync::MutexGuard<'_, State> {
            self.state.lock().unwrap_or_else(|e| e.into_inner())
        }
    }

    async fn answer(
        req: hyper::Request<Incoming>,
        state: &Mutex<State>,
    ) -> hyper::Response<Full<Bytes>> {
        let header = |name: &str| {
            req.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_owned()
        };
        let (method, path) = (req.method().to_string(), req.uri().path().to_owned());
        let (authorization, content_type) = (header("authorization"), header("content-type"));
        let bytes = req
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let body = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
        let mut state = state.lock().unwrap_or_else(|e| e.into_inner());
        state.seen.push(Seen {
            method,
            path: path.clone(),
            authorization: authorization.clone(),
            content_type,
            body: body.clone(),
        });
        let status = state.script.pop_front().unwrap_or(200);
        let respond = |status: u16, body: String| {
            hyper::Response::builder()
                .status(status)
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(body)))
                .expect("response")
        };
        if status != 200 {
            let message =
                format!("refused by the test (request had authorization {authorization})");
            return respond(
                status,
                serde_json::json!({"kind": "Status", "status": "Failure", "message": message})
                    .to_string(),
            );
        }
        if let Some(value) = body
            .pointer(&format!("/metadata/labels/{}", super::LABEL))
            .and_then(|v| v.as_str())
        {
            state.labels.insert(path, value.to_owned());
        }
        respond(200, serde_json::json!({"kind": "Pod"}).to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::testing::FakeKubeApi;
    use super::*;

    const TOKEN: &str = "sa-token-4c1d9e0f7b2a";

    /// A self-signed certificate for 127.0.0.1 (as ca.crt and the stand-in's certificate).
    fn certificate() -> (String, String) {
        let params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()]).expect("params");
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = params.self_signed(&key).expect("self-signed");
        (cert.pem(), key.serialize_pem())
    }

    struct Fixture {
        api: FakeKubeApi,
        dir: tempfile::TempDir,
    }

    async fn fixture() -> Fixture {
        let (cert, key) = certificate();
        let api = FakeKubeApi::start(cert.as_bytes(), key.as_bytes()).await;
        let dir = tempfile::tempdir().expect("dir");
        std::fs::write(dir.path().join("token"), format!("{TOKEN}\n")).expect("token");
        std::fs::write(dir.path().join("ca.crt"), cert).expect("ca");
        Fixture { api, dir }
    }

    fn args(f: &Fixture) -> LeaderLabelArgs {
        LeaderLabelArgs {
            leader_label: true,
            pod_name: "provider-7d9f-x2k4p".into(),
            pod_namespace: "bigfleet".into(),
            kubernetes_credentials: f.dir.path().display().to_string(),
            kubernetes_api: String::new(),
        }
    }

    fn prepare(f: &Fixture, args: &LeaderLabelArgs) -> Result<Option<LeaderLabel>, String> {
        LeaderLabel::prepare_with(
            args,
            Some("127.0.0.1".into()),
            Some(f.api.addr.port().to_string()),
            Telemetry::new("bigfleet_labeltest"),
        )
    }

    #[tokio::test]
    async fn the_label_is_a_merge_patch_on_the_pod_with_the_bearer_token() {
        let f = fixture().await;
        let label = prepare(&f, &args(&f)).unwrap().expect("enabled");
        label.set(true).await.unwrap();
        label.set(false).await.unwrap();
        let seen = f.api.seen();
        assert_eq!(seen.len(), 2);
        for (request, value) in seen.iter().zip(["true", "false"]) {
            assert_eq!(request.method, "PATCH");
            assert_eq!(
                request.path,
                "/api/v1/namespaces/bigfleet/pods/provider-7d9f-x2k4p"
            );
            assert_eq!(request.authorization, format!("Bearer {TOKEN}"));
            assert_eq!(request.content_type, "application/merge-patch+json");
            assert_eq!(
                request.body,
                serde_json::json!({"metadata": {"labels": {"bigfleet-leader": value}}})
            );
        }
        assert_eq!(
            f.api.label("bigfleet", "provider-7d9f-x2k4p").as_deref(),
            Some("false")
        );
    }

    #[tokio::test]
    async fn an_api_server_whose_certificate_the_mounted_ca_did_not_sign_gets_no_request() {
        let f = fixture().await;
        // ca.crt now holds another CA than the one that signed the stand-in's certificate.
        let (other_ca, _) = certificate();
        std::fs::write(f.dir.path().join("ca.crt"), other_ca).expect("ca");
        let label = prepare(&f, &args(&f)).unwrap().expect("enabled");
        let err = label.set(true).await.expect_err("an unverified API server");
        assert!(
            !err.contains(TOKEN),
            "the token leaked into the error: {err}"
        );
        assert!(
            f.api.seen().is_empty(),
            "a request reached an API server the CA did not vouch for"
        );
        assert_eq!(f.api.label("bigfleet", "provider-7d9f-x2k4p"), None);
    }

    #[tokio::test]
    async fn a_refused_patch_is_an_error_without_the_token() {
        let f = fixture().await;
        let label = prepare(&f, &args(&f)).unwrap().expect("enabled");
        f.api.fail_next(&[403]);
        let err = label.set(true).await.expect_err("refused");
        assert!(err.contains("HTTP 403"), "{err}");
        assert!(err.contains("bigfleet/provider-7d9f-x2k4p"), "{err}");
        assert!(
            !err.contains(TOKEN),
            "the token leaked into the error: {err}"
        );
        // The stand-in did see it (so the redaction above was needed).
        assert_eq!(f.api.seen()[0].authorization, format!("Bearer {TOKEN}"));
        assert!(!format!("{label:?}").contains(TOKEN));
    }

    #[tokio::test]
    async fn the_publisher_retries_follows_the_role_and_clears_the_label_at_stop() {
        let f = fixture().await;
        let label = prepare(&f, &args(&f)).unwrap().expect("enabled");
        let (roles, rx) = watch::channel(Role::Standby);
        f.api.fail_next(&[500, 503]);
        let stop = CancellationToken::new();
        let task = tokio::spawn(label.run(rx, stop.clone()));
        let pod = || f.api.label("bigfleet", "provider-7d9f-x2k4p");
        let until = |want: &'static str| {
            let pod = &pod;
            async move {
                let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
                while pod().as_deref() != Some(want) {
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "the label did not become {want}"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        };
        until("false").await;
        assert_eq!(f.api.seen().len(), 3, "two failures, then the patch");
        roles.send_replace(Role::Leader);
        until("true").await;
        roles.send_replace(Role::Degraded);
        until("false").await;
        roles.send_replace(Role::Leader);
        until("true").await;
        stop.cancel();
        task.await.unwrap();
        assert_eq!(pod().as_deref(), Some("false"), "cleared at stop");
    }

    #[tokio::test]
    async fn flags_and_credentials_are_checked_at_startup() {
        let f = fixture().await;
        let telemetry = Telemetry::new("bigfleet_labeltest");
        let off = LeaderLabelArgs::default();
        assert!(prepare(&f, &off).unwrap().is_none());
        let check = |args: LeaderLabelArgs, host: Option<&str>, port: Option<&str>| {
            LeaderLabel::prepare_with(
                &args,
                host.map(str::to_owned),
                port.map(str::to_owned),
                telemetry,
            )
            .expect_err("refused")
        };
        let port = f.api.addr.port().to_string();
        let here = Some("127.0.0.1");
        let err = check(
            LeaderLabelArgs {
                pod_name: String::new(),
                ..args(&f)
            },
            here,
            Some(&port),
        );
        assert!(
            err.contains("--pod-name") && err.contains("BIGFLEET_POD_NAME"),
            "{err}"
        );
        let err = check(
            LeaderLabelArgs {
                pod_namespace: String::new(),
                ..args(&f)
            },
            here,
            Some(&port),
        );
        assert!(err.contains("--pod-namespace"), "{err}");
        let err = check(
            LeaderLabelArgs {
                pod_name: "../nodes/x".into(),
                ..args(&f)
            },
            here,
            Some(&port),
        );
        assert!(err.contains("--pod-name \"../nodes/x\""), "{err}");
        let missing = f.dir.path().join("nowhere");
        let err = check(
            LeaderLabelArgs {
                kubernetes_credentials: missing.display().to_string(),
                ..args(&f)
            },
            here,
            Some(&port),
        );
        assert!(
            err.contains("--kubernetes-credentials") && err.contains("token"),
            "{err}"
        );
        let err = check(args(&f), None, None);
        assert!(
            err.contains("KUBERNETES_SERVICE_HOST") && err.contains("--kubernetes-api"),
            "{err}"
        );
        let err = check(
            LeaderLabelArgs {
                kubernetes_api: "http://127.0.0.1:1".into(),
                ..args(&f)
            },
            None,
            None,
        );
        assert!(err.contains("https://"), "{err}");
        std::fs::write(f.dir.path().join("ca.crt"), "not a certificate").unwrap();
        let err = check(args(&f), here, Some(&port));
        assert!(err.contains("ca.crt"), "{err}");
        std::fs::write(f.dir.path().join("token"), "  \n").unwrap();
        let err = check(args(&f), here, Some(&port));
        assert!(err.contains("is empty"), "{err}");
        assert_eq!(
            api_base("", Some("fd00::1".into()), Some("443".into()))
                .unwrap()
                .as_str(),
            "https://[fd00::1]/"
        );
    }
}

//! The Hetzner Cloud API client: the request and response types of the `hcloud` crate, sent by
//! our own small executor so that every call is retried on 429/5xx with backoff and jitter,
//! honours `Retry-After` / `RateLimit-Reset`, stays within the caller's deadline, and is counted.
//!
//! Why not call `hcloud::apis::*` directly: the generated functions read the response body and
//! drop the headers, so a rate-limit reset hint could never be honoured, and they take a
//! `Configuration` whose derived `Debug` prints the bearer token. The executor below builds the
//! same requests (paths, query names, JSON bodies from `hcloud::models`) and parses responses
//! with the same `hcloud::models` types, so the wire format is still the crate's.
//!
//! The API token lives in a `provider_core::config::Secret` (its `Debug`/`Display` print
//! `[redacted]`); it is sent
//! as a header value marked sensitive and appears in no error text.

use std::collections::HashMap;
use std::time::Duration;

use hcloud::models;
use provider_core::budget::{ApiBudget, Limits, Settings};
use provider_core::cloud::{BodyError, MAX_RESPONSE_BODY, read_body};
use provider_core::config::Secret;
use provider_core::retry::{Backoff, Verdict, classify_status};
use provider_core::telemetry::{Telemetry, status_class};
use reqwest::{Method, Url};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::time::Instant;

/// The public Hetzner Cloud API.
pub const DEFAULT_ENDPOINT: &str = "https://api.hetzner.cloud/v1";

/// The largest page Hetzner serves.
const PER_PAGE: i64 = 50;

/// The `Authorization` header for `token`, marked sensitive so no `Debug` output shows it.
fn bearer(token: &Secret) -> Result<http::HeaderValue, ApiError> {
    let mut value = http::HeaderValue::from_str(&format!("Bearer {}", token.expose().trim()))
        .map_err(|_| {
            ApiError::Config(
                "the API token contains characters not allowed in an HTTP header".into(),
            )
        })?;
    value.set_sensitive(true);
    Ok(value)
}

/// A failed API call.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    /// Hetzner answered with an error status.
    #[error("hcloud {code} (HTTP {status}): {message}")]
    Status {
        status: u16,
        code: String,
        message: String,
        hint: Option<Duration>,
    },
    /// The request did not complete (connection refused, reset, timed out).
    #[error("hcloud request failed: {0}")]
    Transport(String),
    /// A response we could not parse.
    #[error("hcloud response could not be parsed: {0}")]
    Decode(String),
    /// The deadline passed before the call could be (re)tried.
    #[error("hcloud call gave up: deadline exceeded")]
    Deadline,
    /// The client is misconfigured.
    #[error("{0}")]
    Config(String),
}

impl ApiError {
    pub fn status(&self) -> Option<u16> {
        match self {
            ApiError::Status { status, .. } => Some(*status),
            _ => None,
        }
    }

    pub fn code(&self) -> Option<&str> {
        match self {
            ApiError::Status { code, .. } => Some(code),
            _ => None,
        }
    }

    /// Whether the request may have reached Hetzner and taken effect although it failed
    /// (a lost response): such a Create must be followed by a lookup, never blindly repeated.
    pub fn is_ambiguous(&self) -> bool {
        match self {
            ApiError::Transport(_) | ApiError::Decode(_) | ApiError::Deadline => true,
            ApiError::Status { status, .. } => *status >= 500,
            ApiError::Config(_) => false,
        }
    }
}

/// Which failures a request may be repeated after.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Repeat {
    /// Reads, deletes and label replacements: repeating them is harmless.
    Idempotent,
    /// Server creation: only a 429 (refused before any effect) is repeated here; the caller
    /// resolves every other failure by looking the server up.
    RefusedOnly,
}

fn classify(repeat: Repeat, err: &ApiError) -> Verdict {
    match (repeat, err) {
        (
            _,
            ApiError::Status {
                status: 429, hint, ..
            },
        ) => Verdict::Retry { after: *hint },
        (Repeat::RefusedOnly, _) => Verdict::Fatal,
        (
            Repeat::Idempotent,
            ApiError::Status {
                status, code, hint, ..
            },
        ) => {
            // Hetzner answers `conflict` and `locked` while another action holds the server.
            if code == "conflict" || code == "locked" {
                Verdict::Retry { after: *hint }
            } else {
                classify_status(*status, *hint)
            }
        }
        (Repeat::Idempotent, ApiError::Transport(_)) => Verdict::Retry { after: None },
        (Repeat::Idempotent, _) => Verdict::Fatal,
    }
}

/// Timing knobs of the client.
#[derive(Clone, Copy, Debug)]
pub struct ClientTiming {
    /// Upper bound of one HTTP request (further bounded by the caller's deadline).
    pub request_timeout: Duration,
    pub backoff: Backoff,
    /// The largest response body read ([`MAX_RESPONSE_BODY`]).
    pub max_body: usize,
    /// The project's API budget: Hetzner's published limits and this provider's shares.
    pub budget: Settings,
}

impl Default for ClientTiming {
    fn default() -> ClientTiming {
        ClientTiming {
            request_timeout: Duration::from_secs(30),
            backoff: Backoff::default(),
            max_body: MAX_RESPONSE_BODY,
            budget: Settings::new(Limits::HETZNER),
        }
    }
}

/// The Hetzner Cloud API, as this provider uses it.
#[derive(Clone)]
pub struct HcloudApi {
    http: reqwest::Client,
    base: Url,
    token: Secret,
    telemetry: Telemetry,
    timing: ClientTiming,
    /// Every request waits here for its turn and a token of the project's rate limit.
    budget: ApiBudget,
}

impl std::fmt::Debug for HcloudApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HcloudApi")
            .field("base", &self.base.as_str())
            .finish_non_exhaustive()
    }
}

/// Validates `--hcloud-endpoint`: `https://` anywhere, plain `http://` only on loopback.
pub fn parse_endpoint(endpoint: &str) -> Result<Url, String> {
    provider_core::encoding::parse_api_url("--hcloud-endpoint", endpoint)
}

impl HcloudApi {
    pub fn new(
        endpoint: &str,
        token: Secret,
        telemetry: Telemetry,
        timing: ClientTiming,
    ) -> Result<HcloudApi, String> {
        if token.expose().trim().is_empty() {
            return Err("hcloud: token is required for the hetzner backend".into());
        }
        bearer(&token).map_err(|e| e.to_string())?;
        let base = parse_endpoint(endpoint)?;
        let mut builder = reqwest::Client::builder()
            .user_agent(concat!("bigfleet-hetzner/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(Duration::from_secs(10));
        // HTTPS_PROXY / HTTP_PROXY / NO_PROXY apply to the real API; a loopback endpoint (an
        // emulator or a local mirror) is always reached directly.
        if provider_core::encoding::is_loopback(&base) {
            builder = builder.no_proxy();
        }
        let http = builder
            .build()
            .map_err(|e| format!("build the HTTP client: {e}"))?;
        Ok(HcloudApi {
            http,
            base,
            token,
            budget: timing.budget.budget(telemetry.prefix),
            telemetry,
            timing,
        })
    }

    /// The same client drawing on `budget` (one shared with other clients of the token).
    pub fn with_budget(mut self, budget: ApiBudget) -> HcloudApi {
        self.budget = budget;
        self
    }

    /// The budget this client's requests wait on.
    pub fn budget(&self) -> &ApiBudget {
        &self.budget
    }

    pub fn timing(&self) -> ClientTiming {
        self.timing
    }

    fn url(&self, path: &str) -> Url {
        let mut url = self.base.clone();
        let joined = format!("{}{}", url.path().trim_end_matches('/'), path);
        url.set_path(&joined);
        url
    }

    /// One HTTP request, no retries.
    async fn attempt<T: DeserializeOwned>(
        &self,
        endpoint: &'static str,
        method: &Method,
        path: &str,
        query: &[(&str, String)],
        body: Option<&serde_json::Value>,
        deadline: Option<Instant>,
    ) -> Result<T, ApiError> {
        self.budget
            .acquire(deadline)
            .await
            .map_err(|_| ApiError::Deadline)?;
        let mut timeout = self.timing.request_timeout;
        if let Some(deadline) = deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ApiError::Deadline);
            }
            timeout = timeout.min(left);
        }
        let mut request = self
            .http
            .request(method.clone(), self.url(path))
            .header(http::header::AUTHORIZATION, bearer(&self.token)?)
            .timeout(timeout);
        if !query.is_empty() {
            request = request.query(query);
        }
        if let Some(body) = body {
            request = request.json(body);
        }
        let response = match request.send().await {
            Ok(r) => r,
            Err(e) => {
                self.telemetry.api_http(endpoint, "error");
                return Err(ApiError::Transport(transport_text(e)));
            }
        };
        let status = response.status();
        self.telemetry
            .api_http(endpoint, status_class(status.as_u16()));
        self.budget.observe(status.as_u16(), response.headers());
        // After a 429 the retry waits in the budget: for the `Retry-After` if there was one,
        // else for the next token of the bucket, never for `RateLimit-Reset` (that is when the
        // bucket is full again, up to an hour away).
        let hint = (status.as_u16() == 429).then_some(Duration::ZERO);
        let body = read_body(response, self.timing.max_body)
            .await
            .map_err(|e| match e {
                BodyError::TooLarge { .. } => ApiError::Decode(e.to_string()),
                BodyError::Transport(e) => ApiError::Transport(transport_text(e)),
            })?;
        let text = String::from_utf8_lossy(&body).into_owned();
        if status.is_success() {
            let text = if text.trim().is_empty() {
                "{}"
            } else {
                text.as_str()
            };
            return serde_json::from_str(text).map_err(|e| ApiError::Decode(e.to_string()));
        }
        let (code, message) = match serde_json::from_str::<models::ErrorResponse>(&text) {
            Ok(body) => (body.error.code, body.error.message),
            Err(_) => (
                status
                    .canonical_reason()
                    .unwrap_or("error")
                    .to_lowercase()
                    .replace(' ', "_"),
                text.chars().take(200).collect(),
            ),
        };
        Err(ApiError::Status {
            status: status.as_u16(),
            code,
            message,
            hint,
        })
    }

    /// A request with retries per `repeat`, within `deadline`.
    #[allow(clippy::too_many_arguments)]
    async fn call<T: DeserializeOwned>(
        &self,
        endpoint: &'static str,
        method: Method,
        path: &str,
        query: &[(&str, String)],
        body: Option<serde_json::Value>,
        deadline: Option<Instant>,
        repeat: Repeat,
    ) -> Result<T, ApiError> {
        // A retry that finds no room in the budget before the deadline reports what made it
        // retry (a 429, a 503), not only that time ran out.
        let last = std::sync::Mutex::new(None::<ApiError>);
        let result = self
            .timing
            .backoff
            .run(
                deadline,
                |_| {
                    let attempt =
                        self.attempt(endpoint, &method, path, query, body.as_ref(), deadline);
                    let last = &last;
                    async move {
                        let result = attempt.await;
                        if let Err(e) = &result
                            && *e != ApiError::Deadline
                        {
                            *last.lock().unwrap_or_else(|e| e.into_inner()) = Some(e.clone());
                        }
                        result
                    }
                },
                |e| classify(repeat, e),
            )
            .await;
        match result {
            Err(ApiError::Deadline) => {
                let last = last.into_inner().unwrap_or_else(|e| e.into_inner());
                Err(last.unwrap_or(ApiError::Deadline))
            }
            other => other,
        }
    }

    /// Every item of a paged listing of `path` with `filters`, following pagination to the last
    /// page; `split` takes a page apart into its items and the next page. Any failed page fails
    /// the whole listing.
    async fn list_pages<R: DeserializeOwned, T>(
        &self,
        operation: &'static str,
        path: &str,
        filters: &[(&str, String)],
        deadline: Option<Instant>,
        split: impl Fn(R) -> (Vec<T>, Option<i64>),
    ) -> Result<Vec<T>, ApiError> {
        let mut items = Vec::new();
        let mut page = 1;
        loop {
            let mut query = filters.to_vec();
            query.push(("page", page.to_string()));
            query.push(("per_page", PER_PAGE.to_string()));
            let response: R = self
                .call(
                    operation,
                    Method::GET,
                    path,
                    &query,
                    None,
                    deadline,
                    Repeat::Idempotent,
                )
                .await?;
            let (batch, next_page) = split(response);
            items.extend(batch);
            match next_page {
                Some(next) if next > page => page = next,
                Some(next) => {
                    return Err(ApiError::Decode(format!(
                        "pagination went backwards (page {page}, next_page {next})"
                    )));
                }
                None => break,
            }
        }
        Ok(items)
    }

    /// Every server matching `selector`, following pagination to the last page. Any failed
    /// page fails the whole listing.
    pub async fn list_servers(
        &self,
        selector: &str,
        deadline: Option<Instant>,
    ) -> Result<Vec<models::Server>, ApiError> {
        self.list_pages(
            "GET /servers",
            "/servers",
            &[("label_selector", selector.to_owned())],
            deadline,
            |r: models::ListServersResponse| (r.servers, r.meta.pagination.next_page),
        )
        .await
    }

    /// The server named `name`, if any (names are unique in a project).
    pub async fn server_by_name(
        &self,
        name: &str,
        deadline: Option<Instant>,
    ) -> Result<Option<models::Server>, ApiError> {
        let query = [("name", name.to_owned())];
        let response: models::ListServersResponse = self
            .call(
                "GET /servers",
                Method::GET,
                "/servers",
                &query,
                None,
                deadline,
                Repeat::Idempotent,
            )
            .await?;
        Ok(response.servers.into_iter().find(|s| s.name == name))
    }

    /// One server; `None` when it does not exist.
    pub async fn get_server(
        &self,
        id: i64,
        deadline: Option<Instant>,
    ) -> Result<Option<models::Server>, ApiError> {
        let path = format!("/servers/{id}");
        let result: Result<models::GetServerResponse, _> = self
            .call(
                "GET /servers/{id}",
                Method::GET,
                &path,
                &[],
                None,
                deadline,
                Repeat::Idempotent,
            )
            .await;
        match result {
            Ok(response) => Ok(response.server.map(|s| *s)),
            Err(e) if e.status() == Some(404) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Creates a server. Only a 429 is repeated; see [`Repeat::RefusedOnly`].
    pub async fn create_server(
        &self,
        request: &models::CreateServerRequest,
        deadline: Option<Instant>,
    ) -> Result<models::Server, ApiError> {
        let body = to_json(request)?;
        let response: models::CreateServerResponse = self
            .call(
                "POST /servers",
                Method::POST,
                "/servers",
                &[],
                Some(body),
                deadline,
                Repeat::RefusedOnly,
            )
            .await?;
        Ok(*response.server)
    }

    /// Replaces the server's whole label map; the server as the write left it, when the
    /// answer carries it.
    pub async fn replace_labels(
        &self,
        id: i64,
        labels: HashMap<String, String>,
        deadline: Option<Instant>,
    ) -> Result<Option<models::Server>, ApiError> {
        let request = models::ReplaceServerRequest {
            labels: Some(labels),
            name: None,
        };
        let body = to_json(&request)?;
        let path = format!("/servers/{id}");
        let response: models::ReplaceServerResponse = self
            .call(
                "PUT /servers/{id}",
                Method::PUT,
                &path,
                &[],
                Some(body),
                deadline,
                Repeat::Idempotent,
            )
            .await?;
        Ok(response.server.map(|s| *s))
    }

    /// An idempotent DELETE where a resource that is already gone (404) counts as deleted.
    async fn delete_absent_ok<T: DeserializeOwned>(
        &self,
        label: &'static str,
        path: &str,
        deadline: Option<Instant>,
    ) -> Result<(), ApiError> {
        let result: Result<T, _> = self
            .call(
                label,
                Method::DELETE,
                path,
                &[],
                None,
                deadline,
                Repeat::Idempotent,
            )
            .await;
        match result {
            Ok(_) => Ok(()),
            Err(e) if e.status() == Some(404) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Deletes a server; one that does not exist counts as deleted.
    pub async fn delete_server(&self, id: i64, deadline: Option<Instant>) -> Result<(), ApiError> {
        let path = format!("/servers/{id}");
        self.delete_absent_ok::<models::DeleteServerResponse>(
            "DELETE /servers/{id}",
            &path,
            deadline,
        )
        .await
    }

    /// A server type by name.
    pub async fn server_type(
        &self,
        name: &str,
        deadline: Option<Instant>,
    ) -> Result<Option<models::ServerType>, ApiError> {
        let query = [("name", name.to_owned())];
        let response: models::ListServerTypesResponse = self
            .call(
                "GET /server_types",
                Method::GET,
                "/server_types",
                &query,
                None,
                deadline,
                Repeat::Idempotent,
            )
            .await?;
        Ok(response.server_types.into_iter().find(|t| t.name == name))
    }

    /// An image for `architecture`: by numeric id first (architecture ignored, as the
    /// reference does), else by name.
    pub async fn image(
        &self,
        name_or_id: &str,
        architecture: models::Architecture,
        deadline: Option<Instant>,
    ) -> Result<Option<models::Image>, ApiError> {
        if let Ok(id) = name_or_id.parse::<i64>() {
            let path = format!("/images/{id}");
            let result: Result<models::GetImageResponse, _> = self
                .call(
                    "GET /images/{id}",
                    Method::GET,
                    &path,
                    &[],
                    None,
                    deadline,
                    Repeat::Idempotent,
                )
                .await;
            match result {
                Ok(response) => {
                    if let Some(image) = response.image {
                        return Ok(Some(*image));
                    }
                }
                Err(e) if e.status() == Some(404) => {}
                Err(e) => return Err(e),
            }
        }
        let arch = match architecture {
            models::Architecture::Arm => "arm",
            models::Architecture::X86 => "x86",
        };
        let query = [
            ("name", name_or_id.to_owned()),
            ("architecture", arch.to_owned()),
        ];
        let response: models::ListImagesResponse = self
            .call(
                "GET /images",
                Method::GET,
                "/images",
                &query,
                None,
                deadline,
                Repeat::Idempotent,
            )
            .await?;
        Ok(response
            .images
            .into_iter()
            .find(|i| i.name.as_deref() == Some(name_or_id) && i.architecture == architecture))
    }

    /// A private network by numeric id or by name.
    pub async fn network(
        &self,
        name_or_id: &str,
        deadline: Option<Instant>,
    ) -> Result<Option<models::Network>, ApiError> {
        if let Ok(id) = name_or_id.parse::<i64>() {
            let path = format!("/networks/{id}");
            let result: Result<models::GetNetworkResponse, _> = self
                .call(
                    "GET /networks/{id}",
                    Method::GET,
                    &path,
                    &[],
                    None,
                    deadline,
                    Repeat::Idempotent,
                )
                .await;
            match result {
                Ok(response) => {
                    if let Some(network) = response.network {
                        return Ok(Some(*network));
                    }
                }
                Err(e) if e.status() == Some(404) => {}
                Err(e) => return Err(e),
            }
        }
        let query = [("name", name_or_id.to_owned())];
        let response: models::ListNetworksResponse = self
            .call(
                "GET /networks",
                Method::GET,
                "/networks",
                &query,
                None,
                deadline,
                Repeat::Idempotent,
            )
            .await?;
        Ok(response.networks.into_iter().find(|n| n.name == name_or_id))
    }

    /// A resource by numeric id (`GET /<kind>/{id}`, 404 is `None`) or else by name
    /// (`GET /<kind>?name=`); `one` and `many` take the resource out of either answer.
    #[allow(clippy::too_many_arguments)]
    async fn by_name_or_id<G: DeserializeOwned, L: DeserializeOwned, T>(
        &self,
        endpoints: (&'static str, &'static str),
        kind: &str,
        name_or_id: &str,
        deadline: Option<Instant>,
        one: impl Fn(G) -> Option<T>,
        many: impl Fn(L) -> Vec<T>,
        name_of: impl Fn(&T) -> &str,
    ) -> Result<Option<T>, ApiError> {
        if let Ok(id) = name_or_id.parse::<i64>() {
            let path = format!("/{kind}/{id}");
            let result: Result<G, _> = self
                .call(
                    endpoints.0,
                    Method::GET,
                    &path,
                    &[],
                    None,
                    deadline,
                    Repeat::Idempotent,
                )
                .await;
            match result {
                Ok(response) => {
                    if let Some(found) = one(response) {
                        return Ok(Some(found));
                    }
                }
                Err(e) if e.status() == Some(404) => {}
                Err(e) => return Err(e),
            }
        }
        let query = [("name", name_or_id.to_owned())];
        let response: L = self
            .call(
                endpoints.1,
                Method::GET,
                &format!("/{kind}"),
                &query,
                None,
                deadline,
                Repeat::Idempotent,
            )
            .await?;
        Ok(many(response)
            .into_iter()
            .find(|t| name_of(t) == name_or_id))
    }

    /// A firewall by numeric id or by name.
    pub async fn firewall(
        &self,
        name_or_id: &str,
        deadline: Option<Instant>,
    ) -> Result<Option<models::Firewall>, ApiError> {
        self.by_name_or_id(
            ("GET /firewalls/{id}", "GET /firewalls"),
            "firewalls",
            name_or_id,
            deadline,
            |r: models::GetFirewallResponse| Some(*r.firewall),
            |r: models::ListFirewallsResponse| r.firewalls,
            |f| &f.name,
        )
        .await
    }

    /// An SSH key by numeric id or by name.
    pub async fn ssh_key(
        &self,
        name_or_id: &str,
        deadline: Option<Instant>,
    ) -> Result<Option<models::SshKey>, ApiError> {
        self.by_name_or_id(
            ("GET /ssh_keys/{id}", "GET /ssh_keys"),
            "ssh_keys",
            name_or_id,
            deadline,
            |r: models::GetSshKeyResponse| Some(*r.ssh_key),
            |r: models::ListSshKeysResponse| r.ssh_keys,
            |k| &k.name,
        )
        .await
    }

    /// Every available image or snapshot matching `selector` built for `architecture`
    /// (one page of up to 50, newest first as the API sorts them on request).
    pub async fn images_by_selector(
        &self,
        selector: &str,
        architecture: models::Architecture,
        deadline: Option<Instant>,
    ) -> Result<Vec<models::Image>, ApiError> {
        let arch = match architecture {
            models::Architecture::Arm => "arm",
            models::Architecture::X86 => "x86",
        };
        let images = self
            .list_pages(
                "GET /images",
                "/images",
                &[
                    ("label_selector", selector.to_owned()),
                    ("architecture", arch.to_owned()),
                    ("status", "available".to_owned()),
                ],
                deadline,
                |r: models::ListImagesResponse| (r.images, r.meta.pagination.next_page),
            )
            .await?;
        Ok(images
            .into_iter()
            .filter(|i| {
                i.architecture == architecture && i.status == models::image::Status::Available
            })
            .collect())
    }

    /// Every placement group matching `selector`.
    pub async fn placement_groups(
        &self,
        selector: &str,
        deadline: Option<Instant>,
    ) -> Result<Vec<models::PlacementGroup>, ApiError> {
        self.list_pages(
            "GET /placement_groups",
            "/placement_groups",
            &[("label_selector", selector.to_owned())],
            deadline,
            |r: models::ListPlacementGroupsResponse| {
                (r.placement_groups, r.meta.pagination.next_page)
            },
        )
        .await
    }

    /// Creates a spread placement group (a 429 is repeated; a name clash is the caller's).
    pub async fn create_placement_group(
        &self,
        name: &str,
        labels: HashMap<String, String>,
        deadline: Option<Instant>,
    ) -> Result<models::PlacementGroup, ApiError> {
        let request = models::CreatePlacementgroupRequest {
            name: name.to_owned(),
            labels: Some(labels),
            r#type: models::create_placementgroup_request::Type::Spread,
        };
        let body = to_json(&request)?;
        let response: models::CreatePlacementgroupResponse = self
            .call(
                "POST /placement_groups",
                Method::POST,
                "/placement_groups",
                &[],
                Some(body),
                deadline,
                Repeat::RefusedOnly,
            )
            .await?;
        Ok(*response.placement_group)
    }

    /// Deletes a placement group; one that does not exist counts as deleted.
    pub async fn delete_placement_group(
        &self,
        id: i64,
        deadline: Option<Instant>,
    ) -> Result<(), ApiError> {
        let path = format!("/placement_groups/{id}");
        self.delete_absent_ok::<serde_json::Value>("DELETE /placement_groups/{id}", &path, deadline)
            .await
    }

    /// Attaches a server to a network in the subnet `ip_range`; already attached counts as done.
    pub async fn attach_to_network(
        &self,
        server: i64,
        network: i64,
        ip_range: Option<&str>,
        deadline: Option<Instant>,
    ) -> Result<(), ApiError> {
        let request = models::AttachServerToNetworkRequest {
            network,
            ip_range: ip_range.map(str::to_owned),
            ..Default::default()
        };
        let body = to_json(&request)?;
        let path = format!("/servers/{server}/actions/attach_to_network");
        let result: Result<serde_json::Value, _> = self
            .call(
                "POST /servers/{id}/actions/attach_to_network",
                Method::POST,
                &path,
                &[],
                Some(body),
                deadline,
                Repeat::Idempotent,
            )
            .await;
        match result {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Some("server_already_attached") => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Every location (the cheapest read that proves the token works).
    pub async fn locations(
        &self,
        deadline: Option<Instant>,
    ) -> Result<Vec<models::Location>, ApiError> {
        let query = [("per_page", PER_PAGE.to_string())];
        let response: models::ListLocationsResponse = self
            .call(
                "GET /locations",
                Method::GET,
                "/locations",
                &query,
                None,
                deadline,
                Repeat::Idempotent,
            )
            .await?;
        Ok(response.locations)
    }

    /// A location by name.
    pub async fn location(
        &self,
        name: &str,
        deadline: Option<Instant>,
    ) -> Result<Option<models::Location>, ApiError> {
        let query = [("name", name.to_owned())];
        let response: models::ListLocationsResponse = self
            .call(
                "GET /locations",
                Method::GET,
                "/locations",
                &query,
                None,
                deadline,
                Repeat::Idempotent,
            )
            .await?;
        Ok(response.locations.into_iter().find(|l| l.name == name))
    }
}

fn to_json(value: &impl Serialize) -> Result<serde_json::Value, ApiError> {
    serde_json::to_value(value).map_err(|e| ApiError::Decode(e.to_string()))
}

/// A transport error's text, with the URL's query string dropped (it may carry selectors but
/// never the token; the token travels only in a header).
fn transport_text(e: reqwest::Error) -> String {
    let kind = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "connection failed"
    } else {
        "transport error"
    };
    let place = e
        .url()
        .map(|u| format!(" ({} {})", u.host_str().unwrap_or(""), u.path()));
    let e = e.without_url();
    let mut text = format!("{kind}: {e}");
    let mut source = std::error::Error::source(&e);
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text.push_str(&place.unwrap_or_default());
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert!(parse_endpoint("https://api.hetzner.cloud/v1").is_ok());
        assert!(parse_endpoint("http://127.0.0.1:8080/v1/").is_ok());
        assert!(parse_endpoint("http://localhost:1/v1").is_ok());
        assert!(parse_endpoint("http://[::1]:1/v1").is_ok());
        let err = parse_endpoint("http://mirror.example.com/v1").unwrap_err();
        assert!(err.contains("only allowed for loopback"), "{err}");
        assert!(parse_endpoint("ftp://x/v1").is_err());
        assert!(parse_endpoint("not a url").is_err());
    }

    #[test]
    fn token_is_never_printed() {
        let token = Secret::new("s3cr3t-token");
        let header = bearer(&token).unwrap();
        assert!(header.is_sensitive());
        assert!(!format!("{header:?}").contains("s3cr3t"));
        let api = HcloudApi::new(
            "https://api.hetzner.cloud/v1",
            token,
            Telemetry::new("bigfleet_hetzner_test"),
            ClientTiming::default(),
        )
        .unwrap();
        assert!(!format!("{api:?}").contains("s3cr3t"));
        let err = HcloudApi::new(
            "https://api.hetzner.cloud/v1",
            Secret::new(" "),
            Telemetry::new("bigfleet_hetzner_test"),
            ClientTiming::default(),
        )
        .unwrap_err();
        assert_eq!(err, "hcloud: token is required for the hetzner backend");
    }

    #[test]
    fn urls_keep_the_base_path() {
        let api = HcloudApi::new(
            "http://127.0.0.1:9/prefix/v1/",
            Secret::new("t"),
            Telemetry::new("bigfleet_hetzner_test"),
            ClientTiming::default(),
        )
        .unwrap();
        assert_eq!(
            api.url("/servers").as_str(),
            "http://127.0.0.1:9/prefix/v1/servers"
        );
    }

    #[test]
    fn classification() {
        let status = |status: u16, code: &str| ApiError::Status {
            status,
            code: code.into(),
            message: String::new(),
            hint: None,
        };
        let retry = Verdict::Retry { after: None };
        assert_eq!(
            classify(Repeat::Idempotent, &status(429, "rate_limit_exceeded")),
            retry
        );
        assert_eq!(
            classify(Repeat::Idempotent, &status(503, "unavailable")),
            retry
        );
        assert_eq!(
            classify(Repeat::Idempotent, &status(409, "conflict")),
            retry
        );
        assert_eq!(classify(Repeat::Idempotent, &status(423, "locked")), retry);
        assert_eq!(
            classify(Repeat::Idempotent, &status(404, "not_found")),
            Verdict::Fatal
        );
        assert_eq!(
            classify(Repeat::Idempotent, &ApiError::Transport("x".into())),
            retry
        );
        assert_eq!(
            classify(Repeat::RefusedOnly, &status(429, "rate_limit_exceeded")),
            retry
        );
        assert_eq!(
            classify(Repeat::RefusedOnly, &status(503, "unavailable")),
            Verdict::Fatal
        );
        assert_eq!(
            classify(Repeat::RefusedOnly, &ApiError::Transport("x".into())),
            Verdict::Fatal
        );
        assert!(status(502, "x").is_ambiguous());
        assert!(!status(422, "invalid_input").is_ambiguous());
    }
}

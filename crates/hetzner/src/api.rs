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

use crate::models;
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
    /// Reads, deletes, label replacements and network attachments: repeating them is harmless.
    Idempotent,
    /// Creation (servers, placement groups): only a 429 (refused before any effect) is
    /// repeated here; the caller resolves every other failure, e.g. by looking the server up.
    RefusedOnly,
    /// Nothing is repeated here: the reads of a shared round, whose many waiters each decide
    /// whether to ask again.
    Never,
}

impl Repeat {
    /// What a request may repeat unless told otherwise: a method HTTP defines as idempotent
    /// (GET, PUT, DELETE) anything retryable, any other (POST) only a refusal.
    fn of(method: &Method) -> Repeat {
        if method.is_idempotent() {
            Repeat::Idempotent
        } else {
            Repeat::RefusedOnly
        }
    }
}

fn classify(repeat: Repeat, err: &ApiError) -> Verdict {
    match (repeat, err) {
        (Repeat::Never, _) => Verdict::Fatal,
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

    /// A request to `path` (below the base URL), counted under `endpoint`, the path's template
    /// (`GET /servers/{id}`). It repeats what [`Repeat::of`] allows for `method` unless told
    /// otherwise, and is sent by one of the `send` methods of [`Request`].
    fn request(
        &self,
        endpoint: &'static str,
        method: Method,
        path: impl Into<String>,
    ) -> Request<'_> {
        debug_assert!(
            endpoint.starts_with(&format!("{method} ")),
            "{endpoint:?} is not labelled as a {method} request"
        );
        Request {
            api: self,
            endpoint,
            repeat: Repeat::of(&method),
            method,
            path: path.into(),
            query: Vec::new(),
            body: None,
            invalid: None,
        }
    }

    /// A resource by numeric id (`GET <path>/{id}`; a 404 or an answer without it falls
    /// through) or else by name (`GET <path>?name=` with `filters`): the listed one named
    /// `name_or_id` that `keep` accepts.
    async fn by_name_or_id<G: DeserializeOwned, L: DeserializeOwned, T>(
        &self,
        lookup: Lookup<G, L, T>,
        name_or_id: &str,
        filters: impl IntoIterator<Item = (&'static str, String)>,
        keep: impl Fn(&T) -> bool,
        deadline: Option<Instant>,
    ) -> Result<Option<T>, ApiError> {
        if let Ok(id) = name_or_id.parse::<i64>() {
            let found = self
                .request(lookup.by_id, Method::GET, format!("{}/{id}", lookup.path))
                .send_optional(deadline)
                .await?
                .and_then(lookup.one);
            if found.is_some() {
                return Ok(found);
            }
        }
        let listed = self
            .request(lookup.by_name, Method::GET, lookup.path)
            .query([("name", name_or_id.to_owned())])
            .query(filters)
            .send(deadline)
            .await?;
        Ok((lookup.many)(listed)
            .into_iter()
            .find(|t| (lookup.name)(t) == Some(name_or_id) && keep(t)))
    }

    /// Every server matching `selector`, following pagination to the last page. Any failed
    /// page fails the whole listing.
    pub async fn list_servers(
        &self,
        selector: &str,
        deadline: Option<Instant>,
    ) -> Result<Vec<models::Server>, ApiError> {
        self.servers_matching(selector, Repeat::Idempotent, deadline)
            .await
    }

    /// [`HcloudApi::list_servers`] with each page asked once, without retries: for a round
    /// that answers many waiters, which decide on their own whether to ask again (a run of
    /// retries inside it would hold all of them).
    pub async fn list_servers_once(
        &self,
        selector: &str,
        deadline: Option<Instant>,
    ) -> Result<Vec<models::Server>, ApiError> {
        self.servers_matching(selector, Repeat::Never, deadline)
            .await
    }

    async fn servers_matching(
        &self,
        selector: &str,
        repeat: Repeat,
        deadline: Option<Instant>,
    ) -> Result<Vec<models::Server>, ApiError> {
        self.request("GET /servers", Method::GET, "/servers")
            .query([("label_selector", selector.to_owned())])
            .repeat(repeat)
            .send_paged(deadline, |r: models::ListServersResponse| {
                (r.servers, r.meta.pagination.next_page)
            })
            .await
    }

    /// How many servers match `selector`, in whatever status (`deleting` included), from one
    /// request: a page of one server, whose pagination counts them all (`total_entries`, or
    /// `last_page` when Hetzner leaves the total out).
    pub async fn count_servers(
        &self,
        selector: &str,
        deadline: Option<Instant>,
    ) -> Result<u64, ApiError> {
        let response: models::ListServersResponse = self
            .request("GET /servers", Method::GET, "/servers")
            .query(
                [
                    ("label_selector", selector.to_owned()),
                    ("per_page", "1".to_owned()),
                ]
                .into_iter()
                // An empty selector counts every server of the project.
                .filter(|(k, v)| *k != "label_selector" || !v.is_empty()),
            )
            .send(deadline)
            .await?;
        let pagination = &response.meta.pagination;
        let count = match (pagination.total_entries, pagination.last_page) {
            (Some(total), _) => total,
            // One server a page: the last page's number is the count.
            (None, Some(last)) if !response.servers.is_empty() => last,
            _ => response.servers.len() as i64,
        };
        u64::try_from(count)
            .map_err(|_| ApiError::Decode(format!("a server count of {count} is not a count")))
    }

    /// The server named `name`, if any (names are unique in a project).
    pub async fn server_by_name(
        &self,
        name: &str,
        deadline: Option<Instant>,
    ) -> Result<Option<models::Server>, ApiError> {
        let response: models::ListServersResponse = self
            .request("GET /servers", Method::GET, "/servers")
            .query([("name", name.to_owned())])
            .send(deadline)
            .await?;
        Ok(response.servers.into_iter().find(|s| s.name == name))
    }

    /// One server; `None` when it does not exist.
    pub async fn get_server(
        &self,
        id: i64,
        deadline: Option<Instant>,
    ) -> Result<Option<models::Server>, ApiError> {
        let response: Option<models::GetServerResponse> = self
            .request("GET /servers/{id}", Method::GET, format!("/servers/{id}"))
            .send_optional(deadline)
            .await?;
        Ok(response.and_then(|r| r.server))
    }

    /// Creates a server. Only a 429 is repeated; see [`Repeat::RefusedOnly`].
    pub async fn create_server(
        &self,
        request: &models::CreateServerRequest,
        deadline: Option<Instant>,
    ) -> Result<models::Server, ApiError> {
        let response: models::CreateServerResponse = self
            .request("POST /servers", Method::POST, "/servers")
            .json(request)
            .send(deadline)
            .await?;
        response
            .server
            .ok_or_else(|| ApiError::Decode("the answer to a create carries no server".into()))
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
        let response: models::ReplaceServerResponse = self
            .request("PUT /servers/{id}", Method::PUT, format!("/servers/{id}"))
            .json(&request)
            .send(deadline)
            .await?;
        Ok(response.server)
    }

    /// Deletes a server; one that does not exist counts as deleted.
    pub async fn delete_server(&self, id: i64, deadline: Option<Instant>) -> Result<(), ApiError> {
        self.request(
            "DELETE /servers/{id}",
            Method::DELETE,
            format!("/servers/{id}"),
        )
        .send_optional::<serde_json::Value>(deadline)
        .await?;
        Ok(())
    }

    /// Every server type, following pagination (the whole catalogue in one request today).
    pub async fn server_types(
        &self,
        deadline: Option<Instant>,
    ) -> Result<Vec<models::ServerType>, ApiError> {
        self.request("GET /server_types", Method::GET, "/server_types")
            .send_paged(deadline, |r: models::ListServerTypesResponse| {
                (r.server_types, r.meta.pagination.next_page)
            })
            .await
    }

    /// A server type by name.
    pub async fn server_type(
        &self,
        name: &str,
        deadline: Option<Instant>,
    ) -> Result<Option<models::ServerType>, ApiError> {
        let response: models::ListServerTypesResponse = self
            .request("GET /server_types", Method::GET, "/server_types")
            .query([("name", name.to_owned())])
            .send(deadline)
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
        self.by_name_or_id(
            Lookup {
                path: "/images",
                by_id: "GET /images/{id}",
                by_name: "GET /images",
                one: |r: models::GetImageResponse| r.image,
                many: |r: models::ListImagesResponse| r.images,
                name: |i| i.name.as_deref(),
            },
            name_or_id,
            [("architecture", architecture_name(architecture).to_owned())],
            |i| i.architecture == architecture,
            deadline,
        )
        .await
    }

    /// A private network by numeric id or by name.
    pub async fn network(
        &self,
        name_or_id: &str,
        deadline: Option<Instant>,
    ) -> Result<Option<models::Network>, ApiError> {
        self.by_name_or_id(
            Lookup {
                path: "/networks",
                by_id: "GET /networks/{id}",
                by_name: "GET /networks",
                one: |r: models::GetNetworkResponse| r.network,
                many: |r: models::ListNetworksResponse| r.networks,
                name: |n| Some(&n.name),
            },
            name_or_id,
            [],
            |_| true,
            deadline,
        )
        .await
    }

    /// A firewall by numeric id or by name.
    pub async fn firewall(
        &self,
        name_or_id: &str,
        deadline: Option<Instant>,
    ) -> Result<Option<models::Firewall>, ApiError> {
        self.by_name_or_id(
            Lookup {
                path: "/firewalls",
                by_id: "GET /firewalls/{id}",
                by_name: "GET /firewalls",
                one: |r: models::GetFirewallResponse| r.firewall,
                many: |r: models::ListFirewallsResponse| r.firewalls,
                name: |f| Some(&f.name),
            },
            name_or_id,
            [],
            |_| true,
            deadline,
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
            Lookup {
                path: "/ssh_keys",
                by_id: "GET /ssh_keys/{id}",
                by_name: "GET /ssh_keys",
                one: |r: models::GetSshKeyResponse| r.ssh_key,
                many: |r: models::ListSshKeysResponse| r.ssh_keys,
                name: |k| Some(&k.name),
            },
            name_or_id,
            [],
            |_| true,
            deadline,
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
        let images = self
            .request("GET /images", Method::GET, "/images")
            .query([
                ("label_selector", selector.to_owned()),
                ("architecture", architecture_name(architecture).to_owned()),
                ("status", "available".to_owned()),
            ])
            .send_paged(deadline, |r: models::ListImagesResponse| {
                (r.images, r.meta.pagination.next_page)
            })
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
        self.request("GET /placement_groups", Method::GET, "/placement_groups")
            .query([("label_selector", selector.to_owned())])
            .send_paged(deadline, |r: models::ListPlacementGroupsResponse| {
                (r.placement_groups, r.meta.pagination.next_page)
            })
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
        let response: models::CreatePlacementgroupResponse = self
            .request("POST /placement_groups", Method::POST, "/placement_groups")
            .json(&request)
            .send(deadline)
            .await?;
        response.placement_group.ok_or_else(|| {
            ApiError::Decode("the answer to a create carries no placement group".into())
        })
    }

    /// Deletes a placement group; one that does not exist counts as deleted.
    pub async fn delete_placement_group(
        &self,
        id: i64,
        deadline: Option<Instant>,
    ) -> Result<(), ApiError> {
        self.request(
            "DELETE /placement_groups/{id}",
            Method::DELETE,
            format!("/placement_groups/{id}"),
        )
        .send_optional::<serde_json::Value>(deadline)
        .await?;
        Ok(())
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
        let result = self
            .request(
                "POST /servers/{id}/actions/attach_to_network",
                Method::POST,
                format!("/servers/{server}/actions/attach_to_network"),
            )
            .json(&request)
            // Repeating an attach that took effect answers `server_already_attached`.
            .repeat(Repeat::Idempotent)
            .send::<serde_json::Value>(deadline)
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
        let response: models::ListLocationsResponse = self
            .request("GET /locations", Method::GET, "/locations")
            .query([("per_page", PER_PAGE.to_string())])
            .send(deadline)
            .await?;
        Ok(response.locations)
    }

    /// A location by name.
    pub async fn location(
        &self,
        name: &str,
        deadline: Option<Instant>,
    ) -> Result<Option<models::Location>, ApiError> {
        let response: models::ListLocationsResponse = self
            .request("GET /locations", Method::GET, "/locations")
            .query([("name", name.to_owned())])
            .send(deadline)
            .await?;
        Ok(response.locations.into_iter().find(|l| l.name == name))
    }
}

/// How one kind of resource is found by [`HcloudApi::by_name_or_id`].
struct Lookup<G, L, T> {
    /// The collection (`/images`); `<path>/{id}` is one of its members.
    path: &'static str,
    /// The endpoint labels of the look-up by id and of the listing by name.
    by_id: &'static str,
    by_name: &'static str,
    /// The resource in the answer to a look-up by id.
    one: fn(G) -> Option<T>,
    /// The resources in the answer to a listing by name.
    many: fn(L) -> Vec<T>,
    /// The resource's name, if it has one.
    name: fn(&T) -> Option<&str>,
}

/// One request being put together by [`HcloudApi::request`]; a `send` method runs it.
#[derive(Clone)]
#[must_use = "a request does nothing until it is sent"]
struct Request<'a> {
    api: &'a HcloudApi,
    /// The label the request is counted under in the API metrics.
    endpoint: &'static str,
    method: Method,
    path: String,
    query: Vec<(&'static str, String)>,
    body: Option<serde_json::Value>,
    /// A body that could not be serialized: `send` reports it and sends nothing.
    invalid: Option<ApiError>,
    repeat: Repeat,
}

impl Request<'_> {
    /// Appends query parameters.
    fn query(mut self, pairs: impl IntoIterator<Item = (&'static str, String)>) -> Self {
        self.query.extend(pairs);
        self
    }

    /// Sends `body` as JSON.
    fn json(mut self, body: &impl Serialize) -> Self {
        match serde_json::to_value(body) {
            Ok(body) => self.body = Some(body),
            Err(e) => self.invalid = Some(ApiError::Decode(e.to_string())),
        }
        self
    }

    /// Which failures the request is repeated after, instead of what its method allows.
    fn repeat(mut self, repeat: Repeat) -> Self {
        self.repeat = repeat;
        self
    }

    /// Sends the request, repeating it per its [`Repeat`] within `deadline`, and parses the
    /// answer (an empty body as `{}`). A retry that finds no room in the budget before the
    /// deadline reports the failure that made it retry (a 429, a 503), not only that time ran
    /// out.
    async fn send<T: DeserializeOwned>(self, deadline: Option<Instant>) -> Result<T, ApiError> {
        if let Some(invalid) = self.invalid {
            return Err(invalid);
        }
        let last = std::sync::Mutex::new(None::<ApiError>);
        let result = self
            .api
            .timing
            .backoff
            .run(
                deadline,
                |_| {
                    let attempt = self.attempt(deadline);
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
                |e| classify(self.repeat, e),
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

    /// [`Request::send`], where a 404 (no such resource, or for a DELETE one already gone) is
    /// `None`.
    async fn send_optional<T: DeserializeOwned>(
        self,
        deadline: Option<Instant>,
    ) -> Result<Option<T>, ApiError> {
        match self.send(deadline).await {
            Ok(found) => Ok(Some(found)),
            Err(e) if e.status() == Some(404) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Every item of a paged listing, following pagination to the last page; `split` takes a
    /// page apart into its items and the next page. Any failed page fails the whole listing.
    async fn send_paged<R: DeserializeOwned, T>(
        self,
        deadline: Option<Instant>,
        split: impl Fn(R) -> (Vec<T>, Option<i64>),
    ) -> Result<Vec<T>, ApiError> {
        let mut items = Vec::new();
        let mut page = 1;
        loop {
            let response: R = self
                .clone()
                .query([
                    ("page", page.to_string()),
                    ("per_page", PER_PAGE.to_string()),
                ])
                .send(deadline)
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

    /// One HTTP request, no retries.
    async fn attempt<T: DeserializeOwned>(&self, deadline: Option<Instant>) -> Result<T, ApiError> {
        let api = self.api;
        api.budget
            .acquire(deadline)
            .await
            .map_err(|_| ApiError::Deadline)?;
        let mut timeout = api.timing.request_timeout;
        if let Some(deadline) = deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ApiError::Deadline);
            }
            timeout = timeout.min(left);
        }
        let mut request = api
            .http
            .request(self.method.clone(), api.url(&self.path))
            .header(http::header::AUTHORIZATION, bearer(&api.token)?)
            .timeout(timeout);
        if !self.query.is_empty() {
            request = request.query(&self.query);
        }
        if let Some(body) = &self.body {
            request = request.json(body);
        }
        let response = match request.send().await {
            Ok(r) => r,
            Err(e) => {
                api.telemetry.api_http(self.endpoint, "error");
                return Err(ApiError::Transport(transport_text(e)));
            }
        };
        let status = response.status();
        // The budget learns from the answer before the answer is counted: an answer on the
        // metrics has been weighed by the budget they show.
        api.budget.observe(status.as_u16(), response.headers());
        api.telemetry
            .api_http(self.endpoint, status_class(status.as_u16()));
        // After a 429 the retry waits in the budget: for the `Retry-After` if there was one,
        // else for the next token of the bucket, never for `RateLimit-Reset` (that is when the
        // bucket is full again, up to an hour away).
        let hint = (status.as_u16() == 429).then_some(Duration::ZERO);
        let body = read_body(response, api.timing.max_body)
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
}

/// The `architecture` filter of image listings.
fn architecture_name(architecture: models::Architecture) -> &'static str {
    match architecture {
        models::Architecture::Arm => "arm",
        models::Architecture::X86 | models::Architecture::Unknown => "x86",
    }
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
        assert_eq!(Repeat::of(&Method::GET), Repeat::Idempotent);
        assert_eq!(Repeat::of(&Method::PUT), Repeat::Idempotent);
        assert_eq!(Repeat::of(&Method::DELETE), Repeat::Idempotent);
        assert_eq!(Repeat::of(&Method::POST), Repeat::RefusedOnly);
        assert!(status(502, "x").is_ambiguous());
        assert!(!status(422, "invalid_input").is_ambiguous());
    }
}

//! A small DigitalOcean API client over reqwest: the endpoints the provider needs (Droplets,
//! tags, sizes), a configurable base URL, pagination followed to the end, and retries with
//! backoff on 429/5xx and transport errors within the caller's deadline. Creates are never
//! re-sent here: [`crate::cloud`] looks the Droplet up before any second attempt.

use std::time::Duration;

use provider_core::budget::{ApiBudget, Limits, Settings};
use provider_core::cloud::{BodyError, MAX_RESPONSE_BODY, read_body};
use provider_core::retry::{Backoff, Verdict, classify_status};
use provider_core::telemetry::{Telemetry, status_class};
use reqwest::{Method, StatusCode, Url};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

/// The default API base URL.
pub const DEFAULT_API_URL: &str = "https://api.digitalocean.com";
/// Items per page for every list call (the API's maximum).
const PER_PAGE: u32 = 200;
/// A listing longer than this many pages is treated as a pagination loop.
const MAX_PAGES: usize = 10_000;

/// A DigitalOcean Personal Access Token. Never printed.
#[derive(Clone)]
pub struct ApiToken(String);

impl ApiToken {
    /// Trims surrounding whitespace and `'` quotes, so a token pasted as `'dop_v1_…'` works;
    /// `None` when nothing is left.
    pub fn new(raw: &str) -> Option<ApiToken> {
        let token = raw.trim_matches(|c: char| c.is_whitespace() || c == '\'');
        (!token.is_empty()).then(|| ApiToken(token.to_owned()))
    }
}

impl std::fmt::Debug for ApiToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiToken([redacted])")
    }
}

/// Parses `--do-api-url`: `https://` anywhere, `http://` only for loopback hosts.
pub fn parse_base_url(raw: &str) -> Result<Url, String> {
    provider_core::encoding::parse_api_url("--do-api-url", raw)
}

/// A failed API exchange. The text never contains the token.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    /// The API answered with a non-success status.
    #[error("{endpoint}: HTTP {status}: {message}")]
    Status {
        endpoint: &'static str,
        status: u16,
        message: String,
        #[doc(hidden)]
        retry_after: Option<Duration>,
    },
    /// No complete answer arrived (connection refused or dropped, timeout).
    #[error("{endpoint}: {message}")]
    Transport {
        endpoint: &'static str,
        message: String,
    },
    /// The answer did not decode as the expected JSON.
    #[error("{endpoint}: decode response: {message}")]
    Decode {
        endpoint: &'static str,
        message: String,
    },
    /// A `links.pages.next` link that cannot be followed; the listing is incomplete.
    #[error("bad pagination link: {0}")]
    BadLink(String),
}

impl ApiError {
    pub fn status(&self) -> Option<u16> {
        match self {
            ApiError::Status { status, .. } => Some(*status),
            _ => None,
        }
    }

    pub fn is_not_found(&self) -> bool {
        self.status() == Some(404)
    }

    /// Whether trying again may succeed (429, 5xx except 501, transport errors).
    pub fn verdict(&self) -> Verdict {
        match self {
            ApiError::Status {
                status,
                retry_after,
                ..
            } => classify_status(*status, *retry_after),
            ApiError::Transport { .. } => Verdict::Retry { after: None },
            ApiError::Decode { .. } | ApiError::BadLink(_) => Verdict::Fatal,
        }
    }
}

/// The Droplet fields the provider reads.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Droplet {
    pub id: u64,
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub status: String,
    #[serde(default)]
    pub tags: Vec<String>,
    #[serde(default)]
    pub size_slug: String,
    #[serde(default)]
    pub region: RegionRef,
    #[serde(default)]
    pub networks: Networks,
    #[serde(default)]
    pub vpc_uuid: Option<String>,
}

/// The fields of an account action the provider reads (`GET /v2/actions`).
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
pub struct Action {
    pub id: u64,
    /// `create`, `destroy`, `power_off`, ...
    #[serde(rename = "type", default)]
    pub kind: String,
    #[serde(default)]
    pub resource_id: Option<u64>,
    /// `droplet`, `volume`, `image`, ...
    #[serde(default)]
    pub resource_type: String,
}

impl Action {
    /// The Droplet this action destroyed, if it is a Droplet's destroy.
    pub fn destroyed_droplet(&self) -> Option<u64> {
        (self.kind == "destroy" && self.resource_type == "droplet")
            .then_some(self.resource_id)
            .flatten()
    }
}

/// One page of the account's actions, newest first.
#[derive(Clone, Debug, Default)]
pub struct ActionPage {
    pub actions: Vec<Action>,
    /// Whether an older page follows.
    pub more: bool,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct RegionRef {
    #[serde(default)]
    pub slug: String,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct Networks {
    #[serde(default)]
    pub v4: Vec<NetworkV4>,
    #[serde(default)]
    pub v6: Vec<NetworkV4>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct NetworkV4 {
    #[serde(default)]
    pub ip_address: String,
    #[serde(default, rename = "type")]
    pub kind: String,
}

impl Droplet {
    pub fn public_ipv4(&self) -> Option<String> {
        self.networks
            .v4
            .iter()
            .find(|n| n.kind == "public" && !n.ip_address.is_empty())
            .map(|n| n.ip_address.clone())
    }

    /// The Droplet's address in its VPC.
    pub fn private_ipv4(&self) -> Option<String> {
        self.networks
            .v4
            .iter()
            .find(|n| n.kind == "private" && !n.ip_address.is_empty())
            .map(|n| n.ip_address.clone())
    }

    pub fn has_tag(&self, tag: &str) -> bool {
        self.tags.iter().any(|t| t == tag)
    }
}

/// One entry of the size catalogue.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Size {
    pub slug: String,
    /// Memory in MB (used as MiB, as DigitalOcean's own tooling does).
    #[serde(default)]
    pub memory: u64,
    #[serde(default)]
    pub vcpus: u32,
    /// Local disk in GB.
    #[serde(default)]
    pub disk: u64,
    #[serde(default)]
    pub price_hourly: f64,
    #[serde(default)]
    pub available: bool,
    #[serde(default)]
    pub regions: Vec<String>,
}

/// The image of a new Droplet: a numeric image or snapshot id, or a slug.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum ImageRef {
    Id(i64),
    Slug(String),
}

impl ImageRef {
    /// A value that parses as an integer (optional sign, digits) is an id, anything else a slug.
    pub fn parse(raw: &str) -> ImageRef {
        raw.parse::<i64>()
            .map(ImageRef::Id)
            .unwrap_or_else(|_| ImageRef::Slug(raw.to_owned()))
    }
}

/// A login SSH key of a new Droplet: its numeric id or its fingerprint.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(untagged)]
pub enum SshKeyRef {
    Id(u64),
    Fingerprint(String),
}

/// The body of `POST /v2/droplets`.
#[derive(Clone, Serialize)]
pub struct CreateDroplet {
    pub name: String,
    pub region: String,
    pub size: String,
    pub image: ImageRef,
    /// The VPC to place the Droplet in; without it DigitalOcean uses the region's default VPC.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vpc_uuid: Option<String>,
    pub ipv6: bool,
    pub monitoring: bool,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ssh_keys: Vec<SshKeyRef>,
    pub user_data: String,
    pub tags: Vec<String>,
}

impl std::fmt::Debug for CreateDroplet {
    // user_data embeds the agent token: never print it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CreateDroplet")
            .field("name", &self.name)
            .field("region", &self.region)
            .field("size", &self.size)
            .field("image", &self.image)
            .field("vpc_uuid", &self.vpc_uuid)
            .field("ipv6", &self.ipv6)
            .field("monitoring", &self.monitoring)
            .field("ssh_keys", &self.ssh_keys)
            .field("tags", &self.tags)
            .finish_non_exhaustive()
    }
}

/// `GET /v2/account`: the fields a check reports.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Account {
    #[serde(default)]
    pub uuid: String,
    #[serde(default)]
    pub status: String,
    #[serde(default)]
    pub status_message: String,
    #[serde(default)]
    pub droplet_limit: u64,
}

/// One region of `GET /v2/regions`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Region {
    pub slug: String,
    #[serde(default)]
    pub available: bool,
    #[serde(default)]
    pub sizes: Vec<String>,
}

/// An image: public distribution image, snapshot, custom image or backup.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Image {
    pub id: i64,
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub slug: Option<String>,
    #[serde(default, rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub regions: Vec<String>,
    #[serde(default)]
    pub status: String,
    #[serde(default)]
    pub public: bool,
    #[serde(default)]
    pub created_at: String,
}

/// A VPC network.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Vpc {
    pub id: String,
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub region: String,
    #[serde(default)]
    pub ip_range: String,
}

/// An SSH key of the account.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct SshKey {
    pub id: u64,
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub fingerprint: String,
}

/// A cloud firewall: it applies to the Droplets it names and to every Droplet with one of its
/// tags.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Firewall {
    pub id: String,
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub tags: Vec<String>,
    #[serde(default)]
    pub status: String,
}

#[derive(Deserialize)]
struct DropletEnvelope {
    droplet: Droplet,
}

#[derive(Deserialize)]
struct DropletPage {
    #[serde(default)]
    droplets: Vec<Droplet>,
    #[serde(default)]
    links: Links,
}

#[derive(Deserialize)]
struct ActionList {
    #[serde(default)]
    actions: Vec<Action>,
    #[serde(default)]
    links: Links,
}

#[derive(Deserialize)]
struct SizePage {
    #[serde(default)]
    sizes: Vec<Size>,
    #[serde(default)]
    links: Links,
}

#[derive(Default, Deserialize)]
struct Links {
    #[serde(default)]
    pages: Pages,
}

#[derive(Default, Deserialize)]
struct Pages {
    #[serde(default)]
    next: Option<String>,
}

#[derive(Deserialize)]
struct ErrorBody {
    #[serde(default)]
    id: String,
    #[serde(default)]
    message: String,
}

/// The client. Cheap to clone.
#[derive(Clone)]
pub struct ApiClient {
    http: reqwest::Client,
    base: Url,
    token: ApiToken,
    backoff: Backoff,
    telemetry: Telemetry,
    /// Every request waits here for its turn and a token of the token's rate limits.
    budget: ApiBudget,
}

impl std::fmt::Debug for ApiClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiClient")
            .field("base", &self.base.as_str())
            .finish_non_exhaustive()
    }
}

/// Per-request timeout, so a hung connection cannot eat a whole transition budget.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// The message of a request that found no room in the API budget before its deadline.
const NO_ROOM: &str = "not sent: the API budget had no room for it before the deadline";

impl ApiClient {
    pub fn new(
        base: Url,
        token: ApiToken,
        backoff: Backoff,
        telemetry: Telemetry,
    ) -> Result<ApiClient, String> {
        let mut builder = reqwest::Client::builder()
            .use_rustls_tls()
            .connect_timeout(Duration::from_secs(10))
            .user_agent(concat!("bigfleet-digitalocean/", env!("CARGO_PKG_VERSION")));
        if provider_core::encoding::is_loopback(&base) {
            // A local emulator or mirror: a configured HTTP(S)_PROXY must not intercept it.
            builder = builder.no_proxy();
        }
        let http = builder
            .build()
            .map_err(|e| format!("build DigitalOcean HTTP client: {e}"))?;
        Ok(ApiClient {
            http,
            base,
            token,
            backoff,
            budget: Settings::new(Limits::DIGITALOCEAN).budget(telemetry.prefix),
            telemetry,
        })
    }

    /// The same client drawing on `budget` (one shared with other clients of the token, or
    /// time-scaled against an emulator).
    pub fn with_budget(mut self, budget: ApiBudget) -> ApiClient {
        self.budget = budget;
        self
    }

    /// The budget this client's requests wait on.
    pub fn budget(&self) -> &ApiBudget {
        &self.budget
    }

    fn url(&self, path: &str) -> Url {
        let mut url = self.base.clone();
        let prefix = url.path().trim_end_matches('/').to_owned();
        url.set_path(&format!("{prefix}{path}"));
        url
    }

    /// A request to `path` (below the base URL), counted under `endpoint`, the path's template
    /// (`GET /v2/droplets/{id}`). It is retried unless [`Request::once`] says otherwise, and
    /// sent by one of the `send` methods of [`Request`].
    fn request(&self, endpoint: &'static str, method: Method, path: &str) -> Request<'_> {
        debug_assert!(
            endpoint.starts_with(&format!("{method} ")),
            "{endpoint:?} is not labelled as a {method} request"
        );
        Request {
            client: self,
            endpoint,
            method,
            url: self.url(path),
            body: None,
            invalid: None,
            retried: true,
        }
    }

    /// `POST /v2/droplets`, sent exactly once: the caller decides whether a failed create may
    /// be sent again, after checking that no Droplet was created.
    pub async fn create_droplet(
        &self,
        request: &CreateDroplet,
        deadline: Instant,
    ) -> Result<Droplet, ApiError> {
        let created: DropletEnvelope = self
            .request("POST /v2/droplets", Method::POST, "/v2/droplets")
            .json(request)
            .once()
            .send(deadline)
            .await?;
        Ok(created.droplet)
    }

    pub async fn get_droplet(&self, id: u64, deadline: Instant) -> Result<Droplet, ApiError> {
        let found: DropletEnvelope = self
            .request(
                "GET /v2/droplets/{id}",
                Method::GET,
                &format!("/v2/droplets/{id}"),
            )
            .send(deadline)
            .await?;
        Ok(found.droplet)
    }

    /// A single `GET /v2/droplets/{id}` without retries (the caller polls).
    pub async fn get_droplet_once(&self, id: u64, deadline: Instant) -> Result<Droplet, ApiError> {
        let found: DropletEnvelope = self
            .request(
                "GET /v2/droplets/{id}",
                Method::GET,
                &format!("/v2/droplets/{id}"),
            )
            .once()
            .send(deadline)
            .await?;
        Ok(found.droplet)
    }

    /// `DELETE /v2/droplets/{id}`; a Droplet that is already gone is reported as 404.
    pub async fn delete_droplet(&self, id: u64, deadline: Instant) -> Result<(), ApiError> {
        self.request(
            "DELETE /v2/droplets/{id}",
            Method::DELETE,
            &format!("/v2/droplets/{id}"),
        )
        .send_ignoring_answer(deadline)
        .await
    }

    /// Every Droplet carrying `tag`, all pages.
    pub async fn list_droplets_by_tag(
        &self,
        tag: &str,
        deadline: Instant,
    ) -> Result<Vec<Droplet>, ApiError> {
        self.droplets_tagged(tag, true, deadline).await
    }

    /// [`ApiClient::list_droplets_by_tag`] with each page asked once, without retries: for a
    /// round that answers many waiters, which decide on their own whether to ask again (a
    /// run of retries inside it would hold all of them).
    pub async fn list_droplets_by_tag_once(
        &self,
        tag: &str,
        deadline: Instant,
    ) -> Result<Vec<Droplet>, ApiError> {
        self.droplets_tagged(tag, false, deadline).await
    }

    async fn droplets_tagged(
        &self,
        tag: &str,
        retried: bool,
        deadline: Instant,
    ) -> Result<Vec<Droplet>, ApiError> {
        let request = self
            .request("GET /v2/droplets", Method::GET, "/v2/droplets")
            .query(&[("tag_name", tag)]);
        let request = if retried { request } else { request.once() };
        request
            .send_paged(deadline, |page: DropletPage| {
                Ok((page.droplets, page.links.pages.next))
            })
            .await
    }

    /// How many Droplets the account has (in every region, whoever made them), from one
    /// request: a page of one Droplet, whose `meta.total` counts them all.
    pub async fn count_droplets(&self, deadline: Instant) -> Result<u64, ApiError> {
        #[derive(Deserialize)]
        struct Counted {
            #[serde(default)]
            meta: Option<CountMeta>,
        }
        #[derive(Deserialize)]
        struct CountMeta {
            #[serde(default)]
            total: u64,
        }
        let counted: Counted = self
            .request("GET /v2/droplets", Method::GET, "/v2/droplets")
            .query(&[("per_page", "1")])
            .send(deadline)
            .await?;
        Ok(counted.meta.map_or(0, |m| m.total))
    }

    /// Page `page` (from 1) of the account's actions, newest first, [`PER_PAGE`] a page.
    pub async fn list_actions(&self, page: u32, deadline: Instant) -> Result<ActionPage, ApiError> {
        let listed: ActionList = self
            .request("GET /v2/actions", Method::GET, "/v2/actions")
            .query(&[
                ("page", &page.to_string()),
                ("per_page", &PER_PAGE.to_string()),
            ])
            .send(deadline)
            .await?;
        Ok(ActionPage {
            actions: listed.actions,
            more: listed.links.pages.next.is_some_and(|n| !n.is_empty()),
        })
    }

    /// The whole size catalogue, all pages.
    pub async fn list_sizes(&self, deadline: Instant) -> Result<Vec<Size>, ApiError> {
        self.request("GET /v2/sizes", Method::GET, "/v2/sizes")
            .send_paged(deadline, |page: SizePage| {
                Ok((page.sizes, page.links.pages.next))
            })
            .await
    }

    /// Every item under `key` of the paged listing at `path` (with `query`), all pages.
    async fn list_all<T: DeserializeOwned>(
        &self,
        endpoint: &'static str,
        path: &str,
        query: &[(&str, &str)],
        key: &'static str,
        deadline: Instant,
    ) -> Result<Vec<T>, ApiError> {
        self.request(endpoint, Method::GET, path)
            .query(query)
            .send_paged(deadline, |mut page: serde_json::Value| {
                let items = page.get_mut(key).map(serde_json::Value::take);
                let items: Vec<T> = match items {
                    None | Some(serde_json::Value::Null) => Vec::new(),
                    Some(items) => serde_json::from_value(items).map_err(|e| ApiError::Decode {
                        endpoint,
                        message: e.to_string(),
                    })?,
                };
                let links: Links = page
                    .get_mut("links")
                    .map(serde_json::Value::take)
                    .and_then(|l| serde_json::from_value(l).ok())
                    .unwrap_or_default();
                Ok((items, links.pages.next))
            })
            .await
    }

    /// One object under `key` at `/v2/{segments...}` (each segment path-escaped).
    async fn get_one<T: DeserializeOwned>(
        &self,
        endpoint: &'static str,
        segments: &[&str],
        key: &'static str,
        deadline: Instant,
    ) -> Result<T, ApiError> {
        let mut doc: serde_json::Value = self
            .request(endpoint, Method::GET, "/v2")
            .segments(segments)
            .send(deadline)
            .await?;
        let item = doc
            .get_mut(key)
            .map(serde_json::Value::take)
            .unwrap_or_default();
        serde_json::from_value(item).map_err(|e| ApiError::Decode {
            endpoint,
            message: e.to_string(),
        })
    }

    /// `GET /v2/account`: also proves the token works.
    pub async fn get_account(&self, deadline: Instant) -> Result<Account, ApiError> {
        self.get_one("GET /v2/account", &["account"], "account", deadline)
            .await
    }

    pub async fn list_regions(&self, deadline: Instant) -> Result<Vec<Region>, ApiError> {
        self.list_all("GET /v2/regions", "/v2/regions", &[], "regions", deadline)
            .await
    }

    /// `GET /v2/images/{id or slug}`.
    pub async fn get_image(&self, id_or_slug: &str, deadline: Instant) -> Result<Image, ApiError> {
        self.get_one(
            "GET /v2/images/{image}",
            &["images", id_or_slug],
            "image",
            deadline,
        )
        .await
    }

    /// The account's own images (snapshots, custom images, backups), all pages.
    pub async fn list_private_images(&self, deadline: Instant) -> Result<Vec<Image>, ApiError> {
        self.list_all(
            "GET /v2/images",
            "/v2/images",
            &[("private", "true")],
            "images",
            deadline,
        )
        .await
    }

    pub async fn get_vpc(&self, id: &str, deadline: Instant) -> Result<Vpc, ApiError> {
        self.get_one("GET /v2/vpcs/{id}", &["vpcs", id], "vpc", deadline)
            .await
    }

    /// `GET /v2/account/keys/{id or fingerprint}`.
    pub async fn get_ssh_key(
        &self,
        id_or_fingerprint: &str,
        deadline: Instant,
    ) -> Result<SshKey, ApiError> {
        self.get_one(
            "GET /v2/account/keys/{key}",
            &["account", "keys", id_or_fingerprint],
            "ssh_key",
            deadline,
        )
        .await
    }

    pub async fn list_ssh_keys(&self, deadline: Instant) -> Result<Vec<SshKey>, ApiError> {
        self.list_all(
            "GET /v2/account/keys",
            "/v2/account/keys",
            &[],
            "ssh_keys",
            deadline,
        )
        .await
    }

    pub async fn list_firewalls(&self, deadline: Instant) -> Result<Vec<Firewall>, ApiError> {
        self.list_all(
            "GET /v2/firewalls",
            "/v2/firewalls",
            &[],
            "firewalls",
            deadline,
        )
        .await
    }

    /// `POST /v2/tags`; a tag that already exists (422) is fine.
    pub async fn ensure_tag(&self, tag: &str, deadline: Instant) -> Result<(), ApiError> {
        match self
            .request("POST /v2/tags", Method::POST, "/v2/tags")
            .json(&serde_json::json!({ "name": tag }))
            .send_ignoring_answer(deadline)
            .await
        {
            Ok(()) => Ok(()),
            Err(e) if e.status() == Some(422) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// `POST /v2/tags/{tag}/resources` for one Droplet.
    pub async fn tag_droplet(&self, tag: &str, id: u64, deadline: Instant) -> Result<(), ApiError> {
        self.tag_resources(
            "POST /v2/tags/{tag}/resources",
            Method::POST,
            tag,
            &[id],
            deadline,
        )
        .await
    }

    /// `DELETE /v2/tags/{tag}/resources` for one Droplet.
    pub async fn untag_droplet(
        &self,
        tag: &str,
        id: u64,
        deadline: Instant,
    ) -> Result<(), ApiError> {
        self.tag_resources(
            "DELETE /v2/tags/{tag}/resources",
            Method::DELETE,
            tag,
            &[id],
            deadline,
        )
        .await
    }

    /// `DELETE /v2/tags/{tag}/resources` for several Droplets in one request, sent once (the
    /// caller repeats it later if it fails).
    pub async fn untag_droplets_once(
        &self,
        tag: &str,
        ids: &[u64],
        deadline: Instant,
    ) -> Result<(), ApiError> {
        self.request(
            "DELETE /v2/tags/{tag}/resources",
            Method::DELETE,
            "/v2/tags",
        )
        .segments(&[tag, "resources"])
        .json(&resources_body(ids))
        .once()
        .send_ignoring_answer(deadline)
        .await
    }

    async fn tag_resources(
        &self,
        endpoint: &'static str,
        method: Method,
        tag: &str,
        ids: &[u64],
        deadline: Instant,
    ) -> Result<(), ApiError> {
        self.request(endpoint, method, "/v2/tags")
            .segments(&[tag, "resources"])
            .json(&resources_body(ids))
            .send_ignoring_answer(deadline)
            .await
    }
}

/// The body of a tag change: the Droplets `ids`.
fn resources_body(ids: &[u64]) -> serde_json::Value {
    let resources: Vec<serde_json::Value> = ids
        .iter()
        .map(|id| serde_json::json!({ "resource_id": id.to_string(), "resource_type": "droplet" }))
        .collect();
    serde_json::json!({ "resources": resources })
}

/// One request being put together by [`ApiClient::request`]; a `send` method runs it.
#[must_use = "a request does nothing until it is sent"]
struct Request<'a> {
    client: &'a ApiClient,
    /// The label the request is counted under in the API metrics.
    endpoint: &'static str,
    method: Method,
    url: Url,
    body: Option<serde_json::Value>,
    /// A part of the request that could not be built: `send` reports it and sends nothing.
    invalid: Option<ApiError>,
    /// Whether retryable failures are retried (see [`ApiError::verdict`]).
    retried: bool,
}

impl Request<'_> {
    /// Appends path segments, each path-escaped.
    fn segments(mut self, segments: &[&str]) -> Self {
        match self.url.path_segments_mut() {
            Ok(mut path) => {
                path.extend(segments);
            }
            Err(()) => {
                self.invalid = Some(ApiError::BadLink("base URL cannot carry a path".into()));
            }
        }
        self
    }

    /// Appends query parameters.
    fn query(mut self, pairs: &[(&str, &str)]) -> Self {
        if !pairs.is_empty() {
            self.url.query_pairs_mut().extend_pairs(pairs);
        }
        self
    }

    /// Sends `body` as JSON.
    fn json(mut self, body: &impl Serialize) -> Self {
        match serde_json::to_value(body) {
            Ok(body) => self.body = Some(body),
            Err(e) => {
                self.invalid = Some(ApiError::Decode {
                    endpoint: self.endpoint,
                    message: e.to_string(),
                });
            }
        }
        self
    }

    /// Sends the request exactly once, whatever the failure (a create, whose repetition the
    /// caller decides; a poll, which the caller repeats).
    fn once(mut self) -> Self {
        self.retried = false;
        self
    }

    /// Sends the request and decodes the answer.
    async fn send<T: DeserializeOwned>(self, deadline: Instant) -> Result<T, ApiError> {
        decode(self.endpoint, &self.send_for_body(deadline).await?)
    }

    /// Sends the request; the answer's body is not decoded.
    async fn send_ignoring_answer(self, deadline: Instant) -> Result<(), ApiError> {
        self.send_for_body(deadline).await.map(drop)
    }

    /// Every item of a paged listing: sends the request, then follows every
    /// `links.pages.next` until there is none; `split` takes a page apart into its items and
    /// the next link. A next link is only followed on this client's own base URL and list
    /// path, so the token is never sent elsewhere; anything else fails the listing rather
    /// than returning part of it.
    async fn send_paged<P: DeserializeOwned, T>(
        mut self,
        deadline: Instant,
        mut split: impl FnMut(P) -> Result<(Vec<T>, Option<String>), ApiError>,
    ) -> Result<Vec<T>, ApiError> {
        self.url
            .query_pairs_mut()
            .append_pair("per_page", &PER_PAGE.to_string());
        let path = self.url.path().to_owned();
        let mut seen = std::collections::HashSet::new();
        let mut all = Vec::new();
        for _ in 0..MAX_PAGES {
            let page = decode(self.endpoint, &self.send_for_body(deadline).await?)?;
            let (items, next) = split(page)?;
            all.extend(items);
            let Some(next) = next.filter(|n| !n.is_empty()) else {
                return Ok(all);
            };
            let parsed = self
                .url
                .join(&next)
                .map_err(|e| ApiError::BadLink(format!("{next:?}: {e}")))?;
            if parsed.path().trim_end_matches('/') != path.trim_end_matches('/') {
                return Err(ApiError::BadLink(format!("{next:?} leaves {path}")));
            }
            let mut rebased = self.client.url("");
            rebased.set_path(parsed.path());
            rebased.set_query(parsed.query());
            if !seen.insert(rebased.to_string()) || rebased == self.url {
                return Err(ApiError::BadLink(format!("{next:?} repeats a page")));
            }
            self.url = rebased;
        }
        Err(ApiError::BadLink(format!("more than {MAX_PAGES} pages")))
    }

    /// The body of a successful answer, after retries with backoff on retryable failures
    /// until `deadline` unless the request is sent [`once`](Request::once).
    async fn send_for_body(&self, deadline: Instant) -> Result<Vec<u8>, ApiError> {
        if let Some(invalid) = &self.invalid {
            return Err(invalid.clone());
        }
        if !self.retried {
            return self.exchange(deadline).await;
        }
        // A retry that finds no room in the budget before the deadline reports what made it
        // retry (a 429, a 503), not only that it was not sent.
        let last = std::sync::Mutex::new(None::<ApiError>);
        let result = self
            .client
            .backoff
            .run(
                Some(deadline),
                |_| {
                    let exchange = self.exchange(deadline);
                    let last = &last;
                    async move {
                        let result = exchange.await;
                        if let Err(e) = &result
                            && !is_no_room(e)
                        {
                            *last.lock().unwrap_or_else(|e| e.into_inner()) = Some(e.clone());
                        }
                        result
                    }
                },
                ApiError::verdict,
            )
            .await;
        match result {
            Err(e) if is_no_room(&e) => {
                let last = last.into_inner().unwrap_or_else(|e| e.into_inner());
                Err(last.unwrap_or(e))
            }
            other => other,
        }
    }

    /// One HTTP exchange, recorded by endpoint template and status class; the body of a
    /// successful answer.
    async fn exchange(&self, deadline: Instant) -> Result<Vec<u8>, ApiError> {
        let client = self.client;
        let endpoint = self.endpoint;
        client
            .budget
            .acquire(Some(deadline))
            .await
            .map_err(|_| ApiError::Transport {
                endpoint,
                message: NO_ROOM.into(),
            })?;
        let remaining = deadline.saturating_duration_since(Instant::now());
        let timeout = remaining.min(REQUEST_TIMEOUT).max(Duration::from_millis(1));
        let mut request = client
            .http
            .request(self.method.clone(), self.url.clone())
            .bearer_auth(&client.token.0)
            .header(http::header::ACCEPT, "application/json")
            .timeout(timeout);
        if let Some(body) = &self.body {
            request = request.json(body);
        }
        let transport = |e: reqwest::Error| {
            client.telemetry.api_http(endpoint, "error");
            // Strip the URL: it is ours and adds nothing, and the message stays short.
            ApiError::Transport {
                endpoint,
                message: e.without_url().to_string(),
            }
        };
        let response = request.send().await.map_err(transport)?;
        let status = response.status();
        client.budget.observe(status.as_u16(), response.headers());
        // After a 429 the retry waits in the budget, which holds every request back for the
        // `Retry-After` and then paces them at the refill rate.
        let hint = (status == StatusCode::TOO_MANY_REQUESTS).then_some(Duration::ZERO);
        let bytes = match read_body(response, MAX_RESPONSE_BODY).await {
            Ok(bytes) => bytes,
            Err(BodyError::Transport(e)) => return Err(transport(e)),
            Err(too_large @ BodyError::TooLarge { .. }) => {
                client
                    .telemetry
                    .api_http(endpoint, status_class(status.as_u16()));
                return Err(ApiError::Decode {
                    endpoint,
                    message: too_large.to_string(),
                });
            }
        };
        client
            .telemetry
            .api_http(endpoint, status_class(status.as_u16()));
        if status.is_success() {
            return Ok(bytes);
        }
        let message = match serde_json::from_slice::<ErrorBody>(&bytes) {
            Ok(e) if !e.message.is_empty() || !e.id.is_empty() => {
                format!("{} {}", e.id, e.message).trim().to_owned()
            }
            _ => String::from_utf8_lossy(&bytes)
                .chars()
                .take(200)
                .collect::<String>(),
        };
        Err(ApiError::Status {
            endpoint,
            status: status.as_u16(),
            message,
            retry_after: hint,
        })
    }
}

fn decode<T: DeserializeOwned>(endpoint: &'static str, bytes: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(bytes).map_err(|e| ApiError::Decode {
        endpoint,
        message: e.to_string(),
    })
}

/// Whether `e` is a request the budget held back until its deadline (never sent).
fn is_no_room(e: &ApiError) -> bool {
    matches!(e, ApiError::Transport { message, .. } if message == NO_ROOM)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls() {
        assert!(parse_base_url("https://api.digitalocean.com").is_ok());
        assert!(parse_base_url("http://127.0.0.1:8080").is_ok());
        assert!(parse_base_url("http://localhost:1").is_ok());
        assert!(parse_base_url("http://[::1]:9").is_ok());
        let err = parse_base_url("http://10.0.0.1:80").unwrap_err();
        assert!(err.contains("only allowed for loopback"), "{err}");
        assert!(parse_base_url("ftp://127.0.0.1").is_err());
        assert!(parse_base_url("not a url").is_err());
    }

    #[test]
    fn tokens_are_trimmed_and_hidden() {
        let t = ApiToken::new("  'dop_v1_abc'\n").unwrap();
        assert_eq!(t.0, "dop_v1_abc");
        assert!(!format!("{t:?}").contains("abc"));
        assert!(ApiToken::new(" '' ").is_none());
    }

    #[test]
    fn images() {
        assert_eq!(ImageRef::parse("12345"), ImageRef::Id(12345));
        assert_eq!(ImageRef::parse("-7"), ImageRef::Id(-7));
        assert_eq!(ImageRef::parse("+7"), ImageRef::Id(7));
        assert_eq!(
            ImageRef::parse("ubuntu-24-04-x64"),
            ImageRef::Slug("ubuntu-24-04-x64".into())
        );
        assert_eq!(serde_json::to_string(&ImageRef::Id(5)).unwrap(), "5");
    }

    #[test]
    fn retry_verdicts() {
        let status = |s| ApiError::Status {
            endpoint: "x",
            status: s,
            message: String::new(),
            retry_after: None,
        };
        assert_eq!(status(429).verdict(), Verdict::Retry { after: None });
        assert_eq!(status(503).verdict(), Verdict::Retry { after: None });
        assert_eq!(status(404).verdict(), Verdict::Fatal);
        assert!(status(404).is_not_found());
        let t = ApiError::Transport {
            endpoint: "x",
            message: "reset".into(),
        };
        assert_eq!(t.verdict(), Verdict::Retry { after: None });
    }

    /// The emulator's answers (which its spec test holds to DigitalOcean's document) with
    /// every property the document marks `deprecated: true` removed (a Droplet's `kernel`)
    /// decode in the provider's own models.
    #[tokio::test]
    async fn spec_shaped_answers_without_what_the_document_deprecates_decode() {
        const TOKEN: &str = "models-test";
        let doc = spec_shape::digitalocean();
        let emulator = do_emulator::Emulator::new(TOKEN);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let stop = tokio_util::sync::CancellationToken::new();
        let _stop = stop.clone().drop_guard();
        tokio::spawn(emulator.clone().serve(listener, stop));
        let vpc = emulator.add_vpc("m-vpc", "nyc3", "10.10.0.0/20");
        let (key, _) = emulator.add_ssh_key("m-key");
        emulator.add_firewall("m-fw", &["m"]);
        let http = reqwest::Client::new();
        let created: serde_json::Value = http
            .post(format!("{base}/v2/droplets"))
            .bearer_auth(TOKEN)
            .json(
                &serde_json::json!({"name": "m-1", "region": "nyc3", "size": "s-2vcpu-4gb",
                                      "image": "ubuntu-24-04-x64", "tags": ["m"]}),
            )
            .send()
            .await
            .expect("create")
            .json()
            .await
            .expect("json");
        let id = created["droplet"]["id"].as_u64().expect("id");
        let one = format!("/v2/droplets/{id}");
        let vpc = format!("/v2/vpcs/{vpc}");
        let key = format!("/v2/account/keys/{key}");
        let mut removed = 0;
        for (template, path) in [
            ("/v2/droplets/{droplet_id}", one.as_str()),
            ("/v2/droplets", "/v2/droplets?tag_name=m"),
            ("/v2/sizes", "/v2/sizes"),
            ("/v2/regions", "/v2/regions"),
            ("/v2/account", "/v2/account"),
            ("/v2/actions", "/v2/actions"),
            ("/v2/images/{image_id}", "/v2/images/ubuntu-24-04-x64"),
            ("/v2/vpcs/{vpc_id}", vpc.as_str()),
            ("/v2/account/keys/{ssh_key_identifier}", key.as_str()),
            ("/v2/firewalls", "/v2/firewalls"),
        ] {
            let (answer, stripped) =
                spec_shape::get_without_deprecated(&doc, &base, TOKEN, template, path).await;
            removed += usize::from(stripped != answer);
            let v = stripped;
            let decoded = match template {
                "/v2/droplets/{droplet_id}" => {
                    serde_json::from_value::<DropletEnvelope>(v).map(|e| e.droplet.id == id)
                }
                "/v2/droplets" => serde_json::from_value::<DropletPage>(v)
                    .map(|p| p.droplets.len() == 1 && p.droplets[0].id == id),
                "/v2/sizes" => serde_json::from_value::<SizePage>(v).map(|p| !p.sizes.is_empty()),
                "/v2/regions" => serde_json::from_value::<Vec<Region>>(v["regions"].clone())
                    .map(|r| !r.is_empty()),
                "/v2/account" => {
                    serde_json::from_value::<Account>(v["account"].clone()).map(|_| true)
                }
                "/v2/actions" => {
                    serde_json::from_value::<ActionList>(v).map(|l| !l.actions.is_empty())
                }
                "/v2/images/{image_id}" => {
                    serde_json::from_value::<Image>(v["image"].clone()).map(|_| true)
                }
                "/v2/vpcs/{vpc_id}" => {
                    serde_json::from_value::<Vpc>(v["vpc"].clone()).map(|_| true)
                }
                "/v2/account/keys/{ssh_key_identifier}" => {
                    serde_json::from_value::<SshKey>(v["ssh_key"].clone()).map(|_| true)
                }
                _ => serde_json::from_value::<Vec<Firewall>>(v["firewalls"].clone())
                    .map(|f| !f.is_empty()),
            };
            assert!(decoded.unwrap_or_else(|e| panic!("{path}: {e}")), "{path}");
        }
        // A Droplet's `kernel` went (from the Droplet read and the listing).
        assert!(removed >= 2, "only {removed} answers had deprecated keys");
    }
}

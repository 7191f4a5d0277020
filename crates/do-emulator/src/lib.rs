//! A local, stateful emulator of the DigitalOcean API subset the provider uses: Droplets
//! (create, get, list by tag, delete), tags (create, tag and untag resources), sizes and
//! actions (a Droplet's `create` and `destroy`, however it was deleted, listed account-wide
//! newest first), with `links.pages.next` / `meta.total` pagination and DigitalOcean-shaped
//! objects.
//! Fault knobs make it misbehave on purpose: 429 storms with rate-limit headers, 5xx answers,
//! a create whose response is lost after the Droplet exists, Droplets that take a while to
//! become `active`, bad pagination links, small pages, listings during which a listed Droplet
//! is deleted (later Droplets move up a page), oversized answers and out-of-band deletion; the
//! catalogue's own answers: a size sold out in a region or no longer sold, a region that takes
//! no new Droplets (Create answers 422 `unprocessable_entity`), and the account's Droplet limit
//! (422 "… will exceed your droplet limit").
//! The resources a Droplet refers to (account, regions, images and snapshots, VPCs, SSH keys,
//! cloud firewalls) live in [`resources`]; every create body is recorded as sent.
//! Loopback only.

mod ratelimit;
mod resources;

pub use ratelimit::{RateLimit, class_of};
pub use resources::{EmulatedFirewall, EmulatedImage, EmulatedKey, EmulatedVpc};

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Extension, Json, Router};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// One injected failure of the next API request.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
pub struct Fault {
    /// The status answered: 429, a 5xx, or any other refusal (a 403 of a missing token scope).
    pub status: u16,
    /// Seconds sent in `Retry-After` (and in `ratelimit-reset` as now + this); none if absent.
    #[serde(default)]
    pub retry_after: Option<u64>,
}

/// A Droplet as the emulator stores it.
#[derive(Clone, Debug)]
pub struct EmulatedDroplet {
    pub id: u64,
    pub name: String,
    pub region: String,
    pub size: String,
    pub image: Value,
    pub user_data: String,
    pub tags: Vec<String>,
    pub status: String,
    pub public_ipv4: String,
    /// The VPC the Droplet is in (the region's default VPC unless the create named one).
    pub vpc_uuid: String,
    pub private_ipv4: String,
    /// Set when the create asked for IPv6.
    pub public_ipv6: Option<String>,
    pub monitoring: bool,
    /// Ids of the SSH keys the create named (by id or fingerprint).
    pub ssh_key_ids: Vec<u64>,
    /// Reads of this Droplet (its GET, or a listing that shows it) still answered with `new`
    /// before it turns `active`.
    polls_left: u32,
    /// When a Droplet created while a boot time was set turns `active` (reads then do not
    /// count).
    boots_at: Option<std::time::Instant>,
    created_at: String,
}

#[derive(Clone, Debug)]
struct EmulatedSize {
    slug: &'static str,
    vcpus: u32,
    memory_mb: u64,
    disk_gb: u64,
    price_hourly: f64,
}

#[derive(Default)]
struct Knobs {
    fail_next: VecDeque<Fault>,
    /// Every request until this moment meets this fault (before the queued ones).
    outage: Option<(std::time::Instant, Fault)>,
    drop_create_responses: u32,
    active_after_polls: u32,
    /// How long new Droplets take to boot, when set (in place of `active_after_polls`).
    boot_time: Option<std::time::Duration>,
    bad_next_link: bool,
    /// The largest page served, whatever `per_page` asks for.
    max_per_page: Option<usize>,
    /// Listings left during which the first Droplet of page 1 is deleted once it is served.
    churn_listings: u32,
    /// The next answer is a 200 with a body of this many bytes.
    oversize_next: Option<usize>,
    /// The enforced rate limits, once a test sets them.
    rate_limit: Option<ratelimit::Buckets>,
    /// Sizes sold out in a region: left out of `sizes[].regions` and `regions[].sizes`, and
    /// a Create of one answers 422.
    sold_out: BTreeSet<(String, String)>,
    /// Sizes no longer sold anywhere (`sizes[].available: false`).
    retired_sizes: BTreeSet<String>,
    /// Regions that take no new Droplets (`regions[].available: false`).
    closed_regions: BTreeSet<String>,
    /// The account's Droplet limit, enforced once a test sets it (the account reports 25
    /// until then).
    droplet_limit: Option<u64>,
}

/// The Droplet limit `GET /v2/account` reports while no test set one.
const DEFAULT_DROPLET_LIMIT: u64 = 25;

struct EmulatorState {
    token: String,
    next_droplet: u64,
    next_action: u64,
    droplets: BTreeMap<u64, EmulatedDroplet>,
    tags: BTreeSet<String>,
    sizes: Vec<EmulatedSize>,
    actions: Vec<Value>,
    knobs: Knobs,
    create_requests: u32,
    requests: Vec<String>,
    images: Vec<EmulatedImage>,
    vpcs: Vec<EmulatedVpc>,
    ssh_keys: Vec<EmulatedKey>,
    firewalls: Vec<EmulatedFirewall>,
    create_bodies: Vec<Value>,
    /// Requests by [`class_of`], and of those, how many the rate limits refused.
    by_class: BTreeMap<&'static str, (usize, usize)>,
    next_image: u64,
    next_key: u64,
    next_uuid: u64,
}

/// The emulator: clone it freely; all clones share one state.
#[derive(Clone)]
pub struct Emulator {
    state: Arc<Mutex<EmulatorState>>,
}

impl std::fmt::Debug for Emulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Emulator").finish_non_exhaustive()
    }
}

fn default_sizes() -> Vec<EmulatedSize> {
    let s = |slug, vcpus, memory_mb, disk_gb, price_hourly| EmulatedSize {
        slug,
        vcpus,
        memory_mb,
        disk_gb,
        price_hourly,
    };
    vec![
        s("s-1vcpu-512mb-10gb", 1, 512, 10, 0.00595),
        s("s-1vcpu-1gb", 1, 1024, 25, 0.00893),
        s("s-1vcpu-2gb", 1, 2048, 50, 0.01786),
        s("s-2vcpu-2gb", 2, 2048, 60, 0.02679),
        s("s-2vcpu-4gb", 2, 4096, 80, 0.03571),
        s("s-4vcpu-8gb", 4, 8192, 160, 0.07143),
        s("s-8vcpu-16gb", 8, 16384, 320, 0.14286),
        s("g-2vcpu-8gb", 2, 8192, 25, 0.09375),
        s("g-4vcpu-16gb", 4, 16384, 50, 0.1875),
        s("g-8vcpu-32gb", 8, 32768, 100, 0.375),
        s("g-16vcpu-64gb", 16, 65536, 200, 0.75),
        s("c-2", 2, 4096, 25, 0.0625),
        s("c-4", 4, 8192, 50, 0.125),
        s("c-8", 8, 16384, 100, 0.25),
        s("c-16", 16, 32768, 200, 0.5),
        s("m-2vcpu-16gb", 2, 16384, 50, 0.125),
        s("m-4vcpu-32gb", 4, 32768, 100, 0.25),
        s("m-8vcpu-64gb", 8, 65536, 200, 0.5),
        s("m-16vcpu-128gb", 16, 131072, 400, 1.0),
        s("s-2vcpu-4gb-amd", 2, 4096, 80, 0.03869),
        s("s-4vcpu-16gb-amd", 4, 16384, 200, 0.125),
    ]
}

const REGIONS: &[&str] = &[
    "nyc1", "nyc3", "sfo3", "ams3", "fra1", "lon1", "sgp1", "tor1",
];

impl EmulatorState {
    /// Removes a Droplet, recording its `destroy` action as DigitalOcean does for every
    /// deletion (API, console or another tool alike); false if it did not exist.
    fn destroy(&mut self, id: u64) -> bool {
        let Some(droplet) = self.droplets.remove(&id) else {
            return false;
        };
        let action_id = self.next_action;
        self.next_action += 1;
        let now = now_rfc3339();
        self.actions.push(json!({
            "id": action_id, "status": "completed", "type": "destroy", "started_at": now,
            "completed_at": now, "resource_id": id, "resource_type": "droplet",
            "region_slug": droplet.region
        }));
        true
    }
}

fn lock(state: &Mutex<EmulatorState>) -> std::sync::MutexGuard<'_, EmulatorState> {
    state.lock().unwrap_or_else(|e| e.into_inner())
}

fn now_rfc3339() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since the epoch (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn valid_tag(tag: &str) -> bool {
    !tag.is_empty()
        && tag.len() <= 255
        && tag
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b":_-".contains(&c))
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b".-".contains(&c))
}

impl Emulator {
    /// An empty account whose API accepts `token`.
    pub fn new(token: &str) -> Emulator {
        let mut state = EmulatorState {
            token: token.to_owned(),
            next_droplet: 400_000_001,
            next_action: 2_000_000_001,
            droplets: BTreeMap::new(),
            tags: BTreeSet::new(),
            sizes: default_sizes(),
            actions: Vec::new(),
            knobs: Knobs::default(),
            create_requests: 0,
            requests: Vec::new(),
            images: Vec::new(),
            vpcs: Vec::new(),
            ssh_keys: Vec::new(),
            firewalls: Vec::new(),
            create_bodies: Vec::new(),
            by_class: BTreeMap::new(),
            next_image: 160_000_000,
            next_key: 41_000_000,
            next_uuid: 0,
        };
        resources::fresh(&mut state);
        Emulator {
            state: Arc::new(Mutex::new(state)),
        }
    }

    /// Forgets every fault still queued, and ends an outage.
    pub fn clear_faults(&self) {
        let knobs = &mut lock(&self.state).knobs;
        knobs.fail_next.clear();
        knobs.outage = None;
    }

    /// Fails the next `count` API requests with `fault`.
    pub fn fail_next(&self, count: usize, fault: Fault) {
        lock(&self.state)
            .knobs
            .fail_next
            .extend(std::iter::repeat_n(fault, count));
    }

    /// How many queued request faults wait for a request.
    pub fn pending_faults(&self) -> usize {
        lock(&self.state).knobs.fail_next.len()
    }

    /// Fails every API request with `fault` for `lasting` from now, however many requests
    /// that is (an outage, as a cloud has them: by time, not by count), before any queued
    /// fault. A later call replaces the outage.
    pub fn fail_for(&self, lasting: std::time::Duration, fault: Fault) {
        lock(&self.state).knobs.outage = Some((std::time::Instant::now() + lasting, fault));
    }

    /// The next `count` creates make the Droplet and then drop the connection unanswered.
    pub fn drop_create_responses(&self, count: u32) {
        lock(&self.state).knobs.drop_create_responses = count;
    }

    /// New Droplets stay `new` for this many reads of the Droplet (its GET, or a listing
    /// that shows it).
    pub fn set_active_after_polls(&self, polls: u32) {
        lock(&self.state).knobs.active_after_polls = polls;
    }

    /// New Droplets turn `active` once this long has passed since their create, however often
    /// they are read (`None`: by reads, see [`Emulator::set_active_after_polls`]).
    pub fn set_boot_time(&self, boot: Option<std::time::Duration>) {
        lock(&self.state).knobs.boot_time = boot;
    }

    /// Makes every `links.pages.next` point somewhere it must not be followed.
    pub fn set_bad_next_link(&self, bad: bool) {
        lock(&self.state).knobs.bad_next_link = bad;
    }

    /// Serves at most `max` items per page.
    pub fn set_max_per_page(&self, max: usize) {
        lock(&self.state).knobs.max_per_page = Some(max.max(1));
    }

    /// During each of the next `listings` multi-page Droplet listings, deletes the first
    /// Droplet of page 1 right after serving it (as another actor would between two pages).
    pub fn delete_during_next_listings(&self, listings: u32) {
        lock(&self.state).knobs.churn_listings = listings;
    }

    /// Answers the next API request with a 200 whose body is `bytes` long.
    pub fn oversize_next(&self, bytes: usize) {
        lock(&self.state).knobs.oversize_next = Some(bytes);
    }

    /// Sells out `size` in `region` (`sold_out`), or sells it there again: the region leaves
    /// the size's `regions` (and the size the region's `sizes`), and a Create answers 422
    /// `unprocessable_entity`.
    pub fn set_sold_out(&self, size: &str, region: &str, sold_out: bool) {
        let key = (size.to_owned(), region.to_owned());
        let mut state = lock(&self.state);
        if sold_out {
            state.knobs.sold_out.insert(key);
        } else {
            state.knobs.sold_out.remove(&key);
        }
    }

    /// Stops (or resumes) selling `size` anywhere: `sizes[].available` is false.
    pub fn set_size_available(&self, size: &str, available: bool) {
        let mut state = lock(&self.state);
        if available {
            state.knobs.retired_sizes.remove(size);
        } else {
            state.knobs.retired_sizes.insert(size.to_owned());
        }
    }

    /// Closes (or reopens) `region` to new Droplets: `regions[].available` is false.
    pub fn set_region_available(&self, region: &str, available: bool) {
        let mut state = lock(&self.state);
        if available {
            state.knobs.closed_regions.remove(region);
        } else {
            state.knobs.closed_regions.insert(region.to_owned());
        }
    }

    /// The account's Droplet limit, reported by `GET /v2/account` and enforced: a Create that
    /// would exceed it answers 422 `unprocessable_entity` "… will exceed your droplet limit".
    pub fn set_droplet_limit(&self, limit: u64) {
        lock(&self.state).knobs.droplet_limit = Some(limit);
    }

    pub fn set_size_price(&self, slug: &str, price_hourly: f64) {
        for size in lock(&self.state)
            .sizes
            .iter_mut()
            .filter(|s| s.slug == slug)
        {
            size.price_hourly = price_hourly;
        }
    }

    /// Gives Droplet `id` this public IPv4 address (the emulator's are 192.0.2.x); false if it
    /// does not exist.
    pub fn set_public_ipv4(&self, id: u64, ip: &str) -> bool {
        match lock(&self.state).droplets.get_mut(&id) {
            Some(droplet) => {
                droplet.public_ipv4 = ip.to_owned();
                true
            }
            None => false,
        }
    }

    /// Takes `tag` off Droplet `id`, as a Droplet created before the provider set that tag
    /// would lack it; false if the Droplet does not exist or did not carry it.
    pub fn remove_tag(&self, id: u64, tag: &str) -> bool {
        match lock(&self.state).droplets.get_mut(&id) {
            Some(droplet) => {
                let before = droplet.tags.len();
                droplet.tags.retain(|t| t != tag);
                droplet.tags.len() != before
            }
            None => false,
        }
    }

    /// Deletes a Droplet behind the provider's back (recording its `destroy` action, as the
    /// console does); false if it did not exist.
    pub fn delete_out_of_band(&self, id: u64) -> bool {
        lock(&self.state).destroy(id)
    }

    /// Every action recorded, oldest first.
    pub fn actions(&self) -> Vec<Value> {
        lock(&self.state).actions.clone()
    }

    /// Adds a Droplet directly (as if another tool had created it), already `active`.
    pub fn insert_droplet(&self, name: &str, region: &str, size: &str, tags: &[&str]) -> u64 {
        let mut state = lock(&self.state);
        let id = state.next_droplet;
        state.next_droplet += 1;
        for t in tags {
            state.tags.insert((*t).to_owned());
        }
        let vpc_uuid = state
            .default_vpc(region)
            .map(|v| v.id.clone())
            .unwrap_or_default();
        state.droplets.insert(
            id,
            EmulatedDroplet {
                id,
                name: name.to_owned(),
                region: region.to_owned(),
                size: size.to_owned(),
                image: json!("ubuntu-24-04-x64"),
                user_data: String::new(),
                tags: tags.iter().map(|t| (*t).to_owned()).collect(),
                status: "active".into(),
                public_ipv4: format!("192.0.2.{}", id % 250 + 1),
                vpc_uuid,
                private_ipv4: format!("10.0.0.{}", id % 250 + 2),
                public_ipv6: None,
                monitoring: false,
                ssh_key_ids: Vec::new(),
                polls_left: 0,
                boots_at: None,
                created_at: now_rfc3339(),
            },
        );
        id
    }

    pub fn droplets(&self) -> Vec<EmulatedDroplet> {
        lock(&self.state).droplets.values().cloned().collect()
    }

    pub fn droplet(&self, id: u64) -> Option<EmulatedDroplet> {
        lock(&self.state).droplets.get(&id).cloned()
    }

    pub fn tags(&self) -> Vec<String> {
        lock(&self.state).tags.iter().cloned().collect()
    }

    /// How many `POST /v2/droplets` arrived (including failed ones).
    pub fn create_requests(&self) -> u32 {
        lock(&self.state).create_requests
    }

    /// Enforces `limit` from now on, starting from full buckets.
    pub fn set_rate_limit(&self, limit: RateLimit) {
        lock(&self.state).knobs.rate_limit = Some(ratelimit::Buckets::full(limit));
    }

    /// Spends up to `n` requests of the limits as another user of the token would; returns how
    /// many it got (0 without a rate limit).
    pub fn drain_rate_limit(&self, n: u32) -> u32 {
        lock(&self.state)
            .knobs
            .rate_limit
            .as_mut()
            .map_or(0, |b| b.drain(n))
    }

    /// Leaves `left` requests of the hourly limit, as if the rest had been spent earlier in the
    /// hour (the minute's limit is untouched).
    pub fn set_hourly_remaining(&self, left: u32) {
        if let Some(buckets) = lock(&self.state).knobs.rate_limit.as_mut() {
            buckets.set_hourly_remaining(left);
        }
    }

    /// Requests left of the hourly limit (`None` without a rate limit).
    pub fn rate_limit_remaining(&self) -> Option<u32> {
        lock(&self.state)
            .knobs
            .rate_limit
            .as_mut()
            .map(|b| b.remaining())
    }

    /// Requests by class ([`class_of`]): how many arrived and how many of those the rate
    /// limits refused.
    pub fn requests_by_class(&self) -> BTreeMap<&'static str, (usize, usize)> {
        lock(&self.state).by_class.clone()
    }

    /// Every API request so far, as `METHOD /path`.
    pub fn requests(&self) -> Vec<String> {
        lock(&self.state).requests.clone()
    }

    fn router(&self) -> Router {
        let api = Router::new()
            .route("/v2/droplets", post(create_droplet).get(list_droplets))
            .route("/v2/droplets/{id}", get(get_droplet).delete(delete_droplet))
            .route("/v2/droplets/{id}/actions", get(droplet_actions))
            .route("/v2/actions", get(list_actions))
            .route("/v2/actions/{id}", get(get_action))
            .route("/v2/tags", post(create_tag).get(list_tags))
            .route(
                "/v2/tags/{tag}/resources",
                post(tag_resources).delete(untag_resources),
            )
            .route("/v2/sizes", get(list_sizes))
            .route("/v2/account", get(resources::get_account))
            .route("/v2/account/keys", get(resources::list_keys))
            .route("/v2/account/keys/{key}", get(resources::get_key))
            .route("/v2/regions", get(resources::list_regions))
            .route("/v2/images", get(resources::list_images))
            .route("/v2/images/{key}", get(resources::get_image))
            .route("/v2/snapshots", get(resources::list_snapshots))
            .route("/v2/snapshots/{id}", get(resources::get_snapshot))
            .route("/v2/vpcs", get(resources::list_vpcs))
            .route("/v2/vpcs/{id}", get(resources::get_vpc))
            .route("/v2/firewalls", get(resources::list_firewalls))
            .route("/v2/firewalls/{id}", get(resources::get_firewall))
            .layer(axum::middleware::from_fn_with_state(self.clone(), gate));
        let admin = Router::new()
            .route("/_emulator/droplets", get(admin_droplets))
            .route("/_emulator/droplets/{id}", delete(admin_delete))
            .route("/_emulator/faults", post(admin_faults))
            .route("/_emulator/stats", get(admin_stats))
            .route("/_emulator/seed", post(resources::admin_seed))
            .route(
                "/_emulator/create-requests",
                get(resources::admin_create_requests),
            );
        api.merge(admin).with_state(self.clone())
    }

    /// Serves plain HTTP on `listener` until `shutdown` is cancelled.
    pub async fn serve(self, listener: TcpListener, shutdown: CancellationToken) {
        let router = self.router();
        loop {
            let (tcp, _peer): (_, SocketAddr) = tokio::select! {
                () = shutdown.cancelled() => return,
                accepted = listener.accept() => match accepted {
                    Ok(pair) => pair,
                    Err(_) => continue,
                },
            };
            let kill = ConnectionKill(CancellationToken::new());
            let service = hyper_util::service::TowerToHyperService::new(
                router.clone().layer(Extension(kill.clone())),
            );
            let shutdown = shutdown.clone();
            tokio::spawn(async move {
                let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                let conn = builder.serve_connection(TokioIo::new(tcp), service);
                tokio::select! {
                    _ = conn => {}
                    // Dropping the connection unanswered is the "lost response" fault.
                    () = kill.0.cancelled() => {}
                    () = shutdown.cancelled() => {}
                }
            });
        }
    }
}

/// Cancelled by a handler to drop its connection without an answer.
#[derive(Clone)]
struct ConnectionKill(CancellationToken);

fn api_error(status: StatusCode, id: &str, message: &str) -> Response {
    (status, Json(json!({ "id": id, "message": message }))).into_response()
}

/// Authentication, request log, injected faults and rate-limit headers for `/v2/*`.
async fn gate(
    State(emu): State<Emulator>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let fault = {
        let mut state = lock(&emu.state);
        state
            .requests
            .push(format!("{} {}", request.method(), request.uri().path()));
        if request.method() == axum::http::Method::POST && request.uri().path() == "/v2/droplets" {
            state.create_requests += 1;
        }
        let expected = format!("Bearer {}", state.token);
        let authorised = request
            .headers()
            .get(axum::http::header::AUTHORIZATION)
            .is_some_and(|v| v.as_bytes() == expected.as_bytes());
        if !authorised {
            return api_error(
                StatusCode::UNAUTHORIZED,
                "Unauthorized",
                "Unable to authenticate you",
            );
        }
        let class = class_of(request.method().as_str(), request.uri().path());
        let refused = state.knobs.rate_limit.as_mut().map(|b| b.take());
        let counted = state.by_class.entry(class).or_default();
        counted.0 += 1;
        if let Some(Err(retry_after)) = refused {
            counted.1 += 1;
            let mut response = api_error(
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_requests",
                "API Rate limit exceeded.",
            );
            stamp(&mut state, &mut response);
            response
                .headers_mut()
                .insert("retry-after", retry_after.into());
            return response;
        }
        if let Some(bytes) = state.knobs.oversize_next.take() {
            let pad = "x".repeat(bytes.saturating_sub(12));
            return (
                StatusCode::OK,
                [(axum::http::header::CONTENT_TYPE, "application/json")],
                format!("{{\"pad\": \"{pad}\"}}"),
            )
                .into_response();
        }
        match state.knobs.outage {
            Some((until, fault)) if std::time::Instant::now() < until => Some(fault),
            _ => {
                state.knobs.outage = None;
                state.knobs.fail_next.pop_front()
            }
        }
    };
    let reset = unix_now() + 60;
    if let Some(fault) = fault {
        let status =
            StatusCode::from_u16(fault.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = if status == StatusCode::TOO_MANY_REQUESTS {
            api_error(status, "too_many_requests", "API Rate limit exceeded.")
        } else {
            api_error(
                status,
                "server_error",
                "Server was unable to give you a response.",
            )
        };
        let headers = response.headers_mut();
        if let Some(after) = fault.retry_after {
            headers.insert("retry-after", after.into());
            headers.insert("ratelimit-reset", (unix_now() + after).into());
        } else if status.is_server_error() {
            // DigitalOcean sends its rate-limit headers on every answer; the window resets
            // up to an hour later, which says nothing about when to retry a 5xx.
            headers.insert("ratelimit-reset", (unix_now() + 3600).into());
        }
        headers.insert("ratelimit-limit", 5000.into());
        headers.insert("ratelimit-remaining", 0.into());
        return response;
    }
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    headers.insert("ratelimit-limit", 5000.into());
    headers.insert("ratelimit-remaining", 4999.into());
    headers.insert("ratelimit-reset", reset.into());
    stamp(&mut lock(&emu.state), &mut response);
    response
}

/// With rate limits set, an answer carries their real headers instead of the fixed ones.
fn stamp(state: &mut EmulatorState, response: &mut Response) {
    if let Some(buckets) = state.knobs.rate_limit.as_mut() {
        let headers = response.headers_mut();
        for (name, value) in buckets.headers() {
            headers.insert(name, value.into());
        }
    }
}

/// The regions `size` is sold in now.
fn size_regions(knobs: &Knobs, size: &str) -> Vec<&'static str> {
    REGIONS
        .iter()
        .copied()
        .filter(|r| !knobs.sold_out.contains(&(size.to_owned(), (*r).to_owned())))
        .collect()
}

/// Whether a Droplet of `size` can be created in `region` now.
fn orderable(knobs: &Knobs, size: &str, region: &str) -> bool {
    !knobs.retired_sizes.contains(size)
        && !knobs.closed_regions.contains(region)
        && size_regions(knobs, size).contains(&region)
}

fn size_json(knobs: &Knobs, s: &EmulatedSize) -> Value {
    json!({
        "slug": s.slug,
        "memory": s.memory_mb,
        "vcpus": s.vcpus,
        "disk": s.disk_gb,
        "transfer": 4.0,
        "price_monthly": (s.price_hourly * 672.0 * 100.0).round() / 100.0,
        "price_hourly": s.price_hourly,
        "regions": size_regions(knobs, s.slug),
        "available": !knobs.retired_sizes.contains(s.slug),
        "description": "Emulated",
        "disk_info": [{"type": "local", "size": {"amount": s.disk_gb, "unit": "gib"}}],
    })
}

fn droplet_json(state: &EmulatorState, d: &EmulatedDroplet) -> Value {
    let size = state.sizes.iter().find(|s| s.slug == d.size);
    let (vcpus, memory, disk) = size.map_or((1, 1024, 25), |s| (s.vcpus, s.memory_mb, s.disk_gb));
    let found = match &d.image {
        Value::Number(n) => n.as_u64().and_then(|id| state.image_by_id(id)),
        Value::String(slug) => state.image_by_slug(slug),
        _ => None,
    };
    let image = found.map_or(Value::Null, resources::image_json);
    let (v4, v6) = if d.status == "new" {
        (json!([]), json!([]))
    } else {
        let v4 = json!([
            { "ip_address": d.private_ipv4, "netmask": "255.255.240.0", "gateway": "nil", "type": "private" },
            { "ip_address": d.public_ipv4, "netmask": "255.255.255.0", "gateway": "192.0.2.254", "type": "public" }
        ]);
        let v6 = d.public_ipv6.as_ref().map_or(json!([]), |ip| {
            json!([{ "ip_address": ip, "netmask": 64, "gateway": "2001:db8:0:d0::1", "type": "public" }])
        });
        (v4, v6)
    };
    let mut features = vec!["droplet_agent", "private_networking"];
    if d.public_ipv6.is_some() {
        features.push("ipv6");
    }
    if d.monitoring {
        features.push("monitoring");
    }
    json!({
        "id": d.id,
        "name": d.name,
        "memory": memory,
        "vcpus": vcpus,
        "disk": disk,
        "locked": false,
        "status": d.status,
        "kernel": null,
        "created_at": d.created_at,
        "features": features,
        "backup_ids": [],
        "next_backup_window": null,
        "snapshot_ids": [],
        "image": image,
        "volume_ids": [],
        "size": size.map(|s| size_json(&state.knobs, s)).unwrap_or(Value::Null),
        "size_slug": d.size,
        "networks": {
            "v4": v4,
            "v6": v6
        },
        "region": {
            "name": d.region.to_uppercase(),
            "slug": d.region,
            "features": ["backups", "ipv6", "metadata", "install_agent"],
            "available": true,
            "sizes": state.sizes.iter().map(|s| s.slug).collect::<Vec<_>>()
        },
        "tags": d.tags,
        "vpc_uuid": d.vpc_uuid
    })
}

#[derive(Deserialize)]
struct PageQuery {
    page: Option<usize>,
    per_page: Option<usize>,
    tag_name: Option<String>,
}

/// One page of `items` under `key`, with `links.pages` and `meta.total`.
fn page_of(
    items: Vec<Value>,
    key: &str,
    q: &PageQuery,
    headers: &HeaderMap,
    path: &str,
    bad_next_link: bool,
    max_per_page: Option<usize>,
) -> Value {
    page_rendering(
        items,
        |v| v,
        key,
        q,
        headers,
        path,
        bad_next_link,
        max_per_page,
    )
}

/// [`page_of`] over items rendered as JSON only when they are on the page served (a listing
/// of many thousands of Droplets renders one page, not all of them).
#[allow(clippy::too_many_arguments)]
fn page_rendering<T>(
    items: Vec<T>,
    render: impl FnMut(T) -> Value,
    key: &str,
    q: &PageQuery,
    headers: &HeaderMap,
    path: &str,
    bad_next_link: bool,
    max_per_page: Option<usize>,
) -> Value {
    let per_page = q
        .per_page
        .unwrap_or(20)
        .clamp(1, max_per_page.unwrap_or(200).min(200));
    let page = q.page.unwrap_or(1).max(1);
    let total = items.len();
    let last = total.div_ceil(per_page).max(1);
    let host = headers
        .get(axum::http::header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("127.0.0.1");
    let link = |n: usize| {
        let mut query = format!("page={n}&per_page={per_page}");
        if let Some(tag) = &q.tag_name {
            query.push_str("&tag_name=");
            query.push_str(&percent_encode(tag));
        }
        format!("http://{host}{path}?{query}")
    };
    let mut pages = serde_json::Map::new();
    if page > 1 {
        pages.insert("first".into(), json!(link(1)));
        pages.insert("prev".into(), json!(link(page - 1)));
    }
    if page < last {
        let next = if bad_next_link {
            "http://[not-a-link".to_owned()
        } else {
            link(page + 1)
        };
        pages.insert("next".into(), json!(next));
        pages.insert("last".into(), json!(link(last)));
    }
    let slice: Vec<Value> = items
        .into_iter()
        .skip((page - 1) * per_page)
        .take(per_page)
        .map(render)
        .collect();
    json!({ key: slice, "links": { "pages": pages }, "meta": { "total": total } })
}

fn percent_encode(text: &str) -> String {
    text.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

#[derive(Deserialize)]
struct CreateBody {
    name: Option<String>,
    region: Option<String>,
    size: Option<String>,
    image: Option<Value>,
    #[serde(default)]
    user_data: String,
    #[serde(default)]
    tags: Vec<String>,
    #[serde(default)]
    vpc_uuid: Option<String>,
    #[serde(default)]
    ipv6: bool,
    #[serde(default)]
    monitoring: bool,
    #[serde(default)]
    ssh_keys: Vec<Value>,
}

/// What a valid create resolves to besides its plain fields.
struct Placement {
    vpc: EmulatedVpc,
    ssh_key_ids: Vec<u64>,
}

/// Checks image, VPC and SSH keys of a create against the account, with the API's answers.
fn place(
    state: &EmulatorState,
    body: &CreateBody,
    region: &str,
    image: &Value,
) -> Result<Placement, String> {
    if !REGIONS.contains(&region) {
        return Err("You specified an invalid region for Droplet creation.".into());
    }
    if !state
        .sizes
        .iter()
        .any(|s| Some(s.slug) == body.size.as_deref())
    {
        return Err("You specified an invalid size for Droplet creation.".into());
    }
    if !orderable(
        &state.knobs,
        body.size.as_deref().unwrap_or_default(),
        region,
    ) {
        return Err("Size is not available in this region.".into());
    }
    let limit = state.knobs.droplet_limit.unwrap_or(u64::MAX);
    if state.droplets.len() as u64 >= limit {
        return Err("creating this/these droplet(s) will exceed your droplet limit".into());
    }
    let found = match image {
        Value::Number(n) => n.as_u64().and_then(|id| state.image_by_id(id)),
        Value::String(slug) => state.image_by_slug(slug),
        _ => None,
    };
    let Some(found) = found else {
        return Err("You specified an invalid image for Droplet creation.".into());
    };
    if !found.regions.iter().any(|r| r == region) {
        return Err(format!(
            "The image {} is not available in the region {region}.",
            found.id
        ));
    }
    let vpc = match body.vpc_uuid.as_deref() {
        None | Some("") => state.default_vpc(region).cloned(),
        Some(id) => {
            let vpc = state
                .vpc(id)
                .ok_or_else(|| format!("The VPC {id} could not be found."))?;
            if vpc.region != region {
                return Err(format!(
                    "The VPC {id} is in {}, not in the Droplet's region {region}.",
                    vpc.region
                ));
            }
            Some(vpc.clone())
        }
    };
    let vpc = vpc.ok_or_else(|| format!("No default VPC in {region}."))?;
    let mut ssh_key_ids = Vec::new();
    for key in &body.ssh_keys {
        let text = match key {
            Value::Number(n) => n.to_string(),
            Value::String(s) => s.clone(),
            other => {
                return Err(format!(
                    "ssh_keys: {other} is neither an id nor a fingerprint"
                ));
            }
        };
        let k = state
            .key(&text)
            .ok_or_else(|| format!("You specified an invalid SSH key: {text}."))?;
        ssh_key_ids.push(k.id);
    }
    Ok(Placement { vpc, ssh_key_ids })
}

/// The address of host `n` in a VPC's IPv4 range (`a.b.c.d/len`).
fn private_address(ip_range: &str, n: u64) -> String {
    let base = ip_range
        .split('/')
        .next()
        .and_then(|a| a.parse::<std::net::Ipv4Addr>().ok())
        .unwrap_or(std::net::Ipv4Addr::new(10, 0, 0, 0));
    let host = u32::from(base) + 2 + (n % 250) as u32;
    std::net::Ipv4Addr::from(host).to_string()
}

async fn create_droplet(
    State(emu): State<Emulator>,
    Extension(kill): Extension<ConnectionKill>,
    raw: axum::body::Bytes,
) -> Response {
    let parsed = serde_json::from_slice::<Value>(&raw).ok();
    if let Some(value) = &parsed {
        lock(&emu.state).create_bodies.push(value.clone());
    }
    let Some(Ok(body)) = parsed.map(serde_json::from_value::<CreateBody>) else {
        return api_error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "unparseable request body",
        );
    };
    let unprocessable =
        |m: &str| api_error(StatusCode::UNPROCESSABLE_ENTITY, "unprocessable_entity", m);
    let (Some(name), Some(region), Some(size), Some(image)) = (
        body.name.clone(),
        body.region.clone(),
        body.size.clone(),
        body.image.clone(),
    ) else {
        return unprocessable("name, region, size and image are required");
    };
    if !valid_name(&name) {
        return unprocessable("Name is invalid: only a-z, A-Z, 0-9, . and - are allowed");
    }
    if let Some(bad) = body.tags.iter().find(|t| !valid_tag(t)) {
        return unprocessable(&format!("tag {bad:?} is invalid"));
    }
    if body.user_data.len() > 64 * 1024 {
        return unprocessable("user_data is limited to 64 KiB");
    }
    let created = (|| {
        let mut state = lock(&emu.state);
        let placement = place(&state, &body, &region, &image)?;
        let id = state.next_droplet;
        state.next_droplet += 1;
        let action_id = state.next_action;
        state.next_action += 1;
        for t in &body.tags {
            state.tags.insert(t.clone());
        }
        let boots_at = state.knobs.boot_time.map(|t| std::time::Instant::now() + t);
        let polls_left = if boots_at.is_some() {
            1
        } else {
            state.knobs.active_after_polls
        };
        let droplet = EmulatedDroplet {
            id,
            name,
            region,
            size,
            image,
            user_data: body.user_data,
            tags: body.tags,
            status: if polls_left == 0 {
                "active".into()
            } else {
                "new".into()
            },
            public_ipv4: format!("192.0.2.{}", id % 250 + 1),
            private_ipv4: private_address(&placement.vpc.ip_range, id),
            vpc_uuid: placement.vpc.id,
            public_ipv6: body
                .ipv6
                .then(|| format!("2001:db8:0:d0::{:x}", id % 0xffff + 2)),
            monitoring: body.monitoring,
            ssh_key_ids: placement.ssh_key_ids,
            polls_left,
            boots_at,
            created_at: now_rfc3339(),
        };
        state.actions.push(json!({
        "id": action_id, "status": "in-progress", "type": "create", "started_at": now_rfc3339(),
        "completed_at": null, "resource_id": id, "resource_type": "droplet", "region_slug": droplet.region
    }));
        let mut view = droplet_json(&state, &droplet);
        view["status"] = json!("new");
        view["networks"]["v4"] = json!([]);
        view["networks"]["v6"] = json!([]);
        state.droplets.insert(id, droplet);
        let lose_response = state.knobs.drop_create_responses > 0;
        if lose_response {
            state.knobs.drop_create_responses -= 1;
        }
        Ok::<_, String>((view, action_id, lose_response))
    })();
    let (view, action_id, lose_response) = match created {
        Ok(created) => created,
        Err(message) => return unprocessable(&message),
    };
    if lose_response {
        kill.0.cancel();
        std::future::pending::<()>().await;
    }
    let links = json!({ "actions": [{ "id": action_id, "rel": "create", "href": format!("/v2/actions/{action_id}") }] });
    (
        StatusCode::ACCEPTED,
        Json(json!({ "droplet": view, "links": links })),
    )
        .into_response()
}

async fn list_droplets(
    State(emu): State<Emulator>,
    Query(q): Query<PageQuery>,
    headers: HeaderMap,
) -> Response {
    let mut state = lock(&emu.state);
    for d in state.droplets.values_mut() {
        if q.tag_name.as_ref().is_none_or(|t| d.tags.contains(t)) {
            observe(d);
        }
    }
    let items: Vec<&EmulatedDroplet> = state
        .droplets
        .values()
        .filter(|d| q.tag_name.as_ref().is_none_or(|t| d.tags.contains(t)))
        .collect();
    let first_id = items.first().map(|d| d.id);
    let body = page_rendering(
        items,
        |d| droplet_json(&state, d),
        "droplets",
        &q,
        &headers,
        "/v2/droplets",
        state.knobs.bad_next_link,
        state.knobs.max_per_page,
    );
    if state.knobs.churn_listings > 0
        && q.page.unwrap_or(1) <= 1
        && body["links"]["pages"].get("next").is_some()
        && let Some(id) = first_id
    {
        // A deletion between two page requests: later Droplets move up one place.
        state.knobs.churn_listings -= 1;
        state.destroy(id);
    }
    Json(body).into_response()
}

fn not_found() -> Response {
    api_error(
        StatusCode::NOT_FOUND,
        "not_found",
        "The resource you were accessing could not be found.",
    )
}

/// Advances a `new` Droplet on a read: `active` once its boot time has passed, or after its
/// reads run out.
fn observe(d: &mut EmulatedDroplet) {
    if d.status != "new" {
        return;
    }
    match d.boots_at {
        Some(at) => {
            if std::time::Instant::now() >= at {
                d.status = "active".into();
            }
        }
        None => {
            d.polls_left = d.polls_left.saturating_sub(1);
            if d.polls_left == 0 {
                d.status = "active".into();
            }
        }
    }
}

async fn get_droplet(State(emu): State<Emulator>, Path(id): Path<String>) -> Response {
    let Ok(id) = id.parse::<u64>() else {
        return not_found();
    };
    let mut state = lock(&emu.state);
    let Some(d) = state.droplets.get_mut(&id) else {
        return not_found();
    };
    observe(d);
    let d = d.clone();
    let view = droplet_json(&state, &d);
    Json(json!({ "droplet": view })).into_response()
}

async fn delete_droplet(State(emu): State<Emulator>, Path(id): Path<String>) -> Response {
    let Ok(id) = id.parse::<u64>() else {
        return not_found();
    };
    let mut state = lock(&emu.state);
    if !state.destroy(id) {
        return not_found();
    }
    StatusCode::NO_CONTENT.into_response()
}

async fn droplet_actions(State(emu): State<Emulator>, Path(id): Path<u64>) -> Response {
    let state = lock(&emu.state);
    let actions: Vec<Value> = state
        .actions
        .iter()
        .filter(|a| a["resource_id"] == json!(id))
        .cloned()
        .collect();
    let total = actions.len();
    Json(json!({ "actions": actions, "links": {}, "meta": { "total": total } })).into_response()
}

/// `GET /v2/actions`: every action of the account, newest first, paged.
async fn list_actions(
    State(emu): State<Emulator>,
    Query(q): Query<PageQuery>,
    headers: HeaderMap,
) -> Response {
    let state = lock(&emu.state);
    let items: Vec<Value> = state.actions.iter().rev().cloned().collect();
    Json(page_of(
        items,
        "actions",
        &q,
        &headers,
        "/v2/actions",
        state.knobs.bad_next_link,
        state.knobs.max_per_page,
    ))
    .into_response()
}

async fn get_action(State(emu): State<Emulator>, Path(id): Path<u64>) -> Response {
    let state = lock(&emu.state);
    match state.actions.iter().find(|a| a["id"] == json!(id)) {
        Some(action) => {
            let mut action = action.clone();
            let done = action["resource_id"]
                .as_u64()
                .and_then(|r| state.droplets.get(&r))
                .is_none_or(|d| d.status == "active");
            if done {
                action["status"] = json!("completed");
            }
            Json(json!({ "action": action })).into_response()
        }
        None => not_found(),
    }
}

#[derive(Deserialize)]
struct TagBody {
    name: String,
}

async fn create_tag(
    State(emu): State<Emulator>,
    body: Result<Json<TagBody>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let Ok(Json(body)) = body else {
        return api_error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "unparseable request body",
        );
    };
    if !valid_tag(&body.name) {
        return api_error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "unprocessable_entity",
            "tag name is invalid",
        );
    }
    let mut state = lock(&emu.state);
    if !state.tags.insert(body.name.clone()) {
        return api_error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "unprocessable_entity",
            "tag already exists",
        );
    }
    let tag = json!({ "name": body.name, "resources": { "count": 0 } });
    (StatusCode::CREATED, Json(json!({ "tag": tag }))).into_response()
}

async fn list_tags(
    State(emu): State<Emulator>,
    Query(q): Query<PageQuery>,
    headers: HeaderMap,
) -> Response {
    let state = lock(&emu.state);
    let items = state
        .tags
        .iter()
        .map(|t| {
            let count = state
                .droplets
                .values()
                .filter(|d| d.tags.contains(t))
                .count();
            json!({ "name": t, "resources": { "count": count, "droplets": { "count": count } } })
        })
        .collect();
    Json(page_of(
        items,
        "tags",
        &q,
        &headers,
        "/v2/tags",
        state.knobs.bad_next_link,
        state.knobs.max_per_page,
    ))
    .into_response()
}

#[derive(Deserialize)]
struct ResourcesBody {
    resources: Vec<ResourceRef>,
}

#[derive(Deserialize)]
struct ResourceRef {
    resource_id: String,
    resource_type: String,
}

async fn tag_resources(
    State(emu): State<Emulator>,
    Path(tag): Path<String>,
    body: Result<Json<ResourcesBody>, axum::extract::rejection::JsonRejection>,
) -> Response {
    change_tag(emu, tag, body, true)
}

async fn untag_resources(
    State(emu): State<Emulator>,
    Path(tag): Path<String>,
    body: Result<Json<ResourcesBody>, axum::extract::rejection::JsonRejection>,
) -> Response {
    change_tag(emu, tag, body, false)
}

fn change_tag(
    emu: Emulator,
    tag: String,
    body: Result<Json<ResourcesBody>, axum::extract::rejection::JsonRejection>,
    add: bool,
) -> Response {
    let Ok(Json(body)) = body else {
        return api_error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "unparseable request body",
        );
    };
    let mut state = lock(&emu.state);
    if !state.tags.contains(&tag) {
        return not_found();
    }
    for r in &body.resources {
        let id = r.resource_id.parse::<u64>().ok();
        let Some(d) = id
            .and_then(|id| state.droplets.get_mut(&id))
            .filter(|_| r.resource_type == "droplet")
        else {
            return not_found();
        };
        let present = d.tags.contains(&tag);
        if add && !present {
            d.tags.push(tag.clone());
        } else if !add && present {
            d.tags.retain(|t| *t != tag);
        }
    }
    StatusCode::NO_CONTENT.into_response()
}

async fn list_sizes(
    State(emu): State<Emulator>,
    Query(q): Query<PageQuery>,
    headers: HeaderMap,
) -> Response {
    let state = lock(&emu.state);
    let items = state
        .sizes
        .iter()
        .map(|s| size_json(&state.knobs, s))
        .collect();
    Json(page_of(
        items,
        "sizes",
        &q,
        &headers,
        "/v2/sizes",
        state.knobs.bad_next_link,
        state.knobs.max_per_page,
    ))
    .into_response()
}

async fn admin_droplets(State(emu): State<Emulator>) -> Response {
    let state = lock(&emu.state);
    let droplets: Vec<Value> = state
        .droplets
        .values()
        .map(|d| {
            let mut v = droplet_json(&state, d);
            v["user_data"] = json!(d.user_data);
            v
        })
        .collect();
    Json(json!({ "droplets": droplets })).into_response()
}

async fn admin_delete(State(emu): State<Emulator>, Path(id): Path<u64>) -> Response {
    if emu.delete_out_of_band(id) {
        StatusCode::NO_CONTENT.into_response()
    } else {
        not_found()
    }
}

#[derive(Deserialize)]
struct FaultsBody {
    /// Forget the faults still queued first.
    #[serde(default)]
    clear: bool,
    #[serde(default)]
    fail_next: Vec<Fault>,
    drop_create_responses: Option<u32>,
    active_after_polls: Option<u32>,
    /// Seconds new Droplets take to turn `active` (negative: by reads again).
    boot_seconds: Option<f64>,
    bad_next_link: Option<bool>,
}

async fn admin_faults(State(emu): State<Emulator>, Json(body): Json<FaultsBody>) -> Response {
    if body.clear {
        emu.clear_faults();
    }
    for fault in body.fail_next {
        emu.fail_next(1, fault);
    }
    if let Some(n) = body.drop_create_responses {
        emu.drop_create_responses(n);
    }
    if let Some(n) = body.active_after_polls {
        emu.set_active_after_polls(n);
    }
    if let Some(seconds) = body.boot_seconds {
        emu.set_boot_time(std::time::Duration::try_from_secs_f64(seconds).ok());
    }
    if let Some(bad) = body.bad_next_link {
        emu.set_bad_next_link(bad);
    }
    StatusCode::NO_CONTENT.into_response()
}

async fn admin_stats(State(emu): State<Emulator>) -> Response {
    let state = lock(&emu.state);
    Json(json!({
        "create_requests": state.create_requests,
        "droplets": state.droplets.len(),
        "requests": state.requests.len(),
    }))
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_and_names() {
        let d = now_rfc3339();
        assert_eq!(d.len(), 20);
        assert!(d.starts_with("20"));
        assert!(valid_tag("bfmid:mzxw6"));
        assert!(!valid_tag("a b"));
        assert!(valid_name("bigfleet-abc"));
        assert!(!valid_name("bad_name"));
        assert_eq!(percent_encode("bfmid:a b"), "bfmid%3Aa%20b");
    }
}

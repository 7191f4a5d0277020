//! A local, stateful emulator of the Hetzner Cloud API (the subset a capacity provider uses),
//! for tests and `cargo xtask e2e`: servers with labels and label selectors, server types with
//! per-location prices, images per architecture, locations, private networks, actions,
//! pagination, Hetzner-style error bodies and bearer-token auth, today's catalogue with
//! per-location availability and deprecation ([`catalogue`]); the resources a
//! production-shaped server refers to (networks and subnets, firewalls, SSH keys, labelled
//! snapshots, spread placement groups with their server limit, `public_net` switches) live in
//! `resources`, and every create request body is recorded as received. Servers and server types
//! are answered in the shape of Hetzner's official `cloud.spec.json` (timestamps RFC 3339,
//! `datacenter` gone, `server_type.deprecated` a boolean); the rest is built from
//! `hcloud::models` types.
//!
//! Test knobs ([`Emulator`] methods): 429 storms with `Retry-After` or `RateLimit-Reset`,
//! injected 5xx, a Create that takes effect but whose response is lost (502) or hangs, servers
//! that take N polls to reach `running`, a type sold out in a location (412
//! `resource_unavailable`), the account's server limit (403 `resource_limit_exceeded`),
//! out-of-band deletion, servers inserted behind the
//! provider's back, listings during which a listed server is deleted (so later servers shift to
//! earlier pages), oversized answers, and per-server public IPv4 addresses (point them at 127.0.0.1 to reach an
//! in-process SSH server).
//!
//! [`sshd`] is a real SSH server (russh) that plays the servers' sshd: it presents the host key
//! the provider injected via user-data and runs commands for real in a per-server root.

// Handlers short-circuit with a ready HTTP response as their error; boxing it would only add
// noise to a test server.
#![allow(clippy::result_large_err)]

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use hcloud::models;
use tokio::net::TcpListener;

pub mod catalogue;
mod ratelimit;
mod resources;
mod selector;
pub mod sshd;

pub use catalogue::Standing;
pub use ratelimit::{RateLimit, class_of};
pub use resources::{GROUP_FULL, SPREAD_GROUP_LIMIT, snapshot};
pub use sshd::{HostKeySource, Observed, Root, Sshd, SshdSetup, first_address};

pub use selector::{LabelSelector, SelectorError};

/// A fault injected into upcoming requests.
#[derive(Clone, Debug, PartialEq)]
pub enum Fault {
    /// Answer 429 `rate_limit_exceeded`, with `Retry-After: <secs>` if given and a
    /// `RateLimit-Reset` of now + `reset_in` seconds if given.
    RateLimited {
        retry_after: Option<u64>,
        reset_in: Option<u64>,
    },
    /// Answer this 5xx status (with the rate-limit headers Hetzner sends on every answer,
    /// including a `RateLimit-Reset` an hour away).
    ServerError(u16),
    /// Answer 200 with a JSON body of this many bytes (an oversized answer).
    Oversized(usize),
}

/// What happens to the next server creations.
#[derive(Clone, Debug, PartialEq)]
pub enum CreateFault {
    /// The server is created, but the client gets a 502 instead of the response.
    LoseResponse,
    /// The server is created, but the response is held back for this long.
    Hang(Duration),
    /// Nothing is created; the client gets this 5xx status (an upstream hiccup).
    Refuse(u16),
}

/// One request as the emulator saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub query: String,
    pub status: u16,
    /// Whether the request carried the right bearer token.
    pub authorized: bool,
}

struct StoredServer {
    server: models::Server,
    /// Reads of this server left before it reports `running` (or, while `deleting`, before it
    /// disappears).
    polls_to_running: u32,
    /// When a server created while a boot time was set reports `running` (its reads then
    /// do not count).
    boots_at: Option<std::time::Instant>,
    /// The user-data the server was created with (what cloud-init would read).
    user_data: Option<String>,
}

struct World {
    token: String,
    next_id: i64,
    servers: BTreeMap<i64, StoredServer>,
    server_types: Vec<models::ServerType>,
    /// Where each server type stands in each location.
    standings: catalogue::Standings,
    /// The account's server limit, when a test sets one.
    server_limit: Option<usize>,
    images: Vec<models::Image>,
    locations: Vec<models::Location>,
    networks: Vec<models::Network>,
    firewalls: Vec<models::Firewall>,
    ssh_keys: Vec<models::SshKey>,
    placement_groups: BTreeMap<i64, models::PlacementGroup>,
    /// Servers a spread placement group holds at most (Hetzner: 10).
    placement_limit: usize,
    /// The JSON bodies of every `POST /servers`, in order, as received.
    create_bodies: Vec<serde_json::Value>,
    new_server_ipv6_net: Option<String>,
    faults: VecDeque<Fault>,
    /// Every request until this moment meets this fault (before the queued ones).
    outage: Option<(std::time::Instant, Fault)>,
    create_faults: VecDeque<CreateFault>,
    polls_to_running: u32,
    /// How long new servers take to boot, when set (in place of `polls_to_running`).
    boot_time: Option<Duration>,
    new_server_ipv4: Option<String>,
    new_server_private_ip: Option<String>,
    max_per_page: i64,
    /// Reads of a `deleting` server left before it disappears.
    deleting_reads: u32,
    /// Listings left during which the first server of page 1 is deleted right after page 1
    /// is served.
    churn_listings: u32,
    seen: Vec<Seen>,
    /// The enforced rate limit, once a test sets one.
    bucket: Option<ratelimit::Bucket>,
    /// Requests by [`class_of`], and of those, how many were answered 429 by the bucket.
    by_class: BTreeMap<&'static str, (usize, usize)>,
}

/// A running emulator. Cloning shares the state.
#[derive(Clone)]
pub struct Emulator {
    world: Arc<Mutex<World>>,
    addr: SocketAddr,
}

impl std::fmt::Debug for Emulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Emulator")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

fn location(id: i64, name: &str, city: &str, country: &str, zone: &str) -> models::Location {
    models::Location {
        id,
        name: name.into(),
        city: city.into(),
        country: country.into(),
        description: format!("Data center {name}"),
        network_zone: zone.into(),
        ..Default::default()
    }
}

fn price(location: &str, net_hourly: f64) -> models::PricePerTime {
    let money = |net: f64| models::Price {
        net: format!("{net:.10}"),
        gross: format!("{:.10}", net * 1.19),
    };
    models::PricePerTime {
        location: location.into(),
        included_traffic: 21_990_232_555_520,
        price_hourly: Box::new(money(net_hourly)),
        price_monthly: Box::new(money(net_hourly * 730.0)),
        price_per_tb_traffic: Box::new(money(1.0)),
    }
}

impl World {
    fn new(token: String) -> World {
        let locations = vec![
            location(1, "fsn1", "Falkenstein", "DE", "eu-central"),
            location(2, "nbg1", "Nuremberg", "DE", "eu-central"),
            location(3, "hel1", "Helsinki", "FI", "eu-central"),
        ];
        let server_types: Vec<models::ServerType> = catalogue::SERVER_TYPES
            .iter()
            .map(
                |(name, id, cores, memory, disk, arch, cpu, category, eur)| models::ServerType {
                    id: *id,
                    name: (*name).into(),
                    description: name.to_uppercase(),
                    cores: *cores,
                    memory: *memory,
                    disk: *disk,
                    architecture: *arch,
                    cpu_type: if *cpu == "dedicated" {
                        models::server_type::CpuType::Dedicated
                    } else {
                        models::server_type::CpuType::Shared
                    },
                    category: Some((*category).into()),
                    // Location-specific prices: Helsinki is a little cheaper, to tell them apart.
                    prices: vec![
                        price("fsn1", *eur),
                        price("nbg1", *eur),
                        price("hel1", *eur * 0.9),
                    ],
                    locations: locations
                        .iter()
                        .map(|l| models::ServerTypeLocation {
                            id: l.id,
                            name: l.name.clone(),
                            deprecation: None,
                        })
                        .collect(),
                    ..Default::default()
                },
            )
            .collect();
        let image = |id: i64, arch: models::Architecture| models::Image {
            id,
            name: Some("ubuntu-24.04".into()),
            description: "Ubuntu 24.04".into(),
            architecture: arch,
            os_flavor: models::image::OsFlavor::Ubuntu,
            os_version: Some("24.04".into()),
            r#type: models::image::Type::System,
            status: models::image::Status::Available,
            disk_size: 5.0,
            created: "2024-04-25T00:00:00+00:00".into(),
            ..Default::default()
        };
        World {
            token,
            next_id: 4_200_001,
            servers: BTreeMap::new(),
            standings: catalogue::initial_standings(&server_types),
            server_limit: None,
            server_types,
            images: {
                let mut images = vec![
                    image(161_547_269, models::Architecture::X86),
                    image(161_547_270, models::Architecture::Arm),
                ];
                images.extend(resources::fixture_snapshots());
                images
            },
            locations,
            networks: resources::fixture_networks(),
            firewalls: resources::fixture_firewalls(),
            ssh_keys: resources::fixture_ssh_keys(),
            placement_groups: BTreeMap::new(),
            placement_limit: resources::SPREAD_GROUP_LIMIT,
            create_bodies: Vec::new(),
            new_server_ipv6_net: None,
            faults: VecDeque::new(),
            outage: None,
            create_faults: VecDeque::new(),
            polls_to_running: 0,
            boot_time: None,
            new_server_ipv4: None,
            new_server_private_ip: None,
            max_per_page: 50,
            deleting_reads: 0,
            churn_listings: 0,
            seen: Vec::new(),
            bucket: None,
            by_class: BTreeMap::new(),
        }
    }

    fn next_id(&mut self) -> i64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    fn action(&mut self, command: &str, server: i64) -> models::Action {
        models::Action {
            id: self.next_id(),
            command: command.into(),
            status: models::action::Status::Running,
            progress: 0,
            started: now_rfc3339(),
            resources: vec![models::Resource {
                id: server,
                r#type: "server".into(),
            }],
            ..Default::default()
        }
    }
}

/// Now, RFC 3339 in UTC, as Hetzner writes `created` and `started`.
fn now_rfc3339() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    catalogue::rfc3339(secs as i64)
}

fn error(status: StatusCode, code: &str, message: &str) -> Response {
    error_with(status, code, message, serde_json::json!({}))
}

/// An error answer with these `details` (`null` where Hetzner sends none).
fn error_with(
    status: StatusCode,
    code: &str,
    message: &str,
    details: serde_json::Value,
) -> Response {
    let body = serde_json::json!({
        "error": {"code": code, "message": message, "details": details},
    });
    (status, Json(body)).into_response()
}

/// Hetzner's label key rule: optional DNS-subdomain prefix and `/`, then a name of at most 63
/// characters that starts and ends alphanumeric with `-_.` inside.
pub fn valid_label_key(key: &str) -> bool {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    let name_ok = !name.is_empty() && valid_label_value(name);
    let prefix_ok = prefix.is_none_or(|p| {
        !p.is_empty()
            && p.len() <= 253
            && p.split('.').all(|part| {
                !part.is_empty()
                    && part
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                    && !part.starts_with('-')
                    && !part.ends_with('-')
            })
    });
    name_ok && prefix_ok
}

/// Hetzner's label value rule: empty, or at most 63 characters starting and ending
/// alphanumeric with `-_.` inside.
pub fn valid_label_value(value: &str) -> bool {
    let b = value.as_bytes();
    value.is_empty()
        || (value.len() <= 63
            && b[0].is_ascii_alphanumeric()
            && b[b.len() - 1].is_ascii_alphanumeric()
            && b.iter()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.')))
}

fn check_labels(labels: &HashMap<String, String>) -> Result<(), Response> {
    for (k, v) in labels {
        if !valid_label_key(k) {
            return Err(error(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_input",
                &format!("invalid label key {k:?}"),
            ));
        }
        if !valid_label_value(v) {
            return Err(error(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_input",
                &format!("invalid label value {v:?} for key {k:?}"),
            ));
        }
    }
    Ok(())
}

fn valid_server_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name.split('.').all(|part| {
            !part.is_empty()
                && part.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !part.starts_with('-')
                && !part.ends_with('-')
        })
}

type Shared = Arc<Mutex<World>>;

fn lock(world: &Shared) -> MutexGuard<'_, World> {
    world.lock().unwrap_or_else(|e| e.into_inner())
}

/// Checks auth and injected faults, and records the request; `Err` is the response to send.
fn gate(
    world: &Shared,
    headers: &HeaderMap,
    method: &str,
    path: &str,
    query: &str,
) -> Result<(), Response> {
    let mut w = lock(world);
    let expected = format!("Bearer {}", w.token);
    let authorized = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v == expected);
    let mut seen = Seen {
        method: method.into(),
        path: path.into(),
        query: query.into(),
        status: 200,
        authorized,
    };
    let class = class_of(method, path, query);
    let limited = authorized && w.bucket.as_mut().is_some_and(|b| !b.take());
    let counted = w.by_class.entry(class).or_default();
    counted.0 += 1;
    if limited {
        counted.1 += 1;
    }
    let outcome = if !authorized {
        Err(error(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "unable to authenticate",
        ))
    } else if limited {
        Err(error(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_exceeded",
            "limit of requests per hour reached",
        ))
    } else {
        let outage = match &w.outage {
            Some((until, fault)) if std::time::Instant::now() < *until => Some(fault.clone()),
            _ => None,
        };
        if outage.is_none() {
            w.outage = None;
        }
        match outage.or_else(|| w.faults.pop_front()) {
            None => Ok(()),
            Some(Fault::ServerError(status)) => {
                let status =
                    StatusCode::from_u16(status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
                let mut response = error(status, "unavailable", "injected server error");
                let now = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or(0);
                let h = response.headers_mut();
                h.insert("ratelimit-limit", HeaderValue::from_static("3600"));
                h.insert("ratelimit-remaining", HeaderValue::from_static("3599"));
                h.insert("ratelimit-reset", HeaderValue::from(now + 3600));
                Err(response)
            }
            Some(Fault::Oversized(bytes)) => {
                let pad = "x".repeat(bytes.saturating_sub(12));
                Err((
                    StatusCode::OK,
                    [(axum::http::header::CONTENT_TYPE, "application/json")],
                    format!("{{\"pad\": \"{pad}\"}}"),
                )
                    .into_response())
            }
            Some(Fault::RateLimited {
                retry_after,
                reset_in,
            }) => {
                let mut response = error(
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limit_exceeded",
                    "limit of 3600 requests per hour reached",
                );
                let h = response.headers_mut();
                h.insert("ratelimit-limit", HeaderValue::from_static("3600"));
                h.insert("ratelimit-remaining", HeaderValue::from_static("0"));
                if let Some(secs) = retry_after {
                    h.insert("retry-after", HeaderValue::from(secs));
                }
                if let Some(secs) = reset_in {
                    let now = SystemTime::now()
                        .duration_since(UNIX_EPOCH)
                        .map(|d| d.as_secs())
                        .unwrap_or(0);
                    h.insert("ratelimit-reset", HeaderValue::from(now + secs));
                }
                Err(response)
            }
        }
    };
    if let Err(response) = &outcome {
        seen.status = response.status().as_u16();
    }
    w.seen.push(seen);
    outcome
}

fn record_status(world: &Shared, status: StatusCode) {
    if let Some(last) = lock(world).seen.last_mut() {
        last.status = status.as_u16();
    }
}

fn query_string(q: &HashMap<String, String>) -> String {
    let mut pairs: Vec<String> = q.iter().map(|(k, v)| format!("{k}={v}")).collect();
    pairs.sort();
    pairs.join("&")
}

fn paginate<T: Clone>(
    items: &[T],
    q: &HashMap<String, String>,
    max: i64,
) -> Result<(Vec<T>, models::Meta), Response> {
    let parse = |key: &str, default: i64| -> Result<i64, Response> {
        match q.get(key) {
            None => Ok(default),
            Some(v) => v.parse::<i64>().ok().filter(|n| *n >= 1).ok_or_else(|| {
                error(
                    StatusCode::BAD_REQUEST,
                    "invalid_input",
                    &format!("invalid {key} {v:?}"),
                )
            }),
        }
    };
    let page = parse("page", 1)?;
    let per_page = parse("per_page", 25)?.min(max);
    let total = items.len() as i64;
    let last_page = ((total + per_page - 1) / per_page).max(1);
    let start = ((page - 1) * per_page).min(total) as usize;
    let end = (page * per_page).min(total) as usize;
    let meta = models::Meta {
        pagination: Box::new(models::Pagination {
            page,
            per_page,
            previous_page: (page > 1).then_some(page - 1),
            next_page: (page < last_page).then_some(page + 1),
            last_page: Some(last_page),
            total_entries: Some(total),
        }),
    };
    Ok((items[start..end].to_vec(), meta))
}

/// Advances a server's lifecycle on a read: `initializing` -> `running` after N polls, and a
/// `deleting` server disappears after its reads run out. Returns false when it is gone.
fn observe(w: &mut World, id: i64) -> bool {
    let Some(stored) = w.servers.get_mut(&id) else {
        return false;
    };
    match stored.server.status {
        models::server::Status::Initializing => {
            if let Some(at) = stored.boots_at {
                if std::time::Instant::now() >= at {
                    stored.server.status = models::server::Status::Running;
                }
            } else if stored.polls_to_running == 0 {
                stored.server.status = models::server::Status::Running;
            } else {
                stored.polls_to_running -= 1;
            }
        }
        models::server::Status::Deleting => {
            if stored.polls_to_running == 0 {
                w.servers.remove(&id);
                return false;
            }
            stored.polls_to_running -= 1;
        }
        _ => {}
    }
    true
}

async fn list_servers(
    State(world): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    if let Err(r) = gate(&world, &headers, "GET", "/servers", &query_string(&q)) {
        return r;
    }
    let selector = match q
        .get("label_selector")
        .map(|s| LabelSelector::parse(s))
        .transpose()
    {
        Ok(s) => s,
        Err(e) => {
            record_status(&world, StatusCode::BAD_REQUEST);
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_input",
                &format!("invalid label_selector: {e}"),
            );
        }
    };
    let mut w = lock(&world);
    let ids: Vec<i64> = w.servers.keys().copied().collect();
    let mut matching = Vec::new();
    for id in ids {
        if !observe(&mut w, id) {
            continue;
        }
        let server = &w.servers[&id].server;
        if selector
            .as_ref()
            .is_some_and(|s| !s.matches(&server.labels))
        {
            continue;
        }
        if q.get("name").is_some_and(|n| *n != server.name) {
            continue;
        }
        matching.push(id);
    }
    let max = w.max_per_page;
    // Only the servers of the page served are copied (a listing of many thousands is paged).
    let answer = paginate(&matching, &q, max).map(|(page, meta)| {
        // Each type rendered once a page, not once a server.
        let mut types: HashMap<&str, serde_json::Value> = HashMap::new();
        for id in &page {
            let kind = &w.servers[id].server.server_type;
            types
                .entry(kind.name.as_str())
                .or_insert_with(|| catalogue::server_type_json(kind, &w.standings));
        }
        let servers: Vec<catalogue::ServerJson<'_>> = page
            .iter()
            .map(|id| {
                let server = &w.servers[id].server;
                catalogue::server_json(server, &types[server.server_type.name.as_str()])
            })
            .collect();
        #[derive(serde::Serialize)]
        struct Page<'a> {
            servers: Vec<catalogue::ServerJson<'a>>,
            meta: &'a models::Meta,
        }
        let body = serde_json::to_vec(&Page {
            servers,
            meta: &meta,
        })
        .ok();
        (page, body, meta)
    });
    if let Ok((page, _, meta)) = &answer
        && w.churn_listings > 0
        && meta.pagination.page == 1
        && meta.pagination.next_page.is_some()
        && let Some(first) = page.first()
    {
        // A deletion between two page requests: every later server moves up one place, so
        // the first server of page 2 is now on page 1, which the client already has.
        w.churn_listings -= 1;
        w.servers.remove(first);
    }
    drop(w);
    match answer {
        Ok((_, Some(body), _)) => (
            StatusCode::OK,
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response(),
        Ok((_, None, _)) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "the listing could not be serialized",
        ),
        Err(r) => r,
    }
}

async fn get_server(
    State(world): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<i64>,
) -> Response {
    if let Err(r) = gate(&world, &headers, "GET", &format!("/servers/{id}"), "") {
        return r;
    }
    let mut w = lock(&world);
    if !observe(&mut w, id) {
        drop(w);
        record_status(&world, StatusCode::NOT_FOUND);
        return error(StatusCode::NOT_FOUND, "not_found", "server not found");
    }
    let server = &w.servers[&id].server;
    let kind = catalogue::server_type_json(&server.server_type, &w.standings);
    Json(serde_json::json!({"server": catalogue::server_json(server, &kind)})).into_response()
}

async fn create_server(State(world): State<Shared>, headers: HeaderMap, body: String) -> Response {
    if let Err(r) = gate(&world, &headers, "POST", "/servers", "") {
        return r;
    }
    let reject = |status: StatusCode, code: &str, message: &str| {
        record_status(&world, status);
        error(status, code, message)
    };
    let request: models::CreateServerRequest = match serde_json::from_str(&body) {
        Ok(r) => r,
        Err(e) => return reject(StatusCode::BAD_REQUEST, "json_error", &e.to_string()),
    };
    if let Ok(raw) = serde_json::from_str::<serde_json::Value>(&body) {
        lock(&world).create_bodies.push(raw);
    }
    let labels = request.labels.clone().unwrap_or_default();
    if let Err(r) = check_labels(&labels) {
        record_status(&world, r.status());
        return r;
    }
    if !valid_server_name(&request.name) {
        return reject(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_input",
            "invalid server name",
        );
    }
    let (response, fault) = {
        let mut w = lock(&world);
        if let Some(CreateFault::Refuse(status)) = w.create_faults.front().cloned() {
            w.create_faults.pop_front();
            drop(w);
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
            return reject(
                status,
                "unavailable",
                "injected failure before the server was created",
            );
        }
        if w.server_limit.is_some_and(|limit| w.servers.len() >= limit) {
            drop(w);
            record_status(&world, StatusCode::FORBIDDEN);
            return error_with(
                StatusCode::FORBIDDEN,
                "resource_limit_exceeded",
                "server limit exceeded",
                serde_json::json!({"limits": [{"name": "server_limit"}]}),
            );
        }
        if w.servers.values().any(|s| s.server.name == request.name) {
            drop(w);
            return reject(
                StatusCode::CONFLICT,
                "uniqueness_error",
                "server name is already used",
            );
        }
        let Some(server_type) = w
            .server_types
            .iter()
            .find(|t| t.name == request.server_type)
            .cloned()
        else {
            drop(w);
            return reject(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_input",
                "server type not found",
            );
        };
        let image = w
            .images
            .iter()
            .find(|i| {
                (i.id.to_string() == request.image
                    || i.name.as_deref() == Some(request.image.as_str()))
                    && i.architecture == server_type.architecture
            })
            .cloned();
        let Some(image) = image else {
            drop(w);
            return reject(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_input",
                "image not found",
            );
        };
        let location_name = request.location.clone().unwrap_or_else(|| "fsn1".into());
        let Some(location) = w
            .locations
            .iter()
            .find(|l| l.name == location_name)
            .cloned()
        else {
            drop(w);
            return reject(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_input",
                "location not found",
            );
        };
        if !catalogue::orderable(
            &w.server_types,
            &w.standings,
            &server_type.name,
            &location.name,
            &now_rfc3339(),
        ) {
            drop(w);
            record_status(&world, StatusCode::PRECONDITION_FAILED);
            return error_with(
                StatusCode::PRECONDITION_FAILED,
                "resource_unavailable",
                "error during placement",
                serde_json::Value::Null,
            );
        }
        let networks = request.networks.clone().unwrap_or_default();
        if let Some(missing) = networks
            .iter()
            .find(|n| !w.networks.iter().any(|k| k.id == **n))
        {
            let missing = *missing;
            drop(w);
            return reject(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_input",
                &format!("network {missing} not found"),
            );
        }
        let attached = match resources::check_create(&w, &request) {
            Ok(attached) => attached,
            Err((status, code, message)) => {
                drop(w);
                return reject(status, code, &message);
            }
        };
        let id = w.next_id();
        let private_net: Vec<models::ServerPrivateNet> = networks
            .iter()
            .map(|network| models::ServerPrivateNet {
                network: Some(*network),
                ip: Some(
                    w.new_server_private_ip
                        .clone()
                        .unwrap_or_else(|| format!("10.0.{}.{}", id % 200, id % 250 + 2)),
                ),
                alias_ips: Some(Vec::new()),
                mac_address: Some("86:00:00:00:00:01".into()),
            })
            .collect();
        for network in &networks {
            if let Some(n) = w.networks.iter_mut().find(|k| k.id == *network) {
                n.servers.push(id);
            }
        }
        let ip = w
            .new_server_ipv4
            .clone()
            .unwrap_or_else(|| format!("198.51.100.{}", id % 250 + 1));
        let ipv6_net = w
            .new_server_ipv6_net
            .clone()
            .unwrap_or_else(|| format!("2001:db8:{:x}::/64", id % 0xffff));
        let placement_group = attached.placement_group.map(|group| {
            let stored = w.placement_groups.get_mut(&group).expect("checked above");
            stored.servers.push(id);
            Box::new(stored.clone())
        });
        let public_firewalls: Vec<models::ServerPublicNetFirewall> = attached
            .firewalls
            .iter()
            .map(|f| models::ServerPublicNetFirewall {
                id: Some(*f),
                status: Some(models::server_public_net_firewall::Status::Applied),
            })
            .collect();
        for firewall in &attached.firewalls {
            if let Some(f) = w.firewalls.iter_mut().find(|k| k.id == *firewall) {
                f.applied_to.push(resources::applied_to_server(id));
            }
        }
        let server = models::Server {
            id,
            name: request.name.clone(),
            status: models::server::Status::Initializing,
            created: now_rfc3339(),
            labels,
            server_type: Box::new(server_type),
            image: Some(Box::new(image)),
            location: Box::new(location),
            primary_disk_size: 40,
            private_net,
            public_net: Box::new(models::ServerPublicNet {
                ipv4: attached.ipv4.then(|| {
                    Box::new(models::Ipv4 {
                        ip,
                        dns_ptr: format!("static.{id}.example"),
                        blocked: false,
                        id: Some(id + 1_000_000),
                    })
                }),
                ipv6: attached.ipv6.then(|| {
                    Box::new(models::Ipv6 {
                        ip: ipv6_net,
                        dns_ptr: Some(Vec::new()),
                        blocked: false,
                        id: Some(id + 2_000_000),
                    })
                }),
                floating_ips: Vec::new(),
                firewalls: Some(public_firewalls),
            }),
            placement_group: Some(placement_group),
            protection: Box::new(models::ServerProtection {
                delete: false,
                rebuild: false,
            }),
            ..Default::default()
        };
        let polls = w.polls_to_running;
        let boots_at = w.boot_time.map(|t| std::time::Instant::now() + t);
        w.servers.insert(
            id,
            StoredServer {
                server: server.clone(),
                polls_to_running: polls,
                boots_at,
                user_data: request.user_data.clone(),
            },
        );
        let action = w.action("create_server", id);
        let start = w.action("start_server", id);
        let response = serde_json::json!({
            "server": catalogue::server_json(
                &server,
                &catalogue::server_type_json(&server.server_type, &w.standings),
            ),
            "action": action,
            "next_actions": [start],
            "root_password": "emulated-root-password",
        });
        (response, w.create_faults.pop_front())
    };
    match fault {
        None => {
            record_status(&world, StatusCode::CREATED);
            (StatusCode::CREATED, Json(response)).into_response()
        }
        // Consumed before anything was created, above.
        Some(CreateFault::Refuse(_)) => unreachable_refuse(&world),
        Some(CreateFault::LoseResponse) => reject(
            StatusCode::BAD_GATEWAY,
            "bad_gateway",
            "upstream connection lost",
        ),
        Some(CreateFault::Hang(delay)) => {
            tokio::time::sleep(delay).await;
            record_status(&world, StatusCode::CREATED);
            (StatusCode::CREATED, Json(response)).into_response()
        }
    }
}

fn unreachable_refuse(world: &Shared) -> Response {
    record_status(world, StatusCode::INTERNAL_SERVER_ERROR);
    error(
        StatusCode::INTERNAL_SERVER_ERROR,
        "emulator_bug",
        "a Refuse fault reached the create path",
    )
}

async fn replace_server(
    State(world): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<i64>,
    body: String,
) -> Response {
    if let Err(r) = gate(&world, &headers, "PUT", &format!("/servers/{id}"), "") {
        return r;
    }
    let request: models::ReplaceServerRequest = match serde_json::from_str(&body) {
        Ok(r) => r,
        Err(e) => {
            record_status(&world, StatusCode::BAD_REQUEST);
            return error(StatusCode::BAD_REQUEST, "json_error", &e.to_string());
        }
    };
    if let Some(labels) = &request.labels
        && let Err(r) = check_labels(labels)
    {
        record_status(&world, r.status());
        return r;
    }
    let mut w = lock(&world);
    let Some(stored) = w.servers.get_mut(&id) else {
        drop(w);
        record_status(&world, StatusCode::NOT_FOUND);
        return error(StatusCode::NOT_FOUND, "not_found", "server not found");
    };
    if let Some(labels) = request.labels {
        stored.server.labels = labels;
    }
    if let Some(name) = request.name {
        stored.server.name = name;
    }
    let server = stored.server.clone();
    let kind = catalogue::server_type_json(&server.server_type, &w.standings);
    Json(serde_json::json!({"server": catalogue::server_json(&server, &kind)})).into_response()
}

async fn delete_server(
    State(world): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<i64>,
) -> Response {
    if let Err(r) = gate(&world, &headers, "DELETE", &format!("/servers/{id}"), "") {
        return r;
    }
    let mut w = lock(&world);
    let reads = w.deleting_reads;
    if !w.servers.contains_key(&id) {
        drop(w);
        record_status(&world, StatusCode::NOT_FOUND);
        return error(StatusCode::NOT_FOUND, "not_found", "server not found");
    }
    resources::detach_server(&mut w, id);
    let Some(stored) = w.servers.get_mut(&id) else {
        drop(w);
        record_status(&world, StatusCode::NOT_FOUND);
        return error(StatusCode::NOT_FOUND, "not_found", "server not found");
    };
    if reads == 0 {
        w.servers.remove(&id);
    } else {
        stored.server.status = models::server::Status::Deleting;
        stored.polls_to_running = reads;
    }
    let action = w.action("delete_server", id);
    Json(models::DeleteServerResponse {
        action: Some(Box::new(action)),
    })
    .into_response()
}

async fn list_server_types(
    State(world): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    if let Err(r) = gate(&world, &headers, "GET", "/server_types", &query_string(&q)) {
        return r;
    }
    let w = lock(&world);
    let types: Vec<serde_json::Value> = w
        .server_types
        .iter()
        .filter(|t| q.get("name").is_none_or(|n| *n == t.name))
        .map(|t| catalogue::server_type_json(t, &w.standings))
        .collect();
    let max = w.max_per_page;
    drop(w);
    match paginate(&types, &q, max) {
        Ok((server_types, meta)) => {
            Json(serde_json::json!({"server_types": server_types, "meta": meta})).into_response()
        }
        Err(r) => r,
    }
}

async fn list_images(
    State(world): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    if let Err(r) = gate(&world, &headers, "GET", "/images", &query_string(&q)) {
        return r;
    }
    let selector = match q
        .get("label_selector")
        .map(|s| LabelSelector::parse(s))
        .transpose()
    {
        Ok(s) => s,
        Err(e) => {
            record_status(&world, StatusCode::BAD_REQUEST);
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_input",
                &format!("invalid label_selector: {e}"),
            );
        }
    };
    let w = lock(&world);
    let arch = |a: models::Architecture| match a {
        models::Architecture::Arm => "arm",
        models::Architecture::X86 => "x86",
    };
    let kind = |t: models::image::Type| match t {
        models::image::Type::System => "system",
        models::image::Type::App => "app",
        models::image::Type::Snapshot => "snapshot",
        models::image::Type::Backup => "backup",
    };
    // `type` and `architecture` may repeat or list several values; one must match.
    let wanted = |key: &str, value: &str| {
        q.get(key)
            .is_none_or(|list| list.split(',').any(|v| v.trim() == value))
    };
    let images: Vec<models::Image> = w
        .images
        .iter()
        .filter(|i| selector.as_ref().is_none_or(|s| s.matches(&i.labels)))
        .filter(|i| wanted("type", kind(i.r#type)))
        .filter(|i| i.status == models::image::Status::Available || q.contains_key("status"))
        .filter(|i| {
            q.get("name")
                .is_none_or(|n| i.name.as_deref() == Some(n.as_str()))
        })
        .filter(|i| {
            q.get("architecture")
                .is_none_or(|a| a == arch(i.architecture))
        })
        .cloned()
        .collect();
    let max = w.max_per_page;
    drop(w);
    match paginate(&images, &q, max) {
        Ok((images, meta)) => Json(models::ListImagesResponse {
            images,
            meta: Box::new(meta),
        })
        .into_response(),
        Err(r) => r,
    }
}

async fn get_image(
    State(world): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<i64>,
) -> Response {
    if let Err(r) = gate(&world, &headers, "GET", &format!("/images/{id}"), "") {
        return r;
    }
    let w = lock(&world);
    match w.images.iter().find(|i| i.id == id).cloned() {
        Some(image) => Json(models::GetImageResponse {
            image: Some(Box::new(image)),
        })
        .into_response(),
        None => {
            drop(w);
            record_status(&world, StatusCode::NOT_FOUND);
            error(StatusCode::NOT_FOUND, "not_found", "image not found")
        }
    }
}

async fn list_locations(
    State(world): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    if let Err(r) = gate(&world, &headers, "GET", "/locations", &query_string(&q)) {
        return r;
    }
    let w = lock(&world);
    let locations: Vec<models::Location> = w
        .locations
        .iter()
        .filter(|l| q.get("name").is_none_or(|n| *n == l.name))
        .cloned()
        .collect();
    let max = w.max_per_page;
    drop(w);
    match paginate(&locations, &q, max) {
        Ok((locations, meta)) => Json(models::ListLocationsResponse {
            locations,
            meta: Box::new(meta),
        })
        .into_response(),
        Err(r) => r,
    }
}

async fn list_networks(
    State(world): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    if let Err(r) = gate(&world, &headers, "GET", "/networks", &query_string(&q)) {
        return r;
    }
    let w = lock(&world);
    let networks: Vec<models::Network> = w
        .networks
        .iter()
        .filter(|n| q.get("name").is_none_or(|v| *v == n.name))
        .cloned()
        .collect();
    let max = w.max_per_page;
    drop(w);
    match paginate(&networks, &q, max) {
        Ok((networks, meta)) => Json(models::ListNetworksResponse {
            networks,
            meta: Box::new(meta),
        })
        .into_response(),
        Err(r) => r,
    }
}

async fn get_network(
    State(world): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<i64>,
) -> Response {
    if let Err(r) = gate(&world, &headers, "GET", &format!("/networks/{id}"), "") {
        return r;
    }
    let w = lock(&world);
    match w.networks.iter().find(|n| n.id == id).cloned() {
        Some(network) => Json(models::GetNetworkResponse {
            network: Some(Box::new(network)),
        })
        .into_response(),
        None => {
            drop(w);
            record_status(&world, StatusCode::NOT_FOUND);
            error(StatusCode::NOT_FOUND, "not_found", "network not found")
        }
    }
}

async fn fallback(State(world): State<Shared>, headers: HeaderMap) -> Response {
    if let Err(r) = gate(&world, &headers, "?", "?", "") {
        return r;
    }
    record_status(&world, StatusCode::NOT_FOUND);
    error(
        StatusCode::NOT_FOUND,
        "not_found",
        "no such endpoint in the emulator",
    )
}

fn router(world: Shared) -> Router {
    Router::new()
        .route("/v1/servers", get(list_servers).post(create_server))
        .route(
            "/v1/servers/{id}",
            get(get_server).put(replace_server).delete(delete_server),
        )
        .route("/v1/server_types", get(list_server_types))
        .route("/v1/images", get(list_images))
        .route("/v1/images/{id}", get(get_image))
        .route("/v1/locations", get(list_locations))
        .route("/v1/networks", get(list_networks))
        .route("/v1/networks/{id}", get(get_network))
        .merge(resources::routes())
        .fallback(fallback)
        .layer(axum::middleware::map_response_with_state(
            world.clone(),
            stamp_rate_limit,
        ))
        .with_state(world)
}

/// Every answer carries the rate-limit headers, as Hetzner's do: with a rate limit set, the
/// bucket's real ones; without, those of a bucket one request short of full, unless an
/// injected fault chose its own.
async fn stamp_rate_limit(State(world): State<Shared>, mut response: Response) -> Response {
    let mut w = lock(&world);
    let h = response.headers_mut();
    if let Some(bucket) = w.bucket.as_mut() {
        for (name, value) in bucket.headers() {
            h.insert(name, HeaderValue::from(value));
        }
    } else if !h.contains_key("ratelimit-remaining") {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        h.insert("ratelimit-limit", HeaderValue::from_static("3600"));
        h.insert("ratelimit-remaining", HeaderValue::from_static("3599"));
        h.insert("ratelimit-reset", HeaderValue::from(now + 1));
    }
    response
}

impl Emulator {
    /// Serves the emulator on `listener` (bind `127.0.0.1:0` and pass it in), accepting
    /// `token` as the only valid bearer token.
    pub fn serve(listener: TcpListener, token: &str) -> std::io::Result<Emulator> {
        let addr = listener.local_addr()?;
        let world = Arc::new(Mutex::new(World::new(token.to_owned())));
        let app = router(world.clone());
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!(err = %e, "hcloud emulator stopped");
            }
        });
        Ok(Emulator { world, addr })
    }

    /// Binds `127.0.0.1:0` and serves.
    pub async fn start(token: &str) -> std::io::Result<Emulator> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        Emulator::serve(listener, token)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The base URL to give the client (`--hcloud-endpoint`).
    pub fn endpoint(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    fn world(&self) -> MutexGuard<'_, World> {
        lock(&self.world)
    }

    /// Queues faults for the next requests, in order.
    pub fn inject(&self, faults: impl IntoIterator<Item = Fault>) {
        self.world().faults.extend(faults);
    }

    /// How many queued faults wait for a request.
    pub fn pending_faults(&self) -> usize {
        self.world().faults.len()
    }

    /// Answers every request with `fault` for `lasting` from now, however many requests that
    /// is (an outage of the API, as a cloud has them: by time, not by count), before any
    /// queued fault. A later call replaces the outage.
    pub fn inject_for(&self, lasting: Duration, fault: Fault) {
        self.world().outage = Some((std::time::Instant::now() + lasting, fault));
    }

    /// Every server not being deleted, as `(id, name)` (names derive from machine ids).
    pub fn live_servers(&self) -> Vec<(i64, String)> {
        self.world()
            .servers
            .values()
            .filter(|s| s.server.status != models::server::Status::Deleting)
            .map(|s| (s.server.id, s.server.name.clone()))
            .collect()
    }

    /// During each of the next `listings` multi-page server listings, deletes the first server
    /// of page 1 right after serving it (as another actor would between two page requests).
    pub fn delete_during_next_listings(&self, listings: u32) {
        self.world().churn_listings = listings;
    }

    /// Queues faults for the next server creations, in order.
    pub fn inject_create(&self, faults: impl IntoIterator<Item = CreateFault>) {
        self.world().create_faults.extend(faults);
    }

    /// New servers report `initializing` for this many reads before `running`.
    pub fn set_polls_to_running(&self, polls: u32) {
        self.world().polls_to_running = polls;
    }

    /// New servers report `running` once this long has passed since their create, however
    /// often they are read (`None`: by reads, see [`Emulator::set_polls_to_running`]).
    pub fn set_boot_time(&self, boot: Option<Duration>) {
        self.world().boot_time = boot;
    }

    /// The public IPv4 of servers created from now on (e.g. `127.0.0.1`).
    pub fn set_new_server_ipv4(&self, ip: &str) {
        self.world().new_server_ipv4 = Some(ip.to_owned());
    }

    /// The address new servers get on the private networks they are attached to (e.g.
    /// `127.0.0.1` to reach a local SSH server over the "private" path).
    pub fn set_new_server_private_ip(&self, ip: &str) {
        self.world().new_server_private_ip = Some(ip.to_owned());
    }

    /// Caps `per_page`, to exercise pagination with few servers.
    pub fn set_max_per_page(&self, max: i64) {
        self.world().max_per_page = max.max(1);
    }

    /// Deleted servers stay visible as `deleting` for this many reads.
    pub fn set_deleting_reads(&self, reads: u32) {
        self.world().deleting_reads = reads;
    }

    /// Every server, as stored.
    pub fn servers(&self) -> Vec<models::Server> {
        self.world()
            .servers
            .values()
            .map(|s| s.server.clone())
            .collect()
    }

    pub fn server(&self, id: i64) -> Option<models::Server> {
        self.world().servers.get(&id).map(|s| s.server.clone())
    }

    /// The user-data a server was created with.
    pub fn user_data(&self, id: i64) -> Option<String> {
        self.world()
            .servers
            .get(&id)
            .and_then(|s| s.user_data.clone())
    }

    /// Deletes a server behind the provider's back.
    pub fn delete_out_of_band(&self, id: i64) -> bool {
        self.world().servers.remove(&id).is_some()
    }

    /// Replaces a server's labels behind the provider's back.
    pub fn set_labels(&self, id: i64, labels: HashMap<String, String>) {
        if let Some(s) = self.world().servers.get_mut(&id) {
            s.server.labels = labels;
        }
    }

    /// Sets a server's public IPv4.
    pub fn set_ipv4(&self, id: i64, ip: &str) {
        if let Some(s) = self.world().servers.get_mut(&id)
            && let Some(v4) = s.server.public_net.ipv4.as_mut()
        {
            v4.ip = ip.to_owned();
        }
    }

    /// Adds a running server that the provider did not create (an orphan, or one made by an
    /// older version); returns its id.
    pub fn insert_server(
        &self,
        name: &str,
        server_type: &str,
        location: &str,
        labels: HashMap<String, String>,
        ipv4: &str,
    ) -> i64 {
        let mut w = self.world();
        let id = w.next_id();
        let server_type = w
            .server_types
            .iter()
            .find(|t| t.name == server_type)
            .cloned()
            .unwrap_or_default();
        let location = w
            .locations
            .iter()
            .find(|l| l.name == location)
            .cloned()
            .unwrap_or_default();
        let server = models::Server {
            id,
            name: name.into(),
            status: models::server::Status::Running,
            created: now_rfc3339(),
            labels,
            server_type: Box::new(server_type),
            location: Box::new(location),
            public_net: Box::new(models::ServerPublicNet {
                ipv4: Some(Box::new(models::Ipv4 {
                    ip: ipv4.into(),
                    ..Default::default()
                })),
                ..Default::default()
            }),
            ..Default::default()
        };
        w.servers.insert(
            id,
            StoredServer {
                server,
                polls_to_running: 0,
                boots_at: None,
                user_data: None,
            },
        );
        id
    }

    /// Sells out `server_type` in `location` (`sold_out`), or sells it again: the catalogue says
    /// `available: false` there and a Create answers 412 `resource_unavailable`.
    pub fn set_sold_out(&self, server_type: &str, location: &str, sold_out: bool) {
        let mut w = self.world();
        let standing = w
            .standings
            .entry((server_type.to_owned(), location.to_owned()))
            .or_default();
        standing.available = !sold_out;
    }

    /// Announces (or, with `None`, withdraws) a deprecation of `server_type` in `location`:
    /// `(announced, unavailable_after)`, RFC 3339 UTC (`2026-09-01T00:00:00Z`). After
    /// `unavailable_after` a Create answers 412 `resource_unavailable`.
    pub fn set_deprecation(&self, server_type: &str, location: &str, dates: Option<(&str, &str)>) {
        let mut w = self.world();
        let standing = w
            .standings
            .entry((server_type.to_owned(), location.to_owned()))
            .or_default();
        standing.deprecation = dates.map(|(a, u)| (a.to_owned(), u.to_owned()));
    }

    /// Where `server_type` stands in `location`.
    pub fn standing(&self, server_type: &str, location: &str) -> Standing {
        self.world()
            .standings
            .get(&(server_type.to_owned(), location.to_owned()))
            .cloned()
            .unwrap_or_default()
    }

    /// The account's server limit: a Create beyond it answers 403 `resource_limit_exceeded`
    /// (`None`: no limit).
    pub fn set_server_limit(&self, limit: Option<usize>) {
        self.world().server_limit = limit;
    }

    /// Every request seen so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.world().seen.clone()
    }

    /// How many requests matched `method` and `path`.
    pub fn count(&self, method: &str, path: &str) -> usize {
        self.world()
            .seen
            .iter()
            .filter(|s| s.method == method && s.path == path)
            .count()
    }

    /// Enforces `limit` from now on, starting from a full bucket.
    pub fn set_rate_limit(&self, limit: RateLimit) {
        self.world().bucket = Some(ratelimit::Bucket::full(limit));
    }

    /// Spends up to `n` tokens of the bucket as another user of the token would; returns how
    /// many it got (0 without a rate limit).
    pub fn drain_rate_limit(&self, n: u32) -> u32 {
        self.world().bucket.as_mut().map_or(0, |b| b.drain(n))
    }

    /// The whole tokens left in the bucket (`None` without a rate limit).
    pub fn rate_limit_remaining(&self) -> Option<u32> {
        self.world().bucket.as_mut().map(|b| b.remaining())
    }

    /// Requests by class ([`class_of`]): how many arrived and how many of those the rate
    /// limit refused.
    pub fn requests_by_class(&self) -> BTreeMap<&'static str, (usize, usize)> {
        self.world().by_class.clone()
    }

    /// How many requests were answered with `status`.
    pub fn count_status(&self, status: u16) -> usize {
        self.world()
            .seen
            .iter()
            .filter(|s| s.status == status)
            .count()
    }
}

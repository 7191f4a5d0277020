//! The account resources a Droplet refers to: the account itself, regions, images (public
//! distribution images and the account's private snapshots), VPCs (one default VPC per region,
//! as DigitalOcean makes them), SSH keys and cloud firewalls. Read endpoints with the real API's
//! envelopes and `not_found` answers, and an admin seed endpoint for end-to-end runs.

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::{
    Emulator, EmulatorState, PageQuery, REGIONS, api_error, lock, not_found, now_rfc3339, page_of,
};

/// An image: a public distribution image (with a slug) or a private snapshot.
#[derive(Clone, Debug)]
pub struct EmulatedImage {
    pub id: u64,
    pub name: String,
    /// Public images only.
    pub slug: Option<String>,
    pub distribution: String,
    pub public: bool,
    /// `base`, `snapshot`, `custom` or `backup`.
    pub kind: String,
    pub regions: Vec<String>,
    /// `available`, `pending`, `NEW`, `deleted` or `retired`.
    pub status: String,
    pub min_disk_size: u64,
    pub created_at: String,
}

/// A VPC network.
#[derive(Clone, Debug)]
pub struct EmulatedVpc {
    pub id: String,
    pub name: String,
    pub region: String,
    pub ip_range: String,
    pub default: bool,
    pub created_at: String,
}

/// An SSH key of the account.
#[derive(Clone, Debug)]
pub struct EmulatedKey {
    pub id: u64,
    pub name: String,
    pub fingerprint: String,
    pub public_key: String,
}

/// A cloud firewall; it applies to Droplets by id and by tag.
#[derive(Clone, Debug)]
pub struct EmulatedFirewall {
    pub id: String,
    pub name: String,
    pub tags: Vec<String>,
    pub droplet_ids: Vec<u64>,
    pub created_at: String,
}

/// The resources of a fresh account: three public images available everywhere and a default
/// VPC in every region.
pub(crate) fn fresh(state: &mut EmulatorState) {
    for (id, slug, name, distribution) in [
        (191_457_505, "ubuntu-24-04-x64", "24.04 (LTS) x64", "Ubuntu"),
        (129_211_873, "ubuntu-22-04-x64", "22.04 (LTS) x64", "Ubuntu"),
        (135_437_489, "debian-12-x64", "12 x64", "Debian"),
    ] {
        state.images.push(EmulatedImage {
            id,
            name: name.into(),
            slug: Some(slug.into()),
            distribution: distribution.into(),
            public: true,
            kind: "base".into(),
            regions: REGIONS.iter().map(|r| (*r).to_owned()).collect(),
            status: "available".into(),
            min_disk_size: 7,
            created_at: "2024-04-24T15:36:06Z".into(),
        });
    }
    for (i, region) in REGIONS.iter().enumerate() {
        let id = state.next_uuid();
        state.vpcs.push(EmulatedVpc {
            id,
            name: format!("default-{region}"),
            region: (*region).to_owned(),
            ip_range: format!("10.{}.0.0/20", 100 + i * 8),
            default: true,
            created_at: now_rfc3339(),
        });
    }
}

impl EmulatorState {
    /// A fresh version-4-shaped UUID, deterministic per emulator.
    pub(crate) fn next_uuid(&mut self) -> String {
        self.next_uuid += 1;
        let n = self.next_uuid;
        format!(
            "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
            0x5a49_81aa_u32.wrapping_add(n as u32),
            n & 0xffff,
            n & 0xfff,
            (n >> 12) & 0xfff,
            0x00d6_bff5_2042_u64.wrapping_add(n)
        )
    }

    pub(crate) fn image_by_id(&self, id: u64) -> Option<&EmulatedImage> {
        self.images
            .iter()
            .find(|i| i.id == id && i.status != "deleted")
    }

    pub(crate) fn image_by_slug(&self, slug: &str) -> Option<&EmulatedImage> {
        self.images
            .iter()
            .find(|i| i.slug.as_deref() == Some(slug) && i.status != "deleted")
    }

    pub(crate) fn vpc(&self, id: &str) -> Option<&EmulatedVpc> {
        self.vpcs.iter().find(|v| v.id == id)
    }

    pub(crate) fn default_vpc(&self, region: &str) -> Option<&EmulatedVpc> {
        self.vpcs.iter().find(|v| v.region == region && v.default)
    }

    /// A key by numeric id or by fingerprint.
    pub(crate) fn key(&self, id_or_fingerprint: &str) -> Option<&EmulatedKey> {
        match id_or_fingerprint.parse::<u64>() {
            Ok(id) => self.ssh_keys.iter().find(|k| k.id == id),
            Err(_) => self
                .ssh_keys
                .iter()
                .find(|k| k.fingerprint == id_or_fingerprint),
        }
    }
}

/// A fingerprint-shaped value (16 colon-separated hex bytes) derived from `seed`.
fn fingerprint(seed: &str) -> String {
    let mut h: u128 = 0x6c62_272e_07bb_0142_62b8_2175_6295_c58d;
    for b in seed.bytes() {
        h ^= u128::from(b);
        h = h.wrapping_mul(0x0000_0000_0100_0000_0000_0000_0000_013b);
    }
    h.to_be_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

impl Emulator {
    /// Adds a private snapshot of a Droplet, available in `regions`; returns its image id.
    pub fn add_snapshot(&self, name: &str, regions: &[&str]) -> u64 {
        let mut state = lock(&self.state);
        state.next_image += 1;
        let id = state.next_image;
        state.images.push(EmulatedImage {
            id,
            name: name.to_owned(),
            slug: None,
            distribution: "Ubuntu".into(),
            public: false,
            kind: "snapshot".into(),
            regions: regions.iter().map(|r| (*r).to_owned()).collect(),
            status: "available".into(),
            min_disk_size: 25,
            created_at: now_rfc3339(),
        });
        id
    }

    /// Deletes an image or snapshot, as `DELETE /v2/images/{id}` does: from now on it is not
    /// listed, not found and refused by a create. False if no such image exists.
    pub fn delete_image(&self, id: u64) -> bool {
        let mut state = lock(&self.state);
        match state.images.iter_mut().find(|i| i.id == id) {
            Some(image) => {
                image.status = "deleted".into();
                true
            }
            None => false,
        }
    }

    /// Adds a VPC; returns its id.
    pub fn add_vpc(&self, name: &str, region: &str, ip_range: &str) -> String {
        let mut state = lock(&self.state);
        let id = state.next_uuid();
        state.vpcs.push(EmulatedVpc {
            id: id.clone(),
            name: name.to_owned(),
            region: region.to_owned(),
            ip_range: ip_range.to_owned(),
            default: false,
            created_at: now_rfc3339(),
        });
        id
    }

    /// Adds an SSH key; returns its id and fingerprint.
    pub fn add_ssh_key(&self, name: &str) -> (u64, String) {
        let mut state = lock(&self.state);
        state.next_key += 1;
        let id = state.next_key;
        let fingerprint = fingerprint(&format!("{id}/{name}"));
        state.ssh_keys.push(EmulatedKey {
            id,
            name: name.to_owned(),
            fingerprint: fingerprint.clone(),
            public_key: format!("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI{id:032} {name}"),
        });
        (id, fingerprint)
    }

    /// Adds a cloud firewall applying to Droplets with any of `tags`; returns its id.
    pub fn add_firewall(&self, name: &str, tags: &[&str]) -> String {
        let mut state = lock(&self.state);
        let id = state.next_uuid();
        for t in tags {
            state.tags.insert((*t).to_owned());
        }
        state.firewalls.push(EmulatedFirewall {
            id: id.clone(),
            name: name.to_owned(),
            tags: tags.iter().map(|t| (*t).to_owned()).collect(),
            droplet_ids: Vec::new(),
            created_at: now_rfc3339(),
        });
        id
    }

    /// The default VPC of `region`.
    pub fn default_vpc(&self, region: &str) -> Option<String> {
        lock(&self.state).default_vpc(region).map(|v| v.id.clone())
    }

    /// The bodies of every `POST /v2/droplets` that parsed as JSON, in arrival order, exactly
    /// as sent.
    pub fn create_bodies(&self) -> Vec<Value> {
        lock(&self.state).create_bodies.clone()
    }
}

pub(crate) fn image_json(i: &EmulatedImage) -> Value {
    json!({
        "id": i.id,
        "name": i.name,
        "type": i.kind,
        "distribution": i.distribution,
        "slug": i.slug,
        "public": i.public,
        "regions": i.regions,
        "created_at": i.created_at,
        "min_disk_size": i.min_disk_size,
        "size_gigabytes": 2.36,
        "description": "",
        "tags": [],
        "status": i.status,
        "error_message": "",
    })
}

fn snapshot_json(i: &EmulatedImage) -> Value {
    json!({
        "id": i.id.to_string(),
        "name": i.name,
        "created_at": i.created_at,
        "regions": i.regions,
        "resource_id": "200776916",
        "resource_type": "droplet",
        "min_disk_size": i.min_disk_size,
        "size_gigabytes": 2.36,
        "tags": [],
    })
}

fn vpc_json(v: &EmulatedVpc) -> Value {
    json!({
        "id": v.id,
        "urn": format!("do:vpc:{}", v.id),
        "name": v.name,
        "description": "",
        "region": v.region,
        "ip_range": v.ip_range,
        "default": v.default,
        "created_at": v.created_at,
    })
}

fn key_json(k: &EmulatedKey) -> Value {
    json!({ "id": k.id, "fingerprint": k.fingerprint, "public_key": k.public_key, "name": k.name })
}

fn firewall_json(f: &EmulatedFirewall) -> Value {
    json!({
        "id": f.id,
        "status": "succeeded",
        "created_at": f.created_at,
        "pending_changes": [],
        "name": f.name,
        "droplet_ids": f.droplet_ids,
        "tags": f.tags,
        "inbound_rules": [
            { "protocol": "tcp", "ports": "22", "sources": { "addresses": ["0.0.0.0/0", "::/0"] } }
        ],
        "outbound_rules": [
            { "protocol": "tcp", "ports": "0", "destinations": { "addresses": ["0.0.0.0/0", "::/0"] } }
        ],
    })
}

fn paged(
    state: &EmulatorState,
    items: Vec<Value>,
    key: &str,
    q: &PageQuery,
    headers: &HeaderMap,
    path: &str,
) -> Response {
    Json(page_of(
        items,
        key,
        q,
        headers,
        path,
        state.knobs.bad_next_link,
        state.knobs.max_per_page,
    ))
    .into_response()
}

pub(crate) async fn get_account(State(emu): State<Emulator>) -> Response {
    let state = lock(&emu.state);
    Json(json!({ "account": {
        "droplet_limit": state.knobs.droplet_limit.unwrap_or(crate::DEFAULT_DROPLET_LIMIT),
        "floating_ip_limit": 3,
        "volume_limit": 100,
        "email": "operator@example.com",
        "name": "Emulated Operator",
        "uuid": "b6fr89dbf6d9156cace5f3c78dc9851d957381ef",
        "email_verified": true,
        "status": "active",
        "status_message": "",
        "team": { "uuid": "5df3e3004a17e242b7c20ca6c9fc25b701a47ece", "name": "Emulated Team" },
        "droplet_count": state.droplets.len(),
    }}))
    .into_response()
}

pub(crate) async fn list_regions(
    State(emu): State<Emulator>,
    Query(q): Query<PageQuery>,
    headers: HeaderMap,
) -> Response {
    let state = lock(&emu.state);
    let items = REGIONS
        .iter()
        .map(|r| {
            let sizes: Vec<&str> = state
                .sizes
                .iter()
                .map(|s| s.slug)
                .filter(|s| crate::size_regions(&state.knobs, s).contains(r))
                .collect();
            json!({
                "name": r.to_uppercase(),
                "slug": r,
                "features": ["backups", "ipv6", "metadata", "install_agent", "storage", "image_transfer"],
                "available": !state.knobs.closed_regions.contains(*r),
                "sizes": sizes,
            })
        })
        .collect();
    paged(&state, items, "regions", &q, &headers, "/v2/regions")
}

#[derive(Deserialize)]
pub(crate) struct ImageQuery {
    #[serde(rename = "type")]
    kind: Option<String>,
    private: Option<bool>,
    resource_type: Option<String>,
}

pub(crate) async fn list_images(
    State(emu): State<Emulator>,
    Query(q): Query<PageQuery>,
    Query(filter): Query<ImageQuery>,
    headers: HeaderMap,
) -> Response {
    let state = lock(&emu.state);
    let items = state
        .images
        .iter()
        .filter(|i| i.status != "deleted")
        .filter(|i| filter.private.is_none_or(|p| !p || !i.public))
        .filter(|i| match filter.kind.as_deref() {
            Some("distribution") => i.public && i.kind == "base",
            Some("application") => false,
            _ => true,
        })
        .map(image_json)
        .collect();
    paged(&state, items, "images", &q, &headers, "/v2/images")
}

/// `GET /v2/images/{id or slug}`.
pub(crate) async fn get_image(State(emu): State<Emulator>, Path(key): Path<String>) -> Response {
    let state = lock(&emu.state);
    let image = match key.parse::<u64>() {
        Ok(id) => state.image_by_id(id),
        Err(_) => state.image_by_slug(&key),
    };
    match image {
        Some(i) => Json(json!({ "image": image_json(i) })).into_response(),
        None => not_found(),
    }
}

pub(crate) async fn list_snapshots(
    State(emu): State<Emulator>,
    Query(q): Query<PageQuery>,
    Query(filter): Query<ImageQuery>,
    headers: HeaderMap,
) -> Response {
    let state = lock(&emu.state);
    let items = if filter
        .resource_type
        .as_deref()
        .is_some_and(|t| t != "droplet")
    {
        Vec::new()
    } else {
        state
            .images
            .iter()
            .filter(|i| i.kind == "snapshot" && i.status != "deleted")
            .map(snapshot_json)
            .collect()
    };
    paged(&state, items, "snapshots", &q, &headers, "/v2/snapshots")
}

pub(crate) async fn get_snapshot(State(emu): State<Emulator>, Path(id): Path<String>) -> Response {
    let state = lock(&emu.state);
    let found = id
        .parse::<u64>()
        .ok()
        .and_then(|id| state.image_by_id(id))
        .filter(|i| i.kind == "snapshot");
    match found {
        Some(i) => Json(json!({ "snapshot": snapshot_json(i) })).into_response(),
        None => not_found(),
    }
}

pub(crate) async fn list_vpcs(
    State(emu): State<Emulator>,
    Query(q): Query<PageQuery>,
    headers: HeaderMap,
) -> Response {
    let state = lock(&emu.state);
    let items = state.vpcs.iter().map(vpc_json).collect();
    paged(&state, items, "vpcs", &q, &headers, "/v2/vpcs")
}

pub(crate) async fn get_vpc(State(emu): State<Emulator>, Path(id): Path<String>) -> Response {
    let state = lock(&emu.state);
    match state.vpc(&id) {
        Some(v) => Json(json!({ "vpc": vpc_json(v) })).into_response(),
        None => not_found(),
    }
}

pub(crate) async fn list_keys(
    State(emu): State<Emulator>,
    Query(q): Query<PageQuery>,
    headers: HeaderMap,
) -> Response {
    let state = lock(&emu.state);
    let items = state.ssh_keys.iter().map(key_json).collect();
    paged(&state, items, "ssh_keys", &q, &headers, "/v2/account/keys")
}

/// `GET /v2/account/keys/{id or fingerprint}`.
pub(crate) async fn get_key(State(emu): State<Emulator>, Path(key): Path<String>) -> Response {
    let state = lock(&emu.state);
    match state.key(&key) {
        Some(k) => Json(json!({ "ssh_key": key_json(k) })).into_response(),
        None => not_found(),
    }
}

pub(crate) async fn list_firewalls(
    State(emu): State<Emulator>,
    Query(q): Query<PageQuery>,
    headers: HeaderMap,
) -> Response {
    let state = lock(&emu.state);
    let items = state.firewalls.iter().map(firewall_json).collect();
    paged(&state, items, "firewalls", &q, &headers, "/v2/firewalls")
}

pub(crate) async fn get_firewall(State(emu): State<Emulator>, Path(id): Path<String>) -> Response {
    let state = lock(&emu.state);
    match state.firewalls.iter().find(|f| f.id == id) {
        Some(f) => Json(json!({ "firewall": firewall_json(f) })).into_response(),
        None => not_found(),
    }
}

#[derive(Deserialize)]
struct SeedVpc {
    name: String,
    region: String,
    ip_range: String,
}

#[derive(Deserialize)]
struct SeedSnapshot {
    name: String,
    regions: Vec<String>,
}

#[derive(Deserialize)]
struct SeedFirewall {
    name: String,
    tags: Vec<String>,
}

#[derive(Deserialize)]
pub(crate) struct SeedBody {
    #[serde(default)]
    vpcs: Vec<SeedVpc>,
    #[serde(default)]
    snapshots: Vec<SeedSnapshot>,
    #[serde(default)]
    ssh_keys: Vec<String>,
    #[serde(default)]
    firewalls: Vec<SeedFirewall>,
}

/// `POST /_emulator/seed`: adds resources and answers with what was made, in order.
pub(crate) async fn admin_seed(
    State(emu): State<Emulator>,
    body: Option<Json<SeedBody>>,
) -> Response {
    let Some(Json(body)) = body else {
        return api_error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "unparseable seed body",
        );
    };
    let vpcs: Vec<Value> = body
        .vpcs
        .iter()
        .map(|v| json!({ "name": v.name, "id": emu.add_vpc(&v.name, &v.region, &v.ip_range) }))
        .collect();
    let snapshots: Vec<Value> = body
        .snapshots
        .iter()
        .map(|s| {
            let regions: Vec<&str> = s.regions.iter().map(String::as_str).collect();
            json!({ "name": s.name, "id": emu.add_snapshot(&s.name, &regions) })
        })
        .collect();
    let ssh_keys: Vec<Value> = body
        .ssh_keys
        .iter()
        .map(|name| {
            let (id, fingerprint) = emu.add_ssh_key(name);
            json!({ "name": name, "id": id, "fingerprint": fingerprint })
        })
        .collect();
    let firewalls: Vec<Value> = body
        .firewalls
        .iter()
        .map(|f| {
            let tags: Vec<&str> = f.tags.iter().map(String::as_str).collect();
            json!({ "name": f.name, "id": emu.add_firewall(&f.name, &tags) })
        })
        .collect();
    Json(json!({ "vpcs": vpcs, "snapshots": snapshots, "ssh_keys": ssh_keys, "firewalls": firewalls }))
        .into_response()
}

/// `GET /_emulator/create-requests`: every Droplet create body as sent.
pub(crate) async fn admin_create_requests(State(emu): State<Emulator>) -> Response {
    Json(json!({ "requests": emu.create_bodies() })).into_response()
}

//! The resources a production-shaped server refers to: private networks with subnets,
//! firewalls, SSH keys, labelled snapshot images and spread placement groups, with the real
//! API's request and response shapes (`hcloud::models`), plus the checks a server create makes
//! against them and the `attach_to_network` action.
//!
//! Fixtures every emulator starts with (tests and `cargo xtask e2e` refer to them by name):
//!
//! - networks `bigfleet-mgmt` (9001, `10.0.0.0/16`, cloud subnet `10.0.1.0/24` in
//!   `eu-central`) and `bigfleet-storage` (9002, `10.1.0.0/16`, cloud subnet `10.1.0.0/24`);
//! - firewalls `bigfleet-nodes` (7001) and `bigfleet-ssh` (7002);
//! - SSH keys `ops-alice` (5001) and `ops-bob` (5002);
//! - x86 snapshots labelled `k8s-version=1.31,role=node` (3001, older; 3002, newer) and
//!   `k8s-version=1.30,role=node` (3003); no arm snapshot, so an arm server type has no image
//!   for those selectors.

use std::collections::HashMap;

use axum::Json;
use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use hcloud::models;

use crate::{
    Emulator, LabelSelector, Shared, World, check_labels, error, gate, lock, now_rfc3339, paginate,
    query_string, record_status,
};

/// Servers per spread placement group on the real API.
pub const SPREAD_GROUP_LIMIT: usize = 10;

/// The error code of a create into a full spread placement group.
pub const GROUP_FULL: &str = "placement_group_member_limit_reached";

fn subnet(ip_range: &str, gateway: &str) -> models::SubnetWithGateway {
    models::SubnetWithGateway {
        gateway: gateway.into(),
        ip_range: Some(ip_range.into()),
        network_zone: "eu-central".into(),
        r#type: models::subnet_with_gateway::Type::Cloud,
        vswitch_id: None,
    }
}

pub(crate) fn fixture_networks() -> Vec<models::Network> {
    let network =
        |id: i64, name: &str, range: &str, sub: models::SubnetWithGateway| models::Network {
            id,
            name: name.into(),
            ip_range: range.into(),
            subnets: vec![sub],
            created: "2024-01-01T00:00:00+00:00".into(),
            ..Default::default()
        };
    vec![
        network(
            9001,
            "bigfleet-mgmt",
            "10.0.0.0/16",
            subnet("10.0.1.0/24", "10.0.0.1"),
        ),
        network(
            9002,
            "bigfleet-storage",
            "10.1.0.0/16",
            subnet("10.1.0.0/24", "10.1.0.1"),
        ),
    ]
}

pub(crate) fn fixture_firewalls() -> Vec<models::Firewall> {
    [(7001, "bigfleet-nodes"), (7002, "bigfleet-ssh")]
        .into_iter()
        .map(|(id, name)| models::Firewall {
            id,
            name: name.into(),
            labels: Some(HashMap::new()),
            created: "2024-01-01T00:00:00+00:00".into(),
            ..Default::default()
        })
        .collect()
}

pub(crate) fn fixture_ssh_keys() -> Vec<models::SshKey> {
    [(5001, "ops-alice"), (5002, "ops-bob")]
        .into_iter()
        .map(|(id, name)| models::SshKey {
            id,
            name: name.into(),
            fingerprint: format!(
                "b7:2f:30:a0:2f:6c:58:6c:21:04:58:61:ba:06:3b:{:02x}",
                id % 256
            ),
            public_key: format!("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI{id} {name}"),
            created: "2024-01-01T00:00:00+00:00".into(),
            ..Default::default()
        })
        .collect()
}

/// A snapshot image (no name, as Hetzner reports snapshots).
pub fn snapshot(
    id: i64,
    architecture: models::Architecture,
    labels: &[(&str, &str)],
    created: &str,
) -> models::Image {
    models::Image {
        id,
        name: None,
        description: format!("snapshot {id}"),
        architecture,
        os_flavor: models::image::OsFlavor::Ubuntu,
        os_version: None,
        r#type: models::image::Type::Snapshot,
        status: models::image::Status::Available,
        disk_size: 20.0,
        image_size: Some(2.5),
        created: created.into(),
        labels: labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        ..Default::default()
    }
}

pub(crate) fn fixture_snapshots() -> Vec<models::Image> {
    let node_131 = [("k8s-version", "1.31"), ("role", "node")];
    vec![
        snapshot(
            3001,
            models::Architecture::X86,
            &node_131,
            "2024-05-01T10:00:00+00:00",
        ),
        snapshot(
            3002,
            models::Architecture::X86,
            &node_131,
            "2024-06-01T10:00:00+00:00",
        ),
        snapshot(
            3003,
            models::Architecture::X86,
            &[("k8s-version", "1.30"), ("role", "node")],
            "2024-04-01T10:00:00+00:00",
        ),
    ]
}

pub(crate) fn applied_to_server(id: i64) -> models::FirewallResourceId {
    models::FirewallResourceId {
        r#type: models::firewall_resource_id::Type::Server,
        server: Some(Box::new(models::ResourceId { id })),
        ..Default::default()
    }
}

/// What a valid create request attaches the new server to.
pub(crate) struct Attached {
    pub ipv4: bool,
    pub ipv6: bool,
    pub firewalls: Vec<i64>,
    pub placement_group: Option<i64>,
}

type Refusal = (StatusCode, &'static str, String);

fn invalid(message: String) -> Refusal {
    (StatusCode::UNPROCESSABLE_ENTITY, "invalid_input", message)
}

/// The checks a create makes against the referenced resources, as the API does them.
pub(crate) fn check_create(
    w: &World,
    request: &models::CreateServerRequest,
) -> Result<Attached, Refusal> {
    let public = request.public_net.as_deref();
    let ipv4 = public.and_then(|p| p.enable_ipv4).unwrap_or(true);
    let ipv6 = public.and_then(|p| p.enable_ipv6).unwrap_or(true);
    let networks = request.networks.as_deref().unwrap_or_default();
    if !ipv4 && !ipv6 && networks.is_empty() {
        return Err(invalid(
            "a server without public IPv4 and IPv6 must be attached to a network".into(),
        ));
    }
    let mut firewalls = Vec::new();
    for f in request.firewalls.as_deref().unwrap_or_default() {
        if !w.firewalls.iter().any(|k| k.id == f.firewall) {
            return Err(invalid(format!("firewall {} not found", f.firewall)));
        }
        firewalls.push(f.firewall);
    }
    for key in request.ssh_keys.as_deref().unwrap_or_default() {
        if !w
            .ssh_keys
            .iter()
            .any(|k| k.id.to_string() == *key || k.name == *key)
        {
            return Err(invalid(format!("ssh key {key} not found")));
        }
    }
    if let Some(group) = request.placement_group {
        let Some(stored) = w.placement_groups.get(&group) else {
            return Err(invalid(format!("placement group {group} not found")));
        };
        if stored.servers.len() >= w.placement_limit {
            return Err((
                StatusCode::UNPROCESSABLE_ENTITY,
                GROUP_FULL,
                format!(
                    "placement group {group} already holds the maximum of {} servers",
                    w.placement_limit
                ),
            ));
        }
    }
    Ok(Attached {
        ipv4,
        ipv6,
        firewalls,
        placement_group: request.placement_group,
    })
}

/// Takes a server out of every group, network and firewall it was part of.
pub(crate) fn detach_server(w: &mut World, id: i64) {
    for group in w.placement_groups.values_mut() {
        group.servers.retain(|s| *s != id);
    }
    for network in &mut w.networks {
        network.servers.retain(|s| *s != id);
    }
    for firewall in &mut w.firewalls {
        firewall
            .applied_to
            .retain(|a| a.server.as_ref().is_none_or(|s| s.id != id));
    }
}

fn parse_selector(
    world: &Shared,
    q: &HashMap<String, String>,
) -> Result<Option<LabelSelector>, Response> {
    q.get("label_selector")
        .map(|s| LabelSelector::parse(s))
        .transpose()
        .map_err(|e| {
            record_status(world, StatusCode::BAD_REQUEST);
            error(
                StatusCode::BAD_REQUEST,
                "invalid_input",
                &format!("invalid label_selector: {e}"),
            )
        })
}

fn not_found(world: &Shared, what: &str) -> Response {
    record_status(world, StatusCode::NOT_FOUND);
    error(
        StatusCode::NOT_FOUND,
        "not_found",
        &format!("{what} not found"),
    )
}

async fn list_firewalls(
    State(world): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    if let Err(r) = gate(&world, &headers, "GET", "/firewalls", &query_string(&q)) {
        return r;
    }
    let selector = match parse_selector(&world, &q) {
        Ok(s) => s,
        Err(r) => return r,
    };
    let w = lock(&world);
    let firewalls: Vec<models::Firewall> = w
        .firewalls
        .iter()
        .filter(|f| q.get("name").is_none_or(|n| *n == f.name))
        .filter(|f| {
            selector
                .as_ref()
                .is_none_or(|s| s.matches(&f.labels.clone().unwrap_or_default()))
        })
        .cloned()
        .collect();
    let max = w.max_per_page;
    drop(w);
    match paginate(&firewalls, &q, max) {
        Ok((firewalls, meta)) => Json(models::ListFirewallsResponse {
            firewalls,
            meta: Box::new(meta),
        })
        .into_response(),
        Err(r) => r,
    }
}

async fn get_firewall(
    State(world): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<i64>,
) -> Response {
    if let Err(r) = gate(&world, &headers, "GET", &format!("/firewalls/{id}"), "") {
        return r;
    }
    let found = lock(&world).firewalls.iter().find(|f| f.id == id).cloned();
    match found {
        Some(firewall) => Json(models::GetFirewallResponse {
            firewall: Box::new(firewall),
        })
        .into_response(),
        None => not_found(&world, "firewall"),
    }
}

async fn list_ssh_keys(
    State(world): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    if let Err(r) = gate(&world, &headers, "GET", "/ssh_keys", &query_string(&q)) {
        return r;
    }
    let selector = match parse_selector(&world, &q) {
        Ok(s) => s,
        Err(r) => return r,
    };
    let w = lock(&world);
    let keys: Vec<models::SshKey> = w
        .ssh_keys
        .iter()
        .filter(|k| q.get("name").is_none_or(|n| *n == k.name))
        .filter(|k| q.get("fingerprint").is_none_or(|f| *f == k.fingerprint))
        .filter(|k| selector.as_ref().is_none_or(|s| s.matches(&k.labels)))
        .cloned()
        .collect();
    let max = w.max_per_page;
    drop(w);
    match paginate(&keys, &q, max) {
        Ok((ssh_keys, meta)) => Json(models::ListSshKeysResponse {
            ssh_keys,
            meta: Box::new(meta),
        })
        .into_response(),
        Err(r) => r,
    }
}

async fn get_ssh_key(
    State(world): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<i64>,
) -> Response {
    if let Err(r) = gate(&world, &headers, "GET", &format!("/ssh_keys/{id}"), "") {
        return r;
    }
    let found = lock(&world).ssh_keys.iter().find(|k| k.id == id).cloned();
    match found {
        Some(key) => Json(models::GetSshKeyResponse {
            ssh_key: Box::new(key),
        })
        .into_response(),
        None => not_found(&world, "ssh key"),
    }
}

async fn list_placement_groups(
    State(world): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    if let Err(r) = gate(
        &world,
        &headers,
        "GET",
        "/placement_groups",
        &query_string(&q),
    ) {
        return r;
    }
    let selector = match parse_selector(&world, &q) {
        Ok(s) => s,
        Err(r) => return r,
    };
    let w = lock(&world);
    let groups: Vec<models::PlacementGroup> = w
        .placement_groups
        .values()
        .filter(|g| q.get("name").is_none_or(|n| *n == g.name))
        .filter(|_| q.get("type").is_none_or(|t| t == "spread"))
        .filter(|g| selector.as_ref().is_none_or(|s| s.matches(&g.labels)))
        .cloned()
        .collect();
    let max = w.max_per_page;
    drop(w);
    match paginate(&groups, &q, max) {
        Ok((placement_groups, meta)) => Json(models::ListPlacementGroupsResponse {
            placement_groups,
            meta: Box::new(meta),
        })
        .into_response(),
        Err(r) => r,
    }
}

async fn get_placement_group(
    State(world): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<i64>,
) -> Response {
    if let Err(r) = gate(
        &world,
        &headers,
        "GET",
        &format!("/placement_groups/{id}"),
        "",
    ) {
        return r;
    }
    let found = lock(&world).placement_groups.get(&id).cloned();
    match found {
        Some(group) => Json(models::GetPlacementgroupResponse {
            placement_group: Box::new(group),
        })
        .into_response(),
        None => not_found(&world, "placement group"),
    }
}

async fn create_placement_group(
    State(world): State<Shared>,
    headers: HeaderMap,
    body: String,
) -> Response {
    if let Err(r) = gate(&world, &headers, "POST", "/placement_groups", "") {
        return r;
    }
    let reject = |status: StatusCode, code: &str, message: &str| {
        record_status(&world, status);
        error(status, code, message)
    };
    let request: models::CreatePlacementgroupRequest = match serde_json::from_str(&body) {
        Ok(r) => r,
        Err(e) => return reject(StatusCode::BAD_REQUEST, "json_error", &e.to_string()),
    };
    if let Some(labels) = &request.labels
        && let Err(r) = check_labels(labels)
    {
        record_status(&world, r.status());
        return r;
    }
    if request.name.trim().is_empty() {
        return reject(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_input",
            "name must not be empty",
        );
    }
    let mut w = lock(&world);
    if w.placement_groups.values().any(|g| g.name == request.name) {
        drop(w);
        return reject(
            StatusCode::CONFLICT,
            "uniqueness_error",
            "placement group name is already used",
        );
    }
    let id = w.next_id();
    let group = models::PlacementGroup {
        id,
        name: request.name,
        labels: request.labels.unwrap_or_default(),
        servers: Vec::new(),
        r#type: models::placement_group::Type::Spread,
        created: now_rfc3339(),
    };
    w.placement_groups.insert(id, group.clone());
    drop(w);
    record_status(&world, StatusCode::CREATED);
    (
        StatusCode::CREATED,
        Json(models::CreatePlacementgroupResponse {
            action: Some(None),
            placement_group: Box::new(group),
        }),
    )
        .into_response()
}

async fn delete_placement_group(
    State(world): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<i64>,
) -> Response {
    if let Err(r) = gate(
        &world,
        &headers,
        "DELETE",
        &format!("/placement_groups/{id}"),
        "",
    ) {
        return r;
    }
    let mut w = lock(&world);
    let Some(group) = w.placement_groups.get(&id) else {
        drop(w);
        return not_found(&world, "placement group");
    };
    if !group.servers.is_empty() {
        drop(w);
        record_status(&world, StatusCode::UNPROCESSABLE_ENTITY);
        return error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_input",
            "placement group still has servers",
        );
    }
    w.placement_groups.remove(&id);
    drop(w);
    record_status(&world, StatusCode::NO_CONTENT);
    StatusCode::NO_CONTENT.into_response()
}

/// The first four octets of an IPv4 CIDR and its prefix length.
fn cidr(range: &str) -> Option<([u8; 4], u8)> {
    let (ip, bits) = range.split_once('/')?;
    let ip: std::net::Ipv4Addr = ip.parse().ok()?;
    Some((ip.octets(), bits.parse().ok()?))
}

async fn attach_to_network(
    State(world): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<i64>,
    body: String,
) -> Response {
    let path = format!("/servers/{id}/actions/attach_to_network");
    if let Err(r) = gate(&world, &headers, "POST", &path, "") {
        return r;
    }
    let reject = |status: StatusCode, code: &str, message: &str| {
        record_status(&world, status);
        error(status, code, message)
    };
    let request: models::AttachServerToNetworkRequest = match serde_json::from_str(&body) {
        Ok(r) => r,
        Err(e) => return reject(StatusCode::BAD_REQUEST, "json_error", &e.to_string()),
    };
    let mut w = lock(&world);
    let private_ip = w.new_server_private_ip.clone();
    let Some(network) = w.networks.iter().find(|n| n.id == request.network).cloned() else {
        drop(w);
        return reject(
            StatusCode::NOT_FOUND,
            "not_found",
            &format!("network {} not found", request.network),
        );
    };
    let subnet = match &request.ip_range {
        None => network.subnets.first().cloned(),
        Some(range) => network
            .subnets
            .iter()
            .find(|s| s.ip_range.as_deref() == Some(range.as_str()))
            .cloned(),
    };
    let Some(subnet) = subnet else {
        drop(w);
        return reject(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_input",
            "ip_range is not a subnet of the network",
        );
    };
    let Some(stored) = w.servers.get_mut(&id) else {
        drop(w);
        return reject(StatusCode::NOT_FOUND, "not_found", "server not found");
    };
    if stored
        .server
        .private_net
        .iter()
        .any(|p| p.network == Some(request.network))
    {
        drop(w);
        return reject(
            StatusCode::UNPROCESSABLE_ENTITY,
            "server_already_attached",
            "server is already attached to this network",
        );
    }
    let ip = request.ip.clone().or(private_ip).unwrap_or_else(|| {
        let ([a, b, c, _], _) =
            cidr(subnet.ip_range.as_deref().unwrap_or_default()).unwrap_or(([10, 0, 0, 0], 24));
        format!("{a}.{b}.{c}.{}", id % 250 + 2)
    });
    stored.server.private_net.push(models::ServerPrivateNet {
        network: Some(request.network),
        ip: Some(ip),
        alias_ips: Some(request.alias_ips.clone().unwrap_or_default()),
        mac_address: Some("86:00:00:00:00:02".into()),
    });
    if let Some(n) = w.networks.iter_mut().find(|n| n.id == request.network) {
        n.servers.push(id);
    }
    let mut action = w.action("attach_to_network", id);
    action.status = models::action::Status::Success;
    action.progress = 100;
    drop(w);
    record_status(&world, StatusCode::CREATED);
    (
        StatusCode::CREATED,
        Json(models::AttachServerToNetworkResponse {
            action: Box::new(action),
        }),
    )
        .into_response()
}

pub(crate) fn routes() -> Router<Shared> {
    Router::new()
        .route("/v1/firewalls", get(list_firewalls))
        .route("/v1/firewalls/{id}", get(get_firewall))
        .route("/v1/ssh_keys", get(list_ssh_keys))
        .route("/v1/ssh_keys/{id}", get(get_ssh_key))
        .route(
            "/v1/placement_groups",
            get(list_placement_groups).post(create_placement_group),
        )
        .route(
            "/v1/placement_groups/{id}",
            get(get_placement_group).delete(delete_placement_group),
        )
        .route(
            "/v1/servers/{id}/actions/attach_to_network",
            post(attach_to_network),
        )
}

impl Emulator {
    /// Spread placement groups hold at most this many servers (default 10, as on Hetzner).
    pub fn set_placement_group_limit(&self, limit: usize) {
        lock(&self.world).placement_limit = limit.max(1);
    }

    /// The IPv6 network (`<prefix>::/64`) of servers created from now on; `::/64` makes the
    /// server's address `::1`, the loopback.
    pub fn set_new_server_ipv6_net(&self, net: &str) {
        lock(&self.world).new_server_ipv6_net = Some(net.to_owned());
    }

    /// The JSON body of every server create request, in order, exactly as received.
    pub fn create_bodies(&self) -> Vec<serde_json::Value> {
        lock(&self.world).create_bodies.clone()
    }

    /// Every placement group.
    pub fn placement_groups(&self) -> Vec<models::PlacementGroup> {
        lock(&self.world)
            .placement_groups
            .values()
            .cloned()
            .collect()
    }

    /// Adds a placement group behind the provider's back (another owner's); returns its id.
    pub fn insert_placement_group(&self, name: &str, labels: HashMap<String, String>) -> i64 {
        let mut w = lock(&self.world);
        let id = w.next_id();
        w.placement_groups.insert(
            id,
            models::PlacementGroup {
                id,
                name: name.into(),
                labels,
                servers: Vec::new(),
                r#type: models::placement_group::Type::Spread,
                created: now_rfc3339(),
            },
        );
        id
    }

    /// Adds an image (e.g. [`snapshot`]).
    pub fn insert_image(&self, image: models::Image) {
        lock(&self.world).images.push(image);
    }

    /// Withdraws a server type from a location (it is no longer orderable there).
    pub fn withdraw_server_type(&self, server_type: &str, location: &str) {
        let mut w = lock(&self.world);
        if let Some(t) = w.server_types.iter_mut().find(|t| t.name == server_type) {
            t.locations.retain(|l| l.name != location);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidrs() {
        assert_eq!(cidr("10.0.1.0/24"), Some(([10, 0, 1, 0], 24)));
        assert_eq!(cidr("10.0.1.0"), None);
        assert_eq!(cidr("x/24"), None);
    }
}

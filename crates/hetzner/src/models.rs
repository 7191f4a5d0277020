//! The Hetzner Cloud answers this provider reads, as our own lenient types, and the request
//! bodies it sends (those of the `hcloud` crate, which serialize as the API takes them).
//!
//! Why not the `hcloud` crate's answer types: they were generated from an unofficial copy of
//! the API document and make every nullable field a required key and every enum closed, so an
//! answer fails to decode the day Hetzner drops a key its own document marks deprecated (as it
//! dropped `datacenter` from servers, and as `server_types[].deprecated` will go), sends `null`
//! where a value was, or adds an enum value. Here every field but an id may be missing or
//! `null` (it then takes its default), unknown keys are ignored, and every enum has an
//! `Unknown` value for the values it does not name. The fields are those of Hetzner's official
//! `cloud.spec.json` that the provider reads, nothing more.

use std::collections::HashMap;

use serde::{Deserialize, Deserializer};

pub use hcloud::models::{
    AttachServerToNetworkRequest, CreatePlacementgroupRequest, CreateServerRequest,
    CreateServerRequestFirewalls, CreateServerRequestPublicNet, ReplaceServerRequest,
    create_placementgroup_request,
};

/// A field that may be missing or `null`: both read as the type's default.
fn nullable<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

/// CPU architecture of a server type or image.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    #[default]
    X86,
    Arm,
    /// An architecture this provider does not know.
    #[serde(other)]
    Unknown,
}

/// `meta.pagination` of a listing.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct Pagination {
    pub page: Option<i64>,
    pub next_page: Option<i64>,
    pub last_page: Option<i64>,
    pub total_entries: Option<i64>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct Meta {
    #[serde(deserialize_with = "nullable")]
    pub pagination: Pagination,
}

/// A net and gross price, decimal strings in EUR.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct Price {
    #[serde(deserialize_with = "nullable")]
    pub net: String,
    #[serde(deserialize_with = "nullable")]
    pub gross: String,
}

/// `server_types[].prices[]`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct PricePerTime {
    #[serde(deserialize_with = "nullable")]
    pub location: String,
    #[serde(deserialize_with = "nullable")]
    pub price_hourly: Price,
    #[serde(deserialize_with = "nullable")]
    pub price_monthly: Price,
}

/// A deprecation: `announced` and `unavailable_after`, RFC 3339.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct DeprecationInfo {
    #[serde(deserialize_with = "nullable")]
    pub announced: String,
    #[serde(deserialize_with = "nullable")]
    pub unavailable_after: String,
}

/// `server_types[].locations[]`: where the type is sold and how it stands there.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct ServerTypeLocation {
    pub id: i64,
    #[serde(deserialize_with = "nullable")]
    pub name: String,
    pub deprecation: Option<DeprecationInfo>,
    /// `false` while the type is temporarily unavailable there; missing in older answers
    /// (read as available).
    pub available: Option<bool>,
    pub recommended: Option<bool>,
}

/// A server type.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct ServerType {
    pub id: i64,
    #[serde(deserialize_with = "nullable")]
    pub name: String,
    #[serde(deserialize_with = "nullable")]
    pub description: String,
    #[serde(deserialize_with = "nullable")]
    pub cores: f64,
    /// GB.
    #[serde(deserialize_with = "nullable")]
    pub memory: f64,
    /// GB.
    #[serde(deserialize_with = "nullable")]
    pub disk: f64,
    #[serde(deserialize_with = "nullable")]
    pub architecture: Architecture,
    /// `shared` or `dedicated`.
    #[serde(deserialize_with = "nullable")]
    pub cpu_type: String,
    #[serde(deserialize_with = "nullable")]
    pub prices: Vec<PricePerTime>,
    #[serde(deserialize_with = "nullable")]
    pub locations: Vec<ServerTypeLocation>,
    /// Deprecated by Hetzner in favour of `locations[].deprecation`; read only when a location
    /// entry says nothing.
    pub deprecation: Option<DeprecationInfo>,
}

/// A location.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct Location {
    pub id: i64,
    #[serde(deserialize_with = "nullable")]
    pub name: String,
    #[serde(deserialize_with = "nullable")]
    pub description: String,
    #[serde(deserialize_with = "nullable")]
    pub country: String,
    #[serde(deserialize_with = "nullable")]
    pub city: String,
    #[serde(deserialize_with = "nullable")]
    pub network_zone: String,
}

pub mod server {
    use serde::Deserialize;

    /// A server's status.
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
    #[serde(rename_all = "lowercase")]
    pub enum Status {
        Running,
        Initializing,
        Starting,
        Stopping,
        Off,
        Deleting,
        Migrating,
        Rebuilding,
        /// `unknown`, or a status this provider does not know.
        #[default]
        #[serde(other)]
        Unknown,
    }
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct Ipv4 {
    #[serde(deserialize_with = "nullable")]
    pub ip: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct Ipv6 {
    /// The server's /64, e.g. `2001:db8::/64`.
    #[serde(deserialize_with = "nullable")]
    pub ip: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct ServerPublicNet {
    pub ipv4: Option<Ipv4>,
    pub ipv6: Option<Ipv6>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct ServerPrivateNet {
    pub network: Option<i64>,
    pub ip: Option<String>,
}

/// A server.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct Server {
    pub id: i64,
    #[serde(deserialize_with = "nullable")]
    pub name: String,
    #[serde(deserialize_with = "nullable")]
    pub status: server::Status,
    #[serde(deserialize_with = "nullable")]
    pub created: String,
    #[serde(deserialize_with = "nullable")]
    pub labels: HashMap<String, String>,
    #[serde(deserialize_with = "nullable")]
    pub location: Location,
    #[serde(deserialize_with = "nullable")]
    pub server_type: ServerType,
    #[serde(deserialize_with = "nullable")]
    pub public_net: ServerPublicNet,
    #[serde(deserialize_with = "nullable")]
    pub private_net: Vec<ServerPrivateNet>,
    pub placement_group: Option<PlacementGroup>,
}

pub mod image {
    use serde::Deserialize;

    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
    #[serde(rename_all = "lowercase")]
    pub enum Type {
        #[default]
        System,
        App,
        Snapshot,
        Backup,
        /// A kind of image this provider does not know.
        #[serde(other)]
        Unknown,
    }

    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
    #[serde(rename_all = "lowercase")]
    pub enum Status {
        Available,
        Creating,
        /// A status this provider does not know.
        #[default]
        #[serde(other)]
        Unknown,
    }
}

/// An image or snapshot.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct Image {
    pub id: i64,
    pub name: Option<String>,
    #[serde(deserialize_with = "nullable")]
    pub description: String,
    #[serde(deserialize_with = "nullable")]
    pub architecture: Architecture,
    #[serde(deserialize_with = "nullable")]
    pub r#type: image::Type,
    #[serde(deserialize_with = "nullable")]
    pub status: image::Status,
    #[serde(deserialize_with = "nullable")]
    pub created: String,
    #[serde(deserialize_with = "nullable")]
    pub labels: HashMap<String, String>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct Subnet {
    pub ip_range: Option<String>,
    #[serde(deserialize_with = "nullable")]
    pub network_zone: String,
}

/// A private network.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct Network {
    pub id: i64,
    #[serde(deserialize_with = "nullable")]
    pub name: String,
    #[serde(deserialize_with = "nullable")]
    pub subnets: Vec<Subnet>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct Firewall {
    pub id: i64,
    #[serde(deserialize_with = "nullable")]
    pub name: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct SshKey {
    pub id: i64,
    #[serde(deserialize_with = "nullable")]
    pub name: String,
}

/// A placement group.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct PlacementGroup {
    pub id: i64,
    #[serde(deserialize_with = "nullable")]
    pub name: String,
    #[serde(deserialize_with = "nullable")]
    pub labels: HashMap<String, String>,
    #[serde(deserialize_with = "nullable")]
    pub servers: Vec<i64>,
}

/// An error answer: `{"error": {"code", "message", "details"}}`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct ErrorResponse {
    pub error: ErrorBody,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct ErrorBody {
    #[serde(deserialize_with = "nullable")]
    pub code: String,
    #[serde(deserialize_with = "nullable")]
    pub message: String,
}

macro_rules! listing {
    ($name:ident, $field:ident, $item:ty) => {
        #[derive(Clone, Debug, Default, PartialEq, Deserialize)]
        #[serde(default)]
        pub struct $name {
            #[serde(deserialize_with = "nullable")]
            pub $field: Vec<$item>,
            #[serde(deserialize_with = "nullable")]
            pub meta: Meta,
        }
    };
}

macro_rules! single {
    ($name:ident, $field:ident, $item:ty) => {
        #[derive(Clone, Debug, Default, PartialEq, Deserialize)]
        #[serde(default)]
        pub struct $name {
            pub $field: Option<$item>,
        }
    };
}

listing!(ListServersResponse, servers, Server);
listing!(ListServerTypesResponse, server_types, ServerType);
listing!(ListImagesResponse, images, Image);
listing!(ListNetworksResponse, networks, Network);
listing!(ListFirewallsResponse, firewalls, Firewall);
listing!(ListSshKeysResponse, ssh_keys, SshKey);
listing!(
    ListPlacementGroupsResponse,
    placement_groups,
    PlacementGroup
);
listing!(ListLocationsResponse, locations, Location);
single!(GetServerResponse, server, Server);
single!(CreateServerResponse, server, Server);
single!(ReplaceServerResponse, server, Server);
single!(GetImageResponse, image, Image);
single!(GetNetworkResponse, network, Network);
single!(GetFirewallResponse, firewall, Firewall);
single!(GetSshKeyResponse, ssh_key, SshKey);
single!(
    CreatePlacementgroupResponse,
    placement_group,
    PlacementGroup
);

#[cfg(test)]
mod tests {
    use super::*;

    /// A server as Hetzner's document shapes it today, with every key the document marks
    /// deprecated removed (`datacenter`, `server_type.deprecated`, `server_type.deprecation`,
    /// `image.deprecated`), nullable keys `null`, and enum values no version of this provider
    /// has seen.
    const SERVER: &str = r#"{
      "id": 42, "name": "bigfleet-x", "status": "hibernating",
      "created": "2026-07-01T12:00:00Z",
      "public_net": {"ipv4": {"id": 1, "ip": "198.51.100.7", "blocked": false, "dns_ptr": "x"},
                     "ipv6": null, "floating_ips": [], "firewalls": [{"id": 3, "status": "pending-review"}]},
      "private_net": [{"network": 9, "ip": "10.0.0.2", "alias_ips": [], "mac_address": "m"}],
      "server_type": {
        "id": 114, "name": "cx23", "description": "CX23", "cores": 2, "memory": 4, "disk": 40,
        "prices": [{"location": "nbg1",
                    "price_hourly": {"net": "0.0060", "gross": "0.0071"},
                    "price_monthly": {"net": "3.49", "gross": "4.15"},
                    "included_traffic": 21990232555520,
                    "price_per_tb_traffic": {"net": "1.00", "gross": "1.19"}}],
        "storage_type": "quantum", "cpu_type": "shared", "category": "Cost-Optimized",
        "architecture": "riscv",
        "locations": [{"id": 2, "name": "nbg1", "deprecation": null, "recommended": true,
                       "available": false}]
      },
      "location": {"id": 2, "name": "nbg1", "description": "Nuremberg DC Park 1", "country": "DE",
                   "city": "Nuremberg", "latitude": 49.45, "longitude": 11.07,
                   "network_zone": "eu-central-2"},
      "image": {"id": 7, "type": "container", "status": "gone", "name": null, "description": "x",
                "image_size": null, "disk_size": 5, "created": "2026-07-01T12:00:00Z",
                "created_from": null, "bound_to": null, "os_flavor": "plan9", "os_version": null,
                "protection": {"delete": false}, "deleted": null, "labels": {},
                "architecture": "x86"},
      "iso": null, "rescue_enabled": false, "locked": false, "backup_window": null,
      "outgoing_traffic": null, "ingoing_traffic": null, "included_traffic": null,
      "protection": {"delete": false, "rebuild": false},
      "labels": null, "volumes": [], "load_balancers": [], "primary_disk_size": 40,
      "placement_group": null
    }"#;

    #[test]
    fn answers_without_deprecated_keys_with_nulls_and_new_enum_values_decode() {
        let server: Server = serde_json::from_str(SERVER).expect("decodes");
        assert_eq!(server.id, 42);
        assert_eq!(server.status, server::Status::Unknown);
        assert!(server.labels.is_empty(), "labels: null reads as none");
        assert_eq!(server.location.name, "nbg1");
        assert_eq!(
            server.public_net.ipv4.map(|v4| v4.ip),
            Some("198.51.100.7".into())
        );
        assert!(server.public_net.ipv6.is_none());
        assert_eq!(server.private_net[0].network, Some(9));
        assert_eq!(server.server_type.architecture, Architecture::Unknown);
        assert_eq!(server.server_type.locations[0].available, Some(false));
        assert!(server.placement_group.is_none());
        let listing: ListServersResponse =
            serde_json::from_str(&format!(r#"{{"servers": [{SERVER}], "meta": null}}"#))
                .expect("decodes");
        assert_eq!(listing.servers.len(), 1);
        assert_eq!(listing.meta.pagination.next_page, None);
        let image: GetImageResponse =
            serde_json::from_str(r#"{"image": {"id": 1, "type": "container", "status": "gone"}}"#)
                .expect("decodes");
        let image = image.image.expect("image");
        assert_eq!(image.r#type, image::Type::Unknown);
        assert_eq!(image.status, image::Status::Unknown);
    }

    #[test]
    fn the_older_shapes_decode_too() {
        // `deprecated` and the type-level `deprecation` as older answers carried them, no
        // per-location `available`, a `datacenter` on the server.
        let kind: ServerType = serde_json::from_str(
            r#"{"id": 1, "name": "cx22", "cores": 2, "memory": 4.0, "disk": 40,
                "deprecated": true, "architecture": "x86",
                "deprecation": {"announced": "2025-10-16T09:00:00Z",
                                "unavailable_after": "2025-12-31T23:59:59Z"},
                "prices": [], "locations": [{"id": 1, "name": "fsn1", "deprecation": null}]}"#,
        )
        .expect("decodes");
        assert_eq!(kind.locations[0].available, None);
        assert!(kind.deprecation.is_some());
        let server: Server = serde_json::from_str(
            r#"{"id": 1, "status": "running", "datacenter": {"id": 4, "name": "fsn1-dc14"}}"#,
        )
        .expect("decodes");
        assert_eq!(server.status, server::Status::Running);
    }

    /// The emulator's answers (which its spec test holds to Hetzner's document) with every
    /// property the document marks `deprecated: true` removed decode, with the same values.
    #[tokio::test]
    async fn spec_shaped_answers_without_what_the_document_deprecates_decode() {
        const TOKEN: &str = "models-test";
        let doc = spec_shape::hetzner_cloud();
        let emulator = hcloud_emulator::Emulator::start(TOKEN)
            .await
            .expect("emulator");
        emulator.set_deprecation(
            "cx23",
            "fsn1",
            Some(("2026-06-01T09:00:00Z", "2026-12-31T23:59:59Z")),
        );
        let http = spec_shape::exercise::loopback_client();
        let url = |path: &str| format!("{}{path}", emulator.endpoint());
        let created: serde_json::Value = http
            .post(url("/servers"))
            .bearer_auth(TOKEN)
            .json(&serde_json::json!({"name": "m-1", "server_type": "cx23",
                                      "image": "ubuntu-24.04", "location": "nbg1"}))
            .send()
            .await
            .expect("create")
            .json()
            .await
            .expect("json");
        let id = created["server"]["id"].as_i64().expect("id");
        let one = format!("/servers/{id}");
        let mut removed = 0;
        for (template, path) in [
            ("/server_types", "/server_types"),
            ("/locations", "/locations"),
            ("/servers", "/servers"),
            ("/servers/{id}", one.as_str()),
            ("/images", "/images"),
            ("/networks", "/networks"),
            ("/firewalls", "/firewalls"),
            ("/ssh_keys", "/ssh_keys"),
            ("/placement_groups", "/placement_groups"),
        ] {
            let (answer, stripped) = spec_shape::get_without_deprecated(
                &doc,
                &emulator.endpoint(),
                TOKEN,
                template,
                path,
            )
            .await;
            removed += usize::from(stripped != answer);
            let text = stripped.to_string();
            let decoded = match template {
                "/server_types" => {
                    serde_json::from_str::<ListServerTypesResponse>(&text).map(|r| {
                        (
                            r.server_types.len(),
                            r.server_types[0].deprecation.is_none(),
                        )
                    })
                }
                "/locations" => serde_json::from_str::<ListLocationsResponse>(&text)
                    .map(|r| (r.locations.len(), true)),
                "/servers" => serde_json::from_str::<ListServersResponse>(&text)
                    .map(|r| (r.servers.len(), r.servers[0].id == id)),
                "/servers/{id}" => serde_json::from_str::<GetServerResponse>(&text)
                    .map(|r| (1, r.server.is_some_and(|s| s.server_type.name == "cx23"))),
                "/images" => serde_json::from_str::<ListImagesResponse>(&text)
                    .map(|r| (r.images.len(), true)),
                "/networks" => serde_json::from_str::<ListNetworksResponse>(&text)
                    .map(|r| (r.networks.len(), true)),
                "/firewalls" => serde_json::from_str::<ListFirewallsResponse>(&text)
                    .map(|r| (r.firewalls.len(), true)),
                "/ssh_keys" => serde_json::from_str::<ListSshKeysResponse>(&text)
                    .map(|r| (r.ssh_keys.len(), true)),
                _ => serde_json::from_str::<ListPlacementGroupsResponse>(&text)
                    .map(|r| (r.placement_groups.len(), true)),
            };
            let (count, right) = decoded.unwrap_or_else(|e| panic!("{path}: {e}"));
            let listed = answer
                .as_object()
                .and_then(|o| o.values().find_map(serde_json::Value::as_array))
                .map_or(1, Vec::len);
            assert_eq!(count, listed, "{path}");
            assert!(right, "{path}: {text}");
        }
        // The type-level `deprecation` of server types (and of a server's type) went.
        assert!(removed >= 3, "only {removed} answers had deprecated keys");
    }
}

//! The emulator's answers held to Hetzner's official API document (`cloud.spec.json`, the
//! Hetzner Cloud API as published 2026-07) for every operation the provider's client calls on
//! servers, server types and locations, and for the error answers it relies on: each object has
//! every key the document requires, of the document's type, `null` only where the document
//! allows it, enum values among the document's, RFC 3339 timestamps, and no key the document
//! dropped (`datacenter`). The shapes below are the document's `required` lists and property
//! types for those schemas; nothing else of it is kept.

use serde_json::{Value, json};
use spec_shape::{Field, Kind, absent, check, opt, req, req_null};

use crate::TOKEN;
use hcloud_emulator::Emulator;

/// `Server` (GET /servers, GET/PUT /servers/{id}, POST /servers).
const SERVER: &[Field] = &[
    req("id", Kind::Int),
    req("name", Kind::Str),
    req(
        "status",
        Kind::OneOf(&[
            "running",
            "initializing",
            "starting",
            "stopping",
            "off",
            "deleting",
            "migrating",
            "rebuilding",
            "unknown",
        ]),
    ),
    req("created", Kind::Time),
    req("public_net", Kind::Obj),
    req("private_net", Kind::Arr),
    req("server_type", Kind::Obj),
    req("location", Kind::Obj),
    req_null("image", Kind::Obj),
    req_null("iso", Kind::Obj),
    req("rescue_enabled", Kind::Bool),
    req("locked", Kind::Bool),
    req_null("backup_window", Kind::Str),
    req_null("outgoing_traffic", Kind::Int),
    req_null("ingoing_traffic", Kind::Int),
    req_null("included_traffic", Kind::Int),
    req("protection", Kind::Obj),
    req("labels", Kind::Obj),
    req("primary_disk_size", Kind::Num),
    opt("volumes", Kind::Arr),
    opt("load_balancers", Kind::Arr),
];

const PUBLIC_NET: &[Field] = &[
    req_null("ipv4", Kind::Obj),
    req_null("ipv6", Kind::Obj),
    req("floating_ips", Kind::Arr),
];

const IP: &[Field] = &[
    req("ip", Kind::Str),
    req("blocked", Kind::Bool),
    // `dns_ptr` is a string for IPv4 and a list for IPv6.
];

const PROTECTION: &[Field] = &[req("delete", Kind::Bool), req("rebuild", Kind::Bool)];

/// `Location` (in a server, and GET /locations).
const LOCATION: &[Field] = &[
    req("id", Kind::Int),
    req("name", Kind::Str),
    req("description", Kind::Str),
    req("country", Kind::Str),
    req("city", Kind::Str),
    req("latitude", Kind::Num),
    req("longitude", Kind::Num),
    req("network_zone", Kind::Str),
];

/// `ServerType` (in a server, and GET /server_types). `deprecated` is a boolean the document
/// marks deprecated; the type-level `deprecation` is deprecated in favour of the locations'.
const SERVER_TYPE: &[Field] = &[
    req("id", Kind::Int),
    req("name", Kind::Str),
    req("description", Kind::Str),
    req("cores", Kind::Num),
    req("memory", Kind::Num),
    req("disk", Kind::Num),
    req("deprecated", Kind::Bool),
    req("prices", Kind::Arr),
    req("storage_type", Kind::OneOf(&["local", "network"])),
    req("cpu_type", Kind::OneOf(&["shared", "dedicated"])),
    req("architecture", Kind::OneOf(&["x86", "arm"])),
    req("locations", Kind::Arr),
    opt("category", Kind::Str),
];

/// `server_types[].locations[]`.
const SERVER_TYPE_LOCATION: &[Field] = &[
    req("id", Kind::Int),
    req("name", Kind::Str),
    req_null("deprecation", Kind::Obj),
    req("recommended", Kind::Bool),
    req("available", Kind::Bool),
];

const DEPRECATION: &[Field] = &[
    req("announced", Kind::Time),
    req("unavailable_after", Kind::Time),
];

/// `server_types[].prices[]`.
const PRICE_PER_TIME: &[Field] = &[
    req("location", Kind::Str),
    req("price_hourly", Kind::Obj),
    req("price_monthly", Kind::Obj),
    req("included_traffic", Kind::Int),
    req("price_per_tb_traffic", Kind::Obj),
];

const PRICE: &[Field] = &[req("net", Kind::Str), req("gross", Kind::Str)];

const PAGINATION: &[Field] = &[
    req("page", Kind::Int),
    req("per_page", Kind::Int),
    req_null("previous_page", Kind::Int),
    req_null("next_page", Kind::Int),
    req_null("last_page", Kind::Int),
    req_null("total_entries", Kind::Int),
];

/// `Action` (POST /servers `action` and `next_actions[]`).
const ACTION: &[Field] = &[
    req("id", Kind::Int),
    req("command", Kind::Str),
    req("status", Kind::OneOf(&["running", "success", "error"])),
    req("progress", Kind::Num),
    req("started", Kind::Time),
    req_null("finished", Kind::Time),
    req("resources", Kind::Arr),
    req_null("error", Kind::Obj),
];

/// `Image` (GET /images, GET /images/{id}).
const IMAGE: &[Field] = &[
    req("id", Kind::Int),
    req(
        "type",
        Kind::OneOf(&["system", "app", "snapshot", "backup"]),
    ),
    req(
        "status",
        Kind::OneOf(&["available", "creating", "unavailable"]),
    ),
    req_null("name", Kind::Str),
    req("description", Kind::Str),
    req_null("image_size", Kind::Num),
    req("disk_size", Kind::Num),
    req("created", Kind::Time),
    req_null("created_from", Kind::Obj),
    req_null("bound_to", Kind::Int),
    req(
        "os_flavor",
        Kind::OneOf(&[
            "ubuntu", "centos", "debian", "fedora", "rocky", "alma", "opensuse", "unknown",
        ]),
    ),
    req_null("os_version", Kind::Str),
    req("protection", Kind::Obj),
    req_null("deprecated", Kind::Time),
    req_null("deleted", Kind::Time),
    req("labels", Kind::Obj),
    req("architecture", Kind::OneOf(&["x86", "arm"])),
];

/// `Network` (GET /networks, GET /networks/{id}) and its `subnets[]`.
const NETWORK: &[Field] = &[
    req("id", Kind::Int),
    req("name", Kind::Str),
    req("ip_range", Kind::Str),
    req("subnets", Kind::Arr),
    req("routes", Kind::Arr),
    req("servers", Kind::Arr),
    req("protection", Kind::Obj),
    req("labels", Kind::Obj),
    req("created", Kind::Time),
    req("expose_routes_to_vswitch", Kind::Bool),
];

const SUBNET: &[Field] = &[
    req("type", Kind::OneOf(&["cloud", "server", "vswitch"])),
    req("network_zone", Kind::Str),
    req("gateway", Kind::Str),
];

/// `Firewall` (GET /firewalls).
const FIREWALL: &[Field] = &[
    req("id", Kind::Int),
    req("name", Kind::Str),
    req("created", Kind::Time),
    req("rules", Kind::Arr),
    req("applied_to", Kind::Arr),
];

/// `SSHKey` (GET /ssh_keys).
const SSH_KEY: &[Field] = &[
    req("id", Kind::Int),
    req("name", Kind::Str),
    req("fingerprint", Kind::Str),
    req("public_key", Kind::Str),
    req("labels", Kind::Obj),
    req("created", Kind::Time),
];

/// `PlacementGroup` (GET and POST /placement_groups).
const PLACEMENT_GROUP: &[Field] = &[
    req("id", Kind::Int),
    req("name", Kind::Str),
    req("labels", Kind::Obj),
    req("type", Kind::OneOf(&["spread"])),
    req("created", Kind::Time),
    req("servers", Kind::Arr),
];

/// The error answer: `{"error": {"code", "message", "details"}}`.
const ERROR: &[Field] = &[
    req("code", Kind::Str),
    req("message", Kind::Str),
    req_null("details", Kind::Obj),
];

fn server_type(kind: &Value, at: &str) -> Vec<String> {
    let mut problems = check(kind, SERVER_TYPE, at);
    for (i, l) in kind["locations"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        let at = format!("{at}.locations[{i}]");
        problems.extend(check(l, SERVER_TYPE_LOCATION, &at));
        if !l["deprecation"].is_null() {
            problems.extend(check(
                &l["deprecation"],
                DEPRECATION,
                &format!("{at}.deprecation"),
            ));
        }
    }
    for (i, p) in kind["prices"].as_array().into_iter().flatten().enumerate() {
        let at = format!("{at}.prices[{i}]");
        problems.extend(check(p, PRICE_PER_TIME, &at));
        for key in ["price_hourly", "price_monthly", "price_per_tb_traffic"] {
            problems.extend(check(&p[key], PRICE, &format!("{at}.{key}")));
        }
    }
    problems
}

fn server(s: &Value, at: &str) -> Vec<String> {
    let mut problems = check(s, SERVER, at);
    problems.extend(absent(s, "datacenter", at));
    problems.extend(check(
        &s["public_net"],
        PUBLIC_NET,
        &format!("{at}.public_net"),
    ));
    for family in ["ipv4", "ipv6"] {
        let ip = &s["public_net"][family];
        if !ip.is_null() {
            problems.extend(check(ip, IP, &format!("{at}.public_net.{family}")));
        }
    }
    problems.extend(check(
        &s["protection"],
        PROTECTION,
        &format!("{at}.protection"),
    ));
    problems.extend(check(&s["location"], LOCATION, &format!("{at}.location")));
    problems.extend(server_type(&s["server_type"], &format!("{at}.server_type")));
    if let Some(created) = s["image"]["created"].as_str()
        && !spec_shape::is_rfc3339(created)
    {
        problems.push(format!("{at}.image.created: {created} is not RFC 3339"));
    }
    problems
}

fn listing(body: &Value, key: &str, at: &str) -> Vec<String> {
    let mut problems = Vec::new();
    if !body[key].is_array() {
        problems.push(format!("{at}.{key}: required array, got {}", body[key]));
    }
    problems.extend(check(
        &body["meta"]["pagination"],
        PAGINATION,
        &format!("{at}.meta.pagination"),
    ));
    problems
}

fn error(body: &Value, at: &str) -> Vec<String> {
    check(&body["error"], ERROR, &format!("{at}.error"))
}

async fn call(
    http: &reqwest::Client,
    emulator: &Emulator,
    method: reqwest::Method,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut request = http
        .request(method, format!("{}{path}", emulator.endpoint()))
        .bearer_auth(TOKEN);
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

#[tokio::test]
async fn every_answer_the_provider_reads_has_the_shape_of_the_official_document() {
    let emulator = Emulator::start(TOKEN).await.unwrap();
    emulator.set_deprecation(
        "cx23",
        "fsn1",
        Some(("2026-06-01T09:00:00Z", "2026-12-31T23:59:59Z")),
    );
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let get = reqwest::Method::GET;
    let mut problems = Vec::new();

    let (status, types) = call(&http, &emulator, get.clone(), "/server_types", None).await;
    assert_eq!(status, 200);
    problems.extend(listing(&types, "server_types", "GET /server_types"));
    for (i, kind) in types["server_types"].as_array().unwrap().iter().enumerate() {
        problems.extend(server_type(
            kind,
            &format!("GET /server_types server_types[{i}]"),
        ));
    }

    let (status, locations) = call(&http, &emulator, get.clone(), "/locations", None).await;
    assert_eq!(status, 200);
    problems.extend(listing(&locations, "locations", "GET /locations"));
    for (i, l) in locations["locations"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
    {
        problems.extend(check(
            l,
            LOCATION,
            &format!("GET /locations locations[{i}]"),
        ));
    }

    let create = json!({
        "name": "shape-1", "server_type": "cx23", "image": "ubuntu-24.04",
        "location": "nbg1", "labels": {"a": "b"},
    });
    let (status, created) = call(
        &http,
        &emulator,
        reqwest::Method::POST,
        "/servers",
        Some(create),
    )
    .await;
    assert_eq!(status, 201, "{created}");
    for key in ["server", "action", "next_actions", "root_password"] {
        if created.get(key).is_none() {
            problems.push(format!("POST /servers .{key}: required, missing"));
        }
    }
    problems.extend(server(&created["server"], "POST /servers server"));
    problems.extend(check(&created["action"], ACTION, "POST /servers action"));
    for (i, a) in created["next_actions"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
    {
        problems.extend(check(
            a,
            ACTION,
            &format!("POST /servers next_actions[{i}]"),
        ));
    }
    let id = created["server"]["id"].as_i64().unwrap();

    let (status, listed) = call(
        &http,
        &emulator,
        get.clone(),
        "/servers?label_selector=a%3Db",
        None,
    )
    .await;
    assert_eq!(status, 200);
    problems.extend(listing(&listed, "servers", "GET /servers"));
    for (i, s) in listed["servers"].as_array().unwrap().iter().enumerate() {
        problems.extend(server(s, &format!("GET /servers servers[{i}]")));
    }
    let (status, one) = call(
        &http,
        &emulator,
        get.clone(),
        &format!("/servers/{id}"),
        None,
    )
    .await;
    assert_eq!(status, 200);
    problems.extend(server(&one["server"], "GET /servers/{id} server"));
    let labels = json!({"labels": {"a": "c"}});
    let (status, replaced) = call(
        &http,
        &emulator,
        reqwest::Method::PUT,
        &format!("/servers/{id}"),
        Some(labels),
    )
    .await;
    assert_eq!(status, 200);
    problems.extend(server(&replaced["server"], "PUT /servers/{id} server"));

    // The other resources a production-shaped Create refers to.
    for (path, key, shape) in [
        (
            "/images?name=ubuntu-24.04&architecture=x86",
            "images",
            IMAGE,
        ),
        (
            "/images?label_selector=role%3Dnode&architecture=x86",
            "images",
            IMAGE,
        ),
        ("/networks", "networks", NETWORK),
        ("/firewalls", "firewalls", FIREWALL),
        ("/ssh_keys", "ssh_keys", SSH_KEY),
        ("/placement_groups", "placement_groups", PLACEMENT_GROUP),
    ] {
        let (status, body) = call(&http, &emulator, get.clone(), path, None).await;
        assert_eq!(status, 200, "{path}: {body}");
        problems.extend(listing(&body, key, &format!("GET {path}")));
        let items = body[key].as_array().unwrap();
        assert!(
            !items.is_empty() || key == "placement_groups",
            "{path}: nothing listed"
        );
        for (i, item) in items.iter().enumerate() {
            let at = format!("GET {path} {key}[{i}]");
            problems.extend(check(item, shape, &at));
            for (j, subnet) in item["subnets"].as_array().into_iter().flatten().enumerate() {
                problems.extend(check(subnet, SUBNET, &format!("{at}.subnets[{j}]")));
            }
        }
    }
    let (status, image) = call(&http, &emulator, get.clone(), "/images/161547269", None).await;
    assert_eq!(status, 200);
    problems.extend(check(&image["image"], IMAGE, "GET /images/{id} image"));
    let group = json!({"name": "shape-group", "type": "spread", "labels": {"a": "b"}});
    let (status, made) = call(
        &http,
        &emulator,
        reqwest::Method::POST,
        "/placement_groups",
        Some(group),
    )
    .await;
    assert_eq!(status, 201, "{made}");
    problems.extend(check(
        &made["placement_group"],
        PLACEMENT_GROUP,
        "POST /placement_groups placement_group",
    ));

    // The answers of a sold-out type (412) and of the project's server limit (403).
    emulator.set_sold_out("cx33", "nbg1", true);
    let sold_out = json!({"name": "shape-2", "server_type": "cx33", "image": "ubuntu-24.04", "location": "nbg1"});
    let (status, refused) = call(
        &http,
        &emulator,
        reqwest::Method::POST,
        "/servers",
        Some(sold_out),
    )
    .await;
    assert_eq!(status, 412);
    assert_eq!(
        refused,
        json!({"error": {"code": "resource_unavailable", "message": "error during placement", "details": null}})
    );
    problems.extend(error(&refused, "POST /servers 412"));
    emulator.set_server_limit(Some(1));
    let over = json!({"name": "shape-3", "server_type": "cx23", "image": "ubuntu-24.04", "location": "nbg1"});
    let (status, refused) = call(
        &http,
        &emulator,
        reqwest::Method::POST,
        "/servers",
        Some(over),
    )
    .await;
    assert_eq!(status, 403);
    assert_eq!(refused["error"]["code"], "resource_limit_exceeded");
    problems.extend(error(&refused, "POST /servers 403"));

    // Deleting answers with the delete action.
    let (status, deleted) = call(
        &http,
        &emulator,
        reqwest::Method::DELETE,
        &format!("/servers/{id}"),
        None,
    )
    .await;
    assert_eq!(status, 200);
    problems.extend(check(
        &deleted["action"],
        ACTION,
        "DELETE /servers/{id} action",
    ));

    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

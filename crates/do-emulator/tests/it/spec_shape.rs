//! The emulator's answers held to DigitalOcean's official API document (`digitalocean/openapi`,
//! `specification/`, as published 2026) for the catalogue and Droplet operations the provider's
//! client calls and the error answers it relies on: each object has every key the document
//! requires, of the document's type, enum values among the document's and RFC 3339 timestamps.
//! The shapes below are the document's `required` lists and property types for those schemas
//! (`sizes/models/size.yml`, `regions/models/region.yml`, `account/models/account.yml`,
//! `droplets/models/droplet.yml`, `shared/models/error.yml`); nothing else of it is kept.

use serde_json::{Value, json};
use spec_shape::{Field, Kind, check, opt, req};

use crate::{TOKEN, create_body, start};

/// `size` (GET /v2/sizes, and in a Droplet).
const SIZE: &[Field] = &[
    req("available", Kind::Bool),
    req("disk", Kind::Int),
    req("memory", Kind::Int),
    req("price_hourly", Kind::Num),
    req("price_monthly", Kind::Num),
    req("regions", Kind::Arr),
    req("slug", Kind::Str),
    req("transfer", Kind::Num),
    req("vcpus", Kind::Int),
    req("description", Kind::Str),
    opt("disk_info", Kind::Arr),
];

/// `region` (GET /v2/regions, and in a Droplet).
const REGION: &[Field] = &[
    req("available", Kind::Bool),
    req("features", Kind::Arr),
    req("name", Kind::Str),
    req("sizes", Kind::Arr),
    req("slug", Kind::Str),
];

/// `account` (GET /v2/account).
const ACCOUNT: &[Field] = &[
    req("droplet_limit", Kind::Int),
    req("floating_ip_limit", Kind::Int),
    req("email", Kind::Str),
    req("uuid", Kind::Str),
    req("email_verified", Kind::Bool),
    req("status", Kind::OneOf(&["active", "warning", "locked"])),
    req("status_message", Kind::Str),
];

/// `droplet` (POST /v2/droplets, GET /v2/droplets/{id}, GET /v2/droplets?tag_name=).
const DROPLET: &[Field] = &[
    req("name", Kind::Str),
    req("region", Kind::Obj),
    req("size", Kind::Obj),
    req("image", Kind::Obj),
    opt("id", Kind::Int),
    opt("memory", Kind::Int),
    opt("vcpus", Kind::Int),
    opt("disk", Kind::Int),
    opt("locked", Kind::Bool),
    opt("status", Kind::OneOf(&["new", "active", "off", "archive"])),
    opt("created_at", Kind::Time),
    opt("features", Kind::Arr),
    opt("backup_ids", Kind::Arr),
    opt("snapshot_ids", Kind::Arr),
    opt("volume_ids", Kind::Arr),
    opt("size_slug", Kind::Str),
    opt("networks", Kind::Obj),
    opt("tags", Kind::Arr),
    opt("vpc_uuid", Kind::Str),
];

/// `error`: `{"id", "message", "request_id"}`.
const ERROR: &[Field] = &[
    req("id", Kind::Str),
    req("message", Kind::Str),
    opt("request_id", Kind::Str),
];

fn droplet(d: &Value, at: &str) -> Vec<String> {
    let mut problems = check(d, DROPLET, at);
    problems.extend(check(&d["size"], SIZE, &format!("{at}.size")));
    problems.extend(check(&d["region"], REGION, &format!("{at}.region")));
    problems
}

#[tokio::test]
async fn every_answer_the_provider_reads_has_the_shape_of_the_official_document() {
    let (emulator, base, _stop) = start().await;
    emulator.set_sold_out("s-4vcpu-8gb", "nyc3", true);
    let http = reqwest::Client::new();
    let get = |path: &str| {
        let request = http.get(format!("{base}{path}")).bearer_auth(TOKEN);
        async move {
            let response = request.send().await.unwrap();
            assert_eq!(response.status(), 200);
            response.json::<Value>().await.unwrap()
        }
    };
    let mut problems = Vec::new();
    let sizes = get("/v2/sizes").await;
    for (i, s) in sizes["sizes"].as_array().unwrap().iter().enumerate() {
        problems.extend(check(s, SIZE, &format!("GET /v2/sizes sizes[{i}]")));
    }
    let regions = get("/v2/regions").await;
    for (i, r) in regions["regions"].as_array().unwrap().iter().enumerate() {
        problems.extend(check(r, REGION, &format!("GET /v2/regions regions[{i}]")));
    }
    let account = get("/v2/account").await;
    problems.extend(check(
        &account["account"],
        ACCOUNT,
        "GET /v2/account account",
    ));
    for listing in [&sizes, &regions] {
        if !listing["meta"]["total"].is_u64() {
            problems.push(format!("meta.total missing in {}", listing["meta"]));
        }
    }

    let created: Value = http
        .post(format!("{base}/v2/droplets"))
        .bearer_auth(TOKEN)
        .json(&create_body("shape-1", &["bigfleet-managed"]))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    problems.extend(droplet(&created["droplet"], "POST /v2/droplets droplet"));
    let id = created["droplet"]["id"].as_u64().unwrap();
    let one = get(&format!("/v2/droplets/{id}")).await;
    problems.extend(droplet(&one["droplet"], "GET /v2/droplets/{id} droplet"));
    let tagged = get("/v2/droplets?tag_name=bigfleet-managed").await;
    for (i, d) in tagged["droplets"].as_array().unwrap().iter().enumerate() {
        problems.extend(droplet(d, &format!("GET /v2/droplets droplets[{i}]")));
    }

    // A size sold out in the region, and the Droplet limit: 422 unprocessable_entity.
    let refuse = |body: Value| {
        let request = http
            .post(format!("{base}/v2/droplets"))
            .bearer_auth(TOKEN)
            .json(&body);
        async move {
            let response = request.send().await.unwrap();
            (
                response.status().as_u16(),
                response.json::<Value>().await.unwrap(),
            )
        }
    };
    let mut sold_out = create_body("shape-2", &[]);
    sold_out["size"] = json!("s-4vcpu-8gb");
    let (status, body) = refuse(sold_out).await;
    assert_eq!(status, 422);
    assert_eq!(body["id"], "unprocessable_entity");
    problems.extend(check(&body, ERROR, "POST /v2/droplets 422 (sold out)"));
    emulator.set_droplet_limit(1);
    let (status, body) = refuse(create_body("shape-3", &[])).await;
    assert_eq!(status, 422);
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .ends_with("will exceed your droplet limit"),
        "{body}"
    );
    problems.extend(check(&body, ERROR, "POST /v2/droplets 422 (limit)"));
    let account = get("/v2/account").await;
    assert_eq!(account["account"]["droplet_limit"], 1);

    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

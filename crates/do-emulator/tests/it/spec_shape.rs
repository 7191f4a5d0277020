//! The emulator's answers validated against DigitalOcean's official API document: the excerpt
//! of `digitalocean/openapi`'s `specification/` vendored in `crates/spec-shape/official/` (its
//! source is named there), which holds every operation the provider's client calls. Each
//! answer, success or error (422, 404, 429, 5xx: the document's own status or `default`), is
//! checked against the document's schema for its operation and status.

use do_emulator::{Emulator, Fault};
use serde_json::json;
use spec_shape::Exercise;

use crate::{TOKEN, create_body, start};

fn seed(emulator: &Emulator) -> (String, u64, String) {
    let vpc = emulator.add_vpc("shape-vpc", "nyc3", "10.10.0.0/20");
    let (key, _) = emulator.add_ssh_key("shape-key");
    let firewall = emulator.add_firewall("shape-fw", &["bigfleet-managed"]);
    emulator.add_snapshot("shape-snapshot", &["nyc3"]);
    (vpc, key, firewall)
}

#[tokio::test]
async fn every_answer_of_every_operation_the_provider_calls_validates_against_the_official_document()
 {
    let (emulator, base, _stop) = start().await;
    let (vpc, key, _) = seed(&emulator);
    emulator.set_sold_out("s-4vcpu-8gb", "nyc3", true);
    let mut c = Exercise::new(spec_shape::digitalocean(), base, TOKEN);

    // Catalogue, account and the resources a Create refers to.
    c.get("/v2/sizes", "/v2/sizes?per_page=200", 200).await;
    c.get("/v2/regions", "/v2/regions", 200).await;
    c.get("/v2/account", "/v2/account", 200).await;
    c.get("/v2/images/{image_id}", "/v2/images/ubuntu-24-04-x64", 200)
        .await;
    c.get("/v2/images/{image_id}", "/v2/images/no-such-image", 404)
        .await;
    c.get("/v2/images", "/v2/images?private=true", 200).await;
    c.get("/v2/vpcs/{vpc_id}", &format!("/v2/vpcs/{vpc}"), 200)
        .await;
    c.get(
        "/v2/vpcs/{vpc_id}",
        "/v2/vpcs/5a4981aa-9653-4bd1-bef5-d6bff52042e4",
        404,
    )
    .await;
    c.get("/v2/account/keys", "/v2/account/keys", 200).await;
    let keys = "/v2/account/keys/{ssh_key_identifier}";
    c.get(keys, &format!("/v2/account/keys/{key}"), 200).await;
    c.get(keys, "/v2/account/keys/999999999", 404).await;
    c.get("/v2/firewalls", "/v2/firewalls", 200).await;

    // Droplets: tag, create, read, list by tag, count, (un)tag, delete.
    c.call(
        "POST",
        "/v2/tags",
        "/v2/tags",
        Some(json!({"name": "shape-tag"})),
        201,
    )
    .await;
    // A tag that exists already: 422, which the provider takes as done.
    c.call(
        "POST",
        "/v2/tags",
        "/v2/tags",
        Some(json!({"name": "shape-tag"})),
        422,
    )
    .await;
    let created = c
        .call(
            "POST",
            "/v2/droplets",
            "/v2/droplets",
            Some(create_body("shape-1", &["bigfleet-managed"])),
            202,
        )
        .await;
    let id = created["droplet"]["id"].as_u64().unwrap();
    let one = "/v2/droplets/{droplet_id}";
    c.get(one, &format!("/v2/droplets/{id}"), 200).await;
    c.get(
        "/v2/droplets",
        "/v2/droplets?tag_name=bigfleet-managed",
        200,
    )
    .await;
    c.get("/v2/droplets", "/v2/droplets?per_page=1", 200).await;
    c.get("/v2/actions", "/v2/actions?page=1&per_page=200", 200)
        .await;
    let resources =
        json!({"resources": [{"resource_id": id.to_string(), "resource_type": "droplet"}]});
    let tag = "/v2/tags/{tag_id}/resources";
    c.call(
        "POST",
        tag,
        "/v2/tags/shape-tag/resources",
        Some(resources.clone()),
        204,
    )
    .await;
    c.call(
        "DELETE",
        tag,
        "/v2/tags/shape-tag/resources",
        Some(resources.clone()),
        204,
    )
    .await;
    c.call(
        "POST",
        tag,
        "/v2/tags/no-such-tag/resources",
        Some(resources),
        404,
    )
    .await;

    // A size sold out in the region, and the Droplet limit: 422 `unprocessable_entity`.
    let mut sold_out = create_body("shape-2", &[]);
    sold_out["size"] = json!("s-4vcpu-8gb");
    let body = c
        .call("POST", "/v2/droplets", "/v2/droplets", Some(sold_out), 422)
        .await;
    assert_eq!(body["id"], "unprocessable_entity");
    emulator.set_droplet_limit(1);
    let body = c
        .call(
            "POST",
            "/v2/droplets",
            "/v2/droplets",
            Some(create_body("shape-3", &[])),
            422,
        )
        .await;
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .ends_with("will exceed your droplet limit"),
        "{body}"
    );
    let account = c.get("/v2/account", "/v2/account", 200).await;
    assert_eq!(account["account"]["droplet_limit"], 1);

    // Rate limited (429) and an upstream failure (5xx).
    emulator.fail_next(
        1,
        Fault {
            status: 429,
            retry_after: Some(1),
        },
    );
    c.get("/v2/droplets", "/v2/droplets", 429).await;
    emulator.fail_next(
        1,
        Fault {
            status: 503,
            retry_after: None,
        },
    );
    c.get("/v2/sizes", "/v2/sizes", 503).await;

    c.delete(one, &format!("/v2/droplets/{id}"), 204).await;
    c.get(one, &format!("/v2/droplets/{id}"), 404).await;
    c.delete(one, &format!("/v2/droplets/{id}"), 404).await;

    // Every operation of the excerpt (which holds those the client calls) was answered.
    c.assert_complete();
}

//! The emulator's answers validated against Hetzner's official API document: the excerpt of
//! `cloud.spec.json` vendored in `crates/spec-shape/official/` (its source is named there),
//! which holds every operation the provider's client calls. Each answer, success or error, is
//! checked against the document's schema for its operation and status (`4xx`/`5xx` for the
//! errors), and servers carry no key the document dropped (`datacenter`).

use serde_json::{Value, json};
use spec_shape::{Exercise, absent};

use crate::TOKEN;
use hcloud_emulator::{Emulator, Fault};

/// The servers an answer carries.
fn servers(answer: &Value) -> Vec<&Value> {
    let mut all: Vec<&Value> = answer["servers"].as_array().into_iter().flatten().collect();
    all.extend(answer.get("server").filter(|s| s.is_object()));
    all
}

/// A server carries no key the document dropped (`datacenter`).
fn servers_without_datacenter(answer: &Value, at: &str) -> Vec<String> {
    servers(answer)
        .into_iter()
        .flat_map(|server| absent(server, "datacenter", at))
        .collect()
}

fn first_id(listing: &Value, key: &str) -> i64 {
    listing[key][0]["id"]
        .as_i64()
        .unwrap_or_else(|| panic!("nothing under {key}: {listing}"))
}

#[tokio::test]
async fn every_answer_of_every_operation_the_provider_calls_validates_against_the_official_document()
 {
    let emulator = Emulator::start(TOKEN).await.unwrap();
    emulator.set_deprecation(
        "cx23",
        "fsn1",
        Some(("2026-06-01T09:00:00Z", "2026-12-31T23:59:59Z")),
    );
    let mut c = Exercise::new(spec_shape::hetzner_cloud(), emulator.endpoint(), TOKEN)
        .also_checking(servers_without_datacenter);

    // Catalogue and the resources a production-shaped Create refers to.
    c.get("/server_types", "/server_types", 200).await;
    c.get("/locations", "/locations?per_page=50", 200).await;
    c.get("/locations", "/locations?name=nbg1", 200).await;
    let images = c
        .get("/images", "/images?name=ubuntu-24.04&architecture=x86", 200)
        .await;
    let image = first_id(&images, "images");
    c.get(
        "/images",
        "/images?label_selector=role%3Dnode&architecture=x86",
        200,
    )
    .await;
    c.get("/images/{id}", &format!("/images/{image}"), 200)
        .await;
    c.get("/images/{id}", "/images/999999999", 404).await;
    for (list, one, key) in [
        ("/networks", "/networks/{id}", "networks"),
        ("/firewalls", "/firewalls/{id}", "firewalls"),
        ("/ssh_keys", "/ssh_keys/{id}", "ssh_keys"),
    ] {
        let listed = c.get(list, list, 200).await;
        let id = first_id(&listed, key);
        let name = listed[key][0]["name"].as_str().unwrap().to_owned();
        c.get(list, &format!("{list}?name={name}"), 200).await;
        c.get(one, &format!("{list}/{id}"), 200).await;
        c.get(one, &format!("{list}/999999999"), 404).await;
    }

    // Placement groups: listed, created, a duplicate name refused, deleted.
    c.get(
        "/placement_groups",
        "/placement_groups?label_selector=a%3Db",
        200,
    )
    .await;
    let group = json!({"name": "shape-group", "type": "spread", "labels": {"a": "b"}});
    let made = c
        .call(
            "POST",
            "/placement_groups",
            "/placement_groups",
            Some(group.clone()),
            201,
        )
        .await;
    c.call(
        "POST",
        "/placement_groups",
        "/placement_groups",
        Some(group),
        409,
    )
    .await;
    let group = made["placement_group"]["id"].as_i64().unwrap();

    // Servers: created, listed, read, relabelled, attached to a network, deleted.
    let create = json!({
        "name": "shape-1", "server_type": "cx23", "image": "ubuntu-24.04",
        "location": "nbg1", "labels": {"a": "b"},
    });
    let created = c
        .call("POST", "/servers", "/servers", Some(create.clone()), 201)
        .await;
    let id = created["server"]["id"].as_i64().unwrap();
    // The same name again, and a type that does not exist.
    c.call("POST", "/servers", "/servers", Some(create), 409)
        .await;
    let unknown = json!({"name": "shape-x", "server_type": "cx999", "image": "ubuntu-24.04"});
    c.call("POST", "/servers", "/servers", Some(unknown), 422)
        .await;
    c.get("/servers", "/servers?label_selector=a%3Db&per_page=50", 200)
        .await;
    c.get("/servers", "/servers?name=shape-1", 200).await;
    c.get("/servers/{id}", &format!("/servers/{id}"), 200).await;
    c.call(
        "PUT",
        "/servers/{id}",
        &format!("/servers/{id}"),
        Some(json!({"labels": {"a": "c"}})),
        200,
    )
    .await;
    let networks = c.get("/networks", "/networks", 200).await;
    let network = first_id(&networks, "networks");
    let attach = json!({"network": network});
    let attach_path = format!("/servers/{id}/actions/attach_to_network");
    let template = "/servers/{id}/actions/attach_to_network";
    c.call("POST", template, &attach_path, Some(attach.clone()), 201)
        .await;
    // Attached already: 422 `server_already_attached`, which the provider counts as done.
    let again = c
        .call("POST", template, &attach_path, Some(attach), 422)
        .await;
    assert_eq!(again["error"]["code"], "server_already_attached");

    // A sold-out type (412 `resource_unavailable`) and the project's server limit (403
    // `resource_limit_exceeded`).
    emulator.set_sold_out("cx33", "nbg1", true);
    let sold_out = json!({"name": "shape-2", "server_type": "cx33", "image": "ubuntu-24.04", "location": "nbg1"});
    let refused = c
        .call("POST", "/servers", "/servers", Some(sold_out), 412)
        .await;
    assert_eq!(
        refused,
        json!({"error": {"code": "resource_unavailable", "message": "error during placement", "details": null}})
    );
    emulator.set_server_limit(Some(1));
    let over = json!({"name": "shape-3", "server_type": "cx23", "image": "ubuntu-24.04", "location": "nbg1"});
    let refused = c
        .call("POST", "/servers", "/servers", Some(over), 403)
        .await;
    assert_eq!(refused["error"]["code"], "resource_limit_exceeded");
    emulator.set_server_limit(None);

    // Rate limited (429) and an upstream failure (5xx), on a read.
    emulator.inject([Fault::RateLimited {
        retry_after: Some(1),
        reset_in: Some(1),
    }]);
    c.get("/servers", "/servers", 429).await;
    emulator.inject([Fault::ServerError(503)]);
    c.get("/server_types", "/server_types", 503).await;

    // Deleting answers with the delete action; a server that is gone is 404.
    c.delete("/servers/{id}", &format!("/servers/{id}"), 200)
        .await;
    emulator.delete_out_of_band(id);
    c.get("/servers/{id}", &format!("/servers/{id}"), 404).await;
    c.delete("/servers/{id}", &format!("/servers/{id}"), 404)
        .await;
    c.delete(
        "/placement_groups/{id}",
        &format!("/placement_groups/{group}"),
        204,
    )
    .await;
    c.delete(
        "/placement_groups/{id}",
        &format!("/placement_groups/{group}"),
        404,
    )
    .await;

    // Every operation of the excerpt (which holds those the client calls) was answered.
    c.assert_complete();
}

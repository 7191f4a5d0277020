//! The emulator over HTTP: authentication, DigitalOcean-shaped answers, pagination, tags, and
//! the fault knobs as the admin endpoints set them.

#![allow(clippy::unwrap_used)]

use do_emulator::Emulator;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

mod spec_shape;

const TOKEN: &str = "emu-token";

async fn start() -> (Emulator, String, tokio_util::sync::DropGuard) {
    let emulator = Emulator::new(TOKEN);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let stop = CancellationToken::new();
    tokio::spawn(emulator.clone().serve(listener, stop.clone()));
    (emulator, base, stop.drop_guard())
}

fn create_body(name: &str, tags: &[&str]) -> Value {
    json!({ "name": name, "region": "nyc3", "size": "s-2vcpu-4gb", "image": "ubuntu-24-04-x64", "tags": tags })
}

#[tokio::test]
async fn droplets_tags_and_pages() {
    let (emulator, base, _stop) = start().await;
    let http = reqwest::Client::new();
    let r = http.get(format!("{base}/v2/sizes")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(r.json::<Value>().await.unwrap()["id"], "Unauthorized");

    for i in 0..5 {
        let r = http
            .post(format!("{base}/v2/droplets"))
            .bearer_auth(TOKEN)
            .json(&create_body(
                &format!("d-{i}"),
                &["bigfleet-managed", "bfmid:x"],
            ))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 202);
        assert!(r.headers().contains_key("ratelimit-remaining"));
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["droplet"]["status"], "new");
        assert_eq!(body["links"]["actions"][0]["rel"], "create");
    }
    let page: Value = http
        .get(format!("{base}/v2/droplets?tag_name=bfmid:x&per_page=2"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(page["meta"]["total"], 5);
    assert_eq!(page["droplets"].as_array().unwrap().len(), 2);
    let next = page["links"]["pages"]["next"].as_str().unwrap().to_owned();
    assert!(
        next.contains("page=2") && next.contains("tag_name=bfmid%3Ax"),
        "{next}"
    );
    let last: Value = http
        .get(format!(
            "{base}/v2/droplets?tag_name=bfmid:x&per_page=2&page=3"
        ))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(last["droplets"].as_array().unwrap().len(), 1);
    assert!(last["links"]["pages"].get("next").is_none());

    let id = emulator.droplets()[0].id;
    let r = http
        .post(format!("{base}/v2/tags"))
        .bearer_auth(TOKEN)
        .json(&json!({"name": "bfcluster:c"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let r = http
        .post(format!("{base}/v2/tags"))
        .bearer_auth(TOKEN)
        .json(&json!({"name": "bfcluster:c"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 422);
    let resources =
        json!({"resources": [{"resource_id": id.to_string(), "resource_type": "droplet"}]});
    let r = http
        .post(format!("{base}/v2/tags/bfcluster:c/resources"))
        .bearer_auth(TOKEN)
        .json(&resources)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    assert!(
        emulator
            .droplet(id)
            .unwrap()
            .tags
            .contains(&"bfcluster:c".to_owned())
    );
    let r = http
        .delete(format!("{base}/v2/tags/bfcluster:c/resources"))
        .bearer_auth(TOKEN)
        .json(&resources)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    assert!(
        !emulator
            .droplet(id)
            .unwrap()
            .tags
            .contains(&"bfcluster:c".to_owned())
    );

    let r = http
        .delete(format!("{base}/v2/droplets/{id}"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    let r = http
        .get(format!("{base}/v2/droplets/{id}"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(r.json::<Value>().await.unwrap()["id"], "not_found");
}

#[tokio::test]
async fn fault_knobs_through_the_admin_endpoints() {
    let (emulator, base, _stop) = start().await;
    let http = reqwest::Client::new();
    let faults = json!({
        "fail_next": [{"status": 429, "retry_after": 3}, {"status": 503}],
        "drop_create_responses": 1,
        "active_after_polls": 2
    });
    let r = http
        .post(format!("{base}/_emulator/faults"))
        .json(&faults)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    let r = http
        .get(format!("{base}/v2/sizes"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "3");
    assert_eq!(r.headers()["ratelimit-remaining"], "0");
    assert!(r.headers().contains_key("ratelimit-reset"));
    let r = http
        .get(format!("{base}/v2/sizes"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);

    // The create takes effect, but its answer never arrives.
    let err = http
        .post(format!("{base}/v2/droplets"))
        .bearer_auth(TOKEN)
        .json(&create_body("lost", &["bigfleet-managed"]))
        .send()
        .await
        .unwrap_err();
    assert!(!err.is_status(), "{err:?}");
    let droplets: Value = http
        .get(format!("{base}/_emulator/droplets"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let d = &droplets["droplets"][0];
    assert_eq!(d["name"], "lost");
    let id = d["id"].as_u64().unwrap();

    // Active after two GETs.
    let status = |v: Value| v["droplet"]["status"].as_str().unwrap().to_owned();
    let get = || {
        http.get(format!("{base}/v2/droplets/{id}"))
            .bearer_auth(TOKEN)
            .send()
    };
    assert_eq!(status(get().await.unwrap().json().await.unwrap()), "new");
    assert_eq!(status(get().await.unwrap().json().await.unwrap()), "active");

    let r = http
        .delete(format!("{base}/_emulator/droplets/{id}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    assert!(emulator.droplets().is_empty());
    let stats: Value = http
        .get(format!("{base}/_emulator/stats"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(stats["create_requests"], 1);
}

#[tokio::test]
async fn images_vpcs_keys_firewalls_and_create_bodies() {
    let (emulator, base, _stop) = start().await;
    let http = reqwest::Client::new();
    let get = |path: &str| {
        let request = http.get(format!("{base}{path}")).bearer_auth(TOKEN);
        async move {
            let r = request.send().await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let snapshot = emulator.add_snapshot("node-snap", &["nyc3"]);
    let vpc = emulator.add_vpc("prod", "nyc3", "10.40.0.0/20");
    let (key_id, fingerprint) = emulator.add_ssh_key("ops");
    emulator.add_firewall("k8s", &["k8s-node"]);

    let (status, body) = get("/v2/account").await;
    assert_eq!(
        (status, body["account"]["status"].clone()),
        (200, json!("active"))
    );
    let (_, body) = get("/v2/images/ubuntu-24-04-x64").await;
    assert_eq!(body["image"]["slug"], "ubuntu-24-04-x64");
    assert_eq!(body["image"]["public"], true);
    let (_, body) = get(&format!("/v2/images/{snapshot}")).await;
    assert_eq!(body["image"]["type"], "snapshot");
    assert_eq!(body["image"]["regions"], json!(["nyc3"]));
    let (status, body) = get("/v2/images/no-such-slug").await;
    assert_eq!((status, body["id"].clone()), (404, json!("not_found")));
    let (_, body) = get("/v2/images?private=true").await;
    assert_eq!(body["images"].as_array().unwrap().len(), 1);
    assert_eq!(body["images"][0]["name"], "node-snap");
    let (_, body) = get("/v2/snapshots?resource_type=droplet").await;
    assert_eq!(body["snapshots"][0]["id"], json!(snapshot.to_string()));
    let (_, body) = get(&format!("/v2/vpcs/{vpc}")).await;
    assert_eq!(body["vpc"]["region"], "nyc3");
    assert_eq!(body["vpc"]["ip_range"], "10.40.0.0/20");
    let (status, _) = get("/v2/vpcs/00000000-0000-4000-8000-000000000000").await;
    assert_eq!(status, 404);
    let (_, body) = get("/v2/vpcs").await;
    assert_eq!(
        body["meta"]["total"], 9,
        "a default VPC per region plus ours"
    );
    let (_, body) = get(&format!("/v2/account/keys/{key_id}")).await;
    assert_eq!(body["ssh_key"]["fingerprint"], json!(fingerprint));
    let (_, body) = get(&format!("/v2/account/keys/{fingerprint}")).await;
    assert_eq!(body["ssh_key"]["id"], key_id);
    let (status, _) = get("/v2/account/keys/1").await;
    assert_eq!(status, 404);
    let (_, body) = get("/v2/firewalls").await;
    assert_eq!(body["firewalls"][0]["tags"], json!(["k8s-node"]));
    let (_, body) = get("/v2/regions").await;
    assert!(
        body["regions"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["slug"] == "nyc3")
    );

    // A create with every field is recorded as sent and shapes the Droplet.
    let create = json!({
        "name": "prod-1", "region": "nyc3", "size": "s-2vcpu-4gb", "image": snapshot,
        "vpc_uuid": vpc, "ipv6": true, "monitoring": true, "ssh_keys": [key_id, fingerprint],
        "tags": ["k8s-node"], "user_data": "#cloud-config\n"
    });
    let r = http
        .post(format!("{base}/v2/droplets"))
        .bearer_auth(TOKEN)
        .json(&create)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    assert_eq!(emulator.create_bodies(), vec![create.clone()]);
    let id = r.json::<Value>().await.unwrap()["droplet"]["id"]
        .as_u64()
        .unwrap();
    let (_, body) = get(&format!("/v2/droplets/{id}")).await;
    let d = &body["droplet"];
    assert_eq!(d["vpc_uuid"], json!(vpc));
    assert_eq!(d["image"]["id"], snapshot);
    let v4 = d["networks"]["v4"].as_array().unwrap();
    assert!(v4.iter().any(
        |n| n["type"] == "private" && n["ip_address"].as_str().unwrap().starts_with("10.40.0.")
    ));
    assert!(v4.iter().any(|n| n["type"] == "public"));
    assert_eq!(d["networks"]["v6"][0]["type"], "public");
    assert!(
        d["features"]
            .as_array()
            .unwrap()
            .contains(&json!("monitoring"))
    );
    let (_, recorded) = get("/_emulator/create-requests").await;
    assert_eq!(recorded["requests"][0], create);

    // Each refused reference is a 422 unprocessable_entity.
    let other = emulator.add_vpc("ams", "ams3", "10.50.0.0/20");
    let elsewhere = emulator.add_snapshot("sfo", &["sfo3"]);
    for (field, value) in [
        ("image", json!("no-such-slug")),
        ("image", json!(elsewhere)),
        ("vpc_uuid", json!(other)),
        ("vpc_uuid", json!("00000000-0000-4000-8000-000000000000")),
        ("ssh_keys", json!([1])),
    ] {
        let mut body = create.clone();
        body[field] = value.clone();
        let r = http
            .post(format!("{base}/v2/droplets"))
            .bearer_auth(TOKEN)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 422, "{field} {value}");
        assert_eq!(
            r.json::<Value>().await.unwrap()["id"],
            "unprocessable_entity"
        );
    }

    // The admin seed makes the same resources for a separate process.
    let r = http
        .post(format!("{base}/_emulator/seed"))
        .json(&json!({
            "vpcs": [{"name": "seeded", "region": "nyc3", "ip_range": "10.60.0.0/20"}],
            "snapshots": [{"name": "seeded-snap", "regions": ["nyc3"]}],
            "ssh_keys": ["seeded-key"],
            "firewalls": [{"name": "seeded-fw", "tags": ["x"]}]
        }))
        .send()
        .await
        .unwrap();
    let seeded: Value = r.json().await.unwrap();
    let (status, _) = get(&format!(
        "/v2/vpcs/{}",
        seeded["vpcs"][0]["id"].as_str().unwrap()
    ))
    .await;
    assert_eq!(status, 200);
    let (status, _) = get(&format!(
        "/v2/account/keys/{}",
        seeded["ssh_keys"][0]["fingerprint"].as_str().unwrap()
    ))
    .await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn every_deletion_is_an_account_action_listed_newest_first() {
    let (emulator, base, _stop) = start().await;
    let http = reqwest::Client::new();
    let mut ids = Vec::new();
    for i in 0..3 {
        let body: Value = http
            .post(format!("{base}/v2/droplets"))
            .bearer_auth(TOKEN)
            .json(&create_body(&format!("d-{i}"), &["bigfleet-managed"]))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        ids.push(body["droplet"]["id"].as_u64().unwrap());
    }
    // Through the API, through the admin endpoint (an operator in the console) and through
    // the library call tests use.
    let r = http
        .delete(format!("{base}/v2/droplets/{}", ids[0]))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    let r = http
        .delete(format!("{base}/_emulator/droplets/{}", ids[1]))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    assert!(emulator.delete_out_of_band(ids[2]));
    assert!(!emulator.delete_out_of_band(ids[2]), "already gone");

    let page = |n: u32| {
        let (http, base) = (http.clone(), base.clone());
        async move {
            http.get(format!("{base}/v2/actions?per_page=4&page={n}"))
                .bearer_auth(TOKEN)
                .send()
                .await
                .unwrap()
                .json::<Value>()
                .await
                .unwrap()
        }
    };
    let first = page(1).await;
    assert_eq!(first["meta"]["total"], 6);
    let listed = |p: &Value| -> Vec<(String, u64)> {
        p["actions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| {
                assert_eq!(a["resource_type"], "droplet");
                (
                    a["type"].as_str().unwrap().to_owned(),
                    a["resource_id"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    let destroy = |id: u64| ("destroy".to_owned(), id);
    let create = |id: u64| ("create".to_owned(), id);
    assert_eq!(
        listed(&first),
        vec![
            destroy(ids[2]),
            destroy(ids[1]),
            destroy(ids[0]),
            create(ids[2])
        ]
    );
    let next = first["links"]["pages"]["next"].as_str().unwrap();
    assert!(next.contains("/v2/actions?page=2"), "{next}");
    let second = page(2).await;
    assert_eq!(listed(&second), vec![create(ids[1]), create(ids[0])]);
    assert!(second["links"]["pages"].get("next").is_none());
    let newest_first: Vec<u64> = first["actions"]
        .as_array()
        .unwrap()
        .iter()
        .chain(second["actions"].as_array().unwrap())
        .map(|a| a["id"].as_u64().unwrap())
        .collect();
    assert!(
        newest_first.windows(2).all(|w| w[0] > w[1]),
        "{newest_first:?}"
    );
    assert_eq!(do_emulator::class_of("GET", "/v2/actions"), "actions");
}

#[tokio::test]
async fn an_outage_fails_every_request_while_it_lasts_and_none_after() {
    let (emulator, base, _stop) = start().await;
    let http = reqwest::Client::new();
    let sizes = || {
        http.get(format!("{base}/v2/sizes"))
            .bearer_auth(TOKEN)
            .send()
    };
    emulator.fail_for(
        std::time::Duration::from_millis(400),
        do_emulator::Fault {
            status: 429,
            retry_after: Some(1),
        },
    );
    // However many requests come while it lasts, each meets the outage.
    for _ in 0..5 {
        let r = sizes().await.unwrap();
        assert_eq!(r.status(), 429);
        assert_eq!(r.headers()["retry-after"], "1");
    }
    assert_eq!(emulator.pending_faults(), 0, "an outage queues nothing");
    tokio::time::sleep(std::time::Duration::from_millis(450)).await;
    assert_eq!(sizes().await.unwrap().status(), 200);
    // A cleared outage ends at once.
    emulator.fail_for(
        std::time::Duration::from_secs(60),
        do_emulator::Fault {
            status: 503,
            retry_after: None,
        },
    );
    assert_eq!(sizes().await.unwrap().status(), 503);
    emulator.clear_faults();
    assert_eq!(sizes().await.unwrap().status(), 200);
}

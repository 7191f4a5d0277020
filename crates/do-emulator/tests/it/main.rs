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

/// The emulator's API as the provider calls it (with the token), and its admin endpoints
/// (`/_emulator/…`), which take none.
struct Api {
    http: reqwest::Client,
    base: String,
}

impl Api {
    fn new(base: &str) -> Api {
        Api {
            http: reqwest::Client::new(),
            base: base.to_owned(),
        }
    }

    /// `method path` with the token and `body` as JSON, as it is answered or fails.
    async fn try_call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
    ) -> reqwest::Result<reqwest::Response> {
        let mut request = self
            .http
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(TOKEN);
        if let Some(body) = body {
            request = request.json(body);
        }
        request.send().await
    }

    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
    ) -> reqwest::Response {
        self.try_call(method, path, body).await.unwrap()
    }

    async fn get(&self, path: &str) -> reqwest::Response {
        self.call(reqwest::Method::GET, path, None).await
    }

    async fn get_json(&self, path: &str) -> Value {
        self.get(path).await.json().await.unwrap()
    }

    /// The status and JSON body of `GET path`.
    async fn get_answer(&self, path: &str) -> (u16, Value) {
        let r = self.get(path).await;
        (r.status().as_u16(), r.json().await.unwrap())
    }

    async fn post(&self, path: &str, body: &Value) -> reqwest::Response {
        self.call(reqwest::Method::POST, path, Some(body)).await
    }

    async fn delete(&self, path: &str) -> reqwest::Response {
        self.call(reqwest::Method::DELETE, path, None).await
    }

    /// `method path` without a token: the admin endpoints, or an unauthenticated call.
    async fn tokenless(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
    ) -> reqwest::Response {
        let mut request = self.http.request(method, format!("{}{path}", self.base));
        if let Some(body) = body {
            request = request.json(body);
        }
        request.send().await.unwrap()
    }

    /// The JSON body of an admin `GET path`.
    async fn admin_json(&self, path: &str) -> Value {
        self.tokenless(reqwest::Method::GET, path, None)
            .await
            .json()
            .await
            .unwrap()
    }
}

fn create_body(name: &str, tags: &[&str]) -> Value {
    json!({ "name": name, "region": "nyc3", "size": "s-2vcpu-4gb", "image": "ubuntu-24-04-x64", "tags": tags })
}

#[tokio::test]
async fn droplets_tags_and_pages() {
    let (emulator, base, _stop) = start().await;
    let api = Api::new(&base);
    let r = api.tokenless(reqwest::Method::GET, "/v2/sizes", None).await;
    assert_eq!(r.status(), 401);
    assert_eq!(r.json::<Value>().await.unwrap()["id"], "Unauthorized");

    for i in 0..5 {
        let r = api
            .post(
                "/v2/droplets",
                &create_body(&format!("d-{i}"), &["bigfleet-managed", "bfmid:x"]),
            )
            .await;
        assert_eq!(r.status(), 202);
        assert!(r.headers().contains_key("ratelimit-remaining"));
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["droplet"]["status"], "new");
        assert_eq!(body["links"]["actions"][0]["rel"], "create");
    }
    let page: Value = api
        .get_json("/v2/droplets?tag_name=bfmid:x&per_page=2")
        .await;
    assert_eq!(page["meta"]["total"], 5);
    assert_eq!(page["droplets"].as_array().unwrap().len(), 2);
    let next = page["links"]["pages"]["next"].as_str().unwrap().to_owned();
    assert!(
        next.contains("page=2") && next.contains("tag_name=bfmid%3Ax"),
        "{next}"
    );
    let last: Value = api
        .get_json("/v2/droplets?tag_name=bfmid:x&per_page=2&page=3")
        .await;
    assert_eq!(last["droplets"].as_array().unwrap().len(), 1);
    assert!(last["links"]["pages"].get("next").is_none());

    let id = emulator.droplets()[0].id;
    let r = api.post("/v2/tags", &json!({"name": "bfcluster:c"})).await;
    assert_eq!(r.status(), 201);
    let r = api.post("/v2/tags", &json!({"name": "bfcluster:c"})).await;
    assert_eq!(r.status(), 422);
    let resources =
        json!({"resources": [{"resource_id": id.to_string(), "resource_type": "droplet"}]});
    let r = api.post("/v2/tags/bfcluster:c/resources", &resources).await;
    assert_eq!(r.status(), 204);
    assert!(
        emulator
            .droplet(id)
            .unwrap()
            .tags
            .contains(&"bfcluster:c".to_owned())
    );
    let r = api
        .call(
            reqwest::Method::DELETE,
            "/v2/tags/bfcluster:c/resources",
            Some(&resources),
        )
        .await;
    assert_eq!(r.status(), 204);
    assert!(
        !emulator
            .droplet(id)
            .unwrap()
            .tags
            .contains(&"bfcluster:c".to_owned())
    );

    let r = api.delete(&format!("/v2/droplets/{id}")).await;
    assert_eq!(r.status(), 204);
    let r = api.get(&format!("/v2/droplets/{id}")).await;
    assert_eq!(r.status(), 404);
    assert_eq!(r.json::<Value>().await.unwrap()["id"], "not_found");
}

#[tokio::test]
async fn fault_knobs_through_the_admin_endpoints() {
    let (emulator, base, _stop) = start().await;
    let api = Api::new(&base);
    let faults = json!({
        "fail_next": [{"status": 429, "retry_after": 3}, {"status": 503}],
        "drop_create_responses": 1,
        "active_after_polls": 2
    });
    let r = api
        .tokenless(reqwest::Method::POST, "/_emulator/faults", Some(&faults))
        .await;
    assert_eq!(r.status(), 204);
    let r = api.get("/v2/sizes").await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "3");
    assert_eq!(r.headers()["ratelimit-remaining"], "0");
    assert!(r.headers().contains_key("ratelimit-reset"));
    let r = api.get("/v2/sizes").await;
    assert_eq!(r.status(), 503);

    // The create takes effect, but its answer never arrives.
    let err = api
        .try_call(
            reqwest::Method::POST,
            "/v2/droplets",
            Some(&create_body("lost", &["bigfleet-managed"])),
        )
        .await
        .unwrap_err();
    assert!(!err.is_status(), "{err:?}");
    let droplets: Value = api.admin_json("/_emulator/droplets").await;
    let d = &droplets["droplets"][0];
    assert_eq!(d["name"], "lost");
    let id = d["id"].as_u64().unwrap();

    // Active after two GETs.
    let status = |v: Value| v["droplet"]["status"].as_str().unwrap().to_owned();
    let one = format!("/v2/droplets/{id}");
    assert_eq!(status(api.get_json(&one).await), "new");
    assert_eq!(status(api.get_json(&one).await), "active");

    let r = api
        .tokenless(
            reqwest::Method::DELETE,
            &format!("/_emulator/droplets/{id}"),
            None,
        )
        .await;
    assert_eq!(r.status(), 204);
    assert!(emulator.droplets().is_empty());
    let stats: Value = api.admin_json("/_emulator/stats").await;
    assert_eq!(stats["create_requests"], 1);
}

#[tokio::test]
async fn images_vpcs_keys_firewalls_and_create_bodies() {
    let (emulator, base, _stop) = start().await;
    let api = Api::new(&base);
    let snapshot = emulator.add_snapshot("node-snap", &["nyc3"]);
    let vpc = emulator.add_vpc("prod", "nyc3", "10.40.0.0/20");
    let (key_id, fingerprint) = emulator.add_ssh_key("ops");
    emulator.add_firewall("k8s", &["k8s-node"]);

    let (status, body) = api.get_answer("/v2/account").await;
    assert_eq!(
        (status, body["account"]["status"].clone()),
        (200, json!("active"))
    );
    let (_, body) = api.get_answer("/v2/images/ubuntu-24-04-x64").await;
    assert_eq!(body["image"]["slug"], "ubuntu-24-04-x64");
    assert_eq!(body["image"]["public"], true);
    let (_, body) = api.get_answer(&format!("/v2/images/{snapshot}")).await;
    assert_eq!(body["image"]["type"], "snapshot");
    assert_eq!(body["image"]["regions"], json!(["nyc3"]));
    let (status, body) = api.get_answer("/v2/images/no-such-slug").await;
    assert_eq!((status, body["id"].clone()), (404, json!("not_found")));
    let (_, body) = api.get_answer("/v2/images?private=true").await;
    assert_eq!(body["images"].as_array().unwrap().len(), 1);
    assert_eq!(body["images"][0]["name"], "node-snap");
    let (_, body) = api.get_answer("/v2/snapshots?resource_type=droplet").await;
    assert_eq!(body["snapshots"][0]["id"], json!(snapshot.to_string()));
    let (_, body) = api.get_answer(&format!("/v2/vpcs/{vpc}")).await;
    assert_eq!(body["vpc"]["region"], "nyc3");
    assert_eq!(body["vpc"]["ip_range"], "10.40.0.0/20");
    let (status, _) = api
        .get_answer("/v2/vpcs/00000000-0000-4000-8000-000000000000")
        .await;
    assert_eq!(status, 404);
    let (_, body) = api.get_answer("/v2/vpcs").await;
    assert_eq!(
        body["meta"]["total"], 9,
        "a default VPC per region plus ours"
    );
    let (_, body) = api.get_answer(&format!("/v2/account/keys/{key_id}")).await;
    assert_eq!(body["ssh_key"]["fingerprint"], json!(fingerprint));
    let (_, body) = api
        .get_answer(&format!("/v2/account/keys/{fingerprint}"))
        .await;
    assert_eq!(body["ssh_key"]["id"], key_id);
    let (status, _) = api.get_answer("/v2/account/keys/1").await;
    assert_eq!(status, 404);
    let (_, body) = api.get_answer("/v2/firewalls").await;
    assert_eq!(body["firewalls"][0]["tags"], json!(["k8s-node"]));
    let (_, body) = api.get_answer("/v2/regions").await;
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
    let r = api.post("/v2/droplets", &create).await;
    assert_eq!(r.status(), 202);
    assert_eq!(emulator.create_bodies(), vec![create.clone()]);
    let id = r.json::<Value>().await.unwrap()["droplet"]["id"]
        .as_u64()
        .unwrap();
    let (_, body) = api.get_answer(&format!("/v2/droplets/{id}")).await;
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
    let (_, recorded) = api.get_answer("/_emulator/create-requests").await;
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
        let r = api.post("/v2/droplets", &body).await;
        assert_eq!(r.status(), 422, "{field} {value}");
        assert_eq!(
            r.json::<Value>().await.unwrap()["id"],
            "unprocessable_entity"
        );
    }

    // The admin seed makes the same resources for a separate process.
    let r = api
        .tokenless(
            reqwest::Method::POST,
            "/_emulator/seed",
            Some(&json!({
                "vpcs": [{"name": "seeded", "region": "nyc3", "ip_range": "10.60.0.0/20"}],
                "snapshots": [{"name": "seeded-snap", "regions": ["nyc3"]}],
                "ssh_keys": ["seeded-key"],
                "firewalls": [{"name": "seeded-fw", "tags": ["x"]}]
            })),
        )
        .await;
    let seeded: Value = r.json().await.unwrap();
    let (status, _) = api
        .get_answer(&format!(
            "/v2/vpcs/{}",
            seeded["vpcs"][0]["id"].as_str().unwrap()
        ))
        .await;
    assert_eq!(status, 200);
    let (status, _) = api
        .get_answer(&format!(
            "/v2/account/keys/{}",
            seeded["ssh_keys"][0]["fingerprint"].as_str().unwrap()
        ))
        .await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn every_deletion_is_an_account_action_listed_newest_first() {
    let (emulator, base, _stop) = start().await;
    let api = Api::new(&base);
    let mut ids = Vec::new();
    for i in 0..3 {
        let body: Value = api
            .post(
                "/v2/droplets",
                &create_body(&format!("d-{i}"), &["bigfleet-managed"]),
            )
            .await
            .json()
            .await
            .unwrap();
        ids.push(body["droplet"]["id"].as_u64().unwrap());
    }
    // Through the API, through the admin endpoint (an operator in the console) and through
    // the library call tests use.
    let r = api.delete(&format!("/v2/droplets/{}", ids[0])).await;
    assert_eq!(r.status(), 204);
    let r = api
        .tokenless(
            reqwest::Method::DELETE,
            &format!("/_emulator/droplets/{}", ids[1]),
            None,
        )
        .await;
    assert_eq!(r.status(), 204);
    assert!(emulator.delete_out_of_band(ids[2]));
    assert!(!emulator.delete_out_of_band(ids[2]), "already gone");

    let page = |n: u32| {
        let api = &api;
        async move {
            api.get_json(&format!("/v2/actions?per_page=4&page={n}"))
                .await
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
    let api = Api::new(&base);
    let sizes = || api.try_call(reqwest::Method::GET, "/v2/sizes", None);
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

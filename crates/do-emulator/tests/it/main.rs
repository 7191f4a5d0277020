//! The emulator over HTTP: authentication, DigitalOcean-shaped answers, pagination, tags, and
//! the fault knobs as the admin endpoints set them.

#![allow(clippy::unwrap_used)]

use do_emulator::Emulator;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

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

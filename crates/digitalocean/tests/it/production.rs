//! Production-shaped Droplets against the emulator over HTTP: per-offering image (slug, id,
//! snapshot name), VPC, extra tags, IPv6, monitoring and login SSH keys resolved once and sent
//! exactly by Create; resolution errors naming offering, field and value; and the `check`
//! subcommand of the binary reporting each broken setting without ever printing a secret.

use std::collections::HashMap;
use std::time::Duration;

use digitalocean::naming::{
    ENROLLMENT_TOKEN_TAG, MANAGED_TAG, booting_tag, machine_tag, provider_tag,
};
use digitalocean::profile::startup;
use digitalocean::profile::{Defaults, OfferingFields, Wanted, offering_fields, plan};
use provider_core::cloud::Cloud;
use provider_core::offerings::Offering;
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::support::*;

fn offering(size: &str) -> Offering {
    Offering {
        instance_type: size.into(),
        zone: REGION.into(),
        capacity_type: String::new(),
        count: 1,
        resources: Default::default(),
        labels: Default::default(),
    }
}

fn wanted(fields: OfferingFields, defaults: Defaults) -> Vec<Wanted> {
    plan(&[offering("s-2vcpu-4gb")], &[fields], &defaults, true).unwrap()
}

fn defaults() -> Defaults {
    Defaults {
        image: "ubuntu-24-04-x64".into(),
        ..Defaults::default()
    }
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

#[tokio::test]
async fn settings_are_resolved_once_and_create_sends_exactly_them() {
    let env = Env::start().await;
    let vpc = env.emulator.add_vpc("prod-nyc3", REGION, "10.40.0.0/20");
    let snapshot = env
        .emulator
        .add_snapshot("k8s-node-1-31", &[REGION, "sfo3"]);
    let (key_id, _) = env.emulator.add_ssh_key("ops");
    let (_, fingerprint) = env.emulator.add_ssh_key("oncall");
    let fields = offering_fields(
        &json!([{
            "size": "s-2vcpu-4gb", "region": REGION,
            "image": "k8s-node-1-31", "tags": ["pool-a"], "monitoring": true,
            "ssh_keys": ["ops", fingerprint.to_uppercase()]
        }])
        .to_string(),
    )
    .unwrap();
    let wanted = wanted(
        fields[0].clone(),
        Defaults {
            vpc_uuid: vpc.clone(),
            tags: vec!["k8s".into()],
            ipv6: true,
            ..defaults()
        },
    );
    let api = api_client(&env.api_url);
    let profiles = startup(&api, &wanted, soon()).await.unwrap();
    let lookups = env.emulator.requests().len();

    let settings = test_settings().with_profiles(profiles);
    let cloud = digitalocean::DigitalOceanCloud::new(
        api_client(&env.api_url),
        env.channel.channel.clone(),
        settings,
        telemetry(),
    );
    let m = machine(0);
    let host = cloud
        .create_host(&m, &ctx(Duration::from_secs(20)))
        .await
        .unwrap();
    let bodies = env.emulator.create_bodies();
    assert_eq!(bodies.len(), 1);
    let body = &bodies[0];
    assert_eq!(
        body["image"],
        json!(snapshot),
        "a snapshot name is sent as its id"
    );
    assert_eq!(body["vpc_uuid"], json!(vpc));
    assert_eq!(body["ipv6"], json!(true));
    assert_eq!(body["monitoring"], json!(true));
    assert_eq!(
        body["ssh_keys"],
        json!([key_id, fingerprint]),
        "a name is sent as its id, a fingerprint as given (lower case)"
    );
    assert_eq!(
        body["tags"],
        json!([
            MANAGED_TAG,
            machine_tag(&m.id),
            provider_tag(PROVIDER),
            booting_tag(PROVIDER),
            ENROLLMENT_TOKEN_TAG,
            "k8s",
            "pool-a"
        ])
    );
    // Creating made no image, VPC or key lookup.
    let after: Vec<String> = env.emulator.requests()[lookups..].to_vec();
    assert!(
        after.iter().all(|r| !r.contains("/v2/images")
            && !r.contains("/v2/vpcs")
            && !r.contains("/v2/account")),
        "{after:?}"
    );
    let droplet = env.emulator.droplet(host.id.parse().unwrap()).unwrap();
    assert_eq!(droplet.vpc_uuid, vpc);
    assert!(droplet.private_ipv4.starts_with("10.40.0."), "{droplet:?}");
    assert!(droplet.public_ipv6.is_some() && droplet.monitoring);
    assert_eq!(droplet.ssh_key_ids.len(), 2);
}

/// Cloud settings with fast polls (the agent is not involved: only Create runs).
fn test_settings() -> digitalocean::cloud::CloudSettings {
    let mut settings = digitalocean::cloud::CloudSettings::new(
        PROVIDER.into(),
        REGION.into(),
        digitalocean::api::ImageRef::parse("ubuntu-24-04-x64"),
        None,
        digitalocean::cloud::AgentProvisioning {
            endpoint: "https://127.0.0.1:1".into(),
            ca_pem: String::new(),
            pinned_cert_pem: String::new(),
            pinned_spki_sha256: String::new(),
        },
    );
    settings.active_poll = Duration::from_millis(20);
    settings.create_backoff = fast_backoff();
    settings
}

#[tokio::test]
async fn without_settings_the_create_body_is_as_before() {
    let env = Env::start().await;
    let api = api_client(&env.api_url);
    let profiles: HashMap<_, _> =
        startup(&api, &wanted(OfferingFields::default(), defaults()), soon())
            .await
            .unwrap();
    assert_eq!(
        profiles["s-2vcpu-4gb"].image,
        digitalocean::api::ImageRef::Slug("ubuntu-24-04-x64".into())
    );
    env.create_host(&machine(1), 20).await;
    let body = &env.emulator.create_bodies()[0];
    assert!(
        body.get("vpc_uuid").is_none() && body.get("ssh_keys").is_none(),
        "{body}"
    );
    assert_eq!(
        (body["ipv6"].clone(), body["monitoring"].clone()),
        (json!(false), json!(false))
    );
    let d = &env.emulator.droplets()[0];
    assert_eq!(Some(d.vpc_uuid.clone()), env.emulator.default_vpc(REGION));
}

#[tokio::test]
async fn resolution_errors_name_offering_field_and_value() {
    let env = Env::start().await;
    let api = api_client(&env.api_url);
    let other_region = env.emulator.add_vpc("prod-ams3", "ams3", "10.50.0.0/20");
    env.emulator.add_snapshot("sfo-only", &["sfo3"]);
    env.emulator.add_snapshot("twice", &[REGION]);
    env.emulator.add_snapshot("twice", &[REGION]);
    let error = |fields: OfferingFields, defaults: Defaults| {
        let api = api.clone();
        async move {
            startup(&api, &wanted(fields, defaults), soon())
                .await
                .unwrap_err()
        }
    };
    let image = |v: &str| OfferingFields {
        image: Some(v.into()),
        ..Default::default()
    };
    let e = error(image("no-such-image"), defaults()).await;
    assert!(
        e.starts_with(
            "offering s-2vcpu-4gb/nyc3 field image \"no-such-image\": no public image has this slug"
        ),
        "{e}"
    );
    let e = error(image("sfo-only"), defaults()).await;
    assert!(
        e.starts_with("offering s-2vcpu-4gb/nyc3 field image \"sfo-only\": image ")
            && e.contains("is not available in region nyc3 (it is in: sfo3)"),
        "{e}"
    );
    let e = error(image("99999"), defaults()).await;
    assert!(
        e.contains("field image \"99999\": no image, snapshot or custom image has this id"),
        "{e}"
    );
    let e = error(image("twice"), defaults()).await;
    assert!(
        e.contains("field image \"twice\": 2 snapshots or custom images have this name"),
        "{e}"
    );
    let e = error(
        OfferingFields::default(),
        Defaults {
            image: "nope".into(),
            ..defaults()
        },
    )
    .await;
    assert!(
        e.starts_with("offering s-2vcpu-4gb/nyc3 --image \"nope\":"),
        "{e}"
    );

    let e = error(
        OfferingFields {
            vpc_uuid: Some(other_region.clone()),
            ..Default::default()
        },
        defaults(),
    )
    .await;
    assert_eq!(
        e,
        format!(
            "offering s-2vcpu-4gb/nyc3 field vpc_uuid \"{other_region}\": VPC \"prod-ams3\" is in region ams3, not in the offering's region nyc3"
        )
    );
    let missing = "00000000-0000-4000-8000-000000000000";
    let e = error(
        OfferingFields::default(),
        Defaults {
            vpc_uuid: missing.into(),
            ..defaults()
        },
    )
    .await;
    assert_eq!(
        e,
        format!("offering s-2vcpu-4gb/nyc3 --vpc-uuid \"{missing}\": no VPC has this id")
    );
    for key in [
        "123",
        "aa:bb:cc:dd:ee:ff:00:11:22:33:44:55:66:77:88:99",
        "nobody",
    ] {
        let e = error(
            OfferingFields::default(),
            Defaults {
                ssh_keys: vec![key.into()],
                ..defaults()
            },
        )
        .await;
        assert!(
            e.starts_with(&format!(
                "offering s-2vcpu-4gb/nyc3 --login-ssh-key \"{key}\": no SSH key"
            )),
            "{e}"
        );
    }
    // A size the API does not sell is no settings problem: its offering is withdrawn by the
    // catalogue (startup refuses only when no offering can be ordered) and has no settings.
    let profiles = startup(
        &api,
        &plan(&[offering("s-99vcpu")], &[], &defaults(), true).unwrap(),
        soon(),
    )
    .await
    .unwrap();
    assert!(profiles.is_empty());
}

/// Runs `digitalocean check --json` with `args`; returns the exit status, the JSON report and
/// the whole output.
async fn run_check(args: &[String], token: &str) -> (bool, Value, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_digitalocean"))
        .arg("check")
        .arg("--json")
        .args(args)
        .env("DIGITALOCEAN_TOKEN", token)
        .env("BIGFLEET_BOOTSTRAP_SECRET", SECRET)
        .env_remove("DIGITALOCEAN_VPC_UUID")
        .env_remove("DIGITALOCEAN_TAGS")
        .env_remove("DIGITALOCEAN_SSH_KEYS")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let all = format!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let doc: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {all}"));
    (out.status.success(), doc, all)
}

/// The check named `name` in the report.
fn check<'a>(doc: &'a Value, name: &str) -> &'a Value {
    testkit::json::entry(doc, "checks", "check", name)
}

fn problems(doc: &Value) -> Vec<(String, String)> {
    doc["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["ok"] == false)
        .map(|c| {
            (
                c["check"].as_str().unwrap().to_owned(),
                c["problem"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

#[tokio::test]
async fn check_reports_each_broken_setting_and_never_a_secret() {
    let env = Env::start().await;
    let vpc = env.emulator.add_vpc("prod-nyc3", REGION, "10.40.0.0/20");
    let ams = env.emulator.add_vpc("prod-ams3", "ams3", "10.50.0.0/20");
    env.emulator.add_snapshot("k8s-node", &[REGION]);
    env.emulator.add_ssh_key("ops");
    env.emulator.add_firewall("k8s-nodes", &["k8s"]);
    let dir = &env.dir;
    let write = |name: &str, body: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, body).unwrap();
        path.display().to_string()
    };
    let cert = write("channel.pem", &env.pki.cert_pem);
    let key = write("channel-key.pem", &env.pki.key_pem);
    let ca = write("ca.pem", &env.pki.ca_pem);
    let good = write(
        "good.json",
        &json!([
            {"size": "s-2vcpu-4gb", "region": REGION, "count": 1, "image": "k8s-node", "tags": ["k8s"], "ssh_keys": ["ops"]},
            {"size": "s-1vcpu-2gb", "region": REGION, "count": 1, "vpc_uuid": vpc}
        ])
        .to_string(),
    );
    let args = |offerings: &str, endpoint: &str| -> Vec<String> {
        vec![
            format!("--region={REGION}"),
            "--image=ubuntu-24-04-x64".into(),
            format!("--do-api-url={}", env.api_url),
            format!("--offerings={offerings}"),
            "--bootstrap-addr=127.0.0.1:9443".into(),
            format!("--bootstrap-endpoint={endpoint}"),
            format!("--bootstrap-tls-cert={cert}"),
            format!("--bootstrap-tls-key={key}"),
            format!("--bootstrap-ca={ca}"),
        ]
    };
    env.emulator
        .insert_droplet("someone-else", "ams3", "s-1vcpu-1gb", &[]);
    let (ok, doc, all) = run_check(&args(&good, "https://127.0.0.1:9443"), API_TOKEN).await;
    assert!(ok, "{all}");
    assert_eq!(doc["problems"], 0);
    let limit = check(&doc, "droplet limit");
    assert_eq!(
        limit["found"],
        "1 of 25 Droplets in use, room for 24 more; the offerings have 2 slots"
    );
    // A sold-out size is named, and a limit with no room for the slots is a problem.
    env.emulator.set_sold_out("s-1vcpu-2gb", REGION, true);
    env.emulator.set_droplet_limit(2);
    let (ok, doc, _) = run_check(&args(&good, "https://127.0.0.1:9443"), API_TOKEN).await;
    assert!(!ok);
    let found = problems(&doc);
    assert!(
        found.iter().any(|(check, problem)| check == "droplet limit"
            && problem.contains("room for 1 more; the offerings have 2 slots: 1 of them")),
        "{found:?}"
    );
    assert!(
        found
            .iter()
            .any(|(check, problem)| check == "offering s-1vcpu-2gb/nyc3 size"
                && problem.contains("is not available in region nyc3")),
        "{found:?}"
    );
    env.emulator.set_sold_out("s-1vcpu-2gb", REGION, false);
    env.emulator.set_droplet_limit(25);
    let firewall = check(&doc, "offering s-2vcpu-4gb/nyc3 firewalls");
    assert!(
        firewall["found"]
            .as_str()
            .unwrap()
            .starts_with("\"k8s-nodes\" (by tag k8s)"),
        "{firewall}"
    );
    assert!(!all.contains(API_TOKEN) && !all.contains(SECRET), "{all}");
    let requests = env.emulator.requests();
    assert!(
        requests.iter().all(|r| r.starts_with("GET ")),
        "check makes read calls only: {requests:?}"
    );

    let broken = write(
        "broken.json",
        &json!([
            {"size": "s-2vcpu-4gb", "region": REGION, "count": 1, "image": "k8s-nod", "ssh_keys": ["opz"]},
            {"size": "s-1vcpu-2gb", "region": REGION, "count": 1, "vpc_uuid": ams},
            {"size": "s-64vcpu-1tb", "region": REGION, "count": 1}
        ])
        .to_string(),
    );
    let (ok, doc, all) = run_check(
        &args(&broken, "https://bootstrap.example.com:9443"),
        API_TOKEN,
    )
    .await;
    assert!(!ok, "{all}");
    let found = problems(&doc);
    let has =
        |check: &str, needle: &str| found.iter().any(|(c, p)| c == check && p.contains(needle));
    assert!(
        has("offering s-2vcpu-4gb/nyc3 image", "field image \"k8s-nod\""),
        "{found:?}"
    );
    assert!(
        has(
            "offering s-2vcpu-4gb/nyc3 ssh_keys \"opz\"",
            "field ssh_keys \"opz\": no SSH key"
        ),
        "{found:?}"
    );
    assert!(
        has(
            "offering s-1vcpu-2gb/nyc3 vpc_uuid",
            &format!("field vpc_uuid \"{ams}\": VPC \"prod-ams3\" is in region ams3")
        ),
        "{found:?}"
    );
    assert!(
        has(
            "offering s-64vcpu-1tb/nyc3 size",
            "size \"s-64vcpu-1tb\" does not exist"
        ),
        "{found:?}"
    );
    assert!(
        has("--bootstrap-endpoint", "\"bootstrap.example.com\""),
        "{found:?}"
    );
    assert!(!all.contains(API_TOKEN) && !all.contains(SECRET), "{all}");

    // An offline mistake is reported as well, naming the field and value.
    let reserved = write(
        "reserved.json",
        &json!([{"size": "s-2vcpu-4gb", "region": REGION, "tags": ["bigfleet-managed"]}])
            .to_string(),
    );
    let (ok, doc, _) = run_check(&args(&reserved, "https://127.0.0.1:9443"), API_TOKEN).await;
    assert!(!ok);
    assert!(
        problems(&doc)
            .iter()
            .any(|(c, p)| c == "--offerings"
                && p.contains("field tags \"bigfleet-managed\": reserved")),
        "{doc}"
    );

    // A wrong token: reported, never shown.
    let wrong = "dop_v1_wrong_token_must_not_be_printed";
    let (ok, doc, all) = run_check(&args(&good, "https://127.0.0.1:9443"), wrong).await;
    assert!(!ok);
    assert!(
        problems(&doc)
            .iter()
            .any(|(c, p)| c == "token" && p.contains("401")),
        "{doc}"
    );
    assert!(!all.contains(wrong) && !all.contains(SECRET), "{all}");
}

#[tokio::test]
async fn startup_fails_on_a_setting_that_does_not_resolve_before_any_port_binds() {
    let env = Env::start().await;
    let write = |name: &str, body: &str| {
        let path = env.dir.path().join(name);
        std::fs::write(&path, body).unwrap();
        path.display().to_string()
    };
    let cert = write("channel.pem", &env.pki.cert_pem);
    let key = write("channel-key.pem", &env.pki.key_pem);
    let offerings = write(
        "offerings.json",
        &json!([{"size": "s-2vcpu-4gb", "region": REGION, "count": 1, "image": "gone-snapshot"}])
            .to_string(),
    );
    let grpc = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = grpc.local_addr().unwrap().port();
    drop(grpc);
    let out = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_digitalocean"))
            .args([
                format!("--region={REGION}"),
                "--image=ubuntu-24-04-x64".into(),
                format!("--do-api-url={}", env.api_url),
                format!("--offerings={offerings}"),
                format!("--addr=127.0.0.1:{port}"),
                "--metrics-addr=".into(),
                "--bootstrap-addr=127.0.0.1:0".into(),
                "--bootstrap-endpoint=https://127.0.0.1:9443".into(),
                format!("--bootstrap-tls-cert={cert}"),
                format!("--bootstrap-tls-key={key}"),
            ])
            .env("DIGITALOCEAN_TOKEN", API_TOKEN)
            .env("BIGFLEET_BOOTSTRAP_SECRET", SECRET)
            .output(),
    )
    .await
    .expect("the provider exits")
    .unwrap();
    assert!(!out.status.success());
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("offering s-2vcpu-4gb/nyc3 field image \"gone-snapshot\": no public image"),
        "{text}"
    );
    assert!(!text.contains("serving CapacityProvider"), "{text}");
    assert!(
        !text.contains(API_TOKEN) && !text.contains(SECRET),
        "{text}"
    );
    assert!(
        env.emulator.create_bodies().is_empty(),
        "nothing was created"
    );
}

/// A startup check that the API only ever rate-limits fails without blaming the token; a token
/// the API refuses is named as the cause.
#[tokio::test]
async fn a_rate_limited_startup_check_does_not_blame_the_token() {
    let env = Env::start().await;
    env.emulator.fail_next(
        1000,
        do_emulator::Fault {
            status: 429,
            retry_after: Some(600),
        },
    );
    let wanted = wanted(OfferingFields::default(), defaults());
    let budget = Instant::now() + Duration::from_secs(1);
    let e = startup(&api_client(&env.api_url), &wanted, budget)
        .await
        .unwrap_err();
    assert!(
        e.starts_with("digitalocean: the API did not answer the startup checks (GET /v2/account)")
            && e.contains("HTTP 429")
            && !e.contains("token"),
        "{e}"
    );

    let env = Env::start().await;
    let wrong = digitalocean::api::ApiClient::new(
        digitalocean::api::parse_base_url(&env.api_url).unwrap(),
        digitalocean::api::ApiToken::new("dop_v1_not_the_emulators_token_0000").unwrap(),
        fast_backoff(),
        telemetry(),
    )
    .unwrap();
    let e = startup(&wrong, &wanted, soon()).await.unwrap_err();
    assert!(
        e.starts_with("digitalocean: the API token does not work (GET /v2/account)")
            && e.contains("HTTP 401"),
        "{e}"
    );
}

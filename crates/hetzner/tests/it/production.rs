//! Production-shaped servers against the emulator over real HTTP: the create request carries
//! exactly the configured image, networks, firewalls, placement group, public-net switches,
//! labels and login keys; names are resolved once; spread groups roll over and empty owned
//! ones are deleted; SSH reaches IPv6-only servers over `[::1]`; `hetzner check` names every
//! broken setting.

use std::collections::{BTreeMap, HashMap};

use hetzner::cloud::SshAddress;
use hetzner::real::RealArgs;
use hetzner::settings::{NetworkRef, OfferingSpec, Overrides, Placement, ServerSpec};
use provider_core::backend::{BootstrapBlob, ConfigureOrder};
use provider_core::check::{CheckOptions, Report};
use provider_core::cloud::Cloud;
use provider_core::machine::StringMap;
use provider_core::offerings::Offering;
use serde_json::json;

use crate::harness::{Env, Options, PROVIDER, TOKEN, bound, ctx};

fn production_spec() -> ServerSpec {
    ServerSpec {
        image: String::new(),
        image_selector: "k8s-version=1.31,role=node".into(),
        networks: vec![
            NetworkRef::parse("bigfleet-mgmt=10.0.1.0/24").unwrap(),
            NetworkRef::parse("bigfleet-storage").unwrap(),
        ],
        firewalls: vec!["bigfleet-nodes".into(), "7002".into()],
        public_ipv4: false,
        public_ipv6: true,
        ssh_address: SshAddress::Private,
        placement: Placement::Spread,
        labels: BTreeMap::from([("team".to_owned(), "core".to_owned())]),
        login_keys: vec!["ops-alice".into(), "5002".into()],
    }
}

fn offering_spec(server_type: &str, location: &str, spec: ServerSpec) -> OfferingSpec {
    OfferingSpec {
        server_type: server_type.into(),
        location: location.into(),
        spec,
        overrides: Overrides::default(),
    }
}

#[tokio::test]
async fn the_create_request_carries_exactly_the_configured_settings() {
    let env = Env::new(Options {
        offerings: vec![offering_spec("cx23", "nbg1", production_spec())],
        ..Options::default()
    })
    .await;
    env.cloud.resolve().await.unwrap();
    let resolving = env.emulator.seen().len();
    let host = env.create_host(&env.machine("cx23", "nbg1", 0), 20).await;
    let bodies = env.emulator.create_bodies();
    assert_eq!(bodies.len(), 1);
    let body = &bodies[0];
    let group = env.emulator.placement_groups()[0].id;
    assert_eq!(
        body["image"], "3002",
        "the newest x86 snapshot matching the selector"
    );
    assert_eq!(body["networks"], json!([9002]));
    assert_eq!(
        body["firewalls"],
        json!([{"firewall": 7001}, {"firewall": 7002}])
    );
    assert_eq!(body["placement_group"], json!(group));
    assert_eq!(
        body["public_net"],
        json!({"enable_ipv4": false, "enable_ipv6": true})
    );
    assert_eq!(body["ssh_keys"], json!(["5001", "5002"]));
    assert_eq!(body["location"], "nbg1");
    assert_eq!(body["server_type"], "cx23");
    let labels = body["labels"].as_object().unwrap();
    assert_eq!(labels["team"], "core");
    assert_eq!(labels["bigfleet-managed"], "true");
    assert_eq!(labels["bigfleet-provider"], PROVIDER);
    // The subnet network is joined after create, in the chosen subnet.
    let server = env.emulator.server(host.id.parse().unwrap()).unwrap();
    let mgmt = server
        .private_net
        .iter()
        .find(|p| p.network == Some(9001))
        .expect("joined bigfleet-mgmt");
    assert!(
        mgmt.ip.as_deref().unwrap().starts_with("10.0.1."),
        "{mgmt:?}"
    );
    assert!(server.private_net.iter().any(|p| p.network == Some(9002)));
    assert!(server.public_net.ipv4.is_none());
    assert!(server.public_net.ipv6.is_some());
    // A second create resolves nothing again.
    env.create_host(&env.machine("cx23", "nbg1", 1), 20).await;
    let lookups: Vec<String> = env.emulator.seen()[resolving..]
        .iter()
        .map(|s| s.path.clone())
        .filter(|p| {
            [
                "/images",
                "/networks",
                "/firewalls",
                "/ssh_keys",
                "/server_types",
                "/locations",
            ]
            .iter()
            .any(|r| p.starts_with(r))
        })
        .collect();
    assert!(lookups.is_empty(), "names resolved per Create: {lookups:?}");
}

#[tokio::test]
async fn spread_groups_roll_over_at_the_limit_and_empty_owned_ones_are_deleted() {
    let env = Env::new(Options {
        offerings: vec![offering_spec(
            "cx23",
            "nbg1",
            ServerSpec {
                image: "ubuntu-24.04".into(),
                placement: Placement::Spread,
                ..ServerSpec::default()
            },
        )],
        ..Options::default()
    })
    .await;
    env.emulator.set_placement_group_limit(2);
    let foreign = env.emulator.insert_placement_group(
        "someone-elses",
        HashMap::from([("bigfleet-managed".to_owned(), "true".to_owned())]),
    );
    let mut hosts = Vec::new();
    for i in 0..3 {
        let host = env.create_host(&env.machine("cx23", "nbg1", i), 20).await;
        hosts.push(host.id);
    }
    let groups = env.emulator.placement_groups();
    let mut sizes: Vec<usize> = groups
        .iter()
        .filter(|g| g.id != foreign)
        .map(|g| g.servers.len())
        .collect();
    sizes.sort();
    assert_eq!(sizes, vec![1, 2], "{groups:?}");
    assert!(
        env.emulator.count_status(422).ge(&1),
        "the full group was answered with {}",
        hetzner::placement::GROUP_FULL
    );
    for host in &hosts {
        env.cloud.delete_host(host, &ctx(20)).await.unwrap();
    }
    let left: Vec<i64> = env
        .emulator
        .placement_groups()
        .iter()
        .map(|g| g.id)
        .collect();
    assert_eq!(left, vec![foreign], "only the foreign group is left");
}

#[tokio::test]
async fn ipv6_only_servers_are_configured_over_ipv6() {
    let mut env = Env::new(Options {
        offerings: vec![offering_spec(
            "cx23",
            "nbg1",
            ServerSpec {
                image: "ubuntu-24.04".into(),
                public_ipv4: false,
                ssh_address: SshAddress::Ipv6,
                ..ServerSpec::default()
            },
        )],
        ..Options::default()
    })
    .await;
    env.emulator.set_new_server_ipv6_net("::/64");
    let machine = env.machine("cx23", "nbg1", 0);
    let host = env.create_host(&machine, 20).await;
    let machine = bound(machine, &host.id);
    assert_eq!(host.public_ipv4, None);
    env.listen_on_ipv6().await;
    let sshd = env.start_emulator_sshd();
    let order = ConfigureOrder {
        cluster_id: "c6".into(),
        blob: BootstrapBlob(b"ipv6-blob".to_vec()),
    };
    // The harness's hook is an absolute path: it runs whatever the server's root.
    env.cloud
        .configure_host(&machine, &host.id, &order, &ctx(15))
        .await
        .unwrap();
    assert_eq!(env.hook_args().as_deref(), Some("c6\n"));
    assert!(sshd.addr().is_ipv6());
    assert_eq!(
        sshd.observed
            .authenticated
            .load(std::sync::atomic::Ordering::SeqCst),
        1
    );
}

#[tokio::test]
async fn an_image_selector_without_an_image_for_the_architecture_is_refused_before_any_create() {
    let env = Env::new(Options {
        offerings: vec![offering_spec(
            "cax11",
            "fsn1",
            ServerSpec {
                image_selector: "k8s-version=1.31,role=node".into(),
                ..ServerSpec::default()
            },
        )],
        ..Options::default()
    })
    .await;
    let err = env.cloud.resolve().await.unwrap_err();
    assert!(
        err.contains("offering cax11/fsn1 --image-selector \"k8s-version=1.31,role=node\": no available image or snapshot matches it for architecture arm"),
        "{err}"
    );
    assert_eq!(env.emulator.count("POST", "/servers"), 0);
}

fn check_args(endpoint: String, token: &str) -> RealArgs {
    RealArgs {
        provider: PROVIDER.into(),
        image: String::new(),
        image_selector: "k8s-version=1.31,role=node".into(),
        networks: vec!["bigfleet-mgmt=10.0.1.0/24".into()],
        firewalls: vec!["bigfleet-nodes".into()],
        public_ipv4: false,
        ssh_address: "private".into(),
        placement: "spread".into(),
        server_labels: vec!["team=core".into()],
        login_ssh_keys: vec!["ops-alice".into()],
        ..crate::harness::real_args(&endpoint, token)
    }
}

fn offering(server_type: &str, location: &str) -> Offering {
    Offering {
        instance_type: server_type.into(),
        zone: location.into(),
        capacity_type: String::new(),
        count: 1,
        resources: StringMap::new(),
        labels: StringMap::new(),
    }
}

#[tokio::test]
async fn check_passes_a_working_configuration_and_names_each_broken_setting() {
    let env = Env::new(Options::default()).await;
    let key = env.dir.path().join("id_ed25519");
    std::fs::write(
        &key,
        env.client_key
            .to_openssh(russh::keys::ssh_key::LineEnding::LF)
            .unwrap()
            .as_bytes(),
    )
    .unwrap();
    let mut good = check_args(env.emulator.endpoint(), TOKEN);
    good.ssh_key = key.display().to_string();
    let mut report = Report::quiet(CheckOptions::default());
    hetzner::check::run(&mut report, &good, &[offering("cx23", "nbg1")]).await;
    assert!(report.passed(), "{}", report.render());
    let rendered = report.render();
    let headroom = rendered
        .lines()
        .find(|l| l.contains("server limit"))
        .unwrap_or_else(|| panic!("{rendered}"));
    assert!(
        headroom.contains("0 servers in the project, headroom unknown")
            && headroom.contains("the offerings have"),
        "{headroom}"
    );
    assert_eq!(env.emulator.count("POST", "/servers"), 0);
    assert!(
        env.emulator.seen().iter().all(|s| s.method == "GET"),
        "check only reads"
    );

    let overrides = hetzner::settings::parse_overrides(
        r#"[{"server_type":"cax11","location":"fsn1","image_selector":"role=node,k8s-version=1.31"},
            {"server_type":"cx23","location":"nbg1","networks":["nope","bigfleet-mgmt=10.9.0.0/24"],
             "firewalls":["bigfleet-nodes","no-such-fw"],"login_ssh_keys":["ops-carol"]},
            {"server_type":"cx99","location":"nbg1"},
            {"server_type":"cx33","location":"ams9"},
            {"server_type":"cpx12","location":"fsn1","ssh_address":"public"}]"#,
    )
    .unwrap();
    let broken = RealArgs {
        overrides,
        ..good.clone()
    };
    let offerings = [
        offering("cax11", "fsn1"),
        offering("cx23", "nbg1"),
        offering("cx99", "nbg1"),
        offering("cx33", "ams9"),
        offering("cpx12", "fsn1"),
    ];
    let mut report = Report::quiet(CheckOptions::default());
    hetzner::check::run(&mut report, &broken, &offerings).await;
    let text = report.render();
    let problems = report.problems();
    let find = |check: &str| {
        problems
            .iter()
            .find(|(c, _)| *c == check)
            .map(|(_, p)| p.to_string())
            .unwrap_or_else(|| panic!("no problem {check:?} in:\n{text}"))
    };
    assert!(find("offering cax11/fsn1 image").contains("field \"image_selector\" \"role=node,k8s-version=1.31\": no available image or snapshot matches it for architecture arm"));
    let networks = find("offering cx23/nbg1 networks");
    assert!(
        networks.contains("network \"nope\" does not exist"),
        "{networks}"
    );
    assert!(
        networks.contains("network \"bigfleet-mgmt\" has no subnet 10.9.0.0/24"),
        "{networks}"
    );
    assert!(
        find("offering cx23/nbg1 firewalls").contains("firewall \"no-such-fw\" does not exist")
    );
    assert!(
        find("offering cx23/nbg1 login_ssh_keys").contains("SSH key \"ops-carol\" does not exist")
    );
    assert!(find("offering cx99/nbg1 server_type").contains("\"cx99\" does not exist"));
    assert!(find("offering cx33/ams9 location").contains("\"ams9\" does not exist"));
    assert!(find("offering cpx12/fsn1 ssh_address").contains("needs a public IPv4"));
    env.emulator.withdraw_server_type("cx23", "nbg1");
    let mut report = Report::quiet(CheckOptions::default());
    hetzner::check::run(&mut report, &good, &[offering("cx23", "nbg1")]).await;
    assert!(
        report.problems()[0]
            .1
            .contains("server type cx23 is not sold in location nbg1: withdrawn"),
        "{}",
        report.render()
    );

    let mut report = Report::quiet(CheckOptions { json: true });
    hetzner::check::run(
        &mut report,
        &check_args(env.emulator.endpoint(), "wrong-secret-token-77"),
        &[offering("cx23", "nbg1")],
    )
    .await;
    let text = report.render();
    assert!(text.contains("rejected the token"), "{text}");
    assert!(!text.contains("wrong-secret-token-77"), "{text}");
    assert!(!text.contains(TOKEN), "{text}");
}

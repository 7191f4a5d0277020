//! The emulator against the `hcloud` crate's own generated API functions: every response must
//! parse exactly as the crate parses Hetzner's, and the emulator must behave like the API
//! where the provider depends on it (selectors, pagination, uniqueness, errors, auth).

// Test code: a panic is the failure report we want.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::time::Duration;

use hcloud::apis::configuration::Configuration;
use hcloud::apis::{Error, images_api, locations_api, networks_api, server_types_api, servers_api};
use hcloud::models;
use hcloud_emulator::{Emulator, Fault};

mod spec_shape;

const TOKEN: &str = "emulator-it-token";

fn config(emulator: &Emulator, token: &str) -> Configuration {
    let mut config = Configuration::new();
    // Straight to the emulator, whatever proxy the environment names.
    config.client = reqwest::Client::builder().no_proxy().build().unwrap();
    config
        .base_path_mapping
        .insert("https://api.hetzner.cloud/v1".into(), emulator.endpoint());
    config.bearer_access_token = Some(token.into());
    config
}

fn create_request(
    name: &str,
    server_type: &str,
    labels: &[(&str, &str)],
) -> servers_api::CreateServerParams {
    servers_api::CreateServerParams {
        create_server_request: models::CreateServerRequest {
            name: name.into(),
            server_type: server_type.into(),
            image: "ubuntu-24.04".into(),
            location: Some("nbg1".into()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| ((*k).into(), (*v).into()))
                    .collect(),
            ),
            user_data: Some("#cloud-config\n".into()),
            ..Default::default()
        },
    }
}

#[tokio::test]
async fn servers_round_trip_through_the_generated_client() {
    let emulator = Emulator::start(TOKEN).await.unwrap();
    let c = config(&emulator, TOKEN);
    let created = servers_api::create_server(
        &c,
        create_request("web-1", "cx23", &[("role", "web"), ("env", "prod")]),
    )
    .await
    .unwrap();
    assert_eq!(created.server.name, "web-1");
    assert_eq!(created.server.status, models::server::Status::Initializing);
    assert_eq!(created.server.server_type.name, "cx23");
    assert_eq!(created.server.location.name, "nbg1");
    assert!(created.server.public_net.ipv4.is_some());
    servers_api::create_server(
        &c,
        create_request("db-1", "cax11", &[("role", "db"), ("env", "prod")]),
    )
    .await
    .unwrap();
    servers_api::create_server(
        &c,
        create_request("web-2", "cx23", &[("role", "web"), ("env", "dev")]),
    )
    .await
    .unwrap();

    // The names of the servers `selector` selects, sorted.
    let selected = |selector: &str| {
        let params = servers_api::ListServersParams {
            label_selector: Some(selector.into()),
            ..Default::default()
        };
        let c = &c;
        async move {
            let listed = servers_api::list_servers(c, params).await.unwrap();
            let mut names: Vec<String> = listed.servers.into_iter().map(|s| s.name).collect();
            names.sort();
            names
        }
    };
    assert_eq!(selected("role=web").await, ["web-1", "web-2"]);
    assert_eq!(selected("role=web,env!=dev").await, ["web-1"]);
    assert_eq!(selected("env in (dev,test)").await, ["web-2"]);
    assert_eq!(selected("!role").await, Vec::<String>::new());

    // The server reaches running on the next read, then its labels can be replaced.
    let id = created.server.id;
    let got = servers_api::get_server(&c, servers_api::GetServerParams { id })
        .await
        .unwrap();
    assert_eq!(got.server.unwrap().status, models::server::Status::Running);
    let replaced = servers_api::replace_server(
        &c,
        servers_api::ReplaceServerParams {
            id,
            replace_server_request: models::ReplaceServerRequest {
                labels: Some(HashMap::from([("role".into(), "api".into())])),
                name: None,
            },
        },
    )
    .await
    .unwrap();
    assert_eq!(replaced.server.unwrap().labels["role"], "api");

    let deleted = servers_api::delete_server(&c, servers_api::DeleteServerParams { id })
        .await
        .unwrap();
    assert_eq!(deleted.action.unwrap().command, "delete_server");
    let gone = servers_api::get_server(&c, servers_api::GetServerParams { id })
        .await
        .unwrap_err();
    let Error::ResponseError(content) = gone else {
        panic!("expected an HTTP error")
    };
    assert_eq!(content.status.as_u16(), 404);
    assert!(content.content.contains("\"code\":\"not_found\""));
}

#[tokio::test]
async fn pagination_metadata_matches_the_api() {
    let emulator = Emulator::start(TOKEN).await.unwrap();
    emulator.set_max_per_page(2);
    let c = config(&emulator, TOKEN);
    for i in 0..5 {
        servers_api::create_server(&c, create_request(&format!("s-{i}"), "cx23", &[]))
            .await
            .unwrap();
    }
    let mut seen = Vec::new();
    let mut page = Some(1);
    while let Some(p) = page {
        let r = servers_api::list_servers(
            &c,
            servers_api::ListServersParams {
                page: Some(p),
                per_page: Some(50),
                ..Default::default()
            },
        )
        .await
        .unwrap();
        assert_eq!(r.meta.pagination.per_page, 2, "per_page is capped");
        assert_eq!(r.meta.pagination.total_entries, Some(5));
        assert_eq!(r.meta.pagination.last_page, Some(3));
        seen.extend(r.servers.into_iter().map(|s| s.name));
        page = r.meta.pagination.next_page;
    }
    assert_eq!(seen, ["s-0", "s-1", "s-2", "s-3", "s-4"]);
}

#[tokio::test]
async fn catalogue_endpoints_parse() {
    let emulator = Emulator::start(TOKEN).await.unwrap();
    let c = config(&emulator, TOKEN);
    let types = server_types_api::list_server_types(
        &c,
        server_types_api::ListServerTypesParams {
            name: Some("cax11".into()),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(types.server_types.len(), 1);
    let cax = &types.server_types[0];
    assert_eq!(cax.architecture, models::Architecture::Arm);
    let nbg = cax.prices.iter().find(|p| p.location == "nbg1").unwrap();
    assert_eq!(nbg.price_hourly.net.parse::<f64>().unwrap(), 0.0065);
    assert!(
        nbg.price_hourly.gross.parse::<f64>().unwrap() > 0.0065,
        "gross includes VAT"
    );

    let images = images_api::list_images(
        &c,
        images_api::ListImagesParams {
            name: Some("ubuntu-24.04".into()),
            architecture: Some("arm".into()),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(images.images.len(), 1);
    assert_eq!(images.images[0].architecture, models::Architecture::Arm);

    let locations =
        locations_api::list_locations(&c, locations_api::ListLocationsParams::default())
            .await
            .unwrap();
    let mut names: Vec<String> = locations.locations.into_iter().map(|l| l.name).collect();
    names.sort();
    assert_eq!(names, ["fsn1", "hel1", "nbg1"]);

    let networks = networks_api::list_networks(
        &c,
        networks_api::ListNetworksParams {
            name: Some("bigfleet-mgmt".into()),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(networks.networks[0].id, 9001);
}

#[tokio::test]
async fn errors_come_in_hetzners_format() {
    let emulator = Emulator::start(TOKEN).await.unwrap();
    let c = config(&emulator, TOKEN);
    let entity = |e: Error<servers_api::CreateServerError>| match e {
        Error::ResponseError(content) => match content.entity {
            Some(servers_api::CreateServerError::DefaultResponse(body)) => {
                (content.status.as_u16(), body.error.code)
            }
            other => panic!("unparsed error body: {other:?} / {}", content.content),
        },
        other => panic!("expected an HTTP error, got {other}"),
    };

    let wrong = config(&emulator, "not-the-token");
    let e = servers_api::create_server(&wrong, create_request("x", "cx23", &[]))
        .await
        .unwrap_err();
    assert_eq!(entity(e), (401, "unauthorized".into()));

    servers_api::create_server(&c, create_request("dup", "cx23", &[]))
        .await
        .unwrap();
    let e = servers_api::create_server(&c, create_request("dup", "cx23", &[]))
        .await
        .unwrap_err();
    assert_eq!(entity(e), (409, "uniqueness_error".into()));

    let e = servers_api::create_server(&c, create_request("bad-label", "cx23", &[("k", "-bad-")]))
        .await
        .unwrap_err();
    assert_eq!(entity(e), (422, "invalid_input".into()));

    let e = servers_api::create_server(&c, create_request("nope", "cx99", &[]))
        .await
        .unwrap_err();
    assert_eq!(entity(e), (422, "invalid_input".into()));

    emulator.inject([Fault::RateLimited {
        retry_after: Some(3),
        reset_in: None,
    }]);
    let e = servers_api::create_server(&c, create_request("later", "cx23", &[]))
        .await
        .unwrap_err();
    assert_eq!(entity(e), (429, "rate_limit_exceeded".into()));
    assert_eq!(emulator.count_status(429), 1);
    assert!(
        emulator
            .seen()
            .iter()
            .filter(|s| s.path == "/servers")
            .all(|s| s.method == "POST")
    );
    assert!(!emulator.seen()[0].authorized && emulator.seen()[1].authorized);
}

#[tokio::test]
async fn production_resources_round_trip_through_the_generated_client() {
    use hcloud::apis::{firewalls_api, placement_groups_api, ssh_keys_api};
    let emulator = Emulator::start(TOKEN).await.unwrap();
    emulator.set_placement_group_limit(1);
    let c = config(&emulator, TOKEN);
    // Images by label selector: only the matching snapshots.
    let images = images_api::list_images(
        &c,
        images_api::ListImagesParams {
            label_selector: Some("k8s-version=1.31,role=node".into()),
            r#type: Some(vec!["snapshot".into()]),
            ..Default::default()
        },
    )
    .await
    .unwrap()
    .images;
    let mut ids: Vec<i64> = images.iter().map(|i| i.id).collect();
    ids.sort();
    assert_eq!(ids, vec![3001, 3002]);
    assert!(
        images
            .iter()
            .all(|i| i.r#type == models::image::Type::Snapshot)
    );
    // Firewalls and SSH keys by name and id.
    let fw = firewalls_api::list_firewalls(
        &c,
        firewalls_api::ListFirewallsParams {
            name: Some("bigfleet-nodes".into()),
            ..Default::default()
        },
    )
    .await
    .unwrap()
    .firewalls;
    assert_eq!(fw[0].id, 7001);
    let key = ssh_keys_api::get_ssh_key(&c, ssh_keys_api::GetSshKeyParams { id: 5002 })
        .await
        .unwrap()
        .ssh_key;
    assert_eq!(key.name, "ops-bob");
    // A spread group, a server in it, and the full group's answer.
    let group = placement_groups_api::create_placementgroup(
        &c,
        placement_groups_api::CreatePlacementgroupParams {
            create_placementgroup_request: models::CreatePlacementgroupRequest {
                name: "spread-1".into(),
                labels: Some(HashMap::from([("owner".into(), "it".into())])),
                r#type: models::create_placementgroup_request::Type::Spread,
            },
        },
    )
    .await
    .unwrap()
    .placement_group;
    let mut request = create_request("pg-1", "cx23", &[]);
    request.create_server_request.placement_group = Some(group.id);
    request.create_server_request.firewalls = Some(vec![models::CreateServerRequestFirewalls {
        firewall: 7001,
    }]);
    request.create_server_request.ssh_keys = Some(vec!["ops-alice".into(), "5002".into()]);
    request.create_server_request.networks = Some(vec![9002]);
    request.create_server_request.public_net =
        Some(Box::new(models::CreateServerRequestPublicNet {
            enable_ipv4: Some(false),
            enable_ipv6: Some(true),
            ipv4: None,
            ipv6: None,
        }));
    let server = servers_api::create_server(&c, request)
        .await
        .unwrap()
        .server;
    assert!(server.public_net.ipv4.is_none());
    assert!(
        server
            .public_net
            .ipv6
            .as_ref()
            .unwrap()
            .ip
            .ends_with("::/64")
    );
    assert_eq!(
        server.public_net.firewalls.as_ref().unwrap()[0].id,
        Some(7001)
    );
    assert_eq!(
        server
            .placement_group
            .as_ref()
            .unwrap()
            .as_ref()
            .unwrap()
            .id,
        group.id
    );
    assert_eq!(emulator.create_bodies()[0]["ssh_keys"][1], "5002");
    let mut second = create_request("pg-2", "cx23", &[]);
    second.create_server_request.placement_group = Some(group.id);
    match servers_api::create_server(&c, second).await {
        Err(Error::ResponseError(r)) => {
            assert_eq!(r.status.as_u16(), 422);
            assert!(
                r.content.contains(hcloud_emulator::GROUP_FULL),
                "{}",
                r.content
            );
        }
        other => panic!("want the full-group error, got {other:?}"),
    }
    // Subnet placement after create.
    servers_api::attach_server_to_network(
        &c,
        servers_api::AttachServerToNetworkParams {
            id: server.id,
            attach_server_to_network_request: models::AttachServerToNetworkRequest {
                network: 9001,
                ip_range: Some("10.0.1.0/24".into()),
                ..Default::default()
            },
        },
    )
    .await
    .unwrap();
    let stored = emulator.server(server.id).unwrap();
    let mgmt = stored
        .private_net
        .iter()
        .find(|p| p.network == Some(9001))
        .unwrap();
    assert!(mgmt.ip.as_deref().unwrap().starts_with("10.0.1."));
    // A group with a server cannot go; an empty one can.
    assert!(
        placement_groups_api::delete_placementgroup(
            &c,
            placement_groups_api::DeletePlacementgroupParams { id: group.id }
        )
        .await
        .is_err()
    );
    servers_api::delete_server(&c, servers_api::DeleteServerParams { id: server.id })
        .await
        .unwrap();
    placement_groups_api::delete_placementgroup(
        &c,
        placement_groups_api::DeletePlacementgroupParams { id: group.id },
    )
    .await
    .unwrap();
    assert!(emulator.placement_groups().is_empty());
}

#[tokio::test]
async fn an_outage_fails_every_request_while_it_lasts_and_none_after() {
    let emulator = Emulator::start(TOKEN).await.unwrap();
    let c = config(&emulator, TOKEN);
    emulator.inject_for(Duration::from_millis(400), Fault::ServerError(503));
    // However many requests come while it lasts, each meets the outage.
    for _ in 0..5 {
        match server_types_api::list_server_types(&c, Default::default()).await {
            Err(Error::ResponseError(content)) => assert_eq!(content.status.as_u16(), 503),
            other => panic!("a request during the outage: {other:?}"),
        }
    }
    assert_eq!(emulator.pending_faults(), 0, "an outage queues nothing");
    tokio::time::sleep(Duration::from_millis(450)).await;
    server_types_api::list_server_types(&c, Default::default())
        .await
        .unwrap();
    assert_eq!(emulator.count_status(503), 5);
}

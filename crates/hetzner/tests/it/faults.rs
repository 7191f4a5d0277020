//! API faults: lost and slow Create responses, name collisions, rate-limit storms, 5xx,
//! pagination, out-of-band deletion, and the token staying secret throughout.

use std::collections::HashMap;
use std::time::Duration;

use hcloud_emulator::{CreateFault, Fault};
use hetzner::labels;
use provider_core::cloud::Cloud;

use crate::harness::{Env, Options, PROVIDER, TOKEN, ctx};

fn owned_labels(machine_id: &str, provider: &str) -> HashMap<String, String> {
    let mut l: HashMap<String, String> = HashMap::from([(labels::MANAGED.into(), "true".into())]);
    l.extend(labels::machine_id_labels(machine_id));
    l.extend(labels::text_labels(labels::PROVIDER, provider));
    l
}

#[tokio::test]
async fn a_lost_create_response_is_resolved_by_lookup_not_a_second_server() {
    let env = Env::new(Options::default()).await;
    env.emulator.inject_create([CreateFault::LoseResponse]);
    let machine = env.machine("cx23", "nbg1", 0);
    let host = env.create_host(&machine, 30).await;
    assert_eq!(env.emulator.servers().len(), 1);
    assert_eq!(host.id, env.emulator.servers()[0].id.to_string());
    assert_eq!(
        env.emulator.count("POST", "/servers"),
        1,
        "the ambiguous POST was not repeated"
    );
    // The engine retrying the whole Create finds the same server.
    let again = env.create_host(&machine, 30).await;
    assert_eq!(again.id, host.id);
    assert_eq!(env.emulator.servers().len(), 1);
    assert_eq!(env.emulator.count("POST", "/servers"), 1);
}

#[tokio::test]
async fn a_create_that_times_out_makes_no_second_server() {
    let env = Env::new(Options {
        request_timeout: Duration::from_millis(300),
        ..Options::default()
    })
    .await;
    env.emulator
        .inject_create([CreateFault::Hang(Duration::from_secs(3))]);
    let machine = env.machine("cx23", "nbg1", 1);
    let host = env.create_host(&machine, 30).await;
    let servers = env.emulator.servers();
    assert_eq!(servers.len(), 1);
    assert_eq!(host.id, servers[0].id.to_string());
    assert_eq!(
        labels::machine_id_of(&servers[0].labels).as_deref(),
        Some(machine.id.as_str())
    );
}

#[tokio::test]
async fn a_name_taken_by_someone_else_is_never_adopted() {
    let env = Env::new(Options::default()).await;
    let machine = env.machine("cx23", "nbg1", 0);
    // Same name, but the labels belong to another provider instance.
    let foreign = env.emulator.insert_server(
        &labels::server_name(&machine.id),
        "cx23",
        "nbg1",
        owned_labels(&machine.id, "someone-else"),
        "127.0.0.1",
    );
    let err = env.create_fails(&machine, 10).await;
    assert!(
        err.0.contains(&format!(
            "is taken by server {foreign} that is not labelled"
        )),
        "{}",
        err.0
    );
    assert!(err.0.contains("refusing to adopt it"), "{}", err.0);
    assert_eq!(env.emulator.servers().len(), 1);
    // And it is not reported, configured or deleted by us.
    assert!(env.cloud.list_hosts().await.unwrap().is_empty());
    let err = env
        .cloud
        .delete_host(&foreign.to_string(), &ctx(10))
        .await
        .unwrap_err();
    assert!(err.0.contains("refusing to delete it"), "{}", err.0);
    assert!(env.emulator.server(foreign).is_some());
}

#[tokio::test]
async fn rate_limit_storms_are_waited_out_and_counted() {
    let env = Env::new(Options {
        telemetry_prefix: "bigfleet_hetzner_it_storm",
        ..Options::default()
    })
    .await;
    let metrics = provider_core::telemetry::recorder();
    env.emulator.inject([
        Fault::RateLimited {
            retry_after: Some(0),
            reset_in: None,
        },
        Fault::RateLimited {
            retry_after: Some(0),
            reset_in: None,
        },
        Fault::RateLimited {
            retry_after: None,
            reset_in: Some(1),
        },
        Fault::ServerError(503),
        Fault::RateLimited {
            retry_after: Some(0),
            reset_in: None,
        },
    ]);
    let price = env.cloud.price_usd("cx23", "nbg1").await.unwrap();
    assert!(price > 0.0);
    assert_eq!(env.emulator.count_status(429), 4);
    assert_eq!(env.emulator.count_status(503), 1);
    let rendered = metrics.render();
    let line = |needle: &str| {
        rendered
            .lines()
            .find(|l| l.starts_with(needle) && !l.starts_with('#'))
            .map(str::to_owned)
    };
    let http429 = line(
        "bigfleet_hetzner_it_storm_api_http_requests_total{endpoint=\"GET /server_types\",status=\"429\"}",
    );
    assert_eq!(
        http429.as_deref().and_then(|l| l.rsplit(' ').next()),
        Some("4"),
        "{rendered}"
    );
    let ok = line(
        "bigfleet_hetzner_it_storm_api_calls_total{op=\"ServerTypePricing\",outcome=\"success\"}",
    );
    assert_eq!(
        ok.as_deref().and_then(|l| l.rsplit(' ').next()),
        Some("1"),
        "{rendered}"
    );
    env.assert_token_not_logged();
}

#[tokio::test]
async fn a_storm_longer_than_the_budget_fails_instead_of_hanging() {
    let env = Env::new(Options::default()).await;
    env.emulator
        .inject((0..20).map(|_| Fault::ServerError(502)));
    let err = env.cloud.price_usd("cx23", "nbg1").await.unwrap_err();
    assert!(err.0.contains("HTTP 502"), "{}", err.0);
    assert_eq!(
        env.emulator.count_status(502),
        8,
        "gave up after the configured attempts"
    );
}

#[tokio::test]
async fn inventory_follows_pagination_and_keeps_to_its_own_servers() {
    let env = Env::new(Options::default()).await;
    env.emulator.set_max_per_page(2);
    let mut ours = Vec::new();
    for i in 0..5 {
        let host = env.create_host(&env.machine("cx23", "nbg1", i), 30).await;
        ours.push(host.id);
    }
    // Someone else's servers: another provider instance, a location we do not serve, and an
    // unmanaged server.
    env.emulator.insert_server(
        "other",
        "cx23",
        "nbg1",
        owned_labels("x/OnDemand/cx23/nbg1/000", "other"),
        "10.0.0.1",
    );
    env.emulator.insert_server(
        "far",
        "cx23",
        "hel1",
        owned_labels(&format!("{PROVIDER}/OnDemand/cx23/hel1/000"), PROVIDER),
        "10.0.0.2",
    );
    env.emulator
        .insert_server("plain", "cx23", "nbg1", HashMap::new(), "10.0.0.3");
    // A failed page is retried, never skipped.
    env.emulator.inject([Fault::ServerError(503)]);
    let mut listed: Vec<String> = env
        .cloud
        .list_hosts()
        .await
        .unwrap()
        .into_iter()
        .map(|h| h.id)
        .collect();
    listed.sort();
    ours.sort();
    assert_eq!(listed, ours);
    let pages = env
        .emulator
        .seen()
        .iter()
        .filter(|s| {
            s.path == "/servers" && s.method == "GET" && s.query.contains("bigfleet-provider")
        })
        .count();
    assert!(pages >= 3, "followed every page ({pages} requests)");

    // A page that keeps failing fails the listing: never a short inventory.
    env.emulator
        .inject((0..20).map(|_| Fault::ServerError(500)));
    assert!(env.cloud.list_hosts().await.is_err());
}

#[tokio::test]
async fn servers_deleted_out_of_band_or_being_deleted_leave_the_inventory() {
    let env = Env::new(Options::default()).await;
    let a = env.create_host(&env.machine("cx23", "nbg1", 0), 30).await;
    let b = env.create_host(&env.machine("cx23", "nbg1", 1), 30).await;
    assert_eq!(env.cloud.list_hosts().await.unwrap().len(), 2);

    assert!(env.emulator.delete_out_of_band(a.id.parse().unwrap()));
    let hosts = env.cloud.list_hosts().await.unwrap();
    assert_eq!(
        hosts.iter().map(|h| h.id.clone()).collect::<Vec<_>>(),
        vec![b.id.clone()]
    );
    env.cloud.delete_host(&a.id, &ctx(10)).await.unwrap();

    env.emulator.set_deleting_reads(5);
    env.cloud.delete_host(&b.id, &ctx(10)).await.unwrap();
    assert!(
        env.emulator.server(b.id.parse().unwrap()).is_some(),
        "still deleting"
    );
    assert!(env.cloud.list_hosts().await.unwrap().is_empty());
}

/// A backend of `env`'s emulator without SSH, authenticating with `token`, with `timing`.
fn cloud_without_ssh(
    env: &Env,
    token: &str,
    timing: hetzner::cloud::Timing,
) -> hetzner::cloud::HetznerCloud {
    hetzner::cloud::HetznerCloud::new(hetzner::cloud::HetznerConfig {
        token: provider_core::config::Secret::new(token),
        endpoint: env.emulator.endpoint(),
        provider_instance: PROVIDER.into(),
        server: hetzner::settings::ServerSpec {
            image: "ubuntu-24.04".into(),
            ..Default::default()
        },
        offerings: Vec::new(),
        locations: vec!["nbg1".into()],
        ssh: None,
        bootstrap_hook: "/opt/bigfleet/bootstrap".into(),
        base_user_data: None,
        readiness_command: None,
        eur_usd: 1.08,
        telemetry: env.telemetry,
        timing,
    })
    .unwrap()
}

#[tokio::test]
async fn the_token_never_shows_in_errors_or_debug_output() {
    let env = Env::new(Options::default()).await;
    assert!(!format!("{:?}", env.cloud).contains(TOKEN));
    let timing = crate::harness::fast_timing(Duration::from_secs(5));
    let cloud = cloud_without_ssh(&env, "wrong-token-value-123", timing);
    let err = cloud.list_hosts().await.unwrap_err();
    assert_eq!(
        err.0,
        "describe managed servers: hcloud unauthorized (HTTP 401): unable to authenticate"
    );
    assert!(!err.0.contains("wrong-token-value-123"));
    let err = cloud
        .create_host(&env.machine("cx23", "nbg1", 0), &ctx(5))
        .await
        .unwrap_err();
    assert!(!err.0.contains("wrong-token-value-123"), "{}", err.0);
    assert!(!format!("{cloud:?}").contains("wrong-token-value-123"));
    let logs = env.logs.text();
    assert!(!logs.contains("wrong-token-value-123"));
    env.assert_token_not_logged();
}

#[tokio::test]
async fn servers_of_the_reference_provider_are_adopted_and_claimed() {
    let env = Env::new(Options::default()).await;
    // Labels as the reference writes them: no provider label, raw cluster id.
    let reference = |machine_id: &str| {
        let mut l: HashMap<String, String> =
            HashMap::from([(labels::MANAGED.into(), "true".into())]);
        l.extend(labels::machine_id_labels(machine_id));
        l
    };
    let mine_id = format!("{PROVIDER}/OnDemand/cx23/nbg1/004");
    let mut mine_labels = reference(&mine_id);
    mine_labels.insert(labels::CLUSTER.into(), "prod".into());
    let mine =
        env.emulator
            .insert_server("bigfleet-n5yc2mi", "cx23", "nbg1", mine_labels, "127.0.0.1");
    // Another instance's slot, and one of ours in a location this process does not serve.
    env.emulator.insert_server(
        "a",
        "cx23",
        "nbg1",
        reference("other/OnDemand/cx23/nbg1/000"),
        "10.0.0.1",
    );
    env.emulator.insert_server(
        "b",
        "cx23",
        "hel1",
        reference(&format!("{PROVIDER}/OnDemand/cx23/hel1/000")),
        "10.0.0.2",
    );

    let hosts = env.cloud.list_hosts().await.unwrap();
    assert_eq!(hosts.len(), 1, "{hosts:?}");
    assert_eq!(hosts[0].id, mine.to_string());
    assert_eq!(hosts[0].machine_id, mine_id);
    assert_eq!(hosts[0].cluster.as_deref(), Some("prod"));

    // A Create for that machine adopts it (and stamps our provider label) instead of making
    // a second server.
    let mut machine = env.machine("cx23", "nbg1", 4);
    assert_eq!(machine.id, mine_id);
    let host = env.create_host(&machine, 10).await;
    assert_eq!(host.id, mine.to_string());
    assert_eq!(env.emulator.servers().len(), 3);
    assert_eq!(
        labels::text_of(&env.labels(mine), labels::PROVIDER).as_deref(),
        Some(PROVIDER)
    );
    assert_eq!(env.cloud.list_hosts().await.unwrap().len(), 1);

    // Delete works on it; the foreign ones stay.
    machine.host = None;
    env.cloud
        .delete_host(&mine.to_string(), &ctx(10))
        .await
        .unwrap();
    assert_eq!(env.emulator.servers().len(), 2);
}

#[tokio::test]
async fn a_create_refused_without_effect_is_retried_into_exactly_one_server() {
    let env = Env::new(Options::default()).await;
    env.emulator
        .inject_create([CreateFault::Refuse(503), CreateFault::Refuse(500)]);
    let machine = env.machine("cx23", "nbg1", 2);
    let host = env.create_host(&machine, 30).await;
    assert_eq!(
        env.emulator.count("POST", "/servers"),
        3,
        "two refusals, then the create"
    );
    let servers = env.emulator.servers();
    assert_eq!(servers.len(), 1);
    assert_eq!(host.id, servers[0].id.to_string());
    let logs = env.logs.text();
    assert_eq!(
        logs.matches("create failed without a server; retrying")
            .count(),
        2,
        "{logs}"
    );
}

#[tokio::test]
async fn a_create_waits_for_the_machines_previous_server_to_finish_deleting() {
    let env = Env::new(Options::default()).await;
    let machine = env.machine("cx23", "nbg1", 3);
    let first = env.create_host(&machine, 30).await;
    env.emulator.set_deleting_reads(3);
    env.cloud.delete_host(&first.id, &ctx(10)).await.unwrap();
    // The old server still holds the name while it is being deleted.
    let second = env.create_host(&machine, 30).await;
    assert_ne!(second.id, first.id);
    assert!(env.emulator.server(first.id.parse().unwrap()).is_none());
    assert_eq!(env.emulator.servers().len(), 1);
    assert!(
        env.emulator.count_status(409) >= 1,
        "the name was taken at first"
    );
}

/// Defect 3 (first shape): a run of 429s while polling the new server used to fail the Create
/// after the backoff's attempts although the server existed, leaving it running untracked. The
/// poll now keeps going within the deadline and the Create succeeds on that server.
#[tokio::test]
async fn a_rate_limit_storm_while_polling_a_new_server_does_not_fail_the_create() {
    let env = Env::new(Options::default()).await;
    env.emulator.set_polls_to_running(2);
    let machine = env.machine("cx23", "nbg1", 0);
    let cloud = env.cloud.clone();
    let create = tokio::spawn(async move { cloud.create_host(&machine, &ctx(30)).await });
    // Once the server exists, every next request is refused for a while: far more than the
    // client's attempts per call.
    while env.emulator.count("POST", "/servers") == 0 {
        tokio::task::yield_now().await;
    }
    env.emulator.inject((0..20).map(|_| Fault::RateLimited {
        retry_after: None,
        reset_in: None,
    }));
    let host = create.await.unwrap().unwrap();
    assert_eq!(env.emulator.servers().len(), 1);
    assert_eq!(host.id, env.emulator.servers()[0].id.to_string());
    assert!(
        env.emulator.count_status(429) >= 9,
        "the storm hit the polls"
    );
}

/// The retry defect: a 5xx carrying Hetzner's `RateLimit-Reset` (an hour away) is retried
/// after a short backoff, not treated as a rate limit that outlasts the deadline.
#[tokio::test]
async fn a_server_error_is_retried_without_waiting_for_the_rate_limit_reset() {
    let env = Env::new(Options::default()).await;
    let mut timing = crate::harness::fast_timing(Duration::from_secs(5));
    timing.client.backoff = provider_core::retry::Backoff::default();
    let cloud = cloud_without_ssh(&env, TOKEN, timing);
    env.emulator.inject([Fault::ServerError(503)]);
    let started = std::time::Instant::now();
    let hosts = cloud.list_hosts().await.unwrap();
    assert!(hosts.is_empty());
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "retried after {:?}",
        started.elapsed()
    );
    assert_eq!(env.emulator.count_status(503), 1);
}

/// An answer larger than the body cap fails the call (a listing is never built from it), and
/// the next call works.
#[tokio::test]
async fn an_oversized_answer_is_refused() {
    let env = Env::new(Options::default()).await;
    env.emulator.inject([Fault::Oversized(
        provider_core::cloud::MAX_RESPONSE_BODY + 1024,
    )]);
    let err = env.cloud.list_hosts().await.unwrap_err();
    assert!(err.0.contains("larger than"), "{err}");
    assert!(env.cloud.list_hosts().await.unwrap().is_empty());
}

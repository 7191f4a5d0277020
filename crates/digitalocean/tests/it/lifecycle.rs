//! The whole lifecycle against the emulator with a real `bigfleet-agent` process playing the
//! Droplet: create, configure (hook gets the cluster id and the blob), readiness, drain,
//! delete; and what must never show up in logs.

use std::time::Duration;

use digitalocean::naming::{
    ENROLLMENT_TOKEN_TAG, MANAGED_TAG, cluster_tag, droplet_name, machine_tag, provider_tag,
};
use digitalocean::token::{BootstrapSecret, UserDataToken};
use provider_core::backend::{BackendError, BootstrapBlob, ConfigureOrder};
use provider_core::cloud::Cloud;
use provider_core::machine::{HostRef, Machine};

use crate::support::*;

const BLOB: &[u8] = b"join-secret: kubeadm join 10.0.0.1:6443 --token abcdef.0123456789abcdef";

#[tokio::test(flavor = "current_thread")]
async fn full_lifecycle_with_the_real_agent() {
    let logs = LogCapture::default();
    let _guard = logs.install();
    let env = Env::start_with(EnvOptions {
        base_user_data: Some("#!/bin/sh\necho operator part\n".into()),
        ..EnvOptions::default()
    })
    .await;
    let mut m = machine(0);

    // Create: one Droplet in the region, named from the machine id, with the ownership tags.
    let host = env.create_host(&m, 20).await;
    assert!(host.running);
    assert_eq!(host.machine_id, m.id);
    assert_eq!(host.zone, REGION);
    assert_eq!(host.instance_type, "s-2vcpu-4gb");
    assert!(host.public_ipv4.is_some());
    let droplets = env.emulator.droplets();
    assert_eq!(droplets.len(), 1);
    let d = &droplets[0];
    assert_eq!(d.id.to_string(), host.id);
    assert_eq!(d.name, droplet_name(&m.id));
    assert_eq!(d.region, REGION);
    let mut tags = d.tags.clone();
    tags.sort();
    let mut want = vec![
        MANAGED_TAG.to_owned(),
        machine_tag(&m.id),
        provider_tag(PROVIDER),
        ENROLLMENT_TOKEN_TAG.to_owned(),
    ];
    want.sort();
    assert_eq!(tags, want);
    assert!(
        d.user_data.starts_with("Content-Type: multipart/mixed"),
        "operator part merged"
    );
    assert!(d.user_data.contains("echo operator part"));
    m.host = Some(HostRef {
        provider: PROVIDER.into(),
        id: host.id.clone(),
    });

    // The Droplet boots: the agent reads the config its user_data carries.
    let config_json = agent_config_from_user_data(&d.user_data);
    let config: serde_json::Value = serde_json::from_str(&config_json).unwrap();
    assert_eq!(config["machine_id"], m.id.as_str());
    assert_eq!(config["endpoint"], env.channel.endpoint().as_str());
    // The one-time enrollment token of this Create, not the older per-slot token.
    let user_data_token = config["token"].as_str().unwrap().to_owned();
    assert!(
        matches!(
            BootstrapSecret::new(SECRET)
                .unwrap()
                .check_user_data_token(&m.id, &user_data_token),
            Some(UserDataToken::Enrollment { .. })
        ),
        "{user_data_token}"
    );
    assert_eq!(config["ca_pem"], env.pki.ca_pem.as_str());
    let dir = env.dir.path();
    let hook = recording_hook(dir, 0);
    let drain_record = dir.join("drain.args");
    let agent = AgentProcess::spawn(AgentSetup {
        dir,
        config_json,
        hook,
        drain_command: format!(
            "echo \"$BIGFLEET_GRACE_SECONDS $1\" > '{}'",
            drain_record.display()
        ),
        readiness_command: Some(format!(
            "test \"$BIGFLEET_CLUSTER_ID\" = prod-eu && touch '{}/ready'",
            dir.display()
        )),
    });

    // Configure: the blob reaches the hook, the cluster tag is set.
    let order = ConfigureOrder {
        cluster_id: "prod-eu".into(),
        blob: BootstrapBlob(BLOB.to_vec()),
    };
    env.cloud
        .configure_host(&m, &host.id, &order, &ctx(Duration::from_secs(20)))
        .await
        .unwrap();
    assert_eq!(
        std::fs::read_to_string(dir.join("hook.args")).unwrap(),
        "prod-eu\n"
    );
    assert_eq!(std::fs::read(dir.join("hook.blob.copy")).unwrap(), BLOB);
    assert_eq!(
        std::fs::read_to_string(dir.join("hook.blob.mode"))
            .unwrap()
            .trim(),
        "600"
    );
    let d = env.emulator.droplet(host.id.parse().unwrap()).unwrap();
    assert!(d.tags.contains(&cluster_tag("prod-eu")), "{:?}", d.tags);
    let listed = env.cloud.list_hosts().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].cluster.as_deref(), Some("prod-eu"));

    // Readiness: the agent's readiness command ran for this cluster.
    assert!(env.cloud.has_readiness_gate());
    env.cloud
        .confirm_ready(&m, &host.id, "prod-eu", &ctx(Duration::from_secs(20)))
        .await
        .unwrap();
    assert!(dir.join("ready").exists());

    // Drain: grace 0 is sent as 1; the cluster tag goes away.
    env.cloud
        .drain_host(&m, &host.id, 0, &ctx(Duration::from_secs(20)))
        .await
        .unwrap();
    assert_eq!(std::fs::read_to_string(&drain_record).unwrap(), "1 1\n");
    let d = env.emulator.droplet(host.id.parse().unwrap()).unwrap();
    assert!(
        !d.tags.iter().any(|t| t.starts_with("bfcluster:")),
        "{:?}",
        d.tags
    );

    // Delete, twice: the second finds nothing and still succeeds.
    env.cloud
        .delete_host(&host.id, &ctx(Duration::from_secs(10)))
        .await
        .unwrap();
    assert!(env.emulator.droplets().is_empty());
    env.cloud
        .delete_host(&host.id, &ctx(Duration::from_secs(10)))
        .await
        .unwrap();
    assert_eq!(
        std::fs::read_to_string(dir.join("hook.runs")).unwrap(),
        "run\n",
        "hook ran once"
    );

    // Nothing secret in either side's logs.
    let provider_logs = logs.text();
    let agent_logs = agent.output();
    assert!(
        provider_logs.contains("agent applied command"),
        "{provider_logs}"
    );
    assert!(agent_logs.contains("command succeeded"), "{agent_logs}");
    let blob_text = String::from_utf8_lossy(BLOB).into_owned();
    let blob_b64 = base64_standard(BLOB);
    for (name, text) in [("provider", &provider_logs), ("agent", &agent_logs)] {
        for secret in [
            SECRET,
            token(&m.id).as_str(),
            user_data_token.as_str(),
            API_TOKEN,
            blob_text.as_str(),
            blob_b64.as_str(),
        ] {
            assert!(!text.contains(secret), "{name} logs leak a secret: {text}");
        }
    }
}

/// Configure of `m` on the Droplet `host` into cluster c1 within `timeout`, which must fail.
async fn configure_fails(env: &Env, m: &Machine, host: &str, timeout: Duration) -> BackendError {
    let order = ConfigureOrder {
        cluster_id: "c1".into(),
        blob: BootstrapBlob(b"x".to_vec()),
    };
    env.cloud
        .configure_host(m, host, &order, &ctx(timeout))
        .await
        .unwrap_err()
}

fn base64_standard(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

#[tokio::test]
async fn a_failing_hook_fails_configure_with_the_agents_error() {
    let env = Env::start().await;
    let mut m = machine(1);
    let host = create_bound(&env.cloud, &mut m).await;
    let d = env.emulator.droplet(host.id.parse().unwrap()).unwrap();
    let dir = env.dir.path();
    let _agent = AgentProcess::spawn(AgentSetup {
        dir,
        config_json: agent_config_from_user_data(&d.user_data),
        hook: recording_hook(dir, 3),
        drain_command: "true".into(),
        readiness_command: None,
    });
    let err = configure_fails(&env, &m, &host.id, Duration::from_secs(20)).await;
    assert_eq!(
        err.0,
        format!(
            "agent bootstrap failed for {}: bootstrap hook failed: exit status: 3",
            m.id
        )
    );
    let d = env.emulator.droplet(host.id.parse().unwrap()).unwrap();
    assert!(
        !d.tags.iter().any(|t| t.starts_with("bfcluster:")),
        "no binding after a failed hook"
    );
}

#[tokio::test]
async fn an_agent_that_never_answers_times_out() {
    let env = Env::start().await;
    let mut m = machine(2);
    let host = create_bound(&env.cloud, &mut m).await;
    let err = configure_fails(&env, &m, &host.id, Duration::from_millis(600)).await;
    assert_eq!(
        err.0,
        format!(
            "configure: the agent on droplet {} never enrolled, and a bootstrap blob is \
             delivered only to an enrolled agent (an agent older than the provider cannot \
             enroll: install a current bigfleet-agent in the image; see the agent's log for \
             why its enrollment failed)",
            host.id
        )
    );
    // The command was withdrawn: a late poll (with the Droplet's one-time token: the per-slot
    // token does not speak for a Droplet created with one) finds nothing.
    let droplet = env.emulator.droplet(host.id.parse().unwrap()).unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&agent_config_from_user_data(&droplet.user_data)).unwrap();
    let one_time = config["token"].as_str().unwrap().to_owned();
    let client = channel_client(&env.pki.ca_pem);
    let started = tokio::time::Instant::now();
    let r = client
        .get(format!("{}/v1/command", env.channel.endpoint()))
        .query(&[("machine_id", m.id.as_str())])
        .bearer_auth(&one_time)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "an empty poll is held"
    );
}

#[tokio::test]
async fn an_agent_restarted_mid_command_never_runs_it_twice() {
    let env = Env::start().await;
    let m = machine(3);
    // The agent enrolls from the machine's Droplet, with the one-time token of its user_data.
    let host = env.create_host(&m, 20).await;
    let droplet = env.emulator.droplet(host.id.parse().unwrap()).unwrap();
    let user_data: serde_json::Value =
        serde_json::from_str(&agent_config_from_user_data(&droplet.user_data)).unwrap();
    let one_time = user_data["token"].as_str().unwrap().to_owned();
    let dir = env.dir.path();
    let hook = dir.join("bootstrap");
    // The first run blocks until released; every run is recorded.
    write_executable(
        &hook,
        &format!(
            "#!/bin/sh\necho run >> '{d}/hook.runs'\nwhile [ ! -e '{d}/release' ]; do sleep 0.05; done\n",
            d = dir.display()
        ),
    );
    let config_json = format!(
        "{{\"endpoint\":{:?},\"ca_pem\":{:?},\"machine_id\":{:?},\"token\":{:?}}}",
        env.channel.endpoint(),
        env.pki.ca_pem,
        m.id,
        one_time
    );
    let setup = |config_json: String| AgentSetup {
        dir,
        config_json,
        hook: hook.clone(),
        drain_command: "true".into(),
        readiness_command: None,
    };
    let mut first = AgentProcess::spawn(setup(config_json.clone()));
    let channel = env.channel.channel.clone();
    let id = m.id.clone();
    let delivery = tokio::spawn(async move {
        let command = digitalocean::channel::Command::Configure {
            cluster_id: "c".into(),
            blob: b"b".to_vec(),
        };
        channel
            .deliver(&id, command, &ctx(Duration::from_secs(20)))
            .await
    });
    assert!(eventually(Duration::from_secs(10), || dir.join("hook.runs").exists()).await);
    first.kill().await;
    std::fs::write(dir.join("release"), b"").unwrap();
    // The restarted agent is served the same command id and refuses to run it again.
    let second = AgentProcess::spawn(setup(config_json));
    let err = delivery.await.unwrap().unwrap_err();
    assert_eq!(
        err.0,
        format!(
            "agent bootstrap failed for {}: the agent restarted while running this command; it was not run again",
            m.id
        )
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("hook.runs")).unwrap(),
        "run\n"
    );
    assert!(second.output().contains("not running it again"));
}

/// An engine over the real client, the emulator and provider-core's `Fleet`, on an in-memory
/// store.
async fn engine(
    env: &Env,
    count: i64,
    create_timeout: Duration,
) -> std::sync::Arc<provider_core::Engine> {
    let prices = std::sync::Arc::new(provider_core::fleet::PriceBook::new(|t, _| {
        digitalocean::catalog::pinned_price_usd(t)
    }));
    let capacities = std::sync::Arc::new(provider_core::fleet::CapacityBook::new(
        digitalocean::catalog::pinned_capacity,
    ));
    let offering = provider_core::offerings::Offering {
        instance_type: "s-2vcpu-4gb".into(),
        zone: REGION.into(),
        capacity_type: "on_demand".into(),
        count,
        resources: provider_core::StringMap::new(),
        labels: provider_core::StringMap::new(),
    };
    let fleet = provider_core::fleet::Fleet::new(
        env.cloud.clone(),
        PROVIDER,
        vec![offering],
        prices,
        capacities,
        |_| provider_core::StringMap::new(),
    );
    let mut options = provider_core::EngineOptions::new(telemetry());
    options.timeouts.create = create_timeout;
    provider_core::Engine::start(
        std::sync::Arc::new(fleet),
        std::sync::Arc::new(provider_core::store::MemoryStore),
        options,
    )
    .await
    .unwrap()
}

/// Defect 2 on DigitalOcean: a listing during which a listed Droplet is deleted skips a live
/// one (later Droplets move up a page); reconcile changes no machine on that evidence, and
/// the next pass changes exactly the one whose Droplet is gone.
#[tokio::test]
async fn a_droplet_skipped_by_a_shifting_paged_listing_is_not_declared_vanished() {
    let env = Env::start().await;
    for i in 0..6 {
        env.create_host(&machine(i), 20).await;
    }
    let engine = engine(&env, 6, Duration::from_secs(30)).await;
    let ids: Vec<String> = (0..6).map(|i| machine(i).id).collect();
    for id in &ids {
        assert_eq!(
            engine.get(id).unwrap().state,
            provider_core::MachineState::Idle
        );
    }
    env.emulator.set_max_per_page(3);
    env.emulator.delete_during_next_listings(1);
    let report = engine.reconcile().await.unwrap();
    assert_eq!(env.emulator.droplets().len(), 5);
    assert_eq!((report.suspects, report.vanished), (1, 0), "{report:?}");
    for id in &ids {
        assert_eq!(
            engine.get(id).unwrap().state,
            provider_core::MachineState::Idle,
            "{id}"
        );
    }
    let report = engine.reconcile().await.unwrap();
    assert_eq!(report.vanished, 1, "{report:?}");
    // Proved gone, and left Idle: BigFleet's shard has no edge from Idle to say so (its next
    // Configure fails, a Delete gives the slot back).
    for id in &ids[..1] {
        assert_eq!(
            engine.get(id).unwrap().state,
            provider_core::MachineState::Idle,
            "{id}"
        );
    }
}

/// Defect 3 on DigitalOcean: the Create deadline passes while the Droplet is still `new`; the
/// machine goes FAILED, reconcile records the Droplet on it (FAILED-with-host), and an admin
/// release deletes the Droplet.
#[tokio::test]
async fn a_droplet_left_by_a_failed_create_is_recorded_and_released() {
    let env = Env::start().await;
    env.emulator.set_active_after_polls(1_000_000);
    let engine = engine(&env, 1, Duration::from_secs(1)).await;
    let id = engine.spare_of("s-2vcpu-4gb", REGION)[0].clone();
    let token = provider_core::FenceToken {
        shard_id: String::new(),
        epoch: 0,
        sequence: 0,
    };
    engine.create(&id, token).await.unwrap();
    let failed = testkit::engine::settled(&engine, &id, Duration::from_secs(5)).await;
    assert_eq!(
        failed.state,
        provider_core::MachineState::Failed,
        "{failed:?}"
    );
    assert_eq!(env.emulator.droplets().len(), 1, "the Droplet exists");
    assert_eq!(
        failed.host.as_ref().map(|h| h.id.clone()),
        Some(env.emulator.droplets()[0].id.to_string()),
        "the Create recorded the Droplet the moment the cloud named it"
    );
    let droplet = env.emulator.droplets()[0].id.to_string();
    testkit::engine::release_failed_with_host(&engine, &id, &droplet).await;
    assert!(
        env.emulator.droplets().is_empty(),
        "released: the Droplet is deleted"
    );
    assert_eq!(
        engine.get(&id).unwrap().state,
        provider_core::MachineState::Failed
    );
}

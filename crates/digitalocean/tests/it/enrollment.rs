//! Agent enrollment against the real `digitalocean` binary and the real `bigfleet-agent` on
//! loopback: the user_data token is spent by the first enrollment, the enrolled credential
//! survives restarts of either side and a rotation of `--bootstrap-secret`, a stolen token is
//! detected whichever side enrolls first, a re-created Droplet enrolls afresh, a replay of the
//! spent token once the agent was handed its blob changes nothing (the Drain and the next
//! Configure go on), the per-slot token speaks only for a Droplet created before enrollment,
//! and the blob never reaches anyone but the enrolled agent. (A Configure resumed under a
//! rotated secret runs its hook once: `restart.rs` and `resume.rs`.)

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::time::Duration;

use fleet_proto::v1alpha1 as pb;

use crate::binary::{Provider, free_port};
use crate::support::*;

const BLOB: &[u8] = b"enrollment.e2eblobsecret";

/// What an attacker holding a Droplet's user_data (or a copy of its disk) sees of the channel.
struct Outsider {
    client: reqwest::Client,
    endpoint: String,
    machine_id: String,
    /// Every response body it was given.
    bodies: Vec<String>,
}

impl Outsider {
    fn new(ca_pem: &str, config_json: &str) -> Outsider {
        let config: serde_json::Value = serde_json::from_str(config_json).unwrap();
        Outsider {
            client: channel_client(ca_pem),
            endpoint: config["endpoint"].as_str().unwrap().to_owned(),
            machine_id: config["machine_id"].as_str().unwrap().to_owned(),
            bodies: Vec::new(),
        }
    }

    async fn enroll(&mut self, token: &str, credential: &str) -> u16 {
        let r = enroll_with(
            &self.client,
            &self.endpoint,
            &self.machine_id,
            token,
            credential,
        )
        .await;
        let status = r.status().as_u16();
        self.bodies.push(r.text().await.unwrap());
        status
    }

    async fn poll(&mut self, bearer: &str) -> u16 {
        let r = self
            .client
            .get(format!("{}/v1/command", self.endpoint))
            .query(&[("machine_id", self.machine_id.as_str())])
            .bearer_auth(bearer)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        self.bodies.push(r.text().await.unwrap());
        status
    }

    /// No answer it ever got carried the blob, in clear or base64.
    fn saw_no_blob(&self) {
        let b64 = base64_standard(BLOB);
        let clear = String::from_utf8_lossy(BLOB).into_owned();
        for body in &self.bodies {
            assert!(
                !body.contains(&b64) && !body.contains(&clear),
                "an outsider was given the blob: {body}"
            );
        }
    }
}

fn base64_standard(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn user_data_token(config_json: &str) -> String {
    let config: serde_json::Value = serde_json::from_str(config_json).unwrap();
    config["token"].as_str().unwrap().to_owned()
}

async fn export(state: &Path) -> serde_json::Value {
    serde_json::from_slice(&testkit::cli::state_export(Path::new(BINARY), state).await).unwrap()
}

fn machine_in<'a>(export: &'a serde_json::Value, id: &str) -> &'a serde_json::Value {
    testkit::json::entry(export, "machines", "id", id)
}

async fn metric(port: u16, name: &str) -> Option<f64> {
    let text = reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    text.lines()
        .find(|l| l.starts_with(name) && !l.starts_with('#'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

async fn configure(p: &mut Provider, id: &str) {
    p.configure_with(id, "prod-eu", BLOB, Default::default())
        .await
        .unwrap();
}

fn boot(dir: &Path, config_json: String) -> AgentProcess {
    AgentProcess::spawn(AgentSetup::recording(dir, config_json))
}

/// The whole life of an enrollment on a local state: the token is spent, the config loses
/// it, the credential carries the agent through a restart of itself, a kill -9 of the
/// provider and a rotated `--bootstrap-secret`, and a Droplet created again for the machine
/// enrolls afresh while nothing of the first one works for it.
#[tokio::test]
async fn an_enrolled_agent_survives_restarts_and_rotation_and_a_new_droplet_enrolls_afresh() {
    let site_dir = tempfile::tempdir().unwrap();
    let state = site_dir.path().join("state");
    let state_flag = format!("--state={}", state.display());
    let mut p = Provider::start(&[&state_flag, "--configure-timeout=30s"]).await;
    let id = p.idle_machine().await;
    let (dir, config_json) = p.droplet_of(&id);
    let token = user_data_token(&config_json);
    let mut outsider = Outsider::new(&p.site.pki.ca_pem, &config_json);

    let mut agent = boot(&dir, config_json.clone());
    agent
        .expect_output(
            "enrolled; the user_data token is spent",
            Duration::from_secs(15),
        )
        .await;
    // The config no longer holds the token; the state file is the agent's own.
    let on_disk = std::fs::read_to_string(dir.join("config.json")).unwrap();
    assert!(!on_disk.contains(&token), "{on_disk}");
    let state_file = dir.join("state/executed.json");
    let mode = std::fs::metadata(&state_file).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    assert!(
        !std::fs::read_to_string(&state_file)
            .unwrap()
            .contains(&token)
    );
    // The spent token alone is refused now, for commands and for enrollment alike.
    assert_eq!(outsider.poll(&token).await, 401);

    configure(&mut p, &id).await;
    p.wait_for(&id, pb::MachineState::Configured).await;
    assert_eq!(std::fs::read(dir.join("hook.blob.copy")).unwrap(), BLOB);

    // The agent restarts from the config as it is now (without the token).
    agent.kill().await;
    let mut agent = boot(&dir, on_disk.clone());
    // The provider dies and comes back on the same state, with a rotated secret.
    p.kill_9().await;
    p.restart(&[
        &state_flag,
        "--configure-timeout=30s",
        "--bootstrap-secret=a-rotated-bootstrap-secret-0123456789abcdef",
    ])
    .await;
    let exported = export(&state).await;
    let recorded = &machine_in(&exported, &id)["enrollment"];
    assert_eq!(recorded["conflict"], false);
    assert!(recorded["host_id"].as_str().is_some_and(|h| !h.is_empty()));
    assert!(
        recorded.get("credential_digest").is_none(),
        "the export shows only where the credential speaks"
    );
    p.drain(&id, 1).await;
    p.wait_for(&id, pb::MachineState::Idle).await;
    assert!(!agent.output().contains("refused"), "{}", agent.output());

    // Delete forgets the enrollment with the Droplet; a new Create makes a new Droplet, with
    // a new token, that enrolls afresh.
    let old_credential = {
        let text = std::fs::read_to_string(&state_file).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        v["enrollment"]["credential"].as_str().unwrap().to_owned()
    };
    p.delete(&id).await;
    p.wait_for(&id, pb::MachineState::Speculative).await;
    agent.kill().await;
    p.create(&id).await;
    p.wait_for(&id, pb::MachineState::Idle).await;
    let (new_dir, new_config) = p.droplet_of(&id);
    assert_ne!(new_dir, dir, "another Droplet");
    let new_token = user_data_token(&new_config);
    assert_ne!(new_token, token);
    // Nothing of the first Droplet works for the second: its credential, its token (under
    // either secret), an enrollment with it.
    assert_eq!(outsider.poll(&old_credential).await, 401);
    assert_eq!(outsider.poll(&token).await, 401);
    assert_eq!(
        outsider
            .enroll(&token, digitalocean::token::new_credential().expose())
            .await,
        401
    );
    // A copy of the first Droplet's disk (its agent state) on the new Droplet: the config
    // there holds the new token, so the agent enrolls afresh instead of using the old one.
    std::fs::create_dir_all(new_dir.join("state")).unwrap();
    std::fs::copy(&state_file, new_dir.join("state/executed.json")).unwrap();
    let new_agent = boot(&new_dir, new_config);
    new_agent
        .expect_output(
            "enrolled; the user_data token is spent",
            Duration::from_secs(15),
        )
        .await;
    configure(&mut p, &id).await;
    p.wait_for(&id, pb::MachineState::Configured).await;
    assert_eq!(std::fs::read(new_dir.join("hook.blob.copy")).unwrap(), BLOB);
    outsider.saw_no_blob();
    for secret in [token.as_str(), new_token.as_str(), old_credential.as_str()] {
        assert!(
            !p.logs().contains(secret),
            "a credential in the provider's log"
        );
        assert!(
            !new_agent.output().contains(secret),
            "a credential in the agent's log"
        );
    }
}

/// A stolen user_data token, used before the real agent enrolls and after it: either way the
/// second enrollment is a conflict, the machine's Configure fails saying why, the blob reaches
/// neither party, and the conflict is counted.
#[tokio::test]
async fn a_stolen_token_is_a_conflict_whichever_side_enrolls_first() {
    let metrics = free_port().await;
    let metrics_flag = format!("--metrics-addr=127.0.0.1:{metrics}");
    let mut p = Provider::start(&[&metrics_flag, "--configure-timeout=20s"]).await;
    let ids = p.speculative(2).await;
    let (thief_first, agent_first) = (ids[0].clone(), ids[1].clone());
    for id in &ids {
        p.create(id).await;
    }
    for id in &ids {
        p.wait_for(id, pb::MachineState::Idle).await;
    }
    assert_eq!(
        metric(
            metrics,
            "bigfleet_digitalocean_bootstrap_enrollment_conflicts_total"
        )
        .await,
        Some(0.0)
    );

    // The thief enrolls first with the stolen token; the real agent's enrollment is refused.
    let (dir_a, config_a) = p.droplet_of(&thief_first);
    let mut thief_a = Outsider::new(&p.site.pki.ca_pem, &config_a);
    let stolen = digitalocean::token::new_credential().expose().to_owned();
    assert_eq!(
        thief_a.enroll(&user_data_token(&config_a), &stolen).await,
        200
    );
    let agent_a = boot(&dir_a, config_a.clone());
    agent_a
        .expect_output("refused the enrollment (401)", Duration::from_secs(15))
        .await;
    // From now on nothing is served to the thief either.
    assert_eq!(thief_a.poll(&stolen).await, 401);

    // The real agent enrolls first; the thief's enrollment is refused and poisons nothing it
    // can use.
    let (dir_b, config_b) = p.droplet_of(&agent_first);
    let agent_b = boot(&dir_b, config_b.clone());
    agent_b
        .expect_output(
            "enrolled; the user_data token is spent",
            Duration::from_secs(15),
        )
        .await;
    let mut thief_b = Outsider::new(&p.site.pki.ca_pem, &config_b);
    let other = digitalocean::token::new_credential().expose().to_owned();
    assert_eq!(
        thief_b.enroll(&user_data_token(&config_b), &other).await,
        401
    );
    assert_eq!(thief_b.poll(&other).await, 401);

    // Both machines' Configures fail, naming the conflict; no hook ever ran.
    configure(&mut p, &thief_first).await;
    configure(&mut p, &agent_first).await;
    for (id, dir) in [(&thief_first, &dir_a), (&agent_first, &dir_b)] {
        let failed = p.wait_for_state_or_failed(id).await;
        assert_eq!(failed.state, pb::MachineState::Failed as i32, "{id}");
        assert!(
            failed
                .last_error
                .contains("a second enrollment presented the machine's spent"),
            "{}",
            failed.last_error
        );
        assert!(
            !dir.join("hook.runs").exists(),
            "the hook of {id} never ran"
        );
        assert!(!dir.join("hook.blob.copy").exists());
    }
    assert_eq!(thief_a.poll(&stolen).await, 401);
    thief_a.saw_no_blob();
    thief_b.saw_no_blob();
    // Every conflicting attempt counts (the real agent of the first machine keeps trying).
    let conflicts = metric(
        metrics,
        "bigfleet_digitalocean_bootstrap_enrollment_conflicts_total",
    )
    .await
    .unwrap();
    assert!(conflicts >= 2.0, "{conflicts}");
    assert!(
        p.logs()
            .contains("a second enrollment presented this machine's spent one-time token")
    );
    for secret in [stolen.as_str(), other.as_str()] {
        assert!(!p.logs().contains(secret));
    }
}

/// An agent of the previous version (it never enrolls, and polls with its user_data token)
/// against this provider: readiness and drain reach it, a Configure's blob does not, and the
/// Configure fails saying the agent never enrolled.
#[tokio::test]
async fn an_agent_that_never_enrolls_gets_no_blob_and_the_configure_says_why() {
    let mut p = Provider::start(&["--configure-timeout=3s"]).await;
    let id = p.idle_machine().await;
    let (_, config_json) = p.droplet_of(&id);
    let mut old_agent = Outsider::new(&p.site.pki.ca_pem, &config_json);
    let token = user_data_token(&config_json);
    configure(&mut p, &id).await;
    // It polls as the previous agent did, with the token, while the Configure waits: the
    // poll is held, nothing is served to it.
    let held = tokio::time::timeout(Duration::from_secs(2), old_agent.poll(&token)).await;
    assert!(
        held.is_err(),
        "a poll with the token alone was answered: {held:?}"
    );
    let failed = p.wait_for_state_or_failed(&id).await;
    assert_eq!(failed.state, pb::MachineState::Failed as i32);
    assert!(
        failed.last_error.contains("never enrolled"),
        "{}",
        failed.last_error
    );
    old_agent.saw_no_blob();
}

/// The held-out style check: a Droplet's agent completes the lifecycle, and a request with its
/// user_data token after the enrollment gets 401.
#[tokio::test]
async fn after_the_lifecycle_the_user_data_token_gets_401() {
    let mut p = Provider::start(&[]).await;
    let id = p.idle_machine().await;
    let (dir, config_json) = p.droplet_of(&id);
    let _agent = boot(&dir, config_json.clone());
    configure(&mut p, &id).await;
    p.wait_for(&id, pb::MachineState::Configured).await;
    p.drain(&id, 1).await;
    p.wait_for(&id, pb::MachineState::Idle).await;
    let mut outsider = Outsider::new(&p.site.pki.ca_pem, &config_json);
    assert_eq!(outsider.poll(&user_data_token(&config_json)).await, 401);
    outsider.saw_no_blob();
}

/// With `--bootstrap-enrollment-source droplet` (the default) an enrollment is taken only from
/// an address the cloud assigned to the machine's Droplet: the token presented from loopback
/// while the Droplet's address is 192.0.2.x gets 401 and spends nothing; once the cloud reports
/// 127.0.0.1 for the Droplet, the real agent enrolls from there and the Configure completes.
#[tokio::test]
async fn an_enrollment_from_an_address_the_droplet_does_not_have_is_refused() {
    let mut p = Provider::start(&["--bootstrap-enrollment-source=droplet"]).await;
    let id = p.idle_machine().await;
    let (dir, config_json) = p.droplet_of(&id);
    let token = user_data_token(&config_json);
    let mut elsewhere = Outsider::new(&p.site.pki.ca_pem, &config_json);
    assert_eq!(
        elsewhere
            .enroll(&token, digitalocean::token::new_credential().expose())
            .await,
        401,
        "{:?}",
        elsewhere.bodies
    );
    let droplet = p.site.emulator.droplets()[0].id;
    assert!(p.site.emulator.set_public_ipv4(droplet, "127.0.0.1"));
    let _agent = boot(&dir, config_json.clone());
    configure(&mut p, &id).await;
    p.wait_for(&id, pb::MachineState::Configured).await;
    assert_eq!(elsewhere.poll(&token).await, 401);
    elsewhere.saw_no_blob();
    assert!(
        p.logs()
            .contains("did not assign to the machine's Droplet refused"),
        "{}",
        p.logs()
    );
}

/// The enrollment lives in the same store as the machine on etcd too: an agent enrolled under
/// one process is still enrolled, and its user_data token still spent, when a new process takes
/// over the prefix after the first was killed (`kill -9`, the lease running out); the new
/// process delivers the Configure to the enrolled agent and to nobody else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_etcd_an_enrollment_survives_a_takeover_by_a_new_process() {
    let etcd = std::thread::scope(|s| {
        s.spawn(|| provider_core::etcd::testing::Cluster::start(1))
            .join()
            .expect("etcd")
    });
    let state = etcd.state("/bigfleet/do-enrollment");
    let flags = [
        format!("--state={state}"),
        "--etcd-lease-ttl=1s".to_owned(),
        "--configure-timeout=30s".to_owned(),
    ];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut p = Provider::start(&flags).await;
    wait_leading(&mut p).await;
    let id = p.idle_machine().await;
    let (dir, config_json) = p.droplet_of(&id);
    let token = user_data_token(&config_json);
    let mut outsider = Outsider::new(&p.site.pki.ca_pem, &config_json);
    let agent = boot(&dir, config_json.clone());
    agent
        .expect_output(
            "enrolled; the user_data token is spent",
            Duration::from_secs(15),
        )
        .await;

    p.kill_9().await;
    p.restart(&flags).await;
    wait_leading(&mut p).await;
    // The new process knows the token is spent: an enrollment with it is a conflict or a
    // refusal, never a second enrolled party; a poll with it alone is refused.
    assert_eq!(outsider.poll(&token).await, 401);
    configure(&mut p, &id).await;
    p.wait_for(&id, pb::MachineState::Configured).await;
    assert_eq!(std::fs::read(dir.join("hook.blob.copy")).unwrap(), BLOB);
    outsider.saw_no_blob();
    assert!(!agent.output().contains("refused"), "{}", agent.output());
}

/// Waits (bounded) until the process leads the state in etcd and answers List.
async fn wait_leading(p: &mut Provider) {
    for _ in 0..400 {
        if p.client.list(pb::ListFilter::default()).await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the provider never led the state: {}", p.logs());
}

/// Anything on the node can read the Droplet's user_data from the metadata service, and its
/// requests leave from the node's address, so they pass the default source check: once the
/// enrolled agent was handed the Configure's blob, an enrollment with the spent token is a
/// replay. It gets 401, is counted apart from conflicts, and changes nothing: the machine's
/// Drain and its next Configure go on with the enrolled agent.
#[tokio::test]
async fn a_replay_of_the_spent_token_after_the_configure_stops_neither_drain_nor_configure() {
    let site_dir = tempfile::tempdir().unwrap();
    let state = site_dir.path().join("state");
    let state_flag = format!("--state={}", state.display());
    let metrics = free_port().await;
    let metrics_flag = format!("--metrics-addr=127.0.0.1:{metrics}");
    let mut p = Provider::start(&[
        &state_flag,
        &metrics_flag,
        "--bootstrap-enrollment-source=droplet",
        "--configure-timeout=30s",
    ])
    .await;
    let id = p.idle_machine().await;
    // The agent, and the pod that replays, send from the Droplet's own address.
    let droplet = p.site.emulator.droplets()[0].id;
    assert!(p.site.emulator.set_public_ipv4(droplet, "127.0.0.1"));
    let (dir, config_json) = p.droplet_of(&id);
    let token = user_data_token(&config_json);
    let agent = boot(&dir, config_json.clone());
    configure(&mut p, &id).await;
    p.wait_for(&id, pb::MachineState::Configured).await;

    let mut pod = Outsider::new(&p.site.pki.ca_pem, &config_json);
    let stolen = digitalocean::token::new_credential().expose().to_owned();
    assert_eq!(pod.enroll(&token, &stolen).await, 401);
    assert_eq!(pod.poll(&stolen).await, 401);
    let replays = "bigfleet_digitalocean_bootstrap_enrollment_replays_total";
    let conflicts = "bigfleet_digitalocean_bootstrap_enrollment_conflicts_total";
    assert_eq!(metric(metrics, replays).await, Some(1.0));
    assert_eq!(metric(metrics, conflicts).await, Some(0.0));
    p.drain(&id, 1).await;
    p.wait_for(&id, pb::MachineState::Idle).await;

    // Again while the machine is Idle: still a replay, and the next Configure goes on.
    assert_eq!(pod.enroll(&token, &stolen).await, 401);
    configure(&mut p, &id).await;
    p.wait_for(&id, pb::MachineState::Configured).await;
    assert_eq!(runs(&dir, "hook"), 2, "{}", agent.output());
    assert_eq!(metric(metrics, replays).await, Some(2.0));
    assert_eq!(metric(metrics, conflicts).await, Some(0.0));
    pod.saw_no_blob();
    assert!(
        p.logs()
            .contains("refused; the enrolled agent keeps the machine"),
        "{}",
        p.logs()
    );
    assert!(!p.logs().contains(&stolen) && !p.logs().contains(&token));
    p.kill_9().await;
    let exported = export(&state).await;
    let recorded = &machine_in(&exported, &id)["enrollment"];
    assert_eq!(recorded["confirmed"], true, "{recorded}");
    assert_eq!(recorded["conflict"], false, "{recorded}");
}

/// The per-slot token (`HMAC(secret, machine id)`) never changes for a slot, so whoever read
/// the user_data of an older Droplet of the slot holds it for every later one. It enrolls no
/// Droplet created with a one-time token, and no command is served for one with it; the real
/// agent then enrolls as usual and alone gets the blob. A Droplet created before enrollment
/// (without the enrollment token tag) still enrolls with it.
#[tokio::test]
async fn the_per_slot_token_speaks_only_for_droplets_created_before_enrollment() {
    let mut p = Provider::start(&["--configure-timeout=30s"]).await;
    let ids = p.speculative(2).await;
    for id in &ids {
        p.create(id).await;
    }
    for id in &ids {
        p.wait_for(id, pb::MachineState::Idle).await;
    }
    let (new, older) = (&ids[0], &ids[1]);

    let (dir, config_json) = p.droplet_of(new);
    let mut thief = Outsider::new(&p.site.pki.ca_pem, &config_json);
    let per_slot = token(new);
    let credential = digitalocean::token::new_credential().expose().to_owned();
    assert_eq!(thief.enroll(&per_slot, &credential).await, 401);
    assert_eq!(thief.poll(&per_slot).await, 401);
    assert_eq!(thief.poll(&credential).await, 401);
    let agent = boot(&dir, config_json);
    agent
        .expect_output(
            "enrolled; the user_data token is spent",
            Duration::from_secs(15),
        )
        .await;
    configure(&mut p, new).await;
    p.wait_for(new, pb::MachineState::Configured).await;
    assert_eq!(std::fs::read(dir.join("hook.blob.copy")).unwrap(), BLOB);
    thief.saw_no_blob();
    assert!(
        p.logs().contains("enrollment with the per-slot token of a slot whose Droplet was created with a one-time enrollment token refused"),
        "{}",
        p.logs()
    );

    // A Droplet an older provider created: no tag, and the per-slot token in its user_data.
    let (older_dir, older_config) = p.droplet_of(older);
    let droplet = p.droplet(older);
    assert!(
        p.site
            .emulator
            .remove_tag(droplet.id, digitalocean::naming::ENROLLMENT_TOKEN_TAG)
    );
    let mut config: serde_json::Value = serde_json::from_str(&older_config).unwrap();
    config["token"] = token(older).into();
    let older_agent = boot(&older_dir, config.to_string());
    older_agent
        .expect_output(
            "enrolled; the user_data token is spent",
            Duration::from_secs(15),
        )
        .await;
    configure(&mut p, older).await;
    p.wait_for(older, pb::MachineState::Configured).await;
    assert_eq!(
        std::fs::read(older_dir.join("hook.blob.copy")).unwrap(),
        BLOB
    );
}

/// A state lost with `--bootstrap-enrollment-source any`: the state after it counts operations
/// again, but its series differs, so no identity of the lost state repeats. The first Create
/// after the loss names another machine id and another operation, its Droplet's user_data token
/// is new, and whoever kept the user_data of the Droplet the lost state made (deleted since)
/// can enroll neither under that machine nor under the new one; the new Droplet's own agent
/// enrolls and alone receives its Configure's blob.
#[tokio::test]
async fn after_a_state_loss_no_token_or_id_of_the_lost_state_repeats() {
    let site_dir = tempfile::tempdir().unwrap();
    let state = site_dir.path().join("state");
    let state_flag = format!("--state={}", state.display());
    let mut p = Provider::start(&[&state_flag, "--configure-timeout=30s"]).await;
    let old_id = p.idle_machine().await;
    let (_, old_config) = p.droplet_of(&old_id);
    let old_token = user_data_token(&old_config);
    p.delete(&old_id).await;
    p.wait_for(&old_id, pb::MachineState::Speculative).await;
    assert!(p.site.emulator.droplets().is_empty(), "the Droplet is gone");

    // The state is lost: the directory goes, the process starts on a fresh one.
    p.kill_9().await;
    std::fs::remove_dir_all(&state).unwrap();
    p.restart(&[&state_flag, "--configure-timeout=30s"]).await;
    let ids = p.speculative(4).await;
    assert!(
        !ids.contains(&old_id),
        "a machine id of the lost state is listed again: {ids:?}"
    );
    let new_id = ids[0].clone();
    p.create(&new_id).await;
    p.wait_for(&new_id, pb::MachineState::Idle).await;
    let (new_dir, new_config) = p.droplet_of(&new_id);
    let new_token = user_data_token(&new_config);
    assert_ne!(
        new_token, old_token,
        "the token of the lost state's Droplet repeats"
    );

    // The old user_data's holder tries it under the new machine and under the old id.
    let mut thief = Outsider::new(&p.site.pki.ca_pem, &new_config);
    let stolen = digitalocean::token::new_credential().expose().to_owned();
    assert_eq!(thief.enroll(&old_token, &stolen).await, 401);
    let mut old_thief = Outsider::new(&p.site.pki.ca_pem, &old_config);
    assert_eq!(old_thief.enroll(&old_token, &stolen).await, 401);
    assert_eq!(thief.poll(&stolen).await, 401);

    // The new Droplet's agent enrolls and is the one handed the blob.
    let agent = boot(&new_dir, new_config);
    agent
        .expect_output(
            "enrolled; the user_data token is spent",
            Duration::from_secs(15),
        )
        .await;
    configure(&mut p, &new_id).await;
    p.wait_for(&new_id, pb::MachineState::Configured).await;
    assert_eq!(std::fs::read(new_dir.join("hook.blob.copy")).unwrap(), BLOB);
    thief.saw_no_blob();
    old_thief.saw_no_blob();
}

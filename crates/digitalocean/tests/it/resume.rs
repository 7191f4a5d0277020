//! A transition resumed by another provider process: the provider's `Channel` is dropped and a
//! new one with the same secret and certificate takes over the address (a restart, or a new
//! leader), and the resumed transition delivers its command again under the same operation
//! id. The real agent process never runs the hook or the drain twice for it: the resumed
//! delivery ends with the outcome of the one run, whether the restart came while the command
//! ran or after it finished but before its ack arrived. Also the agent's record itself: an old
//! state file loads, and a command whose start cannot be recorded is not run.

use std::time::Duration;

use digitalocean::channel::{AuthLimit, Channel, Command};
use tokio::net::TcpListener;

use crate::support::*;

const BLOB: &[u8] = b"kubeadm join 10.0.0.1:6443 --token abcdef.0123456789abcdef";

fn configure() -> Command {
    Command::Configure {
        cluster_id: "prod-eu".into(),
        blob: BLOB.to_vec(),
    }
}

/// One provider process's channel on `addr`, after the previous one let go of it; it knows
/// the agents' enrollments `previous` recorded, as a new process reads them from the state.
async fn channel_on(addr: std::net::SocketAddr, pki: &Pki, previous: &Channel) -> RunningChannel {
    let listener = TcpListener::bind(addr).await.unwrap();
    let running =
        RunningChannel::start_on(listener, pki, Duration::from_secs(2), AuthLimit::default());
    running.channel.adopt_enrollments(previous);
    running
}

struct Droplet {
    dir: tempfile::TempDir,
    agent: AgentProcess,
}

const MACHINE: &str = "do-test/OnDemand/s-2vcpu-4gb/nyc3/004";

/// The agent of [`MACHINE`], with a gated hook (`hook`), drain command (`drain`) and, when
/// `readiness` is given, that readiness command.
fn droplet(
    channel: &RunningChannel,
    pki: &Pki,
    hook_exit: i32,
    readiness: Option<&str>,
) -> Droplet {
    let dir = tempfile::tempdir().unwrap();
    let hook = dir.path().join("bootstrap");
    write_executable(
        &hook,
        &format!("#!/bin/sh\n{}", gated(dir.path(), "hook", hook_exit)),
    );
    let agent = AgentProcess::spawn(AgentSetup {
        dir: dir.path(),
        config_json: agent_config(&channel.endpoint(), &pki.ca_pem, MACHINE),
        hook,
        drain_command: gated(dir.path(), "drain", 0),
        readiness_command: readiness.map(str::to_owned),
    });
    Droplet { dir, agent }
}

/// Delivers `command` on `channel` in the background, as a transition of `operation_id` does.
fn deliver(
    channel: &RunningChannel,
    command: Command,
    operation_id: &'static str,
) -> tokio::task::JoinHandle<Result<(), digitalocean::channel::DeliveryError>> {
    channel.deliver_later(
        MACHINE,
        command,
        ctx_of(operation_id, Duration::from_secs(30)),
    )
}

/// The provider process dies: its transition stops waiting and its channel goes away.
async fn kill_provider(
    channel: RunningChannel,
    delivery: tokio::task::JoinHandle<Result<(), digitalocean::channel::DeliveryError>>,
) {
    delivery.abort();
    channel.stop().await;
}

/// What a provider process keeps in its state for the next one (the agents' enrollments).
fn kept(channel: &RunningChannel) -> Channel {
    channel.channel.clone()
}

/// Delivers `command` on `channel` in the background as the Configure `operation_id` whose
/// nonce (`TransitionContext::configure_nonce`) is `nonce`, as the engine runs and resumes it.
fn deliver_configure(
    channel: &RunningChannel,
    operation_id: &'static str,
    nonce: &'static str,
) -> tokio::task::JoinHandle<Result<(), digitalocean::channel::DeliveryError>> {
    let channel = channel.channel.clone();
    tokio::spawn(async move {
        let mut ctx = ctx_of(operation_id, Duration::from_secs(30));
        ctx.configure_nonce = Some(nonce.to_owned());
        channel.deliver(MACHINE, configure(), &ctx).await
    })
}

/// A Configure resumed by a process with a rotated `--bootstrap-secret` (a rotation needs a
/// restart) while its hook runs: the command id changes with the secret, the run key does not,
/// and the agent answers the new id from its record of the one run. A Configure that reuses
/// the operation id with another nonce (the provider lost its state and counts from `op-1`
/// again) is another Configure: its hook runs.
#[tokio::test]
async fn a_configure_resumed_under_a_rotated_secret_runs_its_hook_once_and_another_under_its_id_runs_again()
 {
    let pki = pki();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let first =
        RunningChannel::start_on(listener, &pki, Duration::from_secs(2), AuthLimit::default());
    let droplet = droplet(&first, &pki, 0, None);
    let dir = droplet.dir.path();
    let delivery = deliver_configure(&first, "op-2", "7ad30b0600000001");
    assert!(eventually(Duration::from_secs(10), || runs(dir, "hook") == 1).await);
    let state = kept(&first);
    kill_provider(first, delivery).await;

    let second = RunningChannel::start_with_secret(
        TcpListener::bind(addr).await.unwrap(),
        &pki,
        Duration::from_secs(2),
        AuthLimit::default(),
        "a-rotated-bootstrap-secret-0123456789abcdef",
    );
    second.channel.adopt_enrollments(&state);
    let resumed = deliver_configure(&second, "op-2", "7ad30b0600000001");
    release(dir, "hook");
    resumed.await.unwrap().unwrap();
    assert_eq!(runs(dir, "hook"), 1, "{}", droplet.agent.output());
    let output = droplet.agent.output();
    let ids: std::collections::BTreeSet<&str> = output
        .lines()
        .filter(|l| l.contains("op-2.configure.7ad30b0600000001"))
        .filter_map(|l| l.split("command_id=").nth(1)?.split_whitespace().next())
        .collect();
    assert_eq!(ids.len(), 2, "the id changed with the secret: {output}");
    assert!(
        output.contains("command already executed; acknowledging again"),
        "{output}"
    );

    // The same operation id with another nonce: a Configure the agent never ran.
    let again = deliver_configure(&second, "op-2", "f144099d00000002");
    again.await.unwrap().unwrap();
    assert_eq!(runs(dir, "hook"), 2, "{}", droplet.agent.output());
    second.stop().await;
}

/// The restart comes while the hook runs; its ack reaches the resumed delivery of the new
/// process, which ends `Ok`, and the hook ran once.
#[tokio::test]
async fn a_configure_resumed_by_a_new_process_while_the_hook_runs_ends_ok_and_runs_it_once() {
    let pki = pki();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let first =
        RunningChannel::start_on(listener, &pki, Duration::from_secs(2), AuthLimit::default());
    let droplet = droplet(&first, &pki, 0, None);
    let dir = droplet.dir.path();
    let delivery = deliver(&first, configure(), "op-41");
    // The agent fetched the command and runs the hook.
    assert!(eventually(Duration::from_secs(10), || runs(dir, "hook") == 1).await);
    let state = kept(&first);
    kill_provider(first, delivery).await;

    let second = channel_on(addr, &pki, &state).await;
    let resumed = deliver(&second, configure(), "op-41");
    tokio::time::sleep(Duration::from_millis(200)).await;
    release(dir, "hook");
    resumed.await.unwrap().unwrap();
    assert_eq!(runs(dir, "hook"), 1, "{}", droplet.agent.output());
    assert_eq!(
        droplet.agent.output().matches("running command").count(),
        1,
        "{}",
        droplet.agent.output()
    );
}

/// The hook finished while no provider listened, so its ack was lost; the agent's retried
/// ack reaches the new process before the resumed delivery (204: nothing pending), and the
/// resumed delivery is still answered at once from the agent's record.
async fn resumed_after_the_run(
    hook_exit: i32,
    operation_id: &'static str,
) -> (Result<(), String>, Droplet) {
    let pki = pki();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let first =
        RunningChannel::start_on(listener, &pki, Duration::from_secs(2), AuthLimit::default());
    let droplet = droplet(&first, &pki, hook_exit, None);
    let dir = droplet.dir.path();
    let delivery = deliver(&first, configure(), operation_id);
    assert!(eventually(Duration::from_secs(10), || runs(dir, "hook") == 1).await);
    let state = kept(&first);
    kill_provider(first, delivery).await;
    release(dir, "hook");
    droplet
        .agent
        .expect_output("ack failed", Duration::from_secs(10))
        .await;

    let second = channel_on(addr, &pki, &state).await;
    assert!(
        droplet
            .agent
            .wait_for_output("ack not needed any more", Duration::from_secs(10))
            .await,
        "the retried ack reaches the new process: {}",
        droplet.agent.output()
    );
    let started = tokio::time::Instant::now();
    let outcome = deliver(&second, configure(), operation_id)
        .await
        .unwrap()
        .map_err(|e| e.0);
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "answered from the record, not at the deadline: {:?}",
        started.elapsed()
    );
    assert!(
        droplet
            .agent
            .output()
            .contains("command already executed; acknowledging again"),
        "{}",
        droplet.agent.output()
    );
    (outcome, droplet)
}

#[tokio::test]
async fn a_configure_resumed_after_the_hook_finished_but_before_its_ack_arrived_ends_ok() {
    let (outcome, droplet) = resumed_after_the_run(0, "op-42").await;
    outcome.unwrap();
    assert_eq!(
        runs(droplet.dir.path(), "hook"),
        1,
        "{}",
        droplet.agent.output()
    );
}

#[tokio::test]
async fn a_failed_hook_is_answered_from_the_record_on_redelivery_not_run_again() {
    let (outcome, droplet) = resumed_after_the_run(3, "op-43").await;
    assert_eq!(
        outcome.unwrap_err(),
        format!("agent bootstrap failed for {MACHINE}: bootstrap hook failed: exit status: 3")
    );
    assert_eq!(
        runs(droplet.dir.path(), "hook"),
        1,
        "{}",
        droplet.agent.output()
    );
}

/// A drain finished while no provider listened and the agent gave up acking; the resumed
/// drain (which has lost its grace period: the core resumes it with 1 s) is answered from the
/// record and not run again.
#[tokio::test]
async fn a_drain_resumed_by_a_new_process_is_answered_from_the_record() {
    let pki = pki();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let first =
        RunningChannel::start_on(listener, &pki, Duration::from_secs(2), AuthLimit::default());
    let droplet = droplet(&first, &pki, 0, None);
    let dir = droplet.dir.path();
    let delivery = deliver(&first, Command::Drain { grace_seconds: 30 }, "op-51");
    assert!(eventually(Duration::from_secs(10), || runs(dir, "drain") == 1).await);
    let state = kept(&first);
    kill_provider(first, delivery).await;
    release(dir, "drain");
    // The agent gives up acking while no provider listens, so only the record can answer
    // the resumed delivery.
    droplet
        .agent
        .expect_output("ack not delivered", Duration::from_secs(20))
        .await;
    let second = channel_on(addr, &pki, &state).await;
    deliver(&second, Command::Drain { grace_seconds: 1 }, "op-51")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(runs(dir, "drain"), 1, "{}", droplet.agent.output());
}

/// Readiness is a probe: a check in flight at the restart acks the resumed delivery (run
/// once), and a "not ready" that the dead process never received is asked again, so it can
/// neither be replayed nor stall the gate.
#[tokio::test]
async fn readiness_resumed_by_a_new_process_is_answered_and_a_lost_not_ready_is_asked_again() {
    let pki = pki();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let first =
        RunningChannel::start_on(listener, &pki, Duration::from_secs(2), AuthLimit::default());
    let probe_dir = tempfile::tempdir().unwrap();
    let p = probe_dir.path();
    // Ready once `ready.now` exists.
    let probe = gated(p, "probe", 0).replace(
        "exit 0\n",
        &format!("test -e '{}/ready.now'\n", p.display()),
    );
    let droplet = droplet(&first, &pki, 0, Some(&probe));
    let ready = || Command::Ready {
        cluster_id: "prod-eu".into(),
    };

    // The check is running when the provider dies; the new process's resumed delivery gets
    // its answer.
    std::fs::write(p.join("ready.now"), b"").unwrap();
    let delivery = deliver(&first, ready(), "op-61");
    assert!(eventually(Duration::from_secs(10), || runs(p, "probe") == 1).await);
    let state = kept(&first);
    kill_provider(first, delivery).await;
    let second = channel_on(addr, &pki, &state).await;
    let resumed = deliver(&second, ready(), "op-61");
    tokio::time::sleep(Duration::from_millis(200)).await;
    release(p, "probe");
    resumed.await.unwrap().unwrap();
    assert_eq!(runs(p, "probe"), 1, "{}", droplet.agent.output());

    // Another transition: the node is not ready and the answer is lost (the agent gives up
    // acking while no provider listens); the resumed delivery asks again and gets the answer
    // of now. (An answer still being retried when the new process is up reaches the resumed
    // delivery instead: it is the answer to that very check, and it ends the gate as the
    // first process would have.)
    std::fs::remove_file(p.join("probe.go")).unwrap();
    std::fs::remove_file(p.join("ready.now")).unwrap();
    let delivery = deliver(&second, ready(), "op-62");
    assert!(eventually(Duration::from_secs(10), || runs(p, "probe") == 2).await);
    let state = kept(&second);
    kill_provider(second, delivery).await;
    release(p, "probe");
    droplet
        .agent
        .expect_output("ack not delivered", Duration::from_secs(20))
        .await;
    std::fs::write(p.join("ready.now"), b"").unwrap();
    let third = channel_on(addr, &pki, &state).await;
    deliver(&third, ready(), "op-62").await.unwrap().unwrap();
    assert_eq!(runs(p, "probe"), 3, "{}", droplet.agent.output());
}

/// A state file the earlier release wrote (ids `<random prefix>-<n>`) still loads: the agent
/// starts, runs a new command, and keeps the old entries beside the new one.
#[tokio::test]
async fn an_agent_state_file_of_the_earlier_release_still_loads() {
    let (pki, channel) = RunningChannel::with_fresh_pki(Duration::from_secs(2)).await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("state")).unwrap();
    let old = r#"{"executed":[{"id":"9f2c4a1b7e30-1","outcome":{"Ok":null}},{"id":"9f2c4a1b7e30-2","outcome":{"Err":"bootstrap hook failed: exit status: 3"}},{"id":"9f2c4a1b7e30-3","outcome":null}]}"#;
    std::fs::write(dir.path().join("state/executed.json"), old).unwrap();
    let agent = AgentProcess::spawn(AgentSetup::recording(
        dir.path(),
        agent_config(&channel.endpoint(), &pki.ca_pem, MACHINE),
    ));
    channel
        .channel
        .deliver(
            MACHINE,
            configure(),
            &ctx_of("op-71", Duration::from_secs(20)),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}: {}", agent.output()));
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("state/executed.json")).unwrap())
            .unwrap();
    let ids: Vec<&str> = state["executed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids.len(), 4, "{state}");
    assert_eq!(
        &ids[..3],
        ["9f2c4a1b7e30-1", "9f2c4a1b7e30-2", "9f2c4a1b7e30-3"]
    );
    assert!(ids[3].starts_with("op-71.configure."), "{state}");
    assert_eq!(
        state["executed"][1]["outcome"]["Err"],
        "bootstrap hook failed: exit status: 3"
    );
}

/// An agent that cannot record a command as started does not run it (a crash during the run
/// could not be told from a command never run), answers why, and runs it once it can.
#[tokio::test]
async fn an_agent_that_cannot_record_a_command_does_not_run_it() {
    let (pki, channel) = RunningChannel::with_fresh_pki(Duration::from_secs(2)).await;
    let dir = tempfile::tempdir().unwrap();
    // The state file is written through `executed.tmp`; a directory there makes every write
    // fail while the (missing) state file itself loads.
    let blocker = dir.path().join("state/executed.tmp");
    std::fs::create_dir_all(&blocker).unwrap();
    let agent = AgentProcess::spawn(AgentSetup::recording(
        dir.path(),
        agent_config(&channel.endpoint(), &pki.ca_pem, MACHINE),
    ));
    let err = channel
        .channel
        .deliver(
            MACHINE,
            configure(),
            &ctx_of("op-81", Duration::from_secs(20)),
        )
        .await
        .unwrap_err();
    assert!(
        err.0.starts_with(&format!(
            "agent bootstrap failed for {MACHINE}: the agent could not record the command before \
             running it, so it did not run it: write state "
        )),
        "{err}"
    );
    assert!(!dir.path().join("hook.runs").exists(), "{}", agent.output());
    // Once the disk takes writes again, the same command runs, once.
    std::fs::remove_dir(&blocker).unwrap();
    channel
        .channel
        .deliver(
            MACHINE,
            configure(),
            &ctx_of("op-81", Duration::from_secs(20)),
        )
        .await
        .unwrap();
    assert_eq!(runs(dir.path(), "hook"), 1, "{}", agent.output());
}

/// The whole resumed Configure through the backend: the provider dies while the hook runs; a
/// new process (a new channel on the address and a new `DigitalOceanCloud` over it, against
/// the same DigitalOcean) runs `configure_host` and `confirm_ready` again under the same
/// operation id. Both end `Ok`, the hook ran once, and the cluster binding is set.
#[tokio::test]
async fn a_configure_resumed_through_the_backend_by_a_new_process_binds_the_machine_once() {
    use provider_core::backend::{BootstrapBlob, ConfigureOrder};
    use provider_core::cloud::Cloud;

    let serving = testkit::digitalocean::RunningEmulator::start(API_TOKEN).await;
    let (emulator, api_url) = (serving.emulator.clone(), serving.url.clone());
    let pki = pki();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let first =
        RunningChannel::start_on(listener, &pki, Duration::from_secs(2), AuthLimit::default());
    let cloud = cloud_for(&api_url, &first, &pki, None, PROVIDER);
    let mut m = machine(5);
    let host = create_bound(&cloud, &mut m).await;
    let d = emulator.droplet(host.id.parse().unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let hook = dir.path().join("bootstrap");
    write_executable(
        &hook,
        &format!("#!/bin/sh\n{}", gated(dir.path(), "hook", 0)),
    );
    let agent = AgentProcess::spawn(AgentSetup {
        dir: dir.path(),
        config_json: agent_config_from_user_data(&d.user_data),
        hook,
        drain_command: "true".into(),
        readiness_command: Some(format!("echo run >> '{}/probe.runs'", dir.path().display())),
    });
    let order = || ConfigureOrder {
        cluster_id: "prod-eu".into(),
        blob: BootstrapBlob(BLOB.to_vec()),
    };
    let configure = |cloud: std::sync::Arc<digitalocean::DigitalOceanCloud>| {
        let (m, host_id, order) = (m.clone(), host.id.clone(), order());
        tokio::spawn(async move {
            let ctx = ctx_of("op-91", Duration::from_secs(30));
            cloud.configure_host(&m, &host_id, &order, &ctx).await?;
            cloud.confirm_ready(&m, &host_id, "prod-eu", &ctx).await
        })
    };
    let interrupted = configure(std::sync::Arc::new(cloud));
    assert!(eventually(Duration::from_secs(10), || runs(dir.path(), "hook") == 1).await);
    interrupted.abort();
    let state = kept(&first);
    first.stop().await;

    let second = channel_on(addr, &pki, &state).await;
    let resumed = configure(std::sync::Arc::new(cloud_for(
        &api_url, &second, &pki, None, PROVIDER,
    )));
    tokio::time::sleep(Duration::from_millis(200)).await;
    release(dir.path(), "hook");
    resumed
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("{e}: {}", agent.output()));
    assert_eq!(runs(dir.path(), "hook"), 1, "{}", agent.output());
    assert_eq!(runs(dir.path(), "probe"), 1, "{}", agent.output());
    let d = emulator.droplet(host.id.parse().unwrap()).unwrap();
    assert!(
        d.tags
            .contains(&digitalocean::naming::cluster_tag("prod-eu")),
        "{:?}",
        d.tags
    );
}

//! Configure and Drain called again with the same operation id, as the engine does when it
//! resumes a transition after the provider restarted: the hook (or the drain) runs once on the
//! host, whenever the first call stopped (before the hook started, while it ran, after it
//! finished but before its outcome was taken), and a connection that drops mid-run neither
//! fails the transition nor starts the run again. Hook runs are counted by a file the hook
//! appends to.

use std::path::PathBuf;
use std::time::Duration;

use hetzner::labels;
use provider_core::backend::{BootstrapBlob, ConfigureOrder, TransitionContext};
use provider_core::cloud::Cloud;

use crate::harness::{Env, Options, deliveries, until};

fn order(cluster: &str) -> ConfigureOrder {
    ConfigureOrder {
        cluster_id: cluster.into(),
        blob: BootstrapBlob(b"resume-join-secret-material".to_vec()),
    }
}

/// A transition context for operation `operation`, as a resumed transition gets it again.
fn op(operation: &str) -> TransitionContext {
    TransitionContext::with_timeout(operation, Duration::from_secs(20))
}

/// The context the engine gives the Configure `operation` whose nonce is `nonce`.
fn nonced(operation: &str, nonce: &str) -> TransitionContext {
    let mut ctx = op(operation);
    ctx.configure_nonce = Some(nonce.to_owned());
    ctx
}

fn record(env: &Env, run: &str) -> PathBuf {
    PathBuf::from(format!("{}.runs/{run}/record", env.hook.display()))
}

#[tokio::test]
async fn configure_again_with_the_same_operation_takes_the_recorded_outcome() {
    let mut env = Env::new(Options::default()).await;
    let (machine, server) = env.created(0).await;
    let sshd = env.start_sshd_of(server, 0);
    let host = server.to_string();

    env.cloud
        .configure_host(&machine, &host, &order("c1"), &op("op-a"))
        .await
        .unwrap();
    env.cloud
        .configure_host(&machine, &host, &order("c1"), &op("op-a"))
        .await
        .unwrap();
    assert_eq!(env.hook_runs(), 1, "the hook ran once");
    assert_eq!(
        deliveries(&sshd.observed.commands()),
        1,
        "the blob went once"
    );
    assert_eq!(env.labels(server)[labels::CLUSTER], "c1");
    assert!(!env.blob_file().exists());
    let text = std::fs::read_to_string(record(&env, "configure-op-a")).unwrap();
    assert_eq!(text, "exit 0\n");

    // A new operation is a new run.
    env.cloud
        .configure_host(&machine, &host, &order("c1"), &op("op-a2"))
        .await
        .unwrap();
    assert_eq!(env.hook_runs(), 2);
    assert!(!env.logs.text().contains("resume-join-secret-material"));
}

#[tokio::test]
async fn a_configure_cancelled_while_the_hook_runs_is_resumed_by_waiting_for_that_run() {
    let mut env = Env::new(Options {
        hook_sleep: Duration::from_millis(800),
        ..Options::default()
    })
    .await;
    let (machine, server) = env.created(0).await;
    let sshd = env.start_sshd_of(server, 0);
    let host = server.to_string();

    let first = op("op-b");
    let cancel = first.cancel.clone();
    let cloud = env.cloud.clone();
    let (m, h) = (machine.clone(), host.clone());
    let running =
        tokio::spawn(async move { cloud.configure_host(&m, &h, &order("c2"), &first).await });
    until("the hook started", || env.hook_runs() == 1).await;
    cancel.cancel();
    let err = running.await.unwrap().unwrap_err();
    assert_eq!(
        err.0,
        "ssh command on 127.0.0.1 did not complete: deadline exceeded"
    );
    assert!(!env.hook_done(), "the hook was still running");

    env.cloud
        .configure_host(&machine, &host, &order("c2"), &op("op-b"))
        .await
        .unwrap();
    assert!(env.hook_done(), "the resumed Configure waited for the run");
    assert_eq!(env.hook_runs(), 1, "and did not start another");
    assert_eq!(deliveries(&sshd.observed.commands()), 1);
    assert_eq!(env.labels(server)[labels::CLUSTER], "c2");
    assert_eq!(
        env.blob_copy().as_deref(),
        Some(&b"resume-join-secret-material"[..])
    );
}

#[tokio::test]
async fn a_hook_that_finished_after_its_configure_was_dropped_is_not_run_again() {
    let mut env = Env::new(Options {
        hook_sleep: Duration::from_millis(300),
        ..Options::default()
    })
    .await;
    let (machine, server) = env.created(0).await;
    let sshd = env.start_sshd_of(server, 0);
    let host = server.to_string();

    // The provider dies right after the start: the future is dropped mid-poll.
    let (first, c3) = (op("op-c"), order("c3"));
    tokio::select! {
        r = env.cloud.configure_host(&machine, &host, &c3, &first) => {
            panic!("finished before the hook started: {r:?}")
        }
        _ = until("the hook started", || env.hook_runs() == 1) => {}
    }
    let done = record(&env, "configure-op-c");
    until("the run recorded its outcome", || done.exists()).await;
    assert!(!env.labels(server).contains_key(labels::CLUSTER));

    env.cloud
        .configure_host(&machine, &host, &order("c3"), &op("op-c"))
        .await
        .unwrap();
    assert_eq!(env.hook_runs(), 1);
    assert_eq!(deliveries(&sshd.observed.commands()), 1);
    assert_eq!(env.labels(server)[labels::CLUSTER], "c3");
}

#[tokio::test]
async fn a_failed_hooks_recorded_outcome_is_taken_on_resume() {
    let mut env = Env::new(Options {
        hook_exit: 3,
        hook_sleep: Duration::from_millis(200),
        hook_says: Some("join refused by the cluster".into()),
        ..Options::default()
    })
    .await;
    let (machine, server) = env.created(0).await;
    let _sshd = env.start_sshd_of(server, 0);
    let host = server.to_string();

    let (first, c4) = (op("op-d"), order("c4"));
    tokio::select! {
        r = env.cloud.configure_host(&machine, &host, &c4, &first) => {
            panic!("finished before the hook started: {r:?}")
        }
        _ = until("the hook started", || env.hook_runs() == 1) => {}
    }
    let done = record(&env, "configure-op-d");
    until("the run recorded its outcome", || done.exists()).await;

    for _ in 0..2 {
        let err = env
            .cloud
            .configure_host(&machine, &host, &order("c4"), &op("op-d"))
            .await
            .unwrap_err();
        assert_eq!(
            err.0,
            "ssh command on 127.0.0.1 failed: Process exited with status 3 (output ends: join \
             refused by the cluster)"
        );
    }
    assert_eq!(env.hook_runs(), 1, "a failed run is not repeated");
    assert!(!env.labels(server).contains_key(labels::CLUSTER));
    assert!(
        !env.blob_file().exists(),
        "the blob is gone after a failure too"
    );
}

#[tokio::test]
async fn a_connection_dropped_mid_hook_neither_fails_configure_nor_repeats_the_hook() {
    let mut env = Env::new(Options {
        hook_sleep: Duration::from_millis(600),
        ..Options::default()
    })
    .await;
    let (machine, server) = env.created(0).await;
    let key = env.injected_host_key(server);
    let (sshd, relay) = env.start_sshd_behind_relay(key).await;
    let host = server.to_string();

    let (ctx, c5) = (op("op-e"), order("c5"));
    let configure = env.cloud.configure_host(&machine, &host, &c5, &ctx);
    let cut = async {
        until("the hook started", || env.hook_runs() == 1).await;
        relay.cut();
        tokio::time::sleep(Duration::from_millis(100)).await;
        relay.cut();
    };
    let (result, ()) = tokio::join!(configure, cut);
    result.unwrap();
    assert_eq!(env.hook_runs(), 1);
    assert!(env.hook_done());
    assert_eq!(deliveries(&sshd.observed.commands()), 1);
    assert!(
        relay.connections() >= 2,
        "reconnected ({})",
        relay.connections()
    );
    assert_eq!(env.labels(server)[labels::CLUSTER], "c5");
}

#[tokio::test]
async fn readiness_survives_a_dropped_connection() {
    // Succeeds on its third run (commands run in the server's working directory).
    let command = "n=$(cat runs 2>/dev/null || echo 0); n=$((n+1)); echo $n > runs; [ $n -ge 3 ]";
    let mut env = Env::new(Options {
        readiness_command: Some(command.into()),
        ..Options::default()
    })
    .await;
    let (machine, server) = env.created(0).await;
    let key = env.injected_host_key(server);
    let (_sshd, relay) = env.start_sshd_behind_relay(key).await;
    let host = server.to_string();
    let ctx = op("op-r");
    env.cloud
        .configure_host(&machine, &host, &order("c6"), &ctx)
        .await
        .unwrap();
    let runs = env.dir.path().join("runs");
    let ready = env.cloud.confirm_ready(&machine, &host, "c6", &ctx);
    let cut = async {
        until("the first readiness run", || runs.exists()).await;
        relay.cut();
    };
    let (result, ()) = tokio::join!(ready, cut);
    result.unwrap();
    assert!(
        relay.connections() >= 2,
        "reconnected ({})",
        relay.connections()
    );
}

/// Replaces the node's `kubectl` with one whose drain takes `seconds`.
fn slow_kubectl(env: &Env, seconds: f64) {
    use std::os::unix::fs::PermissionsExt;
    let path = env.dir.path().join("bin/kubectl");
    let calls = env.dir.path().join("kubectl.calls");
    std::fs::write(
        &path,
        format!(
            "#!/bin/sh\necho \"$@\" >> '{}'\ncase \"$1\" in drain) sleep {seconds};; esac\n",
            calls.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

fn drains(env: &Env) -> usize {
    env.kubectl_calls()
        .lines()
        .filter(|l| l.starts_with("drain "))
        .count()
}

#[tokio::test]
async fn a_drain_resumed_with_the_same_operation_drains_once() {
    let mut env = Env::new(Options::default()).await;
    let (machine, server) = env.created(0).await;
    let key = env.injected_host_key(server);
    let (_sshd, relay) = env.start_sshd_behind_relay(key).await;
    let host = server.to_string();
    env.cloud
        .configure_host(&machine, &host, &order("c7"), &op("op-f0"))
        .await
        .unwrap();
    slow_kubectl(&env, 0.8);

    // Cancelled mid-drain, then resumed: the same drain is waited for.
    let first = op("op-f");
    let cancel = first.cancel.clone();
    let cloud = env.cloud.clone();
    let (m, h) = (machine.clone(), host.clone());
    let running = tokio::spawn(async move { cloud.drain_host(&m, &h, 5, &first).await });
    until("the drain started", || drains(&env) == 1).await;
    cancel.cancel();
    assert!(running.await.unwrap().is_err());
    assert_eq!(env.labels(server)[labels::CLUSTER], "c7", "not drained yet");

    // The resumed Drain loses its connection mid-drain too.
    let resumed = op("op-f");
    let drain = env.cloud.drain_host(&machine, &host, 5, &resumed);
    let cut = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        relay.cut();
    };
    let (result, ()) = tokio::join!(drain, cut);
    result.unwrap();
    assert_eq!(drains(&env), 1, "{}", env.kubectl_calls());
    assert!(!env.labels(server).contains_key(labels::CLUSTER));

    // Once more after it finished: the recorded outcome, no new drain.
    env.cloud
        .drain_host(&machine, &host, 5, &op("op-f"))
        .await
        .unwrap();
    assert_eq!(drains(&env), 1);
    let text = std::fs::read_to_string(record(&env, "drain-op-f")).unwrap();
    assert_eq!(text, "exit 0\n");
}

#[tokio::test]
async fn a_failed_drains_outcome_is_taken_on_resume() {
    let mut env = Env::new(Options::default()).await;
    let (machine, server) = env.created(0).await;
    let _sshd = env.start_sshd_of(server, 0);
    let host = server.to_string();
    env.cloud
        .configure_host(&machine, &host, &order("c8"), &op("op-g0"))
        .await
        .unwrap();
    use std::os::unix::fs::PermissionsExt;
    let path = env.dir.path().join("bin/kubectl");
    let calls = env.dir.path().join("kubectl.calls");
    std::fs::write(
        &path,
        format!(
            "#!/bin/sh\necho \"$@\" >> '{}'\ncase \"$1\" in drain) echo 'cannot evict pod web-1' >&2; exit 1;; esac\n",
            calls.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    for _ in 0..2 {
        let err = env
            .cloud
            .drain_host(&machine, &host, 5, &op("op-g"))
            .await
            .unwrap_err();
        assert_eq!(
            err.0,
            "ssh command on 127.0.0.1 failed: Process exited with status 1 (output ends: cannot \
             evict pod web-1)"
        );
    }
    assert_eq!(drains(&env), 1);
    assert_eq!(
        env.labels(server)[labels::CLUSTER],
        "c8",
        "the binding stays"
    );
}

/// A provider whose state was lost counts operation ids from `op-1` again, and a server it
/// adopts again still holds the finished runs of its earlier Configures under those ids, both
/// as a release before nonces named them (`configure-op-1`) and with a nonce. A new Configure
/// under the same operation id has a nonce of its own: its hook runs, and no earlier record
/// answers for it; the same Configure resumed (its nonce again) takes its own record.
#[tokio::test]
async fn after_a_state_loss_no_earlier_run_under_the_same_operation_id_answers_a_new_configure() {
    let mut env = Env::new(Options::default()).await;
    let (machine, server) = env.created(0).await;
    let sshd = env.start_sshd_of(server, 0);
    let host = server.to_string();

    // Before the loss: a release before nonces, then this one.
    env.cloud
        .configure_host(&machine, &host, &order("c1"), &op("op-1"))
        .await
        .unwrap();
    assert!(record(&env, "configure-op-1").exists());
    env.cloud
        .configure_host(
            &machine,
            &host,
            &order("c1"),
            &nonced("op-1", "00000000000000a1"),
        )
        .await
        .unwrap();
    assert_eq!(
        env.hook_runs(),
        2,
        "an earlier release's run answers no Configure with a nonce"
    );
    // After it: op-1 again, another Configure.
    let after = nonced("op-1", "00000000000000b2");
    env.cloud
        .configure_host(&machine, &host, &order("c1"), &after)
        .await
        .unwrap();
    assert_eq!(env.hook_runs(), 3, "the new Configure ran its hook");
    assert!(record(&env, "configure-op-1-n00000000000000b2").exists());
    // The same Configure resumed: answered from its own record.
    env.cloud
        .configure_host(
            &machine,
            &host,
            &order("c1"),
            &nonced("op-1", "00000000000000b2"),
        )
        .await
        .unwrap();
    assert_eq!(env.hook_runs(), 3);
    assert_eq!(
        deliveries(&sshd.observed.commands()),
        3,
        "one delivery per Configure"
    );
}

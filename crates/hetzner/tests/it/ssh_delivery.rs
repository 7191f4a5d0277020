//! SSH delivery against a real SSH server: host-key pinning (MITM refused before any byte of
//! the blob leaves), trust on first use for adopted servers, reachability retries, failing
//! hooks, the readiness gate, and Drain without `--ssh-key`.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use hetzner::hostkey;
use hetzner::labels;
use provider_core::backend::{BootstrapBlob, ConfigureOrder};
use provider_core::cloud::Cloud;

use testkit::logs::occurrences;

use crate::harness::{Env, Options, PROVIDER, bound, ctx, new_key};

fn order(cluster: &str) -> ConfigureOrder {
    ConfigureOrder {
        cluster_id: cluster.into(),
        blob: BootstrapBlob(b"join-secret-material".to_vec()),
    }
}

#[tokio::test]
async fn a_host_presenting_another_key_never_receives_the_blob() {
    let mut env = Env::new(Options::default()).await;
    let (machine, server) = env.created(0).await;
    let pinned = env.labels(server)[labels::HOST_KEY_FP].clone();
    let impostor = new_key();
    let presented = hostkey::fingerprint(impostor.public_key());
    let sshd = env.start_sshd(impostor, 0);

    let err = env
        .configure(&machine, server, &order("c1"), 10)
        .await
        .unwrap_err();
    assert_eq!(
        err.0,
        crate::harness::host_key_mismatch(&pinned, &presented)
    );
    assert_eq!(
        sshd.observed.connections.load(Ordering::SeqCst),
        1,
        "a mismatch is not retried"
    );
    assert_eq!(
        sshd.observed.authenticated.load(Ordering::SeqCst),
        0,
        "we never even logged in"
    );
    assert!(sshd.observed.commands().is_empty());
    assert_eq!(sshd.observed.stdin_bytes.load(Ordering::SeqCst), 0);
    assert!(!env.blob_file().exists(), "the blob never reached the host");
    assert!(env.hook_args().is_none());
    assert!(!env.labels(server).contains_key(labels::CLUSTER));
    assert_eq!(
        env.labels(server)[labels::HOST_KEY_FP],
        pinned,
        "the pin is untouched"
    );
}

#[tokio::test]
async fn an_adopted_server_without_a_pin_is_pinned_on_first_use() {
    let mut env = Env::new(Options::default()).await;
    let machine_id = provider_core::fleet::slot_id(PROVIDER, "cx23", "nbg1", 7);
    let mut l: HashMap<String, String> = HashMap::from([(labels::MANAGED.into(), "true".into())]);
    l.extend(labels::machine_id_labels(&machine_id));
    l.extend(labels::text_labels(labels::PROVIDER, PROVIDER));
    let server =
        env.emulator
            .insert_server("made-by-an-older-version", "cx23", "nbg1", l, "127.0.0.1");
    let hosts = env.cloud.list_hosts().await.unwrap();
    assert_eq!(hosts.len(), 1);
    assert_eq!(hosts[0].machine_id, machine_id);

    let host_key = new_key();
    let expected = hostkey::fingerprint(host_key.public_key());
    let _sshd = env.start_sshd(host_key, 0);
    let machine = bound(env.machine("cx23", "nbg1", 7), &server.to_string());
    env.configure(&machine, server, &order("c2"), 10)
        .await
        .unwrap();

    let logs = env.logs.text();
    let warn = logs
        .lines()
        .find(|l| l.contains("pinning SSH host key on first use (no pre-injected key)"))
        .expect("TOFU is logged");
    assert!(warn.contains("WARN"), "{warn}");
    assert!(warn.contains(&format!("server={server}")), "{warn}");
    assert_eq!(
        env.labels(server)[labels::HOST_KEY_FP],
        expected,
        "the observed key is pinned"
    );
    assert_eq!(env.hook_args().as_deref(), Some("c2\n"));
    assert_eq!(env.labels(server)[labels::CLUSTER], "c2");
    assert!(
        !logs.contains("join-secret-material"),
        "the blob is never logged"
    );
}

#[tokio::test]
async fn after_first_use_the_pin_is_enforced() {
    let mut env = Env::new(Options::default()).await;
    let (machine, server) = env.created(0).await;
    // Forget the pin, as if the server had been made before pinning existed.
    let mut l = env.labels(server);
    l.remove(labels::HOST_KEY_FP);
    env.emulator.set_labels(server, l);
    let first = new_key();
    let _sshd = env.start_sshd(first, 0);
    env.configure(&machine, server, &order("c3"), 10)
        .await
        .unwrap();
    let pinned = env.labels(server)[labels::HOST_KEY_FP].clone();
    // Same server, different key on the next connection: refused.
    let mut tampered = env.labels(server);
    tampered.insert(
        labels::HOST_KEY_FP.into(),
        hostkey::fingerprint(new_key().public_key()),
    );
    env.emulator.set_labels(server, tampered);
    let err = env
        .cloud
        .drain_host(&machine, &server.to_string(), 5, &ctx(10))
        .await
        .unwrap_err();
    assert!(err.0.contains("host key mismatch"), "{}", err.0);
    assert!(env.kubectl_calls().is_empty(), "no drain ran");
    assert_ne!(pinned, "");
}

#[tokio::test]
async fn ssh_is_retried_until_the_server_accepts_connections() {
    let mut env = Env::new(Options::default()).await;
    let (machine, server) = env.created(0).await;
    let sshd = env.start_sshd_of(server, 3);
    env.configure(&machine, server, &order("c4"), 20)
        .await
        .unwrap();
    assert_eq!(sshd.observed.connections.load(Ordering::SeqCst), 4);
    assert_eq!(env.hook_args().as_deref(), Some("c4\n"));
}

#[tokio::test]
async fn a_server_that_never_answers_fails_at_the_deadline() {
    // The port accepts TCP (the kernel's backlog) but no SSH server ever speaks.
    let env = Env::new(Options::default()).await;
    let (machine, server) = env.created(0).await;
    let started = std::time::Instant::now();
    let err = env
        .configure(&machine, server, &order("c5"), 1)
        .await
        .unwrap_err();
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    assert_eq!(err.0, "ssh dial 127.0.0.1: connection attempt timed out");
}

#[tokio::test]
async fn a_refused_port_is_retried_until_the_deadline() {
    let mut env = Env::new(Options::default()).await;
    let (machine, server) = env.created(0).await;
    env.refuse_ssh();
    let err = env
        .configure(&machine, server, &order("c5"), 1)
        .await
        .unwrap_err();
    assert!(err.0.starts_with("ssh dial 127.0.0.1: "), "{}", err.0);
    assert!(err.0.to_lowercase().contains("refused"), "{}", err.0);
    let retries = env.logs.count("SSH not reachable yet; retrying");
    assert!(retries >= 2, "retried ({retries})");
}

#[tokio::test]
async fn a_failing_hook_fails_configure_with_the_exit_status() {
    let mut env = Env::new(Options {
        hook_exit: 3,
        ..Options::default()
    })
    .await;
    let (machine, server) = env.created(0).await;
    let _sshd = env.start_sshd_of(server, 0);
    let err = env
        .configure(&machine, server, &order("c6"), 10)
        .await
        .unwrap_err();
    assert_eq!(
        err.0,
        "ssh command on 127.0.0.1 failed: Process exited with status 3"
    );
    assert_eq!(env.hook_args().as_deref(), Some("c6\n"), "the hook did run");
    assert!(
        !env.labels(server).contains_key(labels::CLUSTER),
        "no binding after a failed hook"
    );
}

#[tokio::test]
async fn readiness_that_never_comes_fails_at_the_deadline() {
    let mut env = Env::new(Options {
        readiness_command: Some("exit 1".into()),
        ..Options::default()
    })
    .await;
    assert!(env.cloud.has_readiness_gate());
    let (machine, server) = env.created(0).await;
    let sshd = env.start_sshd_of(server, 0);
    let ctx = ctx(2);
    env.cloud
        .configure_host(&machine, &server.to_string(), &order("c7"), &ctx)
        .await
        .unwrap();
    let err = env
        .cloud
        .confirm_ready(&machine, &server.to_string(), "c7", &ctx)
        .await
        .unwrap_err();
    assert_eq!(
        err.0,
        "readiness: --readiness-command did not succeed on 127.0.0.1 before the Configure deadline (last exit status 1)"
    );
    let runs = occurrences(&sshd.observed.commands(), "exit 1");
    assert!(runs >= 2, "polled until the deadline ({runs} runs)");
    assert_eq!(
        sshd.observed.connections.load(Ordering::SeqCst),
        1,
        "over the same pinned connection"
    );
}

#[tokio::test]
async fn readiness_confirms_once_the_command_succeeds() {
    // Succeeds on its third run (commands run in the server's working directory).
    let command = "n=$(cat runs 2>/dev/null || echo 0); n=$((n+1)); echo $n > runs; [ $n -ge 3 ]";
    let mut env = Env::new(Options {
        readiness_command: Some(command.into()),
        ..Options::default()
    })
    .await;
    let (machine, server) = env.created(0).await;
    let sshd = env.start_sshd_of(server, 0);
    let ctx = ctx(10);
    env.cloud
        .configure_host(&machine, &server.to_string(), &order("c8"), &ctx)
        .await
        .unwrap();
    env.cloud
        .confirm_ready(&machine, &server.to_string(), "c8", &ctx)
        .await
        .unwrap();
    assert_eq!(
        sshd.observed
            .commands()
            .iter()
            .filter(|c| *c == command)
            .count(),
        3
    );
    assert_eq!(sshd.observed.connections.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn without_an_ssh_key_configure_and_drain_refuse_honestly() {
    let env = Env::without_ssh().await;
    assert!(!env.cloud.ssh_enabled());
    let (machine, server) = env.created(0).await;
    let err = env
        .configure(&machine, server, &order("c9"), 5)
        .await
        .unwrap_err();
    assert_eq!(
        err.0,
        format!(
            "configure: SSH delivery disabled (set --ssh-key); cannot deliver bootstrap to {server}"
        )
    );
    let mut l = env.labels(server);
    l.insert(labels::CLUSTER.into(), "joined".into());
    env.emulator.set_labels(server, l);
    let err = env
        .cloud
        .drain_host(&machine, &server.to_string(), 30, &ctx(5))
        .await
        .unwrap_err();
    assert!(
        err.0.contains("cannot be drained without --ssh-key"),
        "{}",
        err.0
    );
    assert_eq!(
        env.labels(server)[labels::CLUSTER],
        "joined",
        "the binding is not dropped while the node is joined"
    );
}

#[tokio::test]
async fn a_cluster_id_outside_label_syntax_is_encoded_and_read_back() {
    let mut env = Env::new(Options::default()).await;
    let (machine, server) = env.created(0).await;
    let _sshd = env.start_sshd_of(server, 0);
    let cluster = "team a/cluster 'prod' #1";
    env.configure(&machine, server, &order(cluster), 10)
        .await
        .unwrap();
    assert_eq!(
        env.hook_args().as_deref(),
        Some(format!("{cluster}\n").as_str())
    );
    let stored = env.labels(server);
    assert!(stored[labels::CLUSTER].starts_with("b32."));
    let hosts = env.cloud.list_hosts().await.unwrap();
    assert_eq!(hosts[0].cluster.as_deref(), Some(cluster));
}

#[tokio::test]
async fn ssh_can_go_over_the_private_network_only() {
    let mut env = Env::new(Options {
        network: Some("bigfleet-mgmt".into()),
        ssh_address: hetzner::cloud::SshAddress::Private,
        ..Options::default()
    })
    .await;
    // The public address refuses connections; only the private one reaches the SSH server.
    env.emulator.set_new_server_ipv4("127.0.0.2");
    env.emulator.set_new_server_private_ip("127.0.0.1");
    let (machine, server) = env.created(0).await;
    let stored = env.emulator.server(server).unwrap();
    assert_eq!(stored.private_net.len(), 1);
    assert_eq!(
        stored.private_net[0].network,
        Some(9001),
        "attached to --network at create"
    );
    let _sshd = env.start_sshd_of(server, 0);
    env.configure(&machine, server, &order("c10"), 10)
        .await
        .unwrap();
    assert_eq!(env.hook_args().as_deref(), Some("c10\n"));
}

#[tokio::test]
async fn an_unknown_network_fails_create_before_any_server_exists() {
    let env = Env::new(Options {
        network: Some("nope".into()),
        ..Options::default()
    })
    .await;
    let err = env.create_fails(&env.machine("cx23", "nbg1", 0), 10).await;
    assert_eq!(
        err.0,
        "create server cx23: offering cx23/nbg1 --network: network \"nope\" does not exist"
    );
    assert!(env.emulator.servers().is_empty());
}

#[tokio::test]
async fn a_login_the_server_refuses_fails_after_a_few_tries() {
    let mut env = Env::new(Options::default()).await;
    let (machine, server) = env.created(0).await;
    let key = env.injected_host_key(server);
    let stranger = new_key().public_key().clone();
    let sshd = env.start_sshd_authorizing(key, stranger, 0);
    let err = env
        .configure(&machine, server, &order("c11"), 10)
        .await
        .unwrap_err();
    assert_eq!(
        err.0,
        "ssh handshake 127.0.0.1: the server rejected public-key authentication as \"root\" (is the \
         --ssh-key public key authorised for --ssh-user on the image?)"
    );
    assert_eq!(
        sshd.observed.connections.load(Ordering::SeqCst),
        2,
        "one retry (auth_retries = 1 in tests)"
    );
    assert!(sshd.observed.commands().is_empty());
}

#[tokio::test]
async fn another_machines_server_is_never_configured() {
    let mut env = Env::new(Options::default()).await;
    let (_, server) = env.created(0).await;
    let other = bound(env.machine("cx23", "nbg1", 1), &server.to_string());
    let sshd = env.start_sshd_of(server, 0);
    let err = env
        .configure(&other, server, &order("c12"), 10)
        .await
        .unwrap_err();
    assert_eq!(
        err.0,
        format!(
            "configure: server {server} is not labelled as machine \"{}\" of provider \"{PROVIDER}\"; refusing to touch it",
            other.id
        )
    );
    assert_eq!(sshd.observed.connections.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn the_emulators_sshd_plays_each_server_with_its_injected_key_and_own_root() {
    let mut env = Env::new(Options::default()).await;
    let (machine, server) = env.created(0).await;
    let sshd = env.start_emulator_sshd();
    env.configure(&machine, server, &order("c13"), 10)
        .await
        .unwrap();
    assert_eq!(env.hook_args().as_deref(), Some("c13\n"));
    assert_eq!(
        env.blob_copy().as_deref(),
        Some(&b"join-secret-material"[..])
    );
    env.cloud
        .drain_host(&machine, &server.to_string(), 5, &ctx(10))
        .await
        .unwrap();
    let root = env.dir.path().join("servers").join(server.to_string());
    let calls = std::fs::read_to_string(root.join("kubectl.calls")).unwrap();
    assert_eq!(
        calls,
        format!(
            "cordon server-{server}\ndrain server-{server} --ignore-daemonsets --delete-emptydir-data --grace-period=5 --timeout=5s\n"
        )
    );
    assert!(
        env.kubectl_calls().is_empty(),
        "the per-server root's kubectl ran"
    );
    assert_eq!(sshd.observed.authenticated.load(Ordering::SeqCst), 2);
}

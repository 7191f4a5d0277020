//! The `hetzner` binary on its **real** backend, pointed at the local Hetzner Cloud API emulator
//! (`hcloud-emulator`), over mTLS like the fake-backend runs, with real SSH delivery:
//!
//! - the emulator also plays the servers' sshd (`--ssh-listen`): servers report 127.0.0.1 as
//!   their public IPv4, a connection presents the host key the provider injected via user-data
//!   and runs commands with `sh -c` in the server's root `<dir>/servers/<id>`, whose `bin/` holds
//!   a stand-in `kubectl` that records its calls;
//! - the provider gets an ed25519 `--ssh-key` (made with `ssh-keygen`), `--ssh-port` of that
//!   sshd and a relative `--bootstrap-hook` (so it resolves inside each server's root);
//! - the first-boot inventory has one SPECULATIVE slot per offered server, priced from the
//!   emulator's live (net) prices;
//! - Create makes a server in the emulator and settles IDLE with its host; Delete removes it;
//! - Configure delivers the blob over SSH (`<hook>.blob` holds it byte for byte while the hook
//!   runs, which copies it, and is gone afterwards) and runs the hook with the cluster id:
//!   CONFIGURED; Drain cordons and drains through `kubectl`: IDLE;
//! - after a restart with no state file, the inventory is rebuilt from the servers' labels: the
//!   drained machine is IDLE on the same server, the deleted one SPECULATIVE, no duplicates;
//!   Delete then returns it to SPECULATIVE.
//!
//! Host-key mismatches, retries, failing hooks and readiness are covered by the hetzner crate's
//! integration tests against the same SSH server.
//!
//! The flags of the real backend, the client key and the servers' stand-in hook are shared with
//! `cargo xtask bench --scenario cloud-budget`, which walks a machine the same way.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result, bail, ensure};
use fleet_proto::v1alpha1 as pb;

use super::SETTLE;
use super::provider_process::{self, Spec};
use super::wire::{self, Caller, ClientSecurity, Shard, state_of};

const TOKEN: &str = "e2e-hcloud-token";
const OFFERINGS: &str = r#"[
  {"server_type": "cx23", "location": "nbg1", "count": 2},
  {"server_type": "cax11", "location": "fsn1", "count": 1}
]"#;

/// Where the provider finds the hook, relative to the SSH command's working directory (the
/// server's root).
pub(crate) const HOOK: &str = "opt/bigfleet/bootstrap";
const CLUSTER: &str = "e2e-cluster";

/// The emulator process; killed when dropped.
struct Emulator {
    child: Child,
    endpoint: String,
    ssh_port: u16,
}

impl Drop for Emulator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Emulator {
    fn start(root: &Path, dir: &Path, authorized: &Path) -> Result<Emulator> {
        let binary = provider_process::target_binary(root, "debug", "hcloud-emulator");
        let servers = dir.join("servers");
        let mut child = Command::new(&binary)
            .args([
                "--listen",
                "127.0.0.1:0",
                "--token",
                TOKEN,
                "--polls-to-running",
                "0",
                "--server-ipv4",
                "127.0.0.1",
                "--ssh-listen",
                "127.0.0.1:0",
            ])
            .arg("--ssh-authorized-key")
            .arg(authorized)
            .arg("--ssh-root")
            .arg(&servers)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("start {}", binary.display()))?;
        let stdout = child.stdout.take().context("emulator stdout")?;
        let mut reader = BufReader::new(stdout);
        let mut read = |prefix: &str| -> Result<String> {
            let mut line = String::new();
            reader
                .read_line(&mut line)
                .context("read the emulator's addresses")?;
            match line.trim().strip_prefix(prefix) {
                Some(rest) => Ok(rest.to_owned()),
                None => bail!("hcloud-emulator printed {line:?} instead of {prefix:?}ADDR"),
            }
        };
        let addresses = read("listening on ").and_then(|endpoint| {
            let ssh: std::net::SocketAddr = read("ssh listening on ")?
                .parse()
                .context("the emulator's SSH address")?;
            Ok((endpoint, ssh))
        });
        let (endpoint, ssh) = match addresses {
            Ok(a) => a,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(e);
            }
        };
        ensure!(
            ssh.ip().is_loopback(),
            "the emulator's sshd is not on loopback: {ssh}"
        );
        Ok(Emulator {
            endpoint,
            ssh_port: ssh.port(),
            child,
        })
    }
}

/// A fresh ed25519 client key (`<dir>/id_ed25519`, public half `.pub`), via `ssh-keygen`.
pub(crate) fn client_key(dir: &Path) -> Result<PathBuf> {
    let key = dir.join("id_ed25519");
    let out = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C", "bigfleet-e2e", "-f"])
        .arg(&key)
        .stdin(Stdio::null())
        .output()
        .context("run ssh-keygen (install openssh-client) to make the e2e SSH key")?;
    ensure!(
        out.status.success(),
        "ssh-keygen failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(key)
}

/// Server `host`'s root, where the emulator's sshd runs its commands.
pub(crate) fn server_root(dir: &Path, host: &str) -> PathBuf {
    dir.join("servers").join(host)
}

/// Installs the stand-in bootstrap hook in `host`'s root: it records its arguments and copies
/// the blob (which is removed when it exits).
pub(crate) fn install_hook(dir: &Path, host: &str) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let hook = server_root(dir, host).join(HOOK);
    let parent = hook.parent().context("hook parent")?;
    std::fs::create_dir_all(parent).with_context(|| format!("create {}", parent.display()))?;
    let body = "#!/bin/sh\nprintf '%s\\n' \"$@\" > hook.args\ncp \"$0.blob\" hook.blob.copy\n";
    std::fs::write(&hook, body).with_context(|| format!("write {}", hook.display()))?;
    std::fs::set_permissions(&hook, std::fs::Permissions::from_mode(0o755))
        .with_context(|| format!("chmod {}", hook.display()))
}

pub(super) fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))
}

/// The flags of the real backend against an emulator at `endpoint` that accepts `token`.
pub(crate) fn backend_args(token: &str, endpoint: &str, offerings: &Path) -> Vec<String> {
    vec![
        "--hetzner-backend=hetzner".into(),
        format!("--token={token}"),
        format!("--hcloud-endpoint={endpoint}"),
        "--image=ubuntu-24.04".into(),
        format!("--offerings={}", offerings.display()),
    ]
}

/// The flags of SSH delivery to the emulator's sshd on `port` with the client `key`, running
/// the stand-in [`HOOK`].
pub(crate) fn ssh_args(key: &Path, port: u16) -> Vec<String> {
    vec![
        format!("--ssh-key={}", key.display()),
        format!("--ssh-port={port}"),
        format!("--bootstrap-hook={HOOK}"),
    ]
}

fn spec(root: &Path, emulator: &Emulator, offerings: &Path, key: &Path) -> Spec {
    let endpoint = &emulator.endpoint;
    let pki = wire::pki_dir(root);
    let pem = |name: &str| pki.join(name).display().to_string();
    Spec {
        name: "hetzner (real backend)".into(),
        binary: provider_process::target_binary(root, "debug", "hetzner"),
        args: backend_args(TOKEN, endpoint, offerings)
            .into_iter()
            .chain(ssh_args(key, emulator.ssh_port))
            .chain([
                format!("--tls-cert={}", pem("server.pem")),
                format!("--tls-key={}", pem("server-key.pem")),
                format!("--tls-ca={}", pem("ca.pem")),
                "--shutdown-grace=5s".into(),
                "--log-level=info".into(),
            ])
            .collect(),
        metrics: true,
        security: ClientSecurity::Mtls,
        pki,
    }
}

pub(crate) fn host_of(machine: &pb::Machine) -> String {
    machine
        .host
        .as_ref()
        .map(|h| h.r#ref.clone())
        .unwrap_or_default()
}

/// Runs the whole check; `Err` names what deviated.
pub(crate) async fn run(root: &Path) -> Result<()> {
    let dir: PathBuf =
        std::env::temp_dir().join(format!("bigfleet-e2e-hetzner-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    let result = async {
        let key = client_key(&dir)?;
        let emulator = Emulator::start(root, &dir, &key.with_extension("pub"))?;
        let offerings = dir.join("offerings.json");
        std::fs::write(&offerings, OFFERINGS).context("write the offerings")?;
        exercise(&dir, &spec(root, &emulator, &offerings, &key)).await
    }
    .await;
    let _ = std::fs::remove_dir_all(&dir);
    result
}

async fn exercise(dir: &Path, spec: &Spec) -> Result<()> {
    use pb::MachineState::*;
    let mut provider = provider_process::start(spec.clone()).await?;
    let checks = async {
        let mut caller = Caller::new(
            provider.default_channel().await?,
            Shard::new(wire::TEST_SHARD, 1),
        );
        let first = caller.list_all().await?;
        ensure!(
            first.len() == 3,
            "want 3 offered slots, got {}: {first:#?}",
            first.len()
        );
        for m in &first {
            ensure!(
                state_of(m) == Speculative,
                "{} is not SPECULATIVE at first boot",
                m.id
            );
            ensure!(m.price_per_hour > 0.0, "{} has no price", m.id);
        }
        let cx23: Vec<&pb::Machine> = first.iter().filter(|m| m.instance_type == "cx23").collect();
        let (kept, dropped) = (cx23[0].id.clone(), cx23[1].id.clone());

        caller.create(&kept).await?;
        let idle = caller
            .wait_for_state(&kept, Idle, SETTLE)
            .await
            .context("Create")?;
        let host = host_of(&idle);
        ensure!(!host.is_empty(), "IDLE without a host: {idle:?}");
        caller.create(&dropped).await?;
        caller
            .wait_for_state(&dropped, Idle, SETTLE)
            .await
            .context("second Create")?;
        caller.delete(&dropped).await?;
        let gone = caller
            .wait_for_state(&dropped, Speculative, SETTLE)
            .await
            .context("Delete")?;
        ensure!(
            gone.host.is_none(),
            "SPECULATIVE with a host after Delete: {gone:?}"
        );

        install_hook(dir, &host)?;
        caller.configure(&kept, CLUSTER, HashMap::new()).await?;
        let configured = caller
            .wait_for_state(&kept, Configured, SETTLE)
            .await
            .context("Configure over SSH")?;
        ensure!(
            host_of(&configured) == host,
            "CONFIGURED on another host: {configured:?}"
        );
        let server = server_root(dir, &host);
        let sent = wire::configure_request(&kept, CLUSTER, HashMap::new(), (String::new(), 0, 0))
            .bootstrap_blob;
        let copy = server.join("hook.blob.copy");
        let delivered = std::fs::read(&copy).with_context(|| format!("read {}", copy.display()))?;
        ensure!(
            delivered == sent,
            "the hook read {:?} from {HOOK}.blob, want the blob {:?}",
            String::from_utf8_lossy(&delivered),
            String::from_utf8_lossy(&sent)
        );
        let blob = server.join(format!("{HOOK}.blob"));
        ensure!(
            !blob.exists(),
            "{} is still there after the hook exited",
            blob.display()
        );
        let args = read_text(&server.join("hook.args")).context("the hook did not run")?;
        ensure!(
            args == format!("{CLUSTER}\n"),
            "the hook ran with {args:?}, want the cluster id {CLUSTER:?}"
        );

        caller.drain(&kept).await?;
        let drained = caller
            .wait_for_state(&kept, Idle, SETTLE)
            .await
            .context("Drain over SSH")?;
        ensure!(
            host_of(&drained) == host,
            "IDLE on another host after Drain: {drained:?}"
        );
        let node = format!("server-{host}");
        let calls = read_text(&server.join("kubectl.calls")).context("kubectl never ran")?;
        ensure!(
            calls.lines().next() == Some(&format!("cordon {node}")[..])
                && calls
                    .lines()
                    .any(|l| l.starts_with(&format!("drain {node} --ignore-daemonsets"))),
            "Drain ran kubectl as {calls:?}"
        );
        Ok::<_, anyhow::Error>(host)
    };
    let host = match checks.await {
        Ok(host) => host,
        Err(e) => bail!("{e:#}\nprovider log:\n{}", provider.logs()),
    };
    provider
        .stop(super::STOP_DEADLINE)
        .await
        .context("SIGTERM must exit 0")?;

    // No --state: the second incarnation rebuilds its inventory from the servers' labels.
    let mut provider = provider_process::start(spec.clone())
        .await
        .context("restart")?;
    let checks = async {
        let mut caller = Caller::new(
            provider.default_channel().await?,
            Shard::new(wire::TEST_SHARD, 2),
        );
        let after = caller.list_all().await?;
        ensure!(
            after.len() == 3,
            "want 3 machines after the restart, got {after:#?}"
        );
        let idle: Vec<&pb::Machine> = after.iter().filter(|m| state_of(m) == Idle).collect();
        ensure!(
            idle.len() == 1 && host_of(idle[0]) == host,
            "after the restart exactly the created machine must be IDLE on server {host}: {after:#?}"
        );
        let kept = idle[0].id.clone();
        caller.delete(&kept).await?;
        let gone = caller
            .wait_for_state(&kept, Speculative, SETTLE)
            .await
            .context("Delete after the restart")?;
        ensure!(
            gone.host.is_none(),
            "SPECULATIVE with a host after Delete: {gone:?}"
        );
        Ok(())
    };
    let result = checks.await;
    if let Err(e) = result {
        bail!("{e:#}\nprovider log:\n{}", provider.logs());
    }
    provider
        .stop(super::STOP_DEADLINE)
        .await
        .context("second incarnation: SIGTERM must exit 0")
}

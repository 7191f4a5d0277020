//! The `hetzner` binary on its **real** backend, pointed at the local Hetzner Cloud API emulator
//! (`hcloud-emulator`), over mTLS like the fake-backend runs:
//!
//! - the first-boot inventory has one SPECULATIVE slot per offered server, priced from the
//!   emulator's live (net) prices;
//! - Create makes a server in the emulator and settles IDLE with its host; Delete removes it;
//! - Configure without `--ssh-key` fails honestly (FAILED, `last_error` says why);
//! - after a restart with no state file, the inventory is rebuilt from the servers' labels: the
//!   created machine is IDLE on the same server, the deleted one SPECULATIVE, no duplicates.
//!
//! SSH delivery itself (pinned host keys, the hook, readiness) is covered by the hetzner crate's
//! integration tests against a real SSH server.

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
  {"server_type": "cx22", "location": "nbg1", "count": 2},
  {"server_type": "cax11", "location": "fsn1", "count": 1}
]"#;

/// The emulator process; killed when dropped.
struct Emulator {
    child: Child,
    endpoint: String,
}

impl Drop for Emulator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Emulator {
    fn start(root: &Path) -> Result<Emulator> {
        let binary = provider_process::target_binary(root, "debug", "hcloud-emulator");
        let mut child = Command::new(&binary)
            .args([
                "--listen",
                "127.0.0.1:0",
                "--token",
                TOKEN,
                "--polls-to-running",
                "0",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("start {}", binary.display()))?;
        let stdout = child.stdout.take().context("emulator stdout")?;
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .context("read the emulator's address")?;
        let Some(endpoint) = line.trim().strip_prefix("listening on ") else {
            let _ = child.kill();
            bail!("hcloud-emulator printed {line:?} instead of its address");
        };
        Ok(Emulator {
            endpoint: endpoint.to_owned(),
            child,
        })
    }
}

fn spec(root: &Path, endpoint: &str, offerings: &Path) -> Spec {
    let pki = wire::pki_dir(root);
    let pem = |name: &str| pki.join(name).display().to_string();
    Spec {
        name: "hetzner (real backend)".into(),
        binary: provider_process::target_binary(root, "debug", "hetzner"),
        args: vec![
            "--hetzner-backend=hetzner".into(),
            format!("--token={TOKEN}"),
            format!("--hcloud-endpoint={endpoint}"),
            "--image=ubuntu-24.04".into(),
            format!("--offerings={}", offerings.display()),
            format!("--tls-cert={}", pem("server.pem")),
            format!("--tls-key={}", pem("server-key.pem")),
            format!("--tls-ca={}", pem("ca.pem")),
            "--shutdown-grace=5s".into(),
            "--log-level=info".into(),
        ],
        metrics: true,
        security: ClientSecurity::Mtls,
        pki,
    }
}

fn host_of(machine: &pb::Machine) -> String {
    machine
        .host
        .as_ref()
        .map(|h| h.r#ref.clone())
        .unwrap_or_default()
}

/// Runs the whole check; `Err` names what deviated.
pub(crate) async fn run(root: &Path) -> Result<()> {
    let emulator = Emulator::start(root)?;
    let dir: PathBuf =
        std::env::temp_dir().join(format!("bigfleet-e2e-hetzner-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    let offerings = dir.join("offerings.json");
    std::fs::write(&offerings, OFFERINGS).context("write the offerings")?;
    let result = exercise(root, &emulator.endpoint, &offerings).await;
    let _ = std::fs::remove_dir_all(&dir);
    result
}

async fn exercise(root: &Path, endpoint: &str, offerings: &Path) -> Result<()> {
    use pb::MachineState::*;
    let spec = spec(root, endpoint, offerings);
    let mut provider = provider_process::start(spec.clone()).await?;
    let checks = async {
        let mut caller = Caller::new(
            provider.default_channel().await?,
            Shard::new("e2e-hcloud", 1),
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
        let cx22: Vec<&pb::Machine> = first.iter().filter(|m| m.instance_type == "cx22").collect();
        let (kept, dropped) = (cx22[0].id.clone(), cx22[1].id.clone());

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

        caller
            .configure(&kept, "e2e-cluster", HashMap::new())
            .await?;
        let failed = caller
            .wait_for_state(&kept, Failed, SETTLE)
            .await
            .context("Configure")?;
        ensure!(
            failed
                .last_error
                .starts_with("configure: SSH delivery disabled (set --ssh-key)"),
            "unexpected last_error without --ssh-key: {:?}",
            failed.last_error
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
    let mut provider = provider_process::start(spec).await.context("restart")?;
    let checks = async {
        let mut caller = Caller::new(
            provider.default_channel().await?,
            Shard::new("e2e-hcloud", 2),
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

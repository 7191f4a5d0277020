//! The `hetzner` binary on its real backend with production-shaped offerings, against the
//! Hetzner Cloud API emulator run in this process (so the run can read what the emulator
//! received):
//!
//! - offering `cx23/nbg1`: image by label selector, a network joined in a chosen subnet plus a
//!   second network, two firewalls, no public IPv4, SSH over the private address, spread
//!   placement (the emulator's groups hold 2 servers), operator labels and login SSH keys;
//!   offering `cx33/fsn1`: IPv6 only, SSH over IPv6;
//! - each Create request carries exactly those settings (the first body is printed);
//! - three Creates fill one spread group and roll over into a second; Configure reaches the
//!   newest `cx23` server at its private address (the emulator's sshd on 127.0.0.1) and the
//!   `cx33` server at its IPv6 address (the emulator's sshd on `[::1]`);
//! - deleting the `cx23` machines deletes both owned groups;
//! - `hetzner check` passes the configuration (exit 0, only reads) and names each broken
//!   setting of a broken one (exit 1).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};
use fleet_proto::v1alpha1 as pb;
use hcloud_emulator::{Emulator, Sshd};
use serde_json::json;

use super::SETTLE;
use super::hetzner_real::{HOOK, client_key, host_of, install_hook, read_text, server_root};
use super::provider_process::{self, Spec};
use super::wire::{self, Caller, ClientSecurity, Shard};

const TOKEN: &str = "e2e-hcloud-production-token";
const CLUSTER: &str = "e2e-production";
const OFFERINGS: &str = r#"[
  {"server_type": "cx23", "location": "nbg1", "count": 3,
   "image_selector": "k8s-version=1.31,role=node",
   "networks": ["bigfleet-mgmt=10.0.1.0/24", "bigfleet-storage"],
   "firewalls": ["bigfleet-nodes", "bigfleet-ssh"],
   "public_ipv4": false, "ssh_address": "private", "placement": "spread",
   "server_labels": {"pool": "workers"}, "login_ssh_keys": ["ops-alice", "ops-bob"]},
  {"server_type": "cx33", "location": "fsn1", "count": 1,
   "public_ipv4": false, "public_ipv6": true, "ssh_address": "ipv6"}
]"#;

/// The serving flags of the run (also what `hetzner check` gets).
fn flags(endpoint: &str, offerings: &Path, key: &Path, ssh_port: u16) -> Vec<String> {
    vec![
        "--hetzner-backend=hetzner".into(),
        format!("--token={TOKEN}"),
        format!("--hcloud-endpoint={endpoint}"),
        "--image=ubuntu-24.04".into(),
        "--server-label=env=e2e".into(),
        format!("--offerings={}", offerings.display()),
        format!("--ssh-key={}", key.display()),
        format!("--ssh-port={ssh_port}"),
        format!("--bootstrap-hook={HOOK}"),
    ]
}

fn spec(root: &Path, flags: Vec<String>) -> Spec {
    let pki = wire::pki_dir(root);
    let pem = |name: &str| pki.join(name).display().to_string();
    let mut args = flags;
    args.extend([
        format!("--tls-cert={}", pem("server.pem")),
        format!("--tls-key={}", pem("server-key.pem")),
        format!("--tls-ca={}", pem("ca.pem")),
        "--shutdown-grace=5s".into(),
        "--log-level=info".into(),
    ]);
    Spec {
        name: "hetzner (real backend, production-shaped)".into(),
        binary: provider_process::target_binary(root, "debug", "hetzner"),
        args,
        metrics: true,
        security: ClientSecurity::Mtls,
        pki,
    }
}

/// Both sshds on one port number: 127.0.0.1 (private addresses) and [::1] (IPv6).
async fn sshds(emulator: &Emulator, dir: &Path, authorized: &str) -> Result<(Sshd, Sshd)> {
    let mut last = None;
    for _ in 0..5 {
        let v4 = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("bind the IPv4 sshd")?;
        let port = v4.local_addr()?.port();
        match tokio::net::TcpListener::bind(("::1", port)).await {
            Ok(v6) => {
                let servers = dir.join("servers");
                let a = Sshd::for_emulator_openssh(
                    v4,
                    emulator.clone(),
                    servers.clone(),
                    authorized,
                    "root",
                )?;
                let b =
                    Sshd::for_emulator_openssh(v6, emulator.clone(), servers, authorized, "root")?;
                return Ok((a, b));
            }
            Err(e) => last = Some(e),
        }
    }
    bail!("bind [::1] on the IPv4 sshd's port: {last:?}")
}

fn redacted(body: &serde_json::Value) -> serde_json::Value {
    let mut body = body.clone();
    if let Some(data) = body.get("user_data").and_then(|d| d.as_str()) {
        // The user data carries the server's SSH host private key.
        body["user_data"] = json!(format!("<{} bytes of cloud-init, redacted>", data.len()));
    }
    body
}

/// Runs the whole check; `Err` names what deviated.
pub(crate) async fn run(root: &Path) -> Result<()> {
    let dir: PathBuf = std::env::temp_dir().join(format!(
        "bigfleet-e2e-hetzner-production-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    let result = async {
        let key = client_key(&dir)?;
        let authorized = read_text(&key.with_extension("pub"))?;
        let emulator = Emulator::start(TOKEN).await.context("start the emulator")?;
        emulator.set_placement_group_limit(2);
        emulator.set_new_server_private_ip("127.0.0.1");
        emulator.set_new_server_ipv6_net("::/64");
        emulator.set_polls_to_running(0);
        let (v4, v6) = sshds(&emulator, &dir, &authorized).await?;
        let offerings = dir.join("offerings.json");
        std::fs::write(&offerings, OFFERINGS).context("write the offerings")?;
        let flags = flags(&emulator.endpoint(), &offerings, &key, v4.addr().port());
        exercise(root, &dir, &emulator, &flags).await?;
        ensure!(
            v4.observed
                .authenticated
                .load(std::sync::atomic::Ordering::SeqCst)
                >= 1,
            "no SSH session reached a private address"
        );
        ensure!(
            v6.observed
                .authenticated
                .load(std::sync::atomic::Ordering::SeqCst)
                >= 1,
            "no SSH session reached an IPv6 address"
        );
        check_command(root, &emulator, &flags, &offerings).await
    }
    .await;
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// The provider's spread groups as (id, servers held).
fn owned_groups(emulator: &Emulator) -> Vec<(i64, usize)> {
    emulator
        .placement_groups()
        .into_iter()
        .filter(|g| g.labels.contains_key("bigfleet-offering"))
        .map(|g| (g.id, g.servers.len()))
        .collect()
}

async fn exercise(root: &Path, dir: &Path, emulator: &Emulator, flags: &[String]) -> Result<()> {
    use pb::MachineState::*;
    let mut provider = provider_process::start(spec(root, flags.to_vec())).await?;
    let checks = async {
        let mut caller = Caller::new(
            provider.default_channel().await?,
            Shard::new(wire::TEST_SHARD, 1),
        );
        let slots = caller.list_all().await?;
        ensure!(slots.len() == 4, "want 4 offered slots, got {slots:#?}");
        let workers: Vec<String> = slots
            .iter()
            .filter(|m| m.instance_type == "cx23")
            .map(|m| m.id.clone())
            .collect();
        let v6_only = slots
            .iter()
            .find(|m| m.instance_type == "cx33")
            .context("the cx33 slot")?
            .id
            .clone();
        let mut hosts = Vec::new();
        for id in &workers {
            caller.create(id).await?;
            let idle = caller
                .wait_for_state(id, Idle, SETTLE)
                .await
                .with_context(|| format!("Create {id}"))?;
            hosts.push(host_of(&idle));
        }
        let bodies = emulator.create_bodies();
        // The third server's first request went to the full group and was refused.
        ensure!(
            bodies.len() == 4,
            "want 4 create requests (one refused by a full group), got {:#?}",
            bodies.iter().map(redacted).collect::<Vec<_>>()
        );
        ensure!(
            bodies[2]["name"] == bodies[3]["name"]
                && bodies[2]["placement_group"] == bodies[0]["placement_group"]
                && bodies[3]["placement_group"] != bodies[0]["placement_group"],
            "the create refused by the full group was not retried in a new group: {:#?}",
            bodies.iter().map(redacted).collect::<Vec<_>>()
        );
        println!(
            "e2e: hetzner production-shaped Create request body:\n{:#}",
            redacted(&bodies[0])
        );
        for body in &bodies {
            let labels = &body["labels"];
            ensure!(
                body["image"] == "3002"
                    && body["networks"] == json!([9002])
                    && body["firewalls"] == json!([{"firewall": 7001}, {"firewall": 7002}])
                    && body["public_net"] == json!({"enable_ipv4": false, "enable_ipv6": true})
                    && body["ssh_keys"] == json!(["5001", "5002"])
                    && body["placement_group"].is_i64()
                    && labels["pool"] == "workers"
                    && labels["env"] == "e2e"
                    && labels["bigfleet-managed"] == "true",
                "the Create request does not carry the configured settings: {:#}",
                redacted(body)
            );
        }
        let mut sizes: Vec<usize> = owned_groups(emulator)
            .iter()
            .map(|(_, held)| *held)
            .collect();
        sizes.sort();
        ensure!(
            sizes == vec![1, 2],
            "three servers must fill one spread group of 2 and roll over into a second: {:#?}",
            emulator.placement_groups()
        );

        // Configure over the private address: the newest cx23 server answers on 127.0.0.1.
        let newest = workers.last().context("a worker")?.clone();
        let host = hosts.last().context("a host")?.clone();
        install_hook(dir, &host)?;
        caller.configure(&newest, CLUSTER, HashMap::new()).await?;
        caller
            .wait_for_state(&newest, Configured, SETTLE)
            .await
            .context("Configure over the private address")?;
        let args = read_text(&server_root(dir, &host).join("hook.args"))?;
        ensure!(args == format!("{CLUSTER}\n"), "the hook ran with {args:?}");

        // The IPv6-only server, configured over [::1].
        caller.create(&v6_only).await?;
        let idle = caller
            .wait_for_state(&v6_only, Idle, SETTLE)
            .await
            .context("Create the IPv6-only server")?;
        let v6_host = host_of(&idle);
        let body = emulator.create_bodies().pop().context("the cx33 body")?;
        ensure!(
            body["public_net"] == json!({"enable_ipv4": false, "enable_ipv6": true})
                && body.get("networks").is_none()
                && body.get("placement_group").is_none(),
            "the IPv6-only Create request: {:#}",
            redacted(&body)
        );
        install_hook(dir, &v6_host)?;
        caller.configure(&v6_only, CLUSTER, HashMap::new()).await?;
        caller
            .wait_for_state(&v6_only, Configured, SETTLE)
            .await
            .context("Configure over IPv6")?;
        let args = read_text(&server_root(dir, &v6_host).join("hook.args"))?;
        ensure!(args == format!("{CLUSTER}\n"), "the hook ran with {args:?}");

        // A configured machine is drained (over the private address again) before Delete.
        caller.drain(&newest).await?;
        caller
            .wait_for_state(&newest, Idle, SETTLE)
            .await
            .context("Drain over the private address")?;
        for id in &workers {
            caller.delete(id).await?;
        }
        for id in &workers {
            caller
                .wait_for_state(id, Speculative, SETTLE)
                .await
                .with_context(|| format!("Delete {id}"))?;
        }
        ensure!(
            owned_groups(emulator).is_empty(),
            "owned spread groups left after their servers were deleted: {:#?}",
            emulator.placement_groups()
        );
        Ok::<_, anyhow::Error>(())
    };
    if let Err(e) = checks.await {
        bail!("{e:#}\nprovider log:\n{}", provider.logs());
    }
    provider
        .stop(super::STOP_DEADLINE)
        .await
        .context("SIGTERM must exit 0")
}

/// `hetzner check` with the run's flags (exit 0) and with broken ones (exit 1, each named).
async fn check_command(
    root: &Path,
    emulator: &Emulator,
    flags: &[String],
    offerings: &Path,
) -> Result<()> {
    let binary = provider_process::target_binary(root, "debug", "hetzner");
    let run = |extra: Vec<String>, offerings_doc: Option<(&Path, &str)>| {
        let binary = binary.clone();
        let mut args: Vec<String> = vec!["check".into()];
        // Extra flags replace the run's flags of the same name.
        let replaced = |flag: &String| {
            extra
                .iter()
                .any(|e| e.split('=').next() == flag.split('=').next())
        };
        args.extend(flags.iter().filter(|f| !replaced(f)).cloned());
        args.extend(extra);
        let doc = offerings_doc.map(|(p, d)| (p.to_owned(), d.to_owned()));
        async move {
            tokio::task::spawn_blocking(move || -> Result<(Option<i32>, String)> {
                if let Some((path, doc)) = doc {
                    std::fs::write(&path, doc)?;
                }
                let out = Command::new(&binary)
                    .args(&args)
                    .env_remove("HCLOUD_TOKEN")
                    .output()
                    .context("run hetzner check")?;
                Ok((
                    out.status.code(),
                    String::from_utf8_lossy(&out.stdout).into_owned(),
                ))
            })
            .await?
        }
    };
    let before = emulator.seen().len();
    let (code, out) = run(Vec::new(), None).await?;
    ensure!(
        code == Some(0),
        "hetzner check of the run's flags failed:\n{out}"
    );
    ensure!(
        emulator.seen()[before..].iter().all(|s| s.method == "GET"),
        "hetzner check made a request that is not a read"
    );
    let broken = offerings.with_file_name("broken.json");
    let doc = r#"[
      {"server_type": "cax11", "location": "fsn1", "count": 1,
       "image_selector": "k8s-version=1.31,role=node"},
      {"server_type": "cx23", "location": "nbg1", "count": 1,
       "networks": ["no-such-network", "bigfleet-mgmt=10.9.0.0/24"],
       "firewalls": ["no-such-firewall"], "login_ssh_keys": ["no-such-key"]},
      {"server_type": "cx33", "location": "fsn1", "count": 1, "public_ipv4": false}
    ]"#;
    let (code, out) = run(
        vec![format!("--offerings={}", broken.display())],
        Some((&broken, doc)),
    )
    .await?;
    ensure!(
        code == Some(1),
        "hetzner check of broken settings exited {code:?}:\n{out}"
    );
    for want in [
        "FAIL  offering cax11/fsn1 image: offering cax11/fsn1 field \"image_selector\" \"k8s-version=1.31,role=node\": no available image or snapshot matches it for architecture arm",
        "network \"no-such-network\" does not exist",
        "network \"bigfleet-mgmt\" has no subnet 10.9.0.0/24",
        "FAIL  offering cx23/nbg1 firewalls: offering cx23/nbg1 field \"firewalls\": firewall \"no-such-firewall\" does not exist",
        "FAIL  offering cx23/nbg1 login_ssh_keys: offering cx23/nbg1 field \"login_ssh_keys\": SSH key \"no-such-key\" does not exist",
        "FAIL  offering cx33/fsn1 ssh_address: offering cx33/fsn1 --ssh-address \"public\" needs a public IPv4, but offering cx33/fsn1 field \"public_ipv4\" is false",
    ] {
        ensure!(
            out.contains(want),
            "hetzner check does not report {want:?}:\n{out}"
        );
    }
    ensure!(
        !out.contains(TOKEN),
        "hetzner check printed the token:\n{out}"
    );
    Ok(())
}

//! The `digitalocean` binary configured as production runs it, against `do-emulator` seeded
//! with a VPC, a private snapshot, login SSH keys and a cloud firewall:
//!
//! - `digitalocean check` passes on the configuration and names the firewall that selects the
//!   offering's tags; with broken values it fails and names each broken setting;
//! - Create sends exactly the configured image (the snapshot, by id), VPC, tags, IPv6,
//!   monitoring and SSH keys (the body is printed, user_data shortened to its length);
//! - the agent bootstraps over the channel and Configure settles CONFIGURED.

use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use fleet_proto::v1alpha1 as pb;
use serde_json::{Value, json};

use super::digitalocean_real::{
    REGION, SECRET, SETTLE, TOKEN, backend_args, droplet_of, start_agent, start_emulator,
    start_provider,
};
use super::provider_process;
use super::wire::{self, Caller, Shard, acked, state_of};

const CLUSTER: &str = "e2e-do-production";
const SNAPSHOT: &str = "k8s-node-1-31-e2e";

/// `POST path` with a JSON body over plain HTTP/1.1; returns status and body.
fn http_post(addr: SocketAddr, path: &str, body: &Value) -> Result<(u16, String)> {
    use std::io::{Read as _, Write as _};
    let body = body.to_string();
    let mut conn = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .with_context(|| format!("connect to {addr}"))?;
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        conn,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut response = String::new();
    conn.read_to_string(&mut response)
        .with_context(|| format!("read the answer to POST {path}"))?;
    let (head, rest) = response
        .split_once("\r\n\r\n")
        .with_context(|| format!("malformed HTTP response: {response:?}"))?;
    let status = head
        .get(9..12)
        .and_then(|code| code.parse().ok())
        .with_context(|| format!("no status line in {head:?}"))?;
    Ok((status, rest.to_owned()))
}

fn get_json(api: SocketAddr, path: &str) -> Result<Value> {
    let (status, body) = super::http_get(api, path)?;
    ensure!(status == 200, "GET {path}: {status} {body}");
    serde_json::from_str(&body).with_context(|| format!("parse GET {path}: {body}"))
}

/// What the seed made.
struct Seeded {
    vpc: String,
    other_region_vpc: String,
    snapshot: u64,
    key_id: u64,
    fingerprint: String,
}

fn seed(api: SocketAddr) -> Result<Seeded> {
    let (status, body) = http_post(
        api,
        "/_emulator/seed",
        &json!({
            "vpcs": [
                {"name": "prod-nyc3", "region": REGION, "ip_range": "10.40.0.0/20"},
                {"name": "prod-ams3", "region": "ams3", "ip_range": "10.50.0.0/20"}
            ],
            "snapshots": [{"name": SNAPSHOT, "regions": [REGION, "sfo3"]}],
            "ssh_keys": ["ops", "oncall"],
            "firewalls": [{"name": "k8s-nodes", "tags": ["k8s-node"]}]
        }),
    )?;
    ensure!(status == 200, "seed: {status} {body}");
    let v: Value = serde_json::from_str(&body).context("parse the seed answer")?;
    let text = |v: &Value| v.as_str().map(str::to_owned).context("seed answer");
    Ok(Seeded {
        vpc: text(&v["vpcs"][0]["id"])?,
        other_region_vpc: text(&v["vpcs"][1]["id"])?,
        snapshot: v["snapshots"][0]["id"].as_u64().context("snapshot id")?,
        key_id: v["ssh_keys"][0]["id"].as_u64().context("key id")?,
        fingerprint: text(&v["ssh_keys"][1]["fingerprint"])?,
    })
}

/// Runs `digitalocean check` with `args`; returns success and stdout.
fn check(root: &Path, args: &[String]) -> Result<(bool, String)> {
    let binary = provider_process::target_binary(root, "debug", "digitalocean");
    let out = Command::new(&binary)
        .arg("check")
        .args(args)
        .env_remove("DIGITALOCEAN_TOKEN")
        .env_remove("BIGFLEET_BOOTSTRAP_SECRET")
        .env_remove("DIGITALOCEAN_VPC_UUID")
        .env_remove("DIGITALOCEAN_TAGS")
        .env_remove("DIGITALOCEAN_SSH_KEYS")
        .output()
        .with_context(|| format!("run {} check", binary.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !stdout.contains(TOKEN)
            && !stdout.contains(SECRET)
            && !stderr.contains(TOKEN)
            && !stderr.contains(SECRET),
        "check printed a secret:\n{stdout}\n{stderr}"
    );
    Ok((out.status.success(), stdout))
}

/// The serving flags of the run (without those `start_provider` adds itself).
fn check_args(root: &Path, api: SocketAddr, offerings: &Path, extra: &[String]) -> Vec<String> {
    let pki = wire::pki_dir(root);
    let pem = |name: &str| pki.join(name).display().to_string();
    backend_args(api, 9443, offerings)
        .into_iter()
        .chain([
            format!("--bootstrap-tls-cert={}", pem("server.pem")),
            format!("--bootstrap-tls-key={}", pem("server-key.pem")),
            format!("--bootstrap-ca={}", pem("ca.pem")),
            format!("--bootstrap-secret={SECRET}"),
        ])
        .chain(extra.iter().cloned())
        .collect()
}

/// Runs the whole production-shaped check; `Err` names what deviated.
pub(crate) async fn run(root: &Path) -> Result<()> {
    let (emulator, api) = start_emulator(root)?;
    let dir = std::env::temp_dir().join(format!(
        "bigfleet-e2e-digitalocean-production-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    let result = exercise(root, api, &dir).await;
    let result =
        result.map_err(|e| anyhow::anyhow!("{e:#}\ndo-emulator log:\n{}", emulator.logs()));
    drop(emulator);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

async fn exercise(root: &Path, api: SocketAddr, dir: &Path) -> Result<()> {
    let seeded = seed(api)?;
    let offerings = dir.join("offerings.json");
    let offering = json!([{
        "size": "s-2vcpu-4gb", "region": REGION, "count": 1,
        "resources": {"cpu": "2", "memory": "4Gi"},
        "image": SNAPSHOT, "tags": ["pool-a"], "monitoring": true,
        "ssh_keys": ["ops", seeded.fingerprint]
    }]);
    std::fs::write(&offerings, offering.to_string()).context("write the offerings")?;
    let flags = vec![
        format!("--vpc-uuid={}", seeded.vpc),
        "--tag=k8s-node".to_owned(),
        "--ipv6".to_owned(),
    ];

    // check: all OK, and the firewall that selects the offering's tags is named.
    let (ok, out) = check(root, &check_args(root, api, &offerings, &flags))?;
    println!("e2e: digitalocean check on the production-shaped configuration:\n{out}");
    ensure!(ok, "check failed on a working configuration:\n{out}");
    ensure!(
        out.contains("OK    offering s-2vcpu-4gb/nyc3 firewalls: \"k8s-nodes\" (by tag k8s-node)"),
        "check did not name the firewall selecting the offering's tags:\n{out}"
    );

    // check: each broken setting is reported, naming it.
    let broken_offerings = dir.join("broken.json");
    std::fs::write(
        &broken_offerings,
        json!([{
            "size": "s-2vcpu-4gb", "region": REGION, "count": 1,
            "image": "k8s-node-1-30-e2e", "ssh_keys": ["nobody"]
        }, {
            "size": "s-96vcpu-1tb", "region": REGION, "count": 1
        }])
        .to_string(),
    )?;
    let broken = vec![format!("--vpc-uuid={}", seeded.other_region_vpc)];
    let (ok, out) = check(root, &check_args(root, api, &broken_offerings, &broken))?;
    ensure!(!ok, "check passed a broken configuration:\n{out}");
    for needle in [
        "FAIL  offering s-2vcpu-4gb/nyc3 image: offering s-2vcpu-4gb/nyc3 field image \"k8s-node-1-30-e2e\"",
        "FAIL  offering s-2vcpu-4gb/nyc3 ssh_keys \"nobody\": offering s-2vcpu-4gb/nyc3 field ssh_keys \"nobody\": no SSH key",
        &format!(
            "FAIL  offering s-2vcpu-4gb/nyc3 vpc_uuid: offering s-2vcpu-4gb/nyc3 --vpc-uuid \"{}\": VPC \"prod-ams3\" is in region ams3",
            seeded.other_region_vpc
        ),
        "FAIL  offering s-96vcpu-1tb/nyc3 size: size \"s-96vcpu-1tb\" does not exist",
    ] {
        ensure!(
            out.contains(needle),
            "check did not report {needle:?}:\n{out}"
        );
    }
    // One line only: the expected FAIL lines of this check would read as failures of the run.
    println!(
        "e2e: digitalocean check refused the broken settings, naming each of them ({} lines)",
        out.lines().filter(|l| l.starts_with("FAIL")).count()
    );
    let (ok, out) = check(
        root,
        &check_args(
            root,
            api,
            &offerings,
            &["--tag=bigfleet-managed".to_owned()],
        ),
    )?;
    ensure!(
        !ok && out.contains("--tag \"bigfleet-managed\": reserved"),
        "check did not refuse a reserved tag:\n{out}"
    );

    // The provider: Create sends exactly the configured settings.
    let mut provider = start_provider(root, api, &offerings, &flags).await?;
    let mut agent = None;
    let result = walk(&provider, root, api, dir, &seeded, &mut agent).await;
    let agent_log = agent
        .as_ref()
        .map(|a: &super::digitalocean_real::Process| a.logs())
        .unwrap_or_default();
    drop(agent);
    if let Err(e) = result {
        bail!(
            "{e:#}\nprovider log:\n{}\nbigfleet-agent log:\n{agent_log}",
            provider.logs()
        );
    }
    provider
        .stop(super::STOP_DEADLINE)
        .await
        .context("SIGTERM must exit 0")
}

async fn walk(
    provider: &provider_process::Provider,
    root: &Path,
    api: SocketAddr,
    dir: &Path,
    seeded: &Seeded,
    agent: &mut Option<super::digitalocean_real::Process>,
) -> Result<()> {
    use pb::MachineState::*;
    let mut caller = Caller::new(
        provider.default_channel().await?,
        Shard::new(wire::TEST_SHARD, 1),
    );
    let slots = caller.list_all().await?;
    let id = slots.first().context("no offered slot")?.id.clone();
    let create = caller.create(&id).await?;
    ensure!(
        state_of(acked(&create)) == Creating,
        "Create ack: {create:?}"
    );
    caller
        .wait_for_state(&id, Idle, SETTLE)
        .await
        .context("Create")?;
    let recorded = get_json(api, "/_emulator/create-requests")?;
    let bodies = recorded["requests"]
        .as_array()
        .context("no requests array")?;
    ensure!(bodies.len() == 1, "want one create request, got {recorded}");
    let mut body = bodies[0].clone();
    let user_data = body["user_data"].as_str().unwrap_or_default().len();
    body["user_data"] = json!(format!(
        "<{user_data} bytes: cloud-config with the agent's endpoint, pin and token>"
    ));
    println!(
        "e2e: digitalocean production-shaped Create request body:\n{}",
        serde_json::to_string_pretty(&body)?
    );
    let tags = body["tags"].as_array().context("no tags")?;
    // Ownership (managed, machine, instance), the booting tag, the enrollment token tag, then
    // the offering's.
    let extra: Vec<&Value> = tags.iter().skip(5).collect();
    let booting = tags
        .get(3)
        .and_then(Value::as_str)
        .is_some_and(|t| t.starts_with("bfboot:"))
        && tags.get(4) == Some(&json!("bftoken:e1"));
    ensure!(
        body["image"] == json!(seeded.snapshot)
            && body["vpc_uuid"] == json!(seeded.vpc)
            && body["ipv6"] == json!(true)
            && body["monitoring"] == json!(true)
            && body["ssh_keys"] == json!([seeded.key_id, seeded.fingerprint])
            && booting
            && extra == [&json!("k8s-node"), &json!("pool-a")]
            && tags.len() == 7
            && body["region"] == REGION
            && body["size"] == "s-2vcpu-4gb",
        "the Create request does not carry exactly the configured settings: {body:#}"
    );
    let (droplet, config) =
        droplet_of(api, &id)?.with_context(|| format!("no Droplet carries machine {id}"))?;
    ensure!(
        droplet["vpc_uuid"] == json!(seeded.vpc)
            && droplet["networks"]["v6"]
                .as_array()
                .is_some_and(|v| !v.is_empty()),
        "the Droplet is not in the VPC with IPv6: {droplet}"
    );

    // The agent reaches --bootstrap-endpoint over the channel, whatever the Droplet's addresses.
    let agent_dir = dir.join("droplet");
    std::fs::create_dir_all(&agent_dir)?;
    *agent = Some(start_agent(root, &agent_dir, &config)?);
    let request = pb::ConfigureRequest {
        machine_id: id.clone(),
        cluster_id: CLUSTER.into(),
        bootstrap_blob: b"kubeadm join 10.40.0.1:6443 --token e2e.production".to_vec(),
        shard_metadata: Default::default(),
        ..wire::configure_request(&id, CLUSTER, Default::default(), caller.shard.next())
    };
    let configure = caller.client.configure(request).await?.into_inner();
    ensure!(
        state_of(acked(&configure)) == Configuring,
        "Configure ack: {configure:?}"
    );
    caller
        .wait_for_state(&id, Configured, SETTLE)
        .await
        .context("Configure")?;
    let args = std::fs::read_to_string(agent_dir.join("hook.args")).unwrap_or_default();
    ensure!(args == format!("{CLUSTER}\n"), "the hook ran with {args:?}");
    Ok(())
}

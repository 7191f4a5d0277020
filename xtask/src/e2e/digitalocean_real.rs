//! The `digitalocean` binary on its **real** backend, pointed at the local DigitalOcean API
//! emulator (`do-emulator`), over mTLS like the fake-backend runs, with a real `bigfleet-agent`
//! process playing the Droplet:
//!
//! - the first-boot inventory has one SPECULATIVE slot per offered Droplet in nyc3;
//! - Create makes a Droplet in the emulator (checked over its HTTP API) and settles IDLE;
//! - the agent is started from the config the provider wrote into the Droplet's user_data
//!   (endpoint, pinned CA, machine id, token), with a recording hook and drain script;
//! - Configure settles CONFIGURED after the hook ran with the cluster id and the exact blob;
//! - Drain runs the drain script with the grace and settles IDLE;
//! - a second agent started from the same user_data gets 401: the token was spent by the first
//!   agent's enrollment;
//! - Delete removes the Droplet and settles SPECULATIVE;
//! - SIGTERM stops the provider with exit 0.
//!
//! The flags of the real backend, the start on a free bootstrap port and the agent are shared
//! with `cargo xtask bench --scenario cloud-budget`, which walks a machine the same way.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use fleet_proto::v1alpha1 as pb;
use serde_json::Value;
use tokio::time::Instant;

use super::provider_process::{self, Provider, Spec};
use super::wire::{self, Caller, ClientSecurity, Shard, acked, state_of};

pub(crate) const TOKEN: &str = "dop_v1_e2e_api_token_0123456789";
pub(super) const SECRET: &str = "e2e-bootstrap-secret-0123456789abcdef";
pub(crate) const REGION: &str = "nyc3";
const OFFERINGS: &str = r#"[
  {"size": "s-2vcpu-4gb", "region": "nyc3", "count": 2, "resources": {"cpu": "2", "memory": "4Gi"}},
  {"size": "s-1vcpu-2gb", "region": "nyc3", "count": 1, "resources": {"cpu": "1", "memory": "2Gi"}}
]"#;
const CLUSTER: &str = "e2e-do-cluster";
/// The join blob, with bytes that are not UTF-8, to check it arrives byte for byte.
const BLOB: &[u8] = b"kubeadm join 10.0.0.1:6443 --token e2e.doblob\n\x00\xff\xfe\x01";
/// How long a real-backend transition may take (emulator round trips, agent long-poll).
pub(super) const SETTLE: Duration = Duration::from_secs(15);
/// How many bootstrap ports to try when the one picked was taken meanwhile.
const BOOTSTRAP_PORT_ATTEMPTS: usize = 3;

/// A child process (emulator or agent) whose output is collected; killed when dropped.
pub(crate) struct Process {
    child: Child,
    log: Arc<Mutex<Vec<String>>>,
}

impl Process {
    pub(crate) fn logs(&self) -> String {
        self.log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .join("\n")
    }

    fn kill(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Collects `stream` line by line into `log` on a thread.
fn collect(stream: impl std::io::Read + Send + 'static, log: &Arc<Mutex<Vec<String>>>) {
    let log = log.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines().map_while(Result::ok) {
            log.lock().unwrap_or_else(|e| e.into_inner()).push(line);
        }
    });
}

/// Starts `do-emulator` on a free loopback port; returns it with its address.
pub(super) fn start_emulator(root: &Path) -> Result<(Process, SocketAddr)> {
    let binary = provider_process::target_binary(root, "debug", "do-emulator");
    let mut child = Command::new(&binary)
        .args(["--listen", "127.0.0.1:0", "--token", TOKEN])
        .env_remove("DIGITALOCEAN_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("start {}", binary.display()))?;
    let log = Arc::new(Mutex::new(Vec::new()));
    collect(child.stderr.take().context("emulator stderr")?, &log);
    let mut stdout = BufReader::new(child.stdout.take().context("emulator stdout")?);
    let mut line = String::new();
    stdout
        .read_line(&mut line)
        .context("read the emulator's address")?;
    collect(stdout, &log);
    let mut emulator = Process { child, log };
    let addr = line
        .trim()
        .strip_prefix("do-emulator listening on http://")
        .and_then(|addr| addr.parse::<SocketAddr>().ok());
    let Some(addr) = addr else {
        emulator.kill();
        bail!(
            "do-emulator printed {line:?} instead of its address; log:\n{}",
            emulator.logs()
        );
    };
    Ok((emulator, addr))
}

/// The flags every DigitalOcean run on the real backend against do-emulator starts with.
pub(crate) fn backend_args(api: SocketAddr, bootstrap: u16, offerings: &Path) -> Vec<String> {
    vec![
        format!("--token={TOKEN}"),
        format!("--region={REGION}"),
        "--image=ubuntu-24-04-x64".into(),
        format!("--do-api-url=http://{api}"),
        format!("--offerings={}", offerings.display()),
        format!("--bootstrap-addr=127.0.0.1:{bootstrap}"),
        format!("--bootstrap-endpoint=https://127.0.0.1:{bootstrap}"),
        // The agents run on loopback, not at the emulated Droplets' 192.0.2.x addresses (the
        // binary's integration tests check the default, `droplet`).
        "--bootstrap-enrollment-source=any".into(),
    ]
}

/// The bootstrap channel's TLS material from the committed test PKI `pki`, and its secret.
pub(crate) fn bootstrap_args(pki: &Path) -> Vec<String> {
    let pem = |name: &str| pki.join(name).display().to_string();
    vec![
        format!("--bootstrap-tls-cert={}", pem("server.pem")),
        format!("--bootstrap-tls-key={}", pem("server-key.pem")),
        format!("--bootstrap-ca={}", pem("ca.pem")),
        format!("--bootstrap-secret={SECRET}"),
    ]
}

fn spec(root: &Path, api: SocketAddr, bootstrap: u16, offerings: &Path, extra: &[String]) -> Spec {
    let pki = wire::pki_dir(root);
    let pem = |name: &str| pki.join(name).display().to_string();
    Spec {
        name: "digitalocean (real backend)".into(),
        binary: provider_process::target_binary(root, "debug", "digitalocean"),
        args: backend_args(api, bootstrap, offerings)
            .into_iter()
            .chain(bootstrap_args(&pki))
            .chain([
                "--configure-timeout=30s".into(),
                format!("--tls-cert={}", pem("server.pem")),
                format!("--tls-key={}", pem("server-key.pem")),
                format!("--tls-ca={}", pem("ca.pem")),
                "--shutdown-grace=5s".into(),
                "--log-level=info".into(),
            ])
            .chain(extra.iter().cloned())
            .collect(),
        metrics: true,
        security: ClientSecurity::Mtls,
        pki,
    }
}

/// Starts the provider with `extra` flags; a bootstrap port lost to another process gets a
/// fresh pick.
pub(super) async fn start_provider(
    root: &Path,
    api: SocketAddr,
    offerings: &Path,
    extra: &[String],
) -> Result<Provider> {
    start_on_free_bootstrap_port(|bootstrap| {
        provider_process::start(spec(root, api, bootstrap, offerings, extra))
    })
    .await
}

/// Runs `start` with a free bootstrap port until it starts; a port lost to another process
/// meanwhile gets a fresh pick.
pub(crate) async fn start_on_free_bootstrap_port<F>(start: impl Fn(u16) -> F) -> Result<Provider>
where
    F: std::future::Future<Output = Result<Provider>>,
{
    let mut last = None;
    for _ in 0..BOOTSTRAP_PORT_ATTEMPTS {
        let bootstrap = provider_process::free_port()?;
        match start(bootstrap).await {
            Ok(provider) => return Ok(provider),
            Err(e)
                if format!("{e:#}")
                    .to_lowercase()
                    .contains("address already in use") =>
            {
                last = Some(e);
            }
            Err(e) => return Err(e),
        }
    }
    Err(last.context("no start attempt")?).context("no free bootstrap port")
}

/// The Droplets in the emulator, with their user_data (`GET /_emulator/droplets`).
fn droplets(api: SocketAddr) -> Result<Vec<Value>> {
    let (status, body) = super::http_get(api, "/_emulator/droplets")?;
    ensure!(status == 200, "GET /_emulator/droplets: {status} {body}");
    let parsed: Value =
        serde_json::from_str(&body).with_context(|| format!("parse the droplets: {body}"))?;
    parsed["droplets"]
        .as_array()
        .cloned()
        .with_context(|| format!("no droplets array in {body}"))
}

/// The agent config.json cloud-init would write from a Droplet's user_data: the JSON indented
/// under `content: |` of the provider's cloud-config part.
fn agent_config(user_data: &str) -> Result<Value> {
    const MARK: &str = "    content: |\n";
    let start = user_data
        .find(MARK)
        .context("no agent cloud-config in the user_data")?
        + MARK.len();
    let mut json = String::new();
    for line in user_data[start..].lines() {
        let Some(stripped) = line.strip_prefix("      ") else {
            break;
        };
        json.push_str(stripped);
        json.push('\n');
    }
    serde_json::from_str(&json).with_context(|| format!("parse the agent config {json:?}"))
}

/// The Droplet whose agent config names `machine_id`, and that config.
pub(crate) fn droplet_of(api: SocketAddr, machine_id: &str) -> Result<Option<(Value, Value)>> {
    for droplet in droplets(api)? {
        let user_data = droplet["user_data"].as_str().unwrap_or_default();
        let Ok(config) = agent_config(user_data) else {
            continue;
        };
        if config["machine_id"] == machine_id {
            return Ok(Some((droplet, config)));
        }
    }
    Ok(None)
}

fn write_executable(path: &Path, body: &str) -> Result<()> {
    std::fs::write(path, body).with_context(|| format!("write {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .with_context(|| format!("chmod {}", path.display()))
}

/// Starts the debug build of `bigfleet-agent` in `dir` with `config` (see [`start_agent_binary`]).
pub(super) fn start_agent(root: &Path, dir: &Path, config: &Value) -> Result<Process> {
    let binary = provider_process::target_binary(root, "debug", "bigfleet-agent");
    start_agent_binary(&binary, dir, config)
}

/// Starts the `bigfleet-agent` at `binary` in `dir` with `config`, a hook recording its
/// arguments and a copy of the blob, and a drain script recording its argument.
pub(crate) fn start_agent_binary(binary: &Path, dir: &Path, config: &Value) -> Result<Process> {
    let config_path = dir.join("config.json");
    std::fs::write(&config_path, serde_json::to_vec_pretty(config)?)
        .context("write the agent config")?;
    let hook = dir.join("bootstrap");
    write_executable(
        &hook,
        &format!(
            "#!/bin/sh\necho \"$@\" > '{d}/hook.args'\ncp \"$0.blob\" '{d}/hook.blob.copy'\n",
            d = dir.display()
        ),
    )?;
    let drain = dir.join("drain.sh");
    write_executable(
        &drain,
        &format!("#!/bin/sh\necho \"$1\" > '{}/drain.args'\n", dir.display()),
    )?;
    let mut child = Command::new(binary)
        .arg("--config")
        .arg(&config_path)
        .arg("--hook")
        .arg(&hook)
        .arg("--drain-command")
        .arg(format!("'{}' \"$BIGFLEET_GRACE_SECONDS\"", drain.display()))
        .arg("--state")
        .arg(dir.join("state").join("executed.json"))
        .args(["--max-backoff", "200ms"])
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("start {}", binary.display()))?;
    let log = Arc::new(Mutex::new(Vec::new()));
    collect(child.stdout.take().context("agent stdout")?, &log);
    collect(child.stderr.take().context("agent stderr")?, &log);
    Ok(Process { child, log })
}

/// Polls `check` until it yields a value or `within` passes.
pub(super) async fn eventually<T>(
    within: Duration,
    what: &str,
    mut check: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(value) = check()? {
            return Ok(value);
        }
        if Instant::now() >= deadline {
            bail!("{what}: not seen within {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Runs the whole check; `Err` names what deviated.
pub(crate) async fn run(root: &Path) -> Result<()> {
    let (emulator, api) = start_emulator(root)?;
    let dir: PathBuf =
        std::env::temp_dir().join(format!("bigfleet-e2e-digitalocean-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    let offerings = dir.join("offerings.json");
    std::fs::write(&offerings, OFFERINGS).context("write the offerings")?;
    let result = exercise(root, api, &dir, &offerings).await;
    let result =
        result.map_err(|e| anyhow::anyhow!("{e:#}\ndo-emulator log:\n{}", emulator.logs()));
    drop(emulator);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

async fn exercise(root: &Path, api: SocketAddr, dir: &Path, offerings: &Path) -> Result<()> {
    let mut provider = start_provider(root, api, offerings, &[]).await?;
    let mut agent: Option<Process> = None;
    let result = walk(root, &provider, api, dir, &mut agent).await;
    let agent_log = agent.as_ref().map(Process::logs).unwrap_or_default();
    // The agent goes first, so no long-poll holds the channel while the provider stops.
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
    root: &Path,
    provider: &Provider,
    api: SocketAddr,
    dir: &Path,
    agent: &mut Option<Process>,
) -> Result<()> {
    use pb::MachineState::*;
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
            state_of(m) == Speculative && m.host.is_none() && m.zone == REGION,
            "{} is not a host-less SPECULATIVE slot in {REGION} at first boot: {m:?}",
            m.id
        );
    }
    ensure!(
        droplets(api)?.is_empty(),
        "the emulator has Droplets before any Create"
    );
    let id = first
        .iter()
        .find(|m| m.instance_type == "s-2vcpu-4gb")
        .context("no s-2vcpu-4gb slot")?
        .id
        .clone();

    // Create -> IDLE, with a Droplet in the emulator.
    let create = caller.create(&id).await?;
    ensure!(
        state_of(acked(&create)) == Creating,
        "Create ack: {create:?}"
    );
    let idle = caller
        .wait_for_state(&id, Idle, SETTLE)
        .await
        .context("Create")?;
    let host = idle.host.clone().context("IDLE without a host")?;
    let (droplet, config) = droplet_of(api, &id)?
        .with_context(|| format!("no Droplet in the emulator carries machine {id}"))?;
    ensure!(
        host.r#ref.parse::<u64>().ok() == droplet["id"].as_u64()
            && droplet["region"]["slug"] == REGION,
        "the IDLE host {host:?} is not the emulator's Droplet {droplet}"
    );
    let pinned = std::fs::read_to_string(wire::pki_dir(root).join("ca.pem"))?;
    let endpoint = config["endpoint"].as_str().unwrap_or_default();
    ensure!(
        endpoint.starts_with("https://127.0.0.1:")
            && config["ca_pem"] == pinned.as_str()
            && config["token"]
                .as_str()
                .is_some_and(|t| t.starts_with("e1.") && t.len() > 46),
        "unexpected agent config in the user_data: endpoint {endpoint:?}, ca_pem matches: {}, token length: {:?}",
        config["ca_pem"] == pinned.as_str(),
        config["token"].as_str().map(str::len)
    );

    // The Droplet boots its agent.
    let agent_dir = dir.join("droplet");
    std::fs::create_dir_all(&agent_dir)?;
    *agent = Some(start_agent(root, &agent_dir, &config)?);

    // Configure -> CONFIGURED, the hook ran with the cluster and the exact blob.
    let request = pb::ConfigureRequest {
        machine_id: id.clone(),
        cluster_id: CLUSTER.into(),
        bootstrap_blob: BLOB.to_vec(),
        shard_metadata: Default::default(),
        ..wire::configure_request(&id, CLUSTER, Default::default(), caller.shard.next())
    };
    let configure = caller.client.configure(request).await?.into_inner();
    ensure!(
        state_of(acked(&configure)) == Configuring,
        "Configure ack: {configure:?}"
    );
    let configured = caller
        .wait_for_state(&id, Configured, SETTLE)
        .await
        .context("Configure")?;
    ensure!(
        configured.cluster == CLUSTER,
        "CONFIGURED without its cluster: {configured:?}"
    );
    let args = std::fs::read_to_string(agent_dir.join("hook.args")).unwrap_or_default();
    ensure!(
        args == format!("{CLUSTER}\n"),
        "the hook ran with {args:?}, want {CLUSTER:?}"
    );
    let copy = std::fs::read(agent_dir.join("hook.blob.copy")).context("the hook's blob copy")?;
    ensure!(
        copy == BLOB,
        "the hook got the blob {copy:?}, want {BLOB:?}"
    );

    // Drain -> IDLE, the drain script ran with the grace.
    let drain = caller.drain(&id).await?;
    ensure!(state_of(acked(&drain)) == Draining, "Drain ack: {drain:?}");
    let drained = caller
        .wait_for_state(&id, Idle, SETTLE)
        .await
        .context("Drain")?;
    ensure!(
        drained.cluster.is_empty() && drained.host.as_ref() == Some(&host),
        "a drained machine must keep its host and drop its cluster: {drained:?}"
    );
    let grace = std::fs::read_to_string(agent_dir.join("drain.args")).unwrap_or_default();
    ensure!(
        grace == "1\n",
        "the drain command ran with {grace:?}, want the 1 s grace"
    );

    // The user_data token was spent by the agent's enrollment: someone else presenting it (a
    // second agent started from the same user_data, without the first one's credential) gets
    // 401, and nothing.
    let thief_dir = dir.join("thief");
    std::fs::create_dir_all(&thief_dir)?;
    let thief = start_agent(root, &thief_dir, &config)?;
    eventually(
        Duration::from_secs(10),
        "the spent user_data token refused",
        || {
            Ok(thief
                .logs()
                .contains("refused the enrollment (401)")
                .then_some(()))
        },
    )
    .await
    .with_context(|| format!("the second agent's log:\n{}", thief.logs()))?;
    ensure!(
        !thief_dir.join("hook.args").exists() && !thief_dir.join("hook.blob.copy").exists(),
        "the second agent ran a hook"
    );
    drop(thief);

    // Delete -> SPECULATIVE, the Droplet is gone.
    let delete = caller.delete(&id).await?;
    ensure!(
        state_of(acked(&delete)) == Deleting,
        "Delete ack: {delete:?}"
    );
    let deleted = caller
        .wait_for_state(&id, Speculative, SETTLE)
        .await
        .context("Delete")?;
    ensure!(
        deleted.host.is_none(),
        "SPECULATIVE with a host after Delete: {deleted:?}"
    );
    eventually(Duration::from_secs(5), "the Droplet removed", || {
        Ok(droplets(api)?.is_empty().then_some(()))
    })
    .await?;
    Ok(())
}

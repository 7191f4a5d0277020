//! The on-host agent (`bigfleet-agent`): reads the config the provider's user_data wrote,
//! trusts only its pin over TLS 1.3 (the channel certificate's public key, or the named CA), long-polls the bootstrap channel with its
//! per-machine token, runs each command once (configure: write the blob and run the hook;
//! drain: run the drain command; ready, a probe, each time it is served), and acks it by id.
//! Executed commands and their outcomes are persisted, so a command re-served after a restart
//! of the agent or of the provider is answered from the record instead of being run twice; one
//! whose run was cut short by an agent restart is answered as failed. A command is known by its
//! id (the provider derives it from the transition, so a resumed transition serves the same
//! id), and a Configure by its run key where the provider sends one: the key stays the same
//! when the id changes (a new `--bootstrap-secret`) and differs for every other Configure, so a
//! record kept under an earlier id still answers it. The token and the blob are never logged.

use std::collections::VecDeque;
use std::io::Write as _;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use rand::RngExt as _;
use reqwest::{StatusCode, Url};
use serde::{Deserialize, Serialize};
use zeroize::Zeroizing;

use crate::pin::Pin;
use crate::token::AgentToken;

/// The default drain: cordon (tolerating failure) and drain the node named by the host name,
/// with the grace as pod grace period and drain timeout.
pub const DEFAULT_DRAIN_COMMAND: &str = "node=$(hostname -f 2>/dev/null || hostname); \
kubectl cordon \"$node\" || true; \
kubectl drain \"$node\" --ignore-daemonsets --delete-emptydir-data \
--grace-period=\"$BIGFLEET_GRACE_SECONDS\" --timeout=\"${BIGFLEET_GRACE_SECONDS}s\"";

/// How many executed command ids the state file remembers.
const REMEMBERED: usize = 256;
/// Per-request timeout: longer than the channel's poll hold.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(90);
/// Largest command body the agent reads from the channel (a blob of about 3 MiB, base64).
/// A larger answer is refused before it is parsed, so a rogue or broken server cannot make the
/// agent buffer without bound.
pub const MAX_COMMAND_BYTES: usize = 4 << 20;
/// Ack delivery attempts before going back to polling (a re-served command is re-acked).
const ACK_ATTEMPTS: u32 = 6;

/// `/etc/bigfleet-agent/config.json` as the provider writes it. Unknown fields are ignored, so
/// a newer provider's config still loads.
#[derive(Deserialize)]
pub struct AgentConfig {
    pub endpoint: String,
    /// Trust anchors (`--bootstrap-ca`). Used only when neither pin below is set: a provider
    /// that pins the channel's key writes its certificate here too, for agents that predate
    /// both pins.
    #[serde(default)]
    pub ca_pem: String,
    /// The channel's certificate (no `--bootstrap-ca`), written by providers before
    /// `pinned_spki_sha256`: its public key is pinned, so a renewal that keeps the key is
    /// accepted. Wins over `ca_pem`.
    #[serde(default)]
    pub pinned_cert_pem: String,
    /// Base64 SHA-256 of the channel certificate's SubjectPublicKeyInfo (no
    /// `--bootstrap-ca`); wins over both fields above.
    #[serde(default)]
    pub pinned_spki_sha256: String,
    pub machine_id: String,
    /// The one-time enrollment token from user_data. Zeroed on drop. The agent removes it
    /// from the file once it enrolled, so a config without one is valid when the agent's state
    /// holds its enrollment.
    #[serde(default)]
    pub token: Zeroizing<String>,
}

impl std::fmt::Debug for AgentConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentConfig")
            .field("endpoint", &self.endpoint)
            .field("machine_id", &self.machine_id)
            .finish_non_exhaustive()
    }
}

impl AgentConfig {
    pub fn load(path: &Path) -> Result<AgentConfig, String> {
        let bytes = Zeroizing::new(
            std::fs::read(path).map_err(|e| format!("read config {}: {e}", path.display()))?,
        );
        let config: AgentConfig = serde_json::from_slice(&bytes)
            .map_err(|e| format!("parse config {}: {e}", path.display()))?;
        for (name, value) in [
            ("endpoint", &config.endpoint),
            ("machine_id", &config.machine_id),
        ] {
            if value.trim().is_empty() {
                return Err(format!("config {}: {name} is empty", path.display()));
            }
        }
        config
            .pin()
            .map_err(|e| format!("config {}: {e}", path.display()))?;
        Ok(config)
    }

    /// What the agent trusts: the public key of `pinned_spki_sha256`, else that of the
    /// certificate of `pinned_cert_pem`, else every certificate of `ca_pem` as a trust anchor.
    /// A malformed value fails rather than being skipped, and a config with none trusts nothing
    /// and is refused.
    pub fn pin(&self) -> Result<Pin, String> {
        if !self.pinned_spki_sha256.trim().is_empty() {
            return crate::pin::parse_spki_pin(&self.pinned_spki_sha256)
                .map(Pin::PublicKey)
                .map_err(|e| format!("pinned_spki_sha256: {e}"));
        }
        if !self.pinned_cert_pem.trim().is_empty() {
            let certs = provider_core::tls::parse_certificates(self.pinned_cert_pem.as_bytes())
                .map_err(|e| format!("pinned_cert_pem: {e}"))?;
            let [cert] = <[_; 1]>::try_from(certs).map_err(|certs| {
                format!(
                    "pinned_cert_pem: holds {} certificates; it must hold exactly the channel's \
                     own certificate",
                    certs.len()
                )
            })?;
            return crate::pin::spki_sha256(&cert)
                .map(Pin::PublicKey)
                .map_err(|e| format!("pinned_cert_pem: {e}"));
        }
        if !self.ca_pem.trim().is_empty() {
            return provider_core::tls::parse_certificates(self.ca_pem.as_bytes())
                .map(Pin::Anchors)
                .map_err(|e| format!("ca_pem: {e}"));
        }
        Err(
            "none of pinned_spki_sha256, pinned_cert_pem and ca_pem is set, so the agent would \
             trust no server"
                .into(),
        )
    }
}

/// What the agent runs and where it keeps its record.
#[derive(Clone, Debug)]
pub struct AgentOptions {
    pub hook: PathBuf,
    /// Run with `sh -c`; `$BIGFLEET_GRACE_SECONDS` (and `$1`) hold the grace.
    pub drain_command: String,
    /// Run with `sh -c` to confirm readiness; `None` takes the hook's success as readiness.
    pub readiness_command: Option<String>,
    pub state_path: PathBuf,
    /// Longest wait between attempts when the provider is unreachable.
    pub max_backoff: Duration,
    /// How long the hook, the readiness command and the drain command may each run before
    /// their process group is killed and the command is acked as failed.
    pub timeouts: CommandTimeouts,
    /// The config file the token came from: rewritten without it once the agent enrolled.
    pub config_path: Option<PathBuf>,
}

/// Per-command time limits of the agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommandTimeouts {
    pub hook: Duration,
    pub readiness: Duration,
    pub drain: Duration,
}

impl Default for CommandTimeouts {
    /// The provider's own default transition timeouts: nobody waits for a configure or a
    /// readiness check longer than the Configure timeout (8m), or for a drain longer than the
    /// Drain timeout (15m).
    fn default() -> CommandTimeouts {
        CommandTimeouts {
            hook: Duration::from_secs(8 * 60),
            readiness: Duration::from_secs(8 * 60),
            drain: Duration::from_secs(15 * 60),
        }
    }
}

/// A command as the channel serves it. The blob is zeroed on drop and never printed.
#[derive(Deserialize)]
pub struct WireCommand {
    id: String,
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    cluster_id: String,
    #[serde(default)]
    blob: Zeroizing<String>,
    #[serde(default)]
    grace_seconds: i64,
    /// What the run of a Configure is recorded under (providers before run keys send none).
    #[serde(default)]
    run_key: String,
}

impl std::fmt::Debug for WireCommand {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WireCommand")
            .field("id", &self.id)
            .field("kind", &self.kind)
            .field("cluster_id", &self.cluster_id)
            .field(
                "blob",
                &format_args!("[redacted; {} bytes]", self.blob.len()),
            )
            .field("grace_seconds", &self.grace_seconds)
            .field("run_key", &self.run_key)
            .finish()
    }
}

#[derive(Serialize)]
struct WireAck<'a> {
    command_id: &'a str,
    ok: bool,
    #[serde(skip_serializing_if = "str::is_empty")]
    error: &'a str,
}

/// One remembered command: `outcome` is `None` while it runs.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
struct Executed {
    id: String,
    outcome: Option<Result<(), String>>,
    /// The run key it came with; absent for a command without one, and in the records of
    /// agents before run keys.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    key: Option<String>,
}

/// How a command is looked up in the record: its id, and its run key if it has one.
#[derive(Clone, Copy, Debug)]
struct CommandRef<'a> {
    id: &'a str,
    key: &'a str,
}

impl CommandRef<'_> {
    /// Whether `entry` records this command. A command with a run key is known by that key
    /// (the id of the same Configure changes with the provider's secret, and an id can come
    /// round again for another Configure after the provider lost its state), or by its id in
    /// an entry that has no key (the record of an agent before run keys). A command without
    /// one (from a provider before run keys) is known by its id, as before.
    fn names(&self, entry: &Executed) -> bool {
        match (&entry.key, self.key.is_empty()) {
            (Some(key), false) => *key == self.key,
            (None, false) | (_, true) => entry.id == self.id,
        }
    }
}

/// The executed-command record, persisted atomically after every change, and the agent's
/// enrollment.
#[derive(Debug, Default, Serialize, Deserialize)]
struct AgentState {
    #[serde(deserialize_with = "entries_as_written")]
    executed: VecDeque<Executed>,
    /// Absent in the state of an agent that never enrolled (or predates enrollment).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    enrollment: Option<EnrolledCredential>,
}

/// The credential the agent enrolled with (or is enrolling with: `confirmed` false until the
/// provider answered), and a digest of the user_data token it was made for, so a config with
/// another token (a new Droplet whose disk holds an old state) enrolls afresh.
#[derive(Clone, Serialize, Deserialize)]
struct EnrolledCredential {
    /// Zeroed on drop, never printed.
    credential: Zeroizing<String>,
    /// Hex SHA-256 of the user_data token.
    token_digest: String,
    confirmed: bool,
}

impl std::fmt::Debug for EnrolledCredential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnrolledCredential")
            .field("confirmed", &self.confirmed)
            .finish_non_exhaustive()
    }
}

fn token_digest(token: &str) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(token.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The record's entries, each an object as the agent writes it: serde would also take an
/// entry written as an array (`["op-7.drain", null]`), a form no agent wrote, so a damaged or
/// hand-made file of that shape is refused like any other damage.
fn entries_as_written<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<VecDeque<Executed>, D::Error> {
    Vec::<serde_json::Map<String, serde_json::Value>>::deserialize(deserializer)?
        .into_iter()
        .map(|entry| {
            serde_json::from_value(serde_json::Value::Object(entry))
                .map_err(serde::de::Error::custom)
        })
        .collect()
}

impl AgentState {
    fn load(path: &Path) -> Result<AgentState, String> {
        match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| format!("parse state {}: {e}", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(AgentState::default()),
            Err(e) => Err(format!("read state {}: {e}", path.display())),
        }
    }

    fn save(&self, path: &Path) -> Result<(), String> {
        let fail = |e: std::io::Error| format!("write state {}: {e}", path.display());
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(fail)?;
        }
        let tmp = path.with_extension("tmp");
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(fail)?;
        file.write_all(&serde_json::to_vec(self).unwrap_or_default())
            .map_err(fail)?;
        file.sync_all().map_err(fail)?;
        std::fs::rename(&tmp, path).map_err(fail)
    }

    fn forget(&mut self, command: CommandRef<'_>) {
        self.executed.retain(|e| !command.names(e));
    }

    fn find(&self, command: CommandRef<'_>) -> Option<&Executed> {
        self.executed.iter().find(|e| command.names(e))
    }

    fn record(&mut self, command: CommandRef<'_>, outcome: Option<Result<(), String>>) {
        if let Some(e) = self.executed.iter_mut().find(|e| command.names(e)) {
            e.outcome = outcome;
            return;
        }
        self.executed.push_back(Executed {
            id: command.id.to_owned(),
            outcome,
            key: (!command.key.is_empty()).then(|| command.key.to_owned()),
        });
        while self.executed.len() > REMEMBERED {
            self.executed.pop_front();
        }
    }
}

/// One entry of the agent's record (`--state`): a command id and its outcome, `None` from the
/// start of its run until it ends, and for good when an agent restart cut the run short.
pub type RecordedCommand = (String, Option<Result<(), String>>);

/// The record in the `--state` file at `path`, oldest first, as the agent reads it at startup
/// (a missing file is an empty record; a damaged one an error).
pub fn read_record(path: &Path) -> Result<Vec<RecordedCommand>, String> {
    AgentState::load(path).map(|state| {
        state
            .executed
            .into_iter()
            .map(|e| (e.id, e.outcome))
            .collect()
    })
}

/// Records `entries` in order as the agent does (an id seen again keeps its place and takes
/// the later outcome; the newest 256 ids are kept) and writes the file as the agent does.
pub fn write_record(path: &Path, entries: &[RecordedCommand]) -> Result<(), String> {
    let mut state = AgentState::default();
    for (id, outcome) in entries {
        state.record(CommandRef { id, key: "" }, outcome.clone());
    }
    state.save(path)
}

/// How many command ids the record keeps.
pub const RECORDED_COMMANDS: usize = REMEMBERED;

/// The running agent.
pub struct Agent {
    /// Replaced (its pooled connections dropped) when a replica that does not lead answers.
    http: std::sync::Mutex<reqwest::Client>,
    tls: rustls::ClientConfig,
    command_url: Url,
    ack_url: Url,
    enroll_url: Url,
    /// The user_data token (empty once it was spent and removed from the config).
    token: AgentToken,
    /// What authenticates requests: the enrolled credential, or (with a provider that predates
    /// enrollment) the token.
    bearer: AgentToken,
    machine_id: String,
    options: AgentOptions,
    state: AgentState,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("machine_id", &self.machine_id)
            .finish_non_exhaustive()
    }
}

impl Agent {
    pub fn new(config: AgentConfig, options: AgentOptions) -> Result<Agent, String> {
        // The pin, and nothing else (not the system's roots), decides whom the agent trusts;
        // the rustls config is TLS 1.3 only.
        let pin = config.pin().map_err(|e| format!("config {e}"))?;
        let tls = crate::pin::client_config(&pin).map_err(|e| format!("config {e}"))?;
        let http = std::sync::Mutex::new(http_client(&tls)?);
        let base = config.endpoint.trim_end_matches('/');
        let endpoint_url = |path: &str| -> Result<Url, String> {
            let mut url = Url::parse(&format!("{base}{path}"))
                .map_err(|e| format!("config endpoint {:?}: {e}", config.endpoint))?;
            if url.scheme() != "https" {
                return Err(format!(
                    "config endpoint {:?}: must be https",
                    config.endpoint
                ));
            }
            url.query_pairs_mut()
                .append_pair("machine_id", &config.machine_id);
            Ok(url)
        };
        let command_url = endpoint_url("/v1/command")?;
        let ack_url = endpoint_url("/v1/ack")?;
        let enroll_url = endpoint_url("/v1/enroll")?;
        let state = AgentState::load(&options.state_path)?;
        let token = AgentToken::from_config(Zeroizing::new(config.token.trim().to_owned()));
        if token.expose().is_empty() && !state.enrollment.as_ref().is_some_and(|e| e.confirmed) {
            return Err(format!(
                "config: token is empty and the state {} holds no enrollment, so the agent \
                 cannot authenticate",
                options.state_path.display()
            ));
        }
        Ok(Agent {
            http,
            tls,
            command_url,
            ack_url,
            enroll_url,
            bearer: token.clone(),
            token,
            machine_id: config.machine_id,
            options,
            state,
        })
    }

    /// Polls and executes commands until `shutdown` resolves.
    pub async fn run(mut self, shutdown: impl std::future::Future<Output = ()>) {
        tokio::pin!(shutdown);
        let mut failures = 0u32;
        loop {
            let enrolled = tokio::select! {
                () = &mut shutdown => return,
                enrolled = self.enroll() => enrolled,
            };
            match enrolled {
                Ok(()) => break,
                Err(e) => {
                    failures += 1;
                    let wait = self.backoff(failures);
                    tracing::warn!(error = %e, retry_in_ms = wait.as_millis() as u64, "enrollment failed");
                    tokio::select! {
                        () = &mut shutdown => return,
                        () = tokio::time::sleep(wait) => {}
                    }
                }
            }
        }
        failures = 0;
        tracing::info!(machine_id = %self.machine_id, endpoint = %self.command_url.origin().ascii_serialization(), "bigfleet-agent polling");
        loop {
            let polled = tokio::select! {
                () = &mut shutdown => return,
                polled = self.poll() => polled,
            };
            match polled {
                Ok(Some(command)) => {
                    failures = 0;
                    self.handle(command).await;
                }
                Ok(None) => failures = 0,
                Err(e) => {
                    failures += 1;
                    let wait = self.backoff(failures);
                    tracing::warn!(error = %e, retry_in_ms = wait.as_millis() as u64, "poll failed");
                    tokio::select! {
                        () = &mut shutdown => return,
                        () = tokio::time::sleep(wait) => {}
                    }
                }
            }
        }
    }

    fn http(&self) -> reqwest::Client {
        self.http.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// A standby replica answered (503): the connection the client keeps reaches that replica,
    /// so the next request opens a new one, which the Service routes to the leader.
    fn reconnect(&self) {
        match http_client(&self.tls) {
            Ok(fresh) => *self.http.lock().unwrap_or_else(|e| e.into_inner()) = fresh,
            Err(e) => tracing::warn!(error = %e, "cannot rebuild the HTTPS client"),
        }
    }

    fn backoff(&self, failures: u32) -> Duration {
        let exp = Duration::from_millis(250).saturating_mul(1 << failures.min(10));
        exp.min(self.options.max_backoff)
            .mul_f64(rand::rng().random_range(0.5..=1.0))
    }

    /// Makes sure the agent speaks with an enrolled credential: one in its state made for the
    /// config's token (or, once the token was removed, any confirmed one) is used as it is;
    /// otherwise a fresh credential is recorded in the state first (so an answer lost to a
    /// crash is repaired by sending the same one again), presented with the token, and on
    /// success the token is removed from the config. A provider that predates enrollment
    /// (404) is spoken to with the token, as before.
    async fn enroll(&mut self) -> Result<(), String> {
        let token = self.token.expose().to_owned();
        let digest = (!token.is_empty()).then(|| token_digest(&token));
        let current = self
            .state
            .enrollment
            .clone()
            .filter(|e| digest.as_ref().is_none_or(|d| *d == e.token_digest));
        if let Some(held) = &current
            && held.confirmed
        {
            self.bearer = AgentToken::from_config(held.credential.clone());
            self.forget_token();
            return Ok(());
        }
        let Some(digest) = digest else {
            return Err("no token to enroll with".into());
        };
        let held = match current {
            Some(held) => held,
            None => {
                let fresh = EnrolledCredential {
                    credential: Zeroizing::new(crate::token::new_credential().expose().to_owned()),
                    token_digest: digest,
                    confirmed: false,
                };
                self.state.enrollment = Some(fresh.clone());
                self.state.save(&self.options.state_path)?;
                fresh
            }
        };
        #[derive(Serialize)]
        struct Body<'a> {
            credential: &'a str,
        }
        let response = self
            .http()
            .post(self.enroll_url.clone())
            .bearer_auth(&token)
            .json(&Body {
                credential: &held.credential,
            })
            .send()
            .await
            .map_err(|e| describe(&e))?;
        match response.status() {
            StatusCode::OK => {
                let mut confirmed = held;
                confirmed.confirmed = true;
                self.bearer = AgentToken::from_config(confirmed.credential.clone());
                self.state.enrollment = Some(confirmed);
                self.state.save(&self.options.state_path)?;
                // The token leaves the config before the line that says it is spent.
                self.forget_token();
                tracing::info!(machine_id = %self.machine_id, "enrolled; the user_data token is spent");
                Ok(())
            }
            StatusCode::NOT_FOUND => {
                tracing::info!(machine_id = %self.machine_id, "the provider predates enrollment; authenticating with the user_data token");
                self.bearer = self.token.clone();
                Ok(())
            }
            StatusCode::SERVICE_UNAVAILABLE => {
                self.reconnect();
                Err("the provider cannot take the enrollment now (503); retrying".into())
            }
            StatusCode::UNAUTHORIZED => Err(
                "the provider refused the enrollment (401): the token is not this Droplet's, \
                 it was already spent by another enrollment, or this address is not one the \
                 cloud assigned to the Droplet (--bootstrap-enrollment-source)"
                    .into(),
            ),
            other => Err(format!("unexpected status {other} to the enrollment")),
        }
    }

    /// Removes the spent token from the config file, so a reader of it learns nothing usable.
    fn forget_token(&self) {
        let Some(path) = &self.options.config_path else {
            return;
        };
        if let Err(e) = remove_token(path) {
            tracing::warn!(config = %path.display(), error = %e, "cannot remove the spent token from the config (it no longer authenticates anything)");
        }
    }

    async fn poll(&self) -> Result<Option<WireCommand>, String> {
        let response = self
            .http()
            .get(self.command_url.clone())
            .bearer_auth(self.bearer.expose())
            .send()
            .await
            .map_err(|e| describe(&e))?;
        match response.status() {
            StatusCode::NO_CONTENT => Ok(None),
            StatusCode::OK => {
                let bytes = read_capped(response, MAX_COMMAND_BYTES).await?;
                serde_json::from_slice(&bytes)
                    .map(Some)
                    .map_err(|e| format!("bad command: {e}"))
            }
            StatusCode::UNAUTHORIZED => Err(
                "the provider rejected this machine's token (401): check the machine id and \
                     the provider's --bootstrap-secret"
                    .into(),
            ),
            StatusCode::SERVICE_UNAVAILABLE => {
                self.reconnect();
                Err("the provider replica does not lead (503); reconnecting".into())
            }
            other => Err(format!("unexpected status {other}")),
        }
    }

    async fn handle(&mut self, command: WireCommand) {
        let id = command.id.clone();
        let key = command.run_key.clone();
        let named = CommandRef { id: &id, key: &key };
        if command.kind == "ready" {
            // Readiness is a probe that changes nothing: it is answered by running it each
            // time it is served, so an earlier "not ready" is never replayed and a check
            // interrupted by a restart of either side is simply asked again.
            tracing::info!(command_id = %id, command = %command.kind, cluster_id = %command.cluster_id, "running command");
            let outcome = self.execute(&command).await;
            log_outcome(&id, &command.kind, &outcome);
            self.ack(&id, &outcome).await;
            return;
        }
        let outcome = match self.state.find(named) {
            Some(Executed {
                outcome: Some(outcome),
                ..
            }) => {
                tracing::info!(command_id = %id, run_key = %key, "command already executed; acknowledging again");
                outcome.clone()
            }
            Some(Executed { outcome: None, .. }) => {
                tracing::warn!(command_id = %id, run_key = %key, "command was interrupted by an agent restart; not running it again");
                let outcome = Err(
                    "the agent restarted while running this command; it was not run again"
                        .to_owned(),
                );
                if let Err(e) = self.remember(named, Some(outcome.clone())) {
                    tracing::error!(command_id = %id, error = %e, "cannot persist the outcome of the command");
                }
                outcome
            }
            None => {
                // Recorded as started before anything runs: if the start cannot be made
                // durable, a crash during the run could not be told from a command never run,
                // so it is not run at all.
                if let Err(e) = self.remember(named, None) {
                    tracing::error!(command_id = %id, error = %e, "cannot record the command before running it; not running it");
                    // Forget it again, so a later delivery once the disk is writable runs it.
                    self.state.forget(named);
                    let outcome = Err(format!(
                        "the agent could not record the command before running it, so it did \
                         not run it: {e}"
                    ));
                    self.ack(&id, &outcome).await;
                    return;
                }
                tracing::info!(command_id = %id, run_key = %key, command = %command.kind, cluster_id = %command.cluster_id, "running command");
                let outcome = self.execute(&command).await;
                log_outcome(&id, &command.kind, &outcome);
                if let Err(e) = self.remember(named, Some(outcome.clone())) {
                    // The start is on disk: a re-delivery after a restart is answered as
                    // interrupted, never run again.
                    tracing::error!(command_id = %id, error = %e, "cannot persist the outcome of the command");
                }
                outcome
            }
        };
        self.ack(&id, &outcome).await;
    }

    fn remember(
        &mut self,
        command: CommandRef<'_>,
        outcome: Option<Result<(), String>>,
    ) -> Result<(), String> {
        self.state.record(command, outcome);
        self.state.save(&self.options.state_path)
    }

    async fn execute(&self, command: &WireCommand) -> Result<(), String> {
        match command.kind.as_str() {
            "configure" => self.configure(command).await,
            "ready" => match &self.options.readiness_command {
                None => Ok(()),
                Some(script) => {
                    let mut cmd = shell(script);
                    cmd.env("BIGFLEET_CLUSTER_ID", &command.cluster_id);
                    run(cmd, "readiness command", self.options.timeouts.readiness).await
                }
            },
            "drain" => {
                let grace = command.grace_seconds.max(1).to_string();
                let mut cmd = shell(&self.options.drain_command);
                cmd.arg(&grace).env("BIGFLEET_GRACE_SECONDS", &grace);
                run(cmd, "drain command", self.options.timeouts.drain).await
            }
            other => Err(format!("unknown command type {other:?}")),
        }
    }

    async fn configure(&self, command: &WireCommand) -> Result<(), String> {
        let blob = Zeroizing::new(
            STANDARD
                .decode(command.blob.as_bytes())
                .map_err(|e| format!("bad blob: {e}"))?,
        );
        let blob_path = blob_path(&self.options.hook);
        write_private(&blob_path, &blob)
            .map_err(|e| format!("write {}: {e}", blob_path.display()))?;
        let mut cmd = tokio::process::Command::new(&self.options.hook);
        cmd.arg(&command.cluster_id)
            .env("BIGFLEET_CLUSTER_ID", &command.cluster_id)
            .env("BIGFLEET_MACHINE_ID", &self.machine_id)
            .env("BIGFLEET_BLOB_FILE", &blob_path);
        run(cmd, "bootstrap hook", self.options.timeouts.hook).await
    }

    async fn ack(&self, id: &str, outcome: &Result<(), String>) {
        let error = outcome.as_ref().err().map(String::as_str).unwrap_or("");
        let body = WireAck {
            command_id: id,
            ok: outcome.is_ok(),
            error,
        };
        for attempt in 1..=ACK_ATTEMPTS {
            let sent = self
                .http()
                .post(self.ack_url.clone())
                .bearer_auth(self.bearer.expose())
                .json(&body)
                .send()
                .await;
            match sent {
                Ok(r) if r.status() == StatusCode::OK => return,
                Ok(r) if r.status() == StatusCode::NO_CONTENT => {
                    tracing::info!(command_id = %id, "ack not needed any more (the provider stopped waiting)");
                    return;
                }
                Ok(r) => {
                    if r.status() == StatusCode::SERVICE_UNAVAILABLE {
                        self.reconnect();
                    }
                    tracing::warn!(command_id = %id, status = %r.status(), "ack refused");
                }
                Err(e) => tracing::warn!(command_id = %id, error = %describe(&e), "ack failed"),
            }
            tokio::time::sleep(self.backoff(attempt)).await;
        }
        tracing::warn!(command_id = %id, "ack not delivered; back to polling (a provider still waiting serves the command again, and it is answered from the record)");
    }
}

fn log_outcome(id: &str, kind: &str, outcome: &Result<(), String>) {
    match outcome {
        Ok(()) => tracing::info!(command_id = %id, command = %kind, "command succeeded"),
        Err(e) => {
            tracing::warn!(command_id = %id, command = %kind, error = %e, "command failed")
        }
    }
}

/// The agent's HTTPS client: TLS 1.3 with the pin only.
fn http_client(tls: &rustls::ClientConfig) -> Result<reqwest::Client, String> {
    reqwest::Client::builder()
        .use_preconfigured_tls(tls.clone())
        .https_only(true)
        .connect_timeout(Duration::from_secs(10))
        .timeout(REQUEST_TIMEOUT)
        .user_agent(concat!("bigfleet-agent/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| format!("build HTTPS client: {e}"))
}

/// Rewrites the JSON config at `path` without its `token` (atomically, 0600); a config that
/// holds none is left alone.
fn remove_token(path: &Path) -> Result<(), String> {
    let bytes = Zeroizing::new(std::fs::read(path).map_err(|e| e.to_string())?);
    let mut value: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| format!("parse: {e}"))?;
    let Some(object) = value.as_object_mut() else {
        return Err("not a JSON object".into());
    };
    if object.remove("token").is_none() {
        return Ok(());
    }
    let text = serde_json::to_vec_pretty(&value).map_err(|e| e.to_string())?;
    let tmp = path.with_extension("tmp");
    write_private(&tmp, &text).map_err(|e| e.to_string())?;
    std::fs::rename(&tmp, path).map_err(|e| e.to_string())
}

/// `<hook>.blob`.
pub fn blob_path(hook: &Path) -> PathBuf {
    let mut name = hook.as_os_str().to_owned();
    name.push(".blob");
    PathBuf::from(name)
}

/// Writes `bytes` to `path` readable by the owner only, also when the file already existed.
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    file.write_all(bytes)?;
    file.sync_all()
}

fn shell(script: &str) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new("/bin/sh");
    cmd.arg("-c").arg(script).arg("bigfleet-agent");
    cmd
}

/// Runs `cmd` as the leader of its own process group, for at most `timeout`. On expiry (or
/// when the agent stops waiting) the whole group is killed, so children the command started
/// (a `sleep`, a `kubeadm` under a shell) do not outlive it; a child that moved itself into
/// another session escapes, as with any process-group kill.
async fn run(
    mut cmd: tokio::process::Command,
    what: &str,
    timeout: Duration,
) -> Result<(), String> {
    cmd.stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .process_group(0);
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("{what}: cannot start: {e}"))?;
    let mut group = GroupGuard(child.id());
    let waited = tokio::time::timeout(timeout, child.wait()).await;
    match waited {
        Ok(Ok(status)) => {
            // It ended by itself: whatever it left running in the background is its business.
            group.0 = None;
            if status.success() {
                Ok(())
            } else {
                Err(format!("{what} failed: {status}"))
            }
        }
        Ok(Err(e)) => Err(format!("{what}: cannot wait for it: {e}")),
        Err(_) => {
            drop(group);
            // Reap the leader so it leaves no zombie; the kill makes this immediate.
            let _ = child.wait().await;
            Err(format!(
                "{what} timed out after {} and was killed with its process group",
                provider_core::duration::format(timeout)
            ))
        }
    }
}

/// Kills a process group with SIGKILL when dropped, unless disarmed (`None`).
struct GroupGuard(Option<u32>);

impl Drop for GroupGuard {
    fn drop(&mut self) {
        if let Some(leader) = self.0.take().and_then(|id| i32::try_from(id).ok()) {
            // ESRCH (the group is gone already) is the only expected error.
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(leader),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// Reads a response body of at most `cap` bytes into a buffer zeroed on drop.
async fn read_capped(
    mut response: reqwest::Response,
    cap: usize,
) -> Result<Zeroizing<Vec<u8>>, String> {
    let too_large = || format!("command body larger than {cap} bytes refused");
    let declared = response.content_length();
    if declared.is_some_and(|n| n > cap as u64) {
        return Err(too_large());
    }
    // Reserving the declared size up front avoids reallocations that would leave unzeroed
    // copies of the blob behind.
    let mut body = Zeroizing::new(Vec::with_capacity(
        declared.map_or(0, |n| usize::try_from(n).unwrap_or(cap)),
    ));
    while let Some(chunk) = response.chunk().await.map_err(|e| describe(&e))? {
        if body.len() + chunk.len() > cap {
            return Err(too_large());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// A transport error with its causes, without the URL (whose query is harmless but long).
fn describe(e: &reqwest::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(id: &str) -> CommandRef<'_> {
        CommandRef { id, key: "" }
    }

    /// A Configure with a run key is known by it: under another id (a rotated secret) it is
    /// answered from its record; another key under the same id (an operation id that came
    /// round again after the provider lost its state) is another command; an entry an older
    /// agent wrote without a key still answers its id, and a command without a key (an older
    /// provider) is known by its id alone.
    #[test]
    fn run_keys_name_a_configure_across_ids() {
        let mut state = AgentState::default();
        let keyed = |id, key| CommandRef { id, key };
        state.record(
            keyed("op-2.configure.7ad30b06aaaaaaaa", "op-2.configure.k1"),
            Some(Ok(())),
        );
        assert!(
            state
                .find(keyed(
                    "op-2.configure.f144099dbbbbbbbb",
                    "op-2.configure.k1"
                ))
                .is_some()
        );
        assert!(
            state
                .find(keyed(
                    "op-2.configure.7ad30b06aaaaaaaa",
                    "op-2.configure.k2"
                ))
                .is_none()
        );
        assert!(state.find(id("op-2.configure.7ad30b06aaaaaaaa")).is_some());
        state.record(id("op-3.configure.0000000000000000"), None);
        assert!(
            state
                .find(keyed(
                    "op-3.configure.0000000000000000",
                    "op-3.configure.k3"
                ))
                .is_some()
        );
        // An outcome recorded under a new id keeps the entry (one entry per run).
        state.record(
            keyed("op-2.configure.f144099dbbbbbbbb", "op-2.configure.k1"),
            Some(Err("x".into())),
        );
        assert_eq!(state.executed.len(), 2);
        assert_eq!(state.executed[0].key.as_deref(), Some("op-2.configure.k1"));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        state.save(&path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains("\"key\":\"op-2.configure.k1\""), "{text}");
        assert_eq!(AgentState::load(&path).unwrap().executed, state.executed);
    }

    #[test]
    fn state_remembers_a_bounded_number_of_ids() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/state.json");
        let mut state = AgentState::default();
        for i in 0..(REMEMBERED + 5) {
            state.record(id(&i.to_string()), Some(Ok(())));
        }
        state.record(id("x"), None);
        state.record(id("x"), Some(Err("boom".into())));
        state.save(&path).unwrap();
        let loaded = AgentState::load(&path).unwrap();
        assert_eq!(loaded.executed.len(), REMEMBERED);
        assert!(loaded.find(id("0")).is_none());
        assert_eq!(
            loaded.find(id("x")).unwrap().outcome,
            Some(Err("boom".into()))
        );
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(
            AgentState::load(&dir.path().join("missing"))
                .unwrap()
                .executed
                .is_empty()
        );
    }

    /// An entry is an object, as the agent writes it; one written as an array is refused,
    /// naming the file.
    #[test]
    fn an_entry_written_as_an_array_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        std::fs::write(&path, br#"{"executed":[["op-9.drain",null]]}"#).unwrap();
        let err = AgentState::load(&path).unwrap_err();
        assert!(
            err.starts_with(&format!("parse state {}: ", path.display())),
            "{err}"
        );
        std::fs::write(
            &path,
            br#"{"executed":[{"id":"op-9.drain","outcome":null}]}"#,
        )
        .unwrap();
        assert_eq!(AgentState::load(&path).unwrap().executed.len(), 1);
    }

    /// A state file as the release before transition-derived command ids wrote it (ids
    /// `<random prefix>-<n>`; an outcome, a failure, and a run cut short) loads, answers from
    /// its record, and keeps its entries when the new form is added beside them.
    #[test]
    fn a_state_file_of_the_earlier_release_loads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        std::fs::write(
            &path,
            br#"{"executed":[{"id":"9f2c4a1b7e30-1","outcome":{"Ok":null}},{"id":"9f2c4a1b7e30-2","outcome":{"Err":"bootstrap hook failed: exit status: 3"}},{"id":"9f2c4a1b7e30-3","outcome":null}]}"#,
        )
        .unwrap();
        let mut state = AgentState::load(&path).unwrap();
        assert_eq!(
            state.find(id("9f2c4a1b7e30-1")).unwrap().outcome,
            Some(Ok(()))
        );
        assert_eq!(
            state.find(id("9f2c4a1b7e30-2")).unwrap().outcome,
            Some(Err("bootstrap hook failed: exit status: 3".into()))
        );
        assert_eq!(state.find(id("9f2c4a1b7e30-3")).unwrap().outcome, None);
        state.record(id("op-7.configure.0123456789abcdef"), Some(Ok(())));
        state.save(&path).unwrap();
        let reloaded = AgentState::load(&path).unwrap();
        assert_eq!(reloaded.executed.len(), 4);
        assert_eq!(reloaded.executed[0].id, "9f2c4a1b7e30-1");
        assert_eq!(
            reloaded
                .find(id("op-7.configure.0123456789abcdef"))
                .unwrap()
                .outcome,
            Some(Ok(()))
        );
        // Unknown fields of a later release are ignored.
        std::fs::write(
            &path,
            br#"{"executed":[{"id":"op-1.drain","outcome":{"Ok":null},"at":"later"}],"v":2}"#,
        )
        .unwrap();
        assert!(
            AgentState::load(&path)
                .unwrap()
                .find(id("op-1.drain"))
                .is_some()
        );
        // A damaged file stops the agent instead of letting it forget what it ran.
        std::fs::write(&path, b"{\"executed\":[").unwrap();
        assert!(
            AgentState::load(&path)
                .unwrap_err()
                .starts_with("parse state")
        );
    }

    /// Whether process `pid` is gone (or a zombie nobody reaped yet: it runs nothing).
    fn gone(pid: &str) -> bool {
        match std::fs::read_to_string(format!("/proc/{}/stat", pid.trim())) {
            Err(_) => true,
            // The state follows the parenthesised command name.
            Ok(stat) => stat
                .rsplit(')')
                .next()
                .is_some_and(|rest| rest.trim_start().starts_with('Z')),
        }
    }

    #[tokio::test]
    async fn a_command_that_outlives_its_timeout_is_killed_with_its_children() {
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("child.pid");
        let script = format!("sleep 1000 & echo $! > '{}'; wait", pid_file.display());
        // On a busy machine the shell may be killed before it started its child; such a run
        // has no child to look for, so the run is repeated (a count, not a longer timeout).
        let mut child = None;
        for _ in 0..20 {
            let started = std::time::Instant::now();
            let err = run(shell(&script), "drain command", Duration::from_millis(300))
                .await
                .unwrap_err();
            assert_eq!(
                err,
                "drain command timed out after 300ms and was killed with its process group"
            );
            assert!(started.elapsed() < Duration::from_secs(30));
            if let Ok(pid) = std::fs::read_to_string(&pid_file)
                && !pid.trim().is_empty()
            {
                child = Some(pid);
                break;
            }
        }
        let child = child.expect("the shell started its child in one of 20 runs");
        let mut waited = 0;
        while !gone(&child) && waited < 100 {
            std::thread::sleep(Duration::from_millis(50));
            waited += 1;
        }
        assert!(gone(&child), "the command's child {child} still runs");
        // A command that finishes in time is judged by its exit status.
        run(
            shell("exit 0"),
            "readiness command",
            Duration::from_secs(30),
        )
        .await
        .unwrap();
        let err = run(
            shell("exit 3"),
            "readiness command",
            Duration::from_secs(30),
        )
        .await
        .unwrap_err();
        assert!(
            err.starts_with("readiness command failed: exit status: 3"),
            "{err}"
        );
    }

    #[test]
    fn a_wire_command_never_prints_its_blob() {
        let command: WireCommand = serde_json::from_str(
            r#"{"id":"7","type":"configure","cluster_id":"c","blob":"c2VjcmV0LWpvaW4tdG9rZW4="}"#,
        )
        .unwrap();
        let shown = format!("{command:?}");
        assert!(!shown.contains("c2VjcmV0LWpvaW4tdG9rZW4="), "{shown}");
        assert!(
            shown.contains("[redacted; 24 bytes]") && shown.contains("\"7\""),
            "{shown}"
        );
    }

    #[test]
    fn blob_next_to_hook() {
        assert_eq!(
            blob_path(Path::new("/opt/bigfleet/bootstrap")),
            PathBuf::from("/opt/bigfleet/bootstrap.blob")
        );
    }

    fn cert_pem() -> String {
        let key = rcgen::KeyPair::generate().unwrap();
        rcgen::CertificateParams::new(vec!["x".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap()
            .pem()
    }

    #[test]
    fn config_needs_every_field() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.json");
        let ca = cert_pem();
        let write = |value: serde_json::Value| std::fs::write(&path, value.to_string()).unwrap();
        // Without a token the config loads (an enrolled agent removed it), but an agent whose
        // state holds no enrollment cannot start from it.
        write(serde_json::json!({"endpoint":"https://x","ca_pem":ca,"machine_id":"m","token":" "}));
        let blank = AgentConfig::load(&path).unwrap();
        let options = AgentOptions {
            hook: dir.path().join("hook"),
            drain_command: "true".into(),
            readiness_command: None,
            state_path: dir.path().join("state.json"),
            max_backoff: Duration::from_secs(1),
            timeouts: CommandTimeouts::default(),
            config_path: None,
        };
        assert!(
            Agent::new(blank, options)
                .unwrap_err()
                .contains("token is empty and the state")
        );
        // A config of a provider that wrote only ca_pem: its certificates are trust anchors.
        write(serde_json::json!({"endpoint":"https://x","ca_pem":ca,"machine_id":"m","token":"t"}));
        let c = AgentConfig::load(&path).unwrap();
        assert!(!format!("{c:?}").contains("\"t\""));
        let anchors = provider_core::tls::parse_certificates(ca.as_bytes()).unwrap();
        assert_eq!(c.pin().unwrap(), Pin::Anchors(anchors.clone()));
        // pinned_cert_pem wins over ca_pem; unknown fields are ignored.
        let leaf = cert_pem();
        write(
            serde_json::json!({"endpoint":"https://x","ca_pem":ca,"pinned_cert_pem":leaf,
            "machine_id":"m","token":"t","from_the_future":1}),
        );
        // An older provider's pinned_cert_pem pins its certificate's public key.
        let pinned = provider_core::tls::parse_certificates(leaf.as_bytes()).unwrap();
        let key = crate::pin::spki_sha256(&pinned[0]).unwrap();
        assert_eq!(
            AgentConfig::load(&path).unwrap().pin().unwrap(),
            Pin::PublicKey(key)
        );
        // pinned_spki_sha256 wins over both.
        let other = crate::pin::spki_sha256(
            &provider_core::tls::parse_certificates(cert_pem().as_bytes()).unwrap()[0],
        )
        .unwrap();
        write(
            serde_json::json!({"endpoint":"https://x","ca_pem":ca,"pinned_cert_pem":leaf,
            "pinned_spki_sha256":crate::pin::spki_pin_text(&other),"machine_id":"m","token":"t"}),
        );
        assert_eq!(
            AgentConfig::load(&path).unwrap().pin().unwrap(),
            Pin::PublicKey(other)
        );
        write(
            serde_json::json!({"endpoint":"https://x","pinned_spki_sha256":"AAAA",
            "machine_id":"m","token":"t"}),
        );
        let e = AgentConfig::load(&path).unwrap_err();
        assert!(
            e.ends_with("pinned_spki_sha256: 3 bytes, where a SHA-256 has 32"),
            "{e}"
        );
        // Exactly one pinned certificate.
        write(
            serde_json::json!({"endpoint":"https://x","pinned_cert_pem":format!("{leaf}{ca}"),
            "machine_id":"m","token":"t"}),
        );
        let e = AgentConfig::load(&path).unwrap_err();
        assert!(e.ends_with("pinned_cert_pem: holds 2 certificates; it must hold exactly the channel's own certificate"), "{e}");
        // Neither field, or both empty: refused.
        write(serde_json::json!({"endpoint":"https://x","machine_id":"m","token":"t"}));
        let e = AgentConfig::load(&path).unwrap_err();
        assert!(
            e.ends_with(
                "none of pinned_spki_sha256, pinned_cert_pem and ca_pem is set, so the agent \
                 would trust no server"
            ),
            "{e}"
        );
        write(
            serde_json::json!({"endpoint":"https://x","ca_pem":"","pinned_cert_pem":" ",
            "machine_id":"m","token":"t"}),
        );
        assert!(
            AgentConfig::load(&path)
                .unwrap_err()
                .contains("none of pinned_spki_sha256, pinned_cert_pem and ca_pem")
        );
        write(
            serde_json::json!({"endpoint":"https://x","ca_pem":"p","machine_id":"m","token":"t"}),
        );
        assert!(
            AgentConfig::load(&path)
                .unwrap_err()
                .contains("ca_pem: no certificates found")
        );
    }
}

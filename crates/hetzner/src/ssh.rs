//! SSH delivery to a server: host-key-pinned connections, retried until the server accepts
//! one (sshd may not be up yet right after `running`), within the transition's deadline;
//! remote commands run over them with their exit status as the verdict; and the scripts of
//! the runs that must outlive a connection (the bootstrap hook, the drain).
//!
//! Guarantees:
//! - The host key is judged inside the handshake, before authentication and before any channel
//!   exists, so on a mismatch not one byte of a command or of the blob leaves this process. A
//!   mismatch is never retried.
//! - The bootstrap blob travels over the channel's stdin, never in the command line, so it is
//!   not visible in the remote process list and has no exec-request size limit. The remote
//!   script checks the byte count before it hands the blob on, so a connection that drops
//!   mid-transfer can never start the hook on a truncated blob.
//! - The hook and the drain run detached from the SSH session, one run per operation, under
//!   `<hook>.runs/<run name>/`: creating that directory is the lock, so however often a run is
//!   started (a retry, a resumed operation, two starts at once) its command runs once. The run
//!   records its exit status and the tail of its output in `record`, moved into place
//!   complete; a probe reads it over any later connection. `<hook>.blob` exists only while the
//!   hook runs.
//! - Remote scripts are POSIX `sh` (no bash needed); every interpolated value is single-quoted.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use russh::ChannelMsg;
use russh::client::{self, Handle};
use russh::keys::{PrivateKey, PrivateKeyWithHashAlg, PublicKeyOrCertificate};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::hostkey::{self, Verdict};

/// How the provider logs in over SSH. The key text is zeroed when the value is dropped.
#[derive(Clone)]
pub struct SshConfig {
    /// Login user (`--ssh-user`, default `root`).
    pub user: String,
    /// The private key text read from `--ssh-key`.
    pub key: String,
    /// Port (`--ssh-port`, default 22).
    pub port: u16,
}

impl std::fmt::Debug for SshConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SshConfig")
            .field("user", &self.user)
            .field("key", &"[redacted]")
            .field("port", &self.port)
            .finish()
    }
}

impl Drop for SshConfig {
    fn drop(&mut self) {
        zeroize::Zeroize::zeroize(&mut self.key);
    }
}

impl zeroize::ZeroizeOnDrop for SshConfig {}

/// A parsed login identity (the parsed private key zeroes itself on drop).
#[derive(Clone)]
pub struct SshIdentity {
    user: String,
    key: Arc<PrivateKey>,
    port: u16,
}

impl std::fmt::Debug for SshIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SshIdentity")
            .field("user", &self.user)
            .field("key", &self.key.algorithm().as_str())
            .field("port", &self.port)
            .finish()
    }
}

impl SshIdentity {
    /// Parses `--ssh-key` now, so a bad key fails the process at startup, not the first
    /// Configure.
    pub fn parse(config: &SshConfig) -> Result<SshIdentity, String> {
        if config.user.trim().is_empty() {
            return Err("--ssh-user must not be empty".into());
        }
        if config.port == 0 {
            return Err("--ssh-port must be between 1 and 65535".into());
        }
        let key = russh::keys::decode_secret_key(&config.key, None).map_err(|e| {
            format!(
                "parse --ssh-key: {e} (expected an unencrypted ed25519 or ECDSA private key in \
                 OpenSSH or PEM form)"
            )
        })?;
        if key.algorithm().is_rsa() {
            return Err("parse --ssh-key: RSA keys are not supported; use an ed25519 key".into());
        }
        Ok(SshIdentity {
            user: config.user.clone(),
            key: Arc::new(key),
            port: config.port,
        })
    }

    pub fn user(&self) -> &str {
        &self.user
    }

    pub fn port(&self) -> u16 {
        self.port
    }
}

/// Why an SSH operation failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SshError {
    /// The presented host key does not match the pin (never retried).
    #[error("{0}")]
    HostKeyMismatch(String),
    /// The server could not be reached or would not complete a handshake before the deadline.
    #[error("{0}")]
    Unreachable(String),
    /// The server refused our key.
    #[error("{0}")]
    Auth(String),
    /// Opening a channel or running a command failed.
    #[error("{0}")]
    Session(String),
}

/// Pacing of connection attempts.
#[derive(Clone, Copy, Debug)]
pub struct SshTiming {
    /// Bound of one TCP connect + SSH handshake.
    pub attempt_timeout: Duration,
    /// Pause between connection attempts.
    pub retry_interval: Duration,
    /// How many times a rejected login is retried (cloud-init may still be installing keys).
    pub auth_retries: u32,
}

impl Default for SshTiming {
    fn default() -> SshTiming {
        SshTiming {
            attempt_timeout: Duration::from_secs(15),
            retry_interval: Duration::from_secs(3),
            auth_retries: 3,
        }
    }
}

struct PinChecker {
    pin: Option<String>,
    verdict: Arc<Mutex<Option<Verdict>>>,
}

impl client::Handler for PinChecker {
    type Error = russh::Error;

    async fn check_server_key(
        &mut self,
        key: &PublicKeyOrCertificate,
    ) -> Result<bool, Self::Error> {
        let verdict = match key {
            PublicKeyOrCertificate::PublicKey { key, .. } => {
                hostkey::verify(self.pin.as_deref(), key)
            }
            // Host certificates are not part of the pinning model: refuse them like a mismatch.
            PublicKeyOrCertificate::Certificate(_) => Verdict::Mismatch {
                pinned: self.pin.clone().unwrap_or_default(),
                presented: "an SSH host certificate".into(),
            },
        };
        let accept = !matches!(verdict, Verdict::Mismatch { .. });
        *self.verdict.lock().unwrap_or_else(|e| e.into_inner()) = Some(verdict);
        Ok(accept)
    }
}

/// An authenticated connection whose host key passed the pin check.
pub struct PinnedSession {
    handle: Handle<PinChecker>,
    ip: String,
    /// The fingerprint of the key the server presented.
    pub observed: String,
    /// True when the server had no pin and this connection trusted it on first use.
    pub first_use: bool,
}

impl std::fmt::Debug for PinnedSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedSession")
            .field("ip", &self.ip)
            .field("observed", &self.observed)
            .field("first_use", &self.first_use)
            .finish()
    }
}

/// Why one attempt failed, and whether to try again.
enum Attempt {
    Retry(String),
    AuthRejected(String),
    Fatal(SshError),
}

/// Connects to `ip`, verifying the host key against `pin`, and retries until the server
/// accepts the connection, `deadline` passes, or `cancel` fires.
pub async fn connect(
    identity: &SshIdentity,
    ip: &str,
    pin: Option<&str>,
    timing: SshTiming,
    deadline: Instant,
    cancel: &CancellationToken,
) -> Result<PinnedSession, SshError> {
    let mut auth_rejections = 0;
    let mut last = String::from("deadline exceeded before the first attempt");
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || cancel.is_cancelled() {
            return Err(SshError::Unreachable(last));
        }
        let attempt = tokio::select! {
            r = tokio::time::timeout(timing.attempt_timeout.min(left), attempt(identity, ip, pin)) => r,
            _ = cancel.cancelled() => return Err(SshError::Unreachable(last)),
        };
        match attempt {
            Ok(Ok(session)) => return Ok(session),
            Ok(Err(Attempt::Fatal(e))) => return Err(e),
            Ok(Err(Attempt::Retry(e))) => last = e,
            Ok(Err(Attempt::AuthRejected(e))) => {
                auth_rejections += 1;
                if auth_rejections > timing.auth_retries {
                    return Err(SshError::Auth(e));
                }
                last = e;
            }
            Err(_) => last = format!("ssh dial {ip}: connection attempt timed out"),
        }
        tracing::debug!(ip, err = %last, "SSH not reachable yet; retrying");
        let pause = timing
            .retry_interval
            .min(deadline.saturating_duration_since(Instant::now()));
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = cancel.cancelled() => return Err(SshError::Unreachable(last)),
        }
    }
}

async fn attempt(
    identity: &SshIdentity,
    ip: &str,
    pin: Option<&str>,
) -> Result<PinnedSession, Attempt> {
    let tcp = TcpStream::connect((ip, identity.port))
        .await
        .map_err(|e| Attempt::Retry(format!("ssh dial {ip}: {e}")))?;
    let _ = tcp.set_nodelay(true);
    let verdict = Arc::new(Mutex::new(None));
    let checker = PinChecker {
        pin: pin.map(str::to_owned),
        verdict: verdict.clone(),
    };
    let config = Arc::new(client::Config {
        inactivity_timeout: Some(Duration::from_secs(120)),
        keepalive_interval: Some(Duration::from_secs(15)),
        ..Default::default()
    });
    let handshake = client::connect_stream(config, tcp, checker).await;
    let seen = verdict.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut handle = match (handshake, &seen) {
        (_, Some(Verdict::Mismatch { pinned, presented })) => {
            return Err(Attempt::Fatal(SshError::HostKeyMismatch(format!(
                "ssh handshake {ip}: {}",
                hostkey::mismatch_message(pinned, presented)
            ))));
        }
        (Ok(handle), _) => handle,
        (Err(e), _) => return Err(Attempt::Retry(format!("ssh handshake {ip}: {e}"))),
    };
    let (observed, first_use) = match seen {
        Some(Verdict::Pinned) => (pin.unwrap_or_default().to_owned(), false),
        Some(Verdict::FirstUse { observed }) => (observed, true),
        // The handler runs before the handshake completes; no verdict means no key was checked.
        _ => {
            return Err(Attempt::Fatal(SshError::Session(format!(
                "ssh handshake {ip}: the server's host key was never checked"
            ))));
        }
    };
    let key = PrivateKeyWithHashAlg::new(identity.key.clone(), None);
    let auth = handle
        .authenticate_publickey(identity.user.clone(), key)
        .await
        .map_err(|e| Attempt::Retry(format!("ssh handshake {ip}: {e}")))?;
    if !auth.success() {
        return Err(Attempt::AuthRejected(format!(
            "ssh handshake {ip}: the server rejected public-key authentication as {:?} (is the \
             --ssh-key public key authorised for --ssh-user on the image?)",
            identity.user
        )));
    }
    Ok(PinnedSession {
        handle,
        ip: ip.to_owned(),
        observed,
        first_use,
    })
}

/// How a remote command ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exit {
    pub status: u32,
    /// What it wrote to standard output (the first [`MAX_OUTPUT`] bytes).
    pub output: Vec<u8>,
}

impl PinnedSession {
    pub fn ip(&self) -> &str {
        &self.ip
    }

    /// Runs `command`, feeding `stdin` (then end-of-file), and returns its exit status and
    /// standard output. When the deadline passes or `cancel` fires first, the remote command is
    /// sent SIGKILL.
    pub async fn run(
        &self,
        command: &str,
        stdin: &[u8],
        deadline: Instant,
        cancel: &CancellationToken,
    ) -> Result<Exit, SshError> {
        let ip = &self.ip;
        let mut channel = self
            .handle
            .channel_open_session()
            .await
            .map_err(|e| SshError::Session(format!("ssh session {ip}: {e}")))?;
        let work = async {
            channel
                .exec(true, command)
                .await
                .map_err(|e| SshError::Session(format!("ssh session {ip}: {e}")))?;
            if !stdin.is_empty() {
                channel.data(stdin).await.map_err(|e| {
                    SshError::Session(format!("ssh command on {ip} did not complete: {e}"))
                })?;
            }
            channel.eof().await.map_err(|e| {
                SshError::Session(format!("ssh command on {ip} did not complete: {e}"))
            })?;
            let mut status = None;
            let mut output = Vec::new();
            while let Some(message) = channel.wait().await {
                match message {
                    ChannelMsg::Data { data } => {
                        let room = MAX_OUTPUT.saturating_sub(output.len());
                        output.extend_from_slice(&data[..data.len().min(room)]);
                    }
                    ChannelMsg::ExitStatus { exit_status } => status = Some(exit_status),
                    ChannelMsg::ExitSignal { signal_name, .. } => {
                        return Err(SshError::Session(format!(
                            "ssh command on {ip} failed: Process killed by signal {signal_name:?}"
                        )));
                    }
                    ChannelMsg::Failure => {
                        return Err(SshError::Session(format!(
                            "ssh session {ip}: the server refused to run the command"
                        )));
                    }
                    ChannelMsg::Close => break,
                    _ => {}
                }
            }
            status
                .map(|status| Exit { status, output })
                .ok_or_else(|| {
                SshError::Session(format!(
                    "ssh command on {ip} did not complete: the channel closed without an exit status"
                ))
            })
        };
        let left = deadline.saturating_duration_since(Instant::now());
        let outcome = tokio::select! {
            r = tokio::time::timeout(left, work) => r.ok(),
            _ = cancel.cancelled() => None,
        };
        match outcome {
            Some(result) => result,
            None => {
                // Best effort: the connection may already be gone.
                let _ = channel.signal(russh::Sig::KILL).await;
                let _ = channel.close().await;
                Err(SshError::Session(format!(
                    "ssh command on {ip} did not complete: deadline exceeded"
                )))
            }
        }
    }

    /// Closes the connection politely.
    pub async fn close(self) {
        let _ = self
            .handle
            .disconnect(russh::Disconnect::ByApplication, "", "en")
            .await;
    }
}

/// Single-quotes `value` for a POSIX shell: `'` becomes `'\''`.
pub fn quote(value: &str) -> String {
    format!("'{}'", value.replace('\'', r"'\''"))
}

/// The most of a command's standard output kept by [`PinnedSession::run`].
const MAX_OUTPUT: usize = 64 * 1024;

/// How many bytes at the end of a detached run's output its record keeps.
pub(crate) const RECORD_TAIL: usize = 2048;

/// The name of the detached run of one operation, usable as a file name: `<kind>-<id>` when
/// the operation id is plain (ASCII letters, digits, `-`, `_`, `.`, at most 64 bytes), else its
/// plain characters followed by a hash of the whole id, so two ids never share a run.
pub(crate) fn run_name(kind: &str, operation_id: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if !operation_id.is_empty() && operation_id.len() <= 64 && operation_id.chars().all(plain) {
        return format!("{kind}-{operation_id}");
    }
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(operation_id.as_bytes());
    let hash: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    let kept: String = operation_id
        .chars()
        .filter(|c| plain(*c))
        .take(32)
        .collect();
    format!("{kind}-{kept}-{hash}")
}

/// The name of a Configure's detached run: [`run_name`] of its operation id, followed by its
/// nonce (`TransitionContext::configure_nonce`) where it has one. The operation id alone is not
/// enough: ids start again at `op-1` after a state was lost, and a server adopted again may
/// still hold the run of an earlier `configure-op-N`, whose record would answer for a
/// Configure it never ran. The nonce is the same for every process that resumes the Configure
/// and differs for every other one, so a resumed Configure finds its run and no other does.
pub(crate) fn configure_run_name(operation_id: &str, nonce: Option<&str>) -> String {
    let run = run_name("configure", operation_id);
    match nonce {
        Some(nonce) => {
            let nonce: String = nonce
                .chars()
                .filter(|c| c.is_ascii_alphanumeric())
                .take(32)
                .collect();
            format!("{run}-n{nonce}")
        }
        None => run,
    }
}

/// Where detached runs live on a host: `<hook>.runs/<run>/`, next to `<hook>.blob`.
fn runs_dir(hook: &str) -> String {
    format!("{hook}.runs")
}

fn run_dir(hook: &str, run: &str) -> String {
    format!("{}/{run}", runs_dir(hook))
}

/// Starts `runner` detached from the SSH session: in a session of its own (`setsid`) where
/// the host has it, else immune to hangups (`nohup`), with no descriptor of the channel, so
/// the connection can close (or drop) while the run goes on.
fn detach(runner: &str, argument: &str) -> String {
    let runner = quote(runner);
    format!(
        "if command -v setsid >/dev/null 2>&1; then \
         setsid sh -c {runner} sh {argument} </dev/null >/dev/null 2>&1 & \
         else nohup sh -c {runner} sh {argument} </dev/null >/dev/null 2>&1 & fi"
    )
}

/// The detached part of a run: takes the run directory as the lock (only its creator goes
/// on; a second start of the same run does nothing), records its pid, runs `command` with its
/// output to a file, and records `exit <status>` and the output's tail in `record`, written to
/// a temporary name and moved into place. `before` and `after` run around the command. Where
/// the host has `timeout`, the command is killed once `limit` (the time left before the
/// transition's deadline) has passed, as nothing would take its outcome any more.
fn runner(
    dir: &str,
    loser: &str,
    before: &str,
    command: &str,
    after: &str,
    limit: Duration,
) -> String {
    // Rounded up: the run is never killed before the deadline.
    let seconds = (limit.as_secs() + u64::from(limit.subsec_nanos() > 0)).max(1);
    format!(
        "umask 077; st=; d={dir}; if ! mkdir \"$d\" 2>/dev/null; then {loser} exit 0; fi; \
         echo $$ > \"$d/pid.tmp\"; mv -f \"$d/pid.tmp\" \"$d/pid\"; \
         if command -v timeout >/dev/null 2>&1; then limit='timeout -s KILL {seconds}'; \
         else limit=; fi; \
         {before} \
         if [ -z \"$st\" ]; then $limit {command} > \"$d/output\" 2>&1 < /dev/null; st=$?; fi; \
         {after} \
         {{ echo \"exit $st\"; tail -c {RECORD_TAIL} \"$d/output\" 2>/dev/null; }} > \"$d/record.tmp\"; \
         mv -f \"$d/record.tmp\" \"$d/record\"; rm -f \"$d/output\"",
        dir = quote(dir),
    )
}

/// Waits (a few seconds at most) for `condition` to hold, so that once the start script
/// returns, a probe finds the run started (or its blob copy discarded).
fn wait_until(condition: &str) -> String {
    format!(
        "i=0; while ! {condition} && [ \"$i\" -lt 100 ]; do i=$((i+1)); \
         sleep 0.1 2>/dev/null || sleep 1; done"
    )
}

/// The Configure start script, one idempotent step per run name: unless the run exists, read
/// exactly `blob_len` bytes from stdin into a copy of this delivery's own (mode 0600 via
/// `umask 077`; removed if the script ends before handing it over), check the length, and
/// start the detached runner. The runner that creates the run directory moves its copy to
/// `<hook>.blob`, runs `<hook> <cluster_id>`, removes `<hook>.blob` when the hook exits, and
/// records the outcome; any other start's runner discards its copy, and a start that finds the
/// run begun once it has read its stdin discards its copy and answers `started`. A truncated
/// blob exits 97 before any runner starts.
pub(crate) fn configure_start_script(
    hook: &str,
    run: &str,
    cluster_id: &str,
    blob_len: usize,
    limit: Duration,
) -> String {
    let runs = runs_dir(hook);
    let dir = run_dir(hook, run);
    let blob = quote(&format!("{hook}.blob"));
    // `run` is a plain file name (`run_name`), so it needs no quoting and the glob works.
    let copies = format!("{}/.{run}.blob.", quote(&runs));
    // The winner leaves other deliveries' copies alone: one may still be reading its stdin, and
    // its own runner (a loser) removes it. Copies of deliveries killed half way go at the probe
    // of the finished run.
    let before = format!(
        "if ! mv -f \"$1\" {blob}; then st=98; \
         echo 'the bootstrap blob was gone before the hook could start' > \"$d/output\"; fi;"
    );
    let command = format!("{} {}", quote(hook), quote(cluster_id));
    let after = format!("rm -f {blob};");
    let runner = runner(&dir, "rm -f \"$1\";", &before, &command, &after, limit);
    format!(
        "set -eu; umask 077; mkdir -p {runs}; \
         if [ -e {dir} ]; then cat > /dev/null; echo started; exit 0; fi; \
         tmp={copies}$$; trap 'rm -f \"$tmp\"' EXIT; trap 'exit 129' HUP; trap 'exit 143' TERM; \
         cat > \"$tmp\"; n=$(wc -c 2>/dev/null < \"$tmp\" | tr -d ' '); \
         if [ -e {dir} ]; then echo started; exit 0; fi; \
         if [ \"$n\" != {blob_len} ]; then \
         echo \"bootstrap blob truncated: got $n of {blob_len} bytes\" >&2; exit 97; fi; \
         {detach}; {wait}; echo started",
        runs = quote(&runs),
        dir = quote(&dir),
        detach = detach(&runner, "\"$tmp\""),
        wait = wait_until("[ ! -e \"$tmp\" ]"),
    )
}

/// The Drain start script: unless the run exists, start [`drain_script`] as a detached run.
pub(crate) fn drain_start_script(hook: &str, run: &str, grace: i64, limit: Duration) -> String {
    let runs = runs_dir(hook);
    let dir = run_dir(hook, run);
    let command = format!("sh -c {}", quote(&drain_script(grace)));
    let runner = runner(&dir, "", "", &command, "", limit);
    format!(
        "set -eu; umask 077; mkdir -p {runs}; \
         if [ -e {dir} ]; then echo started; exit 0; fi; {detach}; {wait}; echo started",
        runs = quote(&runs),
        dir = quote(&dir),
        detach = detach(&runner, "''"),
        wait = wait_until(&format!("[ -e {} ]", quote(&dir))),
    )
}

/// Reports a run's state: `absent`, `running`, `lost` (its runner is gone and left no
/// record), or `finished` followed by the record. A finished run's probe also removes any blob
/// copy a delivery cut short (killed before it could start its runner) left behind.
pub(crate) fn probe_script(hook: &str, run: &str) -> String {
    format!(
        "d={dir}; if [ -f \"$d/record\" ]; then echo finished; cat \"$d/record\"; \
         rm -f {runs}/.{run}.blob.* 2>/dev/null || true; \
         elif [ -d \"$d\" ]; then p=$(cat \"$d/pid\" 2>/dev/null || true); \
         if [ -n \"$p\" ] && ! kill -0 \"$p\" 2>/dev/null && [ ! -f \"$d/record\" ]; \
         then echo lost; else echo running; fi; \
         else echo absent; fi",
        dir = quote(&run_dir(hook, run)),
        runs = quote(&runs_dir(hook)),
    )
}

/// What a detached run recorded when it finished.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RunRecord {
    pub status: u32,
    /// The end of the run's output (at most [`RECORD_TAIL`] bytes).
    pub tail: Vec<u8>,
}

/// A run's state on the host, as [`probe_script`] reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum RunState {
    /// Never started: deliver and start it.
    Absent,
    /// Started and not finished.
    Running,
    /// Started, but its runner is gone without a record (the host restarted, or it was
    /// killed); it is never started again.
    Lost,
    Finished(RunRecord),
}

/// Reads what [`probe_script`] printed.
pub(crate) fn parse_probe(output: &[u8]) -> Option<RunState> {
    let (first, rest) = split_line(output);
    match first {
        b"absent" => Some(RunState::Absent),
        b"running" => Some(RunState::Running),
        b"lost" => Some(RunState::Lost),
        b"finished" => {
            let (line, tail) = split_line(rest);
            let status = std::str::from_utf8(line.strip_prefix(b"exit ")?)
                .ok()?
                .parse()
                .ok()?;
            Some(RunState::Finished(RunRecord {
                status,
                tail: tail.to_vec(),
            }))
        }
        _ => None,
    }
}

fn split_line(bytes: &[u8]) -> (&[u8], &[u8]) {
    match bytes.iter().position(|b| *b == b'\n') {
        Some(at) => (&bytes[..at], &bytes[at + 1..]),
        None => (bytes, &[]),
    }
}

/// The last few lines of a run's output, printable, for an error message; withheld when they
/// contain any 16-byte stretch of `secret` (a hook that echoes part of the blob).
pub(crate) fn output_tail(tail: &[u8], secret: &[u8]) -> Option<String> {
    const WINDOW: usize = 16;
    const SHOWN: usize = 400;
    if !secret.is_empty() {
        let leaks = if secret.len() <= WINDOW {
            tail.windows(secret.len()).any(|w| w == secret)
        } else {
            let seen: std::collections::HashSet<&[u8]> = tail.windows(WINDOW).collect();
            !seen.is_empty() && secret.windows(WINDOW).any(|w| seen.contains(w))
        };
        if leaks {
            return Some("[withheld: it contains part of the bootstrap blob]".into());
        }
    }
    let text = String::from_utf8_lossy(tail);
    let text: String = text
        .trim()
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if text.is_empty() {
        return None;
    }
    let skip = text.chars().count().saturating_sub(SHOWN);
    Some(text.chars().skip(skip).collect())
}

/// The Drain script: cordon (failures tolerated) then drain with `grace` seconds as both the
/// pod grace period and the drain timeout, as the reference does.
pub fn drain_script(grace: i64) -> String {
    let grace = grace.max(1);
    format!(
        "set -eu; node=$(hostname -f 2>/dev/null || hostname); kubectl cordon \"$node\" || true; \
         kubectl drain \"$node\" --ignore-daemonsets --delete-emptydir-data \
         --grace-period={grace} --timeout={grace}s"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn sh(script: &str, stdin: &[u8], dir: &std::path::Path) -> (i32, String) {
        use tokio::io::AsyncWriteExt;
        let mut child = tokio::process::Command::new("sh")
            .arg("-c")
            .arg(script)
            .current_dir(dir)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut input = child.stdin.take().unwrap();
        input.write_all(stdin).await.unwrap();
        drop(input);
        let out = child.wait_with_output().await.unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    }

    #[test]
    fn quoting() {
        assert_eq!(quote("plain"), "'plain'");
        assert_eq!(quote("it's"), r"'it'\''s'");
        assert_eq!(quote(""), "''");
        assert_eq!(quote("$(rm -rf /)"), "'$(rm -rf /)'");
    }

    #[tokio::test]
    async fn quoting_survives_a_real_shell() {
        let dir = tempfile::tempdir().unwrap();
        for value in [
            "it's",
            "a b",
            "$(id)",
            "`id`",
            "\"q\"",
            "back\\slash",
            "new\nline",
            "*",
        ] {
            let (code, out) = sh(&format!("printf %s {}", quote(value)), b"", dir.path()).await;
            assert_eq!((code, out.as_str()), (0, value));
        }
    }

    const MINUTE: Duration = Duration::from_secs(60);

    fn executable(path: &std::path::Path, body: &str) {
        use std::os::unix::fs::PermissionsExt;
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, body).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    fn q(path: &std::path::Path) -> String {
        quote(path.to_str().unwrap())
    }

    /// Probes `run` until it has finished (10 s at most).
    async fn finished(hook: &str, run: &str, dir: &std::path::Path) -> RunRecord {
        for _ in 0..500 {
            let (code, out) = sh(&probe_script(hook, run), b"", dir).await;
            assert_eq!(code, 0, "{out}");
            match parse_probe(out.as_bytes()) {
                Some(RunState::Finished(record)) => return record,
                Some(RunState::Running | RunState::Absent) => {}
                other => panic!("unexpected probe answer {other:?} ({out})"),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("run {run} did not finish");
    }

    fn lines(path: &std::path::Path) -> usize {
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .count()
    }

    #[tokio::test]
    async fn configure_start_delivers_the_blob_and_runs_the_hook_detached() {
        let dir = tempfile::tempdir().unwrap();
        let hook = dir.path().join("opt dir/it's hook");
        let args = dir.path().join("args");
        let copy = dir.path().join("copy");
        let mode = dir.path().join("mode");
        executable(
            &hook,
            &format!(
                "#!/bin/sh\nprintf '%s|' \"$@\" > {}\ncp \"$0.blob\" {}\nstat -c %a \"$0.blob\" > {}\n",
                q(&args),
                q(&copy),
                q(&mode),
            ),
        );
        let blob = b"\x00binary\xffblob'with quotes\n".to_vec();
        let hook_path = hook.to_str().unwrap();
        let run = run_name("configure", "op-1");
        let script = configure_start_script(hook_path, &run, "cluster 'one'", blob.len(), MINUTE);
        assert!(
            !script.contains("binary"),
            "the blob never enters the command line"
        );
        let (code, out) = sh(&script, &blob, dir.path()).await;
        assert_eq!((code, out.as_str()), (0, "started\n"));
        let record = finished(hook_path, &run, dir.path()).await;
        assert_eq!(
            record,
            RunRecord {
                status: 0,
                tail: Vec::new()
            }
        );
        assert_eq!(std::fs::read_to_string(&args).unwrap(), "cluster 'one'|");
        assert_eq!(
            std::fs::read(&copy).unwrap(),
            blob,
            "the hook read the blob"
        );
        assert_eq!(std::fs::read_to_string(&mode).unwrap(), "600\n");
        assert!(
            !std::path::Path::new(&format!("{hook_path}.blob")).exists(),
            "the blob is removed once the hook has exited"
        );
        let runs = std::path::PathBuf::from(format!("{hook_path}.runs"));
        let left: Vec<_> = std::fs::read_dir(&runs)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            left,
            vec![std::ffi::OsString::from(&run)],
            "no blob copy is left"
        );
        let mut kept: Vec<_> = std::fs::read_dir(runs.join(&run))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        kept.sort();
        assert_eq!(kept, ["pid", "record"]);
    }

    #[tokio::test]
    async fn starting_a_run_twice_runs_the_hook_once() {
        let dir = tempfile::tempdir().unwrap();
        let hook = dir.path().join("hook");
        let count = dir.path().join("count");
        executable(
            &hook,
            &format!("#!/bin/sh\necho ran >> {}\nsleep 0.3\n", q(&count)),
        );
        let hook = hook.to_str().unwrap();
        let run = run_name("configure", "op-7");
        let script = configure_start_script(hook, &run, "c", 4, MINUTE);
        // Two deliveries at once, one while the hook runs, and one after it finished.
        let (first, second) = tokio::join!(
            sh(&script, b"blob", dir.path()),
            sh(&script, b"blob", dir.path())
        );
        assert_eq!((first.0, second.0), (0, 0), "{first:?} {second:?}");
        assert_eq!(sh(&script, b"blob", dir.path()).await.0, 0);
        assert_eq!(finished(hook, &run, dir.path()).await.status, 0);
        assert_eq!(sh(&script, b"blob", dir.path()).await.0, 0);
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(lines(&count), 1, "the hook ran once");
        // A copy left by a delivery killed before it started its runner goes at the next probe.
        let stale = dir.path().join(format!("hook.runs/.{run}.blob.12345"));
        std::fs::write(&stale, b"blob").unwrap();
        finished(hook, &run, dir.path()).await;
        assert!(!stale.exists());
        assert!(!dir.path().join("hook.blob").exists());
        let copies = std::fs::read_dir(dir.path().join("hook.runs"))
            .unwrap()
            .filter(|e| e.as_ref().unwrap().file_name() != run.as_str())
            .count();
        assert_eq!(copies, 0, "every delivery's blob copy is gone");

        // Another operation is another run.
        let other = run_name("configure", "op-8");
        let script = configure_start_script(hook, &other, "c", 4, MINUTE);
        assert_eq!(sh(&script, b"blob", dir.path()).await.0, 0);
        assert_eq!(finished(hook, &other, dir.path()).await.status, 0);
        assert_eq!(lines(&count), 2);
    }

    #[tokio::test]
    async fn the_start_returns_while_the_detached_hook_runs_on() {
        let dir = tempfile::tempdir().unwrap();
        let hook = dir.path().join("hook");
        let done = dir.path().join("done");
        executable(&hook, &format!("#!/bin/sh\nsleep 1\ntouch {}\n", q(&done)));
        let hook = hook.to_str().unwrap();
        let run = run_name("configure", "op-2");
        let started = std::time::Instant::now();
        // `sh` returns once the script has exited and its output pipes are closed: the run
        // holds no descriptor of the session.
        let (code, out) = sh(
            &configure_start_script(hook, &run, "c", 1, MINUTE),
            b"b",
            dir.path(),
        )
        .await;
        assert_eq!((code, out.as_str()), (0, "started\n"));
        assert!(started.elapsed() < Duration::from_millis(900));
        assert!(!done.exists());
        let (_, out) = sh(&probe_script(hook, &run), b"", dir.path()).await;
        assert_eq!(parse_probe(out.as_bytes()), Some(RunState::Running));
        assert_eq!(finished(hook, &run, dir.path()).await.status, 0);
        assert!(done.exists());
    }

    #[tokio::test]
    async fn a_hook_still_running_at_the_deadline_is_killed() {
        let dir = tempfile::tempdir().unwrap();
        let hook = dir.path().join("hook");
        let done = dir.path().join("done");
        executable(&hook, &format!("#!/bin/sh\nsleep 5\ntouch {}\n", q(&done)));
        let hook = hook.to_str().unwrap();
        let run = run_name("configure", "op-10");
        let script = configure_start_script(hook, &run, "c", 1, Duration::from_secs(1));
        let started = std::time::Instant::now();
        assert_eq!(sh(&script, b"b", dir.path()).await.0, 0);
        let record = finished(hook, &run, dir.path()).await;
        assert_eq!(record.status, 137, "killed");
        assert!(started.elapsed() < Duration::from_secs(4));
        assert!(!done.exists());
        assert!(!dir.path().join("hook.blob").exists());
    }

    #[tokio::test]
    async fn a_failing_hooks_status_and_output_tail_are_recorded() {
        let dir = tempfile::tempdir().unwrap();
        let hook = dir.path().join("hook");
        executable(
            &hook,
            "#!/bin/sh\nhead -c 3000 /dev/zero | tr '\\0' x\necho\necho 'join failed: boom' >&2\nexit 3\n",
        );
        let hook = hook.to_str().unwrap();
        let run = run_name("configure", "op-3");
        let (code, _) = sh(
            &configure_start_script(hook, &run, "c", 1, MINUTE),
            b"b",
            dir.path(),
        )
        .await;
        assert_eq!(code, 0);
        let record = finished(hook, &run, dir.path()).await;
        assert_eq!(record.status, 3);
        assert_eq!(record.tail.len(), RECORD_TAIL);
        assert!(record.tail.ends_with(b"xx\njoin failed: boom\n"));
        let shown = output_tail(&record.tail, b"the-join-blob").unwrap();
        assert!(shown.ends_with("xxx join failed: boom"), "{shown}");
        assert!(shown.len() <= 400);
        assert!(
            !dir.path().join("hook.blob").exists(),
            "removed after a failure too"
        );
    }

    #[tokio::test]
    async fn the_record_appears_only_when_complete() {
        let dir = tempfile::tempdir().unwrap();
        let hook = dir.path().join("hook");
        executable(&hook, "#!/bin/sh\necho out\n");
        // A `tail` that writes the record's tail in two halves, 300 ms apart.
        let bin = dir.path().join("bin");
        executable(
            &bin.join("tail"),
            "#!/bin/sh\nprintf part1\nsleep 0.3\nprintf part2\n",
        );
        let hook = hook.to_str().unwrap();
        let run = run_name("configure", "op-4");
        let script = format!(
            "PATH={}:$PATH; export PATH; {}",
            q(&bin),
            configure_start_script(hook, &run, "c", 1, MINUTE)
        );
        assert_eq!(sh(&script, b"b", dir.path()).await.0, 0);
        let record = dir.path().join("hook.runs").join(&run).join("record");
        let mut seen = 0;
        for _ in 0..300 {
            if let Ok(text) = std::fs::read_to_string(&record) {
                assert_eq!(text, "exit 0\npart1part2", "never a partial record");
                let (_, out) = sh(&probe_script(hook, &run), b"", dir.path()).await;
                assert_eq!(out, "finished\nexit 0\npart1part2");
                seen += 1;
                if seen > 3 {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("the record never appeared");
    }

    #[tokio::test]
    async fn a_truncated_blob_never_reaches_the_hook() {
        let dir = tempfile::tempdir().unwrap();
        let hook = dir.path().join("hook");
        let ran = dir.path().join("ran");
        executable(&hook, &format!("#!/bin/sh\ntouch {}\n", q(&ran)));
        let hook = hook.to_str().unwrap();
        let run = run_name("configure", "op-5");
        let script = configure_start_script(hook, &run, "c", 100, MINUTE);
        let (code, out) = sh(&script, b"only ten b", dir.path()).await;
        assert_eq!(code, 97);
        assert!(out.contains("got 10 of 100 bytes"), "{out}");
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!ran.exists());
        assert!(!dir.path().join("hook.blob").exists());
        let left = std::fs::read_dir(dir.path().join("hook.runs"))
            .unwrap()
            .count();
        assert_eq!(left, 0, "neither a run nor a blob copy is left");
        let (_, out) = sh(&probe_script(hook, &run), b"", dir.path()).await;
        assert_eq!(parse_probe(out.as_bytes()), Some(RunState::Absent));
        // The full blob then starts the run.
        let (code, _) = sh(
            &configure_start_script(hook, &run, "c", 4, MINUTE),
            b"full",
            dir.path(),
        )
        .await;
        assert_eq!(code, 0);
        assert_eq!(finished(hook, &run, dir.path()).await.status, 0);
        assert!(ran.exists());
    }

    #[tokio::test]
    async fn a_run_whose_runner_vanished_is_lost_not_restarted() {
        let dir = tempfile::tempdir().unwrap();
        let hook = dir.path().join("hook");
        let count = dir.path().join("count");
        executable(&hook, &format!("#!/bin/sh\necho ran >> {}\n", q(&count)));
        let hook = hook.to_str().unwrap();
        let run = run_name("configure", "op-6");
        // A run directory whose recorded runner has exited without a record.
        let gone = std::process::Command::new("true").spawn().unwrap();
        let pid = gone.id();
        let mut gone = gone;
        gone.wait().unwrap();
        let run_dir = dir.path().join("hook.runs").join(&run);
        std::fs::create_dir_all(&run_dir).unwrap();
        std::fs::write(run_dir.join("pid"), format!("{pid}\n")).unwrap();
        let (_, out) = sh(&probe_script(hook, &run), b"", dir.path()).await;
        assert_eq!(parse_probe(out.as_bytes()), Some(RunState::Lost));
        // Without a pid yet it is starting, which counts as running.
        std::fs::remove_file(run_dir.join("pid")).unwrap();
        let (_, out) = sh(&probe_script(hook, &run), b"", dir.path()).await;
        assert_eq!(parse_probe(out.as_bytes()), Some(RunState::Running));
        let (code, _) = sh(
            &configure_start_script(hook, &run, "c", 1, MINUTE),
            b"b",
            dir.path(),
        )
        .await;
        assert_eq!(code, 0);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(lines(&count), 0, "an existing run is never started again");
    }

    #[tokio::test]
    async fn a_drain_run_is_started_once() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("bin");
        let calls = dir.path().join("calls");
        executable(
            &bin.join("kubectl"),
            &format!("#!/bin/sh\necho \"$@\" >> {}\nsleep 0.1\n", q(&calls)),
        );
        let hook = dir.path().join("hook");
        let hook = hook.to_str().unwrap();
        let run = run_name("drain", "op-9");
        let script = format!(
            "PATH={}:$PATH; export PATH; {}",
            q(&bin),
            drain_start_script(hook, &run, 5, MINUTE)
        );
        assert_eq!(sh(&script, b"", dir.path()).await, (0, "started\n".into()));
        assert_eq!(sh(&script, b"", dir.path()).await, (0, "started\n".into()));
        assert_eq!(finished(hook, &run, dir.path()).await.status, 0);
        assert_eq!(sh(&script, b"", dir.path()).await.0, 0);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let text = std::fs::read_to_string(&calls).unwrap();
        assert_eq!(text.lines().count(), 2, "one cordon and one drain: {text}");
        assert!(text.lines().nth(1).unwrap().starts_with("drain "), "{text}");
    }

    #[test]
    fn run_names_are_plain_file_names_and_never_shared() {
        assert_eq!(run_name("configure", "op-123"), "configure-op-123");
        assert_eq!(run_name("drain", "op_1.2"), "drain-op_1.2");
        let odd = run_name("configure", "op/../x y");
        assert!(odd.starts_with("configure-op..xy-"), "{odd}");
        assert_ne!(odd, run_name("configure", "op/../xy "));
        assert!(!odd.contains('/'));
        let long = run_name("configure", &"a".repeat(500));
        assert!(long.len() < 80, "{long}");
        assert_ne!(long, run_name("configure", &"a".repeat(501)));
        assert!(run_name("configure", "").starts_with("configure--"));
        for name in [odd, long, run_name("configure", "\u{e9}\n'$(x)")] {
            assert!(
                name.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')),
                "{name}"
            );
        }
    }

    #[test]
    fn configure_run_names_carry_the_nonce() {
        assert_eq!(configure_run_name("op-3", None), "configure-op-3");
        let run = configure_run_name("op-3", Some("0123456789abcdef"));
        assert_eq!(run, "configure-op-3-n0123456789abcdef");
        assert_ne!(run, configure_run_name("op-3", Some("fedcba9876543210")));
        assert_ne!(run, configure_run_name("op-4", Some("0123456789abcdef")));
        let odd = configure_run_name("op/3", Some("ab/../cd"));
        assert!(
            odd.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')),
            "{odd}"
        );
        assert!(odd.ends_with("-nabcd"), "{odd}");
    }

    #[test]
    fn probe_answers_parse() {
        assert_eq!(parse_probe(b"absent\n"), Some(RunState::Absent));
        assert_eq!(parse_probe(b"running\n"), Some(RunState::Running));
        assert_eq!(parse_probe(b"lost\n"), Some(RunState::Lost));
        assert_eq!(
            parse_probe(b"finished\nexit 7\nsome\noutput"),
            Some(RunState::Finished(RunRecord {
                status: 7,
                tail: b"some\noutput".to_vec()
            }))
        );
        assert_eq!(parse_probe(b"finished\nexit x\n"), None);
        assert_eq!(parse_probe(b""), None);
    }

    #[test]
    fn an_output_tail_with_part_of_the_blob_is_withheld() {
        let blob = b"0123456789abcdefghij-the-join-token";
        let withheld = Some("[withheld: it contains part of the bootstrap blob]".to_owned());
        assert_eq!(
            output_tail(b"error: token ghij-the-join-tok rejected", blob),
            withheld
        );
        assert_eq!(output_tail(b"ab", b"ab"), withheld);
        assert_eq!(
            output_tail(b"line one\n\x1b[31mline two\n", blob).as_deref(),
            Some("line one [31mline two")
        );
        assert_eq!(output_tail(b"\n\n", blob), None);
    }

    proptest::proptest! {
        #[test]
        fn a_probe_answer_never_panics_and_a_record_reads_back(
            status in proptest::prelude::any::<u32>(),
            tail in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..3000),
            junk in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200),
        ) {
            let _ = parse_probe(&junk);
            let mut answer = format!("finished\nexit {status}\n").into_bytes();
            answer.extend_from_slice(&tail);
            proptest::prop_assert_eq!(
                parse_probe(&answer),
                Some(RunState::Finished(RunRecord { status, tail: tail.clone() }))
            );
        }

        #[test]
        fn an_output_tail_never_shows_a_stretch_of_the_blob(
            blob in proptest::collection::vec(proptest::prelude::any::<u8>(), 16..400),
            at in 0usize..400,
            before in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
            after in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
        ) {
            let at = at % (blob.len() - 15);
            let mut tail = before;
            tail.extend_from_slice(&blob[at..at + 16]);
            tail.extend_from_slice(&after);
            let shown = output_tail(&tail, &blob).unwrap();
            proptest::prop_assert_eq!(shown, "[withheld: it contains part of the bootstrap blob]");
            let shown = output_tail(&after, b"").unwrap_or_default();
            proptest::prop_assert!(shown.chars().count() <= 400);
        }
    }

    #[test]
    fn drain_script_clamps_grace() {
        assert!(drain_script(0).ends_with("--grace-period=1 --timeout=1s"));
        assert!(drain_script(-5).ends_with("--grace-period=1 --timeout=1s"));
        assert!(drain_script(90).ends_with("--grace-period=90 --timeout=90s"));
        assert!(drain_script(1).contains("kubectl cordon \"$node\" || true;"));
    }

    #[test]
    fn the_key_text_is_zeroed_on_drop() {
        fn zeroed_on_drop<T: zeroize::ZeroizeOnDrop>() {}
        zeroed_on_drop::<SshConfig>();
    }

    #[test]
    fn key_parsing_errors_name_the_flag() {
        let config = SshConfig {
            user: "root".into(),
            key: "garbage".into(),
            port: 22,
        };
        let err = SshIdentity::parse(&config).unwrap_err();
        assert!(err.starts_with("parse --ssh-key: "), "{err}");
        let key = PrivateKey::random(&mut rand::rng(), russh::keys::Algorithm::Ed25519).unwrap();
        let pem = key
            .to_openssh(russh::keys::ssh_key::LineEnding::LF)
            .unwrap()
            .to_string();
        let config = SshConfig {
            user: "root".into(),
            key: pem,
            port: 22,
        };
        let identity = SshIdentity::parse(&config).unwrap();
        assert_eq!(identity.port(), 22);
        assert!(!format!("{config:?}").contains("PRIVATE"));
        assert!(!format!("{identity:?}").contains("PRIVATE"));
    }
}

//! SSH delivery to a server: one host-key-pinned connection per Configure or Drain, retried
//! until the server accepts it (sshd may not be up yet right after `running`), within the
//! transition's deadline; remote commands run over that connection with their exit status as
//! the verdict.
//!
//! Guarantees:
//! - The host key is judged inside the handshake, before authentication and before any channel
//!   exists, so on a mismatch not one byte of a command or of the blob leaves this process. A
//!   mismatch is never retried.
//! - The bootstrap blob travels over the channel's stdin, never in the command line, so it is
//!   not visible in the remote process list and has no exec-request size limit. The remote
//!   script checks the byte count before it moves the file into place, so a connection that
//!   drops mid-transfer can never start the hook on a truncated blob.
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
}

impl PinnedSession {
    pub fn ip(&self) -> &str {
        &self.ip
    }

    /// Runs `command`, feeding `stdin` (then end-of-file), and returns its exit status. When
    /// the deadline passes or `cancel` fires first, the remote command is sent SIGKILL.
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
            while let Some(message) = channel.wait().await {
                match message {
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
            status.map(|status| Exit { status }).ok_or_else(|| {
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

/// The Configure script: reads exactly `blob_len` bytes from stdin into `<hook>.blob` (mode
/// 0600 via `umask 077`, written to a temporary name and moved into place only when complete),
/// then runs `<hook> <cluster_id>`.
pub fn configure_script(hook: &str, cluster_id: &str, blob_len: usize) -> String {
    let blob = quote(&format!("{hook}.blob"));
    let partial = quote(&format!("{hook}.blob.partial"));
    format!(
        "set -eu; umask 077; mkdir -p \"$(dirname {blob})\"; cat > {partial}; \
         n=$(wc -c < {partial} | tr -d ' '); \
         if [ \"$n\" != {blob_len} ]; then rm -f {partial}; \
         echo \"bootstrap blob truncated: got $n of {blob_len} bytes\" >&2; exit 97; fi; \
         mv -f {partial} {blob}; exec {hook} {cluster}",
        hook = quote(hook),
        cluster = quote(cluster_id),
    )
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

    #[tokio::test]
    async fn configure_script_delivers_the_blob_and_runs_the_hook() {
        let dir = tempfile::tempdir().unwrap();
        let hook = dir.path().join("opt dir/it's hook");
        std::fs::create_dir_all(hook.parent().unwrap()).unwrap();
        let record = dir.path().join("record");
        std::fs::write(
            &hook,
            format!(
                "#!/bin/sh\nprintf '%s|' \"$@\" > {}\n",
                quote(record.to_str().unwrap())
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&hook, std::fs::Permissions::from_mode(0o755)).unwrap();
        let blob = b"\x00binary\xffblob'with quotes\n".to_vec();
        let hook_path = hook.to_str().unwrap();
        let script = configure_script(hook_path, "cluster 'one'", blob.len());
        assert!(
            !script.contains("binary"),
            "the blob never enters the command line"
        );
        let (code, out) = sh(&script, &blob, dir.path()).await;
        assert_eq!(code, 0, "{out}");
        assert_eq!(std::fs::read(format!("{hook_path}.blob")).unwrap(), blob);
        let mode = std::fs::metadata(format!("{hook_path}.blob"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        assert_eq!(std::fs::read_to_string(&record).unwrap(), "cluster 'one'|");
    }

    #[tokio::test]
    async fn a_truncated_blob_never_reaches_the_hook() {
        let dir = tempfile::tempdir().unwrap();
        let hook = dir.path().join("hook");
        let ran = dir.path().join("ran");
        std::fs::write(
            &hook,
            format!("#!/bin/sh\ntouch {}\n", quote(ran.to_str().unwrap())),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&hook, std::fs::Permissions::from_mode(0o755)).unwrap();
        let script = configure_script(hook.to_str().unwrap(), "c", 100);
        let (code, out) = sh(&script, b"only ten b", dir.path()).await;
        assert_eq!(code, 97);
        assert!(out.contains("got 10 of 100 bytes"), "{out}");
        assert!(!ran.exists());
        assert!(!dir.path().join("hook.blob").exists());
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

//! A real SSH server for the tests, in process (russh).
//!
//! Why not Debian's sshd: it needs root-owned host keys, `/run/sshd`, a config file and an
//! `apt install` in CI, and it cannot be told per test to present a chosen host key (which is
//! what a MITM test needs) or to drop its first connections (what the reachability retry
//! needs). This server speaks the same protocol over TCP on 127.0.0.1, authenticates the
//! client's public key, and handles `exec` for real: it runs the command with `sh -c` in a
//! temp directory, pipes the channel's data into the command's stdin, and returns the command's
//! exit status. So the blob file the provider writes and the hook it runs are real files and a
//! real process.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use russh::keys::{PrivateKey, PublicKey};
use russh::server::{self, Auth, Msg, Session};
use russh::{Channel, ChannelId, ChannelMsg, MethodKind, MethodSet};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

/// What the server observed.
#[derive(Default, Debug)]
pub struct Observed {
    /// TCP connections accepted.
    pub connections: AtomicUsize,
    /// Sessions that passed public-key authentication.
    pub authenticated: AtomicUsize,
    /// Commands received through `exec`, in order.
    pub commands: Mutex<Vec<String>>,
    /// Bytes received on channels (stdin of commands).
    pub stdin_bytes: AtomicUsize,
}

impl Observed {
    pub fn commands(&self) -> Vec<String> {
        self.commands.lock().unwrap().clone()
    }
}

/// A running test SSH server.
pub struct TestSshd {
    pub observed: Arc<Observed>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TestSshd {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// How the server behaves.
pub struct SshdSetup {
    /// The host key it presents.
    pub host_key: PrivateKey,
    /// The only client key it accepts.
    pub authorized: PublicKey,
    /// The only user it accepts.
    pub user: String,
    /// Where commands run.
    pub workdir: std::path::PathBuf,
    /// Prepended to `PATH` for commands (stand-ins for `kubectl` and friends).
    pub path_prefix: std::path::PathBuf,
    /// The first N connections are closed right after accept (sshd not up yet).
    pub drop_first: usize,
}

#[derive(Clone)]
struct Handler {
    authorized: PublicKey,
    user: String,
    workdir: std::path::PathBuf,
    path: String,
    observed: Arc<Observed>,
}

impl server::Handler for Handler {
    type Error = russh::Error;

    async fn auth_publickey_offered(
        &mut self,
        user: &str,
        offer: server::PublicKeyOffer<'_>,
    ) -> Result<Auth, Self::Error> {
        let _ = offer;
        if user == self.user {
            Ok(Auth::Accept)
        } else {
            Ok(Auth::reject())
        }
    }

    async fn auth_publickey(
        &mut self,
        user: &str,
        key: server::VerifiedPublicKey<'_>,
    ) -> Result<Auth, Self::Error> {
        if user == self.user && key.public_key.key_data() == self.authorized.key_data() {
            self.observed.authenticated.fetch_add(1, Ordering::SeqCst);
            Ok(Auth::Accept)
        } else {
            Ok(Auth::reject())
        }
    }

    async fn channel_open_session(
        &mut self,
        channel: Channel<Msg>,
        reply: server::ChannelOpenHandle,
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        reply.accept().await;
        let (workdir, path, observed) = (
            self.workdir.clone(),
            self.path.clone(),
            self.observed.clone(),
        );
        tokio::spawn(serve_channel(channel, workdir, path, observed));
        Ok(())
    }

    async fn exec_request(
        &mut self,
        channel: ChannelId,
        _data: &[u8],
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        session.channel_success(channel)?;
        Ok(())
    }
}

/// Collects exec + stdin until EOF, runs the command, and reports its exit status.
async fn serve_channel(
    mut channel: Channel<Msg>,
    workdir: std::path::PathBuf,
    path: String,
    observed: Arc<Observed>,
) {
    let mut command = None;
    let mut stdin = Vec::new();
    while let Some(message) = channel.wait().await {
        match message {
            ChannelMsg::Exec { command: c, .. } => {
                let text = String::from_utf8_lossy(&c).into_owned();
                observed.commands.lock().unwrap().push(text.clone());
                command = Some(text);
            }
            ChannelMsg::Data { data } => {
                observed.stdin_bytes.fetch_add(data.len(), Ordering::SeqCst);
                stdin.extend_from_slice(&data);
            }
            ChannelMsg::Eof => break,
            ChannelMsg::Close => return,
            _ => {}
        }
    }
    let Some(command) = command else { return };
    let child = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(&command)
        .current_dir(&workdir)
        .env("PATH", path)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn();
    let status = match child {
        Ok(mut child) => {
            if let Some(mut input) = child.stdin.take() {
                let _ = input.write_all(&stdin).await;
            }
            // Kill the command when the client goes away or sends a signal.
            tokio::select! {
                out = child.wait_with_output() => match out {
                    Ok(out) => {
                        let _ = channel.data(&out.stdout[..]).await;
                        let _ = channel.extended_data(1, &out.stderr[..]).await;
                        out.status.code().map(|c| c as u32).unwrap_or(255)
                    }
                    Err(_) => 255,
                },
                _ = wait_for_signal(&mut channel) => return,
            }
        }
        Err(_) => 127,
    };
    let _ = channel.exit_status(status).await;
    let _ = channel.eof().await;
    let _ = channel.close().await;
}

async fn wait_for_signal(channel: &mut Channel<Msg>) {
    while let Some(message) = channel.wait().await {
        if matches!(message, ChannelMsg::Signal { .. } | ChannelMsg::Close) {
            return;
        }
    }
}

impl TestSshd {
    /// Serves SSH on `listener` until dropped.
    pub fn start(listener: TcpListener, setup: SshdSetup) -> TestSshd {
        let observed = Arc::new(Observed::default());
        let config = Arc::new(server::Config {
            keys: vec![setup.host_key],
            methods: MethodSet::from(&[MethodKind::PublicKey][..]),
            auth_rejection_time: std::time::Duration::from_millis(10),
            auth_rejection_time_initial: Some(std::time::Duration::from_millis(0)),
            inactivity_timeout: Some(std::time::Duration::from_secs(60)),
            ..Default::default()
        });
        let handler = Handler {
            authorized: setup.authorized,
            user: setup.user,
            workdir: setup.workdir,
            path: format!(
                "{}:{}",
                setup.path_prefix.display(),
                std::env::var("PATH").unwrap_or_else(|_| "/usr/bin:/bin".into())
            ),
            observed: observed.clone(),
        };
        let counters = observed.clone();
        let mut drop_first = setup.drop_first;
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                counters.connections.fetch_add(1, Ordering::SeqCst);
                if drop_first > 0 {
                    drop_first -= 1;
                    drop(tcp);
                    continue;
                }
                let (config, handler) = (config.clone(), handler.clone());
                tokio::spawn(async move {
                    if let Ok(session) = server::run_stream(config, tcp, handler).await {
                        let _ = session.await;
                    }
                });
            }
        });
        TestSshd { observed, task }
    }
}

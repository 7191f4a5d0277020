//! A real SSH server playing the emulated servers' sshd, in process (russh), on 127.0.0.1.
//!
//! Why not Debian's sshd: it needs root-owned host keys, `/run/sshd`, a config file and an
//! `apt install` in CI, and it cannot be told per test to present a chosen host key (which is
//! what a MITM test needs) or to drop its first connections (what the reachability retry
//! needs). This server speaks the same protocol over TCP, authenticates the client's public key,
//! and handles `exec` for real: it runs the command with `sh -c` in a working directory (the
//! server's "root"), pipes the channel's data into the command's stdin, and returns the
//! command's exit status. So the blob file the provider writes and the hook it runs are real
//! files and a real process.
//!
//! Two ways to run it:
//!
//! - [`Sshd::start`] with [`HostKeySource::Given`] and [`Root::Given`]: one fixed host key and
//!   one working directory (what the hetzner crate's tests use to stage MITMs and failures);
//! - [`Sshd::for_emulator`] (what `hcloud-emulator --ssh-listen` runs): a connection is for the
//!   newest live emulated server whose public IPv4, private IP or first IPv6 address is the
//!   address it arrived on;
//!   the server presents the ed25519 host key the provider injected into that server's
//!   user-data (as cloud-init would install it) and runs commands in a per-server root
//!   `<base>/<server id>`, seeded with stand-in `bin/kubectl` (appends its arguments to
//!   `kubectl.calls` in the root) and `bin/hostname`, first on `PATH`.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use russh::keys::{PrivateKey, PublicKey};
use russh::server::{self, Auth, Msg, Session};
use russh::{Channel, ChannelId, ChannelMsg, MethodKind, MethodSet};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

use crate::Emulator;

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
        self.commands
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// A running SSH server; stops accepting when dropped.
pub struct Sshd {
    pub observed: Arc<Observed>,
    addr: std::net::SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for Sshd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sshd")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl Drop for Sshd {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The host key the server presents.
pub enum HostKeySource {
    /// Always this key.
    Given(Box<PrivateKey>),
    /// The key the provider injected into the target server's user-data.
    Injected,
}

/// Where commands run.
pub enum Root {
    /// Always in `workdir`, with `path_prefix` first on `PATH` (stand-ins for `kubectl` and
    /// friends).
    Given {
        workdir: PathBuf,
        path_prefix: PathBuf,
    },
    /// In `<base>/<server id>`, created and seeded on first use, with its `bin` first on `PATH`.
    PerServer(PathBuf),
}

/// How the server behaves.
pub struct SshdSetup {
    pub host_key: HostKeySource,
    /// The only client key it accepts.
    pub authorized: PublicKey,
    /// The only user it accepts.
    pub user: String,
    pub root: Root,
    /// The first N connections are closed right after accept (sshd not up yet).
    pub drop_first: usize,
    /// The emulator whose servers this plays (needed for `Injected` and `PerServer`).
    pub emulator: Option<Emulator>,
}

/// The ed25519 host key a `#cloud-config` user-data installs (`ssh_keys: ed25519_private: |`).
pub fn injected_host_key(user_data: &str) -> Option<PrivateKey> {
    let start = user_data.find("ed25519_private: |\n")?;
    let pem: String = user_data[start..]
        .lines()
        .skip(1)
        .take_while(|l| l.starts_with("    "))
        .map(|l| format!("{}\n", &l[4..]))
        .collect();
    PrivateKey::from_openssh(pem).ok()
}

/// The first host address of an IPv6 network `prefix/len` (`2001:db8::/64` -> `2001:db8::1`),
/// the address Hetzner configures on a server.
pub fn first_address(net: &str) -> Option<std::net::Ipv6Addr> {
    let (prefix, _) = net.split_once('/').unwrap_or((net, ""));
    let base: std::net::Ipv6Addr = prefix.parse().ok()?;
    Some(std::net::Ipv6Addr::from(u128::from(base) | 1))
}

impl Emulator {
    /// The host key the provider injected into `server`'s user-data, if any.
    pub fn injected_host_key(&self, server: i64) -> Option<PrivateKey> {
        injected_host_key(&self.user_data(server)?)
    }

    /// The newest live (not deleting) server reachable at `ip` (public IPv4, private IP, or the
    /// first address of its IPv6 network).
    pub fn server_at(&self, ip: &str) -> Option<i64> {
        self.servers()
            .into_iter()
            .filter(|s| s.status != hcloud::models::server::Status::Deleting)
            .filter(|s| {
                s.public_net.ipv4.as_ref().is_some_and(|v4| v4.ip == ip)
                    || s.private_net.iter().any(|n| n.ip.as_deref() == Some(ip))
                    || s.public_net.ipv6.as_ref().is_some_and(|v6| {
                        first_address(&v6.ip).is_some_and(|a| Some(a) == ip.parse().ok())
                    })
            })
            .map(|s| s.id)
            .max()
    }
}

#[derive(Clone)]
struct Handler {
    authorized: PublicKey,
    user: String,
    workdir: PathBuf,
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
    workdir: PathBuf,
    path: String,
    observed: Arc<Observed>,
) {
    let mut command = None;
    let mut stdin = Vec::new();
    while let Some(message) = channel.wait().await {
        match message {
            ChannelMsg::Exec { command: c, .. } => {
                let text = String::from_utf8_lossy(&c).into_owned();
                observed
                    .commands
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(text.clone());
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

fn executable(path: &Path, body: &str) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(path, body)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
}

/// Creates `root` with stand-in `bin/kubectl` and `bin/hostname` unless they exist.
fn seed_root(root: &Path, server: i64) -> std::io::Result<()> {
    std::fs::create_dir_all(root)?;
    let kubectl = root.join("bin/kubectl");
    if !kubectl.exists() {
        let calls = root.join("kubectl.calls");
        let body = format!(
            "#!/bin/sh\necho \"$@\" >> '{}'\n",
            calls.display().to_string().replace('\'', "'\\''")
        );
        executable(&kubectl, &body)?;
    }
    let hostname = root.join("bin/hostname");
    if !hostname.exists() {
        executable(&hostname, &format!("#!/bin/sh\necho server-{server}\n"))?;
    }
    Ok(())
}

fn path_with(prefix: &Path) -> String {
    format!(
        "{}:{}",
        prefix.display(),
        std::env::var("PATH").unwrap_or_else(|_| "/usr/bin:/bin".into())
    )
}

struct Shared {
    host_key: HostKeySource,
    authorized: PublicKey,
    user: String,
    root: Root,
    emulator: Option<Emulator>,
    observed: Arc<Observed>,
}

impl Shared {
    /// The host key and working directory for a connection that arrived on `tcp`.
    fn target(&self, tcp: &TcpStream) -> Result<(PrivateKey, PathBuf, String), String> {
        let server = match (&self.host_key, &self.root) {
            (HostKeySource::Given(_), Root::Given { .. }) => None,
            _ => {
                let emulator = self
                    .emulator
                    .as_ref()
                    .ok_or("no emulator to find the server in")?;
                let local = tcp.local_addr().map_err(|e| e.to_string())?.ip();
                Some(
                    emulator
                        .server_at(&local.to_string())
                        .ok_or_else(|| format!("no live server at {local}"))?,
                )
            }
        };
        let key = match &self.host_key {
            HostKeySource::Given(key) => (**key).clone(),
            HostKeySource::Injected => {
                let id = server.ok_or("no server")?;
                self.emulator
                    .as_ref()
                    .and_then(|e| e.injected_host_key(id))
                    .ok_or_else(|| {
                        format!("server {id} has no injected host key in its user-data")
                    })?
            }
        };
        let (workdir, path) = match &self.root {
            Root::Given {
                workdir,
                path_prefix,
            } => (workdir.clone(), path_with(path_prefix)),
            Root::PerServer(base) => {
                let id = server.ok_or("no server")?;
                let root = base.join(id.to_string());
                seed_root(&root, id).map_err(|e| format!("seed {}: {e}", root.display()))?;
                let path = path_with(&root.join("bin"));
                (root, path)
            }
        };
        Ok((key, workdir, path))
    }
}

impl Sshd {
    /// Serves SSH on `listener` until dropped.
    pub fn start(listener: TcpListener, setup: SshdSetup) -> std::io::Result<Sshd> {
        let addr = listener.local_addr()?;
        let observed = Arc::new(Observed::default());
        let shared = Arc::new(Shared {
            host_key: setup.host_key,
            authorized: setup.authorized,
            user: setup.user,
            root: setup.root,
            emulator: setup.emulator,
            observed: observed.clone(),
        });
        let mut drop_first = setup.drop_first;
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                shared.observed.connections.fetch_add(1, Ordering::SeqCst);
                if drop_first > 0 {
                    drop_first -= 1;
                    drop(tcp);
                    continue;
                }
                let (key, workdir, path) = match shared.target(&tcp) {
                    Ok(target) => target,
                    Err(e) => {
                        tracing::warn!(err = %e, "sshd: refusing the connection");
                        drop(tcp);
                        continue;
                    }
                };
                let config = Arc::new(server::Config {
                    keys: vec![key],
                    methods: MethodSet::from(&[MethodKind::PublicKey][..]),
                    auth_rejection_time: std::time::Duration::from_millis(10),
                    auth_rejection_time_initial: Some(std::time::Duration::from_millis(0)),
                    inactivity_timeout: Some(std::time::Duration::from_secs(60)),
                    ..Default::default()
                });
                let handler = Handler {
                    authorized: shared.authorized.clone(),
                    user: shared.user.clone(),
                    workdir,
                    path,
                    observed: shared.observed.clone(),
                };
                tokio::spawn(async move {
                    if let Ok(session) = server::run_stream(config, tcp, handler).await {
                        let _ = session.await;
                    }
                });
            }
        });
        Ok(Sshd {
            observed,
            addr,
            task,
        })
    }

    /// Plays the sshd of `emulator`'s servers: injected host keys, per-server roots under
    /// `base`, accepting `authorized` as `user`.
    pub fn for_emulator(
        listener: TcpListener,
        emulator: Emulator,
        base: PathBuf,
        authorized: PublicKey,
        user: &str,
    ) -> std::io::Result<Sshd> {
        Sshd::start(
            listener,
            SshdSetup {
                host_key: HostKeySource::Injected,
                authorized,
                user: user.to_owned(),
                root: Root::PerServer(base),
                drop_first: 0,
                emulator: Some(emulator),
            },
        )
    }

    /// [`Sshd::for_emulator`] with the client key as an OpenSSH public-key line
    /// (`ssh-ed25519 AAAA... comment`).
    pub fn for_emulator_openssh(
        listener: TcpListener,
        emulator: Emulator,
        base: PathBuf,
        authorized: &str,
        user: &str,
    ) -> std::io::Result<Sshd> {
        let authorized = PublicKey::from_openssh(authorized.trim())
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
        Sshd::for_emulator(listener, emulator, base, authorized, user)
    }

    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }
}

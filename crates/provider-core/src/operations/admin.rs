//! The admin interface on a local Unix socket (`--admin-socket`, off by default): list FAILED
//! machines and release one (delete its host if any, return the slot to Speculative). One JSON
//! request line, one JSON response line. The socket file is created mode 0600, so only the
//! provider's own user (and root) can use it. Every action is logged and counted.

use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;

use crate::runtime::engine::Engine;
use crate::runtime::replica::Replica;

/// A request on the admin socket.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum AdminRequest {
    FailedList,
    Release { machine_id: String },
}

/// A FAILED machine as the admin interface shows it.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub struct FailedMachine {
    pub id: String,
    pub host: Option<String>,
    pub instance_type: String,
    pub zone: String,
    pub cluster: String,
    pub last_error: String,
}

/// The answer to an admin request.
#[derive(Debug, Serialize, Deserialize)]
pub struct AdminResponse {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub error: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failed: Vec<FailedMachine>,
    /// What a successful action did, for the operator.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

async fn handle(engine: &Engine, request: AdminRequest) -> AdminResponse {
    let telemetry = engine.options().telemetry;
    match request {
        AdminRequest::FailedList => {
            let failed = engine
                .failed()
                .iter()
                .map(|m| FailedMachine {
                    id: m.id.clone(),
                    host: m.host.as_ref().map(|h| h.id.clone()),
                    instance_type: m.instance_type.clone(),
                    zone: m.zone.clone(),
                    cluster: m.cluster.clone(),
                    last_error: m.last_error.clone(),
                })
                .collect();
            telemetry.admin("failed_list", "success");
            AdminResponse {
                ok: true,
                error: String::new(),
                failed,
                message: String::new(),
            }
        }
        AdminRequest::Release { machine_id } => match engine.release(&machine_id).await {
            Ok(message) => {
                tracing::info!(
                    machine_id,
                    done = message,
                    "admin: released a FAILED machine; its capacity comes back under a new machine id"
                );
                telemetry.admin("release", "success");
                AdminResponse {
                    ok: true,
                    error: String::new(),
                    failed: Vec::new(),
                    message,
                }
            }
            Err(e) => {
                tracing::warn!(machine_id, error = %e, "admin: release refused");
                telemetry.admin("release", "error");
                AdminResponse {
                    ok: false,
                    error: e.to_string(),
                    failed: Vec::new(),
                    message: String::new(),
                }
            }
        },
    }
}

/// The longest request line accepted (requests are a few hundred bytes); a longer one is
/// answered with an error and the connection is closed, so a client cannot make the provider
/// buffer without bound.
pub const MAX_REQUEST_LINE: usize = 64 * 1024;

async fn session(replica: Arc<Replica>, stream: UnixStream) -> std::io::Result<()> {
    use tokio::io::AsyncReadExt;
    let (read, mut write) = stream.into_split();
    let mut reader = BufReader::new(read);
    loop {
        let mut line = Vec::new();
        let n = (&mut reader)
            .take(MAX_REQUEST_LINE as u64 + 1)
            .read_until(b'\n', &mut line)
            .await?;
        if n == 0 {
            return Ok(());
        }
        if line.last() == Some(&b'\n') {
            line.pop();
        } else if line.len() > MAX_REQUEST_LINE {
            let response = AdminResponse {
                ok: false,
                error: format!("admin request line longer than {MAX_REQUEST_LINE} bytes"),
                failed: Vec::new(),
                message: String::new(),
            };
            reply(&mut write, &response).await?;
            return Ok(());
        }
        let response = match serde_json::from_slice::<AdminRequest>(&line) {
            // Only the replica that leads may change the state.
            Ok(request) => match replica.writer() {
                Ok(engine) => handle(&engine, request).await,
                Err(status) => AdminResponse {
                    ok: false,
                    error: status.message().to_owned(),
                    failed: Vec::new(),
                    message: String::new(),
                },
            },
            Err(e) => AdminResponse {
                ok: false,
                error: format!("bad admin request: {e}"),
                failed: Vec::new(),
                message: String::new(),
            },
        };
        reply(&mut write, &response).await?;
    }
}

async fn reply(
    write: &mut tokio::net::unix::OwnedWriteHalf,
    response: &AdminResponse,
) -> std::io::Result<()> {
    let mut out = serde_json::to_string(response).unwrap_or_else(|_| "{\"ok\":false}".into());
    out.push('\n');
    write.write_all(out.as_bytes()).await
}

/// Whether `path` is a Unix socket (not following a symlink).
fn is_socket(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket())
}

/// Removes what is at `path` only if it is a socket nobody listens on any more (left by a
/// provider that did not exit cleanly). Anything else there is the operator's: refuse.
fn clear_stale_socket(path: &Path) -> std::io::Result<()> {
    use std::io::{Error, ErrorKind};
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    if !is_socket(path) {
        return Err(Error::new(
            ErrorKind::AlreadyExists,
            format!(
                "{} exists and is not a socket ({}); refusing to replace it: choose another \
                 --admin-socket path or remove the file",
                path.display(),
                if meta.is_dir() {
                    "a directory"
                } else if meta.file_type().is_symlink() {
                    "a symbolic link"
                } else {
                    "a file"
                }
            ),
        ));
    }
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(Error::new(
            ErrorKind::AddrInUse,
            format!(
                "{} is in use by a running process (another provider?)",
                path.display()
            ),
        ));
    }
    std::fs::remove_file(path)
}

/// Binds a Unix socket at `path` with mode 0600 and no instant at which it is more open: it is
/// bound inside a fresh private (0700) directory next to `path`, restricted to 0600 there, and
/// then hard-linked into place (which, unlike a rename, never replaces an existing file).
fn bind_private(path: &Path) -> std::io::Result<UnixListener> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let parent = match path.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(parent) => parent.to_owned(),
        None => std::path::PathBuf::from("."),
    };
    let private = parent.join(format!(
        ".admin-socket-{}-{:016x}.tmp",
        std::process::id(),
        rand::random::<u64>()
    ));
    std::fs::DirBuilder::new().mode(0o700).create(&private)?;
    let staged = private.join("socket");
    let bound = (|| {
        let listener = UnixListener::bind(&staged)?;
        std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(0o600))?;
        std::fs::hard_link(&staged, path)?;
        Ok(listener)
    })();
    let _ = std::fs::remove_file(&staged);
    let _ = std::fs::remove_dir(&private);
    bound
}

/// Binds the admin socket and serves it until `stop`. A stale socket left by an earlier run is
/// replaced; a live one, or anything at `path` that is not a socket, fails startup.
pub fn serve(
    path: &Path,
    replica: Arc<Replica>,
    stop: CancellationToken,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)?;
    }
    clear_stale_socket(path)?;
    let listener = bind_private(path)?;
    let path = path.to_owned();
    tracing::info!(path = %path.display(), "admin socket listening");
    Ok(tokio::spawn(async move {
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => { tokio::spawn(session(replica.clone(), stream)); }
                    Err(e) => tracing::warn!(error = %e, "admin socket accept failed"),
                },
                _ = stop.cancelled() => break,
            }
        }
        if is_socket(&path) {
            let _ = std::fs::remove_file(&path);
        }
    }))
}

/// Sends one request to a running provider's admin socket.
pub async fn call(path: &Path, request: &AdminRequest) -> Result<AdminResponse, String> {
    let stream = UnixStream::connect(path).await.map_err(|e| {
        format!(
            "connect to admin socket {}: {e} (is the provider running with --admin-socket?)",
            path.display()
        )
    })?;
    let (read, mut write) = stream.into_split();
    let mut line = serde_json::to_string(request).map_err(|e| e.to_string())?;
    line.push('\n');
    write
        .write_all(line.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut lines = BufReader::new(read).lines();
    let reply = lines
        .next_line()
        .await
        .map_err(|e| e.to_string())?
        .ok_or_else(|| "admin socket closed without an answer".to_owned())?;
    serde_json::from_str(&reply).map_err(|e| format!("bad admin answer: {e}"))
}

#[cfg(test)]
mod socket_tests;

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::observability::telemetry::Telemetry;
    use crate::provisioning::offerings::default_mix;
    use crate::runtime::engine::EngineOptions;
    use crate::{FenceToken, MachineState, StringMap};

    async fn wait_for(engine: &Engine, id: &str, state: MachineState) {
        for _ in 0..500 {
            if engine.get(id).unwrap().state == state {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("never reached {state}");
    }

    #[tokio::test]
    async fn list_and_release_over_the_socket() {
        let (cloud, fleet) =
            crate::provisioning::fleet::test_fleet(default_mix(4, ["a", "b"], ["z1", "z2"]));
        let options = EngineOptions::new(Telemetry::new("bigfleet_admintest"));
        let engine = Engine::start(
            Arc::new(fleet),
            Arc::new(crate::persistence::store::MemoryStore),
            options,
        )
        .await
        .unwrap();
        let zero = || FenceToken {
            shard_id: String::new(),
            epoch: 0,
            sequence: 0,
        };
        let id = engine.spare_of("a", "z1")[0].clone();
        let other = engine.spare_of("b", "z1")[0].clone();
        engine.create(&id, zero()).await.unwrap();
        wait_for(&engine, &id, MachineState::Idle).await;
        // The host vanishes behind the provider's back, so Configure fails: FAILED with a host.
        let host = engine.get(&id).unwrap().host.clone().unwrap();
        assert!(cloud.remove_out_of_band(&host.id));
        engine
            .configure(&id, "c".into(), b"blob".to_vec(), StringMap::new(), zero())
            .await
            .unwrap();
        wait_for(&engine, &id, MachineState::Failed).await;

        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("admin.sock");
        let stop = CancellationToken::new();
        let server = serve(&socket, Replica::single(engine.clone()), stop.clone()).unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&socket).unwrap().permissions().mode() & 0o777,
            0o600
        );

        let listed = call(&socket, &AdminRequest::FailedList).await.unwrap();
        assert!(listed.ok);
        assert_eq!(listed.failed.len(), 1);
        assert_eq!(listed.failed[0].id, id);
        assert_eq!(listed.failed[0].host.as_deref(), Some(host.id.as_str()));
        assert!(
            listed.failed[0]
                .last_error
                .contains("configure unknown server"),
            "{:?}",
            listed.failed[0]
        );

        let refused = call(
            &socket,
            &AdminRequest::Release {
                machine_id: other.clone(),
            },
        )
        .await
        .unwrap();
        assert!(!refused.ok);
        assert!(refused.error.contains("not Failed"), "{}", refused.error);

        let released = call(
            &socket,
            &AdminRequest::Release {
                machine_id: id.clone(),
            },
        )
        .await
        .unwrap();
        assert!(released.ok, "{}", released.error);
        let m = engine.get(&id).unwrap();
        assert_eq!(
            m.state,
            MachineState::Failed,
            "the released id stays FAILED"
        );
        assert!(m.host.is_none());
        let successor = m.last_error.rsplit(' ').next().unwrap().to_owned();
        assert!(
            released
                .message
                .ends_with(&format!("comes back as machine {successor}")),
            "{}",
            released.message
        );
        assert_eq!(
            engine.get(&successor).unwrap().state,
            MachineState::Speculative
        );
        assert!(
            call(&socket, &AdminRequest::FailedList)
                .await
                .unwrap()
                .failed
                .is_empty()
        );

        stop.cancel();
        server.await.unwrap();
        assert!(!socket.exists(), "the socket file is removed at shutdown");
        assert!(call(&socket, &AdminRequest::FailedList).await.is_err());
    }
}

//! The admin socket file: never replaces what is not a stale socket, is 0600 from the start,
//! and bounds the request line.

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;
use crate::provisioning::offerings::default_mix;

async fn engine() -> Arc<Engine> {
    let (_, fleet) =
        crate::provisioning::fleet::test_fleet(default_mix(2, ["a", "b"], ["z1", "z2"]));
    crate::runtime::engine::test_support::start_in_memory(Arc::new(fleet), "bigfleet_admintest")
        .await
}

#[tokio::test]
async fn a_regular_file_at_the_path_is_never_replaced() {
    let engine = engine().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("admin.sock");
    std::fs::write(&path, b"the operator's file").expect("write");
    let err = serve(
        &path,
        crate::runtime::replica::Replica::single(engine.clone()),
        CancellationToken::new(),
    )
    .expect_err("must refuse");
    assert!(err.to_string().contains("is not a socket"), "{err}");
    assert!(
        err.to_string().contains(&path.display().to_string()),
        "{err}"
    );
    assert_eq!(
        std::fs::read(&path).expect("still there"),
        b"the operator's file"
    );

    let subdir = dir.path().join("a-directory");
    std::fs::create_dir(&subdir).expect("mkdir");
    let err = serve(
        &subdir,
        crate::runtime::replica::Replica::single(engine),
        CancellationToken::new(),
    )
    .expect_err("must refuse");
    assert!(err.to_string().contains("a directory"), "{err}");
    assert!(subdir.is_dir());
    // Nothing was left behind next to the path.
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .expect("list")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
}

#[tokio::test]
async fn the_socket_is_0600_and_a_stale_one_is_replaced_but_a_live_one_is_not() {
    let engine = engine().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("admin.sock");
    // A socket left behind by a provider that was killed.
    drop(std::os::unix::net::UnixListener::bind(&path).expect("stale socket"));
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777)).expect("chmod");

    let stop = CancellationToken::new();
    let server = serve(
        &path,
        crate::runtime::replica::Replica::single(engine.clone()),
        stop.clone(),
    )
    .expect("replaces a stale socket");
    let meta = std::fs::symlink_metadata(&path).expect("socket");
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    // The private staging directory is gone.
    assert_eq!(std::fs::read_dir(dir.path()).expect("list").count(), 1);
    assert!(
        call(&path, &AdminRequest::FailedList)
            .await
            .expect("served")
            .ok
    );

    // A second provider on the same path does not steal the live socket.
    let err = serve(
        &path,
        crate::runtime::replica::Replica::single(engine),
        CancellationToken::new(),
    )
    .expect_err("in use");
    assert!(err.to_string().contains("in use"), "{err}");
    assert!(
        call(&path, &AdminRequest::FailedList)
            .await
            .expect("still served")
            .ok
    );

    stop.cancel();
    server.await.expect("server");
    assert!(!path.exists());
}

#[tokio::test]
async fn an_overlong_request_line_is_refused_and_the_connection_closed() {
    let engine = engine().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("admin.sock");
    let stop = CancellationToken::new();
    let _server = serve(
        &path,
        crate::runtime::replica::Replica::single(engine),
        stop.clone(),
    )
    .expect("serve");

    let mut stream = UnixStream::connect(&path).await.expect("connect");
    // Twice the limit without a newline: the provider must not wait for (or buffer) the rest.
    let flood = vec![b'x'; 2 * MAX_REQUEST_LINE];
    let _ = stream.write_all(&flood).await;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer))
        .await
        .expect("answered and closed")
        .ok();
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.contains("admin request line longer than 65536 bytes"),
        "{answer}"
    );

    // A request of ordinary size on a new connection is served.
    assert!(
        call(&path, &AdminRequest::FailedList)
            .await
            .expect("served")
            .ok
    );
    stop.cancel();
}

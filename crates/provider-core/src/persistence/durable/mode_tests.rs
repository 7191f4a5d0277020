//! The `--state` directory is 0700 and every file in it 0600, whoever created them.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use super::*;
use crate::rules::fence::HighWaterMark;

fn mode(path: &Path) -> u32 {
    fs::metadata(path).expect("metadata").permissions().mode() & 0o777
}

fn assert_private(dir: &Path) {
    assert_eq!(mode(dir), 0o700, "{}", dir.display());
    let mut files = 0;
    for entry in fs::read_dir(dir).expect("list") {
        let path = entry.expect("entry").path();
        assert_eq!(mode(&path), 0o600, "{}", path.display());
        files += 1;
    }
    assert!(files >= 2, "expected a log and the lock");
}

fn fence(n: i64) -> Change {
    Change::PutFence {
        shard_id: "s".into(),
        machine_id: format!("m-{n}"),
        mark: HighWaterMark {
            epoch: 1,
            sequence: n,
        },
    }
}

#[test]
fn a_new_state_directory_and_its_files_are_private() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("state");
    let store = DurableStore::open_with(
        &dir,
        Tuning {
            compact_min_bytes: 1 << 10,
            ..Tuning::default()
        },
    )
    .expect("open");
    store.load().expect("load");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    for n in 0..100 {
        rt.block_on(store.submit(vec![fence(n)]).wait())
            .expect("commit");
    }
    drop(store);
    // Logs, the lock and the snapshots written by compaction.
    assert!(
        fs::read_dir(&dir).expect("list").any(|e| e
            .expect("entry")
            .file_name()
            .to_string_lossy()
            .starts_with("snapshot-")),
        "no snapshot was written"
    );
    assert_private(&dir);
}

#[test]
fn an_existing_directory_with_wider_modes_is_tightened() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("state");
    drop(DurableStore::open(&dir).expect("create"));
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).expect("chmod dir");
    for entry in fs::read_dir(&dir).expect("list") {
        let path = entry.expect("entry").path();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).expect("chmod file");
    }
    let store = DurableStore::open(&dir).expect("reopen");
    assert_private(&dir);
    drop(store);
}

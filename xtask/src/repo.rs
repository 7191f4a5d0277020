//! Where the workspace lives, for the xtask modules that read or write its files.

use std::path::{Path, PathBuf};

/// The workspace root: the parent of this crate's manifest directory.
pub(crate) fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask sits one level below the workspace root")
        .to_path_buf()
}

//! The files inside a state directory, their names, and the fsync discipline that makes a file
//! appear whole or not at all.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::codec::FileKind;

/// The lock file: held (flock) by the one process that may write the directory.
pub(crate) const LOCK_NAME: &str = "LOCK";
const TEMP_SUFFIX: &str = ".tmp";

/// The file name of a log or snapshot generation. Zero-padded, so names sort by generation.
pub(crate) fn file_name(kind: FileKind, generation: u64) -> String {
    format!("{}-{generation:020}", kind.noun())
}

pub(crate) fn file_path(dir: &Path, kind: FileKind, generation: u64) -> PathBuf {
    dir.join(file_name(kind, generation))
}

/// What a state directory holds.
#[derive(Debug, Default)]
pub(crate) struct Listing {
    /// Snapshot generations, ascending.
    pub snapshots: Vec<u64>,
    /// Log generations, ascending.
    pub logs: Vec<u64>,
    /// Leftovers of an interrupted write (never part of the state).
    pub temps: Vec<PathBuf>,
}

impl Listing {
    /// True when the directory holds no state at all (a fresh start).
    pub fn is_empty(&self) -> bool {
        self.snapshots.is_empty() && self.logs.is_empty()
    }
}

fn parse_generation(name: &str, kind: FileKind) -> Option<u64> {
    let digits = name.strip_prefix(kind.noun())?.strip_prefix('-')?;
    (digits.len() == 20 && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

/// Lists a state directory. Names that are not ours are ignored (a volume root may hold
/// `lost+found`).
pub(crate) fn list(dir: &Path) -> io::Result<Listing> {
    let mut listing = Listing::default();
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if name.ends_with(TEMP_SUFFIX) {
            listing.temps.push(entry.path());
        } else if let Some(g) = parse_generation(name, FileKind::Snapshot) {
            listing.snapshots.push(g);
        } else if let Some(g) = parse_generation(name, FileKind::Log) {
            listing.logs.push(g);
        }
    }
    listing.snapshots.sort_unstable();
    listing.logs.sort_unstable();
    Ok(listing)
}

/// Makes the directory entries of `dir` (creations, renames, removals) durable.
pub(crate) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Creates `dir` (mode 0700) and any missing parents (mode 0755), then makes the new entry
/// durable in its parent.
pub(crate) fn create_dir(dir: &Path) -> io::Result<()> {
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(parent)?;
    }
    fs::DirBuilder::new().mode(0o700).create(dir)?;
    sync_dir(dir)?;
    sync_parent(dir)
}

/// Makes the entry of `path` in its parent directory durable.
pub(crate) fn sync_parent(path: &Path) -> io::Result<()> {
    match path.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(parent) => sync_dir(parent),
        None => sync_dir(Path::new(".")),
    }
}

/// Writes a new file atomically: `<name>.tmp` is written and fsynced, renamed to `name`, and the
/// directory fsynced. Returns the open file, positioned at its end, for appending.
pub(crate) fn create_file_atomically(
    dir: &Path,
    name: &str,
    write: impl FnOnce(&mut File) -> io::Result<()>,
) -> io::Result<File> {
    let temp = dir.join(format!("{name}{TEMP_SUFFIX}"));
    let result = (|| {
        let mut file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&temp)?;
        write(&mut file)?;
        file.flush()?;
        file.sync_all()?;
        fs::rename(&temp, dir.join(name))?;
        sync_dir(dir)?;
        Ok(file)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&temp);
    }
    result
}

/// Removes files that are no longer part of the state, then makes the removals durable.
pub(crate) fn remove_all(dir: &Path, paths: &[PathBuf]) -> io::Result<()> {
    if paths.is_empty() {
        return Ok(());
    }
    for path in paths {
        match fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    sync_dir(dir)
}

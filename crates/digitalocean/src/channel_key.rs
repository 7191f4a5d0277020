//! What the agents of the Droplets in the state were told to trust, kept beside a local state
//! (`channel-key.json`), so that a restart with a bootstrap channel key those agents cannot
//! verify fails before any port binds instead of locking every one of them out.
//!
//! Without `--bootstrap-ca`, an agent pins the SHA-256 of the channel certificate's public key
//! (SubjectPublicKeyInfo) it found in its user_data. A certificate renewed with the same key is
//! accepted; a new key is not. The reload path refuses a new key while running; this record
//! does the same across restarts: it holds the key pin handed out, and a start whose channel
//! key differs while the state still holds Droplets is refused, naming the files. With
//! `--bootstrap-ca` from the start nothing is pinned to a key, and the record says so.
//!
//! The record is rewritten whenever the state holds no Droplet (nothing can be locked out) or
//! none was recorded yet (an upgrade from a version without it: the key served now is the best
//! knowledge). While Droplets exist it is kept as it is, so switching to `--bootstrap-ca` later
//! does not forget the key pinned by the Droplets created before; once those are gone, delete
//! the file (or wait for a start with no Droplet) to let the key change.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The file's name inside the state directory (not a state file: the store ignores it).
pub const FILE_NAME: &str = "channel-key.json";

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Saved {
    /// The base64 SHA-256 of the key pinned by agents, or `None` when they anchor on
    /// `--bootstrap-ca` (no key pinned).
    pinned_spki_sha256: Option<String>,
}

/// The record of one provider's channel key, and what it serves now.
#[derive(Clone, Debug)]
pub struct ChannelKeyRecord {
    path: PathBuf,
    /// What agents of new Droplets pin: the key's hash, or `None` with `--bootstrap-ca`.
    pinned: Option<String>,
    /// `--bootstrap-tls-cert` and `--bootstrap-tls-key`, for messages.
    cert: String,
    key: String,
}

impl ChannelKeyRecord {
    /// `None` without a local state directory (in memory, or in etcd).
    pub fn for_state(
        state: &str,
        pinned_spki_sha256: &str,
        cert: &str,
        key: &str,
    ) -> Option<ChannelKeyRecord> {
        if state.is_empty() || provider_core::etcd::is_etcd(state) {
            return None;
        }
        Some(ChannelKeyRecord {
            path: Path::new(state).join(FILE_NAME),
            pinned: (!pinned_spki_sha256.is_empty()).then(|| pinned_spki_sha256.to_owned()),
            cert: cert.to_owned(),
            key: key.to_owned(),
        })
    }

    /// Refuses a channel key the agents of the `droplets` Droplets in the state pin another
    /// key than; otherwise records what is served now where that loses nothing.
    pub fn check(&self, droplets: usize) -> Result<(), String> {
        let recorded = self.load();
        if let Some(Saved {
            pinned_spki_sha256: Some(pinned),
        }) = &recorded
            && droplets > 0
            && self.pinned.as_deref() != Some(pinned.as_str())
        {
            return Err(format!(
                "--bootstrap-tls-cert {} / --bootstrap-tls-key {}: the channel's key is not the \
                 one the agents of the {droplets} Droplets in the state pin ({} records its \
                 SHA-256, {pinned}); they would refuse this certificate and never reach the \
                 provider again. Serve a certificate with that key (a renewal with cert-manager \
                 privateKey.rotationPolicy: Never keeps it), or replace those Droplets first \
                 (then delete {})",
                self.cert,
                self.key,
                self.path.display(),
                self.path.display(),
            ));
        }
        if recorded.is_none() || droplets == 0 {
            self.save();
        }
        Ok(())
    }

    fn load(&self) -> Option<Saved> {
        let bytes = match std::fs::read(&self.path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
            Err(e) => {
                tracing::warn!(file = %self.path.display(), error = %e, "bootstrap channel: cannot read the recorded key pin; recording the one served now");
                return None;
            }
        };
        match serde_json::from_slice(&bytes) {
            Ok(saved) => Some(saved),
            Err(e) => {
                tracing::warn!(file = %self.path.display(), error = %e, "bootstrap channel: the recorded key pin does not parse; recording the one served now");
                None
            }
        }
    }

    fn save(&self) {
        let saved = Saved {
            pinned_spki_sha256: self.pinned.clone(),
        };
        let result = serde_json::to_vec_pretty(&saved)
            .map_err(std::io::Error::other)
            .and_then(|bytes| provider_core::price_cache::write_atomically(&self.path, &bytes));
        if let Err(e) = result {
            tracing::warn!(file = %self.path.display(), error = %e, "bootstrap channel: cannot record the key pin handed to agents; a restart with another key is then not refused");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(dir: &Path, pin: &str) -> ChannelKeyRecord {
        ChannelKeyRecord::for_state(dir.to_str().unwrap(), pin, "tls.crt", "tls.key").unwrap()
    }

    #[test]
    fn a_new_key_is_refused_while_droplets_pin_the_old_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        record(dir.path(), "AAAA")
            .check(0)
            .expect("a first start records");
        record(dir.path(), "AAAA").check(3).expect("the same key");
        let err = record(dir.path(), "BBBB")
            .check(3)
            .expect_err("another key");
        assert!(
            err.contains("--bootstrap-tls-cert tls.crt")
                && err.contains("3 Droplets")
                && err.contains(FILE_NAME),
            "{err}"
        );
        // Switching to --bootstrap-ca does not help the Droplets that pin the key.
        record(dir.path(), "")
            .check(3)
            .expect_err("anchors now, pins before");
        // With no Droplet left, anything goes, and is recorded.
        record(dir.path(), "BBBB").check(0).expect("no Droplet");
        record(dir.path(), "BBBB")
            .check(5)
            .expect("the new key is the recorded one");
    }

    #[test]
    fn anchored_agents_allow_any_key_and_a_missing_record_takes_the_current_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        record(dir.path(), "")
            .check(2)
            .expect("no record: an upgrade");
        record(dir.path(), "").check(2).expect("anchors");
        record(dir.path(), "CCCC")
            .check(2)
            .expect("anchored agents pin no key");
        let other = tempfile::tempdir().expect("tempdir");
        std::fs::write(other.path().join(FILE_NAME), b"{garbage").unwrap();
        record(other.path(), "DDDD")
            .check(4)
            .expect("an unreadable record is replaced");
        record(other.path(), "EEEE")
            .check(4)
            .expect_err("the replaced record holds DDDD");
    }

    #[test]
    fn no_record_without_a_local_state() {
        assert!(ChannelKeyRecord::for_state("", "AAAA", "c", "k").is_none());
        assert!(ChannelKeyRecord::for_state("etcd://127.0.0.1:2379/p", "AAAA", "c", "k").is_none());
    }
}

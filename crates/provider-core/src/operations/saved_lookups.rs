//! What a cloud's startup look-ups found (the offerings' settings resolved against its API),
//! kept in a file beside the local state, so that a restart serves at once from it instead of
//! waiting on the API before any port binds (a restart in a long 429 storm), and the API budget
//! is not spent again on answers that rarely change.
//!
//! Each provider names its file and gives its own on-disk form of what it keeps; this module is
//! the envelope they share: when the file was written, and the fingerprint of the settings, API
//! endpoint and token the answers belong to (a digest: the token is never written). A file with
//! another fingerprint is not used, nor one that cannot be read or does not parse: the provider
//! then looks everything up from the API as on a first start.

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// The file as written: the envelope, then the provider's own fields.
#[derive(Serialize)]
struct Written<'a, T> {
    /// When it was written, seconds since the Unix epoch (for operators reading it).
    saved_unix: u64,
    /// Hex SHA-256 of what the answers were looked up with ([`fingerprint`]).
    fingerprint: &'a str,
    #[serde(flatten)]
    answers: &'a T,
}

/// The file as read; `saved_unix` is for operators and not needed.
#[derive(Deserialize)]
struct Read<T> {
    fingerprint: String,
    #[serde(flatten)]
    answers: T,
}

/// The digest a saved file must carry to be used: hex SHA-256 of `kind` (the provider, its file
/// and the version of its form), then of each of `parts` (the settings, the endpoint, the
/// token) after a NUL byte.
pub fn fingerprint(kind: &str, parts: &[&str]) -> String {
    let mut digest = ring::digest::Context::new(&ring::digest::SHA256);
    digest.update(kind.as_bytes());
    for part in parts {
        digest.update(b"\0");
        digest.update(part.as_bytes());
    }
    digest
        .finish()
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// One provider's file of saved look-ups.
#[derive(Clone, Debug)]
pub struct SavedLookups {
    path: PathBuf,
    /// What the file holds, as log lines name it ("plans", "Droplet settings").
    what: &'static str,
}

impl SavedLookups {
    /// The file `file_name` in the local state directory `state`; `None` without one (state in
    /// memory, or in etcd, where standbys look up before they may lead anyway).
    pub fn for_state(state: &str, file_name: &str, what: &'static str) -> Option<SavedLookups> {
        if state.is_empty() || crate::runtime::etcd::is_etcd(state) {
            return None;
        }
        Some(SavedLookups::at(Path::new(state).join(file_name), what))
    }

    /// The file at `path`.
    pub fn at(path: PathBuf, what: &'static str) -> SavedLookups {
        SavedLookups { path, what }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The saved answers, if the file exists, parses and was written for `fingerprint`.
    pub fn load<T: DeserializeOwned>(&self, fingerprint: &str) -> Option<T> {
        let what = self.what;
        let bytes = match std::fs::read(&self.path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
            Err(e) => {
                tracing::warn!(file = %self.path.display(), error = %e, "settings: cannot read the saved {what}; resolving them from the API");
                return None;
            }
        };
        let saved: Read<T> = match serde_json::from_slice(&bytes) {
            Ok(saved) => saved,
            Err(e) => {
                tracing::warn!(file = %self.path.display(), error = %e, "settings: the saved {what} do not parse; resolving them from the API");
                return None;
            }
        };
        if saved.fingerprint != fingerprint {
            tracing::info!(file = %self.path.display(), "settings: the saved {what} were resolved for other settings, endpoint or token; resolving them from the API");
            return None;
        }
        Some(saved.answers)
    }

    /// Writes `answers` for `fingerprint` atomically ([`crate::operations::price_cache::write_atomically`]).
    /// A failure is logged (the next start then looks up from the API) and returns false.
    pub fn save<T: Serialize>(&self, fingerprint: &str, answers: &T) -> bool {
        let written = Written {
            saved_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            fingerprint,
            answers,
        };
        let result = serde_json::to_vec_pretty(&written)
            .map_err(std::io::Error::other)
            .and_then(|bytes| crate::operations::price_cache::write_atomically(&self.path, &bytes));
        match result {
            Ok(()) => true,
            Err(e) => {
                let what = self.what;
                tracing::warn!(file = %self.path.display(), error = %e, "settings: cannot save the resolved {what}; the next start resolves them from the API");
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Answers {
        values: Vec<u64>,
    }

    #[test]
    fn answers_round_trip_for_their_fingerprint_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = SavedLookups::at(dir.path().join("answers.json"), "answers");
        let answers = Answers { values: vec![1, 2] };
        assert_eq!(file.load::<Answers>("a"), None, "no file yet");
        assert!(file.save("a", &answers));
        assert_eq!(file.load::<Answers>("a"), Some(answers));
        assert_eq!(file.load::<Answers>("b"), None, "another fingerprint");
        let text = std::fs::read_to_string(file.path()).expect("read");
        let written: serde_json::Value = serde_json::from_str(&text).expect("json");
        assert_eq!(written["fingerprint"], "a", "{text}");
        assert!(
            written["saved_unix"].as_u64().is_some_and(|t| t > 0),
            "{text}"
        );
        assert_eq!(written["values"], serde_json::json!([1, 2]), "{text}");
    }

    #[test]
    fn a_file_that_does_not_parse_or_cannot_be_written_is_no_answer() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = SavedLookups::at(dir.path().join("answers.json"), "answers");
        std::fs::write(file.path(), b"{not json").expect("write");
        assert_eq!(file.load::<Answers>("a"), None);
        std::fs::write(file.path(), br#"{"fingerprint": "a", "values": "x"}"#).expect("write");
        assert_eq!(file.load::<Answers>("a"), None, "a field of the wrong type");
        let nowhere = SavedLookups::at(dir.path().join("missing/answers.json"), "answers");
        assert!(!nowhere.save("a", &Answers { values: vec![] }));
    }

    #[test]
    fn the_fingerprint_separates_its_parts() {
        let print = fingerprint("kind v1", &["settings", "endpoint", "token"]);
        assert_eq!(print.len(), 64);
        assert!(print.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(
            print,
            fingerprint("kind v1", &["settings", "endpoint", "token"])
        );
        assert_ne!(
            print,
            fingerprint("kind v1", &["settings", "endpoint", "other"])
        );
        assert_ne!(
            print,
            fingerprint("kind v2", &["settings", "endpoint", "token"])
        );
        assert_ne!(
            fingerprint("k", &["ab", "c"]),
            fingerprint("k", &["a", "bc"]),
            "a NUL ends each part"
        );
    }

    #[test]
    fn without_a_local_state_there_is_no_file() {
        assert!(SavedLookups::for_state("", "a.json", "answers").is_none());
        assert!(SavedLookups::for_state("etcd://127.0.0.1:2379/p", "a.json", "answers").is_none());
        let file = SavedLookups::for_state("/var/lib/state", "a.json", "answers").expect("local");
        assert_eq!(file.path(), Path::new("/var/lib/state/a.json"));
    }
}

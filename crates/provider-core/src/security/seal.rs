//! Sealing a Configure's bootstrap blob for the time its Configure runs (beyond.md §3): the keys
//! of `--state-encryption-key-file`, AES-256-GCM with a random nonce per blob, and the machine id
//! and operation id bound in as associated data, so a sealed blob opens only for the Configure it
//! was accepted with. Only this module sees key material; nothing here logs or prints it.

use std::path::Path;

use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::rand::{SecureRandom, SystemRandom};
use zeroize::Zeroize;

use crate::provisioning::backend::BootstrapBlob;

/// The flag the keys come from, for error messages.
pub const KEY_FILE_FLAG: &str = "--state-encryption-key-file";

/// The first byte of every sealed blob: the layout below. Another layout gets another number.
const FORMAT: u8 = 1;
/// Bytes of one key.
const KEY_LEN: usize = 32;
/// Bytes a sealed blob adds to its plaintext: format byte, nonce, tag.
pub const OVERHEAD: usize = 1 + NONCE_LEN + 16;
/// Prefixes the associated data, so these ciphertexts can never be taken for another use's.
const CONTEXT: &[u8] = b"bigfleet/sealed-configure/v1\0";

/// The state encryption keys: the first seals, every one opens (rotation keeps in-flight work).
pub struct StateKeys {
    keys: Vec<LessSafeKey>,
    random: SystemRandom,
}

impl std::fmt::Debug for StateKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StateKeys([redacted; {} keys])", self.keys.len())
    }
}

/// Why a sealed blob did not open.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    #[error("the sealed blob is of an unknown format {0}")]
    Format(u8),
    #[error("the sealed blob is truncated")]
    Truncated,
    #[error("none of the {0} keys of {KEY_FILE_FLAG} opens it")]
    NoKey(usize),
}

/// The nonce of a Configure (`TransitionContext::configure_nonce`): the first 8 bytes of the
/// SHA-256 of its sealed record, which holds a random nonce of its own, so it differs for every
/// accepted Configure and is the same wherever the record is read; without a sealed record, 8
/// random bytes. As 16 lower-case hex digits. The digest of a ciphertext tells nothing of the
/// blob or the key.
pub fn configure_nonce(sealed: Option<&crate::rules::records::SealedConfigure>) -> String {
    let mut bytes = [0u8; 8];
    match sealed {
        Some(sealed) => {
            let mut context = ring::digest::Context::new(&ring::digest::SHA256);
            context.update(b"bigfleet/configure-nonce/v1\0");
            context.update(&sealed.sealed);
            bytes.copy_from_slice(&context.finish().as_ref()[..8]);
        }
        None => rand::Rng::fill_bytes(&mut rand::rng(), &mut bytes),
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl StateKeys {
    /// Reads the key file: one base64 key of 32 bytes per line, the current key first. Blank
    /// lines and lines starting with `#` are skipped. Errors name the flag, the file and the line,
    /// never the line's content.
    pub fn load(path: &Path) -> Result<StateKeys, String> {
        let where_ = || format!("{KEY_FILE_FLAG} {}", path.display());
        let mut text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", where_()))?;
        let parsed = StateKeys::parse(&text).map_err(|e| format!("{}: {e}", where_()));
        text.zeroize();
        parsed
    }

    /// Parses the key file's content (see [`StateKeys::load`]).
    pub fn parse(text: &str) -> Result<StateKeys, String> {
        let mut keys = Vec::new();
        for (index, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let number = index + 1;
            let mut bytes = data_encoding::BASE64
                .decode(line.as_bytes())
                .map_err(|_| format!("line {number} is not a base64 key"))?;
            if bytes.len() != KEY_LEN {
                let len = bytes.len();
                bytes.zeroize();
                return Err(format!(
                    "line {number} decodes to {len} bytes; a key is {KEY_LEN} bytes (make one with `openssl rand -base64 32`)"
                ));
            }
            let key = UnboundKey::new(&AES_256_GCM, &bytes)
                .map_err(|_| format!("line {number} is not a usable AES-256 key"));
            bytes.zeroize();
            keys.push(LessSafeKey::new(key?));
        }
        if keys.is_empty() {
            return Err(format!(
                "holds no key; put one base64 key of {KEY_LEN} bytes per line, the current one first (make one with `openssl rand -base64 32`)"
            ));
        }
        Ok(StateKeys {
            keys,
            random: SystemRandom::new(),
        })
    }

    /// How many keys open sealed blobs.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Always false: a key file holds at least one key.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Seals `blob` for the Configure `operation_id` of `machine_id` with the current key.
    pub fn seal(
        &self,
        machine_id: &str,
        operation_id: &str,
        blob: &[u8],
    ) -> Result<Vec<u8>, String> {
        let mut nonce = [0u8; NONCE_LEN];
        self.random
            .fill(&mut nonce)
            .map_err(|_| "seal bootstrap blob: the system random source failed".to_owned())?;
        let mut body = blob.to_vec();
        self.keys[0]
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(associated_data(machine_id, operation_id)),
                &mut body,
            )
            .map_err(|_| "seal bootstrap blob: encryption failed".to_owned())?;
        let mut out = Vec::with_capacity(1 + NONCE_LEN + body.len());
        out.push(FORMAT);
        out.extend_from_slice(&nonce);
        out.append(&mut body);
        Ok(out)
    }

    /// Opens a blob sealed by [`StateKeys::seal`] for the same machine and operation, with
    /// whichever key sealed it.
    pub fn open(
        &self,
        machine_id: &str,
        operation_id: &str,
        sealed: &[u8],
    ) -> Result<BootstrapBlob, OpenError> {
        let (&format, rest) = sealed.split_first().ok_or(OpenError::Truncated)?;
        if format != FORMAT {
            return Err(OpenError::Format(format));
        }
        if rest.len() < NONCE_LEN + 16 {
            return Err(OpenError::Truncated);
        }
        let (nonce, body) = rest.split_at(NONCE_LEN);
        let aad = associated_data(machine_id, operation_id);
        for key in &self.keys {
            let mut buffer = BootstrapBlob(body.to_vec());
            let nonce =
                Nonce::try_assume_unique_for_key(nonce).map_err(|_| OpenError::Truncated)?;
            if let Ok(plain) = key.open_in_place(nonce, Aad::from(&aad), &mut buffer.0) {
                let len = plain.len();
                // The tag's bytes go; the zeroing on drop covers what remains.
                buffer.0.truncate(len);
                return Ok(buffer);
            }
        }
        Err(OpenError::NoKey(self.keys.len()))
    }
}

fn associated_data(machine_id: &str, operation_id: &str) -> Vec<u8> {
    let mut aad = Vec::with_capacity(CONTEXT.len() + machine_id.len() + 1 + operation_id.len());
    aad.extend_from_slice(CONTEXT);
    aad.extend_from_slice(machine_id.as_bytes());
    aad.push(0);
    aad.extend_from_slice(operation_id.as_bytes());
    aad
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY_A: &str = "q83vEjRWeJCrze8SNFZ4kKvN7xI0VniQq83vEjRWeJA=";
    const KEY_B: &str = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";

    fn keys(text: &str) -> StateKeys {
        StateKeys::parse(text).expect("keys")
    }

    #[test]
    fn a_sealed_blob_opens_for_its_own_configure_only() {
        let a = keys(KEY_A);
        let sealed = a.seal("m-1", "op-7", b"join-secret").expect("seal");
        assert_eq!(sealed.len(), OVERHEAD + b"join-secret".len());
        assert!(
            !sealed.windows(11).any(|w| w == b"join-secret"),
            "the plaintext must not appear in the sealed bytes"
        );
        assert_eq!(
            a.open("m-1", "op-7", &sealed).expect("open").0,
            b"join-secret"
        );
        assert_eq!(
            a.open("m-2", "op-7", &sealed).unwrap_err(),
            OpenError::NoKey(1)
        );
        assert_eq!(
            a.open("m-1", "op-8", &sealed).unwrap_err(),
            OpenError::NoKey(1)
        );
        let mut flipped = sealed.clone();
        *flipped.last_mut().expect("tag") ^= 1;
        assert_eq!(
            a.open("m-1", "op-7", &flipped).unwrap_err(),
            OpenError::NoKey(1)
        );
        assert_eq!(
            a.open("m-1", "op-7", &sealed[..10]).unwrap_err(),
            OpenError::Truncated
        );
        let mut other_format = sealed;
        other_format[0] = 9;
        assert_eq!(
            a.open("m-1", "op-7", &other_format).unwrap_err(),
            OpenError::Format(9)
        );
    }

    #[test]
    fn a_configure_nonce_follows_its_sealed_record() {
        let a = keys(KEY_A);
        let record = |sealed: Vec<u8>| crate::rules::records::SealedConfigure {
            deadline_unix_ms: 1,
            sealed,
        };
        let one = record(a.seal("m-1", "op-1", b"same").expect("seal"));
        let two = record(a.seal("m-1", "op-1", b"same").expect("seal"));
        let nonce = configure_nonce(Some(&one));
        assert_eq!(nonce.len(), 16);
        assert!(
            nonce
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        );
        assert_eq!(
            nonce,
            configure_nonce(Some(&one.clone())),
            "read again, the same"
        );
        assert_ne!(
            nonce,
            configure_nonce(Some(&two)),
            "the same blob sealed again differs"
        );
        let (x, y) = (configure_nonce(None), configure_nonce(None));
        assert_ne!(x, y);
        assert_eq!(x.len(), 16);
    }

    #[test]
    fn two_seals_of_one_blob_differ() {
        let a = keys(KEY_A);
        let first = a.seal("m-1", "op-1", b"same").expect("seal");
        let second = a.seal("m-1", "op-1", b"same").expect("seal");
        assert_ne!(first, second, "every seal draws a fresh nonce");
    }

    #[test]
    fn rotation_opens_with_older_keys_and_seals_with_the_first() {
        let sealed_by_a = keys(KEY_A).seal("m-1", "op-1", b"blob").expect("seal");
        let rotated = keys(&format!("{KEY_B}\n{KEY_A}\n"));
        assert_eq!(rotated.len(), 2);
        assert_eq!(
            rotated.open("m-1", "op-1", &sealed_by_a).expect("open").0,
            b"blob"
        );
        let sealed_by_b = rotated.seal("m-1", "op-2", b"blob").expect("seal");
        assert!(keys(KEY_B).open("m-1", "op-2", &sealed_by_b).is_ok());
        assert_eq!(
            keys(KEY_A).open("m-1", "op-2", &sealed_by_b).unwrap_err(),
            OpenError::NoKey(1)
        );
        assert_eq!(
            keys(KEY_B).open("m-1", "op-1", &sealed_by_a).unwrap_err(),
            OpenError::NoKey(1)
        );
    }

    #[test]
    fn key_file_errors_name_the_line_and_never_its_content() {
        let cases = [
            ("", "holds no key"),
            ("# only a comment\n\n", "holds no key"),
            (
                &format!("{KEY_A}\nnot*base64*secretish\n") as &str,
                "line 2 is not a base64 key",
            ),
            (
                "c2hvcnQta2V5LXNlY3JldA==",
                "line 1 decodes to 16 bytes; a key is 32 bytes",
            ),
        ];
        for (text, expected) in cases {
            let err = StateKeys::parse(text).unwrap_err();
            assert!(err.contains(expected), "{err}");
            assert!(!err.contains("secret"), "{err}");
        }
        let with_comments = keys(&format!("# current\n{KEY_A}\n\n  {KEY_B}  \n"));
        assert_eq!(with_comments.len(), 2);
        assert!(!format!("{with_comments:?}").contains(KEY_A));
    }

    #[test]
    fn load_names_the_flag_and_the_file() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("state-key");
        let err = StateKeys::load(&path).unwrap_err();
        assert!(err.starts_with("--state-encryption-key-file "), "{err}");
        assert!(err.contains("state-key"), "{err}");
        std::fs::write(&path, format!("{KEY_A}\n")).expect("write");
        assert_eq!(StateKeys::load(&path).expect("load").len(), 1);
    }
}

//! SSH host-key pinning: minting the ed25519 host key injected into every server we create,
//! its fingerprint (the value of the `bigfleet-host-key-fp` label), the cloud-config that
//! installs it, and the verdict on a key a server presents.
//!
//! Fingerprint format (compatible with the reference): SHA-256 over the SSH wire encoding of
//! the public key, as lower-case unpadded base32, 52 characters of `[a-z2-7]`. It fits a label
//! value as is, unlike OpenSSH's `SHA256:` base64 form.

use russh::keys::ssh_key::{LineEnding, PublicKey};
use russh::keys::{Algorithm, HashAlg, PrivateKey};

use zeroize::Zeroizing;

use crate::labels::base32;

/// A freshly minted host keypair, ready to inject. The private half is zeroed on drop.
pub struct HostKey {
    /// OpenSSH PEM of the private key (comment `bigfleet-host`).
    private_pem: Zeroizing<String>,
    /// `ssh-ed25519 AAAA...`, no comment.
    public_line: String,
    fingerprint: String,
}

impl std::fmt::Debug for HostKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostKey")
            .field("public", &self.public_line)
            .field("fingerprint", &self.fingerprint)
            .finish_non_exhaustive()
    }
}

impl HostKey {
    /// Mints a new ed25519 host key.
    pub fn generate() -> Result<HostKey, String> {
        let mut key = PrivateKey::random(&mut rand::rng(), Algorithm::Ed25519)
            .map_err(|e| format!("generate ed25519 host key: {e}"))?;
        key.set_comment("bigfleet-host");
        let private_pem = key
            .to_openssh(LineEnding::LF)
            .map_err(|e| format!("marshal host private key: {e}"))?;
        let public = PublicKey::new(key.public_key().key_data().clone(), "");
        let public_line = public
            .to_openssh()
            .map_err(|e| format!("marshal host public key: {e}"))?
            .trim()
            .to_owned();
        Ok(HostKey {
            fingerprint: fingerprint(&public),
            private_pem,
            public_line,
        })
    }

    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    pub fn public_line(&self) -> &str {
        &self.public_line
    }

    /// The `#cloud-config` document that makes cloud-init install this key as the server's
    /// ed25519 host key (it holds the private key, so it is zeroed on drop too).
    pub fn cloud_config(&self) -> Zeroizing<String> {
        let mut doc = Zeroizing::new(String::with_capacity(
            self.private_pem.len() * 2 + self.public_line.len() + 128,
        ));
        doc.push_str("#cloud-config\nssh_keys:\n  ed25519_private: |\n");
        for line in self.private_pem.lines() {
            doc.push_str("    ");
            doc.push_str(line);
            doc.push('\n');
        }
        doc.push_str("  ed25519_public: ");
        doc.push_str(&self.public_line);
        doc.push('\n');
        doc
    }
}

/// The pin format of a public key: lower-case unpadded base32 of SHA-256 over its wire form.
pub fn fingerprint(key: &PublicKey) -> String {
    base32(key.key_data().fingerprint(HashAlg::Sha256).as_bytes())
}

/// What to do with a presented host key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The key matches the pin.
    Pinned,
    /// No pin exists: trust on first use and record `observed`.
    FirstUse { observed: String },
    /// The key does not match the pin: refuse before sending anything.
    Mismatch { pinned: String, presented: String },
}

/// Judges `presented` against the server's pin, if it has one.
pub fn verify(pin: Option<&str>, presented: &PublicKey) -> Verdict {
    let observed = fingerprint(presented);
    match pin.filter(|p| !p.is_empty()) {
        None => Verdict::FirstUse { observed },
        Some(pinned) if pinned == observed => Verdict::Pinned,
        Some(pinned) => Verdict::Mismatch {
            pinned: pinned.to_owned(),
            presented: observed,
        },
    }
}

/// The error text of a refused host key (exactly the reference's wording).
pub fn mismatch_message(pinned: &str, presented: &str) -> String {
    format!(
        "host key mismatch: pinned \"{pinned}\", presented \"{presented}\" (possible MITM — refusing)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minted_keys_have_the_documented_shape() {
        let key = HostKey::generate().unwrap();
        assert!(key.public_line().starts_with("ssh-ed25519 AAAA"));
        assert_eq!(key.public_line().split(' ').count(), 2, "no comment");
        assert_eq!(key.fingerprint().len(), 52);
        assert!(
            key.fingerprint()
                .bytes()
                .all(|b| matches!(b, b'a'..=b'z' | b'2'..=b'7'))
        );
        let doc = key.cloud_config();
        assert!(doc.starts_with("#cloud-config\nssh_keys:\n  ed25519_private: |\n    -----BEGIN OPENSSH PRIVATE KEY-----\n"));
        assert!(doc.contains(&format!("\n  ed25519_public: {}\n", key.public_line())));
        let pem: String = doc
            .lines()
            .filter_map(|l| l.strip_prefix("    "))
            .map(|l| format!("{l}\n"))
            .collect();
        let parsed = PrivateKey::from_openssh(&pem).unwrap();
        assert_eq!(parsed.comment().to_string(), "bigfleet-host");
        assert_eq!(fingerprint(parsed.public_key()), key.fingerprint());
        assert_ne!(
            HostKey::generate().unwrap().fingerprint(),
            key.fingerprint()
        );
    }

    #[test]
    fn private_key_material_lives_in_buffers_zeroed_on_drop() {
        fn zeroed_on_drop<T: zeroize::ZeroizeOnDrop>(_: &T) {}
        let key = HostKey::generate().unwrap();
        zeroed_on_drop(&key.private_pem);
        let doc = key.cloud_config();
        zeroed_on_drop(&doc);
        assert!(doc.contains("PRIVATE KEY"));
    }

    #[test]
    fn fingerprint_is_sha256_of_the_wire_encoding() {
        use sha2::{Digest, Sha256};
        let key = HostKey::generate().unwrap();
        let public = PublicKey::from_openssh(key.public_line()).unwrap();
        let wire = public.to_bytes().unwrap();
        assert_eq!(fingerprint(&public), base32(&Sha256::digest(&wire)));
    }

    #[test]
    fn verdicts() {
        let key = HostKey::generate().unwrap();
        let public = PublicKey::from_openssh(key.public_line()).unwrap();
        assert_eq!(verify(Some(key.fingerprint()), &public), Verdict::Pinned);
        assert_eq!(
            verify(None, &public),
            Verdict::FirstUse {
                observed: key.fingerprint().to_owned()
            }
        );
        assert_eq!(
            verify(Some(""), &public),
            Verdict::FirstUse {
                observed: key.fingerprint().to_owned()
            }
        );
        let other = HostKey::generate().unwrap();
        let Verdict::Mismatch { pinned, presented } = verify(Some(other.fingerprint()), &public)
        else {
            panic!("expected a mismatch")
        };
        assert_eq!(
            mismatch_message(&pinned, &presented),
            format!(
                "host key mismatch: pinned \"{}\", presented \"{}\" (possible MITM — refusing)",
                other.fingerprint(),
                key.fingerprint()
            )
        );
    }
}

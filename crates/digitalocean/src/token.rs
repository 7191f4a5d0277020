//! Per-machine agent tokens: `base64url_nopad(HMAC-SHA256(secret, machine_id))`, re-derived on
//! every request (never stored) and compared in constant time. Neither the secret nor a token
//! is ever printed: their Debug output is `[redacted]`.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;
use zeroize::Zeroizing;

/// The HMAC key that mints agent tokens (`--bootstrap-secret` / `BIGFLEET_BOOTSTRAP_SECRET`),
/// used as the raw bytes of the configured string. Zeroed on drop.
#[derive(Clone)]
pub struct BootstrapSecret(Zeroizing<Vec<u8>>);

impl BootstrapSecret {
    /// `None` for an empty secret: an empty HMAC key would make every token guessable.
    pub fn new(secret: impl Into<String>) -> Option<BootstrapSecret> {
        let secret: String = secret.into();
        (!secret.is_empty()).then(|| BootstrapSecret(Zeroizing::new(secret.into_bytes())))
    }

    /// The bearer token of `machine_id`.
    pub fn token_for(&self, machine_id: &str) -> AgentToken {
        let mac = Zeroizing::new(self.mac(machine_id));
        AgentToken(Zeroizing::new(URL_SAFE_NO_PAD.encode(*mac)))
    }

    /// Whether `presented` is the token of `machine_id`, compared in constant time.
    pub fn verify(&self, machine_id: &str, presented: &str) -> bool {
        let expected = self.token_for(machine_id);
        // Lengths are public (always 43); only the content comparison must not leak timing.
        expected.0.as_bytes().ct_eq(presented.as_bytes()).into()
    }

    /// The one-time enrollment token written into the user_data of the Droplet the Create
    /// `create_operation` makes for `machine_id`: `e1.<base64url(operation id)>.<base64url(
    /// HMAC(secret, label, machine id, operation id))>`. Operation ids never repeat within a
    /// state, so a token issued for one Droplet of a slot is worth nothing for the next one.
    pub fn enrollment_token_for(&self, machine_id: &str, create_operation: &str) -> AgentToken {
        let mac = Zeroizing::new(self.enrollment_mac(machine_id, create_operation));
        AgentToken(Zeroizing::new(format!(
            "{ENROLLMENT_TOKEN_PREFIX}{}.{}",
            URL_SAFE_NO_PAD.encode(create_operation),
            URL_SAFE_NO_PAD.encode(*mac)
        )))
    }

    /// What `presented` proves for `machine_id`, checked in constant time: an enrollment token
    /// (and the Create it was issued for), or the older per-slot token of `token_for`.
    pub fn check_user_data_token(
        &self,
        machine_id: &str,
        presented: &str,
    ) -> Option<UserDataToken> {
        if let Some(rest) = presented.strip_prefix(ENROLLMENT_TOKEN_PREFIX) {
            let (operation, mac) = rest.split_once('.')?;
            let operation = String::from_utf8(URL_SAFE_NO_PAD.decode(operation).ok()?).ok()?;
            let expected =
                Zeroizing::new(URL_SAFE_NO_PAD.encode(self.enrollment_mac(machine_id, &operation)));
            let ok: bool = expected.as_bytes().ct_eq(mac.as_bytes()).into();
            return ok.then_some(UserDataToken::Enrollment {
                create_operation: operation,
            });
        }
        self.verify(machine_id, presented)
            .then_some(UserDataToken::PerSlot)
    }

    fn enrollment_mac(&self, machine_id: &str, create_operation: &str) -> [u8; 32] {
        let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(&self.0)
            .expect("HMAC accepts keys of any length");
        mac.update(b"bigfleet enrollment token\0");
        for part in [machine_id.as_bytes(), create_operation.as_bytes()] {
            mac.update(&(part.len() as u64).to_be_bytes());
            mac.update(part);
        }
        let mut out = [0u8; 32];
        out.copy_from_slice(&mac.finalize().into_bytes());
        out
    }

    /// A short keyed digest of `parts` (each length-prefixed, under a label no token input
    /// starts with), for names that must be stable across processes sharing this secret yet
    /// reveal nothing about what they digest to anyone without it.
    pub(crate) fn fingerprint(&self, parts: &[&[u8]]) -> [u8; 8] {
        let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(&self.0)
            .expect("HMAC accepts keys of any length");
        mac.update(b"bigfleet command fingerprint\0");
        for part in parts {
            mac.update(&(part.len() as u64).to_be_bytes());
            mac.update(part);
        }
        let digest = mac.finalize().into_bytes();
        let mut out = [0u8; 8];
        out.copy_from_slice(&digest[..8]);
        out
    }

    fn mac(&self, machine_id: &str) -> [u8; 32] {
        let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(&self.0)
            .expect("HMAC accepts keys of any length");
        mac.update(machine_id.as_bytes());
        let mut out = [0u8; 32];
        out.copy_from_slice(&mac.finalize().into_bytes());
        out
    }
}

impl std::fmt::Debug for BootstrapSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BootstrapSecret([redacted])")
    }
}

/// How an enrollment token starts (a per-slot token is plain base64url and holds no dot).
pub const ENROLLMENT_TOKEN_PREFIX: &str = "e1.";

/// What a valid user_data token is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UserDataToken {
    /// Issued for the Droplet of this Create (this version's user_data).
    Enrollment { create_operation: String },
    /// The older per-slot token, `HMAC(secret, machine id)`, of Droplets created before
    /// enrollment existed: bound to the slot only.
    PerSlot,
}

/// The digest the state keeps of an enrolled credential: SHA-256 over a label, the Droplet id
/// and the credential. The credential is 32 random bytes, so a fast digest is as strong as a
/// slow one, and the digest cannot be presented in its place.
pub fn credential_digest(host_id: &str, credential: &str) -> Vec<u8> {
    use sha2::Digest as _;
    let mut hash = Sha256::new();
    hash.update(b"bigfleet enrolled credential\0");
    hash.update((host_id.len() as u64).to_be_bytes());
    hash.update(host_id.as_bytes());
    hash.update(credential.as_bytes());
    hash.finalize().to_vec()
}

/// Whether `presented` is the credential whose digest is `digest` for `host_id`, in constant
/// time.
pub fn credential_matches(digest: &[u8], host_id: &str, presented: &str) -> bool {
    credential_digest(host_id, presented).ct_eq(digest).into()
}

/// A fresh credential for an agent to enroll with: 32 random bytes, base64url (43 characters).
pub fn new_credential() -> AgentToken {
    let mut bytes = Zeroizing::new([0u8; 32]);
    rand::Rng::fill_bytes(&mut rand::rng(), &mut bytes[..]);
    AgentToken(Zeroizing::new(URL_SAFE_NO_PAD.encode(*bytes)))
}

/// One machine's bearer token. Zeroed on drop.
#[derive(Clone, PartialEq, Eq)]
pub struct AgentToken(Zeroizing<String>);

impl AgentToken {
    /// Wraps a token read from the agent's config file.
    pub fn from_config(token: Zeroizing<String>) -> AgentToken {
        AgentToken(token)
    }

    /// The token text, for the `Authorization` header and the agent's config file only.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for AgentToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AgentToken([redacted])")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enrollment_tokens_are_bound_to_their_create() {
        let s = secret("secret");
        let a = s.enrollment_token_for("m-1", "op-7");
        assert!(a.expose().starts_with(ENROLLMENT_TOKEN_PREFIX));
        assert_eq!(
            s.check_user_data_token("m-1", a.expose()),
            Some(UserDataToken::Enrollment {
                create_operation: "op-7".into()
            })
        );
        // Another machine, another secret, a forged operation id: nothing.
        assert_eq!(s.check_user_data_token("m-2", a.expose()), None);
        assert_eq!(
            secret("other").check_user_data_token("m-1", a.expose()),
            None
        );
        let b = s.enrollment_token_for("m-1", "op-8");
        assert_ne!(a, b, "the next Droplet of the slot gets another token");
        let (_, mac_a) = a.expose().rsplit_once('.').unwrap();
        let forged = format!("e1.{}.{mac_a}", URL_SAFE_NO_PAD.encode("op-8"));
        assert_eq!(s.check_user_data_token("m-1", &forged), None);
        assert_eq!(s.check_user_data_token("m-1", "e1.garbage"), None);
        // The older per-slot token still verifies, as what it is.
        assert_eq!(
            s.check_user_data_token("m-1", s.token_for("m-1").expose()),
            Some(UserDataToken::PerSlot)
        );
    }

    #[test]
    fn credentials_are_bound_to_their_droplet() {
        let c = new_credential();
        assert_eq!(c.expose().len(), 43);
        assert_ne!(c, new_credential());
        let digest = credential_digest("42", c.expose());
        assert!(credential_matches(&digest, "42", c.expose()));
        assert!(!credential_matches(&digest, "43", c.expose()));
        assert!(!credential_matches(
            &digest,
            "42",
            new_credential().expose()
        ));
        assert!(
            !digest
                .windows(8)
                .any(|w| c.expose().as_bytes().windows(8).any(|x| x == w))
        );
    }

    fn secret(s: &str) -> BootstrapSecret {
        BootstrapSecret::new(s).expect("non-empty")
    }

    #[test]
    fn reference_vectors() {
        let s = secret("secret");
        assert_eq!(
            s.token_for("m-1").expose(),
            "RGyPhp3JM2vz25uzLTbRiiptVvpgYCMXhSNCnXL38y8"
        );
        assert_eq!(
            s.token_for("digitalocean/OnDemand/s-2vcpu-4gb/nyc3/000")
                .expose(),
            "afTCmBgInQfipXp_8xl2hGCXP2zhASAQR1A3nGrvyPc"
        );
    }

    #[test]
    fn per_machine_and_per_secret() {
        let a = secret("secret");
        let b = secret("other");
        assert_ne!(a.token_for("m-1"), a.token_for("m-2"));
        assert_ne!(a.token_for("m-1"), b.token_for("m-1"));
        assert_eq!(a.token_for("m-1"), a.token_for("m-1"));
        assert_eq!(a.token_for("m-1").expose().len(), 43);
    }

    #[test]
    fn verification() {
        let s = secret("secret");
        let t = s.token_for("m-1");
        assert!(s.verify("m-1", t.expose()));
        assert!(!s.verify("m-2", t.expose()));
        assert!(!s.verify("m-1", ""));
        assert!(!s.verify("m-1", &t.expose()[..42]));
        assert!(!s.verify("m-1", &format!("{}x", t.expose())));
        assert!(BootstrapSecret::new("").is_none());
    }

    #[test]
    fn never_printed() {
        let s = secret("hunter2");
        let t = s.token_for("m-1");
        assert!(!format!("{s:?}").contains("hunter2"));
        assert!(!format!("{t:?}").contains(t.expose()));
    }
}

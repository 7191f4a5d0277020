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

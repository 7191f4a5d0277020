//! How Droplets are named and tagged: ownership tags carry the machine id, the provider
//! instance and the cluster binding as lower-case unpadded base32 (DigitalOcean tag names allow
//! only `[A-Za-z0-9:_-]`), and the Droplet name is a hash of the machine id, so it is stable
//! across restarts and processes.

use sha2::{Digest, Sha256};

/// Every Droplet this provider creates carries this tag.
pub const MANAGED_TAG: &str = "bigfleet-managed";
/// Prefix of the machine-id tag.
pub const MACHINE_TAG_PREFIX: &str = "bfmid:";
/// Prefix of the cluster-binding tag (set after Configure, removed on Drain).
pub const CLUSTER_TAG_PREFIX: &str = "bfcluster:";
/// Prefix of the provider-instance tag (`--provider`).
pub const PROVIDER_TAG_PREFIX: &str = "bfprov:";
/// Every Droplet whose user_data carries a one-time enrollment token (`e1.`, bound to its
/// Create) carries this tag from its create on: the older per-slot token never enrolls or
/// authenticates for it. A Droplet without it was created by a provider before this tag
/// existed, and may carry a per-slot token.
pub const ENROLLMENT_TOKEN_TAG: &str = "bftoken:e1";

pub use provider_core::encoding::base32_lower;

/// Decodes [`base32_lower`] output (either case accepted); `None` when it is not valid base32
/// or not UTF-8.
pub fn base32_decode(text: &str) -> Option<String> {
    String::from_utf8(provider_core::encoding::base32_decode(text)?).ok()
}

pub fn machine_tag(machine_id: &str) -> String {
    format!(
        "{MACHINE_TAG_PREFIX}{}",
        base32_lower(machine_id.as_bytes())
    )
}

pub fn cluster_tag(cluster_id: &str) -> String {
    format!(
        "{CLUSTER_TAG_PREFIX}{}",
        base32_lower(cluster_id.as_bytes())
    )
}

pub fn provider_tag(provider: &str) -> String {
    format!("{PROVIDER_TAG_PREFIX}{}", base32_lower(provider.as_bytes()))
}

/// Prefix of the tag a Droplet of a provider instance carries from its create until it was
/// seen `active`.
pub const BOOTING_TAG_PREFIX: &str = "bfboot:";

/// The tag of provider instance `provider`'s booting Droplets: one listing of it polls every
/// Create in flight.
pub fn booting_tag(provider: &str) -> String {
    format!("{BOOTING_TAG_PREFIX}{}", base32_lower(provider.as_bytes()))
}

/// `bigfleet-` + base32 of SHA-256(machine id): 61 characters, stable for the machine.
pub fn droplet_name(machine_id: &str) -> String {
    format!(
        "bigfleet-{}",
        base32_lower(&Sha256::digest(machine_id.as_bytes()))
    )
}

/// The value of the first tag with `prefix`, decoded.
pub fn decode_tag(tags: &[String], prefix: &str) -> Option<String> {
    tags.iter()
        .find_map(|t| t.strip_prefix(prefix))
        .and_then(base32_decode)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_round_trip_and_stay_valid() {
        let id = "digitalocean/OnDemand/s-2vcpu-4gb/nyc3/000";
        let tag = machine_tag(id);
        assert!(tag.starts_with("bfmid:"));
        assert!(
            tag.bytes()
                .all(|c| c.is_ascii_alphanumeric() || b":_-".contains(&c))
        );
        assert_eq!(
            decode_tag(&[MANAGED_TAG.into(), tag], MACHINE_TAG_PREFIX).as_deref(),
            Some(id)
        );
        assert_eq!(
            decode_tag(&[cluster_tag("prod/eu")], CLUSTER_TAG_PREFIX).as_deref(),
            Some("prod/eu")
        );
        assert_eq!(provider_tag("digitalocean"), "bfprov:mruwo2lumfwg6y3fmfxa");
    }

    #[test]
    fn names_are_stable_hashes() {
        let name = droplet_name("digitalocean/OnDemand/s-2vcpu-4gb/nyc3/000");
        assert_eq!(name.len(), 61);
        assert_eq!(
            name,
            droplet_name("digitalocean/OnDemand/s-2vcpu-4gb/nyc3/000")
        );
        assert_ne!(
            name,
            droplet_name("digitalocean/OnDemand/s-2vcpu-4gb/nyc3/001")
        );
    }
}

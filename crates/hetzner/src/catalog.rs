//! The pinned Hetzner Cloud catalogue: on-demand EUR/hour prices and hardware capacities per
//! server type, used when the live ServerType API has not answered yet (cold price cache,
//! startup capacity lookup) and by the fake backend. Prices are **net** (VAT-exclusive) EUR per
//! hour, the same basis as the live price the real backend reads, so a warm and a cold cache
//! never disagree by VAT.

use provider_core::StringMap;
use provider_core::cloud::Capacity;

/// One row of the pinned table: server type, EUR/hour net, vCPUs, memory in GiB.
// ccx53's price happens to read like log10(2); it is a price, not that constant.
#[allow(clippy::approx_constant)]
const PINNED: &[(&str, f64, u32, u64)] = &[
    // CX: shared vCPU, Intel/AMD.
    ("cx22", 0.0060, 2, 4),
    ("cx32", 0.0113, 4, 8),
    ("cx42", 0.0273, 8, 16),
    ("cx52", 0.0540, 16, 32),
    // CPX: shared vCPU, AMD.
    ("cpx11", 0.0070, 2, 2),
    ("cpx21", 0.0120, 3, 4),
    ("cpx31", 0.0230, 4, 8),
    ("cpx41", 0.0440, 8, 16),
    ("cpx51", 0.0860, 16, 32),
    // CAX: shared vCPU, Ampere (arm64).
    ("cax11", 0.0059, 2, 4),
    ("cax21", 0.0110, 4, 8),
    ("cax31", 0.0220, 8, 16),
    ("cax41", 0.0430, 16, 32),
    // CCX: dedicated vCPU, AMD.
    ("ccx13", 0.0200, 2, 8),
    ("ccx23", 0.0390, 4, 16),
    ("ccx33", 0.0760, 8, 32),
    ("ccx43", 0.1510, 16, 64),
    ("ccx53", 0.3010, 32, 128),
    ("ccx63", 0.4510, 48, 192),
];

fn row(server_type: &str) -> Option<&'static (&'static str, f64, u32, u64)> {
    PINNED.iter().find(|(name, ..)| *name == server_type)
}

/// Every server type the pinned table knows, in table order.
pub fn pinned_server_types() -> impl Iterator<Item = &'static str> {
    PINNED.iter().map(|(name, ..)| *name)
}

/// The pinned net on-demand price in EUR per hour, location-agnostic (EU baseline).
pub fn pinned_price_eur(server_type: &str) -> Option<f64> {
    row(server_type).map(|(_, eur, ..)| *eur)
}

/// The pinned hardware capacity of a server type.
pub fn pinned_capacity(server_type: &str) -> Option<Capacity> {
    row(server_type).map(|(_, _, vcpus, gib)| Capacity {
        vcpus: *vcpus,
        memory_mib: gib * 1024,
    })
}

/// Labels every offering slot of this server type carries in addition to the offering's own:
/// the Ampere `cax*` family is arm64.
pub fn extra_labels(server_type: &str) -> StringMap {
    let mut labels = StringMap::new();
    if server_type.starts_with("cax") {
        labels.insert("kubernetes.io/arch".to_owned(), "arm64".to_owned());
    }
    labels
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_and_unknown_types() {
        assert_eq!(pinned_price_eur("cx22"), Some(0.0060));
        assert_eq!(pinned_price_eur("ccx63"), Some(0.4510));
        assert_eq!(pinned_price_eur("cx11"), None);
        assert_eq!(
            pinned_capacity("cx22"),
            Some(Capacity {
                vcpus: 2,
                memory_mib: 4096
            })
        );
        assert_eq!(
            pinned_capacity("cpx21"),
            Some(Capacity {
                vcpus: 3,
                memory_mib: 4096
            })
        );
        assert_eq!(pinned_capacity("nope"), None);
        assert_eq!(pinned_server_types().count(), 19);
    }

    #[test]
    fn arm_family_is_labelled() {
        assert_eq!(
            extra_labels("cax21")
                .get("kubernetes.io/arch")
                .map(String::as_str),
            Some("arm64")
        );
        assert!(extra_labels("cx22").is_empty());
        assert!(extra_labels("ccx13").is_empty());
    }

    #[test]
    fn every_row_has_a_price_and_a_capacity() {
        for name in pinned_server_types() {
            assert!(pinned_price_eur(name).is_some_and(|p| p > 0.0), "{name}");
            assert!(
                pinned_capacity(name).is_some_and(|c| c.vcpus > 0 && c.memory_mib > 0),
                "{name}"
            );
        }
    }
}

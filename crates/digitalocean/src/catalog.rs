//! The pinned DigitalOcean size catalogue: on-demand USD/hour prices and vCPU/memory per size
//! slug. Used as the fallback before (or when) the live `/v2/sizes` catalogue answers, and by
//! the fake backend. DigitalOcean prices a size identically in every region.

use provider_core::cloud::Capacity;

/// One pinned size: slug, USD per hour, vCPUs, memory in GiB.
struct PinnedSize {
    slug: &'static str,
    usd_hourly: f64,
    vcpus: u32,
    memory_gib: u64,
}

const fn size(slug: &'static str, usd_hourly: f64, vcpus: u32, memory_gib: u64) -> PinnedSize {
    PinnedSize {
        slug,
        usd_hourly,
        vcpus,
        memory_gib,
    }
}

/// Basic, General Purpose, CPU-Optimized and Memory-Optimized Droplets.
const PINNED: &[PinnedSize] = &[
    size("s-1vcpu-1gb", 0.00744, 1, 1),
    size("s-1vcpu-2gb", 0.01488, 1, 2),
    size("s-2vcpu-2gb", 0.01935, 2, 2),
    size("s-2vcpu-4gb", 0.03571, 2, 4),
    size("s-4vcpu-8gb", 0.07143, 4, 8),
    size("s-8vcpu-16gb", 0.14286, 8, 16),
    size("g-2vcpu-8gb", 0.09226, 2, 8),
    size("g-4vcpu-16gb", 0.18452, 4, 16),
    size("g-8vcpu-32gb", 0.36905, 8, 32),
    size("g-16vcpu-64gb", 0.73810, 16, 64),
    size("c-2", 0.06250, 2, 4),
    size("c-4", 0.12500, 4, 8),
    size("c-8", 0.25000, 8, 16),
    size("c-16", 0.50000, 16, 32),
    size("m-2vcpu-16gb", 0.13393, 2, 16),
    size("m-4vcpu-32gb", 0.26786, 4, 32),
    size("m-8vcpu-64gb", 0.53571, 8, 64),
    size("m-16vcpu-128gb", 1.07143, 16, 128),
];

fn pinned(slug: &str) -> Option<&'static PinnedSize> {
    PINNED.iter().find(|s| s.slug == slug)
}

/// The pinned on-demand price of a size in USD per hour; `None` for a size not in the table.
pub fn pinned_price_usd(slug: &str) -> Option<f64> {
    pinned(slug).map(|s| s.usd_hourly)
}

/// The pinned vCPUs and memory of a size; `None` for a size not in the table.
pub fn pinned_capacity(slug: &str) -> Option<Capacity> {
    pinned(slug).map(|s| Capacity::compute(s.vcpus, s.memory_gib * 1024))
}

/// Every pinned size slug, in table order.
pub fn pinned_sizes() -> impl Iterator<Item = &'static str> {
    PINNED.iter().map(|s| s.slug)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinned_prices() {
        assert_eq!(pinned_price_usd("s-2vcpu-4gb"), Some(0.03571));
        assert_eq!(pinned_price_usd("g-16vcpu-64gb"), Some(0.73810));
        assert_eq!(pinned_price_usd("c-2"), Some(0.0625));
        assert_eq!(pinned_price_usd("m-16vcpu-128gb"), Some(1.07143));
        assert_eq!(pinned_price_usd("s-1vcpu-512mb-10gb"), None);
        assert_eq!(pinned_sizes().count(), 18);
    }

    #[test]
    fn pinned_capacities() {
        assert_eq!(
            pinned_capacity("s-4vcpu-8gb"),
            Some(Capacity::compute(4, 8192))
        );
        assert_eq!(
            pinned_capacity("c-16"),
            Some(Capacity::compute(16, 32 * 1024))
        );
        assert_eq!(
            pinned_capacity("s-1vcpu-1gb"),
            Some(Capacity::compute(1, 1024))
        );
        assert_eq!(pinned_capacity("gpu-h100x1-80gb"), None);
        for slug in pinned_sizes() {
            assert!(pinned_price_usd(slug).is_some_and(|p| p > 0.0), "{slug}");
            assert!(pinned_capacity(slug).is_some(), "{slug}");
        }
    }
}

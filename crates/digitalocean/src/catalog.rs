//! The DigitalOcean size catalogue: what a size is, what it costs and where it can be ordered,
//! read from `GET /v2/sizes` (vCPUs, memory, disk, hourly price, `available` and the `regions`
//! it is sold in) and `GET /v2/regions` (`available`: whether a region takes new Droplets). A
//! size the API describes needs no entry here.
//!
//! The pinned table below is only for where no API answers: the fake backend, and a first start
//! while the API is down (until the first catalogue read replaces it). DigitalOcean prices a
//! size identically in every region.

use provider_core::catalogue::{Catalogue, Entry, Standing};
use provider_core::cloud::{Arch, Capacity};
use provider_core::offerings::Offering;

use crate::api::{Region, Size};

/// The sizes of the built-in default mix.
pub const DEFAULT_MIX: [&str; 2] = ["s-2vcpu-4gb", "s-4vcpu-8gb"];

/// One pinned size: slug, USD per hour, vCPUs, memory in GiB, disk in GB.
struct PinnedSize {
    slug: &'static str,
    usd_hourly: f64,
    vcpus: u32,
    memory_gib: u64,
    disk_gb: u64,
}

const fn size(
    slug: &'static str,
    usd_hourly: f64,
    vcpus: u32,
    memory_gib: u64,
    disk_gb: u64,
) -> PinnedSize {
    PinnedSize {
        slug,
        usd_hourly,
        vcpus,
        memory_gib,
        disk_gb,
    }
}

/// Basic (regular), General Purpose, CPU-Optimized and Memory-Optimized Droplets as
/// DigitalOcean sells them in 2026: sizes from `GET /v2/sizes`, hourly prices its list prices
/// (monthly / 672) as of 2026-07. Droplets are x86-64.
const PINNED: &[PinnedSize] = &[
    size("s-1vcpu-1gb", 0.00893, 1, 1, 25),
    size("s-1vcpu-2gb", 0.01786, 1, 2, 50),
    size("s-2vcpu-2gb", 0.02679, 2, 2, 60),
    size("s-2vcpu-4gb", 0.03571, 2, 4, 80),
    size("s-4vcpu-8gb", 0.07143, 4, 8, 160),
    size("s-8vcpu-16gb", 0.14286, 8, 16, 320),
    size("g-2vcpu-8gb", 0.09375, 2, 8, 25),
    size("g-4vcpu-16gb", 0.18750, 4, 16, 50),
    size("g-8vcpu-32gb", 0.37500, 8, 32, 100),
    size("g-16vcpu-64gb", 0.75000, 16, 64, 200),
    size("c-2", 0.06250, 2, 4, 25),
    size("c-4", 0.12500, 4, 8, 50),
    size("c-8", 0.25000, 8, 16, 100),
    size("c-16", 0.50000, 16, 32, 200),
    size("m-2vcpu-16gb", 0.12500, 2, 16, 50),
    size("m-4vcpu-32gb", 0.25000, 4, 32, 100),
    size("m-8vcpu-64gb", 0.50000, 8, 64, 200),
    size("m-16vcpu-128gb", 1.00000, 16, 128, 400),
];

fn pinned(slug: &str) -> Option<&'static PinnedSize> {
    PINNED.iter().find(|s| s.slug == slug)
}

/// The pinned on-demand price of a size in USD per hour; `None` for a size not in the table.
pub fn pinned_price_usd(slug: &str) -> Option<f64> {
    pinned(slug).map(|s| s.usd_hourly)
}

/// The pinned capacity of a size; `None` for a size not in the table.
pub fn pinned_capacity(slug: &str) -> Option<Capacity> {
    pinned(slug).map(|s| Capacity {
        vcpus: s.vcpus,
        memory_mib: s.memory_gib * 1024,
        disk_gib: s.disk_gb,
        arch: Some(Arch::Amd64),
    })
}

/// Every pinned size slug, in table order.
pub fn pinned_sizes() -> impl Iterator<Item = &'static str> {
    PINNED.iter().map(|s| s.slug)
}

/// A size's capacity as the API describes it (memory in MB, used as MiB as DigitalOcean's own
/// tooling does; disk in GB); `None` without vCPUs or memory. The API has no architecture
/// field: Droplets are x86-64.
pub fn capacity(size: &Size) -> Option<Capacity> {
    (size.vcpus > 0 && size.memory > 0).then_some(Capacity {
        vcpus: size.vcpus,
        memory_mib: size.memory,
        disk_gib: size.disk,
        arch: Some(Arch::Amd64),
    })
}

/// Where `size` stands in `region`: whether DigitalOcean sells it there now.
pub fn standing(sizes: &[Size], regions: &[Region], slug: &str, region: &str) -> Standing {
    let Some(size) = sizes.iter().find(|s| s.slug == slug) else {
        return Standing::unavailable(format!("the API lists no size {slug}"));
    };
    if !size.available {
        return Standing::unavailable(format!("size {slug} is not available for new Droplets"));
    }
    if !size.regions.iter().any(|r| r == region) {
        return Standing::unavailable(format!("size {slug} is not available in region {region}"));
    }
    if regions
        .iter()
        .find(|r| r.slug == region)
        .is_some_and(|r| !r.available)
    {
        return Standing::unavailable(format!("region {region} takes no new Droplets"));
    }
    Standing::available()
}

/// The catalogue of the offered `(size, region)` pairs from one read of sizes and regions.
pub fn catalogue(sizes: &[Size], regions: &[Region], pairs: &[(String, String)]) -> Catalogue {
    Catalogue {
        capacities: sizes
            .iter()
            .filter_map(|s| Some((s.slug.clone(), capacity(s)?)))
            .collect(),
        entries: pairs
            .iter()
            .map(|(slug, region)| {
                let price_usd = sizes
                    .iter()
                    .find(|s| &s.slug == slug)
                    .map(|s| s.price_hourly)
                    .filter(|p| p.is_finite() && *p > 0.0);
                let entry = Entry {
                    price_usd,
                    standing: standing(sizes, regions, slug, region),
                };
                ((slug.clone(), region.clone()), entry)
            })
            .collect(),
    }
}

/// The family of a slug: what comes before its first `-` (`s`, `g`, `c`, `m`, `gd`, ...).
fn family(slug: &str) -> &str {
    slug.split('-').next().unwrap_or(slug)
}

/// The successor of `old` in `region`: the cheapest size of its family sold there now with at
/// least its vCPUs and memory.
pub fn successor<'a>(
    sizes: &'a [Size],
    regions: &[Region],
    old: &Size,
    region: &str,
) -> Option<&'a Size> {
    sizes
        .iter()
        .filter(|s| s.slug != old.slug && family(&s.slug) == family(&old.slug))
        .filter(|s| s.vcpus >= old.vcpus && s.memory >= old.memory && s.price_hourly > 0.0)
        .filter(|s| standing(sizes, regions, &s.slug, region).available)
        .min_by(|a, b| {
            a.price_hourly
                .total_cmp(&b.price_hourly)
                .then(a.slug.cmp(&b.slug))
        })
}

/// Checks the default mix against the catalogue: a size DigitalOcean does not sell in its region
/// now is replaced by its successor there; without one it stays and is withdrawn. Returns
/// `(region, from, to, why)` for each change.
pub fn revise_default_mix(
    offerings: &mut [Offering],
    sizes: &[Size],
    regions: &[Region],
) -> Vec<(String, String, Option<String>, String)> {
    let mut revisions = Vec::new();
    for offering in offerings.iter_mut() {
        let standing = standing(sizes, regions, &offering.instance_type, &offering.zone);
        if standing.available {
            continue;
        }
        let to = sizes
            .iter()
            .find(|s| s.slug == offering.instance_type)
            .and_then(|old| successor(sizes, regions, old, &offering.zone))
            .map(|s| s.slug.clone());
        revisions.push((
            offering.zone.clone(),
            offering.instance_type.clone(),
            to.clone(),
            standing.why,
        ));
        if let Some(to) = to {
            offering.instance_type = to;
        }
    }
    revisions
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinned_prices() {
        assert_eq!(pinned_price_usd("s-2vcpu-4gb"), Some(0.03571));
        assert_eq!(pinned_price_usd("g-16vcpu-64gb"), Some(0.75));
        assert_eq!(pinned_price_usd("c-2"), Some(0.0625));
        assert_eq!(pinned_price_usd("m-16vcpu-128gb"), Some(1.0));
        assert_eq!(pinned_price_usd("s-1vcpu-512mb-10gb"), None);
        assert_eq!(pinned_sizes().count(), 18);
    }

    #[test]
    fn pinned_capacities() {
        assert_eq!(
            pinned_capacity("s-4vcpu-8gb"),
            Some(Capacity {
                vcpus: 4,
                memory_mib: 8192,
                disk_gib: 160,
                arch: Some(Arch::Amd64),
            })
        );
        assert_eq!(
            pinned_capacity("c-16").map(|c| c.memory_mib),
            Some(32 * 1024)
        );
        assert_eq!(pinned_capacity("s-1vcpu-1gb").map(|c| c.vcpus), Some(1));
        assert_eq!(pinned_capacity("gpu-h100x1-80gb"), None);
        for slug in pinned_sizes() {
            assert!(pinned_price_usd(slug).is_some_and(|p| p > 0.0), "{slug}");
            assert!(pinned_capacity(slug).is_some(), "{slug}");
        }
    }

    fn api_size(slug: &str, vcpus: u32, memory: u64, price: f64, regions: &[&str]) -> Size {
        Size {
            slug: slug.into(),
            memory,
            vcpus,
            disk: 80,
            price_hourly: price,
            available: true,
            regions: regions.iter().map(|r| (*r).to_owned()).collect(),
        }
    }

    #[test]
    fn standings_and_successors_follow_sizes_and_regions() {
        let mut retired = api_size("s-2vcpu-4gb", 2, 4096, 0.03571, &["nyc3"]);
        retired.available = false;
        let sizes = vec![
            retired,
            api_size("s-2vcpu-4gb-amd", 2, 4096, 0.03869, &["nyc3", "ams3"]),
            api_size("s-2vcpu-8gb-amd", 2, 8192, 0.0625, &["nyc3"]),
            api_size("s-4vcpu-8gb", 4, 8192, 0.07143, &["ams3"]),
            api_size("c-2", 2, 4096, 0.0625, &["nyc3"]),
        ];
        let regions = vec![
            Region {
                slug: "nyc3".into(),
                available: true,
                sizes: Vec::new(),
            },
            Region {
                slug: "sfo2".into(),
                available: false,
                sizes: Vec::new(),
            },
        ];
        assert!(standing(&sizes, &regions, "s-2vcpu-4gb-amd", "nyc3").available);
        assert_eq!(
            standing(&sizes, &regions, "s-4vcpu-8gb", "nyc3").why,
            "size s-4vcpu-8gb is not available in region nyc3"
        );
        assert_eq!(
            standing(&sizes, &regions, "s-2vcpu-4gb", "nyc3").why,
            "size s-2vcpu-4gb is not available for new Droplets"
        );
        assert_eq!(
            standing(&sizes, &regions, "s-9", "nyc3").why,
            "the API lists no size s-9"
        );
        let mut offerings = provider_core::offerings::default_mix(4, DEFAULT_MIX, ["nyc3", "nyc3"]);
        offerings.truncate(2);
        let revisions = revise_default_mix(&mut offerings, &sizes, &regions);
        // The cheapest Basic size sold in nyc3 with 2 vCPUs and 4 GB; c-2 is another family.
        assert_eq!(offerings[0].instance_type, "s-2vcpu-4gb-amd");
        // s-4vcpu-8gb is not sold in nyc3 and no larger Basic size is: kept, withdrawn.
        assert_eq!(offerings[1].instance_type, "s-4vcpu-8gb");
        assert_eq!(revisions.len(), 2);
        assert_eq!(revisions[1].2, None);
        let catalogue = catalogue(
            &sizes,
            &regions,
            &[("s-2vcpu-8gb-amd".to_owned(), "nyc3".to_owned())],
        );
        assert_eq!(
            catalogue.capacities["s-2vcpu-8gb-amd"].resources()["ephemeral-storage"],
            "80Gi"
        );
        let entry = &catalogue.entries[&("s-2vcpu-8gb-amd".to_owned(), "nyc3".to_owned())];
        assert_eq!(entry.price_usd, Some(0.0625));
        assert!(entry.standing.available);
    }
}

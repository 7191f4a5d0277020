//! The last known live prices and capacities, kept beside the local state (`catalog.json` in the
//! `--state` directory) so that a restart serves at once from them and refreshes from the cloud
//! in the background, instead of waiting on the cloud before the port binds (a restart during a
//! long 429 storm). A first start, or one whose file is missing or unreadable, warms up from the
//! cloud first, as before.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::provisioning::catalogue::Standing;
use crate::provisioning::cloud::{Arch, Capacity};
use crate::provisioning::fleet::Fleet;

/// The file's name inside the state directory (not a state file: the store ignores it).
pub const FILE_NAME: &str = "catalog.json";

#[derive(Debug, Default, PartialEq, Serialize, Deserialize)]
struct Saved {
    /// When it was written, seconds since the Unix epoch (for operators reading it).
    saved_unix: u64,
    prices: Vec<SavedPrice>,
    capacities: Vec<SavedCapacity>,
    /// Where each offered pair stood in the cloud's catalogue (absent in older files).
    #[serde(default)]
    standings: Vec<SavedStanding>,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct SavedStanding {
    instance_type: String,
    zone: String,
    #[serde(flatten)]
    standing: Standing,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct SavedPrice {
    instance_type: String,
    zone: String,
    usd_per_hour: f64,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct SavedCapacity {
    instance_type: String,
    vcpus: u32,
    memory_mib: u64,
    #[serde(default)]
    disk_gib: u64,
    #[serde(default)]
    arch: Option<Arch>,
}

/// Writes `bytes` to `path` atomically, for the files kept beside a local state: a temporary
/// file beside it, synced, then renamed over the old one (a crash leaves the old file or the
/// new one, never half of either).
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let temporary = path.with_extension("json.tmp");
    std::fs::write(&temporary, bytes)?;
    std::fs::File::open(&temporary)?.sync_all()?;
    std::fs::rename(&temporary, path)
}

/// Where the catalogue of one provider is kept: `None` without a local state directory (in
/// memory, or in etcd, where standbys warm up before they may lead anyway).
#[derive(Clone, Debug)]
pub struct PriceCache {
    path: PathBuf,
}

impl PriceCache {
    pub fn for_state(state: &str) -> Option<PriceCache> {
        if state.is_empty() || crate::runtime::etcd::is_etcd(state) {
            return None;
        }
        Some(PriceCache {
            path: Path::new(state).join(FILE_NAME),
        })
    }

    /// Loads the saved catalogue into `fleet`. Returns whether every offered pair now has a
    /// price (live or pinned), so the provider may serve before refreshing.
    pub fn restore(&self, fleet: &Fleet) -> bool {
        let bytes = match std::fs::read(&self.path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return false,
            Err(e) => {
                tracing::warn!(file = %self.path.display(), error = %e, "pricing: cannot read the saved catalogue; warming up from the cloud");
                return false;
            }
        };
        let saved: Saved = match serde_json::from_slice(&bytes) {
            Ok(saved) => saved,
            Err(e) => {
                tracing::warn!(file = %self.path.display(), error = %e, "pricing: the saved catalogue does not parse; warming up from the cloud");
                return false;
            }
        };
        fleet.prices().restore(
            saved
                .prices
                .into_iter()
                .filter(|p| p.usd_per_hour.is_finite() && p.usd_per_hour >= 0.0)
                .map(|p| ((p.instance_type, p.zone), p.usd_per_hour)),
        );
        fleet
            .capacities()
            .restore(saved.capacities.into_iter().map(|c| {
                (
                    c.instance_type,
                    Capacity {
                        vcpus: c.vcpus,
                        memory_mib: c.memory_mib,
                        disk_gib: c.disk_gib,
                        arch: c.arch,
                    },
                )
            }));
        fleet.standings().extend(
            saved
                .standings
                .into_iter()
                .map(|s| ((s.instance_type, s.zone), s.standing)),
        );
        fleet.unpriced().is_empty()
    }

    /// Writes what `fleet` knows now, atomically (a crash leaves the previous file or the new
    /// one). Failures are logged: the file only speeds up the next start.
    pub fn save(&self, fleet: &Fleet) {
        let mut saved = Saved {
            saved_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            prices: fleet
                .prices()
                .live()
                .into_iter()
                .map(|((instance_type, zone), usd_per_hour)| SavedPrice {
                    instance_type,
                    zone,
                    usd_per_hour,
                })
                .collect(),
            capacities: fleet
                .capacities()
                .live()
                .into_iter()
                .map(|(instance_type, c)| SavedCapacity {
                    instance_type,
                    vcpus: c.vcpus,
                    memory_mib: c.memory_mib,
                    disk_gib: c.disk_gib,
                    arch: c.arch,
                })
                .collect(),
            standings: fleet
                .standings()
                .all()
                .into_iter()
                .map(|((instance_type, zone), standing)| SavedStanding {
                    instance_type,
                    zone,
                    standing,
                })
                .collect(),
        };
        saved
            .prices
            .sort_by(|a, b| (&a.instance_type, &a.zone).cmp(&(&b.instance_type, &b.zone)));
        saved
            .capacities
            .sort_by(|a, b| a.instance_type.cmp(&b.instance_type));
        let result = serde_json::to_vec_pretty(&saved)
            .map_err(std::io::Error::other)
            .and_then(|bytes| {
                let dir = self.path.parent().unwrap_or(Path::new("."));
                crate::persistence::durable::write_file_atomically(dir, FILE_NAME, &bytes)
            });
        if let Err(e) = result {
            tracing::warn!(file = %self.path.display(), error = %e, "pricing: cannot save the catalogue for the next start");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::persistence::store::Store;
    use crate::provisioning::fake::{FakeCloud, FakeCloudProfile};
    use crate::provisioning::fleet::{CapacityBook, PriceBook};
    use crate::rules::machine::StringMap;

    /// A fleet whose types have no pinned price: only a live or saved one prices them.
    fn unpinned_fleet() -> Fleet {
        let cloud = Arc::new(FakeCloud::new(FakeCloudProfile {
            name: "fake",
            host_noun: "server",
            id_base: 0,
            ip_prefix: "192.0.2",
            price_usd: 0.25,
            latency: Duration::ZERO,
            capacity: |_| {
                Some(Capacity {
                    vcpus: 4,
                    memory_mib: 8192,
                    disk_gib: 160,
                    arch: Some(Arch::Amd64),
                })
            },
        }));
        Fleet::new(
            cloud,
            "p",
            crate::provisioning::offerings::default_mix(4, ["cx22", "cx32"], ["nbg1", "fsn1"]),
            Arc::new(PriceBook::new(|_, _| None)),
            Arc::new(CapacityBook::new(|_| None)),
            |_| StringMap::new(),
        )
    }

    #[tokio::test]
    async fn a_restart_prices_every_offering_from_what_the_last_run_saved() {
        let dir = tempfile::tempdir().expect("dir");
        let state = dir.path().join("state");
        let cache = PriceCache::for_state(state.to_str().expect("utf-8")).expect("local state");
        let first = unpinned_fleet();
        assert!(!cache.restore(&first), "nothing saved yet");
        assert!(!first.unpriced().is_empty());
        // The state directory the store creates holds the file; the store ignores it.
        let store = crate::persistence::durable::DurableStore::open(&state).expect("open state");
        store.load().expect("load");
        assert!(
            first
                .prices()
                .refresh(&**first.cloud(), &first.price_pairs())
                .await
                .is_empty()
        );
        first
            .capacities()
            .resolve(&**first.cloud(), &first.instance_types())
            .await
            .expect("resolve");
        cache.save(&first);
        drop(store);
        let store = crate::persistence::durable::DurableStore::open(&state).expect("reopen state");
        store
            .load()
            .expect("the saved catalogue is not taken for a state file");

        let restarted = unpinned_fleet();
        assert!(
            cache.restore(&restarted),
            "every offering priced from the file"
        );
        assert_eq!(restarted.prices().price("cx22", "nbg1"), Some(0.25));
        assert_eq!(restarted.capacities().allocatable("cx32")["memory"], "8Gi");
    }

    #[test]
    fn a_damaged_file_means_a_warm_up_from_the_cloud() {
        let dir = tempfile::tempdir().expect("dir");
        let cache = PriceCache::for_state(dir.path().to_str().expect("utf-8")).expect("local");
        std::fs::write(dir.path().join(FILE_NAME), b"{\"prices\": [tru").expect("write");
        assert!(!cache.restore(&unpinned_fleet()));
        assert!(PriceCache::for_state("").is_none());
        assert!(PriceCache::for_state("etcd://127.0.0.1:2379/p").is_none());
    }
}

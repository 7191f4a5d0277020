//! The offerings' Droplet settings as the startup look-ups resolved them (each size's
//! [`DropletProfile`]: image, VPC, tags, IPv6, monitoring, login keys), kept beside a local
//! state as `profiles.json`, so that a restart serves at once from them instead of waiting on
//! the API before any port binds (a restart in a long 429 storm), and the API budget is not
//! spent again on answers that rarely change. They are looked up again at the price-refresh
//! cadence ([`ProfileBook::refresh`]): a refresh that fails keeps the profiles in use, one that
//! finds them changed installs them for later Creates and saves them.
//!
//! The file is used only when it was written for the same settings, API endpoint and token (a
//! digest of all three is stored, never the token); any other file, or one that does not parse,
//! is ignored and the provider looks up from the API as on a first start (the envelope and
//! those rules are [`provider_core::saved_lookups`], which the Hetzner provider shares).
//!
//! A start from the file makes no API call at all before it serves, the token check
//! (`GET /v2/account`) included, as the Hetzner provider makes none with its saved plans: the
//! file stands only for the token it was looked up with, and a token revoked since then fails
//! the first refresh (right after serving, when prices come from `catalog.json` too) and every
//! call, with DigitalOcean's answer.

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use provider_core::saved_lookups::SavedLookups;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::api::{ApiClient, ImageRef, SshKeyRef};
use crate::profile::{DropletProfile, Wanted};

/// The file's name inside the state directory (not a state file: the store ignores it).
pub const FILE_NAME: &str = "profiles.json";

/// What log lines call the file's contents.
const WHAT: &str = "Droplet settings";

/// How long a refresh's look-ups may take, retries included: as long as the startup checks.
const REFRESH_BUDGET: std::time::Duration = std::time::Duration::from_secs(60);

/// What the file holds besides the envelope of [`SavedLookups`] (when it was written, the
/// fingerprint). Its own names, independent of the API's models.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Saved {
    /// Sorted by size, so that the same profiles always make the same file.
    profiles: Vec<SavedProfile>,
}

/// The on-disk form of one size's [`DropletProfile`].
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct SavedProfile {
    size: String,
    image: SavedImage,
    vpc_uuid: Option<String>,
    tags: Vec<String>,
    ipv6: bool,
    monitoring: bool,
    ssh_keys: Vec<SavedKey>,
}

/// `{"id": 160000001}` or `{"slug": "ubuntu-24-04-x64"}`.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum SavedImage {
    Id(i64),
    Slug(String),
}

/// `{"id": 512189}` or `{"fingerprint": "3b:16:…"}`.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum SavedKey {
    Id(u64),
    Fingerprint(String),
}

impl SavedProfile {
    fn of(size: &str, profile: &DropletProfile) -> SavedProfile {
        SavedProfile {
            size: size.to_owned(),
            image: match &profile.image {
                ImageRef::Id(id) => SavedImage::Id(*id),
                ImageRef::Slug(slug) => SavedImage::Slug(slug.clone()),
            },
            vpc_uuid: profile.vpc_uuid.clone(),
            tags: profile.tags.clone(),
            ipv6: profile.ipv6,
            monitoring: profile.monitoring,
            ssh_keys: profile
                .ssh_keys
                .iter()
                .map(|key| match key {
                    SshKeyRef::Id(id) => SavedKey::Id(*id),
                    SshKeyRef::Fingerprint(fp) => SavedKey::Fingerprint(fp.clone()),
                })
                .collect(),
        }
    }

    fn into_profile(self) -> (String, DropletProfile) {
        let profile = DropletProfile {
            image: match self.image {
                SavedImage::Id(id) => ImageRef::Id(id),
                SavedImage::Slug(slug) => ImageRef::Slug(slug),
            },
            vpc_uuid: self.vpc_uuid,
            tags: self.tags,
            ipv6: self.ipv6,
            monitoring: self.monitoring,
            ssh_keys: self
                .ssh_keys
                .into_iter()
                .map(|key| match key {
                    SavedKey::Id(id) => SshKeyRef::Id(id),
                    SavedKey::Fingerprint(fp) => SshKeyRef::Fingerprint(fp),
                })
                .collect(),
        };
        (self.size, profile)
    }
}

/// The API the profiles were looked up against, as the fingerprint takes it: a digest of the
/// endpoint and the token, so that the token itself is not kept for it.
#[derive(Clone)]
pub(crate) struct Account {
    digest: String,
}

impl Account {
    pub(crate) fn new(endpoint: &str, token: &str) -> Account {
        Account {
            digest: provider_core::saved_lookups::fingerprint(
                "bigfleet digitalocean account v1",
                &[endpoint, token],
            ),
        }
    }
}

impl std::fmt::Debug for Account {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Account([redacted])")
    }
}

/// The digest a saved file must carry to be used: the offerings' settings (their `Debug` form,
/// which holds every field, the region included) and the account (endpoint and token).
fn fingerprint(wanted: &[Wanted], account: &Account) -> String {
    provider_core::saved_lookups::fingerprint(
        "bigfleet digitalocean profiles v1",
        &[&format!("{wanted:?}"), &account.digest],
    )
}

/// Where the profiles of one provider are kept between runs.
#[derive(Clone, Debug)]
pub(crate) struct ProfileFile {
    saved: SavedLookups,
}

impl ProfileFile {
    /// `profiles.json` in a local state directory; `None` without one (in memory, or in etcd,
    /// where standbys look up before they may lead anyway).
    pub(crate) fn for_state(state: &str) -> Option<ProfileFile> {
        SavedLookups::for_state(state, FILE_NAME, WHAT).map(|saved| ProfileFile { saved })
    }

    #[cfg(test)]
    fn at(path: PathBuf) -> ProfileFile {
        ProfileFile {
            saved: SavedLookups::at(path, WHAT),
        }
    }

    fn path(&self) -> PathBuf {
        self.saved.path().to_owned()
    }

    /// The saved profiles by size, if the file exists, parses, was written for `fingerprint`
    /// and names each size once.
    fn load(&self, fingerprint: &str) -> Option<HashMap<String, DropletProfile>> {
        let saved: Saved = self.saved.load(fingerprint)?;
        let count = saved.profiles.len();
        let profiles: HashMap<String, DropletProfile> = saved
            .profiles
            .into_iter()
            .map(SavedProfile::into_profile)
            .collect();
        if profiles.len() != count {
            tracing::warn!(file = %self.path().display(), "settings: the saved Droplet settings name a size twice; resolving them from the API");
            return None;
        }
        Some(profiles)
    }

    /// Writes `profiles` atomically; false (and a WARN) when that failed.
    fn save(&self, fingerprint: &str, profiles: &HashMap<String, DropletProfile>) -> bool {
        let mut sizes: Vec<&String> = profiles.keys().collect();
        sizes.sort();
        let saved = Saved {
            profiles: sizes
                .into_iter()
                .map(|size| SavedProfile::of(size, &profiles[size]))
                .collect(),
        };
        self.saved.save(fingerprint, &saved)
    }
}

/// What Creates send per size, replaced while serving when a refresh finds it changed (a
/// Create in flight keeps the profile it took).
pub struct ProfileBook {
    current: RwLock<Arc<HashMap<String, DropletProfile>>>,
    /// `None` for profiles given as they are (no look-up, nothing to refresh).
    lookups: Option<Lookups>,
}

/// How the profiles were looked up, to do it again and keep the result.
struct Lookups {
    wanted: Vec<Wanted>,
    fingerprint: String,
    file: Option<ProfileFile>,
    /// Whether the file holds the profiles in use (a save that failed is tried again).
    saved: AtomicBool,
}

impl std::fmt::Debug for ProfileBook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut sizes: Vec<String> = self.profiles().keys().cloned().collect();
        sizes.sort();
        f.debug_struct("ProfileBook")
            .field("sizes", &sizes)
            .field(
                "file",
                &self
                    .lookups
                    .as_ref()
                    .and_then(|l| l.file.as_ref())
                    .map(ProfileFile::path),
            )
            .finish()
    }
}

impl ProfileBook {
    /// These profiles, never looked up again.
    pub fn fixed(profiles: HashMap<String, DropletProfile>) -> ProfileBook {
        ProfileBook {
            current: RwLock::new(Arc::new(profiles)),
            lookups: None,
        }
    }

    /// The profiles of `wanted` before any port binds: from `file` when it was written for
    /// these settings and this account and holds every offered size (no API call), else from
    /// the API now ([`crate::profile::startup`]), to be saved once the state directory exists
    /// ([`ProfileBook::keep`]).
    pub(crate) async fn start(
        api: &ApiClient,
        wanted: &[Wanted],
        file: Option<ProfileFile>,
        account: &Account,
        deadline: Instant,
    ) -> Result<ProfileBook, String> {
        let fingerprint = fingerprint(wanted, account);
        let sizes: BTreeSet<&str> = wanted.iter().map(|w| w.size.as_str()).collect();
        let saved = file.as_ref().and_then(|file| {
            let profiles = file.load(&fingerprint)?;
            let complete = profiles.len() == sizes.len()
                && sizes.iter().all(|size| profiles.contains_key(*size));
            if !complete {
                tracing::warn!(file = %file.path().display(), "settings: the saved Droplet settings are not those of the offered sizes; resolving them from the API");
            }
            complete.then_some(profiles)
        });
        let from_file = saved.is_some();
        let profiles = match saved {
            Some(profiles) => {
                tracing::info!(
                    offerings = profiles.len(),
                    "settings: starting with the Droplet settings saved by the last run; they are looked up again at the price-refresh cadence"
                );
                profiles
            }
            None => crate::profile::startup(api, wanted, deadline).await?,
        };
        Ok(ProfileBook {
            current: RwLock::new(Arc::new(profiles)),
            lookups: Some(Lookups {
                wanted: wanted.to_vec(),
                fingerprint,
                file,
                saved: AtomicBool::new(from_file),
            }),
        })
    }

    /// The profile of `size`, if it is an offered one.
    pub fn profile(&self, size: &str) -> Option<DropletProfile> {
        self.profiles().get(size).cloned()
    }

    fn profiles(&self) -> Arc<HashMap<String, DropletProfile>> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Saves the profiles in use unless the file holds them already: called once the state
    /// directory exists (a first start creates it after the look-ups) and after a refresh.
    pub(crate) fn keep(&self) {
        let Some(lookups) = &self.lookups else {
            return;
        };
        let Some(file) = &lookups.file else {
            return;
        };
        if lookups.saved.load(Ordering::SeqCst) {
            return;
        }
        let saved = file.save(&lookups.fingerprint, &self.profiles());
        lookups.saved.store(saved, Ordering::SeqCst);
    }

    /// Looks every profile up again, as at startup. On a problem the profiles in use stay and
    /// the problem is returned; profiles that changed are installed for later Creates, logged
    /// and saved.
    pub(crate) async fn refresh(&self, api: &ApiClient) -> Result<(), String> {
        let Some(lookups) = &self.lookups else {
            return Ok(());
        };
        let deadline = Instant::now() + REFRESH_BUDGET;
        let fresh = crate::profile::startup(api, &lookups.wanted, deadline).await?;
        let changed: Vec<String> = {
            let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
            let sizes: BTreeSet<&String> = current.keys().chain(fresh.keys()).collect();
            let changed = sizes
                .into_iter()
                .filter(|size| current.get(*size) != fresh.get(*size))
                .cloned()
                .collect::<Vec<_>>();
            if !changed.is_empty() {
                *current = Arc::new(fresh);
            }
            changed
        };
        if !changed.is_empty() {
            tracing::info!(
                sizes = %changed.join(","),
                "settings: the offerings' Droplet settings resolve differently now; later Creates use the new ones"
            );
            lookups.saved.store(false, Ordering::SeqCst);
        }
        self.keep();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::{Defaults, OfferingFields, plan};
    use provider_core::offerings::Offering;

    fn offering(size: &str) -> Offering {
        Offering {
            instance_type: size.into(),
            zone: "nyc3".into(),
            capacity_type: String::new(),
            count: 1,
            resources: Default::default(),
            labels: Default::default(),
        }
    }

    fn wanted(tags: &[&str]) -> Vec<Wanted> {
        let defaults = Defaults {
            image: "ubuntu-24-04-x64".into(),
            tags: tags.iter().map(|t| (*t).to_owned()).collect(),
            ..Defaults::default()
        };
        plan(
            &[offering("s-2vcpu-4gb")],
            &[OfferingFields::default()],
            &defaults,
            true,
        )
        .expect("valid")
    }

    fn profiles() -> HashMap<String, DropletProfile> {
        HashMap::from([
            (
                "s-2vcpu-4gb".to_owned(),
                DropletProfile {
                    image: ImageRef::Id(160_000_001),
                    vpc_uuid: Some("5a4981aa-9653-4bd1-bef5-d6bff52042e4".into()),
                    tags: vec!["k8s".into()],
                    ipv6: true,
                    monitoring: false,
                    ssh_keys: vec![
                        SshKeyRef::Id(512_189),
                        SshKeyRef::Fingerprint(
                            "3b:16:bf:e4:8b:00:8b:b8:59:8c:a9:d3:f0:19:45:fa".into(),
                        ),
                    ],
                },
            ),
            (
                "s-4vcpu-8gb".to_owned(),
                DropletProfile::with_image(ImageRef::Slug("ubuntu-24-04-x64".into())),
            ),
        ])
    }

    #[test]
    fn profiles_round_trip_for_the_same_settings_endpoint_and_token_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = ProfileFile::at(dir.path().join(FILE_NAME));
        let account = Account::new("https://api.digitalocean.com", "token-a");
        let print = fingerprint(&wanted(&["k8s"]), &account);
        assert_eq!(file.load(&print), None, "no file yet");
        assert!(file.save(&print, &profiles()));
        assert_eq!(file.load(&print), Some(profiles()));
        let other_token = Account::new("https://api.digitalocean.com", "token-b");
        assert_eq!(
            file.load(&fingerprint(&wanted(&["k8s"]), &other_token)),
            None,
            "another account's token"
        );
        let other_endpoint = Account::new("https://proxy.example", "token-a");
        assert_eq!(
            file.load(&fingerprint(&wanted(&["k8s"]), &other_endpoint)),
            None,
            "another endpoint"
        );
        assert_eq!(
            file.load(&fingerprint(&wanted(&["k8s", "pool-b"]), &account)),
            None,
            "other settings"
        );
    }

    #[test]
    fn the_file_has_its_own_form_and_no_token() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = ProfileFile::at(dir.path().join(FILE_NAME));
        let token = "dop_v1_super_secret_token_0123456789abcdef";
        let account = Account::new("https://api.digitalocean.com", token);
        assert!(!format!("{account:?}").contains(&account.digest));
        assert!(file.save(&fingerprint(&wanted(&[]), &account), &profiles()));
        let text = std::fs::read_to_string(dir.path().join(FILE_NAME)).expect("read");
        assert!(!text.contains(token), "{text}");
        let saved: serde_json::Value = serde_json::from_str(&text).expect("json");
        assert_eq!(
            saved["profiles"][0]["size"], "s-2vcpu-4gb",
            "sorted: {text}"
        );
        assert_eq!(saved["profiles"][0]["image"]["id"], 160_000_001, "{text}");
        assert_eq!(
            saved["profiles"][0]["ssh_keys"],
            serde_json::json!([
                {"id": 512_189},
                {"fingerprint": "3b:16:bf:e4:8b:00:8b:b8:59:8c:a9:d3:f0:19:45:fa"}
            ]),
            "{text}"
        );
        assert_eq!(
            saved["profiles"][1]["image"]["slug"], "ubuntu-24-04-x64",
            "{text}"
        );
    }

    #[test]
    fn a_broken_file_is_ignored() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(FILE_NAME);
        let file = ProfileFile::at(path.clone());
        let print = fingerprint(&wanted(&[]), &Account::new("e", "t"));
        std::fs::write(&path, b"{not json").expect("write");
        assert_eq!(file.load(&print), None);
        assert!(file.save(&print, &profiles()));
        let text = std::fs::read_to_string(&path).expect("read");
        std::fs::write(&path, text.replace("\"slug\"", "\"name\"")).expect("write");
        assert_eq!(
            file.load(&print),
            None,
            "an image neither by id nor by slug"
        );
        std::fs::write(&path, text.replace("s-4vcpu-8gb", "s-2vcpu-4gb")).expect("write");
        assert_eq!(file.load(&print), None, "a size named twice");
    }

    #[test]
    fn without_a_local_state_there_is_no_file() {
        assert!(ProfileFile::for_state("").is_none());
        assert!(ProfileFile::for_state("etcd://127.0.0.1:2379/bigfleet").is_none());
        assert_eq!(
            ProfileFile::for_state("/var/lib/do").map(|f| f.path()),
            Some(PathBuf::from("/var/lib/do/profiles.json"))
        );
    }
}

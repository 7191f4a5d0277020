//! The offerings' resolved settings (server type, image, networks, firewalls, login keys: the
//! startup look-ups) kept beside the local state as `plans.json`, so that a restart serves at
//! once from them instead of waiting on the API before the port binds (a restart in a long 429
//! storm), and the API budget is not spent again on answers that rarely change. They are
//! resolved again at the price-refresh cadence; a refresh with problems keeps the last good
//! plans and logs the problems.
//!
//! The file is used only when it was written for the same settings, API endpoint and token
//! (a digest of all three is stored, never the token); any other file, or one that does not
//! parse, is ignored and the provider resolves from the API as on a first start (the envelope
//! and those rules are [`provider_core::saved_lookups`], which the DigitalOcean provider shares).

use std::collections::BTreeMap;

use crate::models;
use provider_core::saved_lookups::SavedLookups;
use serde::{Deserialize, Serialize};

use crate::resolve::Plan;
use crate::settings::{OfferingSpec, SshAddress};

/// The file's name inside the state directory (not a state file: the store ignores it).
pub const FILE_NAME: &str = "plans.json";

/// The on-disk form of one plan (its own names, independent of the API models).
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct SavedPlan {
    key: String,
    server_type: String,
    location: String,
    architecture: String,
    image: i64,
    create_networks: Vec<i64>,
    attach: Vec<(i64, String)>,
    ssh_network: Option<i64>,
    firewalls: Vec<i64>,
    public_ipv4: bool,
    public_ipv6: bool,
    ssh_address: String,
    spread: bool,
    labels: BTreeMap<String, String>,
    login_keys: Vec<String>,
}

/// What the file holds besides the envelope of [`SavedLookups`] (when it was written, the
/// fingerprint).
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Saved {
    plans: Vec<SavedPlan>,
}

impl SavedPlan {
    fn of(plan: &Plan) -> SavedPlan {
        SavedPlan {
            key: plan.key.clone(),
            server_type: plan.server_type.clone(),
            location: plan.location.clone(),
            architecture: match plan.architecture {
                models::Architecture::Arm => "arm",
                models::Architecture::X86 => "x86",
                models::Architecture::Unknown => "unknown",
            }
            .to_owned(),
            image: plan.image,
            create_networks: plan.create_networks.clone(),
            attach: plan.attach.clone(),
            ssh_network: plan.ssh_network,
            firewalls: plan.firewalls.clone(),
            public_ipv4: plan.public_ipv4,
            public_ipv6: plan.public_ipv6,
            ssh_address: plan.ssh_address.name().to_owned(),
            spread: plan.spread,
            labels: plan.labels.clone(),
            login_keys: plan.login_keys.clone(),
        }
    }

    fn into_plan(self) -> Result<Plan, String> {
        let architecture = match self.architecture.as_str() {
            "arm" => models::Architecture::Arm,
            "x86" => models::Architecture::X86,
            other => return Err(format!("plan {}: unknown architecture {other:?}", self.key)),
        };
        Ok(Plan {
            key: self.key,
            server_type: self.server_type,
            location: self.location,
            architecture,
            image: self.image,
            create_networks: self.create_networks,
            attach: self.attach,
            ssh_network: self.ssh_network,
            firewalls: self.firewalls,
            public_ipv4: self.public_ipv4,
            public_ipv6: self.public_ipv6,
            ssh_address: SshAddress::parse(&self.ssh_address)?,
            spread: self.spread,
            labels: self.labels,
            login_keys: self.login_keys,
        })
    }
}

/// The digest a saved file must carry to be used: the offerings' settings (their `Debug`
/// form, which holds every field), the endpoint and the token (which names the project).
pub fn fingerprint(offerings: &[OfferingSpec], endpoint: &str, token: &str) -> String {
    provider_core::saved_lookups::fingerprint(
        "bigfleet hetzner plans v1",
        &[&format!("{offerings:?}"), endpoint, token],
    )
}

/// Where the plans of one provider are kept: `None` without a local state directory (in
/// memory, or in etcd, where standbys resolve before they may lead anyway).
#[derive(Clone, Debug)]
pub struct PlanFile {
    saved: SavedLookups,
}

impl PlanFile {
    pub fn for_state(state: &str) -> Option<PlanFile> {
        SavedLookups::for_state(state, FILE_NAME, "plans").map(|saved| PlanFile { saved })
    }

    #[cfg(test)]
    fn at(path: std::path::PathBuf) -> PlanFile {
        PlanFile {
            saved: SavedLookups::at(path, "plans"),
        }
    }

    /// The saved plans, if the file exists, parses and was written for `fingerprint`.
    pub fn load(&self, fingerprint: &str) -> Option<Vec<Plan>> {
        let saved: Saved = self.saved.load(fingerprint)?;
        let plans: Result<Vec<Plan>, String> =
            saved.plans.into_iter().map(SavedPlan::into_plan).collect();
        match plans {
            Ok(plans) => Some(plans),
            Err(e) => {
                tracing::warn!(file = %self.saved.path().display(), error = %e, "settings: the saved plans are not valid; resolving from the API");
                None
            }
        }
    }

    /// Writes the plans atomically (a temporary file renamed over the old one). A failure is
    /// logged: the next start then resolves from the API.
    pub fn save(&self, fingerprint: &str, plans: &[Plan]) {
        let saved = Saved {
            plans: plans.iter().map(SavedPlan::of).collect(),
        };
        self.saved.save(fingerprint, &saved);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::ServerSpec;

    fn plan() -> Plan {
        Plan {
            key: "cx22/nbg1".into(),
            server_type: "cx22".into(),
            location: "nbg1".into(),
            architecture: models::Architecture::Arm,
            image: 42,
            create_networks: vec![7],
            attach: vec![(8, "10.0.1.0/24".into())],
            ssh_network: Some(7),
            firewalls: vec![3, 4],
            public_ipv4: false,
            public_ipv6: true,
            ssh_address: SshAddress::Private,
            spread: true,
            labels: BTreeMap::from([("team".into(), "infra".into())]),
            login_keys: vec!["11".into()],
        }
    }

    fn offering() -> OfferingSpec {
        OfferingSpec {
            server_type: "cx22".into(),
            location: "nbg1".into(),
            spec: ServerSpec::default(),
            overrides: Default::default(),
        }
    }

    #[test]
    fn plans_round_trip_for_the_same_fingerprint_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = PlanFile::at(dir.path().join(FILE_NAME));
        let print = fingerprint(&[offering()], "https://api.example/v1", "token-a");
        assert_eq!(file.load(&print), None, "no file yet");
        file.save(&print, &[plan()]);
        assert_eq!(file.load(&print), Some(vec![plan()]));
        let other_token = fingerprint(&[offering()], "https://api.example/v1", "token-b");
        assert_eq!(file.load(&other_token), None, "another project's token");
        let other_endpoint = fingerprint(&[offering()], "https://other.example/v1", "token-a");
        assert_eq!(file.load(&other_endpoint), None, "another endpoint");
        let mut changed = offering();
        changed.spec.image = "ubuntu-24.04".into();
        let other_settings = fingerprint(&[changed], "https://api.example/v1", "token-a");
        assert_eq!(file.load(&other_settings), None, "other settings");
    }

    /// Files written before the envelope moved to provider-core stay valid.
    #[test]
    fn the_fingerprint_is_the_digest_earlier_versions_wrote() {
        use sha2::{Digest, Sha256};
        let offerings = [offering()];
        let mut digest = Sha256::new();
        digest.update(b"bigfleet hetzner plans v1\0");
        digest.update(format!("{offerings:?}").as_bytes());
        digest.update(b"\0https://api.example/v1\0token-a");
        let earlier: String = digest
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            fingerprint(&offerings, "https://api.example/v1", "token-a"),
            earlier
        );
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(FILE_NAME);
        let file = PlanFile::at(path.clone());
        file.save(&earlier, &[plan()]);
        let written: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("json");
        let keys: Vec<&str> = written
            .as_object()
            .expect("an object")
            .keys()
            .map(String::as_str)
            .collect();
        assert_eq!(keys, ["fingerprint", "plans", "saved_unix"], "{written}");
    }

    #[test]
    fn the_token_is_never_written() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = PlanFile::at(dir.path().join(FILE_NAME));
        let token = "super-secret-hcloud-token-0123456789abcdef";
        file.save(&fingerprint(&[offering()], "e", token), &[plan()]);
        let text = std::fs::read_to_string(dir.path().join(FILE_NAME)).expect("read");
        assert!(!text.contains(token), "{text}");
    }

    #[test]
    fn a_broken_file_is_ignored() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(FILE_NAME);
        let file = PlanFile::at(path.clone());
        let print = fingerprint(&[offering()], "e", "t");
        std::fs::write(&path, b"{not json").expect("write");
        assert_eq!(file.load(&print), None);
        file.save(&print, &[plan()]);
        let text = std::fs::read_to_string(&path)
            .expect("read")
            .replace("\"arm\"", "\"sparc\"");
        std::fs::write(&path, text).expect("write");
        assert_eq!(file.load(&print), None, "an unknown architecture");
    }
}

//! Spread placement (`--placement spread`): the provider owns spread placement groups per
//! offering, labelled like every other owned resource (`bigfleet-managed=true`, the provider
//! instance, and `bigfleet-offering` = server type/location). A Create goes into the fullest
//! owned group with room; when the offering has none, a new group is opened. Hetzner keeps at
//! most [`GROUP_LIMIT`] servers in a spread group and answers a create into a full group with
//! [`GROUP_FULL`]: that group is then skipped and the create retried in another (new) group.
//! Owned groups left empty are deleted after a server delete and at startup. A group is only
//! used or deleted after its labels prove it belongs to this provider instance and offering;
//! groups of other owners are never touched.
//!
//! Choosing a group and creating the server into it happen under one lock per offering, as do
//! the deletions of empty groups, so this process never deletes a group a Create just chose.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use crate::models;
use sha2::{Digest, Sha256};
use tokio::time::Instant;

use crate::api::{ApiError, HcloudApi};
use crate::labels;
use crate::resolve::Plan;

/// Servers a spread placement group holds at most on Hetzner Cloud.
pub const GROUP_LIMIT: usize = 10;

/// The error code of a create into a full spread placement group.
pub const GROUP_FULL: &str = "placement_group_member_limit_reached";

/// The label naming the offering a placement group serves.
pub const OFFERING: &str = "bigfleet-offering";

/// How many groups one Create may try (each full answer opens another).
const ATTEMPTS: usize = 4;

/// The spread groups of one provider instance: its per-offering locks, its group-name stem and
/// the instance name its group labels carry.
pub struct SpreadGroups {
    /// The provider instance (`--provider`), as the groups' labels record it.
    provider: String,
    /// 8 base32 characters of the provider instance's digest (names are project-wide).
    stem: String,
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl std::fmt::Debug for SpreadGroups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpreadGroups")
            .field("provider", &self.provider)
            .field("stem", &self.stem)
            .finish_non_exhaustive()
    }
}

impl SpreadGroups {
    pub fn new(provider: &str) -> SpreadGroups {
        let digest = Sha256::digest(provider.as_bytes());
        SpreadGroups {
            provider: provider.to_owned(),
            stem: labels::base32(&digest)[..8].to_owned(),
            locks: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.locks.lock().unwrap_or_else(|e| e.into_inner());
        locks.entry(key.to_owned()).or_default().clone()
    }

    /// `bigfleet-<stem>-<type>-<location>-<n>`.
    fn name(&self, server_type: &str, location: &str, n: u64) -> String {
        let safe = |s: &str| -> String {
            s.chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() {
                        c.to_ascii_lowercase()
                    } else {
                        '-'
                    }
                })
                .collect()
        };
        format!(
            "bigfleet-{}-{}-{}-{n}",
            self.stem,
            safe(server_type),
            safe(location)
        )
    }
}

/// The offering key of a plan's groups (`cx22/nbg1`).
fn offering_key(server_type: &str, location: &str) -> String {
    format!("{server_type}/{location}")
}

/// The number at the end of a group name, if any.
fn group_number(name: &str) -> Option<u64> {
    name.rsplit_once('-').and_then(|(_, n)| n.parse().ok())
}

impl SpreadGroups {
    fn group_labels(&self, server_type: &str, location: &str) -> Vec<(String, String)> {
        let mut pairs = vec![(labels::MANAGED.to_owned(), "true".to_owned())];
        pairs.extend(labels::text_labels(labels::PROVIDER, &self.provider));
        pairs.extend(labels::text_labels(
            OFFERING,
            &offering_key(server_type, location),
        ));
        pairs
    }

    /// Whether a group's labels prove it is this instance's group for the offering.
    fn is_our_group(&self, group: &models::PlacementGroup, key: &str) -> bool {
        group.labels.get(labels::MANAGED).map(String::as_str) == Some("true")
            && labels::text_of(&group.labels, labels::PROVIDER).as_deref()
                == Some(self.provider.as_str())
            && labels::text_of(&group.labels, OFFERING).as_deref() == Some(key)
    }

    /// This instance's spread groups of one offering, oldest first.
    pub(crate) async fn owned_groups(
        &self,
        api: &HcloudApi,
        server_type: &str,
        location: &str,
        deadline: Instant,
    ) -> Result<Vec<models::PlacementGroup>, ApiError> {
        let key = offering_key(server_type, location);
        let selector = labels::selector(&self.group_labels(server_type, location));
        let mut groups: Vec<models::PlacementGroup> = api
            .placement_groups(&selector, Some(deadline))
            .await?
            .into_iter()
            .filter(|g| self.is_our_group(g, &key))
            .collect();
        groups.sort_by_key(|g| g.id);
        Ok(groups)
    }

    /// Opens a new owned spread group for the offering.
    async fn open_group(
        &self,
        api: &HcloudApi,
        plan: &Plan,
        existing: &[models::PlacementGroup],
        deadline: Instant,
    ) -> Result<models::PlacementGroup, ApiError> {
        let labels: HashMap<String, String> = self
            .group_labels(&plan.server_type, &plan.location)
            .into_iter()
            .collect();
        let mut n = existing
            .iter()
            .filter_map(|g| group_number(&g.name))
            .max()
            .map_or(1, |m| m + 1);
        let mut last = None;
        for _ in 0..ATTEMPTS {
            let name = self.name(&plan.server_type, &plan.location, n);
            match api
                .create_placement_group(&name, labels.clone(), Some(deadline))
                .await
            {
                Ok(group) => {
                    tracing::info!(offering = %plan.key, group = group.id, name = %group.name, "opened a spread placement group");
                    return Ok(group);
                }
                // A name another owner (or an earlier run) holds: take the next number.
                Err(e) if e.code() == Some("uniqueness_error") => {
                    last = Some(e);
                    n += 1;
                }
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or(ApiError::Deadline))
    }

    /// Creates the server in an owned spread group of its offering, opening groups as they
    /// fill up.
    pub(crate) async fn create_server(
        &self,
        api: &HcloudApi,
        plan: &Plan,
        request: &mut models::CreateServerRequest,
        deadline: Instant,
    ) -> Result<models::Server, ApiError> {
        let lock = self.lock(&plan.key);
        let _held = lock.lock().await;
        let mut full: HashSet<i64> = HashSet::new();
        let mut last = None;
        for _ in 0..ATTEMPTS {
            let groups = self
                .owned_groups(api, &plan.server_type, &plan.location, deadline)
                .await?;
            let roomy = groups
                .iter()
                .filter(|g| !full.contains(&g.id) && g.servers.len() < GROUP_LIMIT)
                .max_by_key(|g| (g.servers.len(), std::cmp::Reverse(g.id)));
            let group = match roomy {
                Some(g) => g.clone(),
                None => self.open_group(api, plan, &groups, deadline).await?,
            };
            request.placement_group = Some(group.id);
            match api.create_server(request, Some(deadline)).await {
                Err(e) if e.code() == Some(GROUP_FULL) => {
                    tracing::info!(offering = %plan.key, group = group.id, "spread placement group is full; using another");
                    full.insert(group.id);
                    last = Some(e);
                }
                other => return other,
            }
        }
        Err(last.unwrap_or(ApiError::Deadline))
    }

    /// Deletes this instance's empty spread groups of the offering.
    pub(crate) async fn sweep_groups(
        &self,
        api: &HcloudApi,
        server_type: &str,
        location: &str,
        deadline: Instant,
    ) -> Result<usize, ApiError> {
        let lock = self.lock(&offering_key(server_type, location));
        let _held = lock.lock().await;
        let mut deleted = 0;
        for group in self
            .owned_groups(api, server_type, location, deadline)
            .await?
        {
            if group.servers.is_empty() {
                api.delete_placement_group(group.id, Some(deadline)).await?;
                tracing::info!(group = group.id, name = %group.name, "deleted an empty spread placement group");
                deleted += 1;
            }
        }
        Ok(deleted)
    }

    /// After a server of a spread offering is deleted: removes its group if it is ours and
    /// now empty (the others of the offering too).
    pub(crate) async fn release_group(
        &self,
        api: &HcloudApi,
        server: &models::Server,
        deadline: Instant,
    ) {
        let Some(group) = &server.placement_group else {
            return;
        };
        let key = offering_key(&server.server_type.name, &server.location.name);
        if !self.is_our_group(group, &key) {
            return;
        }
        if let Err(e) = self
            .sweep_groups(
                api,
                &server.server_type.name,
                &server.location.name,
                deadline,
            )
            .await
        {
            tracing::warn!(group = group.id, err = %e, "could not remove empty spread placement groups; the next delete or restart retries");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_names_are_stable_and_numbered() {
        let a = SpreadGroups::new("hetzner");
        assert_eq!(a.name("cx22", "nbg1", 3), a.name("cx22", "nbg1", 3));
        assert!(a.name("cx22", "nbg1", 3).starts_with("bigfleet-"));
        assert!(a.name("cx22", "nbg1", 3).ends_with("-cx22-nbg1-3"));
        assert_ne!(
            SpreadGroups::new("other").name("cx22", "nbg1", 1),
            a.name("cx22", "nbg1", 1)
        );
        assert_eq!(group_number(&a.name("cx22", "nbg1", 12)), Some(12));
    }
}

//! The servers of many machines read in one listing: the look-up before a Create and the
//! boot polls of every Create in flight ask here, and each round lists the servers carrying
//! any of the asked machine ids with one label selector (`bigfleet-machine-id in (...)`),
//! instead of one request per machine (see [`provider_core::batch`]).

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use crate::models;
use provider_core::batch::{Batcher, ReadError};
use tokio::time::Instant;

use crate::api::{ApiError, HcloudApi};
use crate::labels;

/// Machine ids per listing: each is one value of the selector's `in (...)` set, which keeps
/// the request line short and (a machine having one server) the answer within one page.
const IDS_PER_LISTING: usize = 50;

/// Batched reads of the servers labelled with a machine id, deleting ones included, not
/// filtered by provider instance (callers decide ownership).
#[derive(Clone, Debug)]
pub(crate) struct MachineReads {
    batcher: Batcher<String, Vec<models::Server>, ApiError>,
}

impl MachineReads {
    pub(crate) fn new(api: HcloudApi, gather: Duration) -> MachineReads {
        let fetch = Arc::new(move |ids: Vec<String>, deadline: Instant| {
            let api = api.clone();
            Box::pin(async move { list(&api, ids, deadline).await })
                as provider_core::batch::FetchFuture<_, _, _>
        });
        MachineReads {
            batcher: Batcher::new(gather, fetch),
        }
    }

    /// The servers carrying `machine_id`, from a listing that started after this call.
    pub(crate) async fn servers(
        &self,
        machine_id: &str,
        deadline: Instant,
    ) -> Result<Vec<models::Server>, ApiError> {
        match self.batcher.read(machine_id.to_owned(), deadline).await {
            Ok(found) => Ok(found.unwrap_or_default()),
            Err(ReadError::Fetch(e)) => Err(e),
            Err(ReadError::Deadline) => Err(ApiError::Deadline),
            Err(ReadError::Lost) => Err(ApiError::Transport(
                "the batched server listing ended without an answer".into(),
            )),
        }
    }
}

/// The selector of the servers of `ids`: managed, with a first machine-id chunk in the set.
/// A long id spans several label chunks, so the answer is filtered by the decoded id.
fn selector(ids: &[String]) -> String {
    let firsts: BTreeSet<String> = ids
        .iter()
        .filter_map(|id| labels::machine_id_labels(id).into_iter().next())
        .map(|(_, value)| value)
        .collect();
    let values: Vec<String> = firsts.into_iter().collect();
    format!(
        "{}=true,{} in ({})",
        labels::MANAGED,
        labels::MACHINE_ID,
        values.join(",")
    )
}

async fn list(
    api: &HcloudApi,
    ids: Vec<String>,
    deadline: Instant,
) -> Result<HashMap<String, Vec<models::Server>>, ApiError> {
    let mut found: HashMap<String, Vec<models::Server>> =
        ids.iter().map(|id| (id.clone(), Vec::new())).collect();
    for chunk in ids.chunks(IDS_PER_LISTING) {
        for server in api
            .list_servers_once(&selector(chunk), Some(deadline))
            .await?
        {
            if let Some(id) = labels::machine_id_of(&server.labels)
                && let Some(servers) = found.get_mut(&id)
            {
                servers.push(server);
            }
        }
    }
    for servers in found.values_mut() {
        servers.sort_by_key(|s| s.id);
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_selector_sets_the_first_chunk_of_every_id_once() {
        let ids = vec!["m-1".to_owned(), "m-2".to_owned(), "m-1".to_owned()];
        let first = |id: &str| labels::machine_id_labels(id)[0].1.clone();
        let mut values = [first("m-1"), first("m-2")];
        values.sort();
        assert_eq!(
            selector(&ids),
            format!(
                "bigfleet-managed=true,bigfleet-machine-id in ({})",
                values.join(",")
            )
        );
    }
}

//! What a provider lists, read through the gRPC test client.

use crate::wire::Caller;

/// The ids of every machine the provider lists, in its order.
pub async fn ids(caller: &mut Caller) -> Vec<String> {
    caller
        .list_all()
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.id)
        .collect()
}

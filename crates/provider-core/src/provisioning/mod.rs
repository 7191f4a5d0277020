//! The cloud side: the `Backend` seam the engine drives, the `Cloud` seam each cloud crate
//! implements, and what both clouds share between them: offerings, prices, catalogue,
//! stockouts and headroom, the API budget, batched reads, retries, user data, the fake cloud.

pub mod backend;
pub mod batch;
pub mod budget;
pub mod catalogue;
pub mod catalogue_refresh;
pub mod cloud;
pub mod encoding;
pub mod fake;
pub mod fleet;
pub mod headroom;
pub mod host_ledger;
pub mod offerings;
pub mod retry;
pub mod stockout;
pub mod userdata;

//! The state on disk: the `Store` seam the engine commits to, the in-memory store and the
//! durable log behind `--state PATH`.

pub mod durable;
pub mod store;

#[cfg(test)]
pub(crate) mod test_support;

//! The DigitalOcean capacity provider: the pinned size catalogue, the DigitalOcean API client,
//! the [`provider_core::cloud::Cloud`] implementation over it, the HTTPS bootstrap channel that
//! delivers commands to the on-host agent, and the agent itself (`bigfleet-agent`).

pub mod agent;
pub mod api;
pub mod catalog;
pub mod channel;
pub mod channel_key;
pub mod check;
pub mod cloud;
pub mod enrollment;
pub mod naming;
pub mod pin;
pub mod profile;
pub mod profile_cache;
pub mod setup;
pub mod token;

pub use channel::Channel;
pub use cloud::DigitalOceanCloud;
pub use setup::{RealBackend, RealFlags, build_real};

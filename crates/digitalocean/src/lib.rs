//! The DigitalOcean capacity provider: the pinned size catalogue, the DigitalOcean API client,
//! the [`provider_core::cloud::Cloud`] implementation over it, the HTTPS bootstrap channel that
//! delivers commands to the on-host agent, and the agent itself (`bigfleet-agent`).

pub mod catalog;

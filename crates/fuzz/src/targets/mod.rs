//! One module per input surface; each exposes its [`crate::Target`] constants.

pub mod agent;
pub mod agent_state;
pub mod channel;
pub mod durable;
pub mod etcd;
pub mod labels;
pub mod offerings;
pub mod reference;

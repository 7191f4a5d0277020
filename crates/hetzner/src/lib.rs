//! The Hetzner Cloud capacity provider: the pinned catalogue, the real backend over the Hetzner
//! Cloud API (`hcloud`), SSH bootstrap delivery with pinned host keys, and the label scheme
//! that ties servers to machine slots and provider instances.

pub mod api;
pub mod catalog;
pub mod check;
pub mod cloud;
pub mod create;
pub mod hostkey;
pub mod labels;
pub mod machine_reads;
pub mod models;
pub mod placement;
pub mod plan_cache;
pub mod real;
pub mod remote;
pub mod resolve;
pub mod settings;
pub mod ssh;

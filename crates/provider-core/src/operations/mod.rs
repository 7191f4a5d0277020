//! The process around the engine: shared flags and their validation, startup and shutdown,
//! the `check` and `state` subcommands, the admin socket, the leader label, and the files
//! beside a local state that let a restart serve before the cloud answers.

pub mod admin;
pub mod app;
pub mod check;
pub mod cli;
pub mod config;
pub mod flag_syntax;
pub mod leader_label;
pub mod price_cache;
pub mod saved_lookups;

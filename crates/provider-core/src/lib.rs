//! provider-core: the BigFleet `CapacityProvider` contract engine and everything the Hetzner and
//! DigitalOcean providers share. See ARCHITECTURE.md for the map of modules to contract rules.

pub mod admin;
pub mod app;
pub mod backend;
pub mod batch;
pub mod budget;
pub mod check;
pub mod cli;
pub mod cloud;
pub mod config;
pub mod durable;
pub mod duration;
pub mod encoding;
pub mod engine;
pub mod error;
pub mod etcd;
pub mod fake;
pub mod fence;
pub mod flag_syntax;
pub mod fleet;
pub mod identity;
pub mod inventory;
pub mod leader_label;
pub mod lifecycle;
pub mod limits;
pub mod listener;
pub mod machine;
pub mod offerings;
pub mod price_cache;
pub mod records;
pub mod replica;
pub mod retry;
pub mod saved_lookups;
pub mod seal;
pub mod serve;
pub mod server;
pub mod store;
pub mod telemetry;
pub mod tls;
pub mod userdata;

pub use backend::{Backend, BackendError, BootstrapBlob, ConfigureOrder, TransitionContext};
pub use engine::{Ack, Engine, EngineOptions, ListQuery, Listing, Timeouts};
pub use error::CoreError;
pub use fence::FenceToken;
pub use lifecycle::OperationKind;
pub use machine::{CapacityType, HostRef, Machine, MachineState, StringMap};

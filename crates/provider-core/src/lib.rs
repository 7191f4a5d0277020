//! provider-core: the BigFleet `CapacityProvider` contract engine and everything the Hetzner and
//! DigitalOcean providers share. See ARCHITECTURE.md for the map of modules to contract rules.

pub mod backend;
pub mod cloud;
pub mod duration;
pub mod engine;
pub mod error;
pub mod fence;
pub mod inventory;
pub mod lifecycle;
pub mod machine;
pub mod retry;
pub mod store;
pub mod telemetry;
pub mod userdata;

pub use backend::{Backend, BackendError, BootstrapBlob, ConfigureOrder, TransitionContext};
pub use engine::{Ack, Engine, EngineOptions, ListQuery, Listing, Timeouts};
pub use error::CoreError;
pub use fence::FenceToken;
pub use lifecycle::OperationKind;
pub use machine::{CapacityType, HostRef, Machine, MachineState, StringMap};

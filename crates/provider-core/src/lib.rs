//! provider-core: the BigFleet `CapacityProvider` contract engine and everything the Hetzner and
//! DigitalOcean providers share. See ARCHITECTURE.md for the map of modules to contract rules.
//!
//! # Layers
//!
//! The folders of `src/` are the crate's layers, listed here from the bottom up. A module uses
//! the modules of its own layer and of the layers below it, never those of a layer above, and no
//! two modules of one layer use each other. The module-cycle test (`xtask/src/modules.rs`) reads
//! this list and holds the code to it.
//!
//! 1. `observability/`: metric names and recording, durations as Go writes them.
//! 2. `rules/`: the contract's rules over plain types: machine, transitions, fencing, records,
//!    the inventory and its every change, request limits, errors.
//! 3. `provisioning/`: the `Backend` and `Cloud` seams and the fleet both clouds share.
//! 4. `security/`: TLS, shard identity under mTLS, sealed bootstrap blobs.
//! 5. `persistence/`: the `Store` seam, the in-memory store, the durable log.
//! 6. `runtime/`: the async engine, the replica that drives it (etcd elects it), the reconcile
//!    loop.
//! 7. `wire/`: the gRPC service, its servers and accept loop.
//! 8. `operations/`: flags, startup and shutdown, subcommands, the admin socket, the leader
//!    label, the caches beside a local state.
//!
//! Every module keeps its path from before the folders (`provider_core::fleet`,
//! `provider_core::engine`): the re-exports below are the crate's API.

mod observability;
mod operations;
mod persistence;
mod provisioning;
mod rules;
mod runtime;
mod security;
mod wire;

pub use observability::{duration, telemetry};
pub use operations::{
    admin, app, check, cli, config, flag_syntax, leader_label, price_cache, saved_lookups,
};
pub use persistence::{durable, store};
pub use provisioning::{
    backend, batch, budget, catalogue, catalogue_refresh, cloud, encoding, fake, fleet, headroom,
    host_ledger, offerings, retry, stockout, userdata,
};
pub use rules::{error, fence, inventory, lifecycle, limits, machine, records};
pub use runtime::{engine, etcd, reconcile_loop, replica};
pub use security::{identity, seal, tls};
pub use wire::{listener, serve, server};

pub use backend::{Backend, BackendError, BootstrapBlob, ConfigureOrder, TransitionContext};
pub use engine::{Ack, Engine, EngineOptions, ListQuery, Listing, Timeouts};
pub use error::CoreError;
pub use fence::FenceToken;
pub use lifecycle::OperationKind;
pub use machine::{CapacityType, HostRef, Machine, MachineState, StringMap};

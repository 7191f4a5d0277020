//! The gRPC edge: the `CapacityProvider` service over the engine, the servers (gRPC, health,
//! reflection, `/metrics`) and the accept loop that bounds connections.

pub mod listener;
pub mod serve;
pub mod server;

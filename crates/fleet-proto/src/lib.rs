//! The `bigfleet.v1alpha1` CapacityProvider wire contract: the generated messages, the tonic
//! client and server, and the encoded file descriptor set for gRPC reflection.

#![allow(clippy::all, missing_docs)]

pub mod encoded;
pub mod list;

/// Messages and services of package `bigfleet.v1alpha1`, generated from
/// `proto/bigfleet/v1alpha1/provider.proto`.
pub mod v1alpha1 {
    tonic::include_proto!("bigfleet.v1alpha1");
    pub use crate::list::MachineList;
}

/// The encoded `FileDescriptorSet` of the contract, for the reflection service.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(
    env!("OUT_DIR"),
    "/bigfleet_v1alpha1_descriptor.bin"
));

/// The full gRPC service name.
pub const SERVICE_NAME: &str = "bigfleet.v1alpha1.CapacityProvider";

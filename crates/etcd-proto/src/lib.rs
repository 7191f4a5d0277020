//! Client stubs for the part of etcd's v3 gRPC API that the etcd state store uses: KV (Range,
//! Put, DeleteRange, Txn), Lease (Grant, Revoke, KeepAlive), Watch (the prefix, from a revision) and Maintenance (Status: which
//! member leads).
//!
//! The messages keep etcd's package, names and field numbers, so they are wire-compatible with
//! every etcd 3.x server; fields and services the store does not use are left out (protobuf
//! skips unknown fields). The code is generated at build time with the vendored protoc, so the
//! workspace builds with cargo alone (a client crate that needs a system protoc would not).

#![allow(clippy::all, clippy::pedantic, missing_docs)]

/// `etcdserverpb`: the generated messages and the `KV` and `Lease` clients.
pub mod etcdserverpb {
    tonic::include_proto!("etcdserverpb");
}

//! What the provider trusts and what it keeps secret: TLS configurations and certificates, the
//! shard identity a mutation must prove under mTLS, the sealing of bootstrap blobs at rest.

pub mod identity;
pub mod seal;
pub mod tls;

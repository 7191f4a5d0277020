//! provider-core integration tests: the real gRPC server over loopback, in every security mode
//! with the committed test PKI (`testdata/pki`), checked through a real tonic client.

// Helpers outside `#[test]` functions may unwrap too: a panic is the failure report.
#![allow(clippy::unwrap_used)]

use testkit::wire;

mod errors;
mod fencing;
mod harness;
mod identity;
mod lifecycle;
mod limits;
mod list;
mod reference_parity;
mod startup;
mod tls_reload;
mod transport;

//! Integration tests of the Hetzner backend: the real client against the local Hetzner API
//! emulator, and SSH delivery against a real (in-process) SSH server, all on 127.0.0.1.

// Helpers here are test code too: a panic is the failure report we want.
#![allow(clippy::unwrap_used)]

use testkit::{provider_process, wire};

mod binary;
mod budget;
mod catalogue;
mod etcd_state;
mod expected_hosts;
mod faults;
mod harness;
mod lifecycle;
mod lookups;
mod out_of_band;
mod pacing;
mod production;
mod real_build;
mod restart;
mod resume;
mod scale;
mod secrets;
mod ssh_delivery;
mod stockout;
mod tofu;

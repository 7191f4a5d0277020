//! Integration tests of the DigitalOcean provider: the API client and [`Cloud`] against the
//! local emulator, the HTTPS bootstrap channel, and the real `bigfleet-agent` process playing
//! the Droplet. Everything listens on 127.0.0.1 only.

// Helpers outside #[test] functions panic on setup failures too: that is the report we want.
#![allow(clippy::unwrap_used)]

mod binary;
mod budget;
mod catalogue;
mod channel;
mod cloud;
mod enrollment;
mod lifecycle;
mod out_of_band;
mod pin;
mod production;
mod profile_cache;
mod restart;
mod resume;
mod scale;
mod stockout;
mod support;

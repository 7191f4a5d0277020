//! Scaled time: tests run a cloud's clock (rate-limit refill, boot times, hours of reconcile)
//! `scale` times faster, on the emulator and the client's budget alike.

use std::time::Duration;

/// `seconds` of the cloud's time at `scale` times real speed.
pub fn scaled(seconds: f64, scale: f64) -> Duration {
    Duration::from_secs_f64(seconds / scale)
}

//! The Hetzner Cloud API emulator on 127.0.0.1, at scaled time.

pub use hcloud_emulator::{Emulator, RateLimit};

/// Runs `emulator`'s clock `scale` times faster: Hetzner's rate limit refills that much
/// faster, and a server boots in `boot_seconds` of the cloud's time.
pub fn time_scaled(emulator: &Emulator, scale: f64, boot_seconds: f64) {
    emulator.set_rate_limit(RateLimit::HETZNER.time_scaled(scale));
    emulator.set_boot_time(Some(crate::time::scaled(boot_seconds, scale)));
}

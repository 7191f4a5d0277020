//! The DigitalOcean API emulator on 127.0.0.1.

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use do_emulator::{Emulator, RateLimit};

/// Runs `emulator`'s clock `scale` times faster: DigitalOcean's hourly and per-minute limits
/// refill that much faster, and a Droplet boots in `boot_seconds` of the cloud's time.
pub fn time_scaled(emulator: &Emulator, scale: f64, boot_seconds: f64) {
    emulator.set_rate_limit(RateLimit::DIGITALOCEAN.time_scaled(scale));
    emulator.set_boot_time(Some(crate::time::scaled(boot_seconds, scale)));
}

/// The emulator serving on a loopback port until dropped.
pub struct RunningEmulator {
    pub emulator: Emulator,
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    stop: CancellationToken,
}

impl RunningEmulator {
    /// A fresh emulator accepting `token`, serving on a fresh 127.0.0.1 port.
    pub async fn start(token: &str) -> RunningEmulator {
        RunningEmulator::serve(Emulator::new(token)).await
    }

    /// Serves `emulator` (set up beforehand) on a fresh 127.0.0.1 port.
    pub async fn serve(emulator: Emulator) -> RunningEmulator {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let stop = CancellationToken::new();
        tokio::spawn(emulator.clone().serve(listener, stop.clone()));
        RunningEmulator {
            emulator,
            url,
            stop,
        }
    }

    /// Stops serving (also on drop).
    pub fn stop(&self) {
        self.stop.cancel();
    }

    /// The token cancelled on drop, for fixtures that hold it apart from the emulator.
    pub fn stop_token(&self) -> CancellationToken {
        self.stop.clone()
    }
}

impl Drop for RunningEmulator {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

//! Wiring point between the `hetzner` binary's flags and the real Hetzner Cloud backend.
//! `build` validates the real-backend flags and constructs the `Cloud` implementation.

use std::sync::Arc;

use provider_core::cloud::Cloud;
use provider_core::config::Secret;
use provider_core::offerings::Offering;
use provider_core::telemetry::Telemetry;

/// The flags the real backend needs, as given on the command line.
#[derive(Debug, Clone)]
pub struct RealArgs {
    pub token: Secret,
    pub endpoint: String,
    pub provider: String,
    pub image: String,
    pub ssh_key: String,
    pub ssh_user: String,
    pub ssh_port: u16,
    pub bootstrap_hook: String,
    pub readiness_command: String,
    pub base_user_data: String,
    pub eur_usd: f64,
}

/// Validates the real-backend flags and builds the Hetzner Cloud backend.
pub fn build(args: RealArgs, offerings: &[Offering], telemetry: Telemetry) -> Result<Arc<dyn Cloud>, String> {
    let _ = (offerings, telemetry);
    if args.token.is_empty() {
        return Err("hcloud: token is required for the hetzner backend".into());
    }
    if args.image.is_empty() {
        return Err("hcloud: --image is required for the hetzner backend".into());
    }
    Err("the real Hetzner backend is not wired into this build".into())
}

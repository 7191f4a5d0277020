//! The Hetzner side of `cloud-budget`: the Hetzner Cloud API emulator in this process (so its
//! request counts can be read and owned servers put into it), its sshd playing the servers'
//! for Configure and Drain, and the flags of the `hetzner` binary on its real backend, all
//! taken from the e2e run against the same emulator.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use hcloud_emulator::{Emulator, RateLimit, Sshd};

use super::report::Counts;
use super::{Setup, Spent};
use crate::e2e::hetzner_real::{backend_args, client_key, install_hook, ssh_args};

const TOKEN: &str = "bench-hcloud-token";
/// The provider instance (`--provider`'s default), which owned servers are labelled with.
pub(super) const PROVIDER: &str = "hetzner";
pub(super) const SERVER_TYPE: &str = "cx23";
pub(super) const LOCATION: &str = "nbg1";

/// The emulator of one run, and its sshd when the run configures hosts, served on a runtime
/// of their own (so that the bench's waits never delay an answer).
pub(super) struct Lab {
    pub emulator: Emulator,
    /// The servers' roots (where the sshd runs their commands).
    dir: PathBuf,
    ssh: Option<(Sshd, PathBuf)>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Drop for Lab {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl Lab {
    pub(super) async fn start(dir: &Path, setup: &Setup) -> Result<Lab> {
        let runtime = super::emulator_runtime("hcloud-emulator")?;
        let emulator = runtime
            .spawn(Emulator::start(TOKEN))
            .await?
            .context("start the Hetzner Cloud API emulator")?;
        emulator.set_rate_limit(RateLimit::HETZNER.time_scaled(setup.scale));
        emulator.set_boot_time(Some(setup.boot));
        for index in 0..setup.owned {
            let machine_id = super::slot_id(PROVIDER, SERVER_TYPE, LOCATION, index);
            emulator.insert_server(
                &format!("bench-owned-{index}"),
                SERVER_TYPE,
                LOCATION,
                owned_labels(&machine_id),
                "192.0.2.10",
            );
        }
        let ssh = if setup.configures {
            // New servers answer at the sshd's address.
            emulator.set_new_server_ipv4("127.0.0.1");
            let key = client_key(dir)?;
            let authorized = std::fs::read_to_string(key.with_extension("pub"))
                .context("read the client public key")?;
            let (emulator, servers) = (emulator.clone(), dir.join("servers"));
            let sshd = runtime
                .spawn(async move {
                    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
                    Sshd::for_emulator_openssh(listener, emulator, servers, &authorized, "root")
                })
                .await?
                .context("start the emulator's sshd")?;
            Some((sshd, key))
        } else {
            None
        };
        Ok(Lab {
            emulator,
            dir: dir.to_owned(),
            ssh,
            runtime: Some(runtime),
        })
    }

    /// The backend's flags, with SSH delivery when the run configures hosts.
    pub(super) fn args(&self, offerings: &Path) -> Vec<String> {
        let mut args = backend_args(TOKEN, &self.emulator.endpoint(), offerings);
        if let Some((sshd, key)) = &self.ssh {
            args.extend(ssh_args(key, sshd.addr().port()));
        }
        args
    }

    /// The stand-in bootstrap hook in server `host`'s root, before its Configure.
    pub(super) fn before_configure(&self, host: &str) -> Result<()> {
        install_hook(&self.dir, host)
    }

    pub(super) fn counts(&self) -> Counts {
        self.emulator.requests_by_class()
    }

    /// Spends the bucket as another user of the token would.
    pub(super) fn spend(&self, spent: Spent) {
        let limit = RateLimit::HETZNER.limit;
        self.emulator.drain_rate_limit(match spent {
            Spent::Nothing => 0,
            Spent::Half => limit / 2,
            Spent::All => limit,
        });
    }

    pub(super) fn live_hosts(&self) -> usize {
        self.emulator.live_servers().len()
    }
}

/// The labels the provider writes on a server it created for `machine_id` (its
/// `labels::machine_id_labels` and `instance_selector`): `bigfleet-managed=true`, the provider
/// instance verbatim (label-safe), and the machine id as lower-case unpadded base32, in one
/// label while it fits Hetzner's 63 characters (machine ids of up to 39 bytes, which every
/// slot id of this run is).
fn owned_labels(machine_id: &str) -> HashMap<String, String> {
    HashMap::from([
        ("bigfleet-managed".to_owned(), "true".to_owned()),
        ("bigfleet-provider".to_owned(), PROVIDER.to_owned()),
        (
            "bigfleet-machine-id".to_owned(),
            super::base32_lower(machine_id.as_bytes()),
        ),
    ])
}

/// The offerings file: one offering of `slots` servers.
pub(super) fn offerings(slots: usize) -> String {
    format!(r#"[{{"server_type": "{SERVER_TYPE}", "location": "{LOCATION}", "count": {slots}}}]"#)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owned_servers_carry_the_providers_labels() {
        let id = super::super::slot_id(PROVIDER, SERVER_TYPE, LOCATION, 9999);
        assert_eq!(id, "hetzner/OnDemand/cx23/nbg1/9999");
        let labels = owned_labels(&id);
        let value = &labels["bigfleet-machine-id"];
        // One label: 31 bytes are 50 base32 characters.
        assert_eq!(value.len(), 50);
        assert!(value.len() <= 63);
        assert_eq!(labels["bigfleet-provider"], "hetzner");
        assert!(offerings(3).contains(r#""count": 3"#));
    }
}

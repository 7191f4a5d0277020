//! The DigitalOcean side of `cloud-budget`: the DigitalOcean API emulator in this process (so
//! its request counts can be read and owned Droplets put into it), a real `bigfleet-agent`
//! playing a Droplet for Configure and Drain, and the flags of the `digitalocean` binary on its
//! real backend, all taken from the e2e run against the same emulator.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use do_emulator::{Emulator, RateLimit};
use tokio_util::sync::CancellationToken;

use super::report::Counts;
use super::{Setup, Spent};
use crate::e2e::digitalocean_real::{
    Process, REGION, TOKEN, backend_args, bootstrap_args, droplet_of, start_agent_binary,
};

/// The provider instance (`--provider`'s default), which owned Droplets are tagged with.
pub(super) const PROVIDER: &str = "digitalocean";
pub(super) const SIZE: &str = "s-2vcpu-4gb";

/// The emulator of one run, served until dropped on a runtime of its own (so that the bench's
/// waits never delay an answer), and the agent of the walked Droplet.
pub(super) struct Lab {
    pub emulator: Emulator,
    pub addr: SocketAddr,
    stop: CancellationToken,
    dir: PathBuf,
    agent: Option<Process>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Drop for Lab {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl Lab {
    pub(super) async fn start(dir: &Path, setup: &Setup) -> Result<Lab> {
        let emulator = Emulator::new(TOKEN);
        emulator.set_rate_limit(RateLimit::DIGITALOCEAN.time_scaled(setup.scale));
        emulator.set_boot_time(Some(setup.boot));
        // An account whose Droplet limit leaves room for every slot: the runs measure the
        // budget, not the account's headroom (the emulator's own default is a new account's).
        emulator.set_droplet_limit((setup.owned + setup.slots) as u64);
        let (managed, provider) = ("bigfleet-managed", provider_tag());
        for index in 0..setup.owned {
            let machine_id = super::slot_id(PROVIDER, SIZE, REGION, index);
            let machine = machine_tag(&machine_id);
            emulator.insert_droplet(
                &format!("bench-owned-{index}"),
                REGION,
                SIZE,
                &[managed, &machine, &provider],
            );
        }
        let runtime = super::emulator_runtime("do-emulator")?;
        let stop = CancellationToken::new();
        let (served, until) = (emulator.clone(), stop.clone());
        let addr = runtime
            .spawn(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
                let addr = listener.local_addr()?;
                tokio::spawn(served.serve(listener, until));
                Ok::<_, std::io::Error>(addr)
            })
            .await?
            .context("bind the DigitalOcean API emulator")?;
        Ok(Lab {
            emulator,
            addr,
            stop,
            dir: dir.to_owned(),
            agent: None,
            runtime: Some(runtime),
        })
    }

    /// The backend's flags with the bootstrap channel on `bootstrap`.
    pub(super) fn args(&self, root: &Path, bootstrap: u16, offerings: &Path) -> Vec<String> {
        let mut args = backend_args(self.addr, bootstrap, offerings);
        args.extend(bootstrap_args(&crate::e2e::wire::pki_dir(root)));
        args
    }

    /// Boots the agent of `machine_id`'s Droplet from the config the provider put in its
    /// user_data, as cloud-init would.
    pub(super) fn boot_agent(&mut self, agent: &Path, machine_id: &str) -> Result<()> {
        let (_, config) = droplet_of(self.addr, machine_id)?
            .with_context(|| format!("no Droplet in the emulator carries machine {machine_id}"))?;
        let dir = self.dir.join("droplet");
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        self.agent = Some(start_agent_binary(agent, &dir, &config)?);
        Ok(())
    }

    /// Stops the walked Droplet's agent (its Droplet is gone).
    pub(super) fn stop_agent(&mut self) {
        self.agent = None;
    }

    pub(super) fn agent_log(&self) -> String {
        self.agent.as_ref().map(Process::logs).unwrap_or_default()
    }

    pub(super) fn counts(&self) -> Counts {
        self.emulator.requests_by_class()
    }

    /// Spends the hourly limit (and as much of the minute's) as another user of the token
    /// would.
    pub(super) fn spend(&self, spent: Spent) {
        let limit = RateLimit::DIGITALOCEAN.per_hour;
        self.emulator.drain_rate_limit(match spent {
            Spent::Nothing => 0,
            Spent::Half => limit / 2,
            Spent::All => limit,
        });
    }

    pub(super) fn live_hosts(&self) -> usize {
        self.emulator.droplets().len()
    }
}

/// The tags the provider puts on a Droplet it created (its `naming` module): the machine id and
/// the provider instance as lower-case unpadded base32.
fn machine_tag(machine_id: &str) -> String {
    format!("bfmid:{}", super::base32_lower(machine_id.as_bytes()))
}

fn provider_tag() -> String {
    format!("bfprov:{}", super::base32_lower(PROVIDER.as_bytes()))
}

/// The offerings file: one offering of `slots` Droplets.
pub(super) fn offerings(slots: usize) -> String {
    format!(
        r#"[{{"size": "{SIZE}", "region": "{REGION}", "count": {slots}, "resources": {{"cpu": "2", "memory": "4Gi"}}}}]"#
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owned_droplets_carry_the_providers_tags() {
        assert_eq!(provider_tag(), "bfprov:mruwo2lumfwg6y3fmfxa");
        let id = super::super::slot_id(PROVIDER, SIZE, REGION, 7);
        assert_eq!(id, "digitalocean/OnDemand/s-2vcpu-4gb/nyc3/007");
        let tag = machine_tag(&id);
        assert!(tag.starts_with("bfmid:") && tag.len() <= 255);
        assert!(
            tag.bytes()
                .all(|c| c.is_ascii_alphanumeric() || b":_-".contains(&c))
        );
        assert!(offerings(2).contains(r#""count": 2"#));
    }
}

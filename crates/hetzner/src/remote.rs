//! The SSH side of the real backend: find the address SSH goes to (public IPv4, the address
//! on the offering's first private network, or the server's IPv6 address), open the
//! host-key-pinned connection (pinning on first use, recorded before anything is sent), deliver
//! the bootstrap blob and run the hook (Configure), run the readiness command, and drain.

use hcloud::models;
use provider_core::backend::{BackendError, ConfigureOrder, TransitionContext};
use provider_core::machine::Machine;
use tokio::time::Instant;

use crate::cloud::{HetznerCloud, err, ipv4_of, server_id};
use crate::labels;
use crate::resolve::Plan;
use crate::settings::SshAddress;
use crate::ssh::{self, PinnedSession, SshIdentity};

/// The first host address of a server's IPv6 network (`2001:db8:1::/64` -> `2001:db8:1::1`),
/// the address Hetzner configures on the server.
pub fn ipv6_host(net: &str) -> Option<std::net::Ipv6Addr> {
    let prefix = net.split_once('/').map_or(net, |(p, _)| p);
    let base: std::net::Ipv6Addr = prefix.trim().parse().ok()?;
    Some(std::net::Ipv6Addr::from(u128::from(base) | 1))
}

/// The address SSH connects to for a server of `plan`.
pub fn ssh_ip(server: &models::Server, plan: &Plan) -> Result<String, String> {
    let id = server.id;
    match plan.ssh_address {
        SshAddress::Public => ipv4_of(server)
            .ok_or_else(|| format!("server {id} has no public IPv4 for SSH delivery")),
        SshAddress::Private => server
            .private_net
            .iter()
            .find(|p| plan.ssh_network.is_some() && p.network == plan.ssh_network)
            .and_then(|p| p.ip.clone())
            .filter(|ip| !ip.is_empty())
            .ok_or_else(|| {
                format!(
                    "server {id} has no address on network {} for SSH delivery",
                    plan.ssh_network.map(|n| n.to_string()).unwrap_or_default()
                )
            }),
        SshAddress::Ipv6 => server
            .public_net
            .ipv6
            .as_ref()
            .and_then(|v6| ipv6_host(&v6.ip))
            .map(|ip| ip.to_string())
            .ok_or_else(|| format!("server {id} has no public IPv6 for SSH delivery")),
    }
}

impl HetznerCloud {
    /// The server behind `host_id`, checked to belong to `machine`, and the address SSH goes
    /// to (`ssh_address` of its offering).
    pub(crate) async fn resolve_host(
        &self,
        what: &str,
        machine: &Machine,
        host_id: &str,
        deadline: Instant,
    ) -> Result<(models::Server, String), BackendError> {
        let id = server_id(host_id, what)?;
        let server = self
            .api
            .get_server(id, Some(deadline))
            .await
            .map_err(|e| err(format!("{what}: look up server {id}: {e}")))?
            .ok_or_else(|| err(format!("{what}: server {id} not found")))?;
        if !self.is_machines(&server, &machine.id) {
            return Err(err(format!(
                "{what}: server {id} is not labelled as machine {:?} of provider {:?}; refusing to touch it",
                machine.id, self.provider
            )));
        }
        self.claim_if_legacy(&server, deadline)
            .await
            .map_err(|e| err(format!("{what}: claim server {id}: {e}")))?;
        let plan = self
            .plan(&server.server_type.name, &server.location.name, deadline)
            .await
            .map_err(|e| err(format!("{what}: settings of server {id}: {e}")))?;
        let ip = ssh_ip(&server, &plan).map_err(|e| err(format!("{what}: {e}")))?;
        Ok((server, ip))
    }

    /// Opens the pinned SSH connection, pinning on first use when the server has no pin.
    ///
    /// A key trusted on first use is recorded in the `bigfleet-host-key-fp` label before the
    /// connection is handed out: an unrecorded pin would leave every later connection on
    /// trust-on-first-use, so nothing is sent until the label write has succeeded. While it
    /// fails, the connection is closed and the write retried until the transition's deadline;
    /// once recorded, a fresh connection is opened and verified against that pin.
    pub(crate) async fn open_ssh(
        &self,
        identity: &SshIdentity,
        server: &models::Server,
        ip: &str,
        ctx: &TransitionContext,
    ) -> Result<PinnedSession, BackendError> {
        let pin = server
            .labels
            .get(labels::HOST_KEY_FP)
            .filter(|p| !p.is_empty());
        let session = ssh::connect(
            identity,
            ip,
            pin.map(String::as_str),
            self.timing.ssh,
            ctx.deadline,
            &ctx.cancel,
        )
        .await
        .map_err(|e| err(e.to_string()))?;
        if !session.first_use {
            return Ok(session);
        }
        tracing::warn!(server = server.id, fingerprint = %session.observed, "pinning SSH host key on first use (no pre-injected key)");
        let observed = session.observed.clone();
        let record = || {
            self.update_labels(server.id, ctx.deadline, |l| {
                l.insert(labels::HOST_KEY_FP.to_owned(), observed.clone());
            })
        };
        let mut last = match record().await {
            Ok(()) => return Ok(session),
            Err(e) => e,
        };
        // Nothing has been sent over this connection; do not hold it while the write is retried.
        session.close().await;
        loop {
            tracing::warn!(server = server.id, err = %last, "failed to persist TOFU host-key pin; nothing is sent to the server until it is recorded");
            let left = ctx.deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || ctx.cancel.is_cancelled() {
                return Err(err(format!(
                    "ssh {ip}: server {id} presented host key {observed} on first use, but it \
                     could not be recorded in label {label} before the deadline ({last}); \
                     nothing was sent over an unrecorded pin",
                    id = server.id,
                    label = labels::HOST_KEY_FP,
                )));
            }
            tokio::select! {
                _ = tokio::time::sleep(self.timing.ssh.retry_interval.min(left)) => {}
                _ = ctx.cancel.cancelled() => {}
            }
            if ctx.cancel.is_cancelled() {
                continue;
            }
            match record().await {
                Ok(()) => break,
                Err(e) => last = e,
            }
        }
        ssh::connect(
            identity,
            ip,
            Some(&observed),
            self.timing.ssh,
            ctx.deadline,
            &ctx.cancel,
        )
        .await
        .map_err(|e| err(e.to_string()))
    }

    pub(crate) async fn configure(
        &self,
        machine: &Machine,
        host_id: &str,
        order: &ConfigureOrder,
        ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        let Some(identity) = &self.ssh else {
            return Err(err(format!(
                "configure: SSH delivery disabled (set --ssh-key); cannot deliver bootstrap to {host_id}"
            )));
        };
        let (server, ip) = self
            .resolve_host("configure", machine, host_id, ctx.deadline)
            .await?;
        let session = self.open_ssh(identity, &server, &ip, ctx).await?;
        let script = ssh::configure_script(&self.hook, &order.cluster_id, order.blob.0.len());
        let exit = session
            .run(&script, &order.blob.0, ctx.deadline, &ctx.cancel)
            .await
            .map_err(|e| err(e.to_string()))?;
        if exit.status != 0 {
            session.close().await;
            return Err(err(format!(
                "ssh command on {ip} failed: Process exited with status {}",
                exit.status
            )));
        }
        let binding = labels::text_labels(labels::CLUSTER, &order.cluster_id);
        if let Err(e) = self
            .update_labels(server.id, ctx.deadline, |l| {
                labels::set_chunked(l, labels::CLUSTER, binding.clone())
            })
            .await
        {
            session.close().await;
            return Err(err(format!("label cluster binding: {e}")));
        }
        tracing::info!(machine = %machine.id, server = server.id, "bootstrap delivered and hook succeeded");
        if self.readiness_command.is_some() {
            self.ready_sessions.lock().await.insert(server.id, session);
        } else {
            session.close().await;
        }
        Ok(())
    }

    pub(crate) async fn ready(
        &self,
        machine: &Machine,
        host_id: &str,
        ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        let Some(command) = &self.readiness_command else {
            return Ok(());
        };
        let id = server_id(host_id, "readiness")?;
        let kept = self.ready_sessions.lock().await.remove(&id);
        let session = match kept {
            Some(session) => session,
            None => {
                let Some(identity) = &self.ssh else {
                    return Err(err("readiness: SSH delivery disabled (set --ssh-key)"));
                };
                let (server, ip) = self
                    .resolve_host("readiness", machine, host_id, ctx.deadline)
                    .await?;
                self.open_ssh(identity, &server, &ip, ctx).await?
            }
        };
        let ip = session.ip().to_owned();
        let mut last: Option<String> = None;
        let last = loop {
            match session.run(command, b"", ctx.deadline, &ctx.cancel).await {
                Ok(exit) if exit.status == 0 => {
                    session.close().await;
                    return Ok(());
                }
                Ok(exit) => last = Some(format!("last exit status {}", exit.status)),
                // A run cut short by the deadline says less than the one before it.
                Err(e) if last.is_none() || Instant::now() < ctx.deadline => {
                    last = Some(e.to_string())
                }
                Err(_) => {}
            }
            let last = last.clone().unwrap_or_default();
            let left = ctx.deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || ctx.cancel.is_cancelled() {
                break last;
            }
            tokio::select! {
                _ = tokio::time::sleep(self.timing.readiness_poll.min(left)) => {}
                _ = ctx.cancel.cancelled() => break last,
            }
        };
        session.close().await;
        Err(err(format!(
            "readiness: --readiness-command did not succeed on {ip} before the Configure deadline ({last})"
        )))
    }

    pub(crate) async fn drain(
        &self,
        machine: &Machine,
        host_id: &str,
        grace_period_seconds: i64,
        ctx: &TransitionContext,
    ) -> Result<(), BackendError> {
        let Some(identity) = &self.ssh else {
            return Err(err(format!(
                "drain: server {host_id} cannot be drained without --ssh-key: the node would stay \
                 joined to its cluster, so the binding is kept; set --ssh-key and retry"
            )));
        };
        let (server, ip) = self
            .resolve_host("drain", machine, host_id, ctx.deadline)
            .await?;
        if let Some(stale) = self.ready_sessions.lock().await.remove(&server.id) {
            stale.close().await;
        }
        let session = self.open_ssh(identity, &server, &ip, ctx).await?;
        let grace = if grace_period_seconds <= 0 {
            1
        } else {
            grace_period_seconds
        };
        let exit = session
            .run(&ssh::drain_script(grace), b"", ctx.deadline, &ctx.cancel)
            .await;
        session.close().await;
        let exit = exit.map_err(|e| err(e.to_string()))?;
        if exit.status != 0 {
            return Err(err(format!(
                "ssh command on {ip} failed: Process exited with status {}",
                exit.status
            )));
        }
        self.update_labels(server.id, ctx.deadline, |l| {
            labels::remove_chunked(l, labels::CLUSTER)
        })
        .await
        .map_err(|e| err(format!("drain: clear cluster binding: {e}")))?;
        tracing::info!(machine = %machine.id, server = server.id, "node drained and binding cleared");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv6_hosts() {
        assert_eq!(
            ipv6_host("2001:db8:1::/64").unwrap().to_string(),
            "2001:db8:1::1"
        );
        assert_eq!(ipv6_host("::/64").unwrap().to_string(), "::1");
        assert_eq!(ipv6_host("nonsense"), None);
    }
}

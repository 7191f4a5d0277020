//! The SSH side of the real backend: find the address SSH goes to (public IPv4, the address
//! on the offering's first private network, or the server's IPv6 address), open the
//! host-key-pinned connection (pinning on first use, recorded before anything is sent), start
//! the bootstrap hook (Configure) and the drain as detached runs named after the operation and
//! poll their records, and run the readiness command.
//!
//! A Configure or Drain called again with the same operation id (a retry, or the engine resuming
//! it after a restart) first reads the run's record: a finished run gives its recorded outcome,
//! a running one is waited for, and only a run that never started is started. Connections that
//! drop while a run goes on are opened again against the same pin; the run does not notice.

use crate::models;
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
        let run = ssh::configure_run_name(&ctx.operation_id, ctx.configure_nonce.as_deref());
        // Built when sent, so the run's time limit is what is left of the deadline then.
        let start = || {
            ssh::configure_start_script(
                &self.hook,
                &run,
                &order.cluster_id,
                order.blob.0.len(),
                ctx.remaining(),
            )
        };
        let mut link = Link::first(self, identity, &server, &ip, ctx);
        let record = match link.finish(&run, start, &order.blob.0).await {
            Ok(record) => record,
            Err(e) => {
                link.close().await;
                return Err(e);
            }
        };
        if record.status != 0 {
            link.close().await;
            return Err(err(failed(&ip, &record, &order.blob.0)));
        }
        let binding = labels::text_labels(labels::CLUSTER, &order.cluster_id);
        if let Err(e) = self
            .update_labels(server.id, ctx.deadline, |l| {
                labels::set_chunked(l, labels::CLUSTER, binding.clone())
            })
            .await
        {
            link.close().await;
            return Err(err(format!("label cluster binding: {e}")));
        }
        tracing::info!(machine = %machine.id, server = server.id, run = %run, "bootstrap delivered and hook succeeded");
        match link.session.take() {
            Some(session) if self.readiness_command.is_some() => {
                if let Some(stale) = self.ready_sessions.lock().await.insert(server.id, session) {
                    stale.close().await;
                }
            }
            Some(session) => session.close().await,
            None => {}
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
        let Some(identity) = &self.ssh else {
            return Err(err("readiness: SSH delivery disabled (set --ssh-key)"));
        };
        let id = server_id(host_id, "readiness")?;
        let kept = self.ready_sessions.lock().await.remove(&id);
        let resolved;
        let mut link = match kept {
            Some(session) => Link::kept(self, identity, session, ctx),
            None => {
                resolved = self
                    .resolve_host("readiness", machine, host_id, ctx.deadline)
                    .await?;
                Link::first(self, identity, &resolved.0, &resolved.1, ctx)
            }
        };
        let mut last: Option<String> = None;
        let last = loop {
            match link.exec(command, b"").await {
                Ok(Ok(exit)) if exit.status == 0 => {
                    link.close().await;
                    return Ok(());
                }
                Ok(Ok(exit)) => last = Some(format!("last exit status {}", exit.status)),
                // A run cut short by the deadline says less than the one before it.
                Ok(Err(e)) if last.is_none() || Instant::now() < ctx.deadline => last = Some(e),
                Ok(Err(_)) => {}
                Err(e) if last.is_none() => break e.0,
                Err(_) => break last.unwrap_or_default(),
            }
            if !link.pause(self.timing.readiness_poll).await {
                break last.unwrap_or_default();
            }
        };
        link.close().await;
        Err(err(format!(
            "readiness: --readiness-command did not succeed on {ip} before the Configure deadline ({last})",
            ip = link.ip
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
        let grace = if grace_period_seconds <= 0 {
            1
        } else {
            grace_period_seconds
        };
        let run = ssh::run_name("drain", &ctx.operation_id);
        let start = || ssh::drain_start_script(&self.hook, &run, grace, ctx.remaining());
        let mut link = Link::first(self, identity, &server, &ip, ctx);
        let record = link.finish(&run, start, b"").await;
        link.close().await;
        let record = record?;
        if record.status != 0 {
            return Err(err(failed(&ip, &record, b"")));
        }
        self.update_labels(server.id, ctx.deadline, |l| {
            labels::remove_chunked(l, labels::CLUSTER)
        })
        .await
        .map_err(|e| err(format!("drain: clear cluster binding: {e}")))?;
        tracing::info!(machine = %machine.id, server = server.id, run = %run, "node drained and binding cleared");
        Ok(())
    }
}

/// The error of a run that exited non-zero, with the end of its output unless that holds part
/// of `secret`.
fn failed(ip: &str, record: &ssh::RunRecord, secret: &[u8]) -> String {
    let mut message = format!(
        "ssh command on {ip} failed: Process exited with status {}",
        record.status
    );
    if let Some(tail) = ssh::output_tail(&record.tail, secret) {
        message.push_str(&format!(" (output ends: {tail})"));
    }
    message
}

/// The SSH side of one transition: a pinned connection, opened when first needed and opened
/// again (against the same pin) when it drops, until the deadline or cancellation.
struct Link<'a> {
    cloud: &'a HetznerCloud,
    identity: &'a SshIdentity,
    /// The server, for the first connection (which may pin on first use).
    server: Option<&'a models::Server>,
    ip: String,
    ctx: &'a TransitionContext,
    session: Option<PinnedSession>,
    /// The host key of the first connection, which every later one must present.
    pin: Option<String>,
}

impl<'a> Link<'a> {
    fn first(
        cloud: &'a HetznerCloud,
        identity: &'a SshIdentity,
        server: &'a models::Server,
        ip: &str,
        ctx: &'a TransitionContext,
    ) -> Link<'a> {
        Link {
            cloud,
            identity,
            server: Some(server),
            ip: ip.to_owned(),
            ctx,
            session: None,
            pin: None,
        }
    }

    /// A link over a connection an earlier step kept.
    fn kept(
        cloud: &'a HetznerCloud,
        identity: &'a SshIdentity,
        session: PinnedSession,
        ctx: &'a TransitionContext,
    ) -> Link<'a> {
        Link {
            cloud,
            identity,
            server: None,
            ip: session.ip().to_owned(),
            ctx,
            pin: Some(session.observed.clone()),
            session: Some(session),
        }
    }

    /// Runs `command` over the connection, connecting first if there is none. `Err` when no
    /// connection can be had (those attempts are retried inside until the deadline);
    /// `Ok(Err)` when the command did not complete, the connection then being dropped so the
    /// next call opens a fresh one.
    async fn exec(
        &mut self,
        command: &str,
        stdin: &[u8],
    ) -> Result<Result<ssh::Exit, String>, BackendError> {
        let session = match self.session.take() {
            Some(session) => session,
            None => {
                let session = match (&self.pin, self.server) {
                    (Some(pin), _) => ssh::connect(
                        self.identity,
                        &self.ip,
                        Some(pin),
                        self.cloud.timing.ssh,
                        self.ctx.deadline,
                        &self.ctx.cancel,
                    )
                    .await
                    .map_err(|e| err(e.to_string()))?,
                    (None, Some(server)) => {
                        self.cloud
                            .open_ssh(self.identity, server, &self.ip, self.ctx)
                            .await?
                    }
                    (None, None) => return Err(err("ssh: no server to connect to")),
                };
                self.pin = Some(session.observed.clone());
                session
            }
        };
        match session
            .run(command, stdin, self.ctx.deadline, &self.ctx.cancel)
            .await
        {
            Ok(exit) => {
                self.session = Some(session);
                Ok(Ok(exit))
            }
            Err(e) => {
                tracing::debug!(ip = %self.ip, err = %e, "SSH command did not complete; the next one goes over a new connection");
                session.close().await;
                Ok(Err(e.to_string()))
            }
        }
    }

    /// Sleeps `interval` (less if the deadline is nearer); false once the deadline has passed
    /// or the work was cancelled.
    async fn pause(&self, interval: std::time::Duration) -> bool {
        let left = self.ctx.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || self.ctx.cancel.is_cancelled() {
            return false;
        }
        tokio::select! {
            _ = tokio::time::sleep(interval.min(left)) => {}
            _ = self.ctx.cancel.cancelled() => return false,
        }
        Instant::now() < self.ctx.deadline && !self.ctx.cancel.is_cancelled()
    }

    /// Drives the detached run `run` to its recorded outcome: a run that has finished gives
    /// its record at once, a running one is polled, and an absent one is started with the
    /// script `start` makes (fed `stdin`) first. Starting is idempotent on the host, so a start
    /// whose answer was lost is simply probed again.
    async fn finish(
        &mut self,
        run: &str,
        start: impl Fn() -> String,
        stdin: &[u8],
    ) -> Result<ssh::RunRecord, BackendError> {
        let ip = self.ip.clone();
        let probe = ssh::probe_script(&self.cloud.hook, run);
        let mut start_failures = 0;
        let mut announced = false;
        loop {
            if let Ok(exit) = self.exec(&probe, b"").await? {
                if exit.status != 0 {
                    return Err(err(format!(
                        "ssh command on {ip} failed: probing run {run} exited with status {}",
                        exit.status
                    )));
                }
                match ssh::parse_probe(&exit.output) {
                    Some(ssh::RunState::Finished(record)) => {
                        tracing::debug!(ip = %ip, run, status = record.status, "run finished");
                        return Ok(record);
                    }
                    Some(ssh::RunState::Running) => {
                        if !announced {
                            tracing::info!(ip = %ip, run, "run in progress on the host; waiting for its record");
                            announced = true;
                        }
                    }
                    Some(ssh::RunState::Lost) => {
                        return Err(err(format!(
                            "ssh command on {ip} failed: run {run} ended without recording an \
                             outcome (was the server restarted?); it is not run again"
                        )));
                    }
                    Some(ssh::RunState::Absent) => match self.exec(&start(), stdin).await? {
                        Ok(exit) if exit.status == 0 => {
                            tracing::info!(ip = %ip, run, "run started on the host");
                            announced = true;
                            continue;
                        }
                        Ok(exit) if exit.status == 97 => {
                            return Err(err(format!(
                                "ssh command on {ip} failed: Process exited with status 97 (the \
                                 bootstrap blob arrived incomplete; the hook was not run)"
                            )));
                        }
                        Ok(exit) => {
                            // Probe again first: a concurrent start may have won the run.
                            start_failures += 1;
                            if start_failures > 1 {
                                return Err(err(format!(
                                    "ssh command on {ip} failed: Process exited with status {}",
                                    exit.status
                                )));
                            }
                            continue;
                        }
                        Err(_) => {}
                    },
                    None => {
                        return Err(err(format!(
                            "ssh command on {ip} failed: unexpected answer probing run {run}"
                        )));
                    }
                }
            }
            if !self.pause(self.cloud.timing.run_poll).await {
                return Err(err(format!(
                    "ssh command on {ip} did not complete: deadline exceeded"
                )));
            }
        }
    }

    async fn close(&mut self) {
        if let Some(session) = self.session.take() {
            session.close().await;
        }
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

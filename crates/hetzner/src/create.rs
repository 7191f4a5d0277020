//! The create path of the real backend: adopt the server a previous attempt made, else build
//! the create request from the offering's resolved [`Plan`] (image, networks, firewalls,
//! placement group, public IPs, operator labels, login keys), create it (in a spread group
//! when the offering asks for one), wait for `running` and join the subnets chosen per
//! network. A create error (name taken, lost response) is resolved by looking the server up by
//! its labels, never by the name alone.

use std::collections::HashMap;

use crate::models;
use provider_core::backend::{BackendError, Refusal, TransitionContext};
use provider_core::cloud::OwnedHost;
use provider_core::config::Secret;
use provider_core::machine::Machine;
use tokio::time::Instant;

use crate::api::ApiError;
use crate::cloud::{HetznerCloud, err, is_passing};
use crate::hostkey::HostKey;
use crate::labels;
use crate::resolve::Plan;

/// The labels of a new server: the operator's, then ours (which the settings keep apart).
pub fn server_labels(
    plan: &Plan,
    machine_id: &str,
    provider: &str,
    host_key_fp: &str,
) -> HashMap<String, String> {
    let mut out: HashMap<String, String> = plan
        .labels
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    out.insert(labels::MANAGED.into(), "true".into());
    out.extend(labels::machine_id_labels(machine_id));
    out.extend(labels::text_labels(labels::PROVIDER, provider));
    out.insert(labels::HOST_KEY_FP.into(), host_key_fp.to_owned());
    out
}

/// The create request of a server of `plan` (the placement group is set per attempt).
pub fn create_request(
    plan: &Plan,
    name: &str,
    labels: HashMap<String, String>,
    user_data: String,
) -> models::CreateServerRequest {
    models::CreateServerRequest {
        name: name.to_owned(),
        server_type: plan.server_type.clone(),
        image: plan.image.to_string(),
        location: Some(plan.location.clone()),
        user_data: Some(user_data),
        labels: Some(labels),
        networks: (!plan.create_networks.is_empty()).then(|| plan.create_networks.clone()),
        firewalls: (!plan.firewalls.is_empty()).then(|| {
            plan.firewalls
                .iter()
                .map(|id| models::CreateServerRequestFirewalls { firewall: *id })
                .collect()
        }),
        public_net: Some(Box::new(models::CreateServerRequestPublicNet {
            enable_ipv4: Some(plan.public_ipv4),
            enable_ipv6: Some(plan.public_ipv6),
            ipv4: None,
            ipv6: None,
        })),
        ssh_keys: (!plan.login_keys.is_empty()).then(|| plan.login_keys.clone()),
        ..Default::default()
    }
}

/// The plan of an existing server's offering.
async fn existing_plan(
    cloud: &HetznerCloud,
    server: &models::Server,
    deadline: Instant,
) -> Result<std::sync::Arc<Plan>, BackendError> {
    cloud
        .plan(&server.server_type.name, &server.location.name, deadline)
        .await
        .map_err(err)
}

/// The codes of a create call's refusal that mean the type cannot be placed in the location
/// now (docs/hetzner/troubleshooting.md, "Create refusals"): the offering is withdrawn for a
/// backoff and the slot returned.
pub const STOCKOUT_CODES: [&str; 2] = ["resource_unavailable", "placement_error"];

/// The code of a create call's refusal for the project's limit.
pub const LIMIT_CODE: &str = "resource_limit_exceeded";

/// What a create call's failed answer means for the Create (the table of
/// docs/hetzner/troubleshooting.md, "Create refusals", is this function).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CreateOutcome {
    /// The type cannot be placed in the location now: the slot is returned, the offering
    /// withdrawn for a backoff (the code, a metric label).
    Stockout(&'static str),
    /// A project limit (servers, or the primary IPs each server takes): the slot is returned
    /// and the headroom capped (the code, a metric label).
    Limit(&'static str),
    /// Nothing was made, or the answer may have been lost: look the server up by its labels,
    /// adopt it if it exists, else try again while the deadline allows.
    LookUpAndRetry,
    /// The settings or the token are at fault: the machine fails with the answer and what to
    /// fix.
    Fail(&'static str),
}

/// See [`CreateOutcome`]. 429s never get here: the client waits for the budget and repeats.
pub fn create_outcome(e: &ApiError) -> CreateOutcome {
    if e.is_ambiguous() {
        // 5xx (`server_error`, `bad_gateway`, `unavailable`, `maintenance`, `timeout`), a
        // lost or garbled answer: the server may exist.
        return CreateOutcome::LookUpAndRetry;
    }
    let ApiError::Status { code, message, .. } = e else {
        return CreateOutcome::Fail("");
    };
    if let Some(code) = STOCKOUT_CODES.into_iter().find(|c| c == code) {
        return CreateOutcome::Stockout(code);
    }
    match code.as_str() {
        LIMIT_CODE if message.to_ascii_lowercase().contains("primary_ip") => {
            CreateOutcome::Limit("primary_ip_limit")
        }
        LIMIT_CODE => CreateOutcome::Limit(LIMIT_CODE),
        // Another action holds a resource the server joins (a network, a firewall, the spread
        // group), or the name is held: refused without effect, worth another try.
        "uniqueness_error" | "conflict" | "locked" | "rate_limit_exceeded" | "service_error" => {
            CreateOutcome::LookUpAndRetry
        }
        "placement_group_member_limit_reached" => CreateOutcome::Fail(
            "the spread group is full and no other could be opened: add offerings or locations, \
             or use placement none",
        ),
        "invalid_input"
        | "not_found"
        | "primary_ip_assigned"
        | "primary_ip_datacenter_mismatch"
        | "primary_ip_version_mismatch"
        | "server_not_stopped"
        | "network_not_found"
        | "firewall_resource_not_found" => CreateOutcome::Fail(
            "a server setting is refused (image, network, firewall, SSH key, primary IP): \
             `hetzner check` names the one at fault",
        ),
        "unauthorized" | "forbidden" | "token_readonly" => CreateOutcome::Fail(
            "the token may not create servers: give --token a read-write API token of the project",
        ),
        _ => CreateOutcome::Fail(""),
    }
}

impl HetznerCloud {
    /// What a refused create call (an answer, never a lost one) means for the slot: a stockout,
    /// the project's limit (counted: the servers the project holds now), or `None`, a failure
    /// of the machine's own.
    async fn refusal_of(&self, e: &ApiError, deadline: Instant) -> Option<Refusal> {
        let code = match create_outcome(e) {
            CreateOutcome::Stockout(code) => return Some(Refusal::stockout(code)),
            CreateOutcome::Limit(code) => code,
            CreateOutcome::LookUpAndRetry | CreateOutcome::Fail(_) => return None,
        };
        let held = self.api.count_servers("", Some(deadline)).await;
        if let Err(ce) = &held {
            tracing::warn!(err = %ce, "counting the project's servers after a limit refusal failed; taking the servers known as the limit");
        }
        Some(Refusal::account_limit(code, held.ok()))
    }

    /// One create call: straight, or into a spread group of the offering.
    async fn create_server(
        &self,
        plan: &Plan,
        request: &mut models::CreateServerRequest,
        deadline: Instant,
    ) -> Result<models::Server, ApiError> {
        if plan.spread {
            self.spread
                .create_server(&self.api, plan, request, deadline)
                .await
        } else {
            self.api.create_server(request, Some(deadline)).await
        }
    }

    /// Joins the networks the plan places in a chosen subnet, then re-reads the server.
    async fn attach_subnets(
        &self,
        plan: &Plan,
        server: models::Server,
        ctx: &TransitionContext,
    ) -> Result<models::Server, BackendError> {
        let missing: Vec<&(i64, String)> = plan
            .attach
            .iter()
            .filter(|(network, _)| {
                !server
                    .private_net
                    .iter()
                    .any(|p| p.network == Some(*network))
            })
            .collect();
        if missing.is_empty() {
            return Ok(server);
        }
        for (network, range) in missing {
            self.api
                .attach_to_network(server.id, *network, Some(range), Some(ctx.deadline))
                .await
                .map_err(|e| {
                    err(format!(
                        "attach server {} to network {network} subnet {range}: {e}",
                        server.id
                    ))
                })?;
            tracing::info!(server = server.id, network, subnet = %range, "server joined its subnet");
        }
        self.api
            .get_server(server.id, Some(ctx.deadline))
            .await
            .map_err(|e| err(format!("read server {}: {e}", server.id)))?
            .ok_or_else(|| {
                err(format!(
                    "server {} vanished while joining its networks",
                    server.id
                ))
            })
    }

    /// The servers labelled as `machine_id`'s (deleting ones included), oldest first, from a
    /// listing that started after this call (batched with the other machines' reads).
    pub(crate) async fn machine_servers(
        &self,
        machine_id: &str,
        deadline: Instant,
    ) -> Result<Vec<models::Server>, ApiError> {
        // No provider label in the selector: servers of earlier versions lack it, and
        // `is_ours` decides ownership either way. A round shared by many callers meets a run
        // of 429s or 5xx answers as one caller: it is asked again (a new round) while the
        // deadline allows, as each caller's own request would have been.
        let mut attempt = 0;
        let servers = loop {
            attempt += 1;
            match self.machine_reads.servers(machine_id, deadline).await {
                Err(e) if is_passing(&e) => {
                    let wait = self.timing.client.backoff.delay(attempt, None);
                    if Instant::now() + wait >= deadline {
                        return Err(e);
                    }
                    tokio::time::sleep(wait).await;
                }
                other => break other?,
            }
        };
        Ok(servers.into_iter().filter(|s| self.is_ours(s)).collect())
    }

    /// The live server a previous Create made for `machine_id`, if any.
    async fn find_machine_server(
        &self,
        machine_id: &str,
        deadline: Instant,
    ) -> Result<Option<models::Server>, ApiError> {
        let live: Vec<models::Server> = self
            .machine_servers(machine_id, deadline)
            .await?
            .into_iter()
            .filter(|s| s.status != models::server::Status::Deleting)
            .collect();
        if live.len() > 1 {
            let ids: Vec<i64> = live.iter().map(|s| s.id).collect();
            tracing::warn!(machine = machine_id, servers = ?ids, "several servers carry one machine id; using the oldest");
        }
        Ok(live.into_iter().next())
    }

    /// Waits for the server `id` of `machine_id` to run, looking at it on the schedule its
    /// offering's boot time gives (in the batched listing every Create in flight shares). A
    /// server missing from a listing is read directly before it is declared vanished.
    /// `created` is when the create call returned, for learning the boot time; `None` for an
    /// adopted server.
    async fn wait_running(
        &self,
        server: &models::Server,
        machine_id: &str,
        created: Option<Instant>,
        ctx: &TransitionContext,
    ) -> Result<models::Server, BackendError> {
        let id = server.id;
        if server.status == models::server::Status::Running {
            return Ok(server.clone());
        }
        let cap = Instant::now() + self.timing.running_cap;
        let deadline = ctx.deadline.min(cap);
        let offering = &server.server_type.name;
        let mut schedule = self.boot.schedule(
            offering,
            self.timing.running_poll / 2,
            self.timing.running_poll * 2,
        );
        loop {
            let Some(wake) = schedule.next_look(deadline) else {
                tokio::select! {
                    _ = tokio::time::sleep_until(deadline) => {}
                    _ = ctx.cancel.cancelled() => {}
                }
                return Err(if ctx.cancel.is_cancelled() {
                    err(format!("waiting for server {id} to run: cancelled"))
                } else if cap <= ctx.deadline {
                    err(format!(
                        "server {id} did not reach running within {:?}",
                        self.timing.running_cap
                    ))
                } else {
                    err(format!("waiting for server {id} to run: deadline exceeded"))
                });
            };
            tokio::select! {
                _ = tokio::time::sleep_until(wake) => {}
                _ = ctx.cancel.cancelled() => {
                    return Err(err(format!("waiting for server {id} to run: cancelled")));
                }
            }
            // The server exists: a run of 429s or 5xx answers while polling is no reason to
            // give up on it (and leave it running untracked) while the deadline allows more.
            let polled = match self.machine_reads.servers(machine_id, deadline).await {
                Ok(servers) => match servers.into_iter().find(|s| s.id == id) {
                    Some(found) => Ok(Some(found)),
                    // Not in the listing (its labels changed, or it is gone): ask for it.
                    None => self.api.get_server(id, Some(deadline)).await,
                },
                Err(e) => Err(e),
            };
            match polled {
                Ok(Some(found)) if found.status == models::server::Status::Running => {
                    if let Some(created) = created {
                        self.boot.record(offering, created.elapsed());
                    }
                    return Ok(found);
                }
                Ok(Some(_)) => {}
                Ok(None) => return Err(err(format!("server {id} vanished while creating"))),
                Err(e) if is_passing(&e) => {
                    tracing::warn!(server = id, err = %e, "polling the new server failed; polling on");
                }
                Err(e) => return Err(err(format!("poll server {id}: {e}"))),
            }
        }
    }

    /// The cloud named `id` as this Create's server: from now on the out-of-band check expects
    /// it (whatever becomes of the Create, the server exists until a delete of this process or
    /// of someone else), and it goes into the machine's record before anything else is asked
    /// of the cloud.
    async fn host_named(&self, id: &str, ctx: &TransitionContext) -> Result<(), BackendError> {
        self.ledger.created(id);
        ctx.record_host(id).await
    }

    pub(crate) async fn create(
        &self,
        machine: &Machine,
        ctx: &TransitionContext,
    ) -> Result<OwnedHost, BackendError> {
        let deadline = ctx.deadline;
        let server_type = &machine.instance_type;
        let owned = |server: &models::Server| {
            self.to_owned_host(server)
                .ok_or_else(|| err(format!("server {} has no machine-id label", server.id)))
        };
        if let Some(existing) = self
            .find_machine_server(&machine.id, deadline)
            .await
            .map_err(|e| err(format!("look up existing servers: {e}")))?
        {
            tracing::info!(machine = %machine.id, server = existing.id, "adopting the server a previous Create made");
            self.host_named(&existing.id.to_string(), ctx).await?;
            self.claim_if_legacy(&existing, deadline)
                .await
                .map_err(|e| err(format!("claim server {}: {e}", existing.id)))?;
            let server = self.wait_running(&existing, &machine.id, None, ctx).await?;
            let server = match existing_plan(self, &server, deadline).await {
                Ok(plan) => self.attach_subnets(&plan, server, ctx).await?,
                Err(_) => server,
            };
            return owned(&server);
        }
        if !self.locations.contains(&machine.zone) {
            let mut known: Vec<&String> = self.locations.iter().collect();
            known.sort();
            return Err(err(format!(
                "location {:?} is not one of this provider's locations {known:?}",
                machine.zone
            )));
        }
        let plan = self
            .plan(server_type, &machine.zone, deadline)
            .await
            .map_err(err)?;
        let host_key = HostKey::generate().map_err(err)?;
        let user_data = provider_core::userdata::assemble(
            self.base_user_data.as_ref().map(Secret::expose),
            &host_key.cloud_config(),
        );
        let name = labels::server_name(&machine.id);
        let mut request = create_request(
            &plan,
            &name,
            server_labels(&plan, &machine.id, &self.provider, host_key.fingerprint()),
            user_data,
        );
        let mut attempt = 0u32;
        let created = loop {
            attempt += 1;
            match self.create_server(&plan, &mut request, deadline).await {
                Ok(server) => break server,
                Err(e) if create_outcome(&e) == CreateOutcome::LookUpAndRetry => {
                    // The name is taken or the response was lost: the server may exist. Adopt
                    // it only if its labels say it is this machine's. The look-up may outlast
                    // the Create's deadline (a create call cut short by it may still have made
                    // the server): a server it finds is recorded on the machine, FAILED by
                    // then, so it is never left running untracked.
                    let found = self
                        .machine_servers(
                            &machine.id,
                            provider_core::backend::after_deadline(deadline),
                        )
                        .await
                        .map_err(|le| {
                            err(format!(
                                "create server {server_type}: {e}; look up after the failure: {le}"
                            ))
                        })?;
                    if let Some(server) = found
                        .into_iter()
                        .find(|s| s.status != models::server::Status::Deleting)
                    {
                        tracing::info!(machine = %machine.id, server = server.id, err = %e, "create failed but the server exists; adopting it");
                        break server;
                    }
                    // Who holds the name? Only this machine's previous server, still being
                    // deleted, is worth waiting for (as is a name freed in the meantime).
                    if e.code() == Some("uniqueness_error") {
                        let holder = self.api.server_by_name(&name, Some(deadline)).await.map_err(|le| {
                            err(format!("create server {server_type}: {e}; look up the name's holder: {le}"))
                        })?;
                        if let Some(holder) = holder
                            && !(self.is_machines(&holder, &machine.id)
                                && holder.status == models::server::Status::Deleting)
                        {
                            return Err(err(format!(
                                "create server {server_type}: the name {name} is taken by server {} \
                                 that is not labelled as machine {:?} of provider {:?}; refusing to adopt it",
                                holder.id, machine.id, self.provider
                            )));
                        }
                    }
                    let wait = self.timing.client.backoff.delay(attempt, None);
                    if Instant::now() + wait >= deadline
                        || attempt >= self.timing.client.backoff.max_attempts
                    {
                        return Err(err(format!("create server {server_type}: {e}")));
                    }
                    tracing::warn!(machine = %machine.id, err = %e, "create failed without a server; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = ctx.cancel.cancelled() => return Err(err(format!("create server {server_type}: {e}"))),
                    }
                }
                Err(e) => {
                    if let Some(refusal) = self.refusal_of(&e, deadline).await {
                        ctx.refuse(refusal);
                    }
                    return Err(err(match create_outcome(&e) {
                        CreateOutcome::Fail(fix) if !fix.is_empty() => {
                            format!("create server {server_type}: {e} ({fix})")
                        }
                        _ => format!("create server {server_type}: {e}"),
                    }));
                }
            }
        };
        tracing::info!(machine = %machine.id, server = created.id, name = %name, "server created");
        self.host_named(&created.id.to_string(), ctx).await?;
        let server = self
            .wait_running(&created, &machine.id, Some(Instant::now()), ctx)
            .await?;
        let server = self.attach_subnets(&plan, server, ctx).await?;
        owned(&server)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: u16, code: &str, message: &str) -> ApiError {
        ApiError::Status {
            status,
            code: code.into(),
            message: message.into(),
            hint: None,
        }
    }

    /// Every code of the official document a create call can answer, with its outcome.
    #[test]
    fn each_create_answer_has_a_deliberate_outcome() {
        use CreateOutcome::*;
        let cases = [
            (
                412,
                "resource_unavailable",
                "error during placement",
                Stockout("resource_unavailable"),
            ),
            (
                422,
                "placement_error",
                "error during placement",
                Stockout("placement_error"),
            ),
            (
                403,
                "resource_limit_exceeded",
                "server limit exceeded",
                Limit("resource_limit_exceeded"),
            ),
            (
                403,
                "resource_limit_exceeded",
                "primary_ip_limit",
                Limit("primary_ip_limit"),
            ),
            (
                409,
                "uniqueness_error",
                "server name is already used",
                LookUpAndRetry,
            ),
            (409, "conflict", "resource has changed", LookUpAndRetry),
            (
                422,
                "service_error",
                "error within a service",
                LookUpAndRetry,
            ),
            (423, "locked", "resource is locked", LookUpAndRetry),
            (429, "rate_limit_exceeded", "limit reached", LookUpAndRetry),
            (500, "server_error", "internal", LookUpAndRetry),
            (502, "bad_gateway", "bad gateway", LookUpAndRetry),
            (503, "unavailable", "unavailable", LookUpAndRetry),
            (503, "maintenance", "maintenance", LookUpAndRetry),
            (504, "timeout", "timeout", LookUpAndRetry),
        ];
        for (status, code, message, outcome) in cases {
            assert_eq!(
                create_outcome(&answer(status, code, message)),
                outcome,
                "{code}"
            );
        }
        for code in [
            "invalid_input",
            "not_found",
            "primary_ip_assigned",
            "primary_ip_datacenter_mismatch",
            "primary_ip_version_mismatch",
        ] {
            let Fail(fix) = create_outcome(&answer(422, code, "x")) else {
                panic!("{code}");
            };
            assert!(fix.contains("hetzner check"), "{code}: {fix}");
        }
        let Fail(fix) = create_outcome(&answer(422, "placement_group_member_limit_reached", "x"))
        else {
            panic!("placement_group_member_limit_reached");
        };
        assert!(fix.contains("spread group is full"));
        let Fail(fix) = create_outcome(&answer(403, "forbidden", "x")) else {
            panic!("forbidden");
        };
        assert!(fix.contains("read-write API token"));
        assert_eq!(
            create_outcome(&ApiError::Transport("reset".into())),
            LookUpAndRetry
        );
        assert_eq!(create_outcome(&ApiError::Deadline), LookUpAndRetry);
        for code in ["json_error", "protected", "unsupported_error"] {
            assert_eq!(create_outcome(&answer(400, code, "x")), Fail(""), "{code}");
        }
    }
}

//! Shard-like workers: each is one shard (its own shard id and fence sequence) owning a disjoint
//! share of the machines, walking them through the lifecycle as BigFleet would, retrying every
//! acknowledged mutation, and replaying stale tokens now and then.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use fleet_proto::v1alpha1 as pb;
use pb::capacity_provider_client::CapacityProviderClient;
use tokio::sync::watch;
use tokio::time::Instant;
use tonic::transport::Channel;
use tonic::{Code, Status};

use super::check::{Checker, successor};
use super::{CREATE_TIMEOUT, Chance, Tally};
use crate::e2e::wire;

/// How a worker runs `<binary> admin failed release ID --admin-socket PATH`.
#[derive(Clone, Debug)]
pub(crate) struct AdminCommand {
    pub(crate) binary: PathBuf,
    pub(crate) socket: PathBuf,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Create,
    Configure,
    Delete,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Create => "create",
            Kind::Configure => "configure",
            Kind::Delete => "delete",
        }
    }
}

pub(crate) struct Worker {
    pub(crate) shard: String,
    pub(crate) machines: Vec<String>,
    pub(crate) channel: watch::Receiver<Option<Channel>>,
    pub(crate) checker: Arc<Checker>,
    pub(crate) tally: Tally,
    pub(crate) chance: Chance,
    pub(crate) admin: AdminCommand,
}

/// Whether the call got no answer from a handler (the provider is down or restarting); such a
/// request may or may not have been applied.
fn unanswered(status: &Status) -> bool {
    wire::is_transport_refusal(status)
        || matches!(
            status.code(),
            Code::Unavailable | Code::Unknown | Code::Cancelled | Code::DeadlineExceeded
        )
}

impl Worker {
    fn client(&self) -> Option<CapacityProviderClient<Channel>> {
        self.channel
            .borrow()
            .clone()
            .map(CapacityProviderClient::new)
    }

    async fn send(
        &self,
        client: &mut CapacityProviderClient<Channel>,
        kind: Kind,
        id: &str,
        sequence: i64,
    ) -> Result<pb::TransitionAck, Status> {
        let token = (self.shard.clone(), 1, sequence);
        let call = async {
            match kind {
                Kind::Create => client.create(wire::create_request(id, token)).await,
                Kind::Configure => {
                    client
                        .configure(wire::configure_request(
                            id,
                            "soak-cluster",
                            HashMap::new(),
                            token,
                        ))
                        .await
                }
                Kind::Delete => client.delete(wire::delete_request(id, token)).await,
            }
        };
        let _order = self.checker.in_order().await;
        let answer = match tokio::time::timeout(wire::RPC_TIMEOUT, call).await {
            Ok(r) => r.map(tonic::Response::into_inner),
            Err(_) => Err(Status::deadline_exceeded("soak: RPC timed out")),
        };
        match &answer {
            Err(status) if unanswered(status) => self.checker.unanswered(id),
            answer => self
                .checker
                .answered(kind == Kind::Create, id, answer.as_ref()),
        }
        answer
    }

    /// `id` is retired: its capacity came back as `next`, which the worker owns from now on.
    fn take_over(&mut self, id: &str, next: String) {
        self.checker.track(id, &next);
        self.checker.note(&next, format!("the capacity of {id}"));
        if let Some(slot) = self.machines.iter_mut().find(|m| m.as_str() == id) {
            *slot = next;
        }
    }

    /// Polls Get until `id` is not transitional (across restarts), bounded.
    async fn settle(&self, id: &str) -> Option<pb::Machine> {
        let deadline = Instant::now() + CREATE_TIMEOUT + Duration::from_secs(60);
        while Instant::now() < deadline && !self.checker.failed() {
            let got = match self.client() {
                Some(mut client) => {
                    let _order = self.checker.in_order().await;
                    match tokio::time::timeout(
                        wire::RPC_TIMEOUT,
                        client.get(pb::MachineRef { id: id.to_owned() }),
                    )
                    .await
                    {
                        Ok(Ok(m)) => {
                            let m = m.into_inner();
                            self.checker.got(&m);
                            Some(m)
                        }
                        _ => None,
                    }
                }
                None => None,
            };
            if let Some(m) = got
                && !super::is_transitional(wire::state_of(&m))
            {
                return Some(m);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        None
    }

    async fn release(&self, id: &str) -> bool {
        let admin = self.admin.clone();
        let id = id.to_owned();
        let out = tokio::task::spawn_blocking(move || {
            std::process::Command::new(&admin.binary)
                .args(["admin", "failed", "release", &id, "--admin-socket"])
                .arg(&admin.socket)
                .output()
        })
        .await;
        matches!(out, Ok(Ok(o)) if o.status.success())
    }

    pub(crate) async fn run(mut self, end: Instant) -> Result<()> {
        let mut sequence: i64 = 0;
        // Per machine, the newest sequence a handler answered (so the fence mark is at least it).
        let mut fenced: HashMap<String, i64> = HashMap::new();
        while Instant::now() < end && !self.checker.failed() {
            let pause = self.chance.millis(20, 300);
            tokio::time::sleep(pause).await;
            let Some(mut client) = self.client() else {
                continue;
            };
            let id = self.machines[self.chance.below(self.machines.len() as u64) as usize].clone();
            // A replayed token: stale, must be FAILED_PRECONDITION.
            if let Some(&seen) = fenced.get(&id)
                && self.chance.percent(7)
            {
                match self.send(&mut client, Kind::Delete, &id, seen).await {
                    Err(s) if s.code() == Code::FailedPrecondition => {
                        self.tally.add("rpc.stale_token_rejected")
                    }
                    Err(s) if unanswered(&s) => {}
                    other => self.checker.violate(format!(
                        "a stale token (sequence {seen} of {}) on {id} was not refused with FAILED_PRECONDITION: {other:?}",
                        self.shard
                    )),
                }
                continue;
            }
            let order = self.checker.in_order().await;
            let Ok(Ok(machine)) = tokio::time::timeout(
                wire::RPC_TIMEOUT,
                client.get(pb::MachineRef { id: id.clone() }),
            )
            .await
            else {
                continue;
            };
            let machine = machine.into_inner();
            self.checker.got(&machine);
            drop(order);
            let kind = match wire::state_of(&machine) {
                pb::MachineState::Speculative => Kind::Create,
                pb::MachineState::Idle if self.chance.percent(15) => Kind::Configure,
                pb::MachineState::Idle if self.chance.percent(80) => Kind::Delete,
                pb::MachineState::Failed if successor(&machine).is_some() => {
                    // Retired: its capacity is a new id (a refused Create, a release).
                    let next = successor(&machine).expect("checked");
                    self.take_over(&id, next);
                    continue;
                }
                pb::MachineState::Failed => {
                    self.checker.begin(&id);
                    let released = self.release(&id).await;
                    self.tally.add(if released {
                        "admin.release"
                    } else {
                        "admin.release_refused"
                    });
                    let settled = if released {
                        self.settle(&id).await
                    } else {
                        None
                    };
                    self.checker.end(&id, settled.as_ref());
                    if let Some(next) = settled.as_ref().and_then(successor) {
                        self.take_over(&id, next);
                    }
                    continue;
                }
                _ => continue,
            };
            self.checker.begin(&id);
            sequence += 1;
            self.checker.note(
                &id,
                format!(
                    "{} seq {sequence} from {:?}",
                    kind.name(),
                    wire::state_of(&machine)
                ),
            );
            let settled = match self.send(&mut client, kind, &id, sequence).await {
                Ok(ack) => {
                    self.checker.note(&id, format!("ack {}", ack.operation_id));
                    fenced.insert(id.clone(), sequence);
                    self.tally.add(&format!("ack.{}", kind.name()));
                    self.after_ack(
                        &mut client,
                        kind,
                        &id,
                        &ack.operation_id,
                        &mut sequence,
                        &mut fenced,
                    )
                    .await
                }
                Err(s) if s.code() == Code::FailedPrecondition => {
                    self.checker.violate(format!(
                        "a fresh token (sequence {sequence} of {}) on {id} got FAILED_PRECONDITION: {}",
                        self.shard,
                        s.message()
                    ));
                    None
                }
                Err(s) if unanswered(&s) => {
                    self.tally.add("rpc.unanswered");
                    None
                }
                Err(s) => {
                    fenced.insert(id.clone(), sequence);
                    self.tally.add(&format!("rpc.refused.{:?}", s.code()));
                    None
                }
            };
            self.checker.note(
                &id,
                format!(
                    "end: settled {:?} host {:?}",
                    settled.as_ref().map(wire::state_of),
                    settled
                        .as_ref()
                        .and_then(|m| m.host.as_ref())
                        .map(|h| h.r#ref.clone())
                ),
            );
            self.checker.end(&id, settled.as_ref());
            if let Some(next) = settled.as_ref().and_then(successor) {
                self.take_over(&id, next);
            }
        }
        Ok(())
    }

    /// After an acknowledged mutation: retry it at once (same operation id), wait for it to
    /// settle, and retry a settled Delete (still the same operation id: nothing may have undone
    /// it).
    async fn after_ack(
        &self,
        client: &mut CapacityProviderClient<Channel>,
        kind: Kind,
        id: &str,
        operation_id: &str,
        sequence: &mut i64,
        fenced: &mut HashMap<String, i64>,
    ) -> Option<pb::Machine> {
        *sequence += 1;
        self.check_retry(client, kind, id, operation_id, *sequence, fenced, false)
            .await;
        let settled = self.settle(id).await?;
        let state = wire::state_of(&settled);
        self.tally
            .add(&format!("settled.{}.{state:?}", kind.name()));
        if state == pb::MachineState::Failed {
            let cause = failure_cause(&settled.last_error);
            self.tally.add(&format!("failed.{}.{cause}", kind.name()));
        }
        if kind == Kind::Delete && state == pb::MachineState::Speculative {
            *sequence += 1;
            if let Some(mut client) = self.client() {
                self.check_retry(&mut client, kind, id, operation_id, *sequence, fenced, true)
                    .await;
            }
        }
        Some(settled)
    }

    #[allow(clippy::too_many_arguments)]
    async fn check_retry(
        &self,
        client: &mut CapacityProviderClient<Channel>,
        kind: Kind,
        id: &str,
        operation_id: &str,
        sequence: i64,
        fenced: &mut HashMap<String, i64>,
        settled: bool,
    ) {
        match self.send(client, kind, id, sequence).await {
            Ok(again) => {
                fenced.insert(id.to_owned(), sequence);
                if again.operation_id == operation_id {
                    self.tally.add("rpc.retry_same_operation");
                } else if kind == Kind::Create
                    && !settled
                    && self.tally.count("fault.stockout") + self.tally.count("fault.account_limit")
                        > 0
                {
                    // A Create refused for capacity returned its slot to Speculative before
                    // the retry came: from Speculative, a Create is new work.
                    self.tally.add("rpc.retry_after_returned_create");
                } else {
                    self.checker.violate(format!(
                        "a retry of the acknowledged {} {operation_id} on {id}{} returned operation {} (machine now {:?}, host {:?})",
                        kind.name(),
                        if settled { " after it settled" } else { "" },
                        again.operation_id,
                        again.machine.as_ref().map(wire::state_of),
                        again.machine.as_ref().and_then(|m| m.host.as_ref()).map(|h| h.r#ref.clone())
                    ));
                }
            }
            Err(s) if s.code() == Code::FailedPrecondition => self.checker.violate(format!(
                "a retry with a fresh token on {id} got FAILED_PRECONDITION: {}",
                s.message()
            )),
            Err(s) if unanswered(&s) => {}
            Err(_) => {
                // Out of position: the transition already failed. Not a retry position.
                fenced.insert(id.to_owned(), sequence);
                self.tally.add("rpc.retry_after_failure");
            }
        }
    }
}

/// What a FAILED machine's `last_error` blames, in a word, for the run's figures: its deadline,
/// the cloud's refusal, an interrupted run, or something else.
fn failure_cause(last_error: &str) -> &'static str {
    let e = last_error.to_ascii_lowercase();
    if e.contains("timed out") || e.contains("deadline") {
        "deadline"
    } else if e.contains("restart") || e.contains("interrupted") || e.contains("takeover") {
        "interrupted"
    } else if e.contains("refused") || e.contains("rejected") {
        "refused"
    } else {
        "other"
    }
}

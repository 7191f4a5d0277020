//! Replicas on one etcd prefix: each campaigns for the claim (`PREFIX/owner`, attached to its
//! lease); the one that wins leads, the others follow the prefix as warm standbys and answer
//! UNAVAILABLE (docs/ha.md).
//!
//! A term: win the claim → take the state from the follower's copy once it has reached the
//! claim's revision (or read it) → start an engine on it exactly as a restart does (counters
//! continued, interrupted Creates, Drains and Deletes resumed under their operation ids) →
//! reconcile when reconciling is on → serve. The term ends when the claim is no longer held:
//! a keep-alive not confirmed within the TTL less the margin, a commit etcd could not take or
//! refused for want of the claim. The engine then stops acknowledging at once and stops its
//! in-flight work (the next leader resumes it), and the replica becomes a standby — unless a
//! majority of the etcd members refuse connections (etcd is down for everyone, so nobody else
//! can lead): then it keeps answering reads from memory while that lasts (`Role::Degraded`).
//! It campaigns again either way, and wins the claim with a fresh read.
//!
//! A transaction etcd refuses for what it is (too large for `--max-request-bytes`) is no reason
//! to step down: the claim is kept, the engine that built it (poisoned by the failed commit) is
//! replaced by one on a fresh read of the state under the same claim, as a takeover would.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::follow::Follower;
use super::keys::Keys;
use super::target::{self, Client, EtcdArgs};
use super::{
    Attempt, EtcdStore, Guarded, TxnLimits, guard, holder, new_token, read_state, release, revoke,
    try_claim,
};
use crate::persistence::store::SharedStore;
use crate::rules::records::Snapshot;
use crate::runtime::engine::Engine;
use crate::runtime::replica::{OutageCheck, Replica, Role};

/// How often a replica that does not lead looks at the claim.
const CAMPAIGN_EVERY: Duration = Duration::from_millis(100);
/// How long a takeover waits for the follower's copy to reach the claim's revision before it
/// reads the prefix itself.
const CATCH_UP: Duration = Duration::from_secs(2);

/// Starts an engine on a claimed store (the binary's backend and options).
pub type StartEngine = Box<
    dyn Fn(
            SharedStore,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<Arc<Engine>, String>> + Send>,
        > + Send
        + Sync,
>;

/// What a replica needs besides the etcd flags.
pub struct ReplicaSetup {
    pub replica: Arc<Replica>,
    pub start_engine: StartEngine,
    /// Reconcile with the cloud before serving (when reconciling is on).
    pub reconcile: bool,
    /// How long a leader that shuts down waits for in-flight transitions.
    pub shutdown_grace: Duration,
}

/// Checks the address and flags and connects (lazily): errors surface before any port binds.
pub fn prepare(state: &str, args: &EtcdArgs) -> Result<Prepared, String> {
    args.validate()?;
    let target = target::parse(state)?;
    let client = target::connect(&target, args)?;
    Ok(Prepared {
        describe: target.describe(),
        keys: Keys::new(&target.prefix),
        client,
        ttl_seconds: args.ttl_seconds(),
        limits: TxnLimits::of(args.etcd_max_request_bytes),
    })
}

/// A checked etcd address, connected.
pub struct Prepared {
    describe: String,
    keys: Keys,
    client: Client,
    ttl_seconds: i64,
    limits: TxnLimits,
}

impl std::fmt::Debug for Prepared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prepared")
            .field("state", &self.describe)
            .finish_non_exhaustive()
    }
}

/// The current term's leadership.
struct Term {
    engine: Arc<Engine>,
    store: Arc<EtcdStore>,
    hold: Arc<super::Hold>,
    lease: i64,
    token: Vec<u8>,
}

/// Runs the replica until `stop`: campaigns, leads, steps down, campaigns again.
pub async fn run(prepared: Prepared, setup: ReplicaSetup, stop: CancellationToken) {
    let Prepared {
        describe,
        keys,
        client,
        ttl_seconds,
        limits,
    } = prepared;
    let replica = setup.replica.clone();
    let telemetry = replica.telemetry();
    let outage: OutageCheck = {
        let client = client.clone();
        Arc::new(move || client.quorum_refused())
    };
    // The lease and token of the last term, so a replica that lost its hold but whose claim is
    // still in etcd can give it up at once instead of waiting for the TTL.
    let mut previous: Option<(i64, Vec<u8>)> = None;
    let mut follower = Some(Follower::start(
        client.clone(),
        keys.clone(),
        replica.warmth(),
    ));
    let mut announced_standby = false;
    loop {
        // Campaign.
        let started;
        let claim = loop {
            if stop.is_cancelled() {
                return;
            }
            if !outage() && replica.stand_by_if_degraded() {
                tracing::warn!(
                    state = describe,
                    "standby: the etcd members no longer refuse connections; answering as a \
                     standby until this replica leads again"
                );
            }
            let attempt_started = Instant::now();
            let seen = holder(&client, &keys).await;
            match seen {
                Ok(Some(value)) => {
                    if let Some((lease, token)) = &previous
                        && *token == value
                    {
                        tracing::info!(
                            state = describe,
                            "state: giving up this replica's earlier claim before campaigning again"
                        );
                        revoke(&client, *lease).await;
                        previous = None;
                        continue;
                    }
                    if replica.role() != Role::Standby {
                        replica.stand_by();
                    }
                    if !announced_standby {
                        tracing::info!(
                            state = describe,
                            leader = %String::from_utf8_lossy(&value),
                            "standby: another replica leads; following the state"
                        );
                        announced_standby = true;
                    }
                }
                Ok(None) => {
                    let token = new_token();
                    match try_claim(&client, &keys, ttl_seconds, &token).await {
                        Ok(Attempt::Won(claim)) => {
                            started = attempt_started;
                            break claim;
                        }
                        Ok(Attempt::Held(_)) => continue,
                        Err(e) => {
                            tracing::warn!(state = describe, error = %e, "campaign: etcd did not answer");
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(state = describe, error = %e, "campaign: etcd did not answer");
                }
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(CAMPAIGN_EVERY) => {}
            }
        };
        announced_standby = false;
        let (lease, token, at) = (claim.lease, claim.token.clone(), claim.revision);
        let (guarded, keep_alive) = guard(
            client.clone(),
            keys.clone(),
            claim,
            describe.clone(),
            limits,
        );
        let hold = guarded.hold.clone();
        // Take the state: the follower's copy once it saw our own claim, or a full read.
        // Leading: the follower stops either way.
        let copied = match follower.take() {
            Some(f) => f.into_snapshot_at(&keys, at, CATCH_UP).await,
            None => None,
        };
        let snapshot = match copied {
            Some(s) => Ok(s),
            None => read_state(&client, &keys).await,
        };
        let snapshot = match snapshot {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(state = describe, error = %e, "takeover: could not read the state; giving the claim up");
                keep_alive.cancel();
                revoke(&client, lease).await;
                follower = Some(Follower::start(
                    client.clone(),
                    keys.clone(),
                    replica.warmth(),
                ));
                back_off(&stop).await;
                continue;
            }
        };
        let machines = snapshot.slots.len();
        let (engine, store) = match start_term(&setup, guarded, keep_alive, snapshot).await {
            Ok(started) => started,
            Err(e) => {
                tracing::error!(state = describe, error = %e, "takeover: the engine did not start on the state; giving the claim up");
                follower = Some(Follower::start(
                    client.clone(),
                    keys.clone(),
                    replica.warmth(),
                ));
                back_off(&stop).await;
                continue;
            }
        };
        let check = hold.clone();
        let held = Arc::new(move || check.is_held());
        replica.lead(engine.clone(), held.clone(), outage.clone());
        let took = started.elapsed();
        telemetry.takeover(took);
        tracing::info!(
            state = describe,
            machines,
            etcd_revision = at,
            took_ms = took.as_millis() as u64,
            "leader: claimed the state; serving"
        );
        let mut term = Term {
            engine,
            store,
            hold,
            lease,
            token,
        };
        // Lead until the claim goes or the process stops.
        loop {
            tokio::select! {
                _ = term.hold.lost() => break,
                _ = term.store.refused() => {
                    match renew(&setup, &client, &keys, &term).await {
                        Ok((engine, store)) => {
                            replica.lead(engine.clone(), held.clone(), outage.clone());
                            term.engine = engine;
                            term.store = store;
                            tracing::info!(
                                state = describe,
                                "leader: serving on with a fresh read of the state after etcd refused a commit"
                            );
                        }
                        Err(e) => {
                            term.hold.lose(format!(
                                "etcd refused a commit, and restarting on a fresh read of the \
                                 state failed: {e}"
                            ));
                            break;
                        }
                    }
                }
                _ = stop.cancelled() => {
                    shut_down(term, setup.shutdown_grace).await;
                    return;
                }
            }
        }
        term.engine.step_down();
        telemetry.step_down();
        let degraded = outage();
        if degraded {
            replica.degrade(outage.clone());
        } else {
            replica.stand_by();
        }
        tracing::error!(
            state = describe,
            why = term.hold.loss(),
            "leader: the claim on the state is no longer held; acknowledging nothing more, {}",
            if degraded {
                "answering reads from memory while a majority of the etcd members refuse \
                 connections (etcd is down for everyone)"
            } else {
                "answering as a standby (etcd may have a quorum that this replica cannot reach)"
            }
        );
        if degraded {
            watch_degraded(replica.clone(), outage.clone());
        }
        let _ = term.store.release_bounded().await;
        previous = Some((term.lease, term.token.clone()));
        drop(term);
        follower = Some(Follower::start(
            client.clone(),
            keys.clone(),
            replica.warmth(),
        ));
    }
}

/// Starts the store and the engine of a term on a claim and the state read under it; gives the
/// claim up when the engine does not start.
async fn start_term(
    setup: &ReplicaSetup,
    guarded: Guarded,
    keep_alive: CancellationToken,
    snapshot: Snapshot,
) -> Result<(Arc<Engine>, Arc<EtcdStore>), String> {
    setup.replica.taking_over(&snapshot);
    let hold = guarded.hold.clone();
    let store = Arc::new(EtcdStore::claimed(guarded, keep_alive, snapshot));
    match (setup.start_engine)(store.clone() as SharedStore).await {
        Ok(engine) => {
            if setup.reconcile && hold.is_held() {
                match tokio::time::timeout(Duration::from_secs(5), engine.reconcile()).await {
                    Ok(Ok(report)) => {
                        tracing::info!(?report, "takeover: reconciled with the cloud")
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(error = %e, "takeover: reconcile failed; the periodic reconcile retries")
                    }
                    Err(_) => tracing::warn!(
                        "takeover: reconcile took longer than 5s; serving, the periodic reconcile continues"
                    ),
                }
            }
            Ok((engine, store))
        }
        Err(e) => {
            let _ = store.release_bounded().await;
            Err(e)
        }
    }
}

/// After etcd refused a commit of this term: the engine stops (it acknowledges nothing after a
/// failed commit), and a new one starts on a fresh read under the same claim.
async fn renew(
    setup: &ReplicaSetup,
    client: &Client,
    keys: &Keys,
    term: &Term,
) -> Result<(Arc<Engine>, Arc<EtcdStore>), String> {
    term.engine.step_down();
    let (guarded, keep_alive) = term
        .store
        .hand_over()
        .await
        .ok_or("the store's writer had stopped")?;
    let snapshot = match read_state(client, keys).await {
        Ok(s) => s,
        Err(e) => {
            release(&guarded, &keep_alive).await;
            return Err(e);
        }
    };
    start_term(setup, guarded, keep_alive, snapshot).await
}

/// While degraded, turns the replica into a standby as soon as the evidence that etcd is down
/// for everyone goes (the campaign loop may be waiting on etcd meanwhile).
fn watch_degraded(replica: Arc<Replica>, outage: OutageCheck) {
    tokio::spawn(async move {
        while replica.role() == Role::Degraded {
            if !outage() && replica.stand_by_if_degraded() {
                tracing::warn!(
                    "standby: the etcd members no longer refuse connections; answering as a \
                     standby until this replica leads again"
                );
                return;
            }
            tokio::time::sleep(CAMPAIGN_EVERY).await;
        }
    });
}

/// A leader's graceful stop: wait for in-flight work within the grace, then give the claim up so
/// a standby takes over at once.
async fn shut_down(term: Term, grace: Duration) {
    let unfinished = term.engine.shutdown(grace).await;
    if unfinished > 0 {
        tracing::warn!(
            unfinished,
            "shutdown grace ran out; the next leader resumes the unfinished transitions"
        );
    }
    if let Err(e) = term.store.release_bounded().await {
        tracing::warn!(error = %e, "state store release at shutdown");
    }
}

async fn back_off(stop: &CancellationToken) {
    tokio::select! {
        _ = stop.cancelled() => {}
        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
    }
}

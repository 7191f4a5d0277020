//! The state store behind `--state etcd://HOST:PORT[,HOST:PORT…]/PREFIX`: the same facts as
//! the local log (machines, fence marks, operation ids, counters) as keys under a prefix of an
//! etcd cluster (layout in `keys.rs`; operator view in docs/ha.md).
//!
//! # One writer
//!
//! A provider claims the prefix before it reads it: it puts `PREFIX/owner` with a random token,
//! attached to an etcd lease it keeps alive every TTL/4, and only if the key does not exist. A
//! second provider started on the same prefix waits for the claim to go (a killed provider's
//! lease runs out within the TTL) and refuses to start if it does not. Every commit is a
//! transaction guarded by `value(PREFIX/owner) == token`, so a provider whose claim expired
//! (paused, partitioned) can never write again: its commit is refused by etcd and the store
//! fails, which stops the engine acknowledging.
//!
//! # Group commit
//!
//! Batches queued while a transaction is in flight are committed together in the next one, so
//! the cost per mutation stays flat with the inventory. A transaction holds whole batches, up to
//! etcd's default limits (128 operations, 1.5 MiB per request); a group larger than that is
//! committed as several guarded transactions in order, and a single batch larger than that (a
//! first seed, a reconcile of many machines) is split with the counters first and fence marks
//! before machines, so a crash in between never leaves a machine whose fence or operation
//! counter is behind it. A commit is acknowledged only after all its transactions succeeded.
//!
//! # Failures
//!
//! A request that fails because etcd is electing a leader ("request timed out", unavailable)
//! is retried a bounded number of times; every transaction is idempotent (puts and deletes of
//! fixed values under the guard), so a retry of one that did apply is harmless. When the
//! retries run out the commit fails, and so does every later one: batches must become durable
//! in order.

mod follow;
pub mod ha;
mod keys;
mod target;
mod transfer;

#[cfg(test)]
mod ha_tests;
#[cfg(any(test, feature = "etcd-testing"))]
#[doc(hidden)]
pub mod testing;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use etcd_proto::etcdserverpb as pb;
use pb::compare::{CompareResult, CompareTarget, TargetUnion};
use pb::request_op::Request;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;

pub use target::{EtcdArgs, is_etcd};
pub use transfer::{export_json, import};

/// The value encodings of the records under the prefix (machine slots, fence marks, the meta
/// record), for the fuzz targets and tools that read a prefix without a store.
pub mod records {
    pub use super::keys::{
        Meta, decode_fence, decode_meta, decode_slot, encode_fence, encode_meta, encode_slot,
    };
}

use keys::{KeyKind, Keys, Meta};
use target::{Client, Target};

use crate::persistence::store::{Commit, Store, StoreError};
use crate::rules::records::{Change, FenceRecord, Snapshot};

/// etcd's default `--max-txn-ops`.
pub(crate) const MAX_TXN_OPS: usize = 128;
/// The bytes of the writes of one transaction under etcd's default `--max-request-bytes`, with
/// a guard of the longest token ([`TxnLimits::of`]).
#[cfg(test)]
pub(crate) const MAX_TXN_BYTES: usize = TxnLimits::DEFAULT.txn_bytes;

/// The size limits of one transaction, from `--etcd-max-request-bytes`.
///
/// etcd measures a request as the raft entry it proposes: the transaction with a small header
/// (request id, user name, auth revision). A transaction is its guard (the owner key and the
/// claim's token) plus its writes; [`write_size`] is an upper bound of one write's encoding
/// (key and value plus at most 24 bytes of tags and lengths), and [`FIXED_BYTES`] bounds the
/// rest: the raft header, the guard's framing, and the owner key and token of any prefix and
/// host name the claim can have (an owner key of at most 1 KiB, a token of at most 256 bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TxnLimits {
    /// The largest request etcd accepts (`--max-request-bytes`).
    pub request_bytes: usize,
    /// The bytes the writes of one transaction may take.
    pub txn_bytes: usize,
}

/// Everything in a transaction's request that is not one of its writes (see [`TxnLimits`]).
const FIXED_BYTES: usize = 2048;

impl TxnLimits {
    #[cfg(test)]
    const DEFAULT: TxnLimits = TxnLimits::of(target::DEFAULT_MAX_REQUEST_BYTES);

    pub(crate) const fn of(request_bytes: usize) -> TxnLimits {
        TxnLimits {
            request_bytes,
            txn_bytes: request_bytes.saturating_sub(FIXED_BYTES),
        }
    }

    /// The largest machine record (the slot's durable encoding; its value under
    /// `PREFIX/m/<id>` adds one format byte) whose Configure still fits one transaction: the
    /// writes' room less the fence mark, the counters, the record's own key and format byte,
    /// with `shard_id` and `machine_id` at their limits (the fence key escapes every byte of
    /// both, three bytes each, in the worst case).
    pub(crate) fn max_record_bytes(&self, keys: &Keys) -> usize {
        let id = "/".repeat(crate::rules::limits::MAX_ID_BYTES);
        let fence = write_size(
            &keys.fence(&id, &id),
            Some(&keys::encode_fence(
                &id,
                &id,
                crate::rules::fence::HighWaterMark {
                    epoch: i64::MAX,
                    sequence: i64::MAX,
                },
            )),
        );
        let counters = write_size(
            &keys.meta(),
            Some(&keys::encode_meta(Meta {
                revision: i64::MAX,
                next_op: u64::MAX,
            })),
        );
        let slot_key = write_size(&keys.slot(&id), None);
        self.txn_bytes
            .saturating_sub(fence + counters + slot_key + 1)
    }
}
/// Attempts of one request before etcd counts as unavailable.
const ATTEMPTS: u32 = 6;
/// Keys read per page when loading (a page stays far below the gRPC message limit).
const PAGE: i64 = 2000;

/// A gRPC failure that a retry may cure: no leader yet, a member down (a connection that broke
/// surfaces as `Unknown` "transport error"), a request timeout.
fn retryable(status: &tonic::Status) -> bool {
    use tonic::Code;
    let message = status.message();
    matches!(
        status.code(),
        Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Aborted
    ) || (status.code() == Code::Unknown && message.contains("transport error"))
        || message.contains("request timed out")
        || message.contains("leader changed")
        || message.contains("no leader")
        || message.contains("timed out")
}

/// etcd's refusal of the request itself: it would refuse it again, whoever sent it and however
/// often (too large for `--max-request-bytes` or the gRPC limit, too many operations, a
/// duplicate key). Retrying it is useless and it says nothing about the claim.
fn refuses_the_request(status: &tonic::Status) -> bool {
    use tonic::Code;
    let message = status.message();
    match status.code() {
        Code::InvalidArgument => true,
        Code::ResourceExhausted | Code::OutOfRange => {
            message.contains("larger than max") || message.contains("too large")
        }
        _ => false,
    }
}

/// Why an etcd request failed for good.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RequestError {
    /// etcd refused this request itself ([`refuses_the_request`]); etcd is fine.
    Refused(String),
    /// etcd did not take the request: unreachable, no leader, out of attempts, or an answer
    /// that a retry cannot cure.
    Failed(String),
}

impl From<RequestError> for String {
    fn from(error: RequestError) -> String {
        match error {
            RequestError::Refused(m) | RequestError::Failed(m) => m,
        }
    }
}

/// Runs `request` until it succeeds, fails for good or the attempts run out (backoff 100 ms
/// doubling up to 1 s: about 3 s in all, longer than an etcd leader election).
async fn retry<T, F, Fut>(client: &Client, what: &str, request: F) -> Result<T, String>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    retry_classified(client, what, request)
        .await
        .map_err(String::from)
}

/// [`retry`], telling a refusal of the request itself from etcd not taking it.
async fn retry_classified<T, F, Fut>(
    client: &Client,
    what: &str,
    mut request: F,
) -> Result<T, RequestError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    let mut delay = Duration::from_millis(100);
    let mut attempt = 1;
    loop {
        let at = client.at();
        match request().await {
            Ok(response) => {
                client.answered(at);
                return Ok(response.into_inner());
            }
            Err(status) if attempt < ATTEMPTS && retryable(&status) => {
                client.failed_with(at, &status);
                tracing::debug!(what, attempt, member = at, code = ?status.code(), message = status.message(), "etcd request failed; retrying on the next member");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(1));
                attempt += 1;
            }
            Err(status) => {
                let message = format!(
                    "{what}: etcd answered {:?}: {} (after {attempt} attempt{})",
                    status.code(),
                    status.message(),
                    if attempt == 1 { "" } else { "s" }
                );
                if refuses_the_request(&status) {
                    client.answered(at);
                    return Err(RequestError::Refused(message));
                }
                if retryable(&status) {
                    client.failed_with(at, &status);
                } else {
                    client.answered(at);
                }
                return Err(RequestError::Failed(message));
            }
        }
    }
}

/// One write of a transaction: a put, or a delete when the value is `None`.
type Writes = BTreeMap<Vec<u8>, Option<Vec<u8>>>;

/// The writes of one or more whole batches, coalesced (a later write to a key wins).
#[derive(Default)]
struct Pending {
    meta: Option<Meta>,
    writes: Writes,
    /// An upper bound of the request size.
    bytes: usize,
}

fn write_size(key: &[u8], value: Option<&Vec<u8>>) -> usize {
    key.len() + value.map_or(0, Vec::len) + 24
}

impl Pending {
    fn of(keys: &Keys, batch: Vec<Change>) -> Pending {
        let mut pending = Pending::default();
        for change in batch {
            let (key, value) = match change {
                Change::PutSlot(slot) => {
                    (keys.slot(&slot.machine.id), Some(keys::encode_slot(&slot)))
                }
                Change::RemoveSlot(id) => (keys.slot(&id), None),
                Change::PutFence {
                    shard_id,
                    machine_id,
                    mark,
                } => (
                    keys.fence(&shard_id, &machine_id),
                    Some(keys::encode_fence(&shard_id, &machine_id, mark)),
                ),
                // An evicted mark of an unknown machine id (fence::unknown_ids).
                Change::RemoveFence {
                    shard_id,
                    machine_id,
                } => (keys.fence(&shard_id, &machine_id), None),
                Change::Counters { revision, next_op } => {
                    let meta = Meta { revision, next_op };
                    if pending.meta.is_none() {
                        pending.bytes += write_size(&keys.meta(), Some(&keys::encode_meta(meta)));
                    }
                    pending.meta = Some(meta);
                    continue;
                }
            };
            pending.put(key, value);
        }
        pending
    }

    fn put(&mut self, key: Vec<u8>, value: Option<Vec<u8>>) {
        self.bytes += write_size(&key, value.as_ref());
        self.writes.insert(key, value);
    }

    fn ops(&self) -> usize {
        self.writes.len() + usize::from(self.meta.is_some())
    }

    fn is_empty(&self) -> bool {
        self.ops() == 0
    }

    fn fits(&self, limits: TxnLimits) -> bool {
        self.ops() <= MAX_TXN_OPS && self.bytes <= limits.txn_bytes
    }

    fn fits_with(&self, other: &Pending, limits: TxnLimits) -> bool {
        self.ops() + other.ops() <= MAX_TXN_OPS && self.bytes + other.bytes <= limits.txn_bytes
    }

    fn merge(&mut self, other: Pending) {
        if other.meta.is_some() {
            self.meta = other.meta;
        }
        self.bytes += other.bytes;
        self.writes.extend(other.writes);
    }

    /// The writes in commit order: the counters first, then fence marks (`f/` sorts before
    /// `m/`), then machines.
    fn into_ops(self, keys: &Keys) -> Vec<pb::RequestOp> {
        let meta = self
            .meta
            .map(|meta| (keys.meta(), Some(keys::encode_meta(meta))));
        meta.into_iter()
            .chain(self.writes)
            .map(|(key, value)| op(key, value))
            .collect()
    }
}

fn op(key: Vec<u8>, value: Option<Vec<u8>>) -> pb::RequestOp {
    let request = match value {
        Some(value) => Request::RequestPut(pb::PutRequest {
            key,
            value,
            lease: 0,
        }),
        None => Request::RequestDeleteRange(pb::DeleteRangeRequest {
            key,
            range_end: Vec::new(),
        }),
    };
    pb::RequestOp {
        request: Some(request),
    }
}

/// Packs batches into transactions: whole batches while they fit, a batch too large for one
/// transaction on its own split in commit order.
fn plan(keys: &Keys, batches: Vec<Vec<Change>>, limits: TxnLimits) -> Vec<Vec<pb::RequestOp>> {
    let mut txns = Vec::new();
    let mut current = Pending::default();
    for batch in batches {
        let next = Pending::of(keys, batch);
        if next.is_empty() {
            continue;
        }
        if current.fits_with(&next, limits) {
            current.merge(next);
            continue;
        }
        if !current.is_empty() {
            txns.push(std::mem::take(&mut current).into_ops(keys));
        }
        if next.fits(limits) {
            current = next;
        } else {
            txns.extend(split(next.into_ops(keys), limits));
        }
    }
    if !current.is_empty() {
        txns.push(current.into_ops(keys));
    }
    txns
}

fn op_size(op: &pb::RequestOp) -> usize {
    match &op.request {
        Some(Request::RequestPut(put)) => put.key.len() + put.value.len() + 24,
        Some(Request::RequestDeleteRange(delete)) => delete.key.len() + 24,
        _ => 24,
    }
}

/// Cuts an ordered list of writes into transactions within the limits, keeping the order.
fn split(ops: Vec<pb::RequestOp>, limits: TxnLimits) -> Vec<Vec<pb::RequestOp>> {
    let mut txns = Vec::new();
    let mut current = Vec::new();
    let mut bytes = 0;
    for op in ops {
        let size = op_size(&op);
        if !current.is_empty() && (current.len() == MAX_TXN_OPS || bytes + size > limits.txn_bytes)
        {
            txns.push(std::mem::take(&mut current));
            bytes = 0;
        }
        bytes += size;
        current.push(op);
    }
    if !current.is_empty() {
        txns.push(current);
    }
    txns
}

/// A provider's claim on a prefix: `PREFIX/owner` holds `token`, attached to `lease`.
#[derive(Clone, Debug)]
pub(crate) struct Claim {
    pub lease: i64,
    pub token: Vec<u8>,
    pub ttl: Duration,
    /// When the lease grant was sent: etcd's clock for the lease starts after it.
    pub granted_at: Instant,
    /// The etcd revision at which the claim was written (the start of this term).
    pub revision: i64,
}

/// The outcome of one attempt to claim the prefix.
pub(crate) enum Attempt {
    Won(Claim),
    /// Another provider holds the claim (its description).
    Held(String),
}

/// A fresh claim token naming this process.
pub(crate) fn new_token() -> Vec<u8> {
    format!(
        "pid {} on {} token {:032x}",
        std::process::id(),
        hostname(),
        rand::random::<u128>()
    )
    .into_bytes()
}

/// One attempt to create `PREFIX/owner` under a freshly granted lease (a lease held while
/// waiting could expire before it is used). Errors are etcd failures after the retries.
pub(crate) async fn try_claim(
    client: &Client,
    keys: &Keys,
    ttl_seconds: i64,
    token: &[u8],
) -> Result<Attempt, String> {
    let owner = keys.owner();
    let granted_at = Instant::now();
    let grant = retry(client, "grant the claim lease", || {
        let mut lease = client.lease();
        async move {
            lease
                .lease_grant(pb::LeaseGrantRequest {
                    ttl: ttl_seconds,
                    id: 0,
                })
                .await
        }
    })
    .await?;
    if !grant.error.is_empty() {
        return Err(format!("grant the claim lease: {}", grant.error));
    }
    let request = pb::TxnRequest {
        compare: vec![pb::Compare {
            result: CompareResult::Equal as i32,
            target: CompareTarget::Create as i32,
            key: owner.clone(),
            target_union: Some(TargetUnion::CreateRevision(0)),
            range_end: Vec::new(),
        }],
        success: vec![pb::RequestOp {
            request: Some(Request::RequestPut(pb::PutRequest {
                key: owner.clone(),
                value: token.to_vec(),
                lease: grant.id,
            })),
        }],
        failure: vec![pb::RequestOp {
            request: Some(Request::RequestRange(pb::RangeRequest {
                key: owner.clone(),
                ..Default::default()
            })),
        }],
    };
    let response = retry(client, "claim the state prefix", || {
        let (mut kv, request) = (client.kv(), request.clone());
        async move { kv.txn(request).await }
    })
    .await;
    let response = match response {
        Ok(r) => r,
        Err(e) => {
            revoke(client, grant.id).await;
            return Err(e);
        }
    };
    if response.succeeded {
        return Ok(Attempt::Won(Claim {
            lease: grant.id,
            token: token.to_vec(),
            ttl: Duration::from_secs(grant.ttl.max(1) as u64),
            granted_at,
            revision: response.header.as_ref().map_or(0, |h| h.revision),
        }));
    }
    revoke(client, grant.id).await;
    let holder = response
        .responses
        .iter()
        .find_map(|r| match &r.response {
            Some(pb::response_op::Response::ResponseRange(range)) => range.kvs.first(),
            _ => None,
        })
        .map(|kv| String::from_utf8_lossy(&kv.value).into_owned())
        .unwrap_or_else(|| "unknown".into());
    Ok(Attempt::Held(holder))
}

/// Who holds `PREFIX/owner` now (`None` when nobody does).
pub(crate) async fn holder(client: &Client, keys: &Keys) -> Result<Option<Vec<u8>>, String> {
    let request = pb::RangeRequest {
        key: keys.owner(),
        ..Default::default()
    };
    let page = retry(client, "read the claim", || {
        let (mut kv, request) = (client.kv(), request.clone());
        async move { kv.range(request).await }
    })
    .await?;
    Ok(page.kvs.into_iter().next().map(|kv| kv.value))
}

/// Claims `PREFIX/owner`, waiting up to `wait` for an earlier claim to go.
pub(crate) async fn claim(
    client: &Client,
    keys: &Keys,
    ttl_seconds: i64,
    describe: &str,
    wait: Duration,
) -> Result<Claim, String> {
    let token = new_token();
    let deadline = Instant::now() + wait;
    let mut announced = false;
    loop {
        let holder = match try_claim(client, keys, ttl_seconds, &token)
            .await
            .map_err(|e| format!("{describe}: {e}"))?
        {
            Attempt::Won(claim) => return Ok(claim),
            Attempt::Held(holder) => holder,
        };
        if Instant::now() >= deadline {
            return Err(format!(
                "{describe} is in use by another provider ({holder}); two providers must never \
                 write one state. A provider that is gone loses its claim when its lease \
                 (--etcd-lease-ttl) runs out"
            ));
        }
        if !announced {
            tracing::info!(
                state = describe,
                holder,
                "state: waiting for the earlier claim on the etcd prefix to expire"
            );
            announced = true;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
/// Revokes a lease (best effort, bounded): its keys go at once instead of after the TTL.
pub(crate) async fn revoke(client: &Client, lease: i64) {
    let mut lease_client = client.lease();
    let revoked = tokio::time::timeout(
        Duration::from_secs(2),
        lease_client.lease_revoke(pb::LeaseRevokeRequest { id: lease }),
    )
    .await;
    if !matches!(revoked, Ok(Ok(_))) {
        tracing::debug!(
            lease,
            "could not revoke the etcd lease; the claim expires with its TTL"
        );
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "unknown host".into())
}

/// How long before the lease could run out on etcd's side a provider stops using its claim.
pub(crate) fn safety_margin(ttl: Duration) -> Duration {
    (ttl / 5).max(Duration::from_millis(200))
}

/// Whether a claim may still be used: a keep-alive was confirmed recently enough (within the
/// TTL minus [`safety_margin`], counted from when the keep-alive was sent) and etcd never
/// refused it. Checked by every commit and every mutating RPC, so a provider that was paused
/// past its lease stops acknowledging the moment it runs again, before any timer fires.
#[derive(Debug)]
pub(crate) struct Hold {
    origin: Instant,
    /// Milliseconds after `origin` until which the claim may be used.
    valid_until_ms: std::sync::atomic::AtomicU64,
    /// Milliseconds after `origin` at which the last confirmed keep-alive was sent.
    confirmed_ms: std::sync::atomic::AtomicU64,
    ttl: Duration,
    lost: CancellationToken,
    /// Why the claim was given up, when something other than time ended it.
    why: Mutex<Option<String>>,
}

impl Hold {
    fn new(claim: &Claim) -> Arc<Hold> {
        let hold = Arc::new(Hold {
            origin: claim.granted_at,
            valid_until_ms: std::sync::atomic::AtomicU64::new(0),
            confirmed_ms: std::sync::atomic::AtomicU64::new(0),
            ttl: claim.ttl,
            lost: CancellationToken::new(),
            why: Mutex::new(None),
        });
        hold.confirm(claim.granted_at, claim.ttl);
        hold
    }

    fn valid_until(&self) -> Instant {
        self.origin + Duration::from_millis(self.valid_until_ms.load(Ordering::SeqCst))
    }

    /// A keep-alive sent at `sent` was answered with `ttl`.
    fn confirm(&self, sent: Instant, ttl: Duration) {
        let until = (sent + ttl).saturating_duration_since(self.origin);
        let until = until.saturating_sub(safety_margin(self.ttl)).as_millis() as u64;
        self.valid_until_ms.fetch_max(until, Ordering::SeqCst);
        let sent = sent.saturating_duration_since(self.origin).as_millis() as u64;
        self.confirmed_ms.fetch_max(sent, Ordering::SeqCst);
    }

    /// Whether the claim may be used right now.
    pub fn is_held(&self) -> bool {
        !self.lost.is_cancelled() && Instant::now() < self.valid_until()
    }

    /// Gives the claim up for good (etcd refused a commit or said the lease is gone); the first
    /// reason given is the one [`Hold::loss`] reports.
    pub fn lose(&self, why: impl Into<String>) {
        self.why
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_or_insert_with(|| why.into());
        self.lost.cancel();
    }

    /// Why the claim is no longer held, for the log of a step-down.
    pub fn loss(&self) -> String {
        if let Some(why) = self
            .why
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
        {
            return why;
        }
        let confirmed =
            self.origin + Duration::from_millis(self.confirmed_ms.load(Ordering::SeqCst));
        format!(
            "the last keep-alive of the lease that etcd confirmed was sent {} ms ago; a claim is \
             used at most {} ms after its last confirmed keep-alive was sent (the TTL less the \
             safety margin)",
            confirmed.elapsed().as_millis(),
            self.ttl.saturating_sub(safety_margin(self.ttl)).as_millis()
        )
    }

    /// Completes when the claim is no longer held.
    pub async fn lost(&self) {
        loop {
            if !self.is_held() {
                return;
            }
            tokio::select! {
                _ = self.lost.cancelled() => return,
                _ = tokio::time::sleep_until(self.valid_until().into()) => {}
            }
        }
    }
}

/// Keeps a lease alive every TTL/4 until `stop`. When no keep-alive was confirmed within the
/// TTL minus the margin, or etcd says the lease is gone, the hold is lost: the claim may have
/// expired, so nothing more may be committed under it (the guarded transaction would be
/// refused anyway).
fn keep_alive(client: Client, claim: &Claim, hold: Arc<Hold>, stop: CancellationToken) {
    let (lease, ttl) = (claim.lease, claim.ttl);
    tokio::spawn(async move {
        // Four keep-alives per TTL: after the last confirmed one, more than half the TTL is left
        // to ride out an etcd leader election (about a second) before the hold lapses.
        let every = ttl / 4;
        let request = pb::LeaseKeepAliveRequest { id: lease };
        'streams: while hold.is_held() {
            // etcd answers the stream's headers only with its first response, so the first
            // request is queued before the call is made.
            let (tx, rx) = mpsc::channel(1);
            let mut sent = Instant::now();
            if tx.try_send(request).is_err() {
                continue;
            }
            let at = client.at();
            let mut lease_client = client.lease();
            let opened = tokio::select! {
                _ = stop.cancelled() => return,
                opened = tokio::time::timeout(every, lease_client.lease_keep_alive(tokio_stream::wrappers::ReceiverStream::new(rx))) => opened,
            };
            let mut responses = match opened {
                Ok(Ok(r)) => r.into_inner(),
                Ok(Err(status)) => {
                    tracing::debug!(code = ?status.code(), message = status.message(), "etcd keep-alive stream failed to open");
                    client.failed_with(at, &status);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                Err(_) => {
                    client.failed(at);
                    continue;
                }
            };
            loop {
                let deadline = (sent + every).max(Instant::now() + Duration::from_millis(50));
                let answer = tokio::select! {
                    _ = stop.cancelled() => return,
                    answer = tokio::time::timeout_at(deadline.into(), responses.next()) => answer,
                };
                match answer {
                    Ok(Some(Ok(response))) if response.ttl > 0 => {
                        client.answered(at);
                        hold.confirm(sent, Duration::from_secs(response.ttl as u64));
                        let took = sent.elapsed();
                        if took > every {
                            tracing::warn!(
                                lease,
                                took_ms = took.as_millis() as u64,
                                ttl_ms = ttl.as_millis() as u64,
                                "etcd was slow to confirm a keep-alive of the claim's lease"
                            );
                        }
                    }
                    Ok(Some(Ok(_))) => {
                        hold.lose("etcd answered a keep-alive saying the claim's lease expired");
                        break 'streams;
                    }
                    Ok(Some(Err(status))) => {
                        client.failed_with(at, &status);
                        continue 'streams;
                    }
                    Ok(None) | Err(_) => {
                        client.failed(at);
                        continue 'streams;
                    }
                }
                if !hold.is_held() {
                    break 'streams;
                }
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep_until((sent + every).into()) => {}
                }
                sent = Instant::now();
                if tx.send(request).await.is_err() {
                    continue 'streams;
                }
            }
        }
        let why = hold.loss();
        tracing::error!(
            lease,
            why,
            "state: the claim on the etcd prefix is no longer held; no more commits"
        );
        hold.lose(why);
    });
}

/// Writes guarded by a claim.
#[derive(Clone)]
pub(crate) struct Guarded {
    pub client: Client,
    pub keys: Keys,
    pub claim: Claim,
    pub describe: String,
    pub hold: Arc<Hold>,
    pub limits: TxnLimits,
}

impl Guarded {
    fn guard(&self) -> pb::Compare {
        pb::Compare {
            result: CompareResult::Equal as i32,
            target: CompareTarget::Value as i32,
            key: self.keys.owner(),
            target_union: Some(TargetUnion::Value(self.claim.token.clone())),
            range_end: Vec::new(),
        }
    }

    /// Commits `ops` as one transaction under the claim. A transaction etcd refuses for what
    /// it is (too large, say) fails as [`RequestError::Refused`] and leaves the claim alone;
    /// anything else that fails it ends the claim's use.
    pub async fn txn(&self, ops: Vec<pb::RequestOp>) -> Result<(), RequestError> {
        if !self.hold.is_held() {
            return Err(RequestError::Failed(format!(
                "{}: the claim on the prefix was lost (lease not kept alive); nothing more is committed",
                self.describe
            )));
        }
        let request = pb::TxnRequest {
            compare: vec![self.guard()],
            success: ops,
            failure: Vec::new(),
        };
        let response = retry_classified(&self.client, "commit", || {
            let (mut kv, request) = (self.client.kv(), request.clone());
            async move { kv.txn(request).await }
        })
        .await
        .map_err(|e| match e {
            RequestError::Refused(m) => RequestError::Refused(format!(
                "{}: {m}; the transaction is refused as it is (if it is too large, raise etcd's \
                 --max-request-bytes and --etcd-max-request-bytes together, docs/ha.md)",
                self.describe
            )),
            RequestError::Failed(m) => RequestError::Failed(format!("{}: {m}", self.describe)),
        })?;
        if !response.succeeded {
            self.hold.lose(
                "etcd refused a commit: the claim's key no longer holds this provider's token",
            );
            return Err(RequestError::Failed(format!(
                "{}: commit refused: this provider no longer holds the claim on the prefix \
                 (its lease expired or another provider took it over)",
                self.describe
            )));
        }
        Ok(())
    }

    /// Commits batches in order, in as few transactions as the limits allow.
    pub async fn commit(&self, batches: Vec<Vec<Change>>) -> Result<(), RequestError> {
        for ops in plan(&self.keys, batches, self.limits) {
            self.txn(ops).await?;
        }
        Ok(())
    }
}

/// Reads the whole state under a prefix at one etcd revision.
pub(crate) async fn read_state(client: &Client, keys: &Keys) -> Result<Snapshot, String> {
    let mut attempts = 0;
    loop {
        match read_once(client, keys).await {
            Err(e) if e.contains("compacted") && attempts < 3 => attempts += 1,
            other => return other,
        }
    }
}

/// One decoded key of the state.
#[derive(Clone, Debug)]
pub(crate) enum Entry {
    Owner,
    Meta(Meta),
    Slot(Box<crate::rules::records::Slot>),
    Fence(FenceRecord),
}

/// Decodes one key-value of the prefix, checking that it sits under its own key.
pub(crate) fn decode_entry(keys: &Keys, kv: &pb::KeyValue) -> Result<Entry, String> {
    let at_key = |e: String| format!("etcd key {}: {e}", String::from_utf8_lossy(&kv.key));
    match keys.kind(&kv.key) {
        KeyKind::Owner => Ok(Entry::Owner),
        KeyKind::Meta => Ok(Entry::Meta(keys::decode_meta(&kv.value).map_err(at_key)?)),
        KeyKind::Slot => {
            let slot = keys::decode_slot(&kv.value).map_err(at_key)?;
            if keys.slot(&slot.machine.id) != kv.key {
                return Err(at_key(format!(
                    "holds machine {:?}, which belongs under another key",
                    slot.machine.id
                )));
            }
            Ok(Entry::Slot(Box::new(slot)))
        }
        KeyKind::Fence => {
            let fence = keys::decode_fence(&kv.value).map_err(at_key)?;
            if keys.fence(&fence.shard_id, &fence.machine_id) != kv.key {
                return Err(at_key("holds a fence mark of another pair".into()));
            }
            Ok(Entry::Fence(fence))
        }
        KeyKind::Unknown => Err(at_key(
            "not a key of this state (written by a newer provider, or another program shares \
             the prefix)"
                .into(),
        )),
    }
}

/// Builds a snapshot from decoded entries; `None` meta with data is an interrupted import.
pub(crate) fn assemble(
    keys: &Keys,
    meta: Option<Meta>,
    mut snapshot: Snapshot,
) -> Result<Snapshot, String> {
    match meta {
        Some(meta) => {
            snapshot.revision = meta.revision;
            snapshot.next_op = meta.next_op;
        }
        None if snapshot.slots.is_empty() && snapshot.fences.is_empty() => {}
        None => {
            return Err(format!(
                "the prefix holds {} machines and {} fence marks but no {} record: an \
                 interrupted `state import`? Run the import again after deleting the prefix",
                snapshot.slots.len(),
                snapshot.fences.len(),
                String::from_utf8_lossy(&keys.meta())
            ));
        }
    }
    Ok(snapshot)
}

async fn read_once(client: &Client, keys: &Keys) -> Result<Snapshot, String> {
    let (mut from, end) = keys.range();
    let mut at = 0;
    let mut snapshot = Snapshot::default();
    let mut meta = None;
    loop {
        let request = pb::RangeRequest {
            key: from.clone(),
            range_end: end.clone(),
            limit: PAGE,
            revision: at,
            ..Default::default()
        };
        let page = retry(client, "read the state", || {
            let (mut kv, request) = (client.kv(), request.clone());
            async move { kv.range(request).await }
        })
        .await?;
        if at == 0 {
            at = page.header.as_ref().map_or(0, |h| h.revision);
        }
        for kv in &page.kvs {
            match decode_entry(keys, kv)? {
                Entry::Owner => {}
                Entry::Meta(m) => meta = Some(m),
                Entry::Slot(slot) => snapshot.slots.push(*slot),
                Entry::Fence(fence) => snapshot.fences.push(fence),
            }
        }
        match (page.more, page.kvs.last()) {
            (true, Some(last)) => {
                from = last.key.clone();
                from.push(0);
            }
            _ => break,
        }
    }
    assemble(keys, meta, snapshot)
}

enum Message {
    Batch(Vec<Change>, oneshot::Sender<Result<(), StoreError>>),
    Flush(oneshot::Sender<Result<(), StoreError>>),
    /// Commit what is queued, revoke the claim, then call this and stop.
    Stop(Box<dyn FnOnce() + Send>),
    /// Stop without giving the claim up, handing it (and its keep-alive) back.
    HandOver(oneshot::Sender<(Guarded, CancellationToken)>),
}

/// The etcd store: a claimed prefix, its keep-alive and its writer task.
pub struct EtcdStore {
    describe: String,
    queue: mpsc::UnboundedSender<Message>,
    loaded: Mutex<Option<Snapshot>>,
    /// Cancelled when etcd refused a transaction for what it is (see [`EtcdStore::refused`]).
    refused: CancellationToken,
    max_record_bytes: usize,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("state", &self.describe)
            .finish_non_exhaustive()
    }
}

/// Connects, claims the prefix (waiting for an earlier claim up to two TTLs) and starts the
/// keep-alive. Used by the store and by `state import`.
pub(crate) async fn open_guarded(
    state: &str,
    args: &EtcdArgs,
) -> Result<(Guarded, CancellationToken), String> {
    args.validate()?;
    let target: Target = target::parse(state)?;
    let describe = target.describe();
    let client = target::connect(&target, args)?;
    let keys = Keys::new(&target.prefix);
    let wait = args.etcd_lease_ttl * 2 + Duration::from_secs(1);
    let claim = claim(&client, &keys, args.ttl_seconds(), &describe, wait).await?;
    let limits = TxnLimits::of(args.etcd_max_request_bytes);
    Ok(guard(client, keys, claim, describe, limits))
}

/// Starts keeping a won claim alive; the guarded writes and the token that stops the keep-alive.
pub(crate) fn guard(
    client: Client,
    keys: Keys,
    claim: Claim,
    describe: String,
    limits: TxnLimits,
) -> (Guarded, CancellationToken) {
    let hold = Hold::new(&claim);
    let stop = CancellationToken::new();
    keep_alive(client.clone(), &claim, hold.clone(), stop.clone());
    (
        Guarded {
            client,
            keys,
            claim,
            describe,
            hold,
            limits,
        },
        stop,
    )
}

/// Ends a claim: stops the keep-alive and revokes the lease, so a successor claims at once.
pub(crate) async fn release(guarded: &Guarded, stop: &CancellationToken) {
    stop.cancel();
    revoke(&guarded.client, guarded.claim.lease).await;
}

/// Checks the etcd flags against `--state`: they are checked when the state is in etcd, and
/// refused when it is not (a TLS file meant for etcd would otherwise be silently ignored).
pub fn validate_with_state(state: &str, args: &EtcdArgs) -> Result<(), String> {
    if is_etcd(state) {
        target::parse(state)?;
        return args.validate();
    }
    for (flag, value) in [
        ("--etcd-ca", &args.etcd_ca),
        ("--etcd-cert", &args.etcd_cert),
        ("--etcd-key", &args.etcd_key),
    ] {
        if !value.is_empty() {
            return Err(format!(
                "{flag} is set but --state is not an etcd:// address (got {state:?})"
            ));
        }
    }
    Ok(())
}

impl EtcdStore {
    /// Claims the prefix, reads the state and starts the writer. Every error surfaces here,
    /// before the provider listens.
    pub async fn open(state: &str, args: &EtcdArgs) -> Result<EtcdStore, String> {
        let started = Instant::now();
        let (guarded, stop) = open_guarded(state, args).await?;
        let snapshot = match read_state(&guarded.client, &guarded.keys).await {
            Ok(s) => s,
            Err(e) => {
                release(&guarded, &stop).await;
                return Err(format!("{}: {e}", guarded.describe));
            }
        };
        tracing::info!(
            state = guarded.describe,
            machines = snapshot.slots.len(),
            fences = snapshot.fences.len(),
            revision = snapshot.revision,
            lease_ttl_s = guarded.claim.ttl.as_secs(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "state: claimed and loaded the etcd prefix"
        );
        Ok(EtcdStore::claimed(guarded, stop, snapshot))
    }

    /// A store over a claim already won and a state already read under it (a replica taking
    /// over): starts the writer.
    pub(crate) fn claimed(
        guarded: Guarded,
        stop: CancellationToken,
        snapshot: Snapshot,
    ) -> EtcdStore {
        let (queue, receiver) = mpsc::unbounded_channel();
        let describe = guarded.describe.clone();
        let refused = CancellationToken::new();
        let max_record_bytes = guarded.limits.max_record_bytes(&guarded.keys);
        tokio::spawn(run_writer(guarded, stop, receiver, refused.clone()));
        EtcdStore {
            describe,
            queue,
            loaded: Mutex::new(Some(snapshot)),
            refused,
            max_record_bytes,
        }
    }

    /// Completes once etcd refused one of this store's transactions for what it is (too large,
    /// say). The claim is still held, but that commit and every later one of this store failed
    /// (batches become durable in order or not at all), so the engine on it must be replaced by
    /// one on a fresh read: [`EtcdStore::hand_over`].
    pub(crate) async fn refused(&self) {
        self.refused.cancelled().await;
    }

    /// Stops the writer after what is queued without giving the claim up, and returns the claim
    /// with its keep-alive (a new store continues the term). `None` when the writer already
    /// stopped.
    pub(crate) async fn hand_over(&self) -> Option<(Guarded, CancellationToken)> {
        let (reply, receiver) = oneshot::channel();
        self.queue.send(Message::HandOver(reply)).ok()?;
        receiver.await.ok()
    }

    /// Gives the claim up after the queued commits, waiting at most a few seconds.
    pub(crate) async fn release_bounded(&self) -> Result<(), StoreError> {
        match tokio::time::timeout(Duration::from_secs(5), self.release().wait()).await {
            Ok(result) => result,
            Err(_) => Err(StoreError(format!(
                "{}: releasing the claim took longer than 5s; it expires with its lease",
                self.describe
            ))),
        }
    }

    fn send(
        &self,
        message: impl FnOnce(oneshot::Sender<Result<(), StoreError>>) -> Message,
    ) -> Commit {
        let (reply, receiver) = oneshot::channel();
        if let Err(mpsc::error::SendError(Message::Batch(_, reply) | Message::Flush(reply))) =
            self.queue.send(message(reply))
        {
            let _ = reply.send(Err(StoreError(format!(
                "the etcd writer for {} has stopped",
                self.describe
            ))));
        }
        Commit::pending(receiver)
    }
}

/// Commits queued batches in groups until stopped; after a failed commit every later one fails
/// too (batches become durable in order or not at all).
async fn run_writer(
    guarded: Guarded,
    stop: CancellationToken,
    mut receiver: mpsc::UnboundedReceiver<Message>,
    refused: CancellationToken,
) {
    let mut failed: Option<StoreError> = None;
    while let Some(first) = receiver.recv().await {
        let mut batches = Vec::new();
        let mut replies = Vec::new();
        let mut stopping = None;
        let mut handing_over = None;
        let mut next = Some(first);
        while let Some(message) = next.take() {
            match message {
                Message::Batch(batch, reply) => {
                    batches.push(batch);
                    replies.push(reply);
                }
                Message::Flush(reply) => replies.push(reply),
                Message::Stop(done) => {
                    stopping = Some(done);
                    break;
                }
                Message::HandOver(reply) => {
                    handing_over = Some(reply);
                    break;
                }
            }
            next = receiver.try_recv().ok();
        }
        let result = match &failed {
            Some(e) => Err(e.clone()),
            None if batches.is_empty() => Ok(()),
            None => match guarded.commit(batches).await {
                Ok(()) => Ok(()),
                // etcd is fine and the claim is held: this transaction is what etcd refuses.
                // Later batches were built on it, so they fail too, but nobody steps down.
                Err(RequestError::Refused(e)) => {
                    tracing::error!(error = %e, "state: etcd refused a commit as it is; the claim is kept, this engine commits nothing more and is replaced by one on a fresh read");
                    failed = Some(StoreError(e.clone()));
                    refused.cancel();
                    Err(StoreError(e))
                }
                Err(RequestError::Failed(e)) => {
                    guarded.hold.lose(format!("a commit failed: {e}"));
                    tracing::error!(error = %e, "state: etcd commit failed; no further commits from this provider");
                    failed = Some(StoreError(e.clone()));
                    Err(StoreError(e))
                }
            },
        };
        for reply in replies {
            let _ = reply.send(result.clone());
        }
        if let Some(done) = stopping {
            release(&guarded, &stop).await;
            done();
            return;
        }
        if let Some(reply) = handing_over {
            if let Err((guarded, stop)) = reply.send((guarded, stop)) {
                release(&guarded, &stop).await;
            }
            return;
        }
    }
    release(&guarded, &stop).await;
}

impl Store for EtcdStore {
    fn load(&self) -> Result<Snapshot, StoreError> {
        self.loaded
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .ok_or_else(|| {
                StoreError(format!(
                    "{}: the state was already loaded (it is read once, when the prefix is claimed)",
                    self.describe
                ))
            })
    }

    fn submit(&self, batch: Vec<Change>) -> Commit {
        self.send(|reply| Message::Batch(batch, reply))
    }

    fn is_durable(&self) -> bool {
        true
    }

    fn flush(&self) -> Commit {
        self.send(Message::Flush)
    }

    fn describe(&self) -> String {
        format!("{} (etcd)", self.describe)
    }

    fn max_record_bytes(&self) -> Option<usize> {
        Some(self.max_record_bytes)
    }

    fn release(&self) -> Commit {
        let (reply, receiver) = oneshot::channel();
        let stop = Message::Stop(Box::new(move || {
            let _ = reply.send(Ok(()));
        }));
        match self.queue.send(stop) {
            Ok(()) => Commit::pending(receiver),
            // A writer that already stopped has released the claim.
            Err(_) => Commit::done(),
        }
    }
}

impl Drop for EtcdStore {
    /// Lets the writer finish what is queued and revoke the claim's lease, so a successor does
    /// not wait for the TTL. Waits (bounded) only where blocking is allowed.
    fn drop(&mut self) {
        let (done, finished) = std::sync::mpsc::channel();
        let stop = Message::Stop(Box::new(move || {
            let _ = done.send(());
        }));
        if self.queue.send(stop).is_err() {
            return;
        }
        let multi_thread = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        if multi_thread {
            tokio::task::block_in_place(|| {
                let _ = finished.recv_timeout(Duration::from_secs(3));
            });
        }
    }
}

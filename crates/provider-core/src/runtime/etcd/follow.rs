//! A standby's copy of the state: every key under the prefix, decoded, kept current by an etcd
//! watch from the revision of a full read. A takeover then only waits for the watch to deliver
//! the revision at which the claim was won (the claim key is under the prefix, so its own event
//! marks the point) instead of reading the whole inventory again.
//!
//! A watch that breaks is reopened from the next revision; one cancelled because that revision
//! was compacted away starts over with a full read.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use etcd_proto::etcdserverpb as pb;
use tokio::sync::{mpsc, watch};
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;

use super::keys::{Keys, Meta};
use super::target::Client;
use super::{Entry, PAGE, assemble, decode_entry, retry};
use crate::rules::records::Snapshot;

#[derive(Default)]
struct Copy {
    entries: BTreeMap<Vec<u8>, Entry>,
    /// A key that did not decode (reported by the takeover's own full read instead).
    broken: Option<String>,
}

/// A running follower; stops when dropped.
pub(crate) struct Follower {
    copy: Arc<Mutex<Copy>>,
    revision: watch::Receiver<i64>,
    stop: CancellationToken,
    warm: Arc<AtomicBool>,
}

impl Drop for Follower {
    fn drop(&mut self) {
        self.stop.cancel();
        self.warm.store(false, Ordering::SeqCst);
    }
}

impl Follower {
    /// Starts following; `warm` is set while the copy is read and its watch is open.
    pub fn start(client: Client, keys: Keys, warm: Arc<AtomicBool>) -> Follower {
        let copy = Arc::new(Mutex::new(Copy::default()));
        let (revision_tx, revision) = watch::channel(0);
        let stop = CancellationToken::new();
        warm.store(false, Ordering::SeqCst);
        tokio::spawn(follow(
            client,
            keys,
            copy.clone(),
            revision_tx,
            stop.clone(),
            warm.clone(),
        ));
        Follower {
            copy,
            revision,
            stop,
            warm,
        }
    }

    /// The state as of etcd revision `at` or later, once the copy has caught up (waits at most
    /// `within`). `None` when it did not catch up or a key did not decode: the caller reads the
    /// prefix itself. Consumes the follower: its watch stops and the copy's records move into
    /// the snapshot, so a takeover never holds the inventory twice.
    pub async fn into_snapshot_at(
        mut self,
        keys: &Keys,
        at: i64,
        within: Duration,
    ) -> Option<Snapshot> {
        let caught_up = tokio::time::timeout(within, self.revision.wait_for(|r| *r >= at)).await;
        self.stop.cancel();
        if !matches!(caught_up, Ok(Ok(_))) {
            return None;
        }
        let entries = {
            let mut copy = self.copy.lock().unwrap_or_else(PoisonError::into_inner);
            if copy.broken.is_some() {
                return None;
            }
            std::mem::take(&mut copy.entries)
        };
        let mut meta: Option<Meta> = None;
        let mut snapshot = Snapshot::default();
        for entry in entries.into_values() {
            match entry {
                Entry::Owner => {}
                Entry::Meta(m) => meta = Some(m),
                Entry::Slot(slot) => snapshot.slots.push(*slot),
                Entry::Fence(fence) => snapshot.fences.push(fence),
            }
        }
        assemble(keys, meta, snapshot).ok()
    }
}

fn apply(copy: &Mutex<Copy>, keys: &Keys, kv: &pb::KeyValue, deleted: bool) {
    let mut copy = copy.lock().unwrap_or_else(PoisonError::into_inner);
    if deleted {
        copy.entries.remove(&kv.key);
        return;
    }
    match decode_entry(keys, kv) {
        Ok(entry) => {
            copy.entries.insert(kv.key.clone(), entry);
        }
        Err(e) => copy.broken = Some(e),
    }
}

/// Reads every key at one revision into `copy` (replacing it); returns that revision.
async fn full_read(client: &Client, keys: &Keys, copy: &Mutex<Copy>) -> Result<i64, String> {
    let (mut from, end) = keys.range();
    let mut at = 0;
    let mut fresh = Copy::default();
    loop {
        let request = pb::RangeRequest {
            key: from.clone(),
            range_end: end.clone(),
            limit: PAGE,
            revision: at,
            ..Default::default()
        };
        let page = retry(client, "follow the state", || {
            let (mut kv, request) = (client.kv(), request.clone());
            async move { kv.range(request).await }
        })
        .await?;
        if at == 0 {
            at = page.header.as_ref().map_or(0, |h| h.revision);
        }
        for kv in &page.kvs {
            match decode_entry(keys, kv) {
                Ok(entry) => {
                    fresh.entries.insert(kv.key.clone(), entry);
                }
                Err(e) => fresh.broken = Some(e),
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
    *copy.lock().unwrap_or_else(PoisonError::into_inner) = fresh;
    Ok(at)
}

/// Why a watch ended.
enum Ended {
    /// Reopen from the next revision.
    Broken,
    /// That revision is gone: read everything again.
    Compacted,
}

async fn follow(
    client: Client,
    keys: Keys,
    copy: Arc<Mutex<Copy>>,
    revision: watch::Sender<i64>,
    stop: CancellationToken,
    warm: Arc<AtomicBool>,
) {
    let mut synced: Option<i64> = None;
    loop {
        if stop.is_cancelled() {
            return;
        }
        let at = match synced {
            Some(at) => at,
            None => {
                let read = tokio::select! {
                    _ = stop.cancelled() => return,
                    read = full_read(&client, &keys, &copy) => read,
                };
                match read {
                    Ok(at) => {
                        revision.send_replace(at);
                        at
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "standby: could not read the state; retrying");
                        tokio::select! {
                            _ = stop.cancelled() => return,
                            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                        }
                        continue;
                    }
                }
            }
        };
        let ended = tokio::select! {
            _ = stop.cancelled() => return,
            ended = watch_from(&client, &keys, &copy, &revision, at + 1, &warm) => ended,
        };
        warm.store(false, Ordering::SeqCst);
        match ended {
            Ended::Compacted => synced = None,
            Ended::Broken => {
                synced = Some(*revision.borrow());
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                }
            }
        }
    }
}

/// Applies the events of one watch stream from `start` until it ends.
async fn watch_from(
    client: &Client,
    keys: &Keys,
    copy: &Mutex<Copy>,
    revision: &watch::Sender<i64>,
    start: i64,
    warm: &AtomicBool,
) -> Ended {
    let (range_start, range_end) = keys.range();
    let (tx, rx) = mpsc::channel(1);
    let create = pb::WatchRequest {
        request_union: Some(pb::watch_request::RequestUnion::CreateRequest(
            pb::WatchCreateRequest {
                key: range_start,
                range_end,
                start_revision: start,
                progress_notify: true,
            },
        )),
    };
    if tx.try_send(create).is_err() {
        return Ended::Broken;
    }
    let at = client.at();
    let mut watch_client = client.watch();
    let mut stream = match watch_client
        .watch(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
    {
        Ok(response) => response.into_inner(),
        Err(status) => {
            tracing::debug!(code = ?status.code(), message = status.message(), "standby: the watch did not open");
            client.failed(at);
            return Ended::Broken;
        }
    };
    // `tx` stays alive with the stream: dropping it would close the request side.
    let _requests = tx;
    // The copy is read and the watch delivers every change from its revision on.
    warm.store(true, Ordering::SeqCst);
    while let Some(message) = stream.next().await {
        let response = match message {
            Ok(r) => r,
            Err(status) => {
                tracing::debug!(code = ?status.code(), message = status.message(), "standby: the watch broke");
                client.failed(at);
                return Ended::Broken;
            }
        };
        if response.compact_revision > 0 {
            tracing::info!(
                compacted = response.compact_revision,
                "standby: the watch position was compacted; reading the state again"
            );
            return Ended::Compacted;
        }
        if response.canceled {
            return Ended::Broken;
        }
        let mut last = 0;
        for event in &response.events {
            let Some(kv) = &event.kv else { continue };
            let deleted = event.r#type == pb::event::EventType::Delete as i32;
            apply(copy, keys, kv, deleted);
            last = last.max(kv.mod_revision);
        }
        if last > 0 {
            revision.send_if_modified(|r| {
                let moved = last > *r;
                *r = (*r).max(last);
                moved
            });
        }
    }
    Ended::Broken
}

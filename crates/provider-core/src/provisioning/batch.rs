//! Batched reads: the boot polls (and look-ups) of every transition in flight gathered into
//! one cloud listing per round, instead of one `GET` per machine every few seconds (issue 21
//! §2), and the poll schedule each waiter follows, learned from how long its offering takes
//! to boot.
//!
//! A caller asks [`Batcher::read`] for one key. The first demand starts a round that waits a
//! short gathering window, takes every key asked for by then, and fetches them all at once;
//! demands that arrive while a round is fetching go to the next round. Every answer therefore
//! comes from a fetch that *started after the demand was made*: a round never answers with
//! something older than the question, which is what lets the look-up that guards against a
//! second server for one machine (the one before a retried Create) be batched too.
//!
//! Rounds run on a task of their own, so a waiter that gives up (its deadline, a cancelled
//! transition) never cancels the fetch for the others. A round is sent in the most urgent
//! API budget class among its waiters ([`crate::provisioning::budget::Class`]).

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::hash::Hash;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::provisioning::budget::{self, Class};

/// What a round's fetch returns: the answer for each key it found. A key that is absent from
/// the map was not found by the listing.
pub type FetchFuture<K, V, E> = Pin<Box<dyn Future<Output = Result<HashMap<K, V>, E>> + Send>>;

/// Fetches the keys of one round within a deadline.
pub type Fetch<K, V, E> = Arc<dyn Fn(Vec<K>, Instant) -> FetchFuture<K, V, E> + Send + Sync>;

/// Why a batched read has no answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReadError<E> {
    /// The round's fetch failed; every waiter of the round sees the same error.
    Fetch(E),
    /// No answer before the caller's deadline.
    Deadline,
    /// The round ended without answering (its task panicked).
    Lost,
}

impl<E: std::fmt::Display> std::fmt::Display for ReadError<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::Fetch(e) => e.fmt(f),
            ReadError::Deadline => f.write_str("deadline exceeded waiting for a batched read"),
            ReadError::Lost => f.write_str("the batched read ended without an answer"),
        }
    }
}

struct Waiter<K, V, E> {
    key: K,
    class: Class,
    deadline: Instant,
    answer: oneshot::Sender<Result<Option<V>, E>>,
}

struct Queue<K, V, E> {
    waiting: Vec<Waiter<K, V, E>>,
    /// Whether a round task is running (it takes every waiter queued when it wakes).
    driving: bool,
}

struct Shared<K, V, E> {
    fetch: Fetch<K, V, E>,
    gather: Duration,
    queue: Mutex<Queue<K, V, E>>,
    rounds: std::sync::atomic::AtomicU64,
}

/// Gathers reads of many keys into shared rounds. Cloning shares the rounds.
pub struct Batcher<K, V, E> {
    shared: Arc<Shared<K, V, E>>,
}

impl<K, V, E> Clone for Batcher<K, V, E> {
    fn clone(&self) -> Self {
        Batcher {
            shared: self.shared.clone(),
        }
    }
}

impl<K, V, E> std::fmt::Debug for Batcher<K, V, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher")
            .field("gather", &self.shared.gather)
            .field(
                "rounds",
                &self
                    .shared
                    .rounds
                    .load(std::sync::atomic::Ordering::Relaxed),
            )
            .finish_non_exhaustive()
    }
}

impl<K, V, E> Batcher<K, V, E>
where
    K: Clone + Eq + Hash + Send + 'static,
    V: Clone + Send + 'static,
    E: Clone + Send + 'static,
{
    /// A batcher whose rounds wait `gather` after their first demand before fetching.
    pub fn new(gather: Duration, fetch: Fetch<K, V, E>) -> Batcher<K, V, E> {
        Batcher {
            shared: Arc::new(Shared {
                fetch,
                gather,
                queue: Mutex::new(Queue {
                    waiting: Vec::new(),
                    driving: false,
                }),
                rounds: std::sync::atomic::AtomicU64::new(0),
            }),
        }
    }

    /// The answer for `key` from a round that starts after this call: `None` when the round's
    /// listing did not find it.
    pub async fn read(&self, key: K, deadline: Instant) -> Result<Option<V>, ReadError<E>> {
        let (answer, answered) = oneshot::channel();
        let start = {
            let mut queue = self.lock();
            queue.waiting.push(Waiter {
                key,
                class: budget::current(),
                deadline,
                answer,
            });
            !std::mem::replace(&mut queue.driving, true)
        };
        if start {
            tokio::spawn(drive(self.shared.clone()));
        }
        match tokio::time::timeout_at(deadline, answered).await {
            Ok(Ok(Ok(found))) => Ok(found),
            Ok(Ok(Err(e))) => Err(ReadError::Fetch(e)),
            Ok(Err(_)) => Err(ReadError::Lost),
            Err(_) => Err(ReadError::Deadline),
        }
    }

    /// Rounds fetched so far.
    pub fn rounds(&self) -> u64 {
        self.shared
            .rounds
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue<K, V, E>> {
        self.shared.lock()
    }
}

impl<K, V, E> Shared<K, V, E> {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue<K, V, E>> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Clears the queue's `driving` flag if the round task ends without doing so itself (a panic
/// in a fetch), so that later demands still start rounds.
struct Driving<'a, K, V, E> {
    shared: &'a Shared<K, V, E>,
    finished: bool,
}

impl<K, V, E> Drop for Driving<'_, K, V, E> {
    fn drop(&mut self) {
        if !self.finished {
            self.shared.lock().driving = false;
        }
    }
}

async fn drive<K, V, E>(shared: Arc<Shared<K, V, E>>)
where
    K: Clone + Eq + Hash + Send + 'static,
    V: Clone + Send + 'static,
    E: Clone + Send + 'static,
{
    let mut driving = Driving {
        shared: &shared,
        finished: false,
    };
    loop {
        tokio::time::sleep(shared.gather).await;
        let round: Vec<Waiter<K, V, E>> = {
            let mut queue = shared.lock();
            // Waiters that gave up need no answer.
            queue.waiting.retain(|w| !w.answer.is_closed());
            if queue.waiting.is_empty() {
                // Cleared under the lock: a demand queued after this sees `driving` false and
                // starts the next round itself.
                queue.driving = false;
                driving.finished = true;
                return;
            }
            std::mem::take(&mut queue.waiting)
        };
        let mut seen = HashSet::new();
        let keys: Vec<K> = round
            .iter()
            .filter(|w| seen.insert(w.key.clone()))
            .map(|w| w.key.clone())
            .collect();
        let class = round
            .iter()
            .map(|w| w.class)
            .min()
            .unwrap_or(Class::Transition);
        let deadline = round
            .iter()
            .map(|w| w.deadline)
            .max()
            .unwrap_or_else(Instant::now);
        shared
            .rounds
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let fetched = budget::scoped(class, async { (shared.fetch)(keys, deadline).await }).await;
        for waiter in round {
            let answer = match &fetched {
                Ok(found) => Ok(found.get(&waiter.key).cloned()),
                Err(e) => Err(e.clone()),
            };
            // A waiter that gave up meanwhile is not told.
            let _ = waiter.answer.send(answer);
        }
    }
}

/// The instant at or after `at` that lies on a grid of `step` shared by the whole process, so
/// that waiters whose schedules end at nearby moments ask in the same round.
pub fn on_grid(at: Instant, step: Duration) -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    if step.is_zero() || at <= epoch {
        return at;
    }
    let since = at.duration_since(epoch).as_nanos();
    let step_ns = step.as_nanos();
    let cells = since.div_ceil(step_ns);
    let offset = Duration::from_nanos(u64::try_from(cells * step_ns).unwrap_or(u64::MAX));
    epoch + offset
}

/// How long the hosts of each offering take to boot, learned from the boots this process saw
/// (an exponentially weighted average, a quarter weight for each new boot).
#[derive(Debug, Default)]
pub struct BootClock {
    typical: Mutex<HashMap<String, Duration>>,
}

impl BootClock {
    pub fn new() -> BootClock {
        BootClock::default()
    }

    /// The typical boot time of `offering`, once one of its hosts was seen booting.
    pub fn typical(&self, offering: &str) -> Option<Duration> {
        self.lock().get(offering).copied()
    }

    /// Records that a host of `offering` took `took` from its create to running.
    pub fn record(&self, offering: &str, took: Duration) {
        let mut typical = self.lock();
        let next = match typical.get(offering) {
            Some(old) => (*old * 3 + took) / 4,
            None => took,
        };
        typical.insert(offering.to_owned(), next);
    }

    /// The poll schedule of a new host of `offering`: see [`PollSchedule`].
    pub fn schedule(&self, offering: &str, floor: Duration, cap: Duration) -> PollSchedule {
        PollSchedule::new(self.typical(offering), floor, cap)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Duration>> {
        self.typical.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// When to look at a booting host: first at three quarters of its offering's typical boot time
/// (no sooner than `floor`, no later than `cap`), then at gaps that start at an eighth of it
/// and double up to `cap`.
/// A host that boots in its typical time is seen running after two or three looks, and one
/// that takes far longer costs a look per `cap`. Before any host of the offering was seen
/// booting, the first look is at `floor` and the gaps double from there.
#[derive(Clone, Debug)]
pub struct PollSchedule {
    first: Option<Duration>,
    gap: Duration,
    floor: Duration,
    cap: Duration,
    /// Whether the look just before the end (see [`PollSchedule::next_look`]) was handed out.
    looked_last: bool,
}

impl PollSchedule {
    pub fn new(typical: Option<Duration>, floor: Duration, cap: Duration) -> PollSchedule {
        let cap = cap.max(floor);
        // The first look is never later than `cap`: a boot time learned while the API was
        // slow to answer (polls that waited) must not push every later first look towards
        // the deadline.
        let (first, gap) = match typical {
            Some(typical) => (
                (typical * 3 / 4).clamp(floor, cap),
                (typical / 8).clamp(floor, cap),
            ),
            None => (floor, (floor * 2).min(cap)),
        };
        PollSchedule {
            first: Some(first),
            gap,
            floor,
            cap,
            looked_last: false,
        }
    }

    /// When to take the next look at a host that must be running by `until`: the schedule's
    /// next wait, moved onto the process-wide grid of `floor` so that the looks of hosts
    /// created at nearby moments share a round ([`on_grid`]); when that falls at or after
    /// `until`, one last look just before it; `None` once that last look was handed out.
    pub fn next_look(&mut self, until: Instant) -> Option<Instant> {
        let now = Instant::now();
        let wake = on_grid(now + self.next_wait(), self.floor);
        if wake < until {
            return Some(wake);
        }
        if std::mem::replace(&mut self.looked_last, true) {
            return None;
        }
        Some(until.checked_sub(self.floor).unwrap_or(until).max(now))
    }

    /// The wait before the next look.
    pub fn next_wait(&mut self) -> Duration {
        if let Some(first) = self.first.take() {
            return first;
        }
        let wait = self.gap;
        self.gap = (self.gap * 2).clamp(self.floor, self.cap);
        wait
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    type Calls = Arc<Mutex<Vec<Vec<u32>>>>;

    fn doubling(calls: Calls, fail: Arc<AtomicUsize>) -> Batcher<u32, u32, String> {
        Batcher::new(
            Duration::from_millis(10),
            Arc::new(move |keys: Vec<u32>, _deadline| {
                let calls = calls.clone();
                let fail = fail.clone();
                Box::pin(async move {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    calls.lock().unwrap().push(keys.clone());
                    if fail.load(Ordering::SeqCst) > 0 {
                        fail.fetch_sub(1, Ordering::SeqCst);
                        return Err("listing failed".to_owned());
                    }
                    // Odd keys are "not found".
                    Ok(keys
                        .into_iter()
                        .filter(|k| k % 2 == 0)
                        .map(|k| (k, k * 2))
                        .collect())
                })
            }),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn demands_of_one_window_share_one_fetch_and_each_gets_its_own_answer() {
        let calls: Calls = Arc::default();
        let batcher = doubling(calls.clone(), Arc::default());
        let deadline = Instant::now() + Duration::from_secs(5);
        let reads: Vec<_> = (0..6u32)
            .map(|k| {
                let b = batcher.clone();
                tokio::spawn(async move { b.read(k, deadline).await })
            })
            .collect();
        let mut answers = Vec::new();
        for r in reads {
            answers.push(r.await.unwrap());
        }
        assert_eq!(
            answers,
            vec![
                Ok(Some(0)),
                Ok(None),
                Ok(Some(4)),
                Ok(None),
                Ok(Some(8)),
                Ok(None)
            ]
        );
        let calls = calls.lock().unwrap();
        assert_eq!(calls.len(), 1, "{calls:?}");
        let mut keys = calls[0].clone();
        keys.sort();
        assert_eq!(keys, vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(batcher.rounds(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_demand_made_during_a_fetch_is_answered_by_the_next_round() {
        let calls: Calls = Arc::default();
        let batcher = doubling(calls.clone(), Arc::default());
        let deadline = Instant::now() + Duration::from_secs(5);
        let first = tokio::spawn({
            let b = batcher.clone();
            async move { b.read(2, deadline).await }
        });
        // The first round gathers for 10 ms and then fetches for 50 ms.
        tokio::time::sleep(Duration::from_millis(30)).await;
        let asked = Instant::now();
        let second = batcher.read(2, deadline).await;
        assert_eq!(second, Ok(Some(4)));
        assert_eq!(first.await.unwrap(), Ok(Some(4)));
        assert_eq!(calls.lock().unwrap().len(), 2);
        // Answered by a fetch that started after the question: the first one ends at 60 ms,
        // the second gathers and fetches after that.
        assert!(Instant::now() >= asked + Duration::from_millis(60));
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_fetch_fails_its_round_only_and_a_waiter_that_gives_up_does_not_stop_it() {
        let calls: Calls = Arc::default();
        let fail = Arc::new(AtomicUsize::new(1));
        let batcher = doubling(calls.clone(), fail);
        let deadline = Instant::now() + Duration::from_secs(5);
        let impatient = batcher.read(4, Instant::now() + Duration::from_millis(20));
        let patient = {
            let b = batcher.clone();
            tokio::spawn(async move { b.read(6, deadline).await })
        };
        assert_eq!(impatient.await, Err(ReadError::Deadline));
        assert_eq!(
            patient.await.unwrap(),
            Err(ReadError::Fetch("listing failed".to_owned()))
        );
        assert_eq!(batcher.read(6, deadline).await, Ok(Some(12)));
        assert_eq!(calls.lock().unwrap().len(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_round_goes_in_the_most_urgent_class_of_its_waiters() {
        let classes: Arc<Mutex<Vec<Class>>> = Arc::default();
        let seen = classes.clone();
        let batcher: Batcher<u32, u32, String> = Batcher::new(
            Duration::from_millis(10),
            Arc::new(move |keys: Vec<u32>, _| {
                seen.lock().unwrap().push(budget::current());
                Box::pin(async move { Ok(keys.into_iter().map(|k| (k, k)).collect()) })
            }),
        );
        let deadline = Instant::now() + Duration::from_secs(5);
        let reconcile = {
            let b = batcher.clone();
            tokio::spawn(budget::scoped(Class::Reconcile, async move {
                b.read(1, deadline).await
            }))
        };
        let proof = {
            let b = batcher.clone();
            tokio::spawn(budget::scoped(Class::Proof, async move {
                b.read(2, deadline).await
            }))
        };
        assert_eq!(reconcile.await.unwrap(), Ok(Some(1)));
        assert_eq!(proof.await.unwrap(), Ok(Some(2)));
        budget::scoped(Class::Refresh, batcher.read(3, deadline))
            .await
            .unwrap();
        assert_eq!(*classes.lock().unwrap(), vec![Class::Proof, Class::Refresh]);
    }

    #[test]
    fn the_schedule_looks_at_three_quarters_of_the_boot_then_doubles_up_to_its_cap() {
        let (floor, cap) = (Duration::from_millis(1500), Duration::from_secs(6));
        let waits = |mut s: PollSchedule| -> Vec<f64> {
            (0..6).map(|_| s.next_wait().as_secs_f64()).collect()
        };
        let typical = Some(Duration::from_secs(8));
        assert_eq!(
            waits(PollSchedule::new(typical, floor, cap)),
            vec![6.0, 1.5, 3.0, 6.0, 6.0, 6.0]
        );
        // However long the learned boot, the first look comes by the cap.
        let slow = Some(Duration::from_secs(40));
        assert_eq!(waits(PollSchedule::new(slow, floor, cap))[0], 6.0);
        // Nothing learned yet: from the floor, doubling.
        assert_eq!(
            waits(PollSchedule::new(None, floor, cap)),
            vec![1.5, 3.0, 6.0, 6.0, 6.0, 6.0]
        );
        // A boot far quicker than the floor still waits the floor.
        let mut s = PollSchedule::new(
            Some(Duration::ZERO),
            Duration::from_millis(10),
            Duration::from_millis(40),
        );
        let waits: Vec<u128> = (0..4).map(|_| s.next_wait().as_millis()).collect();
        assert_eq!(waits, vec![10, 10, 20, 40]);
    }

    #[tokio::test(start_paused = true)]
    async fn the_last_look_comes_just_before_the_end_and_then_none() {
        let floor = Duration::from_millis(100);
        let start = Instant::now();
        let until = start + Duration::from_secs(1);
        // Learned 12 s: the first look (capped at 4 s) falls after the end.
        let mut s = PollSchedule::new(Some(Duration::from_secs(12)), floor, Duration::from_secs(4));
        let last = s.next_look(until).unwrap();
        assert!(last < until && last >= until - floor, "{:?}", last - start);
        tokio::time::sleep_until(last).await;
        assert_eq!(s.next_look(until), None);
        // Nothing learned: looks on the grid until the end, each before it.
        let until = Instant::now() + Duration::from_secs(1);
        let mut s = PollSchedule::new(None, floor, floor * 4);
        let mut looks = 0;
        while let Some(at) = s.next_look(until) {
            assert!(at < until);
            tokio::time::sleep_until(at).await;
            looks += 1;
        }
        assert!((3..=6).contains(&looks), "{looks} looks");
    }

    #[test]
    fn the_boot_clock_learns_each_offering_apart() {
        let clock = BootClock::new();
        assert_eq!(clock.typical("cx22"), None);
        clock.record("cx22", Duration::from_secs(20));
        assert_eq!(clock.typical("cx22"), Some(Duration::from_secs(20)));
        clock.record("cx22", Duration::from_secs(40));
        assert_eq!(clock.typical("cx22"), Some(Duration::from_secs(25)));
        assert_eq!(clock.typical("cpx31"), None);
    }

    #[tokio::test(start_paused = true)]
    async fn grid_points_are_shared_and_never_before_the_asked_instant() {
        let step = Duration::from_millis(1500);
        let now = Instant::now();
        let a = on_grid(now + Duration::from_millis(100), step);
        let b = on_grid(now + Duration::from_millis(900), step);
        assert_eq!(a, b);
        assert!(a >= now + Duration::from_millis(900));
        assert!(a < now + Duration::from_millis(100) + step + step);
        let exact = on_grid(a, step);
        assert_eq!(exact, a);
        assert_eq!(on_grid(now, Duration::ZERO), now);
    }
}

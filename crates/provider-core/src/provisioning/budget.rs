//! The API budget of one cloud token: a scheduler in front of a cloud client that sends a
//! request only when a token bucket mirroring the cloud's own allows it, and that hands the
//! tokens out in strict priority order (issue 21 §1).
//!
//! The cloud's bucket is shared by everyone holding the token: this provider takes
//! `--api-budget-share` of it (the rest is left to the operator's tools and other providers),
//! and background work (proofs of absence, reconcile listings, price refreshes) takes at most
//! `--api-reconcile-share` of that. The bucket starts from the published limits and is
//! corrected from the `RateLimit-Limit` / `-Remaining` / `-Reset` headers of every answer
//! (Hetzner's and DigitalOcean's spellings alike, as HTTP header names are case-insensitive),
//! so a 429 is seen only when another user of the token spends more than its part.
//!
//! A request's [`Class`] travels with the task that sends it ([`scoped`]): transitions are the
//! default, so only the engine's reconcile pass and the price refresh mark their work.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use metrics::{counter, gauge, histogram};
use tokio::sync::Notify;
use tokio::time::Instant;

/// Why a request is sent, in priority order: a lower-priority request is never handed a token
/// while a higher-priority one waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    /// Moves an accepted transition forward: a host's create, delete, label writes, polls.
    Transition,
    /// A direct read proving that a host missing from a listing is really gone.
    Proof,
    /// Reconcile's listings and its orphan deletions.
    Reconcile,
    /// Price and capacity refreshes.
    Refresh,
}

impl Class {
    pub const ALL: [Class; 4] = [
        Class::Transition,
        Class::Proof,
        Class::Reconcile,
        Class::Refresh,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Class::Transition => "transition",
            Class::Proof => "proof",
            Class::Reconcile => "reconcile",
            Class::Refresh => "refresh",
        }
    }

    /// Whether this class draws on the background part of the budget as well.
    fn is_background(self) -> bool {
        self != Class::Transition
    }
}

tokio::task_local! {
    static CLASS: Class;
}

/// Runs `work` with every API request it sends (on this task) counted as `class`.
pub async fn scoped<F: Future>(class: Class, work: F) -> F::Output {
    CLASS.scope(class, work).await
}

/// The class of requests sent from the current task ([`Class::Transition`] unless a caller
/// chose another with [`scoped`]).
pub fn current() -> Class {
    CLASS.try_with(|c| *c).unwrap_or(Class::Transition)
}

/// One token bucket: `capacity` requests, refilled at `per_second`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bucket {
    pub capacity: f64,
    pub per_second: f64,
}

/// What a cloud's `RateLimit-Reset` means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResetMeaning {
    /// When the bucket is full again (Hetzner): with `-Limit` and `-Remaining` it gives the
    /// refill rate.
    Full,
    /// When the oldest request of the window stops counting (DigitalOcean): no rate follows.
    WindowStart,
}

/// A cloud's published limits for one token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Limits {
    /// The limit the rate-limit headers describe.
    pub main: Bucket,
    /// A shorter limit without headers of its own (DigitalOcean's 250 per minute).
    pub burst: Option<Bucket>,
    pub reset: ResetMeaning,
}

impl Limits {
    /// Hetzner Cloud: 3,600 requests per project, one returned every second.
    pub const HETZNER: Limits = Limits {
        main: Bucket {
            capacity: 3600.0,
            per_second: 1.0,
        },
        burst: None,
        reset: ResetMeaning::Full,
    };

    /// DigitalOcean: 5,000 requests per hour and 250 per minute per token.
    pub const DIGITALOCEAN: Limits = Limits {
        main: Bucket {
            capacity: 5000.0,
            per_second: 5000.0 / 3600.0,
        },
        burst: Some(Bucket {
            capacity: 250.0,
            per_second: 250.0 / 60.0,
        }),
        reset: ResetMeaning::WindowStart,
    };

    /// The same limits with time running `factor` times faster (an emulator's time scale).
    pub fn time_scaled(self, factor: f64) -> Limits {
        let scale = |b: Bucket| Bucket {
            capacity: b.capacity,
            per_second: b.per_second * factor,
        };
        Limits {
            main: scale(self.main),
            burst: self.burst.map(scale),
            reset: self.reset,
        }
    }
}

/// The default of `--api-budget-share`.
pub const DEFAULT_SHARE: f64 = 0.5;
/// The default of `--api-reconcile-share`.
pub const DEFAULT_RECONCILE_SHARE: f64 = 0.2;

/// How much of the token's budget this provider and its background work may use.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Shares {
    /// `--api-budget-share`: the part of the cloud's bucket this provider may spend.
    pub share: f64,
    /// `--api-reconcile-share`: the part of `share` that background classes may spend.
    pub reconcile: f64,
}

impl Default for Shares {
    fn default() -> Shares {
        Shares {
            share: DEFAULT_SHARE,
            reconcile: DEFAULT_RECONCILE_SHARE,
        }
    }
}

impl Shares {
    /// Checks both fractions: `share` in (0, 1], `reconcile` in (0, 1].
    pub fn validate(&self) -> Result<(), String> {
        let ok = |f: f64| f.is_finite() && f > 0.0 && f <= 1.0;
        if !ok(self.share) {
            return Err(format!(
                "--api-budget-share {} must be a fraction above 0 and at most 1",
                self.share
            ));
        }
        if !ok(self.reconcile) {
            return Err(format!(
                "--api-reconcile-share {} must be a fraction above 0 and at most 1",
                self.reconcile
            ));
        }
        Ok(())
    }
}

/// What a client builds its budget from: the cloud's limits (time-scaled against an
/// emulator) and this provider's shares.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Settings {
    pub limits: Limits,
    pub shares: Shares,
}

impl Settings {
    /// The published limits of `limits` with the default shares.
    pub fn new(limits: Limits) -> Settings {
        Settings {
            limits,
            shares: Shares::default(),
        }
    }

    /// A fresh, full budget with these settings.
    pub fn budget(&self, prefix: &str) -> ApiBudget {
        ApiBudget::new(self.limits, self.shares, prefix)
    }
}

/// A request could not be given a token before its deadline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the API budget had no room for this request before its deadline")]
pub struct NoRoom;

/// A bucket's live level.
#[derive(Clone, Copy, Debug)]
struct Level {
    tokens: f64,
    capacity: f64,
    per_second: f64,
    /// Tokens of ours that the cloud's answers took away without this provider spending them
    /// (a 429 because another user of the token spent the bucket, a low `-Remaining`): held
    /// back, not lost, and handed back as soon as an answer shows the cloud's bucket has room
    /// for them again, so one storm never leaves the provider slower than its share. Tokens
    /// and held tokens together never exceed the capacity.
    held: f64,
}

impl Level {
    fn full(bucket: Bucket, fraction: f64) -> Level {
        Level {
            tokens: bucket.capacity * fraction,
            capacity: bucket.capacity * fraction,
            per_second: bucket.per_second * fraction,
            held: 0.0,
        }
    }

    fn refill(&mut self, elapsed: Duration) {
        self.tokens = (self.tokens + elapsed.as_secs_f64() * self.per_second).min(self.capacity);
        self.held = self.held.min(self.capacity - self.tokens).max(0.0);
    }

    /// The cloud has at most `cap` of ours left: hold back what is above it.
    fn hold_above(&mut self, cap: f64) {
        if self.tokens > cap {
            self.held = (self.held + self.tokens - cap.max(0.0)).min(self.capacity);
            self.tokens = cap;
        }
    }

    /// The cloud has room for `cap` of ours again: hand back what was held, up to it.
    fn release_up_to(&mut self, cap: f64) {
        let room = cap.min(self.capacity) - self.tokens;
        if room > 0.0 && self.held > 0.0 {
            let given = room.min(self.held);
            self.tokens += given;
            self.held -= given;
        }
    }

    /// How long until one whole token is there.
    fn wait_for_one(&self) -> Duration {
        if self.tokens >= 1.0 {
            return Duration::ZERO;
        }
        if self.per_second <= 0.0 {
            return Duration::from_secs(3600);
        }
        Duration::from_secs_f64((1.0 - self.tokens) / self.per_second)
    }
}

struct State {
    /// This provider's share of the cloud's bucket.
    main: Level,
    /// Its share of the headerless burst limit, if the cloud has one.
    burst: Option<Level>,
    /// The part background classes may spend.
    background: Level,
    refilled: Instant,
    /// No request is sent before this (a 429's `Retry-After`).
    paused_until: Option<Instant>,
    /// The requests waiting for a token, in the order they are served.
    queue: BTreeSet<(Class, u64)>,
    next_ticket: u64,
    shares: Shares,
    /// Until the first answer shows how full the cloud's bucket really is (another user, or
    /// this provider before a restart, may have spent it), one request at a time probes it and
    /// the rest of the bucket is held here.
    held: Option<f64>,
    /// Whether an answer has been seen.
    calibrated: bool,
    /// What the cloud last said is left of the whole bucket (`-Remaining`); the published
    /// capacity until an answer says.
    cloud_remaining: f64,
    /// When each request handed a token and not answered yet was sent, oldest first: an
    /// answer's `-Remaining` does not count them yet, so tokens handed back never overlook
    /// them. A request unanswered for [`IN_FLIGHT_FOR`] (a transport failure) is forgotten.
    in_flight: std::collections::VecDeque<Instant>,
}

/// How long a request counts as in flight without an answer: longer than any request's
/// timeout.
const IN_FLIGHT_FOR: Duration = Duration::from_secs(120);

impl State {
    fn refill(&mut self, now: Instant) {
        while self
            .in_flight
            .front()
            .is_some_and(|sent| now.saturating_duration_since(*sent) >= IN_FLIGHT_FOR)
        {
            self.in_flight.pop_front();
        }
        let elapsed = now.saturating_duration_since(self.refilled);
        self.refilled = now;
        self.main.refill(elapsed);
        if let Some(burst) = &mut self.burst {
            burst.refill(elapsed);
        }
        self.background.refill(elapsed);
    }

    /// Tokens of the share held back until an answer shows the cloud has room for them: those
    /// an answer took away (a 429, a low `-Remaining`), and at start those waiting for the
    /// probe's answer.
    fn held_back(&self) -> f64 {
        self.main.held + self.held.unwrap_or(0.0).max(0.0)
    }

    /// How long `class` must wait for its tokens; zero when it may go now.
    fn wait(&self, class: Class, now: Instant) -> Duration {
        let mut wait = self.main.wait_for_one();
        if let Some(burst) = &self.burst {
            wait = wait.max(burst.wait_for_one());
        }
        if class.is_background() {
            wait = wait.max(self.background.wait_for_one());
        }
        if let Some(until) = self.paused_until {
            wait = wait.max(until.saturating_duration_since(now));
        }
        wait
    }

    fn take(&mut self, class: Class, now: Instant) {
        self.in_flight.push_back(now);
        self.main.tokens -= 1.0;
        if !self.calibrated && self.held.is_none() {
            // The probe is out: hold the rest back until its answer.
            self.held = Some(self.main.tokens);
            self.main.tokens = 0.0;
        }
        if let Some(burst) = &mut self.burst {
            burst.tokens -= 1.0;
        }
        if class.is_background() {
            self.background.tokens -= 1.0;
        }
    }
}

/// The metric names of a budget, one set per binary prefix.
#[derive(Clone, Copy, Debug)]
struct Names {
    capacity: &'static str,
    remaining: &'static str,
    held: &'static str,
    cloud_remaining: &'static str,
    requests: &'static str,
    wait: &'static str,
    rate_limited: &'static str,
}

impl Names {
    fn for_prefix(prefix: &str) -> Names {
        static CACHE: OnceLock<Mutex<Vec<(String, Names)>>> = OnceLock::new();
        let mut cache = CACHE
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some((_, names)) = cache.iter().find(|(p, _)| p == prefix) {
            return *names;
        }
        // A bounded set of names per process (one per binary prefix).
        let leak =
            |name: &str| -> &'static str { Box::leak(format!("{prefix}_{name}").into_boxed_str()) };
        let names = Names {
            capacity: leak("api_budget_capacity"),
            remaining: leak("api_budget_remaining"),
            held: leak("api_budget_held"),
            cloud_remaining: leak("api_budget_cloud_remaining"),
            requests: leak("api_budget_requests_total"),
            wait: leak("api_budget_wait_seconds"),
            rate_limited: leak("api_rate_limited_total"),
        };
        cache.push((prefix.to_owned(), names));
        names
    }
}

/// The request scheduler of one cloud token. Cheap to clone; clones share the budget.
#[derive(Clone)]
pub struct ApiBudget {
    inner: Arc<Inner>,
}

struct Inner {
    state: Mutex<State>,
    changed: Notify,
    limits: Limits,
    names: Names,
    /// Requests handed a token so far, by class (in [`Class::ALL`] order).
    served: [std::sync::atomic::AtomicU64; 4],
    /// Of those, the ones the cloud answered 429, by class.
    limited: [std::sync::atomic::AtomicU64; 4],
}

impl std::fmt::Debug for ApiBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiBudget")
            .field("limits", &self.inner.limits)
            .finish_non_exhaustive()
    }
}

impl ApiBudget {
    /// A full budget over `limits`, of which this provider takes `shares`; metrics are named
    /// `<prefix>_api_budget_*`.
    pub fn new(limits: Limits, shares: Shares, prefix: &str) -> ApiBudget {
        let background = shares.share * shares.reconcile;
        let state = State {
            main: Level::full(limits.main, shares.share),
            burst: limits.burst.map(|b| Level::full(b, shares.share)),
            background: Level::full(limits.main, background),
            refilled: Instant::now(),
            paused_until: None,
            queue: BTreeSet::new(),
            next_ticket: 0,
            shares,
            held: None,
            calibrated: false,
            cloud_remaining: limits.main.capacity,
            in_flight: std::collections::VecDeque::new(),
        };
        let budget = ApiBudget {
            inner: Arc::new(Inner {
                state: Mutex::new(state),
                changed: Notify::new(),
                limits,
                names: Names::for_prefix(prefix),
                served: Default::default(),
                limited: Default::default(),
            }),
        };
        budget.publish(&budget.lock());
        budget
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn publish(&self, state: &State) {
        let names = &self.inner.names;
        gauge!(names.capacity).set(state.main.capacity);
        gauge!(names.remaining).set(state.main.tokens.max(0.0));
        gauge!(names.held).set(state.held_back());
        // Every series exists from the first publish (the budget may be built before the
        // metrics recorder, which then misses what was set once): the dashboard and the alert
        // read them.
        gauge!(names.cloud_remaining).set(state.cloud_remaining);
        counter!(names.rate_limited).increment(0);
    }

    /// Waits for a token for one request of the current task's [`Class`].
    pub async fn acquire(&self, deadline: Option<Instant>) -> Result<(), NoRoom> {
        self.acquire_as(current(), deadline).await
    }

    /// Waits until a request of `class` may be sent: its turn (every request of a higher
    /// class, and every earlier one of its own, served first) and its tokens. Gives up at
    /// `deadline`, leaving the queue as if it had never joined.
    pub async fn acquire_as(&self, class: Class, deadline: Option<Instant>) -> Result<(), NoRoom> {
        let started = Instant::now();
        let ticket = {
            let mut state = self.lock();
            let ticket = (class, state.next_ticket);
            state.next_ticket += 1;
            state.queue.insert(ticket);
            ticket
        };
        let mut place = Place {
            budget: self,
            ticket,
            served: false,
        };
        loop {
            let notified = self.inner.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let now = Instant::now();
            let wake = {
                let mut state = self.lock();
                state.refill(now);
                if state.queue.first() == Some(&ticket) {
                    let wait = state.wait(class, now);
                    if wait.is_zero() {
                        state.take(class, now);
                        state.queue.remove(&ticket);
                        self.publish(&state);
                        drop(state);
                        place.served = true;
                        self.inner.changed.notify_waiters();
                        self.inner.served[class as usize]
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let names = &self.inner.names;
                        counter!(names.requests, "class" => class.label()).increment(1);
                        histogram!(names.wait, "class" => class.label())
                            .record(started.elapsed().as_secs_f64());
                        return Ok(());
                    }
                    Some(now + wait)
                } else {
                    None
                }
            };
            if deadline.is_some_and(|d| d <= now) {
                // `place` leaves the queue and wakes the next in line.
                return Err(NoRoom);
            }
            let until = match (wake, deadline) {
                (Some(w), Some(d)) => Some(w.min(d)),
                (w, d) => w.or(d),
            };
            match until {
                Some(until) => {
                    tokio::select! {
                        () = &mut notified => {}
                        () = tokio::time::sleep_until(until) => {}
                    }
                }
                None => notified.await,
            }
        }
    }

    /// Corrects the bucket from one answer: its status and its rate-limit headers.
    pub fn observe(&self, status: u16, headers: &http::HeaderMap) {
        let number = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<f64>().ok())
                .filter(|v| v.is_finite() && *v >= 0.0)
        };
        let limit = number("ratelimit-limit");
        let remaining = number("ratelimit-remaining");
        let reset = number("ratelimit-reset");
        let retry_after = number("retry-after");
        let now = Instant::now();
        let mut state = self.lock();
        let shares = state.shares;
        if !state.calibrated {
            state.calibrated = true;
            if let Some(held) = state.held.take() {
                state.main.tokens = (state.main.tokens + held).min(state.main.capacity);
            }
        }
        state.refill(now);
        // This answer's request is no longer in flight.
        state.in_flight.pop_front();
        if let Some(limit) = limit.filter(|l| *l >= 1.0) {
            let ours = limit * shares.share;
            if (ours - state.main.capacity).abs() > f64::EPSILON {
                state.main.capacity = ours;
                state.main.tokens = state.main.tokens.min(ours);
                state.background.capacity = ours * shares.reconcile;
                state.background.tokens = state.background.tokens.min(ours * shares.reconcile);
            }
            if let (Some(remaining), Some(reset), ResetMeaning::Full) =
                (remaining, reset, self.inner.limits.reset)
                && let Some(rate) = refill_rate(limit, remaining, reset)
            {
                state.main.per_second = rate * shares.share;
                state.background.per_second = rate * shares.share * shares.reconcile;
            }
        }
        if let Some(remaining) = remaining {
            state.cloud_remaining = remaining;
            // Our part of what the cloud still holds: never more than our own bucket. What an
            // earlier answer held back comes back once the cloud has room for it (the cloud
            // refilled after a storm); what this answer shows missing is held back.
            let ours = remaining * shares.share;
            if status != 429 {
                let room = ours - state.in_flight.len() as f64;
                state.main.release_up_to(room);
                state.background.release_up_to(room);
            }
            state.main.hold_above(ours);
            state.background.hold_above(ours);
        }
        if status == 429 {
            counter!(self.inner.names.rate_limited).increment(1);
            self.inner.limited[current() as usize]
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            // Someone else spent the token's budget: nothing is left until the cloud says so.
            state.main.hold_above(0.0);
            // The headers describe the main limit. A 429 that shows it spent was that limit's,
            // held above and handed back by the first answer that shows room again; one that
            // shows room left in it (or no headers) was the shorter limit's, whose window no
            // header describes: spent, refilled at its rate.
            let main_spent = remaining.is_some_and(|r| r < 1.0);
            if let Some(burst) = state.burst.as_mut().filter(|_| !main_spent) {
                burst.tokens = burst.tokens.min(0.0);
            }
            if let Some(after) = retry_after {
                let until = now + Duration::from_secs_f64(after.min(3600.0));
                state.paused_until = Some(state.paused_until.map_or(until, |u| u.max(until)));
            }
        }
        if state.paused_until.is_some_and(|u| u <= now) {
            state.paused_until = None;
        }
        self.publish(&state);
        drop(state);
        self.inner.changed.notify_waiters();
    }

    /// Takes `shares` of the cloud's limits from now on (`--api-budget-share`,
    /// `--api-reconcile-share`, applied once the client is built); every clone of the client
    /// sees the change. Tokens already spent stay spent.
    pub fn set_shares(&self, shares: Shares) {
        let limits = self.inner.limits;
        let now = Instant::now();
        let mut state = self.lock();
        state.refill(now);
        let keep = |old: Level, new: Level| Level {
            tokens: old.tokens.min(new.capacity),
            ..new
        };
        state.main = keep(state.main, Level::full(limits.main, shares.share));
        if let (Some(old), Some(burst)) = (state.burst, limits.burst) {
            state.burst = Some(keep(old, Level::full(burst, shares.share)));
        }
        state.background = keep(
            state.background,
            Level::full(limits.main, shares.share * shares.reconcile),
        );
        state.shares = shares;
        self.publish(&state);
        drop(state);
        self.inner.changed.notify_waiters();
    }

    /// Tokens this provider may spend now (for tests and the metrics).
    pub fn remaining(&self) -> f64 {
        let mut state = self.lock();
        state.refill(Instant::now());
        state.main.tokens
    }

    /// Tokens of this provider's share held back until the cloud's answers show room for them
    /// (for tests and the metrics).
    pub fn held(&self) -> f64 {
        let mut state = self.lock();
        state.refill(Instant::now());
        state.held_back()
    }

    /// The refill rate this provider's share runs at now, in requests per second.
    pub fn refill_per_second(&self) -> f64 {
        self.lock().main.per_second
    }

    /// The refill rate of the background part of the share (`--api-reconcile-share` of it),
    /// which proofs, reconcile and refreshes draw on, in requests per second.
    pub fn background_per_second(&self) -> f64 {
        self.lock().background.per_second
    }

    /// How many requests of `class` were handed a token since the budget was made.
    pub fn served(&self, class: Class) -> u64 {
        self.inner.served[class as usize].load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many requests of `class` the cloud answered: those handed a token, less those
    /// answered 429 (what a piece of work costs when the cloud has room, whatever a storm
    /// made it retry).
    pub fn answered(&self, class: Class) -> u64 {
        let limited = self.inner.limited[class as usize].load(std::sync::atomic::Ordering::Relaxed);
        self.served(class).saturating_sub(limited)
    }
}

/// How long to wait before the next full reconcile survey: `floor` (`--reconcile-interval`),
/// or longer when the last survey's `cost` (requests: listing pages plus proofs) sent at that
/// cadence would spend more than the background refill rate `background_per_second` allows:
///
/// ```text
/// period = max(floor, cost / background_per_second)
/// ```
///
/// At 10,000 Hetzner servers a survey is 200 pages; with the default shares the background
/// rate is 0.5 × 0.2 × 3,600 = 360 requests per hour, so a survey runs every 33 minutes.
pub fn survey_period(floor: Duration, cost: u64, background_per_second: f64) -> Duration {
    if cost == 0 || !background_per_second.is_finite() || background_per_second <= 0.0 {
        return floor;
    }
    let paced = cost as f64 / background_per_second;
    // Never more than a day: a survey that rare would leave out-of-band deletions unseen.
    floor.max(Duration::from_secs_f64(paced.min(86_400.0)))
}

/// The most of the background refill rate the out-of-band checks between two surveys may take
/// ([`survey_pace`]): the surveys keep at least the rest, so checks slow them by a third at
/// most.
pub const CHECK_SHARE: f64 = 0.25;

/// The schedule from the end of one reconcile survey to the start of the next.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SurveyPace {
    /// The wait before the next survey.
    pub period: Duration,
    /// How often the cloud's out-of-band check runs meanwhile; `None` when it does not (the
    /// cloud has none, or the surveys run at the floor anyway).
    pub check_every: Option<Duration>,
}

impl SurveyPace {
    /// A survey every `floor`, with no check in between.
    pub fn floor(floor: Duration) -> SurveyPace {
        SurveyPace {
            period: floor,
            check_every: None,
        }
    }
}

/// The schedule after a survey that cost `survey_cost` requests, for a cloud whose out-of-band
/// check costs `check_cost` requests (`None`: it has none). Without a check the period is
/// [`survey_period`]'s. With one, the check runs every `floor`, or less often where that would
/// take more than [`CHECK_SHARE`] of the background refill rate `r`, and the checks' own rate
/// is left out of what the surveys may spend:
///
/// ```text
/// check_every = max(floor, check_cost / (CHECK_SHARE × r))
/// period      = max(floor, survey_cost / (r − check_cost / check_every))
/// ```
///
/// Checks are worth it only where they come at least twice as often as surveys would without
/// them; otherwise there are none and the surveys keep the whole rate. At 10,000 Hetzner
/// servers (200 pages, r = 0.1 a second) and the default 2-minute floor, a one-request check
/// every 2 minutes takes 8% of r and moves the survey from every 33 to every 36 minutes; at
/// 1,000 servers (a survey every 200 s) there is no check.
pub fn survey_pace(
    floor: Duration,
    survey_cost: u64,
    check_cost: Option<u64>,
    background_per_second: f64,
) -> SurveyPace {
    let alone = SurveyPace {
        period: survey_period(floor, survey_cost, background_per_second),
        check_every: None,
    };
    // A paced period implies a positive, finite rate and a survey that cost something.
    let (Some(check_cost), true) = (check_cost, alone.period > floor) else {
        return alone;
    };
    let every = floor.max(Duration::from_secs_f64(
        (check_cost as f64 / (CHECK_SHARE * background_per_second)).min(86_400.0),
    ));
    if every.is_zero() || every * 2 > alone.period {
        return alone;
    }
    let left = background_per_second - check_cost as f64 / every.as_secs_f64();
    let period = floor.max(Duration::from_secs_f64(
        (survey_cost as f64 / left).min(86_400.0),
    ));
    SurveyPace {
        period,
        check_every: Some(every),
    }
}

/// The cloud's refill rate from `limit`, `remaining` and a full-again `reset` (a Unix time in
/// whole seconds): only when the bucket is short by enough that the rounding of `reset` to a
/// second cannot skew it much.
fn refill_rate(limit: f64, remaining: f64, reset: f64) -> Option<f64> {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .ok()?
        .as_secs_f64();
    let window = reset - now;
    let missing = limit - remaining;
    (window >= 10.0 && missing >= 10.0).then(|| missing / window)
}

/// A waiter's place in the queue; leaving it (a deadline, or the caller dropping the wait)
/// frees the turn for the next in line.
struct Place<'a> {
    budget: &'a ApiBudget,
    ticket: (Class, u64),
    /// Set once the request got its token (and left the queue).
    served: bool,
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        if self.served {
            return;
        }
        self.budget.lock().queue.remove(&self.ticket);
        self.budget.inner.changed.notify_waiters();
    }
}

#[cfg(test)]
mod tests;

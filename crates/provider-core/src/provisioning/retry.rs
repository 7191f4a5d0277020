//! Retry with exponential backoff and jitter for cloud API calls (beyond.md §6): retried on 429
//! and 5xx and on transport errors. Only a 429 honours `Retry-After` and rate-limit reset hints
//! (both clouds send `RateLimit-Reset` on every answer, so a 5xx carrying one says nothing about
//! when to retry); no wait ever runs past the caller's deadline while another attempt still fits.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rand::RngExt;
use tokio::time::Instant;

/// How a failed attempt should be treated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Give up now and report the error.
    Fatal,
    /// Try again after the backoff, or after the server's hint when it gave one.
    Retry { after: Option<Duration> },
}

/// Classifies an HTTP status: 429 and 5xx (except 501) are retried. The server's hint is kept
/// for a 429 only; a 5xx backs off with jitter.
pub fn classify_status(status: u16, hint: Option<Duration>) -> Verdict {
    if status == 429 {
        Verdict::Retry { after: hint }
    } else if (500..600).contains(&status) && status != 501 {
        Verdict::Retry { after: None }
    } else {
        Verdict::Fatal
    }
}

/// The least time left for one more attempt after a wait that was shortened to fit the
/// deadline: a wait that would leave less than this gives up instead.
pub const ATTEMPT_ROOM: Duration = Duration::from_secs(1);

/// Reads a retry hint from response headers: `Retry-After` (seconds or an HTTP date is not
/// supported, seconds only), or `RateLimit-Reset` / `ratelimit-reset` (a Unix timestamp, as
/// Hetzner and DigitalOcean send it).
pub fn hint_from_headers(headers: &http::HeaderMap) -> Option<Duration> {
    let number = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    if let Some(seconds) = number("retry-after") {
        return Some(Duration::from_secs(seconds));
    }
    let reset = number("ratelimit-reset")?;
    let now = SystemTime::now().duration_since(UNIX_EPOCH).ok()?.as_secs();
    Some(Duration::from_secs(reset.saturating_sub(now)))
}

/// Exponential backoff with full jitter.
#[derive(Clone, Copy, Debug)]
pub struct Backoff {
    pub base: Duration,
    pub max: Duration,
    /// Attempts in total, including the first.
    pub max_attempts: u32,
}

impl Default for Backoff {
    fn default() -> Backoff {
        Backoff {
            base: Duration::from_millis(500),
            max: Duration::from_secs(30),
            max_attempts: 8,
        }
    }
}

impl Backoff {
    /// The delay before attempt `attempt + 1` (attempt counts from 1).
    pub fn delay(&self, attempt: u32, hint: Option<Duration>) -> Duration {
        if let Some(hint) = hint {
            return hint.min(self.max);
        }
        let exp = self
            .base
            .saturating_mul(1u32 << attempt.min(16).saturating_sub(1));
        let cap = exp.min(self.max);
        let jitter = rand::rng().random_range(0.5..=1.0);
        cap.mul_f64(jitter)
    }

    /// The wait before the next attempt given `deadline`: the planned wait, shortened so that
    /// one more attempt still fits before the deadline ([`ATTEMPT_ROOM`]); `None` when no
    /// attempt fits any more.
    pub fn fit(planned: Duration, deadline: Option<Instant>) -> Option<Duration> {
        let Some(deadline) = deadline else {
            return Some(planned);
        };
        let left = deadline.saturating_duration_since(Instant::now());
        if planned < left.saturating_sub(ATTEMPT_ROOM) || planned.is_zero() && !left.is_zero() {
            return Some(planned);
        }
        let shortened = left.saturating_sub(ATTEMPT_ROOM);
        (!shortened.is_zero()).then_some(shortened)
    }

    /// Runs `attempt` until it succeeds, fails fatally, runs out of attempts, or no further
    /// attempt fits before `deadline`. A wait (a 429's hint included) that would pass the
    /// deadline is shortened so one more attempt runs before it. `classify` decides per error.
    ///
    /// An attempt refused with a hint (a 429: the request never ran, and the wait for the
    /// next one is the API budget's) does not count against `max_attempts` when there is a
    /// deadline: a rate-limit storm delays a call by about its length, up to the deadline,
    /// instead of using up its attempts in a few seconds. Without a deadline every attempt
    /// counts.
    pub async fn run<T, E, F, Fut>(
        &self,
        deadline: Option<Instant>,
        mut attempt: F,
        classify: impl Fn(&E) -> Verdict,
    ) -> Result<T, E>
    where
        F: FnMut(u32) -> Fut,
        Fut: std::future::Future<Output = Result<T, E>>,
    {
        // `n` numbers the attempts (what `attempt` is told); `counted` those that count.
        let mut n = 1;
        let mut counted = 1;
        loop {
            let err = match attempt(n).await {
                Ok(v) => return Ok(v),
                Err(e) => e,
            };
            let Verdict::Retry { after } = classify(&err) else {
                return Err(err);
            };
            let limited = after.is_some() && deadline.is_some();
            if !limited && counted >= self.max_attempts {
                return Err(err);
            }
            let Some(wait) = Backoff::fit(self.delay(counted, after), deadline) else {
                return Err(err);
            };
            tokio::time::sleep(wait).await;
            n += 1;
            if !limited {
                counted += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn statuses() {
        assert_eq!(classify_status(429, None), Verdict::Retry { after: None });
        assert_eq!(classify_status(503, None), Verdict::Retry { after: None });
        let far = Some(Duration::from_secs(3600));
        assert_eq!(classify_status(429, far), Verdict::Retry { after: far });
        assert_eq!(
            classify_status(502, far),
            Verdict::Retry { after: None },
            "a 5xx never waits for the rate-limit reset"
        );
        assert_eq!(classify_status(501, None), Verdict::Fatal);
        assert_eq!(classify_status(404, None), Verdict::Fatal);
        assert_eq!(classify_status(422, None), Verdict::Fatal);
    }

    #[test]
    fn hints() {
        let mut h = http::HeaderMap::new();
        h.insert("retry-after", "7".parse().unwrap());
        assert_eq!(hint_from_headers(&h), Some(Duration::from_secs(7)));
        let mut h = http::HeaderMap::new();
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs();
        h.insert("ratelimit-reset", (now + 3).to_string().parse().unwrap());
        let d = hint_from_headers(&h).unwrap();
        assert!(d <= Duration::from_secs(3) && d >= Duration::from_secs(2));
        assert_eq!(hint_from_headers(&http::HeaderMap::new()), None);
    }

    #[tokio::test(start_paused = true)]
    async fn retries_until_success_and_stops_at_fatal_or_deadline() {
        let backoff = Backoff::default();
        let calls = AtomicU32::new(0);
        let r: Result<u32, u16> = backoff
            .run(
                None,
                |n| {
                    calls.fetch_add(1, Ordering::SeqCst);
                    async move { if n < 3 { Err(503) } else { Ok(n) } }
                },
                |s| classify_status(*s, None),
            )
            .await;
        assert_eq!(r, Ok(3));
        let r: Result<(), u16> = backoff
            .run(None, |_| async { Err(404) }, |s| classify_status(*s, None))
            .await;
        assert_eq!(r, Err(404));
        let deadline = Instant::now() + Duration::from_secs(2);
        let calls = AtomicU32::new(0);
        let r: Result<(), u16> = backoff
            .run(
                Some(deadline),
                |_| {
                    calls.fetch_add(1, Ordering::SeqCst);
                    async { Err(429) }
                },
                |s| classify_status(*s, Some(Duration::from_secs(1))),
            )
            .await;
        assert_eq!(r, Err(429));
        assert!(Instant::now() < deadline);
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    /// A rate-limit storm longer than the attempts would last (eight 429s a second apart) but
    /// shorter than the deadline delays the call by about its length and then lets it through;
    /// without a deadline the attempts still count.
    #[tokio::test(start_paused = true)]
    async fn a_rate_limit_storm_uses_no_attempts_while_the_deadline_allows() {
        let backoff = Backoff::default();
        let started = Instant::now();
        let storm = Duration::from_secs(20);
        let limited = |_: u32| async move {
            if started.elapsed() < storm {
                Err(429)
            } else {
                Ok(())
            }
        };
        let hint = |s: &u16| classify_status(*s, Some(Duration::from_secs(1)));
        let r: Result<(), u16> = backoff
            .run(Some(started + Duration::from_secs(60)), limited, hint)
            .await;
        assert_eq!(r, Ok(()));
        assert!(started.elapsed() <= storm + Duration::from_secs(1));
        let started = Instant::now();
        let calls = AtomicU32::new(0);
        let r: Result<(), u16> = backoff
            .run(
                None,
                |_| {
                    calls.fetch_add(1, Ordering::SeqCst);
                    async { Err(429) }
                },
                hint,
            )
            .await;
        assert_eq!(r, Err(429));
        assert_eq!(calls.load(Ordering::SeqCst), backoff.max_attempts);
        assert!(started.elapsed() < storm);
    }

    /// A 5xx that carries a rate-limit reset an hour away (both clouds send the header on every
    /// answer) is retried after a short backoff, not after the reset, and the call succeeds well
    /// within its deadline.
    #[tokio::test(start_paused = true)]
    async fn server_errors_back_off_without_waiting_for_the_reset() {
        let backoff = Backoff::default();
        let started = Instant::now();
        let deadline = started + Duration::from_secs(60);
        let far = Some(Duration::from_secs(3600));
        let r: Result<u32, u16> = backoff
            .run(
                Some(deadline),
                |n| async move { if n < 3 { Err(503) } else { Ok(n) } },
                |s| classify_status(*s, far),
            )
            .await;
        assert_eq!(r, Ok(3));
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "two jittered backoffs, not the reset: {:?}",
            started.elapsed()
        );
    }

    /// A 429 whose reset lies past the deadline waits only as long as still leaves room for one
    /// more attempt, and that attempt runs before the deadline.
    #[tokio::test(start_paused = true)]
    async fn a_far_rate_limit_reset_still_leaves_one_attempt_before_the_deadline() {
        let backoff = Backoff::default();
        let started = Instant::now();
        let deadline = started + Duration::from_secs(10);
        let at = std::sync::Mutex::new(Vec::new());
        let r: Result<u32, u16> = backoff
            .run(
                Some(deadline),
                |n| {
                    at.lock().unwrap().push(started.elapsed());
                    async move { if n < 2 { Err(429) } else { Ok(n) } }
                },
                |s| classify_status(*s, Some(Duration::from_secs(60))),
            )
            .await;
        assert_eq!(r, Ok(2));
        let at = at.into_inner().unwrap();
        assert!(
            at[1] < Duration::from_secs(10) && at[1] >= Duration::from_secs(8),
            "{at:?}"
        );
    }
}

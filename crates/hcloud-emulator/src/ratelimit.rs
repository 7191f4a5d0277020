//! Hetzner's rate limit, enforced: one token bucket per project (this emulator serves one
//! token) of `limit` requests refilled at `per_second`, with the headers Hetzner sends on every
//! answer (`RateLimit-Limit`, `RateLimit-Remaining`, and `RateLimit-Reset`, the Unix time at
//! which the bucket is full again), a 429 `rate_limit_exceeded` when it is empty, and a time
//! scale so a test lives through an hour's limit in seconds. Requests are also counted by the
//! class of work they are (see [`class_of`]).

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The limit a project's token is held to.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RateLimit {
    /// The bucket's size.
    pub limit: u32,
    /// Tokens returned per second.
    pub per_second: f64,
}

impl RateLimit {
    /// Hetzner Cloud's published limit: 3,600 requests, one returned every second.
    pub const HETZNER: RateLimit = RateLimit {
        limit: 3600,
        per_second: 1.0,
    };

    /// The same limit with time running `factor` times faster.
    pub fn time_scaled(self, factor: f64) -> RateLimit {
        RateLimit {
            per_second: self.per_second * factor,
            ..self
        }
    }
}

/// The live bucket.
#[derive(Debug)]
pub(crate) struct Bucket {
    limit: RateLimit,
    tokens: f64,
    refilled: Instant,
}

impl Bucket {
    pub(crate) fn full(limit: RateLimit) -> Bucket {
        Bucket {
            limit,
            tokens: f64::from(limit.limit),
            refilled: Instant::now(),
        }
    }

    fn refill(&mut self) {
        let now = Instant::now();
        let elapsed = now.saturating_duration_since(self.refilled).as_secs_f64();
        self.refilled = now;
        self.tokens =
            (self.tokens + elapsed * self.limit.per_second).min(f64::from(self.limit.limit));
    }

    /// Takes one token; false (a 429) when none is left.
    pub(crate) fn take(&mut self) -> bool {
        self.refill();
        if self.tokens < 1.0 {
            return false;
        }
        self.tokens -= 1.0;
        true
    }

    /// Spends up to `n` tokens as another user of the token would; returns how many it got.
    pub(crate) fn drain(&mut self, n: u32) -> u32 {
        self.refill();
        let got = (self.tokens.floor() as u32).min(n);
        self.tokens -= f64::from(got);
        got
    }

    pub(crate) fn remaining(&mut self) -> u32 {
        self.refill();
        self.tokens.floor() as u32
    }

    /// The three headers as Hetzner sends them.
    pub(crate) fn headers(&mut self) -> [(&'static str, u64); 3] {
        let remaining = self.remaining();
        let missing = f64::from(self.limit.limit) - self.tokens;
        let until_full = if self.limit.per_second > 0.0 {
            Duration::from_secs_f64((missing / self.limit.per_second).max(0.0))
        } else {
            Duration::from_secs(3600)
        };
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64();
        let reset = (now + until_full.as_secs_f64()).ceil() as u64;
        [
            ("ratelimit-limit", u64::from(self.limit.limit)),
            ("ratelimit-remaining", u64::from(remaining)),
            ("ratelimit-reset", reset),
        ]
    }
}

/// The class of work a request is, as the emulator counts it: `create`, `delete`, `label`
/// (a server's label write), `action` (any other POST), `poll` (a read of one server),
/// `listing` (servers by label selector), `count` (a page of one server by label selector,
/// read for its total), `lookup` (a server by name), `catalog` (types, locations, images,
/// networks and the other resources settings refer to).
pub fn class_of(method: &str, path: &str, query: &str) -> &'static str {
    let one_server = path.starts_with("/servers/") && !path.contains("/actions/");
    let one_a_page = query.split('&').any(|pair| pair == "per_page=1");
    match method {
        "POST" if path == "/servers" => "create",
        "POST" => "action",
        "DELETE" => "delete",
        "PUT" if one_server => "label",
        "PUT" => "action",
        "GET" if one_server => "poll",
        "GET" if path == "/servers" && query.contains("label_selector=") && one_a_page => "count",
        "GET" if path == "/servers" && query.contains("label_selector=") => "listing",
        "GET" if path == "/servers" => "lookup",
        _ => "catalog",
    }
}

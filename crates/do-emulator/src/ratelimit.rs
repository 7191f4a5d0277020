//! DigitalOcean's rate limits, enforced: per token 5,000 requests an hour and 250 a minute,
//! each a token bucket here, with the headers DigitalOcean sends on every answer
//! (`ratelimit-limit`, `ratelimit-remaining` of the hourly limit, and `ratelimit-reset`, the
//! Unix time at which a request of the window stops counting), a 429 `too_many_requests` with
//! `retry-after` when either is spent, and a time scale so a test lives through an hour in
//! seconds. Requests are also counted by the class of work they are ([`class_of`]).

use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// The limits a token is held to.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RateLimit {
    /// Requests per hour.
    pub per_hour: u32,
    /// Requests per minute.
    pub per_minute: u32,
    /// How many times faster than real time the buckets refill.
    pub time_scale: f64,
}

impl RateLimit {
    /// DigitalOcean's published limits.
    pub const DIGITALOCEAN: RateLimit = RateLimit {
        per_hour: 5000,
        per_minute: 250,
        time_scale: 1.0,
    };

    /// The same limits with time running `factor` times faster.
    pub fn time_scaled(self, factor: f64) -> RateLimit {
        RateLimit {
            time_scale: self.time_scale * factor,
            ..self
        }
    }
}

#[derive(Debug)]
struct Level {
    capacity: f64,
    per_second: f64,
    tokens: f64,
}

impl Level {
    fn seconds_to_one(&self) -> f64 {
        if self.tokens >= 1.0 || self.per_second <= 0.0 {
            0.0
        } else {
            (1.0 - self.tokens) / self.per_second
        }
    }
}

/// The live buckets.
#[derive(Debug)]
pub(crate) struct Buckets {
    hour: Level,
    minute: Level,
    refilled: Instant,
}

impl Buckets {
    pub(crate) fn full(limit: RateLimit) -> Buckets {
        let level = |capacity: u32, window: f64| Level {
            capacity: f64::from(capacity),
            per_second: f64::from(capacity) / window * limit.time_scale,
            tokens: f64::from(capacity),
        };
        Buckets {
            hour: level(limit.per_hour, 3600.0),
            minute: level(limit.per_minute, 60.0),
            refilled: Instant::now(),
        }
    }

    fn refill(&mut self) {
        let now = Instant::now();
        let elapsed = now.saturating_duration_since(self.refilled).as_secs_f64();
        self.refilled = now;
        for level in [&mut self.hour, &mut self.minute] {
            level.tokens = (level.tokens + elapsed * level.per_second).min(level.capacity);
        }
    }

    /// Takes one token of each limit; `Err(retry_after_seconds)` (a 429) when either is spent.
    pub(crate) fn take(&mut self) -> Result<(), u64> {
        self.refill();
        if self.hour.tokens < 1.0 || self.minute.tokens < 1.0 {
            let wait = self.hour.seconds_to_one().max(self.minute.seconds_to_one());
            return Err(wait.ceil().max(1.0) as u64);
        }
        self.hour.tokens -= 1.0;
        self.minute.tokens -= 1.0;
        Ok(())
    }

    /// Spends up to `n` requests of both limits as another user of the token would; returns
    /// how many it got.
    pub(crate) fn drain(&mut self, n: u32) -> u32 {
        self.refill();
        let got = (self.hour.tokens.min(self.minute.tokens).floor().max(0.0) as u32).min(n);
        self.hour.tokens -= f64::from(got);
        self.minute.tokens -= f64::from(got);
        got
    }

    /// Sets what is left of the hourly limit (spent earlier in the hour; the minute's is not).
    pub(crate) fn set_hourly_remaining(&mut self, left: u32) {
        self.refill();
        self.hour.tokens = f64::from(left).min(self.hour.capacity);
    }

    pub(crate) fn remaining(&mut self) -> u32 {
        self.refill();
        self.hour.tokens.floor().max(0.0) as u32
    }

    /// The three headers as DigitalOcean sends them.
    pub(crate) fn headers(&mut self) -> [(&'static str, u64); 3] {
        let remaining = self.remaining();
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64();
        let one_back = if self.hour.per_second > 0.0 {
            1.0 / self.hour.per_second
        } else {
            3600.0
        };
        [
            ("ratelimit-limit", self.hour.capacity as u64),
            ("ratelimit-remaining", u64::from(remaining)),
            ("ratelimit-reset", (now + one_back).ceil() as u64),
        ]
    }
}

/// The class of work a request is, as the emulator counts it: `create`, `delete`, `tag` (a
/// tag written or removed), `poll` (a read of one Droplet), `listing` (Droplets by tag),
/// `actions` (the account's action list), `catalog` (sizes, regions, images, keys and the
/// other resources settings refer to).
pub fn class_of(method: &str, path: &str) -> &'static str {
    let one_droplet = path.starts_with("/v2/droplets/");
    match method {
        "POST" if path == "/v2/droplets" => "create",
        "DELETE" if path.starts_with("/v2/tags") => "tag",
        "DELETE" => "delete",
        "POST" if path.starts_with("/v2/tags") => "tag",
        "GET" if one_droplet => "poll",
        "GET" if path == "/v2/droplets" => "listing",
        "GET" if path == "/v2/actions" => "actions",
        _ => "catalog",
    }
}

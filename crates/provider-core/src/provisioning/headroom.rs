//! The account's headroom: how many more hosts the cloud account may hold (its limit less the
//! hosts it has, whoever made them, less this provider's Creates in flight), which caps the
//! Speculative slots advertised, so the shard never plans on a machine the account cannot hold.
//!
//! The limit comes from the cloud's API where it has one (DigitalOcean's `droplet_limit`), or is
//! learned from a refusal (Hetzner's 403 `resource_limit_exceeded`: the limit is then the hosts
//! the account held when refused). A learned limit holds until a Delete makes room, or a probe
//! Create (one, after a backoff, while no headroom is left) succeeds, which shows the limit was
//! raised. Pure bookkeeping over a clock passed in.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::provisioning::stockout::{Admission, StockoutBackoff};

/// Where the limit came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitSource {
    /// The cloud's API reports it; every account read replaces it.
    Api,
    /// Learned from a refusal; held until a probe shows more.
    Learned,
}

#[derive(Debug, Default)]
struct State {
    limit: Option<(u64, LimitSource)>,
    /// Hosts the account holds, as last read or learned, with this provider's own creates and
    /// deletes since.
    hosts: u64,
    /// This provider's Creates admitted and not yet ended.
    in_flight: u64,
    /// Refusals in a row, and when the next probe of a learned limit may go.
    strikes: u32,
    probe_at: Option<Instant>,
    probing: bool,
}

impl State {
    fn headroom(&self) -> Option<u64> {
        self.limit
            .map(|(limit, _)| limit.saturating_sub(self.hosts + self.in_flight))
    }

    fn probe_due(&self, now: Instant) -> bool {
        matches!(self.limit, Some((_, LimitSource::Learned)))
            && !self.probing
            && self.probe_at.is_none_or(|at| now >= at)
    }
}

/// The account's headroom (see the module documentation).
#[derive(Debug, Default)]
pub struct Headroom {
    backoff: StockoutBackoff,
    state: Mutex<State>,
}

/// What the account holds, as one read of the cloud found it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AccountHosts {
    /// The account's host limit, when the API reports one.
    pub limit: Option<u64>,
    /// Every host the account holds (not only this provider's).
    pub hosts: u64,
}

impl Headroom {
    pub fn new(backoff: StockoutBackoff) -> Headroom {
        Headroom {
            backoff,
            state: Mutex::default(),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes a read of the account. An API limit replaces any; without one a learned limit
    /// stays. Returns whether the advertised cap may have changed.
    pub fn read(&self, account: AccountHosts) -> bool {
        let mut s = self.state();
        let before = s.headroom();
        s.hosts = account.hosts;
        if let Some(limit) = account.limit {
            s.limit = Some((limit, LimitSource::Api));
        }
        before != s.headroom()
    }

    /// The limit and where it came from, if known.
    pub fn limit(&self) -> Option<(u64, LimitSource)> {
        self.state().limit
    }

    /// How many more hosts the account may hold now; `None` when no limit is known.
    pub fn headroom(&self) -> Option<u64> {
        self.state().headroom()
    }

    /// The most Speculative slots to advertise at `now`: the headroom, or one while a probe of
    /// a learned limit is due and none is left; `None` without a known limit.
    pub fn cap(&self, now: Instant) -> Option<usize> {
        let s = self.state();
        let headroom = s.headroom()?;
        let probe = u64::from(headroom == 0 && s.probe_due(now));
        Some(usize::try_from(headroom + probe).unwrap_or(usize::MAX))
    }

    /// When a due probe will raise the cap (after `now`), if one is waiting.
    pub fn next_change(&self, now: Instant) -> Option<Instant> {
        let s = self.state();
        match (s.limit, s.probe_at) {
            (Some((_, LimitSource::Learned)), Some(at)) if at > now && !s.probing => Some(at),
            _ => None,
        }
    }

    /// Decides for a Create at `now`. An admitted one ([`Admission::Open`] or, past a learned
    /// limit, [`Admission::Probe`]) counts as in flight until [`Headroom::ended`].
    pub fn admit(&self, now: Instant) -> Admission {
        let mut s = self.state();
        match s.headroom() {
            None => {
                s.in_flight += 1;
                Admission::Open
            }
            Some(room) if room > 0 => {
                s.in_flight += 1;
                Admission::Open
            }
            Some(_) if s.probe_due(now) => {
                s.in_flight += 1;
                s.probing = true;
                Admission::Probe
            }
            Some(_) => Admission::Withdrawn {
                code: "account_limit",
                left: s
                    .probe_at
                    .map_or(Duration::ZERO, |at| at.saturating_duration_since(now)),
            },
        }
    }

    /// An admitted Create ended: `created` when it made (or found) a host, `probe` when it was
    /// the probe of a learned limit. A probe that made a host shows the limit was raised: it is
    /// forgotten until the next refusal.
    pub fn ended(&self, created: bool, probe: bool) {
        let mut s = self.state();
        s.in_flight = s.in_flight.saturating_sub(1);
        if probe {
            s.probing = false;
        }
        if created {
            s.hosts += 1;
            if probe {
                s.limit = None;
                s.strikes = 0;
                s.probe_at = None;
            }
        }
    }

    /// The cloud refused a Create at `now` for the account's limit, the account holding
    /// `account_hosts` when it could tell. The Create counts as ended. With an API limit the
    /// account is taken as full until the next read or Delete; otherwise the limit is learned:
    /// the hosts held (else those known plus the Creates in flight), and its next probe waits
    /// for a backoff (`jitter` in `[0, 1)`). Returns the wait.
    pub fn refused(
        &self,
        account_hosts: Option<u64>,
        probe: bool,
        now: Instant,
        jitter: f64,
    ) -> Duration {
        let mut s = self.state();
        s.in_flight = s.in_flight.saturating_sub(1);
        if probe {
            s.probing = false;
        }
        // Nothing more fits now; the Creates still in flight count against it.
        match s.limit {
            Some((limit, LimitSource::Api)) => s.hosts = limit.saturating_sub(s.in_flight),
            _ => {
                let held = account_hosts.unwrap_or(s.hosts + s.in_flight);
                s.limit = Some((held, LimitSource::Learned));
                s.hosts = held.saturating_sub(s.in_flight);
            }
        }
        s.strikes = s.strikes.saturating_add(1);
        let wait = self.backoff.wait(s.strikes, jitter);
        s.probe_at = Some(now + wait);
        wait
    }

    /// The provider deleted a host: one more fits.
    pub fn deleted(&self) {
        let mut s = self.state();
        s.hosts = s.hosts.saturating_sub(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_secs(60);

    fn headroom() -> Headroom {
        Headroom::new(StockoutBackoff {
            first: 5 * MIN,
            max: 30 * MIN,
        })
    }

    #[test]
    fn without_a_limit_nothing_is_capped() {
        let h = headroom();
        let now = Instant::now();
        assert_eq!(h.cap(now), None);
        assert_eq!(h.admit(now), Admission::Open);
        h.ended(true, false);
        assert_eq!(h.cap(now), None);
    }

    #[test]
    fn an_api_limit_caps_by_the_account_hosts_and_the_creates_in_flight() {
        let h = headroom();
        let now = Instant::now();
        assert!(h.read(AccountHosts {
            limit: Some(10),
            hosts: 8,
        }));
        assert_eq!(h.cap(now), Some(2));
        assert_eq!(h.admit(now), Admission::Open);
        assert_eq!(h.cap(now), Some(1));
        assert_eq!(h.admit(now), Admission::Open);
        assert_eq!(h.cap(now), Some(0));
        assert!(matches!(h.admit(now), Admission::Withdrawn { .. }));
        h.ended(true, false);
        h.ended(false, false);
        assert_eq!(h.cap(now), Some(1));
        h.deleted();
        assert_eq!(h.cap(now), Some(2));
        // Someone else made hosts: the API's limit is met, until the next read.
        assert_eq!(h.admit(now), Admission::Open);
        h.refused(None, false, now, 0.0);
        assert_eq!(h.cap(now), Some(0));
        assert_eq!(h.limit(), Some((10, LimitSource::Api)));
        assert!(matches!(
            h.admit(now + 60 * MIN),
            Admission::Withdrawn { .. }
        ));
        h.read(AccountHosts {
            limit: Some(10),
            hosts: 7,
        });
        assert_eq!(h.cap(now), Some(3));
    }

    #[test]
    fn a_learned_limit_holds_until_a_delete_or_a_successful_probe() {
        let h = headroom();
        let t0 = Instant::now();
        h.read(AccountHosts {
            limit: None,
            hosts: 3,
        });
        assert_eq!(h.cap(t0), None);
        // Four Creates go; the project may hold 5 servers: two succeed, two are refused.
        for _ in 0..4 {
            assert_eq!(h.admit(t0), Admission::Open);
        }
        h.ended(true, false);
        h.ended(true, false);
        assert_eq!(h.refused(Some(5), false, t0, 0.0), 5 * MIN);
        h.refused(Some(5), false, t0, 0.0);
        assert_eq!(h.limit(), Some((5, LimitSource::Learned)));
        assert_eq!(h.cap(t0), Some(0));
        assert!(matches!(h.admit(t0), Admission::Withdrawn { .. }));
        // A delete makes room for one.
        h.deleted();
        assert_eq!(h.cap(t0), Some(1));
        assert_eq!(h.admit(t0), Admission::Open);
        h.ended(true, false);
        assert_eq!(h.cap(t0), Some(0));
        // After the backoff (10 minutes: the second refusal in a row), one probe is advertised.
        assert_eq!(h.next_change(t0), Some(t0 + 10 * MIN));
        let later = t0 + 10 * MIN;
        assert_eq!(h.cap(later), Some(1));
        assert_eq!(h.admit(later), Admission::Probe);
        assert_eq!(h.cap(later), Some(0), "only one probe at a time");
        assert!(matches!(h.admit(later), Admission::Withdrawn { .. }));
        // It made a host: the limit was raised, and is forgotten.
        h.ended(true, true);
        assert_eq!(h.cap(later), None);
    }

    #[test]
    fn a_refused_probe_backs_off_longer() {
        let h = headroom();
        let t0 = Instant::now();
        h.admit(t0);
        h.refused(Some(2), false, t0, 0.0);
        let t1 = t0 + 5 * MIN;
        assert_eq!(h.admit(t1), Admission::Probe);
        assert_eq!(h.refused(Some(2), true, t1, 0.0), 10 * MIN);
        assert_eq!(h.cap(t1), Some(0));
        assert_eq!(h.cap(t1 + 10 * MIN), Some(1));
    }
}

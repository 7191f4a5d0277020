//! Offerings withdrawn after a stockout: a Create the cloud refused because the type cannot be
//! placed in the zone now withdraws the offering there for a backoff (`--stockout-backoff`,
//! doubling on each stockout in a row up to `--stockout-backoff-max`, with jitter). While it is
//! withdrawn its Speculative slots are not advertised and a Create on one is answered without
//! a request. When the backoff ends the slots come back, and the next Create on the offering is
//! the one probe: while it runs the offering is withdrawn again, so concurrent Creates send
//! nothing either; a host made ends the withdrawal, another stockout starts a longer backoff.
//! So a sold-out offering costs at most one probe per backoff, whatever the demand. The cloud's
//! availability flag turning back on ends a withdrawal at once.
//!
//! Pure bookkeeping over a clock passed in: no I/O, no timers.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// The backoff of a withdrawn offering.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StockoutBackoff {
    /// The first wait (`--stockout-backoff`).
    pub first: Duration,
    /// The longest wait (`--stockout-backoff-max`).
    pub max: Duration,
}

impl Default for StockoutBackoff {
    fn default() -> StockoutBackoff {
        StockoutBackoff {
            first: Duration::from_secs(5 * 60),
            max: Duration::from_secs(30 * 60),
        }
    }
}

/// The share of a wait jitter may take off it: a wait lies in `[0.8, 1.0]` of its nominal
/// value, so many providers sold out together do not probe in step, and none waits longer than
/// `max`.
pub const JITTER: f64 = 0.2;

impl StockoutBackoff {
    /// The wait after the `strikes`-th stockout in a row (from 1), with `jitter` in `[0, 1)`.
    pub fn wait(&self, strikes: u32, jitter: f64) -> Duration {
        let doublings = strikes.saturating_sub(1).min(31);
        let nominal = self
            .first
            .checked_mul(1u32 << doublings)
            .unwrap_or(self.max)
            .min(self.max);
        nominal.mul_f64(1.0 - JITTER * jitter.clamp(0.0, 1.0))
    }

    /// Checks the two flags.
    pub fn validate(&self) -> Result<(), String> {
        if self.first.is_zero() {
            return Err("--stockout-backoff must be a positive duration".into());
        }
        if self.max < self.first {
            return Err(format!(
                "--stockout-backoff-max ({}) must not be shorter than --stockout-backoff ({})",
                crate::observability::duration::format(self.max),
                crate::observability::duration::format(self.first)
            ));
        }
        Ok(())
    }
}

/// One withdrawn offering.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Withdrawal {
    /// Stockouts in a row (a host made starts over).
    pub strikes: u32,
    /// When the backoff ends and the next Create may probe.
    pub until: Instant,
    /// Whether the probe is in flight.
    pub probing: bool,
    /// The cloud's code of the last refusal.
    pub code: &'static str,
}

/// What [`Withdrawals::admit`] decided for a Create.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Not withdrawn: go ahead.
    Open,
    /// The backoff is over: this Create is the probe (report its end with
    /// [`Withdrawals::sold`], [`Withdrawals::stockout`] or [`Withdrawals::inconclusive`]).
    Probe,
    /// Withdrawn: send nothing.
    Withdrawn {
        code: &'static str,
        /// Until the backoff ends (zero while a probe runs).
        left: Duration,
    },
}

type Key = (String, String);

/// The withdrawn offerings by (instance type, zone).
#[derive(Debug, Default)]
pub struct Withdrawals {
    backoff: StockoutBackoff,
    entries: Mutex<HashMap<Key, Withdrawal>>,
}

fn key(instance_type: &str, zone: &str) -> Key {
    (instance_type.to_owned(), zone.to_owned())
}

impl Withdrawals {
    pub fn new(backoff: StockoutBackoff) -> Withdrawals {
        Withdrawals {
            backoff,
            entries: Mutex::default(),
        }
    }

    pub fn backoff(&self) -> StockoutBackoff {
        self.backoff
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Withdrawal>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Why the offering is withdrawn at `now` (its slots not advertised), or `None`: it is
    /// withdrawn from the stockout until its backoff ends, and again while its probe runs.
    pub fn withdrawn(&self, instance_type: &str, zone: &str, now: Instant) -> Option<String> {
        let entries = self.entries();
        let w = entries.get(&key(instance_type, zone))?;
        if w.probing {
            Some(format!("{}: a probe Create is in flight", w.code))
        } else if now < w.until {
            Some(format!(
                "{} (stockout {} in a row; probing again in {})",
                w.code,
                w.strikes,
                crate::observability::duration::format(round_secs(w.until - now))
            ))
        } else {
            None
        }
    }

    /// Decides for a Create on the offering at `now`; a [`Admission::Probe`] marks the probe
    /// in flight.
    pub fn admit(&self, instance_type: &str, zone: &str, now: Instant) -> Admission {
        let mut entries = self.entries();
        let Some(w) = entries.get_mut(&key(instance_type, zone)) else {
            return Admission::Open;
        };
        if w.probing {
            return Admission::Withdrawn {
                code: w.code,
                left: Duration::ZERO,
            };
        }
        if now < w.until {
            return Admission::Withdrawn {
                code: w.code,
                left: w.until - now,
            };
        }
        w.probing = true;
        Admission::Probe
    }

    /// A stockout at `now` (`jitter` in `[0, 1)`) of a Create admitted as the probe (`probe`)
    /// or while the offering was open: the offering is withdrawn for the next backoff. Returns
    /// the wait.
    ///
    /// A refusal of a Create that was sent while the offering was open but arrives while a
    /// withdrawal is already in force (the rest of a burst sent before the first refusal came
    /// back) is the same stockout, not another one in a row: it leaves the backoff as it is, so
    /// a burst of N Creates on a sold-out offering costs one strike, not N.
    pub fn stockout(
        &self,
        instance_type: &str,
        zone: &str,
        code: &'static str,
        now: Instant,
        jitter: f64,
        probe: bool,
    ) -> Duration {
        let mut entries = self.entries();
        let w = entries
            .entry(key(instance_type, zone))
            .or_insert(Withdrawal {
                strikes: 0,
                until: now,
                probing: false,
                code,
            });
        if !probe && w.strikes > 0 && (w.probing || now < w.until) {
            return w.until.saturating_duration_since(now);
        }
        w.strikes = w.strikes.saturating_add(1);
        let wait = self.backoff.wait(w.strikes, jitter);
        w.until = now + wait;
        w.probing = false;
        w.code = code;
        wait
    }

    /// The cloud made a host of the offering (or says it sells it again): the withdrawal ends.
    /// Returns whether there was one.
    pub fn sold(&self, instance_type: &str, zone: &str) -> bool {
        self.entries().remove(&key(instance_type, zone)).is_some()
    }

    /// The probe ended without telling (another error): the offering is advertised again and
    /// the next Create probes.
    pub fn inconclusive(&self, instance_type: &str, zone: &str) {
        if let Some(w) = self.entries().get_mut(&key(instance_type, zone)) {
            w.probing = false;
        }
    }

    /// When the next backoff ends after `now` (the withdrawn slots then come back).
    pub fn next_change(&self, now: Instant) -> Option<Instant> {
        self.entries()
            .values()
            .filter(|w| !w.probing && w.until > now)
            .map(|w| w.until)
            .min()
    }

    /// Every withdrawal, sorted by offering.
    pub fn all(&self) -> Vec<(Key, Withdrawal)> {
        let mut all: Vec<_> = self
            .entries()
            .iter()
            .map(|(k, w)| (k.clone(), w.clone()))
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }
}

fn round_secs(d: Duration) -> Duration {
    Duration::from_secs(d.as_secs() + u64::from(d.subsec_nanos() > 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_secs(60);

    fn backoff() -> StockoutBackoff {
        StockoutBackoff {
            first: 5 * MIN,
            max: 30 * MIN,
        }
    }

    #[test]
    fn the_wait_doubles_up_to_the_cap_and_jitter_only_shortens_it() {
        let b = backoff();
        assert_eq!(b.wait(1, 0.0), 5 * MIN);
        assert_eq!(b.wait(2, 0.0), 10 * MIN);
        assert_eq!(b.wait(3, 0.0), 20 * MIN);
        assert_eq!(b.wait(4, 0.0), 30 * MIN);
        assert_eq!(b.wait(400, 0.0), 30 * MIN);
        assert_eq!(b.wait(1, 0.5), Duration::from_secs(270));
        for strikes in 1..10 {
            for jitter in [0.0, 0.3, 0.999] {
                let w = b.wait(strikes, jitter);
                assert!(w <= b.max && w >= b.wait(strikes, 0.0).mul_f64(0.8));
            }
        }
    }

    #[test]
    fn bad_flags_are_named() {
        let zero = StockoutBackoff {
            first: Duration::ZERO,
            ..backoff()
        };
        assert!(zero.validate().unwrap_err().contains("--stockout-backoff "));
        let short = StockoutBackoff {
            first: 10 * MIN,
            max: 5 * MIN,
        };
        let err = short.validate().unwrap_err();
        assert!(err.contains("--stockout-backoff-max (5m0s)"), "{err}");
        assert_eq!(backoff().validate(), Ok(()));
    }

    #[test]
    fn a_stockout_withdraws_until_the_backoff_ends_then_one_probe_goes() {
        let w = Withdrawals::new(backoff());
        let t0 = Instant::now();
        assert_eq!(w.admit("cx22", "nbg1", t0), Admission::Open);
        assert_eq!(w.withdrawn("cx22", "nbg1", t0), None);
        let wait = w.stockout("cx22", "nbg1", "resource_unavailable", t0, 0.0, false);
        assert_eq!(wait, 5 * MIN);
        assert!(w.withdrawn("cx22", "nbg1", t0).is_some());
        assert_eq!(w.withdrawn("cx22", "fsn1", t0), None, "per location");
        assert_eq!(
            w.admit("cx22", "nbg1", t0 + MIN),
            Admission::Withdrawn {
                code: "resource_unavailable",
                left: 4 * MIN
            }
        );
        assert_eq!(w.next_change(t0), Some(t0 + 5 * MIN));
        let later = t0 + 5 * MIN;
        assert_eq!(w.withdrawn("cx22", "nbg1", later), None, "advertised again");
        assert_eq!(w.admit("cx22", "nbg1", later), Admission::Probe);
        // While the probe runs, the offering is withdrawn and nothing else goes.
        assert!(w.withdrawn("cx22", "nbg1", later).is_some());
        assert!(matches!(
            w.admit("cx22", "nbg1", later),
            Admission::Withdrawn { .. }
        ));
        assert_eq!(w.next_change(later), None);
        // Sold out again: a longer backoff.
        assert_eq!(
            w.stockout("cx22", "nbg1", "resource_unavailable", later, 0.0, true),
            10 * MIN
        );
        let after = later + 10 * MIN;
        assert_eq!(w.admit("cx22", "nbg1", after), Admission::Probe);
        // The probe made a host: the offering is back, and a later stockout starts over.
        assert!(w.sold("cx22", "nbg1"));
        assert_eq!(w.admit("cx22", "nbg1", after), Admission::Open);
        assert_eq!(
            w.stockout("cx22", "nbg1", "resource_unavailable", after, 0.0, false),
            5 * MIN
        );
    }

    #[test]
    fn an_inconclusive_probe_reopens_the_offering() {
        let w = Withdrawals::new(backoff());
        let t0 = Instant::now();
        w.stockout("a", "z", "resource_unavailable", t0, 0.0, false);
        let later = t0 + 5 * MIN;
        assert_eq!(w.admit("a", "z", later), Admission::Probe);
        w.inconclusive("a", "z");
        assert_eq!(w.withdrawn("a", "z", later), None);
        assert_eq!(w.admit("a", "z", later), Admission::Probe);
        assert_eq!(w.all().len(), 1);
    }

    /// Whatever the demand, a sold-out offering sees at most one probe per backoff: over an
    /// hour with a Create every second, the probes number what the waits allow.
    #[test]
    fn the_probes_of_an_hour_are_bounded_whatever_the_demand() {
        let w = Withdrawals::new(backoff());
        let t0 = Instant::now();
        let mut probes = 0;
        let mut sent = 0;
        for second in 0..3600u64 {
            let now = t0 + Duration::from_secs(second);
            match w.admit("a", "z", now) {
                admission @ (Admission::Open | Admission::Probe) => {
                    sent += 1;
                    probes += 1;
                    let probe = admission == Admission::Probe;
                    w.stockout("a", "z", "resource_unavailable", now, 0.999, probe);
                }
                Admission::Withdrawn { .. } => {}
            }
        }
        // Waits of about 4, 8, 16 and then 24 minutes (jitter at its most): 5 sends in an hour.
        assert_eq!(sent, probes);
        assert!(probes <= 5, "{probes} probes");
        assert!(probes >= 4, "{probes} probes");
    }

    /// A burst sent while the offering was open is refused request by request: the first
    /// refusal withdraws the offering, the rest of the burst adds no strike, so the first probe
    /// still comes after the first backoff, not after the longest.
    #[test]
    fn the_refusals_of_one_burst_are_one_stockout() {
        let w = Withdrawals::new(backoff());
        let t0 = Instant::now();
        for _ in 0..20 {
            assert_eq!(w.admit("a", "z", t0), Admission::Open);
        }
        assert_eq!(
            w.stockout("a", "z", "resource_unavailable", t0, 0.0, false),
            5 * MIN
        );
        for i in 1..20u64 {
            let now = t0 + Duration::from_millis(i);
            let left = w.stockout("a", "z", "resource_unavailable", now, 0.0, false);
            assert_eq!(left, 5 * MIN - Duration::from_millis(i));
        }
        assert_eq!(w.all()[0].1.strikes, 1);
        let later = t0 + 5 * MIN;
        assert_eq!(w.admit("a", "z", later), Admission::Probe);
        // A late refusal of the burst while the probe runs changes nothing either.
        w.stockout("a", "z", "resource_unavailable", later, 0.0, false);
        assert!(w.all()[0].1.probing);
        assert_eq!(
            w.stockout("a", "z", "resource_unavailable", later, 0.0, true),
            10 * MIN
        );
        assert_eq!(w.all()[0].1.strikes, 2);
    }
}

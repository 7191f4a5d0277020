//! The API budget after each 429 storm and 5xx burst: the tokens an error answer made the
//! provider hold back (a 429, or an answer that says nothing is left) must come back with the
//! first answers that show the cloud has room again, so that one storm never leaves the
//! provider slower than its share for the rest of the run.
//!
//! Before a storm the soak reads the provider's budget from its metrics. After the storm's end
//! it reads it again until the budget is back:
//!
//! - what is held back (`<prefix>_api_budget_held`) is at most a tenth of the bucket (tokens
//!   for requests still in flight are not handed back until they are answered);
//! - the tokens left (`<prefix>_api_budget_remaining`) plus those spent since
//!   (`<prefix>_api_budget_requests_total`) make up what was there before, within the same
//!   tenth (refills only add).
//!
//! Storms that follow each other before the budget is seen back are one window. The verdict
//! counts answers, not seconds: a window whose budget is still short once the provider's
//! metrics show [`ANSWERS`] answers that carry room (2xx and 4xx,
//! `<prefix>_api_http_requests_total`) since its end fails the run. The provider weighs an
//! answer in its budget before it counts it, so on a slow machine the verdict is the same.

use anyhow::{Result, bail};
use tokio::time::Instant;

/// Healthy answers after a storm's end by which the budget must be back: the first one hands
/// back all the cloud has room for.
pub(crate) const ANSWERS: f64 = 3.0;

/// What a provider's metrics say about its API budget.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Budget {
    /// Tokens it may spend now.
    pub(crate) remaining: f64,
    /// Tokens held back until the cloud shows room for them.
    pub(crate) held: f64,
    /// Its share of the cloud's bucket.
    pub(crate) capacity: f64,
    /// Requests it has sent, every class.
    pub(crate) sent: f64,
    /// Answers it has had with a 2xx or 4xx status (a 429 aside).
    pub(crate) answered: f64,
}

impl Budget {
    /// Reads the budget from a `/metrics` page; `None` when one of its gauges is missing.
    pub(crate) fn read(page: &str) -> Option<Budget> {
        let (mut remaining, mut held, mut capacity) = (None, None, None);
        let (mut sent, mut answered) = (0.0, 0.0);
        for line in page.lines().filter(|l| l.starts_with("bigfleet_")) {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Some(value) = value.trim().parse::<f64>().ok().filter(|v| v.is_finite()) else {
                continue;
            };
            let (name, labels) = series.split_once('{').unwrap_or((series, ""));
            if name.ends_with("_api_budget_remaining") {
                remaining = Some(value);
            } else if name.ends_with("_api_budget_held") {
                held = Some(value);
            } else if name.ends_with("_api_budget_capacity") {
                capacity = Some(value);
            } else if name.ends_with("_api_budget_requests_total") {
                sent += value;
            } else if name.ends_with("_api_http_requests_total")
                && (labels.contains("status=\"2xx\"") || labels.contains("status=\"4xx\""))
            {
                answered += value;
            }
        }
        Some(Budget {
            remaining: remaining?,
            held: held?,
            capacity: capacity?,
            sent,
            answered,
        })
    }

    /// Whether the budget is back from what it was `before` a storm.
    fn back_since(&self, before: &Budget) -> bool {
        let slack = self.capacity / 10.0;
        let spent = (self.sent - before.sent).max(0.0);
        self.held <= slack && self.remaining + spent >= before.remaining - slack
    }
}

/// One or more storms whose budget has not been seen back yet.
#[derive(Debug)]
struct Window {
    before: Budget,
    /// When the last storm of the window ends.
    ends: Instant,
    /// Healthy answers the provider had had at the first look after `ends`.
    answered_at_end: Option<f64>,
}

/// Follows the budget across a run's storms.
#[derive(Debug, Default)]
pub(crate) struct StormWatch {
    window: Option<Window>,
    storms: u64,
    windows: u64,
    /// Windows whose budget was seen back, with the healthy answers since the window's end at
    /// the look that saw it.
    back_after: Vec<u64>,
    /// The longest a budget took to be seen back after its window's end.
    slowest: std::time::Duration,
}

impl StormWatch {
    /// A storm (or burst) ending at `ends` starts now; `before` is the budget just before it.
    pub(crate) fn storm(&mut self, before: Option<Budget>, ends: Instant) {
        self.storms += 1;
        match (&mut self.window, before) {
            (Some(window), _) => {
                window.ends = window.ends.max(ends);
                window.answered_at_end = None;
            }
            (None, Some(before)) => {
                self.windows += 1;
                self.window = Some(Window {
                    before,
                    ends,
                    answered_at_end: None,
                });
            }
            // No metrics to compare with: this storm goes unchecked.
            (None, None) => {}
        }
    }

    /// The provider restarted: its budget starts over, so the open window is dropped.
    pub(crate) fn restarted(&mut self) {
        if self.window.take().is_some() {
            self.windows -= 1;
        }
    }

    /// One look at the budget `now`.
    pub(crate) fn look(&mut self, now: Option<Budget>, at: Instant) -> Result<()> {
        let Some(window) = &mut self.window else {
            return Ok(());
        };
        let Some(now) = now.filter(|_| at >= window.ends) else {
            return Ok(());
        };
        let since = (now.answered - *window.answered_at_end.get_or_insert(now.answered)).max(0.0);
        if now.back_since(&window.before) {
            self.back_after.push(since as u64);
            self.slowest = self.slowest.max(at.saturating_duration_since(window.ends));
            self.window = None;
            return Ok(());
        }
        if since >= ANSWERS {
            bail!(
                "the API budget did not come back after a 429 storm or 5xx burst: {:.0} tokens \
                 held back, {:.0} left and {:.0} spent since, against {:.0} left before it \
                 (bucket {:.0}), after {since} healthy answers since it ended",
                now.held,
                now.remaining,
                (now.sent - window.before.sent).max(0.0),
                window.before.remaining,
                now.capacity
            );
        }
        Ok(())
    }

    /// The run's figures: storms, windows checked, and how soon each budget was back.
    pub(crate) fn figures(&self) -> String {
        let mut after = self.back_after.clone();
        after.sort_unstable();
        let median = after.get(after.len() / 2).copied().unwrap_or(0);
        let most = after.last().copied().unwrap_or(0);
        format!(
            "storms_and_bursts={} budget_back={}/{} (healthy answers after the end: median \
             {median}, most {most}; slowest {:.1}s)",
            self.storms,
            self.back_after.len(),
            self.windows,
            self.slowest.as_secs_f64()
        )
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    const PAGE: &str = "\
# TYPE bigfleet_hetzner_api_budget_remaining gauge
bigfleet_hetzner_api_budget_remaining 1700.5
bigfleet_hetzner_api_budget_held 3
bigfleet_hetzner_api_budget_capacity 1800
bigfleet_hetzner_api_budget_cloud_remaining 3599
bigfleet_hetzner_api_budget_requests_total{class=\"transition\"} 40
bigfleet_hetzner_api_budget_requests_total{class=\"reconcile\"} 12
bigfleet_hetzner_api_http_requests_total{endpoint=\"/servers\",status=\"2xx\"} 30
bigfleet_hetzner_api_http_requests_total{endpoint=\"/servers\",status=\"429\"} 9
bigfleet_hetzner_api_http_requests_total{endpoint=\"/servers/{id}\",status=\"4xx\"} 2
bigfleet_hetzner_api_http_requests_total{endpoint=\"/servers/{id}\",status=\"5xx\"} 4
";

    /// A budget `remaining` tokens full, holding `held`, after `sent` requests and `answered`
    /// healthy answers.
    fn budget(remaining: f64, held: f64, sent: f64, answered: f64) -> Budget {
        Budget {
            remaining,
            held,
            capacity: 1800.0,
            sent,
            answered,
        }
    }

    #[test]
    fn the_budget_is_read_from_the_metrics_page() {
        assert_eq!(Budget::read(PAGE), Some(budget(1700.5, 3.0, 52.0, 32.0)));
        let first_start: String = PAGE
            .lines()
            .filter(|l| !l.contains("_total"))
            .map(|l| format!("{l}\n"))
            .collect();
        assert_eq!(
            Budget::read(&first_start),
            Some(budget(1700.5, 3.0, 0.0, 0.0))
        );
        let without_held: String = PAGE
            .lines()
            .filter(|l| !l.contains("_held"))
            .map(|l| format!("{l}\n"))
            .collect();
        assert_eq!(Budget::read(&without_held), None);
    }

    #[test]
    fn a_budget_back_after_a_storm_closes_its_window() {
        let start = Instant::now();
        let mut watch = StormWatch::default();
        watch.storm(
            Some(budget(1500.0, 0.0, 100.0, 80.0)),
            start + Duration::from_secs(1),
        );
        // During the storm, held tokens do not count against it.
        watch
            .look(Some(budget(0.0, 1500.0, 110.0, 80.0)), start)
            .unwrap();
        // After it: 30 spent since, 1470 left, nothing held.
        let after = start + Duration::from_secs(2);
        watch
            .look(Some(budget(1470.0, 0.0, 130.0, 90.0)), after)
            .unwrap();
        assert_eq!(watch.back_after, vec![0]);
        assert!(watch.window.is_none());
        assert!(
            watch.figures().contains("budget_back=1/1"),
            "{}",
            watch.figures()
        );
    }

    #[test]
    fn a_budget_still_held_after_healthy_answers_fails_the_run() {
        let start = Instant::now();
        let mut watch = StormWatch::default();
        watch.storm(Some(budget(1500.0, 0.0, 100.0, 80.0)), start);
        let at = start + Duration::from_secs(1);
        // Held, but no healthy answer yet shows the cloud has room: look again later.
        watch
            .look(Some(budget(3.0, 1490.0, 104.0, 80.0)), at)
            .unwrap();
        watch
            .look(Some(budget(2.0, 1490.0, 106.0, 80.0 + ANSWERS - 1.0)), at)
            .unwrap();
        let err = watch
            .look(Some(budget(2.0, 1490.0, 107.0, 80.0 + ANSWERS)), at)
            .unwrap_err();
        assert!(err.to_string().contains("did not come back"), "{err}");
    }

    #[test]
    fn tokens_lost_without_being_held_fail_the_run_too() {
        let start = Instant::now();
        let mut watch = StormWatch::default();
        watch.storm(Some(budget(1500.0, 0.0, 100.0, 80.0)), start);
        let err = watch
            .look(Some(budget(900.0, 0.0, 110.0, 80.0)), start)
            .and_then(|()| watch.look(Some(budget(900.0, 0.0, 110.0, 90.0)), start))
            .unwrap_err();
        assert!(err.to_string().contains("900 left"), "{err}");
    }

    #[test]
    fn storms_in_a_row_are_one_window_and_a_restart_drops_it() {
        let start = Instant::now();
        let mut watch = StormWatch::default();
        watch.storm(
            Some(budget(1500.0, 0.0, 100.0, 80.0)),
            start + Duration::from_secs(1),
        );
        watch.storm(
            Some(budget(0.0, 1500.0, 101.0, 80.0)),
            start + Duration::from_secs(3),
        );
        // The first storm is over, the second is not: no verdict, however short the budget.
        let between = start + Duration::from_secs(2);
        for answered in 80..100 {
            watch
                .look(Some(budget(0.0, 1500.0, 101.0, answered as f64)), between)
                .unwrap();
        }
        assert_eq!((watch.storms, watch.windows), (2, 1));
        watch.restarted();
        assert!(watch.window.is_none());
        assert!(
            watch.figures().contains("budget_back=0/0"),
            "{}",
            watch.figures()
        );
    }
}

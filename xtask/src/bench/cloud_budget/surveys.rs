//! Reconcile surveys found in a record of the emulator's request counts, and the real-time
//! length of a window of whole survey cycles. Pure, so both have unit tests.
//!
//! A survey is a run of requests (other than catalog reads and the out-of-band checks between
//! surveys) that follow each other closely; two surveys are apart by at least the provider's
//! wait between them. When the run goes `scale`
//! times faster than real time, the waits are scaled but a survey's own requests take the
//! emulator's real answer time, so a window's real length counts the time between surveys
//! `scale` times and the time inside them once.

use std::time::Duration;

use super::report::{CATALOG, CHECKS, Counts, of_classes, total};

/// The emulator's counts as they were from `at` (since the record began) on.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Snapshot {
    pub at: Duration,
    pub counts: Counts,
}

/// One survey in a record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Survey {
    /// When its first request was seen.
    pub start: Duration,
    /// When its last request was seen.
    pub end: Duration,
    /// The snapshot just before its first request.
    pub before: usize,
}

fn surveyed(counts: &Counts) -> usize {
    total(counts) - of_classes(counts, &[CATALOG]) - of_classes(counts, &CHECKS)
}

/// The surveys in `record` (snapshots in time order, the first one the state when it began):
/// a request seen `gap` or longer after the previous one starts a new survey. Catalog reads and
/// checks neither start nor end one.
pub(crate) fn find(record: &[Snapshot], gap: Duration) -> Vec<Survey> {
    let mut surveys: Vec<Survey> = Vec::new();
    for i in 1..record.len() {
        if surveyed(&record[i].counts) <= surveyed(&record[i - 1].counts) {
            continue;
        }
        let at = record[i].at;
        match surveys.last_mut() {
            Some(last) if at.saturating_sub(last.end) < gap => last.end = at,
            _ => surveys.push(Survey {
                start: at,
                end: at,
                before: i - 1,
            }),
        }
    }
    surveys
}

/// Whole cycles from one survey's start to a later one's.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Window {
    pub cycles: usize,
    /// The requests from the first survey's start to the last one's.
    pub requests: Counts,
    /// Its length in real time.
    pub real_seconds: f64,
}

/// The window from `surveys[from]` to `surveys[from + cycles]`, at `scale` times real time;
/// `None` when the record holds fewer surveys.
pub(crate) fn window(
    record: &[Snapshot],
    surveys: &[Survey],
    from: usize,
    cycles: usize,
    scale: f64,
) -> Option<Window> {
    let first = surveys.get(from)?;
    let last = surveys.get(from + cycles)?;
    let inside: Duration = surveys[from..from + cycles]
        .iter()
        .map(|s| s.end - s.start)
        .sum();
    let elapsed = last.start - first.start;
    let between = elapsed.saturating_sub(inside);
    Some(Window {
        cycles,
        requests: super::report::since(&record[last.before].counts, &record[first.before].counts),
        real_seconds: between.as_secs_f64() * scale + inside.as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64, listing: usize, catalog: usize) -> Snapshot {
        let mut counts = Counts::new();
        if listing > 0 {
            counts.insert("listing", (listing, 0));
        }
        if catalog > 0 {
            counts.insert(CATALOG, (catalog, 0));
        }
        Snapshot {
            at: Duration::from_millis(ms),
            counts,
        }
    }

    /// Surveys of 3 requests 10 ms apart every 1,000 ms, a catalog read between two of them.
    fn record() -> Vec<Snapshot> {
        let mut record = vec![at(0, 0, 0)];
        for cycle in 0..4u64 {
            for page in 0..3u64 {
                let n = (cycle * 3 + page + 1) as usize;
                record.push(at(200 + cycle * 1000 + page * 10, n, cycle as usize));
            }
            record.push(at(
                700 + cycle * 1000,
                (cycle as usize + 1) * 3,
                cycle as usize + 1,
            ));
        }
        record
    }

    #[test]
    fn surveys_are_runs_of_requests_apart_by_the_gap() {
        let record = record();
        let surveys = find(&record, Duration::from_millis(300));
        assert_eq!(surveys.len(), 4, "{surveys:?}");
        assert_eq!(surveys[0].start, Duration::from_millis(200));
        assert_eq!(surveys[0].end, Duration::from_millis(220));
        assert_eq!(surveys[0].before, 0);
        assert_eq!(surveys[1].start, Duration::from_millis(1200));
        assert_eq!(surveys[1].before, 4);
        // A gap longer than the cycle: everything is one survey.
        assert_eq!(find(&record, Duration::from_secs(2)).len(), 1);
        // Catalog reads alone are no survey.
        assert!(find(&[at(0, 0, 0), at(5, 0, 1), at(900, 0, 2)], Duration::ZERO).is_empty());
    }

    #[test]
    fn checks_between_surveys_are_no_survey_but_count_in_the_window() {
        // The record above with an out-of-band check 500 ms after each survey.
        let mut record = record();
        for snapshot in &mut record {
            let checks = (0..4u64)
                .filter(|cycle| snapshot.at >= Duration::from_millis(720 + cycle * 1000))
                .count();
            if checks > 0 {
                snapshot.counts.insert(CHECKS[0], (checks, 0));
            }
        }
        for cycle in 0..4u64 {
            let mut check = record
                .iter()
                .rev()
                .find(|s| s.at <= Duration::from_millis(700 + cycle * 1000))
                .unwrap()
                .clone();
            check.at = Duration::from_millis(720 + cycle * 1000);
            check.counts.insert(CHECKS[0], (cycle as usize + 1, 0));
            let at = record.partition_point(|s| s.at < check.at);
            record.insert(at, check);
        }
        let surveys = find(&record, Duration::from_millis(300));
        assert_eq!(surveys.len(), 4, "{surveys:?}");
        assert_eq!(surveys[1].start, Duration::from_millis(1200));
        assert_eq!(surveys[1].end, Duration::from_millis(1220));
        let w = window(&record, &surveys, 1, 2, 100.0).unwrap();
        assert_eq!(w.requests.get("listing"), Some(&(6, 0)));
        assert_eq!(w.requests.get(CHECKS[0]), Some(&(2, 0)));
    }

    #[test]
    fn a_window_counts_the_waits_scaled_and_the_surveys_once() {
        let record = record();
        let surveys = find(&record, Duration::from_millis(300));
        let w = window(&record, &surveys, 1, 2, 100.0).unwrap();
        assert_eq!(w.cycles, 2);
        // Surveys 1 and 2 (3 listings each) and the catalog reads after surveys 0 and 1.
        assert_eq!(w.requests.get("listing"), Some(&(6, 0)));
        assert_eq!(w.requests.get(CATALOG), Some(&(2, 0)));
        // 2,000 ms from survey 1 to survey 3, 20 ms of it inside each of two surveys.
        assert!(
            (w.real_seconds - (1.96 * 100.0 + 0.04)).abs() < 1e-9,
            "{w:?}"
        );
        assert!(window(&record, &surveys, 1, 3, 100.0).is_none());
        let real = window(&record, &surveys, 0, 3, 1.0).unwrap();
        assert!((real.real_seconds - 3.0).abs() < 1e-9, "{real:?}");
    }
}

//! The periodic reconcile loop: a full survey of the owned hosts every `--reconcile-interval`
//! (the floor), or less often when the survey's cost needs it to stay inside its share of the
//! API budget ([`crate::provisioning::budget::survey_pace`]); while it waits out such a paced period, the
//! cloud's cheap out-of-band check ([`Cloud::inventory_changed`]) runs every floor, and a host
//! changed behind the provider's back (an operator deleting one in the cloud console) starts
//! the survey at once instead of up to a paced period later.
//!
//! Only the replica that leads surveys and checks; every request of both is sent in the
//! [`Class::Reconcile`] budget class and counted towards the pace.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::observability::telemetry::Telemetry;
use crate::provisioning::budget::{Class, SurveyPace, survey_pace};
use crate::provisioning::cloud::{Cloud, InventorySignal};
use crate::runtime::replica::Replica;

/// The longest one out-of-band check may take (it normally needs one request).
const CHECK_TIMEOUT: Duration = Duration::from_secs(60);

/// What the loop does when it next wakes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wake {
    /// Ask the cloud's out-of-band check.
    Check,
    /// Survey.
    Survey,
}

/// How long to sleep, `elapsed` after the last survey ended, and what to do then: the next
/// check on the `pace.check_every` grid counted from that survey, unless it would come within
/// half a check interval of the survey (which then sees the same), else the survey at
/// `pace.period`.
pub fn next_wake(elapsed: Duration, pace: SurveyPace) -> (Duration, Wake) {
    if let Some(every) = pace.check_every.filter(|e| !e.is_zero()) {
        let done = elapsed.as_nanos() / every.as_nanos();
        let next = u32::try_from(done + 1)
            .ok()
            .and_then(|n| every.checked_mul(n));
        if let Some(next) = next
            && next + every / 2 < pace.period
        {
            return (next.saturating_sub(elapsed), Wake::Check);
        }
    }
    (pace.period.saturating_sub(elapsed), Wake::Survey)
}

/// The reconcile loop of one process, as [`crate::operations::app`] runs it.
pub struct ReconcileLoop {
    pub replica: Arc<Replica>,
    /// The cloud behind the backend: its API budget paces the surveys, its out-of-band check
    /// runs between them. `None` for a backend without one (surveys at the floor).
    pub cloud: Option<Arc<dyn Cloud>>,
    /// `--reconcile-interval` (not zero).
    pub floor: Duration,
    pub telemetry: Telemetry,
}

impl ReconcileLoop {
    /// Runs until `stop` is cancelled.
    pub async fn run(self, stop: CancellationToken) {
        let ReconcileLoop {
            replica,
            cloud,
            floor,
            telemetry,
        } = self;
        let budget = cloud.as_ref().and_then(|c| c.api_budget());
        // The cloud's check, until it says it has none.
        let mut signal = cloud;
        // What a survey or a check costs: the requests the cloud answered. The 429s of a storm
        // are not its cost; counted, one storm would pace the surveys down and turn the checks
        // off for good (a check that is not run is never measured again).
        let spent = || {
            budget.as_ref().map_or(0, |b| {
                b.answered(Class::Reconcile) + b.answered(Class::Proof)
            })
        };
        telemetry.reconcile_period(floor, None);
        // A replica that leads from the start reconciled before it served.
        let mut led = replica.writer().is_ok();
        let mut pace = SurveyPace::floor(floor);
        let mut since = Instant::now();
        // What a check costs in requests, as last measured (at least one).
        let mut check_cost = 1;
        let mut check_failing = false;
        loop {
            let (sleep, wake) = next_wake(since.elapsed(), pace);
            tokio::select! { () = tokio::time::sleep(sleep) => {}, () = stop.cancelled() => return }
            // Only the replica that leads reconciles.
            let Ok(engine) = replica.writer() else {
                led = false;
                pace = SurveyPace::floor(floor);
                since = Instant::now();
                continue;
            };
            if !led {
                // A takeover surveyed the cloud before it served: the next survey comes a
                // random part of a period later, so replicas that took over together do not
                // survey together, and none surveys twice in a row.
                led = true;
                pace = SurveyPace::floor(floor.mul_f64(rand::random_range(0.5..=1.0)));
                since = Instant::now();
                continue;
            }
            if wake == Wake::Check {
                let Some(cloud) = &signal else {
                    pace.check_every = None;
                    continue;
                };
                let before = spent();
                let check = tokio::time::timeout(
                    CHECK_TIMEOUT,
                    crate::provisioning::budget::scoped(
                        Class::Reconcile,
                        cloud.inventory_changed(),
                    ),
                );
                let answer = tokio::select! { a = check => a, () = stop.cancelled() => return };
                check_cost = spent().saturating_sub(before).max(1);
                let answer = match answer {
                    Ok(answer) => answer.map_err(|e| e.0),
                    Err(_) => Err(format!(
                        "no answer within {}",
                        crate::observability::duration::format(CHECK_TIMEOUT)
                    )),
                };
                match answer {
                    Ok(InventorySignal::Changed { why }) => {
                        check_failing = false;
                        let due = pace.period.saturating_sub(since.elapsed());
                        tracing::info!(
                            why,
                            survey_was_due_in = %crate::observability::duration::format(due),
                            "reconcile: the cloud's out-of-band check saw the owned hosts change; surveying now"
                        );
                        telemetry.reconcile_early_survey();
                    }
                    Ok(InventorySignal::Unchanged) => {
                        check_failing = false;
                        continue;
                    }
                    Ok(InventorySignal::Unsupported) => {
                        signal = None;
                        pace.check_every = None;
                        continue;
                    }
                    Err(e) => {
                        if !check_failing {
                            tracing::warn!(err = %e, "reconcile: the cloud's out-of-band check failed; the paced survey still comes");
                        } else {
                            tracing::debug!(err = %e, "reconcile: the cloud's out-of-band check failed again");
                        }
                        check_failing = true;
                        continue;
                    }
                }
            }
            let before = spent();
            let pass = crate::provisioning::budget::scoped(Class::Reconcile, engine.reconcile());
            let outcome = pass.await;
            pace = SurveyPace::floor(floor);
            if let Some(budget) = &budget {
                // Surveys are paced so that they, and the checks between them, fit their share
                // of the budget.
                let cost = spent().saturating_sub(before);
                pace = survey_pace(
                    floor,
                    cost,
                    signal.is_some().then_some(check_cost),
                    budget.background_per_second(),
                );
                if pace.period > floor {
                    // Paced periods are spread a little, never below their pace.
                    pace.period = pace.period.mul_f64(rand::random_range(1.0..=1.05));
                }
                telemetry.reconcile_period(pace.period, Some(cost));
            }
            since = Instant::now();
            match outcome {
                Ok(report) => {
                    telemetry.reconcile_outcome("success");
                    if report.changed() || report.orphans_deleted > 0 {
                        tracing::info!(?report, "reconcile applied changes");
                    } else if report.suspects + report.orphans + report.stale > 0 {
                        tracing::debug!(
                            ?report,
                            "reconcile left machines alone pending proof or grace"
                        );
                    }
                }
                Err(e) => {
                    telemetry.reconcile_outcome("error");
                    tracing::warn!(err = %e, "reconcile failed");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, VecDeque};
    use std::sync::Mutex;

    use async_trait::async_trait;

    use super::*;
    use crate::provisioning::backend::{BackendError, ConfigureOrder, TransitionContext};
    use crate::provisioning::budget::{ApiBudget, Bucket, Limits, ResetMeaning, Shares};
    use crate::provisioning::cloud::{Capacity, OwnedHost};
    use crate::rules::machine::Machine;

    const S: Duration = Duration::from_secs(1);

    fn pace(period: u64, every: Option<u64>) -> SurveyPace {
        SurveyPace {
            period: S * u32::try_from(period).unwrap(),
            check_every: every.map(|e| S * u32::try_from(e).unwrap()),
        }
    }

    #[test]
    fn checks_run_on_a_grid_from_the_last_survey_until_it_is_due() {
        let p = pace(1000, Some(120));
        assert_eq!(next_wake(Duration::ZERO, p), (120 * S, Wake::Check));
        // A check that took a while (or a late wake) keeps the grid.
        assert_eq!(next_wake(125 * S, p), (115 * S, Wake::Check));
        // One that took longer than an interval skips the missed one.
        assert_eq!(next_wake(250 * S, p), (110 * S, Wake::Check));
        // 960 s is within half an interval of the survey at 1,000 s: the survey comes instead.
        assert_eq!(next_wake(840 * S, p), (160 * S, Wake::Survey));
        assert_eq!(next_wake(1200 * S, p), (Duration::ZERO, Wake::Survey));
    }

    #[test]
    fn without_checks_the_survey_comes_at_its_period() {
        assert_eq!(
            next_wake(Duration::ZERO, pace(120, None)),
            (120 * S, Wake::Survey)
        );
        assert_eq!(next_wake(30 * S, pace(120, None)), (90 * S, Wake::Survey));
        // A zero interval is no interval.
        assert_eq!(
            next_wake(30 * S, pace(120, Some(0))),
            (90 * S, Wake::Survey)
        );
        // A check that cannot come before the survey is left to it.
        assert_eq!(
            next_wake(Duration::ZERO, pace(150, Some(120))),
            (150 * S, Wake::Survey)
        );
    }

    /// A cloud whose survey costs `SURVEY_PAGES` requests of its budget and whose check costs
    /// one and answers from a script; it records when each happened. Within `storm` (from, to)
    /// every request is answered 429 (`Retry-After: 1`): a check retries it `STORM_TRIES`
    /// times, as the clients do, and fails; a survey fails at its first page.
    struct Scripted {
        budget: ApiBudget,
        answers: Mutex<VecDeque<Result<InventorySignal, BackendError>>>,
        events: Mutex<Vec<(&'static str, Instant)>>,
        storm: Option<(Instant, Instant)>,
    }

    const SURVEY_PAGES: usize = 40;
    const STORM_TRIES: usize = 8;

    impl Scripted {
        fn new(budget: ApiBudget, answers: Vec<Result<InventorySignal, BackendError>>) -> Self {
            Scripted {
                budget,
                answers: Mutex::new(answers.into()),
                events: Mutex::new(Vec::new()),
                storm: None,
            }
        }

        /// Sends one request: `false` when the storm answered it 429.
        async fn send(&self) -> bool {
            self.budget.acquire(None).await.unwrap();
            let now = Instant::now();
            let stormy = self
                .storm
                .is_some_and(|(from, to)| (from..to).contains(&now));
            let (status, headers) = if stormy {
                (429, [("ratelimit-remaining", "0"), ("retry-after", "1")])
            } else {
                (
                    200,
                    [("ratelimit-remaining", "1000"), ("ratelimit-limit", "1000")],
                )
            };
            let headers = headers
                .into_iter()
                .map(|(k, v)| (http::HeaderName::from_static(k), v.parse().unwrap()))
                .collect();
            self.budget.observe(status, &headers);
            !stormy
        }

        fn events(&self) -> Vec<(&'static str, Duration)> {
            let events = self.events.lock().unwrap();
            let start = events[0].1;
            events
                .iter()
                .map(|(what, at)| (*what, *at - start))
                .collect()
        }
    }

    #[async_trait]
    impl Cloud for Scripted {
        async fn create_host(
            &self,
            _machine: &Machine,
            _ctx: &TransitionContext,
        ) -> Result<OwnedHost, BackendError> {
            Err(BackendError::new("not in this test"))
        }

        async fn list_hosts(&self) -> Result<Vec<OwnedHost>, BackendError> {
            for _ in 0..SURVEY_PAGES {
                if !self.send().await {
                    return Err(BackendError::new("429 rate_limit_exceeded"));
                }
            }
            self.events.lock().unwrap().push(("survey", Instant::now()));
            Ok(Vec::new())
        }

        async fn inventory_changed(&self) -> Result<InventorySignal, BackendError> {
            let mut tries = 1;
            while !self.send().await {
                if tries == STORM_TRIES {
                    return Err(BackendError::new("429 rate_limit_exceeded"));
                }
                tries += 1;
            }
            self.events.lock().unwrap().push(("check", Instant::now()));
            self.answers
                .lock()
                .unwrap()
                .pop_front()
                .unwrap_or(Ok(InventorySignal::Unchanged))
        }

        async fn configure_host(
            &self,
            _machine: &Machine,
            _host_id: &str,
            _order: &ConfigureOrder,
            _ctx: &TransitionContext,
        ) -> Result<(), BackendError> {
            Ok(())
        }

        async fn drain_host(
            &self,
            _machine: &Machine,
            _host_id: &str,
            _grace_period_seconds: i64,
            _ctx: &TransitionContext,
        ) -> Result<(), BackendError> {
            Ok(())
        }

        async fn delete_host(
            &self,
            _host_id: &str,
            _ctx: &TransitionContext,
        ) -> Result<(), BackendError> {
            Ok(())
        }

        async fn price_usd(&self, _instance_type: &str, _zone: &str) -> Result<f64, BackendError> {
            Ok(0.01)
        }

        fn api_budget(&self) -> Option<ApiBudget> {
            Some(self.budget.clone())
        }

        async fn capacities(
            &self,
            _instance_types: &[String],
        ) -> Result<HashMap<String, Capacity>, BackendError> {
            Ok(HashMap::new())
        }
    }

    /// Runs the reconcile loop at a floor of a second over an engine of `cloud` for `lasting`.
    async fn run_loop(cloud: &Arc<Scripted>, telemetry: Telemetry, lasting: Duration) {
        let fleet = crate::provisioning::fleet::Fleet::new(
            cloud.clone(),
            "p",
            Vec::new(),
            Arc::new(crate::provisioning::fleet::PriceBook::new(|_, _| None)),
            Arc::new(crate::provisioning::fleet::CapacityBook::new(|_| None)),
            |_| crate::rules::machine::StringMap::new(),
        );
        let engine = crate::runtime::engine::Engine::start(
            Arc::new(fleet),
            Arc::new(crate::persistence::store::MemoryStore),
            crate::runtime::engine::EngineOptions::new(telemetry),
        )
        .await
        .unwrap();
        cloud.events.lock().unwrap().clear();
        let stop = CancellationToken::new();
        let task = tokio::spawn(
            ReconcileLoop {
                replica: Replica::single(engine),
                cloud: Some(cloud.clone()),
                floor: S,
                telemetry,
            }
            .run(stop.clone()),
        );
        tokio::time::sleep(lasting).await;
        stop.cancel();
        task.await.unwrap();
    }

    /// 10 background requests a second, the whole of them this provider's.
    fn ten_a_second(prefix: &str) -> ApiBudget {
        let limits = Limits {
            main: Bucket {
                capacity: 1000.0,
                per_second: 10.0,
            },
            burst: None,
            reset: ResetMeaning::Full,
        };
        let shares = Shares {
            share: 1.0,
            reconcile: 1.0,
        };
        let budget = ApiBudget::new(limits, shares, prefix);
        budget.observe(200, &http::HeaderMap::new());
        budget
    }

    fn near(got: Duration, want: f64) -> bool {
        (got.as_secs_f64() - want).abs() < 0.01
    }

    /// Between paced surveys the loop checks every floor; an unchanged or failed check starts
    /// nothing, a changed one starts the survey at once (counted), and a cloud without a check
    /// is not asked again.
    #[tokio::test(start_paused = true)]
    async fn the_loop_checks_between_paced_surveys_and_surveys_early_on_a_change() {
        let handle = crate::observability::telemetry::recorder();
        let telemetry = Telemetry::new("bigfleet_reconcile_loop_test");
        // 10 background requests a second: a 40-request survey alone every 4 s; with a
        // one-request check a second, 40 / 9 = 4.44 s (spread by up to 5%).
        let budget = ten_a_second("bigfleet_reconcile_loop_test");
        let cloud = Arc::new(Scripted::new(
            budget,
            vec![
                Ok(InventorySignal::Unchanged),
                Err(BackendError::new("the check's request failed")),
                Ok(InventorySignal::Changed {
                    why: "a host went away".into(),
                }),
                Ok(InventorySignal::Unsupported),
            ],
        ));
        let started = Instant::now();
        run_loop(&cloud, telemetry, Duration::from_secs(15)).await;
        let events = cloud.events();
        let what: Vec<&str> = events.iter().map(|(w, _)| *w).collect();
        assert_eq!(
            what,
            [
                "survey", "check", "check", "check", "survey", "check", "survey", "survey"
            ],
            "{events:?}"
        );
        let first = cloud.events.lock().unwrap()[0].1 - started;
        assert!(
            near(first, 1.0),
            "the first survey comes at the floor: {first:?}"
        );
        // Checks every floor after the survey; the changed one is followed by the survey at
        // once, the unsupported one by no other check.
        for (i, want) in [(1, 1.0), (2, 2.0), (3, 3.0), (4, 3.0), (5, 4.0)] {
            assert!(near(events[i].1, want), "event {i}: {events:?}");
        }
        let spread = |from: usize, to: usize, paced: f64| {
            let period = (events[to].1 - events[from].1).as_secs_f64();
            assert!(
                (paced - 0.001..=paced * 1.05 + 0.001).contains(&period),
                "{period} s after event {from}, paced {paced} s: {events:?}"
            );
        };
        // The early survey's successor at the pace that leaves the checks their rate; once the
        // cloud said it has no check, at the survey's own pace.
        spread(4, 6, 40.0 / 9.0);
        spread(6, 7, 4.0);
        assert!(
            handle
                .render()
                .contains("bigfleet_reconcile_loop_test_reconcile_early_surveys_total 1"),
            "one early survey"
        );
    }

    /// A storm of 429s makes a check retry several times and fail, and the surveys in it fail
    /// at their first page. Once it has passed, the checks come every floor between paced
    /// surveys again: what the storm made them retry is not what they cost.
    #[tokio::test(start_paused = true)]
    async fn after_a_storm_the_checks_come_between_paced_surveys_again() {
        let telemetry = Telemetry::new("bigfleet_reconcile_loop_storm_test");
        let mut cloud = Scripted::new(
            ten_a_second("bigfleet_reconcile_loop_storm_test"),
            Vec::new(),
        );
        // The first survey at 1 s, checks at 2 s and on; the storm takes the 2 s check and
        // ends at 12 s.
        let now = Instant::now();
        cloud.storm = Some((now + S * 3 / 2, now + S * 12));
        let cloud = Arc::new(cloud);
        run_loop(&cloud, telemetry, Duration::from_secs(30)).await;
        let events = cloud.events();
        // Events are timed from the first survey, a second after the loop started.
        let within = |what: &str, from: f64, to: f64| {
            events
                .iter()
                .filter(|(w, at)| *w == what && (from..to).contains(&at.as_secs_f64()))
                .count()
        };
        assert_eq!(
            within("check", 0.5, 11.0) + within("survey", 0.5, 11.0),
            0,
            "nothing got through the storm: {events:?}"
        );
        // From 11 s to 29 s: surveys 40 / 9 = 4.44 s apart (spread by up to 5%), checks every
        // floor between them.
        assert!(within("survey", 11.0, 30.0) >= 3, "{events:?}");
        assert!(
            within("check", 11.0, 30.0) >= 10,
            "the checks came back after the storm: {events:?}"
        );
    }
}

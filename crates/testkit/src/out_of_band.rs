//! The steps of the out-of-band check scenario both clouds run (the engine and the provider's
//! reconcile loop over the real client and the emulator, a host deleted behind the provider's
//! back): what is cloud-neutral about it, with the same assertions for both.

use std::sync::Arc;
use std::time::Duration;

use provider_core::cloud::Cloud;
use provider_core::telemetry::Telemetry;
use provider_core::{Engine, MachineState};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::engine::{spawn_reconcile_loop, zero_token};
use crate::metrics;
use crate::wait::until;

/// One cloud's run of the scenario.
pub struct Scenario<'a> {
    pub engine: &'a Arc<Engine>,
    /// The telemetry prefix the cloud client and the reconcile loop count under.
    pub prefix: &'a str,
    /// The reconcile loop's floor.
    pub floor: Duration,
    /// The cloud client's name for its out-of-band check call.
    pub check_op: &'a str,
}

impl<'a> Scenario<'a> {
    pub fn new(
        engine: &'a Arc<Engine>,
        prefix: &'a str,
        floor: Duration,
        check_op: &'a str,
    ) -> Scenario<'a> {
        Scenario {
            engine,
            prefix,
            floor,
            check_op,
        }
    }

    /// Out-of-band checks made, as the cloud client counts its calls.
    pub fn checks(&self) -> f64 {
        metrics::api_calls(self.prefix, self.check_op)
    }

    /// Every one of `ids` is Idle.
    pub fn assert_idle(&self, ids: &[String]) {
        for id in ids {
            assert_eq!(
                self.engine.get(id).unwrap().state,
                MachineState::Idle,
                "{id}"
            );
        }
    }

    /// With the `owned` machines Idle, starts the provider's reconcile loop over `cloud` at the
    /// floor and waits for its first survey: the loop's stop token and task, and the survey's
    /// paced period (see [`Scenario::first_survey_period`]).
    pub async fn start_reconciling(
        &self,
        owned: &[String],
        cloud: Arc<dyn Cloud>,
        telemetry: Telemetry,
    ) -> (CancellationToken, JoinHandle<()>, f64) {
        self.assert_idle(owned);
        let (stop, reconcile) = spawn_reconcile_loop(self.engine, cloud, self.floor, telemetry);
        let period = self.first_survey_period().await;
        (stop, reconcile, period)
    }

    /// Waits for the first survey; its paced period, which must be well above the floor.
    pub async fn first_survey_period(&self) -> f64 {
        until("the first survey", Duration::from_secs(10), || {
            metrics::surveys(self.prefix) >= 1.0
        })
        .await;
        let period = metrics::metric(&format!("{}_reconcile_period_seconds", self.prefix));
        eprintln!(
            "a survey cost {} requests; the next one waits {period:.1} s",
            metrics::metric(&format!("{}_reconcile_survey_requests", self.prefix))
        );
        assert!(
            period >= 3.5,
            "surveys are paced well above the floor: {period} s"
        );
        period
    }

    /// Four floors in which nothing happens: one request of `check_class` a check (at least
    /// two), no listing, no early survey. `requests` reads the emulator's count of a class;
    /// `unanswered` is [`Scenario::unanswered`] before the loop started. Both ends are read
    /// when no check is in flight (the emulator counts a request when it arrives, the client a
    /// check when its answer is in), so a slow machine cannot put a check's request on one
    /// side and its count on the other.
    pub async fn nothing_happens(
        &self,
        requests: impl Fn(&str) -> usize,
        check_class: &str,
        unanswered: f64,
    ) {
        let listings = requests("listing");
        let (checks_sent, checked) = self.settled(&requests, check_class, unanswered).await;
        tokio::time::sleep(self.floor * 4).await;
        let (sent, done) = self.settled(&requests, check_class, unanswered).await;
        let made = done - checked;
        assert!(made >= 2.0, "{made} checks in four floors");
        assert_eq!((sent - checks_sent) as f64, made, "one request per check");
        assert_eq!(requests("listing"), listings, "no survey");
        assert_eq!(metrics::early_surveys(self.prefix), 0.0);
    }

    /// Requests of the check's class the emulator saw (`sent`) beyond the checks the client
    /// finished; read before the loop starts, none is in flight.
    pub fn unanswered(&self, sent: usize) -> f64 {
        sent as f64 - self.checks()
    }

    /// Waits for a moment no check is in flight: the requests of `check_class` are again
    /// `unanswered` more than the checks finished (a check of two requests never gets there).
    /// Both counts then.
    async fn settled(
        &self,
        requests: &impl Fn(&str) -> usize,
        check_class: &str,
        unanswered: f64,
    ) -> (usize, f64) {
        let at = std::cell::Cell::new((0, 0.0));
        until(
            "one request per check, none in flight",
            Duration::from_secs(5),
            || {
                // The checks first: a request that arrives after is one more, never one less.
                let checked = self.checks();
                at.set((requests(check_class), checked));
                at.get().0 as f64 - checked == unanswered
            },
        )
        .await;
        at.get()
    }

    /// The provider's own Delete of `deleted` and Create of `created`, until they settle.
    pub async fn own_delete_and_create(&self, deleted: &str, created: &str) {
        self.engine.delete(deleted, zero_token()).await.unwrap();
        self.engine.create(created, zero_token()).await.unwrap();
        until("the own Delete and Create", Duration::from_secs(10), || {
            self.engine.get(deleted).unwrap().state == MachineState::Speculative
                && self.engine.get(created).unwrap().state == MachineState::Idle
        })
        .await;
    }

    /// Waits for two checks after `checked` of them; no early survey came of them.
    pub async fn two_more_checks_start_no_survey(&self, checked: f64) {
        self.two_checks_without_a_survey(checked, Duration::from_secs(10), "own changes")
            .await;
    }

    /// A storm passes: `storm` makes the cloud answer every request 429 for `lasting` (another
    /// user of the token spent it all). Once it has, the checks come at the floor again (two
    /// within five seconds, however long the storm held the bucket back), and the storm
    /// started no early survey: a check that failed is not a change.
    pub async fn storm_passes(&self, lasting: Duration, storm: impl FnOnce(Duration)) {
        let limited = format!("{}_api_rate_limited_total", self.prefix);
        let before = metrics::metric(&limited);
        storm(lasting);
        tokio::time::sleep(lasting).await;
        assert!(metrics::metric(&limited) > before, "requests met the storm");
        let after = self.checks();
        self.two_checks_without_a_survey(after, Duration::from_secs(5), "a storm")
            .await;
    }

    /// Waits up to `within` for two checks after `checked` of them; `what` came before them
    /// and started no early survey.
    async fn two_checks_without_a_survey(&self, checked: f64, within: Duration, what: &str) {
        until("two more checks", within, || self.checks() >= checked + 2.0).await;
        assert_eq!(
            metrics::early_surveys(self.prefix),
            0.0,
            "{what}: not an out-of-band change"
        );
    }

    /// Waits for the next survey to finish.
    pub async fn next_survey(&self) {
        let done = metrics::surveys(self.prefix);
        until("a survey", Duration::from_secs(20), || {
            metrics::surveys(self.prefix) > done
        })
        .await;
    }

    /// Waits until the deletion of the host of machine `id` out of band at `deleted` was
    /// noticed: one early survey ran after it (the surveys counted at the deletion were
    /// `surveyed`), within four floors and half a paced `period`. The machine keeps its state
    /// (BigFleet's shard has no edge from Idle that says its host is gone).
    pub async fn noticed(
        &self,
        what: &str,
        id: &str,
        deleted: Instant,
        period: f64,
        surveyed: f64,
    ) {
        until(what, Duration::from_secs(5), || {
            metrics::early_surveys(self.prefix) >= 1.0 && metrics::surveys(self.prefix) > surveyed
        })
        .await;
        assert_eq!(self.engine.get(id).unwrap().state, MachineState::Idle);
        let noticed = deleted.elapsed();
        eprintln!("noticed {noticed:?} after the deletion (paced period {period:.1} s)");
        assert_eq!(metrics::early_surveys(self.prefix), 1.0);
        assert!(
            noticed < self.floor * 4 && noticed.as_secs_f64() < period / 2.0,
            "noticed after {noticed:?}, a paced period is {period} s"
        );
    }

    /// Right after the next survey (the next paced one is seconds away), deletes the host of
    /// the machine `id` behind the provider's back with `delete` (given the host's id, it says
    /// whether there was such a host), then waits until [`Scenario::noticed`]. Returns the
    /// host's id.
    pub async fn host_deleted_out_of_band(
        &self,
        what: &str,
        id: &str,
        period: f64,
        delete: impl FnOnce(&str) -> bool,
    ) -> String {
        self.next_survey().await;
        let victim = self.engine.get(id).unwrap();
        let host = victim.host.as_ref().unwrap().id.clone();
        let deleted = Instant::now();
        let surveyed = metrics::surveys(self.prefix);
        assert!(delete(&host));
        self.noticed(what, id, deleted, period, surveyed).await;
        host
    }
}

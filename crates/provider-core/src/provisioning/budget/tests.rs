//! The scheduler under tokio's paused clock: strict priorities, the background share,
//! deadlines, and corrections from the rate-limit headers.

use super::*;

/// A bucket of `capacity` refilled at `per_second`, all of it ours, that has seen an answer
/// without rate-limit headers.
fn small(capacity: f64, per_second: f64) -> ApiBudget {
    let budget = fresh(capacity, per_second);
    budget.observe(200, &http::HeaderMap::new());
    budget
}

/// [`small`] before any answer.
fn fresh(capacity: f64, per_second: f64) -> ApiBudget {
    let limits = Limits {
        main: Bucket {
            capacity,
            per_second,
        },
        burst: None,
        reset: ResetMeaning::Full,
    };
    ApiBudget::new(
        limits,
        Shares {
            share: 1.0,
            reconcile: 1.0,
        },
        "bigfleet_budget_test",
    )
}

fn headers(pairs: &[(&'static str, String)]) -> http::HeaderMap {
    let mut h = http::HeaderMap::new();
    for (name, value) in pairs {
        h.insert(*name, value.parse().unwrap());
    }
    h
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

#[tokio::test(start_paused = true)]
async fn a_full_bucket_sends_at_once_and_an_empty_one_paces_at_the_refill_rate() {
    let budget = small(3.0, 2.0);
    let started = Instant::now();
    for _ in 0..3 {
        budget.acquire(None).await.unwrap();
    }
    assert_eq!(
        started.elapsed(),
        Duration::ZERO,
        "the burst fits the bucket"
    );
    for _ in 0..4 {
        budget.acquire(None).await.unwrap();
    }
    let paced = started.elapsed();
    assert!(
        paced >= Duration::from_millis(1990) && paced <= Duration::from_millis(2010),
        "four more at two a second: {paced:?}"
    );
}

/// Requests queued on an empty bucket are served transitions first, then proofs, reconcile
/// listings and refreshes, whatever the order they arrived in.
#[tokio::test(start_paused = true)]
async fn waiters_are_served_in_strict_priority_order() {
    let budget = small(1.0, 1.0);
    budget.acquire(None).await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for class in [
        Class::Refresh,
        Class::Reconcile,
        Class::Refresh,
        Class::Proof,
        Class::Transition,
        Class::Reconcile,
        Class::Transition,
    ] {
        let (budget, order) = (budget.clone(), order.clone());
        tasks.push(tokio::spawn(async move {
            scoped(class, budget.acquire(None)).await.unwrap();
            order.lock().unwrap().push(class);
        }));
        // Let each one join the queue before the next arrives.
        tokio::task::yield_now().await;
    }
    for task in tasks {
        task.await.unwrap();
    }
    let order = order.lock().unwrap().clone();
    assert_eq!(
        order,
        [
            Class::Transition,
            Class::Transition,
            Class::Proof,
            Class::Reconcile,
            Class::Reconcile,
            Class::Refresh,
            Class::Refresh,
        ]
    );
}

/// A flood of refreshes and reconcile listings already queued does not hold a transition
/// back: it waits for the next token only.
#[tokio::test(start_paused = true)]
async fn a_low_priority_flood_does_not_delay_a_transition() {
    let budget = small(5.0, 1.0);
    let mut flood = Vec::new();
    for i in 0..200 {
        let budget = budget.clone();
        let class = if i % 2 == 0 {
            Class::Refresh
        } else {
            Class::Reconcile
        };
        flood.push(tokio::spawn(async move {
            scoped(class, budget.acquire(None)).await.unwrap();
        }));
    }
    // The flood spends the bucket and queues up behind it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(budget.remaining() < 1.0);
    let asked = Instant::now();
    budget.acquire_as(Class::Transition, None).await.unwrap();
    let waited = asked.elapsed();
    assert!(
        waited <= Duration::from_millis(510),
        "the transition waited {waited:?}, more than one refill"
    );
    for task in flood {
        task.abort();
    }
}

/// Background classes get `reconcile` of the share, so a transition arriving after a long
/// reconcile pass still finds tokens.
#[tokio::test(start_paused = true)]
async fn background_work_spends_only_its_share() {
    let limits = Limits {
        main: Bucket {
            capacity: 100.0,
            per_second: 10.0,
        },
        burst: None,
        reset: ResetMeaning::Full,
    };
    let budget = ApiBudget::new(
        limits,
        Shares {
            share: 0.5,
            reconcile: 0.2,
        },
        "bigfleet_budget_test",
    );
    budget.observe(200, &http::HeaderMap::new());
    let started = Instant::now();
    // 10 background tokens, then one every 1/(10 × 0.5 × 0.2) = 1 s.
    for _ in 0..15 {
        budget.acquire_as(Class::Reconcile, None).await.unwrap();
    }
    let spent = started.elapsed();
    assert!(
        spent >= Duration::from_millis(4990) && spent <= Duration::from_millis(5010),
        "{spent:?}"
    );
    let asked = Instant::now();
    for _ in 0..30 {
        budget.acquire_as(Class::Transition, None).await.unwrap();
    }
    assert_eq!(
        asked.elapsed(),
        Duration::ZERO,
        "the transitions' part is untouched"
    );
}

/// A request whose deadline passes gives up with `NoRoom`, and its place goes to the next.
#[tokio::test(start_paused = true)]
async fn a_deadline_gives_up_and_frees_the_turn() {
    let budget = small(1.0, 0.1);
    budget.acquire(None).await.unwrap();
    let waiting = {
        let budget = budget.clone();
        tokio::spawn(async move { budget.acquire_as(Class::Proof, None).await })
    };
    tokio::task::yield_now().await;
    let started = Instant::now();
    let short = budget
        .acquire_as(Class::Transition, Some(started + Duration::from_secs(2)))
        .await;
    assert_eq!(short, Err(NoRoom));
    assert_eq!(started.elapsed(), Duration::from_secs(2));
    // The proof behind it is served at the next token (10 s after the first one).
    waiting.await.unwrap().unwrap();
    assert!(started.elapsed() <= Duration::from_secs(10));
}

/// A wait dropped by its caller (a timeout around the call) leaves the queue too.
#[tokio::test(start_paused = true)]
async fn a_dropped_wait_leaves_the_queue() {
    let budget = small(1.0, 1.0);
    budget.acquire(None).await.unwrap();
    let dropped = tokio::time::timeout(
        Duration::from_millis(100),
        budget.acquire_as(Class::Transition, None),
    )
    .await;
    assert!(dropped.is_err());
    assert!(budget.lock().queue.is_empty());
    let started = Instant::now();
    budget.acquire_as(Class::Refresh, None).await.unwrap();
    assert!(started.elapsed() <= Duration::from_millis(900));
}

#[tokio::test(start_paused = true)]
async fn remaining_from_the_headers_holds_back_what_the_cloud_lacks_and_hands_back_only_that() {
    let budget = ApiBudget::new(Limits::HETZNER, Shares::default(), "bigfleet_budget_test");
    assert_eq!(budget.remaining(), 1800.0);
    let answer = |remaining: u32| {
        headers(&[
            ("ratelimit-limit", "3600".into()),
            ("ratelimit-remaining", remaining.to_string()),
        ])
    };
    budget.observe(200, &answer(100));
    assert_eq!(
        budget.remaining(),
        50.0,
        "half of what the cloud still holds"
    );
    budget.observe(200, &answer(3000));
    assert_eq!(
        budget.remaining(),
        1500.0,
        "the cloud refilled: what was held back comes back, up to half of what it holds"
    );
    budget.observe(200, &answer(3600));
    assert_eq!(budget.remaining(), 1800.0, "never more than was ours");
    // What this provider spent itself is spent: a full cloud hands nothing back for it.
    for _ in 0..1000 {
        budget.acquire(None).await.unwrap();
    }
    budget.observe(200, &answer(3599));
    assert_eq!(budget.remaining(), 800.0);
}

/// After a 429 storm (another user of the token spent the cloud's bucket) the first answer
/// that shows the cloud refilled gives the provider back its share at once: it does not crawl
/// back at the refill rate for an hour.
#[tokio::test(start_paused = true)]
async fn after_a_storm_the_pace_returns_to_the_share_at_the_first_healthy_answer() {
    let budget = ApiBudget::new(Limits::HETZNER, Shares::default(), "bigfleet_budget_test");
    let limited = headers(&[
        ("ratelimit-limit", "3600".into()),
        ("ratelimit-remaining", "0".into()),
        ("retry-after", "1".into()),
    ]);
    for _ in 0..5 {
        budget.observe(429, &limited);
        budget.acquire(None).await.unwrap();
    }
    assert!(budget.remaining() < 1.0);
    assert!(budget.held() > 1700.0, "the storm holds the share back");
    budget.observe(
        200,
        &headers(&[
            ("ratelimit-limit", "3600".into()),
            ("ratelimit-remaining", "3590".into()),
        ]),
    );
    // Half of the 3590 the cloud has left is ours: all but the few tokens above that come back.
    assert!(
        budget.held() < 10.0,
        "the first healthy answer hands back what the cloud has room for"
    );
    let started = Instant::now();
    for _ in 0..1000 {
        budget.acquire(None).await.unwrap();
    }
    assert_eq!(
        started.elapsed(),
        Duration::ZERO,
        "the held-back share is spendable again"
    );
}

/// DigitalOcean's headers describe its hourly limit only. A storm of 429s that show the hour
/// spent (another user took it) leaves the per-minute window alone: the first healthy answer
/// gives the share back at once, as on Hetzner, and a storm of T seconds costs about T.
#[tokio::test(start_paused = true)]
async fn a_429_of_the_spent_hour_leaves_the_minute_window_alone() {
    let budget = ApiBudget::new(
        Limits::DIGITALOCEAN,
        Shares::default(),
        "bigfleet_budget_test",
    );
    budget.observe(200, &headers(&[("ratelimit-remaining", "4999".into())]));
    let hour_spent = headers(&[
        ("ratelimit-limit", "5000".into()),
        ("ratelimit-remaining", "0".into()),
        ("retry-after", "1".into()),
    ]);
    for _ in 0..5 {
        budget.acquire(None).await.unwrap();
        budget.observe(429, &hour_spent);
    }
    // The storm ends; the next request goes after the last Retry-After.
    tokio::time::sleep(Duration::from_secs(1)).await;
    budget.observe(200, &headers(&[("ratelimit-remaining", "4990".into())]));
    let started = Instant::now();
    for _ in 0..100 {
        budget.acquire(None).await.unwrap();
    }
    assert_eq!(
        started.elapsed(),
        Duration::ZERO,
        "the minute's share (125) was never spent"
    );
}

/// A 429 whose headers show room left in the hour was the per-minute limit's: its window is
/// full, and the provider goes at its share of the minute's refill (250 a minute, half ours).
#[tokio::test(start_paused = true)]
async fn a_429_with_the_hour_left_spends_the_minute_window() {
    let budget = ApiBudget::new(
        Limits::DIGITALOCEAN,
        Shares::default(),
        "bigfleet_budget_test",
    );
    budget.observe(200, &headers(&[("ratelimit-remaining", "4999".into())]));
    budget.acquire(None).await.unwrap();
    budget.observe(429, &headers(&[("ratelimit-remaining", "4000".into())]));
    let started = Instant::now();
    for _ in 0..10 {
        budget.acquire(None).await.unwrap();
        budget.observe(200, &headers(&[("ratelimit-remaining", "3999".into())]));
    }
    // The hour has room, so its bucket is back; the minute's ten tokens at 125 a minute: 4.8 s.
    let took = started.elapsed().as_secs_f64();
    assert!((4.7..=4.9).contains(&took), "{took} s");
}

#[tokio::test(start_paused = true)]
async fn limit_and_reset_correct_capacity_and_refill_rate() {
    let budget = ApiBudget::new(Limits::HETZNER, Shares::default(), "bigfleet_budget_test");
    // A project whose bucket holds 7200 and is 600 short, full again in 300 s: 2 per second.
    budget.observe(
        200,
        &headers(&[
            ("ratelimit-limit", "7200".into()),
            ("ratelimit-remaining", "6600".into()),
            ("ratelimit-reset", (unix_now() + 300).to_string()),
        ]),
    );
    assert_eq!(budget.lock().main.capacity, 3600.0);
    let rate = budget.refill_per_second();
    assert!((rate - 1.0).abs() < 0.01, "half of ~2/s: {rate}");
    // DigitalOcean's reset is the end of a window, not "full again": the rate stays.
    let budget = ApiBudget::new(
        Limits::DIGITALOCEAN,
        Shares::default(),
        "bigfleet_budget_test",
    );
    let published = budget.refill_per_second();
    budget.observe(
        200,
        &headers(&[
            ("ratelimit-limit", "5000".into()),
            ("ratelimit-remaining", "4000".into()),
            ("ratelimit-reset", (unix_now() + 30).to_string()),
        ]),
    );
    assert_eq!(budget.refill_per_second(), published);
}

/// A 429 (someone else spent the budget) empties ours; a `Retry-After` holds every class back
/// until it has passed; then requests go at the refill rate.
#[tokio::test(start_paused = true)]
async fn a_429_empties_the_bucket_and_honours_retry_after() {
    let budget = small(10.0, 1.0);
    budget.observe(429, &headers(&[("retry-after", "5".into())]));
    assert!(budget.remaining() <= 0.0);
    let started = Instant::now();
    budget.acquire_as(Class::Transition, None).await.unwrap();
    assert_eq!(started.elapsed(), Duration::from_secs(5));
}

#[test]
fn the_class_follows_the_task_and_defaults_to_transition() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    runtime.block_on(async {
        assert_eq!(current(), Class::Transition);
        assert_eq!(
            scoped(Class::Refresh, async { current() }).await,
            Class::Refresh
        );
        let nested = scoped(Class::Reconcile, async {
            scoped(Class::Proof, async { current() }).await
        })
        .await;
        assert_eq!(nested, Class::Proof);
    });
}

#[test]
fn shares_are_fractions() {
    assert!(Shares::default().validate().is_ok());
    let bad = Shares {
        share: 0.0,
        reconcile: 0.2,
    };
    assert!(bad.validate().unwrap_err().contains("--api-budget-share"));
    let bad = Shares {
        share: 0.5,
        reconcile: 1.5,
    };
    assert!(
        bad.validate()
            .unwrap_err()
            .contains("--api-reconcile-share")
    );
}

/// Before the first answer nothing is known of the cloud's bucket (another user may have spent
/// it): one request probes, and the rest of a burst waits for its answer.
#[tokio::test(start_paused = true)]
async fn the_first_request_probes_before_a_burst_is_let_through() {
    let budget = fresh(100.0, 1.0);
    budget.acquire(None).await.unwrap();
    let second = tokio::time::timeout(Duration::from_millis(500), budget.acquire(None)).await;
    assert!(second.is_err(), "the burst waits for the probe's answer");
    budget.observe(
        200,
        &headers(&[
            ("ratelimit-limit", "100".into()),
            ("ratelimit-remaining", "3".into()),
        ]),
    );
    let started = Instant::now();
    for _ in 0..3 {
        budget.acquire(None).await.unwrap();
    }
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn a_survey_is_paced_to_its_share_of_the_budget() {
    let floor = Duration::from_secs(120);
    // Hetzner, default shares: 0.5 of 1 request/s, 0.2 of that for background work.
    let hetzner = ApiBudget::new(Limits::HETZNER, Shares::default(), "bigfleet_budget_test");
    let rate = hetzner.background_per_second();
    assert!((rate - 0.1).abs() < 1e-9, "background rate {rate}");
    // 10,000 servers are 200 pages of 50: one survey every 2,000 s.
    assert_eq!(survey_period(floor, 200, rate), Duration::from_secs(2000));
    // 1,000 servers (20 pages) fit the floor's cadence: the floor stays.
    assert_eq!(survey_period(floor, 12, rate), floor);
    assert_eq!(survey_period(floor, 20, rate), Duration::from_secs(200));
    // Nothing measured, or no refill known: the floor.
    assert_eq!(survey_period(floor, 0, rate), floor);
    assert_eq!(survey_period(floor, 200, 0.0), floor);
    assert_eq!(survey_period(floor, 200, f64::NAN), floor);
    // Never rarer than daily.
    assert_eq!(
        survey_period(floor, u64::MAX, rate),
        Duration::from_secs(86_400)
    );
    // The shares set later change the pace.
    hetzner.set_shares(Shares {
        share: 1.0,
        reconcile: 1.0,
    });
    assert!((hetzner.background_per_second() - 1.0).abs() < 1e-9);
}

#[test]
fn out_of_band_checks_fit_between_paced_surveys_and_are_paid_for() {
    let floor = Duration::from_secs(120);
    let rate = 0.1;
    // No check: the survey's own pace.
    assert_eq!(
        survey_pace(floor, 200, None, rate),
        SurveyPace {
            period: Duration::from_secs(2000),
            check_every: None
        }
    );
    // A one-request check every floor; the surveys leave its rate to it.
    let paced = survey_pace(floor, 200, Some(1), rate);
    assert_eq!(paced.check_every, Some(floor));
    let left = rate - 1.0 / 120.0;
    assert!(
        (paced.period.as_secs_f64() - 200.0 / left).abs() < 1e-6,
        "{paced:?}"
    );
    // What a whole period spends stays within the background rate.
    let spent = 200.0 + paced.period.as_secs_f64() / 120.0;
    assert!(spent <= rate * paced.period.as_secs_f64() + 1e-6, "{spent}");
    // Surveys at the floor anyway, or not much above it: no check.
    assert_eq!(
        survey_pace(floor, 12, Some(1), rate),
        SurveyPace::floor(floor)
    );
    assert_eq!(
        survey_pace(floor, 0, Some(1), rate),
        SurveyPace::floor(floor)
    );
    assert_eq!(
        survey_pace(floor, 200, Some(1), 0.0),
        SurveyPace::floor(floor)
    );
    assert_eq!(
        survey_pace(floor, 20, Some(1), rate),
        survey_pace(floor, 20, None, rate),
        "a survey every 200 s leaves no room for a check every 120 s to be worth it"
    );
    // A floor so short that checks every floor would take more than their share: they are
    // spaced to a quarter of the background rate, and the surveys get the rest.
    let short = Duration::from_secs(1);
    let paced = survey_pace(short, 200, Some(1), rate);
    assert_eq!(paced.check_every, Some(Duration::from_secs(40)));
    assert!(
        (paced.period.as_secs_f64() - 200.0 / 0.075).abs() < 1e-6,
        "{paced:?}"
    );
    // A cheap survey at a short floor: checks spaced to their share would not come twice as
    // often as the survey, so there are none (and the survey keeps its pace).
    let cheap = survey_pace(short, 2, Some(1), rate);
    assert_eq!(cheap, survey_pace(short, 2, None, rate), "{cheap:?}");
    assert_eq!(cheap.period, Duration::from_secs(20));
    // A check that costs nothing measurable runs every floor.
    assert_eq!(
        survey_pace(floor, 200, Some(0), rate).check_every,
        Some(floor)
    );
}

#[tokio::test(start_paused = true)]
async fn served_requests_are_counted_by_class() {
    let budget = small(100.0, 1.0);
    for _ in 0..3 {
        budget.acquire_as(Class::Reconcile, None).await.unwrap();
    }
    budget.acquire_as(Class::Proof, None).await.unwrap();
    scoped(Class::Refresh, budget.acquire(None)).await.unwrap();
    assert_eq!(budget.served(Class::Reconcile), 3);
    assert_eq!(budget.served(Class::Proof), 1);
    assert_eq!(budget.served(Class::Refresh), 1);
    assert_eq!(budget.served(Class::Transition), 0);
}

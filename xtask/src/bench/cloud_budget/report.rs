//! The figures of `cloud-budget` and their two outputs: Markdown tables for people and JSON for
//! machines. Pure, so the formatting has unit tests.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use serde_json::{Value, json};

use super::super::args::Cloud;
use super::super::procfs::Machine;
use super::super::report::number;

/// Requests the emulator saw, by its class of work: how many arrived and how many of those its
/// rate limit answered with 429.
pub(crate) type Counts = BTreeMap<&'static str, (usize, usize)>;

/// The class of the catalog reads (types, images, prices...), which are no survey's.
pub(crate) const CATALOG: &str = "catalog";

/// The classes of the out-of-band checks between surveys (Hetzner's one-server count,
/// DigitalOcean's actions since a cursor): reconcile's requests, but no survey's.
pub(crate) const CHECKS: [&str; 2] = ["count", "actions"];

/// The requests of `counts` in `classes`.
pub(crate) fn of_classes(counts: &Counts, classes: &[&str]) -> usize {
    classes
        .iter()
        .map(|class| counts.get(class).map_or(0, |(n, _)| *n))
        .sum()
}

/// Every request in `counts`.
pub(crate) fn total(counts: &Counts) -> usize {
    counts.values().map(|(n, _)| n).sum()
}

/// The requests of `counts` answered with 429.
pub(crate) fn refused(counts: &Counts) -> usize {
    counts.values().map(|(_, r)| r).sum()
}

/// What arrived between two readings of the counts.
pub(crate) fn since(after: &Counts, before: &Counts) -> Counts {
    after
        .iter()
        .filter_map(|(class, (n, r))| {
            let (n0, r0) = before.get(class).copied().unwrap_or_default();
            let n = n.saturating_sub(n0);
            (n > 0).then(|| (*class, (n, r.saturating_sub(r0))))
        })
        .collect()
}

/// `create 1, listing 4` (with `(2 refused)` after a class that met 429s).
fn by_class(counts: &Counts) -> String {
    if counts.is_empty() {
        return "none".into();
    }
    counts
        .iter()
        .map(|(class, (n, r))| {
            if *r > 0 {
                format!("{class} {n} ({r} refused)")
            } else {
                format!("{class} {n}")
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn classes_json(counts: &Counts) -> Value {
    Value::Object(
        counts
            .iter()
            .map(|(class, (n, r))| ((*class).to_owned(), json!({"requests": n, "refused": r})))
            .collect(),
    )
}

/// One transition of one machine walked alone.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Operation {
    pub cloud: Cloud,
    pub name: &'static str,
    pub requests: Counts,
    /// From the RPC to the settled state.
    pub took: Duration,
}

/// How full the token's bucket is when a burst starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Bucket {
    Full,
    /// Spent by another user before the provider started (its first answers say so).
    Empty,
    /// Spent by another user while the provider idled (its last answer said full).
    Emptied,
}

impl Bucket {
    pub(crate) const ALL: [Bucket; 3] = [Bucket::Full, Bucket::Empty, Bucket::Emptied];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Bucket::Full => "full",
            Bucket::Empty => "empty at start",
            Bucket::Emptied => "emptied while idle",
        }
    }
}

/// Concurrent Creates of fresh slots.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Burst {
    pub cloud: Cloud,
    pub bucket: Bucket,
    pub creates: usize,
    pub requests: Counts,
    /// From the first Create to the last machine IDLE.
    pub wall: Duration,
}

/// Reconcile with owned hosts and nothing else to do, over whole survey cycles.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Steady {
    pub cloud: Cloud,
    pub hosts: usize,
    /// How many times faster than real time the run went.
    pub scale: f64,
    /// Survey cycles in the window (from one survey's start to a later one's).
    pub cycles: usize,
    /// The window's requests.
    pub requests: Counts,
    /// The window's length in real, unscaled time.
    pub real_seconds: f64,
    /// The wait the provider chose before its next survey, in real seconds
    /// (`<prefix>_reconcile_period_seconds` times the scale).
    pub period_seconds: Option<f64>,
    /// What the provider counted its last survey at (`<prefix>_reconcile_survey_requests`).
    pub provider_survey_requests: Option<f64>,
    /// The cloud's requests per hour for one token.
    pub hourly_limit: f64,
}

impl Steady {
    /// The window's requests of reconcile: its surveys and the checks between them (everything
    /// but the catalog reads).
    pub(crate) fn reconcile_requests(&self) -> usize {
        total(&self.requests) - of_classes(&self.requests, &[CATALOG])
    }

    /// The window's out-of-band checks.
    pub(crate) fn check_requests(&self) -> usize {
        of_classes(&self.requests, &CHECKS)
    }

    pub(crate) fn per_survey(&self) -> f64 {
        (self.reconcile_requests() - self.check_requests()) as f64 / self.cycles.max(1) as f64
    }

    /// Reconcile requests (surveys and checks) per real hour.
    pub(crate) fn per_hour(&self) -> f64 {
        self.reconcile_requests() as f64 * 3600.0 / self.real_seconds.max(1e-9)
    }

    /// Out-of-band checks per real hour.
    pub(crate) fn checks_per_hour(&self) -> f64 {
        self.check_requests() as f64 * 3600.0 / self.real_seconds.max(1e-9)
    }

    /// Every request of the window per real hour (catalog refreshes included).
    pub(crate) fn all_per_hour(&self) -> f64 {
        total(&self.requests) as f64 * 3600.0 / self.real_seconds.max(1e-9)
    }

    /// [`Steady::per_hour`] as a share of the cloud's hourly limit.
    pub(crate) fn share(&self) -> f64 {
        self.per_hour() / self.hourly_limit
    }
}

/// Creates beside many owned hosts, alone on the token or beside another user.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Crowd {
    pub cloud: Cloud,
    pub owned: usize,
    pub creates: usize,
    /// How many times faster than real time the cloud's limit ran.
    pub scale: f64,
    /// What the other user of the token asked for and got, when there was one.
    pub other: Option<(u32, u32)>,
    pub requests: Counts,
    /// From the first Create to the last machine IDLE.
    pub wall: Duration,
    /// What the provider's share of the refill allows for its requests, and one boot.
    pub budget: Duration,
}

impl Crowd {
    fn other_user(&self) -> String {
        match self.other {
            None => "none".into(),
            Some((asked, got)) => format!("half the refill (got {got} of {asked})"),
        }
    }

    pub(crate) fn ratio(&self) -> f64 {
        self.wall.as_secs_f64() / self.budget.as_secs_f64().max(1e-9)
    }
}

/// Creates from a full bucket, with or without a storm of 429s as they start.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Storm {
    pub cloud: Cloud,
    /// How long the storm lasted; `None` for the calm run.
    pub storm: Option<Duration>,
    pub creates: usize,
    /// From each Create's acknowledgement to its machine IDLE.
    pub p50: Duration,
    pub p99: Duration,
    pub max: Duration,
    pub requests: Counts,
}

/// Everything one run measured, and what failed.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Report {
    pub operations: Vec<Operation>,
    pub bursts: Vec<Burst>,
    pub steady: Vec<Steady>,
    pub crowds: Vec<Crowd>,
    pub storms: Vec<Storm>,
    pub soldouts: Vec<super::soldout::Soldout>,
    /// How each kind of run was set up, one line each.
    pub conditions: Vec<String>,
    pub failures: Vec<String>,
}

/// `210 ms` below a second, `14.0 s` from there.
fn human(d: Duration) -> String {
    if d < Duration::from_secs(1) {
        format!("{} ms", d.as_millis())
    } else {
        format!("{:.1} s", d.as_secs_f64())
    }
}

/// The three Markdown tables.
pub(crate) fn tables(report: &Report) -> String {
    let mut out = String::new();
    if !report.operations.is_empty() {
        out.push_str("Requests per transition, one machine walked alone:\n\n");
        out.push_str("| cloud | transition | requests | by class | 429 | took |\n");
        out.push_str("|---|---|---:|---|---:|---:|\n");
        for op in &report.operations {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} |",
                op.cloud.name(),
                op.name,
                total(&op.requests),
                by_class(&op.requests),
                refused(&op.requests),
                human(op.took)
            );
        }
        out.push('\n');
    }
    if !report.bursts.is_empty() {
        out.push_str("Bursts of Creates:\n\n");
        out.push_str(
            "| cloud | bucket | Creates | requests | per Create | by class | 429 | wall time |\n",
        );
        out.push_str("|---|---|---:|---:|---:|---|---:|---:|\n");
        for b in &report.bursts {
            let n = total(&b.requests);
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                b.cloud.name(),
                b.bucket.name(),
                b.creates,
                n,
                number(n as f64 / b.creates.max(1) as f64),
                by_class(&b.requests),
                refused(&b.requests),
                human(b.wall)
            );
        }
        out.push('\n');
    }
    if !report.steady.is_empty() {
        out.push_str("Steady state (reconcile only), in real time:\n\n");
        out.push_str(
            "| cloud | owned hosts | surveys | requests per survey | provider's count | \
             period s | checks/hour | requests/hour | share of limit | all requests/hour | \
             time scale |\n",
        );
        out.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
        for s in &report.steady {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {:.1}% | {} | {} |",
                s.cloud.name(),
                s.hosts,
                s.cycles,
                number(s.per_survey()),
                s.provider_survey_requests
                    .map_or_else(|| "?".into(), number),
                s.period_seconds.map_or_else(|| "?".into(), number),
                number(s.checks_per_hour()),
                number(s.per_hour()),
                s.share() * 100.0,
                number(s.all_per_hour()),
                number(s.scale)
            );
        }
        out.push('\n');
    }
    if !report.crowds.is_empty() {
        out.push_str("Creates beside owned hosts:\n\n");
        out.push_str(
            "| cloud | owned hosts | Creates | other user | requests | by class | 429 | wall time \
             | budget time | wall / budget | time scale |\n",
        );
        out.push_str("|---|---:|---:|---|---:|---|---:|---:|---:|---:|---:|\n");
        for c in &report.crowds {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.2} | {} |",
                c.cloud.name(),
                c.owned,
                c.creates,
                c.other_user(),
                total(&c.requests),
                by_class(&c.requests),
                refused(&c.requests),
                human(c.wall),
                human(c.budget),
                c.ratio(),
                number(c.scale)
            );
        }
        out.push('\n');
    }
    if !report.storms.is_empty() {
        out.push_str("Create latency (acknowledged to IDLE) with and without a 429 storm:\n\n");
        out.push_str("| cloud | storm | Creates | p50 | p99 | max | requests | 429 |\n");
        out.push_str("|---|---|---:|---:|---:|---:|---:|---:|\n");
        for s in &report.storms {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                s.cloud.name(),
                s.storm.map_or_else(|| "none".to_owned(), human),
                s.creates,
                human(s.p50),
                human(s.p99),
                human(s.max),
                total(&s.requests),
                refused(&s.requests)
            );
        }
        out.push('\n');
    }
    out.push_str(&super::soldout::render(&report.soldouts));
    for line in &report.conditions {
        let _ = writeln!(out, "- {line}");
    }
    out
}

pub(crate) fn to_json(report: &Report, machine: &Machine, took: Duration) -> Value {
    json!({
        "scenario": super::super::args::CLOUD_BUDGET,
        "machine": {
            "cpus": machine.cpus,
            "cpu_model": machine.cpu_model,
            "kernel": machine.kernel,
            "memory_mib": machine.memory_mib,
        },
        "seconds": took.as_secs_f64(),
        "conditions": report.conditions,
        "transitions": report.operations.iter().map(|op| json!({
            "cloud": op.cloud.name(),
            "transition": op.name,
            "requests": total(&op.requests),
            "refused": refused(&op.requests),
            "by_class": classes_json(&op.requests),
            "seconds": op.took.as_secs_f64(),
        })).collect::<Vec<_>>(),
        "storms": report.storms.iter().map(|s| json!({
            "cloud": s.cloud.name(),
            "storm_seconds": s.storm.map(|d| d.as_secs_f64()),
            "creates": s.creates,
            "p50_seconds": s.p50.as_secs_f64(),
            "p99_seconds": s.p99.as_secs_f64(),
            "max_seconds": s.max.as_secs_f64(),
            "requests": total(&s.requests),
            "refused": refused(&s.requests),
        })).collect::<Vec<_>>(),
        "bursts": report.bursts.iter().map(|b| json!({
            "cloud": b.cloud.name(),
            "bucket": b.bucket.name(),
            "creates": b.creates,
            "requests": total(&b.requests),
            "refused": refused(&b.requests),
            "by_class": classes_json(&b.requests),
            "seconds": b.wall.as_secs_f64(),
        })).collect::<Vec<_>>(),
        "steady": report.steady.iter().map(|s| json!({
            "cloud": s.cloud.name(),
            "owned_hosts": s.hosts,
            "time_scale": s.scale,
            "surveys": s.cycles,
            "window_seconds": s.real_seconds,
            "requests_per_survey": s.per_survey(),
            "provider_survey_requests": s.provider_survey_requests,
            "reconcile_period_seconds": s.period_seconds,
            "checks_per_hour": s.checks_per_hour(),
            "requests_per_hour": s.per_hour(),
            "share_of_hourly_limit": s.share(),
            "all_requests_per_hour": s.all_per_hour(),
            "by_class": classes_json(&s.requests),
        })).collect::<Vec<_>>(),
        "crowded": report.crowds.iter().map(|c| json!({
            "cloud": c.cloud.name(),
            "owned_hosts": c.owned,
            "creates": c.creates,
            "time_scale": c.scale,
            "other_user": c.other.map(|(asked, got)| json!({"asked": asked, "got": got})),
            "requests": total(&c.requests),
            "refused": refused(&c.requests),
            "by_class": classes_json(&c.requests),
            "seconds": c.wall.as_secs_f64(),
            "budget_seconds": c.budget.as_secs_f64(),
        })).collect::<Vec<_>>(),
        "soldout": super::soldout::to_json(&report.soldouts),
        "failures": report.failures,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(pairs: &[(&'static str, usize, usize)]) -> Counts {
        pairs.iter().map(|(c, n, r)| (*c, (*n, *r))).collect()
    }

    fn sample() -> Report {
        Report {
            operations: vec![Operation {
                cloud: Cloud::Hetzner,
                name: "Create",
                requests: counts(&[("create", 1, 0), ("listing", 5, 0)]),
                took: Duration::from_millis(16_500),
            }],
            bursts: vec![Burst {
                cloud: Cloud::DigitalOcean,
                bucket: Bucket::Emptied,
                creates: 50,
                requests: counts(&[("create", 50, 0), ("listing", 62, 12), ("tag", 8, 0)]),
                wall: Duration::from_secs(170),
            }],
            steady: vec![Steady {
                cloud: Cloud::Hetzner,
                hosts: 1000,
                scale: 100.0,
                cycles: 3,
                requests: counts(&[("listing", 63, 0), ("count", 9, 0), ("catalog", 6, 0)]),
                real_seconds: 630.0,
                period_seconds: Some(210.0),
                provider_survey_requests: Some(21.0),
                hourly_limit: 3600.0,
            }],
            crowds: vec![Crowd {
                cloud: Cloud::Hetzner,
                owned: 1000,
                creates: 200,
                scale: 10.0,
                other: Some((1500, 1490)),
                requests: counts(&[("create", 200, 0), ("listing", 40, 0)]),
                wall: Duration::from_secs(63),
                budget: Duration::from_secs(60),
            }],
            storms: vec![Storm {
                cloud: Cloud::Hetzner,
                storm: Some(Duration::from_secs(10)),
                creates: 50,
                p50: Duration::from_secs(14),
                p99: Duration::from_secs(16),
                max: Duration::from_secs(17),
                requests: counts(&[("create", 60, 10)]),
            }],
            soldouts: Vec::new(),
            conditions: vec!["walks at real time".into()],
            failures: vec!["digitalocean steady 10000: boom".into()],
        }
    }

    #[test]
    fn counts_between_two_readings() {
        let before = counts(&[("create", 2, 1), ("listing", 4, 0)]);
        let after = counts(&[("create", 3, 1), ("listing", 4, 0), ("poll", 2, 2)]);
        assert_eq!(
            since(&after, &before),
            counts(&[("create", 1, 0), ("poll", 2, 2)])
        );
        assert_eq!(total(&after), 9);
        assert_eq!(refused(&after), 3);
        assert_eq!(by_class(&Counts::new()), "none");
    }

    #[test]
    fn steady_figures_are_per_real_hour() {
        let s = &sample().steady[0];
        assert_eq!(s.reconcile_requests(), 72);
        assert_eq!(s.check_requests(), 9);
        assert_eq!(s.per_survey(), 21.0);
        assert_eq!(s.per_hour(), 411.42857142857144);
        assert_eq!(s.checks_per_hour(), 51.42857142857143);
        assert_eq!(s.all_per_hour(), 445.7142857142857);
        assert!((s.share() - 0.1142857142857143).abs() < 1e-12);
    }

    #[test]
    fn durations_for_people() {
        assert_eq!(human(Duration::from_micros(1610)), "1 ms");
        assert_eq!(human(Duration::from_millis(210)), "210 ms");
        assert_eq!(human(Duration::from_millis(14_040)), "14.0 s");
    }

    #[test]
    fn tables_and_json() {
        let report = sample();
        let text = tables(&report);
        assert!(
            text.contains("| hetzner | Create | 6 | create 1, listing 5 | 0 | 16.5 s |"),
            "{text}"
        );
        assert!(
            text.contains(
                "| digitalocean | emptied while idle | 50 | 120 | 2.40 | create 50, listing 62 \
                 (12 refused), tag 8 | 12 | 170.0 s |"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "| hetzner | 1000 | 3 | 21 | 21 | 210 | 51.4 | 411 | 11.4% | 446 | 100 |"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "| hetzner | 1000 | 200 | half the refill (got 1490 of 1500) | 240 | create 200, \
                 listing 40 | 0 | 63.0 s | 60.0 s | 1.05 | 10 |"
            ),
            "{text}"
        );
        assert!(text.ends_with("- walks at real time\n"), "{text}");
        let machine = Machine {
            cpus: 2,
            cpu_model: "x".into(),
            kernel: "k".into(),
            memory_mib: 1,
        };
        let json = to_json(&report, &machine, Duration::from_secs(200));
        assert_eq!(json["scenario"], "cloud-budget");
        assert_eq!(json["transitions"][0]["requests"], 6);
        assert_eq!(json["bursts"][0]["refused"], 12);
        assert_eq!(json["storms"][0]["p99_seconds"], 16.0);
        assert_eq!(json["storms"][0]["refused"], 10);
        assert!(
            text.contains("| hetzner | 10.0 s | 50 | 14.0 s | 16.0 s | 17.0 s | 60 | 10 |"),
            "{text}"
        );
        assert_eq!(json["bursts"][0]["by_class"]["listing"]["refused"], 12);
        assert_eq!(json["steady"][0]["requests_per_hour"], 411.42857142857144);
        assert_eq!(json["steady"][0]["checks_per_hour"], 51.42857142857143);
        assert_eq!(json["crowded"][0]["other_user"]["got"], 1490);
        assert_eq!(json["crowded"][0]["budget_seconds"], 60.0);
        assert_eq!(json["failures"][0], "digitalocean steady 10000: boom");
        // Nothing measured: no table at all.
        assert_eq!(tables(&Report::default()), "");
    }
}

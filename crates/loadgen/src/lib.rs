//! `bigfleet-loadgen` (also `cargo xtask bench`): a load generator for any
//! `bigfleet.v1alpha1.CapacityProvider` endpoint on loopback, and the measurements behind
//! beyond.md section 10 (speed and memory targets) and docs/performance.md.
//!
//! It benches a running endpoint (`--target`) or starts the provider itself (`--spawn`), in
//! which case every run gets a fresh process, the provider's CPU time and memory are read from
//! /proc, and `--compare` alternates runs against a second command and prints ratios.
//! `--scenario cloud-budget` is of another kind and needs the repository: `cargo xtask bench`
//! runs it (`xtask/src/bench/cloud_budget.rs`), this crate only parses its flags.
//! `--help` lists the scenarios and flags; `--quick` takes seconds.

pub mod args;
mod etcd;
mod floor;
mod load;
pub mod procfs;
mod provider;
pub mod report;
mod scenarios;
mod stats;
mod takeover;

use std::time::Instant;

use anyhow::{Context, Result, bail};

use self::args::{Endpoint, Options, Parsed, Scenario, flag_value};
use self::procfs::Machine;
use self::provider::Provider;
use self::report::{Row, Run, Side};
use self::scenarios::Scratch;

pub use floor::FLAG as FLOOR_FLAG;

/// Runs the load generator with its command-line arguments `args`. `program` is the command
/// line that runs it again (`bigfleet-loadgen`, or `xtask bench`): with [`FLOOR_FLAG`] first,
/// `args` make it the floor server the get scenario compares with.
pub fn run(args: &[String], program: &[String]) -> Result<()> {
    if args.first().map(String::as_str) == Some(floor::FLAG) {
        return floor::serve(&args[1..]);
    }
    let options = match args::parse(args)? {
        Parsed::Help => {
            println!("{}", args::USAGE);
            return Ok(());
        }
        Parsed::CloudBudget(_) => bail!(
            "--scenario {} builds the providers and starts the clouds' emulators from the \
             repository: run it with `cargo xtask bench`",
            args::CLOUD_BUDGET
        ),
        Parsed::Run(options) => *options,
    };
    if cfg!(debug_assertions) {
        // An unoptimised client spends more CPU per call than the provider does, and then it,
        // not the provider, sets the latencies.
        eprintln!("bench: WARNING: an unoptimised build; its own CPU sets the latencies");
    }
    let runtime = if options.client_threads == 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(options.client_threads)
            .enable_all()
            .build()
    }
    .context("start the client runtime")?;
    let machine = Machine::describe();
    let started = Instant::now();
    let runs = runtime.block_on(run_all(&options, program))?;
    let lines = report::lines(&runs);
    let commands = commands(&options);
    let json = report::to_json(&machine, &commands, &runs, &lines);
    if let Some(path) = &options.json_out {
        std::fs::write(path, serde_json::to_string_pretty(&json)?)
            .with_context(|| format!("write {}", path.display()))?;
    }
    if options.json {
        println!("{}", serde_json::to_string_pretty(&json)?);
    } else {
        println!(
            "machine: {} CPUs, {}, {} MiB, Linux {}",
            machine.cpus, machine.cpu_model, machine.memory_mib, machine.kernel
        );
        for (side, command) in &commands {
            println!("{}: {command}", side.name());
        }
        if let Some(load) = report::load_spread(&runs) {
            println!(
                "load average (1 min) at run starts: median {:.2}, {:.2}–{:.2}",
                load.median, load.min, load.max
            );
        }
        println!("\n{}", report::table(&lines, Side::Ours));
        if commands.iter().any(|(side, _)| *side == Side::Theirs) {
            println!("theirs:\n\n{}", report::table(&lines, Side::Theirs));
            println!(
                "ratio ours/theirs (medians):\n\n{}",
                report::ratio_table(&lines, Side::Theirs)
            );
        }
        if lines.iter().any(|line| !line.floor.is_empty()) {
            println!("floor:\n\n{}", report::table(&lines, Side::Floor));
            println!(
                "ratio ours/floor (medians):\n\n{}",
                report::ratio_table(&lines, Side::Floor)
            );
        }
        println!("bench: {} runs in {:.1?}", runs.len(), started.elapsed());
    }
    let failures = report::failures(&runs);
    for failure in &failures {
        eprintln!("bench: FAILED {failure}");
    }
    if !failures.is_empty() {
        bail!("{} of {} runs failed", failures.len(), runs.len());
    }
    Ok(())
}

fn commands(options: &Options) -> Vec<(Side, String)> {
    match &options.endpoint {
        Endpoint::Target { addr, .. } => vec![(Side::Ours, format!("--target {addr}"))],
        Endpoint::Spawn { ours, theirs } => {
            let mut v = vec![(Side::Ours, ours.join(" "))];
            if let Some(theirs) = theirs {
                v.push((Side::Theirs, theirs.join(" ")));
            }
            v
        }
    }
}

/// The inventories a scenario runs at with `--spawn`.
fn sizes(scenario: Scenario, options: &Options, fixed: Option<usize>) -> Vec<usize> {
    if let Some(fixed) = fixed {
        return vec![fixed];
    }
    if scenario.uses_inventory() {
        return vec![options.inventory];
    }
    let mut sizes = options.seeds.clone();
    if scenario == Scenario::Startup && !sizes.contains(&256) {
        // Idle RSS at 256 machines is one of the targets.
        sizes.insert(0, 256);
    }
    sizes
}

async fn run_all(options: &Options, program: &[String]) -> Result<Vec<Run>> {
    match &options.endpoint {
        Endpoint::Target { addr, pid } => {
            let provider = Provider::connect(*addr, options.tls.as_ref(), *pid).await?;
            let size = load::all_ids(&provider.client()).await?.len();
            let mut runs = Vec::new();
            for &scenario in &options.scenarios {
                for repeat in 0..options.repeats {
                    let load1 = procfs::load1();
                    let outcome = measure(scenario, &provider, options).await;
                    let slot = (Side::Ours, scenario, size, repeat);
                    runs.push(record(slot, options.repeats, load1, outcome));
                }
            }
            Ok(runs)
        }
        Endpoint::Spawn { ours, theirs } => {
            let parent = std::env::temp_dir();
            let mut scratch = Scratch::create(&parent)?;
            let fixed = flag_value(ours, "--seed-count").and_then(|v| v.parse().ok());
            let mut runs = Vec::new();
            for &scenario in &options.scenarios {
                for size in sizes(scenario, options, fixed) {
                    // The get scenario also runs against the floor, answering with a machine
                    // of the provider's own encoding.
                    let floor = if scenario == Scenario::Get && options.floor {
                        let machine = floor::sample_machine(ours, size).await?;
                        Some(floor::command(program, &machine))
                    } else {
                        None
                    };
                    if scenario == Scenario::Startup
                        && Some(&size) == sizes(scenario, options, fixed).first()
                    {
                        binary_rows(&mut runs, ours, theirs.as_deref(), size, &scratch);
                    }
                    for repeat in 0..options.repeats {
                        let mut order = vec![(Side::Ours, ours)];
                        if let Some(theirs) = theirs {
                            order.push((Side::Theirs, theirs));
                        }
                        if let Some(floor) = &floor {
                            order.push((Side::Floor, floor));
                        }
                        // Alternate who goes first, so drift favours neither.
                        if repeat % 2 == 1 {
                            order.reverse();
                        }
                        for (side, command) in order {
                            let load1 = procfs::load1();
                            let outcome =
                                spawn_and_measure(scenario, command, size, options, &mut scratch)
                                    .await;
                            let slot = (side, scenario, size, repeat);
                            runs.push(record(slot, options.repeats, load1, outcome));
                        }
                    }
                }
            }
            Ok(runs)
        }
    }
}

fn binary_rows(
    runs: &mut Vec<Run>,
    ours: &[String],
    theirs: Option<&[String]>,
    size: usize,
    scratch: &Scratch,
) {
    let mut sides = vec![(Side::Ours, ours)];
    if let Some(theirs) = theirs {
        sides.push((Side::Theirs, theirs));
    }
    for (side, command) in sides {
        if let Some(row) = scenarios::binary_size(command, scratch) {
            runs.push(Run {
                side,
                scenario: Scenario::Startup,
                size,
                repeat: 0,
                load1: None,
                outcome: Ok(vec![row]),
            });
        }
    }
}

/// Which side, scenario, size and repeat a run is.
type Slot = (Side, Scenario, usize, usize);

fn record(
    (side, scenario, size, repeat): Slot,
    repeats: usize,
    load1: Option<f64>,
    outcome: Result<Vec<Row>>,
) -> Run {
    let load = load1.map_or_else(String::new, |l| format!(" (load {l:.2})"));
    match &outcome {
        Ok(rows) => {
            let summary: Vec<String> = rows
                .iter()
                .filter_map(|r| {
                    let p50 = r.get(report::P50)?;
                    Some(format!("{} p50 {} ms", r.label, report::number(p50)))
                })
                .take(2)
                .collect();
            eprintln!(
                "bench: {} seeds={size} {} run {}/{repeats}{load}: {}",
                scenario.name(),
                side.name(),
                repeat + 1,
                summary.join(", ")
            );
        }
        Err(e) => eprintln!(
            "bench: {} seeds={size} {} run {}/{repeats}{load} FAILED: {e:#}",
            scenario.name(),
            side.name(),
            repeat + 1
        ),
    }
    Run {
        side,
        scenario,
        size,
        repeat,
        load1,
        outcome: outcome.map_err(|e| format!("{e:#}")),
    }
}

async fn measure(scenario: Scenario, provider: &Provider, options: &Options) -> Result<Vec<Row>> {
    match scenario {
        Scenario::Get => scenarios::get(provider, options).await,
        Scenario::List => scenarios::list(provider, options).await,
        Scenario::ListFiltered => scenarios::list_filtered(provider, options).await,
        Scenario::Lifecycle | Scenario::Durable | Scenario::Etcd => {
            scenarios::lifecycle(provider, options).await
        }
        Scenario::Mixed => scenarios::mixed(provider, options).await,
        Scenario::Startup => bail!("startup needs --spawn"),
        Scenario::Takeover => bail!("takeover needs --spawn"),
    }
}

async fn spawn_and_measure(
    scenario: Scenario,
    command: &[String],
    size: usize,
    options: &Options,
    scratch: &mut Scratch,
) -> Result<Vec<Row>> {
    let tls = options.tls.as_ref();
    if scenario == Scenario::Startup {
        return scenarios::startup(command, size, tls, scratch).await;
    }
    if scenario == Scenario::Takeover {
        return takeover::measure(command, size, tls, scratch).await;
    }
    // The etcd scenario: the same walk with its state in a fresh etcd member.
    let etcd = match scenario {
        Scenario::Etcd => Some(etcd::Etcd::start(&scratch.fresh())?),
        _ => None,
    };
    let state = match &etcd {
        Some(etcd) => Some(std::path::PathBuf::from(etcd.state())),
        None => scenario.durable().then(|| scratch.fresh()),
    };
    let provider = Provider::start(command, Some(size), state.as_deref(), tls).await?;
    let outcome = measure(scenario, &provider, options).await;
    let outcome = match outcome {
        Ok(rows) => Ok(rows),
        Err(e) => Err(e.context(format!(
            "provider log tail:\n{}",
            tail(&provider.logs(), 20)
        ))),
    };
    provider.stop().await?;
    if let (Some(state), None) = (state, &etcd) {
        let _ = std::fs::remove_dir_all(&state);
        let _ = std::fs::remove_file(&state);
    }
    drop(etcd);
    outcome
}

/// The last `lines` lines of `text`.
pub fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

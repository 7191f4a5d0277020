//! `fuzz`: runs the fuzz targets (what `cargo xtask fuzz` starts).
//!
//! `fuzz [--seconds N] [--max-inputs N] [--seed 0xSEED] [--list] [TARGET...]`: every target (or
//! the named ones) for N seconds each (default 10), printing per target the inputs tried and
//! any crash with its seed and shrunk input. `--seed` replays one input of one target. Exits 1
//! when a target crashed.

use std::process::ExitCode;
use std::time::Duration;

use fuzz::engine::{self, Budget, Outcome};
use fuzz::{TARGETS, Target};

struct Args {
    seconds: u64,
    max_inputs: u64,
    seed: Option<u64>,
    list: bool,
    targets: Vec<&'static Target>,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        seconds: 10,
        max_inputs: u64::MAX,
        seed: None,
        list: false,
        targets: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |flag: &str| it.next().ok_or_else(|| format!("{flag} needs a value"));
        match arg.as_str() {
            "--seconds" => {
                let v = value("--seconds")?;
                args.seconds = v
                    .parse()
                    .map_err(|_| format!("--seconds: not a whole number: {v:?}"))?;
            }
            "--max-inputs" => {
                let v = value("--max-inputs")?;
                args.max_inputs = v
                    .parse()
                    .map_err(|_| format!("--max-inputs: not a whole number: {v:?}"))?;
            }
            "--seed" => {
                let v = value("--seed")?;
                let digits = v.trim_start_matches("0x");
                args.seed = Some(
                    u64::from_str_radix(digits, 16)
                        .map_err(|_| format!("--seed: not a hexadecimal seed: {v:?}"))?,
                );
            }
            "--list" => args.list = true,
            name if !name.starts_with('-') => {
                args.targets.push(fuzz::target(name).ok_or_else(|| {
                    format!(
                        "unknown target {name:?}; targets: {}",
                        TARGETS
                            .iter()
                            .map(|t| t.name)
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                })?)
            }
            other => return Err(format!("unknown flag {other:?}")),
        }
    }
    if args.targets.is_empty() {
        args.targets = TARGETS.iter().collect();
    }
    Ok(args)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("fuzz: {e}");
            return ExitCode::from(2);
        }
    };
    if args.list {
        for t in TARGETS {
            println!("{:<20} {}", t.name, t.checks);
        }
        return ExitCode::SUCCESS;
    }
    if let Some(seed) = args.seed {
        let [target] = args.targets[..] else {
            eprintln!("fuzz: --seed replays one input of one target; name exactly one target");
            return ExitCode::from(2);
        };
        return match engine::replay(target, seed) {
            Outcome::Crashed(message) => {
                println!("{} seed {seed:#018x}: CRASH {message}", target.name);
                ExitCode::FAILURE
            }
            other => {
                println!("{} seed {seed:#018x}: {other:?}", target.name);
                ExitCode::SUCCESS
            }
        };
    }
    let budget = Budget {
        time: Duration::from_secs(args.seconds),
        max_inputs: args.max_inputs,
    };
    let mut failed = false;
    for target in &args.targets {
        let report = engine::fuzz(target, budget, Duration::from_secs(20));
        println!(
            "{:<20} {:>9} inputs ({} complete cases) in {:.1?}: {}",
            report.target,
            report.inputs,
            report.fitted,
            report.elapsed,
            if report.crash.is_some() {
                "CRASH"
            } else {
                "ok"
            }
        );
        if let Some(crash) = report.crash {
            failed = true;
            println!("  seed:    {:#018x}", crash.seed);
            println!(
                "  panic:   {}",
                crash.message.replace('\n', "\n           ")
            );
            println!(
                "  minimal: {} bytes: {}",
                crash.minimal.len(),
                hex(&crash.minimal)
            );
            println!(
                "  replay:  cargo xtask fuzz {} --seed {:#x}",
                target.name, crash.seed
            );
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

//! The driver: random inputs under a time and input budget, crash capture, seeds and shrinking.
//!
//! Why not `arbtest`'s own loop: it reports a failing seed only by printing it from a panic
//! guard and cannot stop after a number of inputs or say how many it tried, and a run here must
//! report both per target. The scheme is the same: a seed is a `u64` whose low 32 bits are the
//! input length and whose high 32 bits seed the byte generator, so `--seed` regenerates exactly
//! the input that failed, and the input is then shrunk to a minimal one for a regression test.
//!
//! A crash is a panic of the property (an assertion or a bug in the decoder) or a panic on any
//! thread while the property ran (a spawned server task whose panic the runtime would swallow).

use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, Once};
use std::time::{Duration, Instant};

use arbitrary::Unstructured;

/// One fuzz target.
#[derive(Clone, Copy)]
pub struct Target {
    /// The name `cargo xtask fuzz TARGET` takes.
    pub name: &'static str,
    /// What the target feeds and what it asserts (docs/fuzzing.md lists the same).
    pub checks: &'static str,
    /// The property; `Err` means the input did not fit (too short), not a failure.
    pub property: fn(&mut Unstructured<'_>) -> arbitrary::Result<()>,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target").field("name", &self.name).finish()
    }
}

/// How long a target runs: until `time` passes or `max_inputs` inputs were tried.
#[derive(Clone, Copy, Debug)]
pub struct Budget {
    pub time: Duration,
    pub max_inputs: u64,
}

impl Budget {
    pub fn seconds(seconds: u64) -> Budget {
        Budget {
            time: Duration::from_secs(seconds),
            max_inputs: u64::MAX,
        }
    }
}

/// A failing input.
#[derive(Clone, Debug)]
pub struct Crash {
    /// Regenerates the original failing input ([`input_of`]).
    pub seed: u64,
    /// The panic message and location.
    pub message: String,
    /// The smallest input found that still fails.
    pub minimal: Vec<u8>,
}

/// The outcome of one run.
#[derive(Clone, Debug)]
pub struct Report {
    pub target: &'static str,
    /// Inputs tried.
    pub inputs: u64,
    /// Inputs long enough to build a complete case.
    pub fitted: u64,
    pub elapsed: Duration,
    pub crash: Option<Crash>,
}

/// The largest input generated.
const MAX_LEN: u32 = 64 * 1024;

static HOOK: Once = Once::new();
static PANICS: AtomicU64 = AtomicU64::new(0);
static LAST_PANIC: Mutex<Option<String>> = Mutex::new(None);

/// Replaces the default panic output with a record of the last panic (any thread).
fn install_hook() {
    HOOK.call_once(|| {
        panic::set_hook(Box::new(|info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            *LAST_PANIC.lock().unwrap_or_else(|e| e.into_inner()) = Some(info.to_string());
        }));
    });
}

/// The bytes seed `seed` stands for: `seed & 0xffff_ffff` bytes of a SplitMix64 stream.
pub fn input_of(seed: u64) -> Vec<u8> {
    let len = (seed & 0xffff_ffff) as usize;
    let mut state = seed;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// A fresh seed: lengths spread over every power of two up to [`MAX_LEN`], most of them small.
fn fresh_seed() -> u64 {
    let r: u64 = rand::random();
    let exp = (r % 17) as u32;
    let len = ((r >> 8) as u32 % (1u32 << exp)).min(MAX_LEN);
    (r & 0xffff_ffff_0000_0000) | u64::from(len)
}

/// What running the property on one input did.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The property held.
    Held,
    /// The input was too short for a complete case.
    Unfit,
    /// A panic, with its message.
    Crashed(String),
}

/// Runs `target` once on `data`.
pub fn check(target: &Target, data: &[u8]) -> Outcome {
    install_hook();
    let before = PANICS.load(Ordering::SeqCst);
    let result = panic::catch_unwind(AssertUnwindSafe(|| {
        let mut u = Unstructured::new(data);
        (target.property)(&mut u)
    }));
    let last = || {
        LAST_PANIC
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .unwrap_or_else(|| "panic".into())
    };
    match result {
        Err(_) => Outcome::Crashed(last()),
        Ok(_) if PANICS.load(Ordering::SeqCst) != before => {
            Outcome::Crashed(format!("a spawned task panicked: {}", last()))
        }
        Ok(Ok(())) => Outcome::Held,
        Ok(Err(_)) => Outcome::Unfit,
    }
}

/// Runs `target` on fresh random inputs until the budget is spent or an input crashes; a
/// crashing input is shrunk (for at most `shrink_time`).
pub fn fuzz(target: &Target, budget: Budget, shrink_time: Duration) -> Report {
    let started = Instant::now();
    let mut report = Report {
        target: target.name,
        inputs: 0,
        fitted: 0,
        elapsed: Duration::ZERO,
        crash: None,
    };
    while report.inputs < budget.max_inputs && started.elapsed() < budget.time {
        let seed = fresh_seed();
        let data = input_of(seed);
        report.inputs += 1;
        match check(target, &data) {
            Outcome::Held => report.fitted += 1,
            Outcome::Unfit => {}
            Outcome::Crashed(message) => {
                let minimal = shrink(target, data, shrink_time);
                report.crash = Some(Crash {
                    seed,
                    message,
                    minimal,
                });
                break;
            }
        }
    }
    report.elapsed = started.elapsed();
    report
}

/// Replays the input of `seed`.
pub fn replay(target: &Target, seed: u64) -> Outcome {
    check(target, &input_of(seed))
}

/// Shrinks a crashing input: drops ever smaller chunks, then lowers bytes, keeping every step
/// that still crashes.
pub fn shrink(target: &Target, mut data: Vec<u8>, time: Duration) -> Vec<u8> {
    let started = Instant::now();
    let crashes = |d: &[u8]| matches!(check(target, d), Outcome::Crashed(_));
    let mut chunk = data.len().div_ceil(2).max(1);
    while chunk >= 1 && started.elapsed() < time {
        let mut at = 0;
        while at < data.len() && started.elapsed() < time {
            let end = (at + chunk).min(data.len());
            let candidate: Vec<u8> = data[..at].iter().chain(&data[end..]).copied().collect();
            if crashes(&candidate) {
                data = candidate;
            } else {
                at += chunk;
            }
        }
        if chunk == 1 {
            break;
        }
        chunk /= 2;
    }
    for i in 0..data.len() {
        if started.elapsed() >= time {
            break;
        }
        for lower in [0u8, data[i] / 2] {
            if lower < data[i] {
                let mut candidate = data.clone();
                candidate[i] = lower;
                if crashes(&candidate) {
                    data = candidate;
                    break;
                }
            }
        }
    }
    data
}

#[cfg(test)]
mod tests {
    use super::*;

    fn even(u: &mut Unstructured<'_>) -> arbitrary::Result<()> {
        let n = u.bytes(1)?[0];
        assert!(n < 200, "found {n}");
        Ok(())
    }

    const PICKY: Target = Target {
        name: "picky",
        checks: "fails on a byte of 200 or more",
        property: even,
    };

    #[test]
    fn seeds_regenerate_their_input() {
        let seed = 0x1234_5678_0000_0040;
        assert_eq!(input_of(seed).len(), 0x40);
        assert_eq!(input_of(seed), input_of(seed));
        assert_ne!(input_of(seed), input_of(seed + (1 << 32)));
    }

    #[test]
    fn a_crash_is_found_reported_with_its_seed_and_shrunk() {
        let report = fuzz(&PICKY, Budget::seconds(10), Duration::from_secs(5));
        let crash = report.crash.expect("a byte >= 200 is found quickly");
        assert!(crash.message.contains("found"), "{}", crash.message);
        assert!(matches!(replay(&PICKY, crash.seed), Outcome::Crashed(_)));
        assert_eq!(
            crash.minimal.len(),
            1,
            "shrunk to the one byte that matters"
        );
        assert!(crash.minimal[0] >= 200);
        assert_eq!(check(&PICKY, &[3]), Outcome::Held);
        assert_eq!(check(&PICKY, &[]), Outcome::Unfit);
    }

    #[test]
    fn the_input_budget_is_honoured() {
        const NEVER: Target = Target {
            name: "never",
            checks: "",
            property: |_| Ok(()),
        };
        let report = fuzz(
            &NEVER,
            Budget {
                time: Duration::from_secs(60),
                max_inputs: 500,
            },
            Duration::ZERO,
        );
        assert_eq!((report.inputs, report.fitted), (500, 500));
        assert!(report.crash.is_none());
    }
}

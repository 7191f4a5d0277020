//! The provider's CPU time and memory from `/proc/<pid>/stat` and `/proc/<pid>/status`
//! (proc(5)), plus a description of this machine for the report.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{Context, Result, bail};

/// User plus system CPU time of every thread of the process, in clock ticks.
pub(crate) fn parse_stat_cpu_ticks(stat: &str) -> Result<u64> {
    // `pid (comm) state ppid ...`: comm may hold spaces and parentheses, so the fields
    // start after the last ')'. utime and stime are fields 14 and 15, i.e. the 12th and
    // 13th after the ')', since the first one after it is field 3 (state).
    let after = stat
        .rfind(')')
        .map(|i| &stat[i + 1..])
        .context("no ')' in /proc/<pid>/stat")?;
    let fields: Vec<&str> = after.split_whitespace().collect();
    if fields.len() < 13 {
        bail!(
            "/proc/<pid>/stat has {} fields after comm, want at least 13",
            fields.len()
        );
    }
    let utime: u64 = fields[11].parse().context("utime")?;
    let stime: u64 = fields[12].parse().context("stime")?;
    Ok(utime + stime)
}

/// The time a thread has run, in nanoseconds: the first field of
/// /proc/<pid>/task/<tid>/schedstat.
pub(crate) fn parse_schedstat_ns(text: &str) -> Option<u64> {
    text.split_whitespace().next()?.parse().ok()
}

/// A process's CPU time at one instant, in two resolutions.
#[derive(Clone, Debug, Default)]
pub(crate) struct CpuSample {
    total: Duration,
    tick: Duration,
    threads: HashMap<u32, u64>,
}

impl CpuSample {
    /// CPU time used between `before` and `self`. The per-thread figures are exact but miss
    /// what threads that ended meanwhile used in the window; the process total misses nothing
    /// but moves in clock ticks. The exact sum is taken unless the total shows, beyond its
    /// rounding, that more was used.
    pub(crate) fn since(&self, before: &CpuSample) -> Duration {
        let exact: u64 = self
            .threads
            .iter()
            .map(|(tid, ns)| ns.saturating_sub(before.threads.get(tid).copied().unwrap_or(0)))
            .sum();
        let exact = Duration::from_nanos(exact);
        let coarse = self.total.saturating_sub(before.total);
        if self.threads.is_empty() || coarse > exact + 2 * self.tick {
            coarse
        } else {
            exact
        }
    }
}

/// Resident memory figures, in KiB.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Memory {
    /// Peak resident set size (VmHWM).
    pub peak_kib: u64,
    /// Current resident set size (VmRSS).
    pub rss_kib: u64,
}

impl Memory {
    pub(crate) fn peak_mib(self) -> f64 {
        self.peak_kib as f64 / 1024.0
    }

    pub(crate) fn rss_mib(self) -> f64 {
        self.rss_kib as f64 / 1024.0
    }
}

pub(crate) fn parse_status_memory(status: &str) -> Result<Memory> {
    let field = |name: &str| -> Result<u64> {
        let line = status
            .lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
            .with_context(|| format!("no {name} in /proc/<pid>/status"))?;
        let kib = line.trim().trim_end_matches("kB").trim();
        kib.parse()
            .with_context(|| format!("{name}: {kib:?} is not a number of kB"))
    };
    Ok(Memory {
        peak_kib: field("VmHWM")?,
        rss_kib: field("VmRSS")?,
    })
}

/// A process watched through /proc.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Process {
    pub pid: u32,
    tick: Duration,
}

impl Process {
    pub(crate) fn new(pid: u32) -> Process {
        Process {
            pid,
            tick: clock_tick(),
        }
    }

    /// CPU time used so far: the process total from /proc/<pid>/stat (clock ticks, normally
    /// 10 ms, but including threads that have exited) and each live thread's nanosecond
    /// figure from /proc/<pid>/task/<tid>/schedstat.
    pub(crate) fn cpu(&self) -> Result<CpuSample> {
        let path = format!("/proc/{}/stat", self.pid);
        let text = std::fs::read_to_string(&path).with_context(|| format!("read {path}"))?;
        let ticks = parse_stat_cpu_ticks(&text)?;
        let mut threads = HashMap::new();
        if let Ok(tasks) = std::fs::read_dir(format!("/proc/{}/task", self.pid)) {
            for task in tasks.flatten() {
                let Some(tid) = task
                    .file_name()
                    .to_str()
                    .and_then(|t| t.parse::<u32>().ok())
                else {
                    continue;
                };
                // A thread may end between the listing and the read: it is simply not counted.
                if let Ok(text) = std::fs::read_to_string(task.path().join("schedstat"))
                    && let Some(ns) = parse_schedstat_ns(&text)
                {
                    threads.insert(tid, ns);
                }
            }
        }
        Ok(CpuSample {
            total: self.tick * u32::try_from(ticks).unwrap_or(u32::MAX),
            tick: self.tick,
            threads,
        })
    }

    pub(crate) fn memory(&self) -> Result<Memory> {
        let path = format!("/proc/{}/status", self.pid);
        let text = std::fs::read_to_string(&path).with_context(|| format!("read {path}"))?;
        parse_status_memory(&text)
    }
}

/// The length of one clock tick (`getconf CLK_TCK`; Linux exposes 100 Hz to user space on
/// every architecture, which is the fallback).
fn clock_tick() -> Duration {
    let hz = std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .and_then(|s| s.trim().parse::<u32>().ok())
        .filter(|&hz| hz > 0)
        .unwrap_or(100);
    Duration::from_secs(1) / hz
}

/// The 1-minute load average from /proc/loadavg text.
pub(crate) fn parse_load1(loadavg: &str) -> Option<f64> {
    loadavg.split_whitespace().next()?.parse().ok()
}

/// The 1-minute load average now: other work on this machine competes with the runs.
pub(crate) fn load1() -> Option<f64> {
    parse_load1(&std::fs::read_to_string("/proc/loadavg").ok()?)
}

/// `model name` from /proc/cpuinfo text.
pub(crate) fn parse_cpu_model(cpuinfo: &str) -> Option<String> {
    cpuinfo.lines().find_map(|line| {
        let (key, value) = line.split_once(':')?;
        (key.trim() == "model name").then(|| value.trim().to_owned())
    })
}

/// The machine the bench runs on, for the report.
#[derive(Clone, Debug)]
pub struct Machine {
    pub cpus: usize,
    pub cpu_model: String,
    pub kernel: String,
    pub memory_mib: u64,
}

impl Machine {
    pub fn describe() -> Machine {
        let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
        let memory_kib = read("/proc/meminfo")
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap_or(0);
        Machine {
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cpu_model: parse_cpu_model(&read("/proc/cpuinfo")).unwrap_or_else(|| "unknown".into()),
            kernel: read("/proc/sys/kernel/osrelease").trim().to_owned(),
            memory_mib: memory_kib / 1024,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAT: &str = "4242 (tokio (rt) x) S 1 4242 4242 0 -1 4194560 3101 0 0 0 \
                        157 42 0 0 20 0 5 0 123456 1234567 890 18446744073709551615";

    #[test]
    fn stat_cpu_ticks_skip_a_tricky_comm() {
        assert_eq!(parse_stat_cpu_ticks(STAT).unwrap(), 199);
        assert!(parse_stat_cpu_ticks("1 (x) S 1 2").is_err());
        assert!(parse_stat_cpu_ticks("no paren").is_err());
    }

    #[test]
    fn status_memory() {
        let status = "Name:\thetzner\nVmPeak:\t  900000 kB\nVmHWM:\t   20480 kB\n\
                      VmRSS:\t   10240 kB\nThreads:\t3\n";
        let m = parse_status_memory(status).unwrap();
        assert_eq!(
            m,
            Memory {
                peak_kib: 20480,
                rss_kib: 10240
            }
        );
        assert_eq!(m.peak_mib(), 20.0);
        assert_eq!(m.rss_mib(), 10.0);
        assert!(parse_status_memory("VmRSS: 1 kB\n").is_err());
        assert!(parse_status_memory("VmHWM: x kB\nVmRSS: 1 kB\n").is_err());
    }

    #[test]
    fn schedstat_and_cpu_deltas() {
        assert_eq!(parse_schedstat_ns("632819 90333 2\n"), Some(632_819));
        assert_eq!(parse_schedstat_ns(""), None);
        let tick = Duration::from_millis(10);
        let sample = |total_ms: u64, threads: &[(u32, u64)]| CpuSample {
            total: Duration::from_millis(total_ms),
            tick,
            threads: threads.iter().copied().collect(),
        };
        let before = sample(100, &[(1, 50_000_000), (2, 50_000_000)]);
        // Thread 2 ended, thread 3 started: 1 ms + 2 ms exactly.
        let after = sample(100, &[(1, 51_000_000), (3, 2_000_000)]);
        assert_eq!(after.since(&before), Duration::from_millis(3));
        // The total moved by much more than the exact sum plus rounding: a thread that ended
        // used it, so the total wins.
        let after = sample(200, &[(1, 51_000_000)]);
        assert_eq!(after.since(&before), Duration::from_millis(100));
        // Without per-thread figures the total is all there is.
        assert_eq!(
            sample(130, &[]).since(&sample(100, &[])),
            Duration::from_millis(30)
        );
    }

    #[test]
    fn load_average() {
        assert_eq!(parse_load1("4.25 4.36 3.98 5/153 30901\n"), Some(4.25));
        assert_eq!(parse_load1(""), None);
    }

    #[test]
    fn cpu_model() {
        let text =
            "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Processor\n";
        assert_eq!(
            parse_cpu_model(text).as_deref(),
            Some("Intel(R) Xeon(R) Processor")
        );
        assert_eq!(parse_cpu_model("processor: 0\n"), None);
    }

    #[test]
    fn reads_this_process() {
        let me = Process::new(std::process::id());
        assert!(me.memory().unwrap().peak_kib > 0);
        me.cpu().unwrap();
    }
}

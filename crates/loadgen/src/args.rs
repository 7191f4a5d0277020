//! The command line of `bigfleet-loadgen` and `cargo xtask bench`, parsed into [`Options`]
//! before anything starts.
//! Pure: no I/O, so every rule here has a unit test.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};

pub const USAGE: &str = "\
usage: bigfleet-loadgen (--spawn 'CMD ...' | --target HOST:PORT) [options]
       cargo xtask bench (--spawn 'CMD ...' | --target HOST:PORT) [options]
       cargo xtask bench --scenario cloud-budget [--cloud NAME[,NAME]] [--hosts N,N,...]
                         [--runs KIND[,KIND]] [--providers DIR] [--json] [--json-out PATH]

A load generator for any bigfleet.v1alpha1.CapacityProvider endpoint on loopback; and, with
--scenario cloud-budget (cargo xtask bench only: it needs the repository), a count of the
cloud API requests the providers' real backends send.

Endpoint (exactly one):
  --spawn 'CMD ...'       start the provider: the tool appends `--addr 127.0.0.1:<free port>`
                          and `--seed-count <N>` unless the command has them, `--state <tmp>`
                          for the durable, mixed and restart runs, and waits for health SERVING.
                          Pass `--metrics-addr=` (or a loopback address) to keep the provider's
                          metrics port off other interfaces.
  --target HOST:PORT      an already running provider (loopback addresses only)
  --target-pid PID        with --target: the provider's pid, for CPU and RSS from /proc
  --tls-ca PEM            connect with TLS trusting this CA (also for --spawn)
  --tls-cert PEM --tls-key PEM
                          present this client certificate (mTLS)
  --tls-domain NAME       the server name to verify (default localhost)
  --compare 'OTHER CMD'   with --spawn: run every scenario against this command too,
                          alternating runs, and print ratios ours/theirs
  --no-floor              with --spawn, the get scenario runs against the floor too (a
                          minimal server of the same service answering pre-encoded
                          machines, same runtime and HTTP/2 settings) and prints ratios
                          ours/floor; this skips it (it is skipped with TLS)

Scenarios and sizes:
  --scenario NAME[,NAME]  get, list, list-filtered, lifecycle, durable, startup, mixed, etcd,
                          takeover (kill -9 of the leader of two replicas on etcd to the
                          first acknowledged Create on the standby; --spawn only),
                          or all (default all; durable, startup and etcd need --spawn; etcd
                          starts an etcd member, Debian's etcd-server)
  --scenario cloud-budget the cloud API requests of the `hetzner` and `digitalocean` binaries
                          on their real backends, each against its cloud's emulator with the
                          real rate limit and boot times: per Create, Configure, Drain and
                          Delete of one machine (over the emulator's sshd, or a real
                          bigfleet-agent), bursts of 50 Creates from a full and from an empty
                          bucket, and reconcile requests per hour with owned hosts (time-scaled
                          where the binary can follow); it builds the release binaries and
                          starts everything itself (no --spawn or --target), runs alone and
                          takes a few minutes; not part of `all`
  --cloud NAME[,NAME]     with cloud-budget: hetzner, digitalocean (default both)
  --hosts N,N,...         with cloud-budget: owned hosts of the steady-state runs
                          (default 100,1000,10000)
  --runs KIND[,KIND]      with cloud-budget: walk, burst, steady, crowded, storm (50 Creates
                          with and without a 10 s 429 storm: their latency, p50 and p99),
                          soldout (a sold-out offering under Creates for an hour of
                          backoffs scaled 100x: its requests per hour); default all
  --providers DIR         with cloud-budget: take the `hetzner` and `digitalocean` binaries
                          from DIR instead of building them (a release to compare with)
  --repeats N             runs per figure, reported as median and min-max (default 3)
  --seeds N,N,...         inventories for list, list-filtered, lifecycle, durable, etcd and startup
                          (default 1000,10000,100000)
  --inventory N           inventory for get and mixed (default 10000)
  --concurrency N,N       Get concurrencies of the get scenario (default 1,32)
  --machines K            machines walked by lifecycle, durable and etcd (default 256)
  --in-flight N           machines in flight during walks (default 32)
  --duration D            measured window of the timed loops (default 5s)
  --warmup D              warm-up before every measured window (default 1s)
  --timeout D             upper bound for any one walk or list series (default 120s)
  --client-threads N      client runtime threads; 1 is a current-thread runtime (default 1)
  --quick                 a few seconds in all: repeats 1, seeds 1000, inventory 1000,
                          machines 64, warm-up 200ms, window 1s (later flags still apply)
  --json                  print the results as JSON instead of tables
  --json-out PATH         also write the JSON to PATH
  -h, --help              this text

Durations take 500ms, 5s, 2m or plain seconds.";

/// A scenario of the benchmark (beyond.md section 10).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Scenario {
    Get,
    List,
    ListFiltered,
    Lifecycle,
    Durable,
    Startup,
    Mixed,
    Etcd,
    Takeover,
}

impl Scenario {
    pub const ALL: [Scenario; 9] = [
        Scenario::Get,
        Scenario::List,
        Scenario::ListFiltered,
        Scenario::Lifecycle,
        Scenario::Durable,
        Scenario::Startup,
        Scenario::Mixed,
        Scenario::Etcd,
        Scenario::Takeover,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Scenario::Get => "get",
            Scenario::List => "list",
            Scenario::ListFiltered => "list-filtered",
            Scenario::Lifecycle => "lifecycle",
            Scenario::Durable => "durable",
            Scenario::Startup => "startup",
            Scenario::Mixed => "mixed",
            Scenario::Etcd => "etcd",
            Scenario::Takeover => "takeover",
        }
    }

    fn parse(text: &str) -> Result<Scenario> {
        Scenario::ALL
            .into_iter()
            .find(|s| s.name() == text)
            .with_context(|| format!("unknown scenario {text:?}"))
    }

    /// Whether the scenario needs to start the provider itself.
    pub fn needs_spawn(self) -> bool {
        matches!(
            self,
            Scenario::Durable | Scenario::Startup | Scenario::Etcd | Scenario::Takeover
        )
    }

    /// Whether its inventory is `--inventory` (one size) rather than every `--seeds` size.
    pub fn uses_inventory(self) -> bool {
        matches!(self, Scenario::Get | Scenario::Mixed)
    }

    /// Whether its spawned provider runs with `--state`.
    pub fn durable(self) -> bool {
        matches!(self, Scenario::Durable | Scenario::Mixed)
    }
}

/// Client-side TLS material.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tls {
    pub ca: PathBuf,
    pub identity: Option<(PathBuf, PathBuf)>,
    pub domain: String,
}

/// Which provider the load goes to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// A running provider; `pid` enables /proc figures.
    Target { addr: SocketAddr, pid: Option<u32> },
    /// A command line to start (program first), and optionally a second one to compare with.
    Spawn {
        ours: Vec<String>,
        theirs: Option<Vec<String>>,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    pub endpoint: Endpoint,
    pub tls: Option<Tls>,
    pub scenarios: Vec<Scenario>,
    pub repeats: usize,
    pub seeds: Vec<usize>,
    pub inventory: usize,
    pub concurrency: Vec<usize>,
    pub machines: usize,
    pub in_flight: usize,
    pub duration: Duration,
    pub warmup: Duration,
    pub timeout: Duration,
    pub client_threads: usize,
    pub quick: bool,
    pub json: bool,
    pub json_out: Option<PathBuf>,
    /// Whether the get scenario also runs against the floor (`--spawn` without TLS).
    pub floor: bool,
}

/// What the command line asked for: options, or the usage text.
#[derive(Debug, PartialEq)]
pub enum Parsed {
    Run(Box<Options>),
    /// `--scenario cloud-budget`, which starts its own emulators and providers.
    CloudBudget(CloudBudget),
    Help,
}

/// The name of the scenario that counts cloud API requests ([`CloudBudget`]).
pub const CLOUD_BUDGET: &str = "cloud-budget";

/// What `--scenario cloud-budget` runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CloudBudget {
    pub clouds: Vec<Cloud>,
    /// Owned hosts of the steady-state runs, in order.
    pub hosts: Vec<usize>,
    /// The kinds of run (`walk`, `burst`, `steady`, `crowded`, `storm`); empty: all.
    pub runs: Vec<String>,
    /// Where the provider binaries are, instead of building them.
    pub providers: Option<PathBuf>,
    pub json: bool,
    pub json_out: Option<PathBuf>,
}

/// The kinds of run `--runs` names.
pub const CLOUD_BUDGET_RUNS: [&str; 6] = ["walk", "burst", "steady", "crowded", "storm", "soldout"];

impl CloudBudget {
    /// Whether runs of `kind` are part of this report.
    pub fn runs(&self, kind: &str) -> bool {
        self.runs.is_empty() || self.runs.iter().any(|r| r == kind)
    }
}

/// The flags `--scenario cloud-budget` takes besides `--scenario`.
const CLOUD_BUDGET_FLAGS: [&str; 6] = [
    "--cloud",
    "--hosts",
    "--runs",
    "--providers",
    "--json",
    "--json-out",
];

/// The default owned-host counts of the cloud-budget steady state.
const CLOUD_BUDGET_HOSTS: [usize; 3] = [100, 1000, 10_000];
/// The most owned hosts a steady-state run inserts into an emulator.
const MAX_OWNED_HOSTS: usize = 100_000;

/// A cloud whose real backend `cloud-budget` measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Cloud {
    Hetzner,
    DigitalOcean,
}

impl Cloud {
    pub const ALL: [Cloud; 2] = [Cloud::Hetzner, Cloud::DigitalOcean];

    /// The name of the cloud and of its provider binary.
    pub fn name(self) -> &'static str {
        match self {
            Cloud::Hetzner => "hetzner",
            Cloud::DigitalOcean => "digitalocean",
        }
    }

    fn parse(text: &str) -> Result<Cloud> {
        Cloud::ALL
            .into_iter()
            .find(|c| c.name() == text)
            .with_context(|| format!("--cloud: unknown cloud {text:?} (hetzner, digitalocean)"))
    }
}

/// Hard upper bounds, so a typo cannot start a run that never ends.
const MAX_REPEATS: usize = 50;
const MAX_SEEDS: usize = 10_000_000;
const MAX_MACHINES: usize = 1_000_000;
const MAX_IN_FLIGHT: usize = 4096;
const MAX_WINDOW: Duration = Duration::from_secs(3600);

pub fn parse(args: &[String]) -> Result<Parsed> {
    let mut target = None;
    let mut target_pid = None;
    let mut spawn = None;
    let mut compare = None;
    let mut tls_ca = None;
    let mut tls_cert = None;
    let mut tls_key = None;
    let mut tls_domain = None;
    let mut scenarios = None;
    let mut named_spawn_only = None;
    let mut repeats = None;
    let mut seeds = None;
    let mut inventory = None;
    let mut concurrency = None;
    let mut machines = None;
    let mut in_flight = None;
    let mut duration = None;
    let mut warmup = None;
    let mut timeout = None;
    let mut client_threads = None;
    let mut quick = false;
    let mut json = false;
    let mut json_out = None;
    let mut no_floor = false;
    let mut cloud_budget = false;
    let mut clouds = None;
    let mut hosts = None;
    let mut runs = Vec::new();
    let mut providers = None;
    // Every flag given, for the ones `cloud-budget` does not take.
    let mut given: Vec<String> = Vec::new();

    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        let (name, inline) = match arg.split_once('=') {
            Some((name, value)) if name.starts_with("--") => (name, Some(value.to_owned())),
            _ => (arg.as_str(), None),
        };
        let mut value = || -> Result<String> {
            match &inline {
                Some(value) => Ok(value.clone()),
                None => rest
                    .next()
                    .cloned()
                    .with_context(|| format!("{name} needs a value")),
            }
        };
        given.push(name.to_owned());
        match name {
            "-h" | "--help" => return Ok(Parsed::Help),
            "--quick" | "--json" | "--no-floor" => {
                ensure!(inline.is_none(), "{name} takes no value");
                match name {
                    "--quick" => quick = true,
                    "--json" => json = true,
                    _ => no_floor = true,
                }
            }
            "--target" => target = Some(loopback_addr(&value()?)?),
            "--target-pid" => {
                target_pid = Some(u32::try_from(number(
                    name,
                    &value()?,
                    1,
                    u32::MAX as usize,
                )?)?)
            }
            "--spawn" => spawn = Some(command_line(name, &value()?)?),
            "--compare" => compare = Some(command_line(name, &value()?)?),
            "--tls-ca" => tls_ca = Some(PathBuf::from(value()?)),
            "--tls-cert" => tls_cert = Some(PathBuf::from(value()?)),
            "--tls-key" => tls_key = Some(PathBuf::from(value()?)),
            "--tls-domain" => tls_domain = Some(value()?),
            "--json-out" => json_out = Some(PathBuf::from(value()?)),
            "--scenario" => {
                let text = value()?;
                if text
                    .split(',')
                    .map(str::trim)
                    .any(|part| part == CLOUD_BUDGET)
                {
                    ensure!(
                        text.trim() == CLOUD_BUDGET,
                        "--scenario {text}: {CLOUD_BUDGET} runs alone (it starts its own \
                         emulators and providers)"
                    );
                    cloud_budget = true;
                    continue;
                }
                named_spawn_only = text
                    .split(',')
                    .map(str::trim)
                    .find(|part| Scenario::parse(part).is_ok_and(Scenario::needs_spawn))
                    .map(str::to_owned);
                scenarios = Some(scenario_list(&text)?);
            }
            "--repeats" => repeats = Some(number(name, &value()?, 1, MAX_REPEATS)?),
            "--seeds" => seeds = Some(size_list(name, &value()?)?),
            "--inventory" => inventory = Some(number(name, &value()?, 1, MAX_SEEDS)?),
            "--concurrency" => {
                let list = value()?
                    .split(',')
                    .map(|part| number(name, part, 1, MAX_IN_FLIGHT))
                    .collect::<Result<Vec<_>>>()?;
                concurrency = Some(list);
            }
            "--machines" => machines = Some(number(name, &value()?, 1, MAX_MACHINES)?),
            "--in-flight" => in_flight = Some(number(name, &value()?, 1, MAX_IN_FLIGHT)?),
            "--duration" => duration = Some(window(name, &value()?)?),
            "--warmup" => warmup = Some(window(name, &value()?)?),
            "--timeout" => timeout = Some(window(name, &value()?)?),
            "--client-threads" => client_threads = Some(number(name, &value()?, 1, 64)?),
            "--cloud" => {
                let mut list = value()?
                    .split(',')
                    .map(|part| Cloud::parse(part.trim()))
                    .collect::<Result<Vec<_>>>()?;
                list.sort();
                list.dedup();
                clouds = Some(list);
            }
            "--hosts" => {
                let list = value()?
                    .split(',')
                    .map(|part| number(name, part, 1, MAX_OWNED_HOSTS))
                    .collect::<Result<Vec<_>>>()?;
                hosts = Some(list);
            }
            "--runs" => {
                for part in value()?.split(',').map(str::trim) {
                    ensure!(
                        CLOUD_BUDGET_RUNS.contains(&part),
                        "--runs: unknown kind {part:?} ({})",
                        CLOUD_BUDGET_RUNS.join(", ")
                    );
                    runs.push(part.to_owned());
                }
            }
            "--providers" => providers = Some(PathBuf::from(value()?)),
            _ => bail!("unknown argument {arg:?}\n\n{USAGE}"),
        }
    }

    if cloud_budget {
        ensure!(
            scenarios.is_none(),
            "--scenario {CLOUD_BUDGET} runs alone (it starts its own emulators and providers)"
        );
        if let Some(flag) = given
            .iter()
            .find(|f| *f != "--scenario" && !CLOUD_BUDGET_FLAGS.contains(&f.as_str()))
        {
            bail!(
                "{flag} does not apply to --scenario {CLOUD_BUDGET}: it starts its own emulators \
                 and providers, and takes only {}",
                CLOUD_BUDGET_FLAGS.join(", ")
            );
        }
        return Ok(Parsed::CloudBudget(CloudBudget {
            clouds: clouds.unwrap_or_else(|| Cloud::ALL.to_vec()),
            hosts: hosts.unwrap_or_else(|| CLOUD_BUDGET_HOSTS.to_vec()),
            runs,
            providers,
            json,
            json_out,
        }));
    }
    if let Some(flag) = ["--cloud", "--hosts", "--runs", "--providers"]
        .into_iter()
        .find(|flag| given.iter().any(|g| g == flag))
    {
        bail!("{flag} goes with --scenario {CLOUD_BUDGET}");
    }

    let endpoint = match (target, spawn) {
        (Some(_), Some(_)) => bail!("give either --target or --spawn, not both"),
        (None, None) => bail!("give --target HOST:PORT or --spawn 'CMD ...'\n\n{USAGE}"),
        (Some(addr), None) => {
            ensure!(
                compare.is_none(),
                "--compare needs --spawn (it starts both providers)"
            );
            Endpoint::Target {
                addr,
                pid: target_pid,
            }
        }
        (None, Some(ours)) => {
            ensure!(target_pid.is_none(), "--target-pid goes with --target");
            Endpoint::Spawn {
                ours,
                theirs: compare,
            }
        }
    };
    let tls = match (tls_ca, tls_cert, tls_key) {
        (None, None, None) => {
            ensure!(tls_domain.is_none(), "--tls-domain needs --tls-ca");
            None
        }
        (Some(ca), cert, key) => {
            let identity = match (cert, key) {
                (Some(cert), Some(key)) => Some((cert, key)),
                (None, None) => None,
                _ => bail!("--tls-cert and --tls-key go together"),
            };
            Some(Tls {
                ca,
                identity,
                domain: tls_domain.unwrap_or_else(|| "localhost".to_owned()),
            })
        }
        (None, _, _) => bail!("--tls-cert and --tls-key need --tls-ca"),
    };
    let scenarios = scenarios.unwrap_or_else(|| Scenario::ALL.to_vec());
    // `all` silently leaves out what needs --spawn; naming one of those with --target is an error.
    if let (Endpoint::Target { .. }, Some(name)) = (&endpoint, named_spawn_only) {
        bail!("scenario {name} needs --spawn (it starts the provider itself)");
    }
    let scenarios = match endpoint {
        Endpoint::Target { .. } => scenarios.into_iter().filter(|s| !s.needs_spawn()).collect(),
        Endpoint::Spawn { .. } => scenarios,
    };

    let (d_repeats, d_seeds, d_inventory, d_machines, d_warmup, d_duration) = if quick {
        (
            1,
            vec![1000],
            1000,
            64,
            Duration::from_millis(200),
            Duration::from_secs(1),
        )
    } else {
        (
            3,
            vec![1000, 10_000, 100_000],
            10_000,
            256,
            Duration::from_secs(1),
            Duration::from_secs(5),
        )
    };
    let floor = !no_floor && tls.is_none() && matches!(endpoint, Endpoint::Spawn { .. });
    Ok(Parsed::Run(Box::new(Options {
        floor,
        endpoint,
        tls,
        scenarios,
        repeats: repeats.unwrap_or(d_repeats),
        seeds: seeds.unwrap_or(d_seeds),
        inventory: inventory.unwrap_or(d_inventory),
        concurrency: concurrency.unwrap_or_else(|| vec![1, 32]),
        machines: machines.unwrap_or(d_machines),
        in_flight: in_flight.unwrap_or(32),
        duration: duration.unwrap_or(d_duration),
        warmup: warmup.unwrap_or(d_warmup),
        timeout: timeout.unwrap_or(Duration::from_secs(120)),
        client_threads: client_threads.unwrap_or(1),
        quick,
        json,
        json_out,
    })))
}

fn number(name: &str, text: &str, min: usize, max: usize) -> Result<usize> {
    let n: usize = text
        .trim()
        .replace('_', "")
        .parse()
        .with_context(|| format!("{name}: {text:?} is not a whole number"))?;
    ensure!(
        (min..=max).contains(&n),
        "{name}: {n} is outside {min}..={max}"
    );
    Ok(n)
}

fn size_list(name: &str, text: &str) -> Result<Vec<usize>> {
    let sizes = text
        .split(',')
        .map(|part| number(name, part, 1, MAX_SEEDS))
        .collect::<Result<Vec<_>>>()?;
    ensure!(!sizes.is_empty(), "{name} needs at least one size");
    Ok(sizes)
}

fn scenario_list(text: &str) -> Result<Vec<Scenario>> {
    let mut scenarios = Vec::new();
    for part in text.split(',').map(str::trim) {
        if part == "all" {
            scenarios.extend(Scenario::ALL);
        } else {
            scenarios.push(Scenario::parse(part)?);
        }
    }
    scenarios.sort();
    scenarios.dedup();
    ensure!(!scenarios.is_empty(), "--scenario needs a name");
    Ok(scenarios)
}

/// `500ms`, `5s`, `2m`, or plain seconds (fractions allowed).
pub fn parse_duration(text: &str) -> Result<Duration> {
    let text = text.trim();
    let (number, unit) = if let Some(n) = text.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = text.strip_suffix('m') {
        (n, 60.0)
    } else {
        (text, 1.0)
    };
    let value: f64 = number
        .parse()
        .with_context(|| format!("{text:?} is not a duration (500ms, 5s, 2m)"))?;
    ensure!(
        value.is_finite() && value >= 0.0,
        "{text:?} is not a duration"
    );
    Ok(Duration::from_secs_f64(value * unit))
}

fn window(name: &str, text: &str) -> Result<Duration> {
    let d = parse_duration(text).with_context(|| name.to_owned())?;
    ensure!(
        d <= MAX_WINDOW,
        "{name}: {d:?} is longer than {MAX_WINDOW:?}"
    );
    Ok(d)
}

/// `HOST:PORT` where HOST is a loopback address or `localhost`: the tool never sends load
/// anywhere else.
pub fn loopback_addr(text: &str) -> Result<SocketAddr> {
    let (host, port) = text
        .rsplit_once(':')
        .with_context(|| format!("{text:?} is not HOST:PORT"))?;
    let port: u16 = port
        .parse()
        .with_context(|| format!("{text:?}: bad port"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let ip: IpAddr = if host == "localhost" {
        IpAddr::V4(Ipv4Addr::LOCALHOST)
    } else {
        host.parse()
            .with_context(|| format!("{text:?}: the host must be a loopback IP or localhost"))?
    };
    ensure!(
        ip.is_loopback(),
        "{text:?} is not a loopback address; the bench stays on this host"
    );
    ensure!(port != 0, "{text:?}: port 0");
    Ok(SocketAddr::new(ip, port))
}

fn command_line(name: &str, text: &str) -> Result<Vec<String>> {
    let words = split_words(text).with_context(|| name.to_owned())?;
    ensure!(!words.is_empty(), "{name} needs a command");
    Ok(words)
}

/// Splits a command line the way a POSIX shell splits words, for the subset a command line
/// needs here: blanks separate, single quotes keep everything, double quotes keep everything
/// but `\"` and `\\`, a backslash outside quotes escapes the next character. `--x=` stays one
/// word with an empty value.
pub fn split_words(text: &str) -> Result<Vec<String>> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        match c {
            c if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            '\'' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(c) => word.push(c),
                        None => bail!("unclosed ' in {text:?}"),
                    }
                }
            }
            '"' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => match chars.next() {
                            Some(c @ ('"' | '\\')) => word.push(c),
                            Some(c) => {
                                word.push('\\');
                                word.push(c);
                            }
                            None => bail!("unclosed \" in {text:?}"),
                        },
                        Some(c) => word.push(c),
                        None => bail!("unclosed \" in {text:?}"),
                    }
                }
            }
            '\\' => {
                in_word = true;
                match chars.next() {
                    Some(c) => word.push(c),
                    None => bail!("trailing backslash in {text:?}"),
                }
            }
            c => {
                in_word = true;
                word.push(c);
            }
        }
    }
    if in_word {
        words.push(word);
    }
    Ok(words)
}

/// The value of `--flag VALUE` or `--flag=VALUE` in a command line, if present.
pub fn flag_value<'a>(command: &'a [String], flag: &str) -> Option<&'a str> {
    let mut words = command.iter();
    while let Some(word) = words.next() {
        if word == flag {
            return words.next().map(String::as_str);
        }
        if let Some(value) = word.strip_prefix(flag).and_then(|v| v.strip_prefix('=')) {
            return Some(value);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(text: &str) -> Vec<String> {
        split_words(text).unwrap()
    }

    fn options(text: &str) -> Options {
        match parse(&args(text)).unwrap() {
            Parsed::Run(options) => *options,
            other => panic!("unexpected {other:?}"),
        }
    }

    fn cloud_budget(text: &str) -> CloudBudget {
        match parse(&args(text)).unwrap() {
            Parsed::CloudBudget(options) => options,
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn cloud_budget_needs_no_endpoint_and_takes_its_own_flags() {
        assert_eq!(
            cloud_budget("--scenario cloud-budget"),
            CloudBudget {
                clouds: vec![Cloud::Hetzner, Cloud::DigitalOcean],
                hosts: vec![100, 1000, 10_000],
                runs: Vec::new(),
                providers: None,
                json: false,
                json_out: None,
            }
        );
        assert_eq!(
            cloud_budget(
                "--json --scenario=cloud-budget --cloud digitalocean,hetzner,hetzner \
                 --hosts 1_000,50 --json-out=r.json"
            ),
            CloudBudget {
                clouds: vec![Cloud::Hetzner, Cloud::DigitalOcean],
                hosts: vec![1000, 50],
                runs: Vec::new(),
                providers: None,
                json: true,
                json_out: Some(PathBuf::from("r.json")),
            }
        );
        assert_eq!(
            cloud_budget("--scenario cloud-budget --cloud digitalocean").clouds,
            [Cloud::DigitalOcean]
        );
        assert_eq!(
            parse(&args("--scenario cloud-budget --help")).unwrap(),
            Parsed::Help
        );
        // `all` stays the scenarios of a provider endpoint.
        assert!(!options("--spawn bin --scenario all").scenarios.is_empty());
        for bad in [
            "--scenario cloud-budget --spawn bin",
            "--scenario cloud-budget --target 127.0.0.1:9000",
            "--scenario cloud-budget,get",
            "--scenario all,cloud-budget",
            "--scenario cloud-budget --quick",
            "--scenario cloud-budget --repeats 2",
            "--scenario cloud-budget --seeds 100",
            "--scenario cloud-budget --cloud aws",
            "--scenario cloud-budget --hosts 0",
            "--scenario cloud-budget --hosts 1000001",
            "--scenario cloud-budget --json=1",
            "--scenario cloud-budget --scenario get",
            "--scenario get --scenario cloud-budget",
            "--spawn bin --hosts 100",
            "--spawn bin --cloud hetzner",
        ] {
            assert!(parse(&args(bad)).is_err(), "accepted {bad:?}");
        }
        let refused = parse(&args("--scenario cloud-budget --spawn bin"))
            .unwrap_err()
            .to_string();
        assert!(
            refused.contains("--spawn does not apply to --scenario cloud-budget"),
            "{refused}"
        );
        assert!(USAGE.contains("--scenario cloud-budget"));
    }

    #[test]
    fn splits_words_like_a_shell() {
        assert_eq!(
            split_words(
                "target/release/hetzner --use-fake-backend --fake-latency 0s --metrics-addr="
            )
            .unwrap(),
            [
                "target/release/hetzner",
                "--use-fake-backend",
                "--fake-latency",
                "0s",
                "--metrics-addr="
            ]
        );
        assert_eq!(
            split_words("  a  'b c' \"d \\\"e\\\"\" f\\ g ''").unwrap(),
            ["a", "b c", "d \"e\"", "f g", ""]
        );
        assert!(split_words("a 'b").is_err());
        assert!(split_words("a \"b").is_err());
        assert!(split_words("a\\").is_err());
        assert!(split_words("   ").unwrap().is_empty());
    }

    #[test]
    fn spawn_defaults() {
        let o = options("--spawn 'bin --use-fake-backend'");
        assert_eq!(
            o.endpoint,
            Endpoint::Spawn {
                ours: vec!["bin".into(), "--use-fake-backend".into()],
                theirs: None
            }
        );
        assert_eq!(o.scenarios, Scenario::ALL);
        assert_eq!(o.repeats, 3);
        assert_eq!(o.seeds, [1000, 10_000, 100_000]);
        assert_eq!(o.inventory, 10_000);
        assert_eq!(o.concurrency, [1, 32]);
        assert_eq!(o.machines, 256);
        assert_eq!(o.in_flight, 32);
        assert_eq!(o.duration, Duration::from_secs(5));
        assert_eq!(o.warmup, Duration::from_secs(1));
        assert_eq!(o.client_threads, 1);
        assert!(!o.json && !o.quick && o.tls.is_none() && o.json_out.is_none());
    }

    #[test]
    fn quick_then_explicit_flags() {
        let o = options("--spawn=bin --quick --repeats=2 --scenario get,list --json");
        assert_eq!(o.repeats, 2);
        assert_eq!(o.seeds, [1000]);
        assert_eq!(o.machines, 64);
        assert_eq!(o.duration, Duration::from_secs(1));
        assert_eq!(o.scenarios, [Scenario::Get, Scenario::List]);
        assert!(o.json && o.quick);
    }

    #[test]
    fn both_flag_forms_and_lists() {
        let o = options(
            "--spawn bin --compare 'go-bin -x' --seeds 1_000,5000 --machines=10 --duration 500ms \
             --warmup 0 --timeout 2m --scenario all,get --inventory 42 --in-flight 4 \
             --json-out=r.json",
        );
        assert_eq!(o.seeds, [1000, 5000]);
        assert_eq!(o.machines, 10);
        assert_eq!(o.in_flight, 4);
        assert_eq!(o.inventory, 42);
        assert_eq!(options("--spawn bin --concurrency 8").concurrency, [8]);
        assert_eq!(o.json_out, Some(PathBuf::from("r.json")));
        assert_eq!(o.duration, Duration::from_millis(500));
        assert_eq!(o.warmup, Duration::ZERO);
        assert_eq!(o.timeout, Duration::from_secs(120));
        assert_eq!(o.scenarios, Scenario::ALL);
        let Endpoint::Spawn { theirs, .. } = o.endpoint else {
            panic!()
        };
        assert_eq!(theirs.unwrap(), ["go-bin", "-x"]);
    }

    #[test]
    fn target_with_tls_leaves_out_spawn_scenarios() {
        let o = options(
            "--target localhost:9000 --target-pid 42 --tls-ca ca.pem --tls-cert c.pem --tls-key k.pem",
        );
        assert_eq!(
            o.endpoint,
            Endpoint::Target {
                addr: "127.0.0.1:9000".parse().unwrap(),
                pid: Some(42)
            }
        );
        let tls = o.tls.unwrap();
        assert_eq!(tls.domain, "localhost");
        assert_eq!(tls.identity, Some(("c.pem".into(), "k.pem".into())));
        assert!(!o.scenarios.iter().any(|s| s.needs_spawn()));
        assert_eq!(
            options("--target [::1]:1").endpoint,
            Endpoint::Target {
                addr: "[::1]:1".parse().unwrap(),
                pid: None
            }
        );
    }

    #[test]
    fn refusals() {
        for bad in [
            "",
            "--target 127.0.0.1:9000 --spawn bin",
            "--target 10.0.0.1:9000",
            "--target example.com:443",
            "--target 127.0.0.1:0",
            "--target 127.0.0.1:9000 --compare bin",
            "--target 127.0.0.1:9000 --scenario durable",
            "--spawn bin --target-pid 1",
            "--spawn bin --repeats 0",
            "--spawn bin --repeats x",
            "--spawn bin --seeds 10,",
            "--spawn bin --concurrency 0",
            "--spawn bin --scenario nope",
            "--spawn bin --duration 5h",
            "--spawn bin --duration -1s",
            "--spawn bin --tls-cert c.pem",
            "--spawn bin --tls-ca ca.pem --tls-key k.pem",
            "--spawn bin --tls-domain x",
            "--spawn ''",
            "--spawn bin --json=1",
            "--spawn bin --bogus",
            "--spawn",
        ] {
            assert!(parse(&args(bad)).is_err(), "accepted {bad:?}");
        }
        assert_eq!(parse(&args("--spawn bin -h")).unwrap(), Parsed::Help);
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("3").unwrap(), Duration::from_secs(3));
        assert!(parse_duration("soon").is_err());
    }

    #[test]
    fn flag_values_in_a_command_line() {
        let cmd = args("bin --addr 127.0.0.1:5 --seed-count=7 --metrics-addr=");
        assert_eq!(flag_value(&cmd, "--addr"), Some("127.0.0.1:5"));
        assert_eq!(flag_value(&cmd, "--seed-count"), Some("7"));
        assert_eq!(flag_value(&cmd, "--metrics-addr"), Some(""));
        assert_eq!(flag_value(&cmd, "--state"), None);
        assert_eq!(flag_value(&args("bin --addr"), "--addr"), None);
    }
}

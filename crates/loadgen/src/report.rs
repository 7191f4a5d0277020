//! Figures of single runs, their median and spread over repeats, and the two outputs: Markdown
//! tables for people and JSON for machines. With `--compare`, ratios ours/theirs.

use std::time::Duration;

use serde_json::{Value, json};

use super::args::Scenario;
use super::procfs::Machine;
use super::stats::{Samples, Spread, spread};

/// Figures that get a column of their own; everything else goes to the notes column.
pub(crate) const COUNT: &str = "n";
pub(crate) const P50: &str = "p50_ms";
pub(crate) const P99: &str = "p99_ms";
pub(crate) const P999: &str = "p999_ms";
pub(crate) const RATE: &str = "per_s";
pub(crate) const CPU: &str = "cpu_us_per_op";
pub(crate) const PEAK_RSS: &str = "peak_rss_mib";

const COLUMNS: [(&str, &str); 7] = [
    (COUNT, "n"),
    (P50, "p50 ms"),
    (P99, "p99 ms"),
    (P999, "p999 ms"),
    (RATE, "rate /s"),
    (CPU, "CPU us/op"),
    (PEAK_RSS, "peak RSS MiB"),
];

/// One line of figures from one run, e.g. "Get c=32".
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Row {
    pub label: String,
    pub figures: Vec<(&'static str, f64)>,
}

impl Row {
    pub(crate) fn new(label: impl Into<String>) -> Row {
        Row {
            label: label.into(),
            figures: Vec::new(),
        }
    }

    pub(crate) fn set(mut self, key: &'static str, value: f64) -> Row {
        self.figures.push((key, value));
        self
    }

    pub(crate) fn set_opt(self, key: &'static str, value: Option<f64>) -> Row {
        match value {
            Some(v) => self.set(key, v),
            None => self,
        }
    }

    /// Count and p50/p99/p999 of `samples`.
    pub(crate) fn latencies(self, samples: &mut Samples) -> Row {
        let ms = |d: Option<Duration>| d.map(|d| d.as_secs_f64() * 1e3);
        let n = samples.len() as f64;
        let (p50, p99, p999) = (
            ms(samples.percentile(50.0)),
            ms(samples.percentile(99.0)),
            ms(samples.percentile(99.9)),
        );
        self.set(COUNT, n)
            .set_opt(P50, p50)
            .set_opt(P99, p99)
            .set_opt(P999, p999)
    }

    pub(crate) fn get(&self, key: &str) -> Option<f64> {
        self.figures
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| *v)
    }
}

/// Which command a run measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    Ours,
    Theirs,
    /// The minimal server of the same service (`floor.rs`).
    Floor,
}

impl Side {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Side::Ours => "ours",
            Side::Theirs => "theirs",
            Side::Floor => "floor",
        }
    }
}

/// One run of one scenario at one size.
#[derive(Clone, Debug)]
pub(crate) struct Run {
    pub side: Side,
    pub scenario: Scenario,
    pub size: usize,
    pub repeat: usize,
    /// The 1-minute load average when the run started.
    pub load1: Option<f64>,
    pub outcome: Result<Vec<Row>, String>,
}

/// A row label at one scenario and size, with each side's figures over its runs.
#[derive(Clone, Debug)]
pub(crate) struct Line {
    pub scenario: Scenario,
    pub size: usize,
    pub label: String,
    pub ours: Vec<(&'static str, Spread, Vec<f64>)>,
    pub theirs: Vec<(&'static str, Spread, Vec<f64>)>,
    pub floor: Vec<(&'static str, Spread, Vec<f64>)>,
}

/// Groups runs into lines, in the order rows first appeared.
pub(crate) fn lines(runs: &[Run]) -> Vec<Line> {
    let mut keys: Vec<(Scenario, usize, String)> = Vec::new();
    for run in runs {
        for row in run.outcome.iter().flatten() {
            let key = (run.scenario, run.size, row.label.clone());
            if !keys.contains(&key) {
                keys.push(key);
            }
        }
    }
    keys.into_iter()
        .map(|(scenario, size, label)| {
            let side = |side: Side| {
                let rows: Vec<&Row> = runs
                    .iter()
                    .filter(|r| r.side == side && r.scenario == scenario && r.size == size)
                    .flat_map(|r| r.outcome.iter().flatten())
                    .filter(|row| row.label == label)
                    .collect();
                let mut figures: Vec<(&'static str, Spread, Vec<f64>)> = Vec::new();
                for row in &rows {
                    for (key, _) in &row.figures {
                        if figures.iter().any(|(k, _, _)| k == key) {
                            continue;
                        }
                        let values: Vec<f64> = rows.iter().filter_map(|r| r.get(key)).collect();
                        if let Some(s) = spread(&values) {
                            figures.push((key, s, values));
                        }
                    }
                }
                figures
            };
            Line {
                ours: side(Side::Ours),
                theirs: side(Side::Theirs),
                floor: side(Side::Floor),
                scenario,
                size,
                label,
            }
        })
        .collect()
}

/// A number with three significant digits, no exponent for ordinary magnitudes.
pub fn number(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        "0".into()
    } else if a >= 100.0 || (a >= 1.0 && v.fract() == 0.0) {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else if a >= 0.01 {
        format!("{v:.3}")
    } else {
        format!("{v:.2e}")
    }
}

/// `median` or `median (min–max)` when the runs differ.
fn cell(s: &Spread, runs: usize) -> String {
    if runs > 1 && number(s.min) != number(s.max) {
        format!("{} ({}–{})", number(s.median), number(s.min), number(s.max))
    } else {
        number(s.median)
    }
}

fn figure<'a>(
    figures: &'a [(&'static str, Spread, Vec<f64>)],
    key: &str,
) -> Option<&'a (&'static str, Spread, Vec<f64>)> {
    figures.iter().find(|(k, _, _)| *k == key)
}

/// The Markdown table of one side.
pub(crate) fn table(lines: &[Line], side: Side) -> String {
    let mut out = String::from("| scenario | seeds | figure |");
    for (_, title) in COLUMNS {
        out.push_str(&format!(" {title} |"));
    }
    out.push_str(" other |\n|---|---:|---|");
    for _ in COLUMNS {
        out.push_str("---:|");
    }
    out.push_str("---|\n");
    for line in lines {
        let figures = line.side(side);
        if figures.is_empty() {
            continue;
        }
        out.push_str(&format!(
            "| {} | {} | {} |",
            line.scenario.name(),
            line.size,
            line.label
        ));
        for (key, _) in COLUMNS {
            match figure(figures, key) {
                Some((_, s, v)) => out.push_str(&format!(" {} |", cell(s, v.len()))),
                None => out.push_str(" |"),
            }
        }
        let notes: Vec<String> = figures
            .iter()
            .filter(|(k, _, _)| !COLUMNS.iter().any(|(c, _)| c == k))
            .map(|(k, s, v)| format!("{k} {}", cell(s, v.len())))
            .collect();
        out.push_str(&format!(" {} |\n", notes.join("; ")));
    }
    out
}

/// Ratios ours/theirs (or ours/floor) of the medians (below 1 is better for us for times, CPU
/// and memory; above 1 for rates).
pub(crate) fn ratio_table(lines: &[Line], other: Side) -> String {
    let keys = [P50, P99, RATE, CPU, PEAK_RSS];
    let mut out = String::from(
        "| scenario | seeds | figure | p50 | p99 | rate | CPU/op | peak RSS | other |\n",
    );
    out.push_str("|---|---:|---|---:|---:|---:|---:|---:|---|\n");
    for line in lines {
        if line.ours.is_empty() || line.side(other).is_empty() {
            continue;
        }
        out.push_str(&format!(
            "| {} | {} | {} |",
            line.scenario.name(),
            line.size,
            line.label
        ));
        for key in keys {
            match ratio(line, key, other) {
                Some(r) => out.push_str(&format!(" {} |", number(r))),
                None => out.push_str(" |"),
            }
        }
        let other: Vec<String> = line
            .ours
            .iter()
            .filter(|(k, _, _)| !COLUMNS.iter().any(|(c, _)| c == k))
            .filter_map(|(k, _, _)| ratio(line, k, other).map(|r| format!("{k} {}", number(r))))
            .collect();
        out.push_str(&format!(" {} |\n", other.join("; ")));
    }
    out
}

pub(crate) fn ratio(line: &Line, key: &str, other: Side) -> Option<f64> {
    let ours = figure(&line.ours, key)?.1.median;
    let theirs = figure(line.side(other), key)?.1.median;
    (theirs != 0.0).then(|| ours / theirs)
}

impl Line {
    /// The figures of one side.
    pub(crate) fn side(&self, side: Side) -> &[(&'static str, Spread, Vec<f64>)] {
        match side {
            Side::Ours => &self.ours,
            Side::Theirs => &self.theirs,
            Side::Floor => &self.floor,
        }
    }
}

/// Runs that failed, one line each.
pub(crate) fn failures(runs: &[Run]) -> Vec<String> {
    runs.iter()
        .filter_map(|r| {
            r.outcome.as_ref().err().map(|e| {
                format!(
                    "{} seeds={} {} run {}: {}",
                    r.scenario.name(),
                    r.size,
                    r.side.name(),
                    r.repeat + 1,
                    e
                )
            })
        })
        .collect()
}

fn figures_json(figures: &[(&'static str, Spread, Vec<f64>)]) -> Value {
    let mut map = serde_json::Map::new();
    for (key, s, values) in figures {
        map.insert(
            (*key).to_owned(),
            json!({"median": s.median, "min": s.min, "max": s.max, "runs": values}),
        );
    }
    Value::Object(map)
}

/// The spread of the load average at the start of the runs.
pub(crate) fn load_spread(runs: &[Run]) -> Option<Spread> {
    spread(&runs.iter().filter_map(|r| r.load1).collect::<Vec<_>>())
}

pub(crate) fn to_json(
    machine: &Machine,
    commands: &[(Side, String)],
    runs: &[Run],
    lines: &[Line],
) -> Value {
    let load = load_spread(runs).map(|s| json!({"median": s.median, "min": s.min, "max": s.max}));
    json!({
        "load_average_1m": load,
        "machine": {
            "cpus": machine.cpus,
            "cpu_model": machine.cpu_model,
            "kernel": machine.kernel,
            "memory_mib": machine.memory_mib,
        },
        "commands": commands.iter().map(|(side, cmd)| json!({"side": side.name(), "command": cmd})).collect::<Vec<_>>(),
        "results": lines.iter().map(|line| {
            let mut v = json!({
                "scenario": line.scenario.name(),
                "seeds": line.size,
                "figure": line.label,
                "ours": figures_json(&line.ours),
            });
            if !line.theirs.is_empty() {
                v["theirs"] = figures_json(&line.theirs);
                let ratios: serde_json::Map<String, Value> = [P50, P99, P999, RATE, CPU, PEAK_RSS]
                    .into_iter()
                    .filter_map(|k| ratio(line, k, Side::Theirs).map(|r| (k.to_owned(), json!(r))))
                    .collect();
                v["ratio_ours_over_theirs"] = Value::Object(ratios);
            }
            if !line.floor.is_empty() {
                v["floor"] = figures_json(&line.floor);
                let ratios: serde_json::Map<String, Value> = [P50, P99, P999, RATE, CPU, PEAK_RSS]
                    .into_iter()
                    .filter_map(|k| ratio(line, k, Side::Floor).map(|r| (k.to_owned(), json!(r))))
                    .collect();
                v["ratio_ours_over_floor"] = Value::Object(ratios);
            }
            v
        }).collect::<Vec<_>>(),
        "failures": failures(runs),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(side: Side, repeat: usize, p50: f64) -> Run {
        Run {
            side,
            scenario: Scenario::Get,
            size: 10,
            repeat,
            load1: Some(1.0),
            outcome: Ok(vec![Row::new("Get c=1").set(P50, p50).set("extra", 1.0)]),
        }
    }

    #[test]
    fn medians_spreads_and_ratios() {
        let runs = vec![
            run(Side::Ours, 0, 1.0),
            run(Side::Theirs, 0, 4.0),
            run(Side::Ours, 1, 3.0),
            run(Side::Theirs, 1, 4.0),
            run(Side::Ours, 2, 2.0),
            Run {
                side: Side::Theirs,
                scenario: Scenario::Get,
                size: 10,
                repeat: 2,
                load1: None,
                outcome: Err("boom".into()),
            },
        ];
        let lines = lines(&runs);
        assert_eq!(lines.len(), 1);
        let (_, s, values) = figure(&lines[0].ours, P50).unwrap();
        assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 3.0));
        assert_eq!(values.len(), 3);
        assert_eq!(ratio(&lines[0], P50, Side::Theirs), Some(0.5));
        assert_eq!(ratio(&lines[0], P99, Side::Theirs), None);
        let table = table(&lines, Side::Ours);
        assert!(
            table.contains("| get | 10 | Get c=1 | | 2 (1–3) |"),
            "{table}"
        );
        assert!(table.contains("extra 1 |"), "{table}");
        assert!(ratio_table(&lines, Side::Theirs).contains("| 0.500 |"));
        assert!(ratio_table(&lines, Side::Theirs).contains("| extra 1 |"));
        assert_eq!(failures(&runs), ["get seeds=10 theirs run 3: boom"]);
        let json = to_json(
            &Machine {
                cpus: 2,
                cpu_model: "x".into(),
                kernel: "k".into(),
                memory_mib: 1,
            },
            &[(Side::Ours, "bin".into())],
            &runs,
            &lines,
        );
        assert_eq!(json["results"][0]["ours"][P50]["median"], 2.0);
        assert_eq!(json["results"][0]["ratio_ours_over_theirs"][P50], 0.5);
    }

    #[test]
    fn latencies_row() {
        let mut samples = Samples::default();
        for ms in 1..=1000 {
            samples.push(Duration::from_millis(ms));
        }
        let row = Row::new("x").latencies(&mut samples);
        assert_eq!(row.get(COUNT), Some(1000.0));
        assert_eq!(row.get(P50), Some(500.0));
        assert_eq!(row.get(P99), Some(990.0));
        assert_eq!(row.get(P999), Some(999.0));
        assert_eq!(
            Row::new("y").latencies(&mut Samples::default()).get(P50),
            None
        );
    }

    #[test]
    fn numbers() {
        assert_eq!(number(0.0), "0");
        assert_eq!(number(1234.4), "1234");
        assert_eq!(number(20.0), "20");
        assert_eq!(number(12.34), "12.3");
        assert_eq!(number(1.234), "1.23");
        assert_eq!(number(0.1234), "0.123");
        assert_eq!(number(0.001234), "1.23e-3");
    }
}

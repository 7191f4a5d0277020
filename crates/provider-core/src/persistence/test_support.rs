//! What the tests of both stores share: the records they write and the `kill -9` test they both
//! take. In that test the test binary runs itself as a child (one test by name, the store's
//! location in its environment) whose tasks commit batches in a loop and print
//! `ACK <round> <task> <n>` after each acknowledged one; the parent kills it at a random moment
//! once it has acknowledged enough, then checks the reopened state against every
//! acknowledgement it read.

use std::collections::BTreeMap;
use std::future::Future;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::rules::fence::HighWaterMark;
use crate::rules::records::{Change, Slot, Snapshot};

/// The fence mark of `shard` on `machine` at `epoch`/`sequence`.
pub(crate) fn fence(shard: &str, machine: &str, epoch: i64, sequence: i64) -> Change {
    Change::PutFence {
        shard_id: shard.into(),
        machine_id: machine.into(),
        mark: HighWaterMark { epoch, sequence },
    }
}

pub(crate) fn counters(revision: i64, next_op: u64) -> Change {
    Change::Counters { revision, next_op }
}

/// The mark the state holds for `shard` on `machine`.
pub(crate) fn mark_of(snapshot: &Snapshot, shard: &str, machine: &str) -> Option<HighWaterMark> {
    snapshot
        .fences
        .iter()
        .find(|f| f.shard_id == shard && f.machine_id == machine)
        .map(|f| f.mark)
}

/// The newest acknowledged mutation of each `(round, task)`.
pub(crate) type Acked = BTreeMap<(i64, i64), i64>;

/// The child's side: `tasks` tasks each commit `batch(task, n)` for n = 0, 1, … and print an
/// acknowledgement line after each commit, until the process is killed.
pub(crate) async fn commit_until_killed<F, Fut>(round: i64, tasks: i64, commit: F)
where
    F: Fn(i64, i64) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let mut handles = Vec::new();
    for task in 0..tasks {
        let commit = commit.clone();
        handles.push(tokio::spawn(async move {
            for n in 0.. {
                commit(task, n).await;
                let mut out = std::io::stdout().lock();
                writeln!(out, "ACK {round} {task} {n}").expect("stdout");
                out.flush().expect("flush");
            }
        }));
    }
    for h in handles {
        let _ = h.await;
    }
}

/// One round of the parent's side: runs the child test `test` with `env` (and `round` under
/// `round_var`), waits until its whole output lines satisfy `enough` (the child failing or
/// `within` passing first fails the test, naming `short`), sleeps a random time below
/// `max_pause`, kills the child with SIGKILL and adds every acknowledgement it printed to
/// `acked`.
pub(crate) struct Round<'a> {
    pub(crate) test: &'a str,
    pub(crate) env: (&'a str, &'a str),
    pub(crate) round_var: &'a str,
    pub(crate) round: i64,
    pub(crate) enough: fn(&[String]) -> bool,
    pub(crate) within: Duration,
    pub(crate) short: &'a str,
    pub(crate) max_pause: Duration,
}

impl Round<'_> {
    pub(crate) fn kill_child(&self, acked: &mut Acked) {
        let exe = std::env::current_exe().expect("current exe");
        let round = self.round;
        let mut child = Command::new(&exe)
            .args([self.test, "--exact", "--nocapture"])
            .env(self.env.0, self.env.1)
            .env(self.round_var, round.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn child");
        let stdout = child.stdout.take().expect("stdout");
        let lines: Arc<Mutex<Vec<String>>> = Arc::default();
        let reader = {
            let lines = lines.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stdout);
                let mut buf = Vec::new();
                while reader.read_until(b'\n', &mut buf).is_ok_and(|n| n > 0) {
                    // A line without its newline was cut off by the kill: not an acknowledgement.
                    if buf.ends_with(b"\n") {
                        let line = String::from_utf8_lossy(&buf).trim_end().to_owned();
                        lines.lock().expect("lines").push(line);
                    }
                    buf.clear();
                }
            })
        };
        let started = Instant::now();
        while !(self.enough)(&lines.lock().expect("lines")) {
            if started.elapsed() > self.within || child.try_wait().ok().flatten().is_some() {
                let _ = child.kill();
                let output = child.wait_with_output().expect("child output");
                panic!(
                    "round {round}: the child acknowledged {}: {}",
                    self.short,
                    String::from_utf8_lossy(&output.stderr)
                );
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let pause = rand::random_range(0..self.max_pause.as_millis() as u64);
        std::thread::sleep(Duration::from_millis(pause));
        child.kill().expect("kill -9");
        child.wait().expect("wait");
        reader.join().expect("reader");
        for line in lines.lock().expect("lines").iter() {
            let mut parts = line.split_whitespace();
            if parts.next() != Some("ACK") {
                continue;
            }
            let nums: Vec<i64> = parts.map(|p| p.parse().expect("number")).collect();
            let entry = acked.entry((nums[0], nums[1])).or_insert(-1);
            *entry = (*entry).max(nums[2]);
        }
    }
}

/// The id of the slot that mutation `n` of a task writes: one of four per task.
pub(crate) fn slot_id(round: i64, task: i64, n: i64) -> String {
    format!("r{round}-t{task}-{}", n % 4)
}

/// Mutation `n` of a task, atomic as a batch so a check can see a half-applied one: slot
/// [`slot_id`] written, the fence mark of `r<round>-t<task>` on machine `m` at `n`, slot
/// `r<round>-t<task>-latest-<n>` written, `extra` (if any), and the previous `latest` removed.
pub(crate) fn batch(
    round: i64,
    task: i64,
    n: i64,
    slot: fn(&str, i64) -> Slot,
    extra: Option<Change>,
) -> Vec<Change> {
    let mut batch = vec![
        Change::PutSlot(slot(&slot_id(round, task, n), n)),
        fence(&format!("r{round}-t{task}"), "m", 1, n),
        Change::PutSlot(slot(&format!("r{round}-t{task}-latest-{n}"), n)),
    ];
    batch.extend(extra);
    if n > 0 {
        batch.push(Change::RemoveSlot(format!(
            "r{round}-t{task}-latest-{}",
            n - 1
        )));
    }
    batch
}

/// One acknowledged task as the reopened state shows it.
pub(crate) struct Task<'s> {
    pub(crate) round: i64,
    pub(crate) task: i64,
    /// The newest mutation the child acknowledged.
    pub(crate) last_acked: i64,
    /// The newest mutation the state holds.
    pub(crate) newest: i64,
    pub(crate) slots: &'s BTreeMap<&'s str, &'s Slot>,
}

/// Checks what every store promises of each acknowledged task: the state holds its
/// acknowledged mutation or the one after it (each task waits for its commit before the next),
/// and that newest batch is whole. Then `more` checks what the store promises beyond that.
pub(crate) fn check_acknowledged(s: &Snapshot, acked: &Acked, mut more: impl FnMut(&Task<'_>)) {
    let slots: BTreeMap<&str, &Slot> = s
        .slots
        .iter()
        .map(|slot| (slot.machine.id.as_str(), slot))
        .collect();
    for (&(round, task), &last_acked) in acked {
        let newest = mark_of(s, &format!("r{round}-t{task}"), "m")
            .unwrap_or_else(|| panic!("round {round} task {task}: fence mark lost"))
            .sequence;
        assert!(
            newest >= last_acked,
            "round {round} task {task}: acknowledged mutation {last_acked} lost (state has {newest})"
        );
        assert!(
            newest <= last_acked + 1,
            "round {round} task {task}: {newest} after {last_acked}"
        );
        let latest = format!("r{round}-t{task}-latest-{newest}");
        assert!(
            slots.contains_key(latest.as_str()),
            "{latest} missing: batch torn"
        );
        if newest > 0 {
            let previous = format!("r{round}-t{task}-latest-{}", newest - 1);
            assert!(
                !slots.contains_key(previous.as_str()),
                "{previous} present: batch torn"
            );
        }
        more(&Task {
            round,
            task,
            last_acked,
            newest,
            slots: &slots,
        });
    }
}

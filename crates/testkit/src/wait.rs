//! Bounded polling. The verdict of a test is what it counts; a deadline here only turns a hang
//! into a failure with a name.

use std::time::Duration;

use tokio::time::Instant;

/// Waits (polling every `every`) until `condition` holds; panics naming `what` after `within`.
pub async fn until_within(
    what: &str,
    within: Duration,
    every: Duration,
    condition: impl Fn() -> bool,
) {
    let deadline = Instant::now() + within;
    while !condition() {
        assert!(Instant::now() < deadline, "{what} within {within:?}");
        tokio::time::sleep(every).await;
    }
}

/// Waits until `f` holds, polling every 20 ms, for at most `within`; whether it held (one last
/// look at the deadline).
pub async fn eventually(within: Duration, mut f: impl FnMut() -> bool) -> bool {
    let until = Instant::now() + within;
    while Instant::now() < until {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    f()
}

/// Waits (polling every 10 ms) until `condition` holds; panics naming `what` after `within`.
pub async fn until(what: &str, within: Duration, condition: impl Fn() -> bool) {
    until_within(what, within, Duration::from_millis(10), condition).await
}

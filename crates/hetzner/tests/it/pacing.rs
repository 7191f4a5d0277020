//! The `hetzner` binary paces its reconcile surveys to their share of the API budget: at the
//! real Hetzner limit (one request a second, of which the default shares leave a tenth to
//! background work) a survey costs ten seconds of that share, so a one-second
//! `--reconcile-interval` becomes a floor the surveys stay above.

use std::time::Duration;

use hcloud_emulator::RateLimit;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;

use crate::harness::{Env, TOKEN, process_spec};

/// The value of the series `name` (without labels) on the metrics endpoint at `addr`.
async fn metric(addr: std::net::SocketAddr, name: &str) -> Option<f64> {
    let mut tcp = tokio::net::TcpStream::connect(addr).await.ok()?;
    tcp.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await
        .ok()?;
    let mut text = String::new();
    tcp.read_to_string(&mut text).await.ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

fn listings(env: &Env) -> usize {
    env.emulator
        .requests_by_class()
        .get("listing")
        .map_or(0, |(n, _)| *n)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_surveys_are_paced_to_their_share_of_the_budget() {
    let env = Env::without_ssh().await;
    env.emulator.set_rate_limit(RateLimit::HETZNER);
    let dir = env.dir.path();
    let (ssh_key, offerings) =
        env.process_files(r#"[{"server_type":"cx23","location":"nbg1","count":2}]"#);
    let mut spec = process_spec(vec![
        "--hetzner-backend=hetzner".to_owned(),
        format!("--token={TOKEN}"),
        format!("--hcloud-endpoint={}", env.emulator.endpoint()),
        "--image=ubuntu-24.04".into(),
        format!("--offerings={}", offerings.display()),
        format!("--ssh-key={}", ssh_key.display()),
        format!("--state={}", dir.join("state").display()),
        "--reconcile-interval=1s".into(),
        "--log-level=info".into(),
    ]);
    spec.metrics = true;
    let mut provider = crate::provider_process::start(spec).await.unwrap();
    let metrics = provider.metrics.expect("the provider serves metrics");
    let cost = "bigfleet_hetzner_reconcile_survey_requests";
    let period = "bigfleet_hetzner_reconcile_period_seconds";

    // The first periodic survey comes at the floor and records what it cost.
    let deadline = Instant::now() + Duration::from_secs(30);
    let spent = loop {
        if let Some(spent) = metric(metrics, cost).await {
            break spent;
        }
        assert!(
            Instant::now() < deadline,
            "no survey was recorded within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(spent >= 1.0, "a survey lists at least one page: {spent}");
    // Its cost at the background rate (0.5 × 0.2 of one request a second) sets the period.
    let chosen = metric(metrics, period).await.unwrap();
    eprintln!("a survey cost {spent} requests; the next one waits {chosen} s");
    assert!(
        chosen >= 10.0 * spent && chosen <= 10.5 * spent + 0.1,
        "period {chosen} s for a survey of {spent} requests"
    );
    // At the floor's cadence eight more surveys would come in the next eight seconds; paced,
    // none does.
    let before = listings(&env);
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_eq!(
        listings(&env),
        before,
        "a survey ran before its paced period was over"
    );
    assert_eq!(env.emulator.count_status(429), 0);
    provider.stop(Duration::from_secs(10)).await.unwrap();
}

//! The API budget against the emulator's real (time-scaled) limits, 5,000 an hour and 250 a
//! minute with DigitalOcean's headers: a burst of Droplet creates and their polls from a nearly
//! spent token meets no 429, and another user spending half the budget fails none of them.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use digitalocean::api::{ApiClient, CreateDroplet, ImageRef};
use do_emulator::{Emulator, RateLimit};
use provider_core::budget::{Limits, Settings};
use tokio::net::TcpListener;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::support::{API_TOKEN, REGION, api_client};

/// Time runs this many times faster for the emulator and the budget alike.
const SCALE: f64 = 60.0;
const CREATES: u64 = 50;

async fn start(left: u32) -> (Emulator, ApiClient, CancellationToken) {
    let emulator = Emulator::new(API_TOKEN);
    emulator.set_rate_limit(RateLimit::DIGITALOCEAN.time_scaled(SCALE));
    emulator.set_hourly_remaining(left);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let stop = CancellationToken::new();
    tokio::spawn(emulator.clone().serve(listener, stop.clone()));
    let budget = Settings::new(Limits::DIGITALOCEAN.time_scaled(SCALE))
        .budget("bigfleet_digitalocean_it_budget");
    (emulator, api_client(&url).with_budget(budget), stop)
}

/// Creates `CREATES` Droplets at once, then polls each once and lists them by tag; every call
/// must succeed.
async fn burst(api: &ApiClient) -> Duration {
    let started = Instant::now();
    let tasks: Vec<_> = (0..CREATES)
        .map(|i| {
            let api = api.clone();
            tokio::spawn(async move {
                let deadline = Instant::now() + Duration::from_secs(60);
                let request = CreateDroplet {
                    name: format!("bigfleet-budget-{i}"),
                    region: REGION.into(),
                    size: "s-2vcpu-4gb".into(),
                    image: ImageRef::parse("ubuntu-24-04-x64"),
                    vpc_uuid: None,
                    ipv6: false,
                    monitoring: false,
                    ssh_keys: Vec::new(),
                    user_data: String::new(),
                    tags: vec!["bigfleet-budget".into()],
                };
                // As the cloud does: a create refused with 429 had no effect and is sent again
                // once the budget lets it.
                let droplet = loop {
                    match api.create_droplet(&request, deadline).await {
                        Err(e) if e.status() == Some(429) => continue,
                        other => break other.unwrap(),
                    }
                };
                api.get_droplet(droplet.id, deadline).await.unwrap();
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let listed = api
        .list_droplets_by_tag("bigfleet-budget", deadline)
        .await
        .unwrap();
    assert_eq!(listed.len(), CREATES as usize);
    started.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_from_a_nearly_spent_token_meets_no_429() {
    let (emulator, api, stop) = start(10).await;
    let took = burst(&api).await;
    let classes = emulator.requests_by_class();
    eprintln!("{CREATES} creates and polls in {took:?}; requests by class: {classes:?}");
    let refused: usize = classes.values().map(|(_, refused)| refused).sum();
    assert_eq!(refused, 0, "{classes:?}");
    assert_eq!(
        classes["create"].0, CREATES as usize,
        "one POST per Droplet"
    );
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_user_spending_half_the_budget_fails_no_request() {
    let (emulator, api, stop) = start(10).await;
    // Half of the hourly limit's refill (5,000 an hour, 60 times faster: 83 a second).
    let other_stop = Arc::new(AtomicBool::new(false));
    let other = {
        let (emulator, other_stop) = (emulator.clone(), other_stop.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(24));
            let mut got = 0;
            while !other_stop.load(Ordering::SeqCst) {
                tick.tick().await;
                got += emulator.drain_rate_limit(1);
            }
            got
        })
    };
    let took = burst(&api).await;
    other_stop.store(true, Ordering::SeqCst);
    let got = other.await.unwrap();
    let classes = emulator.requests_by_class();
    eprintln!(
        "{CREATES} creates and polls in {took:?} beside another user that got {got}; requests by class: {classes:?}"
    );
    assert!(got > 0);
    assert_eq!(
        classes["create"].0, CREATES as usize,
        "one POST per Droplet"
    );
    stop.cancel();
}

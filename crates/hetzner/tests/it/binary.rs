//! The `hetzner` binary as a process: the metrics-port rule, configuration errors that stop
//! startup before any port binds, JSON logs, and secrets kept out of the output.

use std::net::TcpListener;
use std::process::Command;
use std::time::Duration;

use crate::harness::{binary, process_spec};
use crate::provider_process::{self, Spec};
use crate::wire;

fn spec(args: &[&str]) -> Spec {
    process_spec(args.iter().map(|a| (*a).to_owned()).collect())
}

#[tokio::test]
async fn a_taken_metrics_port_is_logged_and_grpc_still_serves() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let metrics = format!("--metrics-addr={}", taken.local_addr().unwrap());
    let provider =
        provider_process::start(spec(&["--use-fake-backend", "--seed-count=4", &metrics]))
            .await
            .expect("gRPC serves although the metrics port is taken");
    let mut provider = provider;
    provider.stop(Duration::from_secs(10)).await.unwrap();
    let logs = settled_logs(&provider).await;
    assert!(logs.contains("cannot bind the metrics address"), "{logs}");
}

#[tokio::test]
async fn json_logs_carry_the_startup_fields_and_never_the_token() {
    let provider = provider_process::start(spec(&[
        "--use-fake-backend",
        "--seed-count=4",
        "--log-format=json",
        "--token=hcloud-secret-token-5e1f",
    ]))
    .await
    .unwrap();
    let channel = provider.default_channel().await.unwrap();
    let mut caller = wire::Caller::new(channel, wire::Shard::new("s", 1));
    caller.get("no-such-machine").await.unwrap_err();
    let mut provider = provider;
    provider.stop(Duration::from_secs(10)).await.unwrap();
    let logs = settled_logs(&provider).await;
    assert!(
        !logs.contains("hcloud-secret-token-5e1f"),
        "the token leaked:\n{logs}"
    );
    let startup = logs
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["message"] == "serving CapacityProvider")
        .unwrap_or_else(|| panic!("no JSON startup line in:\n{logs}"));
    assert_eq!(startup["security"], "insecure");
    assert_eq!(
        startup["shard_identity"], "off",
        "nothing to check without mTLS"
    );
    assert_eq!(startup["hetzner_backend"], "fake");
    assert!(startup["version"].is_string() && startup["addr"].is_string());
    assert!(
        logs.lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .any(|v| v["message"] == "rpc"
                && v["method"] == "Get"
                && v["machine_id"] == "no-such-machine"
                && v["code"] == "NotFound"
                && v["dur_ms"].is_number()),
        "every RPC is logged with method, machine id, code and duration:\n{logs}"
    );
}

/// Runs the binary with `args` and a free `--addr`; it must exit 1 quickly, print `expected`,
/// and never have bound the gRPC port.
pub(crate) fn refuses(args: &[&str], expected: &str) {
    let port = provider_process::free_port().unwrap();
    let output = Command::new(binary())
        .arg(format!("--addr=127.0.0.1:{port}"))
        .arg("--metrics-addr=")
        .args(args)
        .env_remove("HCLOUD_TOKEN")
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(expected),
        "expected {expected:?} in:\n{stderr}"
    );
    assert!(!stderr.contains("serving CapacityProvider"), "{stderr}");
    // Nothing was left listening on the port.
    TcpListener::bind(("127.0.0.1", port)).expect("the gRPC port was never taken");
}

#[test]
fn bad_configuration_fails_before_any_port_binds() {
    let dir = tempfile::tempdir().unwrap();
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "not a certificate").unwrap();
    let garbage = garbage.to_str().unwrap();
    refuses(
        &[],
        "refusing to start the hetzner provider on the in-memory fake backend",
    );
    refuses(
        &["--use-fake-backend", "--tls-cert", garbage],
        "both --tls-cert and --tls-key are required to enable TLS",
    );
    refuses(
        &["--use-fake-backend", "--tls-ca", garbage],
        "--tls-ca set without --tls-cert/--tls-key",
    );
    refuses(
        &[
            "--use-fake-backend",
            "--tls-cert",
            garbage,
            "--tls-key",
            garbage,
        ],
        "load TLS keypair",
    );
    let offerings = dir.path().join("offerings.json");
    std::fs::write(
        &offerings,
        r#"[{"server_type":"cx23","location":"nbg1","capacity_type":"spot","count":1}]"#,
    )
    .unwrap();
    refuses(
        &[
            "--use-fake-backend",
            "--offerings",
            offerings.to_str().unwrap(),
        ],
        "capacity_type \"spot\" is not offered by Hetzner Cloud (on-demand only)",
    );
    let state = dir.path().join("state.json");
    std::fs::write(&state, "").unwrap();
    refuses(
        &["--use-fake-backend", "--state", state.to_str().unwrap()],
        "state.json",
    );
    refuses(
        &["--token=t", "--hetzner-backend=hetzner"],
        "--image is required for the hetzner backend",
    );
}

#[tokio::test]
async fn sigterm_stops_serving_and_exits_zero() {
    let provider = provider_process::start(spec(&["--use-fake-backend", "--seed-count=2"]))
        .await
        .unwrap();
    let channel = provider.default_channel().await.unwrap();
    wire::wait_for_health(
        &channel,
        tonic_health::pb::health_check_response::ServingStatus::Serving,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    let mut provider = provider;
    provider
        .stop(Duration::from_secs(10))
        .await
        .expect("exit 0 after SIGTERM");
    assert!(settled_logs(&provider).await.contains("shutting down"));
}

/// The child's log once its last line ("stopped") has been read (bounded).
async fn settled_logs(provider: &provider_process::Provider) -> String {
    for _ in 0..200 {
        let logs = provider.logs();
        if logs.contains("stopped") {
            return logs;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    provider.logs()
}

#[test]
fn help_never_echoes_the_token_from_the_environment() {
    let token = "hcloud-env-token-7c4e19";
    let endpoint = "https://user:endpoint-password-2d8a@api.example.test/v1";
    for flag in ["--help", "-h", "--no-such-flag"] {
        let out = Command::new(binary())
            .arg(flag)
            .env("HCLOUD_TOKEN", token)
            .env("HCLOUD_ENDPOINT", endpoint)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(!text.contains(token), "{flag} echoed the token:\n{text}");
        assert!(
            !text.contains("endpoint-password-2d8a"),
            "{flag} echoed the endpoint:\n{text}"
        );
        if flag != "--no-such-flag" {
            assert!(
                text.contains("HCLOUD_TOKEN"),
                "{flag} still names the variable"
            );
        }
    }
}

#[test]
fn text_logs_to_a_pipe_carry_no_colour_codes_even_without_no_color() {
    // A taken port makes the process log its startup WARN and exit at the bind.
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let output = Command::new(binary())
        .args([
            "--use-fake-backend",
            "--seed-count=2",
            "--metrics-addr=",
            &format!("--addr={}", taken.local_addr().unwrap()),
        ])
        .env_remove("NO_COLOR")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("WARN"), "{stderr}");
    assert!(
        !stderr.contains('\u{1b}'),
        "escape sequences in a pod's log: {stderr:?}"
    );
}

#[test]
fn check_is_listed_in_the_help_and_has_its_own() {
    let check = testkit::cli::check_help(&binary(), "hetzner");
    assert!(check.contains("--json"), "{check}");
    assert!(
        check.contains("deprecated or not sold there now"),
        "{check}"
    );
    assert!(
        !check.contains("--hcloud-endpoint"),
        "not the top-level help:\n{check}"
    );
}

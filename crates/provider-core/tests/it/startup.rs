//! Startup through `app::run` in-process: plain-text gRPC in front of a real cloud backend is
//! warned about; with the fake backend, or with TLS, it is not. `--shard-identity` without mTLS
//! fails startup.

use std::io::Write;
use std::sync::{Arc, Mutex};

use clap::Parser;
use provider_core::app::{self, Launch};
use provider_core::config::CommonArgs;
use provider_core::telemetry::Telemetry;
use tokio::sync::oneshot;

use crate::harness::{TestBackend, pki};

#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    common: CommonArgs,
}

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Runs the provider until it announces itself and returns what it logged meanwhile.
fn startup_log(extra: &[String], real_backend: bool) -> String {
    let mut args = vec![
        "provider".to_owned(),
        "--addr=127.0.0.1:0".to_owned(),
        "--metrics-addr=".to_owned(),
        "--reconcile-interval=0".to_owned(),
        "--price-refresh=0".to_owned(),
    ];
    args.extend_from_slice(extra);
    let common = Flags::try_parse_from(args).expect("flags").common;
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    tracing::subscriber::with_default(subscriber, || {
        runtime.block_on(async {
            let (announced_tx, announced) = oneshot::channel();
            let announced_tx = Mutex::new(Some(announced_tx));
            let launch = Launch {
                common,
                backend: TestBackend::instant(2),
                fleet: None,
                telemetry: Telemetry::new("bigfleet_startup"),
                announce: Box::new(move |_, _| {
                    if let Some(tx) = announced_tx.lock().unwrap().take() {
                        let _ = tx.send(());
                    }
                }),
                side_servers: Vec::new(),
                require_zone: false,
                real_backend,
                leading: Default::default(),
            };
            tokio::select! {
                result = app::run(launch) => panic!("the provider stopped: {result:?}"),
                _ = announced => {}
            }
        });
    });
    String::from_utf8(captured.0.lock().unwrap().clone()).expect("utf-8 log")
}

const WARNING: &str = "gRPC is served in PLAIN TEXT with the real cloud backend";

#[test]
fn plaintext_with_the_real_backend_is_warned_about() {
    let log = startup_log(&[], true);
    let line = log
        .lines()
        .find(|l| l.contains(WARNING))
        .unwrap_or_else(|| panic!("no warning in:\n{log}"));
    assert!(line.contains("WARN"), "{line}");
    assert!(line.contains("--tls-cert"), "{line}");
}

#[test]
fn plaintext_with_the_fake_backend_or_tls_with_the_real_one_is_not() {
    let log = startup_log(&[], false);
    // The log was captured (the backend has no readiness gate, which is warned about).
    assert!(log.contains("no readiness gate configured"), "{log}");
    assert!(!log.contains(WARNING), "{log}");
    let tls = mtls_flags();
    let log = startup_log(&tls, true);
    assert!(!log.contains(WARNING), "{log}");
}

/// The committed test PKI's server certificate and key as flags: server TLS.
fn server_tls_flags() -> Vec<String> {
    let pki = pki();
    vec![
        format!("--tls-cert={}", pki.join("server.pem").display()),
        format!("--tls-key={}", pki.join("server-key.pem").display()),
    ]
}

/// [`server_tls_flags`] and the CA that signs the clients' certificates: mTLS.
fn mtls_flags() -> Vec<String> {
    let mut flags = server_tls_flags();
    flags.push(format!("--tls-ca={}", pki().join("ca.pem").display()));
    flags
}

/// What `app::run` fails with for these flags (it must fail before serving).
fn startup_error(extra: &[String]) -> String {
    let mut args = vec![
        "provider".to_owned(),
        "--addr=127.0.0.1:0".to_owned(),
        "--metrics-addr=".to_owned(),
    ];
    args.extend_from_slice(extra);
    let common = Flags::try_parse_from(args).expect("flags").common;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let launch = Launch {
        common,
        backend: TestBackend::instant(2),
        fleet: None,
        telemetry: Telemetry::new("bigfleet_startup"),
        announce: Box::new(|_, _| panic!("announced: startup should have failed")),
        side_servers: Vec::new(),
        require_zone: false,
        real_backend: false,
        leading: Default::default(),
    };
    runtime
        .block_on(app::run(launch))
        .expect_err("startup fails")
}

#[test]
fn shard_identity_without_mtls_fails_startup_naming_the_flag() {
    let err = startup_error(&["--shard-identity=warn".to_owned()]);
    assert_eq!(
        err,
        "--shard-identity=warn needs mTLS (--tls-ca): without verified client certificates \
         there is no shard identity to check"
    );
    // Server TLS without client certificates is not mTLS either.
    let mut server_tls = server_tls_flags();
    server_tls.push("--shard-identity=enforce".to_owned());
    let err = startup_error(&server_tls);
    assert!(
        err.starts_with("--shard-identity=enforce needs mTLS"),
        "{err}"
    );
}

#[test]
fn startup_announces_the_shard_identity_mode_and_warns_when_it_is_not_enforced() {
    let mtls = mtls_flags();
    let log = startup_log(&mtls, false);
    assert!(
        !log.contains("--shard-identity="),
        "enforce by default: {log}"
    );
    let mut off = mtls.to_vec();
    off.push("--shard-identity=off".to_owned());
    let log = startup_log(&off, false);
    assert!(
        log.contains("--shard-identity=off: the shard a mutation asserts is not checked"),
        "{log}"
    );
}

//! The DigitalOcean bootstrap channel's request handling, driven in process: a channel serves
//! on loopback from this thread's runtime, and each input becomes one raw HTTP/1.1 request
//! (arbitrary method, path, query, headers, framing and body) over a fresh TLS 1.3 connection.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arbitrary::{Result, Unstructured};
use digitalocean::channel::{AuthLimit, Channel, ChannelSettings};
use digitalocean::enrollment::{EnrollmentSource, parse_enroll};
use digitalocean::token::BootstrapSecret;
use provider_core::telemetry::Telemetry;
use rustls_pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::TlsConnector;

use crate::engine::Target;
use crate::shape::{json_bytes, mutate, short_string, word};

pub const REQUESTS: Target = Target {
    name: "channel-requests",
    checks: "raw HTTP/1.1 requests to the bootstrap channel (methods, paths, machine_id \
             queries, valid/invalid/missing bearer tokens, wrong or missing Content-Length, \
             chunked bodies, ack-shaped, enrollment-shaped and damaged bodies): no handler task \
             panics, no answer is a 5xx, a well-formed request with the machine's valid token is \
             never refused as unauthorized, and one with a wrong token always is; an enrollment \
             with the right token enrolls when it is the first, is refused only as a conflict \
             after another credential enrolled, and nothing is accepted once in conflict; whatever the enrollment decoder \
             accepts is a 32-byte credential that a re-encoded body gives back",
    property,
};

/// The machine whose token the fuzzer knows.
const MACHINE: &str = "do/s-1/fra1/0";
/// The machine the fuzzer enrolls (another one, so `MACHINE`'s token stays valid).
const ENROLLING: &str = "do/s-1/fra1/1";
/// Credentials an enrollment body may carry: two well-formed ones, then malformed ones.
const CREDENTIALS: &[&str] = &[
    "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",
    "_____________________________________-----",
    "AAAA",
    "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!",
    "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",
];

struct Server {
    runtime: tokio::runtime::Runtime,
    addr: SocketAddr,
    connector: TlsConnector,
    token: String,
    enroll_token: String,
    channel: Channel,
}

thread_local! {
    static SERVER: RefCell<Option<Server>> = const { RefCell::new(None) };
}

fn start() -> Server {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).expect("cert");
    let tls = digitalocean::setup::channel_tls(
        cert.cert.pem().as_bytes(),
        cert.signing_key.serialize_pem().as_bytes(),
    )
    .expect("channel TLS");
    let channel = Channel::new(
        ChannelSettings {
            secret: BootstrapSecret::new("fuzz-bootstrap-secret-0123456789abcdef").expect("secret"),
            tls,
            poll_hold: Duration::from_millis(5),
            // Throttling is not what this target checks; keep it from masking the answers.
            auth_limit: AuthLimit {
                burst: u32::MAX,
                refill_every: Duration::from_millis(1),
            },
        },
        Telemetry::new("bigfleet_fuzz"),
    );
    // No cloud stands behind this channel to say which addresses a Droplet has.
    channel.set_enrollment_source(EnrollmentSource::Any);
    let token = channel.token_for(MACHINE).expose().to_owned();
    let enroll_token = channel
        .enrollment_token_for(ENROLLING, "op-1")
        .expose()
        .to_owned();
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    let serving = channel.clone();
    runtime.spawn(async move {
        let _ = serving.serve(listener, std::future::pending()).await;
    });
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.cert.der().clone()).expect("root");
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13])
    .expect("TLS 1.3")
    .with_root_certificates(roots)
    .with_no_client_auth();
    Server {
        runtime,
        addr,
        connector: TlsConnector::from(Arc::new(config)),
        token,
        enroll_token,
        channel,
    }
}

/// `s` with only the characters a request line or header value may carry verbatim.
fn clean(s: String) -> String {
    s.chars()
        .map(|c| if c.is_ascii_graphic() { c } else { 'x' })
        .collect()
}

/// What one request claims to be, for the properties.
struct Shape {
    well_formed: bool,
    valid_token: bool,
    wrong_token: bool,
    known_route: bool,
    /// An enrollment whose body the decoder accepts.
    enrollment: bool,
}

fn request(u: &mut Unstructured<'_>, server: &Server) -> Result<(Vec<u8>, Shape)> {
    let (method, path) = match u.int_in_range(0..=5)? {
        0 | 1 => ("GET".to_owned(), "/v1/command".to_owned()),
        2 => ("POST".to_owned(), "/v1/ack".to_owned()),
        3 => ("POST".to_owned(), "/v1/enroll".to_owned()),
        _ => (
            word(
                u,
                &["GET", "POST", "PUT", "HEAD", "DELETE", "OPTIONS"],
                false,
            )?,
            word(
                u,
                &[
                    "/v1/command",
                    "/v1/ack",
                    "/v1/enroll",
                    "/",
                    "/v1/",
                    "//v1/ack",
                ],
                false,
            )?,
        ),
    };
    let query = match u.int_in_range(0..=5)? {
        0 => String::new(),
        1 => {
            let id: String = short_string(u)?
                .chars()
                .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '/'))
                .collect();
            format!("?machine_id={id}")
        }
        2 => "?machine_id=do%2Fs-1%2Ffra1%2F0&machine_id=x".to_owned(),
        _ if path == "/v1/enroll" => format!("?machine_id={ENROLLING}"),
        _ => "?machine_id=do/s-1/fra1/0".to_owned(),
    };
    let token = if path == "/v1/enroll" {
        server.enroll_token.as_str()
    } else {
        server.token.as_str()
    };
    let (auth, valid_token, wrong_token) = match u.int_in_range(0..=5)? {
        0 => (None, false, false),
        1 => (
            Some(format!("Bearer {}", clean(short_string(u)?))),
            false,
            true,
        ),
        2 => (Some(format!("bearer {token}")), false, false),
        3 => (Some(short_string(u)?), false, false),
        _ => (Some(format!("Bearer {token}")), true, false),
    };
    let body = match u.int_in_range(0..=4)? {
        0 => Vec::new(),
        4 => {
            let mut enroll = serde_json::Map::new();
            let key = word(u, &["credential", "Credential", "credentials"], false)?;
            let value = if u.ratio(7, 8)? {
                serde_json::Value::String(word(u, CREDENTIALS, false)?)
            } else {
                serde_json::Value::Bool(u.arbitrary()?)
            };
            enroll.insert(key, value);
            json_bytes(u, &serde_json::Value::Object(enroll))?
        }
        1 => {
            let n = u.int_in_range(0..=64)?;
            u.bytes(n)?.to_vec()
        }
        _ => {
            let ack = serde_json::json!({
                "command_id": word(u, &["x-1", ""], false)?,
                "ok": u.arbitrary::<bool>()?,
                "error": short_string(u)?,
            });
            json_bytes(u, &ack)?
        }
    };
    let chunked = u.ratio(1, 8)?;
    let mut head = format!("{method} {path}{query} HTTP/1.1\r\nHost: localhost\r\n");
    if let Some(auth) = &auth {
        head.push_str(&format!("Authorization: {auth}\r\n"));
    }
    let mut honest_length = true;
    if chunked {
        head.push_str("Transfer-Encoding: chunked\r\n");
    } else if !body.is_empty() || u.arbitrary()? {
        let len = if u.ratio(1, 8)? {
            honest_length = false;
            u.int_in_range(0..=200usize)?
        } else {
            body.len()
        };
        head.push_str(&format!("Content-Length: {len}\r\n"));
    }
    let mut plain_headers = true;
    for _ in 0..u.int_in_range(0..=2)? {
        let name = if u.ratio(1, 4)? {
            plain_headers = false;
            short_string(u)?
        } else {
            (*u.choose(&["X-Extra", "Accept", "Expect"])?).to_owned()
        };
        // A raw value may break the header block; an Expect may be answered before routing.
        let value = if u.arbitrary()? {
            plain_headers = false;
            short_string(u)?
        } else {
            clean(short_string(u)?)
        };
        plain_headers &= name != "Expect";
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    let mut bytes = head.into_bytes();
    if chunked {
        bytes.extend_from_slice(format!("{:x}\r\n", body.len()).as_bytes());
        bytes.extend_from_slice(&body);
        bytes.extend_from_slice(b"\r\n0\r\n\r\n");
    } else {
        bytes.extend_from_slice(&body);
    }
    let mut well_formed = honest_length && plain_headers;
    if u.ratio(1, 8)? {
        bytes = mutate(u, &bytes)?;
        well_formed = false;
    }
    let known_route = ((method == "GET" && path == "/v1/command")
        || (method == "POST" && (path == "/v1/ack" || path == "/v1/enroll")))
        && !query.is_empty();
    let enrollment = path == "/v1/enroll" && check_decoder(&body);
    let target = if path == "/v1/enroll" {
        ENROLLING
    } else {
        MACHINE
    };
    Ok((
        bytes,
        Shape {
            well_formed,
            valid_token: valid_token && query.ends_with(&format!("machine_id={target}")),
            wrong_token,
            known_route,
            enrollment,
        },
    ))
}

/// The enrollment decoder on `body`: whatever it accepts is a 43-character credential of 32
/// bytes that a re-encoded body gives back unchanged. Returns whether it accepted `body`.
fn check_decoder(body: &[u8]) -> bool {
    use base64::Engine as _;
    let Some(request) = parse_enroll(body) else {
        return false;
    };
    assert_eq!(request.credential.len(), 43);
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(request.credential.as_bytes())
        .expect("an accepted credential decodes");
    assert_eq!(bytes.len(), 32);
    let again = serde_json::json!({ "credential": request.credential.as_str() }).to_string();
    let reparsed = parse_enroll(again.as_bytes()).expect("a re-encoded body decodes");
    assert_eq!(reparsed.credential, request.credential);
    true
}

/// Sends `bytes` and returns the status of the first response, if one came within 250 ms (a
/// request whose body never completes gets none).
async fn exchange(server: &Server, bytes: &[u8]) -> Option<u16> {
    let tcp = tokio::net::TcpStream::connect(server.addr).await.ok()?;
    let name = ServerName::try_from("localhost").ok()?;
    let mut tls = server.connector.connect(name, tcp).await.ok()?;
    tls.write_all(bytes).await.ok()?;
    tls.flush().await.ok()?;
    let mut got = Vec::new();
    let read = async {
        let mut buf = [0u8; 4096];
        loop {
            match tls.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
            if got.windows(4).any(|w| w == b"\r\n\r\n") {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_millis(250), read).await;
    let line = got.split(|&b| b == b'\r').next()?;
    let line = std::str::from_utf8(line).ok()?;
    line.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()
}

fn property(u: &mut Unstructured<'_>) -> Result<()> {
    SERVER.with(|cell| {
        let mut slot = cell.borrow_mut();
        let server = slot.get_or_insert_with(start);
        let (bytes, shape) = request(u, server)?;
        // The enrolling machine's record before the request: (enrolled, in conflict).
        let before = server
            .channel
            .enrollment_status(ENROLLING)
            .unwrap_or((false, false));
        let status = server.runtime.block_on(exchange(server, &bytes));
        if let Some(status) = status {
            let sent = String::from_utf8_lossy(&bytes);
            assert!(status < 500, "the channel answered {status} to {sent:?}");
            if shape.well_formed && shape.known_route {
                if shape.wrong_token {
                    assert_eq!(status, 401, "a wrong token was not refused: {sent:?}");
                }
                if shape.valid_token && shape.enrollment {
                    // The right token with a decodable credential: the first one enrolls, the
                    // enrolled one again is answered as before, any other is a conflict (401)
                    // that no credential gets past afterwards.
                    match before {
                        (false, _) => {
                            assert_eq!(status, 200, "a first enrollment was refused: {sent:?}")
                        }
                        (true, true) => assert_eq!(
                            status, 401,
                            "an enrollment in conflict was accepted: {sent:?}"
                        ),
                        (true, false) => assert!(
                            status == 200 || status == 401,
                            "an enrollment was answered {status}: {sent:?}"
                        ),
                    }
                    let after = server.channel.enrollment_status(ENROLLING);
                    assert_eq!(
                        after.map(|(enrolled, _)| enrolled),
                        Some(true),
                        "an answered enrollment left the machine unenrolled: {sent:?}"
                    );
                    if status == 401 {
                        assert_eq!(
                            after,
                            Some((true, true)),
                            "an enrollment refused with the right token is not a conflict: \
                             {sent:?}"
                        );
                    }
                } else if shape.valid_token {
                    assert_ne!(status, 401, "a valid token was refused: {sent:?}");
                }
            }
        }
        Ok(())
    })
}

//! Shard identity under mTLS (BigFleet ADR-0048: "the shard presents
//! `bigfleet://shard/<shard_id>`; enforcement is the provider's job"). A mutating RPC (Create,
//! Configure, Drain, Delete) is admitted only when the verified client certificate carries
//! exactly one `bigfleet://` URI SAN and it is `bigfleet://shard/<shard_id of the request>`.
//!
//! The check runs in the server before the engine sees the request: a refused request never
//! advances or reveals a fence mark, nor tells whether its machine exists. Reads (Get, List) are
//! open to every verified certificate, BigFleet's `bigfleet://admin` and `bigfleet://readonly`
//! tools included: they change nothing, and the TLS layer has already refused every client
//! the CA did not sign. The zero token of contract.md §4 (empty shard id, epoch and sequence
//! zero) gets no exemption: its shard id is "", so only `bigfleet://shard/` proves it.
//!
//! Without mTLS there is no verified certificate and nothing is checked: identity is only as
//! strong as the transport.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use clap::ValueEnum;
use rustls_pki_types::CertificateDer;

use crate::observability::telemetry::Telemetry;
use crate::rules::error::CoreError;
use crate::rules::limits::MAX_ID_BYTES;
use crate::security::tls::SecurityMode;

/// What the server does with a mutating RPC whose certificate does not prove its shard
/// (`--shard-identity`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ShardIdentity {
    // Plain comments, not doc comments: clap would list them in `--help` (and the flag table).
    // Refuse it with PERMISSION_DENIED (the default under mTLS).
    Enforce,
    // Admit it, with a WARN line and a count (for an upgrade: see who would be refused).
    Warn,
    // Check nothing (the behaviour before the check existed).
    Off,
}

impl ShardIdentity {
    pub fn name(self) -> &'static str {
        match self {
            ShardIdentity::Enforce => "enforce",
            ShardIdentity::Warn => "warn",
            ShardIdentity::Off => "off",
        }
    }

    /// The mode for the flag's value (`None`: not given) under `security`: `enforce` by default
    /// under mTLS, `off` without it. A value given without mTLS is a startup error, since there
    /// is no verified certificate to check and the operator would believe otherwise.
    pub fn resolve(
        flag: Option<ShardIdentity>,
        security: SecurityMode,
    ) -> Result<ShardIdentity, String> {
        match (security, flag) {
            (SecurityMode::MutualTls, flag) => Ok(flag.unwrap_or(ShardIdentity::Enforce)),
            (SecurityMode::Insecure | SecurityMode::Tls, None) => Ok(ShardIdentity::Off),
            (SecurityMode::Insecure | SecurityMode::Tls, Some(mode)) => Err(format!(
                "--shard-identity={} needs mTLS (--tls-ca): without verified client \
                 certificates there is no shard identity to check",
                mode.name()
            )),
        }
    }
}

/// Why a certificate does not prove the shard a request asserts (the `reason` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// One `bigfleet://` URI SAN, naming something else.
    Mismatch,
    /// No `bigfleet://` URI SAN (a DNS-only certificate included).
    Missing,
    /// More than one `bigfleet://` URI SAN.
    Multiple,
}

impl Reason {
    pub const ALL: [Reason; 3] = [Reason::Mismatch, Reason::Missing, Reason::Multiple];

    pub fn label(self) -> &'static str {
        match self {
            Reason::Mismatch => "mismatch",
            Reason::Missing => "missing",
            Reason::Multiple => "multiple",
        }
    }

    fn index(self) -> usize {
        match self {
            Reason::Mismatch => 0,
            Reason::Missing => 1,
            Reason::Multiple => 2,
        }
    }
}

/// A certificate that does not prove the asserted shard: what it carries and what was asserted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub reason: Reason,
    /// The certificate's `bigfleet://` URI SANs.
    pub found: Vec<String>,
    /// The request's `shard_id`.
    pub asserted: String,
}

impl Refusal {
    /// The SANs found, quoted (`none` when there is none).
    pub fn found_text(&self) -> String {
        if self.found.is_empty() {
            return "none".to_owned();
        }
        self.found
            .iter()
            .map(|uri| format!("{:?}", shown(uri)))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The PERMISSION_DENIED message: the SAN found (or none) and the shard id asserted.
    pub fn message(&self) -> String {
        let asserted = shown(&self.asserted);
        let needed = format!("{SHARD_URI_PREFIX}{asserted}");
        match self.reason {
            Reason::Mismatch => format!(
                "shard identity: the client certificate is {}, but the request asserts \
                 shard_id {asserted:?}, which needs {needed}",
                self.found_text()
            ),
            Reason::Missing => format!(
                "shard identity: the client certificate carries no bigfleet:// URI SAN (none), \
                 but the request asserts shard_id {asserted:?}, which needs {needed}"
            ),
            Reason::Multiple => format!(
                "shard identity: the client certificate carries {} bigfleet:// URI SANs ({}); \
                 exactly one is allowed, and the request asserts shard_id {asserted:?}, which \
                 needs {needed}",
                self.found.len(),
                self.found_text()
            ),
        }
    }
}

/// A shard's URI SAN, before its shard id.
pub const SHARD_URI_PREFIX: &str = "bigfleet://shard/";

/// At most this much of a client-controlled string is echoed in a message or a log line.
fn shown(text: &str) -> &str {
    if text.len() <= MAX_ID_BYTES {
        return text;
    }
    let mut end = MAX_ID_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// Whether a URI has the `bigfleet` scheme (schemes compare without case, RFC 3986 §3.1).
fn is_bigfleet(uri: &str) -> bool {
    uri.split_once(':')
        .is_some_and(|(scheme, _)| scheme.eq_ignore_ascii_case("bigfleet"))
}

/// Whether a `bigfleet://` URI is exactly the shard URI of `shard_id`.
fn proves(uri: &str, shard_id: &str) -> bool {
    uri.split_once(':')
        .and_then(|(_, rest)| rest.strip_prefix("//shard/"))
        == Some(shard_id)
}

/// The `bigfleet://` URI SANs of a certificate, in certificate order. A certificate webpki
/// cannot read (it already verified this one during the handshake) has none.
pub fn bigfleet_uris(cert: &CertificateDer<'_>) -> Vec<String> {
    let Ok(cert) = webpki::EndEntityCert::try_from(cert) else {
        return Vec::new();
    };
    cert.valid_uri_names()
        .filter(|uri| is_bigfleet(uri))
        .map(str::to_owned)
        .collect()
}

/// Whether the client's leaf certificate proves `shard_id`: exactly one `bigfleet://` URI SAN,
/// and it is `bigfleet://shard/<shard_id>`. No certificate proves nothing.
pub fn check(leaf: Option<&CertificateDer<'_>>, shard_id: &str) -> Result<(), Refusal> {
    let found = leaf.map(bigfleet_uris).unwrap_or_default();
    let reason = match found.as_slice() {
        [] => Reason::Missing,
        [one] if proves(one, shard_id) => return Ok(()),
        [_] => Reason::Mismatch,
        _ => Reason::Multiple,
    };
    Err(Refusal {
        reason,
        found,
        asserted: shard_id.to_owned(),
    })
}

/// How often a WARN line per reason is written; the refusals in between are counted into the
/// next line.
pub const LOG_EVERY: Duration = Duration::from_secs(1);

/// The WARN lines of one reason: when the last was written, and how many were left out since.
#[derive(Debug, Default, Clone, Copy)]
struct LogSlot {
    last: Option<Instant>,
    suppressed: u64,
}

impl LogSlot {
    /// `Some(suppressed since the last line)` when a line is due at `now`, else counts one more
    /// suppressed refusal.
    fn due(&mut self, now: Instant) -> Option<u64> {
        match self.last {
            Some(last) if now.saturating_duration_since(last) < LOG_EVERY => {
                self.suppressed += 1;
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
    }
}

/// The check as the server runs it: the mode, the rate-limited WARN line and the counter
/// `<prefix>_shard_identity_rejected_total{reason}` (in `warn` mode it counts the requests
/// `enforce` would refuse).
#[derive(Debug)]
pub struct ShardGuard {
    mode: ShardIdentity,
    telemetry: Telemetry,
    log: Mutex<[LogSlot; 3]>,
}

impl ShardGuard {
    pub fn new(mode: ShardIdentity, telemetry: Telemetry) -> ShardGuard {
        ShardGuard {
            mode,
            telemetry,
            log: Mutex::default(),
        }
    }

    pub fn mode(&self) -> ShardIdentity {
        self.mode
    }

    /// Admits or refuses one mutating RPC from a client that presented `peer` (leaf first).
    pub fn admit(
        &self,
        method: &'static str,
        machine_id: &str,
        peer: Option<&[CertificateDer<'static>]>,
        shard_id: &str,
    ) -> Result<(), tonic::Status> {
        if self.mode == ShardIdentity::Off {
            return Ok(());
        }
        let Err(refusal) = check(peer.and_then(<[_]>::first), shard_id) else {
            return Ok(());
        };
        let reason = refusal.reason;
        self.telemetry.shard_identity_rejected(reason.label());
        let due = {
            let mut slots = self.log.lock().unwrap_or_else(|e| e.into_inner());
            slots[reason.index()].due(Instant::now())
        };
        if let Some(suppressed) = due {
            let (found, asserted) = (refusal.found_text(), shown(&refusal.asserted));
            match self.mode {
                ShardIdentity::Warn => tracing::warn!(
                    method,
                    machine_id = shown(machine_id),
                    reason = reason.label(),
                    found,
                    asserted,
                    suppressed,
                    mode = self.mode.name(),
                    "shard identity: admitted a request the client certificate does not prove \
                     (--shard-identity=warn; enforce would refuse it)"
                ),
                ShardIdentity::Enforce | ShardIdentity::Off => tracing::warn!(
                    method,
                    machine_id = shown(machine_id),
                    reason = reason.label(),
                    found,
                    asserted,
                    suppressed,
                    mode = self.mode.name(),
                    "shard identity: refused a request the client certificate does not prove"
                ),
            }
        }
        match self.mode {
            ShardIdentity::Enforce => Err(CoreError::ShardIdentity(refusal.message()).into()),
            ShardIdentity::Warn | ShardIdentity::Off => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A self-signed certificate with these SANs (`uri:` entries are URIs, the rest DNS names).
    fn certificate(names: &[&str]) -> CertificateDer<'static> {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        for name in names {
            let san = match name.strip_prefix("uri:") {
                Some(uri) => rcgen::SanType::URI(uri.try_into().expect("IA5 URI")),
                None => rcgen::SanType::DnsName((*name).try_into().expect("DNS name")),
            };
            params.subject_alt_names.push(san);
        }
        let key = rcgen::KeyPair::generate().expect("key");
        params.self_signed(&key).expect("self-signed").der().clone()
    }

    #[test]
    fn the_one_shard_uri_of_the_asserted_shard_proves_it() {
        let cert = certificate(&["uri:bigfleet://shard/rc-shard", "localhost"]);
        assert_eq!(check(Some(&cert), "rc-shard"), Ok(()));
        // Other schemes are not identities and do not count against "exactly one".
        let cert = certificate(&["uri:spiffe://cluster/ns/x", "uri:bigfleet://shard/rc-shard"]);
        assert_eq!(check(Some(&cert), "rc-shard"), Ok(()));
        // URI schemes compare without case.
        let cert = certificate(&["uri:BigFleet://shard/rc-shard"]);
        assert_eq!(check(Some(&cert), "rc-shard"), Ok(()));
    }

    #[test]
    fn every_other_certificate_is_refused_with_its_reason() {
        let refused = |names: &[&str], shard: &str| {
            check(Some(&certificate(names)), shard).expect_err("refused")
        };
        let r = refused(&["uri:bigfleet://shard/rc-shard"], "other-shard");
        assert_eq!(r.reason, Reason::Mismatch);
        assert_eq!(
            r.message(),
            "shard identity: the client certificate is \"bigfleet://shard/rc-shard\", but the \
             request asserts shard_id \"other-shard\", which needs bigfleet://shard/other-shard"
        );
        for (names, shard) in [
            (&["uri:bigfleet://admin"][..], "s"),
            (&["uri:bigfleet://readonly"], "s"),
            (&["uri:bigfleet://cluster/s"], "s"),
            (&["uri:bigfleet://shard/s/x"], "s"),
            (&["uri:bigfleet://shard/s"], "S"),
            (&["uri:bigfleet://shard/s"], ""),
        ] {
            assert_eq!(refused(names, shard).reason, Reason::Mismatch, "{names:?}");
        }
        let r = refused(&["localhost"], "s");
        assert_eq!(r.reason, Reason::Missing);
        assert!(r.message().contains("(none)"), "{}", r.message());
        assert!(r.message().contains("shard_id \"s\""), "{}", r.message());
        assert_eq!(refused(&[], "s").reason, Reason::Missing);
        let r = refused(&["uri:bigfleet://shard/s", "uri:bigfleet://admin"], "s");
        assert_eq!(r.reason, Reason::Multiple);
        assert!(
            r.message()
                .contains("2 bigfleet:// URI SANs (\"bigfleet://shard/s\", \"bigfleet://admin\")"),
            "{}",
            r.message()
        );
        assert_eq!(
            check(None, "s").expect_err("no certificate").reason,
            Reason::Missing
        );
    }

    #[test]
    fn the_zero_token_shard_is_proved_only_by_the_empty_shard_uri() {
        assert_eq!(
            check(Some(&certificate(&["uri:bigfleet://shard/"])), ""),
            Ok(())
        );
        let r = check(Some(&certificate(&["uri:bigfleet://shard/s"])), "").expect_err("refused");
        assert_eq!(r.reason, Reason::Mismatch);
    }

    #[test]
    fn a_long_asserted_shard_id_is_cut_in_the_message() {
        let long = "é".repeat(MAX_ID_BYTES);
        let r = check(None, &long).expect_err("refused");
        assert!(r.message().len() < 3 * MAX_ID_BYTES, "{}", r.message());
        assert_eq!(r.asserted, long, "the refusal keeps what was asserted");
    }

    #[test]
    fn the_mode_defaults_to_enforce_under_mtls_and_is_refused_without_it() {
        use SecurityMode::*;
        assert_eq!(
            ShardIdentity::resolve(None, MutualTls),
            Ok(ShardIdentity::Enforce)
        );
        for mode in [
            ShardIdentity::Enforce,
            ShardIdentity::Warn,
            ShardIdentity::Off,
        ] {
            assert_eq!(ShardIdentity::resolve(Some(mode), MutualTls), Ok(mode));
            for security in [Insecure, Tls] {
                let err = ShardIdentity::resolve(Some(mode), security).expect_err("no mTLS");
                assert!(
                    err.contains("--shard-identity") && err.contains("--tls-ca"),
                    "{err}"
                );
            }
        }
        assert_eq!(
            ShardIdentity::resolve(None, Insecure),
            Ok(ShardIdentity::Off)
        );
        assert_eq!(ShardIdentity::resolve(None, Tls), Ok(ShardIdentity::Off));
    }

    #[test]
    fn one_line_per_second_per_reason_with_the_count_left_out() {
        let start = Instant::now();
        let mut slot = LogSlot::default();
        assert_eq!(slot.due(start), Some(0));
        for ms in [1, 500, 999] {
            assert_eq!(slot.due(start + Duration::from_millis(ms)), None);
        }
        assert_eq!(slot.due(start + LOG_EVERY), Some(3));
        assert_eq!(slot.due(start + LOG_EVERY + Duration::from_millis(1)), None);
        assert_eq!(slot.due(start + 3 * LOG_EVERY), Some(1));
    }
}

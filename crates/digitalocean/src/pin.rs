//! What an agent trusts on the bootstrap channel, shared by the agent's HTTPS client and the
//! provider's checks (at startup and on every reload of the channel's keypair), so a pin the
//! provider accepts is exactly one every agent accepts.
//!
//! Two modes:
//! - trust anchors (`--bootstrap-ca`, the config's `ca_pem`): ordinary path validation to one of
//!   the anchors, host name and validity dates checked;
//! - a public-key pin (the config's `pinned_spki_sha256`, written when `--bootstrap-ca` is not
//!   set; or the key of an older config's `pinned_cert_pem`): the server's end-entity
//!   certificate must carry the pinned SubjectPublicKeyInfo, whoever issued it, so a renewal
//!   that keeps the key (cert-manager `privateKey.rotationPolicy: Never`) keeps every agent
//!   working. Intermediates the server sends are ignored, so no certificate of the chain file
//!   ever becomes a trust anchor. The handshake signature (over the pinned key), the host name
//!   and the presented certificate's validity dates are still checked.

use std::sync::Arc;

use provider_core::tls;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::{CertificateError, DigitallySignedStruct, Error, OtherError, SignatureScheme};
use rustls_pki_types::{CertificateDer, ServerName, UnixTime};

/// What the agent trusts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Pin {
    /// Trust anchors: path validation.
    Anchors(Vec<CertificateDer<'static>>),
    /// An end-entity certificate with this SubjectPublicKeyInfo (its SHA-256).
    PublicKey([u8; 32]),
}

/// The SHA-256 of a certificate's DER SubjectPublicKeyInfo: what a public-key pin compares.
pub fn spki_sha256(cert: &CertificateDer<'_>) -> Result<[u8; 32], String> {
    use sha2::Digest as _;
    let parsed = rustls::server::ParsedCertificate::try_from(cert)
        .map_err(|e| format!("not a usable certificate: {e}"))?;
    Ok(sha2::Sha256::digest(parsed.subject_public_key_info().as_ref()).into())
}

/// A public-key pin as the agent config carries it (`pinned_spki_sha256`): standard base64
/// with padding, as `openssl x509 -pubkey -noout | openssl pkey -pubin -outform der | openssl
/// dgst -sha256 -binary | base64` prints it.
pub fn spki_pin_text(pin: &[u8; 32]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(pin)
}

/// The pin of [`spki_pin_text`] read back: exactly 32 bytes.
pub fn parse_spki_pin(text: &str) -> Result<[u8; 32], String> {
    use base64::Engine as _;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(text.trim())
        .map_err(|e| format!("not base64: {e}"))?;
    <[u8; 32]>::try_from(bytes.as_slice())
        .map_err(|_| format!("{} bytes, where a SHA-256 has 32", bytes.len()))
}

/// The verifier an agent uses for `pin` (ring provider).
pub(crate) fn verifier(pin: &Pin) -> Result<Arc<dyn ServerCertVerifier>, String> {
    let provider = tls::crypto_provider();
    match pin {
        Pin::Anchors(anchors) => {
            let mut roots = rustls::RootCertStore::empty();
            for anchor in anchors {
                roots
                    .add(anchor.clone())
                    .map_err(|e| format!("trust anchor: {e}"))?;
            }
            let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
                Arc::new(roots),
                provider,
            )
            .build()
            .map_err(|e| format!("trust anchors: {e}"))?;
            Ok(verifier)
        }
        Pin::PublicKey(spki) => Ok(Arc::new(PublicKeyPin {
            spki: *spki,
            provider,
        })),
    }
}

/// A TLS 1.3-only client config trusting `pin` and nothing else, offering h2 and HTTP/1.1.
pub(crate) fn client_config(pin: &Pin) -> Result<rustls::ClientConfig, String> {
    let mut config = rustls::ClientConfig::builder_with_provider(tls::crypto_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| format!("TLS 1.3: {e}"))?
        .dangerous()
        .with_custom_certificate_verifier(verifier(pin)?)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

/// Accepts an end-entity certificate of one public key.
#[derive(Debug)]
struct PublicKeyPin {
    spki: [u8; 32],
    provider: Arc<CryptoProvider>,
}

/// The server presented a certificate of another key than the pinned one.
struct NotPinned;

/// rustls shows this error with `Debug`: it reads as the message.
impl std::fmt::Debug for NotPinned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

impl std::fmt::Display for NotPinned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(
            "the server's certificate is not the pinned certificate: its public key is not the pinned key",
        )
    }
}

impl std::error::Error for NotPinned {}

impl ServerCertVerifier for PublicKeyPin {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, Error> {
        // The key decides; intermediates play no part.
        let presented = spki_sha256(end_entity)
            .map_err(|_| Error::InvalidCertificate(CertificateError::BadEncoding))?;
        if presented != self.spki {
            return Err(Error::InvalidCertificate(CertificateError::Other(
                OtherError(Arc::new(NotPinned)),
            )));
        }
        let (not_before, not_after) =
            validity(end_entity).ok_or(Error::InvalidCertificate(CertificateError::BadEncoding))?;
        if now.as_secs() < not_before {
            return Err(Error::InvalidCertificate(
                CertificateError::NotValidYetContext {
                    time: now,
                    not_before: UnixTime::since_unix_epoch(std::time::Duration::from_secs(
                        not_before,
                    )),
                },
            ));
        }
        if now.as_secs() > not_after {
            return Err(Error::InvalidCertificate(
                CertificateError::ExpiredContext {
                    time: now,
                    not_after: UnixTime::since_unix_epoch(std::time::Duration::from_secs(
                        not_after,
                    )),
                },
            ));
        }
        let parsed = rustls::server::ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_name(&parsed, server_name)?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        // Never reached (TLS 1.3 only), but verified all the same.
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        // `cert` is the end-entity certificate whose key was matched against the pin, so this
        // proves the server holds the pinned key.
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// `(notBefore, notAfter)` of a DER certificate, in seconds since the epoch (before 1970:
/// 0). `None` when the structure is not a certificate.
fn validity(cert: &CertificateDer<'_>) -> Option<(u64, u64)> {
    let (tag, certificate, _) = tlv(cert.as_ref())?;
    if tag != 0x30 {
        return None;
    }
    let (tag, tbs, _) = tlv(certificate)?;
    if tag != 0x30 {
        return None;
    }
    let mut rest = tbs;
    // version [0] EXPLICIT, optional
    let (tag, _, after) = tlv(rest)?;
    if tag == 0xa0 {
        rest = after;
    }
    // serialNumber, signature, issuer
    for expected in [0x02, 0x30, 0x30] {
        let (tag, _, after) = tlv(rest)?;
        if tag != expected {
            return None;
        }
        rest = after;
    }
    let (tag, validity, _) = tlv(rest)?;
    if tag != 0x30 {
        return None;
    }
    let (tag, not_before, after) = tlv(validity)?;
    let not_before = time(tag, not_before)?;
    let (tag, not_after, _) = tlv(after)?;
    let not_after = time(tag, not_after)?;
    Some((not_before, not_after))
}

/// One DER element: `(tag, contents, rest)`. Single-byte tags and definite lengths only, as DER
/// certificates use.
fn tlv(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, input) = input.split_first()?;
    let (&first, mut input) = input.split_first()?;
    let len = if first < 0x80 {
        usize::from(first)
    } else {
        let count = usize::from(first & 0x7f);
        if count == 0 || count > 4 || input.len() < count {
            return None;
        }
        let (bytes, after) = input.split_at(count);
        input = after;
        bytes
            .iter()
            .fold(0usize, |acc, &b| (acc << 8) | usize::from(b))
    };
    if input.len() < len {
        return None;
    }
    let (contents, rest) = input.split_at(len);
    Some((tag, contents, rest))
}

/// UTCTime (`YYMMDDHHMMSSZ`, RFC 5280: years 1950-2049) or GeneralizedTime
/// (`YYYYMMDDHHMMSSZ`) as seconds since the epoch, clamped at 0.
fn time(tag: u8, text: &[u8]) -> Option<u64> {
    let digits = |s: &[u8]| -> Option<i64> {
        s.iter().try_fold(0i64, |acc, &c| {
            c.is_ascii_digit().then(|| acc * 10 + i64::from(c - b'0'))
        })
    };
    let (year, rest) = match (tag, text.len()) {
        (0x17, 13) => {
            let yy = digits(&text[..2])?;
            (if yy >= 50 { 1900 + yy } else { 2000 + yy }, &text[2..])
        }
        (0x18, 15) => (digits(&text[..4])?, &text[4..]),
        _ => return None,
    };
    if rest[10] != b'Z' {
        return None;
    }
    let month = digits(&rest[0..2])?;
    let day = digits(&rest[2..4])?;
    let hour = digits(&rest[4..6])?;
    let minute = digits(&rest[6..8])?;
    let second = digits(&rest[8..10])?;
    if !(1..=12).contains(&month)
        || !(1..=31).contains(&day)
        || hour > 23
        || minute > 59
        || second > 60
    {
        return None;
    }
    // Days from the civil date (proleptic Gregorian).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + hour * 3_600 + minute * 60 + second;
    Some(u64::try_from(secs).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert_valid(not_before: (i32, u8, u8), not_after: (i32, u8, u8)) -> CertificateDer<'static> {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params =
            rcgen::CertificateParams::new(vec!["localhost".to_owned()]).expect("params");
        params.not_before = rcgen::date_time_ymd(not_before.0, not_before.1, not_before.2);
        params.not_after = rcgen::date_time_ymd(not_after.0, not_after.1, not_after.2);
        params.self_signed(&key).expect("cert").der().clone()
    }

    #[test]
    fn validity_reads_both_time_forms() {
        // 2000-03-01 (UTCTime) to 2100-01-01 (GeneralizedTime).
        let cert = cert_valid((2000, 3, 1), (2100, 1, 1));
        assert_eq!(validity(&cert), Some((951_868_800, 4_102_444_800)));
        let cert = cert_valid((1969, 1, 1), (2049, 12, 31));
        assert_eq!(validity(&cert), Some((0, 2_524_521_600)));
        assert_eq!(
            validity(&CertificateDer::from(vec![0x30, 0x03, 1, 2])),
            None
        );
        assert_eq!(time(0x17, b"240230000000Z"), Some(1_709_251_200));
        assert_eq!(time(0x17, b"2402300000001"), None);
    }

    fn cert_of(
        key: &rcgen::KeyPair,
        not_before: (i32, u8, u8),
        not_after: (i32, u8, u8),
    ) -> CertificateDer<'static> {
        let mut params =
            rcgen::CertificateParams::new(vec!["localhost".to_owned()]).expect("params");
        params.not_before = rcgen::date_time_ymd(not_before.0, not_before.1, not_before.2);
        params.not_after = rcgen::date_time_ymd(not_after.0, not_after.1, not_after.2);
        params.self_signed(key).expect("cert").der().clone()
    }

    #[test]
    fn a_public_key_pin_checks_the_key_the_dates_and_the_name() {
        let now = UnixTime::now();
        let name = ServerName::try_from("localhost").expect("name");
        let key = rcgen::KeyPair::generate().expect("key");
        let good = cert_of(&key, (2000, 1, 1), (2100, 1, 1));
        let pin = spki_sha256(&good).expect("spki");
        let pinned = verifier(&Pin::PublicKey(pin)).expect("verifier");
        pinned
            .verify_server_cert(&good, &[], &name, &[], now)
            .expect("the pinned certificate");
        // A renewal: another certificate, other dates, the same key.
        let renewed = cert_of(&key, (2001, 1, 1), (2099, 1, 1));
        assert_ne!(renewed, good);
        pinned
            .verify_server_cert(&renewed, &[], &name, &[], now)
            .expect("a renewal with the same key");
        let other = cert_valid((2000, 1, 1), (2100, 1, 1));
        let e = pinned
            .verify_server_cert(&other, std::slice::from_ref(&good), &name, &[], now)
            .expect_err("another key");
        assert!(e.to_string().contains("not the pinned key"), "{e}");
        let elsewhere = ServerName::try_from("elsewhere.example.com").expect("name");
        assert!(
            pinned
                .verify_server_cert(&good, &[], &elsewhere, &[], now)
                .is_err()
        );
        // The dates are those of the certificate presented.
        let expired = cert_of(&key, (2000, 1, 1), (2001, 1, 1));
        let e = pinned
            .verify_server_cert(&expired, &[], &name, &[], now)
            .expect_err("expired");
        assert!(e.to_string().contains("expired"), "{e}");
        let future = cert_of(&key, (2090, 1, 1), (2100, 1, 1));
        let e = pinned
            .verify_server_cert(&future, &[], &name, &[], now)
            .expect_err("not yet valid");
        assert!(e.to_string().contains("not valid yet"), "{e}");
    }

    #[test]
    fn the_pin_text_round_trips_and_refuses_other_lengths() {
        let pin = spki_sha256(&cert_valid((2000, 1, 1), (2100, 1, 1))).expect("spki");
        let text = spki_pin_text(&pin);
        assert_eq!(text.len(), 44);
        assert_eq!(parse_spki_pin(&text), Ok(pin));
        assert!(parse_spki_pin("not base64!").is_err());
        let e = parse_spki_pin("AAAA").expect_err("3 bytes");
        assert!(e.contains("3 bytes"), "{e}");
    }
}

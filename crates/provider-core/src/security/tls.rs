//! TLS: rustls `ServerConfig`s, TLS 1.3 only, ring as the only crypto provider, and the three
//! gRPC security modes of the reference (insecure, TLS, mTLS). A bad keypair or CA bundle is a
//! startup error before any port binds; after that, [`reload`] keeps what is served current
//! with the files, and a broken pair or bundle never replaces a good one.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::RootCertStore;
use rustls::server::WebPkiClientVerifier;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;

mod reload;

pub use reload::{
    GrpcTls, KeypairCheck, KeypairFiles, KeypairWatch, RELOAD_INTERVAL, Reloader, ServedKeypair,
};

/// How the gRPC port is secured, logged at startup as the `security` field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SecurityMode {
    Insecure,
    Tls,
    MutualTls,
}

impl SecurityMode {
    pub fn name(self) -> &'static str {
        match self {
            SecurityMode::Insecure => "insecure",
            SecurityMode::Tls => "TLS",
            SecurityMode::MutualTls => "mTLS",
        }
    }
}

/// The ring provider, the only one this project uses.
pub fn crypto_provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Reads every certificate of a PEM file, strictly (see [`parse_certificates`]).
pub fn read_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let pem = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    parse_certificates(&pem).map_err(|e| format!("{}: {e}", path.display()))
}

/// Parses a PEM certificate bundle strictly: a block that does not decode, or a CERTIFICATE
/// block that is not a well-formed X.509 certificate, fails the whole bundle (an operator who
/// pasted a broken bundle learns it at startup, not at the first handshake). Blocks of other
/// kinds (a private key in a combined file) are skipped; a bundle with no certificate fails.
pub fn parse_certificates(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, String> {
    let mut reader = pem;
    let mut certs = Vec::new();
    loop {
        let block = rustls_pki_types::pem::from_buf(&mut reader)
            .map_err(|e| format!("PEM block {} does not decode: {e}", certs.len() + 1))?;
        let Some((kind, der)) = block else { break };
        if kind != rustls_pki_types::pem::SectionKind::Certificate {
            continue;
        }
        let cert = CertificateDer::from(der);
        // Parsing as a trust anchor checks the X.509 structure without judging its use.
        RootCertStore::empty().add(cert.clone()).map_err(|e| {
            format!(
                "certificate {} is not a valid X.509 certificate: {e}",
                certs.len() + 1
            )
        })?;
        certs.push(cert);
    }
    if certs.is_empty() {
        return Err("no certificates found".into());
    }
    Ok(certs)
}

/// The earliest end of validity (notAfter) among the certificates of a PEM file, in seconds
/// since the Unix epoch: the moment the first certificate of the chain or bundle expires.
pub fn earliest_not_after(path: &Path) -> Result<i64, String> {
    let certs = read_certificates(path)?;
    let mut earliest = i64::MAX;
    for (i, cert) in certs.iter().enumerate() {
        let not_after = not_after_unix(cert)
            .map_err(|e| format!("{}: certificate {}: {e}", path.display(), i + 1))?;
        earliest = earliest.min(not_after);
    }
    Ok(earliest)
}

/// The notAfter of one DER certificate in seconds since the Unix epoch (see [`validity_unix`]).
pub fn not_after_unix(der: &[u8]) -> Result<i64, String> {
    validity_unix(der).map(|(_, not_after)| not_after)
}

/// `(notBefore, notAfter)` of one DER certificate in seconds since the Unix epoch. A small DER
/// walk to `tbsCertificate.validity` (RFC 5280 4.1): certificates are only read, never verified
/// here.
pub fn validity_unix(der: &[u8]) -> Result<(i64, i64), String> {
    const SEQUENCE: u8 = 0x30;
    const VERSION: u8 = 0xa0;
    let (certificate, _) = der_expect(der, SEQUENCE, "Certificate")?;
    let (tbs, _) = der_expect(certificate, SEQUENCE, "tbsCertificate")?;
    let mut rest = tbs;
    if rest.first() == Some(&VERSION) {
        rest = der_element(rest)?.2;
    }
    // serialNumber, signature, issuer: skipped whole.
    for _ in 0..3 {
        rest = der_element(rest)?.2;
    }
    let (validity, _) = der_expect(rest, SEQUENCE, "validity")?;
    let (tag, time, after_not_before) = der_element(validity)?;
    let not_before = der_time(tag, time)?;
    let (tag, time, _) = der_element(after_not_before)?;
    Ok((not_before, der_time(tag, time)?))
}

/// Splits one DER element off `input`: (tag, contents, the bytes after it). Only definite
/// lengths of up to four length octets are accepted (DER forbids the indefinite form).
fn der_element(input: &[u8]) -> Result<(u8, &[u8], &[u8]), String> {
    let (&tag, rest) = input.split_first().ok_or("truncated DER: no tag")?;
    let (&first, mut rest) = rest.split_first().ok_or("truncated DER: no length")?;
    let len = if first < 0x80 {
        usize::from(first)
    } else {
        let octets = usize::from(first & 0x7f);
        if octets == 0 || octets > 4 {
            return Err(format!("unsupported DER length form 0x{first:02x}"));
        }
        if rest.len() < octets {
            return Err("truncated DER length".into());
        }
        let (bytes, after) = rest.split_at(octets);
        rest = after;
        bytes.iter().fold(0usize, |n, b| (n << 8) | usize::from(*b))
    };
    if rest.len() < len {
        return Err(format!(
            "truncated DER: element of {len} bytes, {} left",
            rest.len()
        ));
    }
    let (contents, after) = rest.split_at(len);
    Ok((tag, contents, after))
}

fn der_expect<'a>(input: &'a [u8], tag: u8, what: &str) -> Result<(&'a [u8], &'a [u8]), String> {
    let (found, contents, rest) = der_element(input)?;
    if found != tag {
        return Err(format!(
            "{what}: expected DER tag 0x{tag:02x}, found 0x{found:02x}"
        ));
    }
    Ok((contents, rest))
}

/// A UTCTime (`YYMMDDHHMMSSZ`, years 1950..2049) or GeneralizedTime (`YYYYMMDDHHMMSSZ`), the
/// two forms RFC 5280 allows, as Unix seconds.
fn der_time(tag: u8, text: &[u8]) -> Result<i64, String> {
    const UTC_TIME: u8 = 0x17;
    const GENERALIZED_TIME: u8 = 0x18;
    let digits = |range: std::ops::Range<usize>| -> Result<i64, String> {
        let part = text.get(range).ok_or("truncated time")?;
        part.iter().try_fold(0i64, |n, b| {
            b.is_ascii_digit()
                .then(|| n * 10 + i64::from(b - b'0'))
                .ok_or_else(|| format!("time {:?} is not digits", String::from_utf8_lossy(text)))
        })
    };
    let (year, at) = match (tag, text.len()) {
        (UTC_TIME, 13) => {
            let yy = digits(0..2)?;
            (if yy < 50 { 2000 + yy } else { 1900 + yy }, 2)
        }
        (GENERALIZED_TIME, 15) => (digits(0..4)?, 4),
        (UTC_TIME | GENERALIZED_TIME, _) => {
            return Err(format!(
                "time {:?} is not in the form RFC 5280 requires",
                String::from_utf8_lossy(text)
            ));
        }
        _ => {
            return Err(format!(
                "validity: expected a time, found DER tag 0x{tag:02x}"
            ));
        }
    };
    if text.last() != Some(&b'Z') {
        return Err(format!(
            "time {:?} is not UTC (Z)",
            String::from_utf8_lossy(text)
        ));
    }
    let month = digits(at..at + 2)?;
    let day = digits(at + 2..at + 4)?;
    let hour = digits(at + 4..at + 6)?;
    let minute = digits(at + 6..at + 8)?;
    let second = digits(at + 8..at + 10)?;
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let month_days = match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if leap => 29,
        2 => 28,
        _ => 0,
    };
    if day < 1 || day > month_days || hour > 23 || minute > 59 || second > 59 {
        return Err(format!(
            "time {:?} is not a valid date",
            String::from_utf8_lossy(text)
        ));
    }
    Ok(days_from_civil(year, month, day) * 86_400 + hour * 3_600 + minute * 60 + second)
}

/// Days from 1970-01-01 to a proleptic Gregorian date (H. Hinnant's `days_from_civil`).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let year_of_era = y - era * 400;
    let shifted_month = (month + 9) % 12;
    let day_of_year = (153 * shifted_month + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

/// Reads the first private key of a PEM file.
pub fn read_private_key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    let pem = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    PrivateKeyDer::from_pem_slice(&pem)
        .map_err(|e| format!("{}: no usable private key ({e})", path.display()))
}

/// A TLS 1.3-only server config with the given ALPN protocols and, when `client_roots` is set,
/// required and verified client certificates.
pub fn server_config(
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    client_roots: Option<RootCertStore>,
    alpn: &[&[u8]],
) -> Result<rustls::ServerConfig, String> {
    let provider = crypto_provider();
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?;
    let builder = match client_roots {
        Some(roots) => {
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| e.to_string())?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(certs, key)
        .map_err(|e| e.to_string())?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

/// A TLS 1.3-only server config serving whatever `keypair` holds at each handshake, with the
/// given ALPN protocols and, when `client_verifier` is set, required and verified client
/// certificates.
pub fn serving_config(
    keypair: Arc<ServedKeypair>,
    client_verifier: Option<Arc<dyn rustls::server::danger::ClientCertVerifier>>,
    alpn: &[&[u8]],
) -> Result<rustls::ServerConfig, String> {
    let builder = rustls::ServerConfig::builder_with_provider(crypto_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?;
    let builder = match client_verifier {
        Some(verifier) => builder.with_client_cert_verifier(verifier),
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_cert_resolver(keypair);
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

/// The gRPC TLS flags.
#[derive(Clone, Debug, Default)]
pub struct TlsFlags {
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub ca: Option<PathBuf>,
}

/// Validates the flags and loads the gRPC server TLS, with the reference's messages. What it
/// serves follows the files once [`GrpcTls::reloader`] runs.
pub fn grpc_tls(flags: &TlsFlags) -> Result<(SecurityMode, Option<GrpcTls>), String> {
    let (cert, key) = match (&flags.cert, &flags.key, &flags.ca) {
        (None, None, Some(_)) => return Err("--tls-ca set without --tls-cert/--tls-key".into()),
        (None, None, None) => return Ok((SecurityMode::Insecure, None)),
        (Some(cert), Some(key), _) => (cert, key),
        _ => return Err("both --tls-cert and --tls-key are required to enable TLS".into()),
    };
    let files = KeypairFiles {
        certificate: "grpc_server",
        cert: cert.clone(),
        key: key.clone(),
    };
    let mode = match flags.ca {
        None => SecurityMode::Tls,
        Some(_) => SecurityMode::MutualTls,
    };
    let tls = GrpcTls::load(files, flags.ca.as_deref())?;
    Ok((mode, Some(tls)))
}

/// The expiry of each gRPC certificate file the flags name, for the startup metrics:
/// `grpc_server` (the keypair's chain) and `grpc_client_ca` (the client CA bundle).
pub fn grpc_expiries(flags: &TlsFlags) -> Vec<(&'static str, Result<i64, String>)> {
    let mut expiries = Vec::new();
    if let Some(cert) = &flags.cert {
        expiries.push(("grpc_server", earliest_not_after(cert)));
    }
    if let Some(ca) = &flags.ca {
        expiries.push(("grpc_client_ca", earliest_not_after(ca)));
    }
    expiries
}

/// `YYYY-MM-DD` of a Unix time, for expiry lines.
pub fn unix_date(secs: i64) -> String {
    let days = secs.div_euclid(86_400);
    // Civil-from-days (proleptic Gregorian), as in Howard Hinnant's date algorithms.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

/// Takes accepted connections and yields only those whose TLS handshake succeeded within
/// `handshake_timeout`; failed handshakes (no client certificate, TLS 1.2, garbage) are dropped
/// at the TLS layer before any handler runs.
pub fn incoming<IO>(
    mut accepted: mpsc::Receiver<(IO, std::net::SocketAddr)>,
    tls: GrpcTls,
    handshake_timeout: Duration,
) -> ReceiverStream<Result<TlsStream<IO>, io::Error>>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = tokio::select! {
                accepted = accepted.recv() => match accepted {
                    Some(conn) => conn,
                    None => return,
                },
                // The server stopped: stop accepting (dropping `accepted` releases the port).
                _ = tx.closed() => return,
            };
            // The config of this moment: a client CA reloaded later applies to later connections.
            let acceptor = TlsAcceptor::from(tls.current());
            let tx = tx.clone();
            tokio::spawn(async move {
                match tokio::time::timeout(handshake_timeout, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(Ok(stream)).await;
                    }
                    Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake refused"),
                    Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ca_pem() -> Vec<u8> {
        std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../testdata/pki/ca.pem"
        ))
        .expect("the committed test CA")
    }

    #[test]
    fn a_good_bundle_parses() {
        let certs = parse_certificates(&ca_pem()).expect("parses");
        assert_eq!(certs.len(), 1);
    }

    #[test]
    fn a_block_that_does_not_decode_fails_the_bundle() {
        let mut pem = ca_pem();
        pem.extend_from_slice(
            b"-----BEGIN CERTIFICATE-----\nnot*base64!\n-----END CERTIFICATE-----\n",
        );
        let err = parse_certificates(&pem).expect_err("garbage block refused");
        assert!(err.contains("PEM block 2 does not decode"), "{err}");
    }

    #[test]
    fn a_certificate_block_that_is_not_x509_fails_the_bundle() {
        let mut pem = ca_pem();
        // Valid base64 ("hello world, not a certificate"), but no DER certificate inside.
        pem.extend_from_slice(
            b"-----BEGIN CERTIFICATE-----\naGVsbG8gd29ybGQsIG5vdCBhIGNlcnRpZmljYXRl\n-----END CERTIFICATE-----\n",
        );
        let err = parse_certificates(&pem).expect_err("non-certificate refused");
        assert!(
            err.contains("certificate 2 is not a valid X.509 certificate"),
            "{err}"
        );
    }

    #[test]
    fn an_unterminated_block_fails_the_bundle() {
        let mut pem = ca_pem();
        pem.extend_from_slice(b"-----BEGIN CERTIFICATE-----\nMIIB\n");
        assert!(parse_certificates(&pem).is_err());
    }

    #[test]
    fn a_bundle_without_certificates_fails() {
        let err = parse_certificates(b"just text\n").expect_err("empty bundle refused");
        assert_eq!(err, "no certificates found");
    }

    #[test]
    fn the_client_ca_flag_names_the_file_of_a_broken_bundle() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = dir.path().join("ca.pem");
        let mut pem = ca_pem();
        pem.extend_from_slice(b"-----BEGIN CERTIFICATE-----\n@@@@\n-----END CERTIFICATE-----\n");
        std::fs::write(&ca, pem).expect("write");
        let pki = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/pki");
        let flags = TlsFlags {
            cert: Some(Path::new(pki).join("server.pem")),
            key: Some(Path::new(pki).join("server-key.pem")),
            ca: Some(ca.clone()),
        };
        let err = grpc_tls(&flags).expect_err("broken client CA refused");
        assert!(
            err.contains("read client CA") && err.contains(&ca.display().to_string()),
            "{err}"
        );
    }

    /// A self-signed certificate valid from the start of `from` to `until` plus `seconds`.
    fn certificate_valid(
        from: (i32, u8, u8),
        until: (i32, u8, u8),
        seconds: u64,
    ) -> rcgen::Certificate {
        let mut params =
            rcgen::CertificateParams::new(vec!["localhost".to_owned()]).expect("params");
        params.not_before = rcgen::date_time_ymd(from.0, from.1, from.2);
        params.not_after = rcgen::date_time_ymd(until.0, until.1, until.2)
            + std::time::Duration::from_secs(seconds);
        let key = rcgen::KeyPair::generate().expect("key");
        params.self_signed(&key).expect("self-signed")
    }

    #[test]
    fn not_after_is_read_from_utc_and_generalized_times() {
        let hms = 3_600 + 2 * 60 + 3;
        // (notAfter, its Unix seconds as computed by `date -u -d ... +%s`)
        let cases = [
            // UTCTime, a leap day, with hours, minutes and seconds.
            ((2028, 2, 29), hms, 1_835_398_923),
            // The last year UTCTime covers, and the first that needs GeneralizedTime.
            ((2049, 12, 31), 0, 2_524_521_600),
            ((2050, 1, 1), 0, 2_524_608_000),
            ((2100, 3, 1), hms, 4_107_546_123),
        ];
        for (until, seconds, unix) in cases {
            let cert = certificate_valid((1975, 6, 1), until, seconds);
            assert_eq!(
                not_after_unix(cert.der()),
                Ok(unix),
                "{until:?} +{seconds}s"
            );
        }
    }

    #[test]
    fn the_earliest_not_after_of_a_bundle_is_reported() {
        let dir = tempfile::tempdir().expect("tempdir");
        let later = certificate_valid((2020, 1, 1), (2031, 1, 1), 0);
        let sooner = certificate_valid((2020, 1, 1), (2030, 1, 1), 0);
        let path = dir.path().join("bundle.pem");
        std::fs::write(&path, format!("{}{}", later.pem(), sooner.pem())).expect("write");
        assert_eq!(earliest_not_after(&path), Ok(1_893_456_000));
        let missing = dir.path().join("missing.pem");
        let err = earliest_not_after(&missing).expect_err("missing file");
        assert!(err.contains("missing.pem"), "{err}");
    }

    #[test]
    fn the_committed_test_certificates_have_a_not_after() {
        let certs = parse_certificates(&ca_pem()).expect("parses");
        let not_after = not_after_unix(&certs[0]).expect("notAfter");
        // Any date after 2020 and before 2200 is plausible; the walk must not misread it.
        assert!(
            (1_577_836_800..7_258_118_400).contains(&not_after),
            "{not_after}"
        );
    }

    #[test]
    fn malformed_der_is_refused_not_misread() {
        let cert = certificate_valid((2020, 1, 1), (2030, 1, 1), 0);
        let der = cert.der().to_vec();
        // Every truncation fails cleanly.
        for len in 0..der.len() {
            assert!(not_after_unix(&der[..len]).is_err(), "truncated at {len}");
        }
        assert!(
            not_after_unix(b"\x30\x80\x00\x00").is_err(),
            "indefinite length"
        );
        assert!(not_after_unix(b"\x02\x01\x00").is_err(), "not a SEQUENCE");
        // The same validity with a time that is not a date.
        let at = der
            .windows(13)
            .position(|w| w == b"300101000000Z")
            .expect("the UTCTime notAfter is in the DER");
        for bad in [
            &b"301301000000Z"[..],
            b"300230000000Z",
            b"30010124000Z0",
            b"3001010000001",
        ] {
            let mut broken = der.clone();
            broken[at..at + 13].copy_from_slice(bad);
            assert!(
                not_after_unix(&broken).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn civil_days_match_known_dates() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(days_from_civil(1969, 12, 31), -1);
    }
}

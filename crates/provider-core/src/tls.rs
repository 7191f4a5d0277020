//! TLS settled at startup: one rustls `ServerConfig`, TLS 1.3 only, ring as the only crypto
//! provider, and the three gRPC security modes of the reference (insecure, TLS, mTLS). A bad
//! keypair or CA bundle is a startup error before any port binds.

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

/// The gRPC TLS flags.
#[derive(Clone, Debug, Default)]
pub struct TlsFlags {
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub ca: Option<PathBuf>,
}

/// Validates the flags and loads the gRPC server TLS config, with the reference's messages.
pub fn grpc_tls(
    flags: &TlsFlags,
) -> Result<(SecurityMode, Option<Arc<rustls::ServerConfig>>), String> {
    let (cert, key) = match (&flags.cert, &flags.key, &flags.ca) {
        (None, None, Some(_)) => return Err("--tls-ca set without --tls-cert/--tls-key".into()),
        (None, None, None) => return Ok((SecurityMode::Insecure, None)),
        (Some(cert), Some(key), _) => (cert, key),
        _ => return Err("both --tls-cert and --tls-key are required to enable TLS".into()),
    };
    let certs = read_certificates(cert).map_err(|e| format!("load TLS keypair: {e}"))?;
    let private_key = read_private_key(key).map_err(|e| format!("load TLS keypair: {e}"))?;
    let (mode, roots) = match &flags.ca {
        None => (SecurityMode::Tls, None),
        Some(ca) => {
            let certs = read_certificates(ca).map_err(|e| format!("read client CA {e}"))?;
            let mut roots = RootCertStore::empty();
            for cert in certs {
                roots
                    .add(cert)
                    .map_err(|e| format!("read client CA {}: {e}", ca.display()))?;
            }
            (SecurityMode::MutualTls, Some(roots))
        }
    };
    let config = server_config(certs, private_key, roots, &[b"h2"])
        .map_err(|e| format!("load TLS keypair: {e}"))?;
    Ok((mode, Some(Arc::new(config))))
}

/// Takes accepted connections and yields only those whose TLS handshake succeeded within
/// `handshake_timeout`; failed handshakes (no client certificate, TLS 1.2, garbage) are dropped
/// at the TLS layer before any handler runs.
pub fn incoming<IO>(
    mut accepted: mpsc::Receiver<(IO, std::net::SocketAddr)>,
    config: Arc<rustls::ServerConfig>,
    handshake_timeout: Duration,
) -> ReceiverStream<Result<TlsStream<IO>, io::Error>>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (tx, rx) = mpsc::channel(64);
    let acceptor = TlsAcceptor::from(config);
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
            let acceptor = acceptor.clone();
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
}

//! `cargo xtask certs [--out DIR]`: generates the committed test PKI (default `testdata/pki/`)
//! with rcgen on ring, all PEM:
//!
//! - `ca.pem` / `ca-key.pem`: the test CA, trusted by servers (`--tls-ca`) and test clients;
//! - `server.pem` / `server-key.pem`: `localhost` + IP `127.0.0.1`, ServerAuth, signed by the CA;
//! - `client.pem` / `client-key.pem`: ClientAuth, signed by the CA;
//! - `other-ca.pem` / `other-ca-key.pem`: an unrelated CA, and its own
//!   `other-server*.pem` and `other-client*.pem`, for the rejection tests.
//!
//! The certificates are valid from 2024 to 2124 so the committed files never expire under a
//! test run. Regenerating replaces every file; tests read them at run time, so nothing else
//! needs to change.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, date_time_ymd,
};

use crate::repo;

/// Every file the PKI consists of, in the order they are written.
pub(crate) const FILES: [&str; 12] = [
    "ca.pem",
    "ca-key.pem",
    "server.pem",
    "server-key.pem",
    "client.pem",
    "client-key.pem",
    "other-ca.pem",
    "other-ca-key.pem",
    "other-server.pem",
    "other-server-key.pem",
    "other-client.pem",
    "other-client-key.pem",
];

pub(crate) fn run(args: &[String]) -> Result<()> {
    let out = match args {
        [] => repo::root().join("testdata").join("pki"),
        [flag, dir] if flag == "--out" => PathBuf::from(dir),
        _ => bail!("usage: cargo xtask certs [--out DIR]"),
    };
    let written = generate(&out)?;
    for path in written {
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// Writes the whole PKI into `dir` and returns the paths written.
pub(crate) fn generate(dir: &Path) -> Result<Vec<PathBuf>> {
    fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let mut files = Vec::new();
    for (prefix, ca_name) in [("", "BigFleet test CA"), ("other-", "Unrelated test CA")] {
        let (ca, ca_key_pem) = authority(ca_name)?;
        files.push((format!("{prefix}ca.pem"), ca.pem()));
        files.push((format!("{prefix}ca-key.pem"), ca_key_pem));

        let server = leaf(
            &format!("{ca_name} server"),
            &["localhost", "127.0.0.1"],
            ExtendedKeyUsagePurpose::ServerAuth,
        )?;
        let (cert, key) = sign(server, &ca)?;
        files.push((format!("{prefix}server.pem"), cert));
        files.push((format!("{prefix}server-key.pem"), key));

        let client = leaf(
            &format!("{ca_name} client"),
            &["bigfleet-test-client"],
            ExtendedKeyUsagePurpose::ClientAuth,
        )?;
        let (cert, key) = sign(client, &ca)?;
        files.push((format!("{prefix}client.pem"), cert));
        files.push((format!("{prefix}client-key.pem"), key));
    }
    let mut written = Vec::new();
    for (name, pem) in files {
        debug_assert!(FILES.contains(&name.as_str()), "{name} is listed in FILES");
        let path = dir.join(&name);
        fs::write(&path, pem).with_context(|| format!("write {}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

fn validity(params: &mut CertificateParams) {
    params.not_before = date_time_ymd(2024, 1, 1);
    params.not_after = date_time_ymd(2124, 1, 1);
}

/// A self-signed CA and its key as PEM.
fn authority(common_name: &str) -> Result<(CertifiedIssuer<'static, KeyPair>, String)> {
    let mut params = CertificateParams::default();
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    validity(&mut params);
    let key = KeyPair::generate().context("generate CA key")?;
    let key_pem = key.serialize_pem();
    let ca = CertifiedIssuer::self_signed(params, key).context("self-sign CA")?;
    Ok((ca, key_pem))
}

/// The parameters of an end-entity certificate for `names` (DNS names or IP addresses).
fn leaf(
    common_name: &str,
    names: &[&str],
    usage: ExtendedKeyUsagePurpose,
) -> Result<CertificateParams> {
    let mut params =
        CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>())
            .context("subject alternative names")?;
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![usage];
    params.use_authority_key_identifier_extension = true;
    validity(&mut params);
    Ok(params)
}

/// Signs `params` with a fresh key; returns (certificate PEM, key PEM).
fn sign(params: CertificateParams, issuer: &Issuer<'_, KeyPair>) -> Result<(String, String)> {
    let key = KeyPair::generate().context("generate leaf key")?;
    let cert = params.signed_by(&key, issuer).context("sign leaf")?;
    Ok((cert.pem(), key.serialize_pem()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_every_listed_file_as_pem() {
        let dir = std::env::temp_dir().join(format!("xtask-certs-{}", std::process::id()));
        let written = generate(&dir).unwrap();
        let names: Vec<String> = written
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, FILES);
        for path in &written {
            let text = fs::read_to_string(path).unwrap();
            let label = if path.to_string_lossy().ends_with("-key.pem") {
                "-----BEGIN PRIVATE KEY-----"
            } else {
                "-----BEGIN CERTIFICATE-----"
            };
            assert!(text.starts_with(label), "{}: {text}", path.display());
        }
        fs::remove_dir_all(&dir).unwrap();
    }
}

//! `cargo xtask certs [--out DIR]`: generates the committed test PKI (default `testdata/pki/`)
//! with rcgen on ring, all PEM:
//!
//! - `ca.pem` / `ca-key.pem`: the test CA, trusted by servers (`--tls-ca`) and test clients;
//! - `server.pem` / `server-key.pem`: `localhost` + IP `127.0.0.1`, ServerAuth, signed by the CA;
//! - `client.pem` / `client-key.pem`: ClientAuth, signed by the CA, the shard identity URI SAN
//!   `bigfleet://shard/test-shard` (BigFleet ADR-0048), so test clients are that shard;
//! - `admin-client.pem` / `admin-client-key.pem`: ClientAuth, signed by the CA, the URI SAN
//!   `bigfleet://admin` (reads pass, mutations are refused under `--shard-identity=enforce`);
//! - `other-ca.pem` / `other-ca-key.pem`: an unrelated CA, and its own
//!   `other-server*.pem` and `other-client*.pem`, for the rejection tests.
//!
//! The certificates are valid from 2024 to 2124 so the committed files never expire under a
//! test run. Regenerating replaces every file; tests read them at run time, so nothing else
//! needs to change. `--missing` writes only the files that are not in DIR yet, signing new
//! leaves with the CA already there, so the other files stay as they are.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType, date_time_ymd,
};

use crate::repo;

/// The shard id of the test CA's `client.pem` (its URI SAN is `bigfleet://shard/test-shard`).
pub(crate) const TEST_SHARD: &str = "test-shard";

/// Every file the PKI consists of, in the order they are written.
pub(crate) const FILES: [&str; 14] = [
    "ca.pem",
    "ca-key.pem",
    "server.pem",
    "server-key.pem",
    "client.pem",
    "client-key.pem",
    "admin-client.pem",
    "admin-client-key.pem",
    "other-ca.pem",
    "other-ca-key.pem",
    "other-server.pem",
    "other-server-key.pem",
    "other-client.pem",
    "other-client-key.pem",
];

pub(crate) fn run(args: &[String]) -> Result<()> {
    let mut out = repo::root().join("testdata").join("pki");
    let mut missing = false;
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match (arg.as_str(), args.clone().next()) {
            ("--out", Some(dir)) => {
                out = PathBuf::from(dir);
                args.next();
            }
            ("--missing", _) => missing = true,
            _ => bail!("usage: cargo xtask certs [--out DIR] [--missing]"),
        }
    }
    let written = if missing {
        generate_missing(&out)?
    } else {
        generate(&out)?
    };
    for path in written {
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// Writes the whole PKI into `dir` and returns the paths written.
pub(crate) fn generate(dir: &Path) -> Result<Vec<PathBuf>> {
    fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    write(dir, mint(dir, |_| true, false)?)
}

/// Writes only the files of the PKI that are not in `dir`, signing new leaves with the CA in
/// `dir` (a leaf without its CA is an error), and returns the paths written.
pub(crate) fn generate_missing(dir: &Path) -> Result<Vec<PathBuf>> {
    fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    write(dir, mint(dir, |name| !dir.join(name).exists(), true)?)
}

fn write(dir: &Path, files: Vec<(String, String)>) -> Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    for (name, pem) in files {
        debug_assert!(FILES.contains(&name.as_str()), "{name} is listed in FILES");
        let path = dir.join(&name);
        fs::write(&path, pem).with_context(|| format!("write {}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

/// The files `wanted` selects (a certificate and its key go together), with the CA of `dir`
/// when `reuse_ca` and it is there.
fn mint(
    dir: &Path,
    wanted: impl Fn(&str) -> bool,
    reuse_ca: bool,
) -> Result<Vec<(String, String)>> {
    let mut files = Vec::new();
    for (prefix, ca_name) in [("", "BigFleet test CA"), ("other-", "Unrelated test CA")] {
        let ca_key_file = dir.join(format!("{prefix}ca-key.pem"));
        let minted_ca = !(reuse_ca && ca_key_file.exists());
        if reuse_ca && minted_ca && dir.join(format!("{prefix}ca.pem")).exists() {
            bail!(
                "{prefix}ca.pem is in {} without {prefix}ca-key.pem: nothing can be signed \
                 with it",
                dir.display()
            );
        }
        let ca = if !minted_ca {
            let pem = fs::read_to_string(&ca_key_file)
                .with_context(|| format!("read {}", ca_key_file.display()))?;
            let key = KeyPair::from_pem(&pem)
                .with_context(|| format!("parse {}", ca_key_file.display()))?;
            // The same name and key identifier method as `authority`: leaves chain to it.
            Issuer::new(authority_params(ca_name), key)
        } else {
            let (ca, ca_key_pem) = authority(ca_name)?;
            files.push((format!("{prefix}ca.pem"), ca.pem()));
            files.push((format!("{prefix}ca-key.pem"), ca_key_pem));
            let key = KeyPair::from_pem(&files[files.len() - 1].1).context("CA key")?;
            Issuer::new(authority_params(ca_name), key)
        };
        let mut leaves = vec![
            (
                "server",
                leaf(
                    &format!("{ca_name} server"),
                    &["localhost", "127.0.0.1"],
                    &[],
                    ExtendedKeyUsagePurpose::ServerAuth,
                )?,
            ),
            (
                "client",
                leaf(
                    &format!("{ca_name} client"),
                    &["bigfleet-test-client"],
                    // The unrelated CA's client is refused in the TLS layer; it has no identity.
                    &(if prefix.is_empty() {
                        vec![format!("bigfleet://shard/{TEST_SHARD}")]
                    } else {
                        Vec::new()
                    }),
                    ExtendedKeyUsagePurpose::ClientAuth,
                )?,
            ),
        ];
        if prefix.is_empty() {
            leaves.push((
                "admin-client",
                leaf(
                    &format!("{ca_name} admin client"),
                    &["bigfleet-test-admin"],
                    &["bigfleet://admin".to_owned()],
                    ExtendedKeyUsagePurpose::ClientAuth,
                )?,
            ));
        }
        for (name, params) in leaves {
            let (cert_file, key_file) = (
                format!("{prefix}{name}.pem"),
                format!("{prefix}{name}-key.pem"),
            );
            if reuse_ca && minted_ca && dir.join(&cert_file).exists() {
                bail!(
                    "{cert_file} is in {} but {prefix}ca-key.pem is not: it would not chain to \
                     a new CA; regenerate everything without --missing",
                    dir.display()
                );
            }
            if !wanted(&cert_file) && !wanted(&key_file) {
                continue;
            }
            let (cert, key) = sign(params, &ca)?;
            files.push((cert_file, cert));
            files.push((key_file, key));
        }
    }
    // In FILES order.
    files.sort_by_key(|(name, _)| FILES.iter().position(|f| f == name));
    Ok(files)
}

fn validity(params: &mut CertificateParams) {
    params.not_before = date_time_ymd(2024, 1, 1);
    params.not_after = date_time_ymd(2124, 1, 1);
}

/// The parameters of a test CA named `common_name`.
fn authority_params(common_name: &str) -> CertificateParams {
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
    params
}

/// A self-signed CA and its key as PEM.
fn authority(common_name: &str) -> Result<(CertifiedIssuer<'static, KeyPair>, String)> {
    let key = KeyPair::generate().context("generate CA key")?;
    let key_pem = key.serialize_pem();
    let ca =
        CertifiedIssuer::self_signed(authority_params(common_name), key).context("self-sign CA")?;
    Ok((ca, key_pem))
}

/// The parameters of an end-entity certificate for `names` (DNS names or IP addresses) and
/// `uris` (URI SANs).
fn leaf(
    common_name: &str,
    names: &[&str],
    uris: &[String],
    usage: ExtendedKeyUsagePurpose,
) -> Result<CertificateParams> {
    let mut params =
        CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>())
            .context("subject alternative names")?;
    for uri in uris {
        let uri = uri.as_str().try_into().context("URI SAN")?;
        params.subject_alt_names.push(SanType::URI(uri));
    }
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

    #[test]
    fn missing_files_are_signed_by_the_ca_already_there_and_nothing_else_changes() {
        let dir = std::env::temp_dir().join(format!("xtask-certs-missing-{}", std::process::id()));
        generate(&dir).unwrap();
        let before: Vec<String> = FILES
            .iter()
            .map(|f| fs::read_to_string(dir.join(f)).unwrap())
            .collect();
        fs::remove_file(dir.join("client.pem")).unwrap();
        fs::remove_file(dir.join("client-key.pem")).unwrap();
        let written = generate_missing(&dir).unwrap();
        assert_eq!(
            written,
            [dir.join("client.pem"), dir.join("client-key.pem")]
        );
        for (file, old) in FILES.iter().zip(&before) {
            let now = fs::read_to_string(dir.join(file)).unwrap();
            assert_eq!(now == *old, !file.starts_with("client"), "{file}");
        }
        // A leaf whose CA key is gone is not silently re-signed by a new CA.
        fs::remove_file(dir.join("ca-key.pem")).unwrap();
        fs::remove_file(dir.join("client.pem")).unwrap();
        assert!(generate_missing(&dir).is_err());
        fs::remove_dir_all(&dir).unwrap();
    }
}

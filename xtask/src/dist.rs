//! `cargo xtask dist [--test] [--base IMAGE]`: builds the statically linked release binaries,
//! the Debian package of `bigfleet-agent` and the two provider images with buildah, and with
//! `--test` checks the package the way dpkg and systemd would take it and each image the way
//! a cluster would run it.
//!
//! The package, `target/dist/bigfleet-agent_<version>_amd64.deb`, is put together by
//! [`deb`] with `dpkg-deb` from the release binary and `deploy/digitalocean/deb`. Its test
//! ([`check::deb`]) reads `dpkg-deb --info`/`--contents` (exact files, modes, root:root),
//! the control fields and the unit against the agent's flags, runs `systemd-analyze verify`
//! where that tool exists and lintian (no errors, no warnings), and runs `--help` from the
//! unpacked package.
//!
//! The images come from `deploy/<provider>/Dockerfile` with `BUILDER=prebuilt`: cargo builds
//! on the host, and a small build context under `target/dist/<provider>/context` carries the
//! binaries, the host's CA bundle (Debian's ca-certificates) and `deploy/rootfs`. Nothing is
//! pulled when the base is `scratch` (the default here), so this runs without any registry.
//!
//! The image test, for every image:
//! - the config runs as 65532:65532, has the binary as entrypoint and exposes the right ports;
//! - the image, counted as the sum of its uncompressed layers, stays under [`MAX_IMAGE_BYTES`];
//! - the filesystem holds no shell, and its binaries are static executables; on `scratch` it
//!   holds exactly the files we put there;
//! - every binary answers `--help` when run as uid 65532 inside the image;
//! - each provider, started inside the image on its fake backend on loopback ports, reports
//!   SERVING over `grpc.health.v1`, answers `/healthz` and `/readyz`, and exits 0 on SIGTERM.

use std::collections::BTreeSet;
use std::fs::{self, File};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};

mod check;
mod deb;

/// Upper bound for one image: the sum of its uncompressed layers. Our binaries are about
/// 10 MB each when stripped, so this leaves room for growth while catching a debug build,
/// an unstripped binary or a base image that brings a distribution along.
pub(crate) const MAX_IMAGE_BYTES: u64 = 30_000_000;

/// The one target the images are built for; `+crt-static` links glibc statically on it.
const TARGET: &str = "x86_64-unknown-linux-gnu";
const RUNTIME_USER: &str = "65532:65532";
const HOST_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";
const IMAGE_CA_BUNDLE: &str = "etc/ssl/certs/ca-certificates.crt";
/// How long a provider may take from exec to SERVING inside the container.
const SERVE_DEADLINE: Duration = Duration::from_secs(60);
/// SIGTERM to exit: the providers' default shutdown grace (25s) plus a margin.
const STOP_DEADLINE: Duration = Duration::from_secs(35);

struct Binary {
    name: &'static str,
    /// A flag `--help` must list, so a placeholder binary does not pass for the real one.
    help_mentions: &'static str,
    /// Whether this binary is a provider that can be started on its fake backend.
    provider: bool,
}

struct Image {
    /// Provider name: cargo package, `deploy/<name>/Dockerfile`, image `bigfleet-<name>`.
    name: &'static str,
    /// The first binary is the entrypoint.
    binaries: &'static [Binary],
    ports: &'static [u16],
}

const IMAGES: [Image; 2] = [
    Image {
        name: "hetzner",
        binaries: &[Binary {
            name: "hetzner",
            help_mentions: "--use-fake-backend",
            provider: true,
        }],
        ports: &[9000, 9090],
    },
    Image {
        name: "digitalocean",
        binaries: &[
            Binary {
                name: "digitalocean",
                help_mentions: "--use-fake-backend",
                provider: true,
            },
            Binary {
                name: "bigfleet-agent",
                help_mentions: "--config",
                provider: false,
            },
        ],
        ports: &[9000, 9090, 9443],
    },
];

struct Options {
    test: bool,
    base: String,
}

const USAGE: &str = "\
usage: cargo xtask dist [--test] [--base IMAGE]

Builds static release binaries ({TARGET}), the Debian package
target/dist/bigfleet-agent_<version>_amd64.deb (dpkg-deb) and the images
localhost/bigfleet-hetzner and localhost/bigfleet-digitalocean with buildah (vfs storage,
chroot isolation).

  --base IMAGE  runtime base image (default: scratch; production uses
                gcr.io/distroless/static-debian12:nonroot)
  --test        then test the package: members, modes and owners, control fields, the unit
                (against the agent's flags and with systemd-analyze verify), lintian,
                --help from the unpacked package; and each image: config, size, contents,
                --help as uid 65532, fake-backend serving with gRPC health, graceful SIGTERM";

fn parse_options(args: &[String]) -> Result<Option<Options>> {
    let mut options = Options {
        test: false,
        base: "scratch".to_owned(),
    };
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--test" => options.test = true,
            "--base" => options.base = args.next().context("--base needs an image")?.clone(),
            "-h" | "--help" => return Ok(None),
            other => match other.strip_prefix("--base=") {
                Some(base) => options.base = base.to_owned(),
                None => bail!("unknown argument {other:?}\n\n{}", usage()),
            },
        }
    }
    ensure!(!options.base.is_empty(), "--base must name an image");
    Ok(Some(options))
}

fn usage() -> String {
    USAGE.replace("{TARGET}", TARGET)
}

pub(crate) fn run(args: &[String]) -> Result<()> {
    let Some(options) = parse_options(args)? else {
        println!("{}", usage());
        return Ok(());
    };
    let root = crate::repo::root();
    let target_dir = target_dir(&root);
    let version = env!("CARGO_PKG_VERSION");

    build_binaries(&root)?;
    let release = target_dir.join(TARGET).join("release");
    for binary in IMAGES.iter().flat_map(|image| image.binaries) {
        let path = release.join(binary.name);
        ensure_static(&path)?;
    }

    let dist = target_dir.join("dist");
    let started = Instant::now();
    let package = deb::build(&root, &dist, &release, version)?;
    println!(
        "dist: built {} in {:.1}s",
        package.display(),
        started.elapsed().as_secs_f64()
    );
    if options.test {
        let started = Instant::now();
        check::deb::test_package(&root, &dist.join("deb/test"), &package, &release, version)?;
        println!(
            "dist: {}: package test passed in {:.1}s",
            deb::file_name(version),
            started.elapsed().as_secs_f64()
        );
    }

    let mut sizes = Vec::new();
    for image in &IMAGES {
        let work = dist.join(image.name);
        let context = stage_context(&root, &work, image, &release)?;
        let tag = format!("localhost/bigfleet-{}:{version}", image.name);
        build_image(&root, &work, &context, image, &tag, &options.base, version)?;
        println!("dist: built {tag} (base {})", options.base);
        if options.test {
            let size = check::test_image(&work, image, &tag, options.base == "scratch")?;
            sizes.push((tag, size));
        }
    }

    if options.test {
        for (tag, size) in &sizes {
            println!(
                "dist: {tag}: {:.1} MB of {:.0} MB allowed",
                *size as f64 / 1e6,
                MAX_IMAGE_BYTES as f64 / 1e6
            );
        }
        // The package, then each image.
        println!("dist: {} passed, 0 failed", sizes.len() + 1);
    }
    Ok(())
}

fn target_dir(root: &Path) -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => root.join(dir),
        None => root.join("target"),
    }
}

fn build_binaries(root: &Path) -> Result<()> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .current_dir(root)
        .args(["build", "--release", "--target", TARGET, "--bins"])
        .args(IMAGES.iter().flat_map(|image| ["--package", image.name]))
        // With --target, RUSTFLAGS reach only the target artefacts, never build scripts or
        // proc macros, and the host's own target/ cache is left alone.
        .env("RUSTFLAGS", "-C target-feature=+crt-static")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .status()
        .context("run cargo build")?;
    ensure!(
        status.success(),
        "cargo build of the release binaries failed ({status})"
    );
    Ok(())
}

/// Fails unless `path` is an ELF executable with no interpreter and no shared-library needs
/// (a static or static-pie binary), which is what `scratch` and distroless static can run.
fn ensure_static(path: &Path) -> Result<()> {
    let elf = fs::read(path).with_context(|| format!("read {}", path.display()))?;
    match static_elf_verdict(&elf) {
        Ok(()) => Ok(()),
        Err(why) => bail!("{} is not a static executable: {why}", path.display()),
    }
}

fn static_elf_verdict(elf: &[u8]) -> Result<()> {
    const PT_DYNAMIC: u32 = 2;
    const PT_INTERP: u32 = 3;
    const DT_NEEDED: u64 = 1;
    let u16_at = |at: usize| -> Result<u16> {
        Ok(u16::from_le_bytes(
            elf.get(at..at + 2).context("truncated ELF")?.try_into()?,
        ))
    };
    let u32_at = |at: usize| -> Result<u32> {
        Ok(u32::from_le_bytes(
            elf.get(at..at + 4).context("truncated ELF")?.try_into()?,
        ))
    };
    let u64_at = |at: usize| -> Result<u64> {
        Ok(u64::from_le_bytes(
            elf.get(at..at + 8).context("truncated ELF")?.try_into()?,
        ))
    };
    ensure!(elf.starts_with(b"\x7fELF"), "not an ELF file");
    ensure!(
        elf.get(4..6) == Some(&[2, 1]),
        "not a 64-bit little-endian ELF file"
    );

    let table = usize::try_from(u64_at(0x20)?)?;
    let entry_size = usize::from(u16_at(0x36)?);
    for index in 0..usize::from(u16_at(0x38)?) {
        let header = table + index * entry_size;
        match u32_at(header)? {
            PT_INTERP => bail!("it names a program interpreter (dynamically linked)"),
            PT_DYNAMIC => {
                let start = usize::try_from(u64_at(header + 8)?)?;
                let len = usize::try_from(u64_at(header + 32)?)?;
                for entry in (start..start + len).step_by(16) {
                    match u64_at(entry)? {
                        0 => break,
                        DT_NEEDED => bail!("it needs shared libraries"),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// Lays out `<work>/context/prebuilt/` as the image's filesystem, for the `prebuilt` stage.
fn stage_context(root: &Path, work: &Path, image: &Image, release: &Path) -> Result<PathBuf> {
    let context = work.join("context");
    if context.exists() {
        fs::remove_dir_all(&context).with_context(|| format!("clear {}", context.display()))?;
    }
    let tree = context.join("prebuilt");
    for binary in image.binaries {
        let to = tree.join("usr/local/bin").join(binary.name);
        install(&release.join(binary.name), &to, 0o755)?;
    }
    let ca = Path::new(HOST_CA_BUNDLE);
    ensure!(
        ca.is_file(),
        "{HOST_CA_BUNDLE} is missing: install Debian's ca-certificates"
    );
    install(ca, &tree.join(IMAGE_CA_BUNDLE), 0o644)?;
    let rootfs = root.join("deploy/rootfs");
    for file in files_under(&rootfs)? {
        install(&rootfs.join(&file), &tree.join(&file), 0o644)?;
    }
    Ok(context)
}

fn install(from: &Path, to: &Path, mode: u32) -> Result<()> {
    if let Some(dir) = to.parent() {
        fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    }
    fs::copy(from, to).with_context(|| format!("copy {} to {}", from.display(), to.display()))?;
    fs::set_permissions(to, fs::Permissions::from_mode(mode))?;
    Ok(())
}

/// Paths of the regular files and symlinks under `dir`, relative to it.
fn files_under(dir: &Path) -> Result<BTreeSet<PathBuf>> {
    let mut files = BTreeSet::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(current) = pending.pop() {
        for entry in
            fs::read_dir(&current).with_context(|| format!("list {}", current.display()))?
        {
            let entry = entry?;
            let path = entry.path();
            if entry.file_type()?.is_dir() {
                pending.push(path);
            } else {
                files.insert(path.strip_prefix(dir)?.to_path_buf());
            }
        }
    }
    Ok(files)
}

fn buildah() -> Command {
    let mut command = Command::new("buildah");
    command.args(["--storage-driver", "vfs"]);
    command
}

/// Runs a command to completion and returns its stdout, or fails with its stderr.
fn output(command: &mut Command) -> Result<String> {
    let Output {
        status,
        stdout,
        stderr,
    } = command
        .output()
        .with_context(|| format!("run {command:?}"))?;
    ensure!(
        status.success(),
        "{command:?} failed ({status}):\n{}{}",
        String::from_utf8_lossy(&stdout),
        String::from_utf8_lossy(&stderr)
    );
    Ok(String::from_utf8(stdout)?)
}

fn build_image(
    root: &Path,
    work: &Path,
    context: &Path,
    image: &Image,
    tag: &str,
    base: &str,
    version: &str,
) -> Result<()> {
    let log_path = work.join("build.log");
    let iid_path = work.join("image.id");
    let log = File::create(&log_path)?;
    let previous = output(buildah().args(["images", "--quiet", "--no-trunc", tag]))
        .ok()
        .map(|id| id.trim().trim_start_matches("sha256:").to_owned());

    let status = buildah()
        .args([
            "bud",
            "--isolation",
            "chroot",
            "--build-arg",
            "BUILDER=prebuilt",
        ])
        .arg("--build-arg")
        .arg(format!("BASE={base}"))
        .arg("--build-arg")
        .arg(format!("VERSION={version}"))
        .arg("--iidfile")
        .arg(&iid_path)
        .arg("--file")
        .arg(root.join("deploy").join(image.name).join("Dockerfile"))
        .args(["--tag", tag])
        .arg(context)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .status()
        .context("run buildah bud (install it with deploy/ci-setup.sh)")?;
    let log = fs::read_to_string(&log_path).unwrap_or_default();
    if !status.success() {
        let tail: Vec<&str> = log.lines().rev().take(40).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!(
            "buildah bud for {tag} failed ({status}); end of {}:\n{}",
            log_path.display(),
            tail.join("\n")
        );
    }

    // Each stage that a later one copies from is committed as an untagged image, and buildah
    // keeps a working container on it; only the final image is wanted. The image this tag
    // pointed at before is now untagged as well.
    let built = fs::read_to_string(&iid_path)?;
    let built = built.trim().trim_start_matches("sha256:").to_owned();
    let mut stale: BTreeSet<String> = log
        .lines()
        .filter_map(|line| line.trim().strip_prefix("Copying config sha256:"))
        .map(|id| id.trim().to_owned())
        .filter(|id| !id.is_empty() && *id != built)
        .collect();
    stale.extend(previous.filter(|id| !id.is_empty() && *id != built));
    remove_images(&stale);
    Ok(())
}

/// Removes the given images and the working containers built on them, as far as possible:
/// an image still used elsewhere (another tag, someone's container) stays.
fn remove_images(ids: &BTreeSet<String>) {
    if ids.is_empty() {
        return;
    }
    let containers = output(buildah().args([
        "containers",
        "--notruncate",
        "--format",
        "{{.ContainerID}} {{.ImageID}}",
    ]))
    .unwrap_or_default();
    for line in containers.lines() {
        if let Some((container, image)) = line.split_once(' ')
            && ids.contains(image.trim())
        {
            quietly(buildah().args(["rm", container]));
        }
    }
    for id in ids {
        quietly(buildah().args(["rmi", id]));
    }
}

/// Runs a clean-up command whose failure changes nothing for the caller.
fn quietly(command: &mut Command) {
    let _ = command.stdout(Stdio::null()).stderr(Stdio::null()).status();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(args: &[&str]) -> Vec<String> {
        args.iter().map(|arg| (*arg).to_owned()).collect()
    }

    #[test]
    fn options() {
        let parsed = parse_options(&strings(&[])).unwrap().unwrap();
        assert!(!parsed.test);
        assert_eq!(parsed.base, "scratch");
        let parsed = parse_options(&strings(&["--test", "--base", "gcr.io/x:y"]))
            .unwrap()
            .unwrap();
        assert!(parsed.test);
        assert_eq!(parsed.base, "gcr.io/x:y");
        assert_eq!(
            parse_options(&strings(&["--base=b"]))
                .unwrap()
                .unwrap()
                .base,
            "b"
        );
        assert!(parse_options(&strings(&["--help"])).unwrap().is_none());
        assert!(parse_options(&strings(&["--base"])).is_err());
        assert!(parse_options(&strings(&["--base="])).is_err());
        assert!(parse_options(&strings(&["--bogus"])).is_err());
    }

    /// A 64-bit ELF header followed by program headers of the given (type, offset, size).
    fn elf(headers: &[(u32, u64, u64)], tail: &[u8]) -> Vec<u8> {
        let mut out = vec![0u8; 64];
        out[..6].copy_from_slice(b"\x7fELF\x02\x01");
        out[0x20..0x28].copy_from_slice(&64u64.to_le_bytes());
        out[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        out[0x38..0x3a].copy_from_slice(&(headers.len() as u16).to_le_bytes());
        for (kind, offset, size) in headers {
            let mut header = vec![0u8; 56];
            header[..4].copy_from_slice(&kind.to_le_bytes());
            header[8..16].copy_from_slice(&offset.to_le_bytes());
            header[32..40].copy_from_slice(&size.to_le_bytes());
            out.extend(header);
        }
        out.extend_from_slice(tail);
        out
    }

    fn dynamic_entries(entries: &[(u64, u64)]) -> Vec<u8> {
        entries
            .iter()
            .flat_map(|(tag, value)| [tag.to_le_bytes(), value.to_le_bytes()])
            .flatten()
            .collect()
    }

    #[test]
    fn static_executables_are_told_apart() {
        // Program headers end at 64 + 56 = 120, where the dynamic section starts.
        assert!(static_elf_verdict(&elf(&[(1, 0, 0)], &[])).is_ok());
        let static_pie = dynamic_entries(&[(0x6ffffffb, 0), (0, 0)]);
        assert!(static_elf_verdict(&elf(&[(2, 120, 32)], &static_pie)).is_ok());
        let needs_libc = dynamic_entries(&[(1, 5), (0, 0)]);
        assert!(static_elf_verdict(&elf(&[(2, 120, 32)], &needs_libc)).is_err());
        assert!(static_elf_verdict(&elf(&[(3, 0, 0)], &[])).is_err());
        assert!(static_elf_verdict(b"#!/bin/sh\n").is_err());
        assert!(
            static_elf_verdict(&elf(&[(2, 120, 64)], &[])).is_err(),
            "truncated"
        );
    }

    #[test]
    fn this_test_binary_is_judged_correctly() {
        // The test binary is linked the ordinary, dynamic way.
        let me = fs::read(std::env::current_exe().unwrap()).unwrap();
        assert!(static_elf_verdict(&me).is_err());
    }
}

//! The image test of `cargo xtask dist --test`: checks one built image the way a cluster would
//! run it (config, filesystem, `--help` as uid 65532, serving and SIGTERM on loopback ports).

use std::collections::{BTreeSet, HashMap};
use std::fs::{self, File};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};

use super::{
    Binary, IMAGE_CA_BUNDLE, Image, MAX_IMAGE_BYTES, RUNTIME_USER, SERVE_DEADLINE, STOP_DEADLINE,
    buildah, ensure_static, files_under, output, quietly,
};
use crate::grpc_health::{self, ServingStatus};

pub(super) mod deb;

/// Runs the image checks and returns the image size in bytes.
pub(super) fn test_image(work: &Path, image: &Image, tag: &str, from_scratch: bool) -> Result<u64> {
    let inspect = output(buildah().args(["inspect", "--type", "image", tag]))?;
    let size = check_config(&inspect, image)?;

    let container = WorkingContainer::create(tag, &format!("bigfleet-dist-test-{}", image.name))?;
    check_filesystem(&container, image, from_scratch)?;
    for binary in image.binaries {
        check_help(&container, binary)?;
        if binary.provider {
            check_serving(work, &container, binary)?;
        }
    }
    println!("dist: {tag}: image test passed");
    Ok(size)
}

/// Checks user, entrypoint and ports, and returns the summed layer size.
fn check_config(inspect: &str, image: &Image) -> Result<u64> {
    let inspect: serde_json::Value =
        serde_json::from_str(inspect).context("parse buildah inspect")?;
    let config = &inspect["OCIv1"]["config"];
    ensure!(
        config["User"] == RUNTIME_USER,
        "image user is {}, want {RUNTIME_USER}",
        config["User"]
    );
    let entrypoint = format!("/usr/local/bin/{}", image.binaries[0].name);
    ensure!(
        config["Entrypoint"] == serde_json::json!([entrypoint]),
        "image entrypoint is {}, want [{entrypoint:?}]",
        config["Entrypoint"]
    );
    let exposed: BTreeSet<&str> = config["ExposedPorts"]
        .as_object()
        .map(|ports| ports.keys().map(String::as_str).collect())
        .unwrap_or_default();
    let wanted: Vec<String> = image
        .ports
        .iter()
        .map(|port| format!("{port}/tcp"))
        .collect();
    let wanted: BTreeSet<&str> = wanted.iter().map(String::as_str).collect();
    ensure!(
        exposed == wanted,
        "image exposes {exposed:?}, want {wanted:?}"
    );

    let manifest: serde_json::Value = serde_json::from_str(
        inspect["Manifest"]
            .as_str()
            .context("buildah inspect has no manifest")?,
    )?;
    let layers = manifest["layers"]
        .as_array()
        .context("manifest has no layers")?;
    let size = layers
        .iter()
        .map(|layer| layer["size"].as_u64().unwrap_or(0))
        .sum::<u64>();
    ensure!(
        size <= MAX_IMAGE_BYTES,
        "image is {size} bytes, over the {MAX_IMAGE_BYTES}-byte limit"
    );
    Ok(size)
}

/// A buildah working container, removed when dropped.
struct WorkingContainer {
    name: String,
}

impl WorkingContainer {
    fn create(tag: &str, name: &str) -> Result<Self> {
        // A container left by an interrupted run would hold the name.
        quietly(buildah().args(["rm", name]));
        output(buildah().args(["from", "--name", name, tag]))?;
        Ok(Self {
            name: name.to_owned(),
        })
    }

    /// `buildah run` as the runtime user, with no extra environment.
    fn run(&self, argv: &[&str]) -> Command {
        let mut command = buildah();
        command
            .args([
                "run",
                "--isolation",
                "chroot",
                "--user",
                RUNTIME_USER,
                &self.name,
                "--",
            ])
            .args(argv)
            .stdin(Stdio::null());
        command
    }
}

impl Drop for WorkingContainer {
    fn drop(&mut self) {
        quietly(buildah().args(["rm", &self.name]));
    }
}

fn check_filesystem(container: &WorkingContainer, image: &Image, from_scratch: bool) -> Result<()> {
    let mount = output(buildah().args(["mount", &container.name]))?;
    let rootfs = PathBuf::from(mount.trim());
    let verdict = filesystem_verdict(&rootfs, image, from_scratch);
    quietly(buildah().args(["umount", &container.name]));
    verdict
}

fn filesystem_verdict(rootfs: &Path, image: &Image, from_scratch: bool) -> Result<()> {
    for shell in ["bin/sh", "usr/bin/sh", "bin/bash", "bin/busybox"] {
        let present = rootfs.join(shell).symlink_metadata().is_ok();
        ensure!(!present, "the image contains a shell: /{shell}");
    }
    for binary in image.binaries {
        let path = rootfs.join("usr/local/bin").join(binary.name);
        let mode = fs::metadata(&path)
            .with_context(|| format!("/usr/local/bin/{} is missing from the image", binary.name))?
            .permissions()
            .mode();
        ensure!(
            mode & 0o111 == 0o111,
            "/usr/local/bin/{} is not executable ({mode:o})",
            binary.name
        );
        ensure_static(&path)?;
    }
    let ca =
        fs::read_to_string(rootfs.join(IMAGE_CA_BUNDLE)).context("the image has no CA bundle")?;
    ensure!(
        ca.contains("BEGIN CERTIFICATE"),
        "the image's CA bundle holds no certificate"
    );
    let passwd =
        fs::read_to_string(rootfs.join("etc/passwd")).context("the image has no /etc/passwd")?;
    ensure!(
        passwd
            .lines()
            .any(|line| line.starts_with("nonroot:x:65532:65532:")),
        "/etc/passwd has no nonroot (65532) account"
    );

    if from_scratch {
        let found = files_under(rootfs)?;
        let mut wanted: BTreeSet<PathBuf> = [
            "etc/group",
            "etc/nsswitch.conf",
            "etc/passwd",
            IMAGE_CA_BUNDLE,
        ]
        .iter()
        .map(PathBuf::from)
        .collect();
        wanted.extend(
            image
                .binaries
                .iter()
                .map(|b| Path::new("usr/local/bin").join(b.name)),
        );
        ensure!(
            found == wanted,
            "image files are {found:?}, want exactly {wanted:?}"
        );
    }
    Ok(())
}

fn check_help(container: &WorkingContainer, binary: &Binary) -> Result<()> {
    let path = format!("/usr/local/bin/{}", binary.name);
    let Output {
        status,
        stdout,
        stderr,
    } = container.run(&[&path, "--help"]).output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&stdout),
        String::from_utf8_lossy(&stderr)
    );
    ensure!(
        status.success(),
        "{path} --help as {RUNTIME_USER} failed ({status}):\n{text}"
    );
    ensure!(
        text.contains(binary.help_mentions),
        "{path} --help does not mention {}:\n{text}",
        binary.help_mentions
    );
    Ok(())
}

fn check_serving(work: &Path, container: &WorkingContainer, binary: &Binary) -> Result<()> {
    let grpc = free_loopback_port()?;
    let metrics = free_loopback_port()?;
    let log_path = work.join(format!("{}-serve.log", binary.name));
    let log = File::create(&log_path)?;
    let path = format!("/usr/local/bin/{}", binary.name);
    let addr = format!("--addr=127.0.0.1:{grpc}");
    let metrics_addr = format!("--metrics-addr=127.0.0.1:{metrics}");
    let child = container
        .run(&[&path, "--use-fake-backend", &addr, &metrics_addr])
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("start the provider in the image")?;
    let mut running = Running { child };

    let result = serve_and_stop(&mut running, binary.name, grpc, metrics);
    result.with_context(|| {
        format!(
            "{path} on its fake backend inside the image; its output:\n{}",
            fs::read_to_string(&log_path).unwrap_or_default()
        )
    })
}

fn serve_and_stop(running: &mut Running, name: &str, grpc: u16, metrics: u16) -> Result<()> {
    let grpc_addr = SocketAddr::from((Ipv4Addr::LOCALHOST, grpc));
    let deadline = Instant::now() + SERVE_DEADLINE;
    let mut last: String;
    loop {
        if let Some(status) = running.child.try_wait()? {
            bail!("the provider exited before serving ({status})");
        }
        match grpc_health::check(grpc_addr, "", Duration::from_secs(2)) {
            Ok(ServingStatus::Serving) => break,
            Ok(other) => last = format!("health status {other:?}"),
            Err(error) => last = format!("{error:#}"),
        }
        ensure!(
            Instant::now() < deadline,
            "not SERVING after {SERVE_DEADLINE:?}: {last}"
        );
        thread::sleep(Duration::from_millis(200));
    }

    // The HTTP server may bind a moment after gRPC; give it the same deadline.
    for probe in ["/healthz", "/readyz"] {
        loop {
            match http_status(metrics, probe) {
                Ok(200) => break,
                Ok(code) => last = format!("{probe} answered {code}"),
                Err(error) => last = format!("{probe}: {error:#}"),
            }
            ensure!(Instant::now() < deadline, "{last}");
            thread::sleep(Duration::from_millis(200));
        }
    }

    let pid = running.find_descendant(name)?;
    let status = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()?;
    ensure!(
        status.success(),
        "could not send SIGTERM to {name} (pid {pid})"
    );
    let deadline = Instant::now() + STOP_DEADLINE;
    loop {
        if let Some(status) = running.child.try_wait()? {
            ensure!(
                status.success(),
                "{name} exited with {status} after SIGTERM, want 0"
            );
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "{name} still running {STOP_DEADLINE:?} after SIGTERM"
        );
        thread::sleep(Duration::from_millis(100));
    }
}

/// A `buildah run` we started; on drop, it and everything under it is killed.
struct Running {
    child: Child,
}

impl Running {
    /// The process under our `buildah run` whose name is `name`: buildah's chroot runtime
    /// does not pass SIGTERM on, so the signal goes straight to the program.
    fn find_descendant(&self, name: &str) -> Result<u32> {
        let tree = process_tree()?;
        descendants(&tree, self.child.id())
            .into_iter()
            .find(|pid| command_name(*pid).as_deref() == Some(truncate_comm(name)))
            .with_context(|| {
                format!(
                    "no process {name} under buildah run (pid {})",
                    self.child.id()
                )
            })
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            if let Ok(tree) = process_tree() {
                for pid in descendants(&tree, self.child.id()).into_iter().rev() {
                    let _ = Command::new("kill")
                        .args(["-KILL", &pid.to_string()])
                        .status();
                }
            }
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// Parent pid to children, read from /proc.
fn process_tree() -> Result<HashMap<u32, Vec<u32>>> {
    let mut tree: HashMap<u32, Vec<u32>> = HashMap::new();
    for entry in fs::read_dir("/proc")? {
        let Some(pid) = entry?
            .file_name()
            .to_str()
            .and_then(|name| name.parse::<u32>().ok())
        else {
            continue;
        };
        // Format: "pid (comm) state ppid ..."; comm may hold spaces and parentheses.
        let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some(after) = stat.rfind(')').map(|at| &stat[at + 1..]) else {
            continue;
        };
        if let Some(ppid) = after
            .split_whitespace()
            .nth(1)
            .and_then(|ppid| ppid.parse().ok())
        {
            tree.entry(ppid).or_default().push(pid);
        }
    }
    Ok(tree)
}

/// Every process below `root`, parents before children.
fn descendants(tree: &HashMap<u32, Vec<u32>>, root: u32) -> Vec<u32> {
    let mut found = Vec::new();
    let mut pending = vec![root];
    while let Some(pid) = pending.pop() {
        for child in tree.get(&pid).into_iter().flatten() {
            found.push(*child);
            pending.push(*child);
        }
    }
    found
}

fn command_name(pid: u32) -> Option<String> {
    fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|comm| comm.trim_end().to_owned())
}

/// The kernel keeps the first 15 bytes of a program name in /proc/PID/comm.
fn truncate_comm(name: &str) -> &str {
    &name[..name.len().min(15)]
}

fn free_loopback_port() -> Result<u16> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
        .local_addr()?
        .port())
}

/// The status code of `GET path` on the loopback port.
fn http_status(port: u16, path: &str) -> Result<u16> {
    let mut conn = TcpStream::connect((Ipv4Addr::LOCALHOST, port))?;
    conn.set_read_timeout(Some(Duration::from_secs(2)))?;
    write!(
        conn,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
    )?;
    let mut head = [0u8; 12];
    conn.read_exact(&mut head)?;
    let head = std::str::from_utf8(&head)?;
    ensure!(
        head.starts_with("HTTP/1."),
        "not an HTTP response: {head:?}"
    );
    Ok(head[9..12].parse()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::IMAGES;

    const INSPECT: &str = r#"{
        "OCIv1": {"config": {"User": "65532:65532",
            "ExposedPorts": {"9000/tcp": {}, "9090/tcp": {}},
            "Entrypoint": ["/usr/local/bin/hetzner"]}},
        "Manifest": "{\"layers\":[{\"size\":1000},{\"size\":2000}]}"
    }"#;

    #[test]
    fn config_checks() {
        assert_eq!(check_config(INSPECT, &IMAGES[0]).unwrap(), 3000);
        // The DigitalOcean image must expose 9443 and use its own entrypoint.
        assert!(check_config(INSPECT, &IMAGES[1]).is_err());
        let root = INSPECT.replace("65532:65532", "0:0");
        assert!(check_config(&root, &IMAGES[0]).is_err());
        let huge = INSPECT.replace("2000", &MAX_IMAGE_BYTES.to_string());
        assert!(check_config(&huge, &IMAGES[0]).is_err());
    }

    #[test]
    fn process_tree_finds_our_children() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let tree = process_tree().unwrap();
        let mine = descendants(&tree, std::process::id());
        assert!(mine.contains(&child.id()));
        assert_eq!(command_name(child.id()).as_deref(), Some("sleep"));
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(truncate_comm("a-very-long-program-name"), "a-very-long-pro");
    }
}

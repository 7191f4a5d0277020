//! The `etcd` scenario's etcd: one member (Debian's `etcd-server`) on 127.0.0.21 with free
//! ports, its data directory in the scratch space, revision auto-compaction as docs/ha.md
//! advises, default limits (128 operations, 1.5 MiB per transaction), killed by PID on drop.

use std::net::{Ipv4Addr, SocketAddrV4, TcpListener};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

const ADDRESS: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 21);

/// A running etcd member.
pub(crate) struct Etcd {
    client: String,
    child: Child,
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind(SocketAddrV4::new(ADDRESS, 0))?
        .local_addr()?
        .port())
}

impl Etcd {
    /// Starts a member with its data in `dir` and waits (at most 20 s) until it is healthy.
    pub(crate) fn start(dir: &Path) -> Result<Etcd> {
        let client = format!("{ADDRESS}:{}", free_port()?);
        let peer = format!("http://{ADDRESS}:{}", free_port()?);
        let child = Command::new("etcd")
            .args([
                "--name=bench".to_owned(),
                format!("--data-dir={}", dir.display()),
                format!("--listen-peer-urls={peer}"),
                format!("--initial-advertise-peer-urls={peer}"),
                format!("--listen-client-urls=http://{client}"),
                format!("--advertise-client-urls=http://{client}"),
                format!("--initial-cluster=bench={peer}"),
                "--auto-compaction-mode=revision".into(),
                "--auto-compaction-retention=10000".into(),
                "--quota-backend-bytes=8589934592".into(),
                "--logger=zap".into(),
                "--log-level=error".into(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("start etcd (apt-get install etcd-server; deploy/ci-setup.sh does)")?;
        let mut etcd = Etcd { client, child };
        let started = Instant::now();
        loop {
            let healthy = Command::new("etcdctl")
                .env("ETCDCTL_API", "3")
                .args([
                    format!("--endpoints=http://{}", etcd.client),
                    "endpoint".into(),
                    "health".into(),
                ])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .context("run etcdctl (apt-get install etcd-client)")?;
            if healthy.success() {
                return Ok(etcd);
            }
            if let Some(status) = etcd.child.try_wait()? {
                bail!("etcd exited with {status} before it was healthy");
            }
            if started.elapsed() > Duration::from_secs(20) {
                bail!("etcd at {} not healthy within 20 s", etcd.client);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The `--state` of a provider on this member.
    pub(crate) fn state(&self) -> String {
        format!("etcd://{}/bigfleet/bench", self.client)
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

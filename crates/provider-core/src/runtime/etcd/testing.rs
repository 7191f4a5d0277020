//! A real etcd (Debian's `etcd-server`, installed by deploy/ci-setup.sh) for tests: one or three
//! members on loopback addresses no other test uses (127.0.0.21-23), ports picked free, a data
//! directory each, revision auto-compaction, short election timings (so a 1 s lease TTL is
//! granted as asked), killed by PID when dropped.

use std::net::{Ipv4Addr, SocketAddrV4, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::target::{self, Client, EtcdArgs};
use etcd_proto::etcdserverpb as pb;

const ADDRESSES: [Ipv4Addr; 3] = [
    Ipv4Addr::new(127, 0, 0, 21),
    Ipv4Addr::new(127, 0, 0, 22),
    Ipv4Addr::new(127, 0, 0, 23),
];

/// A free port on `ip` (bound, read and released: etcd binds it right after).
fn free_port(ip: Ipv4Addr) -> u16 {
    TcpListener::bind(SocketAddrV4::new(ip, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("no free port on {ip}: {e}"))
}

/// One member's process and addresses.
pub struct Member {
    pub client: String,
    child: Option<Child>,
    args: Vec<String>,
}

impl Member {
    fn spawn(&mut self) {
        let child = Command::new("etcd")
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("start etcd (apt-get install etcd-server; deploy/ci-setup.sh does): {e}")
            });
        self.child = Some(child);
    }

    /// SIGKILL, by PID.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A running etcd cluster; every member is killed on drop.
pub struct Cluster {
    pub members: Vec<Member>,
    _data: tempfile::TempDir,
}

impl Cluster {
    /// Starts `n` (1 or 3) members and waits until the cluster answers.
    pub fn start(n: usize) -> Cluster {
        let data = tempfile::tempdir().expect("tempdir");
        let peers: Vec<(String, String, String)> = ADDRESSES[..n]
            .iter()
            .enumerate()
            .map(|(i, ip)| {
                (
                    format!("n{}", i + 1),
                    format!("http://{ip}:{}", free_port(*ip)),
                    format!("{ip}:{}", free_port(*ip)),
                )
            })
            .collect();
        let initial: Vec<String> = peers
            .iter()
            .map(|(name, peer, _)| format!("{name}={peer}"))
            .collect();
        let mut members: Vec<Member> = peers
            .iter()
            .map(|(name, peer, client)| {
                let dir: PathBuf = data.path().join(name);
                let args = vec![
                    format!("--name={name}"),
                    format!("--data-dir={}", dir.display()),
                    format!("--listen-peer-urls={peer}"),
                    format!("--initial-advertise-peer-urls={peer}"),
                    format!("--listen-client-urls=http://{client}"),
                    format!("--advertise-client-urls=http://{client}"),
                    format!("--initial-cluster={}", initial.join(",")),
                    "--initial-cluster-state=new".into(),
                    "--initial-cluster-token=bigfleet-test".into(),
                    "--heartbeat-interval=50".into(),
                    "--election-timeout=500".into(),
                    "--auto-compaction-mode=revision".into(),
                    "--auto-compaction-retention=1000".into(),
                    "--logger=zap".into(),
                    "--log-level=error".into(),
                ];
                Member {
                    client: client.clone(),
                    child: None,
                    args,
                }
            })
            .collect();
        for m in &mut members {
            m.spawn();
        }
        let cluster = Cluster {
            members,
            _data: data,
        };
        cluster.wait_ready();
        cluster
    }

    /// `etcd://…/PREFIX` over every member.
    pub fn state(&self, prefix: &str) -> String {
        let hosts: Vec<&str> = self.members.iter().map(|m| m.client.as_str()).collect();
        format!("etcd://{}{prefix}", hosts.join(","))
    }

    /// A raw client, for tests that look at or tamper with keys.
    pub(crate) fn client(&self) -> Client {
        let target = target::parse(&self.state("/any")).expect("parse");
        target::connect(&target, &EtcdArgs::default()).expect("connect")
    }

    /// The index of the member that currently leads (polls until one does, at most 10 s).
    pub async fn leader(&self) -> usize {
        use etcd_proto::etcdserverpb::maintenance_client::MaintenanceClient;
        let started = Instant::now();
        loop {
            for (index, member) in self.members.iter().enumerate() {
                if member.child.is_none() {
                    continue;
                }
                let Ok(channel) =
                    tonic::transport::Endpoint::from_shared(format!("http://{}", member.client))
                        .expect("endpoint")
                        .connect()
                        .await
                else {
                    continue;
                };
                let Ok(status) = MaintenanceClient::new(channel)
                    .status(pb::StatusRequest {})
                    .await
                else {
                    continue;
                };
                let status = status.into_inner();
                let me = status.header.map(|h| h.member_id);
                if status.leader != 0 && me == Some(status.leader) {
                    return index;
                }
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "no etcd leader"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Restarts a killed member on its data directory.
    pub fn restart(&mut self, index: usize) {
        let member = &mut self.members[index];
        let args: Vec<String> = member
            .args
            .iter()
            .map(|a| {
                if a == "--initial-cluster-state=new" {
                    "--initial-cluster-state=existing".into()
                } else {
                    a.clone()
                }
            })
            .collect();
        member.args = args;
        member.spawn();
    }

    /// Polls until a linearizable read succeeds (etcd has a leader), at most 20 s.
    pub fn wait_ready(&self) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let started = Instant::now();
        rt.block_on(async {
            let client = self.client();
            loop {
                let mut kv = client.kv();
                let read = kv
                    .range(pb::RangeRequest {
                        key: b"probe".to_vec(),
                        ..Default::default()
                    })
                    .await;
                if read.is_ok() {
                    return;
                }
                assert!(
                    started.elapsed() < Duration::from_secs(20),
                    "etcd did not become ready: {read:?}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for m in &mut self.members {
            m.kill();
        }
    }
}

/// Flags for tests: no TLS, a 1 s lease.
#[cfg(test)]
pub(crate) fn args() -> EtcdArgs {
    EtcdArgs {
        etcd_lease_ttl: Duration::from_secs(1),
        ..EtcdArgs::default()
    }
}

//! A loopback TCP relay: stands in for a Kubernetes Service in front of replicas, a NAT or a
//! network blip. Each new connection goes to the current target and stays on it (as
//! kube-proxy keeps an established connection on its pod) until either side closes it or the
//! relay cuts it.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::net::TcpListener;

pub struct Relay {
    /// Where the relay listens.
    pub addr: SocketAddr,
    target: Arc<Mutex<SocketAddr>>,
    connections: Arc<AtomicUsize>,
    open: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    /// A relay on a fresh 127.0.0.1 port to `target`.
    pub async fn start(target: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        Relay::on(listener, target)
    }

    /// A relay on `listener` to `target`.
    pub fn on(listener: TcpListener, target: SocketAddr) -> Relay {
        let addr = listener.local_addr().unwrap();
        let target = Arc::new(Mutex::new(target));
        let connections = Arc::new(AtomicUsize::new(0));
        let open = Arc::new(Mutex::new(Vec::new()));
        let (current, count, handles) = (target.clone(), connections.clone(), open.clone());
        let task = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let to = *current.lock().unwrap();
                let forward = tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(to).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                handles.lock().unwrap().push(forward.abort_handle());
            }
        });
        Relay {
            addr,
            target,
            connections,
            open,
            task,
        }
    }

    /// Where new connections go from now on.
    pub fn retarget(&self, to: SocketAddr) {
        *self.target.lock().unwrap() = to;
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }

    /// Drops every open connection.
    pub fn cut(&self) {
        for connection in self.open.lock().unwrap().drain(..) {
            connection.abort();
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.cut();
        self.task.abort();
    }
}

//! Bounds on what gRPC clients can hold (docs/limits.md): a cap on open connections, counted
//! from the TCP accept (so TLS handshakes in progress count too), and a deadline for a new
//! connection's first bytes, so a peer that connects and stays silent cannot keep a slot.
//! Streams per connection, handling time and connection age are tonic settings (see
//! [`crate::wire::serve::GrpcLimits`]).
//!
//! A connection also ends when its replica stops serving (a leader that stepped down, a
//! standby): kube-proxy keeps an established connection on its pod, so a client would otherwise
//! stay on a replica that answers UNAVAILABLE until the connection ages out. tonic 0.14 offers
//! no per-connection GOAWAY, so the connection is closed under hyper (its reads end) a moment
//! after the role changed; the client's channel reconnects through the Service to the leader.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio::time::Sleep;
use tonic::transport::server::Connected;

use crate::observability::telemetry::Telemetry;
use crate::runtime::replica::Role;

/// How long a connection goes on once its replica does not serve: answers already on their way
/// are written, then the connection is closed.
pub const STANDBY_CLOSE_AFTER: Duration = Duration::from_millis(500);

/// Resolves when a connection must end.
type Ending = Pin<Box<dyn Future<Output = ()> + Send + Sync>>;

/// Resolves once the role has not served for [`STANDBY_CLOSE_AFTER`] (counted from now when it
/// does not serve now); never while it serves. A role that serves again within that time keeps
/// the connection: a client that connected to a standby a moment before it took over goes on
/// talking to the new leader instead of losing its connection under its first calls.
fn ends_when_not_serving(mut roles: watch::Receiver<Role>) -> Ending {
    Box::pin(async move {
        loop {
            if roles.wait_for(|role| !role.serves()).await.is_err() {
                // The replica is gone with the process: the server's own shutdown closes this.
                return std::future::pending().await;
            }
            let serves_again =
                tokio::time::timeout(STANDBY_CLOSE_AFTER, roles.wait_for(|role| role.serves()))
                    .await
                    .map(|waited| waited.is_ok());
            match serves_again {
                Err(_) => return,
                Ok(true) => {}
                Ok(false) => return std::future::pending().await,
            }
        }
    })
}

/// An accepted connection that holds one slot of the connection cap until it is dropped, fails
/// its reads if no byte arrives before the first-bytes deadline, and ends (its reads see the
/// end of the stream, its writes fail) once its replica stops serving.
pub struct Limited<IO> {
    io: IO,
    first_bytes: Option<Pin<Box<Sleep>>>,
    ending: Option<Ending>,
    ended: bool,
    _slot: Option<Slot>,
}

impl<IO> Limited<IO> {
    /// Whether the connection must end now (registers the waker while it must not).
    fn ends(&mut self, cx: &mut Context<'_>) -> bool {
        if !self.ended
            && let Some(ending) = self.ending.as_mut()
            && ending.as_mut().poll(cx).is_ready()
        {
            self.ended = true;
            self.ending = None;
            tracing::debug!("gRPC connection closed: this replica does not serve");
        }
        self.ended
    }
}

fn ended() -> io::Error {
    io::Error::new(
        io::ErrorKind::BrokenPipe,
        "connection closed: this replica does not serve",
    )
}

/// One slot of the connection cap; dropping it frees the slot and updates the gauge.
struct Slot {
    _permit: OwnedSemaphorePermit,
    semaphore: Arc<Semaphore>,
    capacity: usize,
    telemetry: Telemetry,
}

impl Drop for Slot {
    fn drop(&mut self) {
        // The permit is released after this body runs: one more slot is free than counted.
        let open = self.capacity - self.semaphore.available_permits() - 1;
        self.telemetry.grpc_connections(open);
    }
}

impl<IO> Limited<IO> {
    /// Wraps `io` with a deadline for its first bytes and no slot (the slot is held by the
    /// connection underneath, e.g. the TCP stream inside a TLS stream).
    pub fn first_bytes_within(io: IO, deadline: Duration) -> Limited<IO> {
        Limited {
            io,
            first_bytes: Some(Box::pin(tokio::time::sleep(deadline))),
            ending: None,
            ended: false,
            _slot: None,
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Limited<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        if this.ends(cx) {
            // The end of the stream: hyper ends the connection and drops the socket.
            return Poll::Ready(Ok(()));
        }
        let result = Pin::new(&mut this.io).poll_read(cx, buf);
        if this.first_bytes.is_some() {
            match &result {
                Poll::Ready(Ok(())) if buf.filled().len() > before => this.first_bytes = None,
                Poll::Pending => {
                    if let Some(deadline) = this.first_bytes.as_mut()
                        && deadline.as_mut().poll(cx).is_ready()
                    {
                        return Poll::Ready(Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "no bytes from the client before the handshake deadline",
                        )));
                    }
                }
                _ => {}
            }
        }
        result
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Limited<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.ends(cx) {
            return Poll::Ready(Err(ended()));
        }
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if self.ends(cx) {
            return Poll::Ready(Err(ended()));
        }
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl<IO: Connected> Connected for Limited<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

/// Accepts TCP connections while fewer than `max_connections` are open; beyond that a new
/// connection is closed at once (and counted), so the peer fails fast instead of waiting in the
/// backlog. `first_bytes` bounds how long an accepted connection may stay silent (`None` when a
/// TLS handshake deadline already does). With `roles`, every connection ends
/// [`STANDBY_CLOSE_AFTER`] after the role stops serving. The accept loop stops when the receiver
/// is dropped.
pub fn accept(
    listener: TcpListener,
    max_connections: usize,
    first_bytes: Option<Duration>,
    roles: Option<watch::Receiver<Role>>,
    telemetry: Telemetry,
) -> mpsc::Receiver<(Limited<TcpStream>, SocketAddr)> {
    let (tx, rx) = mpsc::channel(64);
    let semaphore = Arc::new(Semaphore::new(max_connections));
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                // The server stopped: release the port at once.
                _ = tx.closed() => return,
            };
            let (tcp, peer) = match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let Ok(permit) = semaphore.clone().try_acquire_owned() else {
                telemetry.grpc_connection_refused();
                tracing::debug!(%peer, max_connections, "gRPC connection refused: too many open connections");
                drop(tcp);
                continue;
            };
            let _ = tcp.set_nodelay(true);
            telemetry.grpc_connections(max_connections - semaphore.available_permits());
            let conn = Limited {
                io: tcp,
                first_bytes: first_bytes.map(|d| Box::pin(tokio::time::sleep(d))),
                ending: roles.clone().map(ends_when_not_serving),
                ended: false,
                _slot: Some(Slot {
                    _permit: permit,
                    semaphore: semaphore.clone(),
                    capacity: max_connections,
                    telemetry,
                }),
            };
            if tx.send((conn, peer)).await.is_err() {
                return;
            }
        }
    });
    rx
}

/// The plaintext side: accepted connections as a stream for tonic.
pub fn plaintext(
    accepted: mpsc::Receiver<(Limited<TcpStream>, SocketAddr)>,
) -> impl tokio_stream::Stream<Item = Result<Limited<TcpStream>, io::Error>> {
    use tokio_stream::StreamExt as _;
    tokio_stream::wrappers::ReceiverStream::new(accepted).map(|(conn, _)| Ok(conn))
}

#[cfg(test)]
mod tests {
    use std::task::Poll;

    use super::*;

    /// Polls `ending` once, after letting the paused clock run `for_`.
    async fn ended_after(ending: &mut Ending, for_: Duration) -> bool {
        tokio::time::sleep(for_).await;
        matches!(futures_poll(ending), Poll::Ready(()))
    }

    fn futures_poll(ending: &mut Ending) -> Poll<()> {
        let waker = std::task::Waker::noop();
        ending.as_mut().poll(&mut Context::from_waker(waker))
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_ends_only_after_its_replica_stopped_serving_for_the_whole_delay() {
        // Accepted by a standby that takes over within the delay: the connection stays.
        let (roles, rx) = watch::channel(Role::Standby);
        let mut ending = ends_when_not_serving(rx);
        assert!(!ended_after(&mut ending, Duration::from_millis(100)).await);
        roles.send_replace(Role::Leader);
        assert!(!ended_after(&mut ending, STANDBY_CLOSE_AFTER * 4).await);

        // A leader that lost its claim still answers reads from memory: the connection stays.
        roles.send_replace(Role::Degraded);
        assert!(!ended_after(&mut ending, STANDBY_CLOSE_AFTER * 4).await);

        // It learns another replica leads and becomes a standby: the connection ends once the
        // delay has passed.
        roles.send_replace(Role::Standby);
        assert!(!ended_after(&mut ending, Duration::from_millis(10)).await);
        assert!(!ended_after(&mut ending, STANDBY_CLOSE_AFTER / 2).await);
        assert!(ended_after(&mut ending, STANDBY_CLOSE_AFTER).await);

        // Accepted by a standby that stays one: it ends after the delay.
        let (_roles, rx) = watch::channel(Role::Standby);
        let mut ending = ends_when_not_serving(rx);
        assert!(!ended_after(&mut ending, Duration::from_millis(10)).await);
        assert!(ended_after(&mut ending, STANDBY_CLOSE_AFTER).await);

        // A single replica always serves.
        let (_roles, rx) = watch::channel(Role::Single);
        let mut ending = ends_when_not_serving(rx);
        assert!(!ended_after(&mut ending, STANDBY_CLOSE_AFTER * 10).await);
    }
}

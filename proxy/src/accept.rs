//! The accept step every listener shares: the next connection, or `None` once shutdown
//! is cancelled. A failed accept (usually file descriptors exhausted) is logged and
//! retried after a short pause instead of spinning.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

pub async fn next(
    listener: &TcpListener,
    shutdown: &CancellationToken,
    what: &'static str,
) -> Option<(TcpStream, SocketAddr)> {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            r = listener.accept() => match r {
                Ok(a) => return Some(a),
                Err(e) => {
                    tracing::warn!(listener = what, error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        }
    }
}

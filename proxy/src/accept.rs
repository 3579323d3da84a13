//! What every listener does with a connection it accepts: the accept step itself, a cap
//! on the connections one listener holds open ([`ConnLimit`]), and a deadline on a
//! connection that moves no bytes ([`Idle`]). Knows sockets and clocks, no protocol.
//!
//! A failed accept (usually file descriptors exhausted) is logged and retried after a
//! short pause instead of spinning.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
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

/// The open connections of one listener, at most `max`. A connection over the cap is
/// closed at once (counted in `refused`): a flood costs one accept and one close per
/// connection, never a task or a buffer.
#[derive(Clone)]
pub struct ConnLimit {
    permits: Arc<Semaphore>,
    refused: Counter,
    open: Gauge,
}

/// One admitted connection's place under its listener's cap; freed on drop.
pub struct Slot {
    _permit: OwnedSemaphorePermit,
    open: Gauge,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.open.dec();
    }
}

impl ConnLimit {
    pub fn new(max: usize, refused: Counter, open: Gauge) -> ConnLimit {
        ConnLimit {
            permits: Arc::new(Semaphore::new(max.min(Semaphore::MAX_PERMITS))),
            refused,
            open,
        }
    }

    /// Counts a connection closed at once for another reason than the cap.
    pub fn refuse(&self) {
        self.refused.inc();
    }

    /// A place for one more connection, or `None` (counted as refused) when the
    /// listener already holds its cap.
    pub fn admit(&self) -> Option<Slot> {
        match self.permits.clone().try_acquire_owned() {
            Ok(p) => {
                self.open.inc();
                Some(Slot {
                    _permit: p,
                    open: self.open.clone(),
                })
            }
            Err(_) => {
                self.refused.inc();
                None
            }
        }
    }
}

/// A connection that fails with `TimedOut` once no byte has moved either way for
/// `limit` while it waits to read or write. Work the server does between reads (a
/// master call, a transfer) is not idleness: the deadline is only checked while the
/// connection is polled for I/O.
pub struct Idle<S> {
    io: S,
    limit: Duration,
    last: Instant,
    timer: Pin<Box<Sleep>>,
}

impl<S> Idle<S> {
    pub fn new(io: S, limit: Duration) -> Idle<S> {
        let now = Instant::now();
        Idle {
            io,
            limit,
            last: now,
            timer: Box::pin(tokio::time::sleep_until(now + limit)),
        }
    }

    /// `Ready(Err)` once idle past the limit; re-arms the timer when bytes moved since
    /// it was set (checking the clock only when the timer fires keeps the per-read cost
    /// at one `Instant::now`).
    fn poll_idle(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        loop {
            if self.timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            let due = self.last + self.limit;
            if due <= Instant::now() {
                return Poll::Ready(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no bytes moved for {:?}", self.limit),
                ));
            }
            self.timer.as_mut().reset(due);
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Idle<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(r) => {
                if buf.filled().len() > before {
                    this.last = Instant::now();
                }
                Poll::Ready(r)
            }
            Poll::Pending => this.poll_idle(cx).map(Err),
        }
    }
}

impl<S> Idle<S> {
    /// A write's outcome: bytes moved reset the deadline; a write that waits is checked
    /// against it.
    fn wrote(
        &mut self,
        cx: &mut Context<'_>,
        r: Poll<io::Result<usize>>,
    ) -> Poll<io::Result<usize>> {
        match r {
            Poll::Ready(r) => {
                if matches!(r, Ok(n) if n > 0) {
                    self.last = Instant::now();
                }
                Poll::Ready(r)
            }
            Poll::Pending => self.poll_idle(cx).map(Err),
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Idle<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_write(cx, buf);
        this.wrote(cx, r)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.wrote(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn the_cap_refuses_and_counts_and_frees_on_drop() {
        let (refused, open) = (Counter::default(), Gauge::default());
        let l = ConnLimit::new(2, refused.clone(), open.clone());
        let a = l.admit().expect("first");
        let _b = l.admit().expect("second");
        assert!(l.admit().is_none());
        assert_eq!((refused.get(), open.get()), (1, 2));
        drop(a);
        assert_eq!(open.get(), 1);
        assert!(l.admit().is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_times_out_and_a_busy_one_does_not() {
        let (a, mut b) = tokio::io::duplex(64);
        let mut idle = Idle::new(a, Duration::from_secs(10));
        // Bytes every 6 s keep it open past the 10 s limit.
        let feeder = tokio::spawn(async move {
            for _ in 0..3 {
                tokio::time::sleep(Duration::from_secs(6)).await;
                b.write_all(b"x").await.unwrap();
            }
            b
        });
        let mut got = [0u8; 1];
        for _ in 0..3 {
            idle.read_exact(&mut got).await.unwrap();
        }
        let _b = feeder.await.unwrap();
        let started = Instant::now();
        let e = idle.read_exact(&mut got).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), Duration::from_secs(10));
    }
}

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
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;

/// A listener [`next`] takes connections from: TCP or a Unix socket.
pub trait Listener {
    type Conn;
    type Addr;
    fn poll_accept(&self, cx: &mut Context<'_>) -> Poll<io::Result<(Self::Conn, Self::Addr)>>;
}

impl Listener for TcpListener {
    type Conn = TcpStream;
    type Addr = SocketAddr;
    fn poll_accept(&self, cx: &mut Context<'_>) -> Poll<io::Result<(TcpStream, SocketAddr)>> {
        TcpListener::poll_accept(self, cx)
    }
}

impl Listener for tokio::net::UnixListener {
    type Conn = tokio::net::UnixStream;
    type Addr = tokio::net::unix::SocketAddr;
    fn poll_accept(&self, cx: &mut Context<'_>) -> Poll<io::Result<(Self::Conn, Self::Addr)>> {
        tokio::net::UnixListener::poll_accept(self, cx)
    }
}

/// The next connection of `listener`, or `None` once `shutdown` is cancelled.
pub async fn next<L: Listener>(
    listener: &L,
    shutdown: &CancellationToken,
    what: &'static str,
) -> Option<(L::Conn, L::Addr)> {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            r = std::future::poll_fn(|cx| listener.poll_accept(cx)) => match r {
                Ok(a) => return Some(a),
                Err(e) => {
                    tracing::warn!(listener = what, error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        }
    }
}

/// The open connections of one listener, at most `max`. At the cap, a newcomer makes
/// room by shedding the open connection that has made the least progress (moved no byte
/// for longest), if that one has moved none for `shed_after` (counted in `shed`; it is
/// closed by its task, see [`Slot::stopped`]); otherwise the newcomer is closed at once
/// (counted in `refused`). So stalled connections cannot lock good clients out, and a
/// flood costs one accept and one close per connection, never a task or a buffer.
/// Connections being shed still hold their descriptor for the moment their task takes
/// to see it: at most `max` of them, so never more than twice `max` open.
#[derive(Clone)]
pub struct ConnLimit {
    shared: Arc<Shared>,
    refused: Counter,
    shed: Counter,
    open: Gauge,
}

struct Shared {
    max: usize,
    /// 0: never shed.
    shed_after_ms: u64,
    epoch: std::time::Instant,
    conns: std::sync::Mutex<Conns>,
}

#[derive(Default)]
struct Conns {
    next: u64,
    /// Admitted and not being shed.
    live: std::collections::HashMap<u64, (Progress, CancellationToken)>,
    /// Every admitted connection whose slot is not dropped yet (shed ones included).
    held: usize,
    /// No live connection can have stalled `shed_after` before this (ms since the
    /// epoch): progress only moves forward, so a scan that found none sheddable holds
    /// until then, and a flood at the cap is refused without scanning every connection.
    no_victim_before_ms: u64,
}

/// When a connection last moved a byte: ms since its listener's epoch, shared by the
/// connection's [`Idle`] wrapper (which writes it) and its [`ConnLimit`] (which reads it).
#[derive(Clone)]
pub struct Progress {
    at_ms: Arc<std::sync::atomic::AtomicU64>,
    epoch: std::time::Instant,
}

impl Progress {
    fn touch(&self, now: std::time::Instant) {
        let ms = now.saturating_duration_since(self.epoch).as_millis() as u64;
        self.at_ms.store(ms, std::sync::atomic::Ordering::Relaxed);
    }

    fn at_ms(&self) -> u64 {
        self.at_ms.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// One admitted connection's place under its listener's cap; freed on drop.
pub struct Slot {
    shared: Arc<Shared>,
    id: u64,
    progress: Progress,
    stop: CancellationToken,
    open: Gauge,
}

impl Slot {
    /// Resolves when a newcomer shed this connection: its task stops serving it.
    pub fn stopped(&self) -> tokio_util::sync::WaitForCancellationFuture<'_> {
        self.stop.cancelled()
    }

    /// The connection's progress, for its [`Idle`] wrapper to update.
    pub fn progress(&self) -> Progress {
        self.progress.clone()
    }

    /// Never shed this connection: its progress cannot be seen on the socket (a
    /// shared-memory connection moves its bytes through memory).
    pub fn keep(&self) {
        self.progress
            .at_ms
            .store(u64::MAX, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut c = self.shared.lock();
        c.live.remove(&self.id);
        c.held = c.held.saturating_sub(1);
        drop(c);
        self.open.dec();
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Conns> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl ConnLimit {
    /// `shed_after`: how long a connection must have moved no byte before a newcomer
    /// may shed it; zero: never shed (the newcomer is refused).
    pub fn new(
        max: usize,
        shed_after: Duration,
        refused: Counter,
        shed: Counter,
        open: Gauge,
    ) -> ConnLimit {
        ConnLimit {
            shared: Arc::new(Shared {
                max: max.max(1),
                shed_after_ms: shed_after.as_millis() as u64,
                epoch: std::time::Instant::now(),
                conns: Default::default(),
            }),
            refused,
            shed,
            open,
        }
    }

    /// Counts a connection closed at once for another reason than the cap.
    pub fn refuse(&self) {
        self.refused.inc();
    }

    /// A place for one more connection, shedding the least progressed one at the cap
    /// when it stalled long enough; `None` (counted as refused) when none did.
    pub fn admit(&self) -> Option<Slot> {
        let sh = &self.shared;
        let now = std::time::Instant::now();
        let mut c = sh.lock();
        let now_ms = now.saturating_duration_since(sh.epoch).as_millis() as u64;
        if c.live.len() >= sh.max {
            let victim =
                (sh.shed_after_ms > 0 && c.held < 2 * sh.max && now_ms >= c.no_victim_before_ms)
                    .then(|| {
                        // The least progressed one; if it has not stalled long enough, none has.
                        let (at, id) = c.live.iter().map(|(id, (p, _))| (p.at_ms(), *id)).min()?;
                        if now_ms.saturating_sub(at) >= sh.shed_after_ms {
                            Some((at, id))
                        } else {
                            c.no_victim_before_ms = at.saturating_add(sh.shed_after_ms);
                            None
                        }
                    })
                    .flatten();
            let Some((_, id)) = victim else {
                drop(c);
                self.refused.inc();
                return None;
            };
            if let Some((_, stop)) = c.live.remove(&id) {
                stop.cancel();
            }
            self.shed.inc();
        }
        let progress = Progress {
            at_ms: Default::default(),
            epoch: sh.epoch,
        };
        progress.touch(now);
        let stop = CancellationToken::new();
        let id = c.next;
        c.next += 1;
        c.no_victim_before_ms = c
            .no_victim_before_ms
            .min(now_ms.saturating_add(sh.shed_after_ms));
        c.live.insert(id, (progress.clone(), stop.clone()));
        c.held += 1;
        drop(c);
        self.open.inc();
        Some(Slot {
            shared: sh.clone(),
            id,
            progress,
            stop,
            open: self.open.clone(),
        })
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
    /// Where the listener's cap reads this connection's progress, when it sheds.
    progress: Option<Progress>,
}

impl<S> Idle<S> {
    pub fn new(io: S, limit: Duration) -> Idle<S> {
        let now = Instant::now();
        Idle {
            io,
            limit,
            last: now,
            timer: Box::pin(tokio::time::sleep_until(now + limit)),
            progress: None,
        }
    }

    /// Also records each byte moved in `progress` (its [`Slot`]'s), so that a stalled
    /// connection can be shed at the listener's cap.
    pub fn tracking(mut self, progress: Progress) -> Idle<S> {
        self.progress = Some(progress);
        self
    }

    fn moved(&mut self) {
        self.last = Instant::now();
        if let Some(p) = &self.progress {
            p.touch(self.last.into_std());
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
                    this.moved();
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
                    self.moved();
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
        let (refused, shed, open) = (Counter::default(), Counter::default(), Gauge::default());
        let l = ConnLimit::new(
            2,
            Duration::ZERO,
            refused.clone(),
            shed.clone(),
            open.clone(),
        );
        let a = l.admit().expect("first");
        let _b = l.admit().expect("second");
        assert!(l.admit().is_none());
        assert_eq!((refused.get(), shed.get(), open.get()), (1, 0, 2));
        drop(a);
        assert_eq!(open.get(), 1);
        assert!(l.admit().is_some());
    }

    #[test]
    fn at_the_cap_a_newcomer_sheds_the_connection_stalled_longest() {
        let (refused, shed, open) = (Counter::default(), Counter::default(), Gauge::default());
        // A second: no pause of a busy machine between two admissions comes near it
        // (50 ms did: the third admission shed `a` on a loaded 2-core machine).
        let l = ConnLimit::new(
            2,
            Duration::from_secs(1),
            refused.clone(),
            shed.clone(),
            open,
        );
        let a = l.admit().expect("first");
        let b = l.admit().expect("second");
        // Both just moved: none has stalled long enough, the newcomer is refused.
        assert!(l.admit().is_none());
        std::thread::sleep(Duration::from_millis(1_200));
        b.progress().touch(std::time::Instant::now());
        // a stalled 1.2 s, b just moved: a goes.
        let c = l.admit().expect("sheds a");
        assert!(a.stop.is_cancelled() && !b.stop.is_cancelled());
        assert_eq!((refused.get(), shed.get()), (1, 1));
        // a is shed but its task has not let go yet: it is not shed twice, and the
        // fresh c is not sheddable.
        assert!(l.admit().is_none());
        drop((a, b, c));
        assert_eq!(l.shared.lock().held, 0);
    }

    #[test]
    fn a_flood_at_the_cap_is_refused_without_scanning_until_one_could_have_stalled() {
        let (refused, shed, open) = (Counter::default(), Counter::default(), Gauge::default());
        let l = ConnLimit::new(3, Duration::from_secs(1), refused.clone(), shed, open);
        let held: Vec<Slot> = (0..3).map(|_| l.admit().expect("room")).collect();
        assert!(l.admit().is_none());
        let until = l.shared.lock().no_victim_before_ms;
        // The scan found the oldest one a second from stalling: no earlier victim.
        let now_ms = l.shared.epoch.elapsed().as_millis() as u64;
        assert!(
            until > now_ms && until <= now_ms + 1_000,
            "{until} vs {now_ms}"
        );
        for _ in 0..100 {
            assert!(l.admit().is_none());
        }
        assert_eq!(refused.get(), 101);
        assert_eq!(l.shared.lock().no_victim_before_ms, until);
        // A connection kept forever (shared memory) never becomes a victim, and a slot
        // freed and taken again brings the bound no later than the newcomer's.
        held[0].keep();
        drop(held);
        let fresh = l.admit().expect("room again");
        assert!(l.shared.lock().no_victim_before_ms <= until + 1_000);
        drop(fresh);
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

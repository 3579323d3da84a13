//! One client connection and its own upstream connection (never shared: seq numbers are
//! per connection). Two halves run concurrently:
//!
//! - client -> master: split request frames, let [`intercept`] decide, queue an entry
//!   per request in the bounded in-flight queue (forwarded, or answered by moongate),
//!   forward;
//! - master -> client: split response frames, pop the matching entry (the master answers
//!   in request order), observe, forward; answers moongate gave itself go out when their
//!   turn in the queue comes, so the client sees replies in request order.
//!
//! Both halves read whatever is available and forward all complete frames in one write,
//! so pipelined requests stay pipelined. When the queue is full the client half stops
//! reading (backpressure); it never fails a request.
//!
//! [`intercept`]: super::intercept

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use std::collections::VecDeque;
use std::sync::Mutex;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;

use super::Shared;
use super::intercept::{Decided, Queued, on_merged, on_request, on_response};
use super::split::Merge;
use crate::codec::frame::{check_request, check_response};
use crate::codec::{FrameError, Method, RequestFrame, ResponseFrame};
use crate::metrics::{FrameErrorKind, Side};

const READ_CHUNK: usize = 64 << 10;

/// After a malformed client frame: how long the requests forwarded before it may take to
/// be answered before the connection closes anyway.
const ANSWER_BEFORE_CLOSE: Duration = Duration::from_secs(5);

/// A request not yet answered to the client.
enum InFlight {
    Upstream {
        seq: u32,
        method: Option<Method>,
        sent: Instant,
        decided: Option<Decided>,
    },
    Local(Bytes),
}

/// The per-connection in-flight queue, in request order. Bounded by `space`: the client
/// half takes a permit per request, the master half returns it when the reply is out.
struct Queue {
    q: Mutex<VecDeque<InFlight>>,
    space: Semaphore,
    /// A local answer was queued: the master half may have something to send.
    local: Notify,
}

impl Queue {
    fn push(&self, e: InFlight) {
        let local = matches!(e, InFlight::Local(_));
        self.q
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(e);
        if local {
            self.local.notify_one();
        }
    }
    fn pop(&self) -> Option<InFlight> {
        let e = self.q.lock().unwrap_or_else(|p| p.into_inner()).pop_front();
        if e.is_some() {
            self.space.add_permits(1);
        }
        e
    }
    /// Moves the local answers at the head of the queue to `out`.
    fn drain_local(&self, out: &mut BytesMut) {
        let mut q = self.q.lock().unwrap_or_else(|p| p.into_inner());
        while let Some(InFlight::Local(_)) = q.front() {
            if let Some(InFlight::Local(b)) = q.pop_front() {
                out.extend_from_slice(&b);
                self.space.add_permits(1);
            }
        }
    }
    /// The seq, part count and method of the head entry when it is a split batch call.
    fn head_split(&self) -> Option<(u32, usize, Method)> {
        match self.q.lock().unwrap_or_else(|p| p.into_inner()).front() {
            Some(InFlight::Upstream {
                seq,
                method: Some(method),
                decided: Some(d),
                ..
            }) if d.parts > 1 => Some((*seq, d.parts, *method)),
            _ => None,
        }
    }
    fn len(&self) -> usize {
        self.q.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

/// Why a connection ended; logged once per connection.
enum End {
    ClientClosed,
    ClientIo(std::io::Error),
    ClientFrame(FrameError),
    UpstreamClosed {
        pending: usize,
    },
    UpstreamIo(std::io::Error),
    UpstreamFrame(FrameError),
    Idle(Duration),
    Drained,
    /// The client half stopped for shutdown; the master half decides the final end.
    Draining,
}

/// Milliseconds since the connection started at which a byte last moved.
struct Activity {
    start: Instant,
    last_ms: AtomicU64,
}

impl Activity {
    fn touch(&self) {
        self.last_ms
            .store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }
    fn idle_for(&self) -> Duration {
        let now = self.start.elapsed().as_millis() as u64;
        Duration::from_millis(now.saturating_sub(self.last_ms.load(Ordering::Relaxed)))
    }
}

/// Serves one accepted client connection until either side closes, it idles out, or
/// shutdown drains it.
pub async fn serve(client: TcpStream, peer: std::net::SocketAddr, shared: Arc<Shared>) {
    let cfg = &shared.cfg;
    let upstream = match tokio::time::timeout(
        cfg.connect_timeout(),
        TcpStream::connect(cfg.upstream.as_str()),
    )
    .await
    {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            shared
                .metrics
                .connection(crate::metrics::ConnOutcome::upstream_failed);
            tracing::warn!(%peer, upstream = %cfg.upstream, error = %e,
                "upstream master unreachable; closing client connection");
            return;
        }
        Err(_) => {
            shared
                .metrics
                .connection(crate::metrics::ConnOutcome::upstream_failed);
            tracing::warn!(%peer, upstream = %cfg.upstream, timeout_ms = cfg.connect_timeout_ms,
                "upstream master connect timed out; closing client connection");
            return;
        }
    };
    shared
        .metrics
        .connection(crate::metrics::ConnOutcome::accepted);
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    shared.metrics.upstream_connections_open.inc();
    tracing::debug!(%peer, "client connected");

    let (cr, cw) = client.into_split();
    let (ur, uw) = upstream.into_split();
    let queue = Queue {
        q: Mutex::new(VecDeque::new()),
        space: Semaphore::new(cfg.max_inflight_per_connection),
        local: Notify::new(),
    };
    let activity = Activity {
        start: Instant::now(),
        last_ms: AtomicU64::new(0),
    };
    let client_done = CancellationToken::new();

    let c2s = async {
        let _done = client_done.clone().drop_guard();
        client_to_master(cr, uw, &queue, &shared, &activity).await
    };
    let s2c = master_to_client(ur, cw, &queue, &shared, &activity, &client_done);
    let idle = idle_watch(&activity, cfg.idle_timeout());
    tokio::pin!(c2s, s2c, idle);

    let end = tokio::select! {
        e = &mut c2s => match e {
            // Shutdown: answers of forwarded calls still reach the client; the server
            // bounds the whole drain by the grace period.
            End::Draining => tokio::select! { e = &mut s2c => e, e = &mut idle => e },
            // Like the master, answer what came before the bad frame, then close.
            End::ClientFrame(err) => {
                let _ = tokio::time::timeout(ANSWER_BEFORE_CLOSE, &mut s2c).await;
                End::ClientFrame(err)
            }
            e => e,
        },
        e = &mut s2c => e,
        e = &mut idle => e,
    };
    shared.metrics.upstream_connections_open.dec();
    match end {
        End::ClientClosed => tracing::debug!(%peer, "client closed the connection"),
        End::Drained => tracing::debug!(%peer, "connection drained for shutdown"),
        End::Draining => tracing::debug!(%peer, "connection closed while draining"),
        End::ClientIo(e) => tracing::info!(%peer, error = %e, "client connection failed"),
        End::UpstreamIo(e) => {
            tracing::warn!(%peer, error = %e, "upstream connection failed; closing client")
        }
        End::UpstreamClosed { pending } => {
            tracing::warn!(%peer, pending, "upstream master closed the connection; closing client")
        }
        End::ClientFrame(e) => {
            tracing::warn!(%peer, error = %e, "malformed client frame; closing this connection")
        }
        End::UpstreamFrame(e) => {
            tracing::warn!(%peer, error = %e, "malformed master frame; closing this connection")
        }
        End::Idle(d) => {
            tracing::info!(%peer, idle_ms = d.as_millis() as u64, "idle connection closed")
        }
    }
}

async fn idle_watch(activity: &Activity, limit: Option<Duration>) -> End {
    let Some(limit) = limit else {
        return std::future::pending().await;
    };
    loop {
        let idle = activity.idle_for();
        if idle >= limit {
            return End::Idle(idle);
        }
        tokio::time::sleep(limit - idle).await;
    }
}

/// Writes out everything gathered for one side and counts it; `out` is left empty.
async fn flush(
    w: &mut OwnedWriteHalf,
    out: &mut BytesMut,
    bytes: &prometheus_client::metrics::counter::Counter,
) -> std::io::Result<()> {
    if !out.is_empty() {
        w.write_all(out).await?;
        bytes.inc_by(out.len() as u64);
        out.clear();
    }
    Ok(())
}

async fn client_to_master(
    mut cr: OwnedReadHalf,
    mut uw: OwnedWriteHalf,
    queue: &Queue,
    shared: &Shared,
    activity: &Activity,
) -> End {
    let cfg = &shared.cfg;
    let mut buf = BytesMut::with_capacity(READ_CHUNK);
    let mut out = BytesMut::with_capacity(READ_CHUNK);
    let mut client: Option<crate::codec::types::Uuid> = None;
    loop {
        let n = tokio::select! {
            biased;
            _ = shared.shutdown.cancelled() => return End::Draining,
            r = cr.read_buf(&mut buf) => match r {
                Ok(0) => return End::ClientClosed,
                Ok(n) => n,
                Err(e) => return End::ClientIo(e),
            },
        };
        activity.touch();
        loop {
            let h = match check_request(&buf, cfg.max_frame_bytes) {
                Ok(Some(h)) => h,
                Ok(None) => break,
                Err(e) => {
                    let kind = match e {
                        FrameError::TooLarge { .. } => FrameErrorKind::too_large,
                        _ => FrameErrorKind::bad_header,
                    };
                    shared.metrics.frame_error(Side::client, kind);
                    // Forward what was complete before the bad frame, then close.
                    let _ = flush(&mut uw, &mut out, &shared.metrics.bytes_to_master).await;
                    return End::ClientFrame(e);
                }
            };
            // Take a queue slot before the request can reach the master, so its answer
            // always finds its entry.
            match queue.space.try_acquire() {
                Ok(p) => p.forget(),
                Err(_) => {
                    // In-flight limit reached: push what we have, then wait for answers.
                    if let Err(e) = flush(&mut uw, &mut out, &shared.metrics.bytes_to_master).await
                    {
                        return End::UpstreamIo(e);
                    }
                    match queue.space.acquire().await {
                        Ok(p) => p.forget(),
                        Err(_) => return End::Drained,
                    }
                }
            }
            let (frame, raw) = RequestFrame::split(&mut buf, h);
            let method = Method::from_function_id(h.function_id);
            let sent = Instant::now();
            queue.push(
                match on_request(&frame, &raw, method, shared, &mut client, &mut out) {
                    Queued::Upstream(decided) => InFlight::Upstream {
                        seq: h.seq_num,
                        method,
                        sent,
                        decided,
                    },
                    Queued::Local(bytes) => InFlight::Local(bytes),
                },
            );
        }
        if let Err(e) = flush(&mut uw, &mut out, &shared.metrics.bytes_to_master).await {
            return End::UpstreamIo(e);
        }
        if buf.capacity() - buf.len() < 4096 {
            buf.reserve(READ_CHUNK.max(n));
        }
    }
}

async fn master_to_client(
    mut ur: OwnedReadHalf,
    mut cw: OwnedWriteHalf,
    queue: &Queue,
    shared: &Shared,
    activity: &Activity,
    client_done: &CancellationToken,
) -> End {
    let cfg = &shared.cfg;
    let mut buf = BytesMut::with_capacity(READ_CHUNK);
    let mut out = BytesMut::with_capacity(READ_CHUNK);
    let mut client_gone = false;
    let mut merge = Merge::default();
    loop {
        queue.drain_local(&mut out);
        if let Err(e) = flush(&mut cw, &mut out, &shared.metrics.bytes_to_client).await {
            return End::ClientIo(e);
        }
        if client_gone && queue.len() == 0 {
            // The client half stopped (shutdown) and every call is answered.
            return End::Drained;
        }
        tokio::select! {
            _ = client_done.cancelled(), if !client_gone => {
                client_gone = true;
                continue;
            }
            _ = queue.local.notified() => continue,
            r = ur.read_buf(&mut buf) => match r {
                Ok(0) => return End::UpstreamClosed { pending: queue.len() },
                Ok(_) => {}
                Err(e) => return End::UpstreamIo(e),
            },
        }
        activity.touch();
        loop {
            let h = match check_response(&buf, cfg.max_frame_bytes) {
                Ok(Some(h)) => h,
                Ok(None) => break,
                Err(e) => {
                    shared
                        .metrics
                        .frame_error(Side::upstream, FrameErrorKind::too_large);
                    let _ = flush(&mut cw, &mut out, &shared.metrics.bytes_to_client).await;
                    return End::UpstreamFrame(e);
                }
            };
            let (frame, raw) = ResponseFrame::split(&mut buf, h);
            // Answers moongate gave itself for earlier requests go first.
            queue.drain_local(&mut out);
            // The answers to the parts of a split batch come back to back; the entry
            // leaves the queue with the last one.
            let split = queue.head_split().filter(|(seq, ..)| *seq == h.seq_num);
            if let Some((_, parts, method)) = split {
                merge.add(method, &frame, &raw);
                if merge.got < parts {
                    continue;
                }
            }
            match queue.pop() {
                Some(InFlight::Upstream {
                    seq,
                    method,
                    sent,
                    decided,
                }) if seq == h.seq_num => {
                    let latency = sent.elapsed();
                    shared
                        .metrics
                        .method(method)
                        .latency
                        .observe(latency.as_secs_f64());
                    if split.is_some() {
                        on_merged(
                            seq,
                            std::mem::take(&mut merge).finish(seq),
                            method,
                            decided.as_ref(),
                            latency,
                            shared,
                            &mut out,
                        );
                    } else {
                        on_response(
                            &frame,
                            &raw,
                            method,
                            decided.as_ref(),
                            latency,
                            shared,
                            &mut out,
                        );
                    }
                }
                other => {
                    // Not what the master does; relay and let the client judge (it closes
                    // the connection on a seq it does not know).
                    merge = Merge::default();
                    shared
                        .metrics
                        .frame_error(Side::upstream, FrameErrorKind::unmatched_seq);
                    let expected = match other {
                        Some(InFlight::Upstream { seq, .. }) => Some(seq),
                        _ => None,
                    };
                    tracing::warn!(seq = h.seq_num, expected, "response out of request order");
                    out.extend_from_slice(&raw);
                }
            }
        }
        if let Err(e) = flush(&mut cw, &mut out, &shared.metrics.bytes_to_client).await {
            return End::ClientIo(e);
        }
        if buf.capacity() - buf.len() < 4096 {
            buf.reserve(READ_CHUNK);
        }
    }
}

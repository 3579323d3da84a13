//! The tokio shell of one client connection and its own upstream connection (never
//! shared: seq numbers are per connection). All protocol state lives in
//! [`Session`]; this file only moves bytes and time in and out of it.
//!
//! Two halves run concurrently and share the session under a lock held for
//! microseconds (never across an await):
//! - client -> master: read, cut request frames, hand each to the session (waiting for
//!   room when the in-flight queue is full: backpressure, never a failed request),
//!   write what the session gathered for the master;
//! - master -> client: read, cut response frames, hand each to the session, write what
//!   it gathered for the client (answers moongate gave itself included, in request
//!   order).
//!
//! Both halves read whatever is available and forward all complete frames in one write,
//! so pipelined requests stay pipelined.
//!
//! Four tasks per connection, so a wake-up polls only what woke: the client half, the
//! master half, the watches (idle, unanswered calls, a new master leader), which wake
//! on their timers alone, and the connection's own task, which waits for shutdown and
//! for the first of them to end (never woken by traffic). The halves hear from each
//! other through [`Flag`]s, which cost an atomic load per poll where a `Notify` takes a
//! lock.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::Notify;

use super::Shared;
use super::metrics::{CloseReason, FrameErrorKind, Side};
use super::session::Session;
use super::signal::Flag;
use crate::codec::frame::{check_request, check_response};
use crate::codec::{FrameError, RequestFrame, ResponseFrame};
use crate::topology::{Peer, PeerKey};

const READ_CHUNK: usize = 64 << 10;

/// After a malformed client frame: how long the requests forwarded before it may take to
/// be answered before the connection closes anyway.
const ANSWER_BEFORE_CLOSE: Duration = Duration::from_secs(5);

/// The session and the wake-ups between the two halves.
struct Shell {
    session: Mutex<Session>,
    /// The master half popped entries: the client half may hand in more requests
    /// (waited on only when the in-flight queue is full).
    room: Notify,
    /// A pulse to the master half: the client half left bytes for the client (a local
    /// answer), or ended.
    to_client: Flag,
    /// The client half ended (the master half drains what is in flight, then ends).
    client_gone: Flag,
    /// Shutdown: the client half stops reading requests (raised by the connection's
    /// task, so the halves never poll the process-wide token).
    stop: Flag,
}

/// Raised when the client half's task ends, however it ends (aborted included).
struct ClientGone(Arc<Shell>);

impl Drop for ClientGone {
    fn drop(&mut self) {
        self.0.client_gone.raise();
        self.0.to_client.raise();
    }
}

impl Shell {
    fn lock(&self) -> MutexGuard<'_, Session> {
        self.session.lock().unwrap_or_else(|p| p.into_inner())
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
    /// A forwarded call waited this long for the master's answer.
    UpstreamSilent(Duration),
    /// The master leader changed: this connection's upstream is no longer it.
    LeaderChanged,
    Drained,
    /// The client half stopped for shutdown; the master half decides the final end.
    Draining,
}

/// Whether a byte moved since the idle watch last looked: a flag set per read, so the
/// request path reads no clock for it.
#[derive(Default)]
struct Activity {
    moved: AtomicBool,
}

impl Activity {
    fn touch(&self) {
        self.moved.store(true, Ordering::Relaxed);
    }
    fn take(&self) -> bool {
        self.moved.swap(false, Ordering::Relaxed)
    }
}

use crate::topology::IDENTIFY_WITHIN;

/// A connection's peer, counted as connected until this is dropped.
struct Joined(Arc<Peer>, Arc<crate::topology::Topology>);

impl Drop for Joined {
    fn drop(&mut self) {
        self.1.leave(&self.0);
    }
}

/// The process (or address) behind a connection, found off the runtime.
async fn identify(client: &TcpStream, peer: std::net::SocketAddr, shared: &Arc<Shared>) -> Joined {
    let topo = shared.topology.clone();
    let (key, release) = match client.local_addr() {
        Ok(ours) => {
            let t = topo.clone();
            let found = tokio::task::spawn_blocking(move || {
                let key = t.identify(ours, peer);
                // A process seen before keeps what it showed; a new one is read once.
                let release = match key {
                    PeerKey::Process { pid, .. } if t.release_of(key).is_none() => {
                        crate::topology::identify::mooncake_release(pid)
                    }
                    _ => None,
                };
                (key, release)
            });
            match tokio::time::timeout(IDENTIFY_WITHIN, found).await {
                Ok(Ok(k)) => k,
                _ => (PeerKey::Addr(peer.ip()), None),
            }
        }
        Err(_) => (PeerKey::Addr(peer.ip()), None),
    };
    tracing::debug!(%peer, who = %key, release = release.map(|r| r.label()), "client identified");
    let joined = topo.join(key);
    if let Some(r) = release
        && joined.release().is_none()
    {
        joined.saw_release(r.schema());
    }
    Joined(joined, topo)
}

/// The sequence number of the release probe: answered before any client call is
/// relayed, so it cannot be confused with one.
const PROBE_SEQ: u32 = u32::MAX;

/// Asks the master its release ([`crate::codec::release`]) before the connection
/// carries the client's calls: one round trip, within `connect_timeout_ms`. `None`
/// (logged) when the answer tells none: calls are then relayed as received.
async fn probe_release(
    up: &mut TcpStream,
    shared: &Shared,
) -> Option<crate::codec::release::MasterRelease> {
    use crate::codec::release;
    let max = shared.cfg.max_frame_bytes;
    shared.metrics.release_probes.inc();
    let ask = async {
        up.write_all(&release::probe(PROBE_SEQ)).await?;
        let mut buf = BytesMut::with_capacity(1024);
        loop {
            match check_response(&buf, max) {
                Ok(Some(h)) => {
                    let (f, _) = ResponseFrame::split(&mut buf, h);
                    return Ok(release::classify(&f));
                }
                Ok(None) => {}
                Err(e) => return Err(std::io::Error::other(e.to_string())),
            }
            if up.read_buf(&mut buf).await? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
        }
    };
    match tokio::time::timeout(shared.cfg.connect_timeout(), ask).await {
        Ok(Ok(Some(r))) => Some(r),
        Ok(Ok(None)) => {
            tracing::warn!(
                "the master's answer to the release probe names no known release; calls relayed as received"
            );
            None
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "release probe failed; calls relayed as received");
            None
        }
        Err(_) => {
            tracing::warn!(
                "release probe unanswered within connect_timeout_ms; calls relayed as received"
            );
            None
        }
    }
}

/// How often a held client connection tries the master again (see
/// [`connect_upstream`]): a connect refused on loopback costs microseconds, and a new
/// leader is reached within this of when it opens its port.
const HOLD_RETRY: Duration = Duration::from_millis(50);

/// How long a client connection that found no leader is given to show its first call
/// (a client writes it as soon as it connects) before it is closed as before.
const FIRST_CALL_WITHIN: Duration = Duration::from_millis(200);

/// Opens the upstream connection for a new client connection, to the master in force.
/// With HA masters (a leader followed) while none serves (none named, or the one named
/// refusing: a new leader warms up with its address already published), a connection
/// whose first call brings a client's segments back (`Ping`, a mount or remount) is
/// held, and the connect tried again every [`HOLD_RETRY`] and at each change of
/// leader, for up to `master_face.failover_hold_ms`: the client (an owner's ping, once
/// a second) reaches the new leader as it starts serving, and remounts then rather
/// than up to a second later. Other calls are not held: they fail at once, as with
/// the master directly, and the engine decides (a load recomputed, a put retried).
/// `None` (after logging why): the client is closed.
async fn connect_upstream(
    client: &TcpStream,
    leader: &mut crate::upstream::Upstream,
    peer: std::net::SocketAddr,
    shared: &Shared,
) -> Option<(TcpStream, String)> {
    let cfg = &shared.cfg;
    let mut until: Option<Instant> = None;
    let why = loop {
        let why = match leader.addr() {
            None => "no master leader".to_string(),
            Some(addr) => {
                match tokio::time::timeout(cfg.connect_timeout(), TcpStream::connect(addr.as_str()))
                    .await
                {
                    Ok(Ok(s)) => {
                        if until.is_some() {
                            shared.metrics.held(true);
                            tracing::info!(%peer, upstream = %addr,
                                "client connection held for a leader reached it");
                        }
                        return Some((s, addr));
                    }
                    Ok(Err(e)) => format!("upstream master {addr} unreachable: {e}"),
                    Err(_) => format!(
                        "upstream master {addr} connect timed out after {} ms",
                        cfg.connect_timeout_ms
                    ),
                }
            }
        };
        let t = match until {
            Some(t) => t,
            None => match cfg.failover_hold().filter(|_| leader.follows_a_leader()) {
                Some(hold) if brings_segments_back(client).await => {
                    let t = Instant::now() + hold;
                    until = Some(t);
                    t
                }
                _ => break why,
            },
        };
        if Instant::now() >= t {
            shared.metrics.held(false);
            break why;
        }
        let pause = HOLD_RETRY.min(t.saturating_duration_since(Instant::now()));
        tokio::select! {
            _ = leader.changed() => {}
            _ = tokio::time::sleep(pause) => {}
            _ = shared.shutdown.cancelled() => break why,
        }
    };
    tracing::warn!(%peer, held = until.is_some(), error = %why,
        "upstream master unreachable; closing client connection");
    None
}

/// Whether the client's first call (peeked, left in the socket for the relay) is one
/// that brings its segments back at a new leader: its keep-alive `Ping` (answered
/// `NEED_REMOUNT` there) or a mount or remount.
async fn brings_segments_back(client: &TcpStream) -> bool {
    let mut h = [0u8; crate::codec::frame::REQUEST_HEADER_LEN];
    let peeked = tokio::time::timeout(FIRST_CALL_WITHIN, async {
        // A peek returns what has arrived; the header may come in pieces.
        loop {
            match client.peek(&mut h).await {
                Ok(n) if n >= h.len() => return true,
                Ok(0) | Err(_) => return false,
                Ok(_) => tokio::time::sleep(Duration::from_millis(5)).await,
            }
        }
    })
    .await;
    if peeked != Ok(true) {
        return false;
    }
    use crate::codec::Method as M;
    matches!(
        M::from_function_id(crate::codec::RequestHeader::parse(&h).function_id),
        Some(
            M::Ping
                | M::MountSegment
                | M::ReMountSegment
                | M::MountNoFSegment
                | M::ReMountNoFSegment
                | M::MountLocalDiskSegment
        )
    )
}

/// Serves one accepted client connection until either side closes, it idles out, or
/// shutdown drains it.
pub async fn serve(client: TcpStream, peer: std::net::SocketAddr, shared: Arc<Shared>) {
    let cfg = &shared.cfg;
    let mut leader = shared.upstream.clone();
    let Some((upstream, addr)) = connect_upstream(&client, &mut leader, peer, &shared).await else {
        shared
            .metrics
            .connection(super::metrics::ConnOutcome::upstream_failed);
        return;
    };
    shared
        .metrics
        .connection(super::metrics::ConnOutcome::accepted);
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    shared.metrics.upstream_connections_open.inc();
    tracing::debug!(%peer, "client connected");

    let mut upstream = upstream;
    // Both before the first call is relayed, at once: a master round trip, and up to
    // IDENTIFY_WITHIN reading /proc.
    let (release, who) = tokio::join!(
        async {
            match cfg.fixed_release() {
                Some(r) => Some(r),
                None => probe_release(&mut upstream, &shared).await,
            }
        },
        identify(&client, peer, &shared)
    );
    let (cr, cw) = client.into_split();
    let (ur, uw) = upstream.into_split();
    let shell = Arc::new(Shell {
        session: Mutex::new(Session::new(shared.clone(), who.0.clone()).with_master(release)),
        room: Notify::new(),
        to_client: Flag::default(),
        client_gone: Flag::default(),
        stop: Flag::default(),
    });
    let activity = Arc::new(Activity::default());

    // The watches run in their own task: they wake on their timers, not on every
    // chunk of traffic (polled beside the halves, they cost a timer and a watch check
    // per wake-up of the connection).
    let (watch_tx, watch_rx) = tokio::sync::oneshot::channel();
    let watches = {
        let (shell, activity) = (shell.clone(), activity.clone());
        let (idle_limit, answer_limit) = (cfg.idle_timeout(), cfg.answer_timeout());
        let addr = addr.clone();
        tokio::spawn(async move {
            let end = tokio::select! {
                e = idle_watch(&activity, idle_limit) => e,
                e = answer_watch(&shell, answer_limit) => e,
                // A new leader: no new call may go to the old one. The client reconnects
                // through moongate and reaches the new leader (and remounts, as it would
                // directly).
                e = async {
                    loop {
                        leader.changed().await;
                        if leader.addr().as_deref() != Some(addr.as_str()) {
                            return End::LeaderChanged;
                        }
                    }
                } => e,
            };
            let _ = watch_tx.send(end);
        })
    };
    let _stop_watches = AbortOnDrop(watches);
    let watched = async {
        match watch_rx.await {
            Ok(e) => e,
            // The task ended without a word (it cannot, short of a panic): keep serving.
            Err(_) => std::future::pending().await,
        }
    };

    // Each half is its own task: a request wakes only the client half, an answer only
    // the master half (this task, polled with both, cost every wake-up a poll of all).
    let c2s = AbortOnDrop(tokio::spawn({
        let (shell, shared, activity) = (shell.clone(), shared.clone(), activity.clone());
        async move {
            let _gone = ClientGone(shell.clone());
            client_to_master(cr, uw, &shell, &shared, &activity).await
        }
    }));
    let s2c = AbortOnDrop(tokio::spawn({
        let (shell, shared, activity) = (shell.clone(), shared.clone(), activity.clone());
        async move { master_to_client(ur, cw, &shell, &shared, &activity).await }
    }));
    let half = |r: Result<End, tokio::task::JoinError>, which: &str| {
        r.unwrap_or_else(|e| {
            End::UpstreamIo(std::io::Error::other(format!("{which} half ended: {e}")))
        })
    };
    let (mut c2s, mut s2c) = (c2s, s2c);
    let s2c_end = async {
        let r = (&mut s2c.0).await;
        half(r, "master")
    };
    let shutdown = shared.shutdown.cancelled();
    tokio::pin!(s2c_end, watched, shutdown);

    let mut stopping = false;
    let end = loop {
        tokio::select! {
            _ = &mut shutdown, if !stopping => {
                stopping = true;
                shell.stop.raise();
            }
            r = &mut c2s.0 => break match half(r, "client") {
                // Shutdown: answers of forwarded calls still reach the client; the server
                // bounds the whole drain by the grace period.
                End::Draining => tokio::select! { e = &mut s2c_end => e, e = &mut watched => e },
                // Like the master, answer what came before the bad frame, then close.
                End::ClientFrame(err) => {
                    let _ = tokio::time::timeout(ANSWER_BEFORE_CLOSE, &mut s2c_end).await;
                    End::ClientFrame(err)
                }
                e => e,
            },
            e = &mut s2c_end => break e,
            e = &mut watched => break e,
        }
    };
    shared.metrics.upstream_connections_open.dec();
    shared.metrics.closed(end.reason());
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
        End::UpstreamSilent(d) => tracing::warn!(%peer, upstream = %addr,
            waited_ms = d.as_millis() as u64,
            "a call got no answer from the master in time; closing the connection"),
        End::LeaderChanged => tracing::info!(%peer, old = %addr,
            "master leader changed; closing the client connection so it reconnects"),
    }
}

impl End {
    fn reason(&self) -> CloseReason {
        match self {
            End::ClientClosed => CloseReason::client_closed,
            End::ClientIo(_) => CloseReason::client_error,
            End::ClientFrame(_) => CloseReason::client_bad_frame,
            End::UpstreamClosed { .. } => CloseReason::upstream_closed,
            End::UpstreamIo(_) => CloseReason::upstream_error,
            End::UpstreamFrame(_) => CloseReason::upstream_bad_frame,
            End::UpstreamSilent(_) => CloseReason::upstream_silent,
            End::Idle(_) => CloseReason::idle,
            End::LeaderChanged => CloseReason::leader_changed,
            End::Drained | End::Draining => CloseReason::shutdown,
        }
    }
}

/// Ends the connection once the oldest forwarded call has waited `limit` for its
/// answer. Checked every tenth of the limit (at most every second), so a silence is
/// noticed within 1.1 x the limit at worst.
async fn answer_watch(shell: &Shell, limit: Option<Duration>) -> End {
    let Some(limit) = limit else {
        return std::future::pending().await;
    };
    let tick = (limit / 10).clamp(Duration::from_millis(10), Duration::from_secs(1));
    loop {
        tokio::time::sleep(tick).await;
        let oldest = shell.lock().oldest_unanswered();
        if let Some(waited) = oldest.map(|t| t.elapsed())
            && waited >= limit
        {
            return End::UpstreamSilent(waited);
        }
    }
}

/// Ends the connection once no byte moved for `limit`: looks every quarter of it, so
/// an idle connection closes between `limit` and 1.25 x `limit`.
async fn idle_watch(activity: &Activity, limit: Option<Duration>) -> End {
    let Some(limit) = limit else {
        return std::future::pending().await;
    };
    let tick = (limit / 4).max(Duration::from_millis(1));
    let mut quiet = Duration::ZERO;
    loop {
        tokio::time::sleep(tick).await;
        if activity.take() {
            quiet = Duration::ZERO;
        } else {
            quiet += tick;
            if quiet >= limit {
                return End::Idle(quiet);
            }
        }
    }
}

/// Aborts a task when dropped (the connection's watches and master half end with it).
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn client_to_master(
    mut cr: OwnedReadHalf,
    mut uw: OwnedWriteHalf,
    shell: &Shell,
    shared: &Shared,
    activity: &Activity,
) -> End {
    let cfg = &shared.cfg;
    let mut buf = BytesMut::with_capacity(READ_CHUNK);
    loop {
        let n = tokio::select! {
            biased;
            _ = shell.stop.raised() => return End::Draining,
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
                    shared
                        .metrics
                        .frame_error(Side::client, FrameErrorKind::of(&e));
                    // Forward what was complete before the bad frame, then close.
                    let pending = shell.lock().poll_to_master();
                    let _ = flush(&mut uw, pending, &shared.metrics.bytes_to_master).await;
                    return End::ClientFrame(e);
                }
            };
            // Room in the in-flight queue before the request can reach the master, so
            // its answer always finds its entry. (`notify_one` keeps a permit when nobody
            // waits, so an answer that frees room before the wait starts is not lost.)
            while !shell.lock().has_room() {
                // In-flight limit reached: push what we have, then wait for answers.
                let pending = shell.lock().poll_to_master();
                if let Err(e) = flush(&mut uw, pending, &shared.metrics.bytes_to_master).await {
                    return End::UpstreamIo(e);
                }
                tokio::select! {
                    _ = shell.room.notified() => {}
                    _ = shell.stop.raised() => return End::Drained,
                }
            }
            let (frame, raw) = RequestFrame::split(&mut buf, h);
            let local = {
                let mut s = shell.lock();
                s.handle_request(&frame, &raw, Instant::now());
                s.has_output_for_client()
            };
            if local {
                shell.to_client.raise();
            }
        }
        let pending = shell.lock().poll_to_master();
        if let Err(e) = flush(&mut uw, pending, &shared.metrics.bytes_to_master).await {
            return End::UpstreamIo(e);
        }
        if buf.capacity() - buf.len() < 4096 {
            buf.reserve(READ_CHUNK.max(n));
        }
    }
}

/// Writes out bytes gathered for one side and counts them.
async fn flush(
    w: &mut OwnedWriteHalf,
    bytes: Option<Bytes>,
    counter: &prometheus_client::metrics::counter::Counter,
) -> std::io::Result<()> {
    if let Some(b) = bytes {
        w.write_all(&b).await?;
        counter.inc_by(b.len() as u64);
    }
    Ok(())
}

async fn master_to_client(
    mut ur: OwnedReadHalf,
    mut cw: OwnedWriteHalf,
    shell: &Shell,
    shared: &Shared,
    activity: &Activity,
) -> End {
    let cfg = &shared.cfg;
    let mut buf = BytesMut::with_capacity(READ_CHUNK);
    loop {
        // Looked at before the flush: anything the client half gathered before it ended
        // goes out in this round.
        let client_gone = shell.client_gone.is_raised();
        let (out, pending) = {
            let mut s = shell.lock();
            (s.poll_to_client(), s.in_flight())
        };
        if let Err(e) = flush(&mut cw, out, &shared.metrics.bytes_to_client).await {
            return End::ClientIo(e);
        }
        if client_gone && pending == 0 {
            // The client half stopped (shutdown) and every call is answered.
            return End::Drained;
        }
        tokio::select! {
            biased;
            // Also raised once the client half ends.
            _ = shell.to_client.taken() => continue,
            r = ur.read_buf(&mut buf) => match r {
                Ok(0) => {
                    let pending = shell.lock().in_flight();
                    return End::UpstreamClosed { pending };
                }
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
                        .frame_error(Side::upstream, FrameErrorKind::of(&e));
                    let pending = shell.lock().poll_to_client();
                    let _ = flush(&mut cw, pending, &shared.metrics.bytes_to_client).await;
                    return End::UpstreamFrame(e);
                }
            };
            let (frame, raw) = ResponseFrame::split(&mut buf, h);
            let was_full = {
                let mut s = shell.lock();
                let full = !s.has_room();
                s.handle_response(&frame, &raw, Instant::now());
                full
            };
            if was_full {
                shell.room.notify_one();
            }
        }
        if buf.capacity() - buf.len() < 4096 {
            buf.reserve(READ_CHUNK);
        }
    }
}

#[cfg(test)]
mod tests {
    //! The shell on loopback sockets, between a test client and a scripted master
    //! (no real master, no wasm): pipelined requests keep their order and the in-flight
    //! bound holds back what the master sees.

    use super::*;
    use crate::codec::message::{KeyArgs, Request, Response};
    use crate::codec::{BodyStyle, Method, RequestHeader, ResponseHeader};
    use crate::metrics::Metrics;
    use crate::policy::Policy;
    use crate::policy::fake::Fake;
    use crate::policy::registry::Registry;
    use std::sync::atomic::AtomicU64;
    use tokio::net::TcpListener;

    fn exist(seq: u32) -> BytesMut {
        let req = Request::ExistKey(KeyArgs {
            key: Bytes::from(format!("k{seq}")),
            tenant_id: Bytes::from_static(b"default"),
        });
        let mut body = BytesMut::new();
        req.encode_body(BodyStyle::MOONCAKE, &mut body);
        let mut out = BytesMut::new();
        RequestHeader::new(seq, Method::ExistKey.function_id(), body.len() as u32).write(&mut out);
        out.extend_from_slice(&body);
        out
    }

    /// A master that answers every ExistKey `true`, in order, and records the most
    /// requests it ever held unanswered.
    async fn scripted_master(l: TcpListener, most_pending: Arc<AtomicU64>) {
        let (mut s, _) = l.accept().await.unwrap();
        let mut buf = BytesMut::new();
        loop {
            if s.read_buf(&mut buf).await.unwrap_or(0) == 0 {
                return;
            }
            // Give a client that ignores the bound every chance to send more.
            tokio::time::sleep(Duration::from_millis(20)).await;
            let _ = tokio::time::timeout(Duration::from_millis(1), s.read_buf(&mut buf)).await;
            let mut out = BytesMut::new();
            let mut pending = 0;
            while let Ok(Some(h)) = check_request(&buf, 1 << 20) {
                let _ = RequestFrame::split(&mut buf, h);
                pending += 1;
                let mut body = BytesMut::new();
                Response::ExistKey(Ok(true)).encode_body(BodyStyle::MOONCAKE, &mut body);
                ResponseHeader::new(h.seq_num, 0, body.len() as u32).write(&mut out);
                out.extend_from_slice(&body);
            }
            most_pending.fetch_max(pending, Ordering::Relaxed);
            s.write_all(&out).await.unwrap();
        }
    }

    /// A master face whose one connection is served by [`serve`]; its address.
    async fn face(
        cfg: super::super::config::MasterFaceConfig,
        all: &Metrics,
    ) -> std::net::SocketAddr {
        let fake: Arc<dyn Policy> = Arc::new(Fake::new("p"));
        let topology = Arc::new(crate::topology::Topology::new(all.topology.clone()));
        let shared = Arc::new(Shared {
            upstream: crate::upstream::Upstream::fixed(&cfg.upstream),
            cfg,
            metrics: all.master.clone(),
            shutdown: tokio_util::sync::CancellationToken::new(),
            policy: Registry::with_policies(
                Default::default(),
                None,
                all.policy.clone(),
                vec![fake],
            )
            .unwrap(),
            put_bytes_in_flight: Default::default(),
            answered: Arc::new(crate::answered::Sink::new(None, None, topology.clone())),
            topology,
            owner_face: None,
        });
        let face = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let face_addr = face.local_addr().unwrap();
        tokio::spawn(async move {
            let (sock, peer) = face.accept().await.unwrap();
            serve(sock, peer, shared).await;
        });
        face_addr
    }

    #[tokio::test]
    async fn pipelined_requests_are_answered_in_order_within_the_in_flight_bound() {
        let master = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let most_pending = Arc::new(AtomicU64::new(0));
        let upstream = master.local_addr().unwrap().to_string();
        tokio::spawn(scripted_master(master, most_pending.clone()));
        let all = Metrics::new();
        let cfg = super::super::config::MasterFaceConfig {
            upstream,
            max_inflight_per_connection: 2,
            ..Default::default()
        };
        let mut client = TcpStream::connect(face(cfg, &all).await).await.unwrap();
        let seqs = [9u32, 2, 700, 3, 41, 5, 6];
        let mut burst = BytesMut::new();
        for &q in &seqs {
            burst.extend_from_slice(&exist(q));
        }
        client.write_all(&burst).await.unwrap();
        let mut buf = BytesMut::new();
        let mut got = Vec::new();
        while got.len() < seqs.len() {
            let read = tokio::time::timeout(Duration::from_secs(10), client.read_buf(&mut buf));
            assert!(read.await.unwrap().unwrap() > 0, "connection closed early");
            while let Ok(Some(h)) = check_response(&buf, 1 << 20) {
                let _ = ResponseFrame::split(&mut buf, h);
                got.push(h.seq_num);
            }
        }
        assert_eq!(got, seqs, "answers in request order, seqs as sent");
        let most = most_pending.load(Ordering::Relaxed);
        assert!(
            (1..=2).contains(&most),
            "the master saw {most} requests at once; the bound is 2"
        );
    }

    /// A master that accepts and reads but never answers (frozen, or a black hole on
    /// the way): the connection is closed once the call has waited the answer timeout,
    /// and the end is counted.
    #[tokio::test]
    async fn a_call_the_master_never_answers_closes_the_connection() {
        let master = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream = master.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (mut s, _) = master.accept().await.unwrap();
            let mut sink = BytesMut::new();
            while s.read_buf(&mut sink).await.unwrap_or(0) > 0 {}
        });
        let all = Metrics::new();
        let cfg = super::super::config::MasterFaceConfig {
            upstream,
            answer_timeout_ms: 200,
            ..Default::default()
        };
        let mut client = TcpStream::connect(face(cfg, &all).await).await.unwrap();
        client.write_all(&exist(1)).await.unwrap();
        let started = Instant::now();
        let mut buf = BytesMut::new();
        let read = tokio::time::timeout(Duration::from_secs(10), client.read_buf(&mut buf));
        assert_eq!(read.await.expect("closed in time").unwrap_or(0), 0);
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(200),
            "closed after {waited:?}"
        );
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &all.registry).unwrap();
        assert!(
            text.contains("moongate_master_connections_closed_total{reason=\"upstream_silent\"} 1"),
            "{text}"
        );
    }
}

//! The owner face: moongate in front of owners' offload-read service, the path a rank
//! reads an SSD-resident value by (`batch_get_offload_object` to the endpoint its
//! lookup answer named, a transfer-engine read of the staged bytes straight from the
//! owner, `release_offload_buffer`). The master face points each SSD copy in the
//! lookup answers it gives ranks at a relay here, one listener per owner
//! ([`OwnerFace::endpoint_for`]); the relay reads each call and forwards it:
//!
//! - a read is counted (keys and bytes an owner staged from its SSD: the disk reads
//!   themselves, per moongate), cut into parts where `part_keys`, `part_bytes` or the
//!   arm's `split` hook say (the parts go to the owner in parallel, each a whole call;
//!   their answers become the one answer the rank expects, under a batch id moongate
//!   makes up and maps back to the parts' ids at the release), and paced: a read that
//!   would take the owner's staging for this moongate's ranks past `max_staged_bytes`
//!   waits for releases, at most `max_wait_ms` (never a failure);
//! - a release of a made-up id releases every part; any other call is relayed whole.
//!
//! Bytes never pass here: the rank reads the staged values from the owner's transfer
//! engine, whose address the answer carries unchanged. Owners themselves are never
//! pointed here (their own reads of their SSD stay local).
//!
//! Knows sockets and the offload-read calls ([`crate::calls::offload_read`]); not the
//! master's methods, which stay the master face's.

pub mod config;
pub mod metrics;
pub mod staged;

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::future::join_all;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, Semaphore, mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::accept::{ConnLimit, Slot};
use crate::calls::offload_read::{self, ReadAnswer, ReadCall, Release};
use crate::codec::frame::{RESPONSE_HEADER_LEN, check_request, check_response, errc};
use crate::codec::types::Uuid;
use crate::codec::{RequestFrame, RequestHeader, ResponseHeader, RpcError};
use crate::policy::registry::Registry;
use crate::topology::{IDENTIFY_WITHIN, PeerKey, Topology};

pub use config::OwnerFaceConfig;
pub use metrics::{Outcome, OwnerFaceMetrics};
use staged::{Named, Staged};

/// Batches remembered per owner (a made-up id must be found at its release); about
/// 60 bytes each by the layout, plus 8 per part of a cut read (not measured).
const MAX_BATCHES: usize = 65_536;

/// How often a read waiting for staging room looks for batches past their ttl (an
/// owner frees those without a release, so no release wakes the waiter).
const SWEEP_EVERY: Duration = Duration::from_millis(50);

/// The owner face: one relay per owner, created as lookup answers name owners.
pub struct OwnerFace {
    cfg: OwnerFaceConfig,
    metrics: Arc<OwnerFaceMetrics>,
    policy: Arc<Registry>,
    /// Who the ranks are: an experiment that assigns arms by client picks a rank's
    /// reads' `split` hook by the client id its master-face calls carried.
    topology: Arc<Topology>,
    /// By the owner's own endpoint, as the master names it.
    owners: Mutex<HashMap<Bytes, Arc<Owner>>>,
    limit: ConnLimit,
    shutdown: CancellationToken,
    tracker: TaskTracker,
    /// The clock `Owner::named_ms` counts from.
    epoch: std::time::Instant,
    /// The reaper of relays no answer names any more runs (started with the first relay).
    reaping: std::sync::Once,
}

/// One owner's relay: where the owner is, the connections to it, what it holds staged.
struct Owner {
    upstream: String,
    /// The relay's address, as lookup answers name it.
    advertised: Bytes,
    idle: Mutex<Vec<TcpStream>>,
    conns: Semaphore,
    staged: Mutex<Staged>,
    /// Woken when staging room frees.
    room: Notify,
    /// When a lookup answer last named this owner (ms since the face's epoch).
    named_ms: std::sync::atomic::AtomicU64,
    /// Rank connections open on this relay.
    open: std::sync::atomic::AtomicUsize,
    /// Stops this relay's listener (it is retired, or moongate stops).
    stop: CancellationToken,
}

/// A call to an owner that did not get an answer.
#[derive(Debug, thiserror::Error)]
enum CallError {
    #[error("cannot reach the owner at {0}: {1}")]
    Connect(String, std::io::Error),
    #[error("owner at {0}: {1}")]
    Io(String, std::io::Error),
    /// The connection ended before any byte of an answer.
    #[error("the owner closed the connection without answering: {0}")]
    Closed(std::io::Error),
    #[error("owner at {0} did not answer within {1:?}")]
    Timeout(String, Duration),
    #[error("owner at {0} sent a malformed answer: {1}")]
    Frame(String, crate::codec::FrameError),
}

/// An owner's answer to one call.
struct Answer {
    header: ResponseHeader,
    body: Bytes,
    raw: Bytes,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A reply frame with `body`, answering `seq`.
fn reply(seq: u32, body: &Bytes) -> Bytes {
    let mut out = BytesMut::with_capacity(RESPONSE_HEADER_LEN + body.len());
    ResponseHeader::new(seq, errc::OK, body.len() as u32).write(&mut out);
    out.extend_from_slice(body);
    out.freeze()
}

/// A request frame for `body`, as the rank's call `h` but with that body.
fn request(h: &RequestHeader, body: &Bytes) -> Bytes {
    let mut out = BytesMut::with_capacity(20 + body.len());
    let mut h = *h;
    h.length = body.len() as u32;
    h.attach_length = 0;
    h.write(&mut out);
    out.extend_from_slice(body);
    out.freeze()
}

/// Room reserved at an owner for a part on its way; given back when dropped.
struct Reservation<'a> {
    owner: &'a Owner,
    bytes: u64,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        lock(&self.owner.staged).unreserve(self.bytes);
        self.owner.room.notify_waiters();
    }
}

impl Owner {
    /// Sends one call frame and waits for its answer, on a connection of its own. A
    /// pooled connection the owner closed while it was idle (it answers nothing) is
    /// replaced by a fresh one once.
    async fn call(&self, cfg: &OwnerFaceConfig, frame: &Bytes) -> Result<Answer, CallError> {
        // The semaphore lives as long as the owner and is never closed.
        let _permit = self.conns.acquire().await;
        let pooled = lock(&self.idle).pop();
        if let Some(s) = pooled {
            match self.exchange(cfg, s, frame).await {
                Err(CallError::Closed(_)) => {}
                r => return r,
            }
        }
        let limit = Duration::from_millis(cfg.connect_timeout_ms);
        let s = tokio::time::timeout(limit, TcpStream::connect(&self.upstream))
            .await
            .map_err(|_| CallError::Timeout(self.upstream.clone(), limit))?
            .map_err(|e| CallError::Connect(self.upstream.clone(), e))?;
        let _ = s.set_nodelay(true);
        self.exchange(cfg, s, frame).await
    }

    async fn exchange(
        &self,
        cfg: &OwnerFaceConfig,
        mut s: TcpStream,
        frame: &Bytes,
    ) -> Result<Answer, CallError> {
        let limit = Duration::from_millis(cfg.call_timeout_ms);
        let closed = |e: std::io::Error| CallError::Closed(e);
        let answer = tokio::time::timeout(limit, async {
            s.write_all(frame).await.map_err(closed)?;
            let mut buf = BytesMut::with_capacity(RESPONSE_HEADER_LEN + 256);
            loop {
                match check_response(&buf, cfg.max_frame_bytes) {
                    Ok(Some(h)) => {
                        let (f, raw) = crate::codec::ResponseFrame::split(&mut buf, h);
                        return Ok(Answer {
                            header: f.header,
                            body: f.body,
                            raw,
                        });
                    }
                    Ok(None) => {}
                    Err(e) => return Err(CallError::Frame(self.upstream.clone(), e)),
                }
                let n = match s.read_buf(&mut buf).await {
                    Ok(n) => n,
                    Err(e) if buf.is_empty() => return Err(closed(e)),
                    Err(e) => return Err(CallError::Io(self.upstream.clone(), e)),
                };
                if n == 0 {
                    let eof = std::io::ErrorKind::UnexpectedEof.into();
                    return Err(if buf.is_empty() {
                        closed(eof)
                    } else {
                        CallError::Io(self.upstream.clone(), eof)
                    });
                }
            }
        })
        .await
        .map_err(|_| CallError::Timeout(self.upstream.clone(), limit))??;
        // One answer per call: nothing else can be waiting on this connection.
        lock(&self.idle).push(s);
        Ok(answer)
    }
}

impl OwnerFace {
    pub fn new(
        cfg: OwnerFaceConfig,
        metrics: Arc<OwnerFaceMetrics>,
        policy: Arc<Registry>,
        topology: Arc<Topology>,
        shutdown: CancellationToken,
    ) -> Arc<OwnerFace> {
        let limit = ConnLimit::new(
            cfg.max_connections,
            // A rank's connection waits idle between reads: never shed.
            Duration::ZERO,
            metrics.conns_refused.clone(),
            metrics.conns_shed.clone(),
            metrics.conns_open.clone(),
        );
        Arc::new(OwnerFace {
            cfg,
            metrics,
            policy,
            topology,
            owners: Mutex::new(HashMap::new()),
            limit,
            shutdown,
            tracker: TaskTracker::new(),
            epoch: std::time::Instant::now(),
            reaping: std::sync::Once::new(),
        })
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Every quarter of `idle_owner_ms`: relays no lookup answer named for that long and
    /// with no rank connection open are closed, so owners that went away (an owner that
    /// restarts comes back on another port) do not hold listeners and `max_owners`
    /// places for good.
    async fn reap(self: Arc<Self>) {
        let idle = self.cfg.idle_owner_ms;
        let every = Duration::from_millis((idle / 4).max(10));
        loop {
            tokio::select! {
                _ = self.shutdown.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            let now = self.now_ms();
            let mut owners = lock(&self.owners);
            owners.retain(|_, o| {
                let keep = now.saturating_sub(o.named_ms.load(Ordering::Relaxed)) < idle
                    || o.open.load(Ordering::Relaxed) > 0;
                if !keep {
                    o.stop.cancel();
                    self.metrics.owners.dec();
                    self.metrics.owners_retired.inc();
                    tracing::info!(owner = %o.upstream,
                        "owner face: relay closed, no lookup named this owner for idle_owner_ms");
                }
                keep
            });
        }
    }

    /// The relay's endpoint for the owner whose offload-read service is `upstream`
    /// (opening a listener for it the first time), or `None`: past `max_owners`, an
    /// endpoint that is not text, or no listener could be opened (each logged).
    pub fn endpoint_for(self: &Arc<Self>, upstream: &Bytes) -> Option<Bytes> {
        let mut owners = lock(&self.owners);
        if let Some(o) = owners.get(upstream) {
            o.named_ms.store(self.now_ms(), Ordering::Relaxed);
            return Some(o.advertised.clone());
        }
        if owners.len() >= self.cfg.max_owners {
            self.metrics.owners_refused.inc();
            return None;
        }
        let name = std::str::from_utf8(upstream).ok()?.to_string();
        let listener =
            std::net::TcpListener::bind((self.cfg.listen_host.as_str(), 0)).and_then(|l| {
                l.set_nonblocking(true)?;
                let port = l.local_addr()?.port();
                Ok((TcpListener::from_std(l)?, port))
            });
        let (listener, port) = match listener {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(owner = %name, error = %e,
                    "owner face: cannot open a relay; this owner is read directly");
                return None;
            }
        };
        let advertised = Bytes::from(format!("{}:{port}", self.cfg.listen_host));
        let owner = Arc::new(Owner {
            upstream: name.clone(),
            advertised: advertised.clone(),
            idle: Mutex::new(Vec::new()),
            conns: Semaphore::new(self.cfg.max_owner_connections),
            staged: Mutex::new(Staged::new(MAX_BATCHES)),
            room: Notify::new(),
            named_ms: self.now_ms().into(),
            open: 0.into(),
            stop: self.shutdown.child_token(),
        });
        owners.insert(upstream.clone(), owner.clone());
        self.metrics.owners.inc();
        tracing::info!(owner = %name, relay = %String::from_utf8_lossy(&advertised),
            "owner face: relaying this owner's SSD reads");
        self.tracker
            .spawn(self.clone().accept_loop(listener, owner));
        if self.cfg.idle_owner_ms > 0 {
            self.reaping
                .call_once(|| drop(self.tracker.spawn(self.clone().reap())));
        }
        Some(advertised)
    }

    async fn accept_loop(self: Arc<Self>, listener: TcpListener, owner: Arc<Owner>) {
        while let Some((sock, _)) = crate::accept::next(&listener, &owner.stop, "owner face").await
        {
            let Some(slot) = self.limit.admit() else {
                drop(sock);
                continue;
            };
            let face = self.clone();
            let owner = owner.clone();
            owner.open.fetch_add(1, Ordering::Relaxed);
            self.tracker.spawn(async move {
                face.serve(sock, owner.clone(), slot).await;
                owner.open.fetch_sub(1, Ordering::Relaxed);
            });
        }
    }

    /// One rank connection: calls are read in order and handled at once (a release
    /// never waits behind a read waiting for room); answers go back in call order.
    async fn serve(self: Arc<Self>, sock: TcpStream, owner: Arc<Owner>, slot: Slot) {
        let _ = sock.set_nodelay(true);
        let rank = self.identify(&sock).await;
        let (mut rd, mut wr) = sock.into_split();
        let (tx, mut rx) =
            mpsc::channel::<oneshot::Receiver<Bytes>>(self.cfg.max_inflight_per_connection);
        let writer = async move {
            while let Some(answer) = rx.recv().await {
                let Ok(bytes) = answer.await else { break };
                if wr.write_all(&bytes).await.is_err() {
                    break;
                }
            }
        };
        let face = self.clone();
        let reader = async move {
            let mut buf = BytesMut::with_capacity(4096);
            loop {
                match check_request(&buf, face.cfg.max_frame_bytes) {
                    Ok(Some(h)) => {
                        let (frame, raw) = RequestFrame::split(&mut buf, h);
                        let (done, answer) = oneshot::channel();
                        if tx.send(answer).await.is_err() {
                            return;
                        }
                        let (face, owner) = (face.clone(), owner.clone());
                        tokio::spawn(async move {
                            let _ = done.send(face.handle(&owner, rank, frame, raw).await);
                        });
                        continue;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        face.metrics.frame_errors.inc();
                        tracing::warn!(error = %e, "owner face: malformed frame; closing");
                        return;
                    }
                }
                // At shutdown no new call is read; those under way are answered.
                let read = tokio::select! {
                    r = rd.read_buf(&mut buf) => r,
                    _ = face.shutdown.cancelled() => return,
                };
                match read {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        };
        tokio::select! {
            _ = async { tokio::join!(reader, writer) } => {}
            _ = slot.stopped() => {}
        }
    }

    /// The process behind a rank's connection (as the master face names it), found off
    /// the runtime; its address when that fails.
    async fn identify(&self, sock: &TcpStream) -> Option<PeerKey> {
        let (ours, theirs) = (sock.local_addr().ok()?, sock.peer_addr().ok()?);
        let t = self.topology.clone();
        let found = tokio::task::spawn_blocking(move || t.identify(ours, theirs));
        match tokio::time::timeout(IDENTIFY_WITHIN, found).await {
            Ok(Ok(k)) => Some(k),
            _ => Some(PeerKey::Addr(theirs.ip())),
        }
    }

    async fn handle(
        &self,
        owner: &Owner,
        rank: Option<PeerKey>,
        frame: RequestFrame,
        raw: Bytes,
    ) -> Bytes {
        let id = frame.header.function_id;
        if id == offload_read::read_id() {
            // Read at each call: a rank names its client id in its first put.
            let client = rank
                .and_then(|k| self.topology.client_of(k))
                .unwrap_or_default();
            self.read(owner, &client, frame, raw).await
        } else if id == offload_read::release_id() {
            self.release(owner, frame, raw).await
        } else {
            self.metrics.relayed.inc();
            self.whole(owner, frame.header.seq_num, &raw)
                .await
                .raw_or_error()
        }
    }

    async fn whole(&self, owner: &Owner, seq: u32, raw: &Bytes) -> Relayed {
        match owner.call(&self.cfg, raw).await {
            Ok(a) => Relayed::Answer(a),
            Err(e) => {
                tracing::warn!(error = %e, "owner face: call failed");
                Relayed::Failed(RpcError::reply(seq, &format!("moongate: {e}")))
            }
        }
    }

    /// Where to cut a read of keys weighing `sizes`: key-count and byte bounds, and the
    /// arm's `split` hook (its budget: what the owner holds staged for us, the limit).
    fn parts(
        &self,
        call: &ReadCall,
        client: &Uuid,
        sizes: &[u64],
        staged: u64,
    ) -> Vec<Range<usize>> {
        let n = sizes.len();
        let mut points = Vec::new();
        if self.cfg.part_keys > 0 {
            points.extend((self.cfg.part_keys..n).step_by(self.cfg.part_keys));
        }
        if self.cfg.part_bytes > 0 {
            let mut acc = 0u64;
            for (i, &s) in sizes.iter().enumerate() {
                if i > 0 && acc + s > self.cfg.part_bytes {
                    points.push(i);
                    acc = 0;
                }
                acc += s;
            }
        }
        if n < 2 {
            return std::iter::once(0..n).collect();
        }
        // The key as the master face sees it: without the tenant that releases with
        // tenants prefix (`tenant\0key`).
        let key = call
            .keys()
            .next()
            .map(|k| k.splitn(2, |&b| b == 0).last().unwrap_or(k));
        let (set, arm) = self.policy.arm_for(client, key);
        let points = self.policy.cut(
            &set.arms[arm],
            sizes,
            staged,
            self.cfg.max_staged_bytes,
            points,
        );
        let mut ranges = Vec::with_capacity(points.len() + 1);
        let mut from = 0;
        for p in points {
            ranges.push(from..p);
            from = p;
        }
        ranges.push(from..n);
        ranges
    }

    /// Waits until the owner has room for `bytes` more staged (or `deadline` passes).
    async fn reserve<'a>(
        &self,
        owner: &'a Owner,
        bytes: u64,
        deadline: Instant,
    ) -> Reservation<'a> {
        let limit = self.cfg.max_staged_bytes;
        let mut waited = false;
        loop {
            let room = owner.room.notified();
            {
                let mut st = lock(&owner.staged);
                let freed = st.sweep(std::time::Instant::now());
                self.metrics.staged_bytes.dec_by(freed as i64);
                if st.try_reserve(bytes, limit) {
                    break;
                }
                if Instant::now() >= deadline {
                    st.force_reserve(bytes);
                    self.metrics.over_budget.inc();
                    break;
                }
            }
            if !waited {
                self.metrics.waits.inc();
                waited = true;
            }
            let _ = tokio::time::timeout_at(deadline.min(Instant::now() + SWEEP_EVERY), room).await;
        }
        Reservation { owner, bytes }
    }

    fn staged_now(&self, owner: &Owner, freed: u64, added: u64) {
        self.metrics.staged_bytes.inc_by(added as i64);
        self.metrics.staged_bytes.dec_by(freed as i64);
        if freed > 0 {
            owner.room.notify_waiters();
        }
    }

    async fn read(&self, owner: &Owner, client: &Uuid, frame: RequestFrame, raw: Bytes) -> Bytes {
        let seq = frame.header.seq_num;
        let call = match ReadCall::decode(&frame.body) {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(error = %e, "owner face: read of an unknown shape, relayed whole");
                self.metrics.relayed.inc();
                return self.whole(owner, seq, &raw).await.raw_or_error();
            }
        };
        let sizes = call.sizes();
        let staged = lock(&owner.staged).staged();
        let ranges = self.parts(&call, client, &sizes, staged);
        let deadline = Instant::now() + Duration::from_millis(self.cfg.max_wait_ms);
        let total: u64 = sizes.iter().sum();
        if ranges.len() > 1 {
            self.metrics.split_reads.inc();
        }
        // Room for the whole read: its parts stay staged until the rank has read them
        // all and releases the one batch, so they cannot wait for each other.
        let room = self.reserve(owner, total, deadline).await;
        let parts = ranges.iter().map(|r| {
            let frame = if ranges.len() == 1 {
                raw.clone()
            } else {
                request(&frame.header, &call.part(r.clone()))
            };
            async move {
                self.metrics.parts.inc();
                owner.call(&self.cfg, &frame).await
            }
        });
        let sent = std::time::Instant::now();
        let results = join_all(parts).await;
        let now = std::time::Instant::now();
        self.metrics
            .owner_seconds
            .observe(now.duration_since(sent).as_secs_f64());
        // Read every answer; any failure fails the read, and the parts staged are freed.
        // The parts' answers, with their batch ids (the owner's) and, for a read sent
        // whole, the owner's answer as it came.
        let mut reads = Vec::with_capacity(results.len());
        let mut ids = Vec::with_capacity(results.len());
        let mut as_came = None;
        let mut failure: Option<(Outcome, Bytes)> = None;
        for r in results {
            match r {
                Ok(a) if a.header.err_code == errc::OK => match ReadAnswer::decode(&a.body) {
                    Ok(ra) => match ra.batch_id() {
                        Some(id) => {
                            ids.push(id);
                            reads.push(ra);
                            as_came = Some(a.raw);
                        }
                        None => {
                            failure.get_or_insert((Outcome::refused, a.raw));
                        }
                    },
                    Err(e) if ranges.len() == 1 => {
                        // Not read, but the rank's own answer: relayed as it came.
                        tracing::debug!(error = %e, "owner face: answer of an unknown shape");
                        self.metrics.relayed.inc();
                        return a.raw;
                    }
                    Err(e) => {
                        failure.get_or_insert((
                            Outcome::refused,
                            RpcError::reply(seq, &format!("moongate: owner's answer unread: {e}")),
                        ));
                    }
                },
                Ok(a) => {
                    failure.get_or_insert((Outcome::transport, a.raw));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "owner face: read failed");
                    failure.get_or_insert((
                        Outcome::transport,
                        RpcError::reply(seq, &format!("moongate: {e}")),
                    ));
                }
            }
        }
        let ttl = Duration::from_millis(
            reads
                .iter()
                .filter_map(ReadAnswer::ttl_ms)
                .min()
                .unwrap_or(5_000),
        );
        if failure.is_none()
            && ranges.len() == 1
            && let Some(raw) = as_came
        {
            let freed = lock(&owner.staged).record(ids[0], total, ttl, now);
            drop(room);
            self.staged_now(owner, freed, total);
            self.counted_read(call.len(), total);
            return raw;
        }
        if failure.is_none() {
            let (synthetic, freed) = lock(&owner.staged).record_parts(ids.clone(), total, ttl, now);
            match ReadAnswer::merge(&reads, synthetic) {
                Ok(body) => {
                    drop(room);
                    self.staged_now(owner, freed, total);
                    self.counted_read(call.len(), total);
                    return reply(seq, &body);
                }
                Err(e) => {
                    let (_, bytes) = lock(&owner.staged).release(synthetic);
                    self.staged_now(owner, freed + bytes, total);
                    failure = Some((
                        Outcome::refused,
                        RpcError::reply(seq, &format!("moongate: parts' answers unmerged: {e}")),
                    ));
                }
            }
        }
        drop(room);
        // Free what the parts that succeeded staged: the rank will not read it.
        for id in ids {
            let h = RequestHeader::new(seq, offload_read::release_id(), 0);
            let _ = owner
                .call(&self.cfg, &request(&h, &offload_read::release_call(id)))
                .await;
        }
        let (outcome, bytes) = failure.unwrap_or((
            Outcome::refused,
            RpcError::reply(seq, "moongate: no answer"),
        ));
        self.metrics.read(outcome);
        bytes
    }

    fn counted_read(&self, keys: usize, bytes: u64) {
        self.metrics.read(Outcome::ok);
        self.metrics.read_keys.inc_by(keys as u64);
        self.metrics.read_bytes.inc_by(bytes);
    }

    async fn release(&self, owner: &Owner, frame: RequestFrame, raw: Bytes) -> Bytes {
        let seq = frame.header.seq_num;
        let Ok(rel) = Release::decode(&frame.body) else {
            self.metrics.relayed.inc();
            return self.whole(owner, seq, &raw).await.raw_or_error();
        };
        let Some(id) = rel.batch_id() else {
            return self.whole(owner, seq, &raw).await.raw_or_error();
        };
        let (named, bytes) = lock(&owner.staged).release(id);
        self.staged_now(owner, bytes, 0);
        match named {
            Named::Owners => {
                let r = self.whole(owner, seq, &raw).await;
                self.metrics.release(r.outcome());
                r.raw_or_error()
            }
            Named::Unknown => {
                self.metrics.release(Outcome::unknown);
                reply(seq, &offload_read::release_answer(false))
            }
            Named::Parts(parts) => {
                let calls = parts.iter().map(|&p| {
                    let frame = request(&frame.header, &rel.naming(p));
                    async move { owner.call(&self.cfg, &frame).await }
                });
                let mut ok = true;
                let mut transport = false;
                for r in join_all(calls).await {
                    match r {
                        Ok(a) if a.header.err_code == errc::OK => {
                            ok &= offload_read::released(&a.body).unwrap_or(false);
                        }
                        _ => {
                            ok = false;
                            transport = true;
                        }
                    }
                }
                self.metrics.release(match (ok, transport) {
                    (true, _) => Outcome::ok,
                    (false, true) => Outcome::transport,
                    (false, false) => Outcome::refused,
                });
                reply(seq, &offload_read::release_answer(ok))
            }
        }
    }

    /// Stops accepting and waits for the relays' connections to end.
    pub async fn drain(&self) {
        self.tracker.close();
        self.tracker.wait().await;
    }
}

/// A call relayed whole: the owner's answer, or the error frame for the rank.
enum Relayed {
    Answer(Answer),
    Failed(Bytes),
}

impl Relayed {
    fn raw_or_error(self) -> Bytes {
        match self {
            Relayed::Answer(a) => a.raw,
            Relayed::Failed(b) => b,
        }
    }

    /// How a release relayed whole ended.
    fn outcome(&self) -> Outcome {
        match self {
            Relayed::Answer(a) if a.header.err_code == errc::OK => {
                match offload_read::released(&a.body) {
                    Some(true) => Outcome::ok,
                    _ => Outcome::refused,
                }
            }
            _ => Outcome::transport,
        }
    }
}

#[cfg(test)]
mod tests {
    //! The relay against a fake owner that speaks the offload-read calls: cut reads
    //! merged and released part by part, a failed part's siblings freed, made-up ids
    //! that expired, garbage from a rank.

    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;
    use crate::calls::offload_read::tests::{answer_of, call_of};
    use crate::metrics::Metrics;
    use crate::policy::Policy;
    use crate::policy::fake::Fake;

    /// What the fake owner saw.
    #[derive(Default)]
    struct Seen {
        reads: Mutex<Vec<usize>>,
        released: Mutex<Vec<u64>>,
    }

    /// An owner that stages every read as a new batch (pointers 1000 x id + i) and
    /// answers `INVALID_KEY`-like errors for a part naming key `k{bad}`.
    async fn fake_owner(bad: Option<usize>) -> (String, Arc<Seen>) {
        fake_owner_with(bad, false).await
    }

    /// `one_each`: the owner closes every connection after one answer (as an owner that
    /// restarted, or closes idle connections, leaves the relay's pooled ones).
    async fn fake_owner_with(bad: Option<usize>, one_each: bool) -> (String, Arc<Seen>) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let seen = Arc::new(Seen::default());
        let next = Arc::new(AtomicU64::new(1));
        let s2 = seen.clone();
        tokio::spawn(async move {
            loop {
                let (mut sock, _) = l.accept().await.unwrap();
                let (seen, next) = (s2.clone(), next.clone());
                tokio::spawn(async move {
                    let mut buf = BytesMut::new();
                    loop {
                        let h = loop {
                            if let Ok(Some(h)) = check_request(&buf, 1 << 20) {
                                break h;
                            }
                            if sock.read_buf(&mut buf).await.unwrap_or(0) == 0 {
                                return;
                            }
                        };
                        let (f, _) = RequestFrame::split(&mut buf, h);
                        let body = if h.function_id == offload_read::read_id() {
                            let c = ReadCall::decode(&f.body).unwrap();
                            lock(&seen.reads).push(c.len());
                            let named_bad = bad.is_some_and(|b| {
                                c.keys().any(|k| k == format!("default\0k{b}").as_bytes())
                            });
                            if named_bad {
                                // expected<..., ErrorCode>: the error alternative.
                                let mut a = answer_of(0, 0, 0, 0).to_vec();
                                let at = a.iter().position(|&b| b == 0).unwrap() + 1;
                                a.truncate(at);
                                a.extend_from_slice(&[0, 0xfe, 0xff, 0xff, 0xff]);
                                Bytes::from(a)
                            } else {
                                let id = next.fetch_add(1, Ordering::Relaxed);
                                answer_of(id, c.len(), 1000 * id, 5000)
                            }
                        } else {
                            let r = Release::decode(&f.body).unwrap();
                            lock(&seen.released).push(r.batch_id().unwrap());
                            offload_read::release_answer(true)
                        };
                        let mut out = BytesMut::new();
                        ResponseHeader::new(h.seq_num, 0, body.len() as u32).write(&mut out);
                        out.extend_from_slice(&body);
                        sock.write_all(&out).await.unwrap();
                        if one_each {
                            return;
                        }
                    }
                });
            }
        });
        (addr, seen)
    }

    fn face(cfg: OwnerFaceConfig, all: &Metrics) -> Arc<OwnerFace> {
        let fake: Arc<dyn Policy> = Arc::new(Fake::new("p"));
        let policy =
            Registry::with_policies(Default::default(), None, all.policy.clone(), vec![fake])
                .unwrap();
        OwnerFace::new(
            cfg,
            all.owner_face.clone(),
            policy,
            Arc::new(Topology::new(all.topology.clone())),
            CancellationToken::new(),
        )
    }

    /// One call from a rank on `s`; the answer's header and body.
    async fn call(s: &mut TcpStream, seq: u32, id: u32, body: &Bytes) -> (ResponseHeader, Bytes) {
        s.write_all(&request(&RequestHeader::new(seq, id, 0), body))
            .await
            .unwrap();
        let mut buf = BytesMut::new();
        loop {
            if let Some(h) = check_response(&buf, 1 << 20).unwrap() {
                let (f, _) = crate::codec::ResponseFrame::split(&mut buf, h);
                return (f.header, f.body);
            }
            assert!(s.read_buf(&mut buf).await.unwrap() > 0, "closed");
        }
    }

    async fn release(s: &mut TcpStream, seq: u32, id: u64) -> (ResponseHeader, Bytes) {
        let body = offload_read::release_call(id);
        call(s, seq, offload_read::release_id(), &body).await
    }

    fn cut_every(keys: usize) -> OwnerFaceConfig {
        OwnerFaceConfig {
            enabled: true,
            part_keys: keys,
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn a_cut_read_is_one_answer_and_its_release_frees_every_part() {
        let (owner, seen) = fake_owner(None).await;
        let all = Metrics::new();
        let f = face(cut_every(2), &all);
        let relay = f.endpoint_for(&Bytes::from(owner.clone())).unwrap();
        assert_eq!(
            f.endpoint_for(&Bytes::from(owner)).unwrap(),
            relay,
            "one per owner"
        );
        let mut s = TcpStream::connect(std::str::from_utf8(&relay).unwrap())
            .await
            .unwrap();
        let (h, body) = call(&mut s, 7, offload_read::read_id(), &call_of(5, 100)).await;
        assert_eq!((h.seq_num, h.err_code), (7, errc::OK));
        let a = ReadAnswer::decode(&body).unwrap();
        let id = a.batch_id().unwrap();
        assert!(id & staged::SYNTHETIC != 0);
        assert_eq!(a.staged(), 5);
        let mut parts = lock(&seen.reads).clone();
        parts.sort_unstable();
        assert_eq!(parts, vec![1, 2, 2]);
        assert_eq!(all.owner_face.staged_bytes.get(), 500);
        let (_, body) = release(&mut s, 8, id).await;
        assert_eq!(offload_read::released(&body), Some(true));
        let mut released = lock(&seen.released).clone();
        released.sort_unstable();
        assert_eq!(released, vec![1, 2, 3]);
        assert_eq!(all.owner_face.staged_bytes.get(), 0);
        // Released already: unknown now, answered false without asking the owner.
        let (_, body) = release(&mut s, 9, id).await;
        assert_eq!(offload_read::released(&body), Some(false));
        assert_eq!(lock(&seen.released).len(), 3);
        // A whole read keeps the owner's id.
        let (_, body) = call(&mut s, 10, offload_read::read_id(), &call_of(2, 100)).await;
        assert_eq!(ReadAnswer::decode(&body).unwrap().batch_id(), Some(4));
    }

    /// An experiment that assigns arms by client: a rank's SSD reads are cut by the
    /// `split` hook of the arm its client id (carried by its master-face calls, here
    /// this test process's) falls in, not by the arm of the zero id.
    #[tokio::test]
    async fn a_ranks_reads_are_split_by_the_arm_its_client_falls_in() {
        use crate::policy::experiment::{ArmSpec, Assign, ExperimentSpec};
        let (owner, seen) = fake_owner(None).await;
        let all = Metrics::new();
        let whole: Arc<dyn Policy> = Arc::new(Fake::new("whole"));
        let each: Arc<dyn Policy> =
            Arc::new(Fake::new("each").split(|c| Ok((1..c.sizes.len() as u32).collect())));
        let arm = |name: &str| ArmSpec {
            name: name.into(),
            plugin: name.into(),
            weight: 1,
        };
        let spec = ExperimentSpec {
            assign: Assign::Client,
            control: None,
            arms: vec![arm("whole"), arm("each")],
            guardrail: Default::default(),
            capacity: Default::default(),
        };
        let policy = Registry::with_policies(
            Default::default(),
            Some(spec),
            all.policy.clone(),
            vec![whole, each],
        )
        .unwrap();
        let set = policy.current();
        let zero_arm = set.pick(&Uuid::default(), None);
        let client = (1u64..=255)
            .map(|b| Uuid {
                first: b,
                second: 0,
            })
            .find(|u| set.pick(u, None) != zero_arm)
            .expect("a client in the other arm");
        let cuts = set.arms[set.pick(&client, None)].plugin.name() == "each";
        let topology = Arc::new(Topology::new(all.topology.clone()));
        let f = OwnerFace::new(
            OwnerFaceConfig {
                enabled: true,
                ..Default::default()
            },
            all.owner_face.clone(),
            policy,
            topology.clone(),
            CancellationToken::new(),
        );
        let relay = f.endpoint_for(&Bytes::from(owner)).unwrap();
        let mut s = TcpStream::connect(std::str::from_utf8(&relay).unwrap())
            .await
            .unwrap();
        // The rank's master-face calls named `client`. (This test process is the rank
        // and moongate at once: a process is not looked for among its own sockets, so
        // the rank is known by its address here, as a remote one would be.)
        let key = PeerKey::Addr(s.local_addr().unwrap().ip());
        topology.join(key).saw_client(client);
        let (h, _) = call(&mut s, 1, offload_read::read_id(), &call_of(4, 100)).await;
        assert_eq!(h.err_code, errc::OK);
        let parts = lock(&seen.reads).clone();
        if cuts {
            assert_eq!(parts, vec![1, 1, 1, 1], "cut by the client's arm");
        } else {
            assert_eq!(parts, vec![4], "whole, as the client's arm says");
        }
        assert_eq!(all.owner_face.split_reads.get(), u64::from(cuts));
    }

    #[tokio::test]
    async fn a_failed_part_fails_the_read_and_frees_its_siblings() {
        let (owner, seen) = fake_owner(Some(3)).await;
        let all = Metrics::new();
        let f = face(cut_every(2), &all);
        let relay = f.endpoint_for(&Bytes::from(owner)).unwrap();
        let mut s = TcpStream::connect(std::str::from_utf8(&relay).unwrap())
            .await
            .unwrap();
        let (h, body) = call(&mut s, 1, offload_read::read_id(), &call_of(6, 100)).await;
        assert_eq!(h.err_code, errc::OK);
        let a = ReadAnswer::decode(&body).unwrap();
        assert_eq!(a.batch_id(), None, "the owner's error, as it gave it");
        let mut released = lock(&seen.released).clone();
        released.sort_unstable();
        assert_eq!(released, vec![1, 2], "the two parts that staged were freed");
        assert_eq!(all.owner_face.staged_bytes.get(), 0);
    }

    #[tokio::test]
    async fn garbage_closes_that_connection_only_and_a_dead_owner_fails_that_call() {
        let (owner, _) = fake_owner(None).await;
        let all = Metrics::new();
        let f = face(cut_every(0), &all);
        let relay = f.endpoint_for(&Bytes::from(owner)).unwrap();
        let relay = std::str::from_utf8(&relay).unwrap().to_string();
        let mut good = TcpStream::connect(&relay).await.unwrap();
        let mut bad = TcpStream::connect(&relay).await.unwrap();
        bad.write_all(&[0xff; 64]).await.unwrap();
        let mut b = [0u8; 16];
        assert_eq!(bad.read(&mut b).await.unwrap_or(0), 0, "closed, no answer");
        assert_eq!(all.owner_face.frame_errors.get(), 1);
        let (_, body) = call(&mut good, 1, offload_read::read_id(), &call_of(1, 10)).await;
        assert!(ReadAnswer::decode(&body).unwrap().batch_id().is_some());
        // An owner nobody listens for: a transport error for the call, nothing else.
        let gone = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let dead = gone.local_addr().unwrap().to_string();
        drop(gone);
        let relay = f.endpoint_for(&Bytes::from(dead)).unwrap();
        let mut s = TcpStream::connect(std::str::from_utf8(&relay).unwrap())
            .await
            .unwrap();
        let (h, _) = call(&mut s, 5, offload_read::read_id(), &call_of(1, 10)).await;
        assert_eq!((h.seq_num, h.err_code), (5, errc::RPC_THROW_EXCEPTION));
        assert_eq!(all.owner_face.owners.get(), 2);
        let (_, body) = call(&mut good, 2, offload_read::read_id(), &call_of(1, 10)).await;
        assert!(ReadAnswer::decode(&body).unwrap().batch_id().is_some());
    }

    #[tokio::test]
    async fn a_pooled_connection_the_owner_closed_is_replaced() {
        let (owner, seen) = fake_owner_with(None, true).await;
        let all = Metrics::new();
        let f = face(cut_every(0), &all);
        let relay = f.endpoint_for(&Bytes::from(owner)).unwrap();
        let mut s = TcpStream::connect(std::str::from_utf8(&relay).unwrap())
            .await
            .unwrap();
        for seq in 1..4 {
            let (h, body) = call(&mut s, seq, offload_read::read_id(), &call_of(1, 10)).await;
            assert_eq!(h.err_code, errc::OK, "call {seq}");
            assert!(ReadAnswer::decode(&body).unwrap().batch_id().is_some());
        }
        assert_eq!(lock(&seen.reads).len(), 3);
    }

    #[tokio::test]
    async fn a_relay_no_answer_names_any_more_is_closed() {
        let (owner, _) = fake_owner(None).await;
        let all = Metrics::new();
        let f = face(
            OwnerFaceConfig {
                idle_owner_ms: 300,
                ..cut_every(0)
            },
            &all,
        );
        let owner = Bytes::from(owner);
        let relay = f.endpoint_for(&owner).unwrap();
        let addr = std::str::from_utf8(&relay).unwrap().to_string();
        // A rank connection open keeps it, however long.
        let s = TcpStream::connect(&addr).await.unwrap();
        tokio::time::sleep(Duration::from_millis(1000)).await;
        assert_eq!(all.owner_face.owners.get(), 1);
        drop(s);
        let deadline = Instant::now() + Duration::from_secs(10);
        while all.owner_face.owners_retired.get() == 0 {
            assert!(Instant::now() < deadline, "not retired");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(all.owner_face.owners.get(), 0);
        // Its listener is closed (the accept loop may take a moment to see the stop)...
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(&addr).await.is_ok() {
            assert!(Instant::now() < deadline, "still listening");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // ... and the next answer naming the owner opens a new relay.
        assert!(f.endpoint_for(&owner).is_some());
        assert_eq!(all.owner_face.owners.get(), 1);
    }

    #[tokio::test]
    async fn a_read_waits_for_room_until_a_release_or_its_deadline() {
        let (owner, _) = fake_owner(None).await;
        let all = Metrics::new();
        let f = face(
            OwnerFaceConfig {
                max_staged_bytes: 150,
                max_wait_ms: 10_000,
                ..cut_every(0)
            },
            &all,
        );
        let relay = f.endpoint_for(&Bytes::from(owner)).unwrap();
        let addr = std::str::from_utf8(&relay).unwrap().to_string();
        let mut a = TcpStream::connect(&addr).await.unwrap();
        let (_, body) = call(&mut a, 1, offload_read::read_id(), &call_of(1, 100)).await;
        let held = ReadAnswer::decode(&body).unwrap().batch_id().unwrap();
        // 100 staged: another 100 does not fit under 150, so it waits...
        let mut b = TcpStream::connect(&addr).await.unwrap();
        let waiting = tokio::spawn(async move {
            call(&mut b, 1, offload_read::read_id(), &call_of(1, 100)).await
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        while all.owner_face.waits.get() == 0 {
            assert!(Instant::now() < deadline, "never waited");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(!waiting.is_finished());
        // ... until the first is released.
        let (_, body) = release(&mut a, 2, held).await;
        assert_eq!(offload_read::released(&body), Some(true));
        let (h, body) = tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("answered once room freed")
            .unwrap();
        assert_eq!(h.err_code, errc::OK);
        assert!(ReadAnswer::decode(&body).unwrap().batch_id().is_some());
        assert_eq!(all.owner_face.over_budget.get(), 0);
        assert_eq!(all.owner_face.staged_bytes.get(), 100);

        // With a short deadline a read past the bound goes anyway, counted.
        let f = face(
            OwnerFaceConfig {
                max_staged_bytes: 150,
                max_wait_ms: 50,
                ..cut_every(0)
            },
            &all,
        );
        let (owner, _) = fake_owner(None).await;
        let relay = f.endpoint_for(&Bytes::from(owner)).unwrap();
        let mut c = TcpStream::connect(std::str::from_utf8(&relay).unwrap())
            .await
            .unwrap();
        for seq in 1..3 {
            let (h, _) = call(&mut c, seq, offload_read::read_id(), &call_of(1, 100)).await;
            assert_eq!(h.err_code, errc::OK);
        }
        assert_eq!(all.owner_face.over_budget.get(), 1);
    }

    #[tokio::test]
    async fn past_max_owners_an_owner_is_read_directly() {
        let all = Metrics::new();
        let f = face(
            OwnerFaceConfig {
                max_owners: 1,
                ..cut_every(0)
            },
            &all,
        );
        assert!(
            f.endpoint_for(&Bytes::from_static(b"127.0.0.1:1"))
                .is_some()
        );
        assert!(
            f.endpoint_for(&Bytes::from_static(b"127.0.0.1:2"))
                .is_none()
        );
        assert_eq!(all.owner_face.owners_refused.get(), 1);
    }
}

//! Moving one replica's bytes, and choosing how: in place in moongate's own segment,
//! QUIC to a moongate that serves its segment over QUIC, TE-TCP to any Mooncake segment,
//! or a file of the master's disk tier. Knows descriptors and transports, not keys,
//! budgets or the put/get protocol.

use std::sync::Arc;

use bytes::{BufMut, Bytes};

use super::budget::Reserved;
use super::disk;
use super::metadata::Metadata;
use super::{StoreError, Value};
use crate::codec::types::{
    BufferDescriptor, DiskDescriptor, GetReplicaListResponse, ReplicaLocation, ReplicaStatus,
};
use crate::kv::metrics::KvMetrics;
use crate::kv::metrics::{Dir, Transport};
use crate::kv::own::segment::Memory;
use crate::kv::transport::quic::QuicPool;
use crate::kv::transport::te_tcp::{Pool, TeError};

/// Values from this size on are streamed from the owner's TE-TCP listener to the caller
/// as they arrive (both hops overlap, and no whole-value buffer is held).
const STREAM_FROM: u64 = 1 << 20;
/// Bytes per chunk of a streamed value.
const STREAM_CHUNK: usize = 256 << 10;

/// How a put's replicas were written (a memory replica that failed fails the put).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// Memory replicas only (the master has no disk tier).
    Memory,
    /// Memory and disk replicas: the disk one is ended on its own (`PutEnd(DISK)`, as
    /// Mooncake's client does; `PutEnd(ALL)` leaves it not ready).
    MemoryAndDisk,
    /// A disk replica could not be written (logged): it is revoked, the memory ones kept.
    DiskFailed,
}

impl Stored {
    fn and_disk(self, ok: bool) -> Stored {
        match (self, ok) {
            (Stored::DiskFailed, _) | (_, false) => Stored::DiskFailed,
            _ => Stored::MemoryAndDisk,
        }
    }
}

/// One replica a streamed put writes to.
enum Sink<'a> {
    Local(crate::kv::own::memory::Writing<'a>),
    Tcp {
        s: tokio::net::TcpStream,
        peer: String,
        v2: bool,
        addr: u64,
        len: u64,
    },
    Quic {
        send: quinn::SendStream,
        recv: quinn::RecvStream,
        peer: std::net::SocketAddr,
        addr: u64,
        len: u64,
    },
    /// Stripes written over several TE-TCP connections at once (`kv.te_stripe_bytes`).
    Striped(StripedWrite),
}

/// A large value written as stripes, each a WRITE of its own on a pooled connection, at
/// most `lanes` at once: the body's chunks are gathered (not copied) until a stripe is
/// full, then sent while the next one gathers. The put is acknowledged only once every
/// stripe's owner confirmed its bytes (v2); one that fails fails the put, whose caller
/// revokes it, so no half-written value is ever readable.
struct StripedWrite {
    pool: Arc<Pool>,
    peer: Arc<str>,
    v2: bool,
    addr: u64,
    stripe: u64,
    lanes: usize,
    /// Chunks of the stripe being gathered, their bytes, and where it starts.
    parts: Vec<Bytes>,
    gathered: u64,
    at: u64,
    inflight: futures_util::stream::FuturesUnordered<
        futures_util::future::BoxFuture<'static, Result<(), TeError>>,
    >,
}

impl StripedWrite {
    /// Takes the next chunk of the body; sends every stripe it completes.
    async fn send(&mut self, mut chunk: Bytes) -> Result<(), TeError> {
        while !chunk.is_empty() {
            let room = (self.stripe - self.gathered) as usize;
            let part = chunk.split_to(room.min(chunk.len()));
            self.gathered += part.len() as u64;
            self.parts.push(part);
            if self.gathered == self.stripe {
                self.launch().await?;
            }
        }
        Ok(())
    }

    /// Sends the gathered stripe, waiting first for a lane when all are busy.
    async fn launch(&mut self) -> Result<(), TeError> {
        use futures_util::StreamExt;
        while self.inflight.len() >= self.lanes {
            if let Some(r) = self.inflight.next().await {
                r?;
            }
        }
        let parts = std::mem::take(&mut self.parts);
        let (pool, peer, at, v2) = (
            self.pool.clone(),
            self.peer.clone(),
            self.addr + self.at,
            self.v2,
        );
        self.at += self.gathered;
        self.gathered = 0;
        self.inflight.push(Box::pin(async move {
            pool.write_parts(&peer, at, &parts, v2).await
        }));
        Ok(())
    }

    /// Sends what is left and waits until every stripe is in place.
    async fn finish(mut self) -> Result<(), TeError> {
        use futures_util::StreamExt;
        if self.gathered > 0 {
            self.launch().await?;
        }
        while let Some(r) = self.inflight.next().await {
            r?;
        }
        Ok(())
    }
}

impl Sink<'_> {
    /// Passes on the chunk that starts `at` bytes into the value.
    async fn send(&mut self, at: u64, chunk: &Bytes) -> Result<(), StoreError> {
        use tokio::io::AsyncWriteExt;
        match self {
            Sink::Local(w) => {
                w.put(at as usize, chunk);
                Ok(())
            }
            Sink::Tcp { s, peer, .. } => s
                .write_all(chunk)
                .await
                .map_err(|e| StoreError::Transfer(crate::kv::transport::te_tcp::io_error(peer)(e))),
            Sink::Quic { send, peer, .. } => send.write_chunk(chunk.clone()).await.map_err(|e| {
                StoreError::Quic(crate::kv::transport::quic::QuicError::Peer {
                    peer: *peer,
                    error: e.to_string(),
                })
            }),
            Sink::Striped(w) => w.send(chunk.clone()).await.map_err(StoreError::Transfer),
        }
    }

    /// Waits until the owner has the bytes; the transport index for metrics.
    async fn finish(self, store: &Transfers) -> Result<Transport, StoreError> {
        match self {
            Sink::Local(_) => Ok(Transport::Local),
            Sink::Tcp {
                s,
                peer,
                v2,
                addr,
                len,
            } => {
                store.te.finish_write(&peer, s, addr, len, v2).await?;
                Ok(Transport::Tcp)
            }
            Sink::Quic {
                send,
                recv,
                peer,
                addr,
                len,
            } => {
                let q = store.quic.as_ref().ok_or(StoreError::Unexpected)?;
                q.finish_write(peer, send, recv, addr, len).await?;
                Ok(Transport::Quic)
            }
            Sink::Striped(w) => {
                w.finish().await.map_err(StoreError::Transfer)?;
                store.metrics.striped(Dir::Write);
                Ok(Transport::Tcp)
            }
        }
    }
}

/// Where a streamed value's bytes come from.
enum Src {
    /// A TE-TCP connection whose READ the owner accepted; it goes back to the pool once
    /// every byte was read (the owner then waits for the next request on it).
    Te {
        s: tokio::net::TcpStream,
        peer: String,
        pool: Arc<Pool>,
    },
    /// Stripes read over several TE-TCP connections at once (`kv.te_stripe_bytes`).
    Striped(Box<Stripes>),
    /// A QUIC stream from a moongate: never reused.
    Quic(quinn::RecvStream),
}

/// A lane's READ being started: the header sent, the owner's v2 status awaited. `Sync`
/// because a streamed value is an HTTP body, which hyper may hand between threads by
/// reference.
type Opening = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<tokio::net::TcpStream, TeError>> + Send + Sync>,
>;

/// One stripe's READ on a pooled connection of its own.
struct Lane {
    conn: LaneConn,
    /// The stripe's bytes not yet taken from the connection.
    left: u64,
}

enum LaneConn {
    Opening(Opening),
    Open(tokio::net::TcpStream),
}

/// A large value read as stripes over several pooled TE-TCP connections at once: up to
/// `lanes` stripes are asked for ahead (each its own READ on a connection of its own,
/// since a connection carries one request at a time, data-plane spec B.6), so the owner
/// sends them in parallel, while the value is handed on in order from the first lane's
/// connection as its bytes arrive, exactly as a value on one connection is. The stripes
/// ahead wait in their connections' socket buffers, not in moongate's heap. Any lane
/// that fails ends the value with that error; the lanes left are dropped with their
/// connections (only a connection whose READ was read to its end is reused).
pub(crate) struct Stripes {
    pool: Arc<Pool>,
    peer: Arc<str>,
    v2: bool,
    addr: u64,
    len: u64,
    stripe: u64,
    lanes: usize,
    /// Where the next stripe to ask for starts.
    next: u64,
    queue: std::collections::VecDeque<Lane>,
}

impl Stripes {
    /// `first`: a connection on which the first stripe's READ was already accepted
    /// ([`Pool::open_read`] of `min(stripe, len)` bytes at `addr`), so an owner that is
    /// gone or refuses the range fails the value before any of it is answered.
    pub(crate) fn new(
        pool: Arc<Pool>,
        peer: &str,
        v2: bool,
        (addr, len): (u64, u64),
        (stripe, lanes): (u64, usize),
        first: Option<tokio::net::TcpStream>,
    ) -> Stripes {
        let stripe = stripe.max(1);
        let mut st = Stripes {
            pool,
            peer: Arc::from(peer),
            v2,
            addr,
            len,
            stripe,
            lanes: lanes.max(1),
            next: 0,
            queue: std::collections::VecDeque::with_capacity(lanes.max(1)),
        };
        if let Some(s) = first {
            let n = stripe.min(len);
            st.queue.push_back(Lane {
                conn: LaneConn::Open(s),
                left: n,
            });
            st.next = n;
        }
        st
    }

    /// Asks for stripes until `lanes` are on their way and moves every lane's start on;
    /// then the first lane's connection and the bytes left in its stripe, once its READ
    /// was accepted.
    fn poll_head(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(&mut tokio::net::TcpStream, usize), TeError>> {
        use std::task::Poll;
        while self.queue.len() < self.lanes && self.next < self.len {
            let n = self.stripe.min(self.len - self.next);
            let (pool, peer, at, v2) = (
                self.pool.clone(),
                self.peer.clone(),
                self.addr + self.next,
                self.v2,
            );
            self.queue.push_back(Lane {
                conn: LaneConn::Opening(Box::pin(
                    async move { pool.open_read(&peer, at, n, v2).await },
                )),
                left: n,
            });
            self.next += n;
        }
        for lane in self.queue.iter_mut() {
            if let LaneConn::Opening(f) = &mut lane.conn {
                match f.as_mut().poll(cx) {
                    Poll::Ready(Ok(s)) => lane.conn = LaneConn::Open(s),
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => {}
                }
            }
        }
        match self.queue.front_mut() {
            Some(Lane {
                conn: LaneConn::Open(s),
                left,
            }) => Poll::Ready(Ok((s, *left as usize))),
            Some(_) => Poll::Pending,
            None => Poll::Ready(Err(TeError::Io {
                peer: self.peer.to_string(),
                source: std::io::ErrorKind::UnexpectedEof.into(),
            })),
        }
    }

    /// `n` bytes of the first lane were handed on; a lane read to its end goes back to
    /// the pool.
    fn took(&mut self, n: usize) {
        let Some(head) = self.queue.front_mut() else {
            return;
        };
        head.left = head.left.saturating_sub(n as u64);
        if head.left == 0
            && let Some(Lane {
                conn: LaneConn::Open(s),
                ..
            }) = self.queue.pop_front()
        {
            self.pool.give_back(&self.peer, s);
        }
    }
}

/// A value of `len` bytes read from its owner as the caller takes it: polled from the
/// caller's own task (the kv face's connection), so no task or channel sits between the
/// owner's socket and the caller's, and the owner's bytes wait in its socket buffer while
/// the caller's are written. The budget reservation lives until it is dropped.
pub struct Streamed {
    src: Option<Src>,
    len: u64,
    left: usize,
    buf: bytes::BytesMut,
    /// The longest wait for the owner's next bytes (`kv.timeout_ms`): a stalled owner
    /// ends the value with an error instead of holding its budget and connection.
    stall: std::time::Duration,
    /// Whether the owner is being waited on (not since its last bytes: a caller that
    /// stops taking bytes for a while is not the owner's stall), and the timer set
    /// `stall` after the wait began (made on the first wait, then reset).
    waiting: bool,
    timer: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    _room: Reserved,
}

impl std::fmt::Debug for Streamed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Streamed")
            .field("len", &self.len)
            .field("left", &self.left)
            .finish_non_exhaustive()
    }
}

impl Streamed {
    fn new(src: Src, len: u64, room: Reserved, stall: std::time::Duration) -> Streamed {
        Streamed {
            src: Some(src),
            len,
            left: len as usize,
            buf: bytes::BytesMut::new(),
            stall,
            waiting: false,
            timer: None,
            _room: room,
        }
    }

    /// Pending while the owner has been waited on for less than `stall`; else the error.
    fn stalled(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Error> {
        let stall = self.stall;
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(stall)));
        if !self.waiting {
            self.waiting = true;
            timer.as_mut().reset(tokio::time::Instant::now() + stall);
        }
        timer.as_mut().poll(cx).map(|()| {
            self.src = None;
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("the owner sent nothing for {:?}", self.stall),
            )
        })
    }

    /// The value's size.
    pub fn size(&self) -> u64 {
        self.len
    }

    /// Bytes not yet handed out.
    pub fn remaining(&self) -> u64 {
        self.left as u64
    }

    /// The next bytes of the value: up to [`STREAM_CHUNK`] at once, or what has arrived
    /// when the owner's socket has no more yet (so the caller's side writes while the
    /// owner's fills); `None` after the last byte; an error if the owner's connection
    /// broke or ended early.
    pub fn poll_chunk(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<std::io::Result<Bytes>>> {
        use std::task::Poll;
        let Some(src) = self.src.as_mut().filter(|_| self.left > 0) else {
            return Poll::Ready(None);
        };
        // A chunk handed out early leaves the rest of its allocation to fill; a new one
        // is taken only when too little of it is left for a worthwhile read.
        // A striped value reads from its first lane, at most to that stripe's end.
        let mut lane_left = usize::MAX;
        if let Src::Striped(st) = src {
            match st.poll_head(cx) {
                Poll::Ready(Ok((_, left))) => lane_left = left,
                Poll::Ready(Err(e)) => {
                    self.src = None;
                    return Poll::Ready(Some(Err(std::io::Error::other(e))));
                }
                Poll::Pending => return self.stalled(cx).map(|e| Some(Err(e))),
            }
        }
        let want = STREAM_CHUNK.min(self.left).min(lane_left);
        if self.buf.capacity() < (64 << 10).min(want) {
            self.buf.reserve(want);
        }
        let want = want.min(self.buf.capacity());
        while self.buf.len() < want {
            let before = self.buf.len();
            let mut limited = (&mut self.buf).limit(want - before);
            let polled = match src {
                Src::Te { s, .. } => {
                    tokio_util::io::poll_read_buf(std::pin::Pin::new(s), cx, &mut limited)
                }
                Src::Quic(r) => {
                    tokio_util::io::poll_read_buf(std::pin::Pin::new(r), cx, &mut limited)
                }
                Src::Striped(st) => match st.queue.front_mut() {
                    Some(Lane {
                        conn: LaneConn::Open(s),
                        ..
                    }) => tokio_util::io::poll_read_buf(std::pin::Pin::new(s), cx, &mut limited),
                    // poll_head above left an open first lane.
                    _ => Poll::Ready(Err(std::io::ErrorKind::NotConnected.into())),
                },
            };
            let broke = match polled {
                Poll::Ready(Ok(0)) => std::io::ErrorKind::UnexpectedEof.into(),
                Poll::Ready(Ok(_)) => {
                    self.waiting = false;
                    continue;
                }
                Poll::Ready(Err(e)) => e,
                Poll::Pending if self.buf.is_empty() => {
                    return self.stalled(cx).map(|e| Some(Err(e)));
                }
                Poll::Pending => break,
            };
            // Named by the owner it came from, as a failed whole read is (its kind kept).
            let peer = match self.src.take() {
                Some(Src::Te { peer, .. }) => Some(peer),
                Some(Src::Striped(st)) => Some(st.peer.to_string()),
                _ => None,
            };
            let e = match peer {
                Some(peer) => std::io::Error::new(
                    broke.kind(),
                    TeError::Io {
                        peer,
                        source: broke,
                    },
                ),
                None => broke,
            };
            return Poll::Ready(Some(Err(e)));
        }
        let chunk = self.buf.split().freeze();
        self.left -= chunk.len();
        if let Some(Src::Striped(st)) = self.src.as_mut() {
            st.took(chunk.len());
        }
        if self.left == 0 {
            // Every byte read: the connection is clean for the next READ.
            if let Some(Src::Te { s, peer, pool }) = self.src.take() {
                pool.give_back(&peer, s);
            }
        }
        Poll::Ready(Some(Ok(chunk)))
    }
}

/// A replica moongate can read an object from.
#[derive(Debug, Clone)]
pub enum Source {
    Memory(BufferDescriptor),
    /// A file of the master's disk tier (`--root_fs_dir`), read when no memory replica
    /// is left.
    Disk(DiskDescriptor),
}

impl Source {
    pub fn size(&self) -> u64 {
        match self {
            Source::Memory(d) => d.size,
            Source::Disk(d) => d.object_size,
        }
    }
}

/// The first complete memory replica of an object (what Mooncake's client reads too),
/// else its complete disk replica.
pub fn readable(list: &GetReplicaListResponse) -> Result<Source, StoreError> {
    let complete = || {
        list.replicas
            .iter()
            .filter(|r| r.status == ReplicaStatus::COMPLETE)
    };
    complete()
        .find_map(|r| match &r.location {
            ReplicaLocation::Memory(m) => Some(Source::Memory(m.buffer_descriptor.clone())),
            _ => None,
        })
        .or_else(|| {
            complete().find_map(|r| match &r.location {
                ReplicaLocation::Disk(d) => Some(Source::Disk(d.clone())),
                _ => None,
            })
        })
        .ok_or(StoreError::NoMemoryReplica)
}

/// Begins a write of a replica the master placed in moongate's own segment, waiting (as
/// the segment's TE-TCP side does) for a view over the range to end.
async fn begin_own_write(
    mem: &Memory,
    off: usize,
    len: u64,
) -> Result<crate::kv::own::memory::Writing<'_>, StoreError> {
    mem.begin_write_within(off, len as usize, crate::kv::own::segment::FENCE_WAIT)
        .await
        .map_err(StoreError::Fenced)
}

/// The transports of the client core and what they need: the metadata server (where a
/// segment listens), the TE-TCP pool, the QUIC pool (`kv.quic_client`), and moongate's
/// own segment once it is mounted.
pub struct Transfers {
    pub metadata: Metadata,
    pub te: Arc<Pool>,
    pub quic: Option<QuicPool>,
    own: std::sync::OnceLock<(Bytes, Arc<Memory>)>,
    /// Where disk replicas may be (`kv.disk_root`).
    disk: disk::Root,
    metrics: Arc<KvMetrics>,
}

impl Transfers {
    pub fn new(
        metadata: Metadata,
        te: Pool,
        quic: Option<QuicPool>,
        metrics: Arc<KvMetrics>,
    ) -> Transfers {
        Transfers {
            metadata,
            te: Arc::new(te),
            quic,
            own: std::sync::OnceLock::new(),
            disk: disk::Root::default(),
            metrics,
        }
    }

    /// Reads and writes disk replicas only under `dir` (`kv.disk_root`; empty = never).
    pub fn with_disk_root(mut self, dir: &str) -> Transfers {
        self.disk = disk::Root::new(dir);
        self
    }

    /// Declares moongate's own segment, once it is mounted.
    pub fn set_own_segment(&self, name: Bytes, mem: Arc<Memory>) {
        let _ = self.own.set((name, mem));
    }

    /// Runs `op` over QUIC when the segment's owner is a moongate serving QUIC; `None`
    /// when it is not, or when QUIC failed (logged; the caller falls back to TE-TCP, and
    /// the peer's entry is re-read next time).
    async fn via_quic<'a, T, F, Fut>(&'a self, endpoint: &Bytes, op: F) -> Option<T>
    where
        F: FnOnce(
            &'a crate::kv::transport::quic::QuicPool,
            crate::kv::transport::quic::QuicPeer,
        ) -> Fut,
        Fut: std::future::Future<Output = Result<T, crate::kv::transport::quic::QuicError>>,
    {
        let q = self.quic.as_ref()?;
        let peer = self.metadata.quic_peer(endpoint).await?;
        let addr = peer.addr;
        match op(q, peer).await {
            Ok(v) => Some(v),
            Err(e) => {
                tracing::warn!(peer = %addr, error = %e, "quic transfer failed; falling back to TE-TCP");
                self.metadata.forget(endpoint);
                None
            }
        }
    }

    /// moongate's own segment once it is mounted: its name and memory.
    pub fn own_segment(&self) -> Option<(&Bytes, &Arc<Memory>)> {
        self.own.get().map(|(n, m)| (n, m))
    }

    /// Where a replica in moongate's own segment lives: `None` for other segments, an
    /// error for a range outside the segment.
    pub fn in_own_segment(
        &self,
        d: &crate::codec::types::BufferDescriptor,
    ) -> Result<Option<(&crate::kv::own::segment::Memory, usize)>, StoreError> {
        let Some((_, own)) = self
            .own
            .get()
            .filter(|(name, _)| *name == d.transport_endpoint)
        else {
            return Ok(None);
        };
        let off = own
            .offset_of(d.buffer_address, d.size)
            .ok_or(StoreError::OutOfRange {
                addr: d.buffer_address,
                len: d.size,
            })?;
        Ok(Some((&**own, off)))
    }

    pub(super) async fn read_disk(&self, d: &DiskDescriptor) -> Result<Bytes, StoreError> {
        let v = disk::read(&self.disk, d).await?;
        self.metrics
            .transfer(Transport::Disk, Dir::Read, d.object_size);
        Ok(v)
    }

    /// Moves the replica `d` here: in place from the own segment, over QUIC from a
    /// moongate that serves it, else over TE-TCP. With `room` (the caller's reservation),
    /// a value of [`STREAM_FROM`] bytes and more from TE-TCP streams and keeps `room`
    /// until its last chunk.
    pub(super) async fn fetch(
        &self,
        d: &BufferDescriptor,
        room: Option<Reserved>,
    ) -> Result<Value, StoreError> {
        if let Some((own, off)) = self.in_own_segment(d)? {
            let out = own.read_vec(off, d.size as usize);
            self.metrics.transfer(Transport::Local, Dir::Read, d.size);
            return Ok(Value::Whole(Bytes::from(out)));
        }
        let seg = self.segment_of(d).await?;
        let (at, n) = (d.buffer_address, d.size);
        let mut room = room;
        if room.is_some() && n >= STREAM_FROM {
            if let Some(recv) = self
                .via_quic(&d.transport_endpoint, |q, peer| async move {
                    q.open_read(&peer, at, n).await
                })
                .await
                && let Some(r) = room.take()
            {
                self.metrics.transfer(Transport::Quic, Dir::Read, n);
                return Ok(Value::Stream(Streamed::new(
                    Src::Quic(recv),
                    n,
                    r,
                    self.te.timeout(),
                )));
            }
        } else if let Some(v) = self
            .via_quic(&d.transport_endpoint, |q, peer| async move {
                q.read(&peer, at, n).await
            })
            .await
        {
            self.metrics.transfer(Transport::Quic, Dir::Read, n);
            return Ok(Value::Whole(v));
        }
        let forget = |e: TeError| {
            self.metadata.forget(&d.transport_endpoint);
            StoreError::from(e)
        };
        if let Some(room) = room.filter(|_| d.size >= STREAM_FROM) {
            if let Some((stripe, lanes)) = self.te.stripes_for(d.size) {
                // The first stripe is asked for here, so a stale replica or a gone owner
                // is an error before the caller is answered, as on one connection.
                let first = self
                    .te
                    .open_read(&seg.data, d.buffer_address, stripe, seg.v2)
                    .await
                    .map_err(forget)?;
                self.metrics.transfer(Transport::Tcp, Dir::Read, d.size);
                self.metrics.striped(Dir::Read);
                let st = Stripes::new(
                    self.te.clone(),
                    &seg.data,
                    seg.v2,
                    (d.buffer_address, d.size),
                    (stripe, lanes),
                    Some(first),
                );
                return Ok(Value::Stream(Streamed::new(
                    Src::Striped(Box::new(st)),
                    d.size,
                    room,
                    self.te.timeout(),
                )));
            }
            let s = self
                .te
                .open_read(&seg.data, d.buffer_address, d.size, seg.v2)
                .await
                .map_err(forget)?;
            self.metrics.transfer(Transport::Tcp, Dir::Read, d.size);
            let src = Src::Te {
                s,
                peer: seg.data.to_string(),
                pool: self.te.clone(),
            };
            return Ok(Value::Stream(Streamed::new(
                src,
                d.size,
                room,
                self.te.timeout(),
            )));
        }
        let v = self
            .te
            .read(&seg.data, d.buffer_address, d.size, seg.v2)
            .await
            .map_err(forget)?;
        self.metrics.transfer(Transport::Tcp, Dir::Read, d.size);
        Ok(Value::Whole(v))
    }

    /// The segment holding replica `d`, checked to cover it; a stale descriptor (the
    /// owner restarted) is forgotten, to be read again next time.
    async fn segment_of(
        &self,
        d: &BufferDescriptor,
    ) -> Result<Arc<super::metadata::Segment>, StoreError> {
        let seg = self.metadata.segment(&d.transport_endpoint).await?;
        if !seg.covers(d.buffer_address, d.size) {
            self.metadata.forget(&d.transport_endpoint);
            return Err(StoreError::OutOfRange {
                addr: d.buffer_address,
                len: d.size,
            });
        }
        Ok(seg)
    }

    /// Moves the replica `d` into `dst` (exactly its size): in place from the own
    /// segment, or over QUIC or TE-TCP straight into `dst`.
    pub(super) async fn fetch_into(
        &self,
        d: &BufferDescriptor,
        dst: &mut [u8],
    ) -> Result<(), StoreError> {
        if dst.len() as u64 != d.size {
            return Err(StoreError::SizeMismatch {
                got: dst.len() as u64,
                want: d.size,
            });
        }
        if let Some((own, off)) = self.in_own_segment(d)? {
            own.read_at(off, dst);
            self.metrics.transfer(Transport::Local, Dir::Read, d.size);
            return Ok(());
        }
        let seg = self.segment_of(d).await?;
        let (at, n) = (d.buffer_address, d.size);
        let quic = {
            let to = &mut *dst;
            self.via_quic(&d.transport_endpoint, |q, peer| async move {
                q.read_to(&peer, at, to).await
            })
            .await
        };
        if quic.is_some() {
            self.metrics.transfer(Transport::Quic, Dir::Read, n);
            return Ok(());
        }
        if let Err(e) = self.te.read_to(&seg.data, at, dst, seg.v2).await {
            self.metadata.forget(&d.transport_endpoint);
            return Err(e.into());
        }
        self.metrics.transfer(Transport::Tcp, Dir::Read, n);
        Ok(())
    }

    /// Opens a write to every memory replica, then forwards the body to all of them.
    pub(super) async fn stream_replicas<B>(
        &self,
        replicas: &[crate::codec::types::ReplicaDescriptor],
        len: u64,
        mut body: B,
    ) -> Result<Stored, StoreError>
    where
        B: hyper::body::Body<Data = Bytes> + Unpin,
        B::Error: std::fmt::Display,
    {
        use http_body_util::BodyExt;
        let mut sinks = Vec::with_capacity(replicas.len());
        let mut disks = Vec::new();
        let mut stored = Stored::Memory;
        for r in replicas {
            if let ReplicaLocation::Disk(d) = &r.location {
                match disk::Writer::create(&self.disk, d).await {
                    Ok(w) => disks.push(w),
                    Err(e) => stored = stored.and_disk(self.disk_failed(&e)),
                }
            }
            let ReplicaLocation::Memory(m) = &r.location else {
                continue;
            };
            let d = &m.buffer_descriptor;
            if d.size != len {
                return Err(StoreError::SizeMismatch {
                    got: d.size,
                    want: len,
                });
            }
            sinks.push(self.open_sink(d).await?);
        }
        let mut at = 0u64;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| StoreError::Body(e.to_string()))?;
            let Ok(chunk) = frame.into_data() else {
                continue;
            };
            if at + chunk.len() as u64 > len {
                return Err(StoreError::Body(format!(
                    "more than the announced {len} bytes"
                )));
            }
            for s in &mut sinks {
                s.send(at, &chunk).await?;
            }
            let mut failed = None;
            for w in &mut disks {
                if let Err(e) = w.write(&chunk).await {
                    failed = Some(e);
                }
            }
            if let Some(e) = failed {
                stored = stored.and_disk(self.disk_failed(&e));
                disks.clear();
            }
            at += chunk.len() as u64;
        }
        if at != len {
            return Err(StoreError::Body(format!("ended after {at} of {len} bytes")));
        }
        for s in sinks {
            let transport = s.finish(self).await?;
            self.metrics.transfer(transport, Dir::Write, len);
        }
        for w in disks {
            let ok = match w.finish().await {
                Ok(()) => {
                    self.metrics.transfer(Transport::Disk, Dir::Write, len);
                    true
                }
                Err(e) => self.disk_failed(&e),
            };
            stored = stored.and_disk(ok);
        }
        Ok(stored)
    }

    /// A write to the replica `d`, ready for its bytes: in place, QUIC, or TE-TCP.
    async fn open_sink(&self, d: &BufferDescriptor) -> Result<Sink<'_>, StoreError> {
        if let Some((mem, off)) = self.in_own_segment(d)? {
            return Ok(Sink::Local(begin_own_write(mem, off, d.size).await?));
        }
        let seg = self.segment_of(d).await?;
        let (addr, len) = (d.buffer_address, d.size);
        if let Some((send, recv, peer)) = self
            .via_quic(&d.transport_endpoint, |q, peer| async move {
                let (send, recv) = q.open_write(&peer, addr, len).await?;
                Ok((send, recv, peer.addr))
            })
            .await
        {
            return Ok(Sink::Quic {
                send,
                recv,
                peer,
                addr,
                len,
            });
        }
        if let Some((stripe, lanes)) = self.te.stripes_for(len) {
            return Ok(Sink::Striped(StripedWrite {
                pool: self.te.clone(),
                peer: Arc::from(seg.data.as_str()),
                v2: seg.v2,
                addr,
                stripe,
                lanes,
                parts: Vec::new(),
                gathered: 0,
                at: 0,
                inflight: futures_util::stream::FuturesUnordered::new(),
            }));
        }
        let s = self
            .te
            .open_write(&seg.data, addr, len, seg.v2)
            .await
            .inspect_err(|_| self.metadata.forget(&d.transport_endpoint))?;
        Ok(Sink::Tcp {
            s,
            peer: seg.data.clone(),
            v2: seg.v2,
            addr,
            len,
        })
    }

    /// Writes every memory replica (any failure fails the put), then every disk replica
    /// (a failure there keeps the memory replicas: [`Stored::MemoryOnly`]).
    pub async fn write_replicas(
        &self,
        replicas: &[crate::codec::types::ReplicaDescriptor],
        value: &[u8],
    ) -> Result<Stored, StoreError> {
        self.write_memory_replicas(replicas, value).await?;
        let mut stored = Stored::Memory;
        for r in replicas {
            if let ReplicaLocation::Disk(d) = &r.location {
                let ok = match disk::write(&self.disk, d, value).await {
                    Ok(()) => {
                        self.metrics
                            .transfer(Transport::Disk, Dir::Write, d.object_size);
                        true
                    }
                    Err(e) => self.disk_failed(&e),
                };
                stored = stored.and_disk(ok);
            }
        }
        Ok(stored)
    }

    /// Logs a disk replica that could not be written; always `false` (not written).
    fn disk_failed(&self, e: &disk::DiskError) -> bool {
        tracing::warn!(error = %e, "disk replica not written; the value stays in memory only");
        false
    }

    async fn write_memory_replicas(
        &self,
        replicas: &[crate::codec::types::ReplicaDescriptor],
        value: &[u8],
    ) -> Result<(), StoreError> {
        for r in replicas {
            let ReplicaLocation::Memory(m) = &r.location else {
                continue;
            };
            let d = &m.buffer_descriptor;
            if d.size != value.len() as u64 {
                return Err(StoreError::SizeMismatch {
                    got: d.size,
                    want: value.len() as u64,
                });
            }
            if let Some((own, off)) = self.in_own_segment(d)? {
                begin_own_write(own, off, d.size).await?.put(0, value);
                self.metrics.transfer(Transport::Local, Dir::Write, d.size);
                continue;
            }
            let seg = self.segment_of(d).await?;
            if self
                .via_quic(&d.transport_endpoint, |q, peer| {
                    let at = d.buffer_address;
                    async move { q.write(&peer, at, value).await }
                })
                .await
                .is_some()
            {
                self.metrics.transfer(Transport::Quic, Dir::Write, d.size);
                continue;
            }
            if let Err(e) = self
                .te
                .write(&seg.data, d.buffer_address, value, seg.v2)
                .await
            {
                self.metadata.forget(&d.transport_endpoint);
                return Err(e.into());
            }
            self.metrics.transfer(Transport::Tcp, Dir::Write, d.size);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::client::budget::{Budget, ByteBudget};
    use std::time::Duration;
    use tokio::io::AsyncWriteExt;

    fn budget() -> ByteBudget {
        ByteBudget::new(
            &Budget {
                max_inflight_bytes: 64 << 20,
                busy_wait: Duration::from_millis(20),
            },
            crate::metrics::Metrics::new().kv.clone(),
        )
    }

    /// A TE-TCP source on a new connection to `peer`, returned to `pool` when done.
    async fn te_src(peer: &str, pool: &Arc<Pool>) -> Src {
        let s = tokio::net::TcpStream::connect(peer).await.unwrap();
        Src::Te {
            s,
            peer: peer.to_string(),
            pool: pool.clone(),
        }
    }

    /// A streamed value over a connection of `pool` to a peer that sends `sent`.
    async fn streamed(
        pool: &Arc<Pool>,
        len: u64,
        sent: Vec<u8>,
        b: &ByteBudget,
    ) -> (Streamed, String) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let peer = l.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            // In pieces, with pauses: the reader hands out what has arrived.
            for piece in sent.chunks(100_000) {
                s.write_all(piece).await.unwrap();
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            // Held open (a TE owner waits for the next request) until the reader is done.
            let mut rest = Vec::new();
            let _ = tokio::io::AsyncReadExt::read_to_end(&mut s, &mut rest).await;
        });
        let src = te_src(&peer, pool).await;
        (
            Streamed::new(
                src,
                len,
                b.reserve(len).await.unwrap(),
                Duration::from_secs(30),
            ),
            peer,
        )
    }

    async fn drain(v: &mut Streamed) -> Result<Vec<u8>, std::io::Error> {
        let mut out = Vec::new();
        while let Some(c) = std::future::poll_fn(|cx| v.poll_chunk(cx)).await {
            let c = c?;
            assert!(!c.is_empty() && c.len() <= STREAM_CHUNK);
            out.extend_from_slice(&c);
        }
        Ok(out)
    }

    /// Where the fake owner's memory starts.
    const BASE: u64 = 0x7f00_0000_0000;

    /// What the fake owner saw: connections accepted, READs and WRITEs at once (the most).
    #[derive(Default)]
    struct OwnerSeen {
        accepted: std::sync::atomic::AtomicUsize,
        busy: std::sync::atomic::AtomicUsize,
        most_busy: std::sync::atomic::AtomicUsize,
    }

    /// A TE-TCP owner (v2) of `mem` at [`BASE`], serving READs and WRITEs on every
    /// connection until it closes. A request at offset `fail_at` gets half its bytes
    /// (READ) or has its connection closed after half of them (WRITE), then the end.
    async fn fake_owner(
        mem: Arc<std::sync::Mutex<Vec<u8>>>,
        fail_at: Option<u64>,
    ) -> (String, Arc<OwnerSeen>) {
        use std::sync::atomic::Ordering::SeqCst;
        use tokio::io::AsyncReadExt;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let peer = l.local_addr().unwrap().to_string();
        let seen = Arc::new(OwnerSeen::default());
        let seen2 = seen.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                seen2.accepted.fetch_add(1, SeqCst);
                let (mem, seen) = (mem.clone(), seen2.clone());
                tokio::spawn(async move {
                    let ok = 0x4D43_5456u64 << 32;
                    let mut h = [0u8; 24];
                    while s.read_exact(&mut h).await.is_ok() {
                        let size = u64::from_le_bytes(h[..8].try_into().unwrap()) as usize;
                        let off = u64::from_le_bytes(h[8..16].try_into().unwrap()) - BASE;
                        let now = seen.busy.fetch_add(1, SeqCst) + 1;
                        seen.most_busy.fetch_max(now, SeqCst);
                        let fail = fail_at == Some(off);
                        let range = off as usize..off as usize + size;
                        // A reader that went away ends the connection, as a real owner's.
                        if h[16] & 1 == 0 {
                            if s.write_all(&ok.to_le_bytes()).await.is_err() {
                                return;
                            }
                            let bytes = mem.lock().unwrap()[range].to_vec();
                            let n = if fail { size / 2 } else { size };
                            // Slowly enough that stripes overlap.
                            for piece in bytes[..n].chunks(32 << 10) {
                                if s.write_all(piece).await.is_err() {
                                    return;
                                }
                                tokio::task::yield_now().await;
                            }
                        } else {
                            let mut got = vec![0u8; if fail { size / 2 } else { size }];
                            if s.read_exact(&mut got).await.is_err() {
                                return;
                            }
                            if !fail {
                                mem.lock().unwrap()[range].copy_from_slice(&got);
                                if s.write_all(&ok.to_le_bytes()).await.is_err() {
                                    return;
                                }
                            }
                        }
                        seen.busy.fetch_sub(1, SeqCst);
                        if fail {
                            return;
                        }
                    }
                });
            }
        });
        (peer, seen)
    }

    fn pattern(n: usize) -> Vec<u8> {
        (0..n as u32).map(|i| (i * 13 % 251) as u8).collect()
    }

    #[tokio::test]
    async fn a_striped_value_arrives_whole_in_order_over_several_connections_at_once() {
        use std::sync::atomic::Ordering::SeqCst;
        let value = pattern((1 << 20) + 4321);
        let (peer, seen) = fake_owner(Arc::new(std::sync::Mutex::new(value.clone())), None).await;
        let pool = Arc::new(Pool::new(4, Duration::from_secs(5)).with_stripes(64 << 10));
        let len = value.len() as u64;
        let (stripe, lanes) = pool.stripes_for(len).expect("striped");
        let b = budget();
        let st = Stripes::new(
            pool.clone(),
            &peer,
            true,
            (BASE, len),
            (stripe, lanes),
            None,
        );
        let mut v = Streamed::new(
            Src::Striped(Box::new(st)),
            len,
            b.reserve(len).await.unwrap(),
            Duration::from_secs(30),
        );
        assert_eq!(drain(&mut v).await.unwrap(), value);
        assert_eq!(seen.accepted.load(SeqCst), 4, "one connection per lane");
        assert!(
            seen.most_busy.load(SeqCst) >= 2,
            "stripes were read at once"
        );
        // Every lane ended cleanly and is kept for the next value.
        assert_eq!(pool.idle_count(&peer), 4);
        drop(v);
        assert_eq!(b.inflight_bytes(), 0);
    }

    #[tokio::test]
    async fn a_stripe_that_fails_mid_value_fails_the_value_and_its_connection_is_not_kept() {
        let value = pattern(1 << 20);
        let stripe = 64 << 10;
        let mem = Arc::new(std::sync::Mutex::new(value.clone()));
        let (peer, _) = fake_owner(mem, Some(5 * stripe)).await;
        let pool = Arc::new(Pool::new(4, Duration::from_secs(5)).with_stripes(stripe));
        let b = budget();
        // The first stripe opened ahead, as the kv face does.
        let first = pool.open_read(&peer, BASE, stripe, true).await.unwrap();
        let st = Stripes::new(
            pool.clone(),
            &peer,
            true,
            (BASE, 1 << 20),
            (stripe, 4),
            Some(first),
        );
        let mut v = Streamed::new(
            Src::Striped(Box::new(st)),
            1 << 20,
            b.reserve(1 << 20).await.unwrap(),
            Duration::from_secs(30),
        );
        let mut got = Vec::new();
        let e = loop {
            match std::future::poll_fn(|cx| v.poll_chunk(cx)).await {
                Some(Ok(c)) => got.extend_from_slice(&c),
                Some(Err(e)) => break e,
                None => panic!("a value with a failed stripe ended as if whole"),
            }
        };
        // What arrived before the failed stripe broke off, in order; nothing after it.
        assert_eq!(got, value[..got.len()]);
        assert!(
            got.len() as u64 <= 5 * stripe + stripe / 2,
            "{} bytes handed out",
            got.len()
        );
        assert!(e.to_string().contains(&peer), "{e}");
        assert!(std::future::poll_fn(|cx| v.poll_chunk(cx)).await.is_none());
        drop(v);
        assert_eq!(b.inflight_bytes(), 0);
        assert!(pool.idle_count(&peer) < 4, "the broken lane was kept");
    }

    #[tokio::test]
    async fn a_striped_write_lands_whole_and_one_failed_stripe_fails_it() {
        use std::sync::atomic::Ordering::SeqCst;
        let stripe = 64 << 10;
        let value = pattern(10 * stripe as usize + 777);
        let mem = Arc::new(std::sync::Mutex::new(vec![0u8; value.len()]));
        let (peer, seen) = fake_owner(mem.clone(), None).await;
        let pool = Arc::new(Pool::new(3, Duration::from_secs(5)).with_stripes(stripe));
        let w = |pool: &Arc<Pool>, peer: &str| StripedWrite {
            pool: pool.clone(),
            peer: Arc::from(peer),
            v2: true,
            addr: BASE,
            stripe,
            lanes: 3,
            parts: Vec::new(),
            gathered: 0,
            at: 0,
            inflight: futures_util::stream::FuturesUnordered::new(),
        };
        // The body in uneven chunks, as an HTTP upload arrives.
        let mut sink = w(&pool, &peer);
        for c in value.chunks(50_000) {
            sink.send(Bytes::copy_from_slice(c)).await.unwrap();
        }
        sink.finish().await.unwrap();
        assert!(*mem.lock().unwrap() == value);
        assert!(seen.accepted.load(SeqCst) <= 3, "more lanes than allowed");
        assert_eq!(pool.idle_count(&peer), seen.accepted.load(SeqCst));

        // An owner that drops one stripe's connection: the write as a whole fails.
        let mem = Arc::new(std::sync::Mutex::new(vec![0u8; value.len()]));
        let (peer, _) = fake_owner(mem, Some(4 * stripe)).await;
        let pool = Arc::new(Pool::new(3, Duration::from_secs(5)).with_stripes(stripe));
        let mut sink = w(&pool, &peer);
        let mut failed = None;
        for c in value.chunks(50_000) {
            if let Err(e) = sink.send(Bytes::copy_from_slice(c)).await {
                failed = Some(e);
                break;
            }
        }
        let e = match failed {
            Some(e) => e,
            None => sink
                .finish()
                .await
                .expect_err("a failed stripe was not reported"),
        };
        assert!(e.to_string().contains(&peer), "{e}");
    }

    #[test]
    fn values_are_striped_only_from_two_stripes_on_and_with_more_than_one_lane() {
        let p = Pool::new(4, Duration::from_secs(1)).with_stripes(1 << 20);
        assert_eq!(p.stripes_for(2 << 20), Some((1 << 20, 4)));
        assert_eq!(p.stripes_for((2 << 20) - 1), None);
        assert_eq!(
            Pool::new(1, Duration::from_secs(1))
                .with_stripes(1 << 20)
                .stripes_for(64 << 20),
            None
        );
        assert_eq!(
            Pool::new(4, Duration::from_secs(1)).stripes_for(64 << 20),
            None
        );
    }

    #[tokio::test]
    async fn a_streamed_value_arrives_whole_and_its_connection_is_kept_for_the_next_read() {
        let pool = Arc::new(Pool::new(1, Duration::from_secs(5)));
        let b = budget();
        let value: Vec<u8> = (0..1_500_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let (mut v, peer) = streamed(&pool, value.len() as u64, value.clone(), &b).await;
        assert_eq!(b.inflight_bytes(), 1_500_160);
        assert_eq!(drain(&mut v).await.unwrap(), value);
        assert_eq!(v.remaining(), 0);
        // The connection went back to the pool: the next take reuses it (no listener
        // accepts a second one).
        assert_eq!(pool.idle_count(&peer), 1);
        drop(v);
        assert_eq!(b.inflight_bytes(), 0, "the reservation ends with the value");
    }

    #[tokio::test]
    async fn a_streamed_value_cut_short_is_an_error_and_its_connection_is_not_kept() {
        let pool = Arc::new(Pool::new(1, Duration::from_secs(5)));
        let b = budget();
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            s.write_all(&[1u8; 1000]).await.unwrap();
        });
        let src = te_src(&addr.to_string(), &pool).await;
        let mut v = Streamed::new(
            src,
            5000,
            b.reserve(5000).await.unwrap(),
            Duration::from_secs(30),
        );
        let e = drain(&mut v).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
        // Polled again after the error: the end, never a panic or a second read.
        assert!(std::future::poll_fn(|cx| v.poll_chunk(cx)).await.is_none());
        assert_eq!(pool.idle_count(&addr.to_string()), 0);
        drop(v);
        assert_eq!(b.inflight_bytes(), 0);
    }

    #[tokio::test]
    async fn an_owner_that_stalls_mid_value_ends_it_with_a_timeout_and_gives_back_its_budget() {
        let pool = Arc::new(Pool::new(1, Duration::from_secs(5)));
        let b = budget();
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (held_tx, held) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            s.write_all(&[3u8; 70_000]).await.unwrap();
            // Then nothing, with the connection open, until the test ends.
            let _ = held.await;
        });
        let src = te_src(&addr.to_string(), &pool).await;
        let stall = Duration::from_millis(200);
        let mut v = Streamed::new(src, 1 << 20, b.reserve(1 << 20).await.unwrap(), stall);
        // Bounded only so a broken timer fails the test instead of hanging it.
        let r = tokio::time::timeout(Duration::from_secs(30), drain(&mut v))
            .await
            .expect("a stalled owner was waited on without end");
        assert_eq!(r.unwrap_err().kind(), std::io::ErrorKind::TimedOut);
        assert!(std::future::poll_fn(|cx| v.poll_chunk(cx)).await.is_none());
        drop(v);
        assert_eq!(b.inflight_bytes(), 0);
        assert_eq!(pool.idle_count(&addr.to_string()), 0);
        drop(held_tx);
    }

    #[tokio::test]
    async fn a_caller_that_pauses_longer_than_the_stall_bound_is_not_taken_for_a_stalled_owner() {
        let pool = Arc::new(Pool::new(1, Duration::from_secs(5)));
        let b = budget();
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let value: Vec<u8> = (0..200_000u32).map(|i| (i % 253) as u8).collect();
        let sent = value.clone();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            s.write_all(&sent[..100_000]).await.unwrap();
            // The rest well after the caller resumed, well within the bound of that wait.
            tokio::time::sleep(Duration::from_millis(4500)).await;
            s.write_all(&sent[100_000..]).await.unwrap();
            let mut rest = Vec::new();
            let _ = tokio::io::AsyncReadExt::read_to_end(&mut s, &mut rest).await;
        });
        let src = te_src(&addr.to_string(), &pool).await;
        let stall = Duration::from_secs(3);
        let mut v = Streamed::new(src, 200_000, b.reserve(200_000).await.unwrap(), stall);
        let mut got = Vec::new();
        while got.len() < 100_000 {
            let c = std::future::poll_fn(|cx| v.poll_chunk(cx))
                .await
                .unwrap()
                .unwrap();
            got.extend_from_slice(&c);
        }
        // The caller takes nothing for longer than the bound (a slow HTTP reader).
        tokio::time::sleep(Duration::from_secs(4)).await;
        got.extend(
            drain(&mut v)
                .await
                .expect("a paused caller is not a stalled owner"),
        );
        assert!(got == value);
    }
}

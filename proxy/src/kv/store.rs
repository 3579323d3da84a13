//! moongate as a Mooncake store client: lookups, reads, writes and removals against the
//! master (on its own connections, through the same codec) and the segments that hold
//! the bytes (over the transfer engine's TCP transport).
//!
//! A put follows Mooncake's client exactly: `PutStart` allocates replicas, every memory
//! replica is written over TE-TCP (v2: acknowledged once the bytes are in place), then
//! `PutEnd(ALL)`; any failed write revokes the put (`PutRevoke`). A get asks
//! `GetReplicaList` and reads the first complete memory replica.

use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use thiserror::Error;

use super::metadata::{Metadata, MetadataError};
use super::te_tcp::{Pool, TeError};
use crate::codec::message::{
    BatchPutEndArgs, BatchPutRevokeArgs, BatchPutStartArgs, KeyArgs, KeysArgs, PutEndArgs,
    PutRevokeArgs, PutStartArgs, RemoveArgs, Request, Response,
};
use crate::codec::types::{
    BufferDescriptor, DiskDescriptor, ErrorCode, GetReplicaListResponse, ObjectMeta,
    ReplicaLocation, ReplicaStatus, ReplicaType, ReplicateConfig, Uuid,
};
use crate::upstream::{CallError, Conn};

#[derive(Debug, Error)]
pub enum StoreError {
    #[error("master: {0}")]
    Master(#[from] CallError),
    #[error("master answered with transport error {0}")]
    Rpc(u8),
    #[error("master refused: {0}")]
    Refused(ErrorCode),
    #[error("the master's answer does not fit the call")]
    Unexpected,
    #[error("{0}")]
    Metadata(#[from] MetadataError),
    #[error("{0}")]
    Transfer(#[from] TeError),
    #[error("{0}")]
    Quic(#[from] super::quic::QuicError),
    #[error(
        "no complete memory or disk replica (NoF SSD, local-disk and DFS replicas are not read here)"
    )]
    NoMemoryReplica,
    #[error("{0}")]
    Disk(#[from] super::disk::DiskError),
    #[error("replica [{addr:#x}, +{len}) is outside the segment's advertised buffers")]
    OutOfRange { addr: u64, len: u64 },
    #[error("replica size {got} differs from the object size {want}")]
    SizeMismatch { got: u64, want: u64 },
    #[error("busy: {0} value bytes in flight on this node (kv.max_inflight_bytes); retry")]
    Busy(u64),
    #[error("the request body: {0}")]
    Body(String),
    #[error("the request body did not arrive within {0:?} (kv.timeout_ms)")]
    BodyTimeout(Duration),
}

pub struct Store {
    upstream: String,
    client_id: Uuid,
    tenant: Bytes,
    call_timeout: Duration,
    conns: Mutex<Vec<Conn>>,
    max_idle: usize,
    pub metadata: Metadata,
    pub te: Pool,
    /// QUIC to peer moongates that advertise it (`kv.quic_client`).
    pub quic: Option<super::quic::QuicPool>,
    /// moongate's own segment (name and memory): replicas there are copied in place.
    own: std::sync::OnceLock<(Bytes, std::sync::Arc<super::segment::Memory>)>,
    metrics: std::sync::Arc<crate::metrics::Metrics>,
    /// Value bytes of gets and puts in progress, node-wide, in KiB permits.
    budget: std::sync::Arc<tokio::sync::Semaphore>,
    budget_kib: u32,
    busy_wait: Duration,
    /// Replica descriptors reused within the master's read lease (`kv.replica_cache_ms`).
    replicas: Option<ReplicaCache>,
}

/// Where recently read values are, reused while the read lease the master granted with
/// the answer still has time left: within it the master neither evicts the object nor
/// removes it (unforced), so its bytes stay where the descriptor says. A read through a
/// cached descriptor that fails drops the entry and asks the master again.
struct ReplicaCache {
    ttl: Duration,
    entries: Mutex<std::collections::HashMap<Bytes, (BufferDescriptor, std::time::Instant)>>,
}

/// Entries the replica cache holds at most (expired ones are swept when it is full).
const REPLICA_CACHE_ENTRIES: usize = 65_536;

impl ReplicaCache {
    fn get(&self, key: &Bytes) -> Option<BufferDescriptor> {
        let map = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        map.get(key)
            .filter(|(_, until)| *until > std::time::Instant::now())
            .map(|(d, _)| d.clone())
    }

    /// Keeps `d` for `key` for the cache's ttl, at most half the granted lease.
    fn put(&self, key: Bytes, d: &BufferDescriptor, lease_ttl_ms: u64) {
        let ttl = self.ttl.min(Duration::from_millis(lease_ttl_ms / 2));
        if ttl.is_zero() {
            return;
        }
        let now = std::time::Instant::now();
        let mut map = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() >= REPLICA_CACHE_ENTRIES {
            map.retain(|_, (_, until)| *until > now);
            if map.len() >= REPLICA_CACHE_ENTRIES {
                return;
            }
        }
        map.insert(key, (d.clone(), now + ttl));
    }

    fn forget(&self, key: &Bytes) {
        self.entries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(key);
    }
}

/// Budget permits of a transfer in progress; returned on drop (a streamed value holds
/// them until its last byte is sent).
pub struct Reserved {
    _permit: tokio::sync::OwnedSemaphorePermit,
    bytes: u64,
    metrics: std::sync::Arc<crate::metrics::Metrics>,
}

impl Drop for Reserved {
    fn drop(&mut self) {
        self.metrics.kv.inflight_bytes.dec_by(self.bytes as i64);
    }
}

/// Values from this size on are streamed from the owner's TE-TCP listener to the caller
/// as they arrive (both hops overlap, and no whole-value buffer is held).
const STREAM_FROM: u64 = 1 << 20;
/// Bytes per chunk of a streamed value.
const STREAM_CHUNK: usize = 256 << 10;

/// How a put's replicas were written (a memory replica that failed fails the put).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stored {
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
    Local {
        mem: &'a super::segment::Memory,
        off: usize,
    },
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
}

impl Sink<'_> {
    /// Passes on the chunk that starts `at` bytes into the value.
    async fn send(&mut self, at: u64, chunk: &Bytes) -> Result<(), StoreError> {
        use tokio::io::AsyncWriteExt;
        match self {
            Sink::Local { mem, off } => {
                mem.write_at(*off + at as usize, chunk);
                Ok(())
            }
            Sink::Tcp { s, peer, .. } => s
                .write_all(chunk)
                .await
                .map_err(|e| StoreError::Transfer(super::te_tcp::io_error(peer)(e))),
            Sink::Quic { send, peer, .. } => send.write_chunk(chunk.clone()).await.map_err(|e| {
                StoreError::Quic(super::quic::QuicError::Peer {
                    peer: *peer,
                    error: e.to_string(),
                })
            }),
        }
    }

    /// Waits until the owner has the bytes; the transport index for metrics.
    async fn finish(self, store: &Store) -> Result<usize, StoreError> {
        match self {
            Sink::Local { .. } => Ok(1),
            Sink::Tcp {
                s,
                peer,
                v2,
                addr,
                len,
            } => {
                store.te.finish_write(&peer, s, addr, len, v2).await?;
                Ok(0)
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
                Ok(2)
            }
        }
    }
}

/// Keys of one batch part transferred at once (each may itself use several
/// connections when it is large).
pub const BATCH_CONCURRENCY: usize = 16;

/// Runs `jobs` with at most `limit` in progress at once; their outputs in job order.
pub async fn in_order<F: std::future::Future>(jobs: Vec<F>, limit: usize) -> Vec<F::Output> {
    use futures_util::StreamExt;
    let mut out = Vec::with_capacity(jobs.len());
    let mut waiting = jobs.into_iter();
    let mut running = futures_util::stream::FuturesOrdered::new();
    for f in waiting.by_ref().take(limit.max(1)) {
        running.push_back(f);
    }
    while let Some(v) = running.next().await {
        out.push(v);
        if let Some(f) = waiting.next() {
            running.push_back(f);
        }
    }
    out
}

/// A value read from the store.
pub enum Value {
    Whole(Bytes),
    /// `len` bytes arriving in chunks; an `Err` chunk means the transfer broke.
    Stream {
        len: u64,
        chunks: tokio::sync::mpsc::Receiver<Result<Bytes, std::io::Error>>,
    },
}

/// Limits of the kv face's byte budget.
pub struct Budget {
    /// Value bytes in flight at most (a larger single value takes the whole budget).
    pub max_inflight_bytes: u64,
    /// How long a request waits for room before it is answered busy.
    pub busy_wait: Duration,
}

/// Forwards `len` bytes from a TE-TCP connection whose READ was accepted, chunk by
/// chunk; the budget reservation lives until the last chunk is handed on.
fn stream_value<R>(mut s: R, len: u64, room: Reserved) -> Value
where
    R: tokio::io::AsyncRead + Unpin + Send + 'static,
{
    use tokio::io::AsyncReadExt;
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    tokio::spawn(async move {
        let _room = room;
        let mut left = len as usize;
        while left > 0 {
            let mut buf = bytes::BytesMut::with_capacity(STREAM_CHUNK.min(left));
            let n = STREAM_CHUNK.min(left);
            while buf.len() < n {
                match s.read_buf(&mut buf).await {
                    Ok(0) => {
                        let _ = tx.send(Err(std::io::ErrorKind::UnexpectedEof.into())).await;
                        return;
                    }
                    Ok(_) => {}
                    Err(e) => {
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                }
            }
            left -= buf.len();
            if tx.send(Ok(buf.freeze())).await.is_err() {
                return; // the caller went away
            }
        }
    });
    Value::Stream { len, chunks: rx }
}

/// A batch answer that has one entry per asked key, or `Unexpected`.
fn per_key<T>(answers: Vec<T>, keys: usize) -> Result<Vec<T>, StoreError> {
    if answers.len() == keys {
        Ok(answers)
    } else {
        Err(StoreError::Unexpected)
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
fn readable(list: &GetReplicaListResponse) -> Result<Source, StoreError> {
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

/// A client id for this process: Mooncake's are random UUIDs; std's hasher seeds give
/// enough entropy to never collide with a real client's.
pub fn fresh_uuid() -> Uuid {
    use std::hash::{BuildHasher, Hasher};
    let s = std::collections::hash_map::RandomState::new();
    let mut a = s.build_hasher();
    a.write_u32(std::process::id());
    let mut b = s.build_hasher();
    b.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    Uuid {
        first: a.finish(),
        second: b.finish(),
    }
}

impl Store {
    pub fn new(
        upstream: String,
        metadata: Metadata,
        te: Pool,
        call_timeout: Duration,
        tenant: Bytes,
        metrics: std::sync::Arc<crate::metrics::Metrics>,
        budget: Budget,
    ) -> Store {
        let budget_kib =
            (budget.max_inflight_bytes / 1024).clamp(1, u64::from(u32::MAX >> 3)) as u32;
        Store {
            upstream,
            client_id: fresh_uuid(),
            tenant,
            call_timeout,
            conns: Mutex::new(Vec::new()),
            max_idle: 8,
            metadata,
            te,
            quic: None,
            own: std::sync::OnceLock::new(),
            metrics,
            budget: std::sync::Arc::new(tokio::sync::Semaphore::new(budget_kib as usize)),
            budget_kib,
            busy_wait: budget.busy_wait,
            replicas: None,
        }
    }

    /// Reuses replica descriptors for up to `ttl` (never longer than half the read
    /// lease the master granted with them); zero leaves every get asking the master.
    pub fn with_replica_cache(mut self, ttl: Duration) -> Store {
        self.replicas = (!ttl.is_zero()).then(|| ReplicaCache {
            ttl,
            entries: Mutex::new(std::collections::HashMap::new()),
        });
        self
    }

    pub fn client_id(&self) -> Uuid {
        self.client_id
    }

    /// Value bytes in flight now (reserved by gets and puts in progress).
    pub fn inflight_bytes(&self) -> u64 {
        u64::from(self.budget_kib - self.budget.available_permits() as u32) * 1024
    }

    /// The node's in-flight byte budget (`kv.max_inflight_bytes`).
    pub fn budget_bytes(&self) -> u64 {
        u64::from(self.budget_kib) * 1024
    }

    /// Reserves `bytes` of the in-flight budget, waiting at most `busy_wait`.
    pub async fn reserve(&self, bytes: u64) -> Result<Reserved, StoreError> {
        let kib = (bytes.div_ceil(1024) as u32).clamp(1, self.budget_kib);
        let wait = self.budget.clone().acquire_many_owned(kib);
        match tokio::time::timeout(self.busy_wait, wait).await {
            Ok(Ok(p)) => {
                self.metrics.kv.inflight_bytes.inc_by(bytes as i64);
                Ok(Reserved {
                    _permit: p,
                    bytes,
                    metrics: self.metrics.clone(),
                })
            }
            _ => {
                self.metrics.kv.busy.inc();
                Err(StoreError::Busy(self.inflight_bytes()))
            }
        }
    }

    /// Runs `op` over QUIC when the segment's owner is a moongate serving QUIC; `None`
    /// when it is not, or when QUIC failed (logged; the caller falls back to TE-TCP, and
    /// the peer's entry is re-read next time).
    async fn via_quic<'a, T, F, Fut>(&'a self, endpoint: &Bytes, op: F) -> Option<T>
    where
        F: FnOnce(&'a super::quic::QuicPool, super::quic::QuicPeer) -> Fut,
        Fut: std::future::Future<Output = Result<T, super::quic::QuicError>>,
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

    /// Declares moongate's own segment, once it is mounted.
    pub fn set_own_segment(&self, name: Bytes, mem: std::sync::Arc<super::segment::Memory>) {
        let _ = self.own.set((name, mem));
    }

    /// Where a replica in moongate's own segment lives: `None` for other segments, an
    /// error for a range outside the segment.
    fn in_own_segment(
        &self,
        d: &crate::codec::types::BufferDescriptor,
    ) -> Result<Option<(&super::segment::Memory, usize)>, StoreError> {
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

    /// One call on a pooled connection of moongate's own; a connection that failed is
    /// dropped, not returned.
    async fn call(&self, req: Request) -> Result<Response, StoreError> {
        let pooled = self.conns.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut c = match pooled {
            Some(c) => c,
            None => Conn::connect(&self.upstream, self.call_timeout).await?,
        };
        let mut answers = c
            .call_all(std::slice::from_ref(&req), self.call_timeout)
            .await?;
        {
            let mut idle = self.conns.lock().unwrap_or_else(|p| p.into_inner());
            if idle.len() < self.max_idle {
                idle.push(c);
            }
        }
        match answers.pop() {
            Some(Ok(r)) => Ok(r),
            Some(Err(code)) => Err(StoreError::Rpc(code)),
            None => Err(StoreError::Unexpected),
        }
    }

    pub async fn exists(&self, keys: Vec<Bytes>) -> Result<Vec<bool>, StoreError> {
        let n = keys.len();
        let resp = self
            .call(Request::BatchExistKey(KeysArgs {
                keys,
                tenant_id: self.tenant.clone(),
            }))
            .await?;
        let Response::BatchExistKey(v) = resp else {
            return Err(StoreError::Unexpected);
        };
        per_key(v, n)?
            .into_iter()
            .map(|r| match r {
                Ok(b) => Ok(b),
                Err(ErrorCode::OBJECT_NOT_FOUND) => Ok(false),
                Err(e) => Err(StoreError::Refused(e)),
            })
            .collect()
    }

    /// The value of `key`, or `None` when the store does not have it.
    pub async fn get(&self, key: Bytes) -> Result<Option<Value>, StoreError> {
        if let Some(cache) = &self.replicas {
            if let Some(d) = cache.get(&key) {
                let room = self.reserve(d.size).await?;
                match self.fetch(&d, Some(room)).await {
                    Ok(v) => {
                        self.metrics.kv.replica_cache[0].inc();
                        return Ok(Some(v));
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "cached replica unreadable; asking the master");
                        self.metrics.kv.replica_cache[2].inc();
                        cache.forget(&key);
                    }
                }
            } else {
                self.metrics.kv.replica_cache[1].inc();
            }
        }
        let resp = self
            .call(Request::GetReplicaList(KeyArgs {
                key: key.clone(),
                tenant_id: self.tenant.clone(),
            }))
            .await?;
        let list = match resp {
            Response::GetReplicaList(Ok(l)) => l,
            Response::GetReplicaList(Err(ErrorCode::OBJECT_NOT_FOUND)) => return Ok(None),
            Response::GetReplicaList(Err(e)) => return Err(StoreError::Refused(e)),
            _ => return Err(StoreError::Unexpected),
        };
        match readable(&list)? {
            Source::Memory(d) => {
                let room = self.reserve(d.size).await?;
                let v = self.fetch(&d, Some(room)).await?;
                if let Some(cache) = &self.replicas {
                    cache.put(key, &d, list.lease_ttl_ms);
                }
                Ok(Some(v))
            }
            Source::Disk(d) => {
                let _room = self.reserve(d.object_size).await?;
                Ok(Some(Value::Whole(self.read_disk(&d).await?)))
            }
        }
    }

    async fn read_disk(&self, d: &DiskDescriptor) -> Result<Bytes, StoreError> {
        let v = super::disk::read(d).await?;
        self.metrics.kv.transfer(3, false, d.object_size);
        Ok(v)
    }

    /// Where the values of `keys` are, in one `BatchGetReplicaList`: per key the replica
    /// to read, `None` when the key is absent, or why it cannot be read.
    pub async fn locate_many(
        &self,
        keys: Vec<Bytes>,
    ) -> Result<Vec<Result<Option<Source>, StoreError>>, StoreError> {
        let n = keys.len();
        let resp = self
            .call(Request::BatchGetReplicaList(KeysArgs {
                keys,
                tenant_id: self.tenant.clone(),
            }))
            .await?;
        let Response::BatchGetReplicaList(v) = resp else {
            return Err(StoreError::Unexpected);
        };
        Ok(per_key(v, n)?
            .into_iter()
            .map(|r| match r {
                Ok(list) => readable(&list).map(Some),
                Err(ErrorCode::OBJECT_NOT_FOUND) => Ok(None),
                Err(e) => Err(StoreError::Refused(e)),
            })
            .collect())
    }

    /// Reads a replica whole; the caller holds its budget. (Batch reads: their part's
    /// reservation covers every value in it.)
    pub async fn read_replica(&self, src: &Source) -> Result<Bytes, StoreError> {
        match src {
            Source::Disk(d) => self.read_disk(d).await,
            Source::Memory(d) => match self.fetch(d, None).await? {
                Value::Whole(b) => Ok(b),
                Value::Stream { .. } => Err(StoreError::Unexpected),
            },
        }
    }

    /// Moves the replica `d` here: in place from the own segment, over QUIC from a
    /// moongate that serves it, else over TE-TCP. With `room` (the caller's reservation),
    /// a value of [`STREAM_FROM`] bytes and more from TE-TCP streams and keeps `room`
    /// until its last chunk.
    async fn fetch(
        &self,
        d: &BufferDescriptor,
        room: Option<Reserved>,
    ) -> Result<Value, StoreError> {
        if let Some((own, off)) = self.in_own_segment(d)? {
            let mut out = vec![0u8; d.size as usize];
            own.read_at(off, &mut out);
            self.metrics.kv.transfer(1, false, d.size);
            return Ok(Value::Whole(Bytes::from(out)));
        }
        let seg = self.metadata.segment(&d.transport_endpoint).await?;
        if !seg.covers(d.buffer_address, d.size) {
            // A stale descriptor (the owner restarted): re-read it next time.
            self.metadata.forget(&d.transport_endpoint);
            return Err(StoreError::OutOfRange {
                addr: d.buffer_address,
                len: d.size,
            });
        }
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
                self.metrics.kv.transfer(2, false, n);
                return Ok(stream_value(recv, n, r));
            }
        } else if let Some(v) = self
            .via_quic(&d.transport_endpoint, |q, peer| async move {
                q.read(&peer, at, n).await
            })
            .await
        {
            self.metrics.kv.transfer(2, false, n);
            return Ok(Value::Whole(v));
        }
        let forget = |e: TeError| {
            self.metadata.forget(&d.transport_endpoint);
            StoreError::from(e)
        };
        if let Some(room) = room.filter(|_| d.size >= STREAM_FROM) {
            let s = self
                .te
                .open_read(&seg.data, d.buffer_address, d.size, seg.v2)
                .await
                .map_err(forget)?;
            self.metrics.kv.transfer(0, false, d.size);
            return Ok(stream_value(s, d.size, room));
        }
        let v = self
            .te
            .read(&seg.data, d.buffer_address, d.size, seg.v2)
            .await
            .map_err(forget)?;
        self.metrics.kv.transfer(0, false, d.size);
        Ok(Value::Whole(v))
    }

    /// The `PutStart` this store sends for `key` (what a placement policy decides on).
    pub fn put_start(&self, key: Bytes, len: u64) -> Request {
        Request::PutStart(PutStartArgs {
            client_id: self.client_id,
            key,
            slice_length: len,
            config: ReplicateConfig::default(),
            tenant_id: self.tenant.clone(),
        })
    }

    /// Stores `value` under `key` with the given `PutStart` (from [`Store::put_start`],
    /// possibly rewritten by a policy).
    pub async fn put(&self, key: Bytes, value: Bytes, start: Request) -> Result<(), StoreError> {
        let _room = self.reserve(value.len() as u64).await?;
        let resp = self.call(start).await?;
        let replicas = match resp {
            Response::PutStart(Ok(r)) => r,
            Response::PutStart(Err(e)) => return Err(StoreError::Refused(e)),
            _ => return Err(StoreError::Unexpected),
        };
        let written = self.write_replicas(&replicas, &value).await;
        self.end_put(key, written).await
    }

    /// The `BatchPutStart` this store sends for `keys` of `sizes` bytes (what a
    /// placement policy decides on, as for a client's batch on the master face).
    pub fn batch_put_start(&self, keys: Vec<Bytes>, sizes: Vec<u64>) -> Request {
        Request::BatchPutStart(BatchPutStartArgs {
            client_id: self.client_id,
            keys,
            slice_lengths: sizes,
            config: ReplicateConfig::default(),
            tenant_id: self.tenant.clone(),
        })
    }

    /// Stores a batch of `(key, value)` whose budget the caller holds: `start` is the
    /// `BatchPutStart` (from [`Store::batch_put_start`], possibly rewritten by a policy
    /// that dropped denied keys; `fixup` puts their errors back in place). Every
    /// allocated key is written ([`BATCH_CONCURRENCY`] at once), the written ones end
    /// with one `BatchPutEnd`, the failed ones are revoked with one `BatchPutRevoke`.
    /// One result per key in order; `Err` as a whole when the master's answers are
    /// unusable.
    pub async fn put_many(
        &self,
        values: &[(Bytes, Bytes)],
        start: Request,
        fixup: Option<&crate::policy::Fixup>,
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        let resp = self.call(start).await?;
        let resp = match fixup {
            Some(f) => f.apply(resp),
            None => resp,
        };
        let Response::BatchPutStart(started) = resp else {
            return Err(StoreError::Unexpected);
        };
        let started = per_key(started, values.len())?;
        // (allocated, outcome): only allocated keys are ended or revoked.
        let mut jobs = Vec::with_capacity(values.len());
        for ((_, v), s) in values.iter().zip(started) {
            jobs.push(self.write_allocated(s, v));
        }
        let mut done = in_order(jobs, BATCH_CONCURRENCY).await;
        let (mut ended, mut revoked, mut with_disk, mut disk_failed) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (i, (allocated, r)) in done.iter().enumerate() {
            match (allocated, r) {
                (true, Ok(Stored::Memory)) => ended.push(i),
                (true, Ok(Stored::MemoryAndDisk)) => {
                    with_disk.push(i);
                    ended.push(i);
                }
                (true, Ok(Stored::DiskFailed)) => disk_failed.push(i),
                (true, Err(_)) => revoked.push(i),
                _ => {}
            }
        }
        // Rare (a disk tier that cannot be written here): ended key by key.
        for i in disk_failed {
            if let Err(e) = self
                .end_put(values[i].0.clone(), Ok(Stored::DiskFailed))
                .await
            {
                done[i].1 = Err(e);
            }
        }
        let end = |at: &[usize], replica_type| {
            self.call(Request::BatchPutEnd(BatchPutEndArgs {
                client_id: self.client_id,
                object_metas: at
                    .iter()
                    .map(|&i| ObjectMeta {
                        key: values[i].0.clone(),
                        object_checksum: None,
                    })
                    .collect(),
                replica_type,
                tenant_id: self.tenant.clone(),
            }))
        };
        if !with_disk.is_empty() {
            // The disk replicas end on their own, before ALL (as Mooncake's client does).
            if let Response::BatchPutEnd(v) = end(&with_disk, ReplicaType::DISK).await?
                && let Some(Err(e)) = v.into_iter().find(Result::is_err)
            {
                tracing::warn!(code = %e, "BatchPutEnd(DISK) refused");
            }
        }
        if !revoked.is_empty() {
            // Best effort, as for a single put: the write error is what the caller sees.
            let _ = self
                .call(Request::BatchPutRevoke(BatchPutRevokeArgs {
                    client_id: self.client_id,
                    keys: revoked.iter().map(|&i| values[i].0.clone()).collect(),
                    replica_type: ReplicaType::ALL,
                    tenant_id: self.tenant.clone(),
                }))
                .await;
        }
        if !ended.is_empty() {
            let Response::BatchPutEnd(v) = end(&ended, ReplicaType::ALL).await? else {
                return Err(StoreError::Unexpected);
            };
            for (&i, r) in ended.iter().zip(per_key(v, ended.len())?) {
                if let Err(e) = r {
                    done[i].1 = Err(StoreError::Refused(e));
                }
            }
        }
        Ok(done.into_iter().map(|(_, r)| r.map(|_| ())).collect())
    }

    /// Writes one key of a batch that `BatchPutStart` allocated; `(allocated, outcome)`.
    async fn write_allocated(
        &self,
        started: Result<Vec<crate::codec::types::ReplicaDescriptor>, ErrorCode>,
        value: &Bytes,
    ) -> (bool, Result<Stored, StoreError>) {
        match started {
            Ok(replicas) => (true, self.write_replicas(&replicas, value).await),
            Err(e) => (false, Err(StoreError::Refused(e))),
        }
    }

    /// Stores a value of `len` bytes that arrives in `body`, passing each chunk on to
    /// every memory replica as it comes (no whole-value buffer; the caller's upload and
    /// the writes overlap). The whole transfer is bounded by `kv.timeout_ms`; a body
    /// that breaks off or lies about its length revokes the put.
    pub async fn put_streamed<B>(
        &self,
        key: Bytes,
        len: u64,
        body: B,
        start: Request,
    ) -> Result<(), StoreError>
    where
        B: hyper::body::Body<Data = Bytes> + Unpin,
        B::Error: std::fmt::Display,
    {
        let _room = self.reserve(len).await?;
        let replicas = match self.call(start).await? {
            Response::PutStart(Ok(r)) => r,
            Response::PutStart(Err(e)) => return Err(StoreError::Refused(e)),
            _ => return Err(StoreError::Unexpected),
        };
        let written = tokio::time::timeout(
            self.call_timeout,
            self.stream_replicas(&replicas, len, body),
        )
        .await
        .unwrap_or(Err(StoreError::BodyTimeout(self.call_timeout)));
        self.end_put(key, written).await
    }

    /// `PutEnd(ALL)` after every replica was written (preceded by `PutEnd(DISK)` for a
    /// disk replica); `PutRevoke(DISK)` then `PutEnd(ALL)` when only the disk replica
    /// failed; `PutRevoke(ALL)` (and the write's error) when a memory replica failed.
    async fn end_put(
        &self,
        key: Bytes,
        written: Result<Stored, StoreError>,
    ) -> Result<(), StoreError> {
        let revoke = |key: Bytes, replica_type| {
            self.call(Request::PutRevoke(PutRevokeArgs {
                client_id: self.client_id,
                key,
                replica_type,
                tenant_id: self.tenant.clone(),
            }))
        };
        let end = |key: Bytes, replica_type| {
            self.call(Request::PutEnd(PutEndArgs {
                client_id: self.client_id,
                object_meta: ObjectMeta {
                    key,
                    object_checksum: None,
                },
                replica_type,
                tenant_id: self.tenant.clone(),
            }))
        };
        match written {
            Err(e) => {
                let _ = revoke(key, ReplicaType::ALL).await;
                return Err(e);
            }
            Ok(Stored::Memory) => {}
            Ok(Stored::MemoryAndDisk) => {
                if let Response::PutEnd(Err(e)) = end(key.clone(), ReplicaType::DISK).await? {
                    tracing::warn!(code = %e, "PutEnd(DISK) refused");
                }
            }
            Ok(Stored::DiskFailed) => {
                if let Response::PutRevoke(Err(e)) = revoke(key.clone(), ReplicaType::DISK).await? {
                    tracing::warn!(code = %e, "PutRevoke(DISK) refused");
                }
            }
        }
        match end(key, ReplicaType::ALL).await? {
            Response::PutEnd(Ok(())) => Ok(()),
            Response::PutEnd(Err(e)) => Err(StoreError::Refused(e)),
            _ => Err(StoreError::Unexpected),
        }
    }

    /// Opens a write to every memory replica, then forwards the body to all of them.
    async fn stream_replicas<B>(
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
                match super::disk::Writer::create(d).await {
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
            self.metrics.kv.transfer(transport, true, len);
        }
        for w in disks {
            let ok = match w.finish().await {
                Ok(()) => {
                    self.metrics.kv.transfer(3, true, len);
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
            return Ok(Sink::Local { mem, off });
        }
        let seg = self.metadata.segment(&d.transport_endpoint).await?;
        if !seg.covers(d.buffer_address, d.size) {
            self.metadata.forget(&d.transport_endpoint);
            return Err(StoreError::OutOfRange {
                addr: d.buffer_address,
                len: d.size,
            });
        }
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
    async fn write_replicas(
        &self,
        replicas: &[crate::codec::types::ReplicaDescriptor],
        value: &Bytes,
    ) -> Result<Stored, StoreError> {
        self.write_memory_replicas(replicas, value).await?;
        let mut stored = Stored::Memory;
        for r in replicas {
            if let ReplicaLocation::Disk(d) = &r.location {
                let ok = match super::disk::write(d, value).await {
                    Ok(()) => {
                        self.metrics.kv.transfer(3, true, d.object_size);
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
    fn disk_failed(&self, e: &super::disk::DiskError) -> bool {
        tracing::warn!(error = %e, "disk replica not written; the value stays in memory only");
        false
    }

    async fn write_memory_replicas(
        &self,
        replicas: &[crate::codec::types::ReplicaDescriptor],
        value: &Bytes,
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
                own.write_at(off, value);
                self.metrics.kv.transfer(1, true, d.size);
                continue;
            }
            let seg = self.metadata.segment(&d.transport_endpoint).await?;
            if !seg.covers(d.buffer_address, d.size) {
                self.metadata.forget(&d.transport_endpoint);
                return Err(StoreError::OutOfRange {
                    addr: d.buffer_address,
                    len: d.size,
                });
            }
            if self
                .via_quic(&d.transport_endpoint, |q, peer| {
                    let at = d.buffer_address;
                    async move { q.write(&peer, at, value).await }
                })
                .await
                .is_some()
            {
                self.metrics.kv.transfer(2, true, d.size);
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
            self.metrics.kv.transfer(0, true, d.size);
        }
        Ok(())
    }

    /// Removes `key`; `false` when it was not there.
    pub async fn remove(&self, key: Bytes) -> Result<bool, StoreError> {
        if let Some(cache) = &self.replicas {
            cache.forget(&key);
        }
        match self
            .call(Request::Remove(RemoveArgs {
                key,
                force: false,
                tenant_id: self.tenant.clone(),
            }))
            .await?
        {
            Response::Remove(Ok(())) => Ok(true),
            Response::Remove(Err(ErrorCode::OBJECT_NOT_FOUND)) => Ok(false),
            Response::Remove(Err(e)) => Err(StoreError::Refused(e)),
            _ => Err(StoreError::Unexpected),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(max_inflight_bytes: u64) -> Store {
        Store::new(
            "127.0.0.1:1".into(),
            Metadata::new("http://127.0.0.1:1/metadata", Duration::from_secs(1)).unwrap(),
            Pool::new(1, Duration::from_secs(1)),
            Duration::from_secs(1),
            Bytes::from_static(b"default"),
            std::sync::Arc::new(crate::metrics::Metrics::new()),
            Budget {
                max_inflight_bytes,
                busy_wait: Duration::from_millis(20),
            },
        )
    }

    #[tokio::test]
    async fn the_byte_budget_answers_busy_instead_of_queueing() {
        let s = store(1 << 20);
        let a = s.reserve(600 << 10).await.unwrap();
        assert!(matches!(
            s.reserve(600 << 10).await,
            Err(StoreError::Busy(_))
        ));
        assert_eq!(s.metrics.kv.busy.get(), 1);
        assert_eq!(s.metrics.kv.inflight_bytes.get(), 600 << 10);
        drop(a);
        assert_eq!(s.metrics.kv.inflight_bytes.get(), 0);
        // A value larger than the whole budget takes all of it, then proceeds.
        let big = s.reserve(5 << 20).await.unwrap();
        assert!(s.reserve(1).await.is_err());
        drop(big);
        assert!(s.reserve(1).await.is_ok());
    }
}

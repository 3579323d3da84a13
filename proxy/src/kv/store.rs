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
    KeyArgs, KeysArgs, PutEndArgs, PutRevokeArgs, PutStartArgs, RemoveArgs, Request, Response,
};
use crate::codec::types::{
    ErrorCode, ObjectMeta, ReplicaLocation, ReplicaStatus, ReplicaType, ReplicateConfig, Uuid,
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
    #[error("no complete memory replica (tiers other than memory are not read here yet)")]
    NoMemoryReplica,
    #[error("replica [{addr:#x}, +{len}) is outside the segment's advertised buffers")]
    OutOfRange { addr: u64, len: u64 },
    #[error("replica size {got} differs from the object size {want}")]
    SizeMismatch { got: u64, want: u64 },
    #[error("busy: {0} value bytes in flight on this node (kv.max_inflight_bytes); retry")]
    Busy(u64),
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
fn stream_value(mut s: tokio::net::TcpStream, len: u64, room: Reserved) -> Value {
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
        }
    }

    pub fn client_id(&self) -> Uuid {
        self.client_id
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
                Err(StoreError::Busy(
                    u64::from(self.budget_kib - self.budget.available_permits() as u32) * 1024,
                ))
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
        if v.len() != n {
            return Err(StoreError::Unexpected);
        }
        v.into_iter()
            .map(|r| match r {
                Ok(b) => Ok(b),
                Err(ErrorCode::OBJECT_NOT_FOUND) => Ok(false),
                Err(e) => Err(StoreError::Refused(e)),
            })
            .collect()
    }

    /// The value of `key`, or `None` when the store does not have it.
    pub async fn get(&self, key: Bytes) -> Result<Option<Value>, StoreError> {
        let resp = self
            .call(Request::GetReplicaList(KeyArgs {
                key,
                tenant_id: self.tenant.clone(),
            }))
            .await?;
        let list = match resp {
            Response::GetReplicaList(Ok(l)) => l,
            Response::GetReplicaList(Err(ErrorCode::OBJECT_NOT_FOUND)) => return Ok(None),
            Response::GetReplicaList(Err(e)) => return Err(StoreError::Refused(e)),
            _ => return Err(StoreError::Unexpected),
        };
        let mem = list.replicas.iter().find_map(|r| match &r.location {
            ReplicaLocation::Memory(m) if r.status == ReplicaStatus::COMPLETE => {
                Some(&m.buffer_descriptor)
            }
            _ => None,
        });
        let Some(d) = mem else {
            return Err(StoreError::NoMemoryReplica);
        };
        let room = self.reserve(d.size).await?;
        if let Some((own, off)) = self.in_own_segment(d)? {
            let mut out = vec![0u8; d.size as usize];
            own.read_at(off, &mut out);
            self.metrics.kv.transfer(1, false, d.size);
            return Ok(Some(Value::Whole(Bytes::from(out))));
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
        if let Some(v) = self
            .via_quic(&d.transport_endpoint, |q, peer| {
                let (at, n) = (d.buffer_address, d.size);
                async move { q.read(&peer, at, n).await }
            })
            .await
        {
            self.metrics.kv.transfer(2, false, d.size);
            return Ok(Some(Value::Whole(v)));
        }
        if d.size >= STREAM_FROM {
            let s = match self
                .te
                .open_read(&seg.data, d.buffer_address, d.size, seg.v2)
                .await
            {
                Ok(s) => s,
                Err(e) => {
                    self.metadata.forget(&d.transport_endpoint);
                    return Err(e.into());
                }
            };
            self.metrics.kv.transfer(0, false, d.size);
            return Ok(Some(stream_value(s, d.size, room)));
        }
        match self
            .te
            .read(&seg.data, d.buffer_address, d.size, seg.v2)
            .await
        {
            Ok(v) => {
                self.metrics.kv.transfer(0, false, d.size);
                Ok(Some(Value::Whole(v)))
            }
            Err(e) => {
                self.metadata.forget(&d.transport_endpoint);
                Err(e.into())
            }
        }
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
        if let Err(e) = written {
            let _ = self
                .call(Request::PutRevoke(PutRevokeArgs {
                    client_id: self.client_id,
                    key,
                    replica_type: ReplicaType::ALL,
                    tenant_id: self.tenant.clone(),
                }))
                .await;
            return Err(e);
        }
        match self
            .call(Request::PutEnd(PutEndArgs {
                client_id: self.client_id,
                object_meta: ObjectMeta {
                    key,
                    object_checksum: None,
                },
                replica_type: ReplicaType::ALL,
                tenant_id: self.tenant.clone(),
            }))
            .await?
        {
            Response::PutEnd(Ok(())) => Ok(()),
            Response::PutEnd(Err(e)) => Err(StoreError::Refused(e)),
            _ => Err(StoreError::Unexpected),
        }
    }

    async fn write_replicas(
        &self,
        replicas: &[crate::codec::types::ReplicaDescriptor],
        value: &Bytes,
    ) -> Result<(), StoreError> {
        for r in replicas {
            // Disk replicas are written by the master's own disk path, not by clients.
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

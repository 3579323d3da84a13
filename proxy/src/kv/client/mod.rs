//! The client core: moongate as a Mooncake store client. Lookups, reads, writes and
//! removals against the master (on its own connections, [`master`]) and the segments
//! that hold the bytes ([`transfer`]), under the node's byte budget ([`budget`]), with
//! an optional replica cache ([`cache`]), the metadata server ([`metadata`]) and the
//! master's disk tier ([`disk`]).
//!
//! A put follows Mooncake's client exactly (`put.rs`: `PutStart` allocates replicas,
//! every memory replica is written, then `PutEnd(ALL)`; any failed write revokes the
//! put). A get asks `GetReplicaList` (or the replica cache) and reads the first
//! complete memory replica (here). Every master call is told to a [`Heard`] when one is
//! set.

pub mod acked;
pub mod budget;
pub mod cache;
pub mod disk;
pub mod failover;
pub mod master;
pub mod metadata;
mod put;
pub mod transfer;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use thiserror::Error;

use crate::codec::message::{
    BatchPutEndArgs, BatchPutRevokeArgs, BatchPutStartArgs, KeyArgs, KeysArgs, PutEndArgs,
    PutRevokeArgs, PutStartArgs, RemoveArgs, Request, Response,
};
use crate::codec::types::{
    ErrorCode, ObjectMeta, ReplicaDescriptor, ReplicaType, ReplicateConfig, Uuid,
};
use crate::kv::metrics::CacheResult;
use crate::kv::metrics::KvMetrics;
use crate::kv::transport::te_tcp::TeError;
use crate::upstream::CallError;
pub use budget::{Budget, ByteBudget, Reserved};
use cache::ReplicaCache;
use master::MasterConns;
use metadata::MetadataError;
pub use transfer::{Source, Stored, Transfers, readable};

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
    Quic(#[from] crate::kv::transport::quic::QuicError),
    #[error(
        "no complete memory or disk replica (NoF SSD, local-disk and DFS replicas are not read here)"
    )]
    NoMemoryReplica,
    #[error("{0}")]
    Disk(#[from] disk::DiskError),
    #[error("replica [{addr:#x}, +{len}) is outside the segment's advertised buffers")]
    OutOfRange { addr: u64, len: u64 },
    #[error("replica size {got} differs from the object size {want}")]
    SizeMismatch { got: u64, want: u64 },
    #[error("busy: {0} value bytes in flight on this node (kv.max_inflight_bytes); retry")]
    Busy(u64),
    #[error("busy: every master connection is in use (kv.master_connections); retry")]
    MasterBusy,
    #[error(
        "busy: this connection's bodies hold {held} bytes of the byte budget, at most {max} \
         (kv.max_body_bytes_per_connection); retry when one has ended"
    )]
    ConnectionShare { held: u64, max: u64 },
    #[error("no master leader (HA failover in progress); retry")]
    NoLeader,
    #[error("the request body: {0}")]
    Body(String),
    #[error("the request body did not arrive within {0:?} (kv.timeout_ms)")]
    BodyTimeout(Duration),
    #[error("busy: {0}; the master placed the value where a local engine still reads; retry")]
    Fenced(crate::kv::own::fence::Fenced),
}

/// Hears the client core's master calls and their answers: how the rest of moongate
/// (the key table and what it feeds: eviction, KV events, miss reasons, a fleet's access
/// records) learns of what engines do through the kv face, as it learns of what
/// Mooncake's clients do through the master face.
pub trait Heard: Send + Sync {
    /// Whether this call's answer is of interest (a copy of the call is kept until then).
    fn wants(&self, req: &Request) -> bool;
    /// A call and the master's answer.
    fn heard(&self, req: &Request, resp: &Response);
    /// Puts of `keys` were acknowledged and a new leader lost them; their bytes could
    /// not be put again ([`failover`]).
    fn lost(&self, _tenant: &Bytes, _keys: &[Bytes]) {}
    /// Whether `key` ended through this moongate since it was stored (removed by a
    /// client, evicted by moongate): a new leader that lacks it has not lost it.
    fn ended_here(&self, _tenant: &Bytes, _key: &Bytes) -> bool {
        false
    }
    /// Whether a lookup found `key` gone at the master before `before` (the leader
    /// then had already let it go): a later leader that lacks it has not lost it.
    fn gone_before(&self, _tenant: &Bytes, _key: &Bytes, _before: std::time::Instant) -> bool {
        false
    }
}

/// moongate as one Mooncake client (one client id, one tenant).
pub struct Store {
    client_id: Uuid,
    tenant: Bytes,
    call_timeout: Duration,
    master: MasterConns,
    budget: ByteBudget,
    /// Replica descriptors reused within the master's read lease (`kv.replica_cache_ms`).
    replicas: Option<ReplicaCache>,
    pub xfer: Transfers,
    metrics: Arc<KvMetrics>,
    heard: Option<Arc<dyn Heard>>,
    /// Puts acknowledged lately, checked after a leader change (`kv.failover_window_ms`;
    /// `None`: off).
    failover: Option<failover::Failover>,
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
    /// A large value read from its owner as the caller takes it.
    Stream(transfer::Streamed),
}

/// What a read into a caller's buffer came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadInto {
    /// This many bytes are at the start of the buffer.
    Read(usize),
    /// The value has this many bytes, more than the buffer holds; nothing was read.
    TooSmall(u64),
    Absent,
}

/// Where a batch read finds one key's value: a replica list the master just gave, or
/// one from the replica cache (`cached`: the places epoch it was found under, checked
/// again after the read).
#[derive(Debug, Clone)]
pub struct Located {
    pub src: Source,
    cached: Option<u64>,
    /// The own segment's write sequence number from before the lookup that found it
    /// (a view of it checks that its range was not written since).
    pub seq: u64,
    /// The read lease the master granted with it (0: not known).
    pub lease_ms: u64,
}

impl Located {
    /// The value's size as located (what a batch reserves budget for).
    pub fn size(&self) -> u64 {
        self.src.size()
    }

    /// The places epoch it was found under when it came from the replica cache.
    pub fn cached_epoch(&self) -> Option<u64> {
        self.cached
    }
}

/// Whether a lookup's refusal means the value is not there for readers: not stored, or
/// its put not ended yet (no replica complete: what a reader sees is "not stored yet").
fn absent(e: ErrorCode) -> bool {
    e == ErrorCode::OBJECT_NOT_FOUND || e == ErrorCode::REPLICA_IS_NOT_READY
}

/// Every slot of a batch lookup filled (an empty one is `Unexpected`).
fn collect_located(
    found: Vec<Option<Result<Option<Located>, StoreError>>>,
) -> Vec<Result<Option<Located>, StoreError>> {
    found
        .into_iter()
        .map(|s| s.unwrap_or(Err(StoreError::Unexpected)))
        .collect()
}

/// A batch answer that has one entry per asked key, or `Unexpected`.
fn per_key<T>(answers: Vec<T>, keys: usize) -> Result<Vec<T>, StoreError> {
    if answers.len() == keys {
        Ok(answers)
    } else {
        Err(StoreError::Unexpected)
    }
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
        upstream: crate::upstream::Upstream,
        xfer: Transfers,
        call_timeout: Duration,
        tenant: Bytes,
        metrics: Arc<KvMetrics>,
        budget: &Budget,
        master_connections: usize,
    ) -> Store {
        Store {
            client_id: fresh_uuid(),
            tenant,
            call_timeout,
            master: MasterConns::new(
                upstream,
                call_timeout,
                master_connections,
                budget.busy_wait,
                metrics.clone(),
            ),
            budget: ByteBudget::new(budget, metrics.clone()),
            replicas: None,
            xfer,
            metrics,
            heard: None,
            failover: None,
        }
    }

    /// Tells `h` of every master call and its answer.
    pub fn with_heard(mut self, h: Arc<dyn Heard>) -> Store {
        self.heard = Some(h);
        self
    }

    /// Reuses replica descriptors for up to `ttl` (never longer than half the read
    /// lease the master granted with them); zero leaves every get asking the master.
    pub fn with_replica_cache(mut self, ttl: Duration) -> Store {
        self.replicas = (!ttl.is_zero()).then(|| ReplicaCache::new(ttl));
        self
    }

    pub fn client_id(&self) -> Uuid {
        self.client_id
    }

    /// Value bytes in flight now (reserved by gets and puts in progress).
    pub fn inflight_bytes(&self) -> u64 {
        self.budget.inflight_bytes()
    }

    /// The node's in-flight byte budget (`kv.max_inflight_bytes`).
    pub fn budget_bytes(&self) -> u64 {
        self.budget.budget_bytes()
    }

    /// Reserves `bytes` of the in-flight budget, waiting at most `kv.busy_wait_ms`.
    pub async fn reserve(&self, bytes: u64) -> Result<Reserved, StoreError> {
        self.budget.reserve(bytes).await
    }

    /// Who gives budget bytes back when a reservation finds the budget full.
    pub fn set_reclaim(&self, r: Arc<dyn budget::Reclaim>) {
        self.budget.set_reclaim(r);
    }

    /// Adds `more` bytes to a reservation, waiting at most `kv.busy_wait_ms`.
    pub async fn grow(&self, r: &mut Reserved, more: u64) -> Result<(), StoreError> {
        self.budget.grow(r, more).await
    }

    /// The own segment's write sequence number now (0 without one): read before a lookup
    /// whose answer a view may use.
    pub fn write_seq(&self) -> u64 {
        self.xfer
            .own_segment()
            .map_or(0, |(_, m)| m.fence().write_seq())
    }

    /// Drops the replica cache's entry for `key` (its next lookup asks the master).
    pub fn forget_replica(&self, key: &Bytes) {
        if let Some(c) = &self.replicas {
            c.forget(key);
        }
    }

    /// The upstream's places epoch now (it moves when a removal, a lost master or a new
    /// leader voids what lookups said).
    pub fn places_epoch(&self) -> u64 {
        self.master.places_epoch()
    }

    /// The epoch the own segment's known keys are good in.
    pub fn known_epoch(&self) -> u64 {
        self.master.known_epoch()
    }

    /// Periodic upkeep: closes master connections idle for `master_idle` (zero: none)
    /// and reads the bounded tables' sizes into their gauges.
    pub fn housekeeping(&self, master_idle: Duration) {
        if !master_idle.is_zero() {
            self.master.close_idle(master_idle);
        }
        self.prune_failover();
        let m = &self.metrics;
        m.master_idle.set(self.master.idle() as i64);
        let own = self.xfer.own_segment().map(|(_, mem)| mem.fence());
        m.table_entries[0].set(own.map_or(0, |f| f.known_keys()) as i64);
        m.table_entries[1].set(self.failover_followed().unwrap_or(0) as i64);
        m.table_entries[2].set(own.map_or(0, |f| f.held_keys()) as i64);
    }

    /// The deadline of one master call or transfer (`kv.timeout_ms`).
    pub fn call_timeout(&self) -> Duration {
        self.call_timeout
    }

    async fn call(&self, req: Request) -> Result<Response, StoreError> {
        let heard = self.heard.as_ref().filter(|h| h.wants(&req));
        let follow = self.failover.is_some() && failover::follows(&req);
        if heard.is_none() && !follow {
            return self.master.call(req).await;
        }
        // Read before the call: a write begun over a put's range after this voids it.
        let since = if follow { self.write_seq() } else { 0 };
        let asked = req.clone();
        let resp = self.master.call(req).await?;
        if follow {
            self.follow_put(&asked, &resp, since);
        }
        if let Some(h) = heard {
            h.heard(&asked, &resp);
        }
        Ok(resp)
    }

    /// Whether each of `keys` is stored. A key of the failover window that a new leader
    /// lacks while its check runs is asked again after the check ([`Store::await_check`]).
    pub async fn exists(&self, keys: Vec<Bytes>) -> Result<Vec<bool>, StoreError> {
        if !self.check_pending() {
            return self.exists_at_master(keys).await;
        }
        let mut found = self.exists_at_master(keys.clone()).await?;
        let absent: Vec<usize> = (0..found.len()).filter(|&i| !found[i]).collect();
        if !absent.is_empty() && self.await_check(absent.iter().map(|&i| &keys[i])).await {
            let ask = absent.iter().map(|&i| keys[i].clone()).collect();
            for (&i, here) in absent.iter().zip(self.exists_at_master(ask).await?) {
                found[i] = here;
                self.waited_for_check(here);
            }
        }
        Ok(found)
    }

    /// Whether each of `keys` is stored, as the master in force answers now.
    pub(super) async fn exists_at_master(&self, keys: Vec<Bytes>) -> Result<Vec<bool>, StoreError> {
        let n = keys.len();
        let resp = self
            .call(Request::BatchExistKey(KeysArgs {
                keys: keys.into(),
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
        let mut epoch = self.master.places_epoch();
        let mut seq = self.write_seq();
        if let Some(cache) = &self.replicas {
            if let Some(d) = cache.get(&key, epoch) {
                let room = self.reserve(d.size).await?;
                match self.xfer.fetch(&d, Some(room)).await {
                    Ok(v) if self.master.places_epoch() == epoch => {
                        self.metrics.replica_cache(CacheResult::Hit);
                        return Ok(Some(v));
                    }
                    Ok(_) => {
                        // Voided while it was read: what was read may not be the value.
                        self.metrics.replica_cache(CacheResult::Stale);
                        epoch = self.master.places_epoch();
                        seq = self.write_seq();
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "cached replica unreadable; asking the master");
                        self.metrics.replica_cache(CacheResult::Stale);
                        cache.forget(&key);
                    }
                }
            } else {
                self.metrics.replica_cache(CacheResult::Miss);
            }
        }
        let Some((src, lease_ttl_ms)) = self.locate(&key).await? else {
            return Ok(None);
        };
        match src {
            Source::Memory(d) => {
                let room = self.reserve(d.size).await?;
                let v = self.xfer.fetch(&d, Some(room)).await?;
                if let Some(cache) = &self.replicas {
                    cache.put(key, &d, lease_ttl_ms, epoch, seq);
                }
                Ok(Some(v))
            }
            Source::Disk(d) => {
                let _room = self.reserve(d.object_size).await?;
                Ok(Some(Value::Whole(self.xfer.read_disk(&d).await?)))
            }
        }
    }

    /// Reads the value of `key` into `dst` (a caller's memory: nothing is buffered here,
    /// so no budget is taken): [`ReadInto::Read`] with its length, [`ReadInto::TooSmall`] with
    /// the length `dst` lacks room for (nothing read), or [`ReadInto::Absent`].
    pub async fn get_into(&self, key: Bytes, dst: &mut [u8]) -> Result<ReadInto, StoreError> {
        let epoch = self.master.places_epoch();
        let seq = self.write_seq();
        if let Some(cache) = &self.replicas {
            if let Some(d) = cache.get(&key, epoch) {
                let loc = Located {
                    src: Source::Memory(d),
                    cached: Some(epoch),
                    seq,
                    lease_ms: 0,
                };
                return self.read_located_into(&key, &loc, dst).await;
            }
            self.metrics.replica_cache(CacheResult::Miss);
        }
        let Some((src, lease_ttl_ms)) = self.locate(&key).await? else {
            return Ok(ReadInto::Absent);
        };
        self.read_into(&src, dst).await.inspect(|_| {
            if let (Some(cache), Source::Memory(d)) = (&self.replicas, &src) {
                cache.put(key, d, lease_ttl_ms, epoch, seq);
            }
        })
    }

    /// The replica to read for `key` by the master's `GetReplicaList`, with the read
    /// lease it granted; `None` when the key is absent.
    async fn locate(&self, key: &Bytes) -> Result<Option<(Source, u64)>, StoreError> {
        let found = self.locate_once(key).await?;
        if found.is_some() || !self.await_check([key]).await {
            return Ok(found);
        }
        let again = self.locate_once(key).await?;
        self.waited_for_check(again.is_some());
        Ok(again)
    }

    async fn locate_once(&self, key: &Bytes) -> Result<Option<(Source, u64)>, StoreError> {
        let resp = self
            .call(Request::GetReplicaList(KeyArgs {
                key: key.clone(),
                tenant_id: self.tenant.clone(),
            }))
            .await?;
        let list = match resp {
            Response::GetReplicaList(Ok(l)) => l,
            Response::GetReplicaList(Err(e)) if absent(e) => return Ok(None),
            Response::GetReplicaList(Err(e)) => return Err(StoreError::Refused(e)),
            _ => return Err(StoreError::Unexpected),
        };
        Ok(Some((readable(&list)?, list.lease_ttl_ms)))
    }

    /// Reads a located replica into `dst`, as [`Store::get_into`] does.
    pub async fn read_into(&self, src: &Source, dst: &mut [u8]) -> Result<ReadInto, StoreError> {
        let size = src.size();
        let Some(to) = dst.get_mut(..size as usize) else {
            return Ok(ReadInto::TooSmall(size));
        };
        match src {
            Source::Memory(d) => self.xfer.fetch_into(d, to).await?,
            Source::Disk(d) => {
                let v = self.xfer.read_disk(d).await?;
                if v.len() != to.len() {
                    return Err(StoreError::SizeMismatch {
                        got: v.len() as u64,
                        want: size,
                    });
                }
                to.copy_from_slice(&v);
            }
        }
        Ok(ReadInto::Read(size as usize))
    }

    /// Where the values of `keys` are: from the replica cache where it holds a list not
    /// voided since, the rest in one `BatchGetReplicaList` (whose lists are cached): per
    /// key the replica to read, `None` when the key is absent, or why it cannot be read.
    /// A cached one is read with [`Store::read_located`] or
    /// [`Store::read_located_into`], which check after the read that it still held.
    pub async fn locate_many(
        &self,
        keys: Vec<Bytes>,
    ) -> Result<Vec<Result<Option<Located>, StoreError>>, StoreError> {
        let epoch = self.master.places_epoch();
        let seq = self.write_seq();
        let mut found: Vec<Option<Result<Option<Located>, StoreError>>> =
            Vec::with_capacity(keys.len());
        let mut ask = Vec::new();
        for k in &keys {
            let hit = self.replicas.as_ref().and_then(|c| c.hit(k, epoch));
            if hit.is_none() && self.replicas.is_some() {
                self.metrics.replica_cache(CacheResult::Miss);
            }
            found.push(hit.map(|h| {
                Ok(Some(Located {
                    src: Source::Memory(h.at),
                    cached: Some(epoch),
                    seq: h.seq,
                    lease_ms: h.lease_ms,
                }))
            }));
            if found.last().is_some_and(Option::is_none) {
                ask.push(k.clone());
            }
        }
        self.ask_many(&mut found, ask, epoch, seq).await?;
        if !self.check_pending() {
            return Ok(collect_located(found));
        }
        // Keys a new leader lacks while its failover check runs: asked again after it.
        let absent: Vec<usize> = (0..found.len())
            .filter(|&i| matches!(found[i], Some(Ok(None))))
            .collect();
        if !absent.is_empty() && self.await_check(absent.iter().map(|&i| &keys[i])).await {
            let ask = absent.iter().map(|&i| keys[i].clone()).collect();
            absent.iter().for_each(|&i| found[i] = None);
            let (epoch, seq) = (self.master.places_epoch(), self.write_seq());
            self.ask_many(&mut found, ask, epoch, seq).await?;
            for &i in &absent {
                self.waited_for_check(matches!(found[i], Some(Ok(Some(_)))));
            }
        }
        Ok(collect_located(found))
    }

    /// Asks the master where `ask` are (the keys of `found`'s empty slots, in order) in
    /// one `BatchGetReplicaList` and fills those slots; the lists are cached.
    async fn ask_many(
        &self,
        found: &mut [Option<Result<Option<Located>, StoreError>>],
        ask: Vec<Bytes>,
        epoch: u64,
        seq: u64,
    ) -> Result<(), StoreError> {
        if ask.is_empty() {
            return Ok(());
        }
        let n = ask.len();
        let resp = self
            .call(Request::BatchGetReplicaList(KeysArgs {
                keys: ask.clone().into(),
                tenant_id: self.tenant.clone(),
            }))
            .await?;
        let Response::BatchGetReplicaList(v) = resp else {
            return Err(StoreError::Unexpected);
        };
        let mut answers = per_key(v, n)?.into_iter().zip(ask);
        for slot in found.iter_mut().filter(|s| s.is_none()) {
            let Some((r, key)) = answers.next() else {
                return Err(StoreError::Unexpected);
            };
            *slot = Some(match r {
                Ok(list) => readable(&list).map(|src| {
                    if let (Some(cache), Source::Memory(d)) = (&self.replicas, &src) {
                        cache.put(key, d, list.lease_ttl_ms, epoch, seq);
                    }
                    Some(Located {
                        src,
                        cached: None,
                        seq,
                        lease_ms: list.lease_ttl_ms,
                    })
                }),
                Err(e) if absent(e) => Ok(None),
                Err(e) => Err(StoreError::Refused(e)),
            });
        }
        Ok(())
    }

    /// Reads a located replica whole; the caller holds budget for `loc`'s size. A
    /// replica found in the cache is answered only if no removal, lost master or new
    /// leader voided the lists while it was read; else the master is asked again and the
    /// value read anew (`None`: it is gone; a larger value reserves its extra bytes).
    pub async fn read_located(
        &self,
        key: &Bytes,
        loc: &Located,
    ) -> Result<Option<Bytes>, StoreError> {
        let Some(epoch) = loc.cached else {
            return self.read_whole(&loc.src).await.map(Some);
        };
        match self.read_whole(&loc.src).await {
            Ok(v) if self.master.places_epoch() == epoch => {
                self.metrics.replica_cache(CacheResult::Hit);
                return Ok(Some(v));
            }
            r => self.stale(key, r.err()),
        }
        let Some((src, _extra)) = self.relocate(key, loc, true).await? else {
            return Ok(None);
        };
        self.read_whole(&src).await.map(Some)
    }

    /// Reads a located replica into `dst`, as [`Store::read_located`] does.
    pub async fn read_located_into(
        &self,
        key: &Bytes,
        loc: &Located,
        dst: &mut [u8],
    ) -> Result<ReadInto, StoreError> {
        let Some(epoch) = loc.cached else {
            return self.read_into(&loc.src, dst).await;
        };
        match self.read_into(&loc.src, dst).await {
            Ok(r) if self.master.places_epoch() == epoch => {
                self.metrics.replica_cache(CacheResult::Hit);
                return Ok(r);
            }
            r => self.stale(key, r.err()),
        }
        let Some((src, _)) = self.relocate(key, loc, false).await? else {
            return Ok(ReadInto::Absent);
        };
        self.read_into(&src, dst).await
    }

    /// A cached replica list that did not hold through a read: counted, and forgotten
    /// when the read itself failed.
    fn stale(&self, key: &Bytes, failed: Option<StoreError>) {
        self.metrics.replica_cache(CacheResult::Stale);
        if let (Some(e), Some(cache)) = (failed, &self.replicas) {
            tracing::debug!(error = %e, "cached replica unreadable; asking the master");
            cache.forget(key);
        }
    }

    /// Asks the master again for a key whose cached list did not hold: the replica (now
    /// cached) and, with `budget` (a read into moongate's memory), budget for the bytes
    /// it has beyond `loc`'s; `None` when it is gone.
    async fn relocate(
        &self,
        key: &Bytes,
        loc: &Located,
        budget: bool,
    ) -> Result<Option<(Source, Option<Reserved>)>, StoreError> {
        let epoch = self.master.places_epoch();
        let seq = self.write_seq();
        let Some((src, lease_ttl_ms)) = self.locate(key).await? else {
            return Ok(None);
        };
        let extra = match src.size().checked_sub(loc.size()) {
            Some(more) if budget && more > 0 => Some(self.reserve(more).await?),
            _ => None,
        };
        if let (Some(cache), Source::Memory(d)) = (&self.replicas, &src) {
            cache.put(key.clone(), d, lease_ttl_ms, epoch, seq);
        }
        Ok(Some((src, extra)))
    }

    async fn read_whole(&self, src: &Source) -> Result<Bytes, StoreError> {
        match src {
            Source::Disk(d) => self.xfer.read_disk(d).await,
            Source::Memory(d) => match self.xfer.fetch(d, None).await? {
                Value::Whole(b) => Ok(b),
                Value::Stream(_) => Err(StoreError::Unexpected),
            },
        }
    }

    /// Renews the master's read lease of `keys` (one `BatchExistKey`, which grants it),
    /// unheard: it is moongate keeping views alive, not an engine's lookup.
    pub async fn renew_leases(&self, keys: Vec<Bytes>) -> Result<(), StoreError> {
        self.master
            .call(Request::BatchExistKey(KeysArgs {
                keys: keys.into(),
                tenant_id: self.tenant.clone(),
            }))
            .await
            .map(|_| ())
    }

    /// Removes `key`; `false` when it was not there.
    pub async fn remove(&self, key: Bytes) -> Result<bool, StoreError> {
        if let Some(cache) = &self.replicas {
            cache.forget(&key);
        }
        // Before the call: a view after it must not answer from what moongate knew. A
        // key an engine views here is refused, as the master refuses a leased one (a
        // view answered from what moongate knew holds no master lease).
        if let Some((_, own)) = self.xfer.own_segment() {
            if own.fence().viewed_known(&key) {
                return Err(StoreError::Refused(ErrorCode::OBJECT_HAS_LEASE));
            }
            own.fence().forget(&key);
        }
        // Unforced: it fails on a leased value, and every cached one is leased.
        let resp = self
            .call(Request::Remove(RemoveArgs {
                key: key.clone(),
                force: false,
                tenant_id: self.tenant.clone(),
            }))
            .await?;
        // And after it: a view that looked the key up meanwhile may have known it again.
        if let Some((_, own)) = self.xfer.own_segment() {
            own.fence().forget(&key);
        }
        match resp {
            Response::Remove(Ok(())) => Ok(true),
            Response::Remove(Err(ErrorCode::OBJECT_NOT_FOUND)) => Ok(false),
            Response::Remove(Err(e)) => Err(StoreError::Refused(e)),
            _ => Err(StoreError::Unexpected),
        }
    }
}

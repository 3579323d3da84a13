//! Zero-copy views and reservations for engines on this host (the shared-memory
//! connections of [`super::shm`]): an engine maps moongate's own segment and the
//! staging area once, then reads values where they lie and writes values where the
//! master placed them, with its own copies or its GPU's DMA.
//!
//! - A **view** answers where a value lies under a lease. A value in the own segment is
//!   viewed in place: its range is fenced ([`crate::kv::own::fence`]) so no write lands
//!   on it until the lease ends, whatever the master does meanwhile (a forced removal,
//!   an upsert, a remount), and the master's own read lease is renewed for as long as
//!   the view is held so the pool keeps the value. A value elsewhere (another owner,
//!   the disk tier) is read once into the staging area and viewed there.
//! - A **reservation** is a put split in two: the policy decides it and the master
//!   allocates it (`PutStart`, with the own segment preferred), the engine writes the
//!   bytes where they go, and the commit ends the put (`PutEnd`) after sending them to
//!   any other replica. A reservation placed outside the own segment is written into
//!   the staging area and sent on at commit. Nothing is visible before the commit; an
//!   abort, an expiry or the engine's end revokes the put and its space returns.
//!
//! Leases and reservations belong to an [`Engine`]: one handle of the C library (its
//! pooled connections say the same token, `OP_HELLO`), or one connection. They end when
//! released, when `kv.lease_ms` passes, or when the engine's last connection ends,
//! however it ends.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use moongate_kv::capi::{
    MG_ERR_ARG, MG_ERR_BUSY, MG_ERR_NO_LEASE, MG_ERR_NOMEM, MG_ERR_NOT_FOUND, MG_ERR_NOT_LOCAL,
};
use moongate_kv::shm::wire::{MEMORY_SEGMENT, MEMORY_STAGING, PLACE_IN_PLACE, PLACE_STAGED};
use tokio_util::sync::CancellationToken;

use super::state::{KvState, code_of as outcome_code};
use crate::codec::Method;
use crate::codec::message::Request;
use crate::codec::types::{ReplicaDescriptor, ReplicaLocation};
use crate::kv::client::{ReadInto, Source, StoreError, Stored};
use crate::kv::own::memory::Memory;
use crate::kv::own::segment::FENCE_WAIT;
use crate::kv::own::staging::{Slot, Staging};
use crate::policy::Outcome;

/// A failed call or item: a negative `MG_ERR_*` and its message.
#[derive(Debug)]
pub struct Fail(pub i32, pub String);

/// How leases and reservations are bounded (`[kv]`).
#[derive(Debug, Clone, Copy)]
pub struct Rules {
    /// `kv.lease_ms`.
    pub lease: Duration,
    /// `kv.max_leases`, per engine.
    pub max_leases: usize,
}

/// What one item of a view answered: the place (`PLACE_*`), or a negative code; the
/// memory (`MEMORY_*`), offset and length it lies at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ViewItem {
    pub status: i32,
    pub memory: u32,
    pub off: u64,
    pub len: u64,
}

/// What one item of a reservation answered: as [`ViewItem`], with its ticket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReserveItem {
    pub status: i32,
    pub memory: u32,
    pub off: u64,
    pub ticket: u64,
}

impl ViewItem {
    fn failed(code: i32) -> ViewItem {
        ViewItem {
            status: code,
            memory: 0,
            off: 0,
            len: 0,
        }
    }
}

impl ReserveItem {
    fn failed(code: i32) -> ReserveItem {
        ReserveItem {
            status: code,
            memory: 0,
            off: 0,
            ticket: 0,
        }
    }
}

/// What a view lease holds.
enum Held {
    /// A fenced range of the own segment, and its key (its master lease is renewed).
    InPlace {
        off: usize,
        len: usize,
        key: Bytes,
    },
    Staged(Slot),
}

struct Lease {
    deadline: Instant,
    held: Vec<Held>,
    bytes: u64,
    /// How often the master's read lease of its in-place values is renewed (a third of
    /// the shortest lease the master granted with them), and when next.
    renew_every: Option<Duration>,
    renew_at: Instant,
}

/// Where a reservation's bytes are written.
enum Place {
    /// The own segment's range, held as a write in progress (no view can begin on it).
    InPlace {
        off: usize,
        seq: u64,
    },
    Staged(Slot),
}

/// An open reservation.
struct Reservation {
    key: Bytes,
    len: usize,
    replicas: Vec<ReplicaDescriptor>,
    /// The replica the engine writes into (the rest get its bytes at commit).
    written: Option<usize>,
    place: Place,
    decision: crate::policy::Ticket,
    started: Instant,
    deadline: Instant,
}

#[derive(Default)]
struct Holdings {
    leases: HashMap<u64, Lease>,
    tickets: HashMap<u64, Reservation>,
}

/// The zero-copy state of the kv face: the memories engines map, the engines, and the
/// reservations whose engine ended before they did (revoked by [`Engines::run`]).
pub struct Engines {
    rules: Rules,
    /// Names this run of moongate to engines (their mappings are of this run's memory).
    instance: u64,
    own: std::sync::OnceLock<Arc<Memory>>,
    staging: Option<Arc<Staging>>,
    by_token: Mutex<HashMap<(i32, u64), Weak<Engine>>>,
    live: Mutex<Vec<Weak<Engine>>>,
    orphans: Mutex<Vec<Reservation>>,
    next_id: AtomicU64,
    metrics: Arc<crate::kv::metrics::KvMetrics>,
}

/// One engine: its leases and reservations, released when the last of its connections
/// drops it.
pub struct Engine {
    engines: Arc<Engines>,
    holdings: Mutex<Holdings>,
}

impl Drop for Engine {
    fn drop(&mut self) {
        let h = std::mem::take(&mut *self.holdings.lock().unwrap_or_else(|e| e.into_inner()));
        for (_, l) in h.leases {
            self.engines.release(l);
        }
        let n = h.tickets.len();
        if n > 0 {
            tracing::debug!(
                reservations = n,
                "an engine ended holding reservations; revoking them"
            );
            let mut o = self
                .engines
                .orphans
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            for (_, r) in h.tickets {
                self.engines.end_place(&r);
                o.push(r);
            }
        }
    }
}

impl Engines {
    pub fn new(
        rules: Rules,
        staging: Option<Arc<Staging>>,
        metrics: Arc<crate::kv::metrics::KvMetrics>,
    ) -> Arc<Engines> {
        Arc::new(Engines {
            rules,
            instance: crate::kv::client::fresh_uuid().first | 1,
            own: std::sync::OnceLock::new(),
            staging,
            by_token: Mutex::new(HashMap::new()),
            live: Mutex::new(Vec::new()),
            orphans: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(1),
            metrics,
        })
    }

    /// This run of moongate, as engines see it.
    pub fn instance(&self) -> u64 {
        self.instance
    }

    /// Declares the own segment's memory once it exists.
    pub fn set_own(&self, mem: Arc<Memory>) {
        let _ = self.own.set(mem);
    }

    /// The memories an engine maps, `(MEMORY_* id, memory)`.
    pub fn memories(&self) -> Vec<(u32, &Memory)> {
        let mut v = Vec::new();
        if let Some(m) = self.own.get() {
            v.push((MEMORY_SEGMENT, &**m));
        }
        if let Some(s) = &self.staging {
            v.push((MEMORY_STAGING, &s.mem));
        }
        v
    }

    /// A new engine for one connection.
    pub fn engine(self: &Arc<Self>) -> Arc<Engine> {
        let e = Arc::new(Engine {
            engines: self.clone(),
            holdings: Mutex::new(Holdings::default()),
        });
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        live.retain(|w| w.strong_count() > 0);
        live.push(Arc::downgrade(&e));
        e
    }

    /// The engine process `pid` names `token` (the C library's handle): the one its
    /// other connections joined, or a new one.
    pub fn join(self: &Arc<Self>, pid: i32, token: u64) -> Arc<Engine> {
        let mut by = self.by_token.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = by.get(&(pid, token)).and_then(Weak::upgrade) {
            return e;
        }
        by.retain(|_, w| w.strong_count() > 0);
        let e = self.engine();
        by.insert((pid, token), Arc::downgrade(&e));
        e
    }

    fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn release(&self, l: Lease) {
        for h in l.held {
            match h {
                Held::InPlace { off, len, .. } => {
                    if let Some(m) = self.own.get() {
                        m.fence().unview(off, len);
                    }
                }
                Held::Staged(s) => self.free_staged(s),
            }
        }
        self.metrics.view_leases.dec();
        self.metrics.viewed_bytes.dec_by(l.bytes as i64);
    }

    fn free_staged(&self, s: Slot) {
        if let Some(st) = &self.staging {
            st.free(s);
            self.metrics.staging_bytes.set(st.used() as i64);
        }
    }

    /// Ends what a reservation holds of memory (its write in progress, its staging).
    fn end_place(&self, r: &Reservation) {
        match r.place {
            Place::InPlace { seq, .. } => {
                if let Some(m) = self.own.get() {
                    m.fence().end_write(seq);
                }
            }
            Place::Staged(s) => self.free_staged(s),
        }
        self.metrics.reservations.dec();
    }

    /// The bytes a reservation's engine wrote.
    ///
    /// # Safety
    /// The reservation's place is still held (not yet given back).
    unsafe fn written<'a>(&'a self, r: &Reservation) -> Option<&'a [u8]> {
        let (mem, off) = match r.place {
            Place::InPlace { off, .. } => (&**self.own.get()?, off),
            Place::Staged(s) => (&self.staging.as_ref()?.mem, s.off),
        };
        // SAFETY: the range is the reservation's own (allocated to it, held by it);
        // the engine may still write to it (then the put stores what it raced with).
        Some(unsafe { std::slice::from_raw_parts(mem.address_of(off), r.len) })
    }

    /// Views `keys` for `engine`: one lease for every item held (`0` when none is).
    pub async fn view(
        &self,
        state: &KvState,
        engine: &Engine,
        keys: Vec<Bytes>,
    ) -> Result<(u64, Vec<ViewItem>), Fail> {
        engine.room(self.rules.max_leases)?;
        let n = keys.len();
        let mut items: Vec<Option<ViewItem>> = vec![None; n];
        let mut held = Vec::new();
        let mut bytes = 0u64;
        let mut master_ttl: Option<u64> = None;
        let mut pending: Vec<usize> = (0..n).collect();
        // Looked up through the replica cache (a hot block costs no master call: its
        // entry carries the write sequence number from before its lookup). A value whose
        // range was written since, or is being written, is looked up again from the
        // master (twice at most): the master has moved it, or the write was its own put.
        for _ in 0..3 {
            if pending.is_empty() {
                break;
            }
            let ask: Vec<Bytes> = pending.iter().map(|&i| keys[i].clone()).collect();
            let located = state.store.locate_many(ask).await.map_err(fail_of)?;
            let mut again = Vec::new();
            let mut staged = Vec::new();
            for (&i, loc) in pending.iter().zip(located) {
                let loc = match loc {
                    Ok(Some(l)) => l,
                    Ok(None) => {
                        items[i] = Some(ViewItem::failed(MG_ERR_NOT_FOUND));
                        continue;
                    }
                    Err(e) => {
                        items[i] = Some(ViewItem::failed(code_of(&e)));
                        continue;
                    }
                };
                let here = match (&loc.src, self.own.get()) {
                    (Source::Memory(d), Some(own)) => state
                        .store
                        .xfer
                        .in_own_segment(d)
                        .ok()
                        .flatten()
                        .map(|(_, off)| (own, off, d.size as usize)),
                    _ => None,
                };
                let Some((own, off, len)) = here else {
                    staged.push((i, loc.src));
                    continue;
                };
                let moved = own.fence().view(off, len, loc.seq).is_err();
                // From the cache: answered only if no removal or lost master voided the
                // lists meanwhile (as a cached read is).
                let voided = loc
                    .cached_epoch()
                    .is_some_and(|e| e != state.store.places_epoch());
                if moved || voided {
                    if !moved {
                        own.fence().unview(off, len);
                    }
                    state.store.forget_replica(&keys[i]);
                    again.push(i);
                    continue;
                }
                held.push(Held::InPlace {
                    off,
                    len,
                    key: keys[i].clone(),
                });
                if loc.lease_ms > 0 {
                    master_ttl = Some(master_ttl.map_or(loc.lease_ms, |t| t.min(loc.lease_ms)));
                }
                bytes += len as u64;
                self.metrics.views[0].inc();
                items[i] = Some(ViewItem {
                    status: PLACE_IN_PLACE,
                    memory: MEMORY_SEGMENT,
                    off: off as u64,
                    len: len as u64,
                });
            }
            // Elsewhere: read into staging, 16 at once.
            let jobs: Vec<_> = staged
                .into_iter()
                .map(|(i, src)| async move { (i, self.stage(state, &src).await) })
                .collect();
            for (i, r) in
                crate::kv::client::in_order(jobs, crate::kv::client::BATCH_CONCURRENCY).await
            {
                items[i] = Some(match r {
                    Ok((slot, len)) => {
                        held.push(Held::Staged(slot));
                        bytes += len;
                        self.metrics.views[1].inc();
                        ViewItem {
                            status: PLACE_STAGED,
                            memory: MEMORY_STAGING,
                            off: slot.off as u64,
                            len,
                        }
                    }
                    Err(code) => ViewItem::failed(code),
                });
            }
            pending = again;
        }
        for i in pending {
            items[i] = Some(ViewItem::failed(MG_ERR_BUSY));
        }
        let lease = if held.is_empty() {
            0
        } else {
            let id = self.next_id();
            self.metrics.view_leases.inc();
            self.metrics.viewed_bytes.inc_by(bytes as i64);
            let renew_every = master_ttl.map(|t| {
                Duration::from_millis(t / 3)
                    .clamp(Duration::from_millis(50), Duration::from_secs(5))
            });
            let now = Instant::now();
            engine.hold().leases.insert(
                id,
                Lease {
                    deadline: now + self.rules.lease,
                    held,
                    bytes,
                    renew_every,
                    renew_at: now + renew_every.unwrap_or_default(),
                },
            );
            id
        };
        Ok((
            lease,
            items
                .into_iter()
                .map(|i| i.unwrap_or(ViewItem::failed(MG_ERR_BUSY)))
                .collect(),
        ))
    }

    /// Reads a value that is not in the own segment into a new staging slot: the slot
    /// and the value's length, or a code.
    async fn stage(&self, state: &KvState, src: &Source) -> Result<(Slot, u64), i32> {
        let Some(st) = &self.staging else {
            return Err(MG_ERR_NOT_LOCAL);
        };
        let size = src.size() as usize;
        let slot = st.alloc(size).ok_or(MG_ERR_BUSY)?;
        self.metrics.staging_bytes.set(st.used() as i64);
        // SAFETY: the slot is this call's alone until it is given back.
        let dst = unsafe { std::slice::from_raw_parts_mut(st.mem.address_of(slot.off), size) };
        match state.store.read_into(src, dst).await {
            Ok(ReadInto::Read(n)) => Ok((slot, n as u64)),
            Ok(_) => {
                self.free_staged(slot);
                Err(MG_ERR_NOT_FOUND)
            }
            Err(e) => {
                self.free_staged(slot);
                Err(code_of(&e))
            }
        }
    }

    /// Ends lease `id` of `engine`.
    pub fn release_lease(&self, engine: &Engine, id: u64) -> Result<(), Fail> {
        if id == 0 {
            return Ok(());
        }
        let l = engine
            .hold()
            .leases
            .remove(&id)
            .ok_or_else(|| no_lease("lease", id))?;
        self.release(l);
        Ok(())
    }

    /// Reserves room for `(key, len)` items: one decision and one master call for all.
    pub async fn reserve(
        &self,
        state: &KvState,
        engine: &Engine,
        items: Vec<(Bytes, u64)>,
    ) -> Result<Vec<ReserveItem>, Fail> {
        for (k, len) in &items {
            if *len == 0 || *len > state.max_value_bytes as u64 {
                return Err(Fail(
                    MG_ERR_ARG,
                    format!(
                        "{}: a value of {len} bytes (1 to kv.max_value_bytes = {})",
                        String::from_utf8_lossy(k),
                        state.max_value_bytes
                    ),
                ));
            }
        }
        engine.room(self.rules.max_leases)?;
        let n = items.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        let own_name = state.store.xfer.own_segment().map(|(name, _)| name.clone());
        let mut start = if n == 1 {
            state.store.put_start(items[0].0.clone(), items[0].1)
        } else {
            state.store.batch_put_start(
                items.iter().map(|(k, _)| k.clone()).collect(),
                items.iter().map(|(_, l)| *l).collect(),
            )
        };
        // Placed here when the policy says nothing else: the engine writes in place.
        if let Some(name) = &own_name {
            match &mut start {
                Request::PutStart(a) => a.config.preferred_segment = name.clone(),
                Request::BatchPutStart(a) => a.config.preferred_segment = name.clone(),
                _ => {}
            }
        }
        let started = Instant::now();
        let (decision, request, fixup) = match super::state::decide_start(state, start) {
            Ok(up) => up,
            Err(codes) => {
                return Ok(codes
                    .into_iter()
                    .map(|c| ReserveItem::failed(code_of(&StoreError::Refused(c))))
                    .collect());
            }
        };
        let method = if n == 1 {
            Method::PutStart
        } else {
            Method::BatchPutStart
        }
        .name();
        let allocated = match state.store.start_puts(request, fixup.as_ref(), n).await {
            Ok(a) => a,
            Err(e) => {
                decision.finish(&Outcome::of_codes(
                    method,
                    (0..n).map(|_| outcome_code(Err(&e))),
                    Some(started.elapsed()),
                ));
                return Err(fail_of(e));
            }
        };
        let mut out = Vec::with_capacity(n);
        let mut revoke = Vec::new();
        for ((key, len), a) in items.into_iter().zip(allocated) {
            let replicas = match a {
                Ok(r) => r,
                Err(c) => {
                    let e = StoreError::Refused(c);
                    decision.finish(&Outcome::of_codes(
                        method,
                        std::iter::once(outcome_code(Err(&e))),
                        Some(started.elapsed()),
                    ));
                    out.push(ReserveItem::failed(super::shm::code_of(&e)));
                    continue;
                }
            };
            match self.place(state, &replicas, len as usize).await {
                Ok((place, written, item)) => {
                    let ticket = self.next_id();
                    self.metrics.reservations.inc();
                    engine.hold().tickets.insert(
                        ticket,
                        Reservation {
                            key,
                            len: len as usize,
                            replicas,
                            written,
                            place,
                            decision: decision.clone(),
                            started,
                            deadline: Instant::now() + self.rules.lease,
                        },
                    );
                    out.push(ReserveItem { ticket, ..item });
                }
                Err(code) => {
                    revoke.push(key);
                    out.push(ReserveItem::failed(code));
                }
            }
        }
        if !revoke.is_empty() {
            let _ = state.store.revoke_puts(revoke).await;
        }
        Ok(out)
    }

    /// Where the engine writes a value the master allocated `replicas` for: the own
    /// segment's replica in place (held against views), else a staging slot.
    async fn place(
        &self,
        state: &KvState,
        replicas: &[ReplicaDescriptor],
        len: usize,
    ) -> Result<(Place, Option<usize>, ReserveItem), i32> {
        let own = replicas
            .iter()
            .enumerate()
            .find_map(|(i, r)| match &r.location {
                ReplicaLocation::Memory(m) if m.buffer_descriptor.size as usize == len => state
                    .store
                    .xfer
                    .in_own_segment(&m.buffer_descriptor)
                    .ok()
                    .flatten()
                    .map(|(_, off)| (i, off)),
                _ => None,
            });
        if let (Some((i, off)), Some(mem)) = (own, self.own.get()) {
            let seq = mem
                .hold_write_within(off, len, FENCE_WAIT)
                .await
                .map_err(|_| MG_ERR_BUSY)?;
            return Ok((
                Place::InPlace { off, seq },
                Some(i),
                ReserveItem {
                    status: PLACE_IN_PLACE,
                    memory: MEMORY_SEGMENT,
                    off: off as u64,
                    ticket: 0,
                },
            ));
        }
        let st = self.staging.as_ref().ok_or(MG_ERR_NOT_LOCAL)?;
        let slot = st.alloc(len).ok_or(MG_ERR_BUSY)?;
        self.metrics.staging_bytes.set(st.used() as i64);
        Ok((
            Place::Staged(slot),
            None,
            ReserveItem {
                status: PLACE_STAGED,
                memory: MEMORY_STAGING,
                off: slot.off as u64,
                ticket: 0,
            },
        ))
    }

    /// Commits `tickets` of `engine`: per ticket 0 or a negative code.
    pub async fn commit(&self, state: &KvState, engine: &Engine, tickets: &[u64]) -> Vec<i32> {
        let mut out = vec![0i32; tickets.len()];
        let mut taken = Vec::new();
        {
            let mut h = engine.hold();
            for (i, t) in tickets.iter().enumerate() {
                match h.tickets.remove(t) {
                    Some(r) => taken.push((i, r)),
                    None => out[i] = MG_ERR_NO_LEASE,
                }
            }
        }
        if taken.is_empty() {
            return out;
        }
        // The engine is done writing: views of the range may begin once it is stored.
        for (_, r) in &taken {
            if let (Place::InPlace { seq, .. }, Some(m)) = (&r.place, self.own.get()) {
                m.fence().end_write(*seq);
            }
        }
        let jobs: Vec<_> = taken
            .iter()
            .map(|(_, r)| async move {
                // SAFETY: the place is given back only below, after every write ended.
                let Some(value) = (unsafe { self.written(r) }) else {
                    return Err(StoreError::Unexpected);
                };
                state
                    .store
                    .write_replicas_but(&r.replicas, r.written, value)
                    .await
            })
            .collect();
        let written: Vec<Result<Stored, StoreError>> =
            crate::kv::client::in_order(jobs, crate::kv::client::BATCH_CONCURRENCY).await;
        let ending = taken
            .iter()
            .zip(written)
            .map(|((_, r), w)| (r.key.clone(), w))
            .collect();
        let ended = state.store.end_puts(ending).await;
        for (k, (i, r)) in taken.iter().enumerate() {
            if let Place::Staged(s) = r.place {
                self.free_staged(s);
            }
            self.metrics.reservations.dec();
            let result = match &ended {
                Ok(v) => v
                    .get(k)
                    .map_or(Err(&StoreError::Unexpected), |r| r.as_ref().map(|_| ())),
                Err(e) => Err(e),
            };
            r.decision.finish(&Outcome::of_codes(
                Method::PutStart.name(),
                std::iter::once(outcome_code(result)),
                Some(r.started.elapsed()),
            ));
            match result {
                Ok(()) => {
                    self.metrics.reservations_ended[0].inc();
                }
                Err(e) => {
                    self.metrics.reservations_ended[4].inc();
                    out[*i] = code_of(e);
                }
            }
        }
        out
    }

    /// Aborts `tickets` of `engine` (their puts revoked): per ticket 0 or a code.
    pub async fn abort(&self, state: &KvState, engine: &Engine, tickets: &[u64]) -> Vec<i32> {
        let mut out = vec![0i32; tickets.len()];
        let mut taken = Vec::new();
        {
            let mut h = engine.hold();
            for (i, t) in tickets.iter().enumerate() {
                match h.tickets.remove(t) {
                    Some(r) => taken.push(r),
                    None => out[i] = MG_ERR_NO_LEASE,
                }
            }
        }
        for r in &taken {
            self.end_place(r);
            self.metrics.reservations_ended[1].inc();
        }
        if !taken.is_empty() {
            let _ = state
                .store
                .revoke_puts(taken.into_iter().map(|r| r.key).collect())
                .await;
        }
        out
    }

    /// Ends what expired (leases and reservations past `kv.lease_ms`), revokes the
    /// reservations of engines that ended, and renews the master's read lease of the
    /// values viewed in place (each lease every third of the lease the master granted,
    /// 10 s by default: `--default_kv_lease_ttl`), until `shutdown`.
    pub async fn run(self: Arc<Self>, state: Arc<KvState>, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(Duration::from_millis(25));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            let now = Instant::now();
            let mut revoke: Vec<Bytes> = Vec::new();
            let engines: Vec<Arc<Engine>> = {
                let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
                live.retain(|w| w.strong_count() > 0);
                live.iter().filter_map(Weak::upgrade).collect()
            };
            let mut renew: HashSet<Bytes> = HashSet::new();
            for e in &engines {
                let (leases, tickets) = {
                    let mut h = e.hold();
                    let leases: Vec<u64> = h
                        .leases
                        .iter()
                        .filter(|(_, l)| l.deadline <= now)
                        .map(|(id, _)| *id)
                        .collect();
                    let leases: Vec<Lease> =
                        leases.iter().filter_map(|id| h.leases.remove(id)).collect();
                    let tickets: Vec<u64> = h
                        .tickets
                        .iter()
                        .filter(|(_, r)| r.deadline <= now)
                        .map(|(id, _)| *id)
                        .collect();
                    let tickets: Vec<Reservation> = tickets
                        .iter()
                        .filter_map(|id| h.tickets.remove(id))
                        .collect();
                    for l in h.leases.values_mut() {
                        let Some(every) = l.renew_every.filter(|_| l.renew_at <= now) else {
                            continue;
                        };
                        l.renew_at = now + every;
                        for held in &l.held {
                            if let Held::InPlace { key, .. } = held {
                                renew.insert(key.clone());
                            }
                        }
                    }
                    (leases, tickets)
                };
                if !leases.is_empty() {
                    tracing::debug!(leases = leases.len(), "view leases expired (kv.lease_ms)");
                }
                for l in leases {
                    self.release(l);
                }
                for r in tickets {
                    self.end_place(&r);
                    self.metrics.reservations_ended[2].inc();
                    revoke.push(r.key);
                }
            }
            drop(engines);
            let orphans =
                std::mem::take(&mut *self.orphans.lock().unwrap_or_else(|e| e.into_inner()));
            for r in orphans {
                self.metrics.reservations_ended[3].inc();
                revoke.push(r.key);
            }
            for part in revoke.chunks(state.max_batch_keys.max(1)) {
                if let Err(e) = state.store.revoke_puts(part.to_vec()).await {
                    tracing::warn!(error = %e, keys = part.len(), "revoking ended reservations failed (the master expires them itself)");
                }
            }
            if !renew.is_empty() {
                let keys: Vec<Bytes> = renew.into_iter().collect();
                for part in keys.chunks(state.max_batch_keys.max(1)) {
                    // ExistKey grants (renews) the read lease of every key it finds.
                    if let Err(e) = state.store.renew_leases(part.to_vec()).await {
                        tracing::debug!(error = %e, "renewing viewed keys' leases failed");
                    }
                }
            }
        }
    }
}

impl Engine {
    fn hold(&self) -> std::sync::MutexGuard<'_, Holdings> {
        self.holdings.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Refused when the engine holds `max` leases and reservations already.
    fn room(&self, max: usize) -> Result<(), Fail> {
        let h = self.hold();
        let held = h.leases.len() + h.tickets.len();
        if held >= max {
            return Err(Fail(
                MG_ERR_NOMEM,
                format!("{held} leases and reservations held (kv.max_leases); release some"),
            ));
        }
        Ok(())
    }

    /// Leases and reservations held now.
    pub fn held(&self) -> (usize, usize) {
        let h = self.hold();
        (h.leases.len(), h.tickets.len())
    }
}

fn no_lease(what: &str, id: u64) -> Fail {
    Fail(
        MG_ERR_NO_LEASE,
        format!(
            "no {what} {id} on this engine (released, committed, expired, or another handle's)"
        ),
    )
}

fn code_of(e: &StoreError) -> i32 {
    super::shm::code_of(e)
}

fn fail_of(e: StoreError) -> Fail {
    Fail(code_of(&e), e.to_string())
}

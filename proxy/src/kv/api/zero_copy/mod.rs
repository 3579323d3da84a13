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

use super::state::{KvState, abi_code_of as code_of, code_of as outcome_code};
use crate::codec::Method;
use crate::codec::message::Request;
use crate::codec::types::{ReplicaDescriptor, ReplicaLocation};
use crate::kv::client::{ReadInto, Source, StoreError, Stored};
use crate::kv::own::memory::Memory;
use crate::kv::own::segment::FENCE_WAIT;
use crate::kv::own::staging::{Slot, Staging};
use crate::policy::Outcome;

mod reserve;
mod view;

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

fn fail_of(e: StoreError) -> Fail {
    Fail(code_of(&e), e.to_string())
}

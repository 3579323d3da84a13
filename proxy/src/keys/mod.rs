//! What moongate knows of the keys it has seen stored, read and removed, through any
//! face: the bounded key table (size, tier, last access, hits, the arm that put it),
//! the history of why keys left it, the reasons of lookup misses, and the KV events a
//! change of the table announces.
//!
//! Fed by [`crate::answered`] (one observation per answered call, from every face);
//! read by the evictor for candidates, by the admin endpoint (`GET /keys/{key}`) and by
//! the fleet when entries change home. Knows no frame, no connection and no other
//! member: the clock is its own, callers pass what they saw.

pub mod history;
pub mod metrics;
pub mod table;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use bytes::Bytes;

use crate::calls::Seen;
use crate::codec::types::Uuid;
use crate::events::{Change, Changes, Events, What};
pub use history::{History, Why};
use metrics::KeyMetrics;
pub use table::{Adopted, Entry, KeyTable, Tier};

/// A put started this long ago that has not ended is given up (Mooncake's master
/// discards unfinished puts after 30 s, `put_start_discard_timeout_sec`): a lookup that
/// misses it forgets it. Younger ones are puts under way.
const PUT_STALE_MS: u64 = 30_000;

/// The key table, its history and what a change of them announces.
pub struct Keys {
    pub table: KeyTable,
    /// Why keys that left the table left: explains lookup misses.
    pub history: History,
    /// Bytes of puts the master denied with NO_AVAILABLE_HANDLE since the evictor last
    /// took them.
    denied_bytes: AtomicU64,
    clock: Instant,
    metrics: Arc<KeyMetrics>,
    /// KV events (`[events]` on): what the table sees stored and gone, for routers.
    events: Option<Arc<Events>>,
}

/// The table's bounds (from `[eviction]`: `max_keys`, `lease_ms`, `history_keys`).
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    pub max_keys: usize,
    pub lease_ms: u64,
    pub history_keys: usize,
}

impl Keys {
    /// An empty table; `events`: where stores and removals go when KV events are on.
    pub fn new(bounds: Bounds, metrics: Arc<KeyMetrics>, events: Option<Arc<Events>>) -> Keys {
        Keys {
            table: KeyTable::new(bounds.max_keys, bounds.lease_ms),
            history: History::new(bounds.history_keys),
            denied_bytes: AtomicU64::new(0),
            clock: Instant::now(),
            metrics,
            events,
        }
    }

    /// Milliseconds on the table's clock (entries' `last_ms` are on it).
    pub fn now_ms(&self) -> u64 {
        self.clock.elapsed().as_millis() as u64
    }

    /// The bytes of denied puts since the last call (the evictor's denial trigger).
    pub fn take_denied(&self) -> u64 {
        self.denied_bytes.swap(0, Ordering::Relaxed)
    }

    /// Publishes the table's size (after a change of many entries).
    pub fn counted(&self) {
        self.metrics.table_keys.set(self.table.len() as i64);
        self.metrics.history_keys.set(self.history.len() as i64);
    }

    /// Applies one thing seen about keys homed here (`arm`: the arm that served the
    /// call, `arm_name` its name, for miss reasons).
    pub fn apply(&self, tenant: &Bytes, client: Uuid, seen: Seen, arm: usize, arm_name: &str) {
        let now = self.now_ms();
        let arm8 = arm.min(u8::MAX as usize) as u8;
        match seen {
            Seen::Stored(keys) => {
                for (k, _, _) in &keys {
                    self.history.clear(tenant, k);
                }
                self.table.put(tenant, &keys, arm, now)
            }
            Seen::Denied(bytes) => {
                self.denied_bytes.fetch_add(bytes, Ordering::Relaxed);
            }
            Seen::Placed(keys) => self.table.placed(tenant, &keys, client),
            Seen::Completed(keys) => match &self.events {
                Some(ev) => {
                    let mut c = Changes::new(What::Stored);
                    self.table
                        .complete(tenant, keys.iter(), |k, e| c.push(e.arm, Some(e.tier), k));
                    c.send(ev);
                }
                None => self.table.complete(tenant, keys.iter(), |_, _| {}),
            },
            Seen::Found(keys) => {
                let found = keys.iter().map(|(k, tier)| (k, *tier));
                match &self.events {
                    // A key served from its SSD copy lost its memory copy to the
                    // master's own eviction: announced when seen, as a miss is.
                    Some(ev) => {
                        let mut c = Changes::new(What::Removed);
                        self.table
                            .hit(tenant, found, now, |k, e, was| c.push(e.arm, Some(was), k));
                        c.send(ev);
                    }
                    None => self.table.hit(tenant, found, now, |_, _, _| {}),
                }
            }
            Seen::Missed(keys) => self.missed(tenant, &keys, arm_name, now),
            Seen::Removed(keys) => {
                match &self.events {
                    Some(ev) => {
                        let mut c = Changes::new(What::Removed);
                        for k in &keys {
                            match self.table.take(tenant, k) {
                                Some(e) => announce_gone(&mut c, k, &e),
                                None => c.push(arm8, None, k),
                            }
                        }
                        c.send(ev);
                    }
                    None => self.table.forget(tenant, keys.iter()),
                }
                self.history
                    .note(tenant, keys.iter(), Why::removed_by_client, arm8, now);
            }
            Seen::Cleared => {
                let gone = self.table.clear(tenant);
                if let Some(ev) = &self.events {
                    ev.send(Change {
                        what: What::Cleared,
                        arm: arm8,
                        tier: None,
                        keys: Vec::new(),
                    });
                }
                self.history
                    .note(tenant, gone.iter(), Why::removed_by_client, arm8, now);
            }
        }
    }

    /// Keys an owner wrote to its SSD: the table marks them (eviction then keeps that
    /// copy), and KV events announce the new medium.
    pub fn on_disk<'a>(&self, keys: impl Iterator<Item = (&'a Bytes, &'a Bytes)>) {
        let now = self.now_ms();
        match &self.events {
            Some(ev) => {
                let mut c = Changes::new(What::Stored);
                self.table
                    .on_disk(keys, now, |k, e| c.push(e.arm, Some(Tier::LocalDisk), k));
                c.send(ev);
            }
            None => self.table.on_disk(keys, now, |_, _| {}),
        }
    }

    /// Entries another member handed over (this member is their home now).
    pub fn adopt(&self, tenant: &Bytes, items: &[Adopted]) {
        self.table.adopt(tenant, items, self.now_ms());
    }

    /// Explains lookup misses: a key the table holds was stored and is gone without
    /// moongate removing it (the master evicted it), unless moongate's evictor had sent
    /// its removal and not yet read the answer (the lookup raced the removal: it is
    /// moongate's eviction); otherwise the history says why, or it was never stored
    /// through this moongate (as far as it remembers).
    fn missed(&self, tenant: &Bytes, keys: &[Bytes], arm_name: &str, now: u64) {
        if keys.is_empty() {
            return;
        }
        let mut by_why = [0u64; history::WHYS.len()];
        let mut gone = self.events.as_ref().map(|_| Changes::new(What::Removed));
        for k in keys {
            let why = if let Some(e) = self.table.take_missed(tenant, k, now, PUT_STALE_MS) {
                // Announced when seen: it has left the table, so the evictor's own
                // departure does not announce it again.
                if let Some(c) = &mut gone {
                    c.push(e.arm, Some(e.tier), k);
                }
                let why = if e.removing {
                    Why::evicted_by_moongate
                } else {
                    Why::evicted_by_master
                };
                self.history
                    .note(tenant, std::iter::once(k), why, e.arm, now);
                why
            } else {
                self.history
                    .last(tenant, k)
                    .map_or(Why::never_stored, |e| e.why)
            };
            by_why[why as usize] += 1;
        }
        for (i, n) in by_why.into_iter().enumerate() {
            if n > 0 {
                self.metrics.missed(history::WHYS[i], arm_name, n);
            }
        }
        if let (Some(c), Some(ev)) = (gone, &self.events) {
            c.send(ev);
        }
    }

    /// Keys a policy denied at put (they never reached the master).
    pub fn refused(&self, tenant: &Bytes, keys: &[&Bytes], arm: usize) {
        let arm = arm.min(u8::MAX as usize) as u8;
        self.history.note(
            tenant,
            keys.iter().copied(),
            Why::refused_by_policy,
            arm,
            self.now_ms(),
        );
    }

    /// Entries leaving the table together (one eviction round's), announced at once by
    /// [`Keys::depart`].
    pub fn departures(&self) -> Departures {
        Departures { left: Vec::new() }
    }

    /// Forgets what left and announces it: each key the table still held (a lookup
    /// that found one gone first announced it then).
    pub fn depart(&self, d: Departures) {
        let mut gone = self.events.as_ref().map(|_| Changes::new(What::Removed));
        self.table
            .take_each(d.left.iter().map(|(t, k, s)| (t, k, *s)), |k, scope, e| {
                let Some(c) = &mut gone else { return };
                match scope {
                    Scope::Memory => c.push(e.arm, Some(Tier::Memory), k),
                    Scope::Whole => announce_gone(c, k, &e),
                }
            });
        if let (Some(c), Some(ev)) = (gone, &self.events) {
            c.send(ev);
        }
        self.counted();
    }

    /// Whether a lookup through moongate found `key` gone at the master before
    /// `before` (evicted there, or removed by a client not through moongate) and it was
    /// not stored again since: a leader that took over after `before` and lacks it has
    /// not lost it.
    pub fn gone_before(&self, tenant: &Bytes, key: &Bytes, before: Instant) -> bool {
        let before_ms = before.saturating_duration_since(self.clock).as_millis() as u64;
        self.table.get(tenant, key).is_none()
            && self
                .history
                .last(tenant, key)
                .is_some_and(|e| e.why == Why::evicted_by_master && e.at_ms < before_ms)
    }

    /// Puts of `keys` a new leader lost and moongate could not put again: gone from the
    /// table, and a lookup miss of one is explained as `lost_in_failover`.
    pub fn lost_in_failover(&self, tenant: &Bytes, keys: &[Bytes]) {
        self.table.forget(tenant, keys.iter());
        self.history
            .note(tenant, keys.iter(), Why::lost_in_failover, 0, self.now_ms());
    }

    /// Whether `key` left the table through moongate (removed by a client through it,
    /// evicted by it) and was not stored again since.
    pub fn ended_here(&self, tenant: &Bytes, key: &Bytes) -> bool {
        self.table.get(tenant, key).is_none()
            && self
                .history
                .last(tenant, key)
                .is_some_and(|e| matches!(e.why, Why::evicted_by_moongate | Why::removed_by_client))
    }

    /// What moongate knows of one key: its table entry, or why it left.
    pub fn key_state(&self, tenant: &Bytes, key: &Bytes) -> serde_json::Value {
        let now = self.now_ms();
        let entry = self.table.get(tenant, key).map(|e| {
            serde_json::json!({
                "size": e.size,
                "tier": format!("{:?}", e.tier),
                "arm": e.arm,
                "hits": e.hits,
                "last_access_ms_ago": now.saturating_sub(e.last_ms),
                "put_ended": e.complete,
            })
        });
        let last = self.history.last(tenant, key).map(|e| {
            serde_json::json!({
                "why": format!("{:?}", e.why),
                "arm": e.arm,
                "ms_ago": now.saturating_sub(e.at_ms),
            })
        });
        serde_json::json!({
            "key": String::from_utf8_lossy(key),
            "tenant": String::from_utf8_lossy(tenant),
            "stored": entry,
            "last_end": last,
        })
    }
}

/// Entries leaving the table in one go (see [`Keys::departures`]).
pub struct Departures {
    /// (tenant, key, what of it went).
    left: Vec<(Bytes, Bytes, Scope)>,
}

#[derive(Clone, Copy)]
enum Scope {
    /// The whole key: every medium it had is announced.
    Whole,
    /// Only its memory copy (a copy on an SSD stays); the table, which holds what uses
    /// memory, forgets it.
    Memory,
}

impl Departures {
    /// A whole key is gone: every medium it had is announced.
    pub fn whole(&mut self, k: &Bytes, e: &Entry) {
        self.left.push((e.tenant.clone(), k.clone(), Scope::Whole));
    }

    /// Only its memory copy is gone (a copy on an SSD stays); the table, which holds
    /// what uses memory, forgets it.
    pub fn memory(&mut self, k: &Bytes, e: &Entry) {
        self.left.push((e.tenant.clone(), k.clone(), Scope::Memory));
    }

    /// What left, by (tenant, key).
    pub fn keys(&self) -> impl ExactSizeIterator<Item = (&Bytes, &Bytes)> {
        self.left.iter().map(|(t, k, _)| (t, k))
    }
}

/// A whole key gone (removed by a client or by moongate): one event per medium it had,
/// its SSD copy included.
fn announce_gone(c: &mut Changes, k: &Bytes, e: &Entry) {
    c.push(e.arm, Some(e.tier), k);
    if e.on_disk && e.tier != Tier::LocalDisk {
        c.push(e.arm, Some(Tier::LocalDisk), k);
    }
}

//! Why a key is gone: the last thing moongate saw end each key it no longer holds in
//! its table, bounded (oldest forgotten first). A lookup miss is explained from here.
//!
//! Pure data: callers pass the time.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use bytes::Bytes;
use prometheus_client::encoding::EncodeLabelValue;

/// Why a lookup missed, as far as this moongate has seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Why {
    /// No put of it went through this moongate (as far as its history remembers).
    never_stored,
    /// moongate's evictor removed it.
    evicted_by_moongate,
    /// A client removed it (Remove, RemoveAll, a revoked put).
    removed_by_client,
    /// A policy denied its put.
    refused_by_policy,
    /// It was stored and is gone, and moongate did not remove it: the master evicted it
    /// (or its lease / soft pin ran out).
    evicted_by_master,
    /// Its put was acknowledged, a new leader of HA masters lacked it, and moongate
    /// could not vouch for its bytes to put it again (`kv.failover_window_ms`).
    lost_in_failover,
}

pub const WHYS: [Why; 6] = [
    Why::never_stored,
    Why::evicted_by_moongate,
    Why::removed_by_client,
    Why::refused_by_policy,
    Why::evicted_by_master,
    Why::lost_in_failover,
];

/// The last end moongate saw of a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    pub why: Why,
    /// The experiment arm involved (the one that evicted, denied, or put it).
    pub arm: u8,
    pub at_ms: u64,
}

type Owned = (Bytes, Bytes);

/// Keys one note may add to the queue past twice the bound before it is compacted.
const QUEUE_SLACK: usize = 4096;

/// Room for a table kept full: with keys removed and inserted all the time, a hash map
/// at its bound settles at buckets for twice its entries (hashbrown reclaims deleted
/// slots in place only below half full, else it doubles), and a queue with stale items
/// at twice its bound. Reserved the first time the table is full, its memory is flat
/// from then on rather than doubling once, minutes later; a table never filled never
/// takes it. (The hint table does the same.)
pub(crate) fn room_when_full<K, V, S, Q>(
    map: &mut HashMap<K, V, S>,
    queue: &mut VecDeque<Q>,
    queue_max: usize,
) where
    K: Eq + std::hash::Hash,
    S: std::hash::BuildHasher,
{
    map.reserve(map.len());
    queue.reserve(queue_max.saturating_sub(queue.len()));
}

/// At most `max` keys' last event, the oldest forgotten first.
pub struct History {
    max: usize,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    last: HashMap<Owned, (u64, Event), foldhash::fast::RandomState>,
    order: VecDeque<(u64, Owned)>,
    seq: u64,
    /// Whether the room for a full table was reserved ([`room_when_full`]).
    sized: bool,
}

impl History {
    pub fn new(max: usize) -> History {
        History {
            max: max.max(1),
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records that `keys` of `tenant` ended for `why`.
    pub fn note<'a>(
        &self,
        tenant: &Bytes,
        keys: impl Iterator<Item = &'a Bytes>,
        why: Why,
        arm: u8,
        at_ms: u64,
    ) {
        // Own copies, as in the key table: a frame's slice would pin its read buffer.
        let tenant = Bytes::copy_from_slice(tenant);
        let mut g = self.lock();
        for k in keys {
            g.seq += 1;
            let seq = g.seq;
            let owned = (tenant.clone(), Bytes::copy_from_slice(k));
            g.last
                .insert(owned.clone(), (seq, Event { why, arm, at_ms }));
            g.order.push_back((seq, owned));
        }
        while g.last.len() > self.max {
            let Some((seq, owned)) = g.order.pop_front() else {
                break;
            };
            // A key noted again later has a newer entry in `order`: keep it.
            if g.last.get(&owned).is_some_and(|(s, _)| *s == seq) {
                g.last.remove(&owned);
            }
        }
        if !g.sized && g.last.len() >= self.max {
            g.sized = true;
            let Inner { last, order, .. } = &mut *g;
            room_when_full(last, order, 2 * self.max + QUEUE_SLACK);
        }
        // Stale queue entries (keys noted again) would let `order` grow without bound.
        if g.order.len() > 2 * self.max {
            let Inner { last, order, .. } = &mut *g;
            order.retain(|(seq, owned)| last.get(owned).is_some_and(|(s, _)| s == seq));
        }
    }

    /// The last event of a key, if remembered.
    pub fn last(&self, tenant: &Bytes, key: &Bytes) -> Option<Event> {
        self.lock()
            .last
            .get(&(tenant.clone(), key.clone()))
            .map(|(_, e)| *e)
    }

    /// Forgets a key (it is stored again).
    pub fn clear(&self, tenant: &Bytes, key: &Bytes) {
        self.lock().last.remove(&(tenant.clone(), key.clone()));
    }

    pub fn len(&self) -> usize {
        self.lock().last.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(s: &str) -> Bytes {
        Bytes::copy_from_slice(s.as_bytes())
    }

    #[test]
    fn remembers_the_last_event_and_stays_bounded() {
        let h = History::new(3);
        let t = k("t");
        h.note(&t, [k("a"), k("b")].iter(), Why::evicted_by_moongate, 1, 10);
        h.note(&t, [k("a")].iter(), Why::removed_by_client, 0, 20);
        assert_eq!(h.last(&t, &k("a")).unwrap().why, Why::removed_by_client);
        assert_eq!(h.last(&t, &k("b")).unwrap().arm, 1);
        assert!(h.last(&k("other"), &k("a")).is_none(), "per tenant");
        for i in 0..10 {
            h.note(
                &t,
                [k(&format!("x{i}"))].iter(),
                Why::evicted_by_master,
                0,
                30,
            );
        }
        assert_eq!(h.len(), 3);
        assert!(h.last(&t, &k("a")).is_none(), "the oldest are forgotten");
        assert!(h.last(&t, &k("x9")).is_some());
        h.clear(&t, &k("x9"));
        assert!(h.last(&t, &k("x9")).is_none());
        // Noting one key over and over keeps the queue bounded too.
        for i in 0..100 {
            h.note(&t, [k("same")].iter(), Why::evicted_by_master, 0, i);
        }
        assert!(h.lock().order.len() <= 6 + 1);
    }

    #[test]
    fn a_full_history_under_churn_keeps_the_room_it_took_when_it_filled() {
        let h = History::new(1000);
        let t = k("t");
        let room = |h: &History| {
            let g = h.lock();
            (g.last.capacity(), g.order.capacity())
        };
        let note = |from: u64, to: u64| {
            for i in from..to {
                let again = k(&format!("k{}", i / 2));
                let keys = [k(&format!("n{i}")), again];
                h.note(&t, keys.iter(), Why::evicted_by_master, 0, i);
            }
        };
        // Just full (1,000 keys: n0..n666 and k0..k333).
        note(0, 667);
        assert_eq!(h.len(), 1000);
        let full = room(&h);
        // Keys forgotten and noted, and keys noted again (stale queue items), long past
        // the point where deleted slots would have made the map double.
        note(667, 50_000);
        assert_eq!(h.len(), 1000);
        // (The map's capacity counts deleted slots out: it reads less, never more.)
        let now = room(&h);
        assert!(now.0 <= full.0 && now.1 == full.1, "{full:?} -> {now:?}");
    }
}

//! Where recently read values are (`kv.replica_cache_ms`).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::codec::types::BufferDescriptor;

/// Where recently read values are, reused while the read lease the master granted with
/// the answer still has time left: within it the master neither evicts the object nor
/// removes it (unforced), so its bytes stay where the descriptor says. Each entry is
/// stamped with the upstream's places epoch from before the master was asked
/// ([`crate::upstream::Upstream::places_epoch`]) and is used only while that epoch
/// holds: a removal relayed by either face (forced ones take leased values too), a
/// master that did not answer, or a new leader voids every entry at once. A read
/// through a cached descriptor that fails drops the entry and asks the master again.
///
/// Entries hold their own bytes: a key or a descriptor decoded from a frame is a slice of
/// the buffer the frame was read into, and one kept entry would keep that whole buffer
/// (up to megabytes for a batch answer) alive. A 5-minute soak with the slices kept held
/// about 15 MB of master read buffers this way, and moongate's RSS grew with them.
/// Endpoint and protocol names repeat (one per segment), so they are interned.
pub struct ReplicaCache {
    ttl: Duration,
    entries: Mutex<Entries>,
}

struct Entries {
    map: std::collections::HashMap<Bytes, Entry>,
    /// When the map is next swept for expired entries: every quarter of the ttl, so it
    /// holds about one ttl of entries, and a map full of live ones is not scanned on
    /// every insert.
    next_sweep: Instant,
    /// Endpoint and protocol names seen, shared by the entries (at most [`NAMES`]).
    names: Vec<Bytes>,
}

/// Distinct endpoint and protocol names interned (one per segment in the pool and per
/// protocol); past this, an entry gets its own copy.
const NAMES: usize = 1024;

impl Entries {
    /// `b` as bytes of the cache's own: an interned name equal to it, else a copy.
    fn own(&mut self, b: &Bytes) -> Bytes {
        if let Some(n) = self.names.iter().find(|n| *n == b) {
            return n.clone();
        }
        let n = Bytes::copy_from_slice(b);
        if self.names.len() < NAMES {
            self.names.push(n.clone());
        }
        n
    }
}

struct Entry {
    at: BufferDescriptor,
    until: Instant,
    epoch: u64,
    /// The own segment's write sequence number read before the master was asked
    /// ([`crate::kv::own::fence::Fence::write_seq`]): a view through this entry is refused
    /// if its range was written since.
    seq: u64,
    lease_ms: u64,
}

/// A cached replica: where it is, the write sequence number from before it was looked
/// up, and the read lease the master granted with it.
#[derive(Debug, Clone)]
pub struct Hit {
    pub at: BufferDescriptor,
    pub seq: u64,
    pub lease_ms: u64,
}

/// Entries the replica cache holds at most (expired ones are swept when it is full).
const REPLICA_CACHE_ENTRIES: usize = 65_536;

impl ReplicaCache {
    /// Keeps descriptors for up to `ttl` (never longer than half the read lease).
    pub fn new(ttl: Duration) -> ReplicaCache {
        ReplicaCache {
            ttl,
            entries: Mutex::new(Entries {
                map: std::collections::HashMap::new(),
                next_sweep: Instant::now(),
                names: Vec::new(),
            }),
        }
    }

    /// Where `key` is, if an entry taken in places epoch `epoch` is still in time.
    pub fn get(&self, key: &Bytes, epoch: u64) -> Option<BufferDescriptor> {
        self.hit(key, epoch).map(|h| h.at)
    }

    /// As [`ReplicaCache::get`], with what a view needs of the entry.
    pub fn hit(&self, key: &Bytes, epoch: u64) -> Option<Hit> {
        let e = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        e.map
            .get(key)
            .filter(|v| v.epoch == epoch && v.until > Instant::now())
            .map(|v| Hit {
                at: v.at.clone(),
                seq: v.seq,
                lease_ms: v.lease_ms,
            })
    }

    /// Keeps `d` for `key` for the cache's ttl, at most half the granted lease;
    /// `epoch` and `seq` are the places epoch and the own segment's write sequence
    /// number read before the master was asked.
    pub fn put(&self, key: Bytes, d: &BufferDescriptor, lease_ttl_ms: u64, epoch: u64, seq: u64) {
        let ttl = self.ttl.min(Duration::from_millis(lease_ttl_ms / 2));
        if ttl.is_zero() {
            return;
        }
        let now = Instant::now();
        let mut e = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if now >= e.next_sweep {
            e.map.retain(|_, v| v.until > now);
            e.next_sweep = now + (self.ttl / 4).max(Duration::from_millis(10));
        }
        if e.map.len() >= REPLICA_CACHE_ENTRIES && !e.map.contains_key(&key) {
            return;
        }
        let at = BufferDescriptor {
            size: d.size,
            buffer_address: d.buffer_address,
            protocol: e.own(&d.protocol),
            transport_endpoint: e.own(&d.transport_endpoint),
        };
        e.map.insert(
            Bytes::copy_from_slice(&key),
            Entry {
                at,
                until: now + ttl,
                epoch,
                seq,
                lease_ms: lease_ttl_ms,
            },
        );
    }

    pub fn forget(&self, key: &Bytes) {
        self.entries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map
            .remove(key);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.lock().unwrap().map.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(addr: u64) -> BufferDescriptor {
        BufferDescriptor {
            size: 4096,
            buffer_address: addr,
            protocol: Bytes::from_static(b"tcp"),
            transport_endpoint: Bytes::from_static(b"127.0.0.1:1"),
        }
    }

    fn k(s: &'static str) -> Bytes {
        Bytes::from_static(s.as_bytes())
    }

    #[test]
    fn an_entry_holds_only_in_the_epoch_it_was_asked_in() {
        let c = ReplicaCache::new(Duration::from_secs(5));
        c.put(k("a"), &at(1), 10_000, 7, 0);
        assert_eq!(c.get(&k("a"), 7).map(|d| d.buffer_address), Some(1));
        // A removal (or a lost master, a new leader) advanced the epoch: void.
        assert_eq!(c.get(&k("a"), 8), None);
        // An answer asked for before the epoch moved is kept but never used.
        c.put(k("b"), &at(2), 10_000, 7, 0);
        assert_eq!(c.get(&k("b"), 8), None);
    }

    #[test]
    fn an_entry_lives_at_most_half_the_lease() {
        let c = ReplicaCache::new(Duration::from_secs(5));
        // A 2 ms lease: kept 1 ms.
        c.put(k("a"), &at(1), 2, 0, 0);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(c.get(&k("a"), 0), None);
        // No lease: not kept at all.
        c.put(k("b"), &at(1), 0, 0, 0);
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn entries_keep_no_slice_of_the_buffers_they_were_decoded_from() {
        let c = ReplicaCache::new(Duration::from_secs(5));
        // A frame's buffer, with the key and the endpoint sliced out of it.
        let frame = Bytes::from(b"key-1127.0.0.1:9tcp".to_vec());
        let d = BufferDescriptor {
            size: 1,
            buffer_address: 1,
            protocol: frame.slice(16..19),
            transport_endpoint: frame.slice(5..16),
        };
        c.put(frame.slice(0..5), &d, 10_000, 0, 0);
        c.put(frame.slice(0..4), &d, 10_000, 0, 0);
        let range = frame.as_ptr() as usize..frame.as_ptr() as usize + frame.len();
        let g = c.entries.lock().unwrap();
        for (k, v) in &g.map {
            for b in [k, &v.at.protocol, &v.at.transport_endpoint] {
                assert!(
                    !range.contains(&(b.as_ptr() as usize)),
                    "{b:?} is a slice of the frame"
                );
            }
        }
        // One copy of each name, shared.
        assert_eq!(g.names.len(), 2);
        assert_eq!(
            frame.slice(5..16),
            g.map[&frame.slice(0..5)].at.transport_endpoint
        );
    }

    #[test]
    fn expired_entries_are_swept_before_the_cache_is_full() {
        let c = ReplicaCache::new(Duration::from_millis(40));
        for i in 0..100 {
            c.put(Bytes::from(format!("k{i}")), &at(i), 600_000, 0, 0);
        }
        std::thread::sleep(Duration::from_millis(60));
        c.put(k("late"), &at(1), 600_000, 0, 0);
        assert_eq!(c.len(), 1, "the expired entries went at the next put");
    }

    #[test]
    fn a_full_cache_of_live_entries_is_not_swept_on_every_insert() {
        let c = ReplicaCache::new(Duration::from_secs(60));
        for i in 0..REPLICA_CACHE_ENTRIES {
            c.put(Bytes::from(format!("k{i}")), &at(i as u64), 600_000, 0, 0);
        }
        // The first insert past the bound sweeps (nothing expired) and is dropped; the
        // next ones wait for the next sweep instead of scanning 65,536 entries each.
        c.put(k("over"), &at(1), 600_000, 0, 0);
        let next = c.entries.lock().unwrap().next_sweep;
        assert!(next > Instant::now());
        c.put(k("over2"), &at(1), 600_000, 0, 0);
        assert_eq!(c.len(), REPLICA_CACHE_ENTRIES);
        assert_eq!(c.entries.lock().unwrap().next_sweep, next);
        // A key already held is refreshed in place.
        c.put(k("k3"), &at(99), 600_000, 1, 0);
        assert_eq!(c.get(&k("k3"), 1).map(|d| d.buffer_address), Some(99));
    }
}

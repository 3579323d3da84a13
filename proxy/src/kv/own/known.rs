//! Which keys' bytes lie untouched in the own segment, and where: what lets a view of a
//! value moongate holds skip the master (`kv.known_keys`).
//!
//! Every byte written into the segment passes through moongate (the fence's premise),
//! so moongate can tell, without asking anyone, that a range still holds what it held
//! when a key was stored into it or looked up: no write has begun over it since. An
//! entry is made when moongate ends a put into the segment (a committed reservation) or
//! when a view looked the key up at the master and found it here; it is dropped when a
//! write begins over any part of its range, when the key is removed through moongate,
//! and (all at once) when the epoch it was made in ends: a removal that can take leased
//! values, a master that did not answer, a new leader, any removal or upsert relayed by
//! the master face, an eviction round of moongate's own.
//!
//! What it does not know: a key the master evicted, or removed for a client that did
//! not go through moongate, stays known while its range is not written again. A view of
//! it answers the bytes that key was stored with (Mooncake keys name immutable values),
//! not that the pool still lists it; `exists` asks the master. An upsert by such a
//! client is not seen either (docs/kv-api.md says where to turn this off).
//!
//! Pure bookkeeping, kept under the fence's lock (a write's begin and a known entry's
//! use must not interleave): no I/O, no clock.

use std::collections::{BTreeMap, HashMap};

use bytes::Bytes;

/// One known key: its range, and the epoch the entry was made in.
struct Entry {
    start: usize,
    len: usize,
    epoch: u64,
}

/// Known keys, by key and by range start (for the writes that void them).
pub struct Known {
    limit: usize,
    by_key: HashMap<Bytes, Entry>,
    /// Range start -> (end, key). Live entries never overlap (a write over one voids
    /// it); entries of an ended epoch may, until they are met and dropped.
    by_start: BTreeMap<usize, (usize, Bytes)>,
    /// The longest range known (bounds the scan for ranges a write overlaps).
    longest: usize,
    /// The epoch of the last sweep for room: after it every entry is of that epoch, so
    /// a full table is scanned once per epoch, not on every insert.
    swept: Option<u64>,
}

impl Known {
    /// Keeps at most `limit` entries (0: none; every view asks the master).
    pub fn new(limit: usize) -> Known {
        Known {
            limit,
            by_key: HashMap::new(),
            by_start: BTreeMap::new(),
            longest: 0,
            swept: None,
        }
    }

    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    /// Where `key` lies if it is known in `epoch`; an entry of another epoch is dropped.
    pub fn get(&mut self, key: &[u8], epoch: u64) -> Option<(usize, usize)> {
        let e = self.by_key.get(key)?;
        if e.epoch == epoch {
            return Some((e.start, e.len));
        }
        self.forget(key);
        None
    }

    /// Where `key` lies if known, whatever its epoch.
    pub fn peek(&self, key: &[u8]) -> Option<(usize, usize)> {
        self.by_key.get(key).map(|e| (e.start, e.len))
    }

    /// Knows `key` at `[start, start + len)` in `epoch` (the caller checked that no write
    /// began over the range since its bytes were the key's). `false` when full.
    pub fn insert(&mut self, key: &Bytes, start: usize, len: usize, epoch: u64) -> bool {
        if self.limit == 0 {
            return false;
        }
        self.forget(key);
        self.overwritten(start, len);
        if self.by_key.len() >= self.limit && self.swept != Some(epoch) {
            // Entries of ended epochs go first; a table full of live ones takes no more.
            self.swept = Some(epoch);
            let stale: Vec<Bytes> = self
                .by_key
                .iter()
                .filter(|(_, e)| e.epoch != epoch)
                .map(|(k, _)| k.clone())
                .collect();
            for k in stale {
                self.forget(&k);
            }
        }
        if self.by_key.len() >= self.limit {
            return false;
        }
        // The entry owns its key's bytes: a key sliced from a request frame would keep
        // that whole frame alive.
        let key = Bytes::copy_from_slice(key);
        self.by_start.insert(start, (start + len, key.clone()));
        self.by_key.insert(key, Entry { start, len, epoch });
        self.longest = self.longest.max(len);
        true
    }

    /// Drops `key`.
    pub fn forget(&mut self, key: &[u8]) {
        let Some(e) = self.by_key.remove(key) else {
            return;
        };
        if self
            .by_start
            .get(&e.start)
            .is_some_and(|(_, k)| k.as_ref() == key)
        {
            self.by_start.remove(&e.start);
        }
    }

    /// Drops every key whose range overlaps `[start, start + len)`: a write begins there.
    pub fn overwritten(&mut self, start: usize, len: usize) {
        if self.by_start.is_empty() {
            return;
        }
        let end = start.saturating_add(len);
        let from = start.saturating_sub(self.longest);
        // One at a time (no list per write: this runs at every write's begin).
        while let Some(s) = self
            .by_start
            .range(from..end)
            .find(|(s, (e, _))| **s < end && *e > start)
            .map(|(&s, _)| s)
        {
            if let Some((_, k)) = self.by_start.remove(&s) {
                self.by_key.remove(&k);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(s: &str) -> Bytes {
        Bytes::copy_from_slice(s.as_bytes())
    }

    #[test]
    fn a_write_over_any_part_of_a_range_forgets_its_key_and_only_it() {
        let mut n = Known::new(16);
        assert!(n.insert(&k("a"), 0, 100, 1));
        assert!(n.insert(&k("b"), 100, 50, 1));
        assert!(n.insert(&k("c"), 200, 10, 1));
        n.overwritten(149, 1);
        assert_eq!(n.get(b"a", 1), Some((0, 100)));
        assert_eq!(n.get(b"b", 1), None);
        assert_eq!(n.get(b"c", 1), Some((200, 10)));
        n.overwritten(150, 50); // between: touches neither
        assert_eq!(n.len(), 2);
        n.overwritten(0, 1000);
        assert!(n.is_empty());
    }

    #[test]
    fn another_epoch_is_unknown_and_a_key_known_again_moves() {
        let mut n = Known::new(16);
        n.insert(&k("a"), 0, 100, 1);
        assert_eq!(n.get(b"a", 2), None);
        assert!(n.is_empty(), "dropped when met");
        n.insert(&k("a"), 0, 100, 2);
        n.insert(&k("a"), 500, 100, 2);
        assert_eq!(n.get(b"a", 2), Some((500, 100)));
        n.overwritten(0, 100);
        assert_eq!(n.get(b"a", 2), Some((500, 100)), "its old range is not its");
        // A key stored over another's range takes it.
        n.insert(&k("b"), 550, 10, 2);
        assert_eq!(n.get(b"a", 2), None);
        assert_eq!(n.get(b"b", 2), Some((550, 10)));
    }

    #[test]
    fn bounded_stale_entries_make_room_live_ones_do_not() {
        let mut n = Known::new(2);
        assert!(n.insert(&k("a"), 0, 10, 1));
        assert!(n.insert(&k("b"), 10, 10, 1));
        assert!(!n.insert(&k("c"), 20, 10, 1), "full of live entries");
        assert!(n.insert(&k("c"), 20, 10, 2), "epoch 1's entries made room");
        assert_eq!(n.len(), 1);
        let mut off = Known::new(0);
        assert!(!off.insert(&k("a"), 0, 10, 1));
        assert_eq!(off.get(b"a", 1), None);
    }
}

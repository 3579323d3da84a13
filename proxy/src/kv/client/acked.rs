//! The puts this moongate acknowledged lately and where their bytes lie: what a new
//! leader may lack. An HA leader answers `PutEnd` before its oplog has reached the
//! standby (or etcd, while etcd is down), so a leader change can forget puts that were
//! acknowledged in the seconds before it. [`super::failover`] checks these against the
//! new leader and puts again the ones whose bytes moongate can vouch for.
//!
//! A put is followed from its `PutStart` answer (its memory replica) to its
//! `PutEnd(ALL)` (acknowledged: kept for `window`) or its revoke (dropped); a removal
//! through moongate drops it. Bounded: at most `limit` puts in flight and `limit`
//! acknowledged; the oldest acknowledged one makes room and is counted
//! ([`Acked::pushed_out`]).
//!
//! Pure bookkeeping: callers pass the time; no I/O.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::codec::types::BufferDescriptor;

/// Where one put's bytes lie, as far as moongate can vouch for them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Where {
    /// In moongate's own segment: the fence keeps the range's key until a write begins
    /// over it (`Fence::held`).
    Own(BufferDescriptor),
    /// In another segment, with the xxh3-64 of the value when it passed through
    /// moongate whole or streamed (`None`: an engine wrote it elsewhere itself).
    Elsewhere(BufferDescriptor, Option<u64>),
    /// No memory replica (a disk-only put): nothing to read back.
    Nowhere,
}

/// A put followed from its start.
#[derive(Debug, Clone)]
struct Started {
    at: Instant,
    bytes: Where,
}

/// An acknowledged put.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub at: Instant,
    pub bytes: Where,
}

pub struct Acked {
    window: Duration,
    limit: usize,
    started: HashMap<Bytes, Started>,
    by_key: HashMap<Bytes, Entry>,
    /// Acknowledgement order; an element whose key was acknowledged again (or removed)
    /// since is skipped when met.
    order: VecDeque<(Instant, Bytes)>,
    pushed_out: u64,
    untracked: u64,
}

impl Acked {
    /// Keeps puts acknowledged within `window`, at most `limit` of them.
    pub fn new(window: Duration, limit: usize) -> Acked {
        Acked {
            window,
            limit: limit.max(1),
            started: HashMap::new(),
            by_key: HashMap::new(),
            order: VecDeque::new(),
            pushed_out: 0,
            untracked: 0,
        }
    }

    pub fn window(&self) -> Duration {
        self.window
    }

    /// The master allocated `key`'s replicas; `bytes` says where its memory replica is.
    pub fn started(&mut self, key: &[u8], bytes: Where, now: Instant) {
        if self.started.len() >= self.limit && !self.started.contains_key(key) {
            // Puts whose end was never heard (a connection lost mid-put) go first: no
            // put takes a whole window.
            let window = self.window;
            self.started
                .retain(|_, s| now.duration_since(s.at) < window);
            if self.started.len() >= self.limit {
                self.untracked += 1;
                return;
            }
        }
        self.started
            .insert(Bytes::copy_from_slice(key), Started { at: now, bytes });
    }

    /// Whether `key`'s value should be hashed as it passes: it is followed and its
    /// memory replica is in another segment.
    pub fn wants_hash(&self, key: &[u8]) -> bool {
        self.started
            .get(key)
            .is_some_and(|s| matches!(s.bytes, Where::Elsewhere(..)))
    }

    /// The xxh3-64 of `key`'s value, computed as it passed.
    pub fn vouch(&mut self, key: &[u8], hash: u64) {
        if let Some(Started {
            bytes: Where::Elsewhere(_, h),
            ..
        }) = self.started.get_mut(key)
        {
            *h = Some(hash);
        }
    }

    /// The put of `key` was revoked: nothing to keep.
    pub fn revoked(&mut self, key: &[u8]) {
        self.started.remove(key);
    }

    /// The master acknowledged `key`'s put: kept until `now + window`. Where its bytes
    /// lie, when the put was followed.
    pub fn ended(&mut self, key: &[u8], now: Instant) -> Option<Where> {
        let (key, s) = self.started.remove_entry(key)?;
        self.expire(now);
        // A key acknowledged again replaces its entry (its old place in `order` is
        // skipped when met).
        self.by_key.remove(&key);
        while self.by_key.len() >= self.limit {
            let Some((at, k)) = self.order.pop_front() else {
                break;
            };
            if self.by_key.get(&k).is_some_and(|e| e.at == at) {
                self.by_key.remove(&k);
                self.pushed_out += 1;
            }
        }
        if self.order.len() >= 2 * self.limit {
            // Keys acknowledged again (removed and put anew) leave stale elements.
            let by_key = &self.by_key;
            self.order
                .retain(|(at, k)| by_key.get(k).is_some_and(|e| e.at == *at));
        }
        self.order.push_back((now, key.clone()));
        self.by_key.insert(
            key,
            Entry {
                at: now,
                bytes: s.bytes.clone(),
            },
        );
        Some(s.bytes)
    }

    /// `key` was removed through moongate: never to be put again.
    pub fn removed(&mut self, key: &[u8]) {
        self.by_key.remove(key);
        self.started.remove(key);
    }

    /// Whether `key`'s put was acknowledged within the window of `now`.
    pub fn kept(&self, key: &[u8], now: Instant) -> bool {
        self.by_key
            .get(key)
            .is_some_and(|e| now.duration_since(e.at) < self.window)
    }

    /// Every key kept now, with when it was acknowledged (for [`Acked::forget_if`]).
    pub fn keys(&self) -> Vec<(Bytes, Instant)> {
        self.by_key.iter().map(|(k, e)| (k.clone(), e.at)).collect()
    }

    /// Drops `key` if it is still the put acknowledged at `at` (not acknowledged again
    /// since); whether it was.
    pub fn forget_if(&mut self, key: &[u8], at: Instant) -> bool {
        if self.by_key.get(key).is_some_and(|e| e.at == at) {
            self.by_key.remove(key);
            true
        } else {
            false
        }
    }

    /// Drops what was acknowledged before `now - window`.
    fn expire(&mut self, now: Instant) {
        while let Some((at, _)) = self.order.front() {
            if now.duration_since(*at) < self.window {
                break;
            }
            if let Some((at, k)) = self.order.pop_front()
                && self.by_key.get(&k).is_some_and(|e| e.at == at)
            {
                self.by_key.remove(&k);
            }
        }
    }

    /// The puts acknowledged at or after `from` (and within the window of `now`),
    /// oldest first.
    pub fn since(&mut self, from: Instant, now: Instant) -> Vec<(Bytes, Entry)> {
        self.expire(now);
        self.order
            .iter()
            .filter(|(at, _)| *at >= from)
            .filter_map(|(at, k)| {
                self.by_key
                    .get(k)
                    .filter(|e| e.at == *at)
                    .map(|e| (k.clone(), e.clone()))
            })
            .collect()
    }

    /// Acknowledged puts kept now.
    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    /// Acknowledged puts dropped before their window ended, to make room.
    pub fn pushed_out(&self) -> u64 {
        self.pushed_out
    }

    /// Puts not followed at all: too many were in flight at once.
    pub fn untracked(&self) -> u64 {
        self.untracked
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(addr: u64) -> BufferDescriptor {
        BufferDescriptor {
            protocol: Bytes::from_static(b"tcp"),
            transport_endpoint: Bytes::from_static(b"seg"),
            buffer_address: addr,
            size: 10,
        }
    }

    #[test]
    fn a_put_is_kept_from_its_end_for_the_window_and_a_revoke_or_removal_drops_it() {
        let t = Instant::now();
        let s = Duration::from_secs(1);
        let mut a = Acked::new(Duration::from_secs(30), 16);
        a.started(b"a", Where::Own(desc(0)), t);
        a.started(b"b", Where::Elsewhere(desc(10), None), t);
        a.started(b"c", Where::Nowhere, t);
        assert!(a.wants_hash(b"b") && !a.wants_hash(b"a"));
        a.vouch(b"b", 42);
        a.revoked(b"c");
        assert_eq!(a.ended(b"c", t + s), None, "revoked: never acknowledged");
        assert_eq!(a.ended(b"a", t + s), Some(Where::Own(desc(0))));
        assert_eq!(
            a.ended(b"b", t + 2 * s),
            Some(Where::Elsewhere(desc(10), Some(42)))
        );
        let keys = |v: Vec<(Bytes, Entry)>| v.into_iter().map(|(k, _)| k).collect::<Vec<_>>();
        assert_eq!(keys(a.since(t, t + 3 * s)), [&b"a"[..], b"b"]);
        assert_eq!(keys(a.since(t + 2 * s, t + 3 * s)), [&b"b"[..]]);
        a.removed(b"a");
        assert_eq!(keys(a.since(t, t + 3 * s)), [&b"b"[..]]);
        // Past the window: gone.
        assert!(a.since(t, t + 33 * s).is_empty());
        assert!(a.is_empty());
    }

    #[test]
    fn a_key_is_kept_for_the_window_after_its_acknowledgement_only() {
        let t = Instant::now();
        let s = Duration::from_secs(1);
        let mut a = Acked::new(Duration::from_secs(30), 16);
        a.started(b"k", Where::Nowhere, t);
        assert!(!a.kept(b"k", t), "started, not acknowledged");
        a.ended(b"k", t + s);
        assert!(a.kept(b"k", t + 2 * s) && !a.kept(b"other", t + 2 * s));
        assert!(!a.kept(b"k", t + 31 * s), "the window ended");
    }

    #[test]
    fn a_key_is_forgotten_only_as_the_put_it_was() {
        let mut a = Acked::new(Duration::from_secs(30), 10);
        let t0 = Instant::now();
        a.started(b"k", Where::Nowhere, t0);
        a.ended(b"k", t0);
        let (k, at) = a.keys().pop().unwrap();
        // Acknowledged again since: the older listing does not drop it.
        let t1 = t0 + Duration::from_millis(1);
        a.started(b"k", Where::Nowhere, t1);
        a.ended(b"k", t1);
        assert!(!a.forget_if(&k, at));
        assert_eq!(a.len(), 1);
        assert!(a.forget_if(&k, t1));
        assert!(a.is_empty());
        assert!(a.since(t0, t1).is_empty());
    }

    #[test]
    fn bounded_the_oldest_makes_room_and_a_key_put_again_counts_once() {
        let t = Instant::now();
        let ms = Duration::from_millis(1);
        let mut a = Acked::new(Duration::from_secs(30), 2);
        for (i, k) in [&b"a"[..], b"b", b"a", b"c"].into_iter().enumerate() {
            a.started(k, Where::Nowhere, t);
            a.ended(k, t + ms * i as u32);
        }
        // a (again at 2) and c remain: b made room.
        let v = a.since(t, t + ms * 10);
        assert_eq!(
            v.iter().map(|(k, _)| &k[..]).collect::<Vec<_>>(),
            [&b"a"[..], b"c"]
        );
        assert_eq!(a.pushed_out(), 1);
        assert_eq!(a.len(), 2);
        // Puts in flight are bounded too; stale ones make room.
        a.started(b"x", Where::Nowhere, t);
        a.started(b"y", Where::Nowhere, t);
        a.started(b"z", Where::Nowhere, t);
        assert_eq!(a.untracked(), 1);
        a.started(b"z", Where::Nowhere, t + Duration::from_secs(31));
        assert_eq!(a.untracked(), 1, "the stale ones made room");
        assert!(a.ended(b"z", t + Duration::from_secs(31)).is_some());
    }
}

//! What one owner holds staged for this moongate's ranks: every read it answered and was
//! not yet told to release, with its bytes and when the owner frees it on its own (its
//! ttl), the parts behind each batch id moongate made up for a read it cut, and the
//! bytes of parts on their way (reserved). Pure: the clock is passed in.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Batch ids moongate makes for cut reads: the top bit set, which an owner's own
/// counter (from 1) never reaches.
pub const SYNTHETIC: u64 = 1 << 63;

struct Batch {
    bytes: u64,
    expires: Instant,
    /// The owner's ids behind a made-up id (empty: the id is the owner's own).
    parts: Vec<u64>,
}

/// What a release names.
#[derive(Debug, PartialEq, Eq)]
pub enum Named {
    /// The owner's own batch (or one moongate does not know: relayed as it came).
    Owners,
    /// A batch moongate made: release these of the owner's.
    Parts(Vec<u64>),
    /// A made-up id that expired or was never given.
    Unknown,
}

pub struct Staged {
    batches: HashMap<u64, Batch>,
    max_batches: usize,
    next: u64,
    staged: u64,
    reserved: u64,
}

impl Staged {
    /// `max_batches`: batches remembered at most (past it the one expiring soonest is
    /// forgotten: its bytes stop counting, and the owner frees it at its ttl anyway).
    pub fn new(max_batches: usize) -> Staged {
        Staged {
            batches: HashMap::new(),
            max_batches: max_batches.max(1),
            next: 0,
            staged: 0,
            reserved: 0,
        }
    }

    /// Bytes answered and not released (nor expired at the last sweep).
    pub fn staged(&self) -> u64 {
        self.staged
    }

    /// Takes room for a part of `bytes` under `limit` (0: no limit). Granted when it
    /// fits, or when nothing else is staged or reserved (a part larger than the limit
    /// goes alone rather than never).
    pub fn try_reserve(&mut self, bytes: u64, limit: u64) -> bool {
        let used = self.staged + self.reserved;
        if limit == 0 || used == 0 || used.saturating_add(bytes) <= limit {
            self.reserved += bytes;
            true
        } else {
            false
        }
    }

    /// Takes room whatever the limit (the read waited long enough).
    pub fn force_reserve(&mut self, bytes: u64) {
        self.reserved += bytes;
    }

    /// Gives a reservation back (its part answered, or failed).
    pub fn unreserve(&mut self, bytes: u64) {
        self.reserved = self.reserved.saturating_sub(bytes);
    }

    /// Forgets batches past their ttl; the bytes freed.
    pub fn sweep(&mut self, now: Instant) -> u64 {
        let before = self.staged;
        let mut freed = 0;
        self.batches.retain(|_, b| {
            let keep = b.expires > now;
            if !keep {
                freed += b.bytes;
            }
            keep
        });
        self.staged = before - freed;
        freed
    }

    fn insert(&mut self, id: u64, b: Batch, now: Instant) -> u64 {
        let mut freed = 0;
        if let Some(old) = self.batches.remove(&id) {
            // The owner reused an id (it restarted): the old batch is gone.
            self.staged -= old.bytes;
            freed += old.bytes;
        }
        if self.batches.len() >= self.max_batches {
            freed += self.sweep(now);
        }
        if self.batches.len() >= self.max_batches
            && let Some((&soonest, _)) = self.batches.iter().min_by_key(|(_, b)| b.expires)
            && let Some(old) = self.batches.remove(&soonest)
        {
            self.staged -= old.bytes;
            freed += old.bytes;
        }
        self.staged += b.bytes;
        self.batches.insert(id, b);
        freed
    }

    /// The owner staged a whole read as its batch `id`; the bytes freed to make room in
    /// the table (normally 0).
    pub fn record(&mut self, id: u64, bytes: u64, ttl: Duration, now: Instant) -> u64 {
        let b = Batch {
            bytes,
            expires: now + ttl,
            parts: Vec::new(),
        };
        self.insert(id, b, now)
    }

    /// The owner staged a cut read as `parts`: the id to answer the rank with, and the
    /// bytes freed to make room in the table.
    pub fn record_parts(
        &mut self,
        parts: Vec<u64>,
        bytes: u64,
        ttl: Duration,
        now: Instant,
    ) -> (u64, u64) {
        self.next = (self.next + 1) & !SYNTHETIC;
        let id = SYNTHETIC | self.next;
        let b = Batch {
            bytes,
            expires: now + ttl,
            parts,
        };
        (id, self.insert(id, b, now))
    }

    /// A release of `id`: what to release at the owner; the bytes no longer staged.
    pub fn release(&mut self, id: u64) -> (Named, u64) {
        match self.batches.remove(&id) {
            Some(b) => {
                self.staged -= b.bytes;
                let named = if b.parts.is_empty() {
                    Named::Owners
                } else {
                    Named::Parts(b.parts)
                };
                (named, b.bytes)
            }
            None if id & SYNTHETIC != 0 => (Named::Unknown, 0),
            None => (Named::Owners, 0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(5);

    #[test]
    fn reads_stage_releases_free_and_the_ttl_forgets() {
        let t = Instant::now();
        let mut s = Staged::new(16);
        assert_eq!(s.record(1, 100, TTL, t), 0);
        let (id, _) = s.record_parts(vec![2, 3], 300, TTL, t);
        assert!(id & SYNTHETIC != 0);
        assert_eq!(s.staged(), 400);
        assert_eq!(s.release(id), (Named::Parts(vec![2, 3]), 300));
        assert_eq!(s.release(id), (Named::Unknown, 0));
        assert_eq!(s.release(77), (Named::Owners, 0));
        assert_eq!(s.staged(), 100);
        assert_eq!(s.sweep(t + TTL), 100);
        assert_eq!(s.staged(), 0);
        assert_eq!(s.release(1), (Named::Owners, 0));
    }

    #[test]
    fn room_is_reserved_under_the_limit_and_a_lone_large_part_goes() {
        let t = Instant::now();
        let mut s = Staged::new(16);
        assert!(s.try_reserve(500, 100), "nothing else staged: goes alone");
        assert!(!s.try_reserve(1, 100));
        s.unreserve(500);
        s.record(1, 60, TTL, t);
        assert!(s.try_reserve(40, 100));
        assert!(!s.try_reserve(1, 100));
        assert!(s.try_reserve(1, 0), "0: no limit");
        s.force_reserve(1000);
        s.unreserve(1041);
        s.release(1);
        assert!(s.try_reserve(100, 100));
    }

    #[test]
    fn the_table_is_bounded() {
        let t = Instant::now();
        let mut s = Staged::new(2);
        s.record(1, 10, Duration::from_secs(1), t);
        s.record(2, 20, TTL, t);
        // Full: the batch expiring soonest goes.
        assert_eq!(s.record(3, 30, TTL, t), 10);
        assert_eq!(s.staged(), 50);
        assert_eq!(s.release(1), (Named::Owners, 0));
        // An id the owner reuses replaces its old batch.
        assert_eq!(s.record(2, 5, TTL, t), 20);
        assert_eq!(s.staged(), 35);
    }
}

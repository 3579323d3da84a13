//! The hint table: what the serving stack said of keys and blocks, bounded in entries
//! and in bytes. Pure: no clock (times are passed in, in ms), no sockets, no JSON.
//!
//! One entry per name (a key in a tenant, or a block hash); a newer hint of a name
//! replaces the older one, whatever its kind, but for one case: a router announces a
//! block again for each queued request that reads it. A later `upcoming` must not hide
//! the earlier read still to come, nor the earlier one, once due, the later: the entry
//! keeps the pending read's due time (and announcement), and once that is due it shows
//! the latest read announced (the reads in between are not kept).
//!
//! How long a hint holds is by what it says, not by a clock ([`in_force`]): a `done`
//! hint until its block is read or stored again (a plugin sees the block's age fall
//! below the hint's); an `upcoming` or `expect` one until it is due and then for one
//! turnover of the cache (the slack: how long the blocks evicted now had gone unread),
//! since a read a little late is still worth the block's room for as long as the cache
//! keeps any block unread. The live table and the simulator apply the same rule.
//! Entries leave when an operator's cap (`expires_ms`) passes (checked on read, swept
//! on write) or, the table full by count or bytes, oldest first.

use std::collections::{HashMap, VecDeque};
use std::mem::size_of;
use std::sync::Arc;

use bytes::Bytes;

/// What a hint names: a key as a client stores it, or a block as the KV events and the
/// policy's `block-keys` / `block-refs` name it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Name {
    Key {
        tenant: Bytes,
        key: Bytes,
    },
    /// A 64-bit block hash (vLLM's int form).
    Block(u64),
    /// A block hash of another width (a digest's bytes, 1 to 64).
    Digest(Bytes),
}

/// What is known of a name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// It will be read soon (a router has the request queued).
    Upcoming,
    /// Its session ended: that session will not read it again.
    Done,
    /// A next turn that reads it is expected (an agent waiting on a tool).
    Expect,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Upcoming, Kind::Done, Kind::Expect];

    /// The `kind` in the API and the metrics' label.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Upcoming => "upcoming",
            Kind::Done => "done",
            Kind::Expect => "expect",
        }
    }
}

/// One hint as the table keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hint {
    pub kind: Kind,
    /// When it was received (ms, the caller's clock).
    pub at_ms: u64,
    /// `upcoming`: when the read is expected; `expect`: by when the next turn comes;
    /// `done`: when it was said.
    pub due_ms: u64,
    /// When the table forgets it whatever it says (an operator's cap; `u64::MAX`: none).
    pub expires_ms: u64,
    /// The session or tenant it was said for, when the caller named one.
    pub session: Option<Arc<str>>,
}

/// Whether an `upcoming` or `expect` hint last due at `due_ms` is in force at `now_ms`:
/// until it is due, then for `slack_ms`, the cache's turnover; with no turnover known
/// (nothing evicted yet, so nothing is lost by keeping it), until the table's bounds or
/// the operator's cap push it out.
pub fn in_force(due_ms: u64, now_ms: u64, slack_ms: Option<u64>) -> bool {
    slack_ms.is_none_or(|s| now_ms < due_ms.saturating_add(s))
}

/// What one entry is reckoned to hold besides its name's bytes: the name twice (map
/// and queue; the bytes behind them are shared), the hint, the sequence numbers and the
/// map's slot. An estimate, so that `max_bytes` bounds what the table holds in order of
/// magnitude, not to the byte.
pub const ENTRY_OVERHEAD: usize = 2 * size_of::<Name>() + size_of::<Hint>() + 4 * 8;

/// The bytes an entry of `name` is reckoned to hold.
pub fn entry_bytes(name: &Name) -> usize {
    ENTRY_OVERHEAD
        + match name {
            Name::Key { tenant, key } => tenant.len() + key.len(),
            Name::Block(_) => 0,
            Name::Digest(d) => d.len(),
        }
}

/// The table: `cap` entries and `max_bytes` ([`entry_bytes`]) at most.
#[derive(Debug)]
pub struct Table {
    cap: usize,
    max_bytes: usize,
    /// What the entries are reckoned to hold.
    bytes: usize,
    /// Per name: its hint, the sequence number of its insertion, and for `upcoming` the
    /// latest read announced (its `due_ms` otherwise).
    entries: HashMap<Name, (Hint, u64, u64)>,
    /// Names in insertion order with the sequence number of that insertion: an entry
    /// replaced since leaves a stale item here, skipped (and compacted away).
    order: VecDeque<(u64, Name)>,
    next: u64,
    /// Whether the room for a full table was reserved
    /// ([`crate::keys::history::room_when_full`]).
    sized: bool,
}

/// What an insert did besides inserting.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Inserted {
    /// Live entries pushed out because the table was full (by count or bytes).
    pub dropped: u64,
    /// Expired entries swept.
    pub expired: u64,
}

impl Table {
    pub fn new(cap: usize, max_bytes: usize) -> Table {
        Table {
            cap: cap.max(1),
            max_bytes: max_bytes.max(ENTRY_OVERHEAD),
            bytes: 0,
            entries: HashMap::new(),
            order: VecDeque::new(),
            next: 0,
            sized: false,
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// What the entries are reckoned to hold ([`entry_bytes`]).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The hint of `name` in force at `now_ms` ([`in_force`], with the cache's turnover
    /// `slack_ms`): an `upcoming` one whose pending read is due shows the latest read
    /// announced, if one is still to come.
    pub fn get(&self, name: &Name, now_ms: u64, slack_ms: Option<u64>) -> Option<Hint> {
        let (h, _, then) = self.entries.get(name)?;
        if h.expires_ms <= now_ms {
            return None;
        }
        let last_due = match h.kind {
            Kind::Done => None,
            Kind::Upcoming => Some(h.due_ms.max(*then)),
            Kind::Expect => Some(h.due_ms),
        };
        if last_due.is_some_and(|due| !in_force(due, now_ms, slack_ms)) {
            return None;
        }
        let mut h = h.clone();
        if h.kind == Kind::Upcoming && h.due_ms <= now_ms && *then > now_ms {
            h.due_ms = *then;
        }
        Some(h)
    }

    /// Records `hint` for `name` (replacing any), sweeping what expired by `now_ms` from
    /// the oldest end and, when full, pushing out the oldest live entries.
    pub fn insert(&mut self, name: Name, mut hint: Hint, now_ms: u64) -> Inserted {
        let mut out = Inserted::default();
        let mut then = hint.due_ms;
        if hint.kind == Kind::Upcoming
            && let Some((old, _, old_then)) = self.entries.get(&name)
            && old.kind == Kind::Upcoming
            && old.expires_ms > now_ms
        {
            then = then.max(*old_then);
            if old.due_ms > now_ms && old.due_ms < hint.due_ms {
                hint.due_ms = old.due_ms;
                hint.at_ms = old.at_ms;
            }
            hint.expires_ms = hint.expires_ms.max(old.expires_ms);
        }
        // Sweep the oldest end: stale items, and entries already expired.
        while let Some((seq, front)) = self.order.front() {
            match self.entries.get(front) {
                Some((h, s, _)) if s == seq => {
                    if h.expires_ms > now_ms {
                        break;
                    }
                    self.entries.remove(front);
                    self.bytes -= entry_bytes(front);
                    out.expired += 1;
                }
                _ => {}
            }
            self.order.pop_front();
        }
        let replacing = self.entries.contains_key(&name);
        let cost = entry_bytes(&name);
        let full = |t: &Table| t.entries.len() >= t.cap || t.bytes + cost > t.max_bytes;
        if !replacing && !self.sized && full(self) {
            // Full by count or by bytes: from here on entries are pushed out and inserted.
            self.sized = true;
            crate::keys::history::room_when_full(
                &mut self.entries,
                &mut self.order,
                2 * self.cap + 1,
            );
        }
        while !replacing && full(self) {
            let Some((seq, front)) = self.order.pop_front() else {
                break;
            };
            if self.entries.get(&front).is_some_and(|(_, s, _)| *s == seq) {
                self.entries.remove(&front);
                self.bytes -= entry_bytes(&front);
                out.dropped += 1;
            }
        }
        if !replacing {
            self.bytes += cost;
        }
        let seq = self.next;
        self.next += 1;
        self.order.push_back((seq, name.clone()));
        self.entries.insert(name, (hint, seq, then));
        // Replacements leave stale items: keep the queue within twice the table.
        if self.order.len() > 2 * self.cap {
            let entries = &self.entries;
            self.order
                .retain(|(seq, n)| entries.get(n).is_some_and(|(_, s, _)| s == seq));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(k: &str) -> Name {
        Name::Key {
            tenant: Bytes::from_static(b"default"),
            key: Bytes::copy_from_slice(k.as_bytes()),
        }
    }

    fn hint(kind: Kind, at: u64, ttl: u64) -> Hint {
        Hint {
            kind,
            at_ms: at,
            due_ms: at,
            expires_ms: at.saturating_add(ttl),
            session: None,
        }
    }

    #[test]
    fn a_newer_hint_replaces_an_older_one_and_expired_ones_are_not_read() {
        let mut t = Table::new(8, usize::MAX);
        t.insert(key("a"), hint(Kind::Upcoming, 0, 100), 0);
        t.insert(key("a"), hint(Kind::Done, 10, 100), 10);
        assert_eq!(t.len(), 1);
        assert_eq!(t.get(&key("a"), 50, None).map(|h| h.kind), Some(Kind::Done));
        assert_eq!(t.get(&key("a"), 110, None), None, "expired at 110");
        assert_eq!(t.get(&Name::Block(7), 0, None), None);
    }

    #[test]
    fn a_later_upcoming_read_keeps_the_pending_ones_due_time() {
        let mut t = Table::new(8, usize::MAX);
        let up = |at: u64, due: u64| Hint {
            due_ms: due,
            ..hint(Kind::Upcoming, at, due - at + 100)
        };
        t.insert(key("a"), up(0, 50), 0);
        t.insert(key("a"), up(10, 80), 10);
        let h = t.get(&key("a"), 20, None).unwrap();
        assert_eq!((h.at_ms, h.due_ms, h.expires_ms), (0, 50, 180));
        // The pending read is due: the later one shows (announced as the first).
        let h = t.get(&key("a"), 50, None).unwrap();
        assert_eq!((h.at_ms, h.due_ms), (0, 80));
        // Past every read announced: due (kept until it expires).
        assert_eq!(t.get(&key("a"), 100, None).unwrap().due_ms, 50);
        // Once the pending read is due, a new announcement takes its place.
        t.insert(key("a"), up(60, 90), 60);
        let h = t.get(&key("a"), 60, None).unwrap();
        assert_eq!((h.at_ms, h.due_ms), (60, 90));
        // Any other kind replaces it at once.
        t.insert(key("a"), hint(Kind::Done, 70, 100), 70);
        assert_eq!(t.get(&key("a"), 70, None).map(|h| h.kind), Some(Kind::Done));
    }

    #[test]
    fn a_full_table_under_churn_keeps_the_room_it_took_when_it_filled() {
        let mut t = Table::new(1000, usize::MAX);
        let room = |t: &Table| (t.entries.capacity(), t.order.capacity());
        for i in 0..1001u64 {
            t.insert(key(&format!("a{i}")), hint(Kind::Done, i, u64::MAX / 2), i);
        }
        let full = room(&t);
        for i in 0..50_000u64 {
            // New names push out the oldest; names hinted again leave stale queue items.
            t.insert(key(&format!("b{i}")), hint(Kind::Done, i, u64::MAX / 2), i);
            t.insert(
                key(&format!("b{}", i / 2)),
                hint(Kind::Done, i, u64::MAX / 2),
                i,
            );
        }
        assert_eq!(t.len(), 1000);
        let now = room(&t);
        // (The map's capacity counts deleted slots out: it reads less, never more.)
        assert!(now.0 <= full.0 && now.1 == full.1, "{full:?} -> {now:?}");
    }

    #[test]
    fn the_table_stays_within_its_cap_oldest_out_first_and_sweeps_what_expired() {
        let mut t = Table::new(3, usize::MAX);
        for (i, k) in ["a", "b", "c"].iter().enumerate() {
            t.insert(key(k), hint(Kind::Upcoming, i as u64, 1000), i as u64);
        }
        let r = t.insert(key("d"), hint(Kind::Upcoming, 3, 1000), 3);
        assert_eq!(r.dropped, 1);
        assert_eq!(t.len(), 3);
        assert!(t.get(&key("a"), 3, None).is_none() && t.get(&key("d"), 3, None).is_some());
        // Everything expired by 5000: swept on the next insert, nothing pushed out.
        let r = t.insert(Name::Block(1), hint(Kind::Done, 5000, 10), 5000);
        assert_eq!((r.dropped, r.expired), (0, 3));
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn replacing_one_name_many_times_keeps_the_queue_bounded() {
        let mut t = Table::new(4, usize::MAX);
        for i in 0..1000 {
            t.insert(key("same"), hint(Kind::Upcoming, i, 1_000_000), i);
        }
        assert_eq!(t.len(), 1);
        assert!(t.order.len() <= 8, "{}", t.order.len());
        // The replaced items were stale, not live: nothing was pushed out.
        for k in ["b", "c", "d"] {
            assert_eq!(
                t.insert(key(k), hint(Kind::Done, 1000, 10), 1000).dropped,
                0
            );
        }
    }

    #[test]
    fn upcoming_and_expect_hold_until_due_and_one_turnover_after_done_until_read() {
        let mut t = Table::new(8, usize::MAX);
        let up = Hint {
            due_ms: 100,
            expires_ms: u64::MAX,
            ..hint(Kind::Upcoming, 0, 0)
        };
        t.insert(key("u"), up, 0);
        let ex = Hint {
            due_ms: 200,
            expires_ms: u64::MAX,
            ..hint(Kind::Expect, 0, 0)
        };
        t.insert(key("e"), ex, 0);
        t.insert(key("d"), hint(Kind::Done, 0, u64::MAX), 0);
        // A turnover of 50: in force until due + 50.
        let slack = Some(50);
        assert!(t.get(&key("u"), 149, slack).is_some());
        assert!(t.get(&key("u"), 150, slack).is_none());
        assert!(t.get(&key("e"), 249, slack).is_some());
        assert!(t.get(&key("e"), 250, slack).is_none());
        // No turnover known yet (nothing evicted): kept.
        assert!(t.get(&key("u"), 10_000, None).is_some());
        // A slower cache keeps them longer: the same hint at a turnover of 10 s.
        assert!(t.get(&key("u"), 10_000, Some(10_000)).is_some());
        // A done hint does not lapse with time, whatever the turnover.
        assert!(t.get(&key("d"), u64::MAX / 2, Some(1)).is_some());
        // A later read of the same block announced: the slack counts from the latest.
        let later = Hint {
            at_ms: 120,
            due_ms: 300,
            expires_ms: u64::MAX,
            ..hint(Kind::Upcoming, 120, 0)
        };
        t.insert(key("u"), later, 120);
        assert!(t.get(&key("u"), 349, slack).is_some());
        assert!(t.get(&key("u"), 350, slack).is_none());
    }

    #[test]
    fn the_table_stays_within_its_bytes_oldest_out_first() {
        let long = |i: usize| key(&format!("{i:0>200}"));
        let per = entry_bytes(&long(0));
        let mut t = Table::new(1000, 3 * per);
        for i in 0..3 {
            assert_eq!(
                t.insert(long(i), hint(Kind::Done, 0, u64::MAX), 0).dropped,
                0
            );
        }
        assert_eq!(t.bytes(), 3 * per);
        // A fourth long key pushes out the first; the table full, even a block (an
        // entry smaller than a long key) pushes out one.
        assert_eq!(
            t.insert(long(3), hint(Kind::Done, 0, u64::MAX), 0).dropped,
            1
        );
        assert!(t.get(&long(0), 0, None).is_none() && t.get(&long(3), 0, None).is_some());
        assert_eq!(
            t.insert(Name::Block(1), hint(Kind::Done, 0, u64::MAX), 0)
                .dropped,
            1
        );
        assert!(t.bytes() <= 3 * per, "{} > {}", t.bytes(), 3 * per);
        // Replacing a name costs nothing more.
        let before = t.bytes();
        t.insert(Name::Block(1), hint(Kind::Upcoming, 1, u64::MAX), 1);
        assert_eq!(t.bytes(), before);
        // Swept entries give their bytes back.
        let mut t = Table::new(1000, usize::MAX);
        t.insert(long(0), hint(Kind::Done, 0, 10), 0);
        t.insert(Name::Block(2), hint(Kind::Done, 100, u64::MAX), 100);
        assert_eq!(t.bytes(), entry_bytes(&Name::Block(2)));
    }
}

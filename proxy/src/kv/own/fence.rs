//! What keeps a viewed range of the own segment in place: the ranges engines hold views
//! of, and the writes into the segment in progress or recently begun.
//!
//! Mooncake's read lease alone does not keep bytes where they are: a forced `Remove`, an
//! upsert, an unmount or a lost heartbeat frees an object under its lease, and the
//! master's allocator hands the range it freed last out first (shared/mooncake
//! leases-and-allocation). Every byte written into moongate's segment passes through
//! moongate (its TE-TCP and QUIC owner side, the kv face's own puts, an engine's
//! reservation), so the segment can refuse to overwrite what an engine is reading:
//! - a write may not begin over a viewed range ([`Fence::begin_write`] says `Fenced`;
//!   callers wait for the view to end, bounded, then fail the write);
//! - a view may not begin over a write in progress, nor over a range written since the
//!   caller looked the object up ([`Fence::view`] with the sequence number read before
//!   the lookup): then what the lookup named may no longer be what lies there.
//!
//! Pure bookkeeping: no I/O and no clock; the waiting lives in
//! [`super::memory::Memory::begin_write_within`].

use std::collections::{BTreeMap, HashMap, VecDeque};

use bytes::Bytes;

use super::known::Known;

/// Writes remembered after they began, for views that looked their object up before
/// them. A lookup takes one master round trip; far fewer writes begin meanwhile. A view
/// whose lookup is older than the oldest remembered write is refused (and retried).
const RECENT: usize = 4096;

/// The one epoch of [`Inner::held`]: a leader change is what those entries are for.
const HELD: u64 = 0;

/// A write may not begin: an engine holds a view over part of its range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a view is held over [{start}, +{len}) of the segment")]
pub struct Fenced {
    pub start: usize,
    pub len: usize,
}

/// A view may not begin over this range now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Moved {
    #[error("a write into the range is in progress")]
    Writing,
    #[error("the range was written since the object was looked up")]
    Written,
}

struct Inner {
    next_seq: u64,
    /// Writes in progress: sequence number -> `[start, end)`.
    writing: HashMap<u64, (usize, usize)>,
    /// The last [`RECENT`] writes begun: `(seq, start, end)`, oldest first.
    recent: VecDeque<(u64, usize, usize)>,
    /// Viewed ranges `(start, end)` and how many views hold each.
    views: BTreeMap<(usize, usize), u32>,
    /// The longest viewed range ever (bounds the scan for views overlapping a write).
    longest: usize,
    viewed_bytes: u64,
    /// Keys whose bytes lie untouched in the segment (a write's begin drops the ones it
    /// overlaps, under this lock).
    known: Known,
    /// The same, for puts acknowledged lately, in no epoch: a new leader may have
    /// forgotten them, and these are the ones whose bytes are still theirs
    /// (`kv.failover_window_ms`, [`crate::kv::client::failover`]).
    held: Known,
}

impl Default for Inner {
    fn default() -> Inner {
        Inner {
            next_seq: 0,
            writing: HashMap::new(),
            recent: VecDeque::new(),
            views: BTreeMap::new(),
            longest: 0,
            viewed_bytes: 0,
            known: Known::new(0),
            held: Known::new(0),
        }
    }
}

impl Inner {
    /// Why a view of `r` for an object looked up when the next write's number was
    /// `since` may not begin now.
    fn moved(&self, r: (usize, usize), since: u64) -> Option<Moved> {
        if self.writing.values().any(|&w| overlaps(w, r)) {
            return Some(Moved::Writing);
        }
        let remembered_from = self.recent.front().map_or(self.next_seq, |w| w.0);
        if since < remembered_from
            || self
                .recent
                .iter()
                .rev()
                .take_while(|w| w.0 >= since)
                .any(|w| overlaps((w.1, w.2), r))
        {
            return Some(Moved::Written);
        }
        None
    }

    /// Holds, as a view, the range `table` (the known keys or the acknowledged puts)
    /// has for `key` in places epoch `epoch`, unless a write over it is in progress
    /// (which has voided it already; checked anyway, and forgotten).
    fn hold_kept(
        &mut self,
        table: fn(&mut Inner) -> &mut Known,
        key: &[u8],
        epoch: u64,
    ) -> Option<(usize, usize)> {
        let (start, len) = table(self).get(key, epoch)?;
        let r = (start, start + len);
        if self.writing.values().any(|&w| overlaps(w, r)) {
            table(self).forget(key);
            return None;
        }
        self.hold_view(r);
        Some((start, len))
    }

    fn hold_view(&mut self, r: (usize, usize)) {
        *self.views.entry(r).or_insert(0) += 1;
        self.longest = self.longest.max(r.1 - r.0);
        self.viewed_bytes += (r.1 - r.0) as u64;
    }

    fn viewed(&self, start: usize, end: usize) -> bool {
        let from = start.saturating_sub(self.longest);
        self.views
            .range((from, 0)..(end, 0))
            .any(|(&(s, e), _)| s < end && e > start)
    }
}

/// Views and writes of one segment.
#[derive(Default)]
pub struct Fence {
    inner: std::sync::Mutex<Inner>,
}

fn overlaps(a: (usize, usize), b: (usize, usize)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

impl Fence {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The sequence number the next write will get: read it before looking an object
    /// up, and give it to [`Fence::view`].
    pub fn write_seq(&self) -> u64 {
        self.lock().next_seq
    }

    /// Begins a write of `[start, start + len)`: its sequence number, to end it with
    /// [`Fence::end_write`]; `Fenced` while a view overlaps it.
    pub fn begin_write(&self, start: usize, len: usize) -> Result<u64, Fenced> {
        let end = start.saturating_add(len);
        let mut i = self.lock();
        if i.viewed(start, end) {
            return Err(Fenced { start, len });
        }
        let seq = i.next_seq;
        i.next_seq += 1;
        i.writing.insert(seq, (start, end));
        i.known.overwritten(start, len);
        i.held.overwritten(start, len);
        if i.recent.len() == RECENT {
            i.recent.pop_front();
        }
        i.recent.push_back((seq, start, end));
        Ok(seq)
    }

    pub fn end_write(&self, seq: u64) {
        self.lock().writing.remove(&seq);
    }

    /// Begins a view of `[start, start + len)` for an object looked up after
    /// [`Fence::write_seq`] answered `since`: refused while a write overlaps it, or when
    /// one began over it since (or too many writes began since to tell).
    pub fn view(&self, start: usize, len: usize, since: u64) -> Result<(), Moved> {
        let r = (start, start.saturating_add(len));
        let mut i = self.lock();
        if let Some(m) = i.moved(r, since) {
            return Err(m);
        }
        i.hold_view(r);
        Ok(())
    }

    /// Keeps at most `n` known keys (`kv.known_keys`; 0: none).
    pub fn set_known_limit(&self, n: usize) {
        self.lock().known = Known::new(n);
    }

    /// Begins a view of `key` if its bytes are known to lie untouched here, in places
    /// epoch `epoch`: its range, held as [`Fence::view`] holds one (end it with
    /// [`Fence::unview`]); `None` when unknown (ask the master).
    pub fn view_known(&self, key: &[u8], epoch: u64) -> Option<(usize, usize)> {
        self.lock().hold_kept(|i| &mut i.known, key, epoch)
    }

    /// Says that `[start, start + len)` holds `key`'s bytes, as of when the next write's
    /// number was `since` (read before the lookup that named the range, or just past
    /// the write that stored them), in places epoch `epoch`. Not kept when a write over
    /// the range is in progress or began since (or too many began to tell).
    pub fn know(&self, key: &Bytes, start: usize, len: usize, since: u64, epoch: u64) -> bool {
        let r = (start, start.saturating_add(len));
        let mut i = self.lock();
        i.moved(r, since).is_none() && i.known.insert(key, start, len, epoch)
    }

    /// Whether a local engine views `key` now through what moongate knew of it (such a
    /// view holds no master lease, so the master alone would let an unforced removal
    /// through).
    pub fn viewed_known(&self, key: &[u8]) -> bool {
        let i = self.lock();
        i.known
            .peek(key)
            .is_some_and(|(s, l)| i.views.contains_key(&(s, s + l)))
    }

    /// Forgets `key` (removed through moongate).
    pub fn forget(&self, key: &[u8]) {
        self.lock().known.forget(key);
    }

    /// Keys known now.
    pub fn known_keys(&self) -> usize {
        self.lock().known.len()
    }

    /// Keeps at most `n` ranges of acknowledged puts (0: none).
    pub fn set_held_limit(&self, n: usize) {
        self.lock().held = Known::new(n);
    }

    /// Says that `[start, start + len)` holds the bytes of `key`, whose put was just
    /// acknowledged; `since` is the next write's number read before the acknowledgement
    /// was asked for (a write begun over the range since voids it).
    pub fn held(&self, key: &Bytes, start: usize, len: usize, since: u64) -> bool {
        let r = (start, start.saturating_add(len));
        let mut i = self.lock();
        i.moved(r, since).is_none() && i.held.insert(key, start, len, HELD)
    }

    /// Drops `key`'s acknowledged range (removed through moongate).
    pub fn forget_held(&self, key: &[u8]) {
        self.lock().held.forget(key);
    }

    /// Holds the ranges of `keys` whose acknowledged bytes still lie untouched as
    /// [`Fence::view`] holds one, so that no write begins over them (a new leader may
    /// hand them out as free) until each is ended with [`Fence::unview`]: per key, its
    /// range, or `None` when a write has begun over it since.
    pub fn pin_held(&self, keys: &[Bytes]) -> Vec<Option<(usize, usize)>> {
        let mut i = self.lock();
        keys.iter()
            .map(|k| i.hold_kept(|i| &mut i.held, k, HELD))
            .collect()
    }

    /// Ranges of acknowledged puts kept now.
    pub fn held_keys(&self) -> usize {
        self.lock().held.len()
    }

    /// Ends one view of `[start, start + len)` begun by [`Fence::view`].
    pub fn unview(&self, start: usize, len: usize) {
        let r = (start, start.saturating_add(len));
        let mut i = self.lock();
        let last = match i.views.get_mut(&r) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            Some(_) => true,
            None => return,
        };
        if last {
            i.views.remove(&r);
        }
        i.viewed_bytes = i.viewed_bytes.saturating_sub(len as u64);
    }

    /// Bytes under views now (a range viewed twice counts twice).
    pub fn viewed_bytes(&self) -> u64 {
        self.lock().viewed_bytes
    }

    /// Writes in progress now.
    pub fn writes_in_progress(&self) -> usize {
        self.lock().writing.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_over_a_view_is_fenced_until_the_view_ends() {
        let f = Fence::default();
        let since = f.write_seq();
        f.view(100, 50, since).unwrap();
        f.view(100, 50, since).unwrap();
        assert_eq!(f.viewed_bytes(), 100);
        for (s, l) in [(100, 50), (90, 11), (149, 1), (0, 1000)] {
            assert_eq!(f.begin_write(s, l), Err(Fenced { start: s, len: l }));
        }
        // Beside it: free.
        let a = f.begin_write(0, 100).unwrap();
        let b = f.begin_write(150, 10).unwrap();
        f.end_write(a);
        f.end_write(b);
        f.unview(100, 50);
        assert!(f.begin_write(120, 1).is_err(), "one view is still held");
        f.unview(100, 50);
        assert_eq!(f.viewed_bytes(), 0);
        let c = f.begin_write(120, 1).unwrap();
        f.end_write(c);
        // Ending a view that is not held changes nothing.
        f.unview(100, 50);
        assert_eq!(f.viewed_bytes(), 0);
    }

    #[test]
    fn a_view_is_refused_over_a_write_in_progress_or_one_begun_since_the_lookup() {
        let f = Fence::default();
        let w = f.begin_write(0, 64).unwrap();
        let since = f.write_seq();
        assert_eq!(f.view(32, 64, since), Err(Moved::Writing));
        f.end_write(w);
        // Written before the lookup and finished: the lookup saw the result.
        f.view(32, 64, since).unwrap();
        f.unview(32, 64);
        let since = f.write_seq();
        let w = f.begin_write(200, 8).unwrap();
        f.end_write(w);
        assert_eq!(f.view(196, 8, since), Err(Moved::Written));
        f.view(100, 8, since)
            .expect("a write elsewhere does not matter");
    }

    #[test]
    fn a_lookup_older_than_every_remembered_write_is_refused() {
        let f = Fence::default();
        let since = f.write_seq();
        for i in 0..RECENT + 1 {
            let w = f.begin_write(10_000 + i, 1).unwrap();
            f.end_write(w);
        }
        assert_eq!(f.view(0, 8, since), Err(Moved::Written));
        f.view(0, 8, f.write_seq()).unwrap();
    }

    #[test]
    fn an_acknowledged_range_is_pinned_until_unviewed_unless_a_write_began_over_it() {
        let f = Fence::default();
        f.set_held_limit(8);
        let key = |s: &str| Bytes::copy_from_slice(s.as_bytes());
        let since = f.write_seq();
        assert!(f.held(&key("a"), 0, 100, since));
        assert!(f.held(&key("b"), 100, 100, since));
        assert!(f.held(&key("c"), 200, 100, since));
        let w = f.begin_write(150, 1).unwrap();
        f.end_write(w);
        // A write begun since the acknowledgement was asked for: not held.
        assert!(!f.held(&key("d"), 150, 10, since));
        f.forget_held(b"c");
        assert_eq!(
            f.pin_held(&[key("a"), key("b"), key("c"), key("x")]),
            [Some((0, 100)), None, None, None]
        );
        assert_eq!(f.held_keys(), 1);
        assert!(f.begin_write(50, 1).is_err(), "pinned: no write begins");
        f.unview(0, 100);
        assert!(f.begin_write(50, 1).is_ok());
        assert_eq!(f.pin_held(&[key("a")]), [None], "written over since");
    }

    #[test]
    fn long_views_are_found_from_writes_far_past_their_start() {
        let f = Fence::default();
        f.view(0, 1 << 20, 0).unwrap();
        f.view(2 << 20, 16, 0).unwrap();
        assert!(f.begin_write((1 << 20) - 1, 1).is_err());
        assert!(f.begin_write(1 << 20, 4096).is_ok());
    }
}

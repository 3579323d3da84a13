//! The staging area (`kv.staging_bytes`): shareable memory beside the own segment for
//! the values a local engine views or reserves that do not live in the own segment (a
//! replica another owner holds; a put the master placed elsewhere). A view of such a
//! value is read here once and the engine maps it as it maps the segment; a reservation
//! placed elsewhere is written here by the engine and sent on at commit.
//!
//! Space is handed out first-fit in 4 KiB units and given back whole; what is free is
//! kept merged. A slot belongs to one lease or ticket until it ends.

use std::collections::BTreeMap;
use std::sync::Mutex;

use super::memory::Memory;

const UNIT: usize = 4096;

/// A piece of the staging area: `[off, off + len)` (`len` rounded up to 4 KiB).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub off: usize,
    pub len: usize,
}

/// The staging memory and what of it is free.
pub struct Staging {
    pub mem: Memory,
    /// Free ranges: start -> length, none adjacent to another.
    free: Mutex<BTreeMap<usize, usize>>,
    used: std::sync::atomic::AtomicU64,
}

impl Staging {
    pub fn new(len: u64) -> std::io::Result<Staging> {
        // Its advertised base is never used: staging is not a Mooncake segment.
        let mem = Memory::new(0, len, "moongate-staging")?;
        let mut free = BTreeMap::new();
        free.insert(0, (len as usize) / UNIT * UNIT);
        Ok(Staging {
            mem,
            free: Mutex::new(free),
            used: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// A slot of at least `len` bytes, or `None` when no free range is that long.
    pub fn alloc(&self, len: usize) -> Option<Slot> {
        let want = len.max(1).checked_next_multiple_of(UNIT)?;
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let (&off, &have) = free.iter().find(|(_, l)| **l >= want)?;
        free.remove(&off);
        if have > want {
            free.insert(off + want, have - want);
        }
        self.used
            .fetch_add(want as u64, std::sync::atomic::Ordering::Relaxed);
        Some(Slot { off, len: want })
    }

    /// Gives a slot from [`Staging::alloc`] back.
    pub fn free(&self, s: Slot) {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let (mut off, mut len) = (s.off, s.len);
        if let Some((&p, &pl)) = free.range(..off).next_back()
            && p + pl == off
        {
            free.remove(&p);
            off = p;
            len += pl;
        }
        if let Some(nl) = free.remove(&(s.off + s.len)) {
            len += nl;
        }
        free.insert(off, len);
        self.used
            .fetch_sub(s.len as u64, std::sync::atomic::Ordering::Relaxed);
    }

    /// Bytes handed out now.
    pub fn used(&self) -> u64 {
        self.used.load(std::sync::atomic::Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_handed_out_first_fit_and_merge_when_given_back() {
        let s = Staging::new(64 * UNIT as u64).unwrap();
        let a = s.alloc(1).unwrap();
        let b = s.alloc(UNIT + 1).unwrap();
        let c = s.alloc(10 * UNIT).unwrap();
        assert_eq!((a.off, a.len), (0, UNIT));
        assert_eq!((b.off, b.len), (UNIT, 2 * UNIT));
        assert_eq!(c.off, 3 * UNIT);
        assert_eq!(s.used(), 13 * UNIT as u64);
        assert!(s.alloc(52 * UNIT).is_none(), "51 units are left");
        s.free(b);
        // A hole of two units: a slot of one fits there, first.
        assert_eq!(s.alloc(UNIT).unwrap().off, UNIT);
        s.free(a);
        s.free(Slot {
            off: UNIT,
            len: UNIT,
        });
        s.free(c);
        assert_eq!(s.used(), 0);
        assert_eq!(s.alloc(64 * UNIT).unwrap().off, 0, "everything merged back");
    }
}

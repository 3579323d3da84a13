//! What the allocator holds, read at each scrape: the bytes moongate's heap has in use
//! and the bytes the allocator keeps free without giving them back to the system.
//!
//! RSS alone cannot tell a table filling to its bound from memory the allocator retains
//! after the data is gone (glibc's arenas keep freed chunks for reuse); the two gauges
//! can. On glibc they come from `mallinfo2` (which walks the free lists, so only at a
//! scrape, never on a request path); elsewhere they stay 0.

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// The heap gauges (`moongate_heap_bytes{state}`).
pub struct HeapMetrics {
    in_use: Gauge,
    free: Gauge,
}

impl HeapMetrics {
    pub fn register(registry: &mut Registry) -> HeapMetrics {
        let f = Family::<[(&'static str, &'static str); 1], Gauge>::default();
        registry.register(
            "moongate_heap_bytes",
            "Heap bytes by state, read at each scrape (glibc mallinfo2; 0 elsewhere): \
             in_use, allocated and not freed; free, freed but kept by the allocator \
             (RSS less in_use, roughly, is that plus code, stacks and mapped segments)",
            f.clone(),
        );
        // One statement each: a family's handle holds its read lock until the statement
        // ends, and creating the second child takes the write lock.
        let in_use = f.get_or_create(&[("state", "in_use")]).clone();
        let free = f.get_or_create(&[("state", "free")]).clone();
        HeapMetrics { in_use, free }
    }

    /// Reads the allocator's figures into the gauges.
    pub fn refresh(&self) {
        if let Some((in_use, free)) = read() {
            self.in_use.set(clamp(in_use));
            self.free.set(clamp(free));
        }
    }
}

/// Hands the heap's free memory back to the system (glibc `malloc_trim`; nothing
/// elsewhere). For after a rare burst (a failover check reads and frees up to the byte
/// budget at once): glibc keeps what a burst freed in its arenas, and RSS would stay at
/// the burst's height. Walks the arenas: never on a request path.
pub fn give_back() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes a size and touches only the allocator's own state.
    unsafe {
        libc::malloc_trim(0);
    }
}

fn clamp(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn read() -> Option<(u64, u64)> {
    // SAFETY: mallinfo2 takes no pointers and returns a plain struct by value.
    let m = unsafe { libc::mallinfo2() };
    // Chunks from the arenas plus large blocks mapped on their own; free chunks kept in
    // the arenas (the top chunk included).
    Some(((m.uordblks + m.hblkhd) as u64, m.fordblks as u64))
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn read() -> Option<(u64, u64)> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn in_use_follows_an_allocation() {
        let mut r = Registry::default();
        let h = HeapMetrics::register(&mut r);
        h.refresh();
        let before = h.in_use.get();
        let block = vec![1u8; 64 << 20];
        h.refresh();
        let during = h.in_use.get();
        drop(std::hint::black_box(block));
        assert!(
            during - before >= 60 << 20,
            "64 MiB allocated: in use {before} -> {during}"
        );
    }
}

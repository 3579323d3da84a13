//! What the allocator holds, read at each scrape: the bytes moongate's heap has in use
//! and the bytes the allocator keeps free without giving them back to the system.
//!
//! RSS alone cannot tell a table filling to its bound from memory the allocator retains
//! after the data is gone (glibc's arenas keep freed chunks for reuse); the two gauges
//! can. On glibc they come from `mallinfo2` (which walks the free lists, so only at a
//! scrape, never on a request path); elsewhere they stay 0.
//!
//! [`settle`] hands freed memory back once enough has been freed since the last trim:
//! after a burst (a flood of connections, a failover check's reads) glibc keeps the
//! freed chunks in its arenas, and RSS would stay at the burst's height until the next
//! one reused them.

use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

/// How often [`settle`] looks. Each look is a `/proc` read and one `mallinfo2` (a walk
/// of the free lists under each arena's lock, as a metrics scrape does; not timed
/// alone): every 5 s keeps that off the traffic's way, and a burst's memory is back
/// within seconds of its end.
const SETTLE_EVERY: Duration = Duration::from_secs(5);

/// How many bytes must come back free to the heap (its free bytes above their lowest
/// since the last trim) before [`settle`] trims. 16 MiB: above the churn of steady
/// traffic (RSS within 203-212 MB over nine minutes of one soak), below what one burst
/// leaves (a flood of 300 stalled uploads 22-30 MB, a failover check's reads more), and
/// 6-8 % of a sidecar's ~200-250 MB RSS there.
const SETTLE_SLACK: u64 = 16 << 20;

/// The heap gauges (`moongate_heap_bytes{state}`) and the trims [`settle`] made.
pub struct HeapMetrics {
    in_use: Gauge,
    free: Gauge,
    trims: Counter,
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
        let trims = Counter::default();
        registry.register(
            "moongate_heap_trims",
            "Times freed heap memory was handed back to the system: 16 MiB or more had \
             been freed to the heap since its free bytes were lowest (a burst ended)",
            trims.clone(),
        );
        HeapMetrics {
            in_use,
            free,
            trims,
        }
    }

    /// The trims' counter, for [`settle`].
    pub fn trims(&self) -> Counter {
        self.trims.clone()
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

/// Every [`SETTLE_EVERY`], reads the heap's free bytes, and trims ([`give_back`]) once
/// they are more than [`SETTLE_SLACK`] above the lowest reading since the last trim:
/// that much was freed back to the allocator since, which glibc keeps resident; counts
/// each trim in `trims`. Returns at `shutdown`, or at once where the figures cannot be
/// read (not Linux with glibc: nothing to trim there either).
///
/// Not on RSS rising: RSS rises while a burst is live (a flood's buffers, a check's
/// reads), when a trim gives nothing back, and does not rise when the burst ends and
/// frees; a rule on RSS trimmed during a flood and then never again, and left the
/// flood's 22-30 MB resident to the end of a soak. Nor on RSS less the heap in use:
/// reserved room never written, a hash map's spare buckets, counts as in use and is not
/// resident, so that difference reads 0.
pub async fn settle(trims: Counter, shutdown: CancellationToken) {
    let mut low: Option<u64> = None;
    let mut tick = tokio::time::interval(SETTLE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let Some((_, free)) = read() else {
            return;
        };
        if !freed(&mut low, free) {
            continue;
        }
        let rss = resident_anon().unwrap_or(0);
        // malloc_trim walks every arena and madvises its free pages: off the runtime's
        // workers.
        if tokio::task::spawn_blocking(give_back).await.is_err() {
            return;
        }
        trims.inc();
        // Free bytes stay counted once trimmed (only their pages go): the next trim
        // waits for as much freed again.
        low = read().map(|(_, f)| f);
        // What a trim gave back says whether what was freed was resident.
        tracing::debug!(
            rss_before = rss,
            rss_after = resident_anon().unwrap_or(0),
            heap_free = free,
            "heap trimmed"
        );
    }
}

/// Whether the heap's free bytes `free` are more than the slack above `low` (which
/// follows the lowest reading; the first sets it).
fn freed(low: &mut Option<u64>, free: u64) -> bool {
    match low {
        Some(l) if free > l.saturating_add(SETTLE_SLACK) => true,
        Some(l) => {
            *l = (*l).min(free);
            false
        }
        None => {
            *low = Some(free);
            false
        }
    }
}

/// Anonymous resident bytes (`RssAnon`: the heap and other private mappings; not the
/// shared-memory segment, which is the store's data).
fn resident_anon() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb << 10)
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

    #[test]
    fn a_trim_comes_only_once_the_slack_is_freed_above_the_lowest_reading() {
        let mut low = None;
        let mib = 1u64 << 20;
        assert!(!freed(&mut low, 40 * mib), "the first reading sets the low");
        // A burst takes free memory (and RSS rises): no trim while it is live.
        assert!(!freed(&mut low, 10 * mib));
        assert_eq!(low, Some(10 * mib), "the low follows the lowest");
        assert!(!freed(&mut low, 26 * mib), "16 MiB freed: within the slack");
        // The burst ends and frees.
        assert!(freed(&mut low, 27 * mib));
        assert_eq!(low, Some(10 * mib), "a trim's caller reads the low anew");
    }

    /// What a burst leaves resident stays in RSS once freed, and a trim gives it back.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn a_burst_freed_stays_resident_until_a_trim_gives_it_back() {
        // Small chunks (below the mmap threshold) come from the arenas; every page
        // written (a zero fill could come untouched from calloc).
        let mut chunks: Vec<Vec<u8>> = (0..16_384)
            .map(|i| vec![(i % 255 + 1) as u8; 4096])
            .collect();
        // Every 16th kept: the rest freed around them, in holes the top chunk cannot
        // take back on its own (as a burst's memory is, among what stays).
        let mut i = 0;
        chunks.retain(|_| {
            i += 1;
            i % 16 == 0
        });
        let freed = resident_anon().unwrap();
        let (_, free) = read().unwrap();
        give_back();
        let after = resident_anon().unwrap();
        drop(chunks);
        assert!(
            free >= 48 << 20 && after + (32 << 20) <= freed,
            "60 MiB freed ({free} free in the heap): RSS {freed}, after the trim {after}"
        );
    }
}

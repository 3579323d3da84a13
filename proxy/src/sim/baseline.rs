//! The two reference policies every simulation reports, native and exact, over a cache
//! that holds `cap` blocks:
//! - `lru`: after a request is served, every one of its blocks becomes the most recently
//!   used (stored if absent); the least recently used block goes when the cache is full.
//! - `opt`: Belady's rule: the block whose next use is furthest in the future goes
//!   (blocks never used again first). Next use counts block references in trace order,
//!   so within one request the deeper block is the further one: a prefix cache loses
//!   less by dropping the end of a chain than its start.
//!
//! Both count prefix hits: per request, the blocks found before the first miss.

use std::collections::BinaryHeap;

use super::Counts;
use super::trace::Trace;

/// Leading blocks of `blocks` that `present` says are cached.
fn prefix_hits(blocks: &[u32], present: impl Fn(u32) -> bool) -> u64 {
    blocks.iter().take_while(|&&b| present(b)).count() as u64
}

const NONE: u32 = u32::MAX;

/// Plain LRU over `cap` blocks (an intrusive doubly linked list over dense block ids).
pub fn lru(trace: &Trace, cap: usize) -> Counts {
    let n = trace.distinct();
    let (mut prev, mut next) = (vec![NONE; n], vec![NONE; n]);
    let mut present = vec![false; n];
    // head: least recently used; tail: most recently used.
    let (mut head, mut tail) = (NONE, NONE);
    let mut len = 0usize;
    let mut c = Counts::default();
    for r in &trace.requests {
        let blocks = trace.blocks_of(r);
        c.lookups += blocks.len() as u64;
        c.hits += prefix_hits(blocks, |b| present[b as usize]);
        for &b in blocks {
            let b = b as usize;
            if present[b] {
                if tail == b as u32 {
                    continue;
                }
                // unlink
                let (p, nx) = (prev[b], next[b]);
                if p != NONE {
                    next[p as usize] = nx;
                } else {
                    head = nx;
                }
                prev[nx as usize] = p; // nx exists: b is not the tail
            } else {
                if cap == 0 {
                    continue;
                }
                present[b] = true;
                len += 1;
                c.stored += 1;
            }
            // append at the tail
            prev[b] = tail;
            next[b] = NONE;
            if tail != NONE {
                next[tail as usize] = b as u32;
            } else {
                head = b as u32;
            }
            tail = b as u32;
            if len > cap {
                let h = head as usize;
                head = next[h];
                if head != NONE {
                    prev[head as usize] = NONE;
                } else {
                    tail = NONE;
                }
                present[h] = false;
                len -= 1;
                c.evicted += 1;
            }
        }
    }
    c
}

/// How a fleet's router sends requests to ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Any rank, uniformly (a load balancer that knows nothing of the cache).
    Random,
    /// The rank its first block hashes to: requests sharing a prefix meet on one rank
    /// (a cache-aware or session-sticky router).
    Sticky,
}

/// splitmix64: a fixed, seedable spread of request numbers and block ids over ranks.
pub(super) fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The rank request number `i` (first block `first`) is routed to.
pub fn routed(route: Route, i: usize, first: u32, ranks: usize) -> usize {
    (match route {
        Route::Random => mix(i as u64),
        Route::Sticky => mix(u64::from(first) ^ 0x5bd1_e995),
    } as usize)
        % ranks.max(1)
}

/// The rank block `b`'s hash makes its home (the fleet's access records).
pub fn home(b: u32, ranks: usize) -> usize {
    mix(u64::from(b) ^ 0x2545_f491_4f6c_dd1d) as usize % ranks.max(1)
}

/// LRU as a fleet of `ranks` sidecars runs it today, each in front of one rank: a block
/// belongs to the rank that stored it; each rank evicts its own blocks, least recently
/// used first, within an equal quota of `cap` (what the fleet's proportional portions
/// come to when ranks store alike); a rank sees only the accesses routed to it, so a
/// block read through other ranks ages on its owner's list. Lookups find a block
/// wherever it is (one pool). With `ranks = 1` this is [`lru`].
///
/// With `homes` (the fleet's access records, `fleet.records`): a block belongs to the
/// rank its hash picks, whichever rank stored it, and every access reaches that rank's
/// list, so each evictor ranks its blocks by the whole fleet's accesses.
pub fn lru_fleet(trace: &Trace, cap: usize, ranks: usize, route: Route, homes: bool) -> Counts {
    let ranks = ranks.max(1);
    let n = trace.distinct();
    let (mut prev, mut next) = (vec![NONE; n], vec![NONE; n]);
    let mut owner = vec![NONE; n];
    let (mut head, mut tail, mut len) = (vec![NONE; ranks], vec![NONE; ranks], vec![0usize; ranks]);
    let quota: Vec<usize> = (0..ranks)
        .map(|i| cap / ranks + usize::from(i < cap % ranks))
        .collect();
    let mut c = Counts::default();
    for (i, r) in trace.requests.iter().enumerate() {
        let blocks = trace.blocks_of(r);
        c.lookups += blocks.len() as u64;
        c.hits += prefix_hits(blocks, |b| owner[b as usize] != NONE);
        let Some(&first) = blocks.first() else {
            continue;
        };
        let routed = routed(route, i, first, ranks);
        for &b in blocks {
            let bu = b as usize;
            let k = if homes { home(b, ranks) } else { routed };
            match owner[bu] {
                o if o == k as u32 => {
                    if tail[k] == b {
                        continue;
                    }
                    let (p, nx) = (prev[bu], next[bu]);
                    if p != NONE {
                        next[p as usize] = nx;
                    } else {
                        head[k] = nx;
                    }
                    prev[nx as usize] = p;
                }
                // Another rank's block: this rank's evictor never hears of the access.
                o if o != NONE => continue,
                _ => {
                    if quota[k] == 0 {
                        continue;
                    }
                    owner[bu] = k as u32;
                    len[k] += 1;
                    c.stored += 1;
                }
            }
            prev[bu] = tail[k];
            next[bu] = NONE;
            if tail[k] != NONE {
                next[tail[k] as usize] = b;
            } else {
                head[k] = b;
            }
            tail[k] = b;
            if len[k] > quota[k] {
                let h = head[k] as usize;
                head[k] = next[h];
                if head[k] != NONE {
                    prev[head[k] as usize] = NONE;
                } else {
                    tail[k] = NONE;
                }
                owner[h] = NONE;
                len[k] -= 1;
                c.evicted += 1;
            }
        }
    }
    c
}

/// Belady's rule over `cap` blocks.
pub fn opt(trace: &Trace, cap: usize) -> Counts {
    let refs = trace.blocks.len();
    // next_use[j]: the position of the next reference to the block referenced at j.
    let mut next_use = vec![usize::MAX; refs];
    let mut last = vec![usize::MAX; trace.distinct()];
    for j in (0..refs).rev() {
        let b = trace.blocks[j] as usize;
        next_use[j] = last[b];
        last[b] = j;
    }
    // The cached blocks' next use; heap entries go stale when a block is used again.
    let mut cached_next = vec![None::<usize>; trace.distinct()];
    let mut heap: BinaryHeap<(usize, u32)> = BinaryHeap::new();
    let mut len = 0usize;
    let mut c = Counts::default();
    for r in &trace.requests {
        let blocks = trace.blocks_of(r);
        c.lookups += blocks.len() as u64;
        c.hits += prefix_hits(blocks, |b| cached_next[b as usize].is_some());
        for (j, &b) in (r.start as usize..).zip(blocks) {
            if cap == 0 {
                break;
            }
            let slot = &mut cached_next[b as usize];
            if slot.is_none() {
                len += 1;
                c.stored += 1;
            }
            *slot = Some(next_use[j]);
            heap.push((next_use[j], b));
            while len > cap {
                let Some((nu, v)) = heap.pop() else { break };
                if cached_next[v as usize] == Some(nu) {
                    cached_next[v as usize] = None;
                    len -= 1;
                    c.evicted += 1;
                }
            }
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(reqs: &[&[u64]]) -> Trace {
        let text: String = reqs
            .iter()
            .map(|r| format!("{{\"hash_ids\": {r:?}}}\n"))
            .collect();
        Trace::parse(&text).unwrap()
    }

    #[test]
    fn lru_counts_prefix_hits_and_evicts_the_oldest() {
        // cap 2: [1,2] stored; [1,3]: 1 hits, 3 evicts 2; [2,1]: 2 misses (the prefix
        // ends there even though 1 is cached).
        let t = trace(&[&[1, 2], &[1, 3], &[2, 1]]);
        let c = lru(&t, 2);
        assert_eq!((c.lookups, c.hits), (6, 1));
        assert_eq!(c.stored, 5, "1, 2, 3, then 2 and 1 again");
        let all = lru(&t, 10);
        assert_eq!(all.hits, 3, "1 in [1,3], then all of [2,1]");
        assert_eq!(lru(&t, 0).hits, 0);
    }

    #[test]
    fn a_fleet_of_one_is_lru_and_a_partial_view_ages_shared_blocks() {
        let t = trace(&[&[1, 2], &[1, 3], &[2, 1], &[4, 5, 6], &[1, 2, 7]]);
        for cap in [0, 1, 2, 3, 10] {
            for route in [Route::Random, Route::Sticky] {
                for homes in [false, true] {
                    assert_eq!(
                        lru_fleet(&t, cap, 1, route, homes),
                        lru(&t, cap),
                        "cap {cap}"
                    );
                }
            }
        }
        // Two ranks, sticky on the first block: [1,..] requests meet on one rank, so a
        // fleet with room for everything hits as one cache does.
        assert_eq!(
            lru_fleet(&t, 10, 2, Route::Sticky, false).hits,
            lru(&t, 10).hits
        );
        // A block read through another rank ages on its owner's list: [9] is put by
        // one rank and read by the other; the owner's own puts push it out.
        let t = trace(&[&[9], &[9], &[1], &[9], &[2], &[9]]);
        let one = lru(&t, 2).hits;
        let two = lru_fleet(&t, 4, 2, Route::Random, false).hits;
        assert_eq!(one, 3, "one LRU of 2 keeps [9] hot");
        assert!(two <= one, "two ranks of 2 each: {two}");
        // With homes every read of [9] reaches its home's list, wherever it was routed:
        // room for two per rank keeps it as one LRU of two does.
        assert_eq!(lru_fleet(&t, 4, 2, Route::Random, true).hits, one);
    }

    #[test]
    fn opt_keeps_what_comes_back_first() {
        // cap 1: after [1] then [2], Belady keeps 1 (used next) over 2 (used later).
        let t = trace(&[&[1], &[2], &[1], &[2]]);
        assert_eq!(opt(&t, 1).hits, 1);
        assert_eq!(lru(&t, 1).hits, 0);
        assert!(opt(&t, 2).hits == 2 && lru(&t, 2).hits == 2);
    }
}

//! Hint streams derived from a trace, for `moongate sim --hints SPEC`: what a serving
//! stack around the store would have told moongate, by a stated model.
//!
//! - `queue:W`: a router's queue. When request `i` arrives, the blocks of requests
//!   `i+1 ..= i+W` are announced `upcoming`, each due when its request arrives. The
//!   router is assumed to see W requests ahead, no more, no less.
//! - `last:P[@D]`: ended sessions. For a share `P` of the requests (a seeded draw), the
//!   blocks of the request that the trace never reads again are announced `done` `D` ms
//!   (default 0) after the request was served. The trace does not say when a session
//!   ends; a block never read again is its stand-in for "this session ended", which the
//!   serving stack knows.
//! - `expect:P[@W]`: expected next turns. For a share `P` of the requests (a seeded
//!   draw of its own), the blocks of the request that the trace reads again within `W`
//!   ms (default 60000) are announced `expect`, within `W`, when the request was served:
//!   an agent that calls a tool knows its next turn comes back with the same prefix
//!   when the tool returns. The trace does not say which turns wait on a tool; a block
//!   read again within `W` is the stand-in. The hint is due at `W`, read again or not.
//! - `wrong:F`: a share `F` of the `done` hints are wrong: for each true one, with
//!   probability `F / (1 - F)` a block that the trace does read again later is announced
//!   `done` too, drawn from the last 4,096 such blocks served (a misattributed session
//!   end: recent, and alive).
//! - `ttl:MS`: an operator's cap on how long a `done` hint is kept (the live
//!   `hints.done_ttl_ms`). By default none: a `done` hint is in force until its block is
//!   read or stored again (a plugin sees the block's age below the hint's, as
//!   `hint-lru` checks), a truth that does not expire with time; it stays visible after
//!   that, so a plugin can tell a wrong hint by the read that followed it. An `upcoming`
//!   or `expect` one holds until it is due and then for one turnover of the cache (the
//!   median time the last eviction round's victims had gone unread), as the live table
//!   holds it.
//! - `seed:N`: the draws' seed (default 1).
//!
//! Pure: the trace in, per-block hint state out, on the simulator's clock: trace time
//! divided by the live rules' `--speed` (the replay's clock), so a due time, a delay and
//! a ttl given in trace-ms are divided by it too.

use std::collections::VecDeque;

use serde::Serialize;

use super::baseline::mix;
use super::trace::Trace;
use crate::hints::table::in_force;

/// A `--hints` SPEC.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HintSpec {
    /// `queue:W`: requests ahead the router announces (0: none).
    pub queue: usize,
    /// `last:P`: share of requests whose never-read-again blocks are announced done.
    pub last_share: f64,
    /// `last:P@D`: delay of those announcements, ms.
    pub last_delay_ms: u64,
    /// `expect:P`: share of requests whose blocks read again within `expect_within_ms`
    /// are announced expected.
    pub expect_share: f64,
    /// `expect:P@W`: how far ahead an expected turn reaches, ms.
    pub expect_within_ms: u64,
    /// `wrong:F`: share of done hints that are wrong.
    pub wrong_share: f64,
    /// `ttl:MS`: the cap on how long a done hint is kept (`None`: no cap, the default).
    pub ttl_ms: Option<u64>,
    pub seed: u64,
}

impl Default for HintSpec {
    fn default() -> Self {
        HintSpec {
            queue: 0,
            last_share: 0.0,
            last_delay_ms: 0,
            expect_share: 0.0,
            expect_within_ms: 60_000,
            wrong_share: 0.0,
            ttl_ms: None,
            seed: 1,
        }
    }
}

impl HintSpec {
    /// Parses `queue:64,last:0.5@100,wrong:0.05`; an error names the part at fault.
    pub fn parse(s: &str) -> Result<HintSpec, String> {
        let mut spec = HintSpec::default();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (kind, value) = part
                .split_once(':')
                .ok_or_else(|| format!("{part:?}: expected KIND:VALUE"))?;
            let bad = |why: &str| format!("{part:?}: {why}");
            let share = |v: &str| -> Result<f64, String> {
                v.parse::<f64>()
                    .ok()
                    .filter(|p| (0.0..=1.0).contains(p))
                    .ok_or_else(|| bad("a share from 0 to 1"))
            };
            match kind {
                "queue" => {
                    spec.queue = value.parse().map_err(|_| bad("a number of requests"))?;
                }
                "last" => {
                    let (p, d) = at(value);
                    spec.last_share = share(p)?;
                    if let Some(d) = d {
                        spec.last_delay_ms = d.parse().map_err(|_| bad("a delay in ms after @"))?;
                    }
                }
                "expect" => {
                    let (p, w) = at(value);
                    spec.expect_share = share(p)?;
                    if let Some(w) = w {
                        spec.expect_within_ms = w
                            .parse()
                            .ok()
                            .filter(|&w| w > 0)
                            .ok_or_else(|| bad("a positive time in ms after @"))?;
                    }
                }
                "wrong" => {
                    spec.wrong_share = share(value)?;
                    if spec.wrong_share >= 1.0 {
                        return Err(bad("a share below 1"));
                    }
                }
                "ttl" => spec.ttl_ms = Some(value.parse().map_err(|_| bad("milliseconds"))?),
                "seed" => spec.seed = value.parse().map_err(|_| bad("a number"))?,
                _ => {
                    return Err(format!(
                        "{part:?}: unknown hint model {kind:?} (queue, last, expect, wrong, ttl, seed)"
                    ));
                }
            }
        }
        Ok(spec)
    }
}

/// `P@T` as `(P, Some(T))`, `P` as `(P, None)`.
fn at(value: &str) -> (&str, Option<&str>) {
    match value.split_once('@') {
        Some((p, t)) => (p, Some(t)),
        None => (value, None),
    }
}

/// One block's hint at a moment, as the model knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Known {
    None,
    /// Due at this time.
    Upcoming {
        due_ms: u64,
    },
    /// Announced at this time.
    Done {
        at_ms: u64,
    },
    /// An expected turn, announced at `at_ms`, due by `due_ms`.
    Expect {
        at_ms: u64,
        due_ms: u64,
    },
}

/// Mixed into the seed for the `expect` draw, so it is independent of `last`'s.
const EXPECT_STREAM: u64 = 0x6578_7065_6374;

/// Recently served blocks kept to draw wrong hints from.
const RECENT: usize = 4096;

/// A draw in `[0, 1)` for `(seed, a, b)`.
fn draw(seed: u64, a: u64, b: u64) -> f64 {
    (mix(seed ^ mix(a ^ mix(b))) >> 11) as f64 / (1u64 << 53) as f64
}

/// The hint state of every block, advanced request by request.
pub struct HintModel<'t> {
    spec: HintSpec,
    trace: &'t Trace,
    /// Trace time over the simulator's clock (1 but with live rules' `--speed`).
    speed: f64,
    /// Per block, the arrival times of queued requests that read it, earliest first.
    upcoming: Vec<VecDeque<u64>>,
    /// Per block, when a `done` hint was announced (`u64::MAX`: none).
    done_at: Vec<u64>,
    /// Per block, the latest `expect` hint: (announced, due); `(0, 0)`: none.
    expect: Vec<(u64, u64)>,
    /// Done announcements not yet made: (time, block), in time order.
    pending: VecDeque<(u64, u32)>,
    /// Per position in `trace.blocks`: the next request that reads that block
    /// (`u32::MAX`: none, the trace never reads it again).
    next_read: Vec<u32>,
    /// Recently served blocks the trace reads again, with that next read: where wrong
    /// `done` hints are drawn from.
    recent: VecDeque<(u32, u32)>,
    /// Hints announced: upcoming, true done, wrong done, expect.
    pub announced: [u64; 4],
    /// The trace's hash -> its dense block number (keys are named after hashes).
    dense: std::collections::HashMap<u64, u32>,
    /// The cache's turnover (the last eviction round's median victim age; `None`
    /// before any): how long past its due time an `upcoming` or `expect` hint holds,
    /// by the live table's rule.
    slack_ms: Option<u64>,
}

impl<'t> HintModel<'t> {
    pub fn new(spec: HintSpec, trace: &'t Trace, speed: f64) -> HintModel<'t> {
        let n = trace.distinct();
        // Per block position, the next request that reads that block (backwards: the
        // last request seen reading each block).
        let mut next_read = vec![u32::MAX; trace.blocks.len()];
        let mut last = vec![u32::MAX; n];
        for (i, r) in trace.requests.iter().enumerate().rev() {
            let span = r.start as usize..r.end as usize;
            for (next, &b) in next_read[span.clone()]
                .iter_mut()
                .zip(&trace.blocks[span.clone()])
            {
                *next = last[b as usize];
            }
            for &b in &trace.blocks[span] {
                last[b as usize] = i as u32;
            }
        }
        HintModel {
            spec,
            trace,
            speed: speed.max(1e-9),
            upcoming: vec![VecDeque::new(); n],
            done_at: vec![u64::MAX; n],
            expect: vec![(0, 0); n],
            pending: VecDeque::new(),
            next_read,
            recent: VecDeque::new(),
            announced: [0; 4],
            dense: trace
                .hashes
                .iter()
                .enumerate()
                .map(|(i, &h)| (h, i as u32))
                .collect(),
            slack_ms: None,
        }
    }

    /// The block a simulated key (`all/blk/HASH`) names.
    pub fn block_of(&self, key: &[u8]) -> Option<u32> {
        let hash = std::str::from_utf8(key.strip_prefix(b"all/blk/")?)
            .ok()?
            .parse::<u64>()
            .ok()?;
        self.dense.get(&hash).copied()
    }

    pub fn spec(&self) -> &HintSpec {
        &self.spec
    }

    /// Request `i` arrives at `now_ms`: due announcements are made, and the router's
    /// queue moves on by one.
    pub fn arrive(&mut self, i: usize, now_ms: u64) {
        while let Some(&(at, b)) = self.pending.front() {
            if at > now_ms {
                break;
            }
            self.done_at[b as usize] = at;
            self.pending.pop_front();
        }
        if self.spec.queue == 0 {
            return;
        }
        let reqs = &self.trace.requests;
        // At the start the whole window is announced; afterwards the one request that
        // enters it.
        let from = if i == 0 { 1 } else { i + self.spec.queue };
        let to = (i + self.spec.queue).min(reqs.len().saturating_sub(1));
        for r in reqs.iter().take(to + 1).skip(from) {
            let due = self.clock(r.ts_ms);
            for &b in self.trace.blocks_of(r) {
                self.upcoming[b as usize].push_back(due);
                self.announced[0] += 1;
            }
        }
    }

    /// Request `i` was served at `now_ms`: the `last` and `expect` models announce its
    /// blocks.
    pub fn served(&mut self, i: usize, now_ms: u64) {
        self.expected(i, now_ms);
        if self.spec.last_share <= 0.0 {
            return;
        }
        let r = &self.trace.requests[i];
        if self.spec.wrong_share > 0.0 {
            for pos in r.start as usize..r.end as usize {
                if self.next_read[pos] != u32::MAX {
                    if self.recent.len() == RECENT {
                        self.recent.pop_front();
                    }
                    self.recent
                        .push_back((self.trace.blocks[pos], self.next_read[pos]));
                }
            }
        }
        let seed = self.spec.seed;
        if draw(seed, i as u64, 0) >= self.spec.last_share {
            return;
        }
        let at = now_ms + self.clock(self.spec.last_delay_ms);
        let p_wrong = self.spec.wrong_share / (1.0 - self.spec.wrong_share);
        for pos in r.start..r.end {
            if self.next_read[pos as usize] != u32::MAX {
                continue;
            }
            self.pending
                .push_back((at, self.trace.blocks[pos as usize]));
            self.announced[1] += 1;
            if draw(seed, i as u64, u64::from(pos) + 1) < p_wrong
                && let Some(b) = self.wrong_block(i, pos)
            {
                self.pending.push_back((at, b));
                self.announced[2] += 1;
            }
        }
    }

    /// The `expect` model: request `i`'s blocks read again within the window, when the
    /// draw picks it.
    fn expected(&mut self, i: usize, now_ms: u64) {
        let within = self.spec.expect_within_ms;
        if self.spec.expect_share <= 0.0
            || draw(self.spec.seed ^ EXPECT_STREAM, i as u64, 0) >= self.spec.expect_share
        {
            return;
        }
        let reqs = &self.trace.requests;
        let r = &reqs[i];
        let due = now_ms + self.clock(within);
        for pos in r.start as usize..r.end as usize {
            let next = self.next_read[pos];
            if next == u32::MAX || reqs[next as usize].ts_ms.saturating_sub(r.ts_ms) > within {
                continue;
            }
            self.expect[self.trace.blocks[pos] as usize] = (now_ms, due);
            self.announced[3] += 1;
        }
    }

    /// A recently served block that the trace reads again after request `i` (a few
    /// draws; `None` when none is found).
    fn wrong_block(&self, i: usize, pos: u32) -> Option<u32> {
        if self.recent.is_empty() {
            return None;
        }
        (0..8u64).find_map(|k| {
            let at =
                mix(self.spec.seed ^ mix(u64::from(pos) ^ (k << 40))) as usize % self.recent.len();
            let (b, next) = self.recent[at];
            (next as usize > i).then_some(b)
        })
    }

    /// Trace-ms on the simulator's clock.
    fn clock(&self, trace_ms: u64) -> u64 {
        (trace_ms as f64 / self.speed) as u64
    }

    /// An eviction round took blocks that had gone unread this long (their median).
    pub fn turnover(&mut self, age_ms: u64) {
        self.slack_ms = Some(age_ms);
    }

    /// What is known of block `b` at `now_ms`. An `upcoming` or `expect` hint holds
    /// until due and one turnover after ([`in_force`], as the live table reads it); as
    /// in the live table, where a newer hint of a block replaces the older, a `done`
    /// said after a read came due is what shows.
    pub fn known(&mut self, b: u32, now_ms: u64) -> Known {
        let slack = self.slack_ms;
        let q = &mut self.upcoming[b as usize];
        // Keep the latest read that is due (it may hold one turnover) and those to come.
        while q.get(1).is_some_and(|&due| due < now_ms) {
            q.pop_front();
        }
        let mut past_due = None;
        match (q.front(), q.get(1)) {
            (Some(&due_ms), _) if due_ms >= now_ms => return Known::Upcoming { due_ms },
            (Some(_), Some(&due_ms)) => return Known::Upcoming { due_ms },
            (Some(&due_ms), None) if in_force(due_ms, now_ms, slack) => {
                past_due = Some((due_ms, Known::Upcoming { due_ms }));
            }
            (Some(_), None) => {
                q.pop_front();
            }
            (None, _) => {}
        }
        let (at_ms, due_ms) = self.expect[b as usize];
        if due_ms > now_ms {
            return Known::Expect { at_ms, due_ms };
        }
        if due_ms > 0 && in_force(due_ms, now_ms, slack) && past_due.is_none_or(|(t, _)| at_ms >= t)
        {
            past_due = Some((at_ms, Known::Expect { at_ms, due_ms }));
        }
        let at = self.done_at[b as usize];
        let capped = |ttl: u64| now_ms.saturating_sub(at) >= self.clock(ttl);
        if at != u64::MAX
            && !self.spec.ttl_ms.is_some_and(capped)
            && past_due.as_ref().is_none_or(|&(t, _)| at >= t)
        {
            return Known::Done { at_ms: at };
        }
        past_due.map_or(Known::None, |(_, k)| k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace() -> Trace {
        // Block 1 (dense 0) is read by all three requests; 2 (dense 1) only by the first;
        // 3 (dense 2) by the last two.
        Trace::parse(
            "{\"timestamp\": 0, \"hash_ids\": [1, 2]}\n\
             {\"timestamp\": 10, \"hash_ids\": [1, 3]}\n\
             {\"timestamp\": 20, \"hash_ids\": [1, 3]}\n",
        )
        .unwrap()
    }

    #[test]
    fn the_spec_parses_and_names_what_is_wrong() {
        let s = HintSpec::parse("queue:64,last:0.5@100,wrong:0.05").unwrap();
        assert_eq!((s.queue, s.last_share, s.last_delay_ms), (64, 0.5, 100));
        assert_eq!(s.wrong_share, 0.05);
        for (bad, says) in [
            ("queue", "KIND:VALUE"),
            ("queue:x", "number of requests"),
            ("last:2", "share"),
            ("last:0.5@soon", "delay"),
            ("soon:1", "unknown hint model"),
            ("wrong:1", "below 1"),
        ] {
            let e = HintSpec::parse(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn the_queue_announces_the_next_requests_until_they_arrive() {
        let t = trace();
        let mut m = HintModel::new(HintSpec::parse("queue:1").unwrap(), &t, 1.0);
        m.arrive(0, 0);
        // Request 1 (blocks 1, 3) is queued: due at 10.
        assert_eq!(m.known(0, 0), Known::Upcoming { due_ms: 10 });
        assert_eq!(m.known(2, 5), Known::Upcoming { due_ms: 10 });
        assert_eq!(m.known(1, 5), Known::None);
        m.arrive(1, 10);
        // Request 2 enters the window, and its read shows once request 1's is due.
        assert_eq!(m.known(2, 15), Known::Upcoming { due_ms: 20 });
        // Past due: held while no turnover is known, then for one turnover.
        assert_eq!(m.known(2, 21), Known::Upcoming { due_ms: 20 });
        m.turnover(5);
        assert_eq!(m.known(2, 24), Known::Upcoming { due_ms: 20 });
        assert_eq!(m.known(2, 25), Known::None);
        assert_eq!(m.block_of(b"all/blk/3"), Some(2));
        assert_eq!(m.block_of(b"all/blk/4"), None);
    }

    /// As in the live table, where a newer hint of a block replaces the older: a read
    /// that came due and then its session's end, the end shows.
    #[test]
    fn a_done_said_after_a_read_came_due_is_what_shows() {
        let t = trace();
        let mut m = HintModel::new(HintSpec::parse("queue:1,last:1").unwrap(), &t, 1.0);
        for (i, at) in [(0, 0), (1, 10), (2, 20)] {
            m.arrive(i, at);
            m.served(i, at);
        }
        // Block 3 (dense 2): request 2's read came due at 20, then it was announced done.
        m.arrive(3, 30);
        assert_eq!(m.known(2, 30), Known::Done { at_ms: 20 });
    }

    #[test]
    fn last_announces_blocks_never_read_again_and_wrong_adds_some_that_are() {
        let t = trace();
        let mut m = HintModel::new(HintSpec::parse("last:1@5,ttl:100").unwrap(), &t, 1.0);
        m.arrive(0, 0);
        m.served(0, 0);
        assert_eq!(m.known(1, 4), Known::None, "announced 5 ms later");
        m.arrive(1, 10);
        assert_eq!(m.known(1, 10), Known::Done { at_ms: 5 });
        assert_eq!(
            m.known(0, 10),
            Known::None,
            "block 1 is read again: not done"
        );
        assert_eq!(m.known(1, 200), Known::None, "past the operator's cap");
        assert_eq!(m.announced, [0, 1, 0, 0]);
        // No cap (the default): a done hint does not lapse with time.
        let mut m = HintModel::new(HintSpec::parse("last:1@5").unwrap(), &t, 1.0);
        m.arrive(0, 0);
        m.served(0, 0);
        m.arrive(1, 10);
        assert_eq!(m.known(1, 1 << 40), Known::Done { at_ms: 5 });
        // Every true hint brings a wrong one (F / (1 - F) = 0.99 / 0.01 > 1).
        let mut w = HintModel::new(HintSpec::parse("last:1,wrong:0.99").unwrap(), &t, 1.0);
        w.arrive(0, 0);
        w.served(0, 0);
        w.arrive(1, 10);
        assert_eq!(w.announced, [0, 1, 1, 0]);
        assert_eq!(w.known(0, 10), Known::Done { at_ms: 0 }, "the wrong one");
    }

    /// With live rules' `--speed`, the simulator's clock is trace time over it: a
    /// queued request's blocks lapse when it arrives on that clock, and a done hint's
    /// delay and ttl (trace-ms) shrink with it.
    #[test]
    fn times_follow_the_speed() {
        let t = trace();
        let mut m = HintModel::new(
            HintSpec::parse("queue:1,last:1@100,ttl:200").unwrap(),
            &t,
            10.0,
        );
        m.arrive(0, 0);
        assert_eq!(m.known(0, 0), Known::Upcoming { due_ms: 1 });
        m.served(0, 0);
        m.arrive(1, 1);
        // Request 1's read is due; request 2's (trace 20 ms) is due at 2 ms, and holds one
        // turnover (1 ms) after.
        m.turnover(1);
        assert_eq!(m.known(0, 2), Known::Upcoming { due_ms: 2 });
        assert_eq!(m.known(0, 3), Known::None);
        m.arrive(2, 12);
        assert_eq!(m.known(1, 12), Known::Done { at_ms: 10 });
        assert_eq!(
            m.known(1, 31),
            Known::None,
            "the ttl is 20 ms on this clock"
        );
    }

    #[test]
    fn expect_announces_blocks_read_again_within_the_window() {
        let t = trace();
        let mut m = HintModel::new(HintSpec::parse("expect:1@15").unwrap(), &t, 1.0);
        m.arrive(0, 0);
        m.served(0, 0);
        // Block 1 (dense 0) is read again at 10 (within 15); block 2 never.
        assert_eq!(
            m.known(0, 5),
            Known::Expect {
                at_ms: 0,
                due_ms: 15
            }
        );
        assert_eq!(m.known(1, 5), Known::None);
        assert!(
            matches!(m.known(0, 30), Known::Expect { .. }),
            "no turnover known yet"
        );
        m.turnover(3);
        assert!(
            matches!(m.known(0, 17), Known::Expect { .. }),
            "one turnover past due"
        );
        assert_eq!(
            m.known(0, 18),
            Known::None,
            "lapsed a turnover past its due time"
        );
        assert_eq!(m.announced, [0, 0, 0, 1]);
        let e = HintSpec::parse("expect:0.5@0").unwrap_err();
        assert!(e.contains("positive"), "{e}");
    }
}

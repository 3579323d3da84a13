//! Least recently used first, reading what the serving stack said of the candidates
//! (moongate's hint API, WIT 0.1.4):
//!
//! 1. blocks announced `done` (their session ended) go first, oldest first;
//! 2. then blocks nothing is known of, by their place in their prefix chain (as the
//!    `prefix-evict` plugin takes them: leaves never found again, leaves found again,
//!    then inner blocks and blocks it never saw put), least recently used first in each
//!    (with `prefix_order` off: plain LRU);
//! 3. blocks a queued request will read (`upcoming`) or an expected turn will
//!    (`expect`) go last, the one due furthest away first, until it is due: then the
//!    block counts as one nothing is known of (moongate keeps an `upcoming` hint one
//!    turnover of the cache past its due time; kept protected, a block a request was announced
//!    to read but did not, its prefix broken before it, cost the live replay most of
//!    the hints' gain).
//!
//! A round in which no candidate has a hint is exactly LRU (the `lru` plugin's order):
//! without hints the prefix order fell below LRU on a slice of the shipped trace. With
//! hints, the prefix order for the blocks nothing is known of was chosen on the first
//! half of the shipped trace only: there it kept 5 % wrong `done` hints at or above LRU
//! on every seed (plain LRU for those blocks fell 0.6 % of the gap below), and the
//! held-out half and the whole trace agreed (docs/policy-science.md 2c).
//!
//! Wrong hints are the danger: a `done` block read again is a miss LRU would not have
//! had, if LRU would have kept it until that read. The plugin guards itself by
//! measuring how often trusting `done` hints cost such a miss, counting only what LRU
//! would have kept (a wrong hint on a block LRU would have let go anyway costs nothing):
//! - a victim it chose first because of its `done` hint that is put again (read, missed
//!   and stored anew) within the time LRU would still have held it (the age of the
//!   round's oldest candidate less the victim's own age, the victim's "slack");
//! - a candidate read after its `done` hint (its age below the hint's) within the
//!   oldest candidate's age of the hint: evicted when hinted, it would have been such a
//!   miss. It is also treated as one nothing is known of.
//!
//! Once the share of such costs among the `done`-hinted blocks measured (the victims,
//! and the candidates read after their hint) is above `max_wrong_share` with
//! confidence (more than `confidence_z` standard deviations of a binomial count above
//! it, after `min_samples`; counts decay by half every `window` samples, so the share
//! follows the source), `done` hints are not trusted and the order is plain LRU for
//! them, except in one round of `explore_every`: those keep measuring the source, and
//! trust returns when the share measured since is no longer above the bound (after
//! `min_samples` again). `upcoming` and `expect` are always used: wrong ones only keep
//! a block longer.
//!
//! Config (JSON, optional): `{"max_wrong_share": 0.01, "confidence_z": 2.5,
//! "min_samples": 400, "window": 5000, "explore_every": 256, "trust_done": true,
//! "prefix_order": true, "max_tracked": 1000000}` (the
//! defaults: the bound, window and sample count were chosen by `benches/hints_guard.py`
//! on the first half of the shipped trace only (with its first 1,200 requests, which
//! CI replays), and are reported on the other half; see docs/policy-science.md 2c).

use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::{BuildHasherDefault, DefaultHasher};

/// A set with a fixed hasher: the default one seeds itself from WASI randomness, which
/// moongate does not give plugins.
type Set = HashSet<u64, BuildHasherDefault<DefaultHasher>>;
/// Victims chosen by their `done` hint: key hash -> (evicted at, slack), in ms.
type Evicted = HashMap<u64, (u64, u64), BuildHasherDefault<DefaultHasher>>;

use moongate_policy_sdk::*;
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Config {
    /// The share of measured `done`-hinted blocks whose hint cost a miss LRU would not
    /// have had, beyond which `done` hints are not trusted.
    max_wrong_share: f64,
    /// How sure: the count of costs must exceed the bound's expected count by this
    /// many binomial standard deviations (an early handful is not a verdict).
    confidence_z: f64,
    /// Samples before the share is judged.
    min_samples: u64,
    /// Counts halve every this many samples.
    window: u64,
    /// Distrusted, one round in this many still uses `done` hints, to measure them.
    explore_every: u64,
    /// Off: `done` hints are never used (upcoming and expect still are).
    trust_done: bool,
    /// Blocks nothing is known of go by their place in their prefix chain, then by
    /// recency; off: by recency alone (plain LRU).
    prefix_order: bool,
    /// Bound of the chain sets (parents, keys seen put): two generations each.
    max_tracked: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            max_wrong_share: 0.01,
            confidence_z: 2.5,
            min_samples: 400,
            window: 5000,
            explore_every: 256,
            trust_done: true,
            prefix_order: true,
            max_tracked: 1_000_000,
        }
    }
}

/// Victims chosen by their `done` hint remembered (by key hash) to see them come back,
/// and candidates seen read after their hint (each counted once).
const REMEMBERED: usize = 1 << 16;

/// A share of samples, halved every `window` samples.
#[derive(Default, Clone, Copy)]
struct Share {
    samples: u64,
    hits: u64,
    total: u64,
}

impl Share {
    fn add(&mut self, samples: u64, hits: u64, window: u64) {
        self.samples += samples;
        self.hits += hits;
        self.total += samples;
        if self.samples >= window.max(2) {
            self.samples /= 2;
            self.hits /= 2;
        }
    }

    /// Above `max` with confidence: more than `z` standard deviations over the count
    /// `max` expects of the samples.
    fn over(&self, max: f64, z: f64, min_samples: u64) -> bool {
        let expected = max * self.samples.max(1) as f64;
        self.total >= min_samples && self.hits as f64 > expected + z * expected.sqrt()
    }
}

struct HintLru {
    cfg: Config,
    trusted: bool,
    /// `done`-hinted blocks measured, and those whose hint cost a miss.
    came_back: Share,
    /// Hinted rounds while distrusted (every `explore_every`-th uses `done` hints).
    rounds: u64,
    remembered: Evicted,
    /// Victims in the order remembered, with when.
    order: VecDeque<(u64, u64)>,
    /// Candidates seen read after their `done` hint.
    seen: Set,
    seen_order: VecDeque<u64>,
    metrics: Option<Metrics>,
    /// Where stored blocks sit in their chains, learned from puts.
    chains: Chains,
}

/// The plugin's own metrics (none in the native unit tests: no host there).
struct Metrics {
    by_hint: u32,
    came_back: u32,
    read_after: u32,
    trusted: u32,
}

impl Policy for HintLru {
    fn new(config: &[u8]) -> Result<(Self, Interest), String> {
        let cfg: Config = if config.is_empty() {
            Config::default()
        } else {
            serde_json::from_slice(config).map_err(|e| format!("hint-lru config: {e}"))?
        };
        if !(0.0..=1.0).contains(&cfg.max_wrong_share) {
            return Err("hint-lru config: max_wrong_share must be within 0 and 1".into());
        }
        if cfg.max_tracked < 2 {
            return Err("hint-lru config: max_tracked must be at least 2".into());
        }
        let mut p = HintLru::with(cfg);
        p.metrics = Some(Metrics {
            by_hint: host::register_counter(
                "done_first_victims",
                "victims chosen first because of a done hint",
            )?,
            came_back: host::register_counter(
                "done_victims_back",
                "of those, put again while LRU would still have held them (the hint cost a miss)",
            )?,
            read_after: host::register_counter(
                "done_read_soon_after_hint",
                "done candidates read within LRU's window of their hint (a miss, evicted when hinted)",
            )?,
            trusted: host::register_gauge("done_hints_trusted", "1 while done hints are trusted")?,
        });
        p.report(0, 0);
        // Puts are watched for victims coming back; they are admitted unchanged.
        Ok((p, Interest::PUT | Interest::EVICT))
    }

    fn on_put(&mut self, call: PutCall) -> PutDecision {
        self.on_put_keys(&call.keys);
        let back = self.saw_put(&call.keys, now_ms());
        self.report(0, back);
        PutDecision::admit_all()
    }

    fn evict(&mut self, call: EvictCall) -> Vec<u32> {
        // A round with no hint at all: plain LRU (the prefix order was below LRU on CI's
        // slice without hints: 388 hits against 391 at 5 %).
        let order = lru_order(&call.age_ms, &call.sizes);
        take(order, &call.sizes, call.bytes_needed)
    }

    fn evict_hinted(&mut self, call: HintedEvictCall) -> Vec<Victim> {
        let (victims, by_hint) = self.choose(call, now_ms());
        self.report(by_hint, 0);
        victims
    }
}

impl HintLru {
    /// Learns a put's chain (no host calls: the hook's part a native test can run).
    fn on_put_keys(&mut self, keys: &PackedKeys) {
        if self.cfg.prefix_order {
            self.chains.learn(keys);
        }
    }

    fn with(cfg: Config) -> HintLru {
        HintLru {
            chains: Chains::new(cfg.max_tracked),
            trusted: cfg.trust_done,
            cfg,
            came_back: Share::default(),
            rounds: 0,
            remembered: Evicted::default(),
            order: VecDeque::new(),
            seen: Set::default(),
            seen_order: VecDeque::new(),
            metrics: None,
        }
    }

    fn report(&self, by_hint: u64, back: u64) {
        if let Some(m) = &self.metrics {
            host::counter_add(m.by_hint, by_hint);
            host::counter_add(m.came_back, back);
            host::gauge_set(m.trusted, i64::from(self.trusted));
        }
    }

    /// Counts the keys of a put (at `now`, ms) that are victims chosen by their `done`
    /// hint and back within their slack (later, LRU would have missed them too).
    fn saw_put(&mut self, keys: &PackedKeys, now: u64) -> u64 {
        if self.remembered.is_empty() {
            return 0;
        }
        let back = keys
            .iter()
            .filter_map(|k| self.remembered.remove(&key_hash(k)))
            .filter(|&(at, slack)| now.saturating_sub(at) <= slack)
            .count() as u64;
        if back > 0 {
            self.came_back.add(0, back, self.cfg.window);
            self.judge();
        }
        back
    }

    /// Whether `done` hints are trusted, from what was measured: distrust starts a
    /// fresh measure, which brings trust back once it is within the bound.
    fn judge(&mut self) {
        let (max, min) = (self.cfg.max_wrong_share, self.cfg.min_samples);
        let over = self.came_back.over(max, self.cfg.confidence_z, min);
        if !self.cfg.trust_done {
            self.trusted = false;
        } else if self.trusted && over {
            self.trusted = false;
            self.came_back = Share::default();
        } else if !self.trusted && self.came_back.total >= min && !over {
            self.trusted = true;
        }
    }

    /// Counts the candidates read after their `done` hint soon enough that evicting
    /// them when hinted would have cost a miss (`oldest`: the age LRU lets a block
    /// reach), each once.
    fn saw_read_after_hint(&mut self, call: &EvictCall, hints: &[CandidateHint], oldest: u64) {
        let mut costly = 0u64;
        for (i, h) in hints.iter().enumerate() {
            let Some(&age) = call.age_ms.get(i) else {
                break;
            };
            if h.kind != HintKind::Done || age >= h.age_ms || h.age_ms - age > oldest {
                continue;
            }
            let k = key_hash(call.keys.get(i));
            if self.seen.insert(k) {
                self.seen_order.push_back(k);
                costly += 1;
            }
        }
        while self.seen_order.len() > REMEMBERED {
            if let Some(old) = self.seen_order.pop_front() {
                self.seen.remove(&old);
            }
        }
        if costly > 0 {
            self.came_back.add(costly, costly, self.cfg.window);
            if let Some(m) = &self.metrics {
                host::counter_add(m.read_after, costly);
            }
        }
    }

    /// The victims of a hinted round at `now` (ms), and how many were chosen by their
    /// `done` hint.
    fn choose(&mut self, call: HintedEvictCall, now: u64) -> (Vec<Victim>, u64) {
        let HintedEvictCall { call, hints, .. } = call;
        let oldest = call.age_ms.iter().copied().max().unwrap_or(0);
        self.saw_read_after_hint(&call, &hints, oldest);
        self.judge();
        let trust = self.trusted || {
            self.rounds += 1;
            self.cfg.trust_done && self.rounds.is_multiple_of(self.cfg.explore_every.max(1))
        };
        let n = call.sizes.len();
        // Per candidate, once (the sort compares each many times): 0 done, 1-3 nothing
        // known (by chain place, or 1 for all with `prefix_order` off), 4 upcoming.
        let classes: Vec<u8> = (0..n)
            .map(|i| {
                let unknown = || {
                    if self.cfg.prefix_order {
                        1 + self.chains.place(call.keys.get(i), call.hits[i]) as u8
                    } else {
                        1
                    }
                };
                let Some(h) = hints.get(i) else {
                    return unknown();
                };
                match h.kind {
                    HintKind::Done if trust && call.age_ms[i] >= h.age_ms => 0,
                    // Protected until due: a queued request's read that did not come
                    // when announced (its prefix broke before this block, or it was
                    // dropped) must not keep the block.
                    HintKind::Upcoming | HintKind::Expect if h.due_in_ms > 0 => 4,
                    _ => unknown(),
                }
            })
            .collect();
        let class = |i: usize| classes[i];
        let due = |i: usize| hints.get(i).map_or(0, |h| h.due_in_ms);
        let mut idx: Vec<u32> = (0..n as u32).collect();
        idx.sort_by(|&a, &b| {
            let (a, b) = (a as usize, b as usize);
            class(a)
                .cmp(&class(b))
                .then_with(|| {
                    if class(a) == 4 {
                        due(b).cmp(&due(a))
                    } else {
                        std::cmp::Ordering::Equal
                    }
                })
                .then(call.age_ms[b].cmp(&call.age_ms[a]))
                .then(call.sizes[b].cmp(&call.sizes[a]))
        });
        let chosen = take(idx, &call.sizes, call.bytes_needed);
        let mut by_hint = 0u64;
        for &i in &chosen {
            if class(i as usize) == 0 {
                by_hint += 1;
                let h = key_hash(call.keys.get(i as usize));
                let slack = oldest.saturating_sub(call.age_ms[i as usize]);
                self.remembered.insert(h, (now, slack));
                self.order.push_back((h, now));
            }
        }
        while self.order.len() > REMEMBERED {
            // Forgotten only if not evicted again since (a later entry stands for it).
            if let Some((old, at)) = self.order.pop_front()
                && self.remembered.get(&old).is_some_and(|&(t, _)| t == at)
            {
                self.remembered.remove(&old);
            }
        }
        self.came_back.add(by_hint, 0, self.cfg.window);
        let victims = chosen
            .into_iter()
            .map(|index| Victim {
                index,
                scope: EvictScope::Memory,
            })
            .collect();
        (victims, by_hint)
    }
}

/// The host's clock, in ms.
fn now_ms() -> u64 {
    host::now_ns() / 1_000_000
}

/// Oldest first, larger first among equals (the `lru` plugin's order).
fn lru_order(ages: &[u64], sizes: &[u64]) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..sizes.len() as u32).collect();
    idx.sort_by(|&a, &b| {
        let (a, b) = (a as usize, b as usize);
        ages[b].cmp(&ages[a]).then(sizes[b].cmp(&sizes[a]))
    });
    idx
}

/// The first of `order` until `need` bytes are covered.
fn take(order: Vec<u32>, sizes: &[u64], need: u64) -> Vec<u32> {
    let mut freed = 0u64;
    let mut out = Vec::new();
    for i in order {
        if freed >= need {
            break;
        }
        freed = freed.saturating_add(sizes[i as usize]);
        out.push(i);
    }
    out
}

export_policy!(HintLru);

#[cfg(test)]
mod tests {
    use super::*;

    fn hint(kind: HintKind, age_ms: u64, due_in_ms: u64) -> CandidateHint {
        CandidateHint {
            kind,
            age_ms,
            due_in_ms,
        }
    }

    const NONE: CandidateHint = CandidateHint {
        kind: HintKind::None,
        age_ms: 0,
        due_in_ms: 0,
    };

    fn call(keys: &[&str], ages: &[u64], need: u64, hints: Vec<CandidateHint>) -> HintedEvictCall {
        HintedEvictCall {
            call: EvictCall {
                keys: PackedKeys::from_keys(keys),
                sizes: vec![10; ages.len()],
                tiers: vec![Tier::Memory; ages.len()],
                age_ms: ages.to_vec(),
                hits: vec![0; ages.len()],
                bytes_needed: need,
            },
            on_disk: Vec::new(),
            hints,
        }
    }

    fn victims(p: &mut HintLru, c: HintedEvictCall) -> Vec<u32> {
        p.choose(c, 0).0.into_iter().map(|v| v.index).collect()
    }

    #[test]
    fn blocks_nothing_is_known_of_go_by_their_place_in_the_chain_then_by_recency() {
        let cfg = |prefix_order| Config {
            prefix_order,
            ..Config::default()
        };
        // p1 (a parent, oldest), leaf (never read, newest), never put (older).
        let keys = ["p1", "leaf", "other"];
        for prefix_order in [true, false] {
            let mut p = HintLru::with(cfg(prefix_order));
            p.on_put_keys(&PackedKeys::from_keys(&["p1", "leaf"]));
            let hinted = victims(&mut p, call(&keys, &[100, 1, 50], 10, vec![NONE; 3]));
            let want: &[u32] = if prefix_order { &[1] } else { &[0] };
            assert_eq!(hinted, want, "prefix_order {prefix_order}");
            // A round with no hint at all is LRU either way.
            let plain = p.evict(call(&keys, &[100, 1, 50], 10, vec![]).call);
            assert_eq!(plain, [0]);
        }
    }

    #[test]
    fn done_first_then_lru_then_upcoming_due_furthest_first() {
        let mut p = HintLru::with(Config::default());
        let hints = vec![
            hint(HintKind::Upcoming, 5, 100),
            NONE,
            hint(HintKind::Done, 10, 0),
            NONE,
            hint(HintKind::Expect, 5, 9000),
        ];
        // The done one is the youngest but not read since its hint (20 >= 10).
        let c = call(
            &["a", "b", "c", "d", "e"],
            &[900, 300, 20, 500, 800],
            50,
            hints,
        );
        assert_eq!(victims(&mut p, c), [2, 3, 1, 4, 0]);
    }

    #[test]
    fn without_hints_it_is_lru() {
        let mut p = HintLru::with(Config::default());
        let (keys, ages) = (["a", "b", "c", "d"], [5, 900, 40, 300]);
        let hinted = victims(&mut p, call(&keys, &ages, 30, vec![NONE; 4]));
        let plain = p.evict(call(&keys, &ages, 30, Vec::new()).call);
        assert_eq!(hinted, plain);
        assert_eq!(plain, [1, 3, 2]);
    }

    #[test]
    fn a_done_block_read_after_its_hint_is_not_trusted() {
        let mut p = HintLru::with(Config::default());
        // Read 5 ms ago, hinted done 50 ms ago: plain LRU for it.
        let c = call(
            &["a", "b"],
            &[5, 100],
            10,
            vec![hint(HintKind::Done, 50, 0), NONE],
        );
        assert_eq!(victims(&mut p, c), [1]);
    }

    #[test]
    fn a_due_upcoming_hint_no_longer_protects_its_block() {
        let mut p = HintLru::with(Config::default());
        // a, b: due (read or not): plain LRU. c: not yet due, protected.
        let c = call(
            &["a", "b", "c", "d"],
            &[5, 900, 100, 3],
            30,
            vec![
                hint(HintKind::Upcoming, 50, 0),
                hint(HintKind::Upcoming, 50, 0),
                hint(HintKind::Upcoming, 50, 30),
                NONE,
            ],
        );
        assert_eq!(victims(&mut p, c), [1, 0, 3]);
    }

    /// Victims chosen by their hint that come back (put again) stop the trust; done
    /// candidates that are no longer read after their hint bring it back.
    #[test]
    fn a_source_whose_done_victims_come_back_is_distrusted_then_trusted_again() {
        let mut p = HintLru::with(Config {
            max_wrong_share: 0.02,
            confidence_z: 0.0,
            min_samples: 20,
            window: 100,
            explore_every: 8,
            ..Config::default()
        });
        let mut round = 0;
        while p.trusted {
            let key = format!("k{round}");
            let c = call(
                &[key.as_str(), "old"],
                &[60, 100],
                10,
                vec![hint(HintKind::Done, 50, 0), NONE],
            );
            let v = victims(&mut p, c);
            if !p.trusted {
                break;
            }
            assert_eq!(v, [0], "trusted: the done block first");
            // One in ten comes back: 10 % wrong, over the 2 % allowed.
            if round % 10 == 0 {
                p.saw_put(&PackedKeys::from_keys(&[key.as_str()]), 0);
            }
            round += 1;
            assert!(round < 100, "never distrusted");
        }
        assert!(round >= 20, "judged after min_samples only ({round})");
        let done = |key: &str| {
            call(
                &[key, "old"],
                &[60, 100],
                10,
                vec![hint(HintKind::Done, 50, 0), NONE],
            )
        };
        // Distrusted: LRU, except one round in eight that keeps measuring the source.
        let picks: Vec<Vec<u32>> = (0..8)
            .map(|i| victims(&mut p, done(&format!("x{i}"))))
            .collect();
        assert_eq!(
            picks.iter().filter(|v| v.as_slice() == [0]).count(),
            1,
            "{picks:?}"
        );
        // Its explored victims keep coming back: it stays distrusted.
        for i in 0..400 {
            let key = format!("y{i}");
            if victims(&mut p, done(&key)) == [0] {
                p.saw_put(&PackedKeys::from_keys(&[key.as_str()]), 0);
            }
        }
        assert!(!p.trusted);
        // They stop coming back: trusted again once enough were measured.
        for i in 0..4000 {
            victims(&mut p, done(&format!("z{i}")));
        }
        assert!(p.trusted, "a source that improves is trusted again");
    }
    /// A `done`-first victim put again later than LRU would have held it (the oldest
    /// candidate's age less its own) cost nothing LRU would not have lost: not counted.
    #[test]
    fn a_victim_back_after_lru_would_have_let_it_go_is_no_cost() {
        let mut p = HintLru::with(Config::default());
        // Oldest candidate 100 ms, the done victim 60 ms: LRU would have held it 40 ms.
        let c = call(
            &["soon", "old"],
            &[60, 100],
            10,
            vec![hint(HintKind::Done, 50, 0), NONE],
        );
        assert_eq!(p.choose(c, 1000).0.len(), 1);
        let c = call(
            &["late", "old"],
            &[60, 100],
            10,
            vec![hint(HintKind::Done, 50, 0), NONE],
        );
        assert_eq!(p.choose(c, 1000).0.len(), 1);
        assert_eq!(p.saw_put(&PackedKeys::from_keys(&["soon"]), 1040), 1);
        assert_eq!(p.saw_put(&PackedKeys::from_keys(&["late"]), 1041), 0);
        assert_eq!((p.came_back.total, p.came_back.hits), (2, 1));
    }

    /// A candidate read after its `done` hint is measured once, as a cost when the read
    /// came within the age LRU lets a block reach (evicted when hinted, it would have
    /// been a miss), and not when it came later.
    #[test]
    fn a_done_block_read_soon_after_its_hint_counts_once_as_a_cost() {
        let mut p = HintLru::with(Config::default());
        let round = |p: &mut HintLru| {
            // a: hinted 90 ms ago, read 80 ms ago (10 ms after the hint); b: hinted
            // 900 ms ago, read 5 ms ago (895 ms after, past the oldest age, 500).
            let c = call(
                &["a", "b", "c"],
                &[80, 5, 500],
                10,
                vec![
                    hint(HintKind::Done, 90, 0),
                    hint(HintKind::Done, 900, 0),
                    NONE,
                ],
            );
            victims(p, c)
        };
        assert_eq!(round(&mut p), [2], "both read after their hint: plain LRU");
        assert_eq!((p.came_back.total, p.came_back.hits), (1, 1));
        round(&mut p);
        assert_eq!(
            (p.came_back.total, p.came_back.hits),
            (1, 1),
            "counted once"
        );
    }

    /// An early handful of costs is not a verdict: distrust needs the count to stand
    /// `confidence_z` deviations above what the bound expects.
    #[test]
    fn distrust_waits_for_confidence() {
        let s = Share {
            samples: 1000,
            hits: 12,
            total: 1000,
        };
        // 0.75 % of 1,000 expects 7.5 (sd 2.7): 12 is over the bound, not by 2.5 sd.
        assert!(s.over(0.0075, 0.0, 200));
        assert!(!s.over(0.0075, 2.5, 200));
        let s = Share { hits: 15, ..s };
        assert!(s.over(0.0075, 2.5, 200));
    }
}

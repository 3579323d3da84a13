//! Least recently used first, reading what the serving stack said of the candidates
//! (moongate's hint API, WIT 0.1.4):
//!
//! 1. blocks announced `done` (their session ended) go first, oldest first;
//! 2. then blocks nothing is known of, least recently used first (plain LRU);
//! 3. blocks a queued request will read (`upcoming`) or an expected turn will
//!    (`expect`) go last, the one due furthest away first, until it is due: then the
//!    block counts as one nothing is known of (moongate keeps an `upcoming` hint
//!    `hints.ttl_ms` past its due time; kept protected, a block a request was announced
//!    to read but did not, its prefix broken before it, cost the live replay most of
//!    the hints' gain).
//!
//! Without hints it is exactly LRU (the `lru` plugin's order).
//!
//! Wrong hints are the danger: a `done` block read again is a miss LRU would not have
//! had. The plugin guards itself by measuring how often it was wrong to trust them:
//! - a victim it chose first because of its `done` hint that is put again (it was
//!   read, missed and stored anew) came back: the hint was wrong;
//! - a candidate read after its `done` hint (its age below the hint's) shows a wrong
//!   hint too, and is treated as one nothing is known of.
//!
//! Once more than `max_wrong_share` of its `done`-first victims came back (after
//! `min_samples` of them; counts decay by half every `window` victims, so the share
//! follows the source), `done` hints are not trusted and the order is plain LRU for
//! them, except in one round of `explore_every`: those keep measuring the source, and
//! trust returns when the share measured since falls back within the bound (after
//! `min_samples` again). `upcoming` and `expect` are always used: wrong ones only keep
//! a block longer.
//!
//! Config (JSON, optional): `{"max_wrong_share": 0.02, "min_samples": 200,
//! "window": 5000, "explore_every": 64, "trust_done": true}` (the defaults: the best of
//! the settings tried in `moongate sim` on the shipped trace; see
//! docs/policy-science.md).

use std::collections::{HashSet, VecDeque};
use std::hash::{BuildHasherDefault, DefaultHasher};

/// A set with a fixed hasher: the default one seeds itself from WASI randomness, which
/// moongate does not give plugins.
type Set = HashSet<u64, BuildHasherDefault<DefaultHasher>>;

use moongate_policy_sdk::*;
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Config {
    /// The share of `done`-first victims that came back beyond which `done` hints are
    /// not trusted.
    max_wrong_share: f64,
    /// Samples before the share is judged.
    min_samples: u64,
    /// Counts halve every this many samples.
    window: u64,
    /// Distrusted, one round in this many still uses `done` hints, to measure them.
    explore_every: u64,
    /// Off: `done` hints are never used (upcoming and expect still are).
    trust_done: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            max_wrong_share: 0.02,
            min_samples: 200,
            window: 5000,
            explore_every: 64,
            trust_done: true,
        }
    }
}

/// Victims chosen by their `done` hint remembered (by key hash) to see them come back.
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

    fn over(&self, max: f64, min_samples: u64) -> bool {
        self.total >= min_samples && self.hits as f64 > max * self.samples.max(1) as f64
    }
}

struct HintLru {
    cfg: Config,
    trusted: bool,
    /// `done`-first victims, and those of them put again.
    came_back: Share,
    /// Hinted rounds while distrusted (every `explore_every`-th uses `done` hints).
    rounds: u64,
    remembered: Set,
    order: VecDeque<u64>,
    metrics: Option<Metrics>,
}

/// The plugin's own metrics (none in the native unit tests: no host there).
struct Metrics {
    by_hint: u32,
    came_back: u32,
    trusted: u32,
}

/// FNV-1a of a key.
fn hash(key: &[u8]) -> u64 {
    key.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
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
        let mut p = HintLru::with(cfg);
        p.metrics = Some(Metrics {
            by_hint: host::register_counter(
                "done_first_victims",
                "victims chosen first because of a done hint",
            )?,
            came_back: host::register_counter(
                "done_victims_back",
                "of those, put again (the hint was wrong)",
            )?,
            trusted: host::register_gauge("done_hints_trusted", "1 while done hints are trusted")?,
        });
        p.report(0, 0);
        // Puts are watched for victims coming back; they are admitted unchanged.
        Ok((p, Interest::PUT | Interest::EVICT))
    }

    fn on_put(&mut self, call: PutCall) -> PutDecision {
        let back = self.saw_put(&call.keys);
        self.report(0, back);
        PutDecision::admit_all()
    }

    fn evict(&mut self, call: EvictCall) -> Vec<u32> {
        let order = lru_order(&call.age_ms, &call.sizes);
        take(order, &call.sizes, call.bytes_needed)
    }

    fn evict_hinted(&mut self, call: HintedEvictCall) -> Vec<Victim> {
        let (victims, by_hint) = self.choose(call);
        self.report(by_hint, 0);
        victims
    }
}

impl HintLru {
    fn with(cfg: Config) -> HintLru {
        HintLru {
            trusted: cfg.trust_done,
            cfg,
            came_back: Share::default(),
            rounds: 0,
            remembered: Set::default(),
            order: VecDeque::new(),
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

    /// Counts the keys of a put that are victims chosen by their `done` hint.
    fn saw_put(&mut self, keys: &PackedKeys) -> u64 {
        if self.remembered.is_empty() {
            return 0;
        }
        let back = keys
            .iter()
            .filter(|k| self.remembered.remove(&hash(k)))
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
        let over = self.came_back.over(max, min);
        if !self.cfg.trust_done {
            self.trusted = false;
        } else if self.trusted && over {
            self.trusted = false;
            self.came_back = Share::default();
        } else if !self.trusted && self.came_back.total >= min && !over {
            self.trusted = true;
        }
    }

    /// The victims of a hinted round, and how many were chosen by their `done` hint.
    fn choose(&mut self, call: HintedEvictCall) -> (Vec<Victim>, u64) {
        let HintedEvictCall { call, hints, .. } = call;
        self.judge();
        let trust = self.trusted || {
            self.rounds += 1;
            self.cfg.trust_done && self.rounds.is_multiple_of(self.cfg.explore_every.max(1))
        };
        let n = call.sizes.len();
        let class = |i: usize| -> u8 {
            let Some(h) = hints.get(i) else { return 1 };
            match h.kind {
                HintKind::Done if trust && call.age_ms[i] >= h.age_ms => 0,
                // Protected until due: a queued request's read that did not come
                // when announced (its prefix broke before this block, or it was
                // dropped) must not keep the block.
                HintKind::Upcoming | HintKind::Expect if h.due_in_ms > 0 => 2,
                _ => 1,
            }
        };
        let due = |i: usize| hints.get(i).map_or(0, |h| h.due_in_ms);
        let mut idx: Vec<u32> = (0..n as u32).collect();
        idx.sort_by(|&a, &b| {
            let (a, b) = (a as usize, b as usize);
            class(a)
                .cmp(&class(b))
                .then_with(|| {
                    if class(a) == 2 {
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
                let h = hash(call.keys.get(i as usize));
                if self.remembered.insert(h) {
                    self.order.push_back(h);
                }
            }
        }
        while self.order.len() > REMEMBERED {
            if let Some(old) = self.order.pop_front() {
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
        p.choose(c).0.into_iter().map(|v| v.index).collect()
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
                p.saw_put(&PackedKeys::from_keys(&[key.as_str()]));
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
                p.saw_put(&PackedKeys::from_keys(&[key.as_str()]));
            }
        }
        assert!(!p.trusted);
        // They stop coming back: trusted again once enough were measured.
        for i in 0..4000 {
            victims(&mut p, done(&format!("z{i}")));
        }
        assert!(p.trusted, "a source that improves is trusted again");
    }
}

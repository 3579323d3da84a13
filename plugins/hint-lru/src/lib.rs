//! Least recently used first, reading what the serving stack said of the candidates
//! (moongate's hint API, WIT 0.1.4):
//!
//! 1. blocks announced `done` (their session ended) go first, oldest first;
//! 2. then blocks nothing is known of, least recently used first (plain LRU);
//! 3. blocks a queued request will read (`upcoming`) or an expected turn will
//!    (`expect`) go last, the one due furthest away first.
//!
//! Without hints it is exactly LRU (the `lru` plugin's order).
//!
//! Wrong hints are the danger: a `done` block read again is a miss LRU would not have
//! had. The plugin guards itself: a candidate read after its `done` hint (its age below
//! the hint's) shows a wrong hint; such a candidate is treated as one nothing is known
//! of, and once more than `max_wrong_share` of the `done` candidates seen (after
//! `min_samples`) were wrong, `done` hints are no longer trusted at all until the share
//! falls back (an exponentially weighted share, so a source that improves is trusted
//! again).
//!
//! Config (JSON, optional): `{"max_wrong_share": 0.02, "min_samples": 50,
//! "trust_done": true}`.

use moongate_policy_sdk::*;
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Config {
    /// The share of `done` candidates found read after their hint beyond which `done`
    /// hints are not trusted.
    max_wrong_share: f64,
    /// `done` candidates seen before the share is judged.
    min_samples: u64,
    /// Off: `done` hints are never used (upcoming and expect still are).
    trust_done: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            max_wrong_share: 0.02,
            min_samples: 50,
            trust_done: true,
        }
    }
}

/// The weight of one new sample in the wrong share (about the last 500 samples count).
const ALPHA: f64 = 1.0 / 500.0;

struct HintLru {
    cfg: Config,
    /// `done` candidates seen, and the weighted share of those read after their hint.
    seen: u64,
    wrong_share: f64,
    done_seen: u32,
    done_wrong: u32,
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
        let p = HintLru {
            cfg,
            seen: 0,
            wrong_share: 0.0,
            done_seen: host::register_counter(
                "done_hinted_candidates",
                "eviction candidates with a done hint",
            )?,
            done_wrong: host::register_counter(
                "done_hints_wrong",
                "done-hinted candidates read after their hint",
            )?,
            trusted: host::register_gauge("done_hints_trusted", "1 while done hints are trusted")?,
        };
        host::gauge_set(p.trusted, i64::from(p.cfg.trust_done));
        Ok((p, Interest::EVICT))
    }

    fn evict(&mut self, call: EvictCall) -> Vec<u32> {
        let order = lru_order(&call.age_ms, &call.sizes);
        take(order, &call.sizes, call.bytes_needed)
    }

    fn evict_hinted(&mut self, call: HintedEvictCall) -> Vec<Victim> {
        let (victims, judged) = self.choose(call);
        host::counter_add(self.done_seen, judged.seen);
        host::counter_add(self.done_wrong, judged.wrong);
        host::gauge_set(self.trusted, i64::from(judged.trust));
        victims
    }
}

/// What a round said of the `done` hints.
struct Judged {
    seen: u64,
    wrong: u64,
    trust: bool,
}

impl HintLru {
    /// The victims of a hinted round (no host calls: the unit tests run it natively).
    fn choose(&mut self, call: HintedEvictCall) -> (Vec<Victim>, Judged) {
        let HintedEvictCall { call, hints, .. } = call;
        let judged = self.judge(&hints, &call.age_ms);
        let trust = judged.trust;
        let n = call.sizes.len();
        let class = |i: usize| -> u8 {
            let Some(h) = hints.get(i) else { return 1 };
            match h.kind {
                HintKind::Done if trust && call.age_ms[i] >= h.age_ms => 0,
                HintKind::Upcoming | HintKind::Expect => 2,
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
        let victims = take(idx, &call.sizes, call.bytes_needed)
            .into_iter()
            .map(|index| Victim {
                index,
                scope: EvictScope::Memory,
            })
            .collect();
        (victims, judged)
    }

    /// Counts this round's `done` candidates, how many were read after their hint, and
    /// says whether `done` hints are trusted.
    fn judge(&mut self, hints: &[CandidateHint], ages: &[u64]) -> Judged {
        let (mut seen, mut wrong) = (0u64, 0u64);
        for (h, &age) in hints.iter().zip(ages) {
            if h.kind == HintKind::Done {
                seen += 1;
                let w = age < h.age_ms;
                wrong += u64::from(w);
                self.wrong_share += ALPHA * (f64::from(u8::from(w)) - self.wrong_share);
            }
        }
        self.seen = self.seen.saturating_add(seen);
        let trust = self.cfg.trust_done
            && (self.seen < self.cfg.min_samples || self.wrong_share <= self.cfg.max_wrong_share);
        Judged { seen, wrong, trust }
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

    fn plugin(cfg: Config) -> HintLru {
        HintLru {
            cfg,
            seen: 0,
            wrong_share: 0.0,
            done_seen: 0,
            done_wrong: 0,
            trusted: 0,
        }
    }

    fn hint(kind: HintKind, age_ms: u64, due_in_ms: u64) -> CandidateHint {
        CandidateHint {
            kind,
            age_ms,
            due_in_ms,
        }
    }

    fn call(ages: &[u64], need: u64, hints: Vec<CandidateHint>) -> HintedEvictCall {
        let keys: Vec<String> = (0..ages.len()).map(|i| format!("k{i}")).collect();
        HintedEvictCall {
            call: EvictCall {
                keys: PackedKeys::from_keys(&keys),
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

    const NONE: CandidateHint = CandidateHint {
        kind: HintKind::None,
        age_ms: 0,
        due_in_ms: 0,
    };

    #[test]
    fn done_first_then_lru_then_upcoming_due_furthest_first() {
        let mut p = plugin(Config::default());
        let hints = vec![
            hint(HintKind::Upcoming, 5, 100),
            NONE,
            hint(HintKind::Done, 10, 0),
            NONE,
            hint(HintKind::Expect, 5, 9000),
        ];
        // Ages: the upcoming one is the oldest; the done one the youngest but not read
        // since its hint (age 20 >= hint age 10).
        let c = call(&[900, 300, 20, 500, 800], 50, hints);
        assert_eq!(victims(&mut p, c), [2, 3, 1, 4, 0]);
    }

    #[test]
    fn without_hints_it_is_lru() {
        let mut p = plugin(Config::default());
        let ages = [5, 900, 40, 300];
        let hinted = victims(&mut p, call(&ages, 30, vec![NONE; 4]));
        let plain = p.evict(call(&ages, 30, Vec::new()).call);
        assert_eq!(hinted, plain);
        assert_eq!(plain, [1, 3, 2]);
    }

    #[test]
    fn a_done_block_read_after_its_hint_is_not_trusted_and_a_wrong_source_is_dropped() {
        let mut p = plugin(Config {
            min_samples: 10,
            ..Config::default()
        });
        // Read 5 ms ago, hinted done 50 ms ago: the hint was wrong; plain LRU for it.
        let c = call(&[5, 100], 10, vec![hint(HintKind::Done, 50, 0), NONE]);
        assert_eq!(victims(&mut p, c), [1]);
        // Many wrong hints: done hints are no longer trusted, even sound-looking ones.
        for _ in 0..20 {
            p.judge(&[hint(HintKind::Done, 50, 0)], &[5]);
        }
        let c = call(&[60, 100], 10, vec![hint(HintKind::Done, 50, 0), NONE]);
        assert_eq!(victims(&mut p, c), [1], "LRU order: the older one");
        // Right hints again bring the trust back.
        for _ in 0..5000 {
            p.judge(&[hint(HintKind::Done, 50, 0)], &[60]);
        }
        let c = call(&[60, 100], 10, vec![hint(HintKind::Done, 50, 0), NONE]);
        assert_eq!(victims(&mut p, c), [0]);
    }
}

//! Eviction by age (least recently used first, larger first among equals) until the
//! bytes needed are covered; lookups offer memory replicas before other tiers. Puts are
//! admitted unchanged, after counting keys and bytes into plugin metrics: the example of
//! a plugin that registers its own metrics, and the guest the host benchmarks use.
//!
//! With an SSD tier (the owner topology), victims lose their memory copy and keep the one
//! on the SSD; config (JSON, optional) `{"whole_key_after_ms": N}` drops the whole key,
//! the SSD copy too, of a victim not read for N ms: cold keys give their SSD room back.

use moongate_policy_sdk::*;
use serde::Deserialize;

struct Lru {
    keys: u32,
    bytes: u32,
    /// Victims this cold (ms since last read) lose their SSD copy too.
    whole_key_after_ms: Option<u64>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Config {
    whole_key_after_ms: Option<u64>,
}

impl Policy for Lru {
    fn new(config: &[u8]) -> Result<(Self, Interest), String> {
        let cfg: Config = if config.is_empty() {
            Config::default()
        } else {
            serde_json::from_slice(config).map_err(|e| format!("lru config: {e}"))?
        };
        let keys = host::register_counter("put_keys", "keys seen in puts")?;
        let bytes = host::register_counter("put_bytes", "value bytes seen in puts")?;
        Ok((
            Lru {
                keys,
                bytes,
                whole_key_after_ms: cfg.whole_key_after_ms,
            },
            Interest::PUT | Interest::LOOKUP | Interest::EVICT | Interest::OBSERVE,
        ))
    }

    fn on_put(&mut self, call: PutCall) -> PutDecision {
        host::counter_add(self.keys, call.keys.len() as u64);
        host::counter_add(
            self.bytes,
            call.sizes.iter().fold(0u64, |a, &s| a.saturating_add(s)),
        );
        PutDecision::admit_all()
    }

    fn on_lookup(&mut self, call: LookupCall) -> Vec<Vec<u32>> {
        let mut at = 0usize;
        let mut out = Vec::with_capacity(call.counts.len());
        for &n in &call.counts {
            let tiers = &call.tiers[at..at + n as usize];
            let mut order: Vec<u32> = (0..n).collect();
            order.sort_by_key(|&i| !matches!(tiers[i as usize], Tier::Memory));
            out.push(order);
            at += n as usize;
        }
        out
    }

    fn evict(&mut self, call: EvictCall) -> Vec<u32> {
        let mut idx: Vec<u32> = (0..call.sizes.len() as u32).collect();
        idx.sort_by(|&a, &b| {
            let (a, b) = (a as usize, b as usize);
            call.age_ms[b]
                .cmp(&call.age_ms[a])
                .then(call.sizes[b].cmp(&call.sizes[a]))
        });
        let mut freed = 0u64;
        let mut victims = Vec::new();
        for i in idx {
            if freed >= call.bytes_needed {
                break;
            }
            freed = freed.saturating_add(call.sizes[i as usize]);
            victims.push(i);
        }
        victims
    }

    fn evict_tiered(&mut self, call: TieredEvictCall) -> Vec<Victim> {
        let TieredEvictCall { call, on_disk } = call;
        let ages = call.age_ms.clone();
        let after = self.whole_key_after_ms;
        let cold =
            |i: usize| after.is_some_and(|after| on_disk.get(i) == Some(&true) && ages[i] >= after);
        let victims = self.evict(call);
        victims
            .into_iter()
            .map(|index| Victim {
                index,
                scope: if cold(index as usize) {
                    EvictScope::All
                } else {
                    EvictScope::Memory
                },
            })
            .collect()
    }
}

export_policy!(Lru);

#[cfg(test)]
mod tests {
    use super::*;

    fn lru() -> Lru {
        Lru {
            keys: 0,
            bytes: 0,
            whole_key_after_ms: None,
        }
    }

    #[test]
    fn cold_victims_on_an_ssd_lose_the_whole_key_others_their_memory_copy() {
        let call = || TieredEvictCall {
            call: EvictCall {
                keys: PackedKeys::from_keys(&["a", "b", "c"]),
                sizes: vec![10, 10, 10],
                tiers: vec![Tier::Memory; 3],
                age_ms: vec![500, 90, 800],
                hits: vec![0; 3],
                bytes_needed: 30,
            },
            on_disk: vec![true, true, false],
        };
        let scopes = |mut p: Lru| {
            let mut v: Vec<(u32, bool)> = p
                .evict_tiered(call())
                .into_iter()
                .map(|v| (v.index, matches!(v.scope, EvictScope::All)))
                .collect();
            v.sort();
            v
        };
        // Default: memory copies only.
        assert_eq!(scopes(lru()), [(0, false), (1, false), (2, false)]);
        // Cold (>= 100 ms) and on the SSD: the whole key; `c` has no SSD copy to drop.
        let mut p = lru();
        p.whole_key_after_ms = Some(100);
        assert_eq!(scopes(p), [(0, true), (1, false), (2, false)]);
    }

    #[test]
    fn evicts_oldest_first_larger_first_among_equals_until_covered() {
        let call = EvictCall {
            keys: PackedKeys::from_keys(&["a", "b", "c", "d"]),
            sizes: vec![10, 30, 20, u64::MAX],
            tiers: vec![Tier::Memory; 4],
            age_ms: vec![5, 9, 9, 1],
            hits: vec![0; 4],
            bytes_needed: 40,
        };
        assert_eq!(lru().evict(call), [1, 2]);
    }

    #[test]
    fn offers_memory_replicas_first() {
        let call = LookupCall {
            keys: PackedKeys::from_keys(&["a", "b"]),
            counts: vec![3, 1],
            tiers: vec![Tier::Disk, Tier::Memory, Tier::LocalDisk, Tier::Disk],
            sizes: vec![1; 4],
        };
        assert_eq!(lru().on_lookup(call), [vec![1, 0, 2], vec![0]]);
    }
}

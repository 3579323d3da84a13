//! Eviction by age (least recently used first, larger first among equals) until the
//! bytes needed are covered; lookups offer memory replicas before other tiers. Puts are
//! admitted unchanged, after counting keys and bytes into plugin metrics: the example of
//! a plugin that registers its own metrics, and the guest the host benchmarks use.

use moongate_policy_sdk::*;

struct Lru {
    keys: u32,
    bytes: u32,
}

impl Policy for Lru {
    fn new(_config: &[u8]) -> Result<(Self, Interest), String> {
        let keys = host::register_counter("put_keys", "keys seen in puts")?;
        let bytes = host::register_counter("put_bytes", "value bytes seen in puts")?;
        Ok((
            Lru { keys, bytes },
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
}

export_policy!(Lru);

#[cfg(test)]
mod tests {
    use super::*;

    fn lru() -> Lru {
        Lru { keys: 0, bytes: 0 }
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

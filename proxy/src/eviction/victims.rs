//! Who goes: victims among a round's candidates, chosen by each arm's plugin for its
//! share of the bytes, topped up least recently used where a round must free its need.
//! Pure but for the plugin calls; the simulator chooses through here too.

use super::*;

/// One eviction round's terms, for [`victims`].
pub struct Round<'a> {
    /// Bytes to free.
    pub need: u64,
    /// The candidates' clock now (their `last_ms` is on it).
    pub now_ms: u64,
    /// Victims at most.
    pub cap: usize,
    /// Copies may sit on an owner's SSD (`Entry::on_disk`).
    pub tiered: bool,
    /// What the serving stack said of the candidates.
    pub hints: &'a dyn hinted::HintSource,
}

/// Victims (indexes into `cands`, least recently used first) covering `round.need`
/// bytes: each arm's plugin chooses among the keys its arm put, for its share of the
/// bytes, at most `round.cap` in all. The live evictor and the simulator (`crate::sim`)
/// both choose through here, so a plugin sees the same calls in both. `round.tiered`:
/// copies may sit on an owner's SSD (`Entry::on_disk`), and a plugin with
/// `evict-tiered` says per victim whether its memory copy goes or the whole key;
/// otherwise every victim's scope is `Memory` (on a key with no other copy, the same as
/// the whole key). With hints for any candidate, a plugin with `evict-hinted` reads
/// them.
pub fn victims<K: AsRef<[u8]>>(
    policy: &Registry,
    set: &ActiveSet,
    cands: &[(K, Entry)],
    round: &Round<'_>,
) -> Vec<(usize, wit::EvictScope)> {
    let Round {
        need,
        now_ms: now,
        cap,
        tiered,
        hints,
    } = *round;
    let arms = set.arms.len().max(1);
    let by_arm: Vec<Vec<usize>> = if arms == 1 {
        vec![(0..cands.len()).collect()]
    } else {
        let mut by_arm = vec![Vec::new(); arms];
        for (i, (_, e)) in cands.iter().enumerate() {
            let a = if (e.arm as usize) < arms {
                e.arm as usize
            } else {
                0
            };
            by_arm[a].push(i);
        }
        by_arm
    };
    let total: u128 = cands
        .iter()
        .map(|(_, e)| u128::from(e.size))
        .sum::<u128>()
        .max(1);
    let mut victims = Vec::new();
    for (a, idx) in by_arm.iter().enumerate() {
        if idx.is_empty() || victims.len() >= cap {
            continue;
        }
        let bytes: u128 = idx.iter().map(|&i| u128::from(cands[i].1.size)).sum();
        let share = (u128::from(need) * bytes).div_ceil(total).max(1) as u64;
        let call = wit::EvictCall {
            keys: crate::policy::pack_keys(idx.iter().map(|&i| cands[i].0.as_ref())),
            sizes: idx.iter().map(|&i| cands[i].1.size).collect(),
            tiers: idx
                .iter()
                .map(|&i| crate::policy::view::wit_tier(cands[i].1.tier))
                .collect(),
            age_ms: idx
                .iter()
                .map(|&i| now.saturating_sub(cands[i].1.last_ms))
                .collect(),
            hits: idx.iter().map(|&i| cands[i].1.hits).collect(),
            bytes_needed: share,
        };
        let on_disk: Option<Vec<bool>> =
            tiered.then(|| idx.iter().map(|&i| cands[i].1.on_disk).collect());
        let picked = set
            .arms
            .get(a)
            .and_then(|arm| {
                // Only a plugin with `evict-hinted` has its candidates looked up.
                let hints = arm.plugin.reads_hints().then(|| {
                    let tenants: Vec<&Bytes> = idx.iter().map(|&i| &cands[i].1.tenant).collect();
                    hints.hints(policy, arm, &call.keys, &tenants)
                });
                let hints = hints.flatten();
                policy.evict_victims(arm, &call, on_disk.as_deref(), hints.as_deref())
            })
            .unwrap_or_else(|| {
                lru(&call.sizes, share)
                    .into_iter()
                    .map(|i| (i, wit::EvictScope::Memory))
                    .collect()
            });
        let mut seen = vec![false; idx.len()];
        for (p, scope) in picked {
            if victims.len() >= cap {
                break;
            }
            if p < idx.len() && !std::mem::replace(&mut seen[p], true) {
                victims.push((idx[p], scope));
            }
        }
    }
    if !victims.is_empty() {
        let mut ages: Vec<u64> = victims
            .iter()
            .map(|&(i, _)| now.saturating_sub(cands[i].1.last_ms))
            .collect();
        let mid = ages.len() / 2;
        hints.turnover(*ages.select_nth_unstable(mid).1);
    }
    victims
}

/// Adds least recently used candidates not already chosen until `victims` cover `need`
/// bytes (or `cap` victims); they lose their memory copy.
pub(super) fn top_up(
    victims: &mut Vec<(usize, wit::EvictScope)>,
    cands: &[(Bytes, Entry)],
    need: u64,
    cap: usize,
) {
    let mut chosen = vec![false; cands.len()];
    let mut freed = 0u64;
    for &(v, _) in victims.iter() {
        chosen[v] = true;
        freed = freed.saturating_add(cands[v].1.size);
    }
    for (i, (_, e)) in cands.iter().enumerate() {
        if freed >= need || victims.len() >= cap {
            break;
        }
        if !chosen[i] {
            victims.push((i, wit::EvictScope::Memory));
            freed = freed.saturating_add(e.size);
        }
    }
}

/// Candidates are least recently used first: take them in order until `need` bytes.
fn lru(sizes: &[u64], need: u64) -> Vec<usize> {
    let mut freed = 0u64;
    let mut out = Vec::new();
    for (i, &s) in sizes.iter().enumerate() {
        if freed >= need {
            break;
        }
        freed = freed.saturating_add(s);
        out.push(i);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::Tier;
    use crate::keys::table::NO_SEGMENT;

    #[test]
    fn lru_takes_oldest_until_covered() {
        assert_eq!(lru(&[10, 10, 10], 15), [0, 1]);
        assert_eq!(lru(&[10, 10], 0), Vec::<usize>::new());
        assert_eq!(lru(&[10], 100), [0]);
    }

    #[test]
    fn top_up_adds_the_oldest_not_chosen_until_covered() {
        let e = |size| Entry {
            tenant: Bytes::new(),
            size,
            tier: Tier::Memory,
            last_ms: 0,
            hits: 0,
            leased_until_ms: 0,
            arm: 1,
            complete: true,
            on_disk: false,
            client: Default::default(),
            segment: NO_SEGMENT,
            tries: 0,
            removing: false,
        };
        let cands: Vec<(Bytes, Entry)> = (0..4).map(|_| (Bytes::new(), e(10))).collect();
        let m = |v: &[usize]| -> Vec<(usize, wit::EvictScope)> {
            v.iter().map(|&i| (i, wit::EvictScope::Memory)).collect()
        };
        let mut v = m(&[2]);
        top_up(&mut v, &cands, 25, 100);
        assert_eq!(
            v,
            m(&[2, 0, 1]),
            "the plugin's pick stays; the oldest others fill in"
        );
        let mut v = m(&[3, 2, 1]);
        top_up(&mut v, &cands, 25, 100);
        assert_eq!(v, m(&[3, 2, 1]), "already covered");
        let mut v = vec![];
        top_up(&mut v, &cands, 1000, 2);
        assert_eq!(v, m(&[0, 1]), "at most cap");
    }
}

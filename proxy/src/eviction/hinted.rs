//! What the serving stack said of an eviction round's candidates, as a plugin's
//! `evict-hinted` reads it (WIT 0.1.4): each candidate matched in the hint table by its
//! key, else by the block the arm's policy names it as (`block-refs` / `block-keys`, the
//! names the KV events publish and routers send back).

use bytes::Bytes;

use crate::hints::{Hint, Hints, Kind, Name};
use crate::policy::active::Arm;
use crate::policy::registry::Registry;
use crate::policy::wit;

/// Where a round's hints come from: the live table, or the simulator's hint model.
pub trait HintSource {
    /// Per candidate of `keys` (put under `tenants`, in order), its hint; `None` when
    /// nothing is known of any candidate (the plugin is then called without hints).
    fn hints(
        &self,
        policy: &Registry,
        arm: &Arm,
        keys: &wit::PackedKeys,
        tenants: &[&Bytes],
    ) -> Option<Vec<wit::CandidateHint>>;

    /// A round took victims that had gone unread this long (their median, ms): the
    /// cache's turnover, which `upcoming` and `expect` hints hold past their due time by.
    fn turnover(&self, _age_ms: u64) {}
}

/// No hints: a round as before hints existed.
pub struct NoHints;

impl HintSource for NoHints {
    fn hints(
        &self,
        _: &Registry,
        _: &Arm,
        _: &wit::PackedKeys,
        _: &[&Bytes],
    ) -> Option<Vec<wit::CandidateHint>> {
        None
    }
}

/// A hint as a plugin sees it, at `now_ms` on the table's clock.
pub fn candidate_hint(h: Option<&Hint>, now_ms: u64) -> wit::CandidateHint {
    let Some(h) = h else {
        return wit::CandidateHint {
            kind: wit::HintKind::None,
            age_ms: 0,
            due_in_ms: 0,
        };
    };
    wit::CandidateHint {
        kind: match h.kind {
            Kind::Upcoming => wit::HintKind::Upcoming,
            Kind::Done => wit::HintKind::Done,
            Kind::Expect => wit::HintKind::Expect,
        },
        age_ms: now_ms.saturating_sub(h.at_ms),
        due_in_ms: match h.kind {
            Kind::Done => 0,
            _ => h.due_ms.saturating_sub(now_ms),
        },
    }
}

/// A digest's int form as the KV events publish it (`events.block_hash = "int"`, vLLM's
/// default): its last 8 bytes, big-endian.
fn int_form(d: &[u8]) -> u64 {
    let tail = &d[d.len().saturating_sub(8)..];
    tail.iter().fold(0u64, |v, b| (v << 8) | u64::from(*b))
}

/// Each key of a packed list.
pub fn each(keys: &wit::PackedKeys) -> impl Iterator<Item = &[u8]> {
    let mut from = 0usize;
    keys.ends.iter().map(move |&end| {
        let end = (end as usize).min(keys.bytes.len());
        let k = keys.bytes.get(from.min(end)..end).unwrap_or_default();
        from = end;
        k
    })
}

impl HintSource for Hints {
    fn turnover(&self, age_ms: u64) {
        Hints::turnover(self, age_ms);
    }

    fn hints(
        &self,
        policy: &Registry,
        arm: &Arm,
        keys: &wit::PackedKeys,
        tenants: &[&Bytes],
    ) -> Option<Vec<wit::CandidateHint>> {
        if !arm.plugin.reads_hints() || self.is_empty() {
            return None;
        }
        let names: Vec<Name> = each(keys)
            .zip(tenants)
            .map(|(k, t)| Name::Key {
                tenant: (*t).clone(),
                key: Bytes::copy_from_slice(k),
            })
            .collect();
        let (now, mut found) = self.lookup(names.iter());
        if found.iter().any(Option::is_none)
            && let Ok(Some(blocks)) = policy.blocks(arm, keys)
        {
            // A digest is looked up as itself and in the int form the events publish
            // by default (its last 8 bytes), whichever the router sent back.
            let mut by_block: Vec<(usize, Name)> = Vec::new();
            for (i, b) in blocks.iter().enumerate() {
                let Some(b) = b
                    .as_ref()
                    .filter(|_| found.get(i).is_some_and(Option::is_none))
                else {
                    continue;
                };
                match &b.hash {
                    wit::BlockHash::Int(h) => by_block.push((i, Name::Block(*h))),
                    wit::BlockHash::Digest(d) => {
                        by_block.push((i, Name::Digest(Bytes::copy_from_slice(d))));
                        by_block.push((i, Name::Block(int_form(d))));
                    }
                }
            }
            let (_, more) = self.lookup(by_block.iter().map(|(_, n)| n));
            for ((i, _), h) in by_block.iter().zip(more) {
                if h.is_some() && found[*i].is_none() {
                    found[*i] = h;
                }
            }
        }
        if found.iter().all(Option::is_none) {
            return None;
        }
        self.matched(found.iter().flatten().map(|h| h.kind));
        Some(
            found
                .iter()
                .map(|h| candidate_hint(h.as_ref(), now))
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::codec::types::Tier;
    use crate::eviction::{Round, victims};
    use crate::keys::Entry;
    use crate::metrics::Metrics;
    use crate::policy::fake::Fake;
    use crate::policy::{Policy, PolicyConfig};

    fn entry(last_ms: u64) -> Entry {
        Entry {
            tenant: Bytes::from_static(b"default"),
            size: 10,
            tier: Tier::Memory,
            last_ms,
            hits: 0,
            leased_until_ms: 0,
            arm: 0,
            complete: true,
            on_disk: false,
            client: Default::default(),
            segment: crate::keys::table::NO_SEGMENT,
            tries: 0,
            removing: false,
        }
    }

    /// Candidates are matched by key, else by the block their policy names them as
    /// (a digest also in the int form the events publish); the plugin gets one hint per
    /// candidate, and a round with no hint at all calls it without.
    #[test]
    fn candidates_get_their_hints_by_key_or_by_block() {
        let all = Metrics::new();
        let seen: Arc<Mutex<Vec<Vec<wit::HintKind>>>> = Arc::default();
        let record = seen.clone();
        let fake = Fake::new("hinted")
            .blocks(|keys| {
                Ok(each(keys)
                    .map(|k| match k {
                        b"blk7" => Some(wit::Block {
                            hash: wit::BlockHash::Int(7),
                            parent: None,
                            group: None,
                        }),
                        b"digest" => Some(wit::Block {
                            hash: wit::BlockHash::Digest(
                                [&[0xaa; 24][..], &[0, 0, 0, 0, 0, 0, 0, 9]].concat(),
                            ),
                            parent: None,
                            group: None,
                        }),
                        _ => None,
                    })
                    .collect())
            })
            .evict_hinted(move |c| {
                record
                    .lock()
                    .unwrap()
                    .push(c.hints.iter().map(|h| h.kind).collect());
                Ok(vec![wit::Victim {
                    index: 0,
                    scope: wit::EvictScope::Memory,
                }])
            });
        let policy: Arc<dyn Policy> = Arc::new(fake);
        let reg = Registry::with_policies(
            PolicyConfig::default(),
            None,
            all.policy.clone(),
            vec![policy],
        )
        .unwrap();
        let hints = Hints::new(Default::default(), 64, all.hints.clone());
        let cands: Vec<(Bytes, Entry)> = ["x", "blk7", "digest", "y"]
            .iter()
            .map(|k| (Bytes::from_static(k.as_bytes()), entry(0)))
            .collect();
        let round = |source: &dyn HintSource| {
            victims(
                &reg,
                &reg.current(),
                &cands,
                &Round {
                    need: 10,
                    now_ms: 100,
                    cap: 10,
                    tiered: false,
                    hints: source,
                },
            )
        };
        // Nothing known yet: evict-hinted is not called; the fake's plain evict chooses
        // nothing.
        assert!(round(&hints).is_empty());
        assert!(seen.lock().unwrap().is_empty());
        hints
            .post(br#"{"hints": [{"kind": "done", "keys": ["x"]}, {"kind": "upcoming", "blocks": [7, 9]}]}"#)
            .unwrap();
        assert_eq!(round(&hints), [(0, wit::EvictScope::Memory)]);
        assert_eq!(
            seen.lock().unwrap().as_slice(),
            [vec![
                wit::HintKind::Done,
                wit::HintKind::Upcoming,
                wit::HintKind::Upcoming,
                wit::HintKind::None,
            ]]
        );
        // Without a hint table (or hints off) the round is as before.
        round(&NoHints);
        assert_eq!(seen.lock().unwrap().len(), 1);
    }
}

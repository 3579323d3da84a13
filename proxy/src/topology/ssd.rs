//! Which keys sit on which owner's SSD, and so each owner's SSD usage: no call of the
//! offload flow carries it (`ReportSsdCapacity` says the size, never the use, and the
//! master's `master_allocated_file_size_bytes` is pool-wide), so it is summed from what
//! passes the master face: a key enters with the owner's `NotifyOffloadSuccess` (or a
//! lookup answer listing its `LOCAL_DISK` copy, for keys offloaded before moongate
//! started) and leaves when a `Remove` / `RemoveAll` of it succeeds or a lookup answer
//! shows no SSD copy. A copy deleted by the master or the owner on their own is counted
//! until the key is next looked up.
//!
//! Keys are held by a 64-bit hash of tenant and key, not by name: 25 bytes a key at most
//! (hash, owner slot, tenant tag, size, the map's control byte), so the cap below costs
//! ~26 MB when reached (by the layout: not measured). Past it, offloaded keys still add to their owner's usage but
//! cannot be taken off again (`untracked_keys` says how many).
//!
//! Knows no frames, clocks or metrics: [`super::Topology`] feeds it and sets the gauges.

use std::collections::HashMap;

use crate::codec::types::Uuid;

/// Keys whose SSD place is remembered.
pub const MAX_SSD_KEYS: usize = 1 << 19;

/// One owner's SSD, as far as moongate saw.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Keys on it.
    pub keys: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Keys counted in `keys` and `bytes` that moongate could not remember (the cap):
    /// their removal is not taken off, so the figures may run high by them.
    pub untracked_keys: u64,
}

#[derive(Debug, Clone, Copy)]
struct Place {
    owner: u32,
    tenant: u32,
    size: u64,
}

/// Keys on owners' SSDs (bounded by its cap).
pub struct SsdKeys {
    keys: HashMap<u64, Place, foldhash::fast::RandomState>,
    /// Owners by slot (a pool has a few).
    owners: Vec<(Uuid, Usage)>,
    cap: usize,
}

impl SsdKeys {
    pub fn new(cap: usize) -> SsdKeys {
        SsdKeys {
            keys: HashMap::default(),
            owners: Vec::new(),
            cap,
        }
    }

    fn slot(&mut self, owner: Uuid) -> usize {
        match self.owners.iter().position(|(id, _)| *id == owner) {
            Some(i) => i,
            None => {
                self.owners.push((owner, Usage::default()));
                self.owners.len() - 1
            }
        }
    }

    /// `owner` wrote the key (`key`: its hash, `tenant`: its tenant's tag) to its SSD.
    /// `learnt`: seen in a lookup answer rather than in the owner's notice; such a key
    /// is only added while there is room (it may have been counted untracked before).
    /// Returns the owners whose usage changed.
    pub fn stored(
        &mut self,
        owner: Uuid,
        tenant: u32,
        key: u64,
        size: u64,
        learnt: bool,
    ) -> Vec<Uuid> {
        let slot = self.slot(owner);
        let mut changed = Vec::with_capacity(2);
        let place = Place {
            owner: slot as u32,
            tenant,
            size,
        };
        if let Some(old) = self.keys.get_mut(&key) {
            let was = *old;
            if was.owner == place.owner && was.size == size {
                return changed;
            }
            *old = place;
            self.take_off(was);
            changed.push(self.owners[was.owner as usize].0);
        } else if self.keys.len() < self.cap {
            self.keys.insert(key, place);
        } else if learnt {
            return changed;
        } else {
            self.owners[slot].1.untracked_keys += 1;
        }
        let u = &mut self.owners[slot].1;
        u.keys += 1;
        u.bytes = u.bytes.saturating_add(size);
        if !changed.contains(&owner) {
            changed.push(owner);
        }
        changed
    }

    /// The key's SSD copy is gone. Returns the owner whose usage changed.
    pub fn gone(&mut self, key: u64) -> Option<Uuid> {
        let was = self.keys.remove(&key)?;
        self.take_off(was);
        Some(self.owners[was.owner as usize].0)
    }

    /// Every key of the tenant tagged `tenant` is gone (`RemoveAll`).
    pub fn cleared(&mut self, tenant: u32) -> Vec<Uuid> {
        let mut gone = Vec::new();
        self.keys.retain(|_, p| {
            let keep = p.tenant != tenant;
            if !keep {
                gone.push(*p);
            }
            keep
        });
        for p in &gone {
            self.take_off(*p);
        }
        let mut changed: Vec<Uuid> = Vec::new();
        for p in &gone {
            let id = self.owners[p.owner as usize].0;
            if !changed.contains(&id) {
                changed.push(id);
            }
        }
        changed
    }

    fn take_off(&mut self, p: Place) {
        let u = &mut self.owners[p.owner as usize].1;
        u.keys = u.keys.saturating_sub(1);
        u.bytes = u.bytes.saturating_sub(p.size);
    }

    pub fn usage(&self, owner: Uuid) -> Usage {
        self.owners
            .iter()
            .find(|(id, _)| *id == owner)
            .map(|(_, u)| *u)
            .unwrap_or_default()
    }

    /// Keys remembered (tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether the key is remembered on an SSD (tests).
    #[cfg(test)]
    fn holds(&self, key: u64) -> bool {
        self.keys.contains_key(&key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner(n: u64) -> Uuid {
        Uuid {
            first: n,
            second: 0,
        }
    }

    #[test]
    fn usage_follows_stores_removals_moves_and_clears() {
        let mut s = SsdKeys::new(16);
        let (a, b) = (owner(1), owner(2));
        assert_eq!(s.stored(a, 0, 10, 100, false), vec![a]);
        assert_eq!(s.stored(a, 0, 11, 50, false), vec![a]);
        assert_eq!(s.stored(b, 1, 12, 7, false), vec![b]);
        // Offloaded again to the same place, or seen in a lookup: counted once.
        assert!(s.stored(a, 0, 10, 100, false).is_empty());
        assert!(s.stored(a, 0, 10, 100, true).is_empty());
        assert_eq!(
            s.usage(a),
            Usage {
                keys: 2,
                bytes: 150,
                untracked_keys: 0
            }
        );
        // Moved to another owner's SSD.
        assert_eq!(s.stored(b, 0, 11, 50, false), vec![a, b]);
        assert_eq!((s.usage(a).bytes, s.usage(b).bytes), (100, 57));
        assert_eq!(s.gone(10), Some(a));
        assert_eq!(s.gone(10), None, "once");
        assert_eq!(s.usage(a), Usage::default());
        // RemoveAll of tenant 0 leaves tenant 1's key.
        assert_eq!(s.cleared(0), vec![b]);
        assert_eq!(
            s.usage(b),
            Usage {
                keys: 1,
                bytes: 7,
                untracked_keys: 0
            }
        );
        assert_eq!(s.usage(owner(9)), Usage::default());
    }

    #[test]
    fn past_the_cap_notices_count_untracked_and_lookups_add_nothing() {
        let mut s = SsdKeys::new(2);
        let a = owner(1);
        s.stored(a, 0, 1, 10, false);
        s.stored(a, 0, 2, 10, false);
        assert!(s.stored(a, 0, 3, 10, true).is_empty(), "learnt: no room");
        assert_eq!(s.stored(a, 0, 4, 10, false), vec![a]);
        assert_eq!(
            s.usage(a),
            Usage {
                keys: 3,
                bytes: 30,
                untracked_keys: 1
            }
        );
        assert_eq!(s.len(), 2);
        assert!(s.holds(1) && !s.holds(4));
        // A tracked key's removal frees its room.
        s.gone(1);
        s.stored(a, 0, 3, 10, true);
        assert!(s.holds(3));
    }
}

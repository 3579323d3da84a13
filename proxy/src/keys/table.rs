//! The bounded table of keys clients put through this moongate: size, tier, last access,
//! hits, and the experiment arm that served the put. Mooncake keys are per tenant, so
//! entries are keyed by (tenant, key): one tenant's removal, miss or clear never touches
//! another tenant's key, and a victim is removed under the tenant that owns it.
//!
//! Fed from answers the master face already decodes (successful put starts, lookups,
//! removes); read by the evictor for candidates. Pure data: the caller passes the time
//! (milliseconds on its own clock), so tests drive it without sleeping.

use std::collections::HashMap;
use std::collections::hash_map::Entry as Slot;
use std::sync::Mutex;

use bytes::Bytes;

pub use crate::codec::types::Tier;
use crate::codec::types::Uuid;

/// A key's table entry moved to a new home (a fleet member joined or left): ages and
/// leases as durations, since the members' clocks differ.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Adopted {
    pub key: Bytes,
    /// The client that put it, and the experiment arm that served the put.
    pub client: Uuid,
    pub arm: u8,
    pub size: u64,
    pub tier: Tier,
    /// How long ago it was last put or found, on the sender's clock.
    pub age_ms: u64,
    pub hits: u32,
    /// How much longer a read lease holds it.
    pub lease_left_ms: u64,
    pub complete: bool,
    pub on_disk: bool,
    /// The memory replica's segment endpoint (empty when unknown).
    pub segment: Bytes,
    pub tries: u8,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The tenant the key was put under (Mooncake keys are per tenant).
    pub tenant: Bytes,
    pub size: u64,
    pub tier: Tier,
    /// When the key was last put or found by a lookup.
    pub last_ms: u64,
    /// Lookups that found it since it was put.
    pub hits: u32,
    /// Until when the master holds a read lease on it (set by lookups that found it):
    /// a removal before then fails, so it is no candidate.
    pub leased_until_ms: u64,
    /// Index of the experiment arm that served its put (0 without an experiment).
    pub arm: u8,
    /// The put ended (PutEnd accepted). Until then a removal fails: no candidate.
    pub complete: bool,
    /// An owner reported a copy of it on its SSD (NotifyOffloadSuccess), or a lookup
    /// answer listed one.
    pub on_disk: bool,
    /// The client id of the put (the master checks it on a replica clear).
    pub client: Uuid,
    /// The memory replica's segment, as an index into [`KeyTable::segment`]
    /// ([`NO_SEGMENT`] when unknown).
    pub segment: u16,
    /// Replica clears of it that cleared nothing (offload on).
    pub tries: u8,
    /// moongate's evictor sent its `Remove` and has not read the answer yet (or lost
    /// it): a lookup that finds the key gone meanwhile is that removal, not the
    /// master's own eviction.
    pub removing: bool,
}

/// [`Entry::segment`] when the memory replica's segment is not known.
pub const NO_SEGMENT: u16 = u16::MAX;
/// Distinct segments remembered (a pool has one per owner or rank with memory).
const MAX_SEGMENTS: usize = 4096;

/// What the table holds, behind one lock (calls take it once per answer, not per key).
pub struct KeyTable {
    max_keys: usize,
    lease_ms: u64,
    inner: Mutex<Inner>,
}

/// The entries, and the bytes each arm's entries weigh (kept as entries come and go,
/// so a per-arm share is checked without a scan).
#[derive(Default)]
struct Inner {
    map: HashMap<Owned, Entry, foldhash::fast::RandomState>,
    arm_bytes: Vec<u64>,
    /// Memory segments' transfer endpoints, interned (entries hold an index).
    segments: Vec<Bytes>,
}

impl Inner {
    fn add(&mut self, e: &Entry) {
        let a = e.arm as usize;
        if self.arm_bytes.len() <= a {
            self.arm_bytes.resize(a + 1, 0);
        }
        self.arm_bytes[a] = self.arm_bytes[a].saturating_add(e.size);
    }

    fn sub(&mut self, e: &Entry) {
        if let Some(b) = self.arm_bytes.get_mut(e.arm as usize) {
            *b = b.saturating_sub(e.size);
        }
    }

    fn insert(&mut self, k: Owned, e: Entry) {
        self.add(&e);
        if let Some(old) = self.map.insert(k, e) {
            self.sub(&old);
        }
    }

    fn remove(&mut self, k: &Owned) -> Option<Entry> {
        let old = self.map.remove(k);
        if let Some(o) = &old {
            self.sub(o);
        }
        old
    }

    fn recount(&mut self) {
        self.arm_bytes.iter_mut().for_each(|b| *b = 0);
        let entries: Vec<Entry> = self.map.values().cloned().collect();
        for e in &entries {
            self.add(e);
        }
    }
}

/// A key as the master knows it: (tenant, key).
type Owned = (Bytes, Bytes);

impl KeyTable {
    /// `lease_ms`: the master's read lease (`--default_kv_lease_ttl`), which every
    /// lookup that finds a key renews.
    pub fn new(max_keys: usize, lease_ms: u64) -> KeyTable {
        KeyTable {
            max_keys: max_keys.max(1),
            lease_ms,
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    /// Bytes of the keys each arm put (index: arm), as far as the table remembers them.
    pub fn arm_bytes(&self) -> Vec<u64> {
        self.lock().arm_bytes.clone()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Records keys whose put the master accepted: key, size, tier of its first replica.
    pub fn put(&self, tenant: &Bytes, keys: &[(Bytes, u64, Tier)], arm: usize, now_ms: u64) {
        // Own copies: a key decoded from a frame is a slice of the connection's read
        // buffer, and holding the slice would keep the whole buffer alive for as long as
        // the key stays in the table.
        let tenant = Bytes::copy_from_slice(tenant);
        let mut t = self.lock();
        for (key, size, tier) in keys {
            t.insert(
                (tenant.clone(), Bytes::copy_from_slice(key)),
                Entry {
                    tenant: tenant.clone(),
                    size: *size,
                    tier: *tier,
                    last_ms: now_ms,
                    hits: 0,
                    leased_until_ms: 0,
                    arm: arm.min(u8::MAX as usize) as u8,
                    complete: false,
                    on_disk: false,
                    client: Uuid::default(),
                    segment: NO_SEGMENT,
                    tries: 0,
                    removing: false,
                },
            );
        }
        if t.map.len() > self.max_keys {
            forget_oldest(&mut t.map, self.max_keys);
            t.recount();
        }
    }

    /// Records who put keys and where their memory replica lives (`endpoint`: the
    /// segment's transfer endpoint).
    pub fn placed(&self, tenant: &Bytes, keys: &[(Bytes, Bytes)], client: Uuid) {
        let mut t = self.lock();
        let t = &mut *t;
        for (key, endpoint) in keys {
            let seg = match t.segments.iter().position(|s| s == endpoint) {
                Some(i) => i as u16,
                None if t.segments.len() < MAX_SEGMENTS => {
                    t.segments.push(Bytes::copy_from_slice(endpoint));
                    (t.segments.len() - 1) as u16
                }
                None => NO_SEGMENT,
            };
            if let Some(e) = t.map.get_mut(&(tenant.clone(), key.clone())) {
                e.client = client;
                e.segment = seg;
            }
        }
    }

    /// A replica clear left `key` as it was (a lease, or its memory replica already
    /// gone): it is no candidate until `until_ms`; after `max_tries` such clears the
    /// table forgets it. Returns whether it is still held.
    pub fn back_off(&self, tenant: &Bytes, key: &Bytes, until_ms: u64, max_tries: u8) -> bool {
        let mut t = self.lock();
        let k = (tenant.clone(), key.clone());
        let Some(e) = t.map.get_mut(&k) else {
            return false;
        };
        e.tries = e.tries.saturating_add(1);
        e.leased_until_ms = e.leased_until_ms.max(until_ms);
        if e.tries >= max_tries {
            t.remove(&k);
            return false;
        }
        true
    }

    /// Marks (or unmarks) keys whose removal moongate's evictor sends now
    /// ([`Entry::removing`]).
    pub fn mark_removing<'a>(&self, keys: impl Iterator<Item = (&'a Bytes, &'a Bytes)>, on: bool) {
        let mut t = self.lock();
        for (tenant, k) in keys {
            if let Some(e) = t.map.get_mut(&(tenant.clone(), k.clone())) {
                e.removing = on;
            }
        }
    }

    /// Takes each of `keys` (tenant, key, anything the caller pairs with it) out of the
    /// table, calling `each` with the entries that were still held (a lookup miss may
    /// have taken one first).
    pub fn take_each<'a, X>(
        &self,
        keys: impl Iterator<Item = (&'a Bytes, &'a Bytes, X)>,
        mut each: impl FnMut(&Bytes, X, Entry),
    ) {
        let mut t = self.lock();
        for (tenant, k, x) in keys {
            if let Some(e) = t.remove(&(tenant.clone(), k.clone())) {
                each(k, x, e);
            }
        }
    }

    /// The transfer endpoint of segment `i` ([`Entry::segment`]).
    pub fn segment(&self, i: u16) -> Option<Bytes> {
        self.lock().segments.get(usize::from(i)).cloned()
    }

    /// Marks keys an owner wrote to its SSD (at `now_ms`); calls `each` with the
    /// entries it held. A key is no candidate for a lease after the notice: measured
    /// with Mooncake 0.3.13.post1, a memory replica cleared within ~0.3 s of the owner's
    /// NotifyOffloadSuccess took the whole key with it, one cleared a lease (1 s) later
    /// left the SSD copy serving reads.
    pub fn on_disk<'a>(
        &self,
        keys: impl Iterator<Item = (&'a Bytes, &'a Bytes)>,
        now_ms: u64,
        mut each: impl FnMut(&Bytes, &Entry),
    ) {
        let mut t = self.lock();
        let until = now_ms + self.lease_ms;
        for (tenant, key) in keys {
            // 0.3.12's offload notices name no tenant while its puts say "default".
            let k = (tenant.clone(), key.clone());
            let k = if tenant.is_empty() && !t.map.contains_key(&k) {
                (
                    Bytes::from_static(crate::topology::DEFAULT_TENANT),
                    key.clone(),
                )
            } else {
                k
            };
            if let Some(e) = t.map.get_mut(&k) {
                e.on_disk = true;
                e.leased_until_ms = e.leased_until_ms.max(until);
                each(key, e);
            }
        }
    }

    /// Records lookups that found these keys (`tier` when the answer named one).
    /// `left` sees each key found served from its SSD copy while the table held it in
    /// another tier, with that tier: readers take memory before disk, so that copy is
    /// gone (the master evicted it without moongate).
    pub fn hit<'a>(
        &self,
        tenant: &Bytes,
        found: impl Iterator<Item = (&'a Bytes, Option<Tier>)>,
        now_ms: u64,
        mut left: impl FnMut(&Bytes, &Entry, Tier),
    ) {
        let mut t = self.lock();
        for (key, tier) in found {
            if let Some(e) = t.map.get_mut(&(tenant.clone(), key.clone())) {
                e.last_ms = now_ms;
                e.hits = e.hits.saturating_add(1);
                e.leased_until_ms = now_ms + self.lease_ms;
                if let Some(tier) = tier {
                    let was = std::mem::replace(&mut e.tier, tier);
                    if tier == Tier::LocalDisk && was != Tier::LocalDisk {
                        left(key, e, was);
                    }
                }
            }
        }
    }

    /// Marks keys whose put ended: they are stored and may be evicted. `newly` sees each
    /// key that was not marked before (a put of an existing key is a no-op in Mooncake,
    /// and a repeated end changes nothing).
    pub fn complete<'a>(
        &self,
        tenant: &Bytes,
        keys: impl Iterator<Item = &'a Bytes>,
        mut newly: impl FnMut(&Bytes, &Entry),
    ) {
        let mut t = self.lock();
        for k in keys {
            if let Some(e) = t.map.get_mut(&(tenant.clone(), k.clone()))
                && !e.complete
            {
                e.complete = true;
                newly(k, e);
            }
        }
    }

    /// Forgets keys that are gone from the store (removed, or found missing).
    pub fn forget<'a>(&self, tenant: &Bytes, keys: impl Iterator<Item = &'a Bytes>) {
        let mut t = self.lock();
        for k in keys {
            t.remove(&(tenant.clone(), k.clone()));
        }
    }

    /// Forgets every key of `tenant` (its `RemoveAll`); returns them.
    pub fn clear(&self, tenant: &Bytes) -> Vec<Bytes> {
        let mut t = self.lock();
        let mut gone = Vec::new();
        t.map.retain(|(t, k), _| {
            let keep = t != tenant;
            if !keep {
                gone.push(k.clone());
            }
            keep
        });
        t.recount();
        gone
    }

    /// Forgets one key and returns its entry, if it was held.
    pub fn take(&self, tenant: &Bytes, key: &Bytes) -> Option<Entry> {
        self.lock().remove(&(tenant.clone(), key.clone()))
    }

    /// Forgets a key a lookup missed and returns its entry: a stored key (the master
    /// evicted it), or a put that never ended (started `stale_ms` or more before
    /// `now_ms`: its client gave up). A put still under way stays: a lookup that races
    /// its end misses it, and forgetting it then would leave the key in the pool unknown
    /// to the table (no eviction, no KV event when it is stored).
    pub fn take_missed(
        &self,
        tenant: &Bytes,
        key: &Bytes,
        now_ms: u64,
        stale_ms: u64,
    ) -> Option<Entry> {
        let mut t = self.lock();
        // One probe of the map: a miss is on the lookup path.
        let gone = match t.map.entry((tenant.clone(), key.clone())) {
            Slot::Vacant(_) => return None,
            Slot::Occupied(o) => {
                let e = o.get();
                if !e.complete && now_ms.saturating_sub(e.last_ms) < stale_ms {
                    return None;
                }
                o.remove()
            }
        };
        t.sub(&gone);
        Some(gone)
    }

    /// The entry of a key, if held.
    pub fn get(&self, tenant: &Bytes, key: &Bytes) -> Option<Entry> {
        self.lock().map.get(&(tenant.clone(), key.clone())).cloned()
    }

    /// Up to `max` complete entries not under a read lease at `now_ms`, least recently
    /// used first.
    pub fn candidates(&self, max: usize, now_ms: u64) -> Vec<(Bytes, Entry)> {
        self.candidates_where(max, now_ms, |_| true)
    }

    /// As [`KeyTable::candidates`], among the keys arm `arm` put.
    pub fn candidates_of(&self, arm: usize, max: usize, now_ms: u64) -> Vec<(Bytes, Entry)> {
        self.candidates_where(max, now_ms, |e| e.arm as usize == arm)
    }

    fn candidates_where(
        &self,
        max: usize,
        now_ms: u64,
        keep: impl Fn(&Entry) -> bool,
    ) -> Vec<(Bytes, Entry)> {
        let t = self.lock();
        let mut all: Vec<(Bytes, Entry)> = t
            .map
            .iter()
            .filter(|(_, e)| e.complete && e.leased_until_ms <= now_ms && keep(e))
            .map(|((_, k), e)| (k.clone(), e.clone()))
            .collect();
        drop(t);
        if all.len() > max {
            all.select_nth_unstable_by_key(max, |(_, e)| e.last_ms);
            all.truncate(max);
        }
        all.sort_unstable_by_key(|(_, e)| e.last_ms);
        all
    }
}

impl KeyTable {
    /// Takes out every entry `moved(tenant, key)` picks (their home changed), each with
    /// its memory segment's endpoint (empty when unknown).
    pub fn drain_where(
        &self,
        mut moved: impl FnMut(&Bytes, &Bytes) -> bool,
    ) -> Vec<(Bytes, Bytes, Entry, Bytes)> {
        let mut t = self.lock();
        let t = &mut *t;
        let mut out = Vec::new();
        t.map.retain(|(tenant, key), e| {
            if moved(tenant, key) {
                let seg = t
                    .segments
                    .get(usize::from(e.segment))
                    .cloned()
                    .unwrap_or_default();
                out.push((tenant.clone(), key.clone(), e.clone(), seg));
                false
            } else {
                true
            }
        });
        if !out.is_empty() {
            t.recount();
        }
        out
    }

    /// Takes entries another member handed over (this member is their home now), aged
    /// and leased as the sender knew them, on this table's clock (`now_ms`). A key held
    /// already keeps the more recent of the two.
    pub fn adopt(&self, tenant: &Bytes, items: &[Adopted], now_ms: u64) {
        let tenant = Bytes::copy_from_slice(tenant);
        let mut t = self.lock();
        for a in items {
            let seg = if a.segment.is_empty() {
                NO_SEGMENT
            } else {
                match t.segments.iter().position(|s| *s == a.segment) {
                    Some(i) => i as u16,
                    None if t.segments.len() < MAX_SEGMENTS => {
                        t.segments.push(Bytes::copy_from_slice(&a.segment));
                        (t.segments.len() - 1) as u16
                    }
                    None => NO_SEGMENT,
                }
            };
            let e = Entry {
                tenant: tenant.clone(),
                size: a.size,
                tier: a.tier,
                last_ms: now_ms.saturating_sub(a.age_ms),
                hits: a.hits,
                leased_until_ms: now_ms.saturating_add(a.lease_left_ms),
                arm: a.arm,
                complete: a.complete,
                on_disk: a.on_disk,
                client: a.client,
                segment: seg,
                tries: a.tries,
                removing: false,
            };
            let k = (tenant.clone(), Bytes::copy_from_slice(&a.key));
            match t.map.get(&k) {
                Some(old) if old.last_ms >= e.last_ms => {}
                _ => t.insert(k, e),
            }
        }
        if t.map.len() > self.max_keys {
            forget_oldest(&mut t.map, self.max_keys);
            t.recount();
        }
    }
}

/// Drops the least recently used ~1/64 of the table below `max` in one pass, so the
/// O(n) scan is paid once per many inserts.
fn forget_oldest<S>(t: &mut HashMap<Owned, Entry, S>, max: usize) {
    let target = max - max / 64;
    let excess = t.len().saturating_sub(target);
    if excess == 0 {
        return;
    }
    let mut ages: Vec<u64> = t.values().map(|e| e.last_ms).collect();
    let (_, cut, _) = ages.select_nth_unstable(excess - 1);
    let cut = *cut;
    let mut left = excess;
    t.retain(|_, e| {
        if left > 0 && e.last_ms <= cut {
            left -= 1;
            false
        } else {
            true
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(s: &str) -> Bytes {
        Bytes::copy_from_slice(s.as_bytes())
    }

    #[test]
    fn a_miss_forgets_stored_keys_and_abandoned_puts_not_puts_under_way() {
        let t = KeyTable::new(100, 1000);
        let d = k("default");
        t.put(
            &d,
            &[(k("done"), 10, Tier::Memory), (k("busy"), 10, Tier::Memory)],
            0,
            100,
        );
        t.complete(&d, [k("done")].iter(), |_, _| {});
        assert!(t.take_missed(&d, &k("done"), 200, 30_000).is_some());
        // Its lookup raced its end: kept, and its end still completes it.
        assert!(t.take_missed(&d, &k("busy"), 200, 30_000).is_none());
        let mut stored = Vec::new();
        t.complete(&d, [k("busy")].iter(), |key, _| stored.push(key.clone()));
        assert_eq!(stored, vec![k("busy")]);
        // A put whose end never came is given up after the master's discard time.
        t.put(&d, &[(k("lost"), 10, Tier::Memory)], 0, 100);
        assert!(t.take_missed(&d, &k("lost"), 30_100, 30_000).is_some());
        assert!(t.take_missed(&d, &k("none"), 0, 30_000).is_none());
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn entries_handed_over_arrive_as_they_left() {
        let (from, to) = (KeyTable::new(100, 1000), KeyTable::new(100, 1000));
        let d = k("default");
        from.put(
            &d,
            &[(k("a"), 10, Tier::Memory), (k("b"), 20, Tier::Memory)],
            1,
            100,
        );
        from.placed(
            &d,
            &[(k("a"), k("10.0.0.1:1"))],
            Uuid {
                first: 5,
                second: 6,
            },
        );
        from.complete(&d, [k("a")].iter(), |_, _| {});
        from.hit(&d, [(&k("a"), None)].into_iter(), 400, |_, _, _| {});
        let moved = from.drain_where(|_, key| &key[..] == b"a");
        assert_eq!(
            (moved.len(), from.len(), from.arm_bytes()),
            (1, 1, vec![0, 20])
        );
        let (tenant, key, e, seg) = &moved[0];
        assert_eq!(
            (&tenant[..], &key[..], &seg[..]),
            (&b"default"[..], &b"a"[..], &b"10.0.0.1:1"[..])
        );
        // Sent at 500 on the sender's clock (age 100, lease left 900); taken at 10,000.
        let a = Adopted {
            key: key.clone(),
            client: e.client,
            arm: e.arm,
            size: e.size,
            tier: e.tier,
            age_ms: 500 - e.last_ms,
            hits: e.hits,
            lease_left_ms: e.leased_until_ms - 500,
            complete: e.complete,
            on_disk: e.on_disk,
            segment: seg.clone(),
            tries: e.tries,
        };
        to.adopt(&d, &[a], 10_000);
        let got = to.get(&d, &k("a")).unwrap();
        assert_eq!(
            (
                got.last_ms,
                got.leased_until_ms,
                got.hits,
                got.arm,
                got.complete
            ),
            (9_900, 10_900, 1, 1, true)
        );
        assert_eq!(
            got.client,
            Uuid {
                first: 5,
                second: 6
            }
        );
        assert_eq!(to.segment(got.segment).as_deref(), Some(&b"10.0.0.1:1"[..]));
        assert_eq!(to.arm_bytes(), vec![0, 10]);
    }

    #[test]
    fn lru_order_hits_and_forgetting() {
        let t = KeyTable::new(100, 0);
        let d = k("default");
        t.put(
            &d,
            &[(k("a"), 10, Tier::Memory), (k("b"), 20, Tier::Memory)],
            0,
            1,
        );
        t.put(&d, &[(k("c"), 30, Tier::Disk)], 1, 2);
        assert!(t.candidates(10, 5).is_empty(), "puts not ended yet");
        t.complete(&d, [k("a"), k("b"), k("c")].iter(), |_, _| {});
        t.hit(
            &d,
            [(&k("a"), Some(Tier::Disk)), (&k("zz"), None)].into_iter(),
            5,
            |_, _, _| panic!("no key is served from its SSD copy"),
        );
        let c = t.candidates(10, 5);
        let order: Vec<&[u8]> = c.iter().map(|(k, _)| &k[..]).collect();
        assert_eq!(order, [&b"b"[..], b"c", b"a"]);
        assert_eq!((c[2].1.hits, c[2].1.tier), (1, Tier::Disk));
        assert_eq!(c[1].1.arm, 1);
        assert_eq!(t.candidates(1, 5).len(), 1);
        assert_eq!(&t.candidates(1, 5)[0].0[..], b"b");
        t.forget(&d, [k("b")].iter());
        assert_eq!(t.len(), 2);
        t.clear(&d);
        assert!(t.is_empty());
    }

    #[test]
    fn keys_under_a_read_lease_are_no_candidates() {
        let t = KeyTable::new(10, 100);
        t.put(
            &k("t"),
            &[(k("a"), 1, Tier::Memory), (k("b"), 1, Tier::Memory)],
            0,
            0,
        );
        t.complete(&k("t"), [k("a"), k("b")].iter(), |_, _| {});
        t.hit(&k("t"), [(&k("a"), None)].into_iter(), 10, |_, _, _| {});
        let keys = |now| -> Vec<Bytes> { t.candidates(10, now).into_iter().map(|c| c.0).collect() };
        assert_eq!(keys(50), [k("b")]);
        assert_eq!(keys(110), [k("b"), k("a")]);
    }

    #[test]
    fn a_key_found_on_its_ssd_copy_has_lost_its_memory_copy() {
        let t = KeyTable::new(100, 0);
        let d = k("t");
        t.put(
            &d,
            &[(k("a"), 10, Tier::Memory), (k("b"), 10, Tier::Memory)],
            0,
            1,
        );
        t.complete(&d, [k("a"), k("b")].iter(), |_, _| {});
        let mut left = Vec::new();
        let found = [
            (&k("a"), Some(Tier::LocalDisk)),
            (&k("b"), Some(Tier::Memory)),
        ];
        t.hit(&d, found.into_iter(), 5, |k, e, was| {
            left.push((k.clone(), e.tier, was))
        });
        assert_eq!(left, [(k("a"), Tier::LocalDisk, Tier::Memory)]);
        // Found on disk again: nothing more left memory.
        t.hit(
            &d,
            [(&k("a"), Some(Tier::LocalDisk))].into_iter(),
            6,
            |_, _, _| panic!("announced twice"),
        );
    }

    #[test]
    fn tenants_do_not_touch_each_others_keys() {
        let t = KeyTable::new(100, 0);
        let (a, b) = (k("tenant-a"), k("tenant-b"));
        t.put(&a, &[(k("x"), 10, Tier::Memory)], 0, 1);
        t.put(&b, &[(k("x"), 20, Tier::Disk)], 1, 2);
        assert_eq!(t.len(), 2, "the same key under two tenants is two entries");
        t.complete(&a, [k("x")].iter(), |_, _| {});
        // Only a's put ended: only a's key is a candidate, under a.
        let c = t.candidates(10, 5);
        assert_eq!(c.len(), 1);
        assert_eq!((&c[0].1.tenant, c[0].1.size), (&a, 10));
        // b's removal, miss or clear leaves a's key alone.
        t.forget(&b, [k("x")].iter());
        t.clear(&b);
        t.hit(
            &b,
            [(&k("x"), Some(Tier::Disk))].into_iter(),
            9,
            |_, _, _| {},
        );
        assert_eq!(t.len(), 1);
        let c = t.candidates(10, 10);
        assert_eq!(
            (&c[0].1.tenant, c[0].1.hits, c[0].1.tier),
            (&a, 0, Tier::Memory)
        );
        t.forget(&a, [k("x")].iter());
        assert!(t.is_empty());
    }

    #[test]
    fn bytes_per_arm_follow_puts_replacements_and_removals() {
        let t = KeyTable::new(100, 0);
        let d = k("t");
        t.put(
            &d,
            &[(k("a"), 10, Tier::Memory), (k("b"), 20, Tier::Memory)],
            0,
            1,
        );
        t.put(&d, &[(k("c"), 5, Tier::Memory)], 1, 1);
        assert_eq!(t.arm_bytes(), [30, 5]);
        // Put again by the other arm: it moves.
        t.put(&d, &[(k("a"), 12, Tier::Memory)], 1, 2);
        assert_eq!(t.arm_bytes(), [20, 17]);
        t.forget(&d, [k("b")].iter());
        assert_eq!(t.arm_bytes(), [0, 17]);
        t.complete(&d, [k("a"), k("c")].iter(), |_, _| {});
        assert_eq!(t.candidates_of(1, 10, 5).len(), 2);
        assert!(t.candidates_of(0, 10, 5).is_empty());
        t.clear(&d);
        assert_eq!(t.arm_bytes(), [0, 0]);
    }

    #[test]
    fn the_table_stays_bounded_and_keeps_recent_keys() {
        let t = KeyTable::new(1000, 0);
        for i in 0..5000u64 {
            let key = k(&i.to_string());
            t.put(&k("t"), &[(key.clone(), 1, Tier::Memory)], 0, i);
            t.complete(&k("t"), std::iter::once(&key), |_, _| {});
        }
        assert!(t.len() <= 1000, "{}", t.len());
        assert!(t.len() >= 900);
        let c = t.candidates(5000, 5000);
        assert!(c.iter().all(|(_, e)| e.last_ms >= 3900));
        assert!(c.iter().any(|(k, _)| &k[..] == b"4999"));
    }
}

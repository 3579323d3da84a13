//! A model of the store a policy runs against offline: what Mooncake holds (bytes,
//! leases, the master's own eviction) and what moongate does around it (the key table's
//! least-recently-used candidates, eviction rounds), driven by a trace.
//!
//! The policy is called exactly as live traffic calls it, through the same
//! [`Registry`]: `decide` for each request's put (the `on-put` hook, with the same
//! packing; denied keys are not stored), `steer_lookup` on the read of the found prefix
//! (`on-lookup`; a key answered as not found ends the prefix there), the decision finished after the
//! put (`observe`, latency 0: nothing went over a network), and
//! [`crate::eviction::victims`] for every round (`evict`). Keys are named as the trace
//! replay names them (`all/blk/<hash>`), in tenant `default`.
//!
//! Each request, at its arrival time: look the whole prefix up (leading hits count; a
//! found key gets its access time, a hit and a read lease), then put the blocks after
//! the prefix that are not stored (one batch put; admitted blocks are stored while they
//! fit). When they do not fit, [`Rules`] decides what happens.
//!
//! A fleet ([`Fleet`]): one sidecar per rank, each with its own plugin instance and its
//! own part of the key table (the blocks it put, or with access records the blocks
//! whose home it is). Each request is routed to one rank: its lookup and put go through
//! that rank's plugin, and only the owner of a block (or, with records, every rank)
//! tells the owner's table of an access. The master sees every access: its leases and
//! its own eviction are pool-wide. On-demand rules give each rank an equal quota of the
//! capacity; live rules read the pool's usage and every rank frees its portion of the
//! excess (its bytes over the pool's), as the fleet's leader-called rounds do. Not
//! modelled: the leader's cut age (live members cut at the leader's age within a
//! quarter of their portion), record delays and losses.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;

use super::Counts;
use super::baseline::{Route, home, routed};
use super::trace::Trace;
use crate::codec::keys::Keys;
use crate::codec::message::{BatchPutStartArgs, Request, Response};
use crate::codec::types::{
    BufferDescriptor, ErrorCode, GetReplicaListResponse, MemoryDescriptor, ReplicaDescriptor,
    ReplicaLocation, ReplicaStatus, ReplicateConfig, Tier, Uuid,
};
use crate::keys::Entry;
use crate::policy::Outcome;
use crate::policy::registry::Registry;

/// When and how blocks leave the store.
#[derive(Debug, Clone, PartialEq)]
pub enum Rules {
    /// An ideal store whose whole capacity holds data: blocks leave only when a put
    /// needs their room. A round asks the plugin for victims worth at least `batch` of
    /// the capacity (a share) and queues them; they leave in the plugin's order as room
    /// is needed, and a queued block that is found again before it leaves stays (its
    /// hit makes it recent). A plugin call per put would cost a round of up to
    /// `max_candidates` keys each time; with the queue, plain LRU comes out exact.
    OnDemand { batch: f64 },
    /// What a live deployment does (see [`Live`]).
    Live(Live),
}

/// The rules of a live deployment: moongate-driven eviction at watermarks, checked every
/// interval, on top of the master's own eviction and its read leases; a put that does
/// not fit is refused (NO_AVAILABLE_HANDLE).
#[derive(Debug, Clone, PartialEq)]
pub struct Live {
    /// moongate's `eviction.high_watermark` / `low_watermark` (usage ratios).
    pub high: f64,
    pub low: f64,
    /// `eviction.interval_ms`, in wall time.
    pub interval_ms: u64,
    /// `eviction.max_removals_per_interval`.
    pub max_removals: usize,
    /// `eviction.on_put_denials`: refused bytes start a round too.
    pub on_put_denials: bool,
    /// The master's `--eviction_high_watermark_ratio` and `--eviction_ratio`: at that
    /// usage it evicts that share of its objects, least recently used first, leased ones
    /// spared.
    pub master_high: f64,
    pub master_ratio: f64,
    /// The master's read lease (`--default_kv_lease_ttl`): a key found within this long
    /// is removed by neither moongate nor the master.
    pub lease_ms: u64,
    /// The replay's `--speed`: trace time divided by this is wall time.
    pub speed: f64,
}

impl Default for Live {
    /// The shipped replay benchmark's settings (benches/run_replay.sh) and Mooncake's
    /// defaults.
    fn default() -> Self {
        Live {
            high: 0.8,
            low: 0.7,
            interval_ms: 100,
            max_removals: 2000,
            on_put_denials: true,
            master_high: 0.9,
            master_ratio: 0.05,
            // 0.3.13's and 0.3.14's default (0.3.11's was 5,000).
            lease_ms: 10_000,
            speed: 1.0,
        }
    }
}

/// The store and the knobs of one simulation.
#[derive(Debug, Clone)]
pub struct Model {
    pub capacity_bytes: u64,
    pub block_size: u64,
    /// `eviction.max_candidates`: the least recently used keys a round offers the plugin.
    pub max_candidates: usize,
    pub rules: Rules,
    /// A fleet of sidecars on this store; `None`: one moongate.
    pub fleet: Option<Fleet>,
    /// Hint streams derived from the trace (`--hints`); `None`: no hints.
    pub hints: Option<super::hints::HintSpec>,
}

/// A fleet of sidecars, one per rank, in front of one pool.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fleet {
    pub ranks: usize,
    pub route: Route,
    /// The fleet's access records (`fleet.records`): a block belongs to its hash's home
    /// rank, whichever rank put it, and every access reaches the home's table.
    pub records: bool,
}

#[derive(Clone, Copy, Default)]
struct Slot {
    present: bool,
    /// The rank whose table holds it (0 without a fleet).
    owner: u32,
    /// Its place in its owner's least-recently-used order (`Part::order`).
    tick: u64,
    /// Its place in the master's order (`Store::master`; fleets only).
    master_tick: u64,
    /// As its owner's table knows them.
    last_ms: u64,
    hits: u32,
    seen_lease_ms: u64,
    /// The master's read lease: a removal before then fails.
    leased_until_ms: u64,
    /// Chosen by a round, waiting in `Part::doomed` until its room is needed.
    doomed: bool,
}

/// One sidecar's part of the store: the blocks its table holds.
#[derive(Default)]
struct Part {
    /// tick -> block: least recently used first, as this sidecar saw the accesses.
    order: BTreeMap<u64, u32>,
    /// On-demand rules: victims chosen, in the plugin's order, not yet removed.
    doomed: std::collections::VecDeque<u32>,
    used: u64,
    /// On-demand rules: the bytes it may hold (an equal share of the capacity).
    quota: u64,
    /// Live rules: bytes of its puts refused since its evictor last looked.
    denied: u64,
}

struct Store<'a> {
    model: &'a Model,
    keys: Vec<Bytes>,
    slots: Vec<Slot>,
    parts: Vec<Part>,
    /// The master's recency over every block (fleets only: alone, the one part's
    /// order is the master's).
    master: BTreeMap<u64, u32>,
    records: bool,
    next_tick: u64,
    used: u64,
    tenant: Bytes,
    counts: Counts,
    hints: Option<std::cell::RefCell<super::hints::HintModel<'a>>>,
}

/// The hint model as the evictor's hint source: each candidate's block, as the model
/// knows it at the round's time (what the live table would hold).
struct SimHints<'m, 't> {
    model: &'m std::cell::RefCell<super::hints::HintModel<'t>>,
    now_ms: u64,
    /// Some candidate had a hint.
    hinted: std::cell::Cell<bool>,
}

impl crate::eviction::hinted::HintSource for SimHints<'_, '_> {
    fn turnover(&self, age_ms: u64) {
        self.model.borrow_mut().turnover(age_ms);
    }

    fn hints(
        &self,
        _: &Registry,
        arm: &crate::policy::active::Arm,
        keys: &crate::policy::wit::PackedKeys,
        _: &[&Bytes],
    ) -> Option<Vec<crate::policy::wit::CandidateHint>> {
        use super::hints::Known;
        use crate::policy::wit::{CandidateHint, HintKind};
        if !arm.plugin.reads_hints() {
            return None;
        }
        let mut m = self.model.borrow_mut();
        let now = self.now_ms;
        let mut any = false;
        let out = crate::eviction::hinted::each(keys)
            .map(|key| {
                let known = m.block_of(key).map_or(Known::None, |b| m.known(b, now));
                any |= known != Known::None;
                match known {
                    Known::None => CandidateHint {
                        kind: HintKind::None,
                        age_ms: 0,
                        due_in_ms: 0,
                    },
                    // Announced when its request entered the router's queue; its age is
                    // not modelled (0).
                    Known::Upcoming { due_ms } => CandidateHint {
                        kind: HintKind::Upcoming,
                        age_ms: 0,
                        due_in_ms: due_ms.saturating_sub(now),
                    },
                    Known::Done { at_ms } => CandidateHint {
                        kind: HintKind::Done,
                        age_ms: now.saturating_sub(at_ms),
                        due_in_ms: 0,
                    },
                    Known::Expect { at_ms, due_ms } => CandidateHint {
                        kind: HintKind::Expect,
                        age_ms: now.saturating_sub(at_ms),
                        due_in_ms: due_ms.saturating_sub(now),
                    },
                }
            })
            .collect();
        self.hinted.set(self.hinted.get() | any);
        any.then_some(out)
    }
}

/// The client id the simulated puts carry (one client, one arm).
const CLIENT: Uuid = Uuid {
    first: 0x0053_494d,
    second: 1,
};

impl<'a> Store<'a> {
    fn new(model: &'a Model, trace: &'a Trace) -> Store<'a> {
        let ranks = model.fleet.map_or(1, |f| f.ranks.max(1)) as u64;
        let blocks = model.capacity_bytes / model.block_size.max(1);
        // The hint model's times are on the run's clock (trace time over the speed).
        let speed = match &model.rules {
            Rules::OnDemand { .. } => 1.0,
            Rules::Live(l) => l.speed,
        };
        let parts = (0..ranks)
            .map(|i| Part {
                // Whole blocks, the remainder to the first: as the LRU fleet baseline.
                quota: if ranks == 1 {
                    model.capacity_bytes
                } else {
                    (blocks / ranks + u64::from(i < blocks % ranks)) * model.block_size
                },
                ..Default::default()
            })
            .collect();
        Store {
            model,
            keys: trace
                .hashes
                .iter()
                .map(|h| Bytes::from(format!("all/blk/{h}")))
                .collect(),
            slots: vec![Slot::default(); trace.distinct()],
            parts,
            master: BTreeMap::new(),
            records: model.fleet.is_some_and(|f| f.records),
            next_tick: 0,
            used: 0,
            tenant: Bytes::from_static(b"default"),
            counts: Counts::default(),
            hints: model
                .hints
                .clone()
                .map(|s| std::cell::RefCell::new(super::hints::HintModel::new(s, trace, speed))),
        }
    }

    fn fleet(&self) -> bool {
        self.parts.len() > 1
    }

    /// The rank whose table holds block `b` when rank `via` puts it.
    fn owner_of(&self, b: u32, via: usize) -> usize {
        if self.records {
            home(b, self.parts.len())
        } else {
            via
        }
    }

    /// An access to a stored block through rank `via` (a hit, or its put): the master
    /// sees it; the owner's table sees it when the access went through the owner or
    /// records carry it there.
    fn touch(&mut self, b: u32, via: usize, now_ms: u64, lease_ms: u64, hit: bool) {
        let tick = self.next_tick;
        self.next_tick += 1;
        let fleet = self.fleet();
        let records = self.records;
        let s = &mut self.slots[b as usize];
        if hit {
            s.leased_until_ms = now_ms + lease_ms;
        }
        if fleet {
            if s.present {
                self.master.remove(&s.master_tick);
            }
            s.master_tick = tick;
            self.master.insert(tick, b);
        }
        if s.present && !records && s.owner as usize != via {
            return;
        }
        let order = &mut self.parts[s.owner as usize].order;
        if s.present {
            order.remove(&s.tick);
        }
        s.tick = tick;
        s.last_ms = now_ms;
        if hit {
            s.hits = s.hits.saturating_add(1);
            s.seen_lease_ms = s.leased_until_ms;
            s.doomed = false;
        }
        order.insert(tick, b);
    }

    fn store(&mut self, b: u32, owner: usize, now_ms: u64) {
        self.slots[b as usize].owner = owner as u32;
        self.touch(b, owner, now_ms, 0, false);
        let s = &mut self.slots[b as usize];
        s.present = true;
        s.hits = 0;
        s.leased_until_ms = 0;
        s.seen_lease_ms = 0;
        self.used += self.model.block_size;
        self.parts[owner].used += self.model.block_size;
        self.counts.stored += 1;
    }

    /// Removes a block; a removal under the master's read lease fails (an owner that
    /// did not see the lookup that took it learns of it this way).
    fn drop_block(&mut self, b: u32, now_ms: u64) -> bool {
        let s = &mut self.slots[b as usize];
        if !s.present {
            return false;
        }
        if s.leased_until_ms > now_ms {
            s.seen_lease_ms = s.leased_until_ms;
            s.doomed = false;
            return false;
        }
        s.present = false;
        s.doomed = false;
        let part = &mut self.parts[s.owner as usize];
        part.order.remove(&s.tick);
        part.used -= self.model.block_size;
        self.master.remove(&s.master_tick);
        self.used -= self.model.block_size;
        self.counts.evicted += 1;
        true
    }

    /// Up to `max` of rank `part`'s blocks not under a read lease it knows of, least
    /// recently used first.
    fn candidates(&self, part: usize, max: usize, now_ms: u64) -> Vec<u32> {
        self.parts[part]
            .order
            .values()
            .filter(|&&b| self.slots[b as usize].seen_lease_ms <= now_ms)
            .take(max)
            .copied()
            .collect()
    }

    /// One moongate eviction round of rank `part` for `need` bytes, at most `cap`
    /// removals: the plugin picks among the candidates, as live; the victims leave at
    /// once.
    fn round(&mut self, part: usize, reg: &Registry, need: u64, cap: usize, now_ms: u64) {
        for b in self.choose(part, reg, need, cap, now_ms) {
            self.drop_block(b, now_ms);
        }
    }

    /// On-demand rules: frees `need` bytes of rank `part`'s from its queue of chosen
    /// victims, asking its plugin for more (at least `ahead` bytes' worth) when the
    /// queue runs dry.
    fn make_room(&mut self, part: usize, reg: &Registry, need: u64, ahead: u64, now_ms: u64) {
        let mut freed = 0u64;
        let mut asked = false;
        while freed < need {
            let Some(b) = self.parts[part].doomed.pop_front() else {
                if asked {
                    return; // the plugin chose too little: the rest of the put is refused
                }
                asked = true;
                let want = (need - freed).max(ahead);
                let chosen = self.choose(part, reg, want, usize::MAX, now_ms);
                for &b in &chosen {
                    self.slots[b as usize].doomed = true;
                }
                self.parts[part].doomed.extend(chosen);
                continue;
            };
            if self.slots[b as usize].doomed && self.drop_block(b, now_ms) {
                freed += self.model.block_size;
            }
        }
    }

    /// Victims among rank `part`'s candidates for `need` bytes, at most `cap`, chosen
    /// by its plugin.
    fn choose(
        &mut self,
        part: usize,
        reg: &Registry,
        need: u64,
        cap: usize,
        now_ms: u64,
    ) -> Vec<u32> {
        let blocks = self.candidates(part, self.model.max_candidates, now_ms);
        if blocks.is_empty() {
            return Vec::new();
        }
        self.counts.rounds += 1;
        let cands: Vec<(&[u8], Entry)> = blocks
            .iter()
            .map(|&b| {
                let s = &self.slots[b as usize];
                (
                    &self.keys[b as usize][..],
                    Entry {
                        tenant: self.tenant.clone(),
                        size: self.model.block_size,
                        tier: Tier::Memory,
                        last_ms: s.last_ms,
                        hits: s.hits,
                        leased_until_ms: s.seen_lease_ms,
                        arm: 0,
                        complete: true,
                        on_disk: false,
                        client: Default::default(),
                        segment: crate::keys::table::NO_SEGMENT,
                        tries: 0,
                        removing: false,
                    },
                )
            })
            .collect();
        let set = reg.current();
        let hinted = self.hints.as_ref().map(|model| SimHints {
            model,
            now_ms,
            hinted: Default::default(),
        });
        let hints: &dyn crate::eviction::hinted::HintSource = match &hinted {
            Some(h) => h,
            None => &crate::eviction::hinted::NoHints,
        };
        let chosen = crate::eviction::victims(
            reg,
            &set,
            &cands,
            &crate::eviction::Round {
                need,
                now_ms,
                cap,
                tiered: false,
                hints,
            },
        );
        if hinted.is_some_and(|h| h.hinted.get()) {
            self.counts.hinted_rounds += 1;
        }
        chosen.into_iter().map(|(v, _)| blocks[v]).collect()
    }

    /// The master's own eviction: `ratio` of its objects, least recently used first,
    /// leased ones spared.
    fn master_evicts(&mut self, ratio: f64, now_ms: u64) {
        let order = if self.fleet() {
            &self.master
        } else {
            &self.parts[0].order
        };
        let n = ((order.len() as f64 * ratio).ceil() as usize).max(1);
        let victims: Vec<u32> = order
            .values()
            .filter(|&&b| self.slots[b as usize].leased_until_ms <= now_ms)
            .take(n)
            .copied()
            .collect();
        for b in victims {
            if self.drop_block(b, now_ms) {
                self.counts.master_evicted += 1;
            }
        }
    }
}

/// Runs the trace against the store; `regs`: each rank's registry with its own plugin
/// instance (one without a fleet; as many as `model.fleet`'s ranks with one). `clock`
/// is what the plugins' `now-ns` reads (set to trace time here).
///
/// # Panics
/// When `regs` does not hold one registry per rank (a caller's mistake, not input).
pub fn run(trace: &Trace, model: &Model, regs: &[Arc<Registry>], clock: &Arc<AtomicU64>) -> Counts {
    let mut st = Store::new(model, trace);
    assert_eq!(regs.len(), st.parts.len(), "one registry per rank");
    let route = model.fleet.map_or(Route::Random, |f| f.route);
    let (lease_ms, speed) = match &model.rules {
        Rules::OnDemand { .. } => (0, 1.0),
        Rules::Live(l) => (l.lease_ms, l.speed.max(1e-9)),
    };
    let mut next_check_ms = 0u64;
    let cap_bytes = model.capacity_bytes as f64;
    let empty = Bytes::new();
    let mut occupancy_sum = 0f64;
    for (i, r) in trace.requests.iter().enumerate() {
        occupancy_sum += st.used as f64 / cap_bytes.max(1.0);
        let now_ms = (r.ts_ms as f64 / speed) as u64;
        clock.store(now_ms.saturating_mul(1_000_000), Ordering::Relaxed);
        if let Rules::Live(l) = &model.rules {
            // moongate's evictors, every interval that passed since the last request.
            while next_check_ms <= now_ms {
                let mut excess = 0u64;
                if st.used as f64 >= l.high * cap_bytes {
                    excess = st.used - (l.low * cap_bytes) as u64;
                }
                let mut any = excess > 0;
                for (k, reg) in regs.iter().enumerate() {
                    // Each rank's portion of the pool's excess: its bytes over the pool's.
                    let part = &mut st.parts[k];
                    let mut need = (u128::from(excess) * u128::from(part.used))
                        .checked_div(u128::from(st.used))
                        .unwrap_or(0) as u64;
                    if l.on_put_denials {
                        need = need.max(std::mem::take(&mut part.denied));
                    }
                    if need > 0 {
                        any = true;
                        st.round(k, reg, need, l.max_removals, now_ms);
                    }
                }
                next_check_ms += l.interval_ms.max(1);
                if next_check_ms <= now_ms && !any {
                    // Nothing changes between requests: skip the idle checks.
                    next_check_ms = now_ms + 1;
                }
            }
        }
        if let Some(h) = &st.hints {
            h.borrow_mut().arrive(i, now_ms);
        }
        let blocks = trace.blocks_of(r);
        let via = match blocks.first() {
            Some(&first) if st.fleet() => routed(route, i, first, st.parts.len()),
            _ => 0,
        };
        let reg = &regs[via];
        st.counts.lookups += blocks.len() as u64;
        let mut n = blocks
            .iter()
            .take_while(|&&b| st.slots[b as usize].present)
            .count();
        let set = reg.current();
        if n > 0 {
            let ticket = reg.ticket(set.clone(), &CLIENT, Some(&st.keys[blocks[0] as usize][..]));
            let arm = ticket.arm();
            if reg.steers_lookups(arm) {
                let keys: Keys = blocks[..n]
                    .iter()
                    .map(|&b| st.keys[b as usize].clone())
                    .collect();
                let mut resp = replica_answer(n, model.block_size);
                if reg.steer_lookup(arm, &keys, &mut resp) {
                    n = found_prefix(&resp).min(n);
                }
            }
        }
        st.counts.hits += n as u64;
        for &b in &blocks[..n] {
            st.touch(b, via, now_ms, lease_ms, true);
        }
        // Served: what the serving stack then says of its blocks (the put follows).
        if let Some(h) = &st.hints {
            h.borrow_mut().served(i, now_ms);
        }
        let rest: Vec<u32> = blocks[n..]
            .iter()
            .copied()
            .filter(|&b| !st.slots[b as usize].present)
            .collect();
        if rest.is_empty() {
            continue;
        }
        let req = Request::BatchPutStart(BatchPutStartArgs {
            client_id: CLIENT,
            keys: rest.iter().map(|&b| st.keys[b as usize].clone()).collect(),
            slice_lengths: vec![model.block_size; rest.len()],
            config: ReplicateConfig::default(),
            tenant_id: empty.clone(),
        });
        let decided = reg.decide(&set, &req, None);
        let mut admitted = vec![true; rest.len()];
        for &(i, _) in decided.refused().map_or(&[][..], |f| &f.denied[..]) {
            if let Some(a) = admitted.get_mut(i) {
                *a = false;
            }
        }
        let want: Vec<u32> = rest
            .iter()
            .zip(&admitted)
            .filter(|(_, a)| **a)
            .map(|(&b, _)| b)
            .collect();
        st.counts.denied += (rest.len() - want.len()) as u64;
        let owners: Vec<usize> = want.iter().map(|&b| st.owner_of(b, via)).collect();
        if let Rules::OnDemand { batch } = model.rules {
            // Each owner makes room in its quota for its blocks of the put.
            let mut bytes = vec![0u64; st.parts.len()];
            for &o in &owners {
                bytes[o] += model.block_size;
            }
            for (o, b) in bytes.into_iter().enumerate() {
                let part = &st.parts[o];
                if b > 0 && part.used + b > part.quota {
                    let need = part.used + b - part.quota;
                    let ahead = (batch * part.quota as f64) as u64;
                    st.make_room(o, &regs[o], need, ahead, now_ms);
                }
            }
        }
        let mut refused = 0u64;
        for (&b, &o) in want.iter().zip(&owners) {
            let fits = match model.rules {
                Rules::OnDemand { .. } => st.parts[o].used + model.block_size <= st.parts[o].quota,
                Rules::Live(_) => st.used + model.block_size <= model.capacity_bytes,
            };
            if fits {
                st.store(b, o, now_ms);
            } else {
                refused += 1;
            }
        }
        st.counts.refused += refused;
        st.parts[via].denied += refused * model.block_size;
        if let Rules::Live(l) = &model.rules
            && st.used as f64 >= l.master_high * cap_bytes
        {
            st.master_evicts(l.master_ratio, now_ms);
        }
        let failed = refused > 0 || want.len() < rest.len();
        decided.finish(&Outcome {
            method: "BatchPutStart",
            code: if refused > 0 {
                ErrorCode::NO_AVAILABLE_HANDLE.0
            } else {
                0
            },
            failed,
            latency: Some(Duration::ZERO),
            keys: rest.len(),
        });
    }
    if let Some(h) = &st.hints {
        let a = h.borrow().announced;
        (
            st.counts.hints_upcoming,
            st.counts.hints_done,
            st.counts.hints_wrong,
            st.counts.hints_expect,
        ) = (a[0], a[1], a[2], a[3]);
    }
    st.counts.occupancy_ppm =
        (occupancy_sum / trace.requests.len().max(1) as f64 * 1e6).round() as u64;
    st.counts
}

/// A `BatchGetReplicaList` answer for `n` keys, one complete memory replica each.
fn replica_answer(n: usize, size: u64) -> Response {
    let one = GetReplicaListResponse {
        replicas: vec![ReplicaDescriptor {
            id: 1,
            location: ReplicaLocation::Memory(MemoryDescriptor {
                buffer_descriptor: BufferDescriptor {
                    size,
                    buffer_address: 0,
                    protocol: Bytes::from_static(b"tcp"),
                    transport_endpoint: Bytes::from_static(b"127.0.0.1:1"),
                },
            }),
            status: ReplicaStatus::COMPLETE,
        }],
        lease_ttl_ms: 0,
        object_checksum: None,
    };
    Response::BatchGetReplicaList(vec![Ok(one); n])
}

/// Leading keys of a steered lookup answer that still have a replica.
fn found_prefix(resp: &Response) -> usize {
    match resp {
        Response::BatchGetReplicaList(v) => v
            .iter()
            .take_while(|r| r.as_ref().is_ok_and(|l| !l.replicas.is_empty()))
            .count(),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    //! The store model with fake policies (no wasm): what each hook's answer does.

    use super::*;
    use crate::policy::Policy;
    use crate::policy::fake::Fake;
    use crate::policy::host::wit;

    /// The first `n` requests of the shipped trace.
    fn shipped(n: usize) -> Trace {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../benches/traces/mooncake_fast25_synthetic.jsonl"
        );
        let text = std::fs::read_to_string(path).unwrap();
        let head: Vec<&str> = text.lines().take(n).collect();
        Trace::parse(&head.join("\n")).unwrap()
    }

    fn run_with(trace: &Trace, p: Fake, blocks: u64, rules: Rules) -> Counts {
        let metrics = crate::metrics::Metrics::new();
        let policy: Arc<dyn Policy> = Arc::new(p);
        let reg = Registry::with_policies(
            Default::default(),
            None,
            metrics.policy.clone(),
            vec![policy],
        )
        .unwrap();
        let model = Model {
            capacity_bytes: blocks * 1024,
            block_size: 1024,
            max_candidates: 4096,
            rules,
            fleet: None,
            hints: None,
        };
        run(trace, &model, &[reg], &Arc::new(AtomicU64::new(0)))
    }

    #[test]
    fn without_an_evict_hook_the_store_is_lru() {
        let t = shipped(1500);
        for share in [0.05, 0.2] {
            let blocks = (share * t.distinct() as f64) as u64;
            let plain = super::super::baseline::lru(&t, blocks as usize);
            let modeled = run_with(&t, Fake::new("p"), blocks, Rules::OnDemand { batch: 0.05 });
            assert_eq!(modeled.lookups, plain.lookups);
            let d = (modeled.hit_rate() - plain.hit_rate()).abs();
            assert!(d < 0.005, "{share}: {modeled:?} vs {plain:?}");
            assert!(modeled.evicted > 0 && modeled.refused == 0);
        }
    }

    #[test]
    fn a_fleet_without_an_evict_hook_is_the_lru_fleet() {
        let t = shipped(1500);
        let blocks = (0.05 * t.distinct() as f64) as u64;
        let metrics = crate::metrics::Metrics::new();
        let regs: Vec<Arc<Registry>> = (0..4)
            .map(|_| {
                let p: Arc<dyn Policy> = Arc::new(Fake::new("p"));
                Registry::with_policies(Default::default(), None, metrics.policy.clone(), vec![p])
                    .unwrap()
            })
            .collect();
        let mut rates = Vec::new();
        for records in [false, true] {
            let model = Model {
                capacity_bytes: blocks * 1024,
                block_size: 1024,
                max_candidates: 4096,
                rules: Rules::OnDemand { batch: 0.05 },
                hints: None,
                fleet: Some(Fleet {
                    ranks: 4,
                    route: Route::Random,
                    records,
                }),
            };
            let modeled = run(&t, &model, &regs, &Arc::new(AtomicU64::new(0)));
            let native =
                super::super::baseline::lru_fleet(&t, blocks as usize, 4, Route::Random, records);
            assert_eq!(modeled.lookups, native.lookups);
            let d = (modeled.hit_rate() - native.hit_rate()).abs();
            assert!(d < 0.005, "records {records}: {modeled:?} vs {native:?}");
            rates.push(modeled.hit_rate());
        }
        let one = super::super::baseline::lru(&t, blocks as usize).hit_rate();
        assert!(
            rates[0] < rates[1] && rates[1] <= one + 0.005,
            "partial views {:.4}, records {:.4}, one LRU {one:.4}",
            rates[0],
            rates[1]
        );
    }

    #[test]
    fn in_a_live_fleet_a_removal_the_owner_thinks_free_fails_under_anothers_lease() {
        // Two ranks, no records: rank 1 reads a block rank 0 put, so the master holds a
        // lease rank 0 never heard of; rank 0's removal fails and the block stays.
        let t = shipped(1);
        let model = Model {
            capacity_bytes: 1 << 20,
            block_size: 1024,
            max_candidates: 16,
            rules: Rules::Live(Live::default()),
            hints: None,
            fleet: Some(Fleet {
                ranks: 2,
                route: Route::Random,
                records: false,
            }),
        };
        let mut st = Store::new(&model, &t);
        let b = 0;
        st.store(b, 0, 0);
        st.touch(b, 1, 10, 5_000, true);
        assert_eq!(st.candidates(0, 16, 100), [b], "rank 0 saw no lease");
        assert!(!st.drop_block(b, 100), "the master's lease holds");
        assert!(
            st.candidates(0, 16, 100).is_empty(),
            "and now rank 0 knows it"
        );
        assert!(st.drop_block(b, 5_011), "after the lease");
        assert_eq!(st.used, 0);
    }

    #[test]
    fn denied_puts_are_not_stored() {
        let t = shipped(300);
        let deny_all = Fake::new("deny").on_put(|c| {
            Ok(wit::PutDecision {
                config: None,
                admissions: vec![wit::Admission::Deny(-200); c.sizes.len()],
            })
        });
        let c = run_with(&t, deny_all, 1_000_000, Rules::OnDemand { batch: 0.05 });
        assert_eq!((c.hits, c.stored), (0, 0));
        assert!(c.denied > 0);
    }

    #[test]
    fn a_key_the_lookup_hook_hides_ends_the_prefix() {
        let t = shipped(300);
        let all = run_with(
            &t,
            Fake::new("p"),
            1_000_000,
            Rules::OnDemand { batch: 0.05 },
        );
        assert!(all.hits > 0);
        let hide = Fake::new("hide").on_lookup(|c| Ok(vec![Vec::new(); c.counts.len()]));
        let c = run_with(&t, hide, 1_000_000, Rules::OnDemand { batch: 0.05 });
        assert_eq!(c.hits, 0);
    }

    #[test]
    fn live_rules_keep_usage_under_the_watermarks_and_refuse_what_does_not_fit() {
        let t = shipped(1500);
        let blocks = (0.05 * t.distinct() as f64) as u64;
        let ideal = run_with(&t, Fake::new("p"), blocks, Rules::OnDemand { batch: 0.05 });
        let live = run_with(&t, Fake::new("p"), blocks, Rules::Live(Live::default()));
        assert!(live.rounds > 0 && live.evicted > 0);
        // Rounds keep usage between the watermarks: less of the capacity holds data.
        assert!(live.hits < ideal.hits, "{live:?} vs {ideal:?}");
    }
}

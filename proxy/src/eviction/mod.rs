//! moongate-driven eviction: the policy, not the master's own LRU, picks which keys go
//! when memory runs short.
//!
//! - The candidates are the key table's ([`crate::keys`]): what every face saw stored,
//!   read and removed, through [`crate::answered`]. No extra RPC.
//! - A task ([`Evictor::run`]) checks the triggers every `interval_ms`: the master's
//!   memory usage from its Prometheus endpoint against `high_watermark`, and puts the
//!   master denied with NO_AVAILABLE_HANDLE.
//! - A round takes the least recently used candidates, asks each experiment arm's
//!   plugin (`evict`) for victims among the keys it put, with a share of the bytes
//!   needed, and removes them (`Remove`, never forced: a key a reader holds a lease on
//!   stays) on its own master connection, at most `max_removals_per_interval` per
//!   round. An arm whose plugin has no `evict` hook, or whose call fails, gets
//!   least-recently-used victims. There is no lookup before a removal: in Mooncake
//!   0.3.13 `ExistKey` grants a read lease like `GetReplicaList` does, so any probe would
//!   make the removal fail; `Remove` itself answers OBJECT_NOT_FOUND for a key already
//!   gone, and the table forgets it.
//!
//! Owns no client connection and no frame: it talks to the master through
//! [`crate::upstream`] only.

pub mod config;
pub mod hinted;
pub mod metrics;
pub mod usage;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio_util::sync::CancellationToken;

use crate::codec::message::{RemoveArgs, Request, Response};
use crate::codec::types::ErrorCode;
use crate::keys::table::NO_SEGMENT;
use crate::keys::{Entry, Keys, Why};
use crate::policy::active::ActiveSet;
use crate::policy::host::wit;
use crate::policy::registry::Registry;
use crate::upstream::{Conn, HttpUrl};
use config::EvictionConfig;
use metrics::{EvictionMetrics, Stage, Trigger, Victim};

/// Removals per pipelined burst on moongate's own connection.
const CHUNK: usize = 1000;
/// The fewest keys a leader's own cut must take for the fleet to cut at its age: each
/// member's count of keys older than the cut varies as a sample's does (about 1/sqrt(n)
/// with n keys: an eighth at 64), and the portions by bytes bound it to a quarter
/// either way.
const MIN_CUT_KEYS: usize = 64;

/// Replica clears that clear nothing before the table forgets a key (offload on).
const CLEAR_TRIES: u8 = 3;

/// Milliseconds from `at_ms` (wall clock, another member's) to now; 0 when that is
/// negative or over 10 s (clocks too far apart to trust).
fn since(at_ms: u64) -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    match now.checked_sub(at_ms) {
        Some(d) if d <= 10_000 => d,
        _ => 0,
    }
}

/// The leader's cut for its portion of `need` bytes, for the other members to cut at:
/// the age of the newest key a least-recently-used cut of `cands` (oldest first)
/// frees. 0 (the others free their portions by bytes alone) when that cut takes fewer
/// than [`MIN_CUT_KEYS`] keys: a handful of keys is too small a sample of the pool's ages.
fn cut_age(cands: &[(Bytes, Entry)], need: u64, now: u64) -> u64 {
    let mut freed = 0u64;
    for (n, (_, e)) in cands.iter().enumerate() {
        freed = freed.saturating_add(e.size);
        if freed >= need {
            return if n + 1 >= MIN_CUT_KEYS {
                now.saturating_sub(e.last_ms).max(1)
            } else {
                0
            };
        }
    }
    0
}

/// The evictor: the triggers, the rounds and the removals, over the key table
/// ([`crate::keys`]) it reads candidates from.
pub struct Evictor {
    pub cfg: EvictionConfig,
    keys: Arc<Keys>,
    metrics: Arc<EvictionMetrics>,
    usage_url: Option<HttpUrl>,
    /// The owners: with an SSD tier offloading, victims lose only their memory replica.
    topology: Arc<crate::topology::Topology>,
    /// The fleet (`[fleet]` on): this moongate frees only its portion of what the pool
    /// or an arm must free, the other members the rest.
    fleet: Option<Arc<crate::fleet::Fleet>>,
    /// What the serving stack said of keys and blocks: read by plugins with
    /// `evict-hinted`.
    hints: Arc<crate::hints::Hints>,
}

/// What the evictor works with besides its config and metrics.
pub struct Parts {
    pub keys: Arc<Keys>,
    pub topology: Arc<crate::topology::Topology>,
    pub fleet: Option<Arc<crate::fleet::Fleet>>,
    pub hints: Arc<crate::hints::Hints>,
}

impl Evictor {
    pub fn new(cfg: EvictionConfig, metrics: Arc<EvictionMetrics>, parts: Parts) -> Evictor {
        Evictor {
            usage_url: HttpUrl::parse(&cfg.master_metrics_url),
            cfg,
            metrics,
            keys: parts.keys,
            topology: parts.topology,
            fleet: parts.fleet,
            hints: parts.hints,
        }
    }

    fn now_ms(&self) -> u64 {
        self.keys.now_ms()
    }

    /// Runs the triggers and rounds until shutdown.
    pub async fn run(
        self: Arc<Self>,
        policy: Arc<Registry>,
        upstream: crate::upstream::Upstream,
        shutdown: CancellationToken,
    ) {
        let mut conn: Option<(String, Conn)> = None;
        let mut usage_failing = false;
        let interval = Duration::from_millis(self.cfg.interval_ms);
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut rounds = self.fleet.as_deref().map(|f| f.rounds_heard());
        // When this member, as leader, last called a round.
        let mut called_at: Option<tokio::time::Instant> = None;
        loop {
            let heard = tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => None,
                r = next_round(&mut rounds) => Some(r),
            };
            if let Some(round) = heard {
                let (excess, pool) = (round.excess, round.allocated);
                // The leader called a pool-wide round: this member's portion of that
                // excess, now, as every other member frees its own.
                let set = policy.current();
                if let Some(f) = self.fleet.as_deref().filter(|_| !by_weight(&set)) {
                    let mine = self.keys.table.arm_bytes().iter().sum();
                    let need = self.whole_keys(f.portion(mine, excess, pool), mine);
                    tracing::debug!(excess, mine, portion = need, "fleet: the leader's round");
                    let cut = (round.age_ms > 0).then(|| round.age_ms + since(round.at_ms));
                    self.pool_round(
                        &mut conn,
                        None,
                        need,
                        cut,
                        Trigger::Usage,
                        &policy,
                        &upstream,
                    )
                    .await;
                }
                if let Some(f) = self.fleet.as_deref() {
                    f.round_freed(&round);
                }
                continue;
            }
            let mut usage_need = 0u64;
            let mut capacity = None;
            if let Some(url) = &self.usage_url {
                match usage::master_usage(url, self.call_timeout()).await {
                    Ok(u) => {
                        if usage_failing {
                            tracing::info!("master metrics readable again");
                            usage_failing = false;
                        }
                        if let Some(b) = u.ssd_bytes {
                            self.metrics.ssd_bytes.set(b as i64);
                        }
                        if u.capacity_bytes > 0 {
                            capacity = Some((u.capacity_bytes, u.allocated_bytes));
                            let ratio = u.allocated_bytes as f64 / u.capacity_bytes as f64;
                            self.metrics.usage_ppm.set((ratio * 1e6) as i64);
                            if ratio >= self.cfg.high_watermark {
                                let target =
                                    (self.cfg.low_watermark * u.capacity_bytes as f64) as u64;
                                usage_need = u.allocated_bytes.saturating_sub(target);
                            }
                        }
                    }
                    Err(e) => {
                        self.metrics.error(Stage::Usage);
                        if !usage_failing {
                            tracing::warn!(error = %e, url = %self.cfg.master_metrics_url,
                                "cannot read the master's memory usage; usage trigger paused");
                            usage_failing = true;
                        }
                    }
                }
            }
            let set = policy.current();
            let shares = by_weight(&set) && capacity.is_some();
            let mut need = 0u64;
            let mut trigger = None;
            // The leader's candidates, scanned once for its cut and its round.
            let mut leader_cands = None;
            // With shares the arms' own rounds below hold the pool under the watermark:
            // a pool-wide usage round on top would free the same room twice.
            if usage_need > 0 && !shares {
                // In a fleet only the leader calls pool-wide rounds (every member hears
                // of it and frees its portion at once); alone, all of the excess.
                match self.fleet.as_deref() {
                    None => need = usage_need,
                    // The last round may still be under way at the other members
                    // (delivered through etcd, then their removals): the usage read
                    // now may not show it yet, and calling again would free its
                    // excess twice (a fixed wait of two intervals was not enough on a
                    // busy machine: 16 members took the pool to 0.598). The next round
                    // waits for every member's word that it freed its portion, at
                    // least two intervals, at most ROUND_WAIT_INTERVALS.
                    Some(f)
                        if f.leads()
                            && called_at.is_none_or(|t| {
                                let waited = t.elapsed();
                                waited >= 2 * interval
                                    && (f.last_round_done()
                                        || waited >= crate::fleet::ROUND_WAIT_INTERVALS * interval)
                            }) =>
                    {
                        called_at = Some(tokio::time::Instant::now());
                        let pool = capacity.map_or(0, |(_, allocated)| allocated);
                        let mine = self.keys.table.arm_bytes().iter().sum();
                        need = self.whole_keys(f.portion(mine, usage_need, pool), mine);
                        let now = self.now_ms();
                        let cands = self.keys.table.candidates(self.cfg.max_candidates, now);
                        f.call_round(usage_need, pool, cut_age(&cands, need, now));
                        leader_cands = Some(cands);
                        tracing::debug!(
                            excess = usage_need,
                            mine,
                            portion = need,
                            "fleet: this member leads; round called"
                        );
                    }
                    Some(_) => {}
                }
                trigger = Some(Trigger::Usage);
            }
            let denied = self.keys.take_denied();
            if self.cfg.on_put_denials && denied > 0 {
                need = need.max(denied);
                trigger.get_or_insert(Trigger::Denials);
            }
            if set.arms.len() >= 2 && !by_weight(&set) {
                let bytes = self.keys.table.arm_bytes();
                for (i, arm) in set.arms.iter().enumerate() {
                    self.metrics
                        .arm_bytes(&arm.name, bytes.get(i).copied().unwrap_or(0), 0);
                }
            }
            if let Some((capacity, allocated)) = capacity.filter(|_| by_weight(&set)) {
                // Each arm within its own share, from its own keys only.
                for (arm, need) in self.arm_needs(&set, capacity, allocated) {
                    self.metrics.round(Trigger::ArmShare);
                    let cands =
                        self.keys
                            .table
                            .candidates_of(arm, self.cfg.max_candidates, self.now_ms());
                    let r = self
                        .round(&mut conn, &cands, need, true, &policy, &upstream)
                        .await;
                    if let Err(e) = r {
                        tracing::warn!(error = %e, arm, "eviction round cut short");
                        conn = None;
                    }
                    self.metrics.rounds_ended.inc();
                }
            }
            if let Some(trigger) = trigger.filter(|_| need > 0) {
                let cands = leader_cands.take();
                self.pool_round(&mut conn, cands, need, None, trigger, &policy, &upstream)
                    .await;
            }
        }
    }

    /// What to ask the victims to cover for a `portion` of a pool-wide round that every
    /// member takes at once (`mine`: this member's bytes): half a key less. Victims are
    /// whole keys and cover at least what is asked, on average half a key more; alone
    /// that is noise, but N members rounding up together free N/2 keys too many
    /// (measured: 16 members with 1 MiB keys took the pool 0.04 under the low watermark).
    fn whole_keys(&self, portion: u64, mine: u64) -> u64 {
        let keys = self.keys.table.len() as u64;
        let half_key = mine.checked_div(keys).unwrap_or(0) / 2;
        portion.saturating_sub(half_key)
    }

    /// A round over the whole table (not one arm's keys) for `need` bytes; with `cut`
    /// (the leader's cut age), the bytes of this member's keys older than that instead,
    /// within a quarter of `need` either way (the bytes still bound the total when a
    /// member's sample of the pool's ages differs from the leader's). `cands`: the
    /// candidates when the caller has just scanned them; else this scans.
    #[allow(clippy::too_many_arguments)]
    async fn pool_round(
        &self,
        conn: &mut Option<(String, Conn)>,
        cands: Option<Vec<(Bytes, Entry)>>,
        need: u64,
        cut: Option<u64>,
        trigger: Trigger,
        policy: &Registry,
        upstream: &crate::upstream::Upstream,
    ) {
        if need == 0 {
            return;
        }
        self.metrics.round(trigger);
        let now = self.now_ms();
        let cands =
            cands.unwrap_or_else(|| self.keys.table.candidates(self.cfg.max_candidates, now));
        let need = match cut {
            Some(age) => {
                let older: u64 = cands
                    .iter()
                    .filter(|(_, e)| now.saturating_sub(e.last_ms) >= age)
                    .map(|(_, e)| e.size)
                    .sum();
                tracing::debug!(portion = need, older, "fleet: the leader's cut");
                older.clamp(need - need / 4, need.saturating_add(need / 4))
            }
            None => need,
        };
        if let Err(e) = self
            .round(conn, &cands, need, false, policy, upstream)
            .await
        {
            tracing::warn!(error = %e, "eviction round cut short");
            *conn = None;
        }
        self.metrics.rounds_ended.inc();
    }

    /// By-weight shares: the bytes each arm over the high watermark of its share must
    /// free to come down to the low one. Publishes every arm's bytes and share.
    /// In a fleet an arm's bytes are every member's, and this member frees its portion
    /// of the arm's excess (its bytes of the arm over the fleet's).
    fn arm_needs(&self, set: &ActiveSet, capacity: u64, allocated: u64) -> Vec<(usize, u64)> {
        let mine = self.keys.table.arm_bytes();
        let mine_of = |i: usize| mine.get(i).copied().unwrap_or(0);
        let fleet_raw: Vec<u64> = match self.fleet.as_deref() {
            Some(f) => {
                let view = f.view();
                set.arms
                    .iter()
                    .enumerate()
                    .map(|(i, a)| view.arm_bytes(&f.me, &a.name, mine_of(i)))
                    .collect()
            }
            None => (0..set.arms.len()).map(mine_of).collect(),
        };
        let bytes = arm_usage(&fleet_raw, allocated);
        let total: u64 = set.arms.iter().map(|a| a.weight()).sum::<u64>().max(1);
        let mut out = Vec::new();
        for (i, arm) in set.arms.iter().enumerate() {
            let share =
                (u128::from(capacity) * u128::from(arm.weight()) / u128::from(total)) as u64;
            let used = bytes.get(i).copied().unwrap_or(0);
            self.metrics.arm_bytes(&arm.name, used, share);
            if used as f64 >= self.cfg.high_watermark * share as f64 {
                let target = (self.cfg.low_watermark * share as f64) as u64;
                let excess = used.saturating_sub(target);
                let raw = fleet_raw.get(i).copied().unwrap_or(0);
                out.push((i, crate::fleet::share_of(excess, mine_of(i), raw)));
            }
        }
        out.retain(|(_, n)| *n > 0);
        out
    }

    fn call_timeout(&self) -> Duration {
        Duration::from_millis(self.cfg.call_timeout_ms)
    }

    /// Removes victims among `cands` for `need` bytes. `enforce`: when the plugins
    /// choose too little, the least recently used candidates make up the rest (an arm
    /// held to its share cannot keep more by declining to evict).
    async fn round(
        &self,
        conn: &mut Option<(String, Conn)>,
        cands: &[(Bytes, Entry)],
        need: u64,
        enforce: bool,
        policy: &Registry,
        upstream: &crate::upstream::Upstream,
    ) -> Result<(), crate::upstream::CallError> {
        // With an SSD tier offloading, moongate frees memory only from keys already on
        // an SSD (it drops their memory replica): a key with no other copy is left to
        // the master, which offloads before it evicts (`offload_on_evict`) or drops it.
        let topo = Some(&*self.topology).filter(|t| t.offloading());
        let on_disk: Vec<(Bytes, Entry)>;
        let cands = match topo {
            Some(_) => {
                on_disk = cands.iter().filter(|(_, e)| e.on_disk).cloned().collect();
                &on_disk[..]
            }
            None => cands,
        };
        if cands.is_empty() {
            tracing::debug!(need, "eviction round: no candidates in the table");
            return Ok(());
        }
        let addr = upstream
            .addr()
            .ok_or(crate::upstream::CallError::NoLeader)?;
        // A connection to an earlier leader is dropped: removals go to the one in force.
        if conn.as_ref().is_none_or(|(a, _)| *a != addr) {
            *conn = Some((
                addr.clone(),
                Conn::connect(&addr, self.call_timeout(), upstream.release()).await?,
            ));
        }
        let Some((_, c)) = conn.as_mut() else {
            return Ok(());
        };
        // No existence probe before removing: in Mooncake 0.3.13 ExistKey grants a read
        // lease just like GetReplicaList (measured: Remove after is_exist answers
        // OBJECT_HAS_LEASE), so a probe would block the removal it prepares. A victim
        // that is already gone answers OBJECT_NOT_FOUND and is forgotten.
        let set = policy.current();
        let mut victims = self.choose(cands, need, policy, topo.is_some());
        if enforce {
            top_up(
                &mut victims,
                cands,
                need,
                self.cfg.max_removals_per_interval,
            );
        }
        tracing::debug!(
            candidates = cands.len(),
            victims = victims.len(),
            need,
            "eviction victims"
        );
        if victims.is_empty() {
            return Ok(());
        }
        let Some(topo) = topo else {
            let chosen: Vec<(Bytes, Entry)> =
                victims.into_iter().map(|(i, _)| cands[i].clone()).collect();
            return self.remove(c, &chosen, &set).await;
        };
        // With an SSD tier: the memory copy goes unless the plugin said the whole key.
        let (whole, memory): (Vec<_>, Vec<_>) = victims
            .into_iter()
            .partition(|(_, scope)| *scope == wit::EvictScope::All);
        let pick = |v: Vec<(usize, wit::EvictScope)>| -> Vec<(Bytes, Entry)> {
            v.into_iter().map(|(i, _)| cands[i].clone()).collect()
        };
        if !whole.is_empty() {
            self.remove(c, &pick(whole), &set).await?;
        }
        if !memory.is_empty() {
            self.clear_memory(c, &pick(memory), &set, topo).await?;
        }
        Ok(())
    }

    /// Removes the victims' keys (`Remove`, not forced): every copy goes, an SSD's too.
    async fn remove(
        &self,
        c: &mut Conn,
        chosen: &[(Bytes, Entry)],
        set: &ActiveSet,
    ) -> Result<(), crate::upstream::CallError> {
        let reqs: Vec<Request> = chosen
            .iter()
            .map(|(k, e)| {
                Request::Remove(RemoveArgs {
                    key: k.clone(),
                    force: false,
                    tenant_id: e.tenant.clone(),
                })
            })
            .collect();
        let mut gone = self.keys.departures();
        for (chunk, entries) in reqs.chunks(CHUNK).zip(chosen.chunks(CHUNK)) {
            let answers = c
                .call_all(chunk, self.call_timeout())
                .await
                .inspect_err(|_| {
                    self.metrics.error(Stage::Remove);
                })?;
            for ((k, e), a) in entries.iter().zip(answers) {
                let result = match a {
                    Ok(Response::Remove(Ok(()))) => {
                        self.metrics.removed_bytes.inc_by(e.size);
                        self.keys.history.note(
                            &e.tenant,
                            std::iter::once(k),
                            Why::evicted_by_moongate,
                            e.arm,
                            self.now_ms(),
                        );
                        if let Some(arm) =
                            set.arms.get(e.arm as usize).filter(|_| set.arms.len() > 1)
                        {
                            self.metrics.arm_removed(&arm.name, e.size);
                        }
                        gone.whole(k, e);
                        Victim::Removed
                    }
                    Ok(Response::Remove(Err(ErrorCode::OBJECT_HAS_LEASE))) => Victim::Leased,
                    Ok(Response::Remove(Err(ErrorCode::OBJECT_NOT_FOUND))) => {
                        // Already gone (the master evicted it): gone all the same.
                        gone.whole(k, e);
                        Victim::NotFound
                    }
                    other => {
                        tracing::debug!(key = ?k, answer = ?other, "eviction removal failed");
                        Victim::Error
                    }
                };
                self.metrics.victim(result);
            }
        }
        tracing::debug!(removed = gone.keys().len(), "eviction round");
        self.topology
            .ssd_removed(gone.keys().iter().map(|(t, k)| (&t[..], &k[..])));
        self.keys.depart(gone);
        Ok(())
    }

    /// With an SSD tier offloading: drops only the victims' memory replicas
    /// (`BatchReplicaClear` naming the memory segment and the client that put them), so
    /// a copy on an owner's SSD stays; a key with no other copy goes, as with `Remove`.
    /// A victim whose memory segment moongate does not know is kept: never a `Remove`,
    /// which would delete the SSD copy too.
    async fn clear_memory(
        &self,
        c: &mut Conn,
        chosen: &[(Bytes, Entry)],
        set: &ActiveSet,
        topo: &crate::topology::Topology,
    ) -> Result<(), crate::upstream::CallError> {
        use crate::codec::message::ReplicaClearArgs;
        // One call per (client, segment): the master checks both per key.
        let mut groups: std::collections::BTreeMap<(u64, u64, u16), Vec<usize>> =
            Default::default();
        for (i, (_, e)) in chosen.iter().enumerate() {
            if e.segment == NO_SEGMENT {
                self.metrics.victim(Victim::Kept);
                continue;
            }
            groups
                .entry((e.client.first, e.client.second, e.segment))
                .or_default()
                .push(i);
        }
        let mut gone = self.keys.departures();
        for ((first, second, seg), idx) in groups {
            let Some(endpoint) = self.keys.table.segment(seg) else {
                continue;
            };
            let name = topo.segment_name(&endpoint);
            for part in idx.chunks(CHUNK) {
                let req = Request::BatchReplicaClear(ReplicaClearArgs {
                    keys: part.iter().map(|&i| chosen[i].0.clone()).collect(),
                    client_id: crate::codec::types::Uuid { first, second },
                    segment_name: name.clone(),
                });
                let answer = c
                    .call_all(std::slice::from_ref(&req), self.call_timeout())
                    .await
                    .inspect_err(|_| self.metrics.error(Stage::Remove))?;
                let cleared: std::collections::HashSet<Bytes> = match answer.into_iter().next() {
                    Some(Ok(Response::BatchReplicaClear(Ok(keys)))) => {
                        tracing::debug!(segment = ?name, asked = part.len(), cleared = ?keys,
                            "memory replicas cleared");
                        keys.into_iter().collect()
                    }
                    other => {
                        tracing::debug!(answer = ?other, "replica clear failed");
                        for _ in part {
                            self.metrics.victim(Victim::Error);
                        }
                        continue;
                    }
                };
                for &i in part {
                    let (k, e) = &chosen[i];
                    if !cleared.contains(k) {
                        // The master cleared nothing: the key is under a lease (an
                        // owner's offload lookup grants one), its memory replica is
                        // already gone (the master evicted it, the SSD copy serves it),
                        // or the key is gone. The answer does not say which: the key
                        // waits a lease before it is tried again, and is forgotten after
                        // a few tries, or the same stale keys would be chosen round
                        // after round. The master's own eviction stays the backstop.
                        self.metrics.victim(Victim::Kept);
                        self.keys.table.back_off(
                            &e.tenant,
                            k,
                            self.now_ms() + self.cfg.lease_ms,
                            CLEAR_TRIES,
                        );
                        continue;
                    }
                    self.metrics.removed_bytes.inc_by(e.size);
                    if let Some(arm) = set.arms.get(e.arm as usize).filter(|_| set.arms.len() > 1) {
                        self.metrics.arm_removed(&arm.name, e.size);
                    }
                    if e.on_disk {
                        // Its memory copy is gone; its SSD copy still serves reads.
                        self.metrics.victim(Victim::MemoryCleared);
                        gone.memory(k, e);
                    } else {
                        self.metrics.victim(Victim::Removed);
                        self.keys.history.note(
                            &e.tenant,
                            std::iter::once(k),
                            Why::evicted_by_moongate,
                            e.arm,
                            self.now_ms(),
                        );
                        gone.whole(k, e);
                    }
                }
            }
        }
        // The table holds what uses memory: a key left only on an SSD leaves it.
        self.keys.depart(gone);
        Ok(())
    }

    /// Victims (indexes into `cands`) covering `need` bytes, chosen by each arm's plugin.
    fn choose(
        &self,
        cands: &[(Bytes, Entry)],
        need: u64,
        policy: &Registry,
        tiered: bool,
    ) -> Vec<(usize, wit::EvictScope)> {
        let hints: &dyn hinted::HintSource = &*self.hints;
        victims(
            policy,
            &policy.current(),
            cands,
            &Round {
                need,
                now_ms: self.now_ms(),
                cap: self.cfg.max_removals_per_interval,
                tiered,
                hints,
            },
        )
    }
}

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
    victims
}

/// Adds least recently used candidates not already chosen until `victims` cover `need`
/// bytes (or `cap` victims); they lose their memory copy.
fn top_up(
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

/// The excess and the pool's bytes of the next pool-wide round another member calls;
/// never, without a fleet.
async fn next_round(
    rounds: &mut Option<tokio::sync::watch::Receiver<Option<crate::fleet::Round>>>,
) -> crate::fleet::Round {
    let Some(rx) = rounds else {
        return std::future::pending().await;
    };
    loop {
        if rx.changed().await.is_err() {
            return std::future::pending().await;
        }
        if let Some(r) = rx.borrow_and_update().as_ref() {
            return r.clone();
        }
    }
}

/// Each arm's usage from the table's bytes per arm, scaled down when the table holds
/// more than the master says is allocated: the master evicts keys on its own and the
/// table learns of it only when a lookup misses them, so without the scaling an arm
/// looks fuller than it is and its rounds start early.
fn arm_usage(table_bytes: &[u64], allocated: u64) -> Vec<u64> {
    let total: u128 = table_bytes.iter().map(|&b| u128::from(b)).sum();
    if total <= u128::from(allocated) || total == 0 {
        return table_bytes.to_vec();
    }
    table_bytes
        .iter()
        .map(|&b| (u128::from(b) * u128::from(allocated) / total) as u64)
        .collect()
}

/// Whether the experiment in force holds each arm to a share of the capacity.
fn by_weight(set: &ActiveSet) -> bool {
    set.arms.len() >= 2
        && set
            .experiment
            .as_ref()
            .is_some_and(|e| e.capacity == crate::policy::experiment::ArmCapacity::ByWeight)
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

    #[test]
    fn a_rounds_delay_counts_only_when_the_clocks_agree() {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        let d = since(now - 50);
        assert!((50..5_000).contains(&d), "{d}");
        assert_eq!(since(now + 60_000), 0, "from the future");
        assert_eq!(since(now - 60_000), 0, "a minute: clocks apart");
        assert_eq!(since(0), 0);
    }

    #[test]
    fn the_leaders_cut_is_the_age_of_its_newest_victim_when_it_takes_enough_keys() {
        // 100 keys of 10 bytes, oldest first: key i last used at i ms.
        let cands: Vec<(Bytes, Entry)> = (0..100)
            .map(|i| {
                let mut e = Entry {
                    tenant: Bytes::new(),
                    size: 10,
                    tier: Tier::Memory,
                    last_ms: 0,
                    hits: 0,
                    leased_until_ms: 0,
                    arm: 0,
                    complete: true,
                    on_disk: false,
                    client: Default::default(),
                    segment: NO_SEGMENT,
                    tries: 0,
                };
                e.last_ms = i;
                (Bytes::new(), e)
            })
            .collect();
        assert_eq!(
            cut_age(&cands, 700, 1_000),
            1_000 - 69,
            "70 keys: the 70th's age"
        );
        assert_eq!(cut_age(&cands, 100, 1_000), 0, "10 keys: too few to cut at");
        assert_eq!(cut_age(&cands, 5_000, 1_000), 0, "not covered: no cut");
    }

    #[test]
    fn lru_takes_oldest_until_covered() {
        assert_eq!(lru(&[10, 10, 10], 15), [0, 1]);
        assert_eq!(lru(&[10, 10], 0), Vec::<usize>::new());
        assert_eq!(lru(&[10], 100), [0]);
    }

    #[test]
    fn arm_usage_is_scaled_to_what_the_master_holds() {
        assert_eq!(arm_usage(&[60, 40], 200), [60, 40], "the table is not over");
        assert_eq!(arm_usage(&[60, 40], 50), [30, 20], "stale keys: scaled");
        assert_eq!(arm_usage(&[0, 0], 0), [0, 0]);
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

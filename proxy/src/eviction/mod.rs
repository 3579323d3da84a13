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
mod removal;
pub mod usage;
mod victims;

use victims::top_up;
pub use victims::{Round, victims};

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
    /// The master pages read for usage, in order (an HA pair's each).
    usage_urls: Vec<HttpUrl>,
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
            usage_urls: cfg.metrics_urls().filter_map(HttpUrl::parse).collect(),
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
                self.heard_round(&round, &mut conn, &policy, &upstream)
                    .await;
                continue;
            }
            let (usage_need, capacity) = self.read_usage(&mut usage_failing).await;
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

    /// A pool-wide round another member (the leader) called: this member's portion of
    /// its excess, now, as every other member frees its own; then word that it did.
    async fn heard_round(
        &self,
        round: &crate::fleet::Round,
        conn: &mut Option<(String, Conn)>,
        policy: &Registry,
        upstream: &crate::upstream::Upstream,
    ) {
        let Some(f) = self.fleet.as_deref() else {
            return;
        };
        let (excess, pool) = (round.excess, round.allocated);
        if !by_weight(&policy.current()) {
            let mine = self.keys.table.arm_bytes().iter().sum();
            let need = self.whole_keys(f.portion(mine, excess, pool), mine);
            tracing::debug!(excess, mine, portion = need, "fleet: the leader's round");
            let cut = (round.age_ms > 0).then(|| round.age_ms + since(round.at_ms));
            self.pool_round(conn, None, need, cut, Trigger::Usage, policy, upstream)
                .await;
        }
        f.round_freed(round);
    }

    /// The master's memory usage: the bytes over the low watermark once usage crossed
    /// the high one (0 otherwise), and (capacity, allocated) when the page says. A page
    /// that cannot be read pauses the usage trigger (logged once, counted).
    async fn read_usage(&self, failing: &mut bool) -> (u64, Option<(u64, u64)>) {
        if self.usage_urls.is_empty() {
            return (0, None);
        }
        // The first page with a capacity (a leader's); else the last that answered.
        let mut read = None;
        for url in &self.usage_urls {
            match usage::master_usage(url, self.call_timeout()).await {
                Ok(u) if u.capacity_bytes > 0 => {
                    read = Some(Ok(u));
                    break;
                }
                Ok(u) => read = Some(Ok(u)),
                Err(e) => {
                    if read.is_none() {
                        read = Some(Err(e));
                    }
                }
            }
        }
        let Some(read) = read else {
            return (0, None);
        };
        let u = match read {
            Ok(u) => u,
            Err(e) => {
                self.metrics.error(Stage::Usage);
                if !*failing {
                    tracing::warn!(error = %e, url = %self.cfg.master_metrics_url,
                        "cannot read the master's memory usage; usage trigger paused");
                    *failing = true;
                }
                return (0, None);
            }
        };
        if *failing {
            tracing::info!("master metrics readable again");
            *failing = false;
        }
        if let Some(b) = u.ssd_bytes {
            self.metrics.ssd_bytes.set(b as i64);
        }
        if u.capacity_bytes == 0 {
            return (0, None);
        }
        let ratio = u.allocated_bytes as f64 / u.capacity_bytes as f64;
        self.metrics.usage_ppm.set((ratio * 1e6) as i64);
        let need = if ratio >= self.cfg.high_watermark {
            let target = (self.cfg.low_watermark * u.capacity_bytes as f64) as u64;
            u.allocated_bytes.saturating_sub(target)
        } else {
            0
        };
        (need, Some((u.capacity_bytes, u.allocated_bytes)))
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
        // Keys the own segment knows may be among the victims: views ask the master
        // again rather than answer a key this round removed.
        upstream.removal_seen();
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
                    removing: false,
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
    fn arm_usage_is_scaled_to_what_the_master_holds() {
        assert_eq!(arm_usage(&[60, 40], 200), [60, 40], "the table is not over");
        assert_eq!(arm_usage(&[60, 40], 50), [30, 20], "stale keys: scaled");
        assert_eq!(arm_usage(&[0, 0], 0), [0, 0]);
    }
}

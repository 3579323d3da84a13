//! The fleet: the moongates in front of one Mooncake pool (one per inference rank) know
//! each other, so that what each decides alone adds up to what the pool needs.
//!
//! Each member holds a lease-backed key `/moongate/fleet/CLUSTER/members/MEMBER` in
//! etcd whose value is its [`Record`] (JSON): its key table's bytes and keys, per arm,
//! and its lookups and hits per arm. It watches the prefix, so it holds every other
//! member's last record ([`View`]); a member that dies disappears with its lease.
//!
//! What the view is for:
//! - **Eviction frees the excess once, from the right keys.** One member leads: the
//!   first by name ([`View::leader`]). Only it decides when the pool is over the high
//!   watermark, and it calls a pool-wide round ([`Round`], written to etcd beside the
//!   records); every member frees its portion of that one excess as soon as the round
//!   reaches it: the excess times its bytes over the fleet's bytes ([`View::portion`]).
//!   Portions of the same excess taken at the same moment cut every member's
//!   least-recently-used keys at about the same age; members that each read the
//!   usage on their own clock cut at ages up to a second apart (measured), leaving
//!   holes in prefixes that make their tails useless.
//! - **Shares hold pool-wide.** An arm's usage is what all members hold for it
//!   ([`View::arm_bytes`]); each member frees its portion of the arm's excess.
//! - **One answer per experiment.** `GET /fleet` adds up the arms' lookups and hits
//!   across members ([`View::arms`]).
//!
//! Nothing here knows sockets or the master: [`membership`] moves records through etcd,
//! the evictor asks the view for portions.

pub mod config;
pub mod forward;
pub mod hand_over;
pub mod membership;
pub mod metrics;
pub mod records;
pub mod send;

use std::collections::BTreeMap;
use std::sync::Arc;

use arc_swap::ArcSwap;
use serde::{Deserialize, Serialize};

pub use config::FleetConfig;

/// What one member publishes, every `interval_ms` when it changed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Record {
    /// The member's name (`fleet.member`).
    pub member: String,
    /// Its admin endpoint (`host:port`): for operators, and where the other members
    /// send it the access records of the keys it is home to.
    pub admin: String,
    /// It takes access records (`fleet.records`): it is on the ring of homes.
    pub records: bool,
    /// Keys and bytes in its key table: what it put and can evict.
    pub keys: u64,
    pub bytes: u64,
    /// Bytes its evictor removed or cleared since it started.
    pub evicted_bytes: u64,
    /// Pool-wide eviction rounds this member called as the fleet's leader, since it
    /// started.
    pub rounds_called: u64,
    /// The last pool-wide round this member freed its portion of: the leader that
    /// called it (`""`: none yet) and the round's `seq`. Published at once when a
    /// portion is freed: the leader calls its next round only when every member has
    /// freed its portion of the last (or after [`ROUND_WAIT_INTERVALS`] intervals), so
    /// no excess is freed twice however slowly rounds travel.
    pub round_done_by: String,
    pub round_done_seq: u64,
    /// The experiment's control arm on this member (the only arm without one).
    pub control: String,
    /// Per experiment arm (by name; every member runs the same arms).
    pub arms: Vec<ArmRecord>,
}

/// One arm's part of a member's record.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ArmRecord {
    pub name: String,
    /// Bytes of the keys this member put for the arm.
    pub bytes: u64,
    /// Keys the arm's existence checks found, and did not find, through this member.
    pub hits: u64,
    pub misses: u64,
}

/// A pool-wide eviction round the fleet's leader called: every member frees its portion
/// of `excess` when it hears of it. Written to etcd under the leader's lease
/// (`/moongate/fleet/CLUSTER/round`), so it goes with the leader.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Round {
    /// The leader that called it.
    pub by: String,
    /// Its count of rounds called (for operators and logs: each write of the round
    /// reaches a member's watch once, and a member frees once per delivery).
    pub seq: u64,
    /// Bytes the pool holds over the low watermark, as the leader read them.
    pub excess: u64,
    /// Bytes the pool held then (the master's `master_allocated_bytes`).
    pub allocated: u64,
    /// Where the leader's own least-recently-used keys are cut for its portion: the age
    /// (ms since the last access) of the newest key it frees; 0 when it frees none. The
    /// others free their keys older than this, within a quarter of their portion
    /// either way.
    pub age_ms: u64,
    /// When the leader cut (milliseconds since the Unix epoch): a member hearing of the
    /// round later adds the difference to `age_ms`, so both cut at the same instant of
    /// last access (a difference under 0 or over 10 s, clocks apart, is not added).
    pub at_ms: u64,
}

/// Every member's last record, this member's included (as last published).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct View {
    pub members: BTreeMap<String, Record>,
}

impl Record {
    /// A member's record as far as the policy knows it: each arm of `set` with its
    /// lookups and hits so far (the arms' own counters) and `arm_bytes` (by arm index;
    /// empty without a key table), and the control arm. The caller adds the rest.
    pub fn of_arms(set: &crate::policy::active::ActiveSet, arm_bytes: &[u64]) -> Record {
        Record {
            control: set
                .arms
                .get(set.control)
                .map(|a| a.name.clone())
                .unwrap_or_default(),
            bytes: arm_bytes.iter().sum(),
            arms: set
                .arms
                .iter()
                .enumerate()
                .map(|(i, a)| ArmRecord {
                    name: a.name.clone(),
                    bytes: arm_bytes.get(i).copied().unwrap_or(0),
                    hits: a.metrics.lookups[0].get(),
                    misses: a.metrics.lookups[1].get(),
                })
                .collect(),
            ..Default::default()
        }
    }
}

impl View {
    /// This member's portion of `need` bytes the whole fleet must free: `need` times
    /// `mine` (its bytes now) over the fleet's bytes, the larger of `pool` (the bytes
    /// the master holds, read with `need`) and the others' as last published plus
    /// `mine`. Records are up to an interval old: a member that wrote since looks
    /// smaller than it is, and members acting on one excess at once would each take
    /// too much (measured: two members freed 1.4 times the excess); the master's
    /// figure is current. The larger of the two errs towards freeing too little,
    /// which the next round makes up. All of `need` when it is alone or nobody holds
    /// bytes.
    pub fn portion(&self, me: &str, mine: u64, need: u64, pool: u64) -> u64 {
        let others: u64 = self
            .members
            .iter()
            .filter(|(m, _)| m.as_str() != me)
            .map(|(_, r)| r.bytes)
            .sum();
        if others == 0 {
            return share_of(need, mine, mine);
        }
        share_of(need, mine, mine.saturating_add(others).max(pool))
    }

    /// The member that calls pool-wide eviction rounds: the first by name. `me` leads
    /// too when no member before it is known (alone, or before its own record is seen).
    pub fn leads(&self, me: &str) -> bool {
        !self.members.keys().any(|m| m.as_str() < me)
    }

    /// Whether every other member has freed its portion of round `seq` that `me`
    /// called (a member that joined after it has not, and is waited for until the
    /// leader's bound).
    pub fn round_done(&self, me: &str, seq: u64) -> bool {
        self.members
            .iter()
            .filter(|(m, _)| m.as_str() != me)
            .all(|(_, r)| r.round_done_by == me && r.round_done_seq >= seq)
    }

    /// The fleet's bytes for arm `arm`: the others' as last published, plus `mine`.
    pub fn arm_bytes(&self, me: &str, arm: &str, mine: u64) -> u64 {
        self.members
            .iter()
            .filter(|(m, _)| m.as_str() != me)
            .flat_map(|(_, r)| r.arms.iter().filter(|a| a.name == arm))
            .map(|a| a.bytes)
            .fold(mine, u64::saturating_add)
    }

    /// Every arm's totals across members, in the order first seen.
    pub fn arms(&self) -> Vec<ArmRecord> {
        let mut out: Vec<ArmRecord> = Vec::new();
        for a in self.members.values().flat_map(|r| r.arms.iter()) {
            match out.iter_mut().find(|o| o.name == a.name) {
                Some(o) => {
                    o.bytes = o.bytes.saturating_add(a.bytes);
                    o.hits = o.hits.saturating_add(a.hits);
                    o.misses = o.misses.saturating_add(a.misses);
                }
                None => out.push(a.clone()),
            }
        }
        out
    }
}

/// Where the members of `cluster` keep their records in etcd.
pub fn members_prefix(cluster: &str) -> String {
    format!("/moongate/fleet/{cluster}/members/")
}

/// Everything of `cluster` in etcd: its members' records and its leader's round.
pub fn cluster_prefix(cluster: &str) -> String {
    format!("/moongate/fleet/{cluster}/")
}

/// Where `cluster`'s members say that a removal which can take leased values went to
/// the master through them: `PREFIX/MEMBER` = how many so far (under the member's
/// lease). Older members ignore these keys.
pub fn removals_prefix(cluster: &str) -> String {
    format!("/moongate/fleet/{cluster}/removals/")
}

/// Where `cluster`'s leader writes the pool-wide round it called last.
pub fn round_key(cluster: &str) -> String {
    format!("/moongate/fleet/{cluster}/round")
}

/// The fleet as `GET /fleet` and `moongate fleet status` show it: the members, the arms
/// added up across them with their hit rates, and each arm against `control` (the
/// control arm's name; by default the one the members name).
pub fn report(view: &View, control: Option<&str>) -> serde_json::Value {
    let arms = view.arms();
    let control = control.map(str::to_string).or_else(|| {
        view.members
            .values()
            .map(|r| r.control.clone())
            .find(|c| !c.is_empty())
    });
    let base = arms.iter().find(|a| Some(&a.name) == control.as_ref());
    let arms_json: Vec<_> = arms
        .iter()
        .map(|a| {
            let n = a.hits + a.misses;
            let vs = base
                .filter(|b| b.name != a.name)
                .and_then(|b| compare(b, a));
            serde_json::json!({
                "name": a.name,
                "bytes": a.bytes,
                "hits": a.hits,
                "misses": a.misses,
                "hit_rate": if n > 0 { Some(a.hits as f64 / n as f64) } else { None },
                "vs_control": vs,
            })
        })
        .collect();
    serde_json::json!({
        "members": view.members.values().collect::<Vec<_>>(),
        "control": control,
        "arms": arms_json,
    })
}

/// `need * part / whole`, all of `need` when `whole` is 0, never more than `need`.
pub fn share_of(need: u64, part: u64, whole: u64) -> u64 {
    if whole == 0 {
        return need;
    }
    (u128::from(need) * u128::from(part.min(whole)) / u128::from(whole)) as u64
}

/// A two-proportion comparison of hit rates (normal approximation, 95 %): `b` against
/// the control `a`. `None` while either side has no lookups.
pub fn compare(a: &ArmRecord, b: &ArmRecord) -> Option<Difference> {
    let (na, nb) = ((a.hits + a.misses) as f64, (b.hits + b.misses) as f64);
    if na == 0.0 || nb == 0.0 {
        return None;
    }
    let (pa, pb) = (a.hits as f64 / na, b.hits as f64 / nb);
    let se = (pa * (1.0 - pa) / na + pb * (1.0 - pb) / nb).sqrt();
    let diff = pb - pa;
    let half = 1.96 * se;
    Some(Difference {
        diff,
        low: diff - half,
        high: diff + half,
        significant: se > 0.0 && (diff - half > 0.0 || diff + half < 0.0),
    })
}

/// The difference of an arm's hit rate from the control's, with its 95 % interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Difference {
    pub diff: f64,
    pub low: f64,
    pub high: f64,
    /// The interval excludes 0.
    pub significant: bool,
}

/// This member's place in the fleet: its name, the key prefix, and the view its
/// membership task keeps.
pub struct Fleet {
    pub cfg: FleetConfig,
    /// This member's name.
    pub me: String,
    view: ArcSwap<View>,
    pub metrics: Arc<metrics::FleetMetrics>,
    /// Access records to and from the keys' homes (`fleet.records`).
    pub records: Option<Arc<forward::Forwarder>>,
    /// The last pool-wide round another member called, as etcd delivered it (to the
    /// evictor).
    heard: tokio::sync::watch::Sender<Option<Round>>,
    /// The last round this member called as leader (to the membership task, which
    /// writes it to etcd).
    called: tokio::sync::watch::Sender<Option<Round>>,
    /// The last round this member freed its portion of, (leader, seq): the membership
    /// task publishes it at once.
    done: tokio::sync::watch::Sender<(String, u64)>,
}

/// How long a leader waits, in eviction intervals, for every member to free its
/// portion of its last round before it calls the next one anyway (a member that never
/// answers, an older release that does not publish `round_done_*`): then an excess may
/// be freed twice, as without the wait.
pub const ROUND_WAIT_INTERVALS: u32 = 20;

impl Fleet {
    /// `token`: the admin token, which access records carry to the other members.
    pub fn new(cfg: FleetConfig, metrics: Arc<metrics::FleetMetrics>, token: String) -> Arc<Fleet> {
        let me = if cfg.member.is_empty() {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_string())
                .unwrap_or_default();
            let host = if host.is_empty() { "host".into() } else { host };
            format!("{host}-{}", std::process::id())
        } else {
            cfg.member.clone()
        };
        let records = cfg.records.then(|| {
            Arc::new(forward::Forwarder::new(
                &cfg,
                me.clone(),
                token,
                metrics.clone(),
            ))
        });
        Arc::new(Fleet {
            cfg,
            me,
            view: ArcSwap::from_pointee(View::default()),
            metrics,
            records,
            heard: tokio::sync::watch::Sender::new(None),
            called: tokio::sync::watch::Sender::new(None),
            done: tokio::sync::watch::Sender::new((String::new(), 0)),
        })
    }

    /// Whether this member calls the pool-wide rounds now (see [`View::leads`]).
    pub fn leads(&self) -> bool {
        self.view().leads(&self.me)
    }

    /// Calls a pool-wide round of `excess` bytes as the leader: the membership task
    /// writes it to etcd, where every member hears of it.
    pub fn call_round(&self, excess: u64, allocated: u64, age_ms: u64) {
        self.metrics.rounds[0].inc();
        self.metrics.round_excess_bytes.inc_by(excess);
        let seq = self.metrics.rounds[0].get();
        self.called.send_replace(Some(Round {
            by: self.me.clone(),
            seq,
            excess,
            allocated,
            age_ms,
            at_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
        }));
    }

    /// Pool-wide rounds called since start (this member's record).
    pub fn rounds_called(&self) -> u64 {
        self.metrics.rounds[0].get()
    }

    /// This member freed its portion of `r` (the evictor, after its removals).
    pub fn round_freed(&self, r: &Round) {
        self.done.send_replace((r.by.clone(), r.seq));
    }

    /// The last round this member freed its portion of (its record).
    pub fn round_done(&self) -> (String, u64) {
        self.done.borrow().clone()
    }

    /// What this member publishes of itself: keys and bytes per arm of its key table
    /// (when it keeps one), the bytes it evicted, the pool-wide rounds it called and the
    /// last one it freed its portion of.
    pub fn record_of(
        &self,
        set: &crate::policy::active::ActiveSet,
        keys: Option<&crate::keys::Keys>,
        evicted_bytes: u64,
    ) -> Record {
        let (round_done_by, round_done_seq) = self.round_done();
        let arm_bytes = keys.map(|k| k.table.arm_bytes()).unwrap_or_default();
        Record {
            keys: keys.map_or(0, |k| k.table.len() as u64),
            evicted_bytes,
            rounds_called: self.rounds_called(),
            round_done_by,
            round_done_seq,
            ..Record::of_arms(set, &arm_bytes)
        }
    }

    /// Rounds freed, as they happen, for the membership task to publish.
    fn rounds_done_rx(&self) -> tokio::sync::watch::Receiver<(String, u64)> {
        self.done.subscribe()
    }

    /// Whether every other member has freed its portion of the last round this member
    /// called (true before any).
    pub fn last_round_done(&self) -> bool {
        let seq = self.rounds_called();
        seq == 0 || self.view().round_done(&self.me, seq)
    }

    /// The rounds other members call, as they arrive.
    pub fn rounds_heard(&self) -> tokio::sync::watch::Receiver<Option<Round>> {
        self.heard.subscribe()
    }

    /// The rounds this member calls, for the membership task to write.
    fn rounds_called_rx(&self) -> tokio::sync::watch::Receiver<Option<Round>> {
        self.called.subscribe()
    }

    /// A round another member called reached this one.
    fn heard(&self, r: Round) {
        if r.by != self.me {
            self.metrics.rounds[1].inc();
            self.heard.send_replace(Some(r));
        }
    }

    /// Where the members' keys live.
    pub fn prefix(&self) -> String {
        members_prefix(&self.cfg.cluster)
    }

    /// The members as last seen.
    pub fn view(&self) -> Arc<View> {
        self.view.load_full()
    }

    fn set_view(&self, v: View) {
        self.metrics.members.set(v.members.len() as i64);
        if let Some(f) = &self.records {
            f.set_view(&v);
        }
        self.view.store(Arc::new(v));
    }

    /// This member's portion of `need` bytes the fleet must free (see [`View::portion`]).
    pub fn portion(&self, mine: u64, need: u64, pool: u64) -> u64 {
        self.view().portion(&self.me, mine, need, pool)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(m: &str, bytes: u64, arms: &[(&str, u64, u64, u64)]) -> (String, Record) {
        (
            m.into(),
            Record {
                member: m.into(),
                bytes,
                arms: arms
                    .iter()
                    .map(|&(n, b, h, mi)| ArmRecord {
                        name: n.into(),
                        bytes: b,
                        hits: h,
                        misses: mi,
                    })
                    .collect(),
                ..Default::default()
            },
        )
    }

    #[test]
    fn a_round_is_done_when_every_other_member_freed_its_portion() {
        let mut v = View {
            members: [rec("a", 0, &[]), rec("b", 0, &[]), rec("c", 0, &[])]
                .into_iter()
                .collect(),
        };
        assert!(!v.round_done("a", 1), "nobody has freed anything yet");
        for m in ["b", "c"] {
            let r = v.members.get_mut(m).unwrap();
            (r.round_done_by, r.round_done_seq) = ("a".into(), 1);
        }
        assert!(
            v.round_done("a", 1),
            "the leader's own record does not count"
        );
        assert!(!v.round_done("a", 2), "round 2 is not round 1");
        assert!(
            !v.round_done("b", 1),
            "another leader's round of that number"
        );
        v.members.get_mut("c").unwrap().round_done_seq = 3;
        v.members.get_mut("b").unwrap().round_done_seq = 2;
        assert!(
            v.round_done("a", 2),
            "a later round freed covers an earlier one"
        );
    }

    #[test]
    fn portions_of_the_excess_add_up_to_it_once() {
        let v = View {
            members: [rec("a", 100, &[]), rec("b", 300, &[]), rec("c", 600, &[])]
                .into_iter()
                .collect(),
        };
        let need = 1_000;
        let sum: u64 = [("a", 100), ("b", 300), ("c", 600)]
            .iter()
            .map(|&(m, b)| v.portion(m, b, need, 0))
            .sum();
        assert_eq!(sum, need);
        // Alone, or among members that hold nothing: all of it.
        assert_eq!(View::default().portion("a", 5, need, 1_000), need);
        assert_eq!(v.portion("z", 0, 0, 0), 0);
        // Never more than the need, even when this member's bytes moved on.
        assert!(v.portion("a", u64::MAX, need, 0) <= need);
        // The others wrote since their records: the master's figure is larger, and
        // the portions add up to less than the need rather than more.
        let sum: u64 = [("a", 200), ("b", 600), ("c", 1_200)]
            .iter()
            .map(|&(m, b)| v.portion(m, b, need, 2_000))
            .sum();
        assert_eq!(sum, need);
        assert_eq!(v.portion("a", 200, need, 1_000), 1_000 * 200 / 1_100);
    }

    #[test]
    fn arm_totals_and_their_difference() {
        let v = View {
            members: [
                rec("a", 0, &[("lru", 10, 40, 60), ("new", 5, 50, 50)]),
                rec("b", 0, &[("lru", 20, 40, 60), ("new", 7, 70, 30)]),
            ]
            .into_iter()
            .collect(),
        };
        assert_eq!(v.arm_bytes("a", "lru", 11), 31);
        let arms = v.arms();
        assert_eq!(arms.len(), 2);
        assert_eq!((arms[0].hits, arms[0].misses), (80, 120));
        assert_eq!((arms[1].hits, arms[1].misses), (120, 80));
        let d = compare(&arms[0], &arms[1]).unwrap();
        assert!((d.diff - 0.2).abs() < 1e-9, "{d:?}");
        assert!(d.significant && d.low > 0.0, "{d:?}");
        // A handful of lookups proves nothing.
        let few = ArmRecord {
            hits: 3,
            misses: 2,
            ..Default::default()
        };
        let other = ArmRecord {
            hits: 2,
            misses: 3,
            ..Default::default()
        };
        assert!(!compare(&few, &other).unwrap().significant);
        assert!(compare(&ArmRecord::default(), &few).is_none());
    }

    #[test]
    fn the_first_member_by_name_leads() {
        let v = View {
            members: [rec("b", 0, &[]), rec("c", 0, &[])].into_iter().collect(),
        };
        assert!(v.leads("b"));
        assert!(!v.leads("c"));
        assert!(v.leads("a"), "before its own record is seen");
        assert!(View::default().leads("z"), "alone");
    }
}

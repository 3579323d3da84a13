//! Hints: what the serving stack knows of the future, told to moongate. A router knows
//! which blocks its queued requests will read (`upcoming`), an application knows when a
//! session ended (`done`), an agent knows its next turn will come back when a tool
//! returns (`expect`). They reach the table here through `POST /v1/hints` (the kv face)
//! or `POST /hints` (the admin endpoint), or from a ZeroMQ publisher ([`subscriber`],
//! `hints.subscribe`), bounded in size, rate, entries and bytes.
//!
//! Hints never change correctness: nothing is stored, refused or answered differently
//! because of one; they are for the eviction policy to read.
//!
//! Rooms: [`parse`] (the body, pure), [`table`] (the bounded table, pure); this file
//! holds the section's config, its metrics and the handle the faces share, and maps
//! its errors to HTTP statuses in one place ([`HintError::status`]).

pub mod parse;
pub mod subscriber;
pub mod table;

use std::sync::Mutex;
use std::time::Instant;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use serde::Deserialize;

use crate::validate::positive;
pub use parse::ParseError;
pub use table::{Hint, Kind, Name, Table};

/// The `[hints]` section.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct HintsConfig {
    /// On by default: hints only inform eviction, and whoever can reach the kv face can
    /// already put and remove keys.
    pub enabled: bool,
    /// Hints kept at most (keys and blocks alike); a full table drops its oldest.
    pub max_entries: usize,
    /// Bytes the table may hold, each entry reckoned as its key's (or digest's) bytes
    /// plus a fixed overhead (`hints::table::ENTRY_OVERHEAD`, about 220 bytes); a full
    /// table drops its oldest. 48 MiB holds the default `max_entries` with keys of up to
    /// ~160 bytes, and bounds the table when keys are longer.
    pub max_bytes: usize,
    /// When an `upcoming` hint that names no `in_ms` is due: "soon" to a router is within
    /// its queue's wait, and a minute outlives that.
    pub ttl_ms: u64,
    /// An operator's cap on how long an `upcoming` or `expect` hint is kept past its due
    /// time; 0 (the default): none. Past its due time such a hint holds for one turnover
    /// of the cache (the median time the blocks of the last eviction round had gone
    /// unread, `moongate_hints_turnover_ms`), not a fixed time: a late read is worth the
    /// block's room for as long as the cache keeps any block unread, and that is seconds
    /// on one workload and many minutes on another (docs/policy-science.md).
    pub slack_cap_ms: u64,
    /// An operator's cap on how long a `done` hint is kept; 0 (the default): none. A
    /// block announced done stays done until it is read or stored again (the plugin sees
    /// its age fall below the hint's), however long the cache holds it: on a trace whose
    /// blocks stay cached for many minutes, a minute's lifetime threw most done hints
    /// away before their blocks reached the eviction end (docs/policy-science.md). The
    /// table stays bounded by `max_entries`, oldest out first.
    pub done_ttl_ms: u64,
    /// The furthest an `in_ms` or an `expect`'s `within_ms` may reach: an agent's tool
    /// call can take minutes.
    pub max_ttl_ms: u64,
    /// Keys and blocks named in one call.
    pub max_names_per_call: usize,
    /// Bytes of one call's body: a MiB holds 4,096 names of up to ~250 bytes.
    pub max_body_bytes: usize,
    /// Names accepted per second over all calls (a burst of one second's worth);
    /// beyond, a call is refused with 429 and nothing of it is kept.
    pub max_names_per_second: u64,
    /// ZeroMQ PUB endpoints (`tcp://HOST:PORT`) to take hints from, for routers that
    /// publish rather than POST: each message's last frame is one call's body. Empty (the
    /// default): no subscriber.
    pub subscribe: Vec<String>,
    /// The ZeroMQ topic prefix subscribed to: a router that publishes every rank's hints
    /// on one socket tags each message with the rank, and each rank's moongate takes its
    /// own. Empty (the default): every message.
    pub subscribe_topic: String,
}

impl Default for HintsConfig {
    fn default() -> Self {
        HintsConfig {
            enabled: true,
            max_entries: 131_072,
            max_bytes: 48 << 20,
            ttl_ms: 60_000,
            slack_cap_ms: 0,
            done_ttl_ms: 0,
            max_ttl_ms: 600_000,
            max_names_per_call: 4_096,
            max_body_bytes: 1 << 20,
            max_names_per_second: 100_000,
            subscribe: Vec::new(),
            subscribe_topic: String::new(),
        }
    }
}

impl HintsConfig {
    pub fn validate(&self, errs: &mut Vec<String>) {
        positive(errs, "hints.max_entries", self.max_entries as u64);
        // Below this a table could not hold one call's worth of long keys.
        if self.max_bytes < 64 << 10 {
            errs.push(format!(
                "hints.max_bytes = {}: below 64 KiB",
                self.max_bytes
            ));
        }
        positive(errs, "hints.ttl_ms", self.ttl_ms);
        positive(errs, "hints.max_ttl_ms", self.max_ttl_ms);
        positive(
            errs,
            "hints.max_names_per_call",
            self.max_names_per_call as u64,
        );
        positive(errs, "hints.max_body_bytes", self.max_body_bytes as u64);
        positive(
            errs,
            "hints.max_names_per_second",
            self.max_names_per_second,
        );
        if !self.enabled && !self.subscribe.is_empty() {
            errs.push("hints.subscribe is set but hints.enabled = false".to_string());
        }
        for (i, e) in self.subscribe.iter().enumerate() {
            // The ZeroMQ build carries the TCP transport only.
            let ok = e
                .strip_prefix("tcp://")
                .and_then(|hp| hp.rsplit_once(':'))
                .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
            if !ok {
                errs.push(format!(
                    "hints.subscribe[{i}] = {e:?}: expected tcp://HOST:PORT"
                ));
            }
        }
    }
}

/// Why a call's hints were not taken. Nothing of a refused call is kept.
#[derive(Debug, thiserror::Error)]
pub enum HintError {
    #[error("hints are off (hints.enabled = false)")]
    Off,
    #[error("body over {max} bytes (hints.max_body_bytes)")]
    BodyTooLarge { max: usize },
    #[error(transparent)]
    Parse(#[from] ParseError),
    #[error("{names} names would pass hints.max_names_per_second ({per_second}); retry later")]
    Rate { names: usize, per_second: u64 },
}

impl HintError {
    /// The one mapping of hint errors to HTTP statuses, for both endpoints.
    pub fn status(&self) -> u16 {
        match self {
            HintError::Off => 404,
            HintError::BodyTooLarge { .. } | HintError::Parse(ParseError::TooMany { .. }) => 413,
            HintError::Parse(ParseError::Invalid { .. }) => 400,
            HintError::Rate { .. } => 429,
        }
    }

    /// The `reason` label of `moongate_hints_refused_total`.
    fn reason(&self) -> usize {
        match self {
            HintError::Off => 0,
            HintError::Parse(ParseError::Invalid { .. }) => 1,
            HintError::BodyTooLarge { .. } | HintError::Parse(ParseError::TooMany { .. }) => 2,
            HintError::Rate { .. } => 3,
        }
    }
}

/// `moongate_hints_refused_total` reasons, in index order.
pub const REFUSED: [&str; 4] = ["off", "invalid", "too_large", "rate"];

/// The section's metric handles.
pub struct HintsMetrics {
    /// Names taken, by [`Kind::ALL`] index.
    pub received: [Counter; 3],
    /// Calls refused, by [`REFUSED`] index.
    pub refused: [Counter; 4],
    /// Live entries pushed out by a full table (count or bytes).
    pub dropped: Counter,
    /// Bytes the table's entries are reckoned to hold.
    pub bytes: Gauge,
    /// The cache's turnover the table reads `upcoming` / `expect` hints by (ms; 0:
    /// none known yet).
    pub turnover_ms: Gauge,
    /// Eviction candidates a plugin was given with a hint, by [`Kind::ALL`] index.
    pub matched: [Counter; 3],
    /// Entries in the table now.
    pub entries: Gauge,
    /// `hints.subscribe` publishers connected now.
    pub publishers: Gauge,
}

impl HintsMetrics {
    pub fn register(registry: &mut prometheus_client::registry::Registry) -> HintsMetrics {
        use prometheus_client::metrics::family::Family;
        let received = Family::<[(&'static str, &'static str); 1], Counter>::default();
        let refused = Family::<[(&'static str, &'static str); 1], Counter>::default();
        let matched = Family::<[(&'static str, &'static str); 1], Counter>::default();
        registry.register(
            "moongate_hints_received",
            "Keys and blocks named by accepted hints, by kind",
            received.clone(),
        );
        registry.register(
            "moongate_hints_refused",
            "Hint calls refused (nothing of them kept), by reason",
            refused.clone(),
        );
        let m = HintsMetrics {
            received: Kind::ALL.map(|k| received.get_or_create(&[("kind", k.name())]).clone()),
            refused: REFUSED.map(|r| refused.get_or_create(&[("reason", r)]).clone()),
            matched: Kind::ALL.map(|k| matched.get_or_create(&[("kind", k.name())]).clone()),
            dropped: Counter::default(),
            bytes: Gauge::default(),
            turnover_ms: Gauge::default(),
            entries: Gauge::default(),
            publishers: Gauge::default(),
        };
        registry.register(
            "moongate_hints_matched",
            "Eviction candidates a plugin was given with a hint, by kind",
            matched,
        );
        registry.register(
            "moongate_hints_dropped",
            "Live hints pushed out because the table was full (hints.max_entries, hints.max_bytes)",
            m.dropped.clone(),
        );
        registry.register(
            "moongate_hints_bytes",
            "Bytes the hint table's entries are reckoned to hold (hints.max_bytes)",
            m.bytes.clone(),
        );
        registry.register(
            "moongate_hints_turnover_ms",
            "The cache's turnover upcoming and expect hints hold past their due time by: the median time the last eviction round's victims had gone unread (0: none yet)",
            m.turnover_ms.clone(),
        );
        registry.register(
            "moongate_hints_entries",
            "Hints in the table now",
            m.entries.clone(),
        );
        registry.register(
            "moongate_hints_publishers",
            "hints.subscribe publishers connected now",
            m.publishers.clone(),
        );
        m
    }
}

/// Accepted names per second: a token bucket holding one second's worth.
#[derive(Debug)]
struct Rate {
    per_second: u64,
    tokens: f64,
    at: Instant,
}

impl Rate {
    fn take(&mut self, n: usize, now: Instant) -> bool {
        let cap = self.per_second as f64;
        let refill = now.saturating_duration_since(self.at).as_secs_f64() * cap;
        self.tokens = (self.tokens + refill).min(cap);
        self.at = now;
        if (n as f64) > self.tokens {
            return false;
        }
        self.tokens -= n as f64;
        true
    }
}

/// The hint table and its limits, shared by the kv face, the admin endpoint and the
/// evictor. Its lock is held for one call's inserts or one read, never across I/O.
pub struct Hints {
    cfg: HintsConfig,
    max_key_bytes: usize,
    table: Mutex<Table>,
    rate: Mutex<Rate>,
    metrics: std::sync::Arc<HintsMetrics>,
    /// The table's clock: ms since this handle was made.
    epoch: Instant,
    /// The cache's turnover in ms (0: none known), from the evictor's rounds.
    turnover_ms: std::sync::atomic::AtomicU64,
}

/// What an accepted call did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Accepted {
    /// Names taken.
    pub accepted: usize,
    /// Entries in the table after it.
    pub entries: usize,
}

impl Hints {
    pub fn new(
        cfg: HintsConfig,
        max_key_bytes: usize,
        metrics: std::sync::Arc<HintsMetrics>,
    ) -> Hints {
        Hints {
            table: Mutex::new(Table::new(cfg.max_entries, cfg.max_bytes)),
            rate: Mutex::new(Rate {
                per_second: cfg.max_names_per_second,
                tokens: cfg.max_names_per_second as f64,
                at: Instant::now(),
            }),
            cfg,
            max_key_bytes,
            metrics,
            epoch: Instant::now(),
            turnover_ms: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// An eviction round took blocks that had gone unread this long (the median of its
    /// victims, ms): the cache's turnover now, which `upcoming` and `expect` hints hold
    /// past their due time by.
    pub fn turnover(&self, age_ms: u64) {
        // 0 means "none known": a round of blocks read this very ms is 1.
        let t = age_ms.max(1);
        self.turnover_ms
            .store(t, std::sync::atomic::Ordering::Relaxed);
        self.metrics.turnover_ms.set(t as i64);
    }

    /// The turnover hints are read by: none known, or capped by `hints.slack_cap_ms`.
    fn slack_ms(&self) -> Option<u64> {
        let t = self.turnover_ms.load(std::sync::atomic::Ordering::Relaxed);
        let cap = (self.cfg.slack_cap_ms > 0).then_some(self.cfg.slack_cap_ms);
        match (t, cap) {
            (0, cap) => cap,
            (t, Some(c)) => Some(t.min(c)),
            (t, None) => Some(t),
        }
    }

    /// The most body bytes a call may send (`hints.max_body_bytes`).
    pub fn max_body_bytes(&self) -> usize {
        self.cfg.max_body_bytes
    }

    /// The table's clock now (ms).
    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Counts a call whose body could not be read within `hints.max_body_bytes` (the
    /// face read it; nothing reached [`Hints::post`]).
    pub fn refused_body(&self) {
        self.metrics.refused[2].inc();
    }

    /// Takes one call's body: every hint in it, or none (the error says why).
    pub fn post(&self, body: &[u8]) -> Result<Accepted, HintError> {
        let r = self.take(body);
        if let Err(e) = &r {
            self.metrics.refused[e.reason()].inc();
        }
        r
    }

    fn take(&self, body: &[u8]) -> Result<Accepted, HintError> {
        if !self.cfg.enabled {
            return Err(HintError::Off);
        }
        if body.len() > self.cfg.max_body_bytes {
            return Err(HintError::BodyTooLarge {
                max: self.cfg.max_body_bytes,
            });
        }
        let now = self.now_ms();
        let rules = parse::Rules {
            max_names: self.cfg.max_names_per_call,
            max_key_bytes: self.max_key_bytes,
            ttl_ms: self.cfg.ttl_ms,
            slack_cap_ms: (self.cfg.slack_cap_ms > 0).then_some(self.cfg.slack_cap_ms),
            done_ttl_ms: (self.cfg.done_ttl_ms > 0).then_some(self.cfg.done_ttl_ms),
            max_ttl_ms: self.cfg.max_ttl_ms,
        };
        let hints = parse::parse(body, &rules, now)?;
        let taken = self
            .rate
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take(hints.len(), Instant::now());
        if !taken {
            return Err(HintError::Rate {
                names: hints.len(),
                per_second: self.cfg.max_names_per_second,
            });
        }
        let accepted = hints.len();
        let mut by_kind = [0u64; 3];
        let mut dropped = 0;
        let (entries, bytes) = {
            let mut t = self.table.lock().unwrap_or_else(|p| p.into_inner());
            for (name, hint) in hints {
                by_kind[hint.kind as usize] += 1;
                dropped += t.insert(name, hint, now).dropped;
            }
            (t.len(), t.bytes())
        };
        for (c, n) in self.metrics.received.iter().zip(by_kind) {
            if n > 0 {
                c.inc_by(n);
            }
        }
        if dropped > 0 {
            self.metrics.dropped.inc_by(dropped);
        }
        self.metrics.entries.set(entries as i64);
        self.metrics.bytes.set(bytes as i64);
        Ok(Accepted { accepted, entries })
    }

    /// The live hint of each name, in order (`None`: nothing known), read at one time
    /// under one lock (an eviction round asks for its candidates at once), and that time
    /// on the table's clock.
    pub fn lookup<'a>(&self, names: impl Iterator<Item = &'a Name>) -> (u64, Vec<Option<Hint>>) {
        let now = self.now_ms();
        (now, self.lookup_at(names, now))
    }

    /// [`Hints::lookup`] at a given time on the table's clock.
    pub fn lookup_at<'a>(
        &self,
        names: impl Iterator<Item = &'a Name>,
        now_ms: u64,
    ) -> Vec<Option<Hint>> {
        let slack = self.slack_ms();
        let t = self.table.lock().unwrap_or_else(|p| p.into_inner());
        names.map(|n| t.get(n, now_ms, slack)).collect()
    }

    /// Counts the hints an eviction round gave a plugin.
    pub fn matched(&self, kinds: impl Iterator<Item = Kind>) {
        let mut by_kind = [0u64; 3];
        for k in kinds {
            by_kind[k as usize] += 1;
        }
        for (c, n) in self.metrics.matched.iter().zip(by_kind) {
            if n > 0 {
                c.inc_by(n);
            }
        }
    }

    /// Entries in the table (expired ones not yet swept included).
    pub fn len(&self) -> usize {
        self.table.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hints(cfg: HintsConfig) -> Hints {
        let mut r = prometheus_client::registry::Registry::default();
        Hints::new(cfg, 64, std::sync::Arc::new(HintsMetrics::register(&mut r)))
    }

    fn key(k: &str) -> Name {
        Name::Key {
            tenant: bytes::Bytes::from_static(b"default"),
            key: bytes::Bytes::copy_from_slice(k.as_bytes()),
        }
    }

    #[test]
    fn a_call_is_taken_whole_or_not_at_all() {
        let h = hints(HintsConfig::default());
        let ok = br#"{"hints": [{"kind": "upcoming", "keys": ["a", "b"]}, {"kind": "done", "blocks": [9]}]}"#;
        assert_eq!(
            h.post(ok).unwrap(),
            Accepted {
                accepted: 3,
                entries: 3
            }
        );
        let bad =
            br#"{"hints": [{"kind": "done", "keys": ["c"]}, {"kind": "later", "keys": ["d"]}]}"#;
        let e = h.post(bad).unwrap_err();
        assert_eq!(e.status(), 400);
        assert!(e.to_string().starts_with("hints[1].kind:"), "{e}");
        let (_, got) = h.lookup([key("a"), key("c"), Name::Block(9)].iter());
        assert_eq!(got[0].as_ref().map(|h| h.kind), Some(Kind::Upcoming));
        assert!(got[1].is_none(), "nothing of a refused call is kept");
        assert_eq!(got[2].as_ref().map(|h| h.kind), Some(Kind::Done));
        assert_eq!(h.metrics.received[0].get(), 2);
        assert_eq!(h.metrics.refused[1].get(), 1);
    }

    #[test]
    fn limits_answer_413_and_429_and_off_answers_404() {
        let h = hints(HintsConfig {
            max_body_bytes: 64,
            ..HintsConfig::default()
        });
        assert_eq!(h.post(&[b' '; 65]).unwrap_err().status(), 413);
        let h = hints(HintsConfig {
            max_names_per_call: 1,
            ..HintsConfig::default()
        });
        let two = br#"{"hints": [{"kind": "done", "keys": ["a", "b"]}]}"#;
        assert_eq!(h.post(two).unwrap_err().status(), 413);
        let h = hints(HintsConfig {
            max_names_per_second: 3,
            ..HintsConfig::default()
        });
        assert!(h.post(two).is_ok());
        let e = h.post(two).unwrap_err();
        assert_eq!(e.status(), 429, "{e}");
        let h = hints(HintsConfig {
            enabled: false,
            ..HintsConfig::default()
        });
        assert_eq!(h.post(two).unwrap_err().status(), 404);
    }

    /// The live rules as configured by default: a done hint holds however late it is
    /// read; an upcoming one until due and then one turnover of the cache, which the
    /// evictor reports; the operators' caps cut both.
    #[test]
    fn live_hints_hold_by_what_they_say_and_the_caps_cut_them() {
        let body = br#"{"hints": [{"kind": "done", "keys": ["d"]},
            {"kind": "upcoming", "keys": ["u"], "in_ms": 100},
            {"kind": "expect", "keys": ["e"], "within_ms": 100}]}"#;
        let names = [key("d"), key("u"), key("e")];
        let kinds = |h: &Hints, at: u64| -> Vec<Option<Kind>> {
            h.lookup_at(names.iter(), at)
                .into_iter()
                .map(|h| h.map(|h| h.kind))
                .collect()
        };
        let all = vec![Some(Kind::Done), Some(Kind::Upcoming), Some(Kind::Expect)];
        let h = hints(HintsConfig::default());
        h.post(body).unwrap();
        let posted = h.now_ms();
        // An hour later, nothing evicted yet: all three in force.
        assert_eq!(kinds(&h, posted + 3_600_000), all);
        // The cache turns over in 10 s: the upcoming and expect hints hold 10 s past due.
        h.turnover(10_000);
        assert_eq!(h.metrics.turnover_ms.get(), 10_000);
        assert_eq!(kinds(&h, posted + 9_000), all);
        assert_eq!(
            kinds(&h, posted + 200 + 10_000),
            vec![Some(Kind::Done), None, None]
        );
        // A done hint an hour old still holds, whatever the turnover.
        assert_eq!(kinds(&h, posted + 3_600_000)[0], Some(Kind::Done));
        // The operators' caps.
        let h = hints(HintsConfig {
            done_ttl_ms: 10_000,
            slack_cap_ms: 5_000,
            ..HintsConfig::default()
        });
        h.post(body).unwrap();
        let posted = h.now_ms();
        // No turnover known: the cap alone (5 s past due).
        assert_eq!(kinds(&h, posted + 4_000), all);
        assert_eq!(
            kinds(&h, posted + 5_200),
            vec![Some(Kind::Done), None, None]
        );
        assert_eq!(kinds(&h, posted + 10_100), vec![None, None, None]);
        // A turnover longer than the cap: the cap.
        h.turnover(60_000);
        assert_eq!(
            kinds(&h, posted + 5_200),
            vec![Some(Kind::Done), None, None]
        );
    }

    #[test]
    fn the_table_is_bounded_by_bytes_and_counts_what_it_drops() {
        let h = hints(HintsConfig {
            max_bytes: 64 << 10,
            ..HintsConfig::default()
        });
        // 4,096 blocks per call: far over 64 KiB of entries.
        let blocks: Vec<String> = (0..4096).map(|i| i.to_string()).collect();
        let body = format!(
            r#"{{"hints": [{{"kind": "done", "blocks": [{}]}}]}}"#,
            blocks.join(",")
        );
        let got = h.post(body.as_bytes()).unwrap();
        assert!(got.entries < 4096, "{got:?}");
        let held = h.metrics.bytes.get() as usize;
        assert!(held <= 64 << 10 && held > 0, "{held}");
        assert_eq!(h.metrics.dropped.get(), 4096 - got.entries as u64);
        // The newest are kept.
        let (_, last) = h.lookup([Name::Block(4095), Name::Block(0)].iter());
        assert!(last[0].is_some() && last[1].is_none());
        let mut errs = Vec::new();
        HintsConfig {
            max_bytes: 1000,
            ..HintsConfig::default()
        }
        .validate(&mut errs);
        assert!(
            errs.iter().any(|e| e.contains("hints.max_bytes")),
            "{errs:?}"
        );
    }

    #[test]
    fn subscribe_endpoints_are_checked_at_start() {
        let check = |enabled: bool, subscribe: &[&str]| {
            let mut errs = Vec::new();
            HintsConfig {
                enabled,
                subscribe: subscribe.iter().map(|s| s.to_string()).collect(),
                ..HintsConfig::default()
            }
            .validate(&mut errs);
            errs
        };
        assert!(check(true, &["tcp://127.0.0.1:5590", "tcp://router:1"]).is_empty());
        let errs = check(true, &["tcp://r:1", "ipc:///tmp/x", "tcp://r", "tcp://:5"]);
        assert_eq!(errs.len(), 3, "{errs:?}");
        assert!(errs[0].starts_with("hints.subscribe[1]"), "{errs:?}");
        assert_eq!(check(false, &["tcp://r:1"]).len(), 1);
    }
}

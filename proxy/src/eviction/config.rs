//! The `[eviction]` section: moongate-driven eviction, off by default.

use serde::Deserialize;

use crate::validate::positive;

/// moongate-driven eviction: a table of the keys clients put through this moongate, and
/// removals of the victims the policy picks when a trigger fires.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EvictionConfig {
    /// Off by default: Mooncake evicts by itself at its own watermark.
    pub enabled: bool,
    /// The master's Prometheus endpoint (`--metrics_port`), read for segment usage
    /// (`master_allocated_bytes` / `master_total_capacity_bytes`). Empty: no usage
    /// trigger. Behind an HA pair, each master's page, comma-separated: the first that
    /// answers with a capacity is read, so the trigger follows a failover (one URL
    /// would name a dead master, or a standby with no segments, after it).
    pub master_metrics_url: String,
    /// Usage (allocated / capacity) at which a round starts.
    pub high_watermark: f64,
    /// A usage round removes enough bytes to bring usage down to this.
    pub low_watermark: f64,
    /// Also start a round when the master denied puts with NO_AVAILABLE_HANDLE (-200)
    /// since the last check; it frees the denied bytes.
    pub on_put_denials: bool,
    /// How often the triggers are checked.
    pub interval_ms: u64,
    /// Removals sent per interval, at most.
    pub max_removals_per_interval: usize,
    /// Keys the table remembers; beyond it the least recently used entries are forgotten
    /// (not removed from the store).
    pub max_keys: usize,
    /// Candidates (least recently used first) offered to the plugin per round.
    pub max_candidates: usize,
    /// The master's read lease (`--default_kv_lease_ttl`): a key a lookup found within
    /// this long cannot be removed, so it is no candidate.
    pub lease_ms: u64,
    /// Deadline of one round's removals on moongate's own master connection.
    pub call_timeout_ms: u64,
    /// Keys whose end (evicted, removed, refused) moongate remembers to explain lookup
    /// misses; the oldest are forgotten first. Measured (`cargo run --release --example
    /// key_memory`): 400 bytes per key of 100 bytes, so 100,000 keys are about 40 MB;
    /// once full, the room churn takes (~11 MB more at 100,000) is reserved at once.
    pub history_keys: usize,
}

impl EvictionConfig {
    /// The master pages `master_metrics_url` names, in order.
    pub fn metrics_urls(&self) -> impl Iterator<Item = &str> {
        self.master_metrics_url
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
    }
}

impl Default for EvictionConfig {
    fn default() -> Self {
        EvictionConfig {
            enabled: false,
            master_metrics_url: String::new(),
            high_watermark: 0.85,
            low_watermark: 0.75,
            on_put_denials: true,
            interval_ms: 1_000,
            max_removals_per_interval: 1_000,
            max_keys: 1_000_000,
            max_candidates: 4_096,
            lease_ms: 10_000,
            call_timeout_ms: 5_000,
            history_keys: 100_000,
        }
    }
}

impl EvictionConfig {
    /// Appends every problem of this section to `errs` (nothing while it is off).
    pub fn validate(&self, errs: &mut Vec<String>) {
        let ev = self;
        if !ev.enabled {
            return;
        }
        positive(errs, "eviction.interval_ms", ev.interval_ms);
        positive(
            errs,
            "eviction.max_removals_per_interval",
            ev.max_removals_per_interval as u64,
        );
        positive(errs, "eviction.max_keys", ev.max_keys as u64);
        positive(errs, "eviction.max_candidates", ev.max_candidates as u64);
        positive(errs, "eviction.call_timeout_ms", ev.call_timeout_ms);
        positive(errs, "eviction.history_keys", ev.history_keys as u64);
        if !(0.0 < ev.low_watermark
            && ev.low_watermark < ev.high_watermark
            && ev.high_watermark <= 1.0)
        {
            errs.push("eviction: need 0 < low_watermark < high_watermark <= 1".into());
        }
        for u in ev.metrics_urls() {
            if crate::upstream::HttpUrl::parse(u).is_none() {
                errs.push(format!(
                    "eviction.master_metrics_url: {u:?} is not http://HOST:PORT/PATH"
                ));
            }
        }
        if ev.master_metrics_url.is_empty() && !ev.on_put_denials {
            errs.push(
                "eviction: enabled without a trigger (set master_metrics_url or \
                 on_put_denials)"
                    .into(),
            );
        }
    }
}

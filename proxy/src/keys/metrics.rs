//! The key table's metrics: its size and why lookups missed (registered even when no
//! table is kept, so dashboards see 0).

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::history::{WHYS, Why};

/// Handles of the key table.
pub struct KeyMetrics {
    pub table_keys: Gauge,
    /// Keys whose last end the history remembers (at most `eviction.history_keys`).
    pub history_keys: Gauge,
    misses: Family<MissLabels, Counter>,
    miss_handles: std::sync::Mutex<std::collections::HashMap<String, [Counter; WHYS.len()]>>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct MissLabels {
    reason: Why,
    arm: String,
}

impl KeyMetrics {
    /// Lookup misses explained. The handles of an arm are made once, on its first miss
    /// (all reasons at once, so a dashboard shows zeros), then found by its name without
    /// allocating.
    pub fn missed(&self, reason: Why, arm: &str, n: u64) {
        let mut handles = self.miss_handles.lock().unwrap_or_else(|p| p.into_inner());
        if !handles.contains_key(arm) {
            let made = WHYS.map(|reason| {
                self.misses
                    .get_or_create(&MissLabels {
                        reason,
                        arm: arm.to_string(),
                    })
                    .clone()
            });
            handles.insert(arm.to_string(), made);
        }
        if let Some(h) = handles.get(arm) {
            h[reason as usize].inc_by(n);
        }
    }

    pub fn register(registry: &mut Registry) -> KeyMetrics {
        let table_keys = Gauge::default();
        registry.register(
            "moongate_eviction_table_keys",
            "Keys in moongate's eviction table",
            table_keys.clone(),
        );
        let history_keys = Gauge::default();
        registry.register(
            "moongate_key_history_keys",
            "Keys whose last end moongate's key history remembers (at most \
             eviction.history_keys)",
            history_keys.clone(),
        );
        let misses = Family::<MissLabels, Counter>::default();
        registry.register(
            "moongate_lookup_misses",
            "Lookup misses by why, as far as this moongate saw (never_stored, \
             evicted_by_moongate, removed_by_client, refused_by_policy, evicted_by_master, \
             lost_in_failover), \
             and the arm that served the lookup (eviction on: it keeps the key table)",
            misses.clone(),
        );
        KeyMetrics {
            table_keys,
            history_keys,
            misses,
            miss_handles: Default::default(),
        }
    }
}

//! The evictor's metrics (registered even when eviction is off, so dashboards see 0).

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// What started an eviction round, in label order.
pub const EVICTION_TRIGGERS: [&str; 3] = ["usage", "denials", "arm_share"];
/// What became of an eviction candidate moongate acted on, in label order.
pub const EVICTION_RESULTS: [&str; 6] = [
    "removed",
    "leased",
    "not_found",
    "error",
    "memory_cleared",
    "kept",
];
/// Where an eviction round failed, in label order.
pub const EVICTION_STAGES: [&str; 2] = ["usage", "remove"];

/// What started an eviction round (index into [`EVICTION_TRIGGERS`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// The master's memory usage crossed `eviction.high_watermark`.
    Usage,
    /// The master refused puts with NO_AVAILABLE_HANDLE.
    Denials,
    /// An experiment arm's keys crossed the high watermark of its share
    /// (`capacity = "by-weight"`).
    ArmShare,
}

/// What became of a victim (index into [`EVICTION_RESULTS`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Victim {
    Removed,
    /// A reader holds a lease: kept.
    Leased,
    /// Already gone: forgotten.
    NotFound,
    Error,
    /// Offload on: its memory replica was dropped; a copy on an owner's SSD stays.
    MemoryCleared,
    /// Offload on: the master cleared nothing (its memory replica already gone, a
    /// lease, or the key gone), or its segment is unknown to moongate: kept (tried
    /// again after a lease, forgotten after a few tries).
    Kept,
}

/// Where a round was cut short (index into [`EVICTION_STAGES`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    Usage,
    Remove,
}

/// Handles of the evictor (registered even when eviction is off, so dashboards see 0).
pub struct EvictionMetrics {
    rounds: [Counter; 3],
    keys: [Counter; 6],
    pub removed_bytes: Counter,
    errors: [Counter; 2],
    /// Master memory usage (allocated / capacity) in parts per million at the last read.
    pub usage_ppm: Gauge,
    /// Bytes on owners' SSDs, as the master counts them (pool-wide).
    pub ssd_bytes: Gauge,
    /// Rounds that ended (all their removals answered, or cut short): what "the round is
    /// over" means to a dashboard or a test.
    pub rounds_ended: Counter,
    arm_bytes: Family<ArmLabel, Gauge>,
    arm_share: Family<ArmLabel, Gauge>,
    arm_removed: Family<ArmLabel, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct ArmLabel {
    arm: String,
}

impl EvictionMetrics {
    pub fn round(&self, t: Trigger) {
        self.rounds[t as usize].inc();
    }

    pub fn victim(&self, v: Victim) {
        self.keys[v as usize].inc();
    }

    pub fn error(&self, s: Stage) {
        self.errors[s as usize].inc();
    }

    /// An experiment arm's bytes in the table, and its share (by-weight; 0 otherwise).
    /// Once per interval per arm: a label lookup is fine.
    pub fn arm_bytes(&self, arm: &str, bytes: u64, share: u64) {
        let l = ArmLabel { arm: arm.into() };
        self.arm_bytes.get_or_create(&l).set(bytes as i64);
        self.arm_share.get_or_create(&l).set(share as i64);
        // The arm's removals series exists from its first interval (at 0), so a
        // dashboard shows "nothing evicted" rather than "no data".
        let _ = self.arm_removed.get_or_create(&l);
    }

    /// Bytes removed from an arm's keys.
    pub fn arm_removed(&self, arm: &str, bytes: u64) {
        self.arm_removed
            .get_or_create(&ArmLabel { arm: arm.into() })
            .inc_by(bytes);
    }

    pub fn register(registry: &mut Registry) -> EvictionMetrics {
        fn family<const N: usize>(
            registry: &mut Registry,
            name: &str,
            help: &str,
            key: &'static str,
            values: [&'static str; N],
        ) -> [Counter; N] {
            // One label whose name varies by family: a one-pair label set.
            let f = Family::<[(&'static str, &'static str); 1], Counter>::default();
            registry.register(name, help, f.clone());
            values.map(|value| f.get_or_create(&[(key, value)]).clone())
        }
        let rounds = family(
            registry,
            "moongate_eviction_rounds",
            "Eviction rounds by trigger (usage: master memory over eviction.high_watermark; \
             denials: the master refused puts with NO_AVAILABLE_HANDLE; arm_share: an \
             experiment arm over the high watermark of its by-weight share)",
            "trigger",
            EVICTION_TRIGGERS,
        );
        let keys = family(
            registry,
            "moongate_eviction_keys",
            "Eviction victims by result (removed; leased: a reader holds a lease, kept; \
             not_found: already gone, forgotten; error; with an SSD tier: memory_cleared, \
             the memory replica dropped and the SSD copy kept, kept: nothing cleared)",
            "result",
            EVICTION_RESULTS,
        );
        let errors = family(
            registry,
            "moongate_eviction_errors",
            "Eviction rounds cut short, by stage (usage read, removals)",
            "stage",
            EVICTION_STAGES,
        );
        let removed_bytes = Counter::default();
        registry.register(
            "moongate_eviction_removed_bytes",
            "Bytes of keys moongate removed",
            removed_bytes.clone(),
        );
        let usage_ppm = Gauge::default();
        registry.register(
            "moongate_master_memory_usage_ppm",
            "Master memory allocated / capacity, parts per million, at the last read",
            usage_ppm.clone(),
        );
        let ssd_bytes = Gauge::default();
        registry.register(
            "moongate_master_ssd_allocated_bytes",
            "Bytes on owners' SSDs as the master counts them \
             (master_allocated_file_size_bytes, pool-wide), at the last read",
            ssd_bytes.clone(),
        );
        let rounds_ended = Counter::default();
        registry.register(
            "moongate_eviction_rounds_ended",
            "Eviction rounds that ended (removals answered, or cut short: see \
             moongate_eviction_errors_total)",
            rounds_ended.clone(),
        );
        let arm_bytes = Family::<ArmLabel, Gauge>::default();
        registry.register(
            "moongate_eviction_arm_bytes",
            "Bytes of the keys each experiment arm put, as the eviction table knows them",
            arm_bytes.clone(),
        );
        let arm_share = Family::<ArmLabel, Gauge>::default();
        registry.register(
            "moongate_eviction_arm_share_bytes",
            "Each arm's share of the master's capacity (experiment capacity = by-weight; 0 \
             in a shared pool)",
            arm_share.clone(),
        );
        let arm_removed = Family::<ArmLabel, Counter>::default();
        registry.register(
            "moongate_eviction_arm_removed_bytes",
            "Bytes moongate removed from each arm's keys",
            arm_removed.clone(),
        );
        EvictionMetrics {
            arm_bytes,
            arm_share,
            arm_removed,
            rounds_ended,
            rounds,
            keys,
            removed_bytes,
            errors,
            usage_ppm,
            ssd_bytes,
        }
    }
}

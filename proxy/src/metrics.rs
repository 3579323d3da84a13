//! Metric handles, registered once at start-up and indexed by method on the hot path
//! (no label lookups per request). Exposed by the admin endpoint in the OpenMetrics text
//! format; `docs/operations.md` lists every metric.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::codec::Method;
use crate::codec::method::METHOD_COUNT;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MethodLabel {
    method: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    method: String,
    kind: ErrorKind,
}

/// What went wrong with one call.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum ErrorKind {
    /// A transport-level error reply (`err_code != 0`); the client sees `RPC_FAIL`.
    rpc,
    /// An application error (`ErrorCode`) in the reply; batch calls count failed keys.
    app,
    /// A frame of a typed method that did not decode; it was relayed untouched.
    decode,
}

const ERROR_KINDS: [ErrorKind; 3] = [ErrorKind::rpc, ErrorKind::app, ErrorKind::decode];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: ConnOutcome,
}

/// How an accepted client connection went.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum ConnOutcome {
    /// Served with its own upstream connection.
    accepted,
    /// Closed at once: `master_face.max_connections` reached.
    rejected_limit,
    /// Closed at once: the upstream master could not be reached.
    upstream_failed,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FrameErrorLabels {
    side: Side,
    kind: FrameErrorKind,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Side {
    client,
    upstream,
}

/// Why a connection was closed for a bad frame.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum FrameErrorKind {
    bad_header,
    too_large,
    /// A response whose seq matched no forwarded request (relayed; the client decides).
    unmatched_seq,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabel {
    direction: Direction,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Direction {
    to_master,
    to_client,
}

/// Latency buckets (seconds): 25 us (a relayed metadata call's floor) to 10 s.
const LATENCY_BUCKETS: [f64; 17] = [
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 0.5,
    1.0, 2.5, 10.0,
];

/// Per-method handles: index = [`Method::index`], the last slot is "unknown".
pub struct MethodMetrics {
    pub requests: Counter,
    pub latency: Histogram,
    errors: [Counter; 3],
}

impl MethodMetrics {
    pub fn error(&self, kind: ErrorKind, n: u64) {
        if n > 0 {
            self.errors[kind as usize].inc_by(n);
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PluginMetricLabels {
    plugin: String,
    name: String,
}

/// Counters and gauges that plugins register during `configure`, exported as
/// `moongate_plugin_counter_total{plugin,name}` and `moongate_plugin_gauge{plugin,name}`.
pub struct PluginMetricsSink {
    counters: Family<PluginMetricLabels, Counter>,
    gauges: Family<PluginMetricLabels, Gauge>,
}

impl PluginMetricsSink {
    fn valid(name: &str) -> Result<(), String> {
        let ok = !name.is_empty()
            && name.len() <= 64
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
        if ok {
            Ok(())
        } else {
            Err(format!(
                "metric name {name:?}: use 1-64 characters of [a-z0-9_]"
            ))
        }
    }

    pub fn counter(&self, plugin: &str, name: &str, _help: &str) -> Result<Counter, String> {
        Self::valid(name)?;
        Ok(self
            .counters
            .get_or_create(&PluginMetricLabels {
                plugin: plugin.to_string(),
                name: name.to_string(),
            })
            .clone())
    }

    pub fn gauge(&self, plugin: &str, name: &str, _help: &str) -> Result<Gauge, String> {
        Self::valid(name)?;
        Ok(self
            .gauges
            .get_or_create(&PluginMetricLabels {
                plugin: plugin.to_string(),
                name: name.to_string(),
            })
            .clone())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PolicyCallLabels {
    plugin: String,
    version: String,
    arm: String,
    hook: String,
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PolicyLabels {
    plugin: String,
    version: String,
    arm: String,
    hook: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabels {
    plugin: String,
    version: String,
    arm: String,
    decision: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ArmMethodLabels {
    arm: String,
    method: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ArmErrorLabels {
    arm: String,
    method: String,
    kind: ErrorKind,
}

/// Hook call results, in label order.
pub const CALL_RESULTS: [&str; 6] = ["ok", "trap", "timeout", "oom", "invalid", "unavailable"];
/// Put decisions, in label order: unchanged, rewritten config, some keys denied, all denied.
pub const DECISIONS: [&str; 4] = ["unchanged", "rewrite", "deny_some", "deny_all"];

/// The metric handles of one experiment arm (or of the single active plugin), created
/// when the arm is activated.
pub struct ArmMetrics {
    /// by [`CALL_RESULTS`] index
    pub put_calls: [Counter; 6],
    pub put_latency: Histogram,
    /// `on-lookup` calls by [`CALL_RESULTS`] index, and their latency.
    pub lookup_calls: [Counter; 6],
    pub lookup_latency: Histogram,
    /// `split` calls by [`CALL_RESULTS`] index, and their latency.
    pub split_calls: [Counter; 6],
    pub split_latency: Histogram,
    /// `evict` calls by [`CALL_RESULTS`] index, and their latency.
    pub evict_calls: [Counter; 6],
    pub evict_latency: Histogram,
    /// by [`DECISIONS`] index
    pub decisions: [Counter; 4],
    /// Decoded requests served by this arm, by [`Method::index`].
    pub requests: Vec<MethodMetrics>,
    /// `[tier][outcome]` keys and bytes of lookup answers ([`crate::tiers`]).
    pub tier_keys: [[Counter; 3]; 4],
    pub tier_bytes: [[Counter; 3]; 4],
    /// `ExistKey` / `BatchExistKey` keys: `[hit, miss]`.
    pub lookups: [Counter; 2],
}

impl ArmMetrics {
    /// Adds one answer's tier tally.
    pub fn add_tally(&self, t: &crate::tiers::Tally) {
        for tier in 0..4 {
            for outcome in 0..3 {
                if t.keys[tier][outcome] > 0 {
                    self.tier_keys[tier][outcome].inc_by(t.keys[tier][outcome]);
                }
                if t.bytes[tier][outcome] > 0 {
                    self.tier_bytes[tier][outcome].inc_by(t.bytes[tier][outcome]);
                }
            }
        }
        if t.hits > 0 {
            self.lookups[0].inc_by(t.hits);
        }
        if t.misses > 0 {
            self.lookups[1].inc_by(t.misses);
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierLabels {
    tier: String,
    outcome: String,
    arm: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LookupLabels {
    result: String,
    arm: String,
}

/// What started an eviction round, in label order.
pub const EVICTION_TRIGGERS: [&str; 2] = ["usage", "denials"];
/// What became of an eviction candidate moongate acted on, in label order.
pub const EVICTION_RESULTS: [&str; 4] = ["removed", "leased", "not_found", "error"];
/// Where an eviction round failed, in label order.
pub const EVICTION_STAGES: [&str; 2] = ["usage", "remove"];

/// Handles of the evictor (registered even when eviction is off, so dashboards see 0).
pub struct EvictionMetrics {
    /// by [`EVICTION_TRIGGERS`] index
    pub rounds: [Counter; 2],
    /// by [`EVICTION_RESULTS`] index
    pub keys: [Counter; 4],
    pub removed_bytes: Counter,
    /// by [`EVICTION_STAGES`] index
    pub errors: [Counter; 2],
    pub table_keys: Gauge,
    /// Master memory usage (allocated / capacity) in parts per million at the last read.
    pub usage_ppm: Gauge,
}

impl EvictionMetrics {
    fn register(registry: &mut Registry) -> EvictionMetrics {
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
             denials: the master refused puts with NO_AVAILABLE_HANDLE)",
            "trigger",
            EVICTION_TRIGGERS,
        );
        let keys = family(
            registry,
            "moongate_eviction_keys",
            "Eviction victims by result (removed; leased: a reader holds a lease, kept; \
             not_found: already gone, forgotten; error)",
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
        let table_keys = Gauge::default();
        registry.register(
            "moongate_eviction_table_keys",
            "Keys in moongate's eviction table",
            table_keys.clone(),
        );
        let usage_ppm = Gauge::default();
        registry.register(
            "moongate_master_memory_usage_ppm",
            "Master memory allocated / capacity, parts per million, at the last read",
            usage_ppm.clone(),
        );
        EvictionMetrics {
            rounds,
            keys,
            removed_bytes,
            errors,
            table_keys,
            usage_ppm,
        }
    }
}

/// kv face operations, in label order.
pub const KV_OPS: [&str; 6] = ["get", "put", "delete", "exists", "batch_get", "batch_put"];
/// HTTP status classes, in label order.
pub const KV_STATUS: [&str; 3] = ["2xx", "4xx", "5xx"];
/// How kv bytes moved: TE-TCP to a peer segment, in place in moongate's own segment, or
/// QUIC to a peer moongate's segment.
pub const KV_TRANSPORTS: [&str; 4] = ["tcp", "local", "quic", "disk"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KvReqLabels {
    op: &'static str,
    status: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KvXferLabels {
    transport: &'static str,
    direction: &'static str,
}

/// Handles of the kv face.
pub struct KvMetrics {
    /// `[op][status class]`
    pub requests: [[Counter; 3]; 6],
    /// Parts batch gets and puts were cut into.
    pub batch_parts: Counter,
    /// Replica cache lookups of gets: `[hit, miss, stale]`.
    pub replica_cache: [Counter; 3],
    /// `[transport][read, write]`
    pub transfers: [[Counter; 2]; 4],
    pub transfer_bytes: [[Counter; 2]; 4],
    /// Requests refused with 503 because the in-flight byte budget stayed full.
    pub busy: Counter,
    pub inflight_bytes: Gauge,
    /// RDMA devices found at start (the data path falls back to TCP / QUIC regardless).
    pub rdma_devices: Gauge,
}

impl KvMetrics {
    fn register(registry: &mut Registry) -> KvMetrics {
        let req = Family::<KvReqLabels, Counter>::default();
        registry.register(
            "moongate_kv_requests",
            "kv face requests by op (get, put, delete, exists, batch_get, batch_put) and \
             status class",
            req.clone(),
        );
        let xfer = Family::<KvXferLabels, Counter>::default();
        registry.register(
            "moongate_kv_transfers",
            "Replica transfers of the kv face by transport (tcp: TE-TCP to a peer \
             segment; local: moongate's own segment; quic: a peer moongate's segment; \
             disk: a file of the master's disk tier) and direction",
            xfer.clone(),
        );
        let bytes = Family::<KvXferLabels, Counter>::default();
        registry.register(
            "moongate_kv_transfer_bytes",
            "Bytes moved by the kv face, by transport and direction",
            bytes.clone(),
        );
        let busy = Counter::default();
        registry.register(
            "moongate_kv_busy",
            "kv requests answered 503: the node's in-flight byte budget stayed full",
            busy.clone(),
        );
        let cache = Family::<ResultLabel, Counter>::default();
        registry.register(
            "moongate_kv_replica_cache",
            "kv GETs by replica cache result (kv.replica_cache_ms): hit = no master call, \
             miss = asked the master, stale = a cached replica was unreadable (asked again)",
            cache.clone(),
        );
        let batch_parts = Counter::default();
        registry.register(
            "moongate_kv_batch_parts",
            "Parts kv batch gets and puts were cut into under the byte budget",
            batch_parts.clone(),
        );
        let rdma_devices = Gauge::default();
        registry.register(
            "moongate_kv_rdma_devices",
            "RDMA devices found at start (feature rdma); the RDMA data path is not \
             implemented, transfers use tcp / quic",
            rdma_devices.clone(),
        );
        let inflight_bytes = Gauge::default();
        registry.register(
            "moongate_kv_inflight_bytes",
            "Value bytes of kv gets and puts in progress",
            inflight_bytes.clone(),
        );
        let x = |f: &Family<KvXferLabels, Counter>| {
            KV_TRANSPORTS.map(|transport| {
                ["read", "write"].map(|direction| {
                    f.get_or_create(&KvXferLabels {
                        transport,
                        direction,
                    })
                    .clone()
                })
            })
        };
        KvMetrics {
            requests: KV_OPS.map(|op| {
                KV_STATUS.map(|status| req.get_or_create(&KvReqLabels { op, status }).clone())
            }),
            transfers: x(&xfer),
            transfer_bytes: x(&bytes),
            batch_parts,
            replica_cache: ["hit", "miss", "stale"]
                .map(|result| cache.get_or_create(&ResultLabel { result }).clone()),
            busy,
            inflight_bytes,
            rdma_devices,
        }
    }

    /// Counts one transfer of `bytes` (`transport`: index into [`KV_TRANSPORTS`]).
    pub fn transfer(&self, transport: usize, write: bool, bytes: u64) {
        let d = usize::from(write);
        self.transfers[transport][d].inc();
        self.transfer_bytes[transport][d].inc_by(bytes);
    }
}

/// Handles for the policy layer's metric families.
pub struct PolicyFamilies {
    calls: Family<PolicyCallLabels, Counter>,
    latency: Family<PolicyLabels, Histogram>,
    decisions: Family<DecisionLabels, Counter>,
    arm_requests: Family<ArmMethodLabels, Counter>,
    arm_latency: Family<ArmMethodLabels, Histogram>,
    arm_errors: Family<ArmErrorLabels, Counter>,
    tier_keys: Family<TierLabels, Counter>,
    tier_bytes: Family<TierLabels, Counter>,
    lookups: Family<LookupLabels, Counter>,
    pub active_generation: Gauge,
    pub swaps: Counter,
    pub rollbacks: Counter,
    pub guardrail_stops: Counter,
}

/// Policy-call latency buckets (seconds): 0.5 us to 25 ms.
const POLICY_BUCKETS: [f64; 12] = [
    0.5e-6, 1e-6, 2e-6, 5e-6, 10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 1e-3, 5e-3, 25e-3,
];

impl PolicyFamilies {
    /// Creates the handles of one arm. Called on activation, never per request.
    pub fn arm(&self, plugin: &str, version: &str, arm: &str) -> ArmMetrics {
        let pl = |hook: &str, result: &str| PolicyCallLabels {
            plugin: plugin.into(),
            version: version.into(),
            arm: arm.into(),
            hook: hook.into(),
            result: result.into(),
        };
        let hist = |hook: &str| {
            self.latency
                .get_or_create(&PolicyLabels {
                    plugin: plugin.into(),
                    version: version.into(),
                    arm: arm.into(),
                    hook: hook.into(),
                })
                .clone()
        };
        ArmMetrics {
            put_calls: CALL_RESULTS.map(|r| self.calls.get_or_create(&pl("on-put", r)).clone()),
            put_latency: hist("on-put"),
            lookup_calls: CALL_RESULTS
                .map(|r| self.calls.get_or_create(&pl("on-lookup", r)).clone()),
            lookup_latency: hist("on-lookup"),
            split_calls: CALL_RESULTS.map(|r| self.calls.get_or_create(&pl("split", r)).clone()),
            split_latency: hist("split"),
            evict_calls: CALL_RESULTS.map(|r| self.calls.get_or_create(&pl("evict", r)).clone()),
            evict_latency: hist("evict"),
            decisions: DECISIONS.map(|d| {
                self.decisions
                    .get_or_create(&DecisionLabels {
                        plugin: plugin.into(),
                        version: version.into(),
                        arm: arm.into(),
                        decision: d.into(),
                    })
                    .clone()
            }),
            requests: Method::ALL
                .iter()
                .map(|m| {
                    let l = ArmMethodLabels {
                        arm: arm.into(),
                        method: m.name().into(),
                    };
                    MethodMetrics {
                        requests: self.arm_requests.get_or_create(&l).clone(),
                        latency: self.arm_latency.get_or_create(&l).clone(),
                        errors: ERROR_KINDS.map(|kind| {
                            self.arm_errors
                                .get_or_create(&ArmErrorLabels {
                                    arm: arm.into(),
                                    method: m.name().into(),
                                    kind,
                                })
                                .clone()
                        }),
                    }
                })
                .collect(),
            tier_keys: self.tier_family(&self.tier_keys, arm),
            tier_bytes: self.tier_family(&self.tier_bytes, arm),
            lookups: ["hit", "miss"].map(|result| {
                self.lookups
                    .get_or_create(&LookupLabels {
                        result: result.into(),
                        arm: arm.into(),
                    })
                    .clone()
            }),
        }
    }

    fn tier_family(&self, f: &Family<TierLabels, Counter>, arm: &str) -> [[Counter; 3]; 4] {
        crate::tiers::TIERS.map(|tier| {
            crate::tiers::OUTCOMES.map(|outcome| {
                f.get_or_create(&TierLabels {
                    tier: tier.into(),
                    outcome: outcome.into(),
                    arm: arm.into(),
                })
                .clone()
            })
        })
    }
}

/// Every metric moongate exports.
pub struct Metrics {
    pub registry: Registry,
    methods: Vec<MethodMetrics>,
    pub connections_open: Gauge,
    pub upstream_connections_open: Gauge,
    conn_outcomes: [Counter; 3],
    frame_errors: Family<FrameErrorLabels, Counter>,
    pub bytes_to_master: Counter,
    pub bytes_to_client: Counter,
    pub upstream_ready: Gauge,
    /// Per [`Method::index`]: `(batches split, parts sent)`.
    splits: Vec<(Counter, Counter)>,
    pub eviction: EvictionMetrics,
    pub kv: KvMetrics,
    pub plugins: std::sync::Arc<PluginMetricsSink>,
    pub policy: PolicyFamilies,
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let requests = Family::<MethodLabel, Counter>::default();
        let errors = Family::<ErrorLabels, Counter>::default();
        let latency = Family::<MethodLabel, Histogram>::new_with_constructor(|| {
            Histogram::new(LATENCY_BUCKETS)
        });
        let names = Method::ALL
            .iter()
            .map(|m| m.name())
            .chain(std::iter::once("unknown"));
        let methods = names
            .map(|name| {
                let l = MethodLabel {
                    method: name.to_string(),
                };
                MethodMetrics {
                    requests: requests.get_or_create(&l).clone(),
                    latency: latency.get_or_create(&l).clone(),
                    errors: ERROR_KINDS.map(|kind| {
                        errors
                            .get_or_create(&ErrorLabels {
                                method: name.to_string(),
                                kind,
                            })
                            .clone()
                    }),
                }
            })
            .collect();
        registry.register(
            "moongate_master_requests",
            "Requests received on the master face, by method",
            requests,
        );
        registry.register(
            "moongate_master_errors",
            "Failed calls by method and kind (rpc: transport error reply; app: ErrorCode in \
             the reply, per failed key for batch calls; decode: typed frame that did not decode)",
            errors,
        );
        registry.register(
            "moongate_master_request_duration_seconds",
            "Time from forwarding a request to the master until its reply arrived",
            latency,
        );
        let outcomes = Family::<OutcomeLabel, Counter>::default();
        let conn_outcomes = [
            ConnOutcome::accepted,
            ConnOutcome::rejected_limit,
            ConnOutcome::upstream_failed,
        ]
        .map(|outcome| outcomes.get_or_create(&OutcomeLabel { outcome }).clone());
        registry.register(
            "moongate_master_connections",
            "Client connections by outcome",
            outcomes,
        );
        let connections_open = Gauge::default();
        registry.register(
            "moongate_master_connections_open",
            "Client connections currently open on the master face",
            connections_open.clone(),
        );
        let upstream_connections_open = Gauge::default();
        registry.register(
            "moongate_upstream_connections_open",
            "Connections currently open to the upstream master (one per client connection)",
            upstream_connections_open.clone(),
        );
        let frame_errors = Family::<FrameErrorLabels, Counter>::default();
        registry.register(
            "moongate_master_frame_errors",
            "Bad frames by side and kind; bad_header and too_large close the connection",
            frame_errors.clone(),
        );
        let bytes = Family::<DirectionLabel, Counter>::default();
        let bytes_to_master = bytes
            .get_or_create(&DirectionLabel {
                direction: Direction::to_master,
            })
            .clone();
        let bytes_to_client = bytes
            .get_or_create(&DirectionLabel {
                direction: Direction::to_client,
            })
            .clone();
        registry.register(
            "moongate_master_bytes",
            "Bytes relayed on the master face",
            bytes,
        );
        let upstream_ready = Gauge::default();
        registry.register(
            "moongate_upstream_ready",
            "1 while the upstream master answers ServiceReady, else 0",
            upstream_ready.clone(),
        );
        let split_batches = Family::<MethodLabel, Counter>::default();
        let split_parts = Family::<MethodLabel, Counter>::default();
        let splits = Method::ALL
            .iter()
            .map(|m| {
                let l = MethodLabel {
                    method: m.name().to_string(),
                };
                (
                    split_batches.get_or_create(&l).clone(),
                    split_parts.get_or_create(&l).clone(),
                )
            })
            .collect();
        registry.register(
            "moongate_batch_splits",
            "Batch calls sent to the master as several bounded parts (max_batch_keys or a \
             plugin's split points) and answered as one merged reply",
            split_batches,
        );
        registry.register(
            "moongate_batch_parts",
            "Parts sent to the master for split batch calls",
            split_parts,
        );
        let eviction = EvictionMetrics::register(&mut registry);
        let kv = KvMetrics::register(&mut registry);
        let plugins = std::sync::Arc::new(PluginMetricsSink {
            counters: Family::default(),
            gauges: Family::default(),
        });
        registry.register(
            "moongate_plugin_counter",
            "Counters registered by policy plugins",
            plugins.counters.clone(),
        );
        registry.register(
            "moongate_plugin_gauge",
            "Gauges registered by policy plugins",
            plugins.gauges.clone(),
        );
        let policy = PolicyFamilies {
            calls: Family::default(),
            latency: Family::new_with_constructor(|| Histogram::new(POLICY_BUCKETS)),
            decisions: Family::default(),
            arm_requests: Family::default(),
            arm_latency: Family::new_with_constructor(|| Histogram::new(LATENCY_BUCKETS)),
            arm_errors: Family::default(),
            tier_keys: Family::default(),
            tier_bytes: Family::default(),
            lookups: Family::default(),
            active_generation: Gauge::default(),
            swaps: Counter::default(),
            rollbacks: Counter::default(),
            guardrail_stops: Counter::default(),
        };
        registry.register(
            "moongate_policy_calls",
            "Policy hook calls by plugin, version, arm, hook and result (ok, trap, timeout, \
             oom, invalid, unavailable)",
            policy.calls.clone(),
        );
        registry.register(
            "moongate_policy_call_duration_seconds",
            "Time of one hook call (on-put, on-lookup) through the plugin host",
            policy.latency.clone(),
        );
        registry.register(
            "moongate_policy_decisions",
            "Put-family decisions: unchanged, rewrite, deny_some, deny_all",
            policy.decisions.clone(),
        );
        registry.register(
            "moongate_arm_requests",
            "Put-family requests by the experiment arm that decided them",
            policy.arm_requests.clone(),
        );
        registry.register(
            "moongate_arm_request_duration_seconds",
            "Master latency of put-family requests by arm",
            policy.arm_latency.clone(),
        );
        registry.register(
            "moongate_arm_errors",
            "Failed put-family calls by arm (app: ErrorCode per key, incl. policy denials)",
            policy.arm_errors.clone(),
        );
        registry.register(
            "moongate_tier_keys",
            "Keys in lookup answers (GetReplicaList, BatchGetReplicaList) by replica tier \
             (memory, disk, local_disk, unknown), outcome (found, not_found, error) and arm; \
             a found key counts once in each tier it has a replica in",
            policy.tier_keys.clone(),
        );
        registry.register(
            "moongate_tier_bytes",
            "Object bytes of found keys in lookup answers, by tier, outcome and arm",
            policy.tier_bytes.clone(),
        );
        registry.register(
            "moongate_lookup_keys",
            "ExistKey / BatchExistKey keys by result (hit, miss) and arm",
            policy.lookups.clone(),
        );
        registry.register(
            "moongate_policy_generation",
            "Generation number of the active policy set (rises with every swap)",
            policy.active_generation.clone(),
        );
        registry.register(
            "moongate_policy_swaps",
            "Activations of a new policy set",
            policy.swaps.clone(),
        );
        registry.register(
            "moongate_policy_rollbacks",
            "Returns to the last-good policy set (by request or automatic)",
            policy.rollbacks.clone(),
        );
        registry.register(
            "moongate_policy_guardrail_stops",
            "Experiment arms stopped by their guardrail",
            policy.guardrail_stops.clone(),
        );
        Metrics {
            registry,
            plugins,
            policy,
            methods,
            connections_open,
            upstream_connections_open,
            conn_outcomes,
            frame_errors,
            bytes_to_master,
            bytes_to_client,
            upstream_ready,
            splits,
            eviction,
            kv,
        }
    }

    /// Handles of `method`; `None` = an unknown function id.
    pub fn method(&self, method: Option<Method>) -> &MethodMetrics {
        let i = method.map_or(METHOD_COUNT, Method::index);
        &self.methods[i]
    }

    /// Counts one batch call of `method` sent upstream as `parts` parts.
    pub fn split(&self, method: Method, parts: usize) {
        let (b, p) = &self.splits[method.index()];
        b.inc();
        p.inc_by(parts as u64);
    }

    pub fn connection(&self, outcome: ConnOutcome) {
        self.conn_outcomes[outcome as usize].inc();
    }

    /// Rare by nature (a connection closes right after), so a label lookup is fine here.
    pub fn frame_error(&self, side: Side, kind: FrameErrorKind) {
        self.frame_errors
            .get_or_create(&FrameErrorLabels { side, kind })
            .inc();
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut s = String::with_capacity(64 << 10);
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut s, &self.registry);
        s
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_feed_the_exposition() {
        let m = Metrics::new();
        m.method(Some(Method::ExistKey)).requests.inc();
        m.method(Some(Method::ExistKey)).latency.observe(0.0001);
        m.method(None).error(ErrorKind::rpc, 2);
        m.connection(ConnOutcome::rejected_limit);
        let s = m.encode();
        assert!(
            s.contains("moongate_master_requests_total{method=\"ExistKey\"} 1"),
            "{s}"
        );
        assert!(s.contains("moongate_master_errors_total{method=\"unknown\",kind=\"rpc\"} 2"));
        assert!(s.contains("moongate_master_connections_total{outcome=\"rejected_limit\"} 1"));
        assert!(
            s.contains("moongate_master_request_duration_seconds_count{method=\"ExistKey\"} 1")
        );
    }
}

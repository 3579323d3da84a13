//! The policy layer's metrics: hook calls, decisions, per-arm traffic and tiers, swaps,
//! rollbacks, guardrail stops, and the counters plugins register themselves. Handles are
//! created when an arm is activated, never per request.

#![allow(clippy::new_without_default)]

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::codec::Method;
use crate::per_method::{ERROR_KINDS, ErrorKind, LATENCY_BUCKETS, MethodMetrics};

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

/// A plugin hook as the metrics name it (the `hook` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    Put,
    Lookup,
    Split,
    /// `evict` and `evict-tiered`.
    Evict,
    Observe,
    /// `block-refs` and `block-keys` (the KV events' mapping).
    BlockKeys,
}

impl Hook {
    pub const ALL: [Hook; 6] = [
        Hook::Put,
        Hook::Lookup,
        Hook::Split,
        Hook::Evict,
        Hook::Observe,
        Hook::BlockKeys,
    ];

    /// The `hook` label.
    pub fn name(self) -> &'static str {
        match self {
            Hook::Put => "on-put",
            Hook::Lookup => "on-lookup",
            Hook::Split => "split",
            Hook::Evict => "evict",
            Hook::Observe => "observe",
            Hook::BlockKeys => "block-keys",
        }
    }

    /// What stands in when the hook fails (said in the log line).
    pub fn fallback(self) -> &'static str {
        match self {
            Hook::Put | Hook::Lookup => "the fail mode's decision",
            Hook::Split => "the batch left whole",
            Hook::Evict => "least recently used victims",
            Hook::Observe => "nothing (the outcome is not heard)",
            Hook::BlockKeys => "the keys publish no event",
        }
    }
}

/// One hook's handles: calls by [`CALL_RESULTS`] index, and their latency.
pub struct HookMetrics {
    pub calls: [Counter; 6],
    pub latency: Histogram,
}

/// The metric handles of one experiment arm (or of the single active plugin), created
/// when the arm is activated.
pub struct ArmMetrics {
    /// By [`Hook`] (`hooks[hook as usize]`).
    pub hooks: [HookMetrics; 6],
    /// by [`DECISIONS`] index
    pub decisions: [Counter; 4],
    /// Decoded requests served by this arm, by [`Method::index`].
    pub requests: Vec<MethodMetrics>,
    /// `[tier][outcome]` keys and bytes of lookup answers ([`crate::calls::Tally`]).
    pub tier_keys: [[Counter; 3]; 4],
    pub tier_bytes: [[Counter; 3]; 4],
    /// `ExistKey` / `BatchExistKey` keys: `[hit, miss]`.
    pub lookups: [Counter; 2],
    /// Keys and bytes readers were served, by the tier of the replica they read
    /// ([`crate::calls::lookup::SERVED_LABELS`] index).
    pub served_keys: [Counter; 5],
    pub served_bytes: [Counter; 5],
}

impl ArmMetrics {
    pub fn hook(&self, h: Hook) -> &HookMetrics {
        &self.hooks[h as usize]
    }

    /// Adds one answer's tier tally.
    pub fn add_tally(&self, t: &crate::calls::Tally) {
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
        self.add_lookups(t.hits, t.misses);
    }

    /// Adds keys an existence check found and did not find.
    pub fn add_lookups(&self, hits: u64, misses: u64) {
        if hits > 0 {
            self.lookups[0].inc_by(hits);
        }
        if misses > 0 {
            self.lookups[1].inc_by(misses);
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
struct ServedLabels {
    tier: String,
    arm: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LookupLabels {
    result: String,
    arm: String,
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
    served_keys: Family<ServedLabels, Counter>,
    served_bytes: Family<ServedLabels, Counter>,
    pub active_generation: Gauge,
    pub swaps: Counter,
    pub rollbacks: Counter,
    pub guardrail_stops: Counter,
    /// Plugins refused for their signature, by [`super::trust::TRUST_REASONS`].
    pub signature_refusals: [Counter; 4],
    /// Registry pulls: `ok`, `error`.
    pub pulls: [Counter; 2],
    /// The counters and gauges plugins register during `configure`.
    pub plugins: Arc<PluginMetricsSink>,
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
            hooks: Hook::ALL.map(|h| HookMetrics {
                calls: CALL_RESULTS.map(|r| self.calls.get_or_create(&pl(h.name(), r)).clone()),
                latency: hist(h.name()),
            }),
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
            served_keys: self.served_family(&self.served_keys, arm),
            served_bytes: self.served_family(&self.served_bytes, arm),
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

    fn served_family(&self, f: &Family<ServedLabels, Counter>, arm: &str) -> [Counter; 5] {
        crate::calls::lookup::SERVED_LABELS.map(|tier| {
            f.get_or_create(&ServedLabels {
                tier: tier.into(),
                arm: arm.into(),
            })
            .clone()
        })
    }

    fn tier_family(&self, f: &Family<TierLabels, Counter>, arm: &str) -> [[Counter; 3]; 4] {
        crate::calls::TIER_LABELS.map(|tier| {
            crate::calls::OUTCOMES.map(|outcome| {
                f.get_or_create(&TierLabels {
                    tier: tier.into(),
                    outcome: outcome.into(),
                    arm: arm.into(),
                })
                .clone()
            })
        })
    }

    /// Registers the policy families and the plugins' own metrics.
    pub fn register(registry: &mut Registry) -> PolicyFamilies {
        let plugins = Arc::new(PluginMetricsSink {
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
            served_keys: Family::default(),
            served_bytes: Family::default(),
            lookups: Family::default(),
            active_generation: Gauge::default(),
            swaps: Counter::default(),
            rollbacks: Counter::default(),
            guardrail_stops: Counter::default(),
            signature_refusals: Default::default(),
            pulls: Default::default(),
            plugins: plugins.clone(),
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
            "moongate_served_keys",
            "Keys readers were served, by the tier of the replica they read (memory, disk, \
             local_disk, other, unknown = not found) and arm; a key looked up again by the \
             same reader within its read lease counts once; owners' offload lookups are not reads",
            policy.served_keys.clone(),
        );
        registry.register(
            "moongate_served_bytes",
            "Object bytes readers were served, by tier and arm",
            policy.served_bytes.clone(),
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
        let refusals = Family::<[(&'static str, &'static str); 1], Counter>::default();
        registry.register(
            "moongate_plugin_signature_refusals",
            "Plugins refused for their signature (policy.trusted_keys set): unsigned, \
             malformed, untrusted_key, bad_signature",
            refusals.clone(),
        );
        let pulls = Family::<[(&'static str, &'static str); 1], Counter>::default();
        registry.register(
            "moongate_plugin_pulls",
            "Plugin pulls from OCI registries by result (ok, error)",
            pulls.clone(),
        );
        let mut policy = policy;
        policy.signature_refusals =
            super::trust::TRUST_REASONS.map(|r| refusals.get_or_create(&[("reason", r)]).clone());
        policy.pulls = ["ok", "error"].map(|r| pulls.get_or_create(&[("result", r)]).clone());
        policy
    }
}

//! Metric handles, registered once at start-up and indexed by method on the hot path
//! (no label lookups per request). Each part registers its own families
//! ([`crate::policy::metrics`], [`crate::eviction::metrics`], [`crate::kv::metrics`]);
//! this file composes them and holds the master face's handles and the shared
//! per-method building block ([`MethodMetrics`]). Exposed by the admin endpoint in the OpenMetrics text
//! format; `docs/operations.md` lists every metric.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

pub use crate::eviction::metrics::EvictionMetrics;
pub use crate::kv::metrics::KvMetrics;
pub use crate::master_face::metrics::{ConnOutcome, FrameErrorKind, MasterFaceMetrics, Side};
pub use crate::policy::metrics::{PluginMetricsSink, PolicyFamilies};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct MethodLabel {
    pub(crate) method: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ErrorLabels {
    pub(crate) method: String,
    pub(crate) kind: ErrorKind,
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

pub const ERROR_KINDS: [ErrorKind; 3] = [ErrorKind::rpc, ErrorKind::app, ErrorKind::decode];

/// Latency buckets (seconds): 25 us (a relayed metadata call's floor) to 10 s.
pub const LATENCY_BUCKETS: [f64; 17] = [
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 0.5,
    1.0, 2.5, 10.0,
];

/// Per-method handles: index = [`Method::index`], the last slot is "unknown".
pub struct MethodMetrics {
    pub requests: Counter,
    pub latency: Histogram,
    pub(crate) errors: [Counter; 3],
}

impl MethodMetrics {
    pub fn error(&self, kind: ErrorKind, n: u64) {
        if n > 0 {
            self.errors[kind as usize].inc_by(n);
        }
    }
}

/// Every metric moongate exports: each part's handles, registered by the part.
pub struct Metrics {
    pub registry: Registry,
    pub master: MasterFaceMetrics,
    pub eviction: EvictionMetrics,
    pub kv: KvMetrics,
    pub plugins: std::sync::Arc<PluginMetricsSink>,
    pub policy: PolicyFamilies,
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let master = MasterFaceMetrics::register(&mut registry);
        let eviction = EvictionMetrics::register(&mut registry);
        let kv = KvMetrics::register(&mut registry);
        let (policy, plugins) = PolicyFamilies::register(&mut registry);
        Metrics {
            registry,
            master,
            eviction,
            kv,
            plugins,
            policy,
        }
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
    use crate::codec::Method;

    #[test]
    fn handles_feed_the_exposition() {
        let m = Metrics::new();
        m.master.method(Some(Method::ExistKey)).requests.inc();
        m.master
            .method(Some(Method::ExistKey))
            .latency
            .observe(0.0001);
        m.master.method(None).error(ErrorKind::rpc, 2);
        m.master.connection(ConnOutcome::rejected_limit);
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

//! Every metric moongate exports, registered once at start-up. Each part registers its
//! own families ([`crate::master_face::metrics`], [`crate::policy::metrics`],
//! [`crate::eviction::metrics`], [`crate::keys::metrics`], [`crate::events::metrics`], [`crate::kv::metrics`], [`crate::upstream::leader`]);
//! this file only composes them.
//! Exposed by the admin endpoint in the OpenMetrics text format; `docs/operations.md`
//! lists every metric.

use std::sync::Arc;

use prometheus_client::registry::Registry;

pub use crate::eviction::metrics::EvictionMetrics;
pub use crate::kv::metrics::KvMetrics;
pub use crate::master_face::metrics::{ConnOutcome, FrameErrorKind, MasterFaceMetrics, Side};
pub use crate::per_method::{ErrorKind, MethodMetrics};
pub use crate::policy::metrics::{PluginMetricsSink, PolicyFamilies};

/// Every metric moongate exports: each part's handles, registered by the part.
/// A part holds only its own handles (an `Arc` of them), never this composition.
pub struct Metrics {
    pub registry: Registry,
    pub master: Arc<MasterFaceMetrics>,
    pub eviction: Arc<EvictionMetrics>,
    /// The key table's size and the reasons of lookup misses.
    pub keys: Arc<crate::keys::metrics::KeyMetrics>,
    pub events: Arc<crate::events::metrics::EventsMetrics>,
    pub kv: Arc<KvMetrics>,
    /// The policy layer's families, and the counters and gauges plugins register.
    pub policy: Arc<PolicyFamilies>,
    /// Where the master is (leader following).
    pub upstream: Arc<crate::upstream::LeaderMetrics>,
    /// Peers, owners' offloads and SSDs.
    pub topology: Arc<crate::topology::metrics::TopologyMetrics>,
    /// Fleet membership through etcd.
    pub fleet: Arc<crate::fleet::metrics::FleetMetrics>,
    /// Hints taken, refused and kept.
    pub hints: Arc<crate::hints::HintsMetrics>,
    /// SSD reads relayed to owners.
    pub owner_face: Arc<crate::owner_face::OwnerFaceMetrics>,
    /// What the allocator holds, read at each scrape.
    pub heap: crate::heap::HeapMetrics,
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let master = Arc::new(MasterFaceMetrics::register(&mut registry));
        let eviction = Arc::new(EvictionMetrics::register(&mut registry));
        let keys = Arc::new(crate::keys::metrics::KeyMetrics::register(&mut registry));
        let events = Arc::new(crate::events::metrics::EventsMetrics::register(
            &mut registry,
        ));
        let kv = Arc::new(KvMetrics::register(&mut registry));
        let policy = Arc::new(PolicyFamilies::register(&mut registry));
        let upstream = Arc::new(crate::upstream::LeaderMetrics::register(&mut registry));
        let topology = Arc::new(crate::topology::metrics::TopologyMetrics::register(
            &mut registry,
        ));
        let fleet = Arc::new(crate::fleet::metrics::FleetMetrics::register(&mut registry));
        let hints = Arc::new(crate::hints::HintsMetrics::register(&mut registry));
        let owner_face = Arc::new(crate::owner_face::OwnerFaceMetrics::register(&mut registry));
        let heap = crate::heap::HeapMetrics::register(&mut registry);
        Metrics {
            heap,
            owner_face,
            hints,
            fleet,
            topology,
            upstream,
            registry,
            master,
            eviction,
            keys,
            events,
            kv,
            policy,
        }
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        self.heap.refresh();
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

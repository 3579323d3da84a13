//! The topology's metrics: peers connected, what owners offloaded to and promoted from
//! their SSDs, their SSD capacity, and owners' own offload lookups. Served tiers are
//! per experiment arm and live with the arm's handles
//! ([`crate::policy::metrics::ArmMetrics::served_keys`]).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OwnerLabel {
    owner: String,
}

pub struct TopologyMetrics {
    /// Client processes (or remote addresses) with a connection open.
    pub peers: Gauge,
    pub offloaded_keys: Counter,
    pub offloaded_bytes: Counter,
    pub promoted_keys: Counter,
    pub promoted_bytes: Counter,
    /// Keys an offload notice named without a place on the SSD (no replica made).
    pub offload_failed: Counter,
    /// Keys owners' offload heartbeats were asked to offload.
    pub offload_tasks: Counter,
    /// Keys owners looked up to offload them (not reads; not in the served counts).
    pub owner_offload_lookups: Counter,
    ssd_capacity: Family<OwnerLabel, Gauge>,
    ssd_used: Family<OwnerLabel, Gauge>,
    ssd_keys: Family<OwnerLabel, Gauge>,
}

/// One owner's SSD usage gauges (made once per owner).
pub struct SsdGauges {
    pub used_bytes: Gauge,
    pub keys: Gauge,
}

impl TopologyMetrics {
    pub fn register(r: &mut Registry) -> TopologyMetrics {
        let m = TopologyMetrics {
            peers: Gauge::default(),
            offloaded_keys: Counter::default(),
            offloaded_bytes: Counter::default(),
            promoted_keys: Counter::default(),
            promoted_bytes: Counter::default(),
            offload_tasks: Counter::default(),
            offload_failed: Counter::default(),
            owner_offload_lookups: Counter::default(),
            ssd_capacity: Family::default(),
            ssd_used: Family::default(),
            ssd_keys: Family::default(),
        };
        r.register(
            "moongate_master_peers",
            "Client processes (or remote addresses) with a master-face connection open",
            m.peers.clone(),
        );
        r.register(
            "moongate_offload_keys",
            "Keys owners reported written to their SSD tier (NotifyOffloadSuccess)",
            m.offloaded_keys.clone(),
        );
        r.register(
            "moongate_offload_bytes",
            "Bytes owners reported written to their SSD tier",
            m.offloaded_bytes.clone(),
        );
        r.register(
            "moongate_promotion_keys",
            "Keys owners brought back from their SSD into memory (NotifyPromotionSuccess)",
            m.promoted_keys.clone(),
        );
        r.register(
            "moongate_promotion_bytes",
            "Bytes owners brought back from their SSD into memory",
            m.promoted_bytes.clone(),
        );
        r.register(
            "moongate_offload_failed_keys",
            "Keys an owner's NotifyOffloadSuccess named with no place on its SSD (bucket -1, \
             no endpoint): the master makes no SSD replica for them",
            m.offload_failed.clone(),
        );
        r.register(
            "moongate_offload_tasks",
            "Keys the master asked owners to offload (OffloadObjectHeartbeat answers)",
            m.offload_tasks.clone(),
        );
        r.register(
            "moongate_owner_offload_lookup_keys",
            "Keys owners looked up to offload them: their own work, not counted as reads served",
            m.owner_offload_lookups.clone(),
        );
        r.register(
            "moongate_ssd_capacity_bytes",
            "SSD capacity each owner reported (ReportSsdCapacity), by owner client id",
            m.ssd_capacity.clone(),
        );
        r.register(
            "moongate_ssd_used_bytes",
            "Bytes on each owner's SSD as moongate follows them: offload notices and lookup \
             answers listing an SSD copy add a key, removals and answers without one take it \
             off (docs/operations.md: what it cannot see)",
            m.ssd_used.clone(),
        );
        r.register(
            "moongate_ssd_keys",
            "Keys on each owner's SSD, followed as moongate_ssd_used_bytes",
            m.ssd_keys.clone(),
        );
        m
    }

    /// One owner's usage gauges.
    pub fn ssd_gauges(&self, owner: &str) -> SsdGauges {
        let l = OwnerLabel {
            owner: owner.to_string(),
        };
        SsdGauges {
            used_bytes: self.ssd_used.get_or_create(&l).clone(),
            keys: self.ssd_keys.get_or_create(&l).clone(),
        }
    }

    /// The capacity gauge of one owner (few owners per pool: made on its report).
    pub fn ssd_capacity(&self, owner: &str) -> Gauge {
        self.ssd_capacity
            .get_or_create(&OwnerLabel {
                owner: owner.to_string(),
            })
            .clone()
    }
}

//! The fleet's metrics: members seen, what this member wrote to etcd, and etcd trouble.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

pub struct FleetMetrics {
    /// Members in this member's view, itself included (0 while `[fleet]` is off or
    /// etcd was never reached).
    pub members: Gauge,
    /// Record writes to etcd (a record is written only when it changed).
    pub writes: Counter,
    /// etcd calls that failed, or watches and leases that broke; each is retried.
    pub etcd_errors: Counter,
}

impl FleetMetrics {
    pub fn register(r: &mut Registry) -> FleetMetrics {
        let m = FleetMetrics {
            members: Gauge::default(),
            writes: Counter::default(),
            etcd_errors: Counter::default(),
        };
        r.register(
            "moongate_fleet_members",
            "Fleet members this moongate sees through etcd, itself included",
            m.members.clone(),
        );
        r.register(
            "moongate_fleet_writes",
            "Member-record writes this moongate made to etcd",
            m.writes.clone(),
        );
        r.register(
            "moongate_fleet_etcd_errors",
            "Failed etcd calls, broken watches and lost leases of the fleet membership",
            m.etcd_errors.clone(),
        );
        m
    }
}

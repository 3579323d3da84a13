//! The fleet's metrics: members seen, what this member wrote to etcd, etcd trouble, the
//! pool-wide eviction rounds it called or heard, and the access records it sent to and
//! took from other members.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// A pool-wide round this member called (as leader) or heard of, in label order.
pub const ROUND_ROLES: [&str; 2] = ["called", "heard"];

/// Why records meant for another member were dropped, in label order.
pub const DROP_REASONS: [&str; 2] = ["overflow", "unsent"];

pub struct FleetMetrics {
    /// Members in this member's view, itself included (0 while `[fleet]` is off or
    /// etcd was never reached).
    pub members: Gauge,
    /// Record writes to etcd (a record is written only when it changed).
    pub writes: Counter,
    /// etcd calls that failed, or watches and leases that broke; each is retried.
    pub etcd_errors: Counter,
    /// Bytes of access records sent to other members, and taken from them.
    pub records_sent_bytes: Counter,
    pub records_received_bytes: Counter,
    /// Batches of access records dropped: a member's pending bytes past
    /// `fleet.records_max_pending_bytes` (overflow), or a POST that failed (unsent).
    pub records_dropped: [Counter; 2],
    /// Key-table entries handed to their new home when the membership changed.
    pub handed_over: Counter,
    /// Pool-wide eviction rounds, by [`ROUND_ROLES`].
    pub rounds: [Counter; 2],
    /// The excess of the rounds this member called: what the fleet was asked to free.
    pub round_excess_bytes: Counter,
    /// Removals that can take leased values: relayed here and told to the fleet, and
    /// heard from other members (each voids this member's replica lists).
    pub removals_told: Counter,
    pub removals_heard: Counter,
}

impl FleetMetrics {
    pub fn register(r: &mut Registry) -> FleetMetrics {
        let dropped = Family::<[(&'static str, &'static str); 1], Counter>::default();
        let rounds = Family::<[(&'static str, &'static str); 1], Counter>::default();
        let m = FleetMetrics {
            rounds: ROUND_ROLES.map(|r| rounds.get_or_create(&[("role", r)]).clone()),
            round_excess_bytes: Counter::default(),
            members: Gauge::default(),
            writes: Counter::default(),
            etcd_errors: Counter::default(),
            records_sent_bytes: Counter::default(),
            records_received_bytes: Counter::default(),
            records_dropped: DROP_REASONS.map(|r| dropped.get_or_create(&[("reason", r)]).clone()),
            handed_over: Counter::default(),
            removals_told: Counter::default(),
            removals_heard: Counter::default(),
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
        r.register(
            "moongate_fleet_records_sent_bytes",
            "Bytes of access records sent to the members that are the keys' homes",
            m.records_sent_bytes.clone(),
        );
        r.register(
            "moongate_fleet_records_received_bytes",
            "Bytes of access records taken from other members for keys homed here",
            m.records_received_bytes.clone(),
        );
        r.register(
            "moongate_fleet_records_dropped",
            "Batches of access records dropped, by reason (overflow: past \
             fleet.records_max_pending_bytes; unsent: the POST failed)",
            dropped,
        );
        r.register(
            "moongate_fleet_handed_over",
            "Key-table entries handed to their new home member on a change of membership",
            m.handed_over.clone(),
        );
        r.register(
            "moongate_fleet_rounds",
            "Pool-wide eviction rounds this member called as the fleet's leader, or heard \
             of from it",
            rounds,
        );
        r.register(
            "moongate_fleet_round_excess_bytes",
            "Bytes the rounds this member called asked the fleet to free",
            m.round_excess_bytes.clone(),
        );
        r.register(
            "moongate_fleet_removals_told",
            "Writes telling the other members that a removal which can take leased values \
             went to the master through this moongate",
            m.removals_told.clone(),
        );
        r.register(
            "moongate_fleet_removals_heard",
            "Such removals heard from other members: each voided the replica lists this \
             moongate keeps (kv.replica_cache_ms)",
            m.removals_heard.clone(),
        );
        m
    }
}

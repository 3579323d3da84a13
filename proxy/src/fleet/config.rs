//! The `[fleet]` section: the moongates of one pool know each other through etcd. Off by
//! default: one moongate alone behaves as if it were the whole fleet.

use serde::Deserialize;

use crate::validate::{check_addr, positive};

/// Fleet membership through etcd (the store Mooncake's HA already uses).
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct FleetConfig {
    /// Off by default: a sidecar that is alone needs no etcd.
    pub enabled: bool,
    /// etcd endpoints, `HOST:PORT[;HOST:PORT...]`. Empty: the upstream's etcd when
    /// `master_face.upstream` is `etcd://...` (an HA pool has one already).
    pub etcd: String,
    /// The pool's name: members of one cluster see each other, and only each other
    /// (key prefix `/moongate/fleet/CLUSTER/`).
    pub cluster: String,
    /// How often a member publishes its record (only when it changed) and renews its
    /// lease: one etcd write per member per interval at most.
    pub interval_ms: u64,
    /// The lease behind a member's key: a member that dies disappears from every other
    /// member's view within this (etcd leases are whole seconds). At least twice the
    /// interval, so one slow renewal does not drop a live member.
    pub lease_ttl_s: u64,
    /// This member's name in the fleet. Empty: `HOSTNAME-PID` (unique per process on a
    /// host, stable for its life).
    pub member: String,
    /// Access records: every key has one home member (consistent hashing over the
    /// members), whose key table holds it; what the other members see of it (puts,
    /// lookups, removals) travels there in batches, so its evictor ranks keys by the
    /// whole fleet's accesses. Needs the members' admin endpoints reachable from each
    /// other (with `admin.token` set alike on every member when they are not on
    /// loopback). Off: each member keeps and evicts the keys put through it, by the
    /// accesses it saw itself.
    pub records: bool,
    /// How often a member sends what it gathered for each other member (one HTTP POST
    /// per member with records, on a kept connection): the delay before a home sees an
    /// access.
    pub records_flush_ms: u64,
    /// Bytes of records waiting for one member at most (about 30 B per key seen); past
    /// it records are dropped and counted (`moongate_fleet_records_dropped_total`): a
    /// slow or dead member must not grow another's memory.
    pub records_max_pending_bytes: u64,
}

impl Default for FleetConfig {
    fn default() -> Self {
        FleetConfig {
            enabled: false,
            etcd: String::new(),
            cluster: "default".into(),
            interval_ms: 1_000,
            lease_ttl_s: 5,
            member: String::new(),
            records: true,
            records_flush_ms: 20,
            records_max_pending_bytes: 4 << 20,
        }
    }
}

/// `HOST:PORT[;HOST:PORT...]` as a list (blanks dropped).
pub fn parse_endpoints(s: &str) -> Vec<String> {
    s.split(';')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

impl FleetConfig {
    /// The etcd endpoints to use: this section's, else the upstream's (`None`: neither).
    pub fn endpoints(&self, upstream_etcd: Option<&[String]>) -> Option<Vec<String>> {
        if !self.etcd.is_empty() {
            return Some(parse_endpoints(&self.etcd));
        }
        upstream_etcd.map(|e| e.to_vec())
    }

    /// Appends every problem of this section to `errs` (nothing while it is off).
    /// `upstream_etcd`: the upstream's etcd endpoints, if it is `etcd://`.
    pub fn validate(&self, errs: &mut Vec<String>, upstream_etcd: Option<&[String]>) {
        if !self.enabled {
            return;
        }
        positive(errs, "fleet.interval_ms", self.interval_ms);
        positive(errs, "fleet.records_flush_ms", self.records_flush_ms);
        positive(
            errs,
            "fleet.records_max_pending_bytes",
            self.records_max_pending_bytes,
        );
        if self.lease_ttl_s * 1000 < 2 * self.interval_ms.max(500) {
            errs.push(format!(
                "fleet.lease_ttl_s: {} s must be at least twice fleet.interval_ms ({} ms), \
                 or a slow renewal drops a live member",
                self.lease_ttl_s, self.interval_ms
            ));
        }
        if self.cluster.is_empty() || self.cluster.contains('/') {
            errs.push(format!(
                "fleet.cluster: {:?} must be a non-empty name without '/'",
                self.cluster
            ));
        }
        if self.member.contains('/') {
            errs.push(format!(
                "fleet.member: {:?} must not contain '/'",
                self.member
            ));
        }
        match self.endpoints(upstream_etcd) {
            None => errs.push(
                "fleet: enabled without etcd (set fleet.etcd, or an etcd:// upstream)".into(),
            ),
            Some(eps) if eps.is_empty() => errs.push("fleet.etcd: no endpoint".into()),
            Some(eps) => {
                for e in &eps {
                    check_addr(errs, "fleet.etcd", e);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_is_never_an_error_and_on_needs_an_etcd() {
        let mut errs = Vec::new();
        FleetConfig::default().validate(&mut errs, None);
        assert!(errs.is_empty());
        let on = FleetConfig {
            enabled: true,
            ..Default::default()
        };
        on.validate(&mut errs, None);
        assert!(errs[0].contains("without etcd"), "{errs:?}");
        errs.clear();
        let up = ["127.0.0.1:2379".to_string()];
        on.validate(&mut errs, Some(&up));
        assert!(errs.is_empty(), "{errs:?}");
        assert_eq!(on.endpoints(Some(&up)).unwrap(), up);
    }

    #[test]
    fn a_lease_shorter_than_two_intervals_is_refused() {
        let mut errs = Vec::new();
        FleetConfig {
            enabled: true,
            etcd: "127.0.0.1:2379;127.0.0.1:2380".into(),
            interval_ms: 3_000,
            lease_ttl_s: 5,
            cluster: "a/b".into(),
            ..Default::default()
        }
        .validate(&mut errs, None);
        assert_eq!(errs.len(), 2, "{errs:?}");
        assert!(errs[0].contains("lease_ttl_s"));
        assert!(errs[1].contains("fleet.cluster"));
    }
}

//! The `[owner_face]` section: whether ranks read owners' SSDs through moongate, where
//! its relay listens, how a large read is cut, and how much an owner may be asked to
//! stage at once.

use serde::Deserialize;

use crate::validate::positive;

/// moongate in front of owners' offload-read service.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct OwnerFaceConfig {
    /// Off by default: ranks then read an owner's SSD from the owner directly, as
    /// without moongate. On: lookup answers point each SSD copy at a relay moongate
    /// opens per owner, which counts, cuts and paces those reads.
    pub enabled: bool,
    /// The address the relays listen on (one ephemeral port per owner) and that lookup
    /// answers name. Default `127.0.0.1`: the rank that reads is the one beside this
    /// moongate.
    pub listen_host: String,
    /// Owners relayed at most; a lookup naming another owner keeps that owner's own
    /// endpoint (counted in `moongate_owner_face_owners_refused_total`). Default 64.
    pub max_owners: usize,
    /// A relay no lookup answer named for this long, with no rank connection open, is
    /// closed (an owner that restarts comes back on another port, so its old relay
    /// would hold a listener and a `max_owners` place for good); 0 = never. Default
    /// 600000 (10 min: far past any read lease).
    pub idle_owner_ms: u64,
    /// Connections per relay; a further one is closed on accept. Default 256.
    pub max_connections: usize,
    /// Largest request or answer frame, bytes. Default 64 MiB (a read call names keys
    /// and sizes, its answer pointers: a few dozen bytes a key).
    pub max_frame_bytes: u64,
    /// Calls one rank connection may have under way; beyond it moongate stops reading
    /// that connection until one is answered. Default 64.
    pub max_inflight_per_connection: usize,
    /// Connections to each owner's service, shared by the relay's calls: the parts of
    /// one read go out in parallel on as many. Default 8.
    pub max_owner_connections: usize,
    /// Time allowed to connect to an owner. Default 3 s.
    pub connect_timeout_ms: u64,
    /// A call to an owner not answered within this fails (the rank gets a transport
    /// error for that call only). Default 30 s, Mooncake's own RPC timeout: the owner
    /// answers only once it has staged every value from its SSD.
    pub call_timeout_ms: u64,
    /// A read of more keys is cut into parts of at most this many keys; 0 = not cut by
    /// count. Default 0.
    pub part_keys: usize,
    /// A read of more bytes is cut into parts of at most this many bytes (a key larger
    /// than this is a part alone); 0 = not cut by size. Default 0. The arm's plugin,
    /// when it has a `split` hook, cuts as well (points from all three are merged).
    pub part_bytes: u64,
    /// Bytes each owner holds staged for this moongate's ranks (answered, not yet
    /// released) at most: a read that would go past it waits for releases
    /// (backpressure) instead of asking the owner's staging buffer for more than it
    /// has, which fails the read. A read larger than this goes when nothing else is
    /// staged. The whole read is admitted at once: its parts stay staged until the
    /// rank has read them all. 0 = no bound. Default 0.
    pub max_staged_bytes: u64,
    /// The longest a read waits for staging room; past it the read is sent anyway
    /// (counted in `moongate_owner_face_over_budget_total`): the rank's client gives
    /// up on a call after its own timeout, and waiting must never turn a load into a
    /// failure. Default 1000; at most 10000 (the rank's client waits 30 s for the
    /// answer, the owner's SSD read still to come).
    pub max_wait_ms: u64,
}

impl Default for OwnerFaceConfig {
    fn default() -> Self {
        OwnerFaceConfig {
            enabled: false,
            listen_host: "127.0.0.1".into(),
            max_owners: 64,
            idle_owner_ms: 600_000,
            max_connections: 256,
            max_frame_bytes: 64 << 20,
            max_inflight_per_connection: 64,
            max_owner_connections: 8,
            connect_timeout_ms: 3_000,
            call_timeout_ms: 30_000,
            part_keys: 0,
            part_bytes: 0,
            max_staged_bytes: 0,
            max_wait_ms: 1_000,
        }
    }
}

impl OwnerFaceConfig {
    /// Appends every problem of this section to `errs`.
    pub fn validate(&self, errs: &mut Vec<String>) {
        if self.listen_host.parse::<std::net::IpAddr>().is_err() {
            errs.push(format!(
                "owner_face.listen_host: {:?} is not an IP address",
                self.listen_host
            ));
        }
        for (key, v) in [
            ("owner_face.max_owners", self.max_owners as u64),
            ("owner_face.max_connections", self.max_connections as u64),
            (
                "owner_face.max_inflight_per_connection",
                self.max_inflight_per_connection as u64,
            ),
            (
                "owner_face.max_owner_connections",
                self.max_owner_connections as u64,
            ),
            ("owner_face.connect_timeout_ms", self.connect_timeout_ms),
            ("owner_face.call_timeout_ms", self.call_timeout_ms),
        ] {
            positive(errs, key, v);
        }
        if self.max_frame_bytes < 1024 {
            errs.push("owner_face.max_frame_bytes: must be at least 1024".into());
        }
        if self.max_wait_ms > 10_000 {
            errs.push(format!(
                "owner_face.max_wait_ms: {} ms leaves the owner's SSD read too little of \
                 the rank's 30 s call timeout: at most 10000",
                self.max_wait_ms
            ));
        }
    }
}

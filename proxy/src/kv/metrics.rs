//! The kv face's metrics: requests by op and status, transfers by transport and
//! direction, the byte budget, the replica cache, batch parts.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// A kv face operation (index into [`KV_OPS`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Get,
    Put,
    Delete,
    Exists,
    BatchGet,
    BatchPut,
}

/// kv face operations, in label order.
pub const KV_OPS: [&str; 6] = ["get", "put", "delete", "exists", "batch_get", "batch_put"];
/// HTTP status classes, in label order.
pub const KV_STATUS: [&str; 3] = ["2xx", "4xx", "5xx"];
/// How kv bytes moved (the `transport` label of the transfer metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// TE-TCP to a peer segment.
    Tcp,
    /// In place in moongate's own segment.
    Local,
    /// QUIC to a peer moongate's segment.
    Quic,
    /// A file of the master's disk tier.
    Disk,
}

impl Transport {
    const ALL: [Transport; 4] = [
        Transport::Tcp,
        Transport::Local,
        Transport::Quic,
        Transport::Disk,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::Local => "local",
            Transport::Quic => "quic",
            Transport::Disk => "disk",
        }
    }
}

/// A listener of the kv face (the `listener` label of the connection metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listener {
    /// The kv API on TCP (`kv.listen`).
    Http,
    /// The kv API on a Unix socket (`kv.unix_path`).
    Unix,
    /// The kv API over QUIC (`kv.api_quic_listen`).
    QuicApi,
    /// The own segment over TE-TCP (`kv.segment_listen`).
    SegmentTcp,
    /// The own segment over QUIC (`kv.quic_listen`).
    SegmentQuic,
}

impl Listener {
    const ALL: [Listener; 5] = [
        Listener::Http,
        Listener::Unix,
        Listener::QuicApi,
        Listener::SegmentTcp,
        Listener::SegmentQuic,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Listener::Http => "http",
            Listener::Unix => "unix",
            Listener::QuicApi => "quic_api",
            Listener::SegmentTcp => "segment_tcp",
            Listener::SegmentQuic => "segment_quic",
        }
    }
}

/// Which way kv bytes moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    Read,
    Write,
}

/// What a GET's replica cache lookup found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheResult {
    /// A cached replica was read: no master call.
    Hit,
    /// Not cached: asked the master.
    Miss,
    /// A cached replica was unreadable: asked the master again.
    Stale,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TableLabel {
    table: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WhereLabel {
    place: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndLabel {
    end: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ListenerLabel {
    listener: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KvReqLabels {
    op: &'static str,
    status: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShmLabels {
    op: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KvXferLabels {
    transport: &'static str,
    direction: &'static str,
}

/// Handles of the kv face.
pub struct KvMetrics {
    /// `[Op][status class]`
    requests: [[Counter; 3]; 6],
    /// Parts batch gets and puts were cut into.
    pub batch_parts: Counter,
    /// Replica cache lookups of gets, by [`CacheResult`].
    replica_cache: [Counter; 3],
    /// `[Transport][Dir]`
    transfers: [[Counter; 2]; 4],
    transfer_bytes: [[Counter; 2]; 4],
    /// `[Dir]`: TE-TCP transfers moved as stripes over several connections.
    striped: [Counter; 2],
    /// Requests refused with 503 because the in-flight byte budget stayed full.
    pub busy: Counter,
    pub inflight_bytes: Gauge,
    /// RDMA devices found at start (the data path falls back to TCP / QUIC regardless).
    pub rdma_devices: Gauge,
    /// `[Listener]`: connections open, and connections closed at once over the cap.
    connections: [Gauge; 5],
    connections_refused: [Counter; 5],
    connections_shed: [Counter; 5],
    /// Request bodies answered 408: not within `kv.timeout_ms`, below the rate floor,
    /// or shed while the budget was full.
    pub body_timeouts: Counter,
    /// Request bodies stopped, by reason: `[min_rate, budget]`.
    pub bodies_shed: [Counter; 2],
    /// Requests refused because their connection held its share of the budget.
    pub share_refused: Counter,
    /// Master calls refused busy: every one of `kv.master_connections` stayed in use.
    pub master_busy: Counter,
    /// Master connections idle now, and those closed for being idle past
    /// `kv.master_idle_ms`.
    pub master_idle: Gauge,
    pub master_idle_closed: Counter,
    /// Entries of the kv face's bounded tables: `[known_keys, failover_window,
    /// failover_held]` (their bounds: `kv.known_keys`, `kv.failover_window_keys` twice).
    pub table_entries: [Gauge; 3],
    /// Shared-memory calls `[op - 1][ok, error]` (register, release, get_into,
    /// put_from, batch_get_into), and the rest.
    shm_calls: [[Counter; 2]; SHM_OPS.len()],
    shm_registered_bytes: Gauge,
    shm_denied: Counter,
    /// Values viewed by local engines: `[in place, staged]`.
    pub views: [Counter; 2],
    /// Of those in place, the ones answered from the own segment's known keys (no
    /// master call).
    pub views_known: Counter,
    /// View leases held now, and the bytes under them.
    pub view_leases: Gauge,
    pub viewed_bytes: Gauge,
    /// Reservations (write tickets) open now, and how they ended:
    /// `[committed, aborted, expired, orphaned, failed]`.
    pub reservations: Gauge,
    pub reservations_ended: [Counter; 5],
    /// Staging bytes handed out now (`kv.staging_bytes`).
    pub staging_bytes: Gauge,
    /// Writes into the own segment that met a view: `[waited, rejected]`.
    pub fenced_writes: [Counter; 2],
    /// Checks of acknowledged puts after a leader change, and their keys by outcome
    /// (`[present, put_again, ended_here, lost, gone_before]`, `kv.failover_window_ms`).
    pub failover_rechecks: Counter,
    /// Values in other segments read back while no leader served (`[found, changed]`).
    pub failover_read_ahead: [Counter; 2],
    pub failover_keys: [Counter; crate::kv::client::failover::Outcome::ALL.len()],
    /// Reads that met a key of the window missing while a new leader's check ran and
    /// waited for it: `[found, absent]` after it.
    pub failover_waited_reads: [Counter; 2],
}

/// Shared-memory ops in label order (op `i + 1` is `SHM_OPS[i]`; the last is any other).
const SHM_OPS: [&str; 14] = [
    "register",
    "release",
    "get_into",
    "put_from",
    "batch_get_into",
    "batch_put_from",
    "hello",
    "segments",
    "view",
    "release_view",
    "reserve",
    "commit",
    "abort",
    "other",
];

impl KvMetrics {
    pub fn register(registry: &mut Registry) -> KvMetrics {
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
        let striped = Family::<KvXferLabels, Counter>::default();
        registry.register(
            "moongate_kv_striped_transfers",
            "TE-TCP transfers of streamed values moved as stripes over several connections \
             at once (kv.te_stripe_bytes), by direction; each is also one of \
             moongate_kv_transfers",
            striped.clone(),
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
        let conns = Family::<ListenerLabel, Gauge>::default();
        registry.register(
            "moongate_kv_connections",
            "Connections open per kv-face listener (http, unix, quic_api, segment_tcp, \
             segment_quic)",
            conns.clone(),
        );
        let refused = Family::<ListenerLabel, Counter>::default();
        registry.register(
            "moongate_kv_connections_refused",
            "Connections closed at once because their listener held its cap \
             (kv.max_connections, kv.segment_max_connections, kv.quic_max_connections)",
            refused.clone(),
        );
        let shed = Family::<ListenerLabel, Counter>::default();
        registry.register(
            "moongate_kv_connections_shed",
            "Connections closed to make room for a new one at their listener's cap: each \
             had moved no byte for kv.shed_after_ms, the longest of its listener",
            shed.clone(),
        );
        let body_timeouts = Counter::default();
        registry.register(
            "moongate_kv_body_timeouts",
            "kv request bodies answered 408: not whole within kv.timeout_ms, below \
             kv.min_body_bytes_per_second, or shed while the byte budget was full",
            body_timeouts.clone(),
        );
        let bodies_shed = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "moongate_kv_bodies_shed",
            "kv request bodies stopped before they ended, by reason: min_rate (below \
             kv.min_body_bytes_per_second), budget (waiting for bytes for kv.shed_after_ms \
             or more while the byte budget was full)",
            bodies_shed.clone(),
        );
        let share_refused = Counter::default();
        registry.register(
            "moongate_kv_connection_share_refused",
            "kv requests answered 503 because their connection already held \
             kv.max_body_bytes_per_connection of the byte budget",
            share_refused.clone(),
        );
        let master_busy = Counter::default();
        registry.register(
            "moongate_kv_master_busy",
            "kv-face master calls answered busy: all kv.master_connections stayed in use \
             for kv.busy_wait_ms",
            master_busy.clone(),
        );
        let shm = Family::<ShmLabels, Counter>::default();
        registry.register(
            "moongate_kv_shm_calls",
            "Shared-memory calls on the kv Unix socket by op (register, release, get_into, \
             put_from, batch_get_into, batch_put_from, hello, segments, view, \
             release_view, reserve, commit, abort, other) and result (ok, error)",
            shm.clone(),
        );
        let shm_registered_bytes = Gauge::default();
        registry.register(
            "moongate_kv_shm_registered_bytes",
            "Engine memory registered for the shared-memory path now (kv.shm_max_bytes)",
            shm_registered_bytes.clone(),
        );
        let shm_denied = Counter::default();
        registry.register(
            "moongate_kv_shm_denied",
            "Shared-memory connections refused: the peer's uid is not in \
             kv.shm_allowed_uids",
            shm_denied.clone(),
        );
        let views = Family::<WhereLabel, Counter>::default();
        registry.register(
            "moongate_kv_views",
            "Values local engines viewed, by place: in_place (in moongate's own segment, no copy) or \
             staged (read into the staging area first)",
            views.clone(),
        );
        let views_known = Counter::default();
        registry.register(
            "moongate_kv_views_known",
            "Values local engines viewed in place without a master call: moongate knew their \
             bytes lay untouched in its own segment (kv.known_keys)",
            views_known.clone(),
        );
        let view_leases = Gauge::default();
        registry.register(
            "moongate_kv_view_leases",
            "View leases local engines hold now",
            view_leases.clone(),
        );
        let viewed_bytes = Gauge::default();
        registry.register(
            "moongate_kv_viewed_bytes",
            "Bytes under view leases now (in place and staged)",
            viewed_bytes.clone(),
        );
        let reservations = Gauge::default();
        registry.register(
            "moongate_kv_reservations",
            "Reservations (mg_reserve tickets) open now",
            reservations.clone(),
        );
        let ended = Family::<EndLabel, Counter>::default();
        registry.register(
            "moongate_kv_reservations_ended",
            "Reservations by how they ended: committed, aborted, expired (kv.lease_ms), \
             orphaned (the engine's connections ended), failed (commit refused)",
            ended.clone(),
        );
        let staging_bytes = Gauge::default();
        registry.register(
            "moongate_kv_staging_bytes",
            "Bytes of the staging area (kv.staging_bytes) held by views and reservations",
            staging_bytes.clone(),
        );
        let fenced = Family::<ResultLabel, Counter>::default();
        registry.register(
            "moongate_kv_fenced_writes",
            "Writes into the own segment that met a range a local engine views: waited \
             (went ahead once the view ended) or rejected (the view outlasted the wait)",
            fenced.clone(),
        );
        let master_idle = Gauge::default();
        registry.register(
            "moongate_kv_master_idle_connections",
            "The kv face's master connections open and idle now",
            master_idle.clone(),
        );
        let master_idle_closed = Counter::default();
        registry.register(
            "moongate_kv_master_idle_closed",
            "The kv face's master connections closed after kv.master_idle_ms idle",
            master_idle_closed.clone(),
        );
        let tables = Family::<TableLabel, Gauge>::default();
        registry.register(
            "moongate_kv_table_entries",
            "Entries of the kv face's bounded tables, read every 5 s: known_keys (own keys \
             viewed without the master, at most kv.known_keys), failover_window (puts \
             acknowledged lately, at most kv.failover_window_keys), failover_held (their \
             own-segment ranges, as many at most)",
            tables.clone(),
        );
        let read_ahead = Family::<ResultLabel, Counter>::default();
        registry.register(
            "moongate_kv_failover_read_ahead_keys",
            "Values of acknowledged puts in other segments read back while no leader served \
             (between the old leader's end and the next one's start, when no put can land on \
             them), by result: found (as they passed through moongate), changed (the old \
             leader had handed their range to another put)",
            read_ahead.clone(),
        );
        let failover_rechecks = Counter::default();
        registry.register(
            "moongate_kv_failover_rechecks",
            "Leader changes after which the puts acknowledged within kv.failover_window_ms \
             were checked against the new leader",
            failover_rechecks.clone(),
        );
        let failover = Family::<ResultLabel, Counter>::default();
        registry.register(
            "moongate_kv_failover_keys",
            "Acknowledged puts checked after a leader change, by result: present (the new \
             leader has it), put_again (it lacked it; moongate vouched for the bytes and put \
             them again), ended_here (removed or evicted through moongate meanwhile), lost \
             (it lacked it and the bytes could not be vouched for: /keys/KEY says \
             lost_in_failover), gone_before (the old leader had let it go before the change: \
             its range was handed to another put, or a lookup found it gone)",
            failover.clone(),
        );
        let waited = Family::<ResultLabel, Counter>::default();
        registry.register(
            "moongate_kv_failover_waited_reads",
            "Reads of a key acknowledged within kv.failover_window_ms that a new leader lacked \
             while its failover check ran: each waited for the check (at most kv.timeout_ms) \
             and asked again, by result: found (the check had put it again), absent",
            waited.clone(),
        );
        let x = |f: &Family<KvXferLabels, Counter>| {
            Transport::ALL.map(|t| t.label()).map(|transport| {
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
            striped: ["read", "write"].map(|direction| {
                striped
                    .get_or_create(&KvXferLabels {
                        transport: Transport::Tcp.label(),
                        direction,
                    })
                    .clone()
            }),
            batch_parts,
            replica_cache: ["hit", "miss", "stale"]
                .map(|result| cache.get_or_create(&ResultLabel { result }).clone()),
            busy,
            inflight_bytes,
            rdma_devices,
            connections: Listener::ALL.map(|l| {
                conns
                    .get_or_create(&ListenerLabel {
                        listener: l.label(),
                    })
                    .clone()
            }),
            connections_refused: Listener::ALL.map(|l| {
                refused
                    .get_or_create(&ListenerLabel {
                        listener: l.label(),
                    })
                    .clone()
            }),
            connections_shed: Listener::ALL.map(|l| {
                shed.get_or_create(&ListenerLabel {
                    listener: l.label(),
                })
                .clone()
            }),
            body_timeouts,
            bodies_shed: ["min_rate", "budget"]
                .map(|reason| bodies_shed.get_or_create(&ReasonLabel { reason }).clone()),
            share_refused,
            master_busy,
            master_idle,
            master_idle_closed,
            table_entries: ["known_keys", "failover_window", "failover_held"]
                .map(|table| tables.get_or_create(&TableLabel { table }).clone()),
            shm_calls: SHM_OPS.map(|op| {
                ["ok", "error"].map(|result| shm.get_or_create(&ShmLabels { op, result }).clone())
            }),
            shm_registered_bytes,
            shm_denied,
            views: ["in_place", "staged"]
                .map(|w| views.get_or_create(&WhereLabel { place: w }).clone()),
            views_known,
            view_leases,
            viewed_bytes,
            reservations,
            reservations_ended: ["committed", "aborted", "expired", "orphaned", "failed"]
                .map(|end| ended.get_or_create(&EndLabel { end }).clone()),
            staging_bytes,
            fenced_writes: ["waited", "rejected"]
                .map(|result| fenced.get_or_create(&ResultLabel { result }).clone()),
            failover_rechecks,
            failover_read_ahead: ["found", "changed"]
                .map(|result| read_ahead.get_or_create(&ResultLabel { result }).clone()),
            failover_keys: crate::kv::client::failover::Outcome::ALL.map(|o| {
                failover
                    .get_or_create(&ResultLabel { result: o.label() })
                    .clone()
            }),
            failover_waited_reads: ["found", "absent"]
                .map(|result| waited.get_or_create(&ResultLabel { result }).clone()),
        }
    }

    /// Counts one shared-memory call of protocol op `op` (unknown ones as `other`).
    pub fn shm_call(&self, op: u8, ok: bool) {
        let i = usize::from(op).wrapping_sub(1).min(SHM_OPS.len() - 1);
        self.shm_calls[i][usize::from(!ok)].inc();
    }

    /// Sets the bytes registered now.
    pub fn shm_registered(&self, bytes: u64) {
        self.shm_registered_bytes.set(bytes as i64);
    }

    /// Counts a shared-memory connection refused for its uid.
    pub fn shm_denied(&self) {
        self.shm_denied.inc();
    }

    /// The connection cap of one listener, counted under its label.
    /// The cap of listener `l`: `max` connections, shedding one stalled `shed_after`
    /// (zero: never) to make room.
    pub fn conn_limit(
        &self,
        l: Listener,
        max: usize,
        shed_after: Duration,
    ) -> crate::accept::ConnLimit {
        crate::accept::ConnLimit::new(
            max,
            shed_after,
            self.connections_refused[l as usize].clone(),
            self.connections_shed[l as usize].clone(),
            self.connections[l as usize].clone(),
        )
    }

    /// Counts one answered request of `op` by its HTTP status class.
    pub fn request(&self, op: Op, status: u16) {
        let class = match status {
            200..=399 => 0,
            400..=499 => 1,
            _ => 2,
        };
        self.requests[op as usize][class].inc();
    }

    /// Counts one transfer of `bytes`.
    pub fn transfer(&self, transport: Transport, dir: Dir, bytes: u64) {
        let (t, d) = (transport as usize, dir as usize);
        self.transfers[t][d].inc();
        self.transfer_bytes[t][d].inc_by(bytes);
    }

    /// Counts one transfer moved as stripes (also counted by [`KvMetrics::transfer`]).
    pub fn striped(&self, dir: Dir) {
        self.striped[dir as usize].inc();
    }

    /// Counts one replica cache lookup of a GET.
    pub fn replica_cache(&self, r: CacheResult) {
        self.replica_cache[r as usize].inc();
    }
}

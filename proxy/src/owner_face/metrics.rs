//! The owner face's metrics: SSD reads relayed to owners, how they were cut and paced,
//! what owners hold staged, and the relays' connections.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

use crate::per_method::LATENCY_BUCKETS;
use prometheus_client::registry::Registry;

/// How a relayed read (or release) ended, for the rank that made it.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum Outcome {
    /// The owner staged every value (a read) or freed the buffer (a release).
    ok,
    /// The owner answered with an error (a read), or said it held no such buffer.
    refused,
    /// The owner could not be reached or did not answer in time; the rank got a
    /// transport error for that call.
    transport,
    /// A release naming a batch moongate made that had expired or was unknown.
    unknown,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: Outcome,
}

pub struct OwnerFaceMetrics {
    reads: Family<ResultLabel, Counter>,
    releases: Family<ResultLabel, Counter>,
    /// Keys owners staged from their SSD for reads through moongate.
    pub read_keys: Counter,
    /// Bytes of those keys (the sizes the reads named).
    pub read_bytes: Counter,
    /// Calls sent to owners for reads (a read cut in N parts counts N).
    pub parts: Counter,
    /// Reads cut into more than one part.
    pub split_reads: Counter,
    /// Bytes owners hold staged for this moongate's ranks (answered, not released,
    /// within the owner's ttl).
    pub staged_bytes: Gauge,
    /// From the read's parts sent to every answer in: the owner staging the values
    /// from its SSD (and the relay's hop).
    pub owner_seconds: Histogram,
    /// Reads that waited for staging room.
    pub waits: Counter,
    /// Reads sent past `max_staged_bytes` because they had waited `max_wait_ms`.
    pub over_budget: Counter,
    /// Calls relayed whole without being read (another method, or a body of an
    /// unknown shape).
    pub relayed: Counter,
    /// Rank connections closed for a malformed frame.
    pub frame_errors: Counter,
    /// Owners relayed (one listener each).
    pub owners: Gauge,
    /// Owners not relayed because `max_owners` were.
    pub owners_refused: Counter,
    /// Relays closed because no lookup named their owner for `idle_owner_ms`.
    pub owners_retired: Counter,
    pub conns_open: Gauge,
    pub conns_refused: Counter,
    pub conns_shed: Counter,
}

impl OwnerFaceMetrics {
    pub fn register(r: &mut Registry) -> OwnerFaceMetrics {
        let m = OwnerFaceMetrics {
            reads: Family::default(),
            releases: Family::default(),
            read_keys: Counter::default(),
            read_bytes: Counter::default(),
            parts: Counter::default(),
            split_reads: Counter::default(),
            staged_bytes: Gauge::default(),
            owner_seconds: Histogram::new(LATENCY_BUCKETS),
            waits: Counter::default(),
            over_budget: Counter::default(),
            relayed: Counter::default(),
            frame_errors: Counter::default(),
            owners: Gauge::default(),
            owners_refused: Counter::default(),
            owners_retired: Counter::default(),
            conns_open: Gauge::default(),
            conns_refused: Counter::default(),
            conns_shed: Counter::default(),
        };
        // Every result present from the start (0), so a rate over it is defined.
        for o in [
            Outcome::ok,
            Outcome::refused,
            Outcome::transport,
            Outcome::unknown,
        ] {
            let _ = m.reads.get_or_create(&ResultLabel { result: o });
            let _ = m.releases.get_or_create(&ResultLabel { result: o });
        }
        r.register(
            "moongate_owner_face_reads",
            "SSD reads (batch_get_offload_object) relayed to owners, by result",
            m.reads.clone(),
        );
        r.register(
            "moongate_owner_face_releases",
            "Staging releases (release_offload_buffer) relayed to owners, by result",
            m.releases.clone(),
        );
        r.register(
            "moongate_owner_face_read_keys",
            "Keys owners staged from their SSD for reads through moongate",
            m.read_keys.clone(),
        );
        r.register(
            "moongate_owner_face_read_bytes",
            "Bytes owners staged from their SSD for reads through moongate",
            m.read_bytes.clone(),
        );
        r.register(
            "moongate_owner_face_parts",
            "Calls sent to owners for SSD reads (a read cut in N parts counts N)",
            m.parts.clone(),
        );
        r.register(
            "moongate_owner_face_split_reads",
            "SSD reads cut into more than one part",
            m.split_reads.clone(),
        );
        r.register(
            "moongate_owner_face_staged_bytes",
            "Bytes owners hold staged for this moongate's ranks: answered, not yet released \
             or expired",
            m.staged_bytes.clone(),
        );
        r.register(
            "moongate_owner_face_owner_seconds",
            "Time owners took to answer a read relayed to them (all its parts): staging the \
             values from the SSD",
            m.owner_seconds.clone(),
        );
        r.register(
            "moongate_owner_face_waits",
            "Reads that waited for staging room (owner_face.max_staged_bytes)",
            m.waits.clone(),
        );
        r.register(
            "moongate_owner_face_over_budget",
            "Reads sent past owner_face.max_staged_bytes after waiting max_wait_ms",
            m.over_budget.clone(),
        );
        r.register(
            "moongate_owner_face_relayed",
            "Calls to owners relayed whole without being read (another method, or an \
             unknown shape)",
            m.relayed.clone(),
        );
        r.register(
            "moongate_owner_face_frame_errors",
            "Rank connections to the owner face closed for a malformed frame",
            m.frame_errors.clone(),
        );
        r.register(
            "moongate_owner_face_owners",
            "Owners whose SSD reads moongate relays (one listener each)",
            m.owners.clone(),
        );
        r.register(
            "moongate_owner_face_owners_refused",
            "Lookup answers naming an owner past owner_face.max_owners (left pointing at \
             the owner)",
            m.owners_refused.clone(),
        );
        r.register(
            "moongate_owner_face_owners_retired",
            "Relays closed because no lookup answer named their owner for \
             owner_face.idle_owner_ms and no rank connection was open",
            m.owners_retired.clone(),
        );
        r.register(
            "moongate_owner_face_connections_open",
            "Rank connections open on the owner face",
            m.conns_open.clone(),
        );
        r.register(
            "moongate_owner_face_connections_refused",
            "Rank connections closed on accept at owner_face.max_connections",
            m.conns_refused.clone(),
        );
        r.register(
            "moongate_owner_face_connections_shed",
            "Stalled rank connections closed to make room for a new one",
            m.conns_shed.clone(),
        );
        m
    }

    pub fn read(&self, o: Outcome) {
        self.reads.get_or_create(&ResultLabel { result: o }).inc();
    }

    pub fn release(&self, o: Outcome) {
        self.releases
            .get_or_create(&ResultLabel { result: o })
            .inc();
    }
}

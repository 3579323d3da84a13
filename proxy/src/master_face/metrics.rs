//! The master face's metrics: requests, errors and latency by method, connections,
//! bad frames, bytes relayed, batch splits, and whether the upstream master answers.
//! Handles are created once here and indexed by method on the hot path.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::codec::method::METHOD_COUNT;
use crate::codec::release::MasterRelease;
use crate::codec::{Method, Schema};
use crate::per_method::{ERROR_KINDS, ErrorLabels, LATENCY_BUCKETS, MethodLabel, MethodMetrics};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: ConnOutcome,
}

/// How an accepted client connection went.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum ConnOutcome {
    /// Served with its own upstream connection.
    accepted,
    /// Closed at once: `master_face.max_connections` reached.
    rejected_limit,
    /// Closed at once: the upstream master could not be reached.
    upstream_failed,
}

/// Why a served client connection ended.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum CloseReason {
    /// The client closed it (the usual end).
    client_closed,
    /// Reading from or writing to the client failed.
    client_error,
    /// The client sent a malformed frame.
    client_bad_frame,
    /// The master closed its side.
    upstream_closed,
    /// Reading from or writing to the master failed (e.g. a reset).
    upstream_error,
    /// The master sent a malformed frame.
    upstream_bad_frame,
    /// A forwarded call went unanswered for `master_face.answer_timeout_ms`.
    upstream_silent,
    /// No byte moved for `master_face.idle_timeout_ms`.
    idle,
    /// An HA leader change: the client reconnects to the new leader.
    leader_changed,
    /// Closed by shutdown.
    shutdown,
}

const CLOSE_REASONS: [CloseReason; 10] = [
    CloseReason::client_closed,
    CloseReason::client_error,
    CloseReason::client_bad_frame,
    CloseReason::upstream_closed,
    CloseReason::upstream_error,
    CloseReason::upstream_bad_frame,
    CloseReason::upstream_silent,
    CloseReason::idle,
    CloseReason::leader_changed,
    CloseReason::shutdown,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CloseLabel {
    reason: CloseReason,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FrameErrorLabels {
    side: Side,
    kind: FrameErrorKind,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Side {
    client,
    upstream,
}

/// Why a connection was closed for a bad frame.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum FrameErrorKind {
    bad_header,
    too_large,
    /// A response whose seq matched no forwarded request (relayed; the client decides).
    unmatched_seq,
}

impl FrameErrorKind {
    /// The kind of a frame that failed its header check (either side).
    pub fn of(e: &crate::codec::FrameError) -> FrameErrorKind {
        match e {
            crate::codec::FrameError::TooLarge { .. } => FrameErrorKind::too_large,
            _ => FrameErrorKind::bad_header,
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabel {
    direction: Direction,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Direction {
    to_master,
    to_client,
}

/// Every master-face handle.
pub struct MasterFaceMetrics {
    methods: Vec<MethodMetrics>,
    pub connections_open: Gauge,
    pub upstream_connections_open: Gauge,
    conn_outcomes: [Counter; 3],
    /// Client connections held for a leader (`master_face.failover_hold_ms`):
    /// `[connected, closed]`.
    held: [Counter; 2],
    closes: [Counter; CLOSE_REASONS.len()],
    frame_errors: Family<FrameErrorLabels, Counter>,
    pub bytes_to_master: Counter,
    pub bytes_to_client: Counter,
    /// 1 while the upstream master answers `ServiceReady` (the admin's probe).
    pub upstream_ready: Gauge,
    /// Per [`Method::index`]: `(batches split, parts sent)`.
    splits: Vec<(Counter, Counter)>,
    /// Bodies relayed undecoded because their type code names no layout moongate knows.
    unknown_codes: Family<UnknownCodeLabels, Counter>,
    /// (method, side, code) already logged: one WARN each.
    warned_codes: std::sync::Mutex<std::collections::HashSet<(Method, bool, u32)>>,
    /// Per [`Schema`]: client connections whose calls identified that release (open
    /// now, and since start).
    schema_connections: [Gauge; 3],
    schema_identified: [Counter; 3],
    /// Answers with a 0.3.14 compatible section that moongate changed, sent without it.
    pub compat_sections_dropped: Counter,
    /// Fields a policy set that a client's release cannot carry (left out).
    fields_dropped: Family<DroppedLabels, Counter>,
    warned_fields: std::sync::Mutex<std::collections::HashSet<(&'static str, Schema)>>,
    /// Connections by the release of each side: `[client schema]`, `[master release]`.
    peer_client: [Gauge; 3],
    peer_master: [Gauge; 4],
    /// Calls re-encoded from the client's release to the master's (answers back).
    pub bridged: Counter,
    /// Release probes sent (one `GetReplicaList` per upstream connection).
    pub release_probes: Counter,
    /// Calls refused because their layout differs from the master's and
    /// `master_face.bridge` is off, by method.
    skew_refused: Family<BridgeMethodLabel, Counter>,

    /// Answers that the client's release cannot carry, by method (answered with an
    /// error instead).
    untranslatable: Family<BridgeMethodLabel, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UnknownCodeLabels {
    method: &'static str,
    side: Side,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SchemaLabel {
    schema: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BridgeMethodLabel {
    method: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PeerReleaseLabels {
    side: &'static str,
    release: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DroppedLabels {
    field: &'static str,
    schema: &'static str,
}

impl MasterFaceMetrics {
    /// Registers every master-face family in `registry`.
    pub fn register(registry: &mut Registry) -> MasterFaceMetrics {
        let requests = Family::<MethodLabel, Counter>::default();
        let errors = Family::<ErrorLabels, Counter>::default();
        let latency = Family::<MethodLabel, Histogram>::new_with_constructor(|| {
            Histogram::new(LATENCY_BUCKETS)
        });
        let names = Method::ALL
            .iter()
            .map(|m| m.name())
            .chain(std::iter::once("unknown"));
        let methods = names
            .map(|name| {
                let l = MethodLabel {
                    method: name.to_string(),
                };
                MethodMetrics {
                    requests: requests.get_or_create(&l).clone(),
                    latency: latency.get_or_create(&l).clone(),
                    errors: ERROR_KINDS.map(|kind| {
                        errors
                            .get_or_create(&ErrorLabels {
                                method: name.to_string(),
                                kind,
                            })
                            .clone()
                    }),
                }
            })
            .collect();
        registry.register(
            "moongate_master_requests",
            "Requests received on the master face, by method",
            requests,
        );
        registry.register(
            "moongate_master_errors",
            "Failed calls by method and kind (rpc: transport error reply; app: ErrorCode in \
             the reply, per failed key for batch calls; decode: typed frame that did not decode)",
            errors,
        );
        registry.register(
            "moongate_master_request_duration_seconds",
            "Time from forwarding a request to the master until its reply arrived",
            latency,
        );
        let outcomes = Family::<OutcomeLabel, Counter>::default();
        let conn_outcomes = [
            ConnOutcome::accepted,
            ConnOutcome::rejected_limit,
            ConnOutcome::upstream_failed,
        ]
        .map(|outcome| outcomes.get_or_create(&OutcomeLabel { outcome }).clone());
        registry.register(
            "moongate_master_connections",
            "Client connections by outcome",
            outcomes,
        );
        let held_family = Family::<[(&'static str, &'static str); 1], Counter>::default();
        let held =
            ["connected", "closed"].map(|r| held_family.get_or_create(&[("result", r)]).clone());
        registry.register(
            "moongate_master_connections_held",
            "Client connections that arrived while no HA leader served and were held \
             for one (master_face.failover_hold_ms): connected, reached a leader; closed, \
             none served within the hold",
            held_family,
        );
        let close_family = Family::<CloseLabel, Counter>::default();
        let closes =
            CLOSE_REASONS.map(|reason| close_family.get_or_create(&CloseLabel { reason }).clone());
        registry.register(
            "moongate_master_connections_closed",
            "Served client connections by why they ended",
            close_family,
        );
        let connections_open = Gauge::default();
        registry.register(
            "moongate_master_connections_open",
            "Client connections currently open on the master face",
            connections_open.clone(),
        );
        let upstream_connections_open = Gauge::default();
        registry.register(
            "moongate_upstream_connections_open",
            "Connections currently open to the upstream master (one per client connection)",
            upstream_connections_open.clone(),
        );
        let frame_errors = Family::<FrameErrorLabels, Counter>::default();
        registry.register(
            "moongate_master_frame_errors",
            "Bad frames by side and kind; bad_header and too_large close the connection",
            frame_errors.clone(),
        );
        let bytes = Family::<DirectionLabel, Counter>::default();
        let bytes_to_master = bytes
            .get_or_create(&DirectionLabel {
                direction: Direction::to_master,
            })
            .clone();
        let bytes_to_client = bytes
            .get_or_create(&DirectionLabel {
                direction: Direction::to_client,
            })
            .clone();
        registry.register(
            "moongate_master_bytes",
            "Bytes relayed on the master face",
            bytes,
        );
        let upstream_ready = Gauge::default();
        registry.register(
            "moongate_upstream_ready",
            "1 while the upstream master answers ServiceReady, else 0",
            upstream_ready.clone(),
        );
        let split_batches = Family::<MethodLabel, Counter>::default();
        let split_parts = Family::<MethodLabel, Counter>::default();
        let splits = Method::ALL
            .iter()
            .map(|m| {
                let l = MethodLabel {
                    method: m.name().to_string(),
                };
                (
                    split_batches.get_or_create(&l).clone(),
                    split_parts.get_or_create(&l).clone(),
                )
            })
            .collect();
        registry.register(
            "moongate_batch_splits",
            "Batch calls sent to the master as several bounded parts (max_batch_keys or a \
             plugin's split points) and answered as one merged reply",
            split_batches,
        );
        registry.register(
            "moongate_batch_parts",
            "Parts sent to the master for split batch calls",
            split_parts,
        );
        let unknown_codes = Family::<UnknownCodeLabels, Counter>::default();
        registry.register(
            "moongate_master_unknown_type_codes",
            "Bodies relayed undecoded because their struct_pack type code names no layout \
             moongate knows (a Mooncake release it does not support), by method and side",
            unknown_codes.clone(),
        );
        let by_schema = Family::<SchemaLabel, Gauge>::default();
        registry.register(
            "moongate_master_connections_by_schema",
            "Client connections by the Mooncake release their calls' layouts identify \
             (0.3.13 includes 0.3.14; a connection counts once it sent an identifying call, \
             or from the start when its process showed it: an earlier connection's calls, \
             or the wheel it loaded)",
            by_schema.clone(),
        );
        let schema_connections = Schema::ALL.map(|s| {
            by_schema
                .get_or_create(&SchemaLabel { schema: s.label() })
                .clone()
        });
        let identified = Family::<SchemaLabel, Counter>::default();
        registry.register(
            "moongate_master_connections_identified",
            "Client connections whose calls (or process) identified a Mooncake release, \
             since start",
            identified.clone(),
        );
        let schema_identified = Schema::ALL.map(|s| {
            identified
                .get_or_create(&SchemaLabel { schema: s.label() })
                .clone()
        });
        let fields_dropped = Family::<DroppedLabels, Counter>::default();
        registry.register(
            "moongate_policy_fields_dropped",
            "Fields a policy set that the client's Mooncake release cannot carry, left out \
             of the call sent upstream (e.g. soft_pin_ttl_ms for 0.3.12), by field and release",
            fields_dropped.clone(),
        );
        let compat_sections_dropped = Counter::default();
        registry.register(
            "moongate_master_compat_sections_dropped",
            "Master answers with a struct_pack compatible section (Mooncake 0.3.14) that \
             moongate changed (steering, merged denials, reencode = always) and sent in the \
             0.3.13 layout, without the section",
            compat_sections_dropped.clone(),
        );
        let peer = Family::<PeerReleaseLabels, Gauge>::default();
        registry.register(
            "moongate_peer_release",
            "Master-face connections by the Mooncake release of each side: side=client (from \
             its calls' layouts, once one identified it; 0.3.13 includes 0.3.14) and \
             side=master (probed at connect, or master_face.upstream_release)",
            peer.clone(),
        );
        let peer_client = Schema::ALL.map(|s| {
            peer.get_or_create(&PeerReleaseLabels {
                side: "client",
                release: s.label(),
            })
            .clone()
        });
        let peer_master = MasterRelease::ALL.map(|r| {
            peer.get_or_create(&PeerReleaseLabels {
                side: "master",
                release: r.label(),
            })
            .clone()
        });
        let release_probes = Counter::default();
        registry.register(
            "moongate_master_release_probes",
            "Release probes sent to the master: one GetReplicaList of a key no client \
             writes per upstream connection (master_face.upstream_release = auto); the \
             master counts them among its GetReplicaList calls",
            release_probes.clone(),
        );
        let bridged = Counter::default();
        registry.register(
            "moongate_bridge_translated",
            "Calls re-encoded from the client's Mooncake release to the master's (and their \
             answers back): the two sides' releases differ and master_face.bridge is on",
            bridged.clone(),
        );
        let skew_refused = Family::<BridgeMethodLabel, Counter>::default();
        registry.register(
            "moongate_bridge_skew_refused",
            "Calls answered with an error because the client's release lays them (or their \
             answers) out differently from the master's and master_face.bridge is off, by \
             method (relayed, the master would fail them without a word to either side)",
            skew_refused.clone(),
        );

        let untranslatable = Family::<BridgeMethodLabel, Counter>::default();
        registry.register(
            "moongate_bridge_untranslatable",
            "Master answers the client's release cannot carry without losing meaning (a DFS \
             replica for a client before 0.3.13), answered with an error instead, by method",
            untranslatable.clone(),
        );
        MasterFaceMetrics {
            release_probes,
            peer_client,
            peer_master,
            bridged,
            skew_refused,
            untranslatable,
            compat_sections_dropped,
            unknown_codes,
            warned_codes: Default::default(),
            schema_connections,
            schema_identified,
            fields_dropped,
            warned_fields: Default::default(),
            methods,
            connections_open,
            upstream_connections_open,
            conn_outcomes,
            held,
            closes,
            frame_errors,
            bytes_to_master,
            bytes_to_client,
            upstream_ready,
            splits,
        }
    }

    /// Counts a body relayed undecoded for its unknown type `code`; logs it once per
    /// (method, side, code).
    pub fn unknown_type_code(&self, method: Method, side: Side, code: u32) {
        self.unknown_codes
            .get_or_create(&UnknownCodeLabels {
                method: method.name(),
                side,
            })
            .inc();
        let first = self
            .warned_codes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert((method, side == Side::upstream, code));
        if first {
            tracing::warn!(%method, side = ?side, code = format_args!("{code:#010x}"),
                "type code of no known Mooncake release: relayed undecoded, no policy runs on it");
        }
    }

    /// A connection identified as `now` (was `before`).
    pub fn schema_seen(&self, before: Option<Schema>, now: Schema) {
        if let Some(b) = before {
            self.schema_connections[b as usize].dec();
            self.peer_client[b as usize].dec();
        }
        self.schema_connections[now as usize].inc();
        self.peer_client[now as usize].inc();
        self.schema_identified[now as usize].inc();
    }

    /// A connection identified as `s` closed.
    pub fn schema_gone(&self, s: Schema) {
        self.schema_connections[s as usize].dec();
        self.peer_client[s as usize].dec();
    }

    /// A connection's master is `r` (until [`Self::master_gone`]).
    pub fn master_seen(&self, r: MasterRelease) {
        self.peer_master[r as usize].inc();
    }

    pub fn master_gone(&self, r: MasterRelease) {
        self.peer_master[r as usize].dec();
    }

    /// Counts a call of `method` refused for release skew.
    pub fn skew_refused(&self, method: Method) {
        self.skew_refused
            .get_or_create(&BridgeMethodLabel {
                method: method.name(),
            })
            .inc();
    }

    /// Counts an answer of `method` the client's release cannot carry.
    pub fn untranslatable(&self, method: Method) {
        self.untranslatable
            .get_or_create(&BridgeMethodLabel {
                method: method.name(),
            })
            .inc();
    }

    /// Client connections per identified release, in [`Schema::ALL`] order: open now,
    /// and identified since start.
    pub fn schema_counts(&self) -> ([i64; 3], [u64; 3]) {
        (
            self.schema_connections.each_ref().map(Gauge::get),
            self.schema_identified.each_ref().map(Counter::get),
        )
    }

    /// Counts policy-set fields left out for a client of release `schema`; logs each
    /// (field, release) once.
    pub fn fields_dropped(&self, fields: &[&'static str], schema: Schema) {
        for &field in fields {
            self.fields_dropped
                .get_or_create(&DroppedLabels {
                    field,
                    schema: schema.label(),
                })
                .inc();
            let first = self
                .warned_fields
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert((field, schema));
            if first {
                tracing::warn!(
                    field,
                    release = schema.label(),
                    "a policy set a field this client's Mooncake release cannot carry; left out"
                );
            }
        }
    }

    /// Handles of `method`; `None` = an unknown function id.
    pub fn method(&self, method: Option<Method>) -> &MethodMetrics {
        let i = method.map_or(METHOD_COUNT, Method::index);
        &self.methods[i]
    }

    /// Counts one batch call of `method` sent upstream as `parts` parts.
    pub fn split(&self, method: Method, parts: usize) {
        let (b, p) = &self.splits[method.index()];
        b.inc();
        p.inc_by(parts as u64);
    }

    pub fn connection(&self, outcome: ConnOutcome) {
        self.conn_outcomes[outcome as usize].inc();
    }

    /// Counts a client connection that was held for a leader: it reached one
    /// (`true`) or was closed.
    pub fn held(&self, connected: bool) {
        self.held[usize::from(!connected)].inc();
    }

    /// Counts a served connection's end.
    pub fn closed(&self, reason: CloseReason) {
        self.closes[reason as usize].inc();
    }

    /// Rare by nature (a connection closes right after), so a label lookup is fine here.
    pub fn frame_error(&self, side: Side, kind: FrameErrorKind) {
        self.frame_errors
            .get_or_create(&FrameErrorLabels { side, kind })
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::FrameError;

    #[test]
    fn frame_errors_are_labelled_by_what_went_wrong() {
        let large = FrameError::TooLarge { len: 10, max: 1 };
        assert_eq!(FrameErrorKind::of(&large), FrameErrorKind::too_large);
        for e in [
            FrameError::BadMagic(0),
            FrameError::UnsupportedVersion(1),
            FrameError::UnsupportedSerializeType(2),
        ] {
            assert_eq!(FrameErrorKind::of(&e), FrameErrorKind::bad_header);
        }
    }
}

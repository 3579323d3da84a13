//! One client connection's protocol state, with no I/O and no clocks (the caller passes
//! the time): the in-flight queue, seq matching, answers moongate gives itself, the
//! merge of split batches, and what happens to each frame on its way.
//!
//! [`super::connection`] is the tokio shell around it: it reads bytes, cuts frames,
//! feeds them in with [`Session::handle_request`] / [`Session::handle_response`], and
//! writes what [`Session::poll_to_master`] / [`Session::poll_to_client`] hand out.
//!
//! Phase order for a request: classify (method) -> decode (typed methods; a body that
//! does not decode is relayed as is) -> decide ([`crate::policy::decision`]: put family
//! through the plugin; other calls get the arm that serves them) -> queue an entry ->
//! forward (received bytes, re-encoded rewrite, or bounded parts of a batch: [`split`])
//! or answer locally (every key denied; the answer goes out when its turn comes).
//!
//! For a response: match seq (the master answers in request order; the parts of a split
//! batch come back to back and the entry leaves with the last) -> decode -> record for
//! eviction -> merge denied keys back -> steer lookups -> tally tiers -> finish (arm
//! metrics, guardrail, the plugin's `observe`) -> forward.
//!
//! The queue is bounded by `master_face.max_inflight_per_connection`: the shell asks
//! [`Session::has_room`] before it hands in a request and stops reading the client when
//! there is none (backpressure; a request is never failed for it).
//!
//! [`split`]: super::split

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};

use super::Shared;
use super::config::Reencode;
use super::metrics::{FrameErrorKind, Side};
use super::split::{self, InFlightBytes, Merge, Merged};
use crate::calls::offload::Offload;
use crate::calls::{self, AnswerExt, CallExt, Tracked};
use crate::codec::frame::errc;
use crate::codec::keys::Keys;
use crate::codec::message::{ExistCounts, Request, Response, RpcError, is_typed};
use crate::codec::release::MasterRelease;
use crate::codec::types::{ErrorCode, Uuid};
use crate::codec::{
    BodyStyle, DecodeError, Method, RequestFrame, RequestHeader, ResponseFrame, ResponseHeader,
    Schema, older,
};
use crate::per_method::{ErrorKind, MethodMetrics};
use crate::policy::{Fixup, Outcome, Sending, Ticket};
use crate::topology::{LookupRole, Peer};

/// What the session keeps of a forwarded call until its answer arrives.
pub struct Entry {
    /// The set and arm that serve it (kept alive until the answer: a swap meanwhile
    /// changes nothing for this call).
    pub ticket: Ticket,
    pub fixup: Option<Fixup>,
    /// The keys of a lookup (or of an existence check sent as one), moved out of the
    /// decoded request: what the arm's plugin steers and what the answer served.
    pub lookup_keys: Option<Keys>,
    /// Their tenant.
    pub lookup_tenant: Bytes,
    /// The arm's plugin steers the answer (`on-lookup`).
    pub steer: bool,
    /// Upstream calls this request went out as (1 unless a batch was split).
    pub parts: usize,
    /// The put bytes this call holds in the node-wide in-flight count until it ends.
    pub in_flight: Option<InFlightBytes>,
    /// What the answer tells the eviction table (eviction on). Boxed: most nodes run
    /// without eviction, and every call's entry is moved in and out of the queue.
    pub tracked: Option<Box<Tracked>>,
    /// An existence check sent as the replica lookup of its keys (for the arm's
    /// plugin to steer): the client's method, whose answer it gets.
    pub exist: Option<Method>,
    /// The call was translated into the master's release: its answer goes back in
    /// this (the client's) style.
    pub client_style: Option<BodyStyle>,
}

/// A request not yet answered to the client, in request order.
// Entries live in a bounded per-connection queue; boxing them would cost an allocation
// per call.
#[allow(clippy::large_enum_variant)]
enum InFlight {
    Upstream {
        seq: u32,
        method: Option<Method>,
        sent: Instant,
        entry: Option<Entry>,
        /// An offload-family call, read on its way: applied when the master accepts it.
        offload: Option<Box<Offload>>,
        /// A removal that can take leased values: the places epoch advances again at
        /// its answer.
        voids: bool,
    },
    /// Answered by moongate: these bytes go to the client when its turn comes.
    Local(Bytes),
}

/// The protocol state of one client connection and its upstream connection.
pub struct Session {
    shared: Arc<Shared>,
    /// The process (or address) behind this connection, shared by its other
    /// connections.
    peer: Arc<Peer>,
    queue: VecDeque<InFlight>,
    /// The Mooncake client id, once a request carried it: a connection belongs to one
    /// client process, so by-client arms hold for the calls that do not carry it.
    client: Option<Uuid>,
    /// The Mooncake release this connection's calls identified, once one did.
    schema: Option<Schema>,
    /// The master's release, when known (probed at connect, or configured).
    master: Option<MasterRelease>,
    /// The releases differ and that was logged (once per connection).
    skew_logged: bool,
    /// `master_face.client_release`, parsed once: what an unidentified client runs.
    client_default: Option<Schema>,
    merge: Merge,
    to_master: BytesMut,
    to_client: BytesMut,
}

impl Drop for Session {
    fn drop(&mut self) {
        if let Some(s) = self.schema {
            self.shared.metrics.schema_gone(s);
        }
        if let Some(r) = self.master {
            self.shared.metrics.master_gone(r);
        }
        // A removal left unanswered may still land at the master.
        let removing = self
            .queue
            .iter()
            .any(|f| matches!(f, InFlight::Upstream { voids: true, .. }));
        if removing {
            self.shared.upstream.removal_relayed();
        }
    }
}

impl Session {
    pub fn new(shared: Arc<Shared>, peer: Arc<Peer>) -> Session {
        let client_default = shared.cfg.fixed_client_schema();
        // What the process showed before (an earlier connection's calls, or the wheel
        // it loaded) counts this connection under its release from the start.
        let schema = peer.release();
        if let Some(s) = schema {
            shared.metrics.schema_seen(None, s);
        }
        Session {
            shared,
            peer,
            queue: VecDeque::new(),
            client: None,
            schema,
            master: None,
            skew_logged: false,
            client_default,
            merge: Merge::default(),
            to_master: BytesMut::with_capacity(64 << 10),
            to_client: BytesMut::with_capacity(64 << 10),
        }
    }

    /// Whether another request may be handed in (the in-flight bound).
    /// The master's release (calls and answers are translated when a client's
    /// differs, `master_face.bridge`).
    pub fn with_master(mut self, r: Option<MasterRelease>) -> Session {
        if let Some(r) = r {
            self.shared.metrics.master_seen(r);
        }
        self.master = r;
        self
    }

    pub fn has_room(&self) -> bool {
        self.queue.len() < self.shared.cfg.max_inflight_per_connection
    }

    /// Requests not yet answered to the client.
    pub fn in_flight(&self) -> usize {
        self.queue.len()
    }

    /// When the oldest call still waiting for the master's answer arrived, if any.
    pub fn oldest_unanswered(&self) -> Option<Instant> {
        self.queue.iter().find_map(|e| match e {
            InFlight::Upstream { sent, .. } => Some(*sent),
            InFlight::Local(_) => None,
        })
    }

    /// Whether bytes wait for the client (a local answer due now).
    pub fn has_output_for_client(&self) -> bool {
        !self.to_client.is_empty()
    }

    /// The bytes gathered for the master since the last poll, if any.
    pub fn poll_to_master(&mut self) -> Option<Bytes> {
        (!self.to_master.is_empty()).then(|| self.to_master.split().freeze())
    }

    /// The bytes gathered for the client since the last poll, if any.
    pub fn poll_to_client(&mut self) -> Option<Bytes> {
        (!self.to_client.is_empty()).then(|| self.to_client.split().freeze())
    }

    /// Moves the local answers at the head of the queue to the client's bytes.
    fn drain_local(&mut self) {
        while let Some(InFlight::Local(_)) = self.queue.front() {
            if let Some(InFlight::Local(b)) = self.queue.pop_front() {
                self.to_client.extend_from_slice(&b);
            }
        }
    }

    /// Handles one whole client request (`raw`: its bytes as received) that arrived at
    /// `now`. The caller checked [`Session::has_room`].
    pub fn handle_request(&mut self, frame: &RequestFrame, raw: &Bytes, now: Instant) {
        let method = Method::from_function_id(frame.header.function_id);
        // Replica lists moongate keeps (the kv face's) stop holding now, and again at
        // the answer (a lookup the master served just before the removal).
        let voids = method.is_some_and(|m| calls::remove::voids_places(m, &frame.body));
        if voids {
            self.shared.upstream.removal_relayed();
        }
        let upstream = |entry, offload| InFlight::Upstream {
            seq: frame.header.seq_num,
            method,
            sent: now,
            entry,
            offload,
            voids,
        };
        let next = on_request(
            &self.shared,
            &mut self.to_master,
            (&self.peer, &mut self.client, &mut self.schema),
            (self.master, self.client_default, &mut self.skew_logged),
            frame,
            raw,
            method,
        );
        let refused = matches!(next, Next::Refused(_));
        self.queue.push_back(match next {
            Next::Relayed => upstream(None, None),
            Next::Offload(call) => upstream(None, Some(call)),
            Next::Forwarded(entry) if entry.exist.is_some() => InFlight::Upstream {
                seq: frame.header.seq_num,
                // The answer comes in the lookup's layout.
                method: method.map(exist_as_lookup),
                sent: now,
                entry: Some(entry),
                offload: None,
                voids,
            },
            Next::Forwarded(entry) => upstream(Some(entry), None),
            Next::Answered(bytes) => InFlight::Local(bytes),
            Next::Refused(bytes) => {
                self.shared.topology.skew_refused(&self.peer);
                InFlight::Local(bytes)
            }
        });
        // Only a data call that went through shows the client works (its Pings and
        // ServiceReady pass whatever the releases).
        if !refused && method.is_some_and(moves_data) {
            self.peer.data_call_passed();
        }
        // A local answer with nothing before it goes out at once.
        self.drain_local();
    }

    /// Handles one whole master response (`raw`: its bytes as received) that arrived at
    /// `now`.
    pub fn handle_response(&mut self, frame: &ResponseFrame, raw: &Bytes, now: Instant) {
        // Answers moongate gave itself for earlier requests go first.
        self.drain_local();
        let seq = frame.header.seq_num;
        // The answers to the parts of a split batch come back to back; the entry leaves
        // the queue with the last one.
        let split = match self.queue.front() {
            Some(InFlight::Upstream {
                seq: s,
                method: Some(method),
                entry: Some(e),
                ..
            }) if e.parts > 1 && *s == seq => Some((e.parts, *method)),
            _ => None,
        };
        if let Some((parts, method)) = split {
            self.merge.add(method, frame, raw);
            if self.merge.got < parts {
                return;
            }
        }
        match self.queue.pop_front() {
            Some(InFlight::Upstream {
                seq: s,
                method,
                sent,
                entry,
                offload,
                voids,
            }) if s == seq => {
                if let Some(call) = offload {
                    self.offloaded(&call, frame);
                }
                if voids {
                    self.shared.upstream.removal_relayed();
                }
                let latency = now.saturating_duration_since(sent);
                // Counted under the method the client called.
                let shown = entry.as_ref().and_then(|e| e.exist).or(method);
                self.shared
                    .metrics
                    .method(shown)
                    .latency
                    .observe(latency.as_secs_f64());
                let a = Answering::new(
                    method,
                    shown,
                    entry.as_ref(),
                    latency,
                    &self.shared,
                    &self.peer,
                );
                if split.is_some() {
                    match std::mem::take(&mut self.merge).finish(seq) {
                        Merged::Failed(bytes) => {
                            let err_code =
                                bytes.get(2).copied().unwrap_or(errc::RPC_THROW_EXCEPTION);
                            let body = bytes.slice(bytes.len().min(16)..);
                            a.transport_error(err_code, &body);
                            self.to_client.extend_from_slice(&bytes);
                        }
                        Merged::Reply(resp, style) => {
                            let header = ResponseHeader::new(seq, errc::OK, 0);
                            a.reply(
                                resp,
                                style,
                                header,
                                &Bytes::new(),
                                None,
                                &mut self.to_client,
                            );
                        }
                    }
                } else {
                    a.response(frame, raw, &mut self.to_client);
                }
            }
            other => {
                // Not what the master does; relay and let the client judge (it closes the
                // connection on a seq it does not know). The popped entry is dropped: its
                // call will never be answered in order.
                self.merge = Merge::default();
                self.shared
                    .metrics
                    .frame_error(Side::upstream, FrameErrorKind::unmatched_seq);
                let expected = match &other {
                    Some(InFlight::Upstream { seq, .. }) => Some(*seq),
                    _ => None,
                };
                tracing::warn!(seq, expected, "response out of request order");
                self.to_client.extend_from_slice(raw);
            }
        }
        self.drain_local();
    }
}

impl Session {
    /// The master's answer to an owner's offload-family call: what it changed.
    fn offloaded(&self, call: &Offload, frame: &ResponseFrame) {
        let ok = frame.header.err_code == errc::OK;
        let topo = &self.shared.topology;
        if let Offload::Heartbeat { .. } = call {
            topo.offload_call(&self.peer, call, ok);
            if let Some(items) = ok.then(|| calls::offload::tasks(&frame.body)).flatten() {
                topo.offload_tasks(&items);
            }
            return;
        }
        let ok = ok && calls::offload::answered_ok(&frame.body);
        tracing::debug!(?call, ok, "offload call answered");
        let reached_disk = topo.offload_call(&self.peer, call, ok);
        if let (Some(ev), false) = (&self.shared.eviction, reached_disk.is_empty()) {
            ev.offloaded(&reached_disk);
        }
    }
}

/// What became of one request (moved once into the queue: not boxed).
#[allow(clippy::large_enum_variant)]
enum Next {
    /// Not decoded: relayed as received, nothing to remember.
    Relayed,
    /// An offload-family call, relayed as received and read on the way.
    Offload(Box<Offload>),
    /// Forwarded (as received, rewritten or split); its answer needs the entry.
    Forwarded(Entry),
    /// Answered by moongate: these bytes go to the client when its turn comes.
    Answered(Bytes),
    /// Refused for release skew (`master_face.bridge` off): answered like `Answered`.
    Refused(Bytes),
}

/// Decodes, decides and forwards one request (what goes upstream is appended to `out`).
fn on_request(
    shared: &Shared,
    out: &mut BytesMut,
    (peer, client, schema): (&Peer, &mut Option<Uuid>, &mut Option<Schema>),
    (master, client_default, skew_logged): (Option<MasterRelease>, Option<Schema>, &mut bool),
    frame: &RequestFrame,
    raw: &Bytes,
    method: Option<Method>,
) -> Next {
    let m = shared.metrics.method(method);
    m.requests.inc();
    let Some((req, style)) = decode_request(shared, frame, method, m) else {
        out.extend_from_slice(raw);
        // Owners' offload calls are read (never changed) on their way.
        if let Some(call) = method.and_then(|m| calls::offload::request(m, &frame.body)) {
            return Next::Offload(Box::new(call));
        }
        return Next::Relayed;
    };
    if let Some(s) = older::identifies(req.method(), style.schema)
        && *schema != Some(s)
    {
        shared.metrics.schema_seen(*schema, s);
        *schema = Some(s);
        peer.saw_release(s);
    }
    let (up, answer_style) = match bridge(
        shared,
        (&req, style, &frame.body),
        master,
        schema.or_else(|| peer.release()).or(client_default),
        skew_logged,
    ) {
        Bridge::Same => (None, None),
        Bridge::Translate { up, answer } => (Some(up), Some(answer)),
        Bridge::Refuse { client, master } => {
            shared.metrics.skew_refused(req.method());
            m.error(ErrorKind::rpc, 1);
            return Next::Refused(skew_refusal(
                frame.header.seq_num,
                req.method(),
                client,
                master,
            ));
        }
    };
    let got = Received {
        frame,
        raw,
        style,
        up,
    };
    if let Some(id) = req.client_id() {
        *client = Some(id);
        peer.saw_client(id);
    }
    match &req {
        Request::MountSegment(a) => shared.topology.mounted(std::slice::from_ref(&a.segment)),
        Request::ReMountSegment(a) => shared.topology.mounted(&a.segments),
        _ => {}
    }
    // Arms are assigned by the process behind the connection when it is known, so a
    // rank's calls land in one arm whether or not they carry its client id.
    let who = peer.assign.or(*client);
    let policy = &shared.policy;
    let set = policy.current();
    let d = policy.decide(&set, &req, who.as_ref());
    if !d.by_plugin() {
        let ticket = d.into_ticket();
        let arm = ticket.arm();
        arm.metrics.requests[req.method().index()].requests.inc();
        let steer = policy.steers_lookups(arm);
        let (is_lookup, as_lookup) = match calls::call(&req) {
            calls::Call::Lookup(_) => (true, None),
            calls::Call::Exist(_) if steer && shared.cfg.steer_exists => {
                (false, calls::exist::as_lookup(&req))
            }
            _ => (false, None),
        };
        let parts = match &as_lookup {
            Some(lookup) => {
                let frame = RequestFrame {
                    header: RequestHeader {
                        function_id: lookup.method().function_id(),
                        ..frame.header
                    },
                    body: frame.body.clone(),
                    attachment: frame.attachment.clone(),
                };
                let got = Received {
                    frame: &frame,
                    raw,
                    style,
                    up,
                };
                forward(shared, out, &got, lookup, true, &ticket)
            }
            None => forward(shared, out, &got, &req, false, &ticket),
        };
        let mut e = entry(shared, ticket, None, parts, &req);
        e.client_style = answer_style;
        e.exist = as_lookup.as_ref().map(|_| req.method());
        if is_lookup || as_lookup.is_some() {
            // The decoded request is done with: its keys move, uncloned.
            if let Some((tenant, keys)) = lookup_keys(req) {
                e.lookup_keys = Some(keys);
                e.lookup_tenant = tenant;
                e.steer = steer;
            }
        }
        return Next::Forwarded(e);
    }
    let am = &set.arms[d.ticket().arm].metrics.requests[req.method().index()];
    am.requests.inc();
    if let Some(f) = d.refused() {
        note_refused(
            shared,
            &req,
            f.denied.iter().map(|(i, _)| *i),
            d.ticket().arm,
        );
    }
    match d.send(req) {
        Sending::Upstream {
            ticket,
            request,
            rewritten,
            fixup,
        } => {
            let parts = forward(shared, out, &got, &request, rewritten, &ticket);
            // Tracked from what went upstream: the table records the master's answer
            // to it, before denied keys are merged back (moongate's denials are not
            // memory pressure).
            let mut e = entry(shared, ticket, fixup, parts, &request);
            e.client_style = answer_style;
            Next::Forwarded(e)
        }
        Sending::Answered { answer, .. } => {
            let denied = answer.error_count() as u64;
            m.error(ErrorKind::app, denied);
            am.error(ErrorKind::app, denied);
            let mut body = BytesMut::new();
            answer.encode_body(style, &mut body);
            let mut bytes = BytesMut::with_capacity(16 + body.len());
            ResponseFrame {
                header: ResponseHeader::new(frame.header.seq_num, errc::OK, 0),
                body: body.freeze(),
                attachment: Bytes::new(),
            }
            .write(&mut bytes);
            Next::Answered(bytes.freeze())
        }
    }
}

/// What the master's own answer says of keys on owners' SSDs (their usage).
fn follow_ssd(shared: &Shared, e: &Entry, resp: &Response) {
    let topo = &shared.topology;
    if let (Some(keys), Some(answers)) = (&e.lookup_keys, calls::lookup::results(resp)) {
        topo.ssd_lookup(&e.lookup_tenant, keys, answers);
    } else if let Some(t) = e.tracked.as_deref().filter(|t| t.is_remove()) {
        for seen in t.seen(resp) {
            match seen {
                calls::Seen::Removed(keys) => {
                    topo.ssd_removed(keys.iter().map(|k| (&t.tenant[..], &k[..])))
                }
                calls::Seen::Cleared => topo.ssd_cleared(&t.tenant),
                _ => {}
            }
        }
    }
}

/// Tells the eviction history which keys of a put a policy denied (they never reach
/// the master, so no answer will say so).
fn note_refused(
    shared: &Shared,
    req: &Request,
    positions: impl Iterator<Item = usize>,
    arm: usize,
) {
    let (Some(ev), Some(put)) = (&shared.eviction, calls::put::Put::of(req)) else {
        return;
    };
    let keys = put.keys();
    let denied: Vec<&Bytes> = positions.filter_map(|i| keys.get(i)).collect();
    if !denied.is_empty() {
        ev.refused(put.tenant(), &denied, arm);
    }
}

fn entry(
    shared: &Shared,
    ticket: Ticket,
    fixup: Option<Fixup>,
    parts: usize,
    sent: &Request,
) -> Entry {
    Entry {
        ticket,
        fixup,
        lookup_keys: None,
        lookup_tenant: Bytes::new(),
        steer: false,
        parts,
        in_flight: put_bytes(sent, shared),
        tracked: (shared.eviction.is_some()
            || (shared.topology.ssd_tracking() && calls::remove::is_remove(sent.method())))
        .then(|| Tracked::of(sent))
        .flatten()
        .map(Box::new),
        exist: None,
        client_style: None,
    }
}

/// The tenant and keys of a lookup or existence check, moved out of it.
fn lookup_keys(req: Request) -> Option<(Bytes, Keys)> {
    match req {
        Request::GetReplicaList(a) | Request::ExistKey(a) => Some((a.tenant_id, Keys::one(a.key))),
        Request::BatchGetReplicaList(a) | Request::BatchExistKey(a) => Some((a.tenant_id, a.keys)),
        _ => None,
    }
}

/// The lookup an existence check goes upstream as (see `steer_exists`).
fn exist_as_lookup(m: Method) -> Method {
    match m {
        Method::ExistKey => Method::GetReplicaList,
        Method::BatchExistKey => Method::BatchGetReplicaList,
        other => other,
    }
}

/// A request as it arrived: its frame, its bytes, and the body style to re-encode in.
struct Received<'a> {
    frame: &'a RequestFrame,
    raw: &'a Bytes,
    style: BodyStyle,
    /// The master's layout, when the call is translated into it (the releases differ).
    up: Option<BodyStyle>,
}

/// Calls that store, find or remove values (not the connection's own upkeep).
fn moves_data(m: Method) -> bool {
    use Method::*;
    matches!(
        m,
        PutStart
            | PutEnd
            | PutRevoke
            | BatchPutStart
            | BatchPutEnd
            | BatchPutRevoke
            | UpsertStart
            | UpsertEnd
            | BatchUpsertStart
            | BatchUpsertEnd
            | GetReplicaList
            | BatchGetReplicaList
            | ExistKey
            | BatchExistKey
            | Remove
    )
}

/// What the two sides' releases mean for one call.
#[derive(Clone, Copy)]
enum Bridge {
    /// Same layouts (or the master's release unknown): as usual.
    Same,
    /// Re-encoded in `up` (the master's style); the answer goes back in `answer`.
    Translate { up: BodyStyle, answer: BodyStyle },
    /// The layouts differ and `master_face.bridge` is off: refused with this message.
    Refuse {
        client: Schema,
        master: MasterRelease,
    },
}

/// Whether the releases' layouts differ for this call: its own (by type code: the
/// call encoded in the master's layout keeps its code, or not) or its answer's (the
/// answers naming replicas changed at 0.3.13).
fn layouts_differ(req: &Request, style: BodyStyle, body: &Bytes, c: Schema, m: Schema) -> bool {
    let answer_changed = matches!(
        req.method(),
        Method::PutStart
            | Method::UpsertStart
            | Method::BatchPutStart
            | Method::BatchUpsertStart
            | Method::GetReplicaList
            | Method::BatchGetReplicaList
    ) && ((c == Schema::V0_3_13) != (m == Schema::V0_3_13));
    if answer_changed || style.schema == m {
        return answer_changed;
    }
    let mut out = BytesMut::new();
    req.encode_body(BodyStyle { schema: m, ..style }, &mut out);
    older::code_of(&out) != older::code_of(body)
}

/// What to do with a call in `style` from a client known as `client` (what its
/// connection or process identified, else `master_face.client_release`); logs a
/// difference once per connection.
fn bridge(
    shared: &Shared,
    (req, style, body): (&Request, BodyStyle, &Bytes),
    master: Option<MasterRelease>,
    client: Option<Schema>,
    logged: &mut bool,
) -> Bridge {
    let Some(m) = master else {
        return Bridge::Same;
    };
    // A call in 0.3.13's layout may come from a 0.3.12 client (lookups did not change):
    // its process, or the configured fleet release, says which answer it reads; else it
    // is taken to run the master's release (as without moongate: no translation), or
    // 0.3.13 against a 0.3.11 master (whose layout it is not).
    let c = match style.schema {
        Schema::V0_3_13 if older::identifies(req.method(), style.schema).is_some() => {
            Schema::V0_3_13
        }
        Schema::V0_3_13 => client.unwrap_or(match m.schema() {
            Schema::V0_3_11 => Schema::V0_3_13,
            same => same,
        }),
        s => s,
    };
    if m.schema() == c {
        return Bridge::Same;
    }
    if !*logged {
        *logged = true;
        if shared.cfg.bridge {
            tracing::info!(
                client = c.label(),
                master = m.label(),
                "client and master releases differ: calls and answers translated"
            );
        } else {
            tracing::warn!(
                client = c.label(),
                master = m.label(),
                "client and master releases differ and master_face.bridge is off: calls whose layouts differ are refused"
            );
        }
    }
    if !shared.cfg.bridge {
        return if layouts_differ(req, style, body, c, m.schema()) {
            Bridge::Refuse {
                client: c,
                master: m,
            }
        } else {
            Bridge::Same
        };
    }
    shared.metrics.bridged.inc();
    Bridge::Translate {
        up: BodyStyle {
            schema: m.schema(),
            compat: false,
            ..style
        },
        answer: BodyStyle { schema: c, ..style },
    }
}

/// The answer to a call refused for release skew: the whole call fails with a
/// message the client logs (`invalid_rpc_arguments`, as the master would answer it,
/// but saying why).
fn skew_refusal(seq: u32, method: Method, client: Schema, master: MasterRelease) -> Bytes {
    let msg = format!(
        "moongate: {method} from a Mooncake {} client cannot go to the {} master as it is \
         (their layouts differ) and master_face.bridge is off",
        client.label(),
        master.label()
    );
    let mut body = BytesMut::new();
    RpcError {
        code: u16::from(errc::INVALID_RPC_ARGUMENTS),
        message: Bytes::from(msg),
    }
    .encode_body(BodyStyle::MOONCAKE, &mut body);
    let mut out = BytesMut::with_capacity(16 + body.len());
    ResponseFrame {
        header: ResponseHeader::new(seq, errc::INVALID_RPC_ARGUMENTS, body.len() as u32),
        body: body.freeze(),
        attachment: Bytes::new(),
    }
    .write(&mut out);
    out.freeze()
}

/// Sends `req` upstream: as received, re-encoded (`changed`, or `reencode = "always"`),
/// or as bounded parts of a batch. Returns the number of upstream calls.
fn forward(
    shared: &Shared,
    out: &mut BytesMut,
    got: &Received<'_>,
    req: &Request,
    changed: bool,
    ticket: &Ticket,
) -> usize {
    let Received {
        frame,
        raw,
        style,
        up,
    } = *got;
    // Translated: written in the master's layout, a 0.3.11 call given the tenant its
    // Python client names in later releases.
    let translated;
    let (req, style, changed) = match up {
        Some(up) => {
            translated = match (style.schema, req.clone()) {
                (Schema::V0_3_11, mut r) => {
                    if let Some(t) = r.tenant_mut().filter(|t| t.is_empty()) {
                        *t = Bytes::from_static(b"default");
                    }
                    r
                }
                (_, r) => r,
            };
            (&translated, up, true)
        }
        None => (req, style, changed),
    };
    // An attachment cannot be cut with the keys; batch calls never carry one.
    if frame.attachment.is_empty() {
        let points = split::points(
            req,
            shared.cfg.max_batch_keys,
            &shared.policy,
            ticket.arm(),
            shared.put_bytes_in_flight.load(Ordering::Relaxed),
        );
        if let Some(parts) = (!points.is_empty())
            .then(|| req.split_at(&points))
            .flatten()
        {
            for p in &parts {
                write_request(frame, p, style, out);
            }
            shared.metrics.split(req.method(), parts.len());
            return parts.len();
        }
    }
    if changed && style.schema != Schema::V0_3_13 {
        let lost = req.lost_in(style.schema);
        if !lost.is_empty() {
            shared.metrics.fields_dropped(&lost, style.schema);
        }
    }
    if changed || shared.cfg.reencode == Reencode::Always {
        write_request(frame, req, style, out);
    } else {
        out.extend_from_slice(raw);
    }
    1
}

fn decode_request(
    shared: &Shared,
    frame: &RequestFrame,
    method: Option<Method>,
    m: &MethodMetrics,
) -> Option<(Request, BodyStyle)> {
    let method = method.filter(|m| is_typed(*m))?;
    match Request::decode(method, &frame.body)? {
        Ok(d) => Some(d),
        Err(DecodeError::TypeMismatch { found, .. }) => {
            // A release moongate has no layout for: relayed as it came.
            shared
                .metrics
                .unknown_type_code(method, Side::client, found);
            None
        }
        Err(e) => {
            // The master will answer invalid_rpc_arguments itself; relay untouched.
            m.error(ErrorKind::decode, 1);
            tracing::debug!(%method, error = %e, "request body did not decode; relaying raw");
            None
        }
    }
}

fn write_request(frame: &RequestFrame, req: &Request, style: BodyStyle, out: &mut BytesMut) {
    let mut body = BytesMut::with_capacity(frame.body.len() + 64);
    req.encode_body(style, &mut body);
    RequestFrame {
        header: frame.header,
        body: body.freeze(),
        attachment: frame.attachment.clone(),
    }
    .write(out);
}

/// Put bytes a forwarded put-family start holds until it is answered.
fn put_bytes(req: &Request, shared: &Shared) -> Option<InFlightBytes> {
    let put = calls::put::Put::of(req)?;
    Some(InFlightBytes::take(
        &shared.put_bytes_in_flight,
        put.bytes(),
    ))
}

/// Per-answer context: the metric handles and arm of the call being answered.
struct Answering<'a> {
    peer: &'a Peer,
    method: Option<Method>,
    entry: Option<&'a Entry>,
    latency: Duration,
    shared: &'a Shared,
    m: &'a MethodMetrics,
    am: Option<&'a MethodMetrics>,
}

impl<'a> Answering<'a> {
    fn new(
        method: Option<Method>,
        shown: Option<Method>,
        entry: Option<&'a Entry>,
        latency: Duration,
        shared: &'a Shared,
        peer: &'a Peer,
    ) -> Self {
        let am = entry
            .zip(shown)
            .map(|(e, method)| &e.ticket.arm().metrics.requests[method.index()]);
        if let Some(am) = am {
            am.latency.observe(latency.as_secs_f64());
        }
        Answering {
            peer,
            method,
            entry,
            latency,
            shared,
            m: shared.metrics.method(shown),
            am,
        }
    }

    /// A response as received: decoded when typed and successful, else relayed.
    fn response(&self, frame: &ResponseFrame, raw: &Bytes, out: &mut BytesMut) {
        if frame.header.err_code != errc::OK {
            self.transport_error(frame.header.err_code, &frame.body);
            out.extend_from_slice(raw);
            return;
        }
        if self.counted_exists(&frame.body, raw, out) {
            return;
        }
        let decoded = match self.method {
            Some(method) if is_typed(method) => match Response::decode(method, &frame.body) {
                Some(Ok(d)) => Some(d),
                Some(Err(DecodeError::TypeMismatch { found, .. })) => {
                    self.shared
                        .metrics
                        .unknown_type_code(method, Side::upstream, found);
                    None
                }
                Some(Err(e)) => {
                    self.m.error(ErrorKind::decode, 1);
                    tracing::debug!(%method, error = %e, "response body did not decode; relaying raw");
                    None
                }
                None => None,
            },
            _ => None,
        };
        let Some((resp, style)) = decoded else {
            out.extend_from_slice(raw);
            return;
        };
        self.reply(resp, style, frame.header, &frame.attachment, Some(raw), out);
    }

    /// An existence answer (one key or a batch) that is only counted, relayed as
    /// received: nothing rewrites it (no fixup, steering or translation, `reencode` not
    /// `always`) and no key table reads it (no eviction tracking). Counted from its
    /// bytes, as [`Answering::reply`] would count the decoded answer, without building
    /// its results (for 64 keys, about a quarter of what moongate spent on the call over
    /// a bare relay; for one, ~300 instructions of decode and tally, measured). `false`: not such
    /// an answer, or its body does not count (the decode then says why).
    fn counted_exists(&self, body: &Bytes, raw: &Bytes, out: &mut BytesMut) -> bool {
        let (method, count): (_, fn(&Bytes) -> _) = match self.method {
            Some(m @ Method::BatchExistKey) => (m, ExistCounts::of_batch),
            Some(m @ Method::ExistKey) => (m, ExistCounts::of_single),
            _ => return false,
        };
        if self.shared.cfg.reencode == Reencode::Always
            || self.entry.is_some_and(|e| {
                e.fixup.is_some()
                    || e.steer
                    || e.client_style.is_some()
                    || e.exist.is_some()
                    || (e.tracked.is_some() && self.shared.eviction.is_some())
            })
        {
            return false;
        }
        let Ok(c) = count(body) else {
            return false;
        };
        if let Some(e) = self.entry {
            e.ticket.arm().metrics.add_lookups(c.found, c.absent);
        }
        self.finish(method, c.errors, c.first_error, c.keys() as usize);
        out.extend_from_slice(raw);
        true
    }

    /// Counts an answer's per-key errors and ends its call's ticket (the policy's
    /// `on-answer`, experiment outcomes).
    fn finish(&self, method: Method, errors: u64, first_error: Option<ErrorCode>, keys: usize) {
        self.m.error(ErrorKind::app, errors);
        if let Some(am) = self.am {
            am.error(ErrorKind::app, errors);
        }
        if let Some(e) = self.entry {
            e.ticket.finish(&Outcome {
                method: method.name(),
                code: first_error.map_or(0, |e| e.0),
                failed: errors > 0,
                latency: Some(self.latency),
                keys,
            });
        }
    }

    /// An answer the client's release cannot carry: the call fails as a whole with a
    /// message the client logs, counted, instead of bytes it would misread.
    fn untranslatable(
        &self,
        method: Method,
        client: BodyStyle,
        header: ResponseHeader,
        out: &mut BytesMut,
    ) {
        self.shared.metrics.untranslatable(method);
        self.m.error(ErrorKind::rpc, 1);
        if let Some(e) = self.entry {
            e.ticket.finish(&Outcome {
                method: method.name(),
                code: ErrorCode::RPC_FAIL.0,
                failed: true,
                latency: Some(self.latency),
                keys: 0,
            });
        }
        let msg = format!(
            "moongate: the master's answer to {method} names a DFS replica, which a Mooncake \
             {} client cannot read",
            client.schema.label()
        );
        tracing::warn!(%method, client = client.schema.label(), "answer untranslatable to the client's release");
        let mut body = BytesMut::new();
        RpcError {
            code: u16::from(errc::RPC_THROW_EXCEPTION),
            message: Bytes::from(msg),
        }
        .encode_body(BodyStyle::MOONCAKE, &mut body);
        ResponseFrame {
            header: ResponseHeader::new(
                header.seq_num,
                errc::RPC_THROW_EXCEPTION,
                body.len() as u32,
            ),
            body: body.freeze(),
            attachment: Bytes::new(),
        }
        .write(out);
    }

    /// The master (or a part of a split call) failed the call as a whole.
    fn transport_error(&self, err_code: u8, body: &Bytes) {
        self.m.error(ErrorKind::rpc, 1);
        if let Some(am) = self.am {
            am.error(ErrorKind::rpc, 1);
        }
        if let Some(e) = self.entry {
            e.ticket.finish(&Outcome {
                method: self.method.map_or("unknown", Method::name),
                code: ErrorCode::RPC_FAIL.0,
                failed: true,
                latency: Some(self.latency),
                keys: 0,
            });
        }
        if tracing::enabled!(tracing::Level::DEBUG) {
            let msg = RpcError::decode(err_code, body)
                .map(|(e, _)| String::from_utf8_lossy(&e.message).into_owned())
                .unwrap_or_default();
            tracing::debug!(method = self.method.map(Method::name), err_code, %msg,
                "master answered with a transport error");
        }
    }

    /// A decoded successful reply: fix up, steer, tally, finish, then write it out
    /// (`raw`, the bytes as received, when nothing changed it).
    fn reply(
        &self,
        mut resp: Response,
        style: BodyStyle,
        header: ResponseHeader,
        attachment: &Bytes,
        raw: Option<&Bytes>,
        out: &mut BytesMut,
    ) {
        let entry = self.entry;
        let fixup = entry.and_then(|e| e.fixup.as_ref());
        // The master's own answer (before fixup and steering) says what it stores.
        if let (Some(ev), Some(e)) = (&self.shared.eviction, entry)
            && let Some(t) = &e.tracked
        {
            ev.record(t, &resp, e.ticket.arm, &e.ticket.arm().name);
        }
        if let Some(e) = entry
            && self.shared.topology.ssd_tracking()
        {
            follow_ssd(self.shared, e, &resp);
        }
        if let Some(f) = fixup {
            resp = f.apply(resp);
        }
        let mut steered = false;
        if let Some(e) = entry.filter(|e| e.steer)
            && let Some(keys) = &e.lookup_keys
        {
            steered = self
                .shared
                .policy
                .steer_lookup(e.ticket.arm(), keys, &mut resp);
        }
        let mut style = style;
        // A translated call's answer goes back in the client's release.
        let bridged = entry.and_then(|e| e.client_style);
        if let Some(cs) = bridged {
            if cs.schema != Schema::V0_3_13 && resp.needs_0_3_13() {
                self.untranslatable(resp.method(), cs, header, out);
                return;
            }
            style = BodyStyle {
                compat: false,
                ..cs
            };
        }
        if entry.is_some_and(|e| e.exist.is_some()) {
            // An existence check sent as a lookup: the client gets its own answer.
            resp = match calls::exist::from_lookup(resp) {
                Ok(r) | Err(r) => r,
            };
            steered = true;
            style.compat = false;
        }
        // A rank reads an owner's SSD through the owner face; an owner reads its own.
        if let Some(of) = &self.shared.owner_face
            && !self.peer.is_owner()
            && calls::lookup::redirect_local_disk(&mut resp, |ep| of.endpoint_for(ep))
        {
            steered = true;
        }
        if let Some(e) = entry {
            // What the reader will read, after steering; an owner's look at keys it is
            // about to offload is its own work, not a read or a hit.
            let role = match (&e.lookup_keys, calls::lookup::results(&resp)) {
                (Some(keys), Some(answers)) if e.exist.is_none() => self.shared.topology.lookup(
                    self.peer,
                    &e.lookup_tenant,
                    keys,
                    answers,
                    &e.ticket.arm().metrics,
                ),
                _ => LookupRole::Read,
            };
            let tally = calls::Tally::of(&resp);
            if !tally.is_empty() && role == LookupRole::Read {
                e.ticket.arm().metrics.add_tally(&tally);
            }
        }
        let (errors, first_error) = resp.errors();
        self.finish(resp.method(), errors as u64, first_error, resp.key_count());
        match raw {
            Some(raw)
                if fixup.is_none()
                    && !steered
                    && bridged.is_none()
                    && self.shared.cfg.reencode != Reencode::Always =>
            {
                out.extend_from_slice(raw)
            }
            _ => {
                if style.compat {
                    // 0.3.14's compatible section is not re-encoded: the answer goes
                    // out in the 0.3.13 layout (counted).
                    self.shared.metrics.compat_sections_dropped.inc();
                }
                let mut body = BytesMut::with_capacity(64 + 16 * resp.key_count());
                resp.encode_body(style, &mut body);
                ResponseFrame {
                    header,
                    body: body.freeze(),
                    attachment: attachment.clone(),
                }
                .write(out);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! The session driven directly: no master, no sockets, no wasm (a fake policy).

    use super::*;
    use crate::codec::frame::{check_request, check_response};
    use crate::codec::message::{BatchPutStartArgs, KeyArgs, KeysArgs, PutStartArgs};
    use crate::codec::types::{
        BufferDescriptor, DfsDescriptor, ErrorCode, MemoryDescriptor, ReplicaDescriptor,
        ReplicaLocation, ReplicaStatus, ReplicateConfig,
    };
    use crate::codec::{RequestHeader, ResponseHeader};
    use crate::master_face::config::MasterFaceConfig;
    use crate::metrics::Metrics;
    use crate::policy::Policy;
    use crate::policy::fake::Fake;
    use crate::policy::registry::Registry;

    fn session_with(cfg: MasterFaceConfig, fake: Arc<Fake>) -> (Session, Arc<Shared>) {
        session_in(cfg, fake, &Metrics::new())
    }

    /// A session whose handles live in `all` (to read the exposition).
    fn session_in(cfg: MasterFaceConfig, fake: Arc<Fake>, all: &Metrics) -> (Session, Arc<Shared>) {
        let policy: Arc<dyn Policy> = fake;
        let shared = Arc::new(Shared {
            upstream: crate::upstream::Upstream::fixed(&cfg.upstream),
            cfg,
            metrics: all.master.clone(),
            shutdown: Default::default(),
            policy: Registry::with_policies(
                Default::default(),
                None,
                all.policy.clone(),
                vec![policy],
            )
            .unwrap(),
            put_bytes_in_flight: Default::default(),
            eviction: None,
            topology: Arc::new(crate::topology::Topology::new(all.topology.clone())),
            owner_face: None,
        });
        let peer = shared
            .topology
            .join(crate::topology::PeerKey::Addr([127, 0, 0, 1].into()));
        (Session::new(shared.clone(), peer), shared)
    }

    fn session(fake: Arc<Fake>) -> (Session, Arc<Shared>) {
        session_with(MasterFaceConfig::default(), fake)
    }

    fn key(k: &str) -> Bytes {
        Bytes::copy_from_slice(k.as_bytes())
    }

    fn exist(k: &str) -> Request {
        Request::ExistKey(KeyArgs {
            key: key(k),
            tenant_id: key("default"),
        })
    }

    fn put(k: &str) -> Request {
        Request::PutStart(PutStartArgs {
            client_id: Uuid::default(),
            key: key(k),
            slice_length: 10,
            config: ReplicateConfig::default(),
            tenant_id: key("default"),
        })
    }

    fn batch_put(keys: &[&str]) -> Request {
        Request::BatchPutStart(BatchPutStartArgs {
            client_id: Uuid::default(),
            keys: keys.iter().map(|k| key(k)).collect(),
            slice_lengths: keys.iter().map(|_| 10).collect(),
            config: ReplicateConfig::default(),
            tenant_id: key("default"),
        })
    }

    /// A request as the client sends it.
    fn request(seq: u32, req: &Request) -> (RequestFrame, Bytes) {
        let mut body = BytesMut::new();
        req.encode_body(BodyStyle::MOONCAKE, &mut body);
        let mut raw = BytesMut::new();
        RequestHeader::new(seq, req.method().function_id(), body.len() as u32).write(&mut raw);
        raw.extend_from_slice(&body);
        let h = check_request(&raw, 1 << 20).unwrap().unwrap();
        let (f, raw) = RequestFrame::split(&mut raw, h);
        (f, raw)
    }

    /// A master answer.
    fn answer(seq: u32, resp: &Response) -> (ResponseFrame, Bytes) {
        let mut body = BytesMut::new();
        resp.encode_body(BodyStyle::MOONCAKE, &mut body);
        frame(ResponseHeader::new(seq, errc::OK, body.len() as u32), body)
    }

    fn transport_error(seq: u32) -> (ResponseFrame, Bytes) {
        let mut body = BytesMut::new();
        RpcError {
            code: u16::from(errc::RPC_THROW_EXCEPTION),
            message: key("boom"),
        }
        .encode_body(BodyStyle::MOONCAKE, &mut body);
        frame(
            ResponseHeader::new(seq, errc::RPC_THROW_EXCEPTION, body.len() as u32),
            body,
        )
    }

    fn frame(h: ResponseHeader, body: BytesMut) -> (ResponseFrame, Bytes) {
        let mut raw = BytesMut::new();
        h.write(&mut raw);
        raw.extend_from_slice(&body);
        let h = check_response(&raw, 1 << 20).unwrap().unwrap();
        ResponseFrame::split(&mut raw, h)
    }

    /// The requests in bytes the session sent the master: (seq, decoded).
    fn sent(bytes: Option<Bytes>) -> Vec<(u32, Request)> {
        let mut buf = BytesMut::from(&bytes.unwrap_or_default()[..]);
        let mut out = Vec::new();
        while let Some(h) = check_request(&buf, 1 << 20).unwrap() {
            let (f, _) = RequestFrame::split(&mut buf, h);
            let m = Method::from_function_id(h.function_id).unwrap();
            out.push((h.seq_num, Request::decode(m, &f.body).unwrap().unwrap().0));
        }
        assert!(buf.is_empty(), "a partial frame went out");
        out
    }

    /// The replies in bytes the session sent the client: (seq, err_code, frame).
    fn replies(bytes: Option<Bytes>) -> Vec<(u32, u8, ResponseFrame)> {
        let mut buf = BytesMut::from(&bytes.unwrap_or_default()[..]);
        let mut out = Vec::new();
        while let Some(h) = check_response(&buf, 1 << 20).unwrap() {
            let (f, _) = ResponseFrame::split(&mut buf, h);
            out.push((h.seq_num, h.err_code, f));
        }
        assert!(buf.is_empty(), "a partial frame went out");
        out
    }

    fn decoded(m: Method, f: &ResponseFrame) -> Response {
        Response::decode(m, &f.body).unwrap().unwrap().0
    }

    #[test]
    fn pipelined_calls_with_arbitrary_seqs_are_answered_in_order_byte_for_byte() {
        let (mut s, _) = session(Arc::new(Fake::new("p")));
        let now = Instant::now();
        let seqs = [7u32, 3, 100_000];
        for (i, &seq) in seqs.iter().enumerate() {
            let (f, raw) = request(seq, &exist(&format!("k{i}")));
            s.handle_request(&f, &raw, now);
        }
        let up = sent(s.poll_to_master());
        assert_eq!(up.iter().map(|(q, _)| *q).collect::<Vec<_>>(), seqs);
        assert_eq!(s.in_flight(), 3);
        let mut want = BytesMut::new();
        for (i, &seq) in seqs.iter().enumerate() {
            let (f, raw) = answer(seq, &Response::ExistKey(Ok(i % 2 == 0)));
            want.extend_from_slice(&raw);
            s.handle_response(&f, &raw, now + Duration::from_micros(50));
        }
        assert_eq!(
            s.poll_to_client().unwrap(),
            want.freeze(),
            "relayed as received"
        );
        assert_eq!(s.in_flight(), 0);
    }

    #[test]
    fn a_removal_voids_the_places_others_were_told_of_on_its_way_and_at_its_answer() {
        let (mut s, shared) = session(Arc::new(Fake::new("p")));
        let now = Instant::now();
        let epoch = || shared.upstream.places_epoch();
        let e0 = epoch();
        let (f, raw) = request(1, &exist("a"));
        s.handle_request(&f, &raw, now);
        let (f, raw) = answer(1, &Response::ExistKey(Ok(true)));
        s.handle_response(&f, &raw, now);
        assert_eq!(epoch(), e0, "a lookup voids nothing");
        let rm = |force| {
            Request::Remove(crate::codec::message::RemoveArgs {
                key: key("a"),
                force,
                tenant_id: key("default"),
            })
        };
        // Unforced, it cannot take a leased value: nothing cached is void.
        let (f, raw) = request(9, &rm(false));
        s.handle_request(&f, &raw, now);
        let (f, raw) = answer(9, &Response::Remove(Ok(())));
        s.handle_response(&f, &raw, now);
        assert_eq!(epoch(), e0);
        let (f, raw) = request(2, &rm(true));
        s.handle_request(&f, &raw, now);
        assert_eq!(epoch(), e0 + 1, "on its way");
        let (f, raw) = answer(2, &Response::Remove(Ok(())));
        s.handle_response(&f, &raw, now);
        assert_eq!(epoch(), e0 + 2, "at its answer");
        // A BatchRemove is relayed whole: its method alone voids.
        let mut raw = BytesMut::new();
        RequestHeader::new(3, Method::BatchRemove.function_id(), 0).write(&mut raw);
        let h = check_request(&raw, 1 << 20).unwrap().unwrap();
        let (f, raw) = RequestFrame::split(&mut raw, h);
        s.handle_request(&f, &raw, now);
        assert_eq!(epoch(), e0 + 3);
        // Its connection closes before the answer: it may still land.
        drop(s);
        assert_eq!(epoch(), e0 + 4);
    }

    #[test]
    fn a_local_answer_waits_for_the_calls_before_it() {
        let fake = Arc::new(Fake::new("deny").deny_prefix("deny/", -200));
        let (mut s, shared) = session(fake.clone());
        let now = Instant::now();
        for (seq, req) in [(1, exist("a")), (2, put("deny/x")), (3, exist("b"))] {
            let (f, raw) = request(seq, &req);
            s.handle_request(&f, &raw, now);
        }
        // The denied put never reaches the master, and its answer is not due yet.
        let up = sent(s.poll_to_master());
        assert_eq!(up.iter().map(|(q, _)| *q).collect::<Vec<_>>(), [1, 3]);
        assert!(s.poll_to_client().is_none());
        let (f, raw) = answer(1, &Response::ExistKey(Ok(true)));
        s.handle_response(&f, &raw, now);
        let out = replies(s.poll_to_client());
        assert_eq!(out.iter().map(|(q, ..)| *q).collect::<Vec<_>>(), [1, 2]);
        assert_eq!(
            decoded(Method::PutStart, &out[1].2),
            Response::PutStart(Err(ErrorCode::NO_AVAILABLE_HANDLE))
        );
        let (f, raw) = answer(3, &Response::ExistKey(Ok(false)));
        s.handle_response(&f, &raw, now);
        assert_eq!(replies(s.poll_to_client())[0].0, 3);
        assert_eq!(s.in_flight(), 0);
        // Denied locally: the guardrail heard of it, observe did not (nothing went up).
        assert!(fake.observations().is_empty());
        assert_eq!(
            shared.metrics.method(Some(Method::PutStart)).errors[ErrorKind::app as usize].get(),
            1
        );
    }

    #[test]
    fn a_local_answer_with_nothing_before_it_goes_out_at_once() {
        let (mut s, _) = session(Arc::new(Fake::new("deny").deny_prefix("deny/", -200)));
        let (f, raw) = request(9, &put("deny/now"));
        s.handle_request(&f, &raw, Instant::now());
        assert!(s.has_output_for_client());
        assert!(s.poll_to_master().is_none());
        assert_eq!(replies(s.poll_to_client())[0].0, 9);
        assert_eq!(s.in_flight(), 0);
    }

    /// A request in `schema`'s layout.
    fn request_in(seq: u32, req: &Request, schema: Schema) -> (RequestFrame, Bytes) {
        let mut body = BytesMut::new();
        let style = BodyStyle {
            schema,
            ..BodyStyle::MOONCAKE
        };
        req.encode_body(style, &mut body);
        let mut raw = BytesMut::new();
        RequestHeader::new(seq, req.method().function_id(), body.len() as u32).write(&mut raw);
        raw.extend_from_slice(&body);
        let h = check_request(&raw, 1 << 20).unwrap().unwrap();
        RequestFrame::split(&mut raw, h)
    }

    /// A master answer in `schema`'s layout.
    fn answer_in(seq: u32, resp: &Response, schema: Schema) -> (ResponseFrame, Bytes) {
        let mut body = BytesMut::new();
        let style = BodyStyle {
            schema,
            ..BodyStyle::MOONCAKE
        };
        resp.encode_body(style, &mut body);
        frame(ResponseHeader::new(seq, errc::OK, body.len() as u32), body)
    }

    fn replica(location: ReplicaLocation) -> ReplicaDescriptor {
        ReplicaDescriptor {
            id: 1,
            location,
            status: ReplicaStatus::COMPLETE,
        }
    }

    fn memory() -> ReplicaLocation {
        ReplicaLocation::Memory(MemoryDescriptor {
            buffer_descriptor: BufferDescriptor {
                size: 10,
                buffer_address: 4096,
                protocol: key("tcp"),
                transport_endpoint: key("127.0.0.1:1"),
            },
        })
    }

    #[test]
    fn a_call_to_a_master_of_another_release_goes_in_its_layout_and_comes_back_in_the_clients() {
        let (s, shared) = session(Arc::new(Fake::new("p")));
        let mut s = s.with_master(Some(MasterRelease::V0_3_12));
        let now = Instant::now();
        // A 0.3.13 put to a 0.3.12 master: the master's layout upstream.
        let (f, raw) = request(1, &put("k"));
        s.handle_request(&f, &raw, now);
        let mut up = BytesMut::from(&s.poll_to_master().unwrap()[..]);
        let h = check_request(&up, 1 << 20).unwrap().unwrap();
        let (upf, _) = RequestFrame::split(&mut up, h);
        let (req, style) = Request::decode(Method::PutStart, &upf.body)
            .unwrap()
            .unwrap();
        assert_eq!(style.schema, Schema::V0_3_12);
        assert_eq!(req, put("k"));
        // Its answer in the 0.3.12 layout goes back in the client's (0.3.13).
        let resp = Response::PutStart(Ok(vec![replica(memory())]));
        let (f, raw) = answer_in(1, &resp, Schema::V0_3_12);
        s.handle_response(&f, &raw, now);
        let out = replies(s.poll_to_client());
        let (back, style) = Response::decode(Method::PutStart, &out[0].2.body)
            .unwrap()
            .unwrap();
        assert_eq!((back, style.schema), (resp, Schema::V0_3_13));
        assert_eq!(shared.metrics.bridged.get(), 1);
    }

    #[test]
    fn an_answer_an_older_client_cannot_read_fails_the_call_with_a_reason() {
        let all = Metrics::new();
        let (s, _) = session_in(MasterFaceConfig::default(), Arc::new(Fake::new("p")), &all);
        let mut s = s.with_master(Some(MasterRelease::V0_3_13));
        let now = Instant::now();
        // A 0.3.12 put whose replica the 0.3.13 master puts on a DFS.
        let (f, raw) = request_in(3, &put("k"), Schema::V0_3_12);
        s.handle_request(&f, &raw, now);
        assert_eq!(sent(s.poll_to_master()).len(), 1);
        let dfs = ReplicaLocation::DistributedFs(DfsDescriptor {
            file_path: key("/dfs/k"),
            offset: 0,
            object_size: 10,
            aligned_size: 4096,
            shard_idx: 0,
        });
        let (f, raw) = answer(3, &Response::PutStart(Ok(vec![replica(dfs)])));
        s.handle_response(&f, &raw, now);
        let out = replies(s.poll_to_client());
        assert_eq!((out[0].0, out[0].1), (3, errc::RPC_THROW_EXCEPTION));
        let (e, _) = RpcError::decode(out[0].1, &out[0].2.body).unwrap();
        assert!(
            String::from_utf8_lossy(&e.message).contains("DFS replica"),
            "{e:?}"
        );
        assert!(
            all.encode()
                .contains("moongate_bridge_untranslatable_total{method=\"PutStart\"} 1")
        );
    }

    #[test]
    fn with_the_bridge_off_a_call_whose_layouts_differ_is_refused_and_one_that_matches_goes() {
        let cfg = MasterFaceConfig {
            bridge: false,
            ..Default::default()
        };
        let all = Metrics::new();
        let (s, _) = session_in(cfg, Arc::new(Fake::new("p")), &all);
        let mut s = s.with_master(Some(MasterRelease::V0_3_12));
        let now = Instant::now();
        // A 0.3.13 put: refused here, nothing upstream.
        let (f, raw) = request(1, &put("k"));
        s.handle_request(&f, &raw, now);
        assert!(s.poll_to_master().is_none_or(|b| b.is_empty()));
        let out = replies(s.poll_to_client());
        assert_eq!(out[0].1, errc::INVALID_RPC_ARGUMENTS);
        let (e, _) = RpcError::decode(out[0].1, &out[0].2.body).unwrap();
        assert!(
            String::from_utf8_lossy(&e.message).contains("master_face.bridge is off"),
            "{e:?}"
        );
        // An existence check has one layout and one answer in both: it goes.
        let (f, raw) = request(2, &exist("k"));
        s.handle_request(&f, &raw, now);
        assert_eq!(sent(s.poll_to_master()).len(), 1);
        assert!(
            all.encode()
                .contains("moongate_bridge_skew_refused_total{method=\"PutStart\"} 1")
        );
    }

    #[test]
    fn a_partial_denial_is_merged_back_in_key_order_and_observed() {
        let fake = Arc::new(Fake::new("deny").deny_prefix("deny/", -200));
        let (mut s, _) = session(fake.clone());
        let now = Instant::now();
        let (f, raw) = request(5, &batch_put(&["a", "deny/b", "c", "deny/d"]));
        s.handle_request(&f, &raw, now);
        let up = sent(s.poll_to_master());
        let Request::BatchPutStart(a) = &up[0].1 else {
            panic!("{up:?}")
        };
        assert_eq!(a.keys, vec![key("a"), key("c")]);
        let (f, raw) = answer(
            5,
            &Response::BatchPutStart(vec![Ok(vec![]), Err(ErrorCode::OBJECT_ALREADY_EXISTS)]),
        );
        s.handle_response(&f, &raw, now + Duration::from_micros(80));
        let out = replies(s.poll_to_client());
        assert_eq!(
            decoded(Method::BatchPutStart, &out[0].2),
            Response::BatchPutStart(vec![
                Ok(vec![]),
                Err(ErrorCode::NO_AVAILABLE_HANDLE),
                Err(ErrorCode::OBJECT_ALREADY_EXISTS),
                Err(ErrorCode::NO_AVAILABLE_HANDLE),
            ])
        );
        assert_eq!(
            fake.observations(),
            [("BatchPutStart".to_string(), -200, 4)]
        );
    }

    #[test]
    fn an_existence_check_goes_up_as_a_lookup_the_plugin_steers() {
        use crate::codec::types::*;
        // The plugin serves the first key and refuses the second (an empty list).
        let fake = Fake::new("budget").on_lookup(|c| {
            Ok((0..c.counts.len())
                .map(|i| if i == 0 { vec![0] } else { vec![] })
                .collect())
        });
        let (mut s, _) = session(Arc::new(fake));
        let now = Instant::now();
        let req = Request::BatchExistKey(KeysArgs {
            keys: vec![key("a"), key("b"), key("c")].into(),
            tenant_id: key("default"),
        });
        let (f, raw) = request(9, &req);
        s.handle_request(&f, &raw, now);
        let up = sent(s.poll_to_master());
        assert_eq!(up.len(), 1);
        let Request::BatchGetReplicaList(a) = &up[0].1 else {
            panic!("not sent as a lookup: {:?}", up[0].1);
        };
        assert_eq!((up[0].0, a.keys.len()), (9, 3));
        let found = || {
            Ok(GetReplicaListResponse {
                replicas: vec![ReplicaDescriptor {
                    id: 1,
                    location: ReplicaLocation::Disk(DiskDescriptor {
                        file_path: key("f"),
                        object_size: 10,
                    }),
                    status: ReplicaStatus::COMPLETE,
                }],
                lease_ttl_ms: 10_000,
                object_checksum: None,
            })
        };
        let (f, raw) = answer(
            9,
            &Response::BatchGetReplicaList(vec![
                found(),
                found(),
                Err(ErrorCode::OBJECT_NOT_FOUND),
            ]),
        );
        s.handle_response(&f, &raw, now);
        let back = replies(s.poll_to_client());
        assert_eq!(back.len(), 1);
        assert_eq!(
            decoded(Method::BatchExistKey, &back[0].2),
            Response::BatchExistKey(vec![Ok(true), Ok(false), Ok(false)]),
            "a key the plugin will not serve does not exist"
        );
        // Without a steering plugin, an existence check goes up as it came.
        let (mut s, _) = session(Arc::new(Fake::new("p")));
        let (f, raw) = request(3, &req);
        s.handle_request(&f, &raw, now);
        assert!(matches!(
            sent(s.poll_to_master())[0].1,
            Request::BatchExistKey(_)
        ));
    }

    #[test]
    fn a_split_batch_whose_part_fails_fails_as_a_whole_with_the_clients_seq() {
        let cfg = MasterFaceConfig {
            max_batch_keys: 2,
            ..MasterFaceConfig::default()
        };
        let (mut s, shared) = session_with(cfg, Arc::new(Fake::new("p")));
        let now = Instant::now();
        let keys: Vec<Bytes> = (0..5).map(|i| key(&format!("k{i}"))).collect();
        let req = Request::BatchExistKey(KeysArgs {
            keys: keys.clone().into(),
            tenant_id: key("default"),
        });
        let (f, raw) = request(42, &req);
        s.handle_request(&f, &raw, now);
        let up = sent(s.poll_to_master());
        assert_eq!(
            up.iter()
                .map(|(q, r)| (*q, r.key_count()))
                .collect::<Vec<_>>(),
            [(42, 2), (42, 2), (42, 1)]
        );
        let (f, raw) = answer(42, &Response::BatchExistKey(vec![Ok(true), Ok(true)]));
        s.handle_response(&f, &raw, now);
        let (f, raw) = transport_error(42);
        s.handle_response(&f, &raw, now);
        assert_eq!(s.in_flight(), 1, "the entry stays until its last part");
        assert!(s.poll_to_client().is_none());
        let (f, raw) = answer(42, &Response::BatchExistKey(vec![Ok(false)]));
        s.handle_response(&f, &raw, now);
        let out = replies(s.poll_to_client());
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].0, out[0].1), (42, errc::RPC_THROW_EXCEPTION));
        assert_eq!(s.in_flight(), 0);
        assert_eq!(
            shared.metrics.method(Some(Method::BatchExistKey)).errors[ErrorKind::rpc as usize]
                .get(),
            1
        );
    }

    #[test]
    fn split_parts_merge_into_the_unsplit_answer() {
        let cfg = MasterFaceConfig {
            max_batch_keys: 2,
            ..MasterFaceConfig::default()
        };
        let (mut s, _) = session_with(cfg, Arc::new(Fake::new("p")));
        let now = Instant::now();
        let req = Request::BatchExistKey(KeysArgs {
            keys: (0..3).map(|i| key(&format!("k{i}"))).collect(),
            tenant_id: key("default"),
        });
        let (f, raw) = request(8, &req);
        s.handle_request(&f, &raw, now);
        assert_eq!(sent(s.poll_to_master()).len(), 2);
        for part in [
            vec![Ok(true), Err(ErrorCode::OBJECT_NOT_FOUND)],
            vec![Ok(false)],
        ] {
            let (f, raw) = answer(8, &Response::BatchExistKey(part));
            s.handle_response(&f, &raw, now);
        }
        let out = replies(s.poll_to_client());
        assert_eq!(
            decoded(Method::BatchExistKey, &out[0].2),
            Response::BatchExistKey(vec![Ok(true), Err(ErrorCode::OBJECT_NOT_FOUND), Ok(false)])
        );
    }

    #[test]
    fn the_in_flight_bound_is_reported_and_freed_by_answers() {
        let cfg = MasterFaceConfig {
            max_inflight_per_connection: 2,
            ..MasterFaceConfig::default()
        };
        let (mut s, _) = session_with(cfg, Arc::new(Fake::new("p")));
        let now = Instant::now();
        for seq in 1..=2 {
            assert!(s.has_room());
            let (f, raw) = request(seq, &exist("k"));
            s.handle_request(&f, &raw, now);
        }
        assert!(!s.has_room(), "backpressure at the bound");
        let (f, raw) = answer(1, &Response::ExistKey(Ok(true)));
        s.handle_response(&f, &raw, now);
        assert!(s.has_room());
    }

    #[test]
    fn an_answer_with_an_unknown_seq_is_relayed_and_counted() {
        let all = Metrics::new();
        let (mut s, _) = session_in(MasterFaceConfig::default(), Arc::new(Fake::new("p")), &all);
        let now = Instant::now();
        let (f, raw) = request(1, &exist("k"));
        s.handle_request(&f, &raw, now);
        let (f, raw) = answer(77, &Response::ExistKey(Ok(true)));
        s.handle_response(&f, &raw, now);
        assert_eq!(s.poll_to_client().unwrap(), raw);
        assert!(all.encode().contains(
            "moongate_master_frame_errors_total{side=\"upstream\",kind=\"unmatched_seq\"} 1"
        ));
    }

    #[test]
    fn a_decided_put_is_observed_with_its_latency_and_keys() {
        let fake = Arc::new(Fake::new("deny").deny_prefix("nothing-matches/", -200));
        let (mut s, _) = session(fake.clone());
        let now = Instant::now();
        let (f, raw) = request(3, &put("k"));
        s.handle_request(&f, &raw, now);
        let (f, raw) = answer(3, &Response::PutStart(Ok(vec![])));
        s.handle_response(&f, &raw, now + Duration::from_micros(120));
        assert_eq!(fake.observations(), [("PutStart".to_string(), 0, 1)]);
        assert_eq!(fake.observed.lock().unwrap()[0].latency_us, 120);
    }
}

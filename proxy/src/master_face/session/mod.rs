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
//! batch come back to back and the entry leaves with the last) -> decode -> take what
//! the master's answer says ([`crate::answered::Sink::said`]) -> merge denied keys back
//! -> steer lookups -> hand the observation to the sink (key table, SSD usage, tiers
//! served, the fleet's records) -> tally -> finish (arm metrics, guardrail, the
//! plugin's `observe`) -> forward.
//!
//! Rooms: [`request`] (a request's way in), [`bridge`] (calls between releases),
//! [`answer`] (an answer's way back); this file keeps the queue that joins them.
//! Their functions are `#[inline]`: they were one module, and a release build's
//! codegen units would otherwise call across the rooms on every frame (counted: 62
//! instructions per call on the CI mix, docs/results.md).
//!
//! The queue is bounded by `master_face.max_inflight_per_connection`: the shell asks
//! [`Session::has_room`] before it hands in a request and stops reading the client when
//! there is none (backpressure; a request is never failed for it).
//!
//! [`split`]: super::split

mod answer;
mod bridge;
mod request;
#[cfg(test)]
mod tests;

use answer::Answering;
use bridge::{Bridge, bridge, skew_refusal};
use request::{Next, exist_as_lookup, moves_data, on_request};

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};

use super::Shared;
use super::config::Reencode;
use super::metrics::{FrameErrorKind, Side};
use super::split::{self, InFlightBytes, Merge, Merged};
use crate::answered::{Answered, Read};
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
    /// What the answer tells the key table (one kept). Boxed: most nodes keep no key
    /// table, and every call's entry is moved in and out of the queue.
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
        if self.queue.iter().any(|f| {
            matches!(f, InFlight::Upstream { method: Some(m), .. } if calls::remove::removes(*m))
        }) {
            self.shared.upstream.removal_seen();
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
        if method.is_some_and(calls::remove::removes) {
            self.shared.upstream.removal_seen();
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
                // Again at the answer: a lookup the master served just before it.
                if method.is_some_and(calls::remove::removes) {
                    self.shared.upstream.removal_seen();
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
        if !reached_disk.is_empty() {
            self.shared.answered.offloaded(&reached_disk);
        }
    }
}

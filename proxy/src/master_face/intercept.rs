//! What happens to one frame on its way through the master face: decode (typed methods),
//! ask the policy (put family), account, and choose the bytes to forward or the answer
//! to give.
//!
//! Pure functions over frames, decoded values and metric handles: no sockets, no tasks.
//!
//! Phase order for a request: accept -> check/split (connection) -> classify (method) ->
//! decode -> policy (PutStart, BatchPutStart, UpsertStart, BatchUpsertStart) -> forward
//! (received bytes, re-encoded rewrite, or bounded parts of a batch: [`split`]) or answer
//! locally (denied). For a response: check/split -> match seq -> decode (parts of a split
//! batch: merge) -> merge denied keys back (partial batch denial) -> steer lookups ->
//! tally tiers -> observe (latency, errors, arm guardrail) -> forward.
//!
//! [`split`]: super::split

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};

use super::Shared;
use super::split::{self, InFlightBytes, Merged};
use crate::codec::frame::errc;
use crate::codec::message::{Request, Response, RpcError, is_typed};
use crate::codec::types::Uuid;
use crate::codec::{BodyStyle, Method, RequestFrame, ResponseFrame, ResponseHeader};
use crate::config::Reencode;
use crate::eviction::Tracked;
use crate::metrics::{ErrorKind, MethodMetrics};
use crate::policy::registry::{ActiveSet, PutDecided};
use crate::policy::{Fixup, PutAction};
use std::sync::atomic::Ordering;

/// A put-family call the policy decided: the set and arm that decided it (kept alive
/// until the answer arrives, so a swap meanwhile changes nothing for this call).
pub struct Decided {
    pub set: Arc<ActiveSet>,
    pub arm: usize,
    pub fixup: Option<Fixup>,
    /// The plugin failed on this call: it counts against the arm's guardrail.
    pub plugin_failed: bool,
    /// A put-family call the plugin decided (feeds guardrail and `observe`); other
    /// decoded calls are only accounted to the arm that serves their client or key.
    pub decided_by_plugin: bool,
    /// Keys of a lookup whose answer the arm's plugin steers (`on-lookup`).
    pub lookup_keys: Option<Vec<Bytes>>,
    /// Upstream calls this request went out as (1 unless a batch was split).
    pub parts: usize,
    /// The put bytes this call holds in the node-wide in-flight count until it ends.
    pub in_flight: Option<InFlightBytes>,
    /// What the answer tells the eviction table (eviction on).
    pub tracked: Option<Tracked>,
}

/// What the connection queues for one request, in request order.
pub enum Queued {
    /// Forwarded; the master answers it.
    Upstream(Option<Decided>),
    /// Answered by moongate: these bytes go to the client when its turn comes.
    Local(Bytes),
}

fn decode_request(
    frame: &RequestFrame,
    method: Option<Method>,
    m: &MethodMetrics,
) -> Option<(Request, BodyStyle)> {
    let method = method.filter(|m| is_typed(*m))?;
    match Request::decode(method, &frame.body)? {
        Ok(d) => Some(d),
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

/// Sends `req` upstream: as received, re-encoded (`changed`, or `reencode = "always"`),
/// or as bounded parts of a batch. Returns the number of upstream calls.
#[allow(clippy::too_many_arguments)]
fn forward(
    frame: &RequestFrame,
    raw: &Bytes,
    req: &Request,
    style: BodyStyle,
    changed: bool,
    shared: &Shared,
    set: &ActiveSet,
    arm: usize,
    out: &mut BytesMut,
) -> usize {
    // An attachment cannot be cut with the keys; batch calls never carry one.
    if frame.attachment.is_empty() {
        let points = split::points(
            req,
            shared.cfg.max_batch_keys,
            &shared.policy,
            &set.arms[arm],
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
    if changed || shared.cfg.reencode == Reencode::Always {
        write_request(frame, req, style, out);
    } else {
        out.extend_from_slice(raw);
    }
    1
}

/// Put bytes a forwarded put-family start holds until it is answered.
fn put_bytes(req: &Request, shared: &Shared) -> Option<InFlightBytes> {
    let bytes = match req {
        Request::PutStart(a) | Request::UpsertStart(a) => a.slice_length,
        Request::BatchPutStart(a) | Request::BatchUpsertStart(a) => a.slice_lengths.iter().sum(),
        _ => return None,
    };
    Some(InFlightBytes::take(&shared.put_bytes_in_flight, bytes))
}

/// Handles one client request: appends what goes upstream to `out`, returns what to queue.
pub fn on_request(
    frame: &RequestFrame,
    raw: &Bytes,
    method: Option<Method>,
    shared: &Shared,
    client: &mut Option<Uuid>,
    out: &mut BytesMut,
) -> Queued {
    let m = shared.metrics.method(method);
    m.requests.inc();
    let Some((req, style)) = decode_request(frame, method, m) else {
        out.extend_from_slice(raw);
        return Queued::Upstream(None);
    };
    // A connection belongs to one client process: remember its id for the calls that
    // do not carry it, so by-client arms hold for all of them.
    if let Some(id) = req.client_id() {
        *client = Some(id);
    }
    let set = shared.policy.current();
    let Some(PutDecided {
        action,
        arm,
        plugin_failed,
    }) = shared.policy.decide_put(&set, &req)
    else {
        let arm = set.pick(&client.unwrap_or_default(), req.first_key());
        set.arms[arm].metrics.requests[req.method().index()]
            .requests
            .inc();
        let lookup_keys = match &req {
            Request::GetReplicaList(a) if shared.policy.steers_lookups(&set.arms[arm]) => {
                Some(vec![a.key.clone()])
            }
            Request::BatchGetReplicaList(a) if shared.policy.steers_lookups(&set.arms[arm]) => {
                Some(a.keys.clone())
            }
            _ => None,
        };
        let parts = forward(frame, raw, &req, style, false, shared, &set, arm, out);
        let in_flight = put_bytes(&req, shared);
        return Queued::Upstream(Some(Decided {
            set,
            arm,
            fixup: None,
            plugin_failed: false,
            decided_by_plugin: false,
            lookup_keys,
            parts,
            in_flight,
            tracked: shared.eviction.as_ref().and_then(|_| Tracked::of(&req)),
        }));
    };
    let am = &set.arms[arm].metrics.requests[req.method().index()];
    am.requests.inc();
    match action {
        PutAction::Forward => {
            let parts = forward(frame, raw, &req, style, false, shared, &set, arm, out);
            let in_flight = put_bytes(&req, shared);
            Queued::Upstream(Some(Decided {
                set,
                arm,
                fixup: None,
                plugin_failed,
                decided_by_plugin: true,
                lookup_keys: None,
                parts,
                in_flight,
                tracked: shared.eviction.as_ref().and_then(|_| Tracked::of(&req)),
            }))
        }
        PutAction::Rewrite { request, fixup } => {
            let parts = forward(frame, raw, &request, style, true, shared, &set, arm, out);
            let in_flight = put_bytes(&request, shared);
            // Tracked from what went upstream: the table records the master's answer to
            // it, before denied keys are merged back (moongate's denials are not memory
            // pressure).
            Queued::Upstream(Some(Decided {
                set,
                arm,
                fixup,
                plugin_failed,
                decided_by_plugin: true,
                lookup_keys: None,
                parts,
                in_flight,
                tracked: shared.eviction.as_ref().and_then(|_| Tracked::of(&request)),
            }))
        }
        PutAction::Answer(resp) => {
            let denied = resp.error_count() as u64;
            m.error(ErrorKind::app, denied);
            am.error(ErrorKind::app, denied);
            shared
                .policy
                .note_arm_outcome(&set, &set.arms[arm], true, None);
            let mut body = BytesMut::new();
            resp.encode_body(style, &mut body);
            let mut bytes = BytesMut::with_capacity(16 + body.len());
            ResponseFrame {
                header: ResponseHeader::new(frame.header.seq_num, errc::OK, 0),
                body: body.freeze(),
                attachment: Bytes::new(),
            }
            .write(&mut bytes);
            Queued::Local(bytes.freeze())
        }
    }
}

/// Per-answer context: the metric handles and arm of the call being answered.
struct Answering<'a> {
    method: Option<Method>,
    decided: Option<&'a Decided>,
    latency: Duration,
    shared: &'a Shared,
    m: &'a MethodMetrics,
    arm: Option<(&'a Arc<ActiveSet>, &'a crate::policy::registry::Arm)>,
    am: Option<&'a MethodMetrics>,
}

impl<'a> Answering<'a> {
    fn new(
        method: Option<Method>,
        decided: Option<&'a Decided>,
        latency: Duration,
        shared: &'a Shared,
    ) -> Self {
        let arm = decided.map(|d| (&d.set, &d.set.arms[d.arm]));
        let am = arm
            .zip(method)
            .map(|((_, a), method)| &a.metrics.requests[method.index()]);
        if let Some(am) = am {
            am.latency.observe(latency.as_secs_f64());
        }
        Answering {
            method,
            decided,
            latency,
            shared,
            m: shared.metrics.method(method),
            arm,
            am,
        }
    }

    fn plugin_arm(&self) -> Option<(&'a Arc<ActiveSet>, &'a crate::policy::registry::Arm)> {
        self.arm
            .filter(|_| self.decided.is_some_and(|d| d.decided_by_plugin))
    }

    /// The master (or a part of a split call) failed the call as a whole.
    fn transport_error(&self, err_code: u8, body: &Bytes) {
        self.m.error(ErrorKind::rpc, 1);
        if let Some(am) = self.am {
            am.error(ErrorKind::rpc, 1);
        }
        if let Some((set, a)) = self.plugin_arm() {
            self.shared
                .policy
                .note_arm_outcome(set, a, true, Some(self.latency));
            let name = self.method.map_or("unknown", Method::name);
            self.shared.policy.observe(a, name, -900, self.latency, 0);
        }
        if tracing::enabled!(tracing::Level::DEBUG) {
            let msg = RpcError::decode(err_code, body)
                .map(|(e, _)| String::from_utf8_lossy(&e.message).into_owned())
                .unwrap_or_default();
            tracing::debug!(method = self.method.map(Method::name), err_code, %msg,
                "master answered with a transport error");
        }
    }

    /// A decoded successful reply: fix up, steer, tally, observe, then write it out
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
        let decided = self.decided;
        let fixup = decided.and_then(|d| d.fixup.as_ref());
        // The master's own answer (before fixup and steering) says what it stores.
        if let (Some(ev), Some(t)) = (
            &self.shared.eviction,
            decided.and_then(|d| d.tracked.as_ref()),
        ) {
            ev.record(t, &resp, decided.map_or(0, |d| d.arm));
        }
        if let Some(f) = fixup {
            resp = f.apply(resp);
        }
        let mut steered = false;
        if let (Some((_, a)), Some(keys)) =
            (self.arm, decided.and_then(|d| d.lookup_keys.as_deref()))
        {
            steered = self.shared.policy.steer_lookup(a, keys, &mut resp);
        }
        if let Some((_, a)) = self.arm {
            let tally = crate::tiers::Tally::of(&resp);
            if !tally.is_empty() {
                a.metrics.add_tally(&tally);
            }
        }
        let errors = resp.error_count() as u64;
        self.m.error(ErrorKind::app, errors);
        if let Some(am) = self.am {
            am.error(ErrorKind::app, errors);
        }
        if let Some((set, a)) = self.plugin_arm() {
            let failed = errors > 0 || decided.is_some_and(|d| d.plugin_failed);
            self.shared
                .policy
                .note_arm_outcome(set, a, failed, Some(self.latency));
            let outcome = resp.first_error().map_or(0, |e| e.0);
            self.shared.policy.observe(
                a,
                resp.method().name(),
                outcome,
                self.latency,
                resp.key_count(),
            );
        }
        match raw {
            Some(raw)
                if fixup.is_none() && !steered && self.shared.cfg.reencode != Reencode::Always =>
            {
                out.extend_from_slice(raw)
            }
            _ => {
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

/// Handles one master response: appends what goes to the client to `out`.
pub fn on_response(
    frame: &ResponseFrame,
    raw: &Bytes,
    method: Option<Method>,
    decided: Option<&Decided>,
    latency: Duration,
    shared: &Shared,
    out: &mut BytesMut,
) {
    let a = Answering::new(method, decided, latency, shared);
    if frame.header.err_code != errc::OK {
        a.transport_error(frame.header.err_code, &frame.body);
        out.extend_from_slice(raw);
        return;
    }
    let decoded = match method {
        Some(method) if is_typed(method) => match Response::decode(method, &frame.body) {
            Some(Ok(d)) => Some(d),
            Some(Err(e)) => {
                a.m.error(ErrorKind::decode, 1);
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
    a.reply(resp, style, frame.header, &frame.attachment, Some(raw), out);
}

/// Handles the merged answers of a split batch call (request `seq`): one reply out.
pub fn on_merged(
    seq: u32,
    merged: Merged,
    method: Option<Method>,
    decided: Option<&Decided>,
    latency: Duration,
    shared: &Shared,
    out: &mut BytesMut,
) {
    let a = Answering::new(method, decided, latency, shared);
    match merged {
        Merged::Failed(frame) => {
            let err_code = frame.get(2).copied().unwrap_or(errc::RPC_THROW_EXCEPTION);
            let body = frame.slice(frame.len().min(16)..);
            a.transport_error(err_code, &body);
            out.extend_from_slice(&frame);
        }
        Merged::Reply(resp, style) => {
            let header = ResponseHeader::new(seq, errc::OK, 0);
            a.reply(resp, style, header, &Bytes::new(), None, out);
        }
    }
}

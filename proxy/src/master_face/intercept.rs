//! What happens to one frame on its way through the master face: decode (typed methods),
//! ask the policy (put family), account, and choose the bytes to forward or the answer
//! to give.
//!
//! Pure functions over frames, decoded values and metric handles: no sockets, no tasks.
//!
//! Phase order for a request: accept -> check/split (connection) -> classify (method) ->
//! decode -> policy (PutStart, BatchPutStart, UpsertStart, BatchUpsertStart) -> forward
//! (received bytes, re-encoded rewrite) or answer locally (denied). For a response:
//! check/split -> match seq -> decode -> merge denied keys back (partial batch denial) ->
//! observe (latency, errors, arm guardrail) -> forward.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};

use super::Shared;
use crate::codec::frame::errc;
use crate::codec::message::{Request, Response, RpcError, is_typed};
use crate::codec::types::Uuid;
use crate::codec::{BodyStyle, Method, RequestFrame, ResponseFrame, ResponseHeader};
use crate::config::Reencode;
use crate::metrics::{ErrorKind, MethodMetrics};
use crate::policy::registry::{ActiveSet, PutDecided};
use crate::policy::{Fixup, PutAction};

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
        if shared.cfg.reencode == Reencode::Always {
            write_request(frame, &req, style, out);
        } else {
            out.extend_from_slice(raw);
        }
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
        return Queued::Upstream(Some(Decided {
            set,
            arm,
            fixup: None,
            plugin_failed: false,
            decided_by_plugin: false,
            lookup_keys,
        }));
    };
    let am = &set.arms[arm].metrics.requests[req.method().index()];
    am.requests.inc();
    match action {
        PutAction::Forward => {
            if shared.cfg.reencode == Reencode::Always {
                write_request(frame, &req, style, out);
            } else {
                out.extend_from_slice(raw);
            }
            Queued::Upstream(Some(Decided {
                set,
                arm,
                fixup: None,
                plugin_failed,
                decided_by_plugin: true,
                lookup_keys: None,
            }))
        }
        PutAction::Rewrite { request, fixup } => {
            write_request(frame, &request, style, out);
            Queued::Upstream(Some(Decided {
                set,
                arm,
                fixup,
                plugin_failed,
                decided_by_plugin: true,
                lookup_keys: None,
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
    let m = shared.metrics.method(method);
    let arm = decided.map(|d| (&d.set, &d.set.arms[d.arm]));
    let am = arm
        .zip(method)
        .map(|((_, a), method)| &a.metrics.requests[method.index()]);
    if let Some(am) = am {
        am.latency.observe(latency.as_secs_f64());
    }
    if frame.header.err_code != errc::OK {
        m.error(ErrorKind::rpc, 1);
        if let Some(am) = am {
            am.error(ErrorKind::rpc, 1);
        }
        if let Some((set, a)) = arm.filter(|_| decided.is_some_and(|d| d.decided_by_plugin)) {
            shared.policy.note_arm_outcome(set, a, true, Some(latency));
            let name = method.map_or("unknown", Method::name);
            shared.policy.observe(a, name, -900, latency, 0);
        }
        if tracing::enabled!(tracing::Level::DEBUG) {
            let msg = RpcError::decode(frame.header.err_code, &frame.body)
                .map(|(e, _)| String::from_utf8_lossy(&e.message).into_owned())
                .unwrap_or_default();
            tracing::debug!(method = method.map(Method::name), err_code = frame.header.err_code, %msg,
                "master answered with a transport error");
        }
        out.extend_from_slice(raw);
        return;
    }
    let decoded = match method {
        Some(method) if is_typed(method) => match Response::decode(method, &frame.body) {
            Some(Ok(d)) => Some(d),
            Some(Err(e)) => {
                m.error(ErrorKind::decode, 1);
                tracing::debug!(%method, error = %e, "response body did not decode; relaying raw");
                None
            }
            None => None,
        },
        _ => None,
    };
    let Some((mut resp, style)) = decoded else {
        out.extend_from_slice(raw);
        return;
    };
    let fixup = decided.and_then(|d| d.fixup.as_ref());
    if let Some(f) = fixup {
        resp = f.apply(resp);
    }
    let mut steered = false;
    if let (Some((_, a)), Some(keys)) = (arm, decided.and_then(|d| d.lookup_keys.as_deref())) {
        steered = shared.policy.steer_lookup(a, keys, &mut resp);
    }
    if let Some((_, a)) = arm {
        let tally = crate::tiers::Tally::of(&resp);
        if !tally.is_empty() {
            a.metrics.add_tally(&tally);
        }
    }
    let errors = resp.error_count() as u64;
    m.error(ErrorKind::app, errors);
    if let Some(am) = am {
        am.error(ErrorKind::app, errors);
    }
    if let Some((set, a)) = arm.filter(|_| decided.is_some_and(|d| d.decided_by_plugin)) {
        let failed = errors > 0 || decided.is_some_and(|d| d.plugin_failed);
        shared
            .policy
            .note_arm_outcome(set, a, failed, Some(latency));
        let outcome = resp.first_error().map_or(0, |e| e.0);
        shared
            .policy
            .observe(a, resp.method().name(), outcome, latency, resp.key_count());
    }
    if fixup.is_some() || steered || shared.cfg.reencode == Reencode::Always {
        let mut body = BytesMut::with_capacity(frame.body.len() + 64);
        resp.encode_body(style, &mut body);
        ResponseFrame {
            header: frame.header,
            body: body.freeze(),
            attachment: frame.attachment.clone(),
        }
        .write(out);
    } else {
        out.extend_from_slice(raw);
    }
}

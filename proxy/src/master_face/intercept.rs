//! What happens to one frame on its way through the master face: decode (typed methods),
//! account, and choose the bytes to forward.
//!
//! Pure functions over frames and metrics: no sockets, no tasks. This is where policy
//! decisions (rewrite a `ReplicateConfig`, deny a put, reorder replicas) plug in; today
//! every frame is forwarded as received, or re-encoded from its decoded value when
//! `master_face.reencode = "always"`.
//!
//! Phase order for a request: accept -> check/split (connection) -> classify (method) ->
//! decode -> policy -> forward. For a response: check/split -> match seq -> decode ->
//! observe (latency, errors) -> forward.

use bytes::{Bytes, BytesMut};

use crate::codec::frame::errc;
use crate::codec::message::{Request, Response, RpcError, is_typed};
use crate::codec::{Method, RequestFrame, ResponseFrame};
use crate::config::Reencode;
use crate::metrics::{ErrorKind, MethodMetrics};

/// Appends the bytes to forward for one client request to `out`.
pub fn forward_request(
    frame: &RequestFrame,
    raw: &Bytes,
    method: Option<Method>,
    m: &MethodMetrics,
    reencode: Reencode,
    out: &mut BytesMut,
) {
    m.requests.inc();
    let decoded = match method {
        Some(method) if is_typed(method) => match Request::decode(method, &frame.body) {
            Some(Ok(d)) => Some(d),
            Some(Err(e)) => {
                // The master will answer invalid_rpc_arguments itself; relay untouched.
                m.error(ErrorKind::decode, 1);
                tracing::debug!(%method, error = %e, "request body did not decode; relaying raw");
                None
            }
            None => None,
        },
        _ => None,
    };
    match decoded {
        Some((req, style)) if reencode == Reencode::Always => {
            let mut body = BytesMut::with_capacity(frame.body.len());
            req.encode_body(style, &mut body);
            RequestFrame {
                header: frame.header,
                body: body.freeze(),
                attachment: frame.attachment.clone(),
            }
            .write(out);
        }
        _ => out.extend_from_slice(raw),
    }
}

/// Appends the bytes to forward for one master response to `out`, accounting errors.
pub fn forward_response(
    frame: &ResponseFrame,
    raw: &Bytes,
    method: Option<Method>,
    m: &MethodMetrics,
    reencode: Reencode,
    out: &mut BytesMut,
) {
    if frame.header.err_code != errc::OK {
        m.error(ErrorKind::rpc, 1);
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
    match decoded {
        Some((resp, style)) => {
            m.error(ErrorKind::app, resp.error_count() as u64);
            if reencode == Reencode::Always {
                let mut body = BytesMut::with_capacity(frame.body.len());
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
        None => out.extend_from_slice(raw),
    }
}

//! What the kv API's connections share, and the things every handler uses the same
//! way: the one mapping from client-core errors to HTTP statuses (and to the C ABI's
//! codes), and the policy's decision lifecycle for puts (decide, then finish when the
//! put has ended).

use std::sync::Arc;

use hyper::StatusCode;

use bytes::Bytes;

use crate::calls::AnswerExt;
use crate::codec::Method;
use crate::codec::message::Request;
use crate::codec::types::ErrorCode;
use crate::kv::client::{Store, StoreError};
use crate::policy::{Outcome, Sending};

/// What the face shares across connections.
pub struct KvState {
    pub store: Store,
    pub max_value_bytes: usize,
    /// Keys per `POST /v1/kv/exists` and per batch call.
    pub max_batch_keys: usize,
    /// Longest key in a path, a key list or a batch record (`kv.max_key_bytes`).
    pub max_key_bytes: usize,
    /// Value bytes per part of a batch call (see [`super::batch`]).
    pub batch_part_bytes: u64,
    /// Request bodies in progress: rate floor, per-connection share, shedding.
    pub intake: Arc<super::intake::Intake>,
    /// hyper's HTTP/1 read buffer per connection at most (`kv.http1_read_buffer_bytes`).
    pub http1_read_buffer: usize,
    /// The policies that decide placement and admission of puts, as on the master face.
    pub policy: Arc<crate::policy::registry::Registry>,
    pub metrics: Arc<crate::kv::metrics::KvMetrics>,
    /// What routers and engines say of the future (`POST /v1/hints`).
    pub hints: Arc<crate::hints::Hints>,
}

/// The one place store errors become HTTP statuses.
pub fn status_of(e: &StoreError) -> StatusCode {
    match e {
        StoreError::Busy(_)
        | StoreError::Fenced(_)
        | StoreError::MasterBusy
        | StoreError::NoLeader
        | StoreError::ConnectionShare { .. } => StatusCode::SERVICE_UNAVAILABLE,
        StoreError::Body(_) => StatusCode::BAD_REQUEST,
        StoreError::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
        StoreError::Refused(ErrorCode::NO_AVAILABLE_HANDLE) => StatusCode::INSUFFICIENT_STORAGE,
        StoreError::Refused(ErrorCode::OBJECT_ALREADY_EXISTS)
        | StoreError::Refused(ErrorCode::OBJECT_HAS_LEASE) => StatusCode::CONFLICT,
        StoreError::Refused(ErrorCode::INVALID_KEY)
        | StoreError::Refused(ErrorCode::INVALID_PARAMS) => StatusCode::BAD_REQUEST,
        StoreError::Master(crate::upstream::CallError::Timeout(_)) => StatusCode::GATEWAY_TIMEOUT,
        StoreError::Transfer(crate::kv::transport::te_tcp::TeError::Timeout { .. }) => {
            StatusCode::GATEWAY_TIMEOUT
        }
        _ => StatusCode::BAD_GATEWAY,
    }
}

/// A put-family start through the decision lifecycle, exactly as a client's call on
/// the master face: the active arm's plugin may rewrite its placement, deny keys, or
/// refuse it whole (then the decision is finished and `Answered` says with what).
pub fn decide(state: &KvState, start: Request) -> Sending {
    let set = state.policy.current();
    state.policy.decide(&set, &start, None).send(start)
}

/// What goes upstream for a put-family start the policy decided: its ticket, the
/// request (perhaps rewritten) and the fixup that puts denied keys back in the answer.
pub type Upstream = (crate::policy::Ticket, Request, Option<crate::policy::Fixup>);

/// A put-family start through the policy: what goes upstream, or, when the policy
/// refused every key, each key's code (the decision is finished then).
pub fn decide_start(state: &KvState, start: Request) -> Result<Upstream, Vec<ErrorCode>> {
    match decide(state, start) {
        Sending::Upstream {
            ticket,
            request,
            fixup,
            ..
        } => Ok((ticket, request, fixup)),
        Sending::Answered { refused, .. } => {
            Err(refused.denied.into_iter().map(|(_, c)| c).collect())
        }
    }
}

/// The one place store errors become the C ABI's answer codes (the shared-memory
/// socket's answers, views and reservations).
pub fn abi_code_of(e: &StoreError) -> i32 {
    use moongate_kv::capi::{
        MG_ERR_ARG, MG_ERR_BUSY, MG_ERR_EXISTS, MG_ERR_LEASED, MG_ERR_NO_ROOM, MG_ERR_REFUSED,
    };
    match e {
        StoreError::Busy(_)
        | StoreError::MasterBusy
        | StoreError::NoLeader
        | StoreError::Fenced(_) => MG_ERR_BUSY,
        StoreError::Refused(ErrorCode::OBJECT_ALREADY_EXISTS) => MG_ERR_EXISTS,
        StoreError::Refused(ErrorCode::OBJECT_HAS_LEASE) => MG_ERR_LEASED,
        StoreError::Refused(ErrorCode::NO_AVAILABLE_HANDLE) => MG_ERR_NO_ROOM,
        StoreError::Refused(ErrorCode::INVALID_KEY | ErrorCode::INVALID_PARAMS) => MG_ERR_ARG,
        _ => MG_ERR_REFUSED,
    }
}

/// The code a put's per-key result reports to the policy (`observe`, guardrail): 0, the
/// master's refusal, or -900 for anything else (transport, transfer, timeout).
pub fn code_of(r: Result<(), &StoreError>) -> i32 {
    match r {
        Ok(()) => 0,
        Err(StoreError::Refused(c)) => c.0,
        Err(_) => ErrorCode::RPC_FAIL.0,
    }
}

/// One put through the decision lifecycle: decide its `PutStart`, store, finish.
pub async fn decided_put<F, Fut>(
    state: &KvState,
    key: Bytes,
    len: u64,
    store: F,
) -> Result<(), StoreError>
where
    F: FnOnce(crate::codec::message::Request) -> Fut,
    Fut: std::future::Future<Output = Result<(), StoreError>>,
{
    let started = std::time::Instant::now();
    match decide(state, state.store.put_start(key, len)) {
        Sending::Upstream {
            ticket, request, ..
        } => {
            let done = store(request).await;
            ticket.finish(&Outcome::of_codes(
                Method::PutStart.name(),
                std::iter::once(code_of(done.as_ref().map(|_| ()))),
                Some(started.elapsed()),
            ));
            done
        }
        Sending::Answered { answer, .. } => Err(StoreError::Refused(
            answer
                .first_error()
                .unwrap_or(ErrorCode::NO_AVAILABLE_HANDLE),
        )),
    }
}

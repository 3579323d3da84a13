//! What the kv API's connections share, and the two things every handler uses the same
//! way: the one mapping from client-core errors to HTTP statuses, and the policy's
//! decision lifecycle for puts (decide, then settle when the put has ended).

use std::sync::Arc;
use std::time::Duration;

use hyper::StatusCode;

use bytes::Bytes;

use crate::calls::AnswerExt;
use crate::codec::message::{Request, Response};
use crate::codec::types::ErrorCode;
use crate::kv::client::{Store, StoreError};
use crate::policy::{Fixup, Ticket};

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
    /// The policies that decide placement and admission of puts, as on the master face.
    pub policy: Arc<crate::policy::registry::Registry>,
    pub metrics: Arc<crate::kv::metrics::KvMetrics>,
}

/// The one place store errors become HTTP statuses.
pub fn status_of(e: &StoreError) -> StatusCode {
    match e {
        StoreError::Busy(_) | StoreError::MasterBusy | StoreError::NoLeader => {
            StatusCode::SERVICE_UNAVAILABLE
        }
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
/// refuse it whole (`Err`: the answer it gave instead). The ticket, when a plugin
/// decided, is what [`settle`] needs once the put has ended.
#[allow(clippy::type_complexity)]
pub fn decide(
    state: &KvState,
    start: Request,
) -> (Option<Ticket>, Result<(Request, Option<Fixup>), Response>) {
    let set = state.policy.current();
    match state.policy.decide_put(&set, &start) {
        None => (None, Ok((start, None))),
        Some(d) => (Some(d.ticket), d.action.into_request(start)),
    }
}

/// The end of a decided kv put: its per-key results feed the arm's guardrail and the
/// plugin's `observe`, as for the master face (`latency`: the whole put, `None` when
/// the policy refused it and nothing went upstream).
pub fn settle<'a>(
    state: &KvState,
    ticket: Option<&Ticket>,
    method: crate::codec::Method,
    results: impl Iterator<Item = Result<(), &'a StoreError>>,
    latency: Option<Duration>,
) {
    let Some(t) = ticket else {
        return;
    };
    let (mut keys, mut code) = (0usize, 0i32);
    for r in results {
        keys += 1;
        if code == 0
            && let Err(e) = r
        {
            code = match e {
                StoreError::Refused(c) => c.0,
                _ => -900,
            };
        }
    }
    state.policy.settle(
        t,
        &crate::policy::Outcome {
            method: method.name(),
            code,
            failed: code != 0,
            latency,
            keys,
        },
    );
}

/// One put through the decision lifecycle: decide its `PutStart`, store, settle.
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
    let (ticket, decided) = decide(state, state.store.put_start(key, len));
    let (done, latency) = match decided {
        Ok((start, _)) => (store(start).await, Some(started.elapsed())),
        Err(resp) => (
            Err(StoreError::Refused(
                resp.first_error().unwrap_or(ErrorCode::NO_AVAILABLE_HANDLE),
            )),
            None,
        ),
    };
    settle(
        state,
        ticket.as_ref(),
        crate::codec::Method::PutStart,
        std::iter::once(done.as_ref().map(|_| ())),
        latency,
    );
    done
}

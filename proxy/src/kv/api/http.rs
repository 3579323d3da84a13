//! The kv face's HTTP surface: routing, body limits, and the one mapping from store
//! errors to HTTP statuses. Knows no master frames and no transfer-engine bytes.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::body::BodyError;
use super::intake::{Conn, IntakeError, Room, RoomError};
use super::state::{KvState, decided_put, status_of};
use crate::accept::{ConnLimit, Idle};
use crate::kv::client::{StoreError, Value};

/// A streamed value as a response body: polled on the connection's own task.
struct StreamedBody(crate::kv::client::transfer::Streamed);

impl hyper::body::Body for StreamedBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, std::io::Error>>> {
        self.0
            .poll_chunk(cx)
            .map(|o| o.map(|r| r.map(hyper::body::Frame::data)))
    }

    fn is_end_stream(&self) -> bool {
        self.0.remaining() == 0
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        hyper::body::SizeHint::with_exact(self.0.remaining())
    }
}

/// Every answer's body: whole, or a value streamed from its owner as it arrives.
type Body = BoxBody<Bytes, std::io::Error>;

fn reply(status: StatusCode, body: impl Into<Bytes>, ctype: &'static str) -> Response<Body> {
    let mut r = Response::new(
        Full::new(body.into())
            .map_err(|never| match never {})
            .boxed(),
    );
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(ctype),
    );
    r
}

fn error(status: StatusCode, msg: impl std::fmt::Display) -> Response<Body> {
    let body = serde_json::json!({ "error": msg.to_string() }).to_string();
    reply(status, body, "application/json")
}

/// `/v1/kv/{key}` -> the key, percent-decoded; `None` for other paths or bad escapes.
fn key_of(path: &str) -> Option<Bytes> {
    let raw = path.strip_prefix("/v1/kv/")?;
    if raw.is_empty() {
        return None;
    }
    let decoded = moongate_kv::decode_key(raw)?;
    Some(Bytes::from(decoded))
}

/// A body read under the budget and the intake's rules ([`super::body`]), or the
/// answer that refuses it.
async fn body_of(
    state: &KvState,
    conn: &Conn,
    req: Request<Incoming>,
    limit: usize,
    what: &'static str,
) -> Result<(Bytes, Room), Response<Body>> {
    let announced = announced_len(&req);
    let timeout = state.store.call_timeout();
    super::body::read(
        req.into_body(),
        announced,
        limit,
        what,
        conn,
        &state.store,
        timeout,
    )
    .await
    .map_err(|e| match e {
        BodyError::TooLarge { .. } => error(StatusCode::PAYLOAD_TOO_LARGE, e),
        BodyError::Short { .. } => error(StatusCode::BAD_REQUEST, e),
        BodyError::Stopped(e) => stopped(state, e),
        BodyError::Store(e) => {
            if matches!(e, StoreError::BodyTimeout(_)) {
                state.metrics.body_timeouts.inc();
            }
            error(status_of(&e), e)
        }
    })
}

/// The answer to a body the intake stopped (below the rate floor, or shed).
fn stopped(state: &KvState, e: IntakeError) -> Response<Body> {
    state.metrics.body_timeouts.inc();
    error(StatusCode::REQUEST_TIMEOUT, e)
}

fn announced_len<B>(req: &Request<B>) -> Option<u64> {
    req.headers()
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}

/// Counts the answer by op and status class.
async fn counted(state: Arc<KvState>, conn: Arc<Conn>, req: Request<Incoming>) -> Response<Body> {
    use crate::kv::metrics::Op;
    let op = match (req.method(), req.uri().path()) {
        (&Method::GET, _) => Op::Get,
        (&Method::PUT, _) => Op::Put,
        (&Method::DELETE, _) => Op::Delete,
        (_, "/v1/kv/batch/get") => Op::BatchGet,
        (_, "/v1/kv/batch/put") => Op::BatchPut,
        _ => Op::Exists,
    };
    let metrics = state.metrics.clone();
    let r = route(state, &conn, req).await;
    metrics.request(op, r.status().as_u16());
    r
}

/// `PUT /v1/kv/{key}`: a body announced at [`STREAM_PUT_FROM`] bytes or more is passed
/// on to the replicas as it arrives; smaller or unannounced ones are read whole first.
async fn put(state: &KvState, conn: &Conn, key: Bytes, req: Request<Incoming>) -> Response<Body> {
    let announced = announced_len(&req);
    if announced.is_some_and(|n| n > state.max_value_bytes as u64) {
        return error(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "body over {} bytes (kv.max_value_bytes)",
                state.max_value_bytes
            ),
        );
    }
    let done = match announced {
        Some(len) if len >= STREAM_PUT_FROM => {
            let (body, tracked) = conn.body(req.into_body());
            let room = match conn.reserve(&state.store, &tracked, len).await {
                Ok(r) => r,
                Err(RoomError::Store(e)) => return error(status_of(&e), e),
                Err(RoomError::Stopped(e)) => return stopped(state, e),
            };
            let done = decided_put(state, key.clone(), len, |start| {
                state.store.put_streamed(key, len, body, start)
            })
            .await;
            drop(room);
            // The put reports the break as its own; the intake knows why it broke.
            if done.is_err()
                && let Some(why) = tracked.stopped()
            {
                return stopped(state, why);
            }
            done
        }
        _ => {
            let (value, room) = match body_of(
                state,
                conn,
                req,
                state.max_value_bytes,
                "kv.max_value_bytes",
            )
            .await
            {
                Ok(b) => b,
                Err(r) => return r,
            };
            if value.is_empty() {
                return error(StatusCode::BAD_REQUEST, "empty value");
            }
            let len = value.len() as u64;
            let done = decided_put(state, key.clone(), len, |start| {
                state.store.put(key, value, start)
            })
            .await;
            drop(room);
            done
        }
    };
    match done {
        Ok(()) => reply(StatusCode::CREATED, "", "text/plain"),
        Err(e) => error(status_of(&e), e),
    }
}

/// Announced PUT bodies from this size on stream to the replicas.
const STREAM_PUT_FROM: u64 = 1 << 20;

/// The JSON array of keys a batch call asks about, at most `kv.max_batch_keys` of at
/// most `kv.max_key_bytes` each; its body is capped to fit them (and read under the
/// budget, released once the keys are parsed).
async fn keys_of(
    state: &KvState,
    conn: &Conn,
    req: Request<Incoming>,
) -> Result<Vec<Bytes>, Response<Body>> {
    // Room for every key written with a few escapes, its quotes and a comma.
    let limit = state
        .max_batch_keys
        .saturating_mul(state.max_key_bytes.saturating_add(8))
        .saturating_add(2);
    let (raw, _room) = body_of(
        state,
        conn,
        req,
        limit,
        "kv.max_batch_keys x kv.max_key_bytes",
    )
    .await?;
    let keys: Vec<String> = serde_json::from_slice(&raw).map_err(|e| {
        error(
            StatusCode::BAD_REQUEST,
            format!("expected a JSON array of key strings: {e}"),
        )
    })?;
    if keys.len() > state.max_batch_keys {
        return Err(error(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "{} keys; at most {} per call",
                keys.len(),
                state.max_batch_keys
            ),
        ));
    }
    if keys.iter().any(String::is_empty) {
        return Err(error(StatusCode::BAD_REQUEST, "an empty key"));
    }
    if keys.iter().any(|k| k.len() > state.max_key_bytes) {
        return Err(error(
            StatusCode::BAD_REQUEST,
            format!(
                "a key over {} bytes (kv.max_key_bytes)",
                state.max_key_bytes
            ),
        ));
    }
    Ok(keys.into_iter().map(Bytes::from).collect())
}

/// `POST /v1/hints`: what the caller knows of the future, into the hint table (every
/// hint of the call, or none: 400 naming the field, 413, 429).
async fn hints(state: &KvState, conn: &Conn, req: Request<Incoming>) -> Response<Body> {
    let limit = state.hints.max_body_bytes();
    let (raw, _room) = match body_of(state, conn, req, limit, "hints.max_body_bytes").await {
        Ok(b) => b,
        Err(r) => {
            if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
                state.hints.refused_body();
            }
            return r;
        }
    };
    match state.hints.post(&raw) {
        Ok(a) => reply(
            StatusCode::OK,
            serde_json::to_vec(&a).unwrap_or_default(),
            "application/json",
        ),
        Err(e) => error(
            StatusCode::from_u16(e.status()).unwrap_or(StatusCode::BAD_REQUEST),
            e,
        ),
    }
}

async fn exists(state: &KvState, conn: &Conn, req: Request<Incoming>) -> Response<Body> {
    let keys = match keys_of(state, conn, req).await {
        Ok(k) if k.is_empty() => return reply(StatusCode::OK, "[]", "application/json"),
        Ok(k) => k,
        Err(r) => return r,
    };
    match state.store.exists(keys).await {
        Ok(v) => reply(
            StatusCode::OK,
            serde_json::to_vec(&v).unwrap_or_default(),
            "application/json",
        ),
        Err(e) => error(status_of(&e), e),
    }
}

/// `POST /v1/kv/batch/get`: one `BatchGetReplicaList`, then the values streamed as
/// records in key order, part by part under the byte budget ([`super::batch`]).
async fn batch_get(state: Arc<KvState>, conn: &Conn, req: Request<Incoming>) -> Response<Body> {
    let keys = match keys_of(&state, conn, req).await {
        Ok(k) if k.is_empty() => return reply(StatusCode::OK, "", super::records::CONTENT_TYPE),
        Ok(k) => k,
        Err(r) => return r,
    };
    let located = match state.store.locate_many(keys.clone()).await {
        Ok(l) => l,
        Err(e) => return error(status_of(&e), e),
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(8);
    tokio::spawn(super::batch::get_parts(state, keys, located, tx));
    let frames = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, std::io::Error>(hyper::body::Frame::data(b)), rx))
    });
    let mut r = Response::new(StreamBody::new(frames).boxed());
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(super::records::CONTENT_TYPE),
    );
    r
}

/// `POST /v1/kv/batch/put`: records read as they arrive and stored part by part; one
/// outcome per record. A body that breaks off is answered with its status, and the
/// outcomes of the records before the break (those were handled).
async fn batch_put(state: &KvState, conn: &Conn, req: Request<Incoming>) -> Response<Body> {
    let a = super::batch::put_parts(state, conn, req.into_body()).await;
    match a.broken {
        None => reply(
            StatusCode::OK,
            serde_json::to_vec(&a.outcomes).unwrap_or_default(),
            "application/json",
        ),
        Some((status, why)) => reply(
            status,
            serde_json::json!({ "error": why, "results": a.outcomes }).to_string(),
            "application/json",
        ),
    }
}

async fn route(state: Arc<KvState>, conn: &Conn, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    if method == Method::POST {
        match path.as_str() {
            "/v1/kv/exists" => return exists(&state, conn, req).await,
            "/v1/kv/batch/get" => return batch_get(state, conn, req).await,
            "/v1/kv/batch/put" => return batch_put(&state, conn, req).await,
            "/v1/hints" => return hints(&state, conn, req).await,
            _ => {}
        }
    }
    let Some(key) = key_of(&path) else {
        return error(
            StatusCode::NOT_FOUND,
            "no such endpoint; see docs/kv-api.md",
        );
    };
    if key.len() > state.max_key_bytes {
        return error(
            StatusCode::BAD_REQUEST,
            format!("key over {} bytes (kv.max_key_bytes)", state.max_key_bytes),
        );
    }
    match method {
        Method::GET => match state.store.get(key).await {
            Ok(Some(Value::Whole(v))) => reply(StatusCode::OK, v, "application/octet-stream"),
            Ok(Some(Value::Stream(v))) => {
                let len = v.size();
                let mut r = Response::new(StreamedBody(v).boxed());
                r.headers_mut().insert(
                    hyper::header::CONTENT_TYPE,
                    hyper::header::HeaderValue::from_static("application/octet-stream"),
                );
                r.headers_mut().insert(
                    hyper::header::CONTENT_LENGTH,
                    hyper::header::HeaderValue::from(len),
                );
                r
            }
            Ok(None) => error(StatusCode::NOT_FOUND, "no such key"),
            Err(e) => error(status_of(&e), e),
        },
        Method::PUT => put(&state, conn, key, req).await,
        Method::DELETE => match state.store.remove(key).await {
            Ok(true) => reply(StatusCode::NO_CONTENT, "", "text/plain"),
            Ok(false) => error(StatusCode::NOT_FOUND, "no such key"),
            Err(e) => error(status_of(&e), e),
        },
        _ => error(StatusCode::METHOD_NOT_ALLOWED, "GET, PUT or DELETE"),
    }
}

/// Serves the kv face on TCP until shutdown; each connection is its own task, so a bad
/// request or a broken connection affects only itself. At most `limit` connections are
/// open at once (a newcomer sheds a stalled one, or is closed at once), and each closes
/// after `idle` without bytes.
pub async fn serve(
    listener: TcpListener,
    state: Arc<KvState>,
    limit: ConnLimit,
    idle: Duration,
    shutdown: CancellationToken,
) {
    loop {
        let Some((sock, _)) = crate::accept::next(&listener, &shutdown, "kv").await else {
            return;
        };
        let Some(slot) = limit.admit() else {
            continue;
        };
        let _ = sock.set_nodelay(true);
        let state = state.clone();
        tokio::spawn(async move {
            let io = Idle::new(sock, idle).tracking(slot.progress());
            tokio::select! {
                _ = serve_conn(io, state) => {}
                _ = slot.stopped() => tracing::debug!("kv connection shed at the cap"),
            }
            drop(slot);
        });
    }
}

/// Serves the kv face on a Unix socket until shutdown (same API, no TCP stack: for an
/// engine on the same host), then removes the socket file. With `shm`, a connection
/// that opens with [`super::shm::MAGIC`] speaks the shared-memory protocol instead.
pub async fn serve_unix(
    listener: tokio::net::UnixListener,
    path: std::path::PathBuf,
    state: Arc<KvState>,
    shm: Option<Arc<super::shm::ShmLimits>>,
    limit: ConnLimit,
    idle: Duration,
    shutdown: CancellationToken,
) {
    while let Some((sock, _)) = crate::accept::next(&listener, &shutdown, "kv-unix").await {
        let Some(slot) = limit.admit() else {
            continue;
        };
        let (state, shm) = (state.clone(), shm.clone());
        tokio::spawn(async move {
            let serve = async {
                match shm {
                    Some(limits) if super::shm::starts_with_magic(&sock, idle).await => {
                        slot.keep();
                        super::shm::serve_conn(sock, state, limits, idle).await
                    }
                    _ => serve_conn(Idle::new(sock, idle).tracking(slot.progress()), state).await,
                }
            };
            tokio::select! {
                _ = serve => {}
                _ = slot.stopped() => tracing::debug!("kv unix connection shed at the cap"),
            }
            drop(slot);
        });
    }
    let _ = std::fs::remove_file(&path);
}

/// One connection, HTTP/1.1 or HTTP/2 (prior knowledge), until it ends.
pub(super) async fn serve_conn<S>(io: S, state: Arc<KvState>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    // One view of the intake per connection: its bodies' share of the budget.
    let conn = Arc::new(state.intake.conn());
    let read_buffer = state.http1_read_buffer;
    let svc = service_fn(move |req| {
        let (state, conn) = (state.clone(), conn.clone());
        async move { Ok::<_, Infallible>(counted(state, conn, req).await) }
    });
    let mut b = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    // hyper's read buffer grows to ~400 KiB per connection (its default) while a peer
    // sends faster than its body is taken (a body waiting for budget room): a thousand
    // stalled uploads held 400 MiB beyond the byte budget (kv.http1_read_buffer_bytes).
    b.http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(10))
        .max_buf_size(read_buffer);
    if let Err(e) = b.serve_connection(TokioIo::new(io), svc).await {
        tracing::debug!(error = %e, "kv connection ended with an error");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::types::ErrorCode;

    #[test]
    fn keys_from_paths() {
        assert_eq!(key_of("/v1/kv/a%2Fb"), Some(Bytes::from_static(b"a/b")));
        assert_eq!(key_of("/v1/kv/plain"), Some(Bytes::from_static(b"plain")));
        assert_eq!(key_of("/v1/kv/"), None);
        assert_eq!(key_of("/v1/kv/bad%zz"), None);
        assert_eq!(key_of("/v2/kv/x"), None);
    }

    #[test]
    fn statuses() {
        assert_eq!(
            status_of(&StoreError::Refused(ErrorCode::NO_AVAILABLE_HANDLE)),
            StatusCode::INSUFFICIENT_STORAGE
        );
        assert_eq!(status_of(&StoreError::Unexpected), StatusCode::BAD_GATEWAY);
        assert_eq!(
            status_of(&StoreError::Busy(1)),
            StatusCode::SERVICE_UNAVAILABLE
        );
    }
}

//! The admin endpoint (HTTP/1.1, loopback by default): `GET /live`, `GET /ready`,
//! `GET /metrics`. Read-only today, so it needs no token.
//!
//! `/ready` is 200 only while the upstream master answers `ServiceReady`, probed in the
//! background by [`ready_probe`]; a sidecar whose master is gone must not take traffic.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;

/// State the admin endpoint reads.
pub struct AdminState {
    pub metrics: Arc<Metrics>,
    pub ready: AtomicBool,
}

/// Keeps `state.ready` (and the `moongate_upstream_ready` gauge) in step with whether the
/// master answers, logging each change once.
pub async fn ready_probe(
    state: Arc<AdminState>,
    upstream: String,
    interval: Duration,
    timeout: Duration,
    shutdown: CancellationToken,
) {
    let mut was: Option<bool> = None;
    loop {
        let r = crate::upstream::service_ready(&upstream, timeout).await;
        let ok = r.is_ok();
        if was != Some(ok) {
            match &r {
                Ok(v) => tracing::info!(%upstream, version = %String::from_utf8_lossy(v),
                    "upstream master ready"),
                Err(e) => tracing::warn!(%upstream, error = %e, "upstream master not ready"),
            }
            was = Some(ok);
        }
        state.ready.store(ok, Ordering::Relaxed);
        state.metrics.upstream_ready.set(i64::from(ok));
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
    }
}

fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

fn route(state: &AdminState, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    if req.method() != Method::GET {
        return text(StatusCode::METHOD_NOT_ALLOWED, "only GET is served\n");
    }
    match req.uri().path() {
        "/live" => text(StatusCode::OK, "live\n"),
        "/ready" => {
            if state.ready.load(Ordering::Relaxed) {
                text(StatusCode::OK, "ready\n")
            } else {
                text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "not ready: the upstream master does not answer ServiceReady\n",
                )
            }
        }
        "/metrics" => {
            let mut r = text(StatusCode::OK, state.metrics.encode());
            r.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static(
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
            );
            r
        }
        _ => text(
            StatusCode::NOT_FOUND,
            "not found; try /live, /ready, /metrics\n",
        ),
    }
}

/// Serves the admin endpoint until shutdown. Each HTTP connection is its own task; a bad
/// request affects only that connection.
pub async fn serve(listener: TcpListener, state: Arc<AdminState>, shutdown: CancellationToken) {
    loop {
        let (sock, _) = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = listener.accept() => match r {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "admin accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let state = state.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let r = route(&state, &req);
                async move { Ok::<_, Infallible>(r) }
            });
            if let Err(e) = http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(Duration::from_secs(10))
                .serve_connection(TokioIo::new(sock), svc)
                .await
            {
                tracing::debug!(error = %e, "admin connection ended with an error");
            }
        });
    }
}

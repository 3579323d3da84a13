//! The admin endpoint (HTTP/1.1, loopback by default).
//!
//! Read: `GET /live`, `GET /ready`, `GET /status`, `GET /metrics`, `GET /plugins`,
//! `GET /experiments`.
//! Change (bearer token `admin.token`, or loopback when no token is set):
//! `POST /plugins?name=NAME[&sha256=HEX][&path=FILE | &from=oci://REF]` (component bytes
//! as the body with an optional `X-Moongate-Signature` header, a path with `PATH.minisig`
//! beside it, or a registry reference), `POST /plugins/NAME/activate`, `POST /plugins/rollback`, `PUT /experiments`.
//!
//! `/ready` is 200 only while the upstream master (with HA masters: the current leader)
//! answers `ServiceReady`, probed in the background by [`ready_probe`] (a sidecar whose
//! master is gone must not take traffic), and no client connection has had every data
//! call refused for release skew (`master_face.bridge` off: its clients cannot work).

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::policy::experiment::ExperimentSpec;
use crate::policy::registry::{Origin, Registry, RegistryError};
use crate::validate::{check_addr, positive};

/// The admin HTTP endpoint: `/live`, `/ready`, `/metrics`.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// `host:port`; loopback by default so nothing is exposed unless asked for.
    pub listen: String,
    /// How often readiness asks the master `ServiceReady`.
    pub ready_probe_interval_ms: u64,
    /// How long one readiness probe may take before it counts as a failure.
    pub ready_probe_timeout_ms: u64,
    /// Bearer token the mutating endpoints (`POST /plugins`, `PUT /experiments`, ...)
    /// require. Empty: they are refused unless the admin endpoint listens on loopback.
    pub token: String,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            listen: "127.0.0.1:9150".into(),
            ready_probe_interval_ms: 1_000,
            ready_probe_timeout_ms: 1_000,
            token: String::new(),
        }
    }
}

impl AdminConfig {
    /// Appends every problem of this section to `errs`.
    pub fn validate(&self, errs: &mut Vec<String>) {
        check_addr(errs, "admin.listen", &self.listen);
        positive(
            errs,
            "admin.ready_probe_interval_ms",
            self.ready_probe_interval_ms,
        );
        positive(
            errs,
            "admin.ready_probe_timeout_ms",
            self.ready_probe_timeout_ms,
        );
    }
}

/// Largest plugin upload accepted.
/// The request header carrying an uploaded plugin's minisign signature (base64 of the
/// `.minisig` file's text).
pub const SIGNATURE_HEADER: &str = "x-moongate-signature";

/// How long a client whose every data call was refused for release skew keeps `/ready`
/// at 503 after its last refused call (one that gave up or exited stops counting).
const SKEW_STUCK_WITHIN: Duration = Duration::from_secs(30);

/// State the admin endpoint reads.
pub struct AdminState {
    pub metrics: Arc<Metrics>,
    pub ready: AtomicBool,
    pub policy: Arc<Registry>,
    /// Bearer token for mutating endpoints; empty = loopback only.
    pub token: String,
    /// Where answered calls go: its key table and history (`GET /keys/{key}`), and
    /// the access records other members send (`POST /fleet/records`).
    pub answered: Arc<crate::answered::Sink>,
    /// The master face's peers and owners (`GET /ranks`).
    pub topology: Arc<crate::topology::Topology>,
    /// This moongate's fleet, when `[fleet]` is on (`GET /fleet`).
    pub fleet: Option<Arc<crate::fleet::Fleet>>,
    /// The hint table (`POST /hints`).
    pub hints: Arc<crate::hints::Hints>,
}

/// Keeps `state.ready` (and the `moongate_upstream_ready` gauge) in step with whether the
/// master answers, logging each change once.
pub async fn ready_probe(
    state: Arc<AdminState>,
    mut upstream: crate::upstream::Upstream,
    interval: Duration,
    timeout: Duration,
    shutdown: CancellationToken,
) {
    let mut was: Option<bool> = None;
    loop {
        // HA: ready only while a leader is known and answers.
        let addr = upstream.addr();
        let r = match &addr {
            Some(a) => crate::upstream::service_ready(a, timeout)
                .await
                .map_err(|e| e.to_string()),
            None => Err("no master leader".to_string()),
        };
        let ok = r.is_ok();
        if !ok {
            // A master that does not answer may come back empty.
            upstream.places_voided();
        }
        if was != Some(ok) {
            let at = addr.as_deref().unwrap_or("-");
            match &r {
                Ok(v) => tracing::info!(upstream = at, version = %String::from_utf8_lossy(v),
                    "upstream master ready"),
                Err(e) => tracing::warn!(upstream = at, error = %e, "upstream master not ready"),
            }
            was = Some(ok);
        }
        state.ready.store(ok, Ordering::Relaxed);
        state.metrics.master.upstream_ready.set(i64::from(ok));
        // A leader change is probed at once, not at the next interval.
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
            _ = upstream.changed() => {}
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

fn json(status: StatusCode, v: &impl serde::Serialize) -> Response<Full<Bytes>> {
    let body = serde_json::to_vec_pretty(v).unwrap_or_default();
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}

fn error(status: StatusCode, msg: impl std::fmt::Display) -> Response<Full<Bytes>> {
    json(status, &serde_json::json!({ "error": msg.to_string() }))
}

fn registry_error(e: &RegistryError) -> Response<Full<Bytes>> {
    let status = match e {
        RegistryError::UnknownPlugin(_) => StatusCode::NOT_FOUND,
        RegistryError::NoLastGood => StatusCode::CONFLICT,
        RegistryError::Untrusted { .. } => StatusCode::FORBIDDEN,
        RegistryError::Pull(_) => StatusCode::BAD_GATEWAY,
        _ => StatusCode::UNPROCESSABLE_ENTITY,
    };
    error(status, e)
}

fn query(req: &Request<Incoming>) -> std::collections::HashMap<String, String> {
    form_urlencoded::parse(req.uri().query().unwrap_or("").as_bytes())
        .into_owned()
        .collect()
}

fn authorized(state: &AdminState, req: &Request<Incoming>, loopback: bool) -> bool {
    if state.token.is_empty() {
        return loopback;
    }
    req.headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|t| t == state.token)
}

/// The answer to a call [`authorized`] refused: `what` needs the token.
fn unauthorized(what: &str) -> Response<Full<Bytes>> {
    error(
        StatusCode::UNAUTHORIZED,
        format!(
            "{what} `Authorization: Bearer <admin.token>` (or a loopback admin address when no token is set)"
        ),
    )
}

fn experiments_view(policy: &Registry) -> serde_json::Value {
    let set = policy.current();
    let arms: Vec<_> = set
        .arms
        .iter()
        .map(|a| {
            serde_json::json!({
                "name": a.name,
                "plugin": a.plugin.name(),
                "version": a.plugin.version(),
                "stopped": a.is_stopped(),
            })
        })
        .collect();
    serde_json::json!({
        "generation": set.generation,
        "experiment": set.experiment,
        "control": set.arms.get(set.control).map(|a| a.name.clone()),
        "arms": arms,
    })
}

/// `GET /status`: whether the master answers, and the client connections per Mooncake
/// release their calls' layouts identify.
fn status_view(state: &AdminState) -> serde_json::Value {
    let (open, since) = state.metrics.master.schema_counts();
    let by_release = |n: &dyn Fn(usize) -> serde_json::Value| {
        crate::codec::Schema::ALL
            .iter()
            .enumerate()
            .map(|(i, s)| (s.label().to_string(), n(i)))
            .collect::<serde_json::Map<String, serde_json::Value>>()
    };
    serde_json::json!({
        "ready": state.ready.load(Ordering::Relaxed),
        "connections_open": state.metrics.master.connections_open.get(),
        "connections_by_release": by_release(&|i| open[i].into()),
        "connections_identified_since_start": by_release(&|i| since[i].into()),
    })
}

/// `GET /keys/{key}[?tenant=T]`: what this moongate knows of one key (its table entry,
/// or the last end it saw). Key names describe the workload, so off loopback it needs
/// the token, like the changing endpoints.
fn key_view(
    state: &AdminState,
    req: &Request<Incoming>,
    raw: &str,
    loopback: bool,
) -> Response<Full<Bytes>> {
    if !authorized(state, req, loopback) {
        return unauthorized("key history needs");
    }
    let Some(ev) = state.answered.keys() else {
        return error(
            StatusCode::NOT_FOUND,
            "no key table: it is kept with [eviction] enabled = true",
        );
    };
    let Some(key) = moongate_kv::decode_key(raw) else {
        return error(
            StatusCode::BAD_REQUEST,
            "the key is not percent-encoded (a % must start two hex digits)",
        );
    };
    if key.is_empty() {
        return error(StatusCode::BAD_REQUEST, "missing key: GET /keys/{key}");
    }
    let tenant = query(req)
        .remove("tenant")
        .unwrap_or_else(|| "default".into());
    json(
        StatusCode::OK,
        &ev.key_state(&Bytes::from(tenant), &Bytes::from(key)),
    )
}

async fn route(
    state: Arc<AdminState>,
    req: Request<Incoming>,
    loopback: bool,
) -> Response<Full<Bytes>> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    if method == Method::GET && path.starts_with("/keys/") {
        return key_view(&state, &req, &path["/keys/".len()..], loopback);
    }
    if method == Method::GET {
        return view(&state, &path);
    }
    if method == Method::POST && path == "/fleet/records" {
        return fleet_records(&state, req, loopback).await;
    }
    if method == Method::POST && path == "/hints" {
        return hints(&state, req, loopback).await;
    }
    let mutating = matches!(
        (method.as_str(), path.as_str()),
        ("POST", "/plugins") | ("POST", "/plugins/rollback") | ("PUT", "/experiments")
    ) || (method == Method::POST
        && path.starts_with("/plugins/")
        && path.ends_with("/activate"));
    if !mutating {
        return text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed here\n");
    }
    if !authorized(&state, &req, loopback) {
        return unauthorized("changing policies needs");
    }
    match (method.as_str(), path.as_str()) {
        ("POST", "/plugins") => load_plugin(&state, req).await,
        ("POST", "/plugins/rollback") => {
            match state.policy.rollback("requested by the admin API") {
                Ok(g) => json(StatusCode::OK, &serde_json::json!({ "generation": g })),
                Err(e) => registry_error(&e),
            }
        }
        ("PUT", "/experiments") => {
            let body = match Limited::new(req.into_body(), 1 << 20).collect().await {
                Ok(b) => b.to_bytes(),
                Err(e) => return error(StatusCode::PAYLOAD_TOO_LARGE, e),
            };
            let spec: ExperimentSpec = match serde_json::from_slice(&body) {
                Ok(s) => s,
                Err(e) => return error(StatusCode::BAD_REQUEST, format!("experiment JSON: {e}")),
            };
            match state.policy.set_experiment(spec) {
                Ok(_) => json(StatusCode::OK, &experiments_view(&state.policy)),
                Err(e) => registry_error(&e),
            }
        }
        _ => {
            let name = path
                .trim_start_matches("/plugins/")
                .trim_end_matches("/activate");
            match state.policy.activate(name) {
                Ok(g) => json(
                    StatusCode::OK,
                    &serde_json::json!({ "generation": g, "active": name }),
                ),
                Err(e) => registry_error(&e),
            }
        }
    }
}

/// The read-only endpoints (`GET`), open to anyone who reaches the admin listener.
fn view(state: &AdminState, path: &str) -> Response<Full<Bytes>> {
    match path {
        "/live" => text(StatusCode::OK, "live\n"),
        "/ready" => ready(state),
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
        "/status" => json(StatusCode::OK, &status_view(state)),
        "/plugins" => json(StatusCode::OK, &state.policy.list()),
        "/experiments" => json(StatusCode::OK, &experiments_view(&state.policy)),
        "/fleet" => json(StatusCode::OK, &fleet_view(state)),
        "/ranks" => {
            let view = state.topology.report(|p| {
                let who = p.assign.or(p.client()).unwrap_or_default();
                let (set, arm) = state.policy.arm_for(&who, None);
                set.arms
                    .get(arm)
                    .map_or_else(String::new, |a| a.name.clone())
            });
            json(StatusCode::OK, &view)
        }
        _ => text(
            StatusCode::NOT_FOUND,
            "not found; see the admin section of docs/operations.md\n",
        ),
    }
}

/// `GET /ready`: the master answers ServiceReady, and no client process had every data
/// call refused for release skew.
fn ready(state: &AdminState) -> Response<Full<Bytes>> {
    let skewed = state.topology.skew_stuck(SKEW_STUCK_WITHIN);
    if !state.ready.load(Ordering::Relaxed) {
        text(
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: the upstream master does not answer ServiceReady\n",
        )
    } else if skewed > 0 {
        text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "not ready: {skewed} client process(es) of another Mooncake \
                 release than the master's had every data call refused \
                 (master_face.bridge is off)\n"
            ),
        )
    } else {
        text(StatusCode::OK, "ready\n")
    }
}

/// `POST /plugins?name=NAME`: a component from the body, a file (`?path=`) or a registry
/// (`?from=`), checked (pin, signature) and loaded off the runtime.
async fn load_plugin(state: &AdminState, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let q = query(&req);
    let Some(name) = q.get("name").cloned() else {
        return error(StatusCode::BAD_REQUEST, "missing ?name=NAME");
    };
    let pin = q.get("sha256").cloned();
    // A signature for an uploaded body: the `.minisig` file's text, base64 (a
    // header holds no newlines). Files carry theirs beside them (`PATH.minisig`),
    // registry artifacts in their manifest.
    let header_sig = match req.headers().get(SIGNATURE_HEADER) {
        None => None,
        Some(v) => match v
            .to_str()
            .ok()
            .and_then(crate::supply::credentials::decode_base64)
            .and_then(|b| String::from_utf8(b).ok())
        {
            Some(s) => Some(s),
            None => {
                return error(
                    StatusCode::BAD_REQUEST,
                    format!("{SIGNATURE_HEADER}: not base64 of a .minisig file's text"),
                );
            }
        },
    };
    if let Some(from) = q.get("from") {
        let r = crate::policy_feed::load_reference(&state.policy, &name, from, pin, false).await;
        return match r {
            Ok(info) => json(StatusCode::OK, &info),
            Err(e @ RegistryError::Pull(_)) => error(StatusCode::BAD_GATEWAY, e),
            Err(e) => registry_error(&e),
        };
    }
    let cap = state.policy.max_plugin_bytes();
    let body = match Limited::new(req.into_body(), cap).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("body unreadable or over {cap} bytes (policy.max_plugin_bytes): {e}"),
            );
        }
    };
    let (bytes, origin) = match (q.get("path"), body.is_empty()) {
        (Some(p), true) => match tokio::fs::read(p).await {
            Ok(b) => (Bytes::from(b), Origin::file(std::path::Path::new(p))),
            Err(e) => {
                return error(StatusCode::BAD_REQUEST, format!("cannot read {p}: {e}"));
            }
        },
        (None, false) => (
            body,
            Origin {
                source: Some("upload".into()),
                signature: header_sig,
            },
        ),
        _ => {
            return error(
                StatusCode::BAD_REQUEST,
                "send the component bytes as the body, or an empty body and ?path=FILE, \
                 or ?from=oci://HOST/REPO:TAG",
            );
        }
    };
    let policy = state.policy.clone();
    match tokio::task::spawn_blocking(move || {
        policy.load_from(&name, &bytes, pin.as_deref(), &origin)
    })
    .await
    {
        Ok(Ok(info)) => json(StatusCode::OK, &info),
        Ok(Err(e)) => registry_error(&e),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e),
    }
}

/// Serves the admin endpoint until shutdown. Each HTTP connection is its own task; a bad
/// request affects only that connection.
pub async fn serve(listener: TcpListener, state: Arc<AdminState>, shutdown: CancellationToken) {
    let loopback = listener.local_addr().is_ok_and(|a| a.ip().is_loopback());
    loop {
        let Some((sock, _)) = crate::accept::next(&listener, &shutdown, "admin").await else {
            return;
        };
        let state = state.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let state = state.clone();
                async move { Ok::<_, Infallible>(route(state, req, loopback).await) }
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

/// A batch of access records is at most this big (a member sends what it gathered for
/// this one over `fleet.records_flush_ms`, at most `fleet.records_max_pending_bytes`
/// plus one record).
const MAX_RECORDS_BODY: usize = 64 << 20;

/// `POST /hints`: as the kv face's `POST /v1/hints`, for callers that reach the admin
/// endpoint only (authorized as its other writes).
async fn hints(
    state: &AdminState,
    req: Request<Incoming>,
    loopback: bool,
) -> Response<Full<Bytes>> {
    if !authorized(state, &req, loopback) {
        return unauthorized("hints need");
    }
    let max = state.hints.max_body_bytes();
    let body = match Limited::new(req.into_body(), max).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            state.hints.refused_body();
            return error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("body unreadable or over {max} bytes (hints.max_body_bytes): {e}"),
            );
        }
    };
    match state.hints.post(&body) {
        Ok(a) => json(StatusCode::OK, &a),
        Err(e) => error(
            StatusCode::from_u16(e.status()).unwrap_or(StatusCode::BAD_REQUEST),
            e.to_string(),
        ),
    }
}

/// `POST /fleet/records`: access records from another member for keys homed here
/// ([`crate::fleet::records`]). Members authenticate like the changing endpoints. A
/// batch that does not decode is refused whole with the reason; nothing of it applies.
async fn fleet_records(
    state: &AdminState,
    req: Request<Incoming>,
    loopback: bool,
) -> Response<Full<Bytes>> {
    if !authorized(state, &req, loopback) {
        return unauthorized("access records need");
    }
    let (Some(fleet), true) = (&state.fleet, state.answered.keeps_keys()) else {
        return error(
            StatusCode::NOT_FOUND,
            "this moongate takes no access records: it needs [fleet] and a key table ([eviction] or [events] on)",
        );
    };
    let body = match Limited::new(req.into_body(), MAX_RECORDS_BODY)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("body unreadable or over {MAX_RECORDS_BODY} bytes: {e}"),
            );
        }
    };
    let n = body.len() as u64;
    match crate::fleet::records::decode(body) {
        Ok(recs) => {
            fleet.metrics.records_received_bytes.inc_by(n);
            let set = state.policy.current();
            state.answered.accept(recs, |i| {
                set.arms
                    .get(i)
                    .map_or_else(|| format!("arm{i}"), |a| a.name.clone())
            });
            text(StatusCode::OK, "ok\n")
        }
        Err(e) => error(StatusCode::BAD_REQUEST, format!("access records: {e}")),
    }
}

/// `GET /fleet`: the members this moongate sees, each arm's lookups and hits added up
/// across them, and each arm against the control ([`crate::fleet::report`]).
fn fleet_view(state: &AdminState) -> serde_json::Value {
    let Some(fleet) = &state.fleet else {
        return serde_json::json!({ "enabled": false });
    };
    let set = state.policy.current();
    let control = set.arms.get(set.control).map(|a| a.name.as_str());
    let mut v = crate::fleet::report(&fleet.view(), control);
    v["enabled"] = true.into();
    v["cluster"] = fleet.cfg.cluster.clone().into();
    v["me"] = fleet.me.clone().into();
    v
}

//! The task that sends what the forwarder gathered: every `fleet.records_flush_ms`, one
//! `POST /fleet/records` per member with pending records, on a kept HTTP/1.1
//! connection; after each change of the ring, the key-table entries whose home moved
//! are queued first ([`super::hand_over`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::client::conn::http1::SendRequest;
use tokio_util::sync::CancellationToken;

use super::forward::{Forwarder, Homes};

/// How long one POST may take before the batch counts as unsent.
const POST_TIMEOUT: Duration = Duration::from_secs(2);

/// Sends what is pending every `flush` until shutdown. After each change of the ring
/// the entries of `keys` whose home moved are queued first ([`super::hand_over`]),
/// and once more at shutdown with a ring without this member, whose batches then go
/// out before it returns.
pub async fn run(f: Arc<Forwarder>, keys: Arc<crate::keys::Keys>, shutdown: CancellationToken) {
    let handover = |homes: &Homes| super::hand_over::hand_over(&keys, &f, homes, &f.metrics);
    let mut conns: HashMap<String, SendRequest<Full<Bytes>>> = HashMap::new();
    let mut tick = tokio::time::interval(f.flush);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seen = 0;
    loop {
        let stopping = tokio::select! {
            _ = shutdown.cancelled() => true,
            _ = tick.tick() => false,
        };
        let mut homes = f.homes();
        if stopping && homes.shared() {
            homes = Arc::new(homes.without_me());
            handover(&homes);
        } else if homes.generation != seen {
            seen = homes.generation;
            if homes.shared() {
                handover(&homes);
            }
        }
        let batches = f.take_pending();
        if !batches.is_empty() {
            let sends = batches.into_iter().map(|(member, body)| {
                let addr = homes
                    .ring
                    .members
                    .iter()
                    .position(|m| *m == member)
                    .and_then(|i| homes.admin.get(i).cloned())
                    .unwrap_or_default();
                let conn = conns.remove(&member);
                let token = f.token.clone();
                async move {
                    let n = body.len() as u64;
                    let r = tokio::time::timeout(POST_TIMEOUT, post(conn, &addr, &token, body))
                        .await
                        .unwrap_or_else(|_| Err(format!("no answer within {POST_TIMEOUT:?}")));
                    (member, addr, n, r)
                }
            });
            for (member, addr, n, r) in futures_util::future::join_all(sends).await {
                match r {
                    Ok(c) => {
                        f.metrics.records_sent_bytes.inc_by(n);
                        conns.insert(member, c);
                    }
                    Err(e) => {
                        f.metrics.records_dropped[1].inc();
                        tracing::debug!(%member, %addr, error = %e, "fleet: records not sent");
                    }
                }
            }
        }
        if stopping {
            return;
        }
    }
}

/// One batch to one member, on `conn` when it is still open (a new connection
/// otherwise); returns the connection for the next batch.
async fn post(
    conn: Option<SendRequest<Full<Bytes>>>,
    addr: &str,
    token: &str,
    body: Bytes,
) -> Result<SendRequest<Full<Bytes>>, String> {
    if addr.is_empty() {
        return Err("the member names no admin endpoint".into());
    }
    let open = match conn {
        Some(mut c) => c.ready().await.is_ok().then_some(c),
        None => None,
    };
    let mut send = match open {
        Some(c) => c,
        None => {
            let s = tokio::net::TcpStream::connect(addr)
                .await
                .map_err(|e| format!("connect: {e}"))?;
            let _ = s.set_nodelay(true);
            let (send, driver) =
                hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(s))
                    .await
                    .map_err(|e| e.to_string())?;
            tokio::spawn(async move {
                let _ = driver.await;
            });
            send
        }
    };
    let mut b = hyper::Request::builder()
        .method(hyper::Method::POST)
        .uri("/fleet/records")
        .header(hyper::header::HOST, addr)
        .header(hyper::header::CONTENT_TYPE, "application/octet-stream");
    if !token.is_empty() {
        b = b.header(hyper::header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let req = b.body(Full::new(body)).map_err(|e| e.to_string())?;
    let resp = send.send_request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status();
    // The answer is short; read it so the connection can carry the next batch.
    let _ =
        http_body_util::BodyExt::collect(http_body_util::Limited::new(resp.into_body(), 64 << 10))
            .await;
    if !status.is_success() {
        return Err(format!("answered HTTP {status}"));
    }
    Ok(send)
}

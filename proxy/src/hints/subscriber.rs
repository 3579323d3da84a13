//! Hints from a ZeroMQ publisher: for routers that already publish (their KV events, their
//! queue), moongate connects a SUB socket to each `hints.subscribe` endpoint and takes
//! every message as one hint call. The message's last frame is the body, the same JSON
//! as `POST /v1/hints`; frames before it (a topic, a sequence number) are the
//! publisher's business. A refused message is counted like a refused POST
//! (`moongate_hints_refused_total`) and the subscriber carries on.
//!
//! Knows sockets and frames, not the table: every body goes through [`Hints::post`], so
//! the limits of a POST hold here too (size, names per call, the shared rate).

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketEvent, SocketOptions, SocketRecv, SubSocket};

use super::Hints;

/// A TCP publisher's port is tried with a plain connect first, bounded by this; only a
/// port that accepts is handed to the crate. Why: the crate retries a refused connection
/// inside its connect with its own backoff (growing to 30 s), so its connect needed a
/// tight bound, and a bounded connect can be cancelled after it subscribed. A refused
/// probe fails at once and is retried below with [`MAX_BACKOFF`], so a router that comes
/// (back) up is followed within about a second.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// The crate's connect (handshake and subscription) to a port that accepted the probe:
/// long, so it is not cancelled half-way on a loaded machine.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The first wait after a failed connection or a lost publisher; doubles up to
/// [`MAX_BACKOFF`]. A connect to a closed port costs next to nothing.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// At most one warning per subscriber this often about refused messages: a publisher
/// that sends garbage at a high rate must not flood the log (the counter has them all).
const WARN_EVERY: Duration = Duration::from_secs(10);

/// Starts one task per endpoint; each ends at `shutdown`.
pub fn start(hints: Arc<Hints>, endpoints: &[String], topic: &str, shutdown: CancellationToken) {
    for endpoint in endpoints {
        tokio::spawn(follow(
            hints.clone(),
            endpoint.clone(),
            topic.to_string(),
            shutdown.clone(),
        ));
    }
}

/// Connects, takes messages until the publisher is lost, and connects again (a new
/// socket, so the backoff is ours), until shutdown.
async fn follow(hints: Arc<Hints>, endpoint: String, topic: String, shutdown: CancellationToken) {
    let mut backoff = FIRST_BACKOFF;
    let mut warned: Option<Instant> = None;
    loop {
        let probed = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = probe(&endpoint) => r,
        };
        if let Err(e) = probed {
            tracing::debug!(%endpoint, error = %e, "hints.subscribe: cannot connect; retrying");
            if pause(&shutdown, &mut backoff).await {
                return;
            }
            continue;
        }
        let mut options = SocketOptions::default();
        options.connect_timeout(CONNECT_TIMEOUT);
        let mut socket = SubSocket::with_options(options);
        let mut monitor = socket.monitor();
        let ready = async {
            // Subscribed before connecting: the crate sends remembered subscriptions to
            // the peer on connect.
            socket.subscribe(&topic).await?;
            socket.connect(&endpoint).await
        };
        let connected = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = ready => r,
        };
        if let Err(e) = connected {
            tracing::debug!(%endpoint, error = %e, "hints.subscribe: cannot connect; retrying");
            if pause(&shutdown, &mut backoff).await {
                return;
            }
            continue;
        }
        hints.metrics.publishers.inc();
        tracing::info!(%endpoint, %topic, "hints: subscribed");
        backoff = FIRST_BACKOFF;
        let mut take = |body: &[u8]| {
            if let Err(e) = hints.post(body) {
                let now = Instant::now();
                if warned.is_none_or(|at| now.duration_since(at) >= WARN_EVERY) {
                    warned = Some(now);
                    tracing::warn!(%endpoint, error = %e,
                        "hints.subscribe: message refused (further ones counted, \
                         not logged, for 10 s)");
                }
            }
        };
        let stopped = loop {
            // Messages before the monitor, so a message and the disconnection that
            // follows it are never taken in the other order.
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break true,
                msg = socket.recv() => match msg {
                    Ok(msg) => {
                        if let Some(body) = msg.iter().last() {
                            take(body);
                        }
                    }
                    // The publisher went away or broke the protocol.
                    Err(e) => {
                        tracing::debug!(%endpoint, error = %e, "hints subscriber receive");
                        break false;
                    }
                },
                event = monitor.next() => {
                    if matches!(event, Some(SocketEvent::Disconnected(_)) | None) {
                        break false;
                    }
                }
            }
        };
        hints.metrics.publishers.dec();
        if stopped {
            return;
        }
        tracing::info!(%endpoint, "hints: publisher lost; reconnecting");
        drop(socket);
        if pause(&shutdown, &mut backoff).await {
            return;
        }
    }
}
/// Whether a `tcp://` publisher's port accepts a connection now (other transports are
/// left to the crate).
async fn probe(endpoint: &str) -> std::io::Result<()> {
    let Some(addr) = endpoint.strip_prefix("tcp://") else {
        return Ok(());
    };
    match tokio::time::timeout(PROBE_TIMEOUT, tokio::net::TcpStream::connect(addr)).await {
        Ok(r) => r.map(drop),
        Err(_) => Err(std::io::ErrorKind::TimedOut.into()),
    }
}

/// Sleeps the backoff (doubling it); true when shutdown came first.
async fn pause(shutdown: &CancellationToken, backoff: &mut Duration) -> bool {
    let wait = *backoff;
    *backoff = (*backoff * 2).min(MAX_BACKOFF);
    tokio::select! {
        _ = shutdown.cancelled() => true,
        _ = tokio::time::sleep(wait) => false,
    }
}

//! The ZeroMQ side of KV events: a PUB socket for batches and a ROUTER socket that
//! replays buffered batches, as vLLM's `ZmqEventPublisher` does.
//!
//! Replay protocol (vLLM's): a subscriber's REQ or DEALER socket sends the first sequence
//! number it missed as 8 bytes big-endian; moongate answers with one message per buffered
//! batch from that number on (`seq`, `payload`), then `END_SEQ` (-1) with an empty
//! payload. Knows sockets and bytes, not keys or plugins.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use thiserror::Error;
use tokio_util::sync::CancellationToken;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::config::EventsConfig;
use super::metrics::{EventsMetrics, Stage};
use super::wire;

#[derive(Debug, Error)]
pub enum BindError {
    #[error("events: cannot start the publisher thread: {0}")]
    Runtime(std::io::Error),
    #[error("events.{key}: cannot bind {endpoint}: {source}")]
    Bind {
        key: &'static str,
        endpoint: String,
        source: zeromq::ZmqError,
    },
}

/// Published batches kept for replay, oldest first.
type Ring = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// The PUB socket, the sequence counter and the replay buffer.
pub struct Publisher {
    socket: PubSocket,
    topic: Bytes,
    next_seq: u64,
    ring: Ring,
    ring_max: usize,
    /// Where the sockets are bound (port 0 resolved), for the log and for tests.
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
}

impl Publisher {
    /// Binds the PUB socket and, with a replay endpoint, the ROUTER socket (served by a
    /// task until `shutdown`).
    pub async fn bind(
        cfg: &EventsConfig,
        metrics: Arc<EventsMetrics>,
        shutdown: CancellationToken,
    ) -> Result<Publisher, BindError> {
        let mut socket = PubSocket::new();
        let bound = bind(&mut socket, "endpoint", &cfg.endpoint).await?;
        let ring: Ring = Arc::new(Mutex::new(VecDeque::new()));
        let mut replay_endpoint = None;
        if !cfg.replay_endpoint.is_empty() {
            let mut router = RouterSocket::new();
            let at = bind(&mut router, "replay_endpoint", &cfg.replay_endpoint).await?;
            replay_endpoint = Some(at.to_string());
            tokio::spawn(serve_replay(router, ring.clone(), metrics, shutdown));
        }
        Ok(Publisher {
            socket,
            topic: Bytes::copy_from_slice(cfg.topic.as_bytes()),
            next_seq: 0,
            ring,
            ring_max: cfg.replay_batches,
            endpoint: bound.to_string(),
            replay_endpoint,
        })
    }

    /// Publishes one encoded batch under the next sequence number and keeps it for
    /// replay. Subscribers that are too slow lose messages at the socket (PUB never
    /// waits) and can ask for them again.
    pub async fn publish(&mut self, payload: Bytes) -> Result<(), zeromq::ZmqError> {
        let seq = self.next_seq;
        self.next_seq += 1;
        {
            let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
            if ring.len() >= self.ring_max {
                ring.pop_front();
            }
            ring.push_back((seq, payload.clone()));
        }
        let msg = message(vec![
            self.topic.clone(),
            Bytes::copy_from_slice(&wire::seq_frame(seq)),
            payload,
        ]);
        self.socket.send(msg).await
    }
}

/// Binds `socket` to `endpoint` (config key `events.{key}`), naming both on failure.
async fn bind<S: Socket>(
    socket: &mut S,
    key: &'static str,
    endpoint: &str,
) -> Result<zeromq::Endpoint, BindError> {
    socket
        .bind(endpoint)
        .await
        .map_err(|source| BindError::Bind {
            key,
            endpoint: endpoint.to_string(),
            source,
        })
}

fn message(frames: Vec<Bytes>) -> ZmqMessage {
    // Never empty here, so the conversion cannot fail; an empty message would be a
    // single empty frame.
    ZmqMessage::try_from(frames).unwrap_or_else(|_| ZmqMessage::from(Bytes::new()))
}

/// Answers replay requests until shutdown. A malformed request is counted and answered
/// with the end marker alone, so the asking subscriber does not wait for its timeout.
async fn serve_replay(
    mut router: RouterSocket,
    ring: Ring,
    metrics: Arc<EventsMetrics>,
    shutdown: CancellationToken,
) {
    loop {
        let req = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = router.recv() => r,
        };
        let req = match req {
            Ok(r) => r.into_vec(),
            Err(e) => {
                metrics.error(Stage::Replay);
                tracing::debug!(error = %e, "events replay socket");
                continue;
            }
        };
        // [identity, (empty delimiter from REQ / DEALER), start seq]
        let Some(identity) = req.first().cloned() else {
            continue;
        };
        let start = req
            .last()
            .filter(|_| req.len() >= 2)
            .and_then(|f| <[u8; 8]>::try_from(f.as_ref()).ok())
            .map(u64::from_be_bytes);
        let envelope: Vec<Bytes> = if req.len() >= 3 {
            vec![identity, Bytes::new()]
        } else {
            vec![identity]
        };
        let batches: Vec<(u64, Bytes)> = match start {
            Some(start) => {
                let ring = ring.lock().unwrap_or_else(|p| p.into_inner());
                ring.iter().filter(|(s, _)| *s >= start).cloned().collect()
            }
            None => {
                metrics.error(Stage::Replay);
                Vec::new()
            }
        };
        let mut ok = true;
        for (seq, payload) in batches {
            let mut frames = envelope.clone();
            frames.push(Bytes::copy_from_slice(&wire::seq_frame(seq)));
            frames.push(payload);
            if router.send(message(frames)).await.is_err() {
                ok = false;
                break;
            }
        }
        let mut end = envelope;
        end.push(Bytes::from_static(&wire::END_SEQ));
        end.push(Bytes::new());
        if !ok || router.send(message(end)).await.is_err() {
            metrics.error(Stage::Replay);
            continue;
        }
        metrics.replays.inc();
    }
}

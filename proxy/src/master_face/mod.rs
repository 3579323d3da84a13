//! The master face: a transparent coro_rpc endpoint for unmodified Mooncake clients.
//!
//! Each accepted client connection gets exactly one upstream connection to the master
//! ([`connection`], the tokio shell); what happens to each frame is decided by the
//! connection's sans-IO [`session`]: frames of methods moongate understands are decoded
//! on the way, all others are relayed byte for byte; batches may be cut ([`split`]). Bounded: connection count,
//! frame size, in-flight requests per connection, connect and idle timeouts.

pub mod config;
pub mod connection;
pub mod metrics;
pub mod session;
mod signal;
pub mod split;

use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use config::MasterFaceConfig;
use metrics::ConnOutcome;
use metrics::MasterFaceMetrics;

/// What every connection of the face shares.
pub struct Shared {
    pub cfg: MasterFaceConfig,
    /// The master in force (fixed, or the HA leader followed through etcd).
    pub upstream: crate::upstream::Upstream,
    pub metrics: Arc<MasterFaceMetrics>,
    /// Cancelled on SIGTERM: connections stop reading requests and drain.
    pub shutdown: CancellationToken,
    /// The policies deciding on put-family calls.
    pub policy: Arc<crate::policy::registry::Registry>,
    /// Bytes of put-family starts forwarded and not yet answered, across connections
    /// (what a `split` plugin sees as in flight).
    pub put_bytes_in_flight: Arc<std::sync::atomic::AtomicU64>,
    /// Where what each answered call says goes (the key table, SSD usage, the tiers
    /// served, the fleet's access records).
    pub answered: Arc<crate::answered::Sink>,
    /// Who is behind each connection, what ranks were served, what owners offloaded.
    pub topology: Arc<crate::topology::Topology>,
    /// Relays of owners' SSD reads (`[owner_face] enabled`): lookup answers to ranks
    /// point SSD copies at them.
    pub owner_face: Option<Arc<crate::owner_face::OwnerFace>>,
}

/// Accepts client connections until `shared.shutdown` is cancelled. Connection tasks are
/// spawned on `tracker` so the caller can wait for them to drain.
pub async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, tracker: TaskTracker) {
    let limit = Arc::new(Semaphore::new(shared.cfg.max_connections));
    while let Some((sock, peer)) =
        crate::accept::next(&listener, &shared.shutdown, "master face").await
    {
        let Ok(permit) = limit.clone().try_acquire_owned() else {
            shared.metrics.connection(ConnOutcome::rejected_limit);
            tracing::warn!(%peer, max = shared.cfg.max_connections,
                "connection limit reached; closing new connection");
            drop(sock);
            continue;
        };
        let shared = shared.clone();
        tracker.spawn(async move {
            shared.metrics.connections_open.inc();
            connection::serve(sock, peer, shared.clone()).await;
            shared.metrics.connections_open.dec();
            drop(permit);
        });
    }
}

//! The owner face: moongate in front of owners' offload-read service, the path a rank
//! reads an SSD-resident value by (`batch_get_offload_object` to the endpoint its
//! lookup answer named, a transfer-engine read of the staged bytes straight from the
//! owner, `release_offload_buffer`). The master face points each SSD copy in the
//! lookup answers it gives ranks at a relay here, one listener per owner
//! ([`OwnerFace::endpoint_for`]); the relay reads each call and forwards it:
//!
//! - a read is counted (keys and bytes an owner staged from its SSD: the disk reads
//!   themselves, per moongate), cut into parts where `part_keys`, `part_bytes` or the
//!   arm's `split` hook say (the parts go to the owner in parallel, each a whole call;
//!   their answers become the one answer the rank expects, under a batch id moongate
//!   makes up and maps back to the parts' ids at the release), and paced: a read that
//!   would take the owner's staging for this moongate's ranks past `max_staged_bytes`
//!   waits for releases, at most `max_wait_ms` (never a failure);
//! - a release of a made-up id releases every part; any other call is relayed whole.
//!
//! Bytes never pass here: the rank reads the staged values from the owner's transfer
//! engine, whose address the answer carries unchanged. Owners themselves are never
//! pointed here (their own reads of their SSD stay local).
//!
//! Knows sockets and the offload-read calls ([`crate::calls::offload_read`]); not the
//! master's methods, which stay the master face's.
//!
//! Rooms: this file (the relays, one per owner, made as lookups name owners), `owner`
//! (an owner's pooled connections and one call on them), `relay` (a rank's connection
//! and calls relayed whole), `read` (a read cut, merged, paced; its release).

pub mod config;
pub mod metrics;
pub mod staged;

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::future::join_all;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, Semaphore, mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::accept::{ConnLimit, Slot};
use crate::calls::offload_read::{self, ReadAnswer, ReadCall, Release};
use crate::codec::frame::{RESPONSE_HEADER_LEN, check_request, check_response, errc};
use crate::codec::types::Uuid;
use crate::codec::{RequestFrame, RequestHeader, ResponseHeader, RpcError};
use crate::policy::registry::Registry;
use crate::topology::{IDENTIFY_WITHIN, PeerKey, Topology};

pub use config::OwnerFaceConfig;
pub use metrics::{Outcome, OwnerFaceMetrics};
use staged::{Named, Staged};

/// Batches remembered per owner (a made-up id must be found at its release); about
/// 60 bytes each by the layout, plus 8 per part of a cut read (not measured).
const MAX_BATCHES: usize = 65_536;

/// How often a read waiting for staging room looks for batches past their ttl (an
/// owner frees those without a release, so no release wakes the waiter).
const SWEEP_EVERY: Duration = Duration::from_millis(50);

/// The owner face: one relay per owner, created as lookup answers name owners.
pub struct OwnerFace {
    cfg: OwnerFaceConfig,
    metrics: Arc<OwnerFaceMetrics>,
    policy: Arc<Registry>,
    /// Who the ranks are: an experiment that assigns arms by client picks a rank's
    /// reads' `split` hook by the client id its master-face calls carried.
    topology: Arc<Topology>,
    /// By the owner's own endpoint, as the master names it.
    owners: Mutex<HashMap<Bytes, Arc<Owner>>>,
    limit: ConnLimit,
    shutdown: CancellationToken,
    tracker: TaskTracker,
    /// The clock `Owner::named_ms` counts from.
    epoch: std::time::Instant,
    /// The reaper of relays no answer names any more runs (started with the first relay).
    reaping: std::sync::Once,
}

mod owner;
mod read;
mod relay;
#[cfg(test)]
mod tests;

use owner::{Owner, lock};

impl OwnerFace {
    pub fn new(
        cfg: OwnerFaceConfig,
        metrics: Arc<OwnerFaceMetrics>,
        policy: Arc<Registry>,
        topology: Arc<Topology>,
        shutdown: CancellationToken,
    ) -> Arc<OwnerFace> {
        let limit = ConnLimit::new(
            cfg.max_connections,
            // A rank's connection waits idle between reads: never shed.
            Duration::ZERO,
            metrics.conns_refused.clone(),
            metrics.conns_shed.clone(),
            metrics.conns_open.clone(),
        );
        Arc::new(OwnerFace {
            cfg,
            metrics,
            policy,
            topology,
            owners: Mutex::new(HashMap::new()),
            limit,
            shutdown,
            tracker: TaskTracker::new(),
            epoch: std::time::Instant::now(),
            reaping: std::sync::Once::new(),
        })
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Every quarter of `idle_owner_ms`: relays no lookup answer named for that long and
    /// with no rank connection open are closed, so owners that went away (an owner that
    /// restarts comes back on another port) do not hold listeners and `max_owners`
    /// places for good.
    async fn reap(self: Arc<Self>) {
        let idle = self.cfg.idle_owner_ms;
        let every = Duration::from_millis((idle / 4).max(10));
        loop {
            tokio::select! {
                _ = self.shutdown.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            let now = self.now_ms();
            let mut owners = lock(&self.owners);
            owners.retain(|_, o| {
                let keep = now.saturating_sub(o.named_ms.load(Ordering::Relaxed)) < idle
                    || o.open.load(Ordering::Relaxed) > 0;
                if !keep {
                    o.stop.cancel();
                    self.metrics.owners.dec();
                    self.metrics.owners_retired.inc();
                    tracing::info!(owner = %o.upstream,
                        "owner face: relay closed, no lookup named this owner for idle_owner_ms");
                }
                keep
            });
        }
    }

    /// The relay's endpoint for the owner whose offload-read service is `upstream`
    /// (opening a listener for it the first time), or `None`: past `max_owners`, an
    /// endpoint that is not text, or no listener could be opened (each logged).
    pub fn endpoint_for(self: &Arc<Self>, upstream: &Bytes) -> Option<Bytes> {
        let mut owners = lock(&self.owners);
        if let Some(o) = owners.get(upstream) {
            o.named_ms.store(self.now_ms(), Ordering::Relaxed);
            return Some(o.advertised.clone());
        }
        if owners.len() >= self.cfg.max_owners {
            self.metrics.owners_refused.inc();
            return None;
        }
        let name = std::str::from_utf8(upstream).ok()?.to_string();
        let listener =
            std::net::TcpListener::bind((self.cfg.listen_host.as_str(), 0)).and_then(|l| {
                l.set_nonblocking(true)?;
                let port = l.local_addr()?.port();
                Ok((TcpListener::from_std(l)?, port))
            });
        let (listener, port) = match listener {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(owner = %name, error = %e,
                    "owner face: cannot open a relay; this owner is read directly");
                return None;
            }
        };
        let advertised = Bytes::from(format!("{}:{port}", self.cfg.listen_host));
        let owner = Arc::new(Owner {
            upstream: name.clone(),
            advertised: advertised.clone(),
            idle: Mutex::new(Vec::new()),
            conns: Semaphore::new(self.cfg.max_owner_connections),
            staged: Mutex::new(Staged::new(MAX_BATCHES)),
            room: Notify::new(),
            named_ms: self.now_ms().into(),
            open: 0.into(),
            stop: self.shutdown.child_token(),
        });
        owners.insert(upstream.clone(), owner.clone());
        self.metrics.owners.inc();
        tracing::info!(owner = %name, relay = %String::from_utf8_lossy(&advertised),
            "owner face: relaying this owner's SSD reads");
        self.tracker
            .spawn(self.clone().accept_loop(listener, owner));
        if self.cfg.idle_owner_ms > 0 {
            self.reaping
                .call_once(|| drop(self.tracker.spawn(self.clone().reap())));
        }
        Some(advertised)
    }

    /// Stops accepting and waits for the relays' connections to end.
    pub async fn drain(&self) {
        self.tracker.close();
        self.tracker.wait().await;
    }
}

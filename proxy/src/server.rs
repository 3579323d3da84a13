//! `moongate run`: binds the faces, starts the readiness probe, waits for a signal and
//! drains. The only place that knows every part; each part knows only its own config.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use thiserror::Error;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admin::{self, AdminState};
use crate::config::Config;
use crate::master_face::{self, Shared};
use crate::metrics::Metrics;

#[derive(Debug, Error)]
pub enum RunError {
    #[error("cannot listen on {addr} ({what}): {source}")]
    Bind {
        what: &'static str,
        addr: String,
        source: std::io::Error,
    },
    #[error("cannot install signal handlers: {0}")]
    Signal(std::io::Error),
}

async fn bind(what: &'static str, addr: &str) -> Result<TcpListener, RunError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| RunError::Bind {
            what,
            addr: addr.to_string(),
            source,
        })
}

/// Runs until SIGTERM or SIGINT, then drains within `shutdown.grace_period_ms`.
pub async fn run(cfg: Config) -> Result<(), RunError> {
    let metrics = Arc::new(Metrics::new());
    let master_listener = bind("master face", &cfg.master_face.listen).await?;
    let admin_listener = bind("admin", &cfg.admin.listen).await?;
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(RunError::Signal)?;
    let mut sigint = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .map_err(RunError::Signal)?;

    let shutdown = CancellationToken::new();
    let tracker = TaskTracker::new();
    let state = Arc::new(AdminState {
        metrics: metrics.clone(),
        ready: AtomicBool::new(false),
    });
    tokio::spawn(admin::ready_probe(
        state.clone(),
        cfg.master_face.upstream.clone(),
        Duration::from_millis(cfg.admin.ready_probe_interval_ms),
        Duration::from_millis(cfg.admin.ready_probe_timeout_ms),
        shutdown.clone(),
    ));
    tracing::info!(
        master_face = %master_listener.local_addr().map(|a| a.to_string()).unwrap_or_default(),
        admin = %admin_listener.local_addr().map(|a| a.to_string()).unwrap_or_default(),
        upstream = %cfg.master_face.upstream,
        "moongate listening"
    );
    let admin_task = tokio::spawn(admin::serve(admin_listener, state, shutdown.clone()));
    let shared = Arc::new(Shared {
        cfg: cfg.master_face.clone(),
        metrics,
        shutdown: shutdown.clone(),
    });
    let accept = tokio::spawn(master_face::accept_loop(
        master_listener,
        shared,
        tracker.clone(),
    ));

    let sig = tokio::select! {
        _ = sigterm.recv() => "SIGTERM",
        _ = sigint.recv() => "SIGINT",
    };
    let grace = Duration::from_millis(cfg.shutdown.grace_period_ms);
    tracing::info!(
        signal = sig,
        grace_ms = cfg.shutdown.grace_period_ms,
        open = tracker.len(),
        "shutting down: no new connections, draining in-flight calls"
    );
    shutdown.cancel();
    let _ = accept.await;
    tracker.close();
    if tokio::time::timeout(grace, tracker.wait()).await.is_err() {
        tracing::warn!(
            open = tracker.len(),
            "grace period over; closing the connections still open"
        );
    } else {
        tracing::info!("all connections drained");
    }
    let _ = admin_task.await;
    Ok(())
}

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
use crate::policy::registry::Registry;

/// Polls `dir` for new or changed `NAME.wasm` files (a poll, not inotify: it works the
/// same on every filesystem a ConfigMap or volume can be, and a second's delay is fine).
async fn watch_plugins(
    policy: Arc<Registry>,
    dir: std::path::PathBuf,
    every: Duration,
    shutdown: CancellationToken,
) {
    tracing::info!(dir = %dir.display(), "watching for plugins");
    loop {
        let (p, d) = (policy.clone(), dir.clone());
        let _ = tokio::task::spawn_blocking(move || p.scan_dir(&d)).await;
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}

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
    #[error("policy: {0}")]
    Policy(#[from] crate::policy::registry::RegistryError),
    #[error("own segment: {0}")]
    Segment(String),
    #[error("kv API over QUIC: {0}")]
    ApiQuic(String),
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
    // Compiling plugins takes tens of milliseconds each: off the async runtime.
    let policy = {
        let (p, e, m) = (cfg.policy.clone(), cfg.experiment.clone(), metrics.clone());
        tokio::task::spawn_blocking(move || Registry::new(p, e, m))
            .await
            .expect("policy loading does not panic")?
    };
    let master_listener = bind("master face", &cfg.master_face.listen).await?;
    let kv_listener = if cfg.kv.listen.is_empty() {
        None
    } else {
        Some(bind("kv", &cfg.kv.listen).await?)
    };
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
        policy: policy.clone(),
        token: cfg.admin.token.clone(),
    });
    if !cfg.policy.watch_dir.is_empty() {
        tokio::spawn(watch_plugins(
            policy.clone(),
            cfg.policy.watch_dir.clone().into(),
            Duration::from_millis(cfg.policy.watch_interval_ms),
            shutdown.clone(),
        ));
    }
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
    let mut segment_task = None;
    if let Some(l) = kv_listener {
        let timeout = Duration::from_millis(cfg.kv.timeout_ms);
        // Validated with the config: the URL parses.
        if let Some(md) = crate::kv::metadata::Metadata::new(&cfg.kv.metadata_url, timeout) {
            let mut store = crate::kv::store::Store::new(
                cfg.master_face.upstream.clone(),
                md,
                crate::kv::te_tcp::Pool::new(cfg.kv.te_connections_per_peer, timeout),
                timeout,
                bytes::Bytes::from(cfg.kv.tenant.clone()),
                metrics.clone(),
                crate::kv::store::Budget {
                    max_inflight_bytes: cfg.kv.max_inflight_bytes,
                    busy_wait: Duration::from_millis(cfg.kv.busy_wait_ms),
                },
            )
            .with_replica_cache(Duration::from_millis(cfg.kv.replica_cache_ms));
            let rdma = crate::kv::rdma::detect();
            metrics.kv.rdma_devices.set(rdma.device_count() as i64);
            tracing::info!(reason = %rdma.fallback_reason(),
                "transport: RDMA not used; TE-TCP to Mooncake segments, QUIC to moongates that offer it");
            if cfg.kv.quic_client {
                match crate::kv::quic::QuicPool::new(timeout, cfg.kv.quic_streams) {
                    Ok(q) => store.quic = Some(q),
                    Err(e) => {
                        tracing::warn!(error = %e, "no QUIC client; peers are reached over TE-TCP")
                    }
                }
            }
            if cfg.kv.segment_bytes > 0 {
                let (task, name, mem) =
                    own_segment(&cfg, store.client_id(), shutdown.clone()).await?;
                store.set_own_segment(name, mem);
                segment_task = Some(task);
            }
            tracing::info!(kv = %cfg.kv.listen, client_id = %store.client_id(),
                metadata = %cfg.kv.metadata_url, "kv face listening");
            let state = Arc::new(crate::kv::http::KvState {
                store,
                max_value_bytes: cfg.kv.max_value_bytes,
                max_batch_keys: cfg.kv.max_batch_keys,
                batch_part_bytes: cfg.kv.batch_part_bytes,
                policy: policy.clone(),
                metrics: metrics.clone(),
            });
            if !cfg.kv.unix_path.is_empty() {
                let path = std::path::PathBuf::from(&cfg.kv.unix_path);
                // A socket left by a previous run would make the bind fail.
                if std::fs::symlink_metadata(&path)
                    .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
                {
                    let _ = std::fs::remove_file(&path);
                }
                let ul =
                    tokio::net::UnixListener::bind(&path).map_err(|source| RunError::Bind {
                        what: "kv unix socket",
                        addr: cfg.kv.unix_path.clone(),
                        source,
                    })?;
                tracing::info!(path = %cfg.kv.unix_path, "kv face listening on a Unix socket");
                tokio::spawn(crate::kv::http::serve_unix(
                    ul,
                    path,
                    state.clone(),
                    shutdown.clone(),
                ));
            }
            if !cfg.kv.api_quic_listen.is_empty() {
                api_quic(&cfg, state.clone(), shutdown.clone())?;
            }
            tokio::spawn(crate::kv::http::serve(l, state, shutdown.clone()));
        }
    }
    let eviction = cfg.eviction.enabled.then(|| {
        let ev = crate::eviction::Eviction::new(cfg.eviction.clone(), metrics.clone());
        tokio::spawn(ev.clone().run(
            policy.clone(),
            cfg.master_face.upstream.clone(),
            shutdown.clone(),
        ));
        tracing::info!(master_metrics = %cfg.eviction.master_metrics_url,
            high_watermark = cfg.eviction.high_watermark, "eviction on");
        ev
    });
    let shared = Arc::new(Shared {
        cfg: cfg.master_face.clone(),
        metrics,
        shutdown: shutdown.clone(),
        policy,
        put_bytes_in_flight: Default::default(),
        eviction,
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
    // The segment's heartbeat task unmounts it and deletes its metadata on shutdown.
    if let Some(t) = segment_task {
        let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
    }
    let _ = admin_task.await;
    Ok(())
}

/// Serves the kv API over QUIC for remote callers; logs the certificate's SHA-256 (what
/// callers pin when the certificate is self-signed).
fn api_quic(
    cfg: &Config,
    state: Arc<crate::kv::http::KvState>,
    shutdown: CancellationToken,
) -> Result<(), RunError> {
    let err = |e: crate::kv::quic::QuicError| RunError::ApiQuic(e.to_string());
    let id = crate::kv::quic::Identity::load_or_generate(&cfg.kv.quic_cert, &cfg.kv.quic_key)
        .map_err(err)?;
    let at: std::net::SocketAddr = cfg.kv.api_quic_listen.parse().map_err(|_| {
        RunError::ApiQuic(format!("kv.api_quic_listen {:?}", cfg.kv.api_quic_listen))
    })?;
    let ep = crate::kv::api_quic::server(at, &id, &cfg.kv.api_quic_client_ca).map_err(err)?;
    let bound = ep
        .local_addr()
        .map_err(|e| RunError::ApiQuic(e.to_string()))?;
    let sha256: String = id.sha256.iter().map(|b| format!("{b:02x}")).collect();
    tracing::info!(quic = %bound, %sha256,
        client_certs = !cfg.kv.api_quic_client_ca.is_empty(), "kv API served over QUIC");
    tokio::spawn(crate::kv::api_quic::serve(ep, state, shutdown));
    Ok(())
}

/// Allocates, serves, publishes and mounts moongate's own segment; returns the task that
/// keeps it registered (and unregisters it on shutdown), its name and its memory.
async fn own_segment(
    cfg: &Config,
    client_id: crate::codec::types::Uuid,
    shutdown: CancellationToken,
) -> Result<
    (
        tokio::task::JoinHandle<()>,
        bytes::Bytes,
        Arc<crate::kv::segment::Memory>,
    ),
    RunError,
> {
    use crate::kv::{mount, segment};
    let listener = bind("segment", &cfg.kv.segment_listen).await?;
    let local = listener.local_addr().map_err(|source| RunError::Bind {
        what: "segment",
        addr: cfg.kv.segment_listen.clone(),
        source,
    })?;
    let host = local.ip().to_string();
    let name = format!("{host}:{}", local.port());
    // Any non-zero base works: peers only send it back as addresses inside the segment.
    let mem = Arc::new(segment::Memory::new(0x7e00_0000_0000, cfg.kv.segment_bytes));
    tokio::spawn(segment::serve(listener, mem.clone(), shutdown.clone()));
    let quic_entry = if cfg.kv.quic_listen.is_empty() {
        None
    } else {
        let err = |e: crate::kv::quic::QuicError| RunError::Segment(e.to_string());
        let id = crate::kv::quic::Identity::load_or_generate(&cfg.kv.quic_cert, &cfg.kv.quic_key)
            .map_err(err)?;
        let at: std::net::SocketAddr =
            cfg.kv.quic_listen.parse().map_err(|_| {
                RunError::Segment(format!("kv.quic_listen {:?}", cfg.kv.quic_listen))
            })?;
        let ep = crate::kv::quic::server(at, &id).map_err(err)?;
        let bound = ep
            .local_addr()
            .map_err(|e| RunError::Segment(e.to_string()))?;
        tracing::info!(quic = %bound, "own segment served over QUIC");
        tokio::spawn(crate::kv::quic::serve(ep, mem.clone(), shutdown.clone()));
        Some(crate::kv::quic::peer_entry(bound, &id.sha256))
    };
    let reg = Arc::new(mount::Registration {
        client_id,
        segment_id: crate::kv::store::fresh_uuid(),
        name: name.clone(),
        metadata: crate::upstream::MetricsUrl::parse(&cfg.kv.metadata_url)
            .ok_or_else(|| RunError::Segment("kv.metadata_url does not parse".into()))?,
        upstream: cfg.master_face.upstream.clone(),
        timeout: Duration::from_millis(cfg.kv.timeout_ms),
        quic_entry,
    });
    // Mounting retries in the background: the master may start after moongate.
    let task = tokio::spawn(reg.run(mem.clone(), host, local.port(), shutdown));
    Ok((task, bytes::Bytes::from(name), mem))
}

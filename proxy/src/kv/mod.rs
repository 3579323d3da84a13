//! The kv face: moongate as a native Mooncake client for engines that do not embed
//! Mooncake's client. A small HTTP API (HTTP/1.1 and HTTP/2 cleartext on one listener)
//! over the same objects unmodified Mooncake clients see:
//!
//! - `PUT /v1/kv/{key}` (body = value) -> 201; 507 when the store has no room
//!   (NO_AVAILABLE_HANDLE), 409 when the key exists (OBJECT_ALREADY_EXISTS), 413 over
//!   `kv.max_value_bytes`
//! - `GET /v1/kv/{key}` -> 200 with the value, 404 when absent
//! - `DELETE /v1/kv/{key}` -> 204, 404 when absent, 409 while a reader holds a lease
//! - `POST /v1/kv/exists` with a JSON array of keys -> JSON array of booleans
//! - `POST /v1/kv/batch/get` / `batch/put`: many keys per call in [`api::records`], moved in
//!   parts under the node's byte budget ([`api::batch`])
//!
//! With `kv.segment_bytes` > 0 moongate also owns a memory segment ([`own::segment`],
//! registered by [`own::mount`]): the master places puts from any client in it, unmodified
//! clients read it over TE-TCP, and the kv face reads and writes it without a socket.
//!
//! The same API is served over QUIC for remote callers ([`api::quic`]).
//!
//! Keys are the path segment after `/v1/kv/`, percent-decoded (UTF-8). Errors are
//! `{"error": "..."}` with a status chosen in one place ([`api::status_of`]).
//!
//! Rooms, each knowing only the ones below it:
//! - [`api`]: the HTTP / QUIC surface, batch parts, records, status mapping;
//! - [`client`]: moongate as a Mooncake client (master calls, byte budget, replica
//!   cache, the put/get protocol, metadata, the disk tier, transport choice);
//! - [`transport`]: TE-TCP, QUIC between moongates, RDMA detection;
//! - [`own`]: moongate's own segment and its registration;
//! - [`seen`]: the kv face's answered master calls as observations, for the key table
//!   (eviction, KV events, miss reasons) and the fleet's access records;
//! - [`config`], [`metrics`]: this face's config section and metric handles.
//!
//! [`start`] builds all of it from `[kv]`; the server only calls it.

pub mod api;
pub mod client;
pub mod config;
pub mod metrics;
pub mod own;
pub mod seen;
pub mod transport;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use thiserror::Error;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::codec::types::Uuid;
use crate::kv::metrics::{KvMetrics, Listener};
use crate::policy::registry::Registry;
use config::KvConfig;
use transport::quic::{Identity, QuicError};

/// Why the kv face could not start.
#[derive(Debug, Error)]
pub enum StartError {
    #[error("cannot listen on {addr} ({what}): {source}")]
    Bind {
        what: &'static str,
        addr: String,
        source: std::io::Error,
    },
    #[error("kv.metadata_url {0:?} is not http://HOST:PORT/PATH")]
    MetadataUrl(String),
    #[error("own segment: {0}")]
    Segment(String),
    #[error("kv API over QUIC: {0}")]
    ApiQuic(String),
}

/// The kv face, started.
pub struct Kv {
    /// Keeps the own segment registered; unmounts it and deletes its metadata on
    /// shutdown. Await it (bounded) before the process exits.
    pub segment_task: Option<JoinHandle<()>>,
}

/// What the kv face uses of the rest of moongate.
pub struct Uses {
    /// The policies that decide its puts, as the master face's.
    pub policy: Arc<Registry>,
    /// Where `POST /v1/hints` goes.
    pub hints: Arc<crate::hints::Hints>,
    /// Where what its master calls' answers say goes, as the master face's do.
    pub answered: Arc<crate::answered::Sink>,
    pub metrics: Arc<KvMetrics>,
}

/// How often the kv face closes idle master connections and reads its tables' sizes.
const HOUSEKEEPING: Duration = Duration::from_secs(5);

/// Builds and serves the kv face on `listener` (bound by the caller, so a bad address
/// fails start-up with the other listeners): the client core, its transports, the own
/// segment when `kv.segment_bytes` > 0, the Unix socket and the QUIC API when
/// configured. Runs until `shutdown`.
pub async fn start(
    cfg: &KvConfig,
    upstream: &crate::upstream::Upstream,
    listener: TcpListener,
    uses: Uses,
    shutdown: CancellationToken,
) -> Result<Kv, StartError> {
    let Uses {
        policy,
        hints,
        answered,
        metrics,
    } = uses;
    let timeout = Duration::from_millis(cfg.timeout_ms);
    // Validated with the config: the URL parses.
    let md = client::metadata::Metadata::new(&cfg.metadata_url, timeout)
        .ok_or_else(|| StartError::MetadataUrl(cfg.metadata_url.clone()))?
        .with_ttl(Duration::from_millis(cfg.metadata_ttl_ms));
    let idle = Duration::from_millis(cfg.idle_timeout_ms);
    let shed_after = Duration::from_millis(cfg.shed_after_ms);
    let rdma = transport::rdma::detect();
    metrics.rdma_devices.set(rdma.device_count() as i64);
    tracing::info!(reason = %rdma.fallback_reason(),
        "transport: RDMA not used; TE-TCP to Mooncake segments, QUIC to moongates that offer it");
    let quic = if cfg.quic_client {
        // With a fleet CA, this moongate shows its certificate to the segments it reaches.
        let cert = if cfg.quic_client_ca.is_empty() {
            None
        } else {
            let id = Identity::load_or_generate(&cfg.quic_cert, &cfg.quic_key)
                .map_err(|e| StartError::Segment(e.to_string()))?;
            Some(transport::quic::ClientCert::of(&id))
        };
        match transport::quic::QuicPool::new(timeout, cfg.quic_streams) {
            Ok(q) => Some(q.with_client_cert(cert)),
            Err(e) => {
                tracing::warn!(error = %e, "no QUIC client; peers are reached over TE-TCP");
                None
            }
        }
    } else {
        None
    };
    let xfer = client::Transfers::new(
        md,
        transport::te_tcp::Pool::new(cfg.te_connections_per_peer, timeout)
            .with_stripes(cfg.te_stripe_bytes),
        quic,
        metrics.clone(),
    )
    .with_disk_root(&cfg.disk_root);
    let store = client::Store::new(
        upstream.clone(),
        xfer,
        timeout,
        Bytes::from(cfg.tenant.clone()),
        metrics.clone(),
        &client::Budget {
            max_inflight_bytes: cfg.max_inflight_bytes,
            busy_wait: Duration::from_millis(cfg.busy_wait_ms),
        },
        cfg.master_connections,
    )
    .with_replica_cache(Duration::from_millis(cfg.replica_cache_ms));
    // Puts that survive a leader change: only where the leader can change.
    let store = if upstream.follows_a_leader() {
        store.with_failover(
            Duration::from_millis(cfg.failover_window_ms),
            cfg.failover_window_keys,
        )
    } else {
        store
    };
    // The key table learns of engines' traffic as of Mooncake clients'.
    let store = if answered.keeps_keys() {
        let client = store.client_id();
        store.with_heard(Arc::new(seen::Observer {
            answered,
            policy: policy.clone(),
            client,
        }))
    } else {
        store
    };
    let engines = if cfg.shm && cfg.zero_copy && !cfg.unix_path.is_empty() {
        let staging = if cfg.staging_bytes > 0 {
            let s = own::staging::Staging::new(cfg.staging_bytes).map_err(|e| {
                StartError::Segment(format!("staging area of {} bytes: {e}", cfg.staging_bytes))
            })?;
            s.mem.set_copy_threads(cfg.copy_threads());
            Some(Arc::new(s))
        } else {
            None
        };
        Some(api::zero_copy::Engines::new(
            api::zero_copy::Rules {
                lease: Duration::from_millis(cfg.lease_ms),
                max_leases: cfg.max_leases,
            },
            staging,
            metrics.clone(),
        ))
    } else {
        None
    };
    let mut segment_task = None;
    if cfg.segment_bytes > 0 {
        let (task, name, mem) =
            own_segment(cfg, upstream, store.client_id(), &metrics, shutdown.clone()).await?;
        mem.set_copy_threads(cfg.copy_threads());
        mem.fence().set_known_limit(cfg.known_keys);
        if upstream.follows_a_leader() && cfg.failover_window_ms > 0 {
            mem.fence().set_held_limit(cfg.failover_window_keys);
        }
        if cfg.prefault {
            mem.prefault_in_background();
        }
        mem.count_fenced(metrics.fenced_writes.clone());
        if let Some(e) = &engines {
            e.set_own(mem.clone());
        }
        store.xfer.set_own_segment(name, mem);
        segment_task = Some(task);
    }
    let intake = api::intake::Intake::new(
        api::intake::Rules {
            min_rate: api::intake::MinRate {
                per_second: cfg.min_body_bytes_per_second,
                grace: Duration::from_millis(cfg.min_body_grace_ms),
            },
            shed_after,
            per_connection: cfg.max_body_bytes_per_connection,
        },
        metrics.clone(),
    );
    store.set_reclaim(intake.clone());
    tracing::info!(kv = %cfg.listen, client_id = %store.client_id(),
        metadata = %cfg.metadata_url, "kv face listening");
    let state = Arc::new(api::KvState {
        store,
        max_value_bytes: cfg.max_value_bytes,
        max_batch_keys: cfg.max_batch_keys,
        max_key_bytes: cfg.max_key_bytes,
        batch_part_bytes: cfg.batch_part_bytes,
        intake,
        http1_read_buffer: cfg.http1_read_buffer_bytes,
        policy,
        metrics: metrics.clone(),
        hints,
    });
    {
        let (state, upstream, shutdown) = (state.clone(), upstream.clone(), shutdown.clone());
        tokio::spawn(
            async move { client::failover::follow(&state.store, upstream, shutdown).await },
        );
    }
    {
        let (state, shutdown) = (state.clone(), shutdown.clone());
        let idle = Duration::from_millis(cfg.master_idle_ms);
        // Often enough that an idle connection outlives its bound by a quarter at most.
        let every = if idle.is_zero() {
            HOUSEKEEPING
        } else {
            (idle / 4).clamp(Duration::from_millis(100), HOUSEKEEPING)
        };
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(every) => state.store.housekeeping(idle),
                }
            }
        });
    }
    if !cfg.unix_path.is_empty() {
        let path = std::path::PathBuf::from(&cfg.unix_path);
        // A socket left by a previous run would make the bind fail.
        if std::fs::symlink_metadata(&path)
            .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
        {
            let _ = std::fs::remove_file(&path);
        }
        let ul = tokio::net::UnixListener::bind(&path).map_err(|source| StartError::Bind {
            what: "kv unix socket",
            addr: cfg.unix_path.clone(),
            source,
        })?;
        tracing::info!(path = %cfg.unix_path, "kv face listening on a Unix socket");
        let shm = cfg.shm.then(|| {
            let limits = api::shm::ShmLimits::new(cfg);
            Arc::new(match &engines {
                Some(e) => limits.with_engines(e.clone()),
                None => limits,
            })
        });
        if let Some(e) = &engines {
            tokio::spawn(e.clone().run(state.clone(), shutdown.clone()));
        }
        tokio::spawn(api::http::serve_unix(
            ul,
            path,
            state.clone(),
            shm,
            metrics.conn_limit(Listener::Unix, cfg.max_connections, shed_after),
            idle,
            shutdown.clone(),
        ));
    }
    if !cfg.api_quic_listen.is_empty() {
        // QUIC connections are not shed: quinn closes idle ones itself.
        let limit = metrics.conn_limit(Listener::QuicApi, cfg.quic_max_connections, Duration::ZERO);
        api_quic(cfg, state.clone(), limit, shutdown.clone())?;
    }
    let limit = metrics.conn_limit(Listener::Http, cfg.max_connections, shed_after);
    tokio::spawn(api::http::serve(listener, state, limit, idle, shutdown));
    Ok(Kv { segment_task })
}

/// Serves the kv API over QUIC for remote callers; logs the certificate's SHA-256 (what
/// callers pin when the certificate is self-signed).
fn api_quic(
    cfg: &KvConfig,
    state: Arc<api::KvState>,
    limit: crate::accept::ConnLimit,
    shutdown: CancellationToken,
) -> Result<(), StartError> {
    let err = |e: QuicError| StartError::ApiQuic(e.to_string());
    let id = Identity::load_or_generate(&cfg.quic_cert, &cfg.quic_key).map_err(err)?;
    let at: std::net::SocketAddr = cfg.api_quic_listen.parse().map_err(|_| {
        StartError::ApiQuic(format!("kv.api_quic_listen {:?}", cfg.api_quic_listen))
    })?;
    let ep = api::quic::server(at, &id, &cfg.api_quic_client_ca).map_err(err)?;
    let bound = ep
        .local_addr()
        .map_err(|e| StartError::ApiQuic(e.to_string()))?;
    let sha256: String = id.sha256.iter().map(|b| format!("{b:02x}")).collect();
    tracing::info!(quic = %bound, %sha256,
        client_certs = !cfg.api_quic_client_ca.is_empty(), "kv API served over QUIC");
    tokio::spawn(api::quic::serve(ep, state, limit, shutdown));
    Ok(())
}

/// Allocates, serves, publishes and mounts moongate's own segment; returns the task that
/// keeps it registered (and unregisters it on shutdown), its name and its memory.
async fn own_segment(
    cfg: &KvConfig,
    upstream: &crate::upstream::Upstream,
    client_id: Uuid,
    metrics: &KvMetrics,
    shutdown: CancellationToken,
) -> Result<(JoinHandle<()>, Bytes, Arc<own::segment::Memory>), StartError> {
    let listener = TcpListener::bind(&cfg.segment_listen)
        .await
        .map_err(|source| StartError::Bind {
            what: "segment",
            addr: cfg.segment_listen.clone(),
            source,
        })?;
    let local = listener.local_addr().map_err(|source| StartError::Bind {
        what: "segment",
        addr: cfg.segment_listen.clone(),
        source,
    })?;
    let host = local.ip().to_string();
    let name = format!("{host}:{}", local.port());
    // Any non-zero base works: peers only send it back as addresses inside the segment.
    let mem = Arc::new(
        own::segment::Memory::new(0x7e00_0000_0000, cfg.segment_bytes, "moongate-segment")
            .map_err(|e| StartError::Segment(format!("{} bytes: {e}", cfg.segment_bytes)))?,
    );
    let tcp_limit = metrics.conn_limit(
        Listener::SegmentTcp,
        cfg.segment_max_connections,
        Duration::from_millis(cfg.shed_after_ms),
    );
    if cfg.segment_tcp {
        let idle = Duration::from_millis(cfg.idle_timeout_ms);
        tokio::spawn(own::segment::serve(
            listener,
            mem.clone(),
            tcp_limit,
            idle,
            shutdown.clone(),
        ));
    } else {
        tracing::info!(segment = %name, "own segment served over QUIC only (kv.segment_tcp = false)");
        tokio::spawn(own::segment::refuse_all(
            listener,
            tcp_limit,
            shutdown.clone(),
        ));
    }
    let quic_entry = if cfg.quic_listen.is_empty() {
        None
    } else {
        let err = |e: QuicError| StartError::Segment(e.to_string());
        let id = Identity::load_or_generate(&cfg.quic_cert, &cfg.quic_key).map_err(err)?;
        let at: std::net::SocketAddr = cfg
            .quic_listen
            .parse()
            .map_err(|_| StartError::Segment(format!("kv.quic_listen {:?}", cfg.quic_listen)))?;
        let ep = transport::quic::server(at, &id, &cfg.quic_client_ca).map_err(err)?;
        let bound = ep
            .local_addr()
            .map_err(|e| StartError::Segment(e.to_string()))?;
        tracing::info!(quic = %bound, client_certs = !cfg.quic_client_ca.is_empty(),
            "own segment served over QUIC");
        let limit = metrics.conn_limit(
            Listener::SegmentQuic,
            cfg.quic_max_connections,
            Duration::ZERO,
        );
        tokio::spawn(transport::quic::serve(
            ep,
            mem.clone(),
            limit,
            shutdown.clone(),
        ));
        Some(transport::quic::peer_entry(bound, &id.sha256))
    };
    let reg = Arc::new(own::mount::Registration {
        client_id,
        segment_id: client::fresh_uuid(),
        name: name.clone(),
        metadata: crate::upstream::HttpUrl::parse(&cfg.metadata_url)
            .ok_or_else(|| StartError::MetadataUrl(cfg.metadata_url.clone()))?,
        upstream: upstream.clone(),
        timeout: Duration::from_millis(cfg.timeout_ms),
        quic_entry,
    });
    // Mounting retries in the background: the master may start after moongate.
    let task = tokio::spawn(reg.run(mem.clone(), host, local.port(), shutdown));
    Ok((task, Bytes::from(name), mem))
}

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
    #[error("{0}")]
    Kv(#[from] crate::kv::StartError),
    #[error(transparent)]
    Events(#[from] crate::events::publisher::BindError),
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
        let (mut p, e, m) = (
            cfg.policy.clone(),
            cfg.experiment.clone(),
            metrics.policy.clone(),
        );
        p.member = cfg.fleet.member.clone();
        let fetched = crate::policy_feed::pull_configured(&p).await?;
        tokio::task::spawn_blocking(move || Registry::new_with(p, e, m, fetched))
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
    // Where the master is: fixed, or the HA leader followed through etcd.
    let upstream = match cfg.master_face.upstream_spec() {
        Ok(crate::upstream::UpstreamSpec::Etcd { endpoints, key }) => {
            let u = crate::upstream::Upstream::unknown();
            tracing::info!(?endpoints, %key, "following the master leader through etcd");
            tokio::spawn(crate::upstream::leader::follow_etcd(
                endpoints,
                key,
                u.clone(),
                metrics.upstream.clone(),
                shutdown.clone(),
            ));
            u
        }
        // Validated with the config: anything else is a fixed address.
        _ => {
            metrics.upstream.fixed(&cfg.master_face.upstream);
            crate::upstream::Upstream::fixed(&cfg.master_face.upstream)
        }
    };
    let mut events_thread = None;
    // Stopped after the connections drained, so the changes of the last calls are
    // published too.
    let events_stop = CancellationToken::new();
    let events = if cfg.events.enabled {
        let (events, thread) = crate::events::start(
            &cfg.events,
            metrics.events.clone(),
            policy.clone(),
            events_stop.clone(),
        )
        .await?;
        events_thread = Some(thread);
        Some(events)
    } else {
        None
    };
    let topology = Arc::new(crate::topology::Topology::new(metrics.topology.clone()));
    // The key table is kept for eviction and for events; the evictor runs only with
    // eviction on.
    let eviction = (cfg.eviction.enabled || events.is_some()).then(|| {
        let ev = crate::eviction::Eviction::new(
            cfg.eviction.clone(),
            metrics.eviction.clone(),
            events.clone(),
        );
        if cfg.eviction.enabled {
            tokio::spawn(ev.clone().run(
                policy.clone(),
                upstream.clone(),
                topology.clone(),
                shutdown.clone(),
            ));
            tracing::info!(master_metrics = %cfg.eviction.master_metrics_url,
                high_watermark = cfg.eviction.high_watermark, "eviction on");
        }
        ev
    });
    let mut records_task = None;
    let fleet = if cfg.fleet.enabled {
        // Validated with the config: enabled means an etcd is known.
        let endpoints = cfg
            .fleet
            .endpoints(cfg.master_face.upstream_etcd().as_deref())
            .unwrap_or_default();
        let fleet = crate::fleet::Fleet::new(
            cfg.fleet.clone(),
            metrics.fleet.clone(),
            cfg.admin.token.clone(),
        );
        if let Some(ev) = &eviction {
            ev.set_fleet(fleet.clone());
        }
        // Access records need a key table to be home to keys; without one this member
        // neither sends nor takes them.
        let records = match (&fleet.records, &eviction) {
            (Some(f), Some(ev)) => {
                let ev = ev.clone();
                let hand_over = Box::new({
                    let f = f.clone();
                    move |homes: &crate::fleet::forward::Homes| ev.hand_over(&f, homes)
                });
                records_task = Some(tokio::spawn(f.clone().run(hand_over, shutdown.clone())));
                true
            }
            _ => false,
        };
        let admin_addr = admin_listener
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        let snapshot = fleet_snapshot(policy.clone(), eviction.clone(), admin_addr, records);
        tracing::info!(member = %fleet.me, cluster = %cfg.fleet.cluster, ?endpoints, "fleet on");
        tokio::spawn(crate::fleet::membership::run(
            fleet.clone(),
            endpoints,
            snapshot,
            shutdown.clone(),
        ));
        Some(fleet)
    } else {
        None
    };
    let state = Arc::new(AdminState {
        fleet,
        metrics: metrics.clone(),
        ready: AtomicBool::new(false),
        policy: policy.clone(),
        token: cfg.admin.token.clone(),
        eviction: eviction.clone(),
        topology: topology.clone(),
    });
    if !cfg.policy.watch_dir.is_empty() {
        tokio::spawn(crate::policy_feed::watch(
            policy.clone(),
            cfg.policy.watch_dir.clone().into(),
            Duration::from_millis(cfg.policy.watch_interval_ms),
            shutdown.clone(),
        ));
    }
    tokio::spawn(admin::ready_probe(
        state.clone(),
        upstream.clone(),
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
        let kv = crate::kv::start(
            &cfg.kv,
            &upstream,
            l,
            policy.clone(),
            metrics.kv.clone(),
            shutdown.clone(),
        )
        .await?;
        segment_task = kv.segment_task;
    }
    let shared = Arc::new(Shared {
        upstream,
        cfg: cfg.master_face.clone(),
        metrics: metrics.master.clone(),
        shutdown: shutdown.clone(),
        policy,
        put_bytes_in_flight: Default::default(),
        eviction,
        topology,
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
    // A leaving member's last batches hand its entries to their next homes.
    if let Some(t) = records_task
        && tokio::time::timeout(Duration::from_secs(5), t)
            .await
            .is_err()
    {
        tracing::warn!("the fleet's last access records were not sent within 5 s");
    }
    events_stop.cancel();
    if let Some(t) = events_thread {
        let joined = tokio::task::spawn_blocking(move || t.join());
        if tokio::time::timeout(Duration::from_secs(5), joined)
            .await
            .is_err()
        {
            tracing::warn!("the events publisher did not finish within 5 s");
        }
    }
    // The segment's heartbeat task unmounts it and deletes its metadata on shutdown.
    if let Some(t) = segment_task {
        let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
    }
    let _ = admin_task.await;
    Ok(())
}

/// What this member publishes to its fleet: its key table's bytes per arm (when it keeps
/// one) and each arm's lookups and hits through it.
fn fleet_snapshot(
    policy: Arc<crate::policy::registry::Registry>,
    eviction: Option<Arc<crate::eviction::Eviction>>,
    admin: String,
    records: bool,
) -> crate::fleet::membership::Snapshot {
    Arc::new(move || {
        let set = policy.current();
        let mut rec = match &eviction {
            Some(e) => e.fleet_record(&set),
            None => crate::fleet::Record::of_arms(&set, &[]),
        };
        rec.admin = admin.clone();
        rec.records = records;
        rec
    })
}

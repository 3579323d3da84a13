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

/// Why `moongate run` could not start (each names the part and its config).
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
    let policy = load_policy(&cfg, &metrics).await?;
    let listeners = Listeners::bind(&cfg).await?;
    let mut signals = Signals::install()?;
    let shutdown = CancellationToken::new();
    let parts = Parts {
        cfg: &cfg,
        metrics: &metrics,
        policy: &policy,
        shutdown: &shutdown,
    };
    let upstream = parts.upstream();
    // Stopped after the connections drained, so the changes of the last calls are
    // published too.
    let events_stop = CancellationToken::new();
    let (events, events_thread) = parts.events(&events_stop).await?;
    let topology = Arc::new(crate::topology::Topology::new(metrics.topology.clone()));
    let hints = Arc::new(crate::hints::Hints::new(
        cfg.hints.clone(),
        cfg.kv.max_key_bytes,
        metrics.hints.clone(),
    ));
    let keys = parts.keys(events);
    let admin_addr = listeners
        .admin
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let (fleet, records, records_task) = parts.fleet(keys.as_ref(), &upstream, admin_addr);
    let answered = Arc::new(crate::answered::Sink::new(
        keys.clone(),
        records,
        topology.clone(),
    ));
    if let Some(keys) = keys {
        parts.evictor(
            &upstream,
            crate::eviction::Parts {
                keys,
                topology: topology.clone(),
                fleet: fleet.clone(),
                hints: hints.clone(),
            },
        );
    }
    parts.policy_watch();
    crate::hints::subscriber::start(
        hints.clone(),
        &cfg.hints.subscribe,
        &cfg.hints.subscribe_topic,
        shutdown.clone(),
    );
    let state = Arc::new(AdminState {
        hints: hints.clone(),
        fleet,
        metrics: metrics.clone(),
        ready: AtomicBool::new(false),
        policy: policy.clone(),
        token: cfg.admin.token.clone(),
        answered: answered.clone(),
        topology: topology.clone(),
    });
    tokio::spawn(crate::heap::settle(metrics.heap.trims(), shutdown.clone()));
    tokio::spawn(admin::ready_probe(
        state.clone(),
        upstream.clone(),
        Duration::from_millis(cfg.admin.ready_probe_interval_ms),
        Duration::from_millis(cfg.admin.ready_probe_timeout_ms),
        shutdown.clone(),
    ));
    tracing::info!(
        master_face = %listeners.master.local_addr().map(|a| a.to_string()).unwrap_or_default(),
        admin = %listeners.admin.local_addr().map(|a| a.to_string()).unwrap_or_default(),
        upstream = %cfg.master_face.upstream,
        "moongate listening"
    );
    let admin_task = tokio::spawn(admin::serve(listeners.admin, state, shutdown.clone()));
    let segment_task = match listeners.kv {
        Some(l) => parts.kv(&upstream, l, &hints, answered.clone()).await?,
        None => None,
    };
    let tracker = TaskTracker::new();
    let owner_face = cfg.owner_face.enabled.then(|| {
        crate::owner_face::OwnerFace::new(
            cfg.owner_face.clone(),
            metrics.owner_face.clone(),
            policy.clone(),
            topology.clone(),
            shutdown.clone(),
        )
    });
    let shared = Arc::new(Shared {
        owner_face: owner_face.clone(),
        upstream,
        cfg: cfg.master_face.clone(),
        metrics: metrics.master.clone(),
        shutdown: shutdown.clone(),
        policy: policy.clone(),
        put_bytes_in_flight: Default::default(),
        answered,
        topology,
    });
    let accept = tokio::spawn(master_face::accept_loop(
        listeners.master,
        shared,
        tracker.clone(),
    ));

    let sig = signals.recv().await;
    tracing::info!(
        signal = sig,
        grace_ms = cfg.shutdown.grace_period_ms,
        open = tracker.len(),
        "shutting down: no new connections, draining in-flight calls"
    );
    shutdown.cancel();
    let _ = accept.await;
    Running {
        tracker,
        owner_face,
        records_task,
        events_stop,
        events_thread,
        segment_task,
        admin_task,
    }
    .drain(Duration::from_millis(cfg.shutdown.grace_period_ms))
    .await;
    Ok(())
}

/// The plugins of `[policy]` (and `[experiment]`), pulled when configured by reference
/// and compiled off the async runtime: tens of milliseconds each.
async fn load_policy(cfg: &Config, metrics: &Metrics) -> Result<Arc<Registry>, RunError> {
    let (mut p, e, m) = (
        cfg.policy.clone(),
        cfg.experiment.clone(),
        metrics.policy.clone(),
    );
    p.member = cfg.fleet.member.clone();
    let fetched = crate::policy_feed::pull_configured(&p).await?;
    Ok(
        tokio::task::spawn_blocking(move || Registry::new_with(p, e, m, fetched))
            .await
            .expect("policy loading does not panic")?,
    )
}

/// Every listener, bound before anything starts: a taken port fails the start, not a
/// part later.
struct Listeners {
    master: TcpListener,
    kv: Option<TcpListener>,
    admin: TcpListener,
}

impl Listeners {
    async fn bind(cfg: &Config) -> Result<Self, RunError> {
        let master = bind("master face", &cfg.master_face.listen).await?;
        let kv = if cfg.kv.listen.is_empty() {
            None
        } else {
            Some(bind("kv", &cfg.kv.listen).await?)
        };
        let admin = bind("admin", &cfg.admin.listen).await?;
        Ok(Listeners { master, kv, admin })
    }
}

/// SIGTERM and SIGINT, installed at start so that a signal during start-up is not lost.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> Result<Self, RunError> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Signals {
            term: signal(SignalKind::terminate()).map_err(RunError::Signal)?,
            int: signal(SignalKind::interrupt()).map_err(RunError::Signal)?,
        })
    }

    /// The name of the first signal to arrive.
    async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}

/// What every part is built from.
struct Parts<'a> {
    cfg: &'a Config,
    metrics: &'a Arc<Metrics>,
    policy: &'a Arc<Registry>,
    shutdown: &'a CancellationToken,
}

impl Parts<'_> {
    /// Where the master is: fixed, or the HA leader followed through etcd.
    fn upstream(&self) -> crate::upstream::Upstream {
        let (cfg, metrics) = (self.cfg, self.metrics);
        match cfg.master_face.upstream_spec() {
            Ok(crate::upstream::UpstreamSpec::Etcd { endpoints, key }) => {
                let u = crate::upstream::Upstream::unknown()
                    .with_release(cfg.master_face.fixed_release());
                tracing::info!(?endpoints, %key, "following the master leader through etcd");
                tokio::spawn(crate::upstream::leader::follow_etcd(
                    endpoints,
                    key,
                    u.clone(),
                    metrics.upstream.clone(),
                    self.shutdown.clone(),
                ));
                u
            }
            // Validated with the config: anything else is a fixed address.
            _ => {
                metrics.upstream.fixed(&cfg.master_face.upstream);
                crate::upstream::Upstream::fixed(&cfg.master_face.upstream)
                    .with_release(cfg.master_face.fixed_release())
            }
        }
    }

    /// The KV events publisher and its thread, with `[events]` on.
    async fn events(
        &self,
        stop: &CancellationToken,
    ) -> Result<
        (
            Option<Arc<crate::events::Events>>,
            Option<std::thread::JoinHandle<()>>,
        ),
        RunError,
    > {
        if !self.cfg.events.enabled {
            return Ok((None, None));
        }
        let (events, thread) = crate::events::start(
            &self.cfg.events,
            self.metrics.events.clone(),
            self.policy.clone(),
            stop.clone(),
        )
        .await?;
        Ok((Some(events), Some(thread)))
    }

    /// The key table, kept for eviction and for events (`[eviction]` or `[events]` on).
    fn keys(&self, events: Option<Arc<crate::events::Events>>) -> Option<Arc<crate::keys::Keys>> {
        let cfg = &self.cfg.eviction;
        if !cfg.enabled && events.is_none() {
            return None;
        }
        let bounds = crate::keys::Bounds {
            max_keys: cfg.max_keys,
            lease_ms: cfg.lease_ms,
            history_keys: cfg.history_keys,
        };
        Some(Arc::new(crate::keys::Keys::new(
            bounds,
            self.metrics.keys.clone(),
            events,
        )))
    }

    /// The evictor over the key table, with `[eviction]` on.
    fn evictor(&self, upstream: &crate::upstream::Upstream, parts: crate::eviction::Parts) {
        let cfg = &self.cfg.eviction;
        if !cfg.enabled {
            return;
        }
        let ev = crate::eviction::Evictor::new(cfg.clone(), self.metrics.eviction.clone(), parts);
        tokio::spawn(Arc::new(ev).run(
            self.policy.clone(),
            upstream.clone(),
            self.shutdown.clone(),
        ));
        tracing::info!(master_metrics = %cfg.master_metrics_url,
            high_watermark = cfg.high_watermark, "eviction on");
    }

    /// This member of a fleet (`[fleet]` on): membership; with a key table, the access
    /// records' forwarder and its task (its handle: it sends the last records at exit).
    #[allow(clippy::type_complexity)]
    fn fleet(
        &self,
        keys: Option<&Arc<crate::keys::Keys>>,
        upstream: &crate::upstream::Upstream,
        admin_addr: String,
    ) -> (
        Option<Arc<crate::fleet::Fleet>>,
        Option<Arc<crate::fleet::forward::Forwarder>>,
        Option<tokio::task::JoinHandle<()>>,
    ) {
        let cfg = self.cfg;
        if !cfg.fleet.enabled {
            return (None, None, None);
        }
        // Validated with the config: enabled means an etcd is known.
        let endpoints = cfg
            .fleet
            .endpoints(cfg.master_face.upstream_etcd().as_deref())
            .unwrap_or_default();
        let fleet = crate::fleet::Fleet::new(
            cfg.fleet.clone(),
            self.metrics.fleet.clone(),
            cfg.admin.token.clone(),
        );
        // Access records need a key table to be home to keys; without one this member
        // neither sends nor takes them.
        let records = fleet.records.clone().filter(|_| keys.is_some());
        let records_task = match (&records, keys) {
            (Some(f), Some(keys)) => Some(tokio::spawn(crate::fleet::send::run(
                f.clone(),
                keys.clone(),
                self.shutdown.clone(),
            ))),
            _ => None,
        };
        let snapshot = crate::fleet::membership::Snapshot {
            policy: self.policy.clone(),
            keys: keys.cloned(),
            evicted: self.metrics.eviction.removed_bytes.clone(),
            admin: admin_addr,
            records: records_task.is_some(),
        };
        tracing::info!(member = %fleet.me, cluster = %cfg.fleet.cluster, ?endpoints, "fleet on");
        tokio::spawn(crate::fleet::membership::run(
            fleet.clone(),
            endpoints,
            snapshot,
            upstream.clone(),
            self.shutdown.clone(),
        ));
        (Some(fleet), records, records_task)
    }

    /// The watched plugin directory (`policy.watch_dir`), when set.
    fn policy_watch(&self) {
        let p = &self.cfg.policy;
        if p.watch_dir.is_empty() {
            return;
        }
        tokio::spawn(crate::policy_feed::watch(
            self.policy.clone(),
            p.watch_dir.clone().into(),
            Duration::from_millis(p.watch_interval_ms),
            self.shutdown.clone(),
        ));
    }

    /// The kv face on its listener; the handle of its segment's heartbeat task, which
    /// unmounts the segment on shutdown.
    async fn kv(
        &self,
        upstream: &crate::upstream::Upstream,
        listener: TcpListener,
        hints: &Arc<crate::hints::Hints>,
        answered: Arc<crate::answered::Sink>,
    ) -> Result<Option<tokio::task::JoinHandle<()>>, RunError> {
        let kv = crate::kv::start(
            &self.cfg.kv,
            upstream,
            listener,
            crate::kv::Uses {
                policy: self.policy.clone(),
                hints: hints.clone(),
                answered,
                metrics: self.metrics.kv.clone(),
            },
            self.shutdown.clone(),
        )
        .await?;
        Ok(kv.segment_task)
    }
}

/// What is left to wait for once the listeners stopped taking connections.
struct Running {
    tracker: TaskTracker,
    owner_face: Option<Arc<crate::owner_face::OwnerFace>>,
    records_task: Option<tokio::task::JoinHandle<()>>,
    events_stop: CancellationToken,
    events_thread: Option<std::thread::JoinHandle<()>>,
    segment_task: Option<tokio::task::JoinHandle<()>>,
    admin_task: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Drains in order: the connections of both faces (within `grace`), the fleet's last access
    /// records, the events of the last calls, the segment's unmount, the admin server.
    async fn drain(self, grace: Duration) {
        let tracker = self.tracker;
        tracker.close();
        let owner_face = async {
            if let Some(of) = &self.owner_face {
                of.drain().await;
            }
        };
        if tokio::time::timeout(grace, async { tokio::join!(tracker.wait(), owner_face) })
            .await
            .is_err()
        {
            tracing::warn!(
                open = tracker.len(),
                "grace period over; closing the connections still open"
            );
        } else {
            tracing::info!("all connections drained");
        }
        // A leaving member's last batches hand its entries to their next homes.
        if let Some(t) = self.records_task
            && tokio::time::timeout(Duration::from_secs(5), t)
                .await
                .is_err()
        {
            tracing::warn!("the fleet's last access records were not sent within 5 s");
        }
        self.events_stop.cancel();
        if let Some(t) = self.events_thread {
            let joined = tokio::task::spawn_blocking(move || t.join());
            if tokio::time::timeout(Duration::from_secs(5), joined)
                .await
                .is_err()
            {
                tracing::warn!("the events publisher did not finish within 5 s");
            }
        }
        // The segment's heartbeat task unmounts it and deletes its metadata on shutdown.
        if let Some(t) = self.segment_task {
            let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
        }
        let _ = self.admin_task.await;
    }
}

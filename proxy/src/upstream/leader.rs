//! Where the master is: a fixed `host:port`, or the leader of an HA deployment found
//! and followed through etcd exactly as Mooncake's client does it.
//!
//! HA masters (`mooncake_master --enable_ha`) elect a leader through etcd: the winner
//! puts its RPC address (`host:port`, raw bytes) at `mooncake-store/<cluster>/master_view`
//! under a 5 s lease; the key's `create_revision` is the view version, new at every
//! leadership change. A 0.3.14 leader first writes `__mooncake_service_warming__:<lease>`
//! and overwrites it with its address once it serves: warming is "no leader yet".
//! Following: arm a watch on the key, read it, publish, and read again at every watch
//! event; a broken watch or etcd connection is retried every second while the last
//! leader stays in force (the master is still there when only etcd is down).
//!
//! Everything that talks to the master asks [`Upstream`] for the address at connect time
//! and can wait for a change.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// The value a 0.3.14 leader publishes while it warms up (not serving yet).
pub const WARMING: &str = "__mooncake_service_warming__:";

/// The master in force.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leader {
    /// `host:port` of its RPC server.
    pub addr: String,
    /// The view version (the etcd key's `create_revision`; 0 for a fixed address).
    pub view_version: i64,
}

/// How `master_face.upstream` names the master.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpstreamSpec {
    /// A fixed `host:port`.
    Direct(String),
    /// HA masters elected through etcd: its endpoints and the key the leader is at.
    Etcd { endpoints: Vec<String>, key: String },
}

impl UpstreamSpec {
    /// Parses `host:port` or Mooncake's `etcd://H:P[;H:P...]` (`,` works too). The
    /// cluster is `cluster_id` (Mooncake's URL cannot carry it either: clients take it
    /// from `MC_STORE_CLUSTER_ID`, masters from `--cluster_id`).
    pub fn parse(s: &str, cluster_id: &str) -> Result<UpstreamSpec, String> {
        match s.split_once("://") {
            None => Ok(UpstreamSpec::Direct(s.to_string())),
            Some(("etcd", rest)) => {
                let endpoints: Vec<String> = rest
                    .split([';', ','])
                    .map(str::trim)
                    .filter(|e| !e.is_empty())
                    .map(String::from)
                    .collect();
                if endpoints.is_empty() {
                    return Err(format!("{s:?}: no etcd endpoint"));
                }
                let cluster = cluster_id.strip_suffix('/').unwrap_or(cluster_id);
                if cluster.is_empty() {
                    return Err("master_face.ha_cluster_id: empty".into());
                }
                Ok(UpstreamSpec::Etcd {
                    endpoints,
                    key: format!("mooncake-store/{cluster}/master_view"),
                })
            }
            Some(("redis" | "k8s", _)) => Err(format!(
                "{s:?}: the pinned Mooncake master elects leaders through etcd only (its \
                 wheel has no redis or k8s backend)"
            )),
            Some((scheme, _)) => Err(format!("{s:?}: unknown scheme {scheme:?} (etcd://)")),
        }
    }
}

/// The master in force, as everything that connects to it sees it.
#[derive(Clone)]
pub struct Upstream {
    rx: watch::Receiver<Option<Leader>>,
    tx: Arc<watch::Sender<Option<Leader>>>,
    /// The Mooncake release the master runs, when configured
    /// (`master_face.upstream_release`); `None`: asked of each connection that needs it.
    release: Option<crate::codec::release::MasterRelease>,
    /// Advances whenever what the master said of where values are may have become
    /// void (see [`Upstream::places_voided`]); shared by every clone.
    places: Arc<AtomicU64>,
    /// Removals relayed here that can take leased values, counted: the fleet tells the
    /// other members, whose replica lists of this master they void too.
    removals: Arc<watch::Sender<u64>>,
    /// Removals of any kind the master face relayed (unforced ones too): they end the
    /// own segment's known keys ([`Upstream::known_epoch`]).
    any_removals: Arc<AtomicU64>,
    /// Whether the master in force failed to answer moongate's last call to it
    /// (connection refused, reset or timed out): Mooncake's leader stops serving when
    /// it cannot renew its etcd lease, and while etcd is down nothing says so.
    silent: Arc<watch::Sender<bool>>,
    /// A fixed address: never a leader change.
    fixed: bool,
}

impl Upstream {
    /// A fixed master.
    pub fn fixed(addr: &str) -> Upstream {
        Upstream {
            fixed: true,
            ..Upstream::with(Some(Leader {
                addr: addr.to_string(),
                view_version: 0,
            }))
        }
    }

    /// No master known yet (a follower publishes it).
    pub fn unknown() -> Upstream {
        Upstream::with(None)
    }

    fn with(v: Option<Leader>) -> Upstream {
        let (tx, rx) = watch::channel(v);
        Upstream {
            rx,
            tx: Arc::new(tx),
            release: None,
            places: Arc::default(),
            removals: Arc::new(watch::Sender::new(0)),
            any_removals: Arc::default(),
            silent: Arc::new(watch::Sender::new(false)),
            fixed: false,
        }
    }

    /// Says whether the master in force answered a call (`false`: it did not). Cheap
    /// when nothing changes (a read of the flag).
    pub fn answered(&self, yes: bool) {
        if *self.silent.borrow() == yes {
            self.silent.send_replace(!yes);
        }
    }

    /// Follows [`Upstream::answered`]: `true` while the master in force does not answer.
    pub fn silence(&self) -> watch::Receiver<bool> {
        self.silent.subscribe()
    }

    /// Whether the master in force can change (an elected leader, followed): what the
    /// kv face's failover check is for.
    pub fn follows_a_leader(&self) -> bool {
        !self.fixed
    }

    /// The master's release is `r` (configured), not asked.
    pub fn with_release(mut self, r: Option<crate::codec::release::MasterRelease>) -> Upstream {
        self.release = r;
        self
    }

    /// The configured release of the master, if any.
    pub fn release(&self) -> Option<crate::codec::release::MasterRelease> {
        self.release
    }

    /// The master in force, if any.
    pub fn current(&self) -> Option<Leader> {
        self.rx.borrow().clone()
    }

    /// Whether the master in force is `l` (no copy taken).
    pub fn is(&self, l: &Option<Leader>) -> bool {
        *self.rx.borrow() == *l
    }

    /// Its address, if any.
    pub fn addr(&self) -> Option<String> {
        self.rx.borrow().as_ref().map(|l| l.addr.clone())
    }

    /// Waits until the master in force changes (never returns for a fixed one).
    pub async fn changed(&mut self) {
        if self.rx.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// Publishes `v`; `true` when it differs from what was in force.
    pub fn publish(&self, v: Option<Leader>) -> bool {
        let changed = self.tx.send_if_modified(|cur| {
            if *cur == v {
                false
            } else {
                *cur = v;
                true
            }
        });
        if changed {
            // A new leader may not know what the old one placed: its memory is free
            // space to it.
            self.places_voided();
        }
        changed
    }

    /// The epoch of where values are: an answer about places taken in an earlier epoch
    /// may no longer hold (a reader compares the epoch from before it asked with the
    /// one after).
    pub fn places_epoch(&self) -> u64 {
        self.places.load(Ordering::Acquire)
    }

    /// Says that places the master named may be void now: a removal went to the master
    /// (a forced one takes leased values too, and its memory can be handed to the next
    /// put), the master did not answer (it may have restarted: a restarted master
    /// treats every segment as empty), or a new leader is in force.
    pub fn places_voided(&self) {
        self.places.fetch_add(1, Ordering::AcqRel);
    }

    /// A removal that can take leased values went to the master through this moongate:
    /// places are void here, and the fleet (`[fleet]`) says so to the other members.
    pub fn removal_relayed(&self) {
        self.places_voided();
        self.removals.send_modify(|n| *n += 1);
    }

    /// A removal of any kind (an unforced one too) went to the master through the
    /// master face: it may have removed a key the own segment knows.
    pub fn removal_seen(&self) {
        self.any_removals.fetch_add(1, Ordering::AcqRel);
    }

    /// The epoch the own segment's known keys are good in: it moves with the places
    /// epoch and with every removal the master face relays (the kv face forgets the
    /// one key it removes itself). Both counters only grow, so the sum moves whenever
    /// either does.
    pub fn known_epoch(&self) -> u64 {
        self.places_epoch()
            .wrapping_add(self.any_removals.load(Ordering::Acquire))
    }

    /// Follows [`Upstream::removal_relayed`] (the fleet's membership task).
    pub fn removals(&self) -> watch::Receiver<u64> {
        self.removals.subscribe()
    }
}

/// Metric handles of leader following.
pub struct LeaderMetrics {
    pub changes: Counter,
    pub present: Gauge,
    pub leaderless_seconds: Gauge<f64, AtomicU64>,
    pub etcd_errors: Counter,
    pub info: Family<AddressLabel, Gauge>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AddressLabel {
    address: String,
}

impl LeaderMetrics {
    pub fn register(r: &mut prometheus_client::registry::Registry) -> LeaderMetrics {
        let m = LeaderMetrics {
            changes: Counter::default(),
            present: Gauge::default(),
            leaderless_seconds: Gauge::default(),
            etcd_errors: Counter::default(),
            info: Family::default(),
        };
        r.register(
            "moongate_upstream_leader_changes",
            "Changes of the master in force (HA: leader elected, lost or replaced)",
            m.changes.clone(),
        );
        r.register(
            "moongate_upstream_leader_present",
            "1 while a master leader is known (always 1 for a fixed upstream)",
            m.present.clone(),
        );
        r.register(
            "moongate_upstream_leaderless_seconds",
            "Seconds the current leaderless period has lasted (0 while a leader is known)",
            m.leaderless_seconds.clone(),
        );
        r.register(
            "moongate_upstream_etcd_errors",
            "etcd connections or watches that failed (retried every second; the last \
             leader stays in force meanwhile)",
            m.etcd_errors.clone(),
        );
        r.register(
            "moongate_upstream_leader",
            "1 for the master address in force, 0 for earlier ones",
            m.info.clone(),
        );
        m
    }

    /// Records the fixed master of a non-HA upstream.
    pub fn fixed(&self, addr: &str) {
        self.present.set(1);
        self.info
            .get_or_create(&AddressLabel {
                address: addr.to_string(),
            })
            .set(1);
    }
}

/// What one read of the key says.
fn leader_of(kv: Option<&etcd_client::KeyValue>) -> Option<Leader> {
    let kv = kv?;
    let addr = std::str::from_utf8(kv.value()).ok()?;
    (!addr.is_empty() && !addr.starts_with(WARMING)).then(|| Leader {
        addr: addr.to_string(),
        view_version: kv.create_revision(),
    })
}

/// Follows the leader at `key` in etcd until shutdown, publishing it to `upstream`.
pub async fn follow_etcd(
    endpoints: Vec<String>,
    key: String,
    upstream: Upstream,
    metrics: Arc<LeaderMetrics>,
    shutdown: CancellationToken,
) {
    let mut leaderless_since = upstream.current().is_none().then(Instant::now);
    let note = |l: &Option<Leader>, since: &mut Option<Instant>| {
        let before = upstream.current();
        if upstream.publish(l.clone()) {
            metrics.changes.inc();
            if let Some(b) = &before {
                let a = AddressLabel {
                    address: b.addr.clone(),
                };
                metrics.info.get_or_create(&a).set(0);
            }
            match l {
                Some(l) => {
                    let a = AddressLabel {
                        address: l.addr.clone(),
                    };
                    metrics.info.get_or_create(&a).set(1);
                    tracing::info!(leader = %l.addr, view_version = l.view_version,
                        "master leader");
                }
                None => tracing::warn!(%key, "no master leader in etcd"),
            }
        }
        metrics.present.set(i64::from(l.is_some()));
        match (l, *since) {
            (Some(_), _) => {
                *since = None;
                metrics.leaderless_seconds.set(0.0);
            }
            (None, None) => *since = Some(Instant::now()),
            (None, Some(t)) => {
                metrics.leaderless_seconds.set(t.elapsed().as_secs_f64());
            }
        }
    };
    let opts = etcd_client::ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(5))
        .with_timeout(Duration::from_secs(5))
        .with_keep_alive(Duration::from_secs(10), Duration::from_secs(3));
    loop {
        let round = async {
            let mut client = etcd_client::Client::connect(&endpoints, Some(opts.clone())).await?;
            // The watch first, then the read: no change can fall between them.
            let mut events = client.watch(key.as_str(), None).await?;
            loop {
                let r = client.get(key.as_str(), None).await?;
                note(&leader_of(r.kvs().first()), &mut leaderless_since);
                // While there is no leader, read again every 200 ms as well (Mooncake's
                // client re-reads at once; a watch event may still be on its way).
                let wait = if upstream.current().is_none() {
                    Duration::from_millis(200)
                } else {
                    Duration::from_secs(30)
                };
                match tokio::time::timeout(wait, events.message()).await {
                    Ok(Ok(Some(_))) | Err(_) => {}
                    Ok(Ok(None)) => {
                        return Err(etcd_client::Error::WatchError("watch ended".into()));
                    }
                    Ok(Err(e)) => return Err(e),
                }
            }
            #[allow(unreachable_code)]
            Ok::<(), etcd_client::Error>(())
        };
        let e = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = round => r.err(),
        };
        if let Some(e) = e {
            metrics.etcd_errors.inc();
            tracing::warn!(endpoints = ?endpoints, error = %e,
                "etcd unreachable or watch broken; keeping the last leader, retrying in 1 s");
        }
        if leaderless_since.is_some() {
            note(&None, &mut leaderless_since);
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_leader_voids_the_places_the_old_one_named() {
        let u = Upstream::unknown();
        let seen_by_another_part = u.clone();
        let e0 = u.places_epoch();
        let leader = |addr: &str| {
            Some(Leader {
                addr: addr.into(),
                view_version: 1,
            })
        };
        assert!(u.publish(leader("127.0.0.1:1")));
        assert_eq!(seen_by_another_part.places_epoch(), e0 + 1);
        // The same leader again changes nothing.
        assert!(!u.publish(leader("127.0.0.1:1")));
        assert_eq!(u.places_epoch(), e0 + 1);
        assert!(u.publish(leader("127.0.0.1:2")));
        assert_eq!(seen_by_another_part.places_epoch(), e0 + 2);
    }

    #[test]
    fn upstream_forms() {
        assert_eq!(
            UpstreamSpec::parse("127.0.0.1:50051", "mooncake_cluster"),
            Ok(UpstreamSpec::Direct("127.0.0.1:50051".into()))
        );
        assert_eq!(
            UpstreamSpec::parse("etcd://10.0.0.1:2379; 10.0.0.2:2379,10.0.0.3:2379", "c/"),
            Ok(UpstreamSpec::Etcd {
                endpoints: vec![
                    "10.0.0.1:2379".into(),
                    "10.0.0.2:2379".into(),
                    "10.0.0.3:2379".into()
                ],
                key: "mooncake-store/c/master_view".into()
            })
        );
        assert!(UpstreamSpec::parse("etcd://", "c").is_err());
        assert!(
            UpstreamSpec::parse("redis://h:1", "c")
                .unwrap_err()
                .contains("etcd only")
        );
        assert!(UpstreamSpec::parse("zk://h:1", "c").is_err());
    }

    #[tokio::test]
    async fn a_change_wakes_waiters_and_a_repeat_does_not() {
        let u = Upstream::unknown();
        let mut w = u.clone();
        let l = Leader {
            addr: "127.0.0.1:1".into(),
            view_version: 2,
        };
        assert!(u.publish(Some(l.clone())));
        tokio::time::timeout(Duration::from_secs(1), w.changed())
            .await
            .unwrap();
        assert_eq!(w.addr().as_deref(), Some("127.0.0.1:1"));
        assert!(!u.publish(Some(l)), "the same leader is no change");
        assert!(
            tokio::time::timeout(Duration::from_millis(50), w.changed())
                .await
                .is_err()
        );
    }
}

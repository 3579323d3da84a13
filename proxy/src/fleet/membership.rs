//! Fleet membership through etcd: hold a lease, publish this member's record under it,
//! watch the others; write the pool-wide rounds this member calls as leader, hear the
//! ones the leader calls. The only file of the fleet that talks to etcd.
//!
//! Per member and interval: one lease renewal, and one write only when the record
//! changed; one more per pool-wide round the member frees its portion of (at once, so
//! the leader hears it). Every write reaches every watching member, so a fleet of N members whose
//! records all change each interval delivers N writes and N x N watch events per
//! interval (`docs/operations.md`, "Running a fleet"). The leader adds one write per
//! round it calls (N deliveries).
//!
//! Removals that can take leased values (a forced `Remove`, ...) relayed by one member
//! are told to the others at once (one write under `removals/MEMBER`, N deliveries):
//! each voids the replica lists it keeps of the master (the kv face's cache), which
//! would otherwise hold for up to `kv.replica_cache_ms` while the removed value's memory
//! goes to new puts.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Client, ConnectOptions, EventType, GetOptions, KeyValue, PutOptions, WatchOptions,
};
use tokio_util::sync::CancellationToken;

use super::{Fleet, Record, Round, View};
use crate::upstream::Upstream;

/// What this member's record is made of when it is due for publishing.
pub struct Snapshot {
    /// The arms in force (their lookups and hits through this member).
    pub policy: Arc<crate::policy::registry::Registry>,
    /// The key table, when this member keeps one.
    pub keys: Option<Arc<crate::keys::Keys>>,
    /// Bytes moongate's evictor removed (`moongate_eviction_removed_bytes`).
    pub evicted: prometheus_client::metrics::counter::Counter,
    /// This member's admin endpoint (where the others send access records).
    pub admin: String,
    /// Whether it takes access records.
    pub records: bool,
}

impl Snapshot {
    fn record(&self, fleet: &Fleet) -> Record {
        let mut rec = fleet.record_of(
            &self.policy.current(),
            self.keys.as_deref(),
            self.evicted.get(),
        );
        rec.admin = self.admin.clone();
        rec.records = self.records;
        rec
    }
}

/// Keeps this member in the fleet until shutdown, then leaves it (revokes the lease, so
/// the others see it go at once rather than when the lease runs out). Reconnects after
/// any etcd failure, keeping the last view meanwhile.
///
/// `upstream`: the removals relayed here are told to the other members, and theirs void
/// this member's replica lists of the master (the kv face's cache).
pub async fn run(
    fleet: Arc<Fleet>,
    endpoints: Vec<String>,
    snapshot: Snapshot,
    upstream: Upstream,
    shutdown: CancellationToken,
) {
    let opts = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(5))
        .with_timeout(Duration::from_secs(5));
    // The removal count last written: one relayed while etcd was unreachable is told
    // on reconnecting.
    let mut told = 0u64;
    loop {
        let r = session(
            &fleet, &endpoints, &opts, &snapshot, &upstream, &mut told, &shutdown,
        )
        .await;
        match r {
            Ok(()) => return,
            Err(e) => {
                fleet.metrics.etcd_errors.inc();
                tracing::warn!(endpoints = ?endpoints, error = %e,
                    "fleet: etcd unreachable or lease lost; keeping the last view, retrying in 1 s");
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

/// One connection's worth of membership: returns `Ok` at shutdown.
async fn session(
    fleet: &Fleet,
    endpoints: &[String],
    opts: &ConnectOptions,
    snapshot: &Snapshot,
    upstream: &Upstream,
    told: &mut u64,
    shutdown: &CancellationToken,
) -> Result<(), etcd_client::Error> {
    let mut client = Client::connect(endpoints, Some(opts.clone())).await?;
    let prefix = fleet.prefix();
    let key = format!("{prefix}{}", fleet.me);
    let round_key = super::round_key(&fleet.cfg.cluster);
    let mut called = fleet.rounds_called_rx();
    let mut freed = fleet.rounds_done_rx();
    let removals_prefix = super::removals_prefix(&fleet.cfg.cluster);
    let my_removals = format!("{removals_prefix}{}", fleet.me);
    let mut removals = upstream.removals();
    let ttl = fleet.cfg.lease_ttl_s as i64;
    let lease = client.lease_grant(ttl, None).await?.id();
    let (mut keeper, mut acks) = client.lease_keep_alive(lease).await?;
    // The watch before the read: no change can fall between them. It covers the
    // cluster, so the leader's rounds arrive with the records.
    let mut events = client
        .watch(
            super::cluster_prefix(&fleet.cfg.cluster),
            Some(WatchOptions::new().with_prefix()),
        )
        .await?;
    let mut last = None;
    publish(&mut client, fleet, &key, lease, snapshot, &mut last).await?;
    let mut view = read_all(&mut client, &prefix).await?;
    // Removals other members told while this one was not watching are not known:
    // every replica list kept from before is void.
    upstream.places_voided();
    let n = *removals.borrow_and_update();
    if n != *told {
        tell_removals(&mut client, fleet, &my_removals, lease, n).await?;
        *told = n;
    }
    fleet.set_view(view.clone());
    tracing::info!(member = %fleet.me, members = view.members.len(), cluster = %fleet.cfg.cluster,
        "fleet: joined");
    let mut tick = tokio::time::interval(Duration::from_millis(fleet.cfg.interval_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => {
                // Leave at once; if etcd does not answer, the lease ends it anyway.
                let _ = tokio::time::timeout(Duration::from_secs(1), client.lease_revoke(lease)).await;
                return Ok(());
            }
            _ = tick.tick() => {
                keeper.keep_alive().await?;
                publish(&mut client, fleet, &key, lease, snapshot, &mut last).await?;
            }
            // A portion freed: the leader waits for it before its next round.
            Ok(()) = freed.changed() => {
                freed.borrow_and_update();
                publish(&mut client, fleet, &key, lease, snapshot, &mut last).await?;
            }
            Ok(()) = removals.changed() => {
                let n = *removals.borrow_and_update();
                tell_removals(&mut client, fleet, &my_removals, lease, n).await?;
                *told = n;
            }
            Ok(()) = called.changed() => {
                let round = called.borrow_and_update().clone();
                if let Some(r) = round {
                    let body = serde_json::to_vec(&r).unwrap_or_default();
                    client
                        .put(round_key.as_str(), body, Some(PutOptions::new().with_lease(lease)))
                        .await?;
                    fleet.metrics.writes.inc();
                }
            }
            m = acks.message() => match m? {
                Some(a) if a.ttl() > 0 => {}
                // The lease ran out (etcd unreachable for longer than it): our key is
                // gone; start again with a new lease.
                _ => return Err(etcd_client::Error::LeaseKeepAliveError("lease expired".into())),
            },
            m = events.message() => match m? {
                Some(w) => {
                    let mut changed = false;
                    for ev in w.events() {
                        let Some(kv) = ev.kv() else { continue };
                        if kv.key() == round_key.as_bytes() {
                            heard(fleet, kv);
                        } else if let Some(from) = kv.key().strip_prefix(removals_prefix.as_bytes()) {
                            if ev.event_type() == EventType::Put && from != fleet.me.as_bytes() {
                                upstream.places_voided();
                                fleet.metrics.removals_heard.inc();
                            }
                        } else {
                            changed |= apply(&mut view, &prefix, kv);
                        }
                    }
                    if changed {
                        fleet.set_view(view.clone());
                    }
                    if !view.members.contains_key(&fleet.me) {
                        // Our own key went (deleted by hand, or the lease lapsed).
                        last = None;
                    }
                }
                None => return Err(etcd_client::Error::WatchError("watch ended".into())),
            },
        }
    }
}

/// Tells the other members that `n` removals which can take leased values went through
/// this one so far (they void their replica lists on hearing it).
async fn tell_removals(
    client: &mut Client,
    fleet: &Fleet,
    key: &str,
    lease: i64,
    n: u64,
) -> Result<(), etcd_client::Error> {
    client
        .put(
            key,
            n.to_string(),
            Some(PutOptions::new().with_lease(lease)),
        )
        .await?;
    fleet.metrics.removals_told.inc();
    Ok(())
}

/// Writes this member's record when it differs from the last one written.
async fn publish(
    client: &mut Client,
    fleet: &Fleet,
    key: &str,
    lease: i64,
    snapshot: &Snapshot,
    last: &mut Option<Vec<u8>>,
) -> Result<(), etcd_client::Error> {
    let mut rec = snapshot.record(fleet);
    rec.member = fleet.me.clone();
    let body = serde_json::to_vec(&rec).unwrap_or_default();
    if last.as_deref() == Some(&body[..]) {
        return Ok(());
    }
    client
        .put(key, body.clone(), Some(PutOptions::new().with_lease(lease)))
        .await?;
    fleet.metrics.writes.inc();
    *last = Some(body);
    Ok(())
}

/// A round the leader wrote: to the evictor. Its removal (the leader's lease ended) is
/// nothing to act on; one that does not parse is skipped with a warning.
fn heard(fleet: &Fleet, kv: &KeyValue) {
    if kv.value().is_empty() {
        return;
    }
    match serde_json::from_slice::<Round>(kv.value()) {
        Ok(r) => fleet.heard(r),
        Err(e) => tracing::warn!(error = %e, "fleet: the leader's round does not parse; ignored"),
    }
}

/// Applies one key's new state to the view: a record (put), or its absence (a delete
/// carries no value; records are never empty). Whether the view changed. A record that
/// does not parse is skipped with a warning: one bad member must not blind the others.
fn apply(view: &mut View, prefix: &str, kv: &KeyValue) -> bool {
    let Some(member) = kv
        .key_str()
        .ok()
        .and_then(|k| k.strip_prefix(prefix))
        .map(str::to_string)
    else {
        return false;
    };
    if kv.value().is_empty() {
        return view.members.remove(&member).is_some();
    }
    match serde_json::from_slice::<Record>(kv.value()) {
        Ok(r) => view.members.insert(member, r.clone()).as_ref() != Some(&r),
        Err(e) => {
            tracing::warn!(%member, error = %e, "fleet: a member's record does not parse; ignored");
            false
        }
    }
}

/// The fleet as etcd holds it now, read once (`moongate fleet status`): every member's
/// record under `cluster`.
pub async fn read(endpoints: &[String], cluster: &str) -> Result<View, etcd_client::Error> {
    let opts = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(5))
        .with_timeout(Duration::from_secs(5));
    let mut client = Client::connect(endpoints, Some(opts)).await?;
    read_all(&mut client, &super::members_prefix(cluster)).await
}

/// Every record under `prefix`, as a view.
async fn read_all(client: &mut Client, prefix: &str) -> Result<View, etcd_client::Error> {
    let all = client
        .get(prefix, Some(GetOptions::new().with_prefix()))
        .await?;
    let mut view = View::default();
    for kv in all.kvs() {
        apply(&mut view, prefix, kv);
    }
    Ok(view)
}

//! Who is behind the master face's connections and what each was served: ranks
//! identified by their process even when they never name themselves, owners by the
//! offload calls they make, the tier each rank's reads were served from, and what each
//! owner offloaded to and promoted from its SSD.
//!
//! - **Identity** ([`identify`]): a connection's peer is its process (loopback) or its
//!   address; every connection of one process shares one [`Peer`], so a rank's pooled
//!   connections land in one experiment arm (`assign = "client"` hashes the peer's
//!   [`Peer::assign`] id) whether or not its calls carry a client id.
//! - **Owners**: a peer that makes offload calls ([`crate::calls::offload`]) is an owner.
//!   The keys its offload heartbeats are handed are remembered until the owner looks them
//!   up (it does, once, before writing each to the SSD); those lookups are the owner's
//!   own work, not reads served. Other lookups from an owner's process are its dummy
//!   clients' reads, which the owner makes on their behalf under its own identity.
//! - **Served tiers**: for each lookup answer a reader gets, the tier of the replica it
//!   will read ([`crate::calls::lookup::served`]), counted once per reader and key while
//!   the read lease of the first answer lasts: vLLM's tier log looks a batch up
//!   (`batch_get_replica_desc`) just before reading it, and that is one read.
//!
//! Knows no frames and no sockets: the master face hands it peers' addresses, decoded
//! answers and offload calls. Bounded: peers, remembered offload keys and each peer's
//! recent reads are capped.

pub mod identify;
pub mod metrics;
pub mod ssd;

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use bytes::Bytes;

use crate::calls::lookup::{SERVED_LABELS, served};
use crate::calls::offload::{Item, Offload};
use crate::codec::keys::Keys;
use crate::codec::types::{
    ErrorCode, Expected, GetReplicaListResponse, ReplicaLocation, Segment, Uuid,
};
use crate::policy::metrics::ArmMetrics;
pub use identify::PeerKey;
use metrics::{SsdGauges, TopologyMetrics};
use ssd::{MAX_SSD_KEYS, SsdKeys, Usage};

/// Peers remembered (connected or not, for `GET /ranks`); the oldest unconnected go
/// first past this.
const MAX_PEERS: usize = 4096;
/// Keys handed to owners to offload and not yet looked up by them.
const MAX_PENDING_OFFLOADS: usize = 1 << 20;
/// Reads remembered per peer for counting a key once per lease.
const MAX_RECENT: usize = 1 << 16;
/// How long a key's read counts as one when the master's answer names no lease (a key
/// not found): the last lease the master granted, or this before any.
const DEFAULT_LEASE_MS: u64 = 5_000;

/// The tenant Mooncake's clients send (0.3.12 on); offload calls before 0.3.13 name
/// none.
pub const DEFAULT_TENANT: &[u8] = b"default";

/// Keys and bytes per [`SERVED_LABELS`] tier.
pub type TierCounts = [(u64, u64); SERVED_LABELS.len()];

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One client process (or remote address) and what it was served.
pub struct Peer {
    pub key: PeerKey,
    /// The id `assign = "client"` hashes for every call of this peer: the process
    /// (pid, start time) when known. `None` for an address-only peer, whose calls are
    /// assigned by the client id they carry, as before.
    pub assign: Option<Uuid>,
    /// The Mooncake client id its calls carried, once one did.
    client: Mutex<Option<Uuid>>,
    /// `client` is set: most calls carry the id, and the lock is skipped once known.
    client_known: AtomicBool,
    owner: AtomicBool,
    connections: AtomicU32,
    served: [(AtomicU64, AtomicU64); SERVED_LABELS.len()],
    last_batch: Mutex<TierCounts>,
    lookups: AtomicU64,
    /// Key hash -> until when (ms on the topology's clock) a read of it counts as the
    /// one already counted.
    recent: Mutex<HashMap<u64, u64, foldhash::fast::RandomState>>,
    /// Last time a connection of this peer closed (ms), for pruning.
    left_ms: AtomicU64,
    /// The Mooncake release its calls identified (1 + [`Schema`] index; 0: not yet),
    /// for its later connections: a process runs one release, and a reconnected
    /// client's first calls (lookups) may not tell it again. Process peers only: an
    /// address may be several processes.
    release: std::sync::atomic::AtomicU8,
    /// Release skew with `master_face.bridge` off: [`SKEW_STUCK`] once a call was
    /// refused before any data call went through, [`SKEW_WORKS`] once one did.
    skew: std::sync::atomic::AtomicU8,
    /// When (ms on the topology's clock) a call of it was last refused for skew.
    skew_at_ms: AtomicU64,
}

const SKEW_STUCK: u8 = 1;
const SKEW_WORKS: u8 = 2;

impl Peer {
    fn new(key: PeerKey) -> Peer {
        let assign = match key {
            PeerKey::Process { pid, start } => Some(Uuid {
                first: u64::from(pid),
                second: start,
            }),
            PeerKey::Addr(_) => None,
        };
        Peer {
            key,
            assign,
            client: Mutex::new(None),
            client_known: AtomicBool::new(false),
            owner: AtomicBool::new(false),
            connections: AtomicU32::new(0),
            served: Default::default(),
            last_batch: Mutex::new(Default::default()),
            lookups: AtomicU64::new(0),
            recent: Mutex::new(HashMap::default()),
            left_ms: AtomicU64::new(0),
            release: Default::default(),
            skew: Default::default(),
            skew_at_ms: AtomicU64::new(0),
        }
    }

    /// Whether this peer made offload calls (a standalone owner).
    pub fn is_owner(&self) -> bool {
        self.owner.load(Ordering::Relaxed)
    }

    /// The client id its calls carried, if any did.
    pub fn client(&self) -> Option<Uuid> {
        *lock(&self.client)
    }

    /// Remembers the client id a call carried (the first one is kept: a process runs one
    /// Mooncake client; an owner's dummies' calls carry the owner's).
    /// A data call of it went through: it works, whatever was refused before.
    pub fn data_call_passed(&self) {
        if self.skew.load(Ordering::Relaxed) == SKEW_STUCK {
            self.skew.store(SKEW_WORKS, Ordering::Relaxed);
        }
    }

    /// Its calls identified release `s`.
    pub fn saw_release(&self, s: crate::codec::Schema) {
        if self.assign.is_some() {
            self.release.store(1 + s as u8, Ordering::Relaxed);
        }
    }

    /// The release an earlier connection of this process identified.
    pub fn release(&self) -> Option<crate::codec::Schema> {
        match self.release.load(Ordering::Relaxed) {
            0 => None,
            n => crate::codec::Schema::ALL.get(usize::from(n - 1)).copied(),
        }
    }

    pub fn saw_client(&self, id: Uuid) {
        if id == Uuid::default() || self.client_known.load(Ordering::Relaxed) {
            return;
        }
        let mut c = lock(&self.client);
        if c.is_none() {
            *c = Some(id);
        }
        self.client_known.store(true, Ordering::Relaxed);
    }

    /// Keys and bytes served per tier since it first connected.
    pub fn served(&self) -> TierCounts {
        std::array::from_fn(|i| {
            (
                self.served[i].0.load(Ordering::Relaxed),
                self.served[i].1.load(Ordering::Relaxed),
            )
        })
    }
}

/// What one lookup answer said of SSD copies, per key (see [`Topology::ssd_seen`]).
#[derive(Debug)]
pub struct SsdSeen {
    tag: u32,
    /// The key's hash, and the owner and size of its SSD copy when the answer listed one.
    items: Vec<(u64, Option<(Uuid, u64)>)>,
}

/// What an owner told the master about its SSD.
#[derive(Debug, Default, Clone)]
pub struct OwnerState {
    pub capacity_bytes: Option<i64>,
    pub offloading: bool,
    pub offloaded_keys: u64,
    pub offloaded_bytes: u64,
    /// Keys an offload notice named with no place on the SSD.
    pub offload_failed_keys: u64,
    pub promoted_keys: u64,
    pub promoted_bytes: u64,
}

#[derive(Default)]
struct OffloadState {
    /// Keys an owner's heartbeat was handed, in arrival order (bounded).
    pending: HashMap<(Bytes, Bytes), (), foldhash::fast::RandomState>,
    order: VecDeque<(Bytes, Bytes)>,
    /// Promotions under way: key -> size.
    promoting: HashMap<(Bytes, Bytes), u64, foldhash::fast::RandomState>,
    owners: HashMap<Uuid, OwnerState>,
}

/// How long finding the process behind a connection may delay its first call; past it
/// the peer is known by its address.
pub const IDENTIFY_WITHIN: std::time::Duration = std::time::Duration::from_millis(500);

/// The peers of the master face, and what owners did with their SSDs.
pub struct Topology {
    peers: Mutex<HashMap<PeerKey, Arc<Peer>>>,
    offload: Mutex<OffloadState>,
    /// Memory segments clients mounted: transfer endpoint -> segment name (what a
    /// replica clear names a segment by).
    segments: Mutex<HashMap<Bytes, Bytes>>,
    /// Keys on owners' SSDs (each owner's usage) and each owner's usage gauges.
    ssd: Mutex<(SsdKeys, HashMap<Uuid, SsdGauges>)>,
    /// An owner made an offload call: lookups and removals now tell SSD usage.
    ssd_on: AtomicBool,
    /// The last lease the master granted (ms), for keys whose answer names none.
    lease_ms: AtomicU64,
    clock: Instant,
    metrics: Arc<TopologyMetrics>,
}

/// What a lookup answer was, for the tier accounting of the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LookupRole {
    /// Every key was an owner's look before offloading it: not a read.
    OwnerOffload,
    /// Reads (some keys may have been an owner's offload lookups).
    Read,
}

impl Topology {
    pub fn new(metrics: Arc<TopologyMetrics>) -> Topology {
        Topology {
            peers: Mutex::new(HashMap::new()),
            offload: Mutex::new(OffloadState::default()),
            segments: Mutex::new(HashMap::new()),
            ssd: Mutex::new((SsdKeys::new(MAX_SSD_KEYS), HashMap::new())),
            ssd_on: AtomicBool::new(false),
            lease_ms: AtomicU64::new(DEFAULT_LEASE_MS),
            clock: Instant::now(),
            metrics,
        }
    }

    fn now_ms(&self) -> u64 {
        self.clock.elapsed().as_millis() as u64
    }

    /// A call of `peer` was refused for release skew (`master_face.bridge` off).
    pub fn skew_refused(&self, peer: &Peer) {
        let _ = peer
            .skew
            .compare_exchange(0, SKEW_STUCK, Ordering::Relaxed, Ordering::Relaxed);
        peer.skew_at_ms.store(self.now_ms(), Ordering::Relaxed);
    }

    /// Peers whose every data call was refused for release skew, the last within
    /// `within` (a client that gave up, or exited, stops counting after it).
    pub fn skew_stuck(&self, within: std::time::Duration) -> usize {
        let now = self.now_ms();
        let within = within.as_millis() as u64;
        lock(&self.peers)
            .values()
            .filter(|p| {
                p.skew.load(Ordering::Relaxed) == SKEW_STUCK
                    && now.saturating_sub(p.skew_at_ms.load(Ordering::Relaxed)) < within
            })
            .count()
    }

    /// The identity of a new connection's peer (`ours`: the address it reached,
    /// `theirs`: the peer's). Reads `/proc`: call it off the async runtime.
    pub fn identify(&self, ours: SocketAddr, theirs: SocketAddr) -> PeerKey {
        let known: Vec<u32> = lock(&self.peers)
            .keys()
            .filter_map(|k| match k {
                PeerKey::Process { pid, .. } => Some(*pid),
                PeerKey::Addr(_) => None,
            })
            .collect();
        identify::identify(ours, theirs, &known)
    }

    /// The Mooncake client id a known peer's calls carried, if any did.
    pub fn client_of(&self, key: PeerKey) -> Option<Uuid> {
        lock(&self.peers).get(&key).and_then(|p| p.client())
    }

    /// The release a known peer's calls (or its wheel) showed, if any.
    pub fn release_of(&self, key: PeerKey) -> Option<crate::codec::Schema> {
        lock(&self.peers).get(&key).and_then(|p| p.release())
    }

    /// The peer for `key`, counted as one more connection.
    pub fn join(&self, key: PeerKey) -> Arc<Peer> {
        let mut peers = lock(&self.peers);
        if peers.len() >= MAX_PEERS && !peers.contains_key(&key) {
            // Forget the peers gone longest.
            let mut gone: Vec<(u64, PeerKey)> = peers
                .values()
                .filter(|p| p.connections.load(Ordering::Relaxed) == 0)
                .map(|p| (p.left_ms.load(Ordering::Relaxed), p.key))
                .collect();
            gone.sort_unstable_by_key(|(t, _)| *t);
            for (_, k) in gone.iter().take(peers.len() / 4 + 1) {
                peers.remove(k);
            }
        }
        let p = peers
            .entry(key)
            .or_insert_with(|| Arc::new(Peer::new(key)))
            .clone();
        p.connections.fetch_add(1, Ordering::Relaxed);
        self.metrics.peers.set(
            peers
                .values()
                .filter(|p| p.connections.load(Ordering::Relaxed) > 0)
                .count() as i64,
        );
        p
    }

    /// A connection of `peer` closed.
    pub fn leave(&self, peer: &Peer) {
        peer.connections.fetch_sub(1, Ordering::Relaxed);
        peer.left_ms.store(self.now_ms(), Ordering::Relaxed);
        let peers = lock(&self.peers);
        self.metrics.peers.set(
            peers
                .values()
                .filter(|p| p.connections.load(Ordering::Relaxed) > 0)
                .count() as i64,
        );
    }

    /// An offload-family call from `peer` (the request; `ok`: the master accepted it).
    /// Returns the keys that reached an SSD, for the key table and KV events.
    pub fn offload_call(&self, peer: &Peer, call: &Offload, ok: bool) -> Vec<Item> {
        if !peer.owner.swap(true, Ordering::Relaxed) {
            tracing::info!(peer = %peer.key, client = %call.client(), "an owner with an SSD tier connected");
        }
        peer.saw_client(call.client());
        self.ssd_on.store(true, Ordering::Relaxed);
        if !ok {
            return Vec::new();
        }
        let owner_label = call.client().to_string();
        let mut st = lock(&self.offload);
        let st = &mut *st;
        let owner = st.owners.entry(call.client()).or_default();
        match call {
            Offload::MountDisk { offloading, .. } => {
                owner.offloading = *offloading;
                Vec::new()
            }
            Offload::Capacity { bytes, .. } => {
                owner.capacity_bytes = Some(*bytes);
                self.metrics.ssd_capacity(&owner_label).set(*bytes);
                Vec::new()
            }
            Offload::Heartbeat { .. } => Vec::new(),
            Offload::Offloaded { items, failed, .. } => {
                if !failed.is_empty() {
                    self.metrics.offload_failed.inc_by(failed.len() as u64);
                    owner.offload_failed_keys += failed.len() as u64;
                }
                let bytes: u64 = items.iter().map(|i| i.size).sum();
                owner.offloaded_keys += items.len() as u64;
                owner.offloaded_bytes = owner.offloaded_bytes.saturating_add(bytes);
                self.metrics.offloaded_keys.inc_by(items.len() as u64);
                self.metrics.offloaded_bytes.inc_by(bytes);
                // Settled either way: a later lookup of these is no offload work.
                for i in items.iter().chain(failed) {
                    st.pending.remove(&(i.tenant.clone(), i.key.clone()));
                }
                let mut ssd = lock(&self.ssd);
                let mut changed = Vec::new();
                for i in items {
                    let tenant = ssd_tenant(&i.tenant);
                    let (tag, h) = (tenant_tag(tenant), key_hash(tenant, &i.key));
                    for o in ssd.0.stored(call.client(), tag, h, i.size, false) {
                        push_once(&mut changed, o);
                    }
                }
                self.publish_ssd(&mut ssd, &changed);
                items.clone()
            }
            Offload::PromotionStart { item, .. } => {
                if st.promoting.len() < MAX_PENDING_OFFLOADS {
                    st.promoting
                        .insert((item.tenant.clone(), item.key.clone()), item.size);
                }
                Vec::new()
            }
            Offload::Promoted { tenant, key, .. } => {
                let size = st
                    .promoting
                    .remove(&(tenant.clone(), key.clone()))
                    .unwrap_or(0);
                owner.promoted_keys += 1;
                owner.promoted_bytes = owner.promoted_bytes.saturating_add(size);
                self.metrics.promoted_keys.inc();
                self.metrics.promoted_bytes.inc_by(size);
                Vec::new()
            }
        }
    }

    /// Keys an owner's heartbeat answer asks it to offload: its next lookups of them are
    /// its own.
    pub fn offload_tasks(&self, items: &[Item]) {
        if items.is_empty() {
            return;
        }
        self.metrics.offload_tasks.inc_by(items.len() as u64);
        let mut st = lock(&self.offload);
        for i in items {
            let k = (
                Bytes::copy_from_slice(&i.tenant),
                Bytes::copy_from_slice(&i.key),
            );
            if st.pending.insert(k.clone(), ()).is_none() {
                st.order.push_back(k);
            }
        }
        while st.pending.len() > MAX_PENDING_OFFLOADS {
            match st.order.pop_front() {
                Some(k) => {
                    st.pending.remove(&k);
                }
                None => break,
            }
        }
        // The order queue also holds keys already taken; keep it near the map's size.
        if st.order.len() > 2 * st.pending.len() + 1024 {
            let OffloadState { pending, order, .. } = &mut *st;
            order.retain(|k| pending.contains_key(k));
        }
    }

    /// Segments a client mounted (MountSegment, ReMountSegment).
    pub fn mounted(&self, segments: &[Segment]) {
        let mut m = lock(&self.segments);
        for s in segments {
            if m.len() < MAX_PEERS || m.contains_key(&s.te_endpoint) {
                m.insert(
                    Bytes::copy_from_slice(&s.te_endpoint),
                    Bytes::copy_from_slice(&s.name),
                );
            }
        }
    }

    /// The name of the segment at a memory replica's transfer endpoint: as mounted, or
    /// the endpoint itself (Mooncake names a client's segment by its `host:port`).
    pub fn segment_name(&self, endpoint: &Bytes) -> Bytes {
        lock(&self.segments)
            .get(endpoint)
            .cloned()
            .unwrap_or_else(|| endpoint.clone())
    }

    /// Whether any owner has offloading on (then eviction must keep disk copies).
    pub fn offloading(&self) -> bool {
        lock(&self.offload).owners.values().any(|o| o.offloading)
    }

    /// Whether SSD usage is being followed (an owner made an offload call): the master
    /// faces' observations then carry what lookups said of SSD copies
    /// ([`Topology::ssd_seen`]), and removals end SSD copies ([`Topology::ssd_removed`]).
    pub fn ssd_tracking(&self) -> bool {
        self.ssd_on.load(Ordering::Relaxed)
    }

    /// What the master's own answer to a lookup (before any steering hides a replica)
    /// says of SSD copies: a key listed with one is on that owner's SSD; a key found
    /// without one, or not found, is on none. Taken before the face rewrites the answer,
    /// applied with [`Topology::follow_ssd`].
    pub fn ssd_seen(
        tenant: &Bytes,
        keys: &Keys,
        answers: &[Expected<GetReplicaListResponse>],
    ) -> Option<SsdSeen> {
        if keys.len() != answers.len() {
            return None;
        }
        let tenant = ssd_tenant(tenant);
        let items = keys
            .iter()
            .zip(answers)
            .filter_map(|(k, a)| {
                let h = key_hash(tenant, k);
                match a {
                    Ok(list) => Some((
                        h,
                        list.replicas.iter().find_map(|r| match &r.location {
                            ReplicaLocation::LocalDisk(d) => Some((d.client_id, d.object_size)),
                            _ => None,
                        }),
                    )),
                    Err(ErrorCode::OBJECT_NOT_FOUND) => Some((h, None)),
                    Err(_) => None,
                }
            })
            .collect();
        Some(SsdSeen {
            tag: tenant_tag(tenant),
            items,
        })
    }

    /// Applies what a lookup answer said of SSD copies (learnt, for keys offloaded
    /// before moongate started).
    pub fn follow_ssd(&self, seen: &SsdSeen) {
        let mut ssd = lock(&self.ssd);
        let mut changed = Vec::new();
        for &(h, disk) in &seen.items {
            let owners = match disk {
                Some((owner, size)) => ssd.0.stored(owner, seen.tag, h, size, true),
                None => ssd.0.gone(h).into_iter().collect(),
            };
            for o in owners {
                push_once(&mut changed, o);
            }
        }
        self.publish_ssd(&mut ssd, &changed);
    }

    /// Keys removed (a client's `Remove`, moongate's whole-key eviction): their SSD
    /// copies went with them.
    pub fn ssd_removed<'a>(&self, keys: impl Iterator<Item = (&'a [u8], &'a [u8])>) {
        let mut ssd = lock(&self.ssd);
        let mut changed = Vec::new();
        for (tenant, key) in keys {
            if let Some(o) = ssd.0.gone(key_hash(ssd_tenant(tenant), key)) {
                push_once(&mut changed, o);
            }
        }
        self.publish_ssd(&mut ssd, &changed);
    }

    /// A tenant's `RemoveAll` succeeded.
    pub fn ssd_cleared(&self, tenant: &[u8]) {
        let mut ssd = lock(&self.ssd);
        let changed = ssd.0.cleared(tenant_tag(ssd_tenant(tenant)));
        self.publish_ssd(&mut ssd, &changed);
    }

    /// One owner's SSD usage, as followed.
    pub fn ssd_usage(&self, owner: Uuid) -> Usage {
        lock(&self.ssd).0.usage(owner)
    }

    fn publish_ssd(&self, ssd: &mut (SsdKeys, HashMap<Uuid, SsdGauges>), changed: &[Uuid]) {
        for o in changed {
            let u = ssd.0.usage(*o);
            let g = ssd
                .1
                .entry(*o)
                .or_insert_with(|| self.metrics.ssd_gauges(&o.to_string()));
            g.used_bytes.set(u.bytes as i64);
            g.keys.set(u.keys as i64);
        }
    }

    /// Every owner seen and its SSD figures.
    pub fn owners(&self) -> Vec<(Uuid, OwnerState)> {
        lock(&self.offload)
            .owners
            .iter()
            .map(|(k, v)| (*k, v.clone()))
            .collect()
    }

    /// Counts the tiers `peer` is served from by one lookup answer (after any steering:
    /// what the reader gets), into `arm`'s served counters. An owner's lookups of keys it
    /// was handed to offload are counted apart, not as reads.
    pub fn lookup(
        &self,
        peer: &Peer,
        tenant: &Bytes,
        keys: &Keys,
        answers: &[Expected<GetReplicaListResponse>],
        arm: &ArmMetrics,
    ) -> LookupRole {
        if keys.len() != answers.len() {
            return LookupRole::Read;
        }
        let mut own = vec![false; 0];
        if peer.is_owner() {
            let mut st = lock(&self.offload);
            if !st.pending.is_empty() {
                // 0.3.12's offload calls name no tenant while its lookups say "default".
                let untenanted = tenant.as_ref() == DEFAULT_TENANT;
                own = keys
                    .iter_bytes()
                    .map(|k| {
                        st.pending.remove(&(tenant.clone(), k.clone())).is_some()
                            || (untenanted && st.pending.remove(&(Bytes::new(), k)).is_some())
                    })
                    .collect();
            }
        }
        let own_count = own.iter().filter(|o| **o).count();
        if own_count > 0 {
            self.metrics.owner_offload_lookups.inc_by(own_count as u64);
            if own_count == keys.len() {
                return LookupRole::OwnerOffload;
            }
        }
        let now = self.now_ms();
        let mut batch: TierCounts = Default::default();
        {
            let mut recent = lock(&peer.recent);
            if recent.len() >= MAX_RECENT {
                recent.retain(|_, until| *until > now);
                if recent.len() >= MAX_RECENT {
                    recent.clear();
                }
            }
            for (i, (k, a)) in keys.iter().zip(answers).enumerate() {
                if own.get(i).copied().unwrap_or(false) {
                    continue;
                }
                let lease = match a {
                    Ok(l) if l.lease_ttl_ms > 0 => {
                        self.lease_ms.store(l.lease_ttl_ms, Ordering::Relaxed);
                        l.lease_ttl_ms
                    }
                    _ => self.lease_ms.load(Ordering::Relaxed),
                };
                let h = key_hash(tenant, k);
                let until = recent.entry(h).or_insert(0);
                if *until > now {
                    // Looked up again within the lease of the answer already counted.
                    continue;
                }
                *until = now.saturating_add(lease);
                let (tier, bytes) = served(a);
                batch[tier].0 += 1;
                batch[tier].1 = batch[tier].1.saturating_add(bytes);
            }
        }
        if batch.iter().all(|(k, _)| *k == 0) {
            return LookupRole::Read;
        }
        peer.lookups.fetch_add(1, Ordering::Relaxed);
        for (t, (k, b)) in batch.iter().enumerate() {
            if *k > 0 {
                arm.served_keys[t].inc_by(*k);
                peer.served[t].0.fetch_add(*k, Ordering::Relaxed);
            }
            if *b > 0 {
                arm.served_bytes[t].inc_by(*b);
                peer.served[t].1.fetch_add(*b, Ordering::Relaxed);
            }
        }
        *lock(&peer.last_batch) = batch;
        LookupRole::Read
    }

    /// `GET /ranks`: every peer, what it was served, and the owners' SSDs.
    pub fn report(&self, arm_of: impl Fn(&Peer) -> String) -> serde_json::Value {
        let tiers = |c: &TierCounts| {
            serde_json::Value::Object(
                SERVED_LABELS
                    .iter()
                    .zip(c)
                    .map(|(l, (k, b))| {
                        ((*l).to_string(), serde_json::json!({"keys": k, "bytes": b}))
                    })
                    .collect(),
            )
        };
        let peers: Vec<serde_json::Value> = lock(&self.peers)
            .values()
            .map(|p| {
                let (pid, addr) = match p.key {
                    PeerKey::Process { pid, .. } => (Some(pid), None),
                    PeerKey::Addr(a) => (None, Some(a.to_string())),
                };
                serde_json::json!({
                    "peer": p.key.to_string(),
                    "pid": pid,
                    "address": addr,
                    "client_id": p.client().map(|c| c.to_string()),
                    "role": if p.is_owner() { "owner" } else { "rank" },
                    "connections": p.connections.load(Ordering::Relaxed),
                    "arm": arm_of(p),
                    "lookups": p.lookups.load(Ordering::Relaxed),
                    "served": tiers(&p.served()),
                    "last_batch": tiers(&lock(&p.last_batch)),
                })
            })
            .collect();
        let owners: Vec<serde_json::Value> = self
            .owners()
            .into_iter()
            .map(|(id, o)| {
                let u = self.ssd_usage(id);
                serde_json::json!({
                    "client_id": id.to_string(),
                    "offloading": o.offloading,
                    "ssd_capacity_bytes": o.capacity_bytes,
                    "offloaded_keys": o.offloaded_keys,
                    "offloaded_bytes": o.offloaded_bytes,
                    "offload_failed_keys": o.offload_failed_keys,
                    "promoted_keys": o.promoted_keys,
                    "promoted_bytes": o.promoted_bytes,
                    "ssd_used": {
                        "keys": u.keys,
                        "bytes": u.bytes,
                        "untracked_keys": u.untracked_keys,
                    },
                })
            })
            .collect();
        serde_json::json!({"peers": peers, "owners": owners})
    }
}

/// The tenant a key is kept under in [`SsdKeys`]. Offload calls of 0.3.11 and 0.3.12 name
/// no tenant where lookups say "default": both are the default tenant here.
fn ssd_tenant(tenant: &[u8]) -> &[u8] {
    if tenant.is_empty() {
        DEFAULT_TENANT
    } else {
        tenant
    }
}

/// A tenant's tag in [`SsdKeys`] (what `RemoveAll` of that tenant clears).
fn tenant_tag(tenant: &[u8]) -> u32 {
    (key_hash(tenant, b"") >> 32) as u32
}

fn push_once(v: &mut Vec<Uuid>, o: Uuid) {
    if !v.contains(&o) {
        v.push(o);
    }
}

fn key_hash(tenant: &[u8], key: &[u8]) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    // A fixed seed: only compared within this process.
    let mut h = foldhash::fast::FixedState::with_seed(0x6d67).build_hasher();
    h.write(tenant);
    h.write_u8(0xff);
    h.write(key);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calls::lookup::SERVED_UNKNOWN;
    use crate::codec::types::{LocalDiskDescriptor, ReplicaDescriptor, ReplicaStatus};

    fn topology() -> (Topology, prometheus_client::registry::Registry) {
        let mut r = prometheus_client::registry::Registry::default();
        let m = Arc::new(TopologyMetrics::register(&mut r));
        (Topology::new(m), r)
    }

    fn item(key: &str, size: u64) -> Item {
        // As 0.3.11 and 0.3.12 owners send them: no tenant.
        Item {
            tenant: Bytes::new(),
            key: Bytes::copy_from_slice(key.as_bytes()),
            size,
        }
    }

    fn on_ssd(owner: Uuid, size: u64) -> Expected<GetReplicaListResponse> {
        Ok(GetReplicaListResponse {
            replicas: vec![ReplicaDescriptor {
                id: 1,
                location: ReplicaLocation::LocalDisk(LocalDiskDescriptor {
                    client_id: owner,
                    object_size: size,
                    transport_endpoint: Bytes::from_static(b"127.0.0.1:1"),
                }),
                status: ReplicaStatus::COMPLETE,
            }],
            lease_ttl_ms: 1,
            object_checksum: None,
        })
    }

    fn text(r: &prometheus_client::registry::Registry) -> String {
        let mut s = String::new();
        prometheus_client::encoding::text::encode(&mut s, r).unwrap();
        s
    }

    /// A reader's lookup is counted once per key within the lease of its answer, into
    /// the peer's totals and its last batch (`GET /ranks`' `last_batch`), which the next
    /// counted lookup replaces; an owner's look at keys it was handed to offload is not
    /// a read.
    #[test]
    fn a_lookup_is_the_peers_last_batch_and_counted_once_within_its_lease() {
        let (t, _r) = topology();
        let mut reg = prometheus_client::registry::Registry::default();
        let arm = crate::policy::metrics::PolicyFamilies::register(&mut reg).arm("p", "1", "a");
        let peer = t.join(PeerKey::Addr([127, 0, 0, 5].into()));
        let tenant = Bytes::from_static(DEFAULT_TENANT);
        let keys = |ks: &[&str]| -> Keys {
            ks.iter()
                .map(|k| Bytes::copy_from_slice(k.as_bytes()))
                .collect()
        };
        let owner = Uuid {
            first: 7,
            second: 9,
        };
        let last = |p: &Peer| -> TierCounts { *lock(&p.last_batch) };
        // Two keys from the SSD, one missing (lease 60 s).
        let on_disk = |size| {
            let mut a = on_ssd(owner, size);
            if let Ok(l) = &mut a {
                l.lease_ttl_ms = 60_000;
            }
            a
        };
        let role = t.lookup(
            &peer,
            &tenant,
            &keys(&["a", "b", "c"]),
            &[on_disk(100), on_disk(50), Err(ErrorCode::OBJECT_NOT_FOUND)],
            &arm,
        );
        assert_eq!(role, LookupRole::Read);
        assert_eq!(last(&peer)[2], (2, 150), "local_disk: 2 keys, 150 bytes");
        assert_eq!(last(&peer)[SERVED_UNKNOWN].0, 1, "the missing key");
        assert_eq!(peer.served()[2], (2, 150));
        // The same keys again within their lease: nothing new, the last batch stays.
        t.lookup(
            &peer,
            &tenant,
            &keys(&["a", "b"]),
            &[on_disk(100), on_disk(50)],
            &arm,
        );
        assert_eq!(peer.served()[2], (2, 150), "counted once within the lease");
        assert_eq!(last(&peer)[2], (2, 150));
        // Another key: it is the last batch now; the totals add up.
        t.lookup(&peer, &tenant, &keys(&["d"]), &[on_disk(10)], &arm);
        assert_eq!(last(&peer)[2], (1, 10));
        assert_eq!(last(&peer)[SERVED_UNKNOWN].0, 0);
        assert_eq!(peer.served()[2], (3, 160));
        let v = t.report(|_| String::new());
        assert_eq!(v["peers"][0]["last_batch"]["local_disk"]["keys"], 1, "{v}");
        assert_eq!(v["peers"][0]["served"]["local_disk"]["bytes"], 160, "{v}");
    }

    #[test]
    fn ssd_usage_follows_notices_lookups_removals_and_clears() {
        let (t, reg) = topology();
        let owner = Uuid {
            first: 7,
            second: 9,
        };
        let peer = t.join(PeerKey::Addr("127.0.0.1".parse().unwrap()));
        assert!(!t.ssd_tracking());
        let notice = Offload::Offloaded {
            client: owner,
            items: vec![item("a", 100), item("b", 200), item("c", 400)],
            failed: vec![item("x", 800)],
        };
        t.offload_call(&peer, &notice, true);
        assert!(t.ssd_tracking());
        assert_eq!(t.ssd_usage(owner).bytes, 700, "failed keys are on no SSD");
        let default = Bytes::from_static(DEFAULT_TENANT);
        let keys = |ks: &[&str]| -> Keys {
            ks.iter()
                .map(|k| Bytes::copy_from_slice(k.as_bytes()))
                .collect()
        };
        // A lookup ("default" tenant, as clients send it): "a" still on the SSD, "b"
        // found in memory only, "c" gone, "d" on the SSD though no notice was seen.
        let memory_only = Ok(GetReplicaListResponse {
            replicas: Vec::new(),
            lease_ttl_ms: 1,
            object_checksum: None,
        });
        let seen = Topology::ssd_seen(
            &default,
            &keys(&["a", "b", "c", "d"]),
            &[
                on_ssd(owner, 100),
                memory_only,
                Err(ErrorCode::OBJECT_NOT_FOUND),
                on_ssd(owner, 50),
            ],
        );
        t.follow_ssd(&seen.unwrap());
        assert_eq!(t.ssd_usage(owner).bytes, 150);
        assert_eq!(t.ssd_usage(owner).keys, 2);
        // An error other than "not found" says nothing.
        let seen = Topology::ssd_seen(
            &default,
            &keys(&["a"]),
            &[Err(ErrorCode::REPLICA_IS_NOT_READY)],
        );
        t.follow_ssd(&seen.unwrap());
        assert_eq!(t.ssd_usage(owner).bytes, 150);
        t.ssd_removed(std::iter::once((&b"default"[..], &b"a"[..])));
        assert_eq!(t.ssd_usage(owner).bytes, 50);
        // Another tenant's RemoveAll leaves it; its own takes it.
        t.ssd_cleared(b"other");
        assert_eq!(t.ssd_usage(owner).bytes, 50);
        t.ssd_cleared(b"");
        assert_eq!(t.ssd_usage(owner).bytes, 0);
        let m = text(&reg);
        assert!(
            m.contains("moongate_ssd_used_bytes{owner=\"7-9\"} 0"),
            "{m}"
        );
        assert!(m.contains("moongate_ssd_keys{owner=\"7-9\"} 0"), "{m}");
        assert_eq!(
            t.report(|_| String::new())["owners"][0]["ssd_used"]["bytes"],
            0
        );
    }
}

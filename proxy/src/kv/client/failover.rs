//! Puts that survive a leader change. An HA leader acknowledges a put before its oplog
//! has reached the standby (or etcd, while etcd is down): the new leader may not know
//! a key the old one acknowledged seconds before. The bytes are still where they were
//! written; only the new leader's metadata lacks the key. So after a change moongate
//! asks the new leader about every put it acknowledged within `kv.failover_window_ms`
//! before it ([`super::acked`]) and puts again the missing ones whose bytes it can
//! vouch for:
//! - in its own segment: the range no write has begun over since the put ended (every
//!   write into the segment passes through moongate). From the moment the change is
//!   seen until each key is settled, those ranges are held as views are, so the new
//!   leader cannot hand them to a put (it would wait, bounded, as for a view);
//! - in another segment: read back over the network and compared with the xxh3-64
//!   moongate computed as the value passed through it.
//!
//! Anything else missing (another segment's bytes moongate never saw whole, a range
//! written over, an owner gone) is reported lost: counted, logged by key and noted in
//! the key history (`/keys/KEY` says `lost_in_failover`). A key moongate's evictor or a
//! client removed meanwhile is not put back. Reads never answer wrong bytes either way:
//! until a key is put again the new leader does not list it, and what is put again was
//! checked first. A read of a key of the window that the new leader lacks while the
//! check runs waits for the check (at most `kv.timeout_ms`) and asks again, so it
//! does not answer a miss for a put about to be restored ([`Store::await_check`]).
//!
//! On only with an HA upstream (a fixed master has no leader change to survive): the
//! cost is one table entry per put, the hash of values placed in other segments, and
//! an `ExistKey` per key of the window after each change (which grants read leases, as
//! any lookup does).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::acked::{Acked, Entry, Where};
use super::{Store, StoreError, Value};
use crate::codec::message::{Request, Response};
use crate::codec::types::{ErrorCode, ReplicaDescriptor, ReplicaLocation, ReplicaType};
use crate::upstream::{Leader, Upstream};

/// Keys asked of the new leader in one `BatchExistKey`.
const CHECK_CHUNK: usize = 512;
/// How long after a change the new leader is given to answer and to take puts again
/// (Mooncake's failover takes ~10 s; a remount after it a few more).
const SETTLE: Duration = Duration::from_secs(60);
/// Between tries while the new leader is not ready.
const RETRY: Duration = Duration::from_millis(250);

/// What the failover check keeps: the acknowledged puts, under their own lock, and the
/// leader the last check was done against.
pub struct Failover {
    acked: Mutex<Acked>,
    /// The leader whose check has ended (the first one followed needs none); `None`
    /// until [`follow`] runs. While the master in force differs, its check is pending:
    /// a key of the window it lacks may be about to be put again.
    checked: watch::Sender<Option<Leader>>,
}

/// How one key of the window came out of a check (the `result` label of
/// `moongate_kv_failover_keys_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The new leader has it.
    Present,
    /// Missing, and put again from bytes moongate vouched for.
    PutAgain,
    /// Missing, and removed through moongate (or evicted by it) meanwhile: left gone.
    EndedHere,
    /// Missing, and its bytes could not be vouched for.
    Lost,
    /// Missing, and the old leader had already let it go before the change (it
    /// evicted it, or someone removed it not through moongate): its own-segment range
    /// was handed to another put before the change, or a lookup through moongate found
    /// it gone then. Left gone: it was not the change that lost it.
    GoneBefore,
}

impl Outcome {
    pub const ALL: [Outcome; 5] = [
        Outcome::Present,
        Outcome::PutAgain,
        Outcome::EndedHere,
        Outcome::Lost,
        Outcome::GoneBefore,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Outcome::Present => "present",
            Outcome::PutAgain => "put_again",
            Outcome::EndedHere => "ended_here",
            Outcome::Lost => "lost",
            Outcome::GoneBefore => "gone_before",
        }
    }
}

impl Failover {
    pub fn new(window: Duration, limit: usize) -> Failover {
        Failover {
            acked: Mutex::new(Acked::new(window, limit)),
            checked: watch::Sender::new(None),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Acked> {
        self.acked.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Whether a call is one the failover check follows.
pub(super) fn follows(req: &Request) -> bool {
    matches!(
        req,
        Request::PutStart(_)
            | Request::BatchPutStart(_)
            | Request::PutEnd(_)
            | Request::BatchPutEnd(_)
            | Request::PutRevoke(_)
            | Request::BatchPutRevoke(_)
            | Request::Remove(_)
    )
}

fn memory_replica(
    replicas: &[ReplicaDescriptor],
) -> Option<&crate::codec::types::BufferDescriptor> {
    replicas.iter().find_map(|r| match &r.location {
        ReplicaLocation::Memory(m) => Some(&m.buffer_descriptor),
        _ => None,
    })
}

/// The reason a key missing after a change could not be put again.
#[derive(Debug, thiserror::Error)]
enum Unvouched {
    /// Writes begin only on ranges a leader handed out as free, and the ranges are held
    /// from the moment the old leader is seen gone, before any new one serves: one
    /// written over was freed by the old leader (the key evicted or removed there).
    #[error("its range in the own segment was handed to another put before the change")]
    Overwritten,
    #[error("its bytes were written into another segment by an engine (no hash)")]
    NoHash,
    #[error("no memory replica")]
    NoMemoryReplica,
    #[error("its bytes changed where they were written")]
    Changed,
    /// Read while no leader served: only the old leader can have handed the range out.
    #[error("its bytes ({0} B) had changed where they were written before the change")]
    ChangedBefore(u64),
    #[error("reading it back: {0}")]
    Read(StoreError),
    #[error("putting it again: {0}")]
    Put(StoreError),
}

impl Store {
    /// Follows puts for the failover check: acknowledged ones are kept for `window`, at
    /// most `limit` of them (`kv.failover_window_ms`, `kv.failover_window_keys`).
    pub fn with_failover(mut self, window: Duration, limit: usize) -> Store {
        self.failover = (!window.is_zero() && limit > 0).then(|| Failover::new(window, limit));
        self
    }

    /// Whether `key`'s value should be hashed as it passes (its put is followed and
    /// its memory replica is in another segment).
    pub(super) fn wants_hash(&self, key: &[u8]) -> bool {
        self.failover
            .as_ref()
            .is_some_and(|f| f.lock().wants_hash(key))
    }

    /// Records the hash of `key`'s whole value, when it is wanted.
    pub fn vouch(&self, key: &[u8], value: &[u8]) {
        if self.wants_hash(key)
            && let Some(f) = &self.failover
        {
            let h = xxhash_rust::xxh3::xxh3_64(value);
            f.lock().vouch(key, h);
        }
    }

    /// Records the hash computed as `key`'s value streamed through.
    pub(super) fn vouch_hash(&self, key: &[u8], hash: u64) {
        if let Some(f) = &self.failover {
            f.lock().vouch(key, hash);
        }
    }

    /// Learns from a followed call and its answer; `since` is the own segment's write
    /// number read before the call was sent.
    pub(super) fn follow_put(&self, req: &Request, resp: &Response, since: u64) {
        let Some(f) = &self.failover else {
            return;
        };
        let now = Instant::now();
        let place = |replicas: &[ReplicaDescriptor]| match memory_replica(replicas) {
            None => Where::Nowhere,
            Some(d) if matches!(self.xfer.in_own_segment(d), Ok(Some(_))) => Where::Own(d.clone()),
            Some(d) => Where::Elsewhere(d.clone(), None),
        };
        let ended = |key: &Bytes, w: Option<Where>| {
            if let Some(Where::Own(d)) = w
                && let Some((_, mem)) = self.xfer.own_segment()
                && let Some(off) = mem.offset_of(d.buffer_address, d.size)
            {
                mem.fence().held(key, off, d.size as usize, since);
            }
        };
        match (req, resp) {
            (Request::PutStart(a), Response::PutStart(Ok(r))) => {
                let w = place(r);
                f.lock().started(&a.key, w, now);
            }
            (Request::BatchPutStart(a), Response::BatchPutStart(v)) => {
                let places: Vec<_> = v
                    .iter()
                    .map(|r| r.as_ref().ok().map(|r| place(r)))
                    .collect();
                let mut g = f.lock();
                for (k, w) in a.keys.iter().zip(places) {
                    if let Some(w) = w {
                        g.started(k, w, now);
                    }
                }
            }
            (Request::PutEnd(a), Response::PutEnd(r)) if a.replica_type == ReplicaType::ALL => {
                let key = &a.object_meta.key;
                let w = match r {
                    Ok(()) => f.lock().ended(key, now),
                    Err(_) => {
                        f.lock().revoked(key);
                        None
                    }
                };
                ended(key, w);
            }
            (Request::BatchPutEnd(a), Response::BatchPutEnd(v))
                if a.replica_type == ReplicaType::ALL =>
            {
                let done: Vec<_> = {
                    let mut g = f.lock();
                    a.object_metas
                        .iter()
                        .zip(v)
                        .map(|(m, r)| match r {
                            Ok(()) => g.ended(&m.key, now),
                            Err(_) => {
                                g.revoked(&m.key);
                                None
                            }
                        })
                        .collect()
                };
                for (m, w) in a.object_metas.iter().zip(done) {
                    ended(&m.key, w);
                }
            }
            (Request::PutRevoke(a), _) if a.replica_type == ReplicaType::ALL => {
                f.lock().revoked(&a.key);
            }
            (Request::BatchPutRevoke(a), _) if a.replica_type == ReplicaType::ALL => {
                let mut g = f.lock();
                for k in &a.keys {
                    g.revoked(k);
                }
            }
            (Request::Remove(a), Response::Remove(Ok(()))) => {
                f.lock().removed(&a.key);
                if let Some((_, mem)) = self.xfer.own_segment() {
                    mem.fence().forget_held(&a.key);
                }
            }
            _ => {}
        }
    }

    /// Drops from the window the keys moongate removed or evicted since their put (its
    /// evictor removes through its own master connections, which the window does not
    /// follow): they would never be put again, and would take room from live ones.
    /// Run by the kv face's housekeeping; the lookups happen outside the table's lock.
    pub fn prune_failover(&self) -> usize {
        let (Some(f), Some(h)) = (&self.failover, &self.heard) else {
            return 0;
        };
        let keys = f.lock().keys();
        let ended: Vec<_> = keys
            .into_iter()
            .filter(|(k, _)| h.ended_here(&self.tenant, k))
            .collect();
        if ended.is_empty() {
            return 0;
        }
        let gone: Vec<&Bytes> = {
            let mut g = f.lock();
            ended
                .iter()
                .filter(|(k, at)| g.forget_if(k, *at))
                .map(|(k, _)| k)
                .collect()
        };
        if let Some((_, mem)) = self.xfer.own_segment() {
            for k in &gone {
                mem.fence().forget_held(k);
            }
        }
        gone.len()
    }

    /// A lookup found `keys` absent at the master in force. One of them in the window
    /// may be missing only because that master is a new leader whose check has not put
    /// it again yet: then this waits for the check (at most `kv.timeout_ms`) and says to
    /// ask again (`true`). Otherwise, or when the check did not end in time, the answer
    /// stands. So a reader does not see a miss for a put the check is about to restore.
    pub(super) async fn await_check<'a>(&self, keys: impl IntoIterator<Item = &'a Bytes>) -> bool {
        let Some(f) = self.failover.as_ref().filter(|_| self.check_pending()) else {
            return false;
        };
        let now = Instant::now();
        let kept = {
            let g = f.lock();
            keys.into_iter().any(|k| g.kept(k, now))
        };
        if !kept {
            return false;
        }
        let mut checked = f.checked.subscribe();
        let ended = checked.wait_for(|c| !self.due(c));
        matches!(
            tokio::time::timeout(self.call_timeout, ended).await,
            Ok(Ok(_))
        )
    }

    /// Whether the master in force is a leader whose failover check has not ended.
    pub(super) fn check_pending(&self) -> bool {
        self.failover
            .as_ref()
            .is_some_and(|f| self.due(&f.checked.borrow()))
    }

    /// Whether a check is due for the master in force, the last one checked being
    /// `checked` (`None`: none followed yet, nothing to check). Per lookup that misses:
    /// compared in place, nothing copied.
    fn due(&self, checked: &Option<Leader>) -> bool {
        checked.is_some() && !self.master.leader_is(checked)
    }

    /// Counts a read that waited for a check ([`Store::await_check`]) and then found
    /// its key (`true`) or not.
    pub(super) fn waited_for_check(&self, found: bool) {
        self.metrics.failover_waited_reads[usize::from(!found)].inc();
    }

    /// Acknowledged puts followed now (a gauge's reading).
    pub fn failover_followed(&self) -> Option<usize> {
        self.failover.as_ref().map(|f| f.lock().len())
    }

    /// The puts acknowledged within the window before `seen` (and since).
    fn window(&self, seen: Instant) -> Vec<(Bytes, Entry)> {
        let Some(f) = &self.failover else {
            return Vec::new();
        };
        let mut g = f.lock();
        let from = seen.checked_sub(g.window()).unwrap_or(seen);
        g.since(from, Instant::now())
    }

    /// How a key the new leader lacks ended before the change, if moongate knows: it
    /// removed or evicted it, or a lookup found it gone before `seen`.
    fn settled(&self, key: &Bytes, seen: Instant) -> Option<Outcome> {
        let h = self.heard.as_ref()?;
        if h.ended_here(&self.tenant, key) {
            Some(Outcome::EndedHere)
        } else if h.gone_before(&self.tenant, key, seen) {
            Some(Outcome::GoneBefore)
        } else {
            None
        }
    }

    /// The own-segment ranges of `entries` (the window's puts), held as views are (see
    /// [`Pins`]): from here the next leader's puts cannot land on bytes that may still
    /// be needed.
    fn pin(&self, entries: &[(Bytes, Entry)], seen: Instant, pins: &mut Pins) {
        let Some((_, mem)) = self.xfer.own_segment() else {
            return;
        };
        // Not the ones known to have ended before: their ranges are free for good.
        let keys: Vec<Bytes> = entries
            .iter()
            .filter(|(k, e)| {
                matches!(e.bytes, Where::Own(_))
                    && !pins.held.contains_key(k)
                    && self.settled(k, seen).is_none()
            })
            .map(|(k, _)| k.clone())
            .collect();
        for (k, r) in keys.iter().zip(mem.fence().pin_held(&keys)) {
            if let Some(r) = r {
                pins.held.insert(k.clone(), r);
            }
        }
        pins.mem = Some(mem.clone());
    }

    /// Reads back, newest first, the window's values in other segments that moongate
    /// hashed as they passed, while no leader serves (see [`follow`]); as far as the
    /// node's byte budget goes (the rest are read once the new leader is in force).
    /// Returns when all are read, or the budget is spent.
    async fn read_ahead(&self, seen: Instant, pins: &mut Pins) {
        let mut entries = self.window(seen);
        // Not the ones known to have ended before (moongate's evictor removes keys
        // through its own master connections, which this table does not follow).
        entries.retain(|(k, e)| {
            matches!(e.bytes, Where::Elsewhere(_, Some(_)))
                && !pins.read.contains_key(k)
                && !pins.changed.contains(k)
                && self.settled(k, seen).is_none()
        });
        entries.sort_by_key(|(_, e)| std::cmp::Reverse(e.at));
        for (k, e) in entries {
            let Where::Elsewhere(d, Some(h)) = &e.bytes else {
                continue;
            };
            let Ok(room) = self.reserve(d.size).await else {
                return;
            };
            match self.xfer.fetch(d, None).await {
                Ok(Value::Whole(v)) if xxhash_rust::xxh3::xxh3_64(&v) == *h => {
                    self.metrics.failover_read_ahead[0].inc();
                    pins.read.insert(k, (v, room));
                }
                Ok(_) => {
                    self.metrics.failover_read_ahead[1].inc();
                    pins.changed.insert(k);
                }
                // Its owner may be back later: read again at the check.
                Err(_) => {}
            }
        }
    }

    /// Checks every put acknowledged within the window before `seen` against the
    /// master in force now and puts the missing ones again where it can (see the
    /// module); `pins` are released as keys are settled. Per outcome, how many keys.
    async fn recheck(
        &self,
        seen: Instant,
        pins: &mut Pins,
        deadline: Instant,
    ) -> [u64; Outcome::ALL.len()] {
        let mut counts = [0u64; Outcome::ALL.len()];
        let entries = self.window(seen);
        // Puts the old leader acknowledged after the pins were taken.
        self.pin(&entries, seen, pins);
        // What the new leader lacks, asked for every key first: the ranges of the keys
        // it has are free again before any key is put anew.
        let mut missing: Vec<&(Bytes, Entry)> = Vec::new();
        for part in entries.chunks(CHECK_CHUNK) {
            let keys: Vec<Bytes> = part.iter().map(|(k, _)| k.clone()).collect();
            let present = loop {
                match self.exists_at_master(keys.clone()).await {
                    Ok(v) => break Some(v),
                    Err(e) if Instant::now() < deadline => {
                        tracing::debug!(error = %e, "failover check: the new leader does not answer yet");
                        tokio::time::sleep(RETRY).await;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, keys = keys.len(),
                            "failover check: the new leader did not answer; these keys are not checked");
                        break None;
                    }
                }
            };
            let Some(present) = present else {
                keys.iter().for_each(|k| pins.release(k));
                continue;
            };
            for (e, here) in part.iter().zip(present) {
                if here {
                    pins.release(&e.0);
                    counts[Outcome::Present as usize] += 1;
                } else if let Some(o) = self.settled(&e.0, seen) {
                    pins.release(&e.0);
                    counts[o as usize] += 1;
                } else {
                    missing.push(e);
                }
            }
        }
        // Put again in rounds. First every missing key's bytes are read (own ones
        // copied out of their held ranges, which are then released; others read back
        // from their segments before the new leader's puts land there), as far as the
        // node's byte budget goes; then those are put. Released first, so that no put
        // waits on a range this check still holds. Values read ahead come first: they
        // hold budget already, and the first round's puts give it back.
        missing.sort_by_key(|e| !pins.read.contains_key(&e.0));
        let mut lost: Vec<(Bytes, String)> = Vec::new();
        let mut rest: &[&(Bytes, Entry)] = &missing;
        while !rest.is_empty() {
            let mut vouched = Vec::new();
            let mut taken = 0;
            for (k, e) in rest.iter().map(|e| (&e.0, &e.1)) {
                match self.vouched(k, e, pins).await {
                    Ok(v) => vouched.push((k, v)),
                    // The budget is spent: this round puts what it read, the next reads on.
                    Err(Unvouched::Read(StoreError::Busy(_))) if !vouched.is_empty() => break,
                    Err(Unvouched::Overwritten | Unvouched::ChangedBefore(_)) => {
                        counts[Outcome::GoneBefore as usize] += 1
                    }
                    Err(why) => lost.push((k.clone(), why.to_string())),
                }
                taken += 1;
            }
            rest = &rest[taken..];
            let jobs: Vec<_> = vouched
                .iter()
                .map(|(k, (v, _room, seg))| self.put_again(k, v, seg, deadline))
                .collect();
            let done = super::in_order(jobs, super::BATCH_CONCURRENCY).await;
            for ((k, _), r) in vouched.iter().zip(done) {
                match r {
                    Ok(o) => counts[o as usize] += 1,
                    Err(why) => lost.push(((*k).clone(), why.to_string())),
                }
            }
        }
        counts[Outcome::Lost as usize] += lost.len() as u64;
        if !lost.is_empty() {
            let keys: Vec<Bytes> = lost.iter().map(|(k, _)| k.clone()).collect();
            if let Some(h) = &self.heard {
                h.lost(&self.tenant, &keys);
            }
            for (k, why) in lost.iter().take(20) {
                tracing::warn!(key = %String::from_utf8_lossy(k), %why,
                    "failover check: an acknowledged put the new leader lacks is lost");
            }
        }
        counts
    }

    /// The bytes of a key the new leader lacks, if moongate can vouch for them, with
    /// the budget they hold (an own range is released once its bytes are copied out).
    async fn vouched(
        &self,
        key: &Bytes,
        e: &Entry,
        pins: &mut Pins,
    ) -> Result<(Bytes, super::Reserved, Bytes), Unvouched> {
        match &e.bytes {
            Where::Own(d) => {
                let Some(&(start, len)) = pins.held.get(key) else {
                    return Err(Unvouched::Overwritten);
                };
                let Some(mem) = pins.mem.clone().filter(|_| len as u64 == d.size) else {
                    return Err(Unvouched::Overwritten);
                };
                // Without budget the range stays held (a later round copies it).
                let room = self.reserve(d.size).await.map_err(Unvouched::Read)?;
                let v = mem.read_vec(start, len);
                pins.release(key);
                Ok((Bytes::from(v), room, d.transport_endpoint.clone()))
            }
            Where::Elsewhere(d, Some(_)) if pins.changed.contains(key) => {
                Err(Unvouched::ChangedBefore(d.size))
            }
            Where::Elsewhere(d, Some(_)) if pins.read.contains_key(key) => {
                let (v, room) = pins.read.remove(key).expect("checked above");
                Ok((v, room, d.transport_endpoint.clone()))
            }
            Where::Elsewhere(d, Some(h)) => {
                let room = self.reserve(d.size).await.map_err(Unvouched::Read)?;
                match self.xfer.fetch(d, None).await {
                    Ok(Value::Whole(v)) if xxhash_rust::xxh3::xxh3_64(&v) == *h => {
                        Ok((v, room, d.transport_endpoint.clone()))
                    }
                    Ok(_) => Err(Unvouched::Changed),
                    Err(e) => Err(Unvouched::Read(e)),
                }
            }
            Where::Elsewhere(_, None) => Err(Unvouched::NoHash),
            Where::Nowhere => Err(Unvouched::NoMemoryReplica),
        }
    }

    /// Puts `value` again under `key`, in `segment` (where it was) first: a new leader
    /// that knows few segments yet would otherwise fill those it knows. It may not take
    /// puts at once (its segments come back with their owners' remounts): retried until
    /// `deadline`.
    async fn put_again(
        &self,
        key: &Bytes,
        value: &Bytes,
        segment: &Bytes,
        deadline: Instant,
    ) -> Result<Outcome, Unvouched> {
        loop {
            let mut start = self.put_start(key.clone(), value.len() as u64);
            if let Request::PutStart(a) = &mut start {
                a.config.preferred_segments = vec![segment.clone()];
            }
            match self.put(key.clone(), value.clone(), start).await {
                Ok(()) => return Ok(Outcome::PutAgain),
                Err(StoreError::Refused(ErrorCode::OBJECT_ALREADY_EXISTS)) => {
                    return Ok(Outcome::Present);
                }
                Err(e) if Instant::now() < deadline && retryable(&e) => {
                    tokio::time::sleep(RETRY).await;
                }
                Err(e) => return Err(Unvouched::Put(e)),
            }
        }
    }
}

/// What the failover check holds between the old leader's end and each key's
/// settling: own-segment ranges (each as one view), and values in other segments read
/// back while no leader served (each with the byte budget it takes). Released as their
/// keys are settled, and all at once when dropped.
#[derive(Default)]
struct Pins {
    mem: Option<std::sync::Arc<crate::kv::own::segment::Memory>>,
    held: std::collections::HashMap<Bytes, (usize, usize)>,
    /// Read back and found as they passed through moongate.
    read: std::collections::HashMap<Bytes, (Bytes, super::Reserved)>,
    /// Read back and found changed: the old leader had handed their ranges to other
    /// puts (no leader served since), so it had let them go.
    changed: std::collections::HashSet<Bytes>,
}

impl Pins {
    fn release(&mut self, key: &[u8]) {
        if let (Some(m), Some((s, l))) = (&self.mem, self.held.remove(key)) {
            m.fence().unview(s, l);
        }
        self.read.remove(key);
    }
}

impl Drop for Pins {
    fn drop(&mut self) {
        if let Some(m) = &self.mem {
            for (_, (s, l)) in self.held.drain() {
                m.fence().unview(s, l);
            }
        }
    }
}

/// Errors of a put that a new leader gives while it is not ready for it.
fn retryable(e: &StoreError) -> bool {
    matches!(
        e,
        StoreError::Master(_)
            | StoreError::Rpc(_)
            | StoreError::NoLeader
            | StoreError::MasterBusy
            | StoreError::Busy(_)
            | StoreError::Fenced(_)
            | StoreError::Transfer(_)
            | StoreError::Refused(ErrorCode::NO_AVAILABLE_HANDLE | ErrorCode::SEGMENT_NOT_FOUND)
    )
}

/// Follows the master in force and runs the check after each change of leader (a new
/// address, or a new view version at the same one), until `shutdown`. The own ranges
/// of the window are held from the moment the old leader is seen gone; values in
/// other segments are read back from the moment it stops answering (or is seen gone).
/// Returns at once when the check is off.
pub async fn follow(store: &Store, mut upstream: Upstream, shutdown: CancellationToken) {
    let Some(f) = &store.failover else {
        return;
    };
    let mut silence = upstream.silence();
    let mut last: Option<Leader> = upstream.current();
    // Nothing was acknowledged before the first leader this moongate knows.
    f.checked.send_replace(last.clone());
    // Since when the leader in `last` is gone (or silent), and what is held since.
    let mut gone: Option<(Instant, Pins)> = None;
    // Whether to wait for a change (not when one came while reading ahead).
    let mut wait = true;
    loop {
        if wait {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = upstream.changed() => {}
                r = silence.changed() => if r.is_err() { std::future::pending::<()>().await },
            }
        }
        wait = true;
        let now = upstream.current();
        // The leader in force does not answer: Mooncake's stops serving when it cannot
        // renew its lease, and while etcd is down nothing says it is gone.
        let silent = now == last && last.is_some() && *silence.borrow_and_update();
        if now == last && !silent {
            // The same leader, answering (an etcd blip): nothing was forgotten.
            gone = None;
            continue;
        }
        if last.is_none() {
            // The first leader this moongate knows: nothing was acknowledged before it.
            last = now;
            f.checked.send_replace(last.clone());
            continue;
        }
        let (seen, mut pins) = gone
            .take()
            .unwrap_or_else(|| (Instant::now(), Pins::default()));
        if !silent {
            // Gone: from here the own ranges are held. (A silent leader may still hand
            // out free ranges only, so nothing is held for it yet.)
            store.pin(&store.window(seen), seen, &mut pins);
        }
        if silent || now.is_none() {
            // No leader can hand the ranges of values in other segments to new puts
            // yet: they are read back now, before the next one can (a leader whose
            // restore fails sees every range as free).
            let woke = tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = upstream.changed() => true,
                _ = silence.changed() => true,
                _ = store.read_ahead(seen, &mut pins) => false,
            };
            gone = Some((seen, pins));
            wait = !woke;
            continue;
        }
        last = now.clone();
        store.metrics.failover_rechecks.inc();
        let counts = tokio::select! {
            _ = shutdown.cancelled() => return,
            c = store.recheck(seen, &mut pins, seen + SETTLE) => c,
        };
        drop(pins);
        f.checked.send_replace(last.clone());
        // What the check read and put (up to the byte budget at once) is freed now.
        crate::heap::give_back();
        for o in Outcome::ALL {
            store.metrics.failover_keys[o as usize].inc_by(counts[o as usize]);
        }
        tracing::info!(leader = ?now.map(|l| l.addr),
            present = counts[0], put_again = counts[1], ended_here = counts[2], lost = counts[3],
            gone_before = counts[4],
            "failover check: acknowledged puts checked against the new leader");
    }
}

//! What each family of master methods means: a room per family that knows its keys, how
//! its batches are cut and their answers merged, what its answers say about tiers, and
//! what they tell the key table. Adding a method (or another Mooncake version's
//! layout of one) touches the codec's wire table, the one [`call`] / [`answer`] match
//! here, and its room; nothing else.
//!
//! | room | methods |
//! | --- | --- |
//! | [`put`] | PutStart, UpsertStart, BatchPutStart, BatchUpsertStart |
//! | [`end`] | PutEnd, UpsertEnd, BatchPutEnd, BatchUpsertEnd, PutRevoke, BatchPutRevoke |
//! | [`lookup`] | GetReplicaList, BatchGetReplicaList |
//! | [`exist`] | ExistKey, BatchExistKey |
//! | [`remove`] | Remove, RemoveAll |
//! | [`client`] | MountSegment, ReMountSegment, UnmountSegment, Ping, FetchTasks |
//! | [`offload`] | MountLocalDiskSegment, ReportSsdCapacity, OffloadObjectHeartbeat, NotifyOffloadSuccess, PromotionAllocStart, NotifyPromotionSuccess (read, never changed) |
//! | [`offload_read`] | the owner's own service, not the master's: `batch_get_offload_object`, `release_offload_buffer` (cut into parts and merged by the owner face) |
//!
//! Pure: decoded values in, decoded values out. The codec below knows only the wire;
//! the master face, the policy view and the evictor above ask these rooms.

pub mod client;
pub mod end;
pub mod exist;
pub mod lookup;
pub mod offload;
pub mod offload_read;
pub mod put;
pub mod remove;

use bytes::Bytes;

use crate::codec::keys::{self, Keys};
use crate::codec::message::{KeyArgs, KeysArgs, Request, Response};
use crate::codec::types::{ErrorCode, Expected, Tier, Uuid};

/// A decoded request by family.
pub enum Call<'a> {
    Put(put::Put<'a>),
    End(end::End<'a>),
    Lookup(lookup::Lookup<'a>),
    Exist(exist::Exist<'a>),
    Remove(remove::Remove<'a>),
    Client(client::Client<'a>),
    /// ServiceReady, GetStorageConfig: no keys, no client.
    Other,
}

/// The family of a request: the one match from the wire enum to the rooms.
pub fn call(req: &Request) -> Call<'_> {
    use put::Put;
    match req {
        Request::PutStart(a) => Call::Put(Put::Single(put::Kind::Put, a)),
        Request::UpsertStart(a) => Call::Put(Put::Single(put::Kind::Upsert, a)),
        Request::BatchPutStart(a) => Call::Put(Put::Batch(put::Kind::Put, a)),
        Request::BatchUpsertStart(a) => Call::Put(Put::Batch(put::Kind::Upsert, a)),
        Request::PutEnd(a) => Call::End(end::End::One(end::Kind::Put, a)),
        Request::UpsertEnd(a) => Call::End(end::End::One(end::Kind::Upsert, a)),
        Request::BatchPutEnd(a) => Call::End(end::End::BatchPut(a)),
        Request::BatchUpsertEnd(a) => Call::End(end::End::BatchUpsert(a)),
        Request::PutRevoke(a) => Call::End(end::End::Revoke(a)),
        Request::BatchPutRevoke(a) => Call::End(end::End::BatchRevoke(a)),
        Request::GetReplicaList(a) => Call::Lookup(Keyed::One(a)),
        Request::BatchGetReplicaList(a) => Call::Lookup(Keyed::Batch(a)),
        Request::ExistKey(a) => Call::Exist(Keyed::One(a)),
        Request::BatchExistKey(a) => Call::Exist(Keyed::Batch(a)),
        Request::Remove(a) => Call::Remove(remove::Remove::One(a)),
        Request::RemoveAll(a) => Call::Remove(remove::Remove::All(a)),
        Request::MountSegment(a) => Call::Client(client::Client::Mount(a)),
        Request::ReMountSegment(a) => Call::Client(client::Client::ReMount(a)),
        Request::UnmountSegment(a) => Call::Client(client::Client::Unmount(a)),
        Request::Ping(id) => Call::Client(client::Client::Ping(id)),
        Request::FetchTasks(a) => Call::Client(client::Client::FetchTasks(a)),
        Request::ServiceReady(_) | Request::GetStorageConfig(_) | Request::BatchReplicaClear(_) => {
            Call::Other
        }
    }
}

/// A call by key alone (`KeyArgs` / `KeysArgs`): the lookup and exist families.
#[derive(Debug, Clone, Copy)]
pub enum Keyed<'a> {
    One(&'a KeyArgs),
    Batch(&'a KeysArgs),
}

impl<'a> Keyed<'a> {
    /// The keys, borrowed (a batch's are read out of its frame as they are asked for).
    pub fn keys(&self) -> keys::Iter<'a> {
        match self {
            Keyed::One(a) => keys::Iter::of(std::slice::from_ref(&a.key)),
            Keyed::Batch(a) => a.keys.iter(),
        }
    }

    pub fn first(&self) -> Option<&'a [u8]> {
        self.keys().next()
    }

    pub fn len(&self) -> usize {
        match self {
            Keyed::One(_) => 1,
            Keyed::Batch(a) => a.keys.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The keys as a list of their own (sharing the request's memory).
    pub fn to_keys(&self) -> Keys {
        match self {
            Keyed::One(a) => Keys::one(a.key.clone()),
            Keyed::Batch(a) => a.keys.clone(),
        }
    }

    pub fn tenant(&self) -> &'a Bytes {
        match self {
            Keyed::One(a) => &a.tenant_id,
            Keyed::Batch(a) => &a.tenant_id,
        }
    }

    /// A batch's parts, each made into a request by `make` (`None` for one key).
    fn split(
        &self,
        parts: &[std::ops::Range<usize>],
        make: fn(KeysArgs) -> Request,
    ) -> Option<Vec<Request>> {
        let Keyed::Batch(a) = self else {
            return None;
        };
        Some(
            parts
                .iter()
                .map(|r| {
                    make(KeysArgs {
                        keys: a.keys.slice(r.clone()),
                        tenant_id: a.tenant_id.clone(),
                    })
                })
                .collect(),
        )
    }
}

/// What moongate asks of any decoded request.
pub trait CallExt {
    /// The Mooncake client id the request carries, if any.
    fn client_id(&self) -> Option<Uuid>;
    /// The (first) key the request names, if any.
    fn first_key(&self) -> Option<&[u8]>;
    /// Keys the request names (1 for single-key methods, 0 for others).
    fn key_count(&self) -> usize;
    /// Cuts a batch request into sub-requests of the same method, one per range that
    /// `starts` opens (indexes where a new part begins), every other field copied. `None`
    /// for a method that is not a batch, for split points that do not rise strictly
    /// inside `1..keys`, or for a put whose per-key vectors disagree in length.
    fn split_at(&self, starts: &[usize]) -> Option<Vec<Request>>;
}

impl CallExt for Request {
    fn client_id(&self) -> Option<Uuid> {
        match call(self) {
            Call::Put(c) => Some(c.client_id()),
            Call::End(c) => Some(c.client_id()),
            Call::Client(c) => Some(c.client_id()),
            _ => None,
        }
    }

    fn first_key(&self) -> Option<&[u8]> {
        match call(self) {
            Call::Put(c) => c.keys().first().map(|k| &k[..]),
            Call::End(c) => c.first_key(),
            Call::Lookup(c) | Call::Exist(c) => c.first(),
            Call::Remove(c) => c.key().map(|k| &k[..]),
            _ => None,
        }
    }

    fn key_count(&self) -> usize {
        match call(self) {
            Call::Put(c) => c.keys().len(),
            Call::End(c) => c.key_count(),
            Call::Lookup(c) | Call::Exist(c) => c.len(),
            Call::Remove(c) => usize::from(c.key().is_some()),
            _ => 0,
        }
    }

    fn split_at(&self, starts: &[usize]) -> Option<Vec<Request>> {
        let n = self.key_count();
        if starts.is_empty()
            || starts.windows(2).any(|w| w[0] >= w[1])
            || starts[0] == 0
            || starts[starts.len() - 1] >= n
        {
            return None;
        }
        let parts = ranges(starts, n);
        match call(self) {
            Call::Put(c) => c.split(&parts),
            Call::End(c) => c.split(&parts),
            Call::Lookup(c) => lookup::split(&c, &parts),
            Call::Exist(c) => exist::split(&c, &parts),
            _ => None,
        }
    }
}

/// The batch methods whose reply is one result per key in key order, so parts can be
/// concatenated. (`BatchRemove` and `BatchQueryIp` are relayed whole: not typed here.)
pub fn splittable(method: crate::codec::Method) -> bool {
    put::splittable(method)
        || end::splittable(method)
        || lookup::splittable(method)
        || exist::splittable(method)
}

/// The `[start, end)` ranges that `starts` (rising split points, each in `1..len`)
/// cut `0..len` into.
fn ranges(starts: &[usize], len: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::with_capacity(starts.len() + 1);
    let mut at = 0;
    for &s in starts.iter().chain(std::iter::once(&len)) {
        out.push(at..s);
        at = s;
    }
    out
}

/// What moongate asks of any decoded answer.
pub trait AnswerExt: Sized {
    /// The first `ErrorCode` in the reply (a batch's first failed key), if any.
    fn first_error(&self) -> Option<ErrorCode>;
    /// Results in the reply: one per key for batch calls, else 1.
    fn key_count(&self) -> usize;
    /// Number of application-level (`ErrorCode`) errors in the reply: 0 or 1 for single
    /// calls, one per failed key for batch calls.
    fn error_count(&self) -> usize;
    /// [`error_count`](Self::error_count) and [`first_error`](Self::first_error) in one
    /// pass over the results (the answer path wants both, per batch of 64 keys).
    fn errors(&self) -> (usize, Option<ErrorCode>);
    /// Appends the per-key results of `part` (the answer to the next sub-request of a
    /// split batch) to this one; the merged reply is the master's answer to the unsplit
    /// batch. `Err(part)` when the two are not answers of the same batch method.
    fn append(&mut self, part: Self) -> Result<(), Self>;
}

/// Calls `f` with each `ErrorCode` in the reply, in key order, until it returns false.
/// (A visitor, not an iterator: no allocation on the answer path.)
fn visit_errors(resp: &Response, mut f: impl FnMut(ErrorCode) -> bool) {
    fn one<T>(r: &Expected<T>, f: &mut impl FnMut(ErrorCode) -> bool) {
        if let Err(e) = r {
            f(*e);
        }
    }
    fn many<T>(v: &[Expected<T>], f: &mut impl FnMut(ErrorCode) -> bool) {
        for r in v {
            if let Err(e) = r
                && !f(*e)
            {
                return;
            }
        }
    }
    match resp {
        Response::ServiceReady(r) => one(r, &mut f),
        Response::GetStorageConfig(r) => one(r, &mut f),
        Response::MountSegment(r)
        | Response::ReMountSegment(r)
        | Response::UnmountSegment(r)
        | Response::PutEnd(r)
        | Response::PutRevoke(r)
        | Response::UpsertEnd(r)
        | Response::Remove(r) => one(r, &mut f),
        Response::Ping(r) => one(r, &mut f),
        Response::FetchTasks(r) => one(r, &mut f),
        Response::PutStart(r) | Response::UpsertStart(r) => one(r, &mut f),
        Response::BatchPutStart(v) | Response::BatchUpsertStart(v) => many(v, &mut f),
        Response::BatchPutEnd(v) | Response::BatchPutRevoke(v) | Response::BatchUpsertEnd(v) => {
            many(v, &mut f)
        }
        Response::GetReplicaList(r) => one(r, &mut f),
        Response::BatchGetReplicaList(v) => many(v, &mut f),
        Response::ExistKey(r) => one(r, &mut f),
        Response::BatchExistKey(v) => many(v, &mut f),
        Response::RemoveAll(_) => {}
        Response::BatchReplicaClear(r) => one(r, &mut f),
    }
}

impl AnswerExt for Response {
    fn first_error(&self) -> Option<ErrorCode> {
        let mut first = None;
        visit_errors(self, |e| {
            first = Some(e);
            false
        });
        first
    }

    fn key_count(&self) -> usize {
        match self {
            Response::BatchPutStart(v) | Response::BatchUpsertStart(v) => v.len(),
            Response::BatchGetReplicaList(v) => v.len(),
            Response::BatchExistKey(v) => v.len(),
            Response::BatchPutEnd(v)
            | Response::BatchPutRevoke(v)
            | Response::BatchUpsertEnd(v) => v.len(),
            _ => 1,
        }
    }

    fn error_count(&self) -> usize {
        self.errors().0
    }

    // Inlined into the answer path, which calls it for every answer it finishes.
    #[inline]
    fn errors(&self) -> (usize, Option<ErrorCode>) {
        let (mut n, mut first) = (0, None);
        visit_errors(self, |e| {
            n += 1;
            first.get_or_insert(e);
            true
        });
        (n, first)
    }

    fn append(&mut self, part: Response) -> Result<(), Response> {
        let part = match put::append(self, part) {
            Ok(()) => return Ok(()),
            Err(p) => p,
        };
        let part = match end::append(self, part) {
            Ok(()) => return Ok(()),
            Err(p) => p,
        };
        let part = match lookup::append(self, part) {
            Ok(()) => return Ok(()),
            Err(p) => p,
        };
        exist::append(self, part)
    }
}

/// What a forwarded request's answer can tell the key table, taken from the
/// request on its way up (the answer alone does not name the keys).
/// Keys are per tenant: every tracked call carries the tenant it names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tracked {
    pub tenant: Bytes,
    pub what: Track,
    /// The client id the call carries (zero when it carries none): the owner of the
    /// keys a put stores, whom the master checks on a replica clear.
    pub client: Uuid,
}

impl Tracked {
    /// A `Remove` or `RemoveAll`.
    pub fn is_remove(&self) -> bool {
        matches!(self.what, Track::Remove(_) | Track::RemoveAll)
    }
}

/// The keys a tracked call is about, by what it does to them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Track {
    /// Put starts: key and size.
    Put(Vec<(Bytes, u64)>),
    /// PutEnd / UpsertEnd and their batch forms: the keys are stored.
    End(Vec<Bytes>),
    /// PutRevoke / BatchPutRevoke: the put was abandoned.
    Revoke(Vec<Bytes>),
    Lookup(Keys),
    Remove(Bytes),
    RemoveAll,
}

/// One thing an answer says about stored keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    /// Put starts the master accepted: key, size, tier of its first replica.
    Stored(Vec<(Bytes, u64, Tier)>),
    /// Where the memory replica of a stored key lives: key, the segment's transfer
    /// endpoint (what a replica clear names it by, once mapped to the segment's name).
    Placed(Vec<(Bytes, Bytes)>),
    /// Bytes of puts the master refused for lack of room (NO_AVAILABLE_HANDLE).
    Denied(u64),
    /// Keys whose put ended: they may now be removed.
    Completed(Vec<Bytes>),
    /// Keys a lookup found (with the tier it named, when it named one).
    Found(Vec<(Bytes, Option<Tier>)>),
    /// Keys a lookup did not find.
    Missed(Vec<Bytes>),
    /// Keys a client removed (Remove, a revoked put; also when already gone).
    Removed(Vec<Bytes>),
    /// Everything removed.
    Cleared,
}

impl Tracked {
    /// The part of `req` the table needs, for the methods that change or show what is
    /// stored.
    pub fn of(req: &Request) -> Option<Tracked> {
        let (tenant, what) = match call(req) {
            Call::Put(c) => (c.tenant(), c.tracked()),
            Call::End(c) => (c.tenant(), c.tracked()),
            Call::Lookup(c) | Call::Exist(c) => (c.tenant(), Track::Lookup(c.to_keys())),
            Call::Remove(c) => (c.tenant(), c.tracked()),
            _ => return None,
        };
        Some(Tracked {
            tenant: tenant.clone(),
            what,
            client: req.client_id().unwrap_or_default(),
        })
    }

    /// What the successful answer `resp` says about the tracked keys (nothing when the
    /// answer does not fit the request).
    pub fn seen(&self, resp: &Response) -> Vec<Seen> {
        match &self.what {
            Track::Put(keys) => put::seen(keys, resp),
            Track::End(keys) => end::seen_end(keys, resp),
            Track::Revoke(keys) => end::seen_revoke(keys, resp),
            Track::Lookup(keys) => {
                let mut s = lookup::seen(keys, resp);
                s.extend(exist::seen(keys, resp));
                s
            }
            Track::Remove(key) => remove::seen_one(key, resp),
            Track::RemoveAll => remove::seen_all(resp),
        }
    }
}

/// Tier label values of the tier metrics, in index order. NVMe-oF and DFS replicas, and
/// keys with no replica, count as `unknown`.
pub const TIER_LABELS: [&str; 4] = ["memory", "disk", "local_disk", "unknown"];
/// Outcome label values of the tier metrics, in index order.
pub const OUTCOMES: [&str; 3] = ["found", "not_found", "error"];

const UNKNOWN: usize = 3;
const FOUND: usize = 0;
const NOT_FOUND: usize = 1;
const ERROR: usize = 2;

/// The [`TIER_LABELS`] index of a tier.
pub fn tier_label(t: Tier) -> usize {
    match t {
        Tier::Memory => 0,
        Tier::Disk => 1,
        Tier::LocalDisk => 2,
        Tier::Nof | Tier::Dfs => UNKNOWN,
    }
}

/// Tier accounting from answers the master face already carries: which tier the keys a
/// client looked up live on, and how many lookups hit, at zero extra RPCs.
///
/// Semantics (stable: dashboards use them):
/// - A found key counts once in every tier it has a replica in, with its object size as
///   bytes; a key with a memory and a disk replica counts in both.
/// - A key the master does not know counts as `not_found` under tier `unknown`; any
///   other per-key error as `error` under `unknown`.
/// - `ExistKey` / `BatchExistKey`: `hit` for true, `miss` for false; errors are neither.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Tally {
    /// `[tier][outcome]` keys.
    pub keys: [[u64; 3]; 4],
    /// `[tier][outcome]` bytes.
    pub bytes: [[u64; 3]; 4],
    pub hits: u64,
    pub misses: u64,
}

impl Tally {
    pub fn is_empty(&self) -> bool {
        *self == Tally::default()
    }

    /// The tally of one decoded answer (empty for methods that carry no lookup).
    pub fn of(resp: &Response) -> Tally {
        let mut t = Tally::default();
        lookup::tally(resp, &mut t);
        exist::tally(resp, &mut t);
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::BodyStyle;
    use crate::codec::message::{BatchPutStartArgs, KeysArgs, PutStartArgs, RemoveAllArgs};
    use crate::codec::types::ReplicateConfig;
    use bytes::BytesMut;

    fn key(k: &str) -> Bytes {
        Bytes::copy_from_slice(k.as_bytes())
    }

    #[test]
    fn split_parts_merge_back_to_the_unsplit_batch() {
        let keys: Vec<Bytes> = (0..700).map(|i| Bytes::from(format!("k{i}"))).collect();
        let req = Request::BatchPutStart(BatchPutStartArgs {
            client_id: Uuid {
                first: 7,
                second: 9,
            },
            keys: keys.clone(),
            slice_lengths: (0..700).collect(),
            config: ReplicateConfig::default(),
            tenant_id: Bytes::from_static(b"t"),
        });
        let parts = req.split_at(&[256, 512]).unwrap();
        assert_eq!(
            parts.iter().map(CallExt::key_count).collect::<Vec<_>>(),
            [256, 256, 188]
        );
        let Request::BatchPutStart(last) = &parts[2] else {
            panic!("method changed")
        };
        assert_eq!((&last.keys[0], last.slice_lengths[0]), (&keys[512], 512));
        // A part below 256 keys narrows the size width; the merged reply widens again.
        let whole: Vec<Expected<bool>> = (0..700)
            .map(|i| {
                if i % 3 == 0 {
                    Err(ErrorCode(-704))
                } else {
                    Ok(i % 2 == 0)
                }
            })
            .collect();
        let mut merged = Response::BatchExistKey(whole[..256].to_vec());
        merged
            .append(Response::BatchExistKey(whole[256..512].to_vec()))
            .unwrap();
        merged
            .append(Response::BatchExistKey(whole[512..].to_vec()))
            .unwrap();
        let (mut a, mut b) = (BytesMut::new(), BytesMut::new());
        merged.encode_body(BodyStyle::MOONCAKE, &mut a);
        Response::BatchExistKey(whole).encode_body(BodyStyle::MOONCAKE, &mut b);
        assert_eq!(a, b);
        assert!(merged.append(Response::BatchPutEnd(vec![])).is_err());
    }

    #[test]
    fn split_refuses_bad_points_and_single_calls() {
        let req = Request::BatchExistKey(KeysArgs {
            keys: vec![Bytes::from_static(b"a"), Bytes::from_static(b"b")].into(),
            tenant_id: Bytes::new(),
        });
        for bad in [&[][..], &[0], &[2], &[1, 1]] {
            assert!(req.split_at(bad).is_none(), "{bad:?}");
        }
        assert_eq!(req.split_at(&[1]).unwrap().len(), 2);
        let single = Request::PutStart(PutStartArgs {
            client_id: Uuid::default(),
            key: key("k"),
            slice_length: 3,
            config: ReplicateConfig::default(),
            tenant_id: key("default"),
        });
        assert!(single.split_at(&[1]).is_none());
    }

    #[test]
    fn error_visiting() {
        let v = Response::error(
            crate::codec::Method::BatchPutStart,
            ErrorCode::NO_AVAILABLE_HANDLE,
            3,
        )
        .unwrap();
        assert_eq!(v.error_count(), 3);
        assert_eq!(v.first_error(), Some(ErrorCode::NO_AVAILABLE_HANDLE));
        let mixed =
            Response::BatchExistKey(vec![Ok(true), Err(ErrorCode(-704)), Err(ErrorCode(-1))]);
        assert_eq!(
            (mixed.error_count(), mixed.first_error()),
            (2, Some(ErrorCode(-704)))
        );
        assert_eq!(mixed.errors(), (2, Some(ErrorCode(-704))));
        assert_eq!(Response::RemoveAll(3).first_error(), None);
    }

    #[test]
    fn tracked_from_requests() {
        let r = Request::RemoveAll(RemoveAllArgs {
            force: true,
            tenant_id: Bytes::new(),
        });
        assert_eq!(
            Tracked::of(&r),
            Some(Tracked {
                tenant: Bytes::new(),
                what: Track::RemoveAll,
                client: Uuid::default(),
            })
        );
        let r = Request::BatchExistKey(KeysArgs {
            keys: vec![Bytes::from_static(b"a")].into(),
            tenant_id: Bytes::new(),
        });
        assert_eq!(
            Tracked::of(&r).map(|t| t.what),
            Some(Track::Lookup(vec![Bytes::from_static(b"a")].into()))
        );
    }

    #[test]
    fn what_each_family_tells_the_eviction_table() {
        use crate::codec::message::{KeyArgs, PutEndArgs, PutRevokeArgs, RemoveArgs};
        use crate::codec::types::{ObjectMeta, ReplicaType};
        let t = key("default");
        let put = Request::BatchPutStart(BatchPutStartArgs {
            client_id: Uuid::default(),
            keys: vec![key("a"), key("b"), key("c")],
            slice_lengths: vec![10, 20, 30],
            config: ReplicateConfig::default(),
            tenant_id: t.clone(),
        });
        let seen = Tracked::of(&put)
            .unwrap()
            .seen(&Response::BatchPutStart(vec![
                Ok(vec![]),
                Err(ErrorCode::NO_AVAILABLE_HANDLE),
                Err(ErrorCode::OBJECT_ALREADY_EXISTS),
            ]));
        assert_eq!(
            seen,
            [
                Seen::Stored(vec![(key("a"), 10, Tier::Memory)]),
                Seen::Denied(20)
            ]
        );
        // An answer that does not fit the request says nothing.
        assert!(
            Tracked::of(&put)
                .unwrap()
                .seen(&Response::BatchPutStart(vec![Ok(vec![])]))
                .is_empty()
        );
        let end = Request::PutEnd(PutEndArgs {
            client_id: Uuid::default(),
            object_meta: ObjectMeta {
                key: key("a"),
                object_checksum: None,
            },
            replica_type: ReplicaType::ALL,
            tenant_id: t.clone(),
        });
        assert_eq!(
            Tracked::of(&end).unwrap().seen(&Response::PutEnd(Ok(()))),
            [Seen::Completed(vec![key("a")])]
        );
        assert!(
            Tracked::of(&end)
                .unwrap()
                .seen(&Response::PutEnd(Err(ErrorCode::INTERNAL_ERROR)))
                .is_empty()
        );
        let revoke = Request::PutRevoke(PutRevokeArgs {
            client_id: Uuid::default(),
            key: key("a"),
            replica_type: ReplicaType::ALL,
            tenant_id: t.clone(),
        });
        assert_eq!(
            Tracked::of(&revoke)
                .unwrap()
                .seen(&Response::PutRevoke(Err(ErrorCode::INTERNAL_ERROR))),
            [Seen::Removed(vec![key("a")])],
            "a revoked put is gone whatever the answer"
        );
        let exist = Request::ExistKey(KeyArgs {
            key: key("a"),
            tenant_id: t.clone(),
        });
        assert_eq!(
            Tracked::of(&exist)
                .unwrap()
                .seen(&Response::ExistKey(Ok(false))),
            [Seen::Found(vec![]), Seen::Missed(vec![key("a")])]
        );
        let remove = Request::Remove(RemoveArgs {
            key: key("a"),
            force: false,
            tenant_id: t.clone(),
        });
        for (answer, gone) in [
            (Ok(()), true),
            (Err(ErrorCode::OBJECT_NOT_FOUND), true),
            (Err(ErrorCode::OBJECT_HAS_LEASE), false),
        ] {
            let s = Tracked::of(&remove)
                .unwrap()
                .seen(&Response::Remove(answer));
            assert_eq!(!s.is_empty(), gone);
        }
        let all = Tracked {
            tenant: t.clone(),
            what: Track::RemoveAll,
            client: Uuid::default(),
        };
        assert_eq!(all.seen(&Response::RemoveAll(-1)), Vec::<Seen>::new());
        assert_eq!(Tracked::of(&remove).unwrap().tenant, t);
    }
}

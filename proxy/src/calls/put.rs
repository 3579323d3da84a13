//! The put family: `PutStart`, `UpsertStart` and their batch forms. What a policy
//! decides on (keys, sizes, `ReplicateConfig`), how a batch is cut and its answers
//! merged, the bytes it holds in flight, and what an accepted start tells the eviction
//! table.

use std::ops::Range;

use bytes::Bytes;

use super::{Seen, Track};
use crate::codec::Method;
use crate::codec::message::{BatchPutStartArgs, PutStartArgs, Request, Response};
use crate::codec::types::{
    ErrorCode, Expected, ReplicaDescriptor, ReplicaLocation, ReplicateConfig, Tier, Uuid,
};

/// Put or upsert (an upsert replaces an existing value).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Put,
    Upsert,
}

/// A decoded put-family start.
#[derive(Debug, Clone, Copy)]
pub enum Put<'a> {
    Single(Kind, &'a PutStartArgs),
    Batch(Kind, &'a BatchPutStartArgs),
}

impl<'a> Put<'a> {
    /// The put-family start of `req`, if it is one.
    pub fn of(req: &'a Request) -> Option<Put<'a>> {
        match super::call(req) {
            super::Call::Put(p) => Some(p),
            _ => None,
        }
    }

    pub fn kind(&self) -> Kind {
        match self {
            Put::Single(k, _) | Put::Batch(k, _) => *k,
        }
    }

    pub fn is_batch(&self) -> bool {
        matches!(self, Put::Batch(..))
    }

    pub fn client_id(&self) -> Uuid {
        match self {
            Put::Single(_, a) => a.client_id,
            Put::Batch(_, a) => a.client_id,
        }
    }

    pub fn keys(&self) -> &'a [Bytes] {
        match self {
            Put::Single(_, a) => std::slice::from_ref(&a.key),
            Put::Batch(_, a) => &a.keys,
        }
    }

    /// Value size of each key (what the client will write: never changed).
    pub fn sizes(&self) -> &'a [u64] {
        match self {
            Put::Single(_, a) => std::slice::from_ref(&a.slice_length),
            Put::Batch(_, a) => &a.slice_lengths,
        }
    }

    pub fn config(&self) -> &'a ReplicateConfig {
        match self {
            Put::Single(_, a) => &a.config,
            Put::Batch(_, a) => &a.config,
        }
    }

    pub fn tenant(&self) -> &'a Bytes {
        match self {
            Put::Single(_, a) => &a.tenant_id,
            Put::Batch(_, a) => &a.tenant_id,
        }
    }

    /// Bytes this start holds in flight until it is answered (saturating: sizes come
    /// from the client).
    pub fn bytes(&self) -> u64 {
        self.sizes().iter().fold(0u64, |a, &s| a.saturating_add(s))
    }

    /// The same call with `config` (when given) and, for a batch, only the keys `keep`
    /// says, in order. A single put always keeps its key (refuse it with [`Put::refused`]).
    pub fn rewritten(
        &self,
        config: Option<ReplicateConfig>,
        keep: impl Fn(usize) -> bool,
    ) -> Request {
        match *self {
            Put::Single(kind, a) => {
                let mut a = a.clone();
                if let Some(c) = config {
                    a.config = c;
                }
                match kind {
                    Kind::Put => Request::PutStart(a),
                    Kind::Upsert => Request::UpsertStart(a),
                }
            }
            Put::Batch(kind, a) => {
                let (keys, sizes): (Vec<Bytes>, Vec<u64>) = a
                    .keys
                    .iter()
                    .zip(&a.slice_lengths)
                    .enumerate()
                    .filter(|(i, _)| keep(*i))
                    .map(|(_, (k, s))| (k.clone(), *s))
                    .unzip();
                let a = BatchPutStartArgs {
                    client_id: a.client_id,
                    keys,
                    slice_lengths: sizes,
                    config: config.unwrap_or_else(|| a.config.clone()),
                    tenant_id: a.tenant_id.clone(),
                };
                batch(kind, a)
            }
        }
    }

    /// The reply the master gives when it refuses every key: `codes` per key.
    pub fn refused(&self, codes: &[ErrorCode]) -> Response {
        match *self {
            Put::Single(kind, _) => {
                let r = Err(codes
                    .first()
                    .copied()
                    .unwrap_or(ErrorCode::NO_AVAILABLE_HANDLE));
                match kind {
                    Kind::Put => Response::PutStart(r),
                    Kind::Upsert => Response::UpsertStart(r),
                }
            }
            Put::Batch(kind, _) => {
                let v = codes.iter().map(|c| Err(*c)).collect();
                match kind {
                    Kind::Put => Response::BatchPutStart(v),
                    Kind::Upsert => Response::BatchUpsertStart(v),
                }
            }
        }
    }

    pub(super) fn split(&self, parts: &[Range<usize>]) -> Option<Vec<Request>> {
        let Put::Batch(kind, a) = *self else {
            return None;
        };
        if a.slice_lengths.len() != a.keys.len() {
            return None;
        }
        Some(
            parts
                .iter()
                .map(|r| {
                    batch(
                        kind,
                        BatchPutStartArgs {
                            client_id: a.client_id,
                            keys: a.keys[r.clone()].to_vec(),
                            slice_lengths: a.slice_lengths[r.clone()].to_vec(),
                            config: a.config.clone(),
                            tenant_id: a.tenant_id.clone(),
                        },
                    )
                })
                .collect(),
        )
    }

    pub(super) fn tracked(&self) -> Track {
        Track::Put(
            self.keys()
                .iter()
                .cloned()
                .zip(self.sizes().iter().copied())
                .collect(),
        )
    }
}

fn batch(kind: Kind, a: BatchPutStartArgs) -> Request {
    match kind {
        Kind::Put => Request::BatchPutStart(a),
        Kind::Upsert => Request::BatchUpsertStart(a),
    }
}

pub(super) fn splittable(m: Method) -> bool {
    matches!(m, Method::BatchPutStart | Method::BatchUpsertStart)
}

/// The per-key answers of a put-family start.
pub fn results(resp: &Response) -> Option<&[Expected<Vec<ReplicaDescriptor>>]> {
    match resp {
        Response::PutStart(r) | Response::UpsertStart(r) => Some(std::slice::from_ref(r)),
        Response::BatchPutStart(v) | Response::BatchUpsertStart(v) => Some(v),
        _ => None,
    }
}

/// Merges the answers of the keys a policy let through (`admitted`, in order) with the
/// errors of the ones it denied (`denied`: position in the client's batch and error,
/// rising), so the client sees one result per key in its own order. Answers of other
/// shapes, or of the wrong length, are returned unchanged.
pub fn merge_denied(resp: Response, total: usize, denied: &[(usize, ErrorCode)]) -> Response {
    fn merge<T>(
        admitted: Vec<Expected<T>>,
        total: usize,
        denied: &[(usize, ErrorCode)],
    ) -> Vec<Expected<T>> {
        if admitted.len() + denied.len() != total {
            return admitted;
        }
        let mut out = Vec::with_capacity(total);
        let mut rest = admitted.into_iter();
        let mut denied = denied.iter().peekable();
        for i in 0..total {
            match denied.peek() {
                Some((pos, code)) if *pos == i => {
                    out.push(Err(*code));
                    denied.next();
                }
                _ => {
                    if let Some(r) = rest.next() {
                        out.push(r);
                    }
                }
            }
        }
        out
    }
    match resp {
        Response::BatchPutStart(v) => Response::BatchPutStart(merge(v, total, denied)),
        Response::BatchUpsertStart(v) => Response::BatchUpsertStart(merge(v, total, denied)),
        other => other,
    }
}

pub(super) fn append(whole: &mut Response, part: Response) -> Result<(), Response> {
    match (whole, part) {
        (Response::BatchPutStart(v), Response::BatchPutStart(p))
        | (Response::BatchUpsertStart(v), Response::BatchUpsertStart(p)) => {
            v.extend(p);
            Ok(())
        }
        (_, p) => Err(p),
    }
}

/// Accepted starts are stored (size, tier of the first replica); starts the master
/// refused for lack of room count as denied bytes.
pub(super) fn seen(keys: &[(Bytes, u64)], resp: &Response) -> Vec<Seen> {
    let Some(answers) = results(resp).filter(|a| a.len() == keys.len()) else {
        return Vec::new();
    };
    let mut stored = Vec::with_capacity(keys.len());
    let mut placed = Vec::new();
    let mut denied = 0u64;
    for ((key, size), a) in keys.iter().zip(answers) {
        match a {
            Ok(reps) => {
                stored.push((
                    key.clone(),
                    *size,
                    reps.first().map_or(Tier::Memory, |r| r.location.tier()),
                ));
                if let Some(ReplicaLocation::Memory(m)) = reps.first().map(|r| &r.location) {
                    placed.push((key.clone(), m.buffer_descriptor.transport_endpoint.clone()));
                }
            }
            Err(ErrorCode::NO_AVAILABLE_HANDLE) => denied = denied.saturating_add(*size),
            Err(_) => {}
        }
    }
    let mut out = Vec::with_capacity(2);
    if !stored.is_empty() {
        out.push(Seen::Stored(stored));
    }
    if denied > 0 {
        out.push(Seen::Denied(denied));
    }
    if !placed.is_empty() {
        out.push(Seen::Placed(placed));
    }
    out
}

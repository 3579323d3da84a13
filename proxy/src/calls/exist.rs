//! The exist family: `ExistKey` and `BatchExistKey`. Keys, how a batch is cut and
//! merged, hits and misses (lookup metrics), and what the answers tell the eviction
//! table.

use std::ops::Range;

use super::{Seen, Tally};
use crate::codec::Method;
use crate::codec::keys::Keys;
use crate::codec::message::{Request, Response};
use crate::codec::types::{ErrorCode, Expected, GetReplicaListResponse};

/// A decoded existence check: one key or a batch.
pub type Exist<'a> = super::Keyed<'a>;

/// Cuts a batch into parts of the same method.
pub(super) fn split(c: &Exist<'_>, parts: &[Range<usize>]) -> Option<Vec<Request>> {
    c.split(parts, Request::BatchExistKey)
}

pub(super) fn splittable(m: Method) -> bool {
    m == Method::BatchExistKey
}

/// The replica lookup that answers an existence check the way a steering plugin can
/// act on: `ExistKey` -> `GetReplicaList`, `BatchExistKey` -> `BatchGetReplicaList`,
/// same keys and tenant. Their arguments have the same layout in every release, and
/// both grant the same read lease on a found key. `None` for other requests.
pub fn as_lookup(req: &Request) -> Option<Request> {
    match req {
        Request::ExistKey(a) => Some(Request::GetReplicaList(a.clone())),
        Request::BatchExistKey(a) => Some(Request::BatchGetReplicaList(a.clone())),
        _ => None,
    }
}

/// The existence answer a (steered) lookup answer stands for: a key with a replica
/// left to read exists; one not found, not ready, or left with none (a plugin dropped
/// them all) does not; any other error stays that error. Other answers come back as
/// `Err`.
pub fn from_lookup(resp: Response) -> Result<Response, Response> {
    fn one(r: Expected<GetReplicaListResponse>) -> Expected<bool> {
        match r {
            Ok(list) => Ok(!list.replicas.is_empty()),
            Err(ErrorCode::OBJECT_NOT_FOUND | ErrorCode::REPLICA_IS_NOT_READY) => Ok(false),
            Err(e) => Err(e),
        }
    }
    match resp {
        Response::GetReplicaList(r) => Ok(Response::ExistKey(one(r))),
        Response::BatchGetReplicaList(v) => {
            Ok(Response::BatchExistKey(v.into_iter().map(one).collect()))
        }
        other => Err(other),
    }
}

fn results(resp: &Response) -> Option<&[Expected<bool>]> {
    match resp {
        Response::ExistKey(r) => Some(std::slice::from_ref(r)),
        Response::BatchExistKey(v) => Some(v),
        _ => None,
    }
}

pub(super) fn append(whole: &mut Response, part: Response) -> Result<(), Response> {
    match (whole, part) {
        (Response::BatchExistKey(v), Response::BatchExistKey(p)) => {
            v.extend(p);
            Ok(())
        }
        (_, p) => Err(p),
    }
}

/// `hit` for true, `miss` for false; errors are neither.
pub(super) fn tally(resp: &Response, t: &mut Tally) {
    for r in results(resp).unwrap_or(&[]) {
        match r {
            Ok(true) => t.hits += 1,
            Ok(false) => t.misses += 1,
            Err(_) => {}
        }
    }
}

/// Found keys (no tier: an existence check names none), and keys the master no longer
/// has.
pub(super) fn seen(keys: &Keys, resp: &Response) -> Vec<Seen> {
    let Some(answers) = results(resp).filter(|a| a.len() == keys.len()) else {
        return Vec::new();
    };
    let found = keys
        .iter_bytes()
        .zip(answers)
        .filter(|(_, a)| matches!(a, Ok(true)))
        .map(|(k, _)| (k, None))
        .collect();
    let gone = keys
        .iter_bytes()
        .zip(answers)
        .filter(|(_, a)| matches!(a, Ok(false) | Err(ErrorCode::OBJECT_NOT_FOUND)))
        .map(|(k, _)| k)
        .collect();
    vec![Seen::Found(found), Seen::Missed(gone)]
}

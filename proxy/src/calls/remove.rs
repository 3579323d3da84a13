//! The remove family: `Remove` and `RemoveAll`.

use bytes::Bytes;

use super::{Seen, Track};
use crate::codec::message::{RemoveAllArgs, RemoveArgs, Response};
use crate::codec::types::ErrorCode;

#[derive(Debug, Clone, Copy)]
pub enum Remove<'a> {
    One(&'a RemoveArgs),
    All(&'a RemoveAllArgs),
}

impl<'a> Remove<'a> {
    pub fn key(&self) -> Option<&'a Bytes> {
        match self {
            Remove::One(a) => Some(&a.key),
            Remove::All(_) => None,
        }
    }

    pub(super) fn tracked(&self) -> Track {
        match self {
            Remove::One(a) => Track::Remove(a.key.clone()),
            Remove::All(_) => Track::RemoveAll,
        }
    }

    pub fn tenant(&self) -> &'a Bytes {
        match self {
            Remove::One(a) => &a.tenant_id,
            Remove::All(a) => &a.tenant_id,
        }
    }
}

/// Whether moongate reads this method's answers as removals.
pub fn is_remove(m: crate::codec::method::Method) -> bool {
    use crate::codec::method::Method;
    matches!(m, Method::Remove | Method::RemoveAll)
}

/// Whether this call can free the memory of values others were told of while they
/// are leased: a forced `Remove` or `RemoveAll` (an unforced one fails on a leased
/// value), and every `BatchRemove` and `RemoveByRegex` (relayed whole, their flag not
/// read). A body that does not decode counts as forced.
pub fn voids_places(m: crate::codec::method::Method, body: &Bytes) -> bool {
    use crate::codec::message::Request;
    use crate::codec::method::Method;
    match m {
        Method::Remove | Method::RemoveAll => match Request::decode(m, body) {
            Some(Ok((Request::Remove(a), _))) => a.force,
            Some(Ok((Request::RemoveAll(a), _))) => a.force,
            _ => true,
        },
        Method::BatchRemove | Method::RemoveByRegex => true,
        _ => false,
    }
}

/// Whether this call removes keys at all (unforced ones too) or replaces a value (an
/// upsert): the own segment's known keys end with it.
pub fn removes(m: crate::codec::method::Method) -> bool {
    use crate::codec::method::Method;
    matches!(
        m,
        Method::Remove
            | Method::RemoveAll
            | Method::BatchRemove
            | Method::RemoveByRegex
            | Method::UpsertStart
            | Method::BatchUpsertStart
            | Method::UpsertEnd
            | Method::BatchUpsertEnd
    )
}

/// Removed, or already gone.
pub(super) fn seen_one(key: &Bytes, resp: &Response) -> Vec<Seen> {
    match resp {
        Response::Remove(Ok(()) | Err(ErrorCode::OBJECT_NOT_FOUND)) => {
            vec![Seen::Removed(vec![key.clone()])]
        }
        _ => Vec::new(),
    }
}

/// `RemoveAll` answers the count removed; a negative count is an error.
pub(super) fn seen_all(resp: &Response) -> Vec<Seen> {
    match resp {
        Response::RemoveAll(n) if *n >= 0 => vec![Seen::Cleared],
        _ => Vec::new(),
    }
}

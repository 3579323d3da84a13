//! The end family: `PutEnd`, `UpsertEnd`, `BatchPutEnd`, `BatchUpsertEnd` (a put is
//! stored) and `PutRevoke`, `BatchPutRevoke` (a put is abandoned).

use std::ops::Range;

use bytes::Bytes;

use super::{Seen, Track};
use crate::codec::Method;
use crate::codec::message::{
    BatchPutEndArgs, BatchPutRevokeArgs, BatchUpsertEndArgs, PutEndArgs, PutRevokeArgs, Request,
    Response,
};
use crate::codec::types::Uuid;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Put,
    Upsert,
}

/// A decoded end or revoke.
#[derive(Debug, Clone, Copy)]
pub enum End<'a> {
    One(Kind, &'a PutEndArgs),
    BatchPut(&'a BatchPutEndArgs),
    /// No replica type on the wire.
    BatchUpsert(&'a BatchUpsertEndArgs),
    Revoke(&'a PutRevokeArgs),
    BatchRevoke(&'a BatchPutRevokeArgs),
}

impl<'a> End<'a> {
    pub fn client_id(&self) -> Uuid {
        match self {
            End::One(_, a) => a.client_id,
            End::BatchPut(a) => a.client_id,
            End::BatchUpsert(a) => a.client_id,
            End::Revoke(a) => a.client_id,
            End::BatchRevoke(a) => a.client_id,
        }
    }

    pub fn first_key(&self) -> Option<&'a [u8]> {
        match self {
            End::One(_, a) => Some(&a.object_meta.key),
            End::BatchPut(a) => a.object_metas.first().map(|m| &m.key[..]),
            End::BatchUpsert(a) => a.object_metas.first().map(|m| &m.key[..]),
            End::Revoke(a) => Some(&a.key),
            End::BatchRevoke(a) => a.keys.first().map(|k| &k[..]),
        }
    }

    pub fn key_count(&self) -> usize {
        match self {
            End::One(..) | End::Revoke(_) => 1,
            End::BatchPut(a) => a.object_metas.len(),
            End::BatchUpsert(a) => a.object_metas.len(),
            End::BatchRevoke(a) => a.keys.len(),
        }
    }

    fn keys(&self) -> Vec<Bytes> {
        match self {
            End::One(_, a) => vec![a.object_meta.key.clone()],
            End::BatchPut(a) => a.object_metas.iter().map(|m| m.key.clone()).collect(),
            End::BatchUpsert(a) => a.object_metas.iter().map(|m| m.key.clone()).collect(),
            End::Revoke(a) => vec![a.key.clone()],
            End::BatchRevoke(a) => a.keys.clone(),
        }
    }

    pub(super) fn split(&self, parts: &[Range<usize>]) -> Option<Vec<Request>> {
        let cut = |r: &Range<usize>| -> Option<Request> {
            Some(match self {
                End::BatchPut(a) => Request::BatchPutEnd(BatchPutEndArgs {
                    client_id: a.client_id,
                    object_metas: a.object_metas[r.clone()].to_vec(),
                    replica_type: a.replica_type,
                    tenant_id: a.tenant_id.clone(),
                }),
                End::BatchUpsert(a) => Request::BatchUpsertEnd(BatchUpsertEndArgs {
                    client_id: a.client_id,
                    object_metas: a.object_metas[r.clone()].to_vec(),
                    tenant_id: a.tenant_id.clone(),
                }),
                End::BatchRevoke(a) => Request::BatchPutRevoke(BatchPutRevokeArgs {
                    client_id: a.client_id,
                    keys: a.keys[r.clone()].to_vec(),
                    replica_type: a.replica_type,
                    tenant_id: a.tenant_id.clone(),
                }),
                End::One(..) | End::Revoke(_) => return None,
            })
        };
        parts.iter().map(cut).collect()
    }

    pub(super) fn tracked(&self) -> Track {
        match self {
            End::Revoke(_) | End::BatchRevoke(_) => Track::Revoke(self.keys()),
            _ => Track::End(self.keys()),
        }
    }

    pub fn tenant(&self) -> &'a Bytes {
        match self {
            End::One(_, a) => &a.tenant_id,
            End::BatchPut(a) => &a.tenant_id,
            End::BatchUpsert(a) => &a.tenant_id,
            End::Revoke(a) => &a.tenant_id,
            End::BatchRevoke(a) => &a.tenant_id,
        }
    }
}

pub(super) fn splittable(m: Method) -> bool {
    matches!(
        m,
        Method::BatchPutEnd | Method::BatchUpsertEnd | Method::BatchPutRevoke
    )
}

pub(super) fn append(whole: &mut Response, part: Response) -> Result<(), Response> {
    match (whole, part) {
        (Response::BatchPutEnd(v), Response::BatchPutEnd(p))
        | (Response::BatchPutRevoke(v), Response::BatchPutRevoke(p))
        | (Response::BatchUpsertEnd(v), Response::BatchUpsertEnd(p)) => {
            v.extend(p);
            Ok(())
        }
        (_, p) => Err(p),
    }
}

/// The keys whose end the master accepted are complete (removable from now on).
pub(super) fn seen_end(keys: &[Bytes], resp: &Response) -> Vec<Seen> {
    match resp {
        Response::PutEnd(Ok(())) | Response::UpsertEnd(Ok(())) => {
            vec![Seen::Completed(keys.to_vec())]
        }
        Response::BatchPutEnd(v) | Response::BatchUpsertEnd(v) => vec![Seen::Completed(
            keys.iter()
                .zip(v)
                .filter(|(_, r)| r.is_ok())
                .map(|(k, _)| k.clone())
                .collect(),
        )],
        _ => Vec::new(),
    }
}

/// A revoked put is gone, whatever the master answered.
pub(super) fn seen_revoke(keys: &[Bytes], resp: &Response) -> Vec<Seen> {
    match resp {
        Response::PutRevoke(_) | Response::BatchPutRevoke(_) => vec![Seen::Removed(keys.to_vec())],
        _ => Vec::new(),
    }
}

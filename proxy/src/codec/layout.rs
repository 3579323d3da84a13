//! A typed body in the layout of the release that sent it. The body's type code picks
//! 0.3.13's layout ([`super::message`], the one internal model) or an older release's
//! ([`super::older`], mapped to and from that model); an answer goes back in the layout
//! its request came in.
//!
//! Kept apart from both so that neither imports the other's decisions: `older` maps
//! layouts onto `message`'s types, `message` knows nothing of older releases, and this
//! module is the only one that chooses between them.
//!
//! This module knows no sockets, clocks or frames.

use bytes::{Bytes, BytesMut};

use super::error::DecodeError;
use super::message::{Request, Response, is_typed};
use super::method::Method;
use super::older;
use super::pack::{BodyStyle, Schema};

impl Request {
    /// Decodes `body` as a request of `method`, in the schema its type code names
    /// (0.3.11, 0.3.12 or 0.3.13); `None` for a method without a typed form (relay it
    /// raw).
    pub fn decode(
        method: Method,
        body: &Bytes,
    ) -> Option<Result<(Request, BodyStyle), DecodeError>> {
        match older::code_of(body).and_then(|c| older::request_schema(method, c)) {
            Some(s) if is_typed(method) => Some(older::decode_request(method, s, body)),
            _ => Request::decode_current(method, body),
        }
    }

    /// Appends the body (no header) in `style`, in the schema it names.
    pub fn encode_body(&self, style: BodyStyle, out: &mut BytesMut) {
        if style.schema != Schema::V0_3_13 && older::encode_request(self, style, out) {
            return;
        }
        self.encode_current(style, out);
    }

    /// Fields set to values `schema` cannot carry: left out when this request is
    /// encoded in it (a policy's rewrite for an older client, say).
    pub fn lost_in(&self, schema: Schema) -> Vec<&'static str> {
        older::lost_in(self, schema)
    }

    /// The tenant the call names (`None` for methods without one). A 0.3.11 call has
    /// none on the wire and decodes with an empty one.
    pub fn tenant_mut(&mut self) -> Option<&mut Bytes> {
        Some(match self {
            Request::PutStart(a) | Request::UpsertStart(a) => &mut a.tenant_id,
            Request::PutEnd(a) | Request::UpsertEnd(a) => &mut a.tenant_id,
            Request::PutRevoke(a) => &mut a.tenant_id,
            Request::BatchPutStart(a) | Request::BatchUpsertStart(a) => &mut a.tenant_id,
            Request::BatchPutEnd(a) => &mut a.tenant_id,
            Request::BatchPutRevoke(a) => &mut a.tenant_id,
            Request::BatchUpsertEnd(a) => &mut a.tenant_id,
            Request::GetReplicaList(a) | Request::ExistKey(a) => &mut a.tenant_id,
            Request::BatchGetReplicaList(a) | Request::BatchExistKey(a) => &mut a.tenant_id,
            Request::Remove(a) => &mut a.tenant_id,
            Request::RemoveAll(a) => &mut a.tenant_id,
            _ => return None,
        })
    }
}

impl Response {
    /// Whether the answer names a replica only 0.3.13 and later can describe (a DFS
    /// replica: the fifth descriptor alternative), so it cannot be written in an older
    /// client's layout without losing it.
    pub fn needs_0_3_13(&self) -> bool {
        use super::types::ReplicaLocation;
        let dfs = |v: &[super::types::ReplicaDescriptor]| {
            v.iter()
                .any(|d| matches!(d.location, ReplicaLocation::DistributedFs(_)))
        };
        match self {
            Response::PutStart(Ok(v)) | Response::UpsertStart(Ok(v)) => dfs(v),
            Response::BatchPutStart(v) | Response::BatchUpsertStart(v) => {
                v.iter().any(|e| e.as_ref().is_ok_and(|v| dfs(v)))
            }
            Response::GetReplicaList(Ok(r)) => dfs(&r.replicas),
            Response::BatchGetReplicaList(v) => {
                v.iter().any(|e| e.as_ref().is_ok_and(|r| dfs(&r.replicas)))
            }
            _ => false,
        }
    }
}

impl Response {
    /// Decodes the body of a successful response to a `method` request, in the schema
    /// its type code names.
    pub fn decode(
        method: Method,
        body: &Bytes,
    ) -> Option<Result<(Response, BodyStyle), DecodeError>> {
        match older::code_of(body).and_then(|c| older::response_schema(method, c)) {
            Some(s) if is_typed(method) => Some(older::decode_response(method, s, body)),
            _ => Response::decode_current(method, body),
        }
    }

    /// Appends the body in `style`: an answer to a request that arrived in an older
    /// schema is written in that release's answer layout.
    pub fn encode_body(&self, style: BodyStyle, out: &mut BytesMut) {
        if style.schema != Schema::V0_3_13 && older::encode_response(self, style, out) {
            return;
        }
        self.encode_current(style, out);
    }
}

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
use super::message::{ReplicaClearArgs14, Request, Response, is_typed};
use super::method::Method;
use super::older;
use super::pack::{BodyStyle, Schema, encode_message};
use super::release::MasterRelease;

/// Whether a caller must know the master's release to send a `method` call: some
/// release lays it (or its answer) out differently. Ping, ServiceReady, UnmountSegment
/// and the like have one layout in every release.
pub fn depends_on_release(method: Method) -> bool {
    older::varies(method) || method == Method::BatchReplicaClear
}

impl Request {
    /// Decodes `body` as a request of `method`, in the schema its type code names
    /// (0.3.11, 0.3.12 or 0.3.13); `None` for a method without a typed form (relay it
    /// raw).
    pub fn decode(
        method: Method,
        body: &Bytes,
    ) -> Option<Result<(Request, BodyStyle), DecodeError>> {
        let code = older::code_of(body);
        // 0.3.14's BatchReplicaClear (with a tenant) is not modelled: relayed as it came
        // (moongate only ever sends it, never changes a client's).
        if method == Method::BatchReplicaClear && code == Some(schema!(ReplicaClearArgs14).code) {
            return None;
        }
        match code.and_then(|c| older::request_schema(method, c)) {
            Some(s) if is_typed(method) => Some(older::decode_request(method, s, body)),
            _ => Request::decode_current(method, body),
        }
    }

    /// Appends the body as a master of `release` takes it: its schema's layout, and
    /// 0.3.14's own where it changed one (`BatchReplicaClear` gained a tenant; the
    /// tenant sent is `"default"`, what Mooncake's clients send).
    pub fn encode_for(&self, release: MasterRelease, out: &mut BytesMut) {
        let style = BodyStyle {
            schema: release.schema(),
            ..BodyStyle::MOONCAKE
        };
        if let (MasterRelease::V0_3_14, Request::BatchReplicaClear(a)) = (release, self) {
            let v = ReplicaClearArgs14 {
                keys: a.keys.clone(),
                client_id: a.client_id,
                segment_name: a.segment_name.clone(),
                tenant_id: Bytes::from_static(b"default"),
            };
            encode_message(&v, schema!(ReplicaClearArgs14), style, out);
            return;
        }
        self.encode_body(style, out);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::message::ReplicaClearArgs;

    /// A `BatchReplicaClear` goes to a 0.3.14 master with the tenant it takes, to the
    /// others in 0.3.13's layout; 0.3.14's form is relayed by the master face as it came,
    /// not counted as a decode error.
    #[test]
    fn batch_replica_clear_goes_in_each_release_s_layout() {
        let req = Request::BatchReplicaClear(ReplicaClearArgs {
            keys: vec![Bytes::from_static(b"a"), Bytes::from_static(b"b")],
            client_id: Default::default(),
            segment_name: Bytes::from_static(b"127.0.0.1:1234"),
        });
        let mut b13 = BytesMut::new();
        req.encode_for(MasterRelease::V0_3_13, &mut b13);
        let (back, _) = Request::decode(Method::BatchReplicaClear, &b13.freeze())
            .unwrap()
            .unwrap();
        assert_eq!(back, req);
        let mut b14 = BytesMut::new();
        req.encode_for(MasterRelease::V0_3_14, &mut b14);
        let b14 = b14.freeze();
        assert_eq!(older::code_of(&b14), Some(schema!(ReplicaClearArgs14).code));
        assert!(Request::decode(Method::BatchReplicaClear, &b14).is_none());
        assert!(depends_on_release(Method::BatchReplicaClear));
        assert!(depends_on_release(Method::PutStart));
        assert!(!depends_on_release(Method::Ping));
    }
}

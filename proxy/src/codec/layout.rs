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

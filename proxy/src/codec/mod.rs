//! The Mooncake master-RPC codec: coro_rpc framing around struct_pack bodies.
//!
//! Sans-IO: everything here takes and returns bytes. It knows no sockets, tasks or
//! clocks, so it is tested from captured frames and fuzzed (`proxy/fuzz`).
//!
//! - [`frame`]: headers, `check` then `split`.
//! - [`pack`]: struct_pack messages and the [`pack::Pack`] trait.
//! - [`types`], [`message`]: typed requests and responses of the methods moongate acts on
//!   (the 0.3.13 layout: the one internal model); [`older`]: the 0.3.11 / 0.3.12 layouts
//!   of the same methods, mapped to and from that model; [`layout`]: which of them a
//!   body is in, by its type code (the one place that chooses).
//! - [`method`]: the 64 registered methods and their function ids.
//! - [`generic`]: literal-driven decoding of any body.
//! - [`keys`]: a batch's keys, kept in the bytes they arrived in.
//! - [`release`]: which release a master is, from its answer to one probe call.

/// One static schema per concrete root type, built on first use (for the codec's
/// modules; declared before them so each sees it).
macro_rules! schema {
    ($t:ty) => {{
        static S: std::sync::OnceLock<$crate::codec::pack::RootSchema> = std::sync::OnceLock::new();
        S.get_or_init($crate::codec::pack::RootSchema::of::<$t>)
    }};
}

pub mod error;
pub mod frame;
pub mod generic;
pub mod keys;
pub mod layout;
pub mod message;
pub mod method;
pub mod older;
pub mod pack;
pub mod release;
pub mod types;

pub use error::{DecodeError, FrameError};
pub use frame::{RequestFrame, RequestHeader, ResponseFrame, ResponseHeader};
pub use message::{Request, Response, RpcError};
pub use method::Method;
pub use pack::{BodyStyle, Schema};

/// Decodes `data` as a stream of request frames and every body in it, typed where the
/// method has a typed form and generically otherwise, then re-encodes each and checks the
/// bytes. Never panics on any input; used by the fuzz target and by tests.
pub fn fuzz_one(data: &[u8]) {
    use bytes::BytesMut;
    let mut buf = BytesMut::from(data);
    while let Ok(Some(h)) = frame::check_request(&buf, 1 << 20) {
        let (f, _) = RequestFrame::split(&mut buf, h);
        if let Some(m) = Method::from_function_id(h.function_id)
            && let Some(Ok((req, style))) = Request::decode(m, &f.body)
        {
            let mut out = BytesMut::new();
            req.encode_body(style, &mut out);
            let again = Request::decode(m, &out.freeze());
            assert!(matches!(again, Some(Ok((ref r, _))) if *r == req));
        }
        if let Ok(g) = generic::GenericMessage::decode(&f.body) {
            let mut out = BytesMut::new();
            g.encode(&mut out);
            let back = generic::GenericMessage::decode(&out.freeze());
            assert!(matches!(back, Ok(ref b) if b.value == g.value));
        }
    }
    // The same bytes as a response body of every typed method.
    let body = bytes::Bytes::copy_from_slice(data);
    for &m in Method::ALL {
        if let Some(Ok((resp, style))) = Response::decode(m, &body) {
            let mut out = BytesMut::new();
            resp.encode_body(style, &mut out);
            let again = Response::decode(m, &out.freeze());
            assert!(matches!(again, Some(Ok((ref r, _))) if *r == resp));
        }
    }
}

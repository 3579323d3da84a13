//! Typed requests and responses of the methods moongate understands.
//!
//! A closed set: the methods that carry policy decisions, liveness and the client's
//! lifecycle. Every other method is relayed as raw bytes ([`Request::decode`] returns
//! `None` for it). Each method's argument root is its single argument, or a tuple of
//! all arguments in C++ declaration order (spec §4.1); the tuples are the `*Args`
//! structs below, which encode exactly like a `std::tuple`.

use bytes::{Bytes, BytesMut};

use super::error::DecodeError;
use super::frame::errc;
use super::keys::Keys;
use super::method::Method;
use super::pack::{
    BodyStyle, Pack, Reader, RootSchema, Writer, decode_message, decode_message_with,
    encode_message,
};
use super::types::*;
use crate::pack_struct;

/// The argument root of a method without arguments: no body at all on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NoArgs;

impl Pack for NoArgs {
    fn write_literal(_out: &mut Vec<u8>) {}
    fn encode(&self, _w: &mut Writer<'_>) {}
    fn decode(_r: &mut Reader) -> Result<Self, DecodeError> {
        Ok(NoArgs)
    }
}

pack_struct! {
    /// `MountSegment(segment, client_id)`.
    pub struct MountSegmentArgs { pub segment: Segment, pub client_id: Uuid }
}
pack_struct! {
    /// `ReMountSegment(segments, client_id)`.
    pub struct ReMountSegmentArgs { pub segments: Vec<Segment>, pub client_id: Uuid }
}
pack_struct! {
    /// `UnmountSegment(segment_id, client_id)`.
    pub struct UnmountSegmentArgs { pub segment_id: Uuid, pub client_id: Uuid }
}
pack_struct! {
    /// `FetchTasks(client_id, batch_size)`.
    pub struct FetchTasksArgs { pub client_id: Uuid, pub batch_size: u64 }
}
pack_struct! {
    /// `PutStart` / `UpsertStart(client_id, key, slice_length, config, tenant_id)`.
    pub struct PutStartArgs {
        pub client_id: Uuid,
        pub key: Bytes,
        /// Must never be changed: the client writes exactly this many bytes.
        pub slice_length: u64,
        pub config: ReplicateConfig,
        pub tenant_id: Bytes,
    }
}
pack_struct! {
    /// `PutEnd` / `UpsertEnd(client_id, object_meta, replica_type, tenant_id)`.
    pub struct PutEndArgs {
        pub client_id: Uuid,
        pub object_meta: ObjectMeta,
        pub replica_type: ReplicaType,
        pub tenant_id: Bytes,
    }
}
pack_struct! {
    /// `PutRevoke(client_id, key, replica_type, tenant_id)`.
    pub struct PutRevokeArgs {
        pub client_id: Uuid,
        pub key: Bytes,
        pub replica_type: ReplicaType,
        pub tenant_id: Bytes,
    }
}
pack_struct! {
    /// `BatchPutStart` / `BatchUpsertStart(client_id, keys, slice_lengths, config, tenant_id)`.
    pub struct BatchPutStartArgs {
        pub client_id: Uuid,
        pub keys: Vec<Bytes>,
        pub slice_lengths: Vec<u64>,
        pub config: ReplicateConfig,
        pub tenant_id: Bytes,
    }
}
pack_struct! {
    /// `BatchPutEnd(client_id, object_metas, replica_type, tenant_id)`.
    pub struct BatchPutEndArgs {
        pub client_id: Uuid,
        pub object_metas: Vec<ObjectMeta>,
        pub replica_type: ReplicaType,
        pub tenant_id: Bytes,
    }
}
pack_struct! {
    /// `BatchUpsertEnd(client_id, object_metas, tenant_id)`: no replica type.
    pub struct BatchUpsertEndArgs {
        pub client_id: Uuid,
        pub object_metas: Vec<ObjectMeta>,
        pub tenant_id: Bytes,
    }
}
pack_struct! {
    /// `BatchPutRevoke(client_id, keys, replica_type, tenant_id)`.
    pub struct BatchPutRevokeArgs {
        pub client_id: Uuid,
        pub keys: Vec<Bytes>,
        pub replica_type: ReplicaType,
        pub tenant_id: Bytes,
    }
}
pack_struct! {
    /// `ExistKey` / `GetReplicaList(key, tenant_id)`.
    pub struct KeyArgs { pub key: Bytes, pub tenant_id: Bytes }
}
pack_struct! {
    /// `BatchExistKey` / `BatchGetReplicaList(keys, tenant_id)`.
    pub struct KeysArgs { pub keys: Keys, pub tenant_id: Bytes }
}
pack_struct! {
    /// `Remove(key, force, tenant_id)`.
    pub struct RemoveArgs { pub key: Bytes, pub force: bool, pub tenant_id: Bytes }
}
pack_struct! {
    /// `BatchReplicaClear(object_keys, client_id, segment_name)`: drops the replicas of
    /// keys `client_id` put that live on `segment_name` (all of them when it is empty);
    /// a key left with no replica is removed. Keys under a read lease are skipped. The
    /// answer lists the keys cleared. moongate's evictor sends it to free memory while
    /// an SSD copy stays.
    pub struct ReplicaClearArgs { pub keys: Vec<Bytes>, pub client_id: Uuid, pub segment_name: Bytes }
}
pack_struct! {
    /// 0.3.14's `BatchReplicaClear(object_keys, client_id, segment_name, tenant_id)`: a
    /// 0.3.14 master refuses the 0.3.13 layout (found by trial against its master:
    /// `(vector<string>, UUID, string, string)` is accepted, the three-argument tuple is
    /// `invalid_rpc_arguments`).
    pub struct ReplicaClearArgs14 { pub keys: Vec<Bytes>, pub client_id: Uuid, pub segment_name: Bytes, pub tenant_id: Bytes }
}
pack_struct! {
    /// `RemoveAll(force, tenant_id)`.
    pub struct RemoveAllArgs { pub force: bool, pub tenant_id: Bytes }
}

macro_rules! typed_methods {
    ($( $m:ident ( $req:ty ) -> $resp:ty ; )*) => {
        /// A decoded request of a method moongate understands.
        #[derive(Debug, Clone, PartialEq, Eq)]
        pub enum Request { $( $m($req), )* }

        /// The decoded body of a successful (`err_code == 0`) response.
        #[derive(Debug, Clone, PartialEq, Eq)]
        pub enum Response { $( $m($resp), )* }

        impl Request {
            pub fn method(&self) -> Method {
                match self { $( Request::$m(_) => Method::$m, )* }
            }

            /// Decodes `body` as a request of `method` in 0.3.13's layout; `None` for a
            /// method without a typed form. [`Request::decode`] picks the layout.
            pub(super) fn decode_current(method: Method, body: &Bytes)
                -> Option<Result<(Request, BodyStyle), DecodeError>> {
                match method {
                    $( Method::$m => Some(decode_root::<$req>(body, schema!($req))
                        .map(|(v, s)| (Request::$m(v), s))), )*
                    _ => None,
                }
            }

            /// Appends the body (no header) in 0.3.13's layout, with `style`'s width
            /// and literal. [`Request::encode_body`] picks the layout.
            pub(super) fn encode_current(&self, style: BodyStyle, out: &mut BytesMut) {
                match self { $( Request::$m(v) => encode_root(v, schema!($req), style, out), )* }
            }
        }

        impl Response {
            pub fn method(&self) -> Method {
                match self { $( Response::$m(_) => Method::$m, )* }
            }

            /// Decodes the body of a successful response to a `method` request in
            /// 0.3.13's layout. [`Response::decode`] picks the layout.
            pub(super) fn decode_current(method: Method, body: &Bytes)
                -> Option<Result<(Response, BodyStyle), DecodeError>> {
                match method {
                    $( Method::$m => Some(decode_message::<$resp>(body, schema!($resp))
                        .map(|(v, s)| (Response::$m(v), s))), )*
                    _ => None,
                }
            }

            /// Appends the body in 0.3.13's layout. [`Response::encode_body`] picks
            /// the layout.
            pub(super) fn encode_current(&self, style: BodyStyle, out: &mut BytesMut) {
                match self { $( Response::$m(v) => encode_message(v, schema!($resp), style, out), )* }
            }

            /// The reply the master gives when it refuses a request of `method` with
            /// `code` as a whole (for batch methods: `code` for every one of `keys` keys).
            /// `None` for methods whose reply cannot carry an `ErrorCode`.
            pub fn error(method: Method, code: ErrorCode, keys: usize) -> Option<Response> {
                match method {
                    $( Method::$m => <$resp as ErrorReply>::error(code, keys).map(Response::$m), )*
                    _ => None,
                }
            }
        }

        /// Whether a method has a typed form here.
        pub fn is_typed(method: Method) -> bool {
            matches!(method, $( Method::$m )|*)
        }
    };
}

typed_methods! {
    ServiceReady(NoArgs) -> Expected<Bytes>;
    GetStorageConfig(NoArgs) -> Expected<GetStorageConfigResponse>;
    MountSegment(MountSegmentArgs) -> Expected<()>;
    ReMountSegment(ReMountSegmentArgs) -> Expected<()>;
    UnmountSegment(UnmountSegmentArgs) -> Expected<()>;
    Ping(Uuid) -> Expected<PingResponse>;
    FetchTasks(FetchTasksArgs) -> Expected<Vec<TaskAssignment>>;
    PutStart(PutStartArgs) -> Expected<Vec<ReplicaDescriptor>>;
    PutEnd(PutEndArgs) -> Expected<()>;
    PutRevoke(PutRevokeArgs) -> Expected<()>;
    BatchPutStart(BatchPutStartArgs) -> Vec<Expected<Vec<ReplicaDescriptor>>>;
    BatchPutEnd(BatchPutEndArgs) -> Vec<Expected<()>>;
    BatchPutRevoke(BatchPutRevokeArgs) -> Vec<Expected<()>>;
    UpsertStart(PutStartArgs) -> Expected<Vec<ReplicaDescriptor>>;
    UpsertEnd(PutEndArgs) -> Expected<()>;
    BatchUpsertStart(BatchPutStartArgs) -> Vec<Expected<Vec<ReplicaDescriptor>>>;
    BatchUpsertEnd(BatchUpsertEndArgs) -> Vec<Expected<()>>;
    GetReplicaList(KeyArgs) -> Expected<GetReplicaListResponse>;
    BatchGetReplicaList(KeysArgs) -> Vec<Expected<GetReplicaListResponse>>;
    ExistKey(KeyArgs) -> Expected<bool>;
    BatchExistKey(KeysArgs) -> Vec<Expected<bool>>;
    Remove(RemoveArgs) -> Expected<()>;
    RemoveAll(RemoveAllArgs) -> i64;
    BatchReplicaClear(ReplicaClearArgs) -> Expected<Vec<Bytes>>;
}

/// Zero-argument requests carry no body (not even an empty message); a body sent anyway
/// is ignored, as the master does.
fn decode_root<T: Pack>(body: &Bytes, schema: &RootSchema) -> Result<(T, BodyStyle), DecodeError> {
    if schema.literal.is_empty() {
        let mut r = Reader::new(Bytes::new(), 0, super::pack::SizeWidth::W1);
        return Ok((T::decode(&mut r)?, BodyStyle::MOONCAKE));
    }
    decode_message(body, schema)
}

fn encode_root<T: Pack>(v: &T, schema: &RootSchema, style: BodyStyle, out: &mut BytesMut) {
    if !schema.literal.is_empty() {
        encode_message(v, schema, style, out);
    }
}

/// Replies that can say "refused with this ErrorCode".
trait ErrorReply: Sized {
    fn error(code: ErrorCode, keys: usize) -> Option<Self>;
}

impl<T> ErrorReply for Expected<T> {
    fn error(code: ErrorCode, _keys: usize) -> Option<Self> {
        Some(Err(code))
    }
}

impl<T> ErrorReply for Vec<Expected<T>> {
    fn error(code: ErrorCode, keys: usize) -> Option<Self> {
        Some((0..keys).map(|_| Err(code)).collect())
    }
}

impl ErrorReply for i64 {
    fn error(_code: ErrorCode, _keys: usize) -> Option<Self> {
        None
    }
}

/// A transport-level error reply (`err_code` 1..=254: a string body; 255: a
/// `(u16 code, string)` pair). The Mooncake client maps any of them to `RPC_FAIL`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RpcError {
    pub code: u16,
    pub message: Bytes,
}

pack_struct! {
    /// Body of an `err_code == 255` reply.
    pub struct ExtendedRpcError { pub code: u16, pub message: Bytes }
}

impl RpcError {
    pub fn decode(err_code: u8, body: &Bytes) -> Result<(RpcError, BodyStyle), DecodeError> {
        if err_code == errc::EXTENDED {
            let (e, s) = decode_message::<ExtendedRpcError>(body, schema!(ExtendedRpcError))?;
            Ok((
                RpcError {
                    code: e.code,
                    message: e.message,
                },
                s,
            ))
        } else {
            let (m, s) = decode_message::<Bytes>(body, schema!(Bytes))?;
            Ok((
                RpcError {
                    code: u16::from(err_code),
                    message: m,
                },
                s,
            ))
        }
    }

    /// A whole reply frame answering `seq` with `RPC_THROW_EXCEPTION` and `msg`: the
    /// client reports it as a failed call (`RPC_FAIL`), for that call only.
    pub fn reply(seq: u32, msg: &str) -> Bytes {
        let e = RpcError {
            code: u16::from(errc::RPC_THROW_EXCEPTION),
            message: Bytes::copy_from_slice(msg.as_bytes()),
        };
        let mut body = BytesMut::new();
        e.encode_body(BodyStyle::MOONCAKE, &mut body);
        let mut out = BytesMut::with_capacity(16 + body.len());
        crate::codec::frame::ResponseFrame {
            header: crate::codec::frame::ResponseHeader::new(seq, errc::RPC_THROW_EXCEPTION, 0),
            body: body.freeze(),
            attachment: Bytes::new(),
        }
        .write(&mut out);
        out.freeze()
    }

    /// The header `err_code` byte for this error.
    pub fn err_code(&self) -> u8 {
        u8::try_from(self.code)
            .ok()
            .filter(|&c| c != errc::OK && c != errc::EXTENDED)
            .unwrap_or(errc::EXTENDED)
    }

    pub fn encode_body(&self, style: BodyStyle, out: &mut BytesMut) {
        if self.err_code() == errc::EXTENDED {
            let e = ExtendedRpcError {
                code: self.code,
                message: self.message.clone(),
            };
            encode_message(&e, schema!(ExtendedRpcError), style, out);
        } else {
            encode_message(&self.message, schema!(Bytes), style, out);
        }
    }
}

/// The payload of a `Vec<Expected<bool>>` counted in one pass over its bytes: per
/// element a has-value flag, then a bool (`01 00` / `01 01`) or an i32 `ErrorCode`
/// (`00` + 4 bytes). A decode of the same bytes through `Expected::<bool>::decode` cost
/// ~60 instructions a key (measured: 3,745 for 64 keys), the walk ~21 (1,359), the
/// all-answered test ~5. Bytes the decoder would refuse (a flag other than 0 or 1, a
/// short element) are refused here too.
fn count_exists(r: &mut Reader) -> Result<ExistCounts, DecodeError> {
    let n = r.read_len()?;
    let rest = r.rest();
    // The usual answer: every key answered found or absent, two bytes each.
    if let Some(plain) = n.checked_mul(2).and_then(|len| rest.get(..len))
        && let Some(found) = count_plain(plain)
    {
        let len = plain.len();
        r.take(len)?;
        let found = found as u64;
        return Ok(ExistCounts {
            found,
            absent: n as u64 - found,
            ..ExistCounts::default()
        });
    }
    count_elements(r, n)
}

/// `n` `Expected<bool>` elements walked one by one.
fn count_elements(r: &mut Reader, n: usize) -> Result<ExistCounts, DecodeError> {
    let at = r.position();
    let rest = r.rest();
    let bad = |i: usize, value: u8| DecodeError::BadFlag { at: at + i, value };
    let short = |i: usize, need: usize| DecodeError::Truncated {
        at: at + i,
        need,
        have: rest.len().saturating_sub(i),
    };
    let mut c = ExistCounts::default();
    let mut i = 0;
    for _ in 0..n {
        match rest.get(i).copied() {
            Some(1) => {
                match rest.get(i + 1).copied() {
                    Some(1) => c.found += 1,
                    Some(0) => c.absent += 1,
                    Some(v) => return Err(bad(i + 1, v)),
                    None => return Err(short(i, 2)),
                }
                i += 2;
            }
            Some(0) => {
                let Some(code) = rest
                    .get(i + 1..i + 5)
                    .and_then(|b| <[u8; 4]>::try_from(b).ok())
                else {
                    return Err(short(i, 5));
                };
                c.errors += 1;
                c.first_error
                    .get_or_insert(ErrorCode(i32::from_le_bytes(code)));
                i += 5;
            }
            Some(v) => return Err(bad(i, v)),
            None => return Err(short(i, 1)),
        }
    }
    r.take(i)?;
    Ok(c)
}

/// The keys found among `pairs`, when every pair is a present bool (`01 00` or
/// `01 01`); `None` otherwise (the caller walks the elements one by one). Four pairs
/// at a time in a `u64`, without branches: ~5 instructions a key against ~21 for the
/// walk and ~13 for the same test a pair at a time (the 64-key call measured 457
/// instructions cheaper than a pair at a time).
#[inline]
fn count_plain(pairs: &[u8]) -> Option<usize> {
    // `01 0x` with x in {0, 1}: each 16-bit lane is 0x0x01 little-endian.
    const FLAGS: u64 = 0x0001_0001_0001_0001;
    const KEEP: u64 = 0xfeff_feff_feff_feff;
    let mut off = 0u64;
    let mut found = 0u64;
    let mut quads = pairs.chunks_exact(8);
    for q in &mut quads {
        let mut w = [0u8; 8];
        w.copy_from_slice(q);
        let v = u64::from_le_bytes(w);
        off |= (v & KEEP) ^ FLAGS;
        // The four bools, one per lane, summed into the top lane by the multiply.
        found += ((v >> 8) & FLAGS).wrapping_mul(FLAGS) >> 48;
    }
    let mut tail = 0u16;
    for p in quads.remainder().chunks_exact(2) {
        tail |= (u16::from_le_bytes([p[0], p[1]]) & 0xfeff) ^ 0x0001;
        found += u64::from(p[1]);
    }
    (off == 0 && tail == 0).then_some(found as usize)
}

/// What an `ExistKey` or `BatchExistKey` answer says, counted from its bytes without
/// building its results: for a proxy that relays the answer as received and only
/// counts it (a 64-key answer decoded into a `Vec` cost about as much as the rest of
/// the call).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ExistCounts {
    /// Keys that exist, keys that do not, keys answered with an error.
    pub found: u64,
    pub absent: u64,
    pub errors: u64,
    /// The first key's error, in answer order.
    pub first_error: Option<ErrorCode>,
}

impl ExistCounts {
    /// Counts a `BatchExistKey` answer body in 0.3.13's layout, with the checks
    /// [`Response::decode`] makes (type code, literal, every byte read); an error
    /// where it would fail.
    pub fn of_batch(body: &Bytes) -> Result<ExistCounts, DecodeError> {
        decode_message_with(body, schema!(Vec<Expected<bool>>), count_exists).map(|(c, _)| c)
    }

    /// Counts an `ExistKey` answer body (one `Expected<bool>`) the same way.
    pub fn of_single(body: &Bytes) -> Result<ExistCounts, DecodeError> {
        decode_message_with(body, schema!(Expected<bool>), |r| count_elements(r, 1)).map(|(c, _)| c)
    }

    /// Keys answered.
    pub fn keys(&self) -> u64 {
        self.found + self.absent + self.errors
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argument_type_codes_match_the_method_table() {
        let cases: [(Method, u32); 9] = [
            (Method::BatchReplicaClear, 0x472b_2fa2),
            (Method::PutStart, 0xe385_bd0e),
            (Method::BatchPutStart, 0x5870_c0a4),
            (Method::BatchExistKey, 0x00f7_8d62),
            (Method::ExistKey, 0x7cf9_1ed8),
            (Method::Ping, 0x3c6d_83e0),
            (Method::MountSegment, 0x9ef7_0dae),
            (Method::BatchUpsertEnd, 0xdce9_3710),
            (Method::RemoveAll, 0x48a6_c274),
        ];
        for (m, code) in cases {
            let req = sample_request(m);
            let mut out = BytesMut::new();
            req.encode_body(BodyStyle::MOONCAKE, &mut out);
            let head = u32::from_le_bytes([out[0], out[1], out[2], out[3]]);
            assert_eq!(head & !1, code, "{m}");
        }
    }

    fn sample_request(m: Method) -> Request {
        let id = Uuid {
            first: 1,
            second: 2,
        };
        let t = Bytes::from_static(b"default");
        match m {
            Method::PutStart => Request::PutStart(PutStartArgs {
                client_id: id,
                key: Bytes::from_static(b"k"),
                slice_length: 3,
                config: ReplicateConfig::default(),
                tenant_id: t,
            }),
            Method::BatchPutStart => Request::BatchPutStart(BatchPutStartArgs {
                client_id: id,
                keys: vec![],
                slice_lengths: vec![],
                config: ReplicateConfig::default(),
                tenant_id: t,
            }),
            Method::BatchExistKey => Request::BatchExistKey(KeysArgs {
                keys: Keys::default(),
                tenant_id: t,
            }),
            Method::ExistKey => Request::ExistKey(KeyArgs {
                key: Bytes::new(),
                tenant_id: t,
            }),
            Method::Ping => Request::Ping(id),
            Method::MountSegment => Request::MountSegment(MountSegmentArgs {
                segment: Segment {
                    id,
                    name: Bytes::new(),
                    base: 0,
                    size: 0,
                    te_endpoint: Bytes::new(),
                    protocol: Bytes::new(),
                    host_id: Bytes::new(),
                },
                client_id: id,
            }),
            Method::BatchUpsertEnd => Request::BatchUpsertEnd(BatchUpsertEndArgs {
                client_id: id,
                object_metas: vec![],
                tenant_id: t,
            }),
            Method::RemoveAll => Request::RemoveAll(RemoveAllArgs {
                force: false,
                tenant_id: t,
            }),
            Method::BatchReplicaClear => Request::BatchReplicaClear(ReplicaClearArgs {
                keys: vec![Bytes::from_static(b"k")],
                client_id: id,
                segment_name: t,
            }),
            _ => unreachable!(),
        }
    }

    #[test]
    fn error_replies_encode_like_the_master() {
        // session_extended #53: GetReplicaList("missing-key") -> has_value 0, -704
        let r = Response::error(Method::GetReplicaList, ErrorCode::OBJECT_NOT_FOUND, 1).unwrap();
        let mut out = BytesMut::new();
        r.encode_body(BodyStyle::MOONCAKE, &mut out);
        assert_eq!(&out[..4], &0x88c6_276du32.to_le_bytes());
        assert_eq!(&out[out.len() - 5..], &[0x00, 0x40, 0xfd, 0xff, 0xff]);
        // (Counting errors in replies: crate::calls.)
        assert!(Response::error(Method::RemoveAll, ErrorCode::INTERNAL_ERROR, 0).is_none());
    }

    /// A 0.3.14 master's answer (metainfo 0x05: a 2-byte total length, then the 0.3.13
    /// payload, then a compatible section with one `00` per replica descriptor) decodes
    /// as the 0.3.13 value; re-encoded, it is the 0.3.13 layout without the section.
    #[test]
    fn a_compatible_section_is_read_past_and_not_rewritten() {
        let rep = ReplicaDescriptor {
            id: 1,
            location: ReplicaLocation::Disk(DiskDescriptor {
                file_path: Bytes::from_static(b"/d/k"),
                object_size: 9,
            }),
            status: ReplicaStatus::COMPLETE,
        };
        let resp = Response::PutStart(Ok(vec![rep]));
        let mut plain = BytesMut::new();
        resp.encode_body(BodyStyle::MOONCAKE, &mut plain);
        assert_eq!(plain[4], 0x04, "a literal, no compatible section");
        // Build the 0.3.14 form: metainfo 0x05, u16 total length, ..., section `00`.
        let mut v14 = BytesMut::new();
        v14.extend_from_slice(&plain[..4]);
        v14.extend_from_slice(&[0x05, 0, 0]);
        v14.extend_from_slice(&plain[5..]);
        v14.extend_from_slice(&[0x00]);
        let total = v14.len() as u16;
        v14[5..7].copy_from_slice(&total.to_le_bytes());
        let (back, style) = Response::decode(Method::PutStart, &v14.freeze())
            .unwrap()
            .unwrap();
        assert_eq!(back, resp);
        assert!(style.compat);
        let mut again = BytesMut::new();
        back.encode_body(style, &mut again);
        assert_eq!(again, plain);
        // A total length that is not the body's is refused (relayed raw).
        let mut bad = BytesMut::from(&plain[..4]);
        bad.extend_from_slice(&[0x05, 0xff, 0x00]);
        bad.extend_from_slice(&plain[5..]);
        bad.extend_from_slice(&[0x00]);
        assert!(matches!(
            Response::decode(Method::PutStart, &bad.freeze()),
            Some(Err(DecodeError::TrailingBytes(1)))
        ));
    }

    #[test]
    fn rpc_error_round_trips() {
        let e = RpcError {
            code: 11,
            message: Bytes::from_static(b"the rpc function not registered"),
        };
        let mut out = BytesMut::new();
        e.encode_body(BodyStyle::MOONCAKE, &mut out);
        let (back, _) = RpcError::decode(e.err_code(), &out.freeze()).unwrap();
        assert_eq!(back, e);
        let wide = RpcError {
            code: 4000,
            message: Bytes::from_static(b"x"),
        };
        assert_eq!(wide.err_code(), 255);
        let mut out = BytesMut::new();
        wide.encode_body(BodyStyle::MOONCAKE, &mut out);
        assert_eq!(RpcError::decode(255, &out.freeze()).unwrap().0, wide);
    }

    /// The counts of an existence answer, from its decoded results (what
    /// `Answering::reply` counts).
    fn counted_from_decode(m: Method, body: &Bytes) -> Option<ExistCounts> {
        let r = match Response::decode(m, body)? {
            Ok((Response::BatchExistKey(r), _)) => r,
            Ok((Response::ExistKey(r), _)) => vec![r],
            _ => return None,
        };
        Some(ExistCounts {
            found: r.iter().filter(|a| **a == Ok(true)).count() as u64,
            absent: r.iter().filter(|a| **a == Ok(false)).count() as u64,
            errors: r.iter().filter(|a| a.is_err()).count() as u64,
            first_error: r.iter().find_map(|a| a.err()),
        })
    }

    /// Every one-byte change of `body` (and one byte more): counted exactly when the
    /// decoder takes it, and then to the same counts.
    fn counts_follow_the_decoder(m: Method, body: &Bytes, values: &[u8]) {
        let count = match m {
            Method::ExistKey => ExistCounts::of_single,
            _ => ExistCounts::of_batch,
        };
        assert_eq!(count(body).ok(), counted_from_decode(m, body));
        for i in 0..=body.len() {
            for &v in values {
                let mut changed = body.to_vec();
                match changed.get_mut(i) {
                    Some(b) => *b = v,
                    None => changed.push(v),
                }
                let changed = Bytes::from(changed);
                assert_eq!(
                    count(&changed).ok(),
                    counted_from_decode(m, &changed),
                    "{m} byte {i} = {v}"
                );
            }
        }
    }

    fn exist_answer(resp: Response, style: BodyStyle) -> Bytes {
        let mut out = BytesMut::new();
        resp.encode_body(style, &mut out);
        out.freeze()
    }

    #[test]
    fn exist_counts_agree_with_the_decoded_answer() {
        let answers = vec![
            Ok(true),
            Err(ErrorCode::OBJECT_NOT_FOUND),
            Ok(false),
            Ok(true),
            Err(ErrorCode(-1)),
        ];
        let literal = BodyStyle {
            with_literal: true,
            ..BodyStyle::MOONCAKE
        };
        for style in [BodyStyle::MOONCAKE, literal] {
            let body = exist_answer(Response::BatchExistKey(answers.clone()), style);
            let c = ExistCounts::of_batch(&body).unwrap();
            assert_eq!(
                c,
                ExistCounts {
                    found: 2,
                    absent: 1,
                    errors: 2,
                    first_error: Some(ErrorCode::OBJECT_NOT_FOUND),
                }
            );
            assert_eq!(c.keys(), 5);
            // Where the decode fails, so does the count: cut, or another method's answer.
            let cut = body.slice(..body.len() - 1);
            assert!(counted_from_decode(Method::BatchExistKey, &cut).is_none());
            assert!(ExistCounts::of_batch(&cut).is_err());
            counts_follow_the_decoder(Method::BatchExistKey, &body, &[0, 1, 2, 0xff]);
        }
        let single = exist_answer(Response::ExistKey(Ok(true)), BodyStyle::MOONCAKE);
        assert!(matches!(
            ExistCounts::of_batch(&single),
            Err(DecodeError::TypeMismatch { .. })
        ));
        let batch = exist_answer(Response::BatchExistKey(answers), BodyStyle::MOONCAKE);
        assert!(
            ExistCounts::of_single(&batch).is_err(),
            "a batch is not one answer"
        );
        // An answer of found and absent keys only (the counted fast path), long enough
        // for the four-at-a-time loop and its remainder.
        let plain: Vec<Expected<bool>> = (0..37).map(|i| Ok(i % 3 == 0)).collect();
        let body = exist_answer(Response::BatchExistKey(plain), BodyStyle::MOONCAKE);
        assert_eq!(
            ExistCounts::of_batch(&body).unwrap(),
            ExistCounts {
                found: 13,
                absent: 24,
                ..ExistCounts::default()
            }
        );
        counts_follow_the_decoder(Method::BatchExistKey, &body, &[0, 1, 2, 0x81, 0xff]);
        // A single key's answer, each kind.
        for answer in [Ok(true), Ok(false), Err(ErrorCode::OBJECT_NOT_FOUND)] {
            for style in [BodyStyle::MOONCAKE, literal] {
                let body = exist_answer(Response::ExistKey(answer), style);
                let c = ExistCounts::of_single(&body).unwrap();
                assert_eq!((c.keys(), c.first_error), (1, answer.err()));
                counts_follow_the_decoder(Method::ExistKey, &body, &[0, 1, 2, 0xff]);
            }
        }
        let mut empty = BytesMut::new();
        Response::BatchExistKey(vec![]).encode_body(BodyStyle::MOONCAKE, &mut empty);
        assert_eq!(
            ExistCounts::of_batch(&empty.freeze()).unwrap(),
            ExistCounts::default()
        );
    }
}

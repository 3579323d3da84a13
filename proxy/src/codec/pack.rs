//! struct_pack, the body encoding of coro_rpc, as far as Mooncake's master uses it.
//!
//! A body is one *message*: a 4-byte hash head (type code | "metainfo follows"), an
//! optional metainfo byte (size width, "literal follows"), an optional NUL-terminated
//! type literal, then the payload written depth-first with no tags. One size width
//! (1, 2, 4 or 8 bytes) is used for every length prefix of a message, chosen by its
//! largest string, vector or map.
//!
//! [`Pack`] is implemented by every Rust type that mirrors a C++ type on the wire; it
//! yields the type literal (from which the hash is computed), the largest container
//! (from which the width is chosen), and the payload encoding. Decoding slices
//! strings out of the input [`Bytes`] without copying.
//!
//! This module knows no sockets, clocks or frames.

use bytes::{BufMut, Bytes, BytesMut};
use md5::{Digest, Md5};

use super::error::DecodeError;

/// First 4 bytes of MD5(s) read as a big-endian u32: yalantinglibs' `MD5_32`, used for
/// both function ids and type codes.
pub fn md5_32(s: &[u8]) -> u32 {
    let d = Md5::digest(s);
    u32::from_be_bytes([d[0], d[1], d[2], d[3]])
}

/// Width of every length prefix in one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SizeWidth {
    W1,
    W2,
    W4,
    W8,
}

impl SizeWidth {
    /// The narrowest width that holds `max_len`, as the C++ sender chooses it.
    pub fn for_max_len(max_len: usize) -> Self {
        match max_len as u64 {
            0..=0xff => SizeWidth::W1,
            0x100..=0xffff => SizeWidth::W2,
            0x1_0000..=0xffff_ffff => SizeWidth::W4,
            _ => SizeWidth::W8,
        }
    }
    /// Metainfo bits 3-4 for this width.
    pub fn code(self) -> u8 {
        match self {
            SizeWidth::W1 => 0,
            SizeWidth::W2 => 1,
            SizeWidth::W4 => 2,
            SizeWidth::W8 => 3,
        }
    }
    /// Bytes of one length prefix.
    pub fn bytes(self) -> usize {
        match self {
            SizeWidth::W1 => 1,
            SizeWidth::W2 => 2,
            SizeWidth::W4 => 4,
            SizeWidth::W8 => 8,
        }
    }
    fn from_code(c: u8) -> Self {
        match c & 3 {
            0 => SizeWidth::W1,
            1 => SizeWidth::W2,
            2 => SizeWidth::W4,
            _ => SizeWidth::W8,
        }
    }
}

/// Metainfo bit: a type literal follows.
const META_LITERAL: u8 = 0b100;
/// Metainfo bits 0-1: the body's total length follows (2, 4 or 8 bytes), and the body
/// ends with a struct_pack "compatible section" after the payload. Mooncake 0.3.14's
/// master sends one in every answer that carries replica descriptors.
const META_COMPAT: u8 = 0b11;

/// Cursor over one message payload. Strings are returned as slices of the input.
pub struct Reader {
    buf: Bytes,
    pos: usize,
    width: SizeWidth,
}

impl Reader {
    pub fn new(buf: Bytes, pos: usize, width: SizeWidth) -> Self {
        Reader { buf, pos, width }
    }

    pub fn position(&self) -> usize {
        self.pos
    }

    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// The message's size width.
    pub fn width(&self) -> SizeWidth {
        self.width
    }

    /// The bytes not read yet.
    pub fn rest(&self) -> &[u8] {
        self.buf.get(self.pos..).unwrap_or_default()
    }

    /// The bytes read since `start` (a [`Reader::position`]), sharing the input's memory.
    pub fn slice_from(&self, start: usize) -> Bytes {
        self.buf.slice(start.min(self.pos)..self.pos)
    }

    #[inline]
    pub fn take(&mut self, n: usize) -> Result<&[u8], DecodeError> {
        let rest = self.buf.get(self.pos..).unwrap_or_default();
        match rest.get(..n) {
            Some(s) => {
                self.pos += n;
                Ok(s)
            }
            None => Err(truncated(self.pos, n, rest.len())),
        }
    }

    pub fn take_bytes(&mut self, n: usize) -> Result<Bytes, DecodeError> {
        if self.remaining() < n {
            return Err(truncated(self.pos, n, self.remaining()));
        }
        let s = self.buf.slice(self.pos..self.pos + n);
        self.pos += n;
        Ok(s)
    }

    #[inline]
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        match le::<N>(self.buf.get(self.pos..).unwrap_or_default()) {
            Some(a) => {
                self.pos += N;
                Ok(a)
            }
            None => Err(truncated(self.pos, N, self.remaining())),
        }
    }

    #[inline]
    pub fn u8(&mut self) -> Result<u8, DecodeError> {
        match self.buf.get(self.pos) {
            Some(&b) => {
                self.pos += 1;
                Ok(b)
            }
            None => Err(truncated(self.pos, 1, 0)),
        }
    }

    /// A one-byte flag (bool, optional has-value, expected has-value). Anything but 0
    /// or 1 is refused so that a re-encode cannot silently change the bytes.
    #[inline]
    pub fn flag(&mut self) -> Result<bool, DecodeError> {
        let at = self.pos;
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(DecodeError::BadFlag { at, value: v }),
        }
    }

    /// A container length in the message's size width. Bounded by the bytes left, since
    /// every element of every container Mooncake sends takes at least one byte; this
    /// keeps a forged count from reserving gigabytes.
    #[inline]
    pub fn read_len(&mut self) -> Result<usize, DecodeError> {
        let at = self.pos;
        let rest = self.buf.get(at..).unwrap_or_default();
        let n = match self.width {
            SizeWidth::W1 => rest.first().map(|&b| u64::from(b)),
            SizeWidth::W2 => le::<2>(rest).map(|a| u64::from(u16::from_le_bytes(a))),
            SizeWidth::W4 => le::<4>(rest).map(|a| u64::from(u32::from_le_bytes(a))),
            SizeWidth::W8 => le::<8>(rest).map(u64::from_le_bytes),
        };
        let w = self.width.bytes();
        let Some(n) = n else {
            return Err(truncated(at, w, rest.len()));
        };
        let have = rest.len() - w;
        if n > have as u64 {
            return Err(DecodeError::LengthTooLarge { at, len: n, have });
        }
        self.pos = at + w;
        Ok(n as usize)
    }
}

/// The first `N` bytes of `s`, if it has them.
#[inline]
fn le<const N: usize>(s: &[u8]) -> Option<[u8; N]> {
    s.get(..N)?.try_into().ok()
}

// Out of line: the decoders' loops stay small, and a bad frame is rare.
#[cold]
#[inline(never)]
fn truncated(at: usize, need: usize, have: usize) -> DecodeError {
    DecodeError::Truncated { at, need, have }
}

/// Payload writer with a fixed size width.
pub struct Writer<'a> {
    out: &'a mut BytesMut,
    width: SizeWidth,
}

impl<'a> Writer<'a> {
    pub fn new(out: &'a mut BytesMut, width: SizeWidth) -> Self {
        Writer { out, width }
    }
    /// The message's size width.
    pub fn width(&self) -> SizeWidth {
        self.width
    }
    pub fn bytes(&mut self, b: &[u8]) {
        self.out.extend_from_slice(b);
    }
    pub fn u8(&mut self, v: u8) {
        self.out.put_u8(v);
    }
    pub fn write_len(&mut self, n: usize) {
        match self.width {
            SizeWidth::W1 => self.out.put_u8(n as u8),
            SizeWidth::W2 => self.out.put_u16_le(n as u16),
            SizeWidth::W4 => self.out.put_u32_le(n as u32),
            SizeWidth::W8 => self.out.put_u64_le(n as u64),
        }
    }
}

/// A Rust type with a struct_pack wire form identical to a C++ type of Mooncake's.
pub trait Pack: Sized {
    /// Appends this type's struct_pack type literal.
    fn write_literal(out: &mut Vec<u8>);
    /// The largest container size (string bytes, vector or map entries) in the value.
    fn max_len(&self) -> usize {
        0
    }
    fn encode(&self, w: &mut Writer<'_>);
    fn decode(r: &mut Reader) -> Result<Self, DecodeError>;
}

macro_rules! pack_int {
    ($($t:ty => $code:expr),* $(,)?) => {$(
        impl Pack for $t {
            fn write_literal(out: &mut Vec<u8>) {
                out.push($code);
            }
            fn encode(&self, w: &mut Writer<'_>) {
                w.bytes(&self.to_le_bytes());
            }
            #[inline]
            fn decode(r: &mut Reader) -> Result<Self, DecodeError> {
                Ok(<$t>::from_le_bytes(r.array()?))
            }
        }
    )*};
}
pack_int!(i32 => 0x01, u32 => 0x02, i64 => 0x03, u64 => 0x04, i8 => 0x05, u8 => 0x06,
          i16 => 0x07, u16 => 0x08);

impl Pack for bool {
    fn write_literal(out: &mut Vec<u8>) {
        out.push(0x0b);
    }
    fn encode(&self, w: &mut Writer<'_>) {
        w.u8(u8::from(*self));
    }
    #[inline]
    fn decode(r: &mut Reader) -> Result<Self, DecodeError> {
        r.flag()
    }
}

/// `std::string`: bytes, not necessarily UTF-8 (Mooncake keys are arbitrary bytes).
impl Pack for Bytes {
    fn write_literal(out: &mut Vec<u8>) {
        out.extend_from_slice(&[0x80, 0x0c]);
    }
    fn max_len(&self) -> usize {
        self.len()
    }
    fn encode(&self, w: &mut Writer<'_>) {
        w.write_len(self.len());
        w.bytes(self);
    }
    fn decode(r: &mut Reader) -> Result<Self, DecodeError> {
        let n = r.read_len()?;
        r.take_bytes(n)
    }
}

/// `void` / `std::monostate`: no payload.
impl Pack for () {
    fn write_literal(out: &mut Vec<u8>) {
        out.push(0xfa);
    }
    fn encode(&self, _w: &mut Writer<'_>) {}
    fn decode(_r: &mut Reader) -> Result<Self, DecodeError> {
        Ok(())
    }
}

impl<T: Pack> Pack for Vec<T> {
    fn write_literal(out: &mut Vec<u8>) {
        out.push(0x84);
        T::write_literal(out);
    }
    fn max_len(&self) -> usize {
        self.iter().fold(self.len(), |m, x| m.max(x.max_len()))
    }
    fn encode(&self, w: &mut Writer<'_>) {
        w.write_len(self.len());
        for x in self {
            x.encode(w);
        }
    }
    fn decode(r: &mut Reader) -> Result<Self, DecodeError> {
        let n = r.read_len()?;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push(T::decode(r)?);
        }
        Ok(v)
    }
}

impl<T: Pack> Pack for Option<T> {
    fn write_literal(out: &mut Vec<u8>) {
        out.push(0x85);
        T::write_literal(out);
    }
    fn max_len(&self) -> usize {
        self.as_ref().map_or(0, Pack::max_len)
    }
    fn encode(&self, w: &mut Writer<'_>) {
        match self {
            None => w.u8(0),
            Some(x) => {
                w.u8(1);
                x.encode(w);
            }
        }
    }
    fn decode(r: &mut Reader) -> Result<Self, DecodeError> {
        if r.flag()? {
            Ok(Some(T::decode(r)?))
        } else {
            Ok(None)
        }
    }
}

/// `tl::expected<T, E>`: one has-value byte, then T or E.
impl<T: Pack, E: Pack> Pack for Result<T, E> {
    fn write_literal(out: &mut Vec<u8>) {
        out.push(0x87);
        T::write_literal(out);
        E::write_literal(out);
    }
    fn max_len(&self) -> usize {
        match self {
            Ok(v) => v.max_len(),
            Err(e) => e.max_len(),
        }
    }
    fn encode(&self, w: &mut Writer<'_>) {
        match self {
            Ok(v) => {
                w.u8(1);
                v.encode(w);
            }
            Err(e) => {
                w.u8(0);
                e.encode(w);
            }
        }
    }
    #[inline]
    fn decode(r: &mut Reader) -> Result<Self, DecodeError> {
        if r.flag()? {
            Ok(Ok(T::decode(r)?))
        } else {
            Ok(Err(E::decode(r)?))
        }
    }
}

/// A struct_pack "non-trivial struct" (declared with `YLT_REFL`, or an aggregate with a
/// non-POD member), or a `std::tuple` of call arguments: members one after another,
/// literal `fd <members> ff`. Field order is wire order.
#[macro_export]
macro_rules! pack_struct {
    ($(#[$m:meta])* pub struct $name:ident { $( $(#[$fm:meta])* pub $f:ident : $t:ty ),* $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, PartialEq, Eq)]
        pub struct $name { $( $(#[$fm])* pub $f: $t ),* }

        impl $crate::codec::pack::Pack for $name {
            fn write_literal(out: &mut Vec<u8>) {
                out.push(0xfd);
                $( <$t as $crate::codec::pack::Pack>::write_literal(out); )*
                out.push(0xff);
            }
            fn max_len(&self) -> usize {
                0 $( .max($crate::codec::pack::Pack::max_len(&self.$f)) )*
            }
            fn encode(&self, w: &mut $crate::codec::pack::Writer<'_>) {
                $( $crate::codec::pack::Pack::encode(&self.$f, w); )*
            }
            fn decode(r: &mut $crate::codec::pack::Reader)
                -> Result<Self, $crate::codec::error::DecodeError> {
                Ok($name { $( $f: <$t as $crate::codec::pack::Pack>::decode(r)?, )* })
            }
        }
    };
}

/// A C++ enum carried as its underlying integer. Unknown values are kept, so a value a
/// newer master sends passes through a decode/encode unchanged.
#[macro_export]
macro_rules! int_enum {
    ($(#[$m:meta])* pub struct $name:ident($base:ty) { $( $variant:ident = $val:expr ),* $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub struct $name(pub $base);

        #[allow(non_upper_case_globals)]
        impl $name {
            $( pub const $variant: $name = $name($val); )*

            /// The C++ enumerator's name, or `None` for a value this build does not know.
            pub fn name(self) -> Option<&'static str> {
                match self.0 {
                    $( v if v == $val => Some(stringify!($variant)), )*
                    _ => None,
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                match self.name() {
                    Some(n) => write!(f, "{}({})", n, self.0),
                    None => write!(f, "{}", self.0),
                }
            }
        }

        impl $crate::codec::pack::Pack for $name {
            fn write_literal(out: &mut Vec<u8>) {
                <$base as $crate::codec::pack::Pack>::write_literal(out);
            }
            fn encode(&self, w: &mut $crate::codec::pack::Writer<'_>) {
                $crate::codec::pack::Pack::encode(&self.0, w);
            }
            #[inline]
            fn decode(r: &mut $crate::codec::pack::Reader)
                -> Result<Self, $crate::codec::error::DecodeError> {
                Ok($name(<$base as $crate::codec::pack::Pack>::decode(r)?))
            }
        }
    };
}

/// Literal and type code of a message root type, computed once per type.
#[derive(Debug)]
pub struct RootSchema {
    pub literal: Box<[u8]>,
    /// MD5_32(literal) with bit 0 cleared.
    pub code: u32,
}

impl RootSchema {
    pub fn of<T: Pack>() -> Self {
        let mut lit = Vec::new();
        T::write_literal(&mut lit);
        let code = md5_32(&lit) & !1;
        RootSchema {
            literal: lit.into_boxed_slice(),
            code,
        }
    }
}

/// The Mooncake release whose struct layouts a body uses (picked by its type code).
/// Releases that share a layout share a schema: 0.3.14 requests are 0.3.13's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Schema {
    V0_3_11,
    V0_3_12,
    V0_3_13,
}

impl Schema {
    pub const ALL: [Schema; 3] = [Schema::V0_3_11, Schema::V0_3_12, Schema::V0_3_13];

    /// The release as operators name it (a metric label).
    pub fn label(self) -> &'static str {
        match self {
            Schema::V0_3_11 => "0.3.11",
            Schema::V0_3_12 => "0.3.12",
            Schema::V0_3_13 => "0.3.13",
        }
    }
}

/// The parts of a message's prefix that survive a decode, so that a re-encode of an
/// unchanged value gives back the same bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyStyle {
    /// The sender included the type literal (every Mooncake 0.3.13 binary does).
    pub with_literal: bool,
    /// The layout the body arrived in, and is re-encoded in.
    pub schema: Schema,
    /// The body ended with a compatible section (0.3.14). Its fields are not decoded; a
    /// relayed body keeps it, a re-encoded one is written without it (the 0.3.13 layout,
    /// which every client of this family reads).
    pub compat: bool,
}

impl BodyStyle {
    /// What the installed Mooncake binaries send.
    pub const MOONCAKE: BodyStyle = BodyStyle {
        with_literal: true,
        schema: Schema::V0_3_13,
        compat: false,
    };
}

/// The prefix of a message: hash head, metainfo, literal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prefix {
    pub hash_head: u32,
    pub metainfo: Option<u8>,
    /// The literal without its NUL terminator, as a slice of the body.
    pub literal: Option<Bytes>,
    pub width: SizeWidth,
    /// Offset of the payload in the body.
    pub payload_at: usize,
    /// The total body length a compatible section's metainfo announced.
    pub compat_total: Option<u64>,
}

impl Prefix {
    pub fn parse(body: &Bytes) -> Result<Prefix, DecodeError> {
        if body.len() < 4 {
            return Err(DecodeError::Truncated {
                at: 0,
                need: 4,
                have: body.len(),
            });
        }
        let hash_head = u32::from_le_bytes([body[0], body[1], body[2], body[3]]);
        let mut pos = 4;
        let mut metainfo = None;
        let mut literal = None;
        let mut compat_total = None;
        let mut width = SizeWidth::W1;
        if hash_head & 1 == 1 {
            let m = *body.get(pos).ok_or(DecodeError::Truncated {
                at: pos,
                need: 1,
                have: 0,
            })?;
            pos += 1;
            if m >> 5 != 0 {
                return Err(DecodeError::UnsupportedMetainfo(m));
            }
            if m & META_COMPAT != 0 {
                let n = 1usize << (m & META_COMPAT);
                let field = body.get(pos..pos + n).ok_or(DecodeError::Truncated {
                    at: pos,
                    need: n,
                    have: body.len().saturating_sub(pos),
                })?;
                let mut le = [0u8; 8];
                le[..n].copy_from_slice(field);
                compat_total = Some(u64::from_le_bytes(le));
                pos += n;
            }
            width = SizeWidth::from_code(m >> 3);
            if m & META_LITERAL != 0 {
                let end =
                    memchr::memchr(0, &body[pos..]).ok_or(DecodeError::UnterminatedLiteral)?;
                literal = Some(body.slice(pos..pos + end));
                pos += end + 1;
            }
            metainfo = Some(m);
        }
        Ok(Prefix {
            hash_head,
            metainfo,
            literal,
            width,
            payload_at: pos,
            compat_total,
        })
    }

    pub fn style(&self) -> BodyStyle {
        BodyStyle {
            with_literal: self.literal.is_some(),
            schema: Schema::V0_3_13,
            compat: self.compat_total.is_some(),
        }
    }
}

/// Decodes a whole message whose root type is `T`. The type code must match, a literal
/// (if sent) must equal ours byte for byte, and the payload must be consumed exactly:
/// anything else is an error, and a proxy then relays the frame untouched.
pub fn decode_message<T: Pack>(
    body: &Bytes,
    schema: &RootSchema,
) -> Result<(T, BodyStyle), DecodeError> {
    decode_message_with(body, schema, T::decode)
}

/// As [`decode_message`], with the payload read by `read` rather than built as the
/// root type: for a caller that needs a summary of the payload, not its values. The
/// same checks (type code, literal, payload consumed exactly).
pub fn decode_message_with<T>(
    body: &Bytes,
    schema: &RootSchema,
    read: impl FnOnce(&mut Reader) -> Result<T, DecodeError>,
) -> Result<(T, BodyStyle), DecodeError> {
    let prefix = Prefix::parse(body)?;
    if prefix.hash_head >> 1 != schema.code >> 1 {
        return Err(DecodeError::TypeMismatch {
            expected: schema.code,
            found: prefix.hash_head & !1,
        });
    }
    if let Some(lit) = &prefix.literal
        && lit[..] != schema.literal[..]
    {
        return Err(DecodeError::LiteralMismatch);
    }
    let mut r = Reader::new(body.clone(), prefix.payload_at, prefix.width);
    let v = read(&mut r)?;
    match prefix.compat_total {
        // What follows the payload is the compatible section; the announced length
        // must be the body's (as the 0.3.14 master sends it).
        Some(total) if total == body.len() as u64 => {}
        Some(_) => return Err(DecodeError::TrailingBytes(r.remaining())),
        None if r.remaining() != 0 => return Err(DecodeError::TrailingBytes(r.remaining())),
        None => {}
    }
    Ok((v, prefix.style()))
}

/// Encodes `v` as a whole message the way the C++ sender does: hash of the type's own
/// literal, narrowest size width, metainfo only when needed.
pub fn encode_message<T: Pack>(v: &T, schema: &RootSchema, style: BodyStyle, out: &mut BytesMut) {
    let width = SizeWidth::for_max_len(v.max_len());
    let mut meta = width.code() << 3;
    if style.with_literal {
        meta |= META_LITERAL;
    }
    let has_meta = meta != 0;
    out.put_u32_le(schema.code | u32::from(has_meta));
    if has_meta {
        out.put_u8(meta);
    }
    if style.with_literal {
        out.extend_from_slice(&schema.literal);
        out.put_u8(0);
    }
    v.encode(&mut Writer::new(out, width));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn md5_32_matches_spec_example() {
        assert_eq!(
            md5_32(b"mooncake::WrappedMasterService::PutStart"),
            0x65ea_9ac1
        );
    }

    #[test]
    fn width_follows_largest_container() {
        assert_eq!(SizeWidth::for_max_len(255), SizeWidth::W1);
        assert_eq!(SizeWidth::for_max_len(256), SizeWidth::W2);
        assert_eq!(SizeWidth::for_max_len(65535), SizeWidth::W2);
        assert_eq!(SizeWidth::for_max_len(65536), SizeWidth::W4);
    }

    #[test]
    fn string_message_matches_the_rpc_error_body() {
        // Transport-error body from the spec: hash 0x9dcffa76|1, metainfo 04, `80 0c 00`.
        let schema = RootSchema::of::<Bytes>();
        assert_eq!(schema.code, 0x9dcf_fa76);
        let mut out = BytesMut::new();
        encode_message(
            &Bytes::from_static(b"the rpc function not registered"),
            &schema,
            BodyStyle::MOONCAKE,
            &mut out,
        );
        assert_eq!(&out[..8], &[0x77, 0xfa, 0xcf, 0x9d, 0x04, 0x80, 0x0c, 0x00]);
        assert_eq!(out[8], 31);
        let (s, style): (Bytes, _) = decode_message(&out.freeze(), &schema).unwrap();
        assert_eq!(&s[..], b"the rpc function not registered");
        assert!(style.with_literal);
    }

    #[test]
    fn wide_message_switches_every_prefix_and_back() {
        let schema = RootSchema::of::<Vec<Bytes>>();
        let v: Vec<Bytes> = (0..300).map(|i| Bytes::from(format!("k{i:03}"))).collect();
        let mut out = BytesMut::new();
        encode_message(&v, &schema, BodyStyle::MOONCAKE, &mut out);
        let body = out.freeze();
        let p = Prefix::parse(&body).unwrap();
        assert_eq!(p.width, SizeWidth::W2);
        assert_eq!(p.metainfo, Some(0x0c));
        // count (2 bytes) then the first key's length as 2 bytes as well
        assert_eq!(
            &body[p.payload_at..p.payload_at + 4],
            &[0x2c, 0x01, 0x04, 0x00]
        );
        let (back, _): (Vec<Bytes>, _) = decode_message(&body, &schema).unwrap();
        assert_eq!(back, v);
    }

    #[test]
    fn message_without_literal_or_metainfo() {
        let schema = RootSchema::of::<u64>();
        let mut out = BytesMut::new();
        encode_message(
            &7u64,
            &schema,
            BodyStyle {
                with_literal: false,
                schema: Schema::V0_3_13,
                compat: false,
            },
            &mut out,
        );
        assert_eq!(out.len(), 12);
        assert_eq!(u32::from_le_bytes([out[0], out[1], out[2], out[3]]) & 1, 0);
        let (v, style): (u64, _) = decode_message(&out.freeze(), &schema).unwrap();
        assert_eq!(v, 7);
        assert!(!style.with_literal);
    }

    #[test]
    fn forged_count_is_refused_without_allocating() {
        let schema = RootSchema::of::<Vec<u64>>();
        let mut out = BytesMut::new();
        encode_message(&vec![1u64], &schema, BodyStyle::MOONCAKE, &mut out);
        let mut body = out.to_vec();
        let p = Prefix::parse(&Bytes::from(body.clone())).unwrap();
        body[p.payload_at] = 0xff; // 255 elements claimed, 8 bytes present
        let err = decode_message::<Vec<u64>>(&Bytes::from(body), &schema).unwrap_err();
        assert!(matches!(err, DecodeError::LengthTooLarge { .. }), "{err}");
    }
}

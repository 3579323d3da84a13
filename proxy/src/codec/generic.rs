//! Schema-free decoding of any struct_pack body that carries its type literal.
//!
//! The installed Mooncake binaries put the type literal in every body, so the bodies of
//! methods moongate has no typed form for can still be read (field names unknown): for
//! debugging, for tests that prove the codec on every captured frame, and for metrics on
//! methods a policy does not handle. Re-encoding recomputes the size width, the hash and
//! the metainfo from the value, as the C++ sender does.

use bytes::{BufMut, Bytes, BytesMut};

use super::error::DecodeError;
use super::pack::{Prefix, Reader, SizeWidth, Writer, md5_32};

/// Deepest type nesting accepted; Mooncake's deepest type is about 8 levels.
const MAX_DEPTH: usize = 32;

/// A struct_pack type, parsed from a literal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ty {
    /// Fixed-width scalar: literal code and byte size.
    Scalar {
        code: u8,
        size: usize,
    },
    Bool,
    Str,
    Vec(Box<Ty>),
    Map(Box<Ty>, Box<Ty>),
    Opt(Box<Ty>),
    Expected(Box<Ty>, Box<Ty>),
    Void,
    Variant(Vec<Ty>),
    /// Non-trivial struct or tuple: members in order.
    Struct(Vec<Ty>),
    /// Trivially-serializable struct: its raw memory image of `size` bytes.
    Pod {
        fields: Vec<Ty>,
        size: usize,
        align: usize,
    },
}

/// A decoded value of a [`Ty`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// Scalars (and bools) are kept as their little-endian bytes.
    Scalar(Bytes),
    Bool(bool),
    Str(Bytes),
    Seq(Vec<Value>),
    Map(Vec<(Value, Value)>),
    Opt(Option<Box<Value>>),
    Ok(Box<Value>),
    Err(Box<Value>),
    Void,
    Variant(u8, Box<Value>),
    Struct(Vec<Value>),
    Pod(Bytes),
}

fn scalar_size(code: u8) -> Option<usize> {
    Some(match code {
        0x05 | 0x06 | 0x0c => 1,
        0x07 | 0x08 => 2,
        0x01 | 0x02 | 0x11 => 4,
        0x03 | 0x04 | 0x12 => 8,
        _ => return None,
    })
}

impl Ty {
    /// Parses a whole type literal (without its NUL).
    pub fn parse(lit: &[u8]) -> Result<Ty, DecodeError> {
        let mut pos = 0;
        let t = parse_one(lit, &mut pos, 0)?;
        if pos != lit.len() {
            return Err(DecodeError::BadLiteral {
                at: pos,
                reason: "trailing bytes",
            });
        }
        Ok(t)
    }

    fn is_trivial(&self) -> bool {
        matches!(self, Ty::Scalar { .. } | Ty::Bool | Ty::Pod { .. })
    }

    fn size_align(&self) -> (usize, usize) {
        match self {
            Ty::Scalar { size, .. } => (*size, *size),
            Ty::Bool => (1, 1),
            Ty::Pod { size, align, .. } => (*size, *align),
            _ => (0, 1),
        }
    }
}

fn bad(at: usize, reason: &'static str) -> DecodeError {
    DecodeError::BadLiteral { at, reason }
}

fn parse_one(lit: &[u8], pos: &mut usize, depth: usize) -> Result<Ty, DecodeError> {
    if depth > MAX_DEPTH {
        return Err(DecodeError::TooDeep(MAX_DEPTH));
    }
    let at = *pos;
    let c = *lit.get(at).ok_or(bad(at, "literal ends early"))?;
    *pos += 1;
    let sub = |pos: &mut usize| parse_one(lit, pos, depth + 1).map(Box::new);
    Ok(match c {
        0x0b => Ty::Bool,
        0x80 => {
            if lit.get(*pos) != Some(&0x0c) {
                return Err(bad(*pos, "only std::string (80 0c) is supported"));
            }
            *pos += 1;
            Ty::Str
        }
        0x82 => Ty::Map(sub(pos)?, sub(pos)?),
        0x84 => Ty::Vec(sub(pos)?),
        0x85 => Ty::Opt(sub(pos)?),
        0x86 => {
            let mut alts = Vec::new();
            while lit.get(*pos) != Some(&0xff) {
                if *pos >= lit.len() {
                    return Err(bad(*pos, "unterminated variant"));
                }
                alts.push(parse_one(lit, pos, depth + 1)?);
            }
            *pos += 1;
            Ty::Variant(alts)
        }
        0x87 => Ty::Expected(sub(pos)?, sub(pos)?),
        0xfa => Ty::Void,
        0xfd => parse_struct(lit, pos, depth)?,
        c => match scalar_size(c) {
            Some(size) => Ty::Scalar { code: c, size },
            None => return Err(bad(at, "unsupported type code")),
        },
    })
}

/// A struct's members end at `ff`. A trivially-serializable struct ends with two size
/// literals (pack alignment, alignment; `n + 129`) before the `ff`; they are told apart
/// from members because no member literal of the form `<x> <y> ff` exists.
fn parse_struct(lit: &[u8], pos: &mut usize, depth: usize) -> Result<Ty, DecodeError> {
    let mut fields = Vec::new();
    loop {
        match lit.get(*pos) {
            None => return Err(bad(*pos, "unterminated struct")),
            Some(0xff) => {
                *pos += 1;
                return Ok(Ty::Struct(fields));
            }
            Some(&a)
                if !fields.is_empty()
                    && fields.iter().all(Ty::is_trivial)
                    && a > 0x80
                    && lit.get(*pos + 1).is_some_and(|&b| b > 0x80)
                    && lit.get(*pos + 2) == Some(&0xff) =>
            {
                let (size, align) = pod_layout(&fields);
                if usize::from(a) != align + 129 {
                    return Err(bad(*pos, "alignment suffix disagrees with the members"));
                }
                *pos += 3;
                return Ok(Ty::Pod {
                    fields,
                    size,
                    align,
                });
            }
            Some(_) => fields.push(parse_one(lit, pos, depth + 1)?),
        }
    }
}

/// The C++ layout (size with padding, alignment) of a struct of trivial members.
fn pod_layout(fields: &[Ty]) -> (usize, usize) {
    let (mut off, mut align) = (0usize, 1usize);
    for f in fields {
        let (s, a) = f.size_align();
        off = off.div_ceil(a) * a + s;
        align = align.max(a);
    }
    (off.div_ceil(align) * align, align)
}

impl Value {
    pub fn decode(ty: &Ty, r: &mut Reader) -> Result<Value, DecodeError> {
        Ok(match ty {
            Ty::Scalar { size, .. } => Value::Scalar(r.take_bytes(*size)?),
            Ty::Bool => Value::Bool(r.flag()?),
            Ty::Str => {
                let n = r.read_len()?;
                Value::Str(r.take_bytes(n)?)
            }
            Ty::Vec(t) => {
                let n = r.read_len()?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(Value::decode(t, r)?);
                }
                Value::Seq(v)
            }
            Ty::Map(k, v) => {
                let n = r.read_len()?;
                let mut m = Vec::with_capacity(n);
                for _ in 0..n {
                    m.push((Value::decode(k, r)?, Value::decode(v, r)?));
                }
                Value::Map(m)
            }
            Ty::Opt(t) => Value::Opt(if r.flag()? {
                Some(Box::new(Value::decode(t, r)?))
            } else {
                None
            }),
            Ty::Expected(t, e) => {
                if r.flag()? {
                    Value::Ok(Box::new(Value::decode(t, r)?))
                } else {
                    Value::Err(Box::new(Value::decode(e, r)?))
                }
            }
            Ty::Void => Value::Void,
            Ty::Variant(alts) => {
                let at = r.position();
                let i = r.u8()?;
                let t = alts
                    .get(usize::from(i))
                    .ok_or(DecodeError::BadVariant { at, index: i })?;
                Value::Variant(i, Box::new(Value::decode(t, r)?))
            }
            Ty::Struct(fields) => Value::Struct(
                fields
                    .iter()
                    .map(|f| Value::decode(f, r))
                    .collect::<Result<_, _>>()?,
            ),
            Ty::Pod { size, .. } => Value::Pod(r.take_bytes(*size)?),
        })
    }

    pub fn max_len(&self) -> usize {
        match self {
            Value::Str(s) => s.len(),
            Value::Seq(v) => v.iter().fold(v.len(), |m, x| m.max(x.max_len())),
            Value::Map(m) => m
                .iter()
                .fold(m.len(), |acc, (k, v)| acc.max(k.max_len()).max(v.max_len())),
            Value::Opt(Some(v)) | Value::Ok(v) | Value::Err(v) | Value::Variant(_, v) => {
                v.max_len()
            }
            Value::Struct(f) => f.iter().map(Value::max_len).max().unwrap_or(0),
            _ => 0,
        }
    }

    pub fn encode(&self, w: &mut Writer<'_>) {
        match self {
            Value::Scalar(b) | Value::Pod(b) => w.bytes(b),
            Value::Bool(b) => w.u8(u8::from(*b)),
            Value::Str(s) => {
                w.write_len(s.len());
                w.bytes(s);
            }
            Value::Seq(v) => {
                w.write_len(v.len());
                v.iter().for_each(|x| x.encode(w));
            }
            Value::Map(m) => {
                w.write_len(m.len());
                for (k, v) in m {
                    k.encode(w);
                    v.encode(w);
                }
            }
            Value::Opt(None) => w.u8(0),
            Value::Opt(Some(v)) | Value::Ok(v) => {
                w.u8(1);
                v.encode(w);
            }
            Value::Err(v) => {
                w.u8(0);
                v.encode(w);
            }
            Value::Void => {}
            Value::Variant(i, v) => {
                w.u8(*i);
                v.encode(w);
            }
            Value::Struct(f) => f.iter().for_each(|x| x.encode(w)),
        }
    }
}

/// A body decoded with the type tree from its own literal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenericMessage {
    pub literal: Bytes,
    pub ty: Ty,
    pub value: Value,
}

impl GenericMessage {
    pub fn decode(body: &Bytes) -> Result<GenericMessage, DecodeError> {
        let prefix = Prefix::parse(body)?;
        let literal = prefix.literal.clone().ok_or(DecodeError::MissingLiteral)?;
        if md5_32(&literal) >> 1 != prefix.hash_head >> 1 {
            return Err(DecodeError::TypeMismatch {
                expected: md5_32(&literal) & !1,
                found: prefix.hash_head & !1,
            });
        }
        let ty = Ty::parse(&literal)?;
        let mut r = Reader::new(body.clone(), prefix.payload_at, prefix.width);
        let value = Value::decode(&ty, &mut r)?;
        if r.remaining() != 0 {
            return Err(DecodeError::TrailingBytes(r.remaining()));
        }
        Ok(GenericMessage { literal, ty, value })
    }

    /// Re-encodes with the literal, as the installed binaries send.
    pub fn encode(&self, out: &mut BytesMut) {
        let width = SizeWidth::for_max_len(self.value.max_len());
        out.put_u32_le((md5_32(&self.literal) & !1) | 1);
        out.put_u8(0b100 | (width.code() << 3));
        out.extend_from_slice(&self.literal);
        out.put_u8(0);
        self.value.encode(&mut Writer::new(out, width));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_literal_is_a_pod() {
        let t = Ty::parse(&[0xfd, 0x04, 0x04, 0x89, 0x89, 0xff]).unwrap();
        assert!(matches!(
            t,
            Ty::Pod {
                size: 16,
                align: 8,
                ..
            }
        ));
    }

    #[test]
    fn struct_with_optional_member_is_not_a_pod() {
        // {u64, optional<u64>}: `85 04 ff` must not be read as an alignment suffix
        let t = Ty::parse(&[0xfd, 0x04, 0x85, 0x04, 0xff]).unwrap();
        assert!(matches!(t, Ty::Struct(ref f) if f.len() == 2));
    }

    #[test]
    fn bad_literals_are_errors() {
        for lit in [
            &[][..],
            &[0xfd, 0x04],
            &[0x86, 0x04],
            &[0x80, 0x04],
            &[0x42],
            &[0x04, 0x04],
            &[0xfd, 0x04, 0x04, 0x85, 0x85, 0xff],
        ] {
            assert!(Ty::parse(lit).is_err(), "{lit:02x?}");
        }
        let deep = vec![0x84u8; 100];
        assert!(Ty::parse(&deep).is_err());
    }
}

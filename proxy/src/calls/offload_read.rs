//! The owner's offload-read service: how a rank reads a value that sits only on an
//! owner's SSD. The rank calls the endpoint its replica list named
//! (`LocalDiskDescriptor.transport_endpoint`), not the master:
//!
//! | method (function id) | arguments | answer |
//! | --- | --- | --- |
//! | `batch_get_offload_object` | `(keys, sizes)`: per key its tenant-qualified name and size | `expected<{batch_id, pointers, transfer-engine address, gc ttl ms}, ErrorCode>`: the owner staged the values in its buffer at `pointers`; the rank reads them there over the transfer engine |
//! | `release_offload_buffer` | `batch_id` | `bool`: the staging buffer is free again (the owner frees it itself after the ttl) |
//!
//! What this room knows: a read call's keys and sizes, cutting it into parts (each a
//! whole call of its own), merging the parts' answers into the one answer the rank
//! expects under one batch id, and a release naming one of the parts. Read schema-free
//! ([`crate::codec::generic`]) and by shape, so another release that adds a member
//! (tenants per key, say) is still cut: every argument that is a list as long as the
//! keys is cut alongside them, and of the answer the first 8-byte number is the batch
//! id, the list as long as the keys the pointers, texts must agree across parts (the
//! transfer-engine address) and other numbers take the smallest (the ttl: the earliest
//! any part's staging may be freed). A body of another shape is an error, and the call
//! then travels whole.
//!
//! Pure: bytes in, bytes out; no sockets, no clocks.

use std::ops::Range;

use bytes::{Bytes, BytesMut};
use thiserror::Error;

use crate::codec::error::DecodeError;
use crate::codec::generic::{GenericMessage, Ty, Value};
use crate::codec::pack::md5_32;

/// `mooncake::RealClient::batch_get_offload_object`, as the rank's client sends it
/// (0xdc8109d6, seen on the wire from 0.3.13.post1).
pub fn read_id() -> u32 {
    md5_32(b"mooncake::RealClient::batch_get_offload_object")
}

/// `mooncake::RealClient::release_offload_buffer` (0xaa143bb9).
pub fn release_id() -> u32 {
    md5_32(b"mooncake::RealClient::release_offload_buffer")
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ShapeError {
    #[error("{0}")]
    Decode(#[from] DecodeError),
    #[error("not the shape of an offload read: {0}")]
    Shape(&'static str),
    #[error("the parts' answers disagree: {0}")]
    Disagree(&'static str),
}

fn u64_of(v: &Value) -> Option<u64> {
    match v {
        Value::Scalar(b) if b.len() == 8 => {
            let mut a = [0u8; 8];
            a.copy_from_slice(b);
            Some(u64::from_le_bytes(a))
        }
        _ => None,
    }
}

fn is_u64_seq(ty: &Ty) -> bool {
    matches!(ty, Ty::Vec(t) if matches!(**t, Ty::Scalar { size: 8, .. }))
}

/// A decoded `batch_get_offload_object` call.
#[derive(Debug, Clone)]
pub struct ReadCall {
    msg: GenericMessage,
    keys: usize,
    /// Which argument holds the sizes.
    sizes_at: usize,
}

impl ReadCall {
    pub fn decode(body: &Bytes) -> Result<ReadCall, ShapeError> {
        let msg = GenericMessage::decode(body)?;
        let (Ty::Struct(tys), Value::Struct(args)) = (&msg.ty, &msg.value) else {
            return Err(ShapeError::Shape("arguments are not a tuple"));
        };
        let keys = match args.first() {
            Some(Value::Seq(k)) if k.iter().all(|v| matches!(v, Value::Str(_))) => k.len(),
            _ => return Err(ShapeError::Shape("first argument is not a list of keys")),
        };
        if keys == 0 {
            return Err(ShapeError::Shape("no keys"));
        }
        let sizes_at = tys
            .iter()
            .zip(args)
            .position(|(t, v)| is_u64_seq(t) && matches!(v, Value::Seq(s) if s.len() == keys))
            .ok_or(ShapeError::Shape("no list of sizes as long as the keys"))?;
        Ok(ReadCall {
            msg,
            keys,
            sizes_at,
        })
    }

    pub fn len(&self) -> usize {
        self.keys
    }

    pub fn is_empty(&self) -> bool {
        self.keys == 0
    }

    fn args(&self) -> &[Value] {
        match &self.msg.value {
            Value::Struct(a) => a,
            _ => &[],
        }
    }

    /// Each key's size in bytes (a negative size, which no client sends, counts 0).
    pub fn sizes(&self) -> Vec<u64> {
        match &self.args()[self.sizes_at] {
            Value::Seq(s) => s
                .iter()
                .map(|v| u64_of(v).filter(|&n| n < 1 << 63).unwrap_or(0))
                .collect(),
            _ => Vec::new(),
        }
    }

    /// The tenant-qualified key names, in call order.
    pub fn keys(&self) -> impl Iterator<Item = &[u8]> {
        let k: &[Value] = match self.args().first() {
            Some(Value::Seq(k)) => k,
            _ => &[],
        };
        k.iter().filter_map(|v| match v {
            Value::Str(s) => Some(&s[..]),
            _ => None,
        })
    }

    /// The body of a call for the keys in `range` only: every argument as long as the
    /// keys cut alike, the others as they came.
    pub fn part(&self, range: Range<usize>) -> Bytes {
        let n = self.keys;
        let args = self
            .args()
            .iter()
            .map(|a| match a {
                Value::Seq(s) if s.len() == n => Value::Seq(s[range.clone()].to_vec()),
                other => other.clone(),
            })
            .collect();
        let msg = GenericMessage {
            literal: self.msg.literal.clone(),
            ty: self.msg.ty.clone(),
            value: Value::Struct(args),
        };
        let mut out = BytesMut::new();
        msg.encode(&mut out);
        out.freeze()
    }
}

/// A decoded answer to a read call (or to one part of it).
#[derive(Debug, Clone)]
pub struct ReadAnswer {
    msg: GenericMessage,
}

/// Where the batch id and the pointers sit in a successful answer.
fn layout(fields: &[Value]) -> Option<(usize, usize)> {
    let id = fields.iter().position(|f| u64_of(f).is_some())?;
    let ptrs = fields
        .iter()
        .position(|f| matches!(f, Value::Seq(s) if s.iter().all(|p| u64_of(p).is_some())))?;
    Some((id, ptrs))
}

impl ReadAnswer {
    pub fn decode(body: &Bytes) -> Result<ReadAnswer, ShapeError> {
        let msg = GenericMessage::decode(body)?;
        match &msg.value {
            Value::Ok(v) => match &**v {
                Value::Struct(f) if layout(f).is_some() => {}
                _ => return Err(ShapeError::Shape("answer has no batch id and pointers")),
            },
            Value::Err(_) => {}
            _ => return Err(ShapeError::Shape("answer is not an expected value")),
        }
        Ok(ReadAnswer { msg })
    }

    fn fields(&self) -> Option<&[Value]> {
        match &self.msg.value {
            Value::Ok(v) => match &**v {
                Value::Struct(f) => Some(f),
                _ => None,
            },
            _ => None,
        }
    }

    /// The owner's batch id; `None` for an error answer.
    pub fn batch_id(&self) -> Option<u64> {
        let f = self.fields()?;
        let (id, _) = layout(f)?;
        u64_of(&f[id])
    }

    /// How many values the owner staged (pointers); 0 for an error answer.
    pub fn staged(&self) -> usize {
        self.fields()
            .and_then(|f| {
                let (_, p) = layout(f)?;
                match &f[p] {
                    Value::Seq(s) => Some(s.len()),
                    _ => None,
                }
            })
            .unwrap_or(0)
    }

    /// The smallest number after the id and pointers: the owner frees the staging this
    /// many milliseconds after answering, read or not (`None`: the answer names none).
    pub fn ttl_ms(&self) -> Option<u64> {
        let f = self.fields()?;
        let (id, p) = layout(f)?;
        f.iter()
            .enumerate()
            .filter(|&(i, _)| i != id && i != p)
            .filter_map(|(_, v)| u64_of(v))
            .min()
    }

    /// The parts' answers as one, under `batch_id`: pointers in part order; texts (the
    /// transfer-engine address) must be the same in every part; other numbers take the
    /// smallest. Every part must have succeeded.
    pub fn merge(parts: &[ReadAnswer], batch_id: u64) -> Result<Bytes, ShapeError> {
        let first = parts.first().ok_or(ShapeError::Shape("no parts"))?;
        let base = first.fields().ok_or(ShapeError::Shape("a part failed"))?;
        let (id, ptrs) = layout(base).ok_or(ShapeError::Shape("no layout"))?;
        let mut merged: Vec<Value> = base.to_vec();
        merged[id] = Value::Scalar(Bytes::copy_from_slice(&batch_id.to_le_bytes()));
        let mut pointers = Vec::new();
        for p in parts {
            let f = p.fields().ok_or(ShapeError::Shape("a part failed"))?;
            if f.len() != base.len() || layout(f) != Some((id, ptrs)) {
                return Err(ShapeError::Disagree("layout"));
            }
            for (i, v) in f.iter().enumerate() {
                if i == id {
                    continue;
                }
                if i == ptrs {
                    if let Value::Seq(s) = v {
                        pointers.extend(s.iter().cloned());
                    }
                    continue;
                }
                match (&merged[i], v) {
                    (a, b) if a == b => {}
                    (a, b) if u64_of(a).is_some() && u64_of(b).is_some() => {
                        if u64_of(b) < u64_of(a) {
                            merged[i] = b.clone();
                        }
                    }
                    _ => return Err(ShapeError::Disagree("a member other than a number")),
                }
            }
        }
        merged[ptrs] = Value::Seq(pointers);
        let msg = GenericMessage {
            literal: first.msg.literal.clone(),
            ty: first.msg.ty.clone(),
            value: Value::Ok(Box::new(Value::Struct(merged))),
        };
        let mut out = BytesMut::new();
        msg.encode(&mut out);
        Ok(out.freeze())
    }
}

/// A decoded `release_offload_buffer` call.
#[derive(Debug, Clone)]
pub struct Release {
    msg: GenericMessage,
}

impl Release {
    pub fn decode(body: &Bytes) -> Result<Release, ShapeError> {
        let msg = GenericMessage::decode(body)?;
        let r = Release { msg };
        r.batch_id()
            .ok_or(ShapeError::Shape("argument is not one batch id"))?;
        Ok(r)
    }

    fn id_value(v: &Value) -> Option<&Value> {
        match v {
            Value::Struct(f) if f.len() == 1 => Self::id_value(&f[0]),
            Value::Scalar(b) if b.len() == 8 => Some(v),
            _ => None,
        }
    }

    pub fn batch_id(&self) -> Option<u64> {
        Self::id_value(&self.msg.value).and_then(u64_of)
    }

    /// The same call naming `batch_id` instead.
    pub fn naming(&self, batch_id: u64) -> Bytes {
        fn swap(v: &Value, id: u64) -> Value {
            match v {
                Value::Struct(f) if f.len() == 1 => Value::Struct(vec![swap(&f[0], id)]),
                _ => Value::Scalar(Bytes::copy_from_slice(&id.to_le_bytes())),
            }
        }
        let msg = GenericMessage {
            literal: self.msg.literal.clone(),
            ty: self.msg.ty.clone(),
            value: swap(&self.msg.value, batch_id),
        };
        let mut out = BytesMut::new();
        msg.encode(&mut out);
        out.freeze()
    }
}

/// A release's answer: whether the owner freed the buffer (`None`: another shape).
pub fn released(body: &Bytes) -> Option<bool> {
    let msg = GenericMessage::decode(body).ok()?;
    match msg.value {
        Value::Bool(b) => Some(b),
        Value::Ok(v) => match *v {
            Value::Bool(b) => Some(b),
            _ => None,
        },
        _ => None,
    }
}

/// The body of a release of `batch_id`, as the rank's client writes it (for parts
/// moongate frees itself when a cut read fails).
pub fn release_call(batch_id: u64) -> Bytes {
    let msg = GenericMessage {
        literal: Bytes::from_static(&[0x04]),
        ty: Ty::Scalar {
            code: 0x04,
            size: 8,
        },
        value: Value::Scalar(Bytes::copy_from_slice(&batch_id.to_le_bytes())),
    };
    let mut out = BytesMut::new();
    msg.encode(&mut out);
    out.freeze()
}

/// The body of a release's answer saying `ok`, as the owner writes it.
pub fn release_answer(ok: bool) -> Bytes {
    let msg = GenericMessage {
        literal: Bytes::from_static(&[0x0b]),
        ty: Ty::Bool,
        value: Value::Bool(ok),
    };
    let mut out = BytesMut::new();
    msg.encode(&mut out);
    out.freeze()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn hex(s: &str) -> Bytes {
        Bytes::from(
            s.split_whitespace()
                .map(|b| u8::from_str_radix(b, 16).unwrap())
                .collect::<Vec<u8>>(),
        )
    }

    /// Bodies captured from 0.3.13.post1 (a requester-only rank reading `ot/blk/0009`
    /// from the owner's SSD, and releasing batch 1).
    pub(crate) fn read_body() -> Bytes {
        hex(
            "e7 a1 a6 81 04 fd 84 80 0c 84 03 ff 00 01 13 64 65 66 61 75 6c 74 00 6f 74 \
             2f 62 6c 6b 2f 30 30 30 39 01 00 00 10 00 00 00 00 00",
        )
    }
    pub(crate) fn answer_body() -> Bytes {
        hex(
            "b1 ac 03 fd 04 87 fd 04 84 04 80 0c 04 ff 01 00 01 01 00 00 00 00 00 00 00 \
             01 00 f0 ff 7f 28 7f 00 00 0f 31 32 37 2e 30 2e 30 2e 31 3a 31 34 32 34 37 \
             88 13 00 00 00 00 00 00",
        )
    }
    pub(crate) fn release_body() -> Bytes {
        hex("7b 7e 7f ec 04 04 00 01 00 00 00 00 00 00 00")
    }
    pub(crate) fn released_body() -> Bytes {
        hex("d9 ff c8 13 04 0b 00 01")
    }

    /// A call of `n` keys (`k0`, `k1`, ...) of `size` bytes, in the captured layout.
    pub(crate) fn call_of(n: usize, size: u64) -> Bytes {
        let one = ReadCall::decode(&read_body()).unwrap();
        let mut msg = one.msg.clone();
        msg.value = Value::Struct(vec![
            Value::Seq(
                (0..n)
                    .map(|i| Value::Str(Bytes::from(format!("default\0k{i}"))))
                    .collect(),
            ),
            Value::Seq(
                (0..n)
                    .map(|_| Value::Scalar(Bytes::copy_from_slice(&size.to_le_bytes())))
                    .collect(),
            ),
        ]);
        let mut out = BytesMut::new();
        msg.encode(&mut out);
        out.freeze()
    }

    /// An answer staging `n` values at `base`, `base + 1`, ... under `id`.
    pub(crate) fn answer_of(id: u64, n: usize, base: u64, ttl: u64) -> Bytes {
        let a = ReadAnswer::decode(&answer_body()).unwrap();
        let mut msg = a.msg.clone();
        let num = |v: u64| Value::Scalar(Bytes::copy_from_slice(&v.to_le_bytes()));
        msg.value = Value::Ok(Box::new(Value::Struct(vec![
            num(id),
            Value::Seq((0..n as u64).map(|i| num(base + i)).collect()),
            Value::Str(Bytes::from_static(b"127.0.0.1:14247")),
            num(ttl),
        ])));
        let mut out = BytesMut::new();
        msg.encode(&mut out);
        out.freeze()
    }

    #[test]
    fn ids_are_the_ones_on_the_wire() {
        assert_eq!(read_id(), 0xdc81_09d6);
        assert_eq!(release_id(), 0xaa14_3bb9);
    }

    #[test]
    fn the_captured_call_and_answers_read() {
        let c = ReadCall::decode(&read_body()).unwrap();
        assert_eq!(c.len(), 1);
        assert_eq!(c.sizes(), vec![1 << 20]);
        assert_eq!(c.keys().next(), Some(&b"default\0ot/blk/0009"[..]));
        // Cutting the whole call gives the bytes that came.
        assert_eq!(c.part(0..1), read_body());
        let a = ReadAnswer::decode(&answer_body()).unwrap();
        assert_eq!(a.batch_id(), Some(1));
        assert_eq!(a.staged(), 1);
        assert_eq!(a.ttl_ms(), Some(5000));
        assert_eq!(ReadAnswer::merge(&[a], 1).unwrap(), answer_body());
        let r = Release::decode(&release_body()).unwrap();
        assert_eq!(r.batch_id(), Some(1));
        assert_eq!(r.naming(1), release_body());
        assert_eq!(Release::decode(&r.naming(42)).unwrap().batch_id(), Some(42));
        assert_eq!(released(&released_body()), Some(true));
        assert_eq!(release_answer(true), released_body());
        assert_eq!(release_call(1), release_body());
        assert_eq!(released(&release_answer(false)), Some(false));
    }

    #[test]
    fn parts_cut_every_list_and_answers_merge_in_order() {
        let c = ReadCall::decode(&call_of(5, 100)).unwrap();
        let p = ReadCall::decode(&c.part(2..5)).unwrap();
        assert_eq!(p.len(), 3);
        assert_eq!(p.sizes(), vec![100; 3]);
        assert_eq!(
            p.keys().collect::<Vec<_>>(),
            vec![&b"default\0k2"[..], b"default\0k3", b"default\0k4"]
        );
        let a = ReadAnswer::decode(&answer_of(7, 2, 1000, 5000)).unwrap();
        let b = ReadAnswer::decode(&answer_of(8, 3, 2000, 4000)).unwrap();
        let m = ReadAnswer::decode(&ReadAnswer::merge(&[a, b], 1 << 63).unwrap()).unwrap();
        assert_eq!(m.batch_id(), Some(1 << 63));
        assert_eq!(m.staged(), 5);
        assert_eq!(m.ttl_ms(), Some(4000));
        let want = ReadAnswer::decode(&answer_of(1 << 63, 0, 0, 4000)).unwrap();
        // Pointers in part order.
        let ptrs = match m.fields().unwrap()[1].clone() {
            Value::Seq(s) => s.iter().filter_map(u64_of).collect::<Vec<_>>(),
            _ => Vec::new(),
        };
        assert_eq!(ptrs, vec![1000, 1001, 2000, 2001, 2002]);
        assert_eq!(want.fields().unwrap()[2], m.fields().unwrap()[2]);
    }

    #[test]
    fn bad_bodies_and_disagreeing_parts_are_errors() {
        for bad in [
            Bytes::new(),
            Bytes::from_static(b"\x01\x02\x03"),
            read_body().slice(..20),
            release_body(),
        ] {
            assert!(ReadCall::decode(&bad).is_err(), "{bad:02x?}");
        }
        assert!(ReadAnswer::decode(&read_body()).is_err());
        assert!(Release::decode(&read_body()).is_err());
        assert_eq!(released(&read_body()), None);
        let a = ReadAnswer::decode(&answer_of(7, 2, 1000, 5000)).unwrap();
        let mut other = ReadAnswer::decode(&answer_of(8, 1, 2000, 5000)).unwrap();
        if let Value::Ok(v) = &mut other.msg.value
            && let Value::Struct(f) = &mut **v
        {
            f[2] = Value::Str(Bytes::from_static(b"10.0.0.9:1"));
        }
        assert_eq!(
            ReadAnswer::merge(&[a, other], 9),
            Err(ShapeError::Disagree("a member other than a number"))
        );
        assert!(ReadAnswer::merge(&[], 9).is_err());
    }
}

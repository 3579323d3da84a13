//! A vector of keys (`std::vector<std::string>`) kept in the bytes it arrived in.
//!
//! The lookup and exist batches (`BatchExistKey`, `BatchGetReplicaList`) carry up to
//! hundreds of keys, and on the master face's usual path moongate reads one of them
//! (the first, to pick an arm) and relays the frame as it came. Decoding every key into
//! its own [`Bytes`] cost ~130 instructions per key (a refcount up and down, a push, a
//! `Result` per element): a third of a 64-key batch call. [`Keys`] checks the lengths
//! once at decode (so a malformed vector is refused as before) and keeps the vector's
//! bytes; keys are read out when a caller asks for them.
//!
//! This module knows no sockets, clocks or frames.

use std::fmt;
use std::ops::Range;

use bytes::Bytes;

use super::error::DecodeError;
use super::pack::{Pack, Reader, SizeWidth, Writer};

/// A list of keys: as received (a checked struct_pack vector, read on demand) or built
/// from [`Bytes`]. Equal when the keys are equal, however they are held.
#[derive(Clone, Default)]
pub struct Keys {
    repr: Repr,
}

#[derive(Clone)]
enum Repr {
    /// `n` keys, each a length prefix of `width` and its bytes, back to back in `buf`
    /// (every length checked at decode).
    Packed {
        buf: Bytes,
        n: usize,
        width: SizeWidth,
    },
    Owned(Vec<Bytes>),
    /// One key (a single-key call's), without a vector to allocate.
    One(Bytes),
}

impl Default for Repr {
    fn default() -> Self {
        Repr::Owned(Vec::new())
    }
}

impl Keys {
    /// A list of one key.
    pub fn one(key: Bytes) -> Self {
        Keys {
            repr: Repr::One(key),
        }
    }

    /// The keys when they are held as [`Bytes`] (built, not decoded).
    fn held(&self) -> &[Bytes] {
        match &self.repr {
            Repr::Owned(v) => v,
            Repr::One(k) => std::slice::from_ref(k),
            Repr::Packed { .. } => &[],
        }
    }

    pub fn len(&self) -> usize {
        match &self.repr {
            Repr::Packed { n, .. } => *n,
            _ => self.held().len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The keys, borrowed.
    pub fn iter(&self) -> Iter<'_> {
        match &self.repr {
            Repr::Packed { buf, n, width } => Iter(IterRepr::Packed {
                buf,
                pos: 0,
                left: *n,
                width: *width,
            }),
            _ => Iter(IterRepr::Slice(self.held().iter())),
        }
    }

    /// The keys as [`Bytes`] sharing this list's memory (no copy), for callers that keep
    /// them.
    pub fn iter_bytes(&self) -> IterBytes<'_> {
        match &self.repr {
            Repr::Packed { buf, .. } => IterBytes::Packed(buf, self.iter()),
            _ => IterBytes::Owned(self.held().iter()),
        }
    }

    pub fn first(&self) -> Option<&[u8]> {
        self.iter().next()
    }

    pub fn to_vec(&self) -> Vec<Bytes> {
        self.iter_bytes().collect()
    }

    /// The keys at indexes `r` (clamped to the list), sharing this list's memory.
    pub fn slice(&self, r: Range<usize>) -> Keys {
        let end = r.end.min(self.len());
        let start = r.start.min(end);
        match &self.repr {
            Repr::Packed { buf, width, .. } => {
                let mut it = self.iter();
                for _ in 0..start {
                    it.next();
                }
                let from = it.offset();
                for _ in start..end {
                    it.next();
                }
                Keys {
                    repr: Repr::Packed {
                        buf: buf.slice(from..it.offset()),
                        n: end - start,
                        width: *width,
                    },
                }
            }
            _ => Keys::from(self.held()[start..end].to_vec()),
        }
    }
}

impl From<Vec<Bytes>> for Keys {
    fn from(v: Vec<Bytes>) -> Self {
        Keys {
            repr: Repr::Owned(v),
        }
    }
}

impl FromIterator<Bytes> for Keys {
    fn from_iter<I: IntoIterator<Item = Bytes>>(iter: I) -> Self {
        Keys::from(iter.into_iter().collect::<Vec<_>>())
    }
}

impl<'a> IntoIterator for &'a Keys {
    type Item = &'a [u8];
    type IntoIter = Iter<'a>;
    fn into_iter(self) -> Iter<'a> {
        self.iter()
    }
}

impl PartialEq for Keys {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl Eq for Keys {}

impl fmt::Debug for Keys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter_bytes()).finish()
    }
}

/// The keys of a [`Keys`] as [`Bytes`]: see [`Keys::iter_bytes`].
pub enum IterBytes<'a> {
    Packed(&'a Bytes, Iter<'a>),
    Owned(std::slice::Iter<'a, Bytes>),
}

impl Iterator for IterBytes<'_> {
    type Item = Bytes;

    fn next(&mut self) -> Option<Bytes> {
        match self {
            IterBytes::Packed(buf, it) => it.next().map(|k| buf.slice_ref(k)),
            IterBytes::Owned(it) => it.next().cloned(),
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        match self {
            IterBytes::Packed(_, it) => it.size_hint(),
            IterBytes::Owned(it) => it.size_hint(),
        }
    }
}

impl ExactSizeIterator for IterBytes<'_> {}

/// Borrowed keys of a [`Keys`] (or of a slice of [`Bytes`], see [`Iter::of`]).
#[derive(Clone)]
pub struct Iter<'a>(IterRepr<'a>);

#[derive(Clone)]
enum IterRepr<'a> {
    Packed {
        buf: &'a [u8],
        pos: usize,
        left: usize,
        width: SizeWidth,
    },
    Slice(std::slice::Iter<'a, Bytes>),
}

impl<'a> Iter<'a> {
    /// Keys held as a slice (a single-key call's one key).
    pub fn of(keys: &'a [Bytes]) -> Self {
        Iter(IterRepr::Slice(keys.iter()))
    }

    /// Where the next key's length prefix starts in the packed bytes.
    fn offset(&self) -> usize {
        match &self.0 {
            IterRepr::Packed { pos, .. } => *pos,
            IterRepr::Slice(_) => 0,
        }
    }
}

impl<'a> Iterator for Iter<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        match &mut self.0 {
            IterRepr::Packed {
                buf,
                pos,
                left,
                width,
            } => {
                if *left == 0 {
                    return None;
                }
                let w = width.bytes();
                let head = buf.get(*pos..*pos + w)?;
                let mut le = [0u8; 8];
                le[..w].copy_from_slice(head);
                let len = usize::try_from(u64::from_le_bytes(le)).ok()?;
                let start = *pos + w;
                // Checked at decode; `get` keeps a broken invariant from panicking.
                let key = buf.get(start..start.checked_add(len)?)?;
                *pos = start + len;
                *left -= 1;
                Some(key)
            }
            IterRepr::Slice(it) => it.next().map(|b| b.as_ref()),
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = match &self.0 {
            IterRepr::Packed { left, .. } => *left,
            IterRepr::Slice(it) => it.len(),
        };
        (n, Some(n))
    }
}

impl ExactSizeIterator for Iter<'_> {}

impl Pack for Keys {
    fn write_literal(out: &mut Vec<u8>) {
        <Vec<Bytes> as Pack>::write_literal(out);
    }

    fn max_len(&self) -> usize {
        self.iter().fold(self.len(), |m, k| m.max(k.len()))
    }

    fn encode(&self, w: &mut Writer<'_>) {
        w.write_len(self.len());
        match &self.repr {
            // The same width as the message being written: the bytes as they came.
            Repr::Packed { buf, width, .. } if *width == w.width() => w.bytes(buf),
            _ => {
                for k in self.iter() {
                    w.write_len(k.len());
                    w.bytes(k);
                }
            }
        }
    }

    fn decode(r: &mut Reader) -> Result<Self, DecodeError> {
        let n = r.read_len()?;
        let start = r.position();
        let width = r.width();
        let rest = r.rest();
        let scanned = match width {
            SizeWidth::W1 => scan1(rest, n),
            SizeWidth::W2 => scan::<2>(rest, n),
            SizeWidth::W4 => scan::<4>(rest, n),
            SizeWidth::W8 => scan::<8>(rest, n),
        };
        match scanned {
            Some(len) => {
                r.take(len)?;
            }
            // Walked again by the reader, which says what is wrong and where.
            None => {
                for _ in 0..n {
                    let len = r.read_len()?;
                    r.take(len)?;
                }
            }
        }
        Ok(Keys {
            repr: Repr::Packed {
                buf: r.slice_from(start),
                n,
                width,
            },
        })
    }
}

/// [`scan`] for one-byte lengths, the usual width (keys under 256 bytes, batches under
/// 256 keys): a step reads one byte and cannot overflow, so the bound is checked once
/// a key instead of the generic loop's three.
#[inline]
fn scan1(s: &[u8], n: usize) -> Option<usize> {
    let mut pos = 0usize;
    for _ in 0..n {
        pos += 1 + usize::from(*s.get(pos)?);
    }
    (pos <= s.len()).then_some(pos)
}

/// The length of `n` keys with `W`-byte length prefixes at the start of `s`, or `None`
/// when they do not fit in it. One tight loop per width: this runs for every key of
/// every batch lookup.
#[inline]
fn scan<const W: usize>(s: &[u8], n: usize) -> Option<usize> {
    let mut pos = 0usize;
    for _ in 0..n {
        let head: [u8; W] = s.get(pos..pos + W)?.try_into().ok()?;
        let mut le = [0u8; 8];
        le[..W].copy_from_slice(&head);
        let len = usize::try_from(u64::from_le_bytes(le)).ok()?;
        pos = (pos + W).checked_add(len)?;
        if pos > s.len() {
            return None;
        }
    }
    Some(pos)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::pack::{BodyStyle, RootSchema, decode_message, encode_message};

    fn k(s: &str) -> Bytes {
        Bytes::copy_from_slice(s.as_bytes())
    }

    fn style() -> BodyStyle {
        BodyStyle::MOONCAKE
    }

    fn keys(n: usize, len: usize) -> Vec<Bytes> {
        (0..n).map(|i| Bytes::from(format!("{i:0len$}"))).collect()
    }

    /// Encodes `v` as a `Vec<Bytes>` message and decodes it as [`Keys`].
    fn packed(v: &[Bytes]) -> (Keys, Bytes) {
        let mut out = bytes::BytesMut::new();
        encode_message(
            &v.to_vec(),
            &RootSchema::of::<Vec<Bytes>>(),
            style(),
            &mut out,
        );
        let body = out.freeze();
        let (got, _): (Keys, _) = decode_message(&body, &RootSchema::of::<Keys>()).unwrap();
        (got, body)
    }

    #[test]
    fn packed_keys_read_back_in_every_size_width() {
        // W1, W2 (a 300-byte key), W4 (a 70,000-byte key).
        for v in [
            keys(5, 3),
            keys(300, 4),
            vec![k("a"), Bytes::from(vec![7u8; 300])],
            vec![Bytes::from(vec![1u8; 70_000]), k("z")],
        ] {
            let (got, _) = packed(&v);
            assert_eq!(got.len(), v.len());
            assert_eq!(got.to_vec(), v);
            assert_eq!(got, Keys::from(v.clone()));
            assert_eq!(got.first(), v.first().map(|b| b.as_ref()));
            assert_eq!(got.iter().len(), v.len());
        }
    }

    #[test]
    fn an_unchanged_list_encodes_to_the_bytes_it_came_in() {
        let v = keys(64, 10);
        let (got, body) = packed(&v);
        let mut out = bytes::BytesMut::new();
        encode_message(&got, &RootSchema::of::<Keys>(), style(), &mut out);
        assert_eq!(out.freeze(), body);
        // And as a list built from Bytes.
        let mut out = bytes::BytesMut::new();
        encode_message(&Keys::from(v), &RootSchema::of::<Keys>(), style(), &mut out);
        assert_eq!(out.freeze(), body);
    }

    #[test]
    fn a_slice_shares_the_bytes_and_reencodes_in_another_width() {
        let mut v = keys(10, 3);
        v[7] = Bytes::from(vec![9u8; 400]);
        let (got, _) = packed(&v);
        for (a, b) in [(0, 3), (2, 7), (7, 10), (4, 4), (8, 99), (12, 20)] {
            let s = got.slice(a..b);
            let want: Vec<Bytes> = v[a.min(10)..b.min(10)].to_vec();
            assert_eq!(s.to_vec(), want, "{a}..{b}");
            // The part without the long key is written in one-byte widths.
            let mut out = bytes::BytesMut::new();
            encode_message(&s, &RootSchema::of::<Keys>(), style(), &mut out);
            let (back, _): (Vec<Bytes>, _) =
                decode_message(&out.freeze(), &RootSchema::of::<Vec<Bytes>>()).unwrap();
            assert_eq!(back, want);
        }
        assert_eq!(Keys::from(v.clone()).slice(2..5).to_vec(), v[2..5].to_vec());
        let one = Keys::one(k("x"));
        assert_eq!((one.len(), one.first()), (1, Some(&b"x"[..])));
        assert_eq!(one, Keys::from(vec![k("x")]));
        assert_eq!(one.slice(0..1).to_vec(), vec![k("x")]);
        assert!(one.slice(1..1).is_empty());
    }

    #[test]
    fn malformed_lists_are_refused_at_decode() {
        let (_, body) = packed(&keys(4, 3));
        // Every truncation, and a key length past the end.
        for cut in 5..body.len() {
            let r = decode_message::<Keys>(&body.slice(..cut), &RootSchema::of::<Keys>());
            assert!(r.is_err(), "cut at {cut}");
        }
        // The one-byte scan agrees with the generic one on every one-byte change.
        let list: Vec<u8> = (0..6u8)
            .flat_map(|i| [i, b'k', b'e', b'y', b's', b'!'])
            .collect();
        for i in 0..list.len() {
            for v in [0u8, 1, 5, 6, 7, 0xff] {
                let mut m = list.clone();
                m[i] = v;
                for n in [0, 1, 5, 6, 7, 300] {
                    assert_eq!(scan1(&m, n), scan::<1>(&m, n), "byte {i} = {v}, {n} keys");
                }
            }
        }
        let mut bad = body.to_vec();
        let first_len = bad.len() - 4 * 4;
        bad[first_len] = 200;
        assert!(decode_message::<Keys>(&Bytes::from(bad), &RootSchema::of::<Keys>()).is_err());
    }
}

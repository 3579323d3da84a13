//! Access records between fleet members: what one member's master face saw about keys
//! another member keeps (their *home*), so that every key's table entry, recency and
//! leases reflect the whole fleet's traffic and its evictor picks victims by fleet-wide
//! recency.
//!
//! - [`Ring`]: which member is a key's home: consistent hashing of `(tenant, key)` over
//!   the members that take records (64 points each, XXH3-64: any member, any release,
//!   computes the same home). A join or a leave moves about 1/N of the keys.
//! - [`Record`] and [`encode`]/[`decode`]: one batch of records, as it travels in the
//!   body of `POST /fleet/records` (a compact binary form, below).
//! - [`split`]: the part of a [`Seen`] this member keeps and the parts for each home.
//!
//! Pure: no sockets, no clocks (ages travel as durations, each side on its own clock).
//!
//! Batch layout (all integers little-endian): `b"MGR1"`, then records until the end:
//! `kind u8`, `tenant` (u16 length + bytes), `client` (two u64), `arm u8`, `count u32`,
//! then `count` items whose fields depend on the kind (keys: u16 length + bytes; tier:
//! u8, 0xff for none). Every length is checked against what remains: a short, long or
//! unknown input is an error for that batch, never a panic.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use thiserror::Error;

use crate::calls::Seen;
use crate::codec::types::{Tier, Uuid};
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

const MAGIC: &[u8; 4] = b"MGR1";
/// Ring points per member: enough for an even spread of keys over a few members
/// (measured in the tests: within ±25 % of 1/N for 8 members).
const POINTS: u32 = 64;
/// At most this many items per record (a batch is bounded by its body limit anyway).
const MAX_ITEMS: u32 = 1 << 20;

pub use crate::keys::table::Adopted;

/// What one record says: a [`Seen`] from another member's master face, an owner's
/// offload notice, or entries handed over on a change of membership.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum What {
    Seen(Seen),
    /// Keys an owner wrote to its SSD (NotifyOffloadSuccess).
    Offloaded(Vec<Bytes>),
    Adopt(Vec<Adopted>),
}

/// One record: under which tenant, from which client, served by which experiment arm
/// (by index: every member runs the same arms).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub tenant: Bytes,
    pub client: Uuid,
    pub arm: u8,
    pub what: What,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum RecordError {
    #[error("not a record batch (no MGR1 header)")]
    Magic,
    #[error("record {0}: truncated")]
    Short(usize),
    #[error("record {0}: unknown kind {1}")]
    Kind(usize, u8),
    #[error("record {0}: unknown tier {1}")]
    Tier(usize, u8),
    #[error("record {0}: {1} items, more than {MAX_ITEMS}")]
    TooMany(usize, u32),
    #[error("record {0}: a key or tenant longer than 65535 bytes")]
    Long(usize),
}

const K_STORED: u8 = 1;
const K_PLACED: u8 = 2;
const K_COMPLETED: u8 = 3;
const K_FOUND: u8 = 4;
const K_MISSED: u8 = 5;
const K_REMOVED: u8 = 6;
const K_CLEARED: u8 = 7;
const K_OFFLOADED: u8 = 8;
const K_ADOPT: u8 = 9;
const NO_TIER: u8 = 0xff;

fn tier_code(t: Tier) -> u8 {
    match t {
        Tier::Memory => 0,
        Tier::Nof => 1,
        Tier::Disk => 2,
        Tier::LocalDisk => 3,
        Tier::Dfs => 4,
    }
}

fn tier_of(c: u8) -> Option<Tier> {
    Some(match c {
        0 => Tier::Memory,
        1 => Tier::Nof,
        2 => Tier::Disk,
        3 => Tier::LocalDisk,
        4 => Tier::Dfs,
        _ => return None,
    })
}

/// An empty batch, ready for [`encode`].
pub fn batch() -> BytesMut {
    let mut b = BytesMut::with_capacity(4096);
    b.put_slice(MAGIC);
    b
}

/// Whether `b` holds nothing but the header.
pub fn is_empty(b: &[u8]) -> bool {
    b.len() <= MAGIC.len()
}

fn put_str(out: &mut BytesMut, s: &[u8]) -> Result<(), RecordError> {
    let n = u16::try_from(s.len()).map_err(|_| RecordError::Long(0))?;
    out.put_u16_le(n);
    out.put_slice(s);
    Ok(())
}

fn put_uuid(out: &mut BytesMut, u: Uuid) {
    out.put_u64_le(u.first);
    out.put_u64_le(u.second);
}

/// Appends one record to a batch. A tenant or key over 65,535 bytes (Mooncake's own
/// keys are far shorter) is refused, and nothing of the record is written.
pub fn encode(out: &mut BytesMut, r: &Record) -> Result<(), RecordError> {
    let mark = out.len();
    let res = encode_inner(out, r);
    if res.is_err() {
        out.truncate(mark);
    }
    res
}

fn encode_inner(out: &mut BytesMut, r: &Record) -> Result<(), RecordError> {
    let (kind, count) = match &r.what {
        What::Seen(s) => match s {
            Seen::Stored(v) => (K_STORED, v.len()),
            Seen::Placed(v) => (K_PLACED, v.len()),
            Seen::Completed(v) => (K_COMPLETED, v.len()),
            Seen::Found(v) => (K_FOUND, v.len()),
            Seen::Missed(v) => (K_MISSED, v.len()),
            Seen::Removed(v) => (K_REMOVED, v.len()),
            Seen::Cleared => (K_CLEARED, 0),
            // Denials stay with the member that saw them (its own trigger).
            Seen::Denied(_) => return Ok(()),
        },
        What::Offloaded(v) => (K_OFFLOADED, v.len()),
        What::Adopt(v) => (K_ADOPT, v.len()),
    };
    out.put_u8(kind);
    put_str(out, &r.tenant)?;
    put_uuid(out, r.client);
    out.put_u8(r.arm);
    out.put_u32_le(count as u32);
    match &r.what {
        What::Seen(Seen::Stored(v)) => {
            for (k, size, tier) in v {
                put_str(out, k)?;
                out.put_u64_le(*size);
                out.put_u8(tier_code(*tier));
            }
        }
        What::Seen(Seen::Placed(v)) => {
            for (k, seg) in v {
                put_str(out, k)?;
                put_str(out, seg)?;
            }
        }
        What::Seen(Seen::Found(v)) => {
            for (k, tier) in v {
                put_str(out, k)?;
                out.put_u8(tier.map_or(NO_TIER, tier_code));
            }
        }
        What::Seen(Seen::Completed(v) | Seen::Missed(v) | Seen::Removed(v))
        | What::Offloaded(v) => {
            for k in v {
                put_str(out, k)?;
            }
        }
        What::Seen(Seen::Cleared | Seen::Denied(_)) => {}
        What::Adopt(v) => {
            for a in v {
                put_str(out, &a.key)?;
                put_uuid(out, a.client);
                out.put_u8(a.arm);
                out.put_u64_le(a.size);
                out.put_u8(tier_code(a.tier));
                out.put_u64_le(a.age_ms);
                out.put_u32_le(a.hits);
                out.put_u64_le(a.lease_left_ms);
                out.put_u8(u8::from(a.complete) | (u8::from(a.on_disk) << 1));
                put_str(out, &a.segment)?;
                out.put_u8(a.tries);
            }
        }
    }
    Ok(())
}

/// A reader that turns every shortfall into [`RecordError::Short`] for record `i`.
struct Reader {
    b: Bytes,
    i: usize,
}

impl Reader {
    fn need(&self, n: usize) -> Result<(), RecordError> {
        if self.b.remaining() < n {
            Err(RecordError::Short(self.i))
        } else {
            Ok(())
        }
    }
    fn u8(&mut self) -> Result<u8, RecordError> {
        self.need(1)?;
        Ok(self.b.get_u8())
    }
    fn u32(&mut self) -> Result<u32, RecordError> {
        self.need(4)?;
        Ok(self.b.get_u32_le())
    }
    fn u64(&mut self) -> Result<u64, RecordError> {
        self.need(8)?;
        Ok(self.b.get_u64_le())
    }
    fn uuid(&mut self) -> Result<Uuid, RecordError> {
        Ok(Uuid {
            first: self.u64()?,
            second: self.u64()?,
        })
    }
    fn str(&mut self) -> Result<Bytes, RecordError> {
        self.need(2)?;
        let n = self.b.get_u16_le() as usize;
        self.need(n)?;
        Ok(self.b.split_to(n))
    }
    fn tier(&mut self) -> Result<Tier, RecordError> {
        let c = self.u8()?;
        tier_of(c).ok_or(RecordError::Tier(self.i, c))
    }
    fn items<T>(
        &mut self,
        n: u32,
        mut one: impl FnMut(&mut Self) -> Result<T, RecordError>,
    ) -> Result<Vec<T>, RecordError> {
        // Every item takes at least two bytes: a count beyond that is a lie, and is not
        // allowed to reserve memory.
        let mut v = Vec::with_capacity((n as usize).min(self.b.remaining() / 2));
        for _ in 0..n {
            v.push(one(self)?);
        }
        Ok(v)
    }
}

/// Reads a whole batch (the body of one `POST /fleet/records`).
pub fn decode(body: Bytes) -> Result<Vec<Record>, RecordError> {
    if body.len() < MAGIC.len() || &body[..MAGIC.len()] != MAGIC {
        return Err(RecordError::Magic);
    }
    let mut r = Reader {
        b: body.slice(MAGIC.len()..),
        i: 0,
    };
    let mut out = Vec::new();
    while r.b.has_remaining() {
        let kind = r.u8()?;
        if !(K_STORED..=K_ADOPT).contains(&kind) {
            return Err(RecordError::Kind(r.i, kind));
        }
        let tenant = r.str()?;
        let client = r.uuid()?;
        let arm = r.u8()?;
        let n = r.u32()?;
        if n > MAX_ITEMS {
            return Err(RecordError::TooMany(r.i, n));
        }
        let what = match kind {
            K_STORED => What::Seen(Seen::Stored(
                r.items(n, |r| Ok((r.str()?, r.u64()?, r.tier()?)))?,
            )),
            K_PLACED => What::Seen(Seen::Placed(r.items(n, |r| Ok((r.str()?, r.str()?)))?)),
            K_COMPLETED => What::Seen(Seen::Completed(r.items(n, Reader::str)?)),
            K_FOUND => What::Seen(Seen::Found(r.items(n, |r| {
                let k = r.str()?;
                let c = r.u8()?;
                let tier = match c {
                    NO_TIER => None,
                    c => Some(tier_of(c).ok_or(RecordError::Tier(r.i, c))?),
                };
                Ok((k, tier))
            })?)),
            K_MISSED => What::Seen(Seen::Missed(r.items(n, Reader::str)?)),
            K_REMOVED => What::Seen(Seen::Removed(r.items(n, Reader::str)?)),
            K_CLEARED => What::Seen(Seen::Cleared),
            K_OFFLOADED => What::Offloaded(r.items(n, Reader::str)?),
            K_ADOPT => What::Adopt(r.items(n, |r| {
                let key = r.str()?;
                let client = r.uuid()?;
                let arm = r.u8()?;
                let size = r.u64()?;
                let tier = r.tier()?;
                let age_ms = r.u64()?;
                let hits = r.u32()?;
                let lease_left_ms = r.u64()?;
                let flags = r.u8()?;
                let segment = r.str()?;
                let tries = r.u8()?;
                Ok(Adopted {
                    key,
                    client,
                    arm,
                    size,
                    tier,
                    age_ms,
                    hits,
                    lease_left_ms,
                    complete: flags & 1 != 0,
                    on_disk: flags & 2 != 0,
                    segment,
                    tries,
                })
            })?),
            k => return Err(RecordError::Kind(r.i, k)),
        };
        out.push(Record {
            tenant,
            client,
            arm,
            what,
        });
        r.i += 1;
    }
    Ok(out)
}

/// The members that take records, placed on a hash ring.
#[derive(Debug, Clone, Default)]
pub struct Ring {
    /// Member names (index = what [`Ring::home`] returns).
    pub members: Vec<String>,
    points: Vec<(u64, u32)>,
}

impl Ring {
    /// The ring of `members` (their order does not matter: every member builds the same
    /// ring from the same names).
    pub fn new(mut members: Vec<String>) -> Ring {
        members.sort();
        members.dedup();
        let mut points = Vec::with_capacity(members.len() * POINTS as usize);
        for (i, m) in members.iter().enumerate() {
            let mut buf = Vec::with_capacity(m.len() + 5);
            for p in 0..POINTS {
                buf.clear();
                buf.extend_from_slice(m.as_bytes());
                buf.push(b'#');
                buf.extend_from_slice(&p.to_le_bytes());
                points.push((xxh3_64(&buf), i as u32));
            }
        }
        points.sort_unstable();
        Ring { members, points }
    }

    /// The index of `(tenant, key)`'s home; `None` on an empty ring.
    pub fn home(&self, tenant: &[u8], key: &[u8]) -> Option<usize> {
        if self.points.is_empty() {
            return None;
        }
        // The tenant's hash seeds the key's: ("ab", "c") and ("a", "bc") differ.
        let h = xxh3_64_with_seed(key, xxh3_64(tenant));
        let i = self.points.partition_point(|&(p, _)| p < h);
        let (_, m) = self.points[if i == self.points.len() { 0 } else { i }];
        Some(m as usize)
    }
}

/// Splits `seen` by the home of each key: what stays here (`home(key) == None`) and
/// what goes to each other home (by ring index). `Cleared` names no key: it stays here
/// and the caller sends it to every member.
pub fn split(
    seen: Seen,
    mut home: impl FnMut(&Bytes) -> Option<usize>,
) -> (Option<Seen>, Vec<(usize, Seen)>) {
    fn by<T>(
        v: Vec<T>,
        key: impl Fn(&T) -> &Bytes,
        home: &mut impl FnMut(&Bytes) -> Option<usize>,
        make: impl Fn(Vec<T>) -> Seen,
    ) -> (Option<Seen>, Vec<(usize, Seen)>) {
        let mut mine = Vec::new();
        let mut theirs: Vec<(usize, Vec<T>)> = Vec::new();
        for item in v {
            match home(key(&item)) {
                None => mine.push(item),
                Some(h) => match theirs.iter_mut().find(|(m, _)| *m == h) {
                    Some((_, v)) => v.push(item),
                    None => theirs.push((h, vec![item])),
                },
            }
        }
        (
            (!mine.is_empty()).then(|| make(mine)),
            theirs.into_iter().map(|(h, v)| (h, make(v))).collect(),
        )
    }
    match seen {
        Seen::Stored(v) => by(v, |i| &i.0, &mut home, Seen::Stored),
        Seen::Placed(v) => by(v, |i| &i.0, &mut home, Seen::Placed),
        Seen::Completed(v) => by(v, |k| k, &mut home, Seen::Completed),
        Seen::Found(v) => by(v, |i| &i.0, &mut home, Seen::Found),
        Seen::Missed(v) => by(v, |k| k, &mut home, Seen::Missed),
        Seen::Removed(v) => by(v, |k| k, &mut home, Seen::Removed),
        s @ (Seen::Cleared | Seen::Denied(_)) => (Some(s), Vec::new()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(s: &str) -> Bytes {
        Bytes::copy_from_slice(s.as_bytes())
    }

    fn sample() -> Vec<Record> {
        let rec = |what| Record {
            tenant: b("default"),
            client: Uuid {
                first: 7,
                second: 9,
            },
            arm: 1,
            what,
        };
        vec![
            rec(What::Seen(Seen::Stored(vec![(
                b("k1"),
                65536,
                Tier::Memory,
            )]))),
            rec(What::Seen(Seen::Placed(vec![(
                b("k1"),
                b("127.0.0.1:1234"),
            )]))),
            rec(What::Seen(Seen::Completed(vec![b("k1"), b("k2")]))),
            rec(What::Seen(Seen::Found(vec![
                (b("k1"), None),
                (b("k2"), Some(Tier::LocalDisk)),
            ]))),
            rec(What::Seen(Seen::Missed(vec![b("k3")]))),
            rec(What::Seen(Seen::Removed(vec![b("k2")]))),
            rec(What::Seen(Seen::Cleared)),
            rec(What::Offloaded(vec![b("k1")])),
            rec(What::Adopt(vec![Adopted {
                key: b("k1"),
                client: Uuid {
                    first: 1,
                    second: 2,
                },
                arm: 1,
                size: 1 << 20,
                tier: Tier::Memory,
                age_ms: 1500,
                hits: 3,
                lease_left_ms: 200,
                complete: true,
                on_disk: false,
                segment: b("127.0.0.1:1234"),
                tries: 1,
            }])),
        ]
    }

    #[test]
    fn a_batch_reads_back_as_written() {
        let mut out = batch();
        for r in sample() {
            encode(&mut out, &r).unwrap();
        }
        assert_eq!(decode(out.freeze()).unwrap(), sample());
        assert_eq!(decode(batch().freeze()).unwrap(), vec![]);
    }

    #[test]
    fn bad_batches_are_errors_not_panics() {
        let mut out = batch();
        for r in sample() {
            encode(&mut out, &r).unwrap();
        }
        let whole = out.freeze();
        // Every truncation is an error (or, at a record's end, fewer records).
        for n in 0..whole.len() {
            match decode(whole.slice(..n)) {
                Ok(rs) => assert!(rs.len() < sample().len()),
                Err(e) => assert!(
                    matches!(e, RecordError::Short(_) | RecordError::Magic),
                    "{n}: {e}"
                ),
            }
        }
        assert_eq!(decode(b("nope")), Err(RecordError::Magic));
        let mut bad = batch();
        bad.put_slice(&[42, 0, 0]);
        assert_eq!(decode(bad.freeze()), Err(RecordError::Kind(0, 42)));
        // A count that claims four billion items reserves nothing and fails.
        let mut lie = batch();
        lie.put_u8(K_MISSED);
        lie.put_u16_le(0);
        lie.put_slice(&[0; 17]);
        lie.put_u32_le(MAX_ITEMS);
        assert_eq!(decode(lie.freeze()), Err(RecordError::Short(0)));
        let mut many = batch();
        many.put_u8(K_MISSED);
        many.put_u16_le(0);
        many.put_slice(&[0; 17]);
        many.put_u32_le(u32::MAX);
        assert!(matches!(
            decode(many.freeze()),
            Err(RecordError::TooMany(0, _))
        ));
        // A key too long to encode leaves the batch as it was.
        let mut out = batch();
        let long = Record {
            tenant: b("t"),
            client: Uuid::default(),
            arm: 0,
            what: What::Seen(Seen::Missed(vec![Bytes::from(vec![b'x'; 70_000])])),
        };
        assert!(encode(&mut out, &long).is_err());
        assert!(is_empty(&out));
    }

    #[test]
    fn every_member_computes_the_same_home_and_keys_spread_evenly() {
        let names: Vec<String> = (0..8).map(|i| format!("rank-{i}")).collect();
        let mut shuffled = names.clone();
        shuffled.reverse();
        let (a, b2) = (Ring::new(names.clone()), Ring::new(shuffled));
        let mut counts = [0usize; 8];
        for i in 0..40_000 {
            let k = format!("model@tp_rank:0@{i:x}");
            let h = a.home(b"default", k.as_bytes()).unwrap();
            assert_eq!(Some(h), b2.home(b"default", k.as_bytes()));
            counts[h] += 1;
        }
        for c in counts {
            assert!(
                (3_750..=6_250).contains(&c),
                "within ±25 % of 5,000: {counts:?}"
            );
        }
        // A member leaving moves only its own keys.
        let fewer = Ring::new(names[1..].to_vec());
        for i in 0..5_000 {
            let k = format!("k{i}");
            let before = &a.members[a.home(b"t", k.as_bytes()).unwrap()];
            let after = &fewer.members[fewer.home(b"t", k.as_bytes()).unwrap()];
            if before != "rank-0" {
                assert_eq!(before, after);
            }
        }
        assert_eq!(Ring::default().home(b"t", b"k"), None);
    }

    #[test]
    fn a_seen_splits_by_home_and_keeps_order() {
        let seen = Seen::Found(vec![
            (b("a1"), None),
            (b("b1"), None),
            (b("a2"), None),
            (b("c1"), None),
        ]);
        let home = |k: &Bytes| match k[0] {
            b'a' => None,
            b'b' => Some(1),
            _ => Some(2),
        };
        let (mine, theirs) = split(seen, home);
        assert_eq!(
            mine,
            Some(Seen::Found(vec![(b("a1"), None), (b("a2"), None)]))
        );
        assert_eq!(
            theirs,
            vec![
                (1, Seen::Found(vec![(b("b1"), None)])),
                (2, Seen::Found(vec![(b("c1"), None)]))
            ]
        );
        let (mine, theirs) = split(Seen::Cleared, |_| Some(1));
        assert_eq!((mine, theirs.len()), (Some(Seen::Cleared), 0));
    }
}

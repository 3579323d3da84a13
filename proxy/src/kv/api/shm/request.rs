//! A shared-memory request frame's body, decoded: every field read, every count and key
//! length checked against the limits, nothing left over. Pure: no socket, no
//! registration, no store; what a request does is the connection's (`super`). The fuzz
//! target `shm_request` drives [`decode`] with any bytes.

use moongate_kv::shm::wire::*;

use super::Fail;
use super::frames::Fields;

/// The limits a body is decoded under (`kv.max_batch_keys`, `kv.max_key_bytes`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    pub max_batch_keys: usize,
    pub max_key_bytes: usize,
}

/// One item of a batch frame: its key and its range in the region (unchecked against
/// the region, which the decoder does not know).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Item<'a> {
    pub key: &'a [u8],
    pub off: u64,
    pub len: u64,
}

/// A request, as its op and body say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Request<'a> {
    /// `u64 len` (one fd attached).
    Register {
        len: u64,
    },
    Release {
        region: u32,
    },
    GetInto {
        region: u32,
        off: u64,
        cap: u64,
        key: &'a [u8],
    },
    PutFrom {
        region: u32,
        off: u64,
        len: u64,
        key: &'a [u8],
    },
    BatchGetInto {
        region: u32,
        items: Vec<Item<'a>>,
    },
    BatchPutFrom {
        region: u32,
        items: Vec<Item<'a>>,
    },
    Hello {
        token: u64,
    },
    Segments,
    View {
        keys: Vec<&'a [u8]>,
    },
    ReleaseView {
        lease: u64,
    },
    /// `(key, len)` per reservation.
    Reserve {
        items: Vec<(&'a [u8], u64)>,
    },
    Commit {
        tickets: Vec<u64>,
    },
    Abort {
        tickets: Vec<u64>,
    },
}

/// Decodes the body of a frame of `op`.
pub(super) fn decode<'a>(op: u8, body: &'a [u8], limits: &Limits) -> Result<Request<'a>, Fail> {
    let mut f = Fields(body);
    let f = &mut f;
    let key = |k: &'a [u8]| -> Result<&'a [u8], Fail> {
        if k.is_empty() || k.len() > limits.max_key_bytes {
            return Err(Fail::arg(format!(
                "a key of {} bytes (1 to kv.max_key_bytes = {})",
                k.len(),
                limits.max_key_bytes
            )));
        }
        Ok(k)
    };
    let count = |f: &mut Fields<'a>| -> Result<usize, Fail> {
        let n = f.u32()? as usize;
        if n > limits.max_batch_keys {
            return Err(Fail::arg(format!(
                "{n} items (kv.max_batch_keys = {})",
                limits.max_batch_keys
            )));
        }
        Ok(n)
    };
    let ended = |f: &Fields<'a>| -> Result<(), Fail> {
        if f.0.is_empty() {
            Ok(())
        } else {
            Err(Fail::arg("bytes after the last item"))
        }
    };
    // A batch: `u32 region, u32 n, n x (u64 offset, u64 len, u16 key_len, key)`.
    let batch = |f: &mut Fields<'a>| -> Result<(u32, Vec<Item<'a>>), Fail> {
        let region = f.u32()?;
        let n = count(f)?;
        let mut items = Vec::with_capacity(n);
        for _ in 0..n {
            let (off, len) = (f.u64()?, f.u64()?);
            let klen = f.u16()? as usize;
            items.push(Item {
                key: key(f.bytes(klen)?)?,
                off,
                len,
            });
        }
        ended(f)?;
        Ok((region, items))
    };
    let tickets = |f: &mut Fields<'a>| -> Result<Vec<u64>, Fail> {
        let n = count(f)?;
        let mut t = Vec::with_capacity(n);
        for _ in 0..n {
            t.push(f.u64()?);
        }
        ended(f)?;
        Ok(t)
    };
    Ok(match op {
        OP_REGISTER => Request::Register { len: f.u64()? },
        OP_RELEASE => Request::Release { region: f.u32()? },
        OP_GET_INTO => {
            let (region, off, cap) = (f.u32()?, f.u64()?, f.u64()?);
            Request::GetInto {
                region,
                off,
                cap,
                key: key(f.0)?,
            }
        }
        OP_PUT_FROM => {
            let (region, off, len) = (f.u32()?, f.u64()?, f.u64()?);
            Request::PutFrom {
                region,
                off,
                len,
                key: key(f.0)?,
            }
        }
        OP_BATCH_GET_INTO => {
            let (region, items) = batch(f)?;
            Request::BatchGetInto { region, items }
        }
        OP_BATCH_PUT_FROM => {
            let (region, items) = batch(f)?;
            Request::BatchPutFrom { region, items }
        }
        OP_HELLO => Request::Hello { token: f.u64()? },
        OP_SEGMENTS => Request::Segments,
        OP_VIEW => {
            let n = count(f)?;
            let mut keys = Vec::with_capacity(n);
            for _ in 0..n {
                let klen = f.u16()? as usize;
                keys.push(key(f.bytes(klen)?)?);
            }
            ended(f)?;
            Request::View { keys }
        }
        OP_RELEASE_VIEW => {
            let lease = f.u64()?;
            ended(f)?;
            Request::ReleaseView { lease }
        }
        OP_RESERVE => {
            let n = count(f)?;
            let mut items = Vec::with_capacity(n);
            for _ in 0..n {
                let len = f.u64()?;
                let klen = f.u16()? as usize;
                items.push((key(f.bytes(klen)?)?, len));
            }
            ended(f)?;
            Request::Reserve { items }
        }
        OP_COMMIT => Request::Commit {
            tickets: tickets(f)?,
        },
        OP_ABORT => Request::Abort {
            tickets: tickets(f)?,
        },
        other => return Err(Fail::arg(format!("unknown op {other}"))),
    })
}

/// Decodes `data` as a request: its first byte the op, the rest the body, under small
/// limits. Never panics on any input; used by the fuzz target and by tests.
pub fn fuzz_one(data: &[u8]) {
    let Some((&op, body)) = data.split_first() else {
        return;
    };
    let limits = Limits {
        max_batch_keys: 64,
        max_key_bytes: 128,
    };
    if let Ok(r) = decode(op, body, &limits) {
        // What decoded is within the limits it was decoded under.
        let keys: Vec<&[u8]> = match &r {
            Request::GetInto { key, .. } | Request::PutFrom { key, .. } => vec![key],
            Request::BatchGetInto { items, .. } | Request::BatchPutFrom { items, .. } => {
                items.iter().map(|i| i.key).collect()
            }
            Request::View { keys } => keys.clone(),
            Request::Reserve { items } => items.iter().map(|(k, _)| *k).collect(),
            _ => Vec::new(),
        };
        assert!(keys.len() <= limits.max_batch_keys);
        assert!(
            keys.iter()
                .all(|k| !k.is_empty() && k.len() <= limits.max_key_bytes)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: Limits = Limits {
        max_batch_keys: 2,
        max_key_bytes: 4,
    };

    fn item(off: u64, len: u64, key: &[u8]) -> Vec<u8> {
        let mut b = off.to_le_bytes().to_vec();
        b.extend_from_slice(&len.to_le_bytes());
        b.extend_from_slice(&(key.len() as u16).to_le_bytes());
        b.extend_from_slice(key);
        b
    }

    #[test]
    fn each_op_decodes_and_every_bound_is_checked() {
        let mut b = 7u32.to_le_bytes().to_vec();
        b.extend_from_slice(&2u32.to_le_bytes());
        b.extend(item(0, 8, b"ab"));
        b.extend(item(8, 8, b"cd"));
        let r = decode(OP_BATCH_GET_INTO, &b, &L).unwrap_or_else(|e| panic!("{}", e.1));
        assert_eq!(
            r,
            Request::BatchGetInto {
                region: 7,
                items: vec![
                    Item {
                        key: b"ab",
                        off: 0,
                        len: 8
                    },
                    Item {
                        key: b"cd",
                        off: 8,
                        len: 8
                    }
                ]
            }
        );
        let why = |op: u8, body: &[u8]| match decode(op, body, &L) {
            Err(Fail(_, m)) => m,
            Ok(r) => panic!("{r:?}"),
        };
        // Too many items, a key too long, a body cut short, bytes left over, no op.
        let mut three = 7u32.to_le_bytes().to_vec();
        three.extend_from_slice(&3u32.to_le_bytes());
        assert!(why(OP_BATCH_PUT_FROM, &three).contains("kv.max_batch_keys"));
        let mut long = 7u32.to_le_bytes().to_vec();
        long.extend_from_slice(&1u32.to_le_bytes());
        long.extend(item(0, 8, b"toolong"));
        assert!(why(OP_BATCH_PUT_FROM, &long).contains("kv.max_key_bytes"));
        assert!(why(OP_GET_INTO, &[1, 2, 3]).contains("too short"));
        let mut extra = b.clone();
        extra.push(0);
        assert!(why(OP_BATCH_GET_INTO, &extra).contains("after the last item"));
        assert!(why(200, &[]).contains("unknown op"));
        let mut get = 1u32.to_le_bytes().to_vec();
        get.extend_from_slice(&[0; 16]);
        assert!(why(OP_GET_INTO, &get).contains("a key of 0 bytes"));
        get.extend_from_slice(b"k");
        assert!(matches!(
            decode(OP_GET_INTO, &get, &L),
            Ok(Request::GetInto { key: b"k", .. })
        ));
    }

    #[test]
    fn random_frames_never_panic() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for n in 0..20_000usize {
            let len = n % 97;
            let data: Vec<u8> = (0..len)
                .map(|i| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    // Small counts and lengths often, so bodies decode past the counts.
                    if i % 5 == 0 { (x % 4) as u8 } else { x as u8 }
                })
                .collect();
            fuzz_one(&data);
        }
    }
}

//! The offload family: what an owner (`mooncake_client --enable_offload=true`) tells
//! the master about its SSD tier. moongate never changes these calls; it reads them to
//! count what was offloaded and promoted, to know each owner's SSD, to keep the key
//! table's tiers right, and to tell an owner's own offload lookups from ranks' reads.
//!
//! Decoded schema-free ([`crate::codec::generic`]): every Mooncake release carries the
//! type literal in the body, and these calls are rare (about one a second per owner), so
//! the layouts of each release are read by shape, not by a table per release: a task
//! item is `{tenant_id?, key, size}` (0.3.11's has no tenant), a client id is the
//! 16-byte UUID image at the front of every call.
//!
//! | method | read as |
//! | --- | --- |
//! | `MountLocalDiskSegment(client_id, enable_offloading)` | [`Offload::MountDisk`] |
//! | `ReportSsdCapacity(client_id, bytes)` | [`Offload::Capacity`] |
//! | `OffloadObjectHeartbeat(client_id, enable_offloading)` | [`Offload::Heartbeat`]; its answer: the keys the owner is to offload ([`tasks`]) |
//! | `NotifyOffloadSuccess(client_id, tasks, metadatas)` | [`Offload::Offloaded`] |
//! | `PromotionAllocStart(client_id, key, tenant_id, size, segments)` | [`Offload::PromotionStart`] |
//! | `NotifyPromotionSuccess(client_id, key, tenant_id)` | [`Offload::Promoted`] |
//!
//! Pure: bytes in, values out; a body of another shape is `None`, never a panic.

use bytes::Bytes;

use crate::codec::Method;
use crate::codec::generic::{GenericMessage, Value};
use crate::codec::types::Uuid;

/// One key an owner offloads (or is asked to).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item {
    /// Empty for releases without tenants (0.3.11).
    pub tenant: Bytes,
    pub key: Bytes,
    pub size: u64,
}

/// A decoded offload-family request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Offload {
    /// The owner mounted its SSD tier (offloading on or off).
    MountDisk { client: Uuid, offloading: bool },
    /// The owner's SSD capacity, in bytes.
    Capacity { client: Uuid, bytes: i64 },
    /// The owner asks which keys to offload.
    Heartbeat { client: Uuid },
    /// Keys the owner wrote to its SSD (`items`), and keys it reported without a place
    /// on it (`failed`: bucket -1, no size, no endpoint), which the master gives no
    /// SSD replica.
    Offloaded {
        client: Uuid,
        items: Vec<Item>,
        failed: Vec<Item>,
    },
    /// The owner allocates memory to bring a key back from its SSD.
    PromotionStart { client: Uuid, item: Item },
    /// A key is back in memory.
    Promoted {
        client: Uuid,
        tenant: Bytes,
        key: Bytes,
    },
}

impl Offload {
    pub fn client(&self) -> Uuid {
        match self {
            Offload::MountDisk { client, .. }
            | Offload::Capacity { client, .. }
            | Offload::Heartbeat { client }
            | Offload::Offloaded { client, .. }
            | Offload::PromotionStart { client, .. }
            | Offload::Promoted { client, .. } => *client,
        }
    }
}

/// Whether moongate reads this method's calls.
pub fn is_offload(m: Method) -> bool {
    matches!(
        m,
        Method::MountLocalDiskSegment
            | Method::ReportSsdCapacity
            | Method::OffloadObjectHeartbeat
            | Method::NotifyOffloadSuccess
            | Method::PromotionAllocStart
            | Method::NotifyPromotionSuccess
    )
}

/// Reads an offload-family request body (`None`: another method, or another shape).
pub fn request(method: Method, body: &Bytes) -> Option<Offload> {
    if !is_offload(method) {
        return None;
    }
    let msg = GenericMessage::decode(body).ok()?;
    let read = read_request(method, &msg.value);
    if read.is_none() {
        tracing::debug!(%method, value = ?msg.value, "offload call of a shape moongate does not read");
    }
    read
}

fn read_request(method: Method, value: &Value) -> Option<Offload> {
    let Value::Struct(args) = value else {
        return None;
    };
    let client = uuid(args.first()?)?;
    Some(match method {
        Method::MountLocalDiskSegment => Offload::MountDisk {
            client,
            offloading: matches!(args.get(1), Some(Value::Bool(true))),
        },
        Method::ReportSsdCapacity => Offload::Capacity {
            client,
            bytes: scalar(args.get(1)?)? as i64,
        },
        Method::OffloadObjectHeartbeat => Offload::Heartbeat { client },
        Method::NotifyOffloadSuccess => {
            let tasks = items(args.get(1)?)?;
            let Some(Value::Seq(metas)) = args.get(2) else {
                return None;
            };
            if metas.len() != tasks.len() {
                return None;
            }
            type Noted<'v> = Vec<(Item, &'v Value)>;
            let (items, failed): (Noted<'_>, Noted<'_>) = tasks
                .into_iter()
                .zip(metas)
                .map(|(mut i, m)| {
                    if i.size == 0 {
                        i.size = data_size(m).unwrap_or(0);
                    }
                    (i, m)
                })
                .partition(|(_, m)| stored_at(m));
            Offload::Offloaded {
                client,
                items: items.into_iter().map(|(i, _)| i).collect(),
                failed: failed.into_iter().map(|(i, _)| i).collect(),
            }
        }
        Method::PromotionAllocStart => {
            // (client_id, key, tenant_id, size, preferred_segments)
            let strs = strings(&args[1..]);
            let key = strs.first()?.clone();
            let tenant = strs.get(1).cloned().unwrap_or_default();
            let size = args[1..].iter().find_map(scalar)?;
            Offload::PromotionStart {
                client,
                item: Item { tenant, key, size },
            }
        }
        Method::NotifyPromotionSuccess => {
            let strs = strings(&args[1..]);
            Offload::Promoted {
                client,
                key: strs.first()?.clone(),
                tenant: strs.get(1).cloned().unwrap_or_default(),
            }
        }
        _ => return None,
    })
}

/// The keys an `OffloadObjectHeartbeat` answer asks the owner to offload (`None`: an
/// error answer or another shape).
pub fn tasks(body: &Bytes) -> Option<Vec<Item>> {
    match GenericMessage::decode(body).ok()?.value {
        Value::Ok(v) => items(&v).or_else(|| {
            tracing::debug!(value = ?v, "offload tasks of a shape moongate does not read");
            None
        }),
        _ => None,
    }
}

/// Whether an `expected<...>` answer body says success.
pub fn answered_ok(body: &Bytes) -> bool {
    GenericMessage::decode(body).is_ok_and(|m| matches!(m.value, Value::Ok(_)))
}

fn uuid(v: &Value) -> Option<Uuid> {
    let Value::Pod(b) = v else { return None };
    let b: &[u8; 16] = b.as_ref().try_into().ok()?;
    Some(Uuid {
        first: u64::from_le_bytes(b[..8].try_into().ok()?),
        second: u64::from_le_bytes(b[8..].try_into().ok()?),
    })
}

/// An 8-byte scalar (u64 / i64) as its bits.
fn scalar(v: &Value) -> Option<u64> {
    let Value::Scalar(b) = v else { return None };
    Some(u64::from_le_bytes(b.as_ref().try_into().ok()?))
}

fn strings(vs: &[Value]) -> Vec<Bytes> {
    vs.iter()
        .filter_map(|v| match v {
            Value::Str(s) => Some(s.clone()),
            _ => None,
        })
        .collect()
}

/// Whether a `StorageObjectMetadata` `{bucket_id, offset, key_size, data_size,
/// transport_endpoint}` names a place on the SSD. Measured with 0.3.13.post1: part of an
/// eager offload's notices carry `{-1, 0, 0, -1, ""}` for keys the bucket backend did not
/// write, and the master lists no SSD replica for them.
fn data_size(meta: &Value) -> Option<u64> {
    let Value::Struct(f) = meta else { return None };
    let n = scalar(f.get(3)?)? as i64;
    u64::try_from(n).ok()
}

fn stored_at(meta: &Value) -> bool {
    let Value::Struct(f) = meta else { return false };
    let bucket = f.first().and_then(scalar).map(|b| b as i64);
    let endpoint = f.iter().rev().find_map(|v| match v {
        Value::Str(s) => Some(s),
        _ => None,
    });
    bucket.is_some_and(|b| b >= 0) && endpoint.is_some_and(|e| !e.is_empty())
}

/// Task items: `vector<{tenant_id, key, size}>` (0.3.13), `map<key, size>` (the
/// heartbeat answer of 0.3.11 and 0.3.12) or `vector<key>` (their offload notice, whose
/// sizes are in the metadata: 0 here).
fn items(v: &Value) -> Option<Vec<Item>> {
    if let Value::Map(m) = v {
        return m
            .iter()
            .map(|(k, n)| match k {
                Value::Str(key) => Some(Item {
                    tenant: Bytes::new(),
                    key: key.clone(),
                    size: scalar(n)?,
                }),
                _ => None,
            })
            .collect();
    }
    let Value::Seq(seq) = v else { return None };
    seq.iter()
        .map(|it| {
            if let Value::Str(key) = it {
                return Some(Item {
                    tenant: Bytes::new(),
                    key: key.clone(),
                    size: 0,
                });
            }
            let Value::Struct(f) = it else { return None };
            let strs = strings(f);
            let size = f.iter().find_map(scalar)?;
            let (tenant, key) = match strs.as_slice() {
                [key] => (Bytes::new(), key.clone()),
                [tenant, key, ..] => (tenant.clone(), key.clone()),
                [] => return None,
            };
            Some(Item { tenant, key, size })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::generic::Ty;
    use bytes::BytesMut;

    /// A body as the C++ sender writes it, from a literal and a value.
    fn body(literal: &[u8], value: Value) -> Bytes {
        let ty = Ty::parse(literal).unwrap();
        let mut out = BytesMut::new();
        GenericMessage {
            literal: Bytes::copy_from_slice(literal),
            ty,
            value,
        }
        .encode(&mut out);
        out.freeze()
    }

    const UUID_LIT: [u8; 6] = [0xfd, 0x04, 0x04, 0x89, 0x89, 0xff];

    fn uuid_value(first: u64, second: u64) -> Value {
        let mut b = Vec::new();
        b.extend_from_slice(&first.to_le_bytes());
        b.extend_from_slice(&second.to_le_bytes());
        Value::Pod(Bytes::from(b))
    }

    fn s(x: &str) -> Value {
        Value::Str(Bytes::copy_from_slice(x.as_bytes()))
    }

    fn i64v(x: i64) -> Value {
        Value::Scalar(Bytes::copy_from_slice(&x.to_le_bytes()))
    }

    /// `{string, string, i64}`: a 0.3.13 task item.
    fn item_lit() -> Vec<u8> {
        vec![0xfd, 0x80, 0x0c, 0x80, 0x0c, 0x03, 0xff]
    }

    #[test]
    fn reads_an_offload_notice_and_a_heartbeat_answer() {
        // (UUID, vector<{string,string,i64}>,
        //  vector<{i64 bucket, i64 offset, i64 key_size, i64 data_size, string endpoint}>)
        let mut lit = vec![0xfd];
        lit.extend_from_slice(&UUID_LIT);
        lit.push(0x84); // vector of
        lit.extend_from_slice(&item_lit());
        lit.push(0x84);
        lit.extend_from_slice(&[0xfd, 0x03, 0x03, 0x03, 0x03, 0x80, 0x0c, 0xff]);
        lit.push(0xff);
        let item = |k: &str, n| Value::Struct(vec![s("default"), s(k), i64v(n)]);
        let meta = |bucket: i64, endpoint: &str| {
            Value::Struct(vec![i64v(bucket), i64v(0), i64v(1), i64v(10), s(endpoint)])
        };
        let b = body(
            &lit,
            Value::Struct(vec![
                uuid_value(7, 9),
                Value::Seq(vec![item("a", 10), item("b", 20), item("c", 30)]),
                Value::Seq(vec![
                    meta(5, "127.0.0.1:1"),
                    meta(6, "127.0.0.1:1"),
                    meta(-1, ""),
                ]),
            ]),
        );
        let Some(Offload::Offloaded {
            client,
            items,
            failed,
        }) = request(Method::NotifyOffloadSuccess, &b)
        else {
            panic!("not read");
        };
        assert_eq!(
            failed.len(),
            1,
            "a key with no place on the SSD is no offload"
        );
        assert_eq!(failed[0].key, Bytes::from_static(b"c"));
        assert_eq!(
            client,
            Uuid {
                first: 7,
                second: 9
            }
        );
        assert_eq!(
            items,
            [
                Item {
                    tenant: Bytes::from_static(b"default"),
                    key: Bytes::from_static(b"a"),
                    size: 10
                },
                Item {
                    tenant: Bytes::from_static(b"default"),
                    key: Bytes::from_static(b"b"),
                    size: 20
                }
            ]
        );
        // Another method's bytes, or garbage, read as nothing.
        assert_eq!(request(Method::ExistKey, &b), None);
        assert_eq!(
            request(
                Method::NotifyOffloadSuccess,
                &Bytes::from_static(b"\x01\x02")
            ),
            None
        );
        // expected<vector<{string,string,i64}>, i32>
        let mut lit = vec![0x87, 0x84];
        lit.extend_from_slice(&item_lit());
        lit.push(0x01);
        let ok = body(&lit, Value::Ok(Box::new(Value::Seq(vec![item("c", 5)]))));
        assert_eq!(tasks(&ok).map(|v| v.len()), Some(1));
        assert!(answered_ok(&ok));
        let err = body(
            &lit,
            Value::Err(Box::new(Value::Scalar(Bytes::copy_from_slice(
                &(-1i32).to_le_bytes(),
            )))),
        );
        assert_eq!(tasks(&err), None);
        assert!(!answered_ok(&err));
    }

    #[test]
    fn reads_the_older_releases_shapes() {
        // 0.3.11 / 0.3.12: the notice names keys only (sizes in the metadata) ...
        let mut lit = vec![0xfd];
        lit.extend_from_slice(&UUID_LIT);
        lit.extend_from_slice(&[0x84, 0x80, 0x0c]);
        lit.push(0x84);
        lit.extend_from_slice(&[0xfd, 0x03, 0x03, 0x03, 0x03, 0x80, 0x0c, 0xff]);
        lit.push(0xff);
        let meta = |bucket: i64, size: i64, endpoint: &str| {
            Value::Struct(vec![
                i64v(bucket),
                i64v(0),
                i64v(1),
                i64v(size),
                s(endpoint),
            ])
        };
        let b = body(
            &lit,
            Value::Struct(vec![
                uuid_value(1, 2),
                Value::Seq(vec![s("a"), s("b")]),
                Value::Seq(vec![meta(3, 77, "h:1"), meta(-1, -1, "")]),
            ]),
        );
        let Some(Offload::Offloaded { items, failed, .. }) =
            request(Method::NotifyOffloadSuccess, &b)
        else {
            panic!("not read");
        };
        assert_eq!((items.len(), items[0].size, failed.len()), (1, 77, 1));
        // ... and the heartbeat answers a map of key to size.
        let lit = [0x87, 0x82, 0x80, 0x0c, 0x03, 0x01];
        let ok = body(
            &lit,
            Value::Ok(Box::new(Value::Map(vec![(s("k"), i64v(9))]))),
        );
        assert_eq!(
            tasks(&ok),
            Some(vec![Item {
                tenant: Bytes::new(),
                key: Bytes::from_static(b"k"),
                size: 9
            }])
        );
    }

    #[test]
    fn reads_mounts_capacities_and_promotions() {
        let mut lit = vec![0xfd];
        lit.extend_from_slice(&UUID_LIT);
        lit.extend_from_slice(&[0x0b, 0xff]); // bool
        let b = body(
            &lit,
            Value::Struct(vec![uuid_value(1, 2), Value::Bool(true)]),
        );
        assert!(matches!(
            request(Method::MountLocalDiskSegment, &b),
            Some(Offload::MountDisk {
                offloading: true,
                ..
            })
        ));
        let mut lit = vec![0xfd];
        lit.extend_from_slice(&UUID_LIT);
        lit.extend_from_slice(&[0x03, 0xff]); // i64
        let b = body(&lit, Value::Struct(vec![uuid_value(1, 2), i64v(1 << 40)]));
        assert_eq!(
            request(Method::ReportSsdCapacity, &b),
            Some(Offload::Capacity {
                client: Uuid {
                    first: 1,
                    second: 2
                },
                bytes: 1 << 40
            })
        );
        let mut lit = vec![0xfd];
        lit.extend_from_slice(&UUID_LIT);
        lit.extend_from_slice(&[0x80, 0x0c, 0x80, 0x0c, 0xff]);
        let b = body(
            &lit,
            Value::Struct(vec![uuid_value(1, 2), s("k"), s("default")]),
        );
        assert_eq!(
            request(Method::NotifyPromotionSuccess, &b),
            Some(Offload::Promoted {
                client: Uuid {
                    first: 1,
                    second: 2
                },
                tenant: Bytes::from_static(b"default"),
                key: Bytes::from_static(b"k"),
            })
        );
    }
}

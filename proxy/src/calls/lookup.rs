//! The lookup family: `GetReplicaList` and `BatchGetReplicaList`. Keys, how a batch is
//! cut and merged, which tiers the answers name (tier metrics), and what they tell the
//! key table.

use std::ops::Range;

use bytes::Bytes;

use super::{ERROR, FOUND, NOT_FOUND, Seen, Tally, UNKNOWN, tier_label};
use crate::codec::Method;
use crate::codec::keys::Keys;
use crate::codec::message::{Request, Response};
use crate::codec::types::{ErrorCode, Expected, GetReplicaListResponse, ReplicaLocation, Tier};

/// A decoded lookup: one key or a batch.
pub type Lookup<'a> = super::Keyed<'a>;

/// Cuts a batch into parts of the same method.
pub(super) fn split(c: &Lookup<'_>, parts: &[Range<usize>]) -> Option<Vec<Request>> {
    c.split(parts, Request::BatchGetReplicaList)
}

pub(super) fn splittable(m: Method) -> bool {
    m == Method::BatchGetReplicaList
}

/// The per-key answers of a lookup.
pub fn results(resp: &Response) -> Option<&[Expected<GetReplicaListResponse>]> {
    match resp {
        Response::GetReplicaList(r) => Some(std::slice::from_ref(r)),
        Response::BatchGetReplicaList(v) => Some(v),
        _ => None,
    }
}

/// The per-key answers of a lookup, to change (steering).
pub fn results_mut(resp: &mut Response) -> Option<&mut [Expected<GetReplicaListResponse>]> {
    match resp {
        Response::GetReplicaList(r) => Some(std::slice::from_mut(r)),
        Response::BatchGetReplicaList(v) => Some(v),
        _ => None,
    }
}

pub(super) fn append(whole: &mut Response, part: Response) -> Result<(), Response> {
    match (whole, part) {
        (Response::BatchGetReplicaList(v), Response::BatchGetReplicaList(p)) => {
            v.extend(p);
            Ok(())
        }
        (_, p) => Err(p),
    }
}

/// Each found key counts once in every tier it has a replica in.
pub(super) fn tally(resp: &Response, t: &mut Tally) {
    for r in results(resp).unwrap_or(&[]) {
        match r {
            Ok(list) => {
                let mut seen = [false; 4];
                for rep in &list.replicas {
                    let tier = tier_label(rep.location.tier());
                    if !std::mem::replace(&mut seen[tier], true) {
                        t.keys[tier][FOUND] += 1;
                        // The master's sizes: summed without wrapping or panicking.
                        t.bytes[tier][FOUND] =
                            t.bytes[tier][FOUND].saturating_add(rep.location.size());
                    }
                }
            }
            Err(ErrorCode::OBJECT_NOT_FOUND) => t.keys[UNKNOWN][NOT_FOUND] += 1,
            Err(_) => t.keys[UNKNOWN][ERROR] += 1,
        }
    }
}

/// Served-tier label values, in index order: the tier of the replica a reader reads.
/// `other`: NVMe-oF or DFS; `unknown`: not found or failed (what vLLM's tier log calls
/// unknown).
pub const SERVED_LABELS: [&str; 5] = ["memory", "disk", "local_disk", "other", "unknown"];
/// The [`SERVED_LABELS`] index of keys that were not served.
pub const SERVED_UNKNOWN: usize = 4;

/// The tier a reader reads one answer from, and its bytes: Mooncake's client (every
/// release 0.3.11-0.3.13) reads the first replica of the list, except that one that
/// mounted segments of its own prefers a memory replica on them (a requester-only rank
/// mounts none). The master lists replicas in the order they were made, so memory comes
/// before the copy offloaded from it. A key not found, or any error, is `unknown`.
pub fn served(answer: &Expected<GetReplicaListResponse>) -> (usize, u64) {
    let Ok(list) = answer else {
        return (SERVED_UNKNOWN, 0);
    };
    let Some(first) = list.replicas.first() else {
        return (SERVED_UNKNOWN, 0);
    };
    let tier = match first.location.tier() {
        Tier::Memory => 0,
        Tier::Disk => 1,
        Tier::LocalDisk => 2,
        Tier::Nof | Tier::Dfs => 3,
    };
    (tier, first.location.size())
}

/// Points every SSD copy in a lookup answer at the endpoint `to` gives for its owner's
/// offload-read service (`None`: left as it is). Whether anything changed.
pub fn redirect_local_disk(
    resp: &mut Response,
    mut to: impl FnMut(&Bytes) -> Option<Bytes>,
) -> bool {
    let mut changed = false;
    for r in results_mut(resp).into_iter().flatten().flatten() {
        for rep in &mut r.replicas {
            if let ReplicaLocation::LocalDisk(d) = &mut rep.location
                && let Some(ep) = to(&d.transport_endpoint)
            {
                d.transport_endpoint = ep;
                changed = true;
            }
        }
    }
    changed
}

/// The tiers each answer has a copy in, as the key table keeps them.
pub fn has_local_disk(answer: &Expected<GetReplicaListResponse>) -> bool {
    answer.as_ref().is_ok_and(|l| {
        l.replicas
            .iter()
            .any(|r| r.location.tier() == Tier::LocalDisk)
    })
}

/// Found keys (tier of the first replica), and keys the master no longer has.
pub(super) fn seen(keys: &Keys, resp: &Response) -> Vec<Seen> {
    let Some(answers) = results(resp).filter(|a| a.len() == keys.len()) else {
        return Vec::new();
    };
    let found = keys
        .iter_bytes()
        .zip(answers)
        .filter_map(|(k, a)| {
            let list = a.as_ref().ok()?;
            Some((k, list.replicas.first().map(|r| r.location.tier())))
        })
        .collect();
    let gone = keys
        .iter_bytes()
        .zip(answers)
        .filter(|(_, a)| matches!(a, Err(ErrorCode::OBJECT_NOT_FOUND)))
        .map(|(k, _)| k)
        .collect();
    vec![Seen::Found(found), Seen::Missed(gone)]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::types::*;

    const MEMORY: usize = 0;
    const DISK: usize = 1;
    const LOCAL_DISK: usize = 2;

    fn rep(location: ReplicaLocation) -> ReplicaDescriptor {
        ReplicaDescriptor {
            id: 1,
            location,
            status: ReplicaStatus::COMPLETE,
        }
    }

    #[test]
    fn every_tier_and_outcome() {
        let mem = ReplicaLocation::Memory(MemoryDescriptor {
            buffer_descriptor: BufferDescriptor {
                size: 100,
                buffer_address: 0,
                protocol: Bytes::new(),
                transport_endpoint: Bytes::new(),
            },
        });
        let local = ReplicaLocation::LocalDisk(LocalDiskDescriptor {
            client_id: Uuid::default(),
            object_size: 300,
            transport_endpoint: Bytes::new(),
        });
        let disk = ReplicaLocation::Disk(DiskDescriptor {
            file_path: Bytes::new(),
            object_size: 100,
        });
        let list = |reps: Vec<ReplicaDescriptor>| {
            Ok(GetReplicaListResponse {
                replicas: reps,
                lease_ttl_ms: 10_000,
                object_checksum: None,
            })
        };
        let r = Response::BatchGetReplicaList(vec![
            list(vec![rep(mem.clone()), rep(disk)]),
            list(vec![rep(local)]),
            list(vec![rep(mem.clone()), rep(mem)]),
            Err(ErrorCode::OBJECT_NOT_FOUND),
            Err(ErrorCode::INTERNAL_ERROR),
        ]);
        let t = Tally::of(&r);
        assert_eq!(
            t.keys[MEMORY][FOUND], 2,
            "two replicas of one key count once"
        );
        assert_eq!(t.bytes[MEMORY][FOUND], 200);
        assert_eq!((t.keys[DISK][FOUND], t.bytes[DISK][FOUND]), (1, 100));
        assert_eq!(
            (t.keys[LOCAL_DISK][FOUND], t.bytes[LOCAL_DISK][FOUND]),
            (1, 300)
        );
        assert_eq!(t.keys[UNKNOWN][NOT_FOUND], 1);
        assert_eq!(t.keys[UNKNOWN][ERROR], 1);
        let e = Tally::of(&Response::BatchExistKey(vec![
            Ok(true),
            Ok(false),
            Ok(true),
            Err(ErrorCode::INTERNAL_ERROR),
        ]));
        assert_eq!((e.hits, e.misses), (2, 1));
        assert!(Tally::of(&Response::RemoveAll(1)).is_empty());
    }

    #[test]
    fn ssd_copies_are_pointed_at_the_endpoint_given() {
        let local = |ep: &'static [u8]| {
            rep(ReplicaLocation::LocalDisk(LocalDiskDescriptor {
                client_id: Uuid::default(),
                object_size: 300,
                transport_endpoint: Bytes::from_static(ep),
            }))
        };
        let mem = rep(ReplicaLocation::Memory(MemoryDescriptor {
            buffer_descriptor: BufferDescriptor {
                size: 100,
                buffer_address: 0,
                protocol: Bytes::new(),
                transport_endpoint: Bytes::from_static(b"owner:1"),
            },
        }));
        let list = |reps| {
            Ok(GetReplicaListResponse {
                replicas: reps,
                lease_ttl_ms: 1,
                object_checksum: None,
            })
        };
        let mut r = Response::BatchGetReplicaList(vec![
            list(vec![mem.clone(), local(b"owner:2")]),
            list(vec![local(b"other:3")]),
            Err(ErrorCode::OBJECT_NOT_FOUND),
        ]);
        let to = |ep: &Bytes| (&ep[..] == b"owner:2").then(|| Bytes::from_static(b"mg:9"));
        assert!(redirect_local_disk(&mut r, to));
        let eps: Vec<Vec<u8>> = results(&r)
            .unwrap()
            .iter()
            .flatten()
            .flat_map(|l| &l.replicas)
            .map(|rep| match &rep.location {
                ReplicaLocation::LocalDisk(d) => d.transport_endpoint.to_vec(),
                ReplicaLocation::Memory(m) => m.buffer_descriptor.transport_endpoint.to_vec(),
                _ => Vec::new(),
            })
            .collect();
        assert_eq!(
            eps,
            vec![b"owner:1".to_vec(), b"mg:9".to_vec(), b"other:3".to_vec()]
        );
        // Nothing to point elsewhere: unchanged, and said so.
        let mut m = Response::GetReplicaList(list(vec![mem]));
        assert!(!redirect_local_disk(&mut m, to));
    }
}

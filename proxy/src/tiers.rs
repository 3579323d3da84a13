//! Tier accounting from answers the master face already carries: which tier the keys a
//! client looked up live on, and how many lookups hit, at zero extra RPCs.
//!
//! Pure: takes a decoded response, returns a tally. The master face adds the tally to
//! the metric handles of the arm that served the call.
//!
//! Semantics (stable: dashboards use them):
//! - A found key counts once in every tier it has a replica in, with its object size as
//!   bytes; a key with a memory and a disk replica counts in both.
//! - A key the master does not know counts as `not_found` under tier `unknown`; any
//!   other per-key error as `error` under `unknown`.
//! - Tiers: `memory`, `disk` (the master's `--root_fs_dir` replica), `local_disk` (a
//!   client's offloaded replica, `LocalDiskDescriptor`), `unknown` (NVMe-oF, DFS, or no
//!   replica).
//! - `ExistKey` / `BatchExistKey`: `hit` for true, `miss` for false; errors are neither.

use crate::codec::message::Response;
use crate::codec::types::{ErrorCode, Expected, GetReplicaListResponse, ReplicaLocation};

/// Tier label values, in index order.
pub const TIERS: [&str; 4] = ["memory", "disk", "local_disk", "unknown"];
/// Outcome label values, in index order.
pub const OUTCOMES: [&str; 3] = ["found", "not_found", "error"];

const MEMORY: usize = 0;
const DISK: usize = 1;
const LOCAL_DISK: usize = 2;
const UNKNOWN: usize = 3;
const FOUND: usize = 0;
const NOT_FOUND: usize = 1;
const ERROR: usize = 2;

/// Counts from one answer.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Tally {
    /// `[tier][outcome]` keys.
    pub keys: [[u64; 3]; 4],
    /// `[tier][outcome]` bytes.
    pub bytes: [[u64; 3]; 4],
    pub hits: u64,
    pub misses: u64,
}

impl Tally {
    pub fn is_empty(&self) -> bool {
        *self == Tally::default()
    }

    fn replica_list(&mut self, r: &Expected<GetReplicaListResponse>) {
        match r {
            Ok(list) => {
                let mut seen = [false; 4];
                for rep in &list.replicas {
                    let (tier, size) = match &rep.location {
                        ReplicaLocation::Memory(d) => (MEMORY, d.buffer_descriptor.size),
                        ReplicaLocation::Disk(d) => (DISK, d.object_size),
                        ReplicaLocation::LocalDisk(d) => (LOCAL_DISK, d.object_size),
                        ReplicaLocation::Nof(d) => (UNKNOWN, d.buffer_descriptor.size),
                        ReplicaLocation::DistributedFs(d) => (UNKNOWN, d.object_size),
                    };
                    if !std::mem::replace(&mut seen[tier], true) {
                        self.keys[tier][FOUND] += 1;
                        self.bytes[tier][FOUND] += size;
                    }
                }
            }
            Err(ErrorCode::OBJECT_NOT_FOUND) => self.keys[UNKNOWN][NOT_FOUND] += 1,
            Err(_) => self.keys[UNKNOWN][ERROR] += 1,
        }
    }

    /// The tally of one decoded answer (empty for methods that carry no lookup).
    pub fn of(resp: &Response) -> Tally {
        let mut t = Tally::default();
        match resp {
            Response::GetReplicaList(r) => t.replica_list(r),
            Response::BatchGetReplicaList(v) => v.iter().for_each(|r| t.replica_list(r)),
            Response::ExistKey(r) => t.exist(r),
            Response::BatchExistKey(v) => v.iter().for_each(|r| t.exist(r)),
            _ => {}
        }
        t
    }

    fn exist(&mut self, r: &Expected<bool>) {
        match r {
            Ok(true) => self.hits += 1,
            Ok(false) => self.misses += 1,
            Err(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::types::*;
    use bytes::Bytes;

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
}

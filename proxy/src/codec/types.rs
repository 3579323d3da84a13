//! Mooncake's master-RPC value types, field order = wire order (spec §6).
//!
//! Strings are [`Bytes`]: Mooncake keys and names are byte strings, and decoding them
//! as slices of the frame costs no copy.

use bytes::Bytes;

use super::error::DecodeError;
use super::pack::{Pack, Reader, Writer};
use crate::{int_enum, pack_struct};

int_enum! {
    /// `mooncake::ErrorCode` (i32). Values a newer master adds pass through unchanged.
    pub struct ErrorCode(i32) {
        OK = 0, INTERNAL_ERROR = -1, BUFFER_OVERFLOW = -10,
        SHARD_INDEX_OUT_OF_RANGE = -100, SEGMENT_NOT_FOUND = -101,
        SEGMENT_ALREADY_EXISTS = -102, CLIENT_NOT_FOUND = -103,
        NO_AVAILABLE_HANDLE = -200, INVALID_VERSION = -300, INVALID_KEY = -400,
        WRITE_FAIL = -500, INVALID_PARAMS = -600, ILLEGAL_CLIENT = -601,
        INVALID_WRITE = -700, INVALID_READ = -701, INVALID_REPLICA = -702,
        REPLICA_IS_NOT_READY = -703, OBJECT_NOT_FOUND = -704, OBJECT_ALREADY_EXISTS = -705,
        OBJECT_HAS_LEASE = -706, LEASE_EXPIRED = -707, OBJECT_HAS_REPLICATION_TASK = -708,
        OBJECT_NO_REPLICATION_TASK = -709, REPLICA_NOT_FOUND = -710,
        REPLICA_ALREADY_EXISTS = -711, REPLICA_IS_GONE = -712,
        REPLICA_NOT_IN_LOCAL_MEMORY = -713, OBJECT_REPLICA_BUSY = -714,
        TRANSFER_FAIL = -800, CHECKSUM_MISMATCH = -801, RPC_FAIL = -900, RPC_TIMEOUT = -901,
        UNAVAILABLE_IN_CURRENT_STATUS = -1010, UNAVAILABLE_IN_CURRENT_MODE = -1011,
        NOT_SUPPORTED = -1012, UNABLE_OFFLOAD = -1300, TASK_NOT_FOUND = -1400,
        TENANT_QUOTA_EXCEEDED = -1700,
    }
}

int_enum! {
    /// `ReplicaType` (i32). `ALL` is what a normal `PutEnd` finalizes.
    pub struct ReplicaType(i32) {
        MEMORY = 0, DISK = 1, LOCAL_DISK = 2, NOF_SSD = 3, ALL = 4, DFS = 100,
    }
}

int_enum! {
    /// `ReplicaStatus` (i32).
    pub struct ReplicaStatus(i32) {
        UNDEFINED = 0, INITIALIZED = 1, PROCESSING = 2, COMPLETE = 3, REMOVED = 4, FAILED = 5,
    }
}

int_enum! {
    /// `SoftPinAction` (u8).
    pub struct SoftPinAction(u8) { PRESERVE = 0, ENABLE = 1, DISABLE = 2 }
}

int_enum! {
    /// `ObjectDataType` (u8).
    pub struct ObjectDataType(u8) {
        UNKNOWN = 0, KVCACHE = 1, TENSOR = 2, WEIGHT = 3, SAMPLE = 4, ACTIVATION = 5,
        GRADIENT = 6, OPTIMIZER_STATE = 7, METADATA = 8, GENERAL = 9,
    }
}

int_enum! {
    /// `ClientStatus` (i32), in `PingResponse`.
    pub struct ClientStatus(i32) { UNDEFINED = 0, OK = 1, NEED_REMOUNT = 2 }
}

int_enum! {
    /// `TaskType` (i32).
    pub struct TaskType(i32) { REPLICA_COPY = 0, REPLICA_MOVE = 1 }
}

/// `tl::expected<T, ErrorCode>`.
pub type Expected<T> = Result<T, ErrorCode>;

/// `UUID = std::pair<u64, u64>`: a trivially-serializable struct, written as its 16-byte
/// memory image. Printed by Mooncake as `first-second`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Uuid {
    pub first: u64,
    pub second: u64,
}

impl std::fmt::Display for Uuid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.first, self.second)
    }
}

impl Pack for Uuid {
    fn write_literal(out: &mut Vec<u8>) {
        // two u64 members, then pack-alignment 8 and alignment 8 (size literal n+129)
        out.extend_from_slice(&[0xfd, 0x04, 0x04, 0x89, 0x89, 0xff]);
    }
    fn encode(&self, w: &mut Writer<'_>) {
        w.bytes(&self.first.to_le_bytes());
        w.bytes(&self.second.to_le_bytes());
    }
    fn decode(r: &mut Reader) -> Result<Self, DecodeError> {
        Ok(Uuid {
            first: u64::decode(r)?,
            second: u64::decode(r)?,
        })
    }
}

pack_struct! {
    /// `ReplicateConfig`: what a put asks of the master. The fields a placement policy
    /// rewrites (replica counts, preferred segments, pins) live here.
    pub struct ReplicateConfig {
        /// Number of memory replicas.
        pub replica_num: u64,
        pub nof_replica_num: u64,
        pub dfs_replica_num: u64,
        pub soft_pin_action: SoftPinAction,
        pub soft_pin_ttl_ms: Option<u64>,
        pub with_hard_pin: bool,
        /// Segment names (the owner's transfer-engine `host:port`) to allocate on first.
        pub preferred_segments: Vec<Bytes>,
        /// Deprecated single preferred segment; wins over `preferred_segments` when set.
        pub preferred_segment: Bytes,
        pub preferred_nof_segments: Vec<Bytes>,
        pub prefer_alloc_in_same_node: bool,
        pub data_type: ObjectDataType,
        pub host_id: Bytes,
        pub group_ids: Option<Vec<Bytes>>,
    }
}

impl Default for ReplicateConfig {
    /// What the Python client sends for a default `ReplicateConfig()`.
    fn default() -> Self {
        ReplicateConfig {
            replica_num: 1,
            nof_replica_num: 0,
            dfs_replica_num: 0,
            soft_pin_action: SoftPinAction::PRESERVE,
            soft_pin_ttl_ms: None,
            with_hard_pin: false,
            preferred_segments: Vec::new(),
            preferred_segment: Bytes::new(),
            preferred_nof_segments: Vec::new(),
            prefer_alloc_in_same_node: false,
            data_type: ObjectDataType::UNKNOWN,
            host_id: Bytes::new(),
            group_ids: None,
        }
    }
}

pack_struct! {
    /// `ObjectMeta`, in `PutEnd` / `BatchPutEnd`.
    pub struct ObjectMeta {
        pub key: Bytes,
        pub object_checksum: Option<u64>,
    }
}

pack_struct! {
    /// `Segment`: a client's mounted memory segment.
    pub struct Segment {
        pub id: Uuid,
        /// The segment name used by preferred-segment lists (transfer-engine `host:port`).
        pub name: Bytes,
        pub base: u64,
        pub size: u64,
        pub te_endpoint: Bytes,
        pub protocol: Bytes,
        pub host_id: Bytes,
    }
}

pack_struct! {
    /// `AllocatedBuffer::Descriptor`: where a replica's bytes live.
    pub struct BufferDescriptor {
        pub size: u64,
        pub buffer_address: u64,
        pub protocol: Bytes,
        pub transport_endpoint: Bytes,
    }
}

pack_struct! {
    /// `MemoryDescriptor` (variant 0).
    pub struct MemoryDescriptor { pub buffer_descriptor: BufferDescriptor }
}

pack_struct! {
    /// `NoFDescriptor` (variant 1): NVMe-oF SSD.
    pub struct NofDescriptor { pub buffer_descriptor: BufferDescriptor }
}

pack_struct! {
    /// `DiskDescriptor` (variant 2): the master's disk tier (`--root_fs_dir`).
    pub struct DiskDescriptor { pub file_path: Bytes, pub object_size: u64 }
}

pack_struct! {
    /// `LocalDiskDescriptor` (variant 3): a client's local-disk offload.
    pub struct LocalDiskDescriptor {
        pub client_id: Uuid,
        pub object_size: u64,
        pub transport_endpoint: Bytes,
    }
}

pack_struct! {
    /// `DistributedFSDescriptor` (variant 4).
    pub struct DfsDescriptor {
        pub file_path: Bytes,
        pub offset: u64,
        pub object_size: u64,
        pub aligned_size: u64,
        pub shard_idx: i32,
    }
}

/// The tier a replica lives on: the kinds of Mooncake's replica descriptors. The one
/// tier vocabulary of moongate; the plugin contract (`wit::Tier`) and the metric labels
/// are mapped from it in one place each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    Memory,
    /// NVMe-oF SSD.
    Nof,
    /// The master's `--root_fs_dir` disk tier.
    Disk,
    /// A client's offloaded replica.
    LocalDisk,
    /// A distributed filesystem.
    Dfs,
}

/// `Replica::Descriptor::descriptor_variant`: which tier a replica is on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicaLocation {
    Memory(MemoryDescriptor),
    Nof(NofDescriptor),
    Disk(DiskDescriptor),
    LocalDisk(LocalDiskDescriptor),
    DistributedFs(DfsDescriptor),
}

impl ReplicaLocation {
    pub fn tier(&self) -> Tier {
        match self {
            ReplicaLocation::Memory(_) => Tier::Memory,
            ReplicaLocation::Nof(_) => Tier::Nof,
            ReplicaLocation::Disk(_) => Tier::Disk,
            ReplicaLocation::LocalDisk(_) => Tier::LocalDisk,
            ReplicaLocation::DistributedFs(_) => Tier::Dfs,
        }
    }

    /// The object's size as this replica states it.
    pub fn size(&self) -> u64 {
        match self {
            ReplicaLocation::Memory(d) => d.buffer_descriptor.size,
            ReplicaLocation::Nof(d) => d.buffer_descriptor.size,
            ReplicaLocation::Disk(d) => d.object_size,
            ReplicaLocation::LocalDisk(d) => d.object_size,
            ReplicaLocation::DistributedFs(d) => d.object_size,
        }
    }
}

impl Pack for ReplicaLocation {
    fn write_literal(out: &mut Vec<u8>) {
        out.push(0x86);
        MemoryDescriptor::write_literal(out);
        NofDescriptor::write_literal(out);
        DiskDescriptor::write_literal(out);
        LocalDiskDescriptor::write_literal(out);
        DfsDescriptor::write_literal(out);
        out.push(0xff);
    }
    fn max_len(&self) -> usize {
        match self {
            ReplicaLocation::Memory(d) => d.max_len(),
            ReplicaLocation::Nof(d) => d.max_len(),
            ReplicaLocation::Disk(d) => d.max_len(),
            ReplicaLocation::LocalDisk(d) => d.max_len(),
            ReplicaLocation::DistributedFs(d) => d.max_len(),
        }
    }
    fn encode(&self, w: &mut Writer<'_>) {
        match self {
            ReplicaLocation::Memory(d) => {
                w.u8(0);
                d.encode(w)
            }
            ReplicaLocation::Nof(d) => {
                w.u8(1);
                d.encode(w)
            }
            ReplicaLocation::Disk(d) => {
                w.u8(2);
                d.encode(w)
            }
            ReplicaLocation::LocalDisk(d) => {
                w.u8(3);
                d.encode(w)
            }
            ReplicaLocation::DistributedFs(d) => {
                w.u8(4);
                d.encode(w)
            }
        }
    }
    fn decode(r: &mut Reader) -> Result<Self, DecodeError> {
        let at = r.position();
        Ok(match r.u8()? {
            0 => ReplicaLocation::Memory(Pack::decode(r)?),
            1 => ReplicaLocation::Nof(Pack::decode(r)?),
            2 => ReplicaLocation::Disk(Pack::decode(r)?),
            3 => ReplicaLocation::LocalDisk(Pack::decode(r)?),
            4 => ReplicaLocation::DistributedFs(Pack::decode(r)?),
            index => return Err(DecodeError::BadVariant { at, index }),
        })
    }
}

pack_struct! {
    /// `Replica::Descriptor`.
    pub struct ReplicaDescriptor {
        pub id: u64,
        pub location: ReplicaLocation,
        pub status: ReplicaStatus,
    }
}

pack_struct! {
    /// `GetReplicaListResponse`. Every such answer grants the caller a read lease.
    pub struct GetReplicaListResponse {
        pub replicas: Vec<ReplicaDescriptor>,
        pub lease_ttl_ms: u64,
        pub object_checksum: Option<u64>,
    }
}

pack_struct! {
    /// `PingResponse`.
    pub struct PingResponse {
        pub view_version_id: i64,
        pub client_status: ClientStatus,
    }
}

pack_struct! {
    /// `GetStorageConfigResponse`.
    pub struct GetStorageConfigResponse {
        pub fsdir: Bytes,
        pub enable_disk_eviction: bool,
        pub quota_bytes: u64,
    }
}

pack_struct! {
    /// `TaskAssignment`, answered by `FetchTasks`.
    pub struct TaskAssignment {
        pub id: Uuid,
        pub task_type: TaskType,
        pub payload: Bytes,
        pub created_at_ms_epoch: i64,
        pub max_retry_attempts: u32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::pack::RootSchema;

    fn literal<T: Pack>() -> Vec<u8> {
        let mut v = Vec::new();
        T::write_literal(&mut v);
        v
    }

    #[test]
    fn literals_match_the_spec() {
        assert_eq!(literal::<Uuid>(), [0xfd, 0x04, 0x04, 0x89, 0x89, 0xff]);
        assert_eq!(
            literal::<ReplicateConfig>(),
            [
                0xfd, 0x04, 0x04, 0x04, 0x06, 0x85, 0x04, 0x0b, 0x84, 0x80, 0x0c, 0x80, 0x0c, 0x84,
                0x80, 0x0c, 0x0b, 0x06, 0x80, 0x0c, 0x85, 0x84, 0x80, 0x0c, 0xff
            ]
        );
        assert_eq!(
            literal::<ObjectMeta>(),
            [0xfd, 0x80, 0x0c, 0x85, 0x04, 0xff]
        );
    }

    #[test]
    fn response_type_codes_match_the_method_table() {
        // hash_head values of the spec's table minus the metainfo bit
        assert_eq!(
            RootSchema::of::<Expected<GetReplicaListResponse>>().code,
            0x88c6_276c
        );
        assert_eq!(
            RootSchema::of::<Vec<Expected<Vec<ReplicaDescriptor>>>>().code,
            0xad00_6d02
        );
        assert_eq!(RootSchema::of::<Expected<()>>().code, 0xaf28_68cc);
        assert_eq!(RootSchema::of::<Expected<PingResponse>>().code, 0x742a_8f52);
        assert_eq!(RootSchema::of::<i64>().code, 0x8666_6834);
    }

    #[test]
    fn unknown_enum_values_survive() {
        let e = ErrorCode(-4242);
        assert_eq!(e.name(), None);
        assert_eq!(e.to_string(), "-4242");
        assert_eq!(
            ErrorCode::NO_AVAILABLE_HANDLE.to_string(),
            "NO_AVAILABLE_HANDLE(-200)"
        );
    }
}

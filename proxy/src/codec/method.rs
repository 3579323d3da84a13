//! The 64 methods the 0.3.13 master registers, and their function ids.
//!
//! A function id is `MD5_32("mooncake::WrappedMasterService::" + name)`; the table is
//! computed from the names once, on first use.

use std::sync::OnceLock;

use super::pack::md5_32;

/// The C++ class whose member functions are the RPC handlers.
pub const QUALIFIED_PREFIX: &str = "mooncake::WrappedMasterService::";

macro_rules! methods {
    ($($m:ident),* $(,)?) => {
        /// A master RPC method, identified on the wire by its function id.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[repr(u8)]
        pub enum Method { $($m),* }

        impl Method {
            /// Every method, in a stable order ([`Method::index`]).
            pub const ALL: &'static [Method] = &[$(Method::$m),*];

            /// The C++ method name, e.g. `PutStart`.
            pub fn name(self) -> &'static str {
                match self { $(Method::$m => stringify!($m)),* }
            }
        }
    };
}

methods!(
    BatchEvictDiskReplica,
    BatchExistKey,
    BatchGetReplicaList,
    BatchPutEnd,
    BatchPutRevoke,
    BatchPutStart,
    BatchQueryIp,
    BatchRemove,
    BatchReplicaClear,
    BatchUpsertEnd,
    BatchUpsertRevoke,
    BatchUpsertStart,
    CopyEnd,
    CopyRevoke,
    CopyStart,
    CreateCopyTask,
    CreateMoveTask,
    DynamicReplicaCopyEnd,
    DynamicReplicaCopyRevoke,
    DynamicReplicaCopyStart,
    EvictDiskReplica,
    ExistKey,
    FetchTasks,
    GetAllNoFSegments,
    GetFsdir,
    GetNoFSegmentsByName,
    GetReplicaList,
    GetReplicaListByRegex,
    GetStorageConfig,
    GracefulUnmountSegment,
    MarkTaskToComplete,
    MountLocalDiskSegment,
    MountNoFSegment,
    MountSegment,
    MoveEnd,
    MoveRevoke,
    MoveStart,
    NotifyOffloadSuccess,
    NotifyPromotionFailure,
    NotifyPromotionSuccess,
    OffloadObjectHeartbeat,
    Ping,
    PollRemoveAll,
    PromotionAllocStart,
    PromotionObjectHeartbeat,
    PutEnd,
    PutRevoke,
    PutStart,
    QuerySegmentStatus,
    QuerySegmentStatusById,
    QueryTask,
    ReMountNoFSegment,
    ReMountSegment,
    Remove,
    RemoveAll,
    RemoveByRegex,
    ReportSsdCapacity,
    ServiceReady,
    UnmountLocalDiskSegment,
    UnmountNoFSegment,
    UnmountSegment,
    UpsertEnd,
    UpsertRevoke,
    UpsertStart,
);

/// Number of known methods; metrics keep one slot per method plus one for unknown ids.
pub const METHOD_COUNT: usize = Method::ALL.len();

fn id_table() -> &'static [(u32, Method)] {
    static TABLE: OnceLock<Vec<(u32, Method)>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t: Vec<(u32, Method)> = Method::ALL
            .iter()
            .map(|&m| (function_id_of(m.name()), m))
            .collect();
        t.sort_unstable_by_key(|e| e.0);
        t
    })
}

/// The function id of a master method name (without the class prefix).
pub fn function_id_of(name: &str) -> u32 {
    let mut s = String::with_capacity(QUALIFIED_PREFIX.len() + name.len());
    s.push_str(QUALIFIED_PREFIX);
    s.push_str(name);
    md5_32(s.as_bytes())
}

impl Method {
    /// Position in [`Method::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    pub fn function_id(self) -> u32 {
        function_id_of(self.name())
    }

    /// The method a request header's function id names, if this master registers it.
    pub fn from_function_id(id: u32) -> Option<Method> {
        let t = id_table();
        t.binary_search_by_key(&id, |e| e.0).ok().map(|i| t[i].1)
    }
}

impl std::fmt::Display for Method {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_match_the_spec_table() {
        for (name, id) in [
            ("PutStart", 0x65ea_9ac1),
            ("BatchExistKey", 0xb89f_a6b0),
            ("GetReplicaList", 0x1f7e_f174),
            ("Ping", 0xd6c2_dae5),
            ("ServiceReady", 0x7b81_bb56),
            ("RemoveAll", 0xd978_ceb0),
            ("GetAllNoFSegments", 0x04eb_3c85),
        ] {
            assert_eq!(function_id_of(name), id, "{name}");
        }
        assert_eq!(Method::ALL.len(), 64);
    }

    #[test]
    fn every_id_maps_back() {
        for &m in Method::ALL {
            assert_eq!(Method::from_function_id(m.function_id()), Some(m));
        }
        // the client knows CalcCacheStats, the master does not register it
        assert_eq!(Method::from_function_id(0x8ecf_1981), None);
    }
}

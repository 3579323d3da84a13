//! Where recently read values are (`kv.replica_cache_ms`, off by default).

use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;

use crate::codec::types::BufferDescriptor;

/// Where recently read values are, reused while the read lease the master granted with
/// the answer still has time left: within it the master neither evicts the object nor
/// removes it (unforced), so its bytes stay where the descriptor says. A read through a
/// cached descriptor that fails drops the entry and asks the master again.
pub struct ReplicaCache {
    ttl: Duration,
    entries: Mutex<std::collections::HashMap<Bytes, (BufferDescriptor, std::time::Instant)>>,
}

/// Entries the replica cache holds at most (expired ones are swept when it is full).
const REPLICA_CACHE_ENTRIES: usize = 65_536;

impl ReplicaCache {
    pub fn get(&self, key: &Bytes) -> Option<BufferDescriptor> {
        let map = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        map.get(key)
            .filter(|(_, until)| *until > std::time::Instant::now())
            .map(|(d, _)| d.clone())
    }

    /// Keeps `d` for `key` for the cache's ttl, at most half the granted lease.
    pub fn put(&self, key: Bytes, d: &BufferDescriptor, lease_ttl_ms: u64) {
        let ttl = self.ttl.min(Duration::from_millis(lease_ttl_ms / 2));
        if ttl.is_zero() {
            return;
        }
        let now = std::time::Instant::now();
        let mut map = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() >= REPLICA_CACHE_ENTRIES {
            map.retain(|_, (_, until)| *until > now);
            if map.len() >= REPLICA_CACHE_ENTRIES {
                return;
            }
        }
        map.insert(key, (d.clone(), now + ttl));
    }

    pub fn forget(&self, key: &Bytes) {
        self.entries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(key);
    }
}

impl ReplicaCache {
    /// Keeps descriptors for up to `ttl` (never longer than half the read lease).
    pub fn new(ttl: Duration) -> ReplicaCache {
        ReplicaCache {
            ttl,
            entries: Mutex::new(std::collections::HashMap::new()),
        }
    }
}

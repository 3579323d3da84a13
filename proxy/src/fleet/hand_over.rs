//! Key-table entries whose home is now another member (the ring changed, or this member
//! is leaving) go there: the only place the fleet takes entries out of the key table.

use std::collections::HashMap;

use bytes::Bytes;

use super::forward::{Forwarder, Homes};
use super::metrics::FleetMetrics;
use super::records::{self, Adopted, Record};
use crate::keys::Keys;

/// Entries per record: a record is one frame of the batch and is decoded whole.
const PER_RECORD: usize = 1024;

/// Queues the entries homed at another member on `homes` for it, in records of at most
/// [`PER_RECORD`] entries, ages and leases as durations (the members' clocks differ).
pub fn hand_over(keys: &Keys, f: &Forwarder, homes: &Homes, metrics: &FleetMetrics) {
    let now = keys.now_ms();
    let moved = keys.table.drain_where(|t, k| homes.other(t, k).is_some());
    if moved.is_empty() {
        return;
    }
    let n = moved.len();
    let mut groups: HashMap<(usize, Bytes), Vec<Adopted>> = HashMap::new();
    for (tenant, key, e, segment) in moved {
        let Some(h) = homes.other(&tenant, &key) else {
            continue;
        };
        groups.entry((h, tenant)).or_default().push(Adopted {
            key,
            client: e.client,
            arm: e.arm,
            size: e.size,
            tier: e.tier,
            age_ms: now.saturating_sub(e.last_ms),
            hits: e.hits,
            lease_left_ms: e.leased_until_ms.saturating_sub(now),
            complete: e.complete,
            on_disk: e.on_disk,
            segment,
            tries: e.tries,
        });
    }
    for ((h, tenant), items) in groups {
        for chunk in items.chunks(PER_RECORD) {
            let r = Record {
                tenant: tenant.clone(),
                client: Default::default(),
                arm: 0,
                what: records::What::Adopt(chunk.to_vec()),
            };
            f.queue(homes, h, &r);
        }
    }
    metrics.handed_over.inc_by(n as u64);
    keys.counted();
    tracing::info!(
        entries = n,
        "fleet: key-table entries handed to their new homes"
    );
}

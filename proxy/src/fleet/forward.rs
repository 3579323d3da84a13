//! Where access records go: the ring of members that are homes to keys, and what this
//! member gathered for each of them, bounded, until [`super::send`] posts it (every
//! `fleet.records_flush_ms`, one `POST /fleet/records` to each member's admin endpoint).
//! What records mean is [`super::records`]' and the key table's business.
//!
//! Records are hints: a batch a member cannot take (it died, it is slow, its pending
//! bytes are full) is dropped and counted, never retried, and never blocks a request.
//! The master's own eviction stays the backstop for whatever a lost record leaves
//! unmanaged.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::{Bytes, BytesMut};

use super::metrics::FleetMetrics;
use super::records::{self, Record, Ring};
use super::{FleetConfig, View};

/// The members that take records, and which of them this one is.
#[derive(Debug, Default)]
pub struct Homes {
    pub ring: Ring,
    /// This member's index on the ring (`None`: not on it yet; it keeps every key).
    me: Option<usize>,
    /// Each member's admin endpoint (by ring index).
    pub(super) admin: Vec<String>,
    /// Bumped on every change of the ring.
    pub generation: u64,
}

impl Homes {
    /// The ring index of `(tenant, key)`'s home when that is another member; `None`
    /// when it is this one (or the ring has no other member).
    #[inline]
    pub fn other(&self, tenant: &[u8], key: &[u8]) -> Option<usize> {
        let me = self.me?;
        self.ring.home(tenant, key).filter(|&h| h != me)
    }

    /// Whether records travel at all (another member takes them).
    pub fn shared(&self) -> bool {
        self.me.is_some() && self.ring.members.len() > 1
    }

    /// The ring without this member: where its entries go when it leaves.
    pub fn without_me(&self) -> Homes {
        let keep: Vec<usize> = (0..self.ring.members.len())
            .filter(|&i| Some(i) != self.me)
            .collect();
        let names: Vec<String> = keep.iter().map(|&i| self.ring.members[i].clone()).collect();
        let ring = Ring::new(names);
        let admin = ring
            .members
            .iter()
            .map(|m| {
                let i = self.ring.members.iter().position(|n| n == m).unwrap_or(0);
                self.admin.get(i).cloned().unwrap_or_default()
            })
            .collect();
        Homes {
            ring,
            // Every key is another member's now; index past the end is never a home.
            me: Some(usize::MAX),
            admin,
            generation: self.generation + 1,
        }
    }
}

/// Gathers records per member and sends them.
pub struct Forwarder {
    me: String,
    pub(super) flush: Duration,
    max_pending: usize,
    /// `admin.token`, sent as a bearer token (members share their admin settings).
    pub(super) token: String,
    homes: ArcSwap<Homes>,
    pending: Mutex<HashMap<String, BytesMut>>,
    pub(super) metrics: Arc<FleetMetrics>,
}

impl Forwarder {
    pub fn new(cfg: &FleetConfig, me: String, token: String, metrics: Arc<FleetMetrics>) -> Self {
        Forwarder {
            me,
            flush: Duration::from_millis(cfg.records_flush_ms.max(1)),
            max_pending: cfg.records_max_pending_bytes as usize,
            token,
            homes: ArcSwap::from_pointee(Homes::default()),
            pending: Mutex::new(HashMap::new()),
            metrics,
        }
    }

    /// The ring now (one load per answer, not per key).
    pub fn homes(&self) -> Arc<Homes> {
        self.homes.load_full()
    }

    /// Rebuilds the ring from a new view: the members that take records and name an
    /// admin endpoint, and this one.
    pub fn set_view(&self, view: &View) {
        let mut admin_of: HashMap<String, String> = view
            .members
            .iter()
            .filter(|(m, r)| r.records && !r.admin.is_empty() && m.as_str() != self.me)
            .map(|(m, r)| (m.clone(), r.admin.clone()))
            .collect();
        let mut names: Vec<String> = admin_of.keys().cloned().collect();
        names.push(self.me.clone());
        let old = self.homes.load();
        let ring = Ring::new(names);
        let admin: Vec<String> = ring
            .members
            .iter()
            .map(|m| admin_of.remove(m).unwrap_or_default())
            .collect();
        // A member that restarted under its name may listen elsewhere now.
        if ring.members == old.ring.members && admin == old.admin {
            return;
        }
        let me = ring.members.iter().position(|m| *m == self.me);
        tracing::info!(members = ring.members.len(), "fleet: record ring changed");
        self.homes.store(Arc::new(Homes {
            ring,
            me,
            admin,
            generation: old.generation + 1,
        }));
    }

    /// Adds a record for the member at ring index `home` of `homes`. Dropped (and
    /// counted) when that member's pending bytes are full, or when it cannot be encoded.
    pub fn queue(&self, homes: &Homes, home: usize, r: &Record) {
        let Some(name) = homes.ring.members.get(home) else {
            return;
        };
        let mut p = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let buf = match p.get_mut(name) {
            Some(b) => b,
            None => p.entry(name.clone()).or_insert_with(records::batch),
        };
        if buf.len() >= self.max_pending {
            self.metrics.records_dropped[0].inc();
            return;
        }
        if records::encode(buf, r).is_err() {
            self.metrics.records_dropped[0].inc();
        }
    }

    /// Adds a record for every other member (a tenant's RemoveAll names no key).
    pub fn broadcast(&self, homes: &Homes, r: &Record) {
        for i in 0..homes.ring.members.len() {
            if Some(i) != homes.me {
                self.queue(homes, i, r);
            }
        }
    }

    /// Takes every member's pending batch (the sender does, once per flush).
    pub fn take_pending(&self) -> Vec<(String, Bytes)> {
        let mut p = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        p.iter_mut()
            .filter(|(_, b)| !records::is_empty(b))
            .map(|(m, b)| {
                let body = std::mem::replace(b, records::batch()).freeze();
                (m.clone(), body)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(members: &[(&str, bool, &str)]) -> View {
        let mut v = View::default();
        for (m, records, admin) in members {
            v.members.insert(
                m.to_string(),
                super::super::Record {
                    member: m.to_string(),
                    records: *records,
                    admin: admin.to_string(),
                    ..Default::default()
                },
            );
        }
        v
    }

    #[test]
    fn the_ring_holds_the_members_that_take_records_and_follows_their_addresses() {
        let metrics = Arc::new(FleetMetrics::register(
            &mut prometheus_client::registry::Registry::default(),
        ));
        let f = Forwarder::new(&FleetConfig::default(), "a".into(), String::new(), metrics);
        assert!(!f.homes().shared(), "alone until the view says otherwise");
        f.set_view(&view(&[
            ("a", true, "h:1"),
            ("b", true, "h:2"),
            ("c", false, "h:3"),
        ]));
        let h = f.homes();
        assert_eq!(h.ring.members, ["a", "b"], "c takes no records");
        assert!(h.shared());
        let g = h.generation;
        // The same view again changes nothing; b listening elsewhere does.
        f.set_view(&view(&[("a", true, "h:1"), ("b", true, "h:2")]));
        assert_eq!(f.homes().generation, g);
        f.set_view(&view(&[("a", true, "h:1"), ("b", true, "h:9")]));
        assert_eq!(f.homes().generation, g + 1);
        // Leaving: every key's home is another member.
        let gone = f.homes().without_me();
        assert!((0..100).all(|i| gone.other(b"t", format!("k{i}").as_bytes()) == Some(0)));
        // About half of the keys are homed at b.
        let homes = f.homes();
        let theirs = (0..100)
            .filter(|i| homes.other(b"t", format!("k{i}").as_bytes()).is_some())
            .count();
        assert!((20..=80).contains(&theirs), "{theirs} of 100 homed at b");
    }
}

//! What an answered call tells moongate, as one value with one sink.
//!
//! Each face (the master face for Mooncake clients, the kv face for engines) turns a
//! call it answered into one [`Answered`]: who asked (tenant, client, the arm that
//! served it), what the master's answer said of each key (stored, placed, completed,
//! found with its tier, missed, removed, cleared, denied bytes), what it said of SSD
//! copies, and for a lookup what the reader was served. [`Sink::answered`] is the one
//! place that value goes: it feeds the key table and its history (eviction, miss
//! reasons, KV events: [`crate::keys`]), the SSD usage followed and the tiers served to
//! each peer ([`crate::topology`]), and, in a fleet, the access records of keys homed at
//! another member ([`crate::fleet::forward`]).
//!
//! Knows no frame and no connection: faces decode, this applies.

use std::sync::Arc;

use bytes::Bytes;

use crate::calls::offload::Item;
use crate::calls::{Seen, Tracked};
use crate::codec::keys::Keys as KeyList;
use crate::codec::message::Response;
use crate::codec::types::Uuid;
use crate::codec::types::{Expected, GetReplicaListResponse};
use crate::fleet::forward::{Forwarder, Homes};
use crate::fleet::records::{self, Record};
use crate::keys::Keys;
use crate::policy::metrics::ArmMetrics;
use crate::topology::{LookupRole, Peer, SsdSeen, Topology};

/// One answered call, as a face observed it.
pub struct Answered<'a> {
    /// What the master's answer said, taken before the face rewrote it for its client.
    pub said: Said,
    /// The arm that served the call: its index and name.
    pub arm: usize,
    pub arm_name: &'a str,
    /// A lookup's answers as the reader got them (after steering), when the face
    /// counts what it serves to whom (the master face).
    pub read: Option<Read<'a>>,
}

/// What the master's own answer said of keys and SSD copies (owned: the face may
/// rewrite the answer before the observation is handed over). Nothing, without a key
/// table kept or SSD usage followed: a pointer's worth that the common call carries and
/// drops for free.
#[derive(Default)]
pub struct Said(Option<Box<SaidOf>>);

#[derive(Default)]
struct SaidOf {
    /// The call's tenant and client, when it was tracked.
    who: Option<(Bytes, Uuid)>,
    seen: Vec<Seen>,
    ssd: Option<SsdSeen>,
}

/// A lookup's answers as served to a peer.
pub struct Read<'a> {
    pub peer: &'a Peer,
    pub tenant: &'a Bytes,
    pub keys: &'a KeyList,
    pub answers: &'a [Expected<GetReplicaListResponse>],
    pub arm: &'a ArmMetrics,
}

/// Where every face's observations go (built once at start, shared by the faces and
/// the admin endpoint).
pub struct Sink {
    keys: Option<Arc<Keys>>,
    /// Access records of keys homed at other members (`[fleet]` with records on).
    records: Option<Arc<Forwarder>>,
    topology: Arc<Topology>,
}

impl Sink {
    /// `keys`: the key table, when one is kept (`[eviction]` or `[events]` on);
    /// `records`: the fleet's access-record forwarder, when records travel.
    pub fn new(
        keys: Option<Arc<Keys>>,
        records: Option<Arc<Forwarder>>,
        topology: Arc<Topology>,
    ) -> Sink {
        Sink {
            records: records.filter(|_| keys.is_some()),
            keys,
            topology,
        }
    }

    /// The key table, when one is kept.
    pub fn keys(&self) -> Option<&Arc<Keys>> {
        self.keys.as_ref()
    }

    /// Whether per-key outcomes are wanted (a key table is kept): faces then track the
    /// calls that change it.
    pub fn keeps_keys(&self) -> bool {
        self.keys.is_some()
    }

    /// What the master's answer says, read before the face rewrites it: per-key
    /// outcomes of a tracked call (a key table kept) and SSD copies listed by a lookup
    /// (SSD usage followed). `lookup`: the lookup's tenant and keys.
    #[inline]
    pub fn said(
        &self,
        tracked: Option<&Tracked>,
        lookup: Option<(&Bytes, &KeyList)>,
        resp: &Response,
    ) -> Said {
        // Most calls: no table kept and no SSD followed, nothing to take.
        if (tracked.is_none() || self.keys.is_none()) && !self.topology.ssd_tracking() {
            return Said(None);
        }
        self.said_of(tracked, lookup, resp)
    }

    fn said_of(
        &self,
        tracked: Option<&Tracked>,
        lookup: Option<(&Bytes, &KeyList)>,
        resp: &Response,
    ) -> Said {
        let track = tracked.filter(|_| self.keys.is_some() || self.topology.ssd_tracking());
        let ssd = match (lookup, self.topology.ssd_tracking()) {
            (Some((tenant, keys)), true) => crate::calls::lookup::results(resp)
                .and_then(|answers| Topology::ssd_seen(tenant, keys, answers)),
            _ => None,
        };
        if track.is_none() && ssd.is_none() {
            return Said(None);
        }
        Said(Some(Box::new(SaidOf {
            who: track.map(|t| (t.tenant.clone(), t.client)),
            seen: track.map(|t| t.seen(resp)).unwrap_or_default(),
            ssd,
        })))
    }

    /// Takes one observation: the SSD copies followed, the key table (or the keys'
    /// home members) told, and a lookup's tiers counted to its peer. Returns what the
    /// lookup was (an owner's look before offloading is no read).
    #[inline]
    pub fn answered(&self, a: Answered<'_>) -> LookupRole {
        if let Said(Some(said)) = a.said {
            self.take_said(*said, a.arm, a.arm_name);
        }
        match a.read {
            Some(r) => self
                .topology
                .lookup(r.peer, r.tenant, r.keys, r.answers, r.arm),
            None => LookupRole::Read,
        }
    }

    /// What the master's answer said: SSD copies followed, the key table (or the keys'
    /// home members) told.
    fn take_said(&self, said: SaidOf, arm: usize, arm_name: &str) {
        if let Some(ssd) = &said.ssd {
            self.topology.follow_ssd(ssd);
        }
        let Some((tenant, client)) = &said.who else {
            return;
        };
        if self.topology.ssd_tracking() {
            for seen in &said.seen {
                match seen {
                    Seen::Removed(keys) => self
                        .topology
                        .ssd_removed(keys.iter().map(|k| (&tenant[..], &k[..]))),
                    Seen::Cleared => self.topology.ssd_cleared(tenant),
                    _ => {}
                }
            }
        }
        if let Some(keys) = &self.keys {
            self.to_keys(keys, tenant, *client, said.seen, arm, arm_name);
        }
    }

    /// Applies what was seen to the table here, or queues it for the keys' home
    /// members in a fleet.
    fn to_keys(
        &self,
        keys: &Keys,
        tenant: &Bytes,
        client: Uuid,
        seen: Vec<Seen>,
        arm: usize,
        arm_name: &str,
    ) {
        match self.routes() {
            Some((f, homes)) => {
                let arm8 = arm.min(u8::MAX as usize) as u8;
                let rec = |what| Record {
                    tenant: tenant.clone(),
                    client,
                    arm: arm8,
                    what,
                };
                for s in seen {
                    if matches!(s, Seen::Cleared) {
                        f.broadcast(&homes, &rec(records::What::Seen(Seen::Cleared)));
                    }
                    let (mine, theirs) = records::split(s, |k| homes.other(tenant, k));
                    for (h, s) in theirs {
                        f.queue(&homes, h, &rec(records::What::Seen(s)));
                    }
                    if let Some(s) = mine {
                        keys.apply(tenant, client, s, arm, arm_name);
                    }
                }
            }
            None => {
                for s in seen {
                    keys.apply(tenant, client, s, arm, arm_name);
                }
            }
        }
        keys.counted();
    }

    /// The forwarder and its ring, when access records travel (another member on it).
    fn routes(&self) -> Option<(&Forwarder, Arc<Homes>)> {
        let f = self.records.as_deref()?;
        let homes = f.homes();
        homes.shared().then_some((f, homes))
    }

    /// Keys of a put a policy denied (moongate answered for them; they never reach the
    /// master, so no answer will say so).
    pub fn refused(&self, tenant: &Bytes, keys: &[&Bytes], arm: usize) {
        if let Some(k) = &self.keys {
            k.refused(tenant, keys, arm);
        }
    }

    /// Keys an owner wrote to its SSD (its offload notice, answered): marked in the
    /// table here, or sent to their home members.
    pub fn offloaded(&self, items: &[Item]) {
        let Some(keys) = &self.keys else {
            return;
        };
        let Some((f, homes)) = self.routes() else {
            return keys.on_disk(items.iter().map(|i| (&i.tenant, &i.key)));
        };
        let mut theirs: std::collections::HashMap<(usize, Bytes), Vec<Bytes>> =
            std::collections::HashMap::new();
        let mut mine = Vec::new();
        for i in items {
            match homes.other(&i.tenant, &i.key) {
                Some(h) => theirs
                    .entry((h, i.tenant.clone()))
                    .or_default()
                    .push(i.key.clone()),
                None => mine.push(i),
            }
        }
        for ((h, tenant), keys) in theirs {
            let r = Record {
                tenant,
                client: Default::default(),
                arm: 0,
                what: records::What::Offloaded(keys),
            };
            f.queue(&homes, h, &r);
        }
        keys.on_disk(mine.into_iter().map(|i| (&i.tenant, &i.key)));
    }

    /// Access records other members sent for keys homed here (`POST /fleet/records`):
    /// as if this member's faces had answered them. `arm_name` names an arm by index
    /// (for miss reasons). `false`: no key table here to take them.
    pub fn accept(&self, recs: Vec<Record>, arm_name: impl Fn(usize) -> String) -> bool {
        let Some(keys) = &self.keys else {
            return false;
        };
        for r in recs {
            match r.what {
                records::What::Seen(s) => {
                    let arm = usize::from(r.arm);
                    keys.apply(&r.tenant, r.client, s, arm, &arm_name(arm));
                }
                records::What::Offloaded(ks) => keys.on_disk(ks.iter().map(|k| (&r.tenant, k))),
                records::What::Adopt(items) => keys.adopt(&r.tenant, &items),
            }
        }
        keys.counted();
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calls::Track;
    use crate::codec::types::ErrorCode;
    use crate::keys::Why;

    fn k(s: &'static str) -> Bytes {
        Bytes::from_static(s.as_bytes())
    }

    /// A tracked call of tenant `default`.
    fn tracked(what: Track) -> Tracked {
        Tracked {
            tenant: Bytes::from_static(b"default"),
            what,
            client: Default::default(),
        }
    }

    /// A sink keeping a key table, with no fleet.
    fn sink(metrics: &crate::metrics::Metrics, events: Option<Arc<crate::events::Events>>) -> Sink {
        let bounds = crate::keys::Bounds {
            max_keys: 1000,
            lease_ms: 10_000,
            history_keys: 1000,
        };
        let keys = Keys::new(bounds, metrics.keys.clone(), events);
        let topology = Arc::new(Topology::new(metrics.topology.clone()));
        Sink::new(Some(Arc::new(keys)), None, topology)
    }

    /// `keys` (1 byte each) put and ended on arm 0, "a".
    fn stored(sink: &Sink, keys: &[&'static str]) {
        let put = keys.iter().map(|x| (k(x), 1)).collect();
        let started = keys.iter().map(|_| Ok(vec![])).collect();
        tell(
            sink,
            &tracked(Track::Put(put)),
            &Response::BatchPutStart(started),
            0,
            "a",
        );
        let ended = keys.iter().map(|_| Ok(())).collect();
        let end = Track::End(keys.iter().map(|x| k(x)).collect());
        tell(sink, &tracked(end), &Response::BatchPutEnd(ended), 0, "a");
    }

    /// One answered call, as a face hands it over (arm `arm` named `name`).
    fn tell(sink: &Sink, t: &Tracked, resp: &Response, arm: usize, name: &str) {
        let said = sink.said(Some(t), None, resp);
        sink.answered(Answered {
            said,
            arm,
            arm_name: name,
            read: None,
        });
    }

    #[test]
    fn answers_update_the_table() {
        let metrics = crate::metrics::Metrics::new();
        let ev = sink(&metrics, None);
        let tenant = Bytes::from_static(b"default");
        let tracked = |what| Tracked {
            tenant: tenant.clone(),
            what,
            client: Default::default(),
        };
        let t = tracked(Track::Put(vec![
            (Bytes::from_static(b"a"), 100),
            (Bytes::from_static(b"b"), 50),
        ]));
        tell(
            &ev,
            &t,
            &Response::BatchPutStart(vec![Ok(vec![]), Err(ErrorCode::NO_AVAILABLE_HANDLE)]),
            0,
            "a",
        );
        assert_eq!(ev.keys().unwrap().table.len(), 1);
        assert_eq!(ev.keys().unwrap().take_denied(), 50);
        tell(
            &ev,
            &tracked(Track::End(vec![Bytes::from_static(b"a")])),
            &Response::BatchPutEnd(vec![Ok(())]),
            0,
            "a",
        );
        let look = tracked(Track::Lookup(vec![Bytes::from_static(b"a")].into()));
        tell(&ev, &look, &Response::BatchExistKey(vec![Ok(true)]), 0, "a");
        assert!(
            ev.keys().unwrap().table.candidates(1, 0).is_empty(),
            "leased by the lookup"
        );
        assert_eq!(
            ev.keys().unwrap().table.candidates(1, u64::MAX)[0].1.hits,
            1
        );
        tell(&ev, &look, &Response::ExistKey(Ok(false)), 0, "a");
        assert!(
            ev.keys().unwrap().table.is_empty(),
            "a miss means the master dropped it"
        );
        assert_eq!(
            ev.keys()
                .unwrap()
                .history
                .last(&tenant, &Bytes::from_static(b"a"))
                .unwrap()
                .why,
            Why::evicted_by_master
        );
    }

    #[test]
    fn the_table_tells_events_what_was_stored_and_what_is_gone() {
        use crate::events::{Change, Events, EventsConfig, What};
        let metrics = crate::metrics::Metrics::new();
        let (events, mut rx) = Events::new(&EventsConfig::default(), metrics.events.clone());
        let ev = sink(&metrics, Some(events));
        tell(
            &ev,
            &tracked(Track::Put(vec![(k("a"), 1), (k("b"), 1), (k("c"), 1)])),
            &Response::BatchPutStart(vec![Ok(vec![]), Ok(vec![]), Ok(vec![])]),
            2,
            "x",
        );
        // Nothing is stored until the put ends; a repeated end says nothing new.
        assert!(rx.try_recv().is_err());
        for _ in 0..2 {
            tell(
                &ev,
                &tracked(Track::End(vec![k("a"), k("b"), k("c")])),
                &Response::BatchPutEnd(vec![Ok(()), Ok(()), Ok(())]),
                2,
                "x",
            );
        }
        let stored = rx.try_recv().unwrap();
        assert_eq!(
            (stored.what, stored.arm, stored.keys.len()),
            (What::Stored, 2, 3)
        );
        assert!(rx.try_recv().is_err());
        // A client's removal, a key found gone (the master's eviction), a RemoveAll.
        tell(
            &ev,
            &tracked(Track::Remove(k("a"))),
            &Response::Remove(Ok(())),
            0,
            "x",
        );
        tell(
            &ev,
            &tracked(Track::Lookup(vec![k("b"), k("never")].into())),
            &Response::BatchExistKey(vec![Ok(false), Ok(false)]),
            0,
            "x",
        );
        tell(
            &ev,
            &tracked(Track::RemoveAll),
            &Response::RemoveAll(1),
            0,
            "x",
        );
        let rest: Vec<Change> = std::iter::from_fn(|| rx.try_recv().ok()).collect();
        let shapes: Vec<(What, Vec<Bytes>, u8)> =
            rest.into_iter().map(|c| (c.what, c.keys, c.arm)).collect();
        assert_eq!(
            shapes,
            [
                (What::Removed, vec![k("a")], 2),
                (What::Removed, vec![k("b")], 2),
                (What::Cleared, vec![], 0),
            ]
        );
    }

    /// A key a lookup found gone at the master is gone before any later instant and not
    /// before an earlier one; removed through moongate, it ended here instead; stored
    /// again, neither.
    #[test]
    fn gone_before_a_leader_change_is_what_a_lookup_found_gone_earlier() {
        let metrics = crate::metrics::Metrics::new();
        let ev = sink(&metrics, None);
        let keys = ev.keys().expect("a key table");
        let tenant = Bytes::from_static(b"default");
        stored(&ev, &["g", "r"]);
        let earlier = std::time::Instant::now();
        std::thread::sleep(std::time::Duration::from_millis(5));
        tell(
            &ev,
            &tracked(Track::Lookup(vec![k("g")].into())),
            &Response::BatchExistKey(vec![Ok(false)]),
            0,
            "a",
        );
        tell(
            &ev,
            &tracked(Track::Remove(k("r"))),
            &Response::Remove(Ok(())),
            0,
            "a",
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
        let later = std::time::Instant::now();
        assert!(keys.gone_before(&tenant, &k("g"), later));
        assert!(!keys.gone_before(&tenant, &k("g"), earlier));
        assert!(!keys.ended_here(&tenant, &k("g")));
        assert!(keys.ended_here(&tenant, &k("r")));
        assert!(!keys.gone_before(&tenant, &k("r"), later));
        stored(&ev, &["g"]);
        assert!(!keys.gone_before(&tenant, &k("g"), later));
    }

    /// A lookup that finds a key gone between moongate's `Remove` and the evictor
    /// reading its answer: moongate's eviction (a soak counted such keys as lost, the
    /// master having evicted nothing), announced once, not again at the departure.
    #[test]
    fn a_miss_racing_moongates_removal_is_moongates_eviction_announced_once() {
        use crate::events::{Events, EventsConfig, What};
        let metrics = crate::metrics::Metrics::new();
        let (events, mut rx) = Events::new(&EventsConfig::default(), metrics.events.clone());
        let ev = sink(&metrics, Some(events));
        let tenant = Bytes::from_static(b"default");
        stored(&ev, &["x", "y"]);
        assert_eq!(rx.try_recv().unwrap().what, What::Stored);
        let keys = ev.keys().unwrap();
        let chosen: Vec<(Bytes, crate::keys::table::Entry)> = [k("x"), k("y")]
            .into_iter()
            .map(|x| {
                let e = keys.table.get(&tenant, &x).unwrap();
                (x, e)
            })
            .collect();
        // The evictor marks both and sends their removals; a lookup finds "x" gone
        // before the answers are read.
        keys.table
            .mark_removing(chosen.iter().map(|(x, e)| (&e.tenant, x)), true);
        tell(
            &ev,
            &tracked(Track::Lookup(vec![k("x")].into())),
            &Response::BatchExistKey(vec![Ok(false)]),
            0,
            "a",
        );
        assert_eq!(
            keys.history.last(&tenant, &k("x")).unwrap().why,
            Why::evicted_by_moongate
        );
        // The answers: both removed; the departure announces only "y".
        let mut gone = keys.departures();
        for (x, e) in &chosen {
            gone.whole(x, e);
        }
        keys.depart(gone);
        let removed: Vec<Vec<Bytes>> = std::iter::from_fn(|| rx.try_recv().ok())
            .map(|c| {
                assert_eq!(c.what, What::Removed);
                c.keys
            })
            .collect();
        assert_eq!(removed, [vec![k("x")], vec![k("y")]]);
        assert!(keys.table.is_empty());
        // Unmarked (the master kept it under a lease), a later miss is the master's.
        stored(&ev, &["z"]);
        keys.table
            .mark_removing(std::iter::once((&tenant, &k("z"))), true);
        keys.table
            .mark_removing(std::iter::once((&tenant, &k("z"))), false);
        tell(
            &ev,
            &tracked(Track::Lookup(vec![k("z")].into())),
            &Response::BatchExistKey(vec![Ok(false)]),
            0,
            "a",
        );
        assert_eq!(
            keys.history.last(&tenant, &k("z")).unwrap().why,
            Why::evicted_by_master
        );
    }

    #[test]
    fn every_miss_gets_a_reason() {
        let metrics = crate::metrics::Metrics::new();
        let ev = sink(&metrics, None);
        let tenant = Bytes::from_static(b"default");
        // "gone" stored then missed (the master dropped it); "rm" removed by a client;
        // "ev" evicted by moongate; "no" refused by a policy; "new" never seen.
        stored(&ev, &["gone", "rm"]);
        tell(
            &ev,
            &tracked(Track::Remove(k("rm"))),
            &Response::Remove(Ok(())),
            0,
            "a",
        );
        ev.keys()
            .unwrap()
            .history
            .note(&tenant, [k("ev")].iter(), Why::evicted_by_moongate, 1, 0);
        ev.refused(&tenant, &[&k("no")], 1);
        let keys = vec![k("gone"), k("rm"), k("ev"), k("no"), k("new")];
        tell(
            &ev,
            &tracked(Track::Lookup(keys.into())),
            &Response::BatchExistKey(vec![Ok(false); 5]),
            0,
            "a",
        );
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &metrics.registry).unwrap();
        for why in [
            "evicted_by_master",
            "removed_by_client",
            "evicted_by_moongate",
            "refused_by_policy",
            "never_stored",
        ] {
            assert!(
                text.contains(&format!(
                    "moongate_lookup_misses_total{{reason=\"{why}\",arm=\"a\"}} 1"
                )),
                "{why}: {text}"
            );
        }
        // Stored again: its history is forgotten.
        tell(
            &ev,
            &tracked(Track::Put(vec![(k("rm"), 1)])),
            &Response::BatchPutStart(vec![Ok(vec![])]),
            0,
            "a",
        );
        assert!(ev.keys().unwrap().history.last(&tenant, &k("rm")).is_none());
        let state = ev.keys().unwrap().key_state(&tenant, &k("rm"));
        assert!(
            state["stored"].is_object() && state["last_end"].is_null(),
            "{state}"
        );
    }
}

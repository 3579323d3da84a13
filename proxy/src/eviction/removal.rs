//! What a round does to its victims on the master: `Remove` (every copy goes), or with
//! an SSD tier offloading, `BatchReplicaClear` of their memory replicas only; what went
//! leaves the key table together, announced.

use super::*;

impl Evictor {
    /// Removes the victims' keys (`Remove`, not forced): every copy goes, an SSD's too.
    pub(super) async fn remove(
        &self,
        c: &mut Conn,
        chosen: &[(Bytes, Entry)],
        set: &ActiveSet,
    ) -> Result<(), crate::upstream::CallError> {
        let reqs: Vec<Request> = chosen
            .iter()
            .map(|(k, e)| {
                Request::Remove(RemoveArgs {
                    key: k.clone(),
                    force: false,
                    tenant_id: e.tenant.clone(),
                })
            })
            .collect();
        let mut gone = self.keys.departures();
        // Marked before the removals go: a lookup that finds one gone before its answer
        // is read here counts it as moongate's eviction, not the master's. A chunk whose
        // answers are lost stays marked (its removals may have been applied).
        self.keys
            .table
            .mark_removing(chosen.iter().map(|(k, e)| (&e.tenant, k)), true);
        for (chunk, entries) in reqs.chunks(CHUNK).zip(chosen.chunks(CHUNK)) {
            let answers = c
                .call_all(chunk, self.call_timeout())
                .await
                .inspect_err(|_| {
                    self.metrics.error(Stage::Remove);
                })?;
            // Keys the master answered it kept: no longer being removed.
            let mut kept: Vec<(&Bytes, &Bytes)> = Vec::new();
            for ((k, e), a) in entries.iter().zip(answers) {
                let result = match a {
                    Ok(Response::Remove(Ok(()))) => {
                        self.freed(k, e, set, true);
                        gone.whole(k, e);
                        Victim::Removed
                    }
                    Ok(Response::Remove(Err(ErrorCode::OBJECT_HAS_LEASE))) => {
                        kept.push((&e.tenant, k));
                        Victim::Leased
                    }
                    Ok(Response::Remove(Err(ErrorCode::OBJECT_NOT_FOUND))) => {
                        // Already gone (the master evicted it): gone all the same.
                        gone.whole(k, e);
                        Victim::NotFound
                    }
                    other => {
                        tracing::debug!(key = ?k, answer = ?other, "eviction removal failed");
                        kept.push((&e.tenant, k));
                        Victim::Error
                    }
                };
                self.metrics.victim(result);
            }
            if !kept.is_empty() {
                self.keys.table.mark_removing(kept.into_iter(), false);
            }
        }
        tracing::debug!(removed = gone.keys().len(), "eviction round");
        self.topology
            .ssd_removed(gone.keys().map(|(t, k)| (&t[..], &k[..])));
        self.keys.depart(gone);
        Ok(())
    }

    /// With an SSD tier offloading: drops only the victims' memory replicas
    /// (`BatchReplicaClear` naming the memory segment and the client that put them), so
    /// a copy on an owner's SSD stays; a key with no other copy goes, as with `Remove`.
    /// A victim whose memory segment moongate does not know is kept: never a `Remove`,
    /// which would delete the SSD copy too.
    pub(super) async fn clear_memory(
        &self,
        c: &mut Conn,
        chosen: &[(Bytes, Entry)],
        set: &ActiveSet,
        topo: &crate::topology::Topology,
    ) -> Result<(), crate::upstream::CallError> {
        use crate::codec::message::ReplicaClearArgs;
        // One call per (client, segment): the master checks both per key.
        let mut groups: std::collections::BTreeMap<(u64, u64, u16), Vec<usize>> =
            Default::default();
        for (i, (_, e)) in chosen.iter().enumerate() {
            if e.segment == NO_SEGMENT {
                self.metrics.victim(Victim::Kept);
                continue;
            }
            groups
                .entry((e.client.first, e.client.second, e.segment))
                .or_default()
                .push(i);
        }
        let mut gone = self.keys.departures();
        for ((first, second, seg), idx) in groups {
            let Some(endpoint) = self.keys.table.segment(seg) else {
                continue;
            };
            let name = topo.segment_name(&endpoint);
            for part in idx.chunks(CHUNK) {
                let req = Request::BatchReplicaClear(ReplicaClearArgs {
                    keys: part.iter().map(|&i| chosen[i].0.clone()).collect(),
                    client_id: crate::codec::types::Uuid { first, second },
                    segment_name: name.clone(),
                });
                let answer = c
                    .call_all(std::slice::from_ref(&req), self.call_timeout())
                    .await
                    .inspect_err(|_| self.metrics.error(Stage::Remove))?;
                let cleared: std::collections::HashSet<Bytes> = match answer.into_iter().next() {
                    Some(Ok(Response::BatchReplicaClear(Ok(keys)))) => {
                        tracing::debug!(segment = ?name, asked = part.len(), cleared = ?keys,
                            "memory replicas cleared");
                        keys.into_iter().collect()
                    }
                    other => {
                        tracing::debug!(answer = ?other, "replica clear failed");
                        for _ in part {
                            self.metrics.victim(Victim::Error);
                        }
                        continue;
                    }
                };
                for &i in part {
                    let (k, e) = &chosen[i];
                    if !cleared.contains(k) {
                        // The master cleared nothing: the key is under a lease (an
                        // owner's offload lookup grants one), its memory replica is
                        // already gone (the master evicted it, the SSD copy serves it),
                        // or the key is gone. The answer does not say which: the key
                        // waits a lease before it is tried again, and is forgotten after
                        // a few tries, or the same stale keys would be chosen round
                        // after round. The master's own eviction stays the backstop.
                        self.metrics.victim(Victim::Kept);
                        self.keys.table.back_off(
                            &e.tenant,
                            k,
                            self.now_ms() + self.cfg.lease_ms,
                            CLEAR_TRIES,
                        );
                        continue;
                    }
                    self.freed(k, e, set, !e.on_disk);
                    if e.on_disk {
                        // Its memory copy is gone; its SSD copy still serves reads.
                        self.metrics.victim(Victim::MemoryCleared);
                        gone.memory(k, e);
                    } else {
                        self.metrics.victim(Victim::Removed);
                        gone.whole(k, e);
                    }
                }
            }
        }
        // The table holds what uses memory: a key left only on an SSD leaves it.
        self.keys.depart(gone);
        Ok(())
    }

    /// A victim's bytes freed by moongate: counted (and per arm in an experiment); a
    /// `whole` key gone is noted in the history as moongate's eviction (for miss
    /// reasons).
    fn freed(&self, k: &Bytes, e: &Entry, set: &ActiveSet, whole: bool) {
        self.metrics.removed_bytes.inc_by(e.size);
        if let Some(arm) = set.arms.get(e.arm as usize).filter(|_| set.arms.len() > 1) {
            self.metrics.arm_removed(&arm.name, e.size);
        }
        if whole {
            self.keys.history.note(
                &e.tenant,
                std::iter::once(k),
                Why::evicted_by_moongate,
                e.arm,
                self.now_ms(),
            );
        }
    }
}

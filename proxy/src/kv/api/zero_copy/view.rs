//! Views: where values lie, under a lease that keeps their bytes in place (the fence),
//! read into staging first when they live elsewhere.

use super::*;

impl Engines {
    /// Views `keys` for `engine`: one lease for every item held (`0` when none is).
    pub async fn view(
        &self,
        state: &KvState,
        engine: &Engine,
        keys: Vec<Bytes>,
    ) -> Result<(u64, Vec<ViewItem>), Fail> {
        engine.room(self.rules.max_leases)?;
        let n = keys.len();
        let mut items: Vec<Option<ViewItem>> = vec![None; n];
        let mut held = Vec::new();
        let mut bytes = 0u64;
        let mut master_ttl: Option<u64> = None;
        // Read before any lookup: an entry made from a lookup is stamped with it.
        let epoch = state.store.known_epoch();
        let mut pending: Vec<usize> = Vec::with_capacity(n);
        // Values moongate knows lie untouched in its own segment: no master call.
        match self.own.get() {
            Some(own) => {
                for (i, key) in keys.iter().enumerate() {
                    match own.fence().view_known(key, epoch) {
                        Some((off, len)) => {
                            held.push(Held::InPlace {
                                off,
                                len,
                                key: key.clone(),
                            });
                            bytes += len as u64;
                            self.metrics.views[0].inc();
                            self.metrics.views_known.inc();
                            items[i] = Some(ViewItem {
                                status: PLACE_IN_PLACE,
                                memory: MEMORY_SEGMENT,
                                off: off as u64,
                                len: len as u64,
                            });
                        }
                        None => pending.push(i),
                    }
                }
            }
            None => pending.extend(0..n),
        }
        // Looked up through the replica cache (a hot block costs no master call: its
        // entry carries the write sequence number from before its lookup). A value whose
        // range was written since, or is being written, is looked up again from the
        // master (twice at most): the master has moved it, or the write was its own put.
        for _ in 0..3 {
            if pending.is_empty() {
                break;
            }
            let ask: Vec<Bytes> = pending.iter().map(|&i| keys[i].clone()).collect();
            let located = state.store.locate_many(ask).await.map_err(fail_of)?;
            let mut again = Vec::new();
            let mut staged = Vec::new();
            for (&i, loc) in pending.iter().zip(located) {
                let loc = match loc {
                    Ok(Some(l)) => l,
                    Ok(None) => {
                        items[i] = Some(ViewItem::failed(MG_ERR_NOT_FOUND));
                        continue;
                    }
                    Err(e) => {
                        items[i] = Some(ViewItem::failed(code_of(&e)));
                        continue;
                    }
                };
                let here = match (&loc.src, self.own.get()) {
                    (Source::Memory(d), Some(own)) => state
                        .store
                        .xfer
                        .in_own_segment(d)
                        .ok()
                        .flatten()
                        .map(|(_, off)| (own, off, d.size as usize)),
                    _ => None,
                };
                let Some((own, off, len)) = here else {
                    staged.push((i, loc.src));
                    continue;
                };
                let moved = own.fence().view(off, len, loc.seq).is_err();
                // From the cache: answered only if no removal or lost master voided the
                // lists meanwhile (as a cached read is).
                let voided = loc
                    .cached_epoch()
                    .is_some_and(|e| e != state.store.places_epoch());
                if moved || voided {
                    if !moved {
                        own.fence().unview(off, len);
                    }
                    state.store.forget_replica(&keys[i]);
                    again.push(i);
                    continue;
                }
                // Known from now on, as of the lookup (a write since voids it).
                own.fence().know(&keys[i], off, len, loc.seq, epoch);
                held.push(Held::InPlace {
                    off,
                    len,
                    key: keys[i].clone(),
                });
                if loc.lease_ms > 0 {
                    master_ttl = Some(master_ttl.map_or(loc.lease_ms, |t| t.min(loc.lease_ms)));
                }
                bytes += len as u64;
                self.metrics.views[0].inc();
                items[i] = Some(ViewItem {
                    status: PLACE_IN_PLACE,
                    memory: MEMORY_SEGMENT,
                    off: off as u64,
                    len: len as u64,
                });
            }
            // Elsewhere: read into staging, 16 at once.
            let jobs: Vec<_> = staged
                .into_iter()
                .map(|(i, src)| async move { (i, self.stage(state, &src).await) })
                .collect();
            for (i, r) in
                crate::kv::client::in_order(jobs, crate::kv::client::BATCH_CONCURRENCY).await
            {
                items[i] = Some(match r {
                    Ok((slot, len)) => {
                        held.push(Held::Staged(slot));
                        bytes += len;
                        self.metrics.views[1].inc();
                        ViewItem {
                            status: PLACE_STAGED,
                            memory: MEMORY_STAGING,
                            off: slot.off as u64,
                            len,
                        }
                    }
                    Err(code) => ViewItem::failed(code),
                });
            }
            pending = again;
        }
        for i in pending {
            items[i] = Some(ViewItem::failed(MG_ERR_BUSY));
        }
        let lease = if held.is_empty() {
            0
        } else {
            let id = self.next_id();
            self.metrics.view_leases.inc();
            self.metrics.viewed_bytes.inc_by(bytes as i64);
            let renew_every = master_ttl.map(|t| {
                Duration::from_millis(t / 3)
                    .clamp(Duration::from_millis(50), Duration::from_secs(5))
            });
            let now = Instant::now();
            engine.hold().leases.insert(
                id,
                Lease {
                    deadline: now + self.rules.lease,
                    held,
                    bytes,
                    renew_every,
                    renew_at: now + renew_every.unwrap_or_default(),
                },
            );
            id
        };
        Ok((
            lease,
            items
                .into_iter()
                .map(|i| i.unwrap_or(ViewItem::failed(MG_ERR_BUSY)))
                .collect(),
        ))
    }

    /// Reads a value that is not in the own segment into a new staging slot: the slot
    /// and the value's length, or a code.
    async fn stage(&self, state: &KvState, src: &Source) -> Result<(Slot, u64), i32> {
        let Some(st) = &self.staging else {
            return Err(MG_ERR_NOT_LOCAL);
        };
        let size = src.size() as usize;
        let slot = st.alloc(size).ok_or(MG_ERR_BUSY)?;
        self.metrics.staging_bytes.set(st.used() as i64);
        // SAFETY: the slot is this call's alone until it is given back.
        let dst = unsafe { std::slice::from_raw_parts_mut(st.mem.address_of(slot.off), size) };
        match state.store.read_into(src, dst).await {
            Ok(ReadInto::Read(n)) => Ok((slot, n as u64)),
            Ok(_) => {
                self.free_staged(slot);
                Err(MG_ERR_NOT_FOUND)
            }
            Err(e) => {
                self.free_staged(slot);
                Err(code_of(&e))
            }
        }
    }

    /// Ends lease `id` of `engine`.
    pub fn release_lease(&self, engine: &Engine, id: u64) -> Result<(), Fail> {
        if id == 0 {
            return Ok(());
        }
        let l = engine
            .hold()
            .leases
            .remove(&id)
            .ok_or_else(|| no_lease("lease", id))?;
        self.release(l);
        Ok(())
    }
}

//! Reservations: a put decided and allocated now, written by the engine where it lies,
//! ended (sent on to other replicas, `PutEnd`) at commit or revoked at abort.

use super::*;

impl Engines {
    /// The bytes a reservation's engine wrote.
    ///
    /// # Safety
    /// The reservation's place is still held (not yet given back).
    unsafe fn written<'a>(&'a self, r: &Reservation) -> Option<&'a [u8]> {
        let (mem, off) = match r.place {
            Place::InPlace { off, .. } => (&**self.own.get()?, off),
            Place::Staged(s) => (&self.staging.as_ref()?.mem, s.off),
        };
        // SAFETY: the range is the reservation's own (allocated to it, held by it);
        // the engine may still write to it (then the put stores what it raced with).
        Some(unsafe { std::slice::from_raw_parts(mem.address_of(off), r.len) })
    }

    /// Reserves room for `(key, len)` items: one decision and one master call for all.
    pub async fn reserve(
        &self,
        state: &KvState,
        engine: &Engine,
        items: Vec<(Bytes, u64)>,
    ) -> Result<Vec<ReserveItem>, Fail> {
        for (k, len) in &items {
            if *len == 0 || *len > state.max_value_bytes as u64 {
                return Err(Fail(
                    MG_ERR_ARG,
                    format!(
                        "{}: a value of {len} bytes (1 to kv.max_value_bytes = {})",
                        String::from_utf8_lossy(k),
                        state.max_value_bytes
                    ),
                ));
            }
        }
        engine.room(self.rules.max_leases)?;
        let n = items.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        let own_name = state.store.xfer.own_segment().map(|(name, _)| name.clone());
        let mut start = if n == 1 {
            state.store.put_start(items[0].0.clone(), items[0].1)
        } else {
            state.store.batch_put_start(
                items.iter().map(|(k, _)| k.clone()).collect(),
                items.iter().map(|(_, l)| *l).collect(),
            )
        };
        // Placed here when the policy says nothing else: the engine writes in place.
        if let Some(name) = &own_name {
            match &mut start {
                Request::PutStart(a) => a.config.preferred_segment = name.clone(),
                Request::BatchPutStart(a) => a.config.preferred_segment = name.clone(),
                _ => {}
            }
        }
        let started = Instant::now();
        let (decision, request, fixup) = match crate::kv::api::state::decide_start(state, start) {
            Ok(up) => up,
            Err(codes) => {
                return Ok(codes
                    .into_iter()
                    .map(|c| ReserveItem::failed(code_of(&StoreError::Refused(c))))
                    .collect());
            }
        };
        let method = if n == 1 {
            Method::PutStart
        } else {
            Method::BatchPutStart
        }
        .name();
        let allocated = match state.store.start_puts(request, fixup.as_ref(), n).await {
            Ok(a) => a,
            Err(e) => {
                decision.finish(&Outcome::of_codes(
                    method,
                    (0..n).map(|_| outcome_code(Err(&e))),
                    Some(started.elapsed()),
                ));
                return Err(fail_of(e));
            }
        };
        let mut out = Vec::with_capacity(n);
        let mut revoke = Vec::new();
        for ((key, len), a) in items.into_iter().zip(allocated) {
            let replicas = match a {
                Ok(r) => r,
                Err(c) => {
                    let e = StoreError::Refused(c);
                    decision.finish(&Outcome::of_codes(
                        method,
                        std::iter::once(outcome_code(Err(&e))),
                        Some(started.elapsed()),
                    ));
                    out.push(ReserveItem::failed(code_of(&e)));
                    continue;
                }
            };
            match self.place(state, &replicas, len as usize).await {
                Ok((place, written, item)) => {
                    let ticket = self.next_id();
                    self.metrics.reservations.inc();
                    engine.hold().tickets.insert(
                        ticket,
                        Reservation {
                            key,
                            len: len as usize,
                            replicas,
                            written,
                            place,
                            decision: decision.clone(),
                            started,
                            deadline: Instant::now() + self.rules.lease,
                        },
                    );
                    out.push(ReserveItem { ticket, ..item });
                }
                Err(code) => {
                    revoke.push(key);
                    out.push(ReserveItem::failed(code));
                }
            }
        }
        if !revoke.is_empty() {
            let _ = state.store.revoke_puts(revoke).await;
        }
        Ok(out)
    }

    /// Where the engine writes a value the master allocated `replicas` for: the own
    /// segment's replica in place (held against views), else a staging slot.
    async fn place(
        &self,
        state: &KvState,
        replicas: &[ReplicaDescriptor],
        len: usize,
    ) -> Result<(Place, Option<usize>, ReserveItem), i32> {
        let own = replicas
            .iter()
            .enumerate()
            .find_map(|(i, r)| match &r.location {
                ReplicaLocation::Memory(m) if m.buffer_descriptor.size as usize == len => state
                    .store
                    .xfer
                    .in_own_segment(&m.buffer_descriptor)
                    .ok()
                    .flatten()
                    .map(|(_, off)| (i, off)),
                _ => None,
            });
        if let (Some((i, off)), Some(mem)) = (own, self.own.get()) {
            let seq = mem
                .hold_write_within(off, len, FENCE_WAIT)
                .await
                .map_err(|_| MG_ERR_BUSY)?;
            return Ok((
                Place::InPlace { off, seq },
                Some(i),
                ReserveItem {
                    status: PLACE_IN_PLACE,
                    memory: MEMORY_SEGMENT,
                    off: off as u64,
                    ticket: 0,
                },
            ));
        }
        let st = self.staging.as_ref().ok_or(MG_ERR_NOT_LOCAL)?;
        let slot = st.alloc(len).ok_or(MG_ERR_BUSY)?;
        self.metrics.staging_bytes.set(st.used() as i64);
        Ok((
            Place::Staged(slot),
            None,
            ReserveItem {
                status: PLACE_STAGED,
                memory: MEMORY_STAGING,
                off: slot.off as u64,
                ticket: 0,
            },
        ))
    }

    /// Commits `tickets` of `engine`: per ticket 0 or a negative code.
    pub async fn commit(&self, state: &KvState, engine: &Engine, tickets: &[u64]) -> Vec<i32> {
        let mut out = vec![0i32; tickets.len()];
        let mut taken = Vec::new();
        {
            let mut h = engine.hold();
            for (i, t) in tickets.iter().enumerate() {
                match h.tickets.remove(t) {
                    Some(r) => taken.push((i, r)),
                    None => out[i] = MG_ERR_NO_LEASE,
                }
            }
        }
        if taken.is_empty() {
            return out;
        }
        // The engine is done writing: views of the range may begin once it is stored.
        for (_, r) in &taken {
            if let (Place::InPlace { seq, .. }, Some(m)) = (&r.place, self.own.get()) {
                m.fence().end_write(*seq);
            }
        }
        let jobs: Vec<_> = taken
            .iter()
            .map(|(_, r)| async move {
                // SAFETY: the place is given back only below, after every write ended.
                let Some(value) = (unsafe { self.written(r) }) else {
                    return Err(StoreError::Unexpected);
                };
                // A staged value goes to another segment: hashed for the failover check.
                state.store.vouch(&r.key, value);
                state
                    .store
                    .write_replicas_but(&r.replicas, r.written, value)
                    .await
            })
            .collect();
        let written: Vec<Result<Stored, StoreError>> =
            crate::kv::client::in_order(jobs, crate::kv::client::BATCH_CONCURRENCY).await;
        let ending = taken
            .iter()
            .zip(written)
            .map(|((_, r), w)| (r.key.clone(), w))
            .collect();
        // Read before the master hears of the keys: entries made below are stamped with it.
        let epoch = state.store.known_epoch();
        let ended = state.store.end_puts(ending).await;
        for (k, (i, r)) in taken.iter().enumerate() {
            if let Place::Staged(s) = r.place {
                self.free_staged(s);
            }
            self.metrics.reservations.dec();
            let result = match &ended {
                Ok(v) => v
                    .get(k)
                    .map_or(Err(&StoreError::Unexpected), |r| r.as_ref().map(|_| ())),
                Err(e) => Err(e),
            };
            r.decision.finish(&Outcome::of_codes(
                Method::PutStart.name(),
                std::iter::once(outcome_code(result)),
                Some(r.started.elapsed()),
            ));
            match result {
                Ok(()) => {
                    self.metrics.reservations_ended[0].inc();
                    // The engine's bytes lie in place: a view of the key needs no master
                    // call while no write begins over them.
                    if let (Place::InPlace { off, seq }, Some(m)) = (&r.place, self.own.get()) {
                        m.fence().know(&r.key, *off, r.len, seq + 1, epoch);
                    }
                }
                Err(e) => {
                    self.metrics.reservations_ended[4].inc();
                    out[*i] = code_of(e);
                }
            }
        }
        out
    }

    /// Aborts `tickets` of `engine` (their puts revoked): per ticket 0 or a code.
    pub async fn abort(&self, state: &KvState, engine: &Engine, tickets: &[u64]) -> Vec<i32> {
        let mut out = vec![0i32; tickets.len()];
        let mut taken = Vec::new();
        {
            let mut h = engine.hold();
            for (i, t) in tickets.iter().enumerate() {
                match h.tickets.remove(t) {
                    Some(r) => taken.push(r),
                    None => out[i] = MG_ERR_NO_LEASE,
                }
            }
        }
        for r in &taken {
            self.end_place(r);
            self.metrics.reservations_ended[1].inc();
        }
        if !taken.is_empty() {
            let _ = state
                .store
                .revoke_puts(taken.into_iter().map(|r| r.key).collect())
                .await;
        }
        out
    }
}

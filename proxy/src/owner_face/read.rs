//! A rank's read: counted, cut into parts sent in parallel and merged into the one
//! answer it expects, paced under what the owner holds staged; its release frees
//! every part.

use super::owner::{Reservation, reply, request};
use super::*;

impl OwnerFace {
    /// Where to cut a read of keys weighing `sizes`: key-count and byte bounds, and the
    /// arm's `split` hook (its budget: what the owner holds staged for us, the limit).
    pub(super) fn parts(
        &self,
        call: &ReadCall,
        client: &Uuid,
        sizes: &[u64],
        staged: u64,
    ) -> Vec<Range<usize>> {
        let n = sizes.len();
        let mut points = Vec::new();
        if self.cfg.part_keys > 0 {
            points.extend((self.cfg.part_keys..n).step_by(self.cfg.part_keys));
        }
        if self.cfg.part_bytes > 0 {
            let mut acc = 0u64;
            for (i, &s) in sizes.iter().enumerate() {
                if i > 0 && acc + s > self.cfg.part_bytes {
                    points.push(i);
                    acc = 0;
                }
                acc += s;
            }
        }
        if n < 2 {
            return std::iter::once(0..n).collect();
        }
        // The key as the master face sees it: without the tenant that releases with
        // tenants prefix (`tenant\0key`).
        let key = call
            .keys()
            .next()
            .map(|k| k.splitn(2, |&b| b == 0).last().unwrap_or(k));
        let (set, arm) = self.policy.arm_for(client, key);
        let points = self.policy.cut(
            &set.arms[arm],
            sizes,
            staged,
            self.cfg.max_staged_bytes,
            points,
        );
        let mut ranges = Vec::with_capacity(points.len() + 1);
        let mut from = 0;
        for p in points {
            ranges.push(from..p);
            from = p;
        }
        ranges.push(from..n);
        ranges
    }

    /// Waits until the owner has room for `bytes` more staged (or `deadline` passes).
    pub(super) async fn reserve<'a>(
        &self,
        owner: &'a Owner,
        bytes: u64,
        deadline: Instant,
    ) -> Reservation<'a> {
        let limit = self.cfg.max_staged_bytes;
        let mut waited = false;
        loop {
            let room = owner.room.notified();
            {
                let mut st = lock(&owner.staged);
                let freed = st.sweep(std::time::Instant::now());
                self.metrics.staged_bytes.dec_by(freed as i64);
                if st.try_reserve(bytes, limit) {
                    break;
                }
                if Instant::now() >= deadline {
                    st.force_reserve(bytes);
                    self.metrics.over_budget.inc();
                    break;
                }
            }
            if !waited {
                self.metrics.waits.inc();
                waited = true;
            }
            let _ = tokio::time::timeout_at(deadline.min(Instant::now() + SWEEP_EVERY), room).await;
        }
        Reservation { owner, bytes }
    }

    pub(super) fn staged_now(&self, owner: &Owner, freed: u64, added: u64) {
        self.metrics.staged_bytes.inc_by(added as i64);
        self.metrics.staged_bytes.dec_by(freed as i64);
        if freed > 0 {
            owner.room.notify_waiters();
        }
    }

    pub(super) async fn read(
        &self,
        owner: &Owner,
        client: &Uuid,
        frame: RequestFrame,
        raw: Bytes,
    ) -> Bytes {
        let seq = frame.header.seq_num;
        let call = match ReadCall::decode(&frame.body) {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(error = %e, "owner face: read of an unknown shape, relayed whole");
                self.metrics.relayed.inc();
                return self.whole(owner, seq, &raw).await.raw_or_error();
            }
        };
        let sizes = call.sizes();
        let staged = lock(&owner.staged).staged();
        let ranges = self.parts(&call, client, &sizes, staged);
        let deadline = Instant::now() + Duration::from_millis(self.cfg.max_wait_ms);
        let total: u64 = sizes.iter().sum();
        if ranges.len() > 1 {
            self.metrics.split_reads.inc();
        }
        // Room for the whole read: its parts stay staged until the rank has read them
        // all and releases the one batch, so they cannot wait for each other.
        let room = self.reserve(owner, total, deadline).await;
        let parts = ranges.iter().map(|r| {
            let frame = if ranges.len() == 1 {
                raw.clone()
            } else {
                request(&frame.header, &call.part(r.clone()))
            };
            async move {
                self.metrics.parts.inc();
                owner.call(&self.cfg, &frame).await
            }
        });
        let sent = std::time::Instant::now();
        let results = join_all(parts).await;
        let now = std::time::Instant::now();
        self.metrics
            .owner_seconds
            .observe(now.duration_since(sent).as_secs_f64());
        // Read every answer; any failure fails the read, and the parts staged are freed.
        // The parts' answers, with their batch ids (the owner's) and, for a read sent
        // whole, the owner's answer as it came.
        let mut reads = Vec::with_capacity(results.len());
        let mut ids = Vec::with_capacity(results.len());
        let mut as_came = None;
        let mut failure: Option<(Outcome, Bytes)> = None;
        for r in results {
            match r {
                Ok(a) if a.header.err_code == errc::OK => match ReadAnswer::decode(&a.body) {
                    Ok(ra) => match ra.batch_id() {
                        Some(id) => {
                            ids.push(id);
                            reads.push(ra);
                            as_came = Some(a.raw);
                        }
                        None => {
                            failure.get_or_insert((Outcome::refused, a.raw));
                        }
                    },
                    Err(e) if ranges.len() == 1 => {
                        // Not read, but the rank's own answer: relayed as it came.
                        tracing::debug!(error = %e, "owner face: answer of an unknown shape");
                        self.metrics.relayed.inc();
                        return a.raw;
                    }
                    Err(e) => {
                        failure.get_or_insert((
                            Outcome::refused,
                            RpcError::reply(seq, &format!("moongate: owner's answer unread: {e}")),
                        ));
                    }
                },
                Ok(a) => {
                    failure.get_or_insert((Outcome::transport, a.raw));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "owner face: read failed");
                    failure.get_or_insert((
                        Outcome::transport,
                        RpcError::reply(seq, &format!("moongate: {e}")),
                    ));
                }
            }
        }
        let ttl = Duration::from_millis(
            reads
                .iter()
                .filter_map(ReadAnswer::ttl_ms)
                .min()
                .unwrap_or(5_000),
        );
        if failure.is_none()
            && ranges.len() == 1
            && let Some(raw) = as_came
        {
            let freed = lock(&owner.staged).record(ids[0], total, ttl, now);
            drop(room);
            self.staged_now(owner, freed, total);
            self.counted_read(call.len(), total);
            return raw;
        }
        if failure.is_none() {
            let (synthetic, freed) = lock(&owner.staged).record_parts(ids.clone(), total, ttl, now);
            match ReadAnswer::merge(&reads, synthetic) {
                Ok(body) => {
                    drop(room);
                    self.staged_now(owner, freed, total);
                    self.counted_read(call.len(), total);
                    return reply(seq, &body);
                }
                Err(e) => {
                    let (_, bytes) = lock(&owner.staged).release(synthetic);
                    self.staged_now(owner, freed + bytes, total);
                    failure = Some((
                        Outcome::refused,
                        RpcError::reply(seq, &format!("moongate: parts' answers unmerged: {e}")),
                    ));
                }
            }
        }
        drop(room);
        // Free what the parts that succeeded staged: the rank will not read it.
        for id in ids {
            let h = RequestHeader::new(seq, offload_read::release_id(), 0);
            let _ = owner
                .call(&self.cfg, &request(&h, &offload_read::release_call(id)))
                .await;
        }
        let (outcome, bytes) = failure.unwrap_or((
            Outcome::refused,
            RpcError::reply(seq, "moongate: no answer"),
        ));
        self.metrics.read(outcome);
        bytes
    }

    pub(super) fn counted_read(&self, keys: usize, bytes: u64) {
        self.metrics.read(Outcome::ok);
        self.metrics.read_keys.inc_by(keys as u64);
        self.metrics.read_bytes.inc_by(bytes);
    }

    pub(super) async fn release(&self, owner: &Owner, frame: RequestFrame, raw: Bytes) -> Bytes {
        let seq = frame.header.seq_num;
        let Ok(rel) = Release::decode(&frame.body) else {
            self.metrics.relayed.inc();
            return self.whole(owner, seq, &raw).await.raw_or_error();
        };
        let Some(id) = rel.batch_id() else {
            return self.whole(owner, seq, &raw).await.raw_or_error();
        };
        let (named, bytes) = lock(&owner.staged).release(id);
        self.staged_now(owner, bytes, 0);
        match named {
            Named::Owners => {
                let r = self.whole(owner, seq, &raw).await;
                self.metrics.release(r.outcome());
                r.raw_or_error()
            }
            Named::Unknown => {
                self.metrics.release(Outcome::unknown);
                reply(seq, &offload_read::release_answer(false))
            }
            Named::Parts(parts) => {
                let calls = parts.iter().map(|&p| {
                    let frame = request(&frame.header, &rel.naming(p));
                    async move { owner.call(&self.cfg, &frame).await }
                });
                let mut ok = true;
                let mut transport = false;
                for r in join_all(calls).await {
                    match r {
                        Ok(a) if a.header.err_code == errc::OK => {
                            ok &= offload_read::released(&a.body).unwrap_or(false);
                        }
                        _ => {
                            ok = false;
                            transport = true;
                        }
                    }
                }
                self.metrics.release(match (ok, transport) {
                    (true, _) => Outcome::ok,
                    (false, true) => Outcome::transport,
                    (false, false) => Outcome::refused,
                });
                reply(seq, &offload_read::release_answer(ok))
            }
        }
    }
}

//! The put protocol, as Mooncake's client runs it: `PutStart` allocates replicas, every
//! memory replica is written (v2: acknowledged once the bytes are in place), then
//! `PutEnd(ALL)` (a disk replica ended on its own first); a failed write revokes the put
//! (`PutRevoke`). Single, batch, streamed, and split in two for reservations
//! ([`Store::start_puts`] now, [`Store::end_puts`] at commit).

use super::*;

impl Store {
    /// The `PutStart` this store sends for `key` (what a placement policy decides on).
    pub fn put_start(&self, key: Bytes, len: u64) -> Request {
        Request::PutStart(PutStartArgs {
            client_id: self.client_id,
            key,
            slice_length: len,
            config: ReplicateConfig::default(),
            tenant_id: self.tenant.clone(),
        })
    }

    /// Stores `value` under `key` with the given `PutStart` (from [`Store::put_start`],
    /// possibly rewritten by a policy). The caller holds the budget the value was read
    /// under until this returns.
    pub async fn put(&self, key: Bytes, value: Bytes, start: Request) -> Result<(), StoreError> {
        let resp = self.call(start).await?;
        let replicas = match resp {
            Response::PutStart(Ok(r)) => r,
            Response::PutStart(Err(e)) => return Err(StoreError::Refused(e)),
            _ => return Err(StoreError::Unexpected),
        };
        self.vouch(&key, &value);
        let written = self.xfer.write_replicas(&replicas, &value).await;
        self.end_put(key, written).await
    }

    /// As [`Store::put`], from a caller's memory (nothing is buffered here, so no budget
    /// is taken).
    pub async fn put_from(
        &self,
        key: Bytes,
        value: &[u8],
        start: Request,
    ) -> Result<(), StoreError> {
        let resp = self.call(start).await?;
        let replicas = match resp {
            Response::PutStart(Ok(r)) => r,
            Response::PutStart(Err(e)) => return Err(StoreError::Refused(e)),
            _ => return Err(StoreError::Unexpected),
        };
        self.vouch(&key, value);
        let written = self.xfer.write_replicas(&replicas, value).await;
        self.end_put(key, written).await
    }

    /// The `BatchPutStart` this store sends for `keys` of `sizes` bytes (what a
    /// placement policy decides on, as for a client's batch on the master face).
    pub fn batch_put_start(&self, keys: Vec<Bytes>, sizes: Vec<u64>) -> Request {
        Request::BatchPutStart(BatchPutStartArgs {
            client_id: self.client_id,
            keys,
            slice_lengths: sizes,
            config: ReplicateConfig::default(),
            tenant_id: self.tenant.clone(),
        })
    }

    /// Stores a batch of `(key, value)` whose budget the caller holds: `start` is the
    /// `BatchPutStart` (from [`Store::batch_put_start`], possibly rewritten by a policy
    /// that dropped denied keys; `fixup` puts their errors back in place). Every
    /// allocated key is written ([`BATCH_CONCURRENCY`] at once), the written ones end
    /// with one `BatchPutEnd`, the failed ones are revoked with one `BatchPutRevoke`.
    /// One result per key in order; `Err` as a whole when the master's answers are
    /// unusable.
    pub async fn put_many<V: AsRef<[u8]> + Sync>(
        &self,
        values: &[(Bytes, V)],
        start: Request,
        fixup: Option<&crate::policy::Fixup>,
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        let resp = self.call(start).await?;
        let resp = match fixup {
            Some(f) => f.apply(resp),
            None => resp,
        };
        let Response::BatchPutStart(started) = resp else {
            return Err(StoreError::Unexpected);
        };
        let started = per_key(started, values.len())?;
        // (allocated, outcome): only allocated keys are ended or revoked.
        let mut jobs = Vec::with_capacity(values.len());
        for ((k, v), s) in values.iter().zip(started) {
            if s.is_ok() {
                self.vouch(k, v.as_ref());
            }
            jobs.push(self.write_allocated(s, v.as_ref()));
        }
        let done = in_order(jobs, BATCH_CONCURRENCY).await;
        let mut out: Vec<Option<Result<(), StoreError>>> = Vec::with_capacity(done.len());
        let mut ending = Vec::new();
        for (i, (allocated, r)) in done.into_iter().enumerate() {
            if allocated {
                ending.push((values[i].0.clone(), r));
                out.push(None);
            } else {
                out.push(Some(r.map(|_| ())));
            }
        }
        let mut ended = self.end_puts(ending).await?.into_iter();
        Ok(out
            .into_iter()
            .map(|o| o.unwrap_or_else(|| ended.next().unwrap_or(Err(StoreError::Unexpected))))
            .collect())
    }

    /// Ends puts the master allocated, each with how its bytes went: written ones with
    /// one `BatchPutEnd(ALL)` (their disk replicas first with `BatchPutEnd(DISK)`), failed
    /// ones revoked with one `BatchPutRevoke`, a disk replica that could not be written
    /// revoked on its own. One result per key in order; `Err` as a whole when the
    /// master's answers are unusable.
    pub async fn end_puts(
        &self,
        items: Vec<(Bytes, Result<Stored, StoreError>)>,
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        let (mut ended, mut revoked, mut with_disk, mut disk_failed) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (i, (_, r)) in items.iter().enumerate() {
            match r {
                Ok(Stored::Memory) => ended.push(i),
                Ok(Stored::MemoryAndDisk) => {
                    with_disk.push(i);
                    ended.push(i);
                }
                Ok(Stored::DiskFailed) => disk_failed.push(i),
                Err(_) => revoked.push(i),
            }
        }
        let mut done: Vec<Result<(), StoreError>> = items.iter().map(|_| Ok(())).collect();
        // Rare (a disk tier that cannot be written here): ended key by key.
        for i in disk_failed {
            if let Err(e) = self
                .end_put(items[i].0.clone(), Ok(Stored::DiskFailed))
                .await
            {
                done[i] = Err(e);
            }
        }
        let end = |at: &[usize], replica_type| {
            self.call(Request::BatchPutEnd(BatchPutEndArgs {
                client_id: self.client_id,
                object_metas: at
                    .iter()
                    .map(|&i| ObjectMeta {
                        key: items[i].0.clone(),
                        object_checksum: None,
                    })
                    .collect(),
                replica_type,
                tenant_id: self.tenant.clone(),
            }))
        };
        if !with_disk.is_empty() {
            // The disk replicas end on their own, before ALL (as Mooncake's client does).
            if let Response::BatchPutEnd(v) = end(&with_disk, ReplicaType::DISK).await?
                && let Some(Err(e)) = v.into_iter().find(Result::is_err)
            {
                tracing::warn!(code = %e, "BatchPutEnd(DISK) refused");
            }
        }
        if !revoked.is_empty() {
            // Best effort, as for a single put: the write error is what the caller sees.
            let keys = revoked.iter().map(|&i| items[i].0.clone()).collect();
            let _ = self.revoke_puts(keys).await;
        }
        if !ended.is_empty() {
            let Response::BatchPutEnd(v) = end(&ended, ReplicaType::ALL).await? else {
                return Err(StoreError::Unexpected);
            };
            for (&i, r) in ended.iter().zip(per_key(v, ended.len())?) {
                if let Err(e) = r {
                    done[i] = Err(StoreError::Refused(e));
                }
            }
        }
        for (d, (_, r)) in done.iter_mut().zip(items) {
            if let Err(e) = r {
                *d = Err(e);
            }
        }
        Ok(done)
    }

    /// Revokes puts the master allocated and that will not be written (one
    /// `BatchPutRevoke(ALL)`): their space returns and no reader ever sees them.
    pub async fn revoke_puts(&self, keys: Vec<Bytes>) -> Result<(), StoreError> {
        self.call(Request::BatchPutRevoke(BatchPutRevokeArgs {
            client_id: self.client_id,
            keys,
            replica_type: ReplicaType::ALL,
            tenant_id: self.tenant.clone(),
        }))
        .await
        .map(|_| ())
    }

    /// Sends a put-family start (from [`Store::put_start`] or [`Store::batch_put_start`],
    /// possibly rewritten by a policy whose `fixup` puts denied keys back): per key of
    /// the call, the replicas the master allocated or why it did not.
    pub async fn start_puts(
        &self,
        start: Request,
        fixup: Option<&crate::policy::Fixup>,
        keys: usize,
    ) -> Result<Vec<Result<Vec<ReplicaDescriptor>, ErrorCode>>, StoreError> {
        let resp = self.call(start).await?;
        let resp = match fixup {
            Some(f) => f.apply(resp),
            None => resp,
        };
        match resp {
            Response::PutStart(r) if keys == 1 => Ok(vec![r]),
            Response::BatchPutStart(v) => per_key(v, keys),
            _ => Err(StoreError::Unexpected),
        }
    }

    /// Writes `value` to every replica of `replicas` but `skip` (the one whose bytes are
    /// already in place): memory replicas, then disk ones, as a put writes them.
    pub async fn write_replicas_but(
        &self,
        replicas: &[ReplicaDescriptor],
        skip: Option<usize>,
        value: &[u8],
    ) -> Result<Stored, StoreError> {
        if let Some(i) = skip {
            let rest: Vec<_> = replicas
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, r)| r.clone())
                .collect();
            return self.xfer.write_replicas(&rest, value).await;
        }
        self.xfer.write_replicas(replicas, value).await
    }

    /// Writes one key of a batch that `BatchPutStart` allocated; `(allocated, outcome)`.
    async fn write_allocated(
        &self,
        started: Result<Vec<crate::codec::types::ReplicaDescriptor>, ErrorCode>,
        value: &[u8],
    ) -> (bool, Result<Stored, StoreError>) {
        match started {
            Ok(replicas) => (true, self.xfer.write_replicas(&replicas, value).await),
            Err(e) => (false, Err(StoreError::Refused(e))),
        }
    }

    /// Stores a value of `len` bytes that arrives in `body`, passing each chunk on to
    /// every memory replica as it comes (no whole-value buffer; the caller's upload and
    /// the writes overlap). The whole transfer is bounded by `kv.timeout_ms`; a body
    /// that breaks off or lies about its length revokes the put. The caller holds the
    /// value's reservation in the byte budget until this returns.
    pub async fn put_streamed<B>(
        &self,
        key: Bytes,
        len: u64,
        body: B,
        start: Request,
    ) -> Result<(), StoreError>
    where
        B: hyper::body::Body<Data = Bytes> + Unpin,
        B::Error: std::fmt::Display,
    {
        let replicas = match self.call(start).await? {
            Response::PutStart(Ok(r)) => r,
            Response::PutStart(Err(e)) => return Err(StoreError::Refused(e)),
            _ => return Err(StoreError::Unexpected),
        };
        // Hashed as it passes when the failover check wants it (the value lands in
        // another segment): a new leader that lost the key can have it again.
        let mut hash = self
            .wants_hash(&key)
            .then(xxhash_rust::xxh3::Xxh3Default::new);
        let body = Hashing {
            inner: body,
            hash: hash.as_mut(),
        };
        let written = tokio::time::timeout(
            self.call_timeout,
            self.xfer.stream_replicas(&replicas, len, body),
        )
        .await
        .unwrap_or(Err(StoreError::BodyTimeout(self.call_timeout)));
        if let (Ok(_), Some(h)) = (&written, &hash) {
            self.vouch_hash(&key, h.digest());
        }
        self.end_put(key, written).await
    }

    /// `PutEnd(ALL)` after every replica was written (preceded by `PutEnd(DISK)` for a
    /// disk replica); `PutRevoke(DISK)` then `PutEnd(ALL)` when only the disk replica
    /// failed; `PutRevoke(ALL)` (and the write's error) when a memory replica failed.
    async fn end_put(
        &self,
        key: Bytes,
        written: Result<Stored, StoreError>,
    ) -> Result<(), StoreError> {
        let revoke = |key: Bytes, replica_type| {
            self.call(Request::PutRevoke(PutRevokeArgs {
                client_id: self.client_id,
                key,
                replica_type,
                tenant_id: self.tenant.clone(),
            }))
        };
        let end = |key: Bytes, replica_type| {
            self.call(Request::PutEnd(PutEndArgs {
                client_id: self.client_id,
                object_meta: ObjectMeta {
                    key,
                    object_checksum: None,
                },
                replica_type,
                tenant_id: self.tenant.clone(),
            }))
        };
        match written {
            Err(e) => {
                let _ = revoke(key, ReplicaType::ALL).await;
                return Err(e);
            }
            Ok(Stored::Memory) => {}
            Ok(Stored::MemoryAndDisk) => {
                if let Response::PutEnd(Err(e)) = end(key.clone(), ReplicaType::DISK).await? {
                    tracing::warn!(code = %e, "PutEnd(DISK) refused");
                }
            }
            Ok(Stored::DiskFailed) => {
                if let Response::PutRevoke(Err(e)) = revoke(key.clone(), ReplicaType::DISK).await? {
                    tracing::warn!(code = %e, "PutRevoke(DISK) refused");
                }
            }
        }
        match end(key, ReplicaType::ALL).await? {
            Response::PutEnd(Ok(())) => Ok(()),
            Response::PutEnd(Err(e)) => Err(StoreError::Refused(e)),
            _ => Err(StoreError::Unexpected),
        }
    }
}

/// A request body that hashes its data frames as they pass (when it has a hasher).
struct Hashing<'a, B> {
    inner: B,
    hash: Option<&'a mut xxhash_rust::xxh3::Xxh3Default>,
}

impl<B> hyper::body::Body for Hashing<'_, B>
where
    B: hyper::body::Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, B::Error>>> {
        let this = &mut *self;
        let polled = std::pin::Pin::new(&mut this.inner).poll_frame(cx);
        if let (std::task::Poll::Ready(Some(Ok(f))), Some(h)) = (&polled, this.hash.as_mut())
            && let Some(d) = f.data_ref()
        {
            h.update(d);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

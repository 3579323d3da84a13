//! The shared-memory data path on the kv face's Unix socket: an engine on this host
//! registers its own memory (a sealed memfd passed with SCM_RIGHTS) and values move
//! between that memory and the store without crossing the socket: from moongate's own
//! segment by one copy, from remote segments by TE-TCP straight into it.
//!
//! A connection whose first eight bytes are [`MAGIC`] speaks this protocol; any other
//! is HTTP (`super::http`). Frames, little-endian:
//! - request: `u32 body_len | u32 seq | u8 op | body`;
//! - answer: `u32 body_len | u32 seq | i32 status | body`; status 0, or a negative code
//!   numbered as the C library's `MG_ERR_*` with a UTF-8 message as the body.
//!
//! | op | body | answer body |
//! | --- | --- | --- |
//! | 1 register (one fd attached) | `u64 len` | `u32 region` |
//! | 2 release | `u32 region` | |
//! | 3 get into | `u32 region, u64 offset, u64 cap, key` | `u64 len` |
//! | 4 put from | `u32 region, u64 offset, u64 len, key` | |
//! | 5 batch get into | `u32 region, u32 n, n x (u64 offset, u64 cap, u16 key_len, key)` | `n x i64` (length or code) |
//! | 6 batch put from | `u32 region, u32 n, n x (u64 offset, u64 len, u16 key_len, key)` | `n x i32` (0 or code) |
//!
//! Safety rules, each checked here: the peer's uid must be allowed
//! (`kv.shm_allowed_uids`, SO_PEERCRED); a registered memfd must be sealed against
//! shrinking (F_SEAL_SHRINK), or a peer could truncate it under a copy and fault this
//! process; every range must lie inside its registration (and a batch's ranges must not
//! overlap); registrations are bounded per connection and in total, and are unmapped
//! when the connection ends, however it ends. A bad frame gets an error answer, or the
//! connection is closed when the framing itself is broken; nothing else is affected.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::Interest;
use tokio::net::UnixStream;

use super::state::{KvState, abi_code_of as code_of, decided_put};
use crate::kv::client::{ReadInto, StoreError};

mod frames;
pub mod request;
mod zero_copy_ops;

pub use frames::starts_with_magic;
use frames::{Reader, answer, answer_with_fds, write_all};
use request::{Item, Request};

// The wire's numbers and the answer codes are the client library's (one definition:
// clients/rust/src/shm.rs and capi.rs).
pub use moongate_kv::shm::wire::MAGIC;
use moongate_kv::shm::wire::*;

use moongate_kv::capi::{
    MG_ERR_ARG as ERR_ARG, MG_ERR_DENIED as ERR_DENIED, MG_ERR_NOMEM as ERR_NOMEM,
    MG_ERR_NOT_FOUND as ERR_NOT_FOUND, MG_ERR_NOT_LOCAL, MG_ERR_TOO_SMALL as ERR_TOO_SMALL,
};

/// File descriptors a peer may have in flight before it asks for them (one per
/// register frame is all the protocol uses).
const MAX_PENDING_FDS: usize = 4;

/// The shared-memory limits and what is registered across connections.
pub struct ShmLimits {
    pub allowed_uids: Vec<u32>,
    pub per_connection: u64,
    pub total: u64,
    pub max_regions: usize,
    registered: AtomicU64,
    /// Views and reservations (`kv.zero_copy`); `None` = off.
    pub engines: Option<Arc<crate::kv::api::zero_copy::Engines>>,
}

impl ShmLimits {
    /// From `kv.shm_*`; an empty uid list allows the user moongate runs as.
    pub fn new(cfg: &crate::kv::config::KvConfig) -> ShmLimits {
        let allowed_uids = if cfg.shm_allowed_uids.is_empty() {
            // SAFETY: geteuid has no failure mode and touches no memory.
            vec![unsafe { libc::geteuid() }]
        } else {
            cfg.shm_allowed_uids.clone()
        };
        ShmLimits {
            allowed_uids,
            per_connection: cfg.shm_max_bytes_per_connection,
            total: cfg.shm_max_bytes,
            max_regions: cfg.shm_max_regions,
            registered: AtomicU64::new(0),
            engines: None,
        }
    }

    /// With views and reservations served by `engines`.
    pub fn with_engines(mut self, engines: Arc<crate::kv::api::zero_copy::Engines>) -> ShmLimits {
        self.engines = Some(engines);
        self
    }

    /// Bytes registered now, on every connection.
    pub fn registered(&self) -> u64 {
        self.registered.load(Ordering::Relaxed)
    }

    fn take(&self, len: u64) -> bool {
        self.registered
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |r| {
                r.checked_add(len).filter(|&t| t <= self.total)
            })
            .is_ok()
    }

    fn give_back(&self, len: u64) {
        self.registered.fetch_sub(len, Ordering::AcqRel);
    }
}

/// A registration: another process's memory mapped here, unmapped on drop.
struct Region {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; this process only copies bytes in and
// out of it, one request of its connection at a time.
unsafe impl Send for Region {}
unsafe impl Sync for Region {}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: a mapping made in `register`, of this length, unmapped once.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

impl Region {
    /// `[off, off + len)` if it lies inside the registration.
    fn range(&self, off: u64, len: u64) -> Result<(usize, usize), Fail> {
        match off.checked_add(len) {
            Some(end) if end <= self.len as u64 => Ok((off as usize, len as usize)),
            _ => Err(Fail::arg(format!(
                "range [{off}, +{len}) is outside the registration of {} bytes",
                self.len
            ))),
        }
    }

    /// The bytes at a checked range, to read (a value put from them).
    ///
    /// # Safety
    /// No live `slice` of this region overlaps the range (shared reads may overlap).
    unsafe fn bytes(&self, (off, len): (usize, usize)) -> &[u8] {
        // SAFETY: in bounds by `range`; no exclusive slice overlaps, by the caller.
        unsafe { std::slice::from_raw_parts(self.ptr.add(off), len) }
    }

    /// The bytes at a checked range.
    ///
    /// # Safety
    /// No other live slice of this region overlaps the range (the peer process may
    /// write to it at any time: it then gets whatever bytes it raced with).
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, (off, len): (usize, usize)) -> &mut [u8] {
        // SAFETY: in bounds by `range`; exclusive within this process by the caller.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off), len) }
    }
}

/// A batch's keys, each with its checked `(offset, len)` in the region.
type BatchItems = Vec<(Bytes, (usize, usize))>;

/// An error answer.
struct Fail(i32, String);

impl Fail {
    fn arg(msg: impl Into<String>) -> Fail {
        Fail(ERR_ARG, msg.into())
    }
}

impl From<StoreError> for Fail {
    fn from(e: StoreError) -> Fail {
        Fail(code_of(&e), e.to_string())
    }
}

/// One shared-memory connection: its registrations, released when it ends, and the
/// engine it belongs to (its own, or the one its `OP_HELLO` token names).
struct Conn<'a> {
    state: &'a KvState,
    limits: &'a ShmLimits,
    regions: Vec<Option<Region>>,
    bytes: u64,
    engine: Option<Arc<crate::kv::api::zero_copy::Engine>>,
    said_hello: bool,
    peer_pid: i32,
}

impl Drop for Conn<'_> {
    fn drop(&mut self) {
        self.limits.give_back(self.bytes);
        self.state.metrics.shm_registered(self.limits.registered());
    }
}

impl Conn<'_> {
    fn region(&self, id: u32) -> Result<&Region, Fail> {
        self.regions
            .get(id as usize)
            .and_then(Option::as_ref)
            .ok_or_else(|| Fail::arg(format!("no registration {id} on this connection")))
    }

    fn key(&self, k: &[u8]) -> Result<Bytes, Fail> {
        if k.is_empty() || k.len() > self.state.max_key_bytes {
            return Err(Fail::arg(format!(
                "a key of {} bytes (1 to kv.max_key_bytes = {})",
                k.len(),
                self.state.max_key_bytes
            )));
        }
        Ok(Bytes::copy_from_slice(k))
    }

    fn register(&mut self, len: u64, fd: Option<OwnedFd>) -> Result<Vec<u8>, Fail> {
        let fd = fd.ok_or_else(|| Fail::arg("register without a file descriptor"))?;
        let live = self.regions.iter().flatten().count();
        if len == 0 {
            return Err(Fail::arg("a registration of 0 bytes"));
        }
        if live >= self.limits.max_regions {
            return Err(Fail(
                ERR_NOMEM,
                format!("{live} registrations on this connection (kv.shm_max_regions)"),
            ));
        }
        if self.bytes + len > self.limits.per_connection {
            return Err(Fail(
                ERR_NOMEM,
                format!(
                    "{} more bytes would pass kv.shm_max_bytes_per_connection ({})",
                    len, self.limits.per_connection
                ),
            ));
        }
        // SAFETY: fcntl and fstat on a descriptor we own.
        let (seals, size) = unsafe {
            let seals = libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS);
            let mut st: libc::stat = std::mem::zeroed();
            let size = if libc::fstat(fd.as_raw_fd(), &mut st) == 0 {
                st.st_size as u64
            } else {
                0
            };
            (seals, size)
        };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(Fail::arg(
                "the memory must be a memfd sealed against shrinking (F_SEAL_SHRINK)",
            ));
        }
        if size < len {
            return Err(Fail::arg(format!(
                "the memfd has {size} bytes, fewer than the {len} registered"
            )));
        }
        let ulen = usize::try_from(len).map_err(|_| Fail::arg("registration too large"))?;
        if !self.limits.take(len) {
            return Err(Fail(
                ERR_NOMEM,
                format!(
                    "{len} more bytes would pass kv.shm_max_bytes ({})",
                    self.limits.total
                ),
            ));
        }
        // Sealed against shrinking and at least `len` long (both checked above).
        let p = match crate::kv::own::memory::map_shared(fd.as_raw_fd(), ulen) {
            Ok(p) => p,
            Err(e) => {
                self.limits.give_back(len);
                return Err(Fail(ERR_NOMEM, format!("mmap of {len} bytes: {e}")));
            }
        };
        self.bytes += len;
        let region = Region { ptr: p, len: ulen };
        let id = match self.regions.iter().position(Option::is_none) {
            Some(i) => {
                self.regions[i] = Some(region);
                i
            }
            None => {
                self.regions.push(Some(region));
                self.regions.len() - 1
            }
        };
        self.state.metrics.shm_registered(self.limits.registered());
        Ok((id as u32).to_le_bytes().to_vec())
    }

    fn release(&mut self, id: u32) -> Result<Vec<u8>, Fail> {
        self.region(id)?;
        if let Some(r) = self.regions[id as usize].take() {
            self.bytes -= r.len as u64;
            self.limits.give_back(r.len as u64);
        }
        self.state.metrics.shm_registered(self.limits.registered());
        Ok(Vec::new())
    }

    async fn get_into(&self, id: u32, off: u64, cap: u64, key: &[u8]) -> Result<Vec<u8>, Fail> {
        let key = self.key(key)?;
        let r = self.region(id)?;
        let range = r.range(off, cap)?;
        // SAFETY: the only slice of this region while the call runs.
        let dst = unsafe { r.slice(range) };
        match self.state.store.get_into(key.clone(), dst).await? {
            ReadInto::Read(n) => Ok((n as u64).to_le_bytes().to_vec()),
            ReadInto::TooSmall(n) => Err(Fail(
                ERR_TOO_SMALL,
                format!("the value has {n} bytes, more than the {cap} given"),
            )),
            ReadInto::Absent => Err(Fail(ERR_NOT_FOUND, "not stored".into())),
        }
    }

    async fn put_from(&self, id: u32, off: u64, len: u64, key: &[u8]) -> Result<Vec<u8>, Fail> {
        let key = self.key(key)?;
        if len == 0 || len > self.state.max_value_bytes as u64 {
            return Err(Fail::arg(format!(
                "a value of {len} bytes (1 to kv.max_value_bytes = {})",
                self.state.max_value_bytes
            )));
        }
        let r = self.region(id)?;
        let range = r.range(off, len)?;
        // SAFETY: the only slice of this region while the call runs.
        let value: &[u8] = unsafe { r.slice(range) };
        let state = self.state;
        decided_put(state, key.clone(), len, |start| {
            state.store.put_from(key, value, start)
        })
        .await?;
        Ok(Vec::new())
    }

    /// Puts each `(offset, len, key)` of `region` in parts cut as the HTTP batch put
    /// cuts them (the policy's `split`, else `kv.batch_part_bytes`), each one
    /// `BatchPutStart` through the policy host; nothing is buffered here, so no budget
    /// is taken. Per item 0 or a negative code.
    async fn batch_put_from(&self, id: u32, items: &[Item<'_>]) -> Result<Vec<u8>, Fail> {
        let (r, parsed) = self.batch_items(id, items)?;
        let n = parsed.len();
        let mut items = Vec::with_capacity(n);
        for (key, range) in parsed {
            if range.1 == 0 || range.1 > self.state.max_value_bytes {
                return Err(Fail::arg(format!(
                    "a value of {} bytes (1 to kv.max_value_bytes = {})",
                    range.1, self.state.max_value_bytes
                )));
            }
            // SAFETY: reads only; no exclusive slice of the region is live in this call.
            items.push((key, unsafe { r.bytes(range) }));
        }
        if n == 0 {
            return Ok(Vec::new());
        }
        let sizes: Vec<u64> = items.iter().map(|(_, v)| v.len() as u64).collect();
        let mut starts = super::batch::part_starts(self.state, &items[0].0, &sizes);
        starts.push(n);
        let mut out = Vec::with_capacity(n * 4);
        let mut from = 0;
        for to in starts {
            let to = to.min(n);
            if to <= from {
                continue;
            }
            let part = &items[from..to];
            match super::batch::store_part(self.state, part).await {
                Ok(results) => {
                    for r in results {
                        let code = r.map_or_else(|e| code_of(&e), |()| 0);
                        out.extend_from_slice(&code.to_le_bytes());
                    }
                }
                Err(e) => {
                    for _ in part {
                        out.extend_from_slice(&code_of(&e).to_le_bytes());
                    }
                }
            }
            from = to;
        }
        Ok(out)
    }

    /// A batch frame's region and items (decoded: counts and keys checked), every range
    /// checked inside the region.
    fn batch_items(&self, id: u32, items: &[Item<'_>]) -> Result<(&Region, BatchItems), Fail> {
        let r = self.region(id)?;
        let mut out = Vec::with_capacity(items.len());
        for it in items {
            out.push((self.key(it.key)?, r.range(it.off, it.len)?));
        }
        Ok((r, out))
    }

    async fn batch_get_into(&self, id: u32, items: &[Item<'_>]) -> Result<Vec<u8>, Fail> {
        let (r, items) = self.batch_items(id, items)?;
        let mut sorted: Vec<(usize, usize)> = items.iter().map(|(_, r)| *r).collect();
        sorted.sort_unstable();
        if sorted.windows(2).any(|w| w[0].0 + w[0].1 > w[1].0) {
            return Err(Fail::arg("two items' ranges overlap"));
        }
        let keys: Vec<Bytes> = items.iter().map(|(k, _)| k.clone()).collect();
        let located = self.state.store.locate_many(keys).await?;
        let jobs: Vec<_> = items
            .iter()
            .zip(located)
            .map(|((key, range), src)| async move {
                let src = match src {
                    Ok(Some(s)) => s,
                    Ok(None) => return i64::from(ERR_NOT_FOUND),
                    Err(e) => return i64::from(code_of(&e)),
                };
                // SAFETY: the items' ranges do not overlap (checked above).
                let dst = unsafe { r.slice(*range) };
                match self.state.store.read_located_into(key, &src, dst).await {
                    Ok(ReadInto::Read(n)) => n as i64,
                    Ok(ReadInto::TooSmall(_)) => i64::from(ERR_TOO_SMALL),
                    Ok(ReadInto::Absent) => i64::from(ERR_NOT_FOUND),
                    Err(e) => i64::from(code_of(&e)),
                }
            })
            .collect();
        let out = crate::kv::client::in_order(jobs, crate::kv::client::BATCH_CONCURRENCY).await;
        Ok(out.iter().flat_map(|v| v.to_le_bytes()).collect())
    }
}

/// Serves one connection that started with [`MAGIC`] until it ends or sends a broken
/// frame; its registrations are released then. `idle`: the longest wait for a frame.
pub async fn serve_conn(
    sock: UnixStream,
    state: Arc<KvState>,
    limits: Arc<ShmLimits>,
    idle: Duration,
) {
    if let Err(e) = serve(&sock, &state, &limits, idle).await {
        tracing::debug!(error = %e, "kv shared-memory connection ended with an error");
    }
}

async fn serve(
    sock: &UnixStream,
    state: &KvState,
    limits: &ShmLimits,
    idle: Duration,
) -> io::Result<()> {
    let mut rd = Reader::new(sock);
    if rd.take(MAGIC.len()).await?.as_deref() != Some(&MAGIC[..]) {
        return Ok(());
    }
    let uid = sock.peer_cred()?.uid();
    if !limits.allowed_uids.contains(&uid) {
        state.metrics.shm_denied();
        let msg = format!("uid {uid} may not register memory here (kv.shm_allowed_uids)");
        return answer(sock, 0, ERR_DENIED, msg.as_bytes()).await;
    }
    write_all(sock, MAGIC).await?;
    let mut conn = Conn {
        state,
        limits,
        regions: Vec::new(),
        bytes: 0,
        engine: None,
        said_hello: false,
        peer_pid: sock.peer_cred()?.pid().unwrap_or(0),
    };
    // The largest body: a batch of kv.max_batch_keys items with the longest keys.
    let max_body = 8 + state.max_batch_keys * (18 + state.max_key_bytes);
    loop {
        let head = match tokio::time::timeout(idle, rd.take(9)).await {
            Err(_) => return Ok(()),
            Ok(r) => match r? {
                Some(h) => h,
                None => return Ok(()),
            },
        };
        let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
        let seq = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
        let op = head[8];
        if len > max_body {
            let msg = format!("a frame body of {len} bytes (at most {max_body})");
            answer(sock, seq, ERR_ARG, msg.as_bytes()).await?;
            return Ok(());
        }
        let body = match tokio::time::timeout(idle, rd.take(len)).await {
            Ok(Ok(Some(b))) => b,
            Ok(Ok(None)) | Err(_) => return Ok(()),
            Ok(Err(e)) => return Err(e),
        };
        let limits = request::Limits {
            max_batch_keys: state.max_batch_keys,
            max_key_bytes: state.max_key_bytes,
        };
        let req = match request::decode(op, &body, &limits) {
            Ok(r) => r,
            Err(Fail(code, msg)) => {
                state.metrics.shm_call(op, false);
                answer(sock, seq, code, msg.as_bytes()).await?;
                continue;
            }
        };
        if req == Request::Segments {
            let r = conn.segments();
            state.metrics.shm_call(op, r.is_ok());
            match r {
                Ok((b, fds)) => answer_with_fds(sock, seq, &b, &fds).await?,
                Err(Fail(code, msg)) => answer(sock, seq, code, msg.as_bytes()).await?,
            }
            continue;
        }
        let r = match req {
            Request::Register { len } => {
                let fd = rd.fds.pop_front();
                conn.register(len, fd)
            }
            Request::Release { region } => conn.release(region),
            Request::GetInto {
                region,
                off,
                cap,
                key,
            } => conn.get_into(region, off, cap, key).await,
            Request::PutFrom {
                region,
                off,
                len,
                key,
            } => conn.put_from(region, off, len, key).await,
            Request::BatchGetInto { region, items } => conn.batch_get_into(region, &items).await,
            Request::BatchPutFrom { region, items } => conn.batch_put_from(region, &items).await,
            Request::Hello { token } => conn.hello(token),
            Request::View { keys } => conn.view(&keys).await,
            Request::ReleaseView { lease } => conn.release_view(lease),
            Request::Reserve { items } => conn.reserve(&items).await,
            Request::Commit { tickets } => conn.end_tickets(&tickets, true).await,
            Request::Abort { tickets } => conn.end_tickets(&tickets, false).await,
            Request::Segments => continue,
        };
        state.metrics.shm_call(op, r.is_ok());
        match r {
            Ok(b) => answer(sock, seq, 0, &b).await?,
            Err(Fail(code, msg)) => answer(sock, seq, code, msg.as_bytes()).await?,
        }
    }
}

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

use super::state::{KvState, decided_put};
use crate::codec::types::ErrorCode;
use crate::kv::client::{ReadInto, StoreError};

// The wire's numbers and the answer codes are the client library's (one definition:
// clients/rust/src/shm.rs and capi.rs).
pub use moongate_kv::shm::wire::MAGIC;
use moongate_kv::shm::wire::*;

use moongate_kv::capi::{
    MG_ERR_ARG as ERR_ARG, MG_ERR_BUSY as ERR_BUSY, MG_ERR_DENIED as ERR_DENIED,
    MG_ERR_EXISTS as ERR_EXISTS, MG_ERR_LEASED as ERR_LEASED, MG_ERR_NO_ROOM as ERR_NO_ROOM,
    MG_ERR_NOMEM as ERR_NOMEM, MG_ERR_NOT_FOUND as ERR_NOT_FOUND, MG_ERR_NOT_LOCAL,
    MG_ERR_REFUSED as ERR_REFUSED, MG_ERR_TOO_SMALL as ERR_TOO_SMALL,
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
    pub engines: Option<Arc<super::zero_copy::Engines>>,
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
    pub fn with_engines(mut self, engines: Arc<super::zero_copy::Engines>) -> ShmLimits {
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

/// Whether the connection starts with [`MAGIC`], without consuming a byte: waits for
/// eight bytes or the first that differs. `false` too when the peer closes or sends
/// nothing within `within`.
pub async fn starts_with_magic(sock: &UnixStream, within: Duration) -> bool {
    let peek = async {
        let mut buf = [0u8; 8];
        loop {
            sock.readable().await?;
            let n = match sock.try_io(Interest::READABLE, || {
                // SAFETY: recv into a buffer of its stated length.
                let n = unsafe {
                    libc::recv(
                        sock.as_raw_fd(),
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                        libc::MSG_PEEK,
                    )
                };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            }) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            };
            if n == 0 || buf[..n] != MAGIC[..n] {
                return Ok(false);
            }
            if n == MAGIC.len() {
                return Ok(true);
            }
            // A partial magic: wait for more without spinning.
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    matches!(tokio::time::timeout(within, peek).await, Ok(Ok(true)))
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

/// The one place store errors become shared-memory answer codes.
pub(super) fn code_of(e: &StoreError) -> i32 {
    match e {
        StoreError::Busy(_)
        | StoreError::MasterBusy
        | StoreError::NoLeader
        | StoreError::Fenced(_) => ERR_BUSY,
        StoreError::Refused(ErrorCode::OBJECT_ALREADY_EXISTS) => ERR_EXISTS,
        StoreError::Refused(ErrorCode::OBJECT_HAS_LEASE) => ERR_LEASED,
        StoreError::Refused(ErrorCode::NO_AVAILABLE_HANDLE) => ERR_NO_ROOM,
        StoreError::Refused(ErrorCode::INVALID_KEY | ErrorCode::INVALID_PARAMS) => ERR_ARG,
        _ => ERR_REFUSED,
    }
}

impl From<StoreError> for Fail {
    fn from(e: StoreError) -> Fail {
        Fail(code_of(&e), e.to_string())
    }
}

/// Reads frames with `recvmsg`, keeping the file descriptors that arrive with them.
struct Reader<'a> {
    sock: &'a UnixStream,
    buf: Vec<u8>,
    fds: VecDeque<OwnedFd>,
    /// What one `recvmsg` reads into: once per connection, not a 64 KiB array zeroed
    /// on the stack (and carried in the future) at every read.
    scratch: Box<[u8]>,
}

impl Reader<'_> {
    /// Reads more bytes (and any descriptors) into the buffer; `Ok(false)` at the end.
    async fn fill(&mut self) -> io::Result<bool> {
        // Room for MAX_PENDING_FDS descriptors in one control message.
        let mut control = [0u64; 8];
        let chunk = &mut self.scratch;
        loop {
            self.sock.readable().await?;
            let r = self.sock.try_io(Interest::READABLE, || {
                let mut iov = libc::iovec {
                    iov_base: chunk.as_mut_ptr().cast(),
                    iov_len: chunk.len(),
                };
                // SAFETY: zeroed msghdr is valid; its pointers are set below.
                let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
                msg.msg_iov = &mut iov;
                msg.msg_iovlen = 1;
                msg.msg_control = control.as_mut_ptr().cast();
                msg.msg_controllen = std::mem::size_of_val(&control) as _;
                // SAFETY: every buffer in msg is ours and of its stated length.
                let n = unsafe {
                    libc::recvmsg(self.sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC)
                };
                if n < 0 {
                    return Err(io::Error::last_os_error());
                }
                let mut fds = Vec::new();
                // SAFETY: walking the control messages recvmsg filled in.
                unsafe {
                    let mut c = libc::CMSG_FIRSTHDR(&msg);
                    while !c.is_null() {
                        if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS
                        {
                            let data = libc::CMSG_DATA(c).cast::<RawFd>();
                            let bytes = (*c).cmsg_len as usize - (data as usize - c as usize);
                            for i in 0..bytes / std::mem::size_of::<RawFd>() {
                                fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                            }
                        }
                        c = libc::CMSG_NXTHDR(&msg, c);
                    }
                }
                let truncated = msg.msg_flags & libc::MSG_CTRUNC != 0;
                Ok((n as usize, fds, truncated))
            });
            let (n, fds, truncated) = match r {
                Ok(v) => v,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            };
            if truncated || self.fds.len() + fds.len() > MAX_PENDING_FDS {
                return Err(io::Error::other("more file descriptors than registrations"));
            }
            self.fds.extend(fds);
            self.buf.extend_from_slice(&chunk[..n]);
            return Ok(n > 0);
        }
    }

    /// The next `n` bytes; `Ok(None)` when the connection ended cleanly first.
    async fn take(&mut self, n: usize) -> io::Result<Option<Vec<u8>>> {
        while self.buf.len() < n {
            if !self.fill().await? {
                return if self.buf.is_empty() {
                    Ok(None)
                } else {
                    Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "connection ended inside a frame",
                    ))
                };
            }
        }
        let rest = self.buf.split_off(n);
        Ok(Some(std::mem::replace(&mut self.buf, rest)))
    }
}

async fn write_all(sock: &UnixStream, mut b: &[u8]) -> io::Result<()> {
    while !b.is_empty() {
        sock.writable().await?;
        match sock.try_write(b) {
            Ok(n) => b = &b[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Sends an answer frame with descriptors attached (SCM_RIGHTS, with its first bytes).
async fn answer_with_fds(
    sock: &UnixStream,
    seq: u32,
    body: &[u8],
    fds: &[RawFd],
) -> io::Result<()> {
    let mut frame = Vec::with_capacity(12 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(&seq.to_le_bytes());
    frame.extend_from_slice(&0i32.to_le_bytes());
    frame.extend_from_slice(body);
    // Room for 8 descriptors; two memories send four.
    let mut control = [0u64; 8];
    let fd_bytes = std::mem::size_of_val(fds);
    // SAFETY: CMSG_SPACE is arithmetic.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes as u32) } as usize;
    if fds.len() > 8 || space > std::mem::size_of_val(&control) {
        return Err(io::Error::other("too many descriptors"));
    }
    let sent = loop {
        sock.writable().await?;
        let r = sock.try_io(Interest::WRITABLE, || {
            let mut iov = libc::iovec {
                iov_base: frame.as_ptr() as *mut libc::c_void,
                iov_len: frame.len(),
            };
            // SAFETY: a zeroed msghdr is valid; its pointers are set to buffers we own.
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = space as _;
            // SAFETY: the control buffer holds one cmsg of `fds` (CMSG_SPACE checked).
            let n = unsafe {
                let c = libc::CMSG_FIRSTHDR(&msg);
                (*c).cmsg_level = libc::SOL_SOCKET;
                (*c).cmsg_type = libc::SCM_RIGHTS;
                (*c).cmsg_len = libc::CMSG_LEN(fd_bytes as u32) as _;
                std::ptr::copy_nonoverlapping(
                    fds.as_ptr(),
                    libc::CMSG_DATA(c).cast::<RawFd>(),
                    fds.len(),
                );
                libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL)
            };
            if n < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(n as usize)
            }
        });
        match r {
            Ok(n) => break n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    };
    // The descriptors went with the first bytes; the rest is plain data.
    write_all(sock, &frame[sent..]).await
}

/// Sends an answer frame: its 12-byte head and `body` in one vectored write where the
/// socket takes it (no frame buffer is built per answer).
async fn answer(sock: &UnixStream, seq: u32, status: i32, body: &[u8]) -> io::Result<()> {
    let mut head = [0u8; 12];
    head[..4].copy_from_slice(&(body.len() as u32).to_le_bytes());
    head[4..8].copy_from_slice(&seq.to_le_bytes());
    head[8..].copy_from_slice(&status.to_le_bytes());
    let mut parts = [io::IoSlice::new(&head), io::IoSlice::new(body)];
    let mut left: &mut [io::IoSlice<'_>] = &mut parts;
    while !left.is_empty() {
        sock.writable().await?;
        match sock.try_write_vectored(left) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => io::IoSlice::advance_slices(&mut left, n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A frame body being read field by field.
struct Fields<'a>(&'a [u8]);

impl<'a> Fields<'a> {
    fn bytes(&mut self, n: usize) -> Result<&'a [u8], Fail> {
        if self.0.len() < n {
            return Err(Fail::arg("frame body too short"));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u16(&mut self) -> Result<u16, Fail> {
        Ok(u16::from_le_bytes(
            self.bytes(2)?.try_into().unwrap_or_default(),
        ))
    }
    fn u32(&mut self) -> Result<u32, Fail> {
        Ok(u32::from_le_bytes(
            self.bytes(4)?.try_into().unwrap_or_default(),
        ))
    }
    fn u64(&mut self) -> Result<u64, Fail> {
        Ok(u64::from_le_bytes(
            self.bytes(8)?.try_into().unwrap_or_default(),
        ))
    }
}

/// One shared-memory connection: its registrations, released when it ends, and the
/// engine it belongs to (its own, or the one its `OP_HELLO` token names).
struct Conn<'a> {
    state: &'a KvState,
    limits: &'a ShmLimits,
    regions: Vec<Option<Region>>,
    bytes: u64,
    engine: Option<Arc<super::zero_copy::Engine>>,
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

    async fn get_into(&self, f: &mut Fields<'_>) -> Result<Vec<u8>, Fail> {
        let (id, off, cap) = (f.u32()?, f.u64()?, f.u64()?);
        let key = self.key(f.0)?;
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

    async fn put_from(&self, f: &mut Fields<'_>) -> Result<Vec<u8>, Fail> {
        let (id, off, len) = (f.u32()?, f.u64()?, f.u64()?);
        let key = self.key(f.0)?;
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
    async fn batch_put_from(&self, f: &mut Fields<'_>) -> Result<Vec<u8>, Fail> {
        let (r, parsed) = self.batch_items(f)?;
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

    /// A batch frame's region and items: `u32 region, u32 n`, then n x `(u64 offset,
    /// u64 len, u16 key_len, key)`, every range checked inside the region, at most
    /// `kv.max_batch_keys` items, nothing after the last one.
    fn batch_items(&self, f: &mut Fields<'_>) -> Result<(&Region, BatchItems), Fail> {
        let (id, n) = (f.u32()?, f.u32()? as usize);
        if n > self.state.max_batch_keys {
            return Err(Fail::arg(format!(
                "{n} keys (kv.max_batch_keys = {})",
                self.state.max_batch_keys
            )));
        }
        let r = self.region(id)?;
        let mut items = Vec::with_capacity(n);
        for _ in 0..n {
            let (off, len) = (f.u64()?, f.u64()?);
            let klen = f.u16()? as usize;
            let key = self.key(f.bytes(klen)?)?;
            items.push((key, r.range(off, len)?));
        }
        if !f.0.is_empty() {
            return Err(Fail::arg("bytes after the last item"));
        }
        Ok((r, items))
    }

    fn engines(&self) -> Result<&Arc<super::zero_copy::Engines>, Fail> {
        self.limits.engines.as_ref().ok_or_else(|| {
            Fail(
                MG_ERR_NOT_LOCAL,
                "views and reservations are off (kv.zero_copy = false)".into(),
            )
        })
    }

    /// This connection's engine, made on first use when no `OP_HELLO` named one.
    fn engine(&mut self) -> Result<Arc<super::zero_copy::Engine>, Fail> {
        let engines = self.engines()?.clone();
        Ok(self.engine.get_or_insert_with(|| engines.engine()).clone())
    }

    fn hello(&mut self, f: &mut Fields<'_>) -> Result<Vec<u8>, Fail> {
        let token = f.u64()?;
        let engines = self.engines()?.clone();
        // Before it, the connection was its own engine: taken over if it holds nothing.
        let holds = self.engine.as_ref().is_some_and(|e| e.held() != (0, 0));
        if self.said_hello || holds {
            return Err(Fail::arg(
                "hello comes once, before this connection holds leases or reservations",
            ));
        }
        self.said_hello = true;
        self.engine = Some(engines.join(self.peer_pid, token));
        Ok(engines.instance().to_le_bytes().to_vec())
    }

    /// The answer to `OP_SEGMENTS` and the descriptors to attach.
    fn segments(&self) -> Result<(Vec<u8>, Vec<RawFd>), Fail> {
        let engines = self.engines()?;
        let mems = engines.memories();
        let mut body = Vec::with_capacity(12 + mems.len() * 12);
        body.extend_from_slice(&engines.instance().to_le_bytes());
        body.extend_from_slice(&(mems.len() as u32).to_le_bytes());
        let mut fds = Vec::with_capacity(2 * mems.len());
        for (id, m) in mems {
            body.extend_from_slice(&id.to_le_bytes());
            body.extend_from_slice(&m.len.to_le_bytes());
            let (rw, ro) = m.fds();
            fds.push(rw);
            fds.push(ro);
        }
        Ok((body, fds))
    }

    /// `u32 n, n x (u16 key_len, key)`.
    fn keys(&self, f: &mut Fields<'_>) -> Result<Vec<Bytes>, Fail> {
        let n = self.count(f)?;
        let mut keys = Vec::with_capacity(n);
        for _ in 0..n {
            let klen = f.u16()? as usize;
            keys.push(self.key(f.bytes(klen)?)?);
        }
        self.ended(f)?;
        Ok(keys)
    }

    fn count(&self, f: &mut Fields<'_>) -> Result<usize, Fail> {
        let n = f.u32()? as usize;
        if n > self.state.max_batch_keys {
            return Err(Fail::arg(format!(
                "{n} items (kv.max_batch_keys = {})",
                self.state.max_batch_keys
            )));
        }
        Ok(n)
    }

    fn ended(&self, f: &Fields<'_>) -> Result<(), Fail> {
        if f.0.is_empty() {
            Ok(())
        } else {
            Err(Fail::arg("bytes after the last item"))
        }
    }

    async fn view(&mut self, f: &mut Fields<'_>) -> Result<Vec<u8>, Fail> {
        let keys = self.keys(f)?;
        let engine = self.engine()?;
        let (lease, items) = self
            .engines()?
            .view(self.state, &engine, keys)
            .await
            .map_err(|e| Fail(e.0, e.1))?;
        let mut out = Vec::with_capacity(8 + items.len() * ITEM_BYTES);
        out.extend_from_slice(&lease.to_le_bytes());
        for it in items {
            out.extend_from_slice(&it.status.to_le_bytes());
            out.extend_from_slice(&it.memory.to_le_bytes());
            out.extend_from_slice(&it.off.to_le_bytes());
            out.extend_from_slice(&it.len.to_le_bytes());
        }
        Ok(out)
    }

    fn release_view(&mut self, f: &mut Fields<'_>) -> Result<Vec<u8>, Fail> {
        let lease = f.u64()?;
        self.ended(f)?;
        let engine = self.engine()?;
        self.engines()?
            .release_lease(&engine, lease)
            .map_err(|e| Fail(e.0, e.1))?;
        Ok(Vec::new())
    }

    async fn reserve(&mut self, f: &mut Fields<'_>) -> Result<Vec<u8>, Fail> {
        let n = self.count(f)?;
        let mut items = Vec::with_capacity(n);
        for _ in 0..n {
            let len = f.u64()?;
            let klen = f.u16()? as usize;
            items.push((self.key(f.bytes(klen)?)?, len));
        }
        self.ended(f)?;
        let engine = self.engine()?;
        let got = self
            .engines()?
            .reserve(self.state, &engine, items)
            .await
            .map_err(|e| Fail(e.0, e.1))?;
        let mut out = Vec::with_capacity(got.len() * ITEM_BYTES);
        for it in got {
            out.extend_from_slice(&it.status.to_le_bytes());
            out.extend_from_slice(&it.memory.to_le_bytes());
            out.extend_from_slice(&it.off.to_le_bytes());
            out.extend_from_slice(&it.ticket.to_le_bytes());
        }
        Ok(out)
    }

    async fn end_tickets(&mut self, f: &mut Fields<'_>, commit: bool) -> Result<Vec<u8>, Fail> {
        let n = self.count(f)?;
        let mut tickets = Vec::with_capacity(n);
        for _ in 0..n {
            tickets.push(f.u64()?);
        }
        self.ended(f)?;
        let engine = self.engine()?;
        let engines = self.engines()?;
        let codes = if commit {
            engines.commit(self.state, &engine, &tickets).await
        } else {
            engines.abort(self.state, &engine, &tickets).await
        };
        Ok(codes.iter().flat_map(|c| c.to_le_bytes()).collect())
    }

    async fn batch_get_into(&self, f: &mut Fields<'_>) -> Result<Vec<u8>, Fail> {
        let (r, items) = self.batch_items(f)?;
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
    let mut rd = Reader {
        sock,
        buf: Vec::new(),
        fds: VecDeque::new(),
        scratch: vec![0u8; 64 * 1024].into_boxed_slice(),
    };
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
        let mut f = Fields(&body);
        if op == OP_SEGMENTS {
            let r = conn.segments();
            state.metrics.shm_call(op, r.is_ok());
            match r {
                Ok((b, fds)) => answer_with_fds(sock, seq, &b, &fds).await?,
                Err(Fail(code, msg)) => answer(sock, seq, code, msg.as_bytes()).await?,
            }
            continue;
        }
        let r = match op {
            OP_REGISTER => match f.u64() {
                Ok(n) => {
                    let fd = rd.fds.pop_front();
                    conn.register(n, fd)
                }
                Err(e) => Err(e),
            },
            OP_RELEASE => f.u32().and_then(|id| conn.release(id)),
            OP_GET_INTO => conn.get_into(&mut f).await,
            OP_PUT_FROM => conn.put_from(&mut f).await,
            OP_BATCH_GET_INTO => conn.batch_get_into(&mut f).await,
            OP_BATCH_PUT_FROM => conn.batch_put_from(&mut f).await,
            OP_HELLO => conn.hello(&mut f),
            OP_VIEW => conn.view(&mut f).await,
            OP_RELEASE_VIEW => conn.release_view(&mut f),
            OP_RESERVE => conn.reserve(&mut f).await,
            OP_COMMIT => conn.end_tickets(&mut f, true).await,
            OP_ABORT => conn.end_tickets(&mut f, false).await,
            other => Err(Fail::arg(format!("unknown op {other}"))),
        };
        state.metrics.shm_call(op, r.is_ok());
        match r {
            Ok(b) => answer(sock, seq, 0, &b).await?,
            Err(Fail(code, msg)) => answer(sock, seq, code, msg.as_bytes()).await?,
        }
    }
}

//! The client side of moongate's shared-memory protocol (docs/kv-api.md, "Shared
//! memory"): one blocking connection on the kv face's Unix socket that registers
//! memfds and asks moongate to move values between them and the store.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;

pub use wire::MAGIC;
use wire::*;

/// The protocol's numbers, shared with moongate's side (`proxy/src/kv/api/shm.rs`), which
/// imports them from here: one definition of the wire.
pub mod wire {
    /// The first bytes of a shared-memory connection, and moongate's answer.
    pub const MAGIC: &[u8; 8] = b"MGSHM01\n";

    /// `u64 len`, one memfd attached -> `u32 region`.
    pub const OP_REGISTER: u8 = 1;
    /// `u32 region` -> empty.
    pub const OP_RELEASE: u8 = 2;
    /// `u32 region, u64 offset, u64 cap, key` -> `u64 len`.
    pub const OP_GET_INTO: u8 = 3;
    /// `u32 region, u64 offset, u64 len, key` -> empty.
    pub const OP_PUT_FROM: u8 = 4;
    /// `u32 region, u32 n, n x (u64 offset, u64 cap, u16 key_len, key)` -> `n x i64`.
    pub const OP_BATCH_GET_INTO: u8 = 5;
    /// `u32 region, u32 n, n x (u64 offset, u64 len, u16 key_len, key)` -> `n x i32`.
    pub const OP_BATCH_PUT_FROM: u8 = 6;
    /// `u64 token` -> `u64 instance`: this connection's leases and reservations are
    /// shared with the caller's other connections that say the same token (one engine);
    /// `instance` names this run of moongate (its memories are new when it changes).
    pub const OP_HELLO: u8 = 7;
    /// empty -> `u64 instance, u32 n, n x (u32 memory, u64 len)`, with `2n` descriptors
    /// attached: per memory a read-write one, then a read-only one.
    pub const OP_SEGMENTS: u8 = 8;
    /// `u32 n, n x (u16 key_len, key)` -> `u64 lease, n x (i32 status, u32 memory, u64
    /// offset, u64 len)`; status `PLACE_*` or a negative code; lease 0 when none is held.
    pub const OP_VIEW: u8 = 9;
    /// `u64 lease` -> empty.
    pub const OP_RELEASE_VIEW: u8 = 10;
    /// `u32 n, n x (u64 len, u16 key_len, key)` -> `n x (i32 status, u32 memory, u64
    /// offset, u64 ticket)`.
    pub const OP_RESERVE: u8 = 11;
    /// `u32 n, n x u64 ticket` -> `n x i32`.
    pub const OP_COMMIT: u8 = 12;
    /// `u32 n, n x u64 ticket` -> `n x i32`.
    pub const OP_ABORT: u8 = 13;

    /// The memory a view or reservation lies in: moongate's own segment.
    pub const MEMORY_SEGMENT: u32 = 0;
    /// The staging area.
    pub const MEMORY_STAGING: u32 = 1;
    /// A value viewed or reserved where it is stored (no copy).
    pub const PLACE_IN_PLACE: i32 = 0;
    /// A value read into (view) or to be sent on from (reservation) the staging area.
    pub const PLACE_STAGED: i32 = 1;
    /// Bytes of one view or reservation answer item.
    pub const ITEM_BYTES: usize = 24;
}

/// One memory moongate shares: its id (`MEMORY_*`), length, and descriptors.
pub struct SharedMemory {
    pub id: u32,
    pub len: u64,
    pub rw: std::os::fd::OwnedFd,
    pub ro: std::os::fd::OwnedFd,
}

/// One item of a view or reservation answer: status (`PLACE_*` or a negative code),
/// memory, offset, and the length (view) or ticket (reservation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Item {
    pub status: i32,
    pub memory: u32,
    pub offset: u64,
    pub extra: u64,
}

/// What a call failed with.
#[derive(Debug)]
pub enum ShmError {
    /// moongate does not speak the protocol here (`kv.shm = false`, or an older one).
    Unavailable,
    Io(io::Error),
    /// moongate's answer: a negative `MG_ERR_*` code and its message.
    Refused(i32, String),
}

impl From<io::Error> for ShmError {
    fn from(e: io::Error) -> Self {
        ShmError::Io(e)
    }
}

/// One connection and the registrations made on it (by the memfd they came from).
pub struct ShmConn {
    s: UnixStream,
    seq: u32,
    regions: HashMap<RawFd, u32>,
    /// The moongate run this connection reached ([`ShmConn::hello`]; 0 before).
    pub instance: u64,
    /// Calls sent whose answers are read before the next call's
    /// ([`ShmConn::release_view_later`]), oldest first.
    later: Vec<u32>,
}

/// Releases sent ahead of their answers on one connection at most: past it the oldest
/// answers are read at once (they are 12 bytes each; the socket's buffer is not the
/// bound).
const LATER: usize = 64;

impl ShmConn {
    /// Connects and exchanges the magic. [`ShmError::Unavailable`] when moongate answers
    /// anything else (its HTTP service then answers the magic as a bad request).
    pub fn connect(path: &str) -> Result<ShmConn, ShmError> {
        let mut s = UnixStream::connect(path)?;
        s.write_all(MAGIC)?;
        let mut back = [0u8; 8];
        s.read_exact(&mut back).map_err(|_| ShmError::Unavailable)?;
        if &back == MAGIC {
            return Ok(ShmConn {
                s,
                seq: 0,
                regions: HashMap::new(),
                instance: 0,
                later: Vec::new(),
            });
        }
        // A refusal frame (its status at bytes 8..12 and a message), or HTTP.
        let status = {
            let mut st = [0u8; 4];
            match s.read_exact(&mut st) {
                Ok(()) => i32::from_le_bytes(st),
                Err(_) => return Err(ShmError::Unavailable),
            }
        };
        let len = u32::from_le_bytes([back[0], back[1], back[2], back[3]]) as usize;
        if status >= 0 || len > 4096 {
            return Err(ShmError::Unavailable);
        }
        let mut msg = vec![0u8; len];
        s.read_exact(&mut msg)?;
        Err(ShmError::Refused(
            status,
            String::from_utf8_lossy(&msg).into_owned(),
        ))
    }

    /// The registration of memfd `fd` (`len` bytes) on this connection, made now if it
    /// has none. Registrations are remembered by fd number: [`ShmConn::release`] one
    /// before closing its memfd, or a later memfd given the same number would be served
    /// with the old registration (the old memory, which moongate keeps mapped).
    pub fn region(&mut self, fd: RawFd, len: usize) -> Result<u32, ShmError> {
        if let Some(&r) = self.regions.get(&fd) {
            return Ok(r);
        }
        let body = (len as u64).to_le_bytes();
        let seq = self.next_seq();
        let mut frame = head(body.len(), seq, OP_REGISTER);
        frame.extend_from_slice(&body);
        send_with_fd(&self.s, &frame, fd)?;
        let answer = self.answer(seq)?;
        let id = u32::from_le_bytes(
            answer
                .get(..4)
                .and_then(|b| b.try_into().ok())
                .ok_or_else(|| io::Error::other("short register answer"))?,
        );
        self.regions.insert(fd, id);
        Ok(id)
    }

    /// Ends the registration of memfd `fd` on this connection (moongate unmaps it);
    /// nothing to do when it has none.
    pub fn release(&mut self, fd: RawFd) -> Result<(), ShmError> {
        let Some(id) = self.regions.remove(&fd) else {
            return Ok(());
        };
        let seq = self.next_seq();
        let mut frame = head(4, seq, OP_RELEASE);
        frame.extend_from_slice(&id.to_le_bytes());
        self.s.write_all(&frame)?;
        self.answer(seq).map(|_| ())
    }

    /// Reads `key` into `[offset, offset + cap)` of `region`: the value's length.
    pub fn get_into(
        &mut self,
        region: u32,
        offset: u64,
        cap: u64,
        key: &str,
    ) -> Result<u64, ShmError> {
        let a = self.call(OP_GET_INTO, region, offset, cap, key)?;
        Ok(u64::from_le_bytes(
            a.get(..8)
                .and_then(|b| b.try_into().ok())
                .ok_or_else(|| io::Error::other("short get answer"))?,
        ))
    }

    /// Stores `[offset, offset + len)` of `region` under `key`.
    pub fn put_from(
        &mut self,
        region: u32,
        offset: u64,
        len: u64,
        key: &str,
    ) -> Result<(), ShmError> {
        self.call(OP_PUT_FROM, region, offset, len, key).map(|_| ())
    }

    /// Reads each `(offset, cap, key)` into `region`: per item its length or a negative
    /// `MG_ERR_*`.
    pub fn batch_get_into(
        &mut self,
        region: u32,
        items: &[(u64, u64, &str)],
    ) -> Result<Vec<i64>, ShmError> {
        let a = self.batch(OP_BATCH_GET_INTO, region, items, 8)?;
        Ok(a.chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap_or_default()))
            .collect())
    }

    /// Stores each `(offset, len, key)` of `region` as one value: per item 0 or a
    /// negative `MG_ERR_*`.
    pub fn batch_put_from(
        &mut self,
        region: u32,
        items: &[(u64, u64, &str)],
    ) -> Result<Vec<i32>, ShmError> {
        let a = self.batch(OP_BATCH_PUT_FROM, region, items, 4)?;
        Ok(a.chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap_or_default()))
            .collect())
    }

    /// One batch call: `(offset, u64, key)` items of `region`, answered by `per_item`
    /// bytes per item (the answer's length checked).
    fn batch(
        &mut self,
        op: u8,
        region: u32,
        items: &[(u64, u64, &str)],
        per_item: usize,
    ) -> Result<Vec<u8>, ShmError> {
        let mut body = Vec::with_capacity(8 + items.len() * 40);
        body.extend_from_slice(&region.to_le_bytes());
        body.extend_from_slice(&(items.len() as u32).to_le_bytes());
        for (off, len, key) in items {
            let klen = u16::try_from(key.len()).map_err(|_| io::Error::other("key too long"))?;
            body.extend_from_slice(&off.to_le_bytes());
            body.extend_from_slice(&len.to_le_bytes());
            body.extend_from_slice(&klen.to_le_bytes());
            body.extend_from_slice(key.as_bytes());
        }
        let seq = self.next_seq();
        let mut frame = head(body.len(), seq, op);
        frame.extend_from_slice(&body);
        self.s.write_all(&frame)?;
        let a = self.answer(seq)?;
        if a.len() != items.len() * per_item {
            return Err(io::Error::other("batch answer of the wrong length").into());
        }
        Ok(a)
    }

    fn call(
        &mut self,
        op: u8,
        region: u32,
        offset: u64,
        len: u64,
        key: &str,
    ) -> Result<Vec<u8>, ShmError> {
        let seq = self.next_seq();
        let mut frame = head(20 + key.len(), seq, op);
        frame.extend_from_slice(&region.to_le_bytes());
        frame.extend_from_slice(&offset.to_le_bytes());
        frame.extend_from_slice(&len.to_le_bytes());
        frame.extend_from_slice(key.as_bytes());
        self.s.write_all(&frame)?;
        self.answer(seq)
    }

    /// Joins this connection to the engine `token` names (the caller's handle); learns
    /// the moongate run ([`ShmConn::instance`]).
    pub fn hello(&mut self, token: u64) -> Result<(), ShmError> {
        let a = self.simple(OP_HELLO, &token.to_le_bytes())?;
        self.instance = a
            .get(..8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
            .ok_or_else(|| io::Error::other("short hello answer"))?;
        Ok(())
    }

    /// The memories moongate shares, with their descriptors, and the run they belong to.
    pub fn segments(&mut self) -> Result<(u64, Vec<SharedMemory>), ShmError> {
        use std::os::fd::{FromRawFd, OwnedFd};
        let seq = self.next_seq();
        self.s.write_all(&head(0, seq, OP_SEGMENTS))?;
        let (body, fds) = self.answer_fds(seq)?;
        let mut fds: std::collections::VecDeque<OwnedFd> = fds
            .into_iter()
            // SAFETY: descriptors received with the answer, owned from here.
            .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) })
            .collect();
        let (instance, n) = body
            .get(..12)
            .map(|b| {
                (
                    u64::from_le_bytes(b[..8].try_into().unwrap_or_default()),
                    u32::from_le_bytes(b[8..12].try_into().unwrap_or_default()) as usize,
                )
            })
            .ok_or_else(|| io::Error::other("short segments answer"))?;
        if body.len() != 12 + n * 12 || fds.len() != 2 * n {
            return Err(io::Error::other("segments answer does not match its descriptors").into());
        }
        let mut out = Vec::with_capacity(n);
        for c in body[12..].chunks_exact(12) {
            let (Some(rw), Some(ro)) = (fds.pop_front(), fds.pop_front()) else {
                return Err(io::Error::other("missing descriptors").into());
            };
            out.push(SharedMemory {
                id: u32::from_le_bytes(c[..4].try_into().unwrap_or_default()),
                len: u64::from_le_bytes(c[4..].try_into().unwrap_or_default()),
                rw,
                ro,
            });
        }
        Ok((instance, out))
    }

    /// Views `keys`: the lease (0 when no item is held) and per key where it lies
    /// (`extra` = its length).
    pub fn view(&mut self, keys: &[&str]) -> Result<(u64, Vec<Item>), ShmError> {
        let mut body = Vec::with_capacity(4 + keys.len() * 40);
        body.extend_from_slice(&(keys.len() as u32).to_le_bytes());
        for k in keys {
            let klen = u16::try_from(k.len()).map_err(|_| io::Error::other("key too long"))?;
            body.extend_from_slice(&klen.to_le_bytes());
            body.extend_from_slice(k.as_bytes());
        }
        let a = self.simple(OP_VIEW, &body)?;
        if a.len() != 8 + keys.len() * ITEM_BYTES {
            return Err(io::Error::other("view answer of the wrong length").into());
        }
        let lease = u64::from_le_bytes(a[..8].try_into().unwrap_or_default());
        Ok((lease, items(&a[8..])))
    }

    /// Ends a view lease.
    pub fn release_view(&mut self, lease: u64) -> Result<(), ShmError> {
        self.simple(OP_RELEASE_VIEW, &lease.to_le_bytes())
            .map(|_| ())
    }

    /// Ends a view lease without waiting for moongate's answer: the release is sent now
    /// (moongate acts on it as soon as it reads it, before any later call of this
    /// connection), its answer read before the next call's. A refusal (a lease moongate
    /// no longer held: it expired) is not reported; a broken connection is, by the next
    /// call. Saves one round trip per batch of views.
    pub fn release_view_later(&mut self, lease: u64) -> Result<(), ShmError> {
        if self.later.len() >= LATER {
            self.drain_later()?;
        }
        let seq = self.next_seq();
        let mut frame = head(8, seq, OP_RELEASE_VIEW);
        frame.extend_from_slice(&lease.to_le_bytes());
        self.s.write_all(&frame)?;
        self.later.push(seq);
        Ok(())
    }

    /// Reads the answers to calls sent ahead ([`ShmConn::release_view_later`]).
    fn drain_later(&mut self) -> Result<(), ShmError> {
        for seq in std::mem::take(&mut self.later) {
            match self.read_answer(seq) {
                Ok(_) | Err(ShmError::Refused(..)) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Reserves room for `(key, len)` items: per item where to write (`extra` = its
    /// ticket).
    pub fn reserve(&mut self, items_in: &[(&str, u64)]) -> Result<Vec<Item>, ShmError> {
        let mut body = Vec::with_capacity(4 + items_in.len() * 48);
        body.extend_from_slice(&(items_in.len() as u32).to_le_bytes());
        for (k, len) in items_in {
            let klen = u16::try_from(k.len()).map_err(|_| io::Error::other("key too long"))?;
            body.extend_from_slice(&len.to_le_bytes());
            body.extend_from_slice(&klen.to_le_bytes());
            body.extend_from_slice(k.as_bytes());
        }
        let a = self.simple(OP_RESERVE, &body)?;
        if a.len() != items_in.len() * ITEM_BYTES {
            return Err(io::Error::other("reserve answer of the wrong length").into());
        }
        Ok(items(&a))
    }

    /// Commits (`OP_COMMIT`) or aborts (`OP_ABORT`) tickets: per ticket 0 or a code.
    pub fn end_tickets(&mut self, op: u8, tickets: &[u64]) -> Result<Vec<i32>, ShmError> {
        let mut body = Vec::with_capacity(4 + tickets.len() * 8);
        body.extend_from_slice(&(tickets.len() as u32).to_le_bytes());
        for t in tickets {
            body.extend_from_slice(&t.to_le_bytes());
        }
        let a = self.simple(op, &body)?;
        if a.len() != tickets.len() * 4 {
            return Err(io::Error::other("answer of the wrong length").into());
        }
        Ok(a.chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap_or_default()))
            .collect())
    }

    /// One call with `body`: its answer's body.
    fn simple(&mut self, op: u8, body: &[u8]) -> Result<Vec<u8>, ShmError> {
        let seq = self.next_seq();
        let mut frame = head(body.len(), seq, op);
        frame.extend_from_slice(body);
        self.s.write_all(&frame)?;
        self.answer(seq)
    }

    /// The answer to `seq` and the descriptors that came with it.
    fn answer_fds(&mut self, seq: u32) -> Result<(Vec<u8>, Vec<RawFd>), ShmError> {
        self.drain_later()?;
        let mut h = [0u8; 12];
        let mut fds = recv_with_fds(&self.s, &mut h)?;
        let len = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
        let got = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
        let status = i32::from_le_bytes([h[8], h[9], h[10], h[11]]);
        let close = |fds: &mut Vec<RawFd>| {
            for fd in fds.drain(..) {
                // SAFETY: descriptors received here and owned by no one else.
                unsafe { libc::close(fd) };
            }
        };
        if len > 1 << 20 || got != seq {
            close(&mut fds);
            return Err(io::Error::other("a segments answer that does not fit").into());
        }
        let mut body = vec![0u8; len];
        if let Err(e) = self.s.read_exact(&mut body) {
            close(&mut fds);
            return Err(e.into());
        }
        if status < 0 {
            close(&mut fds);
            return Err(ShmError::Refused(
                status,
                String::from_utf8_lossy(&body).into_owned(),
            ));
        }
        Ok((body, fds))
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    /// The answer to `seq`: its body, or the refusal it carries.
    fn answer(&mut self, seq: u32) -> Result<Vec<u8>, ShmError> {
        self.drain_later()?;
        self.read_answer(seq)
    }

    fn read_answer(&mut self, seq: u32) -> Result<Vec<u8>, ShmError> {
        let mut h = [0u8; 12];
        self.s.read_exact(&mut h)?;
        let len = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
        let got = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
        let status = i32::from_le_bytes([h[8], h[9], h[10], h[11]]);
        // Answers are small: a length, a region id, or 8 bytes per batch item.
        if len > 64 << 20 {
            return Err(io::Error::other(format!("an answer of {len} bytes")).into());
        }
        let mut body = vec![0u8; len];
        self.s.read_exact(&mut body)?;
        if got != seq {
            return Err(io::Error::other(format!("answer {got} to call {seq}")).into());
        }
        if status < 0 {
            return Err(ShmError::Refused(
                status,
                String::from_utf8_lossy(&body).into_owned(),
            ));
        }
        Ok(body)
    }
}

fn items(b: &[u8]) -> Vec<Item> {
    b.chunks_exact(ITEM_BYTES)
        .map(|c| Item {
            status: i32::from_le_bytes(c[..4].try_into().unwrap_or_default()),
            memory: u32::from_le_bytes(c[4..8].try_into().unwrap_or_default()),
            offset: u64::from_le_bytes(c[8..16].try_into().unwrap_or_default()),
            extra: u64::from_le_bytes(c[16..24].try_into().unwrap_or_default()),
        })
        .collect()
}

/// Reads exactly `buf.len()` bytes, keeping the descriptors that arrive with them.
fn recv_with_fds(s: &UnixStream, buf: &mut [u8]) -> io::Result<Vec<RawFd>> {
    let mut fds = Vec::new();
    let mut got = 0;
    while got < buf.len() {
        let mut iov = libc::iovec {
            iov_base: buf[got..].as_mut_ptr().cast(),
            iov_len: buf.len() - got,
        };
        // Room for 8 descriptors: two memories' two each, with margin.
        let mut control = [0u64; 8];
        // SAFETY: a zeroed msghdr is valid; its pointers are set to buffers we own.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&control) as _;
        // SAFETY: every buffer in msg is ours and of its stated length.
        let n = unsafe { libc::recvmsg(s.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        // SAFETY: walking the control messages recvmsg filled in.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(c).cast::<RawFd>();
                    let bytes = (*c).cmsg_len as usize - (data as usize - c as usize);
                    for i in 0..bytes / std::mem::size_of::<RawFd>() {
                        fds.push(data.add(i).read_unaligned());
                    }
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        if n == 0 {
            for fd in fds {
                // SAFETY: received here, owned by no one else.
                unsafe { libc::close(fd) };
            }
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        got += n as usize;
    }
    Ok(fds)
}

fn head(body_len: usize, seq: u32, op: u8) -> Vec<u8> {
    let mut f = Vec::with_capacity(9 + body_len);
    f.extend_from_slice(&(body_len as u32).to_le_bytes());
    f.extend_from_slice(&seq.to_le_bytes());
    f.push(op);
    f
}

/// Sends `data` with `fd` attached (SCM_RIGHTS).
fn send_with_fd(s: &UnixStream, data: &[u8], fd: RawFd) -> io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    let mut control = [0u64; 4];
    // SAFETY: a zeroed msghdr is valid; its pointers are set below to buffers we own.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE is pure arithmetic.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as _;
    // SAFETY: the control buffer holds one cmsg with one fd (CMSG_SPACE above fits in it).
    let sent = unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        libc::CMSG_DATA(c).cast::<RawFd>().write_unaligned(fd);
        libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL)
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    let sent = sent as usize;
    if sent < data.len() {
        // The fd went with the first bytes; the rest is plain data.
        (&*s).write_all(&data[sent..])?;
    }
    Ok(())
}

//! The client side of moongate's shared-memory protocol (docs/kv-api.md, "Shared
//! memory"): one blocking connection on the kv face's Unix socket that registers
//! memfds and asks moongate to move values between them and the store.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;

/// The first bytes of a shared-memory connection, and moongate's answer.
pub const MAGIC: &[u8; 8] = b"MGSHM01\n";

const OP_REGISTER: u8 = 1;
const OP_RELEASE: u8 = 2;
const OP_GET_INTO: u8 = 3;
const OP_PUT_FROM: u8 = 4;
const OP_BATCH_GET_INTO: u8 = 5;
const OP_BATCH_PUT_FROM: u8 = 6;

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
}

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

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    /// The answer to `seq`: its body, or the refusal it carries.
    fn answer(&mut self, seq: u32) -> Result<Vec<u8>, ShmError> {
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

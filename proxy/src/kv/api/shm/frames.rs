//! The shared-memory protocol's frames on the socket: the magic peeked without taking
//! it, frames read with the descriptors that come with them, answers written (with
//! descriptors when they carry some), and a frame body read field by field.

use super::*;

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

/// Reads frames with `recvmsg`, keeping the file descriptors that arrive with them.
pub(super) struct Reader<'a> {
    sock: &'a UnixStream,
    buf: Vec<u8>,
    pub(super) fds: VecDeque<OwnedFd>,
    /// What one `recvmsg` reads into: once per connection, not a 64 KiB array zeroed
    /// on the stack (and carried in the future) at every read.
    scratch: Box<[u8]>,
}

impl<'a> Reader<'a> {
    pub(super) fn new(sock: &'a UnixStream) -> Reader<'a> {
        Reader {
            sock,
            buf: Vec::new(),
            fds: VecDeque::new(),
            scratch: vec![0u8; 64 * 1024].into_boxed_slice(),
        }
    }

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
    pub(super) async fn take(&mut self, n: usize) -> io::Result<Option<Vec<u8>>> {
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

pub(super) async fn write_all(sock: &UnixStream, mut b: &[u8]) -> io::Result<()> {
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
pub(super) async fn answer_with_fds(
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
pub(super) async fn answer(
    sock: &UnixStream,
    seq: u32,
    status: i32,
    body: &[u8],
) -> io::Result<()> {
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
pub(super) struct Fields<'a>(pub(super) &'a [u8]);

impl<'a> Fields<'a> {
    pub(super) fn bytes(&mut self, n: usize) -> Result<&'a [u8], Fail> {
        if self.0.len() < n {
            return Err(Fail::arg("frame body too short"));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    pub(super) fn u16(&mut self) -> Result<u16, Fail> {
        Ok(u16::from_le_bytes(
            self.bytes(2)?.try_into().unwrap_or_default(),
        ))
    }
    pub(super) fn u32(&mut self) -> Result<u32, Fail> {
        Ok(u32::from_le_bytes(
            self.bytes(4)?.try_into().unwrap_or_default(),
        ))
    }
    pub(super) fn u64(&mut self) -> Result<u64, Fail> {
        Ok(u64::from_le_bytes(
            self.bytes(8)?.try_into().unwrap_or_default(),
        ))
    }
}

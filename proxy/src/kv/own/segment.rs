//! moongate's own memory segment: memory it mounts with the master so that puts from any
//! Mooncake client can land in it, and the owner side of the transfer engine's TCP
//! transport that serves it to unmodified clients.
//!
//! The memory is a set of 1 MiB pages, each behind its own lock, addressed from an
//! advertised base address (any non-zero number works: owners map addresses to their own
//! storage, data-plane spec B.7). Transfers copy through a bounded chunk buffer, never
//! holding a page lock across socket I/O.
//!
//! Owner protocol (spec B): a 24-byte header; a request is served iff `size > 0`, the
//! range does not overflow and lies inside the segment; otherwise v2 peers get status 1
//! and the connection closes (v1: it just closes). A v2 WRITE is acknowledged only after
//! the last byte is in memory. One request at a time per connection, at most
//! `kv.segment_max_connections` connections, each closed after `kv.idle_timeout_ms`
//! without bytes; a broken or malicious connection ends only itself. Like Mooncake's own
//! TE-TCP, the listener trusts the network: anyone who reaches it reads and writes the
//! segment (`kv.segment_tcp = false` serves it over authenticated QUIC only).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::accept::{ConnLimit, Idle};

const PAGE: usize = 1 << 20;
/// Bytes moved per step between socket and pages.
const CHUNK: usize = 256 << 10;
const STATUS_OK: [u8; 8] = [0, 0, 0, 0, 0x56, 0x54, 0x43, 0x4d];
const STATUS_REJECTED: [u8; 8] = [1, 0, 0, 0, 0x56, 0x54, 0x43, 0x4d];

/// Segment memory: `len` bytes at advertised addresses `[base, base + len)`.
pub struct Memory {
    pub base: u64,
    pub len: u64,
    pages: Vec<Mutex<Box<[u8]>>>,
}

impl Memory {
    pub fn new(base: u64, len: u64) -> Memory {
        let n = (len as usize).div_ceil(PAGE);
        Memory {
            base,
            len,
            pages: (0..n)
                .map(|_| Mutex::new(vec![0u8; PAGE].into_boxed_slice()))
                .collect(),
        }
    }

    /// The offset of `[addr, addr + size)` in the segment, if it lies inside.
    pub fn offset_of(&self, addr: u64, size: u64) -> Option<usize> {
        let end = addr.checked_add(size)?;
        (size > 0 && addr >= self.base && end <= self.base + self.len)
            .then(|| (addr - self.base) as usize)
    }

    pub fn write_at(&self, off: usize, mut data: &[u8]) {
        self.each_page(off, data.len(), |page| {
            let n = page.len();
            page.copy_from_slice(&data[..n]);
            data = &data[n..];
        });
    }

    /// `len` bytes from `off` in a new vector, copied once (not zeroed first).
    pub fn read_vec(&self, off: usize, len: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(len);
        self.each_page(off, len, |page| out.extend_from_slice(page));
        out
    }

    pub fn read_at(&self, off: usize, mut out: &mut [u8]) {
        self.each_page(off, out.len(), |page| {
            let (to, rest) = std::mem::take(&mut out).split_at_mut(page.len());
            to.copy_from_slice(page);
            out = rest;
        });
    }

    /// Calls `f` with each page's part of `[off, off + len)` in order, that page locked.
    fn each_page(&self, mut off: usize, mut len: usize, mut f: impl FnMut(&mut [u8])) {
        while len > 0 {
            let (p, within) = (off / PAGE, off % PAGE);
            let n = (PAGE - within).min(len);
            f(&mut self.pages[p].lock().unwrap_or_else(|e| e.into_inner())[within..within + n]);
            off += n;
            len -= n;
        }
    }
}

/// Serves TE-TCP requests for `mem` until shutdown, at most `limit` connections at
/// once, each closed after `idle` without bytes.
pub async fn serve(
    listener: TcpListener,
    mem: Arc<Memory>,
    limit: ConnLimit,
    idle: Duration,
    shutdown: CancellationToken,
) {
    loop {
        let Some((sock, peer)) = crate::accept::next(&listener, &shutdown, "segment").await else {
            return;
        };
        let Some(slot) = limit.admit() else {
            continue;
        };
        let _ = sock.set_nodelay(true);
        let mem = mem.clone();
        tokio::spawn(async move {
            let io = Idle::new(sock, idle).tracking(slot.progress());
            tokio::select! {
                r = serve_conn(io, &mem) => if let Err(e) = r {
                    tracing::debug!(%peer, error = %e, "segment connection closed");
                },
                _ = slot.stopped() => tracing::debug!(%peer, "segment connection shed at the cap"),
            }
            drop(slot);
        });
    }
}

/// Holds the TE-TCP address of a segment served over QUIC only (`kv.segment_tcp =
/// false`): the address names the segment, but every connection to it is closed at
/// once and counted as refused.
pub async fn refuse_all(listener: TcpListener, refused: ConnLimit, shutdown: CancellationToken) {
    while let Some((sock, peer)) = crate::accept::next(&listener, &shutdown, "segment").await {
        tracing::debug!(%peer, "TE-TCP to a QUIC-only segment refused");
        refused.refuse();
        drop(sock);
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("rejected {op} of {size} bytes at {addr:#x}: outside the segment")]
    Rejected {
        op: &'static str,
        addr: u64,
        size: u64,
    },
}

/// Serves requests on one connection (a TCP socket or a QUIC stream) until EOF.
pub async fn serve_conn<S>(mut s: S, mem: &Memory) -> Result<(), ConnError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    // Sized by the first transfer, not up front: connections that only connect (or
    // move small values) cost no 256 KiB each.
    let mut chunk = Vec::new();
    loop {
        let mut h = [0u8; 24];
        match s.read_exact(&mut h).await {
            Ok(_) => {}
            // EOF between requests is how peers leave.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        }
        let size = u64::from_le_bytes(h[..8].try_into().unwrap_or_default());
        let addr = u64::from_le_bytes(h[8..16].try_into().unwrap_or_default());
        let v2 = h[16] & 0x80 != 0;
        let write = h[16] & 0x7f == 1;
        let op = if write { "WRITE" } else { "READ" };
        let Some(off) = mem.offset_of(addr, size) else {
            if v2 {
                let _ = s.write_all(&STATUS_REJECTED).await;
            }
            return Err(ConnError::Rejected { op, addr, size });
        };
        let size = size as usize;
        if chunk.len() < CHUNK.min(size) {
            chunk.resize(CHUNK.min(size), 0);
        }
        if write {
            let mut done = 0;
            while done < size {
                let n = CHUNK.min(size - done);
                s.read_exact(&mut chunk[..n]).await?;
                mem.write_at(off + done, &chunk[..n]);
                done += n;
            }
            // Acknowledged only now: every byte is in place.
            if v2 {
                s.write_all(&STATUS_OK).await?;
            }
        } else {
            if v2 {
                s.write_all(&STATUS_OK).await?;
            }
            let mut done = 0;
            while done < size {
                let n = CHUNK.min(size - done);
                mem.read_at(off + done, &mut chunk[..n]);
                s.write_all(&chunk[..n]).await?;
                done += n;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_and_page_crossing_copies() {
        let m = Memory::new(0x1000_0000, 3 * PAGE as u64);
        assert_eq!(m.offset_of(0x1000_0000, 1), Some(0));
        assert_eq!(m.offset_of(0x1000_0000, 0), None);
        assert_eq!(m.offset_of(0x0fff_ffff, 2), None);
        assert_eq!(m.offset_of(0x1000_0000 + 3 * PAGE as u64 - 1, 2), None);
        assert_eq!(m.offset_of(u64::MAX, 2), None);
        let data: Vec<u8> = (0..PAGE + 10).map(|i| i as u8).collect();
        m.write_at(PAGE - 5, &data);
        let mut back = vec![0u8; data.len()];
        m.read_at(PAGE - 5, &mut back);
        assert_eq!(back, data);
        assert_eq!(m.read_vec(PAGE - 5, data.len()), data);
        assert_eq!(m.read_vec(PAGE - 5, 3), data[..3]);
    }
}

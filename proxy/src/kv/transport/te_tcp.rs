//! The initiator side of Mooncake's transfer-engine TCP transport: READ and WRITE of a
//! byte range in another process's registered memory.
//!
//! Wire (data-plane spec B): a 24-byte header `u64 size | u64 addr | u8 opcode | 7 pad`
//! (opcode bit 0 = WRITE, bit 7 = v2 framing); v2 owners answer an 8-byte status frame
//! (`u32 status | "MCTV"`) before READ data and after WRITE data is in memory. One
//! request at a time per connection; connections are kept per peer and reused, and a
//! large transfer is cut into ranges moved over several connections at once.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use thiserror::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt, ReadBuf};

use super::fill;
use tokio::net::TcpStream;

/// `"MCTV"` in the high half of a v2 status frame.
const STATUS_MAGIC: u32 = 0x4D43_5456;
const OP_WRITE: u8 = 1;
const OP_V2: u8 = 0x80;

#[derive(Debug, Error)]
pub enum TeError {
    #[error("transfer engine peer {peer}: {source}")]
    Io {
        peer: String,
        source: std::io::Error,
    },
    #[error("transfer engine peer {peer} rejected [{addr:#x}, +{len}) (status {status})")]
    Rejected {
        peer: String,
        addr: u64,
        len: u64,
        status: u32,
    },
    #[error("transfer engine peer {peer} sent a frame that is not a v2 status")]
    NotV2 { peer: String },
    #[error("transfer engine peer {peer} did not answer within {0:?}", .timeout)]
    Timeout { peer: String, timeout: Duration },
}

/// Maps an I/O error on the connection to `peer`.
pub fn io_error(peer: &str) -> impl Fn(std::io::Error) -> TeError + '_ {
    move |source| TeError::Io {
        peer: peer.to_string(),
        source,
    }
}

/// Encodes a request header.
pub fn header(size: u64, addr: u64, write: bool, v2: bool) -> [u8; 24] {
    let mut h = [0u8; 24];
    h[..8].copy_from_slice(&size.to_le_bytes());
    h[8..16].copy_from_slice(&addr.to_le_bytes());
    h[16] = (if write { OP_WRITE } else { 0 }) | (if v2 { OP_V2 } else { 0 });
    h
}

/// Decodes a v2 status frame: `Some(status)`, or `None` when it is not one.
pub fn status(frame: [u8; 8]) -> Option<u32> {
    let v = u64::from_le_bytes(frame);
    ((v >> 32) as u32 == STATUS_MAGIC).then_some(v as u32)
}

/// `(offset, len)` ranges covering `0..len`: one below `split_bytes`, else `parts` equal
/// parts (the last one shorter), moved over that many connections or streams at once.
pub fn split_ranges(len: u64, split_bytes: u64, parts: usize) -> Vec<(u64, u64)> {
    let parts = if len >= split_bytes {
        parts.max(1) as u64
    } else {
        1
    };
    let step = len.div_ceil(parts).max(1);
    (0..parts)
        .map(|i| (i * step, step.min(len.saturating_sub(i * step))))
        .filter(|&(_, n)| n > 0)
        .collect()
}

/// Idle connections kept per peer at least (the kv face's batch concurrency).
const KEEP_PER_PEER: usize = 16;

/// Idle connections per peer (`host:port` of its TE data listener).
pub struct Pool {
    idle: Mutex<HashMap<String, Vec<TcpStream>>>,
    /// Connections one large transfer is spread over.
    per_peer: usize,
    /// Idle connections kept per peer: enough for a batch's concurrent transfers, so
    /// they reuse connections instead of dialling and dropping one each.
    keep: usize,
    timeout: Duration,
    /// Ranges at least this large are split over several connections.
    split_bytes: u64,
    /// Bytes per stripe of a streamed value (`kv.te_stripe_bytes`; 0: one connection).
    stripe_bytes: u64,
}

impl Pool {
    pub fn new(per_peer: usize, timeout: Duration) -> Pool {
        Pool {
            idle: Mutex::new(HashMap::new()),
            per_peer: per_peer.max(1),
            keep: per_peer.max(KEEP_PER_PEER),
            timeout,
            split_bytes: 4 << 20,
            stripe_bytes: 0,
        }
    }

    /// Streams values in stripes of `bytes` over the pool's connections per peer at once
    /// (`kv.te_stripe_bytes`; 0 keeps a streamed value on one connection).
    pub fn with_stripes(mut self, bytes: u64) -> Pool {
        self.stripe_bytes = bytes;
        self
    }

    /// How a streamed value of `len` bytes moves: `Some((stripe bytes, connections at
    /// once))` when it spans at least two stripes and more than one connection is
    /// allowed, else `None` (one connection, bytes passed on as they arrive).
    pub fn stripes_for(&self, len: u64) -> Option<(u64, usize)> {
        (self.stripe_bytes > 0 && self.per_peer > 1 && len >= 2 * self.stripe_bytes)
            .then_some((self.stripe_bytes, self.per_peer))
    }

    /// The deadline of one transfer's step (`kv.timeout_ms`).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    async fn take(&self, peer: &str) -> Result<TcpStream, TeError> {
        let reused = self
            .idle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(peer)
            .and_then(Vec::pop);
        if let Some(s) = reused {
            return Ok(s);
        }
        let s = tokio::time::timeout(self.timeout, TcpStream::connect(peer))
            .await
            .map_err(|_| TeError::Timeout {
                peer: peer.to_string(),
                timeout: self.timeout,
            })?
            .map_err(io_error(peer))?;
        let _ = s.set_nodelay(true);
        Ok(s)
    }

    /// Idle connections kept for `peer` (tests).
    #[cfg(test)]
    pub fn idle_count(&self, peer: &str) -> usize {
        let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        idle.get(peer).map_or(0, Vec::len)
    }

    /// Keeps a connection whose last transfer ended cleanly, for the next one to `peer`.
    pub fn give_back(&self, peer: &str, s: TcpStream) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let v = idle.entry(peer.to_string()).or_default();
        if v.len() < self.keep {
            v.push(s);
        }
    }

    /// Starts a READ of `len` bytes at `addr` and returns the connection once the peer
    /// accepted it (v2 status OK), so the caller streams the bytes as they arrive. The
    /// caller owns the connection; only one whose `len` bytes were all read may go back
    /// to the pool.
    pub async fn open_read(
        &self,
        peer: &str,
        addr: u64,
        len: u64,
        v2: bool,
    ) -> Result<TcpStream, TeError> {
        let mut s = self.take(peer).await?;
        let start = async {
            s.write_all(&header(len, addr, false, v2))
                .await
                .map_err(io_error(peer))?;
            if v2 {
                self.expect_ok(&mut s, peer, addr, len).await?;
            }
            Ok::<_, TeError>(())
        };
        self.bounded(peer, start).await?;
        Ok(s)
    }

    /// Starts a WRITE of `len` bytes at `addr`: the header is sent, the caller sends the
    /// bytes as they arrive, then [`Pool::finish_write`].
    pub async fn open_write(
        &self,
        peer: &str,
        addr: u64,
        len: u64,
        v2: bool,
    ) -> Result<TcpStream, TeError> {
        let mut s = self.take(peer).await?;
        self.bounded(peer, async {
            s.write_all(&header(len, addr, true, v2))
                .await
                .map_err(io_error(peer))
        })
        .await?;
        Ok(s)
    }

    /// Ends a WRITE whose bytes were all sent: waits for the owner's v2 status (the
    /// bytes are in place) and keeps the connection for reuse.
    pub async fn finish_write(
        &self,
        peer: &str,
        mut s: TcpStream,
        addr: u64,
        len: u64,
        v2: bool,
    ) -> Result<(), TeError> {
        if v2 {
            self.bounded(peer, self.expect_ok(&mut s, peer, addr, len))
                .await?;
        }
        self.give_back(peer, s);
        Ok(())
    }

    /// Reads `len` bytes at `addr` in the peer's memory, into memory not zeroed first
    /// (every byte is the peer's before the value is handed out).
    pub async fn read(&self, peer: &str, addr: u64, len: u64, v2: bool) -> Result<Bytes, TeError> {
        let len = len as usize;
        let mut out = BytesMut::with_capacity(len);
        let spare = &mut out.spare_capacity_mut()[..len];
        self.read_ranges(peer, addr, spare, ReadBuf::uninit, v2)
            .await?;
        // SAFETY: the ranges cover [0, len) and read_ranges returns Ok only once every
        // range's ReadBuf was filled, so every byte up to len is initialized.
        unsafe { out.set_len(len) };
        Ok(out.freeze())
    }

    /// Reads `out.len()` bytes at `addr` in the peer's memory straight into `out` (a
    /// caller's buffer: the shared-memory path reads into an engine's memory this way).
    pub async fn read_to(
        &self,
        peer: &str,
        addr: u64,
        out: &mut [u8],
        v2: bool,
    ) -> Result<(), TeError> {
        self.read_ranges(peer, addr, out, ReadBuf::new, v2).await
    }

    /// Cuts `buf` as [`Pool::ranges`] cuts its length and reads every range at once,
    /// each into its part (`wrap` makes the part a `ReadBuf`: initialized memory or
    /// not); `Ok` once every part is full.
    async fn read_ranges<'a, T>(
        &self,
        peer: &str,
        addr: u64,
        buf: &'a mut [T],
        wrap: fn(&'a mut [T]) -> ReadBuf<'a>,
        v2: bool,
    ) -> Result<(), TeError> {
        let parts = self.ranges(buf.len() as u64);
        let mut rest = buf;
        let mut jobs = Vec::with_capacity(parts.len());
        for (off, n) in parts {
            let (chunk, tail) = rest.split_at_mut(n as usize);
            rest = tail;
            jobs.push(self.read_into(peer, addr + off, wrap(chunk), v2));
        }
        futures_util::future::try_join_all(jobs).await?;
        Ok(())
    }

    /// Writes `data` at `addr` in the peer's memory; with v2 it returns once the peer
    /// confirmed the bytes are in place.
    pub async fn write(&self, peer: &str, addr: u64, data: &[u8], v2: bool) -> Result<(), TeError> {
        let jobs: Vec<_> = self
            .ranges(data.len() as u64)
            .into_iter()
            .map(|(off, n)| {
                self.write_one(
                    peer,
                    addr + off,
                    &data[off as usize..(off + n) as usize],
                    v2,
                )
            })
            .collect();
        futures_util::future::try_join_all(jobs).await?;
        Ok(())
    }

    /// Writes `parts`, in order, as one WRITE at `addr` on one connection; with v2 it
    /// returns once the peer confirmed the bytes are in place.
    pub async fn write_parts(
        &self,
        peer: &str,
        addr: u64,
        parts: &[Bytes],
        v2: bool,
    ) -> Result<(), TeError> {
        let len = parts.iter().map(|p| p.len() as u64).sum();
        let mut s = self.open_write(peer, addr, len, v2).await?;
        self.bounded(peer, async {
            for p in parts {
                s.write_all(p).await.map_err(io_error(peer))?;
            }
            Ok(())
        })
        .await?;
        self.finish_write(peer, s, addr, len, v2).await
    }

    fn ranges(&self, len: u64) -> Vec<(u64, u64)> {
        split_ranges(len, self.split_bytes, self.per_peer)
    }

    /// Reads the range into `buf` until it is full (its memory may start uninitialized).
    async fn read_into(
        &self,
        peer: &str,
        addr: u64,
        mut buf: ReadBuf<'_>,
        v2: bool,
    ) -> Result<(), TeError> {
        let mut s = self
            .open_read(peer, addr, buf.capacity() as u64, v2)
            .await?;
        self.bounded(peer, async {
            fill(&mut s, &mut buf).await.map_err(io_error(peer))
        })
        .await?;
        self.give_back(peer, s);
        Ok(())
    }

    async fn write_one(&self, peer: &str, addr: u64, data: &[u8], v2: bool) -> Result<(), TeError> {
        let len = data.len() as u64;
        let mut s = self.open_write(peer, addr, len, v2).await?;
        self.bounded(peer, async {
            s.write_all(data).await.map_err(io_error(peer))
        })
        .await?;
        self.finish_write(peer, s, addr, len, v2).await
    }

    async fn expect_ok(
        &self,
        s: &mut TcpStream,
        peer: &str,
        addr: u64,
        len: u64,
    ) -> Result<(), TeError> {
        let mut f = [0u8; 8];
        s.read_exact(&mut f).await.map_err(io_error(peer))?;
        match status(f) {
            Some(0) => Ok(()),
            Some(status) => Err(TeError::Rejected {
                peer: peer.to_string(),
                addr,
                len,
                status,
            }),
            None => Err(TeError::NotV2 {
                peer: peer.to_string(),
            }),
        }
    }

    async fn bounded<T>(
        &self,
        peer: &str,
        f: impl std::future::Future<Output = Result<T, TeError>>,
    ) -> Result<T, TeError> {
        tokio::time::timeout(self.timeout, f)
            .await
            .map_err(|_| TeError::Timeout {
                peer: peer.to_string(),
                timeout: self.timeout,
            })?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_match_the_captures() {
        // READ v2, 100000 B @0x7fe97b000000 (data-plane spec B.2)
        let h = header(100_000, 0x7fe9_7b00_0000, false, true);
        assert_eq!(
            h,
            [
                0xa0, 0x86, 0x01, 0, 0, 0, 0, 0, 0, 0, 0, 0x7b, 0xe9, 0x7f, 0, 0, 0x80, 0, 0, 0, 0,
                0, 0, 0
            ]
        );
        assert_eq!(header(5 << 20, 0xa12b_0000_1000, true, true)[16], 0x81);
        assert_eq!(header(1, 1, true, false)[16], 0x01);
    }

    #[test]
    fn status_frames() {
        assert_eq!(status([0, 0, 0, 0, 0x56, 0x54, 0x43, 0x4d]), Some(0));
        assert_eq!(status([1, 0, 0, 0, 0x56, 0x54, 0x43, 0x4d]), Some(1));
        assert_eq!(status([0; 8]), None);
    }

    #[tokio::test]
    async fn fill_takes_a_range_in_pieces_into_uninitialized_memory_and_refuses_a_short_one() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let peer = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            for piece in [&b"abc"[..], b"defg", b"hij"] {
                s.write_all(piece).await.unwrap();
                s.flush().await.unwrap();
                tokio::task::yield_now().await;
            }
            // A second range of 10 bytes gets 4, then the end.
            s.write_all(b"klmn").await.unwrap();
        });
        let mut s = TcpStream::connect(addr).await.unwrap();
        let mut mem = [std::mem::MaybeUninit::<u8>::uninit(); 10];
        let mut buf = ReadBuf::uninit(&mut mem);
        fill(&mut s, &mut buf).await.unwrap();
        assert_eq!(buf.filled(), b"abcdefghij");
        let mut short = [0u8; 10];
        let e = fill(&mut s, &mut ReadBuf::new(&mut short))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
        peer.await.unwrap();
    }

    #[test]
    fn large_ranges_split_evenly() {
        let p = Pool::new(4, Duration::from_secs(1));
        assert_eq!(p.ranges(100), [(0, 100)]);
        let r = p.ranges((16 << 20) + 3);
        assert_eq!(r.len(), 4);
        assert_eq!(r.iter().map(|x| x.1).sum::<u64>(), (16 << 20) + 3);
        assert_eq!(r[1].0, r[0].1);
    }
}

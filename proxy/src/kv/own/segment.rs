//! moongate's own memory segment: memory it mounts with the master so that puts from any
//! Mooncake client can land in it, and the owner side of the transfer engine's TCP
//! transport that serves it to unmodified clients.
//!
//! The memory ([`Memory`]) is a memfd addressed from an advertised base address (any
//! non-zero number works: owners map addresses to their own storage, data-plane spec
//! B.7); engines on this host may map it for views. Transfers copy through a bounded
//! chunk buffer. A WRITE over a range an engine holds a view of waits for the view to
//! end, up to [`FENCE_WAIT`], then is rejected ([`super::fence`]): the viewed bytes never
//! change under the engine.
//!
//! Owner protocol (spec B): a 24-byte header; a request is served iff `size > 0`, the
//! range does not overflow and lies inside the segment; otherwise v2 peers get status 1
//! and the connection closes (v1: it just closes). A v2 WRITE is acknowledged only after
//! the last byte is in memory. One request at a time per connection, at most
//! `kv.segment_max_connections` connections, each closed after `kv.idle_timeout_ms`
//! without bytes; a broken or malicious connection ends only itself. Like Mooncake's own
//! TE-TCP, the listener trusts the network: anyone who reaches it reads and writes the
//! segment (`kv.segment_tcp = false` serves it over authenticated QUIC only).

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::accept::{ConnLimit, Idle};

/// Bytes moved per step between socket and memory.
const CHUNK: usize = 256 << 10;
const STATUS_OK: [u8; 8] = [0, 0, 0, 0, 0x56, 0x54, 0x43, 0x4d];
const STATUS_REJECTED: [u8; 8] = [1, 0, 0, 0, 0x56, 0x54, 0x43, 0x4d];

pub use super::memory::Memory;

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
    #[error("rejected WRITE of {size} bytes at {addr:#x}: an engine holds a view there")]
    Fenced { addr: u64, size: u64 },
}

/// How long a WRITE over a viewed range waits for the view to end. Views last as long as
/// an engine's load into GPU memory (milliseconds); a writer reaching a viewed range
/// means the master reused memory it freed under a lease (a forced removal, an upsert),
/// and Mooncake's writers retry a failed put.
pub const FENCE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

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
            let Ok(w) = mem.begin_write_within(off, size, FENCE_WAIT).await else {
                if v2 {
                    let _ = s.write_all(&STATUS_REJECTED).await;
                }
                return Err(ConnError::Fenced {
                    addr,
                    size: size as u64,
                });
            };
            let mut done = 0;
            while done < size {
                let n = CHUNK.min(size - done);
                s.read_exact(&mut chunk[..n]).await?;
                w.put(done, &chunk[..n]);
                done += n;
            }
            drop(w);
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

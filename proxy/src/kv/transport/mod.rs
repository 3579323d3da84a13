//! How value bytes move between moongate and the segments that hold them: the transfer
//! engine's TCP protocol ([`te_tcp`], to any Mooncake segment), QUIC between moongates
//! ([`quic`], certificate pinned through the metadata server), and RDMA device detection
//! ([`rdma`], feature `rdma`; no RDMA data path yet). Knows bytes and peers, not keys
//! or the master.

pub mod quic;
pub mod rdma;
pub mod te_tcp;

use tokio::io::{AsyncRead, ReadBuf};

/// Reads until `buf` is full (memory initialized or not: a value's buffer is not zeroed
/// before the peer's bytes land in it); the peer closing first is `UnexpectedEof`.
pub(crate) async fn fill<S: AsyncRead + Unpin>(
    s: &mut S,
    buf: &mut ReadBuf<'_>,
) -> std::io::Result<()> {
    while buf.remaining() > 0 {
        let before = buf.filled().len();
        std::future::poll_fn(|cx| std::pin::Pin::new(&mut *s).poll_read(cx, buf)).await?;
        if buf.filled().len() == before {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(())
}

//! Request bodies read whole, under the node's byte budget and a deadline: the bytes a
//! body may occupy are reserved before they are buffered (the announced length up
//! front; an unannounced body reserves as it grows), so slow or lying clients cannot
//! hold more memory than the budget, nor hold it longer than `kv.timeout_ms`; and the
//! intake's rules hold while it arrives ([`super::intake`]: the rate floor, the
//! connection's share, shedding when the budget is full).

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;

use super::intake::{Conn, IntakeError, Room, RoomError};
use crate::kv::client::{Store, StoreError};

/// Why a body was not read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("body over {limit} bytes ({what})")]
    TooLarge { limit: usize, what: &'static str },
    #[error("body shorter than its announced {announced} bytes")]
    Short { announced: u64 },
    /// Below the rate floor, or shed: answered 408.
    #[error(transparent)]
    Stopped(IntakeError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<RoomError> for BodyError {
    fn from(e: RoomError) -> BodyError {
        match e {
            RoomError::Store(e) => BodyError::Store(e),
            RoomError::Stopped(e) => BodyError::Stopped(e),
        }
    }
}

/// Grows an unannounced body's reservation in steps of this many bytes, so a body of
/// many small frames costs few semaphore operations.
const STEP: u64 = 64 << 10;

/// Reads `body` whole: at most `limit` bytes (`what` names the limit in the error),
/// within `timeout` and under the intake's rules for connection `conn`, with its bytes
/// reserved in `store`'s budget before they are held.
/// The reservation is returned with the bytes: the caller keeps it while the value is
/// in memory.
pub async fn read<B>(
    body: B,
    announced: Option<u64>,
    limit: usize,
    what: &'static str,
    conn: &Conn,
    store: &Store,
    timeout: Duration,
) -> Result<(Bytes, Room), BodyError>
where
    B: hyper::body::Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    if announced.is_some_and(|n| n > limit as u64) {
        return Err(BodyError::TooLarge { limit, what });
    }
    let (mut body, tracked) = conn.body(body);
    // An unannounced body starts with one step and grows as it arrives.
    let mut room = conn
        .reserve(store, &tracked, announced.unwrap_or(STEP).max(1))
        .await?;
    let reading = async {
        let mut buf = Gather::new(announced);
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| match e {
                IntakeError::Body(m) => BodyError::Store(StoreError::Body(m)),
                stopped => BodyError::Stopped(stopped),
            })?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            let len = buf.len().saturating_add(data.len());
            if len > limit || announced.is_some_and(|n| len as u64 > n) {
                return Err(BodyError::TooLarge { limit, what });
            }
            if len as u64 > room.bytes() {
                let more = (len as u64 - room.bytes()).max(STEP);
                conn.grow(store, &mut room, more).await?;
            }
            buf.push(data);
        }
        if let Some(n) = announced
            && (buf.len() as u64) < n
        {
            return Err(BodyError::Short { announced: n });
        }
        Ok(buf.finish())
    };
    match tokio::time::timeout(timeout, reading).await {
        Ok(Ok(b)) => Ok((b, room)),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(StoreError::BodyTimeout(timeout).into()),
    }
}

/// A body's bytes as they arrive. Frames are kept as they came (each a slice of the
/// connection's read buffer, no copy). An announced body moves into one buffer of its
/// size once half of it has arrived (each later frame copied in as it comes); an
/// unannounced one, or an announced one that ends before half, is joined once at the
/// end. Either way each byte is copied once.
///
/// Not the announced size up front: a client that announces a large body and stalls
/// (the soak's flood: 300 PUTs of 1 MiB, 64 KiB sent each) would have the allocator
/// hand out the whole announced size per body, hundreds of MiB of heap address space
/// that later small allocations spread over and trimming cannot take back; kept as
/// frames, a stalled body holds about what it sent. Nor one buffer grown by doubling:
/// that left every smaller step behind as a heap hole, and a thousand stalled uploads
/// growing in lockstep cost twice their bytes. Frames under [`SMALL`] bytes are copied
/// into a small tail instead, so a trickle of tiny frames cannot each pin a whole read
/// buffer.
enum Gather {
    Sized(BytesMut),
    Frames {
        frames: Vec<Bytes>,
        tail: BytesMut,
        len: usize,
        /// The announced length: at half of it the frames move into one buffer.
        announced: Option<usize>,
    },
}

/// Frames shorter than this are copied (see [`Gather`]); also the tail's capacity.
const SMALL: usize = 4 << 10;

impl Gather {
    fn new(announced: Option<u64>) -> Gather {
        Gather::Frames {
            frames: Vec::new(),
            tail: BytesMut::new(),
            len: 0,
            announced: announced.and_then(|n| usize::try_from(n).ok()),
        }
    }

    fn len(&self) -> usize {
        match self {
            Gather::Sized(b) => b.len(),
            Gather::Frames { len, .. } => *len,
        }
    }

    fn push(&mut self, data: Bytes) {
        let Gather::Frames {
            frames,
            tail,
            len,
            announced,
        } = self
        else {
            if let Gather::Sized(b) = self {
                b.extend_from_slice(&data);
            }
            return;
        };
        *len += data.len();
        if let Some(n) = *announced
            && *len >= n.div_ceil(2)
        {
            // Half has come: the client is sending, and the body's size is worth
            // holding in one piece.
            let mut b = BytesMut::with_capacity(n.max(*len));
            for f in frames.drain(..) {
                b.extend_from_slice(&f);
            }
            b.extend_from_slice(tail);
            b.extend_from_slice(&data);
            *self = Gather::Sized(b);
            return;
        }
        if tail.len() + data.len() > SMALL && !tail.is_empty() {
            frames.push(std::mem::take(tail).freeze());
        }
        if data.len() >= SMALL {
            frames.push(data);
        } else {
            if tail.capacity() == 0 {
                tail.reserve(SMALL);
            }
            tail.extend_from_slice(&data);
        }
    }

    /// Bytes of buffers this body holds (its frames count whole, though a frame may
    /// share its buffer with the connection's next read).
    #[cfg(test)]
    fn held(&self) -> usize {
        match self {
            Gather::Sized(b) => b.capacity(),
            Gather::Frames { frames, tail, .. } => {
                frames.iter().map(Bytes::len).sum::<usize>() + tail.capacity()
            }
        }
    }

    fn finish(self) -> Bytes {
        match self {
            Gather::Sized(b) => b.freeze(),
            Gather::Frames {
                mut frames,
                tail,
                len,
                ..
            } => {
                if !tail.is_empty() {
                    frames.push(tail.freeze());
                }
                if frames.len() == 1 {
                    return frames.pop().unwrap_or_default();
                }
                let mut out = BytesMut::with_capacity(len);
                for f in frames {
                    out.extend_from_slice(&f);
                }
                out.freeze()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames_of(body: &[u8], size: usize) -> Vec<Bytes> {
        body.chunks(size).map(Bytes::copy_from_slice).collect()
    }

    #[test]
    fn a_stalled_announced_body_holds_about_what_it_sent() {
        let mut g = Gather::new(Some(1 << 20));
        g.push(Bytes::from(vec![7u8; 64 << 10]));
        assert_eq!(g.len(), 64 << 10);
        // Not the announced MiB: a flood of these would spread the heap.
        assert!(g.held() <= 2 * (64 << 10), "held {}", g.held());
    }

    #[test]
    fn an_announced_body_moves_into_one_buffer_at_half_and_reads_back_whole() {
        let body: Vec<u8> = (0..(1 << 20) + 3).map(|i| (i * 31 % 251) as u8).collect();
        let mut g = Gather::new(Some(body.len() as u64));
        // Frames of every kind: read-buffer slices and tiny ones for the tail.
        let mut at = 0;
        for (i, size) in [100, 65536, 7, 4096, 65536].iter().cycle().enumerate() {
            if at == body.len() {
                break;
            }
            let end = (at + size).min(body.len());
            g.push(Bytes::copy_from_slice(&body[at..end]));
            at = end;
            if at < body.len() / 2 {
                assert!(matches!(g, Gather::Frames { .. }), "frame {i}: sized early");
            } else {
                assert!(
                    matches!(g, Gather::Sized(_)),
                    "frame {i}: not sized at half"
                );
            }
        }
        assert_eq!(g.held(), body.len(), "one buffer of the announced size");
        assert_eq!(&g.finish()[..], &body[..]);
    }

    #[test]
    fn unannounced_and_short_bodies_are_joined_whole() {
        let body: Vec<u8> = (0..300_000u32).map(|i| (i % 253) as u8).collect();
        for announced in [None, Some(10 << 20)] {
            let mut g = Gather::new(announced);
            for f in frames_of(&body, 65536) {
                g.push(f);
            }
            assert!(matches!(g, Gather::Frames { .. }));
            assert_eq!(&g.finish()[..], &body[..], "announced {announced:?}");
        }
        // A body in one frame.
        let mut g = Gather::new(Some(5));
        g.push(Bytes::from_static(b"hello"));
        assert_eq!(&g.finish()[..], b"hello");
    }
}

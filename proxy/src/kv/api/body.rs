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

/// A body's bytes as they arrive. An announced body is copied into one buffer of its
/// size. An unannounced one keeps its frames as they came (each a slice of the
/// connection's read buffer, no copy) and is joined once at the end: growing one buffer
/// by doubling left every smaller step behind as a heap hole, and a thousand stalled
/// uploads growing in lockstep cost twice their bytes. Frames under [`SMALL`] bytes are
/// copied into a small tail instead, so a trickle of tiny frames cannot each pin a
/// whole read buffer.
enum Gather {
    Sized(BytesMut),
    Frames {
        frames: Vec<Bytes>,
        tail: BytesMut,
        len: usize,
    },
}

/// Frames shorter than this are copied (see [`Gather`]); also the tail's capacity.
const SMALL: usize = 4 << 10;

impl Gather {
    fn new(announced: Option<u64>) -> Gather {
        match announced {
            Some(n) => Gather::Sized(BytesMut::with_capacity(n as usize)),
            None => Gather::Frames {
                frames: Vec::new(),
                tail: BytesMut::new(),
                len: 0,
            },
        }
    }

    fn len(&self) -> usize {
        match self {
            Gather::Sized(b) => b.len(),
            Gather::Frames { len, .. } => *len,
        }
    }

    fn push(&mut self, data: Bytes) {
        match self {
            Gather::Sized(b) => b.extend_from_slice(&data),
            Gather::Frames { frames, tail, len } => {
                *len += data.len();
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
        }
    }

    fn finish(self) -> Bytes {
        match self {
            Gather::Sized(b) => b.freeze(),
            Gather::Frames {
                mut frames,
                tail,
                len,
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

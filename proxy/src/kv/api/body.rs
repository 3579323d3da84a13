//! Request bodies read whole, under the node's byte budget and a deadline: the bytes a
//! body may occupy are reserved before they are buffered (the announced length up
//! front; an unannounced body reserves as it grows), so slow or lying clients cannot
//! hold more memory than the budget, nor hold it longer than `kv.timeout_ms`; and once
//! its grace has passed a body must keep arriving at `kv.min_body_bytes_per_second`, so
//! one that stalls gives its bytes back in seconds, not at the deadline.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;

use crate::kv::client::{Reserved, Store, StoreError};

/// Why a body was not read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("body over {limit} bytes ({what})")]
    TooLarge { limit: usize, what: &'static str },
    #[error("body shorter than its announced {announced} bytes")]
    Short { announced: u64 },
    #[error(
        "body arriving slower than {per_second} bytes/s (kv.min_body_bytes_per_second): \
         {got} bytes in {secs:.1} s"
    )]
    TooSlow {
        per_second: u64,
        got: usize,
        secs: f64,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Grows an unannounced body's reservation in steps of this many bytes, so a body of
/// many small frames costs few semaphore operations.
const STEP: u64 = 64 << 10;

/// The least a body must keep up: after `grace`, `per_second` bytes a second on average
/// since it started (0: no floor).
#[derive(Debug, Clone, Copy)]
pub struct MinRate {
    pub per_second: u64,
    pub grace: Duration,
}

impl MinRate {
    /// When a body that has `got` bytes after starting at `start` falls below the rate.
    fn deadline(&self, start: tokio::time::Instant, got: usize) -> Option<tokio::time::Instant> {
        (self.per_second > 0).then(|| {
            start + self.grace + Duration::from_secs_f64(got as f64 / self.per_second as f64)
        })
    }
}

/// Reads `body` whole: at most `limit` bytes (`what` names the limit in the error),
/// within `timeout` and at `min` rate, with its bytes reserved in `store`'s budget
/// before they are held.
/// The reservation is returned with the bytes: the caller keeps it while the value is
/// in memory.
pub async fn read<B>(
    body: B,
    announced: Option<u64>,
    limit: usize,
    what: &'static str,
    store: &Store,
    timeout: Duration,
    min: MinRate,
) -> Result<(Bytes, Reserved), BodyError>
where
    B: hyper::body::Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    if announced.is_some_and(|n| n > limit as u64) {
        return Err(BodyError::TooLarge { limit, what });
    }
    // An unannounced body starts with one step and grows as it arrives.
    let mut room = store.reserve(announced.unwrap_or(STEP).max(1)).await?;
    let reading = async {
        let mut body = body;
        let mut buf = BytesMut::with_capacity(announced.unwrap_or(0) as usize);
        let start = tokio::time::Instant::now();
        loop {
            let next = match min.deadline(start, buf.len()) {
                Some(at) => tokio::select! {
                    f = body.frame() => f,
                    _ = tokio::time::sleep_until(at) => {
                        return Err(BodyError::TooSlow {
                            per_second: min.per_second,
                            got: buf.len(),
                            secs: start.elapsed().as_secs_f64(),
                        });
                    }
                },
                None => body.frame().await,
            };
            let Some(frame) = next else { break };
            let frame = frame.map_err(|e| StoreError::Body(e.to_string()))?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            let len = buf.len().saturating_add(data.len());
            if len > limit || announced.is_some_and(|n| len as u64 > n) {
                return Err(BodyError::TooLarge { limit, what });
            }
            if len as u64 > room.bytes() {
                let more = (len as u64 - room.bytes()).max(STEP);
                store.grow(&mut room, more).await?;
            }
            buf.extend_from_slice(&data);
        }
        if let Some(n) = announced
            && (buf.len() as u64) < n
        {
            return Err(BodyError::Short { announced: n });
        }
        Ok(buf.freeze())
    };
    match tokio::time::timeout(timeout, reading).await {
        Ok(Ok(b)) => Ok((b, room)),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(StoreError::BodyTimeout(timeout).into()),
    }
}

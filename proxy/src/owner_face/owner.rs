//! One owner's offload-read service as the relay reaches it: pooled connections, one
//! call exchanged on one of them, the staging room a read holds until its release.

use super::*;

/// One owner's relay: where the owner is, the connections to it, what it holds staged.
pub(super) struct Owner {
    pub(super) upstream: String,
    /// The relay's address, as lookup answers name it.
    pub(super) advertised: Bytes,
    pub(super) idle: Mutex<Vec<TcpStream>>,
    pub(super) conns: Semaphore,
    pub(super) staged: Mutex<Staged>,
    /// Woken when staging room frees.
    pub(super) room: Notify,
    /// When a lookup answer last named this owner (ms since the face's epoch).
    pub(super) named_ms: std::sync::atomic::AtomicU64,
    /// Rank connections open on this relay.
    pub(super) open: std::sync::atomic::AtomicUsize,
    /// Stops this relay's listener (it is retired, or moongate stops).
    pub(super) stop: CancellationToken,
}

/// A call to an owner that did not get an answer.
#[derive(Debug, thiserror::Error)]
pub(super) enum CallError {
    #[error("cannot reach the owner at {0}: {1}")]
    Connect(String, std::io::Error),
    #[error("owner at {0}: {1}")]
    Io(String, std::io::Error),
    /// The connection ended before any byte of an answer.
    #[error("the owner closed the connection without answering: {0}")]
    Closed(std::io::Error),
    #[error("owner at {0} did not answer within {1:?}")]
    Timeout(String, Duration),
    #[error("owner at {0} sent a malformed answer: {1}")]
    Frame(String, crate::codec::FrameError),
}

/// An owner's answer to one call.
pub(super) struct Answer {
    pub(super) header: ResponseHeader,
    pub(super) body: Bytes,
    pub(super) raw: Bytes,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A reply frame with `body`, answering `seq`.
pub(super) fn reply(seq: u32, body: &Bytes) -> Bytes {
    let mut out = BytesMut::with_capacity(RESPONSE_HEADER_LEN + body.len());
    ResponseHeader::new(seq, errc::OK, body.len() as u32).write(&mut out);
    out.extend_from_slice(body);
    out.freeze()
}

/// A request frame for `body`, as the rank's call `h` but with that body.
pub(super) fn request(h: &RequestHeader, body: &Bytes) -> Bytes {
    let mut out = BytesMut::with_capacity(20 + body.len());
    let mut h = *h;
    h.length = body.len() as u32;
    h.attach_length = 0;
    h.write(&mut out);
    out.extend_from_slice(body);
    out.freeze()
}

/// Room reserved at an owner for a part on its way; given back when dropped.
pub(super) struct Reservation<'a> {
    pub(super) owner: &'a Owner,
    pub(super) bytes: u64,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        lock(&self.owner.staged).unreserve(self.bytes);
        self.owner.room.notify_waiters();
    }
}

impl Owner {
    /// Sends one call frame and waits for its answer, on a connection of its own. A
    /// pooled connection the owner closed while it was idle (it answers nothing) is
    /// replaced by a fresh one once.
    pub(super) async fn call(
        &self,
        cfg: &OwnerFaceConfig,
        frame: &Bytes,
    ) -> Result<Answer, CallError> {
        // The semaphore lives as long as the owner and is never closed.
        let _permit = self.conns.acquire().await;
        let pooled = lock(&self.idle).pop();
        if let Some(s) = pooled {
            match self.exchange(cfg, s, frame).await {
                Err(CallError::Closed(_)) => {}
                r => return r,
            }
        }
        let limit = Duration::from_millis(cfg.connect_timeout_ms);
        let s = tokio::time::timeout(limit, TcpStream::connect(&self.upstream))
            .await
            .map_err(|_| CallError::Timeout(self.upstream.clone(), limit))?
            .map_err(|e| CallError::Connect(self.upstream.clone(), e))?;
        let _ = s.set_nodelay(true);
        self.exchange(cfg, s, frame).await
    }

    pub(super) async fn exchange(
        &self,
        cfg: &OwnerFaceConfig,
        mut s: TcpStream,
        frame: &Bytes,
    ) -> Result<Answer, CallError> {
        let limit = Duration::from_millis(cfg.call_timeout_ms);
        let closed = |e: std::io::Error| CallError::Closed(e);
        let answer = tokio::time::timeout(limit, async {
            s.write_all(frame).await.map_err(closed)?;
            let mut buf = BytesMut::with_capacity(RESPONSE_HEADER_LEN + 256);
            loop {
                match check_response(&buf, cfg.max_frame_bytes) {
                    Ok(Some(h)) => {
                        let (f, raw) = crate::codec::ResponseFrame::split(&mut buf, h);
                        return Ok(Answer {
                            header: f.header,
                            body: f.body,
                            raw,
                        });
                    }
                    Ok(None) => {}
                    Err(e) => return Err(CallError::Frame(self.upstream.clone(), e)),
                }
                let n = match s.read_buf(&mut buf).await {
                    Ok(n) => n,
                    Err(e) if buf.is_empty() => return Err(closed(e)),
                    Err(e) => return Err(CallError::Io(self.upstream.clone(), e)),
                };
                if n == 0 {
                    let eof = std::io::ErrorKind::UnexpectedEof.into();
                    return Err(if buf.is_empty() {
                        closed(eof)
                    } else {
                        CallError::Io(self.upstream.clone(), eof)
                    });
                }
            }
        })
        .await
        .map_err(|_| CallError::Timeout(self.upstream.clone(), limit))??;
        // One answer per call: nothing else can be waiting on this connection.
        lock(&self.idle).push(s);
        Ok(answer)
    }
}

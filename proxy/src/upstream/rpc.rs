//! moongate's own calls to the master over coro_rpc, on connections of its own (never a
//! client's: seq numbers are per connection): the readiness probe, and pipelined typed
//! calls (the evictor's removals, the kv face's client core, the own segment's mount).
//!
//! Typed calls go in the layout of the master's Mooncake release: configured, or asked
//! once per connection (the release probe of [`crate::codec::release`]) before the
//! first call whose layout some release changed; calls with one layout in every
//! release (Ping, ServiceReady, ...) never wait for it.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use thiserror::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::codec::frame::{RESPONSE_HEADER_LEN, ResponseHeader, errc};
use crate::codec::message::Response;
use crate::codec::release::MasterRelease;
use crate::codec::{Method, RequestHeader};

#[derive(Debug, Error)]
pub enum ProbeError {
    #[error("cannot reach the master: {0}")]
    Io(#[from] std::io::Error),
    #[error("the master did not answer within {0:?}")]
    Timeout(Duration),
    #[error("the master answered with transport error {0}")]
    Rpc(u8),
    #[error("the master's ServiceReady answer did not decode")]
    Undecodable,
    #[error("the master refused ServiceReady with {0}")]
    Refused(crate::codec::types::ErrorCode),
    #[error("answer of {0} bytes is too large for a ServiceReady reply")]
    TooLarge(u64),
}

/// Asks the master `ServiceReady` on a fresh connection; returns its version string.
pub async fn service_ready(upstream: &str, timeout: Duration) -> Result<Bytes, ProbeError> {
    tokio::time::timeout(timeout, service_ready_inner(upstream))
        .await
        .map_err(|_| ProbeError::Timeout(timeout))?
}

async fn service_ready_inner(upstream: &str) -> Result<Bytes, ProbeError> {
    let mut s = TcpStream::connect(upstream).await?;
    let mut req = BytesMut::new();
    RequestHeader::new(0, Method::ServiceReady.function_id(), 0).write(&mut req);
    s.write_all(&req).await?;
    let mut hb = [0u8; RESPONSE_HEADER_LEN];
    s.read_exact(&mut hb).await?;
    let h = ResponseHeader::parse(&hb);
    let rest = u64::from(h.length) + u64::from(h.attach_length);
    if rest > 64 << 10 {
        return Err(ProbeError::TooLarge(rest));
    }
    let mut body = vec![0u8; rest as usize];
    s.read_exact(&mut body).await?;
    if h.err_code != errc::OK {
        return Err(ProbeError::Rpc(h.err_code));
    }
    body.truncate(h.length as usize);
    match Response::decode(Method::ServiceReady, &Bytes::from(body)) {
        Some(Ok((Response::ServiceReady(Ok(v)), _))) => Ok(v),
        Some(Ok((Response::ServiceReady(Err(code)), _))) => Err(ProbeError::Refused(code)),
        _ => Err(ProbeError::Undecodable),
    }
}

/// Errors of moongate's own calls on its own connections.
#[derive(Debug, Error)]
pub enum CallError {
    #[error("cannot reach the master: {0}")]
    Io(#[from] std::io::Error),
    #[error("the master did not answer within {0:?}")]
    Timeout(Duration),
    #[error("bad frame from the master: {0}")]
    Frame(#[from] crate::codec::FrameError),
    #[error("the master closed the connection with {0} calls unanswered")]
    Closed(usize),
    #[error("the answer to {0} did not decode")]
    Undecodable(Method),
    #[error("the master answered seq {got} where seq {want} was due; connection dropped")]
    OutOfOrder { want: u32, got: u32 },
    #[error("no master leader (HA failover in progress)")]
    NoLeader,
    #[error("the master's answer to the release probe was transport error {0}")]
    ProbeRefused(u8),
}

/// One call's outcome: the decoded answer, or the transport error code the master sent.
pub type Answer = Result<Response, u8>;

/// A connection of moongate's own to the master, for typed calls (eviction probes and
/// removals). Calls are pipelined: all requests go out in one write, answers are read
/// in request order.
pub struct Conn {
    s: TcpStream,
    seq: u32,
    buf: BytesMut,
    /// The master's release, once configured or asked; `None` until a call needs it.
    release: Option<MasterRelease>,
}

/// Largest answer accepted on moongate's own connections (a 5,000-key batch answer is
/// ~1 MiB).
const OWN_MAX_FRAME: u64 = 64 << 20;

impl Conn {
    /// A connection to the master at `upstream`, whose release is `release` (as
    /// configured; `None`: asked when a call first needs it).
    pub async fn connect(
        upstream: &str,
        timeout: Duration,
        release: Option<MasterRelease>,
    ) -> Result<Conn, CallError> {
        let s = tokio::time::timeout(timeout, TcpStream::connect(upstream))
            .await
            .map_err(|_| CallError::Timeout(timeout))??;
        let _ = s.set_nodelay(true);
        Ok(Conn {
            s,
            seq: 0,
            buf: BytesMut::with_capacity(64 << 10),
            release,
        })
    }

    /// Asks the master its release (one round trip). An answer that names none leaves
    /// 0.3.13's layouts, the pinned release's (logged).
    async fn learn_release(&mut self) -> Result<MasterRelease, CallError> {
        let seq = self.seq;
        self.seq = self.seq.wrapping_add(1);
        self.s.write_all(&crate::codec::release::probe(seq)).await?;
        let h = loop {
            if let Some(h) = crate::codec::frame::check_response(&self.buf, OWN_MAX_FRAME)? {
                break h;
            }
            if self.s.read_buf(&mut self.buf).await? == 0 {
                return Err(CallError::Closed(1));
            }
        };
        let (frame, _) = crate::codec::ResponseFrame::split(&mut self.buf, h);
        if h.seq_num != seq {
            return Err(CallError::OutOfOrder {
                want: seq,
                got: h.seq_num,
            });
        }
        let release = match crate::codec::release::classify(&frame) {
            Some(r) => {
                tracing::debug!(release = r.label(), "master release (own connection)");
                r
            }
            None if h.err_code != errc::OK => return Err(CallError::ProbeRefused(h.err_code)),
            None => {
                tracing::warn!(
                    "the master's answer to the release probe names no known release; \
                     moongate's own calls use 0.3.13's layouts"
                );
                MasterRelease::V0_3_13
            }
        };
        self.release = Some(release);
        Ok(release)
    }

    /// Sends `reqs` pipelined and returns their answers in order.
    pub async fn call_all(
        &mut self,
        reqs: &[crate::codec::message::Request],
        timeout: Duration,
    ) -> Result<Vec<Answer>, CallError> {
        tokio::time::timeout(timeout, self.call_all_inner(reqs))
            .await
            .map_err(|_| CallError::Timeout(timeout))?
    }

    async fn call_all_inner(
        &mut self,
        reqs: &[crate::codec::message::Request],
    ) -> Result<Vec<Answer>, CallError> {
        let release = match self.release {
            Some(r) => r,
            None if reqs
                .iter()
                .any(|r| crate::codec::layout::depends_on_release(r.method())) =>
            {
                self.learn_release().await?
            }
            None => MasterRelease::V0_3_13,
        };
        let mut out = BytesMut::new();
        let first = self.seq;
        for r in reqs {
            let mut body = BytesMut::new();
            r.encode_for(release, &mut body);
            RequestHeader::new(self.seq, r.method().function_id(), body.len() as u32)
                .write(&mut out);
            out.extend_from_slice(&body);
            self.seq = self.seq.wrapping_add(1);
        }
        self.s.write_all(&out).await?;
        let mut answers = Vec::with_capacity(reqs.len());
        while answers.len() < reqs.len() {
            let h = match crate::codec::frame::check_response(&self.buf, OWN_MAX_FRAME)? {
                Some(h) => h,
                None => {
                    if self.s.read_buf(&mut self.buf).await? == 0 {
                        return Err(CallError::Closed(reqs.len() - answers.len()));
                    }
                    continue;
                }
            };
            let (frame, _) = crate::codec::ResponseFrame::split(&mut self.buf, h);
            let i = answers.len();
            let want = first.wrapping_add(i as u32);
            // An answer out of order would be attributed to the wrong call; the caller
            // drops a connection that returned an error, so nothing later reads it.
            if h.seq_num != want {
                return Err(CallError::OutOfOrder {
                    want,
                    got: h.seq_num,
                });
            }
            let method = reqs[i].method();
            if h.err_code != errc::OK {
                answers.push(Err(h.err_code));
                continue;
            }
            match Response::decode(method, &frame.body) {
                Some(Ok((r, _))) => answers.push(Ok(r)),
                _ => return Err(CallError::Undecodable(method)),
            }
        }
        Ok(answers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::frame::REQUEST_HEADER_LEN;
    use crate::codec::message::{NoArgs, Request};

    /// A master that answers each request with `seq + shift` and transport error 1 (so
    /// no body is decoded), and the release probe (a GetReplicaList of the probe key)
    /// with transport error `probe_err` (0.3.11 answers 4, invalid arguments); it
    /// reports each request's method id and body.
    async fn fake_master(
        shift: u32,
        probe_err: u8,
    ) -> (String, tokio::sync::mpsc::UnboundedReceiver<(u32, Vec<u8>)>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            loop {
                let mut h = [0u8; REQUEST_HEADER_LEN];
                if s.read_exact(&mut h).await.is_err() {
                    return;
                }
                let seq = u32::from_le_bytes(h[4..8].try_into().unwrap());
                let id = u32::from_le_bytes(h[8..12].try_into().unwrap());
                let len = u32::from_le_bytes(h[12..16].try_into().unwrap());
                let mut body = vec![0u8; len as usize];
                s.read_exact(&mut body).await.unwrap();
                let probe = body
                    .windows(crate::codec::release::PROBE_KEY.len())
                    .any(|w| w == crate::codec::release::PROBE_KEY);
                let _ = tx.send((id, body));
                let mut out = BytesMut::new();
                let err = if probe { probe_err } else { 1 };
                ResponseHeader::new(seq.wrapping_add(shift), err, 0).write(&mut out);
                s.write_all(&out).await.unwrap();
            }
        });
        (addr, rx)
    }

    async fn scripted(shift: u32) -> String {
        fake_master(shift, 1).await.0
    }

    #[tokio::test]
    async fn an_answer_with_another_seq_is_an_error_not_a_misattribution() {
        let t = Duration::from_secs(5);
        let mut c = Conn::connect(&scripted(0).await, t, None).await.unwrap();
        let reqs = [Request::ServiceReady(NoArgs), Request::ServiceReady(NoArgs)];
        let a = c.call_all(&reqs, t).await.unwrap();
        assert_eq!(a.len(), 2);
        assert!(a.iter().all(|r| matches!(r, Err(1))));

        let mut c = Conn::connect(&scripted(5).await, t, None).await.unwrap();
        assert!(matches!(
            c.call_all(&reqs, t).await,
            Err(CallError::OutOfOrder { want: 0, got: 5 })
        ));
    }

    /// The older layout the next call the fake master saw was in; it must be a PutStart.
    async fn put_layout(
        seen: &mut tokio::sync::mpsc::UnboundedReceiver<(u32, Vec<u8>)>,
    ) -> Option<crate::codec::Schema> {
        let (id, body) = seen.recv().await.unwrap();
        assert_eq!(id, Method::PutStart.function_id());
        let code = crate::codec::older::code_of(&body).unwrap();
        crate::codec::older::request_schema(Method::PutStart, code)
    }

    /// Against a 0.3.11 master (it refuses the probe's layout), a put goes in 0.3.11's
    /// layout; calls with one layout in every release are sent without asking.
    #[tokio::test]
    async fn calls_go_in_the_layout_of_the_master_s_release() {
        use crate::codec::Schema;
        use crate::codec::message::PutStartArgs;
        use crate::codec::types::ReplicateConfig;
        let t = Duration::from_secs(5);
        let (addr, mut seen) = fake_master(0, errc::INVALID_RPC_ARGUMENTS).await;
        let mut c = Conn::connect(&addr, t, None).await.unwrap();
        c.call_all(&[Request::ServiceReady(NoArgs)], t)
            .await
            .unwrap();
        assert_eq!(
            seen.recv().await.unwrap().0,
            Method::ServiceReady.function_id()
        );
        let put = Request::PutStart(PutStartArgs {
            client_id: Default::default(),
            key: bytes::Bytes::from_static(b"k"),
            slice_length: 5,
            config: ReplicateConfig::default(),
            tenant_id: bytes::Bytes::from_static(b"default"),
        });
        let a = c.call_all(std::slice::from_ref(&put), t).await.unwrap();
        assert!(matches!(a[..], [Err(1)]));
        let (probe, _) = seen.recv().await.unwrap();
        assert_eq!(probe, Method::GetReplicaList.function_id());
        assert_eq!(put_layout(&mut seen).await, Some(Schema::V0_3_11));
        // Asked once per connection.
        c.call_all(std::slice::from_ref(&put), t).await.unwrap();
        assert_eq!(seen.recv().await.unwrap().0, Method::PutStart.function_id());

        // Configured: not asked.
        let (addr, mut seen) = fake_master(0, errc::INVALID_RPC_ARGUMENTS).await;
        let mut c = Conn::connect(&addr, t, Some(MasterRelease::V0_3_12))
            .await
            .unwrap();
        c.call_all(std::slice::from_ref(&put), t).await.unwrap();
        assert_eq!(put_layout(&mut seen).await, Some(Schema::V0_3_12));
    }
}

//! moongate's own calls to the master, on connections of its own (never a client's: seq
//! numbers are per connection): the readiness probe, typed calls for eviction (probes
//! and removals), and the master's memory usage from its Prometheus endpoint.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use thiserror::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::codec::frame::{RESPONSE_HEADER_LEN, ResponseHeader, errc};
use crate::codec::message::Response;
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
}

/// Largest answer accepted on moongate's own connections (a 5,000-key batch answer is
/// ~1 MiB).
const OWN_MAX_FRAME: u64 = 64 << 20;

impl Conn {
    pub async fn connect(upstream: &str, timeout: Duration) -> Result<Conn, CallError> {
        let s = tokio::time::timeout(timeout, TcpStream::connect(upstream))
            .await
            .map_err(|_| CallError::Timeout(timeout))??;
        let _ = s.set_nodelay(true);
        Ok(Conn {
            s,
            seq: 0,
            buf: BytesMut::with_capacity(64 << 10),
        })
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
        let mut out = BytesMut::new();
        let first = self.seq;
        for r in reqs {
            let mut body = BytesMut::new();
            r.encode_body(crate::codec::BodyStyle::MOONCAKE, &mut body);
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
            debug_assert_eq!(h.seq_num, first.wrapping_add(i as u32));
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

/// `http://HOST:PORT/PATH`, the only form the master's metrics endpoint takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricsUrl {
    pub authority: String,
    pub path: String,
}

impl MetricsUrl {
    pub fn parse(url: &str) -> Option<MetricsUrl> {
        let rest = url.strip_prefix("http://")?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/metrics"),
        };
        let (host, port) = authority.rsplit_once(':')?;
        if host.is_empty() || port.parse::<u16>().is_err() {
            return None;
        }
        Some(MetricsUrl {
            authority: authority.to_string(),
            path: path.to_string(),
        })
    }
}

/// The master's memory usage, from its Prometheus endpoint.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Usage {
    pub allocated_bytes: u64,
    pub capacity_bytes: u64,
}

/// Errors of moongate's own HTTP reads (the master's metrics page, the metadata server).
#[derive(Debug, Error)]
pub enum UsageError {
    #[error("cannot connect: {0}")]
    Io(#[from] std::io::Error),
    #[error("http: {0}")]
    Http(#[from] hyper::Error),
    #[error("answered HTTP {0}")]
    Status(u16),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("no {0} sample in the master's metrics")]
    Missing(&'static str),
}

/// Reads `master_allocated_bytes` and `master_total_capacity_bytes`.
pub async fn master_usage(url: &MetricsUrl, timeout: Duration) -> Result<Usage, UsageError> {
    tokio::time::timeout(timeout, master_usage_inner(url))
        .await
        .map_err(|_| UsageError::Timeout(timeout))?
}

async fn master_usage_inner(url: &MetricsUrl) -> Result<Usage, UsageError> {
    let (status, body) = http_get_inner(&url.authority, &url.path).await?;
    if !(200..300).contains(&status) {
        return Err(UsageError::Status(status));
    }
    parse_usage(&String::from_utf8_lossy(&body))
}

/// One HTTP/1.1 GET on a fresh connection: status and body (at most 64 MiB).
pub async fn http_get(
    authority: &str,
    path: &str,
    timeout: Duration,
) -> Result<(u16, Bytes), UsageError> {
    http_request(hyper::Method::GET, authority, path, Bytes::new(), timeout).await
}

/// One HTTP/1.1 request on a fresh connection (a JSON body when non-empty): status and
/// body (at most 64 MiB).
pub async fn http_request(
    method: hyper::Method,
    authority: &str,
    path: &str,
    body: Bytes,
    timeout: Duration,
) -> Result<(u16, Bytes), UsageError> {
    tokio::time::timeout(timeout, http_inner(method, authority, path, body))
        .await
        .map_err(|_| UsageError::Timeout(timeout))?
}

async fn http_get_inner(authority: &str, path: &str) -> Result<(u16, Bytes), UsageError> {
    http_inner(hyper::Method::GET, authority, path, Bytes::new()).await
}

async fn http_inner(
    method: hyper::Method,
    authority: &str,
    path: &str,
    body: Bytes,
) -> Result<(u16, Bytes), UsageError> {
    use http_body_util::{BodyExt, Full, Limited};
    let s = TcpStream::connect(authority).await?;
    let (mut send, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(s)).await?;
    let driver = tokio::spawn(conn);
    let mut b = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header(hyper::header::HOST, authority);
    if !body.is_empty() {
        b = b.header(hyper::header::CONTENT_TYPE, "application/json");
    }
    let req = b.body(Full::new(body)).map_err(|_| UsageError::Status(0))?;
    let resp = send.send_request(req).await?;
    let status = resp.status().as_u16();
    // A bound keeps a wrong URL from filling memory.
    let body = Limited::new(resp.into_body(), 64 << 20)
        .collect()
        .await
        .map_err(|_| UsageError::Status(413))?
        .to_bytes();
    driver.abort();
    Ok((status, body))
}

/// Finds the two samples in a Prometheus text page.
pub fn parse_usage(text: &str) -> Result<Usage, UsageError> {
    let sample = |name: &'static str| {
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .find_map(|l| {
                let (n, v) = l.split_once(' ')?;
                (n == name).then(|| v.trim().parse::<f64>().ok()).flatten()
            })
            .map(|v| v as u64)
            .ok_or(UsageError::Missing(name))
    };
    Ok(Usage {
        allocated_bytes: sample("master_allocated_bytes")?,
        capacity_bytes: sample("master_total_capacity_bytes")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_urls() {
        assert_eq!(
            MetricsUrl::parse("http://127.0.0.1:9003/metrics"),
            Some(MetricsUrl {
                authority: "127.0.0.1:9003".into(),
                path: "/metrics".into()
            })
        );
        assert_eq!(
            MetricsUrl::parse("http://h:1").unwrap().path,
            "/metrics".to_string()
        );
        for bad in ["https://h:1/m", "http://h/m", "http://:1/m", "h:1"] {
            assert!(MetricsUrl::parse(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn usage_from_the_masters_page() {
        let page = "# HELP x\nmaster_allocated_bytes 1048576\nmaster_total_capacity_bytes 4.194304e+06\nmaster_key_count 3\n";
        assert_eq!(
            parse_usage(page).unwrap(),
            Usage {
                allocated_bytes: 1 << 20,
                capacity_bytes: 4 << 20
            }
        );
        assert!(matches!(
            parse_usage("master_allocated_bytes 1\n"),
            Err(UsageError::Missing("master_total_capacity_bytes"))
        ));
    }
}

//! moongate's own calls to the master, on connections of its own (never a client's: seq
//! numbers are per connection). Today: the readiness probe.

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

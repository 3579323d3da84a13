//! moongate's own plain HTTP/1.1 calls (the master's metrics page, the transfer
//! engine's metadata server): one request per fresh connection, bounded in time and
//! size.

use std::time::Duration;

use bytes::Bytes;
use thiserror::Error;
use tokio::net::TcpStream;

/// `http://HOST:PORT/PATH`, the only form the master's metrics endpoint and the
/// metadata server take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpUrl {
    pub authority: String,
    pub path: String,
}

impl HttpUrl {
    pub fn parse(url: &str) -> Option<HttpUrl> {
        let rest = url.strip_prefix("http://")?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/metrics"),
        };
        let (host, port) = authority.rsplit_once(':')?;
        if host.is_empty() || port.parse::<u16>().is_err() {
            return None;
        }
        Some(HttpUrl {
            authority: authority.to_string(),
            path: path.to_string(),
        })
    }
}

/// Errors of moongate's own HTTP reads (the master's metrics page, the metadata server).
#[derive(Debug, Error)]
pub enum HttpError {
    #[error("cannot connect: {0}")]
    Io(#[from] std::io::Error),
    #[error("http: {0}")]
    Http(#[from] hyper::Error),
    #[error("answered HTTP {0}")]
    Status(u16),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

/// One HTTP/1.1 GET on a fresh connection: status and body (at most 64 MiB).
pub async fn http_get(
    authority: &str,
    path: &str,
    timeout: Duration,
) -> Result<(u16, Bytes), HttpError> {
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
) -> Result<(u16, Bytes), HttpError> {
    tokio::time::timeout(timeout, http_inner(method, authority, path, body))
        .await
        .map_err(|_| HttpError::Timeout(timeout))?
}

async fn http_inner(
    method: hyper::Method,
    authority: &str,
    path: &str,
    body: Bytes,
) -> Result<(u16, Bytes), HttpError> {
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
    let req = b.body(Full::new(body)).map_err(|_| HttpError::Status(0))?;
    let resp = send.send_request(req).await?;
    let status = resp.status().as_u16();
    // A bound keeps a wrong URL from filling memory.
    let body = Limited::new(resp.into_body(), 64 << 20)
        .collect()
        .await
        .map_err(|_| HttpError::Status(413))?
        .to_bytes();
    driver.abort();
    Ok((status, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_urls() {
        assert_eq!(
            HttpUrl::parse("http://127.0.0.1:9003/metrics"),
            Some(HttpUrl {
                authority: "127.0.0.1:9003".into(),
                path: "/metrics".into()
            })
        );
        assert_eq!(
            HttpUrl::parse("http://h:1").unwrap().path,
            "/metrics".to_string()
        );
        for bad in ["https://h:1/m", "http://h/m", "http://:1/m", "h:1"] {
            assert!(HttpUrl::parse(bad).is_none(), "{bad}");
        }
    }
}

//! The kv API for remote callers, over QUIC (`kv.api_quic_listen`).
//!
//! Each bidirectional stream is one HTTP/1.1 (or HTTP/2 prior-knowledge) connection
//! served by the same service as the loopback listener ([`super::http`]), so every
//! endpoint, status and limit is the same; streams of one QUIC connection run in
//! parallel without head-of-line blocking, and a bad request closes only its stream.
//! ALPN `moongate-kv/1`, TLS 1.3 with the certificate of `kv.quic_cert` / `kv.quic_key`
//! (or a self-signed one, whose SHA-256 is logged at start for callers to pin). With
//! `kv.api_quic_client_ca`, callers must present a certificate issued by that CA.
//!
//! [`ApiClient`] is the Rust caller side (pinned fingerprint, optional client
//! certificate).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use tokio_util::sync::CancellationToken;

use super::state::KvState;
use crate::accept::ConnLimit;
use crate::kv::transport::quic::{Identity, QuicError, client_verifier, transport_to};

/// ALPN of the kv API over QUIC.
pub const ALPN: &[u8] = b"moongate-kv/1";

/// Binds the API endpoint; `client_ca` (PEM path, may be empty) turns on client
/// certificate checks.
pub fn server(
    listen: SocketAddr,
    id: &Identity,
    client_ca: &str,
) -> Result<crate::kv::transport::quic::QuicListener, QuicError> {
    let clients = client_verifier(client_ca, "kv.api_quic_client_ca")?;
    crate::kv::transport::quic::endpoint(listen, id, ALPN, clients)
}

/// Serves the kv API on `endpoint` until shutdown: a task per connection, one HTTP
/// connection per stream.
pub async fn serve(
    endpoint: crate::kv::transport::quic::QuicListener,
    state: Arc<KvState>,
    limit: ConnLimit,
    shutdown: CancellationToken,
) {
    crate::kv::transport::quic::serve_streams(
        endpoint,
        limit,
        shutdown,
        "kv API",
        move |stream, _| super::http::serve_conn(stream, state.clone()),
    )
    .await
}

/// How a caller proves who it is to a server with `kv.api_quic_client_ca`.
pub use crate::kv::transport::quic::ClientCert;

/// A remote caller of the kv API over QUIC: one connection, a stream per request.
pub struct ApiClient {
    conn: quinn::Connection,
    // Kept so the connection's socket lives as long as the client.
    _endpoint: quinn::Endpoint,
    timeout: Duration,
}

impl ApiClient {
    /// Connects to `addr`, trusting only the certificate whose SHA-256 is `sha256`.
    pub async fn connect(
        addr: SocketAddr,
        sha256: [u8; 32],
        cert: Option<ClientCert>,
        timeout: Duration,
    ) -> Result<ApiClient, QuicError> {
        let err = |e: String| QuicError::Peer {
            peer: addr,
            error: e,
        };
        let client = cert.map(|c| (c.certs, c.key));
        let cfg = moongate_kv::quic::pinned_client(sha256, client, ALPN, transport_to(addr.ip()))
            .map_err(err)?;
        let bind: SocketAddr = if addr.is_ipv6() {
            "[::]:0".parse()
        } else {
            "0.0.0.0:0".parse()
        }
        .map_err(|_| QuicError::Setup("bind".into()))?;
        let endpoint = crate::kv::transport::quic::bind(bind, None)?;
        let connecting = endpoint
            .connect_with(cfg, addr, "moongate")
            .map_err(|e| err(e.to_string()))?;
        let conn = tokio::time::timeout(timeout, connecting)
            .await
            .map_err(|_| QuicError::Timeout {
                peer: addr,
                timeout,
            })?
            .map_err(|e| err(e.to_string()))?;
        Ok(ApiClient {
            conn,
            _endpoint: endpoint,
            timeout,
        })
    }

    /// The QUIC connection (for callers that speak HTTP on streams themselves).
    pub fn connection(&self) -> &quinn::Connection {
        &self.conn
    }

    /// One request on a fresh stream: `(status, body)`.
    pub async fn request(
        &self,
        method: &str,
        path: &str,
        body: Bytes,
    ) -> Result<(u16, Bytes), QuicError> {
        let peer = self.conn.remote_address();
        let err = |e: String| QuicError::Peer { peer, error: e };
        let exchange = async {
            let (send, recv) = self.conn.open_bi().await.map_err(|e| err(e.to_string()))?;
            let io = hyper_util::rt::TokioIo::new(tokio::io::join(recv, send));
            let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
                .await
                .map_err(|e| err(e.to_string()))?;
            tokio::spawn(conn);
            let req = hyper::Request::builder()
                .method(method)
                .uri(path)
                .header(hyper::header::HOST, "moongate")
                .body(Full::new(body))
                .map_err(|e| err(e.to_string()))?;
            let resp = sender
                .send_request(req)
                .await
                .map_err(|e| err(e.to_string()))?;
            let status = resp.status().as_u16();
            let bytes = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| err(e.to_string()))?
                .to_bytes();
            Ok((status, bytes))
        };
        tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| QuicError::Timeout {
                peer,
                timeout: self.timeout,
            })?
    }
}

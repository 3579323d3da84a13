//! QUIC between moongates: a moongate that owns a segment serves it over QUIC as well as
//! TE-TCP, and another moongate's kv face reads and writes it over QUIC instead of TCP.
//!
//! Discovery and trust: the owner publishes `moongate/quic/<segment name>` in the
//! metadata server with its QUIC address and the SHA-256 of its certificate; initiators
//! pin that fingerprint (the metadata server is already what every Mooncake peer trusts
//! for addresses). The certificate comes from `kv.quic_cert` / `kv.quic_key`, or is a
//! self-signed one made at start-up.
//!
//! Wire: one bidirectional stream per transfer, carrying the TE-TCP exchange unchanged
//! (24-byte header, v2 status frames), so the owner side is the same code
//! ([`crate::kv::own::segment::serve_conn`]). A large range is cut over several streams of one
//! connection at once.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use quinn::crypto::rustls::QuicServerConfig;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use sha2::{Digest, Sha256};
use thiserror::Error;
use tokio::io::ReadBuf;
use tokio_util::sync::CancellationToken;

use super::te_tcp::{header, status};
use crate::accept::ConnLimit;
use crate::kv::own::segment::Memory;

/// ALPN of the segment protocol over QUIC.
const ALPN: &[u8] = b"moongate-segment/1";

#[derive(Debug, Error)]
pub enum QuicError {
    #[error("quic: {0}")]
    Setup(String),
    #[error("quic peer {peer}: {error}")]
    Peer { peer: SocketAddr, error: String },
    #[error("quic peer {peer} rejected [{addr:#x}, +{len}) (status {status})")]
    Rejected {
        peer: SocketAddr,
        addr: u64,
        len: u64,
        status: u32,
    },
    #[error("quic peer {peer} did not answer within {timeout:?}")]
    Timeout { peer: SocketAddr, timeout: Duration },
}

/// A certificate chain and its key, and the fingerprint peers pin.
pub struct Identity {
    pub certs: Vec<CertificateDer<'static>>,
    pub key: PrivateKeyDer<'static>,
    pub sha256: [u8; 32],
}

impl Identity {
    /// Loads PEM files, or makes a self-signed certificate when both paths are empty.
    pub fn load_or_generate(cert: &str, key: &str) -> Result<Identity, QuicError> {
        use rustls::pki_types::pem::PemObject;
        let (certs, key) = if cert.is_empty() && key.is_empty() {
            let ck = rcgen::generate_simple_self_signed(vec!["moongate".to_string()])
                .map_err(|e| QuicError::Setup(format!("self-signed certificate: {e}")))?;
            (
                vec![ck.cert.der().clone()],
                PrivateKeyDer::Pkcs8(ck.key_pair.serialize_der().into()),
            )
        } else {
            let certs = CertificateDer::pem_file_iter(cert)
                .and_then(|i| i.collect::<Result<Vec<_>, _>>())
                .map_err(|e| QuicError::Setup(format!("kv.quic_cert {cert}: {e}")))?;
            let key = PrivateKeyDer::from_pem_file(key)
                .map_err(|e| QuicError::Setup(format!("kv.quic_key {key}: {e}")))?;
            (certs, key)
        };
        let first = certs
            .first()
            .ok_or_else(|| QuicError::Setup("no certificate in kv.quic_cert".into()))?;
        let sha256 = Sha256::digest(first.as_ref()).into();
        Ok(Identity { certs, key, sha256 })
    }
}

pub(in crate::kv) fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The transport shared with the client library (`moongate_kv::quic::tuned_transport`:
/// large datagrams, windows for multi-MiB values), with this side's stream limit and
/// keep-alives.
pub(in crate::kv) fn transport() -> Arc<quinn::TransportConfig> {
    Arc::new(tuned())
}

fn tuned() -> quinn::TransportConfig {
    let mut t = moongate_kv::quic::tuned_transport();
    t.max_concurrent_bidi_streams(quinn::VarInt::from_u32(256))
        .keep_alive_interval(Some(Duration::from_secs(5)));
    t
}

/// [`transport`] fitted to a peer at `ip` (`moongate_kv::quic::fit_to_peer`: no
/// segmentation offload towards loopback).
pub(in crate::kv) fn transport_to(ip: std::net::IpAddr) -> Arc<quinn::TransportConfig> {
    let mut t = tuned();
    moongate_kv::quic::fit_to_peer(&mut t, ip);
    Arc::new(t)
}

/// A QUIC server endpoint, and the configuration it admits loopback peers with
/// ([`transport_to`]; quinn fixes a connection's transport when it is accepted).
pub struct QuicListener {
    pub endpoint: quinn::Endpoint,
    loopback: Arc<quinn::ServerConfig>,
}

impl QuicListener {
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.endpoint.local_addr()
    }
}

/// Bytes one QUIC connection may have in flight towards this side.
pub use moongate_kv::quic::RECEIVE_WINDOW;

/// Serves moongate's segment over QUIC until shutdown; `client_ca` (PEM path, may be
/// empty) admits only peers with a certificate that CA issued.
pub fn server(
    listen: SocketAddr,
    id: &Identity,
    client_ca: &str,
) -> Result<QuicListener, QuicError> {
    endpoint(
        listen,
        id,
        ALPN,
        client_verifier(client_ca, "kv.quic_client_ca")?,
    )
}

/// A verifier admitting only client certificates issued by the CA bundle at `ca` (a
/// PEM path named by config key `key`); `None` when `ca` is empty.
pub(in crate::kv) fn client_verifier(
    ca: &str,
    key: &str,
) -> Result<Option<Arc<dyn rustls::server::danger::ClientCertVerifier>>, QuicError> {
    if ca.is_empty() {
        return Ok(None);
    }
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    let certs = rustls::pki_types::CertificateDer::pem_file_iter(ca)
        .and_then(|i| i.collect::<Result<Vec<_>, _>>())
        .map_err(|e| QuicError::Setup(format!("{key} {ca}: {e}")))?;
    let (added, _) = roots.add_parsable_certificates(certs);
    if added == 0 {
        return Err(QuicError::Setup(format!(
            "{key} {ca}: no usable CA certificate"
        )));
    }
    let v =
        rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
            .build()
            .map_err(|e| QuicError::Setup(format!("{key}: {e}")))?;
    Ok(Some(v))
}

/// How a QUIC caller proves who it is to a server that checks client certificates.
pub struct ClientCert {
    pub certs: Vec<rustls::pki_types::CertificateDer<'static>>,
    pub key: rustls::pki_types::PrivateKeyDer<'static>,
}

impl ClientCert {
    /// The identity of `id` as a client certificate.
    pub fn of(id: &Identity) -> ClientCert {
        ClientCert {
            certs: id.certs.clone(),
            key: id.key.clone_key(),
        }
    }
}

/// A QUIC server endpoint: TLS 1.3 with `id`, one ALPN, and client certificates
/// checked by `clients` when given.
pub(in crate::kv) fn endpoint(
    listen: SocketAddr,
    id: &Identity,
    alpn: &[u8],
    clients: Option<Arc<dyn rustls::server::danger::ClientCertVerifier>>,
) -> Result<QuicListener, QuicError> {
    let b = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| QuicError::Setup(e.to_string()))?;
    let b = match clients {
        Some(v) => b.with_client_cert_verifier(v),
        None => b.with_no_client_auth(),
    };
    let mut tls = b
        .with_single_cert(id.certs.clone(), id.key.clone_key())
        .map_err(|e| QuicError::Setup(format!("certificate: {e}")))?;
    tls.alpn_protocols = vec![alpn.to_vec()];
    let crypto =
        Arc::new(QuicServerConfig::try_from(tls).map_err(|e| QuicError::Setup(e.to_string()))?);
    let mut cfg = quinn::ServerConfig::with_crypto(crypto.clone());
    cfg.transport_config(transport());
    let mut loopback = quinn::ServerConfig::with_crypto(crypto);
    loopback.transport_config(transport_to(std::net::Ipv4Addr::LOCALHOST.into()));
    Ok(QuicListener {
        endpoint: bind(listen, Some(cfg))?,
        loopback: Arc::new(loopback),
    })
}

/// A QUIC endpoint on `addr` (a server when `server` is given): the client library's
/// (`moongate_kv::quic::udp_endpoint`: large socket buffers and datagrams).
pub(in crate::kv) fn bind(
    addr: SocketAddr,
    server: Option<quinn::ServerConfig>,
) -> Result<quinn::Endpoint, QuicError> {
    moongate_kv::quic::udp_endpoint(addr, server)
        .map_err(|e| QuicError::Setup(format!("endpoint on {addr}: {e}")))
}

/// Serves the own segment's TE exchange on every stream until shutdown, at most `limit`
/// connections at once.
pub async fn serve(
    endpoint: QuicListener,
    mem: Arc<Memory>,
    limit: ConnLimit,
    shutdown: CancellationToken,
) {
    serve_streams(endpoint, limit, shutdown, "segment", move |stream, peer| {
        let mem = mem.clone();
        async move {
            if let Err(e) = crate::kv::own::segment::serve_conn(stream, &mem).await {
                tracing::debug!(%peer, error = %e, "quic segment stream closed");
            }
        }
    })
    .await
}

/// A bidirectional QUIC stream as one byte stream.
pub(in crate::kv) type BiStream = tokio::io::Join<quinn::RecvStream, quinn::SendStream>;

/// Accepts connections on `endpoint` until shutdown, and runs `on_stream` as its own
/// task for every bidirectional stream (so a bad stream ends only itself). At most
/// `limit` connections at once: more are refused before their handshake. `what`
/// names the listener in logs.
pub(in crate::kv) async fn serve_streams<F, Fut>(
    listener: QuicListener,
    limit: ConnLimit,
    shutdown: CancellationToken,
    what: &'static str,
    on_stream: F,
) where
    F: Fn(BiStream, SocketAddr) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let QuicListener { endpoint, loopback } = listener;
    loop {
        let incoming = tokio::select! {
            _ = shutdown.cancelled() => {
                endpoint.close(0u32.into(), b"shutdown");
                return;
            }
            i = endpoint.accept() => match i {
                Some(i) => i,
                None => return,
            },
        };
        let Some(slot) = limit.admit() else {
            incoming.refuse();
            continue;
        };
        let on_stream = on_stream.clone();
        let accepting = if moongate_kv::quic::on_loopback(incoming.remote_address().ip()) {
            incoming.accept_with(loopback.clone())
        } else {
            incoming.accept()
        };
        tokio::spawn(async move {
            let _slot = slot;
            let Ok(accepting) = accepting else {
                return;
            };
            let conn = match accepting.await {
                Ok(c) => c,
                Err(e) => {
                    tracing::info!(listener = what, error = %e, "quic handshake failed");
                    return;
                }
            };
            let peer = conn.remote_address();
            while let Ok((send, recv)) = conn.accept_bi().await {
                tokio::spawn(on_stream(tokio::io::join(recv, send), peer));
            }
        });
    }
}

/// Where a peer moongate serves its segment over QUIC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuicPeer {
    pub addr: SocketAddr,
    pub sha256: [u8; 32],
}

/// Parses a `moongate/quic/<name>` entry: `{"addr": "host:port", "sha256": "hex"}`.
pub fn parse_peer(body: &[u8]) -> Option<QuicPeer> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let addr = v.get("addr")?.as_str()?.parse().ok()?;
    let sha256 = moongate_kv::quic::parse_sha256(v.get("sha256")?.as_str()?)?;
    Some(QuicPeer { addr, sha256 })
}

/// The metadata entry a QUIC-serving moongate publishes.
pub fn peer_entry(addr: SocketAddr, sha256: &[u8; 32]) -> String {
    let hex: String = sha256.iter().map(|b| format!("{b:02x}")).collect();
    serde_json::json!({ "addr": addr.to_string(), "sha256": hex }).to_string()
}

/// The initiator side: one connection per peer, a stream per transfer.
pub struct QuicPool {
    endpoint: quinn::Endpoint,
    conns: Mutex<HashMap<SocketAddr, quinn::Connection>>,
    timeout: Duration,
    streams: usize,
    /// Shown to peers that check client certificates (`kv.quic_client_ca`).
    client: Option<ClientCert>,
}

impl QuicPool {
    pub fn new(timeout: Duration, streams: usize) -> Result<QuicPool, QuicError> {
        // Any address: peers are other hosts' moongates (IPv4, as Mooncake's segment
        // names are).
        let any: SocketAddr = "0.0.0.0:0"
            .parse()
            .map_err(|_| QuicError::Setup("bind".into()))?;
        let endpoint = bind(any, None)?;
        Ok(QuicPool {
            endpoint,
            conns: Mutex::new(HashMap::new()),
            timeout,
            streams: streams.max(1),
            client: None,
        })
    }

    /// Presents `cert` to the peers it connects to (their `kv.quic_client_ca` checks it).
    pub fn with_client_cert(mut self, cert: Option<ClientCert>) -> QuicPool {
        self.client = cert;
        self
    }

    async fn conn(&self, peer: &QuicPeer) -> Result<quinn::Connection, QuicError> {
        if let Some(c) = self
            .conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&peer.addr)
            .filter(|c| c.close_reason().is_none())
        {
            return Ok(c.clone());
        }
        let err = |e: String| QuicError::Peer {
            peer: peer.addr,
            error: e,
        };
        let client = self
            .client
            .as_ref()
            .map(|c| (c.certs.clone(), c.key.clone_key()));
        let cfg = moongate_kv::quic::pinned_client(
            peer.sha256,
            client,
            ALPN,
            transport_to(peer.addr.ip()),
        )
        .map_err(err)?;
        let connecting = self
            .endpoint
            .connect_with(cfg, peer.addr, "moongate")
            .map_err(|e| err(e.to_string()))?;
        let c = tokio::time::timeout(self.timeout, connecting)
            .await
            .map_err(|_| QuicError::Timeout {
                peer: peer.addr,
                timeout: self.timeout,
            })?
            .map_err(|e| err(e.to_string()))?;
        tracing::info!(peer = %peer.addr, "quic connection to a peer moongate");
        self.conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(peer.addr, c.clone());
        Ok(c)
    }

    fn ranges(&self, len: u64) -> Vec<(u64, u64)> {
        super::te_tcp::split_ranges(len, 4 << 20, self.streams)
    }

    pub async fn read(&self, peer: &QuicPeer, addr: u64, len: u64) -> Result<Bytes, QuicError> {
        let len = len as usize;
        let mut out = BytesMut::with_capacity(len);
        let spare = &mut out.spare_capacity_mut()[..len];
        self.read_ranges(peer, addr, spare, ReadBuf::uninit).await?;
        // SAFETY: the ranges cover [0, len) and read_ranges returns Ok only once every
        // range's ReadBuf was filled, so every byte up to len is initialized.
        unsafe { out.set_len(len) };
        Ok(out.freeze())
    }

    /// Reads `out.len()` bytes at `addr` straight into `out` (a caller's memory: the
    /// shared-memory path reads into an engine's registration this way).
    pub async fn read_to(
        &self,
        peer: &QuicPeer,
        addr: u64,
        out: &mut [u8],
    ) -> Result<(), QuicError> {
        self.read_ranges(peer, addr, out, ReadBuf::new).await
    }

    /// Cuts `buf` as [`QuicPool::ranges`] cuts its length and reads every range at once,
    /// each on its own stream into its part (`wrap` makes the part a `ReadBuf`:
    /// initialized memory or not); `Ok` once every part is full.
    async fn read_ranges<'a, T>(
        &self,
        peer: &QuicPeer,
        addr: u64,
        buf: &'a mut [T],
        wrap: fn(&'a mut [T]) -> ReadBuf<'a>,
    ) -> Result<(), QuicError> {
        let conn = self.conn(peer).await?;
        let parts = self.ranges(buf.len() as u64);
        let mut rest = buf;
        let mut jobs = Vec::with_capacity(parts.len());
        for (off, n) in parts {
            let (chunk, tail) = rest.split_at_mut(n as usize);
            rest = tail;
            jobs.push(self.one(&conn, peer.addr, addr + off, Op::Read(wrap(chunk))));
        }
        futures_util::future::try_join_all(jobs).await?;
        Ok(())
    }

    pub async fn write(&self, peer: &QuicPeer, addr: u64, data: &[u8]) -> Result<(), QuicError> {
        let conn = self.conn(peer).await?;
        let jobs: Vec<_> = self
            .ranges(data.len() as u64)
            .into_iter()
            .map(|(off, n)| {
                self.one(
                    &conn,
                    peer.addr,
                    addr + off,
                    Op::Write(&data[off as usize..(off + n) as usize]),
                )
            })
            .collect();
        futures_util::future::try_join_all(jobs).await?;
        Ok(())
    }

    /// Starts a READ of `len` bytes at `addr` on a new stream and returns its receive
    /// half once the owner accepted it, so the caller streams the bytes as they arrive.
    pub async fn open_read(
        &self,
        peer: &QuicPeer,
        addr: u64,
        len: u64,
    ) -> Result<quinn::RecvStream, QuicError> {
        let conn = self.conn(peer).await?;
        let err = |e: String| QuicError::Peer {
            peer: peer.addr,
            error: e,
        };
        let start = async {
            let (mut send, mut recv) = conn.open_bi().await.map_err(|e| err(e.to_string()))?;
            send.write_all(&header(len, addr, false, true))
                .await
                .map_err(|e| err(e.to_string()))?;
            let _ = send.finish();
            let mut st = [0u8; 8];
            recv.read_exact(&mut st)
                .await
                .map_err(|e| err(e.to_string()))?;
            check(st, peer.addr, addr, len)?;
            Ok(recv)
        };
        tokio::time::timeout(self.timeout, start)
            .await
            .map_err(|_| QuicError::Timeout {
                peer: peer.addr,
                timeout: self.timeout,
            })?
    }

    /// Starts a WRITE of `len` bytes at `addr` on a new stream; the caller sends the
    /// bytes on the returned send half, then [`QuicPool::finish_write`].
    pub async fn open_write(
        &self,
        peer: &QuicPeer,
        addr: u64,
        len: u64,
    ) -> Result<(quinn::SendStream, quinn::RecvStream), QuicError> {
        let conn = self.conn(peer).await?;
        let err = |e: String| QuicError::Peer {
            peer: peer.addr,
            error: e,
        };
        let (mut send, recv) = conn.open_bi().await.map_err(|e| err(e.to_string()))?;
        send.write_all(&header(len, addr, true, true))
            .await
            .map_err(|e| err(e.to_string()))?;
        Ok((send, recv))
    }

    /// Ends a WRITE whose bytes were all sent: waits for the owner's status.
    pub async fn finish_write(
        &self,
        peer: SocketAddr,
        mut send: quinn::SendStream,
        mut recv: quinn::RecvStream,
        addr: u64,
        len: u64,
    ) -> Result<(), QuicError> {
        let err = |e: String| QuicError::Peer { peer, error: e };
        let _ = send.finish();
        let mut st = [0u8; 8];
        tokio::time::timeout(self.timeout, recv.read_exact(&mut st))
            .await
            .map_err(|_| QuicError::Timeout {
                peer,
                timeout: self.timeout,
            })?
            .map_err(|e| err(e.to_string()))?;
        check(st, peer, addr, len)
    }

    async fn one(
        &self,
        conn: &quinn::Connection,
        peer: SocketAddr,
        addr: u64,
        op: Op<'_>,
    ) -> Result<(), QuicError> {
        let err = |e: String| QuicError::Peer { peer, error: e };
        let exchange = async {
            let (mut send, mut recv) = conn.open_bi().await.map_err(|e| err(e.to_string()))?;
            let mut st = [0u8; 8];
            match op {
                Op::Read(mut buf) => {
                    let len = buf.remaining() as u64;
                    send.write_all(&header(len, addr, false, true))
                        .await
                        .map_err(|e| err(e.to_string()))?;
                    let _ = send.finish();
                    recv.read_exact(&mut st)
                        .await
                        .map_err(|e| err(e.to_string()))?;
                    check(st, peer, addr, len)?;
                    super::fill(&mut recv, &mut buf)
                        .await
                        .map_err(|e| err(e.to_string()))?;
                }
                Op::Write(data) => {
                    let len = data.len() as u64;
                    send.write_all(&header(len, addr, true, true))
                        .await
                        .map_err(|e| err(e.to_string()))?;
                    send.write_all(data).await.map_err(|e| err(e.to_string()))?;
                    let _ = send.finish();
                    recv.read_exact(&mut st)
                        .await
                        .map_err(|e| err(e.to_string()))?;
                    check(st, peer, addr, len)?;
                }
            }
            Ok(())
        };
        tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| QuicError::Timeout {
                peer,
                timeout: self.timeout,
            })?
    }
}

enum Op<'a> {
    Read(ReadBuf<'a>),
    Write(&'a [u8]),
}

fn check(frame: [u8; 8], peer: SocketAddr, addr: u64, len: u64) -> Result<(), QuicError> {
    match status(frame) {
        Some(0) => Ok(()),
        Some(status) => Err(QuicError::Rejected {
            peer,
            addr,
            len,
            status,
        }),
        None => Err(QuicError::Peer {
            peer,
            error: "not a v2 status frame".into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_entries_round_trip() {
        let addr: SocketAddr = "127.0.0.1:4433".parse().unwrap();
        let sha = [0xab; 32];
        assert_eq!(
            parse_peer(peer_entry(addr, &sha).as_bytes()),
            Some(QuicPeer { addr, sha256: sha })
        );
        assert_eq!(parse_peer(br#"{"addr":"x","sha256":"00"}"#), None);
        assert_eq!(parse_peer(b"garbage"), None);
    }

    #[tokio::test]
    async fn a_segment_over_quic_with_a_pinned_certificate() {
        let id = Identity::load_or_generate("", "").unwrap();
        let mem = Arc::new(Memory::new(0x1000, 8 << 20, "t").unwrap());
        let ep = server("127.0.0.1:0".parse().unwrap(), &id, "").unwrap();
        let addr = ep.local_addr().unwrap();
        let stop = CancellationToken::new();
        let limit = crate::metrics::Metrics::new().kv.conn_limit(
            crate::kv::metrics::Listener::SegmentQuic,
            4,
            Duration::ZERO,
        );
        tokio::spawn(serve(ep, mem.clone(), limit, stop.clone()));
        let pool = QuicPool::new(Duration::from_secs(5), 4).unwrap();
        let peer = QuicPeer {
            addr,
            sha256: id.sha256,
        };
        let data: Vec<u8> = (0..(5 << 20) + 3).map(|i| (i * 7) as u8).collect();
        pool.write(&peer, 0x1000 + 11, &data).await.unwrap();
        let back = pool
            .read(&peer, 0x1000 + 11, data.len() as u64)
            .await
            .unwrap();
        assert!(back[..] == data[..]);
        // outside the segment: status 1
        assert!(matches!(
            pool.read(&peer, 0x10, 4).await,
            Err(QuicError::Rejected { status: 1, .. })
        ));
        // a wrong fingerprint: refused
        let other = QuicPool::new(Duration::from_secs(5), 1).unwrap();
        let wrong = QuicPeer {
            addr,
            sha256: [0; 32],
        };
        assert!(other.read(&wrong, 0x1000, 4).await.is_err());
        // Bad input on a stream (a truncated header; garbage with a huge length; a
        // write past the end) ends that stream only: the connection and the endpoint
        // keep serving, and the segment is untouched.
        let conn = pool.conn(&peer).await.unwrap();
        for bad in [
            &b"\x01\x02\x03"[..],
            &header(u64::MAX, 0x1000, true, true)[..],
            &header(16, 0x1000 + (8 << 20) - 8, true, true)[..],
        ] {
            let (mut send, mut recv) = conn.open_bi().await.unwrap();
            send.write_all(bad).await.unwrap();
            let _ = send.write_all(&[0xEE; 16]).await;
            let _ = send.finish();
            let answer = recv.read_to_end(64).await.unwrap_or_default();
            assert!(
                answer.is_empty()
                    || status(answer[..8].try_into().unwrap()).is_some_and(|s| s != 0),
                "{answer:?}"
            );
        }
        let again = pool.read(&peer, 0x1000 + 11, 64).await.unwrap();
        assert!(again[..] == data[..64]);
        let tail = pool.read(&peer, 0x1000 + (8 << 20) - 8, 8).await.unwrap();
        assert_eq!(&tail[..], &[0u8; 8], "a refused write left bytes behind");
        stop.cancel();
    }
}

//! The kv face over QUIC (`kv.api_quic_listen`) for callers on other hosts: one QUIC
//! connection per [`Link`], and each [`Client`](crate::Client) made from it is one
//! bidirectional stream carrying the same keep-alive HTTP/1.1 exchange as a TCP
//! connection (docs/kv-api.md, "Remote callers over QUIC").
//!
//! Trust is by pin: the caller names the SHA-256 of moongate's certificate (moongate
//! logs it at start: `kv API served over QUIC quic=ADDR sha256=HEX`), and may present a
//! certificate of its own for a moongate with `kv.api_quic_client_ca`.
//!
//! Blocking over async: a link owns a one-worker tokio runtime that drives the
//! connection; reads and writes block the calling thread on it. So a link must not be
//! used from inside another tokio runtime's worker (C callers never are).

use std::io::{self, Read, Write};
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use sha2::{Digest, Sha256};

/// ALPN of moongate's kv API over QUIC.
const ALPN: &[u8] = b"moongate-kv/1";
/// The TLS name asked for; the pin, not the name, is what is checked.
const SERVER_NAME: &str = "moongate";
/// A connection with no traffic this long is closed (moongate's side uses the same).
const IDLE: Duration = Duration::from_secs(30);
/// Pings keep an idle pooled link alive well within [`IDLE`].
const KEEP_ALIVE: Duration = Duration::from_secs(10);
/// UDP socket buffers asked for (the kernel caps them at net.core.*mem_max).
const UDP_BUFFER_BYTES: usize = 8 << 20;
/// The largest datagram accepted, as moongate's endpoints do.
const MAX_UDP_PAYLOAD: u16 = 65_527;
/// How long closing a link waits for its close to reach moongate.
const CLOSE_WAIT: Duration = Duration::from_millis(500);

/// One QUIC connection to a moongate, reopened when it was lost.
pub struct Link {
    // Declared first: dropped before the runtime that drives them.
    conn: Mutex<quinn::Connection>,
    endpoint: quinn::Endpoint,
    config: quinn::ClientConfig,
    addr: SocketAddr,
    timeout: Duration,
    rt: tokio::runtime::Runtime,
}

impl Drop for Link {
    fn drop(&mut self) {
        // Tell moongate at once rather than leaving it to the idle timeout: the close
        // is sent by the endpoint's driver, so the runtime runs until it is out (on
        // loopback, well under the bound).
        if let Ok(c) = self.conn.lock() {
            c.close(0u32.into(), b"closed");
        }
        let endpoint = &self.endpoint;
        self.rt.block_on(async {
            let _ = tokio::time::timeout(CLOSE_WAIT, endpoint.wait_idle()).await;
        });
    }
}

/// Who the caller is, for a moongate that checks client certificates: PEM files.
pub struct ClientPem<'a> {
    pub cert: &'a str,
    pub key: &'a str,
}

fn setup(e: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, e.to_string())
}

/// Parses 64 hex digits.
pub fn parse_sha256(hex: &str) -> Option<[u8; 32]> {
    let hex = hex.trim();
    if hex.len() != 64 || !hex.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

impl Link {
    /// Connects to `addr` (`HOST:PORT`), trusting only the certificate whose SHA-256 is
    /// `sha256`; `cert` is presented when given. Waits at most `timeout` for the
    /// handshake.
    pub fn connect(
        addr: &str,
        sha256: [u8; 32],
        cert: Option<ClientPem<'_>>,
        timeout: Duration,
    ) -> io::Result<Arc<Link>> {
        let addr = addr
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| setup(format!("{addr}: no address")))?;
        let client = match cert {
            Some(c) => {
                let certs = CertificateDer::pem_file_iter(c.cert)
                    .and_then(|i| i.collect::<Result<Vec<_>, _>>())
                    .map_err(|e| setup(format!("client certificate {}: {e}", c.cert)))?;
                let key = PrivateKeyDer::from_pem_file(c.key)
                    .map_err(|e| setup(format!("client key {}: {e}", c.key)))?;
                Some((certs, key))
            }
            None => None,
        };
        let mut transport = tuned_transport();
        fit_to_peer(&mut transport, addr.ip());
        transport
            .max_idle_timeout(Some(IDLE.try_into().map_err(setup)?))
            .keep_alive_interval(Some(KEEP_ALIVE));
        let config = pinned_client(sha256, client, ALPN, Arc::new(transport)).map_err(setup)?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("moongate-kv-quic")
            .enable_all()
            .build()?;
        let bind: SocketAddr = if addr.is_ipv6() {
            (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
        } else {
            (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
        };
        let endpoint = {
            let _entered = rt.enter();
            udp_endpoint(bind, None)?
        };
        let conn = rt.block_on(handshake(&endpoint, &config, addr, timeout))?;
        Ok(Arc::new(Link {
            conn: Mutex::new(conn),
            endpoint,
            config,
            addr,
            timeout,
            rt,
        }))
    }

    /// A new stream: one HTTP/1.1 connection to the kv face. A lost connection is
    /// reopened first (one try; its failure is the caller's error).
    pub fn open(self: &Arc<Link>) -> io::Result<QuicStream> {
        let mut conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        if conn.close_reason().is_some() {
            *conn = self.rt.block_on(handshake(
                &self.endpoint,
                &self.config,
                self.addr,
                self.timeout,
            ))?;
        }
        let c = conn.clone();
        drop(conn);
        let (send, recv) = self
            .rt
            .block_on(async {
                tokio::time::timeout(self.timeout, c.open_bi())
                    .await
                    .map_err(|_| io::Error::from(io::ErrorKind::TimedOut))?
                    .map_err(io::Error::other)
            })
            .map_err(|e| peer(self.addr, e))?;
        Ok(QuicStream {
            link: self.clone(),
            send,
            recv,
        })
    }
}

/// The transport moongate's QUIC ends and this library share: datagrams up to 65,000
/// bytes where the path carries them (quinn stops at Ethernet size), and windows sized
/// for multi-MiB values on fast links (quinn's internet defaults ran a 16 MiB get at a
/// third of this). Callers add their idle timeout, keep-alives and stream limits.
pub fn tuned_transport() -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    let mut mtu = quinn::MtuDiscoveryConfig::default();
    mtu.upper_bound(65_000);
    t.mtu_discovery_config(Some(mtu));
    // The connection window is also what one peer can make the other side buffer:
    // moongate bounds a QUIC listener's memory with it.
    t.stream_receive_window(quinn::VarInt::from_u32(8 << 20))
        .receive_window(quinn::VarInt::from_u32(RECEIVE_WINDOW))
        .send_window(64 << 20);
    t
}

/// Fits `t` to a peer at `ip`: segmentation offload (GSO) off towards loopback, on
/// elsewhere. On loopback the path MTU climbs to 65,000 bytes, where each datagram is
/// already a system call's worth and quinn with GSO moved 16 MiB at half the rate it
/// does without (0.45 vs 0.95 GB/s, `proxy/examples/quic_loop.rs`, 2-core VM); at an
/// Ethernet-sized MTU GSO is what makes quinn fast (0.52 vs 0.18 GB/s at 1,452 bytes).
pub fn fit_to_peer(t: &mut quinn::TransportConfig, ip: std::net::IpAddr) {
    t.enable_segmentation_offload(!on_loopback(ip));
}

/// Whether a peer at `ip` is this host's loopback (IPv4-mapped addresses included): the
/// peers [`fit_to_peer`] turns GSO off for.
pub fn on_loopback(ip: std::net::IpAddr) -> bool {
    ip.to_canonical().is_loopback()
}

/// Bytes one QUIC connection may have in flight towards its receiver.
pub const RECEIVE_WINDOW: u32 = 16 << 20;

/// A QUIC endpoint on a UDP socket bound to `addr` (a server when `server` is given),
/// with large socket buffers and datagrams; call it inside a tokio runtime.
pub fn udp_endpoint(
    addr: SocketAddr,
    server: Option<quinn::ServerConfig>,
) -> io::Result<quinn::Endpoint> {
    let socket = std::net::UdpSocket::bind(addr)?;
    // The kernel's default (~208 KiB) overflows under a GSO burst of large datagrams:
    // the drops read as loss, cut the congestion window and, seen as an MTU black hole,
    // pin the path MTU at 1200. Ask for more; the kernel caps it at net.core.*mem_max
    // (not being granted it is not an error).
    let s = socket2::SockRef::from(&socket);
    let _ = s
        .set_recv_buffer_size(UDP_BUFFER_BYTES)
        .and_then(|()| s.set_send_buffer_size(UDP_BUFFER_BYTES));
    let mut cfg = quinn::EndpointConfig::default();
    cfg.max_udp_payload_size(MAX_UDP_PAYLOAD).map_err(setup)?;
    quinn::Endpoint::new(cfg, server, socket, Arc::new(quinn::TokioRuntime))
}

/// A QUIC client configuration trusting only the certificate whose SHA-256 is
/// `sha256` (TLS 1.3, ALPN `alpn`), presenting `client` (chain and key) when given.
pub fn pinned_client(
    sha256: [u8; 32],
    client: Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
    alpn: &[u8],
    transport: Arc<quinn::TransportConfig>,
) -> Result<quinn::ClientConfig, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let b = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(Pinned {
            sha256,
            algs: provider.signature_verification_algorithms,
        }));
    let mut tls = match client {
        Some((certs, key)) => b
            .with_client_auth_cert(certs, key)
            .map_err(|e| e.to_string())?,
        None => b.with_no_client_auth(),
    };
    tls.alpn_protocols = vec![alpn.to_vec()];
    let crypto =
        quinn::crypto::rustls::QuicClientConfig::try_from(tls).map_err(|e| e.to_string())?;
    let mut cfg = quinn::ClientConfig::new(Arc::new(crypto));
    cfg.transport_config(transport);
    Ok(cfg)
}

fn peer(addr: SocketAddr, e: impl std::fmt::Display) -> io::Error {
    io::Error::other(format!("quic {addr}: {e}"))
}

async fn handshake(
    endpoint: &quinn::Endpoint,
    config: &quinn::ClientConfig,
    addr: SocketAddr,
    timeout: Duration,
) -> io::Result<quinn::Connection> {
    let connecting = endpoint
        .connect_with(config.clone(), addr, SERVER_NAME)
        .map_err(|e| peer(addr, e))?;
    tokio::time::timeout(timeout, connecting)
        .await
        .map_err(|_| peer(addr, format!("no handshake within {timeout:?}")))?
        .map_err(|e| peer(addr, e))
}

/// One bidirectional stream, read and written as a blocking byte stream.
pub struct QuicStream {
    link: Arc<Link>,
    send: quinn::SendStream,
    recv: quinn::RecvStream,
}

impl Read for QuicStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let recv = &mut self.recv;
        match self.link.rt.block_on(recv.read(buf)) {
            Ok(Some(n)) => Ok(n),
            Ok(None) => Ok(0),
            Err(e) => Err(peer(self.link.addr, e)),
        }
    }
}

impl Write for QuicStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let send = &mut self.send;
        self.link
            .rt
            .block_on(send.write(buf))
            .map_err(|e| peer(self.link.addr, e))
    }

    fn flush(&mut self) -> io::Result<()> {
        // QUIC sends what was written without an explicit flush.
        Ok(())
    }
}

impl Drop for QuicStream {
    fn drop(&mut self) {
        // Ends the stream (moongate ends its HTTP connection on it).
        let _ = self.send.finish();
    }
}

/// Trusts one certificate, by its SHA-256 (no CA, no name check); signatures are
/// checked with the given algorithms.
#[derive(Debug)]
struct Pinned {
    sha256: [u8; 32],
    algs: rustls::crypto::WebPkiSupportedAlgorithms,
}

impl rustls::client::danger::ServerCertVerifier for Pinned {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        let got: [u8; 32] = Sha256::digest(end_entity.as_ref()).into();
        if got == self.sha256 {
            Ok(rustls::client::danger::ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General(
                "moongate's certificate does not match the pinned SHA-256".into(),
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algs)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algs)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.algs.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segmentation_offload_is_off_only_towards_loopback() {
        // quinn has no getter; its Debug form names the field.
        let gso = |ip: &str| {
            let mut t = tuned_transport();
            fit_to_peer(&mut t, ip.parse().unwrap());
            format!("{t:?}")
                .split("enable_segmentation_offload: ")
                .nth(1)
                .map(|rest| rest.starts_with("true"))
                .expect("quinn's TransportConfig Debug names enable_segmentation_offload")
        };
        assert!(!gso("127.0.0.1"));
        assert!(!gso("::1"));
        assert!(!gso("::ffff:127.0.0.1"));
        assert!(gso("10.1.2.3"));
        assert!(gso("fd00::1"));
    }

    #[test]
    fn a_fingerprint_is_64_hex_digits() {
        let hex = "00ff".repeat(16);
        let p = parse_sha256(&hex).unwrap();
        assert_eq!((p[0], p[1], p[31]), (0x00, 0xff, 0xff));
        assert!(parse_sha256(&hex[1..]).is_none());
        assert!(parse_sha256(&format!("{}zz", &hex[2..])).is_none());
        assert!(parse_sha256(&"é".repeat(32)).is_none());
    }
}

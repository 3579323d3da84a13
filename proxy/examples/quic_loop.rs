//! QUIC alone on loopback, with the transport moongate and its library share
//! (`moongate_kv::quic::tuned_transport`): `quic_loop [SIZE_MIB] [COUNT] [STREAMS]`
//! sends COUNT values of SIZE MiB from a server endpoint to a client endpoint, each value
//! cut over STREAMS streams at once, and prints GB/s with the client connection's path
//! statistics (path MTU, lost packets, congestion window). The two endpoints run on
//! runtimes of their own (threads `QUIC_LOOP_THREADS` each, default 1), as two
//! processes would. Tells the transport's own ceiling apart from what moongate adds.
//!
//! Knobs (environment): `QUIC_LOOP_GSO=1` segmentation offload on (off towards
//! loopback, as moongate sets it); `QUIC_LOOP_MTU=BYTES` the MTU discovery's upper
//! bound; `QUIC_LOOP_CC=bbr` the BBR congestion controller; `QUIC_LOOP_IW=BYTES` the
//! controller's initial window; `QUIC_LOOP_SRW=BYTES` the stream receive window (the
//! connection's: four times it); `QUIC_LOOP_ACK=N` the ACK frequency extension's
//! ack-eliciting threshold.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use sha2::Digest;

fn runtime(threads: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .expect("runtime")
}

fn transport() -> Arc<quinn::TransportConfig> {
    let mut t = moongate_kv::quic::tuned_transport();
    t.max_concurrent_bidi_streams(quinn::VarInt::from_u32(256));
    let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
    if let Some(w) = env("QUIC_LOOP_SRW") {
        t.stream_receive_window(quinn::VarInt::from_u64(w).unwrap())
            .receive_window(quinn::VarInt::from_u64(w * 4).unwrap());
    }
    if let Some(n) = env("QUIC_LOOP_ACK") {
        let mut a = quinn::AckFrequencyConfig::default();
        a.ack_eliciting_threshold(quinn::VarInt::from_u64(n).unwrap());
        t.ack_frequency_config(Some(a));
    }
    if let Some(m) = env("QUIC_LOOP_MTU") {
        let mut d = quinn::MtuDiscoveryConfig::default();
        d.upper_bound(m as u16);
        t.mtu_discovery_config(Some(d));
    }
    // As moongate and its library set it up for a loopback peer (GSO off), unless
    // QUIC_LOOP_GSO=1 turns segmentation offload back on.
    moongate_kv::quic::fit_to_peer(&mut t, std::net::Ipv4Addr::LOCALHOST.into());
    if env("QUIC_LOOP_GSO") == Some(1) {
        t.enable_segmentation_offload(true);
    }
    let iw: Option<u64> = std::env::var("QUIC_LOOP_IW")
        .ok()
        .and_then(|v| v.parse().ok());
    if std::env::var("QUIC_LOOP_CC").as_deref() == Ok("bbr") {
        let mut c = quinn::congestion::BbrConfig::default();
        if let Some(w) = iw {
            c.initial_window(w);
        }
        t.congestion_controller_factory(Arc::new(c));
    } else if let Some(w) = iw {
        let mut c = quinn::congestion::CubicConfig::default();
        c.initial_window(w);
        t.congestion_controller_factory(Arc::new(c));
    }
    Arc::new(t)
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numbers"))
        .collect();
    let size = args.first().copied().unwrap_or(16) << 20;
    let count = args.get(1).copied().unwrap_or(20);
    let streams = args.get(2).copied().unwrap_or(1).max(1);
    let threads = std::env::var("QUIC_LOOP_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);

    let ck = rcgen::generate_simple_self_signed(vec!["moongate".to_string()]).expect("cert");
    let der = ck.cert.der().clone();
    let sha: [u8; 32] = sha2::Sha256::digest(der.as_ref()).into();
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(ck.key_pair.serialize_der().into());
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("tls")
        .with_no_client_auth()
        .with_single_cert(vec![der], key)
        .expect("cert");
    tls.alpn_protocols = vec![b"loop".to_vec()];
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls).expect("quic tls");
    let mut server_cfg = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    server_cfg.transport_config(transport());

    let value = Arc::new(vec![7u8; size]);
    let srv_rt = runtime(threads);
    let server = srv_rt.block_on(async {
        moongate_kv::quic::udp_endpoint("127.0.0.1:0".parse().unwrap(), Some(server_cfg))
            .expect("server endpoint")
    });
    let addr: SocketAddr = server.local_addr().expect("addr");
    // The server answers every stream's 16-byte request (offset, length) with that
    // part of the value.
    srv_rt.spawn(async move {
        while let Some(inc) = server.accept().await {
            let value = value.clone();
            tokio::spawn(async move {
                let Ok(conn) = inc.await else { return };
                while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                    let value = value.clone();
                    tokio::spawn(async move {
                        let mut req = [0u8; 16];
                        if recv.read_exact(&mut req).await.is_err() {
                            return;
                        }
                        let off = u64::from_le_bytes(req[..8].try_into().unwrap()) as usize;
                        let n = u64::from_le_bytes(req[8..].try_into().unwrap()) as usize;
                        let part = bytes::Bytes::copy_from_slice(&value[off..off + n]);
                        let _ = send.write_chunk(part).await;
                        let _ = send.finish();
                        let _ = send.stopped().await;
                    });
                }
            });
        }
    });

    let cli_rt = runtime(threads);
    cli_rt.block_on(async move {
        let client = moongate_kv::quic::udp_endpoint("127.0.0.1:0".parse().unwrap(), None)
            .expect("client endpoint");
        let cfg = moongate_kv::quic::pinned_client(sha, None, b"loop", transport())
            .expect("client config");
        let conn = client
            .connect_with(cfg, addr, "moongate")
            .expect("connect")
            .await
            .expect("handshake");
        let mut buf = vec![0u8; size];
        let step = size.div_ceil(streams);
        for round in 0..count + 2 {
            let t = Instant::now();
            let parts = buf.chunks_mut(step).enumerate().map(|(i, part)| {
                let conn = conn.clone();
                async move {
                    let (mut send, mut recv) = conn.open_bi().await.expect("open");
                    let mut req = [0u8; 16];
                    req[..8].copy_from_slice(&((i * step) as u64).to_le_bytes());
                    req[8..].copy_from_slice(&(part.len() as u64).to_le_bytes());
                    send.write_all(&req).await.expect("request");
                    send.finish().expect("finish");
                    recv.read_exact(part).await.expect("value");
                }
            });
            futures_util::future::join_all(parts).await;
            let s = t.elapsed().as_secs_f64();
            if round >= 2 {
                let st = conn.stats();
                println!(
                    "{:.2} GB/s  mtu {}  lost {}  cwnd {}  sent {}",
                    size as f64 / s / 1e9,
                    st.path.current_mtu,
                    st.path.lost_packets,
                    st.path.cwnd,
                    st.udp_tx.datagrams
                );
            }
        }
        assert!(buf.iter().all(|&b| b == 7));
    });
}

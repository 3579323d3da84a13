//! The kv face's bounds against hostile peers, each tested as the peer would try it,
//! while a well-behaved client is still served: 2,000 connections on every listener
//! (kv TCP, Unix, QUIC API, the own segment's TE-TCP and QUIC), slow and lying bodies,
//! endless key lists, unannounced bodies larger than the byte budget, idle connections.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::*;

/// Connections (QUIC: attempts) per listener: 20 times the caps the test sets (100; QUIC
/// 16). 10,000 proved nothing more (docs/results.md, "Bounds") and took 157 s of CI's
/// 40 minutes, a fifth of it 2,000.
const FLOOD: usize = 2_000;

/// Resident memory of a process, in KiB.
fn rss_kib(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmRSS")
}

fn enc(key: &str) -> String {
    format!("/v1/kv/{}", key.replace('/', "%2F"))
}

/// One HTTP/1.1 request on a stream; the status code of its answer.
fn status_over<S: Read + Write>(mut s: S, method: &str, path: &str) -> u16 {
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    let line = String::from_utf8_lossy(&out);
    line.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status in {line:?}"))
}

/// The `quic=` address a moongate logged on the line containing `marker`.
fn logged_addr(mg: &Moongate, marker: &str) -> std::net::SocketAddr {
    wait_for(marker, Duration::from_secs(10), &[&mg.proc], || {
        mg.proc.log_text().contains(marker)
    });
    let log = mg.proc.log_text();
    let line = log.lines().find(|l| l.contains(marker)).unwrap();
    line.split("quic=")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no quic= in {line}"))
}

/// Accepts any server certificate: the flood only needs handshakes to complete.
#[derive(Debug)]
struct AnyServer(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyServer {
    fn verify_server_cert(
        &self,
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        m: &[u8],
        c: &rustls::pki_types::CertificateDer<'_>,
        d: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(m, c, d, &self.0.signature_verification_algorithms)
    }
    fn verify_tls13_signature(
        &self,
        m: &[u8],
        c: &rustls::pki_types::CertificateDer<'_>,
        d: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(m, c, d, &self.0.signature_verification_algorithms)
    }
    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `FLOOD` QUIC connection attempts at `at` with `alpn`, all at once; the connections
/// that got in are returned (held open by the caller), with the count refused.
async fn quic_flood(at: std::net::SocketAddr, alpn: &[u8]) -> (Vec<quinn::Connection>, usize) {
    let p = Arc::new(rustls::crypto::ring::default_provider());
    let mut tls = rustls::ClientConfig::builder_with_provider(p.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyServer(p)))
        .with_no_client_auth();
    tls.alpn_protocols = vec![alpn.to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap();
    let cfg = quinn::ClientConfig::new(Arc::new(crypto));
    let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    ep.set_default_client_config(cfg);
    let mut held = Vec::new();
    let mut refused = 0;
    // In waves, so the client's own socket buffers keep up.
    for _ in 0..FLOOD / 500 {
        let attempts: Vec<_> = (0..500)
            .map(|_| ep.connect(at, "moongate").unwrap())
            .collect();
        for a in attempts {
            match tokio::time::timeout(Duration::from_secs(10), a).await {
                Ok(Ok(c)) => held.push(c),
                Ok(Err(_)) => refused += 1,
                Err(_) => panic!("a QUIC attempt was neither admitted nor refused"),
            }
        }
    }
    (held, refused)
}

/// Waits until a listener holds `open` connections and has refused `refused` (at
/// least `refused` when `at_least`: over UDP, a client's retransmitted first packet can
/// arrive as a second attempt and is refused as well).
fn wait_conns(mg: &Moongate, listener: &str, open: f64, refused: f64, at_least: bool) {
    let o = format!("moongate_kv_connections{{listener=\"{listener}\"}}");
    let r = format!("moongate_kv_connections_refused_total{{listener=\"{listener}\"}}");
    // Generous: 10,000 connects on a busy 2-core machine took over a minute once.
    let deadline = Instant::now() + Duration::from_secs(240);
    loop {
        let m = mg.metrics();
        let (got_o, got_r) = (metric_value(&m, &o), metric_value(&m, &r));
        let refused_ok = if at_least {
            got_r >= refused
        } else {
            got_r == refused
        };
        if got_o == open && refused_ok {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{listener}: want {open} open, {refused} refused; have {got_o}, {got_r}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// 2,000 connections on each of the five listeners, one listener at a time: each holds
/// its cap and closes the rest at once (counted), moongate's memory stays bounded, other
/// listeners serve meanwhile, and once the flood ends a real client is served on the
/// flooded listener. Nothing is shed here (`shed_after_ms = 0`: the cap alone, tested
/// with exact counts; shedding has its own test). Idle connections are never closed here (an hour): a busy CI run
/// took over a minute to connect 10,000, and the default 60 s idle close then freed
/// slots mid-flood (0 open, 9,800 refused instead of 100 and 9,900). Idle closes are
/// tested on their own (`hostile_bodies_are_bounded_and_a_well_behaved_client_is_served`).
#[test]
fn a_connection_flood_on_every_listener_is_capped_and_real_clients_are_served() {
    let master = Master::start();
    let dir = tempdir();
    let unix = dir.path().join("kv.sock");
    let (mg, kv) = kv_moongate(
        &master,
        &format!(
            "segment_bytes = 16777216\nquic_listen = \"127.0.0.1:0\"\n\
             api_quic_listen = \"127.0.0.1:0\"\nunix_path = \"{}\"\n\
             max_connections = 100\nsegment_max_connections = 100\nquic_max_connections = 16\n\
             idle_timeout_ms = 3600000\nshed_after_ms = 0\n",
            unix.display()
        ),
    );
    let segment = wait_segment_mounted(&mg);
    let api_quic = logged_addr(&mg, "kv API served over QUIC");
    let seg_quic = logged_addr(&mg, "own segment served over QUIC");
    let logs = [&master.proc, &mg.proc];
    for (k, n) in [("own/small", 5000), ("own/big", (3 << 20) + 7)] {
        let (st, b) = http(&kv, "PUT", &enc(k), &value_of(k, n)).unwrap();
        assert_eq!(st, 201, "{b}\n{}", mg.proc.log_text());
    }
    let pid = mg.proc.pid();
    let base = rss_kib(pid);
    let mut peak = base;
    let mut report = Vec::new();

    // TCP listeners: the kv API, and the own segment's TE-TCP.
    for (listener, addr) in [("http", kv.clone()), ("segment_tcp", segment.clone())] {
        let before = Instant::now();
        let flood: Vec<TcpStream> = (0..FLOOD)
            .map(|_| TcpStream::connect(&addr).unwrap())
            .collect();
        wait_conns(&mg, listener, 100.0, (FLOOD - 100) as f64, false);
        let rss = rss_kib(pid);
        peak = peak.max(rss);
        report.push(format!(
            "{listener}: {FLOOD} connections in {:?}, RSS {rss} KiB",
            before.elapsed()
        ));
        // Meanwhile the Unix socket and the master face serve.
        assert_eq!(
            status_over(
                UnixStream::connect(&unix).unwrap(),
                "GET",
                &enc("own/small")
            ),
            200
        );
        assert!(service_ready(&mg.listen));
        drop(flood);
        wait_conns(&mg, listener, 0.0, (FLOOD - 100) as f64, false);
    }
    // Served again: the kv API, and an unmodified client reading the own segment.
    let (st, body) = http_bytes(&kv, "GET", &enc("own/big"), &[]).unwrap();
    assert!(st == 200 && body == value_of("own/big", (3 << 20) + 7));
    let r = run_role("guest", &mg.listen, &master.metadata, &[], &logs);
    assert_eq!(result(&r, "get own/small")["ok"], true, "{r}");
    assert_eq!(result(&r, "get own/big")["ok"], true, "{r}");

    // The Unix socket.
    let flood: Vec<UnixStream> = (0..FLOOD)
        .map(|_| UnixStream::connect(&unix).unwrap())
        .collect();
    wait_conns(&mg, "unix", 100.0, (FLOOD - 100) as f64, false);
    let rss = rss_kib(pid);
    peak = peak.max(rss);
    report.push(format!("unix: {FLOOD} connections, RSS {rss} KiB"));
    let (st, _) = http(&kv, "GET", &enc("own/small"), &[]).unwrap();
    assert_eq!(st, 200, "TCP serves while the Unix socket is flooded");
    drop(flood);
    wait_conns(&mg, "unix", 0.0, (FLOOD - 100) as f64, false);
    assert_eq!(
        status_over(
            UnixStream::connect(&unix).unwrap(),
            "GET",
            &enc("own/small")
        ),
        200
    );

    // The QUIC listeners: 16 held, the rest refused before their handshake.
    let rt = tokio::runtime::Runtime::new().unwrap();
    for (listener, at, alpn) in [
        ("quic_api", api_quic, &b"moongate-kv/1"[..]),
        ("segment_quic", seg_quic, &b"moongate-segment/1"[..]),
    ] {
        let before = Instant::now();
        let (held, refused) = rt.block_on(quic_flood(at, alpn));
        assert_eq!((held.len(), refused), (16, FLOOD - 16), "{listener}");
        wait_conns(&mg, listener, 16.0, (FLOOD - 16) as f64, true);
        let rss = rss_kib(pid);
        peak = peak.max(rss);
        report.push(format!(
            "{listener}: {FLOOD} attempts in {:?}, RSS {rss} KiB",
            before.elapsed()
        ));
        let (st, _) = http(&kv, "GET", &enc("own/small"), &[]).unwrap();
        assert_eq!(st, 200);
        for c in &held {
            c.close(0u32.into(), b"done");
        }
        drop(held);
        wait_conns(&mg, listener, 0.0, (FLOOD - 16) as f64, true);
    }
    // A real caller of the QUIC API, and a peer moongate reading the segment over QUIC.
    let (addr, sha) = crate::kv_quic::api_quic_of(&mg);
    rt.block_on(async {
        let c =
            moongate::kv::api::quic::ApiClient::connect(addr, sha, None, Duration::from_secs(10))
                .await
                .unwrap();
        let (st, b) = c
            .request("GET", &enc("own/small"), bytes::Bytes::new())
            .await
            .unwrap();
        assert!(st == 200 && b[..] == value_of("own/small", 5000)[..]);
    });
    let (peer, peer_kv) = kv_moongate(&master, "");
    let (st, body) = http_bytes(&peer_kv, "GET", &enc("own/big"), &[]).unwrap();
    assert!(
        st == 200 && body == value_of("own/big", (3 << 20) + 7),
        "{st}"
    );
    assert_eq!(
        peer.metric("moongate_kv_transfers_total{transport=\"quic\",direction=\"read\"}"),
        1.0,
        "{}",
        peer.proc.log_text()
    );

    let grown = peak.saturating_sub(base);
    eprintln!(
        "RSS at start {base} KiB, peak {peak} KiB (+{grown} KiB)\n{}",
        report.join("\n")
    );
    // The counts above prove the caps; this catches what a connection refused at once
    // might still keep (1,900 of them per listener, each with a task and buffers, would
    // take tens to hundreds of MiB); capped, the growth is the caps' worth.
    assert!(
        grown < 64 << 10,
        "RSS grew by {grown} KiB\n{}",
        report.join("\n")
    );
}

/// Opens `n` connections with `open` and starts on each a chunked PUT whose body never
/// finishes (one 16 KiB piece, then nothing): what a stalled or malicious client holds.
fn stalled_puts<S: Write>(n: usize, mut open: impl FnMut() -> S) -> Vec<S> {
    (0..n)
        .map(|i| {
            let mut s = open();
            write!(
                s,
                "PUT /v1/kv/stalled%2F{i} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n4000\r\n"
            )
            .unwrap();
            s.write_all(&[b'x'; 16384]).unwrap();
            s
        })
        .collect()
}

/// A listener full of stalled bodies does not lock a new client out: once they have
/// moved no byte for `kv.shed_after_ms`, each new connection sheds the one stalled
/// longest (counted), on TCP and on the Unix socket; the rest of the flood stays held.
#[test]
fn stalled_bodies_at_the_cap_are_shed_for_new_clients() {
    const CAP: usize = 16;
    let master = Master::start();
    let dir = tempdir();
    let (mg, kv, unix) = kv_unix_moongate(
        &master,
        dir.path(),
        64 << 20,
        // No body-rate floor here: the flood must stay stalled, not be answered 408.
        &format!("max_connections = {CAP}\nshed_after_ms = 500\nmin_body_bytes_per_second = 0\n"),
    );
    let open = |l: &str| mg.metric(&format!("moongate_kv_connections{{listener=\"{l}\"}}"));
    let shed = |l: &str| {
        mg.metric(&format!(
            "moongate_kv_connections_shed_total{{listener=\"{l}\"}}"
        ))
    };
    let value = value_of("shed/v", 1 << 20);

    let flood = stalled_puts(CAP, || TcpStream::connect(&kv).unwrap());
    let stalled_at = Instant::now();
    wait_for(
        "the TCP flood held",
        Duration::from_secs(30),
        &[&mg.proc],
        || open("http") == CAP as f64,
    );
    // The rule is about time without progress: let the flood pass it.
    std::thread::sleep(Duration::from_millis(600).saturating_sub(stalled_at.elapsed()));
    for round in 0..3 {
        let started = Instant::now();
        // A new connection each round (the GETs' client keeps its own).
        let path = format!("/v1/kv/shed%2Fv{round}");
        let (st, _) = request_over(TcpStream::connect(&kv).unwrap(), "PUT", &path, &value).unwrap();
        assert_eq!(st, 201, "round {round}\n{}", mg.proc.log_text());
        let (st, got) = http_bytes(&kv, "GET", &format!("/v1/kv/shed%2Fv{round}"), &[]).unwrap();
        assert!(st == 200 && got == value, "round {round}: {st}");
        // Not a speed check: a bound far above the time it takes, far below the
        // kv.timeout_ms a client locked out would wait.
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "round {round}: {:?}",
            started.elapsed()
        );
    }
    // The first new connection shed a stalled one; a finished one frees its place, so
    // later ones may take it without shedding.
    assert!(shed("http") >= 1.0, "{}", shed("http"));
    // What was not shed is still held.
    wait_for(
        "the flood's rest held",
        Duration::from_secs(30),
        &[&mg.proc],
        || {
            let o = open("http");
            o >= CAP as f64 - shed("http") && o <= CAP as f64
        },
    );
    drop(flood);

    let flood = stalled_puts(CAP, || UnixStream::connect(&unix).unwrap());
    let stalled_at = Instant::now();
    wait_for(
        "the Unix flood held",
        Duration::from_secs(30),
        &[&mg.proc],
        || open("unix") == CAP as f64,
    );
    std::thread::sleep(Duration::from_millis(600).saturating_sub(stalled_at.elapsed()));
    let small = value_of("shed/u", 100_000);
    for round in 0..3 {
        let path = format!("/v1/kv/shed%2Fu{round}");
        let (st, _) =
            request_over(UnixStream::connect(&unix).unwrap(), "PUT", &path, &small).unwrap();
        assert_eq!(st, 201, "round {round}\n{}", mg.proc.log_text());
        let (st, got) =
            request_over(UnixStream::connect(&unix).unwrap(), "GET", &path, &[]).unwrap();
        assert!(
            st == 200 && got == small,
            "round {round}: {st}, {} bytes",
            got.len()
        );
    }
    assert!(shed("unix") >= 1.0, "{}", shed("unix"));
    assert_eq!(
        open("unix"),
        (CAP - shed("unix") as usize) as f64 + 0.0_f64.max(0.0)
    );
    drop(flood);
}

/// A body that stalls is answered 408 once it falls below
/// `kv.min_body_bytes_per_second` (after its grace), long before `kv.timeout_ms`, and
/// gives its reserved bytes back: buffered, streamed (1 MiB and more) and batch puts
/// alike; a batch keeps the records that arrived whole. A slow but steady body is taken.
#[test]
fn a_body_below_the_minimum_rate_is_answered_408_and_a_steady_one_is_taken() {
    let master = Master::start();
    let (mg, kv) = kv_moongate(
        &master,
        "segment_bytes = 16777216\ntimeout_ms = 60000\nmin_body_bytes_per_second = 65536\n\
         min_body_grace_ms = 1000\n",
    );
    wait_segment_mounted(&mg);
    let mut stalled = stalled_puts(1, || TcpStream::connect(&kv).unwrap()).remove(0);
    let started = Instant::now();
    stalled
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut answer = Vec::new();
    let _ = stalled.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("min_body_bytes_per_second"), "{answer}");
    // Not a speed check: the floor, not kv.timeout_ms (60 s), answered it.
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    wait_for(
        "the budget given back",
        Duration::from_secs(10),
        &[&mg.proc],
        || mg.metric("moongate_kv_inflight_bytes") == 0.0,
    );
    let (st, _) = http(&kv, "GET", &enc("stalled/0"), &[]).unwrap();
    assert_eq!(st, 404, "nothing of the stalled put was stored");

    // The same floor for a streamed PUT (announced 4 MiB: passed on to the replicas as
    // it arrives) that stops after 256 KiB: 408, the put revoked, the budget back.
    let mut streamed = TcpStream::connect(&kv).unwrap();
    write!(
        streamed,
        "PUT {} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n",
        enc("streamed-stall"),
        4 << 20
    )
    .unwrap();
    streamed.write_all(&vec![5u8; 256 << 10]).unwrap();
    streamed
        .set_read_timeout(Some(Duration::from_secs(40)))
        .unwrap();
    let mut answer = Vec::new();
    let _ = streamed.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.starts_with("HTTP/1.1 408") && answer.contains("min_body_bytes_per_second"),
        "{answer}"
    );
    // And for a batch put: the first record whole, then the second stops halfway.
    // The first is stored (what arrived whole is kept), the break answered 408.
    let first = value_of("batch-stall/0", 100_000);
    let mut body = moongate::kv::api::records::put_record(b"batch-stall/0", &first);
    let second = moongate::kv::api::records::put_record(b"batch-stall/1", &[6u8; 200_000]);
    body.extend_from_slice(&second[..100_000]);
    let mut batch = TcpStream::connect(&kv).unwrap();
    write!(
        batch,
        "POST /v1/kv/batch/put HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n",
        body.len()
    )
    .unwrap();
    batch.write_all(&body).unwrap();
    batch.write_all(b"\r\n").unwrap();
    batch
        .set_read_timeout(Some(Duration::from_secs(40)))
        .unwrap();
    let mut answer = Vec::new();
    let _ = batch.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.starts_with("HTTP/1.1 408") && answer.contains("min_body_bytes_per_second"),
        "{answer}"
    );
    let (st, got) = http_bytes(&kv, "GET", &enc("batch-stall/0"), &[]).unwrap();
    assert!(
        st == 200 && got == first,
        "the whole record was stored: {st}"
    );
    let (st, _) = http(&kv, "GET", &enc("streamed-stall"), &[]).unwrap();
    assert_eq!(st, 404, "nothing of the stalled streamed put was stored");
    wait_for(
        "the budget given back",
        Duration::from_secs(10),
        &[&mg.proc],
        || mg.metric("moongate_kv_inflight_bytes") == 0.0,
    );
    assert_eq!(
        mg.metric("moongate_kv_bodies_shed_total{reason=\"min_rate\"}"),
        3.0
    );

    // 32 KiB every 100 ms (about 320 KiB/s) for 2 s: slow, above the floor.
    let mut steady = TcpStream::connect(&kv).unwrap();
    write!(
        steady,
        "PUT {} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
        enc("steady")
    )
    .unwrap();
    let piece = vec![3u8; 32 << 10];
    for _ in 0..20 {
        write!(steady, "{:x}\r\n", piece.len()).unwrap();
        steady.write_all(&piece).unwrap();
        steady.write_all(b"\r\n").unwrap();
        std::thread::sleep(Duration::from_millis(100));
    }
    steady.write_all(b"0\r\n\r\n").unwrap();
    let mut answer = Vec::new();
    steady.read_to_end(&mut answer).unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.starts_with("HTTP/1.1 201"),
        "{answer}\n{}",
        mg.proc.log_text()
    );
    let (st, got) = http_bytes(&kv, "GET", &enc("steady"), &[]).unwrap();
    assert!(st == 200 && got == vec![3u8; 20 * (32 << 10)], "{st}");
}

/// Bodies and key lists a hostile client sends: slow (408 after kv.timeout_ms, its
/// reservation given back), announced huge (413 before a byte is read), endless key
/// lists (413 at the cap), unannounced bodies beyond the byte budget (503 past it, the
/// budget never exceeded), keys too long (400), idle connections (closed); a
/// well-behaved client is served throughout.
#[test]
fn hostile_bodies_are_bounded_and_a_well_behaved_client_is_served() {
    let master = Master::start();
    let (mg, kv) = kv_moongate(
        &master,
        "segment_bytes = 16777216\nmax_inflight_bytes = 1048576\ntimeout_ms = 1500\n\
         busy_wait_ms = 200\nmax_batch_keys = 100\nmax_key_bytes = 64\nidle_timeout_ms = 2500\n",
    );
    wait_segment_mounted(&mg);
    let budget = 1048576.0;
    let inflight = || mg.metric("moongate_kv_inflight_bytes");
    let served = || {
        let (st, b) = http(&kv, "PUT", &enc("good/x"), b"fine").unwrap();
        assert!(st == 201 || st == 409, "{st} {b}");
        let (st, b) = http(&kv, "GET", &enc("good/x"), &[]).unwrap();
        assert_eq!((st, b.as_str()), (200, "fine"));
    };

    // Slowloris: 10 of 1000 announced bytes, then nothing.
    let mut slow = TcpStream::connect(&kv).unwrap();
    write!(
        slow,
        "PUT {} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n",
        enc("slow")
    )
    .unwrap();
    slow.write_all(&[1u8; 10]).unwrap();
    wait_for(
        "the slow body holds its bytes",
        Duration::from_secs(5),
        &[&mg.proc],
        || inflight() == 1000.0,
    );
    served();
    slow.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut answer = [0u8; 12];
    slow.read_exact(&mut answer).unwrap();
    assert_eq!(&answer, b"HTTP/1.1 408");
    assert_eq!(mg.metric("moongate_kv_body_timeouts_total"), 1.0);
    assert_eq!(inflight(), 0.0);
    let (st, _) = http(&kv, "GET", &enc("slow"), &[]).unwrap();
    assert_eq!(st, 404, "nothing of the slow put was stored");

    // Announced lengths far beyond any limit: refused before a byte is read.
    for (method, path) in [("PUT", enc("huge")), ("POST", "/v1/kv/exists".to_string())] {
        let mut s = TcpStream::connect(&kv).unwrap();
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000000\r\n\r\n"
        )
        .unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.read_exact(&mut answer).unwrap();
        assert_eq!(&answer, b"HTTP/1.1 413", "{method} {path}");
    }
    assert_eq!(inflight(), 0.0);

    // An endless key list (chunked): 413 at 100 keys of 64 bytes' worth of JSON.
    let mut endless = TcpStream::connect(&kv).unwrap();
    write!(
        endless,
        "POST /v1/kv/exists HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    .unwrap();
    let chunk = format!("\"{}\",", "k".repeat(60));
    let framed = format!("{:x}\r\n{chunk}\r\n", chunk.len());
    let mut sent = 0usize;
    endless.write_all(b"1\r\n[\r\n").unwrap();
    while sent < (64 << 20) {
        if endless.write_all(framed.as_bytes()).is_err() {
            break;
        }
        sent += chunk.len();
        if sent % (256 << 10) < chunk.len() {
            // Stop early once moongate answered (it reads no further).
            endless.set_nonblocking(true).unwrap();
            let mut peek = [0u8; 12];
            let got = endless.peek(&mut peek).unwrap_or(0);
            endless.set_nonblocking(false).unwrap();
            if got > 0 {
                break;
            }
        }
    }
    endless
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    endless.read_exact(&mut answer).unwrap();
    assert_eq!(&answer, b"HTTP/1.1 413");
    assert!(sent < 64 << 20, "moongate kept reading an endless key list");
    assert_eq!(inflight(), 0.0);
    served();

    // Keys too long, in a path and in a list.
    let long = "k".repeat(65);
    let (st, _) = http(&kv, "PUT", &enc(&long), b"v").unwrap();
    assert_eq!(st, 400);
    let (st, b) = http(
        &kv,
        "POST",
        "/v1/kv/exists",
        format!("[\"{long}\"]").as_bytes(),
    )
    .unwrap();
    assert_eq!(st, 400, "{b}");

    // Unannounced (chunked) bodies, each 400 KiB then stalled: their reservations grow
    // as the bytes arrive (by at least 64 KiB), two fit the 1 MiB budget, the third
    // waits busy_wait_ms and is answered 503; the budget holds.
    let part = vec![7u8; 400 << 10];
    let mut stalled = Vec::new();
    for i in 0..3 {
        let mut s = TcpStream::connect(&kv).unwrap();
        write!(
            s,
            "PUT {} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n",
            enc(&format!("chunked/{i}")),
            part.len()
        )
        .unwrap();
        s.write_all(&part).unwrap();
        s.write_all(b"\r\n").unwrap();
        if i < 2 {
            let want = 400 * 1024 * (i + 1);
            wait_for(
                "the chunked body is reserved",
                Duration::from_secs(5),
                &[&mg.proc],
                || inflight() >= want as f64,
            );
        }
        stalled.push(s);
    }
    let mut fourth = stalled.pop().unwrap();
    fourth
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    fourth.read_exact(&mut answer).unwrap();
    assert_eq!(&answer, b"HTTP/1.1 503");
    assert!(inflight() <= budget, "{} over the budget", inflight());
    for mut s in stalled {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.read_exact(&mut answer).unwrap();
        assert_eq!(&answer, b"HTTP/1.1 408");
    }
    assert_eq!(inflight(), 0.0);
    assert_eq!(mg.metric("moongate_kv_body_timeouts_total"), 3.0);
    served();

    // An idle connection is closed after kv.idle_timeout_ms; a busy one is not.
    // The clock starts before connect: moongate's idle timer starts at its accept, which
    // can come before connect returns here (a start taken after connect measured 2.4976 s).
    let started = Instant::now();
    let mut idle = TcpStream::connect(&kv).unwrap();
    idle.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut rest = Vec::new();
    idle.read_to_end(&mut rest).unwrap();
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(2500) && waited < Duration::from_secs(8),
        "closed after {waited:?} (kv.idle_timeout_ms = 2500; hyper's own header timeout is 10 s)"
    );
    served();
    assert!(service_ready(&mg.listen));
}

/// A burst of concurrent puts opens several master connections; once idle past
/// `kv.master_idle_ms` moongate closes them (counted), and the next put works.
#[test]
fn idle_master_connections_are_closed_after_a_burst() {
    let master = Master::start();
    let (mg, kv) = kv_moongate(&master, "master_idle_ms = 1000\nsegment_bytes = 16777216\n");
    wait_segment_mounted(&mg);
    let burst: Vec<_> = (0..8)
        .map(|i| {
            let kv = kv.clone();
            std::thread::spawn(move || {
                for j in 0..20 {
                    let k = format!("burst/{i}/{j}");
                    let st = http_bytes(
                        &kv,
                        "PUT",
                        &format!("/v1/kv/{}", enc(&k)),
                        &value_of(&k, 4096),
                    );
                    assert_eq!(st.map(|s| s.0), Some(201), "{k}");
                }
            })
        })
        .collect();
    for t in burst {
        t.join().unwrap();
    }
    wait_for(
        "idle master connections closed",
        Duration::from_secs(20),
        &[&mg.proc, &master.proc],
        || {
            let m = mg.metrics();
            metric_value(&m, "moongate_kv_master_idle_closed_total") >= 2.0
                && metric_value(&m, "moongate_kv_master_idle_connections") == 0.0
        },
    );
    let st = http_bytes(&kv, "PUT", "/v1/kv/after", &value_of("after", 4096));
    assert_eq!(st.map(|s| s.0), Some(201));
}

//! Two moongates move values over QUIC: B owns the only segment and serves it over QUIC
//! as well as TE-TCP, A's kv face writes and reads it over QUIC; an unmodified Python
//! client reads and writes the same segment over TE-TCP; a peer whose QUIC identity does
//! not check out is reached over TE-TCP instead.

use crate::support::*;

/// A moongate's metrics page, and its `moongate_kv_transfers_total` by transport and
/// direction.
fn transfers(mg: &Moongate) -> (String, impl Fn(&str, &str) -> f64) {
    let m = mg.metrics();
    let page = m.clone();
    let count = move |transport: &str, dir: &str| {
        metric_value(
            &page,
            &format!(
                "moongate_kv_transfers_total{{transport=\"{transport}\",direction=\"{dir}\"}}"
            ),
        )
    };
    (m, count)
}

fn enc(key: &str) -> String {
    format!("/v1/kv/{}", key.replace('/', "%2F"))
}

#[test]
fn two_moongates_move_values_over_quic_and_fall_back_to_tcp() {
    let master = Master::start();
    let (b, _b_kv) = kv_moongate(
        &master,
        "segment_bytes = 67108864\nquic_listen = \"127.0.0.1:0\"\n",
    );
    let name = wait_segment_mounted(&b);
    assert!(b.proc.log_text().contains("own segment served over QUIC"));
    let dir = tempdir();
    let sock = dir.path().join("kv.sock");
    let (a, a_kv) = kv_moongate(&master, &format!("unix_path = \"{}\"\n", sock.display()));
    let logs = [&master.proc, &a.proc, &b.proc];
    let all = || {
        logs.iter()
            .map(|p| p.log_text())
            .collect::<Vec<_>>()
            .join("\n")
    };

    // A -> B over QUIC (B's segment is the only one)
    for (key, size) in [("own/small", 5000), ("own/big", (3 << 20) + 7)] {
        let (st, m) = http(&a_kv, "PUT", &enc(key), &value_of(key, size)).unwrap();
        assert_eq!(st, 201, "{m}\n{}", all());
    }
    let (st, body) = http_bytes(&a_kv, "GET", &enc("own/big"), &[]).unwrap();
    assert!(
        st == 200 && body == value_of("own/big", (3 << 20) + 7),
        "{st}"
    );

    // An unmodified client with no memory reads and writes B's segment over TE-TCP.
    let r = run_role("guest", &master.rpc, &master.metadata, &[], &logs);
    let get = |n: &str| result(&r, n).clone();
    assert_eq!(get("get own/small")["ok"], true, "{r}");
    assert_eq!(get("get own/big")["ok"], true, "{r}");
    assert_eq!(get("put py/big"), 0, "{r}");
    // ... and A reads what it wrote, over QUIC.
    let (st, body) = http_bytes(&a_kv, "GET", &enc("py/big"), &[]).unwrap();
    assert!(
        st == 200 && body == value_of("py/big", (5 << 20) + 1),
        "{st}"
    );

    let (m, t) = transfers(&a);
    assert_eq!((t("quic", "write"), t("quic", "read")), (2.0, 2.0), "{m}");
    assert_eq!((t("tcp", "write"), t("tcp", "read")), (0.0, 0.0), "{m}");

    // A's shared-memory path: B's value read over QUIC straight into an engine's memfd.
    {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::FileExt;
        let len = 8u64 << 20;
        let fd = crate::kv_shm::memfd(len, true);
        let mut c = moongate_kv::shm::ShmConn::connect(sock.to_str().unwrap()).unwrap();
        let region = c.region(fd.as_raw_fd(), len as usize).unwrap();
        let big = (3 << 20) + 7;
        assert_eq!(
            c.get_into(region, 4096, 4 << 20, "own/big").unwrap(),
            big as u64
        );
        let mut got = vec![0u8; big];
        std::fs::File::from(fd)
            .read_exact_at(&mut got, 4096)
            .unwrap();
        assert!(
            got == value_of("own/big", big),
            "the bytes read over QUIC into the memfd differ"
        );
    }
    let (m, t) = transfers(&a);
    assert_eq!((t("quic", "read"), t("tcp", "read")), (3.0, 0.0), "{m}");
    assert!(
        a.proc
            .log_text()
            .contains("quic connection to a peer moongate")
    );

    // C does not trust B's QUIC identity (a forged fingerprint in the metadata server):
    // it falls back to TE-TCP and still reads bit-exact.
    let md = master
        .metadata
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap()
        .to_string();
    let quic_key = format!(
        "/metadata?key=moongate%2Fquic%2F{}",
        name.replace(':', "%3A")
    );
    let (_, entry) = http_get(&md, &quic_key).unwrap();
    let forged = entry.replace(
        &entry[entry.find("\"sha256\":\"").unwrap() + 10..][..64],
        &"0".repeat(64),
    );
    let (st, _) = http(&md, "PUT", &quic_key, forged.as_bytes()).unwrap();
    assert_eq!(st, 200);
    let (c, c_kv) = kv_moongate(&master, "");
    let (st, body) = http_bytes(&c_kv, "GET", &enc("own/small"), &[]).unwrap();
    assert!(
        st == 200 && body == value_of("own/small", 5000),
        "{st}\n{}",
        c.proc.log_text()
    );
    let mc = c.metrics();
    assert_eq!(
        metric_value(
            &mc,
            "moongate_kv_transfers_total{transport=\"tcp\",direction=\"read\"}"
        ),
        1.0,
        "{mc}"
    );
    assert!(c.proc.log_text().contains("falling back to TE-TCP"));
}

/// The SHA-256 a moongate logged for its kv API over QUIC, and the bound address.
pub(crate) fn api_quic_of(mg: &Moongate) -> (std::net::SocketAddr, [u8; 32]) {
    wait_for(
        "kv API over QUIC",
        std::time::Duration::from_secs(10),
        &[&mg.proc],
        || mg.proc.log_text().contains("kv API served over QUIC"),
    );
    let log = mg.proc.log_text();
    let line = log
        .lines()
        .find(|l| l.contains("kv API served over QUIC"))
        .unwrap();
    let field = |name: &str| {
        line.split(&format!("{name}="))
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .unwrap_or_else(|| panic!("{name} in {line}"))
            .to_string()
    };
    let mut sha = [0u8; 32];
    let hex = field("sha256");
    for (i, b) in sha.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
    }
    (field("quic").parse().unwrap(), sha)
}

/// A CA, and a client certificate it issued (PEM files in `dir`), plus one from a CA
/// the server does not know.
fn client_certs(
    dir: &std::path::Path,
) -> (
    std::path::PathBuf,
    moongate::kv::api::quic::ClientCert,
    moongate::kv::api::quic::ClientCert,
) {
    use rcgen::{BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, KeyPair};
    let issue = |ca: &rcgen::Certificate, ca_key: &KeyPair| {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(vec!["engine-7".to_string()]).unwrap();
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let cert = p.signed_by(&key, ca, ca_key).unwrap();
        moongate::kv::api::quic::ClientCert {
            certs: vec![cert.der().clone()],
            key: rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        }
    };
    let make_ca = || {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(vec!["fleet-ca".to_string()]).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        (p.self_signed(&key).unwrap(), key)
    };
    let (ca, ca_key) = make_ca();
    let (other, other_key) = make_ca();
    let path = dir.join("clients-ca.pem");
    std::fs::write(&path, ca.pem()).unwrap();
    (path, issue(&ca, &ca_key), issue(&other, &other_key))
}

/// A remote caller uses the kv API over QUIC: the same endpoints and statuses as on
/// TCP, many requests in parallel on one connection; with a client CA configured, only
/// callers holding a certificate it issued get in; garbage datagrams and a broken
/// stream leave the endpoint serving.
#[test]
fn the_kv_api_is_served_over_quic_to_remote_callers() {
    use bytes::Bytes;
    use moongate::kv::api::quic::ApiClient;
    use std::time::Duration;
    let master = Master::start();
    let dir = tempdir();
    let (ca, good, stranger) = client_certs(dir.path());
    let (mg, kv) = kv_moongate(
        &master,
        &format!(
            "segment_bytes = 33554432\napi_quic_listen = \"127.0.0.1:0\"\n\
             api_quic_client_ca = \"{}\"\n",
            ca.display()
        ),
    );
    wait_segment_mounted(&mg);
    let (addr, sha) = api_quic_of(&mg);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let t = Duration::from_secs(10);
    rt.block_on(async {
        // Without a certificate, or with one from another CA: refused at the handshake
        // (or on the first request, as TLS 1.3 reports client-auth failures late).
        for cert in [None, Some(stranger)] {
            let refused = match ApiClient::connect(addr, sha, cert, t).await {
                Err(_) => true,
                Ok(c) => c.request("GET", "/v1/kv/x", Bytes::new()).await.is_err(),
            };
            assert!(refused, "{}", mg.proc.log_text());
        }
        // A wrong pin: the caller refuses the server.
        assert!(ApiClient::connect(addr, [0u8; 32], None, t).await.is_err());

        let c = ApiClient::connect(addr, sha, Some(good), t).await.unwrap();
        let big = Bytes::from(value_of("remote/big", (3 << 20) + 3));
        let (st, b) = c
            .request("PUT", "/v1/kv/remote%2Fbig", big.clone())
            .await
            .unwrap();
        assert_eq!(st, 201, "{b:?}");
        // 32 puts on 32 streams at once over the one connection.
        let puts = (0..32).map(|i| {
            let c = &c;
            async move {
                let key = format!("remote/{i}");
                c.request(
                    "PUT",
                    &format!("/v1/kv/remote%2F{i}"),
                    Bytes::from(value_of(&key, 10_000)),
                )
                .await
                .map(|r| r.0)
            }
        });
        let sts = futures_util::future::join_all(puts).await;
        assert!(sts.iter().all(|s| matches!(s, Ok(201))), "{sts:?}");
        let (st, b) = c
            .request("GET", "/v1/kv/remote%2Fbig", Bytes::new())
            .await
            .unwrap();
        assert!(st == 200 && b == big, "{st}");
        let (st, b) = c
            .request(
                "POST",
                "/v1/kv/exists",
                Bytes::from_static(br#"["remote/7","nope"]"#),
            )
            .await
            .unwrap();
        assert_eq!((st, &b[..]), (200, &b"[true,false]"[..]));
        let (st, _) = c.request("GET", "/v1/kv/nope", Bytes::new()).await.unwrap();
        assert_eq!(st, 404);

        // Garbage on the UDP port, and a stream that carries no HTTP.
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        for n in [1usize, 20, 1200] {
            udp.send_to(&vec![0xAB; n], addr).unwrap();
        }
        let (mut send, mut recv) = c.connection().open_bi().await.unwrap();
        send.write_all(b"\x00\x01 not http\r\n\r\n").await.unwrap();
        send.finish().unwrap();
        let raw = recv
            .read_to_end(1 << 16)
            .await
            .expect("the stream is answered and finished");
        assert!(raw.starts_with(b"HTTP/1.1 400"), "{raw:?}");
        let (st, _) = c
            .request("GET", "/v1/kv/remote%2F3", Bytes::new())
            .await
            .unwrap();
        assert_eq!(st, 200);
    });
    // The loopback listener sees the same objects.
    let (st, body) = http_bytes(&kv, "GET", "/v1/kv/remote%2F31", &[]).unwrap();
    assert!(st == 200 && body == value_of("remote/31", 10_000));
    assert!(service_ready(&mg.listen));
}

/// A fleet CA (PEM file in `dir`) and a node certificate it issued for `name` (server
/// and client use), as `(ca, cert, key)` paths; `other_ca` issues from an unrelated CA.
fn node_cert(
    dir: &std::path::Path,
    name: &str,
    other_ca: bool,
) -> (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf) {
    use rcgen::{BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, KeyPair};
    let ca_file = if other_ca { "other-ca" } else { "fleet-ca" };
    let ca_key_path = dir.join(format!("{ca_file}.key"));
    let ca_path = dir.join(format!("{ca_file}.pem"));
    let ca_key = if ca_key_path.exists() {
        KeyPair::from_pem(&std::fs::read_to_string(&ca_key_path).unwrap()).unwrap()
    } else {
        KeyPair::generate().unwrap()
    };
    let mut p = CertificateParams::new(vec![ca_file.to_string()]).unwrap();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    // Same key and parameters: the same CA each time it is made here.
    let ca = p.self_signed(&ca_key).unwrap();
    if !ca_path.exists() {
        std::fs::write(&ca_path, ca.pem()).unwrap();
        std::fs::write(&ca_key_path, ca_key.serialize_pem()).unwrap();
    }
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(vec!["moongate".to_string()]).unwrap();
    p.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let cert = p.signed_by(&key, &ca, &ca_key).unwrap();
    let (c, k) = (
        dir.join(format!("{name}.pem")),
        dir.join(format!("{name}.key")),
    );
    std::fs::write(&c, cert.pem()).unwrap();
    std::fs::write(&k, key.serialize_pem()).unwrap();
    (ca_path, c, k)
}

/// With `kv.quic_client_ca`, the own segment's QUIC endpoint admits only moongates
/// holding a certificate from that CA; with `kv.segment_tcp = false` the segment is not
/// reachable any other way: a moongate without such a certificate cannot read it at all.
#[test]
fn the_quic_segment_admits_only_fleet_certificates_and_can_be_quic_only() {
    let master = Master::start();
    let dir = tempdir();
    let quic_cfg = |name: &str, other: bool| {
        let (ca, cert, key) = node_cert(dir.path(), name, other);
        format!(
            "quic_cert = \"{}\"\nquic_key = \"{}\"\nquic_client_ca = \"{}\"\n",
            cert.display(),
            key.display(),
            ca.display()
        )
    };
    let (b, _b_kv) = kv_moongate(
        &master,
        &format!(
            "segment_bytes = 16777216\nquic_listen = \"127.0.0.1:0\"\nsegment_tcp = false\n{}",
            quic_cfg("b", false)
        ),
    );
    wait_segment_mounted(&b);
    assert!(b.proc.log_text().contains("served over QUIC only"));
    let (a, a_kv) = kv_moongate(&master, &quic_cfg("a", false));
    let logs = [&master.proc, &a.proc, &b.proc];
    let v = value_of("fleet/x", 70_000);
    let (st, m) = http(&a_kv, "PUT", &enc("fleet/x"), &v).unwrap();
    assert_eq!(st, 201, "{m}\n{}", logs.map(|p| p.log_text()).join("\n"));
    let (st, body) = http_bytes(&a_kv, "GET", &enc("fleet/x"), &[]).unwrap();
    assert!(st == 200 && body == v, "{st}");
    let quic = |mg: &Moongate, dir: &str| {
        mg.metric(&format!(
            "moongate_kv_transfers_total{{transport=\"quic\",direction=\"{dir}\"}}"
        ))
    };
    assert_eq!((quic(&a, "write"), quic(&a, "read")), (1.0, 1.0));

    // Without a certificate, or with one from another CA: the handshake is refused, the
    // TE-TCP fallback is refused too (QUIC only), and nothing is read.
    for (name, extra) in [
        ("no certificate", String::new()),
        ("another CA", quic_cfg("d", true)),
    ] {
        let (c, c_kv) = kv_moongate(&master, &extra);
        let (st, body) = http_bytes(&c_kv, "GET", &enc("fleet/x"), &[]).unwrap();
        assert!(
            st >= 500 && body != v,
            "{name}: {st}\n{}",
            c.proc.log_text()
        );
        assert_eq!(quic(&c, "read"), 0.0, "{name}");
        assert!(
            c.proc.log_text().contains("falling back to TE-TCP"),
            "{name}: {}",
            c.proc.log_text()
        );
    }
    assert!(b.metric("moongate_kv_connections_refused_total{listener=\"segment_tcp\"}") >= 2.0);
    // The fleet member still reads.
    let (st, body) = http_bytes(&a_kv, "GET", &enc("fleet/x"), &[]).unwrap();
    assert!(st == 200 && body == v, "{st}");
}

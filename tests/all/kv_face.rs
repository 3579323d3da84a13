//! The kv face against the real master and a real Python client that owns the only
//! segment: values cross both ways bit-exact over the transfer engine's TCP path, and
//! bad input on the kv listener gets a clear answer while everyone else carries on.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use crate::support::*;

#[test]
fn values_cross_between_the_python_client_and_the_kv_face_bit_exact() {
    values_cross("", 0.0);
}

/// The same with large values moved as stripes over several TE-TCP connections to the
/// real owner: py/big (3 MiB + 7) read as four stripes of 1 MiB, kv/big written so.
#[test]
fn values_cross_bit_exact_in_stripes_over_several_connections() {
    values_cross("te_stripe_bytes = 1048576\n", 1.0);
}

/// Values put by Mooncake's Python client read through the kv face and back; `extra`
/// adds `[kv]` keys; `striped`: the GETs and PUTs moved as stripes, each way.
fn values_cross(extra: &str, striped: f64) {
    // Leases long enough that no step outlives one on a busy machine: the cached
    // replica list of py/big (half the lease) must still be held when the peer leaves,
    // and the lease of py/small when the removal below is refused.
    let master = Master::start_with(MasterOpts {
        extra: vec!["--default_kv_lease_ttl=120000".into()],
        ..Default::default()
    });
    let (mg, kv) = kv_moongate(&master, &format!("replica_cache_ms = 60000\n{extra}"));
    let logs = [&master.proc, &mg.proc];
    let mut peer = Background::start("kvpeer", &master.rpc, &master.metadata, &logs);
    let log = || format!("{}\n{}", mg.proc.log_text(), peer_log(&peer.proc));

    // Python put -> moongate get
    let (st, body) = http_bytes(&kv, "GET", "/v1/kv/py%2Fsmall", &[]).unwrap();
    assert_eq!(st, 200, "{}\n{}", String::from_utf8_lossy(&body), log());
    assert!(body == value_of("py/small", 5000), "py/small differs");
    let (st, body) = http_bytes(&kv, "GET", "/v1/kv/py%2Fbig", &[]).unwrap();
    assert_eq!(st, 200);
    assert!(body == value_of("py/big", (3 << 20) + 7), "py/big differs");
    // Read again within the lease: the replica list is reused, no master call.
    let (st, body) = http_bytes(&kv, "GET", "/v1/kv/py%2Fsmall", &[]).unwrap();
    assert!(st == 200 && body == value_of("py/small", 5000));
    let cache = |r: &str| {
        metric_value(
            &mg.metrics(),
            &format!("moongate_kv_replica_cache_total{{result=\"{r}\"}}"),
        )
    };
    assert_eq!((cache("hit"), cache("miss")), (1.0, 2.0));
    // The same two in one batch (one BatchGetReplicaList, reads over TE-TCP).
    let (st, body) = http_bytes(
        &kv,
        "POST",
        "/v1/kv/batch/get",
        br#"["py/big", "nope", "py/small"]"#,
    )
    .unwrap();
    assert_eq!(st, 200);
    let recs = get_records(&body);
    assert_eq!(
        recs.iter().map(|r| r.0).collect::<Vec<_>>(),
        [200, 404, 200]
    );
    assert!(
        recs[0].1 == value_of("py/big", (3 << 20) + 7),
        "batch py/big differs"
    );
    assert!(
        recs[2].1 == value_of("py/small", 5000),
        "batch py/small differs"
    );

    // moongate put -> Python get (after the peer is told to read)
    let (st, b) = http(&kv, "PUT", "/v1/kv/kv%2Fsmall", &value_of("kv/small", 5000)).unwrap();
    assert_eq!(st, 201, "{b}\n{}", log());
    let (st, _) = http(
        &kv,
        "PUT",
        "/v1/kv/kv%2Fbig",
        &value_of("kv/big", (3 << 20) + 7),
    )
    .unwrap();
    assert_eq!(st, 201);
    let (st, b) = http(
        &kv,
        "POST",
        "/v1/kv/exists",
        br#"["py/small", "kv/big", "nope"]"#,
    )
    .unwrap();
    assert_eq!((st, b.as_str()), (200, "[true,true,false]"));
    // Our GET leased py/small for the master's lease period: a removal must wait.
    let (st, b) = http(&kv, "DELETE", "/v1/kv/py%2Fsmall", &[]).unwrap();
    assert_eq!(st, 409, "{b}");
    let (st, _) = http(&kv, "PUT", "/v1/kv/kv%2Ftmp", b"short-lived").unwrap();
    assert_eq!(st, 201);
    let (st, _) = http(&kv, "DELETE", "/v1/kv/kv%2Ftmp", &[]).unwrap();
    assert_eq!(st, 204);
    let (st, _) = http(&kv, "GET", "/v1/kv/kv%2Ftmp", &[]).unwrap();
    assert_eq!(st, 404);
    let (st, _) = http(&kv, "DELETE", "/v1/kv/kv%2Ftmp", &[]).unwrap();
    assert_eq!(st, 404);

    peer.tell();
    let r = peer.finish();
    for name in ["get kv/small", "get kv/big"] {
        assert_eq!(result(&r, name)["ok"], true, "{name}: {r}");
    }
    // The owner unmounted: its objects are gone with its segment.
    let (st, _) = http(&kv, "GET", "/v1/kv/kv%2Fsmall", &[]).unwrap();
    assert_eq!(st, 404);
    // ... including one whose replica list is still cached: the read through it fails,
    // the master is asked again and says absent.
    let (st, _) = http(&kv, "GET", "/v1/kv/py%2Fbig", &[]).unwrap();
    assert_eq!(st, 404, "{}", mg.proc.log_text());
    assert_eq!(cache("stale"), 1.0);
    // Each way once: py/big's first GET (the second is in the batch, a whole read) and
    // kv/big's PUT.
    for dir in ["read", "write"] {
        let n = metric_value(
            &mg.metrics(),
            &format!(
                "moongate_kv_striped_transfers_total{{transport=\"tcp\",direction=\"{dir}\"}}"
            ),
        );
        assert_eq!(n, striped, "striped {dir}s\n{}", mg.proc.log_text());
    }
}

fn peer_log(p: &Proc) -> String {
    p.log_text()
}

/// A forced removal a rank sends through this moongate's master face voids the kv
/// face's cached replica lists at once: the next GET asks the master (and finds the key
/// gone) instead of reading the memory the value was in, which the master may already
/// have handed to another put.
#[test]
fn a_forced_removal_through_the_master_face_voids_the_replica_cache() {
    let master = Master::start_with(MasterOpts {
        extra: vec!["--default_kv_lease_ttl=120000".into()],
        ..Default::default()
    });
    // A window no busy machine outlasts: only the removal may end it.
    let (mg, kv) = kv_moongate(&master, "replica_cache_ms = 60000\n");
    let logs = [&master.proc, &mg.proc];
    let args = ["--segment-mib", "16"];
    let mut rank = Background::start_args("steps", &mg.listen, &master.metadata, &args, &logs);
    let none = serde_json::json!([]);
    assert_eq!(rank.step_json("put fr/ 2 5000")["bad"], none);
    let cache = |r: &str| {
        metric_value(
            &mg.metrics(),
            &format!("moongate_kv_replica_cache_total{{result=\"{r}\"}}"),
        )
    };
    for _ in 0..2 {
        let (st, body) = http_bytes(&kv, "GET", "/v1/kv/fr%2F0", &[]).unwrap();
        assert!(
            st == 200 && body == value_of("fr/0", 5000),
            "{st}\n{}",
            mg.proc.log_text()
        );
    }
    assert_eq!((cache("hit"), cache("miss")), (1.0, 1.0));
    // A batch reads through the same cache: fr/0 from it, fr/1 asked (and cached).
    let batch = || {
        let (st, body) =
            http_bytes(&kv, "POST", "/v1/kv/batch/get", br#"["fr/0","fr/1"]"#).unwrap();
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
        get_records(&body)
    };
    let both = vec![(200, value_of("fr/0", 5000)), (200, value_of("fr/1", 5000))];
    assert!(batch() == both, "a batch read other values");
    assert_eq!((cache("hit"), cache("miss")), (2.0, 2.0));
    assert!(batch() == both, "a batch read other values");
    assert_eq!((cache("hit"), cache("miss")), (4.0, 2.0));
    // Our reads leased fr/0; a forced removal takes it anyway.
    assert_eq!(rank.step_json("forcerm fr/ 1")["bad"], none);
    let (st, _) = http_bytes(&kv, "GET", "/v1/kv/fr%2F0", &[]).unwrap();
    assert_eq!(st, 404, "read through a voided replica list");
    assert_eq!((cache("hit"), cache("miss")), (4.0, 3.0));
    // A batch too: fr/0 absent, fr/1 read as before (every list was voided: asked anew).
    let recs = batch();
    assert_eq!(recs[0].0, 404, "a batch read through a voided replica list");
    assert!(recs[1] == both[1]);
    assert_eq!((cache("hit"), cache("miss")), (4.0, 5.0));
    // The other key reads as before, from the list the batch cached anew.
    for _ in 0..2 {
        let (st, body) = http_bytes(&kv, "GET", "/v1/kv/fr%2F1", &[]).unwrap();
        assert!(st == 200 && body == value_of("fr/1", 5000));
    }
    assert_eq!((cache("hit"), cache("miss")), (6.0, 5.0));
    rank.end(Duration::from_secs(60));
}

#[test]
fn bad_input_on_the_kv_listener_gets_clear_errors_and_others_carry_on() {
    let master = Master::start();
    let (mg, kv) = kv_moongate(&master, "max_value_bytes = 1048576\n");
    // garbage instead of HTTP: that connection gets 400 or is closed
    let mut s = TcpStream::connect(&kv).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"\x00\x01\x02garbage\r\n\r\n").unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out)
        .expect("moongate answers and closes (not a read timeout)");
    assert!(
        out.starts_with(b"HTTP/1.1 400"),
        "{}",
        String::from_utf8_lossy(&out)
    );
    // truncated request, then the peer goes away
    let mut t = TcpStream::connect(&kv).unwrap();
    t.write_all(b"PUT /v1/kv/x HTTP/1.1\r\nContent-Length: 100\r\n\r\nabc")
        .unwrap();
    drop(t);
    let (st, b) = http(&kv, "POST", "/v1/kv/exists", b"{not json").unwrap();
    assert_eq!(st, 400, "{b}");
    assert!(b.contains("JSON array"), "{b}");
    let (st, b) = http(&kv, "PUT", "/v1/kv/big", &vec![7u8; (1 << 20) + 1]).unwrap();
    assert_eq!(st, 413, "{b}");
    let (st, _) = http(&kv, "GET", "/v2/other", &[]).unwrap();
    assert_eq!(st, 404);
    let (st, _) = http(&kv, "PUT", "/v1/kv/empty", &[]).unwrap();
    assert_eq!(st, 400);
    // No segment is mounted: the master has nowhere to put it.
    let (st, b) = http(&kv, "PUT", "/v1/kv/nowhere", b"abc").unwrap();
    assert_eq!(st, 507, "{b}");
    // Still serving, and the master face too.
    let (st, b) = http(&kv, "POST", "/v1/kv/exists", br#"["a"]"#).unwrap();
    assert_eq!((st, b.as_str()), (200, "[false]"));
    assert!(service_ready(&mg.listen));
}

#[test]
fn the_kv_face_needs_a_metadata_url() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_moongate"))
        .args(["run", "--kv", "127.0.0.1:1", "--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("kv.metadata_url"));
}

/// moongate's own segment: the master places puts in it, unmodified clients read from
/// and write to it over TE-TCP, the kv face reads it in place; bad requests on its
/// listener are refused per connection; on SIGTERM it unmounts and deletes its metadata.
#[test]
fn own_segment_serves_unmodified_clients_and_unregisters_on_shutdown() {
    let master = Master::start();
    let (mut mg, kv) = kv_moongate(&master, "segment_bytes = 67108864\n");
    let logs = [&master.proc, &mg.proc];
    let name = wait_segment_mounted(&mg);
    // Only moongate's segment exists: these land in it and are read back in place.
    let (st, b) = http(
        &kv,
        "PUT",
        "/v1/kv/own%2Fsmall",
        &value_of("own/small", 5000),
    )
    .unwrap();
    assert_eq!(st, 201, "{b}\n{}", mg.proc.log_text());
    let (st, _) = http(
        &kv,
        "PUT",
        "/v1/kv/own%2Fbig",
        &value_of("own/big", (3 << 20) + 7),
    )
    .unwrap();
    assert_eq!(st, 201);
    let (st, body) = http_bytes(&kv, "GET", "/v1/kv/own%2Fbig", &[]).unwrap();
    assert!(st == 200 && body == value_of("own/big", (3 << 20) + 7));

    // Bad requests on the segment listener: out of range (v2 gets status 1), garbage.
    let mut bad = TcpStream::connect(&name).unwrap();
    bad.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut h = [0u8; 24];
    h[..8].copy_from_slice(&16u64.to_le_bytes());
    h[8..16].copy_from_slice(&8u64.to_le_bytes());
    h[16] = 0x80;
    bad.write_all(&h).unwrap();
    let mut st8 = [0u8; 8];
    bad.read_exact(&mut st8).unwrap();
    assert_eq!(st8, [1, 0, 0, 0, 0x56, 0x54, 0x43, 0x4d]);
    assert_eq!(
        bad.read(&mut st8).unwrap_or(0),
        0,
        "closed after a rejection"
    );
    let mut g = TcpStream::connect(&name).unwrap();
    g.write_all(b"\xff\xff\xff\xff\xff\xff\xff\xffshort")
        .unwrap();
    drop(g);

    // An unmodified client with no memory of its own reads and writes moongate's.
    let r = run_role("guest", &mg.listen, &master.metadata, &[], &logs);
    let get = |n: &str| result(&r, n).clone();
    assert_eq!(get("get own/small")["ok"], true, "{r}");
    assert_eq!(get("get own/big")["ok"], true, "{r}");
    assert_eq!(get("put py/x"), 0, "{r}");
    assert_eq!(get("put py/big"), 0, "{r}");
    for (key, size) in [("py/x", 70000), ("py/big", (5 << 20) + 1)] {
        let (st, body) = http_bytes(
            &kv,
            "GET",
            &format!("/v1/kv/{}", key.replace('/', "%2F")),
            &[],
        )
        .unwrap();
        assert_eq!(st, 200, "{key}");
        assert!(body == value_of(key, size), "{key} differs");
    }

    // SIGTERM: unmount, metadata gone, exit 0.
    let md_key = format!(
        "/metadata?key=mooncake%2Fram%2F{}",
        name.replace(':', "%3A")
    );
    let http_md = master
        .metadata
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap()
        .to_string();
    assert_eq!(http_get(&http_md, &md_key).map(|r| r.0), Some(200));
    mg.proc.signal(libc::SIGTERM);
    let st = mg
        .proc
        .wait_exit(Duration::from_secs(20))
        .expect("moongate exits");
    assert!(st.success(), "{}", mg.proc.log_text());
    assert!(
        mg.proc
            .log_text()
            .contains("segment unmounted, metadata deleted")
    );
    assert_eq!(http_get(&http_md, &md_key).map(|r| r.0), Some(404));
}

/// kv puts go through the same policy host as the master face: a deny rule answers
/// 507 (NO_AVAILABLE_HANDLE) without a PutStart reaching the master.
#[test]
fn kv_puts_are_decided_by_the_active_policy() {
    let master = Master::start();
    let plugin = plugin_path("tier-placement");
    let (mg, kv) = kv_moongate(
        &master,
        &format!(
            "segment_bytes = 16777216\n[policy]\nactive = \"tp\"\n[[policy.plugins]]\nname = \"tp\"\n\
             path = \"{}\"\nconfig = '''{{\"rules\": [{{\"key_prefix\": \"deny/\", \"deny\": -200}}]}}'''\n",
            plugin.display()
        ),
    );
    wait_segment_mounted(&mg);
    let (st, b) = http(&kv, "PUT", "/v1/kv/deny%2Fx", b"value").unwrap();
    assert_eq!(st, 507, "{b}");
    let (st, b) = http(&kv, "PUT", "/v1/kv/ok%2Fx", b"value").unwrap();
    assert_eq!(st, 201, "{b}");
    let (st, body) = http_bytes(&kv, "GET", "/v1/kv/ok%2Fx", &[]).unwrap();
    assert_eq!((st, body.as_slice()), (200, &b"value"[..]));
    // A batch: the plugin denies one key, the others are stored, outcomes in order.
    let batch = put_records(&[
        ("ok/b1", b"one".to_vec()),
        ("deny/b2", b"two".to_vec()),
        ("ok/b3", b"three".to_vec()),
    ]);
    let (st, b) = http(&kv, "POST", "/v1/kv/batch/put", &batch).unwrap();
    assert_eq!((st, statuses(&b)), (200, vec![201, 507, 201]), "{b}");
    let m = mg.metrics();
    assert_eq!(
        metric_value(
            &m,
            "moongate_kv_transfers_total{transport=\"local\",direction=\"write\"}"
        ),
        3.0,
        "{m}"
    );
    assert_eq!(
        metric_value(&m, "moongate_kv_requests_total{op=\"put\",status=\"5xx\"}"),
        1.0
    );
    assert!(
        m.lines()
            .any(|l| l.starts_with("moongate_policy_decisions_total")
                && l.contains("decision=\"deny_all\"")
                && l.ends_with(" 1")),
        "{m}"
    );
}

/// A sidecar may start before the master: the own segment is mounted once it is up.
#[test]
fn the_own_segment_mounts_when_the_master_comes_up_later() {
    let (rpc, http_port) = (free_port(), free_port());
    let kv = format!("127.0.0.1:{}", free_port());
    let mg = Moongate::start_config(&format!(
        "[master_face]\nupstream = \"127.0.0.1:{rpc}\"\n[kv]\nlisten = \"{kv}\"\n\
         metadata_url = \"http://127.0.0.1:{http_port}/metadata\"\nsegment_bytes = 16777216\n"
    ));
    wait_for(
        "a mount retry",
        Duration::from_secs(10),
        &[&mg.proc],
        || {
            mg.proc
                .log_text()
                .contains("cannot mount the own segment yet")
        },
    );
    let _master = Master::start_with(MasterOpts {
        ports: Some((rpc, http_port)),
        ..Default::default()
    });
    wait_segment_mounted(&mg);
    let (st, b) = http(&kv, "PUT", "/v1/kv/late", b"value").unwrap();
    assert_eq!(st, 201, "{b}");
}

/// The shipped Python example drives the kv face over its Unix socket: a 1 MiB round
/// trip, exists, an absent key, delete.
#[test]
fn the_python_example_works_over_the_unix_socket() {
    let master = Master::start();
    let dir = tempdir();
    let (mg, _kv, sock) = kv_unix_moongate(&master, dir.path(), 16777216, "");
    let out = std::process::Command::new(python())
        .arg(repo_root().join("examples/python/kv_client.py"))
        .arg("--unix")
        .arg(&sock)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        mg.proc.log_text()
    );
    let r: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
    assert_eq!(r["roundtrip_ok"], true, "{r}");
    assert_eq!(r["absent_get"], serde_json::Value::Null);
    assert_eq!(
        (r["deleted"].clone(), r["after_delete"].clone()),
        (true.into(), serde_json::Value::Null)
    );
    assert_eq!(r["batch_ok"], true, "{r}");
    assert_eq!(r["batch_put"], serde_json::json!([null, 409]), "{r}");
    drop(mg);
}

/// The Rust client crate (clients/rust) over TCP and over the Unix socket.
#[test]
fn the_rust_client_crate_round_trips() {
    let master = Master::start();
    let dir = tempdir();
    let (_mg, kv, sock) = kv_unix_moongate(&master, dir.path(), 16777216, "");
    let mut tcp = moongate_kv::Client::connect_tcp(&kv).unwrap();
    let mut unix = moongate_kv::Client::connect_unix(&sock).unwrap();
    let big = value_of("rust/big", (2 << 20) + 5);
    tcp.put("rust/big", &big).unwrap();
    unix.put("rust/\"odd\" key", b"x").unwrap();
    assert_eq!(unix.get("rust/big").unwrap().as_deref(), Some(&big[..]));
    assert_eq!(
        tcp.exists(&["rust/big", "rust/\"odd\" key", "nope"])
            .unwrap(),
        [true, true, false]
    );
    assert_eq!(tcp.get("nope").unwrap(), None);
    assert!(!unix.delete("nope").unwrap());
    match tcp.put("rust/empty", b"") {
        Err(moongate_kv::Error::Status {
            status: 400,
            reason,
        }) => {
            assert!(reason.contains("empty"), "{reason}")
        }
        other => panic!("expected 400, got {other:?}"),
    }
    // keep-alive: the same connection keeps working after an error answer
    assert_eq!(
        tcp.get("rust/big").unwrap().map(|v| v.len()),
        Some(big.len())
    );
    // batches, on the same keep-alive connections (the get answer is chunked)
    let put = unix
        .batch_put(&[
            ("rust/b1", b"one"),
            ("rust/big", b"dup"),
            ("rust/b2", b"two"),
        ])
        .unwrap();
    assert!(put[0].is_ok() && put[2].is_ok(), "{put:?}");
    assert!(
        matches!(&put[1], Err(moongate_kv::Error::Status { status: 409, .. })),
        "{put:?}"
    );
    let got = tcp.batch_get(&["rust/b2", "nope", "rust/big"]).unwrap();
    assert_eq!(got[0].as_ref().unwrap().as_deref(), Some(&b"two"[..]));
    assert_eq!(got[1].as_ref().unwrap(), &None);
    assert_eq!(got[2].as_ref().unwrap().as_deref(), Some(&big[..]));
    assert_eq!(tcp.exists(&["rust/b1"]).unwrap(), [true]);

    // HTTP/2 (prior knowledge) on the same listeners: many requests at once on one
    // connection, over TCP and over the Unix socket.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let tcp = tokio::net::TcpStream::connect(&kv).await.unwrap();
        h2_round_trips(tcp, "h2tcp", &big).await;
        let unix = tokio::net::UnixStream::connect(&sock).await.unwrap();
        h2_round_trips(unix, "h2unix", &big).await;
    });
}

/// 20 PUTs and then 20 GETs in parallel on one HTTP/2 connection, plus a 2 MiB GET.
async fn h2_round_trips<S>(io: S, prefix: &str, big: &[u8])
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    let (sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(io),
    )
    .await
    .expect("h2 handshake");
    tokio::spawn(conn);
    let call = |method: &str, key: String, body: Vec<u8>| {
        let mut sender = sender.clone();
        let req = hyper::Request::builder()
            .method(method)
            .uri(format!("http://moongate/v1/kv/{key}"))
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        async move {
            let resp = sender.send_request(req).await.expect("h2 request");
            assert_eq!(resp.version(), hyper::Version::HTTP_2);
            let status = resp.status().as_u16();
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            (status, body)
        }
    };
    let keys: Vec<String> = (0..20).map(|i| format!("{prefix}%2F{i}")).collect();
    let puts = keys
        .iter()
        .map(|k| call("PUT", k.clone(), value_of(&k.replace("%2F", "/"), 30_000)));
    for (st, b) in futures_util::future::join_all(puts).await {
        assert_eq!(st, 201, "{b:?}");
    }
    let gets = keys.iter().map(|k| call("GET", k.clone(), Vec::new()));
    for (k, (st, b)) in keys.iter().zip(futures_util::future::join_all(gets).await) {
        assert!(
            st == 200 && b[..] == value_of(&k.replace("%2F", "/"), 30_000)[..],
            "{k}"
        );
    }
    let (st, b) = call("GET", "rust%2Fbig".into(), Vec::new()).await;
    assert!(st == 200 && b[..] == big[..]);
}

/// A batch put body: `u16 key_len | key | u64 value_len | value` per record (LE).
fn put_records(items: &[(&str, Vec<u8>)]) -> Vec<u8> {
    let mut b = Vec::new();
    for (k, v) in items {
        b.extend_from_slice(&(k.len() as u16).to_le_bytes());
        b.extend_from_slice(k.as_bytes());
        b.extend_from_slice(&(v.len() as u64).to_le_bytes());
        b.extend_from_slice(v);
    }
    b
}

/// A batch get answer: `u16 status | u64 len | payload` per key (LE).
fn get_records(mut b: &[u8]) -> Vec<(u16, Vec<u8>)> {
    let mut out = Vec::new();
    while !b.is_empty() {
        assert!(b.len() >= 10, "a cut record head: {b:?}");
        let status = u16::from_le_bytes([b[0], b[1]]);
        let len = u64::from_le_bytes(b[2..10].try_into().unwrap()) as usize;
        out.push((status, b[10..10 + len].to_vec()));
        b = &b[10 + len..];
    }
    out
}

fn statuses(json: &str) -> Vec<u64> {
    let v: serde_json::Value = serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {json}"));
    let arr = v.as_array().or_else(|| v["results"].as_array()).unwrap();
    arr.iter().map(|o| o["status"].as_u64().unwrap()).collect()
}

/// Batch get and put carry many keys per call, cut into parts under the byte budget;
/// a caller that holds the whole budget makes the others get a clear 503 (never a
/// queue), and once it goes away everyone carries on. Malformed batch bodies get 400
/// with the outcomes of the records before the break.
#[test]
fn batch_calls_move_many_keys_in_parts_with_backpressure() {
    let master = Master::start();
    let (mg, kv) = kv_moongate(
        &master,
        "segment_bytes = 67108864\nbatch_part_bytes = 1048576\nmax_inflight_bytes = 4194304\n\
         busy_wait_ms = 300\nmax_value_bytes = 4194304\nmax_batch_keys = 100\n",
    );
    wait_segment_mounted(&mg);
    let log = || mg.proc.log_text();

    // 40 values of 100 KiB (about 4 parts), an empty one, an oversize one, a repeat.
    let names: Vec<String> = (0..40).map(|i| format!("batch/{i}")).collect();
    let mut items: Vec<(&str, Vec<u8>)> = names
        .iter()
        .map(|n| (n.as_str(), value_of(n, 100 << 10)))
        .collect();
    items.push(("batch/empty", Vec::new()));
    items.push(("batch/huge", vec![1u8; (4 << 20) + 1]));
    items.push(("batch/0", b"again".to_vec()));
    let (st, b) = http(&kv, "POST", "/v1/kv/batch/put", &put_records(&items)).unwrap();
    assert_eq!(st, 200, "{b}\n{}", log());
    let got = statuses(&b);
    assert_eq!(&got[..40], &[201; 40][..], "{b}");
    assert_eq!(&got[40..], &[400, 413, 409], "{b}");

    // The same key twice in one part: the first is stored, the second refused.
    let (st, b) = http(
        &kv,
        "POST",
        "/v1/kv/batch/put",
        &put_records(&[("dup/a", b"one".to_vec()), ("dup/a", b"two".to_vec())]),
    )
    .unwrap();
    assert_eq!((st, statuses(&b)), (200, vec![201, 409]), "{b}");
    let (st, body) = http_bytes(&kv, "GET", "/v1/kv/dup%2Fa", &[]).unwrap();
    assert_eq!((st, body.as_slice()), (200, &b"one"[..]));

    let mut ask: Vec<String> = names.clone();
    ask.push("batch/missing".into());
    let (st, body) = http_bytes(
        &kv,
        "POST",
        "/v1/kv/batch/get",
        serde_json::to_string(&ask).unwrap().as_bytes(),
    )
    .unwrap();
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    let recs = get_records(&body);
    assert_eq!(recs.len(), 41);
    for (n, (s, v)) in names.iter().zip(&recs) {
        assert_eq!(*s, 200, "{n}: {}", String::from_utf8_lossy(v));
        assert!(*v == value_of(n, 100 << 10), "{n} differs");
    }
    assert_eq!(recs[40].0, 404);
    let m = mg.metrics();
    // 1 MiB parts of ten 100 KiB values: the put's 40 (+ the 5-byte repeat) in 4, the
    // two-record put in 1, the get's 40 (+ the missing key) in 4.
    assert_eq!(
        metric_value(&m, "moongate_kv_batch_parts_total"),
        9.0,
        "{m}"
    );
    assert_eq!(
        metric_value(
            &m,
            "moongate_kv_requests_total{op=\"batch_get\",status=\"2xx\"}"
        ),
        1.0
    );

    // A slow caller announces a 4 MiB value and sends part of it: its reservation holds
    // the whole budget, so others are answered busy instead of waiting in a queue.
    let mut slow = TcpStream::connect(&kv).unwrap();
    let mut head = Vec::new();
    head.extend_from_slice(&5u16.to_le_bytes());
    head.extend_from_slice(b"slowk");
    head.extend_from_slice(&(4u64 << 20).to_le_bytes());
    write!(
        slow,
        "POST /v1/kv/batch/put HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n",
        head.len() + (4 << 20)
    )
    .unwrap();
    slow.write_all(&head).unwrap();
    slow.write_all(&[9u8; 1000]).unwrap();
    wait_for(
        "the slow put holds the budget",
        Duration::from_secs(10),
        &[&mg.proc],
        || metric_value(&mg.metrics(), "moongate_kv_inflight_bytes") >= (4 << 20) as f64,
    );
    // Even the batch get's key list is read under the budget: the whole call is busy.
    let (st, body) =
        http_bytes(&kv, "POST", "/v1/kv/batch/get", br#"["batch/1","batch/2"]"#).unwrap();
    assert_eq!(st, 503);
    assert!(
        String::from_utf8_lossy(&body).contains("busy"),
        "{}",
        String::from_utf8_lossy(&body)
    );
    let (st, b) = http(
        &kv,
        "POST",
        "/v1/kv/batch/put",
        &put_records(&[("batch/late", vec![3u8; 10])]),
    )
    .unwrap();
    assert_eq!((st, statuses(&b)), (200, vec![503]), "{b}");
    let (st, b) = http(&kv, "PUT", "/v1/kv/single", b"v").unwrap();
    assert_eq!(st, 503, "{b}");
    // One per refused request: the batch get's part, the batch put's record, the PUT.
    assert_eq!(metric_value(&mg.metrics(), "moongate_kv_busy_total"), 3.0);
    // The slow caller goes away: its bytes are given back, nothing of it was stored.
    drop(slow);
    wait_for(
        "the budget is free again",
        Duration::from_secs(10),
        &[&mg.proc],
        || metric_value(&mg.metrics(), "moongate_kv_inflight_bytes") == 0.0,
    );
    let (st, b) = http(
        &kv,
        "POST",
        "/v1/kv/batch/put",
        &put_records(&[("batch/late", vec![3u8; 10])]),
    )
    .unwrap();
    assert_eq!((st, statuses(&b)), (200, vec![201]), "{b}");
    let (st, b) = http(&kv, "POST", "/v1/kv/exists", br#"["slowk","batch/late"]"#).unwrap();
    assert_eq!((st, b.as_str()), (200, "[false,true]"));

    // Malformed bodies: the records before the break are handled and reported.
    let mut broken = put_records(&[("batch/before", b"x".to_vec())]);
    broken.extend_from_slice(&[0, 0, 1, 0, 0, 0, 0, 0, 0, 0]); // an empty key
    let (st, b) = http(&kv, "POST", "/v1/kv/batch/put", &broken).unwrap();
    assert_eq!(st, 400, "{b}");
    assert!(b.contains("empty key"), "{b}");
    assert_eq!(statuses(&b), vec![201]);
    let mut cut = put_records(&[("batch/cut", vec![5u8; 100])]);
    cut.truncate(50);
    let (st, b) = http(&kv, "POST", "/v1/kv/batch/put", &cut).unwrap();
    assert_eq!(st, 400, "{b}");
    assert!(b.contains("ended inside a record"), "{b}");
    let (st, b) = http(&kv, "POST", "/v1/kv/batch/get", b"[1, 2]").unwrap();
    assert_eq!(st, 400, "{b}");
    let many: Vec<String> = (0..101).map(|i| format!("k{i}")).collect();
    let (st, _) = http(
        &kv,
        "POST",
        "/v1/kv/batch/get",
        serde_json::to_string(&many).unwrap().as_bytes(),
    )
    .unwrap();
    assert_eq!(st, 413);
    let too_many: Vec<(&str, Vec<u8>)> = many.iter().map(|k| (k.as_str(), b"v".to_vec())).collect();
    let (st, b) = http(&kv, "POST", "/v1/kv/batch/put", &put_records(&too_many)).unwrap();
    assert_eq!(st, 413, "{b}");
    assert_eq!(statuses(&b).len(), 100);
    // A streamed PUT (announced 2 MiB) whose caller goes away half-way is revoked:
    // nothing half-written is ever readable, and the key can be stored again.
    let mut cut = TcpStream::connect(&kv).unwrap();
    write!(
        cut,
        "PUT /v1/kv/stream%2Fcut HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n",
        2 << 20
    )
    .unwrap();
    cut.write_all(&vec![1u8; 1 << 20]).unwrap();
    drop(cut);
    let whole = value_of("stream/cut", 2 << 20);
    wait_for(
        "the cut put is revoked",
        Duration::from_secs(10),
        &[&mg.proc],
        || http(&kv, "PUT", "/v1/kv/stream%2Fcut", &whole).is_some_and(|(s, _)| s == 201),
    );
    let (st, body) = http_bytes(&kv, "GET", "/v1/kv/stream%2Fcut", &[]).unwrap();
    assert!(st == 200 && body == whole, "{st}");
    assert_eq!(
        metric_value(&mg.metrics(), "moongate_kv_inflight_bytes"),
        0.0
    );
    assert!(service_ready(&mg.listen));
    let (st, body) = http_bytes(&kv, "GET", "/v1/kv/batch%2F39", &[]).unwrap();
    assert_eq!(st, 200);
    assert!(body == value_of("batch/39", 100 << 10));
}

/// Every regular file under `dir` (the master's disk tier), recursively.
fn files_under(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(files_under(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// The master's disk tier (`--root_fs_dir`): moongate writes the disk replica of what it
/// puts (plain and streamed) where the master says, reads a disk replica when no memory
/// one is left (one written by the real client, and its own), and the real client
/// reads moongate's. A disk replica moongate cannot write is revoked and the value
/// stays in memory.
#[test]
fn the_disk_tier_is_written_and_read_both_ways() {
    let root = tempdir();
    let master = Master::start_with(MasterOpts {
        root_fs_dir: Some(root.path().to_path_buf()),
        ..Default::default()
    });
    // The real client puts "dk" (memory in its segment, the only one yet, + disk) and
    // leaves: only the disk copy is left.
    let r = run_role("disk", &master.rpc, &master.metadata, &[], &[&master.proc]);
    assert_eq!(r.as_array().unwrap()[0][1], 0, "{r}");
    let disk_root = format!("disk_root = \"{}\"\n", root.path().display());
    let (mut a, kv) = kv_moongate(&master, &format!("segment_bytes = 16777216\n{disk_root}"));
    wait_segment_mounted(&a);
    let (st, body) = http_bytes(&kv, "GET", "/v1/kv/dk", &[]).unwrap();
    assert_eq!(
        st,
        200,
        "{}\n{}",
        String::from_utf8_lossy(&body),
        a.proc.log_text()
    );
    assert!(body == value_of("dk", 2000), "dk differs");
    let disk = |m: &str, dir: &str| {
        metric_value(
            m,
            &format!("moongate_kv_transfers_total{{transport=\"disk\",direction=\"{dir}\"}}"),
        )
    };
    assert_eq!(disk(&a.metrics(), "read"), 1.0);

    // moongate's puts write the disk replica too: the file holds the raw value.
    let small = value_of("kvd/small", 5000);
    let big = value_of("kvd/big", (2 << 20) + 3);
    for (k, v) in [("kvd%2Fsmall", &small), ("kvd%2Fbig", &big)] {
        let (st, b) = http(&kv, "PUT", &format!("/v1/kv/{k}"), v).unwrap();
        assert_eq!(st, 201, "{b}\n{}", a.proc.log_text());
    }
    let files = files_under(root.path());
    for v in [&small, &big] {
        assert!(
            files
                .iter()
                .any(|f| std::fs::read(f).ok().as_ref() == Some(v)),
            "no disk file holds a value moongate put: {files:?}"
        );
    }
    assert_eq!(disk(&a.metrics(), "write"), 2.0);

    // A disk replica that cannot be written (a directory sits where its file goes): the
    // put still succeeds, in memory only, and the disk replica is revoked.
    let (st, _) = http(&kv, "PUT", "/v1/kv/kvd%2Ffail", b"first").unwrap();
    assert_eq!(st, 201);
    let path = files_under(root.path())
        .into_iter()
        .find(|f| std::fs::read(f).ok().as_deref() == Some(&b"first"[..]))
        .expect("the first kvd/fail file");
    let (st, b) = http(&kv, "DELETE", "/v1/kv/kvd%2Ffail", &[]).unwrap();
    assert_eq!(st, 204, "{b}");
    let _ = std::fs::remove_file(&path);
    std::fs::create_dir_all(&path).unwrap();
    let (st, b) = http(&kv, "PUT", "/v1/kv/kvd%2Ffail", b"second").unwrap();
    assert_eq!(st, 201, "{b}\n{}", a.proc.log_text());
    assert!(a.proc.log_text().contains("disk replica not written"));
    let (st, body) = http_bytes(&kv, "GET", "/v1/kv/kvd%2Ffail", &[]).unwrap();
    assert_eq!((st, body.as_slice()), (200, &b"second"[..]));

    // Batch puts end their disk replicas too (a removal right after finds them ready).
    let batch = put_records(&[
        ("kvd/b1", value_of("kvd/b1", 3000)),
        ("kvd/b2", value_of("kvd/b2", 70_000)),
        ("kvd/b3", b"gone soon".to_vec()),
    ]);
    let (st, b) = http(&kv, "POST", "/v1/kv/batch/put", &batch).unwrap();
    assert_eq!((st, statuses(&b)), (200, vec![201, 201, 201]), "{b}");
    let (st, b) = http(&kv, "DELETE", "/v1/kv/kvd%2Fb3", &[]).unwrap();
    assert_eq!(st, 204, "{b}");

    // moongate leaves (its segment unmounts): its values live on in the disk tier.
    a.proc.stop();
    let (b_mg, b_kv) = kv_moongate(&master, &disk_root);
    for (k, v) in [("kvd%2Fsmall", &small), ("kvd%2Fbig", &big)] {
        let (st, body) = http_bytes(&b_kv, "GET", &format!("/v1/kv/{k}"), &[]).unwrap();
        assert!(
            st == 200 && body == *v,
            "{k}: {st}\n{}",
            b_mg.proc.log_text()
        );
    }
    let (st, body) = http_bytes(
        &b_kv,
        "POST",
        "/v1/kv/batch/get",
        br#"["kvd/b1","kvd/b2","kvd/b3"]"#,
    )
    .unwrap();
    assert_eq!(st, 200);
    let recs = get_records(&body);
    assert_eq!(
        recs.iter().map(|r| r.0).collect::<Vec<_>>(),
        [200, 200, 404]
    );
    assert!(recs[0].1 == value_of("kvd/b1", 3000) && recs[1].1 == value_of("kvd/b2", 70_000));
    // The value whose disk replica was revoked left with the memory.
    let (st, _) = http(&b_kv, "GET", "/v1/kv/kvd%2Ffail", &[]).unwrap();
    assert_eq!(st, 404);
    let r = run_role(
        "diskget",
        &master.rpc,
        &master.metadata,
        &[],
        &[&master.proc, &b_mg.proc],
    );
    let get = |n: &str| result(&r, n).clone();
    assert_eq!(get("tiers kvd/small"), serde_json::json!(["disk"]), "{r}");
    assert_eq!(get("get kvd/small")["ok"], true, "{r}");
    assert_eq!(get("get kvd/big")["ok"], true, "{r}");
}

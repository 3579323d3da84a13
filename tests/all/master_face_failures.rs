//! Failure behaviour of the master face against the real master: master down, master
//! restarted, client gone, malformed client bytes, limits, idle timeout, SIGTERM drain.
//! Raw coro_rpc connections (built with moongate's codec) poke at moongate while real
//! Mooncake clients show that everyone else carries on.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::support::*;
use bytes::{Bytes, BytesMut};
use moongate::codec::message::{KeyArgs, KeysArgs, Request};
use moongate::codec::{BodyStyle, Method, RequestHeader};

/// A hand-driven client connection.
struct Raw {
    s: TcpStream,
}

enum Read1 {
    Frame {
        seq: u32,
        err_code: u8,
        body: Vec<u8>,
    },
    Closed,
    Timeout,
}

impl Raw {
    fn connect(addr: &str) -> Raw {
        let s = TcpStream::connect(addr).unwrap();
        s.set_nodelay(true).unwrap();
        Raw { s }
    }

    fn request(seq: u32, req: &Request) -> Vec<u8> {
        let mut body = BytesMut::new();
        req.encode_body(BodyStyle::MOONCAKE, &mut body);
        let mut out = BytesMut::new();
        RequestHeader::new(seq, req.method().function_id(), body.len() as u32).write(&mut out);
        out.extend_from_slice(&body);
        out.to_vec()
    }

    fn exist(seq: u32, key: &str) -> Vec<u8> {
        Raw::request(
            seq,
            &Request::ExistKey(KeyArgs {
                key: Bytes::copy_from_slice(key.as_bytes()),
                tenant_id: Bytes::from_static(b"default"),
            }),
        )
    }

    fn service_ready(seq: u32) -> Vec<u8> {
        let mut out = BytesMut::new();
        RequestHeader::new(seq, Method::ServiceReady.function_id(), 0).write(&mut out);
        out.to_vec()
    }

    fn send(&mut self, b: &[u8]) {
        // The peer may already have closed; the read that follows tells.
        let _ = self.s.write_all(b);
    }

    fn read(&mut self, limit: Duration) -> Read1 {
        self.s.set_read_timeout(Some(limit)).unwrap();
        let mut h = [0u8; 16];
        match self.s.read_exact(&mut h) {
            Ok(()) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Read1::Timeout;
            }
            Err(_) => return Read1::Closed,
        }
        let len = u32::from_le_bytes(h[8..12].try_into().unwrap()) as usize;
        let mut body = vec![0; len];
        if self.s.read_exact(&mut body).is_err() {
            return Read1::Closed;
        }
        Read1::Frame {
            seq: u32::from_le_bytes(h[4..8].try_into().unwrap()),
            err_code: h[2],
            body,
        }
    }

    fn expect_answer(&mut self, seq: u32) -> (u8, Vec<u8>) {
        match self.read(Duration::from_secs(10)) {
            Read1::Frame {
                seq: s,
                err_code,
                body,
            } => {
                assert_eq!(s, seq);
                (err_code, body)
            }
            Read1::Closed => panic!("connection closed, expected answer {seq}"),
            Read1::Timeout => panic!("no answer to {seq}"),
        }
    }

    fn expect_closed(&mut self, within: Duration, logs: &[&Proc]) {
        let start = Instant::now();
        loop {
            match self.read(Duration::from_millis(200)) {
                Read1::Closed => return,
                Read1::Frame { .. } => panic!("expected the connection to close, got a frame"),
                Read1::Timeout if start.elapsed() < within => continue,
                Read1::Timeout => {
                    let l: Vec<String> = logs.iter().map(|p| p.log_text()).collect();
                    panic!("connection still open after {within:?}\n{}", l.join("\n"))
                }
            }
        }
    }
}

fn wait_metric(mg: &Moongate, sample: &str, want: f64) {
    wait_for(
        &format!("{sample} == {want}"),
        Duration::from_secs(10),
        &[&mg.proc],
        || mg.metric(sample) == want,
    );
}

#[test]
fn master_down_closes_clients_promptly_and_is_not_ready() {
    let dead = format!("127.0.0.1:{}", free_port());
    let mg = Moongate::start(&dead);
    let mut c = Raw::connect(&mg.listen);
    c.send(&Raw::service_ready(0));
    c.expect_closed(Duration::from_secs(5), &[&mg.proc]);
    assert!(mg.proc.log_text().contains("upstream master unreachable"));
    assert_eq!(
        mg.metric("moongate_master_connections_total{outcome=\"upstream_failed\"}"),
        1.0
    );
    let (status, body) = http_get(&mg.admin, "/ready").unwrap();
    assert_eq!(status, 503, "{body}");
    assert_eq!(http_get(&mg.admin, "/live").unwrap().0, 200);
    assert_eq!(http_get(&mg.admin, "/nope").unwrap().0, 404);
    assert_eq!(mg.metric("moongate_upstream_ready"), 0.0);
}

#[test]
fn master_restart_closes_old_connections_and_serves_new_ones() {
    let master = Master::start();
    let ports = (master.rpc_port, master.http_port);
    let mg = Moongate::start(&master.rpc);
    mg.wait_ready(&master);
    let mut c = Raw::connect(&mg.listen);
    c.send(&Raw::service_ready(1));
    assert_eq!(c.expect_answer(1).0, 0);

    drop(master); // SIGTERM, then SIGKILL if needed
    c.expect_closed(Duration::from_secs(5), &[&mg.proc]);
    wait_for("not ready", Duration::from_secs(10), &[&mg.proc], || {
        http_get(&mg.admin, "/ready").is_some_and(|(s, _)| s == 503)
    });

    let master = Master::start_with(MasterOpts {
        ports: Some(ports),
        ..Default::default()
    });
    mg.wait_ready(&master);
    let mut c = Raw::connect(&mg.listen);
    c.send(&Raw::service_ready(0));
    assert_eq!(c.expect_answer(0).0, 0);
    // and a real client works end to end again
    let r = run_role(
        "demo",
        &mg.listen,
        &master.metadata,
        &[],
        &[&master.proc, &mg.proc],
    );
    assert_eq!(r[1][1]["gets"], 100, "{r}");
}

#[test]
fn client_disconnect_closes_its_upstream() {
    let master = Master::start();
    let mg = Moongate::start(&master.rpc);
    mg.wait_ready(&master);
    let mut c = Raw::connect(&mg.listen);
    c.send(&Raw::exist(5, "k"));
    let (err, _) = c.expect_answer(5);
    assert_eq!(err, 0);
    assert_eq!(mg.metric("moongate_upstream_connections_open"), 1.0);
    drop(c);
    wait_metric(&mg, "moongate_upstream_connections_open", 0.0);
    wait_metric(&mg, "moongate_master_connections_open", 0.0);
}

#[test]
fn malformed_client_bytes_close_only_that_connection() {
    let master = Master::start();
    let mg = Moongate::start(&master.rpc);
    mg.wait_ready(&master);
    let logs = [&master.proc, &mg.proc];
    let busy = Background::start("loop", &mg.listen, &master.metadata, &logs);

    // 1. random garbage
    let mut c = Raw::connect(&mg.listen);
    c.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    c.expect_closed(Duration::from_secs(5), &logs);
    // 2. a frame with protocol version 1
    let mut c = Raw::connect(&mg.listen);
    let mut f = Raw::service_ready(0);
    f[1] = 1;
    c.send(&f);
    c.expect_closed(Duration::from_secs(5), &logs);
    // 3. a header announcing a 4 GiB body, after one good request that is answered
    let mut c = Raw::connect(&mg.listen);
    let mut bad = Raw::exist(1, "k");
    bad[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
    let mut both = Raw::exist(0, "k");
    both.extend_from_slice(&bad[..20]);
    c.send(&both);
    assert_eq!(c.expect_answer(0).0, 0);
    c.expect_closed(Duration::from_secs(5), &logs);
    // 4. a truncated frame, then the client goes away mid-frame
    let mut c = Raw::connect(&mg.listen);
    c.send(&Raw::exist(0, "k")[..10]);
    drop(c);
    // 5. a well-framed request whose body is not what the method takes: relayed, and the
    //    master's own "invalid rpc arg" answer comes back on a connection that stays up.
    let mut c = Raw::connect(&mg.listen);
    let mut wrong = Raw::exist(3, "k");
    wrong[20 + 1] ^= 0x55; // corrupt the type hash
    c.send(&wrong);
    let (err, _) = c.expect_answer(3);
    assert_eq!(err, 4, "invalid_rpc_arguments from the master");
    c.send(&Raw::exist(4, "k"));
    assert_eq!(c.expect_answer(4).0, 0, "same connection still served");

    // finish() fails the test if the real client failed while others misbehaved.
    let res = busy.finish();
    assert!(res[1][1].as_u64().unwrap() > 0, "{res}");
    assert_eq!(
        mg.metric("moongate_master_frame_errors_total{side=\"client\",kind=\"bad_header\"}"),
        2.0
    );
    assert_eq!(
        mg.metric("moongate_master_frame_errors_total{side=\"client\",kind=\"too_large\"}"),
        1.0
    );
    // A type hash of no known release: relayed, counted as such (not as a decode error),
    // logged once.
    assert_eq!(
        mg.metric("moongate_master_unknown_type_codes_total{method=\"ExistKey\",side=\"client\"}"),
        1.0
    );
    assert_eq!(
        mg.metric("moongate_master_errors_total{method=\"ExistKey\",kind=\"decode\"}"),
        0.0
    );
    assert!(
        mg.proc
            .log_text()
            .contains("type code of no known Mooncake release")
    );
    assert!(mg.proc.log_text().contains("malformed client frame"));
}

#[test]
fn connection_limit_closes_the_excess_connection() {
    let master = Master::start();
    let mg = Moongate::start_with(&master.rpc, "max_connections = 2");
    mg.wait_ready(&master);
    let mut a = Raw::connect(&mg.listen);
    a.send(&Raw::service_ready(0));
    a.expect_answer(0);
    let mut b = Raw::connect(&mg.listen);
    b.send(&Raw::service_ready(0));
    b.expect_answer(0);
    let mut c = Raw::connect(&mg.listen);
    c.send(&Raw::service_ready(0));
    c.expect_closed(Duration::from_secs(5), &[&mg.proc]);
    assert_eq!(
        mg.metric("moongate_master_connections_total{outcome=\"rejected_limit\"}"),
        1.0
    );
    drop(a);
    wait_metric(&mg, "moongate_master_connections_open", 1.0);
    let mut d = Raw::connect(&mg.listen);
    d.send(&Raw::service_ready(7));
    assert_eq!(d.expect_answer(7).0, 0);
}

#[test]
fn idle_connections_are_closed() {
    let master = Master::start();
    let mg = Moongate::start_with(&master.rpc, "idle_timeout_ms = 300");
    let mut c = Raw::connect(&mg.listen);
    c.send(&Raw::service_ready(0));
    c.expect_answer(0);
    c.expect_closed(Duration::from_secs(5), &[&mg.proc]);
    assert!(mg.proc.log_text().contains("idle connection closed"));
}

#[test]
fn pipelined_requests_keep_their_order() {
    let master = Master::start();
    let mg = Moongate::start(&master.rpc);
    let mut c = Raw::connect(&mg.listen);
    let mut burst = Vec::new();
    // Arbitrary seq numbers, each used three times (the master allows duplicates), on
    // two kinds of call whose answers differ: each answer must come back in its
    // request's place, not just carry a seq that was sent.
    let seqs: Vec<u32> = (0..300).map(|i| (i * 7919) % 100).collect();
    for (i, &s) in seqs.iter().enumerate() {
        assert_eq!(seqs.iter().filter(|&&x| x == s).count(), 3);
        if i % 2 == 0 {
            burst.extend_from_slice(&Raw::exist(s, &format!("k{s}")));
        } else {
            burst.extend_from_slice(&Raw::service_ready(s));
        }
    }
    c.send(&burst);
    let mut bodies: [Option<Vec<u8>>; 2] = [None, None];
    for (i, &s) in seqs.iter().enumerate() {
        let (err, body) = c.expect_answer(s);
        assert_eq!(err, 0);
        let kind = bodies[i % 2].get_or_insert_with(|| body.clone());
        assert_eq!(*kind, body, "answer {i} (seq {s}) is another call's");
    }
    assert_ne!(
        bodies[0], bodies[1],
        "ExistKey and ServiceReady answers differ"
    );
}

/// A burst mixing single calls with batches that moongate splits: every reply is
/// byte-identical to the master's own answer to the unsplit burst, in order.
#[test]
fn split_batches_reply_byte_identical_in_a_pipelined_burst() {
    let keys = |n: usize, tag: &str| KeysArgs {
        keys: (0..n).map(|i| Bytes::from(format!("{tag}/{i}"))).collect(),
        tenant_id: Bytes::from_static(b"default"),
    };
    let mut burst = Raw::exist(1, "single");
    burst.extend(Raw::request(2, &Request::BatchExistKey(keys(5000, "a"))));
    burst.extend(Raw::exist(3, "single"));
    burst.extend(Raw::request(
        4,
        &Request::BatchGetReplicaList(keys(2500, "b")),
    ));
    burst.extend(Raw::request(5, &Request::BatchExistKey(keys(700, "c"))));
    burst.extend(Raw::service_ready(6));
    let answers = |addr: &str| {
        let mut c = Raw::connect(addr);
        c.send(&burst);
        (1..=6).map(|seq| c.expect_answer(seq)).collect::<Vec<_>>()
    };
    let master = Master::start();
    let direct = answers(&master.rpc);
    let mg = Moongate::start_with(&master.rpc, "max_batch_keys = 700");
    let via = answers(&mg.listen);
    assert_eq!(direct.len(), via.len());
    for (seq, (d, v)) in direct.iter().zip(&via).enumerate() {
        assert!(
            d == v,
            "answer {} differs ({} vs {} bytes)",
            seq + 1,
            d.1.len(),
            v.1.len()
        );
    }
    assert_eq!(
        mg.metric("moongate_batch_parts_total{method=\"BatchExistKey\"}"),
        8.0,
        "5,000 keys in 8 parts; 700 keys not split"
    );
    assert_eq!(
        mg.metric("moongate_batch_parts_total{method=\"BatchGetReplicaList\"}"),
        4.0
    );
}

#[test]
fn sigterm_lets_in_flight_calls_finish_then_exits_zero() {
    let master = Master::start();
    let mut mg = Moongate::start(&master.rpc);
    mg.wait_ready(&master);
    let mut c = Raw::connect(&mg.listen);
    c.send(&Raw::exist(0, "warm"));
    c.expect_answer(0);

    // Freeze the master so the next calls stay in flight.
    master.proc.signal(libc::SIGSTOP);
    let mut burst = Vec::new();
    for s in 1..=50 {
        burst.extend_from_slice(&Raw::exist(s, "k"));
    }
    c.send(&burst);
    wait_metric(
        &mg,
        "moongate_master_requests_total{method=\"ExistKey\"}",
        51.0,
    );
    mg.proc.signal(libc::SIGTERM);
    wait_for(
        "moongate starts draining",
        Duration::from_secs(10),
        &[&mg.proc],
        || {
            mg.proc
                .log_text()
                .contains("shutting down: no new connections")
        },
    );
    // New connections are no longer accepted while draining.
    assert!(
        TcpStream::connect(&mg.listen).is_err()
            || matches!(
                Raw::connect(&mg.listen).read(Duration::from_secs(2)),
                Read1::Closed
            )
    );
    master.proc.signal(libc::SIGCONT);
    for s in 1..=50 {
        assert_eq!(c.expect_answer(s).0, 0, "in-flight call {s} answered");
    }
    c.expect_closed(Duration::from_secs(5), &[&mg.proc]);
    let st = mg
        .proc
        .wait_exit(Duration::from_secs(10))
        .expect("moongate exits");
    assert!(st.success(), "exit status {st}\n{}", mg.proc.log_text());
    assert!(mg.proc.log_text().contains("all connections drained"));
}

#[test]
fn sigterm_gives_up_after_the_grace_period() {
    let master = Master::start();
    let mut mg = Moongate::start_config(&format!(
        "[master_face]\nupstream = \"{}\"\n[shutdown]\ngrace_period_ms = 500\n",
        master.rpc
    ));
    mg.wait_ready(&master);
    let mut c = Raw::connect(&mg.listen);
    master.proc.signal(libc::SIGSTOP);
    c.send(&Raw::exist(1, "k"));
    wait_metric(
        &mg,
        "moongate_master_requests_total{method=\"ExistKey\"}",
        1.0,
    );
    mg.proc.signal(libc::SIGTERM);
    let st = mg
        .proc
        .wait_exit(Duration::from_secs(10))
        .expect("moongate exits");
    master.proc.signal(libc::SIGCONT);
    assert!(st.success(), "exit status {st}");
    assert!(mg.proc.log_text().contains("grace period over"));
    c.expect_closed(Duration::from_secs(5), &[&mg.proc]);
}

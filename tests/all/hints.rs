//! Hints through the live endpoints: `POST /v1/hints` on the kv face and `POST /hints` on
//! the admin endpoint, against the real master. Good hints are taken; bad ones get
//! 400 (naming the field) / 413 / 429 and nothing else changes: the store keeps serving
//! puts and gets byte-exact.

use std::time::{Duration, Instant};

use crate::support::*;

fn hints_of(n: usize, kind: &str) -> Vec<u8> {
    let keys: Vec<String> = (0..n).map(|i| format!("\"h/{kind}/{i}\"")).collect();
    format!(
        r#"{{"hints": [{{"kind": "{kind}", "keys": [{}]}}]}}"#,
        keys.join(",")
    )
    .into_bytes()
}

#[test]
fn hints_are_taken_bounded_and_change_nothing_else() {
    let master = Master::start();
    let (mg, kv) = kv_moongate(
        &master,
        "segment_bytes = 16777216\n[hints]\nmax_names_per_call = 100\nmax_body_bytes = 65536\n\
         max_names_per_second = 300\n",
    );
    wait_segment_mounted(&mg);
    let value = value_of("h/value", 1 << 20);
    let (st, b) = http(&kv, "PUT", "/v1/kv/h%2Fvalue", &value).unwrap();
    assert_eq!(st, 201, "{b}\n{}", mg.proc.log_text());

    // Good hints, every kind, keys and blocks.
    let good = br#"{"hints": [
        {"kind": "upcoming", "keys": ["h/value", "h/next"], "in_ms": 200, "session": "r1"},
        {"kind": "done", "blocks": [1234, "00ff00ff"]},
        {"kind": "expect", "keys": ["h/agent"], "within_ms": 30000, "tenant": "default"}
    ]}"#;
    let (st, b) = http(&kv, "POST", "/v1/hints", good).unwrap();
    assert_eq!(st, 200, "{b}");
    let v: serde_json::Value = serde_json::from_str(&b).unwrap();
    assert_eq!(v["accepted"], 5, "{b}");
    // The admin endpoint takes the same body (loopback, no token).
    let (st, b) = http(&mg.admin, "POST", "/hints", &hints_of(3, "done")).unwrap();
    assert_eq!(st, 200, "{b}");

    // Bad input: each refused whole, with the field or the limit named.
    for (body, status, says) in [
        (&b"{not json"[..], 400, "body"),
        (
            br#"{"hints": [{"kind": "soon", "keys": ["a"]}]}"#,
            400,
            "hints[0].kind",
        ),
        (
            br#"{"hints": [{"kind": "done", "blocks": [-3]}]}"#,
            400,
            "hints[0].blocks[0]",
        ),
        (
            br#"{"hints": [{"kind": "expect", "keys": ["a"]}]}"#,
            400,
            "hints[0].within_ms",
        ),
    ] {
        let (st, b) = http(&kv, "POST", "/v1/hints", body).unwrap();
        assert_eq!(st, status, "{}: {b}", String::from_utf8_lossy(body));
        assert!(b.contains(says), "{b} should name {says}");
    }
    let (st, b) = http(&kv, "POST", "/v1/hints", &hints_of(101, "done")).unwrap();
    assert_eq!(st, 413, "{b}");
    assert!(b.contains("max_names_per_call"), "{b}");
    let mut huge = b"{\"hints\": [], \"pad\": \"".to_vec();
    huge.resize(70_000, b'x');
    let (st, b) = http(&kv, "POST", "/v1/hints", &huge).unwrap();
    assert_eq!(st, 413, "{b}");
    let (st, _) = http(&mg.admin, "POST", "/hints", &huge).unwrap();
    assert_eq!(st, 413);
    // A flood: 300 names a second are allowed; calls of 100 names, back to back, meet
    // the limit within a few calls (a refill of 300 a second cannot keep up with calls
    // that each take far less than a third of a second).
    let refused = (0..40)
        .map(|_| http(&kv, "POST", "/v1/hints", &hints_of(100, "upcoming")).unwrap())
        .find(|(st, _)| *st == 429);
    let (_, b) = refused.expect("a flood meets the rate limit");
    assert!(b.contains("max_names_per_second"), "{b}");

    // Nothing else changed: the value reads back byte-exact, new puts work.
    let (st, body) = http_bytes(&kv, "GET", "/v1/kv/h%2Fvalue", &[]).unwrap();
    assert!(st == 200 && body == value, "{st}");
    let (st, _) = http(&kv, "PUT", "/v1/kv/h%2Fafter", b"after").unwrap();
    assert_eq!(st, 201);
    let (st, body) = http_bytes(&kv, "GET", "/v1/kv/h%2Fafter", &[]).unwrap();
    assert_eq!((st, body.as_slice()), (200, &b"after"[..]));
    assert!(service_ready(&mg.listen));

    let m = mg.metrics();
    let sample = |s: &str| sample_of(&m, s).unwrap_or_else(|| panic!("{s} missing:\n{m}"));
    assert!(sample("moongate_hints_received_total{kind=\"upcoming\"}") >= 2.0);
    assert_eq!(
        sample("moongate_hints_received_total{kind=\"expect\"}"),
        1.0
    );
    assert_eq!(
        sample("moongate_hints_refused_total{reason=\"invalid\"}"),
        4.0
    );
    assert_eq!(
        sample("moongate_hints_refused_total{reason=\"too_large\"}"),
        3.0
    );
    assert!(sample("moongate_hints_refused_total{reason=\"rate\"}") >= 1.0);
    assert!(sample("moongate_hints_entries") >= 8.0);
}

/// `hints.subscribe`: moongate connects to a router's PUB socket (before the router is
/// up, and again after it restarts), takes its own topic's messages as hint calls,
/// counts a bad one as refused and carries on.
#[test]
fn a_subscriber_takes_its_topics_hints_from_a_publisher_and_survives_bad_ones() {
    use zeromq::{Socket, SocketSend, ZmqMessage};
    let port = free_port();
    let mg = Moongate::start_config(&format!(
        "[master_face]\nupstream = \"127.0.0.1:{}\"\n[hints]\nsubscribe = [\"tcp://127.0.0.1:{port}\"]\n\
         subscribe_topic = \"r0\"\n",
        free_port()
    ));
    assert_eq!(mg.metric("moongate_hints_publishers"), 0.0);
    let received =
        |kind: &str| mg.metric(&format!("moongate_hints_received_total{{kind=\"{kind}\"}}"));
    let invalid = || mg.metric("moongate_hints_refused_total{reason=\"invalid\"}");
    let msg = |topic: &str, body: String| {
        ZmqMessage::try_from(vec![
            bytes::Bytes::from(topic.to_string()),
            bytes::Bytes::from(body),
        ])
        .unwrap()
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    // Publishes rounds (another rank's hint, a bad body, a good one) until `enough`.
    let publish_until = |enough: &dyn Fn() -> bool, round0: usize| {
        rt.block_on(async {
            let mut publisher = zeromq::PubSocket::new();
            publisher
                .bind(&format!("tcp://127.0.0.1:{port}"))
                .await
                .unwrap();
            wait_for(
                "subscriber connected",
                Duration::from_secs(30),
                &[&mg.proc],
                || mg.metric("moongate_hints_publishers") == 1.0,
            );
            let start = Instant::now();
            let mut round = round0;
            // A subscription reaches the publisher just after the connection: the first
            // messages may be dropped by PUB, so rounds repeat until counted.
            while !enough() {
                assert!(
                    start.elapsed() < Duration::from_secs(30),
                    "{}",
                    mg.proc.log_text()
                );
                let other = format!(r#"{{"hints": [{{"kind": "done", "keys": ["x/{round}"]}}]}}"#);
                let good =
                    format!(r#"{{"hints": [{{"kind": "upcoming", "keys": ["z/{round}"]}}]}}"#);
                publisher.send(msg("r1", other)).await.unwrap();
                publisher.send(msg("r0", "{not json".into())).await.unwrap();
                publisher.send(msg("r0", good)).await.unwrap();
                round += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            round
        })
    };
    let rounds = publish_until(&|| received("upcoming") >= 3.0 && invalid() >= 3.0, 0);
    // Another rank's hints are not taken; every bad body was followed by a good one.
    assert_eq!(received("done"), 0.0);
    assert!(received("upcoming") >= invalid() - 1.0);
    // The publisher went away (dropped at the end of its block): the gauge says so,
    // and a new one on the same endpoint is followed again.
    wait_for(
        "subscriber disconnected",
        Duration::from_secs(30),
        &[&mg.proc],
        || mg.metric("moongate_hints_publishers") == 0.0,
    );
    let before = received("upcoming");
    publish_until(&|| received("upcoming") >= before + 3.0, rounds);
    assert_eq!(received("done"), 0.0);
    assert!(mg.metric("moongate_hints_entries") >= before + 3.0);
}

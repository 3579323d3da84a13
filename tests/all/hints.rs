//! Hints through the live endpoints: `POST /v1/hints` on the kv face and `POST /hints` on
//! the admin endpoint, against the real master. Good hints are taken; bad ones get
//! 400 (naming the field) / 413 / 429 and nothing else changes: the store keeps serving
//! puts and gets byte-exact.

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

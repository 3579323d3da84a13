//! Golden tests per Mooncake release: the master-RPC bytes of the two-process scenario
//! captured from 0.3.11.post1 and 0.3.12.post1 (their clients and masters,
//! `scripts/capture_release_fixtures.py`; 0.3.13.post1's are in `codec_fixtures`). Every
//! frame of a method moongate decodes decodes in its release's layout and re-encodes
//! byte for byte, requests and answers alike.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;

use bytes::BytesMut;
use moongate::codec::frame::{check_request, check_response, errc};
use moongate::codec::message::is_typed;
use moongate::codec::{Method, Request, RequestFrame, Response, ResponseFrame, Schema};

fn dir(release: &str) -> PathBuf {
    crate::support::repo_root().join(format!("proxy/tests/fixtures/releases/{release}"))
}

/// Per schema: typed requests and answers that round-tripped.
#[derive(Default, Debug)]
struct Seen {
    requests: HashMap<Schema, usize>,
    answers: HashMap<Schema, usize>,
}

fn replay(release: &str) -> Seen {
    let mut seen = Seen::default();
    let mut conns = 0;
    for n in 1.. {
        let c2s = dir(release).join(format!("conn{n}.c2s.bin"));
        if !c2s.exists() {
            break;
        }
        conns += 1;
        let mut methods: HashMap<u32, VecDeque<Option<Method>>> = HashMap::new();
        let mut buf = BytesMut::from(&std::fs::read(&c2s).unwrap()[..]);
        while let Some(h) = check_request(&buf, 1 << 30).unwrap() {
            let (f, _) = RequestFrame::split(&mut buf, h);
            let method = Method::from_function_id(h.function_id);
            methods.entry(h.seq_num).or_default().push_back(method);
            let Some(m) = method.filter(|m| is_typed(*m)) else {
                continue;
            };
            let (req, style) = Request::decode(m, &f.body)
                .unwrap()
                .unwrap_or_else(|e| panic!("{release} conn{n} {m}: {e}"));
            let mut out = BytesMut::new();
            req.encode_body(style, &mut out);
            assert_eq!(out.freeze(), f.body, "{release} conn{n} {m}: re-encode");
            *seen.requests.entry(style.schema).or_default() += 1;
        }
        assert!(buf.is_empty(), "{release} conn{n}: a cut request");
        let s2c = dir(release).join(format!("conn{n}.s2c.bin"));
        let mut buf = BytesMut::from(&std::fs::read(&s2c).unwrap()[..]);
        while let Some(h) = check_response(&buf, 1 << 30).unwrap() {
            let (f, _) = ResponseFrame::split(&mut buf, h);
            let method = methods
                .get_mut(&h.seq_num)
                .and_then(VecDeque::pop_front)
                .unwrap_or_else(|| panic!("{release} conn{n}: answer to no request"));
            let Some(m) = method.filter(|m| is_typed(*m)) else {
                continue;
            };
            if h.err_code != errc::OK {
                continue;
            }
            let (resp, style) = Response::decode(m, &f.body)
                .unwrap()
                .unwrap_or_else(|e| panic!("{release} conn{n} {m} answer: {e}"));
            let mut out = BytesMut::new();
            resp.encode_body(style, &mut out);
            assert_eq!(
                out.freeze(),
                f.body,
                "{release} conn{n} {m} answer: re-encode"
            );
            *seen.answers.entry(style.schema).or_default() += 1;
        }
        assert!(buf.is_empty(), "{release} conn{n}: a cut answer");
    }
    assert!(
        conns >= 2,
        "{release}: no capture (run scripts/capture_release_fixtures.py)"
    );
    seen
}

#[test]
fn captured_0_3_11_frames_decode_in_their_layout_and_round_trip() {
    let s = replay("0.3.11.post1");
    eprintln!("{s:?}");
    // Its puts, lookups and mounts are 0.3.11 layouts; its answers with replicas 0.3.12's
    // (the two releases answer alike).
    assert!(
        s.requests.get(&Schema::V0_3_11).copied().unwrap_or(0) >= 10,
        "{s:?}"
    );
    assert!(
        s.answers.get(&Schema::V0_3_12).copied().unwrap_or(0) >= 2,
        "{s:?}"
    );
}

#[test]
fn captured_0_3_12_frames_decode_in_their_layout_and_round_trip() {
    let s = replay("0.3.12.post1");
    eprintln!("{s:?}");
    assert_eq!(s.requests.get(&Schema::V0_3_11), None, "{s:?}");
    assert!(
        s.requests.get(&Schema::V0_3_12).copied().unwrap_or(0) >= 5,
        "{s:?}"
    );
    assert!(
        s.answers.get(&Schema::V0_3_12).copied().unwrap_or(0) >= 2,
        "{s:?}"
    );
}

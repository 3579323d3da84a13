//! Golden tests of the codec against byte streams captured between the real Mooncake
//! 0.3.13.post1 client and master (`tests/fixtures/master-rpc`, copied from the shared
//! captures). Streams are split with moongate's own framing and matched request to
//! response with a per-connection seq map, as the master face does; the capture index is
//! only used to cross-check.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};

use bytes::{Bytes, BytesMut};
use moongate::codec::frame::{check_request, check_response};
use moongate::codec::generic::GenericMessage;
use moongate::codec::message::{Request, Response, RpcError, is_typed};
use moongate::codec::types::*;
use moongate::codec::{Method, RequestFrame, ResponseFrame};

const SESSIONS: [&str; 5] = [
    "session_basic",
    "session_extended",
    "session_disk_replica",
    "session_idle_heartbeat",
    "probe_all_methods",
];

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/master-rpc")
}

/// One captured frame in capture order, with what the index says of it.
struct Frame {
    index: u64,
    request: bool,
    raw: Bytes,
    method: Option<Method>,
    index_method: String,
    err_code: u8,
    body: Bytes,
}

fn load(session: &str) -> Vec<Frame> {
    let dir = fixtures().join(session);
    let idx: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("index.json")).unwrap()).unwrap();
    let entries = idx["frames"].as_array().unwrap();
    // Split every stream ourselves.
    let mut by_key: HashMap<(String, u64), Frame> = HashMap::new();
    let mut conns: Vec<u64> = entries
        .iter()
        .map(|e| e["conn"].as_u64().unwrap())
        .collect();
    conns.sort_unstable();
    conns.dedup();
    for conn in conns {
        let c2s = std::fs::read(dir.join(format!("conn{conn}.c2s.bin"))).unwrap_or_default();
        let s2c = std::fs::read(dir.join(format!("conn{conn}.s2c.bin"))).unwrap_or_default();
        let mut pending: VecDeque<(u32, Option<Method>)> = VecDeque::new();
        let mut buf = BytesMut::from(&c2s[..]);
        let mut off = 0u64;
        while let Some(h) = check_request(&buf, 1 << 30).unwrap() {
            let (f, raw) = RequestFrame::split(&mut buf, h);
            let m = Method::from_function_id(h.function_id);
            pending.push_back((h.seq_num, m));
            let key = (format!("conn{conn}.c2s.bin"), off);
            off += raw.len() as u64;
            by_key.insert(
                key,
                Frame {
                    index: 0,
                    request: true,
                    raw,
                    method: m,
                    index_method: String::new(),
                    err_code: 0,
                    body: f.body,
                },
            );
        }
        assert!(
            buf.is_empty(),
            "{session} conn{conn}: trailing request bytes"
        );
        let mut buf = BytesMut::from(&s2c[..]);
        let mut off = 0u64;
        while let Some(h) = check_response(&buf, 1 << 30).unwrap() {
            let (f, raw) = ResponseFrame::split(&mut buf, h);
            let (seq, m) = pending.pop_front().expect("response without request");
            assert_eq!(seq, h.seq_num, "{session}: responses come in request order");
            let key = (format!("conn{conn}.s2c.bin"), off);
            off += raw.len() as u64;
            by_key.insert(
                key,
                Frame {
                    index: 0,
                    request: false,
                    raw,
                    method: m,
                    index_method: String::new(),
                    err_code: h.err_code,
                    body: f.body,
                },
            );
        }
        assert!(
            buf.is_empty(),
            "{session} conn{conn}: trailing response bytes"
        );
    }
    let mut out = Vec::new();
    for e in entries {
        let key = (
            e["file"].as_str().unwrap().to_string(),
            e["offset"].as_u64().unwrap(),
        );
        let mut f = by_key
            .remove(&key)
            .unwrap_or_else(|| panic!("{session}: index frame {key:?} not found by our framing"));
        assert_eq!(f.raw.len() as u64, e["length"].as_u64().unwrap());
        f.index = e["index"].as_u64().unwrap();
        f.index_method = e["method"].as_str().unwrap_or("").to_string();
        out.push(f);
    }
    assert!(by_key.is_empty(), "{session}: frames not in the index");
    out
}

fn reencode_request(f: &Frame) -> Option<Bytes> {
    let m = f.method?;
    let (req, style) = Request::decode(m, &f.body)?.unwrap_or_else(|e| {
        panic!("frame {} ({m}) failed to decode: {e}", f.index);
    });
    let mut body = BytesMut::new();
    req.encode_body(style, &mut body);
    let mut out = BytesMut::new();
    let h = moongate::codec::RequestHeader::parse(f.raw[..20].try_into().unwrap());
    RequestFrame {
        header: h,
        body: body.freeze(),
        attachment: Bytes::new(),
    }
    .write(&mut out);
    Some(out.freeze())
}

fn reencode_response(f: &Frame) -> Option<Bytes> {
    let h = moongate::codec::ResponseHeader::parse(f.raw[..16].try_into().unwrap());
    let mut body = BytesMut::new();
    if f.err_code != 0 {
        let (e, style) = RpcError::decode(f.err_code, &f.body).expect("rpc error body");
        e.encode_body(style, &mut body);
    } else {
        let m = f.method?;
        let (resp, style) = Response::decode(m, &f.body)?.unwrap_or_else(|e| {
            panic!("frame {} ({m} response) failed to decode: {e}", f.index);
        });
        resp.encode_body(style, &mut body);
    }
    let mut out = BytesMut::new();
    ResponseFrame {
        header: h,
        body: body.freeze(),
        attachment: Bytes::new(),
    }
    .write(&mut out);
    Some(out.freeze())
}

/// Captured frames of the methods moongate decodes to types (fixed by the fixtures):
/// 490, and the probe's BatchReplicaClear request and answer (typed for the evictor).
const TYPED_FRAMES: usize = 492;

#[test]
fn every_captured_frame_round_trips_byte_identically() {
    let (mut total, mut typed, mut generic) = (0, 0, 0);
    for s in SESSIONS {
        for f in load(s) {
            total += 1;
            let name = f.method.map(Method::name).unwrap_or("");
            assert_eq!(name, f.index_method, "{s} frame {}: method", f.index);
            let again = if f.request {
                reencode_request(&f)
            } else {
                reencode_response(&f)
            };
            if let Some(again) = again {
                typed += 1;
                assert_eq!(
                    again, f.raw,
                    "{s} frame {} ({name}): typed re-encode",
                    f.index
                );
            }
            if !f.body.is_empty() {
                let g = GenericMessage::decode(&f.body)
                    .unwrap_or_else(|e| panic!("{s} frame {}: generic decode: {e}", f.index));
                let mut out = BytesMut::new();
                g.encode(&mut out);
                assert_eq!(
                    out, f.body,
                    "{s} frame {} ({name}): generic re-encode",
                    f.index
                );
                generic += 1;
            }
        }
    }
    assert_eq!(total, 574, "all captured frames");
    assert_eq!(
        generic, 562,
        "every non-empty body decodes from its own literal"
    );
    assert_eq!(typed, TYPED_FRAMES, "typed frames");
}

#[test]
fn typed_methods_cover_the_client_sessions() {
    // Every request of the real Python client sessions (not the synthetic probe) that
    // names a method moongate acts on must decode typed.
    for s in &SESSIONS[..4] {
        for f in load(s).iter().filter(|f| f.request) {
            let m = f.method.expect("known method");
            if is_typed(m) {
                assert!(Request::decode(m, &f.body).unwrap().is_ok());
            }
        }
    }
}

fn frame(session: &str, index: u64) -> Frame {
    load(session)
        .into_iter()
        .find(|f| f.index == index)
        .unwrap()
}

#[test]
fn put_start_with_a_custom_config_field_by_field() {
    let f = frame("session_extended", 44);
    let Some(Ok((Request::PutStart(a), _))) = Request::decode(Method::PutStart, &f.body) else {
        panic!("not a PutStart");
    };
    assert_eq!(&a.key[..], b"kcfg");
    assert_eq!(a.slice_length, 300);
    assert_eq!(&a.tenant_id[..], b"default");
    let c = &a.config;
    assert_eq!(
        (c.replica_num, c.nof_replica_num, c.dfs_replica_num),
        (1, 0, 0)
    );
    assert_eq!(c.soft_pin_action, SoftPinAction::ENABLE);
    assert_eq!(c.soft_pin_ttl_ms, Some(60000));
    assert!(!c.with_hard_pin);
    assert_eq!(c.preferred_segments, vec![Bytes::from_static(b"127.0.0.1")]);
    assert!(c.preferred_segment.is_empty() && c.host_id.is_empty());
    assert_eq!(c.data_type, ObjectDataType::UNKNOWN);
    assert_eq!(c.group_ids, None);
}

#[test]
fn replica_list_with_memory_and_disk_replicas_field_by_field() {
    let f = frame("session_disk_replica", 23);
    let Some(Ok((Response::GetReplicaList(Ok(r)), _))) =
        Response::decode(Method::GetReplicaList, &f.body)
    else {
        panic!("not a successful GetReplicaList");
    };
    assert_eq!(r.replicas.len(), 2);
    assert_eq!(r.lease_ttl_ms, 10000);
    assert_eq!(r.object_checksum, None);
    let m = &r.replicas[0];
    assert_eq!((m.id, m.status), (1, ReplicaStatus::COMPLETE));
    let ReplicaLocation::Memory(md) = &m.location else {
        panic!("first replica is in memory");
    };
    assert_eq!(md.buffer_descriptor.size, 2000);
    assert_eq!(md.buffer_descriptor.buffer_address, 0x7f4b_c300_0000);
    assert_eq!(&md.buffer_descriptor.protocol[..], b"tcp");
    assert_eq!(
        &md.buffer_descriptor.transport_endpoint[..],
        b"127.0.0.1:12482"
    );
    let d = &r.replicas[1];
    assert_eq!(d.id, 2);
    let ReplicaLocation::Disk(dd) = &d.location else {
        panic!("second replica is on disk");
    };
    assert_eq!(dd.object_size, 2000);
    assert_eq!(dd.file_path.len(), 40);
}

#[test]
fn application_error_and_wide_batch() {
    let f = frame("session_extended", 53);
    let Some(Ok((Response::GetReplicaList(Err(e)), _))) =
        Response::decode(Method::GetReplicaList, &f.body)
    else {
        panic!("not a failed GetReplicaList");
    };
    assert_eq!(e, ErrorCode::OBJECT_NOT_FOUND);

    let f = frame("session_extended", 62);
    let Some(Ok((Request::BatchPutStart(a), _))) = Request::decode(Method::BatchPutStart, &f.body)
    else {
        panic!("not a BatchPutStart");
    };
    assert_eq!(a.keys.len(), 300);
    assert_eq!(a.slice_lengths, vec![16; 300]);
    assert_eq!(&a.keys[7][..], b"big007");
}

#[test]
fn a_rewrite_changes_the_width_of_the_whole_message() {
    // A policy that appends 300 preferred segments to a tiny PutStart forces 2-byte
    // sizes everywhere; the master must still be able to decode it (we check that our
    // own decoder, which follows the spec, reads back the same value).
    let f = load("session_basic")
        .into_iter()
        .find(|f| f.request && f.method == Some(Method::PutStart))
        .unwrap();
    let m = Method::PutStart;
    let Some(Ok((Request::PutStart(mut a), style))) = Request::decode(m, &f.body) else {
        panic!("not a PutStart");
    };
    a.config.preferred_segments = (0..300).map(|i| Bytes::from(format!("seg{i}"))).collect();
    let req = Request::PutStart(a);
    let mut body = BytesMut::new();
    req.encode_body(style, &mut body);
    let body = body.freeze();
    assert_eq!(body[4], 0x0c, "metainfo: literal + 2-byte sizes");
    let (back, _) = Request::decode(m, &body).unwrap().unwrap();
    assert_eq!(back, req);
}

#[test]
fn tier_tallies_from_captured_answers() {
    use moongate::calls::Tally;
    let tally = |session: &str, index: u64| {
        let f = frame(session, index);
        let (resp, _) = Response::decode(f.method.unwrap(), &f.body)
            .unwrap()
            .unwrap();
        Tally::of(&resp)
    };
    // memory + disk replica of one 2000-byte key
    let t = tally("session_disk_replica", 23);
    assert_eq!((t.keys[0][0], t.bytes[0][0]), (1, 2000), "memory");
    assert_eq!((t.keys[1][0], t.bytes[1][0]), (1, 2000), "disk");
    // a miss
    let t = tally("session_extended", 53);
    assert_eq!(t.keys[3][1], 1, "not_found under unknown");
    // batch_is_exist(["bk0", "bk1", "bk2", "nokey"])
    let f = load("session_basic")
        .into_iter()
        .find(|f| !f.request && f.method == Some(Method::BatchExistKey))
        .unwrap();
    let (resp, _) = Response::decode(Method::BatchExistKey, &f.body)
        .unwrap()
        .unwrap();
    let t = Tally::of(&resp);
    assert_eq!((t.hits, t.misses), (3, 1));
    // Counted from the bytes, as the master face counts an answer it only relays.
    let c = moongate::codec::message::ExistCounts::of_batch(&f.body).unwrap();
    assert_eq!((c.found, c.absent, c.errors), (3, 1, 0));
}

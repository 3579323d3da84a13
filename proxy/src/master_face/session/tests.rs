//! The session driven directly: no master, no sockets, no wasm (a fake policy).

use super::*;
use crate::codec::frame::{check_request, check_response};
use crate::codec::message::{BatchPutStartArgs, KeyArgs, KeysArgs, PutStartArgs};
use crate::codec::types::{
    BufferDescriptor, DfsDescriptor, ErrorCode, MemoryDescriptor, ReplicaDescriptor,
    ReplicaLocation, ReplicaStatus, ReplicateConfig,
};
use crate::codec::{RequestHeader, ResponseHeader};
use crate::master_face::config::MasterFaceConfig;
use crate::metrics::Metrics;
use crate::policy::Policy;
use crate::policy::fake::Fake;
use crate::policy::registry::Registry;

fn session_with(cfg: MasterFaceConfig, fake: Arc<Fake>) -> (Session, Arc<Shared>) {
    session_in(cfg, fake, &Metrics::new())
}

/// A session whose handles live in `all` (to read the exposition).
fn session_in(cfg: MasterFaceConfig, fake: Arc<Fake>, all: &Metrics) -> (Session, Arc<Shared>) {
    let policy: Arc<dyn Policy> = fake;
    let topology = Arc::new(crate::topology::Topology::new(all.topology.clone()));
    let shared = Arc::new(Shared {
        upstream: crate::upstream::Upstream::fixed(&cfg.upstream),
        cfg,
        metrics: all.master.clone(),
        shutdown: Default::default(),
        policy: Registry::with_policies(Default::default(), None, all.policy.clone(), vec![policy])
            .unwrap(),
        put_bytes_in_flight: Default::default(),
        answered: Arc::new(crate::answered::Sink::new(None, None, topology.clone())),
        topology,
        owner_face: None,
    });
    let peer = shared
        .topology
        .join(crate::topology::PeerKey::Addr([127, 0, 0, 1].into()));
    (Session::new(shared.clone(), peer), shared)
}

fn session(fake: Arc<Fake>) -> (Session, Arc<Shared>) {
    session_with(MasterFaceConfig::default(), fake)
}

fn key(k: &str) -> Bytes {
    Bytes::copy_from_slice(k.as_bytes())
}

fn exist(k: &str) -> Request {
    Request::ExistKey(KeyArgs {
        key: key(k),
        tenant_id: key("default"),
    })
}

fn put(k: &str) -> Request {
    Request::PutStart(PutStartArgs {
        client_id: Uuid::default(),
        key: key(k),
        slice_length: 10,
        config: ReplicateConfig::default(),
        tenant_id: key("default"),
    })
}

fn batch_put(keys: &[&str]) -> Request {
    Request::BatchPutStart(BatchPutStartArgs {
        client_id: Uuid::default(),
        keys: keys.iter().map(|k| key(k)).collect(),
        slice_lengths: keys.iter().map(|_| 10).collect(),
        config: ReplicateConfig::default(),
        tenant_id: key("default"),
    })
}

/// A request as the client sends it.
fn request(seq: u32, req: &Request) -> (RequestFrame, Bytes) {
    let mut body = BytesMut::new();
    req.encode_body(BodyStyle::MOONCAKE, &mut body);
    let mut raw = BytesMut::new();
    RequestHeader::new(seq, req.method().function_id(), body.len() as u32).write(&mut raw);
    raw.extend_from_slice(&body);
    let h = check_request(&raw, 1 << 20).unwrap().unwrap();
    let (f, raw) = RequestFrame::split(&mut raw, h);
    (f, raw)
}

/// A master answer.
fn answer(seq: u32, resp: &Response) -> (ResponseFrame, Bytes) {
    let mut body = BytesMut::new();
    resp.encode_body(BodyStyle::MOONCAKE, &mut body);
    frame(ResponseHeader::new(seq, errc::OK, body.len() as u32), body)
}

fn transport_error(seq: u32) -> (ResponseFrame, Bytes) {
    let mut body = BytesMut::new();
    RpcError {
        code: u16::from(errc::RPC_THROW_EXCEPTION),
        message: key("boom"),
    }
    .encode_body(BodyStyle::MOONCAKE, &mut body);
    frame(
        ResponseHeader::new(seq, errc::RPC_THROW_EXCEPTION, body.len() as u32),
        body,
    )
}

fn frame(h: ResponseHeader, body: BytesMut) -> (ResponseFrame, Bytes) {
    let mut raw = BytesMut::new();
    h.write(&mut raw);
    raw.extend_from_slice(&body);
    let h = check_response(&raw, 1 << 20).unwrap().unwrap();
    ResponseFrame::split(&mut raw, h)
}

/// The requests in bytes the session sent the master: (seq, decoded).
fn sent(bytes: Option<Bytes>) -> Vec<(u32, Request)> {
    let mut buf = BytesMut::from(&bytes.unwrap_or_default()[..]);
    let mut out = Vec::new();
    while let Some(h) = check_request(&buf, 1 << 20).unwrap() {
        let (f, _) = RequestFrame::split(&mut buf, h);
        let m = Method::from_function_id(h.function_id).unwrap();
        out.push((h.seq_num, Request::decode(m, &f.body).unwrap().unwrap().0));
    }
    assert!(buf.is_empty(), "a partial frame went out");
    out
}

/// The replies in bytes the session sent the client: (seq, err_code, frame).
fn replies(bytes: Option<Bytes>) -> Vec<(u32, u8, ResponseFrame)> {
    let mut buf = BytesMut::from(&bytes.unwrap_or_default()[..]);
    let mut out = Vec::new();
    while let Some(h) = check_response(&buf, 1 << 20).unwrap() {
        let (f, _) = ResponseFrame::split(&mut buf, h);
        out.push((h.seq_num, h.err_code, f));
    }
    assert!(buf.is_empty(), "a partial frame went out");
    out
}

fn decoded(m: Method, f: &ResponseFrame) -> Response {
    Response::decode(m, &f.body).unwrap().unwrap().0
}

#[test]
fn pipelined_calls_with_arbitrary_seqs_are_answered_in_order_byte_for_byte() {
    let (mut s, _) = session(Arc::new(Fake::new("p")));
    let now = Instant::now();
    let seqs = [7u32, 3, 100_000];
    for (i, &seq) in seqs.iter().enumerate() {
        let (f, raw) = request(seq, &exist(&format!("k{i}")));
        s.handle_request(&f, &raw, now);
    }
    let up = sent(s.poll_to_master());
    assert_eq!(up.iter().map(|(q, _)| *q).collect::<Vec<_>>(), seqs);
    assert_eq!(s.in_flight(), 3);
    let mut want = BytesMut::new();
    for (i, &seq) in seqs.iter().enumerate() {
        let (f, raw) = answer(seq, &Response::ExistKey(Ok(i % 2 == 0)));
        want.extend_from_slice(&raw);
        s.handle_response(&f, &raw, now + Duration::from_micros(50));
    }
    assert_eq!(
        s.poll_to_client().unwrap(),
        want.freeze(),
        "relayed as received"
    );
    assert_eq!(s.in_flight(), 0);
}

#[test]
fn a_removal_voids_the_places_others_were_told_of_on_its_way_and_at_its_answer() {
    let (mut s, shared) = session(Arc::new(Fake::new("p")));
    let now = Instant::now();
    let epoch = || shared.upstream.places_epoch();
    let e0 = epoch();
    let (f, raw) = request(1, &exist("a"));
    s.handle_request(&f, &raw, now);
    let (f, raw) = answer(1, &Response::ExistKey(Ok(true)));
    s.handle_response(&f, &raw, now);
    assert_eq!(epoch(), e0, "a lookup voids nothing");
    let rm = |force| {
        Request::Remove(crate::codec::message::RemoveArgs {
            key: key("a"),
            force,
            tenant_id: key("default"),
        })
    };
    // Unforced, it cannot take a leased value: nothing cached is void.
    let (f, raw) = request(9, &rm(false));
    s.handle_request(&f, &raw, now);
    let (f, raw) = answer(9, &Response::Remove(Ok(())));
    s.handle_response(&f, &raw, now);
    assert_eq!(epoch(), e0);
    let (f, raw) = request(2, &rm(true));
    s.handle_request(&f, &raw, now);
    assert_eq!(epoch(), e0 + 1, "on its way");
    let (f, raw) = answer(2, &Response::Remove(Ok(())));
    s.handle_response(&f, &raw, now);
    assert_eq!(epoch(), e0 + 2, "at its answer");
    // A BatchRemove is relayed whole: its method alone voids.
    let mut raw = BytesMut::new();
    RequestHeader::new(3, Method::BatchRemove.function_id(), 0).write(&mut raw);
    let h = check_request(&raw, 1 << 20).unwrap().unwrap();
    let (f, raw) = RequestFrame::split(&mut raw, h);
    s.handle_request(&f, &raw, now);
    assert_eq!(epoch(), e0 + 3);
    // Its connection closes before the answer: it may still land.
    drop(s);
    assert_eq!(epoch(), e0 + 4);
}

#[test]
fn a_local_answer_waits_for_the_calls_before_it() {
    let fake = Arc::new(Fake::new("deny").deny_prefix("deny/", -200));
    let (mut s, shared) = session(fake.clone());
    let now = Instant::now();
    for (seq, req) in [(1, exist("a")), (2, put("deny/x")), (3, exist("b"))] {
        let (f, raw) = request(seq, &req);
        s.handle_request(&f, &raw, now);
    }
    // The denied put never reaches the master, and its answer is not due yet.
    let up = sent(s.poll_to_master());
    assert_eq!(up.iter().map(|(q, _)| *q).collect::<Vec<_>>(), [1, 3]);
    assert!(s.poll_to_client().is_none());
    let (f, raw) = answer(1, &Response::ExistKey(Ok(true)));
    s.handle_response(&f, &raw, now);
    let out = replies(s.poll_to_client());
    assert_eq!(out.iter().map(|(q, ..)| *q).collect::<Vec<_>>(), [1, 2]);
    assert_eq!(
        decoded(Method::PutStart, &out[1].2),
        Response::PutStart(Err(ErrorCode::NO_AVAILABLE_HANDLE))
    );
    let (f, raw) = answer(3, &Response::ExistKey(Ok(false)));
    s.handle_response(&f, &raw, now);
    assert_eq!(replies(s.poll_to_client())[0].0, 3);
    assert_eq!(s.in_flight(), 0);
    // Denied locally: the guardrail heard of it, observe did not (nothing went up).
    assert!(fake.observations().is_empty());
    assert_eq!(
        shared.metrics.method(Some(Method::PutStart)).errors[ErrorKind::app as usize].get(),
        1
    );
}

#[test]
fn a_local_answer_with_nothing_before_it_goes_out_at_once() {
    let (mut s, _) = session(Arc::new(Fake::new("deny").deny_prefix("deny/", -200)));
    let (f, raw) = request(9, &put("deny/now"));
    s.handle_request(&f, &raw, Instant::now());
    assert!(s.has_output_for_client());
    assert!(s.poll_to_master().is_none());
    assert_eq!(replies(s.poll_to_client())[0].0, 9);
    assert_eq!(s.in_flight(), 0);
}

/// A request in `schema`'s layout.
fn request_in(seq: u32, req: &Request, schema: Schema) -> (RequestFrame, Bytes) {
    let mut body = BytesMut::new();
    let style = BodyStyle {
        schema,
        ..BodyStyle::MOONCAKE
    };
    req.encode_body(style, &mut body);
    let mut raw = BytesMut::new();
    RequestHeader::new(seq, req.method().function_id(), body.len() as u32).write(&mut raw);
    raw.extend_from_slice(&body);
    let h = check_request(&raw, 1 << 20).unwrap().unwrap();
    RequestFrame::split(&mut raw, h)
}

/// A master answer in `schema`'s layout.
fn answer_in(seq: u32, resp: &Response, schema: Schema) -> (ResponseFrame, Bytes) {
    let mut body = BytesMut::new();
    let style = BodyStyle {
        schema,
        ..BodyStyle::MOONCAKE
    };
    resp.encode_body(style, &mut body);
    frame(ResponseHeader::new(seq, errc::OK, body.len() as u32), body)
}

fn replica(location: ReplicaLocation) -> ReplicaDescriptor {
    ReplicaDescriptor {
        id: 1,
        location,
        status: ReplicaStatus::COMPLETE,
    }
}

fn memory() -> ReplicaLocation {
    ReplicaLocation::Memory(MemoryDescriptor {
        buffer_descriptor: BufferDescriptor {
            size: 10,
            buffer_address: 4096,
            protocol: key("tcp"),
            transport_endpoint: key("127.0.0.1:1"),
        },
    })
}

#[test]
fn a_call_to_a_master_of_another_release_goes_in_its_layout_and_comes_back_in_the_clients() {
    let (s, shared) = session(Arc::new(Fake::new("p")));
    let mut s = s.with_master(Some(MasterRelease::V0_3_12));
    let now = Instant::now();
    // A 0.3.13 put to a 0.3.12 master: the master's layout upstream.
    let (f, raw) = request(1, &put("k"));
    s.handle_request(&f, &raw, now);
    let mut up = BytesMut::from(&s.poll_to_master().unwrap()[..]);
    let h = check_request(&up, 1 << 20).unwrap().unwrap();
    let (upf, _) = RequestFrame::split(&mut up, h);
    let (req, style) = Request::decode(Method::PutStart, &upf.body)
        .unwrap()
        .unwrap();
    assert_eq!(style.schema, Schema::V0_3_12);
    assert_eq!(req, put("k"));
    // Its answer in the 0.3.12 layout goes back in the client's (0.3.13).
    let resp = Response::PutStart(Ok(vec![replica(memory())]));
    let (f, raw) = answer_in(1, &resp, Schema::V0_3_12);
    s.handle_response(&f, &raw, now);
    let out = replies(s.poll_to_client());
    let (back, style) = Response::decode(Method::PutStart, &out[0].2.body)
        .unwrap()
        .unwrap();
    assert_eq!((back, style.schema), (resp, Schema::V0_3_13));
    assert_eq!(shared.metrics.bridged.get(), 1);
}

#[test]
fn an_answer_an_older_client_cannot_read_fails_the_call_with_a_reason() {
    let all = Metrics::new();
    let (s, _) = session_in(MasterFaceConfig::default(), Arc::new(Fake::new("p")), &all);
    let mut s = s.with_master(Some(MasterRelease::V0_3_13));
    let now = Instant::now();
    // A 0.3.12 put whose replica the 0.3.13 master puts on a DFS.
    let (f, raw) = request_in(3, &put("k"), Schema::V0_3_12);
    s.handle_request(&f, &raw, now);
    assert_eq!(sent(s.poll_to_master()).len(), 1);
    let dfs = ReplicaLocation::DistributedFs(DfsDescriptor {
        file_path: key("/dfs/k"),
        offset: 0,
        object_size: 10,
        aligned_size: 4096,
        shard_idx: 0,
    });
    let (f, raw) = answer(3, &Response::PutStart(Ok(vec![replica(dfs)])));
    s.handle_response(&f, &raw, now);
    let out = replies(s.poll_to_client());
    assert_eq!((out[0].0, out[0].1), (3, errc::RPC_THROW_EXCEPTION));
    let (e, _) = RpcError::decode(out[0].1, &out[0].2.body).unwrap();
    assert!(
        String::from_utf8_lossy(&e.message).contains("DFS replica"),
        "{e:?}"
    );
    assert!(
        all.encode()
            .contains("moongate_bridge_untranslatable_total{method=\"PutStart\"} 1")
    );
}

#[test]
fn with_the_bridge_off_a_call_whose_layouts_differ_is_refused_and_one_that_matches_goes() {
    let cfg = MasterFaceConfig {
        bridge: false,
        ..Default::default()
    };
    let all = Metrics::new();
    let (s, _) = session_in(cfg, Arc::new(Fake::new("p")), &all);
    let mut s = s.with_master(Some(MasterRelease::V0_3_12));
    let now = Instant::now();
    // A 0.3.13 put: refused here, nothing upstream.
    let (f, raw) = request(1, &put("k"));
    s.handle_request(&f, &raw, now);
    assert!(s.poll_to_master().is_none_or(|b| b.is_empty()));
    let out = replies(s.poll_to_client());
    assert_eq!(out[0].1, errc::INVALID_RPC_ARGUMENTS);
    let (e, _) = RpcError::decode(out[0].1, &out[0].2.body).unwrap();
    assert!(
        String::from_utf8_lossy(&e.message).contains("master_face.bridge is off"),
        "{e:?}"
    );
    // An existence check has one layout and one answer in both: it goes.
    let (f, raw) = request(2, &exist("k"));
    s.handle_request(&f, &raw, now);
    assert_eq!(sent(s.poll_to_master()).len(), 1);
    assert!(
        all.encode()
            .contains("moongate_bridge_skew_refused_total{method=\"PutStart\"} 1")
    );
}

#[test]
fn a_partial_denial_is_merged_back_in_key_order_and_observed() {
    let fake = Arc::new(Fake::new("deny").deny_prefix("deny/", -200));
    let (mut s, _) = session(fake.clone());
    let now = Instant::now();
    let (f, raw) = request(5, &batch_put(&["a", "deny/b", "c", "deny/d"]));
    s.handle_request(&f, &raw, now);
    let up = sent(s.poll_to_master());
    let Request::BatchPutStart(a) = &up[0].1 else {
        panic!("{up:?}")
    };
    assert_eq!(a.keys, vec![key("a"), key("c")]);
    let (f, raw) = answer(
        5,
        &Response::BatchPutStart(vec![Ok(vec![]), Err(ErrorCode::OBJECT_ALREADY_EXISTS)]),
    );
    s.handle_response(&f, &raw, now + Duration::from_micros(80));
    let out = replies(s.poll_to_client());
    assert_eq!(
        decoded(Method::BatchPutStart, &out[0].2),
        Response::BatchPutStart(vec![
            Ok(vec![]),
            Err(ErrorCode::NO_AVAILABLE_HANDLE),
            Err(ErrorCode::OBJECT_ALREADY_EXISTS),
            Err(ErrorCode::NO_AVAILABLE_HANDLE),
        ])
    );
    assert_eq!(
        fake.observations(),
        [("BatchPutStart".to_string(), -200, 4)]
    );
}

#[test]
fn an_existence_check_goes_up_as_a_lookup_the_plugin_steers() {
    use crate::codec::types::*;
    // The plugin serves the first key and refuses the second (an empty list).
    let fake = Fake::new("budget").on_lookup(|c| {
        Ok((0..c.counts.len())
            .map(|i| if i == 0 { vec![0] } else { vec![] })
            .collect())
    });
    let (mut s, _) = session(Arc::new(fake));
    let now = Instant::now();
    let req = Request::BatchExistKey(KeysArgs {
        keys: vec![key("a"), key("b"), key("c")].into(),
        tenant_id: key("default"),
    });
    let (f, raw) = request(9, &req);
    s.handle_request(&f, &raw, now);
    let up = sent(s.poll_to_master());
    assert_eq!(up.len(), 1);
    let Request::BatchGetReplicaList(a) = &up[0].1 else {
        panic!("not sent as a lookup: {:?}", up[0].1);
    };
    assert_eq!((up[0].0, a.keys.len()), (9, 3));
    let found = || {
        Ok(GetReplicaListResponse {
            replicas: vec![ReplicaDescriptor {
                id: 1,
                location: ReplicaLocation::Disk(DiskDescriptor {
                    file_path: key("f"),
                    object_size: 10,
                }),
                status: ReplicaStatus::COMPLETE,
            }],
            lease_ttl_ms: 10_000,
            object_checksum: None,
        })
    };
    let (f, raw) = answer(
        9,
        &Response::BatchGetReplicaList(vec![found(), found(), Err(ErrorCode::OBJECT_NOT_FOUND)]),
    );
    s.handle_response(&f, &raw, now);
    let back = replies(s.poll_to_client());
    assert_eq!(back.len(), 1);
    assert_eq!(
        decoded(Method::BatchExistKey, &back[0].2),
        Response::BatchExistKey(vec![Ok(true), Ok(false), Ok(false)]),
        "a key the plugin will not serve does not exist"
    );
    // Without a steering plugin, an existence check goes up as it came.
    let (mut s, _) = session(Arc::new(Fake::new("p")));
    let (f, raw) = request(3, &req);
    s.handle_request(&f, &raw, now);
    assert!(matches!(
        sent(s.poll_to_master())[0].1,
        Request::BatchExistKey(_)
    ));
}

#[test]
fn a_split_batch_whose_part_fails_fails_as_a_whole_with_the_clients_seq() {
    let cfg = MasterFaceConfig {
        max_batch_keys: 2,
        ..MasterFaceConfig::default()
    };
    let (mut s, shared) = session_with(cfg, Arc::new(Fake::new("p")));
    let now = Instant::now();
    let keys: Vec<Bytes> = (0..5).map(|i| key(&format!("k{i}"))).collect();
    let req = Request::BatchExistKey(KeysArgs {
        keys: keys.clone().into(),
        tenant_id: key("default"),
    });
    let (f, raw) = request(42, &req);
    s.handle_request(&f, &raw, now);
    let up = sent(s.poll_to_master());
    assert_eq!(
        up.iter()
            .map(|(q, r)| (*q, r.key_count()))
            .collect::<Vec<_>>(),
        [(42, 2), (42, 2), (42, 1)]
    );
    let (f, raw) = answer(42, &Response::BatchExistKey(vec![Ok(true), Ok(true)]));
    s.handle_response(&f, &raw, now);
    let (f, raw) = transport_error(42);
    s.handle_response(&f, &raw, now);
    assert_eq!(s.in_flight(), 1, "the entry stays until its last part");
    assert!(s.poll_to_client().is_none());
    let (f, raw) = answer(42, &Response::BatchExistKey(vec![Ok(false)]));
    s.handle_response(&f, &raw, now);
    let out = replies(s.poll_to_client());
    assert_eq!(out.len(), 1);
    assert_eq!((out[0].0, out[0].1), (42, errc::RPC_THROW_EXCEPTION));
    assert_eq!(s.in_flight(), 0);
    assert_eq!(
        shared.metrics.method(Some(Method::BatchExistKey)).errors[ErrorKind::rpc as usize].get(),
        1
    );
}

#[test]
fn split_parts_merge_into_the_unsplit_answer() {
    let cfg = MasterFaceConfig {
        max_batch_keys: 2,
        ..MasterFaceConfig::default()
    };
    let (mut s, _) = session_with(cfg, Arc::new(Fake::new("p")));
    let now = Instant::now();
    let req = Request::BatchExistKey(KeysArgs {
        keys: (0..3).map(|i| key(&format!("k{i}"))).collect(),
        tenant_id: key("default"),
    });
    let (f, raw) = request(8, &req);
    s.handle_request(&f, &raw, now);
    assert_eq!(sent(s.poll_to_master()).len(), 2);
    for part in [
        vec![Ok(true), Err(ErrorCode::OBJECT_NOT_FOUND)],
        vec![Ok(false)],
    ] {
        let (f, raw) = answer(8, &Response::BatchExistKey(part));
        s.handle_response(&f, &raw, now);
    }
    let out = replies(s.poll_to_client());
    assert_eq!(
        decoded(Method::BatchExistKey, &out[0].2),
        Response::BatchExistKey(vec![Ok(true), Err(ErrorCode::OBJECT_NOT_FOUND), Ok(false)])
    );
}

#[test]
fn the_in_flight_bound_is_reported_and_freed_by_answers() {
    let cfg = MasterFaceConfig {
        max_inflight_per_connection: 2,
        ..MasterFaceConfig::default()
    };
    let (mut s, _) = session_with(cfg, Arc::new(Fake::new("p")));
    let now = Instant::now();
    for seq in 1..=2 {
        assert!(s.has_room());
        let (f, raw) = request(seq, &exist("k"));
        s.handle_request(&f, &raw, now);
    }
    assert!(!s.has_room(), "backpressure at the bound");
    let (f, raw) = answer(1, &Response::ExistKey(Ok(true)));
    s.handle_response(&f, &raw, now);
    assert!(s.has_room());
}

#[test]
fn an_answer_with_an_unknown_seq_is_relayed_and_counted() {
    let all = Metrics::new();
    let (mut s, _) = session_in(MasterFaceConfig::default(), Arc::new(Fake::new("p")), &all);
    let now = Instant::now();
    let (f, raw) = request(1, &exist("k"));
    s.handle_request(&f, &raw, now);
    let (f, raw) = answer(77, &Response::ExistKey(Ok(true)));
    s.handle_response(&f, &raw, now);
    assert_eq!(s.poll_to_client().unwrap(), raw);
    assert!(all.encode().contains(
        "moongate_master_frame_errors_total{side=\"upstream\",kind=\"unmatched_seq\"} 1"
    ));
}

#[test]
fn a_decided_put_is_observed_with_its_latency_and_keys() {
    let fake = Arc::new(Fake::new("deny").deny_prefix("nothing-matches/", -200));
    let (mut s, _) = session(fake.clone());
    let now = Instant::now();
    let (f, raw) = request(3, &put("k"));
    s.handle_request(&f, &raw, now);
    let (f, raw) = answer(3, &Response::PutStart(Ok(vec![])));
    s.handle_response(&f, &raw, now + Duration::from_micros(120));
    assert_eq!(fake.observations(), [("PutStart".to_string(), 0, 1)]);
    assert_eq!(fake.observed.lock().unwrap()[0].latency_us, 120);
}

//! The relay against a fake owner that speaks the offload-read calls: cut reads
//! merged and released part by part, a failed part's siblings freed, made-up ids
//! that expired, garbage from a rank.

use std::sync::atomic::{AtomicU64, Ordering};

use super::owner::request;
use super::*;
use crate::calls::offload_read::tests::{answer_of, call_of};
use crate::metrics::Metrics;
use crate::policy::Policy;
use crate::policy::fake::Fake;

/// What the fake owner saw.
#[derive(Default)]
struct Seen {
    reads: Mutex<Vec<usize>>,
    released: Mutex<Vec<u64>>,
}

/// An owner that stages every read as a new batch (pointers 1000 x id + i) and
/// answers `INVALID_KEY`-like errors for a part naming key `k{bad}`.
async fn fake_owner(bad: Option<usize>) -> (String, Arc<Seen>) {
    fake_owner_with(bad, false).await
}

/// `one_each`: the owner closes every connection after one answer (as an owner that
/// restarted, or closes idle connections, leaves the relay's pooled ones).
async fn fake_owner_with(bad: Option<usize>, one_each: bool) -> (String, Arc<Seen>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let seen = Arc::new(Seen::default());
    let next = Arc::new(AtomicU64::new(1));
    let s2 = seen.clone();
    tokio::spawn(async move {
        loop {
            let (mut sock, _) = l.accept().await.unwrap();
            let (seen, next) = (s2.clone(), next.clone());
            tokio::spawn(async move {
                let mut buf = BytesMut::new();
                loop {
                    let h = loop {
                        if let Ok(Some(h)) = check_request(&buf, 1 << 20) {
                            break h;
                        }
                        if sock.read_buf(&mut buf).await.unwrap_or(0) == 0 {
                            return;
                        }
                    };
                    let (f, _) = RequestFrame::split(&mut buf, h);
                    let body = if h.function_id == offload_read::read_id() {
                        let c = ReadCall::decode(&f.body).unwrap();
                        lock(&seen.reads).push(c.len());
                        let named_bad = bad.is_some_and(|b| {
                            c.keys().any(|k| k == format!("default\0k{b}").as_bytes())
                        });
                        if named_bad {
                            // expected<..., ErrorCode>: the error alternative.
                            let mut a = answer_of(0, 0, 0, 0).to_vec();
                            let at = a.iter().position(|&b| b == 0).unwrap() + 1;
                            a.truncate(at);
                            a.extend_from_slice(&[0, 0xfe, 0xff, 0xff, 0xff]);
                            Bytes::from(a)
                        } else {
                            let id = next.fetch_add(1, Ordering::Relaxed);
                            answer_of(id, c.len(), 1000 * id, 5000)
                        }
                    } else {
                        let r = Release::decode(&f.body).unwrap();
                        lock(&seen.released).push(r.batch_id().unwrap());
                        offload_read::release_answer(true)
                    };
                    let mut out = BytesMut::new();
                    ResponseHeader::new(h.seq_num, 0, body.len() as u32).write(&mut out);
                    out.extend_from_slice(&body);
                    sock.write_all(&out).await.unwrap();
                    if one_each {
                        return;
                    }
                }
            });
        }
    });
    (addr, seen)
}

fn face(cfg: OwnerFaceConfig, all: &Metrics) -> Arc<OwnerFace> {
    let fake: Arc<dyn Policy> = Arc::new(Fake::new("p"));
    let policy =
        Registry::with_policies(Default::default(), None, all.policy.clone(), vec![fake]).unwrap();
    OwnerFace::new(
        cfg,
        all.owner_face.clone(),
        policy,
        Arc::new(Topology::new(all.topology.clone())),
        CancellationToken::new(),
    )
}

/// One call from a rank on `s`; the answer's header and body.
async fn call(s: &mut TcpStream, seq: u32, id: u32, body: &Bytes) -> (ResponseHeader, Bytes) {
    s.write_all(&request(&RequestHeader::new(seq, id, 0), body))
        .await
        .unwrap();
    let mut buf = BytesMut::new();
    loop {
        if let Some(h) = check_response(&buf, 1 << 20).unwrap() {
            let (f, _) = crate::codec::ResponseFrame::split(&mut buf, h);
            return (f.header, f.body);
        }
        assert!(s.read_buf(&mut buf).await.unwrap() > 0, "closed");
    }
}

async fn release(s: &mut TcpStream, seq: u32, id: u64) -> (ResponseHeader, Bytes) {
    let body = offload_read::release_call(id);
    call(s, seq, offload_read::release_id(), &body).await
}

fn cut_every(keys: usize) -> OwnerFaceConfig {
    OwnerFaceConfig {
        enabled: true,
        part_keys: keys,
        ..Default::default()
    }
}

#[tokio::test]
async fn a_cut_read_is_one_answer_and_its_release_frees_every_part() {
    let (owner, seen) = fake_owner(None).await;
    let all = Metrics::new();
    let f = face(cut_every(2), &all);
    let relay = f.endpoint_for(&Bytes::from(owner.clone())).unwrap();
    assert_eq!(
        f.endpoint_for(&Bytes::from(owner)).unwrap(),
        relay,
        "one per owner"
    );
    let mut s = TcpStream::connect(std::str::from_utf8(&relay).unwrap())
        .await
        .unwrap();
    let (h, body) = call(&mut s, 7, offload_read::read_id(), &call_of(5, 100)).await;
    assert_eq!((h.seq_num, h.err_code), (7, errc::OK));
    let a = ReadAnswer::decode(&body).unwrap();
    let id = a.batch_id().unwrap();
    assert!(id & staged::SYNTHETIC != 0);
    assert_eq!(a.staged(), 5);
    let mut parts = lock(&seen.reads).clone();
    parts.sort_unstable();
    assert_eq!(parts, vec![1, 2, 2]);
    assert_eq!(all.owner_face.staged_bytes.get(), 500);
    let (_, body) = release(&mut s, 8, id).await;
    assert_eq!(offload_read::released(&body), Some(true));
    let mut released = lock(&seen.released).clone();
    released.sort_unstable();
    assert_eq!(released, vec![1, 2, 3]);
    assert_eq!(all.owner_face.staged_bytes.get(), 0);
    // Released already: unknown now, answered false without asking the owner.
    let (_, body) = release(&mut s, 9, id).await;
    assert_eq!(offload_read::released(&body), Some(false));
    assert_eq!(lock(&seen.released).len(), 3);
    // A whole read keeps the owner's id.
    let (_, body) = call(&mut s, 10, offload_read::read_id(), &call_of(2, 100)).await;
    assert_eq!(ReadAnswer::decode(&body).unwrap().batch_id(), Some(4));
}

/// An experiment that assigns arms by client: a rank's SSD reads are cut by the
/// `split` hook of the arm its client id (carried by its master-face calls, here
/// this test process's) falls in, not by the arm of the zero id.
#[tokio::test]
async fn a_ranks_reads_are_split_by_the_arm_its_client_falls_in() {
    use crate::policy::experiment::{ArmSpec, Assign, ExperimentSpec};
    let (owner, seen) = fake_owner(None).await;
    let all = Metrics::new();
    let whole: Arc<dyn Policy> = Arc::new(Fake::new("whole"));
    let each: Arc<dyn Policy> =
        Arc::new(Fake::new("each").split(|c| Ok((1..c.sizes.len() as u32).collect())));
    let arm = |name: &str| ArmSpec {
        name: name.into(),
        plugin: name.into(),
        weight: 1,
    };
    let spec = ExperimentSpec {
        assign: Assign::Client,
        control: None,
        arms: vec![arm("whole"), arm("each")],
        guardrail: Default::default(),
        capacity: Default::default(),
    };
    let policy = Registry::with_policies(
        Default::default(),
        Some(spec),
        all.policy.clone(),
        vec![whole, each],
    )
    .unwrap();
    let set = policy.current();
    let zero_arm = set.pick(&Uuid::default(), None);
    let client = (1u64..=255)
        .map(|b| Uuid {
            first: b,
            second: 0,
        })
        .find(|u| set.pick(u, None) != zero_arm)
        .expect("a client in the other arm");
    let cuts = set.arms[set.pick(&client, None)].plugin.name() == "each";
    let topology = Arc::new(Topology::new(all.topology.clone()));
    let f = OwnerFace::new(
        OwnerFaceConfig {
            enabled: true,
            ..Default::default()
        },
        all.owner_face.clone(),
        policy,
        topology.clone(),
        CancellationToken::new(),
    );
    let relay = f.endpoint_for(&Bytes::from(owner)).unwrap();
    let mut s = TcpStream::connect(std::str::from_utf8(&relay).unwrap())
        .await
        .unwrap();
    // The rank's master-face calls named `client`. (This test process is the rank
    // and moongate at once: a process is not looked for among its own sockets, so
    // the rank is known by its address here, as a remote one would be.)
    let key = PeerKey::Addr(s.local_addr().unwrap().ip());
    topology.join(key).saw_client(client);
    let (h, _) = call(&mut s, 1, offload_read::read_id(), &call_of(4, 100)).await;
    assert_eq!(h.err_code, errc::OK);
    let parts = lock(&seen.reads).clone();
    if cuts {
        assert_eq!(parts, vec![1, 1, 1, 1], "cut by the client's arm");
    } else {
        assert_eq!(parts, vec![4], "whole, as the client's arm says");
    }
    assert_eq!(all.owner_face.split_reads.get(), u64::from(cuts));
}

#[tokio::test]
async fn a_failed_part_fails_the_read_and_frees_its_siblings() {
    let (owner, seen) = fake_owner(Some(3)).await;
    let all = Metrics::new();
    let f = face(cut_every(2), &all);
    let relay = f.endpoint_for(&Bytes::from(owner)).unwrap();
    let mut s = TcpStream::connect(std::str::from_utf8(&relay).unwrap())
        .await
        .unwrap();
    let (h, body) = call(&mut s, 1, offload_read::read_id(), &call_of(6, 100)).await;
    assert_eq!(h.err_code, errc::OK);
    let a = ReadAnswer::decode(&body).unwrap();
    assert_eq!(a.batch_id(), None, "the owner's error, as it gave it");
    let mut released = lock(&seen.released).clone();
    released.sort_unstable();
    assert_eq!(released, vec![1, 2], "the two parts that staged were freed");
    assert_eq!(all.owner_face.staged_bytes.get(), 0);
}

#[tokio::test]
async fn garbage_closes_that_connection_only_and_a_dead_owner_fails_that_call() {
    let (owner, _) = fake_owner(None).await;
    let all = Metrics::new();
    let f = face(cut_every(0), &all);
    let relay = f.endpoint_for(&Bytes::from(owner)).unwrap();
    let relay = std::str::from_utf8(&relay).unwrap().to_string();
    let mut good = TcpStream::connect(&relay).await.unwrap();
    let mut bad = TcpStream::connect(&relay).await.unwrap();
    bad.write_all(&[0xff; 64]).await.unwrap();
    let mut b = [0u8; 16];
    assert_eq!(bad.read(&mut b).await.unwrap_or(0), 0, "closed, no answer");
    assert_eq!(all.owner_face.frame_errors.get(), 1);
    let (_, body) = call(&mut good, 1, offload_read::read_id(), &call_of(1, 10)).await;
    assert!(ReadAnswer::decode(&body).unwrap().batch_id().is_some());
    // An owner nobody listens for: a transport error for the call, nothing else.
    let gone = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dead = gone.local_addr().unwrap().to_string();
    drop(gone);
    let relay = f.endpoint_for(&Bytes::from(dead)).unwrap();
    let mut s = TcpStream::connect(std::str::from_utf8(&relay).unwrap())
        .await
        .unwrap();
    let (h, _) = call(&mut s, 5, offload_read::read_id(), &call_of(1, 10)).await;
    assert_eq!((h.seq_num, h.err_code), (5, errc::RPC_THROW_EXCEPTION));
    assert_eq!(all.owner_face.owners.get(), 2);
    let (_, body) = call(&mut good, 2, offload_read::read_id(), &call_of(1, 10)).await;
    assert!(ReadAnswer::decode(&body).unwrap().batch_id().is_some());
}

#[tokio::test]
async fn a_pooled_connection_the_owner_closed_is_replaced() {
    let (owner, seen) = fake_owner_with(None, true).await;
    let all = Metrics::new();
    let f = face(cut_every(0), &all);
    let relay = f.endpoint_for(&Bytes::from(owner)).unwrap();
    let mut s = TcpStream::connect(std::str::from_utf8(&relay).unwrap())
        .await
        .unwrap();
    for seq in 1..4 {
        let (h, body) = call(&mut s, seq, offload_read::read_id(), &call_of(1, 10)).await;
        assert_eq!(h.err_code, errc::OK, "call {seq}");
        assert!(ReadAnswer::decode(&body).unwrap().batch_id().is_some());
    }
    assert_eq!(lock(&seen.reads).len(), 3);
}

#[tokio::test]
async fn a_relay_no_answer_names_any_more_is_closed() {
    let (owner, _) = fake_owner(None).await;
    let all = Metrics::new();
    let f = face(
        OwnerFaceConfig {
            idle_owner_ms: 300,
            ..cut_every(0)
        },
        &all,
    );
    let owner = Bytes::from(owner);
    let relay = f.endpoint_for(&owner).unwrap();
    let addr = std::str::from_utf8(&relay).unwrap().to_string();
    // A rank connection open keeps it, however long.
    let s = TcpStream::connect(&addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(all.owner_face.owners.get(), 1);
    drop(s);
    let deadline = Instant::now() + Duration::from_secs(10);
    while all.owner_face.owners_retired.get() == 0 {
        assert!(Instant::now() < deadline, "not retired");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(all.owner_face.owners.get(), 0);
    // Its listener is closed (the accept loop may take a moment to see the stop)...
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(&addr).await.is_ok() {
        assert!(Instant::now() < deadline, "still listening");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // ... and the next answer naming the owner opens a new relay.
    assert!(f.endpoint_for(&owner).is_some());
    assert_eq!(all.owner_face.owners.get(), 1);
}

#[tokio::test]
async fn a_read_waits_for_room_until_a_release_or_its_deadline() {
    let (owner, _) = fake_owner(None).await;
    let all = Metrics::new();
    let f = face(
        OwnerFaceConfig {
            max_staged_bytes: 150,
            max_wait_ms: 10_000,
            ..cut_every(0)
        },
        &all,
    );
    let relay = f.endpoint_for(&Bytes::from(owner)).unwrap();
    let addr = std::str::from_utf8(&relay).unwrap().to_string();
    let mut a = TcpStream::connect(&addr).await.unwrap();
    let (_, body) = call(&mut a, 1, offload_read::read_id(), &call_of(1, 100)).await;
    let held = ReadAnswer::decode(&body).unwrap().batch_id().unwrap();
    // 100 staged: another 100 does not fit under 150, so it waits...
    let mut b = TcpStream::connect(&addr).await.unwrap();
    let waiting =
        tokio::spawn(
            async move { call(&mut b, 1, offload_read::read_id(), &call_of(1, 100)).await },
        );
    let deadline = Instant::now() + Duration::from_secs(10);
    while all.owner_face.waits.get() == 0 {
        assert!(Instant::now() < deadline, "never waited");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!waiting.is_finished());
    // ... until the first is released.
    let (_, body) = release(&mut a, 2, held).await;
    assert_eq!(offload_read::released(&body), Some(true));
    let (h, body) = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("answered once room freed")
        .unwrap();
    assert_eq!(h.err_code, errc::OK);
    assert!(ReadAnswer::decode(&body).unwrap().batch_id().is_some());
    assert_eq!(all.owner_face.over_budget.get(), 0);
    assert_eq!(all.owner_face.staged_bytes.get(), 100);

    // With a short deadline a read past the bound goes anyway, counted.
    let f = face(
        OwnerFaceConfig {
            max_staged_bytes: 150,
            max_wait_ms: 50,
            ..cut_every(0)
        },
        &all,
    );
    let (owner, _) = fake_owner(None).await;
    let relay = f.endpoint_for(&Bytes::from(owner)).unwrap();
    let mut c = TcpStream::connect(std::str::from_utf8(&relay).unwrap())
        .await
        .unwrap();
    for seq in 1..3 {
        let (h, _) = call(&mut c, seq, offload_read::read_id(), &call_of(1, 100)).await;
        assert_eq!(h.err_code, errc::OK);
    }
    assert_eq!(all.owner_face.over_budget.get(), 1);
}

#[tokio::test]
async fn past_max_owners_an_owner_is_read_directly() {
    let all = Metrics::new();
    let f = face(
        OwnerFaceConfig {
            max_owners: 1,
            ..cut_every(0)
        },
        &all,
    );
    assert!(
        f.endpoint_for(&Bytes::from_static(b"127.0.0.1:1"))
            .is_some()
    );
    assert!(
        f.endpoint_for(&Bytes::from_static(b"127.0.0.1:2"))
            .is_none()
    );
    assert_eq!(all.owner_face.owners_refused.get(), 1);
}

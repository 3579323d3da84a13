//! Bad input gives typed errors, never a panic: truncated bodies, wrong type codes and
//! literals, and random or mutated bytes (a deterministic stand-in for the cargo-fuzz
//! target in `proxy/fuzz`, so CI exercises the same entry point).

use bytes::{Bytes, BytesMut};
use moongate::codec::error::DecodeError;
use moongate::codec::frame::check_request;
use moongate::codec::message::{Request, Response};
use moongate::codec::{Method, RequestFrame, fuzz_one};

fn captured_requests() -> Vec<(Method, Bytes, Bytes)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/master-rpc/session_extended");
    let mut out = Vec::new();
    for conn in 1..=2 {
        let data = std::fs::read(dir.join(format!("conn{conn}.c2s.bin"))).unwrap();
        let mut buf = BytesMut::from(&data[..]);
        while let Some(h) = check_request(&buf, 1 << 30).unwrap() {
            let (f, raw) = RequestFrame::split(&mut buf, h);
            if let Some(m) = Method::from_function_id(h.function_id) {
                out.push((m, f.body, raw));
            }
        }
    }
    out
}

/// Tiny deterministic PRNG (xorshift64*): reproducible without a dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

#[test]
fn every_truncation_of_every_typed_body_is_an_error() {
    let mut checked = 0;
    for (m, body, _) in captured_requests() {
        if body.is_empty() || Request::decode(m, &body).is_none() {
            continue;
        }
        for cut in 0..body.len() {
            let r = Request::decode(m, &body.slice(..cut)).unwrap();
            assert!(r.is_err(), "{m} cut at {cut} decoded");
            checked += 1;
        }
    }
    assert!(checked > 1000, "{checked}");
}

#[test]
fn wrong_type_code_and_wrong_literal_are_told_apart() {
    let (m, body, _) = captured_requests()
        .into_iter()
        .find(|(m, _, _)| *m == Method::PutStart)
        .unwrap();
    let mut wrong_hash = body.to_vec();
    wrong_hash[1] ^= 0x40;
    assert!(matches!(
        Request::decode(m, &Bytes::from(wrong_hash)).unwrap(),
        Err(DecodeError::TypeMismatch { .. })
    ));
    let mut wrong_lit = body.to_vec();
    wrong_lit[6] ^= 0x01; // inside the literal, hash intact
    assert_eq!(
        Request::decode(m, &Bytes::from(wrong_lit))
            .unwrap()
            .unwrap_err(),
        DecodeError::LiteralMismatch
    );
    // An ExistKey body sent under GetReplicaList's id has the same type: it decodes,
    // because the type code does not identify a method (spec §5, note 1).
    let (_, ek, _) = captured_requests()
        .into_iter()
        .find(|(m, _, _)| *m == Method::ExistKey)
        .unwrap();
    assert!(
        Request::decode(Method::GetReplicaList, &ek)
            .unwrap()
            .is_ok()
    );
    // ...but not as a response.
    assert!(
        Response::decode(Method::GetReplicaList, &ek)
            .unwrap()
            .is_err()
    );
}

#[test]
fn random_bytes_never_panic() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for _ in 0..20_000 {
        let n = (rng.next() % 300) as usize;
        let v: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
        fuzz_one(&v);
    }
}

#[test]
fn mutated_captured_frames_never_panic() {
    let frames = captured_requests();
    let mut rng = Rng(42);
    for _ in 0..20_000 {
        let (_, _, raw) = &frames[(rng.next() as usize) % frames.len()];
        let mut v = raw.to_vec();
        for _ in 0..1 + rng.next() % 4 {
            let i = (rng.next() as usize) % v.len();
            // keep the header sane most of the time so bodies get exercised
            if i >= 20 || rng.next().is_multiple_of(8) {
                v[i] = rng.next() as u8;
            }
        }
        if rng.next().is_multiple_of(4) {
            let keep = (rng.next() as usize) % v.len();
            v.truncate(keep);
        }
        fuzz_one(&v);
    }
}

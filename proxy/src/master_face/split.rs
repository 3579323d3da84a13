//! Batch splitting: where a batch call is cut into bounded parts on its way to the
//! master, and how the answers of those parts become the one reply the client expects.
//!
//! The parts go out back to back on the connection's own upstream connection, all with
//! the client's seq number (the master echoes it and answers in request order, so the
//! parts' answers arrive together and in order). Their per-key results are concatenated
//! in key order; the merged reply is what the master gives for the same keys unsplit. A
//! part answered with a transport error makes the whole reply that error, as the master
//! would have failed the unsplit call.
//!
//! No sockets here: the connection feeds answers in and writes out what comes back.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;

use crate::calls::{AnswerExt, CallExt};
use crate::codec::frame::errc;
use crate::codec::message::{Request, Response, RpcError};
use crate::codec::{BodyStyle, Method, ResponseFrame};
use crate::policy::active::Arm;
use crate::policy::registry::Registry;

/// Where to cut `req` (indexes where a new part starts, rising, inside `1..keys`): every
/// `max_keys` keys (0 = no bound) and wherever the arm's plugin says. Empty: send whole.
pub fn points(
    req: &Request,
    max_keys: usize,
    policy: &Registry,
    arm: &Arm,
    put_bytes_in_flight: u64,
) -> Vec<usize> {
    let n = req.key_count();
    if n < 2 || !crate::calls::splittable(req.method()) {
        return Vec::new();
    }
    let by_count = (max_keys > 0 && n > max_keys)
        .then(|| (1..n.div_ceil(max_keys)).map(move |i| i * max_keys))
        .into_iter()
        .flatten();
    if !policy.splits_batches(arm) {
        return by_count.collect();
    }
    let zeros;
    let sizes = match crate::calls::put::Put::of(req) {
        Some(p) => p.sizes(),
        None => {
            zeros = vec![0; n];
            &zeros[..]
        }
    };
    policy.cut(arm, sizes, put_bytes_in_flight, 0, by_count)
}

/// The answers of a split call's parts so far.
#[derive(Default)]
pub struct Merge {
    /// Parts answered so far.
    pub got: usize,
    merged: Option<(Response, BodyStyle)>,
    /// The first part that failed: its raw error frame (or one moongate made), which
    /// becomes the whole reply.
    failed: Option<Bytes>,
}

/// The merged outcome of all parts.
pub enum Merged {
    /// Every part succeeded: the concatenated reply and the style to encode it in.
    Reply(Response, BodyStyle),
    /// A part failed as a whole: these bytes (a complete frame) are the reply.
    Failed(Bytes),
}

impl Merge {
    /// Takes the answer to the next part of a split `method` call.
    pub fn add(&mut self, method: Method, frame: &ResponseFrame, raw: &Bytes) {
        self.got += 1;
        if self.failed.is_some() {
            return;
        }
        if frame.header.err_code != errc::OK {
            self.failed = Some(raw.clone());
            return;
        }
        let part = match Response::decode(method, &frame.body) {
            Some(Ok(p)) => p,
            Some(Err(e)) => {
                self.failed = Some(RpcError::reply(
                    frame.header.seq_num,
                    &format!(
                        "moongate: part {} of a split {method} did not decode: {e}",
                        self.got
                    ),
                ));
                return;
            }
            None => {
                self.failed = Some(RpcError::reply(
                    frame.header.seq_num,
                    &format!("moongate: {method} cannot be merged"),
                ));
                return;
            }
        };
        match &mut self.merged {
            None => self.merged = Some(part),
            Some((m, _)) => {
                if m.append(part.0).is_err() {
                    self.failed = Some(RpcError::reply(
                        frame.header.seq_num,
                        &format!("moongate: parts of a split {method} answered different methods"),
                    ));
                }
            }
        }
    }

    pub fn finish(self, seq: u32) -> Merged {
        match (self.failed, self.merged) {
            (Some(raw), _) => Merged::Failed(raw),
            (None, Some((r, s))) => Merged::Reply(r, s),
            (None, None) => {
                Merged::Failed(RpcError::reply(seq, "moongate: split call got no answers"))
            }
        }
    }
}

/// Bytes of put-family starts forwarded and not yet answered, node-wide; what a plugin's
/// `split` sees as in flight. The guard gives its bytes back when the call ends, however
/// it ends (answered, or its connection dropped).
pub struct InFlightBytes {
    total: Arc<AtomicU64>,
    bytes: u64,
}

impl InFlightBytes {
    pub fn take(total: &Arc<AtomicU64>, bytes: u64) -> InFlightBytes {
        total.fetch_add(bytes, Ordering::Relaxed);
        InFlightBytes {
            total: total.clone(),
            bytes,
        }
    }
}

impl Drop for InFlightBytes {
    fn drop(&mut self) {
        self.total.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::ResponseHeader;
    use crate::codec::message::KeysArgs;
    use bytes::BytesMut;

    fn frame(seq: u32, resp: &Response) -> (ResponseFrame, Bytes) {
        let mut body = BytesMut::new();
        resp.encode_body(BodyStyle::MOONCAKE, &mut body);
        let f = ResponseFrame {
            header: ResponseHeader::new(seq, errc::OK, 0),
            body: body.freeze(),
            attachment: Bytes::new(),
        };
        let mut raw = BytesMut::new();
        f.clone().write(&mut raw);
        (f, raw.freeze())
    }

    #[test]
    fn parts_concatenate_in_order() {
        let mut m = Merge::default();
        for part in [
            vec![Ok(true), Ok(false)],
            vec![Err(crate::codec::types::ErrorCode(-704))],
        ] {
            let (f, raw) = frame(5, &Response::BatchExistKey(part));
            m.add(Method::BatchExistKey, &f, &raw);
        }
        assert_eq!(m.got, 2);
        let Merged::Reply(r, _) = m.finish(5) else {
            panic!("merge failed")
        };
        assert_eq!(
            r,
            Response::BatchExistKey(vec![
                Ok(true),
                Ok(false),
                Err(crate::codec::types::ErrorCode(-704))
            ])
        );
    }

    #[test]
    fn a_failed_or_garbled_part_fails_the_whole_call() {
        let (ok, ok_raw) = frame(9, &Response::BatchExistKey(vec![Ok(true)]));
        let mut garbled = ok.clone();
        garbled.body = Bytes::from_static(b"\x01\x02");
        let mut m = Merge::default();
        m.add(Method::BatchExistKey, &ok, &ok_raw);
        m.add(Method::BatchExistKey, &garbled, &Bytes::new());
        let Merged::Failed(bytes) = m.finish(9) else {
            panic!("garbled part merged")
        };
        let mut buf = BytesMut::from(&bytes[..]);
        let h = crate::codec::frame::check_response(&buf, 1 << 20)
            .unwrap()
            .unwrap();
        assert_eq!((h.seq_num, h.err_code), (9, errc::RPC_THROW_EXCEPTION));
        let (f, _) = ResponseFrame::split(&mut buf, h);
        let (e, _) = RpcError::decode(h.err_code, &f.body).unwrap();
        assert!(String::from_utf8_lossy(&e.message).contains("part 2"));
    }

    #[test]
    fn bound_cuts_every_max_keys() {
        let req = Request::BatchExistKey(KeysArgs {
            keys: (0..2500).map(|i| Bytes::from(i.to_string())).collect(),
            tenant_id: Bytes::new(),
        });
        let policy = registry(crate::policy::fake::Fake::new("none"));
        let set = policy.current();
        assert_eq!(points(&req, 1000, &policy, &set.arms[0], 0), [1000, 2000]);
        assert!(points(&req, 0, &policy, &set.arms[0], 0).is_empty());
        assert!(points(&req, 2500, &policy, &set.arms[0], 0).is_empty());
    }

    fn registry(fake: crate::policy::fake::Fake) -> Arc<Registry> {
        let p: Arc<dyn crate::policy::Policy> = Arc::new(fake);
        Registry::with_policies(
            crate::policy::PolicyConfig::default(),
            None,
            crate::metrics::Metrics::new().policy.clone(),
            vec![p],
        )
        .unwrap()
    }

    #[test]
    fn the_plugins_points_join_the_bound_and_see_put_sizes() {
        let keys: Vec<Bytes> = (0..10).map(|i| Bytes::from(i.to_string())).collect();
        let put = Request::BatchPutStart(crate::codec::message::BatchPutStartArgs {
            client_id: Default::default(),
            keys,
            slice_lengths: (1..=10).collect(),
            config: Default::default(),
            tenant_id: Bytes::new(),
        });
        // Cuts before the first key whose size is 5 or more, and at 4 (also a bound point).
        let fake = crate::policy::fake::Fake::new("sizes").split(|c| {
            let at = c.sizes.iter().position(|&s| s >= 5).unwrap_or(0) as u32;
            Ok(vec![at, 8])
        });
        let policy = registry(fake);
        let set = policy.current();
        assert_eq!(points(&put, 4, &policy, &set.arms[0], 0), [4, 8]);
        assert_eq!(points(&put, 3, &policy, &set.arms[0], 0), [3, 4, 6, 8, 9]);
        assert!(
            points(&put, 0, &policy, &set.arms[0], 0) == [4, 8],
            "the plugin alone"
        );
    }
}

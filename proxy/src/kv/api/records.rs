//! The kv face's batch records read from a body as it arrives. The format itself is
//! defined once, in the client crate both sides use ([`moongate_kv::records`]: a put
//! record is `u16 key_len | key | u64 value_len | value`, a get record `u16 status | u64
//! len | payload`, little-endian). Pure: knows no sockets, no store and no HTTP beyond
//! pulling body frames.

use bytes::{Buf, Bytes, BytesMut};
use http_body_util::BodyExt;
use thiserror::Error;

pub use moongate_kv::records::CONTENT_TYPE;
use moongate_kv::records::{KEY_HEAD, LEN_HEAD};

#[derive(Debug, Error)]
pub enum RecordError {
    #[error("the body ended inside a record ({0} bytes of it arrived)")]
    Truncated(usize),
    #[error("a record has an empty key")]
    EmptyKey,
    #[error("reading the body: {0}")]
    Body(String),
    #[error("no body bytes arrived for {0:?} (kv.timeout_ms)")]
    Stalled(std::time::Duration),
}

/// The head of one get-answer record.
pub fn get_head(status: u16, len: u64) -> Bytes {
    Bytes::copy_from_slice(&moongate_kv::records::get_head(status, len))
}

/// One put record, whole (for tests and tools).
pub fn put_record(key: &[u8], value: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    moongate_kv::records::put_record(&mut b, key, value).expect("a short key");
    b
}

/// Pulls put records out of a request body as it arrives: the caller reads a record's
/// head, decides (size limits, byte budget), then takes or skips its value, so a value
/// is only buffered once it has room.
pub struct PutReader<B> {
    body: B,
    buf: BytesMut,
    ended: bool,
    /// Longest wait for the next body frame; `None` = no limit.
    stall: Option<std::time::Duration>,
}

impl<B> PutReader<B>
where
    B: hyper::body::Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    pub fn new(body: B) -> Self {
        PutReader {
            body,
            buf: BytesMut::new(),
            ended: false,
            stall: None,
        }
    }

    /// Fails the read ([`RecordError::Stalled`]) when no frame arrives for `limit`: a
    /// client that trickles a batch holds its reserved bytes no longer than that.
    pub fn with_stall_limit(mut self, limit: std::time::Duration) -> Self {
        self.stall = Some(limit);
        self
    }

    /// Pulls body frames until `n` bytes are buffered; `false` when the body ended first.
    async fn fill(&mut self, n: usize) -> Result<bool, RecordError> {
        while self.buf.len() < n {
            if self.ended {
                return Ok(false);
            }
            let frame = match self.stall {
                Some(t) => tokio::time::timeout(t, self.body.frame())
                    .await
                    .map_err(|_| RecordError::Stalled(t))?,
                None => self.body.frame().await,
            };
            match frame {
                None => self.ended = true,
                Some(Err(e)) => return Err(RecordError::Body(e.to_string())),
                Some(Ok(f)) => {
                    if let Ok(data) = f.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
            }
        }
        Ok(true)
    }

    /// The next record's key and value length; `None` at the end of the body.
    pub async fn next_head(&mut self) -> Result<Option<(Bytes, u64)>, RecordError> {
        if !self.fill(1).await? {
            return Ok(None);
        }
        if !self.fill(KEY_HEAD).await? {
            return Err(RecordError::Truncated(self.buf.len()));
        }
        let klen = moongate_kv::records::key_len([self.buf[0], self.buf[1]]);
        if klen == 0 {
            return Err(RecordError::EmptyKey);
        }
        if !self.fill(KEY_HEAD + klen + LEN_HEAD).await? {
            return Err(RecordError::Truncated(self.buf.len()));
        }
        self.buf.advance(KEY_HEAD);
        let key = self.buf.split_to(klen).freeze();
        let len = self.buf.get_u64_le();
        Ok(Some((key, len)))
    }

    /// The current record's value of `len` bytes.
    pub async fn value(&mut self, len: usize) -> Result<Bytes, RecordError> {
        if !self.fill(len).await? {
            return Err(RecordError::Truncated(self.buf.len()));
        }
        Ok(self.buf.split_to(len).freeze())
    }

    /// Drops the current record's value of `len` bytes without holding it.
    pub async fn skip(&mut self, mut len: u64) -> Result<(), RecordError> {
        const STEP: u64 = 1 << 20;
        while len > 0 {
            let n = len.min(STEP) as usize;
            if !self.fill(n).await? {
                return Err(RecordError::Truncated(self.buf.len()));
            }
            self.buf.advance(n);
            len -= n as u64;
        }
        Ok(())
    }
}

/// Part boundaries (indexes where a new part starts) so that each part's values weigh at
/// most `part_bytes`; a value larger than that is a part of its own.
pub fn cut_by_bytes(sizes: &[u64], part_bytes: u64) -> Vec<usize> {
    let mut points = Vec::new();
    let mut acc = 0u64;
    for (i, &s) in sizes.iter().enumerate() {
        if i > 0 && acc.saturating_add(s) > part_bytes {
            points.push(i);
            acc = 0;
        }
        acc = acc.saturating_add(s);
    }
    points
}

/// Reads `data` as a batch-put body arriving in frames (the first byte sets the frame
/// size), record by record, as the kv face reads one: values of up to 64 KiB held,
/// longer ones skipped; then as a batch-get answer and as a key in a path. Never panics
/// on any input; used by the fuzz target `kv_records` and by tests.
pub fn fuzz_one(data: &[u8]) {
    use futures_util::FutureExt;
    use http_body_util::{BodyExt, StreamBody};
    use hyper::body::Frame;
    let Some((&step, rest)) = data.split_first() else {
        return;
    };
    let step = usize::from(step).max(1);
    let frames: Vec<Result<Frame<Bytes>, std::convert::Infallible>> = rest
        .chunks(step)
        .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
        .collect();
    let body = StreamBody::new(futures_util::stream::iter(frames)).boxed();
    let mut r = PutReader::new(body);
    let mut held = 0usize;
    // Every frame is ready: each call completes without waiting.
    loop {
        let Some(Ok(Some((key, len)))) = r.next_head().now_or_never() else {
            break;
        };
        assert!(!key.is_empty());
        let done = if len <= 64 << 10 {
            match r.value(len as usize).now_or_never() {
                Some(Ok(v)) => {
                    assert_eq!(v.len() as u64, len);
                    held += v.len();
                    true
                }
                _ => false,
            }
        } else {
            matches!(r.skip(len).now_or_never(), Some(Ok(())))
        };
        if !done {
            break;
        }
    }
    assert!(held <= rest.len());
    if let Some(parts) = moongate_kv::records::parse_get_answer(rest) {
        assert!(parts.iter().all(|(_, p)| p.len() <= rest.len()));
    }
    if let Ok(s) = std::str::from_utf8(rest)
        && let Some(k) = moongate_kv::decode_key(s)
        && let Ok(k) = String::from_utf8(k)
    {
        let again = moongate_kv::decode_key(&moongate_kv::encode_key(&k));
        assert_eq!(again.as_deref(), Some(k.as_bytes()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fuzz entry point over well-formed bodies with damage: no panic.
    #[test]
    fn random_bodies_never_panic() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for n in 0..5_000 {
            let mut body = vec![(next() % 7) as u8 + 1];
            for r in 0..(n % 5) {
                let key = format!("k{r}");
                let value = vec![b'v'; (next() % 300) as usize];
                moongate_kv::records::put_record(&mut body, key.as_bytes(), &value);
            }
            // Damage: a byte changed, the tail cut.
            if body.len() > 2 && n % 3 == 0 {
                let at = 1 + (next() as usize) % (body.len() - 1);
                body[at] = next() as u8;
            }
            if n % 4 == 0 {
                body.truncate(1 + (next() as usize) % body.len());
            }
            fuzz_one(&body);
        }
    }
    use http_body_util::StreamBody;

    type Frames = futures_util::stream::Iter<
        std::vec::IntoIter<Result<hyper::body::Frame<Bytes>, std::convert::Infallible>>,
    >;

    /// A body that delivers `bytes` in frames of `step` bytes.
    fn body_in_frames(bytes: Vec<u8>, step: usize) -> StreamBody<Frames> {
        let frames: Vec<_> = bytes
            .chunks(step)
            .map(|c| Ok(hyper::body::Frame::data(Bytes::copy_from_slice(c))))
            .collect();
        StreamBody::new(futures_util::stream::iter(frames))
    }

    #[tokio::test]
    async fn put_records_parse_across_any_frame_boundary() {
        let mut all = put_record(b"alpha", b"one");
        all.extend(put_record(b"b", &[7u8; 3000]));
        all.extend(put_record(b"gamma/3", b"x"));
        for step in [1, 2, 7, 10, 4096] {
            let mut r = PutReader::new(body_in_frames(all.clone(), step));
            let (k, n) = r.next_head().await.unwrap().unwrap();
            assert_eq!((&k[..], n), (&b"alpha"[..], 3));
            assert_eq!(&r.value(3).await.unwrap()[..], b"one");
            let (k, n) = r.next_head().await.unwrap().unwrap();
            assert_eq!((&k[..], n), (&b"b"[..], 3000));
            r.skip(n).await.unwrap();
            let (k, n) = r.next_head().await.unwrap().unwrap();
            assert_eq!(&k[..], b"gamma/3");
            assert_eq!(&r.value(n as usize).await.unwrap()[..], b"x");
            assert!(r.next_head().await.unwrap().is_none(), "step {step}");
        }
    }

    #[tokio::test]
    async fn truncated_and_malformed_records_are_errors() {
        let whole = put_record(b"key", b"value");
        for cut in 1..whole.len() {
            let mut r = PutReader::new(body_in_frames(whole[..cut].to_vec(), 3));
            let res = match r.next_head().await {
                Err(e) => Err(e),
                Ok(Some((_, n))) => r.value(n as usize).await.map(|_| ()),
                Ok(None) => panic!("cut {cut}: a partial record read as the end"),
            };
            assert!(
                matches!(res, Err(RecordError::Truncated(_))),
                "cut {cut}: {res:?}"
            );
        }
        let mut r = PutReader::new(body_in_frames(vec![0, 0, 1, 0, 0, 0, 0, 0, 0, 0], 4));
        assert!(matches!(r.next_head().await, Err(RecordError::EmptyKey)));
        // A length far beyond the body is a truncation, not an allocation.
        let mut huge = vec![1, 0, b'k'];
        huge.extend(u64::MAX.to_le_bytes());
        let mut r = PutReader::new(body_in_frames(huge, 5));
        let (_, n) = r.next_head().await.unwrap().unwrap();
        assert!(matches!(r.skip(n).await, Err(RecordError::Truncated(_))));
    }

    #[test]
    fn parts_stay_under_the_byte_budget() {
        assert_eq!(cut_by_bytes(&[], 10), Vec::<usize>::new());
        assert_eq!(cut_by_bytes(&[4, 4, 4, 4], 10), vec![2]);
        assert_eq!(cut_by_bytes(&[4, 4, 4, 4], 8), vec![2]);
        assert_eq!(cut_by_bytes(&[20, 1, 20], 10), vec![1, 2]);
        assert_eq!(cut_by_bytes(&[1; 5], 1), vec![1, 2, 3, 4]);
    }
}

//! Batch get and put on the kv face, cut into parts under the node's byte budget.
//!
//! A batch load is never one unbounded transfer: its values are cut into parts of at
//! most `kv.batch_part_bytes` (or where the active policy's `split` hook says), each
//! part reserves its bytes in the node's in-flight budget before it moves, and the next
//! part starts only when the previous one has been handed to the caller's connection.
//! When the budget stays full for `kv.busy_wait_ms`, the part's keys (and every later
//! key) are answered 503 instead of queueing. Puts are read from the request body one
//! record at a time, and a value is only buffered once its bytes have room.
//!
//! Knows the store and the policy host, not the HTTP routing around it.

use std::sync::Arc;

use bytes::Bytes;
use hyper::StatusCode;

use super::intake::RoomError;
use super::records::{self, PutReader, RecordError};
use super::state::{KvState, code_of, status_of};
use crate::codec::Method;
use crate::kv::client::{BATCH_CONCURRENCY, Located, StoreError};
use crate::policy;

/// The outcome of one key of a batch.
#[derive(Debug)]
pub enum Outcome {
    Ok,
    Failed(StatusCode, String),
}

impl Outcome {
    fn of(e: &StoreError) -> Outcome {
        Outcome::Failed(status_of(e), e.to_string())
    }

    fn json(&self, ok: StatusCode) -> serde_json::Value {
        match self {
            Outcome::Ok => serde_json::json!({ "status": ok.as_u16() }),
            Outcome::Failed(s, e) => serde_json::json!({ "status": s.as_u16(), "error": e }),
        }
    }
}

/// One get-answer record for a failed key.
fn failed_record(status: StatusCode, msg: &str) -> [Bytes; 2] {
    let body = Bytes::from(serde_json::json!({ "error": msg }).to_string());
    [records::get_head(status.as_u16(), body.len() as u64), body]
}

/// Where a batch of values weighing `sizes` is cut: the active arm's `split` hook when
/// it has one (it sees the node's budget), else parts of `kv.batch_part_bytes`.
pub(super) fn part_starts(state: &KvState, first_key: &Bytes, sizes: &[u64]) -> Vec<usize> {
    let (set, arm) = state
        .policy
        .arm_for(&state.store.client_id(), Some(&first_key[..]));
    let arm = &set.arms[arm];
    if state.policy.splits_batches(arm) {
        state.policy.cut(
            arm,
            sizes,
            state.store.inflight_bytes(),
            state.store.budget_bytes(),
            [],
        )
    } else {
        records::cut_by_bytes(sizes, state.batch_part_bytes)
    }
}

/// Runs a batch get whose keys were located (`BatchGetReplicaList`), sending the answer
/// records in key order to `tx` part by part. Ends early when the caller goes away.
pub async fn get_parts(
    state: Arc<KvState>,
    keys: Vec<Bytes>,
    located: Vec<Result<Option<Located>, StoreError>>,
    tx: tokio::sync::mpsc::Sender<Bytes>,
) {
    let sizes: Vec<u64> = located
        .iter()
        .map(|r| match r {
            Ok(Some(d)) => d.size(),
            _ => 0,
        })
        .collect();
    let mut starts = part_starts(&state, &keys[0], &sizes);
    starts.push(keys.len());
    state.metrics.batch_parts.inc_by(starts.len() as u64);
    let mut from = 0;
    let mut busy: Option<String> = None;
    for to in starts {
        // Sizes are the master's: summed without wrapping (the budget caps a reservation).
        let bytes = sizes[from..to]
            .iter()
            .fold(0u64, |a, &s| a.saturating_add(s));
        let room = match &busy {
            Some(_) => None,
            None if bytes == 0 => None,
            None => match state.store.reserve(bytes).await {
                Ok(r) => Some(r),
                Err(e) => {
                    busy = Some(e.to_string());
                    None
                }
            },
        };
        let mut jobs = Vec::with_capacity(to - from);
        for (key, r) in keys[from..to].iter().zip(&located[from..to]) {
            jobs.push(get_one(&state, key, r, busy.as_deref()));
        }
        // Records go out in key order as soon as each is read (and all earlier ones
        // were), so the caller's receive overlaps the part's remaining reads.
        let mut waiting = jobs.into_iter();
        let mut running = futures_util::stream::FuturesOrdered::new();
        for job in waiting.by_ref().take(BATCH_CONCURRENCY) {
            running.push_back(job);
        }
        while let Some([head, body]) = futures_util::StreamExt::next(&mut running).await {
            if let Some(job) = waiting.next() {
                running.push_back(job);
            }
            if tx.send(head).await.is_err() || (!body.is_empty() && tx.send(body).await.is_err()) {
                return; // the caller went away; the part's room is given back
            }
        }
        drop(room);
        from = to;
    }
}

/// The answer record of one key of a batch get.
async fn get_one(
    state: &KvState,
    key: &Bytes,
    located: &Result<Option<Located>, StoreError>,
    busy: Option<&str>,
) -> [Bytes; 2] {
    match (located, busy) {
        (Ok(None), _) => failed_record(StatusCode::NOT_FOUND, "no such key"),
        (Err(e), _) => failed_record(status_of(e), &e.to_string()),
        (Ok(Some(_)), Some(why)) => failed_record(StatusCode::SERVICE_UNAVAILABLE, why),
        (Ok(Some(d)), None) => match state.store.read_located(key, d).await {
            Ok(Some(v)) => [records::get_head(200, v.len() as u64), v],
            Ok(None) => failed_record(StatusCode::NOT_FOUND, "no such key"),
            Err(e) => failed_record(status_of(&e), &e.to_string()),
        },
    }
}

/// A part of a batch put being gathered: its keys' positions, records and budget.
#[derive(Default)]
struct Part {
    at: Vec<usize>,
    values: Vec<(Bytes, Bytes)>,
    bytes: u64,
    room: Vec<super::intake::Room>,
}

/// Stores a part through the policy host (placement rewrite or per-key denial, exactly
/// as for a client's `BatchPutStart` on the master face) and records each key's outcome.
async fn flush(state: &KvState, part: &mut Part, out: &mut [Option<Outcome>]) {
    if part.values.is_empty() {
        return;
    }
    let p = std::mem::take(part);
    match store_part(state, &p.values).await {
        Ok(results) => {
            for (&i, r) in p.at.iter().zip(results) {
                out[i] = Some(match r {
                    Ok(()) => Outcome::Ok,
                    Err(e) => Outcome::of(&e),
                });
            }
        }
        Err(e) => {
            for &i in &p.at {
                out[i] = Some(Outcome::of(&e));
            }
        }
    }
    drop(p.room);
}

/// Stores `values` as one `BatchPutStart` through the policy host, the hooks told how
/// it went: one result per key, or the error of the whole part (the master's answers
/// unusable). The HTTP batch put and the shared-memory one (values in an engine's
/// memory) both store their parts here.
pub(super) async fn store_part<V: AsRef<[u8]> + Sync>(
    state: &KvState,
    values: &[(Bytes, V)],
) -> Result<Vec<Result<(), StoreError>>, StoreError> {
    state.metrics.batch_parts.inc();
    let start = state.store.batch_put_start(
        values.iter().map(|(k, _)| k.clone()).collect(),
        values
            .iter()
            .map(|(_, v)| v.as_ref().len() as u64)
            .collect(),
    );
    let started = std::time::Instant::now();
    let (ticket, start, fixup) = match super::state::decide_start(state, start) {
        Ok(up) => up,
        // Every key refused by the policy (the decision is finished).
        Err(codes) => {
            return Ok(codes
                .into_iter()
                .map(|c| Err(StoreError::Refused(c)))
                .collect());
        }
    };
    let results = state.store.put_many(values, start, fixup.as_ref()).await;
    let latency = Some(started.elapsed());
    let method = Method::BatchPutStart.name();
    ticket.finish(&match &results {
        Ok(results) => policy::Outcome::of_codes(
            method,
            results.iter().map(|r| code_of(r.as_ref().map(|_| ()))),
            latency,
        ),
        Err(e) => {
            policy::Outcome::of_codes(method, values.iter().map(|_| code_of(Err(e))), latency)
        }
    });
    results
}

/// What a batch put answers: the per-key outcomes (201 for stored keys), and for a body
/// that broke off, the status and reason (the keys before it were still handled).
pub struct PutAnswer {
    pub outcomes: Vec<serde_json::Value>,
    pub broken: Option<(StatusCode, String)>,
}

/// Reads put records from `body` (under the intake's rules for connection `conn`) and
/// stores them part by part.
pub async fn put_parts<B>(state: &KvState, conn: &super::intake::Conn, body: B) -> PutAnswer
where
    B: hyper::body::Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    let (body, tracked) = conn.body(body);
    let mut reader = PutReader::new(body).with_stall_limit(state.store.call_timeout());
    let mut out: Vec<Option<Outcome>> = Vec::new();
    let mut part = Part::default();
    let mut busy: Option<String> = None;
    // A part also fits the connection's share, so a batch alone is never refused by it.
    let part_limit = state
        .batch_part_bytes
        .min(state.store.budget_bytes())
        .min(state.intake.per_connection());
    let broken = loop {
        let (key, len) = match reader.next_head().await {
            Ok(Some(h)) => h,
            Ok(None) => break None,
            Err(e) => break Some(record_error(e)),
        };
        if out.len() == state.max_batch_keys {
            break Some((
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("more than {} keys per call", state.max_batch_keys),
            ));
        }
        let i = out.len();
        out.push(None);
        let refuse = if len == 0 {
            Some((StatusCode::BAD_REQUEST, "empty value".to_string()))
        } else if key.len() > state.max_key_bytes {
            Some((
                StatusCode::BAD_REQUEST,
                format!("key over {} bytes (kv.max_key_bytes)", state.max_key_bytes),
            ))
        } else if len > state.max_value_bytes as u64 {
            Some((
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "value over {} bytes (kv.max_value_bytes)",
                    state.max_value_bytes
                ),
            ))
        } else {
            busy.clone()
                .map(|why| (StatusCode::SERVICE_UNAVAILABLE, why))
        };
        if let Some((status, why)) = refuse {
            out[i] = Some(Outcome::Failed(status, why));
            if let Err(e) = reader.skip(len).await {
                break Some(record_error(e));
            }
            continue;
        }
        if part.bytes.saturating_add(len) > part_limit {
            flush(state, &mut part, &mut out).await;
        }
        let room = match conn.reserve(&state.store, &tracked, len).await {
            Ok(r) => r,
            // Shed while it waited with earlier records' room held: the body ends here.
            Err(RoomError::Stopped(why)) => {
                out[i] = Some(Outcome::Failed(
                    StatusCode::REQUEST_TIMEOUT,
                    why.to_string(),
                ));
                break Some((StatusCode::REQUEST_TIMEOUT, why.to_string()));
            }
            Err(RoomError::Store(e)) => {
                busy = Some(e.to_string());
                out[i] = Some(Outcome::of(&e));
                if let Err(e) = reader.skip(len).await {
                    break Some(record_error(e));
                }
                continue;
            }
        };
        let value = match reader.value(len as usize).await {
            Ok(v) => v,
            Err(e) => {
                out.pop();
                break Some(record_error(e));
            }
        };
        part.at.push(i);
        part.values.push((key, value));
        part.bytes += len;
        part.room.push(room);
    };
    // The intake's reason when it stopped the body (the reader saw only a broken body).
    let broken = broken.map(|b| match tracked.stopped() {
        Some(why) => {
            state.metrics.body_timeouts.inc();
            (StatusCode::REQUEST_TIMEOUT, why.to_string())
        }
        None => b,
    });
    drop(tracked);
    // Whatever was read whole is stored even when the body broke off later.
    flush(state, &mut part, &mut out).await;
    PutAnswer {
        outcomes: out
            .iter()
            .map(|o| {
                o.as_ref()
                    .map_or(serde_json::Value::Null, |o| o.json(StatusCode::CREATED))
            })
            .collect(),
        broken,
    }
}

fn record_error(e: RecordError) -> (StatusCode, String) {
    let status = match e {
        RecordError::Stalled(_) => StatusCode::REQUEST_TIMEOUT,
        _ => StatusCode::BAD_REQUEST,
    };
    (status, e.to_string())
}

#[cfg(test)]
mod tests {
    //! The batch room with a fake policy and no master: parts are cut where the policy
    //! or the byte bound says, and refusals go through the decision lifecycle.

    use std::sync::Arc;
    use std::time::Duration;

    use http_body_util::Full;

    use super::*;
    use crate::kv::client::metadata::Metadata;
    use crate::kv::client::{Budget, Store, Transfers};
    use crate::kv::transport::te_tcp::Pool;
    use crate::metrics::Metrics;
    use crate::policy::fake::Fake;
    use crate::policy::registry::Registry;
    use crate::policy::{Policy, PolicyConfig};

    /// A kv state whose master and segments are unreachable: anything that gets past
    /// the policy would fail with a 5xx, so a 507 proves the policy answered.
    fn state(fake: Arc<Fake>, part_bytes: u64, all: &Metrics) -> KvState {
        let t = Duration::from_millis(200);
        let xfer = Transfers::new(
            Metadata::new("http://127.0.0.1:1/metadata", t).unwrap(),
            Pool::new(1, t),
            None,
            all.kv.clone(),
        );
        let policy: Arc<dyn Policy> = fake;
        KvState {
            store: Store::new(
                crate::upstream::Upstream::fixed("127.0.0.1:1"),
                xfer,
                t,
                Bytes::from_static(b"default"),
                all.kv.clone(),
                &Budget {
                    max_inflight_bytes: 1 << 20,
                    busy_wait: Duration::from_millis(10),
                },
                4,
            ),
            max_value_bytes: 1 << 16,
            max_batch_keys: 100,
            max_key_bytes: 64,
            batch_part_bytes: part_bytes,
            intake: crate::kv::api::intake::Intake::new(
                crate::kv::api::intake::Rules {
                    min_rate: crate::kv::api::intake::MinRate {
                        per_second: 0,
                        grace: Duration::ZERO,
                    },
                    shed_after: Duration::ZERO,
                    per_connection: 0,
                },
                all.kv.clone(),
            ),
            http1_read_buffer: 64 << 10,
            policy: Registry::with_policies(
                PolicyConfig::default(),
                None,
                all.policy.clone(),
                vec![policy],
            )
            .unwrap(),
            metrics: all.kv.clone(),
            hints: Arc::new(crate::hints::Hints::new(
                Default::default(),
                64,
                all.hints.clone(),
            )),
        }
    }

    #[test]
    fn parts_follow_the_policy_or_the_byte_bound() {
        let all = Metrics::new();
        let plain = state(Arc::new(Fake::new("plain")), 100, &all);
        let k = Bytes::from_static(b"k");
        assert_eq!(part_starts(&plain, &k, &[60, 60, 30, 90]), [1, 3]);
        let splitter = Fake::new("s").split(|c| Ok(vec![2, 2, 0, c.sizes.len() as u32]));
        let by_policy = state(Arc::new(splitter), 100, &all);
        assert_eq!(
            part_starts(&by_policy, &k, &[60, 60, 30, 90]),
            [2],
            "the plugin's points, cleaned"
        );
    }

    #[tokio::test]
    async fn a_batch_the_policy_refuses_is_answered_per_key_without_the_master() {
        let all = Metrics::new();
        let fake = Arc::new(Fake::new("deny").deny_prefix("", -200));
        let st = state(fake.clone(), 1 << 20, &all);
        let mut body = records::put_record(b"a", b"1");
        body.extend(records::put_record(b"b", b""));
        body.extend(records::put_record(b"c", &[9u8; 70_000]));
        body.extend(records::put_record(b"d", b"4"));
        let a = put_parts(&st, &st.intake.conn(), Full::new(Bytes::from(body))).await;
        assert!(a.broken.is_none());
        let statuses: Vec<u64> = a
            .outcomes
            .iter()
            .map(|o| o["status"].as_u64().unwrap())
            .collect();
        // a, d: refused by the policy (-200 -> 507); b: empty; c: over max_value_bytes.
        assert_eq!(statuses, [507, 400, 413, 507]);
        // Settled: nothing went upstream, so observe heard nothing; the decision counts.
        assert!(fake.observations().is_empty());
        let deny_all = crate::policy::metrics::DECISIONS
            .iter()
            .position(|d| *d == "deny_all")
            .unwrap();
        assert_eq!(
            st.policy.current().arms[0].metrics.decisions[deny_all].get(),
            1
        );
    }
}

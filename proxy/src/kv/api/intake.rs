//! Request bodies in progress on the kv API, and the three rules that keep stalled or
//! greedy peers from holding the node's byte budget:
//! - a body must keep `kv.min_body_bytes_per_second` on average once
//!   `kv.min_body_grace_ms` has passed ([`Paced`]);
//! - one connection holds at most `kv.max_body_bytes_per_connection` of the budget for
//!   its bodies ([`Conn::reserve`]), unless it has a single body in progress;
//! - when a reservation finds the budget full, the bodies that have waited longest for
//!   their next byte, `kv.shed_after_ms` or more, are stopped and give their bytes back
//!   ([`Intake`] is the budget's [`Reclaim`]).
//!
//! Only bodies waiting on their peer count as stalled: a body the server is not reading
//! (its bytes are being written to replicas) is making the server's progress, not
//! stalling. Knows HTTP bodies and the budget; not what the bytes are for.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use tokio::time::{Instant, Sleep};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use crate::kv::client::budget::Reclaim;
use crate::kv::client::{Reserved, Store, StoreError};
use crate::kv::metrics::KvMetrics;

/// The least a body must keep up: after `grace`, `per_second` bytes a second on average
/// since it started (0: no floor).
#[derive(Debug, Clone, Copy)]
pub struct MinRate {
    pub per_second: u64,
    pub grace: Duration,
}

impl MinRate {
    /// When a body that has `got` bytes after starting at `start` falls below the rate.
    fn deadline(&self, start: Instant, got: u64) -> Instant {
        start + self.grace + Duration::from_secs_f64(got as f64 / self.per_second as f64)
    }
}

/// The intake's settings (`[kv]` keys of the same names).
#[derive(Debug, Clone, Copy)]
pub struct Rules {
    pub min_rate: MinRate,
    /// A body waiting this long for its next byte may be shed when the budget is full;
    /// zero: never.
    pub shed_after: Duration,
    /// Budget bytes one connection's bodies may hold; 0: no bound.
    pub per_connection: u64,
}

/// Why a body was stopped before it ended.
#[derive(Debug, Clone, thiserror::Error)]
pub enum IntakeError {
    #[error(
        "body arriving slower than {per_second} bytes/s (kv.min_body_bytes_per_second): \
         {got} bytes in {secs:.1} s"
    )]
    TooSlow {
        per_second: u64,
        got: u64,
        secs: f64,
    },
    #[error(
        "body shed: it waited {waited_ms} ms for its next byte (kv.shed_after_ms) while the \
         byte budget (kv.max_inflight_bytes) was full"
    )]
    Shed { waited_ms: u64 },
    #[error("reading the body: {0}")]
    Body(String),
}

const NOT_WAITING: u64 = u64::MAX;

/// What the intake knows of one body in progress.
struct Watch {
    /// When (ms since the intake's epoch) the body began waiting on its peer for the
    /// next frame; [`NOT_WAITING`] while a frame just came or the server is busy.
    waiting_since: AtomicU64,
    /// Budget bytes the body's reservations hold.
    held: AtomicU64,
    stop: CancellationToken,
    /// Why it was stopped (set once: the first reason wins).
    stopped: OnceLock<IntakeError>,
}

/// Every request body in progress on this node's kv API.
pub struct Intake {
    rules: Rules,
    epoch: std::time::Instant,
    live: Mutex<HashMap<u64, Arc<Watch>>>,
    next: AtomicU64,
    metrics: Arc<KvMetrics>,
}

impl Intake {
    pub fn new(rules: Rules, metrics: Arc<KvMetrics>) -> Arc<Intake> {
        Arc::new(Intake {
            rules,
            epoch: std::time::Instant::now(),
            live: Mutex::default(),
            next: AtomicU64::new(0),
            metrics,
        })
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Watch>>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Budget bytes one connection's bodies may hold (`u64::MAX`: no bound).
    pub fn per_connection(&self) -> u64 {
        match self.rules.per_connection {
            0 => u64::MAX,
            n => n,
        }
    }

    /// A new connection's view of the intake.
    pub fn conn(self: &Arc<Intake>) -> Conn {
        Conn {
            intake: self.clone(),
            held: Arc::new(AtomicU64::new(0)),
        }
    }
}

impl Reclaim for Intake {
    /// Stops the bodies that have waited longest for their next byte (at least
    /// `kv.shed_after_ms`) and hold budget bytes, until they hold `need` bytes.
    fn reclaim(&self, need: u64) -> u64 {
        if self.rules.shed_after.is_zero() {
            return 0;
        }
        let now = self.now_ms();
        let after = self.rules.shed_after.as_millis() as u64;
        // Bodies already stopped give their bytes back once their tasks see the stop:
        // those bytes are on their way, and shedding more for the same need (waiters ask
        // again every 100 ms, and each asks for the whole queue) would stop bodies
        // whose room nobody is left to take.
        let mut coming = 0u64;
        let mut stalled: Vec<(u64, u64, Arc<Watch>)> = {
            let live = self.lock();
            live.iter()
                .filter_map(|(id, w)| {
                    let held = w.held.load(Ordering::Relaxed);
                    if w.stopped.get().is_some() {
                        coming = coming.saturating_add(held);
                        return None;
                    }
                    let since = w.waiting_since.load(Ordering::Relaxed);
                    (since != NOT_WAITING && now.saturating_sub(since) >= after && held > 0)
                        .then(|| (since, *id, w.clone()))
                })
                .collect()
        };
        if coming >= need {
            return 0;
        }
        stalled.sort_unstable_by_key(|(since, id, _)| (*since, *id));
        let mut freed = coming;
        for (since, _, w) in stalled {
            if freed >= need {
                break;
            }
            let waited_ms = now.saturating_sub(since);
            if w.stopped.set(IntakeError::Shed { waited_ms }).is_ok() {
                freed = freed.saturating_add(w.held.load(Ordering::Relaxed));
                w.stop.cancel();
                self.metrics.bodies_shed[1].inc();
            }
        }
        freed
    }
}

/// One connection's bodies: their share of the budget.
pub struct Conn {
    intake: Arc<Intake>,
    held: Arc<AtomicU64>,
}

/// A body registered with the intake; unregistered on drop.
pub struct Tracked {
    id: u64,
    watch: Arc<Watch>,
    intake: Arc<Intake>,
}

impl Tracked {
    /// Why the intake stopped this body, if it did (an error from the body's reader
    /// may hide it, as when a streamed put reports the break as its own).
    pub fn stopped(&self) -> Option<IntakeError> {
        self.watch.stopped.get().cloned()
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.intake.lock().remove(&self.id);
    }
}

/// Budget bytes held for a body, counted in its connection's share and its body's
/// holding until dropped.
pub struct Room {
    reserved: Reserved,
    conn: Arc<AtomicU64>,
    watch: Arc<Watch>,
}

impl Room {
    pub fn bytes(&self) -> u64 {
        self.reserved.bytes()
    }
}

impl Drop for Room {
    fn drop(&mut self) {
        let n = self.reserved.bytes();
        self.conn.fetch_sub(n, Ordering::Relaxed);
        self.watch.held.fetch_sub(n, Ordering::Relaxed);
    }
}

impl Conn {
    /// Registers a body and wraps it in the rate floor and the shedding stop.
    pub fn body<B>(&self, body: B) -> (Paced<B>, Tracked) {
        let intake = &self.intake;
        let watch = Arc::new(Watch {
            waiting_since: AtomicU64::new(NOT_WAITING),
            held: AtomicU64::new(0),
            stop: CancellationToken::new(),
            stopped: OnceLock::new(),
        });
        let id = intake.next.fetch_add(1, Ordering::Relaxed);
        intake.lock().insert(id, watch.clone());
        let min = intake.rules.min_rate;
        let start = Instant::now();
        let paced = Paced {
            inner: body,
            watch: watch.clone(),
            intake: intake.clone(),
            start,
            got: 0,
            waiting: false,
            timer: (min.per_second > 0).then(|| Box::pin(tokio::time::sleep_until(start))),
            stop: Box::pin(watch.stop.clone().cancelled_owned()),
        };
        (
            paced,
            Tracked {
                id,
                watch,
                intake: intake.clone(),
            },
        )
    }

    /// Takes `bytes` of this connection's share: always when `own` is all it holds (a
    /// single body may be as large as the budget allows), else within the share.
    fn take_share(&self, bytes: u64, own: u64) -> Result<(), StoreError> {
        let max = self.intake.rules.per_connection;
        let r = self
            .held
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |held| {
                (max == 0 || held <= own || held.saturating_add(bytes) <= max)
                    .then(|| held.saturating_add(bytes))
            });
        r.map(|_| ()).map_err(|held| {
            self.intake.metrics.share_refused.inc();
            StoreError::ConnectionShare { held, max }
        })
    }

    /// Reserves `bytes` of the budget for body `t`, within this connection's share.
    pub async fn reserve(&self, store: &Store, t: &Tracked, bytes: u64) -> Result<Room, RoomError> {
        self.take_share(bytes, 0)?;
        match self.waiting_for_room(&t.watch, store.reserve(bytes)).await {
            Ok(reserved) => {
                t.watch.held.fetch_add(bytes, Ordering::Relaxed);
                Ok(Room {
                    reserved,
                    conn: self.held.clone(),
                    watch: t.watch.clone(),
                })
            }
            Err(e) => {
                self.held.fetch_sub(bytes, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    /// Adds `more` bytes to `room`, within this connection's share.
    pub async fn grow(&self, store: &Store, room: &mut Room, more: u64) -> Result<(), RoomError> {
        self.take_share(more, room.bytes())?;
        let watch = room.watch.clone();
        match self
            .waiting_for_room(&watch, store.grow(&mut room.reserved, more))
            .await
        {
            Ok(()) => {
                watch.held.fetch_add(more, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                self.held.fetch_sub(more, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    /// Waits for budget room on behalf of a body. One that already holds bytes counts
    /// as stalled meanwhile (holding room while waiting for more is no progress, and a
    /// full budget of such bodies would otherwise wait on each other until
    /// `kv.busy_wait_ms`), so it may be shed, which ends the wait.
    async fn waiting_for_room<T>(
        &self,
        w: &Watch,
        room: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, RoomError> {
        if w.held.load(Ordering::Relaxed) == 0 {
            return Ok(room.await?);
        }
        let marked = w
            .waiting_since
            .compare_exchange(
                NOT_WAITING,
                self.intake.now_ms(),
                Ordering::Relaxed,
                Ordering::Relaxed,
            )
            .is_ok();
        let r = tokio::select! {
            r = room => r.map_err(RoomError::Store),
            _ = w.stop.cancelled() => Err(RoomError::Stopped(
                w.stopped.get().cloned().unwrap_or(IntakeError::Shed { waited_ms: 0 }),
            )),
        };
        if marked {
            w.waiting_since.store(NOT_WAITING, Ordering::Relaxed);
        }
        r
    }
}

/// Why a body got no budget room.
#[derive(Debug, thiserror::Error)]
pub enum RoomError {
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Shed while it waited (it held room already).
    #[error(transparent)]
    Stopped(IntakeError),
}

/// A request body under the intake's rules: fails with [`IntakeError::TooSlow`] once
/// below the rate floor, with [`IntakeError::Shed`] once the intake stopped it, and
/// records when it waits on its peer.
pub struct Paced<B> {
    inner: B,
    watch: Arc<Watch>,
    intake: Arc<Intake>,
    start: Instant,
    got: u64,
    /// Mirrors `watch.waiting_since != NOT_WAITING`, so a busy body touches the shared
    /// atomic once per wait, not per poll.
    waiting: bool,
    /// Fires at the floor's deadline as it stood when set; re-armed when it fires early
    /// (bytes came since), so one timer serves the whole body.
    timer: Option<Pin<Box<Sleep>>>,
    stop: Pin<Box<WaitForCancellationFutureOwned>>,
}

impl<B> Paced<B> {
    /// `Some(error)` once the floor is missed.
    fn poll_floor(&mut self, cx: &mut Context<'_>) -> Option<IntakeError> {
        let timer = self.timer.as_mut()?;
        let min = self.intake.rules.min_rate;
        loop {
            if timer.as_mut().poll(cx).is_pending() {
                return None;
            }
            let due = min.deadline(self.start, self.got);
            if due <= Instant::now() {
                return Some(IntakeError::TooSlow {
                    per_second: min.per_second,
                    got: self.got,
                    secs: self.start.elapsed().as_secs_f64(),
                });
            }
            timer.as_mut().reset(due);
        }
    }
}

impl<B> Body for Paced<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    type Data = Bytes;
    type Error = IntakeError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, IntakeError>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(f))) => {
                if let Some(d) = f.data_ref() {
                    this.got += d.len() as u64;
                }
                if this.waiting {
                    this.waiting = false;
                    this.watch
                        .waiting_since
                        .store(NOT_WAITING, Ordering::Relaxed);
                }
                Poll::Ready(Some(Ok(f)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(IntakeError::Body(e.to_string())))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => {
                if this.stop.as_mut().poll(cx).is_ready() {
                    let why = this.watch.stopped.get().cloned();
                    return Poll::Ready(Some(Err(
                        why.unwrap_or(IntakeError::Shed { waited_ms: 0 })
                    )));
                }
                if !this.waiting {
                    this.waiting = true;
                    this.watch
                        .waiting_since
                        .store(this.intake.now_ms(), Ordering::Relaxed);
                }
                if let Some(e) = this.poll_floor(cx) {
                    if this.watch.stopped.set(e.clone()).is_ok() {
                        this.intake.metrics.bodies_shed[0].inc();
                    }
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::client::metadata::Metadata;
    use crate::kv::client::{Budget, Transfers};
    use crate::kv::transport::te_tcp::Pool;
    use crate::metrics::Metrics;
    use http_body_util::{BodyExt, StreamBody};
    use tokio::sync::mpsc;

    type Tx = mpsc::Sender<Result<Frame<Bytes>, std::io::Error>>;

    /// A body whose frames the test sends.
    fn body() -> (
        Tx,
        StreamBody<impl futures_util::Stream<Item = Result<Frame<Bytes>, std::io::Error>> + Unpin>,
    ) {
        let (tx, mut rx) = mpsc::channel(16);
        let s = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx));
        (tx, StreamBody::new(s))
    }

    fn intake(rules: Rules, all: &Metrics) -> Arc<Intake> {
        Intake::new(rules, all.kv.clone())
    }

    fn rules(per_second: u64, shed_after_ms: u64, per_connection: u64) -> Rules {
        Rules {
            min_rate: MinRate {
                per_second,
                grace: Duration::from_secs(1),
            },
            shed_after: Duration::from_millis(shed_after_ms),
            per_connection,
        }
    }

    /// A store with no reachable master: only its byte budget is used here.
    fn store(budget: u64, all: &Metrics) -> Store {
        let t = Duration::from_millis(200);
        let xfer = Transfers::new(
            Metadata::new("http://127.0.0.1:1/metadata", t).unwrap(),
            Pool::new(1, t),
            None,
            all.kv.clone(),
        );
        Store::new(
            crate::upstream::Upstream::fixed("127.0.0.1:1"),
            xfer,
            t,
            Bytes::from_static(b"default"),
            all.kv.clone(),
            &Budget {
                max_inflight_bytes: budget,
                busy_wait: Duration::from_secs(1),
            },
            4,
        )
    }

    fn data(n: usize) -> Result<Frame<Bytes>, std::io::Error> {
        Ok(Frame::data(Bytes::from(vec![7u8; n])))
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_below_the_floor_fails_and_a_steady_one_does_not() {
        let all = Metrics::new();
        let i = intake(rules(1000, 0, 0), &all);
        let conn = i.conn();
        // 500 bytes a second for 4 s: below 1000/s once the 1 s grace is spent.
        let (tx, b) = body();
        let (mut paced, tracked) = conn.body(b);
        let feeder = tokio::spawn(async move {
            for _ in 0..4 {
                tx.send(data(500)).await.unwrap();
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            tx
        });
        let started = Instant::now();
        let mut got = 0;
        let err = loop {
            match paced.frame().await {
                Some(Ok(f)) => got += f.into_data().unwrap().len(),
                Some(Err(e)) => break e,
                None => panic!("ended"),
            }
        };
        assert!(matches!(err, IntakeError::TooSlow { .. }), "{err}");
        // 1 s grace + 1000 bytes at 1000/s: due at 2 s.
        assert_eq!(started.elapsed(), Duration::from_secs(2));
        assert_eq!(got, 1000);
        assert!(matches!(
            tracked.stopped(),
            Some(IntakeError::TooSlow { .. })
        ));
        assert_eq!(all.kv.bodies_shed[0].get(), 1);
        drop(feeder);
        // 2000 bytes a second for 5 s, then the end: whole.
        let (tx, b) = body();
        let (paced, _t) = conn.body(b);
        tokio::spawn(async move {
            for _ in 0..5 {
                tx.send(data(2000)).await.unwrap();
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
        let whole = paced.collect().await.expect("steady body").to_bytes();
        assert_eq!(whole.len(), 10_000);
        assert_eq!(all.kv.bodies_shed[0].get(), 1);
    }

    #[tokio::test]
    async fn a_full_budget_sheds_the_body_waiting_longest_and_no_other() {
        let all = Metrics::new();
        let i = intake(rules(0, 100, 0), &all);
        let s = store(1 << 20, &all);
        s.set_reclaim(i.clone());
        let (c1, c2, c3) = (i.conn(), i.conn(), i.conn());
        // Three bodies of 400 KiB, 400 KiB and 200 KiB fill the 1 MiB budget.
        let (tx1, b1) = body();
        let (mut p1, t1) = c1.body(b1);
        let r1 = c1.reserve(&s, &t1, 400 << 10).await.unwrap();
        let (tx2, b2) = body();
        let (mut p2, t2) = c2.body(b2);
        let r2 = c2.reserve(&s, &t2, 400 << 10).await.unwrap();
        let (_tx3, b3) = body();
        let (_p3, t3) = c3.body(b3);
        let _r3 = c3.reserve(&s, &t3, 200 << 10).await.unwrap();
        // Body 1 waits on its peer first, body 2 later; body 3 is not read at all (the
        // server is busy with it): it is never stalled.
        tx1.send(data(10)).await.unwrap();
        assert!(p1.frame().await.unwrap().is_ok());
        // Like a body's reader, it gives its bytes back when its body fails.
        let poll1 = tokio::spawn(async move {
            let e = p1.frame().await;
            drop(r1);
            (e, tx1)
        });
        tokio::time::sleep(Duration::from_millis(60)).await;
        tx2.send(data(10)).await.unwrap();
        assert!(p2.frame().await.unwrap().is_ok());
        let poll2 = tokio::spawn(async move { (p2.frame().await, r2, tx2) });
        tokio::time::sleep(Duration::from_millis(120)).await;
        // Both have waited 100 ms or more; 300 KiB are needed: body 1 alone covers it.
        let c4 = i.conn();
        let (_tx4, b4) = body();
        let (_p4, t4) = c4.body(b4);
        let r4 = c4.reserve(&s, &t4, 300 << 10).await.expect("room made");
        let (e1, _tx1) = poll1.await.unwrap();
        assert!(matches!(e1, Some(Err(IntakeError::Shed { waited_ms })) if waited_ms >= 100));
        assert!(matches!(t1.stopped(), Some(IntakeError::Shed { .. })));
        assert!(t2.stopped().is_none() && t3.stopped().is_none());
        assert_eq!(all.kv.bodies_shed[1].get(), 1);
        drop((r4, poll2));
        // With shedding off, a full budget answers busy.
        let off = intake(rules(0, 0, 0), &all);
        let s = store(1 << 20, &all);
        s.set_reclaim(off.clone());
        let c = off.conn();
        let (_tx, b) = body();
        let (_p, t) = c.body(b);
        let _all = c.reserve(&s, &t, 1 << 20).await.unwrap();
        let (_tx, b) = body();
        let (_p, t) = c.body(b);
        assert!(matches!(
            off.conn().reserve(&s, &t, 1).await,
            Err(RoomError::Store(StoreError::Busy(_)))
        ));
    }

    /// Waiters ask again every 100 ms, each for the whole queue's shortfall: bytes of a
    /// body already shed are on their way back and count against the need, or every
    /// ask would shed another body for the same room.
    #[tokio::test]
    async fn bytes_already_shed_count_against_the_next_ask() {
        let all = Metrics::new();
        let i = intake(rules(0, 100, 0), &all);
        let s = store(1 << 20, &all);
        s.set_reclaim(i.clone());
        let (c1, c2) = (i.conn(), i.conn());
        let (tx1, b1) = body();
        let (mut p1, t1) = c1.body(b1);
        let _r1 = c1.reserve(&s, &t1, 400 << 10).await.unwrap();
        let (tx2, b2) = body();
        let (mut p2, t2) = c2.body(b2);
        let _r2 = c2.reserve(&s, &t2, 400 << 10).await.unwrap();
        // Both wait on their peers, long enough to be shed.
        tx1.send(data(10)).await.unwrap();
        assert!(p1.frame().await.unwrap().is_ok());
        tx2.send(data(10)).await.unwrap();
        assert!(p2.frame().await.unwrap().is_ok());
        let w1 = tokio::spawn(async move { (p1.frame().await.is_some(), tx1) });
        let w2 = tokio::spawn(async move { (p2.frame().await.is_some(), tx2) });
        tokio::time::sleep(Duration::from_millis(150)).await;
        i.reclaim(300 << 10);
        assert!(t1.stopped().is_some() && t2.stopped().is_none());
        // Body 1's room is not back yet (its reader has not dropped it): the same need
        // asked again sheds nothing more.
        i.reclaim(300 << 10);
        assert!(
            t2.stopped().is_none(),
            "a second body shed for the same room"
        );
        assert_eq!(all.kv.bodies_shed[1].get(), 1);
        // A need beyond what is coming back sheds the next.
        i.reclaim(600 << 10);
        assert!(t2.stopped().is_some());
        drop((w1, w2));
    }

    #[tokio::test]
    async fn a_body_holding_room_while_it_waits_for_more_can_be_shed() {
        let all = Metrics::new();
        let i = intake(rules(0, 100, 0), &all);
        let s = Arc::new(store(1 << 20, &all));
        s.set_reclaim(i.clone());
        // Two bodies hold half the budget each; one waits to grow (the budget is
        // full): holding room while waiting for more is no progress.
        let (c1, c2) = (i.conn(), i.conn());
        let (_tx1, b1) = body();
        let (_p1, t1) = c1.body(b1);
        let mut r1 = c1.reserve(&s, &t1, 512 << 10).await.unwrap();
        let (_tx2, b2) = body();
        let (_p2, t2) = c2.body(b2);
        let _r2 = c2.reserve(&s, &t2, 512 << 10).await.unwrap();
        let s1 = s.clone();
        let grower = tokio::spawn(async move {
            let e = c1.grow(&s1, &mut r1, 64 << 10).await;
            drop(r1);
            e
        });
        tokio::time::sleep(Duration::from_millis(150)).await;
        // A newcomer sheds it (it waited 100 ms or more; the other body is not
        // waiting at all: its server is busy with it).
        let c3 = i.conn();
        let (_tx3, b3) = body();
        let (_p3, t3) = c3.body(b3);
        let r3 = c3.reserve(&s, &t3, 256 << 10).await.expect("room made");
        assert!(matches!(
            grower.await.unwrap(),
            Err(RoomError::Stopped(IntakeError::Shed { .. }))
        ));
        assert!(t2.stopped().is_none());
        assert_eq!(all.kv.bodies_shed[1].get(), 1);
        drop(r3);
    }

    #[tokio::test]
    async fn one_connection_holds_at_most_its_share_unless_it_has_one_body() {
        let all = Metrics::new();
        let i = intake(rules(0, 0, 256 << 10), &all);
        let s = store(1 << 20, &all);
        let c = i.conn();
        let (_tx, b) = body();
        let (_p, t) = c.body(b);
        // A single body may exceed the share, and grow past it.
        let mut big = c.reserve(&s, &t, 300 << 10).await.unwrap();
        c.grow(&s, &mut big, 100 << 10).await.unwrap();
        // A second body on the same connection may not.
        let (_tx2, b2) = body();
        let (_p2, t2) = c.body(b2);
        assert!(matches!(
            c.reserve(&s, &t2, 1).await,
            Err(RoomError::Store(StoreError::ConnectionShare { held, max }))
                if held == 400 << 10 && max == 256 << 10
        ));
        assert_eq!(all.kv.share_refused.get(), 1);
        // Another connection may.
        let other = i.conn();
        let r = other.reserve(&s, &t2, 200 << 10).await.unwrap();
        drop(big);
        // Within the share, two bodies of one connection.
        let a = c.reserve(&s, &t, 128 << 10).await.unwrap();
        let mut b = c.reserve(&s, &t2, 100 << 10).await.unwrap();
        assert!(matches!(
            c.grow(&s, &mut b, 100 << 10).await,
            Err(RoomError::Store(StoreError::ConnectionShare { .. }))
        ));
        assert_eq!(c.held.load(Ordering::Relaxed), 228 << 10);
        drop((a, b, r));
        assert_eq!(c.held.load(Ordering::Relaxed), 0);
        assert_eq!(s.inflight_bytes(), 0);
    }
}

//! The master on moongate's own pooled connections (never a client's: seq numbers are
//! per connection), through the same codec as the master face.
//!
//! At most `kv.master_connections` are open at once; a call that finds every one in
//! use waits up to `kv.busy_wait_ms`, then is refused busy (503): a burst of kv
//! requests can not open an unbounded number of master connections. Idle ones are
//! closed after `kv.master_idle_ms` ([`MasterConns::close_idle`], from the kv face's
//! housekeeping): a burst's
//! connections do not stay open until the next leader change.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Semaphore;

use super::StoreError;
use crate::codec::message::{Request, Response};
use crate::kv::metrics::KvMetrics;
use crate::upstream::{Conn, Upstream};

pub struct MasterConns {
    /// The master in force: connections go to it; idle ones to an earlier leader are
    /// dropped.
    upstream: Upstream,
    call_timeout: Duration,
    busy_wait: Duration,
    /// One permit per connection that may be open (idle here or in a call).
    open: Arc<Semaphore>,
    /// Idle connections: the leader's address, the connection, when it was last used.
    /// Taken from the back (the most recently used), aged out from the front.
    idle: Mutex<Vec<(String, Conn, std::time::Instant)>>,
    metrics: Arc<KvMetrics>,
}

impl MasterConns {
    pub fn new(
        upstream: Upstream,
        call_timeout: Duration,
        max: usize,
        busy_wait: Duration,
        metrics: Arc<KvMetrics>,
    ) -> MasterConns {
        MasterConns {
            upstream,
            call_timeout,
            busy_wait,
            open: Arc::new(Semaphore::new(max.clamp(1, Semaphore::MAX_PERMITS))),
            idle: Mutex::new(Vec::new()),
            metrics,
        }
    }

    /// Whether the master in force is `l` (no copy taken).
    pub fn leader_is(&self, l: &Option<crate::upstream::Leader>) -> bool {
        self.upstream.is(l)
    }

    /// The upstream's places epoch ([`Upstream::places_epoch`]).
    pub fn places_epoch(&self) -> u64 {
        self.upstream.places_epoch()
    }

    /// The epoch the own segment's known keys are good in ([`Upstream::known_epoch`]).
    pub fn known_epoch(&self) -> u64 {
        self.upstream.known_epoch()
    }

    /// One call on a pooled connection of moongate's own; a connection that failed is
    /// dropped, not returned.
    pub async fn call(&self, req: Request) -> Result<Response, StoreError> {
        let Ok(Ok(_permit)) =
            tokio::time::timeout(self.busy_wait, self.open.clone().acquire_owned()).await
        else {
            self.metrics.master_busy.inc();
            return Err(StoreError::MasterBusy);
        };
        let Some(addr) = self.upstream.addr() else {
            return Err(StoreError::NoLeader);
        };
        let pooled = {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            idle.retain(|(a, _, _)| *a == addr);
            idle.pop()
        };
        let mut c = match pooled {
            Some((_, c, _)) => c,
            None => Conn::connect(&addr, self.call_timeout, self.upstream.release())
                .await
                .inspect_err(|_| {
                    self.upstream.places_voided();
                    self.upstream.answered(false);
                })?,
        };
        let mut answers = c
            .call_all(std::slice::from_ref(&req), self.call_timeout)
            .await
            .inspect_err(|_| {
                // A master that does not answer may be restarting: what it said of
                // places does not outlive it.
                self.upstream.places_voided();
                self.upstream.answered(false);
            })?;
        self.upstream.answered(true);
        // Back to the pool before the permit is released (the permit counts it).
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).push((
            addr,
            c,
            std::time::Instant::now(),
        ));
        match answers.pop() {
            Some(Ok(r)) => Ok(r),
            Some(Err(code)) => Err(StoreError::Rpc(code)),
            None => Err(StoreError::Unexpected),
        }
    }
}

impl MasterConns {
    /// Closes the idle connections last used more than `older_than` ago; how many.
    pub fn close_idle(&self, older_than: Duration) -> usize {
        let closed: Vec<_> = {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            let now = std::time::Instant::now();
            let keep = idle
                .iter()
                .position(|(_, _, at)| now.duration_since(*at) < older_than)
                .unwrap_or(idle.len());
            idle.drain(..keep).collect()
        };
        // Closed outside the lock.
        let n = closed.len();
        drop(closed);
        self.metrics.master_idle_closed.inc_by(n as u64);
        n
    }

    /// Idle connections now.
    pub fn idle(&self) -> usize {
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::codec::message::NoArgs;
    use crate::upstream::CallError;

    /// A master that accepts and never answers: five concurrent calls with room for two
    /// connections open exactly two; the other three are answered busy after the wait.
    #[tokio::test]
    async fn at_most_the_configured_connections_open_and_the_rest_are_answered_busy() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let accepted = Arc::new(AtomicUsize::new(0));
        let a = accepted.clone();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = l.accept().await {
                a.fetch_add(1, Ordering::SeqCst);
                held.push(s);
            }
        });
        let metrics = crate::metrics::Metrics::new().kv.clone();
        let m = Arc::new(MasterConns::new(
            Upstream::fixed(&addr),
            Duration::from_millis(800),
            2,
            Duration::from_millis(100),
            metrics.clone(),
        ));
        let calls: Vec<_> = (0..5)
            .map(|_| {
                let m = m.clone();
                tokio::spawn(async move { m.call(Request::ServiceReady(NoArgs)).await })
            })
            .collect();
        let (mut busy, mut timed_out) = (0, 0);
        for c in calls {
            match c.await.unwrap() {
                Err(StoreError::MasterBusy) => busy += 1,
                Err(StoreError::Master(CallError::Timeout(_))) => timed_out += 1,
                other => panic!("{other:?}"),
            }
        }
        assert_eq!((busy, timed_out), (3, 2));
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
        assert_eq!(metrics.master_busy.get(), 3);
    }

    /// A master that answers every request with transport error 1 (no body) and counts
    /// the connections open to it.
    async fn answering_master() -> (String, Arc<AtomicUsize>) {
        use crate::codec::frame::{REQUEST_HEADER_LEN, ResponseHeader};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let open = Arc::new(AtomicUsize::new(0));
        let o = open.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let o = o.clone();
                o.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut h = [0u8; REQUEST_HEADER_LEN];
                    while s.read_exact(&mut h).await.is_ok() {
                        let seq = u32::from_le_bytes(h[4..8].try_into().unwrap());
                        let len = u32::from_le_bytes(h[12..16].try_into().unwrap());
                        let mut body = vec![0u8; len as usize];
                        if s.read_exact(&mut body).await.is_err() {
                            break;
                        }
                        // Slow enough that concurrent calls each take a connection.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        let mut out = bytes::BytesMut::new();
                        ResponseHeader::new(seq, 1, 0).write(&mut out);
                        if s.write_all(&out).await.is_err() {
                            break;
                        }
                    }
                    o.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        (addr, open)
    }

    /// A burst opens several connections; once idle past the bound they are closed
    /// (the master sees them go), and the next call opens one again.
    #[tokio::test]
    async fn idle_connections_are_closed_after_the_idle_time() {
        let (addr, open) = answering_master().await;
        let metrics = crate::metrics::Metrics::new().kv.clone();
        let m = Arc::new(MasterConns::new(
            Upstream::fixed(&addr),
            Duration::from_secs(5),
            8,
            Duration::from_secs(5),
            metrics.clone(),
        ));
        let calls: Vec<_> = (0..6)
            .map(|_| {
                let m = m.clone();
                tokio::spawn(async move { m.call(Request::ServiceReady(NoArgs)).await })
            })
            .collect();
        for c in calls {
            assert!(matches!(c.await.unwrap(), Err(StoreError::Rpc(1))));
        }
        assert_eq!(m.idle(), 6);
        assert_eq!(
            m.close_idle(Duration::from_secs(60)),
            0,
            "not idle long enough"
        );
        let t0 = std::time::Instant::now();
        while open.load(Ordering::SeqCst) > 0 {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "connections stayed open"
            );
            m.close_idle(Duration::from_millis(200));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(m.idle(), 0);
        assert_eq!(metrics.master_idle_closed.get(), 6);
        assert!(matches!(
            m.call(Request::ServiceReady(NoArgs)).await,
            Err(StoreError::Rpc(1))
        ));
        assert_eq!(open.load(Ordering::SeqCst), 1);
    }
}

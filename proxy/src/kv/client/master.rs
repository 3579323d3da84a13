//! The master on moongate's own pooled connections (never a client's: seq numbers are
//! per connection), through the same codec as the master face.
//!
//! At most `kv.master_connections` are open at once; a call that finds every one in
//! use waits up to `kv.busy_wait_ms`, then is refused busy (503): a burst of kv
//! requests can not open an unbounded number of master connections.

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
    idle: Mutex<Vec<(String, Conn)>>,
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
            idle.retain(|(a, _)| *a == addr);
            idle.pop()
        };
        let mut c = match pooled {
            Some((_, c)) => c,
            None => Conn::connect(&addr, self.call_timeout, self.upstream.release())
                .await
                .inspect_err(|_| self.upstream.places_voided())?,
        };
        let mut answers = c
            .call_all(std::slice::from_ref(&req), self.call_timeout)
            .await
            .inspect_err(|_| {
                // A master that does not answer may be restarting: what it said of
                // places does not outlive it.
                self.upstream.places_voided();
            })?;
        // Back to the pool before the permit is released (the permit counts it).
        self.idle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((addr, c));
        match answers.pop() {
            Some(Ok(r)) => Ok(r),
            Some(Err(code)) => Err(StoreError::Rpc(code)),
            None => Err(StoreError::Unexpected),
        }
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
}

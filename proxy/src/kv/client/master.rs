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
use crate::upstream::Conn;

pub struct MasterConns {
    upstream: String,
    call_timeout: Duration,
    busy_wait: Duration,
    /// One permit per connection that may be open (idle here or in a call).
    open: Arc<Semaphore>,
    idle: Mutex<Vec<Conn>>,
    metrics: Arc<KvMetrics>,
}

impl MasterConns {
    pub fn new(
        upstream: String,
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

    /// One call on a pooled connection of moongate's own; a connection that failed is
    /// dropped, not returned.
    pub async fn call(&self, req: Request) -> Result<Response, StoreError> {
        let Ok(Ok(_permit)) =
            tokio::time::timeout(self.busy_wait, self.open.clone().acquire_owned()).await
        else {
            self.metrics.master_busy.inc();
            return Err(StoreError::MasterBusy);
        };
        let pooled = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut c = match pooled {
            Some(c) => c,
            None => Conn::connect(&self.upstream, self.call_timeout).await?,
        };
        let mut answers = c
            .call_all(std::slice::from_ref(&req), self.call_timeout)
            .await?;
        // Back to the pool before the permit is released (the permit counts it).
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).push(c);
        match answers.pop() {
            Some(Ok(r)) => Ok(r),
            Some(Err(code)) => Err(StoreError::Rpc(code)),
            None => Err(StoreError::Unexpected),
        }
    }
}

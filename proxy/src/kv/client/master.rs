//! The master on moongate's own pooled connections (never a client's: seq numbers are
//! per connection), through the same codec as the master face.

use std::sync::Mutex;
use std::time::Duration;

use super::StoreError;
use crate::codec::message::{Request, Response};
use crate::upstream::Conn;

/// Idle connections kept for reuse; beyond them a concurrent call opens its own.
const MAX_IDLE: usize = 8;

pub struct MasterConns {
    upstream: String,
    call_timeout: Duration,
    conns: Mutex<Vec<Conn>>,
}

impl MasterConns {
    pub fn new(upstream: String, call_timeout: Duration) -> MasterConns {
        MasterConns {
            upstream,
            call_timeout,
            conns: Mutex::new(Vec::new()),
        }
    }

    /// One call on a pooled connection of moongate's own; a connection that failed is
    /// dropped, not returned.
    pub async fn call(&self, req: Request) -> Result<Response, StoreError> {
        let pooled = self.conns.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut c = match pooled {
            Some(c) => c,
            None => Conn::connect(&self.upstream, self.call_timeout).await?,
        };
        let mut answers = c
            .call_all(std::slice::from_ref(&req), self.call_timeout)
            .await?;
        {
            let mut idle = self.conns.lock().unwrap_or_else(|p| p.into_inner());
            if idle.len() < MAX_IDLE {
                idle.push(c);
            }
        }
        match answers.pop() {
            Some(Ok(r)) => Ok(r),
            Some(Err(code)) => Err(StoreError::Rpc(code)),
            None => Err(StoreError::Unexpected),
        }
    }
}

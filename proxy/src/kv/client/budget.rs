//! The node's in-flight byte budget (`kv.max_inflight_bytes`): every get and put
//! reserves its value bytes before they move, and waits at most `kv.busy_wait_ms` for
//! room; then it is refused busy (503) instead of queueing without bound.

use std::sync::Arc;
use std::time::Duration;

use super::StoreError;
use crate::kv::metrics::KvMetrics;

/// Limits of the kv face's byte budget.
pub struct Budget {
    /// Value bytes in flight at most (a larger single value takes the whole budget).
    pub max_inflight_bytes: u64,
    /// How long a request waits for room before it is answered busy.
    pub busy_wait: Duration,
}

/// Budget permits of a transfer in progress; returned on drop (a streamed value holds
/// them until its last byte is sent).
pub struct Reserved {
    _permit: tokio::sync::OwnedSemaphorePermit,
    bytes: u64,
    metrics: Arc<KvMetrics>,
}

impl Reserved {
    /// Value bytes this reservation covers.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        self.metrics.inflight_bytes.dec_by(self.bytes as i64);
    }
}

/// Value bytes of gets and puts in progress, node-wide, in KiB permits.
pub struct ByteBudget {
    permits: Arc<tokio::sync::Semaphore>,
    kib: u32,
    busy_wait: Duration,
    metrics: Arc<KvMetrics>,
}

impl ByteBudget {
    pub fn new(b: &Budget, metrics: Arc<KvMetrics>) -> ByteBudget {
        let kib = (b.max_inflight_bytes / 1024).clamp(1, u64::from(u32::MAX >> 3)) as u32;
        ByteBudget {
            permits: Arc::new(tokio::sync::Semaphore::new(kib as usize)),
            kib,
            busy_wait: b.busy_wait,
            metrics,
        }
    }

    /// Value bytes in flight now (reserved by gets and puts in progress).
    pub fn inflight_bytes(&self) -> u64 {
        u64::from(self.kib - self.permits.available_permits() as u32) * 1024
    }

    /// The budget (`kv.max_inflight_bytes`).
    pub fn budget_bytes(&self) -> u64 {
        u64::from(self.kib) * 1024
    }

    /// KiB permits for `bytes`, at least 1 and at most the whole budget (clamped in u64:
    /// a peer-announced size must not wrap when narrowed).
    fn kib_of(&self, bytes: u64) -> u32 {
        bytes.div_ceil(1024).clamp(1, u64::from(self.kib)) as u32
    }

    async fn permits(&self, kib: u32) -> Result<tokio::sync::OwnedSemaphorePermit, StoreError> {
        let wait = self.permits.clone().acquire_many_owned(kib);
        match tokio::time::timeout(self.busy_wait, wait).await {
            Ok(Ok(p)) => Ok(p),
            _ => {
                self.metrics.busy.inc();
                Err(StoreError::Busy(self.inflight_bytes()))
            }
        }
    }

    /// Reserves `bytes` of the in-flight budget, waiting at most `busy_wait`.
    pub async fn reserve(&self, bytes: u64) -> Result<Reserved, StoreError> {
        let p = self.permits(self.kib_of(bytes)).await?;
        self.metrics.inflight_bytes.inc_by(bytes as i64);
        Ok(Reserved {
            _permit: p,
            bytes,
            metrics: self.metrics.clone(),
        })
    }

    /// Adds `more` bytes to `r` (a body that turned out longer than first reserved),
    /// waiting at most `busy_wait`; a reservation never holds more than the budget.
    pub async fn grow(&self, r: &mut Reserved, more: u64) -> Result<(), StoreError> {
        let total = r.bytes.saturating_add(more);
        let held = r._permit.num_permits() as u32;
        let need = self.kib_of(total).saturating_sub(held);
        if need > 0 {
            let p = self.permits(need).await?;
            r._permit.merge(p);
        }
        self.metrics.inflight_bytes.inc_by(more as i64);
        r.bytes = total;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(max_inflight_bytes: u64) -> ByteBudget {
        ByteBudget::new(
            &Budget {
                max_inflight_bytes,
                busy_wait: Duration::from_millis(20),
            },
            crate::metrics::Metrics::new().kv.clone(),
        )
    }

    #[tokio::test]
    async fn the_byte_budget_answers_busy_instead_of_queueing() {
        let s = budget(1 << 20);
        let a = s.reserve(600 << 10).await.unwrap();
        assert!(matches!(
            s.reserve(600 << 10).await,
            Err(StoreError::Busy(_))
        ));
        assert_eq!(s.metrics.busy.get(), 1);
        assert_eq!(s.metrics.inflight_bytes.get(), 600 << 10);
        drop(a);
        assert_eq!(s.metrics.inflight_bytes.get(), 0);
        // A value larger than the whole budget takes all of it, then proceeds.
        let big = s.reserve(5 << 20).await.unwrap();
        assert!(s.reserve(1).await.is_err());
        drop(big);
        assert!(s.reserve(1).await.is_ok());
        // A size past u32 KiB does not wrap to a small reservation.
        let huge = s.reserve((u64::from(u32::MAX) + 2) * 1024).await.unwrap();
        assert_eq!(s.inflight_bytes(), 1 << 20);
        drop(huge);
    }

    #[tokio::test]
    async fn a_reservation_grows_up_to_the_budget_and_not_beyond() {
        let s = budget(1 << 20);
        let mut r = s.reserve(1).await.unwrap();
        s.grow(&mut r, 300 << 10).await.unwrap();
        assert_eq!(s.inflight_bytes(), 301 << 10);
        assert_eq!(r.bytes(), (300 << 10) + 1);
        let other = s.reserve(700 << 10).await.unwrap();
        // No room left for growth: busy, and the reservation keeps what it had.
        assert!(matches!(
            s.grow(&mut r, 100 << 10).await,
            Err(StoreError::Busy(_))
        ));
        assert_eq!(r.bytes(), (300 << 10) + 1);
        drop(other);
        s.grow(&mut r, 5 << 20).await.unwrap();
        assert_eq!(s.inflight_bytes(), 1 << 20, "capped at the budget");
        drop(r);
        assert_eq!((s.inflight_bytes(), s.metrics.inflight_bytes.get()), (0, 0));
    }
}

//! The node's in-flight byte budget (`kv.max_inflight_bytes`): every get and put
//! reserves its value bytes before they move, and waits at most `kv.busy_wait_ms` for
//! room; then it is refused busy (503) instead of queueing without bound. A reservation
//! that finds the budget full first asks the budget's [`Reclaim`] (the API's stalled
//! request bodies) to give bytes back, so stalled peers cannot hold the room others wait
//! for.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
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

/// What can give budget bytes back when a reservation finds the budget full: asked
/// (synchronously, without waiting) to free at least `need` bytes; returns how many it
/// will free. The bytes come back when the holders drop their reservations, which the
/// waiting reservation then takes within `kv.busy_wait_ms`.
pub trait Reclaim: Send + Sync {
    fn reclaim(&self, need: u64) -> u64;
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
    reclaim: OnceLock<Arc<dyn Reclaim>>,
    /// KiB the reservations waiting for room ask for.
    waiting_kib: AtomicU64,
}

/// How often a reservation waiting for room asks the reclaimer again.
const RECLAIM_EVERY: Duration = Duration::from_millis(100);

/// A reservation's KiB counted as waiting while it is queued (also when its future is
/// dropped mid-wait).
struct Queued<'a> {
    waiting: &'a AtomicU64,
    kib: u64,
}

impl<'a> Queued<'a> {
    fn new(waiting: &'a AtomicU64, kib: u32) -> Queued<'a> {
        let kib = u64::from(kib);
        waiting.fetch_add(kib, Ordering::Relaxed);
        Queued { waiting, kib }
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.waiting.fetch_sub(self.kib, Ordering::Relaxed);
    }
}

impl ByteBudget {
    pub fn new(b: &Budget, metrics: Arc<KvMetrics>) -> ByteBudget {
        let kib = (b.max_inflight_bytes / 1024).clamp(1, u64::from(u32::MAX >> 3)) as u32;
        ByteBudget {
            permits: Arc::new(tokio::sync::Semaphore::new(kib as usize)),
            kib,
            busy_wait: b.busy_wait,
            metrics,
            reclaim: OnceLock::new(),
            waiting_kib: AtomicU64::new(0),
        }
    }

    /// Who is asked for bytes when the budget is full (set once; later calls are
    /// ignored).
    pub fn set_reclaim(&self, r: Arc<dyn Reclaim>) {
        let _ = self.reclaim.set(r);
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
        match self.permits.clone().try_acquire_many_owned(kib) {
            Ok(p) => return Ok(p),
            Err(tokio::sync::TryAcquireError::NoPermits) => self.ask_reclaim(kib),
            Err(tokio::sync::TryAcquireError::Closed) => {}
        }
        let _queued = Queued::new(&self.waiting_kib, kib);
        let wait = self.permits.clone().acquire_many_owned(kib);
        tokio::pin!(wait);
        let deadline = tokio::time::Instant::now() + self.busy_wait;
        loop {
            // Ask again while waiting (keeping the place in the queue): a body may
            // become stalled long enough to be shed after this wait began.
            let next = deadline.min(tokio::time::Instant::now() + RECLAIM_EVERY);
            tokio::select! {
                r = &mut wait => match r {
                    Ok(p) => return Ok(p),
                    Err(_) => break,
                },
                _ = tokio::time::sleep_until(next) => {
                    if next >= deadline {
                        break;
                    }
                    // Queued now: its own KiB are among the waiting ones.
                    self.ask_reclaim(0);
                }
            }
        }
        self.metrics.busy.inc();
        Err(StoreError::Busy(self.inflight_bytes()))
    }

    /// Asks the reclaimer for the room `kib` (not queued yet) lacks. The semaphore
    /// serves waiters in order, so this one is served once those queued before it are:
    /// their room too.
    fn ask_reclaim(&self, kib: u32) {
        if let Some(r) = self.reclaim.get() {
            let wanted = u64::from(kib) + self.waiting_kib.load(Ordering::Relaxed);
            let short = wanted.saturating_sub(self.permits.available_permits() as u64);
            if short > 0 {
                r.reclaim(short * 1024);
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

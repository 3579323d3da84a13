//! Wake-ups between the tasks of one connection, priced for the request path.
//!
//! A half of a connection waits on its socket and on a signal from another task (stop
//! reading for shutdown; a local answer to write; the client half ended). `select!`
//! polls every branch on every wake-up, so the signal is polled once per call: a
//! `tokio::sync::Notify` or a `CancellationToken` takes a lock on each poll (about 300
//! instructions per wake-up, counted with callgrind), a [`Flag`] an atomic load and a
//! waker registration. Knows no sockets and no frames.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use futures_util::task::AtomicWaker;

/// A flag one task waits on and any task raises. One waiter at a time: the last task
/// that polled is the one woken (each flag belongs to one half of one connection).
#[derive(Default)]
pub struct Flag {
    set: AtomicBool,
    waker: AtomicWaker,
}

impl Flag {
    /// Raises the flag and wakes the waiter, if any.
    pub fn raise(&self) {
        self.set.store(true, Ordering::Release);
        self.waker.wake();
    }

    /// Whether the flag is up (no wake-up registered).
    pub fn is_raised(&self) -> bool {
        self.set.load(Ordering::Acquire)
    }

    /// Ready once the flag is up; it stays up.
    pub fn raised(&self) -> impl Future<Output = ()> + '_ {
        std::future::poll_fn(move |cx| self.poll(cx, false))
    }

    /// Ready once the flag is up, and lowers it: a pulse, for "there is something new
    /// to look at" (raises between two waits count once).
    pub fn taken(&self) -> impl Future<Output = ()> + '_ {
        std::future::poll_fn(move |cx| self.poll(cx, true))
    }

    fn poll(&self, cx: &mut Context<'_>, take: bool) -> Poll<()> {
        let look = || {
            if take {
                self.set.swap(false, Ordering::AcqRel)
            } else {
                self.set.load(Ordering::Acquire)
            }
        };
        if look() {
            return Poll::Ready(());
        }
        self.waker.register(cx.waker());
        // Raised between the look and the registration: its wake may have found no
        // waker, so look again.
        if look() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[tokio::test]
    async fn a_raise_from_another_task_wakes_the_waiter_and_a_latched_flag_stays_up() {
        let f = Arc::new(Flag::default());
        let waiter = tokio::spawn({
            let f = f.clone();
            async move { f.raised().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        f.raise();
        tokio::time::timeout(Duration::from_secs(10), waiter)
            .await
            .expect("the raise woke the waiter")
            .unwrap();
        assert!(f.is_raised());
        f.raised().await;
    }

    #[tokio::test]
    async fn a_pulse_is_taken_once_and_raises_before_the_wait_are_not_lost() {
        let f = Flag::default();
        f.raise();
        f.raise();
        f.taken().await;
        assert!(!f.is_raised(), "taken lowers it");
        let again = tokio::time::timeout(Duration::from_millis(20), f.taken()).await;
        assert!(again.is_err(), "two raises before one wait count once");
    }
}

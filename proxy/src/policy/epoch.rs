//! The clock that stops a plugin call past its deadline: a thread that advances the
//! wasmtime engine's epoch, and rests while no plugin runs.
//!
//! Owns one thread and three atomics; knows nothing of plugins or calls beyond "one
//! started" and "one ended". Its costs, both paid on the host moongate shares with the
//! inference ranks:
//! - **a wake-up per tick**: the tick is a quarter of the call deadline (10 ms by default:
//!   400 wake-ups a second under traffic, not the 1,000 a 1 ms tick cost);
//! - **none at rest**: after [`REST_AFTER`] ticks in which no call started and none
//!   runs, the thread parks until the next call; an idle sidecar costs no wake-ups.
//!
//! A call pays two atomic adds and a load ([`EpochClock::enter`]), and a futex wake only
//! when it is the first call after a rest. The trade: a call is stopped between its
//! deadline and one tick after it (see [`EpochClock::ticks_for`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::Thread;
use std::time::Duration;

use wasmtime::Engine;

/// Ticks with no call before the clock rests.
const REST_AFTER: u32 = 4;

/// The tick bounds: at least a millisecond (wasmtime's check is cheap, the thread's
/// wake-up is not), at most 50 ms (the setup deadline is seconds; a coarser tick would
/// only blur it).
const MIN_TICK: Duration = Duration::from_millis(1);
const MAX_TICK: Duration = Duration::from_millis(50);

struct Shared {
    /// Calls started since the clock began (the clock rests only when this stands still).
    started: AtomicU64,
    /// Calls running now (a plugin looping in one call starts nothing new).
    running: AtomicUsize,
    /// The thread is parked, or about to: the next call must unpark it.
    resting: AtomicBool,
    stop: AtomicBool,
}

/// The epoch clock of one engine. Dropping it stops the thread.
pub struct EpochClock {
    tick: Duration,
    shared: Arc<Shared>,
    thread: Thread,
}

/// A call in progress; ends when dropped.
pub struct Running<'a>(&'a Shared);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::SeqCst);
    }
}

impl EpochClock {
    /// Starts the clock for `engine`, ticking a quarter of `call_timeout` (bounded).
    pub fn start(engine: Engine, call_timeout: Duration) -> std::io::Result<EpochClock> {
        let tick = (call_timeout / 4).clamp(MIN_TICK, MAX_TICK);
        let shared = Arc::new(Shared {
            started: AtomicU64::new(0),
            running: AtomicUsize::new(0),
            resting: AtomicBool::new(false),
            stop: AtomicBool::new(false),
        });
        let s = shared.clone();
        let handle = std::thread::Builder::new()
            .name("moongate-epoch".into())
            .spawn(move || run(engine, tick, &s))?;
        Ok(EpochClock {
            tick,
            shared,
            thread: handle.thread().clone(),
        })
    }

    /// The deadline, in ticks, for a call that may run `limit`: the epoch advances at
    /// most one tick after the call starts and then every tick, so `ceil(limit / tick) + 1`
    /// ticks stop the call between `limit` and `limit + tick` after it started, never
    /// before `limit`.
    pub fn ticks_for(&self, limit: Duration) -> u64 {
        let t = self.tick.as_nanos().max(1);
        (limit.as_nanos().div_ceil(t) as u64).max(1) + 1
    }

    /// Marks a call as running until the returned guard drops; wakes the clock if it
    /// rests. Call before setting the store's deadline.
    pub fn enter(&self) -> Running<'_> {
        // SeqCst pairs with the clock's rest check: either it sees this call, or this
        // call sees it resting and unparks it (a park after an unpark returns at once).
        self.shared.started.fetch_add(1, Ordering::SeqCst);
        self.shared.running.fetch_add(1, Ordering::SeqCst);
        if self.shared.resting.load(Ordering::SeqCst) {
            self.thread.unpark();
        }
        Running(&self.shared)
    }

    #[cfg(test)]
    fn resting(&self) -> bool {
        self.shared.resting.load(Ordering::SeqCst)
    }
}

impl Drop for EpochClock {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.thread.unpark();
    }
}

fn run(engine: Engine, tick: Duration, s: &Shared) {
    let mut seen = s.started.load(Ordering::SeqCst);
    let mut quiet = 0u32;
    while !s.stop.load(Ordering::SeqCst) {
        let now = s.started.load(Ordering::SeqCst);
        if now == seen && s.running.load(Ordering::SeqCst) == 0 {
            quiet += 1;
        } else {
            quiet = 0;
            seen = now;
        }
        if quiet >= REST_AFTER {
            s.resting.store(true, Ordering::SeqCst);
            // Checked again after announcing the rest: a call that started in between
            // either shows here or saw `resting` and will unpark.
            while s.started.load(Ordering::SeqCst) == seen
                && s.running.load(Ordering::SeqCst) == 0
                && !s.stop.load(Ordering::SeqCst)
            {
                std::thread::park();
            }
            s.resting.store(false, Ordering::SeqCst);
            quiet = 0;
            seen = s.started.load(Ordering::SeqCst);
        }
        std::thread::sleep(tick);
        engine.increment_epoch();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn engine() -> Engine {
        let mut cfg = wasmtime::Config::new();
        cfg.epoch_interruption(true);
        Engine::new(&cfg).unwrap()
    }

    #[test]
    fn a_deadline_is_never_shorter_than_its_limit() {
        let c = EpochClock::start(engine(), Duration::from_millis(10)).unwrap();
        assert_eq!(c.tick, Duration::from_micros(2500));
        // 10 ms in 2.5 ms ticks: the 5th advance comes after 10 ms, at most 12.5 ms.
        assert_eq!(c.ticks_for(Duration::from_millis(10)), 5);
        assert_eq!(c.ticks_for(Duration::from_millis(11)), 6);
        assert_eq!(c.ticks_for(Duration::ZERO), 2);
        let tiny = EpochClock::start(engine(), Duration::from_micros(100)).unwrap();
        assert_eq!(tiny.tick, MIN_TICK);
        assert_eq!(tiny.ticks_for(Duration::from_micros(100)), 2);
    }

    /// The clock rests when nothing runs and wakes for the next call; a call that stays
    /// keeps it ticking. Waits are bounded polls (a busy machine delays, never fails).
    #[test]
    fn rests_while_idle_and_wakes_for_a_call() {
        let c = EpochClock::start(engine(), Duration::from_millis(4)).unwrap();
        let until = |what: &str, f: &dyn Fn() -> bool| {
            let t = Instant::now();
            while !f() {
                assert!(t.elapsed() < Duration::from_secs(20), "never {what}");
                std::thread::sleep(Duration::from_millis(1));
            }
        };
        until("rested", &|| c.resting());
        let call = c.enter();
        until("woke", &|| !c.resting());
        // A running call never lets it rest, however long it runs (a looping plugin must
        // still be stopped): well past the rest threshold of 4 ticks of 1 ms.
        std::thread::sleep(Duration::from_millis(30));
        assert!(!c.resting(), "rested under a running call");
        drop(call);
        until("rested again", &|| c.resting());
    }
}

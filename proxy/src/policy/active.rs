//! The policies in force: one [`ActiveSet`] of arms in an `ArcSwap`, replaced whole.
//!
//! A call takes the set once and finishes on it, so a swap never disturbs a call in
//! flight. The set before the current one is kept as last-good (rollback returns to it);
//! replaced sets are dropped by a reaper thread after a delay, never on the request path.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use prometheus_client::metrics::counter::Counter;

use super::Policy;
use super::experiment::{Assign, ExperimentSpec, Window, arm_for_hash, assignment_hash};
use super::metrics::{ArmMetrics, PolicyFamilies};

/// An arm in force: its policy generation and its metric handles.
pub struct Arm {
    pub name: String,
    pub plugin: Arc<dyn Policy>,
    pub(super) weight: u64,
    pub metrics: ArmMetrics,
    stopped: AtomicBool,
    /// Guardrail window (experiments only).
    pub(super) window: Mutex<Window>,
    /// When a failed plugin call was last logged, and failures since then not logged.
    failure_log: Mutex<(Option<Instant>, u64)>,
}

/// A failing plugin is logged at most once per this interval per arm (with the count of
/// failures in between); every failure is counted in the call metrics regardless.
pub const FAILURE_LOG_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);

impl Arm {
    pub fn new(name: &str, plugin: Arc<dyn Policy>, weight: u64, families: &PolicyFamilies) -> Arm {
        Arm {
            metrics: families.arm(plugin.name(), plugin.version(), name),
            name: name.to_string(),
            plugin,
            weight,
            stopped: AtomicBool::new(false),
            window: Mutex::new(Window::new(Instant::now())),
            failure_log: Mutex::new((None, 0)),
        }
    }

    /// Whether a failed plugin call at `now` should be logged: `Some(n)` with the
    /// failures left unlogged before it, at most once per [`FAILURE_LOG_INTERVAL`].
    pub fn failure_to_log(&self, now: Instant) -> Option<u64> {
        let mut g = self.failure_log.lock().unwrap_or_else(|p| p.into_inner());
        let due =
            g.0.is_none_or(|at| now.saturating_duration_since(at) >= FAILURE_LOG_INTERVAL);
        if due {
            let skipped = g.1;
            *g = (Some(now), 0);
            Some(skipped)
        } else {
            g.1 += 1;
            None
        }
    }

    /// Its weight in the experiment (1 outside one).
    pub fn weight(&self) -> u64 {
        self.weight
    }

    pub fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Relaxed)
    }

    /// Stops the arm; `true` if this call stopped it.
    pub(super) fn stop(&self) -> bool {
        !self.stopped.swap(true, Ordering::Relaxed)
    }
}

/// The policies in force at one moment.
pub struct ActiveSet {
    pub generation: u64,
    pub arms: Vec<Arm>,
    pub control: usize,
    pub assign: Assign,
    pub experiment: Option<ExperimentSpec>,
    /// [`super::experiment::fnv1a`] of this sidecar's name (`assign = "member"`).
    pub member: u64,
    pub(super) activated: Instant,
    /// Plugin-failure calls seen since activation (automatic rollback).
    pub(super) probation: Mutex<Window>,
    /// `moongate_policy_guardrail_stops_total`, set when the set is put in force: a
    /// decision finishes on its set alone, without the registry.
    guardrail_stops: Counter,
}

impl ActiveSet {
    pub fn new(
        arms: Vec<Arm>,
        control: usize,
        assign: Assign,
        experiment: Option<ExperimentSpec>,
    ) -> ActiveSet {
        let now = Instant::now();
        ActiveSet {
            generation: 0,
            arms,
            control,
            assign,
            experiment,
            member: 0,
            activated: now,
            probation: Mutex::new(Window::new(now)),
            guardrail_stops: Counter::default(),
        }
    }

    /// The arm serving a call from `client` about `key`.
    pub fn pick(&self, client: &crate::codec::types::Uuid, key: Option<&[u8]>) -> usize {
        if self.arms.len() == 1 {
            return 0;
        }
        let h = assignment_hash(self.assign, client, key, self.member);
        let i = arm_for_hash(h, self.arms.iter().map(|a| a.weight));
        if self.arms[i].is_stopped() {
            self.control
        } else {
            i
        }
    }

    /// Guardrail bookkeeping for experiment arm `arm`: `failed` for a plugin failure or
    /// a client-visible error, `latency` of the upstream call when known. A breach stops
    /// the arm (its traffic goes to the control arm). Nothing outside an experiment.
    pub fn note_outcome(&self, arm: usize, failed: bool, latency: Option<Duration>) {
        let Some(exp) = &self.experiment else {
            return;
        };
        let Some(a) = self.arms.get(arm) else {
            return;
        };
        if self.arms.len() < 2 || arm == self.control || a.is_stopped() {
            return;
        }
        let g = &exp.guardrail;
        let breach = {
            let mut w = a.window.lock().unwrap_or_else(|p| p.into_inner());
            w.add(
                Instant::now(),
                Duration::from_millis(g.window_ms),
                failed,
                latency,
            );
            w.breach(g)
        };
        if let Some(why) = breach
            && a.stop()
        {
            self.guardrail_stops.inc();
            tracing::warn!(arm = %a.name, plugin = %a.plugin.name(), reason = %why,
                control = %self.arms[self.control].name, "guardrail stopped an experiment arm");
        }
    }
}

/// How long a replaced set is kept alive before the reaper drops it: calls that
/// started on it finish well within this.
const RETIRE_AFTER: Duration = Duration::from_secs(5);

/// The set in force, the last-good one, and the reaper of replaced ones.
pub struct Active {
    current: ArcSwap<ActiveSet>,
    last_good: Mutex<Option<Arc<ActiveSet>>>,
    generation: AtomicU64,
    retire: Mutex<std::sync::mpsc::Sender<Arc<ActiveSet>>>,
    /// Serializes activations (swap + last-good bookkeeping); never taken by calls.
    swap_lock: Mutex<()>,
}

impl Active {
    /// An empty set in force (no arms) and a reaper thread.
    pub fn new() -> std::io::Result<Active> {
        let (tx, rx) = std::sync::mpsc::channel::<Arc<ActiveSet>>();
        std::thread::Builder::new()
            .name("moongate-reaper".into())
            .spawn(move || {
                // Dropping a generation (instances, compiled code) can take milliseconds.
                for set in rx {
                    std::thread::sleep(RETIRE_AFTER);
                    drop(set);
                }
            })?;
        Ok(Active {
            current: ArcSwap::from_pointee(ActiveSet::new(Vec::new(), 0, Assign::Client, None)),
            last_good: Mutex::new(None),
            generation: AtomicU64::new(0),
            retire: Mutex::new(tx),
            swap_lock: Mutex::new(()),
        })
    }

    /// The set in force; hold it for the whole call.
    pub fn current(&self) -> Arc<ActiveSet> {
        self.current.load_full()
    }

    /// Whether `set` is still the one in force.
    pub fn is_current(&self, set: &Arc<ActiveSet>) -> bool {
        Arc::ptr_eq(set, &self.current.load())
    }

    pub fn last_good(&self) -> Option<Arc<ActiveSet>> {
        self.last_good
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Forgets the last-good set (at start-up: nobody chose the set before the first).
    pub fn clear_last_good(&self) {
        *self.last_good.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    fn retire(&self, set: Arc<ActiveSet>) {
        let _ = self
            .retire
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(set);
    }

    /// Puts `set` in force; the one it replaces becomes last-good. Returns its generation.
    pub fn swap_in(&self, mut set: ActiveSet, families: &PolicyFamilies) -> u64 {
        let _g = self.swap_lock.lock().unwrap_or_else(|p| p.into_inner());
        let generation = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
        set.generation = generation;
        set.guardrail_stops = families.guardrail_stops.clone();
        let old = self.current.swap(Arc::new(set));
        if !old.arms.is_empty() {
            let prev = self
                .last_good
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .replace(old);
            if let Some(prev) = prev {
                self.retire(prev);
            }
        }
        families.swaps.inc();
        families.active_generation.set(generation as i64);
        generation
    }

    /// Returns to the last-good set; `None` when there is none.
    pub fn rollback(&self, families: &PolicyFamilies) -> Option<u64> {
        let _g = self.swap_lock.lock().unwrap_or_else(|p| p.into_inner());
        let prev = self
            .last_good
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()?;
        let old = self.current.swap(prev.clone());
        self.retire(old);
        families.rollbacks.inc();
        families.active_generation.set(prev.generation as i64);
        Some(prev.generation)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_plugin_is_logged_once_per_interval_with_the_count_between() {
        let families = crate::metrics::Metrics::new().policy.clone();
        let fake: Arc<dyn Policy> = Arc::new(crate::policy::fake::Fake::new("f"));
        let arm = Arm::new("a", fake, 1, &families);
        let t0 = Instant::now();
        assert_eq!(arm.failure_to_log(t0), Some(0));
        for i in 1..=99u64 {
            assert_eq!(arm.failure_to_log(t0 + Duration::from_millis(i)), None);
        }
        assert_eq!(arm.failure_to_log(t0 + FAILURE_LOG_INTERVAL), Some(99));
        assert_eq!(arm.failure_to_log(t0 + FAILURE_LOG_INTERVAL), None);
    }
}

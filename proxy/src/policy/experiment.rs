//! Experiments: weighted arms, how a call is assigned to one, and the guardrail that
//! stops an arm whose calls go wrong (its traffic then goes to the control arm).
//!
//! Pure: assignment is a stable hash anyone can recompute ([`fnv1a`], [`arm_for_hash`]);
//! a guardrail [`Window`] is judged with the time passed in.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// How an experiment assigns calls to arms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum Assign {
    /// By the Mooncake client id: one rank stays in one arm.
    #[default]
    Client,
    /// By a hash of the (first) key.
    Key,
    /// By this sidecar's name (`fleet.member`): every call through one moongate goes to
    /// one arm. With one moongate per rank that is one arm per rank, also for
    /// requester-only ranks, whose calls carry no client id to assign by.
    Member,
}

/// Stops an arm whose calls go wrong.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Guardrail {
    /// Largest share of an arm's put calls that may fail (plugin failure, or an error
    /// for any key in the reply, denials included) within a window.
    pub max_error_ratio: f64,
    /// Largest mean master latency of an arm's put calls within a window; 0 = off.
    pub max_mean_latency_ms: f64,
    pub window_ms: u64,
    /// Calls a window needs before it can stop an arm.
    pub min_calls: u64,
}

impl Default for Guardrail {
    fn default() -> Self {
        Guardrail {
            max_error_ratio: 0.5,
            max_mean_latency_ms: 0.0,
            window_ms: 10_000,
            min_calls: 50,
        }
    }
}

/// One arm of an experiment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArmSpec {
    pub name: String,
    /// A plugin name from the catalog (`default` is always there).
    pub plugin: String,
    pub weight: u32,
}

/// How the arms of an experiment share the store's capacity (with moongate-driven
/// eviction on).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum ArmCapacity {
    /// One pool: rounds start on the master's usage and each arm frees its part by the
    /// bytes it holds. One arm's policy changes what the others keep (an arm that frees
    /// a lot leaves room the others use), which is what a fleet running that policy
    /// everywhere would see, but it biases an A/B comparison.
    #[default]
    Shared,
    /// Each arm owns `weight / sum of weights` of the capacity: a round starts when an
    /// arm's own keys pass the high watermark of its share and removes only its keys
    /// (its plugin chooses; moongate tops up with its least recently used keys when the
    /// plugin frees too little). No arm's policy can evict another arm's keys or crowd
    /// them out.
    ByWeight,
}

/// An experiment: `PUT /experiments` takes it as JSON, `[experiment]` as TOML.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExperimentSpec {
    #[serde(default)]
    pub assign: Assign,
    /// The arm that takes the traffic of stopped arms (default: the first arm).
    #[serde(default)]
    pub control: Option<String>,
    pub arms: Vec<ArmSpec>,
    #[serde(default)]
    pub guardrail: Guardrail,
    /// `shared` (default) or `by-weight`: see [`ArmCapacity`].
    #[serde(default)]
    pub capacity: ArmCapacity,
}

impl ExperimentSpec {
    /// Why the spec cannot run, if it cannot; `Ok(control arm index)` otherwise. An empty
    /// arm list is valid (it ends the experiment) and is not checked here.
    pub fn check(&self) -> Result<usize, String> {
        let mut names = std::collections::HashSet::new();
        for a in &self.arms {
            if !valid_name(&a.name) || !names.insert(a.name.clone()) {
                return Err(format!("arm names must be unique and valid ({:?})", a.name));
            }
        }
        let total: u64 = self.arms.iter().map(|a| u64::from(a.weight)).sum();
        if total == 0 {
            return Err("weights sum to 0".into());
        }
        let control = match &self.control {
            Some(c) => self
                .arms
                .iter()
                .position(|a| &a.name == c)
                .ok_or_else(|| format!("control arm {c:?} is not an arm"))?,
            None => 0,
        };
        let g = &self.guardrail;
        if !(0.0..=1.0).contains(&g.max_error_ratio)
            || g.window_ms == 0
            || g.max_mean_latency_ms < 0.0
        {
            return Err(
                "guardrail: max_error_ratio in [0,1], window_ms > 0, max_mean_latency_ms >= 0"
                    .into(),
            );
        }
        Ok(control)
    }
}

/// A name for a plugin or an arm: 1-64 characters of `[A-Za-z0-9._-]`.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// FNV-1a (64-bit): a stable hash for arm assignment that tests and operators can
/// recompute.
pub fn fnv1a(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in data {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The arm index a hash falls into, given the arms' weights (`hash % total`, walked in
/// arm order). Public so tests and tools can recompute an assignment.
pub fn arm_for_hash(h: u64, weights: impl Iterator<Item = u64> + Clone) -> usize {
    let total: u64 = weights.clone().sum();
    if total == 0 {
        return 0;
    }
    let mut x = h % total;
    for (i, w) in weights.enumerate() {
        if x < w {
            return i;
        }
        x -= w;
    }
    0
}

/// The hash a call is assigned by.
/// `member`: [`fnv1a`] of this sidecar's name, for [`Assign::Member`].
pub fn assignment_hash(
    assign: Assign,
    client: &crate::codec::types::Uuid,
    key: Option<&[u8]>,
    member: u64,
) -> u64 {
    match assign {
        Assign::Member => member,
        Assign::Client => {
            let mut b = [0u8; 16];
            b[..8].copy_from_slice(&client.first.to_le_bytes());
            b[8..].copy_from_slice(&client.second.to_le_bytes());
            fnv1a(&b)
        }
        Assign::Key => fnv1a(key.unwrap_or_default()),
    }
}

/// Calls, failures and latency within one window (a guardrail's, or an activation's
/// probation for automatic rollback).
#[derive(Debug)]
pub struct Window {
    start: Instant,
    pub calls: u64,
    pub failures: u64,
    latency_us: u64,
}

impl Window {
    pub fn new(now: Instant) -> Self {
        Window {
            start: now,
            calls: 0,
            failures: 0,
            latency_us: 0,
        }
    }

    /// Counts one call (restarting the window when `window` has passed since it began).
    pub fn add(&mut self, now: Instant, window: Duration, failed: bool, latency: Option<Duration>) {
        if now.saturating_duration_since(self.start) > window {
            *self = Window::new(now);
        }
        self.count(failed);
        if let Some(l) = latency {
            self.latency_us += l.as_micros() as u64;
        }
    }

    /// Counts one call in a window that never restarts (an activation's probation ends
    /// by the caller's clock instead).
    pub fn count(&mut self, failed: bool) {
        self.calls += 1;
        self.failures += u64::from(failed);
    }

    pub fn failure_ratio(&self) -> f64 {
        if self.calls == 0 {
            0.0
        } else {
            self.failures as f64 / self.calls as f64
        }
    }

    /// Why `g` stops the arm this window belongs to, if it does.
    pub fn breach(&self, g: &Guardrail) -> Option<String> {
        if self.calls < g.min_calls {
            None
        } else if self.failure_ratio() > g.max_error_ratio {
            Some(format!(
                "error ratio {:.2} > {}",
                self.failure_ratio(),
                g.max_error_ratio
            ))
        } else if g.max_mean_latency_ms > 0.0
            && (self.latency_us as f64 / self.calls as f64) / 1000.0 > g.max_mean_latency_ms
        {
            Some(format!("mean latency over {} ms", g.max_mean_latency_ms))
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_split_the_hash_space_in_arm_order() {
        let w = [30u64, 70];
        assert_eq!(arm_for_hash(0, w.iter().copied()), 0);
        assert_eq!(arm_for_hash(29, w.iter().copied()), 0);
        assert_eq!(arm_for_hash(30, w.iter().copied()), 1);
        assert_eq!(arm_for_hash(130, w.iter().copied()), 1);
        assert_eq!(arm_for_hash(100, w.iter().copied()), 0);
        assert_eq!(arm_for_hash(5, [0u64, 0].iter().copied()), 0);
    }

    #[test]
    fn a_window_breaches_on_errors_or_latency_once_it_has_enough_calls() {
        let g = Guardrail {
            max_error_ratio: 0.5,
            max_mean_latency_ms: 1.0,
            window_ms: 1_000,
            min_calls: 4,
        };
        let t0 = Instant::now();
        let win = Duration::from_millis(g.window_ms);
        let mut w = Window::new(t0);
        for _ in 0..3 {
            w.add(t0, win, true, None);
        }
        assert!(w.breach(&g).is_none(), "too few calls");
        w.add(t0, win, true, None);
        assert!(w.breach(&g).unwrap().contains("error ratio"));
        // A new window forgets the old one.
        let later = t0 + Duration::from_secs(2);
        w.add(later, win, false, Some(Duration::from_millis(5)));
        assert_eq!((w.calls, w.failures), (1, 0));
        for _ in 0..3 {
            w.add(later, win, false, Some(Duration::from_millis(5)));
        }
        assert!(w.breach(&g).unwrap().contains("latency"));
    }
}

//! The decision lifecycle, the same for every caller (the master face and the kv face):
//!
//! ```text
//!  decide ---------------> apply ----------------> settle
//!  pick the arm (set       the caller acts on      the outcome feeds the arm's
//!  held in a Ticket),      the action: forward,    guardrail (experiments), the
//!  call the hook, count,   rewrite, answer         rollback probation was fed at
//!  fail mode on failure    locally                 decide, and the plugin's observe
//! ```
//!
//! Every hook call goes through here: it is timed into the arm's histogram, counted by
//! result, and a failure applies `policy.fail_mode` (open: Mooncake's own behaviour;
//! closed: deny). Knows no frames and no sockets: callers pass decoded values.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::FailMode;
use super::active::{ActiveSet, Arm};
use super::host::{CallError, Interest, wit};
use super::metrics::CALL_RESULTS;
use super::registry::Registry;
use super::view::{
    PutAction, apply_lookup, decision_index, failed_decision, lookup_call, put_action, put_view,
};
use crate::codec::keys::Keys;
use crate::codec::message::{Request, Response};
use crate::codec::types::Uuid;

/// A decision taken: the set and arm that took it. Held until the outcome is known, so
/// a swap meanwhile changes nothing for this call.
#[derive(Clone)]
pub struct Ticket {
    pub set: Arc<ActiveSet>,
    pub arm: usize,
    /// The arm's plugin decided this call (put family): its outcome feeds the guardrail
    /// and `observe`. Other calls are only accounted to the arm that serves them.
    pub by_plugin: bool,
    /// The plugin failed on this call (the fail mode's decision stood in): it counts
    /// against the arm's guardrail.
    pub plugin_failed: bool,
}

impl Ticket {
    pub fn arm(&self) -> &Arm {
        &self.set.arms[self.arm]
    }
}

/// A put-family call's decision.
pub struct PutDecided {
    pub action: PutAction,
    pub ticket: Ticket,
}

/// How a decided call ended, as the caller saw it.
#[derive(Debug, Clone, Copy)]
pub struct Outcome<'a> {
    /// Master method name, e.g. "PutStart" (what `observe` receives).
    pub method: &'a str,
    /// 0 on success, else the first Mooncake ErrorCode, or -900 for a transport error.
    pub code: i32,
    /// The call failed as a whole or for any of its keys (policy denials included).
    pub failed: bool,
    /// Time the call took upstream (the master call; for the kv face the whole put).
    /// `None` when nothing went upstream (answered locally): then only the guardrail
    /// hears of it, not `observe`.
    pub latency: Option<Duration>,
    pub keys: usize,
}

/// The [`CALL_RESULTS`] index of a hook call's result.
fn result_index(r: &Result<impl Sized, CallError>) -> usize {
    match r {
        Ok(_) => 0,
        Err(e) => CALL_RESULTS
            .iter()
            .position(|k| *k == e.kind())
            .unwrap_or(1),
    }
}

impl Registry {
    /// The ticket of a call no plugin decides (lookups, ends, removes): the arm that
    /// serves `client` / `key`, for per-arm accounting and lookup steering.
    pub fn ticket(&self, set: Arc<ActiveSet>, client: &Uuid, key: Option<&[u8]>) -> Ticket {
        let arm = set.pick(client, key);
        Ticket {
            set,
            arm,
            by_plugin: false,
            plugin_failed: false,
        }
    }

    /// Decides a put-family request (`None` for other methods): picks the arm, asks its
    /// plugin (when it wants `on-put`), and turns the answer, or the fail mode's
    /// decision, into an action.
    pub fn decide_put(&self, set: &Arc<ActiveSet>, req: &Request) -> Option<PutDecided> {
        self.decide_put_as(set, req, None)
    }

    /// As [`Registry::decide_put`], the arm assigned by `who` (the caller's identity of
    /// the client, such as its process) instead of the client id the request carries.
    pub fn decide_put_as(
        &self,
        set: &Arc<ActiveSet>,
        req: &Request,
        who: Option<&Uuid>,
    ) -> Option<PutDecided> {
        let view = put_view(req)?;
        let arm_i = set.pick(
            who.unwrap_or(&view.client),
            view.keys.first().map(|k| &k[..]),
        );
        let arm = &set.arms[arm_i];
        let ticket = |plugin_failed| Ticket {
            set: set.clone(),
            arm: arm_i,
            by_plugin: true,
            plugin_failed,
        };
        if !arm.plugin.interest().contains(Interest::PUT) {
            arm.metrics.decisions[decision_index(&PutAction::Forward)].inc();
            return Some(PutDecided {
                action: PutAction::Forward,
                ticket: ticket(false),
            });
        }
        let started = Instant::now();
        let result = arm.plugin.on_put(&view.to_wit());
        arm.metrics
            .put_latency
            .observe(started.elapsed().as_secs_f64());
        arm.metrics.put_calls[result_index(&result)].inc();
        let plugin_failed = result.is_err();
        self.note_plugin_call(set, arm, plugin_failed);
        let decision = result.unwrap_or_else(|e| {
            self.warn_failed(arm, "on-put", &e);
            failed_decision(
                self.cfg.fail_mode,
                view.keys.len(),
                self.cfg.fail_closed_code,
            )
        });
        let action = put_action(req, &decision);
        arm.metrics.decisions[decision_index(&action)].inc();
        Some(PutDecided {
            action,
            ticket: ticket(plugin_failed),
        })
    }

    /// Logs a failed plugin call, at most once per [`super::active::FAILURE_LOG_INTERVAL`]
    /// per arm: a plugin failing on every call must not flood the log (each failure is
    /// counted in `moongate_policy_calls_total{result="error"}` anyway).
    fn warn_failed(&self, arm: &Arm, hook: &str, e: &dyn std::fmt::Display) {
        if let Some(unlogged) = arm.failure_to_log(Instant::now()) {
            tracing::warn!(plugin = %arm.plugin.name(), version = arm.plugin.version(),
                arm = %arm.name, hook, error = %e, fail_mode = ?self.cfg.fail_mode,
                unlogged_failures_before = unlogged, "policy call failed");
        }
    }

    /// Whether the arm's plugin steers lookups (`on-lookup`).
    pub fn steers_lookups(&self, arm: &Arm) -> bool {
        arm.plugin.interest().contains(Interest::LOOKUP)
    }

    /// Lets the arm's plugin reorder or drop the replicas of a lookup answer for `keys`.
    /// A failed call applies the fail mode (open: unchanged; closed: every key not
    /// found). Returns whether the answer changed.
    pub fn steer_lookup(&self, arm: &Arm, keys: &Keys, resp: &mut Response) -> bool {
        let Some(call) = lookup_call(keys, resp) else {
            return false;
        };
        let started = Instant::now();
        let result = arm.plugin.on_lookup(&call);
        arm.metrics
            .lookup_latency
            .observe(started.elapsed().as_secs_f64());
        arm.metrics.lookup_calls[result_index(&result)].inc();
        let keep = match result {
            Ok(k) => k,
            Err(e) => {
                self.warn_failed(arm, "on-lookup", &e);
                match self.cfg.fail_mode {
                    FailMode::Open => return false,
                    FailMode::Closed => vec![Vec::new(); call.counts.len()],
                }
            }
        };
        apply_lookup(resp, &keep)
    }

    /// Whether the arm's plugin chooses batch split points (`split`).
    pub fn splits_batches(&self, arm: &Arm) -> bool {
        arm.plugin.interest().contains(Interest::BATCH_SPLIT)
    }

    /// Where the arm's plugin cuts a batch whose keys weigh `sizes` bytes (0 where the
    /// request does not say), given the bytes in flight on this node and the limit:
    /// indexes where a new part starts, rising, inside `1..sizes.len()` (a plugin's answer
    /// is advice; it is cleaned to that). Empty when the plugin has no `split` hook or
    /// the call failed (either fail mode): splitting only changes how a batch travels,
    /// never its answer.
    pub fn split_points(&self, arm: &Arm, sizes: &[u64], in_flight: u64, limit: u64) -> Vec<usize> {
        if !self.splits_batches(arm) {
            return Vec::new();
        }
        let n = sizes.len();
        let call = wit::SplitCall {
            sizes: sizes.to_vec(),
            budget: wit::BudgetState {
                in_flight_bytes: in_flight,
                limit_bytes: limit,
            },
        };
        let started = Instant::now();
        let result = arm.plugin.split(&call);
        arm.metrics
            .split_latency
            .observe(started.elapsed().as_secs_f64());
        arm.metrics.split_calls[result_index(&result)].inc();
        match result {
            Ok(points) => {
                let mut points: Vec<usize> = points
                    .into_iter()
                    .map(|p| p as usize)
                    .filter(|&p| p > 0 && p < n)
                    .collect();
                points.sort_unstable();
                points.dedup();
                points
            }
            Err(e) => {
                self.warn_failed(arm, "split (batch left whole)", &e);
                Vec::new()
            }
        }
    }

    /// Asks the arm's plugin for eviction victims among `call`'s candidates. `None` when
    /// the plugin has no `evict` hook or the call failed (either fail mode): the evictor
    /// then falls back to least recently used first.
    pub fn evict_victims(
        &self,
        arm: &Arm,
        call: &wit::EvictCall,
        on_disk: Option<&[bool]>,
    ) -> Option<Vec<(usize, wit::EvictScope)>> {
        if !arm.plugin.interest().contains(Interest::EVICT) {
            return None;
        }
        let started = Instant::now();
        // With copies on an SSD, a plugin that has `evict-tiered` chooses per tier; any
        // other loses victims' memory copies only.
        let tiered = match on_disk {
            Some(on_disk) => arm
                .plugin
                .evict_tiered(&wit::TieredEvictCall {
                    call: call.clone(),
                    on_disk: on_disk.to_vec(),
                })
                .transpose(),
            None => None,
        };
        let result = match tiered {
            Some(r) => r.map(|v| {
                v.into_iter()
                    .map(|v| (v.index as usize, v.scope))
                    .collect::<Vec<_>>()
            }),
            None => arm.plugin.evict(call).map(|v| {
                v.into_iter()
                    .map(|i| (i as usize, wit::EvictScope::Memory))
                    .collect()
            }),
        };
        arm.metrics
            .evict_latency
            .observe(started.elapsed().as_secs_f64());
        arm.metrics.evict_calls[result_index(&result)].inc();
        match result {
            Ok(v) => Some(v),
            Err(e) => {
                self.warn_failed(arm, "evict (least recently used victims instead)", &e);
                None
            }
        }
    }

    /// The end of a decided call: its outcome feeds the arm's guardrail and, when it went
    /// upstream, the plugin's `observe`. Calls no plugin decided are not settled.
    pub fn settle(&self, t: &Ticket, o: &Outcome<'_>) {
        if !t.by_plugin {
            return;
        }
        let arm = t.arm();
        self.note_arm_outcome(&t.set, arm, o.failed || t.plugin_failed, o.latency);
        let Some(latency) = o.latency else {
            return;
        };
        if !arm.plugin.interest().contains(Interest::OBSERVE) {
            return;
        }
        let event = wit::Observation {
            method: o.method.to_string(),
            outcome: o.code,
            latency_us: latency.as_micros() as u64,
            keys: o.keys as u32,
        };
        if let Err(e) = arm.plugin.observe(&event) {
            tracing::debug!(plugin = %arm.plugin.name(), error = %e, "observe hook failed");
        }
    }

    /// Automatic rollback: a set activated less than `rollback.window_ms` ago whose
    /// plugin failures exceed the budget goes back to last-good.
    fn note_plugin_call(&self, set: &Arc<ActiveSet>, arm: &Arm, failed: bool) {
        let rb = &self.cfg.rollback;
        // Experiments have guardrails instead (fed one outcome per call by `settle`).
        if set.experiment.is_some() {
            return;
        }
        let window = Duration::from_millis(rb.window_ms);
        if set.activated.elapsed() > window {
            return;
        }
        let breach = {
            let mut w = set.probation.lock().unwrap_or_else(|p| p.into_inner());
            w.count(failed);
            w.calls >= rb.min_calls && w.failure_ratio() > rb.max_failure_ratio
        };
        if breach && self.active.is_current(set) {
            let why = format!(
                "plugin {} failed more than {:.0}% of calls within {} ms of activation",
                arm.plugin.name(),
                rb.max_failure_ratio * 100.0,
                rb.window_ms
            );
            let _ = self.rollback(&why);
        }
    }

    /// Guardrail bookkeeping for an experiment arm: `failed` for a plugin failure or a
    /// client-visible error, `latency` of the upstream call when known.
    pub fn note_arm_outcome(
        &self,
        set: &ActiveSet,
        arm: &Arm,
        failed: bool,
        latency: Option<Duration>,
    ) {
        let Some(exp) = &set.experiment else {
            return;
        };
        if set.arms.len() < 2 || std::ptr::eq(arm, &set.arms[set.control]) || arm.is_stopped() {
            return;
        }
        let g = &exp.guardrail;
        let breach = {
            let mut w = arm.window.lock().unwrap_or_else(|p| p.into_inner());
            w.add(
                Instant::now(),
                Duration::from_millis(g.window_ms),
                failed,
                latency,
            );
            w.breach(g)
        };
        if let Some(why) = breach
            && arm.stop()
        {
            self.metrics.guardrail_stops.inc();
            tracing::warn!(arm = %arm.name, plugin = %arm.plugin.name(), reason = %why,
                control = %set.arms[set.control].name, "guardrail stopped an experiment arm");
        }
    }
}

#[cfg(test)]
mod tests {
    //! The lifecycle with fake policies: no wasm, no master.

    use super::*;
    use crate::codec::message::PutStartArgs;
    use crate::codec::types::{ErrorCode, ReplicateConfig};
    use crate::metrics::Metrics;
    use crate::policy::experiment::{ArmSpec, Assign, ExperimentSpec, Guardrail};
    use crate::policy::fake::Fake;
    use crate::policy::{Policy, PolicyConfig};

    fn put(key: &'static str) -> Request {
        Request::PutStart(PutStartArgs {
            client_id: Uuid::default(),
            key: bytes::Bytes::from_static(key.as_bytes()),
            slice_length: 1,
            config: ReplicateConfig::default(),
            tenant_id: bytes::Bytes::from_static(b"default"),
        })
    }

    fn registry(
        cfg: PolicyConfig,
        exp: Option<ExperimentSpec>,
        fakes: Vec<Arc<Fake>>,
    ) -> Arc<Registry> {
        let policies = fakes.into_iter().map(|f| f as Arc<dyn Policy>).collect();
        Registry::with_policies(cfg, exp, Metrics::new().policy.clone(), policies).unwrap()
    }

    fn trapping(name: &str) -> Arc<Fake> {
        Arc::new(Fake::new(name).on_put(|_| Err(CallError::Trap("unreachable".into()))))
    }

    #[test]
    fn a_failed_call_applies_the_fail_mode() {
        let open = registry(PolicyConfig::default(), None, vec![trapping("t")]);
        let d = open.decide_put(&open.current(), &put("k")).unwrap();
        assert!(matches!(d.action, PutAction::Forward));
        assert!(d.ticket.plugin_failed && d.ticket.by_plugin);
        let closed = registry(
            PolicyConfig {
                fail_mode: FailMode::Closed,
                fail_closed_code: -200,
                ..PolicyConfig::default()
            },
            None,
            vec![trapping("t")],
        );
        let d = closed.decide_put(&closed.current(), &put("k")).unwrap();
        assert!(matches!(
            d.action,
            PutAction::Answer(Response::PutStart(Err(ErrorCode::NO_AVAILABLE_HANDLE)))
        ));
        let arm = &closed.current().arms[0];
        assert_eq!(arm.metrics.put_calls[1].get(), 1, "counted as a trap");
    }

    #[test]
    fn a_plugin_that_keeps_failing_right_after_activation_is_rolled_back() {
        let mut cfg = PolicyConfig::default();
        cfg.rollback.min_calls = 4;
        let r = registry(
            cfg,
            None,
            vec![Arc::new(Fake::new("good")), trapping("bad")],
        );
        r.activate("bad").unwrap();
        for _ in 0..4 {
            r.decide_put(&r.current(), &put("k")).unwrap();
        }
        assert_eq!(r.current().arms[0].plugin.name(), "good");
    }

    fn experiment(guardrail: Guardrail) -> ExperimentSpec {
        ExperimentSpec {
            assign: Assign::Key,
            control: Some("base".into()),
            arms: vec![
                ArmSpec {
                    name: "base".into(),
                    plugin: "base".into(),
                    weight: 1,
                },
                ArmSpec {
                    name: "new".into(),
                    plugin: "new".into(),
                    weight: 1,
                },
            ],
            guardrail,
            capacity: Default::default(),
        }
    }

    #[test]
    fn settled_failures_stop_an_experiment_arm_and_observe_hears_them() {
        let new = Arc::new(Fake::new("new").deny_prefix("", -200));
        let r = registry(
            PolicyConfig::default(),
            Some(experiment(Guardrail {
                max_error_ratio: 0.5,
                max_mean_latency_ms: 0.0,
                window_ms: 60_000,
                min_calls: 3,
            })),
            vec![Arc::new(Fake::new("base")), new.clone()],
        );
        let set = r.current();
        let t = Ticket {
            set: set.clone(),
            arm: 1,
            by_plugin: true,
            plugin_failed: false,
        };
        let failed = Outcome {
            method: "PutStart",
            code: -200,
            failed: true,
            latency: Some(Duration::from_micros(90)),
            keys: 1,
        };
        for _ in 0..2 {
            r.settle(&t, &failed);
        }
        assert!(!set.arms[1].is_stopped(), "below min_calls");
        r.settle(&t, &failed);
        assert!(set.arms[1].is_stopped());
        assert_eq!(new.observations().len(), 3);
        // Its traffic now goes to the control arm.
        assert!(
            (0..100).all(|i| set.pick(&Uuid::default(), Some(format!("k{i}").as_bytes())) == 0)
        );
        // A call no plugin decided is not settled.
        let untouched = Ticket {
            by_plugin: false,
            ..t.clone()
        };
        r.settle(&untouched, &failed);
        assert_eq!(new.observations().len(), 3);
        // Nothing went upstream: the guardrail hears of it, observe does not.
        r.settle(
            &t,
            &Outcome {
                latency: None,
                ..failed
            },
        );
        assert_eq!(new.observations().len(), 3);
    }

    #[test]
    fn split_points_are_cleaned_and_a_failed_split_leaves_the_batch_whole() {
        let messy = Arc::new(Fake::new("messy").split(|_| Ok(vec![0, 3, 1, 3, 9])));
        let r = registry(PolicyConfig::default(), None, vec![messy]);
        let set = r.current();
        assert_eq!(r.split_points(&set.arms[0], &[1, 1, 1, 1], 0, 0), [1, 3]);
        let broken = Arc::new(
            Fake::new("broken").split(|_| Err(CallError::Timeout(Duration::from_millis(1)))),
        );
        let r = registry(PolicyConfig::default(), None, vec![broken]);
        let set = r.current();
        assert!(r.split_points(&set.arms[0], &[1, 1], 0, 0).is_empty());
        assert_eq!(
            set.arms[0].metrics.split_calls[2].get(),
            1,
            "counted as a timeout"
        );
        let none = registry(
            PolicyConfig::default(),
            None,
            vec![Arc::new(Fake::new("none"))],
        );
        let set = none.current();
        assert!(none.split_points(&set.arms[0], &[1, 1], 0, 0).is_empty());
    }

    #[test]
    fn lookup_steering_fail_closed_answers_not_found() {
        use crate::codec::types::GetReplicaListResponse;
        let failing = Arc::new(Fake::new("f").on_lookup(|_| Err(CallError::OutOfMemory)));
        let r = registry(
            PolicyConfig {
                fail_mode: FailMode::Closed,
                ..PolicyConfig::default()
            },
            None,
            vec![failing],
        );
        let mut resp = Response::GetReplicaList(Ok(GetReplicaListResponse {
            replicas: vec![],
            lease_ttl_ms: 1,
            object_checksum: None,
        }));
        let set = r.current();
        assert!(r.steer_lookup(
            &set.arms[0],
            &vec![bytes::Bytes::from_static(b"k")].into(),
            &mut resp
        ));
        assert_eq!(
            resp,
            Response::GetReplicaList(Err(ErrorCode::OBJECT_NOT_FOUND))
        );
    }
}

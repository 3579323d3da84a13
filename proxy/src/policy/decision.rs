//! The decision lifecycle, the same for every caller (the master face, the kv face's
//! single and batch puts, the simulator):
//!
//! ```text
//!  decide ---------------> send -----------------> finish
//!  pick the arm (set       the request to send     the outcome feeds the arm's
//!  held in a Ticket),      upstream (as received   guardrail (experiments) and the
//!  call the hook, count,   or rewritten, denied    plugin's observe; the rollback
//!  fail mode on failure    keys' fixup), or the    probation was fed at decide
//!                          local answer (finished)
//! ```
//!
//! A [`Decision`] owns that lifecycle: callers act on what it says to send and tell its
//! [`Ticket`] how the call ended, nothing more. Every hook call, whoever makes it (the
//! faces, the evictor, the events thread), goes through one timed call here: timed into
//! the arm's histogram, counted by result, a failure logged (rate-limited) with what
//! stands in for it. Knows no frames and no sockets: callers pass decoded values.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::active::{ActiveSet, Arm};
use super::host::{CallError, Interest, wit};
use super::metrics::{CALL_RESULTS, Hook};
use super::registry::Registry;
use super::view::{
    Fixup, PutAction, apply_lookup, decision_index, failed_decision, lookup_call, put_action,
    put_view,
};
use super::{FailMode, Policy};
use crate::calls::CallExt;
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

    /// The end of the call: its outcome feeds the arm's guardrail and, when it went
    /// upstream, the plugin's `observe`. Calls no plugin decided have nothing to finish.
    pub fn finish(&self, o: &Outcome<'_>) {
        if !self.by_plugin {
            return;
        }
        let arm = self.arm();
        self.set
            .note_outcome(self.arm, o.failed || self.plugin_failed, o.latency);
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
        // A failed observe changes nothing: it is counted and logged like any hook.
        let _ = timed(arm, Hook::Observe, None, |p| p.observe(&event));
    }
}

/// A call's decision: which arm serves it and, for the put family, what its plugin
/// decided. Made by [`Registry::decide`] for every decoded call.
pub struct Decision {
    ticket: Ticket,
    action: PutAction,
}

/// What a [`Decision`] sends.
// Matched at once where it is made: boxing the request would allocate on every call.
#[allow(clippy::large_enum_variant)]
pub enum Sending {
    /// The call goes upstream: `request` is the one received (`rewritten` false: its
    /// bytes may be relayed as they came) or the policy's rewrite; `fixup` merges the
    /// keys the policy denied back into the master's answer. Finish `ticket` when the
    /// call has ended.
    Upstream {
        ticket: Ticket,
        request: Request,
        rewritten: bool,
        fixup: Option<Fixup>,
    },
    /// The policy refused every key: `answer` is the client's answer (one error per key
    /// for a batch; the codes also in `refused`). Nothing goes upstream and the decision
    /// is already finished (the guardrail heard of it; `observe` does not).
    Answered { answer: Response, refused: Fixup },
}

impl Decision {
    pub fn ticket(&self) -> &Ticket {
        &self.ticket
    }

    /// Whether a plugin decided it (the put family); other calls are only assigned an
    /// arm.
    pub fn by_plugin(&self) -> bool {
        self.ticket.by_plugin
    }

    /// The keys the policy refused, by position in the call, whether some (the rest go
    /// upstream) or all (answered locally); `None` when it refused none.
    pub fn refused(&self) -> Option<&Fixup> {
        match &self.action {
            PutAction::Forward => None,
            PutAction::Rewrite { fixup, .. } => fixup.as_ref(),
            PutAction::Answer { refused, .. } => Some(refused),
        }
    }

    /// The arm's ticket, for a call no plugin decides.
    pub fn into_ticket(self) -> Ticket {
        self.ticket
    }

    /// What to send for `original`, the request this decision was taken on. A call
    /// answered locally is finished here.
    pub fn send(self, original: Request) -> Sending {
        let ticket = self.ticket;
        match self.action {
            PutAction::Forward => Sending::Upstream {
                ticket,
                request: original,
                rewritten: false,
                fixup: None,
            },
            PutAction::Rewrite { request, fixup } => Sending::Upstream {
                ticket,
                request: *request,
                rewritten: true,
                fixup,
            },
            PutAction::Answer { answer, refused } => {
                ticket.finish(&Outcome {
                    method: original.method().name(),
                    code: refused.denied.first().map_or(0, |(_, c)| c.0),
                    failed: true,
                    latency: None,
                    keys: refused.total,
                });
                Sending::Answered { answer, refused }
            }
        }
    }

    /// The end of a call whose sending the caller did itself (the simulator).
    pub fn finish(self, o: &Outcome<'_>) {
        self.ticket.finish(o)
    }
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

impl<'a> Outcome<'a> {
    /// The outcome of a call from its per-key codes (0: that key succeeded): the first
    /// error is the call's code.
    pub fn of_codes(
        method: &'a str,
        codes: impl Iterator<Item = i32>,
        latency: Option<Duration>,
    ) -> Outcome<'a> {
        let (mut keys, mut code) = (0usize, 0i32);
        for c in codes {
            keys += 1;
            if code == 0 {
                code = c;
            }
        }
        Outcome {
            method,
            code,
            failed: code != 0,
            latency,
            keys,
        }
    }
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

/// The one way a hook is called: timed into the arm's histogram for `hook`, counted by
/// result, a failure logged at most once per [`super::active::FAILURE_LOG_INTERVAL`]
/// per arm (a plugin failing on every call must not flood the log; each failure is
/// counted in `moongate_policy_calls_total{result!="ok"}` anyway). `fail_mode` goes in
/// the log line where it decides what stands in.
fn timed<T>(
    arm: &Arm,
    hook: Hook,
    fail_mode: Option<FailMode>,
    call: impl FnOnce(&dyn Policy) -> Result<T, CallError>,
) -> Result<T, CallError> {
    let started = Instant::now();
    let result = call(&*arm.plugin);
    record(arm, hook, fail_mode, started, &result);
    result
}

/// Accounts one hook call that started at `started` (see [`timed`]).
fn record<T>(
    arm: &Arm,
    hook: Hook,
    fail_mode: Option<FailMode>,
    started: Instant,
    result: &Result<T, CallError>,
) {
    let m = arm.metrics.hook(hook);
    m.latency.observe(started.elapsed().as_secs_f64());
    m.calls[result_index(result)].inc();
    if let Err(e) = result {
        failed(arm, hook, fail_mode, e);
    }
}

#[cold]
#[inline(never)]
fn failed(arm: &Arm, hook: Hook, fail_mode: Option<FailMode>, e: &CallError) {
    if let Some(unlogged) = arm.failure_to_log(Instant::now()) {
        tracing::warn!(plugin = %arm.plugin.name(), version = arm.plugin.version(),
            arm = %arm.name, hook = hook.name(), error = %e, instead = hook.fallback(),
            ?fail_mode, unlogged_failures_before = unlogged, "policy call failed");
    }
}

impl Registry {
    /// Decides a decoded call: picks the arm that serves `who` (the caller's identity of
    /// the client, such as its process; the client id the request carries when `None`)
    /// and, for the put family, asks its plugin (when it wants `on-put`) and turns the
    /// answer, or the fail mode's decision, into what to send.
    pub fn decide(&self, set: &Arc<ActiveSet>, req: &Request, who: Option<&Uuid>) -> Decision {
        let Some(view) = put_view(req) else {
            let arm = set.pick(who.unwrap_or(&Uuid::default()), req.first_key());
            return Decision {
                ticket: Ticket {
                    set: set.clone(),
                    arm,
                    by_plugin: false,
                    plugin_failed: false,
                },
                action: PutAction::Forward,
            };
        };
        let arm_i = set.pick(
            who.unwrap_or(&view.client),
            view.keys.first().map(|k| &k[..]),
        );
        let arm = &set.arms[arm_i];
        let decided = |action: PutAction, plugin_failed| {
            arm.metrics.decisions[decision_index(&action)].inc();
            Decision {
                ticket: Ticket {
                    set: set.clone(),
                    arm: arm_i,
                    by_plugin: true,
                    plugin_failed,
                },
                action,
            }
        };
        if !arm.plugin.interest().contains(Interest::PUT) {
            return decided(PutAction::Forward, false);
        }
        let fail_mode = self.cfg.fail_mode;
        let result = timed(arm, Hook::Put, Some(fail_mode), |p| {
            p.on_put(&view.to_wit())
        });
        let plugin_failed = result.is_err();
        self.note_plugin_call(set, arm, plugin_failed);
        let decision = result.unwrap_or_else(|_| {
            failed_decision(fail_mode, view.keys.len(), self.cfg.fail_closed_code)
        });
        decided(put_action(req, &decision), plugin_failed)
    }

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
        let fail_mode = self.cfg.fail_mode;
        let keep = match timed(arm, Hook::Lookup, Some(fail_mode), |p| p.on_lookup(&call)) {
            Ok(k) => k,
            Err(_) => match fail_mode {
                FailMode::Open => return false,
                FailMode::Closed => vec![Vec::new(); call.counts.len()],
            },
        };
        apply_lookup(resp, &keep)
    }

    /// The arm the active set assigns to calls of `who` about `key` (what a decision of
    /// theirs is accounted to): the set and the arm's index. The one place faces learn an
    /// arm outside a decision.
    pub fn arm_for(&self, who: &Uuid, key: Option<&[u8]>) -> (Arc<ActiveSet>, usize) {
        let set = self.current();
        let arm = set.pick(who, key);
        (set, arm)
    }

    /// Where a batch of keys weighing `sizes` is cut, the one place split points are
    /// assembled: the caller's own `bounds` (part starts it needs: every N keys, where a
    /// byte bound runs out) and the arm's plugin's `split` points (given the bytes in
    /// flight and the limit), rising, inside `1..sizes.len()`, each once.
    pub fn cut(
        &self,
        arm: &Arm,
        sizes: &[u64],
        in_flight: u64,
        limit: u64,
        bounds: impl IntoIterator<Item = usize>,
    ) -> Vec<usize> {
        let n = sizes.len();
        let mut points: Vec<usize> = bounds.into_iter().filter(|&p| p > 0 && p < n).collect();
        points.extend(self.split_points(arm, sizes, in_flight, limit));
        points.sort_unstable();
        points.dedup();
        points
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
        let Ok(points) = timed(arm, Hook::Split, None, |p| p.split(&call)) else {
            return Vec::new();
        };
        let mut points: Vec<usize> = points
            .into_iter()
            .map(|p| p as usize)
            .filter(|&p| p > 0 && p < n)
            .collect();
        points.sort_unstable();
        points.dedup();
        points
    }

    /// Asks the arm's plugin for eviction victims among `call`'s candidates. `None` when
    /// the plugin has no `evict` hook or the call failed (either fail mode): the evictor
    /// then falls back to least recently used first.
    pub fn evict_victims(
        &self,
        arm: &Arm,
        call: &wit::EvictCall,
        on_disk: Option<&[bool]>,
        hints: Option<&[wit::CandidateHint]>,
    ) -> Option<Vec<(usize, wit::EvictScope)>> {
        if !arm.plugin.interest().contains(Interest::EVICT) {
            return None;
        }
        timed(arm, Hook::Evict, None, |p| {
            // With hints, a plugin that has `evict-hinted` reads them (and chooses per
            // tier as `evict-tiered` would).
            let hinted = match hints {
                Some(hints) => p
                    .evict_hinted(&wit::HintedEvictCall {
                        call: call.clone(),
                        on_disk: on_disk.map(<[bool]>::to_vec).unwrap_or_default(),
                        hints: hints.to_vec(),
                    })
                    .transpose(),
                None => None,
            };
            if let Some(r) = hinted {
                return r.map(|v| {
                    v.into_iter()
                        .map(|v| (v.index as usize, v.scope))
                        .collect::<Vec<_>>()
                });
            }
            // With copies on an SSD, a plugin that has `evict-tiered` chooses per tier;
            // any other loses victims' memory copies only.
            let tiered = match on_disk {
                Some(on_disk) => p
                    .evict_tiered(&wit::TieredEvictCall {
                        call: call.clone(),
                        on_disk: on_disk.to_vec(),
                    })
                    .transpose(),
                None => None,
            };
            match tiered {
                Some(r) => r.map(|v| {
                    v.into_iter()
                        .map(|v| (v.index as usize, v.scope))
                        .collect::<Vec<_>>()
                }),
                None => p.evict(call).map(|v| {
                    v.into_iter()
                        .map(|i| (i as usize, wit::EvictScope::Memory))
                        .collect()
                }),
            }
        })
        .ok()
    }

    /// The block each of `keys` names, by the arm's plugin (`block-refs` or
    /// `block-keys`), for the KV events. `Ok(None)`: the plugin has neither hook (its
    /// keys publish nothing; not a call, so not counted).
    pub fn blocks(
        &self,
        arm: &Arm,
        keys: &wit::PackedKeys,
    ) -> Result<Option<Vec<Option<wit::Block>>>, CallError> {
        let started = Instant::now();
        let result = arm.plugin.blocks(keys);
        if !matches!(result, Ok(None)) {
            record(arm, Hook::BlockKeys, None, started, &result);
        }
        result
    }

    /// Automatic rollback: a set activated less than `rollback.window_ms` ago whose
    /// plugin failures exceed the budget goes back to last-good.
    fn note_plugin_call(&self, set: &Arc<ActiveSet>, arm: &Arm, failed: bool) {
        let rb = &self.cfg.rollback;
        // Experiments have guardrails instead (fed one outcome per call when it ends).
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
}

#[cfg(test)]
mod tests {
    //! The lifecycle with fake policies: no wasm, no master.

    use super::*;
    use crate::calls::AnswerExt;
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
        let d = open.decide(&open.current(), &put("k"), None);
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
        let d = closed.decide(&closed.current(), &put("k"), None);
        assert_eq!(
            d.refused().map(|f| f.denied.clone()),
            Some(vec![(0, ErrorCode(-200))])
        );
        let Sending::Answered { answer, .. } = d.send(put("k")) else {
            panic!("a refused put is answered locally");
        };
        assert_eq!(
            answer,
            Response::PutStart(Err(ErrorCode::NO_AVAILABLE_HANDLE))
        );
        let arm = &closed.current().arms[0];
        assert_eq!(
            arm.metrics.hook(Hook::Put).calls[1].get(),
            1,
            "counted as a trap"
        );
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
            r.decide(&r.current(), &put("k"), None);
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
            t.finish(&failed);
        }
        assert!(!set.arms[1].is_stopped(), "below min_calls");
        t.finish(&failed);
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
        untouched.finish(&failed);
        assert_eq!(new.observations().len(), 3);
        // Nothing went upstream: the guardrail hears of it, observe does not.
        t.finish(&Outcome {
            latency: None,
            ..failed
        });
        assert_eq!(new.observations().len(), 3);
    }

    #[test]
    fn a_decision_says_what_to_send_and_finishes_a_local_answer_itself() {
        let fake = Arc::new(Fake::new("new").deny_prefix("no/", -200));
        let mut spec = experiment(Guardrail {
            max_error_ratio: 0.4,
            max_mean_latency_ms: 0.0,
            window_ms: 60_000,
            min_calls: 1,
        });
        // Both arms run the denying plugin; only the non-control one has a guardrail.
        spec.arms[0].plugin = "new".into();
        let r = registry(PolicyConfig::default(), Some(spec), vec![fake.clone()]);
        let set = r.current();
        fn batch(keys: &[&str]) -> Request {
            Request::BatchPutStart(crate::codec::message::BatchPutStartArgs {
                client_id: Uuid::default(),
                keys: keys
                    .iter()
                    .map(|k| bytes::Bytes::copy_from_slice(k.as_bytes()))
                    .collect(),
                slice_lengths: vec![1; keys.len()],
                config: ReplicateConfig::default(),
                tenant_id: bytes::Bytes::from_static(b"default"),
            })
        }
        // Some keys denied: the rest go upstream, the denied ones are known by position.
        let req = batch(&["no/a", "yes", "no/b"]);
        let d = r.decide(&set, &req, None);
        let refused = d.refused().expect("two keys refused").denied.clone();
        assert_eq!(refused, [(0, ErrorCode(-200)), (2, ErrorCode(-200))]);
        let Sending::Upstream {
            ticket,
            request,
            rewritten,
            fixup,
        } = d.send(req)
        else {
            panic!("one key admitted: the call goes upstream");
        };
        assert!(rewritten && fixup.is_some());
        assert_eq!(request.first_key(), Some(&b"yes"[..]));
        ticket.finish(&Outcome::of_codes(
            "BatchPutStart",
            [0].into_iter(),
            Some(Duration::ZERO),
        ));
        // Every key denied: answered locally, finished on the spot (the guardrail heard
        // of it, observe did not), nothing left for the caller to settle.
        // (on the arm with a guardrail: arms are assigned by the first key)
        let first = (0..)
            .map(|i| format!("no/{i}"))
            .find(|k| set.pick(&Uuid::default(), Some(k.as_bytes())) == 1)
            .unwrap_or_default();
        let req = batch(&[&first, "no/d"]);
        let d = r.decide(&set, &req, None);
        assert_eq!(d.ticket().arm, 1);
        let Sending::Answered { answer, refused } = d.send(req) else {
            panic!("every key refused: answered locally");
        };
        assert_eq!(answer.error_count(), 2);
        assert_eq!(refused.total, 2);
        assert_eq!(
            fake.observations().len(),
            1,
            "observe: only the call that went up"
        );
        assert!(
            set.arms[1].is_stopped(),
            "the guardrail heard the local answer"
        );
        // Other calls get an arm and nothing to decide.
        let lookup = Request::ExistKey(crate::codec::message::KeyArgs {
            key: bytes::Bytes::from_static(b"k"),
            tenant_id: bytes::Bytes::from_static(b"default"),
        });
        let d = r.decide(&set, &lookup, None);
        assert!(!d.by_plugin() && d.refused().is_none());
    }

    #[test]
    fn every_hook_is_timed_and_counted_in_one_place() {
        use crate::policy::metrics::Hook;
        let mapped = Arc::new(
            Fake::new("mapped")
                .on_put(|_| {
                    Ok(wit::PutDecision {
                        config: None,
                        admissions: Vec::new(),
                    })
                })
                .blocks(|_| Err(CallError::Trap("bad mapping".into()))),
        );
        let r = registry(PolicyConfig::default(), None, vec![mapped]);
        let set = r.current();
        let arm = &set.arms[0];
        let d = r.decide(&set, &put("k"), None);
        let Sending::Upstream { ticket, .. } = d.send(put("k")) else {
            panic!("admitted");
        };
        ticket.finish(&Outcome::of_codes(
            "PutStart",
            [0].into_iter(),
            Some(Duration::ZERO),
        ));
        let keys = crate::policy::pack_keys([b"k"].iter());
        assert!(r.blocks(arm, &keys).is_err());
        let count = |h: Hook, result: usize| arm.metrics.hook(h).calls[result].get();
        assert_eq!(count(Hook::Put, 0), 1);
        assert_eq!(count(Hook::Observe, 0), 1);
        assert_eq!(
            count(Hook::BlockKeys, 1),
            1,
            "a failed mapping is counted as a trap"
        );
        // A plugin without the mapping is not called, so nothing is counted.
        let bare = registry(
            PolicyConfig::default(),
            None,
            vec![Arc::new(Fake::new("b"))],
        );
        let set = bare.current();
        assert!(matches!(bare.blocks(&set.arms[0], &keys), Ok(None)));
        assert_eq!(set.arms[0].metrics.hook(Hook::BlockKeys).calls[0].get(), 0);
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
            set.arms[0].metrics.hook(Hook::Split).calls[2].get(),
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

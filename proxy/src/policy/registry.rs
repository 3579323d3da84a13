//! The set of policies in force, swapped atomically.
//!
//! - A catalog of loaded plugins (each passed pre-flight: compile, instantiate,
//!   configure, conformance calls); a plugin that fails pre-flight is recorded as
//!   rejected with its reason and changes nothing.
//! - The active set lives in an `ArcSwap`: a call takes the set once and finishes on it,
//!   so a swap never disturbs a call in flight. Replaced sets are dropped by a reaper
//!   thread after a delay, never on the request path.
//! - Last-good: the set before the current one. Rollback returns to it, on request or
//!   automatically when a freshly activated plugin's failure rate breaches
//!   `policy.rollback` within its window.
//! - Experiments: weighted arms assigned by client id or key hash; each arm has its own
//!   metric handles and a guardrail that stops it (its traffic then goes to the control
//!   arm) when its error ratio or mean latency breaches the budget.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::host::{HostLimits, Interest, LoadError, Plugin, PolicyEngine};
use super::{PutAction, decision_index, failed_decision, fnv1a, put_action, put_view};
use crate::codec::message::Request;
use crate::config::PolicyConfig;
use crate::metrics::{ArmMetrics, CALL_RESULTS, Metrics};

/// The policy moongate embeds: Mooncake's behaviour unchanged.
pub const DEFAULT_PLUGIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/default.wasm"));

/// How an experiment assigns calls to arms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum Assign {
    /// By the Mooncake client id: one rank stays in one arm.
    #[default]
    Client,
    /// By a hash of the (first) key.
    Key,
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
}

#[derive(Debug, Error)]
pub enum RegistryError {
    #[error("{0}")]
    Load(#[from] LoadError),
    #[error("no plugin named {0:?} is loaded")]
    UnknownPlugin(String),
    #[error("invalid experiment: {0}")]
    BadExperiment(String),
    #[error("there is no last-good policy set to roll back to")]
    NoLastGood,
    #[error("cannot read {path}: {error}")]
    Read { path: String, error: std::io::Error },
    #[error("invalid plugin name {0:?}: use 1-64 characters of [A-Za-z0-9._-]")]
    BadName(String),
}

struct Window {
    start: Instant,
    calls: u64,
    failures: u64,
    latency_us: u64,
}

impl Window {
    fn new() -> Self {
        Window {
            start: Instant::now(),
            calls: 0,
            failures: 0,
            latency_us: 0,
        }
    }
}

/// An arm in force: its plugin generation and its metric handles.
pub struct Arm {
    pub name: String,
    pub plugin: Arc<Plugin>,
    weight: u64,
    pub metrics: ArmMetrics,
    stopped: AtomicBool,
    window: Mutex<Window>,
}

impl Arm {
    pub fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Relaxed)
    }
}

/// The policies in force at one moment.
pub struct ActiveSet {
    pub generation: u64,
    pub arms: Vec<Arm>,
    pub control: usize,
    pub assign: Assign,
    pub experiment: Option<ExperimentSpec>,
    activated: Instant,
    /// Plugin-failure calls seen since activation (automatic rollback).
    probation: Mutex<Window>,
}

impl ActiveSet {
    /// The arm serving a call from `client` about `key`.
    pub fn pick(&self, client: &crate::codec::types::Uuid, key: Option<&Bytes>) -> usize {
        if self.arms.len() == 1 {
            return 0;
        }
        let h = match self.assign {
            Assign::Client => {
                let mut b = [0u8; 16];
                b[..8].copy_from_slice(&client.first.to_le_bytes());
                b[8..].copy_from_slice(&client.second.to_le_bytes());
                fnv1a(&b)
            }
            Assign::Key => fnv1a(key.map_or(&[][..], |k| &k[..])),
        };
        let i = arm_for_hash(h, self.arms.iter().map(|a| a.weight));
        if self.arms[i].is_stopped() {
            self.control
        } else {
            i
        }
    }
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

/// A put-family call's decision.
pub struct PutDecided {
    pub action: PutAction,
    /// Index of the arm in the set.
    pub arm: usize,
    /// The plugin produced no decision (the fail mode's decision stands in).
    pub plugin_failed: bool,
}

/// One row of `GET /plugins`.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct PluginInfo {
    pub name: String,
    pub sha256: String,
    /// `active`, `loaded`, `last-good` or `rejected`.
    pub state: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

struct CatalogEntry {
    plugin: Option<Arc<Plugin>>,
    sha256: String,
    rejected: Option<String>,
}

/// What the master face holds: the policies and how to call them.
pub struct Registry {
    engine: Arc<PolicyEngine>,
    cfg: PolicyConfig,
    metrics: Arc<Metrics>,
    catalog: Mutex<BTreeMap<String, CatalogEntry>>,
    active: ArcSwap<ActiveSet>,
    last_good: Mutex<Option<Arc<ActiveSet>>>,
    generation: AtomicU64,
    retire: Mutex<std::sync::mpsc::Sender<Arc<ActiveSet>>>,
    /// Serializes activations (swap + last-good bookkeeping); never taken by calls.
    swap_lock: Mutex<()>,
}

/// How long a replaced set is kept alive before the reaper drops it: calls that
/// started on it finish well within this.
const RETIRE_AFTER: Duration = Duration::from_secs(5);

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

impl Registry {
    /// Loads the embedded default and every configured plugin, and activates
    /// `policy.active` or `[experiment]`. A configured plugin that fails pre-flight is
    /// an error: better not to start than to run a policy nobody chose.
    pub fn new(
        cfg: PolicyConfig,
        experiment: Option<ExperimentSpec>,
        metrics: Arc<Metrics>,
    ) -> Result<Arc<Registry>, RegistryError> {
        let engine = PolicyEngine::new(
            HostLimits {
                call_timeout: Duration::from_millis(cfg.call_timeout_ms),
                memory_bytes: cfg.memory_limit_bytes as usize,
                max_instances: cfg.max_instances,
            },
            metrics.plugins.clone(),
        )?;
        let (tx, rx) = std::sync::mpsc::channel::<Arc<ActiveSet>>();
        std::thread::Builder::new()
            .name("moongate-reaper".into())
            .spawn(move || {
                // Dropping a generation (instances, compiled code) can take milliseconds.
                for set in rx {
                    std::thread::sleep(RETIRE_AFTER);
                    drop(set);
                }
            })
            .map_err(|e| RegistryError::Read {
                path: "reaper thread".into(),
                error: e,
            })?;
        let default_cfg = cfg
            .plugins
            .iter()
            .find(|p| p.name == "default")
            .map(|p| p.config.clone())
            .unwrap_or_default();
        let default = engine.load("default", DEFAULT_PLUGIN, default_cfg.as_bytes(), None)?;
        let reg = Arc::new(Registry {
            engine,
            metrics,
            catalog: Mutex::new(BTreeMap::new()),
            active: ArcSwap::from_pointee(ActiveSet {
                generation: 0,
                arms: Vec::new(),
                control: 0,
                assign: Assign::Client,
                experiment: None,
                activated: Instant::now(),
                probation: Mutex::new(Window::new()),
            }),
            last_good: Mutex::new(None),
            generation: AtomicU64::new(0),
            retire: Mutex::new(tx),
            swap_lock: Mutex::new(()),
            cfg,
        });
        reg.insert(default);
        for spec in reg.cfg.plugins.clone() {
            if let Some(path) = &spec.path {
                let bytes = std::fs::read(path).map_err(|error| RegistryError::Read {
                    path: path.clone(),
                    error,
                })?;
                reg.load(&spec.name, &bytes, spec.sha256.as_deref())?;
            }
        }
        match experiment {
            Some(exp) => reg.set_experiment(exp)?,
            None => reg.activate(&reg.cfg.active.clone())?,
        };
        *reg.last_good.lock().unwrap_or_else(|p| p.into_inner()) = None;
        Ok(reg)
    }

    fn insert(&self, p: Arc<Plugin>) {
        self.catalog
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                p.name.clone(),
                CatalogEntry {
                    sha256: p.sha256.clone(),
                    plugin: Some(p),
                    rejected: None,
                },
            );
    }

    /// Pre-flights `bytes` as plugin `name` and adds it to the catalog (replacing a
    /// loaded one of that name, which keeps serving until an activation). Blocking:
    /// compilation takes tens of milliseconds; call it off the async runtime.
    pub fn load(
        &self,
        name: &str,
        bytes: &[u8],
        sha256: Option<&str>,
    ) -> Result<PluginInfo, RegistryError> {
        if !valid_name(name) {
            return Err(RegistryError::BadName(name.to_string()));
        }
        let config = self
            .cfg
            .plugins
            .iter()
            .find(|p| p.name == name)
            .map(|p| p.config.clone())
            .unwrap_or_default();
        match self.engine.load(name, bytes, config.as_bytes(), sha256) {
            Ok(p) => {
                tracing::info!(plugin = name, sha256 = %p.sha256, interest = ?p.interest(), "plugin loaded");
                self.insert(p);
                Ok(self.info(name).expect("just inserted"))
            }
            Err(e) => {
                tracing::warn!(plugin = name, error = %e, "plugin rejected");
                let mut cat = self.catalog.lock().unwrap_or_else(|p| p.into_inner());
                // A rejected upload never replaces a working plugin of the same name.
                if cat.get(name).is_none_or(|e| e.plugin.is_none()) {
                    cat.insert(
                        name.to_string(),
                        CatalogEntry {
                            plugin: None,
                            sha256: hex_sha(bytes),
                            rejected: Some(e.to_string()),
                        },
                    );
                }
                Err(e.into())
            }
        }
    }

    fn plugin(&self, name: &str) -> Result<Arc<Plugin>, RegistryError> {
        self.catalog
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .and_then(|e| e.plugin.clone())
            .ok_or_else(|| RegistryError::UnknownPlugin(name.to_string()))
    }

    fn make_arm(&self, name: &str, plugin: Arc<Plugin>, weight: u64) -> Arm {
        Arm {
            metrics: self
                .metrics
                .policy
                .arm(&plugin.name, plugin.version(), name),
            name: name.to_string(),
            plugin,
            weight,
            stopped: AtomicBool::new(false),
            window: Mutex::new(Window::new()),
        }
    }

    fn swap_in(&self, mut set: ActiveSet) -> u64 {
        let _g = self.swap_lock.lock().unwrap_or_else(|p| p.into_inner());
        let generation = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
        set.generation = generation;
        let old = self.active.swap(Arc::new(set));
        if !old.arms.is_empty() {
            let prev = self
                .last_good
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .replace(old);
            if let Some(prev) = prev {
                let _ = self
                    .retire
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .send(prev);
            }
        }
        self.metrics.policy.swaps.inc();
        self.metrics.policy.active_generation.set(generation as i64);
        generation
    }

    /// Makes `name` the only policy (ends any experiment).
    pub fn activate(&self, name: &str) -> Result<u64, RegistryError> {
        let plugin = self.plugin(name)?;
        let arm = self.make_arm(name, plugin, 1);
        let g = self.swap_in(ActiveSet {
            generation: 0,
            arms: vec![arm],
            control: 0,
            assign: Assign::Client,
            experiment: None,
            activated: Instant::now(),
            probation: Mutex::new(Window::new()),
        });
        tracing::info!(plugin = name, generation = g, "policy activated");
        Ok(g)
    }

    /// Starts (or replaces) an experiment; an empty arm list ends it and keeps the
    /// control arm's plugin as the only policy.
    pub fn set_experiment(&self, spec: ExperimentSpec) -> Result<u64, RegistryError> {
        if spec.arms.is_empty() {
            let cur = self.current();
            let keep = cur.arms.get(cur.control).map(|a| a.plugin.name.clone());
            return self.activate(keep.as_deref().unwrap_or("default"));
        }
        let mut names = std::collections::HashSet::new();
        for a in &spec.arms {
            if !valid_name(&a.name) || !names.insert(a.name.clone()) {
                return Err(RegistryError::BadExperiment(format!(
                    "arm names must be unique and valid ({:?})",
                    a.name
                )));
            }
        }
        let total: u64 = spec.arms.iter().map(|a| u64::from(a.weight)).sum();
        if total == 0 {
            return Err(RegistryError::BadExperiment("weights sum to 0".into()));
        }
        let control = match &spec.control {
            Some(c) => spec.arms.iter().position(|a| &a.name == c).ok_or_else(|| {
                RegistryError::BadExperiment(format!("control arm {c:?} is not an arm"))
            })?,
            None => 0,
        };
        let g = &spec.guardrail;
        if !(0.0..=1.0).contains(&g.max_error_ratio)
            || g.window_ms == 0
            || g.max_mean_latency_ms < 0.0
        {
            return Err(RegistryError::BadExperiment(
                "guardrail: max_error_ratio in [0,1], window_ms > 0, max_mean_latency_ms >= 0"
                    .into(),
            ));
        }
        let arms = spec
            .arms
            .iter()
            .map(|a| Ok(self.make_arm(&a.name, self.plugin(&a.plugin)?, u64::from(a.weight))))
            .collect::<Result<Vec<_>, RegistryError>>()?;
        let generation = self.swap_in(ActiveSet {
            generation: 0,
            arms,
            control,
            assign: spec.assign,
            experiment: Some(spec),
            activated: Instant::now(),
            probation: Mutex::new(Window::new()),
        });
        tracing::info!(generation, "experiment started");
        Ok(generation)
    }

    /// Returns to the last-good set.
    pub fn rollback(&self, why: &str) -> Result<u64, RegistryError> {
        let _g = self.swap_lock.lock().unwrap_or_else(|p| p.into_inner());
        let prev = self
            .last_good
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or(RegistryError::NoLastGood)?;
        let old = self.active.swap(prev.clone());
        let _ = self
            .retire
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(old);
        self.metrics.policy.rollbacks.inc();
        self.metrics
            .policy
            .active_generation
            .set(prev.generation as i64);
        tracing::warn!(
            generation = prev.generation,
            reason = why,
            "policy rolled back to last-good"
        );
        Ok(prev.generation)
    }

    /// The set in force; hold it for the whole call.
    pub fn current(&self) -> Arc<ActiveSet> {
        self.active.load_full()
    }

    pub fn experiment(&self) -> Option<ExperimentSpec> {
        self.current().experiment.clone()
    }

    pub fn info(&self, name: &str) -> Option<PluginInfo> {
        self.list().into_iter().find(|p| p.name == name)
    }

    /// `GET /plugins`.
    pub fn list(&self) -> Vec<PluginInfo> {
        let cur = self.current();
        let last = self
            .last_good
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let in_set =
            |set: &ActiveSet, p: &Arc<Plugin>| set.arms.iter().any(|a| Arc::ptr_eq(&a.plugin, p));
        self.catalog
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(name, e)| {
                let state = match &e.plugin {
                    None => "rejected",
                    Some(p) if in_set(&cur, p) => "active",
                    Some(p) if last.as_ref().is_some_and(|l| in_set(l, p)) => "last-good",
                    Some(_) => "loaded",
                };
                PluginInfo {
                    name: name.clone(),
                    sha256: e.sha256.clone(),
                    state: state.into(),
                    reason: e.rejected.clone(),
                }
            })
            .collect()
    }

    /// Asks the active policy about a put-family request. Returns the action, the arm
    /// that decided it and whether the plugin failed (`None` for other methods).
    pub fn decide_put(&self, set: &Arc<ActiveSet>, req: &Request) -> Option<PutDecided> {
        let view = put_view(req)?;
        let arm_i = set.pick(&view.client, view.keys.first());
        let arm = &set.arms[arm_i];
        if !arm.plugin.interest().contains(Interest::PUT) {
            arm.metrics.decisions[0].inc();
            return Some(PutDecided {
                action: PutAction::Forward,
                arm: arm_i,
                plugin_failed: false,
            });
        }
        let started = Instant::now();
        let call = view.to_wit();
        let result = arm.plugin.on_put(&call);
        arm.metrics
            .put_latency
            .observe(started.elapsed().as_secs_f64());
        let plugin_failed = result.is_err();
        let decision = match result {
            Ok(d) => {
                arm.metrics.put_calls[0].inc();
                self.note_plugin_call(set, arm, false);
                d
            }
            Err(e) => {
                let i = CALL_RESULTS
                    .iter()
                    .position(|r| *r == e.kind())
                    .unwrap_or(1);
                arm.metrics.put_calls[i].inc();
                tracing::warn!(plugin = %arm.plugin.name, version = arm.plugin.version(),
                    arm = %arm.name, error = %e, fail_mode = ?self.cfg.fail_mode, "policy call failed");
                self.note_plugin_call(set, arm, true);
                failed_decision(
                    self.cfg.fail_mode,
                    view.keys.len(),
                    self.cfg.fail_closed_code,
                )
            }
        };
        let action = put_action(req, &decision);
        arm.metrics.decisions[decision_index(&action)].inc();
        Some(PutDecided {
            action,
            arm: arm_i,
            plugin_failed,
        })
    }

    /// Whether the arm's plugin steers lookups.
    pub fn steers_lookups(&self, arm: &Arm) -> bool {
        arm.plugin.interest().contains(Interest::LOOKUP)
    }

    /// Lets the arm's plugin reorder or drop the replicas of a lookup answer for `keys`.
    /// A failed call applies the fail mode (open: unchanged; closed: every key not
    /// found). Returns whether the answer changed.
    pub fn steer_lookup(
        &self,
        arm: &Arm,
        keys: &[Bytes],
        resp: &mut crate::codec::message::Response,
    ) -> bool {
        let Some(call) = super::lookup_call(keys, resp) else {
            return false;
        };
        let started = Instant::now();
        let result = arm.plugin.on_lookup(&call);
        arm.metrics
            .lookup_latency
            .observe(started.elapsed().as_secs_f64());
        let keep = match result {
            Ok(k) => {
                arm.metrics.lookup_calls[0].inc();
                k
            }
            Err(e) => {
                let i = CALL_RESULTS
                    .iter()
                    .position(|r| *r == e.kind())
                    .unwrap_or(1);
                arm.metrics.lookup_calls[i].inc();
                tracing::warn!(plugin = %arm.plugin.name, arm = %arm.name, error = %e,
                    fail_mode = ?self.cfg.fail_mode, "lookup steering failed");
                match self.cfg.fail_mode {
                    super::FailMode::Open => return false,
                    super::FailMode::Closed => vec![Vec::new(); call.counts.len()],
                }
            }
        };
        super::apply_lookup(resp, &keep)
    }

    /// Whether the arm's plugin chooses batch split points (`split`).
    pub fn splits_batches(&self, arm: &Arm) -> bool {
        arm.plugin.interest().contains(Interest::BATCH_SPLIT)
    }

    /// Asks the arm's plugin where to cut a batch whose keys weigh `sizes` bytes (0 where
    /// the request does not say), given the bytes of split put batches now in flight on
    /// this node and the configured limit. A failed call (either fail mode) splits
    /// nothing: splitting only changes how the batch travels, never its answer.
    pub fn split_points(
        &self,
        arm: &Arm,
        sizes: Vec<u64>,
        in_flight: u64,
        limit: u64,
    ) -> Vec<usize> {
        let call = super::host::wit::SplitCall {
            sizes,
            budget: super::host::wit::BudgetState {
                in_flight_bytes: in_flight,
                limit_bytes: limit,
            },
        };
        let started = Instant::now();
        let result = arm.plugin.split(&call);
        arm.metrics
            .split_latency
            .observe(started.elapsed().as_secs_f64());
        match result {
            Ok(points) => {
                arm.metrics.split_calls[0].inc();
                points
                    .into_iter()
                    .filter(|&p| p > 0)
                    .map(|p| p as usize)
                    .collect()
            }
            Err(e) => {
                let i = CALL_RESULTS
                    .iter()
                    .position(|r| *r == e.kind())
                    .unwrap_or(1);
                arm.metrics.split_calls[i].inc();
                tracing::warn!(plugin = %arm.plugin.name, arm = %arm.name, error = %e,
                    "batch split call failed; batch left whole");
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
        call: &super::host::wit::EvictCall,
    ) -> Option<Vec<usize>> {
        if !arm.plugin.interest().contains(Interest::EVICT) {
            return None;
        }
        let started = Instant::now();
        let result = arm.plugin.evict(call);
        arm.metrics
            .evict_latency
            .observe(started.elapsed().as_secs_f64());
        match result {
            Ok(v) => {
                arm.metrics.evict_calls[0].inc();
                Some(v.into_iter().map(|i| i as usize).collect())
            }
            Err(e) => {
                let i = CALL_RESULTS
                    .iter()
                    .position(|r| *r == e.kind())
                    .unwrap_or(1);
                arm.metrics.evict_calls[i].inc();
                tracing::warn!(plugin = %arm.plugin.name, arm = %arm.name, error = %e,
                    "evict call failed; least recently used victims instead");
                None
            }
        }
    }

    /// Tells an arm's plugin how a call it decided went, if it asked (`observe`).
    pub fn observe(&self, arm: &Arm, method: &str, outcome: i32, latency: Duration, keys: usize) {
        if !arm.plugin.interest().contains(Interest::OBSERVE) {
            return;
        }
        let event = super::host::wit::Observation {
            method: method.to_string(),
            outcome,
            latency_us: latency.as_micros() as u64,
            keys: keys as u32,
        };
        if let Err(e) = arm.plugin.observe(&event) {
            tracing::debug!(plugin = %arm.plugin.name, error = %e, "observe hook failed");
        }
    }

    /// Automatic rollback: a set activated less than `rollback.window_ms` ago whose
    /// plugin failures exceed the budget goes back to last-good.
    fn note_plugin_call(&self, set: &Arc<ActiveSet>, arm: &Arm, failed: bool) {
        let rb = &self.cfg.rollback;
        // Experiments have guardrails instead (fed one outcome per call by the face).
        if set.experiment.is_some() {
            return;
        }
        if set.activated.elapsed() > Duration::from_millis(rb.window_ms) {
            return;
        }
        let breach = {
            let mut w = set.probation.lock().unwrap_or_else(|p| p.into_inner());
            w.calls += 1;
            w.failures += u64::from(failed);
            w.calls >= rb.min_calls && (w.failures as f64 / w.calls as f64) > rb.max_failure_ratio
        };
        if breach && Arc::ptr_eq(set, &self.active.load()) {
            let why = format!(
                "plugin {} failed more than {:.0}% of calls within {} ms of activation",
                arm.plugin.name,
                rb.max_failure_ratio * 100.0,
                rb.window_ms
            );
            let _ = self.rollback(&why);
        }
    }

    /// Guardrail bookkeeping for an experiment arm: `failed` for a plugin failure or a
    /// client-visible error, `latency` of the master call when known.
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
            if w.start.elapsed() > Duration::from_millis(g.window_ms) {
                *w = Window::new();
            }
            w.calls += 1;
            w.failures += u64::from(failed);
            if let Some(l) = latency {
                w.latency_us += l.as_micros() as u64;
            }
            if w.calls < g.min_calls {
                None
            } else if w.failures as f64 / w.calls as f64 > g.max_error_ratio {
                Some(format!(
                    "error ratio {:.2} > {}",
                    w.failures as f64 / w.calls as f64,
                    g.max_error_ratio
                ))
            } else if g.max_mean_latency_ms > 0.0
                && (w.latency_us as f64 / w.calls as f64) / 1000.0 > g.max_mean_latency_ms
            {
                Some(format!("mean latency over {} ms", g.max_mean_latency_ms))
            } else {
                None
            }
        };
        if let Some(why) = breach
            && !arm.stopped.swap(true, Ordering::Relaxed)
        {
            self.metrics.policy.guardrail_stops.inc();
            tracing::warn!(arm = %arm.name, plugin = %arm.plugin.name, reason = %why,
                control = %set.arms[set.control].name, "guardrail stopped an experiment arm");
        }
    }

    /// Loads every `*.wasm` in `dir` whose bytes changed since the last look; a plugin
    /// that is the sole active policy is re-activated with its new version.
    pub fn scan_dir(&self, dir: &std::path::Path) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let path = e.path();
            if path.extension().is_none_or(|x| x != "wasm") {
                continue;
            }
            let Some(name) = path.file_stem().map(|s| s.to_string_lossy().into_owned()) else {
                continue;
            };
            let Ok(bytes) = std::fs::read(&path) else {
                continue;
            };
            let sha = hex_sha(&bytes);
            let known = self
                .catalog
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&name)
                .map(|e| e.sha256.clone());
            if known.as_deref() == Some(sha.as_str()) {
                continue;
            }
            let pin = self
                .cfg
                .plugins
                .iter()
                .find(|p| p.name == name)
                .and_then(|p| p.sha256.clone());
            if self.load(&name, &bytes, pin.as_deref()).is_ok() {
                let cur = self.current();
                if cur.experiment.is_none()
                    && cur.arms.first().is_some_and(|a| a.plugin.name == name)
                {
                    let _ = self.activate(&name);
                }
            }
        }
    }

    pub fn config(&self) -> &PolicyConfig {
        &self.cfg
    }
}

fn hex_sha(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

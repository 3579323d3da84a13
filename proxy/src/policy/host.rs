//! The WebAssembly policy host: compiles plugin components once, keeps one instance per
//! plugin generation, and calls hooks under a deadline and a memory cap.
//!
//! Knows no frames and no sockets: it takes the host-side views in [`super`] and returns
//! decisions. A trap, a timeout, running out of memory or an answer that breaks the
//! contract is a plugin failure: the instance is discarded (a trapped store is poisoned),
//! the caller gets [`CallError`], and the next call instantiates afresh.
//!
//! Capabilities: none. The plugins are built for wasm32-wasip2, so their components
//! import WASI interfaces that Rust's standard library references; the linker defines
//! every such import as a trap. A plugin can reach only the `host` interface of the WIT
//! package (log, metrics registered during configure, monotonic time).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use sha2::{Digest, Sha256};
use thiserror::Error;
use wasmtime::component::{Component, ComponentExportIndex, HasSelf, Instance, Linker, TypedFunc};
use wasmtime::{
    Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, ResourceLimiter, Store,
    Trap,
};

use super::epoch::EpochClock;
use super::metrics::PluginMetricsSink;

wasmtime::component::bindgen!({
    path: "../wit",
    world: "policy",
});

pub use moongate::policy::types as wit;

/// The least time instantiation, `configure` and the load-time conformance calls get.
/// They run once per load, off the request path, and a busy machine can delay a few
/// milliseconds of work past a tight call deadline (seen: a load refused with "wasm trap:
/// interrupt" on a loaded 2-core CI run). A plugin that loops is still refused, after
/// this long.
const SETUP_DEADLINE: Duration = Duration::from_secs(2);

/// What a plugin's `now-ns` reads.
#[derive(Debug, Clone, Default)]
pub enum Clock {
    /// Monotonic time since the instance started: live traffic.
    #[default]
    Real,
    /// Nanoseconds the caller sets: the simulator runs plugins on trace time, so a
    /// plugin's windows and ages mean the same offline as live.
    Virtual(Arc<std::sync::atomic::AtomicU64>),
}

/// Engine-wide limits.
#[derive(Debug, Clone)]
pub struct HostLimits {
    /// Longest a single hook call may run.
    pub call_timeout: Duration,
    /// Linear memory one plugin instance may grow to.
    pub memory_bytes: usize,
    /// Plugin instances alive at once (pooling allocator slots).
    pub max_instances: u32,
}

#[derive(Debug, Error)]
pub enum LoadError {
    #[error("not a valid policy component: {0}")]
    Compile(String),
    #[error("component does not fit the moongate:policy@0.1 world: {0}")]
    Link(String),
    #[error("instantiation failed: {0}")]
    Instantiate(String),
    #[error("configure refused the config: {0}")]
    Refused(String),
    #[error("configure failed: {0}")]
    Configure(CallError),
    #[error("sha256 is {actual}, the pin says {expected}")]
    ShaMismatch { expected: String, actual: String },
    #[error("conformance call {call} failed: {error}")]
    Conformance {
        call: &'static str,
        error: CallError,
    },
}

/// Why a hook call produced no decision.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum CallError {
    #[error("trapped: {0}")]
    Trap(String),
    #[error("ran past its {0:?} deadline")]
    Timeout(Duration),
    #[error("ran out of memory")]
    OutOfMemory,
    #[error("answer breaks the contract: {0}")]
    Invalid(String),
    #[error("could not be instantiated: {0}")]
    Unavailable(String),
}

impl CallError {
    /// Metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            CallError::Trap(_) => "trap",
            CallError::Timeout(_) => "timeout",
            CallError::OutOfMemory => "oom",
            CallError::Invalid(_) => "invalid",
            CallError::Unavailable(_) => "unavailable",
        }
    }
}

/// Per-store state: the memory cap and the plugin's registered metrics.
pub struct HostState {
    memory_cap: usize,
    /// A memory or table grow was refused: the trap that follows is reported as
    /// out-of-memory, not as a plugin bug.
    refused_grow: bool,
    plugin: String,
    sink: Arc<PluginMetricsSink>,
    configuring: bool,
    /// The pre-flight instance: metric updates are dropped so conformance calls do not
    /// show up as traffic.
    muted: bool,
    counters: Vec<Counter>,
    gauges: Vec<Gauge>,
    started: Instant,
    clock: Clock,
}

impl ResourceLimiter for HostState {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let ok = desired <= self.memory_cap;
        self.refused_grow |= !ok;
        Ok(ok)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let ok = desired <= 100_000;
        self.refused_grow |= !ok;
        Ok(ok)
    }
}

impl moongate::policy::types::Host for HostState {}

impl moongate::policy::host::Host for HostState {
    fn log(&mut self, level: moongate::policy::host::Level, message: String) {
        use moongate::policy::host::Level;
        let plugin = self.plugin.as_str();
        // Bounded: a plugin cannot flood the log with megabyte lines.
        let msg = message
            .get(..message.floor_char_boundary(1024))
            .unwrap_or("");
        match level {
            Level::Error => tracing::error!(plugin, "{msg}"),
            Level::Warn => tracing::warn!(plugin, "{msg}"),
            Level::Info => tracing::info!(plugin, "{msg}"),
            Level::Debug => tracing::debug!(plugin, "{msg}"),
        }
    }

    fn register_counter(&mut self, name: String, help: String) -> Result<u32, String> {
        if !self.configuring {
            return Err("metrics can only be registered during configure".into());
        }
        let c = self.sink.counter(&self.plugin, &name, &help)?;
        self.counters.push(c);
        Ok(self.counters.len() as u32 - 1)
    }

    fn register_gauge(&mut self, name: String, help: String) -> Result<u32, String> {
        if !self.configuring {
            return Err("metrics can only be registered during configure".into());
        }
        let g = self.sink.gauge(&self.plugin, &name, &help)?;
        self.gauges.push(g);
        Ok(self.gauges.len() as u32 - 1)
    }

    fn counter_add(&mut self, handle: u32, value: u64) {
        if self.muted {
            return;
        }
        if let Some(c) = self.counters.get(handle as usize) {
            c.inc_by(value);
        }
    }

    fn gauge_set(&mut self, handle: u32, value: i64) {
        if self.muted {
            return;
        }
        if let Some(g) = self.gauges.get(handle as usize) {
            g.set(value);
        }
    }

    fn now_ns(&mut self) -> u64 {
        match &self.clock {
            Clock::Real => self.started.elapsed().as_nanos() as u64,
            Clock::Virtual(ns) => ns.load(Ordering::Relaxed),
        }
    }
}

/// The engine and what every plugin shares. Create one per process.
pub struct PolicyEngine {
    engine: Engine,
    limits: HostLimits,
    sink: Arc<PluginMetricsSink>,
    /// Stops calls past their deadline (dropped with the engine: its thread ends).
    epoch: EpochClock,
    clock: Clock,
}

impl PolicyEngine {
    pub fn new(limits: HostLimits, sink: Arc<PluginMetricsSink>) -> Result<Arc<Self>, LoadError> {
        PolicyEngine::with_clock(limits, sink, Clock::Real)
    }

    /// As [`PolicyEngine::new`], with the clock plugins read.
    pub fn with_clock(
        limits: HostLimits,
        sink: Arc<PluginMetricsSink>,
        clock: Clock,
    ) -> Result<Arc<Self>, LoadError> {
        let mut cfg = Config::new();
        cfg.wasm_component_model(true);
        cfg.epoch_interruption(true);
        let mut pool = PoolingAllocationConfig::default();
        pool.total_component_instances(limits.max_instances);
        // wasip2 components carry a few core instances (module, adapter, shims).
        pool.total_core_instances(limits.max_instances * 8);
        pool.total_memories(limits.max_instances * 2);
        pool.total_tables(limits.max_instances * 8);
        pool.max_memory_size(limits.memory_bytes);
        cfg.allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
        let engine = Engine::new(&cfg).map_err(|e| LoadError::Compile(e.to_string()))?;
        let epoch = EpochClock::start(engine.clone(), limits.call_timeout)
            .map_err(|e| LoadError::Compile(format!("epoch thread: {e}")))?;
        Ok(Arc::new(PolicyEngine {
            engine,
            limits,
            sink,
            epoch,
            clock,
        }))
    }

    /// Compiles and links `bytes`, instantiates it, runs `configure` and the conformance
    /// calls. Only a plugin that passes all of them is returned.
    pub fn load(
        self: &Arc<Self>,
        name: &str,
        bytes: &[u8],
        config: &[u8],
        sha256_pin: Option<&str>,
    ) -> Result<Arc<Plugin>, LoadError> {
        let sha = hex(&Sha256::digest(bytes));
        if let Some(pin) = sha256_pin
            && !pin.eq_ignore_ascii_case(&sha)
        {
            return Err(LoadError::ShaMismatch {
                expected: pin.to_string(),
                actual: sha,
            });
        }
        let component = Component::new(&self.engine, bytes)
            .map_err(|e| LoadError::Compile(format!("{e:#}")))?;
        let mut linker: Linker<HostState> = Linker::new(&self.engine);
        Policy::add_to_linker::<_, HasSelf<_>>(&mut linker, |s| s)
            .map_err(|e| LoadError::Link(format!("{e:#}")))?;
        for older in ["0.1.0", "0.1.1", "0.1.2", "0.1.3"] {
            add_host_as(&mut linker, older).map_err(|e| LoadError::Link(format!("{e:#}")))?;
        }
        linker
            .define_unknown_imports_as_traps(&component)
            .map_err(|e| LoadError::Link(format!("{e:#}")))?;
        let pre = linker
            .instantiate_pre(&component)
            .map_err(|e| LoadError::Link(format!("{e:#}")))?;
        let pre = PolicyPre::new(pre).map_err(|e| LoadError::Link(format!("{e:#}")))?;
        // Optional since 0.1.1, 0.1.2, 0.1.3 and 0.1.4: looked up by name so that older
        // components still load.
        let block_keys = component.get_export_index(None, "block-keys");
        let evict_tiered = component.get_export_index(None, "evict-tiered");
        let block_refs = component.get_export_index(None, "block-refs");
        let evict_hinted = component.get_export_index(None, "evict-hinted");
        let plugin = Arc::new(Plugin {
            block_keys,
            evict_hinted,
            block_refs,
            evict_tiered,
            name: name.to_string(),
            sha256: sha,
            config: config.to_vec(),
            engine: self.clone(),
            pre,
            interest: Mutex::new(Interest::empty()),
            slot: Mutex::new(None),
            preflight: AtomicBool::new(false),
        });
        let interest = plugin.instantiate_now(true)?;
        *plugin.interest.lock().unwrap_or_else(|p| p.into_inner()) = interest;
        plugin.preflight.store(true, Ordering::Relaxed);
        let conformance = plugin.conformance();
        plugin.preflight.store(false, Ordering::Relaxed);
        conformance?;
        // Conformance calls must not leave state behind (a budget spent, a table
        // filled): traffic starts on a fresh instance.
        *plugin.slot.lock().unwrap_or_else(|p| p.into_inner()) = None;
        Ok(plugin)
    }
}

/// The `host` interface once more under an older version's name, for components built
/// before the contract grew (the interface itself did not change). wasmtime would match
/// 0.1.0 to 0.1.4 by semver, but the trap stubs for unknown (WASI) imports are defined
/// by exact name first and would shadow that match.
fn add_host_as(linker: &mut Linker<HostState>, version: &str) -> wasmtime::Result<()> {
    use moongate::policy::host::{Host, Level};
    let mut i = linker.instance(&format!("moongate:policy/host@{version}"))?;
    i.func_wrap("log", |mut s, (level, message): (Level, String)| {
        Host::log(s.data_mut(), level, message);
        Ok(())
    })?;
    i.func_wrap("register-counter", |mut s, (n, h): (String, String)| {
        Ok((Host::register_counter(s.data_mut(), n, h),))
    })?;
    i.func_wrap("register-gauge", |mut s, (n, h): (String, String)| {
        Ok((Host::register_gauge(s.data_mut(), n, h),))
    })?;
    i.func_wrap("counter-add", |mut s, (h, v): (u32, u64)| {
        Host::counter_add(s.data_mut(), h, v);
        Ok(())
    })?;
    i.func_wrap("gauge-set", |mut s, (h, v): (u32, i64)| {
        Host::gauge_set(s.data_mut(), h, v);
        Ok(())
    })?;
    i.func_wrap("now-ns", |mut s, (): ()| Ok((Host::now_ns(s.data_mut()),)))?;
    Ok(())
}

/// The widest block digest a plugin may name: sha512's 64 bytes. A longer one is a
/// plugin bug, and a router would have to store it per block. Hints name blocks by the
/// same digests, so the hint parser takes the same bound.
pub const MAX_DIGEST: usize = 64;

fn digest_len(h: &wit::BlockHash) -> usize {
    match h {
        wit::BlockHash::Int(_) => 8,
        wit::BlockHash::Digest(d) => d.len(),
    }
}

fn hash_ok(h: &wit::BlockHash) -> bool {
    (1..=MAX_DIGEST).contains(&digest_len(h))
}

/// A per-key answer with exactly one entry per key, or why not.
fn one_per_key<T>(d: Vec<T>, keys: &wit::PackedKeys) -> Result<Option<Vec<T>>, CallError> {
    if d.len() != keys.ends.len() {
        return Err(CallError::Invalid(format!(
            "{} blocks for {} keys",
            d.len(),
            keys.ends.len()
        )));
    }
    Ok(Some(d))
}

/// Victims a component chose among `n` candidates, each index checked (a tier
/// choice's or a hint-aware one's alike).
fn victims_of(d: Vec<wit::Victim>, n: usize) -> Result<Vec<wit::Victim>, CallError> {
    match d.iter().find(|v| v.index as usize >= n) {
        Some(v) => Err(CallError::Invalid(format!(
            "victim index {} out of range ({n} candidates)",
            v.index
        ))),
        None => Ok(d),
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// An export of one argument and one result.
type OneArgFn<A, R> = TypedFunc<(A,), (R,)>;
/// The `block-keys` export's signature.
type BlockKeysFn = TypedFunc<(wit::PackedKeys,), (Vec<Option<wit::BlockRef>>,)>;
/// The `block-refs` export's signature.
type BlockRefsFn = TypedFunc<(wit::PackedKeys,), (Vec<Option<wit::Block>>,)>;
/// The `evict-tiered` export's signature.
type EvictTieredFn = TypedFunc<(wit::TieredEvictCall,), (Vec<wit::Victim>,)>;
/// The `evict-hinted` export's signature.
type EvictHintedFn = TypedFunc<(wit::HintedEvictCall,), (Vec<wit::Victim>,)>;

struct Live {
    store: Store<HostState>,
    bindings: Policy,
    instance: Instance,
    /// Looked up on the first `block-keys` call of this instance.
    block_keys: Option<BlockKeysFn>,
    /// Looked up on the first `block-refs` call of this instance.
    block_refs: Option<BlockRefsFn>,
    /// Looked up on the first `evict-tiered` call of this instance.
    evict_tiered: Option<EvictTieredFn>,
    /// Looked up on the first `evict-hinted` call of this instance.
    evict_hinted: Option<EvictHintedFn>,
}

/// One loaded plugin generation: its compiled form and its single live instance.
///
/// One instance per generation, behind a mutex, so a stateful plugin (a budget, a
/// table) sees every call; hook calls take microseconds, so they do not contend.
pub struct Plugin {
    pub name: String,
    pub sha256: String,
    config: Vec<u8>,
    engine: Arc<PolicyEngine>,
    pre: PolicyPre<HostState>,
    /// The optional `block-keys` export (WIT 0.1.1), when the component has it.
    block_keys: Option<ComponentExportIndex>,
    /// The optional `block-refs` export (WIT 0.1.3), when the component has it.
    block_refs: Option<ComponentExportIndex>,
    /// The optional `evict-tiered` export (WIT 0.1.2), when the component has it.
    evict_tiered: Option<ComponentExportIndex>,
    /// The optional `evict-hinted` export (WIT 0.1.4), when the component has it.
    evict_hinted: Option<ComponentExportIndex>,
    interest: Mutex<Interest>,
    slot: Mutex<Option<Live>>,
    /// The load-time conformance calls run: they get the setup deadline.
    preflight: AtomicBool,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("name", &self.name)
            .field("sha256", &self.sha256)
            .finish()
    }
}

impl Plugin {
    pub fn interest(&self) -> Interest {
        *self.interest.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Short version label for metrics: the first 12 hex digits of the sha256.
    pub fn version(&self) -> &str {
        &self.sha256[..12]
    }

    /// Drops the live instance and its state: the next call starts a fresh one
    /// (configured again). The simulator starts every run this way.
    pub fn reset(&self) {
        *self.slot.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// The same compiled generation (checked and configured alike) with an instance of
    /// its own: the simulator's fleet runs one per modelled sidecar, as live members
    /// each run their own. Its first call starts a fresh instance.
    pub fn sibling(&self) -> Arc<Plugin> {
        Arc::new(Plugin {
            name: self.name.clone(),
            sha256: self.sha256.clone(),
            config: self.config.clone(),
            engine: self.engine.clone(),
            pre: self.pre.clone(),
            block_keys: self.block_keys,
            block_refs: self.block_refs,
            evict_tiered: self.evict_tiered,
            evict_hinted: self.evict_hinted,
            interest: Mutex::new(self.interest()),
            slot: Mutex::new(None),
            preflight: AtomicBool::new(false),
        })
    }

    fn new_store(&self, muted: bool) -> Store<HostState> {
        let state = HostState {
            muted,
            memory_cap: self.engine.limits.memory_bytes,
            refused_grow: false,
            plugin: self.name.clone(),
            sink: self.engine.sink.clone(),
            configuring: false,
            counters: Vec::new(),
            gauges: Vec::new(),
            started: Instant::now(),
            clock: self.engine.clock.clone(),
        };
        let mut store = Store::new(&self.engine.engine, state);
        store.limiter(|s| s as &mut dyn ResourceLimiter);
        store
    }

    /// Instantiates and configures a fresh instance into the slot (`muted`: its metric
    /// updates are dropped, for the pre-flight instance).
    fn instantiate_now(&self, muted: bool) -> Result<Interest, LoadError> {
        let mut store = self.new_store(muted);
        let _running = self.engine.epoch.enter();
        store.set_epoch_deadline(self.setup_ticks());
        let instance = self
            .pre
            .instance_pre()
            .instantiate(&mut store)
            .map_err(|e| LoadError::Instantiate(format!("{e:#}")))?;
        let bindings = Policy::new(&mut store, &instance)
            .map_err(|e| LoadError::Instantiate(format!("{e:#}")))?;
        store.data_mut().configuring = true;
        let r = bindings.call_configure(&mut store, &self.config);
        store.data_mut().configuring = false;
        let interest = match r {
            Ok(Ok(i)) => i,
            Ok(Err(msg)) => return Err(LoadError::Refused(msg)),
            Err(e) => return Err(LoadError::Configure(classify(&e, &store, self))),
        };
        *self.slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(Live {
            store,
            bindings,
            instance,
            block_keys: None,
            block_refs: None,
            evict_tiered: None,
            evict_hinted: None,
        });
        Ok(interest)
    }

    fn deadline_ticks(&self) -> u64 {
        if self.preflight.load(Ordering::Relaxed) {
            return self.setup_ticks();
        }
        self.engine.epoch.ticks_for(self.engine.limits.call_timeout)
    }

    fn setup_ticks(&self) -> u64 {
        self.engine
            .epoch
            .ticks_for(self.engine.limits.call_timeout.max(SETUP_DEADLINE))
    }

    /// Runs `f` on the live instance under a fresh deadline. On any failure the instance
    /// is dropped; the next call re-instantiates it.
    fn with_instance<R>(
        &self,
        f: impl FnOnce(&Policy, &mut Store<HostState>) -> wasmtime::Result<R>,
    ) -> Result<R, CallError> {
        self.with_live(|live| f(&live.bindings, &mut live.store))
    }

    /// As [`Plugin::with_instance`], with the whole live instance.
    fn with_live<R>(
        &self,
        f: impl FnOnce(&mut Live) -> wasmtime::Result<R>,
    ) -> Result<R, CallError> {
        let mut slot = self.slot.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            drop(slot);
            self.instantiate_now(false)
                .map_err(|e| CallError::Unavailable(e.to_string()))?;
            slot = self.slot.lock().unwrap_or_else(|p| p.into_inner());
        }
        let live = slot
            .as_mut()
            .ok_or_else(|| CallError::Unavailable("no instance".into()))?;
        let _running = self.engine.epoch.enter();
        live.store.set_epoch_deadline(self.deadline_ticks());
        match f(live) {
            Ok(r) => Ok(r),
            Err(e) => {
                let err = classify(&e, &live.store, self);
                *slot = None;
                Err(err)
            }
        }
    }

    pub fn on_put(&self, call: &wit::PutCall) -> Result<wit::PutDecision, CallError> {
        let keys = call.keys.ends.len();
        let d = self.with_instance(|b, s| b.call_on_put(s, call))?;
        if !d.admissions.is_empty() && d.admissions.len() != keys {
            return Err(CallError::Invalid(format!(
                "{} admissions for {keys} keys",
                d.admissions.len()
            )));
        }
        Ok(d)
    }

    pub fn on_lookup(&self, call: &wit::LookupCall) -> Result<Vec<Vec<u32>>, CallError> {
        let d = self.with_instance(|b, s| b.call_on_lookup(s, call))?;
        if !d.is_empty() && d.len() != call.counts.len() {
            return Err(CallError::Invalid(format!(
                "{} replica lists for {} keys",
                d.len(),
                call.counts.len()
            )));
        }
        for (k, keep) in d.iter().enumerate() {
            if keep.iter().any(|&i| i >= call.counts[k]) {
                return Err(CallError::Invalid(format!(
                    "replica index out of range for key {k}"
                )));
            }
        }
        Ok(d)
    }

    pub fn split(&self, call: &wit::SplitCall) -> Result<Vec<u32>, CallError> {
        let d = self.with_instance(|b, s| b.call_split(s, call))?;
        if d.windows(2).any(|w| w[0] >= w[1]) || d.iter().any(|&i| i as usize >= call.sizes.len()) {
            return Err(CallError::Invalid(
                "split points must rise and stay in range".into(),
            ));
        }
        Ok(d)
    }

    pub fn evict(&self, call: &wit::EvictCall) -> Result<Vec<u32>, CallError> {
        let d = self.with_instance(|b, s| b.call_evict(s, call))?;
        if d.iter().any(|&i| i as usize >= call.sizes.len()) {
            return Err(CallError::Invalid("victim index out of range".into()));
        }
        Ok(d)
    }

    pub fn observe(&self, event: &wit::Observation) -> Result<(), CallError> {
        self.with_instance(|b, s| b.call_observe(s, event))
    }

    /// Calls an optional export (found by name at load, its typed function kept on the
    /// live instance from the first call); `None` when the component has no such export.
    /// Arguments go by value: they are copied once per call, and these calls are off the
    /// request path (the events publisher, eviction rounds).
    fn call_optional<A, R>(
        &self,
        index: Option<ComponentExportIndex>,
        cached: fn(&mut Live) -> &mut Option<OneArgFn<A, R>>,
        arg: A,
    ) -> Result<Option<R>, CallError>
    where
        (A,): wasmtime::component::ComponentNamedList + wasmtime::component::Lower + Send + Sync,
        (R,): wasmtime::component::ComponentNamedList + wasmtime::component::Lift + Send + Sync,
    {
        let Some(index) = index else {
            return Ok(None);
        };
        self.with_live(|live| {
            let f = match *cached(live) {
                Some(f) => f,
                None => {
                    let f = live.instance.get_typed_func(&mut live.store, index)?;
                    *cached(live) = Some(f);
                    f
                }
            };
            let (out,) = f.call(&mut live.store, (arg,))?;
            Ok(Some(out))
        })
    }

    /// The block of each key (`block-keys`), or `None` when the component has no such
    /// export (built for WIT 0.1.0).
    pub fn block_keys(
        &self,
        keys: &wit::PackedKeys,
    ) -> Result<Option<Vec<Option<wit::BlockRef>>>, CallError> {
        let Some(d) = self.call_optional(self.block_keys, |l| &mut l.block_keys, keys.clone())?
        else {
            return Ok(None);
        };
        one_per_key(d, keys)
    }

    /// The block of each key: by `block-refs` (WIT 0.1.3) when the component has it, else
    /// by `block-keys` (64-bit hashes, no group), else `None` (built for WIT 0.1.0).
    pub fn blocks(
        &self,
        keys: &wit::PackedKeys,
    ) -> Result<Option<Vec<Option<wit::Block>>>, CallError> {
        if self.block_refs.is_some() {
            let Some(d) =
                self.call_optional(self.block_refs, |l| &mut l.block_refs, keys.clone())?
            else {
                return Ok(None);
            };
            let bad = d
                .iter()
                .flatten()
                .flat_map(|b| std::iter::once(&b.hash).chain(b.parent.as_ref()))
                .find(|h| !hash_ok(h));
            if let Some(h) = bad {
                return Err(CallError::Invalid(format!(
                    "a block hash of {} bytes (1 to {MAX_DIGEST} allowed)",
                    digest_len(h)
                )));
            }
            return one_per_key(d, keys);
        }
        let Some(narrow) = self.block_keys(keys)? else {
            return Ok(None);
        };
        Ok(Some(
            narrow
                .into_iter()
                .map(|b| {
                    b.map(|b| wit::Block {
                        hash: wit::BlockHash::Int(b.hash),
                        parent: b.parent.map(wit::BlockHash::Int),
                        group: None,
                    })
                })
                .collect(),
        ))
    }

    /// Victims chosen per tier (`evict-tiered`), or `None` when the component has no such
    /// export (built for WIT 0.1.0 or 0.1.1).
    pub fn evict_tiered(
        &self,
        call: &wit::TieredEvictCall,
    ) -> Result<Option<Vec<wit::Victim>>, CallError> {
        self.call_optional(self.evict_tiered, |l| &mut l.evict_tiered, call.clone())?
            .map(|d| victims_of(d, call.call.sizes.len()))
            .transpose()
    }

    /// Victims chosen knowing the candidates' hints (`evict-hinted`), or `None` when the
    /// component has no such export (built for WIT 0.1.0 to 0.1.3).
    pub fn evict_hinted(
        &self,
        call: &wit::HintedEvictCall,
    ) -> Result<Option<Vec<wit::Victim>>, CallError> {
        self.call_optional(self.evict_hinted, |l| &mut l.evict_hinted, call.clone())?
            .map(|d| victims_of(d, call.call.sizes.len()))
            .transpose()
    }

    /// Whether the component has `evict-hinted` (WIT 0.1.4): the evictor looks hints up
    /// for its candidates only then.
    pub fn reads_hints(&self) -> bool {
        self.evict_hinted.is_some()
    }

    /// Conformance: one call of each hook the plugin asked for, on small synthetic input.
    fn conformance(&self) -> Result<(), LoadError> {
        let interest = self.interest();
        let keys = wit::PackedKeys {
            bytes: b"conformance/a conformance/b".to_vec(),
            ends: vec![13, 27],
        };
        if interest.contains(Interest::PUT) {
            let call = wit::PutCall {
                kind: wit::PutKind::BatchPut,
                client: "0-0".into(),
                keys: keys.clone(),
                sizes: vec![4096, 1 << 20],
                config: default_wit_config(),
            };
            self.on_put(&call).map_err(|error| LoadError::Conformance {
                call: "on-put",
                error,
            })?;
        }
        if interest.contains(Interest::LOOKUP) {
            let call = wit::LookupCall {
                keys: keys.clone(),
                counts: vec![2, 0],
                tiers: vec![wit::Tier::Memory, wit::Tier::Disk],
                sizes: vec![4096, 4096],
            };
            self.on_lookup(&call)
                .map_err(|error| LoadError::Conformance {
                    call: "on-lookup",
                    error,
                })?;
        }
        if interest.contains(Interest::BATCH_SPLIT) {
            let call = wit::SplitCall {
                sizes: vec![4096, 1 << 20],
                budget: wit::BudgetState {
                    in_flight_bytes: 0,
                    limit_bytes: 1 << 30,
                },
            };
            self.split(&call).map_err(|error| LoadError::Conformance {
                call: "split",
                error,
            })?;
        }
        if self.block_keys.is_some() || self.block_refs.is_some() {
            self.blocks(&keys).map_err(|error| LoadError::Conformance {
                call: "block-refs",
                error,
            })?;
        }
        if interest.contains(Interest::EVICT) {
            let call = wit::EvictCall {
                keys,
                sizes: vec![4096, 4096],
                tiers: vec![wit::Tier::Memory, wit::Tier::Memory],
                age_ms: vec![10, 20],
                hits: vec![1, 0],
                bytes_needed: 4096,
            };
            if self.evict_hinted.is_some() {
                let hint = |kind, age_ms, due_in_ms| wit::CandidateHint {
                    kind,
                    age_ms,
                    due_in_ms,
                };
                let call = wit::HintedEvictCall {
                    call: call.clone(),
                    on_disk: vec![true, false],
                    hints: vec![
                        hint(wit::HintKind::Done, 5, 0),
                        hint(wit::HintKind::Upcoming, 1, 100),
                    ],
                };
                self.evict_hinted(&call)
                    .map_err(|error| LoadError::Conformance {
                        call: "evict-hinted",
                        error,
                    })?;
            }
            if self.evict_tiered.is_some() {
                let call = wit::TieredEvictCall {
                    call: call.clone(),
                    on_disk: vec![true, false],
                };
                self.evict_tiered(&call)
                    .map_err(|error| LoadError::Conformance {
                        call: "evict-tiered",
                        error,
                    })?;
            }
            self.evict(&call).map_err(|error| LoadError::Conformance {
                call: "evict",
                error,
            })?;
        }
        Ok(())
    }
}

impl super::Policy for Plugin {
    fn name(&self) -> &str {
        &self.name
    }
    fn sha256(&self) -> &str {
        &self.sha256
    }
    fn interest(&self) -> Interest {
        Plugin::interest(self)
    }
    fn on_put(&self, call: &wit::PutCall) -> Result<wit::PutDecision, CallError> {
        Plugin::on_put(self, call)
    }
    fn on_lookup(&self, call: &wit::LookupCall) -> Result<Vec<Vec<u32>>, CallError> {
        Plugin::on_lookup(self, call)
    }
    fn split(&self, call: &wit::SplitCall) -> Result<Vec<u32>, CallError> {
        Plugin::split(self, call)
    }
    fn evict(&self, call: &wit::EvictCall) -> Result<Vec<u32>, CallError> {
        Plugin::evict(self, call)
    }
    fn observe(&self, event: &wit::Observation) -> Result<(), CallError> {
        Plugin::observe(self, event)
    }
    fn blocks(&self, keys: &wit::PackedKeys) -> Result<Option<Vec<Option<wit::Block>>>, CallError> {
        Plugin::blocks(self, keys)
    }
    fn evict_tiered(
        &self,
        call: &wit::TieredEvictCall,
    ) -> Result<Option<Vec<wit::Victim>>, CallError> {
        Plugin::evict_tiered(self, call)
    }
    fn evict_hinted(
        &self,
        call: &wit::HintedEvictCall,
    ) -> Result<Option<Vec<wit::Victim>>, CallError> {
        Plugin::evict_hinted(self, call)
    }
    fn reads_hints(&self) -> bool {
        Plugin::reads_hints(self)
    }
}

/// The WIT form of Mooncake's default `ReplicateConfig`.
pub fn default_wit_config() -> wit::ReplicateConfig {
    wit::ReplicateConfig {
        replica_num: 1,
        nof_replica_num: 0,
        dfs_replica_num: 0,
        soft_pin_action: wit::SoftPinAction::Preserve,
        soft_pin_ttl_ms: None,
        with_hard_pin: false,
        preferred_segments: Vec::new(),
        preferred_segment: String::new(),
        prefer_alloc_in_same_node: false,
    }
}

fn classify(e: &wasmtime::Error, store: &Store<HostState>, plugin: &Plugin) -> CallError {
    // Rust guests abort when an allocation fails, so a refused grow shows up as a trap.
    if store.data().refused_grow {
        return CallError::OutOfMemory;
    }
    match e.downcast_ref::<Trap>() {
        Some(Trap::Interrupt) => CallError::Timeout(plugin.engine.limits.call_timeout),
        Some(t) => CallError::Trap(t.to_string()),
        None => CallError::Trap(format!("{e:#}")),
    }
}

#[cfg(test)]
mod tests {
    //! The host with the one component every build has (the embedded default) and with
    //! bytes that are no component; the other plugins are tested in `tests/all/`.

    use super::*;
    use crate::metrics::Metrics;
    use crate::policy::registry::DEFAULT_PLUGIN;

    fn engine() -> Arc<PolicyEngine> {
        PolicyEngine::new(
            HostLimits {
                // No test here is about the deadline (tests/all/policy_host.rs are): a
                // generous one, so a starved machine does not fail a hook call.
                call_timeout: Duration::from_secs(1),
                memory_bytes: 8 << 20,
                max_instances: 4,
            },
            Metrics::new().policy.plugins.clone(),
        )
        .unwrap()
    }

    #[test]
    fn the_embedded_default_loads_and_admits_unchanged() {
        let p = engine().load("default", DEFAULT_PLUGIN, b"", None).unwrap();
        assert!(p.interest().contains(Interest::PUT));
        let d = p
            .on_put(&wit::PutCall {
                kind: wit::PutKind::Put,
                client: "1-2".into(),
                keys: wit::PackedKeys {
                    bytes: b"k".to_vec(),
                    ends: vec![1],
                },
                sizes: vec![1],
                config: default_wit_config(),
            })
            .unwrap();
        assert!(d.config.is_none() && d.admissions.is_empty());
        assert_eq!(p.version().len(), 12);
    }

    #[test]
    fn bytes_that_are_no_component_or_break_the_pin_are_refused() {
        let e = engine();
        assert!(matches!(
            e.load("junk", b"\0asm garbage", b"", None),
            Err(LoadError::Compile(_))
        ));
        assert!(matches!(
            e.load("default", DEFAULT_PLUGIN, b"", Some("00")),
            Err(LoadError::ShaMismatch { .. })
        ));
    }

    /// A victim index past the candidates is the plugin's bug: the whole answer is
    /// refused (the evictor then falls back to least recently used first).
    #[test]
    fn victims_past_the_candidates_are_refused() {
        let v = |index| wit::Victim {
            index,
            scope: wit::EvictScope::Memory,
        };
        assert_eq!(victims_of(vec![v(0), v(2)], 3).unwrap().len(), 2);
        let e = victims_of(vec![v(1), v(3)], 3).unwrap_err();
        assert!(
            e.to_string()
                .contains("victim index 3 out of range (3 candidates)"),
            "{e}"
        );
        assert!(victims_of(vec![v(0)], 0).is_err());
    }
}

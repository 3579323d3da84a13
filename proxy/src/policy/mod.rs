//! Policies: sandboxed WebAssembly plugins that decide on moongate's traffic.
//!
//! Rooms, each owning one thing:
//! - [`Policy`] (here): what a policy is to the rest of moongate: the hooks of the WIT
//!   contract as plain calls. The wasm plugin ([`host::Plugin`]) implements it; tests
//!   implement it with fakes, so nothing above this layer needs wasm to be tested.
//! - [`epoch`]: the thread that advances the engine's epoch (call deadlines), at rest
//!   while no plugin runs.
//! - [`host`]: the wasmtime host (compile once, one instance per plugin generation,
//!   deadline and memory cap per call, fail classification).
//! - [`view`]: a decoded call as the plugin sees it, and the plugin's answer as an
//!   action on decoded values (rewrite, partial deny + merge, local answer).
//! - [`decision`]: the one decision lifecycle every caller goes through, the master face
//!   and the kv face alike: decide -> send -> finish (observe + guardrail), with the
//!   fail mode and the hook metrics.
//! - [`catalog`]: loaded plugins, their hashes, rejected uploads, the watched directory.
//! - [`active`]: the set in force in an `ArcSwap`, swap, last-good, rollback, reaper.
//! - [`experiment`]: arms, assignment, guardrail windows (pure).
//! - [`registry`]: composes the three above into the handle the faces and admin hold.
//! - [`config`], [`metrics`]: this layer's config section and metric families.
//!
//! The policy layer knows no frames and no sockets: it takes decoded values and returns
//! decoded values; the faces encode.

pub mod active;
pub mod catalog;
pub mod config;
pub mod decision;
pub mod epoch;
pub mod experiment;
pub mod host;
pub mod metrics;
pub mod registry;
pub mod trust;
pub mod view;

#[cfg(test)]
pub mod fake;

pub use config::{FailMode, PolicyConfig};
pub use decision::{Decision, Outcome, Sending, Ticket};
pub use experiment::{arm_for_hash, fnv1a};
pub use host::{CallError, Interest, wit};
pub use view::{Fixup, PutAction, pack_keys, put_action, put_view};

/// A policy as moongate calls it: the hooks of `wit/policy.wit`, each a plain call that
/// returns a decision or why there is none. Implementations must be cheap to call from
/// the request path (microseconds) and must not block on I/O.
pub trait Policy: Send + Sync + std::fmt::Debug {
    /// Catalog name.
    fn name(&self) -> &str;
    /// Hex sha256 of the code (the component bytes for a plugin).
    fn sha256(&self) -> &str;
    /// Short version label for metrics: the first 12 hex digits of the sha256.
    fn version(&self) -> &str {
        let s = self.sha256();
        &s[..s.len().min(12)]
    }
    /// The hooks it wants called; the others are never called.
    fn interest(&self) -> Interest;
    fn on_put(&self, call: &wit::PutCall) -> Result<wit::PutDecision, CallError>;
    fn on_lookup(&self, call: &wit::LookupCall) -> Result<Vec<Vec<u32>>, CallError>;
    fn split(&self, call: &wit::SplitCall) -> Result<Vec<u32>, CallError>;
    fn evict(&self, call: &wit::EvictCall) -> Result<Vec<u32>, CallError>;
    fn observe(&self, event: &wit::Observation) -> Result<(), CallError>;
    /// The block each key names, for KV events (`block-refs`, WIT 0.1.3, or `block-keys`,
    /// WIT 0.1.1). `Ok(None)`: the policy has neither hook, so its keys publish nothing.
    fn blocks(
        &self,
        _keys: &wit::PackedKeys,
    ) -> Result<Option<Vec<Option<wit::Block>>>, CallError> {
        Ok(None)
    }
    /// Victims chosen per tier (`evict-tiered`, WIT 0.1.2), called instead of `evict` in
    /// the owner topology with an SSD tier. `Ok(None)`: the policy has no such hook, so
    /// its victims lose their memory copy only.
    fn evict_tiered(
        &self,
        _call: &wit::TieredEvictCall,
    ) -> Result<Option<Vec<wit::Victim>>, CallError> {
        Ok(None)
    }
    /// Victims chosen knowing what the serving stack said of the candidates
    /// (`evict-hinted`, WIT 0.1.4), called instead of `evict-tiered` / `evict` when a
    /// round has hints. `Ok(None)`: the policy has no such hook.
    fn evict_hinted(
        &self,
        _call: &wit::HintedEvictCall,
    ) -> Result<Option<Vec<wit::Victim>>, CallError> {
        Ok(None)
    }
    /// Whether it has `evict-hinted`: only then are a round's hints looked up.
    fn reads_hints(&self) -> bool {
        false
    }
}

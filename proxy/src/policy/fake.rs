//! A policy for tests: hooks are closures, observations are recorded. Lets the decision
//! lifecycle, the master-face session and the kv face be tested with no wasm.

use std::sync::Mutex;

use super::Policy;
use super::host::{CallError, Interest, wit};

type Hook<C, R> = Box<dyn Fn(&C) -> Result<R, CallError> + Send + Sync>;

pub struct Fake {
    name: String,
    interest: Interest,
    on_put: Hook<wit::PutCall, wit::PutDecision>,
    on_lookup: Hook<wit::LookupCall, Vec<Vec<u32>>>,
    split: Hook<wit::SplitCall, Vec<u32>>,
    /// `block-refs`; `None`: the policy has no such hook.
    blocks: Option<Hook<wit::PackedKeys, Vec<Option<wit::Block>>>>,
    /// `evict-hinted`; `None`: the policy has no such hook.
    evict_hinted: Option<Hook<wit::HintedEvictCall, Vec<wit::Victim>>>,
    /// Every `observe` call, in order.
    pub observed: Mutex<Vec<wit::Observation>>,
}

impl std::fmt::Debug for Fake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fake").field("name", &self.name).finish()
    }
}

impl Fake {
    /// A policy that wants `observe` only and changes nothing.
    pub fn new(name: &str) -> Fake {
        Fake {
            name: name.into(),
            interest: Interest::OBSERVE,
            on_put: Box::new(|_| {
                Ok(wit::PutDecision {
                    config: None,
                    admissions: Vec::new(),
                })
            }),
            on_lookup: Box::new(|_| Ok(Vec::new())),
            split: Box::new(|_| Ok(Vec::new())),
            blocks: None,
            evict_hinted: None,
            observed: Mutex::new(Vec::new()),
        }
    }

    pub fn on_put(
        mut self,
        f: impl Fn(&wit::PutCall) -> Result<wit::PutDecision, CallError> + Send + Sync + 'static,
    ) -> Fake {
        self.interest |= Interest::PUT;
        self.on_put = Box::new(f);
        self
    }

    pub fn on_lookup(
        mut self,
        f: impl Fn(&wit::LookupCall) -> Result<Vec<Vec<u32>>, CallError> + Send + Sync + 'static,
    ) -> Fake {
        self.interest |= Interest::LOOKUP;
        self.on_lookup = Box::new(f);
        self
    }

    pub fn split(
        mut self,
        f: impl Fn(&wit::SplitCall) -> Result<Vec<u32>, CallError> + Send + Sync + 'static,
    ) -> Fake {
        self.interest |= Interest::BATCH_SPLIT;
        self.split = Box::new(f);
        self
    }

    /// Gives it a `block-refs` hook (not an interest flag: found by export).
    pub fn blocks(
        mut self,
        f: impl Fn(&wit::PackedKeys) -> Result<Vec<Option<wit::Block>>, CallError>
        + Send
        + Sync
        + 'static,
    ) -> Fake {
        self.blocks = Some(Box::new(f));
        self
    }

    /// Gives it an `evict-hinted` hook (and the `evict` interest).
    pub fn evict_hinted(
        mut self,
        f: impl Fn(&wit::HintedEvictCall) -> Result<Vec<wit::Victim>, CallError> + Send + Sync + 'static,
    ) -> Fake {
        self.interest |= Interest::EVICT;
        self.evict_hinted = Some(Box::new(f));
        self
    }

    /// A put decision that denies the keys whose name starts with `prefix`.
    pub fn deny_prefix(self, prefix: &'static str, code: i32) -> Fake {
        self.on_put(move |c| {
            let mut from = 0usize;
            let admissions = c
                .keys
                .ends
                .iter()
                .map(|&end| {
                    let key = &c.keys.bytes[from..end as usize];
                    from = end as usize;
                    if key.starts_with(prefix.as_bytes()) {
                        wit::Admission::Deny(code)
                    } else {
                        wit::Admission::Admit
                    }
                })
                .collect();
            Ok(wit::PutDecision {
                config: None,
                admissions,
            })
        })
    }

    pub fn observations(&self) -> Vec<(String, i32, u32)> {
        self.observed
            .lock()
            .unwrap()
            .iter()
            .map(|o| (o.method.clone(), o.outcome, o.keys))
            .collect()
    }
}

impl Policy for Fake {
    fn name(&self) -> &str {
        &self.name
    }
    fn sha256(&self) -> &str {
        "fa4efa4efa4efa4efa4efa4efa4efa4e"
    }
    fn interest(&self) -> Interest {
        self.interest
    }
    fn on_put(&self, call: &wit::PutCall) -> Result<wit::PutDecision, CallError> {
        (self.on_put)(call)
    }
    fn on_lookup(&self, call: &wit::LookupCall) -> Result<Vec<Vec<u32>>, CallError> {
        (self.on_lookup)(call)
    }
    fn split(&self, call: &wit::SplitCall) -> Result<Vec<u32>, CallError> {
        (self.split)(call)
    }
    fn evict(&self, _call: &wit::EvictCall) -> Result<Vec<u32>, CallError> {
        Ok(Vec::new())
    }
    fn blocks(&self, keys: &wit::PackedKeys) -> Result<Option<Vec<Option<wit::Block>>>, CallError> {
        self.blocks.as_ref().map(|f| f(keys)).transpose()
    }
    fn evict_hinted(
        &self,
        call: &wit::HintedEvictCall,
    ) -> Result<Option<Vec<wit::Victim>>, CallError> {
        self.evict_hinted.as_ref().map(|f| f(call)).transpose()
    }
    fn reads_hints(&self) -> bool {
        self.evict_hinted.is_some()
    }
    fn observe(&self, event: &wit::Observation) -> Result<(), CallError> {
        self.observed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(event.clone());
        Ok(())
    }
}

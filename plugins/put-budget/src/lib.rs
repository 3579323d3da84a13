//! Backpressure for puts: admits value bytes up to a budget per time window, node-wide
//! (every connection of this moongate shares the one plugin instance) and per client,
//! and denies the rest with NO_AVAILABLE_HANDLE (-200), which vLLM's connector treats
//! as "skip this store". Keys are admitted in the order the call lists them.
//!
//! Config (JSON): `{"window_ms": 1000, "node_bytes": 1073741824, "client_bytes": 268435456,
//! "part_bytes": 67108864}` (`client_bytes` optional: no per-client limit). A window
//! starts with the first put after the previous one ended; budgets refill at its end.
//! `part_bytes` (optional) also cuts every batch put into parts of at most that many
//! value bytes on their way to the master (the `split` hook); the client still gets one
//! reply.
//!
//! Metrics: `moongate_plugin_gauge{name="node_bytes_in_window"}`,
//! `moongate_plugin_counter_total{name="denied_keys"}` and `{name="denied_bytes"}`.

// BTreeMap, not HashMap: std's HashMap seeds itself from WASI randomness, and a plugin
// has no WASI (the import traps).
use std::collections::BTreeMap;

use moongate_policy_sdk::*;
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    window_ms: u64,
    node_bytes: u64,
    client_bytes: Option<u64>,
    part_bytes: Option<u64>,
}

struct PutBudget {
    cfg: Config,
    window: Window,
    node_used: u64,
    client_used: BTreeMap<String, u64>,
    gauge_used: u32,
    denied_keys: u32,
    denied_bytes: u32,
}

impl Policy for PutBudget {
    fn new(config: &[u8]) -> Result<(Self, Interest), String> {
        let cfg: Config =
            serde_json::from_slice(config).map_err(|e| format!("put-budget config: {e}"))?;
        if cfg.window_ms == 0
            || cfg.node_bytes == 0
            || cfg.client_bytes == Some(0)
            || cfg.part_bytes == Some(0)
        {
            return Err(
                "put-budget: window_ms, node_bytes, client_bytes and part_bytes must be > 0".into(),
            );
        }
        let interest = if cfg.part_bytes.is_some() {
            Interest::PUT | Interest::BATCH_SPLIT
        } else {
            Interest::PUT
        };
        let window = Window::new(cfg.window_ms);
        Ok((
            PutBudget {
                cfg,
                window,
                node_used: 0,
                client_used: BTreeMap::new(),
                gauge_used: host::register_gauge(
                    "node_bytes_in_window",
                    "bytes admitted this window",
                )?,
                denied_keys: host::register_counter("denied_keys", "keys refused for budget")?,
                denied_bytes: host::register_counter("denied_bytes", "bytes refused for budget")?,
            },
            interest,
        ))
    }

    fn split(&mut self, call: SplitCall) -> Vec<u32> {
        match self.cfg.part_bytes {
            Some(max) => split_by_bytes(&call.sizes, max),
            None => Vec::new(),
        }
    }

    fn on_put(&mut self, call: PutCall) -> PutDecision {
        if self.window.roll() {
            self.node_used = 0;
            self.client_used.clear();
        }
        let client_used = self.client_used.entry(call.client.clone()).or_insert(0);
        let mut admissions = Vec::with_capacity(call.sizes.len());
        let mut denied = 0u64;
        let mut denied_bytes = 0u64;
        for &size in &call.sizes {
            let fits_node = self.node_used + size <= self.cfg.node_bytes;
            let fits_client = self
                .cfg
                .client_bytes
                .is_none_or(|c| *client_used + size <= c);
            if fits_node && fits_client {
                self.node_used += size;
                *client_used += size;
                admissions.push(Admission::Admit);
            } else {
                denied += 1;
                denied_bytes += size;
                admissions.push(Admission::Deny(error_code::NO_AVAILABLE_HANDLE));
            }
        }
        host::gauge_set(self.gauge_used, self.node_used as i64);
        if denied == 0 {
            return PutDecision::admit_all();
        }
        host::counter_add(self.denied_keys, denied);
        host::counter_add(self.denied_bytes, denied_bytes);
        PutDecision {
            config: None,
            admissions,
        }
    }
}

export_policy!(PutBudget);

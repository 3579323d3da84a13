//! `moongate sim`: policies evaluated offline over a request trace, in seconds.
//!
//! Rooms:
//! - [`trace`]: the trace, as dense block numbers.
//! - [`baseline`]: the references every run reports, native: `lru` and `opt` (Belady).
//! - [`store`]: the store model a plugin runs against, through the same policy host
//!   code as live traffic ([`crate::policy::registry::Registry`], the eviction rounds
//!   of [`crate::eviction::victims`]).
//! - [`report`]: the JSON report and the miss-ratio plot.
//!
//! Knows no sockets: it reads a trace and plugin bytes it is given and returns numbers.

pub mod baseline;
pub mod hints;
pub mod report;
pub mod store;
pub mod trace;

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Instant;

use serde::Serialize;
use thiserror::Error;

use crate::policy::Policy;
use crate::policy::host::{Clock, HostLimits, PolicyEngine};
use crate::policy::registry::Registry;
pub use store::{Live, Model, Rules};
pub use trace::Trace;

/// What one run counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Counts {
    /// Blocks looked up.
    pub lookups: u64,
    /// Prefix hits: per request, the blocks found before the first miss.
    pub hits: u64,
    /// Blocks stored.
    pub stored: u64,
    /// Blocks removed (by moongate's rounds or the master).
    pub evicted: u64,
    /// Of those, removed by the master's own eviction (live rules).
    pub master_evicted: u64,
    /// Blocks the policy denied at put.
    pub denied: u64,
    /// Blocks admitted that did not fit (refused with NO_AVAILABLE_HANDLE).
    pub refused: u64,
    /// Eviction rounds that asked the policy.
    pub rounds: u64,
    /// Mean share of the capacity holding data, sampled as each request arrives, in
    /// parts per million (the store model; the native baselines leave it 0).
    pub occupancy_ppm: u64,
    /// With `--hints`: blocks announced `upcoming`, `done` (true), `done` (wrong) and
    /// `expect`.
    pub hints_upcoming: u64,
    pub hints_done: u64,
    pub hints_wrong: u64,
    pub hints_expect: u64,
    /// Eviction rounds whose candidates had a hint (the plugin was called with them).
    pub hinted_rounds: u64,
}

impl Counts {
    pub fn hit_rate(&self) -> f64 {
        if self.lookups == 0 {
            0.0
        } else {
            self.hits as f64 / self.lookups as f64
        }
    }
}

/// A capacity as `--capacity` names it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Capacity {
    /// A share of the trace's distinct blocks (`5%`).
    Share(f64),
    /// Bytes (`64MiB`, `1GiB`, `4096`).
    Bytes(u64),
}

impl Capacity {
    /// Parses a comma list: `5%,10%` or `64MiB,128MiB` (units KiB, MiB, GiB, KB, MB, GB,
    /// or none for bytes).
    pub fn parse_list(s: &str) -> Result<Vec<Capacity>, String> {
        let out: Result<Vec<Capacity>, String> = s
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(Capacity::parse)
            .collect();
        let out = out?;
        if out.is_empty() {
            return Err(format!("{s:?}: no capacity"));
        }
        Ok(out)
    }

    fn parse(p: &str) -> Result<Capacity, String> {
        if let Some(pct) = p.strip_suffix('%') {
            let v: f64 = pct
                .trim()
                .parse()
                .map_err(|_| format!("{p:?}: not a percentage"))?;
            if !(v > 0.0 && v <= 100.0) {
                return Err(format!("{p:?}: a share must be in (0, 100] %"));
            }
            return Ok(Capacity::Share(v / 100.0));
        }
        let split = p
            .find(|c: char| !c.is_ascii_digit() && c != '.')
            .unwrap_or(p.len());
        let (num, unit) = p.split_at(split);
        let v: f64 = num
            .parse()
            .map_err(|_| format!("{p:?}: not a size (e.g. 64MiB)"))?;
        let mult: f64 = match unit.trim() {
            "" | "B" => 1.0,
            "KiB" => 1024.0,
            "MiB" => 1024.0 * 1024.0,
            "GiB" => 1024.0 * 1024.0 * 1024.0,
            "KB" | "kB" => 1e3,
            "MB" => 1e6,
            "GB" => 1e9,
            u => {
                return Err(format!(
                    "{p:?}: unknown unit {u:?} (KiB, MiB, GiB, KB, MB, GB)"
                ));
            }
        };
        let bytes = (v * mult) as u64;
        if bytes == 0 {
            return Err(format!("{p:?}: zero bytes"));
        }
        Ok(Capacity::Bytes(bytes))
    }

    /// Whole blocks of `block_size` this capacity holds for `trace`.
    pub fn blocks(&self, trace: &Trace, block_size: u64) -> u64 {
        match *self {
            Capacity::Share(f) => (f * trace.distinct() as f64) as u64,
            Capacity::Bytes(b) => b / block_size.max(1),
        }
    }
}

/// A policy to simulate: its label in the report and its component bytes.
pub struct PluginSource {
    pub label: String,
    pub bytes: Vec<u8>,
    /// JSON config given to its `configure` (empty: none).
    pub config: Vec<u8>,
}

/// One simulation: the trace, capacities, policies and store rules.
pub struct Spec {
    pub trace_name: String,
    pub capacities: Vec<Capacity>,
    pub block_size: u64,
    pub plugins: Vec<PluginSource>,
    pub rules: Rules,
    pub max_candidates: usize,
    /// Above 1: also the fleet's rows, each policy run by this many sidecars (each with
    /// its own instance and its own part of the table) with only the accesses routed to
    /// it, and with the fleet's access records: natively for `lru`
    /// ([`baseline::lru_fleet`]), through the store model for plugins ([`store::Fleet`]).
    /// At most [`MAX_PLUGIN_RANKS`] with plugins.
    pub ranks: usize,
    pub route: baseline::Route,
    /// Hint streams the plugins get (`--hints`); `lru` and `opt` stay hint-free
    /// references.
    pub hints: Option<hints::HintSpec>,
}

/// The most sidecars a plugin's fleet run models: one plugin instance each, every
/// instance holding its own memory (up to the host's limit).
pub const MAX_PLUGIN_RANKS: usize = 64;

#[derive(Debug, Error)]
pub enum SimError {
    #[error("plugin {label}: {error}")]
    Plugin { label: String, error: String },
    #[error(
        "{ranks} ranks with plugins: at most {MAX_PLUGIN_RANKS} (one plugin instance per rank)"
    )]
    TooManyRanks { ranks: usize },
}

/// One (policy, capacity) result, as the report's JSON carries it.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub policy: String,
    pub capacity_fraction: f64,
    pub capacity_bytes: u64,
    pub lookups: u64,
    pub hits: u64,
    pub hit_rate: f64,
    /// Everything else the run counted.
    pub counts: Counts,
    /// Wall time of this run.
    pub seconds: f64,
}

/// The report: `{"trace", "results": [...]}` plus what the run was.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub trace: String,
    pub requests: usize,
    pub distinct_blocks: usize,
    pub block_size: u64,
    /// `on-demand` or `live`.
    pub rules: String,
    /// The hint model the plugins' rows ran with (`null`: none).
    pub hints: Option<hints::HintSpec>,
    pub results: Vec<Row>,
}

/// Runs the baselines and every plugin at every capacity.
pub fn run(trace: &Trace, spec: &Spec) -> Result<Report, SimError> {
    if !spec.plugins.is_empty() && spec.ranks > MAX_PLUGIN_RANKS {
        return Err(SimError::TooManyRanks { ranks: spec.ranks });
    }
    let distinct = trace.distinct() as u64;
    let route = match spec.route {
        baseline::Route::Random => "random",
        baseline::Route::Sticky => "sticky",
    };
    let fleet_label = |policy: &str, records: bool| {
        format!(
            "{policy} x{} {route}{}",
            spec.ranks,
            if records { " records" } else { "" }
        )
    };
    let mut results = Vec::new();
    let row = |policy: &str, blocks: u64, c: Counts, t: Instant| Row {
        policy: policy.to_string(),
        capacity_fraction: blocks as f64 / distinct as f64,
        capacity_bytes: blocks * spec.block_size,
        lookups: c.lookups,
        hits: c.hits,
        hit_rate: c.hit_rate(),
        counts: c,
        seconds: t.elapsed().as_secs_f64(),
    };
    let capacities: Vec<u64> = spec
        .capacities
        .iter()
        .map(|c| c.blocks(trace, spec.block_size))
        .collect();
    for &blocks in &capacities {
        let t = Instant::now();
        let c = baseline::lru(trace, blocks as usize);
        results.push(row("lru", blocks, c, t));
        let t = Instant::now();
        let c = baseline::opt(trace, blocks as usize);
        results.push(row("opt", blocks, c, t));
        if spec.ranks > 1 {
            for homes in [false, true] {
                let t = Instant::now();
                let c = baseline::lru_fleet(trace, blocks as usize, spec.ranks, spec.route, homes);
                results.push(row(&fleet_label("lru", homes), blocks, c, t));
            }
        }
    }
    let clock = Arc::new(AtomicU64::new(0));
    let metrics = crate::metrics::Metrics::new();
    let engine = PolicyEngine::with_clock(
        HostLimits {
            // Offline nothing waits on a call: a generous deadline only catches loops.
            call_timeout: std::time::Duration::from_secs(5),
            memory_bytes: 256 << 20,
            // One instance per modelled sidecar, and the loaded one.
            max_instances: spec.ranks.clamp(1, MAX_PLUGIN_RANKS) as u32 + 2,
        },
        metrics.policy.plugins.clone(),
        Clock::Virtual(clock.clone()),
    )
    .map_err(|e| SimError::Plugin {
        label: "(engine)".into(),
        error: e.to_string(),
    })?;
    for p in &spec.plugins {
        let fail = |error: String| SimError::Plugin {
            label: p.label.clone(),
            error,
        };
        let plugin = engine
            .load(&p.label, &p.bytes, &p.config, None)
            .map_err(|e| match e {
                // A plugin that needs a config, given none: say so, and how.
                crate::policy::host::LoadError::Refused(why) if p.config.is_empty() => {
                    fail(format!(
                        "it needs a config (its configure refused none: {why}); give it as \
                         --policy NAME='{{...}}' or --policy NAME=@config.json"
                    ))
                }
                e => fail(e.to_string()),
            })?;
        // A registry over a fresh instance: a plugin's state must not carry over
        // from one run to the next, nor from one modelled sidecar to another.
        let registry = |plugin: Arc<crate::policy::host::Plugin>| {
            plugin.reset();
            let policy: Arc<dyn Policy> = plugin;
            let cfg = crate::policy::PolicyConfig {
                call_timeout_ms: 5000,
                ..Default::default()
            };
            Registry::with_policies(cfg, None, metrics.policy.clone(), vec![policy])
                .map_err(|e| fail(e.to_string()))
        };
        for &blocks in &capacities {
            let model = Model {
                capacity_bytes: blocks * spec.block_size,
                block_size: spec.block_size,
                max_candidates: spec.max_candidates,
                rules: spec.rules.clone(),
                fleet: None,
                hints: spec.hints.clone(),
            };
            let t = Instant::now();
            let c = store::run(trace, &model, &[registry(plugin.clone())?], &clock);
            results.push(row(&p.label, blocks, c, t));
            if spec.ranks < 2 {
                continue;
            }
            for records in [false, true] {
                let regs = (0..spec.ranks)
                    .map(|_| registry(plugin.sibling()))
                    .collect::<Result<Vec<_>, _>>()?;
                let model = Model {
                    fleet: Some(store::Fleet {
                        ranks: spec.ranks,
                        route: spec.route,
                        records,
                    }),
                    ..model.clone()
                };
                let t = Instant::now();
                let c = store::run(trace, &model, &regs, &clock);
                results.push(row(&fleet_label(&p.label, records), blocks, c, t));
            }
        }
    }
    Ok(Report {
        trace: spec.trace_name.clone(),
        requests: trace.requests.len(),
        distinct_blocks: trace.distinct(),
        block_size: spec.block_size,
        rules: match spec.rules {
            Rules::OnDemand { .. } => "on-demand".into(),
            Rules::Live(_) => "live".into(),
        },
        hints: spec.hints.clone(),
        results,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacities_parse_as_shares_or_sizes() {
        assert_eq!(
            Capacity::parse_list("5%, 10%").unwrap(),
            [Capacity::Share(0.05), Capacity::Share(0.10)]
        );
        assert_eq!(
            Capacity::parse_list("64MiB,1GB,4096").unwrap(),
            [
                Capacity::Bytes(64 << 20),
                Capacity::Bytes(1_000_000_000),
                Capacity::Bytes(4096)
            ]
        );
        for bad in ["", "0%", "101%", "x%", "12QB", "0MiB", "MiB"] {
            assert!(Capacity::parse_list(bad).is_err(), "{bad:?}");
        }
    }
}

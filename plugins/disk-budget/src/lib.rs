//! Tier steering of reads. On every GetReplicaList / BatchGetReplicaList answer:
//!
//! - replicas are offered memory first (`"prefer": "memory"`, the default), or disk
//!   only when the key has a disk replica (`"prefer": "disk"`: spare memory bandwidth);
//! - a key whose first offered replica is on disk (disk or local disk) is a disk read:
//!   disk reads are admitted up to `disk_bytes` per `window_ms`, in the order the keys
//!   were asked for (prefix order); once the budget is spent, that key and every later
//!   key of the answer are answered as not found, so the engine recomputes them instead
//!   of waiting on a saturated disk (vLLM's static 0.9 x 1280 MiB staging rule, as a
//!   live budget);
//! - a key is charged once per window: one admitted in this window or the one before is
//!   admitted again at no charge. vLLM looks a batch up before it loads it (its
//!   scheduler's existence check, its tier log's `batch_get_replica_desc`), and the
//!   load of a key the budget admitted at its lookup must not be cut afterwards.
//!
//! Config (JSON): `{"window_ms": 1000, "disk_bytes": 1207959552, "prefer": "memory"}`.
//! Metrics: gauge `disk_bytes_in_window`, counters `disk_keys_admitted`, `keys_cut`.

use std::collections::BTreeSet;

use moongate_policy_sdk::*;
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    window_ms: u64,
    disk_bytes: u64,
    #[serde(default)]
    prefer: Prefer,
}

#[derive(Deserialize, Default, PartialEq)]
#[serde(rename_all = "lowercase")]
enum Prefer {
    #[default]
    Memory,
    Disk,
}

struct DiskBudget {
    cfg: Config,
    window: Window,
    used: u64,
    /// Keys admitted as disk reads in this window, and in the one before.
    admitted_now: BTreeSet<Vec<u8>>,
    admitted_before: BTreeSet<Vec<u8>>,
    gauge_used: u32,
    admitted: u32,
    cut: u32,
}

fn is_disk(t: Tier) -> bool {
    matches!(t, Tier::Disk | Tier::LocalDisk)
}

impl Policy for DiskBudget {
    fn new(config: &[u8]) -> Result<(Self, Interest), String> {
        let cfg: Config =
            serde_json::from_slice(config).map_err(|e| format!("disk-budget config: {e}"))?;
        if cfg.window_ms == 0 {
            return Err("disk-budget: window_ms must be > 0".into());
        }
        let window = Window::new(cfg.window_ms);
        Ok((
            DiskBudget {
                cfg,
                window,
                used: 0,
                admitted_now: BTreeSet::new(),
                admitted_before: BTreeSet::new(),
                gauge_used: host::register_gauge(
                    "disk_bytes_in_window",
                    "disk bytes admitted this window",
                )?,
                admitted: host::register_counter("disk_keys_admitted", "disk reads admitted")?,
                cut: host::register_counter("keys_cut", "keys answered not found for budget")?,
            },
            Interest::LOOKUP,
        ))
    }

    fn on_lookup(&mut self, call: LookupCall) -> Vec<Vec<u32>> {
        if self.window.roll() {
            self.used = 0;
            self.admitted_before = std::mem::take(&mut self.admitted_now);
        }
        let mut out = Vec::with_capacity(call.counts.len());
        let (mut at, mut exhausted) = (0usize, false);
        let (mut admitted, mut cut) = (0u64, 0u64);
        for (k, &n) in call.counts.iter().enumerate() {
            let tiers = &call.tiers[at..at + n as usize];
            let sizes = &call.sizes[at..at + n as usize];
            at += n as usize;
            if n == 0 {
                out.push(Vec::new());
                continue;
            }
            let key = call.keys.get(k);
            let seen = self.admitted_now.contains(key) || self.admitted_before.contains(key);
            if exhausted && !seen {
                cut += 1;
                out.push(Vec::new());
                continue;
            }
            let mut order: Vec<u32> = (0..n).collect();
            if self.cfg.prefer == Prefer::Disk && tiers.iter().any(|&t| is_disk(t)) {
                order.retain(|&i| is_disk(tiers[i as usize]));
            } else {
                order.sort_by_key(|&i| !matches!(tiers[i as usize], Tier::Memory));
            }
            let first = order[0] as usize;
            if is_disk(tiers[first]) && seen {
                // Charged when it was first admitted.
                if !self.admitted_now.contains(key) {
                    self.admitted_now.insert(key.to_vec());
                }
            } else if is_disk(tiers[first]) {
                if self.used + sizes[first] > self.cfg.disk_bytes {
                    exhausted = true;
                    cut += 1;
                    out.push(Vec::new());
                    continue;
                }
                self.used += sizes[first];
                admitted += 1;
                self.admitted_now.insert(key.to_vec());
            }
            out.push(order);
        }
        host::gauge_set(self.gauge_used, self.used as i64);
        host::counter_add(self.admitted, admitted);
        host::counter_add(self.cut, cut);
        out
    }
}

export_policy!(DiskBudget);

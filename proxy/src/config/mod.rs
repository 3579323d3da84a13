//! moongate's configuration: one strict TOML file, parsed once at start-up.
//!
//! Unknown keys are errors (`deny_unknown_fields`): a typo must not silently fall back
//! to a default. Every key has a default; `config/reference.toml` documents each one with
//! its reason, and a test keeps that file in step with [`Config::default`].

use std::path::Path;
use std::time::Duration;

use serde::Deserialize;
use thiserror::Error;

pub mod check;

pub use crate::kv::config::KvConfig;
pub use crate::policy::config::{PluginSpec, PolicyConfig, RollbackConfig};
use check::{check_addr, positive};

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub master_face: MasterFaceConfig,
    pub admin: AdminConfig,
    pub shutdown: ShutdownConfig,
    pub log: LogConfig,
    pub runtime: RuntimeConfig,
    pub policy: PolicyConfig,
    pub eviction: EvictionConfig,
    pub kv: KvConfig,
    /// An experiment to start with (instead of `policy.active`).
    pub experiment: Option<crate::policy::experiment::ExperimentSpec>,
}

/// moongate-driven eviction: a table of the keys clients put through this moongate, and
/// removals of the victims the policy picks when a trigger fires.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EvictionConfig {
    /// Off by default: Mooncake evicts by itself at its own watermark.
    pub enabled: bool,
    /// The master's Prometheus endpoint (`--metrics_port`), read for segment usage
    /// (`master_allocated_bytes` / `master_total_capacity_bytes`). Empty: no usage
    /// trigger.
    pub master_metrics_url: String,
    /// Usage (allocated / capacity) at which a round starts.
    pub high_watermark: f64,
    /// A usage round removes enough bytes to bring usage down to this.
    pub low_watermark: f64,
    /// Also start a round when the master denied puts with NO_AVAILABLE_HANDLE (-200)
    /// since the last check; it frees the denied bytes.
    pub on_put_denials: bool,
    /// How often the triggers are checked.
    pub interval_ms: u64,
    /// Removals sent per interval, at most.
    pub max_removals_per_interval: usize,
    /// Keys the table remembers; beyond it the least recently used entries are forgotten
    /// (not removed from the store).
    pub max_keys: usize,
    /// Candidates (least recently used first) offered to the plugin per round.
    pub max_candidates: usize,
    /// The master's read lease (`--default_kv_lease_ttl`): a key a lookup found within
    /// this long cannot be removed, so it is no candidate.
    pub lease_ms: u64,
    /// Deadline of one round's removals on moongate's own master connection.
    pub call_timeout_ms: u64,
}

impl Default for EvictionConfig {
    fn default() -> Self {
        EvictionConfig {
            enabled: false,
            master_metrics_url: String::new(),
            high_watermark: 0.85,
            low_watermark: 0.75,
            on_put_denials: true,
            interval_ms: 1_000,
            max_removals_per_interval: 1_000,
            max_keys: 1_000_000,
            max_candidates: 4_096,
            lease_ms: 10_000,
            call_timeout_ms: 5_000,
        }
    }
}

/// The async runtime.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct RuntimeConfig {
    /// 1: a single-threaded runtime (lowest per-call latency; a sidecar serves one
    /// rank's few connections). More: a multi-threaded runtime with that many workers.
    pub worker_threads: usize,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig { worker_threads: 1 }
    }
}

/// The master face: where Mooncake clients connect, and the master it fronts.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct MasterFaceConfig {
    /// `host:port` clients use as `master_server_address`.
    pub listen: String,
    /// `host:port` of the real `mooncake_master` RPC port.
    pub upstream: String,
    /// Client connections served at once; further ones are closed on accept.
    pub max_connections: usize,
    /// Largest request or response frame (header + body + attachment) in bytes.
    pub max_frame_bytes: u64,
    /// Requests forwarded but not yet answered, per connection; beyond it moongate
    /// stops reading that client until answers arrive.
    pub max_inflight_per_connection: usize,
    /// Time allowed to open the upstream connection for a new client connection.
    pub connect_timeout_ms: u64,
    /// Close a connection after this long without a byte in either direction; 0 = never.
    pub idle_timeout_ms: u64,
    /// When decoded frames are re-encoded: `on-change` (only when a policy changed the
    /// value; otherwise the received bytes are forwarded) or `always` (every typed frame
    /// goes out re-encoded from its decoded value; proves the codec on live traffic).
    pub reencode: Reencode,
    /// Batch calls with more keys than this go to the master as several calls of at most
    /// this many keys, answered as one merged reply; 0 = never split by count.
    pub max_batch_keys: usize,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Reencode {
    OnChange,
    Always,
}

/// The admin HTTP endpoint: `/live`, `/ready`, `/metrics`.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// `host:port`; loopback by default so nothing is exposed unless asked for.
    pub listen: String,
    /// How often readiness asks the master `ServiceReady`.
    pub ready_probe_interval_ms: u64,
    /// How long one readiness probe may take before it counts as a failure.
    pub ready_probe_timeout_ms: u64,
    /// Bearer token the mutating endpoints (`POST /plugins`, `PUT /experiments`, ...)
    /// require. Empty: they are refused unless the admin endpoint listens on loopback.
    pub token: String,
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct ShutdownConfig {
    /// After SIGTERM/SIGINT: how long in-flight calls may take to finish before the
    /// remaining connections are closed.
    pub grace_period_ms: u64,
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// A `tracing` filter, e.g. `info` or `moongate=debug`. `RUST_LOG` wins if set.
    pub level: String,
    /// `text` for people, `json` for log pipelines.
    pub format: LogFormat,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum LogFormat {
    Text,
    Json,
}

impl Default for MasterFaceConfig {
    fn default() -> Self {
        MasterFaceConfig {
            listen: "127.0.0.1:50052".into(),
            upstream: "127.0.0.1:50051".into(),
            max_connections: 1024,
            max_frame_bytes: 64 << 20,
            max_inflight_per_connection: 1024,
            connect_timeout_ms: 3_000,
            idle_timeout_ms: 300_000,
            reencode: Reencode::OnChange,
            max_batch_keys: 0,
        }
    }
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            listen: "127.0.0.1:9150".into(),
            ready_probe_interval_ms: 1_000,
            ready_probe_timeout_ms: 1_000,
            token: String::new(),
        }
    }
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        ShutdownConfig {
            grace_period_ms: 5_000,
        }
    }
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            level: "info".into(),
            format: LogFormat::Text,
        }
    }
}

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: String, message: String },
    #[error("{}", .0.join("\n"))]
    Invalid(Vec<String>),
}

impl Config {
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Config::parse(&text).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse {
                path: path.display().to_string(),
                message,
            },
            other => other,
        })
    }

    /// Parses and validates; validation reports every problem at once.
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let cfg: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: String::new(),
            message: e.to_string(),
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut errs = Vec::new();
        let mf = &self.master_face;
        check_addr(&mut errs, "master_face.listen", &mf.listen);
        check_addr(&mut errs, "master_face.upstream", &mf.upstream);
        check_addr(&mut errs, "admin.listen", &self.admin.listen);
        positive(
            &mut errs,
            "master_face.max_connections",
            mf.max_connections as u64,
        );
        if mf.max_frame_bytes < 1024 {
            errs.push("master_face.max_frame_bytes: must be at least 1024".into());
        }
        positive(
            &mut errs,
            "master_face.max_inflight_per_connection",
            mf.max_inflight_per_connection as u64,
        );
        positive(
            &mut errs,
            "master_face.connect_timeout_ms",
            mf.connect_timeout_ms,
        );
        positive(
            &mut errs,
            "admin.ready_probe_interval_ms",
            self.admin.ready_probe_interval_ms,
        );
        positive(
            &mut errs,
            "admin.ready_probe_timeout_ms",
            self.admin.ready_probe_timeout_ms,
        );
        positive(
            &mut errs,
            "runtime.worker_threads",
            self.runtime.worker_threads as u64,
        );
        self.kv.validate(&mut errs);
        let ev = &self.eviction;
        if ev.enabled {
            positive(&mut errs, "eviction.interval_ms", ev.interval_ms);
            positive(
                &mut errs,
                "eviction.max_removals_per_interval",
                ev.max_removals_per_interval as u64,
            );
            positive(&mut errs, "eviction.max_keys", ev.max_keys as u64);
            positive(
                &mut errs,
                "eviction.max_candidates",
                ev.max_candidates as u64,
            );
            positive(&mut errs, "eviction.call_timeout_ms", ev.call_timeout_ms);
            if !(0.0 < ev.low_watermark
                && ev.low_watermark < ev.high_watermark
                && ev.high_watermark <= 1.0)
            {
                errs.push("eviction: need 0 < low_watermark < high_watermark <= 1".into());
            }
            if !ev.master_metrics_url.is_empty()
                && crate::upstream::MetricsUrl::parse(&ev.master_metrics_url).is_none()
            {
                errs.push(format!(
                    "eviction.master_metrics_url: {:?} is not http://HOST:PORT/PATH",
                    ev.master_metrics_url
                ));
            }
            if ev.master_metrics_url.is_empty() && !ev.on_put_denials {
                errs.push(
                    "eviction: enabled without a trigger (set master_metrics_url or \
                     on_put_denials)"
                        .into(),
                );
            }
        }
        self.policy.validate(
            &mut errs,
            self.experiment
                .iter()
                .flat_map(|e| e.arms.iter().map(|a| (a.name.as_str(), a.plugin.as_str()))),
        );
        if tracing_subscriber::EnvFilter::try_new(&self.log.level).is_err() {
            errs.push(format!(
                "log.level: {:?} is not a valid tracing filter",
                self.log.level
            ));
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(errs))
        }
    }
}

impl MasterFaceConfig {
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }
    pub fn idle_timeout(&self) -> Option<Duration> {
        (self.idle_timeout_ms > 0).then(|| Duration::from_millis(self.idle_timeout_ms))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_is_all_defaults() {
        assert_eq!(Config::parse("").unwrap(), Config::default());
    }

    #[test]
    fn reference_file_states_the_defaults() {
        let text = include_str!("../../../config/reference.toml");
        assert_eq!(Config::parse(text).unwrap(), Config::default());
    }

    #[test]
    fn unknown_keys_are_refused() {
        let e = Config::parse("[master_face]\nlisten_addr = \"x:1\"\n").unwrap_err();
        assert!(e.to_string().contains("unknown field `listen_addr`"), "{e}");
    }

    #[test]
    fn every_invalid_value_is_reported_at_once() {
        let e = Config::parse(
            "[master_face]\nlisten = \"nope\"\nmax_connections = 0\n[admin]\nlisten = \":80\"\n",
        )
        .unwrap_err();
        let s = e.to_string();
        for k in [
            "master_face.listen",
            "master_face.max_connections",
            "admin.listen",
        ] {
            assert!(s.contains(k), "{k} missing from {s}");
        }
    }
}

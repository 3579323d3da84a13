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

/// The kv face: moongate as a native Mooncake client behind a small HTTP API.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct KvConfig {
    /// `host:port` of the HTTP API; empty = off.
    pub listen: String,
    /// Also serve the HTTP API on this Unix socket path; empty = no socket.
    pub unix_path: String,
    /// The transfer engine's metadata server (`http://HOST:PORT/metadata`, the same
    /// string Mooncake clients get), where segments publish their data listeners.
    pub metadata_url: String,
    /// Largest value a PUT may carry.
    pub max_value_bytes: usize,
    /// Keys one `POST /v1/kv/exists` or batch call may carry.
    pub max_batch_keys: usize,
    /// Value bytes per part of a batch get or put: each part reserves its bytes in the
    /// in-flight budget before it moves.
    pub batch_part_bytes: u64,
    /// Transfer-engine connections kept per peer; a value of 4 MiB or more moves over
    /// this many at once.
    pub te_connections_per_peer: usize,
    /// Deadline of one master call or one transfer.
    pub timeout_ms: u64,
    /// The Mooncake tenant of every key (what the Python client sends).
    pub tenant: String,
    /// Value bytes of gets and puts in progress on this node at most; beyond it requests
    /// wait up to `busy_wait_ms`, then get 503.
    pub max_inflight_bytes: u64,
    pub busy_wait_ms: u64,
    /// Size of moongate's own memory segment, mounted with the master; 0 = none.
    pub segment_bytes: u64,
    /// Address the segment's TE-TCP listener binds and advertises (port 0: any free).
    pub segment_listen: String,
    /// Also serve the own segment over QUIC here (UDP `host:port`); empty = no QUIC.
    pub quic_listen: String,
    /// PEM certificate chain and key of the QUIC endpoint; both empty = a self-signed
    /// certificate made at start (peers pin its fingerprint from the metadata server).
    pub quic_cert: String,
    pub quic_key: String,
    /// Use QUIC for segments whose owner moongate advertises it (else TE-TCP).
    pub quic_client: bool,
    /// QUIC streams (and TE-TCP connections) one large value is spread over.
    pub quic_streams: usize,
    /// Reuse the replica list of a GET for later GETs of the same key for this long
    /// (never beyond half the master's read lease); 0 = every GET asks the master.
    pub replica_cache_ms: u64,
    /// Serve the kv API over QUIC here (UDP `host:port`) for callers on other hosts;
    /// empty = off. Same certificate as `quic_listen`.
    pub api_quic_listen: String,
    /// PEM CA bundle; when set, QUIC API callers must present a certificate it issued.
    pub api_quic_client_ca: String,
}

impl Default for KvConfig {
    fn default() -> Self {
        KvConfig {
            listen: String::new(),
            unix_path: String::new(),
            metadata_url: String::new(),
            max_value_bytes: 256 << 20,
            max_batch_keys: 10_000,
            batch_part_bytes: 64 << 20,
            te_connections_per_peer: 4,
            timeout_ms: 30_000,
            tenant: "default".into(),
            max_inflight_bytes: 1 << 30,
            busy_wait_ms: 1_000,
            segment_bytes: 0,
            segment_listen: "127.0.0.1:0".into(),
            quic_listen: String::new(),
            quic_cert: String::new(),
            quic_key: String::new(),
            quic_client: true,
            replica_cache_ms: 0,
            api_quic_listen: String::new(),
            api_quic_client_ca: String::new(),
            quic_streams: 4,
        }
    }
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
        let kv = &self.kv;
        if !kv.listen.is_empty() {
            check_addr(&mut errs, "kv.listen", &kv.listen);
            if crate::upstream::MetricsUrl::parse(&kv.metadata_url).is_none() {
                errs.push(format!(
                    "kv.metadata_url: {:?} is not http://HOST:PORT/PATH (the kv face needs \
                     the metadata server to find segments)",
                    kv.metadata_url
                ));
            }
            positive(&mut errs, "kv.max_value_bytes", kv.max_value_bytes as u64);
            positive(&mut errs, "kv.max_batch_keys", kv.max_batch_keys as u64);
            positive(&mut errs, "kv.batch_part_bytes", kv.batch_part_bytes);
            positive(
                &mut errs,
                "kv.te_connections_per_peer",
                kv.te_connections_per_peer as u64,
            );
            positive(&mut errs, "kv.timeout_ms", kv.timeout_ms);
            if kv.max_inflight_bytes < 1024 {
                errs.push("kv.max_inflight_bytes: at least 1024".into());
            }
            if !kv.quic_listen.is_empty() {
                check_addr(&mut errs, "kv.quic_listen", &kv.quic_listen);
                if kv.segment_bytes == 0 {
                    errs.push(
                        "kv.quic_listen: serves the own segment; set kv.segment_bytes".into(),
                    );
                }
                if kv.quic_cert.is_empty() != kv.quic_key.is_empty() {
                    errs.push("kv.quic_cert and kv.quic_key: both or neither".into());
                }
            }
            positive(&mut errs, "kv.quic_streams", kv.quic_streams as u64);
            if kv.replica_cache_ms > 600_000 {
                errs.push(
                    "kv.replica_cache_ms: at most 600000 (it never outlives half the \
                           master's read lease anyway)"
                        .into(),
                );
            }
            if !kv.api_quic_listen.is_empty() {
                check_addr(&mut errs, "kv.api_quic_listen", &kv.api_quic_listen);
                if kv.quic_listen.is_empty() && kv.quic_cert.is_empty() != kv.quic_key.is_empty() {
                    errs.push("kv.quic_cert and kv.quic_key: both or neither".into());
                }
            } else if !kv.api_quic_client_ca.is_empty() {
                errs.push("kv.api_quic_client_ca: needs kv.api_quic_listen".into());
            }
            if kv.segment_bytes > 0 {
                check_addr(&mut errs, "kv.segment_listen", &kv.segment_listen);
                if kv.segment_bytes < (1 << 20) {
                    errs.push("kv.segment_bytes: 0 (none) or at least 1 MiB".into());
                }
            }
        } else if !kv.api_quic_listen.is_empty() || !kv.unix_path.is_empty() {
            errs.push(
                "kv.api_quic_listen and kv.unix_path serve the kv face: set kv.listen".into(),
            );
        }
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

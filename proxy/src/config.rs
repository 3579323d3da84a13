//! moongate's configuration: one strict TOML file, parsed once at start-up.
//!
//! Unknown keys are errors (`deny_unknown_fields`): a typo must not silently fall back
//! to a default. Every key has a default; `config/reference.toml` documents each one with
//! its reason, and a test keeps that file in step with [`Config::default`].

use std::path::Path;
use std::time::Duration;

use serde::Deserialize;
use thiserror::Error;

#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub master_face: MasterFaceConfig,
    pub admin: AdminConfig,
    pub shutdown: ShutdownConfig,
    pub log: LogConfig,
    pub runtime: RuntimeConfig,
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
        }
    }
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            listen: "127.0.0.1:9150".into(),
            ready_probe_interval_ms: 1_000,
            ready_probe_timeout_ms: 1_000,
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

fn positive(errs: &mut Vec<String>, key: &str, v: u64) {
    if v == 0 {
        errs.push(format!("{key}: must be greater than 0"));
    }
}

/// `host:port` with a numeric port; the host may be a name (resolved when used).
fn check_addr(errs: &mut Vec<String>, key: &str, v: &str) {
    let ok = v
        .rsplit_once(':')
        .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok());
    if !ok {
        errs.push(format!("{key}: {v:?} is not HOST:PORT"));
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
        let text = include_str!("../../config/reference.toml");
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

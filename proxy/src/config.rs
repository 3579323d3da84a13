//! moongate's configuration: one strict TOML file, parsed once at start-up. Each part
//! owns its section and its validation ([`MasterFaceConfig`], [`PolicyConfig`],
//! [`KvConfig`], [`EvictionConfig`], [`AdminConfig`]); this file composes them and holds
//! the process-wide sections (shutdown, log, runtime).
//!
//! Unknown keys are errors (`deny_unknown_fields`): a typo must not silently fall back
//! to a default. Every key has a default; `config/reference.toml` documents each one with
//! its reason, and a test keeps that file in step with [`Config::default`].

use std::path::Path;

use serde::Deserialize;
use thiserror::Error;

pub use crate::admin::AdminConfig;
pub use crate::eviction::config::EvictionConfig;
pub use crate::kv::config::KvConfig;
pub use crate::master_face::config::{MasterFaceConfig, Reencode};
pub use crate::policy::config::{PluginSpec, PolicyConfig, RollbackConfig};
use crate::validate::positive;

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
    pub events: crate::events::EventsConfig,
    pub kv: KvConfig,
    pub fleet: crate::fleet::FleetConfig,
    pub hints: crate::hints::HintsConfig,
    pub owner_face: crate::owner_face::OwnerFaceConfig,
    /// An experiment to start with (instead of `policy.active`).
    pub experiment: Option<crate::policy::experiment::ExperimentSpec>,
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
    /// Reads and validates a file (what `check-config` does).
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let cfg = Config::read(path)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads a file without validating it: for `run`, whose flags override the file and
    /// may supply what it leaves out (`--kv` for a file that sets `kv.unix_path`), so
    /// the result is validated after they are applied.
    pub fn read(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.display().to_string(),
            message: e.to_string(),
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
        self.master_face.validate(&mut errs);
        self.admin.validate(&mut errs);
        positive(
            &mut errs,
            "runtime.worker_threads",
            self.runtime.worker_threads as u64,
        );
        self.kv.validate(&mut errs);
        self.eviction.validate(&mut errs);
        self.events.validate(&mut errs);
        self.hints.validate(&mut errs);
        self.owner_face.validate(&mut errs);
        self.fleet
            .validate(&mut errs, self.master_face.upstream_etcd().as_deref());
        // Records refused for want of a token would leave the keys homed elsewhere in no
        // member's table: say so at start instead.
        let admin_on_loopback = self
            .admin
            .listen
            .parse::<std::net::SocketAddr>()
            .is_ok_and(|a| a.ip().is_loopback());
        if self.fleet.enabled
            && self.fleet.records
            && self.admin.token.is_empty()
            && !admin_on_loopback
        {
            errs.push(format!(
                "fleet.records: the admin endpoint ({}) is not on loopback, so the members' \
                 access records need admin.token (the same on every member); or set \
                 fleet.records = false",
                self.admin.listen
            ));
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
    fn fleet_records_off_loopback_need_a_token() {
        let fleet = "[fleet]\nenabled = true\netcd = \"127.0.0.1:2379\"\n";
        let open = format!("{fleet}[admin]\nlisten = \"0.0.0.0:9150\"\n");
        let e = Config::parse(&open).unwrap_err().to_string();
        assert!(
            e.contains("fleet.records") && e.contains("admin.token"),
            "{e}"
        );
        for ok in [
            format!("{open}token = \"s3cret\"\n"),
            format!("{fleet}records = false\n[admin]\nlisten = \"0.0.0.0:9150\"\n"),
            fleet.to_string(),
        ] {
            Config::parse(&ok).unwrap();
        }
    }

    #[test]
    fn unknown_keys_are_refused() {
        let e = Config::parse("[master_face]\nlisten_addr = \"x:1\"\n").unwrap_err();
        assert!(e.to_string().contains("unknown field `listen_addr`"), "{e}");
    }

    #[test]
    fn transfer_lanes_and_stripes_are_bounded() {
        let kv = "[kv]\nlisten = \"127.0.0.1:9200\"\nmetadata_url = \"http://127.0.0.1:8080/metadata\"\n";
        let e = Config::parse(&format!(
            "{kv}te_connections_per_peer = 65\nte_stripe_bytes = 1000\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("kv.te_connections_per_peer") && e.contains("kv.te_stripe_bytes"),
            "{e}"
        );
        for ok in [
            "te_connections_per_peer = 64\nte_stripe_bytes = 0\n",
            "te_stripe_bytes = 65536\n",
        ] {
            Config::parse(&format!("{kv}{ok}")).unwrap();
        }
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

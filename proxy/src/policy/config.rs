//! The `[policy]` section: which plugin serves, and the limits every plugin call runs
//! under. Owned here so that the policy layer never imports the process-wide config
//! (`crate::config` composes this section, not the other way round).

use serde::Deserialize;

/// What a failed plugin call (trap, timeout, out of memory, invalid answer) means.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FailMode {
    /// Mooncake's own behaviour: forward the call unchanged.
    Open,
    /// Deny the call with the configured error code.
    Closed,
}

/// Policy plugins: which one serves, and the limits every plugin call runs under.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyConfig {
    /// The plugin that decides when no experiment runs; `default` is embedded.
    pub active: String,
    /// What a failed plugin call (trap, timeout, out of memory, invalid answer) means:
    /// `open` = Mooncake's own behaviour, `closed` = deny with `fail_closed_code`.
    pub fail_mode: FailMode,
    /// ErrorCode of fail-closed denials; -200 (NO_AVAILABLE_HANDLE) is what vLLM treats
    /// as backpressure.
    pub fail_closed_code: i32,
    /// Deadline of one hook call: a call is stopped between this and a quarter of it
    /// more (the epoch ticks a quarter of it).
    pub call_timeout_ms: u64,
    /// Linear memory one plugin instance may use.
    pub memory_limit_bytes: u64,
    /// Plugin instances alive at once (loaded generations, last-good, experiment arms).
    pub max_instances: u32,
    /// Directory watched for `NAME.wasm` files to load (empty: no watching).
    pub watch_dir: String,
    pub watch_interval_ms: u64,
    pub rollback: RollbackConfig,
    /// Plugins to load at start-up and their configs.
    pub plugins: Vec<PluginSpec>,
    /// Minisign public keys (each the base64 line of a `minisign.pub`, `RW...`). Set:
    /// every plugin from a file, the watched directory, the admin API or a registry needs
    /// a valid minisign signature by one of them (the embedded default is exempt).
    /// Empty: signatures are not checked.
    pub trusted_keys: Vec<String>,
    /// Registries (`HOST[:PORT]`) that may be reached over plain HTTP when HTTPS fails;
    /// loopback registries always may. HTTPS is always tried first.
    pub insecure_registries: Vec<String>,
    /// Docker-style credentials (`config.json` with `auths`). Empty:
    /// `$DOCKER_CONFIG/config.json`, else `~/.docker/config.json`, when present.
    pub registry_auth_file: String,
    /// This sidecar's name for `[experiment] assign = "member"`: not a key of `[policy]`
    /// but `fleet.member`, copied here at start.
    #[serde(skip)]
    pub member: String,
    /// Largest plugin component accepted: registry pulls check the manifest before
    /// downloading; uploads are cut off.
    pub max_plugin_bytes: u64,
    /// Deadline of one registry pull.
    pub pull_timeout_ms: u64,
}

/// Automatic return to the last-good policy after a bad activation.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RollbackConfig {
    /// How long after an activation its failures are watched.
    pub window_ms: u64,
    /// Calls needed before a verdict.
    pub min_calls: u64,
    /// Share of failed plugin calls (trap, timeout, oom, invalid) that triggers rollback.
    pub max_failure_ratio: f64,
}

/// A plugin to load.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PluginSpec {
    /// Catalog name; `default` configures the embedded plugin.
    pub name: String,
    /// Component file; without it (and without `from`) only the config applies (for
    /// `default`, or for a plugin that arrives later by the admin API or the watched
    /// directory). With `policy.trusted_keys`, `PATH.minisig` must sign it.
    pub path: Option<String>,
    /// Or an OCI reference, `oci://HOST[:PORT]/REPO(:TAG|@sha256:DIGEST)`, pulled at
    /// start-up (a tag resolves to a digest once, shown in `GET /plugins`).
    #[serde(default)]
    pub from: Option<String>,
    /// Refuse the file unless its sha256 (hex) matches.
    pub sha256: Option<String>,
    /// Config handed to the plugin's `configure` (usually JSON).
    #[serde(default)]
    pub config: String,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            active: "default".into(),
            fail_mode: FailMode::Open,
            fail_closed_code: -200,
            call_timeout_ms: 10,
            memory_limit_bytes: 16 << 20,
            max_instances: 64,
            watch_dir: String::new(),
            watch_interval_ms: 1_000,
            rollback: RollbackConfig::default(),
            plugins: Vec::new(),
            trusted_keys: Vec::new(),
            insecure_registries: Vec::new(),
            registry_auth_file: String::new(),
            member: String::new(),
            max_plugin_bytes: 32 << 20,
            pull_timeout_ms: 30_000,
        }
    }
}

impl Default for RollbackConfig {
    fn default() -> Self {
        RollbackConfig {
            window_ms: 30_000,
            min_calls: 20,
            max_failure_ratio: 0.05,
        }
    }
}

impl PolicyConfig {
    /// How registries are reached, from this section.
    pub fn oci_settings(&self) -> crate::supply::oci::Settings {
        crate::supply::oci::Settings {
            insecure: self.insecure_registries.clone(),
            auth_file: crate::supply::credentials::auth_file(&self.registry_auth_file),
            max_bytes: self.max_plugin_bytes,
            timeout: std::time::Duration::from_millis(self.pull_timeout_ms),
        }
    }

    /// The config string of plugin `name` (empty when it has none).
    pub fn plugin_config(&self, name: &str) -> String {
        self.plugins
            .iter()
            .find(|p| p.name == name)
            .map(|p| p.config.clone())
            .unwrap_or_default()
    }

    /// Appends every problem of this section to `errs`; `experiment_plugins` are the
    /// plugins an `[experiment]` names (they must be loadable too).
    pub fn validate<'a>(
        &self,
        errs: &mut Vec<String>,
        experiment_plugins: impl Iterator<Item = (&'a str, &'a str)>,
    ) {
        use crate::validate::positive;
        positive(errs, "policy.call_timeout_ms", self.call_timeout_ms);
        positive(errs, "policy.max_instances", u64::from(self.max_instances));
        positive(errs, "policy.watch_interval_ms", self.watch_interval_ms);
        if self.memory_limit_bytes < (1 << 20) {
            errs.push("policy.memory_limit_bytes: must be at least 1 MiB".into());
        }
        if self.fail_closed_code >= 0 {
            errs.push("policy.fail_closed_code: must be a negative Mooncake ErrorCode".into());
        }
        if !(0.0..=1.0).contains(&self.rollback.max_failure_ratio) {
            errs.push("policy.rollback.max_failure_ratio: must be within [0, 1]".into());
        }
        let mut seen = std::collections::HashSet::new();
        for spec in &self.plugins {
            if !seen.insert(spec.name.as_str()) {
                errs.push(format!("policy.plugins: {:?} is listed twice", spec.name));
            }
            if spec.name == "default" && spec.path.is_some() {
                errs.push("policy.plugins: `default` is embedded; it takes no path".into());
            }
            if spec.path.is_some() && spec.from.is_some() {
                errs.push(format!(
                    "policy.plugins.{}: give `path` or `from`, not both",
                    spec.name
                ));
            }
            if let Some(from) = &spec.from
                && let Err(e) = crate::supply::oci::parse(from)
            {
                errs.push(format!("policy.plugins.{}.from: {e}", spec.name));
            }
            if let Some(path) = &spec.path
                && !std::path::Path::new(path).is_file()
            {
                errs.push(format!(
                    "policy.plugins.{}: {path:?} is not a file",
                    spec.name
                ));
            }
        }
        positive(errs, "policy.max_plugin_bytes", self.max_plugin_bytes);
        positive(errs, "policy.pull_timeout_ms", self.pull_timeout_ms);
        if let Err(e) = super::trust::Trust::new(&self.trusted_keys) {
            errs.push(format!("policy.trusted_keys: {e}"));
        }
        let known = |n: &str| n == "default" || self.plugins.iter().any(|s| s.name == n);
        if !known(&self.active) {
            errs.push(format!("policy.active: no plugin named {:?}", self.active));
        }
        for (arm, plugin) in experiment_plugins {
            if !known(plugin) {
                errs.push(format!("experiment.arms.{arm}: no plugin named {plugin:?}"));
            }
        }
    }
}

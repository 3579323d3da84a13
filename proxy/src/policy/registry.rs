//! The handle the faces and the admin endpoint hold: the [`Catalog`] of loaded plugins,
//! the [`Active`] set with swap and rollback, experiments, and the engine that loads new
//! plugins. The calls that decide on traffic are in [`super::decision`].

use std::sync::Arc;

use thiserror::Error;

use super::Policy;
use super::active::{Active, ActiveSet, Arm};
use super::catalog::{Catalog, PluginInfo, hex_sha};
use super::config::PolicyConfig;
use super::experiment::{Assign, ExperimentSpec, valid_name};
use super::host::{HostLimits, LoadError, PolicyEngine};
use super::metrics::PolicyFamilies;

/// The policy moongate embeds: Mooncake's behaviour unchanged.
pub const DEFAULT_PLUGIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/default.wasm"));

/// A plugin component that `build.rs` built from this checkout's `plugins/`
/// (`target/plugins/NAME.wasm`): for the tests, benchmarks and tools of the checkout.
pub fn built_plugin(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("MOONGATE_PLUGIN_DIR")).join(format!("{name}.wasm"))
}

#[derive(Debug, Error)]
pub enum RegistryError {
    #[error("{0}")]
    Load(#[from] LoadError),
    #[error("no plugin named {0:?} is loaded")]
    UnknownPlugin(String),
    #[error("invalid experiment: {0}")]
    BadExperiment(String),
    #[error("there is no last-good policy set to roll back to")]
    NoLastGood,
    #[error("cannot read {path}: {error}")]
    Read { path: String, error: std::io::Error },
    #[error("invalid plugin name {0:?}: use 1-64 characters of [A-Za-z0-9._-]")]
    BadName(String),
    #[error("this registry has no plugin engine (it was built from given policies)")]
    NoEngine,
    #[error("plugin {name:?} refused: {error}")]
    Untrusted {
        name: String,
        error: super::trust::TrustError,
    },
    #[error("policy.trusted_keys: {0}")]
    BadKeys(String),
    #[error("{0}")]
    Pull(String),
}

/// Where a plugin's bytes came from and the signature that came with them.
#[derive(Debug, Clone, Default)]
pub struct Origin {
    /// `file:PATH`, `oci://HOST/REPO@sha256:...`, `upload`; shown in `GET /plugins`.
    pub source: Option<String>,
    /// The text of a `.minisig` file (a minisign signature of the bytes).
    pub signature: Option<String>,
}

impl Origin {
    /// A component file, with the signature beside it (`PATH.minisig`) when present.
    pub fn file(path: &std::path::Path) -> Origin {
        let mut sig = path.as_os_str().to_owned();
        sig.push(".minisig");
        Origin {
            source: Some(format!("file:{}", path.display())),
            signature: std::fs::read_to_string(sig).ok(),
        }
    }
}

/// What the faces hold: the policies and how to call them.
pub struct Registry {
    /// Loads components; `None` for a registry built from given policies (tests).
    engine: Option<Arc<PolicyEngine>>,
    pub(super) cfg: PolicyConfig,
    pub(super) metrics: Arc<PolicyFamilies>,
    catalog: Catalog,
    pub(super) active: Active,
    /// `policy.trusted_keys`; empty: signatures are not checked.
    trust: super::trust::Trust,
    /// The watched directory's files as last tried: name -> (sha256, signature).
    scanned: std::sync::Mutex<std::collections::HashMap<String, (String, Option<String>)>>,
}

impl Registry {
    /// Loads the embedded default and every configured plugin, and activates
    /// `policy.active` or `[experiment]`. A configured plugin that fails pre-flight is
    /// an error: better not to start than to run a policy nobody chose.
    pub fn new(
        cfg: PolicyConfig,
        experiment: Option<ExperimentSpec>,
        metrics: Arc<PolicyFamilies>,
    ) -> Result<Arc<Registry>, RegistryError> {
        Registry::new_with(cfg, experiment, metrics, Vec::new())
    }

    /// As [`Registry::new`], with plugins whose bytes the caller fetched (the configured
    /// `from = "oci://..."` ones: pulling is not this layer's business), by name.
    pub fn new_with(
        cfg: PolicyConfig,
        experiment: Option<ExperimentSpec>,
        metrics: Arc<PolicyFamilies>,
        fetched: Vec<(String, Vec<u8>, Origin)>,
    ) -> Result<Arc<Registry>, RegistryError> {
        let engine = PolicyEngine::new(
            HostLimits {
                call_timeout: std::time::Duration::from_millis(cfg.call_timeout_ms),
                memory_bytes: cfg.memory_limit_bytes as usize,
                max_instances: cfg.max_instances,
            },
            metrics.plugins.clone(),
        )?;
        let default = engine.load(
            "default",
            DEFAULT_PLUGIN,
            cfg.plugin_config("default").as_bytes(),
            None,
        )?;
        let reg = Registry::assemble(cfg, metrics, Some(engine), vec![default])?;
        for spec in reg.cfg.plugins.clone() {
            if let Some(path) = &spec.path {
                let bytes = std::fs::read(path).map_err(|error| RegistryError::Read {
                    path: path.clone(),
                    error,
                })?;
                let origin = Origin::file(std::path::Path::new(path));
                reg.load_from(&spec.name, &bytes, spec.sha256.as_deref(), &origin)?;
            }
        }
        for (name, bytes, origin) in fetched {
            // Pulled before the registry existed: counted now.
            reg.count_pull(true);
            let pin = reg
                .cfg
                .plugins
                .iter()
                .find(|p| p.name == name)
                .and_then(|p| p.sha256.clone());
            reg.load_from(&name, &bytes, pin.as_deref(), &origin)?;
        }
        reg.start(experiment)?;
        Ok(reg)
    }

    /// A registry over policies given as values (no engine: nothing more can be loaded
    /// from bytes). The first one serves unless `policy.active` or `experiment` names
    /// others. This is how the faces are tested without wasm.
    pub fn with_policies(
        cfg: PolicyConfig,
        experiment: Option<ExperimentSpec>,
        metrics: Arc<PolicyFamilies>,
        policies: Vec<Arc<dyn Policy>>,
    ) -> Result<Arc<Registry>, RegistryError> {
        let first = policies.first().map(|p| p.name().to_string());
        let mut cfg = cfg;
        if let Some(first) = first
            && !policies.iter().any(|p| p.name() == cfg.active)
        {
            cfg.active = first;
        }
        let reg = Registry::assemble(cfg, metrics, None, policies)?;
        reg.start(experiment)?;
        Ok(reg)
    }

    fn assemble(
        cfg: PolicyConfig,
        metrics: Arc<PolicyFamilies>,
        engine: Option<Arc<PolicyEngine>>,
        policies: Vec<Arc<dyn Policy>>,
    ) -> Result<Arc<Registry>, RegistryError> {
        let active = Active::new().map_err(|e| RegistryError::Read {
            path: "reaper thread".into(),
            error: e,
        })?;
        let trust = super::trust::Trust::new(&cfg.trusted_keys).map_err(RegistryError::BadKeys)?;
        let reg = Registry {
            engine,
            cfg,
            metrics,
            catalog: Catalog::default(),
            active,
            trust,
            scanned: Default::default(),
        };
        for p in policies {
            reg.catalog.insert(p);
        }
        Ok(Arc::new(reg))
    }

    fn start(&self, experiment: Option<ExperimentSpec>) -> Result<(), RegistryError> {
        match experiment {
            Some(exp) => self.set_experiment(exp)?,
            None => self.activate(&self.cfg.active.clone())?,
        };
        self.active.clear_last_good();
        Ok(())
    }

    /// Pre-flights `bytes` as plugin `name` and adds it to the catalog (replacing a
    /// loaded one of that name, which keeps serving until an activation). Blocking:
    /// compilation takes tens of milliseconds; call it off the async runtime.
    pub fn load(
        &self,
        name: &str,
        bytes: &[u8],
        sha256: Option<&str>,
    ) -> Result<PluginInfo, RegistryError> {
        self.load_from(name, bytes, sha256, &Origin::default())
    }

    /// As [`Registry::load`], for bytes from `origin`. With `policy.trusted_keys` set,
    /// the origin's signature must be a trusted key's over these exact bytes; a refused
    /// plugin is recorded as rejected and counted, and the active one stays.
    pub fn load_from(
        &self,
        name: &str,
        bytes: &[u8],
        sha256: Option<&str>,
        origin: &Origin,
    ) -> Result<PluginInfo, RegistryError> {
        if !valid_name(name) {
            return Err(RegistryError::BadName(name.to_string()));
        }
        let engine = self.engine.as_ref().ok_or(RegistryError::NoEngine)?;
        let signed_by = if self.trust.is_empty() {
            None
        } else {
            match self.trust.check(bytes, origin.signature.as_deref()) {
                Ok(key) => Some(key.to_string()),
                Err(error) => {
                    let i = super::trust::TRUST_REASONS
                        .iter()
                        .position(|r| *r == error.reason())
                        .unwrap_or(0);
                    self.metrics.signature_refusals[i].inc();
                    tracing::warn!(plugin = name, source = ?origin.source, error = %error,
                        "plugin refused: signature");
                    self.catalog.reject(
                        name,
                        hex_sha(bytes),
                        error.to_string(),
                        origin.source.clone(),
                    );
                    return Err(RegistryError::Untrusted {
                        name: name.to_string(),
                        error,
                    });
                }
            }
        };
        let config = self.cfg.plugin_config(name);
        match engine.load(name, bytes, config.as_bytes(), sha256) {
            Ok(p) => {
                tracing::info!(plugin = name, sha256 = %p.sha256, source = ?origin.source,
                    signed_by = ?signed_by, interest = ?p.interest(), "plugin loaded");
                self.catalog
                    .insert_from(p, origin.source.clone(), signed_by);
                Ok(self.info(name).expect("just inserted"))
            }
            Err(e) => {
                tracing::warn!(plugin = name, error = %e, "plugin rejected");
                self.catalog
                    .reject(name, hex_sha(bytes), e.to_string(), origin.source.clone());
                Err(e.into())
            }
        }
    }

    /// Whether `name` is the sole active policy (no experiment): a new version of it
    /// from the watched directory or a registry is activated at once.
    pub fn is_sole_active(&self, name: &str) -> bool {
        let cur = self.current();
        cur.experiment.is_none() && cur.arms.first().is_some_and(|a| a.plugin.name() == name)
    }

    /// `policy.max_plugin_bytes`, for uploads.
    pub fn max_plugin_bytes(&self) -> usize {
        usize::try_from(self.cfg.max_plugin_bytes).unwrap_or(usize::MAX)
    }

    /// How registries are reached (from `[policy]`).
    pub fn oci_settings(&self) -> crate::supply::oci::Settings {
        self.cfg.oci_settings()
    }

    /// Counts a registry pull.
    pub fn count_pull(&self, ok: bool) {
        self.metrics.pulls[usize::from(!ok)].inc();
    }

    fn plugin(&self, name: &str) -> Result<Arc<dyn Policy>, RegistryError> {
        self.catalog
            .get(name)
            .ok_or_else(|| RegistryError::UnknownPlugin(name.to_string()))
    }

    fn arm(&self, name: &str, plugin: Arc<dyn Policy>, weight: u64) -> Arm {
        Arm::new(name, plugin, weight, &self.metrics)
    }

    /// Makes `name` the only policy (ends any experiment).
    pub fn activate(&self, name: &str) -> Result<u64, RegistryError> {
        let arm = self.arm(name, self.plugin(name)?, 1);
        let g = self.active.swap_in(
            ActiveSet::new(vec![arm], 0, Assign::Client, None),
            &self.metrics,
        );
        tracing::info!(plugin = name, generation = g, "policy activated");
        Ok(g)
    }

    /// Starts (or replaces) an experiment; an empty arm list ends it and keeps the
    /// control arm's plugin as the only policy.
    pub fn set_experiment(&self, spec: ExperimentSpec) -> Result<u64, RegistryError> {
        if spec.arms.is_empty() {
            let cur = self.current();
            let keep = cur
                .arms
                .get(cur.control)
                .map(|a| a.plugin.name().to_string());
            return self.activate(keep.as_deref().unwrap_or("default"));
        }
        let control = spec.check().map_err(RegistryError::BadExperiment)?;
        if spec.assign == Assign::Member && self.cfg.member.is_empty() {
            return Err(RegistryError::BadExperiment(
                "assign = \"member\" needs fleet.member: this sidecar's stable name".into(),
            ));
        }
        let arms = spec
            .arms
            .iter()
            .map(|a| Ok(self.arm(&a.name, self.plugin(&a.plugin)?, u64::from(a.weight))))
            .collect::<Result<Vec<_>, RegistryError>>()?;
        let mut set = ActiveSet::new(arms, control, spec.assign, Some(spec));
        set.member = super::experiment::fnv1a(self.cfg.member.as_bytes());
        let generation = self.active.swap_in(set, &self.metrics);
        tracing::info!(generation, "experiment started");
        Ok(generation)
    }

    /// Returns to the last-good set.
    pub fn rollback(&self, why: &str) -> Result<u64, RegistryError> {
        let generation = self
            .active
            .rollback(&self.metrics)
            .ok_or(RegistryError::NoLastGood)?;
        tracing::warn!(generation, reason = why, "policy rolled back to last-good");
        Ok(generation)
    }

    /// The set in force; hold it for the whole call.
    pub fn current(&self) -> Arc<ActiveSet> {
        self.active.current()
    }

    pub fn info(&self, name: &str) -> Option<PluginInfo> {
        self.list().into_iter().find(|p| p.name == name)
    }

    /// `GET /plugins`.
    pub fn list(&self) -> Vec<PluginInfo> {
        let last = self.active.last_good();
        self.catalog.list(&self.current(), last.as_deref())
    }

    /// Loads every `*.wasm` in `dir` whose bytes changed since the last look; a plugin
    /// that is the sole active policy is re-activated with its new version.
    pub fn scan_dir(&self, dir: &std::path::Path) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let path = e.path();
            if path.extension().is_none_or(|x| x != "wasm") {
                continue;
            }
            let Some(name) = path.file_stem().map(|s| s.to_string_lossy().into_owned()) else {
                continue;
            };
            let Ok(bytes) = std::fs::read(&path) else {
                continue;
            };
            let origin = Origin::file(&path);
            // Tried already with these bytes and this signature: a component copied
            // before its `.minisig` is tried again once the signature arrives.
            let attempt = (hex_sha(&bytes), origin.signature.clone());
            {
                let mut seen = self.scanned.lock().unwrap_or_else(|p| p.into_inner());
                if seen.get(&name) == Some(&attempt)
                    || (!seen.contains_key(&name)
                        && self.catalog.sha256(&name).as_deref() == Some(attempt.0.as_str()))
                {
                    seen.insert(name.clone(), attempt);
                    continue;
                }
                seen.insert(name.clone(), attempt);
            }
            let pin = self
                .cfg
                .plugins
                .iter()
                .find(|p| p.name == name)
                .and_then(|p| p.sha256.clone());
            if self
                .load_from(&name, &bytes, pin.as_deref(), &origin)
                .is_ok()
                && self.is_sole_active(&name)
            {
                let _ = self.activate(&name);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! The registry over fake policies: activation, the catalog's states, rollback.

    use super::*;
    use crate::metrics::Metrics;
    use crate::policy::fake::Fake;

    fn registry() -> Arc<Registry> {
        let a: Arc<dyn Policy> = Arc::new(Fake::new("a"));
        let b: Arc<dyn Policy> = Arc::new(Fake::new("b"));
        Registry::with_policies(
            PolicyConfig::default(),
            None,
            Metrics::new().policy.clone(),
            vec![a, b],
        )
        .unwrap()
    }

    fn state(r: &Registry, name: &str) -> String {
        r.info(name).unwrap().state
    }

    #[test]
    fn activation_rollback_and_the_catalog_states() {
        let r = registry();
        assert_eq!(r.current().arms[0].plugin.name(), "a");
        assert_eq!(
            (state(&r, "a").as_str(), state(&r, "b").as_str()),
            ("active", "loaded")
        );
        assert!(matches!(r.rollback("x"), Err(RegistryError::NoLastGood)));
        let g = r.activate("b").unwrap();
        assert_eq!(
            (state(&r, "a").as_str(), state(&r, "b").as_str()),
            ("last-good", "active")
        );
        assert!(
            r.rollback("test").unwrap() < g,
            "back to the earlier generation"
        );
        assert_eq!(r.current().arms[0].plugin.name(), "a");
        assert!(matches!(
            r.activate("nope"),
            Err(RegistryError::UnknownPlugin(_))
        ));
    }

    #[test]
    fn without_an_engine_bytes_cannot_be_loaded_and_names_are_checked_first() {
        let r = registry();
        assert!(matches!(
            r.load("ok-name", b"\0asm", None),
            Err(RegistryError::NoEngine)
        ));
        assert!(matches!(
            r.load("bad name!", b"", None),
            Err(RegistryError::BadName(_))
        ));
        assert_eq!(state(&r, "a"), "active", "nothing changed");
    }

    #[test]
    fn a_rejected_upload_never_replaces_a_working_plugin() {
        let r = registry();
        r.catalog.reject("a", "00".into(), "broken".into(), None);
        assert_eq!(state(&r, "a"), "active");
        r.catalog
            .reject("fresh", "11".into(), "broken".into(), None);
        let row = r.info("fresh").unwrap();
        assert_eq!(
            (row.state.as_str(), row.reason.as_deref()),
            ("rejected", Some("broken"))
        );
    }

    #[test]
    fn an_experiment_with_an_empty_arm_list_keeps_the_control_plugin() {
        use crate::policy::experiment::{ArmSpec, ExperimentSpec};
        let r = registry();
        let arm = |n: &str| ArmSpec {
            name: n.into(),
            plugin: n.into(),
            weight: 1,
        };
        r.set_experiment(ExperimentSpec {
            assign: Default::default(),
            control: Some("b".into()),
            arms: vec![arm("a"), arm("b")],
            guardrail: Default::default(),
            capacity: Default::default(),
        })
        .unwrap();
        assert_eq!(r.current().arms.len(), 2);
        r.set_experiment(ExperimentSpec {
            assign: Default::default(),
            control: None,
            arms: vec![],
            guardrail: Default::default(),
            capacity: Default::default(),
        })
        .unwrap();
        let cur = r.current();
        assert_eq!((cur.arms.len(), cur.arms[0].plugin.name()), (1, "b"));
    }

    #[test]
    fn arms_by_member_need_a_member_name_and_follow_it() {
        use crate::codec::types::Uuid;
        use crate::policy::experiment::{ArmSpec, ExperimentSpec, arm_for_hash, fnv1a};
        let spec = || ExperimentSpec {
            assign: Assign::Member,
            control: None,
            arms: ["a", "b"]
                .iter()
                .map(|n| ArmSpec {
                    name: (*n).into(),
                    plugin: (*n).into(),
                    weight: 1,
                })
                .collect(),
            guardrail: Default::default(),
            capacity: Default::default(),
        };
        let r = registry();
        let err = r.set_experiment(spec()).unwrap_err().to_string();
        assert!(err.contains("fleet.member"), "{err}");
        for member in ["rank0", "rank1", "rank2", "rank3"] {
            let r = Registry::with_policies(
                PolicyConfig {
                    member: member.into(),
                    ..PolicyConfig::default()
                },
                None,
                Metrics::new().policy.clone(),
                vec![Arc::new(Fake::new("a")), Arc::new(Fake::new("b"))],
            )
            .unwrap();
            r.set_experiment(spec()).unwrap();
            let want = arm_for_hash(fnv1a(member.as_bytes()), [1u64, 1].into_iter());
            let set = r.current();
            // Every client and key of this sidecar lands in its member's arm.
            for (first, key) in [(1, "x"), (2, "y"), (u64::MAX, "z")] {
                let client = Uuid { first, second: 0 };
                let key = bytes::Bytes::from_static(key.as_bytes());
                assert_eq!(set.pick(&client, Some(&key[..])), want, "{member}");
            }
        }
    }
}

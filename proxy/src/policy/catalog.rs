//! The plugins moongate has loaded: each passed pre-flight (compile, instantiate,
//! configure, conformance calls) or is recorded as rejected with its reason. A rejected
//! upload never replaces a working plugin of the same name.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use serde::Serialize;

use super::Policy;
use super::active::ActiveSet;

/// One row of `GET /plugins`.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct PluginInfo {
    pub name: String,
    pub sha256: String,
    /// `active`, `loaded`, `last-good` or `rejected`.
    pub state: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Where the bytes came from: `file:PATH`, `oci://HOST/REPO@sha256:...` (a tag
    /// resolved to its digest once, at pull), `upload` (the admin API's body).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// The trusted minisign key that signed it (with `policy.trusted_keys` set).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub signed_by: Option<String>,
}

struct Entry {
    plugin: Option<Arc<dyn Policy>>,
    sha256: String,
    rejected: Option<String>,
    source: Option<String>,
    signed_by: Option<String>,
}

/// Loaded and rejected plugins by name.
#[derive(Default)]
pub struct Catalog {
    entries: Mutex<BTreeMap<String, Entry>>,
}

impl Catalog {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Entry>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds (or replaces) a plugin that passed pre-flight.
    pub fn insert(&self, p: Arc<dyn Policy>) {
        self.insert_from(p, None, None);
    }

    /// As [`Catalog::insert`], with where the bytes came from and who signed them.
    pub fn insert_from(
        &self,
        p: Arc<dyn Policy>,
        source: Option<String>,
        signed_by: Option<String>,
    ) {
        self.lock().insert(
            p.name().to_string(),
            Entry {
                sha256: p.sha256().to_string(),
                plugin: Some(p),
                rejected: None,
                source,
                signed_by,
            },
        );
    }

    /// Records a rejected upload, unless a working plugin of that name is loaded.
    pub fn reject(&self, name: &str, sha256: String, reason: String, source: Option<String>) {
        let mut cat = self.lock();
        if cat.get(name).is_none_or(|e| e.plugin.is_none()) {
            cat.insert(
                name.to_string(),
                Entry {
                    plugin: None,
                    sha256,
                    rejected: Some(reason),
                    source,
                    signed_by: None,
                },
            );
        }
    }

    pub fn get(&self, name: &str) -> Option<Arc<dyn Policy>> {
        self.lock().get(name).and_then(|e| e.plugin.clone())
    }

    /// The sha256 recorded for `name` (loaded or rejected).
    pub fn sha256(&self, name: &str) -> Option<String> {
        self.lock().get(name).map(|e| e.sha256.clone())
    }

    /// Every plugin and its state relative to the set in force and the last-good one.
    pub fn list(&self, current: &ActiveSet, last_good: Option<&ActiveSet>) -> Vec<PluginInfo> {
        let in_set = |set: &ActiveSet, p: &Arc<dyn Policy>| {
            set.arms.iter().any(|a| Arc::ptr_eq(&a.plugin, p))
        };
        self.lock()
            .iter()
            .map(|(name, e)| {
                let state = match &e.plugin {
                    None => "rejected",
                    Some(p) if in_set(current, p) => "active",
                    Some(p) if last_good.is_some_and(|l| in_set(l, p)) => "last-good",
                    Some(_) => "loaded",
                };
                PluginInfo {
                    name: name.clone(),
                    sha256: e.sha256.clone(),
                    state: state.into(),
                    reason: e.rejected.clone(),
                    source: e.source.clone(),
                    signed_by: e.signed_by.clone(),
                }
            })
            .collect()
    }
}

/// Hex sha256 of `bytes`.
pub fn hex_sha(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

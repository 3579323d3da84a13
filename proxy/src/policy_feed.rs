//! What feeds the policy registry from outside the process: configured `from =
//! "oci://..."` plugins at start-up, the watched directory (`NAME.wasm` files, with
//! `NAME.wasm.minisig` signatures, and `NAME.oci` files naming a registry reference),
//! and the admin API's `POST /plugins?from=oci://...`. Composes [`crate::supply`]
//! (fetching bytes) with [`crate::policy::registry`] (checking and loading them); a
//! fetch that fails changes nothing.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::policy::registry::{Origin, Registry, RegistryError};
use crate::policy::{PolicyConfig, catalog::PluginInfo};
use crate::supply::oci;

/// Pulls a component and its signature into an [`Origin`] (source = the pinned
/// reference), counting the pull.
pub async fn pull(
    reference: &str,
    settings: &oci::Settings,
    registry: Option<&Registry>,
) -> Result<(Vec<u8>, Origin), oci::OciError> {
    let r = oci::pull(reference, settings).await;
    if let Some(reg) = registry {
        reg.count_pull(r.is_ok());
    }
    let p = r?;
    tracing::info!(reference, pinned = %p.pinned, bytes = p.bytes.len(),
        signed = p.signature.is_some(), "plugin pulled");
    Ok((
        p.bytes,
        Origin {
            source: Some(p.pinned),
            signature: p.signature,
        },
    ))
}

/// The configured plugins with `from`: pulled before the registry starts (a plugin
/// nobody can fetch is an error at start-up, like a missing file).
pub async fn pull_configured(
    cfg: &PolicyConfig,
) -> Result<Vec<(String, Vec<u8>, Origin)>, RegistryError> {
    let settings = cfg.oci_settings();
    let mut out = Vec::new();
    for spec in &cfg.plugins {
        if let Some(from) = &spec.from {
            let (bytes, origin) = pull(from, &settings, None)
                .await
                .map_err(|e| RegistryError::Pull(format!("policy.plugins.{}: {e}", spec.name)))?;
            out.push((spec.name.clone(), bytes, origin));
        }
    }
    Ok(out)
}

/// Pulls `reference` and loads it as `name` (off the async runtime). `upgrade`: when
/// `name` is the sole active policy, its new version is activated at once (the watched
/// directory's rule; the admin API loads and leaves activation to its own call).
pub async fn load_reference(
    registry: &Arc<Registry>,
    name: &str,
    reference: &str,
    pin: Option<String>,
    upgrade: bool,
) -> Result<PluginInfo, RegistryError> {
    let settings = registry.oci_settings();
    let (bytes, origin) = pull(reference, &settings, Some(registry))
        .await
        .map_err(|e| RegistryError::Pull(e.to_string()))?;
    let (reg, name) = (registry.clone(), name.to_string());
    tokio::task::spawn_blocking(move || {
        let info = reg.load_from(&name, &bytes, pin.as_deref(), &origin)?;
        if upgrade && reg.is_sole_active(&name) {
            reg.activate(&name)?;
        }
        Ok(info)
    })
    .await
    .map_err(|e| RegistryError::Pull(format!("loading task: {e}")))?
}

/// Watches `dir` every `every` until shutdown: component files through
/// [`Registry::scan_dir`], and `NAME.oci` files (one reference each, as a Kubernetes
/// ConfigMap key or a downward-API annotation file carries it) pulled whenever their
/// text changes. A failed pull is retried each interval and logged when its error
/// changes; refused bytes are not pulled again until the text changes; either way the
/// active plugin stays.
pub async fn watch(
    registry: Arc<Registry>,
    dir: PathBuf,
    every: Duration,
    shutdown: CancellationToken,
) {
    tracing::info!(dir = %dir.display(), "watching for plugins");
    // name -> (reference text, last error, whether to try it again): a failed pull is
    // retried each interval (the registry may come back); bytes refused for what they
    // are (signature, pre-flight) are not, until the reference changes.
    let mut tried: HashMap<String, (String, Option<String>, bool)> = HashMap::new();
    loop {
        let (r, d) = (registry.clone(), dir.clone());
        let _ = tokio::task::spawn_blocking(move || r.scan_dir(&d)).await;
        for (name, reference) in oci_files(&dir) {
            let done = tried
                .get(&name)
                .is_some_and(|(text, _, again)| *text == reference && !again);
            if done {
                continue;
            }
            let result = load_reference(&registry, &name, &reference, None, true).await;
            let err = result.as_ref().err().map(|e| e.to_string());
            let again = matches!(result, Err(RegistryError::Pull(_)));
            let repeated = tried
                .get(&name)
                .is_some_and(|(t, e, _)| *t == reference && *e == err);
            match (&result, repeated) {
                (Ok(info), _) => {
                    tracing::info!(plugin = %name, reference = %reference,
                        source = ?info.source, "watched reference loaded")
                }
                (Err(e), false) => {
                    tracing::warn!(plugin = %name, reference = %reference, error = %e,
                        "watched reference not loaded; the active plugin stays")
                }
                (Err(_), true) => {}
            }
            tried.insert(name, (reference, err, again));
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}

/// `NAME.oci` files in `dir` and the reference each holds (first non-empty line).
fn oci_files(dir: &Path) -> Vec<(String, String)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let path = e.path();
        // Kubernetes volumes show files through `..data` symlinks: follow them, skip
        // the hidden timestamped directories.
        if path.extension().is_none_or(|x| x != "oci")
            || path
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with('.'))
        {
            continue;
        }
        let Some(name) = path.file_stem().map(|s| s.to_string_lossy().into_owned()) else {
            continue;
        };
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        if let Some(line) = text.lines().map(str::trim).find(|l| !l.is_empty()) {
            out.push((name, line.to_string()));
        }
    }
    out.sort();
    out
}

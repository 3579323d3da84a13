//! Registry credentials from a Docker-style `config.json` (`docker login`, `podman
//! login --authfile`, a Kubernetes `kubernetes.io/dockerconfigjson` secret mounted as a
//! file): `{"auths": {"HOST[:PORT]": {"auth": base64("user:password")}}}`, or
//! `username` / `password` fields. Credential helpers are not run.

use std::path::{Path, PathBuf};

use serde::Deserialize;

#[derive(Debug, Deserialize, Default)]
struct DockerConfig {
    #[serde(default)]
    auths: std::collections::BTreeMap<String, AuthEntry>,
}

#[derive(Debug, Deserialize, Default)]
struct AuthEntry {
    auth: Option<String>,
    username: Option<String>,
    password: Option<String>,
}

/// A user name and password for one registry.
#[derive(Clone, PartialEq, Eq)]
pub struct Basic {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for Basic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the password, not even in a debug log.
        f.debug_struct("Basic")
            .field("username", &self.username)
            .finish_non_exhaustive()
    }
}

/// The file to read: `configured` if set, else `$DOCKER_CONFIG/config.json`, else
/// `$HOME/.docker/config.json`, when it exists.
pub fn auth_file(configured: &str) -> Option<PathBuf> {
    if !configured.is_empty() {
        return Some(PathBuf::from(configured));
    }
    let candidates = [
        std::env::var_os("DOCKER_CONFIG").map(|d| PathBuf::from(d).join("config.json")),
        std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".docker/config.json")),
    ];
    candidates.into_iter().flatten().find(|p| p.is_file())
}

/// The credentials for `registry` (`HOST[:PORT]`) in `file`, if any. A missing file
/// means anonymous access; an unreadable or malformed one is an error (better than
/// pulling anonymously and failing with a confusing 401).
pub fn lookup(file: Option<&Path>, registry: &str) -> Result<Option<Basic>, String> {
    let Some(file) = file else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
    let cfg: DockerConfig =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", file.display()))?;
    let entry = cfg.auths.iter().find(|(k, _)| {
        let k = k
            .trim_start_matches("https://")
            .trim_start_matches("http://")
            .trim_end_matches('/');
        k == registry || k.strip_suffix("/v1").or(k.strip_suffix("/v2")) == Some(registry)
    });
    let Some((_, e)) = entry else {
        return Ok(None);
    };
    if let (Some(u), Some(p)) = (&e.username, &e.password) {
        return Ok(Some(Basic {
            username: u.clone(),
            password: p.clone(),
        }));
    }
    let Some(auth) = &e.auth else {
        return Ok(None);
    };
    let raw = decode_base64(auth.trim())
        .ok_or_else(|| format!("{}: auth for {registry} is not base64", file.display()))?;
    let s = String::from_utf8(raw)
        .map_err(|_| format!("{}: auth for {registry} is not UTF-8", file.display()))?;
    let (u, p) = s.split_once(':').ok_or_else(|| {
        format!(
            "{}: auth for {registry} is not user:password",
            file.display()
        )
    })?;
    Ok(Some(Basic {
        username: u.to_string(),
        password: p.to_string(),
    }))
}

/// Standard base64, padded or not (Docker writes it padded; some tools do not).
pub fn decode_base64(s: &str) -> Option<Vec<u8>> {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD_NO_PAD
        .decode(s.trim_end_matches('='))
        .ok()
}

/// Standard base64 with padding.
pub fn encode_base64(b: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trips() {
        for s in ["", "a", "ab", "abc", "user:pa:ss", "\u{0}\u{ff}x"] {
            let e = encode_base64(s.as_bytes());
            assert_eq!(decode_base64(&e).unwrap(), s.as_bytes(), "{e}");
        }
        assert_eq!(encode_base64(b"user:pass"), "dXNlcjpwYXNz");
        assert!(decode_base64("a*b=").is_none());
    }

    #[test]
    fn docker_config_entries_are_found_by_registry() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("config.json");
        std::fs::write(
            &f,
            r#"{"auths": {"https://reg.example:5000/v2/": {"auth": "dXNlcjpwYXNz"},
                          "other.example": {"username": "u", "password": "p"}}}"#,
        )
        .unwrap();
        let b = lookup(Some(&f), "reg.example:5000").unwrap().unwrap();
        assert_eq!((b.username.as_str(), b.password.as_str()), ("user", "pass"));
        assert_eq!(
            lookup(Some(&f), "other.example").unwrap().unwrap().username,
            "u"
        );
        assert!(lookup(Some(&f), "nowhere").unwrap().is_none());
        assert!(!format!("{b:?}").contains("pass"));
        std::fs::write(&f, "not json").unwrap();
        assert!(lookup(Some(&f), "x").is_err());
    }
}

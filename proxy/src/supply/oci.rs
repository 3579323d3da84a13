//! Plugins as OCI artifacts in the CNCF Wasm layout (config media type
//! `application/vnd.wasm.config.v0+json`, one `application/wasm` layer), pulled and
//! pushed with `oci-client` and `oci-wasm`.
//!
//! A reference is `oci://HOST[:PORT]/REPOSITORY(:TAG|@sha256:DIGEST)`. A pull resolves a
//! tag to the manifest's digest once and returns the pinned form
//! (`oci://HOST/REPO@sha256:...`), which is what moongate records and shows; the layer's
//! size is checked against the cap before a byte of it is fetched, and the fetched bytes
//! against the layer's digest. HTTPS first, always; plain HTTP after it only for
//! loopback registries and those an operator lists as insecure. A signature (the text of a `.minisig` file) travels as
//! the manifest annotation [`SIGNATURE_ANNOTATION`], base64-encoded.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use oci_wasm::{WasmClient, WasmConfig};
use sha2::{Digest, Sha256};
use thiserror::Error;

use super::credentials;

/// The manifest annotation carrying a minisign signature of the component's bytes.
pub const SIGNATURE_ANNOTATION: &str = "dev.moongate.plugin.minisig";

/// How moongate talks to registries (from `[policy]`).
#[derive(Debug, Clone)]
pub struct Settings {
    /// `HOST[:PORT]` registries that may be reached over plain HTTP when HTTPS fails
    /// (loopback ones always may).
    pub insecure: Vec<String>,
    /// A Docker-style `config.json`; `None`: anonymous.
    pub auth_file: Option<PathBuf>,
    /// Largest component accepted, checked against the manifest before downloading.
    pub max_bytes: u64,
    /// Deadline of a whole pull or push.
    pub timeout: Duration,
}

#[derive(Debug, Error)]
pub enum OciError {
    #[error("{0:?} is not oci://HOST[:PORT]/REPOSITORY(:TAG|@sha256:DIGEST)")]
    BadReference(String),
    #[error("{reference}: {message}")]
    Registry { reference: String, message: String },
    #[error("{reference}: cannot fetch a Wasm component artifact: {message}")]
    NotWasm { reference: String, message: String },
    #[error(
        "{reference}: the component is {size} bytes, over the cap of {max} (policy.max_plugin_bytes)"
    )]
    TooLarge {
        reference: String,
        size: i64,
        max: u64,
    },
    #[error("{reference}: digest mismatch: asked for or announced {expected}, got {actual}")]
    DigestMismatch {
        reference: String,
        expected: String,
        actual: String,
    },
    #[error("registry credentials: {0}")]
    Credentials(String),
    #[error("{0}: no answer within the deadline")]
    Timeout(String),
    #[error("{reference}: not a component: {message}")]
    NotAComponent { reference: String, message: String },
}

/// A pulled component.
#[derive(Debug, Clone)]
pub struct Pulled {
    pub bytes: Vec<u8>,
    /// `oci://HOST/REPO@sha256:...`: the manifest digest the reference resolved to.
    pub pinned: String,
    /// The `.minisig` text from the manifest annotation, if signed.
    pub signature: Option<String>,
}

/// Parses `oci://...` into a reference.
pub fn parse(reference: &str) -> Result<Reference, OciError> {
    let bad = || OciError::BadReference(reference.to_string());
    let rest = reference.strip_prefix("oci://").ok_or_else(bad)?;
    // oci-client would read a bare `name:tag` as a Docker Hub image: insist on a host.
    let (host, _) = rest.split_once('/').ok_or_else(bad)?;
    if host.is_empty() || !(host.contains('.') || host.contains(':') || host == "localhost") {
        return Err(bad());
    }
    rest.parse::<Reference>().map_err(|_| bad())
}

/// Whether `registry` (`HOST[:PORT]`) is this machine.
fn is_loopback(registry: &str) -> bool {
    let host = registry
        .rsplit_once(':')
        .filter(|(_, p)| p.parse::<u16>().is_ok())
        .map_or(registry, |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The schemes to try, in order: HTTPS first, always; plain HTTP after it only for a
/// loopback registry or one in `insecure` (Docker's rule for insecure registries), so a
/// loopback registry that speaks TLS is still reached over TLS.
fn schemes(s: &Settings, r: &Reference) -> &'static [bool] {
    let registry = r.resolve_registry();
    if is_loopback(registry) || s.insecure.iter().any(|h| h == registry) {
        &[true, false]
    } else {
        &[true]
    }
}

/// Runs `attempt` over each allowed scheme until one succeeds. An answer from the
/// registry (too large, wrong digest) ends the tries; when every scheme failed, the
/// error names each.
async fn over_schemes<T, F, Fut>(
    reference: &str,
    s: &Settings,
    r: &Reference,
    attempt: F,
) -> Result<T, OciError>
where
    F: Fn(bool) -> Fut,
    Fut: std::future::Future<Output = Result<T, OciError>>,
{
    let mut failures = Vec::new();
    for &tls in schemes(s, r) {
        match attempt(tls).await {
            Ok(v) => return Ok(v),
            Err(e @ (OciError::TooLarge { .. } | OciError::DigestMismatch { .. })) => {
                return Err(e);
            }
            Err(e) => failures.push((tls, e)),
        }
    }
    if failures.len() == 1 {
        return Err(failures.remove(0).1);
    }
    Err(OciError::Registry {
        reference: reference.to_string(),
        message: failures
            .iter()
            .map(|(tls, e)| format!("over {}: {e}", if *tls { "HTTPS" } else { "HTTP" }))
            .collect::<Vec<_>>()
            .join("; "),
    })
}

fn client(s: &Settings, tls: bool) -> WasmClient {
    let protocol = if tls {
        ClientProtocol::Https
    } else {
        ClientProtocol::Http
    };
    WasmClient::new(Client::new(ClientConfig {
        protocol,
        connect_timeout: Some(s.timeout.min(Duration::from_secs(10))),
        read_timeout: Some(s.timeout),
        ..ClientConfig::default()
    }))
}

fn auth(s: &Settings, r: &Reference) -> Result<RegistryAuth, OciError> {
    Ok(
        match credentials::lookup(s.auth_file.as_deref(), r.resolve_registry())
            .map_err(OciError::Credentials)?
        {
            Some(b) => RegistryAuth::Basic(b.username, b.password),
            None => RegistryAuth::Anonymous,
        },
    )
}

fn registry_error(reference: &str, e: impl std::fmt::Display) -> OciError {
    OciError::Registry {
        reference: reference.to_string(),
        message: e.to_string(),
    }
}

fn sha256_digest(bytes: &[u8]) -> String {
    let d = Sha256::digest(bytes);
    let hex: String = d.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// Pulls a component. Nothing is loaded here: the caller pre-flights the bytes and
/// checks the signature; a failed pull changes nothing.
pub async fn pull(reference: &str, s: &Settings) -> Result<Pulled, OciError> {
    let r = parse(reference)?;
    let work = over_schemes(reference, s, &r, |tls| pull_inner(reference, &r, s, tls));
    tokio::time::timeout(s.timeout, work)
        .await
        .map_err(|_| OciError::Timeout(reference.to_string()))?
}

async fn pull_inner(
    reference: &str,
    r: &Reference,
    s: &Settings,
    tls: bool,
) -> Result<Pulled, OciError> {
    let c = client(s, tls);
    let auth = auth(s, r)?;
    let (manifest, _config, digest) =
        c.pull_manifest_and_config(r, &auth)
            .await
            .map_err(|e| OciError::NotWasm {
                reference: reference.to_string(),
                message: format!("{e:#}"),
            })?;
    if let Some(asked) = r.digest()
        && asked != digest
    {
        return Err(OciError::DigestMismatch {
            reference: reference.to_string(),
            expected: asked.to_string(),
            actual: digest,
        });
    }
    let layer = &manifest.layers[0];
    if layer.size < 0 || layer.size as u64 > s.max_bytes {
        return Err(OciError::TooLarge {
            reference: reference.to_string(),
            size: layer.size,
            max: s.max_bytes,
        });
    }
    let pinned = Reference::with_digest(
        r.registry().to_string(),
        r.repository().to_string(),
        digest.clone(),
    );
    let mut bytes = Vec::with_capacity(layer.size as usize);
    c.pull_blob(&pinned, layer, &mut bytes)
        .await
        .map_err(|e| registry_error(reference, e))?;
    let actual = sha256_digest(&bytes);
    if bytes.len() as u64 > s.max_bytes || actual != layer.digest {
        return Err(OciError::DigestMismatch {
            reference: reference.to_string(),
            expected: layer.digest.clone(),
            actual,
        });
    }
    let signature = match manifest
        .annotations
        .as_ref()
        .and_then(|a| a.get(SIGNATURE_ANNOTATION))
    {
        Some(b64) => Some(
            credentials::decode_base64(b64)
                .and_then(|b| String::from_utf8(b).ok())
                .ok_or_else(|| {
                    registry_error(reference, "the signature annotation is not base64 text")
                })?,
        ),
        None => None,
    };
    Ok(Pulled {
        bytes,
        pinned: format!("oci://{}/{}@{digest}", r.registry(), r.repository()),
        signature,
    })
}

/// Pushes a component (and its signature, if given) to `reference`; returns the pinned
/// reference of what was pushed.
pub async fn push(
    bytes: Vec<u8>,
    signature: Option<&str>,
    reference: &str,
    s: &Settings,
) -> Result<String, OciError> {
    let r = parse(reference)?;
    let auth = auth(s, &r)?;
    let artifact = |bytes: Vec<u8>| {
        WasmConfig::from_raw_component(bytes, None).map_err(|e| OciError::NotAComponent {
            reference: reference.to_string(),
            message: format!("{e:#}"),
        })
    };
    // Refuse what is no component before talking to any registry.
    artifact(bytes.clone())?;
    let annotations = signature.map(|sig| {
        BTreeMap::from([(
            SIGNATURE_ANNOTATION.to_string(),
            credentials::encode_base64(sig.as_bytes()),
        )])
    });
    let work = over_schemes(reference, s, &r, |tls| {
        let (c, auth, annotations, r) =
            (client(s, tls), auth.clone(), annotations.clone(), r.clone());
        let made = artifact(bytes.clone());
        async move {
            let (config, layer) = made?;
            c.push(&r, &auth, layer, config, annotations)
                .await
                .map_err(|e| registry_error(reference, format!("{e:#}")))?;
            c.fetch_manifest_digest(&r, &auth)
                .await
                .map_err(|e| registry_error(reference, e))
        }
    });
    let digest = tokio::time::timeout(s.timeout, work)
        .await
        .map_err(|_| OciError::Timeout(reference.to_string()))??;
    Ok(format!(
        "oci://{}/{}@{digest}",
        r.registry(),
        r.repository()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_need_the_scheme_and_a_host() {
        for ok in [
            "oci://127.0.0.1:5000/moongate/lru:1.0",
            "oci://reg.example/a/b@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
            "oci://localhost:5000/p",
        ] {
            assert!(parse(ok).is_ok(), "{ok}");
        }
        for bad in [
            "127.0.0.1:5000/p:1",
            "oci://lru:1.0",
            "oci://",
            "oci://h.example/",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        assert!(
            is_loopback("127.0.0.1:5000") && is_loopback("localhost") && is_loopback("[::1]:80")
        );
        assert!(!is_loopback("10.0.0.1:5000") && !is_loopback("reg.example"));
    }

    /// Two rustls crypto providers are in the tree (ring for QUIC, aws-lc for reqwest):
    /// building an HTTPS client must not trip over the choice.
    #[tokio::test]
    async fn an_https_client_builds_and_fails_cleanly_where_nothing_listens() {
        let s = Settings {
            insecure: vec![],
            auth_file: None,
            max_bytes: 1 << 20,
            timeout: Duration::from_secs(5),
        };
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        // Listed as insecure is the only way to reach a loopback port without TLS here,
        // so use a name that is not loopback-literal but resolves locally.
        let e = pull(&format!("oci://localhost.localdomain:{port}/x:1"), &s)
            .await
            .unwrap_err();
        assert!(!matches!(e, OciError::BadReference(_)), "{e}");
    }
}

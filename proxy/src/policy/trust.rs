//! Who may author a plugin: with `policy.trusted_keys` set, a component is accepted only
//! with a minisign signature by one of those keys, over its exact bytes. Pure: bytes and
//! signature text in, a verdict out (where a signature comes from is the caller's
//! business: a `.minisig` file beside a component file, a header on `POST /plugins`, a
//! manifest annotation in an OCI registry).

use minisign_verify::{PublicKey, Signature};
use thiserror::Error;

/// Why a plugin's signature was refused. `reason()` is the metric label.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum TrustError {
    #[error("unsigned: policy.trusted_keys is set, so a plugin needs a minisign signature")]
    Unsigned,
    #[error("the signature is not a minisign signature: {0}")]
    Malformed(String),
    #[error("signed by a key that is not in policy.trusted_keys")]
    UntrustedKey,
    #[error(
        "the signature does not match the component's bytes (altered, or signed as another file)"
    )]
    BadSignature,
}

impl TrustError {
    pub fn reason(&self) -> &'static str {
        match self {
            TrustError::Unsigned => "unsigned",
            TrustError::Malformed(_) => "malformed",
            TrustError::UntrustedKey => "untrusted_key",
            TrustError::BadSignature => "bad_signature",
        }
    }
}

/// Metric labels of [`TrustError::reason`], in a fixed order.
pub const TRUST_REASONS: [&str; 4] = ["unsigned", "malformed", "untrusted_key", "bad_signature"];

/// The trusted minisign public keys.
pub struct Trust {
    keys: Vec<(String, PublicKey)>,
}

impl std::fmt::Debug for Trust {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.keys.iter().map(|(k, _)| k))
            .finish()
    }
}

impl Trust {
    /// Parses the keys: each the base64 line of a minisign public key (`RW...`), or the
    /// whole `minisign.pub` file text (its comment line is skipped).
    pub fn new(keys: &[String]) -> Result<Trust, String> {
        let mut out = Vec::new();
        for k in keys {
            let line = k
                .lines()
                .map(str::trim)
                .rfind(|l| !l.is_empty() && !l.starts_with("untrusted comment:"))
                .unwrap_or("");
            let pk = PublicKey::from_base64(line)
                .map_err(|e| format!("{line:?} is not a minisign public key: {e}"))?;
            out.push((line.to_string(), pk));
        }
        Ok(Trust { keys: out })
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Checks `signature` (the text of a `.minisig` file) over `bytes`; returns the
    /// trusted key (its base64 line) that signed them.
    pub fn check(&self, bytes: &[u8], signature: Option<&str>) -> Result<&str, TrustError> {
        let text = signature.ok_or(TrustError::Unsigned)?;
        let sig = Signature::decode(text).map_err(|e| TrustError::Malformed(e.to_string()))?;
        let mut bad = false;
        for (line, pk) in &self.keys {
            match pk.verify(bytes, &sig, false) {
                Ok(()) => return Ok(line),
                // Another key's id: try the next trusted key.
                Err(minisign_verify::Error::UnexpectedKeyId) => {}
                Err(_) => bad = true,
            }
        }
        Err(if bad {
            TrustError::BadSignature
        } else {
            TrustError::UntrustedKey
        })
    }
}

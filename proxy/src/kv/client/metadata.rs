//! The transfer engine's HTTP metadata server, read side: where a segment's data
//! listener is and which memory it serves (data-plane spec A).
//!
//! Keys are escaped exactly as libcurl's `curl_easy_escape` does (only `A-Za-z0-9-._~`
//! kept): the master-embedded server does not URL-decode, so any other spelling misses.
//! Descriptors are cached per segment for `kv.metadata_ttl_ms` (Mooncake's own
//! initiators keep them for the process lifetime; names come from the master, so a
//! cache keyed by them must not grow or live forever), at most [`MAX_CACHED`] of them;
//! a transfer that fails drops the entry so the next call re-reads it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::Deserialize;
use thiserror::Error;

use crate::upstream::HttpUrl;

#[derive(Debug, Error)]
pub enum MetadataError {
    #[error("metadata server: {0}")]
    Http(String),
    #[error("metadata server has no descriptor for segment {0}")]
    NotFound(String),
    #[error("segment {name}: descriptor does not parse: {error}")]
    Bad { name: String, error: String },
    #[error("segment {name} is served over {protocol:?}, not tcp")]
    Protocol { name: String, protocol: String },
}

/// How long an answer is reused unless [`Metadata::with_ttl`] says otherwise.
const DEFAULT_TTL: Duration = Duration::from_secs(60);

/// `curl_easy_escape`: every byte but `A-Z a-z 0-9 - . _ ~` as upper-case `%XX`.
pub fn escape(key: &str) -> String {
    let mut out = String::with_capacity(key.len() * 3);
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[derive(Debug, Clone, Deserialize)]
struct RawBuffer {
    addr: u64,
    length: u64,
}

#[derive(Debug, Clone, Deserialize)]
struct RawDescriptor {
    #[serde(default)]
    protocol: serde_json::Value,
    #[serde(default)]
    tcp_data_host: String,
    #[serde(default)]
    tcp_data_port: u16,
    #[serde(default)]
    tcp_proto_version: Option<u32>,
    #[serde(default)]
    buffers: Vec<RawBuffer>,
}

/// What a reader or writer needs of a segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// `host:port` of its TE data listener.
    pub data: String,
    /// Acknowledged (v2) framing.
    pub v2: bool,
    /// `(addr, length)` of its registered buffers.
    pub buffers: Vec<(u64, u64)>,
}

impl Segment {
    /// Whether `[addr, addr + len)` lies inside one advertised buffer.
    pub fn covers(&self, addr: u64, len: u64) -> bool {
        addr.checked_add(len).is_some_and(|end| {
            self.buffers
                .iter()
                .any(|&(a, l)| addr >= a && end <= a.saturating_add(l))
        })
    }
}

/// Parses a `ram/<name>` descriptor.
pub fn parse_segment(name: &str, body: &[u8]) -> Result<Segment, MetadataError> {
    let d: RawDescriptor = serde_json::from_slice(body).map_err(|e| MetadataError::Bad {
        name: name.to_string(),
        error: e.to_string(),
    })?;
    let tcp = match &d.protocol {
        serde_json::Value::String(s) => s == "tcp",
        serde_json::Value::Array(a) => a.iter().any(|p| p == "tcp"),
        _ => false,
    };
    if !tcp {
        return Err(MetadataError::Protocol {
            name: name.to_string(),
            protocol: d.protocol.to_string(),
        });
    }
    if d.tcp_data_host.is_empty() || d.tcp_data_port == 0 {
        return Err(MetadataError::Bad {
            name: name.to_string(),
            error: "no tcp_data_host / tcp_data_port (legacy rpc_meta lookup not supported)".into(),
        });
    }
    let host = if d.tcp_data_host.contains(':') {
        format!("[{}]", d.tcp_data_host)
    } else {
        d.tcp_data_host.clone()
    };
    Ok(Segment {
        data: format!("{host}:{}", d.tcp_data_port),
        v2: d.tcp_proto_version.unwrap_or(1) >= 2,
        buffers: d.buffers.iter().map(|b| (b.addr, b.length)).collect(),
    })
}

/// Segments whose answers are cached at most; past it, expired entries are dropped,
/// then (a fleet this large) the whole cache.
pub const MAX_CACHED: usize = 4096;

/// Answers keyed by segment name, each reused for `ttl` after it was read.
struct Expiring<V> {
    ttl: Duration,
    map: HashMap<Bytes, (Instant, V)>,
}

impl<V: Clone> Expiring<V> {
    fn new(ttl: Duration) -> Self {
        Expiring {
            ttl,
            map: HashMap::new(),
        }
    }

    fn get(&mut self, name: &Bytes) -> Option<V> {
        match self.map.get(name) {
            Some((at, v)) if at.elapsed() < self.ttl => Some(v.clone()),
            Some(_) => {
                self.map.remove(name);
                None
            }
            None => None,
        }
    }

    fn insert(&mut self, name: Bytes, v: V) {
        if self.map.len() >= MAX_CACHED {
            let ttl = self.ttl;
            self.map.retain(|_, (at, _)| at.elapsed() < ttl);
            if self.map.len() >= MAX_CACHED {
                self.map.clear();
            }
        }
        self.map.insert(name, (Instant::now(), v));
    }

    fn remove(&mut self, name: &Bytes) {
        self.map.remove(name);
    }
}

/// Reads segment descriptors from `http://HOST:PORT/metadata`, with a cache.
pub struct Metadata {
    url: HttpUrl,
    timeout: Duration,
    prefix: String,
    cache: Mutex<Expiring<Arc<Segment>>>,
    /// `moongate/quic/<name>` entries; `None` = the segment has no QUIC endpoint.
    quic: Mutex<Expiring<Option<crate::kv::transport::quic::QuicPeer>>>,
}

impl Metadata {
    /// `url`: the metadata connection string clients use (`http://HOST:PORT/metadata`).
    pub fn new(url: &str, timeout: Duration) -> Option<Metadata> {
        Some(Metadata {
            url: HttpUrl::parse(url)?,
            timeout,
            // MC_METADATA_CLUSTER_ID namespaces the keys, as Mooncake's clients do.
            prefix: match std::env::var("MC_METADATA_CLUSTER_ID") {
                Ok(id) if !id.is_empty() => format!("mooncake/{}/", id.trim_end_matches('/')),
                _ => "mooncake/".into(),
            },
            cache: Mutex::new(Expiring::new(DEFAULT_TTL)),
            quic: Mutex::new(Expiring::new(DEFAULT_TTL)),
        })
    }

    /// Reuses each answer for `ttl` (`kv.metadata_ttl_ms`) instead of the default.
    pub fn with_ttl(self, ttl: Duration) -> Metadata {
        Metadata {
            cache: Mutex::new(Expiring::new(ttl)),
            quic: Mutex::new(Expiring::new(ttl)),
            ..self
        }
    }

    /// The metadata key a QUIC-serving moongate publishes for its segment `name`.
    pub fn quic_key(&self, name: &str) -> String {
        format!("moongate/quic/{name}")
    }

    /// The QUIC endpoint of the moongate owning segment `name`, if it serves one.
    /// Answers (found or not) are cached; [`Metadata::forget`] drops them.
    pub async fn quic_peer(&self, name: &Bytes) -> Option<crate::kv::transport::quic::QuicPeer> {
        if let Some(p) = self
            .quic
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
        {
            return p;
        }
        let key = self.quic_key(&String::from_utf8_lossy(name));
        let path = format!("{}?key={}", self.url.path, escape(&key));
        let peer = match crate::upstream::http_get(&self.url.authority, &path, self.timeout).await {
            Ok((200, body)) => crate::kv::transport::quic::parse_peer(&body),
            Ok(_) => None,
            // Unreachable metadata: no answer to cache; TE-TCP will report the problem.
            Err(_) => return None,
        };
        self.quic
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name.clone(), peer.clone());
        peer
    }

    pub async fn segment(&self, name: &Bytes) -> Result<Arc<Segment>, MetadataError> {
        if let Some(s) = self
            .cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
        {
            return Ok(s);
        }
        let name_str = String::from_utf8_lossy(name).into_owned();
        let key = format!("{}ram/{}", self.prefix, name_str);
        let path = format!("{}?key={}", self.url.path, escape(&key));
        let (status, body) = crate::upstream::http_get(&self.url.authority, &path, self.timeout)
            .await
            .map_err(|e| MetadataError::Http(e.to_string()))?;
        match status {
            200 => {}
            404 => return Err(MetadataError::NotFound(name_str)),
            s => return Err(MetadataError::Http(format!("GET {path} answered {s}"))),
        }
        let seg = Arc::new(parse_segment(&name_str, &body)?);
        self.cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name.clone(), seg.clone());
        Ok(seg)
    }

    /// Drops a cached descriptor (its owner may have restarted elsewhere).
    pub fn forget(&self, name: &Bytes) {
        self.cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(name);
        self.quic
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_answers_expire_and_the_cache_stays_bounded() {
        let mut c = Expiring::new(Duration::from_millis(30));
        c.insert(Bytes::from_static(b"a"), 1);
        assert_eq!(c.get(&Bytes::from_static(b"a")), Some(1));
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(c.get(&Bytes::from_static(b"a")), None);
        let mut c = Expiring::new(Duration::from_secs(60));
        for i in 0..(MAX_CACHED + 10) {
            c.insert(Bytes::from(i.to_string()), i);
        }
        assert!(c.map.len() <= MAX_CACHED, "{}", c.map.len());
        assert_eq!(
            c.get(&Bytes::from((MAX_CACHED + 9).to_string())),
            Some(MAX_CACHED + 9)
        );
    }

    #[test]
    fn escapes_like_curl() {
        assert_eq!(
            escape("mooncake/ram/127.0.0.1:13261"),
            "mooncake%2Fram%2F127.0.0.1%3A13261"
        );
        assert_eq!(escape("a b~_-."), "a%20b~_-.");
    }

    #[test]
    fn parses_the_captured_descriptor() {
        let body =
            br#"{"buffers":[{"addr":140640868347968,"length":16777216,"name":"127.0.0.1:13261"},
            {"addr":140640767705088,"length":67108864,"name":"127.0.0.1:13261"}],
            "name":"127.0.0.1:13261","protocol":"tcp","rdma_server_name":"",
            "tcp_data_host":"127.0.0.1","tcp_data_port":15235,"tcp_proto_version":2,
            "timestamp":"2026-11-29 22:16:55.252486"}"#;
        let s = parse_segment("127.0.0.1:13261", body).unwrap();
        assert_eq!(s.data, "127.0.0.1:15235");
        assert!(s.v2);
        assert!(s.covers(140640767705088, 67108864));
        assert!(!s.covers(140640767705088, 67108865));
        assert!(!s.covers(u64::MAX, 2));
        assert!(matches!(
            parse_segment("x", br#"{"protocol":"rdma"}"#),
            Err(MetadataError::Protocol { .. })
        ));
        assert!(parse_segment("x", b"not json").is_err());
    }
}

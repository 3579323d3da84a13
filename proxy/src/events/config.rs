//! The `[events]` section: KV events for cache-aware routers, off by default.

use serde::Deserialize;

use super::wire::Encoding;
use crate::validate::positive;

/// KV events: the pool's block stores and removals as seen through this moongate,
/// published over ZeroMQ in vLLM's KV-event format (see `docs/operations.md`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EventsConfig {
    /// Off by default: a router has to be told where to subscribe, and the key table
    /// (kept with events on even when eviction is off) costs memory per key.
    pub enabled: bool,
    /// Where the PUB socket binds (`tcp://HOST:PORT`; port 0 picks a free one, logged).
    /// Loopback by default: events name keys, so exposing them is the operator's choice.
    pub endpoint: String,
    /// Where the ROUTER socket for replaying missed batches binds; empty: no replay.
    /// Subscribers send the first sequence number they missed (8 bytes, big-endian).
    pub replay_endpoint: String,
    /// The first frame of every published message; subscribers filter on its prefix.
    /// Empty by default, as vLLM's publisher.
    pub topic: String,
    /// Changes waiting for the publisher, at most. When it is full a change is dropped
    /// and counted (`moongate_events_dropped_total`): the master face never waits on a
    /// router.
    pub queue: usize,
    /// Batches kept for replay (vLLM keeps 10,000 too).
    pub replay_batches: usize,
    /// Events in one published batch, at most: a burst becomes a few batches, not one
    /// huge message.
    pub max_batch_events: usize,
    /// The `block_size` field of `BlockStored` (tokens per block). moongate cannot see
    /// tokens; set it to the connector's block size (vLLM's default is 16) so a router
    /// can size prefixes.
    pub block_tokens: u64,
    /// vLLM's encoding of the batches: `"map"` (tagged maps with `group_idx`, vLLM's
    /// current one) or `"array"` (positional arrays, what vLLM published before and
    /// routers built then parse). Default `"map"`: what vLLM publishes today, so one
    /// router reads vLLM's GPU events and the pool's alike.
    pub encoding: Encoding,
    /// How a block named by a digest (vLLM's chunk hashes, 32 bytes) is published:
    /// `"int"`, its low 64 bits as an unsigned integer, as vLLM does by default
    /// (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`), or `"bytes"`, the digest itself, as vLLM
    /// does with that variable at 0. Match the engines' setting so the pool's hashes equal
    /// their GPU events' hashes. Blocks named by 64-bit numbers are always integers.
    pub block_hash: BlockHashForm,
}

/// How a digest-named block's hash is published (`events.block_hash`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BlockHashForm {
    /// The digest's low 64 bits, big-endian, as an unsigned integer (vLLM's int form).
    #[default]
    Int,
    /// The digest's bytes.
    Bytes,
}

impl Default for EventsConfig {
    fn default() -> Self {
        EventsConfig {
            enabled: false,
            endpoint: "tcp://127.0.0.1:5557".into(),
            replay_endpoint: "tcp://127.0.0.1:5558".into(),
            topic: String::new(),
            queue: 10_000,
            replay_batches: 10_000,
            max_batch_events: 1_000,
            block_tokens: 16,
            encoding: Encoding::Map,
            block_hash: BlockHashForm::Int,
        }
    }
}

impl EventsConfig {
    /// Appends every problem of this section to `errs` (nothing while it is off).
    pub fn validate(&self, errs: &mut Vec<String>) {
        if !self.enabled {
            return;
        }
        positive(errs, "events.queue", self.queue as u64);
        positive(errs, "events.replay_batches", self.replay_batches as u64);
        positive(
            errs,
            "events.max_batch_events",
            self.max_batch_events as u64,
        );
        for (key, value, may_be_empty) in [
            ("events.endpoint", &self.endpoint, false),
            ("events.replay_endpoint", &self.replay_endpoint, true),
        ] {
            if value.is_empty() && may_be_empty {
                continue;
            }
            if tcp_addr(value).is_none() {
                errs.push(format!("{key}: {value:?} is not tcp://HOST:PORT"));
            }
        }
        if !self.replay_endpoint.is_empty()
            && self.replay_endpoint == self.endpoint
            && !self.endpoint.ends_with(":0")
        {
            errs.push("events: endpoint and replay_endpoint must differ".into());
        }
    }
}

/// `tcp://HOST:PORT` into `HOST:PORT`.
pub fn tcp_addr(endpoint: &str) -> Option<&str> {
    let rest = endpoint.strip_prefix("tcp://")?;
    let (host, port) = rest.rsplit_once(':')?;
    (!host.is_empty() && port.parse::<u16>().is_ok()).then_some(rest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_endpoints_and_sizes_are_named() {
        let mut errs = Vec::new();
        EventsConfig {
            enabled: true,
            endpoint: "ipc:///x".into(),
            replay_endpoint: "tcp://h:99999".into(),
            queue: 0,
            ..EventsConfig::default()
        }
        .validate(&mut errs);
        let all = errs.join("\n");
        for key in ["events.endpoint", "events.replay_endpoint", "events.queue"] {
            assert!(all.contains(key), "{all}");
        }
        let mut errs = Vec::new();
        EventsConfig {
            enabled: true,
            replay_endpoint: String::new(),
            ..EventsConfig::default()
        }
        .validate(&mut errs);
        assert!(errs.is_empty(), "{errs:?}");
    }
}

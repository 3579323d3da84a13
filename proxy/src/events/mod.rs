//! KV events for cache-aware routers: the pool's block stores and removals, as this
//! moongate sees them, published in vLLM's KV-event format over ZeroMQ.
//!
//! Rooms:
//! - here: [`Events`], the handle the key table feeds ([`Change`]s, never waiting: a full
//!   queue drops and counts), and the publisher task that turns changes into events;
//! - [`wire`]: the msgpack encoding (pure);
//! - [`publisher`]: the PUB and replay sockets (bytes only);
//! - [`config`], [`metrics`].
//!
//! What a change means is decided by the key table ([`crate::keys`]): a put whose
//! end succeeded is stored, a removal, a `RemoveAll`, an eviction by moongate or a key
//! found gone on a lookup is removed. How a key maps to a block hash and parent is the
//! active policy's `block-keys` hook, called here, off the request path.

pub mod config;
pub mod metrics;
pub mod publisher;
pub mod wire;

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::codec::types::Tier;
use crate::policy::registry::Registry;
use crate::policy::wit;
pub use config::{BlockHashForm, EventsConfig};
use metrics::{EventsMetrics, Stage};
use publisher::Publisher;
use wire::{Event, Hash};

/// What happened to the keys of a [`Change`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum What {
    Stored,
    Removed,
    /// Every key is gone (`RemoveAll`); the change carries no keys.
    Cleared,
}

/// Keys of one call (in the call's order) that changed alike: one arm, one tier.
#[derive(Debug, Clone, PartialEq)]
pub struct Change {
    pub what: What,
    /// The experiment arm whose policy names the keys as blocks.
    pub arm: u8,
    /// `None`: not known (a removal of a key moongate never saw stored).
    pub tier: Option<Tier>,
    pub keys: Vec<Bytes>,
}

/// Builds the changes of one call: a new change whenever the arm or the tier changes, so
/// a batch put's keys stay together and in order.
#[derive(Debug)]
pub struct Changes {
    what: What,
    out: Vec<Change>,
}

impl Changes {
    pub fn new(what: What) -> Changes {
        Changes {
            what,
            out: Vec::new(),
        }
    }

    pub fn push(&mut self, arm: u8, tier: Option<Tier>, key: &Bytes) {
        match self.out.last_mut() {
            Some(c) if c.arm == arm && c.tier == tier => c.keys.push(key.clone()),
            _ => self.out.push(Change {
                what: self.what,
                arm,
                tier,
                keys: vec![key.clone()],
            }),
        }
    }

    /// Sends every change to `events`.
    pub fn send(self, events: &Events) {
        for c in self.out {
            events.send(c);
        }
    }
}

/// The `medium` of an event: the Mooncake tier, named as Mooncake's replica types are.
pub fn medium(tier: Tier) -> &'static str {
    match tier {
        Tier::Memory => "MEMORY",
        Tier::Nof => "NOF",
        Tier::Disk => "DISK",
        Tier::LocalDisk => "LOCAL_DISK",
        Tier::Dfs => "DFS",
    }
}

/// The handle the key table holds.
pub struct Events {
    tx: mpsc::Sender<Change>,
    metrics: Arc<EventsMetrics>,
}

impl Events {
    /// The handle and the receiving end for [`run`].
    pub fn new(
        cfg: &EventsConfig,
        metrics: Arc<EventsMetrics>,
    ) -> (Arc<Events>, mpsc::Receiver<Change>) {
        let (tx, rx) = mpsc::channel(cfg.queue.max(1));
        (Arc::new(Events { tx, metrics }), rx)
    }

    /// Queues a change, or drops and counts it when the queue is full: the caller is
    /// the master face, which never waits on a router.
    pub fn send(&self, change: Change) {
        match self.tx.try_send(change) {
            Ok(()) => self.metrics.queued.inc(),
            Err(_) => self.metrics.dropped.inc(),
        };
    }
}

/// Starts the publisher on a thread of its own (with its own single-threaded runtime):
/// naming blocks calls the plugin, a burst of changes is a burst of plugin calls, and
/// none of them may delay the master face's thread. Returns once the sockets are bound
/// (or could not be); the thread ends when `stop` is cancelled, after publishing what
/// was queued.
pub async fn start(
    cfg: &EventsConfig,
    metrics: Arc<EventsMetrics>,
    policy: Arc<Registry>,
    stop: CancellationToken,
) -> Result<(Arc<Events>, std::thread::JoinHandle<()>), publisher::BindError> {
    let shutdown = stop;
    let (events, rx) = Events::new(cfg, metrics.clone());
    let (bound_tx, bound_rx) = tokio::sync::oneshot::channel();
    let cfg = cfg.clone();
    let thread = std::thread::Builder::new()
        .name("moongate-events".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = bound_tx.send(Err(publisher::BindError::Runtime(e)));
                    return;
                }
            };
            rt.block_on(async move {
                let p = match Publisher::bind(&cfg, metrics.clone(), shutdown.clone()).await {
                    Ok(p) => p,
                    Err(e) => {
                        let _ = bound_tx.send(Err(e));
                        return;
                    }
                };
                tracing::info!(endpoint = %p.endpoint,
                    replay = %p.replay_endpoint.as_deref().unwrap_or("off"),
                    topic = %cfg.topic, "KV events publishing");
                let _ = bound_tx.send(Ok(()));
                run(rx, p, policy, cfg, metrics, shutdown).await;
            });
        })
        .map_err(publisher::BindError::Runtime)?;
    match bound_rx.await {
        Ok(Ok(())) => Ok((events, thread)),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(publisher::BindError::Runtime(std::io::Error::other(
            "the events thread ended before binding",
        ))),
    }
}

/// Publishes queued changes until shutdown, then what is still queued.
pub async fn run(
    mut rx: mpsc::Receiver<Change>,
    mut publisher: Publisher,
    policy: Arc<Registry>,
    cfg: EventsConfig,
    metrics: Arc<EventsMetrics>,
    shutdown: CancellationToken,
) {
    let max = cfg.max_batch_events.max(1);
    let mut changes = Vec::with_capacity(max);
    let mut payload = Vec::new();
    loop {
        let n = tokio::select! {
            _ = shutdown.cancelled() => {
                while let Ok(c) = rx.try_recv() {
                    changes.push(c);
                }
                0
            }
            n = rx.recv_many(&mut changes, max) => n,
        };
        let events = to_events(&changes, &policy, cfg.block_hash, &metrics);
        let handled = changes.len() as u64;
        changes.clear();
        for chunk in events.chunks(max) {
            payload.clear();
            let ts = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            wire::encode_batch(ts, chunk, cfg.block_tokens, cfg.encoding, &mut payload);
            match publisher.publish(Bytes::copy_from_slice(&payload)).await {
                Ok(()) => {
                    metrics.batches.inc();
                    for e in chunk {
                        metrics.published(e.index());
                    }
                }
                Err(e) => {
                    metrics.error(Stage::Send);
                    tracing::warn!(error = %e, "events: a batch could not be published");
                }
            }
        }
        metrics.handled.inc_by(handled);
        if n == 0 {
            return;
        }
    }
}

/// Events of `changes`, in order: the keys named as blocks by their arm's policy.
fn to_events(
    changes: &[Change],
    policy: &Registry,
    form: BlockHashForm,
    metrics: &EventsMetrics,
) -> Vec<Event> {
    let set = policy.current();
    let mut out = Vec::new();
    for c in changes {
        if c.what == What::Cleared {
            out.push(Event::Cleared);
            continue;
        }
        let Some(arm) = set.arms.get(c.arm as usize).or(set.arms.first()) else {
            continue;
        };
        let keys = crate::policy::pack_keys(c.keys.iter());
        let blocks = match policy.blocks(arm, &keys) {
            Ok(Some(b)) => b,
            Ok(None) => {
                metrics.unmapped.inc_by(c.keys.len() as u64);
                continue;
            }
            Err(e) => {
                metrics.error(Stage::Hook);
                metrics.unmapped.inc_by(c.keys.len() as u64);
                tracing::debug!(plugin = arm.plugin.name(), error = %e, "events: block-refs failed");
                continue;
            }
        };
        let medium = c.tier.map(medium);
        let unmapped = blocks.iter().filter(|b| b.is_none()).count();
        metrics.unmapped.inc_by(unmapped as u64);
        let blocks: Vec<Option<Block>> = blocks
            .iter()
            .map(|b| b.as_ref().map(|b| Block::of(b, form)))
            .collect();
        match c.what {
            What::Stored => chains(&blocks, medium, &mut out),
            _ => removals(&blocks, medium, &mut out),
        }
    }
    out
}

/// A block as published: its hashes in their wire form.
#[derive(Debug, Clone, PartialEq)]
struct Block {
    hash: Hash,
    parent: Option<Hash>,
    group: Option<u32>,
}

impl Block {
    fn of(b: &wit::Block, form: BlockHashForm) -> Block {
        Block {
            hash: wire_hash(&b.hash, form),
            parent: b.parent.as_ref().map(|p| wire_hash(p, form)),
            group: b.group,
        }
    }
}

/// A plugin's hash in the form `events.block_hash` asks for: a digest as its bytes, or as
/// vLLM turns it into an int (`int.from_bytes(digest, "big") & (2**64 - 1)`: the last
/// eight bytes).
fn wire_hash(h: &wit::BlockHash, form: BlockHashForm) -> Hash {
    match (h, form) {
        (wit::BlockHash::Int(v), _) => Hash::Int(*v),
        (wit::BlockHash::Digest(d), BlockHashForm::Bytes) => Hash::Bytes(d.clone()),
        (wit::BlockHash::Digest(d), BlockHashForm::Int) => {
            let tail = &d[d.len().saturating_sub(8)..];
            Hash::Int(tail.iter().fold(0u64, |v, b| (v << 8) | u64::from(*b)))
        }
    }
}

/// `BlockStored` events for blocks in call order: one event per run of blocks of one
/// group where each block's parent is the block before it.
fn chains(blocks: &[Option<Block>], medium: Option<&'static str>, out: &mut Vec<Event>) {
    let mut run: Option<(Vec<Hash>, Option<Hash>, Option<u32>)> = None;
    let flush = |run: &mut Option<(Vec<Hash>, Option<Hash>, Option<u32>)>, out: &mut Vec<Event>| {
        if let Some((hashes, parent, group)) = run.take() {
            out.push(Event::Stored {
                hashes,
                parent,
                medium,
                group,
            });
        }
    };
    for b in blocks {
        let Some(b) = b else {
            flush(&mut run, out);
            continue;
        };
        match &mut run {
            Some((hashes, _, group))
                if *group == b.group
                    && b.parent.is_some()
                    && hashes.last() == b.parent.as_ref() =>
            {
                hashes.push(b.hash.clone())
            }
            _ => {
                flush(&mut run, out);
                run = Some((vec![b.hash.clone()], b.parent.clone(), b.group));
            }
        }
    }
    flush(&mut run, out);
}

/// `BlockRemoved` events of one change: one per run of blocks of one group.
fn removals(blocks: &[Option<Block>], medium: Option<&'static str>, out: &mut Vec<Event>) {
    let first = out.len();
    for b in blocks.iter().flatten() {
        match out[first..].last_mut() {
            Some(Event::Removed { hashes, group, .. }) if *group == b.group => {
                hashes.push(b.hash.clone())
            }
            _ => out.push(Event::Removed {
                hashes: vec![b.hash.clone()],
                medium,
                group: b.group,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(hash: u64, parent: Option<u64>) -> Option<Block> {
        g(hash, parent, None)
    }

    fn g(hash: u64, parent: Option<u64>, group: Option<u32>) -> Option<Block> {
        Some(Block {
            hash: Hash::Int(hash),
            parent: parent.map(Hash::Int),
            group,
        })
    }

    fn int(h: &Hash) -> u64 {
        match h {
            Hash::Int(v) => *v,
            Hash::Bytes(b) => panic!("{b:?}"),
        }
    }

    #[test]
    fn stored_blocks_become_one_event_per_chain_and_group() {
        let mut out = Vec::new();
        chains(
            &[
                b(1, None),
                b(2, Some(1)),
                b(3, Some(2)),
                b(9, Some(7)),
                None,
                b(10, Some(9)),
                g(11, Some(10), Some(1)),
                g(12, Some(11), Some(1)),
            ],
            Some("MEMORY"),
            &mut out,
        );
        let got: Vec<(Vec<u64>, Option<u64>, Option<u32>)> = out
            .into_iter()
            .map(|e| match e {
                Event::Stored {
                    hashes,
                    parent,
                    group,
                    ..
                } => (
                    hashes.iter().map(int).collect(),
                    parent.as_ref().map(int),
                    group,
                ),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            got,
            [
                (vec![1, 2, 3], None, None),
                (vec![9], Some(7), None),
                (vec![10], Some(9), None),
                (vec![11, 12], Some(10), Some(1)),
            ]
        );
    }

    #[test]
    fn removals_group_by_group_within_one_change() {
        let mut out = vec![Event::Removed {
            hashes: vec![Hash::Int(0)],
            medium: None,
            group: None,
        }];
        removals(
            &[b(1, None), None, b(2, Some(1)), g(3, None, Some(2))],
            None,
            &mut out,
        );
        let got: Vec<(Vec<u64>, Option<u32>)> = out
            .iter()
            .map(|e| match e {
                Event::Removed { hashes, group, .. } => (hashes.iter().map(int).collect(), *group),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            got,
            [(vec![0], None), (vec![1, 2], None), (vec![3], Some(2))]
        );
    }

    #[test]
    fn digests_publish_as_vllm_ints_or_as_bytes() {
        let digest: Vec<u8> = (1..=32).collect();
        let h = wit::BlockHash::Digest(digest.clone());
        // int.from_bytes(bytes(range(1, 33)), "big") & (2**64 - 1)
        assert_eq!(
            wire_hash(&h, BlockHashForm::Int),
            Hash::Int(0x191a_1b1c_1d1e_1f20)
        );
        assert_eq!(wire_hash(&h, BlockHashForm::Bytes), Hash::Bytes(digest));
        let short = wit::BlockHash::Digest(vec![1, 2]);
        assert_eq!(wire_hash(&short, BlockHashForm::Int), Hash::Int(0x102));
        let n = wit::BlockHash::Int(7);
        assert_eq!(wire_hash(&n, BlockHashForm::Bytes), Hash::Int(7));
    }

    #[test]
    fn changes_split_by_arm_and_tier_in_order() {
        let k = |s: &'static str| Bytes::from_static(s.as_bytes());
        let mut c = Changes::new(What::Stored);
        c.push(0, Some(Tier::Memory), &k("a"));
        c.push(0, Some(Tier::Memory), &k("b"));
        c.push(0, Some(Tier::Disk), &k("c"));
        c.push(1, Some(Tier::Disk), &k("d"));
        let shapes: Vec<(u8, Option<Tier>, usize)> = c
            .out
            .iter()
            .map(|c| (c.arm, c.tier, c.keys.len()))
            .collect();
        assert_eq!(
            shapes,
            [
                (0, Some(Tier::Memory), 2),
                (0, Some(Tier::Disk), 1),
                (1, Some(Tier::Disk), 1)
            ]
        );
    }
}

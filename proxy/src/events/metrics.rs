//! The events publisher's metric families, registered once.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

/// Event types by their wire tag, in [`super::wire::Event::index`] order.
pub const EVENT_TYPES: [&str; 3] = ["BlockStored", "BlockRemoved", "AllBlocksCleared"];

/// Stages where publishing can fail.
#[derive(Debug, Clone, Copy)]
pub enum Stage {
    /// The plugin's `block-keys` hook failed (trap, timeout, bad answer).
    Hook = 0,
    /// The PUB socket refused a message.
    Send = 1,
    /// A replay request was malformed or its answer could not be sent.
    Replay = 2,
}

const STAGES: [&str; 3] = ["hook", "send", "replay"];

pub struct EventsMetrics {
    pub published: [Counter; 3],
    pub batches: Counter,
    pub dropped: Counter,
    pub unmapped: Counter,
    pub replays: Counter,
    /// Changes queued for the publisher, and changes it has handled (published or found
    /// to name no block): equal when nothing is waiting.
    pub queued: Counter,
    pub handled: Counter,
    errors: [Counter; 3],
}

impl EventsMetrics {
    pub fn error(&self, s: Stage) {
        self.errors[s as usize].inc();
    }

    /// One event published, by [`super::wire::Event::index`].
    pub fn published(&self, index: usize) {
        if let Some(c) = self.published.get(index) {
            c.inc();
        }
    }

    pub fn register(registry: &mut Registry) -> EventsMetrics {
        let published = Family::<[(&'static str, &'static str); 1], Counter>::default();
        registry.register(
            "moongate_events_published",
            "KV events published, by type (BlockStored, BlockRemoved, AllBlocksCleared)",
            published.clone(),
        );
        let errors = Family::<[(&'static str, &'static str); 1], Counter>::default();
        registry.register(
            "moongate_events_errors",
            "KV event failures by stage (hook: a plugin's block-keys failed; send: the \
             PUB socket refused a batch; replay: a bad or unanswerable replay request)",
            errors.clone(),
        );
        let batches = Counter::default();
        registry.register(
            "moongate_events_batches",
            "KV event batches published (one sequence number each)",
            batches.clone(),
        );
        let dropped = Counter::default();
        registry.register(
            "moongate_events_dropped",
            "Changes dropped because the events queue (events.queue) was full: routers \
             missed them and cannot replay them",
            dropped.clone(),
        );
        let unmapped = Counter::default();
        registry.register(
            "moongate_events_unmapped_keys",
            "Keys that published no event: the policy named no block for them, has no \
             block-keys hook (built for WIT 0.1.0), or its hook failed",
            unmapped.clone(),
        );
        let changes = Family::<[(&'static str, &'static str); 1], Counter>::default();
        registry.register(
            "moongate_events_changes",
            "Key-table changes (keys of one call alike) by state: queued for the publisher, \
             handled by it (equal when nothing waits)",
            changes.clone(),
        );
        let replays = Counter::default();
        registry.register(
            "moongate_events_replays",
            "Replay requests answered",
            replays.clone(),
        );
        // One statement per handle: `get_or_create` returns a read guard, and two of them
        // alive in one expression would deadlock the second's insert.
        let queued = changes.get_or_create(&[("state", "queued")]).clone();
        let handled = changes.get_or_create(&[("state", "handled")]).clone();
        EventsMetrics {
            published: EVENT_TYPES.map(|t| published.get_or_create(&[("type", t)]).clone()),
            errors: STAGES.map(|s| errors.get_or_create(&[("stage", s)]).clone()),
            batches,
            dropped,
            unmapped,
            replays,
            queued,
            handled,
        }
    }
}

//! What the kv face's traffic tells the rest of moongate: every master call the kv face
//! makes for an engine (puts, their ends and revokes, lookups, existence checks,
//! removals) and its answer become one observation for [`crate::answered::Sink`], as the
//! master face's answered calls do, so
//! keys engines store through the kv face (HTTP, the Unix socket, shared memory, QUIC,
//! reservations and views) are moongate's evictor's to choose, are announced in KV
//! events, and their misses explained.
//!
//! The arm a call is accounted to is the one the active set assigns the kv face's
//! client id and the call's first key, as its put decisions are assigned.

use std::sync::Arc;

use bytes::Bytes;

use crate::answered::{Answered, Sink};
use crate::calls::{CallExt, Tracked};
use crate::codec::message::{Request, Response};
use crate::codec::types::Uuid;
use crate::kv::client::Heard;
use crate::policy::registry::Registry;

/// Turns the kv face's answered master calls into observations.
pub struct Observer {
    pub answered: Arc<Sink>,
    pub policy: Arc<Registry>,
    /// The kv face's Mooncake client id.
    pub client: Uuid,
}

impl Heard for Observer {
    fn wants(&self, req: &Request) -> bool {
        // What `Tracked::of` reads, without building it for calls it does not.
        matches!(
            req,
            Request::PutStart(_)
                | Request::BatchPutStart(_)
                | Request::PutEnd(_)
                | Request::BatchPutEnd(_)
                | Request::PutRevoke(_)
                | Request::BatchPutRevoke(_)
                | Request::GetReplicaList(_)
                | Request::BatchGetReplicaList(_)
                | Request::ExistKey(_)
                | Request::BatchExistKey(_)
                | Request::Remove(_)
        )
    }

    fn heard(&self, req: &Request, resp: &Response) {
        let Some(t) = Tracked::of(req) else {
            return;
        };
        let (set, arm) = self.policy.arm_for(&self.client, req.first_key());
        let said = self.answered.said(Some(&t), None, resp);
        self.answered.answered(Answered {
            said,
            arm,
            arm_name: &set.arms[arm].name,
            read: None,
        });
    }

    fn lost(&self, tenant: &Bytes, keys: &[Bytes]) {
        if let Some(k) = self.answered.keys() {
            k.lost_in_failover(tenant, keys);
        }
    }

    fn ended_here(&self, tenant: &Bytes, key: &Bytes) -> bool {
        self.answered
            .keys()
            .is_some_and(|k| k.ended_here(tenant, key))
    }

    fn gone_before(&self, tenant: &Bytes, key: &Bytes, before: std::time::Instant) -> bool {
        self.answered
            .keys()
            .is_some_and(|k| k.gone_before(tenant, key, before))
    }
}

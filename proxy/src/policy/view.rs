//! A decoded call as a plugin sees it, and a plugin's answer as an action on decoded
//! values: rewrite the `ReplicateConfig`, deny some keys (and merge their errors back
//! into the master's answer), or answer locally. Pure: no frames, sockets or clocks.

use bytes::Bytes;

use super::FailMode;
use super::host::wit;
use crate::calls::put::{self, Put};
use crate::codec::keys::Keys;
use crate::codec::message::{Request, Response};
use crate::codec::types::{ErrorCode, ReplicateConfig, SoftPinAction, Tier, Uuid};

/// What happens to a put-family call after the policy decided.
#[derive(Debug)]
pub enum PutAction {
    /// Forward the received bytes.
    Forward,
    /// Forward this re-encoded request; when `fixup` is set, merge denied keys back into
    /// the master's batch answer.
    Rewrite {
        request: Box<Request>,
        fixup: Option<Fixup>,
    },
    /// Every key refused: answer the client from moongate (`answer`, one error per key
    /// for a batch, the codes in `refused`); nothing goes upstream.
    Answer { answer: Response, refused: Fixup },
}

/// Keys a policy denied out of a batch that was forwarded without them: their errors
/// are put back at their positions in the master's answer, so the client sees one result
/// per key in its own order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fixup {
    pub total: usize,
    /// (position in the client's batch, error), in rising position order.
    pub denied: Vec<(usize, ErrorCode)>,
}

impl Fixup {
    /// Merges the master's answer for the admitted keys with the denied ones. Answers of
    /// other shapes (or of the wrong length) are returned unchanged.
    pub fn apply(&self, resp: Response) -> Response {
        put::merge_denied(resp, self.total, &self.denied)
    }
}

/// Packs keys into one buffer plus end offsets (one copy into the guest for a batch).
pub fn pack_keys<K: AsRef<[u8]>>(keys: impl Iterator<Item = K>) -> wit::PackedKeys {
    let mut bytes = Vec::new();
    let mut ends = Vec::new();
    for k in keys {
        bytes.extend_from_slice(k.as_ref());
        ends.push(bytes.len() as u32);
    }
    wit::PackedKeys { bytes, ends }
}

fn lossy(b: &Bytes) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The plugin's view of a `ReplicateConfig`.
pub fn to_wit_config(c: &ReplicateConfig) -> wit::ReplicateConfig {
    wit::ReplicateConfig {
        replica_num: c.replica_num,
        nof_replica_num: c.nof_replica_num,
        dfs_replica_num: c.dfs_replica_num,
        soft_pin_action: match c.soft_pin_action {
            SoftPinAction::ENABLE => wit::SoftPinAction::Enable,
            SoftPinAction::DISABLE => wit::SoftPinAction::Disable,
            _ => wit::SoftPinAction::Preserve,
        },
        soft_pin_ttl_ms: c.soft_pin_ttl_ms,
        with_hard_pin: c.with_hard_pin,
        preferred_segments: c.preferred_segments.iter().map(lossy).collect(),
        preferred_segment: lossy(&c.preferred_segment),
        prefer_alloc_in_same_node: c.prefer_alloc_in_same_node,
    }
}

/// Applies a plugin's config to the original; fields the WIT does not expose (NoF
/// segments, data type, host id, group ids) keep their values.
pub fn apply_wit_config(orig: &ReplicateConfig, w: &wit::ReplicateConfig) -> ReplicateConfig {
    ReplicateConfig {
        replica_num: w.replica_num,
        nof_replica_num: w.nof_replica_num,
        dfs_replica_num: w.dfs_replica_num,
        soft_pin_action: match w.soft_pin_action {
            wit::SoftPinAction::Enable => SoftPinAction::ENABLE,
            wit::SoftPinAction::Disable => SoftPinAction::DISABLE,
            wit::SoftPinAction::Preserve => SoftPinAction::PRESERVE,
        },
        soft_pin_ttl_ms: w.soft_pin_ttl_ms,
        with_hard_pin: w.with_hard_pin,
        preferred_segments: w
            .preferred_segments
            .iter()
            .map(|s| Bytes::copy_from_slice(s.as_bytes()))
            .collect(),
        preferred_segment: Bytes::copy_from_slice(w.preferred_segment.as_bytes()),
        ..orig.clone()
    }
}

/// A put-family request as the policy sees it.
pub struct PutView<'a> {
    pub kind: wit::PutKind,
    pub client: Uuid,
    pub keys: &'a [Bytes],
    pub sizes: &'a [u64],
    pub config: &'a ReplicateConfig,
}

/// The put-family view of a request, or `None` for other methods.
pub fn put_view(req: &Request) -> Option<PutView<'_>> {
    let p = Put::of(req)?;
    Some(PutView {
        kind: match (p.kind(), p.is_batch()) {
            (put::Kind::Put, false) => wit::PutKind::Put,
            (put::Kind::Upsert, false) => wit::PutKind::Upsert,
            (put::Kind::Put, true) => wit::PutKind::BatchPut,
            (put::Kind::Upsert, true) => wit::PutKind::BatchUpsert,
        },
        client: p.client_id(),
        keys: p.keys(),
        sizes: p.sizes(),
        config: p.config(),
    })
}

/// The plugin's name for a tier.
pub fn wit_tier(t: Tier) -> wit::Tier {
    match t {
        Tier::Memory => wit::Tier::Memory,
        Tier::Nof => wit::Tier::Nof,
        Tier::Disk => wit::Tier::Disk,
        Tier::LocalDisk => wit::Tier::LocalDisk,
        Tier::Dfs => wit::Tier::Dfs,
    }
}

impl PutView<'_> {
    pub fn to_wit(&self) -> wit::PutCall {
        wit::PutCall {
            kind: self.kind,
            client: self.client.to_string(),
            keys: pack_keys(self.keys.iter()),
            sizes: self.sizes.to_vec(),
            config: to_wit_config(self.config),
        }
    }
}

/// The plugin's view of a lookup answer: the keys asked for and, per key, its replicas'
/// tiers and sizes in the master's order (keys with an error have none).
pub fn lookup_call(keys: &Keys, resp: &Response) -> Option<wit::LookupCall> {
    let answers = crate::calls::lookup::results(resp)?;
    if answers.len() != keys.len() {
        return None;
    }
    let mut call = wit::LookupCall {
        keys: pack_keys(keys.iter()),
        counts: Vec::with_capacity(keys.len()),
        tiers: Vec::new(),
        sizes: Vec::new(),
    };
    for a in answers {
        let reps = a.as_ref().map(|l| &l.replicas[..]).unwrap_or(&[]);
        call.counts.push(reps.len() as u32);
        for r in reps {
            call.tiers.push(wit_tier(r.location.tier()));
            call.sizes.push(r.location.size());
        }
    }
    Some(call)
}

/// Applies a lookup decision: per key, the kept replicas in the plugin's order; a key
/// with none left is answered OBJECT_NOT_FOUND (the engine recomputes it). Returns
/// whether anything changed.
pub fn apply_lookup(resp: &mut Response, keep: &[Vec<u32>]) -> bool {
    use crate::codec::types::GetReplicaListResponse;
    fn one(r: &mut Result<GetReplicaListResponse, ErrorCode>, keep: &[u32]) -> bool {
        let Ok(list) = r else {
            return false;
        };
        if keep.is_empty() {
            *r = Err(ErrorCode::OBJECT_NOT_FOUND);
            return true;
        }
        let same = keep.len() == list.replicas.len()
            && keep.iter().enumerate().all(|(i, &k)| i as u32 == k);
        if !same {
            let old = std::mem::take(&mut list.replicas);
            list.replicas = keep
                .iter()
                .filter_map(|&i| old.get(i as usize).cloned())
                .collect();
        }
        !same
    }
    if keep.is_empty() {
        return false;
    }
    let Some(answers) = crate::calls::lookup::results_mut(resp) else {
        return false;
    };
    answers
        .iter_mut()
        .zip(keep)
        .fold(false, |changed, (r, k)| one(r, k) | changed)
}

/// Index into [`super::metrics::DECISIONS`] of an action.
pub fn decision_index(a: &PutAction) -> usize {
    match a {
        PutAction::Forward => 0,
        PutAction::Rewrite { fixup: None, .. } => 1,
        PutAction::Rewrite { fixup: Some(_), .. } => 2,
        PutAction::Answer { .. } => 3,
    }
}

/// Turns a plugin's decision on `req` into what to do on the wire.
pub fn put_action(req: &Request, d: &wit::PutDecision) -> PutAction {
    let Some(put) = Put::of(req) else {
        return PutAction::Forward;
    };
    let config = d.config.as_ref().map(|c| apply_wit_config(put.config(), c));
    let config = config.filter(|c| c != put.config());
    let denied: Vec<(usize, ErrorCode)> = d
        .admissions
        .iter()
        .enumerate()
        .filter_map(|(i, a)| match a {
            wit::Admission::Deny(code) => Some((i, ErrorCode(*code))),
            wit::Admission::Admit => None,
        })
        .collect();
    let n = put.keys().len();
    if !denied.is_empty() && denied.len() == n {
        // Every key refused: answer like the master would, per key for batches.
        let codes: Vec<ErrorCode> = denied.iter().map(|(_, c)| *c).collect();
        return PutAction::Answer {
            answer: put.refused(&codes),
            refused: Fixup { total: n, denied },
        };
    }
    if denied.is_empty() && config.is_none() {
        return PutAction::Forward;
    }
    let mut dropped = vec![false; n];
    for (i, _) in &denied {
        if let Some(d) = dropped.get_mut(*i) {
            *d = true;
        }
    }
    let request = put.rewritten(config, |i| !dropped[i]);
    let fixup = (!denied.is_empty()).then_some(Fixup { total: n, denied });
    PutAction::Rewrite {
        request: Box::new(request),
        fixup,
    }
}

/// The decision a failed plugin call stands for.
pub fn failed_decision(mode: FailMode, keys: usize, code: i32) -> wit::PutDecision {
    match mode {
        FailMode::Open => wit::PutDecision {
            config: None,
            admissions: Vec::new(),
        },
        FailMode::Closed => wit::PutDecision {
            config: None,
            admissions: vec![wit::Admission::Deny(code); keys],
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::message::BatchPutStartArgs;

    fn batch(keys: &[&str]) -> Request {
        Request::BatchPutStart(BatchPutStartArgs {
            client_id: Uuid::default(),
            keys: keys
                .iter()
                .map(|k| Bytes::copy_from_slice(k.as_bytes()))
                .collect(),
            slice_lengths: keys.iter().map(|k| k.len() as u64).collect(),
            config: ReplicateConfig::default(),
            tenant_id: Bytes::from_static(b"default"),
        })
    }

    #[test]
    fn partial_denial_forwards_the_rest_and_merges_in_order() {
        let req = batch(&["a", "bb", "ccc", "dddd"]);
        let d = wit::PutDecision {
            config: None,
            admissions: vec![
                wit::Admission::Admit,
                wit::Admission::Deny(-200),
                wit::Admission::Admit,
                wit::Admission::Deny(-600),
            ],
        };
        let PutAction::Rewrite {
            request,
            fixup: Some(f),
        } = put_action(&req, &d)
        else {
            panic!("expected a rewrite with fixup");
        };
        let Request::BatchPutStart(a) = *request else {
            panic!("a batch stays a batch");
        };
        assert_eq!(
            a.keys,
            vec![Bytes::from_static(b"a"), Bytes::from_static(b"ccc")]
        );
        assert_eq!(a.slice_lengths, vec![1, 3]);
        let merged = f.apply(Response::BatchPutStart(vec![
            Ok(vec![]),
            Err(ErrorCode(-705)),
        ]));
        assert_eq!(
            merged,
            Response::BatchPutStart(vec![
                Ok(vec![]),
                Err(ErrorCode(-200)),
                Err(ErrorCode(-705)),
                Err(ErrorCode(-600)),
            ])
        );
    }

    #[test]
    fn all_denied_is_answered_locally_and_unchanged_is_forwarded() {
        let req = batch(&["a", "b"]);
        let d = failed_decision(FailMode::Closed, 2, -200);
        assert!(
            matches!(put_action(&req, &d), PutAction::Answer { answer: Response::BatchPutStart(v), refused } if v.len() == 2 && refused.denied.len() == 2)
        );
        let same = wit::PutDecision {
            config: Some(to_wit_config(&ReplicateConfig::default())),
            admissions: vec![],
        };
        assert!(matches!(put_action(&req, &same), PutAction::Forward));
    }

    #[test]
    fn lookup_steering_reorders_drops_and_cuts() {
        use crate::codec::types::*;
        let rep = |id: u64, loc: ReplicaLocation| ReplicaDescriptor {
            id,
            location: loc,
            status: ReplicaStatus::COMPLETE,
        };
        let disk = |n: u64| {
            ReplicaLocation::Disk(DiskDescriptor {
                file_path: Bytes::new(),
                object_size: n,
            })
        };
        let list = |reps: Vec<ReplicaDescriptor>| {
            Ok(GetReplicaListResponse {
                replicas: reps,
                lease_ttl_ms: 1,
                object_checksum: None,
            })
        };
        let mut resp = Response::BatchGetReplicaList(vec![
            list(vec![rep(1, disk(10)), rep(2, disk(20))]),
            list(vec![rep(3, disk(30))]),
            Err(ErrorCode::OBJECT_NOT_FOUND),
        ]);
        let keys = Keys::from(vec![
            Bytes::from_static(b"a"),
            Bytes::from_static(b"b"),
            Bytes::from_static(b"c"),
        ]);
        let call = lookup_call(&keys, &resp).unwrap();
        assert_eq!(call.counts, vec![2, 1, 0]);
        assert_eq!(call.sizes, vec![10, 20, 30]);
        assert!(
            lookup_call(&keys.slice(0..2), &resp).is_none(),
            "key count must match"
        );
        assert!(
            !apply_lookup(&mut resp.clone(), &[vec![0, 1], vec![0], vec![]]),
            "identity"
        );
        assert!(apply_lookup(&mut resp, &[vec![1], vec![], vec![]]));
        let Response::BatchGetReplicaList(v) = resp else {
            unreachable!()
        };
        assert_eq!(
            v[0].as_ref()
                .unwrap()
                .replicas
                .iter()
                .map(|r| r.id)
                .collect::<Vec<_>>(),
            vec![2]
        );
        assert_eq!(v[1], Err(ErrorCode::OBJECT_NOT_FOUND));
        assert_eq!(v[2], Err(ErrorCode::OBJECT_NOT_FOUND));
    }

    #[test]
    fn config_rewrite_keeps_fields_the_plugin_cannot_see() {
        let orig = ReplicateConfig {
            host_id: Bytes::from_static(b"node-7"),
            ..ReplicateConfig::default()
        };
        let mut w = to_wit_config(&orig);
        w.preferred_segment = "127.0.0.1:1234".into();
        w.replica_num = 2;
        let c = apply_wit_config(&orig, &w);
        assert_eq!(&c.host_id[..], b"node-7");
        assert_eq!(&c.preferred_segment[..], b"127.0.0.1:1234");
        assert_eq!(c.replica_num, 2);
    }
}

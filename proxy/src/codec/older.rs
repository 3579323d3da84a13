//! The struct layouts of Mooncake 0.3.11.post1 and 0.3.12.post1 for the methods moongate
//! decodes, and their mapping to and from the one internal model (the 0.3.13 layout of
//! [`super::message`]).
//!
//! Every struct_pack body carries its type code, and within one method different
//! layouts have different codes: the code picks the schema ([`request_schema`],
//! [`response_schema`]). A body is decoded into the internal model, where a field an
//! older release lacks is absent (`None`, empty, zero: the value that release means by
//! not having it), and re-encoded in the schema it arrived in, byte-identical when
//! unchanged. A policy may set a field the arrival schema cannot carry (a soft-pin TTL
//! on 0.3.12, say): [`Request::lost_in`] names such fields, so the face can count the
//! drop; the encoder never writes a layout the master would reject.
//!
//! Methods whose layout did not change share the 0.3.13 codes and decode as 0.3.13.
//! Source of the layouts: the project's Mooncake notes (`versions.md`, verified against
//! each release's master); the type codes below are checked against its table.

use bytes::{Bytes, BytesMut};

use super::error::DecodeError;
use super::keys::Keys;
use super::message::*;
use super::method::Method;
use super::pack::{BodyStyle, Pack, Reader, Schema, Writer, decode_message, encode_message};
use super::types::*;
use crate::pack_struct;

pack_struct! {
    /// `ReplicateConfig` of 0.3.11: a soft pin is a bool, no DFS replicas, no TTL.
    pub struct ReplicateConfig11 {
        pub replica_num: u64,
        pub nof_replica_num: u64,
        pub with_soft_pin: bool,
        pub with_hard_pin: bool,
        pub preferred_segments: Vec<Bytes>,
        pub preferred_segment: Bytes,
        pub preferred_nof_segments: Vec<Bytes>,
        pub prefer_alloc_in_same_node: bool,
        pub data_type: ObjectDataType,
    }
}

pack_struct! {
    /// `ReplicateConfig` of 0.3.12: 0.3.11's, plus `host_id` and `group_ids`.
    pub struct ReplicateConfig12 {
        pub replica_num: u64,
        pub nof_replica_num: u64,
        pub with_soft_pin: bool,
        pub with_hard_pin: bool,
        pub preferred_segments: Vec<Bytes>,
        pub preferred_segment: Bytes,
        pub preferred_nof_segments: Vec<Bytes>,
        pub prefer_alloc_in_same_node: bool,
        pub data_type: ObjectDataType,
        pub host_id: Bytes,
        pub group_ids: Option<Vec<Bytes>>,
    }
}

/// The soft pin as a bool: only `ENABLE` pins (0.3.11 / 0.3.12 have no TTL and no
/// "disable").
fn pin_of(with_soft_pin: bool) -> SoftPinAction {
    if with_soft_pin {
        SoftPinAction::ENABLE
    } else {
        SoftPinAction::PRESERVE
    }
}

impl From<ReplicateConfig12> for ReplicateConfig {
    fn from(c: ReplicateConfig12) -> Self {
        ReplicateConfig {
            replica_num: c.replica_num,
            nof_replica_num: c.nof_replica_num,
            dfs_replica_num: 0,
            soft_pin_action: pin_of(c.with_soft_pin),
            soft_pin_ttl_ms: None,
            with_hard_pin: c.with_hard_pin,
            preferred_segments: c.preferred_segments,
            preferred_segment: c.preferred_segment,
            preferred_nof_segments: c.preferred_nof_segments,
            prefer_alloc_in_same_node: c.prefer_alloc_in_same_node,
            data_type: c.data_type,
            host_id: c.host_id,
            group_ids: c.group_ids,
        }
    }
}

impl From<ReplicateConfig11> for ReplicateConfig {
    fn from(c: ReplicateConfig11) -> Self {
        ReplicateConfig12 {
            replica_num: c.replica_num,
            nof_replica_num: c.nof_replica_num,
            with_soft_pin: c.with_soft_pin,
            with_hard_pin: c.with_hard_pin,
            preferred_segments: c.preferred_segments,
            preferred_segment: c.preferred_segment,
            preferred_nof_segments: c.preferred_nof_segments,
            prefer_alloc_in_same_node: c.prefer_alloc_in_same_node,
            data_type: c.data_type,
            host_id: Bytes::new(),
            group_ids: None,
        }
        .into()
    }
}

fn config12(c: &ReplicateConfig) -> ReplicateConfig12 {
    ReplicateConfig12 {
        replica_num: c.replica_num,
        nof_replica_num: c.nof_replica_num,
        with_soft_pin: c.soft_pin_action == SoftPinAction::ENABLE,
        with_hard_pin: c.with_hard_pin,
        preferred_segments: c.preferred_segments.clone(),
        preferred_segment: c.preferred_segment.clone(),
        preferred_nof_segments: c.preferred_nof_segments.clone(),
        prefer_alloc_in_same_node: c.prefer_alloc_in_same_node,
        data_type: c.data_type,
        host_id: c.host_id.clone(),
        group_ids: c.group_ids.clone(),
    }
}

fn config11(c: &ReplicateConfig) -> ReplicateConfig11 {
    let c = config12(c);
    ReplicateConfig11 {
        replica_num: c.replica_num,
        nof_replica_num: c.nof_replica_num,
        with_soft_pin: c.with_soft_pin,
        with_hard_pin: c.with_hard_pin,
        preferred_segments: c.preferred_segments,
        preferred_segment: c.preferred_segment,
        preferred_nof_segments: c.preferred_nof_segments,
        prefer_alloc_in_same_node: c.prefer_alloc_in_same_node,
        data_type: c.data_type,
    }
}

/// The fields of `c` that `schema` cannot carry (set to something else than "absent").
fn config_lost(c: &ReplicateConfig, schema: Schema, out: &mut Vec<&'static str>) {
    if schema == Schema::V0_3_13 {
        return;
    }
    if c.dfs_replica_num != 0 {
        out.push("dfs_replica_num");
    }
    if c.soft_pin_ttl_ms.is_some() {
        out.push("soft_pin_ttl_ms");
    }
    if c.soft_pin_action == SoftPinAction::DISABLE {
        out.push("soft_pin_action");
    }
    if schema == Schema::V0_3_11 {
        if !c.host_id.is_empty() {
            out.push("host_id");
        }
        if c.group_ids.is_some() {
            out.push("group_ids");
        }
    }
}

pack_struct! {
    /// `Segment` of 0.3.11: no `host_id`.
    pub struct Segment11 {
        pub id: Uuid,
        pub name: Bytes,
        pub base: u64,
        pub size: u64,
        pub te_endpoint: Bytes,
        pub protocol: Bytes,
    }
}

impl From<Segment11> for Segment {
    fn from(s: Segment11) -> Self {
        Segment {
            id: s.id,
            name: s.name,
            base: s.base,
            size: s.size,
            te_endpoint: s.te_endpoint,
            protocol: s.protocol,
            host_id: Bytes::new(),
        }
    }
}

fn segment11(s: &Segment) -> Segment11 {
    Segment11 {
        id: s.id,
        name: s.name.clone(),
        base: s.base,
        size: s.size,
        te_endpoint: s.te_endpoint.clone(),
        protocol: s.protocol.clone(),
    }
}

/// `Replica::Descriptor::descriptor_variant` before 0.3.13: four alternatives (no DFS).
/// The bytes of indexes 0-3 are the same as 0.3.13's; only the literal differs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location4(pub ReplicaLocation);

impl Pack for Location4 {
    fn write_literal(out: &mut Vec<u8>) {
        out.push(0x86);
        MemoryDescriptor::write_literal(out);
        NofDescriptor::write_literal(out);
        DiskDescriptor::write_literal(out);
        LocalDiskDescriptor::write_literal(out);
        out.push(0xff);
    }
    fn max_len(&self) -> usize {
        self.0.max_len()
    }
    fn encode(&self, w: &mut Writer<'_>) {
        self.0.encode(w)
    }
    fn decode(r: &mut Reader) -> Result<Self, DecodeError> {
        let at = r.position();
        let l = ReplicaLocation::decode(r)?;
        if let ReplicaLocation::DistributedFs(_) = l {
            return Err(DecodeError::BadVariant { at, index: 4 });
        }
        Ok(Location4(l))
    }
}

pack_struct! {
    /// `Replica::Descriptor` before 0.3.13.
    pub struct ReplicaDescriptor4 {
        pub id: u64,
        pub location: Location4,
        pub status: ReplicaStatus,
    }
}

pack_struct! {
    /// `GetReplicaListResponse` before 0.3.13: no `object_checksum`.
    pub struct GetReplicaListResponse11 {
        pub replicas: Vec<ReplicaDescriptor4>,
        pub lease_ttl_ms: u64,
    }
}

impl From<ReplicaDescriptor4> for ReplicaDescriptor {
    fn from(d: ReplicaDescriptor4) -> Self {
        ReplicaDescriptor {
            id: d.id,
            location: d.location.0,
            status: d.status,
        }
    }
}

fn desc4(d: &ReplicaDescriptor) -> ReplicaDescriptor4 {
    ReplicaDescriptor4 {
        id: d.id,
        location: Location4(d.location.clone()),
        status: d.status,
    }
}

impl From<GetReplicaListResponse11> for GetReplicaListResponse {
    fn from(r: GetReplicaListResponse11) -> Self {
        GetReplicaListResponse {
            replicas: r.replicas.into_iter().map(Into::into).collect(),
            lease_ttl_ms: r.lease_ttl_ms,
            object_checksum: None,
        }
    }
}

fn grlr11(r: &GetReplicaListResponse) -> GetReplicaListResponse11 {
    GetReplicaListResponse11 {
        replicas: r.replicas.iter().map(desc4).collect(),
        lease_ttl_ms: r.lease_ttl_ms,
    }
}

// Argument roots. 0.3.11 has no tenants; 0.3.12 added a trailing `tenant_id`; 0.3.13
// changed ReplicateConfig and made the end calls carry `ObjectMeta`.

pack_struct! {
    /// `PutStart` / `UpsertStart` of 0.3.11.
    pub struct PutStartArgs11 {
        pub client_id: Uuid,
        pub key: Bytes,
        pub slice_length: u64,
        pub config: ReplicateConfig11,
    }
}
pack_struct! {
    /// `PutStart` / `UpsertStart` of 0.3.12.
    pub struct PutStartArgs12 {
        pub client_id: Uuid,
        pub key: Bytes,
        pub slice_length: u64,
        pub config: ReplicateConfig12,
        pub tenant_id: Bytes,
    }
}
pack_struct! {
    /// `BatchPutStart` / `BatchUpsertStart` of 0.3.11.
    pub struct BatchPutStartArgs11 {
        pub client_id: Uuid,
        pub keys: Vec<Bytes>,
        pub slice_lengths: Vec<u64>,
        pub config: ReplicateConfig11,
    }
}
pack_struct! {
    /// `BatchPutStart` / `BatchUpsertStart` of 0.3.12.
    pub struct BatchPutStartArgs12 {
        pub client_id: Uuid,
        pub keys: Vec<Bytes>,
        pub slice_lengths: Vec<u64>,
        pub config: ReplicateConfig12,
        pub tenant_id: Bytes,
    }
}
pack_struct! {
    /// `PutEnd` / `UpsertEnd` / `PutRevoke` / `UpsertRevoke` of 0.3.11 (a bare key).
    pub struct KeyEndArgs11 { pub client_id: Uuid, pub key: Bytes, pub replica_type: ReplicaType }
}
pack_struct! {
    /// `PutEnd` / `UpsertEnd` of 0.3.12 (a bare key; `PutRevoke` of 0.3.12 is 0.3.13's).
    pub struct KeyEndArgs12 {
        pub client_id: Uuid,
        pub key: Bytes,
        pub replica_type: ReplicaType,
        pub tenant_id: Bytes,
    }
}
pack_struct! {
    /// `BatchPutEnd` / `BatchPutRevoke` of 0.3.11 (bare keys).
    pub struct KeysEndArgs11 {
        pub client_id: Uuid,
        pub keys: Vec<Bytes>,
        pub replica_type: ReplicaType,
    }
}
pack_struct! {
    /// `BatchPutEnd` of 0.3.12 (bare keys; `BatchPutRevoke` of 0.3.12 is 0.3.13's).
    pub struct KeysEndArgs12 {
        pub client_id: Uuid,
        pub keys: Vec<Bytes>,
        pub replica_type: ReplicaType,
        pub tenant_id: Bytes,
    }
}
pack_struct! {
    /// `BatchUpsertEnd` of 0.3.11 (no replica type in any release).
    pub struct BatchUpsertEndArgs11 { pub client_id: Uuid, pub keys: Vec<Bytes> }
}
pack_struct! {
    /// `BatchUpsertEnd` of 0.3.12.
    pub struct BatchUpsertEndArgs12 { pub client_id: Uuid, pub keys: Vec<Bytes>, pub tenant_id: Bytes }
}
pack_struct! {
    /// `Remove` of 0.3.11.
    pub struct RemoveArgs11 { pub key: Bytes, pub force: bool }
}
pack_struct! {
    /// `MountSegment` of 0.3.11.
    pub struct MountSegmentArgs11 { pub segment: Segment11, pub client_id: Uuid }
}
pack_struct! {
    /// `ReMountSegment` of 0.3.11.
    pub struct ReMountSegmentArgs11 { pub segments: Vec<Segment11>, pub client_id: Uuid }
}

fn meta(key: Bytes) -> ObjectMeta {
    ObjectMeta {
        key,
        object_checksum: None,
    }
}

/// The type code of a body (hash head, metainfo bit cleared); `None` when too short.
pub fn code_of(body: &[u8]) -> Option<u32> {
    let h: [u8; 4] = body.get(..4)?.try_into().ok()?;
    Some(u32::from_le_bytes(h) & !1)
}

/// The older schema a request body of `method` with type code `code` uses, if any.
pub fn request_schema(method: Method, code: u32) -> Option<Schema> {
    let (v11, v12) = older_codes(method)?;
    if code == v11 {
        Some(Schema::V0_3_11)
    } else if Some(code) == v12 {
        Some(Schema::V0_3_12)
    } else {
        None
    }
}

/// Whether some release lays `method`'s call out differently from 0.3.13 (and so, for
/// the put and lookup families, its answer): a caller must know the master's release
/// to send it. Ping, ServiceReady, UnmountSegment and the like have one layout.
pub fn varies(method: Method) -> bool {
    older_codes(method).is_some()
}

/// The type codes of `method`'s 0.3.11 and (where it differs from 0.3.13's) 0.3.12
/// argument layouts.
fn older_codes(method: Method) -> Option<(u32, Option<u32>)> {
    use Method::*;
    Some(match method {
        PutStart | UpsertStart => (
            schema!(PutStartArgs11).code,
            Some(schema!(PutStartArgs12).code),
        ),
        BatchPutStart | BatchUpsertStart => (
            schema!(BatchPutStartArgs11).code,
            Some(schema!(BatchPutStartArgs12).code),
        ),
        PutEnd | UpsertEnd => (schema!(KeyEndArgs11).code, Some(schema!(KeyEndArgs12).code)),
        PutRevoke => (schema!(KeyEndArgs11).code, None),
        BatchPutEnd => (
            schema!(KeysEndArgs11).code,
            Some(schema!(KeysEndArgs12).code),
        ),
        BatchPutRevoke => (schema!(KeysEndArgs11).code, None),
        BatchUpsertEnd => (
            schema!(BatchUpsertEndArgs11).code,
            Some(schema!(BatchUpsertEndArgs12).code),
        ),
        GetReplicaList | ExistKey => (schema!(Bytes).code, None),
        BatchGetReplicaList | BatchExistKey => (schema!(Vec<Bytes>).code, None),
        Remove => (schema!(RemoveArgs11).code, None),
        // Not in the release table: a bare `bool force`, seen from the 0.3.11 client.
        RemoveAll => (schema!(bool).code, None),
        MountSegment => (schema!(MountSegmentArgs11).code, None),
        ReMountSegment => (schema!(ReMountSegmentArgs11).code, None),
        _ => return None,
    })
}

/// Decodes a request body in an older `schema` into the internal model.
pub fn decode_request(
    method: Method,
    schema: Schema,
    body: &Bytes,
) -> Result<(Request, BodyStyle), DecodeError> {
    use Method::*;
    use Schema::*;
    macro_rules! dec {
        ($t:ty) => {{
            let (v, s) = decode_message::<$t>(body, schema!($t))?;
            (v, BodyStyle { schema, ..s })
        }};
    }
    let put = |client_id, key, slice_length, config, tenant_id| PutStartArgs {
        client_id,
        key,
        slice_length,
        config,
        tenant_id,
    };
    Ok(match (method, schema) {
        (PutStart | UpsertStart, V0_3_11) => {
            let (a, s) = dec!(PutStartArgs11);
            let r = put(
                a.client_id,
                a.key,
                a.slice_length,
                a.config.into(),
                Bytes::new(),
            );
            (start_request(method, r), s)
        }
        (PutStart | UpsertStart, _) => {
            let (a, s) = dec!(PutStartArgs12);
            let r = put(
                a.client_id,
                a.key,
                a.slice_length,
                a.config.into(),
                a.tenant_id,
            );
            (start_request(method, r), s)
        }
        (BatchPutStart | BatchUpsertStart, V0_3_11) => {
            let (a, s) = dec!(BatchPutStartArgs11);
            let r = BatchPutStartArgs {
                client_id: a.client_id,
                keys: a.keys,
                slice_lengths: a.slice_lengths,
                config: a.config.into(),
                tenant_id: Bytes::new(),
            };
            (batch_start_request(method, r), s)
        }
        (BatchPutStart | BatchUpsertStart, _) => {
            let (a, s) = dec!(BatchPutStartArgs12);
            let r = BatchPutStartArgs {
                client_id: a.client_id,
                keys: a.keys,
                slice_lengths: a.slice_lengths,
                config: a.config.into(),
                tenant_id: a.tenant_id,
            };
            (batch_start_request(method, r), s)
        }
        (PutEnd | UpsertEnd | PutRevoke, V0_3_11) => {
            let (a, s) = dec!(KeyEndArgs11);
            (
                key_end(method, a.client_id, a.key, a.replica_type, Bytes::new()),
                s,
            )
        }
        (PutEnd | UpsertEnd, _) => {
            let (a, s) = dec!(KeyEndArgs12);
            (
                key_end(method, a.client_id, a.key, a.replica_type, a.tenant_id),
                s,
            )
        }
        (BatchPutEnd | BatchPutRevoke, V0_3_11) => {
            let (a, s) = dec!(KeysEndArgs11);
            (
                keys_end(method, a.client_id, a.keys, a.replica_type, Bytes::new()),
                s,
            )
        }
        (BatchPutEnd, _) => {
            let (a, s) = dec!(KeysEndArgs12);
            (
                keys_end(method, a.client_id, a.keys, a.replica_type, a.tenant_id),
                s,
            )
        }
        (BatchUpsertEnd, V0_3_11) => {
            let (a, s) = dec!(BatchUpsertEndArgs11);
            let r = BatchUpsertEndArgs {
                client_id: a.client_id,
                object_metas: a.keys.into_iter().map(meta).collect(),
                tenant_id: Bytes::new(),
            };
            (Request::BatchUpsertEnd(r), s)
        }
        (BatchUpsertEnd, _) => {
            let (a, s) = dec!(BatchUpsertEndArgs12);
            let r = BatchUpsertEndArgs {
                client_id: a.client_id,
                object_metas: a.keys.into_iter().map(meta).collect(),
                tenant_id: a.tenant_id,
            };
            (Request::BatchUpsertEnd(r), s)
        }
        (GetReplicaList | ExistKey, V0_3_11) => {
            let (key, s) = dec!(Bytes);
            let a = KeyArgs {
                key,
                tenant_id: Bytes::new(),
            };
            let r = if method == ExistKey {
                Request::ExistKey(a)
            } else {
                Request::GetReplicaList(a)
            };
            (r, s)
        }
        (BatchGetReplicaList | BatchExistKey, V0_3_11) => {
            let (keys, s) = dec!(Keys);
            let a = KeysArgs {
                keys,
                tenant_id: Bytes::new(),
            };
            let r = if method == BatchExistKey {
                Request::BatchExistKey(a)
            } else {
                Request::BatchGetReplicaList(a)
            };
            (r, s)
        }
        (Remove, V0_3_11) => {
            let (a, s) = dec!(RemoveArgs11);
            let r = RemoveArgs {
                key: a.key,
                force: a.force,
                tenant_id: Bytes::new(),
            };
            (Request::Remove(r), s)
        }
        (RemoveAll, V0_3_11) => {
            let (force, s) = dec!(bool);
            let r = RemoveAllArgs {
                force,
                tenant_id: Bytes::new(),
            };
            (Request::RemoveAll(r), s)
        }
        (MountSegment, V0_3_11) => {
            let (a, s) = dec!(MountSegmentArgs11);
            let r = MountSegmentArgs {
                segment: a.segment.into(),
                client_id: a.client_id,
            };
            (Request::MountSegment(r), s)
        }
        (ReMountSegment, V0_3_11) => {
            let (a, s) = dec!(ReMountSegmentArgs11);
            let r = ReMountSegmentArgs {
                segments: a.segments.into_iter().map(Into::into).collect(),
                client_id: a.client_id,
            };
            (Request::ReMountSegment(r), s)
        }
        _ => {
            return Err(DecodeError::TypeMismatch {
                expected: 0,
                found: code_of(body).unwrap_or(0),
            });
        }
    })
}

fn start_request(method: Method, a: PutStartArgs) -> Request {
    if method == Method::UpsertStart {
        Request::UpsertStart(a)
    } else {
        Request::PutStart(a)
    }
}

fn batch_start_request(method: Method, a: BatchPutStartArgs) -> Request {
    if method == Method::BatchUpsertStart {
        Request::BatchUpsertStart(a)
    } else {
        Request::BatchPutStart(a)
    }
}

fn key_end(
    method: Method,
    client_id: Uuid,
    key: Bytes,
    replica_type: ReplicaType,
    tenant_id: Bytes,
) -> Request {
    match method {
        Method::PutRevoke => Request::PutRevoke(PutRevokeArgs {
            client_id,
            key,
            replica_type,
            tenant_id,
        }),
        _ => {
            let a = PutEndArgs {
                client_id,
                object_meta: meta(key),
                replica_type,
                tenant_id,
            };
            if method == Method::UpsertEnd {
                Request::UpsertEnd(a)
            } else {
                Request::PutEnd(a)
            }
        }
    }
}

fn keys_end(
    method: Method,
    client_id: Uuid,
    keys: Vec<Bytes>,
    replica_type: ReplicaType,
    tenant_id: Bytes,
) -> Request {
    if method == Method::BatchPutRevoke {
        Request::BatchPutRevoke(BatchPutRevokeArgs {
            client_id,
            keys,
            replica_type,
            tenant_id,
        })
    } else {
        Request::BatchPutEnd(BatchPutEndArgs {
            client_id,
            object_metas: keys.into_iter().map(meta).collect(),
            replica_type,
            tenant_id,
        })
    }
}

/// Encodes `req` in the older schema of `style` (fields it cannot carry are left out:
/// see [`Request::lost_in`]). `false` when `req`'s method has no such layout (the caller
/// then encodes it as 0.3.13).
pub fn encode_request(req: &Request, style: BodyStyle, out: &mut BytesMut) -> bool {
    use Schema::*;
    macro_rules! enc {
        ($t:ty, $v:expr) => {{
            encode_message::<$t>(&$v, schema!($t), style, out);
            true
        }};
    }
    let v11 = style.schema == V0_3_11;
    match req {
        Request::PutStart(a) | Request::UpsertStart(a) => {
            if v11 {
                enc!(
                    PutStartArgs11,
                    PutStartArgs11 {
                        client_id: a.client_id,
                        key: a.key.clone(),
                        slice_length: a.slice_length,
                        config: config11(&a.config),
                    }
                )
            } else {
                enc!(
                    PutStartArgs12,
                    PutStartArgs12 {
                        client_id: a.client_id,
                        key: a.key.clone(),
                        slice_length: a.slice_length,
                        config: config12(&a.config),
                        tenant_id: a.tenant_id.clone(),
                    }
                )
            }
        }
        Request::BatchPutStart(a) | Request::BatchUpsertStart(a) => {
            if v11 {
                enc!(
                    BatchPutStartArgs11,
                    BatchPutStartArgs11 {
                        client_id: a.client_id,
                        keys: a.keys.clone(),
                        slice_lengths: a.slice_lengths.clone(),
                        config: config11(&a.config),
                    }
                )
            } else {
                enc!(
                    BatchPutStartArgs12,
                    BatchPutStartArgs12 {
                        client_id: a.client_id,
                        keys: a.keys.clone(),
                        slice_lengths: a.slice_lengths.clone(),
                        config: config12(&a.config),
                        tenant_id: a.tenant_id.clone(),
                    }
                )
            }
        }
        Request::PutEnd(a) | Request::UpsertEnd(a) => {
            let key = a.object_meta.key.clone();
            if v11 {
                enc!(
                    KeyEndArgs11,
                    KeyEndArgs11 {
                        client_id: a.client_id,
                        key,
                        replica_type: a.replica_type,
                    }
                )
            } else {
                enc!(
                    KeyEndArgs12,
                    KeyEndArgs12 {
                        client_id: a.client_id,
                        key,
                        replica_type: a.replica_type,
                        tenant_id: a.tenant_id.clone(),
                    }
                )
            }
        }
        Request::PutRevoke(a) if v11 => enc!(
            KeyEndArgs11,
            KeyEndArgs11 {
                client_id: a.client_id,
                key: a.key.clone(),
                replica_type: a.replica_type,
            }
        ),
        Request::BatchPutEnd(a) => {
            let keys: Vec<Bytes> = a.object_metas.iter().map(|m| m.key.clone()).collect();
            if v11 {
                enc!(
                    KeysEndArgs11,
                    KeysEndArgs11 {
                        client_id: a.client_id,
                        keys,
                        replica_type: a.replica_type,
                    }
                )
            } else {
                enc!(
                    KeysEndArgs12,
                    KeysEndArgs12 {
                        client_id: a.client_id,
                        keys,
                        replica_type: a.replica_type,
                        tenant_id: a.tenant_id.clone(),
                    }
                )
            }
        }
        Request::BatchPutRevoke(a) if v11 => enc!(
            KeysEndArgs11,
            KeysEndArgs11 {
                client_id: a.client_id,
                keys: a.keys.clone(),
                replica_type: a.replica_type,
            }
        ),
        Request::BatchUpsertEnd(a) => {
            let keys: Vec<Bytes> = a.object_metas.iter().map(|m| m.key.clone()).collect();
            if v11 {
                enc!(
                    BatchUpsertEndArgs11,
                    BatchUpsertEndArgs11 {
                        client_id: a.client_id,
                        keys,
                    }
                )
            } else {
                enc!(
                    BatchUpsertEndArgs12,
                    BatchUpsertEndArgs12 {
                        client_id: a.client_id,
                        keys,
                        tenant_id: a.tenant_id.clone(),
                    }
                )
            }
        }
        Request::GetReplicaList(a) | Request::ExistKey(a) if v11 => enc!(Bytes, a.key.clone()),
        Request::BatchGetReplicaList(a) | Request::BatchExistKey(a) if v11 => {
            enc!(Keys, a.keys.clone())
        }
        Request::Remove(a) if v11 => enc!(
            RemoveArgs11,
            RemoveArgs11 {
                key: a.key.clone(),
                force: a.force,
            }
        ),
        Request::RemoveAll(a) if v11 => enc!(bool, a.force),
        Request::MountSegment(a) if v11 => enc!(
            MountSegmentArgs11,
            MountSegmentArgs11 {
                segment: segment11(&a.segment),
                client_id: a.client_id,
            }
        ),
        Request::ReMountSegment(a) if v11 => enc!(
            ReMountSegmentArgs11,
            ReMountSegmentArgs11 {
                segments: a.segments.iter().map(segment11).collect(),
                client_id: a.client_id,
            }
        ),
        _ => false,
    }
}

/// Fields of `req` set to values `schema` cannot carry (they are left out when it is
/// encoded in that schema).
pub fn lost_in(req: &Request, schema: Schema) -> Vec<&'static str> {
    let mut out = Vec::new();
    if schema == Schema::V0_3_13 {
        return out;
    }
    let checksum = |m: &ObjectMeta, out: &mut Vec<&'static str>| {
        if m.object_checksum.is_some() {
            out.push("object_checksum");
        }
    };
    let tenant = |t: &Bytes, out: &mut Vec<&'static str>| {
        if schema == Schema::V0_3_11 && !t.is_empty() {
            out.push("tenant_id");
        }
    };
    match req {
        Request::PutStart(a) | Request::UpsertStart(a) => {
            config_lost(&a.config, schema, &mut out);
            tenant(&a.tenant_id, &mut out);
        }
        Request::BatchPutStart(a) | Request::BatchUpsertStart(a) => {
            config_lost(&a.config, schema, &mut out);
            tenant(&a.tenant_id, &mut out);
        }
        Request::PutEnd(a) | Request::UpsertEnd(a) => {
            checksum(&a.object_meta, &mut out);
            tenant(&a.tenant_id, &mut out);
        }
        Request::BatchPutEnd(a) => {
            a.object_metas.iter().for_each(|m| checksum(m, &mut out));
            tenant(&a.tenant_id, &mut out);
        }
        Request::BatchUpsertEnd(a) => {
            a.object_metas.iter().for_each(|m| checksum(m, &mut out));
            tenant(&a.tenant_id, &mut out);
        }
        Request::RemoveAll(a) => tenant(&a.tenant_id, &mut out),
        Request::Remove(a) => tenant(&a.tenant_id, &mut out),
        _ => {}
    }
    out.dedup();
    out
}

/// The release a decoded request of `method` in `schema` identifies: any older layout
/// names its release; a 0.3.13 layout does only for the methods whose layout changed in
/// 0.3.13 (the others are shared with 0.3.12).
pub fn identifies(method: Method, schema: Schema) -> Option<Schema> {
    use Method::*;
    match (schema, method) {
        (Schema::V0_3_11 | Schema::V0_3_12, _) => Some(schema),
        (
            _,
            PutStart | UpsertStart | BatchPutStart | BatchUpsertStart | PutEnd | UpsertEnd
            | BatchPutEnd | BatchUpsertEnd,
        ) => Some(Schema::V0_3_13),
        _ => None,
    }
}

/// The older schema a successful response body of `method` with type code `code`
/// uses, if any (the answers whose replica descriptors had four alternatives).
pub fn response_schema(method: Method, code: u32) -> Option<Schema> {
    use Method::*;
    let old = match method {
        PutStart | UpsertStart => schema!(Expected<Vec<ReplicaDescriptor4>>).code,
        BatchPutStart | BatchUpsertStart => schema!(Vec<Expected<Vec<ReplicaDescriptor4>>>).code,
        GetReplicaList => schema!(Expected<GetReplicaListResponse11>).code,
        BatchGetReplicaList => schema!(Vec<Expected<GetReplicaListResponse11>>).code,
        _ => return None,
    };
    // 0.3.11 and 0.3.12 answer alike; 0.3.12 is named (the newer of the two).
    (code == old).then_some(Schema::V0_3_12)
}

/// Decodes a successful response body in an older `schema` into the internal model.
pub fn decode_response(
    method: Method,
    schema: Schema,
    body: &Bytes,
) -> Result<(Response, BodyStyle), DecodeError> {
    use Method::*;
    macro_rules! dec {
        ($t:ty) => {{
            let (v, s) = decode_message::<$t>(body, schema!($t))?;
            (v, BodyStyle { schema, ..s })
        }};
    }
    let list = |v: Vec<ReplicaDescriptor4>| v.into_iter().map(Into::into).collect();
    Ok(match method {
        PutStart | UpsertStart => {
            let (v, s) = dec!(Expected<Vec<ReplicaDescriptor4>>);
            let v = v.map(list);
            let r = if method == UpsertStart {
                Response::UpsertStart(v)
            } else {
                Response::PutStart(v)
            };
            (r, s)
        }
        BatchPutStart | BatchUpsertStart => {
            let (v, s) = dec!(Vec<Expected<Vec<ReplicaDescriptor4>>>);
            let v = v.into_iter().map(|e| e.map(list)).collect();
            let r = if method == BatchUpsertStart {
                Response::BatchUpsertStart(v)
            } else {
                Response::BatchPutStart(v)
            };
            (r, s)
        }
        GetReplicaList => {
            let (v, s) = dec!(Expected<GetReplicaListResponse11>);
            (Response::GetReplicaList(v.map(Into::into)), s)
        }
        BatchGetReplicaList => {
            let (v, s) = dec!(Vec<Expected<GetReplicaListResponse11>>);
            let v = v.into_iter().map(|e| e.map(Into::into)).collect();
            (Response::BatchGetReplicaList(v), s)
        }
        _ => {
            return Err(DecodeError::TypeMismatch {
                expected: 0,
                found: code_of(body).unwrap_or(0),
            });
        }
    })
}

/// Encodes `resp` in the older schema of `style`; `false` when its method has no such
/// layout.
pub fn encode_response(resp: &Response, style: BodyStyle, out: &mut BytesMut) -> bool {
    macro_rules! enc {
        ($t:ty, $v:expr) => {{
            encode_message::<$t>(&$v, schema!($t), style, out);
            true
        }};
    }
    let list = |v: &Vec<ReplicaDescriptor>| v.iter().map(desc4).collect::<Vec<_>>();
    match resp {
        Response::PutStart(v) | Response::UpsertStart(v) => {
            enc!(
                Expected<Vec<ReplicaDescriptor4>>,
                v.as_ref().map(list).map_err(|e| *e)
            )
        }
        Response::BatchPutStart(v) | Response::BatchUpsertStart(v) => enc!(
            Vec<Expected<Vec<ReplicaDescriptor4>>>,
            v.iter()
                .map(|e| e.as_ref().map(list).map_err(|e| *e))
                .collect::<Vec<_>>()
        ),
        Response::GetReplicaList(v) => enc!(
            Expected<GetReplicaListResponse11>,
            v.as_ref().map(grlr11).map_err(|e| *e)
        ),
        Response::BatchGetReplicaList(v) => enc!(
            Vec<Expected<GetReplicaListResponse11>>,
            v.iter()
                .map(|e| e.as_ref().map(grlr11).map_err(|e| *e))
                .collect::<Vec<_>>()
        ),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Method::*;
    use Schema::*;

    fn sample(m: Method, schema: Schema) -> Request {
        let id = Uuid {
            first: 7,
            second: 9,
        };
        let t = if schema == V0_3_11 {
            Bytes::new()
        } else {
            Bytes::from_static(b"default")
        };
        let k = |s: &'static str| Bytes::from_static(s.as_bytes());
        let config = ReplicateConfig {
            replica_num: 2,
            soft_pin_action: SoftPinAction::ENABLE,
            preferred_segment: k("10.0.0.1:1"),
            ..ReplicateConfig::default()
        };
        let start = PutStartArgs {
            client_id: id,
            key: k("a"),
            slice_length: 5,
            config: config.clone(),
            tenant_id: t.clone(),
        };
        let batch = BatchPutStartArgs {
            client_id: id,
            keys: vec![k("a"), k("b")],
            slice_lengths: vec![5, 6],
            config,
            tenant_id: t.clone(),
        };
        let end = PutEndArgs {
            client_id: id,
            object_meta: meta(k("a")),
            replica_type: ReplicaType::ALL,
            tenant_id: t.clone(),
        };
        let metas = vec![meta(k("a")), meta(k("b"))];
        let segment = Segment {
            id,
            name: k("seg"),
            base: 4096,
            size: 1 << 20,
            te_endpoint: k("127.0.0.1:2"),
            protocol: k("tcp"),
            host_id: Bytes::new(),
        };
        match m {
            PutStart => Request::PutStart(start),
            UpsertStart => Request::UpsertStart(start),
            BatchPutStart => Request::BatchPutStart(batch),
            BatchUpsertStart => Request::BatchUpsertStart(batch),
            PutEnd => Request::PutEnd(end),
            UpsertEnd => Request::UpsertEnd(end),
            PutRevoke => Request::PutRevoke(PutRevokeArgs {
                client_id: id,
                key: k("a"),
                replica_type: ReplicaType::ALL,
                tenant_id: t,
            }),
            BatchPutEnd => Request::BatchPutEnd(BatchPutEndArgs {
                client_id: id,
                object_metas: metas,
                replica_type: ReplicaType::ALL,
                tenant_id: t,
            }),
            BatchPutRevoke => Request::BatchPutRevoke(BatchPutRevokeArgs {
                client_id: id,
                keys: vec![k("a")],
                replica_type: ReplicaType::ALL,
                tenant_id: t,
            }),
            BatchUpsertEnd => Request::BatchUpsertEnd(BatchUpsertEndArgs {
                client_id: id,
                object_metas: metas,
                tenant_id: t,
            }),
            GetReplicaList => Request::GetReplicaList(KeyArgs {
                key: k("a"),
                tenant_id: t,
            }),
            ExistKey => Request::ExistKey(KeyArgs {
                key: k("a"),
                tenant_id: t,
            }),
            BatchGetReplicaList => Request::BatchGetReplicaList(KeysArgs {
                keys: vec![k("a"), k("b")].into(),
                tenant_id: t,
            }),
            BatchExistKey => Request::BatchExistKey(KeysArgs {
                keys: vec![k("a"), k("b")].into(),
                tenant_id: t,
            }),
            Remove => Request::Remove(RemoveArgs {
                key: k("a"),
                force: true,
                tenant_id: t,
            }),
            RemoveAll => Request::RemoveAll(RemoveAllArgs {
                force: true,
                tenant_id: t,
            }),
            MountSegment => Request::MountSegment(MountSegmentArgs {
                segment,
                client_id: id,
            }),
            ReMountSegment => Request::ReMountSegment(ReMountSegmentArgs {
                segments: vec![segment],
                client_id: id,
            }),
            _ => unreachable!(),
        }
    }

    fn style(schema: Schema) -> BodyStyle {
        BodyStyle {
            schema,
            ..BodyStyle::MOONCAKE
        }
    }

    /// The argument type codes of the release table (hash heads with bit 0 cleared):
    /// each older request encodes with its release's code, is recognised by it, decodes
    /// into the internal model and re-encodes byte for byte.
    #[test]
    fn older_requests_carry_their_release_codes_and_round_trip() {
        let table: [(Method, Schema, u32); 22] = [
            (PutStart, V0_3_11, 0x5ddd_cc88),
            (PutStart, V0_3_12, 0x6920_ea5c),
            (UpsertStart, V0_3_11, 0x5ddd_cc88),
            (UpsertStart, V0_3_12, 0x6920_ea5c),
            (BatchPutStart, V0_3_11, 0xcc9b_c312),
            (BatchPutStart, V0_3_12, 0x8048_5c74),
            (BatchUpsertStart, V0_3_12, 0x8048_5c74),
            (PutEnd, V0_3_11, 0x6123_2de0),
            (PutEnd, V0_3_12, 0x1b7a_228a),
            (UpsertEnd, V0_3_12, 0x1b7a_228a),
            (BatchPutEnd, V0_3_11, 0x3af6_85d6),
            (BatchPutEnd, V0_3_12, 0x94ee_5d44),
            (PutRevoke, V0_3_11, 0x6123_2de0),
            (BatchPutRevoke, V0_3_11, 0x3af6_85d6),
            (BatchUpsertEnd, V0_3_11, 0x581e_61a4),
            (BatchUpsertEnd, V0_3_12, 0xd609_1496),
            (GetReplicaList, V0_3_11, 0x9dcf_fa76),
            (ExistKey, V0_3_11, 0x9dcf_fa76),
            (BatchGetReplicaList, V0_3_11, 0x8a86_e11a),
            (BatchExistKey, V0_3_11, 0x8a86_e11a),
            (Remove, V0_3_11, 0xdbcf_8900),
            (MountSegment, V0_3_11, 0x0f2f_cc18),
        ];
        for (m, schema, code) in table {
            let req = sample(m, schema);
            let mut out = BytesMut::new();
            req.encode_body(style(schema), &mut out);
            let body = out.freeze();
            assert_eq!(code_of(&body), Some(code), "{m} {schema:?}");
            assert_eq!(request_schema(m, code), Some(schema), "{m} {schema:?}");
            let (back, st) = Request::decode(m, &body).unwrap().unwrap();
            assert_eq!((&back, st.schema), (&req, schema), "{m} {schema:?}");
            let mut again = BytesMut::new();
            back.encode_body(st, &mut again);
            assert_eq!(again.freeze(), body, "{m} {schema:?}: byte-identical");
        }
        // ReMountSegment's 0.3.11 code, RemoveAll's (a bare bool, not in the table)
        // round trip, and layouts 0.3.12 shares with 0.3.13 (those decode as 0.3.13).
        let mut out = BytesMut::new();
        sample(ReMountSegment, V0_3_11).encode_body(style(V0_3_11), &mut out);
        assert_eq!(code_of(&out), Some(0xecb9_930c));
        let mut out = BytesMut::new();
        let all = sample(RemoveAll, V0_3_11);
        all.encode_body(style(V0_3_11), &mut out);
        let (back, st) = Request::decode(RemoveAll, &out.freeze()).unwrap().unwrap();
        assert_eq!((back, st.schema), (all, V0_3_11));
        for (m, code) in [
            (PutRevoke, 0x1b7a_228a),
            (ExistKey, 0x7cf9_1ed8),
            (BatchGetReplicaList, 0x00f7_8d62),
            (Remove, 0x18e8_9fee),
            (MountSegment, 0x9ef7_0dae),
        ] {
            assert_eq!(request_schema(m, code), None, "{m}");
            let mut out = BytesMut::new();
            sample(m, V0_3_13).encode_body(BodyStyle::MOONCAKE, &mut out);
            assert_eq!(code_of(&out), Some(code), "{m}");
        }
    }

    /// Answers with four-alternative replica descriptors (0.3.11 / 0.3.12) carry the
    /// table's return codes, decode (no checksum: absent) and re-encode byte for byte.
    #[test]
    fn older_answers_carry_their_release_codes_and_round_trip() {
        let rep = ReplicaDescriptor {
            id: 3,
            location: ReplicaLocation::Memory(MemoryDescriptor {
                buffer_descriptor: BufferDescriptor {
                    size: 5,
                    buffer_address: 4096,
                    protocol: Bytes::from_static(b"tcp"),
                    transport_endpoint: Bytes::from_static(b"127.0.0.1:2"),
                },
            }),
            status: ReplicaStatus::COMPLETE,
        };
        let list = GetReplicaListResponse {
            replicas: vec![rep.clone()],
            lease_ttl_ms: 10_000,
            object_checksum: None,
        };
        let cases = [
            (
                PutStart,
                Response::PutStart(Ok(vec![rep.clone()])),
                0x12e5_cdba,
            ),
            (
                BatchPutStart,
                Response::BatchPutStart(vec![Ok(vec![rep]), Err(ErrorCode::NO_AVAILABLE_HANDLE)]),
                0xac1d_82a2,
            ),
            (
                GetReplicaList,
                Response::GetReplicaList(Ok(list.clone())),
                0x75ec_f440,
            ),
            (
                BatchGetReplicaList,
                Response::BatchGetReplicaList(vec![Ok(list), Err(ErrorCode::OBJECT_NOT_FOUND)]),
                0x0a20_c6b8,
            ),
        ];
        for (m, resp, code) in cases {
            let mut out = BytesMut::new();
            resp.encode_body(style(V0_3_12), &mut out);
            let body = out.freeze();
            assert_eq!(code_of(&body), Some(code), "{m}");
            let (back, st) = Response::decode(m, &body).unwrap().unwrap();
            assert_eq!((&back, st.schema), (&resp, V0_3_12), "{m}");
            let mut again = BytesMut::new();
            back.encode_body(st, &mut again);
            assert_eq!(again.freeze(), body, "{m}");
        }
        // A refusal a policy answers to an older client is in its release's layout.
        let deny = Response::error(PutStart, ErrorCode::NO_AVAILABLE_HANDLE, 1).unwrap();
        let mut out = BytesMut::new();
        deny.encode_body(style(V0_3_11), &mut out);
        assert_eq!(code_of(&out), Some(0x12e5_cdba));
    }

    /// What a policy sets that an older release cannot carry is named (and left out),
    /// never sent in a layout the master would reject; what it can carry maps over.
    #[test]
    fn fields_an_older_release_cannot_carry_are_named_and_left_out() {
        let Request::PutStart(mut a) = sample(PutStart, V0_3_12) else {
            unreachable!()
        };
        a.config.soft_pin_ttl_ms = Some(60_000);
        a.config.dfs_replica_num = 1;
        let req = Request::PutStart(a);
        assert_eq!(req.lost_in(V0_3_13), Vec::<&str>::new());
        assert_eq!(req.lost_in(V0_3_12), ["dfs_replica_num", "soft_pin_ttl_ms"]);
        let mut out = BytesMut::new();
        req.encode_body(style(V0_3_12), &mut out);
        let (back, _) = Request::decode(PutStart, &out.freeze()).unwrap().unwrap();
        let Request::PutStart(b) = back else {
            unreachable!()
        };
        assert_eq!(b.config.soft_pin_ttl_ms, None);
        assert_eq!(b.config.dfs_replica_num, 0);
        assert_eq!(
            b.config.soft_pin_action,
            SoftPinAction::ENABLE,
            "the pin itself"
        );
        assert_eq!(b.config.replica_num, 2);
        // 0.3.11 has no tenants and no host ids.
        let Request::PutStart(mut c) = sample(PutStart, V0_3_11) else {
            unreachable!()
        };
        c.tenant_id = Bytes::from_static(b"t1");
        c.config.host_id = Bytes::from_static(b"h");
        assert_eq!(
            Request::PutStart(c).lost_in(V0_3_11),
            ["host_id", "tenant_id"]
        );
    }
}

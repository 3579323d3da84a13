//! Which Mooncake release a master is, from its answer to one probe call: a
//! `GetReplicaList` of a key no client writes, in the 0.3.13 layout (`(key, tenant)`).
//! - 0.3.11 has a bare-key layout for it: the master refuses the call as a whole
//!   (`invalid_rpc_arguments`);
//! - 0.3.12 takes it and answers in the four-alternative descriptor layout;
//! - 0.3.13 answers in its own (`object_checksum`, five alternatives);
//! - 0.3.14 answers as 0.3.13 with a struct_pack compatible section (metainfo `0x05`),
//!   even when the answer is an error, as it is here (no such key).
//!
//! The key has no value, so the call grants no read lease and changes nothing.
//! Sans-IO: builds the probe's bytes and reads its answer; the caller moves them.

use bytes::{Bytes, BytesMut};

use super::frame::{RequestHeader, ResponseFrame, errc};
use super::message::{KeyArgs, Request, Response};
use super::method::Method;
use super::pack::{BodyStyle, Schema};

/// A master's release, as far as its wire tells it apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MasterRelease {
    V0_3_11,
    V0_3_12,
    V0_3_13,
    V0_3_14,
}

impl MasterRelease {
    pub const ALL: [MasterRelease; 4] = [
        MasterRelease::V0_3_11,
        MasterRelease::V0_3_12,
        MasterRelease::V0_3_13,
        MasterRelease::V0_3_14,
    ];

    /// The layout its calls and answers use (0.3.14's is 0.3.13's).
    pub fn schema(self) -> Schema {
        match self {
            MasterRelease::V0_3_11 => Schema::V0_3_11,
            MasterRelease::V0_3_12 => Schema::V0_3_12,
            MasterRelease::V0_3_13 | MasterRelease::V0_3_14 => Schema::V0_3_13,
        }
    }

    /// The release as operators name it (a metric label).
    pub fn label(self) -> &'static str {
        match self {
            MasterRelease::V0_3_11 => "0.3.11",
            MasterRelease::V0_3_12 => "0.3.12",
            MasterRelease::V0_3_13 => "0.3.13",
            MasterRelease::V0_3_14 => "0.3.14",
        }
    }

    /// From a configured name (`0.3.11` ... `0.3.14`).
    pub fn parse(s: &str) -> Option<MasterRelease> {
        Some(match s {
            "0.3.11" => MasterRelease::V0_3_11,
            "0.3.12" => MasterRelease::V0_3_12,
            "0.3.13" => MasterRelease::V0_3_13,
            "0.3.14" => MasterRelease::V0_3_14,
            _ => return None,
        })
    }
}

/// The probe's key: no Mooncake client writes a key that starts with NUL.
pub const PROBE_KEY: &[u8] = b"\0moongate/release-probe";

/// The probe request frame, with sequence number `seq`.
pub fn probe(seq: u32) -> Bytes {
    let req = Request::GetReplicaList(KeyArgs {
        key: Bytes::from_static(PROBE_KEY),
        tenant_id: Bytes::from_static(b"default"),
    });
    let mut body = BytesMut::new();
    req.encode_body(BodyStyle::MOONCAKE, &mut body);
    let mut out = BytesMut::with_capacity(32 + body.len());
    RequestHeader::new(seq, Method::GetReplicaList.function_id(), body.len() as u32)
        .write(&mut out);
    out.extend_from_slice(&body);
    out.freeze()
}

/// The release the probe's answer shows; `None` when it shows none of them.
pub fn classify(answer: &ResponseFrame) -> Option<MasterRelease> {
    if answer.header.err_code == errc::INVALID_RPC_ARGUMENTS {
        return Some(MasterRelease::V0_3_11);
    }
    if answer.header.err_code != errc::OK {
        return None;
    }
    let (_, style) = Response::decode(Method::GetReplicaList, &answer.body)?.ok()?;
    Some(match (style.schema, style.compat) {
        (Schema::V0_3_13, true) => MasterRelease::V0_3_14,
        (Schema::V0_3_13, false) => MasterRelease::V0_3_13,
        _ => MasterRelease::V0_3_12,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::frame::{ResponseHeader, check_request, check_response};
    use crate::codec::message::RpcError;
    use crate::codec::types::ErrorCode;

    fn answer(err_code: u8, body: BytesMut) -> ResponseFrame {
        let mut raw = BytesMut::new();
        ResponseHeader::new(7, err_code, body.len() as u32).write(&mut raw);
        raw.extend_from_slice(&body);
        let h = check_response(&raw, 1 << 20).unwrap().unwrap();
        ResponseFrame::split(&mut raw, h).0
    }

    #[test]
    fn the_probe_is_a_0_3_13_lookup_of_the_probe_key() {
        let mut raw = BytesMut::from(&probe(7)[..]);
        let h = check_request(&raw, 1 << 20).unwrap().unwrap();
        assert_eq!(h.seq_num, 7);
        let (f, _) = crate::codec::RequestFrame::split(&mut raw, h);
        let (req, style) = Request::decode(Method::GetReplicaList, &f.body)
            .unwrap()
            .unwrap();
        assert_eq!(style.schema, Schema::V0_3_13);
        assert!(matches!(req, Request::GetReplicaList(a) if a.key == PROBE_KEY));
    }

    #[test]
    fn each_release_is_told_by_its_answer() {
        // 0.3.13: its own answer layout.
        let mut body = BytesMut::new();
        Response::GetReplicaList(Err(ErrorCode::OBJECT_NOT_FOUND))
            .encode_body(BodyStyle::MOONCAKE, &mut body);
        assert_eq!(
            classify(&answer(errc::OK, body)),
            Some(MasterRelease::V0_3_13)
        );
        // 0.3.12: the older answer layout.
        let mut body = BytesMut::new();
        let old = BodyStyle {
            schema: Schema::V0_3_12,
            ..BodyStyle::MOONCAKE
        };
        Response::GetReplicaList(Err(ErrorCode::OBJECT_NOT_FOUND)).encode_body(old, &mut body);
        assert_eq!(
            classify(&answer(errc::OK, body)),
            Some(MasterRelease::V0_3_12)
        );
        // 0.3.11: the call refused as a whole.
        let mut body = BytesMut::new();
        RpcError {
            code: u16::from(errc::INVALID_RPC_ARGUMENTS),
            message: Bytes::from_static(b"invalid rpc arg"),
        }
        .encode_body(BodyStyle::MOONCAKE, &mut body);
        assert_eq!(
            classify(&answer(errc::INVALID_RPC_ARGUMENTS, body)),
            Some(MasterRelease::V0_3_11)
        );
        // Anything else tells nothing.
        assert_eq!(
            classify(&answer(errc::OK, BytesMut::from(&b"junk"[..]))),
            None
        );
        assert_eq!(
            classify(&answer(errc::FUNCTION_NOT_REGISTERED, BytesMut::new())),
            None
        );
    }
}

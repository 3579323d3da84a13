//! Calls between a client and a master of different Mooncake releases: translated into
//! the master's layout and back, or refused with a reason when `master_face.bridge` is
//! off.

use super::*;

/// What the two sides' releases mean for one call.
#[derive(Clone, Copy)]
pub(super) enum Bridge {
    /// Same layouts (or the master's release unknown): as usual.
    Same,
    /// Re-encoded in `up` (the master's style); the answer goes back in `answer`.
    Translate { up: BodyStyle, answer: BodyStyle },
    /// The layouts differ and `master_face.bridge` is off: refused with this message.
    Refuse {
        client: Schema,
        master: MasterRelease,
    },
}

/// Whether the releases' layouts differ for this call: its own (by type code: the
/// call encoded in the master's layout keeps its code, or not) or its answer's (the
/// answers naming replicas changed at 0.3.13).
#[inline]
pub(super) fn layouts_differ(
    req: &Request,
    style: BodyStyle,
    body: &Bytes,
    c: Schema,
    m: Schema,
) -> bool {
    let answer_changed = matches!(
        req.method(),
        Method::PutStart
            | Method::UpsertStart
            | Method::BatchPutStart
            | Method::BatchUpsertStart
            | Method::GetReplicaList
            | Method::BatchGetReplicaList
    ) && ((c == Schema::V0_3_13) != (m == Schema::V0_3_13));
    if answer_changed || style.schema == m {
        return answer_changed;
    }
    let mut out = BytesMut::new();
    req.encode_body(BodyStyle { schema: m, ..style }, &mut out);
    older::code_of(&out) != older::code_of(body)
}

/// What to do with a call in `style` from a client known as `client` (what its
/// connection or process identified, else `master_face.client_release`); logs a
/// difference once per connection.
#[inline]
pub(super) fn bridge(
    shared: &Shared,
    (req, style, body): (&Request, BodyStyle, &Bytes),
    master: Option<MasterRelease>,
    client: Option<Schema>,
    logged: &mut bool,
) -> Bridge {
    let Some(m) = master else {
        return Bridge::Same;
    };
    // A call in 0.3.13's layout may come from a 0.3.12 client (lookups did not change):
    // its process, or the configured fleet release, says which answer it reads; else it
    // is taken to run the master's release (as without moongate: no translation), or
    // 0.3.13 against a 0.3.11 master (whose layout it is not).
    let c = match style.schema {
        Schema::V0_3_13 if older::identifies(req.method(), style.schema).is_some() => {
            Schema::V0_3_13
        }
        Schema::V0_3_13 => client.unwrap_or(match m.schema() {
            Schema::V0_3_11 => Schema::V0_3_13,
            same => same,
        }),
        s => s,
    };
    if m.schema() == c {
        return Bridge::Same;
    }
    if !*logged {
        *logged = true;
        if shared.cfg.bridge {
            tracing::info!(
                client = c.label(),
                master = m.label(),
                "client and master releases differ: calls and answers translated"
            );
        } else {
            tracing::warn!(
                client = c.label(),
                master = m.label(),
                "client and master releases differ and master_face.bridge is off: calls whose layouts differ are refused"
            );
        }
    }
    if !shared.cfg.bridge {
        return if layouts_differ(req, style, body, c, m.schema()) {
            Bridge::Refuse {
                client: c,
                master: m,
            }
        } else {
            Bridge::Same
        };
    }
    shared.metrics.bridged.inc();
    Bridge::Translate {
        up: BodyStyle {
            schema: m.schema(),
            compat: false,
            ..style
        },
        answer: BodyStyle { schema: c, ..style },
    }
}

/// The answer to a call refused for release skew: the whole call fails with a
/// message the client logs (`invalid_rpc_arguments`, as the master would answer it,
/// but saying why).
#[inline]
pub(super) fn skew_refusal(
    seq: u32,
    method: Method,
    client: Schema,
    master: MasterRelease,
) -> Bytes {
    let msg = format!(
        "moongate: {method} from a Mooncake {} client cannot go to the {} master as it is \
         (their layouts differ) and master_face.bridge is off",
        client.label(),
        master.label()
    );
    let mut body = BytesMut::new();
    RpcError {
        code: u16::from(errc::INVALID_RPC_ARGUMENTS),
        message: Bytes::from(msg),
    }
    .encode_body(BodyStyle::MOONCAKE, &mut body);
    let mut out = BytesMut::with_capacity(16 + body.len());
    ResponseFrame {
        header: ResponseHeader::new(seq, errc::INVALID_RPC_ARGUMENTS, body.len() as u32),
        body: body.freeze(),
        attachment: Bytes::new(),
    }
    .write(&mut out);
    out.freeze()
}

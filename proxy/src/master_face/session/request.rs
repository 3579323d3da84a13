//! One request on its way: decoded, decided by the policy, recorded for its answer, and
//! forwarded (as received, rewritten, split) or answered by moongate.

use super::*;

/// What became of one request (moved once into the queue: not boxed).
#[allow(clippy::large_enum_variant)]
pub(super) enum Next {
    /// Not decoded: relayed as received, nothing to remember.
    Relayed,
    /// An offload-family call, relayed as received and read on the way.
    Offload(Box<Offload>),
    /// Forwarded (as received, rewritten or split); its answer needs the entry.
    Forwarded(Entry),
    /// Answered by moongate: these bytes go to the client when its turn comes.
    Answered(Bytes),
    /// Refused for release skew (`master_face.bridge` off): answered like `Answered`.
    Refused(Bytes),
}

/// Decodes, decides and forwards one request (what goes upstream is appended to `out`).
#[inline]
pub(super) fn on_request(
    shared: &Shared,
    out: &mut BytesMut,
    (peer, client, schema): (&Peer, &mut Option<Uuid>, &mut Option<Schema>),
    (master, client_default, skew_logged): (Option<MasterRelease>, Option<Schema>, &mut bool),
    frame: &RequestFrame,
    raw: &Bytes,
    method: Option<Method>,
) -> Next {
    let m = shared.metrics.method(method);
    m.requests.inc();
    let Some((req, style)) = decode_request(shared, frame, method, m) else {
        out.extend_from_slice(raw);
        // Owners' offload calls are read (never changed) on their way.
        if let Some(call) = method.and_then(|m| calls::offload::request(m, &frame.body)) {
            return Next::Offload(Box::new(call));
        }
        return Next::Relayed;
    };
    if let Some(s) = older::identifies(req.method(), style.schema)
        && *schema != Some(s)
    {
        shared.metrics.schema_seen(*schema, s);
        *schema = Some(s);
        peer.saw_release(s);
    }
    let (up, answer_style) = match bridge(
        shared,
        (&req, style, &frame.body),
        master,
        schema.or_else(|| peer.release()).or(client_default),
        skew_logged,
    ) {
        Bridge::Same => (None, None),
        Bridge::Translate { up, answer } => (Some(up), Some(answer)),
        Bridge::Refuse { client, master } => {
            shared.metrics.skew_refused(req.method());
            m.error(ErrorKind::rpc, 1);
            return Next::Refused(skew_refusal(
                frame.header.seq_num,
                req.method(),
                client,
                master,
            ));
        }
    };
    let got = Received {
        frame,
        raw,
        style,
        up,
    };
    if let Some(id) = req.client_id() {
        *client = Some(id);
        peer.saw_client(id);
    }
    match &req {
        Request::MountSegment(a) => shared.topology.mounted(std::slice::from_ref(&a.segment)),
        Request::ReMountSegment(a) => shared.topology.mounted(&a.segments),
        _ => {}
    }
    // Arms are assigned by the process behind the connection when it is known, so a
    // rank's calls land in one arm whether or not they carry its client id.
    let who = peer.assign.or(*client);
    let policy = &shared.policy;
    let set = policy.current();
    let d = policy.decide(&set, &req, who.as_ref());
    if !d.by_plugin() {
        let ticket = d.into_ticket();
        let arm = ticket.arm();
        arm.metrics.requests[req.method().index()].requests.inc();
        let steer = policy.steers_lookups(arm);
        let (is_lookup, as_lookup) = match calls::call(&req) {
            calls::Call::Lookup(_) => (true, None),
            calls::Call::Exist(_) if steer && shared.cfg.steer_exists => {
                (false, calls::exist::as_lookup(&req))
            }
            _ => (false, None),
        };
        let parts = match &as_lookup {
            Some(lookup) => {
                let frame = RequestFrame {
                    header: RequestHeader {
                        function_id: lookup.method().function_id(),
                        ..frame.header
                    },
                    body: frame.body.clone(),
                    attachment: frame.attachment.clone(),
                };
                let got = Received {
                    frame: &frame,
                    raw,
                    style,
                    up,
                };
                forward(shared, out, &got, lookup, true, &ticket)
            }
            None => forward(shared, out, &got, &req, false, &ticket),
        };
        let mut e = entry(shared, ticket, None, parts, &req);
        e.client_style = answer_style;
        e.exist = as_lookup.as_ref().map(|_| req.method());
        if is_lookup || as_lookup.is_some() {
            // The decoded request is done with: its keys move, uncloned.
            if let Some((tenant, keys)) = lookup_keys(req) {
                e.lookup_keys = Some(keys);
                e.lookup_tenant = tenant;
                e.steer = steer;
            }
        }
        return Next::Forwarded(e);
    }
    let am = &set.arms[d.ticket().arm].metrics.requests[req.method().index()];
    am.requests.inc();
    if let Some(f) = d.refused() {
        note_refused(
            shared,
            &req,
            f.denied.iter().map(|(i, _)| *i),
            d.ticket().arm,
        );
    }
    match d.send(req) {
        Sending::Upstream {
            ticket,
            request,
            rewritten,
            fixup,
        } => {
            let parts = forward(shared, out, &got, &request, rewritten, &ticket);
            // Tracked from what went upstream: the table records the master's answer
            // to it, before denied keys are merged back (moongate's denials are not
            // memory pressure).
            let mut e = entry(shared, ticket, fixup, parts, &request);
            e.client_style = answer_style;
            Next::Forwarded(e)
        }
        Sending::Answered { answer, .. } => {
            let denied = answer.error_count() as u64;
            m.error(ErrorKind::app, denied);
            am.error(ErrorKind::app, denied);
            let mut body = BytesMut::new();
            answer.encode_body(style, &mut body);
            let mut bytes = BytesMut::with_capacity(16 + body.len());
            ResponseFrame {
                header: ResponseHeader::new(frame.header.seq_num, errc::OK, 0),
                body: body.freeze(),
                attachment: Bytes::new(),
            }
            .write(&mut bytes);
            Next::Answered(bytes.freeze())
        }
    }
}

/// What the master's own answer says of keys on owners' SSDs (their usage).
/// Tells the key table's history which keys of a put a policy denied (they never reach
/// the master, so no answer will say so).
#[inline]
pub(super) fn note_refused(
    shared: &Shared,
    req: &Request,
    positions: impl Iterator<Item = usize>,
    arm: usize,
) {
    let Some(put) = calls::put::Put::of(req).filter(|_| shared.answered.keeps_keys()) else {
        return;
    };
    let keys = put.keys();
    let denied: Vec<&Bytes> = positions.filter_map(|i| keys.get(i)).collect();
    if !denied.is_empty() {
        shared.answered.refused(put.tenant(), &denied, arm);
    }
}

#[inline]
pub(super) fn entry(
    shared: &Shared,
    ticket: Ticket,
    fixup: Option<Fixup>,
    parts: usize,
    sent: &Request,
) -> Entry {
    Entry {
        ticket,
        fixup,
        lookup_keys: None,
        lookup_tenant: Bytes::new(),
        steer: false,
        parts,
        in_flight: put_bytes(sent, shared),
        tracked: (shared.answered.keeps_keys()
            || (shared.topology.ssd_tracking() && calls::remove::is_remove(sent.method())))
        .then(|| Tracked::of(sent))
        .flatten()
        .map(Box::new),
        exist: None,
        client_style: None,
    }
}

/// The tenant and keys of a lookup or existence check, moved out of it.
#[inline]
pub(super) fn lookup_keys(req: Request) -> Option<(Bytes, Keys)> {
    match req {
        Request::GetReplicaList(a) | Request::ExistKey(a) => Some((a.tenant_id, Keys::one(a.key))),
        Request::BatchGetReplicaList(a) | Request::BatchExistKey(a) => Some((a.tenant_id, a.keys)),
        _ => None,
    }
}

/// The lookup an existence check goes upstream as (see `steer_exists`).
#[inline]
pub(super) fn exist_as_lookup(m: Method) -> Method {
    match m {
        Method::ExistKey => Method::GetReplicaList,
        Method::BatchExistKey => Method::BatchGetReplicaList,
        other => other,
    }
}

/// A request as it arrived: its frame, its bytes, and the body style to re-encode in.
pub(super) struct Received<'a> {
    frame: &'a RequestFrame,
    raw: &'a Bytes,
    style: BodyStyle,
    /// The master's layout, when the call is translated into it (the releases differ).
    up: Option<BodyStyle>,
}

/// Calls that store, find or remove values (not the connection's own upkeep).
#[inline]
pub(super) fn moves_data(m: Method) -> bool {
    use Method::*;
    matches!(
        m,
        PutStart
            | PutEnd
            | PutRevoke
            | BatchPutStart
            | BatchPutEnd
            | BatchPutRevoke
            | UpsertStart
            | UpsertEnd
            | BatchUpsertStart
            | BatchUpsertEnd
            | GetReplicaList
            | BatchGetReplicaList
            | ExistKey
            | BatchExistKey
            | Remove
    )
}

/// Sends `req` upstream: as received, re-encoded (`changed`, or `reencode = "always"`),
/// or as bounded parts of a batch. Returns the number of upstream calls.
#[inline]
pub(super) fn forward(
    shared: &Shared,
    out: &mut BytesMut,
    got: &Received<'_>,
    req: &Request,
    changed: bool,
    ticket: &Ticket,
) -> usize {
    let Received {
        frame,
        raw,
        style,
        up,
    } = *got;
    // Translated: written in the master's layout, a 0.3.11 call given the tenant its
    // Python client names in later releases.
    let translated;
    let (req, style, changed) = match up {
        Some(up) => {
            translated = match (style.schema, req.clone()) {
                (Schema::V0_3_11, mut r) => {
                    if let Some(t) = r.tenant_mut().filter(|t| t.is_empty()) {
                        *t = Bytes::from_static(b"default");
                    }
                    r
                }
                (_, r) => r,
            };
            (&translated, up, true)
        }
        None => (req, style, changed),
    };
    // An attachment cannot be cut with the keys; batch calls never carry one.
    if frame.attachment.is_empty() {
        let points = split::points(
            req,
            shared.cfg.max_batch_keys,
            &shared.policy,
            ticket.arm(),
            shared.put_bytes_in_flight.load(Ordering::Relaxed),
        );
        if let Some(parts) = (!points.is_empty())
            .then(|| req.split_at(&points))
            .flatten()
        {
            for p in &parts {
                write_request(frame, p, style, out);
            }
            shared.metrics.split(req.method(), parts.len());
            return parts.len();
        }
    }
    if changed && style.schema != Schema::V0_3_13 {
        let lost = req.lost_in(style.schema);
        if !lost.is_empty() {
            shared.metrics.fields_dropped(&lost, style.schema);
        }
    }
    if changed || shared.cfg.reencode == Reencode::Always {
        write_request(frame, req, style, out);
    } else {
        out.extend_from_slice(raw);
    }
    1
}

#[inline]
pub(super) fn decode_request(
    shared: &Shared,
    frame: &RequestFrame,
    method: Option<Method>,
    m: &MethodMetrics,
) -> Option<(Request, BodyStyle)> {
    let method = method.filter(|m| is_typed(*m))?;
    match Request::decode(method, &frame.body)? {
        Ok(d) => Some(d),
        Err(DecodeError::TypeMismatch { found, .. }) => {
            // A release moongate has no layout for: relayed as it came.
            shared
                .metrics
                .unknown_type_code(method, Side::client, found);
            None
        }
        Err(e) => {
            // The master will answer invalid_rpc_arguments itself; relay untouched.
            m.error(ErrorKind::decode, 1);
            tracing::debug!(%method, error = %e, "request body did not decode; relaying raw");
            None
        }
    }
}

#[inline]
pub(super) fn write_request(
    frame: &RequestFrame,
    req: &Request,
    style: BodyStyle,
    out: &mut BytesMut,
) {
    let mut body = BytesMut::with_capacity(frame.body.len() + 64);
    req.encode_body(style, &mut body);
    RequestFrame {
        header: frame.header,
        body: body.freeze(),
        attachment: frame.attachment.clone(),
    }
    .write(out);
}

/// Put bytes a forwarded put-family start holds until it is answered.
#[inline]
pub(super) fn put_bytes(req: &Request, shared: &Shared) -> Option<InFlightBytes> {
    let put = calls::put::Put::of(req)?;
    Some(InFlightBytes::take(
        &shared.put_bytes_in_flight,
        put.bytes(),
    ))
}

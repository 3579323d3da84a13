//! One answer on its way back: matched to its entry, decoded, observed (one
//! [`Answered`] to the sink), fixed up, steered, tallied, finished, and written for the
//! client.

use super::*;

/// Per-answer context: the metric handles and arm of the call being answered.
pub(super) struct Answering<'a> {
    peer: &'a Peer,
    method: Option<Method>,
    entry: Option<&'a Entry>,
    latency: Duration,
    shared: &'a Shared,
    m: &'a MethodMetrics,
    am: Option<&'a MethodMetrics>,
}

impl<'a> Answering<'a> {
    #[inline]
    pub(super) fn new(
        method: Option<Method>,
        shown: Option<Method>,
        entry: Option<&'a Entry>,
        latency: Duration,
        shared: &'a Shared,
        peer: &'a Peer,
    ) -> Self {
        let am = entry
            .zip(shown)
            .map(|(e, method)| &e.ticket.arm().metrics.requests[method.index()]);
        if let Some(am) = am {
            am.latency.observe(latency.as_secs_f64());
        }
        Answering {
            peer,
            method,
            entry,
            latency,
            shared,
            m: shared.metrics.method(shown),
            am,
        }
    }

    /// A response as received: decoded when typed and successful, else relayed.
    #[inline]
    pub(super) fn response(&self, frame: &ResponseFrame, raw: &Bytes, out: &mut BytesMut) {
        if frame.header.err_code != errc::OK {
            self.transport_error(frame.header.err_code, &frame.body);
            out.extend_from_slice(raw);
            return;
        }
        if self.counted_exists(&frame.body, raw, out) {
            return;
        }
        let decoded = match self.method {
            Some(method) if is_typed(method) => match Response::decode(method, &frame.body) {
                Some(Ok(d)) => Some(d),
                Some(Err(DecodeError::TypeMismatch { found, .. })) => {
                    self.shared
                        .metrics
                        .unknown_type_code(method, Side::upstream, found);
                    None
                }
                Some(Err(e)) => {
                    self.m.error(ErrorKind::decode, 1);
                    tracing::debug!(%method, error = %e, "response body did not decode; relaying raw");
                    None
                }
                None => None,
            },
            _ => None,
        };
        let Some((resp, style)) = decoded else {
            out.extend_from_slice(raw);
            return;
        };
        self.reply(resp, style, frame.header, &frame.attachment, Some(raw), out);
    }

    /// An existence answer (one key or a batch) that is only counted, relayed as
    /// received: nothing rewrites it (no fixup, steering or translation, `reencode` not
    /// `always`) and no key table reads it (no eviction tracking). Counted from its
    /// bytes, as [`Answering::reply`] would count the decoded answer, without building
    /// its results (for 64 keys, about a quarter of what moongate spent on the call over
    /// a bare relay; for one, ~300 instructions of decode and tally, measured). `false`: not such
    /// an answer, or its body does not count (the decode then says why).
    #[inline]
    pub(super) fn counted_exists(&self, body: &Bytes, raw: &Bytes, out: &mut BytesMut) -> bool {
        let (method, count): (_, fn(&Bytes) -> _) = match self.method {
            Some(m @ Method::BatchExistKey) => (m, ExistCounts::of_batch),
            Some(m @ Method::ExistKey) => (m, ExistCounts::of_single),
            _ => return false,
        };
        if self.shared.cfg.reencode == Reencode::Always
            || self.entry.is_some_and(|e| {
                e.fixup.is_some()
                    || e.steer
                    || e.client_style.is_some()
                    || e.exist.is_some()
                    || (e.tracked.is_some() && self.shared.answered.keeps_keys())
            })
        {
            return false;
        }
        let Ok(c) = count(body) else {
            return false;
        };
        if let Some(e) = self.entry {
            e.ticket.arm().metrics.add_lookups(c.found, c.absent);
        }
        self.finish(method, c.errors, c.first_error, c.keys() as usize);
        out.extend_from_slice(raw);
        true
    }

    /// Counts an answer's per-key errors and ends its call's ticket (the policy's
    /// `on-answer`, experiment outcomes).
    #[inline]
    pub(super) fn finish(
        &self,
        method: Method,
        errors: u64,
        first_error: Option<ErrorCode>,
        keys: usize,
    ) {
        self.m.error(ErrorKind::app, errors);
        if let Some(am) = self.am {
            am.error(ErrorKind::app, errors);
        }
        if let Some(e) = self.entry {
            e.ticket.finish(&Outcome {
                method: method.name(),
                code: first_error.map_or(0, |e| e.0),
                failed: errors > 0,
                latency: Some(self.latency),
                keys,
            });
        }
    }

    /// An answer the client's release cannot carry: the call fails as a whole with a
    /// message the client logs, counted, instead of bytes it would misread.
    #[inline]
    pub(super) fn untranslatable(
        &self,
        method: Method,
        client: BodyStyle,
        header: ResponseHeader,
        out: &mut BytesMut,
    ) {
        self.shared.metrics.untranslatable(method);
        self.m.error(ErrorKind::rpc, 1);
        if let Some(e) = self.entry {
            e.ticket.finish(&Outcome {
                method: method.name(),
                code: ErrorCode::RPC_FAIL.0,
                failed: true,
                latency: Some(self.latency),
                keys: 0,
            });
        }
        let msg = format!(
            "moongate: the master's answer to {method} names a DFS replica, which a Mooncake \
             {} client cannot read",
            client.schema.label()
        );
        tracing::warn!(%method, client = client.schema.label(), "answer untranslatable to the client's release");
        let mut body = BytesMut::new();
        RpcError {
            code: u16::from(errc::RPC_THROW_EXCEPTION),
            message: Bytes::from(msg),
        }
        .encode_body(BodyStyle::MOONCAKE, &mut body);
        ResponseFrame {
            header: ResponseHeader::new(
                header.seq_num,
                errc::RPC_THROW_EXCEPTION,
                body.len() as u32,
            ),
            body: body.freeze(),
            attachment: Bytes::new(),
        }
        .write(out);
    }

    /// The master (or a part of a split call) failed the call as a whole.
    #[inline]
    pub(super) fn transport_error(&self, err_code: u8, body: &Bytes) {
        self.m.error(ErrorKind::rpc, 1);
        if let Some(am) = self.am {
            am.error(ErrorKind::rpc, 1);
        }
        if let Some(e) = self.entry {
            e.ticket.finish(&Outcome {
                method: self.method.map_or("unknown", Method::name),
                code: ErrorCode::RPC_FAIL.0,
                failed: true,
                latency: Some(self.latency),
                keys: 0,
            });
        }
        if tracing::enabled!(tracing::Level::DEBUG) {
            let msg = RpcError::decode(err_code, body)
                .map(|(e, _)| String::from_utf8_lossy(&e.message).into_owned())
                .unwrap_or_default();
            tracing::debug!(method = self.method.map(Method::name), err_code, %msg,
                "master answered with a transport error");
        }
    }

    /// A decoded successful reply: fix up, steer, tally, finish, then write it out
    /// (`raw`, the bytes as received, when nothing changed it).
    #[inline]
    pub(super) fn reply(
        &self,
        mut resp: Response,
        style: BodyStyle,
        header: ResponseHeader,
        attachment: &Bytes,
        raw: Option<&Bytes>,
        out: &mut BytesMut,
    ) {
        let entry = self.entry;
        let fixup = entry.and_then(|e| e.fixup.as_ref());
        // The master's own answer (before fixup and steering) says what it stores.
        let said = entry.map(|e| {
            self.shared.answered.said(
                e.tracked.as_deref(),
                e.lookup_keys.as_ref().map(|k| (&e.lookup_tenant, k)),
                &resp,
            )
        });
        if let Some(f) = fixup {
            resp = f.apply(resp);
        }
        let mut steered = false;
        if let Some(e) = entry.filter(|e| e.steer)
            && let Some(keys) = &e.lookup_keys
        {
            steered = self
                .shared
                .policy
                .steer_lookup(e.ticket.arm(), keys, &mut resp);
        }
        let mut style = style;
        // A translated call's answer goes back in the client's release.
        let bridged = entry.and_then(|e| e.client_style);
        if let Some(cs) = bridged {
            if cs.schema != Schema::V0_3_13 && resp.needs_0_3_13() {
                self.untranslatable(resp.method(), cs, header, out);
                return;
            }
            style = BodyStyle {
                compat: false,
                ..cs
            };
        }
        if entry.is_some_and(|e| e.exist.is_some()) {
            // An existence check sent as a lookup: the client gets its own answer.
            resp = match calls::exist::from_lookup(resp) {
                Ok(r) | Err(r) => r,
            };
            steered = true;
            style.compat = false;
        }
        // A rank reads an owner's SSD through the owner face; an owner reads its own.
        if let Some(of) = &self.shared.owner_face
            && !self.peer.is_owner()
            && calls::lookup::redirect_local_disk(&mut resp, |ep| of.endpoint_for(ep))
        {
            steered = true;
        }
        if let (Some(e), Some(said)) = (entry, said) {
            // What the reader will read, after steering; an owner's look at keys it is
            // about to offload is its own work, not a read or a hit.
            let arm = e.ticket.arm();
            let read = match (&e.lookup_keys, calls::lookup::results(&resp)) {
                (Some(keys), Some(answers)) if e.exist.is_none() => Some(Read {
                    peer: self.peer,
                    tenant: &e.lookup_tenant,
                    keys,
                    answers,
                    arm: &arm.metrics,
                }),
                _ => None,
            };
            let role = self.shared.answered.answered(Answered {
                said,
                arm: e.ticket.arm,
                arm_name: &arm.name,
                read,
            });
            let tally = calls::Tally::of(&resp);
            if !tally.is_empty() && role == LookupRole::Read {
                e.ticket.arm().metrics.add_tally(&tally);
            }
        }
        let (errors, first_error) = resp.errors();
        self.finish(resp.method(), errors as u64, first_error, resp.key_count());
        match raw {
            Some(raw)
                if fixup.is_none()
                    && !steered
                    && bridged.is_none()
                    && self.shared.cfg.reencode != Reencode::Always =>
            {
                out.extend_from_slice(raw)
            }
            _ => {
                if style.compat {
                    // 0.3.14's compatible section is not re-encoded: the answer goes
                    // out in the 0.3.13 layout (counted).
                    self.shared.metrics.compat_sections_dropped.inc();
                }
                let mut body = BytesMut::with_capacity(64 + 16 * resp.key_count());
                resp.encode_body(style, &mut body);
                ResponseFrame {
                    header,
                    body: body.freeze(),
                    attachment: attachment.clone(),
                }
                .write(out);
            }
        }
    }
}

//! A rank's connection to a relay: accepted, identified, each call read and relayed
//! whole, or handed to the read path.

use super::owner::Answer;
use super::*;

impl OwnerFace {
    pub(super) async fn accept_loop(self: Arc<Self>, listener: TcpListener, owner: Arc<Owner>) {
        while let Some((sock, _)) = crate::accept::next(&listener, &owner.stop, "owner face").await
        {
            let Some(slot) = self.limit.admit() else {
                drop(sock);
                continue;
            };
            let face = self.clone();
            let owner = owner.clone();
            owner.open.fetch_add(1, Ordering::Relaxed);
            self.tracker.spawn(async move {
                face.serve(sock, owner.clone(), slot).await;
                owner.open.fetch_sub(1, Ordering::Relaxed);
            });
        }
    }

    /// One rank connection: calls are read in order and handled at once (a release
    /// never waits behind a read waiting for room); answers go back in call order.
    pub(super) async fn serve(self: Arc<Self>, sock: TcpStream, owner: Arc<Owner>, slot: Slot) {
        let _ = sock.set_nodelay(true);
        let rank = self.identify(&sock).await;
        let (mut rd, mut wr) = sock.into_split();
        let (tx, mut rx) =
            mpsc::channel::<oneshot::Receiver<Bytes>>(self.cfg.max_inflight_per_connection);
        let writer = async move {
            while let Some(answer) = rx.recv().await {
                let Ok(bytes) = answer.await else { break };
                if wr.write_all(&bytes).await.is_err() {
                    break;
                }
            }
        };
        let face = self.clone();
        let reader = async move {
            let mut buf = BytesMut::with_capacity(4096);
            loop {
                match check_request(&buf, face.cfg.max_frame_bytes) {
                    Ok(Some(h)) => {
                        let (frame, raw) = RequestFrame::split(&mut buf, h);
                        let (done, answer) = oneshot::channel();
                        if tx.send(answer).await.is_err() {
                            return;
                        }
                        let (face, owner) = (face.clone(), owner.clone());
                        tokio::spawn(async move {
                            let _ = done.send(face.handle(&owner, rank, frame, raw).await);
                        });
                        continue;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        face.metrics.frame_errors.inc();
                        tracing::warn!(error = %e, "owner face: malformed frame; closing");
                        return;
                    }
                }
                // At shutdown no new call is read; those under way are answered.
                let read = tokio::select! {
                    r = rd.read_buf(&mut buf) => r,
                    _ = face.shutdown.cancelled() => return,
                };
                match read {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        };
        tokio::select! {
            _ = async { tokio::join!(reader, writer) } => {}
            _ = slot.stopped() => {}
        }
    }

    /// The process behind a rank's connection (as the master face names it), found off
    /// the runtime; its address when that fails.
    pub(super) async fn identify(&self, sock: &TcpStream) -> Option<PeerKey> {
        let (ours, theirs) = (sock.local_addr().ok()?, sock.peer_addr().ok()?);
        let t = self.topology.clone();
        let found = tokio::task::spawn_blocking(move || t.identify(ours, theirs));
        match tokio::time::timeout(IDENTIFY_WITHIN, found).await {
            Ok(Ok(k)) => Some(k),
            _ => Some(PeerKey::Addr(theirs.ip())),
        }
    }

    pub(super) async fn handle(
        &self,
        owner: &Owner,
        rank: Option<PeerKey>,
        frame: RequestFrame,
        raw: Bytes,
    ) -> Bytes {
        let id = frame.header.function_id;
        if id == offload_read::read_id() {
            // Read at each call: a rank names its client id in its first put.
            let client = rank
                .and_then(|k| self.topology.client_of(k))
                .unwrap_or_default();
            self.read(owner, &client, frame, raw).await
        } else if id == offload_read::release_id() {
            self.release(owner, frame, raw).await
        } else {
            self.metrics.relayed.inc();
            self.whole(owner, frame.header.seq_num, &raw)
                .await
                .raw_or_error()
        }
    }

    pub(super) async fn whole(&self, owner: &Owner, seq: u32, raw: &Bytes) -> Relayed {
        match owner.call(&self.cfg, raw).await {
            Ok(a) => Relayed::Answer(a),
            Err(e) => {
                tracing::warn!(error = %e, "owner face: call failed");
                Relayed::Failed(RpcError::reply(seq, &format!("moongate: {e}")))
            }
        }
    }
}

/// A call relayed whole: the owner's answer, or the error frame for the rank.
pub(super) enum Relayed {
    Answer(Answer),
    Failed(Bytes),
}

impl Relayed {
    pub(super) fn raw_or_error(self) -> Bytes {
        match self {
            Relayed::Answer(a) => a.raw,
            Relayed::Failed(b) => b,
        }
    }

    /// How a release relayed whole ended.
    pub(super) fn outcome(&self) -> Outcome {
        match self {
            Relayed::Answer(a) if a.header.err_code == errc::OK => {
                match offload_read::released(&a.body) {
                    Some(true) => Outcome::ok,
                    _ => Outcome::refused,
                }
            }
            _ => Outcome::transport,
        }
    }
}

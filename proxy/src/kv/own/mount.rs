//! The registration of moongate's own segment, start to end: publish its descriptor in
//! the metadata server (so initiators find its TE-TCP listener), `MountSegment` with the
//! master, `Ping` about once a second (the master drops clients silent for
//! `--client_ttl`, 10 s) with `ReMountSegment` when the master asks, and on shutdown
//! `UnmountSegment` and the metadata entries deleted, as Mooncake's own clients do
//! (data-plane spec A.7).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hyper::Method;
use thiserror::Error;
use tokio_util::sync::CancellationToken;

use super::segment::Memory;
use crate::codec::message::{
    MountSegmentArgs, ReMountSegmentArgs, Request, Response, UnmountSegmentArgs,
};
use crate::codec::types::{ClientStatus, Segment, Uuid};
use crate::kv::client::metadata::escape;
use crate::upstream::{Conn, HttpUrl, http_request};

/// How soon the heartbeat asks again while the master does not answer. A refused
/// connect (a leader gone, or a new one still warming up) costs microseconds; a master
/// that does not answer at all takes the call's timeout per try anyway.
const RETRY_UNANSWERED: Duration = Duration::from_millis(100);

#[derive(Debug, Error)]
pub enum MountError {
    #[error("metadata server: {0}")]
    Metadata(String),
    #[error("master: {0}")]
    Master(String),
}

/// What identifies the segment to the master and to peers.
pub struct Registration {
    pub client_id: Uuid,
    pub segment_id: Uuid,
    /// `host:port` of the TE-TCP listener; also the segment name and `te_endpoint`.
    pub name: String,
    pub metadata: HttpUrl,
    /// The master in force (a new HA leader answers NEED_REMOUNT; the segment remounts).
    pub upstream: crate::upstream::Upstream,
    pub timeout: Duration,
    /// The `moongate/quic/<name>` entry, when the segment is also served over QUIC.
    pub quic_entry: Option<String>,
}

impl Registration {
    fn key(&self, kind: &str) -> String {
        let prefix = match std::env::var("MC_METADATA_CLUSTER_ID") {
            Ok(id) if !id.is_empty() => format!("mooncake/{}/", id.trim_end_matches('/')),
            _ => "mooncake/".into(),
        };
        format!("{prefix}{kind}/{}", self.name)
    }

    fn path(&self, kind: &str) -> String {
        let key = if kind == "quic" {
            format!("moongate/quic/{}", self.name)
        } else {
            self.key(kind)
        };
        format!("{}?key={}", self.metadata.path, escape(&key))
    }

    fn segment(&self, mem: &Memory) -> Segment {
        Segment {
            id: self.segment_id,
            name: Bytes::from(self.name.clone()),
            base: mem.base,
            size: mem.len,
            te_endpoint: Bytes::from(self.name.clone()),
            protocol: Bytes::from_static(b"tcp"),
            host_id: Bytes::new(),
        }
    }

    async fn put_metadata(&self, kind: &str, body: String) -> Result<(), MountError> {
        let body = Bytes::from(body);
        let mut status_and_answer = self.metadata_call(Method::PUT, kind, body.clone()).await?;
        if status_and_answer.0 == 400 && status_and_answer.1.starts_with(b"Duplicate") {
            // Mooncake's standalone metadata server refuses to overwrite an rpc_meta
            // entry: ours from an earlier attempt (the master was not reachable yet) or
            // a crashed predecessor's on the same port. Either way it is stale.
            self.metadata_call(Method::DELETE, kind, Bytes::new())
                .await?;
            status_and_answer = self.metadata_call(Method::PUT, kind, body).await?;
        }
        let (status, resp) = status_and_answer;
        if status != 200 {
            return Err(MountError::Metadata(format!(
                "PUT {} answered {status}: {}",
                self.key(kind),
                String::from_utf8_lossy(&resp)
            )));
        }
        Ok(())
    }

    async fn metadata_call(
        &self,
        method: Method,
        kind: &str,
        body: Bytes,
    ) -> Result<(u16, Bytes), MountError> {
        let (status, answer) = http_request(
            method,
            &self.metadata.authority,
            &self.path(kind),
            body,
            self.timeout,
        )
        .await
        .map_err(|e| MountError::Metadata(e.to_string()))?;
        Ok((status, answer))
    }

    async fn call(&self, req: Request) -> Result<Response, MountError> {
        let addr = self
            .upstream
            .addr()
            .ok_or_else(|| MountError::Master("no master leader".into()))?;
        // The heartbeat's calls (every second) tell the failover check whether the
        // leader still answers even when no engine calls.
        let mut c = Conn::connect(&addr, self.timeout, self.upstream.release())
            .await
            .map_err(|e| {
                self.upstream.answered(false);
                MountError::Master(e.to_string())
            })?;
        let mut a = c
            .call_all(std::slice::from_ref(&req), self.timeout)
            .await
            .map_err(|e| {
                self.upstream.answered(false);
                MountError::Master(e.to_string())
            })?;
        self.upstream.answered(true);
        match a.pop() {
            Some(Ok(r)) => Ok(r),
            Some(Err(code)) => Err(MountError::Master(format!("transport error {code}"))),
            None => Err(MountError::Master("no answer".into())),
        }
    }

    /// Publishes the descriptor, then mounts. `data_host`/`data_port`: the listener.
    pub async fn mount(
        &self,
        mem: &Memory,
        data_host: &str,
        data_port: u16,
    ) -> Result<(), MountError> {
        let rpc_meta = serde_json::json!({"ip_or_host_name": data_host, "rpc_port": data_port});
        self.put_metadata("rpc_meta", rpc_meta.to_string()).await?;
        let desc = serde_json::json!({
            "name": self.name,
            "protocol": "tcp",
            "tcp_data_host": data_host,
            "tcp_data_port": data_port,
            "tcp_proto_version": 2,
            "rdma_server_name": "",
            "buffers": [{"name": self.name, "addr": mem.base, "length": mem.len}],
        });
        self.put_metadata("ram", desc.to_string()).await?;
        if let Some(q) = &self.quic_entry {
            self.put_metadata("quic", q.clone()).await?;
        }
        match self
            .call(Request::MountSegment(MountSegmentArgs {
                segment: self.segment(mem),
                client_id: self.client_id,
            }))
            .await?
        {
            Response::MountSegment(Ok(())) => Ok(()),
            Response::MountSegment(Err(e)) => {
                Err(MountError::Master(format!("MountSegment refused: {e}")))
            }
            _ => Err(MountError::Master(
                "unexpected answer to MountSegment".into(),
            )),
        }
    }

    /// Mounts (retrying every second until the master and the metadata server answer),
    /// then pings until shutdown, remounting when the master asks; then unmounts and
    /// deletes the metadata entries.
    pub async fn run(
        self: Arc<Self>,
        mem: Arc<Memory>,
        data_host: String,
        data_port: u16,
        shutdown: CancellationToken,
    ) {
        // Logged when the reason changes, not every second.
        let mut last_error = String::new();
        loop {
            match self.mount(&mem, &data_host, data_port).await {
                Ok(()) => break,
                Err(e) => {
                    let e = e.to_string();
                    if e != last_error {
                        tracing::warn!(error = %e, segment = %self.name,
                            "cannot mount the own segment yet; retrying every second");
                        last_error = e;
                    }
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
        tracing::info!(segment = %self.name, bytes = mem.len, "own segment mounted");
        self.heartbeat(mem, shutdown).await
    }

    async fn heartbeat(&self, mem: Arc<Memory>, shutdown: CancellationToken) {
        let mut warned = false;
        loop {
            // Once a second, as Mooncake's clients ping; every RETRY_UNANSWERED while the
            // master does not answer, so the segment remounts as a new leader starts
            // serving: until then the values a restored leader knows here answer
            // REPLICA_IS_NOT_READY, and puts can only land in the segments already back.
            let every = if warned {
                RETRY_UNANSWERED
            } else {
                Duration::from_secs(1)
            };
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(every) => {}
            }
            match self.call(Request::Ping(self.client_id)).await {
                Ok(Response::Ping(Ok(p))) => {
                    warned = false;
                    if p.client_status == ClientStatus::NEED_REMOUNT {
                        let r = self
                            .call(Request::ReMountSegment(ReMountSegmentArgs {
                                segments: vec![self.segment(&mem)],
                                client_id: self.client_id,
                            }))
                            .await;
                        tracing::info!(
                            ok = matches!(r, Ok(Response::ReMountSegment(Ok(())))),
                            "master asked to remount moongate's segment"
                        );
                    }
                }
                other => {
                    if !warned {
                        tracing::warn!(answer = ?other.err(),
                            "segment heartbeat failed; retrying every 100 ms until the master answers");
                        warned = true;
                    }
                }
            }
        }
        let r = self
            .call(Request::UnmountSegment(UnmountSegmentArgs {
                segment_id: self.segment_id,
                client_id: self.client_id,
            }))
            .await;
        for kind in ["ram", "rpc_meta", "quic"] {
            let _ = self.metadata_call(Method::DELETE, kind, Bytes::new()).await;
        }
        tracing::info!(unmounted = matches!(r, Ok(Response::UnmountSegment(Ok(())))),
            segment = %self.name, "segment unmounted, metadata deleted");
    }
}

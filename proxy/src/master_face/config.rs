//! The `[master_face]` section: where Mooncake clients connect, the master it fronts,
//! and the bounds of every connection.

use std::time::Duration;

use serde::Deserialize;

use crate::validate::{check_addr, positive};

/// The master face: where Mooncake clients connect, and the master it fronts.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct MasterFaceConfig {
    /// `host:port` clients use as `master_server_address`.
    pub listen: String,
    /// The real master: `host:port` of its RPC port, or HA masters as Mooncake's
    /// clients name them, `etcd://HOST:PORT[;HOST:PORT...]` (moongate follows the
    /// leader; see `ha_cluster_id`).
    pub upstream: String,
    /// The HA cluster (the masters' `--cluster_id`; Mooncake clients take it from
    /// `MC_STORE_CLUSTER_ID`). Default `mooncake_cluster`, Mooncake's.
    pub ha_cluster_id: String,
    /// Client connections served at once; further ones are closed on accept.
    pub max_connections: usize,
    /// Largest request or response frame (header + body + attachment) in bytes.
    pub max_frame_bytes: u64,
    /// Requests forwarded but not yet answered, per connection; beyond it moongate
    /// stops reading that client until answers arrive.
    pub max_inflight_per_connection: usize,
    /// Time allowed to open the upstream connection for a new client connection.
    pub connect_timeout_ms: u64,
    /// With HA masters (`upstream = "etcd://..."`): a client connection that arrives
    /// while no leader serves (none named, or the one named refusing connections) is
    /// held, its upstream connect tried again every 50 ms and at each change of
    /// leader, for up to this long before it is closed; 0 = closed at once. Default
    /// 5 s: a new leader warms up ~5 s with its address already in etcd, and
    /// Mooncake's clients retry once a second, so without the hold each reaches the
    /// new leader up to a second after it serves. An owner's segment then remounts
    /// that much later, and a new leader that restored its objects evicts the puts
    /// that land meanwhile in the segments already back (the soak lost every client's
    /// puts of that second so). Held far below the clients' own 30 s RPC timeout
    /// (`MC_RPC_TIMEOUT_MS`). A fixed master is never waited for.
    pub failover_hold_ms: u64,
    /// Close a connection after this long without a byte in either direction; 0 = never.
    /// Checked every quarter of it (the request path sets a flag, reads no clock), so an
    /// idle connection closes within 1.25 x this.
    pub idle_timeout_ms: u64,
    /// Close a client connection (and its upstream one) when a call forwarded to the
    /// master has waited this long for its answer; 0 = never. Default 10 s: the master
    /// answers metadata calls in milliseconds, so a call this old means a frozen master
    /// or a network black hole, and the client (whose own timeout is 30 s,
    /// `MC_RPC_TIMEOUT_MS`) learns it sooner and reconnects.
    pub answer_timeout_ms: u64,
    /// When decoded frames are re-encoded: `on-change` (only when a policy changed the
    /// value; otherwise the received bytes are forwarded) or `always` (every typed frame
    /// goes out re-encoded from its decoded value; proves the codec on live traffic).
    pub reencode: Reencode,
    /// Batch calls with more keys than this go to the master as several calls of at most
    /// this many keys, answered as one merged reply; 0 = never split by count.
    pub max_batch_keys: usize,
    /// When the serving arm's plugin steers lookups (`on-lookup`, e.g. `disk-budget`),
    /// an `ExistKey` / `BatchExistKey` goes to the master as the replica lookup of the
    /// same keys, the plugin steers it, and the client gets the existence answer that
    /// follows (a key the plugin will not serve does not exist). This is where vLLM's
    /// scheduler counts its hits: a key a budget refuses is a miss before a load is
    /// planned, not a failed load. Both calls grant the same read lease.
    pub steer_exists: bool,
    /// Translate between releases: when a client's calls are in another release's
    /// layout than the master's, each call is re-encoded in the master's layout and
    /// each answer in the client's (docs/operations.md, "Upgrading Mooncake through
    /// moongate"). Default true: without it such a pair fails every call whose layout
    /// changed. `false`: relayed as received (counted, and logged once per connection).
    pub bridge: bool,
    /// The master's release: `auto` (default: asked of each new upstream connection
    /// with one lookup of a key no client writes, one round trip) or `0.3.11`,
    /// `0.3.12`, `0.3.13`, `0.3.14` (no probe; for a master behind something that
    /// answers the probe for it).
    pub upstream_release: String,
    /// What a client connection runs before its calls tell (`auto`: the release of
    /// the call itself). A 0.3.12 client's lookups have 0.3.13's layout, so until it
    /// puts (or mounts) it cannot be told from a 0.3.13 client, but their answers
    /// differ: set this to the fleet's older release while it is being upgraded, so a
    /// reader that never put still gets answers it can read. Default `auto`.
    pub client_release: String,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Reencode {
    OnChange,
    Always,
}

impl Default for MasterFaceConfig {
    fn default() -> Self {
        MasterFaceConfig {
            listen: "127.0.0.1:50052".into(),
            upstream: "127.0.0.1:50051".into(),
            ha_cluster_id: "mooncake_cluster".into(),
            max_connections: 1024,
            max_frame_bytes: 64 << 20,
            max_inflight_per_connection: 1024,
            connect_timeout_ms: 3_000,
            failover_hold_ms: 5_000,
            idle_timeout_ms: 300_000,
            answer_timeout_ms: 10_000,
            reencode: Reencode::OnChange,
            max_batch_keys: 0,
            steer_exists: true,
            bridge: true,
            upstream_release: "auto".into(),
            client_release: "auto".into(),
        }
    }
}

impl MasterFaceConfig {
    /// Appends every problem of this section to `errs`.
    pub fn validate(&self, errs: &mut Vec<String>) {
        check_addr(errs, "master_face.listen", &self.listen);
        match self.upstream_spec() {
            Ok(crate::upstream::UpstreamSpec::Direct(a)) => {
                check_addr(errs, "master_face.upstream", &a)
            }
            Ok(crate::upstream::UpstreamSpec::Etcd { endpoints, .. }) => {
                for e in &endpoints {
                    check_addr(errs, "master_face.upstream (etcd endpoint)", e);
                }
            }
            Err(e) => errs.push(format!("master_face.upstream: {e}")),
        }
        positive(
            errs,
            "master_face.max_connections",
            self.max_connections as u64,
        );
        if self.max_frame_bytes < 1024 {
            errs.push("master_face.max_frame_bytes: must be at least 1024".into());
        }
        positive(
            errs,
            "master_face.max_inflight_per_connection",
            self.max_inflight_per_connection as u64,
        );
        positive(
            errs,
            "master_face.connect_timeout_ms",
            self.connect_timeout_ms,
        );
        if self.client_release != "auto"
            && crate::codec::release::MasterRelease::parse(&self.client_release).is_none()
        {
            errs.push(format!(
                "master_face.client_release: {:?} is not auto, 0.3.11, 0.3.12, 0.3.13 or 0.3.14",
                self.client_release
            ));
        }
        if self.upstream_release != "auto"
            && crate::codec::release::MasterRelease::parse(&self.upstream_release).is_none()
        {
            errs.push(format!(
                "master_face.upstream_release: {:?} is not auto, 0.3.11, 0.3.12, 0.3.13 or 0.3.14",
                self.upstream_release
            ));
        }
    }

    /// The configured release of not-yet-identified clients, when not `auto`.
    pub fn fixed_client_schema(&self) -> Option<crate::codec::Schema> {
        crate::codec::release::MasterRelease::parse(&self.client_release).map(|r| r.schema())
    }

    /// The configured master release, when not `auto`.
    pub fn fixed_release(&self) -> Option<crate::codec::release::MasterRelease> {
        crate::codec::release::MasterRelease::parse(&self.upstream_release)
    }
    /// The etcd endpoints `upstream` names, when it is `etcd://...`.
    pub fn upstream_etcd(&self) -> Option<Vec<String>> {
        match self.upstream_spec() {
            Ok(crate::upstream::UpstreamSpec::Etcd { endpoints, .. }) => Some(endpoints),
            _ => None,
        }
    }

    /// How `upstream` names the master.
    pub fn upstream_spec(&self) -> Result<crate::upstream::UpstreamSpec, String> {
        crate::upstream::UpstreamSpec::parse(&self.upstream, &self.ha_cluster_id)
    }

    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }
    pub fn failover_hold(&self) -> Option<Duration> {
        (self.failover_hold_ms > 0).then(|| Duration::from_millis(self.failover_hold_ms))
    }
    pub fn answer_timeout(&self) -> Option<Duration> {
        (self.answer_timeout_ms > 0).then(|| Duration::from_millis(self.answer_timeout_ms))
    }
    pub fn idle_timeout(&self) -> Option<Duration> {
        (self.idle_timeout_ms > 0).then(|| Duration::from_millis(self.idle_timeout_ms))
    }
}

//! The `[kv]` section: the kv face, its own segment and its transports.

use serde::Deserialize;

use crate::validate::{check_addr, positive};

/// The kv face: moongate as a native Mooncake client behind a small HTTP API.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct KvConfig {
    /// `host:port` of the HTTP API; empty = off.
    pub listen: String,
    /// Also serve the HTTP API on this Unix socket path; empty = no socket.
    pub unix_path: String,
    /// The transfer engine's metadata server (`http://HOST:PORT/metadata`, the same
    /// string Mooncake clients get), where segments publish their data listeners.
    pub metadata_url: String,
    /// Largest value a PUT may carry.
    pub max_value_bytes: usize,
    /// Keys one `POST /v1/kv/exists` or batch call may carry.
    pub max_batch_keys: usize,
    /// Value bytes per part of a batch get or put: each part reserves its bytes in the
    /// in-flight budget before it moves.
    pub batch_part_bytes: u64,
    /// Transfer-engine connections kept per peer; a value of 4 MiB or more moves over
    /// this many at once.
    pub te_connections_per_peer: usize,
    /// Bytes per stripe of a streamed value (an HTTP GET or PUT of 1 MiB and more):
    /// a value of two stripes or more moves as stripes over `te_connections_per_peer`
    /// connections at once; 0 (the default) keeps it on one connection, which was
    /// faster on two cores (docs/results.md).
    pub te_stripe_bytes: u64,
    /// Deadline of one master call or one transfer.
    pub timeout_ms: u64,
    /// The Mooncake tenant of every key (what the Python client sends).
    pub tenant: String,
    /// Value bytes of gets and puts in progress on this node at most; beyond it requests
    /// wait up to `busy_wait_ms`, then get 503.
    pub max_inflight_bytes: u64,
    pub busy_wait_ms: u64,
    /// Size of moongate's own memory segment, mounted with the master; 0 = none.
    pub segment_bytes: u64,
    /// Address the segment's TE-TCP listener binds and advertises (port 0: any free).
    pub segment_listen: String,
    /// Also serve the own segment over QUIC here (UDP `host:port`); empty = no QUIC.
    pub quic_listen: String,
    /// PEM certificate chain and key of the QUIC endpoint; both empty = a self-signed
    /// certificate made at start (peers pin its fingerprint from the metadata server).
    pub quic_cert: String,
    pub quic_key: String,
    /// Use QUIC for segments whose owner moongate advertises it (else TE-TCP).
    pub quic_client: bool,
    /// QUIC streams (and TE-TCP connections) one large value is spread over.
    pub quic_streams: usize,
    /// Reuse the replica list of a GET for later GETs of the same key for this long
    /// (never beyond half the master's read lease, and void at once when a removal goes
    /// to the master through either face, the master stops answering or a new leader is
    /// in force); 0 = every GET asks the master.
    pub replica_cache_ms: u64,
    /// Serve the kv API over QUIC here (UDP `host:port`) for callers on other hosts;
    /// empty = off. Same certificate as `quic_listen`.
    pub api_quic_listen: String,
    /// PEM CA bundle; when set, QUIC API callers must present a certificate it issued.
    pub api_quic_client_ca: String,
    /// PEM CA bundle; when set, peers of the own segment's QUIC endpoint must present a
    /// certificate it issued, and this moongate presents `kv.quic_cert` to the segments
    /// it reads and writes over QUIC. Required when `kv.quic_listen` is not loopback:
    /// without it any host that completes TLS reads and writes the segment.
    pub quic_client_ca: String,
    /// Serve the own segment over TE-TCP (what unmodified Mooncake clients speak).
    /// `false` = QUIC only (needs `kv.quic_listen`): only moongates with a certificate
    /// from `kv.quic_client_ca` reach the segment, and an unmodified client whose put the
    /// master places in it fails that write. TE-TCP, like Mooncake's own, trusts the
    /// network. Default true.
    pub segment_tcp: bool,
    /// Connections each API listener (TCP, Unix) holds open at most; more are closed
    /// at once. Default 1024: far above an engine's pool, far below the fd limit.
    pub max_connections: usize,
    /// At a TCP or Unix listener's cap (API or segment), a new connection sheds the open
    /// one that moved no byte for longest, if that one moved none for this long (ms);
    /// otherwise the newcomer is closed. And when a reservation finds
    /// `kv.max_inflight_bytes` full, request bodies that have waited this long for their
    /// next byte are stopped (408), longest first, until their bytes cover it. Default
    /// 1000: a request in progress moves bytes far more often, and a stalled body or an
    /// idle keep-alive connection must not lock a restarting engine out. 0: never shed.
    pub shed_after_ms: u64,
    /// Every request body (a PUT, streamed or not, a batch put, a key list) must arrive
    /// at this many bytes a second on average once `kv.min_body_grace_ms` has passed, or
    /// it is answered 408 and its reserved bytes given back. Default 65536: an engine
    /// sends at hundreds of MB/s; a body that stalls must not hold its share of
    /// `kv.max_inflight_bytes` until `kv.timeout_ms`. 0: no floor.
    pub min_body_bytes_per_second: u64,
    /// How long a body may take before the floor applies (ms). Default 1000.
    pub min_body_grace_ms: u64,
    /// Bytes of `kv.max_inflight_bytes` the request bodies of one connection (its
    /// HTTP/2 streams, a batch put's parts) may hold at once; a body that would take it
    /// past this is answered 503. A connection with a single body may still take more
    /// (a value as large as `kv.max_value_bytes` must fit). Default 268435456 (a quarter
    /// of the default budget): one client cannot hold the whole node's budget. 0: no
    /// bound.
    pub max_body_bytes_per_connection: u64,
    /// The HTTP/1 read buffer of one kv API connection at most (bytes, at least 8192).
    /// Default 65536: hyper's own default (~400 KiB) let a thousand stalled uploads hold
    /// 400 MiB beyond the byte budget; at 64 KiB the cap costs 64 MiB. Larger buffers
    /// read big PUT bodies in fewer calls (16 MiB puts measured 0.77-0.89x Mooncake's
    /// client at 64 KiB, 0.85x at 256 KiB; noisy): raise it where memory is plentiful.
    pub http1_read_buffer_bytes: usize,
    /// Connections the own segment's TE-TCP listener holds open at most (each costs up
    /// to a 256 KiB copy buffer while it moves bytes). Default 512.
    pub segment_max_connections: usize,
    /// QUIC connections each QUIC listener (API, segment) holds at most. Each may buffer
    /// up to its 16 MiB receive window, so the default 64 bounds that at 1 GiB.
    pub quic_max_connections: usize,
    /// A TCP or Unix connection (API or segment) that moves no byte for this long while
    /// waiting on its peer is closed. Default 60000 (above `kv.timeout_ms`, so a slow
    /// master answer never reads as idleness).
    pub idle_timeout_ms: u64,
    /// Longest key, in bytes, in a path or a key list. Default 4096. Key-list bodies
    /// are capped at `kv.max_batch_keys` keys of this size.
    pub max_key_bytes: usize,
    /// Connections to the master the kv face opens at most; a call finding them all in
    /// use waits up to `kv.busy_wait_ms`, then is answered 503. Default 32.
    pub master_connections: usize,
    /// A master connection idle this long is closed (`kv.master_idle_ms`). Default
    /// 30,000: a burst opens up to `kv.master_connections`, which otherwise stay open
    /// (one descriptor here and one in the master each) until the next leader change;
    /// steady traffic reuses its few. 0 = never closed.
    pub master_idle_ms: u64,
    /// How long a segment descriptor read from the metadata server is reused (it is
    /// also dropped when a transfer with it fails). Default 60000.
    pub metadata_ttl_ms: u64,
    /// The master's `--root_fs_dir` as mounted on this host. Disk replicas are read and
    /// written only under it; empty (default) = the kv face does not touch the disk tier
    /// (reads of disk-only values fail, disk replicas of its puts are revoked), because
    /// the paths come from the master and must not name arbitrary files.
    pub disk_root: String,
    /// The shared-memory data path on `kv.unix_path` (docs/kv-api.md, "Shared memory"):
    /// an engine on this host registers its memory and values move straight between it
    /// and the store. Default true; needs `kv.unix_path`.
    pub shm: bool,
    /// Users (uids) whose processes may register memory; empty (default) = the user
    /// moongate runs as. Mapping another process's memory is only safe for peers that
    /// are trusted as much as moongate itself.
    pub shm_allowed_uids: Vec<u32>,
    /// Bytes one connection may have registered at once. Default 16 GiB: an engine's KV
    /// staging buffers, not its whole GPU memory. Registered memory is the engine's
    /// (mapped, not copied), but every byte mapped is address space moongate holds.
    pub shm_max_bytes_per_connection: u64,
    /// Bytes all connections may have registered at once. Default 64 GiB.
    pub shm_max_bytes: u64,
    /// Registrations one connection may hold at once. Default 64.
    pub shm_max_regions: usize,
    /// Zero-copy views and reservations for local engines on the shared-memory path
    /// (docs/kv-api.md, "Zero copy"): engines map the own segment and the staging area
    /// (read-only for views, writable for reservations). Default true; needs `kv.shm`.
    /// Mapping the segment writable lets an engine write any byte of it, as any TE-TCP
    /// peer of the segment already can; only `kv.shm_allowed_uids` get the mappings.
    pub zero_copy: bool,
    /// How long a view lease or a reservation lives unless released, committed or
    /// aborted first (ms). Default 30000: a prefix load into GPU memory takes
    /// milliseconds, and a lease an engine forgot holds its range against writers.
    pub lease_ms: u64,
    /// View leases plus reservations one engine (one handle's connections) may hold at
    /// once. Default 4096: a few hundred prefixes in flight with batches of 64.
    pub max_leases: usize,
    /// Bytes of the staging area: views of values that are not in the own segment are
    /// read into it, and reservations the master places elsewhere are written into it
    /// and sent on at commit. Memory is taken as it is first used. Default 268435456
    /// (256 MiB); 0 = none (such views and reservations are refused with
    /// `MG_ERR_NOT_LOCAL`; the engine copies with `mg_get_into` / `mg_put`).
    pub staging_bytes: u64,
    /// Threads a large copy in or out of the own segment is cut over (copies of 8 MiB
    /// and more, 4 MiB a thread at least). 0 (default) = the cores this process may
    /// use, at most 8: one core copies ~10 GB/s, a host's memory 35-40 GB/s.
    pub copy_threads: usize,
    /// Keys moongate knows lie untouched in its own segment, kept to answer a local
    /// engine's view without a master call (`kv.known_keys`). Default 262,144: a 16 GiB
    /// segment of 64 KiB blocks, about 50 MB of table at most (an estimate). 0 turns it off (every
    /// view asks the master, as Mooncake's own clients do).
    pub known_keys: usize,
    /// After a leader change of HA masters, the puts moongate acknowledged within this
    /// many milliseconds before it are checked against the new leader, and the ones it
    /// lacks put again from bytes moongate can vouch for (`kv.failover_window_ms`,
    /// docs/kv-api.md "Puts that survive a failover"). Default 300,000: a leader that
    /// takes over with its oplog in order lacks only the last seconds (and, while etcd
    /// is down, everything acknowledged until the old leader's 5 s lease ran out); one
    /// whose restore fails (Mooncake 0.3.13 logs `Standby restore failed` and serves
    /// with no objects: observed after an etcd outage followed by a kill) lacks
    /// everything, and then the whole window is put again. 0 turns it off. Only with an
    /// `etcd://` upstream. At most 3,600,000.
    pub failover_window_ms: u64,
    /// At most this many acknowledged puts are kept for that check (the oldest make
    /// room; `moongate_kv_failover_keys_total` shows what was checked). Default 65,536:
    /// 30 s of ~2,000 puts a second, ~13 MB of table at most with 100-byte keys (an
    /// estimate); keys removed or evicted through moongate leave it at once. At most
    /// 16,777,216.
    pub failover_window_keys: usize,
    /// Makes and maps the own segment's pages at start, on a thread of its own
    /// (`kv.prefault`, default true): moongate's own first writes into a range then run
    /// at copy speed, and an engine's cost a mapping per 4 KiB page, not a new page. The segment's memory is taken at start
    /// rather than as it fills. An engine's own mappings are prefaulted by the C library
    /// only with `MOONGATE_KV_PREFAULT=1` in its environment.
    pub prefault: bool,
}

impl Default for KvConfig {
    fn default() -> Self {
        KvConfig {
            listen: String::new(),
            unix_path: String::new(),
            metadata_url: String::new(),
            max_value_bytes: 256 << 20,
            max_batch_keys: 10_000,
            batch_part_bytes: 64 << 20,
            te_connections_per_peer: 4,
            te_stripe_bytes: 0,
            timeout_ms: 30_000,
            tenant: "default".into(),
            max_inflight_bytes: 1 << 30,
            busy_wait_ms: 1_000,
            segment_bytes: 0,
            segment_listen: "127.0.0.1:0".into(),
            quic_listen: String::new(),
            quic_cert: String::new(),
            quic_key: String::new(),
            quic_client: true,
            replica_cache_ms: 1_000,
            api_quic_listen: String::new(),
            api_quic_client_ca: String::new(),
            quic_streams: 4,
            quic_client_ca: String::new(),
            segment_tcp: true,
            max_connections: 1024,
            shed_after_ms: 1000,
            min_body_bytes_per_second: 65_536,
            min_body_grace_ms: 1000,
            max_body_bytes_per_connection: 256 << 20,
            http1_read_buffer_bytes: 64 << 10,
            segment_max_connections: 512,
            quic_max_connections: 64,
            idle_timeout_ms: 60_000,
            max_key_bytes: 4096,
            master_connections: 32,
            master_idle_ms: 30_000,
            metadata_ttl_ms: 60_000,
            disk_root: String::new(),
            shm: true,
            shm_allowed_uids: Vec::new(),
            shm_max_bytes_per_connection: 16 << 30,
            shm_max_bytes: 64 << 30,
            shm_max_regions: 64,
            zero_copy: true,
            lease_ms: 30_000,
            max_leases: 4096,
            staging_bytes: 256 << 20,
            copy_threads: 0,
            known_keys: 262_144,
            failover_window_ms: 300_000,
            failover_window_keys: 65_536,
            prefault: true,
        }
    }
}

impl KvConfig {
    /// Threads a large copy is cut over (`kv.copy_threads`, 0 = the cores, at most 8).
    pub fn copy_threads(&self) -> usize {
        if self.copy_threads > 0 {
            return self.copy_threads;
        }
        std::thread::available_parallelism().map_or(1, |n| n.get().min(8))
    }

    /// Appends every problem of this section to `errs` (nothing is checked while the kv
    /// face is off, except keys that need it on).
    pub fn validate(&self, errs: &mut Vec<String>) {
        let kv = self;
        let errs = &mut *errs;
        if !kv.listen.is_empty() {
            check_addr(errs, "kv.listen", &kv.listen);
            if crate::upstream::HttpUrl::parse(&kv.metadata_url).is_none() {
                errs.push(format!(
                    "kv.metadata_url: {:?} is not http://HOST:PORT/PATH (the kv face needs \
                         the metadata server to find segments)",
                    kv.metadata_url
                ));
            }
            positive(errs, "kv.max_value_bytes", kv.max_value_bytes as u64);
            positive(errs, "kv.max_batch_keys", kv.max_batch_keys as u64);
            positive(errs, "kv.batch_part_bytes", kv.batch_part_bytes);
            positive(
                errs,
                "kv.te_connections_per_peer",
                kv.te_connections_per_peer as u64,
            );
            positive(errs, "kv.timeout_ms", kv.timeout_ms);
            positive(errs, "kv.max_connections", kv.max_connections as u64);
            positive(
                errs,
                "kv.segment_max_connections",
                kv.segment_max_connections as u64,
            );
            positive(
                errs,
                "kv.quic_max_connections",
                kv.quic_max_connections as u64,
            );
            positive(errs, "kv.idle_timeout_ms", kv.idle_timeout_ms);
            positive(errs, "kv.max_key_bytes", kv.max_key_bytes as u64);
            positive(errs, "kv.master_connections", kv.master_connections as u64);
            positive(errs, "kv.metadata_ttl_ms", kv.metadata_ttl_ms);
            if kv.shm {
                positive(
                    errs,
                    "kv.shm_max_bytes_per_connection",
                    kv.shm_max_bytes_per_connection,
                );
                positive(errs, "kv.shm_max_bytes", kv.shm_max_bytes);
                positive(errs, "kv.shm_max_regions", kv.shm_max_regions as u64);
                if kv.zero_copy {
                    positive(errs, "kv.lease_ms", kv.lease_ms);
                    positive(errs, "kv.max_leases", kv.max_leases as u64);
                }
            }
            if kv.te_connections_per_peer > 64 {
                errs.push(
                    "kv.te_connections_per_peer: at most 64 (each is a socket to every peer)"
                        .into(),
                );
            }
            if kv.te_stripe_bytes != 0 && !(64 << 10..=64 << 20).contains(&kv.te_stripe_bytes) {
                errs.push(format!(
                    "kv.te_stripe_bytes: {} is neither 0 nor between 64 KiB and 64 MiB",
                    kv.te_stripe_bytes
                ));
            }
            if kv.copy_threads > 256 {
                errs.push("kv.copy_threads: at most 256".into());
            }
            if kv.known_keys > 16 << 20 {
                errs.push("kv.known_keys: at most 16777216".into());
            }
            if kv.failover_window_keys > 16 << 20 {
                errs.push("kv.failover_window_keys: at most 16777216".into());
            }
            if kv.failover_window_ms > 3_600_000 {
                errs.push("kv.failover_window_ms: at most 3600000 (an hour)".into());
            }
            if !kv.disk_root.is_empty() && !std::path::Path::new(&kv.disk_root).is_absolute() {
                errs.push(format!(
                    "kv.disk_root: {:?} is not an absolute path (the master's disk paths are)",
                    kv.disk_root
                ));
            }
            if !kv.quic_client_ca.is_empty() {
                if kv.quic_listen.is_empty() && !kv.quic_client {
                    errs.push("kv.quic_client_ca: needs kv.quic_listen or kv.quic_client".into());
                }
                if kv.quic_cert.is_empty() {
                    errs.push(
                        "kv.quic_client_ca: set kv.quic_cert and kv.quic_key to a certificate \
                         that CA issued (it is what this moongate shows its peers)"
                            .into(),
                    );
                }
            }
            if !kv.segment_tcp && (kv.segment_bytes == 0 || kv.quic_listen.is_empty()) {
                errs.push(
                    "kv.segment_tcp = false serves the own segment over QUIC only: set \
                     kv.segment_bytes and kv.quic_listen"
                        .into(),
                );
            }
            if kv.http1_read_buffer_bytes < 8192 {
                errs.push("kv.http1_read_buffer_bytes: at least 8192".into());
            }
            if kv.max_inflight_bytes < 1024 {
                errs.push("kv.max_inflight_bytes: at least 1024".into());
            }
            if !kv.quic_listen.is_empty() {
                check_addr(errs, "kv.quic_listen", &kv.quic_listen);
                if kv.segment_bytes == 0 {
                    errs.push(
                        "kv.quic_listen: serves the own segment; set kv.segment_bytes".into(),
                    );
                }
                if kv.quic_cert.is_empty() != kv.quic_key.is_empty() {
                    errs.push("kv.quic_cert and kv.quic_key: both or neither".into());
                }
                let loopback = kv
                    .quic_listen
                    .parse::<std::net::SocketAddr>()
                    .is_ok_and(|a| a.ip().is_loopback());
                if !loopback && kv.quic_client_ca.is_empty() {
                    errs.push(format!(
                        "kv.quic_listen {:?} is not loopback: set kv.quic_client_ca, or any \
                         host that reaches it reads and writes the own segment",
                        kv.quic_listen
                    ));
                }
            }
            positive(errs, "kv.quic_streams", kv.quic_streams as u64);
            if kv.replica_cache_ms > 600_000 {
                errs.push(
                    "kv.replica_cache_ms: at most 600000 (it never outlives half the \
                               master's read lease anyway)"
                        .into(),
                );
            }
            if !kv.api_quic_listen.is_empty() {
                check_addr(errs, "kv.api_quic_listen", &kv.api_quic_listen);
                if kv.quic_listen.is_empty() && kv.quic_cert.is_empty() != kv.quic_key.is_empty() {
                    errs.push("kv.quic_cert and kv.quic_key: both or neither".into());
                }
            } else if !kv.api_quic_client_ca.is_empty() {
                errs.push("kv.api_quic_client_ca: needs kv.api_quic_listen".into());
            }
            if kv.segment_bytes > 0 {
                check_addr(errs, "kv.segment_listen", &kv.segment_listen);
                if kv.segment_bytes < (1 << 20) {
                    errs.push("kv.segment_bytes: 0 (none) or at least 1 MiB".into());
                }
            }
        } else if !kv.api_quic_listen.is_empty() || !kv.unix_path.is_empty() {
            errs.push(
                "kv.api_quic_listen and kv.unix_path serve the kv face: set kv.listen".into(),
            );
        }
    }
}

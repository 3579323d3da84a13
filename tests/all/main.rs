//! moongate's integration tests, in one binary (moongate and wasmtime are linked once,
//! and one support module serves every test).
//!
//! - Sans-IO against captured frames: [`codec_fixtures`] (0.3.13), [`codec_releases`]
//!   (0.3.11, 0.3.12), [`codec_errors`].
//! - Older releases live, their own masters and clients: [`releases`].
//! - The policy host with real plugin components: [`policy_host`].
//! - The command line: [`cli`], and the offline simulator [`sim`].
//! - The shipped dashboard and alert rules on a real Prometheus: [`dashboards`].
//! - Live, against the real `mooncake_master` and the real Mooncake Python client on
//!   free loopback ports ([`support`] starts, probes and stops them): [`real_mooncake`],
//!   [`master_face_failures`], [`policy_live`], [`eviction_live`], [`replay_live`],
//!   [`kv_face`], [`kv_quic`], [`kv_zero_copy`] (views and reservations of local engines),
//!   [`kv_bounds`] (hostile peers against every kv-face bound),
//!   [`kv_flood`] (2,000 stalled bodies while a new client is served),
//!   [`arm_shares`] (experiment arms held to their capacity shares), [`owner_topology`]
//!   (vLLM's owner with an SSD tier and requester-only ranks: served tiers, offload,
//!   eviction that keeps the SSD, ranks in arms, a disk budget at lookup), [`vllm`]
//!   (real vLLM, its CPU build: moongate's connector over views and reservations, and
//!   vLLM's own Mooncake connector through the master face).
//! - Faults, live: [`ha`] (HA masters through a real etcd: failover, a frozen leader,
//!   etcd down and back), [`faults`] (delay, reset and black hole between moongate and
//!   the master, injected by [`fault_relay`]).
//!
//! Run one group with a filter, e.g. `cargo test --test all -- kv_face::`.

mod support;

mod arm_shares;
mod bridge;
mod cli;
mod codec_errors;
mod codec_fixtures;
mod codec_releases;
mod dashboards;
mod deploy;
mod eviction_live;
mod fault_relay;
mod faults;
mod fleet;
mod ha;
mod hints;
mod kv_bounds;
mod kv_c_abi;
mod kv_events;
mod kv_face;
mod kv_flood;
mod kv_quic;
mod kv_seen;
mod kv_shm;
mod kv_zero_copy;
mod master_face_failures;
mod owner_topology;
mod policy_host;
mod policy_live;
mod real_mooncake;
mod releases;
mod replay_live;
mod sim;
mod supply;
mod vllm;

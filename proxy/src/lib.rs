//! moongate: a policy sidecar for the Mooncake KV-cache store.
//!
//! The house, from the ground up; a module uses only the ones listed before it, and no
//! file imports another in a circle (`docs/architecture.md` has the map, the path of
//! one frame and the path of one decision):
//! - [`validate`], [`per_method`], [`accept`]: small shared blocks (config checks, a
//!   method's metric handles; what every listener does with a connection: the accept
//!   step, a cap per listener, an idle deadline).
//! - [`codec`]: the master RPC wire format, sans-IO; wire types only.
//! - [`calls`]: what each family of master methods means (keys, split, merge, tier
//!   tally, what answers tell the key table).
//! - [`hints`]: what the serving stack tells moongate of the future (upcoming reads,
//!   ended sessions, expected turns): the bounded table and the body it is read from.
//! - [`upstream`]: moongate's own connections to the master and to HTTP endpoints.
//! - [`policy`]: the `Policy` trait, the wasm host, and the one decision lifecycle
//!   (decide -> send -> finish) every face goes through; plugins, swaps, experiments.
//! - [`events`]: KV events for routers (what the key table sees stored and gone, named
//!   as blocks by the policy, published over ZeroMQ).
//! - [`supply`]: where plugin components come from besides files (OCI registries,
//!   registry credentials); bytes only.
//! - [`policy_feed`]: feeds the registry from outside (start-up `from` references, the
//!   watched directory's files and `.oci` references, the admin API's pulls).
//! - [`keys`]: the key table, its history and what its changes announce.
//! - [`answered`]: what an answered call tells, as one value with one sink (the key
//!   table, SSD usage and tiers served, the fleet's access records).
//! - [`fleet`]: moongates of one cluster through etcd (membership, rounds, access
//!   records, hand-over).
//! - [`topology`], [`owner_face`]: who is behind the connections; ranks' SSD reads.
//! - [`eviction`]: the evictor over the key table.
//! - [`kv`]: the kv face (API, client core, transports, own segment).
//! - [`master_face`]: the sans-IO session per client connection and its tokio shell.
//! - [`metrics`], [`admin`], [`config`]: composition of every part's metrics, the admin
//!   endpoint, and the TOML file whose sections each part owns.
//! - [`server`]: wiring, signals and drain.
//! - [`sim`]: policies offline over a trace (`moongate sim`), through the same policy
//!   host and eviction rounds as live traffic.

pub mod accept;
pub mod admin;
pub mod answered;
pub mod calls;
pub mod codec;
pub mod config;
pub mod events;
pub mod eviction;
pub mod fleet;
pub mod heap;
pub mod hints;
pub mod keys;
pub mod kv;
pub mod master_face;
pub mod metrics;
pub mod owner_face;
pub mod per_method;
pub mod policy;
pub mod policy_feed;
pub mod server;
pub mod sim;
pub mod supply;
pub mod topology;
pub mod upstream;
pub mod validate;

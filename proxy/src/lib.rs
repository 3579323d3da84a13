//! moongate: a policy sidecar for the Mooncake KV-cache store.
//!
//! Layers, each owning one thing and never reaching around the one below it:
//! - [`codec`]: the master RPC wire format, sans-IO.
//! - [`master_face`]: accepts Mooncake clients, keeps one upstream master connection per
//!   client connection, decodes and forwards frames.
//! - [`admin`]: liveness, readiness and Prometheus metrics over HTTP.
//! - [`config`]: the TOML file and its validation.
//! - [`metrics`]: metric handles, registered once at start-up.

pub mod accept;
pub mod admin;
pub mod calls;
pub mod codec;
pub mod config;
pub mod eviction;
pub mod kv;
pub mod master_face;
pub mod metrics;
pub mod per_method;
pub mod policy;
pub mod server;
pub mod upstream;
pub mod validate;

//! The kv face: moongate as a native Mooncake client for engines that do not embed
//! Mooncake's client. A small HTTP API (HTTP/1.1 and HTTP/2 cleartext on one listener)
//! over the same objects unmodified Mooncake clients see:
//!
//! - `PUT /v1/kv/{key}` (body = value) -> 201; 507 when the store has no room
//!   (NO_AVAILABLE_HANDLE), 409 when the key exists (OBJECT_ALREADY_EXISTS), 413 over
//!   `kv.max_value_bytes`
//! - `GET /v1/kv/{key}` -> 200 with the value, 404 when absent
//! - `DELETE /v1/kv/{key}` -> 204, 404 when absent, 409 while a reader holds a lease
//! - `POST /v1/kv/exists` with a JSON array of keys -> JSON array of booleans
//! - `POST /v1/kv/batch/get` / `batch/put`: many keys per call in [`records`], moved in
//!   parts under the node's byte budget ([`batch`])
//!
//! With `kv.segment_bytes` > 0 moongate also owns a memory segment ([`segment`],
//! registered by [`mount`]): the master places puts from any client in it, unmodified
//! clients read it over TE-TCP, and the kv face reads and writes it without a socket.
//!
//! The same API is served over QUIC for remote callers ([`api_quic`]).
//!
//! Keys are the path segment after `/v1/kv/`, percent-decoded (UTF-8). Errors are
//! `{"error": "..."}` with a status chosen in one place ([`http::status_of`]).
//! Bytes move over the transfer engine's TCP transport ([`te_tcp`]) to and from the
//! segments the master names; the master is reached on moongate's own connections.

pub mod api_quic;
pub mod batch;
pub mod disk;
pub mod http;
pub mod metadata;
pub mod metrics;
pub mod mount;
pub mod quic;
pub mod rdma;
pub mod records;
pub mod segment;
pub mod store;
pub mod te_tcp;

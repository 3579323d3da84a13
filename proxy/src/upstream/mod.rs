//! moongate's own connections to what it fronts, never a client's: coro_rpc calls to the
//! master ([`rpc`]) and plain HTTP reads and writes ([`http`]: the master's metrics page,
//! the metadata server).

pub mod http;
pub mod rpc;

pub use http::{HttpError, HttpUrl, http_get, http_request};
pub use rpc::{Answer, CallError, Conn, ProbeError, service_ready};

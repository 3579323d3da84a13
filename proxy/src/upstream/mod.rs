//! moongate's own connections to what it fronts, never a client's: coro_rpc calls to the
//! master ([`rpc`]) and plain HTTP reads and writes ([`http`]: the master's metrics page,
//! the metadata server), and where the master is ([`leader`]: fixed, or the HA leader
//! followed through etcd).

pub mod http;
pub mod leader;
pub mod rpc;

pub use http::{HttpError, HttpUrl, http_get, http_request};
pub use leader::{Leader, LeaderMetrics, Upstream, UpstreamSpec};
pub use rpc::{Answer, CallError, Conn, ProbeError, service_ready};

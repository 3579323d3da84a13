//! The kv API: HTTP/1.1 and h2c over TCP or a Unix socket ([`http`]), the same service
//! over QUIC for remote callers ([`quic`]), batch calls in parts under the byte budget
//! ([`batch`]) and their binary records ([`records`]), request bodies under the rate
//! floor, per-connection share and shedding rules ([`intake`], [`body`]), and the
//! shared-memory data path on the Unix socket ([`shm`]) with its zero-copy views and
//! reservations ([`zero_copy`]). Knows the client core and the policy; no master frames,
//! no transfer-engine bytes.

pub mod batch;
pub mod body;
pub mod http;
pub mod intake;
pub mod quic;
pub mod records;
pub mod shm;
pub mod state;
pub mod zero_copy;

pub use state::{KvState, status_of};

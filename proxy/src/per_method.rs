//! The per-method building block the master face and the policy's arms both use: a
//! request counter, a latency histogram and error counters by kind, for one method.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::Histogram;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct MethodLabel {
    pub(crate) method: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ErrorLabels {
    pub(crate) method: String,
    pub(crate) kind: ErrorKind,
}

/// What went wrong with one call.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum ErrorKind {
    /// A transport-level error reply (`err_code != 0`); the client sees `RPC_FAIL`.
    rpc,
    /// An application error (`ErrorCode`) in the reply; batch calls count failed keys.
    app,
    /// A frame of a typed method that did not decode; it was relayed untouched.
    decode,
}

pub const ERROR_KINDS: [ErrorKind; 3] = [ErrorKind::rpc, ErrorKind::app, ErrorKind::decode];

/// Latency buckets (seconds): 25 us (a relayed metadata call's floor) to 10 s.
pub const LATENCY_BUCKETS: [f64; 17] = [
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 0.5,
    1.0, 2.5, 10.0,
];

/// Per-method handles: index = [`Method::index`], the last slot is "unknown".
pub struct MethodMetrics {
    pub requests: Counter,
    pub latency: Histogram,
    pub(crate) errors: [Counter; 3],
}

impl MethodMetrics {
    pub fn error(&self, kind: ErrorKind, n: u64) {
        if n > 0 {
            self.errors[kind as usize].inc_by(n);
        }
    }
}

//! How value bytes move between moongate and the segments that hold them: the transfer
//! engine's TCP protocol ([`te_tcp`], to any Mooncake segment), QUIC between moongates
//! ([`quic`], certificate pinned through the metadata server), and RDMA device detection
//! ([`rdma`], feature `rdma`; no RDMA data path yet). Knows bytes and peers, not keys
//! or the master.

pub mod quic;
pub mod rdma;
pub mod te_tcp;

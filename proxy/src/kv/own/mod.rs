//! moongate's own memory segment (`kv.segment_bytes`): the page-locked memory and its
//! TE-TCP owner side ([`segment`]), and its registration with the master and the
//! metadata server ([`mount`]: mount, heartbeat, remount, unmount on shutdown).

pub mod mount;
pub mod segment;

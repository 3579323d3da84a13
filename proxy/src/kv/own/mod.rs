//! moongate's own memory segment (`kv.segment_bytes`): memory engines on this host can
//! map ([`memory`]), what keeps viewed ranges in place ([`fence`]) and which keys' bytes
//! lie untouched in it ([`known`]), the staging area for
//! values that are not in it ([`staging`]), the TE-TCP owner side ([`segment`]), and
//! its registration with the master and the metadata server ([`mount`]: mount,
//! heartbeat, remount, unmount on shutdown).

pub mod fence;
pub mod known;
pub mod memory;
pub mod mount;
pub mod segment;
pub mod staging;

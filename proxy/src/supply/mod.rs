//! Where plugin components come from besides local files: OCI registries ([`oci`]), and
//! the registry credentials operators already have ([`credentials`]). Knows registries
//! and bytes; what a component may do, and whether its signature is trusted, is the
//! policy layer's business.

pub mod credentials;
pub mod oci;

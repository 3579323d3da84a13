//! RDMA transport detection, behind the `rdma` cargo feature.
//!
//! With the feature, moongate loads `libibverbs.so.1` at run time (Debian's
//! `libibverbs1`; no headers or build-time linking) and counts devices with
//! `ibv_get_device_list`. The RDMA data path (queue pairs, memory registration, Mooncake's
//! RDMA transport handshake) is NOT implemented: whatever this finds, bytes move over
//! TE-TCP or QUIC, and the reason is logged once at start and exported as
//! `moongate_kv_rdma_devices`. Our machines have no RDMA device, so nothing here has
//! been measured on RDMA hardware.

/// What run-time detection found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rdma {
    /// Devices present (count); the data path still falls back (not implemented).
    Devices(usize),
    /// Why RDMA is not available here.
    Unavailable(String),
}

impl Rdma {
    pub fn device_count(&self) -> usize {
        match self {
            Rdma::Devices(n) => *n,
            Rdma::Unavailable(_) => 0,
        }
    }

    /// The transport decision for the log: always a fallback today.
    pub fn fallback_reason(&self) -> String {
        match self {
            Rdma::Devices(n) => format!(
                "{n} RDMA device(s) found, but moongate's RDMA data path is not implemented"
            ),
            Rdma::Unavailable(why) => why.clone(),
        }
    }
}

/// Detects RDMA devices (never fails: every problem is a reason to fall back).
#[cfg(not(feature = "rdma"))]
pub fn detect() -> Rdma {
    Rdma::Unavailable("built without the `rdma` feature".into())
}

/// Detects RDMA devices (never fails: every problem is a reason to fall back).
#[cfg(feature = "rdma")]
pub fn detect() -> Rdma {
    detect_in("libibverbs.so.1")
}

#[cfg(feature = "rdma")]
fn detect_in(library: &str) -> Rdma {
    use std::os::raw::{c_int, c_void};
    type GetList = unsafe extern "C" fn(*mut c_int) -> *mut *mut c_void;
    type FreeList = unsafe extern "C" fn(*mut *mut c_void);
    // SAFETY: loading libibverbs runs its initialisers, which only read the system's
    // RDMA configuration; the two symbols have the C signatures declared above
    // (verbs.h: `struct ibv_device **ibv_get_device_list(int *num_devices)`,
    // `void ibv_free_device_list(struct ibv_device **list)`), and the list is freed
    // exactly once, after its length was read.
    unsafe {
        let lib = match libloading::Library::new(library) {
            Ok(l) => l,
            Err(e) => return Rdma::Unavailable(format!("{library} not loadable: {e}")),
        };
        let get: libloading::Symbol<GetList> = match lib.get(b"ibv_get_device_list\0") {
            Ok(f) => f,
            Err(e) => return Rdma::Unavailable(format!("ibv_get_device_list: {e}")),
        };
        let free: libloading::Symbol<FreeList> = match lib.get(b"ibv_free_device_list\0") {
            Ok(f) => f,
            Err(e) => return Rdma::Unavailable(format!("ibv_free_device_list: {e}")),
        };
        let mut n: c_int = 0;
        let list = get(&mut n);
        if list.is_null() {
            return Rdma::Unavailable("ibv_get_device_list failed (no RDMA subsystem)".into());
        }
        free(list);
        if n <= 0 {
            Rdma::Unavailable("no RDMA device on this host".into())
        } else {
            Rdma::Devices(n as usize)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(not(feature = "rdma"))]
    #[test]
    fn without_the_feature_the_reason_names_the_feature() {
        assert_eq!(
            detect(),
            Rdma::Unavailable("built without the `rdma` feature".into())
        );
        assert_eq!(detect().device_count(), 0);
    }

    /// With the feature, libibverbs (installed by scripts/bootstrap.sh) loads, and the
    /// outcome is one of the two the code can reach with the library present: devices
    /// (whose reason says the data path is not implemented), or none, named as such.
    #[cfg(feature = "rdma")]
    #[test]
    fn with_the_feature_the_library_loads_and_the_outcome_is_named() {
        match detect() {
            Rdma::Devices(n) => {
                assert!(n > 0);
                assert!(
                    Rdma::Devices(n)
                        .fallback_reason()
                        .contains("data path is not implemented")
                );
            }
            Rdma::Unavailable(why) => assert!(
                why == "no RDMA device on this host"
                    || why == "ibv_get_device_list failed (no RDMA subsystem)",
                "unexpected reason (is libibverbs1 installed?): {why}"
            ),
        }
    }

    #[cfg(feature = "rdma")]
    #[test]
    fn a_missing_library_is_a_fallback_not_a_failure() {
        assert!(matches!(
            detect_in("libibverbs-does-not-exist.so.9"),
            Rdma::Unavailable(why) if why.contains("not loadable")
        ));
    }
}

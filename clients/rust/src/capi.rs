//! The C ABI: `libmoongate_kv.so` / `libmoongate_kv.a` and the header `moongate_kv.h`
//! (generated from this file by cbindgen; a test fails when they drift apart).
//!
//! A C or C++ engine links the library and talks to moongate's kv face without writing
//! HTTP: connect, put, get into its own buffer, check existence, remove, in batches too.
//!
//! Contract, for every function:
//! - Handles are thread-safe: calls on one handle from several threads each take a
//!   connection of their own from the handle's pool (opened on demand, kept for reuse:
//!   at most 64 idle ones).
//! - No global state beyond the calling thread's error messages; no panic crosses the
//!   boundary (a bug inside is answered [`MG_ERR_INTERNAL`]).
//! - Return values: 0 or a byte count on success, a negative `MG_ERR_*` code on failure;
//!   [`mg_last_error`] then gives the message.
//! - Pointers: the library never keeps a caller's pointer past the call, and never
//!   frees what the caller owns. Keys are NUL-terminated UTF-8. A NULL where a pointer
//!   is required is [`MG_ERR_ARG`], never a crash.
//!
//! Shared memory: on a `unix:` handle, memory from [`mg_alloc`] (a sealed memfd) is
//! registered with moongate on first use, and [`mg_put`], [`mg_get_into`] and
//! [`mg_batch_get_into`] on it move the values between it and the store without
//! crossing the socket (docs/kv-api.md, "Shared memory"). Other memory, TCP and QUIC
//! handles, and a moongate with `kv.shm = false` take the copying path, with the same
//! results.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod zero_copy;

use crate::quic::{ClientPem, Link, parse_sha256};
use crate::shm::{ShmConn, ShmError};
use crate::{Client, Error};
pub use zero_copy::*;
use zero_copy::{Mapped, handle_token};

/// Success.
pub const MG_OK: c_int = 0;
/// A bad argument: a NULL pointer, a key that is not UTF-8, an address that does not
/// parse, a pointer `mg_free` did not hand out.
pub const MG_ERR_ARG: c_int = -1;
/// The key is not stored.
pub const MG_ERR_NOT_FOUND: c_int = -2;
/// The caller's buffer is smaller than the value (the message gives its length).
pub const MG_ERR_TOO_SMALL: c_int = -3;
/// moongate could not be reached, or the connection broke.
pub const MG_ERR_TRANSPORT: c_int = -4;
/// moongate's byte budget is full (HTTP 503): retry later.
pub const MG_ERR_BUSY: c_int = -5;
/// A reader holds a lease on the key (HTTP 409 on remove): retry later.
pub const MG_ERR_LEASED: c_int = -6;
/// moongate refused the call (another error status; the message gives it).
pub const MG_ERR_REFUSED: c_int = -7;
/// moongate's answer did not parse.
pub const MG_ERR_PROTOCOL: c_int = -8;
/// Memory could not be allocated.
pub const MG_ERR_NOMEM: c_int = -9;
/// A bug in the library, caught at the boundary.
pub const MG_ERR_INTERNAL: c_int = -10;
/// moongate refused this process's shared memory (its uid is not in
/// `kv.shm_allowed_uids`).
pub const MG_ERR_DENIED: c_int = -13;
/// The key is already stored (HTTP 409 on put): Mooncake writes a value once; remove
/// it first to replace it.
pub const MG_ERR_EXISTS: c_int = -11;
/// The store has no room for the value (HTTP 507: no segment has space).
pub const MG_ERR_NO_ROOM: c_int = -12;
/// No such lease or ticket on this handle: released, committed, aborted, expired
/// (`kv.lease_ms`), or another handle's.
pub const MG_ERR_NO_LEASE: c_int = -14;
/// Views and reservations need moongate's memory on this host: a `unix:` handle to a
/// moongate with `kv.shm` and `kv.zero_copy`; or the value is not in moongate's own
/// segment and moongate stages nothing (`kv.staging_bytes = 0`). Copy instead
/// ([`mg_get_into`], [`mg_put`]).
pub const MG_ERR_NOT_LOCAL: c_int = -15;

/// A view or reservation is in moongate's own segment: no byte was copied to view it,
/// and the engine's writes are the stored value.
pub const MG_IN_PLACE: c_int = 0;
/// A view was read into moongate's staging area first (its value lives on another
/// owner or on disk); a reservation is written into the staging area and sent on to
/// where the master placed it at commit.
pub const MG_STAGED: c_int = 1;

/// Idle connections a handle keeps for reuse.
const MAX_IDLE: usize = 64;

/// A batch's items in one shared mapping: `(offset in it, length, key)`.
type ShmItems<'k> = Vec<(u64, u64, &'k str)>;

/// A handle: where moongate is, a pool of connections to it, and the memory
/// [`mg_alloc`] handed out. Opaque to C.
#[allow(non_camel_case_types)]
pub struct mg_client {
    id: u64,
    address: Address,
    idle: Mutex<Vec<Client>>,
    /// Mappings from `mg_alloc`, by address (ordered: a pointer's mapping is the last
    /// one that starts at or below it).
    allocs: Mutex<BTreeMap<usize, Mapping>>,
    /// Idle shared-memory connections (`unix:` handles), each with its registrations
    /// and the [`mg_client::shm_epoch`] it was opened in.
    shm_idle: Mutex<Vec<(u64, ShmConn)>>,
    /// Counts `mg_free` calls. Registrations are keyed by fd, and a freed mapping's fd
    /// may come back from a later `mg_alloc`: a connection opened before a free (idle
    /// then, or in use by another thread) is not used again after it.
    shm_epoch: AtomicU64,
    /// moongate answered that it does not serve shared memory: copy from now on.
    shm_off: std::sync::atomic::AtomicBool,
    /// Names this handle to moongate (`OP_HELLO`): its connections share leases.
    token: u64,
    /// moongate's memories, mapped here (current run first; earlier runs' stay mapped
    /// until [`mg_close`], as views into them may still be read).
    mapped: Mutex<Vec<Mapped>>,
}

enum Address {
    Unix(String),
    Tcp(String),
    /// Each pooled connection is a stream of this one QUIC connection.
    Quic(Arc<Link>),
}

/// How long [`mg_connect_quic`] waits for the QUIC handshake (and a pooled connection
/// for a new stream).
const QUIC_TIMEOUT: Duration = Duration::from_secs(10);

/// One `mg_alloc` mapping: its memfd (what the shared-memory path will pass to moongate).
struct Mapping {
    fd: c_int,
    len: usize,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // Unmapped by the owner before drop (it knows the address); the fd closes here.
        // SAFETY: the fd was opened by mg_alloc and is owned by this mapping alone.
        unsafe {
            libc::close(self.fd);
        }
    }
}

/// A failure: its code and message.
struct Fail(c_int, String);

impl From<ShmError> for Fail {
    fn from(e: ShmError) -> Fail {
        match e {
            ShmError::Refused(code, msg) => Fail(code, msg),
            ShmError::Io(e) => Fail(MG_ERR_TRANSPORT, format!("kv face (shared memory): {e}")),
            ShmError::Unavailable => Fail(MG_ERR_TRANSPORT, "shared memory unavailable".into()),
        }
    }
}

impl From<Error> for Fail {
    fn from(e: Error) -> Fail {
        let code = match &e {
            Error::Io(_) => MG_ERR_TRANSPORT,
            Error::Status { status: 503, .. } => MG_ERR_BUSY,
            Error::Status { status: 409, .. } => MG_ERR_EXISTS,
            Error::Status { status: 507, .. } => MG_ERR_NO_ROOM,
            Error::Status { status: 404, .. } => MG_ERR_NOT_FOUND,
            Error::Status { .. } => MG_ERR_REFUSED,
            Error::Protocol(_) => MG_ERR_PROTOCOL,
            Error::TooSmall { .. } => MG_ERR_TOO_SMALL,
        };
        Fail(code, e.to_string())
    }
}

fn arg(msg: impl Into<String>) -> Fail {
    Fail(MG_ERR_ARG, msg.into())
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);
/// This thread's last failure per handle id (0: `mg_connect`), newest last; a few
/// handles' worth, so a thread that opens and closes many does not grow it.
const ERRORS_KEPT: usize = 16;

thread_local! {
    static ERRORS: RefCell<Vec<(u64, CString)>> = const { RefCell::new(Vec::new()) };
}

fn set_error(id: u64, msg: &str) {
    let msg = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    ERRORS.with(|e| {
        let mut e = e.borrow_mut();
        e.retain(|(i, _)| *i != id);
        if e.len() >= ERRORS_KEPT {
            e.remove(0);
        }
        e.push((id, msg));
    });
}

/// Runs `f` for the C caller: a failure's message is stored for `mg_last_error`, a
/// panic becomes [`MG_ERR_INTERNAL`].
fn guard<T>(id: u64, fail_value: impl Fn(c_int) -> T, f: impl FnOnce() -> Result<T, Fail>) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => v,
        Ok(Err(Fail(code, msg))) => {
            set_error(id, &msg);
            fail_value(code)
        }
        Err(_) => {
            set_error(
                id,
                "internal error in libmoongate_kv (a bug: please report it)",
            );
            fail_value(MG_ERR_INTERNAL)
        }
    }
}

impl mg_client {
    fn connect(&self) -> Result<Client, Error> {
        match &self.address {
            Address::Unix(p) => Client::connect_unix(p),
            Address::Tcp(a) => Client::connect_tcp(a),
            Address::Quic(link) => Client::connect_quic(link),
        }
    }

    /// The `mg_alloc` mapping holding `[p, p + len)`: its memfd, base and length.
    fn mapping_of(&self, p: *const c_void, len: usize) -> Option<(c_int, usize, usize)> {
        self.mapping_at(p as usize, len)
    }

    /// [`mg_client::mapping_of`] by address.
    fn mapping_at(&self, p: usize, len: usize) -> Option<(c_int, usize, usize)> {
        if !matches!(self.address, Address::Unix(_))
            || self.shm_off.load(Ordering::Relaxed)
            || len == 0
        {
            return None;
        }
        let allocs = self.allocs.lock().unwrap_or_else(|e| e.into_inner());
        allocs
            .range(..=p)
            .next_back()
            .filter(|(base, m)| p.checked_add(len).is_some_and(|e| e <= **base + m.len))
            .map(|(base, m)| (m.fd, *base, m.len))
    }

    /// When every buffer `ptrs[i]` (of `lens[i]` bytes) lies in one `mg_alloc` mapping:
    /// its memfd, its length, and the batch items `(offset in it, length, key)`.
    fn in_one_mapping<'k>(
        &self,
        ptrs: impl ExactSizeIterator<Item = usize>,
        lens: &[usize],
        keys: &[&'k str],
    ) -> Option<(c_int, usize, ShmItems<'k>)> {
        let mut items = Vec::with_capacity(ptrs.len());
        let mut first = None;
        for ((p, &len), &k) in ptrs.zip(lens).zip(keys) {
            let (fd, base, alen) = self.mapping_at(p, len)?;
            if *first.get_or_insert((fd, base, alen)) != (fd, base, alen) {
                return None;
            }
            items.push(((p - base) as u64, len as u64, k));
        }
        let (fd, _, alen) = first?;
        Some((fd, alen, items))
    }

    /// Runs `f` on a pooled shared-memory connection; `None` when moongate does not
    /// serve shared memory (the caller copies instead). A connection an I/O error broke
    /// is dropped.
    fn with_shm<T>(
        &self,
        f: impl FnOnce(&mut ShmConn) -> Result<T, ShmError>,
    ) -> Option<Result<T, Fail>> {
        let Address::Unix(path) = &self.address else {
            return None;
        };
        // Read before the connection is used: a free while it is in use makes it stale.
        let epoch = self.shm_epoch.load(Ordering::SeqCst);
        let pooled = {
            let mut idle = self.shm_idle.lock().unwrap_or_else(|p| p.into_inner());
            // Connections from before an mg_free (pushed back as it ran) are dropped.
            idle.retain(|(e, _)| *e == epoch);
            idle.pop().map(|(_, c)| c)
        };
        let mut conn = match pooled {
            Some(c) => c,
            None => match ShmConn::connect(path) {
                Ok(mut c) => {
                    // One engine across the handle's connections. A moongate from
                    // before views refuses the op: the connection still copies.
                    match c.hello(self.token) {
                        Ok(()) | Err(ShmError::Refused(..)) => c,
                        Err(e) => return Some(Err(e.into())),
                    }
                }
                Err(ShmError::Unavailable) => {
                    self.shm_off.store(true, Ordering::Relaxed);
                    return None;
                }
                Err(e) => return Some(Err(e.into())),
            },
        };
        let r = f(&mut conn);
        if !matches!(r, Err(ShmError::Io(_))) && self.shm_epoch.load(Ordering::SeqCst) == epoch {
            let mut idle = self.shm_idle.lock().unwrap_or_else(|p| p.into_inner());
            if idle.len() < MAX_IDLE {
                idle.push((epoch, conn));
            }
        }
        Some(r.map_err(Fail::from))
    }

    /// Runs `f` on a pooled connection. The connection goes back to the pool unless the
    /// call broke it (an I/O or protocol error leaves it in an unknown state).
    fn with<T>(&self, f: impl FnOnce(&mut Client) -> Result<T, Error>) -> Result<T, Fail> {
        let pooled = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut client = match pooled {
            Some(c) => c,
            None => self.connect()?,
        };
        let r = f(&mut client);
        let broken = matches!(r, Err(Error::Io(_) | Error::Protocol(_)));
        if !broken {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            if idle.len() < MAX_IDLE {
                idle.push(client);
            }
        }
        Ok(r?)
    }
}

/// A handle's reference, or [`MG_ERR_ARG`] for NULL.
///
/// # Safety
/// `c` is NULL or a live handle from [`mg_connect`].
unsafe fn handle<'a>(c: *mut mg_client) -> Result<&'a mg_client, Fail> {
    // SAFETY: the caller passes a handle from mg_connect, not yet closed.
    unsafe { c.as_ref() }.ok_or_else(|| arg("NULL handle"))
}

/// # Safety
/// `p` is NULL or a NUL-terminated string.
unsafe fn text<'a>(p: *const c_char, what: &str) -> Result<&'a str, Fail> {
    if p.is_null() {
        return Err(arg(format!("NULL {what}")));
    }
    // SAFETY: non-NULL and NUL-terminated by the contract.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| arg(format!("{what} is not UTF-8")))
}

/// The `n` elements at `p`: none when `n` is 0, where `p` may be NULL (a slice may not
/// be made from NULL, even an empty one).
///
/// # Safety
/// For `n > 0`, `p` points to `n` elements that outlive the call.
unsafe fn elems<'a, T>(p: *const T, n: usize) -> &'a [T] {
    if n == 0 {
        return &[];
    }
    // SAFETY: n > 0 elements at p, by the contract.
    unsafe { std::slice::from_raw_parts(p, n) }
}

/// A batch call's handle and keys, with its three other arrays (`null`: which are NULL,
/// named `names`) checked: NULL is an error unless `n` is 0.
///
/// # Safety
/// As [`handle`] and [`keys`].
unsafe fn batch_args<'a>(
    c: *mut mg_client,
    keys: *const *const c_char,
    n: usize,
    null: [bool; 3],
    names: &str,
) -> Result<(&'a mg_client, Vec<&'a str>), Fail> {
    // SAFETY: by this function's contract.
    let (c, ks) = unsafe { (handle(c)?, self::keys(keys, n)?) };
    if n > 0 && null.iter().any(|&b| b) {
        return Err(arg(format!("NULL {names}")));
    }
    Ok((c, ks))
}

/// # Safety
/// `keys` is NULL or points to `n` NUL-terminated strings.
unsafe fn keys<'a>(keys: *const *const c_char, n: usize) -> Result<Vec<&'a str>, Fail> {
    if n == 0 {
        return Ok(Vec::new());
    }
    if keys.is_null() {
        return Err(arg("NULL keys"));
    }
    // SAFETY: `keys` points to `n` pointers by the contract.
    let ptrs = unsafe { std::slice::from_raw_parts(keys, n) };
    ptrs.iter()
        // SAFETY: each is NULL or NUL-terminated by the contract.
        .map(|&k| unsafe { text(k, "key") })
        .collect()
}

/// Connects to moongate's kv face at `address`: `"unix:PATH"` (its Unix socket) or
/// `"tcp:HOST:PORT"`. Opens one connection at once, so a wrong address fails here.
/// Returns NULL on error; `mg_last_error(NULL)` then says why. Close with [`mg_close`].
/// For a moongate on another host, see [`mg_connect_quic`].
///
/// # Safety
/// `address` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mg_connect(address: *const c_char) -> *mut mg_client {
    guard(
        0,
        |_| std::ptr::null_mut(),
        || {
            // SAFETY: by this function's contract.
            let a = unsafe { text(address, "address") }?;
            let address = if let Some(p) = a.strip_prefix("unix:") {
                Address::Unix(p.to_string())
            } else if let Some(t) = a.strip_prefix("tcp:") {
                Address::Tcp(t.to_string())
            } else if a.starts_with("quic:") {
                return Err(arg(format!(
                    "address {a:?}: QUIC needs moongate's certificate fingerprint: \
                     use mg_connect_quic"
                )));
            } else {
                return Err(arg(format!(
                    "address {a:?}: expected \"unix:PATH\" or \"tcp:HOST:PORT\""
                )));
            };
            open_handle(address, a)
        },
    )
}

/// Connects to moongate's kv face over QUIC (`kv.api_quic_listen`), for an engine on
/// another host: `address` is `"HOST:PORT"` (UDP); `sha256` the 64 hex digits of
/// moongate's certificate fingerprint, which moongate logs at start (`kv API served
/// over QUIC ... sha256=HEX`): only that certificate is trusted. `cert_pem` and
/// `key_pem` are the paths of this caller's certificate and key (PEM), for a moongate
/// with `kv.api_quic_client_ca`; both NULL for none. Completes the handshake at once
/// (up to 10 s), so a wrong address, fingerprint or certificate fails here. The handle
/// works as one from [`mg_connect`]: each pooled connection is a stream of the one
/// QUIC connection (reopened if it was lost); memory from [`mg_alloc`] is copied (the
/// shared-memory path is local only). Returns NULL on error (`mg_last_error(NULL)`).
///
/// # Safety
/// `address` and `sha256` are NULL or NUL-terminated strings; so are `cert_pem` and
/// `key_pem`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mg_connect_quic(
    address: *const c_char,
    sha256: *const c_char,
    cert_pem: *const c_char,
    key_pem: *const c_char,
) -> *mut mg_client {
    guard(
        0,
        |_| std::ptr::null_mut(),
        || {
            // SAFETY: by this function's contract.
            let (a, hex) = unsafe { (text(address, "address")?, text(sha256, "sha256")?) };
            let pin = parse_sha256(hex).ok_or_else(|| {
                arg(format!(
                    "sha256 {hex:?}: expected the 64 hex digits moongate logs"
                ))
            })?;
            let cert = match (cert_pem.is_null(), key_pem.is_null()) {
                (true, true) => None,
                (false, false) => Some(ClientPem {
                    // SAFETY: non-NULL, NUL-terminated by the contract.
                    cert: unsafe { text(cert_pem, "cert_pem") }?,
                    // SAFETY: as above.
                    key: unsafe { text(key_pem, "key_pem") }?,
                }),
                _ => {
                    return Err(arg(
                        "cert_pem and key_pem: give both (a client certificate) or neither",
                    ));
                }
            };
            // Transport errors name the peer already; argument errors get the address.
            let link = Link::connect(a, pin, cert, QUIC_TIMEOUT).map_err(|e| {
                if e.kind() == std::io::ErrorKind::InvalidInput {
                    Fail(MG_ERR_ARG, format!("quic:{a}: {e}"))
                } else {
                    Fail(MG_ERR_TRANSPORT, e.to_string())
                }
            })?;
            open_handle(Address::Quic(link), &format!("quic:{a}"))
        },
    )
}

/// A handle for `address`, with one connection opened at once (`label` names it in
/// errors).
fn open_handle(address: Address, label: &str) -> Result<*mut mg_client, Fail> {
    let c = mg_client {
        id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        address,
        idle: Mutex::new(Vec::new()),
        allocs: Mutex::new(BTreeMap::new()),
        shm_idle: Mutex::new(Vec::new()),
        shm_epoch: AtomicU64::new(0),
        shm_off: std::sync::atomic::AtomicBool::new(false),
        token: handle_token(),
        mapped: Mutex::new(Vec::new()),
    };
    let first = c
        .connect()
        .map_err(|e| Fail(MG_ERR_TRANSPORT, format!("{label}: {e}")))?;
    c.idle.lock().unwrap_or_else(|p| p.into_inner()).push(first);
    Ok(Box::into_raw(Box::new(c)))
}

/// Closes a handle: its connections, and the memory [`mg_alloc`] handed out through it
/// that was not freed. NULL is ignored. The handle must not be used afterwards, nor
/// while another thread still uses it.
///
/// # Safety
/// `c` is NULL or a live handle from [`mg_connect`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mg_close(c: *mut mg_client) {
    if c.is_null() {
        return;
    }
    // SAFETY: a live handle from mg_connect, given back once.
    let c = unsafe { Box::from_raw(c) };
    let _ = catch_unwind(AssertUnwindSafe(move || {
        let allocs = std::mem::take(&mut *c.allocs.lock().unwrap_or_else(|p| p.into_inner()));
        for (at, m) in allocs {
            // SAFETY: a mapping mg_alloc made, at this address and length.
            unsafe {
                libc::munmap(at as *mut c_void, m.len);
            }
        }
        drop(c);
    }));
}

/// The library's version (`"0.1.0"`): moongate's, the Python package's and the wheel's
/// are the same number, one release of the whole project. A static string; do not free
/// it. Which moongate this library can talk to is settled per connection by the
/// protocols' own handshakes: with a moongate whose shared-memory magic differs, shared
/// memory is not used (the copying calls go over HTTP, versioned by its `/v1/` paths).
#[unsafe(no_mangle)]
pub extern "C" fn mg_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// The message of the calling thread's last failed call on `c` (of its last failed
/// [`mg_connect`] when `c` is NULL); `""` when there is none. The string stays valid
/// until this thread's next failing call on the same handle; do not free it.
///
/// # Safety
/// `c` is NULL or a live handle from [`mg_connect`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mg_last_error(c: *mut mg_client) -> *const c_char {
    // SAFETY: by this function's contract.
    let id = unsafe { c.as_ref() }.map_or(0, |c| c.id);
    ERRORS.with(|e| {
        e.borrow()
            .iter()
            .find(|(i, _)| *i == id)
            .map_or(c"".as_ptr(), |(_, m)| m.as_ptr())
    })
}

/// Stores `len` bytes at `data` under `key` (from [`mg_alloc`] memory: without a copy
/// through the socket). 0, or a negative `MG_ERR_*`
/// ([`MG_ERR_EXISTS`] when the key is already stored, [`MG_ERR_BUSY`] or
/// [`MG_ERR_NO_ROOM`] to retry later).
///
/// # Safety
/// `c` a live handle; `key` NUL-terminated; `data` readable for `len` bytes (may be
/// NULL when `len` is 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mg_put(
    c: *mut mg_client,
    key: *const c_char,
    data: *const c_void,
    len: usize,
) -> c_int {
    // SAFETY: by this function's contract.
    let id = unsafe { c.as_ref() }.map_or(0, |c| c.id);
    guard(
        id,
        |e| e,
        || {
            // SAFETY: by this function's contract.
            let (c, key) = unsafe { (handle(c)?, text(key, "key")?) };
            if let Some((fd, base, alen)) = c.mapping_of(data, len) {
                let off = (data as usize - base) as u64;
                let r = c.with_shm(|s| {
                    let region = s.region(fd, alen)?;
                    s.put_from(region, off, len as u64, key)
                });
                if let Some(r) = r {
                    return r.map(|()| MG_OK);
                }
            }
            // SAFETY: readable for len bytes.
            let value = unsafe { bytes(data, len) }?;
            c.with(|cl| cl.put(key, value))?;
            Ok(MG_OK)
        },
    )
}

/// # Safety
/// `p` is readable for `len` bytes, or NULL with `len` 0.
unsafe fn bytes<'a>(p: *const c_void, len: usize) -> Result<&'a [u8], Fail> {
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(arg("NULL data"));
    }
    // SAFETY: readable for len bytes by the contract.
    Ok(unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) })
}

/// # Safety
/// `p` is writable for `len` bytes, or NULL with `len` 0.
unsafe fn bytes_mut<'a>(p: *mut c_void, len: usize) -> Result<&'a mut [u8], Fail> {
    if len == 0 {
        return Ok(&mut []);
    }
    if p.is_null() {
        return Err(arg("NULL buffer"));
    }
    // SAFETY: writable for len bytes by the contract.
    Ok(unsafe { std::slice::from_raw_parts_mut(p.cast::<u8>(), len) })
}

/// Reads the value of `key` into `dst` (room for `cap` bytes): its length in bytes, or
/// a negative `MG_ERR_*`: [`MG_ERR_NOT_FOUND`] when absent, [`MG_ERR_TOO_SMALL`] when
/// it does not fit (`dst` is then unspecified; the message gives the length).
///
/// # Safety
/// `c` a live handle; `key` NUL-terminated; `dst` writable for `cap` bytes (may be NULL
/// when `cap` is 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mg_get_into(
    c: *mut mg_client,
    key: *const c_char,
    dst: *mut c_void,
    cap: usize,
) -> i64 {
    // SAFETY: by this function's contract.
    let id = unsafe { c.as_ref() }.map_or(0, |c| c.id);
    guard(id, i64::from, || {
        // SAFETY: by this function's contract.
        let (c, key) = unsafe { (handle(c)?, text(key, "key")?) };
        if let Some((fd, base, alen)) = c.mapping_of(dst, cap) {
            let off = (dst as usize - base) as u64;
            let r = c.with_shm(|s| {
                let region = s.region(fd, alen)?;
                s.get_into(region, off, cap as u64, key)
            });
            if let Some(r) = r {
                return r.map(|n| n as i64);
            }
        }
        // SAFETY: writable for cap bytes.
        let dst = unsafe { bytes_mut(dst, cap) }?;
        match c.with(|cl| cl.get_into(key, dst))? {
            Some(n) => Ok(n as i64),
            None => Err(Fail(MG_ERR_NOT_FOUND, format!("{key}: not stored"))),
        }
    })
}

/// Whether each of `n` keys is stored: `out[i]` is 1 or 0. 0, or a negative `MG_ERR_*`.
///
/// # Safety
/// `c` a live handle; `keys` points to `n` NUL-terminated strings; `out` writable for
/// `n` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mg_exists(
    c: *mut mg_client,
    keys: *const *const c_char,
    n: usize,
    out: *mut u8,
) -> c_int {
    // SAFETY: by this function's contract.
    let id = unsafe { c.as_ref() }.map_or(0, |c| c.id);
    guard(
        id,
        |e| e,
        || {
            // SAFETY: by this function's contract.
            let (c, ks) = unsafe { (handle(c)?, self::keys(keys, n)?) };
            // SAFETY: writable for n bytes.
            let out = unsafe { bytes_mut(out.cast(), n) }?;
            let found = c.with(|cl| cl.exists(&ks))?;
            if found.len() != n {
                return Err(Fail(
                    MG_ERR_PROTOCOL,
                    format!("{} answers for {n} keys", found.len()),
                ));
            }
            for (o, f) in out.iter_mut().zip(found) {
                *o = u8::from(f);
            }
            Ok(MG_OK)
        },
    )
}

/// Removes `key`. 0; [`MG_ERR_NOT_FOUND`] when it was not stored; [`MG_ERR_LEASED`]
/// while a reader holds a lease on it; or another negative `MG_ERR_*`.
///
/// # Safety
/// `c` a live handle; `key` NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mg_remove(c: *mut mg_client, key: *const c_char) -> c_int {
    // SAFETY: by this function's contract.
    let id = unsafe { c.as_ref() }.map_or(0, |c| c.id);
    guard(
        id,
        |e| e,
        || {
            // SAFETY: by this function's contract.
            let (c, key) = unsafe { (handle(c)?, text(key, "key")?) };
            match c.with(|cl| cl.delete(key)) {
                Ok(true) => Ok(MG_OK),
                Ok(false) => Err(Fail(MG_ERR_NOT_FOUND, format!("{key}: not stored"))),
                // On a remove, 409 is a reader's lease, not an existing key.
                Err(Fail(MG_ERR_EXISTS, msg)) => Err(Fail(MG_ERR_LEASED, msg)),
                Err(f) => Err(f),
            }
        },
    )
}

/// Stores `n` values in one call: key `keys[i]`, `lens[i]` bytes at `data[i]`.
/// `results[i]` gets 0 or the item's negative `MG_ERR_*` ([`MG_ERR_BUSY`]: retry that
/// item). Returns 0 when the call went through (look at `results`), or a negative
/// `MG_ERR_*` when it did not (no item is stored then). When every value lies in one
/// [`mg_alloc`] region of a `unix:` handle, moongate reads them there (shared memory);
/// otherwise they are sent over the socket.
///
/// # Safety
/// `c` a live handle; `keys`, `data`, `lens` and `results` point to `n` elements each;
/// each `data[i]` is readable for `lens[i]` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mg_batch_put(
    c: *mut mg_client,
    keys: *const *const c_char,
    data: *const *const c_void,
    lens: *const usize,
    n: usize,
    results: *mut c_int,
) -> c_int {
    // SAFETY: by this function's contract.
    let id = unsafe { c.as_ref() }.map_or(0, |c| c.id);
    guard(
        id,
        |e| e,
        || {
            let arrays = [data.is_null(), lens.is_null(), results.is_null()];
            // SAFETY: by this function's contract.
            let (c, ks) = unsafe { batch_args(c, keys, n, arrays, "data, lens or results") }?;
            // SAFETY: data and lens hold n elements.
            let (ds, ls) = unsafe { (elems(data, n), elems(lens, n)) };
            // Every value in one mg_alloc mapping: moongate reads them from it directly.
            if let Some((fd, alen, items)) =
                c.in_one_mapping(ds.iter().map(|&p| p as usize), ls, &ks)
            {
                let r = c.with_shm(|s| {
                    let region = s.region(fd, alen)?;
                    s.batch_put_from(region, &items)
                });
                if let Some(r) = r {
                    for (i, code) in r?.into_iter().enumerate() {
                        // SAFETY: results holds n elements; the answer has n (checked).
                        unsafe { *results.add(i) = code };
                    }
                    return Ok(MG_OK);
                }
            }
            let mut items = Vec::with_capacity(n);
            for (i, k) in ks.iter().enumerate() {
                // SAFETY: data and lens hold n elements; data[i] readable for lens[i].
                let v = unsafe { bytes(*data.add(i), *lens.add(i)) }?;
                items.push((*k, v));
            }
            let out = c.with(|cl| cl.batch_put(&items))?;
            for (i, r) in out.into_iter().enumerate() {
                let code = match r {
                    Ok(()) => MG_OK,
                    Err(e) => Fail::from(e).0,
                };
                // SAFETY: results holds n elements, and out has n (checked by batch_put).
                unsafe { *results.add(i) = code };
            }
            Ok(MG_OK)
        },
    )
}

/// Reads `n` values in one call into the caller's buffers: key `keys[i]` into `dst[i]`
/// (room for `caps[i]` bytes). `results[i]` gets the value's length, or the item's
/// negative `MG_ERR_*` ([`MG_ERR_NOT_FOUND`], [`MG_ERR_TOO_SMALL`], [`MG_ERR_BUSY`]).
/// Returns 0 when the call went through (look at `results`), or a negative `MG_ERR_*`.
///
/// # Safety
/// `c` a live handle; `keys`, `dst`, `caps` and `results` point to `n` elements each;
/// each `dst[i]` is writable for `caps[i]` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mg_batch_get_into(
    c: *mut mg_client,
    keys: *const *const c_char,
    dst: *const *mut c_void,
    caps: *const usize,
    n: usize,
    results: *mut i64,
) -> c_int {
    // SAFETY: by this function's contract.
    let id = unsafe { c.as_ref() }.map_or(0, |c| c.id);
    guard(
        id,
        |e| e,
        || {
            let arrays = [dst.is_null(), caps.is_null(), results.is_null()];
            // SAFETY: by this function's contract.
            let (c, ks) = unsafe { batch_args(c, keys, n, arrays, "dst, caps or results") }?;
            // SAFETY: dst and caps hold n elements.
            let (dsts, cs) = unsafe { (elems(dst, n), elems(caps, n)) };
            // Every buffer in one mg_alloc mapping: moongate reads into it directly.
            if let Some((fd, alen, items)) =
                c.in_one_mapping(dsts.iter().map(|&p| p as usize), cs, &ks)
            {
                let r = c.with_shm(|s| {
                    let region = s.region(fd, alen)?;
                    s.batch_get_into(region, &items)
                });
                if let Some(r) = r {
                    for (i, v) in r?.into_iter().enumerate() {
                        // SAFETY: results holds n elements; the answer has n (checked).
                        unsafe { *results.add(i) = v };
                    }
                    return Ok(MG_OK);
                }
            }
            let got = c.with(|cl| cl.batch_get(&ks))?;
            for (i, r) in got.into_iter().enumerate() {
                let out = match r {
                    Ok(Some(v)) => {
                        // SAFETY: dst and caps hold n elements; dst[i] writable for caps[i].
                        let to = unsafe { bytes_mut(*dst.add(i), *caps.add(i)) }?;
                        match to.get_mut(..v.len()) {
                            Some(to) => {
                                to.copy_from_slice(&v);
                                v.len() as i64
                            }
                            None => i64::from(MG_ERR_TOO_SMALL),
                        }
                    }
                    Ok(None) => i64::from(MG_ERR_NOT_FOUND),
                    Err(e) => i64::from(Fail::from(e).0),
                };
                // SAFETY: results holds n elements, and got has n (checked by batch_get).
                unsafe { *results.add(i) = out };
            }
            Ok(MG_OK)
        },
    )
}

/// `len` bytes of memory to share with moongate (a memfd sealed against shrinking,
/// mapped page-aligned and zeroed), owned by the handle until [`mg_free`] or
/// [`mg_close`]. On a `unix:` handle, puts from and gets into it move no value bytes
/// through the socket. NULL on error.
///
/// # Safety
/// `c` a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mg_alloc(c: *mut mg_client, len: usize) -> *mut c_void {
    // SAFETY: by this function's contract.
    let id = unsafe { c.as_ref() }.map_or(0, |c| c.id);
    guard(
        id,
        |_| std::ptr::null_mut(),
        || {
            // SAFETY: by this function's contract.
            let c = unsafe { handle(c) }?;
            if len == 0 {
                return Err(arg("mg_alloc of 0 bytes"));
            }
            let nomem = |what: &str| {
                Fail(
                    MG_ERR_NOMEM,
                    format!("{what} of {len} bytes: {}", std::io::Error::last_os_error()),
                )
            };
            // SAFETY: a plain syscall with a NUL-terminated name.
            let fd = unsafe {
                libc::memfd_create(
                    c"moongate-kv".as_ptr(),
                    libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
                )
            };
            if fd < 0 {
                return Err(nomem("memfd_create"));
            }
            let m = Mapping { fd, len };
            let size = libc::off_t::try_from(len).map_err(|_| arg("mg_alloc: too large"))?;
            // SAFETY: fd is ours.
            if unsafe { libc::ftruncate(fd, size) } != 0 {
                return Err(nomem("ftruncate"));
            }
            // moongate maps only memory that cannot shrink under it.
            // SAFETY: fcntl on our own fd.
            if unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } != 0 {
                return Err(nomem("sealing"));
            }
            // SAFETY: a new shared mapping of our own fd; nothing else is at that address.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(nomem("mmap"));
            }
            c.allocs
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(p as usize, m);
            Ok(p)
        },
    )
}

/// Frees memory from [`mg_alloc`] on the same handle. 0, or [`MG_ERR_ARG`] for a
/// pointer this handle did not hand out (nothing is freed then).
///
/// # Safety
/// `c` a live handle; no other thread uses the memory at `p` any more.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mg_free(c: *mut mg_client, p: *mut c_void) -> c_int {
    // SAFETY: by this function's contract.
    let id = unsafe { c.as_ref() }.map_or(0, |c| c.id);
    guard(
        id,
        |e| e,
        || {
            // SAFETY: by this function's contract.
            let c = unsafe { handle(c) }?;
            let m = c
                .allocs
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&(p as usize))
                .ok_or_else(|| {
                    arg(format!(
                        "mg_free of {p:?}: not from mg_alloc on this handle"
                    ))
                })?;
            // Shared-memory connections may hold a registration of it (keyed by its fd,
            // which a later mg_alloc may reuse): the idle ones close now (releasing
            // every registration), those in use close when they come back.
            c.shm_epoch.fetch_add(1, Ordering::SeqCst);
            c.shm_idle.lock().unwrap_or_else(|p| p.into_inner()).clear();
            // SAFETY: the mapping mg_alloc made at p, of m.len bytes.
            unsafe {
                libc::munmap(p, m.len);
            }
            drop(m);
            Ok(MG_OK)
        },
    )
}

//! Views and reservations of moongate's own memory (docs/kv-api.md, "Zero copy"):
//! moongate's memories mapped into this process once per run of moongate, the calls
//! that view and reserve in them, and the ends of leases and tickets. Part of the C ABI
//! (`moongate_kv.h` is generated from this file and `capi.rs`).

use super::*;
use std::sync::atomic::AtomicBool;

/// One moongate run's memories mapped here.
pub(super) struct Mapped {
    instance: u64,
    memories: Vec<MappedMemory>,
    /// The thread filling these mappings' page tables ([`prefault`]), told to stop and
    /// joined before they are unmapped.
    prefault: Option<(Arc<AtomicBool>, std::thread::JoinHandle<()>)>,
}

/// `MemAvailable` of /proc/meminfo, in bytes.
fn mem_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Fills the page tables of freshly made mappings on a thread of its own, in chunks:
/// the writable ones first (`MADV_POPULATE_WRITE`: moongate's pages made and mapped),
/// then the read-only ones (`MADV_POPULATE_READ`). Without it, an engine's first write
/// into a range of the segment faults once per 4 KiB page (on a VM: 64 KiB in 33 us, a
/// fifth of a copy's speed) and its first read once per page; with it, a first write
/// runs at copy speed. It costs the page tables (8 bytes a page per mapping) and about
/// 0.2 s a GiB of one core, beside the engine's own work: on a 2-core host a vLLM
/// engine's first request after connecting took 196-238 ms instead of 74 with a 2 GiB
/// segment being populated meanwhile, and a GPU engine's registration
/// (`cudaHostRegister`) maps every page anyway. So it is opt-in:
/// `MOONGATE_KV_PREFAULT=1` in the engine's environment (CPU engines that write soon
/// after connecting); moongate makes the pages itself (`kv.prefault`), so without it a
/// first write costs a mapping per page, not a new page; a kernel without these calls (before 5.14) is left as it is; a memory whose
/// pages moongate has not made, larger than nine tenths of the host's available memory,
/// is not populated (the caller leaves it out).
fn prefault(
    memories: &[(usize, usize, usize)],
) -> Option<(Arc<AtomicBool>, std::thread::JoinHandle<()>)> {
    if memories.is_empty() || !std::env::var("MOONGATE_KV_PREFAULT").is_ok_and(|v| v == "1") {
        return None;
    }
    const CHUNK: usize = 64 << 20;
    let stop = Arc::new(AtomicBool::new(false));
    let ranges: Vec<(usize, usize, libc::c_int)> = memories
        .iter()
        .map(|&(rw, _, len)| (rw, len, libc::MADV_POPULATE_WRITE))
        .chain(
            memories
                .iter()
                .map(|&(_, ro, len)| (ro, len, libc::MADV_POPULATE_READ)),
        )
        .collect();
    let flag = stop.clone();
    let t = std::thread::Builder::new()
        .name("moongate-kv-prefault".into())
        .spawn(move || {
            for (base, len, advice) in ranges {
                let mut off = 0;
                while off < len {
                    if flag.load(Ordering::Relaxed) {
                        return;
                    }
                    let n = CHUNK.min(len - off);
                    // SAFETY: inside a mapping this process made and keeps until this
                    // thread is joined; populating changes no byte.
                    if unsafe { libc::madvise((base + off) as *mut c_void, n, advice) } != 0 {
                        return; // not supported here (or a range the engine cannot touch)
                    }
                    off += n;
                }
            }
        })
        .ok()?;
    Some((stop, t))
}

/// One memory: its id, length, and read-only and writable mappings.
struct MappedMemory {
    id: u32,
    len: usize,
    ro: usize,
    rw: usize,
}

impl Drop for Mapped {
    fn drop(&mut self) {
        if let Some((stop, t)) = self.prefault.take() {
            stop.store(true, Ordering::Relaxed);
            let _ = t.join();
        }
        for m in &self.memories {
            // SAFETY: mappings made by `map_memories`, of these lengths, unmapped once.
            unsafe {
                libc::munmap(m.ro as *mut c_void, m.len);
                libc::munmap(m.rw as *mut c_void, m.len);
            }
        }
    }
}

/// A token naming one handle to moongate: random enough that two handles of one process
/// never share one.
pub(super) fn handle_token() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(NEXT_ID.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    h.finish() | 1
}

impl mg_client {
    /// Runs `f` on a shared-memory connection with moongate's memories mapped here for
    /// the run that connection reached; [`MG_ERR_NOT_LOCAL`] when the handle has no
    /// shared-memory path.
    fn with_mapped<T>(
        &self,
        f: impl FnOnce(&mut ShmConn, &[(u32, usize, usize, usize)]) -> Result<T, ShmError>,
    ) -> Result<T, Fail> {
        let not_local = || {
            Fail(
                MG_ERR_NOT_LOCAL,
                "views and reservations need a unix: handle to a moongate with kv.shm and                  kv.zero_copy"
                    .into(),
            )
        };
        self.with_shm(|s| {
            if s.instance == 0 {
                return Err(ShmError::Refused(
                    MG_ERR_NOT_LOCAL,
                    "this moongate has no views or reservations (an older release)".into(),
                ));
            }
            let mems = self.mapped_for(s)?;
            f(s, &mems)
        })
        .ok_or_else(not_local)?
    }

    /// `(id, len, ro, rw)` of each memory of the run `s` reached, mapped on first use.
    fn mapped_for(&self, s: &mut ShmConn) -> Result<Vec<(u32, usize, usize, usize)>, ShmError> {
        let mut mapped = self.mapped.lock().unwrap_or_else(|p| p.into_inner());
        let list = |m: &Mapped| {
            m.memories
                .iter()
                .map(|x| (x.id, x.len, x.ro, x.rw))
                .collect()
        };
        if let Some(m) = mapped.iter().find(|m| m.instance == s.instance) {
            return Ok(list(m));
        }
        let (instance, shared) = s.segments()?;
        let mut memories = Vec::with_capacity(shared.len());
        let mut made_bytes = Vec::with_capacity(shared.len());
        let mut fresh = Mapped {
            instance,
            memories: Vec::new(),
            prefault: None,
        };
        for m in shared {
            let len = usize::try_from(m.len).map_err(|_| std::io::Error::other("too large"))?;
            let map = |fd: &std::os::fd::OwnedFd, prot| {
                use std::os::fd::AsRawFd;
                // SAFETY: a new shared mapping of a descriptor moongate sent.
                let p = unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        len,
                        prot,
                        libc::MAP_SHARED,
                        fd.as_raw_fd(),
                        0,
                    )
                };
                if p == libc::MAP_FAILED {
                    Err(std::io::Error::last_os_error())
                } else {
                    Ok(p as usize)
                }
            };
            let ro = map(&m.ro, libc::PROT_READ)?;
            let rw = match map(&m.rw, libc::PROT_READ | libc::PROT_WRITE) {
                Ok(p) => p,
                Err(e) => {
                    // SAFETY: the mapping just made.
                    unsafe { libc::munmap(ro as *mut c_void, len) };
                    return Err(e.into());
                }
            };
            memories.push(MappedMemory {
                id: m.id,
                len,
                ro,
                rw,
            });
            // Bytes of it that exist already (moongate made them): filling this
            // process's page tables for those takes no memory.
            let made = {
                use std::os::fd::AsRawFd;
                // SAFETY: fstat of a descriptor we own, into a zeroed stat.
                let mut st: libc::stat = unsafe { std::mem::zeroed() };
                if unsafe { libc::fstat(m.rw.as_raw_fd(), &mut st) } == 0 {
                    (st.st_blocks as u64).saturating_mul(512)
                } else {
                    0
                }
            };
            made_bytes.push(made);
        }
        fresh.memories = memories;
        // Only memories whose missing pages fit in what the host has free: populating
        // one larger than that (a segment oversubscribed on purpose) would make every
        // page and end in the OOM killer.
        let mut room = mem_available().map_or(0, |b| b / 10 * 9);
        let ranges: Vec<(usize, usize, usize)> = fresh
            .memories
            .iter()
            .zip(&made_bytes)
            // The own segment only: the staging area is memory moongate takes as it is
            // first used, and keeps it that way.
            .filter(|(m, _)| m.id == 0)
            .filter(|(m, made)| {
                let missing = (m.len as u64).saturating_sub(**made);
                let fits = missing <= room;
                if fits {
                    room -= missing;
                }
                fits
            })
            .map(|(m, _)| (m.rw, m.ro, m.len))
            .collect();
        fresh.prefault = prefault(&ranges);
        let out = list(&fresh);
        // The run this connection reached first: views answered from now on are its.
        mapped.insert(0, fresh);
        Ok(out)
    }
}

/// The address of `[off, off + len)` of memory `id` (read-only or writable mapping),
/// checked to lie inside it.
fn address(
    mems: &[(u32, usize, usize, usize)],
    id: u32,
    off: u64,
    len: u64,
    writable: bool,
) -> Result<usize, ShmError> {
    let (_, mlen, ro, rw) =
        mems.iter().find(|m| m.0 == id).copied().ok_or_else(|| {
            std::io::Error::other(format!("an answer names memory {id}, not shared"))
        })?;
    match off.checked_add(len) {
        Some(end) if end <= mlen as u64 => Ok(if writable { rw } else { ro } + off as usize),
        _ => Err(std::io::Error::other("an answer outside moongate's memory").into()),
    }
}

/// Views the value of `key` where it lies, without copying it: `*data` and `*len` say
/// where it is in moongate's memory (mapped read-only into this process), until
/// [`mg_release`] of `*lease`, `kv.lease_ms` passing, or the handle's end. Returns
/// [`MG_IN_PLACE`] (in moongate's own segment), [`MG_STAGED`] (read into its staging
/// area first), or a negative `MG_ERR_*` (then no lease is held): [`MG_ERR_NOT_FOUND`],
/// [`MG_ERR_NOT_LOCAL`] (no shared memory on this handle, or nothing to stage into),
/// [`MG_ERR_BUSY`] (the value's memory is being rewritten, or staging is full: retry).
/// Writing through `*data` faults this process (the mapping is read-only).
///
/// # Safety
/// `c` a live handle; `key` NUL-terminated; `data`, `len` and `lease` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mg_view(
    c: *mut mg_client,
    key: *const c_char,
    data: *mut *const c_void,
    len: *mut usize,
    lease: *mut u64,
) -> c_int {
    // SAFETY: by this function's contract.
    let id = unsafe { c.as_ref() }.map_or(0, |c| c.id);
    guard(
        id,
        |e| e,
        || {
            // SAFETY: by this function's contract.
            let (c, key) = unsafe { (handle(c)?, text(key, "key")?) };
            if data.is_null() || len.is_null() || lease.is_null() {
                return Err(arg("NULL data, len or lease"));
            }
            let (l, item, at) = c.with_mapped(|s, mems| {
                let (l, items) = s.view(&[key])?;
                let item = items[0];
                let at = if item.status >= 0 {
                    address(mems, item.memory, item.offset, item.extra, false)?
                } else {
                    0
                };
                Ok((l, item, at))
            })?;
            one(key, item.status)?;
            // SAFETY: writable by the contract.
            unsafe {
                *data = at as *const c_void;
                *len = item.extra as usize;
                *lease = l;
            }
            Ok(item.status)
        },
    )
}

/// A single-item call's item status: its place, or its failure with a message that
/// names the key.
fn one(key: &str, status: c_int) -> Result<c_int, Fail> {
    if status < 0 {
        return Err(Fail(status, format!("{key}: {}", describe(status))));
    }
    Ok(status)
}

/// What a per-item code means, for `mg_last_error` after a single-item call.
fn describe(code: c_int) -> &'static str {
    match code {
        MG_ERR_NOT_FOUND => "not stored",
        MG_ERR_BUSY => "busy (the value's memory is being rewritten, or staging is full): retry",
        MG_ERR_NOT_LOCAL => {
            "not in moongate's own segment, and moongate stages nothing (kv.staging_bytes = 0)"
        }
        MG_ERR_NO_LEASE => "no such ticket on this handle",
        MG_ERR_EXISTS => "already stored",
        MG_ERR_NO_ROOM => "no room in the store",
        _ => "refused (moongate's log has the reason)",
    }
}

/// Views `n` values under one lease (`*lease`; 0 when no item could be viewed, and
/// releasing 0 does nothing): `results[i]` is [`MG_IN_PLACE`], [`MG_STAGED`] or the item's
/// negative `MG_ERR_*`, with `data[i]` and `lens[i]` set for the viewed ones. Returns 0
/// when the call went through (look at `results`), or a negative `MG_ERR_*`.
///
/// # Safety
/// `c` a live handle; `keys` points to `n` NUL-terminated strings; `data`, `lens` and
/// `results` to `n` writable elements; `lease` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mg_batch_view(
    c: *mut mg_client,
    keys: *const *const c_char,
    n: usize,
    data: *mut *const c_void,
    lens: *mut usize,
    results: *mut c_int,
    lease: *mut u64,
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
            if lease.is_null() {
                return Err(arg("NULL lease"));
            }
            let (l, out) = c.with_mapped(|s, mems| {
                let (l, items) = s.view(&ks)?;
                let mut out = Vec::with_capacity(n);
                for it in items {
                    let at = if it.status >= 0 {
                        address(mems, it.memory, it.offset, it.extra, false)?
                    } else {
                        0
                    };
                    out.push((it.status, at, it.extra as usize));
                }
                Ok((l, out))
            })?;
            for (i, (st, at, len)) in out.into_iter().enumerate() {
                // SAFETY: the arrays hold n elements; the answer has n (checked).
                unsafe {
                    *results.add(i) = st;
                    *data.add(i) = at as *const c_void;
                    *lens.add(i) = len;
                }
            }
            // SAFETY: writable by the contract.
            unsafe { *lease = l };
            Ok(MG_OK)
        },
    )
}

/// Ends a view lease from [`mg_view`] or [`mg_batch_view`]: its pointers must not be
/// read after. 0 (also for lease 0), or [`MG_ERR_NO_LEASE`] for a lease this handle
/// does not hold (released already, expired, another handle's).
///
/// # Safety
/// `c` a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mg_release(c: *mut mg_client, lease: u64) -> c_int {
    // SAFETY: by this function's contract.
    let id = unsafe { c.as_ref() }.map_or(0, |c| c.id);
    guard(
        id,
        |e| e,
        || {
            // SAFETY: by this function's contract.
            let c = unsafe { handle(c) }?;
            if lease == 0 {
                return Ok(MG_OK);
            }
            c.with_mapped(|s, _| s.release_view(lease))?;
            Ok(MG_OK)
        },
    )
}

/// Ends a view lease as [`mg_release`] does, without waiting for moongate's answer: the
/// release is sent now and moongate acts on it before any later call of this handle's
/// connection; its answer is read with that next call (one round trip saved per batch
/// of views: about half the fixed cost of a batch of small values). 0 once sent; a
/// lease moongate no longer held (released already, expired) is not reported; a broken
/// connection is reported here or by the next call.
///
/// # Safety
/// `c` a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mg_release_later(c: *mut mg_client, lease: u64) -> c_int {
    // SAFETY: by this function's contract.
    let id = unsafe { c.as_ref() }.map_or(0, |c| c.id);
    guard(
        id,
        |e| e,
        || {
            // SAFETY: by this function's contract.
            let c = unsafe { handle(c) }?;
            if lease == 0 {
                return Ok(MG_OK);
            }
            c.with_mapped(|s, _| s.release_view_later(lease))?;
            Ok(MG_OK)
        },
    )
}

/// The mappings of moongate's memory in this process, to register once with a GPU
/// runtime (e.g. `cudaHostRegister`) so that copies from views and into reservations
/// are DMA: per memory (the own segment, then the staging area) its read-only mapping
/// (where views point; register it read-only) then its writable one (where
/// reservations point). Up to `cap` entries are written to `bases` / `lens`; `*n` gets
/// how many there are. 0, [`MG_ERR_TOO_SMALL`] when `cap` is less than `*n` (nothing
/// written but `*n`), or another negative `MG_ERR_*`.
///
/// # Safety
/// `c` a live handle; `bases` and `lens` writable for `cap` elements; `n` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mg_segments(
    c: *mut mg_client,
    bases: *mut *const c_void,
    lens: *mut usize,
    cap: usize,
    n: *mut usize,
) -> c_int {
    // SAFETY: by this function's contract.
    let id = unsafe { c.as_ref() }.map_or(0, |c| c.id);
    guard(
        id,
        |e| e,
        || {
            // SAFETY: by this function's contract.
            let c = unsafe { handle(c) }?;
            if n.is_null() || (cap > 0 && (bases.is_null() || lens.is_null())) {
                return Err(arg("NULL bases, lens or n"));
            }
            let mems = c.with_mapped(|_, mems| Ok(mems.to_vec()))?;
            let entries: Vec<(usize, usize)> = mems
                .iter()
                .flat_map(|&(_, len, ro, rw)| [(ro, len), (rw, len)])
                .collect();
            // SAFETY: writable by the contract.
            unsafe { *n = entries.len() };
            if cap < entries.len() {
                return Err(Fail(
                    MG_ERR_TOO_SMALL,
                    format!("{} mappings, room for {cap}", entries.len()),
                ));
            }
            for (i, (b, l)) in entries.into_iter().enumerate() {
                // SAFETY: cap >= entries, writable by the contract.
                unsafe {
                    *bases.add(i) = b as *const c_void;
                    *lens.add(i) = l;
                }
            }
            Ok(MG_OK)
        },
    )
}

/// Reserves `len` bytes for `key` in moongate's memory: the policy decides the put and
/// the master places it (moongate's own segment preferred). `*data` is where to write
/// the value (a writable mapping here), `*ticket` what [`mg_commit`] publishes it with
/// or [`mg_abort`] drops it with. Nothing is readable before the commit; a ticket never
/// committed (aborted, `kv.lease_ms` passing, the handle's end) leaves no value and its
/// space returns. Returns [`MG_IN_PLACE`] (the bytes written are the stored replica),
/// [`MG_STAGED`] (written into the staging area, sent on to the master's placement at
/// commit), or a negative `MG_ERR_*` ([`MG_ERR_EXISTS`], [`MG_ERR_NO_ROOM`],
/// [`MG_ERR_BUSY`], [`MG_ERR_REFUSED`] by policy, [`MG_ERR_ARG`] over
/// `kv.max_value_bytes`, [`MG_ERR_NOT_LOCAL`]).
///
/// # Safety
/// `c` a live handle; `key` NUL-terminated; `data` and `ticket` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mg_reserve(
    c: *mut mg_client,
    key: *const c_char,
    len: usize,
    data: *mut *mut c_void,
    ticket: *mut u64,
) -> c_int {
    // SAFETY: by this function's contract.
    let id = unsafe { c.as_ref() }.map_or(0, |c| c.id);
    guard(
        id,
        |e| e,
        || {
            // SAFETY: by this function's contract.
            let (c, key) = unsafe { (handle(c)?, text(key, "key")?) };
            if data.is_null() || ticket.is_null() {
                return Err(arg("NULL data or ticket"));
            }
            let (item, at) = c.with_mapped(|s, mems| {
                let it = s.reserve(&[(key, len as u64)])?[0];
                let at = if it.status >= 0 {
                    address(mems, it.memory, it.offset, len as u64, true)?
                } else {
                    0
                };
                Ok((it, at))
            })?;
            one(key, item.status)?;
            // SAFETY: writable by the contract.
            unsafe {
                *data = at as *mut c_void;
                *ticket = item.extra;
            }
            Ok(item.status)
        },
    )
}

/// Reserves `n` values in one decision and one master call: key `keys[i]`, `lens[i]`
/// bytes, written at `data[i]` and published with `tickets[i]`; `results[i]` is
/// [`MG_IN_PLACE`], [`MG_STAGED`] or the item's negative `MG_ERR_*`. Returns 0 when the
/// call went through (look at `results`), or a negative `MG_ERR_*` (no ticket then).
///
/// # Safety
/// `c` a live handle; `keys` points to `n` NUL-terminated strings, `lens` to `n`
/// elements; `data`, `tickets` and `results` to `n` writable elements.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mg_batch_reserve(
    c: *mut mg_client,
    keys: *const *const c_char,
    lens: *const usize,
    n: usize,
    data: *mut *mut c_void,
    tickets: *mut u64,
    results: *mut c_int,
) -> c_int {
    // SAFETY: by this function's contract.
    let id = unsafe { c.as_ref() }.map_or(0, |c| c.id);
    guard(
        id,
        |e| e,
        || {
            let arrays = [
                lens.is_null(),
                data.is_null(),
                tickets.is_null() || results.is_null(),
            ];
            // SAFETY: by this function's contract.
            let (c, ks) =
                unsafe { batch_args(c, keys, n, arrays, "lens, data, tickets or results") }?;
            // SAFETY: lens holds n elements.
            let ls = unsafe { elems(lens, n) };
            let items: Vec<(&str, u64)> = ks.iter().zip(ls).map(|(k, l)| (*k, *l as u64)).collect();
            let out = c.with_mapped(|s, mems| {
                let got = s.reserve(&items)?;
                let mut out = Vec::with_capacity(n);
                for (it, (_, len)) in got.into_iter().zip(&items) {
                    let at = if it.status >= 0 {
                        address(mems, it.memory, it.offset, *len, true)?
                    } else {
                        0
                    };
                    out.push((it.status, at, it.extra));
                }
                Ok(out)
            })?;
            for (i, (st, at, t)) in out.into_iter().enumerate() {
                // SAFETY: the arrays hold n elements; the answer has n (checked).
                unsafe {
                    *results.add(i) = st;
                    *data.add(i) = at as *mut c_void;
                    *tickets.add(i) = t;
                }
            }
            Ok(MG_OK)
        },
    )
}

/// Commits (publishes) or aborts tickets; the shared body of the four calls.
///
/// # Safety
/// As [`mg_batch_commit`].
unsafe fn end_tickets(
    c: *mut mg_client,
    tickets: *const u64,
    n: usize,
    results: *mut c_int,
    op: u8,
) -> c_int {
    // SAFETY: by this function's contract.
    let id = unsafe { c.as_ref() }.map_or(0, |c| c.id);
    guard(
        id,
        |e| e,
        || {
            // SAFETY: by this function's contract.
            let c = unsafe { handle(c) }?;
            if n > 0 && (tickets.is_null() || results.is_null()) {
                return Err(arg("NULL tickets or results"));
            }
            // SAFETY: tickets holds n elements.
            let ts = unsafe { elems(tickets, n) };
            let out = c.with_mapped(|s, _| s.end_tickets(op, ts))?;
            for (i, r) in out.into_iter().enumerate() {
                // SAFETY: results holds n elements; the answer has n (checked).
                unsafe { *results.add(i) = r };
            }
            Ok(MG_OK)
        },
    )
}

/// Publishes a reservation: its bytes are the value of its key from now on (sent on to
/// every other replica first). 0, or a negative `MG_ERR_*` ([`MG_ERR_NO_LEASE`]: not a
/// ticket of this handle, or committed, aborted or expired already).
///
/// # Safety
/// `c` a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mg_commit(c: *mut mg_client, ticket: u64) -> c_int {
    let mut r = MG_OK;
    // SAFETY: one ticket, one result.
    match unsafe { end_tickets(c, &ticket, 1, &mut r, crate::shm::wire::OP_COMMIT) } {
        MG_OK => single(c, r),
        e => e,
    }
}

/// Drops a reservation: nothing becomes visible and its space returns. 0 or
/// [`MG_ERR_NO_LEASE`].
///
/// # Safety
/// `c` a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mg_abort(c: *mut mg_client, ticket: u64) -> c_int {
    let mut r = MG_OK;
    // SAFETY: one ticket, one result.
    match unsafe { end_tickets(c, &ticket, 1, &mut r, crate::shm::wire::OP_ABORT) } {
        MG_OK => single(c, r),
        e => e,
    }
}

/// A single-ticket call's result, its message stored when it failed.
fn single(c: *mut mg_client, r: c_int) -> c_int {
    if r < 0 {
        // SAFETY: a handle the caller just used.
        let id = unsafe { c.as_ref() }.map_or(0, |c| c.id);
        set_error(id, describe(r));
    }
    r
}

/// Commits `n` tickets in one master call: `results[i]` is 0 or the item's negative
/// `MG_ERR_*`. Returns 0 when the call went through (look at `results`).
///
/// # Safety
/// `c` a live handle; `tickets` points to `n` elements, `results` to `n` writable ones.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mg_batch_commit(
    c: *mut mg_client,
    tickets: *const u64,
    n: usize,
    results: *mut c_int,
) -> c_int {
    // SAFETY: by this function's contract.
    unsafe { end_tickets(c, tickets, n, results, crate::shm::wire::OP_COMMIT) }
}

/// Aborts `n` tickets in one master call, as [`mg_batch_commit`].
///
/// # Safety
/// As [`mg_batch_commit`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mg_batch_abort(
    c: *mut mg_client,
    tickets: *const u64,
    n: usize,
    results: *mut c_int,
) -> c_int {
    // SAFETY: by this function's contract.
    unsafe { end_tickets(c, tickets, n, results, crate::shm::wire::OP_ABORT) }
}

//! Memory that engines on this host can map: a sealed memfd mapped here read-write,
//! whose descriptors (a read-write one and a read-only one) can be handed to a local
//! engine over the Unix socket. moongate's own segment is one; the staging area for
//! views of remote values and reservations placed elsewhere is another.
//!
//! The bytes are shared with other processes, so no Rust reference to them is ever held
//! across a copy: every access is a raw copy in or out ([`Memory::read_at`],
//! [`Writing::put`]). A peer that writes where it should not (an engine scribbling over
//! its writable mapping) changes bytes, never this process's control flow: the memfd
//! is sealed against shrinking, so no access here can fault.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

use super::fence::{Fence, Fenced};

/// Copies of at least this many bytes are cut over several threads
/// ([`Memory::set_copy_threads`]); below it one thread is faster than starting others.
const PARALLEL_FROM: usize = 8 << 20;

/// `len` bytes at advertised addresses `[base, base + len)`, backed by a memfd.
pub struct Memory {
    pub base: u64,
    pub len: u64,
    ptr: *mut u8,
    fd: OwnedFd,
    /// The same memfd opened read-only: what an engine maps for views.
    ro_fd: OwnedFd,
    fence: Fence,
    copy_threads: std::sync::atomic::AtomicUsize,
    /// Writes that met a view: `[waited, rejected]` (the kv face's metrics).
    fenced: std::sync::OnceLock<[prometheus_client::metrics::counter::Counter; 2]>,
}

// SAFETY: the mapping is plain shared memory, accessed only by raw copies (see the
// module's note); the pointer is valid for the life of the value.
unsafe impl Send for Memory {}
unsafe impl Sync for Memory {}

impl Drop for Memory {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, of this length, unmapped once.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len as usize);
        }
    }
}

fn os(what: &str) -> impl FnOnce(io::Error) -> io::Error + '_ {
    move |e| io::Error::new(e.kind(), format!("{what}: {e}"))
}

fn check(rc: libc::c_int, what: &str) -> io::Result<()> {
    if rc < 0 {
        Err(os(what)(io::Error::last_os_error()))
    } else {
        Ok(())
    }
}

impl Memory {
    /// A zeroed memfd of `len` bytes named `name` (shown in `/proc/PID/maps`), sealed so
    /// that no holder of its descriptor can shrink or grow it or add seals, mapped here.
    pub fn new(base: u64, len: u64, name: &str) -> io::Result<Memory> {
        let ulen = usize::try_from(len).map_err(|_| io::Error::other("memory too large"))?;
        if ulen == 0 {
            return Err(io::Error::other("memory of 0 bytes"));
        }
        let cname = std::ffi::CString::new(name).map_err(|_| io::Error::other("bad name"))?;
        // SAFETY: a plain syscall with a NUL-terminated name.
        let raw = unsafe {
            libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        check(raw, "memfd_create")?;
        // SAFETY: a new descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let size = libc::off_t::try_from(len).map_err(|_| io::Error::other("too large"))?;
        // SAFETY: ftruncate and fcntl on our own descriptor.
        unsafe {
            check(libc::ftruncate(fd.as_raw_fd(), size), "ftruncate")?;
            check(
                libc::fcntl(
                    fd.as_raw_fd(),
                    libc::F_ADD_SEALS,
                    libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
                ),
                "sealing",
            )?;
        }
        // A second open file description of the same memfd, read-only: mappings made
        // from it cannot be writable, whatever the holder asks.
        let path = std::ffi::CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd()))
            .map_err(|_| io::Error::other("path"))?;
        // SAFETY: open of a NUL-terminated path.
        let ro = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
        check(ro, "reopening the memfd read-only")?;
        // SAFETY: a new descriptor we own.
        let ro_fd = unsafe { OwnedFd::from_raw_fd(ro) };
        let p = map_shared(fd.as_raw_fd(), ulen).map_err(os("mmap"))?;
        Ok(Memory {
            base,
            len,
            ptr: p,
            fd,
            ro_fd,
            fence: Fence::default(),
            copy_threads: std::sync::atomic::AtomicUsize::new(1),
            fenced: std::sync::OnceLock::new(),
        })
    }

    /// Makes this memory's pages and maps them here, on a thread of its own, in 64 MiB
    /// steps (`MADV_POPULATE_WRITE`; `kv.prefault`): a first write into a range here
    /// then costs no page fault per 4 KiB, and an engine's only a mapping, no new page
    /// (on a VM a fresh 64 KiB took 33 us to write, 23 us once its pages existed, 7 us
    /// once mapped by the writer). Stops when everyone else has let go of the memory, or
    /// where the kernel lacks the call (before 5.14); skipped for a segment larger than
    /// nine tenths of the host's available memory. Changes no byte.
    pub fn prefault_in_background(self: &std::sync::Arc<Self>) {
        const STEP: usize = 64 << 20;
        // A segment larger than what the host has free (oversubscribed on purpose) is
        // left to fill as it is written: making every page would end in the OOM killer.
        let available = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|s| {
                let line = s
                    .lines()
                    .find(|l| l.starts_with("MemAvailable:"))?
                    .to_string();
                line.split_whitespace().nth(1)?.parse::<u64>().ok()
            })
            .map(|kib| kib * 1024);
        if available.is_none_or(|a| self.len > a / 10 * 9) {
            tracing::warn!(
                segment_bytes = self.len,
                available_bytes = available,
                "own segment not prefaulted: larger than nine tenths of the memory available"
            );
            return;
        }
        let m = self.clone();
        let spawned = std::thread::Builder::new()
            .name("moongate-prefault".into())
            .spawn(move || {
                let started = std::time::Instant::now();
                let len = m.len as usize;
                let mut off = 0;
                while off < len {
                    if std::sync::Arc::strong_count(&m) == 1 {
                        return;
                    }
                    let n = STEP.min(len - off);
                    // SAFETY: inside this memory's mapping, which `m` keeps alive.
                    let rc = unsafe {
                        libc::madvise(m.ptr.add(off).cast(), n, libc::MADV_POPULATE_WRITE)
                    };
                    if rc != 0 {
                        tracing::info!(
                            error = %io::Error::last_os_error(),
                            "own segment not prefaulted (first writes fault per page)"
                        );
                        return;
                    }
                    off += n;
                }
                tracing::info!(
                    bytes = len,
                    seconds = started.elapsed().as_secs_f64(),
                    "own segment prefaulted"
                );
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the prefault thread");
        }
    }

    /// Threads a large copy in or out is cut over (`kv.copy_threads`); at least 1.
    pub fn set_copy_threads(&self, n: usize) {
        self.copy_threads
            .store(n.max(1), std::sync::atomic::Ordering::Relaxed);
    }

    /// Where writes that met a view are counted: `[waited, rejected]`.
    pub fn count_fenced(&self, c: [prometheus_client::metrics::counter::Counter; 2]) {
        let _ = self.fenced.set(c);
    }

    /// The descriptors an engine maps: `(read-write, read-only)`.
    pub fn fds(&self) -> (RawFd, RawFd) {
        (self.fd.as_raw_fd(), self.ro_fd.as_raw_fd())
    }

    /// Views and writes of this memory.
    pub fn fence(&self) -> &Fence {
        &self.fence
    }

    /// The offset of `[addr, addr + size)` in the segment, if it lies inside.
    pub fn offset_of(&self, addr: u64, size: u64) -> Option<usize> {
        let end = addr.checked_add(size)?;
        (size > 0 && addr >= self.base && end <= self.base + self.len)
            .then(|| (addr - self.base) as usize)
    }

    /// Whether `[off, off + len)` lies inside.
    fn inside(&self, off: usize, len: usize) -> bool {
        off.checked_add(len).is_some_and(|e| e <= self.len as usize)
    }

    /// Copies `out.len()` bytes from `off` into `out`. Panics on a range outside (every
    /// caller checked it with [`Memory::offset_of`] or holds a range it was given).
    pub fn read_at(&self, off: usize, out: &mut [u8]) {
        assert!(self.inside(off, out.len()), "read outside the memory");
        // SAFETY: in bounds (checked); `out` is ours and cannot overlap this mapping.
        unsafe { self.copy(self.ptr.add(off), out.as_mut_ptr(), out.len()) }
    }

    /// `len` bytes from `off` in a new vector, copied once (not zeroed first).
    pub fn read_vec(&self, off: usize, len: usize) -> Vec<u8> {
        assert!(self.inside(off, len), "read outside the memory");
        let mut out = Vec::with_capacity(len);
        // SAFETY: in bounds; the vector has capacity `len`, set to its length once full.
        unsafe {
            self.copy(self.ptr.add(off), out.as_mut_ptr(), len);
            out.set_len(len);
        }
        out
    }

    /// Copies `len` bytes, over several threads when large.
    ///
    /// # Safety
    /// `src` readable and `dst` writable for `len` bytes, not overlapping.
    unsafe fn copy(&self, src: *const u8, dst: *mut u8, len: usize) {
        let threads = self.copy_threads.load(std::sync::atomic::Ordering::Relaxed);
        // SAFETY: by this function's contract.
        unsafe { parallel_copy(src, dst, len, threads) }
    }

    /// Begins a write of `[off, off + len)` (checked inside): `Fenced` while a view
    /// holds part of it.
    pub fn begin_write(&self, off: usize, len: usize) -> Result<Writing<'_>, Fenced> {
        assert!(self.inside(off, len), "write outside the memory");
        let seq = self.fence.begin_write(off, len)?;
        Ok(Writing {
            mem: self,
            off,
            len,
            seq,
        })
    }

    /// As [`Memory::begin_write`], waiting up to `wait` for the views over the range to
    /// end (they end when engines release them, or expire).
    pub async fn begin_write_within(
        &self,
        off: usize,
        len: usize,
        wait: Duration,
    ) -> Result<Writing<'_>, Fenced> {
        let deadline = tokio::time::Instant::now() + wait;
        let count = |i: usize| {
            if let Some(c) = self.fenced.get() {
                c[i].inc();
            }
        };
        let mut waited = false;
        loop {
            match self.begin_write(off, len) {
                Ok(w) => {
                    if waited {
                        count(0);
                    }
                    return Ok(w);
                }
                Err(f) if tokio::time::Instant::now() >= deadline => {
                    count(1);
                    return Err(f);
                }
                // Views last milliseconds to seconds (a load into GPU memory); a short
                // poll costs nothing next to that and needs no wake-up plumbing.
                Err(_) => {
                    waited = true;
                    tokio::time::sleep(Duration::from_millis(2)).await
                }
            }
        }
    }

    /// As [`Memory::begin_write_within`] for a write that outlives this call (an
    /// engine's reservation, written through its own mapping): its sequence number, to
    /// end with `fence().end_write(seq)`.
    pub async fn hold_write_within(
        &self,
        off: usize,
        len: usize,
        wait: Duration,
    ) -> Result<u64, Fenced> {
        let w = self.begin_write_within(off, len, wait).await?;
        let seq = w.seq;
        std::mem::forget(w);
        Ok(seq)
    }

    /// The address of `off` in this process's mapping (for an engine's own copies,
    /// which happen in its mapping, not this one).
    pub fn address_of(&self, off: usize) -> *mut u8 {
        assert!(off <= self.len as usize);
        // SAFETY: in bounds of the mapping.
        unsafe { self.ptr.add(off) }
    }
}

/// A new read-write shared mapping of `len` bytes of `fd` (a memfd sealed against
/// shrinking, at least `len` long: what keeps accesses through it from faulting).
pub fn map_shared(fd: RawFd, len: usize) -> io::Result<*mut u8> {
    // SAFETY: a new mapping at an address the kernel chooses; nothing else is there.
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
        return Err(io::Error::last_os_error());
    }
    Ok(p.cast())
}

/// A write in progress into `[off, off + len)` of a [`Memory`]: no view can begin over
/// it until it is dropped.
pub struct Writing<'a> {
    mem: &'a Memory,
    off: usize,
    len: usize,
    seq: u64,
}

impl Writing<'_> {
    /// Copies `data` to `at` bytes into the range. Panics past its end (callers write
    /// the value they announced).
    pub fn put(&self, at: usize, data: &[u8]) {
        assert!(
            at.checked_add(data.len()).is_some_and(|e| e <= self.len),
            "write past the range begun"
        );
        // SAFETY: inside the range, which is inside the memory; `data` is ours.
        unsafe {
            self.mem
                .copy(data.as_ptr(), self.mem.ptr.add(self.off + at), data.len())
        }
    }
}

impl Drop for Writing<'_> {
    fn drop(&mut self) {
        self.mem.fence.end_write(self.seq);
    }
}

/// Copies `len` bytes from `src` to `dst`: one `memcpy` below [`PARALLEL_FROM`] or with
/// one thread, else cut into one part per thread (each at least 4 MiB), the parts copied
/// at once on scoped threads. One core copies ~10 GB/s; a many-core host's memory
/// moves 35-40 GB/s (docs/results.md, the GPU host).
///
/// # Safety
/// `src` readable and `dst` writable for `len` bytes, not overlapping, neither changed
/// by this process while the copy runs.
pub unsafe fn parallel_copy(src: *const u8, dst: *mut u8, len: usize, threads: usize) {
    let parts = threads.min(len / (4 << 20)).max(1);
    if len < PARALLEL_FROM || parts == 1 {
        // SAFETY: by this function's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
        return;
    }
    let each = len.div_ceil(parts).next_multiple_of(4096);
    let (src, dst) = (src as usize, dst as usize);
    std::thread::scope(|s| {
        for i in 1..parts {
            let from = i * each;
            if from >= len {
                break;
            }
            let n = each.min(len - from);
            s.spawn(move || {
                // SAFETY: a part of the ranges the caller vouched for.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (src + from) as *const u8,
                        (dst + from) as *mut u8,
                        n,
                    )
                }
            });
        }
        // SAFETY: the first part, on this thread.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, each.min(len)) };
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_copies_and_sealed_descriptors() {
        let m = Memory::new(0x1000_0000, 3 << 20, "t").unwrap();
        assert_eq!(m.offset_of(0x1000_0000, 1), Some(0));
        assert_eq!(m.offset_of(0x1000_0000, 0), None);
        assert_eq!(m.offset_of(0x0fff_ffff, 2), None);
        assert_eq!(m.offset_of(0x1000_0000 + (3 << 20) - 1, 2), None);
        assert_eq!(m.offset_of(u64::MAX, 2), None);
        let data: Vec<u8> = (0..(1 << 20) + 10).map(|i| i as u8).collect();
        m.begin_write((1 << 20) - 5, data.len())
            .unwrap()
            .put(0, &data);
        let mut back = vec![0u8; data.len()];
        m.read_at((1 << 20) - 5, &mut back);
        assert_eq!(back, data);
        assert_eq!(m.read_vec((1 << 20) - 5, 3), data[..3]);
        let (rw, ro) = m.fds();
        // SAFETY: test code: fcntl on descriptors the memory owns.
        unsafe {
            let seals = libc::fcntl(rw, libc::F_GET_SEALS);
            assert_ne!(seals & libc::F_SEAL_SHRINK, 0);
            assert_ne!(seals & libc::F_SEAL_SEAL, 0);
            assert_eq!(
                libc::fcntl(ro, libc::F_GETFL) & libc::O_ACCMODE,
                libc::O_RDONLY
            );
            // A writable mapping of the read-only descriptor is refused.
            let p = libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                ro,
                0,
            );
            assert_eq!(p, libc::MAP_FAILED);
            // A read-only one sees what was written through this process's mapping.
            let p = libc::mmap(
                std::ptr::null_mut(),
                2 << 20,
                libc::PROT_READ,
                libc::MAP_SHARED,
                ro,
                0,
            );
            assert_ne!(p, libc::MAP_FAILED);
            assert_eq!(*p.cast::<u8>().add(1 << 20), data[5]);
            libc::munmap(p, 2 << 20);
        }
    }

    #[test]
    fn parallel_copies_are_byte_exact_at_every_cut() {
        for (len, threads) in [(8 << 20, 4), ((8 << 20) + 4097, 3), ((17 << 20) + 1, 16)] {
            let src: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let mut dst = vec![0u8; len];
            // SAFETY: two vectors of `len` bytes.
            unsafe { parallel_copy(src.as_ptr(), dst.as_mut_ptr(), len, threads) };
            assert!(src == dst, "{len} bytes over {threads} threads");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_waits_for_a_view_then_gives_up() {
        let m = std::sync::Arc::new(Memory::new(0x1000, 1 << 20, "t").unwrap());
        m.fence().view(0, 4096, m.fence().write_seq()).unwrap();
        let e = m
            .begin_write_within(0, 10, Duration::from_millis(50))
            .await
            .err();
        assert_eq!(e, Some(Fenced { start: 0, len: 10 }));
        let m2 = m.clone();
        let t = tokio::spawn(async move {
            m2.begin_write_within(100, 10, Duration::from_secs(5))
                .await
                .is_ok()
        });
        tokio::time::sleep(Duration::from_millis(30)).await;
        m.fence().unview(0, 4096);
        assert!(t.await.unwrap(), "the write went ahead once the view ended");
    }
}

"""Batched copies between this process's memory (or its GPU's) and moongate's mappings:
many runs moved as one operation, not one call (and one tensor) per run.

- `CpuCopier`: `memmove`s, cut over threads for moves of 8 MiB and more;
- `CudaCopier`: DMAs on a stream of its own, one `cudaMemcpyBatchAsync` per call where
  the CUDA runtime has it (12.8 and later), else one `cudaMemcpyAsync` per run.

Both take int64 tensors of destination addresses, source addresses and lengths (CPU
tensors; for CUDA, device pointers and host pointers of registered memory alike).
"""
import ctypes
import os

import torch

from . import _error

__all__ = ["CpuCopier", "CudaCopier"]


class CpuCopier:
    """Memory copies by this process, done when `copy` returns: one thread for small
    moves, up to `threads` (the cores, at most 8) for moves of 8 MiB and more, each
    taking a contiguous share of the runs (ctypes releases the GIL while memmove runs).
    One core copies ~6-10 GB/s; a 4,096-token prefix of a small model is 128 MiB."""

    PARALLEL_BYTES = 8 << 20

    def __init__(self, threads=None):
        self.threads = max(1, min(threads or os.cpu_count() or 1, 8))
        self._pool = None

    def copy(self, dst, src, lens, after_current=False):
        d, s, n = dst.tolist(), src.tolist(), lens.tolist()
        total = sum(n)
        if self.threads == 1 or total < self.PARALLEL_BYTES or len(n) < 2:
            _memmoves(d, s, n, 0, len(n))
            return None
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="moongate-copy")
        # Cut the runs where each share reaches its part of the bytes.
        cuts, acc, part = [0], 0, total / self.threads
        for i, k in enumerate(n):
            acc += k
            if acc >= part * len(cuts) and len(cuts) < self.threads:
                cuts.append(i + 1)
        cuts.append(len(n))
        jobs = [self._pool.submit(_memmoves, d, s, n, a, b)
                for a, b in zip(cuts, cuts[1:]) if b > a]
        for j in jobs:
            j.result()
        return None

    def wait(self, ev):
        pass


def _memmoves(d, s, n, a, b):
    mm = ctypes.memmove
    for i in range(a, b):
        mm(d[i], s[i], n[i])


class CudaCopier:
    """DMAs between device memory and moongate's registered mappings on a stream of its
    own: one `cudaMemcpyBatchAsync` per call where the runtime has it, else one
    `cudaMemcpyAsync` per run (no tensor made per run, no Python object per copy)."""

    def __init__(self, stream=None):
        self.stream = stream or torch.cuda.Stream()
        self.rt = _cudart()
        self.batch = _batch_api(self.rt)
        self.batch_error = None

    def copy(self, dst, src, lens, after_current=False):
        cur = torch.cuda.current_stream()
        # Loads and stores both wait for what the caller queued before them: a store
        # reads what it wrote, a load must not land under a kernel still reading the
        # block's previous contents.
        self.stream.wait_stream(cur)
        h = ctypes.c_void_p(self.stream.cuda_stream)
        n = int(lens.numel())
        if n == 0:
            return None
        dst, src, lens = dst.contiguous(), src.contiguous(), lens.contiguous()
        if self.batch is not None:
            rc = self.batch(dst, src, lens, n, h)
            if rc != 0:
                # A runtime that exports the call but refuses it (a driver too old for
                # it): one copy per run from now on, said once.
                self.batch, self.batch_error = None, rc
                import warnings
                warnings.warn(f"cudaMemcpyBatchAsync failed (CUDA error {rc}); copying "
                              "one run at a time")
        if self.batch is None:
            fn = self.rt.cudaMemcpyAsync
            for d, s, k in zip(dst.tolist(), src.tolist(), lens.tolist()):
                rc = fn(ctypes.c_void_p(d), ctypes.c_void_p(s), ctypes.c_size_t(k), 4, h)
                if rc != 0:
                    raise _error(-4, f"cudaMemcpyAsync failed: CUDA error {rc}")
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def wait(self, ev):
        torch.cuda.current_stream().wait_event(ev)


def _cudart():
    """The CUDA runtime torch loaded (the same one its streams belong to)."""
    torch.cuda.init()
    names = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                p = line.split()[-1]
                if "libcudart" in p and p not in names:
                    names.append(p)
    except OSError:
        pass
    for n in names + ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]:
        try:
            rt = ctypes.CDLL(n)
            rt.cudaMemcpyAsync.restype = ctypes.c_int
            rt.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                           ctypes.c_int, ctypes.c_void_p]
            return rt
        except OSError:
            continue
    raise OSError("the CUDA runtime library (libcudart) is not loaded")


class _MemcpyAttributes(ctypes.Structure):
    # struct cudaMemcpyAttributes (CUDA 12.8+): srcAccessOrder, srcLocHint {type, id},
    # dstLocHint {type, id}, flags.
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcType", ctypes.c_int),
                ("srcId", ctypes.c_int), ("dstType", ctypes.c_int), ("dstId", ctypes.c_int),
                ("flags", ctypes.c_uint)]


def _batch_api(rt):
    """A caller of `cudaMemcpyBatchAsync` for this runtime's signature (12.8-12.9: with
    a failIdx out-parameter; 13: without), or None where the runtime lacks it."""
    try:
        fn = rt.cudaMemcpyBatchAsync
    except AttributeError:
        return None
    ver = ctypes.c_int(0)
    rt.cudaRuntimeGetVersion(ctypes.byref(ver))
    if ver.value < 12080:
        return None
    attrs = _MemcpyAttributes(srcAccessOrder=1)  # cudaMemcpySrcAccessOrderStream
    idx = ctypes.c_size_t(0)
    fn.restype = ctypes.c_int
    if ver.value >= 13000:
        def call(dst, src, lens, n, stream):
            return fn(ctypes.c_void_p(dst.data_ptr()), ctypes.c_void_p(src.data_ptr()),
                      ctypes.c_void_p(lens.data_ptr()), ctypes.c_size_t(n),
                      ctypes.byref(attrs), ctypes.byref(idx), ctypes.c_size_t(1), stream)
    else:
        fail = ctypes.c_size_t(0)

        def call(dst, src, lens, n, stream):
            return fn(ctypes.c_void_p(dst.data_ptr()), ctypes.c_void_p(src.data_ptr()),
                      ctypes.c_void_p(lens.data_ptr()), ctypes.c_size_t(n),
                      ctypes.byref(attrs), ctypes.byref(idx), ctypes.c_size_t(1),
                      ctypes.byref(fail), stream)
    return call

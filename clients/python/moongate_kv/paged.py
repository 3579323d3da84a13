"""Blocks of a paged KV cache in and out of moongate, one value per block across layers.

The data path of the vLLM connector (`moongate_kv.vllm`), free of vLLM so that it runs
and is measured wherever torch runs (the GPU host's bench uses it without vLLM):

    import moongate_kv, moongate_kv.paged as paged
    c = moongate_kv.Client("unix:/run/moongate/kv.sock")
    kv = paged.PagedKV(c, layers)         # one tensor per layer, dim 0 = block
    kv.store(keys, block_ids)             # reserve, copy every layer, commit
    failed = kv.load(keys, block_ids)     # view, copy every layer, release

A value holds one block of every layer, layer after layer; within a layer, the block's
bytes in the order they lie in memory. One value per block (not one per block and layer)
because the block sizes engines use are small per layer (a Llama-3-8B-shaped block of 16
tokens is 64 KiB a layer, 2 MiB across 32 layers) and moongate's fixed cost is per value
(docs/results.md, "vLLM connector"). Layer-by-layer jobs (`LoadJob`, `StoreJob`) let an
engine overlap the copies of one layer with the compute of another.

Copies: on CPU tensors, memory copies by this process (`ctypes.memmove`); on CUDA
tensors, DMAs from (views) and into (reservations) moongate's mappings registered with
CUDA, queued on a stream of their own, as one batched call per layer where the CUDA
runtime has `cudaMemcpyBatchAsync` (12.8 and later) and one `cudaMemcpyAsync` per run
otherwise: a launch per small copy would cap a 64 KiB run at ~16 GB/s (4 us each).

A block whose value cannot be viewed (missing, evicted, busy, of another size: nothing a
caller may read as KV) is reported as failed, never copied; the caller recomputes it.
"""
import ctypes
import os

import torch

from . import MoongateError, _error

__all__ = ["PagedKV", "LoadJob", "StoreJob", "block_runs"]

# A batch of keys per kv-face call: moongate's default `kv.max_batch_keys` is 10,000;
# 1,024 keeps one call's lease and reply small while costing one round trip per 1,024
# blocks (16k tokens at vLLM's default block size).
DEFAULT_BATCH = 1024


def block_runs(t):
    """The byte runs of one block of `t` (dim 0 = block), relative to block 0:
    [(offset, length)] in memory order. One run where the block is dense (every layout
    with the block outside heads, tokens and content); several where another dimension
    lies outside the block (e.g. heads outermost)."""
    if t.dim() < 1:
        raise ValueError("a layer's tensor needs a block dimension (dim 0)")
    el = t.element_size()
    dims = sorted((st, sz) for st, sz in zip(t.stride()[1:], t.shape[1:]) if sz != 1)
    dense, k = 1, 0
    for st, sz in dims:
        if st != dense:
            break
        dense *= sz
        k += 1
    offsets = [0]
    for st, sz in dims[k:]:
        offsets = [o + i * st for o in offsets for i in range(sz)]
    offsets.sort()
    return [(o * el, dense * el) for o in offsets]


class PagedKV:
    """Where each block of a paged KV cache lies, and the moves of blocks to and from
    moongate. `layers`: one tensor per layer, all on one device, dim 0 the block (vLLM's
    logical per-layer view [blocks, heads, tokens, content], whatever its strides);
    `client`: a `moongate_kv.Client` on a "unix:" address (views and reservations)."""

    def __init__(self, client, layers, stream=None, batch=DEFAULT_BATCH):
        layers = list(layers)
        if not layers:
            raise ValueError("no layers")
        self.client, self.layers, self.batch = client, layers, max(1, int(batch))
        self.device = layers[0].device
        if any(t.device != self.device for t in layers):
            raise ValueError("every layer must be on one device")
        self.num_blocks = layers[0].shape[0]
        if any(t.shape[0] != self.num_blocks for t in layers):
            raise ValueError("every layer must have the same number of blocks")
        # Per layer: (base address, block stride in bytes, [(offset in block, length,
        # offset in the value)]).
        self.plan = []
        off = 0
        for t in layers:
            runs = []
            for o, n in block_runs(t):
                runs.append((o, n, off))
                off += n
            self.plan.append((t.data_ptr(), t.stride(0) * t.element_size(), runs))
        self.value_bytes = off
        # Layers whose block runs follow each other in memory (a cross-layer layout,
        # e.g. vLLM's BLHNC) move as one run when whole blocks move.
        self.whole = _coalesce(self.plan)
        self.cuda = self.device.type == "cuda"
        self._copier = _CudaCopier(stream) if self.cuda else _CpuCopier()
        if self.cuda:
            from . import torch as mgt
            mgt.register(client, read=True, write=True)

    def describe(self):
        """The layout as text (shapes, dtypes, strides, runs): two caches whose texts
        match store interchangeable values."""
        parts = [f"{tuple(t.shape)}:{t.dtype}:{t.stride()}" for t in self.layers]
        return ";".join(parts) + f"|runs={[len(r) for _, _, r in self.plan]}"

    def _addresses(self, layer, block_ids, value_addrs):
        """Per run of `layer` (None: every layer, coalesced) for each block: (addresses
        in the cache, addresses in the values, lengths), as int64 tensors."""
        plan = self.plan if layer is None else [self.plan[layer]]
        if layer is None:
            plan = self.whole
        b = torch.as_tensor(block_ids, dtype=torch.int64)
        v = torch.as_tensor(value_addrs, dtype=torch.int64)
        cache, value, lens = [], [], []
        for base, stride, runs in plan:
            for o, n, vo in runs:
                cache.append(base + o + b * stride)
                value.append(v + vo)
                lens.append(torch.full_like(b, n))
        return torch.cat(cache), torch.cat(value), torch.cat(lens)

    def load_job(self, keys, block_ids):
        """Views `keys` (one per block of `block_ids`) and returns the job that copies
        them in layer by layer."""
        return LoadJob(self, list(keys), list(block_ids))

    def store_job(self, keys, block_ids):
        """Reserves `keys` for the blocks of `block_ids` and returns the job that copies
        them out layer by layer and commits them."""
        return StoreJob(self, list(keys), list(block_ids))

    def load(self, keys, block_ids):
        """Copies the values of `keys` into the blocks `block_ids`; returns the set of
        block ids that could not be loaded (their contents are untouched)."""
        job = self.load_job(keys, block_ids)
        try:
            job.copy_all()
        finally:
            job.finish()
        return job.failed

    def store(self, keys, block_ids):
        """Stores the blocks `block_ids` under `keys`; returns (stored, skipped): keys
        committed, and {key: code} of those refused (MG_ERR_EXISTS: already stored)."""
        job = self.store_job(keys, block_ids)
        try:
            job.copy_all()
        except BaseException:
            job.abort()
            raise
        return job.finish()


class LoadJob:
    """Values viewed for blocks, copied in per layer (`copy_layer`, or `copy_all`),
    waited for per layer (`wait_layer`), released at `finish`. `failed`: block ids not
    loaded (nothing was copied into them)."""

    def __init__(self, kv, keys, block_ids):
        if len(keys) != len(block_ids):
            raise ValueError("one key per block")
        self.kv, self.failed, self.views = kv, set(), []
        self.ok_blocks, self.addrs = [], []
        self.codes = {}
        self._layer_events = {}
        self._done = False
        try:
            for a in range(0, len(keys), kv.batch):
                vs = kv.client.batch_view(keys[a:a + kv.batch])
                self.views.append(vs)
                for i, (r, n, addr) in enumerate(zip(vs.results, vs.lengths, vs.addresses)):
                    bid = block_ids[a + i]
                    if r < 0 or n != kv.value_bytes:
                        self.failed.add(bid)
                        self.codes[keys[a + i]] = r if r < 0 else "size"
                    else:
                        self.ok_blocks.append(bid)
                        self.addrs.append(addr)
        except MoongateError as e:
            # The call itself failed (moongate gone, refused): nothing is loaded.
            self.failed = set(block_ids)
            self.ok_blocks, self.addrs = [], []
            self.codes = {k: e.code for k in keys}
        except BaseException:
            self.finish()
            raise

    def copy_layer(self, layer):
        if not self.ok_blocks:
            return
        dst, src, lens = self.kv._addresses(layer, self.ok_blocks, self.addrs)
        self._layer_events[layer] = self.kv._copier.copy(dst, src, lens)

    def copy_all(self):
        if not self.ok_blocks:
            return
        dst, src, lens = self.kv._addresses(None, self.ok_blocks, self.addrs)
        ev = self.kv._copier.copy(dst, src, lens)
        for i in range(len(self.kv.layers)):
            self._layer_events[i] = ev

    def wait_layer(self, layer):
        """Makes the caller's current stream wait for `layer`'s copies (CUDA), or
        nothing (CPU copies are done when issued)."""
        ev = self._layer_events.get(layer)
        if ev is not None:
            self.kv._copier.wait(ev)

    def finish(self):
        """Waits for every copy, then releases the views (their bytes may then change)."""
        if self._done:
            return
        self._done = True
        for ev in self._layer_events.values():
            if ev is not None:
                ev.synchronize()
        for vs in self.views:
            try:
                vs.release()
            except MoongateError:
                pass  # expired or moongate gone: nothing of ours is held any more


class StoreJob:
    """Reservations for blocks, copied into per layer, committed at `finish`."""

    def __init__(self, kv, keys, block_ids):
        if len(keys) != len(block_ids):
            raise ValueError("one key per block")
        self.kv = kv
        self.reserved = []  # (key, block id, Reservation)
        self.skipped = {}
        self._events = []
        self._ended = False
        try:
            for a in range(0, len(keys), kv.batch):
                rs, codes = kv.client.batch_reserve(keys[a:a + kv.batch],
                                                    [kv.value_bytes] * len(keys[a:a + kv.batch]))
                for i, (r, c) in enumerate(zip(rs, codes)):
                    if r is None:
                        self.skipped[keys[a + i]] = c
                    else:
                        self.reserved.append((keys[a + i], block_ids[a + i], r))
        except BaseException:
            self.abort()
            raise

    def _copy(self, layer):
        if not self.reserved:
            return
        bids = [b for _, b, _ in self.reserved]
        addrs = [r.address for _, _, r in self.reserved]
        src, dst, lens = self.kv._addresses(layer, bids, addrs)
        self._events.append(self.kv._copier.copy(dst, src, lens, after_current=True))

    def copy_layer(self, layer):
        """Queues `layer`'s copies out of the cache (after the work already queued on the
        caller's current stream, which wrote them)."""
        self._copy(layer)

    def copy_all(self):
        self._copy(None)

    def finish(self):
        """Waits for the copies and commits: (stored keys, {key: code} not stored)."""
        if self._ended:
            return [], dict(self.skipped)
        self._ended = True
        for ev in self._events:
            if ev is not None:
                ev.synchronize()
        if not self.reserved:
            return [], dict(self.skipped)
        codes = self.kv.client.commit([r.ticket for _, _, r in self.reserved])
        stored = []
        for (k, _, _), c in zip(self.reserved, codes):
            if c < 0:
                self.skipped[k] = c
            else:
                stored.append(k)
        return stored, dict(self.skipped)

    def abort(self):
        """Revokes every reservation (nothing of them becomes visible)."""
        if self._ended:
            return
        self._ended = True
        for ev in self._events:
            if ev is not None:
                ev.synchronize()
        if self.reserved:
            try:
                self.kv.client.abort([r.ticket for _, _, r in self.reserved])
            except MoongateError:
                pass  # moongate revokes what an engine left at kv.lease_ms


def _coalesce(plan):
    """The plan for whole-block moves: runs of consecutive layers that follow each other
    in memory, with one block stride, merged into one."""
    flat = []
    for base, stride, runs in plan:
        for o, n, vo in runs:
            flat.append([base + o, stride, n, vo])
    merged = []
    for addr, stride, n, vo in flat:
        if merged:
            m = merged[-1]
            if m[1] == stride and m[0] + m[2] == addr and m[3] + m[2] == vo:
                m[2] += n
                continue
        merged.append([addr, stride, n, vo])
    return [(addr, stride, [(0, n, vo)]) for addr, stride, n, vo in merged]


class _CpuCopier:
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


class _CudaCopier:
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

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
import torch

from . import MoongateError
from .copies import CpuCopier, CudaCopier

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
        self._copier = CudaCopier(stream) if self.cuda else CpuCopier()
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
        plan = self.whole if layer is None else [self.plan[layer]]
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

"""GPU tensors in and out of moongate: store a list of tensors under keys and load keys
into tensors, with the bytes moved by the GPU's DMA straight between its memory and
moongate's (no CPU copy on either side when the values are in moongate's own segment).

    import moongate_kv, moongate_kv.torch as mgt
    c = moongate_kv.Client("unix:/run/moongate/kv.sock")
    mgt.store(c, keys, tensors)          # D2H into reservations, then one commit
    mgt.load(c, keys, out_tensors)       # H2D from views, then one release

How: moongate's memory is mapped into this process by the C library; `register`
pins those mappings with CUDA once (`cudaHostRegister`; the view mapping read-only),
so a copy between them and device tensors is a DMA. A group's copies go as one batched
call on a CUDA stream of their own (`moongate_kv.copies`: `cudaMemcpyBatchAsync` where
the runtime has it), not a tensor and a launch per value, which capped 64 KiB values at
a twentieth of the link. Work is cut into groups (`group` values, 64 by default: a
batch of views costs per call, 7 us a value in groups of 16 and 4 in groups of 64 on
the GPU host): while the GPU copies one group, the next is viewed or reserved, so the
master round trips hide behind the copies.

Tensors must be contiguous; their bytes are stored as they lie (dtype and shape are the
caller's to keep). On CPU tensors the same calls copy with the CPU (what CI tests).
"""
import torch

from . import STAGED, MoongateError, _error
from .copies import CpuCopier, CudaCopier

_registered = {}

# cudaHostRegister flags (CUDA runtime API).
_PORTABLE = 1
_READ_ONLY = 8


def register(client, read=True, write=True):
    """Pins moongate's mappings with CUDA (once per client and kind): copies from views
    (`read`: the read-only mappings) and into reservations (`write`: the writable ones)
    then run at the link's speed. Pinning costs time and locked memory per byte mapped,
    so an engine that only loads registers only `read`. No-op without CUDA. Returns the
    (address, length, writable) mappings registered."""
    key = (id(client), read, write)
    if key in _registered:
        return _registered[key]
    maps = [m for m in client.segments() if (m[2] and write) or (not m[2] and read)]
    maps = [m for m in maps if not any(m in v for v in _registered.values())]
    if torch.cuda.is_available():
        rt = torch.cuda.cudart()
        for addr, length, writable in maps:
            flags = _PORTABLE | (0 if writable else _READ_ONLY)
            err = rt.cudaHostRegister(addr, length, flags)
            try:
                code = int(err)
            except TypeError:
                code = getattr(err, "value", err)
            if code not in (0, 712):  # 712: already registered
                raise RuntimeError(f"cudaHostRegister({addr:#x}, {length}) failed: {err}")
    _registered[key] = maps
    return maps


def _copier(cuda, stream):
    """The batched copier for these tensors: DMAs on `stream` (after the work queued on
    the current stream), or memory copies."""
    if cuda:
        return CudaCopier(stream or torch.cuda.Stream())
    return CpuCopier()


def _bytes_of(t):
    if not t.is_contiguous():
        raise ValueError("tensors must be contiguous")
    return t.view(torch.uint8).reshape(-1) if t.dim() else t.reshape(1).view(torch.uint8)


def _groups(n, group):
    return [(i, min(n, i + group)) for i in range(0, n, group)]


def store(client, keys, tensors, stream=None, group=64):
    """Stores each tensor's bytes under its key: reserved, copied device-to-host into the
    reservation (DMA on `stream`), committed once its group's copies finished. Returns
    the number of values staged (placed outside moongate's own segment; sent on at
    commit). Raises on the first key refused (reservations of that group are aborted)."""
    keys, tensors = list(keys), list(tensors)
    if len(keys) != len(tensors):
        raise ValueError("one key per tensor")
    cuda = any(t.is_cuda for t in tensors)
    if cuda:
        register(client, read=False, write=True)
    copier = _copier(cuda, stream)
    staged = 0
    inflight = []  # (event, tickets)
    for a, b in _groups(len(keys), group):
        srcs = [_bytes_of(t) for t in tensors[a:b]]
        rs, codes = client.batch_reserve(keys[a:b], [s.numel() for s in srcs])
        if any(c < 0 for c in codes):
            for r in rs:
                if r is not None:
                    r.abort()
            bad = next(i for i, c in enumerate(codes) if c < 0)
            raise _error(codes[bad], f"{keys[a + bad]}: reservation refused")
        staged += sum(1 for r in rs if r.staged)
        # One batched copy for the group (not a tensor and a launch per value).
        ev = copier.copy(torch.tensor([r.address for r in rs], dtype=torch.int64),
                         torch.tensor([x.data_ptr() for x in srcs], dtype=torch.int64),
                         torch.tensor([r.length for r in rs], dtype=torch.int64))
        inflight.append((ev, [r.ticket for r in rs]))
        # Commit the group before last: its copies have had this group's reservation
        # round trip to finish.
        while len(inflight) > 1:
            _commit(client, *inflight.pop(0))
    for ev, tickets in inflight:
        _commit(client, ev, tickets)
    return staged


def _commit(client, ev, tickets):
    if ev is not None:
        ev.synchronize()
    client.commit(tickets).raise_first("commit")


def load(client, keys, out, stream=None, group=64):
    """Reads each key into the tensor of the same index in `out` (device or CPU; its byte
    size must equal the value's): viewed, copied host-to-device from the view (DMA on
    `stream`), released once its group's copies finished. Returns the number of values
    that were staged (not in moongate's own segment). Raises `NotFound` for a missing
    key, ValueError for a size that differs."""
    keys, out = list(keys), list(out)
    if len(keys) != len(out):
        raise ValueError("one key per tensor")
    cuda = any(t.is_cuda for t in out)
    if cuda:
        register(client, read=True, write=False)
    copier = _copier(cuda, stream)
    staged = 0
    inflight = []  # (event, views)
    try:
        for a, b in _groups(len(keys), group):
            vs = client.batch_view(keys[a:b])
            inflight.append((None, vs))
            vs.check()
            dsts = [_bytes_of(t) for t in out[a:b]]
            for k, n, d in zip(keys[a:b], vs.lengths, dsts):
                if n != d.numel():
                    raise ValueError(f"{k}: {n} bytes stored, {d.numel()} to fill")
            staged += sum(1 for r in vs.results if r == STAGED)
            ev = copier.copy(torch.tensor([d.data_ptr() for d in dsts], dtype=torch.int64),
                             torch.tensor(vs.addresses, dtype=torch.int64),
                             torch.tensor(vs.lengths, dtype=torch.int64))
            inflight[-1] = (ev, vs)
            while len(inflight) > 1:
                e, v = inflight.pop(0)
                if e is not None:
                    e.synchronize()
                v.release()
    finally:
        for e, v in inflight:
            if e is not None:
                e.synchronize()
            v.release()
    return staged


__all__ = ["register", "store", "load", "MoongateError"]

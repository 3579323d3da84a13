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
a twentieth of the link. Work is cut into groups (`group` values, 64 by default), each
one C call into arrays (addresses, lengths, results written by the library into
tensors: no Python object per value), shared among `workers` threads (2 by default):
while the GPU copies one group, the next is viewed or reserved, and a store's master
round trips (one BatchPutStart and one BatchPutEnd a group) overlap each other.

Tensors must be contiguous; their bytes are stored as they lie (dtype and shape are the
caller's to keep). On CPU tensors the same calls copy with the CPU (what CI tests).
"""
import torch

from . import STAGED, KeyArray, MoongateError, _error
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


def _layout(tensors):
    """Per tensor its address and byte size (int64 CPU tensors); contiguous ones only."""
    ptrs, sizes = [], []
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("tensors must be contiguous")
        ptrs.append(t.data_ptr())
        sizes.append(t.numel() * t.element_size())
    return torch.tensor(ptrs, dtype=torch.int64), torch.tensor(sizes, dtype=torch.int64)


def _groups(n, group):
    return [(i, min(n, i + group)) for i in range(0, n, group)]


def _first(bad):
    """The index of the first True in a bool tensor."""
    return int(torch.nonzero(bad)[0])


# Per group: one C call, a few operations on int64 tensors, one batched copy. Keys,
# addresses, lengths, tickets and results live in arrays made once per call (a
# KeyArray and tensors written by the C library), not in Python objects per value:
# at 64 KiB a value those objects cost more than moongate's own work.
#
# Groups are shared among `workers` threads (each with its own copy stream and, in the
# C library, its own connection): a group's master round trips (a store's BatchPutStart
# and BatchPutEnd) and its Python work overlap another's copies. The C calls and the
# copies run without the GIL. Stores of 64 KiB values on a 2-core VM: 1.7-2.3 GB/s with
# one thread, 3.2-3.3 with two.

_pools = {}


def _in_workers(groups, workers, run):
    """Runs `run(share, stop)` over `groups` cut into `workers` interleaved shares, one a
    thread (the caller's thread takes the first); returns the results in share order.
    The first exception raised is raised once every share has stopped (`stop` is set
    for the others at the first failure)."""
    import threading
    stop = threading.Event()
    shares = [groups[j::workers] for j in range(max(1, min(workers, len(groups))))]
    if len(shares) == 1:
        return [run(shares[0], stop)]
    from concurrent.futures import ThreadPoolExecutor
    pool = _pools.get(len(shares))
    if pool is None:
        pool = _pools[len(shares)] = ThreadPoolExecutor(len(shares) - 1,
                                                       thread_name_prefix="moongate-torch")

    def guarded(share):
        try:
            return run(share, stop)
        except BaseException:
            stop.set()
            raise

    futures = [pool.submit(guarded, sh) for sh in shares[1:]]
    first, out = None, []
    try:
        out.append(guarded(shares[0]))
    except BaseException as e:  # noqa: BLE001 - raised below, after the others stop
        first = e
    for f in futures:
        try:
            out.append(f.result())
        except BaseException as e:  # noqa: BLE001
            first = first or e
    if first is not None:
        raise first
    return out


def store(client, keys, tensors, stream=None, group=64, workers=2):
    """Stores each tensor's bytes under its key: reserved, copied device-to-host into the
    reservation (DMA), committed once its group's copies finished. Returns the number of
    values staged (placed outside moongate's own segment; sent on at commit). Raises on
    the first key refused (reservations of that group are aborted; groups copied before
    it are committed). `stream`: the copy stream of a single worker (`workers=1`);
    with several, each has its own, ordered after the caller's current stream."""
    keys, tensors = list(keys), list(tensors)
    if len(keys) != len(tensors):
        raise ValueError("one key per tensor")
    n = len(keys)
    if n == 0:
        return 0
    cuda = any(t.is_cuda for t in tensors)
    if cuda:
        register(client, read=False, write=True)
    src, sizes = _layout(tensors)
    ka = KeyArray(keys)
    addrs = torch.empty(n, dtype=torch.int64)
    tickets = torch.empty(n, dtype=torch.int64)
    res = torch.empty(n, dtype=torch.int32)
    ends = torch.empty(n, dtype=torch.int32)
    a8, s8, t8, r4, e4 = (addrs.data_ptr(), sizes.data_ptr(), tickets.data_ptr(),
                          res.data_ptr(), ends.data_ptr())

    def commit(ev, a, b):
        if ev is not None:
            ev.synchronize()
        client.commit_at(t8 + 8 * a, b - a, e4 + 4 * a)
        bad = ends[a:b] < 0
        if bool(bad.any()):
            i = a + _first(bad)
            raise _error(int(ends[i]), f"{keys[i]}: commit refused")

    def run(share, stop):
        copier = _copier(cuda, stream if workers <= 1 else None)
        staged = 0
        inflight = []  # (event, a, b)
        try:
            for a, b in share:
                if stop.is_set():
                    break
                client.batch_reserve_at(ka, a, b - a, s8 + 8 * a, a8 + 8 * a, t8 + 8 * a,
                                        r4 + 4 * a)
                r = res[a:b]
                bad = r < 0
                if bool(bad.any()):
                    held = tickets[a:b][~bad].contiguous()
                    if held.numel():
                        scratch = torch.empty(held.numel(), dtype=torch.int32)
                        client.abort_at(held.data_ptr(), held.numel(), scratch.data_ptr())
                    i = a + _first(bad)
                    raise _error(int(res[i]), f"{keys[i]}: reservation refused")
                staged += int((r == STAGED).sum())
                inflight.append((copier.copy(addrs[a:b], src[a:b], sizes[a:b]), a, b))
                # Commit the group before last: its copies have had this group's
                # reservation round trip to finish.
                while len(inflight) > 1:
                    commit(*inflight.pop(0))
            while inflight:
                commit(*inflight.pop(0))
        except BaseException:
            # Groups already reserved and copied are stored; the error is the first.
            for ev, a, b in inflight:
                try:
                    commit(ev, a, b)
                except Exception:  # noqa: BLE001 - the first error is the one raised
                    pass
            raise
        return staged

    return sum(_in_workers(_groups(n, group), workers, run))


def load(client, keys, out, stream=None, group=64, workers=2):
    """Reads each key into the tensor of the same index in `out` (device or CPU; its byte
    size must equal the value's): viewed, copied host-to-device from the view (DMA),
    released once its group's copies finished. Returns the number of values that were
    staged (not in moongate's own segment). Raises `NotFound` for a missing key,
    ValueError for a size that differs. `stream` and `workers` as for `store`."""
    keys, out = list(keys), list(out)
    if len(keys) != len(out):
        raise ValueError("one key per tensor")
    n = len(keys)
    if n == 0:
        return 0
    cuda = any(t.is_cuda for t in out)
    if cuda:
        register(client, read=True, write=False)
    dst, want = _layout(out)
    ka = KeyArray(keys)
    addrs = torch.empty(n, dtype=torch.int64)
    lens = torch.empty(n, dtype=torch.int64)
    res = torch.empty(n, dtype=torch.int32)
    a8, l8, r4 = addrs.data_ptr(), lens.data_ptr(), res.data_ptr()

    def run(share, stop):
        copier = _copier(cuda, stream if workers <= 1 else None)
        staged = 0
        inflight = []  # (event, lease)
        try:
            for a, b in share:
                if stop.is_set():
                    break
                inflight.append((None, client.batch_view_at(ka, a, b - a, a8 + 8 * a,
                                                            l8 + 8 * a, r4 + 4 * a)))
                r = res[a:b]
                bad = r < 0
                if bool(bad.any()):
                    i = a + _first(bad)
                    raise _error(int(res[i]), f"{keys[i]}: not viewed")
                differ = lens[a:b] != want[a:b]
                if bool(differ.any()):
                    i = a + _first(differ)
                    raise ValueError(
                        f"{keys[i]}: {int(lens[i])} bytes stored, {int(want[i])} to fill")
                staged += int((r == STAGED).sum())
                inflight[-1] = (copier.copy(dst[a:b], addrs[a:b], lens[a:b]), inflight[-1][1])
                while len(inflight) > 1:
                    ev, lease = inflight.pop(0)
                    if ev is not None:
                        ev.synchronize()
                    client.release_later(lease)
        finally:
            for ev, lease in inflight:
                if ev is not None:
                    ev.synchronize()
                try:
                    client.release_later(lease)
                except MoongateError:
                    pass  # the connection broke: its leases end with it
        return staged

    # Every group's copies finished before its views were released: `out` is ready.
    return sum(_in_workers(_groups(n, group), workers, run))


__all__ = ["register", "store", "load", "MoongateError"]

"""moongate's kv face from Python, over the C library libmoongate_kv.

    import moongate_kv
    c = moongate_kv.Client("unix:/run/moongate/kv.sock")
    c.put("model/0/blk42", b"...")
    with c.view("model/0/blk42") as v:       # no copy: v.buffer is moongate's memory
        first = bytes(v.buffer[:16])
    r = c.reserve("model/0/blk43", 4096)     # write where the value will live
    r.buffer[:] = b"x" * 4096
    r.commit()

GPU tensors: `moongate_kv.torch` (imports torch when used).

The binding is ctypes over the C ABI (clients/rust/include/moongate_kv.h): no
dependency, importable without torch, and every call releases the GIL while it runs, so
threads overlap their calls. The wheel (`bash scripts/wheel.sh`, then `pip install` it)
carries the library and its header (`moongate_kv/include/moongate_kv.h`, for C engines
that take it from the same place). The library is found at $MOONGATE_KV_LIB (an explicit
choice wins), else the package's own (beside this file), else the repository's
target/release (a checkout built with `cargo build --release -p moongate-kv`), else on
the loader's path. `__version__` is the library's: moongate, the library and the
package are released as one version.

Errors raise `MoongateError` (its `code` is the C library's MG_ERR_*), or one of its
subclasses for the codes callers branch on: `NotFound`, `Busy`, `Exists`, `NoRoom`,
`NoLease`, `NotLocal`.
"""
import ctypes
import ctypes.util
import glob
import os
import threading

__all__ = [
    "Client", "View", "Views", "Reservation", "MoongateError", "NotFound", "Busy",
    "Exists", "NoRoom", "NoLease", "NotLocal", "IN_PLACE", "STAGED", "library_path",
    "KeyArray", "__version__",
]

IN_PLACE = 0
STAGED = 1

ERR_ARG, ERR_NOT_FOUND, ERR_TOO_SMALL, ERR_TRANSPORT, ERR_BUSY = -1, -2, -3, -4, -5
ERR_LEASED, ERR_REFUSED, ERR_PROTOCOL, ERR_NOMEM, ERR_INTERNAL = -6, -7, -8, -9, -10
ERR_EXISTS, ERR_NO_ROOM, ERR_DENIED, ERR_NO_LEASE, ERR_NOT_LOCAL = -11, -12, -13, -14, -15


class MoongateError(Exception):
    """A call failed: `code` is the C library's MG_ERR_* (negative)."""

    def __init__(self, code, message):
        super().__init__(f"{message} (MG_ERR {code})")
        self.code = code


class NotFound(MoongateError, KeyError):
    pass


class Busy(MoongateError):
    pass


class Exists(MoongateError):
    pass


class NoRoom(MoongateError):
    pass


class NoLease(MoongateError):
    pass


class NotLocal(MoongateError):
    pass


_BY_CODE = {ERR_NOT_FOUND: NotFound, ERR_BUSY: Busy, ERR_EXISTS: Exists,
            ERR_NO_ROOM: NoRoom, ERR_NO_LEASE: NoLease, ERR_NOT_LOCAL: NotLocal}


def _error(code, message):
    return _BY_CODE.get(code, MoongateError)(code, message)


def library_path():
    """Where libmoongate_kv.so is loaded from (see the module's note)."""
    env = os.environ.get("MOONGATE_KV_LIB")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    # The wheel's own (the build names it libmoongate_kv.so, with or without an ABI tag).
    beside = sorted(glob.glob(os.path.join(here, "libmoongate_kv*.so")))
    if beside:
        return beside[0]
    repo = os.path.join(here, "..", "..", "..", "target", "release", "libmoongate_kv.so")
    if os.path.exists(repo):
        return os.path.normpath(repo)
    found = ctypes.util.find_library("moongate_kv")
    if found:
        return found
    raise OSError("libmoongate_kv.so not found: install the wheel (bash scripts/wheel.sh "
                  "builds it), set MOONGATE_KV_LIB, or build it with "
                  "`cargo build --release -p moongate-kv`")


_lib = None
_lib_lock = threading.Lock()
_P = ctypes.c_void_p
_SZ = ctypes.c_size_t
_KEYS = ctypes.POINTER(ctypes.c_char_p)


def _load():
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        lib = ctypes.CDLL(library_path())
        sig = {
            "mg_version": (ctypes.c_char_p, []),
            "mg_connect": (_P, [ctypes.c_char_p]),
            "mg_close": (None, [_P]),
            "mg_last_error": (ctypes.c_char_p, [_P]),
            "mg_put": (ctypes.c_int, [_P, ctypes.c_char_p, _P, _SZ]),
            "mg_get_into": (ctypes.c_int64, [_P, ctypes.c_char_p, _P, _SZ]),
            "mg_exists": (ctypes.c_int, [_P, _KEYS, _SZ, ctypes.POINTER(ctypes.c_uint8)]),
            "mg_remove": (ctypes.c_int, [_P, ctypes.c_char_p]),
            "mg_view": (ctypes.c_int, [_P, ctypes.c_char_p, ctypes.POINTER(_P),
                                       ctypes.POINTER(_SZ), ctypes.POINTER(ctypes.c_uint64)]),
            "mg_batch_view": (ctypes.c_int, [_P, _KEYS, _SZ, ctypes.POINTER(_P),
                                             ctypes.POINTER(_SZ), ctypes.POINTER(ctypes.c_int),
                                             ctypes.POINTER(ctypes.c_uint64)]),
            "mg_release": (ctypes.c_int, [_P, ctypes.c_uint64]),
            "mg_release_later": (ctypes.c_int, [_P, ctypes.c_uint64]),
            "mg_segments": (ctypes.c_int, [_P, ctypes.POINTER(_P), ctypes.POINTER(_SZ), _SZ,
                                           ctypes.POINTER(_SZ)]),
            "mg_reserve": (ctypes.c_int, [_P, ctypes.c_char_p, _SZ, ctypes.POINTER(_P),
                                          ctypes.POINTER(ctypes.c_uint64)]),
            "mg_batch_reserve": (ctypes.c_int, [_P, _KEYS, ctypes.POINTER(_SZ), _SZ,
                                                ctypes.POINTER(_P),
                                                ctypes.POINTER(ctypes.c_uint64),
                                                ctypes.POINTER(ctypes.c_int)]),
            "mg_commit": (ctypes.c_int, [_P, ctypes.c_uint64]),
            "mg_abort": (ctypes.c_int, [_P, ctypes.c_uint64]),
            "mg_batch_commit": (ctypes.c_int, [_P, ctypes.POINTER(ctypes.c_uint64), _SZ,
                                               ctypes.POINTER(ctypes.c_int)]),
            "mg_batch_abort": (ctypes.c_int, [_P, ctypes.POINTER(ctypes.c_uint64), _SZ,
                                              ctypes.POINTER(ctypes.c_int)]),
        }
        for name, (res, args) in sig.items():
            f = getattr(lib, name)
            f.restype = res
            f.argtypes = args
        # The batch calls again, every pointer a plain address: for callers that keep
        # keys, addresses and results in arrays of their own (KeyArray, tensors), so a
        # group costs one call and no Python object per key.
        a, z, i = _P, _SZ, ctypes.c_int
        raw = {
            "mg_batch_view": ctypes.CFUNCTYPE(i, a, a, z, a, a, a, a),
            "mg_batch_reserve": ctypes.CFUNCTYPE(i, a, a, a, z, a, a, a),
            "mg_batch_commit": ctypes.CFUNCTYPE(i, a, a, z, a),
            "mg_batch_abort": ctypes.CFUNCTYPE(i, a, a, z, a),
        }
        lib.raw = {name: proto(ctypes.cast(getattr(lib, name), _P).value)
                   for name, proto in raw.items()}
        _lib = lib
        return lib


def __getattr__(name):
    # `__version__` asks the library (loaded on first use, not at import).
    if name == "__version__":
        return _load().mg_version().decode()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class KeyArray:
    """Keys encoded once into one C array, for the `*_at` calls of `Client`: a batch is a
    slice of it (`start`, `n`), so a caller moving thousands of values in groups encodes
    each key once and builds no list per group."""

    def __init__(self, keys):
        self._keys = [_key(k) for k in keys]
        self._arr = (ctypes.c_char_p * max(len(self._keys), 1))(*self._keys)
        self._base = ctypes.addressof(self._arr)

    def __len__(self):
        return len(self._keys)

    def at(self, i):
        """The address of key `i`'s pointer in the array."""
        if not 0 <= i <= len(self._keys):
            raise IndexError(i)
        return self._base + i * ctypes.sizeof(ctypes.c_char_p)

    def key(self, i):
        return self._keys[i].decode(errors="replace")


def _key(k):
    return k.encode() if isinstance(k, str) else bytes(k)


def _keys(keys):
    ks = [_key(k) for k in keys]
    return ks, (ctypes.c_char_p * len(ks))(*ks)


def _drop(mv):
    """Releases a memoryview of moongate's memory (views taken of it stay valid Python
    objects, but must not be used after the lease ends)."""
    if mv is not None:
        try:
            mv.release()
        except BufferError:
            pass


def _memory(address, length, writable):
    """A memoryview of `length` bytes at `address` (read-only unless `writable`)."""
    if length == 0:
        return memoryview(b"")
    mv = memoryview((ctypes.c_char * length).from_address(address)).cast("B")
    return mv if writable else mv.toreadonly()


class View:
    """One value viewed under its own lease; `buffer` is valid until `release()` (or
    the end of a `with` block). `staged`: read into moongate's staging area first."""

    def __init__(self, client, address, length, lease, place):
        self._client, self.address, self.length, self.lease = client, address, length, lease
        self.staged = place == STAGED
        self.buffer = _memory(address, length, False)

    def release(self):
        if self.lease:
            _drop(self.buffer)
            self._client.release(self.lease)
            self.lease = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


class Views:
    """Values viewed under one lease: per key `buffers[i]` (None where `results[i]` is
    an error code), `addresses[i]`, `lengths[i]`; `results[i]` is IN_PLACE, STAGED or a
    negative MG_ERR_*."""

    def __init__(self, client, keys, addresses, lengths, results, lease):
        self._client, self.keys, self.lease = client, keys, lease
        self.addresses, self.lengths, self.results = addresses, lengths, results
        self._buffers = None

    @property
    def buffers(self):
        """Per key a read-only memoryview of the value (None where not viewed). Made on
        first use: a memoryview costs ~2 us, as much as moongate's own work per value,
        and callers that copy by address (moongate_kv.paged, the torch helpers) need none."""
        if self._buffers is None:
            self._buffers = [_memory(a, n, False) if r >= 0 else None
                             for a, n, r in zip(self.addresses, self.lengths, self.results)]
        return self._buffers

    def check(self):
        """Raises for the first key that could not be viewed."""
        for k, r in zip(self.keys, self.results):
            if r < 0:
                raise _error(r, f"{k}: not viewed")
        return self

    def release(self):
        """Ends the lease. The release is sent without waiting for moongate's answer
        (read with this client's next call: one round trip saved per batch); the
        buffers must not be read after."""
        if self.lease:
            for b in self._buffers or ():
                _drop(b)
            self._client.release_later(self.lease)
            self.lease = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


class Reservation:
    """Room for one value in moongate's memory: write `buffer`, then `commit()` (or
    `abort()`). `staged`: sent on to where the master placed it at commit."""

    def __init__(self, client, key, address, length, ticket, place):
        self._client, self.key, self.address, self.length = client, key, address, length
        self.ticket, self.staged = ticket, place == STAGED
        self._buffer = None

    @property
    def buffer(self):
        """A writable memoryview of the reservation, made on first use (see
        `Views.buffers`)."""
        if self._buffer is None:
            self._buffer = _memory(self.address, self.length, True)
        return self._buffer

    def commit(self):
        _drop(self._buffer)
        self._client.commit([self.ticket]).raise_first()

    def abort(self):
        _drop(self._buffer)
        self._client.abort([self.ticket])


class _Codes(list):
    def raise_first(self, what="ticket"):
        for c in self:
            if c < 0:
                raise _error(c, f"{what}: refused")
        return self


class Client:
    """A handle on moongate's kv face: "unix:PATH" (shared memory, views and
    reservations) or "tcp:HOST:PORT" (copies only). Thread-safe; close() ends its
    leases and reservations."""

    def __init__(self, address):
        self._lib = _load()
        self._h = self._lib.mg_connect(address.encode())
        if not self._h:
            raise MoongateError(ERR_TRANSPORT, self._lib.mg_last_error(None).decode())

    def close(self):
        if self._h:
            self._lib.mg_close(self._h)
            self._h = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _fail(self, code):
        return _error(code, self._lib.mg_last_error(self._h).decode(errors="replace"))

    def _check(self, rc):
        if rc < 0:
            raise self._fail(rc)
        return rc

    # Copies -----------------------------------------------------------------------

    def put(self, key, data):
        """Stores `data` (any bytes-like object) under `key`."""
        buf = (ctypes.c_char * len(data)).from_buffer_copy(data) if not isinstance(
            data, bytes) else data
        self._check(self._lib.mg_put(self._h, _key(key), buf, len(data)))

    def get_into(self, key, buffer):
        """Reads the value into `buffer` (writable bytes-like); its length."""
        mv = memoryview(buffer).cast("B")
        addr = ctypes.addressof((ctypes.c_char * len(mv)).from_buffer(mv)) if len(mv) else None
        n = self._lib.mg_get_into(self._h, _key(key), addr, len(mv))
        return self._check(n)

    def get(self, key):
        """The value of `key` as bytes (a view copied out when local, else a read)."""
        try:
            with self.view(key) as v:
                return bytes(v.buffer)
        except NotLocal:
            pass
        cap = 1 << 20
        while True:
            buf = bytearray(cap)
            n = self._lib.mg_get_into(self._h, _key(key),
                                      (ctypes.c_char * cap).from_buffer(buf), cap)
            if n == ERR_TOO_SMALL and cap < (1 << 34):
                cap *= 4
                continue
            self._check(n)
            return bytes(buf[:n])

    def exists(self, keys):
        ks, arr = _keys(keys)
        out = (ctypes.c_uint8 * max(len(ks), 1))()
        self._check(self._lib.mg_exists(self._h, arr, len(ks), out))
        return [bool(out[i]) for i in range(len(ks))]

    def remove(self, key):
        self._check(self._lib.mg_remove(self._h, _key(key)))

    # Zero copy --------------------------------------------------------------------

    def segments(self):
        """moongate's memory mapped here: [(address, length, writable)], to register
        once with a GPU runtime (the read-only ones are where views point)."""
        n = _SZ(0)
        bases = (_P * 8)()
        lens = (_SZ * 8)()
        self._check(self._lib.mg_segments(self._h, bases, lens, 8, ctypes.byref(n)))
        return [(bases[i], lens[i], i % 2 == 1) for i in range(n.value)]

    def view(self, key):
        data, length, lease = _P(), _SZ(), ctypes.c_uint64()
        place = self._check(self._lib.mg_view(self._h, _key(key), ctypes.byref(data),
                                              ctypes.byref(length), ctypes.byref(lease)))
        return View(self, data.value or 0, length.value, lease.value, place)

    def batch_view(self, keys):
        keys = list(keys)
        ks, arr = _keys(keys)
        n = len(ks)
        data, lens = (_P * max(n, 1))(), (_SZ * max(n, 1))()
        res, lease = (ctypes.c_int * max(n, 1))(), ctypes.c_uint64()
        self._check(self._lib.mg_batch_view(self._h, arr, n, data, lens, res,
                                            ctypes.byref(lease)))
        return Views(self, keys, [data[i] or 0 for i in range(n)],
                     [lens[i] for i in range(n)], [res[i] for i in range(n)], lease.value)

    def release(self, lease):
        """Ends a view lease; NoLease for one this client does not hold."""
        self._check(self._lib.mg_release(self._h, lease))

    def release_later(self, lease):
        """Ends a view lease without waiting for moongate's answer (mg_release_later):
        a lease it no longer held is not reported."""
        self._check(self._lib.mg_release_later(self._h, lease))

    def reserve(self, key, length):
        data, ticket = _P(), ctypes.c_uint64()
        place = self._check(self._lib.mg_reserve(self._h, _key(key), length,
                                                 ctypes.byref(data), ctypes.byref(ticket)))
        return Reservation(self, key, data.value, length, ticket.value, place)

    def batch_reserve(self, keys, lengths):
        """One reservation per key (None where refused: `codes[i]` says why)."""
        keys = list(keys)
        ks, arr = _keys(keys)
        n = len(ks)
        lens = (_SZ * max(n, 1))(*lengths)
        data = (_P * max(n, 1))()
        tickets = (ctypes.c_uint64 * max(n, 1))()
        res = (ctypes.c_int * max(n, 1))()
        self._check(self._lib.mg_batch_reserve(self._h, arr, lens, n, data, tickets, res))
        out = [Reservation(self, keys[i], data[i], lengths[i], tickets[i], res[i])
               if res[i] >= 0 else None for i in range(n)]
        return out, _Codes(res[i] for i in range(n))

    # Batches by address: `keys` a KeyArray, the rest addresses of arrays of `n` items
    # (uint64 / size_t for addresses, lengths and tickets, int32 for results), e.g. a
    # tensor's data_ptr(). Nothing is checked but the call's own return code: the caller
    # reads per-item results from its arrays.

    def _in(self, keys, start, n):
        if start < 0 or n < 0 or start + n > len(keys):
            raise IndexError(f"keys [{start}, {start + n}) of {len(keys)}")
        return keys.at(start)

    def batch_view_at(self, keys, start, n, addresses, lengths, results):
        """`batch_view` of keys[start:start + n] into arrays: per item its address,
        length and result (IN_PLACE, STAGED or a negative MG_ERR_*). Returns the lease
        (0 when nothing was viewed): end it with `release` or `release_later`."""
        lease = ctypes.c_uint64()
        self._check(self._lib.raw["mg_batch_view"](
            self._h, self._in(keys, start, n), n, addresses, lengths, results,
            ctypes.addressof(lease)))
        return lease.value

    def batch_reserve_at(self, keys, start, n, lengths, addresses, tickets, results):
        """`batch_reserve` of keys[start:start + n] with the lengths at `lengths`: per
        item where to write, its ticket and its result into arrays."""
        self._check(self._lib.raw["mg_batch_reserve"](
            self._h, self._in(keys, start, n), lengths, n, addresses, tickets, results))

    def commit_at(self, tickets, n, results):
        """Commits the `n` tickets at `tickets`: per ticket 0 or MG_ERR_* at `results`."""
        self._check(self._lib.raw["mg_batch_commit"](self._h, tickets, n, results))

    def abort_at(self, tickets, n, results):
        self._check(self._lib.raw["mg_batch_abort"](self._h, tickets, n, results))

    def _end(self, fn, tickets):
        tickets = list(tickets)
        n = len(tickets)
        arr = (ctypes.c_uint64 * max(n, 1))(*tickets)
        res = (ctypes.c_int * max(n, 1))()
        self._check(fn(self._h, arr, n, res))
        return _Codes(res[i] for i in range(n))

    def commit(self, tickets):
        """Publishes reservations: per ticket 0 or a negative MG_ERR_*."""
        return self._end(self._lib.mg_batch_commit, tickets)

    def abort(self, tickets):
        return self._end(self._lib.mg_batch_abort, tickets)

#!/usr/bin/env python3
"""The Python package (clients/python, moongate_kv) against a live moongate, on CPU
buffers: bytes in and out, views, reservations (single and batch), their errors, and
the lease and ticket rules. Run by tests/all/kv_zero_copy.rs with the package installed
into a fresh target directory; prints "all ok" when every check held.

    kv_python.py --address unix:PATH --prefix P
"""
import argparse
import sys
import threading

import moongate_kv as mk


def value(i, n):
    return bytes((i * 31 + j * 7) & 0xFF for j in range(n))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--prefix", default="py")
    a = p.parse_args()
    pre = a.prefix
    c = mk.Client(a.address)

    # Bytes, copied.
    c.put(f"{pre}/bytes", b"hello moongate")
    assert c.get(f"{pre}/bytes") == b"hello moongate"
    buf = bytearray(64)
    assert c.get_into(f"{pre}/bytes", buf) == 14 and bytes(buf[:14]) == b"hello moongate"
    assert c.exists([f"{pre}/bytes", f"{pre}/nope"]) == [True, False]
    try:
        c.put(f"{pre}/bytes", b"again")
        raise AssertionError("a second put went through")
    except mk.Exists:
        pass
    try:
        c.get(f"{pre}/nope")
        raise AssertionError("a missing key was read")
    except mk.NotFound:
        pass
    print("bytes: ok")

    # The mappings: read-only then writable per memory.
    maps = c.segments()
    assert len(maps) >= 2 and [w for _, _, w in maps[:2]] == [False, True], maps
    print(f"mappings: {len(maps)}")

    # A reservation: written in place, invisible until committed.
    r = c.reserve(f"{pre}/r", 1 << 20)
    assert not r.staged
    r.buffer[:] = value(1, 1 << 20)
    assert c.exists([f"{pre}/r"]) == [False]
    r.commit()
    with c.view(f"{pre}/r") as v:
        assert not v.staged and v.length == 1 << 20
        assert bytes(v.buffer) == value(1, 1 << 20)
        try:
            v.buffer[0] = 1
            raise AssertionError("a view is writable")
        except TypeError:
            pass
        lease = v.lease
    try:
        c.release(lease)
        raise AssertionError("a lease released twice")
    except mk.NoLease:
        pass
    try:
        c.commit([r.ticket]).raise_first()
        raise AssertionError("a ticket committed twice")
    except mk.NoLease:
        pass
    r2 = c.reserve(f"{pre}/aborted", 4096)
    r2.abort()
    assert c.exists([f"{pre}/aborted"]) == [False]
    try:
        c.reserve(f"{pre}/r", 10)
        raise AssertionError("an existing key reserved")
    except mk.Exists:
        pass
    print("reservations: ok")

    # The array calls: keys encoded once, a slice of them viewed into caller arrays,
    # released ahead of the answer; a slice past the keys is refused before any call.
    import ctypes
    ka = mk.KeyArray([f"{pre}/nope", f"{pre}/r", f"{pre}/aborted"])
    addrs, lens = (ctypes.c_uint64 * 2)(), (ctypes.c_uint64 * 2)()
    res = (ctypes.c_int32 * 2)()
    lease = c.batch_view_at(ka, 1, 2, ctypes.addressof(addrs), ctypes.addressof(lens),
                            ctypes.addressof(res))
    assert list(res) == [0, mk.ERR_NOT_FOUND] and lens[0] == 1 << 20, (list(res), lens[0])
    assert ctypes.string_at(addrs[0], lens[0]) == value(1, 1 << 20)
    c.release_later(lease)
    c.release_later(lease)  # moongate no longer holds it: not reported
    try:
        c.batch_view_at(ka, 2, 2, ctypes.addressof(addrs), ctypes.addressof(lens),
                        ctypes.addressof(res))
        raise AssertionError("a slice past the keys was viewed")
    except IndexError:
        pass
    assert c.exists([f"{pre}/r"]) == [True]  # the connection carries on
    print("arrays: ok")

    # Batches, from several threads of one client.
    errors = []

    def worker(t):
        try:
            keys = [f"{pre}/t{t}/{i}" for i in range(8)]
            sizes = [4096 * (i + 1) for i in range(8)]
            rs, codes = c.batch_reserve(keys, sizes)
            assert list(codes) == [0] * 8, codes
            for i, rr in enumerate(rs):
                rr.buffer[:] = value(t * 10 + i, sizes[i])
            assert list(c.commit([rr.ticket for rr in rs])) == [0] * 8
            with c.batch_view(keys + [f"{pre}/missing"]) as vs:
                assert vs.results[:8] == [0] * 8 and vs.results[8] == mk.ERR_NOT_FOUND
                for i in range(8):
                    assert bytes(vs.buffers[i]) == value(t * 10 + i, sizes[i])
                try:
                    vs.check()
                    raise AssertionError("check passed a missing key")
                except mk.NotFound:
                    pass
        except Exception as e:  # reported by the main thread
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    print("batches from threads: ok")

    # The copying path reads what reservations wrote.
    assert c.get(f"{pre}/t0/0") == value(0, 4096)
    c.close()
    print("all ok")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"FAIL: {e}", file=sys.stderr)
        raise

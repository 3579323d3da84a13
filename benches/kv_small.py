#!/usr/bin/env python3
"""The local path at the value sizes engines store (64 KiB - 4 MiB), through the Python
package over moongate's Unix socket, against a plain copy of the same bytes in the same
process:

- view + copy: `batch_view` of 64 keys, the engine's own `memmove` of each view into one
  buffer, `release`;
- the same through the array calls (`KeyArray`, `batch_view_at` writing addresses into
  arrays, `release_later`): what moongate_kv.torch and moongate_kv.paged do, and the
  cost an engine in C sees (no Python object per value);
- reserve + copy + commit: `batch_reserve` of 64 keys, a `memmove` into each
  reservation, `batch_commit` (new keys each round, removed after it, untimed);
- plain copy: one `memmove` per value between two buffers of this process whose pages
  were all written first; the same from a source never written is reported apart
  (`plain_from_untouched`: such pages may all map the kernel's zero page, so a baseline
  of that kind can read faster than memory; on this VM it did not).

    bash benches/run_kv_small.sh [--row-mib 256] [--batch 64] [--sizes 64,256,1024,4096]

One thread copies (as the issue's engine did); each figure is the median of --reps rows.
Prints one JSON document and a table.
"""
import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))
from benchlib import free_port, master_cmd, run, start_kv_moongate, stop_all, work_dir  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20


def touched(n):
    """A buffer of n bytes, every page written."""
    buf = (ctypes.c_char * n)()
    ctypes.memset(buf, 0x5A, n)
    return buf


def measure(c, size, a):
    import moongate_kv
    n_values = max(a.batch, a.row_mib * MiB // size)
    n_values -= n_values % a.batch
    row = n_values * size
    keys = [f"small/{size}/{i}" for i in range(n_values)]
    src = touched(size)
    for i in range(0, n_values, a.batch):
        for k in keys[i:i + a.batch]:
            c.put(k, bytes(src))
    dst = touched(row)
    dst_addr = ctypes.addressof(dst)
    mm = ctypes.memmove

    def view_row():
        t = time.perf_counter()
        for i in range(0, n_values, a.batch):
            vs = c.batch_view(keys[i:i + a.batch])
            off = dst_addr + i * size
            for j, (addr, n) in enumerate(zip(vs.addresses, vs.lengths)):
                mm(off + j * size, addr, n)
            vs.release()
        return time.perf_counter() - t

    # The same through the array calls (what moongate_kv.torch and paged use): keys
    # encoded once, addresses written by the C library into arrays, released ahead.
    ka = moongate_kv.KeyArray(keys)
    addrs = (ctypes.c_uint64 * a.batch)()
    lens = (ctypes.c_uint64 * a.batch)()
    res = (ctypes.c_int32 * a.batch)()
    pa, pl, pr = ctypes.addressof(addrs), ctypes.addressof(lens), ctypes.addressof(res)

    def view_row_arrays():
        t = time.perf_counter()
        for i in range(0, n_values, a.batch):
            lease = c.batch_view_at(ka, i, a.batch, pa, pl, pr)
            off = dst_addr + i * size
            for j in range(a.batch):
                mm(off + j * size, addrs[j], lens[j])
            c.release_later(lease)
        return time.perf_counter() - t

    def plain_row(source):
        s = ctypes.addressof(source)
        t = time.perf_counter()
        for i in range(n_values):
            mm(dst_addr + i * size, s + (i * size) % len(source), size)
        return time.perf_counter() - t

    big = touched(min(row, 64 * MiB))
    untouched = (ctypes.c_char * min(row, 64 * MiB))()

    def reserve_row(r):
        ks = [f"small/{size}/w{r}/{i}" for i in range(n_values)]
        s = ctypes.addressof(big)
        t = time.perf_counter()
        for i in range(0, n_values, a.batch):
            rs, codes = c.batch_reserve(ks[i:i + a.batch], [size] * a.batch)
            codes.raise_first()
            for j, res in enumerate(rs):
                mm(res.address, s + ((i + j) * size) % len(big), size)
            c.commit([res.ticket for res in rs]).raise_first()
        took = time.perf_counter() - t
        for k in ks:
            for _ in range(100):
                try:
                    c.remove(k)
                    break
                except moongate_kv.MoongateError:
                    time.sleep(0.02)
        return took

    view_row()  # warm: the mapping's pages, the replica cache
    views, arrays, plains, untouched_s, reserves = [], [], [], [], []
    for r in range(a.reps):
        views.append(view_row())
        arrays.append(view_row_arrays())
        plains.append(plain_row(big))
        untouched_s.append(plain_row(untouched))
        reserves.append(reserve_row(r))
    gb = lambda secs: row / statistics.median(secs) / 1e9  # noqa: E731
    v, p = gb(views), gb(plains)
    per_value_us = (statistics.median(views) - statistics.median(plains)) / n_values * 1e6
    return {"size": size, "values": n_values, "row_bytes": row,
            "view_copy_GBps": v, "plain_copy_GBps": p, "ratio": v / p,
            "view_us_per_value_beyond_copy": per_value_us,
            "view_arrays_copy_GBps": gb(arrays), "arrays_ratio": gb(arrays) / p,
            "view_arrays_us_per_value_beyond_copy":
                (statistics.median(arrays) - statistics.median(plains)) / n_values * 1e6,
            "view_copy_us_per_value": statistics.median(views) / n_values * 1e6,
            "plain_copy_us_per_value": statistics.median(plains) / n_values * 1e6,
            "plain_from_untouched_GBps": gb(untouched_s),
            "reserve_copy_commit_GBps": gb(reserves), "reserve_ratio": gb(reserves) / p}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="64,256,1024,4096", help="KiB")
    p.add_argument("--row-mib", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--moongate", default=os.path.join(ROOT, "target/release/moongate"))
    p.add_argument("--lib", default=os.path.join(ROOT, "target/release/libmoongate_kv.so"))
    a = p.parse_args()
    os.environ["MOONGATE_KV_LIB"] = a.lib
    import moongate_kv
    work = work_dir("kv-small-")
    procs = []
    out = {"host": {"cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d")},
           "batch": a.batch, "row_mib": a.row_mib, "rows": []}
    try:
        rpc, http = free_port(), free_port()
        procs.append(subprocess.Popen(master_cmd(rpc, http), stdout=subprocess.DEVNULL,
                                      stderr=open(f"{work}/master.log", "w")))
        segment = (len(a.sizes.split(",")) + 1) * a.row_mib * MiB + 256 * MiB
        _, _, sock = start_kv_moongate(a.moongate, work, rpc,
                                       f"http://127.0.0.1:{http}/metadata", segment, procs)
        c = moongate_kv.Client(f"unix:{sock}")
        for kib in map(int, a.sizes.split(",")):
            r = measure(c, kib * KiB, a)
            out["rows"].append(r)
            print(f"{kib} KiB: view+copy {r['view_copy_GBps']:.2f} GB/s, plain "
                  f"{r['plain_copy_GBps']:.2f} ({r['ratio']:.2f}x)", file=sys.stderr, flush=True)
        c.close()
    finally:
        stop_all(procs)
    print(json.dumps(out, indent=1))
    h = out["host"]
    print(f"\nhost: {h['cores']} cores, {h['date']}; batches of {a.batch}, {a.row_mib} MiB a row, "
          "one copying thread", file=sys.stderr)
    print("value | view+copy GB/s | plain copy GB/s | ratio | us/value beyond copy | "
          "arrays: ratio | us/value beyond copy | "
          "reserve+copy+commit GB/s | ratio | plain from untouched GB/s", file=sys.stderr)
    for r in out["rows"]:
        print(f"{r['size'] // KiB:5d} KiB | {r['view_copy_GBps']:6.2f} | {r['plain_copy_GBps']:6.2f} | "
              f"{r['ratio']:.2f}x | {r['view_us_per_value_beyond_copy']:6.1f} | "
              f"{r['arrays_ratio']:.2f}x | {r['view_arrays_us_per_value_beyond_copy']:6.1f} | "
              f"{r['reserve_copy_commit_GBps']:6.2f} | {r['reserve_ratio']:.2f}x | "
              f"{r['plain_from_untouched_GBps']:6.2f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run(main)

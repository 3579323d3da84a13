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
    n_values = row_shape(size, a)
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


def row_shape(size, a):
    n_values = max(a.batch, a.row_mib * MiB // size)
    return n_values - n_values % a.batch


def role_mooncake(a):
    """Mooncake's own client on the same rows: a dummy client of a standalone owner
    (shared memory with it) or an embedded client with no segment (TE-TCP), reading each
    row with `batch_get_into` in batches into one registered buffer (its view + copy)
    and writing it with `batch_put_from` (new keys each round, removed after it)."""
    from mooncake.store import MooncakeDistributedStore
    s = MooncakeDistributedStore()
    region = a.row_mib * MiB
    if a.kind == "dummy":
        assert s.setup_dummy(region + 64 * MiB, 64 * MiB, a.owner) == 0, "setup_dummy"
        base = s.alloc_from_mem_pool(region)
        assert base, "alloc_from_mem_pool"
    else:
        assert s.setup("127.0.0.1", a.metadata, 0, 64 * MiB, "tcp", "", a.master) == 0, "setup"
        buf = touched(region)
        base = ctypes.addressof(buf)
    ctypes.memset(base, 0x5A, region)
    assert s.register_buffer(base, region) == 0
    out = {}
    for kib in map(int, a.sizes.split(",")):
        size = kib * KiB
        n = row_shape(size, a)
        batches = [(i, [f"mc/{a.kind}/{size}/{j}" for j in range(i, i + a.batch)],
                    [base + j * size for j in range(i, i + a.batch)]) for i in range(0, n, a.batch)]
        sizes = [size] * a.batch
        for _, ks, addrs in batches:
            assert list(s.batch_put_from(ks, addrs, sizes)) == [0] * a.batch

        def read_row():
            t = time.perf_counter()
            for _, ks, addrs in batches:
                got = s.batch_get_into(ks, addrs, sizes)
                if list(got) != sizes:
                    raise SystemExit(f"batch_get_into: {list(got)[:4]}")
            return time.perf_counter() - t

        def write_row(r):
            names = [[f"mc/{a.kind}/w{r}/{size}/{j}" for j in range(i, i + a.batch)]
                     for i, _, _ in batches]
            t = time.perf_counter()
            for ks, (_, _, addrs) in zip(names, batches):
                assert list(s.batch_put_from(ks, addrs, sizes)) == [0] * a.batch
            took = time.perf_counter() - t
            for ks in names:
                for k in ks:
                    s.remove(k)
            return took

        read_row()
        reads, writes = [], []
        for r in range(a.reps):
            reads.append(read_row())
            writes.append(write_row(r))
        for _, ks, _ in batches:
            for k in ks:
                s.remove(k)
        row = n * size
        out[str(size)] = {"read_GBps": row / statistics.median(reads) / 1e9,
                          "write_GBps": row / statistics.median(writes) / 1e9}
    s.close()
    print(json.dumps(out), flush=True)


def mooncake_arms(a, work, procs):
    """Mooncake's clients, moongate stopped: a master of their own (moongate's segment
    and keys gone with the first one), a standalone owner and, one after the other, a
    dummy and an embedded client (`role_mooncake`). The owner's segment holds a row and
    every round's written row (a key just put may not be removable at once: the master
    would evict the row being read)."""
    rpc, http = free_port(), free_port()
    procs.append(subprocess.Popen(master_cmd(rpc, http), stdout=subprocess.DEVNULL,
                                  stderr=open(f"{work}/master2.log", "w")))
    import mooncake
    owner_bin = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_client")
    oport = free_port()
    procs.append(subprocess.Popen(
        [owner_bin, "--host=127.0.0.1", f"--port={oport}",
         f"--master_server_address=127.0.0.1:{rpc}",
         f"--metadata_server=http://127.0.0.1:{http}/metadata",
         f"--global_segment_size={(a.reps + 3) * a.row_mib + 256} MB", "--protocol=tcp",
         "--logtostderr"],
        stdout=subprocess.DEVNULL, stderr=open(f"{work}/owner.log", "w")))
    got = {}
    for kind in ["dummy", "embedded"]:
        deadline = time.time() + 60
        while True:
            r = subprocess.run(
                [sys.executable, __file__, "--role", "mooncake", "--kind", kind,
                 "--master", f"127.0.0.1:{rpc}", "--metadata", f"http://127.0.0.1:{http}/metadata",
                 "--owner", f"127.0.0.1:{oport}", "--sizes", a.sizes, "--row-mib", str(a.row_mib),
                 "--batch", str(a.batch), "--reps", str(a.reps)],
                capture_output=True, text=True, timeout=1800)
            if r.returncode == 0 or time.time() > deadline:
                break
            time.sleep(1)  # the owner may still be starting
        if r.returncode != 0:
            raise SystemExit(f"mooncake {kind}: {r.stderr[-3000:]}")
        got[kind] = json.loads(r.stdout.strip().splitlines()[-1])
    return got


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--role", default="driver")
    p.add_argument("--kind", default="embedded")
    p.add_argument("--master")
    p.add_argument("--metadata")
    p.add_argument("--owner")
    p.add_argument("--no-mooncake", action="store_true",
                   help="moongate and the plain copy only")
    p.add_argument("--sizes", default="64,256,1024,4096", help="KiB")
    p.add_argument("--row-mib", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--moongate", default=os.path.join(ROOT, "target/release/moongate"))
    p.add_argument("--lib", default=os.path.join(ROOT, "target/release/libmoongate_kv.so"))
    a = p.parse_args()
    if a.role == "mooncake":
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        role_mooncake(a)
        return 0
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
        if not a.no_mooncake:
            stop_all(procs)
            procs.clear()
            mc = mooncake_arms(a, work, procs)
            for r in out["rows"]:
                for kind, rows in mc.items():
                    m = rows[str(r["size"])]
                    r[f"mooncake_{kind}_read_GBps"] = m["read_GBps"]
                    r[f"mooncake_{kind}_write_GBps"] = m["write_GBps"]
                    r[f"view_vs_{kind}"] = r["view_copy_GBps"] / m["read_GBps"]
                    r[f"reserve_vs_{kind}"] = r["reserve_copy_commit_GBps"] / m["write_GBps"]
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
    if not a.no_mooncake:
        print("value | Mooncake dummy read / write GB/s | embedded read / write GB/s | "
              "moongate view+copy vs dummy, embedded | reserve vs dummy, embedded", file=sys.stderr)
        for r in out["rows"]:
            print(f"{r['size'] // KiB:5d} KiB | {r['mooncake_dummy_read_GBps']:6.2f} / "
                  f"{r['mooncake_dummy_write_GBps']:5.2f} | {r['mooncake_embedded_read_GBps']:6.2f} / "
                  f"{r['mooncake_embedded_write_GBps']:5.2f} | {r['view_vs_dummy']:.2f}x, "
                  f"{r['view_vs_embedded']:.2f}x | {r['reserve_vs_dummy']:.2f}x, "
                  f"{r['reserve_vs_embedded']:.2f}x", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run(main)

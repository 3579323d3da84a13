#!/usr/bin/env python3
"""Local engines at memory speed: moongate's shared-memory path (libmoongate_kv, mg_alloc
memory) against Mooncake's own clients on the same host, in one run.

moongate (phase 1): mooncake_master and moongate with the kv face, a Unix socket and a
256 MiB own segment (the pool's only segment, so every value is in it); a ctypes
driver of libmoongate_kv.so:
  shm    mg_get_into / mg_batch_get_into into mg_alloc memory (registered once);
  copy   the same calls into malloc'd memory (HTTP over the Unix socket, then a copy).
Mooncake (phase 2, moongate stopped): a standalone owner (`mooncake_client`, 256 MB
segment: the pool's only one) and, one after the other:
  dummy     a dummy client of the owner (setup_dummy: shared memory with the owner);
  embedded  an embedded client with no segment reading over TE-TCP into a registered
            buffer (get_into / batch_get_into).
Registrations (phase 1): a fresh 64 MiB mg_alloc region's first read (the library
connects, passes the memfd, moongate maps it) against reads into a registered region;
and how long moongate takes to release 256 MiB registered by a process that is killed
(its metrics page polled until the bytes are gone).
Values: 16 MiB, 64 x 64 KiB (one batch call), 4 KiB; and a batch put of 64 x 64 KiB
from the shared or registered buffer (new keys each call, removed after it, untimed). Per call kind: best and median
GB/s over --reps calls (4 KiB: p50 latency). Not part of CI (timing); run with
`bash benches/run_kv_shm.sh`.
"""
import argparse
import ctypes
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import free_port, master_cmd, pct, run, stop_all, wait_http, work_dir  # noqa: E402

MiB = 1 << 20
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
BIG, SMALL = 16 * MiB, 4096
BATCH_N, BATCH_SIZE = 64, 64 * 1024


def value(seed, size):
    """The same bytes in every process (the readers check what the writers put)."""
    block = hashlib.sha256(str(seed).encode()).digest()
    return (block * (size // len(block) + 1))[:size]


def timed(fn, reps, size):
    """(best GB/s, median GB/s, p50 us) of `reps` calls of `fn` (timed around the call,
    or the seconds it returns when it times its own part)."""
    for _ in range(3):
        fn()
    secs = []
    for _ in range(reps):
        t = time.perf_counter()
        took = fn()
        secs.append(took if took is not None else time.perf_counter() - t)
    return {"best_GBps": size / min(secs) / 1e9,
            "median_GBps": size / statistics.median(secs) / 1e9,
            "p50_us": pct([s * 1e6 for s in secs], 0.5)}


def load(lib_path):
    """libmoongate_kv with the signatures this bench calls."""
    lib = ctypes.CDLL(lib_path)
    lib.mg_connect.restype = ctypes.c_void_p
    lib.mg_connect.argtypes = [ctypes.c_char_p]
    lib.mg_last_error.restype = ctypes.c_char_p
    lib.mg_last_error.argtypes = [ctypes.c_void_p]
    lib.mg_alloc.restype = ctypes.c_void_p
    lib.mg_alloc.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.mg_put.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
    lib.mg_get_into.restype = ctypes.c_int64
    lib.mg_get_into.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p,
                                ctypes.c_size_t]
    lib.mg_batch_get_into.argtypes = [
        ctypes.c_void_p, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_void_p),
        ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t, ctypes.POINTER(ctypes.c_int64)]
    lib.mg_free.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.mg_remove.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.mg_batch_put.argtypes = [
        ctypes.c_void_p, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_void_p),
        ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t, ctypes.POINTER(ctypes.c_int)]
    lib.mg_view.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p),
                            ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_uint64)]
    lib.mg_release.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
    return lib


def connect(lib, sock):
    h = None
    deadline = time.time() + 30
    while h is None and time.time() < deadline:
        h = lib.mg_connect(f"unix:{sock}".encode())
        if not h:
            time.sleep(0.2)
    if not h:
        raise SystemExit(f"mg_connect: {lib.mg_last_error(None)}")
    return h


def registered_bytes(admin):
    """moongate_kv_shm_registered_bytes from moongate's metrics page."""
    import urllib.request
    with urllib.request.urlopen(f"http://{admin}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("moongate_kv_shm_registered_bytes "):
                return int(float(line.split()[1]))
    raise SystemExit("no moongate_kv_shm_registered_bytes on the metrics page")


def role_holder(a):
    """Registers a region of --region bytes (mg_alloc, then one read into it), says
    HELD, and waits to be killed."""
    lib = load(a.lib)
    h = connect(lib, a.sock)
    p = lib.mg_alloc(h, a.region)
    assert p, lib.mg_last_error(h)
    assert lib.mg_get_into(h, b"kv/4k", p, SMALL) == SMALL, lib.mg_last_error(h)
    print("HELD", flush=True)
    sys.stdin.read()


def registration(a, lib, h, sock, admin, out):
    """The cost of a registration (a fresh mg_alloc region's first read: connect,
    memfd passed and mapped) against a read into a region already registered; and how
    long moongate takes to release the registration of a process that is killed."""
    steady, first, alloc = [], [], []
    for _ in range(a.reps * 2):
        t = time.perf_counter()
        p = lib.mg_alloc(h, 64 * MiB)
        alloc.append((time.perf_counter() - t) * 1e6)
        assert p, lib.mg_last_error(h)
        t = time.perf_counter()
        assert lib.mg_get_into(h, b"kv/4k", p, SMALL) == SMALL, lib.mg_last_error(h)
        first.append((time.perf_counter() - t) * 1e6)
        for _ in range(5):
            t = time.perf_counter()
            assert lib.mg_get_into(h, b"kv/4k", p, SMALL) == SMALL
            steady.append((time.perf_counter() - t) * 1e6)
        assert lib.mg_free(h, p) == 0, lib.mg_last_error(h)
    released = []
    for _ in range(5):
        before = registered_bytes(admin)
        holder = subprocess.Popen(
            [sys.executable, __file__, "--role", "holder", "--sock", sock, "--lib", a.lib,
             "--region", str(256 * MiB)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True)
        assert holder.stdout.readline().startswith("HELD"), "holder did not register"
        assert registered_bytes(admin) >= before + 256 * MiB
        t = time.perf_counter()
        holder.kill()
        holder.wait()
        while registered_bytes(admin) > before:
            if time.perf_counter() - t > 30:
                raise SystemExit("a dead holder's registration was not released in 30 s")
            time.sleep(0.0005)
        released.append((time.perf_counter() - t) * 1e3)
    out["registration"] = {
        "mg_alloc_64MiB_p50_us": pct(alloc, 0.5),
        "first_read_p50_us": pct(first, 0.5),
        "registered_read_p50_us": pct(steady, 0.5),
        "dead_holder_256MiB_released_p50_ms": pct(released, 0.5),
        "dead_holder_256MiB_released_max_ms": max(released),
    }


def phase_moongate(a, lib_path, sock, admin, out):
    lib = load(lib_path)
    h = connect(lib, sock)
    region = BIG + BATCH_N * BATCH_SIZE
    shm = lib.mg_alloc(h, region)
    heap = ctypes.create_string_buffer(region)
    heap_addr = ctypes.addressof(heap)
    # The values, put from the shared buffer (the own segment is the pool's only one).
    vals = {"kv/16m": value(1, BIG), "kv/4k": value(2, SMALL)}
    vals.update({f"kv/b/{i}": value(3 + i, BATCH_SIZE) for i in range(BATCH_N)})
    for k, v in vals.items():
        ctypes.memmove(shm, v, len(v))
        for _ in range(100):
            rc = lib.mg_put(h, k.encode(), shm, len(v))
            if rc == 0:
                break
            time.sleep(0.1)  # the own segment may still be mounting
        else:
            raise SystemExit(f"put {k}: {rc} {lib.mg_last_error(h)}")
    keys = (ctypes.c_char_p * BATCH_N)(*[f"kv/b/{i}".encode() for i in range(BATCH_N)])
    sizes = (ctypes.c_size_t * BATCH_N)(*[BATCH_SIZE] * BATCH_N)
    res = (ctypes.c_int64 * BATCH_N)()

    def get(buf, key, size):
        def f():
            n = lib.mg_get_into(h, key, buf, size)
            assert n == size, (n, lib.mg_last_error(h))
        return f

    def batch(base):
        dst = (ctypes.c_void_p * BATCH_N)(*[base + BIG + i * BATCH_SIZE for i in range(BATCH_N)])

        def f():
            assert lib.mg_batch_get_into(h, keys, dst, sizes, BATCH_N, res) == 0
            assert list(res) == [BATCH_SIZE] * BATCH_N, list(res)
        return f

    def batch_put(base, name):
        src = (ctypes.c_void_p * BATCH_N)(*[base + BIG + i * BATCH_SIZE for i in range(BATCH_N)])
        codes = (ctypes.c_int * BATCH_N)()
        round_ = [0]

        def f():
            # New keys each call (a stored key is not written again), removed untimed.
            names = [f"kv/bp/{name}/{round_[0]}/{i}".encode() for i in range(BATCH_N)]
            round_[0] += 1
            t = time.perf_counter()
            assert lib.mg_batch_put(h, (ctypes.c_char_p * BATCH_N)(*names), src, sizes,
                                    BATCH_N, codes) == 0, lib.mg_last_error(h)
            took = time.perf_counter() - t
            assert list(codes) == [0] * BATCH_N, list(codes)
            for k in names:
                assert lib.mg_remove(h, k) == 0, lib.mg_last_error(h)
            return took
        return f

    # A view of the 16 MiB value and the engine's own copy out of it, against a plain
    # memcpy of the same bytes between two buffers of this process.
    data, length, lease = ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_uint64()
    dst = ctypes.create_string_buffer(BIG)
    src = ctypes.create_string_buffer(vals["kv/16m"], BIG)

    def view_copy():
        rc = lib.mg_view(h, b"kv/16m", ctypes.byref(data), ctypes.byref(length),
                         ctypes.byref(lease))
        assert rc == 0, (rc, lib.mg_last_error(h))
        ctypes.memmove(dst, data.value, length.value)
        assert lib.mg_release(h, lease.value) == 0

    out["view_16m_plus_copy"] = timed(view_copy, a.reps * 3, BIG)
    out["memcpy_16m"] = timed(lambda: ctypes.memmove(dst, src, BIG) and None, a.reps * 3, BIG)
    assert dst.raw == vals["kv/16m"]
    for name, base in [("shm", shm), ("copy", heap_addr)]:
        out[f"moongate_{name}"] = {
            "16m": timed(get(base, b"kv/16m", BIG), a.reps, BIG),
            "batch64x64k": timed(batch(base), a.reps, BATCH_N * BATCH_SIZE),
            "4k": timed(get(base, b"kv/4k", SMALL), a.reps * 20, SMALL),
            "batch_put64x64k": timed(batch_put(base, name), a.reps, BATCH_N * BATCH_SIZE),
        }
    # Bytes check: what the shared buffer got is what was put.
    assert lib.mg_get_into(h, b"kv/16m", shm, BIG) == BIG
    assert ctypes.string_at(shm, BIG) == vals["kv/16m"]
    registration(a, lib, h, sock, admin, out)


def role_mooncake(a):
    """Puts through a dummy client of the owner, then measures the dummy (shared memory
    with the owner) or an embedded client (`--kind`)."""
    from mooncake.store import MooncakeDistributedStore
    s = MooncakeDistributedStore()
    region = BIG + BATCH_N * BATCH_SIZE
    if a.kind == "dummy":
        rc = s.setup_dummy(region + 16 * MiB, 64 * MiB, a.owner)
        assert rc == 0, f"setup_dummy {rc}"
        base = s.alloc_from_mem_pool(region)
        assert base, "alloc_from_mem_pool"
        # Shares it with the owner (a UDS registration of its memfd).
        assert s.register_buffer(base, region) == 0
    else:
        rc = s.setup("127.0.0.1", a.metadata, 0, 64 * MiB, "tcp", "", a.master)
        assert rc == 0, f"setup {rc}"
        buf = (ctypes.c_char * region)()
        base = ctypes.addressof(buf)
        assert s.register_buffer(base, region) == 0
    vals = {"kv/16m": value(1, BIG), "kv/4k": value(2, SMALL)}
    vals.update({f"kv/b/{i}": value(3 + i, BATCH_SIZE) for i in range(BATCH_N)})
    for k, v in vals.items():
        if not s.is_exist(k):
            assert s.put(k, v) == 0, k
    keys = [f"kv/b/{i}" for i in range(BATCH_N)]
    addrs = [base + BIG + i * BATCH_SIZE for i in range(BATCH_N)]
    sizes = [BATCH_SIZE] * BATCH_N

    def get(key, size):
        def f():
            assert s.get_into(key, base, size) == size
        return f

    def batch():
        assert list(s.batch_get_into(keys, addrs, sizes)) == sizes

    round_ = [0]

    def batch_put():
        names = [f"kv/bp/{a.kind}/{round_[0]}/{i}" for i in range(BATCH_N)]
        round_[0] += 1
        t = time.perf_counter()
        assert list(s.batch_put_from(names, addrs, sizes)) == [0] * BATCH_N
        took = time.perf_counter() - t
        for k in names:
            assert s.remove(k) == 0, k
        return took

    out = {
        "16m": timed(get("kv/16m", BIG), a.reps, BIG),
        "batch64x64k": timed(batch, a.reps, BATCH_N * BATCH_SIZE),
        "4k": timed(get("kv/4k", SMALL), a.reps * 20, SMALL),
        "batch_put64x64k": timed(batch_put, a.reps, BATCH_N * BATCH_SIZE),
    }
    assert s.get_into("kv/16m", base, BIG) == BIG
    assert ctypes.string_at(base, BIG) == vals["kv/16m"]
    s.close()
    print(json.dumps(out), flush=True)


def driver(a):
    work = work_dir("moongate-kvshm-")
    procs = []
    out = {"host": {"cores": os.cpu_count()}}
    try:
        mport, hport = free_port(), free_port()
        master = f"127.0.0.1:{mport}"
        metadata = f"http://127.0.0.1:{hport}/metadata"
        procs.append(subprocess.Popen(master_cmd(mport, hport), stdout=subprocess.DEVNULL,
                                      stderr=open(f"{work}/master.log", "w")))
        sock = f"{work}/kv.sock"
        kv, seg, admin, listen = free_port(), free_port(), free_port(), free_port()
        with open(f"{work}/mg.toml", "w") as f:
            f.write(f'[master_face]\nupstream = "{master}"\n'
                    f'[kv]\nlisten = "127.0.0.1:{kv}"\nunix_path = "{sock}"\n'
                    f'metadata_url = "{metadata}"\nsegment_bytes = {256 * MiB}\n'
                    f'segment_listen = "127.0.0.1:{seg}"\n')
        mg = subprocess.Popen(
            [a.moongate, "run", "--config", f"{work}/mg.toml", "--listen",
             f"127.0.0.1:{listen}", "--admin", f"127.0.0.1:{admin}"],
            stdout=subprocess.DEVNULL, stderr=open(f"{work}/moongate.log", "w"),
            env={**os.environ, "RUST_LOG": "warn"})
        procs.append(mg)
        wait_http(f"http://127.0.0.1:{admin}/ready")
        phase_moongate(a, a.lib, sock, f"127.0.0.1:{admin}", out)
        mg.send_signal(signal.SIGTERM)
        mg.wait(timeout=30)
        procs.remove(mg)
        oport = free_port()
        import mooncake
        owner_bin = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_client")
        procs.append(subprocess.Popen(
            [owner_bin, "--host=127.0.0.1", f"--port={oport}",
             f"--master_server_address={master}", f"--metadata_server={metadata}",
             "--global_segment_size=256 MB", "--protocol=tcp", "--logtostderr"],
            stdout=subprocess.DEVNULL, stderr=open(f"{work}/owner.log", "w")))
        for kind in ["dummy", "embedded"]:
            deadline = time.time() + 60
            while True:
                r = subprocess.run(
                    [sys.executable, __file__, "--role", "mooncake", "--kind", kind,
                     "--master", master, "--metadata", metadata,
                     "--owner", f"127.0.0.1:{oport}", "--reps", str(a.reps)],
                    capture_output=True, text=True, timeout=600)
                if r.returncode == 0 or time.time() > deadline:
                    break
                time.sleep(1)  # the owner may still be starting
            if r.returncode != 0:
                raise SystemExit(f"{kind}: {r.stderr[-3000:]}")
            out[f"mooncake_{kind}"] = json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        stop_all(procs)
    emb = out["mooncake_embedded"]
    shm = out["moongate_shm"]
    out["ratios"] = {
        "view_16m_plus_copy_median_vs_memcpy_median":
            out["view_16m_plus_copy"]["median_GBps"] / out["memcpy_16m"]["median_GBps"],
        "shm_16m_best_vs_embedded_best": shm["16m"]["best_GBps"] / emb["16m"]["best_GBps"],
        "shm_16m_best_vs_dummy_best":
            shm["16m"]["best_GBps"] / out["mooncake_dummy"]["16m"]["best_GBps"],
        "shm_batch_median_vs_embedded_median":
            shm["batch64x64k"]["median_GBps"] / emb["batch64x64k"]["median_GBps"],
        "shm_4k_p50_vs_copy_p50": shm["4k"]["p50_us"] / out["moongate_copy"]["4k"]["p50_us"],
        "shm_batch_put_median_vs_embedded_median":
            shm["batch_put64x64k"]["median_GBps"] / emb["batch_put64x64k"]["median_GBps"],
        "shm_batch_put_median_vs_copy_median":
            shm["batch_put64x64k"]["median_GBps"]
            / out["moongate_copy"]["batch_put64x64k"]["median_GBps"],
    }
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--role", default="driver")
    p.add_argument("--kind", default="embedded")
    p.add_argument("--master")
    p.add_argument("--metadata")
    p.add_argument("--owner")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--moongate", default="target/release/moongate")
    p.add_argument("--lib", default="target/release/libmoongate_kv.so")
    p.add_argument("--json")
    p.add_argument("--sock", help="holder role: moongate's kv Unix socket")
    p.add_argument("--region", type=int, default=0, help="holder role: bytes to register")
    a = p.parse_args()
    if a.role == "mooncake":
        role_mooncake(a)
    elif a.role == "holder":
        role_holder(a)
    else:
        driver(a)


if __name__ == "__main__":
    run(main)

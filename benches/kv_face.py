#!/usr/bin/env python3
"""The kv face against Mooncake's own client, in one run: remote get of 4 KiB (p50) and
16 MiB (GB/s) from the same owner segment.

Setup: mooncake_master; an owner process (real client) with a 256 MiB segment that puts
kv/4k, kv/16m and 64 values of 64 KiB (kv/b/0..63, read as one batch); moongate with the kv face; then alternately, --rounds times:
  mooncake  a reader process with an empty segment doing get_into of the same keys
            (the transfer engine's TCP path, as in ../shared/bench/mc_bench.py)
  moongate  examples/kv_bench: keep-alive HTTP GETs to the kv face
  raw       the owner's ceiling: a bare TE-TCP reader (one connection, v2 framing, no
            work of its own) reading the same replicas, after one master lookup each
  shm       the same kv face from a local engine's side: libmoongate_kv (ctypes) on
            moongate's Unix socket, reading into mg_alloc memory (moongate reads the
            owner's replica by TE-TCP straight into the engine's memory: one hop, no
            HTTP) and putting from it
  quic      the same library from a remote engine's side: mg_connect_quic to moongate's
            kv API over QUIC (loopback here), into and from the engine's own memory
Medians over rounds. Then (--mix-rounds, default 12) the 4 KiB get once more from one
process holding every client (Mooncake's, the C library over HTTP, with shared memory
and over QUIC, the bare reader), in blocks of 300 calls taken in turn: the sides above
run minutes apart, and this VM drifts by more than the gaps between them. The raw column is what the owner serves to a reader that does
nothing else: neither client can read faster over one connection, and moongate also
sends every byte on to its caller on the same cores. `benches/run_kv_face.sh` builds release binaries and runs this.
"""
import argparse
import ctypes
import json
import resource
import os
import statistics
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import free_port, master_cmd, pct, run, run_owner, spawn_owner, stop_all, wait_http, work_dir  # noqa: E402,E501

MiB = 1 << 20
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
SIZES = {"4k": 4096, "16m": 16 * MiB}
# A batch load: BATCH_N values of BATCH_SIZE (kv/b/0..), one call each side
# (Mooncake's batch_get_into, moongate's POST /v1/kv/batch/get).
BATCH_N, BATCH_SIZE = 64, 64 * 1024
BATCH = f"batch{BATCH_N}x{BATCH_SIZE // 1024}k"
# 4 KiB values read once each (kv/f/0..FIRST_N-1): a first read, where moongate asks the
# master (the "4k" row reads one key over and over: after the first GET, moongate's are
# replica-cache hits within kv.replica_cache_ms, while Mooncake's client asks its master
# every time).
FIRST_N = 2000


def measure(call, n, warm, nbytes):
    """`warm` untimed calls, then `n` timed ones: p50 and p99 latency (us) and GB/s
    (`nbytes` a call)."""
    for _ in range(warm):
        call()
    lat = []
    t0 = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        call()
        lat.append((time.perf_counter() - t) * 1e6)
    total = time.perf_counter() - t0
    return {"p50_us": pct(lat, 0.5), "p99_us": pct(lat, 0.99), "GBps": nbytes * n / total / 1e9}


def measure_each(get, keys):
    """`get(key)` once per key, timed: p50 and p99 latency (us) and GB/s of 4 KiB."""
    lat = []
    t0 = time.perf_counter()
    for k in keys:
        t = time.perf_counter()
        get(k)
        lat.append((time.perf_counter() - t) * 1e6)
    total = time.perf_counter() - t0
    return {"p50_us": pct(lat, 0.5), "p99_us": pct(lat, 0.99),
            "GBps": 4096 * len(keys) / total / 1e9}


def first_count(a):
    """First reads a side makes: every key once."""
    return min(FIRST_N, a.count)


def value_count(a, size):
    """Timed calls for a value of `size`: fewer for large ones."""
    return a.count if size < MiB else max(8, a.count // 50)


def role_owner(a):
    values = {f"kv/{name}": os.urandom(size) for name, size in SIZES.items()}
    values.update({f"kv/b/{i}": os.urandom(BATCH_SIZE) for i in range(BATCH_N)})
    values.update({f"kv/f/{i}": os.urandom(4096) for i in range(FIRST_N)})
    run_owner(a.master, a.metadata, 256 * MiB, values)


def role_reader(a):
    from mooncake.store import MooncakeDistributedStore
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", a.metadata, 0, 64 * MiB, "tcp", "", a.master) == 0
    buf = (ctypes.c_char * (16 * MiB))()
    addr = ctypes.addressof(buf)
    assert s.register_buffer(addr, 16 * MiB) == 0
    out = {}
    for name, size in SIZES.items():
        def get(key=f"kv/{name}", size=size):
            assert s.get_into(key, addr, size) == size
        out[name] = measure(get, value_count(a, size), 5, size)
    out["4kfirst"] = measure_each(
        lambda k: s.get_into(k, addr, 4096) == 4096 or sys.exit(f"get {k}"),
        [f"kv/f/{i}" for i in range(first_count(a))])
    keys = [f"kv/b/{i}" for i in range(BATCH_N)]
    addrs = [addr + i * BATCH_SIZE for i in range(BATCH_N)]
    sizes = [BATCH_SIZE] * BATCH_N

    def batch():
        assert list(s.batch_get_into(keys, addrs, sizes)) == sizes
    out[BATCH] = measure(batch, max(20, a.count // 20), 3, BATCH_N * BATCH_SIZE)
    # Puts of 16 MiB from the registered buffer into the owner's segment, each removed
    # after its (timed) put so the segment never fills.
    n = max(8, a.count // 100)
    lat = []
    for i in range(n + 2):
        key = f"mc/put/{i}"
        t = time.perf_counter()
        assert s.put_from(key, addr, 16 * MiB) == 0, key
        took = time.perf_counter() - t
        if i >= 2:
            lat.append(took)
        assert s.remove(key) == 0, key
    out["put16m"] = {"p50_us": pct(lat, 0.5) * 1e6, "p99_us": pct(lat, 0.99) * 1e6,
                     "GBps": 16 * MiB * n / sum(lat) / 1e9}
    s.unregister_buffer(addr)
    s.close()
    print(json.dumps(out), flush=True)


def role_lib(a):
    """The library's sides: gets of kv/4k and kv/16m, the batch, and 16 MiB puts,
    through libmoongate_kv: `shm`, on moongate's Unix socket into and from mg_alloc
    memory; `quic`, over mg_connect_quic into and from memory of its own."""
    from kv_shm import connect, load
    lib = load(a.lib)
    region = 16 * MiB
    if a.role == "shm":
        h = connect(lib, a.sock)
        p = lib.mg_alloc(h, region)
        assert p, lib.mg_last_error(h)
    else:
        lib.mg_connect_quic.restype = ctypes.c_void_p
        lib.mg_connect_quic.argtypes = [ctypes.c_char_p] * 4
        addr, sha = a.quic.split("#")
        h = lib.mg_connect_quic(addr.encode(), sha.encode(), None, None)
        assert h, lib.mg_last_error(None)
        own = ctypes.create_string_buffer(region)
        p = ctypes.addressof(own)
    out = {}
    for name, size in SIZES.items():
        def get(key=f"kv/{name}".encode(), size=size):
            assert lib.mg_get_into(h, key, p, size) == size, lib.mg_last_error(h)
        out[name] = measure(get, value_count(a, size), 5, size)

    def get_first(key):
        assert lib.mg_get_into(h, key, p, 4096) == 4096, lib.mg_last_error(h)
    out["4kfirst"] = measure_each(get_first,
                                  [f"kv/f/{i}".encode() for i in range(first_count(a))])
    keys = (ctypes.c_char_p * BATCH_N)(*[f"kv/b/{i}".encode() for i in range(BATCH_N)])
    dst = (ctypes.c_void_p * BATCH_N)(*[p + i * BATCH_SIZE for i in range(BATCH_N)])
    caps = (ctypes.c_size_t * BATCH_N)(*[BATCH_SIZE] * BATCH_N)
    res = (ctypes.c_int64 * BATCH_N)()

    def batch():
        assert lib.mg_batch_get_into(h, keys, dst, caps, BATCH_N, res) == 0, \
            lib.mg_last_error(h)
        assert list(res) == [BATCH_SIZE] * BATCH_N, list(res)
    out[BATCH] = measure(batch, max(20, a.count // 20), 3, BATCH_N * BATCH_SIZE)
    # 16 MiB puts from the shared region, each removed after its (timed) put.
    n = max(8, a.count // 100)
    lat = []
    for i in range(n + 2):
        key = f"{a.role}/put/{os.getpid()}/{i}".encode()
        t = time.perf_counter()
        assert lib.mg_put(h, key, p, 16 * MiB) == 0, lib.mg_last_error(h)
        took = time.perf_counter() - t
        if i >= 2:
            lat.append(took)
        assert lib.mg_remove(h, key) == 0, lib.mg_last_error(h)
    out["put16m"] = {"p50_us": pct(lat, 0.5) * 1e6, "p99_us": pct(lat, 0.99) * 1e6,
                     "GBps": 16 * MiB * n / sum(lat) / 1e9}
    if a.role == "shm":
        assert lib.mg_free(h, p) == 0, lib.mg_last_error(h)
    lib.mg_close.argtypes = [ctypes.c_void_p]
    lib.mg_close(h)
    print(json.dumps(out), flush=True)


def raw_reader(s, metadata, name, size, conns):
    """A bare TE-TCP read of kv/NAME's replica (data-plane spec B) on a connection of
    `conns` (one per owner port), the location asked of the master once."""
    import socket
    import struct
    import urllib.parse
    b = s.get_replica_desc(f"kv/{name}")[0].get_memory_descriptor().buffer_descriptor
    key = urllib.parse.quote("mooncake/ram/" + b.transport_endpoint, safe="")
    with urllib.request.urlopen(f"{metadata}?key={key}") as r:
        port = json.loads(r.read())["tcp_data_port"]
    if port not in conns:
        c = socket.create_connection(("127.0.0.1", port))
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conns[port] = c
    c, buf = conns[port], bytearray(size)
    view = memoryview(buf)

    def read():
        c.sendall(struct.pack("<QQB7x", size, b.buffer_address, 0x80))
        status = b""
        while len(status) < 8:
            status += c.recv(8 - len(status))
        assert status[4:] == b"VTCM" and status[:4] == b"\0\0\0\0", status
        got = 0
        while got < size:
            n = c.recv_into(view[got:])
            assert n > 0, "owner closed"
            got += n
    return read


def role_raw(a):
    """Reads the replicas of kv/4k and kv/16m straight from the owner's TE-TCP listener
    (data-plane spec B), the location asked of the master once per key."""
    from mooncake.store import MooncakeDistributedStore
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", a.metadata, 0, 64 * MiB, "tcp", "", a.master) == 0
    out, conns = {}, {}
    for name, size in SIZES.items():
        read = raw_reader(s, a.metadata, name, size, conns)
        out[name] = measure(read, value_count(a, size), 5, size)
    for c in conns.values():
        c.close()
    s.close()
    print(json.dumps(out), flush=True)


# The interleaved 4 KiB comparison: blocks of this many calls, each client in turn.
MIX_BLOCK, MIX_WARM = 300, 20


def role_mixed(a):
    """4 KiB gets from one process holding every client at once, in short blocks taken
    in turn (order rotated each round), so all clients see the same moments of the
    machine: Mooncake's client (get_into a registered buffer), the C library over HTTP
    (mg_connect to the kv face's TCP listener, into memory of its own), the C library
    with shared memory (Unix socket, mg_alloc memory), the C library over QUIC, and the
    bare TE-TCP reader.
    Sequential sides measured minutes apart differed by more than the gaps between
    them on this VM (a 20-55 us "shm slower than HTTP" that vanished interleaved)."""
    from kv_shm import connect, load
    from mooncake.store import MooncakeDistributedStore
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", a.metadata, 0, 64 * MiB, "tcp", "", a.master) == 0
    buf = (ctypes.c_char * 4096)()
    addr = ctypes.addressof(buf)
    assert s.register_buffer(addr, 4096) == 0
    lib = load(a.lib)
    shm = connect(lib, a.sock)
    region = lib.mg_alloc(shm, 1 << 20)
    assert region, lib.mg_last_error(shm)
    http = lib.mg_connect(f"tcp:{a.kv}".encode())
    assert http, lib.mg_last_error(None)
    own = ctypes.create_string_buffer(4096)
    lib.mg_connect_quic.restype = ctypes.c_void_p
    lib.mg_connect_quic.argtypes = [ctypes.c_char_p] * 4
    qaddr, sha = a.quic.split("#")
    quic = lib.mg_connect_quic(qaddr.encode(), sha.encode(), None, None)
    assert quic, lib.mg_last_error(None)
    conns = {}

    def lib_get(h, p):
        def get():
            assert lib.mg_get_into(h, b"kv/4k", p, 4096) == 4096, lib.mg_last_error(h)
        return get

    def mc_get():
        assert s.get_into("kv/4k", addr, 4096) == 4096
    clients = {"mooncake": mc_get, "http": lib_get(http, ctypes.addressof(own)),
               "shm": lib_get(shm, region), "quic": lib_get(quic, ctypes.addressof(own)),
               "raw": raw_reader(s, a.metadata, "4k", 4096, conns)}
    names = list(clients)
    out = {n: [] for n in names}
    for r in range(a.mix_rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            out[n].append(measure(clients[n], MIX_BLOCK, MIX_WARM, 4096)["p50_us"])
    assert lib.mg_free(shm, region) == 0, lib.mg_last_error(shm)
    lib.mg_close.argtypes = [ctypes.c_void_p]
    lib.mg_close(shm)
    lib.mg_close(http)
    lib.mg_close(quic)
    for c in conns.values():
        c.close()
    s.unregister_buffer(addr)
    s.close()
    print(json.dumps(out), flush=True)


CHECKED = {"capture_output": True, "text": True}


def _checked_run(*args, **kw):
    """subprocess.run that fails with the side's own error output."""
    r = subprocess.run(*args, **kw)
    if r.returncode:
        raise SystemExit(f"{' '.join(map(str, r.args[:4]))} ... failed ({r.returncode}):\n"
                         f"{r.stderr[-3000:]}")
    return r


def cache_counts(admin):
    """moongate's replica cache results so far ({"hit": n, "miss": n, "stale": n})."""
    out = {}
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics") as r:
        for ln in r.read().decode().splitlines():
            if ln.startswith("moongate_kv_replica_cache_total{"):
                res = ln.split('result="', 1)[1].split('"', 1)[0]
                out[res] = float(ln.rsplit(" ", 1)[1])
    return out


def proc_cpu(pid):
    """User and system CPU seconds of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def host_line():
    """The host the figures come from: cores and CPU model."""
    model = "?"
    try:
        for ln in open("/proc/cpuinfo"):
            if ln.startswith("model name"):
                model = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"host: {os.cpu_count()} cores ({model})"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--role", default="driver")
    p.add_argument("--master")
    p.add_argument("--metadata")
    p.add_argument("--count", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of the sides (0: only the interleaved 4 KiB comparison)")
    p.add_argument("--moongate", default="target/release/moongate")
    p.add_argument("--kv-bench", default="target/release/examples/kv_bench")
    p.add_argument("--lib", default="target/release/libmoongate_kv.so",
                   help="libmoongate_kv for the shm side (cargo build --release -p moongate-kv)")
    p.add_argument("--sock")
    p.add_argument("--quic", help="ADDR#SHA256 of moongate's kv API over QUIC")
    p.add_argument("--json")
    p.add_argument("--kv", help="the kv face's TCP address (the mixed role's HTTP client)")
    p.add_argument("--mix-rounds", type=int, default=12,
                   help="rounds of the interleaved 4 KiB comparison (0: skip it)")
    p.add_argument("--moongate-config", help="extra moongate TOML (e.g. a [runtime] or [kv] "
                   "variant); the flags above still set addresses")
    a = p.parse_args()
    if a.role == "owner":
        return role_owner(a)
    if a.role == "reader":
        return role_reader(a)
    if a.role == "raw":
        return role_raw(a)
    if a.role in ("shm", "quic"):
        return role_lib(a)
    if a.role == "mixed":
        return role_mixed(a)
    work = work_dir("moongate-kv-")
    rpc, http, kv, admin = (free_port() for _ in range(4))
    metadata = f"http://127.0.0.1:{http}/metadata"
    procs = []
    res = {"mooncake": [], "moongate": [], "raw": [], "shm": [], "quic": []}
    sock = f"{work}/kv.sock"
    # The Unix socket for the shm side, added to the caller's config (or a config of
    # its own).
    cfg = open(a.moongate_config).read() if a.moongate_config else ""
    line = f'unix_path = "{sock}"\napi_quic_listen = "127.0.0.1:0"\n'
    cfg = cfg.replace("[kv]\n", "[kv]\n" + line, 1) if "[kv]\n" in cfg \
        else cfg + "\n[kv]\n" + line
    with open(f"{work}/moongate.toml", "w") as f:
        f.write(cfg)
    try:
        procs.append(subprocess.Popen(
            master_cmd(rpc, http),
            stdout=open(f"{work}/master.log", "w"), stderr=subprocess.STDOUT))
        mg = subprocess.Popen(
            [a.moongate, "run", "--listen", f"127.0.0.1:{free_port()}",
             "--upstream", f"127.0.0.1:{rpc}", "--admin", f"127.0.0.1:{admin}",
             "--kv", f"127.0.0.1:{kv}", "--metadata", metadata,
             "--config", f"{work}/moongate.toml"],
            stdout=open(f"{work}/moongate.log", "w"), stderr=subprocess.STDOUT,
            env={**os.environ, "RUST_LOG": "warn,moongate::kv=info"})
        procs.append(mg)

        def timed(cmd):
            """One kv_bench run and the CPU seconds it took: moongate's and the client's
            (where a remote GET's time goes: moongate's cores, or waiting)."""
            m0, c0 = proc_cpu(mg.pid), resource.getrusage(resource.RUSAGE_CHILDREN)
            out = json.loads(_checked_run(cmd, **CHECKED).stdout)
            c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            out["cpu_s"] = {"moongate": round(proc_cpu(mg.pid) - m0, 3),
                            "client": round(c1.ru_utime + c1.ru_stime
                                            - c0.ru_utime - c0.ru_stime, 3)}
            return out
        wait_http(f"http://127.0.0.1:{admin}/ready")
        # Where the kv API is served over QUIC, and the certificate to pin: its log line.
        quic = None
        for _ in range(100):
            for ln in open(f"{work}/moongate.log"):
                if "kv API served over QUIC" in ln:
                    f = dict(part.split("=", 1) for part in ln.split() if "=" in part)
                    quic = f"{f['quic']}#{f['sha256']}"
            if quic:
                break
            time.sleep(0.1)
        assert quic, "moongate did not log its kv API over QUIC"
        owner = spawn_owner(__file__, f"127.0.0.1:{rpc}", metadata, work)
        procs.append(owner)
        for i in range(a.rounds):
            sides = ["raw", "mooncake", "moongate", "shm", "quic"]
            for side in (sides if i % 2 == 0 else sides[::-1]):
                if side in ("mooncake", "raw", "shm", "quic"):
                    role = {"mooncake": "reader"}.get(side, side)
                    out = _checked_run(
                        [sys.executable, __file__, "--role", role, "--master",
                         f"127.0.0.1:{rpc}", "--metadata", metadata, "--count", str(a.count),
                         "--lib", a.lib, "--sock", sock, "--quic", quic],
                        **CHECKED).stdout
                    res[side].append(json.loads(out.strip().splitlines()[-1]))
                else:
                    r = {}
                    for name, size in SIZES.items():
                        n = value_count(a, size)
                        r[name] = timed([a.kv_bench, f"127.0.0.1:{kv}", f"kv%2F{name}", str(n)])
                    before = cache_counts(admin)
                    out = _checked_run([a.kv_bench, f"127.0.0.1:{kv}", f"each:kv%2Ff%2F:{FIRST_N}",
                                          str(first_count(a))],
                                         **CHECKED).stdout
                    r["4kfirst"] = json.loads(out)
                    after = cache_counts(admin)
                    r["4kfirst"]["cache"] = {k: after[k] - before.get(k, 0) for k in after}
                    n = max(20, a.count // 20)
                    r[BATCH] = timed([a.kv_bench, f"127.0.0.1:{kv}", f"batch:kv/b/:{BATCH_N}",
                                      str(n)])
                    r["put16m"] = timed([a.kv_bench, f"127.0.0.1:{kv}",
                                         f"put:mg%2Fput%2F:{16 * MiB}", str(max(8, a.count // 100))])
                    res[side].append(r)
                print(f"round {i + 1}/{a.rounds} {side} done", file=sys.stderr, flush=True)
        mixed = None
        if a.mix_rounds > 0:
            out = _checked_run(
                [sys.executable, __file__, "--role", "mixed", "--master", f"127.0.0.1:{rpc}",
                 "--metadata", metadata, "--lib", a.lib, "--sock", sock,
                 "--kv", f"127.0.0.1:{kv}", "--quic", quic, "--mix-rounds", str(a.mix_rounds)],
                **CHECKED).stdout
            mixed = json.loads(out.strip().splitlines()[-1])
            res["mixed"] = mixed
            print("interleaved 4 KiB done", file=sys.stderr, flush=True)
        owner.stdin.close()
        owner.wait(timeout=30)
    finally:
        stop_all(procs)
    med = lambda side, name, m: statistics.median(r[name][m] for r in res[side])
    print(f"\n{host_line()}")
    if a.rounds > 0:
        print(f"medians over {a.rounds} rounds; 4k: one key over and over (moongate: "
              f"replica-cache hits after the first GET); 4kfirst: {first_count(a)} keys "
              f"read once each (moongate asks the master for each)")
        print(f"{'':<28}{'mooncake client':>18}{'moongate kv face':>18}{'kv face, shm':>14}"
              f"{'kv face, QUIC':>15}{'owner ceiling':>16}")
        for name, metric in (("4k", "p50_us"), ("4k", "p99_us"), ("4kfirst", "p50_us"),
                             ("16m", "GBps"),
                             (BATCH, "p50_us"), (BATCH, "GBps"), ("put16m", "GBps")):
            op = " remote put " if name.startswith("put") else " remote get "
            raw = f"{med('raw', name, metric):>16.2f}" if name in SIZES else f"{'-':>16}"
            if name == "4kfirst" and metric == "p50_us":
                hits = sum(r["4kfirst"]["cache"].get("hit", 0) for r in res["moongate"])
                gets = sum(sum(r["4kfirst"]["cache"].values()) for r in res["moongate"])
                cache_note = f"  (HTTP: {hits:.0f} of {gets:.0f} GETs were cache hits)"
            else:
                cache_note = ""
            print(f"{name + op + metric:<28}{med('mooncake', name, metric):>18.2f}"
                  f"{med('moongate', name, metric):>18.2f}{med('shm', name, metric):>14.2f}"
                  f"{med('quic', name, metric):>15.2f}{raw}{cache_note}")
        # Where the HTTP side's time goes: CPU seconds per op (moongate, kv_bench) against
        # the wall time per op (from the rate): near 1.0 of a core means CPU-bound.
        # Where the HTTP side's time goes: CPU milliseconds per call (moongate's, and the
        # client's, kv_bench) against the wall time per call (its bytes at its rate): a
        # CPU time near the wall time is a core kept busy.
        print("\nHTTP side, per call (medians): wall ms | moongate CPU ms | client CPU ms")
        for name in ("16m", BATCH, "put16m"):
            rows = [r[name] for r in res["moongate"] if "cpu_s" in r[name] and r[name].get("calls")]
            if not rows:
                continue
            per = lambda f: statistics.median(f(r) for r in rows)  # noqa: E731
            wall = per(lambda r: r["bytes"] / (r["GBps"] * 1e6))
            mgc = per(lambda r: r["cpu_s"]["moongate"] * 1e3 / r["calls"])
            cl = per(lambda r: r["cpu_s"]["client"] * 1e3 / r["calls"])
            print(f"  {name:<14}{wall:>8.2f} |{mgc:>8.2f} |{cl:>8.2f}")
    if mixed:
        n = len(mixed["mooncake"])
        print(f"\n4 KiB remote get of one key, interleaved (moongate's: replica-cache hits): {n} rounds of {MIX_BLOCK} calls per client "
              f"in one process, p50 us (median of blocks, [min, max]); ratio: median of "
              f"each round's client p50 / Mooncake's")
        for c in ("mooncake", "http", "shm", "quic", "raw"):
            v = mixed[c]
            ratio = statistics.median(x / m for x, m in zip(v, mixed["mooncake"]))
            print(f"  {c:<10}{statistics.median(v):>10.1f}  [{min(v):.1f}, {max(v):.1f}]"
                  f"  {ratio:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    run(main)

#!/usr/bin/env python3
"""Real Mooncake client workloads for moongate's integration tests and demo.

Every store call goes through `master_server_address`, which the tests point either at
the real mooncake_master or at moongate in front of it; the two runs must produce equal
results. Results are JSON written to --out; values are checked byte for byte here.

Roles:
  owner   mounts a segment, writes o/* keys, prints "READY <endpoint>", waits for a
          line on stdin, then reads back what the reader wrote and cleans up.
  reader  mounts an empty segment, so every replica lives in the owner's segment and
          every get/put crosses processes over the transfer engine's TCP path.
  idle    setup, put, sleep --idle seconds doing nothing, then get/is_exist/close.
  loop    repeat put/get/is_exist until stdin closes; exit 1 on the first failure.
  demo    a small mixed workload (the README demo) printing a summary.
  hold    mount a segment, print "READY <endpoint>", wait for a line on stdin, close.
  disk    against a master with --root_fs_dir: put, wait for the disk replica, look
          it up, probe a hit and a miss.
  steer   against a master with --root_fs_dir: put --count 2000-byte keys, give the
          disk writes --idle seconds, then read them all in one batch (get_batch) and
          report which came back byte-exact and which as misses.
  bulk    one client, --count keys of 1 KiB in single batch calls: put_batch,
          batch_is_exist (with as many misses), batch_get_replica_desc, get_batch
          (byte-exact), get_batch of missing keys. For batch splitting; it leaves other
          clients' keys alone (no remove_all).
  chains  mount a 16 MiB segment, put --count chains of 8 blocks of 64 KiB (one
          put_batch per chain, prefix order), print "READY <endpoint>", wait for a
          line on stdin, then report which blocks still exist (batch_is_exist only:
          lookups that grant leases would block moongate's removals).
  kvpeer  mount a 64 MiB segment, put py/small (5000 B) and py/big (3 MiB + 7 B),
          print "READY <endpoint>", wait for a line on stdin, then read kv/small and
          kv/big (written through moongate's kv face) and check them byte for byte.
  guest   mount no memory, read own/small and own/big (put through moongate's kv face
          into moongate's own segment), then put py/x (70000 B) and py/big (5 MiB + 1),
          which can only land in moongate's segment.
  events  three phases of puts, removals, a RemoveAll and a 10 MiB batch put, each
          ended by "READY <n>" and a line on stdin (the KV-events test).
  steps   mount --segment-mib of memory, print "READY <endpoint>", then do what each
          stdin line says and answer "READY <json>": `put PREFIX N SIZE` (one put per
          key; the return codes that were not 0), `get PREFIX N SIZE` (byte-exact
          reads; the indices that failed), `check PREFIX N SIZE` (reads where a miss
          is allowed: "bad" the indices read back wrong, "missing" those absent),
          `exist PREFIX N` (batch_is_exist; the indices missing); any shorter line
          closes.
  place   put each of --count keys (--prefix) one call at a time (so a per-key policy
          decides each), then report every put's return code and where each replica
          landed (segment endpoint, from batch_get_replica_desc).
"""
import argparse
import ctypes
import hashlib
import json
import os
import sys
import time
import zlib

from mooncake.store import MooncakeDistributedStore

MiB = 1 << 20


def value(key, size):
    """Deterministic bytes for a key: any corruption or mix-up changes the CRC."""
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


class Buf:
    """A registered, page-aligned-enough buffer for the zero-copy APIs."""

    def __init__(self, store, size):
        self.raw = (ctypes.c_char * size)()
        self.addr = ctypes.addressof(self.raw)
        self.size = size
        rc = store.register_buffer(self.addr, size)
        if rc != 0:
            raise SystemExit(f"register_buffer failed: {rc}")

    def write(self, off, data):
        ctypes.memmove(self.addr + off, data, len(data))

    def read(self, off, n):
        return ctypes.string_at(self.addr + off, n)

    def poison(self):
        ctypes.memset(self.addr, 0xA5, self.size)


class Run:
    def __init__(self, args):
        self.args = args
        self.results = []
        self.s = MooncakeDistributedStore()
        self.me = None

    def rec(self, op, result):
        self.results.append([op, result])

    def setup(self, segment):
        a = self.args
        rc = self.s.setup("127.0.0.1", a.metadata, segment, 16 * MiB, "tcp", "", a.master)
        self.rec("setup", rc)
        if rc != 0:
            self.finish()
            raise SystemExit(f"setup failed: {rc}")
        self.me = self.s.get_hostname()

    def where(self, endpoint):
        if endpoint == self.me:
            return "self"
        if endpoint == self.args.owner_host:
            return "owner"
        return "other"

    def desc(self, reps):
        out = []
        for r in reps:
            d = {"status": str(r.status)}
            if r.is_memory_replica():
                bd = r.get_memory_descriptor().buffer_descriptor
                d.update(tier="memory", size=bd.size, at=self.where(bd.transport_endpoint))
            elif r.is_disk_replica():
                dd = r.get_disk_descriptor()
                d.update(tier="disk", size=dd.object_size)
            else:
                d.update(tier="other")
            out.append(d)
        return out

    def check_get(self, key, size):
        v = self.s.get(key)
        self.rec(f"get {key}", {"len": len(v), "ok": bytes(v) == value(key, size)})

    def finish(self):
        with open(self.args.out, "w") as f:
            json.dump(self.results, f, indent=1)


def owner(run):
    s = run.s
    run.setup(64 * MiB)
    run.rec("put o/k1", s.put("o/k1", value("o/k1", 5000)))
    buf = Buf(s, 4 * 65536)
    keys = [f"o/b{i}" for i in range(4)]
    for i, k in enumerate(keys):
        buf.write(i * 65536, value(k, 65536))
    run.rec("batch_put_from o/b*", s.batch_put_from(
        keys, [buf.addr + i * 65536 for i in range(4)], [65536] * 4))
    run.rec("put o/big", s.put("o/big", value("o/big", 3 * MiB)))
    print(f"READY {run.me}", flush=True)
    sys.stdin.readline()
    # What the reader wrote, read back here from the owner's own segment.
    run.check_get("r/k2", 20000)
    for i in range(3):
        run.check_get(f"r/b{i}", 4096)
    run.rec("remove_all", s.remove_all(True))
    run.rec("is_exist o/k1 after remove_all", s.is_exist("o/k1"))
    run.rec("close", s.close())
    run.finish()


def reader(run):
    s = run.s
    run.setup(0)
    run.check_get("o/k1", 5000)
    run.check_get("o/big", 3 * MiB)
    buf = Buf(s, 4 * MiB)
    buf.poison()
    n = s.get_into("o/k1", buf.addr, buf.size)
    run.rec("get_into o/k1", {"n": n, "ok": buf.read(0, 5000) == value("o/k1", 5000)})
    keys = [f"o/b{i}" for i in range(4)]
    buf.poison()
    ns = s.batch_get_into(keys, [buf.addr + i * 65536 for i in range(4)], [65536] * 4)
    run.rec("batch_get_into o/b*", {
        "n": list(ns),
        "ok": [buf.read(i * 65536, 65536) == value(k, 65536) for i, k in enumerate(keys)]})
    run.rec("is_exist o/k1", s.is_exist("o/k1"))
    run.rec("is_exist missing", s.is_exist("missing"))
    run.rec("batch_is_exist", list(s.batch_is_exist(keys + ["missing", "o/k1"])))
    run.rec("get_replica_desc o/k1", run.desc(s.get_replica_desc("o/k1")))
    d = s.batch_get_replica_desc(keys + ["missing"])
    run.rec("batch_get_replica_desc", {k: run.desc(d.get(k, [])) for k in keys + ["missing"]})
    run.rec("get missing", len(s.get("missing")))
    # Writes from the reader land in the owner's segment (ours is empty): remote TCP writes.
    run.rec("put r/k2", s.put("r/k2", value("r/k2", 20000)))
    run.rec("put r/k2 again", s.put("r/k2", value("r/k2", 20000)))
    wkeys = [f"r/b{i}" for i in range(3)]
    for i, k in enumerate(wkeys):
        buf.write(i * 4096, value(k, 4096))
    run.rec("batch_put_from r/b*", list(s.batch_put_from(
        wkeys, [buf.addr + i * 4096 for i in range(3)], [4096] * 3)))
    run.rec("upsert o/k1", s.upsert("o/k1", value("o/k1 v2", 7000)))
    v = s.get("o/k1")
    run.rec("get o/k1 after upsert", {"len": len(v), "ok": bytes(v) == value("o/k1 v2", 7000)})
    run.rec("get_replica_desc r/k2", run.desc(s.get_replica_desc("r/k2")))
    run.rec("put r/k3", s.put("r/k3", b"x" * 100))
    run.rec("remove r/k3 (never read)", s.remove("r/k3"))
    run.rec("remove o/k1 (read lease held)", s.remove("o/k1"))
    run.rec("is_exist r/k3", s.is_exist("r/k3"))
    run.rec("close", s.close())
    run.finish()


def idle(run):
    s = run.s
    run.setup(16 * MiB)
    run.rec("put", s.put("idle/k", value("idle/k", 1000)))
    time.sleep(run.args.idle)
    run.check_get("idle/k", 1000)
    run.rec("is_exist", s.is_exist("idle/k"))
    run.rec("get_replica_desc", run.desc(s.get_replica_desc("idle/k")))
    run.rec("put after idle", s.put("idle/k2", b"y" * 10))
    run.rec("close", s.close())
    run.finish()


def loop(run):
    """Keeps calling until told to stop; any failure ends it with exit code 1."""
    import select
    from mooncake.store import ReplicateConfig
    s = run.s
    run.setup(16 * MiB)
    # Keep this client's objects in its own segment: another client closing (and
    # unmounting its segment) must not take them away mid-loop.
    cfg = ReplicateConfig()
    cfg.preferred_segment = run.me
    print(f"READY {run.me}", flush=True)
    i = 0
    failures = []
    while True:
        r, _, _ = select.select([sys.stdin], [], [], 0)
        if r:
            break
        k = f"loop/{os.getpid()}/{i % 50}"
        rc = s.upsert(k, value(k, 2048), cfg)
        v = s.get(k)
        e = s.is_exist(k)
        if rc != 0 or bytes(v) != value(k, 2048) or e != 1:
            failures.append({"i": i, "rc": rc, "len": len(v), "exist": e})
            break
        i += 1
        if run.args.pause_ms:
            time.sleep(run.args.pause_ms / 1000)
    run.rec("iterations", i)
    run.rec("failures", failures)
    run.rec("close", s.close())
    run.finish()
    sys.exit(1 if failures or i == 0 else 0)


def failover(run):
    """Puts and reads back through a master failover until told to stop: every call
    timed, every value read checked. A read is ok (byte-exact), absent, or wrong (never
    allowed); failed calls are expected while there is no leader."""
    import select
    from mooncake.store import ReplicateConfig
    s = run.s
    run.setup(16 * MiB)
    cfg = ReplicateConfig()
    cfg.preferred_segment = run.me
    print(f"READY {run.me}", flush=True)
    i = 0
    ok = failed = wrong = absent = 0
    slowest_failure = 0.0
    first_failure = last_failure = None
    ok_after = 0
    while True:
        r, _, _ = select.select([sys.stdin], [], [], 0)
        if r:
            break
        k = f"fo/{os.getpid()}/{i % 50}"
        t0 = time.monotonic()
        rc = s.upsert(k, value(k, 2048), cfg)
        v = s.get(k)
        t1 = time.monotonic()
        good = rc == 0 and len(v) > 0
        if len(v) > 0 and bytes(v) != value(k, 2048):
            wrong += 1
        elif len(v) == 0 and rc == 0:
            absent += 1
        if good:
            ok += 1
            if last_failure is not None:
                ok_after += 1
                if ok_after == 1:
                    # Back after an outage: a test can wait for this line.
                    print("READY recovered", flush=True)
        else:
            failed += 1
            slowest_failure = max(slowest_failure, t1 - t0)
            first_failure = first_failure or t0
            last_failure = t1
            ok_after = 0
            time.sleep(0.05)
        i += 1
    run.rec("ok", ok)
    run.rec("failed", failed)
    run.rec("wrong", wrong)
    run.rec("absent_after_put", absent)
    run.rec("slowest_failed_round_s", round(slowest_failure, 3))
    run.rec("outage_s", round((last_failure - first_failure), 3) if first_failure else 0)
    run.rec("ok_after_last_failure", ok_after)
    run.rec("close", s.close())
    run.finish()


def demo(run):
    s = run.s
    t0 = time.time()
    run.setup(64 * MiB)
    keys = [f"demo/{i}" for i in range(200)]
    ok = 0
    for k in keys:
        ok += s.put(k, value(k, 16384)) == 0
    hits = sum(s.batch_is_exist(keys + [f"demo/miss/{i}" for i in range(50)]))
    good = sum(bytes(s.get(k)) == value(k, 16384) for k in keys[:100])
    desc = run.desc(s.get_replica_desc(keys[0]))
    s.remove_all(True)
    s.close()
    print(f"demo: {ok}/200 puts ok, {hits}/250 keys found, {good}/100 gets byte-exact, "
          f"replica of {keys[0]}: {desc}, {time.time() - t0:.2f}s", flush=True)
    run.rec("summary", {"puts": ok, "hits": hits, "gets": good})
    run.finish()
    sys.exit(0 if ok == 200 and hits == 200 and good == 100 else 1)


def disk(run):
    s = run.s
    run.setup(64 * MiB)
    run.rec("put", s.put("dk", value("dk", 2000)))
    tiers = []
    for _ in range(50):  # the client writes the disk replica in the background
        tiers = run.desc(s.get_replica_desc("dk"))
        if any(d["tier"] == "disk" for d in tiers):
            break
        time.sleep(0.1)
    run.rec("tiers", sorted(d["tier"] for d in tiers))
    run.check_get("dk", 2000)
    run.rec("is_exist", [s.is_exist("dk"), s.is_exist("nope")])
    run.rec("get missing", len(s.get("nope")))
    run.rec("close", s.close())
    run.finish()


def diskget(run):
    """Reads what moongate stored, after moongate's memory is gone (disk replicas only)."""
    s = run.s
    run.setup(0)
    run.rec("tiers kvd/small", sorted(d["tier"] for d in run.desc(s.get_replica_desc("kvd/small"))))
    run.check_get("kvd/small", 5000)
    run.check_get("kvd/big", 2 * MiB + 3)
    run.rec("close", s.close())
    run.finish()


def steer(run):
    s = run.s
    a = run.args
    run.setup(64 * MiB)
    keys = [f"{a.prefix}{i}" for i in range(a.count)]
    run.rec("puts", [s.put(k, value(k, 2000)) for k in keys])
    time.sleep(a.idle)
    got = s.get_batch(keys)
    run.rec("reads", ["hit" if bytes(v) == value(k, 2000) else ("miss" if len(v) == 0 else "corrupt")
                      for k, v in zip(keys, got)])
    run.rec("close", s.close())
    run.finish()


def bulk(run):
    s = run.s
    a = run.args
    run.setup(64 * MiB)
    keys = [f"{a.prefix}{i}" for i in range(a.count)]
    misses = [f"{a.prefix}miss/{i}" for i in range(a.count)]
    # Keep the keys in this client's own segment, as an engine with a local segment
    # does. (Placed in another live client's segment, 0.3.13's put_batch of this size
    # fails part of the keys with TRANSFER_FAIL, with or without moongate.)
    from mooncake.store import ReplicateConfig
    cfg = ReplicateConfig()
    cfg.preferred_segment = run.me
    run.rec("put_batch", s.put_batch(keys, [value(k, 1024) for k in keys], cfg))
    found = s.batch_is_exist(keys + misses)
    run.rec("batch_is_exist", {"hits": sum(1 for x in found if x == 1),
                               "misses": sum(1 for x in found if x == 0),
                               "order": found[:a.count] == [1] * a.count})
    d = s.batch_get_replica_desc(keys)
    run.rec("replica_desc", {"keys": len(d), "tiers": sorted({t["tier"] for k in keys
                                                            for t in run.desc(d.get(k) or [])})})
    got = s.get_batch(keys)
    run.rec("get_batch", {"n": len(got), "ok": sum(bytes(v) == value(k, 1024)
                                                    for k, v in zip(keys, got))})
    run.rec("get_batch misses", sum(len(v) for v in s.get_batch(misses[:100])))
    run.rec("close", s.close())
    run.finish()


def chains(run):
    s = run.s
    a = run.args
    run.setup(16 * MiB)
    keys = [[f"{a.prefix}{c}/{b}" for b in range(8)] for c in range(a.count)]
    run.rec("puts", [s.put_batch(ch, [value(k, 64 << 10) for k in ch]) for ch in keys])
    print(f"READY {run.me}", flush=True)
    sys.stdin.readline()
    flat = [k for ch in keys for k in ch]
    run.rec("exists", dict(zip(flat, s.batch_is_exist(flat))))
    run.rec("close", s.close())
    run.finish()


def kvpeer(run):
    s = run.s
    run.setup(64 * MiB)
    run.rec("put py/small", s.put("py/small", value("py/small", 5000)))
    run.rec("put py/big", s.put("py/big", value("py/big", 3 * MiB + 7)))
    print(f"READY {run.me}", flush=True)
    sys.stdin.readline()
    run.check_get("kv/small", 5000)
    run.check_get("kv/big", 3 * MiB + 7)
    run.rec("close", s.close())
    run.finish()


def guest(run):
    s = run.s
    run.setup(0)
    run.check_get("own/small", 5000)
    run.check_get("own/big", 3 * MiB + 7)
    run.rec("put py/x", s.put("py/x", value("py/x", 70000)))
    run.rec("put py/big", s.put("py/big", value("py/big", 5 * MiB + 1)))
    run.rec("close", s.close())
    run.finish()


def hold(run):
    run.setup(64 * MiB)
    print(f"READY {run.me}", flush=True)
    sys.stdin.readline()
    run.rec("close", run.s.close())
    run.finish()


def steps(run):
    s = run.s
    run.setup(run.args.segment_mib * MiB)
    print(f"READY {run.me}", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if len(cmd) < 3:  # "close", or the harness's end-of-input line
            break
        keys = [f"{cmd[1]}{i}" for i in range(int(cmd[2]))]
        if cmd[0] == "put":
            size = int(cmd[3])
            bad = [rc for rc in (s.put(k, value(k, size)) for k in keys) if rc != 0]
        elif cmd[0] == "get":
            size = int(cmd[3])
            bad = [i for i, k in enumerate(keys) if s.get(k) != value(k, size)]
        elif cmd[0] == "check":
            # A miss is allowed (the value may be gone); a wrong value never is.
            size = int(cmd[3])
            got = [bytes(s.get(k)) for k in keys]
            print("READY " + json.dumps({
                "bad": [i for i, (k, g) in enumerate(zip(keys, got)) if g and g != value(k, size)],
                "missing": [i for i, g in enumerate(got) if not g]}), flush=True)
            continue
        elif cmd[0] == "exist":
            bad = [i for i, e in enumerate(s.batch_is_exist(keys)) if e != 1]
        elif cmd[0] == "rm":
            bad = [i for i, k in enumerate(keys) if s.remove(k) != 0]
        elif cmd[0] == "forcerm":
            # Past any read lease (an operator's forced removal).
            bad = [i for i, k in enumerate(keys) if s.remove(k, True) != 0]
        else:
            raise SystemExit(f"steps: unknown command {line!r}")
        print("READY " + json.dumps({"bad": bad}), flush=True)
    run.rec("close", s.close())
    run.finish()


def place(run):
    s = run.s
    a = run.args
    run.setup(0)
    keys = [f"{a.prefix}{i}" for i in range(a.count)]
    rcs = {k: s.put(k, value(k, 1024)) for k in keys}
    at = {}
    for i in range(0, len(keys), 500):
        chunk = keys[i:i + 500]
        d = s.batch_get_replica_desc(chunk)
        for k in chunk:
            reps = d.get(k) or []
            at[k] = [r.get_memory_descriptor().buffer_descriptor.transport_endpoint
                     for r in reps if r.is_memory_replica()]
    run.rec("rc", rcs)
    run.rec("at", at)
    run.rec("close", s.close())
    run.finish()


def misses(run):
    """Lookups that miss for known reasons: a key a client removed, a key never stored
    (and one that hits)."""
    s = run.s
    run.setup(16 * MiB)
    run.rec("put_kept", s.put("m/kept", value("m/kept", 1024)))
    run.rec("put_rm", s.put("m/rm", value("m/rm", 1024)))
    run.rec("remove", s.remove("m/rm"))
    run.rec("exist", [int(x) for x in s.batch_is_exist(["m/kept", "m/rm", "m/never"])])
    run.rec("close", s.close())
    run.finish()


def events(run):
    """KV events: a scripted workload whose every event a test checks. Three phases,
    each ended by "READY <n>" and a line on stdin."""
    s = run.s
    run.setup(16 * MiB)
    chain = [f"ev/blk/{i}" for i in range(1, 9)]
    run.rec("put_chain", s.put_batch(chain, [value(k, 64 << 10) for k in chain]))
    run.rec("put_one", s.put("ev/blk/100", value("ev/blk/100", 4096)))
    run.rec("put_plain", s.put("plain", value("plain", 4096)))
    run.rec("remove_one", s.remove("ev/blk/100"))
    print("READY 1", flush=True)
    sys.stdin.readline()
    late = [f"ev/blk/{i}" for i in range(200, 204)]
    run.rec("put_late", s.put_batch(late, [value(k, 4096) for k in late]))
    run.rec("remove_all", s.remove_all())
    print("READY 2", flush=True)
    sys.stdin.readline()
    # 10 MiB into a 16 MiB pool: over the test's eviction mark.
    big = [f"ev/blk/{i}" for i in range(1000, 1040)]
    run.rec("put_big", s.put_batch(big, [value(k, 256 << 10) for k in big]))
    print("READY 3", flush=True)
    sys.stdin.readline()
    run.rec("exist_big", dict(zip(big, [int(x) for x in s.batch_is_exist(big)])))
    run.rec("close", s.close())
    run.finish()


def vllmkeys(run):
    """Keys as vLLM's MooncakeStoreConnector names them (`PoolKey`): one request's four
    chunks of KV-cache group 0 in one batch put and two of group 1 in another, chunk
    hashes chained as vLLM chains block hashes; a plain key; then the last chunk of group
    0 removed. Ends with "READY 1" and waits for a line on stdin."""
    s = run.s
    run.setup(16 * MiB)
    prefix = "Qwen/Qwen3-8B@tp_rank:0@pcp0@dcp0@pp_rank:0"

    def chain(seed, n):
        out, h = [], b""
        for i in range(n):
            h = hashlib.sha256(h + f"{seed}/{i}".encode()).digest()
            out.append(h.hex())
        return out

    groups = {0: chain("request", 4), 1: chain("request-window", 2)}
    keys = {g: [f"{prefix}@group:{g}@{h}" for h in hs] for g, hs in groups.items()}
    run.rec("hashes", {str(g): hs for g, hs in groups.items()})
    for g, ks in keys.items():
        run.rec(f"put{g}", s.put_batch(ks, [value(k, 64 << 10) for k in ks]))
    run.rec("put_plain", s.put("plain", value("plain", 4096)))
    run.rec("remove", s.remove(keys[0][3]))
    print("READY 1", flush=True)
    sys.stdin.readline()
    run.rec("close", s.close())
    run.finish()


def fleetfill(run):
    """One client per moongate of a fleet (`--masters`, comma-separated), all in this
    process (a Mooncake client per thread of work would cost a process each), each
    mounting `--segment-mib`. Commands on stdin, each answered with a READY line:
      put PREFIX BYTES SIZE [I,J,...|all [FIRST]]
                              fresh keys PREFIX<FIRST>, PREFIX<FIRST+1>, ... (FIRST 0 by
                              default) of SIZE bytes through the clients in turn (or
                              clients I, J, ... only) until BYTES are written
                              ({"puts": n, "bad": [rc, ...]})
      exist PREFIX N          how many of PREFIX0..PREFIX(N-1) exist ({"found": n})
      check PREFIX N SIZE I   reads PREFIX0..PREFIX(N-1) through client I: how many came
                              back, and how many of those were not what was put
                              ({"found": n, "wrong": n})
      close                   close every client and exit"""
    a = run.args
    stores = []
    for m in a.masters.split(","):
        s = MooncakeDistributedStore()
        rc = s.setup("127.0.0.1", a.metadata, a.segment_mib * MiB, 16 * MiB, "tcp", "", m)
        run.rec("setup", rc)
        if rc != 0:
            run.finish()
            raise SystemExit(f"setup through {m} failed: {rc}")
        stores.append(s)
    print(f"READY {len(stores)}", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if len(cmd) == 3 and cmd[0] == "exist":
            keys = [f"{cmd[1]}{i}" for i in range(int(cmd[2]))]
            found = sum(1 for e in stores[0].batch_is_exist(keys) if e == 1)
            print("READY " + json.dumps({"found": found}), flush=True)
            continue
        if len(cmd) == 5 and cmd[0] == "check":
            size, via = int(cmd[3]), stores[int(cmd[4])]
            found = wrong = 0
            for i in range(int(cmd[2])):
                k = f"{cmd[1]}{i}"
                v = via.get(k)
                if len(v):
                    found += 1
                    wrong += bytes(v) != value(k, size)
            print("READY " + json.dumps({"found": found, "wrong": wrong}), flush=True)
            continue
        if len(cmd) not in (4, 5, 6) or cmd[0] != "put":
            break
        prefix, total, size = cmd[1], int(cmd[2]), int(cmd[3])
        through = stores
        if len(cmd) >= 5 and cmd[4] != "all":
            through = [stores[int(i)] for i in cmd[4].split(",")]
        first = int(cmd[5]) if len(cmd) == 6 else 0
        bad, n = [], 0
        while n * size < total:
            s = through[n % len(through)]
            k = f"{prefix}{first + n}"
            rc = s.put(k, value(k, size))
            if rc != 0:
                bad.append(rc)
            n += 1
        print("READY " + json.dumps({"puts": n, "bad": bad}), flush=True)
    for s in stores:
        run.rec("close", s.close())
    run.finish()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--role", required=True,
                   choices=["owner", "reader", "idle", "loop", "demo", "hold", "place", "disk", "steer", "bulk", "chains", "kvpeer", "guest",
                            "diskget", "failover", "misses", "events", "steps", "vllmkeys",
                            "fleetfill"])
    p.add_argument("--master", required=True)
    p.add_argument("--metadata", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--owner-host", default="")
    p.add_argument("--idle", type=float, default=20.0)
    p.add_argument("--prefix", default="k/")
    p.add_argument("--count", type=int, default=10)
    p.add_argument("--segment-mib", type=int, default=16,
                   help="steps, fleetfill: memory to mount (per client)")
    p.add_argument("--masters", default="", help="fleetfill: one client per address")
    p.add_argument("--pause-ms", type=float, default=0.0,
                   help="loop: pause between iterations (a neighbour, not a load test)")
    a = p.parse_args()
    run = Run(a)
    {"owner": owner, "reader": reader, "idle": idle, "loop": loop, "demo": demo,
     "hold": hold, "place": place, "disk": disk, "steer": steer, "bulk": bulk, "chains": chains, "kvpeer": kvpeer, "guest": guest,
     "diskget": diskget, "failover": failover, "misses": misses,
     "events": events, "steps": steps, "vllmkeys": vllmkeys,
     "fleetfill": fleetfill}[a.role](run)


if __name__ == "__main__":
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    main()

#!/usr/bin/env python3
"""vLLM's owner-client topology, played with the real Mooncake client.

Roles (one process each; all take --master, the address the client is given as its
master, and --metadata):

  writer    a requester-only rank (global_segment_size = 0) that puts --keys values of
            --size bytes under --prefix into the owner's pool, retrying a put the master
            refuses for lack of room; exits with its counts.
  reader    a requester-only rank that takes commands on stdin, one per line, and
            answers each with a line "READY <json>":
              read FIRST COUNT BATCH   vLLM's load with its tier log on: per batch,
                                       batch_get_replica_desc then get() of each key;
                                       bytes checked; the client's own offload-read count
              exist FIRST COUNT        batch_is_exist of the keys, as vLLM's scheduler asks
              load FIRST COUNT         batch_get_into of the keys (the load after a hit);
                                       the client's own offload-read count
              quit                     writes --out and exits
  dummy     a dummy client of the owner (setup_dummy): reads --keys keys, checks bytes.

Values are the key's SHA-256 repeated (tests/all/support.rs::value_of).
"""
import argparse
import ctypes
import hashlib
import json
import sys
import time

from mooncake.store import MooncakeDistributedStore


def value_of(key, size):
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def key(prefix, i):
    return f"{prefix}/{i:04d}"


def rank(args):
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", args.metadata, 0, 64 << 20, "tcp", "", args.master)
    if rc != 0:
        raise SystemExit(f"setup failed: {rc}")
    return s


def writer(args):
    s = rank(args)
    stored, retries, failed = 0, 0, 0
    for i in range(args.keys):
        k = key(args.prefix, i)
        v = value_of(k, args.size)
        for attempt in range(50):
            rc = s.put(k, v)
            if rc == 0:
                stored += 1
                break
            retries += 1
            time.sleep(0.2)
        else:
            failed += 1
        if args.pace_ms:
            time.sleep(args.pace_ms / 1000)
    s.close()
    return {"stored": stored, "retries": retries, "failed": failed}


def classify(desc):
    kinds = []
    for r in desc:
        if r.is_memory_replica():
            kinds.append("memory")
        elif hasattr(r, "is_local_disk_replica") and r.is_local_disk_replica():
            kinds.append("local_disk")
        else:
            kinds.append("other")
    return kinds


def read_pass(s, args, first, count, batch):
    out = {"memory_first": 0, "local_disk_first": 0, "missing": 0, "exact": 0,
           "empty": 0, "corrupt": 0, "keys": {}}
    before = s.get_offload_rpc_read_count()
    keys = [key(args.prefix, i) for i in range(first, first + count)]
    for at in range(0, len(keys), batch):
        part = keys[at:at + batch]
        descs = s.batch_get_replica_desc(part)
        for k in part:
            kinds = classify(descs.get(k, []))
            first_kind = kinds[0] if kinds else "missing"
            out["keys"][k] = kinds
            if first_kind == "memory":
                out["memory_first"] += 1
            elif first_kind == "local_disk":
                out["local_disk_first"] += 1
            else:
                out["missing"] += 1
            v = s.get(k)
            if len(v) == 0:
                out["empty"] += 1
            elif v == value_of(k, args.size):
                out["exact"] += 1
            else:
                out["corrupt"] += 1
    out["offload_reads"] = s.get_offload_rpc_read_count() - before
    return out


def exist_pass(s, args, first, count):
    keys = [key(args.prefix, i) for i in range(first, first + count)]
    return {"exists": list(s.batch_is_exist(keys))}


def load_pass(s, args, first, count):
    keys = [key(args.prefix, i) for i in range(first, first + count)]
    buf = ctypes.create_string_buffer(args.size * len(keys))
    base = ctypes.addressof(buf)
    if s.register_buffer(base, len(buf)) != 0:
        raise SystemExit("register_buffer failed")
    ptrs = [base + i * args.size for i in range(len(keys))]
    before = s.get_offload_rpc_read_count()
    t0 = time.perf_counter()
    got = s.batch_get_into(keys, ptrs, [args.size] * len(keys))
    elapsed = time.perf_counter() - t0
    offload_reads = s.get_offload_rpc_read_count() - before
    exact, failed, corrupt = 0, 0, 0
    for i, (k, n) in enumerate(zip(keys, got)):
        if n < 0:
            failed += 1
        elif ctypes.string_at(ptrs[i], n) == value_of(k, args.size):
            exact += 1
        else:
            corrupt += 1
    s.unregister_buffer(base)
    return {"results": list(got), "exact": exact, "failed": failed, "corrupt": corrupt,
            "offload_reads": offload_reads, "elapsed_s": elapsed}


def reader(args):
    s = rank(args)
    log = []
    print("READY reader", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "quit":
            break
        nums = [int(w) for w in words[1:]]
        if words[0] == "read":
            r = read_pass(s, args, *nums)
        elif words[0] == "exist":
            r = exist_pass(s, args, *nums)
        elif words[0] == "load":
            r = load_pass(s, args, *nums)
        else:
            r = {"error": f"unknown command {words[0]}"}
        log.append(r)
        print("READY " + json.dumps(r), flush=True)
    s.close()
    return {"steps": len(log)}


def dummy(args):
    s = MooncakeDistributedStore()
    rc = s.setup_dummy(64 << 20, 16 << 20, args.owner)
    if rc != 0:
        raise SystemExit(f"setup_dummy failed: {rc}")
    exact, empty, corrupt = 0, 0, 0
    for i in range(args.first, args.first + args.keys):
        k = key(args.prefix, i)
        v = s.get(k)
        if len(v) == 0:
            empty += 1
        elif v == value_of(k, args.size):
            exact += 1
        else:
            corrupt += 1
    s.close()
    return {"exact": exact, "empty": empty, "corrupt": corrupt}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--role", required=True, choices=["writer", "reader", "dummy"])
    p.add_argument("--master", default="")
    p.add_argument("--metadata", default="")
    p.add_argument("--owner", default="")
    p.add_argument("--out", required=True)
    # `PREFIX/blk/N`: the default policy names such keys as blocks for KV events.
    p.add_argument("--prefix", default="ot/blk")
    p.add_argument("--keys", type=int, default=200)
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--size", type=int, default=1 << 20)
    p.add_argument("--pace-ms", type=int, default=0, help="writer: pause between puts")
    args = p.parse_args()
    result = {"writer": writer, "reader": reader, "dummy": dummy}[args.role](args)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Steady traffic through every member of a fleet, for benches/fleet_scale.py: one real
Mooncake client per moongate (all in this process, 16 MiB segment each), each step a put
of a fresh 64 KiB key through one member and a get of an earlier key through another
(so access records travel: a key's home is rarely the member a call went through).
Paced to --ops steps per second until stdin closes or --seconds pass; prints one JSON
line with what it did (puts and gets that failed, reads that came back wrong)."""
import argparse
import hashlib
import json
import os
import random
import sys
import threading
import time

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
from mooncake.store import MooncakeDistributedStore  # noqa: E402

MiB = 1 << 20


def value(key, size):
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--masters", required=True, help="comma-separated moongate addresses")
    p.add_argument("--metadata", required=True)
    p.add_argument("--ops", type=float, default=200)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--size", type=int, default=64 << 10)
    a = p.parse_args()
    stores = []
    for m in a.masters.split(","):
        s = MooncakeDistributedStore()
        rc = s.setup("127.0.0.1", a.metadata, 16 * MiB, 16 * MiB, "tcp", "", m)
        if rc != 0:
            raise SystemExit(f"setup through {m}: {rc}")
        stores.append(s)
    print("READY", flush=True)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    rng = random.Random(7)
    out = {"steps": 0, "put_failed": 0, "get_missed": 0, "get_wrong": 0}
    t0 = time.monotonic()
    while not stop.is_set() and time.monotonic() - t0 < a.seconds:
        n = out["steps"]
        k = f"t/{n}"
        if stores[n % len(stores)].put(k, value(k, a.size)) != 0:
            out["put_failed"] += 1
        if n:
            old = f"t/{rng.randrange(max(0, n - 2000), n)}"
            got = stores[rng.randrange(len(stores))].get(old)
            if len(got) == 0:
                out["get_missed"] += 1  # evicted: the pool is smaller than the writes
            elif bytes(got) != value(old, a.size):
                out["get_wrong"] += 1
        out["steps"] = n + 1
        ahead = out["steps"] / a.ops - (time.monotonic() - t0)
        if ahead > 0:
            time.sleep(ahead)
    out["seconds"] = time.monotonic() - t0
    print(json.dumps(out), flush=True)
    for s in stores:
        s.close()


if __name__ == "__main__":
    main()

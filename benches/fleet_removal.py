#!/usr/bin/env python3
"""How long another fleet member keeps serving a force-removed key from its replica
cache: the window `docs/kv-api.md` ("The replica cache") leaves between a forced
removal relayed by one member and the others hearing it through etcd.

Two moongates, `a` and `b`, in one fleet (Debian's etcd-server), one mooncake_master;
`b` also runs the kv face with a 60 s replica cache (so without the fleet's word a
removed key would be served for up to a minute). A real Mooncake client goes through
`a`. Each of --rounds rounds: put a fresh 5000-byte key through `a`, read it twice
through `b`'s kv face (the second read comes from the cache), remove it with force
through `a`, then read it through `b` on one kept-alive connection until it answers
404. Reports, from the removal's answer: the time until `b` answers 404 and how many
reads it answered 200 meanwhile (each a read of freed memory, the bytes the cache is
there to save a round trip for), as percentiles over the rounds.

  python benches/fleet_removal.py --moongate target/release/moongate [--rounds 200]
"""
import argparse
import http.client
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import (free_port, master_cmd, pct, run, start_etcd, start_moongate,  # noqa: E402
                      stop_all, wait_http, work_dir)

MiB = 1 << 20


def get(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--moongate", default="target/release/moongate")
    p.add_argument("--rounds", type=int, default=200)
    a = p.parse_args()
    if not shutil.which("etcd"):
        raise SystemExit("needs Debian's etcd-server (scripts/bootstrap.sh installs it)")
    work = work_dir("moongate-fleet-removal-")
    procs = []
    try:
        etcd = start_etcd(work, procs)
        rpc, meta_port = free_port(), free_port()
        metadata = f"http://127.0.0.1:{meta_port}/metadata"
        # A long read lease: b's reads lease the key, so only a forced removal takes it.
        procs.append(subprocess.Popen(master_cmd(rpc, meta_port) + ["--default_kv_lease_ttl=120000"],
                                      stdout=open(f"{work}/master.log", "w"),
                                      stderr=subprocess.STDOUT))
        kv = f"127.0.0.1:{free_port()}"
        members = {}
        for name, extra in (("a", ""), ("b", f"[kv]\nlisten = \"{kv}\"\nmetadata_url = "
                                              f"\"{metadata}\"\nreplica_cache_ms = 60000\n")):
            _, url, listen = start_moongate(
                a.moongate, work, name,
                f"[master_face]\nupstream = \"127.0.0.1:{rpc}\"\n{extra}"
                f"[fleet]\nenabled = true\netcd = \"{etcd}\"\ncluster = \"bench\"\n"
                f"member = \"{name}\"\n", procs)
            members[name] = (url, listen)
        for url, _ in members.values():
            wait_http(f"{url}/ready")
        end = time.monotonic() + 30
        while any(len(json.loads(get(f"{u}/fleet"))["members"]) != 2 for u, _ in members.values()):
            if time.monotonic() > end:
                raise SystemExit(f"the members did not see each other; see {work}")
            time.sleep(0.05)

        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        from mooncake.store import MooncakeDistributedStore
        s = MooncakeDistributedStore()
        if s.setup("127.0.0.1", metadata, 64 * MiB, 16 * MiB, "tcp", "", members["a"][1]):
            raise SystemExit(f"client setup failed; see {work}")
        host, port = kv.split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)

        def read(key):
            conn.request("GET", "/v1/kv/" + urllib.parse.quote(key, safe=""))
            r = conn.getresponse()
            r.read()
            return r.status

        windows, stale, gaps = [], [], []
        for i in range(a.rounds):
            key = f"rm/{i}"
            if s.put(key, os.urandom(5000)) != 0:
                raise SystemExit(f"put {key} failed; see {work}")
            if read(key) != 200 or read(key) != 200:
                raise SystemExit(f"b did not read {key}; see {work}")
            if s.remove(key, True) != 0:
                raise SystemExit(f"forced remove {key} failed; see {work}")
            t1 = time.monotonic()
            n, last = 0, t1
            while (st := read(key)) == 200:
                n += 1
                now = time.monotonic()
                gaps.append(now - last)
                last = now
                if now - t1 > 30:
                    raise SystemExit(f"b served {key} for 30 s after its removal; see {work}")
            if st != 404:
                raise SystemExit(f"b answered {st} for removed {key}; see {work}")
            windows.append(time.monotonic() - t1)
            stale.append(n)
        conn.close()
        s.close()
        told = get(f"{members['a'][0]}/metrics")
        heard = get(f"{members['b'][0]}/metrics")

        def metric(text, name):
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith(name + " ") or line.startswith(name + "{"))

        ms = [w * 1000 for w in windows]
        print(f"{a.rounds} forced removals through a, read through b's kv face (60 s replica "
              f"cache): b answered 404 after p50 {pct(ms, 0.5):.2f} ms, p99 {pct(ms, 0.99):.2f}"
              f" ms, max {max(ms):.2f} ms from the removal's answer; reads answered 200 in "
              f"between: p50 {pct(stale, 0.5)}, p99 {pct(stale, 0.99)}, max {max(stale)} "
              f"(one read every {pct(gaps, 0.5) * 1e6:.0f} us); told "
              f"{metric(told, 'moongate_fleet_removals_told_total'):.0f}, heard "
              f"{metric(heard, 'moongate_fleet_removals_heard_total'):.0f}", flush=True)
    finally:
        stop_all(procs)


if __name__ == "__main__":
    run(main)

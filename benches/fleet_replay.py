#!/usr/bin/env python3
"""A fleet's hit rate, live: the shipped trace replayed by 4 ranks (real Mooncake
clients, 16 MiB segment each: a 64 MiB pool; 16 KiB blocks) with random routing and
`[eviction]` at 0.8 / 0.7, in three shapes, each in its own master:

  one       every rank through one moongate (the single-evictor reference)
  sidecars  each rank through its own moongate, `[fleet]` off (partial views)
  fleet     each rank through its own moongate, `[fleet]` on with access records

and prints each one's hit rate (reads checked byte-exact). --runs repeats the three,
interleaved, since live hit rates move by a point between runs.

  python benches/fleet_replay.py --moongate target/release/moongate [--speed 20] \
      [--limit 0] [--runs 1] [--shapes one,sidecars,fleet]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import (free_port, master_cmd, run, start_etcd, start_moongate,  # noqa: E402
                      stop_all, wait_http, work_dir)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANKS = 4


def shape(a, name, work):
    procs = []
    try:
        etcd = start_etcd(work, procs) if name == "fleet" else None
        rpc, http = free_port(), free_port()
        mcmd = master_cmd(rpc, http)
        mport = next(x.split("=", 1)[1] for x in mcmd if x.startswith("--metrics_port="))
        procs.append(subprocess.Popen(mcmd, stdout=open(f"{work}/master-{name}.log", "w"),
                                      stderr=subprocess.STDOUT))
        # Bound before any other port is picked: free_port could hand its port out again.
        wait_http(f"http://127.0.0.1:{mport}/metrics", 30)
        listens, admins = [], []
        for i in range(1 if name == "one" else RANKS):
            fleet = ""
            if etcd:
                fleet = (f"[fleet]\nenabled = true\netcd = \"{etcd}\"\ncluster = \"replay\"\n"
                         f"member = \"m{i}\"\nrecords = {a.records}\n")
            _, admin, listen = start_moongate(
                a.moongate, work, f"{name}-m{i}",
                f"[master_face]\nupstream = \"127.0.0.1:{rpc}\"\n"
                f"[eviction]\nenabled = true\n"
                f"master_metrics_url = \"http://127.0.0.1:{mport}/metrics\"\n"
                f"high_watermark = 0.8\nlow_watermark = 0.7\ninterval_ms = 100\n{fleet}", procs)
            wait_http(f"{admin}/ready", 60)
            listens.append(listen)
            admins.append(admin)
        out = f"{work}/{name}.json"
        cmd = [sys.executable, os.path.join(ROOT, "benches/replay.py"),
               "--trace", os.path.join(ROOT, "benches/traces/mooncake_fast25_synthetic.jsonl"),
               "--master", ",".join(listens), "--metadata", f"http://127.0.0.1:{http}/metadata",
               "--master-metrics", f"http://127.0.0.1:{mport}/metrics",
               "--workers-per-arm", str(RANKS), "--segment-mib", "16", "--value-size", "16384",
               "--route", "random", "--speed", str(a.speed), "--json", out]
        if a.limit:
            cmd += ["--limit", str(a.limit)]
        r = subprocess.run(cmd, stdout=open(f"{work}/{name}-replay.log", "w"),
                           stderr=subprocess.STDOUT)
        if r.returncode != 0:
            raise SystemExit(f"{name}: the replay failed; see {work}/{name}-replay.log")
        # What each moongate and the master counted by the end, for reading a gap
        # afterwards (MOONGATE_KEEP_WORK=1 keeps them).
        for i, admin in enumerate(admins):
            with open(f"{work}/{name}-m{i}.metrics", "w") as f:
                f.write(urllib.request.urlopen(f"{admin}/metrics").read().decode())
        with open(f"{work}/master-{name}.metrics", "w") as f:
            f.write(urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics").read().decode())
        return json.load(open(out))
    finally:
        stop_all(procs)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--moongate", default="target/release/moongate")
    p.add_argument("--speed", type=float, default=20)
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--shapes", default="one,sidecars,fleet")
    p.add_argument("--records", choices=["true", "false"], default="true",
                   help="the fleet shape's access records")
    a = p.parse_args()
    if "fleet" in a.shapes and not shutil.which("etcd"):
        raise SystemExit("needs Debian's etcd-server (scripts/bootstrap.sh installs it)")
    work = work_dir("moongate-fleet-replay-")
    rows = {}
    for run_i in range(a.runs):
        for name in a.shapes.split(","):
            rep = shape(a, name, work)
            arm = rep["arms"]["all"]
            rows.setdefault(name, []).append(arm["hit_rate"])
            print(f"run {run_i + 1} {name:>8}: hit rate {arm['hit_rate']:.4f} "
                  f"(corrupt {arm['corrupt']}, master evicted {rep['master']['evicted_keys']:.0f} "
                  f"keys, usage mean {rep['master']['usage_mean']}), {rep['wall_s']} s", flush=True)
    for name, v in rows.items():
        print(f"{name:>8}: {', '.join(f'{x:.4f}' for x in v)}; mean {sum(v) / len(v):.4f}")


if __name__ == "__main__":
    run(main)

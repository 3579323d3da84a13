#!/usr/bin/env python3
"""Hints on parts of a trace they were not tuned on, and on the same requests with time
stretched: `moongate sim` over the tuning part (the first half of the requests), the
evaluation part (the second half), and both stretched 10x and 60x (timestamps scaled:
a policy whose gains vanish when time stretches is tuned to a clock).

Per part, stretch and capacity: LRU, Belady and `hint-lru` under each hint SPEC, with
the share of the LRU-to-Belady gap it closes. Not CI (docs/policy-science.md keeps the
figures).

    python3 benches/hints_heldout.py [--moongate target/release/moongate]
        [--trace benches/traces/mooncake_fast25_synthetic.jsonl] [--json OUT]
        [--specs 'queue:64,last:0.5;last:1;...'] [--stretches 1,10,60]
        [--plugin hint-lru | PATH.wasm]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

SPECS = ["", "queue:64,last:0.5", "last:1", "last:0.5,wrong:0.05",
         "queue:64,last:0.5,wrong:0.05", "queue:256,last:1",
         "queue:64,last:0.5,ttl:60000"]


def parts(path, work, stretches):
    """(part, stretch, file) for the tuning and evaluation halves at each stretch."""
    with open(path) as f:
        rows = [json.loads(l) for l in f if l.strip()]
    half = len(rows) // 2
    out = []
    for name, rs in (("tuning", rows[:half]), ("evaluation", rows[half:])):
        for k in stretches:
            p = os.path.join(work, f"{name}_x{k}.jsonl")
            with open(p, "w") as f:
                for r in rs:
                    r = dict(r)
                    r["timestamp"] = int(r.get("timestamp", 0) * k)
                    f.write(json.dumps(r) + "\n")
            out.append((name, k, p))
    return out


def run(mg, trace, spec, capacity, work, policy="hint-lru"):
    j = os.path.join(work, "r.json")
    cmd = [mg, "sim", "--trace", trace, "--capacity", capacity, "--policy", policy,
           "--json", j] + (["--hints", spec] if spec else [])
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)}: {r.stderr}")
    rows = {}
    for x in json.load(open(j))["results"]:
        c = round(x["capacity_fraction"], 4)
        rows.setdefault(c, {})["lru" if x["policy"] == "lru" else "opt" if x["policy"] == "opt"
                               else "hint"] = x["hits"] / max(x["lookups"], 1)
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--moongate", default=os.path.join(ROOT, "target/release/moongate"))
    p.add_argument("--trace", default=os.path.join(HERE, "traces/mooncake_fast25_synthetic.jsonl"))
    p.add_argument("--capacity", default="5%,10%")
    p.add_argument("--stretches", default="1,10,60")
    p.add_argument("--specs", default=";".join(SPECS))
    p.add_argument("--plugin", default="hint-lru",
                   help="the plugin under test: a name built into target/plugins or a .wasm path")
    p.add_argument("--json")
    a = p.parse_args()
    stretches = [int(x) for x in a.stretches.split(",")]
    specs = a.specs.split(";")
    results = []
    with tempfile.TemporaryDirectory(prefix="moongate-heldout-") as work:
        for part, k, path in parts(a.trace, work, stretches):
            for spec in specs:
                for cap, r in sorted(run(a.moongate, path, spec, a.capacity, work,
                                         a.plugin).items()):
                    gap = (r["hint"] - r["lru"]) / (r["opt"] - r["lru"]) if r["opt"] > r["lru"] else 0.0
                    results.append({"part": part, "stretch": k, "hints": spec or "none",
                                    "capacity_fraction": cap, "lru": r["lru"], "opt": r["opt"],
                                    "hint_lru": r["hint"], "gap_closed": gap})
    print(f"{'part':>10} {'x':>3} {'hints':>30} {'cap':>5} {'lru':>7} {'belady':>7} "
          f"{'hint-lru':>8} {'gap':>7}")
    for x in results:
        print(f"{x['part']:>10} {x['stretch']:>3} {x['hints']:>30} {100 * x['capacity_fraction']:4.0f}% "
              f"{x['lru']:7.4f} {x['opt']:7.4f} {x['hint_lru']:8.4f} {100 * x['gap_closed']:+6.1f}%")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"trace": a.trace, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Cost of each decision point on the master face, against relay-only, in one run.

One mooncake_master, one owner process with a 1 GiB segment, and side by side on the
same master:
  relay      a bare tokio byte relay (examples/bare_relay): the floor of any hop
  default    moongate with the embedded default policy (decode, tally, on-put admit)
  on-put     moongate + tier-placement with a rule that rewrites every put's config
             (on-put decision + re-encode)
  on-lookup  moongate + lru (on-lookup reorders replica lists: memory first)
  split      moongate with master_face.max_batch_keys = 1000 (5,000-key batches go
             upstream as 5 parts, merged into one reply)
The same real-client workload runs against each side, rounds rotated, --rounds times;
the table gives the median over rounds of each side's p50 and its ratio to relay.

  python benches/decisions.py --moongate target/release/moongate \
      --relay target/release/examples/bare_relay --plugins target/plugins
(`benches/run_decisions.sh` builds release binaries and runs this.)
"""
import argparse
import json
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


def role_owner(a):
    run_owner(a.master, a.metadata, 1024 * MiB)


def role_client(a):
    from mooncake.store import MooncakeDistributedStore
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", a.metadata, 0, 64 * MiB, "tcp", "", a.master)
    if rc:
        raise SystemExit(f"client setup {rc}")
    t = a.tag
    small = [f"{t}/s{i}" for i in range(64)]
    big = [f"{t}/b{i}" for i in range(5000)]
    # Small batches: 0.3.13's put_batch of thousands of keys into another process's
    # segment loses some to TRANSFER_FAIL (seen with and without moongate).
    for part in [small] + [big[i:i + 100] for i in range(0, len(big), 100)]:
        rc = s.put_batch(part, [b"v" * 64] * len(part))
        if rc != 0:
            rc = s.put_batch(part, [b"v" * 64] * len(part))
        assert rc == 0, rc
    n = a.iterations
    seq = iter(range(10 ** 9))
    ops = {
        "put_4KiB": (n, lambda: s.put(f"{t}/p{next(seq)}", b"x" * 4096)),
        "get_replica_desc": (n, lambda: s.get_replica_desc(small[0])),
        "batch_is_exist_64": (n, lambda: s.batch_is_exist(small)),
        "batch_is_exist_5000": (max(20, n // 20), lambda: s.batch_is_exist(big)),
        "batch_replica_desc_5000": (max(20, n // 20), lambda: s.batch_get_replica_desc(big)),
    }
    out = {}
    for name, (count, fn) in ops.items():
        for _ in range(min(20, count)):
            fn()
        lat = []
        for _ in range(count):
            t0 = time.perf_counter_ns()
            fn()
            lat.append(time.perf_counter_ns() - t0)
        out[name] = pct(lat, 0.5) / 1e3
    s.close()
    with open(a.out, "w") as f:
        json.dump(out, f)


SIDES = ["relay", "default", "on-put", "on-lookup", "split"]


def config_for(side, plugins):
    if side == "on-put":
        rule = '{"rules": [{"key_prefix": "", "soft_pin_ttl_ms": 60000}]}'
        return (f'[policy]\nactive = "tp"\n[[policy.plugins]]\nname = "tp"\n'
                f'path = "{plugins}/tier-placement.wasm"\nconfig = \'\'\'{rule}\'\'\'\n')
    if side == "on-lookup":
        return (f'[policy]\nactive = "lru"\n[[policy.plugins]]\nname = "lru"\n'
                f'path = "{plugins}/lru.wasm"\n')
    if side == "split":
        return "[master_face]\nmax_batch_keys = 1000\n"
    return ""


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--role", default="driver")
    p.add_argument("--master")
    p.add_argument("--metadata")
    p.add_argument("--out")
    p.add_argument("--tag", default="b")
    p.add_argument("--iterations", type=int, default=1000)
    p.add_argument("--moongate", default="target/release/moongate")
    p.add_argument("--relay", default="target/release/examples/bare_relay")
    p.add_argument("--plugins", default="target/plugins")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--baseline", default="",
                   help="a second moongate binary (e.g. an earlier commit's release build): "
                        "every moongate side also runs on it, as SIDE@base, in the same run")
    p.add_argument("--json")
    a = p.parse_args()
    if a.role == "owner":
        return role_owner(a)
    if a.role == "client":
        return role_client(a)

    work = work_dir("moongate-decisions-")
    rpc, http = free_port(), free_port()
    metadata = f"http://127.0.0.1:{http}/metadata"
    plugins = os.path.abspath(a.plugins)
    procs = []
    addr = {}
    sides = list(SIDES) + ([f"{x}@base" for x in SIDES if x != "relay"] if a.baseline else [])
    try:
        procs.append(subprocess.Popen(
            master_cmd(rpc, http),
            stdout=open(f"{work}/master.log", "w"), stderr=subprocess.STDOUT))
        for side in sides:
            port = free_port()
            addr[side] = f"127.0.0.1:{port}"
            if side == "relay":
                procs.append(subprocess.Popen(
                    [a.relay, addr[side], f"127.0.0.1:{rpc}"],
                    stdout=open(f"{work}/relay.log", "w"), stderr=subprocess.STDOUT))
                continue
            admin = f"127.0.0.1:{free_port()}"
            cfg = f"{work}/{side}.toml"
            with open(cfg, "w") as f:
                f.write(config_for(side.removesuffix("@base"), plugins))
            binary = a.baseline if side.endswith("@base") else a.moongate
            procs.append(subprocess.Popen(
                [binary, "run", "--config", cfg, "--listen", addr[side],
                 "--upstream", f"127.0.0.1:{rpc}", "--admin", admin],
                stdout=open(f"{work}/{side}.log", "w"), stderr=subprocess.STDOUT,
                env={**os.environ, "RUST_LOG": "warn"}))
            wait_http(f"http://{admin}/ready")
        owner = spawn_owner(__file__, f"127.0.0.1:{rpc}", metadata, work)
        procs.append(owner)
        runs = {side: [] for side in sides}
        for i in range(a.rounds):
            order = sides[i % len(sides):] + sides[:i % len(sides)]
            for side in order:
                out = f"{work}/{side}{i}.json"
                subprocess.run(
                    [sys.executable, __file__, "--role", "client", "--master", addr[side],
                     "--metadata", metadata, "--out", out, "--tag", f"{side}{i}",
                     "--iterations", str(a.iterations)],
                    check=True, stderr=open(f"{work}/client-{side}{i}.log", "w"))
                runs[side].append(json.load(open(out)))
                print(f"round {i + 1}/{a.rounds} {side} done", file=sys.stderr, flush=True)
        owner.stdin.close()
        owner.wait(timeout=30)
    finally:
        stop_all(procs)

    med = {side: {op: statistics.median(r[op] for r in runs[side]) for op in runs[side][0]}
           for side in sides}
    ops = list(med["relay"])
    print(f"\np50 latency (us), median over {a.rounds} rounds; ratio to relay in brackets")
    print(f"{'op':<24}" + "".join(f"{s:>18}" for s in sides))
    for op in ops:
        r = med["relay"][op]
        print(f"{op:<24}" + "".join(
            f"{med[s][op]:>9.1f} [{med[s][op] / r:>5.2f}]" for s in sides))
    for op in ("batch_is_exist_5000", "batch_replica_desc_5000"):
        print(f"split/unsplit {op}: {med['split'][op] / med['default'][op]:.3f}")
    if a.baseline:
        print("\nthis build / baseline build, p50 (median over rounds); < 1 is faster")
        print(f"{'op':<24}" + "".join(f"{x:>12}" for x in SIDES if x != "relay"))
        for op in ops:
            print(f"{op:<24}" + "".join(
                f"{med[x][op] / med[x + '@base'][op]:>12.3f}" for x in SIDES if x != "relay"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"median_p50_us": med, "rounds": a.rounds, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    run(main)

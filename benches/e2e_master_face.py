#!/usr/bin/env python3
"""End-to-end cost of the master face: the same real-Mooncake-client workload run
directly against mooncake_master and through moongate, alternating, N pairs, in one run.

Prints, per operation, the median over pairs of each side's p50/p99 (latency) or GB/s
(throughput), the ratio moongate/direct, and for latency the added microseconds.

Setup (all real processes on loopback): one mooncake_master; moongate in front of it;
an owner process that mounts a 1 GiB segment directly on the master; a measuring
client that mounts an empty segment, so every put/get moves bytes over the transfer
engine's TCP path to the owner (never through moongate: only metadata RPCs do).

  python benches/e2e_master_face.py --moongate target/release/moongate --pairs 3
(`benches/run_e2e.sh` builds the release binary and runs this.)
"""
import argparse
import ctypes
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


# --------------------------------------------------------------------------- roles
def role_owner(a):
    run_owner(a.master, a.metadata, 1024 * MiB)


def role_client(a):
    from mooncake.store import MooncakeDistributedStore
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", a.metadata, 0, 64 * MiB, "tcp", "", a.master)
    if rc:
        raise SystemExit(f"client setup {rc}")
    tag = a.tag
    out = {}
    # metadata: keys exist (put once), then timed loops
    keys = [f"{tag}/m{i}" for i in range(64)]
    for k in keys:
        assert s.put(k, b"v" * 64) == 0
    n = a.iterations

    ops = {
        "is_exist": lambda: s.is_exist(keys[0]),
        "batch_is_exist_64": lambda: s.batch_is_exist(keys),
        "get_replica_desc": lambda: s.get_replica_desc(keys[1]),
    }
    # Interleave the ops in rounds so none always runs first (the first timed loop of a
    # process was measured slower whatever the op).
    rounds = 4
    samples = {name: [] for name in ops}
    for fn in ops.values():
        for _ in range(50):
            fn()
    for r in range(rounds):
        names = list(ops)
        names = names[r % len(names):] + names[:r % len(names)]
        for name in names:
            fn = ops[name]
            for _ in range(n // rounds):
                t0 = time.perf_counter_ns()
                fn()
                samples[name].append(time.perf_counter_ns() - t0)
    for name, t in samples.items():
        out[name] = {"p50_us": pct(t, 0.5) / 1e3, "p99_us": pct(t, 0.99) / 1e3}
    s.batch_remove(keys, True)

    buf = (ctypes.c_char * (16 * MiB))()
    addr = ctypes.addressof(buf)
    ctypes.memset(addr, 0x5A, 16 * MiB)
    assert s.register_buffer(addr, 16 * MiB) == 0
    for size, count in ((1 * MiB, 256), (16 * MiB, 24)):
        label = f"{size // MiB}MiB"
        ks = [f"{tag}/d{label}/{i}" for i in range(count)]
        t0 = time.perf_counter()
        for k in ks:
            rc = s.put_from(k, addr, size)
            assert rc == 0, rc
        dt = time.perf_counter() - t0
        out[f"put_{label}"] = {"GBps": size * count / dt / 1e9}
        t0 = time.perf_counter()
        for k in ks:
            got = s.get_into(k, addr, size)
            assert got == size, got
        dt = time.perf_counter() - t0
        out[f"get_into_{label}"] = {"GBps": size * count / dt / 1e9}
        s.batch_remove(ks, True)
    s.unregister_buffer(addr)
    s.close()
    with open(a.out, "w") as f:
        json.dump(out, f)


# --------------------------------------------------------------------------- driver
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--role", default="driver")
    p.add_argument("--master")
    p.add_argument("--metadata")
    p.add_argument("--out")
    p.add_argument("--tag", default="b")
    p.add_argument("--iterations", type=int, default=2000)
    p.add_argument("--moongate", default="target/release/moongate")
    p.add_argument("--moongate-config", default="",
                   help="config file for moongate (e.g. to try runtime.worker_threads)")
    p.add_argument("--relay", default="target/release/examples/bare_relay",
                   help="bare byte relay (the floor of any hop); '' to skip")
    p.add_argument("--baseline", default="",
                   help="a second moongate binary (e.g. an earlier commit's release build) "
                        "run side by side with the same config, to compare two builds in "
                        "one run")
    p.add_argument("--baseline-config", default=None,
                   help="config file for the baseline (default: --moongate-config); with "
                        "--baseline set to the same binary this compares two configs, e.g. "
                        "KV events on against off")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--json", help="write the summary here")
    a = p.parse_args()
    if a.role == "owner":
        return role_owner(a)
    if a.role == "client":
        return role_client(a)

    work = work_dir("moongate-bench-")
    rpc, http, listen, admin, relay, b_listen, b_admin = (free_port() for _ in range(7))
    metadata = f"http://127.0.0.1:{http}/metadata"
    procs = []
    try:
        procs.append(subprocess.Popen(
            master_cmd(rpc, http),
            stdout=open(f"{work}/master.log", "w"), stderr=subprocess.STDOUT))
        procs.append(subprocess.Popen(
            [a.moongate, "run"] + (["--config", a.moongate_config] if a.moongate_config else [])
            + ["--listen", f"127.0.0.1:{listen}",
             "--upstream", f"127.0.0.1:{rpc}", "--admin", f"127.0.0.1:{admin}"],
            stdout=open(f"{work}/moongate.log", "w"), stderr=subprocess.STDOUT,
            env={**os.environ, "RUST_LOG": "warn"}))
        if a.baseline:
            base_cfg = a.moongate_config if a.baseline_config is None else a.baseline_config
            procs.append(subprocess.Popen(
                [a.baseline, "run"]
                + (["--config", base_cfg] if base_cfg else [])
                + ["--listen", f"127.0.0.1:{b_listen}",
                   "--upstream", f"127.0.0.1:{rpc}", "--admin", f"127.0.0.1:{b_admin}"],
                stdout=open(f"{work}/baseline.log", "w"), stderr=subprocess.STDOUT,
                env={**os.environ, "RUST_LOG": "warn"}))
            wait_http(f"http://127.0.0.1:{b_admin}/ready")
        if a.relay:
            procs.append(subprocess.Popen(
                [a.relay, f"127.0.0.1:{relay}", f"127.0.0.1:{rpc}"],
                stdout=open(f"{work}/relay.log", "w"), stderr=subprocess.STDOUT))
        wait_http(f"http://127.0.0.1:{admin}/ready")
        owner = spawn_owner(__file__, f"127.0.0.1:{rpc}", metadata, work)
        procs.append(owner)

        sides = (["direct", "moongate"] + (["relay"] if a.relay else [])
                 + (["baseline"] if a.baseline else []))
        addr = {"direct": rpc, "moongate": listen, "relay": relay, "baseline": b_listen}
        runs = {side: [] for side in sides}
        for i in range(a.pairs):
            # rotate the order so no side always runs first (warm caches, clock drift)
            order = sides[i % len(sides):] + sides[:i % len(sides)]
            for side in order:
                target = f"127.0.0.1:{addr[side]}"
                out = f"{work}/{side}{i}.json"
                subprocess.run(
                    [sys.executable, __file__, "--role", "client", "--master", target,
                     "--metadata", metadata, "--out", out, "--tag", f"{side}{i}",
                     "--iterations", str(a.iterations)],
                    check=True, stderr=open(f"{work}/client-{side}{i}.log", "w"))
                runs[side].append(json.load(open(out)))
                print(f"pair {i + 1}/{a.pairs} {side} done", file=sys.stderr, flush=True)
        owner.stdin.close()
        owner.wait(timeout=30)
    finally:
        stop_all(procs)

    summary = {}
    print(f"\nmedians over {a.pairs} alternating runs per side")
    base = "baseline" in runs
    print(f"{'op':<18} {'metric':<7} {'direct':>9} {'relay':>9} {'moongate':>9} "
          f"{'mg/direct':>9} {'mg-direct':>10} {'mg-relay':>9}"
          + (f" {'baseline':>9} {'base-relay':>10} {'mg/base':>8}" if base else ""))
    for op in runs["direct"][0]:
        for metric in runs["direct"][0][op]:
            med = {side: statistics.median(r[op][metric] for r in runs[side]) for side in runs}
            d, m, rl = med["direct"], med["moongate"], med.get("relay", float("nan"))
            lat = metric.endswith("_us")
            unit = "GB/s" if metric == "GBps" else metric
            line = (f"{op:<18} {unit:<7} {d:>9.2f} {rl:>9.2f} {m:>9.2f} {m / d:>9.3f} "
                    + (f"{m - d:>+8.1f}us {m - rl:>+7.1f}us" if lat else " " * 20))
            if base:
                b = med["baseline"]
                line += (f" {b:>9.2f} " + (f"{b - rl:>+8.1f}us" if lat else " " * 10)
                         + f" {m / b:>8.3f}")
            print(line)
            summary[f"{op}.{metric}"] = {**med, "ratio": m / d}
    summary["_pairs"] = a.pairs
    summary["_iterations"] = a.iterations
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": summary, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    run(main)
